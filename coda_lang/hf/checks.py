"""What a model must be for the patch: each thing the fused blocks can't run is refused by name.

What it does: `check_model(model, family)` raises ValueError (`refuse`: "coda_lang.hf: what: why")
for a model of another class, one patched already, a dtype the blocks don't run, biases, an
activation other than SiLU, sliding-window attention, RoPE that scales cos/sin, or (Qwen3) attention
without its q/k norms. Checks of the patch's contract with other code (hooks, adapters) belong here.
What it does not: patch anything (patch.py); refuse what only a call can show (forward.py refuses
a KV cache or a changed dtype, loss.py labels out of range).
Invariants: it reads the model and changes nothing; nothing is patched unless it passes.
"""

from __future__ import annotations

from typing import Any

from coda_lang.hf.blocks import DTYPES
from coda_lang.hf.family import Family

ROPE_TYPES = ("default", "llama3", "linear")


def refuse(what: str, why: str) -> ValueError:
    return ValueError(f"coda_lang.hf: {what}: {why}")


def check_model(model: Any, family: Family) -> None:
    """Raise `refuse(...)` for the first thing about `model` that the blocks of `family` can't run."""
    cfg = model.config
    name = type(model).__name__
    if name != family.model_class:
        raise refuse(name, f"apply_coda_to_{family.name} patches a transformers {family.model_class}")
    if getattr(model, "_coda", None) is not None:
        raise refuse(name, "this model is patched already")
    if str(model.dtype).removeprefix("torch.") not in DTYPES:
        raise refuse(f"dtype {model.dtype}", "coda blocks run in bfloat16, float16 or float32")
    if getattr(cfg, "attention_bias", False):
        raise refuse("attention_bias=True", "the fused QKV and out-projection blocks have no bias")
    if getattr(cfg, "mlp_bias", False):
        raise refuse("mlp_bias=True", "the fused MLP block has no bias")
    if cfg.hidden_act != "silu":
        raise refuse(f"hidden_act={cfg.hidden_act!r}", "the MLP block is SwiGLU (silu)")
    if getattr(cfg, "use_sliding_window", False) or any(
        t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])
    ):
        raise refuse("sliding-window attention", "only full attention layers are supported")
    rope = model.model.rotary_emb
    if rope.rope_type not in ROPE_TYPES:
        raise refuse(f"rope_type={rope.rope_type!r}", f"supported: {', '.join(ROPE_TYPES)}")
    if float(rope.attention_scaling) != 1.0:
        raise refuse(f"RoPE attention_scaling={rope.attention_scaling}", "only 1.0 is supported")
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if getattr(attn, n, None) is None or getattr(attn, n).bias is not None:
                raise refuse(f"layer {i}: self_attn.{n}", "missing or has a bias")
        if family.qk_norm and (
            getattr(attn, "q_norm", None) is None or getattr(attn, "k_norm", None) is None
        ):
            raise refuse(f"layer {i}", "Qwen3 attention without q_norm/k_norm")
