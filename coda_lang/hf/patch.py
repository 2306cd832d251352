"""Patching one model instance in place, and undoing it: checked, its layers' weights fused, its
forwards replaced; `unpatch` gives the Hugging Face modules and forwards back.

What it does: `apply(model, family, loss)`: checks.py's checks, the model's state (state.py, kept as
`model._coda`), each layer's fused weights and checkpoint hooks (checkpoint.py), the causal LM's and
the base model's `forward` set to forward.py's (bound with `functools.partial`, which a copy or pickle
of the model keeps, where a bound method would not unpickle), and the contract the forward checks at
each call (contract.py). `unpatch(model)`: the projections split back out of the fused weights
exactly (checkpoint.py), the forwards and the state removed: an ordinary transformers model again
(generation with a KV cache works), the parameters it shared with the patched model the same objects.
What it does not: know one family from another (families.py gives their facts).
Invariants: nothing changes on a model that fails a check; the optimizer should be made after
patching and again after unpatching (the fused weights, and the projections unpatching makes, are new
parameters).
"""

from __future__ import annotations

import functools
from typing import Any

from coda_lang.hf.checkpoint import check_unfusable, fuse_layer, unfuse_layer
from coda_lang.hf.checks import check_model, refuse
from coda_lang.hf.contract import Contract
from coda_lang.hf.family import Family
from coda_lang.hf.forward import base_forward, causal_lm_forward
from coda_lang.hf.loss import LossSettings
from coda_lang.hf.state import ModelState


class Owner:
    """The causal LM holding a patched base model, called as the weak reference it once was
    (`base._coda_owner()`); a strong reference, which a copy or pickle of the model carries (the
    forwards bound to the model make a reference cycle already)."""

    __slots__ = ("model",)

    def __init__(self, model: Any):
        self.model = model

    def __call__(self) -> Any:
        return self.model


def apply(model: Any, family: Family, loss: LossSettings) -> Any:
    """Patch `model` (a transformers causal LM of `family`) in place and return it; its LM head makes
    the loss as `loss` says."""
    check_model(model, family)
    st = ModelState(model, family, loss)
    for layer in model.model.layers:
        fuse_layer(layer, st.HD)
    model._coda = st
    object.__setattr__(model.model, "_coda_owner", Owner(model))
    forwards = (functools.partial(causal_lm_forward, model), functools.partial(base_forward, model.model))
    model.forward, model.model.forward = forwards
    st.contract = Contract(model, family, forwards)
    return model


def unpatch(model: Any) -> Any:
    """Undo `apply_coda_to_llama` / `apply_coda_to_qwen3` on `model` in place (and return it): each
    layer's q/k/v and gate/up projections split back out of the fused weights exactly (and their
    gradients, when any), the transformers forwards back, the coda state removed. What was changed
    since patching (a module replaced, an adapter) stays as it is. ValueError for a model not patched,
    or whose forward was wrapped since patching (unpatch it before wrapping)."""
    st = getattr(model, "_coda", None)
    if st is None:
        raise refuse(type(model).__name__, "not patched by coda_lang.hf", "there is nothing to unpatch")
    lm_forward, base_fwd = st.contract.forwards
    base = model.model
    for what, m, fwd in (("model.forward", model, lm_forward), ("model.model.forward", base, base_fwd)):
        if m.__dict__.get("forward") is not fwd:
            raise refuse(
                what,
                "replaced or wrapped since patching (e.g. by accelerate's prepare)",
                "unpatch the model before wrapping it",
            )
    for i, layer in enumerate(base.layers):  # all checked before any changes
        check_unfusable(f"model.layers.{i}", layer)
    for i, layer in enumerate(base.layers):
        unfuse_layer(f"model.layers.{i}", layer)
    del model.forward, base.forward
    base.__dict__.pop("_coda_owner", None)
    del model._coda
    return model
