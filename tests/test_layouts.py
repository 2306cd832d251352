"""Layout copies (coda_lang/backend_triton/layouts.py): the fused QKV tile's gradient from dq, dk, dv
(hf.forward.Heads), and a paired stage's full-width tile from its two lanes.

- `join_heads`' Triton kernel under Triton's CPU interpreter, against torch's reference (the
  concatenation of the token-major transposes): per-head gradients in the attention backward's
  [B, H, S, D] layout, as transposed views of a token-major tensor, and a part given as None (zeros),
  with a sequence that is not a multiple of the kernel's block, two batches, GQA widths;
- `Heads` (the patch's q/k/v views) against autograd's split + transpose: the same views forward,
  the same gradient backward, on the CPU path;
- `interleave` under the interpreter against torch's stack, at sizes that are multiples of no block;
- `scale_round` under the interpreter against torch's mul of the same operands (f32 and bf16 inputs,
  an f32 or bf16 scale, a size that is a multiple of no block), and the patch's CPU path;
- `tied_grad` (a tied LM head + embedding's weight gradient) under the interpreter and on the patch's
  CPU path against float64: repeated ids, a padding id whose rows add nothing, ids never seen;
- on a GPU (marked `gpu`): the compiled kernels, through `Heads.backward` and directly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from coda_lang.hf.forward import Heads

pytest.importorskip("triton")

B, S, H, KV, HD = 2, 100, 4, 2, 16


def reference(grads: list[Any], hd: int = HD) -> torch.Tensor:
    parts = [
        (torch.zeros(B, n, S, hd) if g is None else g.float()).transpose(1, 2).reshape(B * S, n * hd)
        for g, n in zip(grads, (H, KV, KV), strict=True)
    ]
    return torch.cat(parts, dim=1)


def grads(layout: str, gen: torch.Generator, hd: int = HD) -> list[Any]:
    out: list[Any] = []
    for n in (H, KV, KV):
        if layout == "bhsd":
            g = torch.randn(B, n, S, hd, generator=gen)
        else:  # [B, S, H, D] memory seen as [B, H, S, D]
            g = torch.randn(B, S, n, hd, generator=gen).transpose(1, 2)
        out.append(g.bfloat16())
    return out


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("none", [None, 1])
@pytest.mark.parametrize("hd", [HD, 96])  # 96: Phi-3's, not a power of two (masked columns)
def test_join_heads_kernel_on_the_interpreter(layout: str, none: int | None, hd: int) -> None:
    from coda_lang.backend_triton import layouts

    gs = grads(layout, torch.Generator().manual_seed(3), hd)
    if none is not None:
        gs[none] = None
    out = torch.full((B * S, (H + 2 * KV) * hd), float("nan"), dtype=torch.bfloat16)
    assert layouts.supported(out, hd, interpret=True)
    parts = [(g, n, c) for g, n, c in zip(gs, (H, KV, KV), (0, H * hd, (H + KV) * hd), strict=True)]
    layouts.join_heads(out, parts, B, S, hd, interpret=True)
    torch.testing.assert_close(out.float(), reference(gs, hd), rtol=0, atol=0)


def test_join_heads_refuses_what_it_cant_take() -> None:
    from coda_lang.backend_triton import layouts

    out = torch.empty(4, 48, dtype=torch.bfloat16)
    assert not layouts.supported(out, 16)  # a CPU tensor, not interpreted
    assert not layouts.supported(out, 24, interpret=True)  # not a multiple of 16
    assert not layouts.supported(out, 8, interpret=True)  # below 16
    assert layouts.supported(out, 48, interpret=True)  # a multiple of 16, not a power of two
    assert not layouts.supported(out.t(), 16, interpret=True)  # not contiguous


def test_heads_views_and_gradient_match_autograds_split() -> None:
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(B * S, (H + 2 * KV) * HD, generator=gen).bfloat16()
    gs = grads("bhsd", gen)

    def split(x: Any) -> Any:
        qs, ks, vs = x.split([H * HD, KV * HD, KV * HD], dim=1)
        return tuple(t.view(B, S, -1, HD).transpose(1, 2) for t in (qs, ks, vs))

    x0 = qkv.clone().requires_grad_()
    x1 = qkv.clone().requires_grad_()
    want = split(x0)
    got = Heads.apply(x1, B, S, H, KV, HD)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
    torch.autograd.backward(want, gs)
    torch.autograd.backward(got, gs)
    assert torch.equal(x1.grad, x0.grad)
    # only q and k used: v's columns of the gradient are zeros
    x2 = qkv.clone().requires_grad_()
    q, k, _ = Heads.apply(x2, B, S, H, KV, HD)
    ((q.float() * gs[0].float()).sum() + (k.float() * gs[1].float()).sum()).backward()
    torch.testing.assert_close(x2.grad.float(), reference([gs[0], gs[1], None]), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_heads_backward_on_the_gpu(layout: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gs = [g.cuda() for g in grads(layout, torch.Generator().manual_seed(7))]
    x = torch.randn(B * S, (H + 2 * KV) * HD, device="cuda").bfloat16().requires_grad_()
    torch.autograd.backward(Heads.apply(x, B, S, H, KV, HD), gs)
    torch.testing.assert_close(x.grad.float().cpu(), reference([g.cpu() for g in gs]), rtol=0, atol=0)


@pytest.mark.parametrize("rows, n", [(37, 300), (1, 5), (16, 128)])
def test_interleave_on_the_interpreter(rows: int, n: int) -> None:
    from coda_lang.backend_triton import layouts

    gen = torch.Generator().manual_seed(rows + n)
    even = torch.randn(rows, n, generator=gen).bfloat16()
    odd = torch.randn(rows, n, generator=gen).bfloat16()
    got = layouts.interleave(even, odd, interpret=True)
    want = torch.stack((even, odd), dim=-1).reshape(rows, 2 * n)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert torch.equal(got[:, 0::2], even) and torch.equal(got[:, 1::2], odd)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_scale_round_on_the_interpreter(src_dtype: torch.dtype, scale_dtype: torch.dtype) -> None:
    from coda_lang.backend_triton import layouts
    from coda_lang.hf.loss import scale_round

    gen = torch.Generator().manual_seed(3)
    src = (torch.randn(37, 300, generator=gen) * 1e3).to(src_dtype)
    g = torch.tensor(0.37, dtype=scale_dtype)
    want = (src.float() * g.float()).bfloat16()
    got = layouts.scale_round(src, g.reshape(1), torch.bfloat16, interpret=True)
    assert got.dtype == torch.bfloat16 and got.shape == src.shape and torch.equal(got, want)
    assert torch.equal(scale_round(src, g, torch.bfloat16), want)  # the CPU path: torch's mul
    if src_dtype == torch.float32:  # (rounding the f32 total first, then scaling, differs)
        assert not torch.equal(want, (src.bfloat16() * g.bfloat16()))


@pytest.mark.parametrize("padding_idx", [None, 3])
def test_tied_grad_against_float64(padding_idx: int | None) -> None:
    from coda_lang.backend_triton import layouts
    from coda_lang.hf.loss import tied_grad

    gen = torch.Generator().manual_seed(5)
    V, D, T = 50, 40, 70  # D a multiple of no block; ids repeat, and some ids never occur
    total = torch.randn(V, D, generator=gen)
    ids = torch.randint(0, 20, (2, T // 2), generator=gen)
    ids[0, :4] = 3
    rows = torch.randn(T, D, generator=gen).bfloat16()
    g = torch.tensor(0.25)
    keep = (
        torch.ones(T, dtype=torch.float64)
        if padding_idx is None
        else (ids.reshape(-1) != padding_idx).double()
    )
    want = (total.double() * 0.25).index_add_(0, ids.reshape(-1), rows.double() * keep[:, None])
    assert padding_idx is None or torch.equal(want[3], total[3].double() * 0.25)  # (no rows at the pad)
    for got in (
        layouts.tied_grad(total, g.reshape(1), ids, rows, torch.float32, padding_idx, interpret=True),
        tied_grad(total, g, ids, rows, torch.float32, padding_idx),
    ):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    got = layouts.tied_grad(total, g.reshape(1), ids, rows, torch.bfloat16, padding_idx, interpret=True)
    assert got.dtype == torch.bfloat16
    # rounded once from the f32 sum: within half a bf16 step of the exact value (a step 2^-7 relative)
    assert ((got.double() - want).abs() <= want.abs() * 2.0**-8 * 1.0001).all()


@pytest.mark.gpu
def test_interleave_on_the_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from coda_lang.backend_triton import layouts

    even = torch.randn(8192 + 3, 1536, device="cuda").bfloat16()
    odd = torch.randn(8192 + 3, 1536, device="cuda").bfloat16()
    got = layouts.interleave(even, odd)
    assert torch.equal(got, torch.stack((even, odd), dim=-1).reshape(even.shape[0], -1))
    src = torch.randn(4096 + 7, 2048, device="cuda")
    g = torch.tensor(0.37, device="cuda")
    assert torch.equal(layouts.scale_round(src, g.reshape(1), torch.bfloat16), (src * g).bfloat16())
    ids = torch.randint(0, 1000, (1, 4096), device="cuda")
    rows = torch.randn(4096, 2048, device="cuda").bfloat16()
    want = (src[:1000] * g).index_add_(0, ids[0], rows.float())
    got = layouts.tied_grad(src[:1000], g.reshape(1), ids, rows, torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _every_fp8_code(dtype: torch.dtype) -> torch.Tensor:
    """Every byte as an fp8 value of `dtype` (NaNs, infinities, subnormals, +-0 among them), each of the
    256 codes in a column of 37 rows."""
    return torch.arange(256, dtype=torch.uint8).repeat(37).view(dtype).reshape(37, 256)


@pytest.mark.parametrize("src", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_widen_on_the_interpreter(src: torch.dtype, dtype: torch.dtype) -> None:
    """fp8 widened to bf16, f16 or f32 is torch's cast of every finite code (exact). (Triton's CPU
    interpreter reads e4m3's NaN codes as +-480 and e5m2's inf and NaN codes as finite numbers past
    57344, which the GPU's conversion does not: every code is checked there, below.)"""
    from coda_lang.backend_triton import layouts

    x = _every_fp8_code(src)
    x = x[:, x[0].float().isfinite()]
    got, want = layouts.widen(x, dtype, interpret=True), x.to(dtype)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert torch.equal(got.float().signbit(), want.float().signbit())


