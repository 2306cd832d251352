"""Tile configurations of a stage's kernel and the rules of which fit it.

What it does: `TileConfig` (quack's SM90 default: 128x192 pingpong, cluster 2x1; `CUBLAS`, the
stand-in config of a plain stage run by cuBLAS), the candidate lists (`CANDIDATES`, tried in order by
select.select_config; `TUNE_CANDIDATES`, timed by the tuner), and the rules a stage's config must
satisfy, every one a `TileConstraint` (ir/types.py) with its reason: the stage's own (`spec.tiling`:
whole groups, from the checker; pairs, paired stores and groups within the epilogue subtile, from the
planner) and the backend's that apply to it (PAIRED_SUBTILE, WIDE_F32_TILE): `rules`. `broken` is the
rules a config breaks (one loop over them, on the config's `tile_values`); `fits` is whether it
breaks none. E0805 (a tile given that does not fit) and E0706 (no candidate fits) list their text.
What it does not: compile or time anything.
Invariants: pure functions of a StageSpec and a TileConfig; a kernel_only rule never refuses a config
of the emulated kernels (`emulated=True`), which hold at any tile.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from coda_lang.backend_cute.plan.spec import SCALE_BLOCK, StageSpec
from coda_lang.ir.types import TileConstraint, TileQuantity


@dataclass(frozen=True)
class TileConfig:
    tile_m: int = 128
    tile_n: int = 192
    cluster_m: int = 2
    cluster_n: int = 1
    pingpong: bool = True
    # The N extent of the epilogue's subtile (the columns each pass over the accumulator handles):
    # 0 is quack's choice (32 for 16-bit outputs); 16 halves the registers the epilogue holds at once,
    # which keeps heavy epilogues (two tile loads and a sink) spill-free at 128x192.
    epi_n: int = 0
    # An fp8 GEMM accumulated in the WGMMA accumulator alone (quack's `fp8_fast_accum`): no second f32
    # accumulator, so half the accumulator registers, but each product sum at the tensor core's own
    # fp8 accumulation precision, not promoted to f32 after each K tile (FP8_FAST_CANDIDATES)
    fast_accum: bool = False

    def __str__(self) -> str:
        if self.is_cublas:
            return "cuBLAS (torch.matmul)"
        kind = "pingpong" if self.pingpong else "cooperative"
        epi = f", epilogue subtile N {self.epi_n}" if self.epi_n else ""
        fast = ", fast fp8 accumulation" if self.fast_accum else ""
        return f"{self.tile_m}x{self.tile_n} {kind}, cluster {self.cluster_m}x{self.cluster_n}{epi}{fast}"

    @property
    def short(self) -> str:
        if self.is_cublas:
            return "cublas"
        return (
            f"{self.tile_m}x{self.tile_n}"
            + (f"e{self.epi_n}" if self.epi_n else "")
            + ("f" if self.fast_accum else "")
        )

    @property
    def is_cublas(self) -> bool:
        """The stand-in config of a plain GEMM stage run by cuBLAS (see `CUBLAS`)."""
        return self.tile_m == 0


# A stage whose epilogue only stores the accumulator in the operands' dtype (a wgrad or dgrad GEMM
# with nothing fused) is a bare GEMM: the tuner also times it on cuBLAS and takes that when faster.
CUBLAS = TileConfig(0, 0, 1, 1, False)


def is_plain(spec: StageSpec) -> bool:
    """Whether the stage's kernel would be a bare GEMM: D = acc in the operands' dtype, nothing else."""
    return spec.plain


DEFAULT_CONFIG = TileConfig()

# Tried in order by select_config: quack's default, the same tile with a narrower epilogue subtile,
# then narrower tiles (fewer accumulator registers per thread, so more room for the epilogue; quack's
# subtile of 128x176 is 16 columns wide by itself).
CANDIDATES = (
    TileConfig(128, 192),
    TileConfig(128, 192, epi_n=16),
    TileConfig(128, 176),
    TileConfig(128, 128),
    TileConfig(128, 96),
    TileConfig(128, 64),
)

# What the runtime measures on a GPU (quack's SM90 space: pingpong 128xN, cooperative 256xN, clusters
# 2x1 and 1x2), after the ptxas check has dropped the configs that spill.
TUNE_CANDIDATES = (
    TileConfig(128, 192),
    TileConfig(128, 192, epi_n=16),
    TileConfig(128, 176),
    TileConfig(128, 160),
    TileConfig(128, 128),
    TileConfig(128, 192, 1, 2),
    TileConfig(256, 128, 2, 1, False),
    TileConfig(256, 192, 2, 1, False),
)

# A GEMM of fp8 operands accumulates in two sets of f32 registers (quack's default for 8-bit operands:
# each K tile's WGMMA result is added into a second accumulator, so the sum keeps f32's precision,
# which Hopper's fp8 WGMMA accumulator alone does not), twice the accumulator registers of a 16-bit
# GEMM: quack's 128-row pingpong tiles spill from 128x128 up (512 bytes at 128x128, ptxas, sm_90a),
# the cooperative 256x128 and 128x256 too. These fit (no spills with fp8_delayed's second GEMM, nor
# with the fp8 Llama layer's forward and backward GEMMs: each of the cooperative 128x192's two
# consumer warpgroups holds 64x192 twice, the widest that fits):
# 64-row pingpong tiles were tried and dropped (2026-11-28, H200): they fit (ptxas: 0 spills at 64x128
# in every fp8 Llama layer GEMM, and at 64x192 with a 16-column subtile in all but the paired ones),
# but the tuner timed them beside these on every fp8 stage of the 1B step and none won (the SwiGLU
# backward: 0.510 ms at 64x128 pingpong against 0.461 at 128x192 cooperative; the weight gradients
# 25-40 % slower), and the captured step was 129.9 against 130.2 ms.
FP8_CANDIDATES = (
    TileConfig(128, 128, 2, 1, False),
    TileConfig(128, 192, 2, 1, False),
    TileConfig(128, 192, 1, 2, False),
    TileConfig(128, 96),
    TileConfig(128, 64),
)


# With fast accumulation (`TileConfig.fast_accum`), the wider cooperative tiles stop spilling: ptxas,
# sm_90a, 2026-11-28, the fp8 Llama-3.2-1B layer's backward GEMMs: at 128x256 and 256x128 (cluster
# 2x1) they spill 512-1,056 bytes with the second accumulator and 0 without it (`dacc5 @ w_2q`, with
# its SwiGLU-backward epilogue, 16 bytes at 128x256). Timed by the tuner only where
# $CODA_FP8_FAST_ACCUM=1: it changes the GEMMs' numerics (see docs/backend.md, "fp8 GEMMs"). On an
# H200 the captured 1B step was 1.8% faster with it (127.6 against 129.9 ms, 2026-11-28). Pingpong
# tiles stay out: with fast accumulation too, at 168 registers, the SwiGLU-backward GEMM spills 2,052
# bytes at 128x128 and the gate/up dgrad 76 (ptxas, sm_90a, same day); only the weight gradients fit.
FP8_FAST_CANDIDATES = (
    TileConfig(128, 192, 2, 1, False, fast_accum=True),
    TileConfig(128, 256, 2, 1, False, fast_accum=True),
    TileConfig(256, 128, 2, 1, False, fast_accum=True),
    TileConfig(128, 256, 1, 2, False, fast_accum=True),
)


# A 16-column epilogue subtile for the fp8 tiles whose epilogue spills a few words at quack's own:
# ptxas, sm_90a, 2026-11-28, the fp8 Llama layer's SwiGLU-backward GEMM (`dacc5 @ w_2q`, its e5m2
# cotangent stored as pairs) spills 8 bytes at 128x192 cooperative and 4 at 128x96 pingpong, and the
# down projection's forward (`aq @ w_2q`) 4 at 128x96 pingpong; at epi_n 16 none of them spills, so
# the tuner could time them. Timed only where $CODA_FP8_E16=1: on an H200 (2026-11-28) they passed
# tests/test_fp8_pairs.py's GPU tests, but the captured 1B step gained 0.5 ms (127.5 against 128.0 ms),
# inside the spread, for about 12 s more of tuning compiles.
FP8_E16_CANDIDATES = (
    TileConfig(128, 192, 2, 1, False, epi_n=16),
    TileConfig(128, 96, epi_n=16),
)


# Tried only where every candidate of a GEMM stage spills (select.select_config,
# select.configs_without_spills; tiles.choose_config where none fits): tiles whose threads hold fewer
# values at once, for the heaviest epilogues. A 16-column epilogue subtile halves what one pass over the
# accumulator holds; a cooperative tile's two consumer warpgroups hold 64 rows each, half a pingpong
# tile's accumulators (for the stages WIDE_F32_TILE leaves cooperative tiles, and PAIRED_SUBTILE
# 32-column subtiles). ptxas, sm_90a, 2026-11-28, Gemma 2's fp8 layer backward, whose QKV data gradient
# `dacc9 @ w_qkvq` carries the sandwich norms' backward (three tiles loaded, two f32 tiles stored, two
# column sums and a row sum; pingpong only): with e5m2 cotangents (an fp8 GEMM, beside its second
# accumulator) it spills 224 bytes at 128x96 and 8 at 128x64, with bf16 ones ("delayed-forward": a
# 16-bit GEMM of the widened weight) at every 16-bit candidate; at 128x64 with the 16-column subtile it
# spills none in either (nor at cooperative 128x128 e16 and 128x64 where those are allowed). Not
# candidates of every stage: each is one more kernel to compile and time, and a 16-column subtile runs
# the epilogue in twice the passes.
FALLBACK_CANDIDATES = (
    TileConfig(128, 128, 2, 1, False, epi_n=16),
    TileConfig(128, 96, epi_n=16),
    TileConfig(128, 64, epi_n=16),
    TileConfig(128, 64, 2, 1, False),
)


def fallback_candidates_for(spec: StageSpec) -> tuple[TileConfig, ...]:
    """The tiles tried for this stage only where every one of its candidates spills
    (FALLBACK_CANDIDATES less those among its candidates)."""
    return tuple(c for c in FALLBACK_CANDIDATES if c not in candidates_for(spec))


def fp8_e16_on() -> bool:
    """Whether the tuner also times fp8 GEMMs at FP8_E16_CANDIDATES ($CODA_FP8_E16=1)."""
    return os.environ.get("CODA_FP8_E16", "0") == "1"


def fp8_tuning_variant(spec: StageSpec) -> str | None:
    """The name of an fp8 stage's candidate set where it is not the default one (the tuning cache
    keeps each set's choice apart), or None."""
    parts = [p for p, on in (("fp8-fast-accum", fast_accum_on(spec)), ("fp8-e16", fp8_e16_on())) if on]
    return "+".join(parts) if parts and fp8_operands(spec) else None


