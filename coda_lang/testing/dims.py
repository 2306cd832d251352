"""Random sizes for a block's symbolic dims, and random tiles for the interpreter's tile simulation.

What it does: `dim_units(blocks, align)` works out, for each dim X of a block, the step its size must
be a multiple of so that every extent `c*X` in the block (parameters, outputs, stage values, acc,
`F/2` after `pairs`, `W/g` of a grouped reduction) is a positive integer, every width a vector over a
fixed dim G repeats across a multiple of G, and, with `align > 1`, a
multiple of `align` (the CUDA backend's TMA loads need rows of 16 bytes: align 8 for bf16).
`dim_sizes(blocks, max_dim, align)` is a hypothesis strategy of {dim: size} (fixed dims keep their
value) that shrinks towards the smallest sizes. `tile_unit(blocks)` and `tiles(blocks, ...)` do the
same for `Block.run(..., sim_tile=(tile_M, tile_N))`: tile_N must be even in a stage that works on
column pairs and must hold whole groups (`interp/run.py`, `check_tile`).
What it does not: look at values (inputs.py) or make programs (programs.py).
Invariants: every size drawn here binds without error (`Block.run(dims=...)`), for every block given
(pass a block's derived forward and backward blocks too when the backward runs at the same sizes).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from fractions import Fraction
from typing import Any

from hypothesis import strategies as st

from coda_lang.frontend.verify.repeat import repeat_uses
from coda_lang.ir.nodes import Block, Stage, Var
from coda_lang.ir.types import GROUP, MATRIX, TILE, Dim


def _ir(b: Any) -> Block:
    return b.ir if hasattr(b, "ir") else b


def _vars(block: Block) -> Iterator[Var]:
    for p in block.params:
        yield p.var
    for s in block.body:
        if isinstance(s, Stage):
            if s.acc is not None:
                yield s.acc
            for e in s.body:
                yield from e.outs
        else:
            yield from s.outs


def block_dims(blocks: Iterable[Any]) -> Iterator[Dim]:
    """Every extent (a `Dim`) that appears in the blocks' types and stage shapes."""
    for b in blocks:
        ir = _ir(b)
        for v in _vars(ir):
            if v.type is not None:
                yield from v.type.shape
                if v.type.kind == GROUP and v.type.group and len(v.type.shape) == 2:
                    yield v.type.shape[1].scale(v.type.group)  # the width the groups come from
        for o in ir.outputs:
            yield from o.type.shape
        for s in ir.stages:
            if s.shape is not None:
                yield from s.shape


def dim_units(blocks: Iterable[Any], align: int = 1) -> dict[str, int]:
    """{dim: the step its size must be a multiple of} (1 for a dim no coefficient constrains)."""
    blocks = list(blocks)
    units = {d.name: 1 for b in blocks for d in _ir(b).dims}
    need = [(d, align) for d in block_dims(blocks)]
    fixed = fixed_dims(blocks)
    for b in blocks:  # a vector over G repeating across W columns: W a multiple of G's size
        for u in repeat_uses(_ir(b)):
            g = u.over.evaluate(fixed)
            if g.denominator == 1 and g > 0:
                need.append((u.width, int(g)))
    for d, a in need:
        if d.name is None:
            continue
        p, q = d.coeff.numerator, d.coeff.denominator
        step = q * a // math.gcd(p, a)  # (p/q) * (step * t) is a multiple of a for every t
        units[d.name] = math.lcm(units.get(d.name, 1), step)
    return units


def _stage_cols(s: Stage) -> Dim | None:
    if s.acc is not None and s.acc.type is not None:
        return s.acc.type.shape[1]
    return s.shape[1] if s.shape is not None else None


def fixed_dims(blocks: Iterable[Any]) -> dict[str, int]:
    """Dims the program fixes (`dims HD = 128`)."""
    return {d.name: d.value for b in blocks for d in _ir(b).dims if d.value is not None}


def dim_sizes(
    blocks: Any, max_dim: int = 64, align: int = 1, given: dict[str, int] | None = None
) -> st.SearchStrategy[dict[str, int]]:
    """{dim: size} for the blocks' dims: a multiple of its unit (`dim_units`), at most `max_dim` (or
    one unit when the unit is larger), shrinking towards the smallest; `given` sizes are kept as they
    are. `blocks`: a Block or several."""
    blocks = [blocks] if not isinstance(blocks, (list, tuple)) else list(blocks)
    units = dim_units(blocks, align)
    fixed = {**fixed_dims(blocks), **(given or {})}
    parts: dict[str, st.SearchStrategy[int]] = {}
    for name, u in units.items():
        if name in fixed:
            parts[name] = st.just(fixed[name])
        else:
            parts[name] = _multiples(u, max_dim)
    return st.fixed_dictionaries(parts)


def _multiples(unit: int, top: int) -> st.SearchStrategy[int]:
    """Multiples of `unit` up to `top` (at least one unit), shrinking towards `unit`."""
    return st.integers(1, max(1, top // unit)).map(lambda k: k * unit)


def tile_unit(blocks: Iterable[Any]) -> int:
    """The step tile_N must be a multiple of in every stage of the blocks: 2 where a stage has tiles of
    another width than its own (made by pairs or interleave, or loaded: a half-width tile needs an
    even tile_N), and whole groups for grouped reductions."""
    unit = 1
    for b in blocks:
        for s in _ir(b).stages:
            cols = _stage_cols(s)
            if cols is None:
                continue
            for e in s.body:
                for v in e.outs + tuple(a for a in e.ins if isinstance(a, Var)):
                    t = v.type
                    if t is None or len(t.shape) != 2:
                        continue
                    if t.kind in (TILE, MATRIX) and t.shape[1] != cols:  # (a loaded tile's type is a matrix)
                        unit = math.lcm(unit, 2)
                    if t.kind == GROUP and t.group and t.group_axis == 1:
                        ratio = Fraction(t.shape[1].coeff * t.group) / Fraction(cols.coeff)
                        unit = math.lcm(unit, _group_step(ratio, t.group))
    return unit


def _group_step(ratio: Fraction, group: int) -> int:
    """The smallest n with (n * ratio) % group == 0 (interp.run.check_tile's test)."""
    n = 1
    while (n * ratio) % group:
        n += 1
    return n


def row_unit(blocks: Iterable[Any]) -> int:
    """The step tile_M must be a multiple of in every stage of the blocks: whole groups of rows for
    grouped reductions along the rows (`over=M, group=g`: a g x 1 group, e.g. a requantizing stage's)."""
    unit = 1
    for b in blocks:
        for s in _ir(b).stages:
            for e in s.body:
                for v in e.outs:
                    t = v.type
                    if t is not None and t.kind == GROUP and t.group and t.group_axis == 0:
                        unit = math.lcm(unit, t.group)
    return unit


def tiles(blocks: Any, max_tile: int = 16) -> st.SearchStrategy[tuple[int, int]]:
    """(tile_M, tile_N) for `Block.run(sim_tile=...)`: small tiles (at most `max_tile`, tile_N a multiple
    of `tile_unit`, tile_M of `row_unit`: whole groups of rows, where one holds more than `max_tile`)
    so that small matrices still have several, ragged, tiles."""
    blocks = [blocks] if not isinstance(blocks, (list, tuple)) else list(blocks)
    u, r = tile_unit(blocks), row_unit(blocks)
    return st.tuples(_multiples(r, max_tile), _multiples(u, max_tile))