@pytest.mark.gpu
def test_widen_on_the_gpu() -> None:
    """The same on the GPU, at a size of many programs, and through the runtime's `dense` (the fp8
    operand a backward multiplies in bf16)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from coda_lang.backend_cute.runtime.launch import dense

    for src in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = _every_fp8_code(src).repeat(300, 3).cuda()
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            got, want = dense(x, dtype), x.to(dtype)
            assert got.is_contiguous() and got.dtype == dtype
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("shape", [(1, 1), (64, 64), (100, 37), (130, 257)])
@pytest.mark.parametrize("pad", [0, 16])
def test_transposed_on_the_interpreter(shape: tuple[int, int], pad: int) -> None:
    """An fp8 tensor's transpose, contiguous, with columns past its rows zero to `width` (the next
    multiple of 16 here when padded): every byte as torch's transpose (every code, NaN included,
    moved as bytes), at sizes that are multiples of no block."""
    from coda_lang.backend_triton import layouts

    r, c = shape
    codes = torch.arange(r * c, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(r, c)
    x = codes.view(torch.float8_e5m2)
    width = -(-r // pad) * pad if pad else r
    got = layouts.transposed(x, width, interpret=True)
    assert got.dtype == x.dtype and got.shape == (c, width) and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8)[:, :r], codes.t())
    assert not got.view(torch.uint8)[:, r:].any()


@pytest.mark.gpu
def test_transposed_on_the_gpu() -> None:
    """The same on the GPU at a size of many programs, through the runtime's `kmajor_pair` (a weight
    gradient's two operands, K = the tokens padded to 16)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from coda_lang.backend_cute.runtime.launch import kmajor_pair

    g = torch.Generator(device="cuda").manual_seed(0)
    m, n, k = 1000, 520, 2056
    a = torch.randint(0, 256, (m, n), dtype=torch.uint8, device="cuda", generator=g).view(torch.float8_e4m3fn)
    b = torch.randint(0, 256, (m, k), dtype=torch.uint8, device="cuda", generator=g).view(torch.float8_e5m2)
    A, B = kmajor_pair(a, b, True, True)
    assert A.shape == (n, 1008) and B.shape == (k, 1008)
    assert torch.equal(A.view(torch.uint8)[:, :m], a.view(torch.uint8).t())
    assert torch.equal(B.view(torch.uint8)[:, :m], b.view(torch.uint8).t())
    assert not A.view(torch.uint8)[:, m:].any() and not B.view(torch.uint8)[:, m:].any()
