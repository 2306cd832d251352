"""K-major copies written by the stage that makes a value, not by a separate transpose pass.

A derived fp8 backward's weight-gradient GEMMs read their fp8 operands transposed (`transpose(dacc) @
x`), and Hopper's fp8 WGMMA reads both operands K-major, so the runtime gives them K-major copies
(launch.kmajor_pair). The packed SwiGLU stage's e5m2 cotangent is rounded to e5m2 by the runtime
anyway (its narrowing pass); that pass now writes the K-major copy from the same tiles
(layouts.narrowed_with_kmajor), and the weight gradient takes it instead of transposing again.

- The CUDA block knows which values its GEMMs read as K-major copies (`_kmajor`).
- `collect` of the packed stage binds the narrowed cotangent and its copy (kmajor_key), equal to the
  copy kmajor_pair would make, its rows zero-padded to a multiple of 16.
- `arguments` of the weight-gradient stage passes that very tensor (no copy made), and without it
  makes an equal one itself; a copy of another width or dtype is not taken.
- The Triton kernel, under Triton's CPU interpreter: its row-major result is the conversion kernel's,
  its K-major copy that result transposed and padded, at sizes that are not multiples of the tile.
- On a GPU: bit for bit against torch's cast and transpose.
- The elementwise stages that start the fp8 layer's backward (x1q and x2q, the weights' e4m3 copies,
  each read only by a GEMM that wants it K-major) write the copies from their generated kernel
  (`TritonStage.kmajor_stores`): the copy is the transpose of the stored tile, padded, and the tile is
  what the kernel stores without copies, bit for bit, under the interpreter and on a GPU.
- Under $CODA_KMAJOR_STAGES=all, the RoPE backward (over column pairs, with reductions over each
  row) and the last layer's norm backward (with reductions over rows and columns) write theirs too:
  the same checks, the reductions equal within f32 rounding; without it they write none.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from test_fp8_kernels import MLP8  # noqa: E402  (the fp8 MLP of those tests)

import coda_lang  # noqa: E402
from coda_lang.backend_cute.build.config import TileConfig  # noqa: E402
from coda_lang.backend_cute.plan.planner import plan_stage  # noqa: E402
from coda_lang.backend_cute.runtime.launch import StageRunner, kmajor_copy  # noqa: E402
from coda_lang.backend_triton import kmajor_key  # noqa: E402


def _backward() -> coda_lang.Block:
    blk = coda_lang.load(MLP8)["mlp"]
    return blk.derivation(["x", "w", "w2"], backward=coda_lang.BackwardOptions(fp8_grads="e5m2")).backward


def _runner(bwd: coda_lang.Block, k: int) -> StageRunner:
    return StageRunner(bwd, k, plan_stage(bwd, k), TileConfig(128, 128), emulate=True)


@pytest.mark.usefixtures("narrowing")
def test_the_block_knows_its_kmajor_operands() -> None:
    cb = _backward().cuda()  # (planned for the GPU; nothing runs)
    assert cb._kmajor == {"dacc1", "x", "w", "w2", "aq", "dacc2"}
    packed = cb.specs[1]
    assert (
        packed is not None and packed.d is not None and (packed.d.name, packed.d.narrow) == ("dacc1", "e5m2")
    )
    wgrad = cb.specs[2]
    assert wgrad is not None and (wgrad.gemm.a, wgrad.gemm.copy_a, wgrad.gemm.b, wgrad.gemm.copy_b) == (
        "dacc1",
        True,
        "x",
        True,
    )


@pytest.mark.usefixtures("narrowing")
@pytest.mark.parametrize("m", [64, 72])  # 72 tokens: the copy's rows padded to 80
def test_the_narrowing_binds_the_copy_and_the_weight_gradient_takes_it(m: int) -> None:
    bwd = _backward()
    f, d = 48, 32
    packed = _runner(bwd, 2)
    g = torch.Generator().manual_seed(m)
    A = torch.randn(m, d, generator=g).to(torch.float8_e5m2)  # dacc2 [M, D]
    B = torch.randn(f, d, generator=g).to(torch.float8_e4m3fn)  # w2's K-major copy, [F, D]: (n, k)
    outs = packed.allocate(A, B)
    outs[0].copy_((torch.randn(outs[0].shape, generator=g) * 100).to(outs[0].dtype))
    for o in outs[1:]:
        o.zero_()
    env: dict[str, Any] = {}
    packed.collect(outs, env, {}, {}, frozenset({"dacc1"}), rows=m)
    row = env["dacc1"]
    assert row.dtype == torch.float8_e5m2 and tuple(row.shape) == (m, 2 * f)
    assert torch.equal(row.view(torch.uint8), outs[0].to(torch.float8_e5m2).view(torch.uint8))
    made = env[kmajor_key("dacc1")]
    width = -(-m // 16) * 16
    assert tuple(made.shape) == (2 * f, width) and made.dtype == torch.float8_e5m2
    assert torch.equal(made.view(torch.uint8), kmajor_copy(row, width).view(torch.uint8))
    assert not made[:, m:].view(torch.uint8).any()
    # without the name in kmajor: no copy
    plain: dict[str, Any] = {}
    packed.collect(outs, plain, {}, {}, frozenset(), rows=m)
    assert kmajor_key("dacc1") not in plain

    wgrad = _runner(bwd, 3)  # dw = transpose(dacc1) @ x
    env["x"] = torch.randn(m, d, generator=g).to(torch.float8_e4m3fn)
    env.update(
        {o.name: torch.tensor(2.0) for o in wgrad.spec.operands if o.role == "scalar"}
    )  # (its 1 / scale)
    ins, _ = wgrad.arguments(env)
    assert ins[0] is made  # A: the copy the narrowing wrote, not a new one
    assert torch.equal(ins[1].view(torch.uint8), kmajor_copy(env["x"], width).view(torch.uint8))
    del env[kmajor_key("dacc1")]
    again, _ = wgrad.arguments(env)
    assert again[0] is not made and torch.equal(again[0].view(torch.uint8), made.view(torch.uint8))
    # a copy of another width (or dtype) is not the one the GEMM needs: made again
    env[kmajor_key("dacc1")] = torch.zeros((2 * f, width + 16), dtype=torch.float8_e5m2)
    other, _ = wgrad.arguments(env)
    assert tuple(other[0].shape) == (2 * f, width)
    env[kmajor_key("dacc1")] = made.view(torch.uint8)
    assert wgrad.arguments(env)[0][0].dtype == torch.float8_e5m2


@pytest.mark.parametrize("shape", [(100, 72), (64, 64), (130, 200)])
@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_narrowed_with_kmajor_under_the_interpreter(shape: tuple[int, int], dtype: torch.dtype) -> None:
    from coda_lang.backend_triton import layouts

    r, c = shape
    g = torch.Generator().manual_seed(r * c)
    src = (torch.randn(r, c, generator=g) * 50).to(torch.bfloat16)
    width = -(-r // 16) * 16
    row, t = layouts.narrowed_with_kmajor(src, dtype, width, interpret=True)
    want = layouts._converted(src, dtype, True)  # the conversion kernel, interpreted the same way
    assert torch.equal(row.view(torch.uint8), want.view(torch.uint8))
    assert tuple(t.shape) == (c, width)
    assert torch.equal(t.view(torch.uint8), kmajor_copy(row, width).view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(8200, 4096), (1000, 3072), (64, 16)])
def test_gpu_narrowed_with_kmajor_bit_for_bit(shape: tuple[int, int]) -> None:
    from coda_lang.backend_triton import layouts

    r, c = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    # in range and NaN-free, as the packed stage's clamped D is
    src = (torch.randn(r, c, device="cuda", generator=g) * 1000).clamp(-57344, 57344).to(torch.bfloat16)
    width = -(-r // 16) * 16
    row, t = layouts.narrowed_with_kmajor(src, torch.float8_e5m2, width)
    want = src.to(torch.float8_e5m2)
    assert torch.equal(row.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(t.view(torch.uint8), kmajor_copy(want, width).view(torch.uint8))


# -------------------------------------------------- elementwise stages that write the copy themselves

LAYER_SIZES = {
    "M": 40,
    "D": 160,
    "F": 96,
    "K": 64,
    "P": 160,
}  # 40 rows: a copy padded to 48; 160 columns (pairs): 3 chunks of 64


def _layer_backward(name: str = "layer") -> coda_lang.Block:
    from coda_lang.hf.blocks import model_source

    blk = coda_lang.load(model_source("bfloat16", 1e-5, 64, None, fp8="delayed"))[name]
    wrt = [p.var.name for p in blk.ir.params if p.var.name not in ("pos", "freq", "eps")]
    wrt = [n for n in wrt if not n.startswith("s_")]
    return blk.derivation(wrt, backward=coda_lang.BackwardOptions(fp8_grads="e5m2")).backward


# (block, the value whose stage is tested): the start stages' x1q and w_13q; the RoPE backward's e5m2
# cotangent of the QKV GEMM (a stage over pairs, with per-row reductions); the last block's norm
# backward's (per-row and column reductions). The last two write copies under $CODA_KMAJOR_STAGES=all.
STAGES = [("layer", "x1q"), ("layer", "w_13q"), ("layer", "dacc7"), ("last", "dacc5")]
WIDE = {"dacc7", "dacc5"}


def _stage(block: str, which: str, interpret: bool) -> tuple[Any, Any, Any, Any]:
    """(the backward, its ElementwiseStage that stores `which`, its TritonStage, the K-major marks)."""
    from coda_lang.backend_triton.elementwise import ElementwiseStage
    from coda_lang.backend_triton.generate import TritonStage
    from coda_lang.ir.nodes import Stage

    bwd = _layer_backward(block)
    cb = bwd.cuda()
    stages = [s for s in bwd.ir.body if isinstance(s, Stage)]
    k = next(i for i, s in enumerate(stages, 1) if any(e.outs[0].name == which for e in s.body))
    st = ElementwiseStage(bwd, k, emulate=True)
    ts = TritonStage(st, interpret=interpret)
    stored = [n for n, *_ in st.store_meta]
    marks = ts.kmajor_stores(cb._kmajor)
    assert marks == tuple(n in cb._kmajor for n in stored) and any(marks), (stored, marks)
    return bwd, st, ts, marks


def _arguments(bwd: Any, st: Any, sizes: dict[str, int], seed: int, device: str) -> list[Any]:
    """Random values of the stage's loads, each at its type's shape and dtype (scales: 37.5)."""
    from coda_lang.ir.nodes import Stage

    types = {p.var.name: p.var.type for p in bwd.ir.params}
    for s in bwd.ir.body:
        for e in s.body if isinstance(s, Stage) else [s]:
            types.update({o.name: o.type for o in e.outs})
    g = torch.Generator(device=device).manual_seed(seed)
    args: list[Any] = []
    for name, role in st.roles:
        if role == "scalar":
            args.append(torch.tensor(37.5, device=device) if device == "cuda" else 37.5)
            continue
        t = types[name]
        shape = tuple(int(x.evaluate(sizes)) for x in t.shape)
        x = torch.randn(shape, generator=g, device=device) * 3
        args.append(x.to(torch.bfloat16) if t.dtype == "bf16" else x)
    return args


def _same_with_copies(
    st: Any, marks: tuple[bool, ...], plain: tuple[Any, ...], got: tuple[Any, ...], rows: int, cols: int
) -> None:
    """`got` (the kernel writing the K-major copies `marks` says) against `plain` (without): the
    stored tiles bit for bit, the reductions equal (a max) or within f32 rounding (a sum: its
    partials fold in another order), then each copy the transpose of its tile, rows past `rows`
    zeros."""
    stored = len(st.store_meta)
    marked = [i for i, on in enumerate(marks) if on]
    assert len(got) == len(plain) + len(marked)
    for i in range(stored):
        assert torch.equal(got[i].view(torch.uint8), plain[i].view(torch.uint8)), st.store_meta[i][0]
    for i, name in enumerate(st.reductions, stored):
        w, x = plain[i].float(), got[i].float()
        assert x.shape == w.shape, name
        torch.testing.assert_close(x, w, rtol=1e-5, atol=1e-5 * float(w.abs().max()), msg=name)
    width = -(-rows // 16) * 16
    for j, i in enumerate(marked):
        copy = got[len(plain) + j]
        assert tuple(copy.shape) == (cols, width), st.store_meta[i][0]
        assert torch.equal(copy.view(torch.uint8), kmajor_copy(plain[i], width).view(torch.uint8))


def _check_under_the_interpreter(block: str, which: str) -> None:
    """The stage that stores `which`, under Triton's CPU interpreter, with and without its copies
    (`_same_with_copies`), at LAYER_SIZES."""
    bwd, st, ts, marks = _stage(block, which, interpret=True)
    args = _arguments(bwd, st, LAYER_SIZES, st.index, "cpu")
    rows, cols = int(st.rows.evaluate(LAYER_SIZES)), int(st.cols.evaluate(LAYER_SIZES))
    plain = ts(rows, cols, dict(LAYER_SIZES), torch.device("cpu"), *args)
    got = ts(rows, cols, dict(LAYER_SIZES), torch.device("cpu"), *args, kmajor=marks)
    _same_with_copies(st, marks, plain, got, rows, cols)


@pytest.mark.parametrize("block, which", STAGES)
def test_the_stage_kernel_writes_the_copies(block: str, which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp8 layer's backward starts with elementwise stages that make x1q and x2q ([M, D]) and the
    weights' copies again, and its RoPE backward (a stage over column pairs) makes the QKV GEMM's
    e5m2 cotangent; the last block's norm backward makes the down GEMM's. Each is read only by GEMMs
    that want it K-major. The generated kernel (Triton's CPU interpreter) writes those copies too:
    each the transpose of the tile it stores, rows past M zeros; the tiles are the ones the kernel
    writes without copies, bit for bit, and its reductions theirs (per row: folded from one partial
    per program column)."""
    pytest.importorskip("triton")
    if which in WIDE:
        monkeypatch.setenv("CODA_KMAJOR_STAGES", "all")
    _check_under_the_interpreter(block, which)


