"""The facts of each model family the patch knows: one `Family` per transformers model class.

What it does: `Family` (its name, which is also the config's `model_type`, its causal LM class, and
what its layers do beyond the LLaMA layer: a q/k norm per head or over each projection, a QKV bias,
a sliding window and where its attention reads it, multipliers, norms after each branch instead of
or besides before it; the names of its projections and of its MLP's activation, and residual
dropout modules; Gemma's norms of 1 + w, GeGLU, scaled embeddings, soft-capping and per-kind RoPE)
and the families known (`LLAMA`, `QWEN3`, `MISTRAL`, `MINISTRAL`, `QWEN2`, `GRANITE`, `PHI3`,
`OLMO2`, `GEMMA2`, `GEMMA3`), by model type in `FAMILIES`; `multipliers(family, config)`, the values
of Granite's; `softcap(family, config)`, Gemma's final logit soft-capping; `layer_norms(family)`,
which of a decoder layer's norm modules is which norm of the blocks. The checks, the model's state and the patch read a family's facts from here; families.py
holds the entry points.
What it does not: anything but describe (no import of transformers, torch or the patch).
Invariants: a family's blocks are `blocks.model_source(..., family.qk_norm, family.qkv_bias, ...,
pre_norm=family.pre_norm, post_norm=family.post_norm, norm_offset=family.norm_offset,
act=family.activation, softcap=softcap(family, config))`; shared code branches on a family's facts,
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
    # the config's `model_type`, where it is not `name` (Gemma 3's text model: "gemma3_text")
    config_type: str | None = None
    # the base model's class in the modeling module, where it is not <prefix>Model (Gemma 3's
    # `Gemma3TextModel`; its `Gemma3Model` is the multimodal one)
    base_class: str | None = None
    # RMSNorm scales by (norm_offset + w): 1 in Gemma (its norm weights are stored as w, zero at init)
    norm_offset: float = 0.0
    # the MLP's gate activation (the value of the config's `act_config` field the blocks run): "silu"
    # (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, GELU with the tanh approximation: Gemma)
    activation: str = "silu"
    act_config: str = "hidden_act"
    # the embedding is the modeling module's <prefix>TextScaledWordEmbedding, which multiplies the
    # looked-up rows by its `embed_scale` (sqrt(hidden_size)) cast to the weight's dtype (Gemma)
    scaled_embedding: bool = False
    # the LM head soft-caps its logits, cap * tanh(logits / cap), cap the config's
    # `final_logit_softcapping` when set (Gemma 2, Gemma 3)
    logit_softcap: bool = False
    # the attention module passes its `attn_logit_softcapping` to the attention function as
    # `softcap=` (Gemma 2; Gemma 3's attention passes none, whatever the config says)
    attn_softcap: bool = False
    # each kind of layer (config.layer_types) has its own RoPE: the rotary embedding's
    # `<kind>_inv_freq`, `<kind>_attention_scaling` and `rope_type[kind]` (Gemma 3: local layers'
    # base 1e4, global layers' 1e6, maybe linear scaling)
    rope_kinds: bool = False
    # the attribute holding an RMSNorm module's epsilon (Gemma's norms: `eps`)
    eps_attr: str = "variance_epsilon"

    @property
    def model_type(self) -> str:
        """The config's `model_type` of this family's models."""
        return self.config_type or self.name


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
# Gemma 2: the sandwich (a norm before and after each branch), norms of 1 + w, GeGLU, embeddings
# scaled by sqrt(hidden_size), the logits soft-capped, attention soft-capping and alternating
# sliding-window layers the attention function's
GEMMA2 = Family(
    "gemma2",
    "Gemma2ForCausalLM",
    qk_norm=None,
    sliding="layer_types",
    post_norm=True,
    norm_offset=1.0,
    activation="gelu_pytorch_tanh",
    act_config="hidden_activation",
    scaled_embedding=True,
    logit_softcap=True,
    attn_softcap=True,
    eps_attr="eps",
)
# Gemma 3's text model: Gemma 2's layer with a per-head q/k norm (of 1 + w) and a RoPE per kind of
# layer; its attention takes no soft-capping
GEMMA3 = Family(
    "gemma3",
    "Gemma3ForCausalLM",
    qk_norm="head",
    sliding="layer_types",
    post_norm=True,
    config_type="gemma3_text",
    base_class="Gemma3TextModel",
    norm_offset=1.0,
    activation="gelu_pytorch_tanh",
    act_config="hidden_activation",
    scaled_embedding=True,
    logit_softcap=True,
    rope_kinds=True,
    eps_attr="eps",
)

# by `config.model_type`: what `apply_coda` and `AutoCodaForCausalLM` patch
FAMILIES = {
    f.model_type: f for f in (LLAMA, QWEN3, MISTRAL, MINISTRAL, QWEN2, GRANITE, PHI3, OLMO2, GEMMA2, GEMMA3)
}


def multipliers(family: Family, config: Any) -> tuple[float, float, float] | None:
    """Granite's (embedding, residual, logits) multipliers, as its model applies them (the logits
    divided by `logits_scaling`); None for a family without them."""
    if not family.multipliers:
        return None
    c = config
    return float(c.embedding_multiplier), float(c.residual_multiplier), float(c.logits_scaling)


def softcap(family: Family, config: Any) -> float | None:
    """The final logits' soft-capping value of a Gemma config (`final_logit_softcapping`: Gemma 2's
    30, Gemma 3's none by default), None when unset or for a family without it."""
    if not family.logit_softcap:
        return None
    cap = getattr(config, "final_logit_softcapping", None)
    return None if cap is None else float(cap)


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
