"""fp8 in the CuTeDSL kernels: a bf16 GEMM's epilogue stores a quantized (e4m3 / e5m2) tile, and a
GEMM multiplies fp8 operands (e4m3 x e4m3, e5m2 x e4m3) read K-major, a per-tensor scale in its epilogue.

- The planner compiles an fp8 stored tile (the stage's D, or a TileStore of an element-mode stage):
  examples/fp8_blockwise.coda's forward (1x128 group amax, then the store), fp8_delayed.coda's first
  stage (a delayed per-tensor scale, this step's amax as a partial), and a stage storing bf16, e4m3
  and e5m2 tiles together. The emitted epilogue clamps each fp8 value to the dtype's range with
  NaN-propagating max/min before quack's store rounds it (the interpreter's saturation rule).
- The fp8 GEMM: fp8_delayed's second stage (`hq @ transpose(w2)`) and a dgrad-like e5m2 x e4m3 GEMM
  plan; what quack 0.6.5's SM90 GEMM can't multiply is E0702 at the operand with the layout that would
  compile: an N-major B (`hq @ w2`, w2 stored [N, P]), a transposed A, fp8 beside bf16.
- A paired stage's half-width fp8 tile (SwiGLU's gate/up GEMM storing e4m3: SWIGLU8) plans as our
  GatedFp8Store (plan/gated_store.py; a 16-bit one keeps quack's TileStore), compiles without spills
  at three tiles, and its register-to-smem layout is checked by tracing CuTeDSL's layouts on the CPU.
- What it still refuses, with E0702/E0703 at the place: an fp8 vector loaded into an epilogue (fp8 tiles
  load: tests/test_fp8_loads.py), `cast(x, e4m3)` inside a stage, a
  full-width fp8 tile stored by a paired stage as two lanes, an f32 half-width one.
- Toolchain (no GPU): the fp8 GEMMs compile for sm_90a without spills at the fp8 tiles
  (config.FP8_CANDIDATES) with fp8 WGMMA (`wgmma...f32.e4m3.e4m3`, `.e5m2.e4m3`); quack accepts the
  whole fp8_delayed forward from the runtime ("meta" tensors). The stores compile without spills, rounding with
  `cvt.rn.satfinite.e4m3x2.f32` / `e5m2x2` after the clamp; quack accepts what the runtime hands it
  (an fp8 D on "meta" tensors).
- GPU (marked `gpu`): the kernels' fp8 codes against the interpreter's, bit for bit (NaN as NaN), where
  the accumulator is exact (an identity A, so acc = B): every e4m3/e5m2 value, the midpoints between
  neighbours and the bf16 values next to them, subnormals, values past the range, and scales of 1,
  2^-8 (subnormal results), 2^100 (products overflow f32 to inf, then saturate), inf and NaN; and the
  examples at ragged sizes against the interpreter within one fp8 ulp (accumulation order differs);
  the fp8 GEMMs (e4m3 x e4m3, e5m2 x e4m3, and the whole fp8_delayed forward) against the interpreter
  within the accuracy rule, and exactly where every product and partial sum is exact in f32.
  The gated fp8 store: every e4m3 / e5m2 code bit for bit where the value before the store is exact
  (SWIGLU8_EXACT, ragged M and F, three tiles), and SWIGLU8 within one fp8 ulp.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import coda_lang
from coda_lang.backend_cute.plan.emit import emit_stage
from coda_lang.backend_cute.plan.planner import plan_stage
from coda_lang.core.diagnostics import CodaError

ROOT = Path(__file__).resolve().parent.parent

# fp8_delayed.coda's first stage, alone
DELAYED = """
dims M, K, N
block fp8_store(x: bf16[M, K], w: bf16[K, N], scale: f32) -> (hq: e4m3[M, N], amax: f32) {
  gemm x @ w {
    hq: e4m3 = acc * scale
    row_amax = max(abs(acc), over=N)
  }
  amax = max(row_amax, over=M)
}
"""

# three stored tiles of three dtypes: e5m2 is D (the last full-width store), bf16 and e4m3 TileStores
MIXED = """
dims M, K, N
block fp8_stores(x: bf16[M, K], w: bf16[K, N], scale: f32)
    -> (h: bf16[M, N], hq: e4m3[M, N], g: e5m2[M, N], amax: f32) {
  gemm x @ w {
    h: bf16 = acc
    hq: e4m3 = acc * scale
    g: e5m2 = acc * scale
    row_amax = max(abs(acc), over=N)
  }
  amax = max(row_amax, over=M)
}
"""

# a dgrad of the fp8 recipes: the e5m2 gradient times the e4m3 weight, both scales folded in
DGRAD = """
dims M, K, N
block dgrad(dy: e5m2[M, N], w: e4m3[K, N], sdy: f32, sw: f32) -> (dx: bf16[M, K]) {
  gemm dy @ transpose(w) {
    dx = acc * (sdy * sw)
  }
}
"""

# fp8 GEMMs quack 0.6.5 does not multiply: (source, stage, message, help)
GEMM_REFUSED = {
    # fp8_delayed as it was written first: w2 stored [N, P], N-major
    "b_n_major": (
        (ROOT / "examples" / "fp8_delayed.coda")
        .read_text()
        .replace("w2: e4m3[P, N]", "w2: e4m3[N, P]")
        .replace("hq @ transpose(w2)", "hq @ w2"),
        2,
        "fp8 GEMM operand `w2` is stored [N, P]: its contiguous dimension is `P`, not K (`N`)",
        "declare `w2` as e4m3[P, N] (K contiguous",
    ),
    "a_m_major": (
        """
dims M, K, N
block b(x: e4m3[K, M], w: e4m3[N, K]) -> (y: bf16[M, N]) {
  gemm transpose(x) @ transpose(w) {
    y = acc
  }
}
""",
        1,
        "fp8 GEMM operand `x` is written `transpose(x)`: stored [K, M], its contiguous dimension is `M`",
        "store `x` as [M, K] (K contiguous)",
    ),
    "mixed_width": (
        """
dims M, K, N
block b(x: bf16[M, K], w: e4m3[N, K], s: f32) -> (y: bf16[M, N]) {
  gemm x @ transpose(w) {
    y = acc * s
  }
}
""",
        1,
        "GEMM operand `x` is bf16 and `w` is e4m3; an fp8 GEMM needs both operands in fp8",
        "quantize `x` too",
    ),
}

REFUSED = {
    # an fp8 vector loaded into an epilogue (an fp8 tile loads: tests/test_fp8_loads.py)
    "load": """
dims M, K, N
block b(x: bf16[M, K], w: bf16[K, N], r: e4m3[N]) -> (y: bf16[M, N]) {
  gemm x @ w {
    y = acc + r
  }
}
""",
    # a fake quantization inside a stage
    "cast": """
dims M, K, N
block b(x: bf16[M, K], w: bf16[K, N], s: f32) -> (y: bf16[M, N]) {
  gemm x @ w {
    y = cast(acc * s, e4m3) / s
  }
}
""",
    # a full-width fp8 tile stored by a paired stage beside its D (as two lanes: quack's gated
    # TileStores, 16-bit only; a half-width fp8 one compiles: SWIGLU8)
    "paired_lanes": """
dims M, K, N
block b(x: bf16[M, K], w: bf16[K, 2*N]) -> (y: bf16[M, N], h: e4m3[M, 2*N], d: bf16[M, 2*N]) {
  gemm x @ w {
    g, u = pairs(acc)
    y = g * u
    h: e4m3 = acc
    d = acc * 2.0
  }
}
""",
    # an f32 half-width tile of a paired stage
    "paired_f32": """
dims M, K, N
block b(x: bf16[M, K], w: bf16[K, 2*N]) -> (y: f32[M, N]) {
  gemm x @ w {
    g, u = pairs(acc)
    y: f32 = g * u
  }
}
""",
}

# SwiGLU's gate/up GEMM of fp8 operands storing its half-width result in fp8 (acc_pair mode: the
# store is GatedFp8Store, plan/gated_store.py); SWIGLU8_EXACT: no silu, so that the kernel's value
# is the interpreter's exactly before the store rounds it
SWIGLU8 = """
dims M, D, F
block g(x: e4m3[M, D], w: e4m3[2*F, D], r: f32[M], s: f32) -> (aq: e4m3[M, F]) {
  gemm x @ transpose(w) {
    z = acc * r
    gt, up = pairs(z)
    aq: e4m3 = silu(gt) * up * s
  }
}
"""
SWIGLU8_EXACT = SWIGLU8.replace("silu(gt) * up * s", "gt * up * s")


def one(source: str) -> coda_lang.Block:
    (blk,) = coda_lang.load(source).blocks.values()
    return blk


def example(name: str) -> coda_lang.Block:
    return coda_lang.load(ROOT / "examples" / f"{name}.coda")[name]


def compiled() -> list[tuple[str, coda_lang.Block]]:
    return [("fp8_blockwise", example("fp8_blockwise")), ("delayed", one(DELAYED)), ("mixed", one(MIXED))]


@pytest.mark.parametrize("i", range(3))
def test_the_fp8_store_is_planned_and_saturated(i: int) -> None:
    """The stored fp8 tiles become D / TileStores of their dtype, each clamped to +-max in the emitted
    epilogue (NaN-propagating), right before it is returned to quack's store."""
    name, blk = compiled()[i]
    spec = plan_stage(blk, 1)
    stored = ([spec.d] if spec.d else []) + list(spec.outputs)
    fp8 = {o.name: o.dtype for o in stored if o.dtype in ("e4m3", "e5m2")}
    assert (
        fp8
        == {"fp8_blockwise": {"yq": "e4m3"}, "delayed": {"hq": "e4m3"}, "mixed": {"hq": "e4m3", "g": "e5m2"}}[
            name
        ]
    )
    src = emit_stage(spec)
    for out, dtype in fp8.items():
        m = {"e4m3": 448.0, "e5m2": 57344.0}[dtype]
        clamp = (
            f"{out}_sat = cute.math.min(cute.math.max({out}, {-m!r}, propagate_nan=True), {m!r}, "
            "propagate_nan=True)"
        )
        assert clamp in src, src
    assert (
        spec.d is not None
        and spec.d.dtype == {"fp8_blockwise": "e4m3", "delayed": "e4m3", "mixed": "e5m2"}[name]
    )
    assert '"D": ' + f"{spec.d.name}_sat" in src
    # a 16-bit tile is stored as it was
    assert '"h": h' in src or name != "mixed"