FAST_ACCUM_SETTINGS = ("0", "1", "forward")


def fast_accum_on(spec: StageSpec | None = None) -> bool:
    """Whether the tuner also times this stage's fp8 GEMM with fast accumulation: $CODA_FP8_FAST_ACCUM=1
    for every fp8 GEMM, `forward` for those of blocks that are not derived backwards (the forward's,
    as TransformerEngine's and torchao's float8 defaults accumulate only the forward GEMM fast; the
    data and weight gradients keep the second f32 accumulator). Without a stage: whether any is.
    ValueError for another value."""
    v = os.environ.get("CODA_FP8_FAST_ACCUM", "0")
    if v not in FAST_ACCUM_SETTINGS:
        raise ValueError(f"$CODA_FP8_FAST_ACCUM is {v!r}; it takes 0, 1 or forward")
    if v == "forward" and spec is not None:
        return not spec.derived
    return v != "0"


def fp8_operands(spec: StageSpec) -> bool:
    """Whether the stage's GEMM multiplies fp8 operands (the planner compiles only both fp8)."""
    return spec.gemm.a_dtype in ("e4m3", "e5m2") or spec.gemm.b_dtype in ("e4m3", "e5m2")


def candidates_for(spec: StageSpec) -> tuple[TileConfig, ...]:
    """The tiles select_config tries for this stage, in order (FP8_CANDIDATES for an fp8 GEMM)."""
    return FP8_CANDIDATES if fp8_operands(spec) else CANDIDATES


