"""The saved-tensor policy of autodiff (`remat`): "save" reads what the forward stores, "recompute" runs
a stage's GEMM again in the backward and computes the stage's backward in its epilogue from the f32
accumulator, "auto" recomputes the stages that store no tile (a loss head).

- lm_head_ce recomputed keeps no [M, V] tensor from the forward (no saved tensor or backward parameter
  of that shape), its backward checks and matches finite differences in float64 under every policy,
  and in exact mode it is as accurate as plain bf16 PyTorch at logits near 40 (the saved bf16 logits
  are not);
- what auto chooses, and what `coda grad --remat` prints.
"""

from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
from support import coda
from test_autodiff import check_vjp

import coda_lang
from coda_lang.ir.types import Dim

ROOT = Path(__file__).resolve().parent.parent
LM = ROOT / "examples" / "lm_head_ce.coda"


def lm_head() -> coda_lang.Block:
    return coda_lang.load(LM)["lm_head_ce"]


def _mv_params(bwd: coda_lang.Block) -> list[str]:
    mv = (Dim.sym("M"), Dim.sym("V"))
    return [p.var.name for p in bwd.ir.params if p.var.type is not None and tuple(p.var.type.shape) == mv]


def test_recomputed_lm_head_keeps_no_m_by_v_tensor() -> None:
    blk = lm_head()
    saved = blk.derivation(remat="save")
    assert _mv_params(saved.backward) == ["acc1"]  # the logits, kept from the forward
    d = blk.derivation(remat="recompute")
    assert _mv_params(d.backward) == [] and d.saved == ("lse",)
    assert [p.var.name for p in d.forward.ir.params] == [p.var.name for p in blk.ir.params]
    assert [o.name for o in d.forward.ir.outputs] == ["loss", "lse"]  # the forward stores nothing more
    gemms = [(s.a.name, s.b.name) for s in d.backward.ir.stages if s.is_gemm]  # type: ignore[union-attr]
    assert gemms[0] == ("hg", "w_lm")  # the forward's GEMM, run again, hosts the softmax backward
    assert any("runs again in the backward" in line for line in d.report)
    assert blk.derivation(remat="auto").backward.ir == d.backward.ir  # a loss head stores no tile


def test_auto_runs_no_gemm_again_where_the_forward_stores_tiles() -> None:
    """llama_mlp's stages store tiles: auto runs no forward GEMM again (the backward has as many GEMMs
    as under save), and recomputes `a` and `hg` in epilogues the backward runs anyway."""
    mlp = coda_lang.load(ROOT / "examples" / "llama_mlp.coda")["llama_mlp"]
    auto, save = mlp.derivation(remat="auto"), mlp.derivation(remat="save")
    assert save.saved == ("a", "acc2", "r", "hg", "h")
    assert auto.saved == ("acc2", "r", "h")
    gemms = [s for s in auto.backward.ir.stages if s.is_gemm]
    assert len(gemms) == len([s for s in save.backward.ir.stages if s.is_gemm])
    fwd_gemms = {(s.a.name, s.b.name) for s in mlp.ir.stages}  # type: ignore[union-attr]
    assert not fwd_gemms & {(s.a.name, s.b.name) for s in gemms}  # type: ignore[union-attr]


@pytest.mark.parametrize("remat", ["save", "recompute", "auto"])
def test_lm_head_gradients_under_every_policy(remat: str) -> None:
    blk = lm_head()
    rng = np.random.default_rng(3)
    m, d, v = 12, 8, 40
    ins = {
        "hg": rng.standard_normal((m, d)),
        "r": rng.uniform(0.5, 1.5, m),
        "w_lm": rng.standard_normal((d, v)),
        "target": np.where(np.arange(m) % 5 == 0, -100, rng.integers(0, v, m)).astype(np.int32),
    }
    check_vjp(blk, ins) if remat == "save" else None
    cts = {"loss": rng.standard_normal(m), "lse": rng.standard_normal(m)}
    got = blk.vjp(ins, cts, precision="f64", remat=remat)
    want = blk.vjp(ins, cts, precision="f64", remat="save")
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-12, atol=1e-14, err_msg=k)
    outs = blk.derivation(remat=remat)
    for b in (outs.forward, outs.backward):
        assert coda_lang.load(str(b))[b.name].ir == b.ir  # printed, it loads back the same


def test_recomputed_lm_head_is_as_accurate_as_torch_bf16_at_large_logits() -> None:
    """PAPER's rule against float64: at most twice plain bf16 PyTorch's error, at max|logit| near 40.
    Reading the bf16-rounded logits with the forward's f32 log-sum-exp (save) misses it."""
    blk = lm_head()
    rng = np.random.default_rng(0)
    m, d, v = 64, 64, 512

    def bf16(a: np.ndarray) -> np.ndarray:
        return a.astype(ml_dtypes.bfloat16).astype(np.float32)

    hg, w = bf16(rng.standard_normal((m, d))), bf16(rng.standard_normal((d, v)) * 1.2)
    target = rng.integers(0, v, m).astype(np.int32)
    target[::7] = -100
    ins = {"hg": hg, "r": np.ones(m, np.float32), "w_lm": w, "target": target}
    assert 35 < np.abs(hg @ w).max() < 45
    cts = {"loss": np.full(m, 1.0 / m, np.float32)}
    ref = blk.vjp(
        {k: x.astype(np.float64) if x.dtype.kind == "f" else x for k, x in ins.items()}, cts, precision="f64"
    )
    th = torch.tensor(hg, dtype=torch.bfloat16, requires_grad=True)
    tw = torch.tensor(w, dtype=torch.bfloat16, requires_grad=True)
    loss = (
        torch.nn.functional.cross_entropy(
            (th @ tw).float(), torch.tensor(target, dtype=torch.long), ignore_index=-100, reduction="sum"
        )
        / m
    )
    loss.backward()
    assert th.grad is not None and tw.grad is not None
    torch_err = {
        "hg": np.abs(th.grad.double().numpy() - ref["hg"]).max(),
        "w_lm": np.abs(tw.grad.double().numpy() - ref["w_lm"]).max(),
    }
    errs = {}
    for remat in ("recompute", "save"):
        got = blk.vjp(ins, cts, precision="exact", remat=remat)
        errs[remat] = {k: np.abs(np.asarray(got[k], np.float64) - ref[k]).max() for k in torch_err}
    for k, e in torch_err.items():
        assert errs["recompute"][k] <= 2 * e + 1e-6, (k, errs, torch_err)
    assert any(errs["save"][k] > 2 * e + 1e-6 for k, e in torch_err.items()), (errs, torch_err)


def test_coda_grad_remat_option(tmp_path: Path) -> None:
    r = coda("grad", LM, "--remat", "recompute")
    assert r.returncode == 0, r.stderr
    assert not re.search(r"\bacc1\b", r.stdout) and "# saved tensors (stored by the forward): lse" in r.stdout
    assert "runs again in the backward" in r.stderr
    assert "acc1: bf16[M, V]" in coda("grad", LM, "--remat", "save").stdout  # save keeps the logits
    assert "acc1: bf16[M, V]" not in coda("grad", LM).stdout  # the default (auto) does not
    r = coda("grad", LM, "--remat", "sometimes")
    assert r.returncode == 2 and "coda: error: remat= is 'sometimes'" in r.stderr and not r.stdout
