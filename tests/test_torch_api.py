"""coda_lang.torch: blocks as differentiable torch functions and modules, on the CPU (the kernels' torch
stand-ins), against torch autograd of the same math in float64."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

import coda_lang  # noqa: E402
from coda_lang.layout import interleave_gate_up  # noqa: E402
from coda_lang.torch import BlockModule, LlamaMLP, function, uses_kernels  # noqa: E402
from tests.support import ROOT  # noqa: E402


def rel(a: Any, b: Any) -> float:
    return float((a.detach().double() - b.detach().double()).abs().max() / b.detach().double().abs().max())


def mlp_reference(y: Any, x: Any, w_o: Any, g: Any, w_13: Any, w_2: Any, eps: float = 1e-6) -> Any:
    h = y @ w_o.T + x
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * g
    z = n @ w_13.T
    return (torch.nn.functional.silu(z[:, 0::2]) * z[:, 1::2]) @ w_2.T + h


def test_cpu_runs_the_stand_ins() -> None:
    assert not uses_kernels("cpu")


def test_function_gradients_match_torch_float64() -> None:
    """A float32 block's outputs and gradients against torch autograd of the same math in float64."""
    mlp = LlamaMLP(32, 48, dtype=torch.float32, eps=1e-6)
    torch.manual_seed(0)
    with torch.no_grad():
        mlp.g.copy_(1 + 0.3 * torch.randn(32))
    y, x = torch.randn(10, 32, requires_grad=True), torch.randn(10, 32, requires_grad=True)
    out = mlp(y, x)
    ct = torch.randn_like(out)
    (out * ct).sum().backward()
    ps = {n: p.detach().double().requires_grad_() for n, p in mlp.named_parameters()}
    y64, x64 = y.detach().double().requires_grad_(), x.detach().double().requires_grad_()
    ref = mlp_reference(y64, x64, **ps)
    (ref * ct.double()).sum().backward()
    assert rel(out, ref) < 1e-5
    assert rel(y.grad, y64.grad) < 1e-5 and rel(x.grad, x64.grad) < 1e-5
    for n, p in mlp.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32
        assert rel(p.grad, ps[n].grad) < 1e-5, n


def test_bf16_module_follows_the_interpreter() -> None:
    """The bf16 module's forward equals the reference interpreter (exact mode) on the same inputs."""
    torch.manual_seed(1)
    mlp = LlamaMLP(32, 48, dtype=torch.bfloat16)
    y, x = torch.randn(8, 32).bfloat16(), torch.randn(8, 32).bfloat16()
    got = mlp(y, x).float()
    ins = {n: p.detach().float().numpy() for n, p in mlp.named_parameters()}
    import ml_dtypes

    ins = {k: v.astype(ml_dtypes.bfloat16) if k != "g" else v for k, v in ins.items()}
    ins["y"], ins["x"] = (t.float().numpy().astype(ml_dtypes.bfloat16) for t in (y, x))
    want = mlp.fn.block.run(ins)["x2"].astype("float32")
    assert float((got.detach() - torch.from_numpy(want)).abs().max()) <= 2**-6 * float(abs(want).max())


def test_function_from_a_file_and_block_module() -> None:
    prog = coda_lang.load(ROOT / "examples" / "llama_mlp.coda")
    with pytest.raises(ValueError, match="remat"):
        function(prog["llama_mlp"], remat="sometimes")
    f = function(str(ROOT / "examples" / "llama_mlp.coda"))
    assert f.name == "llama_mlp"
    torch.manual_seed(2)
    D, F = 16, 24
    w1, w3 = torch.randn(D, F) * 0.1, torch.randn(D, F) * 0.1
    params = {
        "w_o": (torch.randn(D, D) * 0.1).bfloat16(),
        "g": torch.ones(D),
        "w_13": interleave_gate_up(w1, w3).bfloat16(),
        "w_2": (torch.randn(F, D) * 0.1).bfloat16(),
    }
    mod = BlockModule(prog["llama_mlp"], params)
    assert sorted(n for n, _ in mod.named_parameters()) == sorted(params)
    y, x = torch.randn(4, D).bfloat16(), torch.randn(4, D).bfloat16()
    out = mod(y=y, x=x)
    assert out.shape == (4, D) and out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert all(p.grad is not None for p in mod.parameters())
    assert torch.equal(out, f(y=y, x=x, **params)["x2"])
    with pytest.raises(ValueError, match="no input `w_9`"):
        BlockModule(prog["llama_mlp"], {"w_9": torch.zeros(2)})
    with pytest.raises(TypeError, match="by name"):
        mod(y, x)


