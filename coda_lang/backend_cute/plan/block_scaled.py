"""A block-scaled fp8 mainloop for quack's SM90 GEMM: each 128-deep block of K promoted with its scales.

What it does: `BlockScale(name)` is an epilogue op that the epilogue never reads. It carries one scale
matrix into the kernel (an f32 tensor, one of the two `scale_a=` / `scale_b=` of a block-scaled GEMM
stage, docs/language.md "Block scales"), and, when quack converts the kernel's arguments (its
`to_params`, on the host, before the kernel is traced), it gives that kernel object a mainloop of ours
(`_scaled_mma`) for this trace. That mainloop is quack's fp8 consumer loop (a WGMMA into a fresh
accumulator per K tile, then promotion into the f32 one) with the promotion scaled:
`acc_slow += acc * sa[row, kb] * sb[n block, kb]`, the K tile being the block (128 deep). The scales
are read from global memory (L2) at each promotion: a word per accumulator row a thread holds, and one
per tile for B's 128 x 128 blocks. DeepSeek-V3's recipe (1 x 128 groups of A, 128 x 128 blocks of B).
Two more forms, which a derived backward's data gradient has (`dacc @ w, scale_b=sw`: the cotangent
scaled per tensor in the epilogue, the weight's blocks cutting the contraction the other way):
- B's scale alone (no A scale: `acc_slow += acc * sb[...]`);
- B's blocks laid out as B is stored [K, N] (`kn`: sb [K/128, N/128], read `sb[kb, n block]`), the
  kernel reading B's K-major copy.
And one more, not yet reachable from the planner (refusals.block_scales_unsupported keeps it E0709
until it has run on a GPU): B's scale per column and K block (`columns`: sb [K/128, N], B stored
[K, N]; a weight gradient reading its activation quantized again in 128 x 1 groups,
BackwardOptions.requantize_wgrad), `acc_slow += acc * sb[kb, column]`, each thread loading the
scales of the columns it holds (`_scaled_mma` with `columns`).
How the mainloop learns what quack does not hand it (its `mma` is called with the pipeline, the
accumulators and the K tile count only):
- the scale tensors: the kernel passes its epilogue parameters to `epi_get_smem_tensors` at its top,
  before any branch; ours records them, then calls quack's;
- the tile's coordinates: the scheduler class (`get_scheduler_class`) is one whose work tiles record
  their coordinates when the consumer loop reads them (`tile_idx`, at the top of each iteration of the
  persistent loop, before the mainloop). The work tile is a value carried through that loop, rebuilt
  from its parts each iteration (`__new_from_mlir_values__`), so ours rebuilds itself as ours. (The
  recorder is the process's, set by `install` for the trace that follows: quack traces one kernel
  at a time in a process.)
A scale left out (None) is an error here: quack would drop the op, and the GEMM would run unscaled.
What it does not: plan which stages take it (the planner gives it to stages in DeepSeek-V3's form,
refusals.block_scales_unsupported, E0709 for the others; config.BLOCK_SCALED_TILE its tiles), split K,
pingpong tiles (quack's pingpong loop hands the tensor cores over between warpgroups in its own
mainloop), or tiles whose N is not B's block (128). `check_config` says so before a compile.
Invariants: quack 0.6.5's kernel body calls `epi_get_smem_tensors`, `get_scheduler_class`,
`work_tile.tile_idx` and `mma` in that order (checked by tests/test_block_scaled_kernel.py, which
compiles it to PTX); `VERSION` is in every op's config_key, bumped with any edit here.
"""

from __future__ import annotations

import types
from typing import Any

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup
from quack.compile_utils import make_fake_tensor
from quack.cute_dsl_utils import torch2cute_dtype_map
from quack.epilogue.ops import EpiOp
from quack.tile_scheduler import TileScheduler, WorkTileInfo

from coda_lang.backend_cute.plan.spec import SCALE_BLOCK

VERSION = 5
GROUP = SCALE_BLOCK  # the depth of a K block, and the tile's K (quack's fp8 tile_K)


class _Recorder:
    """What the mainloop is told during one trace: the epilogue parameters and the tile's coordinates."""

    params: Any = None
    tile: Any = None


class _RecordingWorkTile(WorkTileInfo):
    recorder: _Recorder | None = None

    @property
    def tile_idx(self) -> Any:
        if _RecordingWorkTile.recorder is not None:
            _RecordingWorkTile.recorder.tile = self._tile_idx
        return self._tile_idx

    def __new_from_mlir_values__(self, values: Any) -> _RecordingWorkTile:
        plain = super().__new_from_mlir_values__(values)
        return _RecordingWorkTile(plain._tile_idx, plain._is_valid_tile)


