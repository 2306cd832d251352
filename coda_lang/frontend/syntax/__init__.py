"""Syntax: parse (lark, with positions), lower the parse tree to the IR, print the IR back as .coda
source (see lower.py for the lowering's three modules)."""
