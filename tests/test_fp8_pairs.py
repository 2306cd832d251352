"""A packed stage's fp8 D stored by the kernel as its pairs (the default; $CODA_FP8_PAIR_STORE=0 narrows).

The derived SwiGLU backward's packed stage stores an e5m2 cotangent. quack's packed mode stores C's
16-bit dtype only; with $CODA_FP8_PAIR_STORE=0 the stage stores it in that dtype (rounded to odd),
and the runtime narrows it to e5m2 in one more pass (tests/test_fp8_kernels.py, the `narrowing`
fixture). By default the kernel stores the e5m2 codes itself: one 16-bit word
per accumulator element, lane 0's code in the low byte, through an int16 view of the fp8 [M, 2N]
buffer; C is read as float32 words, split by the emitted code; quack runs the stage in element mode.

Checked here on the CPU:
- the plan and the emitted source, by default and with $CODA_FP8_PAIR_STORE=0, and the emulated plan
  (unchanged);
- what the runtime hands quack: the views, their shapes, dtypes and storage;
- the layout the kernel relies on, modelled with NumPy bit operations: a word's bytes in the buffer
  are the two lanes' codes in column order, and a float32 word's halves are the two 16-bit lanes;
- (toolchain, slow) the stage compiles for sm_90a without spills, with the pair conversion inlined.
On a GPU (`-m gpu`): the stage bit for bit against the interpreter's rounding, and the fp8 MLP's
derived backward against the interpreter, as tests/test_fp8_kernels.py checks the default path.
"""

from __future__ import annotations

import re
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from test_fp8_kernels import (
    PACKED_E5M2,
    _gemm_stages,
    _mlp8_backward,
    mlp8_backward_matches,
    one,
    packed_bit_for_bit,
)

import coda_lang
from coda_lang.backend_cute.build.config import TileConfig
from coda_lang.backend_cute.plan.emit import emit_stage
from coda_lang.backend_cute.plan.planner import plan_stage
from coda_lang.backend_cute.plan.spec import PACKED, WORDS


