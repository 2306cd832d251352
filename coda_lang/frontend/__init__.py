"""The front end: .coda text -> a checked, typed block and its plan.

- syntax/: the grammar (lark; syntax only, ops are generic calls), parse.py, lowering to the IR
  (lower.py: the file's dims and blocks; scope.py: dims, shapes and types; blocks.py: blocks,
  stages and statements; exprs.py: expressions and op calls), and printer.py (IR -> .coda text that parses back to the same IR);
- verify/: the checker (check.py: names, dtypes, shapes, block-locality), a block's plan (plan.py:
  what each stage loads, stores and reduces), vectors that repeat (repeat.py), and the picture of a
  plan (draw.py, `coda draw`);
- source.py: the passes in order (`check_source`), `CheckedBlock` (what every later layer takes) and
  `check_generated` (a block a pass made, checked without printing it).

Below it: core/ (diagnostics), ir/ (types, nodes), ops/ (the registry). Nothing here imports NumPy
or torch: `coda check` runs on the front end alone.
"""
