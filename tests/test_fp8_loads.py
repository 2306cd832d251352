"""fp8 tiles loaded into a GEMM's epilogue: an e4m3 or e5m2 tile read beside the accumulator (an fp8
saved activation, a quantized residual), in an element-mode stage and in a paired one (SwiGLU's
gate/up stage reading a full-width tile as two lanes).

- CPU: each plans as quack's TileLoad of the fp8 dtype (one lane, or two in the paired stage), and the
  emitted source names it; fp8 vectors, and a packed stage's double-width fp8 tile, stay refused
  (E0702 at the load, with the fix). On the torch stand-ins (`Block.cuda(emulate=True)`) both give
  the interpreter's values bit for bit, ragged sizes included. A tile whose rows are under 16 bytes
  (8 e4m3 columns) is handed to the kernel in rows padded to 16 bytes (TMA's rule), values unchanged.
- Toolchain: the stage compiles for sm_90a without spills, each pair of codes widened by one
  `cvt.rn.f16x2.e4m3x2` (`e5m2x2`), exact.
- A packed stage's double-width fp8 tile (the SwiGLU backward reading an fp8 gate/up copy, the step
  that saving it in fp8 needs: docs/design.md), beside an fp8 D: loaded as int16 words of two codes,
  unpacked in the epilogue, the stage in quack's element mode; planned, emitted, compiled (CPU),
  handed over as int16 words, and bit for bit on the GPU. Beside a 16-bit D, or with
  $CODA_FP8_PAIR_LOAD=0, it is E0702.
- GPU (marked `gpu`): the kernels against the interpreter, bit for bit, on inputs where every value
  before the bf16 store is exact in f32: every fp8 code (NaN included; not e5m2's infinities, which
  the interpreter binds saturated), ragged
  M, rows of 520 and of 8 fp8 values (padded), both dtypes, both modes.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
from test_fp8_kernels import same_codes  # noqa: E402  (fp8 codes bit for bit, NaN as NaN)

import coda_lang
from coda_lang.backend_cute.plan.emit import emit_stage
from coda_lang.backend_cute.plan.planner import plan_stage
from coda_lang.core.diagnostics import CodaError

# y = acc * r * s: with acc an integer of 5 bits and s = 0.375, every product is exact in f32
ELEMENT = """
dims M, K, N
block b(x: bf16[M, K], w: bf16[K, N], r: {dt}[M, N], s: f32) -> (y: bf16[M, N]) {{
  gemm x @ w {{
    y = acc * r * s
  }}
}}
"""

# both lanes of r in the paired stage: (gt * rg) * (up * ru), exact in f32 for 5-bit integer accs
PAIRED = """
dims M, K, F
block b(x: bf16[M, K], w: bf16[K, 2*F], r: {dt}[M, 2*F]) -> (y: bf16[M, F]) {{
  gemm x @ w {{
    gt, up = pairs(acc)
    rg, ru = pairs(r)
    y = (gt * rg) * (up * ru)
  }}
}}
"""

# a packed stage (the SwiGLU backward's form) reading the double-width tile in fp8: still refused
PACKED = """
dims M, K, F
block b(dh: bf16[M, K], w: bf16[F, K], g: {dt}[M, 2*F]) -> (dg: bf16[M, 2*F]) {{
  gemm dh @ transpose(w) {{
    gt, up = pairs(g)
    dg = interleave(acc * up, acc * gt)
  }}
}}
"""

# the same packed stage storing its double-width result in e5m2 (as pairs, by default): the form in which
# it may read an fp8 tile (exact in f32: 5-bit integer accs, fp8 codes, s = 0.375)
PACKED_FP8 = """
dims M, K, F
block b(dh: bf16[M, K], w: bf16[F, K], g: {dt}[M, 2*F], s: f32) -> (dg: e5m2[M, 2*F]) {{
  gemm dh @ transpose(w) {{
    gt, up = pairs(g)
    dg = interleave(acc * up * s, acc * gt * s)
  }}
}}
"""

SOURCES = {"element": ELEMENT, "paired": PAIRED}


def block(kind: str, dtype: str) -> coda_lang.Block:
    return next(iter(coda_lang.load(SOURCES[kind].format(dt=dtype))))


@pytest.mark.parametrize("dtype", ["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", ["element", "paired"])
def test_an_fp8_tile_load_is_planned(kind: str, dtype: str) -> None:
    spec = plan_stage(block(kind, dtype), 1)
    assert spec.mode == ("element" if kind == "element" else "acc_pair")
    (r,) = [o for o in spec.operands if o.name == "r"]
    assert (r.op, r.dtype, r.lanes) == ("TileLoad", dtype, 1 if kind == "element" else 2)
    width = "N" if kind == "element" else "2*F"
    assert f"load   r: {dtype}[M, {width}] tile (TileLoad)" in emit_stage(spec)


@pytest.mark.parametrize("dtype", ["e4m3", "e5m2"])
def test_a_packed_stages_fp8_tile_is_still_refused(dtype: str) -> None:
    blk = next(iter(coda_lang.load(PACKED.format(dt=dtype))))
    with pytest.raises(CodaError) as ei:
        plan_stage(blk, 1)
    (d,) = ei.value.diagnostics
    assert d.code == "E0702" and f"the double-width tile `g` is {dtype}" in d.message, d.message
    assert d.span is not None and d.span.line == 5
    assert plan_stage(blk, 1, emulated=True) is not None  # the torch stand-ins run it


@pytest.fixture
def pair_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default, whatever the environment running the tests sets."""
    monkeypatch.delenv("CODA_FP8_PAIR_LOAD", raising=False)