def tune_candidates_for(spec: StageSpec) -> tuple[TileConfig, ...]:
    """The tiles the tuner times for this stage (an fp8 GEMM's with fast accumulation too, where
    $CODA_FP8_FAST_ACCUM=1, or =forward for a forward block's, and at a 16-column epilogue subtile,
    where $CODA_FP8_E16=1)."""
    if not fp8_operands(spec):
        return TUNE_CANDIDATES
    out: tuple[TileConfig, ...] = FP8_CANDIDATES
    if fast_accum_on(spec):
        out += FP8_FAST_CANDIDATES
    if fp8_e16_on():
        out += FP8_E16_CANDIDATES
    return out


SMALL_SPILL = (
    16  # bytes: configs_without_spills' tiles that spill a few words, timed after the spill-free ones
)

# A paired stage (acc_pair mode: SwiGLU's half-width stores) keeps quack's epilogue subtile (32
# columns for 16-bit stores; epi_n 0) or a wider one: a half-width store of a narrower subtile is a
# path quack doesn't exercise on SM90.
PAIRED_SUBTILE = TileConstraint(
    of="epi_n",
    multiple_of=32,
    reason="a paired stage keeps quack's epilogue subtile (epi_n=0) or a wider one",
)


def _atom_rows(config: TileConfig) -> int:
    """How many warpgroups quack 0.6.5's SM90 GEMM stacks along M in a tile (its atom_layout_mnk[0]):
    one in a pingpong tile; in a cooperative one, tile_M / 64 below 256 rows and 2 from 256 (192 rows:
    3 for tile_N <= 128, else 1; 320 rows: 1)."""
    if config.pingpong:
        return 1
    if config.tile_m == 320:
        return 1
    if config.tile_m == 192:
        return 3 if config.tile_n <= 128 else 1
    return config.tile_m // 64 if config.tile_m < 256 else 2


