"""The facts of each model family the patch knows: one `Family` per transformers model class.

What it does: `Family` (its name, which is also the config's `model_type`, its causal LM class, and
what its layers do beyond the LLaMA layer: a q/k norm per head or over each projection, a QKV bias,
a sliding window and where its attention reads it, multipliers, norms after each branch instead of
or besides before it; the names of its projections and of its MLP's activation, and residual
dropout modules) and the families known (`LLAMA`, `QWEN3`, `MISTRAL`, `MINISTRAL`, `QWEN2`,
`GRANITE`, `PHI3`, `OLMO2`), by model type in `FAMILIES`; `multipliers(family, config)`, the values
of Granite's; `layer_norms(family)`, which of a decoder layer's norm modules is which norm of the
blocks. The checks, the model's state and the patch read a family's facts from here; families.py
holds the entry points.
What it does not: anything but describe (no import of transformers, torch or the patch).
Invariants: a family's blocks are `blocks.model_source(..., family.qk_norm, family.qkv_bias, ...,
pre_norm=family.pre_norm, post_norm=family.post_norm)`; shared code branches on a family's facts,
never on its name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    name: str  # as in `apply_coda_to_<name>`; the config's `model_type`
    model_class: str  # the transformers causal LM it patches
    # RMSNorm of q and k in the QKV blocks: "head" per head, in the epilogue (Qwen3); "proj" over each
    # projection's whole width (all of q's heads together, all of k's), applied by a row stage after
    # the QKV GEMM (OLMo 2); None
    qk_norm: str | None
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
    # where a decoder layer's RMSNorms sit (at least one): `pre_norm`, on each branch's input (the
    # input norm before attention, the MLP's norm before gate/up: LLaMA); `post_norm`, on each
    # branch's output before it joins the residual (OLMo 2; with `pre_norm`, Gemma 2/3's sandwich)
    pre_norm: bool = True
    post_norm: bool = False


LLAMA = Family("llama", "LlamaForCausalLM", qk_norm=None)
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", qk_norm="head", sliding="layer_types")
MISTRAL = Family("mistral", "MistralForCausalLM", qk_norm=None, sliding="config")
MINISTRAL = Family("ministral", "MinistralForCausalLM", qk_norm=None, sliding="layer_types")
QWEN2 = Family("qwen2", "Qwen2ForCausalLM", qk_norm=None, qkv_bias=True, sliding="layer_types")
GRANITE = Family("granite", "GraniteForCausalLM", qk_norm=None, multipliers=True)
# Phi-3, Phi-3.5: the LLaMA layer with fused checkpoint projections, Mistral's every-layer window
PHI3 = Family(
    "phi3",
    "Phi3ForCausalLM",
    qk_norm=None,
    sliding="config",
    qkv_parts=("qkv_proj",),
    gate_up_parts=("gate_up_proj",),
    act_name="activation_fn",
    resid_dropouts=("resid_attn_dropout", "resid_mlp_dropout"),
)
OLMO2 = Family("olmo2", "Olmo2ForCausalLM", qk_norm="proj", pre_norm=False, post_norm=True)

# by `config.model_type`: what `apply_coda` and `AutoCodaForCausalLM` patch
FAMILIES = {f.name: f for f in (LLAMA, QWEN3, MISTRAL, MINISTRAL, QWEN2, GRANITE, PHI3, OLMO2)}


def multipliers(family: Family, config: Any) -> tuple[float, float, float] | None:
    """Granite's (embedding, residual, logits) multipliers, as its model applies them (the logits
    divided by `logits_scaling`); None for a family without them."""
    if not family.multipliers:
        return None
    c = config
    return float(c.embedding_multiplier), float(c.residual_multiplier), float(c.logits_scaling)


def layer_norms(family: Family) -> dict[str, str]:
    """The norms a decoder layer's own block reads, by the block's parameter: the name of each one's
    module in a Hugging Face decoder layer. The MLP's pre-norm `g1` (`post_attention_layernorm` in
    LLaMA; `pre_feedforward_layernorm` where that name is the attention's post-norm's, as in Gemma 2/3),
    the post-norms `go` of the attention's output and `gd` of the MLP's. (The input norm, the
    blocks' `g`/`g2`, is the next layer's: `input_layernorm`, with `pre_norm`.)"""
    if not family.post_norm:
        return {"g1": "post_attention_layernorm"}
    out = {"go": "post_attention_layernorm", "gd": "post_feedforward_layernorm"}
    if family.pre_norm:
        out["g1"] = "pre_feedforward_layernorm"
    return out