def _recording(work: WorkTileInfo) -> _RecordingWorkTile:
    return _RecordingWorkTile(work._tile_idx, work._is_valid_tile)


class _RecordingScheduler(TileScheduler):
    """quack's tile scheduler whose work tiles record their coordinates when read."""

    def initial_work_tile_info(self, *, loc: Any = None, ip: Any = None) -> _RecordingWorkTile:
        return _recording(super().initial_work_tile_info(loc=loc, ip=ip))

    def get_current_work(self, *, loc: Any = None, ip: Any = None) -> _RecordingWorkTile:
        return _recording(super().get_current_work(loc=loc, ip=ip))


class BlockScale(EpiOp):
    """One scale matrix of a block-scaled GEMM (`role` "a": [M, K/128]; "b": [N/128, K/128], or
    [K/128, N/128] where `kn`), carried to the mainloop; the epilogue does not see it. `other`: the
    other scale's name, "" where B's scale is the only one."""

    fn_port = None

    def __init__(self, name: str, role: str, other: str, kn: bool = False, columns: bool = False) -> None:
        super().__init__(name)
        if role not in ("a", "b"):
            raise ValueError(f"role is 'a' or 'b', not {role!r}")
        if role == "a" and not other:
            raise ValueError("A's block scale goes with B's: the kernel has no GEMM scaling A alone")
        if columns and (role != "b" or other or not kn):
            raise ValueError("a scale per column is B's alone, laid out [K/128, N] (kn=True)")
        self.role = role
        self.other = other  # the name of the other scale
        self.kn = kn  # (B's blocks laid out [K/128, N/128]; given to B's op, or to A's for both)
        self.columns = columns  # (B's scale per column and K block, [K/128, N])

    def config_key(self) -> tuple[Any, ...]:
        return (VERSION, self.role, self.other, self.kn, self.columns)

    def host_arg_key(self, value: Any) -> Any:
        # (quack leaves out an op whose value is None: the GEMM would then run unscaled)
        if value is None:
            raise ValueError(
                f"block scale `{self.name}` was not given: a block-scaled GEMM never runs unscaled"
            )
        if value.ndim != 2:
            raise ValueError(f"block scale `{self.name}` is {value.ndim}-D, not a matrix")
        return (torch2cute_dtype_map[value.dtype], value.ndim)

    def host_fake_arg(self, key: Any, fctx: Any) -> Any:
        dtype, ndim = key
        return make_fake_tensor(dtype, (cute.sym_int(), cute.sym_int()), leading_dim=1, divisibility=1)

    def param_fields(self) -> list[tuple[str, Any, Any]]:
        return [(self.name, object, None)]

    def to_params(self, gemm: Any, args: Any) -> dict[str, Any]:
        if self.role == "a":
            install(gemm, scale_a=self.name, scale_b=self.other, kn=self.kn)
        elif not self.other:  # (B's scale alone)
            install(gemm, scale_a=None, scale_b=self.name, kn=self.kn, columns=self.columns)
        return {self.name: getattr(args, self.name)}


def check_config(tile_n: int, pingpong: bool, split_k: int = 1, columns: bool = False) -> str | None:
    """Why this mainloop can't run at a tile, or None (`columns`: B's scale per column, any tile N)."""
    if pingpong:
        return "pingpong tiles hand the tensor cores over inside quack's own mainloop"
    if tile_n != GROUP and not columns:
        return f"the tile's N is {tile_n}, not one of B's {GROUP}-row blocks"
    if split_k != 1:
        return "split K"
    return None


def install(gemm: Any, *, scale_a: str | None, scale_b: str, kn: bool = False, columns: bool = False) -> None:
    """Give quack's kernel object `gemm` the scaled mainloop for the trace that follows (`scale_a`
    None: B's scale alone; `kn`: B's blocks laid out [K/128, N/128]; `columns`: B's scale per column
    and K block, [K/128, N])."""
    why = check_config(gemm.cta_tile_shape_mnk[1], gemm.pingpong, getattr(gemm, "split_k", 1), columns)
    if why is not None:
        raise ValueError(f"a block-scaled mainloop can't run here: {why}")
    if not gemm.fp8_slow_accum:
        raise ValueError("a block-scaled mainloop needs fp8 operands promoted per K tile")
    recorder = _Recorder()
    gemm._coda_scales = (recorder, scale_a, scale_b, kn, columns)
    _RecordingWorkTile.recorder = recorder
    own = type(gemm)
    gemm.get_scheduler_class = lambda varlen_m=False: _RecordingScheduler
    first = own.epi_get_smem_tensors

    def epi_get_smem_tensors(params: Any, storage: Any) -> Any:
        recorder.params = params
        return first(gemm, params, storage)

    gemm.epi_get_smem_tensors = epi_get_smem_tensors
    gemm.mma = types.MethodType(_scaled_mma, gemm)


