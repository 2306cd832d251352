"""Lower a lark parse tree to the IR: resolve names, ops and dims; flatten expressions to SSA.

What it does: `lower` turns each block of the tree into an `ir.Block` whose statements are flat
equations (one op each, temporaries named `_tN`) and stages; params and outputs get their declared
types; every node gets a span. Name errors (E02) and shape-expression errors (E0409) are reported
here. The jobs, one module each: lower.py (the entry: the file's dims and blocks), scope.py
(`ProgramScope`: the file's dims, shape expressions, dtypes and types), blocks.py (a block: its
scope, signature, stages and statements), exprs.py (an expression: operators, op calls and their
parameters, decompositions, names).
What it does not: type the body or check locality (frontend/verify/ does); it never looks at kinds.
Invariants: a name is bound once per block (E0202 otherwise); a failed name becomes an `ErrAtom`,
so one mistake gives one diagnostic; temporaries never collide with user names; a dim or block is
declared once per file (E0209), an unknown dim or bad shape reported once per file.
"""

from __future__ import annotations

from typing import Any

from coda_lang.core.diagnostics import Diagnostic
from coda_lang.frontend.syntax.blocks import BlockLowerer
from coda_lang.frontend.syntax.parse import span_of
from coda_lang.frontend.syntax.scope import ProgramScope
from coda_lang.ir.nodes import Block, DimDecl, Program, Span


def lower(tree: Any, file: str, diags: list[Diagnostic]) -> Program:
    """The program of a parse tree (parse.py's), its diagnostics appended to `diags`: the dims it
    declares (into a ProgramScope), then each block (blocks.BlockLowerer, which asks the scope for
    shapes and types)."""
    scope = ProgramScope(file, diags)
    blocks: list[Block] = []
    seen_blocks: dict[str, Span] = {}
    for item in tree.children:
        if item.data == "dims_decl":
            for d in item.children:
                name = str(d.children[0])
                value = int(d.children[1]) if d.children[1] is not None else None
                if name in scope.dims:
                    scope.error(
                        "E0209",
                        f"dim `{name}` is declared twice",
                        d,
                        related=[(scope.dims[name].span, "first declared here")],
                    )
                    continue
                if value is not None and value <= 0:
                    scope.error("E0409", f"dim `{name}` must be positive, got {value}", d)
                scope.dims[name] = DimDecl(name, value, span_of(scope.file, d))
        elif item.data == "block":
            b = BlockLowerer(scope, item).lower()
            if b.name in seen_blocks:
                scope.error(
                    "E0209",
                    f"block `{b.name}` is defined twice",
                    item.children[0],
                    related=[(seen_blocks[b.name], "first defined here")],
                )
                continue
            seen_blocks[b.name] = b.span
            blocks.append(b)
        elif item.data == "stray_stmt":
            scope.error(
                "E0105",
                "statement outside a block",
                item,
                label="statements go inside `block name(...) -> (...) { ... }`",
            )
    if not blocks and not any(d.code.startswith("E01") for d in scope.diags):
        # Point at the last thing the file does hold (not at a leading comment), if anything.
        last = span_of(scope.file, tree.children[-1]) if tree.children else Span(scope.file, 1, 1, 1, 2)
        scope.diags.append(
            Diagnostic(
                "E0106",
                "no block in the file",
                last,
                label="the file ends after this" if tree.children else "",
                help=["a file holds `dims ...` and one or more `block name(...) -> (...) { ... }`"],
            )
        )
    return Program(tuple(scope.dims.values()), tuple(blocks), scope.file)
    return Program(tuple(scope.dims.values()), tuple(blocks), scope.file)
