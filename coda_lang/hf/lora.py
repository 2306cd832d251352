"""peft LoRA under the patch: the blocks run each projection's effective weight W + s (B A).

What it does: the weights a block reads where peft LoRA layers stand at projections (checks.py:
`is_lora`, and `check_lora` at patching: plain LoRA on an `nn.Linear` base). The base layer of a
LoRA layer whose base weight patching fused is checkpoint.py's `FusedPart`, through which peft's
merge and unmerge change the fused weight. `delta(m)` is the sum over m's active adapters of s_a (B_a A_a), or None, following peft's
`lora.Linear.forward`: none while adapters are disabled (after unmerging, as peft does) or merged
(the base weight holds them). `linear_weight`, `qkv_weight`, `gate_up_weight` give the weights a
block reads: the parameter itself without adapters, else the base plus the deltas as differentiable
torch ops (q and k rows in the interleaved RoPE layout, gate and up rows interleaved, as the fused
parameters are; for Phi-3's fused `qkv_proj` and `gate_up_proj` one delta over all their rows), so the block's weight gradient flows to A and B (and to the base only if it is
trainable).
What it does not: run a block, fuse or move weights (checkpoint.py), or refuse anything else
(checks.py).
Invariants: the effective weight of a layer is peft's: its forward x W^T + s (x A^T) B^T is x (W + s
B A)^T. Dropout on the adapter's input is a different input per adapter, which one weight can't
express: a LoRA dropout > 0 in training mode is refused at the forward (in eval mode dropout is the
identity, and is honoured).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from coda_lang.hf.checkpoint import gate_up_fused, qkv_fused
from coda_lang.hf.checks import is_lora, refuse


def delta(m: Any, sharded_ok: bool = True) -> torch.Tensor | None:
    """s_a (B_a A_a) summed over the active adapters of LoRA layer `m`, [out, in] in Hugging Face's
    layout, or None: as peft's `lora.Linear.forward` (none while disabled, unmerging first as it
    does; none while merged: the base weight holds them)."""
    if m.disable_adapters:
        if m.merged:
            m.unmerge()
        return None
    if m.merged:
        return None
    on_cuda = any(m.lora_A[a].weight.is_cuda for a in m.active_adapters if a in m.lora_A)
    if on_cuda and not os.environ.get("CODA_LORA_CUDA"):
        raise refuse(
            "peft LoRA adapters on a CUDA model",
            "the adapters run in the blocks' CUDA kernels, which are not yet checked against peft there "
            "(a Llama-3.2-1B benchmark's loss drifted from peft's by 0.014 after 7 steps, where the same "
            "code on the CPU matches it); refused rather than trained differently",
            "train the LoRA model unpatched (or with Liger Kernel) for now; merged adapters "
            "(merge_adapter()) and the CPU run as peft does; CODA_LORA_CUDA=1 lifts this for testing",
        )
    out = None
    for a in m.active_adapters:
        if a not in m.lora_A:
            continue
        drop = m.lora_dropout[a]
        if isinstance(drop, torch.nn.Dropout) and drop.training and drop.p > 0:
            raise refuse(
                f"lora_dropout={drop.p} (adapter {a!r}) in training mode",
                "the patched forward runs each LoRA projection as one weight W + s B A, and dropout on the "
                "adapter's input (a different input than the base weight's) can't be one weight",
                "use lora_dropout=0 (common for LLM fine-tuning), or train it unpatched",
            )
        wa, wb = m.lora_A[a].weight, m.lora_B[a].weight
        dt = None if sharded_ok else sys.modules.get("torch.distributed.tensor")
        if dt is not None and (isinstance(wa, dt.DTensor) or isinstance(wb, dt.DTensor)):
            raise refuse(
                f"the LoRA weights of a q, k or v projection are DTensors (adapter {a!r})",
                "layer i's QKV is made by layer i-1's block (or the root's), and its adapters stay in "
                "layer i, whose FSDP2 unit is not gathered then",
                "shard the root only (fully_shard(model)), use DDP, or put LoRA on o, gate, up and down only",
            )
        d = (wb @ wa) * m.scaling[a]
        out = d if out is None else out + d
    return out


def linear_weight(m: Any) -> torch.Tensor:
    """The weight a block reads for projection `m` (o_proj, down_proj)."""
    if not is_lora(m):
        return m.weight
    w = m.base_layer.weight
    d = delta(m)
    return w if d is None else w + d.to(w.dtype)


def qkv_weight(fused: Any) -> torch.Tensor:
    """The fused QKV weight a block reads: `qkv_weight`, plus the LoRA deltas of its parts (q, k and v,
    or Phi-3's whole `qkv_proj`: the LoRA layers the FusedQKV reaches, `loras`) in the fused layout."""
    w = fused.qkv_weight
    loras = fused.__dict__.get("loras", ())
    if not any(loras):
        return w
    ds = [None if m is None else delta(m, sharded_ok=False) for m in loras]
    if all(d is None for d in ds):
        return w
    n = w.shape[0]
    rows = [n] if len(ds) == 1 else [fused.nq, fused.nk, n - fused.nq - fused.nk]
    parts = [
        w.new_zeros(r, w.shape[1]) if d is None else d.to(w.dtype) for d, r in zip(ds, rows, strict=True)
    ]
    return w + qkv_fused(parts, fused)


def gate_up_weight(mlp: Any) -> torch.Tensor:
    """The fused gate/up weight a block reads: `gate_up_weight`, plus the LoRA deltas of gate and up
    (or Phi-3's whole `gate_up_proj`) in the fused layout (rows interleaved)."""
    w = mlp.gate_up_weight
    mods = mlp._modules
    names = mlp._coda_names
    ds = [None if mods.get(n) is None else delta(mods[n]) for n in names]
    if all(d is None for d in ds):
        return w
    rows = w.shape[0] // len(names)
    parts = [w.new_zeros(rows, w.shape[1]) if d is None else d.to(w.dtype) for d in ds]
    return w + gate_up_fused(parts)