def test_functions_compiled_together_share_one_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """`compile_together(f, g)`: the first GPU call of either compiles the kernels of both (forward,
    backward, chunked backwards) in one parallel compile; the other's first call then has nothing left
    to compile. `precompile(f, g)` does it at once, strictly. The CPU path is unchanged."""
    from coda_lang.backend_cute.build import parallel
    from coda_lang.backend_cute.runtime import tiles
    from coda_lang.torch import compile_together, precompile

    monkeypatch.delenv("CODA_TUNE", raising=False)
    mlp = coda_lang.load(ROOT / "examples" / "llama_mlp.coda")["llama_mlp"]
    head = coda_lang.load(ROOT / "examples" / "lm_head_ce.coda")["lm_head_ce"]
    f, g = function(mlp), function(head, chunk="auto")
    compile_together(f, g)
    assert f._together is g._together and f._together == [f, g]
    with pytest.raises(TypeError, match="coda functions"):
        compile_together(f, "lm_head_ce")  # type: ignore[arg-type]
    seen: list[list[str]] = []
    monkeypatch.setattr(
        parallel,
        "warm",
        lambda requests, **kw: seen.append(sorted({r.spec.block for r in requests})) or parallel.Warmed(),
    )
    monkeypatch.setattr(tiles, "find_ptxas", lambda: True)
    fn = f._fn(False)  # (made, not run: what a first call on the GPU does before its launch)
    tiles.precompile([fn.forward, *fn.forward._compile_with])
    assert seen == [["llama_mlp", "llama_mlp_bwd", "lm_head_ce", "lm_head_ce_bwd"]]
    gn = g._fn(False)
    assert tiles.precompile([gn.forward, *gn.forward._compile_with]) is None and len(seen) == 1
    assert {id(b) for b in g.kernel_blocks()} <= {id(b) for b in fn.forward._compile_with}
    # precompile: the same blocks, now (a fresh pair of functions)
    f2, g2 = function(mlp), function(head)
    precompile(f2, g2, quiet=True)
    assert seen[-1] == ["llama_mlp", "llama_mlp_bwd", "lm_head_ce", "lm_head_ce_bwd"]
    # without the toolchain, precompile says so (a first call would run, uncompiled, on the CPU)
    from coda_lang.backend_cute.build.ptxas import BackendUnavailable

    monkeypatch.setattr(tiles, "find_ptxas", lambda: False)
    with pytest.raises(BackendUnavailable, match="ptxas"):
        precompile(function(mlp), quiet=True)
    # linking changes nothing on the CPU: the emulated path runs as before
    x = _mlp_inputs()
    out = f(x)["x2"]
    assert out.shape == x["x"].shape and torch.isfinite(out).all()


def _mlp_inputs() -> dict[str, Any]:
    torch.manual_seed(0)
    M, D, F = 16, 32, 48
    return {
        "y": torch.randn(M, D, dtype=torch.bfloat16),
        "x": torch.randn(M, D, dtype=torch.bfloat16),
        "w_o": (torch.randn(D, D) / D**0.5).to(torch.bfloat16),
        "g": torch.ones(D),
        "w_13": (torch.randn(D, 2 * F) / D**0.5).to(torch.bfloat16),
        "w_2": (torch.randn(F, D) / F**0.5).to(torch.bfloat16),
    }


def test_the_llama_mlp_has_one_source() -> None:
    """examples/llama_mlp.coda (read in the README), `LlamaMLP`'s block and coda_lang.hf's layer blocks
    are one program: the example's block is `llama_mlp_source` in bf16 with [in, out] weights and y as
    wide as the hidden size, LlamaMLP's is its nn.Linear-layout form, and hf's blocks hold its stages."""
    from coda_lang.hf.blocks import model_source
    from coda_lang.torch import llama_mlp_source, llama_mlp_stages

    example = coda_lang.load(ROOT / "examples" / "llama_mlp.coda")["llama_mlp"]
    made = coda_lang.load(llama_mlp_source("bf16", 1e-6, linear=False, attn="D"))["llama_mlp"]
    assert str(example) == str(made)
    mlp = LlamaMLP(32, 48, 40, dtype=torch.float16, eps=1e-5)
    assert str(mlp.fn.block) == str(coda_lang.load(llama_mlp_source("f16", 1e-5))["llama_mlp"])
    assert [p.var.name for p in mlp.fn.block.ir.params] == ["y", "x", "w_o", "g", "w_13", "w_2", "eps"]
    for qk_norm in (False, True):
        assert llama_mlp_stages("bf16", h="x1", n="1", stored=True).split("x2: bf16")[0] in model_source(
            "bfloat16", 1e-5, 16, qk_norm
        )


