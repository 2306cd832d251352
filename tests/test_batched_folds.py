"""The amax folds a CUDA block runs together at the end of a run (`cuda_block.batched_folds`).

An fp8 block returns the amaxes its next step's scales come from: each a fold of a GEMM stage's
per-tile partials or of an elementwise stage's per-row partials, passed to an output by `detach` or a
copy, read by nothing in the run. The runtime folds them all in one `torch._foreach_max` after the
run instead of one launch each. Checked on the emulated runtime (the torch path CI runs):
- which folds are taken: every amax of the fp8 Llama layer's forward (six) and backward (three);
  none that a later stage or equation reads;
- the values: the run's outputs are those of the same run folding each amax in place, bit for bit,
  and the interpreter's, with NaN and infinities in the inputs too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from runtime_check import to_torch

import coda_lang
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.hf.blocks import model_source
from coda_lang.testing.inputs import block_inputs

torch = pytest.importorskip("torch")

WRT = ["y", "x", "w_o", "g1", "w_13", "w_2", "g2", "w_qkv"]
DIMS = {"M": 24, "D": 32, "F": 48, "K": 32, "P": 48}


def _layer() -> coda_lang.Block:
    return coda_lang.load(model_source("bfloat16", 1e-5, 16, None, fp8="delayed"))["layer"]


def _run(cb: Any, ins: dict[str, np.ndarray], batched: bool) -> dict[str, Any]:
    if not batched:
        cb._folds, cb._after = {}, frozenset()
    return cb({k: to_torch(np.asarray(v)) for k, v in ins.items()})


def test_the_layers_amaxes_are_batched() -> None:
    layer = _layer()
    cb = layer.cuda(emulate=True)
    folded = {layer.ir.body[i].ins[0].name for i in cb._folds}
    assert len(cb._folds) == 6 and len(cb._after) == 6, folded
    amaxes = {o.name for o in layer.ir.outputs if o.name.startswith("am_")}
    passed = {v.name for i in cb._after for v in layer.ir.body[i].outs}
    assert passed == amaxes
    d = layer.derivation(WRT, backward=BackwardOptions("auto", fp8_grads="e5m2"))
    bcb = d.backward.cuda(emulate=True)
    assert len(bcb._folds) == 3
    assert {v.name for i in bcb._after for v in d.backward.ir.body[i].outs} == set(d.scales.values())


def test_a_fold_read_in_the_run_is_not_batched() -> None:
    """A statistic a later stage reads (RMSNorm's row sums: `r1 = rsqrt(ss1 / D + eps)`) is folded where
    it stands; only folds that reach outputs through detach or a copy are taken."""
    layer = _layer()
    cb = layer.cuda(emulate=True)
    for i in cb._folds:
        e = layer.ir.body[i]
        assert e.op == "reduce_max"
        users = [
            s
            for s in layer.ir.body
            if any(getattr(a, "name", None) == e.outs[0].name for a in getattr(s, "ins", ()))
        ]
        assert users and all(u.op == "detach" for u in users)


@pytest.mark.parametrize("special", [False, True], ids=["plain", "special"])
def test_batched_amaxes_are_the_folds_in_place(special: bool) -> None:
    layer = _layer()
    ins = block_inputs(layer, DIMS, 5, special)
    for k in [p.var.name for p in layer.ir.params if p.var.name.startswith("s_")]:
        ins[k] = np.float32(0.5)
    got = _run(layer.cuda(emulate=True), ins, True)
    ref = _run(layer.cuda(emulate=True), ins, False)
    want = layer.run(ins)
    for name in ref:
        a, b = got[name], ref[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.isnan(), b.isnan()), name
        assert torch.equal(torch.nan_to_num(a.float()), torch.nan_to_num(b.float())), name
    for name in [n for n in ref if n.startswith("am_")]:
        w = np.asarray(want[name], np.float32)
        g = got[name].float().numpy()
        assert (np.isnan(w) and np.isnan(g)) or g == w, (name, g, w)


def test_the_backwards_amaxes() -> None:
    """The derived backward's cotangent amaxes (`dacc<k>_amax`), batched, are the interpreter's."""
    layer = _layer()
    d = layer.derivation(WRT, backward=BackwardOptions("auto", fp8_grads="e5m2"))
    bwd = d.backward
    ins = block_inputs(bwd, DIMS, 7)
    for k in [
        p.var.name for p in bwd.ir.params if p.var.name.startswith("s_") or p.var.name.endswith("_scale")
    ]:
        ins[k] = np.float32(0.5)
    got = _run(bwd.cuda(emulate=True), ins, True)
    want = bwd.run(ins)
    for name in d.scales.values():
        assert got[name].float().item() == float(np.asarray(want[name], np.float32)), name