def test_fp8_gemm_is_planned() -> None:
    """fp8_delayed's second GEMM (e4m3 @ transpose(e4m3), both K-major) and a dgrad's e5m2 x e4m3 plan:
    the scale product is the epilogue's, the operands keep their dtypes."""
    spec = plan_stage(example("fp8_delayed"), 2)
    g = spec.gemm
    assert (g.a_dtype, g.b_dtype, g.ta, g.tb) == ("e4m3", "e4m3", False, True)
    assert spec.d is not None and spec.d.dtype == "bf16" and not spec.plain
    spec = plan_stage(one(DGRAD), 1)
    assert (spec.gemm.a_dtype, spec.gemm.b_dtype, spec.gemm.tb) == ("e5m2", "e4m3", True)
    assert "acc * " in emit_stage(spec)


@pytest.mark.parametrize("what", sorted(GEMM_REFUSED))
def test_fp8_gemm_layouts_refused(what: str) -> None:
    """What quack's SM90 fp8 GEMM can't read is E0702 at the operand, saying which layout would compile;
    the emulated runtime takes it."""
    source, where, want, fix = GEMM_REFUSED[what]
    blk = one(source) if source else example("fp8_delayed")
    with pytest.raises(CodaError) as ei:
        plan_stage(blk, where)
    (d,) = ei.value.diagnostics
    assert d.code == "E0702" and want in d.message, d.message
    assert d.span is not None and d.span.line > 1
    assert any(fix in h for h in d.help), d.help
    assert any("K-major" in n for n in d.notes), d.notes
    assert plan_stage(blk, where, emulated=True) is not None


@pytest.mark.parametrize("what", sorted(REFUSED))
def test_other_fp8_uses_still_refused(what: str) -> None:
    """Refused by the planner, or by the emitter (cast's lowering), at the line that asks for it."""
    blk = one(REFUSED[what])
    with pytest.raises(CodaError) as ei:
        emit_stage(plan_stage(blk, 1))
    (d,) = ei.value.diagnostics
    want = {
        "load": ("E0702", "loaded column vector `r` is e4m3: fp8 vectors are not compiled"),
        "cast": ("E0703", "cast() to e4m3 has no CuTeDSL emitter yet"),
        "paired_lanes": (
            "E0702",
            "full-width (stored as two half-width lanes) stored tile `h` is e4m3; quack stores paired "
            "outputs as 16-bit values",
        ),
        "paired_f32": ("E0702", "half-width stored tile `y` is f32; quack stores paired outputs"),
    }[what]
    assert d.code == want[0] and want[1] in d.message, d.message
    assert d.span is not None and d.span.line > 1
    assert plan_stage(blk, 1, emulated=True) is not None  # the torch stand-ins run it


@pytest.mark.parametrize("dtype", ["e4m3", "e5m2", "bf16"])
def test_gated_fp8_store_is_planned(dtype: str) -> None:
    """A paired stage's half-width fp8 tile plans (no E0702): a gated TileStore of its dtype, emitted as
    our GatedFp8Store, clamped like every fp8 store, with the subtile rule of its TMA store written
    down; a 16-bit one keeps quack's TileStore (its source unchanged)."""
    from coda_lang.backend_cute.build.config import TileConfig, fits

    spec = plan_stage(one(SWIGLU8.replace("aq: e4m3", f"aq: {dtype}")), 1)
    assert spec.paired and spec.d is None
    (out,) = spec.outputs
    assert (out.name, out.dtype, out.gated, out.lane) == ("aq", dtype, True, None)
    src = emit_stage(spec)
    subtile = [c for c in spec.tiling if c.of == "the epilogue subtile's N"]
    if dtype == "bf16":
        assert 'outputs=(TileStore("aq", gated=True),)' in src and "GatedFp8Store" not in src
        assert '"aq": aq}' in src and not subtile
        return
    assert 'outputs=(GatedFp8Store("aq"),)' in src, src
    assert "from coda_lang.backend_cute.plan.gated_store import GatedFp8Store" in src
    assert "from quack.epilogue.ops import ColVecLoad, Scalar\n" in src  # not quack's TileStore
    m = {"e4m3": 448.0, "e5m2": 57344.0}[dtype]
    clamp = (
        f"aq_sat = cute.math.min(cute.math.max(aq, {-m!r}, propagate_nan=True), {m!r}, propagate_nan=True)"
    )
    assert clamp in src and '"aq": aq_sat}' in src, src
    assert [c.multiple_of for c in subtile] == [32] and subtile[0].kernel_only
    assert fits(spec, TileConfig(128, 96)) and fits(spec, TileConfig(128, 128, 2, 1, False))
    assert not fits(spec, TileConfig(128, 112))  # tile_N % 32
    assert not fits(spec, TileConfig(128, 128, epi_n=16))  # 8 fp8 columns: rows of 8 bytes