@pytest.fixture
def pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (as a user gets it with the variable unset)."""
    monkeypatch.delenv("CODA_FP8_PAIR_STORE", raising=False)


def _packed(dtype: str = "bf16", fp8: str = "e5m2") -> coda_lang.Block:
    """PACKED_E5M2 with its 16-bit inputs in `dtype` and its stored cotangent in `fp8`."""
    return one(PACKED_E5M2.replace("bf16", dtype).replace("e5m2", fp8))


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_the_pairs_are_planned_and_emitted(pairs: None, dtype: str) -> None:
    """By default: no D, a TileStore of the e5m2 tile's pairs, C a TileLoad of float32 words (the
    runtime's view), quack's element mode; the emitted code splits C's words by its dtype, clamps each
    lane and packs the two into one word. Lanes and everything else as in packed mode."""
    spec = plan_stage(_packed(dtype), 1)
    assert spec.mode == PACKED and spec.quack_mode == "element" and spec.d is None
    (out,) = [o for o in spec.outputs if o.pairs]
    assert (out.name, out.dtype, out.op) == ("dz", "e5m2", "TileStore")
    (words,) = [o for o in spec.operands if o.host == WORDS]
    assert (words.name, words.op, words.dtype, words.lanes) == ("c", "TileLoad", dtype, 2)
    assert not any(o.op == "C" for o in spec.operands)
    src = emit_stage(spec)
    assert "mode=" not in src and "round_odd" not in src and "unpack(" not in src, src
    assert re.search(rf"{words.py}_0, {words.py}_1 = unpack_{dtype}x2\({words.py}\)", src), src
    for lane in (0, 1):
        assert re.search(rf"dz_{lane}_sat = cute\.math\.min\(cute\.math\.max\(dz_{lane}, -57344\.0", src)
    assert '"dz": pack_e5m2x2(dz_0_sat, dz_1_sat)' in src
    assert f'"{words.py}": TileLoad("{words.py}")' in src and 'TileStore("dz")' in src


def test_with_the_pair_store_off_and_emulated_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """$CODA_FP8_PAIR_STORE=0 plans the narrowing (a 16-bit D); the emulated plan, by default too,
    stores e5m2 as D."""
    monkeypatch.setenv("CODA_FP8_PAIR_STORE", "0")
    spec = plan_stage(_packed(), 1)
    assert spec.quack_mode == PACKED and spec.d is not None and spec.d.narrow == "e5m2"
    assert not any(o.pairs for o in spec.outputs)
    monkeypatch.delenv("CODA_FP8_PAIR_STORE")
    assert plan_stage(_packed(), 1).d is None  # (the default: the pairs)
    emulated = plan_stage(_packed(), 1, emulated=True)
    assert emulated.d is not None and (emulated.d.dtype, emulated.d.narrow) == ("e5m2", None)
    assert emulated.quack_mode == PACKED


def test_the_derived_swiglu_backward_stores_pairs(pairs: None) -> None:
    """The fp8 MLP's derived backward: its packed stage stores its e5m2 cotangent as pairs beside
    the e4m3 SwiGLU output; its other GEMM stages are as with the narrowing."""
    bwd = _mlp8_backward()
    packed = [k for k in _gemm_stages(bwd) if plan_stage(bwd, k).mode == PACKED]
    assert len(packed) == 1
    spec = plan_stage(bwd, packed[0])
    assert spec.quack_mode == "element" and spec.d is None
    assert [o.dtype for o in spec.outputs if o.pairs] == ["e5m2"]
    src = emit_stage(spec)
    assert "pack_e5m2x2(" in src and "unpack_bf16x2(" in src


def test_the_runtime_hands_quack_the_views(pairs: None) -> None:
    """What the runtime passes for the stage: C's 16-bit [m, 2n] tile as a float32 [m, n] view of the
    same storage, the e5m2 [m, 2n] buffer as an int16 [m, n] view of it, no D and no C (element
    mode); the block's value is the e5m2 buffer itself."""
    import torch

    blk = _packed()
    r = blk.cuda(tile=(128, 128)).runner(1)
    m, n, f = 1000, 64, 528
    c = torch.randn(m, 2 * f).to(torch.bfloat16)
    env: dict[str, Any] = {
        "g": torch.randn(m, n).to(torch.bfloat16),
        "w": torch.randn(n, f).to(torch.bfloat16),
        "c": c,
        "s": 2.0,
    }
    ins, scalars = r.arguments(env)
    (j,) = [i for i, o in enumerate(r.spec.operands) if o.host == WORDS]
    words = ins[2 + j]
    assert words is not None and words.dtype == torch.float32 and tuple(words.shape) == (m, f)
    assert words.data_ptr() == c.data_ptr()
    assert ins[0] is not None and ins[1] is not None
    outs = r.allocate(ins[0], ins[1])
    assert outs[0].dtype == torch.float8_e5m2 and tuple(outs[0].shape) == (m, 2 * f)
    D, C, epi = r.epilogue_arguments(ins, scalars, outs)
    assert D is None and C is None
    stored = epi["dz"]
    assert stored.dtype == torch.int16 and tuple(stored.shape) == (m, f)
    assert stored.data_ptr() == outs[0].data_ptr()
    assert epi[r.spec.operands[j].py] is words or epi[r.spec.operands[j].py].data_ptr() == c.data_ptr()
    got: dict[str, Any] = {}
    r.collect(outs, got, {}, {})
    assert got["dz"] is outs[0]


def test_the_word_layout_the_kernel_relies_on() -> None:
    """The layout, modelled with NumPy's bits (little-endian, as the GPU): a 16-bit word whose low
    byte is lane 0's code and high byte lane 1's is, in the fp8 buffer, the codes in column order; a
    float32 word over two 16-bit lanes holds lane 0 in its low half and lane 1 in its high half, and
    epi_ops' split (the low half shifted up, the high half masked) gives each bf16 lane widened,
    bit for bit, NaN payloads and signs included."""
    assert np.little_endian
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 16)) * np.exp2(rng.integers(-20, 18, (6, 16)))).astype(np.float32)
    x[0, :4] = [np.nan, -0.0, 57344.0, -1e-7]
    codes = np.clip(x, -57344, 57344).astype(ml_dtypes.float8_e5m2).view(np.uint8)
    lo, hi = codes[:, 0::2].astype(np.uint16), codes[:, 1::2].astype(np.uint16)
    word = lo | (hi << 8)  # cvt.rn.satfinite.e5m2x2.f32 d, lane1, lane0 -> lane 0 in the low byte
    assert np.array_equal(word.view(np.uint8).reshape(codes.shape), codes)
    halves = rng.integers(0, 1 << 16, (6, 16), dtype=np.uint64).astype(np.uint16)
    halves[0, :3] = [0x7FC1, 0xFF81, 0x8000]  # NaNs with payloads, -0
    as_f32 = halves.view(np.uint32)  # the float32 words' bits, [6, 8]
    lane0 = (as_f32 << np.uint32(16)).astype(np.uint32)
    lane1 = as_f32 & np.uint32(0xFFFF0000)
    widened = halves.astype(np.uint32) << np.uint32(16)  # a bf16 widened to f32: its bits on top
    assert np.array_equal(lane0, widened[:, 0::2]) and np.array_equal(lane1, widened[:, 1::2])


