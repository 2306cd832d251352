"""Infinities through the CUDA runtime (issue #17's "known differences on the GPU"), on the CPU: the
emulated kernels model what quack's kernels do at the places where infinities used to come out wrong.

- pick() of a value that is exactly -inf: quack's ColVecSelect takes -inf for "no match" and never
  writes it, so with the output prefilled with 0 such a row read 0. The runtime now prefills -inf
  where the row's index is in range (0 where it is not), so the row reads -inf, as in the interpreter;
  the emulated select skips -inf as quack's does, and fails without the prefill.
- Sums in a ragged tile with an infinity in a row of A: past the end of the reduced dim the
  accumulator is that row times zero columns, inf * 0 = NaN, and quack's sums fold it. The planner
  masks every sum over the columns of a value of acc there now (`sum(acc * acc)`, which it left
  unmasked as 0 for finite inputs, included: scaled, both factors masked, in the ragged last tile
  only); the emulated kernel models the NaN padding, and without the mask the sum of that row is NaN
  where the interpreter's is inf. (A sum over the rows is NaN there only for an infinity in a column
  of B, a weight as a rule: not masked, docs/backend.md.)
- logsumexp() of a row holding +inf, or only -inf: quack's online log-sum-exp gives NaN there
  (exp(inf - inf)), the interpreter +inf / -inf. The kernel folds each value clamped to +-F32_MAX and
  the runtime reads +-F32_MAX back as +-inf; the emulated fold models quack's, and fails without the
  clamp.
- A NaN reaching max() or min(), elementwise or folded over a dim, gives NaN (the interpreter's and
  torch's rule): the kernels use the NaN-propagating FMNMX (test_backend_ptx checks the PTX).
- The same on the GPU (marked gpu): every case through the compiled kernels.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import coda_lang  # noqa: E402
from coda_lang.testing.compare import mismatch  # noqa: E402

PICK_LOG = """dims M, K, N
block b(x: bf16[M, K], w: bf16[K, N], s: f32[N], t: i32[M]) -> (p: f32[M]) {
  gemm x @ w {
    p = pick(log(abs(acc) * s), t)
  }
}
"""


def _pick_case() -> tuple[Any, dict[str, Any], dict[str, Any]]:
    block = coda_lang.load(PICK_LOG)["b"]
    rng = np.random.default_rng(0)
    m, k, n = 40, 16, 72  # ragged: 72 columns in tiles of 32
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    s = np.ones(n, np.float32)
    s[::5] = 0  # log(0) = -inf in these columns
    t = rng.integers(0, n, m).astype(np.int32)
    t[::4] = 5  # a -inf column
    t[1::7] = -100  # ignored rows
    t[2::9] = n + 3  # past N (and past the last tile)
    t[3::11] = n + 1  # past N, inside the ragged last tile
    ins = {"x": x.astype(ml_dtypes.bfloat16), "w": w.astype(ml_dtypes.bfloat16), "s": s, "t": t}
    tensors = {
        "x": torch.tensor(x).bfloat16(),
        "w": torch.tensor(w).bfloat16(),
        "s": torch.tensor(s),
        "t": torch.tensor(t),
    }
    return block, ins, tensors


def test_a_picked_minus_infinity_reads_minus_infinity(monkeypatch: pytest.MonkeyPatch) -> None:
    block, ins, tensors = _pick_case()
    ref = block.run(ins)["p"]
    assert np.isneginf(ref).sum() >= 10 and (ref == 0).sum() >= 8
    cb = block.cuda(emulate=True, tile=(16, 32))
    got = cb(tensors)["p"]
    assert mismatch("p", got, ref) is None
    import coda_lang.backend_cute.runtime.launch as launch

    monkeypatch.setattr(launch, "_prefill_select", lambda out, idx, n: out.zero_())  # the old prefill
    got = block.cuda(emulate=True, tile=(16, 32))(tensors)["p"]
    why = mismatch("p", got, ref)
    assert why is not None and "finite" in why and "-inf" in why, why


def test_the_pick_prefill_is_minus_infinity_in_range_and_zero_elsewhere() -> None:
    """launch._prefill_select against the rule it implements (-inf where 0 <= index < n, else 0), on
    indices in range, negative and past n (int32 and int64), in at most three torch ops (views aside)
    after the zeroed allocation (the GPU test counts the kernels of a launch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import coda_lang.backend_cute.runtime.launch as launch

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    for dtype in (torch.int32, torch.int64):
        idx = torch.tensor([-5, -1, 0, 3, 6, 7, 8, 100, -(2**31)], dtype=dtype)
        n = 7
        out = torch.zeros(idx.shape[0], dtype=torch.float32)
        with Count() as c:
            launch._prefill_select(out, idx, n)
        want = np.where((idx.numpy() >= 0) & (idx.numpy() < n), -np.inf, 0.0)
        np.testing.assert_array_equal(out.numpy(), want)
        kernels = [
            op for op in c.ops if not op.startswith(("aten.view", "aten.reshape", "aten._unsafe_view"))
        ]
        assert len(kernels) <= 3, c.ops  # views launch nothing
    empty = torch.zeros(3)
    launch._prefill_select(empty, torch.tensor([0, 1, -1]), 0)
    assert (empty == 0).all()


SUMS = """dims M, K, N
block b(x: bf16[M, K], w: bf16[K, N], g: f32[N]) -> (o: bf16[M, N], ss: f32[M], t: f32[M], c: f32[N]) {
  gemm x @ w {
    o = acc * g
    ss = sum(acc * acc, over=N)
    t = sum(exp(acc / 64.0), over=N)
    c = sum(acc * g, over=M)
  }
}
"""


def _sums_case() -> tuple[Any, dict[str, Any], dict[str, Any]]:
    block = coda_lang.load(SUMS)["b"]
    rng = np.random.default_rng(0)
    m, k, n = 40, 16, 72
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    x[3, 2] = np.inf  # a row of A with an infinity: acc of row 3 is +-inf, its squares inf
    g = np.ones(n, np.float32)
    ins = {"x": x.astype(ml_dtypes.bfloat16), "w": w.astype(ml_dtypes.bfloat16), "g": g}
    tensors = {"x": torch.tensor(x).bfloat16(), "w": torch.tensor(w).bfloat16(), "g": torch.tensor(g)}
    return block, ins, tensors


def test_sums_of_a_row_with_an_infinity_are_not_nan(monkeypatch: pytest.MonkeyPatch) -> None:
    block, ins, tensors = _sums_case()
    ref = block.run(ins)
    assert ref["ss"][3] == np.inf
    cb = block.cuda(emulate=True, tile=(16, 32))
    masked = {s.name: (s.bounded, s.ragged_only) for sp in cb.specs if sp is not None for s in sp.sinks}
    # ss: 0 there for finite inputs (the ragged last tile only); t: exp(0) = 1 there (every tile); c, a
    # sum over the rows, NaN there only for an infinity in a column of B: not masked
    assert masked == {"ss": (True, True), "t": (True, False), "c": (False, False)}, masked
    got = cb(tensors)
    for k in ref:
        assert mismatch(k, got[k], ref[k]) is None, k
    import coda_lang.backend_cute.plan.sinks as sinks

    padding_value = sinks.padding_value
    monkeypatch.setattr(  # the old rule: sums that are 0 there for finite inputs left unmasked
        sinks, "padding_value", lambda *a, finite=True, **kw: padding_value(*a, **kw)
    )
    got = block.cuda(emulate=True, tile=(16, 32))(tensors)
    why = mismatch("ss", got["ss"], ref["ss"])
    assert why is not None and "nan" in why and "inf" in why, why


LSE = """dims M, K, N
block b(x: bf16[M, K], w: bf16[K, N]) -> (lse: f32[M], mx: f32[M], mn: f32[N], o: f32[M, N]) {
  gemm x @ w {
    lse = logsumexp(acc, over=N)
    mx = max(acc, over=N)
    mn = min(acc, over=M)
    o = max(acc, 0.0) + min(acc, 1.0)
  }
}
"""


def _lse_case() -> tuple[Any, dict[str, Any], dict[str, Any]]:
    block = coda_lang.load(LSE)["b"]
    rng = np.random.default_rng(1)
    m, k, n = 40, 16, 72
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    w[2, 5] = np.inf  # column 5 of acc: +inf where x[:, 2] > 0, -inf where < 0
    x[7, :] = 0.0
    x[7, 2] = -1.0  # row 7: -inf at column 5 only (the rest 0): lse finite
    x[9, 4] = np.nan  # row 9: NaN everywhere
    ins = {"x": x.astype(ml_dtypes.bfloat16), "w": w.astype(ml_dtypes.bfloat16)}
    tensors = {"x": torch.tensor(x).bfloat16(), "w": torch.tensor(w).bfloat16()}
    return block, ins, tensors


def test_logsumexp_of_infinities_and_nan_through_max_and_min(monkeypatch: pytest.MonkeyPatch) -> None:
    block, ins, tensors = _lse_case()
    ref = block.run(ins)
    assert np.isposinf(ref["lse"]).sum() >= 10 and np.isfinite(ref["lse"][7]) and np.isnan(ref["lse"][9])
    assert np.isnan(ref["mx"][9]) and np.isnan(ref["mn"]).all() and np.isnan(ref["o"][9]).all()
    got = block.cuda(emulate=True, tile=(16, 32))(tensors)
    for k in ref:
        assert mismatch(k, got[k], ref[k]) is None, k
    import coda_lang.backend_cute.plan.spec as specs

    monkeypatch.setattr(specs, "LSE_CLAMP", False)  # quack's online log-sum-exp as it is
    got = block.cuda(emulate=True, tile=(16, 32))(tensors)
    why = mismatch("lse", got["lse"], ref["lse"])
    assert why is not None and "nan" in why and "inf" in why, why


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["pick", "sums", "lse"])
def test_infinities_on_the_gpu(case: str) -> None:
    block, ins, tensors = {"pick": _pick_case, "sums": _sums_case, "lse": _lse_case}[case]()
    ref = block.run(ins)
    got = block.cuda(tune=False)({k: v.cuda() for k, v in tensors.items()})
    for k in ref:
        assert mismatch(k, got[k], ref[k], block.run(ins, precision="f64")[k]) is None, k