# --------------------------------------------------------------------------------------- toolchain


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("i", [0, pytest.param(2, marks=pytest.mark.slow)])  # (2, the mixed stage: -m slow)
def test_fp8_store_compiles_to_ptx(i: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    """fp8_blockwise's forward and the bf16 + e4m3 + e5m2 stage compile for sm_90a at 128x128 without
    spills: WGMMA of bf16, the clamp (setp/selp against +-max: NaN compares false and stays), then
    the hardware's saturating round to nearest even, two values per cvt."""
    from coda_lang.backend_cute.build.compile import compile_stage
    from coda_lang.backend_cute.build.config import TileConfig

    name, blk = compiled()[i]
    c = compile_stage(blk, 1, TileConfig(128, 128), directory=tmp_path_factory.mktemp("fp8-kernels"))
    ptx = c.ptx
    assert ".target sm_90a" in ptx and "wgmma.mma_async" in ptx and "bf16.bf16" in ptx
    assert c.report is not None and not c.report.spills, c.report.text
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "0f43E00000" in ptx and "0fC3E00000" in ptx  # +-448
    if name == "mixed":
        assert "cvt.rn.satfinite.e5m2x2.f32" in ptx and "cvt.rn.bf16x2.f32" in ptx
        assert "0f47600000" in ptx and "0fC7600000" in ptx  # +-57344


# the GPU test's tiles: cooperative 128x128 (two warpgroups stacked: a 128x32 subtile), pingpong
# 128x96 (64x32, a ragged half tile of 48 columns) and 128x64 with a 64-column subtile (two 16-column
# STSM blocks per half-width row of it)
GATED_TILES = [((128, 128, 2, 1, False), 0), ((128, 96, 2, 1, True), 0), ((128, 64, 2, 1, True), 64)]


def _gated_tile(i: int) -> Any:
    from coda_lang.backend_cute.build.config import TileConfig

    (m, n, cm, cn, pingpong), epi_n = GATED_TILES[i]
    return TileConfig(m, n, cm, cn, pingpong, epi_n)


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
# (the cooperative tile in the default run; the pingpong ones, whose PTX holds the same ops: -m slow)
@pytest.mark.parametrize(
    "i", [0, *(pytest.param(i, marks=pytest.mark.slow) for i in range(1, len(GATED_TILES)))]
)
def test_gated_fp8_store_compiles_to_ptx(i: int, tmp_path_factory: pytest.TempPathFactory) -> None:
    """SWIGLU8 compiles for sm_90a at the GPU test's tiles without spills: the gated register permute
    (quad shuffles, at f32), the clamp, two values per cvt, then two fp8 per shared store (a universal
    copy, no STSM), and the TMA store of the half-width tile."""
    from coda_lang.backend_cute.build.compile import compile_stage

    c = compile_stage(one(SWIGLU8), 1, _gated_tile(i), directory=tmp_path_factory.mktemp("gated8"))
    ptx = c.ptx
    assert c.report is not None and not c.report.spills, c.report.text
    assert "e4m3.e4m3" in ptx and "cvt.rn.satfinite.e4m3x2.f32" in ptx
    assert "0f43E00000" in ptx and "0fC3E00000" in ptx  # +-448
    assert "shfl.sync.idx" in ptx and "st.shared.b16" in ptx and "stmatrix" not in ptx
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "rows,tile_n,epi",
    [
        (1, 96, (64, 32)),
        # (the same argument at two more layouts, a few seconds of tracing each: -m slow)
        pytest.param(2, 128, (128, 32), marks=pytest.mark.slow),
        pytest.param(1, 64, (64, 64), marks=pytest.mark.slow),
    ],
)
def test_sm90_gated_fp8_store_layout(rows: int, tile_n: int, epi: tuple[int, int]) -> None:
    """The layout argument of plan/gated_store.py, traced on the CPU with CuTeDSL's layouts: the gated
    TileStore's register-to-smem copy (quack's: its atom over D's 16-bit STSM tiled copy) puts, after
    quack's f32 register permute (simulated here: its quad shuffles), each thread's half-width value
    at its own position, for the 8-bit atom (a universal copy of two fp8) as for the 16-bit STSM one,
    and the two atoms map every register to the same position."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as hh
    from cutlass.cute.nvgpu import OperandMajorMode, warp
    from quack import copy_utils

    from coda_lang.backend_cute.build import quack_adapter  # noqa: F401  (CUTE_DSL_ARCH=sm_90a; conftest too)

    epi_m, epi_n = epi
    nthr = 128 * rows
    got: dict[Any, Any] = {}

    def trace() -> None:  # static layouts only: evaluated while tracing
        mma = hh.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.K,
            cutlass.Float32, (rows, 1, 1), tiler_mn=(64, tile_n),
        )  # fmt: skip
        c_atom = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, num_matrices=4), cutlass.Float16)
        d_r2s = cute.make_tiled_copy_S(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), cutlass.BFloat16),
            cute.make_tiled_copy_C_atom(c_atom, mma),
        )  # gemm_sm90.epilog_smem_store_and_partition, D absent (quack builds it in bf16)
        copies = {
            dt: cute.make_tiled_copy_S(copy_utils.get_smem_store_atom(t, False, epi_n // 2), d_r2s)
            for dt, t in (("bf16", cutlass.BFloat16), ("e4m3", cutlass.Float8E4M3FN))
        }  # TileStore._make_copy_atom_r2s / _make_tiled_copy_r2s on SM90
        for t in range(nthr):
            d = d_r2s.get_slice(t).partition_S(cute.make_identity_tensor((epi_m, epi_n)))
            got["D", t] = [tuple(d[j]) for j in range(cute.size(d))]
            aux_shape = cute.recast_layout(2, 1, cute.make_layout(d.shape)).shape  # visit.py's aux frag
            for dt, tc in copies.items():
                rt = tc.retile(cute.make_rmem_tensor(aux_shape, cutlass.Float32))
                at = tc.get_slice(t).partition_S(cute.make_identity_tensor((epi_m, epi_n // 2)))
                got[dt, t] = {
                    cute.crd2idx(cute.idx2crd(j, rt.shape), rt.layout): tuple(at[cute.idx2crd(j, at.shape)])
                    for j in range(cute.size(rt))
                }
        got["atom"] = str(copies["e4m3"])

    @cute.jit
    def probe() -> None:
        trace()

    probe()
    assert "CopyUniversal" in got["atom"] or "f8E4M3FN" in got["atom"], got["atom"]
    nv = len(got["D", 0]) // 2
    before = {}
    for t in range(nthr):  # aux value i of a thread: its D pair (2i, 2i + 1), half-width column c // 2
        pairs_ = [(got["D", t][2 * i], got["D", t][2 * i + 1]) for i in range(nv)]
        assert all(a[0] == b[0] and a[1] % 2 == 0 and b[1] == a[1] + 1 for a, b in pairs_)
        before[t] = [(a[0], a[1] // 2) for a, _ in pairs_]

    def parts(t: int, g: int) -> tuple[Any, ...]:
        v, lane03 = before[t][4 * g : 4 * g + 4], t % 4 in (0, 3)
        return (v[0], v[1], v[2], v[3]) if lane03 else (v[2], v[3], v[0], v[1])  # x0, x1, y0, y1

    for dt in ("bf16", "e4m3"):
        seen = set()
        for t in range(nthr):  # layout_utils.permute_gated_Cregs_f32, lane by lane
            q = t % 4
            upper = q // 2 if q % 2 == 0 else 3 - q // 2
            for g in range(nv // 4):
                x0, x1, _, _ = parts(t - q + upper, g)
                _, _, y0, y1 = parts(t - q + (upper ^ 1), g)
                after = [x0, y0, x1, y1] if q in (0, 3) else [y0, x0, y1, x1]
                for k in range(4):
                    pos = got[dt, t][4 * g + k]
                    assert after[k] == pos, (dt, t, 4 * g + k, after[k], pos)
                    seen.add(pos)
        assert len(seen) == epi_m * epi_n // 2, dt
    assert all(got["bf16", t] == got["e4m3", t] for t in range(nthr))


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_quack_accepts_an_fp8_d_from_the_runtime(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the runtime allocates and hands quack for the delayed-scale stage (an e4m3 D, the scale, the
    amax partials), as "meta" tensors: quack validates it and compiles the kernel, without a GPU."""
    import torch

    from coda_lang.backend_cute.build import quack_adapter

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path_factory.mktemp("fp8-dry")))
    blk = one(DELAYED)
    cb = blk.cuda(tile=(128, 128))
    r = cb.runner(1)
    env: dict[str, Any] = {
        "x": torch.empty((1000, 520), dtype=torch.bfloat16, device="meta"),
        "w": torch.empty((520, 1008), dtype=torch.bfloat16, device="meta"),
        "scale": 0.5,
    }
    ins, scalars = r.arguments(env)
    assert ins[0] is not None and ins[1] is not None
    outs = r.allocate(ins[0], ins[1])
    assert outs[0].dtype == torch.float8_e4m3fn and tuple(outs[0].shape) == (1000, 1008)
    D, C, epi = r.epilogue_arguments(ins, scalars, outs)
    quack_adapter.launch(r.mod, r.spec, r.config, ins[0], ins[1], D, epi, C=C, dry_run=True)


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("src", ["fp8_delayed", "dgrad"])
def test_fp8_gemm_compiles_to_ptx(src: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """fp8_delayed's e4m3 x e4m3 GEMM and the dgrad's e5m2 x e4m3 compile for sm_90a at the first fp8
    tile (cooperative 128x128) without spills, with fp8 WGMMA (k32) of the two dtypes only."""
    from coda_lang.backend_cute.build.compile import compile_stage
    from coda_lang.backend_cute.build.config import FP8_CANDIDATES

    blk, index = (example("fp8_delayed"), 2) if src == "fp8_delayed" else (one(DGRAD), 1)
    c = compile_stage(blk, index, FP8_CANDIDATES[0], directory=tmp_path_factory.mktemp("fp8-gemm"))
    ptx = c.ptx
    assert c.report is not None and not c.report.spills, c.report.text
    want = "e4m3.e4m3" if src == "fp8_delayed" else "e5m2.e4m3"
    wgmma = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k32\.f32\.(\w+\.\w+)", ptx))
    assert wgmma == {want}, wgmma
    assert "bf16.bf16" not in ptx and "add.f32" in ptx


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_quack_accepts_the_fp8_forward_from_the_runtime(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole fp8_delayed forward as the runtime hands it to quack ("meta" tensors): stage 1 stores an
    e4m3 hq, stage 2 multiplies it by w2 [P, N] passed (n, k); quack validates both and compiles."""
    import torch

    from coda_lang.backend_cute.build import quack_adapter

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path_factory.mktemp("fp8-dry")))
    blk = example("fp8_delayed")
    cb = blk.cuda(tile=(128, 128))
    m, k, n, p = 1000, 512, 1008, 528
    env: dict[str, Any] = {
        "x": torch.empty((m, k), dtype=torch.bfloat16, device="meta"),
        "w": torch.empty((k, n), dtype=torch.bfloat16, device="meta"),
        "scale": 0.5,
        "inv": 2.0,
        "w2": torch.empty((p, n), dtype=torch.float8_e4m3fn, device="meta"),
    }
    for index in (1, 2):
        r = cb.runner(index)
        if index == 2:
            r.config = replace(r.config, pingpong=False)  # FP8_CANDIDATES[0]
        ins, scalars = r.arguments(env)
        assert ins[0] is not None and ins[1] is not None
        outs = r.allocate(ins[0], ins[1])
        if index == 1:
            env["hq"] = outs[0]
            assert outs[0].dtype == torch.float8_e4m3fn
        else:
            assert outs[0].dtype == torch.bfloat16 and tuple(outs[0].shape) == (m, p)
            assert tuple(ins[1].shape) == (p, n) and not r.spec.plain
        D, C, epi = r.epilogue_arguments(ins, scalars, outs)
        quack_adapter.launch(r.mod, r.spec, r.config, ins[0], ins[1], D, epi, C=C, dry_run=True)
    # a K the TMA loads can't take (rows of 1000 bytes: not a multiple of 16) is E0807 before quack
    env["hq"] = torch.empty((m, 1000), dtype=torch.float8_e4m3fn, device="meta")
    env["w2"] = torch.empty((p, 1000), dtype=torch.float8_e4m3fn, device="meta")
    with pytest.raises(CodaError) as ei:
        cb.runner(2).arguments(env)
    assert ei.value.diagnostics[0].code == "E0807"


# --------------------------------------------------------------------------------------------- GPU

FP8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def probe_values(dtype: str) -> np.ndarray:
    """bf16 values that test a rounding to `dtype`: every finite fp8 value, the midpoints between
    neighbours (ties: nearest even decides), the bf16 values next to each midpoint, values past the
    range and up to bf16's largest; no -0 (a GEMM's sum may give +0 for it)."""
    bf16 = ml_dtypes.bfloat16
    codes = np.arange(256, dtype=np.uint8).view(FP8[dtype]).astype(np.float32)
    pos = np.unique(codes[np.isfinite(codes) & (codes >= 0)])
    mids = (pos[:-1] + pos[1:]) / 2
    up = np.nextafter(mids.astype(bf16), bf16(np.inf)).astype(np.float32)
    down = np.nextafter(mids.astype(bf16), bf16(0)).astype(np.float32)
    top = float(pos[-1])
    past = np.array([top * 1.03, top * 1.0625, top * 1.07, top * 1.125, top * 2, 1e30, 3.38e38], np.float32)
    v = np.concatenate([pos[pos > 0], mids, up, down, past])
    v = v.astype(bf16).astype(np.float32)
    return np.concatenate([v, -v, [0.0]]).astype(np.float32)


def codes(x: Any, dtype: str) -> np.ndarray:
    """fp8 codes of a kernel output (a torch fp8 tensor) or an interpreter output (f32 fp8 values)."""
    if hasattr(x, "view") and "torch" in type(x).__module__:
        import torch

        return x.detach().cpu().view(torch.uint8).numpy()
    return np.asarray(x, np.float32).astype(FP8[dtype]).view(np.uint8)


def same_codes(name: str, got: Any, want: Any, dtype: str) -> None:
    """Bit for bit, NaN as NaN (the hardware's NaN is 0x7F; the interpreter keeps a NaN's sign)."""
    g, w = codes(got, dtype), codes(want, dtype)
    nan = 0x7F if dtype == "e4m3" else None
    gn = (g & 0x7F) == 0x7F if nan else ((g & 0x7C) == 0x7C) & ((g & 0x03) != 0)
    wn = (w & 0x7F) == 0x7F if nan else ((w & 0x7C) == 0x7C) & ((w & 0x03) != 0)
    assert np.array_equal(gn, wn), f"{name}: NaN at {np.argwhere(gn != wn)[:4].tolist()}"
    bad = (g != w) & ~gn
    at = tuple(np.argwhere(bad)[0]) if bad.any() else None
    assert at is None, f"{name}: {int(bad.sum())} codes differ; first at {at}: {g[at]:#04x} vs {w[at]:#04x}"


def exact_inputs(dtype: str, n: int) -> dict[str, Any]:
    """x = I (M = K = 256), w holds the probe values (repeated to [256, n]): acc = w exactly."""
    import torch

    v = probe_values(dtype)
    w = np.resize(v, (256, n)).astype(np.float32)
    return {
        "x": torch.eye(256, dtype=torch.bfloat16, device="cuda"),
        "w": torch.from_numpy(w).to(torch.bfloat16).cuda(),
    }


SCALES = [1.0, 2.0**-8, 2.0**100, float("inf"), float("nan"), 0.37]


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("src", ["delayed", "mixed"])
def test_gpu_fp8_store_bit_for_bit(src: str, scale: float) -> None:
    """The kernel's e4m3 (and e5m2) codes equal the interpreter's where acc is exact, special scales
    included; the amax and the bf16 tile exactly."""
    import torch

    os.environ.setdefault("CODA_TUNE", "0")
    blk = one(DELAYED if src == "delayed" else MIXED)
    cb = blk.cuda(poison=True)
    for dtype in ("e4m3", "e5m2") if src == "mixed" else ("e4m3",):
        ins = {**exact_inputs(dtype, 1024), "scale": scale}
        outs = cb(ins)
        torch.cuda.synchronize()
        ref = blk.run({k: v.cpu() if hasattr(v, "cpu") else v for k, v in ins.items()})
        for o in blk.ir.outputs:
            assert o.type is not None
            if o.type.dtype in FP8:
                same_codes(
                    f"{o.name} ({dtype} probes, scale {scale})", outs[o.name], ref[o.name], o.type.dtype
                )
            else:
                got = outs[o.name].float().cpu().numpy()
                assert np.array_equal(got, np.asarray(ref[o.name], np.float32), equal_nan=True), o.name


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("src", ["fp8_blockwise", "delayed", "mixed"])
def test_gpu_fp8_store_matches_interpreter(src: str) -> None:
    """Random inputs at ragged sizes (M = 1000, K = 520; N = 1024 for the 1x128 groups, else 1008):
    within one fp8 ulp of the interpreter (the GEMM's summation order differs), amax within f32's."""
    import torch
    from runtime_check import example_inputs

    from coda_lang.testing.compare import mismatch

    os.environ.setdefault("CODA_TUNE", "0")
    blk = example(src) if src == "fp8_blockwise" else one(DELAYED if src == "delayed" else MIXED)
    sizes = {"M": 1000, "K": 520, "N": 1024 if src == "fp8_blockwise" else 1008}
    ins = example_inputs(blk, sizes, seed=3, device="cuda")
    if "amax" in {o.name for o in blk.ir.outputs} and src != "fp8_blockwise":
        # a scale of 448 / (half the largest |acc|): the top half of the range saturates
        first = blk.run({**{k: v.cpu() for k, v in ins.items()}, "scale": 1.0})
        ins["scale"] = 448.0 / (0.5 * float(first["amax"]))
    cb = blk.cuda(poison=True)
    outs = cb(ins)
    torch.cuda.synchronize()
    cpu = {k: v.cpu() if hasattr(v, "cpu") else v for k, v in ins.items()}
    ref = blk.run(cpu, sim_tile=cb.tiles)
    for o in blk.ir.outputs:
        assert o.type is not None
        got = outs[o.name]
        g = got.float() if got.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16) else got
        assert not torch.isnan(g).any(), f"{o.name}: NaN (unwritten?)"
        why = mismatch(o.name, g, ref[o.name], None, o.type.dtype)
        assert why is None, why


# scales of SWIGLU8_EXACT's runs: with the products of two e4m3 values (and r^2 in [1/16, 16]) they
# reach every code of either fp8 dtype (subnormals from 2^-12 down, saturation, inf and NaN scales)
GATED_SCALES = [
    1.0,
    2.0**-6,
    2.0**-12,
    2.0**-18,
    2.0**-24,
    2.0**10,
    2.0**100,
    float("inf"),
    float("nan"),
    0.37,
]


def gated_exact_inputs(device: str) -> dict[str, Any]:
    """x = I (M = D = 208: a ragged M tile), w [2F, D] (F = 208: ragged half tiles at tile_N 128, 96
    and 64) of e4m3 values, r powers of two, so acc * r and every product is exact in f32: gt runs
    through every e4m3 value (NaN aside) down the rows, up through them at another stride."""
    import torch

    e4m3 = np.arange(256, dtype=np.uint8).view(FP8["e4m3"]).astype(np.float32)
    vals = e4m3[np.isfinite(e4m3)]  # 254 values, +-0 included
    m = f = 208
    i = np.arange(m)[None, :]
    j = np.arange(f)[:, None]
    w = np.empty((2 * f, m), np.float32)
    w[0::2] = vals[(i + 13 * j) % len(vals)]
    w[1::2] = vals[(7 * i + 31 * j + 100) % len(vals)]
    r = 2.0 ** ((np.arange(m) % 5) - 2)
    return {
        "x": torch.eye(m).to(torch.float8_e4m3fn).to(device),
        "w": torch.from_numpy(w).to(torch.float8_e4m3fn).to(device),
        "r": torch.from_numpy(r.astype(np.float32)).to(device),
    }


def check_gated_exact(dtype: str, tile: Any, emulate: bool) -> set[int]:
    """SWIGLU8_EXACT storing `dtype` at `tile`, each scale of GATED_SCALES, against the interpreter bit
    for bit (NaN as NaN, unwritten elements are the poison's NaN); returns the codes the interpreter
    gave (a test of the inputs: all of them)."""
    import torch

    blk = one(SWIGLU8_EXACT.replace("aq: e4m3", f"aq: {dtype}"))
    device = "cpu" if emulate else "cuda"
    ins = gated_exact_inputs(device)
    cb = blk.cuda(tile=tile, poison=True, emulate=emulate, tune=False)
    cpu = {k: v.cpu() for k, v in ins.items()}
    reached: set[int] = set()
    for scale in GATED_SCALES:
        got = cb({**ins, "s": scale})["aq"]
        if not emulate:
            torch.cuda.synchronize()
        assert got.shape == (208, 208)
        ref = blk.run({**cpu, "s": scale})["aq"]
        same_codes(f"aq ({dtype}, {tile}, scale {scale})", got, ref, dtype)
        reached |= set(codes(ref, dtype).ravel().tolist())
    return reached


def test_gated_exact_inputs_reach_every_code() -> None:
    """The GPU test's inputs, on the emulated runtime (CPU): the interpreter's codes are all 256 of
    e4m3 and e5m2 (NaN as the interpreter writes it), the emulated store gives them bit for bit."""
    for dtype in ("e4m3", "e5m2"):
        reached = check_gated_exact(dtype, _gated_tile(1), emulate=True)
        finite = np.arange(256, dtype=np.uint8).view(FP8[dtype]).astype(np.float32)
        want = {int(c) for c in np.nonzero(np.isfinite(finite))[0]}
        assert want <= reached, sorted(want - reached)[:8]
        assert any(not np.isfinite(finite[c]) for c in reached)  # inf (e5m2) / NaN reached too


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("dtype,i", [("e4m3", 0), ("e4m3", 1), ("e4m3", 2), ("e5m2", 1)])
def test_gpu_gated_fp8_store_bit_for_bit(dtype: str, i: int) -> None:
    """A paired stage's half-width fp8 store (GatedFp8Store) on the GPU: the kernel's codes equal the
    interpreter's bit for bit where the value before the store is exact (SWIGLU8_EXACT), every code
    of the dtype reached over the scales, at ragged M and F, at the three GATED_TILES (e5m2 at one)."""
    check_gated_exact(dtype, _gated_tile(i), emulate=False)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("i", [0, 1])
def test_gpu_gated_fp8_swiglu_matches_interpreter(i: int) -> None:
    """SWIGLU8 itself (quack's silu) at ragged sizes (M = 1000, D = 512, F = 1008) from random inputs:
    within one fp8 ulp of the interpreter, no element unwritten."""
    import torch
    from runtime_check import example_inputs

    from coda_lang.testing.compare import mismatch

    blk = one(SWIGLU8)
    ins = example_inputs(blk, {"M": 1000, "D": 512, "F": 1008}, seed=4, device="cuda")
    ins["s"] = 5.0  # the largest values saturate
    cb = blk.cuda(tile=_gated_tile(i), poison=True, tune=False)
    got = cb(ins)["aq"]
    torch.cuda.synchronize()
    ref = blk.run({k: v.cpu() if hasattr(v, "cpu") else v for k, v in ins.items()}, sim_tile=cb.tiles)
    g = got.float()
    assert not torch.isnan(g).any(), "aq: NaN (unwritten?)"
    why = mismatch("aq", g, ref["aq"], None, "e4m3")
    assert why is None, why


# e4m3 x e4m3 with both scales: fp8_delayed's second GEMM with its scales as inputs
E4M3_GEMM = DGRAD.replace("dy: e5m2", "dy: e4m3")


def fp8_gemm_inputs(src: str, exact: bool, device: str) -> dict[str, Any]:
    """dy [M, N] and w [K, N] (N, the GEMM's K, is 1024; M = 1000, K = 520: ragged tiles). `exact`:
    values in {-1, 0, 1} and power-of-two scales, so every product and sum is exact in f32 and the
    kernel's bf16 must equal the interpreter's bit for bit; else randn values and scales 0.37, 1/300."""
    import torch

    g = torch.Generator().manual_seed(5)
    m, k, n = 1000, 520, 1024
    dy_t = torch.float8_e5m2 if src == "dgrad" else torch.float8_e4m3fn
    if exact:
        dy = torch.randint(-1, 2, (m, n), generator=g).float()
        w = torch.randint(-1, 2, (k, n), generator=g).float()
        sdy, sw = 0.25, 2.0**-3
    else:
        dy, w = torch.randn(m, n, generator=g) * 8, torch.randn(k, n, generator=g) * 30
        sdy, sw = 0.37, 1 / 300
    return {"dy": dy.to(dy_t).to(device), "w": w.to(torch.float8_e4m3fn).to(device), "sdy": sdy, "sw": sw}


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("src", ["e4m3", "dgrad"])
def test_gpu_fp8_gemm_matches_interpreter(src: str, exact: bool) -> None:
    """The fp8 GEMM (e4m3 x e4m3, e5m2 x e4m3) against the interpreter (fp8 upcast to f32, f32 sums):
    bit for bit where everything is exact, else within the accuracy rule."""
    import torch

    from coda_lang.testing.compare import mismatch

    os.environ.setdefault("CODA_TUNE", "0")
    blk = one(DGRAD if src == "dgrad" else E4M3_GEMM)
    ins = fp8_gemm_inputs(src, exact, "cuda")
    cb = blk.cuda(poison=True)
    got = cb(ins)["dx"]
    torch.cuda.synchronize()
    ref = blk.run({k: v.cpu() if hasattr(v, "cpu") else v for k, v in ins.items()})["dx"]
    g = got.float().cpu().numpy()
    assert not np.isnan(g).any(), "NaN (unwritten?)"
    if exact:
        assert np.array_equal(g, np.asarray(ref, np.float32))
    else:
        why = mismatch("dx", got.float(), ref, None, "bf16")
        assert why is None, why


# fp8_delayed.coda with its quantized tile hq an output too: the test reads the kernel's own hq
DELAYED_WITH_HQ = (
    (ROOT / "examples" / "fp8_delayed.coda")
    .read_text()
    .replace("-> (out: bf16[M, P], amax: f32)", "-> (out: bf16[M, P], hq: e4m3[M, N], amax: f32)")
)


def test_delayed_with_hq_is_the_example_with_one_more_output() -> None:
    blk, ex = one(DELAYED_WITH_HQ), example("fp8_delayed")
    assert [o.name for o in blk.ir.outputs] == ["out", "hq", "amax"]
    assert [o.name for o in ex.ir.outputs] == ["out", "amax"]


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_gpu_fp8_delayed_forward_matches_interpreter() -> None:
    """The whole examples/fp8_delayed.coda forward on the kernels (two stages: the quantizing
    epilogue, then the e4m3 GEMM), with hq made an output. hq's rounding of the f32 sums may differ by
    one fp8 ulp where the two summation orders straddle a midpoint, and one such code moves `out` by
    up to an e4m3 ulp (1/8 of the value) times w2, past the bf16 accuracy rule. So: hq within one fp8
    ulp of the interpreter's and equal to it in all but a few codes in 10^4; `out` against float64 of
    the kernel's own hq times w2 and the inverse scale, within the accuracy rule (a wrong GEMM, layout
    or scale can't hide behind a flipped code); the amax within f32's."""
    import torch

    from coda_lang.testing.compare import mismatch

    os.environ.setdefault("CODA_TUNE", "0")
    blk = one(DELAYED_WITH_HQ)
    g = torch.Generator().manual_seed(9)
    m, k, n, p = 1000, 520, 1024, 528
    cpu: dict[str, Any] = {
        "x": torch.randn(m, k, generator=g).bfloat16(),
        "w": (torch.randn(k, n, generator=g) / 20).bfloat16(),
        "scale": 1.0,
        "w2": (torch.randn(p, n, generator=g) / 4).to(torch.float8_e4m3fn),
    }
    cpu["scale"] = 448.0 / (0.5 * float(blk.run(cpu)["amax"]))  # the top half of the range saturates
    ins = {k_: v.cuda() if isinstance(v, torch.Tensor) else v for k_, v in cpu.items()}
    cb = blk.cuda(poison=True)
    outs = cb(ins)
    torch.cuda.synchronize()
    ref = blk.run(cpu, sim_tile=cb.tiles)
    hq = outs["hq"].float()
    assert not torch.isnan(hq).any(), "hq: NaN (unwritten?)"
    why = mismatch("hq", hq, ref["hq"], None, "e4m3")
    assert why is None, why
    flipped = int((hq.cpu() != torch.as_tensor(np.asarray(ref["hq"], np.float32))).sum())
    assert flipped <= hq.numel() // 2000, f"hq: {flipped} of {hq.numel()} codes differ"
    inv = float(np.float32(1.0) / np.float32(cpu["scale"]))
    want = (hq.double().cpu() @ cpu["w2"].double().T * inv).numpy()
    out = outs["out"].float()
    assert not torch.isnan(out).any(), "out: NaN (unwritten?)"
    why = mismatch("out", out, want, None, "bf16")
    assert why is None, why
    why = mismatch("amax", outs["amax"], ref["amax"], None, "f32")
    assert why is None, why


def test_epilogue_subtile_of_an_fp8_d_is_quacks() -> None:
    """quack 0.6.5 widens its SM90 epilogue subtile to gcd(64, tile_N) for an 8-bit D where one
    warpgroup row holds the tile (pingpong); a cooperative 128- or 256-row tile keeps gcd(32, tile_N),
    as a 16-bit D does everywhere. The grouped statistics' tiling rule reads this width."""
    from coda_lang.backend_cute.build.config import TileConfig, epilogue_subtile_n

    fp8 = plan_stage(one(DELAYED), 1)
    bf16 = plan_stage(one(DELAYED.replace("hq: e4m3", "hq: bf16")), 1)
    assert fp8.d is not None and fp8.d.dtype == "e4m3"
    assert bf16.d is not None and bf16.d.dtype == "bf16"
    for tile, want8, want16 in [
        (TileConfig(128, 128), 64, 32),
        (TileConfig(128, 96), 32, 32),
        (TileConfig(128, 128, 2, 1, False), 32, 32),
        (TileConfig(256, 128, 2, 1, False), 32, 32),
        (TileConfig(128, 128, epi_n=16), 16, 16),
    ]:
        assert epilogue_subtile_n(fp8, tile) == want8, tile
        assert epilogue_subtile_n(bf16, tile) == want16, tile


def test_detach_is_the_identity_in_a_kernel() -> None:
    """The planner reads `detach` as the identity: fp8_blockwise's detached grouped amax is the stored
    reduction itself (one store, under the output's name); a detached value the stage also reads
    undetached (acc) is a copy."""
    from coda_lang.backend_cute.plan.context import without_detach

    blk = example("fp8_blockwise")
    (st,) = blk.ir.stages
    plain = without_detach(st)
    assert [e.op for e in st.body if e.op == "detach"] == ["detach"]
    assert all(e.op != "detach" for e in plain.body) and len(plain.body) == len(st.body) - 1
    (amax,) = [e for e in plain.body if any(v.name == "amax" for v in e.outs)]
    assert amax.op == "reduce_max" and amax.param("group") == 128
    twice = one(
        """
dims M, K, N
block b(x: bf16[M, K], w: bf16[K, N]) -> (y: bf16[M, N]) {
  gemm x @ w {
    t = detach(acc)
    y = t * t + acc
  }
}
"""
    )
    (st2,) = twice.ir.stages
    assert [e.op for e in without_detach(st2).body].count("copy") == 1
    src = emit_stage(plan_stage(twice, 1))
    assert "detach" not in src


# ------------------------------------------------------------------ a derived backward's fp8 operands


def _backward(fp8_grads: str | None) -> coda_lang.Block:
    options = coda_lang.BackwardOptions(fp8_grads=fp8_grads) if fp8_grads else None
    d = example("fp8_delayed").derivation(["x", "w", "w2"], backward=options)
    assert d.backward.ir.derived and not d.forward.ir.derived
    return d.backward


def _gemm_stages(blk: coda_lang.Block) -> list[int]:
    from coda_lang.ir.nodes import Stage

    stages = [s for s in blk.ir.body if isinstance(s, Stage)]
    return [k for k, s in enumerate(stages, 1) if s.is_gemm]


def test_derived_backward_multiplies_fp8_beside_bf16_in_bf16() -> None:
    """fp8_delayed's derived backward with bf16 cotangents: its GEMMs read the e4m3 weight and the
    saved e4m3 hq beside a bf16 cotangent, which quack's fp8 GEMM can't multiply: each such fp8
    operand is multiplied in bf16, which the runtime casts it to (exactly). A user's block with such
    a GEMM is still E0702 (test_fp8_gemm_layouts_refused); the emulated plan keeps fp8."""
    import torch

    bwd = _backward(None)
    fp8_ops = 0
    declared = {p.var.name: p.var.type.dtype for p in bwd.ir.params if p.var.type is not None}
    for k in _gemm_stages(bwd):
        spec = plan_stage(bwd, k)
        g = spec.gemm
        assert (g.a_dtype, g.b_dtype) == ("bf16", "bf16"), (k, g)
        assert not (g.copy_a or g.copy_b)
        if declared.get(g.a) in ("e4m3", "e5m2") or declared.get(g.b) in ("e4m3", "e5m2"):
            fp8_ops += 1
            emulated = plan_stage(bwd, k, emulated=True).gemm
            assert "e4m3" in (emulated.a_dtype, emulated.b_dtype), emulated
    assert fp8_ops >= 1
    # the runtime's arguments: the fp8 weight handed to the GEMM in bf16
    cb = bwd.cuda(tile=(128, 128))
    k = next(k for k in _gemm_stages(bwd) if plan_stage(bwd, k).gemm.b == "w2")
    r = cb.runner(k)
    m, n, p = 1000, 1024, 528
    env: dict[str, Any] = {
        "w2": torch.empty((p, n), dtype=torch.float8_e4m3fn, device="meta"),
        r.spec.gemm.a: torch.empty((m, p), dtype=torch.bfloat16, device="meta"),
    }
    env.update({o.name: 1.0 for o in r.spec.operands if o.name not in env})
    ins, _ = r.arguments(env)
    assert ins[1] is not None and ins[1].dtype == torch.bfloat16 and tuple(ins[1].shape) == (p, n)


def test_derived_backward_multiplies_fp8_cotangents_in_fp8() -> None:
    """With e5m2 cotangents, the backward's GEMMs of two fp8 operands stay fp8 and are compiled
    K-major: the weight gradient `transpose(dacc2) @ hq` (both stored M-major) with K-major copies of
    both, the data gradient `dacc2 @ w2` (w2 stored [P, N]: N-major) with one of w2. The GEMMs of
    16-bit operands are as they were. The emulated plan keeps the program's layouts."""
    bwd = _backward("e5m2")
    got = {}
    for k in _gemm_stages(bwd):
        g = plan_stage(bwd, k).gemm
        got[(g.a, g.b)] = g
        emulated = plan_stage(bwd, k, emulated=True).gemm
        assert not (emulated.copy_a or emulated.copy_b)
    wgrad, dgrad = got[("dacc2", "hq")], got[("dacc2", "w2")]
    assert (wgrad.a_dtype, wgrad.b_dtype) == ("e5m2", "e4m3") == (dgrad.a_dtype, dgrad.b_dtype)
    assert (wgrad.ta, wgrad.tb, wgrad.copy_a, wgrad.copy_b) == (False, True, True, True)
    assert (dgrad.ta, dgrad.tb, dgrad.copy_a, dgrad.copy_b) == (False, True, False, True)
    assert all(
        g.a_dtype == g.b_dtype == "bf16" and not (g.copy_a or g.copy_b)
        for g in got.values()
        if g not in (wgrad, dgrad)
    )


@pytest.mark.parametrize("m", [1000, 1024])
def test_runtime_hands_the_fp8_gemm_k_major_copies(m: int) -> None:
    """The runtime's arguments of those two GEMMs (CPU tensors): A [M, K] and B [N, K], K contiguous,
    each a copy of what is stored the other way round, and a K that is not a multiple of 16 (the
    weight gradient's: the tokens) zero-padded in both; their product is the program's GEMM."""
    import torch

    bwd = _backward("e5m2")
    cb = bwd.cuda(tile=(128, 128))
    n, p = 1024, 528
    gen = torch.Generator().manual_seed(3)
    dacc2 = (torch.randn((m, p), generator=gen) * 4).to(torch.float8_e5m2)
    hq = (torch.randn((m, n), generator=gen) * 4).to(torch.float8_e4m3fn)
    w2 = (torch.randn((p, n), generator=gen) * 4).to(torch.float8_e4m3fn)
    values = {"dacc2": dacc2, "hq": hq, "w2": w2}
    for k in _gemm_stages(bwd):
        r = cb.runner(k)
        g = r.spec.gemm
        if not (g.copy_a or g.copy_b):
            continue
        env: dict[str, Any] = {name: values[name] for name in (g.a, g.b)}
        env.update({o.name: 1.0 for o in r.spec.operands if o.name not in env})
        ins, _ = r.arguments(env)
        A, B = ins[0], ins[1]
        assert A is not None and B is not None
        assert A.dtype == values[g.a].dtype and B.dtype == values[g.b].dtype
        assert A.is_contiguous() and B.is_contiguous() and A.shape[1] == B.shape[1] and A.shape[1] % 16 == 0
        a, b = values[g.a].double(), values[g.b].double()
        want = (a.t() if g.copy_a else a) @ (b if g.copy_b else b.t())
        assert torch.equal(A.double() @ B.double().t(), want)
        kk = a.shape[0] if g.copy_a else a.shape[1]
        assert torch.equal(A[:, kk:].double(), torch.zeros_like(A[:, kk:].double()))
        assert A.shape[1] == -(-kk // 16) * 16


@pytest.mark.toolchain
@pytest.mark.slow  # (CI minutes: the same bf16 WGMMA path as the default run's other derived compiles)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_derived_backward_with_an_e4m3_weight_compiles(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The dgrad GEMM of the e4m3 weight (multiplied in bf16) compiles for sm_90a without spills, as a
    bf16 WGMMA."""
    from coda_lang.backend_cute.build.compile import compile_stage
    from coda_lang.backend_cute.build.config import TileConfig

    bwd = _backward(None)
    k = next(k for k in _gemm_stages(bwd) if plan_stage(bwd, k).gemm.b == "w2")
    c = compile_stage(bwd, k, TileConfig(128, 128), directory=tmp_path_factory.mktemp("fp8-bwd"))
    assert "wgmma.mma_async" in c.ptx and "bf16.bf16" in c.ptx and "e4m3" not in c.ptx
    assert c.report is not None and not c.report.spills, c.report.text


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("operands", [("dacc2", "hq"), ("dacc2", "w2")])
def test_derived_fp8_gemms_compile_to_fp8_wgmma(
    operands: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The e5m2-cotangent backward's weight and data gradient GEMMs compile for sm_90a without spills
    as e5m2 x e4m3 WGMMAs (not a bf16 one)."""
    from coda_lang.backend_cute.build.compile import compile_stage
    from coda_lang.backend_cute.build.config import FP8_CANDIDATES, candidates_for

    bwd = _backward("e5m2")
    k = next(
        k for k in _gemm_stages(bwd) if (plan_stage(bwd, k).gemm.a, plan_stage(bwd, k).gemm.b) == operands
    )
    assert candidates_for(plan_stage(bwd, k)) == FP8_CANDIDATES
    c = compile_stage(bwd, k, FP8_CANDIDATES[0], directory=tmp_path_factory.mktemp("fp8-bwd8"))
    assert re.search(r"wgmma\.mma_async\S*\.e5m2\.e4m3", c.ptx), "no e5m2 x e4m3 WGMMA"
    assert "bf16.bf16" not in c.ptx
    assert c.report is not None and not c.report.spills, c.report.text


# an fp8 MLP: its derived backward's SwiGLU stage (the down projection's dgrad) is packed (it reads
# the saved gate/up pre-activation as its C) and, with e5m2 cotangents, stores an e5m2 D
MLP8 = """
dims M, D, F
block mlp(x: e4m3[M, D], w: e4m3[2*F, D], w2: e4m3[D, F], s_a: f32, inv1: f32, inv2: f32) -> (out: bf16[M, D]) {
  gemm x @ transpose(w) {
    z = acc * inv1
    gt, up = pairs(z)
    aq: e4m3 = silu(gt) * up * s_a
  }
  gemm aq @ transpose(w2) {
    out = acc * inv2
  }
}
"""


def _mlp8_backward() -> coda_lang.Block:
    d = one(MLP8).derivation(["x", "w", "w2"], backward=coda_lang.BackwardOptions(fp8_grads="e5m2"))
    return d.backward


def _packed_stage(blk: coda_lang.Block) -> int:
    return next(k for k in _gemm_stages(blk) if plan_stage(blk, k).mode == "packed_cd_b16x2")


@pytest.mark.usefixtures("narrowing")
def test_packed_fp8_d_is_stored_in_bf16_rounded_to_odd() -> None:
    """The packed SwiGLU stage's e5m2 D (quack's packed mode stores C's dtype only) is planned as a
    bf16 D narrowed by the runtime; the emitted epilogue clamps each lane to +-57344, then rounds it
    to odd, before quack packs it. Its other GEMMs multiply fp8 by fp8. The emulated plan stores e5m2."""
    bwd = _mlp8_backward()
    k = _packed_stage(bwd)
    spec = plan_stage(bwd, k)
    assert spec.d is not None and (spec.d.dtype, spec.d.narrow) == ("bf16", "e5m2")
    emulated = plan_stage(bwd, k, emulated=True)
    assert emulated.d is not None and (emulated.d.dtype, emulated.d.narrow) == ("e5m2", None)
    src = emit_stage(spec)
    name = spec.d.py
    for lane in (0, 1):
        sat = re.search(
            rf"{name}_{lane}_sat = cute\.math\.min\(cute\.math\.max\({name}_{lane}, -57344\.0", src
        )
        odd = re.search(rf"{name}_{lane}_sat_odd = round_odd_bf16\({name}_{lane}_sat\)", src)
        assert sat and odd and sat.start() < odd.start(), src
    assert f'"D": pack({name}_0_sat_odd, {name}_1_sat_odd)' in src
    assert all(plan_stage(bwd, j).gemm.a_dtype == "e5m2" for j in _gemm_stages(bwd))


def _round_odd_bf16(x: np.ndarray) -> np.ndarray:
    """epi_ops.round_odd_bf16's PTX, bit for bit: the low 16 bits cut, the last kept bit set if any was."""
    b = x.astype(np.float32).view(np.uint32)
    r = (b & np.uint32(0xFFFF0000)) | np.where(b & np.uint32(0xFFFF), np.uint32(0x10000), np.uint32(0))
    return r.astype(np.uint32).view(np.float32)


def _round_odd_f16(x: np.ndarray) -> np.ndarray:
    """epi_ops.round_odd_f16's PTX: x rounded toward zero to f16, its last bit set if that was
    inexact (a NaN is unequal: it stays NaN), as f32."""
    x = x.astype(np.float32)
    h = x.astype(np.float16)  # (to nearest; stepped toward zero where that went past x)
    h = np.where(np.abs(h.astype(np.float32)) > np.abs(x), np.nextafter(h, np.float16(0)), h)
    inexact = ~(h.astype(np.float32) == x)
    return (h.view(np.uint16) | inexact.astype(np.uint16)).view(np.float16).astype(np.float32)


@pytest.mark.parametrize("carrier", ["bf16", "f16"])
@pytest.mark.parametrize("dtype", ["e5m2", "e4m3"])
def test_round_to_odd_then_nearest_even_is_the_direct_rounding(dtype: str, carrier: str) -> None:
    """Rounding to bf16 or f16 (a packed stage's C dtype) by rounding to odd, then to fp8 to nearest
    even (the kernel's store, then the runtime's narrowing: torch's cast on the CPU), gives the
    interpreter's direct rounding of the clamped f32 value, code for code: every fp8 code's neighbourhood (the midpoints between codes and
    one f32 ulp either side, where a double rounding through bf16 to nearest would err), subnormals,
    random values of every magnitude, the range's ends, NaN."""
    import torch

    from coda_lang.backend_cute.runtime.launch import _narrow
    from coda_lang.core.numerics import round_fp8

    fmax = 57344.0 if dtype == "e5m2" else 448.0
    mlt = ml_dtypes.float8_e5m2 if dtype == "e5m2" else ml_dtypes.float8_e4m3fn
    codes = np.arange(256, dtype=np.uint8).view(mlt).astype(np.float32)
    codes = np.sort(codes[np.isfinite(codes)])
    mids = ((codes[1:].astype(np.float64) + codes[:-1]) / 2).astype(np.float32)
    near = np.concatenate(
        [mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))]
    )
    rng = np.random.default_rng(5)
    rand = (rng.standard_normal(200_000) * np.exp2(rng.uniform(-30, 18, 200_000))).astype(np.float32)
    x = np.concatenate(
        [codes, near, rand, np.float32([fmax, -fmax, 1e30, -1e30, np.inf, -np.inf, np.nan, 0.0, -0.0])]
    )
    clamped = np.clip(x, -fmax, fmax)  # (the epilogue's clamp; NaN stays NaN)
    if carrier == "bf16":
        carried = _round_odd_bf16(clamped)
        bits = torch.from_numpy(carried.view(np.uint32) >> 16).to(torch.int32).to(torch.int16)
        held = bits.view(torch.bfloat16)
    else:
        carried = _round_odd_f16(clamped)
        held = torch.from_numpy(carried.astype(np.float16))
    # (the carrier is exactly a value of its dtype: its bits, a NaN as a NaN: f16's payload widens
    # differently in torch and NumPy)
    nan = np.isnan(carried)
    assert np.array_equal(np.isnan(held.float().numpy()), nan)
    assert np.array_equal(held.float().numpy()[~nan].view(np.uint32), carried[~nan].view(np.uint32))
    got = _narrow(held, dtype).float().numpy()
    want = round_fp8(x, dtype).astype(np.float32)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    assert same.all(), (x[~same][:5], got[~same][:5], want[~same][:5])
    assert np.array_equal(np.signbit(got[~np.isnan(got)]), np.signbit(want[~np.isnan(want)]))
    # and rounding to the carrier to nearest first would not do (the test can tell the two apart)
    nearest = torch.from_numpy(clamped).to(torch.bfloat16 if carrier == "bf16" else torch.float16)
    assert not np.array_equal(
        nearest.to(getattr(torch, "float8_e5m2" if dtype == "e5m2" else "float8_e4m3fn"))
        .float()
        .numpy()[: len(codes) + len(near)],
        want[: len(codes) + len(near)],
    )


@pytest.mark.usefixtures("narrowing")
@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_packed_fp8_d_compiles(tmp_path_factory: pytest.TempPathFactory) -> None:
    """That packed stage compiles for sm_90a without spills, an e5m2 x e4m3 WGMMA, the rounding to odd
    inlined (its mask of the 16 cut bits), and no e5m2 conversion of D (the runtime narrows it)."""
    from coda_lang.backend_cute.build.compile import compile_stage
    from coda_lang.backend_cute.build.config import candidates_for

    bwd = _mlp8_backward()
    k = _packed_stage(bwd)
    c = compile_stage(
        bwd, k, candidates_for(plan_stage(bwd, k))[0], directory=tmp_path_factory.mktemp("packed8")
    )
    assert re.search(r"wgmma\.mma_async\S*\.e5m2\.e4m3", c.ptx)
    assert "and.b32" in c.ptx and "65535" in c.ptx
    assert "e5m2x2" not in c.ptx  # (aq's e4m3 store is there; D is stored as bf16 pairs)
    assert c.report is not None and not c.report.spills, c.report.text


def _gpu_backward_matches(
    block: coda_lang.Block,
    d: Any,
    ins: dict[str, Any],
    cots: dict[str, Any],
    scale: float,
    bounded: bool = False,
) -> None:
    """`d`'s derived backward on the kernels against the interpreter on the same backward inputs (every
    fp8 cotangent scale `scale`), within the accuracy rule; `bounded`: where the plain rule fails for an
    element, within its rounding bound too (as `coda fuzz` judges)."""
    import torch
    from runtime_check import to_torch

    from coda_lang.interp import bound
    from coda_lang.testing.compare import mismatch

    os.environ.setdefault("CODA_TUNE", "0")
    fwd = d.forward.run(ins)
    bins, bdims = block.backward_inputs(d, ins, cots, fwd, None)
    for name in d.scales:
        bins[name] = np.float32(scale)
    ref, bounds = bound.run(d.backward, bins, bdims) if bounded else (d.backward.run(bins, dims=bdims), {})
    got = d.backward.cuda(poison=True)({name: to_torch(np.asarray(v), "cuda") for name, v in bins.items()})
    torch.cuda.synchronize()
    for o in d.backward.ir.outputs:
        assert o.type is not None
        g = got[o.name]
        g = g.float() if isinstance(g, torch.Tensor) and g.dtype != torch.float32 else g
        why = mismatch(o.name, g, ref[o.name], None, o.type.dtype)
        if why is not None and bounded:
            why = mismatch(o.name, g, ref[o.name], None, o.type.dtype, bound=bounds[o.name])
        assert why is None, why


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("fp8_grads", [None, "e5m2"])
def test_gpu_fp8_delayed_backward_matches_interpreter(fp8_grads: str | None) -> None:
    """fp8_delayed's derived backward on the kernels (bf16 cotangents: its fp8 operands multiplied in bf16;
    e5m2 cotangents: fp8 GEMMs on K-major copies, K = 1000 padded to 1008) against the
    interpreter on the same backward inputs, within the accuracy rule."""
    block = example("fp8_delayed")
    options = coda_lang.BackwardOptions(fp8_grads=fp8_grads) if fp8_grads else None
    d = block.derivation(["x", "w", "w2"], backward=options)
    rng = np.random.default_rng(21)
    m, k, n, p = 1000, 520, 1024, 528
    ins = {
        "x": rng.standard_normal((m, k)).astype(np.float32),
        "w": (rng.standard_normal((k, n)) / 20).astype(np.float32),
        "scale": np.float32(60.0),
        "w2": (rng.standard_normal((p, n)) / 4).astype(ml_dtypes.float8_e4m3fn).astype(np.float32),
    }
    cots = {"out": rng.standard_normal((m, p)).astype(np.float32), "amax": np.float32(0.0)}
    _gpu_backward_matches(block, d, ins, cots, 3000.0)


@pytest.mark.usefixtures("narrowing")
@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("m", [1000, 1024])
def test_gpu_fp8_mlp_backward_matches_interpreter(m: int) -> None:
    """MLP8's e5m2-cotangent backward on the kernels (every GEMM fp8 by fp8 on K-major copies; the
    packed SwiGLU stage's e5m2 D stored in bf16 rounded to odd, narrowed by the runtime) against the
    interpreter on the same backward inputs, within the accuracy rule (ragged M: the weight
    gradients' K padded to 16). An e5m2 cotangent whose value before rounding lies near a midpoint
    may round to the other neighbour in one of the two runs: the rule's per-element rounding bound
    allows for that where the plain rule does not."""
    mlp8_backward_matches(m)


def mlp8_backward_matches(m: int) -> None:
    """MLP8's e5m2-cotangent backward on the kernels against the interpreter at m rows (a GPU test's
    body: the default path here, the pair store's in tests/test_fp8_pairs.py)."""
    block = one(MLP8)
    d = block.derivation(["x", "w", "w2"], backward=coda_lang.BackwardOptions(fp8_grads="e5m2"))
    rng = np.random.default_rng(23)
    dd, f = 528, 544

    def e4m3(a: np.ndarray) -> np.ndarray:
        return a.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)

    ins = {
        "x": e4m3(rng.standard_normal((m, dd)) * 4),
        "w": e4m3(rng.standard_normal((2 * f, dd)) * 4),
        "w2": e4m3(rng.standard_normal((dd, f)) * 4),
        "s_a": np.float32(8.0),
        "inv1": np.float32(1 / 256),
        "inv2": np.float32(1 / 512),
    }
    cots = {"out": rng.standard_normal((m, dd)).astype(np.float32)}
    _gpu_backward_matches(block, d, ins, cots, 4096.0, bounded=True)


# a packed stage of your own storing an e5m2 D: the SwiGLU backward's shape (C's pairs times the acc)
PACKED_E5M2 = """
dims M, N, F
block p(g: bf16[M, N], w: bf16[N, F], c: bf16[M, 2*F], s: f32) -> (dz: e5m2[M, 2*F]) {
  gemm g @ w {
    gt, up = pairs(c)
    dz: e5m2 = interleave(acc * gt, acc * up) * s
  }
}
"""


def _packed_exact_inputs(m: int, f: int, scale: float, dtype: str = "bf16") -> dict[str, Any]:
    """g a 0/1 selection of w's rows (so acc is a w row, exactly), w and c bf16 values of few
    significand bits (their products often an e5m2 midpoint) and random ones, NaN and inf in c."""
    rng = np.random.default_rng(7)
    n = 64
    g = np.zeros((m, n), np.float32)
    g[np.arange(m), rng.integers(0, n, m)] = 1.0
    few = rng.integers(1, 16, (n, f)) * np.exp2(rng.integers(-8, 6, (n, f))) * rng.choice([-1, 1], (n, f))
    w = np.where(rng.random((n, f)) < 0.5, few, rng.standard_normal((n, f)) * 8).astype(np.float32)
    cf = rng.integers(1, 16, (m, 2 * f)) * np.exp2(rng.integers(-12, 4, (m, 2 * f)))
    c = np.where(rng.random((m, 2 * f)) < 0.5, cf, rng.standard_normal((m, 2 * f)) * 100).astype(np.float32)
    c.flat[rng.integers(0, c.size, 40)] = np.nan
    c.flat[rng.integers(0, c.size, 40)] = np.inf
    kind = ml_dtypes.bfloat16 if dtype == "bf16" else np.float16
    bf = lambda a: a.astype(kind).astype(np.float32)  # noqa: E731
    return {"g": g, "w": bf(w), "c": bf(c), "s": np.float32(scale)}


def _packed_e5m2(dtype: str) -> coda_lang.Block:
    """PACKED_E5M2 with its 16-bit inputs (and so C) in `dtype`."""
    return one(PACKED_E5M2.replace("bf16", dtype))


@pytest.mark.usefixtures("narrowing")
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_packed_e5m2_plans_narrowed(dtype: str) -> None:
    """A block of your own whose packed stage stores e5m2 plans as the derived one does: D in C's
    dtype (bf16 or f16), rounded to odd by the op of that dtype, narrowed by the runtime."""
    spec = plan_stage(_packed_e5m2(dtype), 1)
    assert spec.mode == "packed_cd_b16x2" and spec.d is not None
    assert (spec.d.dtype, spec.d.narrow) == (dtype, "e5m2")
    src = emit_stage(spec)
    other = "f16" if dtype == "bf16" else "bf16"
    assert f"round_odd_{dtype}(" in src and f"round_odd_{other}(" not in src


@pytest.mark.usefixtures("narrowing")
@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("dtype", ["bf16", pytest.param("f16", marks=pytest.mark.slow)])
def test_packed_e5m2_compiles(dtype: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """That stage compiles for sm_90a without spills at 128x128 (the 128x192 candidate spills a few
    bytes, which the tile choice skips), its rounding to odd inlined: the bf16 one's mask of the 16
    cut bits, the f16 one's conversion toward zero."""
    from coda_lang.backend_cute.build.compile import compile_stage
    from coda_lang.backend_cute.build.config import candidates_for

    blk = _packed_e5m2(dtype)
    cfg = next(c for c in candidates_for(plan_stage(blk, 1)) if c.short == "128x128")
    c = compile_stage(blk, 1, cfg, directory=tmp_path_factory.mktemp("pk8"))
    assert ("cvt.rz.f16.f32" in c.ptx) == (dtype == "f16")
    if dtype == "bf16":
        assert "and.b32" in c.ptx and "65535" in c.ptx
    assert c.report is not None and not c.report.spills, c.report.text


@pytest.mark.usefixtures("narrowing")
@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("scale", [1.0, 2.0**-10, 2.0**12])
def test_gpu_packed_e5m2_d_bit_for_bit(scale: float, dtype: str) -> None:
    """That packed stage on the kernel (bf16 rounded to odd, then the runtime's narrowing) against the
    interpreter's direct rounding, code for code, where the value before the store is exact (acc a row
    of w, times a bf16 value, times a power of 2): midpoints, subnormals (2^-10), saturation (2^12),
    NaN and infinities from C."""
    packed_bit_for_bit(_packed_e5m2(dtype), scale, dtype)


def packed_bit_for_bit(blk: coda_lang.Block, scale: float, dtype: str, tile: Any = None) -> None:
    """PACKED_E5M2's stage `blk` on the kernel against the interpreter, code for code, on
    `_packed_exact_inputs` (a GPU test's body: the default path here, the pair store's in
    tests/test_fp8_pairs.py); `tile`: the stage's TileConfig (None: the one select_config picks)."""
    import torch
    from runtime_check import to_torch

    os.environ.setdefault("CODA_TUNE", "0")
    ins = _packed_exact_inputs(1000, 528, scale, dtype)
    want = blk.run(ins)["dz"]
    got = blk.cuda(tile=tile, poison=True)({k: to_torch(np.asarray(v), "cuda") for k, v in ins.items()})["dz"]
    fp8 = blk.ir.outputs[0].type.dtype  # (e5m2, or e4m3 for a block of e4m3 cotangents)
    assert got.dtype == {"e5m2": torch.float8_e5m2, "e4m3": torch.float8_e4m3fn}[fp8]
    got_codes = got.view(torch.uint8).cpu().numpy()
    np_fp8 = {"e5m2": ml_dtypes.float8_e5m2, "e4m3": ml_dtypes.float8_e4m3fn}[fp8]
    want_codes = np.asarray(want, np.float32).astype(np_fp8).view(np.uint8)
    nan = np.isnan(np.asarray(want, np.float32))
    assert np.array_equal(np.isnan(got.float().cpu().numpy()), nan)
    same = (got_codes == want_codes) | nan
    assert same.all(), (np.argwhere(~same)[:5], got_codes[~same][:5], want_codes[~same][:5])


@pytest.mark.slow  # (two compiles at 128x256 for an opt-in variable; its tuning: test_fast_accumulation_is_timed_only_when_asked)
@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_fast_accumulation_drops_the_second_accumulator(tmp_path_factory: pytest.TempPathFactory) -> None:
    """An fp8 GEMM at 128x256 (cooperative, cluster 2x1) spills with quack's second f32 accumulator
    and not with fast accumulation (`TileConfig.fast_accum`), whose PTX adds no K tile's result into a
    second accumulator: fewer f32 adds in the mainloop. The two are separate cache entries; a config
    without it keeps the key it had before the field existed."""
    from dataclasses import asdict

    from coda_lang.backend_cute.build.cache import ptx_key
    from coda_lang.backend_cute.build.compile import compile_spec
    from coda_lang.backend_cute.build.config import TileConfig

    spec = plan_stage(example("fp8_delayed"), 2)  # hq @ transpose(w2), e4m3 x e4m3
    slow_cfg = TileConfig(128, 256, 2, 1, False)
    fast_cfg = TileConfig(128, 256, 2, 1, False, fast_accum=True)
    d = tmp_path_factory.mktemp("fp8-fast")
    slow, fast = compile_spec(spec, slow_cfg, directory=d), compile_spec(spec, fast_cfg, directory=d)
    assert slow.report is not None and fast.report is not None
    assert slow.report.spills and not fast.report.spills, (slow.report.text, fast.report.text)
    adds = [len(re.findall(r"\badd\.(?:rn\.)?f32\b", c.ptx)) for c in (slow, fast)]
    assert adds[1] < adds[0], adds
    source = emit_stage(spec)
    assert ptx_key(source, slow_cfg) != ptx_key(source, fast_cfg)
    from coda_lang.backend_cute.build import cache

    # (the key of a config at the defaults, computed as it was before `fast_accum` existed)
    old = {k: v for k, v in asdict(slow_cfg).items() if k not in ("epi_n", "fast_accum")}
    key = {
        "source": cache.source_hash(source),
        "emitter": cache.EMITTER_VERSION,
        "coda": cache.kernel_fingerprint(),
        "arch": cache.ARCH,
        "config": old,
        "libraries": cache.library_versions(),
    }
    assert ptx_key(source, slow_cfg) == hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def test_fast_accumulation_is_timed_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tuner's fp8 candidates gain the fast-accumulation tiles only with $CODA_FP8_FAST_ACCUM=1;
    a bf16 stage's never do. The label says which."""
    from coda_lang.backend_cute.build.config import FP8_FAST_CANDIDATES, TileConfig, tune_candidates_for

    fp8 = plan_stage(example("fp8_delayed"), 2, emulated=True)
    bf16 = plan_stage(example("llama_mlp"), 1, emulated=True)
    monkeypatch.delenv("CODA_FP8_FAST_ACCUM", raising=False)
    assert not any(c.fast_accum for c in tune_candidates_for(fp8))
    monkeypatch.setenv("CODA_FP8_FAST_ACCUM", "1")
    assert set(FP8_FAST_CANDIDATES) <= set(tune_candidates_for(fp8))
    assert not any(c.fast_accum for c in tune_candidates_for(bf16))
    c = TileConfig(128, 256, 2, 1, False, fast_accum=True)
    assert c.short == "128x256f" and str(c).endswith("fast fp8 accumulation")
    from coda_lang.backend_cute.build import tune

    # (a choice made among the default candidates is not taken for one among these)
    shape = (8192, 2048, 8192)
    assert tune.disk_key("src", shape, "H100", "fp8-fast-accum") != tune.disk_key("src", shape, "H100")


def test_fast_accumulation_for_the_forward_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """$CODA_FP8_FAST_ACCUM=forward: the fast-accumulation tiles are timed for a forward block's fp8
    GEMM (fp8_delayed's `hq @ transpose(w2)`) and not for its derived backward's (`transpose(dacc2)
    @ hq`, e5m2 by e4m3), each keeping its own tuning-cache variant; another value is refused."""
    from coda_lang.backend_cute.build.config import fast_accum_on, fp8_tuning_variant, tune_candidates_for

    block = example("fp8_delayed")
    fwd = plan_stage(block, 2)
    bwd = plan_stage(block.grad(backward=coda_lang.BackwardOptions(fp8_grads="e5m2")), 5)
    assert not fwd.derived and bwd.derived and bwd.gemm.a_dtype == "e5m2"
    monkeypatch.setenv("CODA_FP8_FAST_ACCUM", "forward")
    assert any(c.fast_accum for c in tune_candidates_for(fwd))
    assert not any(c.fast_accum for c in tune_candidates_for(bwd))
    assert fp8_tuning_variant(fwd) == "fp8-fast-accum" and fp8_tuning_variant(bwd) is None
    monkeypatch.setenv("CODA_FP8_FAST_ACCUM", "1")
    assert any(c.fast_accum for c in tune_candidates_for(bwd))
    monkeypatch.setenv("CODA_FP8_FAST_ACCUM", "fwd")
    with pytest.raises(ValueError, match="takes 0, 1 or forward"):
        fast_accum_on(fwd)


def test_the_16_column_subtiles_are_timed_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """$CODA_FP8_E16=1 adds the fp8 tiles at a 16-column epilogue subtile to the tuner's candidates of
    an fp8 stage (after the default ones, so an untuned pick is unchanged), never a bf16 stage's; each
    set of candidates keeps its own choice in the tuning cache (its variant), fast accumulation too."""
    from coda_lang.backend_cute.build.config import (
        FP8_CANDIDATES,
        FP8_E16_CANDIDATES,
        candidates_for,
        fp8_tuning_variant,
        tune_candidates_for,
    )

    fp8 = plan_stage(example("fp8_delayed"), 2, emulated=True)
    bf16 = plan_stage(example("llama_mlp"), 1, emulated=True)
    monkeypatch.delenv("CODA_FP8_FAST_ACCUM", raising=False)
    monkeypatch.delenv("CODA_FP8_E16", raising=False)
    assert tune_candidates_for(fp8) == FP8_CANDIDATES and fp8_tuning_variant(fp8) is None
    monkeypatch.setenv("CODA_FP8_E16", "1")
    assert tune_candidates_for(fp8) == FP8_CANDIDATES + FP8_E16_CANDIDATES
    assert all(c.epi_n == 16 for c in FP8_E16_CANDIDATES)
    assert candidates_for(fp8) == FP8_CANDIDATES  # (the untuned pick's list)
    assert not any(c.epi_n == 16 and c.tile_n == 96 for c in tune_candidates_for(bf16))
    assert fp8_tuning_variant(fp8) == "fp8-e16" and fp8_tuning_variant(bf16) is None
    monkeypatch.setenv("CODA_FP8_FAST_ACCUM", "1")
    assert fp8_tuning_variant(fp8) == "fp8-fast-accum+fp8-e16"
    monkeypatch.delenv("CODA_FP8_E16")
    assert fp8_tuning_variant(fp8) == "fp8-fast-accum"  # (the key the fast-accumulation choices had)
