"""The IR: dtypes, symbolic dims, value types and tile constraints (types.py), and frozen, flat SSA
nodes with a source span each (nodes.py). The printer lives beside the syntax (frontend/syntax)."""