@pytest.mark.toolchain
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_pair_store_compiles(pairs: None, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The stage compiles for sm_90a at 128x128 without spills: the pair conversion
    (cvt.rn.satfinite.e5m2x2.f32) and the bf16 split (shl.b32) inlined, no rounding to odd."""
    from coda_lang.backend_cute.build.compile import compile_stage
    from coda_lang.backend_cute.build.config import candidates_for

    blk = _packed()
    cfg = next(c for c in candidates_for(plan_stage(blk, 1)) if c.short == "128x128")
    c = compile_stage(blk, 1, cfg, directory=tmp_path_factory.mktemp("pairs8"))
    assert "cvt.rn.satfinite.e5m2x2.f32" in c.ptx and "shl.b32" in c.ptx
    assert "65535" not in c.ptx  # (round_odd_bf16's mask of the cut bits)
    assert c.report is not None and not c.report.spills, c.report.text


@pytest.mark.toolchain
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_quack_takes_the_runtime_arguments(
    pairs: None, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the runtime hands quack for the stage (its own arguments, allocation and
    views, on "meta" tensors): quack validates them and compiles the kernel, without a GPU."""
    import torch

    from coda_lang.backend_cute.build import quack_adapter

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path_factory.mktemp("pairs-dry")))
    r = _packed().cuda(tile=(128, 128)).runner(1)
    m, n, f = 1000, 64, 528
    env: dict[str, Any] = {
        "g": torch.empty((m, n), dtype=torch.bfloat16, device="meta"),
        "w": torch.empty((n, f), dtype=torch.bfloat16, device="meta"),
        "c": torch.empty((m, 2 * f), dtype=torch.bfloat16, device="meta"),
        "s": 2.0,
    }
    ins, scalars = r.arguments(env)
    assert ins[0] is not None and ins[1] is not None
    outs = r.allocate(ins[0], ins[1])
    D, C, epi = r.epilogue_arguments(ins, scalars, outs)
    assert D is None and C is None and epi["dz"].dtype == torch.int16
    quack_adapter.launch(r.mod, r.spec, r.config, ins[0], ins[1], D, epi, C=C, dry_run=True)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
@pytest.mark.parametrize("scale", [1.0, 2.0**-10, 2.0**12])
def test_gpu_pairs_bit_for_bit(pairs: None, scale: float, dtype: str) -> None:
    """The stage on the kernel against the interpreter's direct rounding, code for code,
    where the value before the store is exact: midpoints, subnormals (2^-10), saturation (2^12), NaN
    and infinities from C (tests/test_fp8_kernels.py's inputs for the default path)."""
    packed_bit_for_bit(_packed(dtype), scale, dtype)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_gpu_pairs_in_the_mlp_backward(pairs: None) -> None:
    """The fp8 MLP's e5m2-cotangent backward by default (its SwiGLU stage storing pairs, the
    weight gradient reading a transposed copy of them) against the interpreter."""
    mlp8_backward_matches(1000)


def _llama_swiglu_backward() -> tuple[coda_lang.Block, int]:
    """The patched fp8 Llama layer's derived backward (e5m2 cotangents, no gradient of the scales)
    and the index of its packed SwiGLU-backward stage."""
    from coda_lang.hf.blocks import model_source

    blk = coda_lang.load(model_source("bfloat16", 1e-5, 64, None, fp8="delayed"))["layer"]
    wrt = [p.var.name for p in blk.ir.params if p.var.name not in ("pos", "freq", "eps")]
    bwd = blk.derivation(
        [n for n in wrt if not n.startswith("s_")], backward=coda_lang.BackwardOptions(fp8_grads="e5m2")
    ).backward
    (k,) = [k for k in _gemm_stages(bwd) if plan_stage(bwd, k).mode == PACKED]
    return bwd, k


