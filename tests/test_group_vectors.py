"""Vectors that repeat across columns (docs/language.md, "Vectors that repeat"): a vector over a dim of
fixed size G on a tile of width W reads g[c mod G] at column c; its gradient is `fold(x, into=G)` of the
cotangent's column sums.

- The checker: what it accepts (a tile of any of the stage's widths, `expand`), what it refuses, with
  which code (E0404 a dim without a fixed size, E0410 sizes that don't fit, E0402 no tile, E0507 a fold
  inside a stage), and that vectors over the rows or the stage's own column dim keep their meaning.
- The interpreter against NumPy with an explicit `np.tile`, whole and in ragged tiles, after pairs and
  in interleave, between stages (`expand`, `fold`); E0802 when the bound sizes don't fit.
- Autodiff: float64 finite differences (the backward at the block's entry, hosted by a dgrad GEMM, a
  row reduction of a product, the example qk_norm, fold between stages); the printed backward reloads;
  the gradient equals the hand-folded one.
- The CUDA runtime's emulated path (forward, autograd, an elementwise backward stage, a paired stage)
  against the interpreter; the planner's operand (passed repeated, its header line, two widths refused
  with E0704); a chunked run along the repeated columns is refused (E0809).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_autodiff import check_vjp

import coda_lang
from coda_lang.core.diagnostics import CodaError

ROOT = Path(__file__).resolve().parent.parent


def codes(text: str) -> list[str]:
    try:
        coda_lang.load(text)
    except CodaError as e:
        return [d.code for d in e.diagnostics]
    return []


def program(body: str, sig: str = "", dims: str = "M, D, P, HD = 4", outs: str = "y: f32[M, 2*P]") -> str:
    params = "x: f32[M, D], w: f32[D, 2*P], g: f32[HD]" + (f", {sig}" if sig else "")
    return f"dims {dims}\n\nblock b({params}) -> ({outs}) {{\n{body}\n}}\n"


def gemm(*lines: str) -> str:
    return "  gemm x @ w {\n" + "".join(f"    {ln}\n" for ln in lines) + "  }"


def rnd(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------------------- the checker


@pytest.mark.parametrize(
    "body",
    [
        gemm("y = acc * g"),
        gemm("y = g + acc"),
        gemm("y = expand(g, acc)"),
        gemm("y = where(acc > g, acc, g)"),
        gemm("h = g * g + 1.0", "y = acc * h"),  # a vector over HD computed in the stage
        gemm("a, c = pairs(acc)", "y = interleave(a * g, c)"),  # a half-width tile
    ],
)
def test_a_vector_over_a_fixed_dim_repeats_on_a_tile(body: str) -> None:
    assert codes(program(body)) == []


@pytest.mark.parametrize(
    "text, code",
    [
        # a dim without a fixed size: as any vector over a dim the tile doesn't have
        (program(gemm("y = acc * g"), dims="M, D, P, HD"), "E0404"),
        # both sizes known and 6 is no multiple of 4
        (program(gemm("y = acc * g"), dims="M, D, P = 3, HD = 4"), "E0410"),
        # a half-width tile of 4 columns and a vector of 8
        (program(gemm("a, c = pairs(acc)", "y = interleave(a * g, c)"), dims="M, D, P = 4, HD = 8"), "E0410"),
        # a row vector and a repeating vector: no columns to repeat across
        (program(gemm("t = r * g", "y = acc * t"), sig="r: f32[M]"), "E0402"),
        # a column vector and a repeating vector (expand(g, c) is the way)
        (program(gemm("t = c * g", "y = acc * t"), sig="c: f32[2*P]"), "E0402"),
        # between stages only expand() repeats
        (
            program(gemm("y = acc") + "\n  v = g * c", sig="c: f32[2*P]", outs="y: f32[M, 2*P], v: f32[2*P]"),
            "E0402",
        ),
        # fold inside a stage
        (
            program(
                gemm("y = acc * c", "s = fold(c, into=HD)"),
                sig="c: f32[2*P]",
                outs="y: f32[M, 2*P], s: f32[HD]",
            ),
            "E0507",
        ),
        # fold into a dim without a fixed size, or one that does not divide
        (
            program(
                gemm("y = acc") + "\n  s = fold(c, into=P)",
                sig="c: f32[2*P]",
                outs="y: f32[M, 2*P], s: f32[P]",
            ),
            "E0410",
        ),
        (
            program(
                gemm("y = acc") + "\n  s = fold(c, into=HD)",
                sig="c: f32[6]",
                outs="y: f32[M, 2*P], s: f32[HD]",
            ),
            "E0410",
        ),
        # a grouped value has one column per group: nothing to repeat across
        (program(gemm("s = sum(acc, over=2*P, group=HD)", "t = s * g", "y = acc * t")), "E0404"),
    ],
    ids=[
        "unfixed-dim",
        "width-not-multiple",
        "half-width-not-multiple",
        "row-vector",
        "column-vector",
        "between-stages",
        "fold-in-stage",
        "fold-unfixed",
        "fold-not-multiple",
        "grouped-value",
    ],
)
def test_bad_uses_get_their_codes(text: str, code: str) -> None:
    got = codes(text)
    assert got and got[0] == code, got


def test_vectors_over_the_rows_and_the_column_dim_keep_their_meaning() -> None:
    """A vector over the rows is a row vector and one over the stage's column dim a column vector of
    that width, even when that dim has a fixed size: only another dim's vector repeats."""
    ok = program(gemm("y = acc * r + c"), sig="r: f32[M], c: f32[2*P]", dims="M, D, P = 4, HD = 4")
    assert codes(ok) == []
    # a vector over P (half the columns, fixed or not) on the full-width tile is no repeating vector
    for dims in ("M, D, P, HD = 4", "M, D, P = 4, HD = 4"):
        assert codes(program(gemm("y = acc * h"), sig="h: f32[P]", dims=dims))[:1] == ["E0404"]
    b = coda_lang.load(ok)["b"]
    rng = np.random.default_rng(0)
    x, w, g, r, c = rnd(rng, 5, 3), rnd(rng, 3, 8), rnd(rng, 4), rnd(rng, 5), rnd(rng, 8)
    out = b.run(dict(x=x, w=w, g=g, r=r, c=c))["y"]
    np.testing.assert_allclose(out, (x @ w) * r[:, None] + c[None, :], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- the interpreter


def test_the_interpreter_repeats_the_vector_per_head() -> None:
    text = program(
        gemm("y = acc * g + r", "s = sum(acc * g, over=2*P)"),
        sig="r: f32[M]",
        outs="y: f32[M, 2*P], s: f32[M]",
    )
    b = coda_lang.load(text)["b"]
    rng = np.random.default_rng(1)
    x, w, g, r = rnd(rng, 7, 5), rnd(rng, 5, 12), rnd(rng, 4), rnd(rng, 7)
    acc = x.astype(np.float64) @ w
    want = acc * np.tile(g, 3) + r[:, None]
    for tile in (None, (3, 5), (4, 2), (2, 12)):  # ragged tiles that cut the heads anywhere
        out = b.run(dict(x=x, w=w, g=g, r=r), sim_tile=tile)
        np.testing.assert_allclose(out["y"], want, rtol=1e-5, atol=1e-5, err_msg=str(tile))
        np.testing.assert_allclose(out["s"], (acc * np.tile(g, 3)).sum(1), rtol=1e-4, atol=1e-4)


def test_columns_are_counted_in_the_tile_the_vector_meets() -> None:
    """After pairs, a half-width tile's own columns: column k of the even columns reads g[k mod G]."""
    text = program(gemm("a, c = pairs(acc)", "y = interleave(a * g, c - g)"), dims="M, D, P, HD = 3")
    b = coda_lang.load(text)["b"]
    rng = np.random.default_rng(2)
    x, w, g = rnd(rng, 5, 4), rnd(rng, 4, 12), rnd(rng, 3)
    acc = x.astype(np.float64) @ w
    want = np.empty_like(acc)
    want[:, 0::2] = acc[:, 0::2] * np.tile(g, 2)
    want[:, 1::2] = acc[:, 1::2] - np.tile(g, 2)
    for tile in (None, (2, 4), (3, 10)):
        np.testing.assert_allclose(b.run(dict(x=x, w=w, g=g), sim_tile=tile)["y"], want, rtol=1e-5, atol=1e-5)


def test_expand_and_fold_between_stages() -> None:
    text = program(
        gemm("s = sum(acc, over=M)", "y = acc") + "\n  e = expand(g, s)\n  f = fold(s, into=HD)",
        outs="y: f32[M, 2*P], e: f32[2*P], f: f32[HD]",
    )
    b = coda_lang.load(text)["b"]
    rng = np.random.default_rng(3)
    x, w, g = rnd(rng, 6, 3), rnd(rng, 3, 16), rnd(rng, 4)
    out = b.run(dict(x=x, w=w, g=g))
    s = (x.astype(np.float64) @ w).sum(0)
    np.testing.assert_allclose(out["e"], np.tile(g, 4))
    np.testing.assert_allclose(out["f"], s.reshape(4, 4).sum(0), rtol=1e-5, atol=1e-5)


def test_sizes_that_cut_the_last_copy_fail_when_bound() -> None:
    b = coda_lang.load(program(gemm("y = acc * g")))["b"]
    rng = np.random.default_rng(4)
    with pytest.raises(CodaError) as e:
        b.run(dict(x=rnd(rng, 3, 2), w=rnd(rng, 2, 10), g=rnd(rng, 4)))  # 2*P = 10, HD = 4
    (d,) = e.value.diagnostics
    assert d.code == "E0802" and "`g`" in d.message and "not a multiple of 4" in d.message


# ---------------------------------------------------------------------------- autodiff

FD_CASES = {
    # the backward at the block's entry (an elementwise stage)
    "entry": program(gemm("y = acc * g + g")),
    # a row reduction of a product with g: its cotangent is a row vector, made a tile first
    "row-sum": program(gemm("y = acc * g", "s = sum(acc * g, over=2*P)"), outs="y: f32[M, 2*P], s: f32[M]"),
    # hosted by the dgrad GEMM of the stage that consumes the tile
    "hosted": program(
        gemm("h = tanh(acc) * g") + "\n  gemm h @ v {\n    o = acc\n  }",
        sig="v: f32[2*P, D]",
        outs="o: f32[M, D]",
    ),
    # a half-width tile after pairs, and a vector computed from g in the stage
    "pairs": program(
        gemm("a, c = pairs(acc)", "k = exp(g)", "y = interleave(a * k, c * g)"), dims="M, D, P, HD = 3"
    ),
    # folded between stages, and repeated there
    "between": program(
        gemm("s = sum(acc * acc, over=M)", "y = acc")
        + "\n  f = fold(s, into=HD) * g\n  e = expand(f, s) * s",
        outs="y: f32[M, 2*P], e: f32[2*P]",
    ),
}


@pytest.mark.parametrize("name", sorted(FD_CASES))
def test_gradients_match_finite_differences(name: str) -> None:
    b = coda_lang.load(FD_CASES[name])["b"]
    rng = np.random.default_rng(5)
    p = 3 if "HD = 3" in FD_CASES[name] else 4
    inputs = {
        k: rng.standard_normal(s)
        for k, s in (("x", (5, 3)), ("w", (3, 4 * p)), ("g", (p,)), ("v", (4 * p, 3)))
    }
    inputs = {k: v for k, v in inputs.items() if k in {q.var.name for q in b.ir.params}}
    check_vjp(b, inputs, seed=1)
    # the printed backward is a program: it loads back to the same block
    bwd = b.grad()
    assert coda_lang.load(str(bwd))[bwd.name].ir == bwd.ir


def test_the_gradient_is_the_hand_folded_one() -> None:
    """d g of `acc * g` is the column sums of dy * acc folded per head: the same as the gradient of
    the [2*P] weight np.tile(g, H) summed over its H copies."""
    full = program(gemm("y = acc * gf"), sig="gf: f32[2*P]")
    short = program(gemm("y = acc * g"))
    rng = np.random.default_rng(6)
    x, w, g, dy = rnd(rng, 6, 3), rnd(rng, 3, 12), rnd(rng, 4), rnd(rng, 6, 12)
    got = coda_lang.load(short)["b"].vjp(dict(x=x, w=w, g=g), {"y": dy}, precision="f64")
    ref = coda_lang.load(full)["b"].vjp(dict(x=x, w=w, g=g, gf=np.tile(g, 3)), {"y": dy}, precision="f64")
    np.testing.assert_allclose(got["g"], ref["gf"].reshape(3, 4).sum(0), rtol=1e-12)
    np.testing.assert_allclose(got["x"], ref["x"], rtol=1e-12)
    text = str(coda_lang.load(short)["b"].grad())
    assert "dg = fold(" in text and ", into=HD)" in text


def test_qk_norm_gradient_and_printed_backward() -> None:
    b = coda_lang.load(ROOT / "examples" / "qk_norm.coda")["qk_norm"]
    assert b.ir.params[2].var.type is not None and str(b.ir.params[2].var.type.shape[0]) == "HD"
    rng = np.random.default_rng(7)
    m, d, p = 5, 6, 128  # 2*P = 256: two heads of 128
    inputs = {
        "x": rng.standard_normal((m, d)),
        "w_q": rng.standard_normal((d, 2 * p)) / np.sqrt(d),
        "g": 1.0 + 0.2 * rng.standard_normal(128),
        "pos": rng.standard_normal(m),
        "freq": rng.standard_normal(p),
    }
    check_vjp(b, inputs, seed=2)
    bwd = b.grad()
    assert coda_lang.load(str(bwd))[bwd.name].ir == bwd.ir
    assert "dg = fold(" in str(bwd)


# ---------------------------------------------------------------------------- the CUDA runtime (emulated)

torch = pytest.importorskip("torch")


def _t(a: np.ndarray) -> object:
    return torch.from_numpy(np.ascontiguousarray(a))


def _bf16(text: str) -> coda_lang.Block:
    return coda_lang.load(text.replace("f32[M, D], w: f32[D", "bf16[M, D], w: bf16[D"))["b"]


@pytest.mark.parametrize(
    "body, hd",
    [
        (gemm("y = acc * g + g", "s = sum(acc * g, over=2*P)"), 4),  # element mode
        (gemm("a, c = pairs(acc)", "y = interleave(a * g, c * g)", "s = sum(y, over=2*P)"), 8),  # half width
        (
            gemm("a, c = pairs(acc * g)", "y = interleave(a, c)", "s = sum(y - g, over=2*P)"),
            16,
        ),  # paired, full
    ],
    ids=["element", "paired-half", "paired-full"],
)
def test_emulated_runtime_equals_the_interpreter(body: str, hd: int) -> None:
    b = _bf16(program(body, dims=f"M, D, P, HD = {hd}", outs="y: f32[M, 2*P], s: f32[M]"))
    gen = torch.Generator().manual_seed(8)
    inputs = {
        "x": torch.randn(40, 32, generator=gen).bfloat16(),
        "w": torch.randn(32, 64, generator=gen).bfloat16(),
        "g": torch.randn(hd, generator=gen),
    }
    got = b.cuda(emulate=True)(**inputs)
    want = b.run(inputs)
    for k in want:
        np.testing.assert_allclose(got[k].float().numpy(), want[k], rtol=1e-5, atol=1e-4, err_msg=k)


def test_one_width_per_stage_in_a_kernel() -> None:
    """The runtime passes a vector repeated to one width: a stage where vectors over HD meet the full
    and the half width is refused by the backend (E0704), not miscomputed; the interpreter runs it."""
    b = _bf16(
        program(
            gemm("a, c = pairs(acc * g)", "y = interleave(a, c)", "s = sum(a * g, over=P)"),
            dims="M, D, P, HD = 16",
            outs="y: f32[M, 2*P], s: f32[M]",
        )
    )
    with pytest.raises(CodaError) as e:
        b.cuda(emulate=True)
    d = e.value.diagnostics[0]
    assert d.code == "E0704" and "repeats across `P` columns here and across `2*P`" in d.message, d.message
    assert b.run({"x": np.ones((4, 3)), "w": np.ones((3, 32)), "g": np.ones(16)})["s"].shape == (4,)


def test_emulated_autograd_equals_the_interpreter_vjp() -> None:
    b = _bf16(
        program(gemm("y = tanh(acc) * g", "s = sum(acc * g, over=2*P)"), outs="y: f32[M, 2*P], s: f32[M]")
    )
    gen = torch.Generator().manual_seed(9)
    x, w = torch.randn(48, 16, generator=gen).bfloat16(), torch.randn(16, 24, generator=gen).bfloat16()
    g = torch.randn(4, generator=gen)
    dy, ds = torch.randn(48, 24, generator=gen), torch.randn(48, generator=gen)
    leaves = {
        "x": x.clone().requires_grad_(True),
        "w": w.clone().requires_grad_(True),
        "g": g.clone().requires_grad_(True),
    }
    out = b.cuda(emulate=True).autograd()(**leaves)
    fwd = b.run({"x": x, "w": w, "g": g})
    for k in fwd:
        np.testing.assert_allclose(out[k].detach().float().numpy(), fwd[k], rtol=1e-5, atol=1e-4, err_msg=k)
    torch.autograd.backward([out["y"], out["s"]], [dy.to(out["y"].dtype), ds])
    want = b.vjp({"x": x, "w": w, "g": g}, {"y": dy.numpy(), "s": ds.numpy()})
    for k, leaf in leaves.items():
        assert leaf.grad is not None and leaf.grad.shape == leaf.shape
        got = leaf.grad.float().numpy()
        np.testing.assert_allclose(
            got, want[k], rtol=2e-2, atol=2e-2 * float(np.abs(want[k]).max()), err_msg=k
        )


def test_the_runtime_refuses_sizes_that_cut_the_last_copy() -> None:
    b = _bf16(program(gemm("y = acc * g")))
    with pytest.raises(CodaError) as e:
        b.cuda(emulate=True)(
            x=torch.randn(8, 16).bfloat16(), w=torch.randn(16, 10).bfloat16(), g=torch.randn(4)
        )
    assert e.value.diagnostics[0].code == "E0802" and "not a multiple of 4" in e.value.diagnostics[0].message


def test_the_planner_passes_the_vector_repeated() -> None:
    from coda_lang.backend_cute.plan.emit import emit_stage
    from coda_lang.backend_cute.plan.planner import plan_stage

    b = coda_lang.load(ROOT / "examples" / "qk_norm.coda")["qk_norm"]
    spec = plan_stage(b, 1)
    (g,) = [o for o in spec.operands if o.name == "g"]
    assert (str(g.period), [str(d) for d in g.shape], g.op, g.lanes) == ("HD", ["2*P"], "RowVecLoad", 2)
    src = emit_stage(spec)
    assert "load   g: f32[HD] column vector (RowVecLoad, passed repeated to `2*P` columns)" in src
    assert '"g": RowVecLoad("g")' in src


def test_a_chunked_run_along_the_repeated_columns_is_refused() -> None:
    from coda_lang.autodiff.chunk import chunk_plan

    text = "dims M, D, V, HD = 4\n\nblock b(x: f32[M, D], w: f32[D, V], g: f32[HD]) -> (y: f32[M, V]) {\n" + (
        "  gemm x @ w {\n    y = acc * g\n  }\n}\n"
    )
    b = coda_lang.load(text)["b"]
    with pytest.raises(CodaError) as e:
        chunk_plan(b, "V")
    assert e.value.diagnostics[0].code == "E0809" and "repeats across" in e.value.diagnostics[0].message
    chunk_plan(b, "M")  # rows: the columns are whole in every chunk
    bwd = b.grad()
    plan = chunk_plan(bwd, "M")  # the fold of the row sums adds up over the chunks
    assert "dg" in plan.summed


def test_the_qwen3_program_takes_one_head_s_norm_weights() -> None:
    """The generated Qwen3 program takes q_norm's and k_norm's weights as they are (one head's, HD
    values, interleaved like a RoPE head) with constant q/k column masks; its backward folds their
    gradients into HD and checks as printed source."""
    from coda_lang.hf.blocks import model_source

    prog = coda_lang.load(model_source("bfloat16", 1e-6, 8, True))
    for name in ("first_qkv", "layer"):
        b = prog[name]
        types = {p.var.name: str(p.var.type) for p in b.ir.params}
        assert types["gq"] == types["gk"] == "f32[HD] vec" and types["mq"] == types["mk"] == "f32[2*P] vec"
        assert "gqk" not in types and "nrm" not in types
        bwd = b.grad(wrt=["gq", "gk", "w_qkv"])
        text = str(bwd)
        assert "dgq = fold(" in text and "dgk = fold(" in text
        assert coda_lang.load(text)[bwd.name].ir == bwd.ir


@pytest.mark.slow  # (the default run compiles a qk norm with its prepass: test_backend_ptx.py)
@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # quack's imports of CuTeDSL names
def test_the_qwen3_qkv_stage_compiles(tmp_path: Path) -> None:
    """The Qwen3 QKV stage (per-head q/k norm with the weights repeated across the heads, RoPE) compiles
    to PTX without spills: the repeated weights are ordinary column vector loads (RowVecLoad)."""
    from coda_lang.backend_cute.build.select import select_config
    from coda_lang.hf.blocks import model_source

    b = coda_lang.load(model_source("bfloat16", 1e-6, 128, True))["first_qkv"]
    c = select_config(b, 2, directory=tmp_path)
    assert ".target sm_90a" in c.ptx and c.report is not None and not c.report.spills, c.report
    for name in ("gq", "gk"):
        assert (
            f"load   {name}: f32[HD] column vector (RowVecLoad, passed repeated to `2*P` columns)" in c.source
        )
        assert f'"{name}": RowVecLoad("{name}")' in c.source


def test_a_fold_of_a_vector_that_is_not_whole_runs_fails_when_bound() -> None:
    text = program(
        gemm("s = sum(acc, over=M)", "y = acc") + "\n  f = fold(s, into=HD)",
        outs="y: f32[M, 2*P], f: f32[HD]",
    )
    b = coda_lang.load(text)["b"]
    rng = np.random.default_rng(10)
    with pytest.raises(CodaError) as e:
        b.run(dict(x=rnd(rng, 3, 2), w=rnd(rng, 2, 10), g=rnd(rng, 4)))  # 2*P = 10
    (d,) = e.value.diagnostics
    assert d.code == "E0802" and "fold(s, into=HD)" in d.message and "= 10 values" in d.message
    with pytest.raises(CodaError) as e:
        b.cuda(emulate=True)(x=torch.randn(3, 2), w=torch.randn(2, 10), g=torch.randn(4))
    assert e.value.diagnostics[0].code == "E0802"