def epilogue_subtile_n(spec: StageSpec, config: TileConfig) -> int:
    """The N extent of quack's SM90 epilogue subtile for `config`: its `epi_n` when set, else quack's
    default (`_compute_tile_shape_or_override`): gcd(32, tile_N), but gcd(64, tile_N) for an 8-bit D
    (e4m3, e5m2) where one warpgroup row holds the tile's rows (a pingpong tile; not a cooperative
    tile of 128 or 192 rows stacked in warpgroups)."""
    if config.epi_n:
        return config.epi_n
    stacked = _atom_rows(config) > 1 and (config.tile_m % 128 == 0 or config.tile_m % 192 == 0)
    eight_bit = spec.d is not None and spec.d.dtype in ("e4m3", "e5m2")
    return math.gcd(64 if eight_bit and not stacked else 32, config.tile_n)


# Seen on an H100 (2026-11-25): the cooperative 256x128 kernel of a stage that moves an f32 tile and
# folds column partials never finished; the tuner's first launch hung the GPU. Twice in the Llama
# training step's RMSNorm backwards: `dx1: f32` loaded beside `sum(.., over=M)` (last_bwd at
# 8192x2048x16384), and `dx1: f32` stored beside one (layer_bwd at 8192x2048x3072). The same stages
# with bf16 tiles (llama_mlp's) run at 256x128; until the cause in quack's epilogue is known, a stage
# that loads or stores an f32 tile beside column partials is given pingpong (128-row) tiles only.
WIDE_F32_TILE = TileConstraint(
    of="cooperative",
    equals=0,
    reason="a stage loading or storing an f32 tile beside column partials takes 128-row (pingpong) tiles",
    kernel_only=True,
)


# The hang above was at 256-row cooperative tiles. A block-scaled GEMM runs cooperative tiles only (its
# own mainloop), at 128 rows: such a stage that moves an f32 tile beside column partials (the RMSNorm
# backward in the gate/up data gradient of fp8="blockwise" layers) keeps its 128 x 128 tile, which ran
# on an H200 (2026-11-29, benchmarks/RESULTS.md: the blockwise Llama step)
COOPERATIVE_F32_TILE = TileConstraint(
    of="tile_M",
    equals=128,
    reason="a stage loading or storing an f32 tile beside column partials takes 128-row tiles",
    kernel_only=True,
)


