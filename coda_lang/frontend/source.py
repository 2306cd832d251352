"""The front end as one function: text -> parse -> lower -> check, collecting every diagnostic.

What it does: `check_source` runs the passes in order and returns the typed program, the plan of
each block and the diagnostics (sorted by position); `api.load` wraps that for the Python API.
`CheckedBlock` is a block that checked (typed IR and plan), what every later layer takes;
`check_generated` checks a block a pass made (autodiff's backward, the chunker's rewrite) directly,
without printing and parsing it.
What it does not: run, differentiate or compile anything (interp/, autodiff/, backend_cute/).
Invariants: `check_source` never raises for any text (a diagnostic instead); the typed program is
returned only when there are no errors; a CheckedBlock's `str()` is .coda source that loads back to
an equal block.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from coda_lang.core.diagnostics import Diagnostic, error
from coda_lang.frontend.syntax.lower import lower
from coda_lang.frontend.syntax.parse import parse
from coda_lang.frontend.syntax.printer import print_block
from coda_lang.frontend.verify.check import check_block
from coda_lang.frontend.verify.plan import BlockPlan, explain
from coda_lang.ir.nodes import Block, Program, Span, Stage, Var


class CheckedBlock:
    """A block that checked: `ir` is its typed IR, `plan` what each stage loads, stores and reduces.
    `coda_lang.Block` (api.py) is one, with the interpreter, autodiff and the backends on top."""

    def __init__(self, ir: Block, plan: BlockPlan):
        self.ir = ir
        self.plan = plan

    @property
    def name(self) -> str:
        return self.ir.name

    def explain(self) -> str:
        return explain(self.plan)

    def __str__(self) -> str:
        return print_block(self.ir)

    def __repr__(self) -> str:
        return f"<coda Block {self.name}: {len(self.plan.stages)} stages>"


def check_generated(block: Block, what: str, origin: Span | None = None) -> CheckedBlock:
    """`block`, made by a pass (`what` names it), checked; CodaError E0601 (a bug in coda_lang, with
    the first diagnostics as notes) when it does not check. `origin`: the user's source it came from."""
    diags: list[Diagnostic] = []
    typed, plan = check_block(block, diags)
    # (the parser's E0201 and E0205, which a block made by a pass never went through: a value read
    # before anything defines it, an output nothing assigns)
    defined = {p.var.name for p in block.params}

    def read(x: Any, inside: set[str], span: Span | None) -> None:
        if isinstance(x, Var) and x.name not in inside:
            diags.append(Diagnostic("E0201", f"`{x.name}` is read before anything defines it", span))

    for item in block.body:
        inside = set(defined)  # (and, within a stage, its acc and what its equations define)
        if isinstance(item, Stage):
            if item.acc is not None:
                inside.add(item.acc.name)
            for x in item.operands:
                read(x, inside, block.span)
        for e in item.body if isinstance(item, Stage) else (item,):
            for x in e.ins:
                read(x, inside, e.span)
            inside.update(v.name for v in e.outs)
            defined.update(v.name for v in e.outs)
    for o in block.outputs:
        if o.name not in defined:
            diags.append(Diagnostic("E0205", f"output `{o.name}` is never assigned", o.span))
    if diags:
        notes = [x.short() for x in diags[:5]] + ["this is a bug in coda_lang; please report it"]
        raise error("E0601", f"{what} `{block.name}` does not check", origin, notes=notes)
    return CheckedBlock(typed, plan)


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
