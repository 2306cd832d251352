"""peft LoRA under the patch: each LoRA projection's GEMM runs over a K widened by the adapters' ranks.

What it does: where peft LoRA layers stand at projections (checks.py: `is_lora`, and `check_lora` at
patching: plain LoRA on an `nn.Linear` base), a block is cut before each GEMM whose weight has active
adapters (split.py), and that GEMM's epilogue adds the adapters' output c = s (x A^T) B^T to its f32
accumulator before anything else reads it: x W^T + s (x A^T) B^T, peft's `lora.Linear.forward`, with
the epilogue (RoPE, SwiGLU, the residual add, the next norm) on the adapted output. `correction`
makes c ([tokens, out], two GEMMs of K = tokens' width and the ranks summed); the block's derived
backward gives dc, the cotangent of the accumulator, from which autograd gives dA and dB (two thin
GEMMs), and it makes no gradient of a frozen base weight (forward.py: such a weight is not
differentiated), so a LoRA step does no weight-gradient GEMM of the base.
`Spec` says which LoRA layers feed one fused weight (`linear`, `qkv`, `gate_up`: None without active
adapters). The base layer of a LoRA layer whose base
weight patching fused is checkpoint.py's `FusedPart`, through which peft's merge and unmerge change
the fused weight; `active(m)` follows peft: no adapter while adapters are disabled (unmerging first,
as peft does) or merged (the base weight holds them).
What it does not: run a block, fuse or move weights (checkpoint.py), or refuse anything else
(checks.py).
Invariants: the base weight is read as it is (never W + s B A rounded to the weights' dtype, which
loses an update smaller than half of W's spacing), and c joins x W^T in f32, inside the GEMM's
epilogue (peft's bf16 forward rounds x W^T to bf16 first, and loses a c below half its spacing).
Each adapter reads its own dropout of x (`lora_dropout`), as peft's does.
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


def correction(x: torch.Tensor, spec: Spec) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
    """sum_a s_a (drop_a(x) A_a^T) B_a^T in the fused weight's row layout, [tokens, out] in x's
    dtype: what the adapters add to x W^T; and a function that makes it again (without autograd) from
    the thin factors, so that the block's backward need not hold it (`kept`). One GEMM makes every
    adapter's x A^T when none drops anything, then one GEMM of K = the ranks summed multiplies it by
    the adapters' s B (zero in the rows of a part without an adapter); autograd gives dA and dB from
    the cotangent of the sum."""
    As, drops, bs, owner, scales = [], [], [], [], []
    for i, m, a in spec.adapters:
        As.append(m.lora_A[a].weight)
        drops.append(_dropout(m, a))
        bs.append(m.lora_B[a].weight)
        scales.append(m.scaling[a])
        owner.append(i)
    # (few launches: the host, not the GPU, bounds a LoRA step's time)
    one = len(set(scales)) == 1
    if not one:
        bs = [b * sc for b, sc in zip(bs, scales, strict=True)]
    if all(d is None for d in drops):
        u = x @ (As[0] if len(As) == 1 else torch.cat(As, 0)).to(x.dtype).t()
    else:
        u = torch.cat(
            [(x if d is None else d(x)) @ A.to(x.dtype).t() for A, d in zip(As, drops, strict=True)], 1
        )
    if len(set(owner)) == len(owner):  # (one adapter per part: each part's rows hold its s B, as a block)
        by_part = dict(zip(owner, bs, strict=True))
        diag = torch.block_diag(
            *[by_part.get(i, bs[0].new_zeros(rows, 0)) for i, rows in enumerate(spec.rows)]
        )
        fused = spec.fuse([diag])  # (one part: the fused layout of the rows stacked)
    else:  # each part's rows hold its adapters' s B in their columns, zeros elsewhere
        fused = spec.fuse(
            [
                torch.cat(
                    [b if j == i else b.new_zeros(rows, b.shape[1]) for j, b in zip(owner, bs, strict=True)],
                    1,
                )
                for i, rows in enumerate(spec.rows)
            ]
        )
    fused = (fused * scales[0] if one else fused).to(x.dtype)

    kind = x.device.type
    cast = torch.is_autocast_enabled(kind)
    cast_dtype = torch.get_autocast_dtype(kind) if cast else None

    def again() -> torch.Tensor:  # (as the forward made it: under its autocast, if any)
        with torch.no_grad(), torch.autocast(kind, dtype=cast_dtype, enabled=cast):
            return u @ fused.t()

    return u @ fused.t(), again


class kept:
    """Within it, a tensor `c` that autograd would save for a backward is saved as the way to make it
    again (`again`): the LoRA output a block reads, [tokens, out], is not held from the forward to the
    backward (its factors are: x A^T, [tokens, ranks], and s B). Every other tensor is saved by the
    hooks around it, if any (activation checkpointing's: a checkpointed layer keeps nothing)."""

    def __init__(self, c: torch.Tensor, again: Callable[[], torch.Tensor]):
        self.key = (c.data_ptr(), c.shape, c.dtype)
        self.again = again
        self.outer: Any = None

    def pack(self, t: torch.Tensor) -> Any:
        if (t.data_ptr(), t.shape, t.dtype) == self.key:
            return self
        return t if self.outer is None else _Outer(self.outer[0](t))

    def unpack(self, p: Any) -> torch.Tensor:
        if p is self:
            return self.again()
        return self.outer[1](p.packed) if isinstance(p, _Outer) else p

    def __enter__(self) -> None:
        # (the hooks this one sits in: torch gives only the innermost pair a tensor to save)
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        self._hooks.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


class _Outer:
    """What the outer hooks made of a saved tensor (`kept.pack`)."""

    __slots__ = ("packed",)

    def __init__(self, packed: Any):
        self.packed = packed