# A block-scaled GEMM (DeepSeek-V3's, plan/block_scaled.py) runs our mainloop, which scales each K
# block of a tile by one block of B's scales (a tile as wide as B's 128-row blocks) and replaces quack's
# cooperative consumer loop (pingpong tiles hand the tensor cores over in quack's own): 128 x 128
# cooperative tiles, among FP8_CANDIDATES (ptxas, sm_90a, 2026-11-28: no spills at clusters 1 and 2).
BLOCK_SCALED_TILE = (
    TileConstraint(
        of="tile_N",
        equals=SCALE_BLOCK,
        reason="a block-scaled GEMM's tile is one block of B's rows",
        kernel_only=True,
    ),
    TileConstraint(
        of="cooperative",
        equals=1,
        reason="a block-scaled GEMM runs its own cooperative mainloop",
        kernel_only=True,
    ),
)


def moves_f32_tile(spec: StageSpec) -> bool:
    """Whether the stage's epilogue loads or stores an f32 tile (D included)."""
    stored = [*spec.outputs, *([spec.d] if spec.d is not None else [])]
    return any(o.role == "tile" and o.dtype == "f32" for o in spec.operands) or any(
        o.dtype == "f32" for o in stored
    )


def f32_tile_beside_partials(spec: StageSpec) -> bool:
    """Whether the stage's epilogue moves an f32 tile beside column partials: the stages WIDE_F32_TILE
    holds to pingpong tiles (and runtime/split_epilogue.py may cut off their GEMM)."""
    return moves_f32_tile(spec) and any(s.layout == "column partials" for s in spec.sinks)


def f32_tile_rows128() -> bool:
    """Whether a stage that moves an f32 tile beside column partials may take cooperative tiles of 128
    rows too (COOPERATIVE_F32_TILE, as a block-scaled one does), not pingpong ones alone
    (WIDE_F32_TILE): $CODA_F32_TILE_RULE=rows128 (experimental: the tuner then times 128 x 128 and
    128 x 192 cooperative for the RMSNorm backwards; the hang was seen at 256 rows, and 128-row
    cooperative tiles of such stages ran on an H200, 2026-11-29). Unset or "pingpong": the default;
    another value is a ValueError naming the variable."""
    got = os.environ.get("CODA_F32_TILE_RULE", "pingpong")
    if got not in ("pingpong", "rows128"):
        raise ValueError(f"$CODA_F32_TILE_RULE is {got!r}; it takes pingpong (the default) or rows128")
    return got == "rows128"


def rules(spec: StageSpec, emulated: bool = False) -> list[TileConstraint]:
    """Every rule a config of this stage must satisfy: the stage's own (`spec.tiling`, which the
    emitted source prints: the groups within the epilogue subtile among them) and the backend's that
    apply to it; `emulated`: without the kernel_only ones (the emulated kernels' grouped folds are
    exact at any subtile, and they never hang)."""
    own = [
        *spec.tiling,
        *([PAIRED_SUBTILE] if spec.paired else []),
        *(
            [COOPERATIVE_F32_TILE if spec.gemm.scaled or f32_tile_rows128() else WIDE_F32_TILE]
            if f32_tile_beside_partials(spec)
            else []
        ),
        *((BLOCK_SCALED_TILE[1:] if spec.gemm.b_columns else BLOCK_SCALED_TILE) if spec.gemm.scaled else ()),
        *(
            TileConstraint(
                of="tile_N",
                divides=o.group,
                reason=f"`expand({o.name}, acc)` reads one column of `{o.name}` per tile, {o.group} columns wide",
                kernel_only=True,
            )
            for o in spec.operands
            if o.op == "GroupColumnLoad"
        ),
    ]
    return [c for c in own if not (emulated and c.kernel_only)]


def tile_values(spec: StageSpec, config: TileConfig) -> dict[TileQuantity, int]:
    """The quantities a TileConstraint may be about, for this config of this stage."""
    return {
        "tile_M": config.tile_m,
        "tile_N": config.tile_n,
        "epi_n": config.epi_n,
        "the epilogue subtile's N": epilogue_subtile_n(spec, config),
        "cooperative": int(not config.pingpong and not config.is_cublas),
    }


def broken(spec: StageSpec, config: TileConfig, emulated: bool = False) -> list[TileConstraint]:
    """The rules of the stage (`rules`) that `config` breaks, in order."""
    values = tile_values(spec, config)
    return [c for c in rules(spec, emulated) if not c.holds(values)]


def fits(spec: StageSpec, config: TileConfig, emulated: bool = False) -> bool:
    """Whether `config` breaks none of the stage's rules (`emulated`: the kernel_only ones aside)."""
    return not broken(spec, config, emulated)
