"""The facts of each model family the patch knows: one `Family` per transformers model class.

What it does: `Family` (its name, which is also the config's `model_type`, its causal LM class, and
what its layers do beyond the LLaMA layer: a per-head q/k norm, a QKV bias, a sliding window and
where its attention reads it, multipliers) and the families known (`LLAMA`, `QWEN3`, `MISTRAL`,
`MINISTRAL`, `QWEN2`, `GRANITE`), by model type in `FAMILIES`; `multipliers(family, config)`, the
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


LLAMA = Family("llama", "LlamaForCausalLM", qk_norm=False)
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", qk_norm=True, sliding="layer_types")
MISTRAL = Family("mistral", "MistralForCausalLM", qk_norm=False, sliding="config")
MINISTRAL = Family("ministral", "MinistralForCausalLM", qk_norm=False, sliding="layer_types")
QWEN2 = Family("qwen2", "Qwen2ForCausalLM", qk_norm=False, qkv_bias=True, sliding="layer_types")
GRANITE = Family("granite", "GraniteForCausalLM", qk_norm=False, multipliers=True)

# by `config.model_type`: what `apply_coda` and `AutoCodaForCausalLM` patch
FAMILIES = {f.name: f for f in (LLAMA, QWEN3, MISTRAL, MINISTRAL, QWEN2, GRANITE)}


def multipliers(family: Family, config: Any) -> tuple[float, float, float] | None:
    """Granite's (embedding, residual, logits) multipliers, as its model applies them (the logits
    divided by `logits_scaling`); None for a family without them."""
    if not family.multipliers:
        return None
    c = config
    return float(c.embedding_multiplier), float(c.residual_multiplier), float(c.logits_scaling)
