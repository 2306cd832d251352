"""The front end as one function: text -> parse -> lower -> check, collecting every diagnostic.

What it does: `check_source` runs the passes in order and returns the typed program, the plan of
each block and the diagnostics (sorted by position); `load` wraps that for the Python API.
What it does not: run, differentiate or compile anything (interp/, autodiff/, backend_cute/).
Invariants: never raises for any text (a diagnostic instead); the typed program is returned only
when there are no errors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from coda_lang.core.diagnostics import Diagnostic
from coda_lang.frontend.syntax.lower import lower
from coda_lang.frontend.syntax.parse import parse
from coda_lang.frontend.verify.check import check_block
from coda_lang.frontend.verify.plan import BlockPlan
from coda_lang.ir.nodes import Block, Program, Span


def _pos(d: Diagnostic) -> tuple[int, int]:
    return (d.span.line, d.span.col) if d.span else (0, 0)


def check_source(
    text: str, file: str = "<string>"
) -> tuple[Program | None, dict[str, BlockPlan], list[Diagnostic]]:
    text = normalize_newlines(text)
    tree, err = parse(text, file)
    if err is not None:
        return None, {}, [err]
    deep = too_deep(tree, file)
    if deep is not None:
        return None, {}, [deep]
    diags: list[Diagnostic] = []
    prog = lower(tree, file, diags)
    plans: dict[str, BlockPlan] = {}
    blocks: list[Block] = []
    for b in prog.blocks:
        typed, plan = check_block(b, diags)
        blocks.append(typed)
        plans[b.name] = plan
    diags.sort(key=_pos)
    if diags:
        return None, plans, diags
    return Program(prog.dims, tuple(blocks), file), plans, diags


def normalize_newlines(text: str) -> str:
    """CRLF and lone CR line endings as LF: a file and the same text given as a string mean the same
    (Python's text-mode files already read them so)."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


MAX_DEPTH = 100  # nesting of one expression: far beyond what a program writes, far below the stack's limit


def too_deep(tree: Any, file: str) -> Diagnostic | None:
    """E0108 at the first expression nested more than MAX_DEPTH levels deep (lowering is recursive),
    found without recursion."""
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        children = getattr(node, "children", None)
        if children is None:
            continue
        if depth > MAX_DEPTH:
            meta = node.meta
            span = Span(
                file,
                getattr(meta, "line", 1),
                getattr(meta, "column", 1),
                getattr(meta, "end_line", 1),
                getattr(meta, "end_column", 1),
            )
            return Diagnostic(
                "E0108",
                f"an expression nested more than {MAX_DEPTH} levels deep",
                span,
                label="nested too deeply here",
                help=["give parts of it names: `t = ...` on lines of their own"],
            )
        stack.extend((c, depth + 1) for c in children if c is not None)
    return None


def read_source(path_or_text: str | os.PathLike[str]) -> tuple[str, str]:
    """(text, file name): a path-like or a string naming an existing file is read, other strings are source."""
    if isinstance(path_or_text, os.PathLike):
        p = Path(path_or_text)
        return p.read_text(), str(p)
    s = str(path_or_text)
    if "\n" not in s and "{" not in s and (s.endswith(".coda") or _is_file(s)):
        return Path(s).read_text(), s
    return s, "<string>"


def _is_file(s: str) -> bool:
    try:
        return Path(s).is_file()
    except (OSError, ValueError):  # e.g. a long line of text: "File name too long"
        return False
