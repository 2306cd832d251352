"""Patching one model instance in place: checked, its layers' weights fused and moved to the modules
that read them, its forwards replaced.

What it does: `apply(model, family, loss)`: checks.py's checks (and that no parameter is sharded
yet), the model's state (state.py, kept as `model._coda`), the fused weights, each moved under the
module whose forward runs the block that reads it, and the state-dict hooks (checkpoint.py), and the
forwards bound to forward.py's: the causal LM's, the base model's and each decoder layer's.
What it does not: know one family from another (families.py gives their facts).
Invariants: nothing changes on a model that fails a check; the optimizer should be made after
patching (the fused weights are new parameters), and so should any wrapping that holds parameters
(FSDP2's `fully_shard`, DDP).
"""

from __future__ import annotations

import sys
import types
import weakref
from typing import Any

from coda_lang.hf.checkpoint import fuse_and_move
from coda_lang.hf.checks import check_model, refuse
from coda_lang.hf.family import Family
from coda_lang.hf.forward import base_forward, causal_lm_forward, layer_forward
from coda_lang.hf.loss import LossSettings
from coda_lang.hf.state import ModelState


def check_unsharded(model: Any) -> None:
    """A model whose parameters FSDP2 has sharded already (DTensors) is refused: patching replaces and
    moves parameters, which the wrapper would not know of."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None:
        return
    for name, p in model.named_parameters():
        if isinstance(p, dtensor.DTensor):
            raise refuse(
                f"parameter {name} is a DTensor",
                "patch the model before sharding it (fully_shard after apply_coda_to_*)",
            )


def apply(model: Any, family: Family, loss: LossSettings) -> Any:
    """Patch `model` (a transformers causal LM of `family`) in place and return it; its LM head makes
    the loss as `loss` says."""
    check_unsharded(model)
    check_model(model, family)
    st = ModelState(model, family, loss)
    names = {id(m): n for n, m in model.named_modules()}
    layers = list(model.model.layers)
    st.layout = fuse_and_move(model, st.HD)
    model._coda = st
    object.__setattr__(model.model, "_coda_owner", weakref.ref(model))
    for i, layer in enumerate(layers):
        layer._coda = st
        layer._coda_name = names[id(layer)]  # (for messages)
        layer._coda_last = i == len(layers) - 1
        layer.forward = types.MethodType(layer_forward, layer)
    model.forward = types.MethodType(causal_lm_forward, model)
    model.model.forward = types.MethodType(base_forward, model.model)
    return model
