"""Checkpoint layout helpers: the interleaved column orders that `pairs()` needs, and back.

What it does: `pairs(z)` splits a tile into its even and odd columns, so a weight whose outputs
pair up must store each pair as adjacent columns. These functions convert between the ordinary
layout of a checkpoint and that interleaved layout:
  - `interleave_gate_up(w1, w3)` / `split_gate_up(w13)`: gate and up projections of a gated MLP
    (SwiGLU) as one matrix with columns (g0, u0, g1, u1, ...);
  - `interleave_rope(w, head_dim, rope_width)` / `deinterleave_rope(...)`: within each head, the
    rotate-half RoPE partners (j, j + head_dim/2) moved to columns (2j, 2j+1), for the heads in the
    first `rope_width` columns (the q and k heads of a fused QKV; v stays as it is);
  - `rope_freq(head_dim, rope_width, width)`: the per-column-pair inverse frequencies (`freq`) that
    the RoPE examples multiply by the position.
Weights are [in, out] matrices, the right operand of a GEMM (`x @ w`). A torch `nn.Linear.weight`
is [out, in]: pass `linear.weight.T` (and transpose the result back to store it in a Linear).
Every function permutes only the last axis, so the same call converts a weight matrix, a bias or
norm-weight vector, or an activation (e.g. a block's `qkv` output, to compare with an unfused model).
What it does not: copy data between devices (a torch tensor is permuted through views and slices,
never an index tensor copied to its device: the patched models permute their q/k norm weights in
every forward, which a CUDA graph captures) or change dtypes (a permutation is exact), touch the
rows of a weight, or know about attention itself: RoPE on the interleaved layout gives the same q.k
because q and k share the permutation.
Invariants: each pair of functions are exact inverses; inputs may be NumPy arrays (any dtype,
ml_dtypes bfloat16 included) or torch tensors, and the result is of the same kind, dtype and device.
torch is never imported here: a tensor argument means the caller has imported it already, and
`import coda_lang` must stay free of torch.
"""

from __future__ import annotations

import sys
from typing import Any, TypeVar

import numpy as np

__all__ = ["deinterleave_rope", "interleave_gate_up", "interleave_rope", "rope_freq", "split_gate_up"]

A = TypeVar("A")


