"""The NumPy reference interpreter: the executable spec every other path is tested against.

What it does: runs a checked block on NumPy arrays. GEMMs accumulate in f32 (float64 in the "f64"
precision); epilogues run vectorized over whole matrices (whole mode) or tile by tile (tile mode);
every op is computed by its registry `impl`. A tile used after its stage is rounded to its storage
dtype when the stage ends, so later stages read the rounded value while its own stage used the f32 one.
What it does not: check the program (frontend/verify/ did) or validate inputs (inputs.py does).
Invariants: in tile mode each partial reduction is computed per tile into a buffer shaped like a
kernel's (row partials [rows, ceil(cols/tile_N)], column partials [ceil(rows/tile_M), cols]) and then
combined with its op's combine rule; whole and tile modes agree up to floating-point reassociation.
The simulated tile (`run_block(sim_tile=)`, `Block.run(sim_tile=)`) is one (tile_M, tile_N) for
every stage, or a dict {stage index (1-based): (tile_M, tile_N)} (a kernel chooses its tile per
stage; a stage missing from the dict runs in whole mode).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from coda_lang.core.diagnostics import error
from coda_lang.core.numerics import compute_dtype, round_to, to_storage
from coda_lang.frontend.verify.plan import BlockPlan
from coda_lang.frontend.verify.repeat import check_repeats, repeat_uses, repeated
from coda_lang.interp.inputs import check_sizes
from coda_lang.ir.nodes import Atom, Block, DimRef, Eqn, Lit, Stage, Var
from coda_lang.ir.types import ERROR_TYPE, GROUP, MATRIX, PARTIAL, TILE, Dim, Type, extent
from coda_lang.ops import REGISTRY, Locality, StageShape, grouped_reads
from coda_lang.ops.registry import combine_rule, repeats_in


def combine(buf: np.ndarray, rule: str, axis: int) -> np.ndarray:
    """Combine per-tile partials along `axis` by the combine record named `rule` (ops.COMBINES)."""
    return np.asarray(combine_rule(rule).numpy(buf, axis))


@dataclass
class _Tile:
    """Where the current tile sits in the stage's acc space (whole mode: the whole matrix)."""

    rows: Dim
    cols: Dim
    r0: int
    r1: int
    c0: int
    c1: int

    def col_slice(self, width: Dim) -> slice:
        ratio = width.coeff / self.cols.coeff
        return slice(int(self.c0 * ratio), int(self.c1 * ratio))


def _type_or_none(a: Any) -> Type | None:
    return a.type if isinstance(a, Var) else None


def _type(a: Atom) -> Type:
    return a.type if isinstance(a, Var) and a.type is not None else ERROR_TYPE


Tiles = tuple[int, int] | dict[int, tuple[int, int]] | None


