"""The gradient of a fused QKV tile from the attention's per-head gradients, in one Triton kernel.

What it does: `join_heads(out, parts)` writes per-head tensors g[b, h, s, :] ([batch, heads, seq,
head_dim], any strides with a unit last one: what an attention backward gives for dq, dk, dv) into
their columns of one token-major [batch * seq, width] tile: out[b * seq + s, col + h * head_dim + d].
Each program moves a block of 64 positions of one head: a read and a write of 128-byte rows, where
torch's strided copy of the transposed view ran at a tenth of the memory bandwidth.
What it does not: convert dtypes, or take head dims that are not a power of two or tensors on the CPU
(`supported` says; the caller copies with torch then).
Invariants: every element of each part's columns is written once; a part given as None is zeroed.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

BLOCK_S = 64  # positions per program


def _join_kernel(src, out, S, sb, sh, ss, out_row, col0, HD: tl.constexpr, BS: tl.constexpr):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    s = pid * BS + tl.arange(0, BS)[:, None]
    d = tl.arange(0, HD)[None, :]
    m = s < S
    b64 = b.to(tl.int64)
    x = tl.load(src + b64 * sb + h.to(tl.int64) * sh + s.to(tl.int64) * ss + d, mask=m)
    tl.store(out + (b64 * S + s) * out_row + col0 + h * HD + d, x, mask=m)


_kernels: dict[bool, Any] = {}


def _kernel(interpret: bool) -> Any:
    k = _kernels.get(interpret)
    if k is None:
        if interpret:
            from triton.runtime.interpreter import InterpretedFunction

            k = InterpretedFunction(_join_kernel)
        else:
            k = triton.jit(_join_kernel)
        _kernels[interpret] = k
    return k


def supported(out: torch.Tensor, head_dim: int, interpret: bool = False) -> bool:
    """Whether `join_heads` takes this output tile and head dim."""
    return (
        (interpret or out.device.type == "cuda")
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
        and out.dim() == 2
        and out.is_contiguous()
    )


def join_heads(
    out: torch.Tensor,
    parts: list[tuple[torch.Tensor | None, int, int]],
    batch: int,
    seq: int,
    head_dim: int,
    interpret: bool = False,
) -> None:
    """Write each (g, heads, col) of `parts`, g a [batch, heads, seq, head_dim] tensor or None (zeros),
    into out[:, col : col + heads * head_dim] (out: [batch * seq, width], contiguous)."""
    assert supported(out, head_dim, interpret)
    k = _kernel(interpret)
    for g, heads, col in parts:
        if g is None:
            out[:, col : col + heads * head_dim].zero_()
            continue
        assert tuple(g.shape) == (batch, heads, seq, head_dim) and g.dtype == out.dtype
        if g.stride(3) != 1:
            g = g.contiguous()
        grid = (triton.cdiv(seq, BLOCK_S), heads, batch)
        k[grid](
            g, out, seq, g.stride(0), g.stride(1), g.stride(2), out.stride(0), col, HD=head_dim, BS=BLOCK_S
        )
