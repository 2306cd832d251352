"""Patching one model instance in place, and undoing it: checked, its layers' weights fused and moved
to the modules that read them, its forwards replaced; `unpatch` gives the Hugging Face modules and
forwards back.

What it does: `apply(model, family, loss)`: checks.py's checks (and that no parameter is sharded
yet), the model's state (state.py, kept as `model._coda`), the fused weights, each moved under the
module whose forward runs the block that reads it, and the state-dict hooks (checkpoint.py), the
forwards set to forward.py's (the causal LM's, the base model's and each decoder layer's, bound with
`functools.partial`, which a copy or pickle of the model keeps, where a bound method would not
unpickle), and the contract the forward checks at each call (contract.py). `unpatch(model)`: the
projections split back out of the fused weights exactly and every moved module put back
(checkpoint.py), the forwards and the state removed: an ordinary transformers model again
(generation with a KV cache works), the parameters it shared with the patched model the same objects.
What it does not: know one family from another (families.py gives their facts).
Invariants: nothing changes on a model that fails a check; the optimizer should be made after
patching (the fused weights are new parameters), and so should any wrapping that holds parameters
(FSDP2's `fully_shard`, DDP); and again after unpatching (the projections it makes are new
parameters).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from coda_lang.hf.blocks import DELAYED, FP8_GRADS, FP8_RECIPES, SCALE_GROUP
from coda_lang.hf.checkpoint import fuse_and_move, moved_parts, unfuse_and_restore
from coda_lang.hf.checks import check_model, peft_inner, refuse
from coda_lang.hf.contract import Contract
from coda_lang.hf.family import Family
from coda_lang.hf.forward import base_forward, causal_lm_forward, layer_forward
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


def check_unsharded(
    model: Any, what: str = "patch the model before sharding it (fully_shard after apply_coda_to_*)"
) -> None:
    """A model whose parameters FSDP2 has sharded already (DTensors) is refused: patching replaces and
    moves parameters, which the wrapper would not know of."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None:
        return
    for name, p in model.named_parameters():
        if isinstance(p, dtensor.DTensor):
            raise refuse(f"parameter {name} is a DTensor", what)


def check_fp8(fp8: Any) -> None:
    """`fp8=` is None or a recipe of blocks.FP8_RECIPES (every family takes it): TypeError / ValueError
    naming what it takes."""
    if fp8 is None:
        return
    takes = f"None (bf16 blocks) or {' or '.join(map(repr, FP8_RECIPES))}"
    if not isinstance(fp8, str):
        raise TypeError(f"fp8= is {fp8!r}; it takes {takes}")
    if fp8 not in FP8_RECIPES:
        hint = _FP8_HINTS.get(fp8, "")
        raise ValueError(f"fp8= is {fp8!r}; it takes {takes}{hint}")


