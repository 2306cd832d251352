"""Independent torch references of the examples: the ordinary, unfused math, written as a model would.

Shared by tests/test_examples_torch.py (forward accuracy against bf16 and float64 torch) and
tests/test_autodiff.py (gradients against torch.autograd). Every function takes tensors in the
ordinary layouts (torch `nn.Linear` weights [out, in], gate and up separate, rotate-half RoPE heads)
and computes in the dtype of its inputs, so the same code runs in bfloat16, float32 and float64 and
is differentiable by torch.autograd. Nothing here knows about coda_lang's layouts or interpreter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS, BASE = 1e-6, 10000.0


def inv_freq(head_dim: int, base: float = BASE) -> torch.Tensor:
    """HF LLaMA's inv_freq, in f32."""
    return (base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)).float()


def rope(q: torch.Tensor, pos: torch.Tensor, head_dim: int, freq: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate-half RoPE on [M, H*head_dim] (HF LLaMA: f32 angles, cos/sin cast to q's dtype).

    `freq`: the inverse frequencies per head, [H, head_dim/2] (default: `inv_freq` for every head);
    a head whose frequencies are 0 is left as it is.
    """
    qh = q.reshape(q.shape[0], -1, head_dim)
    angle_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    if freq is None:
        ang = pos.to(angle_dtype)[:, None] * inv_freq(head_dim).to(angle_dtype)[None, :]
        emb = torch.cat([ang, ang], dim=-1)
        cos, sin = emb.cos().to(q.dtype)[:, None, :], emb.sin().to(q.dtype)[:, None, :]
    else:
        ang = pos.to(angle_dtype)[:, None, None] * freq.to(angle_dtype)[None, :, :]  # [M, H, half]
        emb = torch.cat([ang, ang], dim=-1)
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
    half = head_dim // 2
    rotated = torch.cat([-qh[..., half:], qh[..., :half]], dim=-1)
    return (qh * cos + rotated * sin).reshape(q.shape)


def rope_prefix(
    qkv: torch.Tensor, pos: torch.Tensor, head_dim: int, rope_width: int, freq: torch.Tensor | None = None
) -> torch.Tensor:
    """RoPE on the heads in the first `rope_width` columns (the q and k heads of a fused QKV); the
    rest (v) untouched."""
    return torch.cat([rope(qkv[:, :rope_width], pos, head_dim, freq), qkv[:, rope_width:]], dim=-1)


def llama_mlp(
    y: torch.Tensor,
    x: torch.Tensor,
    o_proj: torch.Tensor,
    norm: torch.Tensor,
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    eps: float = EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 = down(silu(gate(n)) * up(n)) + h, n = RMSNorm(h) * norm, h = o_proj(y) + x; returns (x2, h)."""
    h = F.linear(y, o_proj) + x
    n = F.rms_norm(h, (h.shape[-1],), norm, eps)
    a = F.silu(F.linear(n, gate_proj)) * F.linear(n, up_proj)
    return F.linear(a, down_proj) + h, h


def qkv_rope(
    xg: torch.Tensor,
    r: torch.Tensor,
    w_qkv: torch.Tensor,
    pos: torch.Tensor,
    head_dim: int,
    rope_width: int,
    freq: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE(RMSNorm(h) * g @ W_qkv) given xg = h * g and the row scale r = rstd(h)."""
    n = xg * r[:, None]
    return rope_prefix(F.linear(n, w_qkv), pos, head_dim, rope_width, freq)


def llama_block(
    y: torch.Tensor,
    x: torch.Tensor,
    o_proj: torch.Tensor,
    norm1: torch.Tensor,
    gate_proj: torch.Tensor,
    up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    norm2: torch.Tensor,
    w_qkv: torch.Tensor,
    pos: torch.Tensor,
    head_dim: int,
    rope_width: int,
    freq: torch.Tensor | None = None,
    eps: float = EPS,
) -> dict[str, torch.Tensor]:
    """The MLP half of a LLaMA layer, then the next layer's norm, QKV projection and RoPE."""
    x2, _ = llama_mlp(y, x, o_proj, norm1, gate_proj, up_proj, down_proj, eps)
    n2 = F.rms_norm(x2, (x2.shape[-1],), norm2, eps)
    return {"x2": x2, "qkv": rope_prefix(F.linear(n2, w_qkv), pos, head_dim, rope_width, freq)}


def qk_norm(
    x: torch.Tensor, w_q: torch.Tensor, gq: torch.Tensor, pos: torch.Tensor, head_dim: int, eps: float = EPS
) -> torch.Tensor:
    """Per-head RMSNorm of q = x @ w_q^T (weight gq shared by the heads), then RoPE."""
    m = x.shape[0]
    q = F.linear(x, w_q).reshape(m, -1, head_dim)
    q = F.rms_norm(q, (head_dim,), gq, eps).reshape(m, -1)
    return rope(q, pos, head_dim)


def lm_head_ce(
    hg: torch.Tensor, r: torch.Tensor, w_lm: torch.Tensor, target: torch.Tensor, upcast: bool = False
) -> dict[str, torch.Tensor]:
    """Cross-entropy per row (ignore_index -100) and log-sum-exp of the logits (hg * r) @ w_lm^T.
    `upcast`: the usual `logits.float()` of a low-precision model."""
    logits = F.linear(hg * r[:, None], w_lm)
    logits = logits.float() if upcast else logits
    return {
        "loss": F.cross_entropy(logits, target.long(), reduction="none", ignore_index=-100),
        "lse": torch.logsumexp(logits, dim=-1),
    }
