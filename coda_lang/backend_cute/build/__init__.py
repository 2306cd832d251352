"""(package docstring: filled in below)"""
