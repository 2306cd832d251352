"""Two parameters whose gradients are one value: `v = r + p` gives r and p v's cotangent.

The derived backward named that value for the first parameter's gradient and lost the second's:
`coda grad` printed a block whose output `dr1` was never computed, and `Block.vjp` raised KeyError
(found by `coda fuzz --programs 2000 --target interp --seed 43`, 2026-11-28). Each gradient is now
there, the second a copy of the first, for vectors between stages and for tiles in a stage, and
equal to torch autograd's of the same function.
"""

from __future__ import annotations

import numpy as np
import pytest

import coda_lang

VEC = """
dims M, N
block fwd(r1: f32[M], p5: f32[M], x: f32[M, N], w: f32[N, N]) -> (y: f32[M, N], v26: f32[M]) {
  gemm x @ w {
    y = acc
  }
  v10 = r1 + p5
  v26 = abs(v10)
}
"""

TILE = """
dims M, N
block fwd(a: f32[M, N], c: f32[M, N], x: f32[M, N], w: f32[N, N]) -> (y: f32[M, N]) {
  gemm x @ w {
    y = sigmoid(acc + a + c)
  }
}
"""


def _grads(src: str, remat: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], coda_lang.Block]:
    block = coda_lang.load(src)["fwd"]
    rng = np.random.default_rng(4)
    ins = {
        p.var.name: rng.standard_normal([5 if d.name == "M" else 3 for d in p.var.type.shape]).astype(
            np.float32
        )
        for p in block.ir.params
    }
    outs = block.run(ins)
    cots = {k: rng.standard_normal(np.shape(v)).astype(np.float32) for k, v in outs.items()}
    return ins, cots, block


@pytest.mark.parametrize("remat", ["save", "auto", "recompute"])
def test_two_vectors_with_one_cotangent(remat: str) -> None:
    import torch

    ins, cots, block = _grads(VEC, remat)
    d = block.derivation(remat=remat)
    outs = {o.name for o in d.backward.ir.outputs}
    assert {"dr1", "dp5"} <= outs
    got = block.vjp(ins, cots, remat=remat)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in ins.items()}
    y = t["x"] @ t["w"]
    v26 = (t["r1"] + t["p5"]).abs()
    torch.autograd.backward(
        [y, v26],
        [torch.tensor(cots["y"], dtype=torch.float64), torch.tensor(cots["v26"], dtype=torch.float64)],
    )
    for k in ins:
        assert t[k].grad is not None
        np.testing.assert_allclose(got[k], t[k].grad.numpy(), rtol=1e-5, atol=1e-5, err_msg=k)
    assert np.array_equal(got["r1"], got["p5"])


@pytest.mark.parametrize("remat", ["save", "auto"])
def test_two_tiles_with_one_cotangent(remat: str) -> None:
    import torch

    ins, cots, block = _grads(TILE, remat)
    got = block.vjp(ins, cots, remat=remat)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in ins.items()}
    y = torch.sigmoid(t["x"] @ t["w"] + t["a"] + t["c"])
    y.backward(torch.tensor(cots["y"], dtype=torch.float64))
    for k in ins:
        assert t[k].grad is not None
        np.testing.assert_allclose(got[k], t[k].grad.numpy(), rtol=1e-5, atol=1e-5, err_msg=k)
    assert np.array_equal(got["a"], got["c"])


def test_coda_grad_prints_every_gradient(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    """The printed backward assigns every output it declares (it checks as a program of its own)."""
    from pathlib import Path

    from coda_lang.cli import main

    src = Path(str(tmp_path)) / "vec.coda"
    src.write_text(VEC)
    assert main(["grad", str(src), "--remat", "save"]) == 0
    out = capsys.readouterr().out
    assert "dr1 = " in out and "dp5 = " in out
    back = Path(str(tmp_path)) / "bwd.coda"
    back.write_text(out)
    assert main(["check", str(back)]) == 0, capsys.readouterr()