def _torch_of(x: Any) -> Any:
    """The torch module if `x` is a torch tensor, else None (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch
    return None


def _last_axis(x: Any, what: str) -> int:
    shape = getattr(x, "shape", None)
    if shape is None:
        raise TypeError(f"{what} must be a NumPy array or a torch tensor, got {type(x).__name__}")
    if len(shape) == 0:
        raise ValueError(f"{what} is a scalar; the layout helpers permute the last axis (columns)")
    return int(shape[-1])


def _permute(x: Any, perm: np.ndarray) -> Any:
    """x[..., perm] (a new array or tensor, same kind, dtype and device)."""
    torch = _torch_of(x)
    if torch is not None:
        return x.index_select(-1, torch.as_tensor(perm, device=x.device))
    return np.asarray(x)[..., perm]


def _check_even(name: str, n: int) -> None:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n <= 0 or n % 2:
        raise ValueError(f"{name} must be a positive even integer (RoPE rotates pairs of columns), got {n!r}")


def _rope_perm(width: int, head_dim: int, rope_width: int | None) -> np.ndarray:
    """perm with interleaved[..., k] = ordinary[..., perm[k]], after checking the arguments."""
    _check_even("head_dim", head_dim)
    rw = width if rope_width is None else rope_width
    if not isinstance(rw, (int, np.integer)) or isinstance(rw, bool) or rw < 0:
        raise ValueError(f"rope_width must be a non-negative integer, got {rope_width!r}")
    if rw > width:
        raise ValueError(f"rope_width = {rw} is more than the {width} columns of the last axis")
    if rw % head_dim:
        what = (
            "rope_width" if rope_width is not None else "the width of the last axis (the default rope_width)"
        )
        raise ValueError(
            f"{what} = {rw} is not a multiple of head_dim = {head_dim}; "
            "RoPE heads must be whole (give rope_width for the q and k heads only)"
        )
    half = head_dim // 2
    perm = np.arange(width)
    heads = np.arange(0, rw, head_dim)[:, None]
    j = np.arange(half)[None, :]
    perm[:rw] = np.stack([heads + j, heads + half + j], axis=-1).reshape(-1)
    return perm


def interleave_gate_up(w1: A, w3: A) -> A:
    """Gate and up projections -> one matrix with columns (g0, u0, g1, u1, ...) for `pairs()`.

    `w1` (gate) and `w3` (up) are [..., F]: [in, out] weights (for torch Linears pass
    `gate_proj.weight.T` and `up_proj.weight.T`), biases, or activations. Returns [..., 2F], so
    `gt, up = pairs(x @ w13)` gives `gt = x @ w1` and `up = x @ w3`.
    """
    g: Any = w1
    u: Any = w3
    f = _last_axis(g, "w1")
    _last_axis(u, "w3")
    torch_g, torch_u = _torch_of(g), _torch_of(u)
    if (torch_g is None) != (torch_u is None):
        raise TypeError("w1 and w3 must both be NumPy arrays or both torch tensors")
    if tuple(g.shape) != tuple(u.shape):
        raise ValueError(f"w1 and w3 must have the same shape, got {tuple(g.shape)} and {tuple(u.shape)}")
    if g.dtype != u.dtype:
        raise ValueError(f"w1 and w3 must have the same dtype, got {g.dtype} and {u.dtype}")
    if torch_g is not None:
        if g.device != u.device:
            raise ValueError(f"w1 and w3 must be on the same device, got {g.device} and {u.device}")
        return torch_g.stack([g, u], dim=-1).flatten(-2)
    a, b = np.asarray(g), np.asarray(u)
    out: Any = np.stack([a, b], axis=-1).reshape(a.shape[:-1] + (2 * f,))
    return out


def split_gate_up(w13: A) -> tuple[A, A]:
    """The inverse of `interleave_gate_up`: [..., 2F] with columns (g0, u0, ...) -> (w1, w3), [..., F] each."""
    n = _last_axis(w13, "w13")
    if n % 2:
        raise ValueError(f"w13 must have an even number of columns (gate, up pairs), got {n}")
    if _torch_of(w13) is not None:  # (strided slices: no index tensor to copy to the device)
        t: Any = w13
        return t[..., 0::2].contiguous(), t[..., 1::2].contiguous()
    even, odd = np.arange(0, n, 2), np.arange(1, n, 2)
    return _permute(w13, even), _permute(w13, odd)


def interleave_rope(w: A, head_dim: int, rope_width: int | None = None) -> A:
    """Ordinary (rotate-half) RoPE layout -> the interleaved layout that `pairs()` needs.

    The last axis holds heads of `head_dim` columns. In each head among the first `rope_width`
    columns (default: all), columns j and j + head_dim/2 (rotated together by rotate-half RoPE) move
    to columns 2j and 2j + 1; the other columns (e.g. the v heads of a fused QKV) stay in place.
    `w` is an [in, out] weight (for a torch Linear pass `q_proj.weight.T`), a bias, a norm weight
    repeated per head, or an activation. Raises ValueError if head_dim is odd or rope_width is not
    a multiple of head_dim that fits in the last axis.
    """
    perm = _rope_perm(_last_axis(w, "w"), head_dim, rope_width)
    if _torch_of(w) is not None:
        return _rope_views(w, head_dim, rope_width, inverse=False)
    return _permute(w, perm)


def _rope_views(x: Any, head_dim: int, rope_width: int | None, inverse: bool) -> Any:
    """interleave_rope (or, `inverse`, deinterleave_rope) of a torch tensor through views: each head
    of the first `rope_width` columns as [2, head_dim/2] (or [head_dim/2, 2]) transposed, the rest
    unchanged, in one new tensor. An index_select would copy the permutation to x's device first, on
    every call: a host-to-device copy, which a CUDA graph can't capture (the q/k norm weights are
    permuted in every forward)."""
    torch = _torch_of(x)
    rw = int(x.shape[-1]) if rope_width is None else rope_width
    half = head_dim // 2
    split = (rw // head_dim, half, 2) if inverse else (rw // head_dim, 2, half)
    heads = x[..., :rw].unflatten(-1, split).transpose(-1, -2).flatten(-3)
    return torch.cat([heads, x[..., rw:]], dim=-1) if rw < x.shape[-1] else heads.contiguous()


def deinterleave_rope(w: A, head_dim: int, rope_width: int | None = None) -> A:
    """The inverse of `interleave_rope` (e.g. to compare a block's `qkv` output with an unfused model)."""
    perm = _rope_perm(_last_axis(w, "w"), head_dim, rope_width)
    if _torch_of(w) is not None:
        return _rope_views(w, head_dim, rope_width, inverse=True)
    return _permute(w, np.argsort(perm))


def rope_freq(head_dim: int, rope_width: int, width: int, base: float = 10000.0) -> np.ndarray:
    """f32[width/2]: the RoPE inverse frequency of each column pair of the interleaved layout.

    Pair k holds columns (2k, 2k+1). For a pair inside the first `rope_width` columns, at index j
    within its head, the value is the usual inv_freq[j] = base ** (-2j / head_dim) (computed in
    float64, rounded once to f32); pairs beyond `rope_width` (v heads) get 0, so their angle is 0
    and the rotation leaves them unchanged. Multiply by the position to get the angle.
    """
    _check_even("width", width)
    _rope_perm(width, head_dim, rope_width)  # validates head_dim and rope_width
    half = head_dim // 2
    inv = base ** (-2.0 * np.arange(half, dtype=np.float64) / head_dim)
    out = np.zeros(width // 2, dtype=np.float64)
    out[: rope_width // 2] = np.tile(inv, rope_width // head_dim)
    return out.astype(np.float32)
