"""The delayed-scaling update as one Triton kernel (backend_triton/scales.py, `grad_scales.fused_update`),
run by Triton's CPU interpreter, against the torch ops it replaces on a GPU: the scales, the history
ring, its position and the scales a backward ran at, bit for bit, over more steps than the ring holds,
with amaxes of 0, inf and NaN; through a call site's `DelayedScaling` and through a patched fp8 model's
forward scales (hf/fp8.py's `Bank`)."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from coda_lang.backend_cute.runtime import grad_scales  # noqa: E402
from coda_lang.backend_cute.runtime.grad_scales import AmaxRing, DelayedScaling, delayed_scales  # noqa: E402

# (the interpreter computes 1 / 0 for an amax of 0, which the rule then leaves unused, as torch does)
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _amaxes(step: int, width: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    a = torch.rand(width, generator=g) * 10 ** torch.randint(-3, 4, (width,), generator=g).float()
    specials = [0.0, float("inf"), float("nan"), 1e-30]
    if step % 3 == 1:
        a[step % width] = specials[(step // 3) % len(specials)]
    return a


@pytest.mark.parametrize("width, size", [(1, 1), (5, 3), (40, 15)])
def test_the_kernel_is_the_torch_ops(width: int, size: int) -> None:
    from coda_lang.backend_triton.scales import delayed_update

    ring = AmaxRing(size, width, torch.device("cpu"))
    vec = torch.full((width,), 2.0)
    ring2, vec2 = copy.deepcopy(ring), vec.clone()
    fed = torch.zeros(width)
    for step in range(max(2 * size + 3, 12)):  # (the ring wraps; every special amax fed)
        a = _amaxes(step, width)
        fed = torch.maximum(fed, a)
        want_last = vec.clone()
        delayed_scales(a, ring.rows, vec, 448.0, out=vec)
        ring.push(a)
        last = torch.empty_like(vec2)
        delayed_update(a, ring2.rows, ring2.count, vec2, 448.0, last, interpret=True)
        assert _same(vec2, vec) and _same(ring2.rows, ring.rows), step
        assert int(ring2.count) == int(ring.count) == step + 1
        assert _same(last, want_last)
    assert torch.isnan(fed).any()  # (the specials went through: a NaN amax, kept by the max)


def test_a_call_sites_records_are_the_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    names = ["dacc1_scale", "dacc2_scale", "dacc3_scale"]
    states = []
    for fused in (False, True):
        monkeypatch.setattr(grad_scales, "INTERPRET_FUSED", fused)
        st = DelayedScaling(1.0, history=4, margin=1)
        st.bind(names, "e5m2")
        st.scales_for(torch.device("cpu"))
        seen = []
        for step in range(9):
            a = _amaxes(step, 3)
            st.record({n: a[i] for i, n in enumerate(names)})
            seen.append((torch.stack(list(st.scales.values())), torch.stack(list(st.last_scales.values()))))
        states.append((st, seen))
    (plain, seen0), (fused, seen1) = states
    for (s0, l0), (s1, l1) in zip(seen0, seen1, strict=True):
        assert _same(s0, s1) and _same(l0, l1)
    assert plain._past is not None and fused._past is not None
    assert _same(plain._past.rows, fused._past.rows) and plain.steps == fused.steps == 9


def test_a_patched_models_scales_are_the_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny fp8="delayed" Llama, four steps: its losses, the forward's scales and history (the Bank)
    and every call site's cotangent scales, with the kernel and with torch's ops."""
    pytest.importorskip("transformers")
    from test_hf import batch
    from test_hf_fp8 import tiny

    from coda_lang.hf import apply_coda_to_llama

    base = tiny()
    ids, labels = batch()
    runs = []
    for fused in (False, True):
        monkeypatch.setattr(grad_scales, "INTERPRET_FUSED", fused)
        model = apply_coda_to_llama(copy.deepcopy(base), fp8="delayed")
        losses = []
        for _ in range(4):
            model.zero_grad()
            loss = model(input_ids=ids, labels=labels).loss
            loss.backward()
            losses.append(loss.item())
        runs.append((losses, model._coda.fp8_bank))
    (l0, b0), (l1, b1) = runs
    assert l0 == l1
    assert _same(b0.scales, b1.scales) and _same(b0.past.rows, b1.past.rows)
    assert int(b0.past.count) == int(b1.past.count) == 4
    assert b0.grads.keys() == b1.grads.keys()
    for site, g0 in b0.grads.items():
        g1 = b1.grads[site]
        assert _same(g0._vec, g1._vec) and _same(g0._past.rows, g1._past.rows), site


@pytest.mark.gpu
def test_the_kernel_on_a_gpu_is_the_torch_ops() -> None:
    """The compiled kernel (not the interpreter) on CUDA tensors, against torch's ops on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from coda_lang.backend_triton.scales import delayed_update

    dev = torch.device("cuda")
    ring, vec = AmaxRing(15, 40, dev), torch.full((40,), 2.0, device=dev)
    ring2, vec2 = AmaxRing(15, 40, dev), vec.clone()
    for step in range(40):
        a = _amaxes(step, 40).to(dev)
        want_last = vec.clone()
        delayed_scales(a, ring.rows, vec, 57344.0, out=vec)
        ring.push(a)
        last = torch.empty_like(vec2)
        delayed_update(a, ring2.rows, ring2.count, vec2, 57344.0, last)
        assert _same(vec2, vec) and _same(ring2.rows, ring.rows) and _same(last, want_last), step
    assert int(ring2.count) == int(ring.count) == 40


def test_the_variable_takes_0_or_1(monkeypatch: pytest.MonkeyPatch) -> None:
    for v, want in (("1", True), ("0", False)):
        monkeypatch.setenv("CODA_FUSED_SCALES", v)
        assert grad_scales.fused_scales_on() is want
    monkeypatch.delenv("CODA_FUSED_SCALES")
    assert grad_scales.fused_scales_on() is False
    monkeypatch.setenv("CODA_FUSED_SCALES", "yes")
    with pytest.raises(ValueError, match="CODA_FUSED_SCALES is 'yes'; it takes 1"):
        grad_scales.fused_scales_on()
