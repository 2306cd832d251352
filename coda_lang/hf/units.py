"""FSDP2 units whose forward a patched model never calls, gathered where their weights are read.

What it does: `gathered(module)` all-gathers the parameters of `module` when it is an FSDP2 unit of its
own (`fully_shard(module)`, alone or in a group), and returns it. Accelerate's FSDP2 preparation
(and torchtitan's) shards the LM head as a unit besides the decoder layers; the patched model's loss
head reads its weight inside the causal LM's forward and never calls the module, so FSDP2's
pre-forward all-gather would never run for it. `FSDPModule.unshard()` is that all-gather, made
explicitly; the unit stays gathered until its post-backward, which FSDP2's end-of-backward callback
runs for every unit whose backward hooks did not fire (its gradients reduce-scattered then, its
parameters resharded).
What it does not: gather a submodule of a decoder layer (a layer's block reads its weights through
the layer's own unit: such a wrapping is refused, E0811), or anything without FSDP2 loaded.
Invariants: a no-op for a module that is not an FSDP2 unit, or whose parameters are gathered already;
never imports torch.distributed itself (it is loaded already wherever a module was sharded).
"""

from __future__ import annotations

import sys
from typing import Any


def gathered(module: Any) -> Any:
    """`module`, its parameters all-gathered first when it is an FSDP2 unit (see the module
    docstring)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is not None and isinstance(module, fsdp.FSDPModule):
        module.unshard()
    return module