# ---------------------------------------------------------------------------- nothing dropped or sliced

_LIN = """dims M, K, N

block lin(x: f32[M, K], w: f32[K, N], r: f32[M], eps: f32 = 1.0) -> (y: f32[M, N]) {
  gemm x @ w {
    y = acc * r * eps
  }
}
"""


def _code(e: Any) -> str:
    return str(e.value.diagnostics[0].code)


def test_a_misspelled_input_is_an_error_not_dropped() -> None:
    """`esp=` for `eps=` is E0801 through `function`, `BlockModule` and `forward_backward`, as
    `Block.cuda(emulate=True)` gives it; never the default used in silence."""
    x, w, r = torch.randn(4, 8), torch.randn(8, 16), torch.rand(4)
    f = function(_LIN, chunk_dim="M")
    ref = f(x=x, w=w, r=r, eps=0.5)["y"]
    calls = [
        lambda: f(x=x, w=w, r=r, esp=0.5),
        lambda: f({"x": x, "w": w, "r": r, "esp": 0.5}),
        lambda: BlockModule(_LIN, {"w": w})(x=x, r=r, esp=0.5),
        lambda: f.forward_backward(x=x, w=w, r=r, esp=0.5, cotangents={"y": ref}, chunk=2),
        lambda: f.block.cuda(emulate=True)(x=x, w=w, r=r, esp=0.5),
    ]
    for call in calls:
        with pytest.raises(coda_lang.CodaError, match="unknown input `esp`") as e:
            call()
        assert _code(e) == "E0801"


def test_forward_backward_refuses_inputs_of_other_lengths() -> None:
    """A row-indexed input (or a cotangent) longer or shorter than the others is refused before any
    chunk runs, as a plain call refuses it (E0804; a cotangent not of its output's shape E0802), never
    sliced to the first input's rows."""
    torch.manual_seed(3)
    x, w, r = torch.randn(6, 8), torch.randn(8, 16), torch.rand(6)
    f = function(_LIN, chunk_dim="M")
    ct_y = torch.randn(6, 16)
    outs, grads = f.forward_backward(x=x, w=w, r=r, cotangents={"y": ct_y}, chunk=4)
    assert outs["y"].shape == (6, 16) and grads["x"].shape == (6, 8)
    for bad in (torch.rand(9), torch.rand(3)):
        with pytest.raises(coda_lang.CodaError) as e:
            f(x=x, w=w, r=bad)
        assert _code(e) == "E0804"
        with pytest.raises(coda_lang.CodaError, match="input `r` gives M") as e:
            f.forward_backward(x=x, w=w, r=bad, cotangents={"y": ct_y}, chunk=4)
        assert _code(e) == "E0804"
    for bad in (torch.randn(9, 16), torch.randn(3, 16), torch.randn(6, 17)):
        with pytest.raises(coda_lang.CodaError, match="cotangent of output `y`") as e:
            f.forward_backward(x=x, w=w, r=r, cotangents={"y": bad}, chunk=4)
        assert _code(e) == "E0802"


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_create_graph_is_refused_not_first_order() -> None:
    """A gradient penalty needs the gradient's own gradient, which the kernels' backward has not:
    `create_graph=True` is a RuntimeError naming coda and the option (it used to give a gradient that
    was a constant, so penalty + L2 came out as the L2 term alone); first-order runs are unchanged."""
    m = BlockModule(_LIN, {"w": torch.randn(8, 16)})
    x, r = torch.randn(4, 8, requires_grad=True), torch.rand(4)
    with pytest.raises(RuntimeError, match=r"coda: block lin .*create_graph=True"):
        torch.autograd.grad(m(x=x, r=r).sum(), m.w, create_graph=True)
    with pytest.raises(RuntimeError, match=r"coda: block lin .*create_graph=True"):
        m(x=x, r=r).sum().backward(create_graph=True)
    (g,) = torch.autograd.grad(m(x=x, r=r).sum(), m.w)
    assert torch.allclose(g, x.detach().T @ r[:, None].expand(4, 16), rtol=1e-5)
