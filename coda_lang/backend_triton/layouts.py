"""Layout copies as Triton kernels: a fused QKV tile's gradient from per-head gradients, a tile
from its two lanes, a scaled, rounded copy, and a tied embedding's gradient.

What it does: `join_heads(out, parts)` writes per-head tensors g[b, h, s, :] ([batch, heads, seq,
head_dim], any strides with a unit last one: what an attention backward gives for dq, dk, dv) into
their columns of one token-major [batch * seq, width] tile: out[b * seq + s, col + h * head_dim + d].
Each program moves a block of 64 positions of one head: a read and a write of 128-byte rows, where
torch's strided copy of the transposed view ran at a tenth of the memory bandwidth.
`interleave(even, odd)` makes the [rows, 2 n] tile whose even columns are `even` and odd ones `odd`
(a paired stage's second full-width tile, stored by the kernel as two lanes): torch's stack of the
two along a new last axis is a strided concatenation at a quarter of the bandwidth.
`scale_round(src, scale, dtype)` is src * scale rounded to dtype in one pass, the scale read from
the GPU (a loss head's f32 weight-gradient total times the incoming gradient: torch's mixed-dtype
`mul(out=)` runs unvectorized at a third of the bandwidth, and a multiply then a cast is two passes).
`tied_grad(total, scale, ids, rows, dtype)` is a tied LM head + embedding weight's gradient in one
pass over the [V, D] weight: the head's f32 total times the scale, plus the embedding's rows of each
token whose id is that row's, summed in f32 and rounded once (torch fills a dense [V, D] embedding
gradient with zeros, scatters into it and adds it to the head's: three passes).
A head dim that is not a power of two (a multiple of 16: Phi-3's 96) is moved as a block of the
next power of two's columns, the columns beyond it masked (not read or written).
`widen(src, dtype)` is an fp8 tensor in bf16, f16 or f32 (exact) in one vectorized pass.
`transposed(src, width)` is a one-byte tensor's transpose, contiguous, zero-padded to `width` columns:
the K-major copy of an fp8 operand that a derived backward's fp8 GEMM reads. `narrowed(src, dtype)`
rounds a 16-bit tensor to fp8 (a packed stage's fp8 D, which the kernel stores in bf16 or f16);
`narrowed_with_kmajor(src, dtype, width)` does that and writes the result's K-major copy too, from
the same tiles (a cotangent that a data gradient reads as it is and a weight gradient transposed).
What it does not: convert dtypes (but `scale_round`, `widen` and `tied_grad`), transpose anything but one-byte tensors, or take head dims below 16
or not a multiple of 16, or tensors on the CPU (`supported` says; the callers copy with torch there).
Invariants: every element of each part's columns is written once; a part given as None is zeroed;
`interleave` writes every element of its result once and keeps the lanes' dtype; `scale_round`
multiplies in f32 and rounds once, as torch's `mul` of the same operands; `tied_grad` rounds each
element once, after adding every row of its id (none for the padding id).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from coda_lang.backend_triton.generate import _jit
from coda_lang.backend_triton.launcher import launch

BLOCK_S = 64  # positions per program


def _join_kernel(
    src, out, S, sb, sh, ss, out_row, col0, HD: tl.constexpr, HDP: tl.constexpr, BS: tl.constexpr
):
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    s = pid * BS + tl.arange(0, BS)[:, None]
    d = tl.arange(0, HDP)[None, :]  # HDP: HD rounded up to a power of two (Phi-3's 96: 128)
    m = (s < S) & (d < HD)
    b64 = b.to(tl.int64)
    x = tl.load(src + b64 * sb + h.to(tl.int64) * sh + s.to(tl.int64) * ss + d, mask=m)
    tl.store(out + (b64 * S + s) * out_row + col0 + h * HD + d, x, mask=m)


def _interleave_kernel(even, odd, out, R, N, BM: tl.constexpr, BN: tl.constexpr):
    r = tl.program_id(0) * BM + tl.arange(0, BM)[:, None]
    c = tl.program_id(1) * BN + tl.arange(0, BN)[None, :]
    m = (r < R) & (c < N)
    at = r.to(tl.int64) * N + c
    e = tl.load(even + at, mask=m)
    o = tl.load(odd + at, mask=m)
    # [BM, BN, 2] -> [BM, 2 BN]: e0 o0 e1 o1 ... (tl.interleave is a jitted helper, which the CPU
    # interpreter can only call when interpretation was on from import)
    both = tl.reshape(tl.join(e, o), (BM, 2 * BN))
    r2 = tl.program_id(0) * BM + tl.arange(0, BM)[:, None]
    c2 = 2 * tl.program_id(1) * BN + tl.arange(0, 2 * BN)[None, :]
    tl.store(out + r2.to(tl.int64) * (2 * N) + c2, both, mask=(r2 < R) & (c2 < 2 * N))


def _scale_kernel(src, scale, out, n, BLOCK: tl.constexpr, RNE_BF16: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(src + i, mask=m).to(tl.float32) * tl.load(scale).to(tl.float32)
    if RNE_BF16:  # the CPU interpreter's f32 -> bf16 truncates: round the bits to nearest even first
        b = x.to(tl.uint32, bitcast=True)
        x = tl.where(x != x, x, ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True))
    tl.store(out + i, x.to(out.dtype.element_ty), mask=m)


def _convert_kernel(src, out, n, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(out + i, tl.load(src + i, mask=m).to(tl.float32).to(out.dtype.element_ty), mask=m)


def _narrow_t_kernel(src, out, out_t, R, C, W, BR: tl.constexpr, BC: tl.constexpr):
    # out[r, c] = src[r, c] in out's dtype (nearest even), and out_t[c, r] the same, 0 for R <= r < W
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    at = r[:, None].to(tl.int64) * C + c[None, :]
    m = (r[:, None] < R) & (c[None, :] < C)
    x = tl.load(src + at, mask=m, other=0).to(tl.float32).to(out.dtype.element_ty)
    tl.store(out + at, x, mask=m)
    tl.store(
        out_t + c[:, None].to(tl.int64) * W + r[None, :],
        tl.trans(x),
        mask=(c[:, None] < C) & (r[None, :] < W),
    )


def _transpose_kernel(src, out, R, C, W, BR: tl.constexpr, BC: tl.constexpr):
    # out[c, r] = src[r, c] for r < R, 0 for R <= r < W (bytes: any one-byte dtype)
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    x = tl.load(
        src + r[:, None].to(tl.int64) * C + c[None, :], mask=(r[:, None] < R) & (c[None, :] < C), other=0
    )
    tl.store(
        out + c[:, None].to(tl.int64) * W + r[None, :], tl.trans(x), mask=(c[:, None] < C) & (r[None, :] < W)
    )


def _tied_kernel(total, scale, perm, starts, rows, out, D, PAD, BD: tl.constexpr, RNE_BF16: tl.constexpr):
    v = tl.program_id(0)
    c = tl.program_id(1) * BD + tl.arange(0, BD)
    m = c < D
    v64 = v.to(tl.int64)
    acc = tl.load(total + v64 * D + c, mask=m).to(tl.float32) * tl.load(scale).to(tl.float32)
    lo = tl.load(starts + v).to(tl.int32)
    hi = tl.load(starts + v + 1).to(tl.int32)
    hi = tl.where(v == PAD, lo, hi)  # the padding id's rows get no gradient (torch's embedding)
    for k in range(lo, hi):  # the tokens of id v (ids sorted: perm[lo:hi])
        t = tl.load(perm + k).to(tl.int64)
        acc += tl.load(rows + t * D + c, mask=m).to(tl.float32)
    if RNE_BF16:  # as _scale_kernel
        b = acc.to(tl.uint32, bitcast=True)
        acc = tl.where(
            acc != acc, acc, ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        )
    tl.store(out + v64 * D + c, acc.to(out.dtype.element_ty), mask=m)


_kernels: dict[tuple[str, bool], Any] = {}
_FUNCTIONS = {
    "join": _join_kernel,
    "interleave": _interleave_kernel,
    "scale": _scale_kernel,
    "convert": _convert_kernel,
    "transpose": _transpose_kernel,
    "narrow_t": _narrow_t_kernel,
    "tied": _tied_kernel,
}


def _kernel(name: str, interpret: bool) -> Any:
    k = _kernels.get((name, interpret))
    if k is None:
        k = _kernels[(name, interpret)] = _jit(interpret)(_FUNCTIONS[name])
    return k


def interleave(even: torch.Tensor, odd: torch.Tensor, interpret: bool = False) -> torch.Tensor:
    """The [rows, 2 n] tile whose column 2 j is even[:, j] and 2 j + 1 is odd[:, j] (CUDA tensors, or
    any under the interpreter; launch.py stacks them with torch elsewhere)."""
    assert even.shape == odd.shape and even.dim() == 2 and even.dtype == odd.dtype
    assert interpret or even.device.type == "cuda"
    rows, n = even.shape
    even, odd = even.contiguous(), odd.contiguous()
    out = torch.empty((rows, 2 * n), dtype=even.dtype, device=even.device)
    if rows and n:
        bm, bn = 8, 128
        grid = (triton.cdiv(rows, bm), triton.cdiv(n, bn))
        launch(_kernel("interleave", interpret), grid, even, odd, out, rows, n, BM=bm, BN=bn)
    return out


def scale_round(
    src: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, interpret: bool = False
) -> torch.Tensor:
    """src * scale (a one-element tensor on src's device, not read back to the host), computed in f32
    and rounded to `dtype` (contiguous CUDA tensors, or any under the interpreter)."""
    assert interpret or src.device.type == "cuda"
    assert scale.numel() == 1 and scale.device == src.device
    src = src.contiguous()
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    n = src.numel()
    if n:
        block = 4096
        rne = interpret and dtype == torch.bfloat16
        launch(
            _kernel("scale", interpret),
            (triton.cdiv(n, block),),
            src,
            scale,
            out,
            n,
            BLOCK=block,
            RNE_BF16=rne,
        )
    return out


def widen(src: torch.Tensor, dtype: torch.dtype, interpret: bool = False) -> torch.Tensor:
    """An fp8 tensor in a wider float dtype (bf16, f16, f32: exact), in one vectorized pass (torch's
    cast from a one-byte dtype runs unvectorized, at about a third of the memory bandwidth: the fp8
    operands that a backward multiplies in bf16, H100)."""
    assert interpret or src.device.type == "cuda"
    return _converted(src, dtype, interpret)


def _converted(src: torch.Tensor, dtype: torch.dtype, interpret: bool) -> torch.Tensor:
    """src in `dtype`, contiguous, in one vectorized pass through f32 (`widen`, `narrowed`)."""
    src = src.contiguous()
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    n = src.numel()
    if n:
        block = 4096
        launch(_kernel("convert", interpret), (triton.cdiv(n, block),), src, out, n, BLOCK=block)
    return out


def transposed(src: torch.Tensor, width: int | None = None, interpret: bool = False) -> torch.Tensor:
    """The [C, width] transpose of a one-byte [R, C] tensor (an fp8 GEMM operand made K-major), contiguous,
    its columns R to `width` (default R) zeros, in one pass of 64 x 64 tiles: torch's copy of the
    transposed view moves one byte at a time."""
    assert interpret or src.device.type == "cuda"
    assert src.dim() == 2 and src.element_size() == 1
    R, C = src.shape
    width = R if width is None else width
    assert width >= R
    src = src.contiguous()
    out = torch.empty((C, width), dtype=src.dtype, device=src.device)
    if C and width:
        b = 64
        grid = (triton.cdiv(width, b), triton.cdiv(C, b))
        launch(
            _kernel("transpose", interpret),
            grid,
            src.view(torch.uint8),
            out.view(torch.uint8),
            R,
            C,
            width,
            BR=b,
            BC=b,
        )
    return out


def narrowed(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 16-bit CUDA tensor rounded to an fp8 dtype to nearest even in one pass (Triton's f32 -> fp8
    conversion, on sm_90 `cvt.rn.satfinite`): a packed stage's fp8 D, which the kernel stores in bf16
    or f16, rounded to odd and already clamped to the fp8 range (launch.py's `_narrow`)."""
    assert src.device.type == "cuda" and dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return _converted(src, dtype, False)


def narrowed_with_kmajor(
    src: torch.Tensor, dtype: torch.dtype, width: int | None = None, interpret: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`narrowed(src, dtype)` ([R, C]) and, from the same pass, its K-major copy for a GEMM that reads
    it transposed: the [C, width] transpose (`transposed(narrowed(src, dtype), width)`, columns R to
    `width` zeros), in 64 x 64 tiles. One read of src where `narrowed` then `transposed` read it and
    the narrowed copy again."""
    assert interpret or src.device.type == "cuda"
    assert dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and src.dim() == 2
    R, C = src.shape
    width = R if width is None else width
    assert width >= R
    src = src.contiguous()
    out = torch.empty((R, C), dtype=dtype, device=src.device)
    out_t = torch.empty((C, width), dtype=dtype, device=src.device)
    if C and width:
        b = 64
        grid = (triton.cdiv(width, b), triton.cdiv(C, b))
        launch(_kernel("narrow_t", interpret), grid, src, out, out_t, R, C, width, BR=b, BC=b)
    return out, out_t


def tied_grad(
    total: torch.Tensor,
    scale: torch.Tensor,
    ids: torch.Tensor,
    rows: torch.Tensor,
    dtype: torch.dtype,
    padding_idx: int | None = None,
    interpret: bool = False,
) -> torch.Tensor:
    """total * scale + the sum of rows[i] over the tokens i with ids[i] == v, in each row v of the
    [V, D] result (`total`: [V, D]; `scale`: one element on the device; `ids`: the token ids, any
    shape; `rows`: [tokens, D]), summed in f32 and rounded to `dtype`; rows of `padding_idx` add
    nothing. Nothing is read back to the host."""
    assert interpret or total.device.type == "cuda"
    assert scale.numel() == 1 and total.dim() == 2 and rows.dim() == 2 and rows.shape[1] == total.shape[1]
    V, D = total.shape
    ids = ids.reshape(-1)
    assert ids.numel() == rows.shape[0]
    total, rows = total.contiguous(), rows.contiguous()
    ordered, perm = torch.sort(ids)
    starts = torch.searchsorted(ordered, torch.arange(V + 1, device=ids.device, dtype=ordered.dtype))
    out = torch.empty((V, D), dtype=dtype, device=total.device)
    if V and D:
        bd = min(1024, triton.next_power_of_2(D))
        pad = -1 if padding_idx is None else int(padding_idx) % V
        rne = interpret and dtype == torch.bfloat16
        launch(
            _kernel("tied", interpret),
            (V, triton.cdiv(D, bd)),
            total,
            scale,
            perm,
            starts,
            rows,
            out,
            D,
            pad,
            BD=bd,
            RNE_BF16=rne,
        )
    return out


def supported(out: torch.Tensor, head_dim: int, interpret: bool = False) -> bool:
    """Whether `join_heads` takes this output tile and head dim."""
    return (
        (interpret or out.device.type == "cuda")
        and head_dim >= 16
        and head_dim % 16 == 0
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
    k = _kernel("join", interpret)
    for g, heads, col in parts:
        if g is None:
            out[:, col : col + heads * head_dim].zero_()
            continue
        assert tuple(g.shape) == (batch, heads, seq, head_dim) and g.dtype == out.dtype
        if g.stride(3) != 1:
            g = g.contiguous()
        grid = (triton.cdiv(seq, BLOCK_S), heads, batch)
        launch(
            k,
            grid,
            g,
            out,
            seq,
            g.stride(0),
            g.stride(1),
            g.stride(2),
            out.stride(0),
            col,
            HD=head_dim,
            HDP=triton.next_power_of_2(head_dim),
            BS=BLOCK_S,
        )
