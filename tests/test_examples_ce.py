"""The cross-entropy variants of the LM head (examples/lm_head_ce_{smooth,zloss,softcap}.coda).

- The forward on the interpreter in f64 mode against torch float64: `F.cross_entropy(...,
  label_smoothing=)`, the z-loss `ce + z * lse**2` (PaLM), the soft-capped logits `cap * tanh(l / cap)`
  (Gemma 2); ignored rows (target < 0) give 0.
- The gradients (`Block.vjp`, f64) against torch.autograd in float64, under every saved-tensor policy.
- `coda grad --remat recompute` (and auto) keeps no [M, V] tensor: no saved tensor and no backward
  parameter of that shape.
- Golden files: the printed backward (`coda grad --remat recompute`, tests/golden/grad/) and the emitted
  epilogue of the forward's stage (tests/golden/emit/); `pytest --update-golden` rewrites them.

The torch losses here (`ce_smooth`, `ce_zloss`, `ce_softcap`) are also the references of
tests/test_examples_torch.py's accuracy-rule cases for these examples.
"""

from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from support import coda, golden, no_traceback

import coda_lang
from coda_lang.backend_cute.plan.emit import emit_stage
from coda_lang.backend_cute.plan.planner import plan_stage
from coda_lang.ir.types import Dim

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ["lm_head_ce_smooth", "lm_head_ce_zloss", "lm_head_ce_softcap"]
REMATS = ["save", "recompute", "auto"]


# ---------------------------------------------------------------------------- torch references


def ce_smooth(logits: torch.Tensor, target: torch.Tensor, smoothing: float) -> dict[str, torch.Tensor]:
    return {
        "loss": F.cross_entropy(
            logits, target, reduction="none", ignore_index=-100, label_smoothing=smoothing
        ),
        "lse": torch.logsumexp(logits, dim=-1),
    }


def ce_zloss(logits: torch.Tensor, target: torch.Tensor, z: float) -> dict[str, torch.Tensor]:
    lse = torch.logsumexp(logits, dim=-1)
    ce = F.cross_entropy(logits, target, reduction="none", ignore_index=-100)
    return {"loss": torch.where(target >= 0, ce + z * lse**2, 0.0), "lse": lse}


def ce_softcap(logits: torch.Tensor, target: torch.Tensor, cap: float) -> dict[str, torch.Tensor]:
    capped = cap * torch.tanh(logits / cap)
    return {
        "loss": F.cross_entropy(capped, target, reduction="none", ignore_index=-100),
        "lse": torch.logsumexp(capped, dim=-1),
    }


LOSSES = {"lm_head_ce_smooth": ce_smooth, "lm_head_ce_zloss": ce_zloss, "lm_head_ce_softcap": ce_softcap}
# each variant's scalar parameter: its default in the .coda file, and a value other than the default
SCALARS = {
    "lm_head_ce_smooth": ("smoothing", 0.1, 0.25),
    "lm_head_ce_zloss": ("z", 1e-4, 0.05),
    "lm_head_ce_softcap": ("cap", 30.0, 3.0),
}


def block(name: str) -> coda_lang.Block:
    return coda_lang.load(ROOT / "examples" / f"{name}.coda")[name]


def inputs(m: int = 13, d: int = 8, v: int = 37, seed: int = 0, scale: float = 1.0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "hg": rng.standard_normal((m, d)) * scale,
        "r": rng.uniform(0.5, 1.5, m),
        "w_lm": rng.standard_normal((d, v)),
        "target": np.where(np.arange(m) % 4 == 1, -100, rng.integers(0, v, m)).astype(np.int32),
    }


def torch_reference(name: str, ins: dict[str, np.ndarray], scalar: float) -> dict[str, torch.Tensor]:
    """The torch float64 loss and lse of the inputs (hg, r, w_lm as leaves that require grad)."""
    hg, r, w = (torch.tensor(ins[k], dtype=torch.float64, requires_grad=True) for k in ("hg", "r", "w_lm"))
    logits = (hg * r[:, None]) @ w
    out = LOSSES[name](logits, torch.tensor(ins["target"]).long(), scalar)
    return {"hg": hg, "r": r, "w_lm": w, **out}


