"""Each decoder layer's attention mask and sliding window, as the family's own forward gives them.

What it does: `layer_masks(model, family, emb, attention_mask, position_ids)`: the mask of each
decoder layer, one made per kind of layer the model has, as transformers' forward of that family
makes them (`create_causal_mask` for full attention, `create_sliding_window_causal_mask` for a
sliding window), the kinds from `layer_kinds`: `config.layer_types` (Ministral, Qwen2, Qwen3, Gemma 2, Gemma 3:
`Family.sliding == "layer_types"`), every layer sliding when the config has a `sliding_window`
(Mistral: `"config"`), or every layer full (Llama: None). `window(family, attn)`: the attention
function's `sliding_window` argument as the family's attention module passes it: its own
`sliding_window` (None on a full-attention layer), the config's, or no argument.
What it does not: run attention (forward.py calls the model's attention function with these), or
decide that a model may be patched (checks.py refuses a sliding window where the family has none).
During a CUDA graph's capture, a layer with no attention mask and no position ids gets None (sdpa's
`is_causal`) where transformers gives that outside a capture: full attention, or a sliding window
longer than the sequence (`plain_causal_in_capture`).
Invariants: the sliding window is the attention's business: the blocks are the same for every kind
of layer. The config fields read here are compared with those at patching at every forward
(contract.py), so the kinds can't change under a patched model.
"""

from __future__ import annotations

from typing import Any

from coda_lang.backend_cute.runtime.capture import capturing
from coda_lang.hf.family import Family

FULL, SLIDING = "full_attention", "sliding_attention"


def layer_kinds(family: Family, config: Any) -> list[str]:
    """The kind of attention of each decoder layer: `FULL` or `SLIDING` (or another kind named in
    `config.layer_types`, which `layer_masks` refuses)."""
    n = config.num_hidden_layers
    if family.sliding == "layer_types":
        return list(config.layer_types[:n])
    if family.sliding == "config" and getattr(config, "sliding_window", None) is not None:
        return [SLIDING] * n
    return [FULL] * n


def layer_masks(model: Any, family: Family, emb: Any, attention_mask: Any, position_ids: Any) -> list[Any]:
    """The attention mask of each decoder layer (the same object for layers of one kind)."""
    # lazy: transformers, which the patch alone does not import (the model's caller has)
    import transformers.masking_utils as mu

    makers = {FULL: mu.create_causal_mask, SLIDING: mu.create_sliding_window_causal_mask}
    kinds = layer_kinds(family, model.config)
    made = {
        kind: None
        if plain_causal_in_capture(model.config, kind, emb.shape[1], attention_mask, position_ids)
        else makers[kind](
            config=model.config,
            inputs_embeds=emb,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=position_ids,
        )
        for kind in dict.fromkeys(kinds)
    }
    return [made[kind] for kind in kinds]


def plain_causal_in_capture(config: Any, kind: str, seq: int, attention_mask: Any, position_ids: Any) -> bool:
    """Whether a layer's mask is left to sdpa's `is_causal` while a CUDA graph is being captured.
    transformers makes that choice itself outside a capture, where no token is padded, the positions
    give no packed sequences, and (a sliding-window layer) the sequence is shorter than the window;
    during one it materializes the [seq, seq] mask, since its test reads the data, and sdpa's attention
    with that mask ran 3.3x slower than causal on an H200 (2026-11-28). Without an attention mask or
    position ids there is nothing to read: the mask is the plain causal one, the choice transformers
    makes outside a capture, and the same here."""
    window = getattr(config, "sliding_window", None)
    return (
        (kind == FULL or (kind == SLIDING and isinstance(window, int) and seq < window))
        and attention_mask is None
        and position_ids is None
        and getattr(config, "_attn_implementation", None) == "sdpa"
        and getattr(config, "is_causal", True)
        and capturing()
    )


def window(family: Family, attn: Any) -> dict[str, Any]:
    """The `sliding_window` keyword argument the family's attention module gives its attention
    function, or none."""
    if family.sliding == "layer_types":
        return {"sliding_window": attn.sliding_window}
    if family.sliding == "config":
        return {"sliding_window": getattr(attn.config, "sliding_window", None)}
    return {}
