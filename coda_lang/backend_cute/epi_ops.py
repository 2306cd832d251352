"""CuTeDSL epilogue ops of coda_lang's own, for what quack's frontend can't say with its library ops.

What it does: `GroupedReduce(name, combine="add"|"max"|"min"|"lse")` is a grouped reduction complete
inside a tile (`sum(x, over=N, group=g)`, and max, min, logsumexp): quack's `GroupedColStatsBase` (the machinery of its `HeadRstd`, the
per-head rstd of QK-norm) with the finalize left out. The emitted prepass fn returns the value to
reduce under the op's name; the op folds it per (row, run of g columns) in registers, deterministically
(a fixed butterfly, then a fixed-order fold of the per-warp smem planes, no atomics); the main fn
receives the op's name as a value port: the RAW fold of each element's group (`HeadRstd` bakes
`rsqrt(sum / g + eps)` into its finalize instead; coda computes whatever follows in the fn, so one op
serves every grouped sum, max, min or logsumexp; quack's base folds by add or max, min and lse are
ours). Its host argument is the group width as a plain int (a compile-time
constant; quack checks that it divides N and tile_N). `GroupedReduce(...).out(name)` is quack's
`GroupedColStatsOut`: it writes the fold to an f32 [m, N / g] buffer when the stage's result is used
after it. `RowVecLSEReduce(name)` is logsumexp over the rows (`logsumexp(x, over=M)`), one partial
per (row tile, column): quack's `OnlineLSEReduce` (the columns' online log-sum-exp) on a RowVecReduce.
What it does not: anything at trace time beyond quack's base class; it is imported only by emitted
epilogue modules (so importing it imports quack and CuTeDSL).
Invariants: `config_key` holds everything that changes the generated code, and `VERSION`, bumped with
any edit here (quack keys its disk cache of compiled kernels on an op's module, class name and
config_key, not on its source).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import cutlass
import cutlass.cute as cute
import quack.layout_utils as layout_utils
from cutlass import Float32, const_expr
from quack.epilogue.ops import (  # RowVecReduce's end-of-stripe helpers (quack pinned at 0.6.5)
    GroupedColStatsBase,
    RowVecReduce,
    _get_lane_warp_layouts,
    _mode_flat_stride,
)
from quack.reduce import swap_shuffle_reduce
from quack.sm90_utils import partition_for_epilogue

VERSION = 2

_math: Any = cute.math  # CuTeDSL's math functions (exp, log: generated, so mypy can't see them)


def _lse2(a: Any, b: Any) -> Any:
    """log(exp(a) + exp(b)) = max + log(1 + exp(min - max)), an associative fold with identity -inf
    (one exp and one log per element, fast-math). Where a == b (two -inf, two +inf) the difference is
    taken as 0: max + log 2 is then -inf, +inf or the right value, never NaN."""
    hi = cute.arch.fmax(a, b)
    lo = cute.arch.fmin(a, b)
    d = Float32(cutlass.select_(lo == hi, Float32(0.0), lo - hi))
    return hi + _math.log(Float32(1.0) + _math.exp(d, fastmath=True), fastmath=True)


class GroupedReduce(GroupedColStatsBase):
    """Per-(row, group of columns) sum, max or min of what the prepass fn returns under `name`; the main
    fn reads the raw result at every element of the group."""

    def __init__(self, name: str, combine: str = "add"):
        if combine not in ("add", "max", "min", "lse"):
            raise ValueError(f"GroupedReduce folds by add, max, min or lse, not {combine!r}")
        super().__init__(name)
        # "max" from a -inf identity, "min" from +inf: exact here because a group never straddles the end
        # of N (quack validates N % width == 0), so the zeros of out-of-bounds columns fill only unused
        # groups
        self.combine = combine

    def config_key(self) -> tuple[Any, ...]:
        return (self.combine, VERSION)

    # quack's base folds by add or max; min (fmin from +inf) and lse (`_lse2` from -inf) are ours, used
    # by the fold, the butterfly, the smem planes' fold and the GroupedColStatsOut writer alike
    def _combine_op(self) -> Any:
        return {"min": cute.arch.fmin, "lse": _lse2}.get(self.combine) or super()._combine_op()

    def _fold_identity(self) -> float:
        return {"min": math.inf, "lse": -math.inf}.get(self.combine) or super()._fold_identity()

    @cute.jit
    def stat_value(self, total: Any, group_cols: int) -> Any:
        return total


class RowVecLSEReduce(RowVecReduce):
    """Online log-sum-exp over the rows: `logsumexp(x, over=M)`, one partial per (row tile, column),
    out[m_tile, n] = log sum over the tile's rows of exp(v) (f32 [ceil(m / tile_M), n], like RowVecReduce).

    quack's `OnlineLSEReduce` is the same fold over the columns (a ColVecReduce); its RowVecReduce twin
    does not exist because RowVecReduce's end of stripe (the butterfly across the M lanes, the smem
    exchange across the M warps, the gmem write) folds one plane with `combine=` and has no hooks. This
    class is that end of stripe carrying the coupled (running max, running sum) pair through
    OnlineLSEReduce's `_merge` / `_finalize`, and OnlineLSEReduce's fold (thread-local max first, then one
    rescale and one exp per element) with the ragged-tile mask on the M coordinate instead of N.
    The fn returns the logit under the op's name (a sink port); rows past M (the zero accumulator rows
    of a ragged last M tile) are masked to -inf, the fold's identity. The fold uses fast-math exp/log,
    as OnlineLSEReduce does.
    """

    reduce_planes = 2  # (max, sum) per column and non-leader warp in the inter-warp smem exchange
    _NEG_INF = -math.inf

    def __init__(self, name: str, check_oob: bool = True):
        super().__init__(name)
        self.check_oob = check_oob

    def config_key(self) -> tuple[Any, ...]:
        return ("lse", self.check_oob, VERSION)

    def host_finalize(self, partials: Any) -> Any:
        import torch

        return torch.logsumexp(partials, dim=-2)

    def _mask_oob_active(self) -> bool:
        return self.check_oob

    # -- the coupled fold (as OnlineLSEReduce) ----------------------------------------------------

    @cute.jit
    def _guard_neg_inf(self, m_new: Any) -> Any:
        """0 while the running max is still the -inf identity (an empty slot), so exp(-inf - 0) = 0
        instead of exp(NaN)."""
        return Float32(cutlass.select_(m_new == Float32(self._NEG_INF), Float32(0.0), m_new))

    @cute.jit
    def _merge(self, vals: Any, others: Any) -> Any:
        m, s = vals
        om, os = others
        m_new = cute.arch.fmax(m, om)
        m_sub = self._guard_neg_inf(m_new)
        s_new = s * _math.exp(m - m_sub, fastmath=True) + os * _math.exp(om - m_sub, fastmath=True)
        return (m_new, s_new)

    @cute.jit
    def _finalize(self, vals: Any) -> Any:
        return _math.log(vals[1], fastmath=True) + vals[0]

    @cute.jit
    def begin(self, gemm: Any, param: Any, smem_tensor: Any, ctx: Any) -> Any:
        vec_mma_layout = cute.make_layout((ctx.tile_M, ctx.tile_N), stride=self._broadcast_stride())
        acc_layout = ctx.partition_for_epilogue_fn(cute.make_rmem_tensor(vec_mma_layout, Float32)).layout
        tDrMax = cute.make_rmem_tensor(acc_layout, Float32)
        tDrSum = cute.make_rmem_tensor(acc_layout, Float32)
        state: tuple[Any, ...] = (tDrMax, tDrSum, smem_tensor)
        if const_expr(self.check_oob):
            tDcD = ctx.partition_for_epilogue_fn(cute.make_identity_tensor((ctx.tile_M, ctx.tile_N)))
            limit_m = ctx.varlen_manager.len_m(ctx.tile_coord_mnkl[3]) - ctx.tile_coord_mnkl[0] * ctx.tile_M
            state = (tDrMax, tDrSum, smem_tensor, tDcD, limit_m)
        return state

    @cute.jit
    def begin_loop(self, gemm: Any, state: Any, epi_coord: Any) -> Any:
        m_cur = state[0][None, None, None, epi_coord[0], epi_coord[1]]
        s_cur = state[1][None, None, None, epi_coord[0], epi_coord[1]]
        if const_expr(epi_coord[0] == 0):  # the first M subtile of the stripe: the empty state
            cute.filter_zeros(m_cur).fill(self._NEG_INF)
            cute.filter_zeros(s_cur).fill(0.0)
        loop_state: tuple[Any, ...] = (m_cur, s_cur)
        if const_expr(self.check_oob):
            loop_state = (m_cur, s_cur, state[3][None, None, None, epi_coord[0], epi_coord[1]], state[4])
        return loop_state

    @cute.jit
    def _fold(self, m_acc: Any, s_acc: Any, frag: Any, coords: Any = None, limit_m: Any = None,
              tile_shape_mn: Any = None) -> None:
        if const_expr(coords is not None):
            # rows past M to the identity (-inf); rebased compare on the static M offset
            lay_m = cute.composition(cute.make_layout(tile_shape_mn, stride=(1, 0)), coords.layout)
            limit_rel = limit_m - coords[0][0]
            for i in cutlass.range(cute.size(frag), unroll_full=True):
                off_m = cute.crd2idx(i, lay_m)
                frag[i] = frag[i] if off_m < limit_rel else self._NEG_INF
        ref = m_acc.layout
        frag_g = layout_utils.convert_layout_zero_stride(frag, ref)
        m_g = layout_utils.convert_layout_zero_stride(m_acc, ref)[None, 0]
        s_g = layout_utils.convert_layout_zero_stride(s_acc, ref)[None, 0]
        n_aliased = const_expr(cute.size(frag_g, mode=[1]))
        for si in cutlass.range(cute.size(m_g), unroll_full=True):
            m_old = m_g[si]
            vmax = frag_g[si, 0]
            for j in cutlass.range_constexpr(1, n_aliased):
                vmax = cute.arch.fmax(vmax, frag_g[si, j])
            m_new = cute.arch.fmax(m_old, vmax)
            m_sub = self._guard_neg_inf(m_new)
            s_new = s_g[si] * _math.exp(m_old - m_sub, fastmath=True)
            for j in cutlass.range_constexpr(n_aliased):
                s_new = s_new + _math.exp(frag_g[si, j] - m_sub, fastmath=True)
            s_g[si] = s_new
            m_g[si] = m_new

    @cute.jit
    def fn_sink_flush(self, gemm: Any, state: Any, frag: Any) -> None:
        if const_expr(self.check_oob):
            self._fold(state[0], state[1], frag, state[2], state[3], tile_shape_mn=gemm.cta_tile_shape_mnk[:2])
        else:
            self._fold(state[0], state[1], frag)

    # -- the end of an N stripe: RowVecReduce's, two planes, merged by _merge ---------------------

    @cute.jit
    def end_loop_stage(self, gemm: Any, param: Any, state: Any, epi_coord: Any, epi_tile: Any,
                       tiled_copy_t2r: Any, tiled_copy_r2s: Any, tidx: Any) -> Any:
        staged = None
        epi_tile_shape = cute.zipped_divide(cute.make_layout(gemm.cta_tile_shape_mnk[:2]), epi_tile).shape[1]
        if const_expr(epi_coord[0] == epi_tile_shape[0] - 1):
            m_cur = state[0][None, None, None, epi_coord[0], epi_coord[1]]
            s_cur = state[1][None, None, None, epi_coord[0], epi_coord[1]]
            sExch = state[2]
            tiled_copy = tiled_copy_t2r if tiled_copy_t2r is not None else tiled_copy_r2s
            reference_src = tiled_copy_t2r is None
            lane_layout_MN, warp_layout_MN = _get_lane_warp_layouts(tiled_copy, reference_src)
            lanes_in_M = cute.size(lane_layout_MN, mode=[0])
            lanes_in_N = cute.size(lane_layout_MN, mode=[1])
            is_lane_m_leader = cute.arch.lane_idx() < lanes_in_N
            assert lanes_in_M == 1 << int(math.log2(lanes_in_M)), "lanes_in_M must be a power of 2"
            if const_expr(lanes_in_N > 1):
                assert lane_layout_MN.stride[1] == 1, "RowVecLSEReduce assumes contiguous N lanes"
            ref_layout = m_cur.layout
            vals_n = (layout_utils.convert_layout_zero_stride(m_cur, ref_layout)[None, 0],
                      layout_utils.convert_layout_zero_stride(s_cur, ref_layout)[None, 0])
            warps_in_M = const_expr(cute.size(warp_layout_MN[0]))
            partition_fn = partial(partition_for_epilogue, epi_tile=epi_tile, tiled_copy=tiled_copy, tidx=tidx,
                                   reference_src=reference_src)
            tile_M, tile_N = gemm.cta_tile_shape_mnk[:2]
            tDcD = partition_fn(cute.make_identity_tensor((tile_M, tile_N)))
            tDcD_cur = tDcD[None, None, None, epi_coord[0], epi_coord[1]]
            tDcD_n = layout_utils.convert_layout_zero_stride(tDcD_cur, ref_layout)[None, 0]

            E = const_expr(cute.size(tDcD_n, mode=[0]))
            s_m_flat = _mode_flat_stride(lane_layout_MN, 0)
            s_m = const_expr(s_m_flat if s_m_flat is not None else 1)
            num_slices = const_expr(min(lanes_in_M, E))
            use_swap_shuffle = const_expr(
                lanes_in_M > 1 and s_m_flat is not None and s_m == 1 << int(math.log2(s_m))
                and E % num_slices == 0 and num_slices == 1 << int(math.log2(num_slices)))
            slice_elems = const_expr(E // num_slices if use_swap_shuffle else E)
            lane_g = (cute.arch.lane_idx() // s_m) % lanes_in_M
            if const_expr(use_swap_shuffle):
                swap_shuffle_reduce(vals_n, self._merge, num_lanes=lanes_in_M, lane_stride=s_m,
                                    slice_elems=slice_elems)
            elif const_expr(lanes_in_M > 1):
                for n in cutlass.range(cute.size(vals_n[0]), unroll_full=True):
                    reduction_rows = lanes_in_M // 2
                    while reduction_rows > 0:
                        offset = cute.crd2idx((reduction_rows, 0), lane_layout_MN)
                        others = tuple(cute.arch.shuffle_sync_bfly(v[n], offset=offset) for v in vals_n)
                        merged = self._merge(tuple(v[n] for v in vals_n), others)
                        for k in cutlass.range_constexpr(2):
                            vals_n[k][n] = merged[k]
                        reduction_rows = reduction_rows // 2

            # the M warps' partials to smem for the inter-warp merge (after the driver's barrier)
            warp_idx = cute.arch.make_warp_uniform(tidx // cute.arch.WARP_SIZE)
            warp_m_idx = warp_layout_MN.get_hier_coord(warp_idx)[0]
            if const_expr(warps_in_M > 1):
                if const_expr(use_swap_shuffle):
                    if warp_m_idx > 0 and lane_g < num_slices:
                        for j in cutlass.range_constexpr(slice_elems):
                            col_idx = tDcD_n[lane_g * slice_elems + j][1]
                            for k in cutlass.range_constexpr(2):
                                sExch[col_idx, warp_m_idx - 1, k] = vals_n[k][j]
                else:
                    if warp_m_idx > 0 and is_lane_m_leader:
                        for n in cutlass.range(cute.size(tDcD_n, mode=[0])):
                            col_idx = tDcD_n[n][1]
                            for k in cutlass.range_constexpr(2):
                                sExch[col_idx, warp_m_idx - 1, k] = vals_n[k][n]
            staged = (warps_in_M > 1, (vals_n, tDcD_n, sExch, warps_in_M, warp_m_idx, is_lane_m_leader,
                                       use_swap_shuffle, num_slices, slice_elems, lane_g))
        return staged

    @cute.jit
    def end_loop_finish(self, gemm: Any, param: Any, staged: Any, tile_coord_mnkl: Any, varlen_manager: Any) -> None:
        vals_n, tDcD_n, sExch = staged[0], staged[1], staged[2]
        warps_in_M, warp_m_idx, is_lane_m_leader = staged[3], staged[4], staged[5]
        use_swap_shuffle, num_slices, slice_elems, lane_g = staged[6], staged[7], staged[8], staged[9]
        if const_expr(warps_in_M > 1):
            if const_expr(use_swap_shuffle):
                if warp_m_idx == 0 and lane_g < num_slices:
                    for j in cutlass.range_constexpr(slice_elems):
                        col_idx = tDcD_n[lane_g * slice_elems + j][1]
                        for warp_m in cutlass.range_constexpr(1, warps_in_M):
                            others = tuple(sExch[col_idx, warp_m - 1, k] for k in range(2))
                            merged = self._merge(tuple(v[j] for v in vals_n), others)
                            for k in cutlass.range_constexpr(2):
                                vals_n[k][j] = merged[k]
            else:
                if warp_m_idx == 0 and is_lane_m_leader:
                    for n in cutlass.range(cute.size(tDcD_n, mode=[0])):
                        col_idx = tDcD_n[n][1]
                        for warp_m in cutlass.range_constexpr(1, warps_in_M):
                            others = tuple(sExch[col_idx, warp_m - 1, k] for k in range(2))
                            merged = self._merge(tuple(v[n] for v in vals_n), others)
                            for k in cutlass.range_constexpr(2):
                                vals_n[k][n] = merged[k]

        # gmem: one partial per (row tile, column)
        assert not varlen_manager.varlen_m, "RowVecLSEReduce: no varlen_m"
        tile_N = gemm.cta_tile_shape_mnk[1]
        batch_idx = tile_coord_mnkl[3]
        limit_m_tiles = param.shape[1]
        mRowVec = param[batch_idx, tile_coord_mnkl[0], None]
        gRowVec = cute.local_tile(mRowVec, (tile_N,), (tile_coord_mnkl[1],))
        limit_n = min(cute.size(mRowVec, mode=[0]) - tile_coord_mnkl[1] * tile_N, tile_N)
        if const_expr(use_swap_shuffle):
            in_warp0 = True if const_expr(warps_in_M == 1) else warp_m_idx == 0
            if tile_coord_mnkl[0] < limit_m_tiles and in_warp0 and lane_g < num_slices:
                for j in cutlass.range_constexpr(slice_elems):
                    col_idx = tDcD_n[lane_g * slice_elems + j][1]
                    if col_idx < limit_n:
                        gRowVec[col_idx] = self._finalize(tuple(v[j] for v in vals_n))
        else:
            should_write_gmem = is_lane_m_leader if const_expr(warps_in_M == 1) else (
                warp_m_idx == 0 and is_lane_m_leader)
            if tile_coord_mnkl[0] < limit_m_tiles and should_write_gmem:
                for n in cutlass.range(cute.size(tDcD_n, mode=[0])):
                    col_idx = tDcD_n[n][1]
                    if col_idx < limit_n:
                        gRowVec[col_idx] = self._finalize(tuple(v[n] for v in vals_n))
