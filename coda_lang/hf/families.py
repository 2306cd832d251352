"""The entry points of the model families the patch knows: `apply_coda_to_<family>`, and `apply_coda`
and `AutoCodaForCausalLM`, which pick the family from the config's `model_type`.

What it does: `apply_coda_to_llama`, `apply_coda_to_qwen3`, `apply_coda_to_mistral`,
`apply_coda_to_ministral`, `apply_coda_to_qwen2`, `apply_coda_to_granite`, `apply_coda_to_phi3`,
`apply_coda_to_olmo2`, `apply_coda_to_gemma2`, `apply_coda_to_gemma3`: check the loss settings, then patch a
model of that family (patch.py) with its facts (family.py). `apply_coda(model)`: the same for the
family of `model.config.model_type` (`FAMILIES`), refusing a type it does not know with the list of
those it does (the multimodal Gemma 3, `gemma3`, with what to load instead). `AutoCodaForCausalLM.from_pretrained(...)` / `.from_config(...)`: transformers'
`AutoModelForCausalLM`'s, then `apply_coda` (as Liger Kernel's `AutoLigerKernelForCausalLM`), the
model type checked from the config before any weights load. A new family's entry point goes here, its
facts in family.py, blocks it needs beyond these in blocks.py.
What it does not: patch (patch.py) or check (checks.py).
"""

from __future__ import annotations

from typing import Any

from coda_lang.hf.checks import refuse
from coda_lang.hf.family import (
    FAMILIES,
    GEMMA2,
    GEMMA3,
    GRANITE,
    LLAMA,
    MINISTRAL,
    MISTRAL,
    OLMO2,
    PHI3,
    QWEN2,
    QWEN3,
    Family,
)
from coda_lang.hf.loss import LossSettings
from coda_lang.hf.patch import apply


def apply_coda_to_llama(
    model: Any,
    *,
    loss_mode: str = "rows",
    loss_budget: int | None = None,
    loss_rows: int | None = None,
    fp8: str | None = None,
) -> Any:
    """Patch a transformers `LlamaForCausalLM` in place (and return it) so that everything outside
    attention runs as coda blocks; see `coda_lang.hf`. Make the optimizer afterwards. The LM head's
    loss: `loss_mode` "rows" (default: chunks of `loss_rows` rows, None: 1 GiB of logits each) or
    "vocab" (less memory, one GEMM more: the backward in chunks of the vocabulary within
    `loss_budget` bytes, None: 256 MiB) or, with fp8="delayed", "fp8" (experimental: the head's GEMMs
    in fp8 too, at a cost in accuracy: docs/models.md); TypeError or ValueError for a bad setting,
    before anything is patched (hf/loss.py, `LossSettings`). `fp8`: None (the blocks in the model's dtype),
    "delayed" (the layers' gate/up, down and QKV GEMMs in e4m3, each input quantized in the epilogue
    that makes it at a delayed per-tensor scale, and their backward's cotangents in e5m2) or
    "delayed-forward" (the same forward, the backward in the model's dtype) or "blockwise"
    (DeepSeek-V3's current 1 x 128 activation and 128 x 128 weight scales; widths that are multiples of
    128) (fp8.py; docs/models.md, "fp8 training"); the out-projection and (but for loss_mode="fp8") the LM head stay in the model's
    dtype."""
    return apply(model, LLAMA, LossSettings(loss_mode, loss_budget, loss_rows), fp8)


def apply_coda_to_qwen3(
    model: Any,
    *,
    loss_mode: str = "rows",
    loss_budget: int | None = None,
    loss_rows: int | None = None,
    fp8: str | None = None,
) -> Any:
    """Patch a transformers `Qwen3ForCausalLM` in place (and return it): as `apply_coda_to_llama`, with
    Qwen3's per-head q/k RMSNorm in the QKV blocks' epilogue."""
    return apply(model, QWEN3, LossSettings(loss_mode, loss_budget, loss_rows), fp8)


def apply_coda_to_mistral(
    model: Any,
    *,
    loss_mode: str = "rows",
    loss_budget: int | None = None,
    loss_rows: int | None = None,
    fp8: str | None = None,
) -> Any:
    """Patch a transformers `MistralForCausalLM` in place (and return it): as `apply_coda_to_llama`; a
    sliding window (`config.sliding_window`) is the model's attention function's, with its mask."""
    return apply(model, MISTRAL, LossSettings(loss_mode, loss_budget, loss_rows), fp8)


