"""The checker and what it finds out about a block: types, shapes and block-locality (check.py), the
plan of each stage (plan.py), vectors that repeat across columns (repeat.py), and the plan drawn as
SVG (draw.py)."""
