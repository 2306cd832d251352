"""The facts of each model family the patch knows: one `Family` per transformers model class.

What it does: `Family` (its name, which is also the config's `model_type`, its causal LM class, and
what its layers do beyond the LLaMA layer: a per-head q/k norm, a QKV bias, a sliding window and
where its attention reads it, multipliers; the names of its projections and of its MLP's
activation, and residual dropout modules) and the families known (`LLAMA`, `QWEN3`, `MISTRAL`,
`MINISTRAL`, `QWEN2`, `GRANITE`, `PHI3`), by model type in `FAMILIES`; `multipliers(family, config)`, the
values of Granite's. The checks, the model's state and the patch read a family's
facts from here; families.py holds the entry points.
What it does not: anything but describe (no import of transformers, torch or the patch).
Invariants: a family's blocks are `blocks.model_source(..., family.qk_norm, family.qkv_bias)`; shared code
branches on a family's facts, never on its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str  # as in `apply_coda_to_<name>`; the config's `model_type`
    model_class: str  # the transformers causal LM it patches
    qk_norm: bool  # per-head RMSNorm of q and k in the QKV blocks' epilogue (Qwen3)
    qkv_bias: bool = False  # q, k and v projections with biases, o_proj without (Qwen2)
    # embedding, residual and logits multipliers from the config (Granite; its attention multiplier
    # is its attention module's `scaling`, which the attention function is given)
    multipliers: bool = False
    # sliding-window attention, the attention function's business (masks.py): None (the family has
    # none), "layer_types" (each layer's kind in config.layer_types, its window the attention
    # module's own), "config" (config.sliding_window, when set, for every layer: Mistral)
    sliding: str | None = None
    # the attention's projections whose rows, in this order, make the fused QKV weight (q, k and v
    # rows): three of them, or Phi-3's one `qkv_proj` holding q, k and v rows stacked
    qkv_parts: tuple[str, ...] = ("q_proj", "k_proj", "v_proj")
    # the MLP's projections whose rows make the fused gate/up weight: gate and up, or Phi-3's one
    # `gate_up_proj` holding the gate rows, then the up rows
    gate_up_parts: tuple[str, ...] = ("gate_proj", "up_proj")
    act_name: str = "act_fn"  # the MLP's activation module (Phi-3: `activation_fn`)
    # a decoder layer's dropout modules on its two residual branches (Phi-3's `resid_pdrop`): the
    # blocks have no dropout, so they run only while these are the identity (eval mode, or p = 0)
    resid_dropouts: tuple[str, ...] = ()


LLAMA = Family("llama", "LlamaForCausalLM", qk_norm=False)
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", qk_norm=True, sliding="layer_types")
MISTRAL = Family("mistral", "MistralForCausalLM", qk_norm=False, sliding="config")
MINISTRAL = Family("ministral", "MinistralForCausalLM", qk_norm=False, sliding="layer_types")
QWEN2 = Family("qwen2", "Qwen2ForCausalLM", qk_norm=False, qkv_bias=True, sliding="layer_types")
GRANITE = Family("granite", "GraniteForCausalLM", qk_norm=False, multipliers=True)
# Phi-3, Phi-3.5: the LLaMA layer with fused checkpoint projections, Mistral's every-layer window
PHI3 = Family(
    "phi3",
    "Phi3ForCausalLM",
    qk_norm=False,
    sliding="config",
    qkv_parts=("qkv_proj",),
    gate_up_parts=("gate_up_proj",),
    act_name="activation_fn",
    resid_dropouts=("resid_attn_dropout", "resid_mlp_dropout"),
)

# by `config.model_type`: what `apply_coda` and `AutoCodaForCausalLM` patch
FAMILIES = {f.name: f for f in (LLAMA, QWEN3, MISTRAL, MINISTRAL, QWEN2, GRANITE, PHI3)}


def multipliers(family: Family, config: Any) -> tuple[float, float, float] | None:
    """Granite's (embedding, residual, logits) multipliers, as its model applies them (the logits
    divided by `logits_scaling`); None for a family without them."""
    if not family.multipliers:
        return None
    c = config
    return float(c.embedding_multiplier), float(c.residual_multiplier), float(c.logits_scaling)
