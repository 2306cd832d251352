"""The interpreter's reductions by a combine function, folded a slice at a time
(coda_lang/backend_triton/interpret.py), against the interpreter's own element-at-a-time fold and
NumPy: the same values bit for bit, shapes and dtypes, NaN and infinities included."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from coda_lang.backend_triton import interpret  # noqa: E402


def _add(a, b):  # type: ignore[no-untyped-def]
    return a + b


def _nanmax(a, b):  # type: ignore[no-untyped-def]
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


def _both(a, i, b, j):  # type: ignore[no-untyped-def]
    # a two-value combine: the larger value and its index (ties: the smaller index)
    take = (a > b) | ((a == b) & (i < j))
    return tl.where(take, a, b), tl.where(take, i, j)


_add_j: Any = None  # (the combine functions as the interpreter calls them: set by _run)
_nanmax_j: Any = None
_both_j: Any = None


def _kernel(x, out_rows, out_cols, out_all, out_keep, out_idx, R: tl.constexpr, C: tl.constexpr):  # type: ignore[no-untyped-def]
    r = tl.arange(0, R)[:, None]
    c = tl.arange(0, C)[None, :]
    v = tl.load(x + r * C + c)
    tl.store(out_rows + tl.arange(0, R), tl.reduce(v, 1, _add_j))
    tl.store(out_cols + tl.arange(0, C), tl.reduce(v, 0, _nanmax_j))
    tl.store(out_all, tl.reduce(tl.reshape(v, (R * C,)), 0, _add_j))
    k = tl.reduce(v, 1, _nanmax_j, keep_dims=True)
    tl.store(out_keep + r, k)
    idx = tl.broadcast_to(c, (R, C))
    _m, i = tl.reduce((v, idx), 1, _both_j)
    tl.store(out_idx + tl.arange(0, R), i)


def _run(x: torch.Tensor) -> list[torch.Tensor]:
    from triton.runtime.interpreter import InterpretedFunction

    global _add_j, _nanmax_j, _both_j
    _add_j, _nanmax_j, _both_j = (InterpretedFunction(f) for f in (_add, _nanmax, _both))
    R, C = x.shape
    outs = [
        torch.empty(R),
        torch.empty(C),
        torch.empty(1),
        torch.empty(R, 1),
        torch.empty(R, dtype=torch.int32),
    ]
    InterpretedFunction(_kernel)[(1,)](x, *outs, R=R, C=C)
    return outs


def _inputs() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 16, generator=gen) * 1e3
    x[1, 3] = float("nan")
    x[2, :] = float("-inf")
    x[3, 5] = float("inf")
    x[4, 7] = x[4, 9] = 5e4  # a tie: the smaller index
    return x


def test_the_slice_fold_is_the_interpreters_fold_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    from triton.runtime import interpreter

    assert interpret.speed_up_reductions()
    assert interpreter.ReduceOps.generic_reduce is interpret._slice_fold
    x = _inputs()
    fast = _run(x)
    monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce", interpret._ORIGINAL[0])
    slow = _run(x)
    for f, s in zip(fast, slow, strict=True):
        assert f.shape == s.shape and f.dtype == s.dtype
        assert torch.equal(f.view(torch.int32), s.view(torch.int32)), (f, s)
    # and what they are: NumPy's left folds
    xn = x.numpy()
    rows = np.zeros(8, np.float32)
    for j in range(16):
        rows = (rows + xn[:, j]).astype(np.float32) if j else xn[:, 0].copy()
    assert np.array_equal(fast[0].numpy(), rows, equal_nan=True)
    cols = fast[1].numpy()
    assert np.isnan(cols[3]) and cols[5] == np.inf
    ok = [j for j in range(16) if j not in (3,)]
    assert np.array_equal(cols[ok], np.max(xn[:, ok], axis=0))
    assert fast[3][2, 0] == float("-inf") and np.isnan(float(fast[3][1, 0]))
    assert int(fast[4][4]) == 7


def test_the_generated_kernels_use_it() -> None:
    from triton.runtime import interpreter

    from coda_lang.backend_triton.generate import _jit

    _jit(True)
    assert interpreter.ReduceOps.generic_reduce is interpret._slice_fold
