"""GEMMs with block scales: `gemm a @ b, scale_a=sa, scale_b=sb { ... }` (docs/language.md, "Block scales").

Checked on the CPU: the options parse and print back; the interpreter's accumulator against float64
NumPy of the dequantized operands (each operand times its scales repeated over their groups), for
DeepSeek-V3's 1x128 and 128x128 groups, for a transposed A, for one operand scaled, and in `--precision
f64` to float64's own rounding; the scales really are per block (one scale per operand would miss);
the checker's E0411s and E0211s (tests/bad/ has their programs); the derived backward (each operand's
gradient a GEMM carrying the other operand's scale, times its own scale read over its groups) against
float64 torch autograd of the dequantized product, alone and after a producer that quantizes in 1x128
groups, under each saved-tensor policy; no gradient through a scale (E0602); a matrix read over its
groups (`expand(s, acc)`) in the interpreter at simulated tiles and in an elementwise stage's torch
stand-in; the kernels' form (DeepSeek-V3's, plan/block_scaled.py: planned, emulated against the
interpreter) and the refusals of every other form and of a grouped read (E0709, E0704), with `coda
grad`, `coda compile` and `coda fuzz` exiting as documented.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from support import coda

import coda_lang
from coda_lang.core.diagnostics import CodaError
from coda_lang.frontend.syntax.printer import print_block, print_program

DEEPSEEK = """
dims M, K, N
block scaled(a: e4m3[M, K], sa: f32[M, K/128], w: e4m3[N, K], sw: f32[N/128, K/128]) -> (y: f32[M, N]) {
  gemm a @ transpose(w), scale_a=sa, scale_b=sw {
    y = acc
  }
}
"""

# A stored [K, M] and written transposed; B stored [K, N]; groups of 64 along K, 32 along N
TRANSPOSED = """
dims M, K, N
block scaled(a: e4m3[K, M], sa: f32[K/64, M], w: e5m2[K, N], sw: f32[K/64, N/32]) -> (y: f32[M, N]) {
  gemm transpose(a) @ w, scale_a=sa, remat="save", scale_b=sw {
    y = acc
  }
}
"""

ONLY_B = """
dims M, K, N
block scaled(a: bf16[M, K], w: bf16[N, K], sw: f32[N, K/32]) -> (y: f32[M, N]) {
  gemm a @ transpose(w), scale_b=sw {
    y = acc
  }
}
"""

ONLY_A = """
dims M, K, N
block scaled(a: e4m3[M, K], sa: f32[M, K/128], w: e4m3[N, K]) -> (y: f32[M, N]) {
  gemm a @ transpose(w), scale_a=sa {
    y = acc
  }
}
"""

# w's 128 x 128 blocks alone, fp8: a form of the kernels' (as its derived data gradient's is)
FP8_ONLY_B = """
dims M, K, N
block scaled(a: e4m3[M, K], w: e4m3[N, K], sw: f32[N/128, K/128]) -> (y: bf16[M, N]) {
  gemm a @ transpose(w), scale_b=sw {
    y: bf16 = acc * 0.5
  }
}
"""


def _fp8(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    return (rng.standard_normal(shape) * 4).astype(dtype)


def _repeat(s: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """A scale matrix repeated over its groups to its operand's stored shape."""
    return np.repeat(np.repeat(s.astype(np.float64), rows // s.shape[0], 0), cols // s.shape[1], 1)


def _inputs(src: str, m: int, k: int, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    blk = coda_lang.load(src)["scaled"]
    out: dict[str, np.ndarray] = {}
    sizes = {"M": m, "K": k, "N": n}
    for p in blk.ir.params:
        assert p.var.type is not None
        shape = tuple(int(d.evaluate(sizes)) for d in p.var.type.shape)
        dt = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "bf16": ml_dtypes.bfloat16}
        if p.var.type.dtype in dt:
            out[p.var.name] = _fp8(rng, shape, dt[p.var.type.dtype])
        else:  # scales over several octaves, so that a wrong block's scale shows
            out[p.var.name] = np.exp2(rng.integers(-6, 7, shape)).astype(np.float32) * rng.uniform(
                0.5, 1, shape
            ).astype(np.float32)
    return out


def _dequantized_product(
    ins: dict[str, np.ndarray], ta: bool, tb: bool, b_scaled_only: bool = False
) -> np.ndarray:
    """float64: (a times its scales) @ (w times its scales), each operand as stored, then transposed."""
    a = ins["a"].astype(np.float64)
    w = ins["w"].astype(np.float64)
    if not b_scaled_only:
        a = a * _repeat(ins["sa"], *a.shape)
    w = w * _repeat(ins["sw"], *w.shape)
    return (a.T if ta else a) @ (w.T if tb else w)


def _close(got: np.ndarray, want: np.ndarray, k: int) -> None:
    """Within the f32 accumulation of K products (plus the scale products), against the magnitudes."""
    mag = np.abs(want).max()
    assert np.abs(got.astype(np.float64) - want).max() <= 4 * (k + 2) * 2.0**-24 * mag * 8, (
        np.abs(got - want).max(),
        mag,
    )


@pytest.mark.parametrize("sizes", [(64, 384, 256), (3, 128, 128), (200, 640, 384)])
def test_deepseek_groups_against_the_dequantized_product(sizes: tuple[int, int, int]) -> None:
    m, k, n = sizes
    ins = _inputs(DEEPSEEK, m, k, n)
    got = coda_lang.load(DEEPSEEK)["scaled"].run(ins)["y"]
    _close(got, _dequantized_product(ins, False, True), k)


def test_a_transposed_operand_transposes_its_scales() -> None:
    ins = _inputs(TRANSPOSED, 96, 256, 64, seed=3)
    got = coda_lang.load(TRANSPOSED)["scaled"].run(ins)["y"]
    _close(got, _dequantized_product(ins, True, False), 256)


def test_one_operand_scaled() -> None:
    ins = _inputs(ONLY_B, 16, 96, 40, seed=4)
    got = coda_lang.load(ONLY_B)["scaled"].run(ins)["y"]
    _close(got, _dequantized_product(ins, False, True, b_scaled_only=True), 96)


def test_f64_precision_is_float64s_product() -> None:
    ins = _inputs(DEEPSEEK, 32, 256, 128, seed=5)
    got = coda_lang.load(DEEPSEEK)["scaled"].run(ins, precision="f64")["y"]
    want = _dequantized_product(ins, False, True)
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


def test_the_scales_are_per_block() -> None:
    """The same operands with each scale matrix replaced by its mean: far from the blockwise product
    (so the comparisons above can fail)."""
    ins = _inputs(DEEPSEEK, 64, 384, 256, seed=6)
    got = coda_lang.load(DEEPSEEK)["scaled"].run(ins)["y"]
    flat = {
        **ins,
        "sa": np.full_like(ins["sa"], ins["sa"].mean()),
        "sw": np.full_like(ins["sw"], ins["sw"].mean()),
    }
    want = _dequantized_product(ins, False, True)
    off = np.abs(_dequantized_product(flat, False, True) - want).max()
    assert off > 0.1 * np.abs(want).max()
    _close(got, want, 384)


@pytest.mark.parametrize("src", [DEEPSEEK, TRANSPOSED, ONLY_B])
def test_prints_back(src: str) -> None:
    prog = coda_lang.load(src)
    again = coda_lang.load(print_program(prog.ir))
    assert again.ir == prog.ir
    st = again["scaled"].ir.stages[0]
    assert st.scaled and (st.scale_a is not None) == (src != ONLY_B)


def _torch_grads(src: str, ins: dict[str, np.ndarray], dy: np.ndarray) -> dict[str, np.ndarray]:
    """float64 torch autograd of the dequantized product (the scales constants), by operand."""
    import torch

    blk = coda_lang.load(src)["scaled"]
    st = blk.ir.stages[0]
    t = {n: torch.tensor(np.asarray(x, np.float64), requires_grad=n in ("a", "w")) for n, x in ins.items()}
    deq = {}
    for op, sc in (("a", st.scale_a), ("w", st.scale_b)):
        x = t[op]
        deq[op] = x * torch.tensor(_repeat(ins[sc.name], *x.shape)) if sc is not None else x
    a = deq["a"].T if st.ta else deq["a"]
    w = deq["w"].T if st.tb else deq["w"]
    (a @ w).backward(torch.tensor(dy))
    return {n: t[n].grad.numpy() for n in ("a", "w")}


@pytest.mark.parametrize("remat", ["auto", "save", "recompute"])
@pytest.mark.parametrize("src", [DEEPSEEK, TRANSPOSED, ONLY_B], ids=["deepseek", "transposed", "only_b"])
def test_the_backward_against_torch_autograd(src: str, remat: str) -> None:
    """float64: the derived backward's gradients of both operands (the other operand's scale on its
    GEMM, the operand's own read over its groups in the epilogue) against torch autograd of the
    dequantized product."""
    blk = coda_lang.load(src)["scaled"]
    m, k, n = (40, 256, 128) if src == TRANSPOSED else (24, 256, 384) if src == DEEPSEEK else (16, 96, 40)
    ins = _inputs(src, m, k, n, seed=7)
    dy = np.random.default_rng(8).standard_normal((m, n))
    got = blk.vjp(ins, {"y": dy}, precision="f64", remat=remat)
    want = _torch_grads(src, ins, dy)
    assert set(got) == {"a", "w"}  # (a parameter used as a block scale is not differentiated by default)
    for name in ("a", "w"):
        g = np.asarray(got[name], np.float64)
        assert g.shape == want[name].shape
        assert np.abs(g - want[name]).max() <= 1e-12 * np.abs(want[name]).max(), name


CHAIN = """
dims M, D, K, N
block chain(x: bf16[M, D], w1: bf16[D, K], w2: e4m3[N, K], sw: f32[N/128, K/128]) -> (y: f32[M, N]) {
  gemm x @ w1 {
    amax = detach(max(abs(acc), over=K, group=128))
    hq: e4m3 = acc * (448.0 / max(amax, 1e-12))
  }
  gemm hq @ transpose(w2), scale_a=amax, scale_b=sw {
    y = acc * (1.0 / 448.0)
  }
}
"""


def test_a_quantizing_producer_and_its_scaled_consumer() -> None:
    """DeepSeek-V3's forward of two GEMMs: the first quantizes its output in 1x128 groups in its
    epilogue (the amax detached), the second multiplies it by 128x128-scaled weights with that amax as
    its block scale. The backward is straight through the quantizer: float64 gradients of x, w1, w2
    against torch autograd of the same math, the quantizer straight through; the derived GEMM of w2's
    gradient reads the saved amax as its block scale, and the data gradient hosts the first stage's
    backward."""
    import torch

    blk = coda_lang.load(CHAIN)["chain"]
    rng = np.random.default_rng(9)
    m, d, k, n = 20, 48, 256, 256
    ins = {
        "x": rng.standard_normal((m, d)).astype(ml_dtypes.bfloat16),
        "w1": rng.standard_normal((d, k)).astype(ml_dtypes.bfloat16),
        "w2": (rng.standard_normal((n, k)) * 4).astype(ml_dtypes.float8_e4m3fn),
        "sw": np.exp2(rng.integers(-3, 4, (n // 128, k // 128))).astype(np.float32),
    }
    dy = rng.standard_normal((m, n))
    bwd = blk.grad(["x", "w1", "w2"])
    text = print_block(bwd.ir)
    assert "scale_b=amax" in text and "expand(amax, acc)" in text and "expand(sw, acc)" in text, text
    got = blk.vjp(ins, {"y": dy}, precision="f64", wrt=["x", "w1", "w2"])
    t = {n_: torch.tensor(np.asarray(v, np.float64), requires_grad=n_ != "sw") for n_, v in ins.items()}
    h = t["x"] @ t["w1"]
    amax = h.detach().abs().unflatten(1, (-1, 128)).amax(-1).clamp(min=1e-12).repeat_interleave(128, 1)
    hs = h * (448.0 / amax)
    q = torch.tensor(hs.detach().numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float64))
    hq = hs + (q - hs).detach()  # the e4m3 store (rounded in f64 precision too), straight through
    w2 = t["w2"] * torch.tensor(_repeat(ins["sw"], n, k))
    ((hq * amax) @ w2.T * (1.0 / 448.0)).backward(torch.tensor(dy))
    for name in ("x", "w1", "w2"):
        want = t[name].grad.numpy()
        assert np.abs(np.asarray(got[name], np.float64) - want).max() <= 1e-11 * np.abs(want).max(), name


def test_no_gradient_through_a_scale() -> None:
    """A block scale asked for in `wrt`, or computed from a differentiated parameter without `detach`,
    is E0602 at its stage: the backward would miss the gradient through it."""
    blk = coda_lang.load(DEEPSEEK)["scaled"]
    with pytest.raises(CodaError) as e:
        blk.grad(["a", "sa"])
    (d,) = e.value.diagnostics
    assert (
        d.code == "E0602" and "`sa`, a block scale" in d.message and d.span is not None and d.span.line == 4
    )
    live = CHAIN.replace("detach(max(abs(acc), over=K, group=128))", "max(abs(acc), over=K, group=128)")
    with pytest.raises(CodaError) as e:
        coda_lang.load(live)["chain"].grad(["x", "w1", "w2"])
    assert e.value.diagnostics[0].code == "E0602" and "`amax`" in e.value.diagnostics[0].message


def test_fuzz_on_the_interpreter_forward_and_backward() -> None:
    from coda_lang.fuzz.search import fuzz_block

    for src, name in ((DEEPSEEK, "scaled"), (TRANSPOSED, "scaled"), (CHAIN, "chain")):
        res = fuzz_block(coda_lang.load(src)[name], "interp", examples=4)
        assert res.failure is None, res.failure


def test_the_kernels_take_deepseeks_form_and_refuse_the_others() -> None:
    """The kernels' block-scaled GEMM (plan/block_scaled.py) is DeepSeek-V3's form: a [M, K] and
    transpose(w), both fp8, sa [M, K/128] and sw [N/128, K/128]. It plans (the scales carried to the
    mainloop by two BlockScale ops; the emulated kernels alike), at 128 x 128 cooperative tiles only.
    Every other form is E0709 at the scale, naming what is wrong: A transposed, 16-bit operands, A's
    scale alone (w's alone is a form of the kernels': test_ws_scale_alone_and_the_data_gradient...)."""
    from coda_lang.backend_cute.build.config import TileConfig, fits
    from coda_lang.backend_cute.plan.emit import emit_stage
    from coda_lang.backend_cute.plan.planner import plan_stage

    blk = coda_lang.load(DEEPSEEK)["scaled"]
    for emulated in (False, True):
        g = plan_stage(blk, 1, emulated=emulated).gemm
        assert (g.scale_a, g.scale_b, g.ta, g.tb, g.a_dtype) == ("sa", "sw", False, True, "e4m3")
    spec = plan_stage(blk, 1)
    src = emit_stage(spec)
    assert f'BlockScale("{spec.gemm.scale_a_py}", "a", "{spec.gemm.scale_b_py}")' in src
    assert "from coda_lang.backend_cute.plan.block_scaled import BlockScale" in src
    assert fits(spec, TileConfig(128, 128, 2, 1, False))
    assert not fits(spec, TileConfig(128, 192, 2, 1, False)) and not fits(spec, TileConfig(128, 128))
    assert fits(spec, TileConfig(128, 192), emulated=True)  # (the torch stand-in holds at any tile)
    for src_, why in ((TRANSPOSED, "K-major"), (ONLY_B, "not both fp8"), (ONLY_A, "scales a only")):
        for emulated in (False, True):
            with pytest.raises(CodaError) as e:
                plan_stage(coda_lang.load(src_)["scaled"], 1, emulated=emulated)
            (d,) = e.value.diagnostics
            assert d.code == "E0709" and why in d.message and d.span is not None and d.span.line == 4


def test_the_emulated_kernels_run_the_forward_against_the_interpreter() -> None:
    """`coda fuzz --target emulate` of DeepSeek's form, forward: the torch stand-in of the kernel
    (each 128-deep block of K scaled, in order) within the accuracy rule of the interpreter, at
    ragged sizes the fuzzer draws; alone, and after a GEMM that quantizes its output in 1x128 groups
    and makes the scale (CHAIN: an e4m3 value the block stores, multiplied as e4m3). Their backwards'
    GEMMs carry one scale each: E0709, a note."""
    from coda_lang.fuzz.search import fuzz_block

    for src, name in ((DEEPSEEK, "scaled"), (CHAIN, "chain")):
        res = fuzz_block(coda_lang.load(src)[name], "emulate", examples=2)
        assert res.failure is None, res.failure
        assert res.cases == 2 and any("E0709" in n for n in res.notes), (name, res.notes)


def test_ws_scale_alone_and_the_data_gradient_run_emulated_against_the_interpreter() -> None:
    """w's scale alone (FP8_ONLY_B), and DeepSeek's form differentiated with respect to `a` with e5m2
    cotangents, whose backward's GEMM is the data gradient `dacc @ w, scale_b=sw` (w's blocks laid out
    as w is stored, [K/128, N/128] from that GEMM's side): they plan with B's scale alone, and the
    emulated kernels run them within the accuracy rule of the interpreter, forward and backward. With
    respect to `w` too: DeepSeek's weight gradient `transpose(dacc) @ a, scale_b=sa` is still E0709
    (A's scale changes along the contraction), a note; the other's reads `expand(sw, acc)` over 128 x
    128 groups of its tile, which runs (test_grouped_reads_in_the_runtimes)."""
    from coda_lang.backend_cute.plan.planner import plan_stage
    from coda_lang.fuzz.fuzzer import Fuzzer
    from coda_lang.fuzz.search import fuzz_block

    fwd = coda_lang.load(FP8_ONLY_B)["scaled"]
    bwd = coda_lang.load(DEEPSEEK.replace("f32[M, N]", "bf16[M, N]"))["scaled"]
    for blk in (fwd, bwd):
        res = fuzz_block(
            blk, "emulate", examples=3, fuzzer=Fuzzer(blk, "emulate", fp8_grads="e5m2", wrt=["a"])
        )
        assert res.failure is None and res.cases == 3, res.failure
        assert not any("not checked" in n for n in res.notes), res.notes
        g = plan_stage(blk.grad(["a"], backward=coda_lang.BackwardOptions(fp8_grads="e5m2")), 2).gemm
        assert (g.scale_a, g.scale_b, g.b_kn, g.copy_b) == (None, "sw", True, True)
    # the weight gradients: DeepSeek's form's A groups change along its contraction (E0709); w's scale
    # alone reads w's 128 x 128 blocks in its weight gradient's epilogue (`expand(sw, acc)`, passed
    # repeated over rows), so that block's whole backward runs
    res = fuzz_block(
        bwd, "emulate", examples=1, fuzzer=Fuzzer(bwd, "emulate", fp8_grads="e5m2", wrt=["a", "w"])
    )
    assert res.failure is None and any("E0709" in n and "transpose(dacc1) @ a" in n for n in res.notes), (
        res.notes
    )
    res = fuzz_block(
        fwd, "emulate", examples=3, fuzzer=Fuzzer(fwd, "emulate", fp8_grads="e5m2", wrt=["a", "w"])
    )
    assert res.failure is None and res.cases == 3 and not res.notes, (res.failure, res.notes)


def test_the_commands(tmp_path: Any) -> None:
    f = tmp_path / "scaled.coda"
    f.write_text(DEEPSEEK)
    r = coda("grad", str(f))
    assert r.returncode == 0 and "scale_b=sw" in r.stdout and "expand(sa, acc)" in r.stdout, r.stderr
    r = coda("compile", str(f), "--emit", "source", "-o", str(tmp_path / "out"))
    assert r.returncode == 0 and "BlockScale(" in (tmp_path / "out" / "scaled_stage1.py").read_text(), (
        r.stderr
    )
    # a tile the stage can't take: E0805 naming its rules, before anything compiles
    r = coda("compile", str(f), "--emit", "ptx", "--tile", "128x192", "-o", str(tmp_path / "out"))
    assert r.returncode == 1 and "E0805" in r.stderr and "one block of B's rows" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not list((tmp_path / "out").glob("*.ptx"))
    t = tmp_path / "transposed.coda"
    t.write_text(TRANSPOSED)
    r = coda("compile", str(t), "--emit", "source", "-o", str(tmp_path / "out"))
    assert r.returncode == 1 and "E0709" in r.stderr and "Traceback" not in r.stderr
    r = coda("fuzz", str(f), "--target", "interp", "--examples", "4", "--no-backward")
    assert r.returncode == 0, r.stderr


GROUPED = """
dims M, K, N
block deq(x: e4m3[M, N], s: f32[M/2, N/128]) -> (y: f32[M, N]) {
  elementwise [M, N] {
    y = x * expand(s, x)
  }
}
block epi(a: bf16[M, K], w: bf16[K, N], s: f32[M, N/128]) -> (y: f32[M, N]) {
  gemm a @ w {
    y = acc * expand(s, acc)
  }
}
block rows(a: bf16[M, K], w: bf16[K, N], s: f32[M/2, N/128]) -> (y: f32[M, N]) {
  gemm a @ w {
    y = acc * expand(s, acc)
  }
}
block columns(a: bf16[M, K], w: bf16[K, N], s: f32[M/2, N]) -> (y: f32[M, N]) {
  gemm a @ w {
    y = acc * expand(s, acc)
  }
}
"""


@pytest.mark.parametrize("tile", [None, (4, 128), (3, 256), (5, 100)])
def test_a_matrix_read_over_its_groups(tile: Any) -> None:
    """`expand(s, acc)` of a matrix whose extents are the tile space's divided by whole group sizes:
    each element of the tile reads its group's, at any simulated tile (a tile may cut a group)."""
    prog = coda_lang.load(GROUPED)
    rng = np.random.default_rng(10)
    m, k, n = 6, 8, 384
    x = rng.standard_normal((m, n)).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(1, 4, (m // 2, n // 128)).astype(np.float32)
    got = prog["deq"].run({"x": x, "s": s}, sim_tile=tile)["y"]
    assert np.array_equal(got, (x.astype(np.float32) * _repeat(s, m, n).astype(np.float32)))
    a = rng.standard_normal((m, k)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((k, n)).astype(ml_dtypes.bfloat16)
    s2 = rng.uniform(1, 4, (m, n // 128)).astype(np.float32)
    want = (a.astype(np.float64) @ w.astype(np.float64)) * _repeat(s2, m, n)
    got = prog["epi"].run({"a": a, "w": w, "s": s2}, sim_tile=tile)["y"]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_a_matrix_read_without_expand_says_how() -> None:
    src = GROUPED.replace("acc * expand(s, acc)", "acc * s")
    with pytest.raises(CodaError) as e:
        coda_lang.load(src)
    diags = e.value.diagnostics
    assert diags and all(d.code == "E0505" and any("expand(s, acc)" in h for h in d.help) for d in diags)


def test_grouped_reads_in_the_runtimes() -> None:
    """An elementwise stage's torch stand-in (the emulated runtime, and torch.compile's on a GPU) expands
    the matrix as the interpreter does; the generated Triton kernel leaves such a stage to torch.compile.
    A GEMM epilogue loads a matrix of one value per row and run of g columns (`s: [M, N/128]`) as the
    column a tile's columns fall in (epi_ops.GroupColumnLoad, at tiles whose N divides g): planned,
    and run emulated against the interpreter, forward and backward. Groups that span rows too
    (`s: [M/2, N/128]`) load the same way, the runtime passing `s` repeated over its groups of rows;
    a matrix of one value per column (`s: [M/2, N]`) is E0704."""
    import torch

    from coda_lang.backend_cute.build.config import TileConfig, fits
    from coda_lang.backend_cute.plan.emit import emit_stage
    from coda_lang.backend_cute.plan.planner import plan_stage
    from coda_lang.backend_triton import generate
    from coda_lang.backend_triton.elementwise import ElementwiseStage
    from coda_lang.fuzz.search import fuzz_block

    prog = coda_lang.load(GROUPED)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((8, 256)).astype(ml_dtypes.float8_e4m3fn)
    s = rng.uniform(1, 4, (4, 2)).astype(np.float32)
    want = prog["deq"].run({"x": x, "s": s})["y"]
    xt = torch.from_numpy(x.astype(np.float32)).to(torch.float8_e4m3fn)
    got = prog["deq"].cuda(emulate=True)({"x": xt, "s": torch.from_numpy(s)})["y"]
    assert np.array_equal(got.numpy(), want)
    assert "expand" in (generate.unsupported(ElementwiseStage(prog["deq"], 1, emulate=False)) or "")
    spec = plan_stage(prog["epi"], 1)
    (o,) = spec.operands
    assert (o.role, o.op, o.group) == ("grouped tile", "GroupColumnLoad", 128)
    assert 'GroupColumnLoad("s", group=128)' in emit_stage(spec)
    assert fits(spec, TileConfig(128, 128)) and fits(spec, TileConfig(128, 64))
    assert not fits(spec, TileConfig(128, 192)) and fits(spec, TileConfig(128, 192), emulated=True)
    from coda_lang.fuzz.fuzzer import Fuzzer

    res = fuzz_block(
        prog["epi"], "emulate", examples=2, fuzzer=Fuzzer(prog["epi"], "emulate", wrt=["a", "w"])
    )
    assert res.failure is None and res.cases == 2, (res.failure, res.notes)
    (o,) = plan_stage(prog["rows"], 1).operands
    assert (o.role, o.group, o.row_group) == ("grouped tile", 128, 2)
    res = fuzz_block(
        prog["rows"], "emulate", examples=2, fuzzer=Fuzzer(prog["rows"], "emulate", wrt=["a", "w"])
    )
    assert res.failure is None and res.cases == 2 and not res.notes, (res.failure, res.notes)
    with pytest.raises(CodaError) as e:
        plan_stage(prog["columns"], 1)
    assert e.value.diagnostics[0].code == "E0704" and "of one column each" in e.value.diagnostics[0].message


WEIGHTS = """
dims N, K
block wq(w: bf16[N, K]) -> (wq: e4m3[N, K], s: f32[N/128, K/128]) {
  elementwise [N, K] {
    m = detach(max(abs(w), over=K, group=128))
  }
  elementwise [N, K/128] {
    s = max(m, over=N, group=128)
  }
  elementwise [N, K] {
    wq: e4m3 = w * (448.0 / max(expand(s, w), 1e-12))
  }
}
"""


def test_the_weights_quantizer_runs_on_the_kernels_runtime() -> None:
    """WEIGHTS on the emulated kernels' runtime (its elementwise stages' torch functions, as a GPU runs
    them through torch.compile), as the interpreter runs it: the second stage reduces the first's
    stored per-group amax over runs of 128 rows (E0705 there before), the third reads the result over
    128 x 128 groups."""
    from coda_lang.backend_triton import generate
    from coda_lang.backend_triton.elementwise import ElementwiseStage
    from coda_lang.fuzz.search import fuzz_block

    blk = coda_lang.load(WEIGHTS)["wq"]
    res = fuzz_block(blk, "emulate", examples=4, backward=False)
    assert res.failure is None and res.cases == 4, res.failure
    assert "runs of rows" in (generate.unsupported(ElementwiseStage(blk, 2, emulate=False)) or "")


def test_the_weights_128_by_128_scales() -> None:
    """docs/language.md's weight quantizer: each 128 x 128 block's amax (NumPy's), and the e4m3 codes of
    w scaled by 448 over it (ml_dtypes' rounding), so that wq times the scales over 448 is w to e4m3's
    precision."""
    rng = np.random.default_rng(12)
    w = (rng.standard_normal((256, 384)) * np.exp2(rng.integers(-4, 5, (256, 1)))).astype(ml_dtypes.bfloat16)
    out = coda_lang.load(WEIGHTS)["wq"].run({"w": w})
    amax = np.abs(w.astype(np.float32)).reshape(2, 128, 3, 128).max(axis=(1, 3))
    assert np.array_equal(out["s"], amax)
    want = (w.astype(np.float32) * (np.float32(448.0) / _repeat(amax, 256, 384).astype(np.float32))).astype(
        ml_dtypes.float8_e4m3fn
    )
    assert np.array_equal(out["wq"].view(np.uint8), want.view(np.uint8))


MLP = """
dims M, D, F
block mlp(x: bf16[M, D], w13: e4m3[2*F, D], s13: f32[2*F/128, D/128], w2: e4m3[D, F], s2: f32[D/128, F/128])
    -> (y: bf16[M, D]) {
  elementwise [M, D] {
    ax = detach(max(abs(x), over=D, group=128))
    xq: e4m3 = x * (448.0 / max(ax, 1e-12))
  }
  gemm xq @ transpose(w13), scale_a=ax, scale_b=s13 {
    g, u = pairs(acc * (1.0 / 448.0))
    a = silu(g) * u
    aa = detach(max(abs(a), over=F, group=128))
    aq: e4m3 = a * (448.0 / max(aa, 1e-12))
  }
  gemm aq @ transpose(w2), scale_a=aa, scale_b=s2 {
    y = acc * (1.0 / 448.0)
  }
}
"""


def _mlp_inputs(seed: int, m: int, d: int, f: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """MLP's inputs (x in bf16, e4m3 weights and their power-of-two 128 x 128 scales) and a cotangent of y."""
    rng = np.random.default_rng(seed)
    ins = {
        "x": rng.standard_normal((m, d)).astype(ml_dtypes.bfloat16),
        "w13": (rng.standard_normal((2 * f, d)) * 2).astype(ml_dtypes.float8_e4m3fn),
        "s13": np.exp2(rng.integers(-6, -3, (2 * f // 128, d // 128))).astype(np.float32),
        "w2": (rng.standard_normal((d, f)) * 2).astype(ml_dtypes.float8_e4m3fn),
        "s2": np.exp2(rng.integers(-6, -3, (d // 128, f // 128))).astype(np.float32),
    }
    return ins, rng.standard_normal((m, d))


def test_deepseeks_mlp_end_to_end() -> None:
    """A SwiGLU MLP in DeepSeek-V3's recipe, written in the language: its input quantized in 1x128 groups,
    the gate/up GEMM on 128 x 128-scaled weights, the SwiGLU output quantized in 1x128 groups in that
    GEMM's epilogue, the down GEMM likewise. float64 gradients of x and both weights (straight through
    every quantizer, at the forward's codes) against torch autograd of the same math."""
    import torch

    blk = coda_lang.load(MLP)["mlp"]
    m, d, f = 12, 256, 256
    ins, dy = _mlp_inputs(13, m, d, f)
    got = blk.vjp(ins, {"y": dy}, precision="f64", wrt=["x", "w13", "w2"])

    t = {
        k: torch.tensor(np.asarray(v, np.float64), requires_grad=k in ("x", "w13", "w2"))
        for k, v in ins.items()
    }

    def quantized(v: Any) -> tuple[Any, Any]:
        """v's 1x128-group e4m3 codes (straight through) and their amax, repeated over the groups."""
        amax = v.detach().abs().unflatten(1, (-1, 128)).amax(-1).clamp(min=1e-12).repeat_interleave(128, 1)
        vs = v * (448.0 / amax)
        q = torch.tensor(vs.detach().numpy().astype(ml_dtypes.float8_e4m3fn).astype(np.float64))
        return vs + (q - vs).detach(), amax

    xq, ax = quantized(t["x"])
    w13 = t["w13"] * torch.tensor(_repeat(ins["s13"], 2 * f, d))
    z = (xq * ax) @ w13.T / 448.0
    a = torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]
    aq, aa = quantized(a)
    w2 = t["w2"] * torch.tensor(_repeat(ins["s2"], d, f))
    y = (aq * aa) @ w2.T / 448.0
    assert (
        np.abs(blk.run(ins, precision="f64")["y"] - y.detach().numpy()).max() <= 1e-12 * y.abs().max().item()
    )
    y.backward(torch.tensor(dy))
    for name in ("x", "w13", "w2"):
        want = t[name].grad.numpy()
        assert np.abs(np.asarray(got[name], np.float64) - want).max() <= 1e-10 * np.abs(want).max(), name


def _requantized(v: np.ndarray, g: int = 128) -> np.ndarray:
    """float64 `v` [M, K] quantized in g x 1 groups as the requantizing stage does: each group's amax
    (at least 1e-12), the e4m3 codes of v * (448 / amax), times the scale amax * (1 / 448)."""
    m, k = v.shape
    amax = np.maximum(np.abs(v).reshape(m // g, g, k).max(axis=1), 1e-12)
    codes = (v * np.repeat(448.0 / amax, g, 0)).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return codes * np.repeat(amax * (1.0 / 448.0), g, 0)


def test_the_weight_gradients_read_their_activations_quantized_again() -> None:
    """BackwardOptions(requantize_wgrad=True) on DeepSeek's MLP: each weight gradient reads its
    activation (`xq`, `aq`, in 1 x 128 groups along K) quantized again in 128 x 1 groups by an
    elementwise stage of the backward, as DeepSeek-V3 does, with a scale per 128 rows and column
    (`scale_b=`, constant over each 128-deep block of its contraction). float64 gradients of both
    weights against NumPy of that recipe (the forward's dequantized activation, requantized, times the
    cotangent); x's gradient is the exact one's bit for bit; the weights' differ from the exact
    straight-through ones by the second rounding, and by no more than e4m3's step."""
    from coda_lang.frontend.syntax.printer import print_block

    blk = coda_lang.load(MLP)["mlp"]
    m, d, f = 256, 256, 256
    ins, dy = _mlp_inputs(17, m, d, f)
    wrt = ["x", "w13", "w2"]
    opts = coda_lang.BackwardOptions(requantize_wgrad=True)
    text = print_block(blk.derivation(wrt, backward=opts).backward.ir)
    assert "scale_b=aac" in text and "scale_b=axc" in text and "over=M, group=128" in text, text
    got = blk.vjp(ins, {"y": dy}, precision="f64", wrt=wrt, backward=opts)
    exact = blk.vjp(ins, {"y": dy}, precision="f64", wrt=wrt)
    assert np.array_equal(np.asarray(got["x"], np.float64), np.asarray(exact["x"], np.float64))

    # the forward in float64 (as test_deepseeks_mlp_end_to_end), then the recipe's weight gradients
    def quantized(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        amax = np.maximum(np.abs(v).reshape(m, -1, 128).max(-1), 1e-12)
        codes = (v * np.repeat(448.0 / amax, 128, 1)).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
        return codes, amax

    x = np.asarray(ins["x"], np.float64)
    w13 = np.asarray(ins["w13"], np.float64) * _repeat(ins["s13"], 2 * f, d)
    w2 = np.asarray(ins["w2"], np.float64) * _repeat(ins["s2"], d, f)
    xq, ax = quantized(x)
    z = (xq * np.repeat(ax, 128, 1)) @ w13.T / 448.0
    gate, up = z[:, 0::2], z[:, 1::2]
    a = gate / (1.0 + np.exp(-gate)) * up
    aq, aa = quantized(a)
    dacc3 = dy / 448.0
    dw2 = dacc3.T @ _requantized(aq * np.repeat(aa, 128, 1)) * _repeat(ins["s2"], d, f)
    # the cotangent of z: through the SwiGLU at the forward's codes (straight through aq)
    da = (dacc3 @ w2) * np.repeat(aa, 128, 1) * np.repeat(448.0 / aa, 128, 1)
    sig = 1.0 / (1.0 + np.exp(-gate))
    dz = np.empty_like(z)
    dz[:, 0::2] = da * up * sig * (1.0 + gate * (1.0 - sig))
    dz[:, 1::2] = da * gate * sig
    dw13 = (dz / 448.0).T @ _requantized(xq * np.repeat(ax, 128, 1)) * _repeat(ins["s13"], 2 * f, d)
    for name, want in (("w2", dw2), ("w13", dw13)):
        g, e = np.asarray(got[name], np.float64), np.asarray(exact[name], np.float64)
        top = np.abs(want).max()
        assert np.abs(g - want).max() <= 1e-9 * top, name
        off = np.abs(g - e).max()
        assert 1e-6 * top < off <= 2.0**-3 * top, (name, off / top)  # (the second rounding, within a step)


def test_requantized_weight_gradients_on_the_kernels_the_commands_and_bad_options(tmp_path: Any) -> None:
    """The requantized weight gradient (a scale per column and 128-deep block of K) plans for the
    kernels' column-scale loop, kernels and emulated alike (GPU-checked 2026-11-29);
    `coda grad --requantize-wgrad` prints it, `coda fuzz --requantize-wgrad` checks it on the
    interpreter (whole groups of rows in its simulated tiles), and goes with a backward only (exit 2); a
    bad value is a TypeError."""
    from coda_lang.backend_cute.plan.planner import plan_stage

    blk = coda_lang.load(MLP)["mlp"]
    opts = coda_lang.BackwardOptions(fp8_grads="e5m2", requantize_wgrad=True)
    bwd = blk.grad(["x", "w13", "w2"], backward=opts)
    wgrads = [i + 1 for i, st in enumerate(bwd.ir.stages) if st.is_gemm and st.ta]
    assert len(wgrads) == 2
    for i in wgrads:
        for emulated in (False, True):
            g = plan_stage(bwd, i, emulated=emulated).gemm
            assert g.b_columns and g.b_kn and g.scale_a is None, (i, emulated)
    f = tmp_path / "mlp.coda"
    f.write_text(MLP)
    r = coda("grad", str(f), "--requantize-wgrad")
    assert r.returncode == 0 and "over=M, group=128" in r.stdout and "requantize_wgrad" in r.stdout, r.stderr
    assert "nothing is quantized again" not in r.stdout
    # a block without block-scaled weight gradients: the same backward, and a line that says so
    plain = tmp_path / "plain.coda"
    plain.write_text(FP8_ONLY_B)
    r = coda("grad", str(plain), "--requantize-wgrad")
    assert r.returncode == 0 and "nothing is quantized again" in r.stdout, (r.stdout, r.stderr)
    r = coda("fuzz", str(f), "--target", "interp", "--examples", "3", "--requantize-wgrad")
    assert r.returncode == 0 and "--requantize-wgrad" in r.stdout, (r.stdout, r.stderr)
    r = coda("fuzz", str(f), "--target", "interp", "--requantize-wgrad", "--no-backward")
    assert r.returncode == 2 and "--requantize-wgrad" in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(TypeError, match="requantize_wgrad= is 'yes'"):
        coda_lang.BackwardOptions(requantize_wgrad="yes")  # type: ignore[arg-type]


# an activation quantized in 1 x 128 groups by an elementwise stage, then a block-scaled GEMM
QUANTIZED_INPUT = """
dims M, D, N
block q1(x: bf16[M, D], w: e4m3[N, D], sw: f32[N/128, D/128]) -> (y: bf16[M, N]) {
  elementwise [M, D] {
    ax = detach(max(abs(x), over=D, group=128))
    xq: e4m3 = x * (448.0 / max(ax, 1e-12))
  }
  gemm xq @ transpose(w), scale_a=ax, scale_b=sw {
    y: bf16 = acc * (1.0 / 448.0)
  }
}
"""


def test_an_input_quantizers_backward_reads_its_stored_amax() -> None:
    """The backward of the stage that quantizes x in 1 x 128 groups runs in the epilogue of x's data
    gradient (`dacc @ w, scale_b=sw`). It reads the amax the forward stored (`expand(ax, acc)`, the
    same f32 values) rather than reducing x's tile over groups again, which the kernels don't fold
    (E0705): so the whole backward with respect to x plans (w's scale alone, its blocks as w is
    stored; a grouped column load) and runs emulated against the interpreter. The forward, whose
    elementwise stage hands the GEMM its amax as `scale_a=`, runs emulated as the interpreter does."""
    import torch

    from coda_lang.backend_cute.plan.planner import plan_stage
    from coda_lang.backend_triton import generate
    from coda_lang.backend_triton.elementwise import ElementwiseStage
    from coda_lang.frontend.syntax.printer import print_block
    from coda_lang.fuzz.fuzzer import Fuzzer
    from coda_lang.fuzz.search import fuzz_block

    blk = coda_lang.load(QUANTIZED_INPUT)["q1"]
    # the forward: the stage's amax, a grouped value that the GEMM reads as its scale, comes back from the
    # elementwise stage (a KeyError before), one value per row and group; the generated Triton kernel
    # leaves such a stage to its torch function
    rng = np.random.default_rng(5)
    ins = {
        "x": rng.standard_normal((16, 256)).astype(ml_dtypes.bfloat16),
        "w": (rng.standard_normal((256, 256)) * 2).astype(ml_dtypes.float8_e4m3fn),
        "sw": np.exp2(rng.integers(-3, 3, (2, 2))).astype(np.float32),
    }
    tin = {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in ins.items()}
    tin["x"], tin["w"] = tin["x"].bfloat16(), tin["w"].to(torch.float8_e4m3fn)
    got = blk.cuda(emulate=True)(tin)["y"].float().numpy()
    assert np.array_equal(got, np.asarray(blk.run(ins)["y"], np.float32))
    why = generate.unsupported(ElementwiseStage(blk, 1, emulate=False)) or ""
    assert "`ax`" in why and "used after the stage" in why, why
    bwd = blk.grad(["x"], backward=coda_lang.BackwardOptions(fp8_grads="e5m2"))
    (k,) = [i + 1 for i, st in enumerate(bwd.ir.stages) if st.is_gemm]
    text = print_block(bwd.ir)
    stage = text[text.index("gemm ") :]
    assert "expand(ax, acc)" in stage and "group=128" not in stage, stage
    for emulated in (False, True):
        g = plan_stage(bwd, k, emulated=emulated).gemm
        assert (g.scale_a, g.scale_b) == (None, "sw")
    res = fuzz_block(blk, "emulate", examples=3, fuzzer=Fuzzer(blk, "emulate", fp8_grads="e5m2", wrt=["x"]))
    assert res.failure is None and res.cases == 3 and not res.notes, (res.failure, res.notes)
    res = fuzz_block(blk, "interp", examples=3, fuzzer=Fuzzer(blk, "interp", wrt=["x", "w"]))
    assert res.failure is None and res.cases == 3, res.failure


def test_a_grouped_value_used_by_a_later_elementwise_stage() -> None:
    """A grouped value computed from a grouped reduction (not only `detach` of it: `r = s * 2.0`) and
    read by a later elementwise stage over its groups comes back from its stage: the emulated kernels
    run the block as the interpreter does (`coda fuzz --target emulate`, forward)."""
    from coda_lang.fuzz.search import fuzz_block

    src = """
dims M, D, N
block q(x: bf16[M, D], w: bf16[N, D]) -> (y: bf16[M, N], z: bf16[M, D]) {
  elementwise [M, D] {
    s = max(abs(x), over=D, group=128)
    r = s * 2.0
    xg: bf16 = x * 2.0
  }
  gemm xg @ transpose(w) {
    y: bf16 = acc
  }
  elementwise [M, D] {
    z: bf16 = x * expand(r, x)
  }
}
"""
    res = fuzz_block(coda_lang.load(src)["q"], "emulate", examples=3, backward=False)
    assert res.failure is None and res.cases == 3, res.failure


def test_the_requantized_weight_gradient_runs_emulated() -> None:
    """QUANTIZED_INPUT differentiated with respect to x and w, `requantize_wgrad=True`: x's data
    gradient, the stage that quantizes x again in 128 x 1 groups (a reduction over runs of rows, in the
    elementwise stage's torch function), and w's gradient `transpose(dacc) @ xqc, scale_b=axc` (a scale
    per column and K block; `expand(sw, acc)` read over 128 x 128 groups): the emulated kernels run the
    whole backward as the interpreter does."""
    from coda_lang.backend_cute.plan.emit import emit_stage
    from coda_lang.backend_cute.plan.planner import plan_stage
    from coda_lang.fuzz.fuzzer import Fuzzer
    from coda_lang.fuzz.search import fuzz_block

    blk = coda_lang.load(QUANTIZED_INPUT)["q1"]
    opts = coda_lang.BackwardOptions(fp8_grads="e5m2", requantize_wgrad=True)

    def fuzz() -> Any:
        fz = Fuzzer(blk, "emulate", backward=opts, wrt=["x", "w"])
        return fuzz_block(blk, "emulate", examples=3, dims={"M": 256, "D": 384, "N": 256}, fuzzer=fz)

    bwd = blk.grad(["x", "w"], backward=opts)
    k = max(i + 1 for i, st in enumerate(bwd.ir.stages) if st.is_gemm)
    spec = plan_stage(bwd, k)
    assert spec.gemm.b_columns and spec.gemm.b_kn and spec.gemm.copy_b
    assert f'BlockScale("{spec.gemm.scale_b_py}", "b", "", kn=True, columns=True)' in emit_stage(spec)
    res = fuzz()
    assert res.failure is None and res.cases == 3 and not res.notes, (res.failure, res.notes)


# DeepSeek-V3's recipe for a SwiGLU MLP in forms the kernels take: x and the SwiGLU output each
# quantized in 1 x 128 groups by an elementwise stage (the gate/up epilogue's grouped amax over column
# pairs is not compiled yet: E0705), both GEMMs on 128 x 128-scaled e4m3 weights
BLOCKWISE_MLP = """
dims M, D, F
block mlp(x: bf16[M, D], w13: e4m3[2*F, D], s13: f32[2*F/128, D/128], w2: e4m3[D, F], s2: f32[D/128, F/128])
    -> (y: bf16[M, D]) {
  elementwise [M, D] {
    ax = detach(max(abs(x), over=D, group=128))
    xq: e4m3 = x * (448.0 / max(ax, 1e-12))
  }
  gemm xq @ transpose(w13), scale_a=ax, scale_b=s13 {
    g, u = pairs(acc * (1.0 / 448.0))
    a: bf16 = silu(g) * u
  }
  elementwise [M, F] {
    aa = detach(max(abs(a), over=F, group=128))
    aq: e4m3 = a * (448.0 / max(aa, 1e-12))
  }
  gemm aq @ transpose(w2), scale_a=aa, scale_b=s2 {
    y: bf16 = acc * (1.0 / 448.0)
  }
}
"""
BLOCKWISE_OPTIONS = {"fp8_grads": "e5m2", "requantize_wgrad": True}

# the same recipe for a LLaMA layer's input norm and QKV projection with RoPE (an epilogue over column
# pairs): the norm's weighted input quantized in 1 x 128 groups, the row scale deferred into the epilogue
BLOCKWISE_QKV = """
dims M, D, P
block qkv(h: bf16[M, D], g: f32[D], w: e4m3[2*P, D], sw: f32[2*P/128, D/128], pos: f32[M], freq: f32[P],
          eps: f32 = 1e-5) -> (qkv: bf16[M, 2*P]) {
  elementwise [M, D] {
    ss = sum(h * h, over=D)
    hg = h * g
    ah = detach(max(abs(hg), over=D, group=128))
    hq: e4m3 = hg * (448.0 / max(ah, 1e-12))
  }
  r = rsqrt(ss / D + eps)
  gemm hq @ transpose(w), scale_a=ah, scale_b=sw {
    z = acc * (1.0 / 448.0) * r
    qa, qb = pairs(z)
    ang = pos * freq
    c = cos(ang)
    s = sin(ang)
    qkv: bf16 = interleave(qa * c - qb * s, qa * s + qb * c)
  }
}
"""
# each blockwise block, the parameters it is differentiated with respect to, and fixed fuzz sizes
BLOCKWISE = {
    "mlp": (BLOCKWISE_MLP, ["x", "w13", "w2"], {"M": 256, "D": 256, "F": 384}),
    "qkv": (BLOCKWISE_QKV, ["h", "g", "w"], {"M": 256, "D": 256, "P": 192}),
}


@pytest.mark.parametrize("name", sorted(BLOCKWISE))
def test_blockwise_blocks_forward_and_backward_on_the_emulated_kernels(name: str) -> None:
    """BLOCKWISE_MLP and BLOCKWISE_QKV differentiated with e5m2 cotangents and the weight gradients'
    activations quantized again in 128 x 1 groups: every GEMM stage of the forward and the backward
    plans for the kernels, and the emulated kernels run both as the interpreter does."""
    from coda_lang.backend_cute.plan.planner import plan_stage
    from coda_lang.fuzz.fuzzer import Fuzzer
    from coda_lang.fuzz.search import fuzz_block

    src, wrt, dims = BLOCKWISE[name]
    blk = coda_lang.load(src)[name]
    opts = coda_lang.BackwardOptions(**BLOCKWISE_OPTIONS)  # type: ignore[arg-type]

    def fuzz() -> Any:
        fz = Fuzzer(blk, "emulate", backward=opts, wrt=wrt)
        return fuzz_block(blk, "emulate", examples=3, dims=dims, fuzzer=fz)

    bwd = blk.grad(wrt, backward=opts)
    for b in (blk, bwd):
        gemms = [i + 1 for i, st in enumerate(b.ir.stages) if st.is_gemm]
        assert gemms and all(plan_stage(b, i).gemm.scaled for i in gemms), b.name
    res = fuzz()
    assert res.failure is None and res.cases == 3 and not res.notes, (res.failure, res.notes)


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("name", sorted(BLOCKWISE))
def test_blockwise_blocks_kernels_compile(name: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Each GEMM kernel of the blockwise blocks' forwards and backwards (BLOCKWISE_MLP: two forward,
    four backward; BLOCKWISE_QKV: one and two) compiles for sm_90a at 128 x 128 cooperative without
    spills: data gradients on w's blocks alone, weight gradients with a scale per column."""
    from coda_lang.backend_cute.build.config import TileConfig
    from coda_lang.backend_cute.build.select import select_config

    pytest.importorskip("quack")
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    src, wrt, _ = BLOCKWISE[name]
    blk = coda_lang.load(src)[name]
    bwd = blk.grad(wrt, backward=coda_lang.BackwardOptions(**BLOCKWISE_OPTIONS))  # type: ignore[arg-type]
    for b in (blk, bwd):
        for i, st in enumerate(b.ir.stages, 1):
            if st.is_gemm:
                c = select_config(b, i, directory=tmp_path)
                assert c.config == TileConfig(128, 128, 2, 1, False), (b.name, i, c.config)
                assert c.report is not None and not c.report.spills, (b.name, i, c.report.text)


@pytest.mark.gpu
def test_an_input_quantizers_backward_runs_on_the_kernels() -> None:
    """QUANTIZED_INPUT's backward on the kernels, against the interpreter: with respect to x; then with
    respect to x and w, `requantize_wgrad=True` (the loop for a scale per column). Passed on an H200,
    2026-11-29."""
    from coda_lang.fuzz.fuzzer import Fuzzer
    from coda_lang.fuzz.search import fuzz_block

    blk = coda_lang.load(QUANTIZED_INPUT)["q1"]
    res = fuzz_block(blk, "cuda", examples=3, fuzzer=Fuzzer(blk, "cuda", fp8_grads="e5m2", wrt=["x"]))
    assert res.failure is None and res.cases == 3 and not res.notes, (res.failure, res.notes)
    opts = coda_lang.BackwardOptions(fp8_grads="e5m2", requantize_wgrad=True)
    res = fuzz_block(blk, "cuda", examples=3, fuzzer=Fuzzer(blk, "cuda", backward=opts, wrt=["x", "w"]))
    assert res.failure is None and res.cases == 3 and not res.notes, (res.failure, res.notes)
    # and the blockwise MLP and QKV, forward and backward
    for name, (src, wrt, _) in sorted(BLOCKWISE.items()):
        b = coda_lang.load(src)[name]
        res = fuzz_block(b, "cuda", examples=3, fuzzer=Fuzzer(b, "cuda", backward=opts, wrt=wrt))
        assert res.failure is None and res.cases == 3 and not res.notes, (name, res.failure, res.notes)


def test_a_scale_read_only_by_a_later_gemm_is_stored_by_its_stage() -> None:
    """The kernels' planner keeps a stage's value that a later stage reads only as its block scale
    (CHAIN's 1x128 amax, read as `scale_a=` by the second GEMM): the grouped reduction is written out."""
    from coda_lang.backend_cute.plan.planner import plan_stage

    spec = plan_stage(coda_lang.load(CHAIN)["chain"], 1)
    assert [(g.name, g.out is not None) for g in spec.groups] == [("amax", True)]


def test_a_scale_stays_live_until_the_gemm_that_reads_it() -> None:
    """The CUDA runtime's liveness (the last read of each value, after which a consuming run drops it
    or stores over its buffer) counts a stage's block scales among its reads: an amax made by the first
    GEMM, read by an elementwise stage, then as the second GEMM's `scale_a=`, lives until that GEMM."""
    from coda_lang.backend_cute.runtime.liveness import Liveness
    from coda_lang.ir.nodes import Stage

    src = """
dims M, D, K, N
block chain(x: bf16[M, D], w1: bf16[D, K], w2: e4m3[N, K], sw: f32[N/128, K/128])
    -> (y: f32[M, N], half: f32[M, K/128]) {
  gemm x @ w1 {
    amax = detach(max(abs(acc), over=K, group=128))
    hq: e4m3 = acc * (448.0 / max(amax, 1e-12))
  }
  elementwise [M, K/128] {
    half = amax * 0.5
  }
  gemm hq @ transpose(w2), scale_a=amax, scale_b=sw {
    y = acc * (1.0 / 448.0)
  }
}
"""
    ir = coda_lang.load(src)["chain"].ir
    second = max(i for i, s in enumerate(ir.body) if isinstance(s, Stage))
    assert Liveness(ir).last_read["amax"] == second


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_grouped_column_load_compiles_and_takes_the_runtimes_arguments(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`y = acc * expand(s, acc)`, s [M, N/128]: the stage compiles without spills at a tile whose N
    divides 128, and quack accepts the runtime's arguments (s passed whole, [M, N/128]) on "meta"
    tensors."""
    import torch

    from coda_lang.backend_cute.build import quack_adapter
    from coda_lang.backend_cute.build.select import select_config

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    blk = coda_lang.load(GROUPED)["epi"]
    c = select_config(blk, 1, directory=tmp_path)
    assert c.config.tile_n in (64, 128) and c.report is not None and not c.report.spills, c.report
    m, k, n = 1000, 64, 384
    meta = lambda shape, dt: torch.empty(shape, dtype=dt, device="meta")  # noqa: E731
    env = {
        "a": meta((m, k), torch.bfloat16),
        "w": meta((k, n), torch.bfloat16),
        "s": meta((m, n // 128), torch.float32),
    }
    r = blk.cuda(tile=c.config).runner(1)
    ins, scalars = r.arguments(env)
    outs = r.allocate(ins[0], ins[1])
    D, C, epi = r.epilogue_arguments(ins, scalars, outs)
    assert tuple(epi["s"].shape) == (m, n // 128)
    quack_adapter.launch(r.mod, r.spec, r.config, ins[0], ins[1], D, epi, C=C, dry_run=True)


@pytest.mark.gpu
def test_a_grouped_column_load_runs_as_the_interpreter_does() -> None:
    """On the kernels, forward and backward (the backward's GEMMs read `expand(s, ...)` too), against
    the interpreter: `coda fuzz --target cuda --wrt a,w`; for groups of one row and of two (`rows`,
    passed repeated over its rows)."""
    from coda_lang.fuzz.fuzzer import Fuzzer
    from coda_lang.fuzz.search import fuzz_block

    for name in ("epi", "rows"):
        blk = coda_lang.load(GROUPED)[name]
        res = fuzz_block(blk, "cuda", examples=4, fuzzer=Fuzzer(blk, "cuda", wrt=["a", "w"]))
        assert res.failure is None and res.cases == 4 and not res.notes, (name, res.failure, res.notes)


def test_a_group_no_tile_divides_is_e0706_naming_the_rule() -> None:
    """`expand(s, acc)` of s [M, N/32]: no tile of the backend's is 32 columns or narrower, so no
    candidate satisfies the stage's rules; the error says that (with the rule), not that tiles spilled,
    and compiles nothing. The emulated stand-in, which holds at any tile, runs it."""
    from coda_lang.backend_cute.build.select import select_config

    blk = coda_lang.load(
        GROUPED.replace(
            "N/128]) -> (y: f32[M, N]) {\n  gemm a @ w", "N/32]) -> (y: f32[M, N]) {\n  gemm a @ w"
        )
    )["epi"]
    with pytest.raises(CodaError) as e:
        select_config(blk, 1)
    (d,) = e.value.diagnostics
    assert d.code == "E0706" and "no candidate tile" in d.message and any("32 % tile_N" in n for n in d.notes)
    assert blk.cuda(emulate=True).runner(1).config.tile_n > 32


def test_a_grouped_column_read_in_a_stage_over_column_pairs_is_e0704() -> None:
    """The column load serves element-mode epilogues only: the same read before `pairs()` is E0704 at
    the `expand`, not a kernel that reads the wrong columns."""
    from coda_lang.backend_cute.plan.planner import plan_stage

    src = """
dims M, K, N
block p(a: bf16[M, K], w: bf16[K, 2*N], s: f32[M, 2*N/128]) -> (y: bf16[M, N]) {
  gemm a @ w {
    g, u = pairs(acc * expand(s, acc))
    y: bf16 = g * u
  }
}
"""
    with pytest.raises(CodaError) as e:
        plan_stage(coda_lang.load(src)["p"], 1)
    (d,) = e.value.diagnostics
    assert d.code == "E0704" and "column pairs" in d.message and d.span is not None and d.span.line == 5


def test_a_run_that_would_split_a_group_is_e0802_on_the_kernels_runtime() -> None:
    """The weights' quantizer (WEIGHTS: an amax over runs of 128 rows) at 200 rows, and a 1 x 128 group
    over 200 columns, on the emulated kernels' runtime: E0802 naming the value and the group, as the
    interpreter says, where the elementwise stage's torch function would fold rows of two groups
    together (NaN in a patched model's gradients before)."""
    import torch

    from coda_lang.backend_triton.elementwise import ElementwiseStage

    blk = coda_lang.load(WEIGHTS)["wq"]
    for n, k, what in ((200, 256, "rows"), (256, 200, "columns")):
        w = torch.randn(n, k).bfloat16()
        with pytest.raises(CodaError) as e:
            blk.cuda(emulate=True)({"w": w})
        (d,) = e.value.diagnostics
        assert d.code == "E0802" and f"groups of 128 {what}" in d.message and "200" in d.message, d.message
    # the stage's own check, beside the interpreter's
    st = ElementwiseStage(blk, 2, emulate=True)
    with pytest.raises(CodaError, match="groups of 128 rows, and this run has 200"):
        st.check_groups(200, 2)
    st.check_groups(256, 2)
