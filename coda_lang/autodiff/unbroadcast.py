"""Unbroadcasting: a cotangent of a broadcast use of a value, as a cotangent of the value itself.

What it does: a VJP rule returns, for each operand, a cotangent of the operand *as the equation used
it* (its logical type: a row vector used in a tile is, logically, a tile). These functions turn such
a contribution into one of the value's own type, from the logical type it carries:
- `in_stage`: to a value of the site's own stage (a group broadcast over its columns: summed per
  group, or multiplied by the group's width where its columns are equal);
- `outside`: to a vector or scalar from outside the site, broadcast in it: partial sums in the site
  (a row vector: sums over columns; a column vector: over rows; a scalar: sums over columns, then
  their sum over rows between stages; a vector over G that repeats across the columns: sums over
  rows, then `fold(..., into=G)` between stages), or, for a contribution that is a complete vector
  already, `complete` between stages;
- `complete`: between stages, a complete vector or scalar standing for a value of some logical type
  as the cotangent of a vector or scalar: a sum over the axes it has and the target lacks, times the
  extent of the axes neither has (each element of the target received it that many times); for a
  target over G that repeated across the logical type's columns W, that cotangent over W folded
  into G (or a scalar's, times W/G);
- `row_sums`: partial sums over a tile's columns, square tiles included.
What it does not: broadcast (a vector to a tile is the site's `fill`, passed in where needed), or
decide where a contribution goes (site.py and reverse.py do).
Invariants: every function emits through the builder it is given and returns a contribution whose
type is the target's (a scalar may stand for a vector whose elements are equal); `Later` functions
run between stages, after the site that made them is closed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from coda_lang.autodiff.builder import AutodiffError, Builder
from coda_lang.ir.nodes import Atom, DimRef, Var
from coda_lang.ir.types import GROUP, SCALAR, TILE, VEC, Dim, Type

Part = tuple[Atom, Type]  # a cotangent contribution, and the logical type of the value it is the cotangent of
Fill = Callable[[Atom, Type], Atom]  # a vector, scalar or group as a tile of the given type (the site's)
Later = Callable[[Builder], Atom]  # a contribution completed between stages


def same_shape(a: Type, b: Type) -> bool:
    """Whether two types are of one kind, shape and grouping (dtypes aside)."""
    return (a.kind, a.shape, a.group) == (b.kind, b.shape, b.group)


def in_stage(b: Builder, c: Atom, logical: Type, target: Type, fill: Fill) -> Part:
    """A cotangent contribution of logical type `logical` (the broadcast operand of the op that made it)
    as a contribution to the in-site value of type `target`: a group broadcast over its columns sums
    them, a vector made from indices keeps the broadcast form."""
    if same_shape(logical, target):
        return c, target
    if target.kind == GROUP and logical.kind == TILE:  # a group broadcast over its columns: sum each group
        g = target.group
        assert g is not None and b.stage is not None
        t = b.type_of(c)
        if t.kind == TILE:
            return b.sum_over(c, t.shape[1], group=g), target
        if t.kind in (GROUP, SCALAR) or (t.kind == VEC and t.shape[0] == b.stage.rows):
            return b.mul(c, b.lit(g)), target  # g equal columns per group
        return b.sum_over(fill(c, logical), logical.shape[1], group=g), target
    if target.kind in (VEC, SCALAR):  # a vector made from indices: its cotangent keeps the broadcast form
        return c, logical
    raise AutodiffError(
        "E0601",
        f"autodiff can't turn a cotangent of a {logical} into one of a {target}",
        b.span,
        notes=["this is a bug in coda_lang's autodiff; please report it"],
    )


def outside(b: Builder, parts: list[Part], target: Type, fill: Fill) -> tuple[list[Atom], list[Later]]:
    """Cotangents of a vector or scalar (`target`) from outside the site, broadcast in it: (the partial
    sums made in the site now; what completes between stages: a contribution that is a complete
    vector already, or the sum over rows of a scalar's partial row sums)."""
    now: list[Atom] = []
    later: list[Later] = []
    tiles: dict[tuple[object, ...], Atom] = {}
    for c, logical in parts:
        t = b.type_of(c)
        if t.kind in (VEC, SCALAR) and not (isinstance(c, Var) and c.name in b.local):
            later.append(functools.partial(complete, c=c, logical=logical, target=target))
            continue
        if t.kind in (VEC, SCALAR):
            c = fill(c, logical)
            t = b.type_of(c)
        key = (t.kind, t.shape, t.group)  # tiles of one shape add; each shape is reduced on its own
        tiles[key] = b.add(tiles[key], c) if key in tiles else c
    for c in tiles.values():
        t = b.type_of(c)
        if target.kind == VEC and t.kind == TILE and target.shape[0] not in t.shape:
            # a vector over G that repeated across the tile's columns: column sums, folded into G after
            # the stage
            part = b.sum_over(c, t.shape[0])
            later.append(functools.partial(fold, a=Var(part.name), into=target.shape[0]))
        elif target.kind == VEC:
            rows = t.kind == GROUP or (target.shape[0] == t.shape[0] and target.shape[0] != t.shape[1])
            part = b.sum_over(c, t.shape[1] if rows else t.shape[0])
            now.append(Var(part.name))
        else:  # a scalar: partial row sums here, their sum between stages
            part = row_sums(b, c)
            later.append(functools.partial(Builder.sum_over, a=Var(part.name), over=t.shape[0]))
    return now, later


def row_sums(b: Builder, c: Atom) -> Var:
    """Partial sums over the columns of a tile. A square tile's columns can't be named by their extent:
    a double-width one is summed as the two halves of its column pairs, another one interleaved
    with zeros (twice as wide, so no longer square)."""
    t = b.type_of(c)
    assert b.stage is not None
    if t.kind == TILE and t.shape[0] == t.shape[1]:
        if t.shape[1] == b.stage.cols.scale(2):
            lo, hi = b.ops("pairs", c)
            c = b.add(lo, hi)
        else:
            c = b.op("interleave", c, b.lit(0.0))
        t = b.type_of(c)
    return b.sum_over(c, t.shape[1])


def fold(b: Builder, a: Atom, into: Dim) -> Atom:
    """Between stages: the cotangent of a vector over `into` that repeated across the columns `a` is
    the cotangent of (a vector over them): each element's copies summed."""
    return b.op("fold", a, into=into)


def complete(b: Builder, c: Atom, logical: Type, target: Type) -> Atom:
    """Between stages: a complete vector or scalar `c` that stood for a value of type `logical`, as the
    cotangent of `target`: sums over the axes `c` has and `target` lacks, times the extent of the axes
    neither has (each element of `target` received `c` that many times). A target over G that
    repeated across the columns W of `logical` (G is none of its axes) takes the cotangent of a
    vector over W, folded into G (a scalar standing for equal elements: times W/G)."""
    if target.kind == VEC and logical.shape and target.shape[0] not in logical.shape:
        wide = logical.shape[-1]
        c = complete(b, c, logical, Type(target.dtype, (wide,), VEC))
        if b.type_of(c).kind == VEC:
            return fold(b, c, target.shape[0])
        return b.mul(c, b.div(DimRef(wide), DimRef(target.shape[0])))
    t = b.type_of(c)
    axes = (
        {"rows": logical.shape[0], "cols": logical.shape[1]}
        if len(logical.shape) == 2
        else {"rows": logical.shape[0]}
        if logical.shape
        else {}
    )

    def axis(d: Dim) -> str:
        return "rows" if axes.get("rows") == d else "cols"

    have = axis(t.shape[0]) if t.kind == VEC else None
    want = axis(target.shape[0]) if target.kind == VEC else None
    if have is not None and have != want:
        c = b.sum_over(c, t.shape[0])
    for ax, d in axes.items():
        if ax not in (have, want):
            c = b.mul(c, DimRef(d))
    return c
