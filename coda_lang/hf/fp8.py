"""fp8 training of a patched model (`apply_coda(model, fp8="delayed")`): the delayed per-tensor scales
of each block's e4m3 inputs and weights, kept across steps.

What it does: `run_scaled(owner, step, index, name, inputs, loras)` runs block `name` (blocks.py's fp8
variant: its gate/up, down and QKV GEMMs in e4m3) with this step's scales and records the amaxes it
returns. Each call site (the model's first block; each decoder layer's block) keeps one
`DelayedScaling` (`owner._coda_fp8`), whose rule sets each scale from the amaxes of the last `HISTORY`
steps: scale = 448 / max(amaxes) (backend_cute/runtime/grad_scales.py; a scale stays as it was where
the amax is 0 or not finite). The first call calibrates: it runs the block once without autograd at
scales 1 and sets the scales from that run's amaxes (current scaling for the first step), so that no
step runs at a default scale. A forward run again by activation checkpointing (the same decoder
layer in the same `Step`) runs at the scales its first run used and records nothing, so the
recomputed tensors are the ones the first run saved.
What it does not: quantize anything itself (the blocks do), save the scales in the model's
state_dict (a model loaded from a checkpoint calibrates again at its first step), or reduce amaxes
across data-parallel ranks (each rank keeps its own scales: its activations' amaxes; the weights',
the same on every rank, agree).
Invariants: scales and amaxes are 0-d f32 tensors on the device of the block's inputs (no host
synchronization per step); peft LoRA adapters on an fp8 block are refused (ValueError), never
skipped.
"""

from __future__ import annotations

from typing import Any

import torch

from coda_lang.backend_cute.runtime.grad_scales import DelayedScaling
from coda_lang.hf.checks import refuse

# amaxes a scale is computed from (torchao's delayed scaling kept 16 by default)
HISTORY = 16
ATTR = "_coda_fp8"


def scale_names(block: Any) -> list[str]:
    """The quantized values of a block, by its scale inputs `s_<name>`."""
    return [p.var.name[2:] for p in block.ir.params if p.var.name.startswith("s_")]


def state_of(owner: Any, names: list[str]) -> DelayedScaling:
    """The delayed scales of the block `owner` runs (made at its first call)."""
    st = owner.__dict__.get(ATTR)
    if st is None:
        st = DelayedScaling(1.0, history=HISTORY)
        st.bind(names, "e4m3")
        owner.__dict__[ATTR] = st
    return st


def run_scaled(
    owner: Any, step: Any, index: int, run: Any, fn: Any, inputs: dict[str, Any], loras: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """`run(inputs)` (the block function `fn`, run by `owner`) with the delayed scales of its fp8
    values added to `inputs` and its amaxes recorded; `index`: the decoder layer's index in `step`
    (-1: the first block), whose second run in one step (activation checkpointing's) reuses the first
    run's scales and records nothing."""
    active = sorted(k for k, v in loras.items() if v is not None)
    if active:
        raise refuse(
            f"{getattr(owner, '_coda_name', type(owner).__name__)}: peft LoRA adapters on {', '.join(active)}",
            'fp8="delayed" blocks multiply e4m3 copies of the base weights and have no adapter path yet',
            "patch without fp8= to train LoRA adapters",
        )
    names = scale_names(fn.block)
    st = state_of(owner, names)
    device = next(v.device for v in inputs.values() if isinstance(v, torch.Tensor))
    ran = step.scales.get(index)
    if ran is not None:  # (activation checkpointing runs the layer again in the backward)
        return run({**inputs, **{f"s_{n}": s for n, s in ran.items()}})
    if st.steps == 0 and not st.scales:
        # calibration: the first step's scales from its own amaxes, measured at scales 1
        ones = st.scales_for(device)
        with torch.no_grad():
            out = run({**inputs, **{f"s_{n}": s for n, s in ones.items()}})
        st.scales = st.next_scales({n: out[f"am_{n}"] for n in names}, ones)
    scales = st.scales_for(device)
    out = run({**inputs, **{f"s_{n}": s for n, s in scales.items()}})
    st.record({n: out[f"am_{n}"] for n in names})
    step.scales[index] = scales
    return out


def forget(module: Any) -> None:
    """Drop the delayed scales a module keeps (unpatching)."""
    module.__dict__.pop(ATTR, None)