class Interpreter:
    def __init__(
        self,
        block: Block,
        plan: BlockPlan,
        dims: dict[str, int],
        precision: str = "exact",
        tile: Tiles = None,
    ):
        self.block, self.plan, self.dims, self.precision, self.tile = block, plan, dims, precision, tile
        self.partials: dict[str, np.ndarray] = {}

    def cdtype(self, t: Type) -> np.dtype[Any]:
        return compute_dtype(t.dtype if t.dtype != "<error>" else "f32", self.precision)

    # ------------------------------------------------------------------ block

    def run(self, env: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.env = dict(env)
        for s in self.block.body:
            if isinstance(s, Stage):
                self.stage(s)
            else:
                vals = [self.block_value(a) for a in s.ins]
                for v, x in zip(s.outs, self.apply(s, vals, None), strict=True):
                    self.store(v.name, x, v.annot)
        return {o.name: self.output(o.name, o.type.dtype) for o in self.block.outputs}

    def store(self, name: str, x: Any, dtype: str | None) -> None:
        """`name` computed as `x`, rounded to `dtype` where it is stored in one (None: kept as it is)."""
        self.env[name] = round_to(x, dtype, self.precision) if dtype else x

    def output(self, name: str, dtype: str) -> np.ndarray:
        """The block's output `name` in its declared dtype."""
        return to_storage(self.env[name], dtype, self.precision)

    def literal(self, a: Atom) -> Any:
        if isinstance(a, Lit):
            return a.value
        assert isinstance(a, DimRef)
        return extent(a.dim, self.dims)

    def block_value(self, a: Atom) -> Any:
        if isinstance(a, Var):
            return self.env[a.name]
        return self.literal(a)

    # ------------------------------------------------------------------ stages

    def stage(self, s: Stage) -> None:
        acc: np.ndarray | None = None
        if s.is_gemm:
            assert (
                isinstance(s.a, Var) and isinstance(s.b, Var) and s.acc is not None and s.acc.type is not None
            )
            acc = self.gemm(s)
            rows, cols = s.acc.type.shape
            R, C = acc.shape
        else:  # an elementwise stage: the tile space of a matrix, no GEMM
            assert s.shape is not None
            rows, cols = s.shape
            R, C = extent(rows, self.dims), extent(cols, self.dims)
        k = self.block.stages.index(s)
        stores = {st.name: st.dtype for st in self.plan.stages[k].stores}
        tile = self.tile.get(k + 1) if isinstance(self.tile, dict) else self.tile
        if tile is None:
            tiles = [(0, R, 0, C)]
            tm, tn = R, C
        else:
            tm, tn = tile
            self.check_tile(s, rows, cols, tile)
            tiles = [(i, min(i + tm, R), j, min(j + tn, C)) for i in range(0, R, tm) for j in range(0, C, tn)]
        n_rt, n_ct = -(-R // tm), -(-C // tn)
        results: dict[str, np.ndarray] = {}
        bufs: dict[str, tuple[np.ndarray, str, int]] = {}
        for r0, r1, c0, c1 in tiles:
            t = _Tile(rows, cols, r0, r1, c0, c1)
            senv: dict[str, Any] = {"acc": acc[r0:r1, c0:c1]} if acc is not None else {}
            for e in s.body:
                grouped = bool(grouped_reads((e,), StageShape(rows, cols), _type_or_none))
                vals = [self.stage_value(a, senv, t, i == 0 and grouped) for i, a in enumerate(e.ins)]
                outs = self.apply(e, vals, t, senv)
                for v, x in zip(e.outs, outs, strict=True):
                    senv[v.name] = x
                    vt = _type(v)
                    if vt.kind == TILE and v.name in stores:
                        full = results.get(v.name)
                        if full is None:
                            full = results[v.name] = np.empty(
                                (R, extent(vt.shape[1], self.dims)), self.cdtype(vt)
                            )
                        full[r0:r1, t.col_slice(vt.shape[1])] = x
                    elif vt.kind == GROUP and vt.group_axis == 0:  # one per column and run of rows
                        full = results.get(v.name)
                        assert vt.group is not None
                        if full is None:
                            shape = (extent(vt.shape[0], self.dims), extent(vt.shape[1], self.dims))
                            full = results[v.name] = np.empty(shape, self.cdtype(vt))
                        full[r0 // vt.group : -(-r1 // vt.group), t.col_slice(vt.shape[1])] = x
                    elif vt.kind == GROUP:
                        full = results.get(v.name)
                        width = extent(vt.shape[1], self.dims)
                        if full is None:
                            full = results[v.name] = np.empty((R, width), self.cdtype(vt))
                        full[r0:r1, t.col_slice(vt.shape[1])] = x
                    elif vt.kind == PARTIAL:
                        row_partial = bool(vt.shape) and vt.shape[0] == rows
                        axis = 1 if row_partial else 0
                        if v.name not in bufs:
                            shape = (
                                (R, n_ct)
                                if row_partial
                                else (n_rt, extent(vt.shape[0], self.dims) if vt.shape else 1)
                            )
                            comb = combine_rule(vt.combine)
                            bufs[v.name] = (np.full(shape, comb.identity, self.cdtype(vt)), comb.name, axis)
                        buf = bufs[v.name][0]
                        if row_partial:
                            buf[r0:r1, c0 // tn] = x
                        else:
                            sl = t.col_slice(vt.shape[0]) if vt.shape else slice(0, 1)
                            buf[r0 // tm, sl] = x
        for name, (buf, rule, axis) in bufs.items():
            self.partials[name] = buf
            results[name] = combine(buf, rule, axis)
        for name, x in results.items():
            self.store(name, x, stores.get(name) or self.plan.storage.get(name))

    def gemm(self, s: Stage) -> np.ndarray:
        """The accumulator of a GEMM stage: its operands' product (f32, or float64 in f64 precision).
        With block scales, each block of K summed alone, times the product of its two scales (that of
        the block's row group of A and that of its column group of B), and the blocks added in order."""
        assert isinstance(s.a, Var) and isinstance(s.b, Var)
        a, b = self.env[s.a.name], self.env[s.b.name]
        a, b = (a.T if s.ta else a), (b.T if s.tb else b)
        if not s.scaled:
            return np.matmul(a, b)
        g, sa, sb = self.block_scales(s)
        acc = np.zeros((a.shape[0], b.shape[1]), np.result_type(a, b))
        for j in range(sa.shape[1]):
            part = np.matmul(a[:, j * g : (j + 1) * g], b[j * g : (j + 1) * g])
            acc += part * (sa[:, j : j + 1] * sb[j : j + 1, :]).astype(acc.dtype)
        return acc

    def block_scales(self, s: Stage) -> tuple[int, np.ndarray, np.ndarray]:
        """A scaled GEMM's block of K (g), and its scales as [M, K/g] and [K/g, N] (each operand's
        scale transposed with it and repeated over its group of rows or columns; 1 where not given)."""
        a = self.env[s.a.name] if isinstance(s.a, Var) else None
        b = self.env[s.b.name] if isinstance(s.b, Var) else None
        assert a is not None and b is not None
        m, kk = (a.shape[1], a.shape[0]) if s.ta else a.shape
        n = b.shape[0] if s.tb else b.shape[1]
        sa = sb = None
        if isinstance(s.scale_a, Var):
            x = np.asarray(self.env[s.scale_a.name])
            sa = x.T if s.ta else x
        if isinstance(s.scale_b, Var):
            x = np.asarray(self.env[s.scale_b.name])
            sb = x.T if s.tb else x
        nblocks = sa.shape[1] if sa is not None else sb.shape[0]  # type: ignore[union-attr]
        g = kk // nblocks
        sa = np.ones((m, nblocks), np.float32) if sa is None else np.repeat(sa, m // sa.shape[0], axis=0)
        sb = np.ones((nblocks, n), np.float32) if sb is None else np.repeat(sb, n // sb.shape[1], axis=1)
        return g, sa, sb

    def check_tile(self, s: Stage, rows: Dim, cols: Dim, tile: tuple[int, int]) -> None:
        tm, tn = tile
        full = extent(cols, self.dims)
        tn = min(tn, full)  # one clipped tile holds the whole width
        if tm < 1 or tn < 1:
            raise error("E0805", f"tile sizes must be positive, got {tm}x{tn}")

        def splits_pairs(t: Type) -> bool:
            """A tile of another width than the stage's (half: after pairs) gets tn * ratio columns per
            tile: that must be whole (a tile holding the whole width always is)."""
            if t.kind not in (TILE, MATRIX) or len(t.shape) != 2 or t.shape[1] == cols or tn == full:
                return False
            w = t.shape[1]
            if w.name != cols.name:
                return False
            return (tn * Fraction(w.coeff) / Fraction(cols.coeff)).denominator != 1

        grouped = grouped_reads(s.body, StageShape(rows, cols), _type_or_none)
        for e in s.body:
            for a in e.ins:  # (a matrix read over groups of the tile: any tile holds whole elements of it)
                if isinstance(a, Var) and a.name not in grouped and splits_pairs(_type(a)):
                    raise error(
                        "E0805", f"tile_N = {tn} is odd, but stage reads `{a.name}` at half its width"
                    )
            for v in e.outs:
                t = _type(v)
                if splits_pairs(t):
                    raise error("E0805", f"tile_N = {tn} is odd, but stage `{v.name}` works on column pairs")
                if t.kind == GROUP and t.group_axis == 0:
                    assert t.group is not None
                    if tm % t.group and tm < extent(_type(v).grouped_shape()[0], self.dims):
                        raise error(
                            "E0805",
                            f"tile_M = {tm} splits the groups of {t.group} rows of `{v.name}`",
                            notes=["the checker recorded this tiling constraint; see `coda check --explain`"],
                        )
                elif t.kind == GROUP:
                    assert t.group is not None
                    ratio = t.shape[1].coeff * t.group / cols.coeff
                    if (tn * ratio) % t.group:
                        raise error(
                            "E0805",
                            f"tile_N = {tn} splits the groups of {t.group} columns of `{v.name}`",
                            notes=["the checker recorded this tiling constraint; see `coda check --explain`"],
                        )

    def grouped_tile(self, x: np.ndarray, t: _Tile) -> np.ndarray:
        """Tile `t` of a matrix read over groups of the tile space (each extent the space's divided by a
        whole group size): each element its group's (a tile may cut a group)."""
        gr, gc = extent(t.rows, self.dims) // x.shape[0], extent(t.cols, self.dims) // x.shape[1]
        first = t.r0 // gr
        rows = np.repeat(x[first : -(-t.r1 // gr)], gr, 0)[t.r0 - first * gr : t.r1 - first * gr]
        return np.repeat(rows[:, t.c0 // gc : -(-t.c1 // gc)], gc, 1)[:, t.c0 % gc : t.c0 % gc + t.c1 - t.c0]

    def stage_value(self, a: Atom, senv: dict[str, Any], t: _Tile, grouped: bool = False) -> Any:
        """`a` as an equation of the stage reads it at tile `t`; `grouped`: a matrix read over groups
        of the tile (`expand(s, acc)`), each element of the tile its group's."""
        if not isinstance(a, Var):
            return self.literal(a)
        if a.name in senv:
            return senv[a.name]
        x = self.env[a.name]
        at = _type(a)
        if grouped and x.ndim == 2:
            return self.grouped_tile(x, t)
        if x.ndim == 2:  # a tile load at this tile's position
            return x[t.r0 : t.r1, t.col_slice(at.shape[1])]
        if x.ndim == 1:
            if at.shape[0] == t.rows:
                return x[t.r0 : t.r1, None]
            if repeats_in(at.shape[0], t.rows, t.cols):  # whole: repeated where it meets a tile (apply)
                return x[None, :]
            return x[None, t.col_slice(at.shape[0])]
        return x

    # ------------------------------------------------------------------ equations

    def repeat_operands(self, e: Eqn, vals: list[Any], t: _Tile | None) -> list[Any]:
        """`vals` with each vector over G that repeats across W columns laid out at the width it meets:
        column c reads element c mod G (a scalar operand stays as it is)."""
        reps = repeated(e, t.rows, t.cols) if t is not None else repeated(e)
        if not reps:
            return vals
        vals = list(vals)
        for i, rep_g, rep_w in reps:
            x = np.asarray(vals[i])
            if x.ndim == 0:
                continue
            if t is None:
                vals[i] = x[np.arange(extent(rep_w, self.dims)) % extent(rep_g, self.dims)]
            else:
                sl = t.col_slice(rep_w)
                vals[i] = x.reshape(1, -1)[:, np.arange(sl.start, sl.stop) % extent(rep_g, self.dims)]
        return vals

    def apply(
        self, e: Eqn, vals: list[Any], t: _Tile | None, senv: dict[str, Any] | None = None
    ) -> tuple[Any, ...]:
        op = REGISTRY[e.op]
        assert op.impl is not None, f"op {e.op} has no NumPy impl"
        outs_t = [_type(v) for v in e.outs]
        params = dict(e.params)
        vals = self.repeat_operands(e, vals, t)
        if op.locality.per_element:
            if outs_t[0].kind == TILE:  # a grouped value of this stage broadcasts over its groups' columns
                # (one stored by an earlier stage is a tile of one column per group: read as it is)
                vals = [
                    np.repeat(x, _type(a).group or 1, axis=_type(a).group_axis)
                    if _type(a).kind == GROUP and (senv is None or isinstance(a, Var) and a.name in senv)
                    else x
                    for a, x in zip(e.ins, vals, strict=True)
                ]
            kw: dict[str, Any] = {k: v for k, v in params.items() if not isinstance(v, Dim)}
            if op.rounds:  # its rounding depends on the precision (none in "f64")
                kw["precision"] = self.precision
            res = op.impl(*vals, **kw)
        elif op.locality is Locality.REDUCE:
            (x,) = vals
            over = params["over"]
            group = params.get("group")
            if t is None:
                res = op.impl(np.asarray(x), 0)
            elif group is not None and _type(e.outs[0]).group_axis == 0:
                g = int(group)  # type: ignore[arg-type]
                if x.shape[0] % g:  # a height the checker could not see
                    assert isinstance(over, Dim)
                    raise error(
                        "E0802",
                        f"`{e.outs[0].name}` reduces groups of {g} rows of `{over}`, which is "
                        f"{extent(over, self.dims)}: not a multiple of {g}",
                        notes=["choose sizes that make the grouped rows a multiple of the group"],
                    )
                res = op.impl(x.reshape(x.shape[0] // g, g, x.shape[1]), 1)
            elif group is not None:
                g = int(group)  # type: ignore[arg-type]
                if x.shape[1] % g:  # a width the checker could not see (a dim known only from the inputs)
                    assert isinstance(over, Dim)
                    raise error(
                        "E0802",
                        f"`{e.outs[0].name}` reduces groups of {g} columns of `{over}`, which is "
                        f"{extent(over, self.dims)}: not a multiple of {g}",
                        notes=["choose sizes that make the grouped width a multiple of the group"],
                    )
                res = op.impl(x.reshape(x.shape[0], x.shape[1] // g, g), 2)
            else:
                xt = _type(e.ins[0])
                axis = 1 if (xt.shape[1] == over and xt.shape[0] != over) else 0
                res = op.impl(x, axis)
        elif op.locality is Locality.GATHER:
            x, idx = vals
            assert t is not None
            it = _type(e.ins[1])
            if it.shape[0] == t.rows:  # an index per row selects along the columns
                res = op.impl(x, np.asarray(idx).reshape(-1), 1, t.col_slice(_type(e.ins[0]).shape[1]).start)
            else:
                res = op.impl(x, np.asarray(idx).reshape(-1), 0, t.r0)
        elif op.locality is Locality.VECTOR:  # between stages: fold(x, into=G)
            into = params["into"]
            assert isinstance(into, Dim)
            res = op.impl(np.asarray(vals[0]), extent(into, self.dims))
        elif op.locality is Locality.INDEX:
            assert t is not None
            if op.index_axis == 0:
                res = op.impl(t.r0, t.r1 - t.r0)[:, None]
            else:
                res = op.impl(t.c0, t.c1 - t.c0)[None, :]
        else:
            raise AssertionError(op.locality)
        res_t = res if isinstance(res, tuple) else (res,)
        return tuple(
            np.asarray(r).astype(self.cdtype(ot), copy=False) for r, ot in zip(res_t, outs_t, strict=True)
        )


def _is_tile(t: Any) -> bool:
    return (
        isinstance(t, (tuple, list))
        and len(t) == 2
        and all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)) for x in t)
    )


def check_tiles(block: Block, tile: Any) -> None:
    """`sim_tile=` of a run: None, one (tile_M, tile_N) of integers for every stage, or a dict from
    stage numbers (1-based) of the block to such pairs; E0805 naming what is wrong otherwise."""
    if tile is None:
        return
    if isinstance(tile, dict):
        n = len(block.stages)
        for k, t in tile.items():
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= n:
                raise error(
                    "E0805", f"sim_tile= names stage {k!r}, but block {block.name} has stages 1 to {n}"
                )
            if not _is_tile(t):
                raise error(
                    "E0805", f"sim_tile= of stage {k} is {t!r}; a tile is (tile_M, tile_N), two integers"
                )
        return
    if not _is_tile(tile):
        raise error(
            "E0805", f"sim_tile= is {tile!r}; a tile is (tile_M, tile_N), two integers, or a dict by stage"
        )


def run_block(
    block: Block,
    plan: BlockPlan,
    env: dict[str, np.ndarray],
    dims: dict[str, int],
    *,
    precision: str = "exact",
    sim_tile: Tiles = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Outputs by name, and (tile mode: `sim_tile`, the simulated tile) the per-tile partial buffers
    by name."""
    check_tiles(block, sim_tile)
    check_sizes(block, dims, precision, sim_tile)
    check_repeats(repeat_uses(block), dims)
    it = Interpreter(block, plan, dims, precision, sim_tile)
    with np.errstate(all="ignore"):
        outs = it.run(env)
    return outs, it.partials