def check_blockwise_widths(model: Any) -> None:
    """fp8="blockwise" quantizes in groups of 128 along every width its GEMMs contract or whose weights
    it blocks (the hidden size, the intermediate size, the fused QKV projection's width): ValueError
    naming the one of this model that is not a multiple of 128."""
    cfg = getattr(model, "config", None)
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    get = lambda k: getattr(text, k, None)  # noqa: E731
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    kv = get("num_key_value_heads") or heads
    hd = get("head_dim") or (hidden // heads if isinstance(hidden, int) and heads else None)
    widths = {
        "hidden_size": hidden,
        "intermediate_size": get("intermediate_size"),
        "the QKV projection's width ((heads + 2 * kv heads) * head_dim)": None
        if not (isinstance(hd, int) and heads and kv)
        else (heads + 2 * kv) * hd,
    }
    for what, n in widths.items():
        if isinstance(n, int) and n % SCALE_GROUP:
            raise ValueError(
                f"fp8='blockwise' scales 1 x {SCALE_GROUP} groups of activations and {SCALE_GROUP} x "
                f"{SCALE_GROUP} blocks of weights, and this model's {what} is {n}, not a multiple of "
                f"{SCALE_GROUP}: use fp8='delayed' (per-tensor scales) for it"
            )


# names of other libraries' fp8 recipes, and what coda has instead
_FP8_HINTS = {
    "tensorwise": " (torchao's tensorwise scales each tensor by its current amax, which needs the whole "
    "tensor before any tile is stored; 'delayed' scales it by the amaxes of earlier steps)",
    "rowwise": " (a scale per row from the row's current amax over all of N is not block-local: a GEMM's "
    "epilogue sees one tile of the row; 'blockwise' scales each 1 x 128 group of a row by its current amax, "
    "'delayed' scales per tensor, from earlier steps' amaxes)",
}


def apply(model: Any, family: Family, loss: LossSettings, fp8: str | None = None) -> Any:
    """Patch `model` (a transformers causal LM of `family`, or a peft model of one: its base model is
    patched, its LoRA layers run in the blocks) in place and return it; its LM head makes the loss as
    `loss` says; `fp8`: None (the blocks in the model's dtype), "delayed" (the layers' gate/up, down
    and QKV GEMMs in e4m3 at delayed per-tensor scales, and the cotangents of their accumulators in
    e5m2 at delayed scales of their own, so that the backward's GEMMs multiply fp8 by fp8: fp8.py) or
    "delayed-forward" (the same forward, the cotangents in the model's dtype) or "blockwise" (DeepSeek-V3's
    current 1x128 and 128x128 scales, `check_blockwise_widths`). `loss.mode` "fp8" takes fp8="delayed"
    (ValueError otherwise)."""
    check_fp8(fp8)
    if loss.mode == "fp8" and (fp8 not in DELAYED or FP8_GRADS[fp8] is None):
        raise ValueError(
            f"loss_mode='fp8' runs the LM head's GEMMs in fp8 at delayed scales beside fp8 layers with fp8 "
            f"cotangents; fp8= is {fp8!r}: pass fp8='delayed' with it, or leave loss_mode at 'rows'"
        )
    if fp8 == "blockwise":
        check_blockwise_widths(model)
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if loss.mode == "fp8" and isinstance(vocab, int) and vocab % 16:
        raise ValueError(
            f"loss_mode='fp8' stores the [tokens, vocabulary] dlogits in fp8 in rows of 16-byte multiples "
            f"(Hopper's TMA), and this model's vocabulary is {vocab} tokens, not a multiple of 16: leave "
            "loss_mode at 'rows' (the head in the model's dtype)"
        )
    inner = peft_inner(model)
    if inner is not model:
        apply(inner, family, loss, fp8)
        return model
    check_unsharded(model)
    check_model(model, family)
    st = ModelState(model, family, loss, fp8)
    names = {id(m): n for n, m in model.named_modules()}
    layers = list(model.model.layers)
    st.layout = fuse_and_move(model, family, st.HD, (st.H, st.KV))
    model._coda = st
    object.__setattr__(model.model, "_coda_owner", Owner(model))
    for i, layer in enumerate(layers):
        layer._coda = st
        layer._coda_name = names[id(layer)]  # (for messages)
        layer._coda_index = i
        layer._coda_last = i == len(layers) - 1
        layer.forward = functools.partial(layer_forward, layer)
    forwards = (functools.partial(causal_lm_forward, model), functools.partial(base_forward, model.model))
    model.forward, model.model.forward = forwards
    st.contract = Contract(model, family, forwards)
    return model


LAYER_ATTRS = ("forward", "_coda", "_coda_name", "_coda_index", "_coda_last")


def unpatch(model: Any) -> Any:
    """Undo `apply_coda_to_llama` / `apply_coda_to_qwen3` on `model` in place (and return it): each
    layer's q/k/v and gate/up projections split back out of the fused weights exactly (and their
    gradients, when any), every moved module back where Hugging Face has it, the transformers
    forwards back, the coda state removed (with it an fp8 model's delayed scales, the forward's and
    the cotangents': patched again, it calibrates again). What was changed since patching (a module replaced, an
    adapter, a checkpoint wrapper) stays as it is. ValueError for a model not patched, sharded, or
    whose forward was wrapped since patching (unpatch it before wrapping)."""
    inner = peft_inner(model)
    if inner is not model:
        unpatch(inner)
        return model
    st = getattr(model, "_coda", None)
    if st is None:
        raise refuse(type(model).__name__, "not patched by coda_lang.hf", "there is nothing to unpatch")
    check_unsharded(
        model, "unpatch the model before sharding it, or load its state_dict() into an unpatched one"
    )
    lm_forward, base_fwd = st.contract.forwards
    base = model.model
    for what, m, fwd in (("model.forward", model, lm_forward), ("model.model.forward", base, base_fwd)):
        if m.__dict__.get("forward") is not fwd:
            raise refuse(
                what,
                "replaced or wrapped since patching (e.g. by accelerate's prepare)",
                "unpatch the model before wrapping it",
            )
    parts = moved_parts(model)  # all checked before anything changes
    unfuse_and_restore(model, st.layout)
    for layer, _, _ in parts:
        for a in LAYER_ATTRS:
            layer.__dict__.pop(a, None)

    del model.forward, base.forward
    base.__dict__.pop("_coda_owner", None)
    del model._coda
    return model