def apply_coda_to_ministral(
    model: Any,
    *,
    loss_mode: str = "rows",
    loss_budget: int | None = None,
    loss_rows: int | None = None,
    fp8: str | None = None,
) -> Any:
    """Patch a transformers `MinistralForCausalLM` in place (and return it): as `apply_coda_to_llama`;
    its layers' full or sliding-window attention (`config.layer_types`) is the model's attention
    function's, with its masks."""
    return apply(model, MINISTRAL, LossSettings(loss_mode, loss_budget, loss_rows), fp8)


def apply_coda_to_qwen2(
    model: Any,
    *,
    loss_mode: str = "rows",
    loss_budget: int | None = None,
    loss_rows: int | None = None,
    fp8: str | None = None,
) -> Any:
    """Patch a transformers `Qwen2ForCausalLM` (Qwen2, Qwen2.5) in place (and return it): as
    `apply_coda_to_llama`, with the q, k and v projections' biases added in the QKV blocks' epilogue;
    sliding-window layers (`use_sliding_window`) as `apply_coda_to_ministral`."""
    return apply(model, QWEN2, LossSettings(loss_mode, loss_budget, loss_rows), fp8)


def apply_coda_to_granite(
    model: Any,
    *,
    loss_mode: str = "rows",
    loss_budget: int | None = None,
    loss_rows: int | None = None,
    fp8: str | None = None,
) -> Any:
    """Patch a transformers `GraniteForCausalLM` (Granite 3.x dense) in place (and return it): as
    `apply_coda_to_llama`, with its multipliers: the embedding's (applied to the embeddings), the
    residual's and the logits' (scalars in the blocks' epilogues) and the attention's (the scaling
    its attention function is given)."""
    return apply(model, GRANITE, LossSettings(loss_mode, loss_budget, loss_rows), fp8)


def apply_coda_to_phi3(
    model: Any,
    *,
    loss_mode: str = "rows",
    loss_budget: int | None = None,
    loss_rows: int | None = None,
    fp8: str | None = None,
) -> Any:
    """Patch a transformers `Phi3ForCausalLM` (Phi-3, Phi-3.5 with the default RoPE) in place (and
    return it): as `apply_coda_to_llama`. Its checkpoints' fused `qkv_proj` and `gate_up_proj` become
    coda's fused weights (their rows reordered) and come back out in Phi-3's layout; its sliding
    window (`config.sliding_window`) is the attention function's, as Mistral's; LongRoPE (the 128k
    variants) and residual dropout in training are refused."""
    return apply(model, PHI3, LossSettings(loss_mode, loss_budget, loss_rows), fp8)


def apply_coda_to_olmo2(
    model: Any,
    *,
    loss_mode: str = "rows",
    loss_budget: int | None = None,
    loss_rows: int | None = None,
    fp8: str | None = None,
) -> Any:
    """Patch a transformers `Olmo2ForCausalLM` (OLMo 2) in place (and return it): as
    `apply_coda_to_llama`, with OLMo 2's norms: no norm before attention or the MLP, a norm of each
    branch's output before it joins the residual (`post_attention_layernorm` after the
    out-projection, `post_feedforward_layernorm` after the down-projection), and q and k each
    normalized over its projection's whole width before RoPE (`q_norm`, `k_norm`)."""
    return apply(model, OLMO2, LossSettings(loss_mode, loss_budget, loss_rows), fp8)


def apply_coda_to_gemma2(
    model: Any,
    *,
    loss_mode: str = "rows",
    loss_budget: int | None = None,
    loss_rows: int | None = None,
    fp8: str | None = None,
) -> Any:
    """Patch a transformers `Gemma2ForCausalLM` (Gemma 2) in place (and return it): as
    `apply_coda_to_llama`, with Gemma's layer: a norm before and after each branch (the sandwich:
    `input_layernorm`, `post_attention_layernorm`, `pre_feedforward_layernorm`,
    `post_feedforward_layernorm`), every norm scaling by 1 + w, a GELU-tanh gated MLP (GeGLU), the
    final logits soft-capped (`final_logit_softcapping`) in the LM head; the embeddings scaled by
    sqrt(hidden_size) as its embedding does, the attention's scaling (`query_pre_attn_scalar`),
    soft-capping (`attn_logit_softcapping`) and alternating sliding-window layers the model's attention
    function's."""
    return apply(model, GEMMA2, LossSettings(loss_mode, loss_budget, loss_rows), fp8)


def apply_coda_to_gemma3(
    model: Any,
    *,
    loss_mode: str = "rows",
    loss_budget: int | None = None,
    loss_rows: int | None = None,
    fp8: str | None = None,
) -> Any:
    """Patch a transformers `Gemma3ForCausalLM` (Gemma 3's text model, `model_type` gemma3_text) in
    place (and return it): as `apply_coda_to_gemma2`, with Gemma 3's per-head q/k norm (of 1 + w)
    before RoPE, each kind of layer's RoPE (local layers' `rope_local_base_freq`, global layers'
    `rope_theta` and linear scaling), and no attention soft-capping (its attention passes none). The
    multimodal `Gemma3ForConditionalGeneration` is refused."""
    return apply(model, GEMMA3, LossSettings(loss_mode, loss_budget, loss_rows), fp8)


