"""The checkpoint layout helpers (coda_lang/layout.py): round trips, RoPE equivalence, errors.

Round trips are checked both ways on NumPy (f32 and ml_dtypes bfloat16) and torch (bf16, f32);
the RoPE property is that `pairs()` of `x @ interleave_rope(W)`, rotated by `rope_freq` angles and
de-interleaved, equals ordinary rotate-half RoPE of `x @ W` (float64, to rounding).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from coda_lang.layout import (
    deinterleave_rope,
    interleave_gate_up,
    interleave_rope,
    rope_freq,
    split_gate_up,
)


def _np(shape: tuple[int, ...], seed: int, dtype: object = np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)  # type: ignore[call-overload]


def _same(a: object, b: object) -> None:
    """Same kind, dtype, shape and values."""
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    else:
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


KINDS: dict[str, Callable[[tuple[int, ...], int], Any]] = {
    "np-f32": lambda s, seed: _np(s, seed),
    "np-bf16": lambda s, seed: _np(s, seed, ml_dtypes.bfloat16),
    "torch-f32": lambda s, seed: torch.from_numpy(_np(s, seed)),
    "torch-bf16": lambda s, seed: torch.from_numpy(_np(s, seed)).to(torch.bfloat16),
}


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(40,), (8, 40), (2, 3, 40)])
def test_gate_up_round_trips(kind: str, shape: tuple[int, ...]) -> None:
    make = KINDS[kind]
    w1, w3 = make(shape, 1), make(shape, 2)
    w13 = interleave_gate_up(w1, w3)
    assert type(w13) is type(w1) and tuple(w13.shape) == shape[:-1] + (80,)
    # the documented column order: (g0, u0, g1, u1, ...)
    _same(w13[..., 0::2].copy() if isinstance(w13, np.ndarray) else w13[..., 0::2].contiguous(), w1)
    _same(w13[..., 1::2].copy() if isinstance(w13, np.ndarray) else w13[..., 1::2].contiguous(), w3)
    g, u = split_gate_up(w13)
    _same(g, w1)
    _same(u, w3)
    # and the other way: split, then interleave
    other = make(shape[:-1] + (80,), 3)
    _same(interleave_gate_up(*split_gate_up(other)), other)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "head_dim, width, rope_width", [(16, 128, 96), (16, 64, None), (8, 40, 0), (2, 6, 4)]
)
def test_rope_round_trips(kind: str, head_dim: int, width: int, rope_width: int | None) -> None:
    make = KINDS[kind]
    w = make((24, width), 4)
    wi = interleave_rope(w, head_dim, rope_width)
    assert type(wi) is type(w) and wi.dtype == w.dtype and wi.shape == w.shape
    _same(deinterleave_rope(wi, head_dim, rope_width), w)
    _same(interleave_rope(deinterleave_rope(w, head_dim, rope_width), head_dim, rope_width), w)
    rw = width if rope_width is None else rope_width
    # columns past rope_width (v heads) stay where they are
    _same(wi[:, rw:], w[:, rw:])


@given(
    head_dim=st.integers(1, 8).map(lambda h: 2 * h),
    rope_heads=st.integers(0, 4),
    other_heads=st.integers(0, 3),
    lead=st.lists(st.integers(1, 3), max_size=2),
    seed=st.integers(0, 2**16),
)
def test_rope_round_trip_property(
    head_dim: int, rope_heads: int, other_heads: int, lead: list[int], seed: int
) -> None:
    width = (rope_heads + other_heads) * head_dim
    w = _np((*lead, width), seed)
    rw = rope_heads * head_dim
    wi = interleave_rope(w, head_dim, rw)
    _same(deinterleave_rope(wi, head_dim, rw), w)
    # a permutation: the same multiset of values, every column moved within its own head
    for h in range(rope_heads + other_heads):
        cols = slice(h * head_dim, (h + 1) * head_dim)
        assert np.array_equal(np.sort(wi[..., cols], axis=-1), np.sort(w[..., cols], axis=-1))


def test_layout_is_the_documented_one() -> None:
    w = np.arange(2 * 8 + 4)
    # head_dim 8, two rope heads: halves (j, j + 4) -> columns (2j, 2j+1); the last 4 columns stay
    assert interleave_rope(w, 8, 16).tolist() == [
        0,
        4,
        1,
        5,
        2,
        6,
        3,
        7,
        8,
        12,
        9,
        13,
        10,
        14,
        11,
        15,
        16,
        17,
        18,
        19,
    ]
    assert interleave_gate_up(np.arange(3), np.arange(10, 13)).tolist() == [0, 10, 1, 11, 2, 12]


def test_torch_device_and_grad_free_copy() -> None:
    w = torch.randn(4, 32, dtype=torch.bfloat16)
    wi = interleave_rope(w, 16)
    assert wi.device == w.device and wi.data_ptr() != w.data_ptr()
    w1, w3 = split_gate_up(w)
    assert w1.is_contiguous() and w3.is_contiguous()


# ---------------------------------------------------------------------------- RoPE equivalence


def _rotate_half_rope(
    q: np.ndarray, pos: np.ndarray, head_dim: int, rope_width: int, base: float
) -> np.ndarray:
    """Ordinary rotate-half RoPE (HF LLaMA style) on the heads in the first rope_width columns."""
    out = q.copy()
    inv = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = pos[:, None] * np.concatenate([inv, inv])[None, :]  # [M, head_dim]
    cos, sin = np.cos(ang), np.sin(ang)
    for h0 in range(0, rope_width, head_dim):
        x = q[:, h0 : h0 + head_dim]
        rot = np.concatenate([-x[:, head_dim // 2 :], x[:, : head_dim // 2]], axis=1)
        out[:, h0 : h0 + head_dim] = x * cos + rot * sin
    return out


@pytest.mark.parametrize("head_dim, heads, rope_heads", [(16, 8, 6), (8, 3, 3), (128, 2, 1)])
def test_pairs_of_interleaved_weights_reproduce_rotate_half_rope(
    head_dim: int, heads: int, rope_heads: int
) -> None:
    M, D, base = 12, 24, 10000.0
    width, rw = heads * head_dim, rope_heads * head_dim
    x = _np((M, D), 5).astype(np.float64)
    w = _np((D, width), 6).astype(np.float64)
    pos = np.arange(M, dtype=np.float64) * 7.0
    ref = _rotate_half_rope(x @ w, pos, head_dim, rw, base)

    z = x @ interleave_rope(w, head_dim, rw)  # what the stage's acc holds
    a, b = z[:, 0::2], z[:, 1::2]  # pairs(z)
    ang = pos[:, None] * rope_freq(head_dim, rw, width, base).astype(np.float64)[None, :]
    c, s = np.cos(ang), np.sin(ang)
    out = np.empty_like(z)
    out[:, 0::2], out[:, 1::2] = a * c - b * s, a * s + b * c  # interleave(...)
    got = deinterleave_rope(out, head_dim, rw)
    # rope_freq is f32, the reference's inv_freq f64: angles agree to ~1e-7 relative
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    # q.k per head is unchanged by the shared permutation
    qi = x @ interleave_rope(w, head_dim, rw)
    q = x @ w
    for h0 in range(0, width, head_dim):
        np.testing.assert_allclose(
            (qi[:, h0 : h0 + head_dim] @ qi[:, h0 : h0 + head_dim].T),
            (q[:, h0 : h0 + head_dim] @ q[:, h0 : h0 + head_dim].T),
            rtol=1e-12,
            atol=1e-12,
        )


def test_rope_freq_values() -> None:
    f = rope_freq(16, 32, 48, base=500000.0)
    assert f.dtype == np.float32 and f.shape == (24,)
    inv = (500000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)).float().numpy()
    assert np.array_equal(f[:8], inv) and np.array_equal(f[8:16], inv)
    assert np.all(f[16:] == 0)


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: interleave_rope(np.zeros((4, 30)), 15), "head_dim must be a positive even integer"),
        (lambda: interleave_rope(np.zeros((4, 30)), 0), "head_dim must be a positive even integer"),
        (
            lambda: interleave_rope(np.zeros((4, 40)), 16),
            "width of the last axis .* = 40 is not a multiple of head_dim = 16",
        ),
        (
            lambda: deinterleave_rope(torch.zeros(4, 48), 16, 40),
            "rope_width = 40 is not a multiple of head_dim = 16",
        ),
        (lambda: interleave_rope(np.zeros((4, 48)), 16, 64), "rope_width = 64 is more than the 48 columns"),
        (lambda: rope_freq(15, 30, 30), "head_dim must be a positive even integer"),
        (lambda: rope_freq(16, 24, 48), "rope_width = 24 is not a multiple of head_dim = 16"),
        (lambda: rope_freq(16, 32, 47), "width must be a positive even integer"),
        (lambda: split_gate_up(np.zeros((4, 7))), "even number of columns"),
        (lambda: interleave_gate_up(np.zeros((4, 8)), np.zeros((4, 6))), "same shape"),
        (lambda: interleave_gate_up(np.zeros(8, np.float32), np.zeros(8)), "same dtype"),
        (lambda: interleave_rope(np.float32(1.0), 2), "scalar"),
    ],
)
def test_errors(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


def test_mixed_kinds_and_non_arrays_are_type_errors() -> None:
    with pytest.raises(TypeError, match="must both be NumPy arrays or both torch tensors"):
        interleave_gate_up(np.zeros(4), torch.zeros(4))
    with pytest.raises(TypeError, match="NumPy array or a torch tensor"):
        interleave_rope([1.0, 2.0], 2)


def test_import_does_not_import_torch() -> None:
    code = (
        "import sys, numpy as np, coda_lang, coda_lang.layout as L; "
        "L.interleave_rope(L.interleave_gate_up(np.ones((2, 8)), np.ones((2, 8))), 4); L.rope_freq(4, 8, 16); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