# The wider tiles with a 16-column epilogue subtile: at quack's subtile, the Llama stage with the pair
# store spills at 128x192 cooperative (8 bytes) and 128x96 pingpong (4 bytes), where with the narrowing
# it fits (ptxas, sm_90a, 2026-11-28); FP8_CANDIDATES holds neither e16 variant yet
WIDER = [TileConfig(128, 192, 2, 1, False, epi_n=16), TileConfig(128, 96, epi_n=16)]


@pytest.mark.toolchain
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("cfg", WIDER, ids=lambda c: c.short + ("p" if c.pingpong else "c"))
def test_the_llama_pair_store_fits_the_wider_tiles_at_a_16_column_subtile(
    pairs: None, cfg: TileConfig, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The patched Llama layer's SwiGLU-backward stage, storing pairs, compiles without spills at
    128x192 cooperative once the epilogue subtile is 16 columns, K-major copies of its cotangent and
    SwiGLU output included (by default: tests/test_kmajor_store.py), and at 128x96 pingpong without
    those copies (with them it spills 72 bytes there: ptxas 13.0, 2026-11-29)."""
    from coda_lang.backend_cute.build.compile import compile_stage

    if cfg.pingpong:
        monkeypatch.setenv("CODA_KMAJOR_STORE", "0")
    bwd, k = _llama_swiglu_backward()
    c = compile_stage(bwd, k, cfg, directory=tmp_path_factory.mktemp("wide"))
    assert c.report is not None and not c.report.spills, c.report.text


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(
    "cfg", [TileConfig(128, 64), *WIDER], ids=lambda c: c.short + ("p" if c.pingpong else "c")
)
@pytest.mark.parametrize("scale", [1.0, 2.0**-10])
def test_gpu_pairs_bit_for_bit_at_other_tiles(pairs: None, scale: float, cfg: TileConfig) -> None:
    """The pair store at the other tiles the tuner has or could have (a pingpong tile, whose 8-bit
    subtile is 64 columns by default, and the two 16-column subtiles above), code for code against
    the interpreter."""
    packed_bit_for_bit(_packed(), scale, "bf16", tile=cfg)


def test_e4m3_pairs_are_planned_and_emitted(pairs: None) -> None:
    """An e4m3 cotangent (`fp8_grads="e4m3"`) stored the same way: its lanes clamped to +-448 and
    packed by the e4m3 conversion."""
    spec = plan_stage(_packed(fp8="e4m3"), 1)
    assert spec.quack_mode == "element" and spec.d is None
    assert [(o.name, o.dtype) for o in spec.outputs if o.pairs] == [("dz", "e4m3")]
    src = emit_stage(spec)
    assert '"dz": pack_e4m3x2(dz_0_sat, dz_1_sat)' in src and "pack_e5m2x2" not in src, src
    for lane in (0, 1):
        assert re.search(rf"dz_{lane}_sat = cute\.math\.min\(cute\.math\.max\(dz_{lane}, -448\.0", src), src


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_e4m3_pairs_compile(pairs: None, tmp_path_factory: pytest.TempPathFactory) -> None:
    """That stage compiles for sm_90a without spills, the two lanes converted by one e4m3x2 cvt."""
    from coda_lang.backend_cute.build.compile import compile_stage

    c = compile_stage(
        _packed(fp8="e4m3"), 1, TileConfig(128, 128, 2, 1, False), directory=tmp_path_factory.mktemp("e4")
    )
    assert "cvt.rn.satfinite.e4m3x2.f32" in c.ptx and "e5m2x2" not in c.ptx
    assert c.report is not None and not c.report.spills, c.report.text


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("scale", [1.0, 2.0**-10, 2.0**8])
def test_gpu_e4m3_pairs_bit_for_bit(pairs: None, scale: float) -> None:
    """The e4m3 pair store on the kernel against the interpreter, code for code (saturation at
    2^8: e4m3's range ends at 448)."""
    packed_bit_for_bit(_packed(fp8="e4m3"), scale, "bf16")
