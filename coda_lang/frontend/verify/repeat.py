"""Vectors that repeat across columns: where a checked block uses them, and the run-time size check.

What it does: a vector over a dim of fixed size G used on a tile of another width W (or expanded to a
longer vector) repeats: column c of what it meets reads element c mod G (docs/language.md, "Vectors
that repeat"). `repeated(e, rows, cols)` gives, for one typed equation, the operands that repeat and
the width they meet; `repeat_uses(block)` lists every such use of a block (and every `fold(x, into=G)`, its adjoint, whose
vector must hold whole runs of G values too); `check_repeats` raises
E0802 when the sizes a run binds make a width that is not a multiple of G (the checker says E0410
where it knows both sizes).
What it does not: decide whether a use is valid (the type rules did), or compute anything (each
executor repeats the vector itself: the interpreter per tile, the CUDA runtime on the host).
Invariants: only ops of locality POINTWISE and PAIR take a repeating operand (reductions, pick
and the pair splitter need tiles); the width of an equation is that of its result (half of it for
interleave, a JOIN of lanes, whose operands are half as wide as its result).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from coda_lang.core.diagnostics import error
from coda_lang.ir.nodes import Block, Eqn, Span, Stage, Var
from coda_lang.ir.types import PARTIAL, TILE, VEC, Dim
from coda_lang.ops import REGISTRY, Lanes, Locality
from coda_lang.ops.registry import repeats_in


def width_of(e: Eqn, rows: Dim | None) -> Dim | None:
    """The column extent a pointwise (or pair) equation computes at: its result's width (a tile's
    columns, or a vector's length when it is not a row vector), half of it for interleave."""
    op = REGISTRY[e.op]
    if not op.locality.per_element or not e.outs:
        return None
    t = e.outs[0].type
    if t is None or t.is_error:
        return None
    if t.kind == TILE and len(t.shape) == 2:
        w = t.shape[1]
        return w.scale(Fraction(1, 2)) if op.lanes is Lanes.JOIN else w
    if t.kind == VEC and t.shape and (rows is None or t.shape[0] != rows):
        return t.shape[0]
    return None


def repeated(e: Eqn, rows: Dim | None = None, cols: Dim | None = None) -> list[tuple[int, Dim, Dim]]:
    """(operand position, G, W) of each operand of `e` that is a vector over G repeating across W
    columns; `rows`, `cols`: the tile space of the stage `e` is in (None between stages)."""
    w = width_of(e, rows)
    if w is None:
        return []
    out = []
    for i, a in enumerate(e.ins):
        t = a.type if isinstance(a, Var) else None
        if t is None or t.kind not in (VEC, PARTIAL) or len(t.shape) != 1:
            continue
        d = t.shape[0]
        if d != w and repeats_in(d, rows, cols):
            out.append((i, d, w))
    return out


@dataclass(frozen=True)
class RepeatUse:
    name: str  # the vector
    over: Dim  # G
    width: Dim  # W
    span: Span
    stage: int  # 1-based; 0 between stages
    fold: bool = False  # `fold(name, into=G)` of a vector over W (its adjoint: the same sizes)

    @property
    def sizes(self) -> tuple[tuple[str | None, int, int], tuple[str | None, int, int]]:
        """G and W as (dim, numerator, denominator): plain ints (a runtime traced by torch.compile
        checks them without touching a Fraction)."""
        g, w = self.over, self.width
        return (
            (g.name, g.coeff.numerator, g.coeff.denominator),
            (w.name, w.coeff.numerator, w.coeff.denominator),
        )


def repeat_uses(block: Block) -> list[RepeatUse]:
    """Every use of a repeating vector in a checked block, in program order."""
    uses: list[RepeatUse] = []
    k = 0
    for s in block.body:
        if isinstance(s, Stage):
            k += 1
            if s.acc is not None and s.acc.type is not None:
                rows, cols = s.acc.type.shape
            else:
                assert s.shape is not None
                rows, cols = s.shape
            for e in s.body:
                for i, g, w in repeated(e, rows, cols):
                    a = e.ins[i]
                    assert isinstance(a, Var)
                    uses.append(RepeatUse(a.name, g, w, e.span, k))
        else:
            for i, g, w in repeated(s):
                a = s.ins[i]
                assert isinstance(a, Var)
                uses.append(RepeatUse(a.name, g, w, s.span, 0))
            x, into = (s.ins[0] if s.ins else None), s.param("into")
            if REGISTRY[s.op].locality is Locality.VECTOR and isinstance(x, Var) and isinstance(into, Dim):
                assert x.type is not None
                uses.append(RepeatUse(x.name, into, x.type.shape[0], s.span, 0, fold=True))
    return uses


def check_repeats(uses: list[RepeatUse], dims: dict[str, Any]) -> None:
    """E0802 when, at these dims, a repeating vector meets a width that is not a multiple of its length
    (so its last copy would be cut)."""

    for u in uses:
        (gn, gp, gq), (wn, wp, wq) = u.sizes
        g = (dims[gn] if gn is not None else 1) * gp // gq
        w = (dims[wn] if wn is not None else 1) * wp // wq
        if (g <= 0 or w % g) and u.fold:
            raise error(
                "E0802",
                f"`fold({u.name}, into={u.over})` (line {u.span.line}): `{u.name}` has `{u.width}` = {w} "
                f"values, not a multiple of `{u.over}` = {g}",
                notes=["fold adds up the vector's runs of G values: choose sizes that hold whole runs"],
            )
        if g <= 0 or w % g:
            where = f"stage {u.stage}" if u.stage else "between stages"
            raise error(
                "E0802",
                f"`{u.name}` (over `{u.over}`, {g} values) repeats across `{u.width}` = {w} columns "
                f"({where}, line {u.span.line}): not a multiple of {g}",
                notes=[
                    "column c reads element c mod the vector's length: choose sizes that hold whole copies"
                ],
            )