@pytest.mark.parametrize("block, which", [("layer", "x1q"), ("layer", "dacc7")])
def test_another_program_shape_writes_the_same_copies(
    block: str, which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$CODA_KMAJOR_PROGRAM=32x16x8 (32 rows x 16 column units a program, 8 warps; the RoPE
    backward's over pairs, with per-row reductions folded from more partials): the same tiles and
    copies as without copies, under Triton's CPU interpreter, at sizes that are not multiples of it."""
    pytest.importorskip("triton")
    from coda_lang.backend_triton.generate import kmajor_program

    monkeypatch.setenv("CODA_KMAJOR_PROGRAM", "32x16x8")
    monkeypatch.setenv("CODA_KMAJOR_STAGES", "all")
    assert kmajor_program() == (32, 16, 8)
    _check_under_the_interpreter(block, which)


@pytest.mark.parametrize("value", ["64x64", "60x16x4", "64x12x4", "64x16x32", "big"])
def test_a_bad_program_shape_is_refused(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from coda_lang.backend_triton.generate import kmajor_program

    monkeypatch.setenv("CODA_KMAJOR_PROGRAM", value)
    with pytest.raises(ValueError, match="CODA_KMAJOR_PROGRAM"):
        kmajor_program()


def test_a_start_stage_writes_the_copy_alone_where_nothing_reads_the_tile() -> None:
    """x1q, x2q and the weights' e4m3 copies at the layer backward's start are each read only by a
    GEMM that takes the K-major copy (`_alone`): the kernel writes the copy alone (ALONE), no row-major
    tile, and returns the tile as the copy's transposed view, equal to what it stores without copies
    code for code. A value also read as it is stored (dacc7, by `dacc7 @ w_qkvq`) is not among them."""
    pytest.importorskip("triton")
    from coda_lang.backend_triton.generate import ALONE

    bwd = _layer_backward("layer")
    cb = bwd.cuda()
    assert {"x1q", "x2q", "w_13q", "w_2q"} <= cb._alone and "dacc7" not in cb._alone
    assert "dacc7" in cb._kmajor and not cb._alone & {o.name for o in bwd.ir.outputs}
    for which in ("x1q",):  # (the stage that makes x1q and x2q; the weights' run the same code)
        _, st, ts, _ = _stage("layer", which, interpret=True)
        marks = ts.kmajor_stores(cb._kmajor, cb._alone)
        stored = [n for n, *_ in st.store_meta]
        assert marks == tuple(ALONE if n in cb._alone else 0 for n in stored) and ALONE in marks
        args = _arguments(bwd, st, LAYER_SIZES, st.index, "cpu")
        rows, cols = int(st.rows.evaluate(LAYER_SIZES)), int(st.cols.evaluate(LAYER_SIZES))
        plain = ts(rows, cols, dict(LAYER_SIZES), torch.device("cpu"), *args)
        got = ts(rows, cols, dict(LAYER_SIZES), torch.device("cpu"), *args, kmajor=marks)
        _same_with_copies(st, marks, plain, got, rows, cols)
        copies = got[len(plain) :]
        for i, j in zip([i for i, on in enumerate(marks) if on], range(len(copies)), strict=True):
            assert got[i].data_ptr() == copies[j].data_ptr() and not got[i].is_contiguous()
        src = ts.source(tuple(False for _n, role in st.roles if role == "scalar"), marks)
        for i, on in enumerate(marks):  # (the row-major store's line, only where it is stored)
            assert (f"tl.store(out{i} + " in src) == (on != ALONE), (which, i)


@pytest.mark.gpu
@pytest.mark.parametrize("block, which", STAGES)
def test_gpu_stage_kernel_writes_the_copies(block: str, which: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same kernels on the GPU, at Llama-3.2-1B-like widths and a row count that is not a multiple
    of 16 or of the program's 32 rows."""
    if which in WIDE:
        monkeypatch.setenv("CODA_KMAJOR_STAGES", "all")
    sizes = {"M": 1000, "D": 2048, "F": 8192, "K": 2048, "P": 1536}
    bwd, st, ts, marks = _stage(block, which, interpret=False)
    args = _arguments(bwd, st, sizes, st.index, "cuda")
    rows, cols = int(st.rows.evaluate(sizes)), int(st.cols.evaluate(sizes))
    dev = torch.device("cuda")
    plain = ts(rows, cols, dict(sizes), dev, *args)
    got = ts(rows, cols, dict(sizes), dev, *args, kmajor=marks)
    _same_with_copies(st, marks, plain, got, rows, cols)


def test_stages_over_pairs_or_with_reductions_write_no_copies_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without $CODA_KMAJOR_STAGES=all, the RoPE backward (over pairs, with reductions) and the norm
    backward (with reductions) leave their copies to the runtime's transpose pass: their 64 x 64
    programs are not timed yet; the start stages write theirs."""
    pytest.importorskip("triton")
    from coda_lang.backend_triton.elementwise import ElementwiseStage
    from coda_lang.backend_triton.generate import TritonStage
    from coda_lang.ir.nodes import Stage

    monkeypatch.delenv("CODA_KMAJOR_STAGES", raising=False)
    for block, which in STAGES:
        bwd = _layer_backward(block)
        cb = bwd.cuda()
        stages = [s for s in bwd.ir.body if isinstance(s, Stage)]
        k = next(i for i, s in enumerate(stages, 1) if any(e.outs[0].name == which for e in s.body))
        marks = TritonStage(ElementwiseStage(bwd, k, emulate=True), interpret=True).kmajor_stores(cb._kmajor)
        assert any(marks) == (which not in WIDE), (which, marks)


# blockwise fp8's layer backward, at whole groups of 128: its weights' e4m3 blocks and the activations
# quantized again in 128 x 1 groups for the weight gradients are made by stages torch.compile runs
BLOCKWISE_SIZES = {"M": 256, "D": 128, "F": 256, "K": 128, "P": 128}
INDUCTOR_MADE = {"w_13q", "w_2q", "w_qkvq", "x1qc", "x2qc", "aqc"}


def _blockwise_inductor_stages() -> tuple[Any, Any, list[Any]]:
    """(blockwise's layer backward, its CUDA block, its ElementwiseStages that torch.compile runs)."""
    from coda_lang.backend_triton.elementwise import ElementwiseStage
    from coda_lang.hf.blocks import model_source

    blk = coda_lang.load(model_source("bfloat16", 1e-5, 16, None, fp8="blockwise", heads=(8, 4)))["layer"]
    wrt = [p.var.name for p in blk.ir.params if p.var.name not in ("pos", "freq", "eps")]
    wrt = [n for n in wrt if not n.startswith("s_")]
    opts = coda_lang.BackwardOptions(fp8_grads="e5m2", requantize_wgrad=True)
    bwd = blk.derivation(wrt, backward=opts).backward
    cb = bwd.cuda()  # (planned for the GPU; nothing runs)
    stages = [ElementwiseStage(bwd, k, emulate=True) for k in sorted(cb.elementwise)]
    return bwd, cb, [st for st in stages if st.generator == "inductor"]


def test_torch_compiled_stages_write_the_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """$CODA_KMAJOR_INDUCTOR=1: the stages of blockwise fp8's layer backward that torch.compile runs
    (InductorStage) write the K-major copies of the one-byte tiles the block's GEMMs read transposed
    (the weights' e4m3 blocks, the activations quantized again for the weight gradients): each the
    transpose of the tile the stage stores, its rows padded with zeros, the tiles and reductions the
    stage's without copies, bit for bit. The same body run eagerly (the function torch.compile
    traces). Unset, or 0, no stage writes any; another value is a ValueError."""
    from coda_lang.backend_triton.elementwise import InductorStage

    bwd, cb, stages = _blockwise_inductor_stages()
    monkeypatch.setenv("CODA_KMAJOR_INDUCTOR", "1")
    made: set[str] = set()
    for st in stages:
        fn = InductorStage(st, compiled=False)
        marks = fn.kmajor_stores(cb._kmajor, cb._alone)
        stored = [n for n, *_ in st.store_meta]
        assert marks == tuple(int(n in cb._kmajor) for n in stored), (stored, marks)
        if not any(marks):
            continue
        made |= {n for n, on in zip(stored, marks, strict=True) if on}
        args = _arguments(bwd, st, BLOCKWISE_SIZES, st.index, "cpu")
        rows, cols = int(st.rows.evaluate(BLOCKWISE_SIZES)), int(st.cols.evaluate(BLOCKWISE_SIZES))
        plain = fn(rows, cols, dict(BLOCKWISE_SIZES), torch.device("cpu"), *args)
        got = fn(rows, cols, dict(BLOCKWISE_SIZES), torch.device("cpu"), *args, kmajor=marks)
        _same_with_copies(st, marks, plain, got, rows, cols)
    assert made == INDUCTOR_MADE, made
    for off in (None, "0"):
        if off is None:
            monkeypatch.delenv("CODA_KMAJOR_INDUCTOR")
        else:
            monkeypatch.setenv("CODA_KMAJOR_INDUCTOR", off)
        assert not any(any(InductorStage(st, compiled=False).kmajor_stores(cb._kmajor)) for st in stages)
    monkeypatch.setenv("CODA_KMAJOR_INDUCTOR", "yes")
    with pytest.raises(ValueError, match="CODA_KMAJOR_INDUCTOR is 'yes'"):
        InductorStage(stages[0], compiled=False).kmajor_stores(cb._kmajor)


def test_a_stage_run_binds_the_copy_it_wrote(monkeypatch: pytest.MonkeyPatch) -> None:
    """`ElementwiseStage.run` with a stage function that writes copies (InductorStage, eager) binds
    each copy under kmajor_key beside the value, which is the GEMM's `made` operand
    (launch.kmajor_pair takes it instead of transposing)."""
    from coda_lang.backend_triton.elementwise import InductorStage

    bwd, cb, stages = _blockwise_inductor_stages()
    monkeypatch.setenv("CODA_KMAJOR_INDUCTOR", "1")
    st = next(s for s in stages if any(n == "x1qc" for n, *_ in s.store_meta))
    st._fn = InductorStage(st, compiled=False)
    args = _arguments(bwd, st, BLOCKWISE_SIZES, st.index, "cpu")
    env = {name: x for (name, _), x in zip(st.roles, args, strict=True)}
    dims = dict(BLOCKWISE_SIZES)
    st.run(env, dims, cb.plan.storage, kmajor=cb._kmajor, alone=cb._alone)
    rows = int(st.rows.evaluate(BLOCKWISE_SIZES))
    width = -(-rows // 16) * 16
    assert torch.equal(
        env[kmajor_key("x1qc")].view(torch.uint8), kmajor_copy(env["x1qc"], width).view(torch.uint8)
    )


@pytest.mark.slow
def test_torch_compiled_stages_write_the_copies_compiled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same, through torch.compile itself (Inductor's CPU kernels): the stage that quantizes the
    gate/up activations again for the weight gradient writes its copy, equal to its tile transposed."""
    from coda_lang.backend_triton.elementwise import InductorStage

    bwd, cb, stages = _blockwise_inductor_stages()
    monkeypatch.setenv("CODA_KMAJOR_INDUCTOR", "1")
    st = next(s for s in stages if any(n == "x1qc" for n, *_ in s.store_meta))
    fn = InductorStage(st)
    marks = fn.kmajor_stores(cb._kmajor)
    args = _arguments(bwd, st, BLOCKWISE_SIZES, st.index, "cpu")
    rows, cols = int(st.rows.evaluate(BLOCKWISE_SIZES)), int(st.cols.evaluate(BLOCKWISE_SIZES))
    dev = torch.device("cpu")
    plain = InductorStage(st, compiled=False)(rows, cols, dict(BLOCKWISE_SIZES), dev, *args)
    got = fn(rows, cols, dict(BLOCKWISE_SIZES), dev, *args, kmajor=marks)
    _same_with_copies(st, marks, plain, got, rows, cols)
    # (and without copies, the compiled function called as the runtime calls it then)
    again = fn(rows, cols, dict(BLOCKWISE_SIZES), dev, *args)
    assert all(
        torch.equal(
            a.view(torch.uint8) if a.element_size() == 1 else a,
            b.view(torch.uint8) if b.element_size() == 1 else b,
        )
        for a, b in zip(again, plain, strict=True)
    )


@pytest.mark.gpu
def test_gpu_torch_compiled_stages_write_the_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, through torch.compile's CUDA kernels: each stage of blockwise fp8's layer backward that
    Inductor runs writes its K-major copies ($CODA_KMAJOR_INDUCTOR=1), each its tile transposed bit for
    bit, the tiles and reductions those it writes without copies, at widths of whole groups of 128 and
    1152 tokens (not a multiple of the copies' 16-row padding's larger tiles)."""
    from coda_lang.backend_triton.elementwise import InductorStage

    bwd, cb, stages = _blockwise_inductor_stages()
    monkeypatch.setenv("CODA_KMAJOR_INDUCTOR", "1")
    sizes = {"M": 1152, "D": 1024, "F": 2048, "K": 1024, "P": 768}
    dev = torch.device("cuda")
    made: set[str] = set()
    for st in stages:
        fn = InductorStage(st)
        marks = fn.kmajor_stores(cb._kmajor, cb._alone)
        if not any(marks):
            continue
        made |= {n for (n, *_), on in zip(st.store_meta, marks, strict=True) if on}
        args = _arguments(bwd, st, sizes, st.index, "cuda")
        rows, cols = int(st.rows.evaluate(sizes)), int(st.cols.evaluate(sizes))
        plain = fn(rows, cols, dict(sizes), dev, *args)
        got = fn(rows, cols, dict(sizes), dev, *args, kmajor=marks)
        _same_with_copies(st, marks, [t.cpu() for t in plain], [t.cpu() for t in got], rows, cols)
    assert made == INDUCTOR_MADE, made