def packed_fp8(dtype: str) -> coda_lang.Block:
    return next(iter(coda_lang.load(PACKED_FP8.format(dt=dtype))))


def test_switched_off_a_packed_fp8_tile_says_what_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODA_FP8_PAIR_LOAD", "0")
    with pytest.raises(CodaError) as ei:
        plan_stage(packed_fp8("e4m3"), 1)
    (d,) = ei.value.diagnostics
    assert d.code == "E0702" and any("CODA_FP8_PAIR_LOAD=0" in n for n in d.notes), d.notes


@pytest.mark.parametrize("dtype", ["e4m3", "e5m2"])
def test_a_packed_stage_loads_fp8_pairs_as_int16_words(dtype: str, pair_load: None) -> None:
    from coda_lang.backend_cute.plan.spec import FP8_WORDS

    spec = plan_stage(packed_fp8(dtype), 1)
    assert spec.mode == "packed_cd_b16x2" and spec.quack_mode == "element" and spec.c is None
    (g,) = [o for o in spec.operands if o.name == "g"]
    assert (g.op, g.dtype, g.host, g.lanes) == ("TileLoad", dtype, FP8_WORDS, 2)
    assert spec.d is None and [(o.name, o.pairs, o.dtype) for o in spec.outputs] == [("dg", True, "e5m2")]
    src = emit_stage(spec)
    assert f"unpack_{dtype}x2({g.py})" in src and "pack_e5m2x2(" in src


def test_beside_a_16_bit_d_a_packed_fp8_tile_is_refused(pair_load: None) -> None:
    blk = next(iter(coda_lang.load(PACKED.format(dt="e4m3"))))
    with pytest.raises(CodaError) as ei:
        plan_stage(blk, 1)
    (d,) = ei.value.diagnostics
    assert d.code == "E0702" and "only beside an fp8 D stored as pairs" in d.message, d.message
    assert d.span is not None and d.span.line == 5


