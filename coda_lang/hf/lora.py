"""peft LoRA under the patch: each LoRA projection's GEMM runs over a K widened by the adapters' ranks.

What it does: where peft LoRA layers stand at projections (checks.py: `is_lora`, and `check_lora` at
patching: plain LoRA on an `nn.Linear` base), a block is cut before each GEMM whose weight has active
adapters (split.py), and that GEMM reads [x, u] and [W, B'] instead of x and W: u = x A^T (the
adapters' A stacked, [tokens, R]), B' the adapters' s_a B_a in W's fused row layout, zero in the rows
of a part without an adapter ([out, R]). Then x W^T + s (x A^T) B^T, peft's `lora.Linear.forward`,
is one GEMM whose epilogue (RoPE, SwiGLU, the residual add, the next norm) sees the adapted output,
and the block's derived backward gives d[x, u] and d[W, B'], from which autograd gives dA and dB.
`Spec` says which LoRA layers feed one fused weight (`linear`, `qkv`, `gate_up`: None without active
adapters); `widen(x, w, spec)` gives the GEMM's operands. The base layer of a LoRA layer whose base
weight patching fused is checkpoint.py's `FusedPart`, through which peft's merge and unmerge change
the fused weight; `active(m)` follows peft: no adapter while adapters are disabled (unmerging first,
as peft does) or merged (the base weight holds them).
What it does not: run a block, fuse or move weights (checkpoint.py), or refuse anything else
(checks.py).
Invariants: the base weight is read as it is (never W + s B A rounded to the weights' dtype, which
loses an update smaller than half of W's spacing: the adapter's contribution is computed apart from
W's, as peft's is). Each adapter reads its own dropout of x (`lora_dropout`), as peft's does; without
dropout one GEMM makes every adapter's u (`Widen`, which keeps only [x, u] for its backward).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from coda_lang.hf.checkpoint import gate_up_fused, qkv_fused
from coda_lang.hf.checks import is_lora, refuse


def active(m: Any, sharded_ok: bool = True) -> list[str]:
    """The adapters of LoRA layer `m` that its forward adds, as peft's `lora.Linear.forward`: none
    while disabled (unmerging first, as it does) or merged (the base weight holds them)."""
    if m.disable_adapters:
        if m.merged:
            m.unmerge()
        return []
    if m.merged:
        return []
    out = [a for a in m.active_adapters if a in m.lora_A]
    dt = None if sharded_ok else sys.modules.get("torch.distributed.tensor")
    for a in out:
        wa, wb = m.lora_A[a].weight, m.lora_B[a].weight
        if dt is not None and (isinstance(wa, dt.DTensor) or isinstance(wb, dt.DTensor)):
            raise refuse(
                f"the LoRA weights of a q, k or v projection are DTensors (adapter {a!r})",
                "layer i's QKV is made by layer i-1's block (or the root's), and its adapters stay in "
                "layer i, whose FSDP2 unit is not gathered then",
                "shard the root only (fully_shard(model)), use DDP, or put LoRA on o, gate, up and down only",
            )
    return out


@dataclass
class Spec:
    """The LoRA layers of one fused weight: `parts` (a LoRA layer or None per part, in the checkpoint's
    order), `rows` (each part's rows) and `fuse` (the parts' rows, each [rows_i, C], in the fused
    weight's row layout, [out, C]); `adapters` the (part, LoRA layer, adapter) that are active."""

    parts: tuple[Any, ...]
    rows: tuple[int, ...]
    fuse: Callable[[list[torch.Tensor]], torch.Tensor]
    adapters: tuple[tuple[int, Any, str], ...]


def _spec(
    parts: list[Any],
    rows: list[int],
    fuse: Callable[[list[torch.Tensor]], torch.Tensor],
    sharded_ok: bool = True,
) -> Spec | None:
    adapters = tuple((i, m, a) for i, m in enumerate(parts) if m is not None for a in active(m, sharded_ok))
    return Spec(tuple(parts), tuple(rows), fuse, adapters) if adapters else None


def linear(m: Any, out: int) -> Spec | None:
    """The LoRA of projection `m` (o_proj, down_proj; `out` rows), or None."""
    if not is_lora(m):
        return None
    return _spec([m], [out], lambda ps: ps[0])


def qkv(fused: Any) -> Spec | None:
    """The LoRA of the fused QKV weight: its parts' LoRA layers (q, k and v, or Phi-3's whole
    `qkv_proj`: the LoRA layers the FusedQKV reaches, `loras`) in the fused layout, or None."""
    loras = fused.__dict__.get("loras", ())
    if not any(loras):
        return None
    n = fused.qkv_weight.shape[0]
    rows = [n] if len(loras) == 1 else [fused.nq, fused.nk, n - fused.nq - fused.nk]
    return _spec(list(loras), rows, lambda ps: qkv_fused(ps, fused), sharded_ok=False)


def gate_up(mlp: Any) -> Spec | None:
    """The LoRA of the fused gate/up weight (gate and up, or Phi-3's whole `gate_up_proj`; rows
    interleaved in the fused layout), or None."""
    names = mlp._coda_names
    mods = [mlp._modules.get(n) for n in names]
    if not any(m is not None and is_lora(m) for m in mods):
        return None
    n = mlp.gate_up_weight.shape[0] // len(names)
    return _spec([m if m is not None and is_lora(m) else None for m in mods], [n] * len(names), gate_up_fused)


def _dropout(m: Any, a: str) -> torch.nn.Module | None:
    """Adapter `a`'s dropout module of `m` when it drops anything (training mode, p > 0), else None."""
    drop = m.lora_dropout[a]
    if isinstance(drop, torch.nn.Identity) or not drop.training:
        return None
    if isinstance(drop, torch.nn.Dropout):
        return drop if drop.p > 0 else None
    return drop


class Widen(torch.autograd.Function):
    """[x, x A^T] (A: the adapters' A stacked, [R, K]; the product in x's dtype), saving only the
    result for the backward (x is its first K columns): dx = dy[:, :K] + du A, dA = du^T x."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        k = x.shape[1]
        out = x.new_empty(x.shape[0], k + a.shape[0])
        out[:, :k] = x
        out[:, k:] = x @ a.to(x.dtype).t()
        ctx.save_for_backward(out, a)
        ctx.k = k
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, Any]:
        out, a = ctx.saved_tensors
        k = ctx.k
        x, du = out[:, :k], dy[:, k:]
        dx = da = None
        if ctx.needs_input_grad[0]:
            dx = dy[:, :k] + du @ a.to(dy.dtype)
        if ctx.needs_input_grad[1]:
            da = (du.t() @ x).to(a.dtype)
        return dx, da


def widen(x: torch.Tensor, w: torch.Tensor, spec: Spec) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands of the GEMM x W^T + sum_a s_a (drop_a(x) A_a^T) B_a^T over a widened K: [x, u] and
    [W, B'] (u [tokens, R], B' [out, R] in W's fused row layout), R the adapters' ranks summed,
    padded to a multiple of 8 (16-byte rows for the kernels' loads)."""
    As, drops, cols = [], [], []
    for i, m, a in spec.adapters:
        As.append(m.lora_A[a].weight)
        drops.append(_dropout(m, a))
        cols.append((i, m.lora_B[a].weight * m.scaling[a]))
    r = sum(t.shape[0] for t in As)
    pad = -r % 8
    if all(d is None for d in drops):
        a_all = torch.cat(As + ([As[0].new_zeros(pad, As[0].shape[1])] if pad else []), 0)
        xw = Widen.apply(x, a_all)
    else:
        us = [(x if d is None else d(x)) @ A.to(x.dtype).t() for A, d in zip(As, drops, strict=True)]
        if pad:
            us.append(x.new_zeros(x.shape[0], pad))
        xw = torch.cat([x, *us], 1)
    # B': each part's rows hold its adapters' s B in their columns, zeros elsewhere
    blocks = []
    for i, rows in enumerate(spec.rows):
        cs = [b.to(w.dtype) if j == i else w.new_zeros(rows, b.shape[1]) for j, b in cols]
        if pad:
            cs.append(w.new_zeros(rows, pad))
        blocks.append(torch.cat(cs, 1))
    return xw, torch.cat([w, spec.fuse(blocks)], 1)