# ---------------------------------------------------------------------------- forward


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("which", ["default", "given"])
def test_forward_f64_matches_torch_float64(name: str, which: str) -> None:
    key, default, other = SCALARS[name]
    ins = inputs(scale=3.0)  # logits up to ~40: the soft cap bites
    value = default if which == "default" else other
    given = ins if which == "default" else {**ins, key: other}
    ours = block(name).run(given, precision="f64")
    ref = torch_reference(name, ins, value)
    for out in ("loss", "lse"):
        want = ref[out].detach().numpy()
        np.testing.assert_allclose(ours[out], want, rtol=1e-12, atol=1e-12, err_msg=f"{name}.{out}")
    assert np.all(ours["loss"][ins["target"] < 0] == 0.0)  # ignored rows
    tiled = block(name).run(given, precision="f64", sim_tile=(4, 8))  # ragged tiles both ways
    for out in ("loss", "lse"):
        np.testing.assert_allclose(tiled[out], ours[out], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("remat", REMATS)
def test_gradients_match_torch_autograd(name: str, remat: str) -> None:
    key, _, other = SCALARS[name]
    ins = inputs(seed=1, scale=2.0)
    rng = np.random.default_rng(7)
    cts = {"loss": rng.standard_normal(13), "lse": rng.standard_normal(13)}
    got = block(name).vjp({**ins, key: other}, cts, precision="f64", remat=remat)
    ref = torch_reference(name, ins, other)
    total = (ref["loss"] * torch.tensor(cts["loss"])).sum() + (ref["lse"] * torch.tensor(cts["lse"])).sum()
    total.backward()
    assert sorted(got) == ["hg", "r", "w_lm"]
    for k in got:
        want = ref[k].grad.numpy()  # type: ignore[union-attr]
        np.testing.assert_allclose(got[k], want, rtol=1e-10, atol=1e-12, err_msg=f"{name} d{k} ({remat})")


# ---------------------------------------------------------------------------- no [M, V] tensor kept


def _mv_params(bwd: coda_lang.Block) -> list[str]:
    mv = (Dim.sym("M"), Dim.sym("V"))
    return [p.var.name for p in bwd.ir.params if p.var.type is not None and tuple(p.var.type.shape) == mv]


@pytest.mark.parametrize("name", VARIANTS)
def test_recomputed_keeps_no_m_by_v_tensor(name: str) -> None:
    b = block(name)
    assert _mv_params(b.derivation(remat="save").backward) == ["acc1"]
    for remat in ("recompute", "auto"):
        d = b.derivation(remat=remat)
        assert _mv_params(d.backward) == [], remat
        assert "lse" in d.saved and "acc1" not in d.saved
        for s in d.saved:
            t = next(o.type for o in d.forward.ir.outputs if o.name == s)
            assert len(t.shape) <= 1, f"{name} ({remat}) saves {s}: {t}"


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("remat", ["recompute", "auto"])
def test_coda_grad_prints_no_m_by_v_tensor(name: str, remat: str) -> None:
    r = coda("grad", f"examples/{name}.coda", "--remat", remat)
    no_traceback(r)
    assert r.returncode == 0, r.stderr
    saved = re.search(r"^# saved tensors \(stored by the forward\): (.*)$", r.stdout, re.M)
    assert saved is not None and "acc1" not in saved.group(1).split(", ")
    assert f"# saved per row: 4 bytes (--remat {remat})" in r.stdout
    sig = re.search(r"^block \w+\((.*)\) ->", r.stdout, re.M)
    assert sig is not None and "[M, V]" not in sig.group(1)
    assert "runs again in the backward" in r.stderr


# ---------------------------------------------------------------------------- golden files


@pytest.mark.parametrize("name", VARIANTS)
def test_golden_grad_recompute(name: str, update_golden: bool) -> None:
    got = coda("grad", f"examples/{name}.coda", "--remat", "recompute")
    assert got.returncode == 0, got.stderr
    golden(ROOT / "tests" / "golden" / "grad" / f"{name}_recompute.coda", got.stdout, update_golden)
    coda_lang.load(got.stdout)  # the golden backward checks


@pytest.mark.parametrize("name", VARIANTS)
def test_golden_emit(name: str, update_golden: bool) -> None:
    source = emit_stage(plan_stage(block(name), 1))
    golden(ROOT / "tests" / "golden" / "emit" / f"{name}_stage1.py", source, update_golden)


# ---------------------------------------------------------------------------- accuracy at large logits


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("chunk", [None, 16])
def test_recomputed_exact_gradients_meet_the_accuracy_rule(name: str, chunk: int | None) -> None:
    """Exact mode, max|logit| near 27 (bf16 inputs): the recomputed backward (softmax from the f32
    logits), chunked or not, is within twice plain bf16 PyTorch's error against float64 (docs/design.md,
    "Accuracy"), for hg and w_lm."""
    _, default, _ = SCALARS[name]
    m, d, v = 64, 64, 256
    hg = torch.randn(m, d, generator=torch.Generator().manual_seed(0)).bfloat16()
    w = (torch.randn(v, d, generator=torch.Generator().manual_seed(1)) * 0.7).bfloat16()
    r = torch.ones(m)
    t = torch.randint(0, v, (m,), generator=torch.Generator().manual_seed(2))
    t[::9] = -100

    def torch_grads(dt: torch.dtype) -> dict[str, np.ndarray]:
        H, W = hg.to(dt).clone().requires_grad_(), w.to(dt).clone().requires_grad_()
        logits = (H * r.to(dt)[:, None]) @ W.T
        logits = logits.float() if dt == torch.bfloat16 else logits
        LOSSES[name](logits, t, default)["loss"].sum().backward()
        assert H.grad is not None and W.grad is not None
        return {"hg": H.grad.double().numpy(), "w_lm": W.grad.double().T.numpy()}

    g64, g16 = torch_grads(torch.float64), torch_grads(torch.bfloat16)
    ins = {
        "hg": hg.float().numpy().astype(ml_dtypes.bfloat16),
        "r": r.numpy(),
        "w_lm": w.T.float().numpy().astype(ml_dtypes.bfloat16),
        "target": t.int().numpy(),
    }
    ours = block(name).vjp(ins, {"loss": np.ones(m, np.float32)}, remat="recompute", chunk=chunk)
    for k in ("hg", "w_lm"):
        err = float(np.max(np.abs(np.asarray(ours[k], np.float64) - g64[k])))
        base = float(np.max(np.abs(g16[k] - g64[k])))
        assert err <= 2 * base + 1e-6, f"{name} d{k}: {err:.3e} > 2 * {base:.3e} (bf16 torch)"
