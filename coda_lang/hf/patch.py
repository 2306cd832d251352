"""Patching one model instance in place: checked, its layers' weights fused, its forwards replaced.

What it does: `apply(model, family, loss)`: checks.py's checks, the model's state (state.py, kept as
`model._coda`), each layer's fused weights and checkpoint hooks (checkpoint.py), and the causal LM's
and the base model's `forward` bound to forward.py's.
What it does not: know one family from another (families.py gives their facts).
Invariants: nothing changes on a model that fails a check; the optimizer should be made after
patching (the fused weights are new parameters).
"""

from __future__ import annotations

import types
import weakref
from typing import Any

from coda_lang.hf.checkpoint import fuse_layer
from coda_lang.hf.checks import check_model
from coda_lang.hf.family import Family
from coda_lang.hf.forward import base_forward, causal_lm_forward
from coda_lang.hf.loss import LossSettings
from coda_lang.hf.state import ModelState


def apply(model: Any, family: Family, loss: LossSettings) -> Any:
    """Patch `model` (a transformers causal LM of `family`) in place and return it; its LM head makes
    the loss as `loss` says."""
    check_model(model, family)
    st = ModelState(model, family, loss)
    for layer in model.model.layers:
        fuse_layer(layer, st.HD)
    model._coda = st
    object.__setattr__(model.model, "_coda_owner", weakref.ref(model))
    model.forward = types.MethodType(causal_lm_forward, model)
    model.model.forward = types.MethodType(base_forward, model.model)
    return model