def test_the_packed_fp8_tile_is_handed_over_as_int16_words(pair_load: None) -> None:
    import torch

    from coda_lang.backend_cute.build.config import TileConfig
    from coda_lang.backend_cute.runtime.launch import StageRunner

    blk = packed_fp8("e4m3")
    spec = plan_stage(blk, 1)
    g = torch.arange(48 * 32, dtype=torch.int32).remainder(256).to(torch.uint8).view(48, 32)
    env = {
        "dh": torch.ones(48, 16, dtype=torch.bfloat16),
        "w": torch.ones(16, 16, dtype=torch.bfloat16),
        "g": g.view(torch.float8_e4m3fn),
        "s": 0.375,
    }
    ins, _ = StageRunner(blk, 1, spec, TileConfig(128, 128), emulate=False).arguments(env)
    words = ins[2 + [o.name for o in spec.operands].index("g")]
    assert words is not None and words.dtype == torch.int16 and tuple(words.shape) == (48, 16)
    assert torch.equal(words.view(torch.uint8), g)  # (lane 0, the even column, in the low byte)


def exact_inputs(kind: str, dtype: str, m: int, n: int, device: str, seed: int = 0) -> dict[str, Any]:
    """x, w in {-1, 0, 1} with K = 16 (|acc| <= 16, exact); r every code of `dtype` (NaN included),
    then random codes; `n`: the loaded tile's width. e5m2's infinities are left out: the interpreter
    binds an fp8 input saturated (docs/language.md, "fp8"), the kernels read the codes as given."""
    import torch

    rng = np.random.default_rng(seed)
    k = 16
    cols = n // 2 if kind == "paired" else n
    x = rng.integers(-1, 2, (m, k)).astype(np.float32)
    w = rng.integers(-1, 2, (k, n)).astype(np.float32)
    every = np.arange(256, dtype=np.uint8)
    codes = (
        np.concatenate([every, rng.integers(0, 256, m * n - 256, dtype=np.uint8)]) if m * n > 256 else every
    )
    if dtype == "e5m2":  # (an fp8 input binds saturated in the interpreter: its infinities are +-max)
        codes = np.where(codes == 0x7C, 0x7B, np.where(codes == 0xFC, 0xFB, codes)).astype(np.uint8)
    r = torch.from_numpy(codes[: m * n].reshape(m, n).copy()).view(
        {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[dtype]
    )
    ins: dict[str, Any] = {
        "x": torch.from_numpy(x).to(torch.bfloat16).to(device),
        "w": torch.from_numpy(w).to(torch.bfloat16).to(device),
        "r": r.to(device),
    }
    if kind == "element":
        ins["s"] = 0.375
    assert cols > 0
    return ins


def same_bf16(got: Any, want: Any) -> None:
    """bf16 codes equal, NaN where the interpreter has NaN."""
    import torch

    g = got.float().cpu().numpy()
    w = np.asarray(want, np.float32)
    nan = np.isnan(w)
    assert np.array_equal(np.isnan(g), nan), np.argwhere(np.isnan(g) != nan)[:5]
    gc = got.cpu().view(torch.int16).numpy()
    wc = torch.from_numpy(w).to(torch.bfloat16).view(torch.int16).numpy()
    same = (gc == wc) | nan
    assert same.all(), (np.argwhere(~same)[:5], g[~same][:5], w[~same][:5])


@pytest.mark.parametrize("dtype", ["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", ["element", "paired"])
def test_the_torch_stand_ins_give_the_interpreters_values(kind: str, dtype: str) -> None:
    """Every code of the dtype, ragged M and N, through the emulated kernels: bit for bit."""
    blk = block(kind, dtype)
    ins = exact_inputs(kind, dtype, 70, 48, "cpu")
    want = blk.run(ins)["y"]
    got = blk.cuda(emulate=True, tile=(64, 32))(ins)["y"]
    same_bf16(got, want)


def test_rows_under_16_bytes_are_handed_over_padded() -> None:
    """An e4m3 tile of 8 columns (8-byte rows): the launch hands the kernel (and the torch stand-ins)
    rows of 16 bytes, viewed at the tile's own width (TMA loads rows that start every multiple of 16
    bytes); the op's traced arguments keep the tile as it is."""
    import torch

    from coda_lang.backend_cute.build.config import TileConfig
    from coda_lang.backend_cute.runtime.launch import StageRunner

    blk = block("element", "e4m3")
    spec = plan_stage(blk, 1)
    env = exact_inputs("element", "e4m3", 40, 8, "cpu")
    (r_op,) = [o for o in spec.operands if o.name == "r"]
    runner = StageRunner(blk, 1, spec, TileConfig(128, 128), emulate=False)
    ins, scalars = runner.arguments(env)
    traced = ins[2 + spec.operands.index(r_op)]  # (after A and B)
    assert traced is not None and traced.stride() == (8, 1)
    _, _, epi = runner.epilogue_arguments(ins, scalars, runner.allocate(ins[0], ins[1]))
    r = epi[r_op.py]
    assert r.dtype == torch.float8_e4m3fn and tuple(r.shape) == (40, 8)
    assert r.stride() == (16, 1), r.stride()
    assert torch.equal(r.view(torch.uint8), env["r"].view(torch.uint8))


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    ("kind", "dtype"), [("element", "e4m3"), pytest.param("paired", "e5m2", marks=pytest.mark.slow)]
)
def test_an_fp8_tile_load_compiles(kind: str, dtype: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    from coda_lang.backend_cute.build.compile import compile_stage
    from coda_lang.backend_cute.build.config import TileConfig

    c = compile_stage(
        block(kind, dtype), 1, TileConfig(128, 128), directory=tmp_path_factory.mktemp("fp8-load")
    )
    assert c.report is not None and not c.report.spills, c.report.text
    assert f"cvt.rn.f16x2.{dtype}x2" in c.ptx
    assert "cp.async.bulk.tensor" in c.ptx  # (TMA loads)


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_packed_fp8_tile_compiles(pair_load: None, tmp_path_factory: pytest.TempPathFactory) -> None:
    from coda_lang.backend_cute.build.compile import compile_stage
    from coda_lang.backend_cute.build.config import TileConfig

    c = compile_stage(
        packed_fp8("e4m3"), 1, TileConfig(128, 128), directory=tmp_path_factory.mktemp("fp8-pl")
    )
    assert c.report is not None and not c.report.spills, c.report.text
    assert "cvt.rn.f16x2.e4m3x2" in c.ptx and "cvt.rzi.s32.f32" in c.ptx
    assert "cvt.rn.satfinite.e5m2x2.f32" in c.ptx


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("dtype", ["e4m3", "e5m2"])
def test_gpu_packed_fp8_tile_bit_for_bit(dtype: str, pair_load: None) -> None:
    """The packed stage reading its fp8 tile as words, on the kernel, against the interpreter: every
    e5m2 code of dg, NaN as NaN."""
    import torch

    os.environ.setdefault("CODA_TUNE", "0")
    blk = packed_fp8(dtype)
    rng = np.random.default_rng(1)
    m, k, f = 1000, 16, 264
    ins = {
        "dh": torch.from_numpy(rng.integers(-1, 2, (m, k)).astype(np.float32)).to(torch.bfloat16).cuda(),
        "w": torch.from_numpy(rng.integers(-1, 2, (f, k)).astype(np.float32)).to(torch.bfloat16).cuda(),
        "g": exact_inputs("element", dtype, m, 2 * f, "cuda")["r"],
        "s": 0.375,
    }
    got = blk.cuda(poison=True)(ins)["dg"]
    torch.cuda.synchronize()
    want = blk.run({k: v.cpu() if hasattr(v, "cpu") else v for k, v in ins.items()})["dg"]
    same_codes("dg", got, want, "e5m2")


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("dtype", ["e4m3", "e5m2"])
@pytest.mark.parametrize(
    ("kind", "m", "n"), [("element", 1000, 520), ("element", 136, 8), ("paired", 1000, 528)]
)
def test_gpu_fp8_tile_loads_bit_for_bit(kind: str, m: int, n: int, dtype: str) -> None:
    import torch

    os.environ.setdefault("CODA_TUNE", "0")
    blk = block(kind, dtype)
    ins = exact_inputs(kind, dtype, m, n, "cuda")
    got = blk.cuda(poison=True)(ins)["y"]
    torch.cuda.synchronize()
    want = blk.run({k: v.cpu() if hasattr(v, "cpu") else v for k, v in ins.items()})["y"]
    same_bf16(got, want)