# model types whose refusal can say more than that they are not supported
NOT_FAMILIES = {
    "gemma3": (
        "the multimodal Gemma 3 (Gemma3ForConditionalGeneration: a vision tower, image tokens and "
        "bidirectional attention over them) is not a family coda_lang.hf patches; its text-only model, "
        "Gemma3ForCausalLM (model_type 'gemma3_text', as google/gemma-3-1b-pt), is",
        "patch a Gemma3ForCausalLM, or train this model unpatched",
    ),
}


def family_of(model_type: Any, what: str) -> Family:
    """The family of a config's `model_type`; ValueError naming it (`what`: the model or config it is
    read from) and the types supported."""
    family = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None and model_type in NOT_FAMILIES:
        why, todo = NOT_FAMILIES[model_type]
        raise refuse(
            f"model_type {model_type!r} ({what})", f"{why}; supported: {', '.join(sorted(FAMILIES))}", todo
        )
    if family is None:
        raise refuse(
            f"model_type {model_type!r} ({what})",
            f"not a family coda_lang.hf patches; supported: {', '.join(sorted(FAMILIES))}",
            "train this model unpatched (or with Liger Kernel)",
        )
    return family


def apply_coda(
    model: Any,
    *,
    loss_mode: str = "rows",
    loss_budget: int | None = None,
    loss_rows: int | None = None,
    fp8: str | None = None,
) -> Any:
    """Patch a transformers causal LM of any supported family in place (and return it): the family of
    `model.config.model_type`, patched as its `apply_coda_to_<family>` does (the loss settings are
    theirs). ValueError for a model type not supported, listing those that are (and, as the entry
    points, for a model of another class than the family's causal LM); TypeError for an object
    without a transformers config."""
    loss = LossSettings(loss_mode, loss_budget, loss_rows)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        raise TypeError(
            f"apply_coda takes a transformers causal LM (a model with config.model_type), got a "
            f"{type(model).__name__}"
        )
    return apply(model, family_of(model_type, type(model).__name__), loss, fp8)


# transformers' keyword arguments of `from_pretrained` that say where and how to find the config
_HUB = (
    "cache_dir",
    "force_download",
    "local_files_only",
    "token",
    "revision",
    "subfolder",
    "trust_remote_code",
)


class AutoCodaForCausalLM:
    """transformers' `AutoModelForCausalLM`, then `apply_coda`: `from_pretrained(name_or_path, ...,
    loss_mode=, loss_budget=, loss_rows=, fp8=)` takes transformers' arguments (dtype, device_map, config,
    ...) and the patch's loss settings, and returns the patched model; `from_config(config, ...)` the
    same for a model of random weights. A model type coda_lang.hf does not patch is refused (ValueError,
    listing those it does) from the config alone, before any weights load."""

    def __init__(self, *args: Any, **kwargs: Any):
        raise TypeError(
            "AutoCodaForCausalLM is made with AutoCodaForCausalLM.from_pretrained(...) or "
            "AutoCodaForCausalLM.from_config(config)"
        )

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path: Any,
        *model_args: Any,
        loss_mode: str = "rows",
        loss_budget: int | None = None,
        loss_rows: int | None = None,
        fp8: str | None = None,
        **kwargs: Any,
    ) -> Any:
        # lazy: transformers, which `import coda_lang.hf` does not need
        from transformers import AutoConfig, AutoModelForCausalLM

        loss = LossSettings(loss_mode, loss_budget, loss_rows)
        config = kwargs.get("config")
        if config is None or isinstance(config, str):
            hub = {k: kwargs[k] for k in _HUB if k in kwargs}
            config = AutoConfig.from_pretrained(config or pretrained_model_name_or_path, **hub)
        family = family_of(getattr(config, "model_type", None), str(pretrained_model_name_or_path))
        model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        return apply(model, family, loss, fp8)

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        loss_mode: str = "rows",
        loss_budget: int | None = None,
        loss_rows: int | None = None,
        fp8: str | None = None,
        **kwargs: Any,
    ) -> Any:
        # lazy: transformers, which `import coda_lang.hf` does not need
        from transformers import AutoModelForCausalLM

        loss = LossSettings(loss_mode, loss_budget, loss_rows)
        family = family_of(getattr(config, "model_type", None), type(config).__name__)
        return apply(AutoModelForCausalLM.from_config(config, **kwargs), family, loss, fp8)