@cute.jit
def _scaled_mma(
    self: Any,
    ab_pipeline: Any,
    ab_read_state: Any,
    mma_fn: Any,
    acc: cute.Tensor,
    acc_slow: cute.Tensor,
    k_tile_cnt: Int32,
    warp_group_idx: Int32,
) -> Any:
    """quack's fp8 consumer loop with each K tile's WGMMA result promoted times its scales, loaded while
    the tile's WGMMAs run: per row, `sa[row, kb] * sb[n block, kb]` (or B's alone; `kn`: sb[kb, n
    block]); with `columns`, per column, `sb[kb, column]`. A thread's accumulator holds, per WGMMA, 2
    adjacent columns of each of the tile's 8-column groups for 2 rows (mode 0 of its layout: (column,
    row, group)), so it loads 2 rows' scales, or 2 x groups x MMA_N columns' (0 past M or N, where the
    accumulator is 0 too)."""
    recorder, name_a, name_b, kn, columns = self._coda_scales
    sb = getattr(recorder.params, name_b)  # f32 [N / 128, KB] ([KB, N / 128] where kn; [KB, N] where columns)
    pid_m, pid_n = recorder.tile[0], recorder.tile[1]
    tile_m, tile_n = self.cta_tile_shape_mnk[0], self.cta_tile_shape_mnk[1]
    tiled_mma = mma_fn.args[0]
    tidx, _, _ = cute.arch.thread_idx()
    coords = tiled_mma.get_slice(tidx).partition_C(cute.make_identity_tensor((tile_m, tile_n)))
    mma_m = const_expr(cute.size(acc.shape[1]))
    mma_n = const_expr(cute.size(acc.shape[2]))
    groups = const_expr(cute.size(acc.shape[0][2]))
    n_block = pid_n  # (tile_n == 128: one block of B's rows)
    acc_slow.fill(0.0)
    for k_tile in cutlass.range(k_tile_cnt, unroll=1):
        ab_pipeline.consumer_wait(ab_read_state)
        mma_fn(A_idx=ab_read_state.index, B_idx=ab_read_state.index, zero_init=True)
        if const_expr(columns):
            col_scales = cute.make_rmem_tensor((2, groups, mma_n), Float32)
            for n in cutlass.range_constexpr(mma_n):
                for v in cutlass.range_constexpr(groups):
                    for c in cutlass.range_constexpr(2):
                        col = pid_n * tile_n + coords[(c, 0, v), 0, n][1]
                        s = Float32(0.0)
                        if col < cute.size(sb.shape[1]):
                            s = sb[k_tile, col]
                        col_scales[c, v, n] = s
        else:
            sb_k = Float32(0.0)
            if const_expr(kn):
                sb_k = sb[k_tile, n_block]
            else:
                sb_k = sb[n_block, k_tile]
            row_scales = cute.make_rmem_tensor((2, mma_m), Float32)
            for m in cutlass.range_constexpr(mma_m):
                for r in cutlass.range_constexpr(2):
                    if const_expr(name_a is None):
                        row_scales[r, m] = sb_k
                    else:
                        sa = getattr(recorder.params, name_a)  # f32 [M, KB]
                        row = pid_m * tile_m + coords[(0, r, 0), m, 0][0]
                        s = Float32(0.0)
                        if row < cute.size(sa.shape[0]):
                            s = sa[row, k_tile]
                        row_scales[r, m] = s * sb_k
        warpgroup.wait_group(0)
        ab_pipeline.consumer_release(ab_read_state)
        ab_read_state.advance()
        if const_expr(columns):
            for m in cutlass.range_constexpr(mma_m):
                for n in cutlass.range_constexpr(mma_n):
                    for v in cutlass.range_constexpr(groups):
                        for r in cutlass.range_constexpr(2):
                            for c in cutlass.range_constexpr(2):
                                acc_slow[(c, r, v), m, n] = (
                                    acc_slow[(c, r, v), m, n] + acc[(c, r, v), m, n] * col_scales[c, v, n]
                                )
        else:
            for m in cutlass.range_constexpr(mma_m):
                for r in cutlass.range_constexpr(2):
                    slow = acc_slow[(None, r, None), m, None]
                    slow.store(slow.load() + acc[(None, r, None), m, None].load() * row_scales[r, m])
    acc.store(acc_slow.load())
    return ab_read_state
