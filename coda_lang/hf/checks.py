"""What a model must be for the patch: each thing the fused blocks can't run, or would bypass, is
refused by name.

What it does: `check_model(model, family)` raises ValueError (`refuse`: "coda_lang.hf: what: why;
what to do") for a model of another class (a peft tuner among them: patch the PeftModel), one
patched already, a dtype the blocks don't run, biases the family has none of, an activation other
than the family's (SiLU; Gemma's GELU-tanh), bidirectional attention (Gemma 3's option),
sliding-window attention where the family has none (`check_layer_kinds`), RoPE that scales cos/sin
(of each kind of layer: Gemma 3's, `rope_tables`), (Qwen3, OLMo 2, Gemma 3) attention without its
q/k norms, a layer without one of the family's norms (`norm_names`), a norm whose epsilon is not the
config's (`check_norms`: Gemma's norms keep it as `eps`), a width whose rows the kernels can't load
(`check_widths`: a vocabulary not a multiple of 8 in bf16), a module the blocks would bypass that is
not the family's own (peft layers but plain LoRA on the seven projections, which `check_lora`
checks; bitsandbytes' quantized layers, a parametrization, an activation or norm swapped), hooks on
such a module or global ones (`module_trouble`, `global_hooks`), and what fusing q/k/v and gate/up
would merge: their `requires_grad`, dtype, device, gradient hooks or tensor type
(`check_fused_parts`); RoPE the QKV blocks don't compute (`check_rope`: a rope type that scales
cos/sin or changes inv_freq per call, Phi-3's LongRoPE among them, or a partial rotary factor). The
per-forward checks of the same contract are contract.py's; the messages and the tests of what a
module may carry are shared from here.
What it does not: patch anything (patch.py); refuse what only a call can show (contract.py refuses
what changed since patching, forward.py a KV cache, loss.py labels out of range).
Invariants: it reads the model and changes nothing; nothing is patched unless it passes.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch.nn.modules import module as torch_module
from torch.nn.utils import parametrize

from coda_lang.hf.blocks import DTYPES
from coda_lang.hf.family import Family, layer_norms
from coda_lang.hf.masks import FULL, SLIDING, layer_kinds

ROPE_TYPES = ("default", "llama3", "linear")
QKV_PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

UNPATCH = "coda_lang.hf.unpatch(model) makes it an unpatched model again"
LORA = (
    "peft LoRA is supported on q, k, v, o, gate, up and down when applied before patching "
    "(get_peft_model, then apply_coda_to_* on the peft model; Phi-3's projections: qkv_proj, o_proj, "
    "gate_up_proj, down_proj); on a patched model, unpatch first "
    "(coda_lang.hf.unpatch(model)), apply LoRA, and patch again; other peft layers (LoRA on other "
    "modules, other methods) are not supported: train such a model unpatched"
)
BYPASSED = (
    "the patched forward runs this module's work inside fused coda blocks and never calls it, so it "
    "would be ignored"
)


def refuse(what: str, why: str, todo: str | None = None) -> ValueError:
    """The patch's error: "coda_lang.hf: <what>: <why>; <what to do>"."""
    return ValueError(f"coda_lang.hf: {what}: {why}" + (f"; {todo}" if todo else ""))


def class_name(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def foreign(m: Any) -> tuple[str, str] | None:
    """(what it is, what to do) for a module of a library whose layers the blocks can't run: peft's
    adapter layers (LoRA), bitsandbytes' quantized ones (QLoRA's base); None for any other."""
    libs = {c.__module__.split(".")[0] for c in type(m).__mro__}
    if "peft" in libs:
        return f"a peft adapter layer ({class_name(m)})", LORA
    if "bitsandbytes" in libs:
        return (
            f"a bitsandbytes quantized layer ({class_name(m)})",
            "4-bit and 8-bit base weights (QLoRA) are not supported: " + LORA,
        )
    return None


LORA_LAYER = "peft.tuners.lora.layer.Linear"


def peft_inner(model: Any) -> Any:
    """The transformers model inside a peft `PeftModel` (its `get_base_model()`), or `model`."""
    if type(model).__module__.split(".")[0] == "peft" and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def is_lora(m: Any) -> bool:
    """`m` is peft's LoRA layer for an `nn.Linear` (its class exactly)."""
    cls = type(m)
    return f"{cls.__module__}.{cls.__qualname__}" == LORA_LAYER


def base_of(m: Any) -> Any:
    """The `nn.Linear` a projection is: itself, or a LoRA layer's base layer."""
    return m.base_layer if is_lora(m) else m


# the projections whose peft LoRA layers the patch runs (checks.py `check_lora`, lora.py)
LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",  # (Phi-3's fused projections: LoRA's B A on all their rows)
    "gate_up_proj",
)


def check_lora(path: str, m: Any, biased: bool = False) -> None:
    """Raise `refuse(...)` unless the patch can run LoRA layer `m` (at `path`) (lora.py: x W^T + s (x A^T) B^T):
    plain LoRA (no DoRA, no LoRA bias, no other variant, not fan_in_fan_out) on an `nn.Linear` base
    (not a quantized one: QLoRA) with a bias where the family's projection has one (`biased`: Qwen2's
    q, k and v), no hooks on it or its parts."""
    base = m.base_layer
    what = foreign(base)
    if what is not None:
        raise refuse(
            f"{path}.base_layer",
            f"{what[0]}: a quantized base (QLoRA) is not supported: the blocks read a dense bf16/f16/f32 "
            "weight",
            "train QLoRA unpatched, or LoRA on a bf16 base patched",
        )
    if type(base) is not torch.nn.Linear or (base.bias is not None) != biased:
        has = getattr(base, "bias", None) is not None
        raise refuse(
            f"{path}.base_layer",
            f"a {class_name(base)}{' with a bias' if has else ' without a bias'}, not "
            f"an nn.Linear {'with' if biased else 'without'} a bias",
            "train this model unpatched",
        )
    if getattr(m, "fan_in_fan_out", False):
        raise refuse(path, "fan_in_fan_out=True: not an nn.Linear's layout", "train it unpatched")
    for a in m.lora_A:
        for flag, what_ in (
            ("use_dora", "DoRA (use_dora=True)"),
            ("lora_bias", "a LoRA bias (lora_bias=True)"),
        ):
            if getattr(m, flag, {}).get(a, False):
                raise refuse(
                    f"{path} (adapter {a!r})",
                    f"{what_}: the patch runs plain LoRA, x W^T + s (x A^T) B^T per projection",
                    "train it unpatched",
                )
        if a in getattr(m, "lora_variant", {}):
            raise refuse(
                f"{path} (adapter {a!r})", "a LoRA variant other than plain LoRA", "train it unpatched"
            )
    for sub_path, sub in m.named_modules(prefix=path):
        hooks = module_hooks(sub)
        if hooks:
            raise refuse(
                sub_path,
                f"{', '.join(hooks)} registered on it: the patched forward runs LoRA inside fused blocks "
                "and never calls it, so it would be ignored",
                f"remove it, or run the model unpatched ({UNPATCH})",
            )


def _is_capture_hook(hook: Any) -> bool:
    """transformers' own output-capturing hooks (installed once a model is asked for
    `output_attentions` / `output_hidden_states`): inert unless those are asked for, which the
    patched forward refuses or serves itself."""
    return getattr(hook, "__module__", None) == "transformers.utils.output_capturing"


def _is_fsdp_hook(hook: Any) -> bool:
    """FSDP2's own gather and reduce hooks (`fully_shard` on a module): on a module the blocks bypass
    they never run, its parameters are never gathered, and the block that reads them says so (E0811,
    naming the parameter), so they are let be here."""
    return str(getattr(hook, "__module__", None)).startswith("torch.distributed.fsdp")


def _fsdp_class(m: Any, cls: type) -> bool:
    """`m`'s class is the one FSDP2's `fully_shard` makes of `cls` (FSDP<cls>: FSDPModule and `cls`)."""
    bases = type(m).__bases__
    return len(bases) == 2 and bases[1] is cls and bases[0].__module__.startswith("torch.distributed.fsdp")


def _hook_name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or type(hook).__name__


def module_hooks(m: Any) -> list[str]:
    """The module's forward / backward hooks and pre-hooks (with_kwargs ones among them), but for
    transformers' inert output-capturing hooks and FSDP2's own."""
    kinds = (
        ("forward hook", m._forward_hooks),
        ("forward pre-hook", m._forward_pre_hooks),
        ("backward hook", m._backward_hooks),
        ("backward pre-hook", m._backward_pre_hooks),
    )
    return [
        f"a {kind} ({_hook_name(h)})"
        for kind, d in kinds
        for h in d.values()
        if not (_is_capture_hook(h) or _is_fsdp_hook(h))
    ]


def global_hooks() -> list[str]:
    """Hooks registered for every module (torch.nn.modules.module.register_module_forward_hook and
    the like)."""
    m = torch_module
    kinds = (
        ("global forward hook", m._global_forward_hooks),
        ("global forward pre-hook", m._global_forward_pre_hooks),
        ("global backward hook", m._global_backward_hooks),
        ("global backward pre-hook", m._global_backward_pre_hooks),
    )
    return [f"a {kind} ({_hook_name(h)})" for kind, d in kinds for h in d.values()]


def global_refusal(hooks: list[str]) -> ValueError:
    return refuse(
        ", ".join(hooks),
        "registered for every module (torch.nn.modules.module.register_module_forward_hook and the "
        "like), but the patched forward runs the layers' modules fused in coda blocks without calling "
        "them, so it would run for the model and not for them",
        f"remove it for the patched model's forwards, or run the model unpatched ({UNPATCH})",
    )


def module_trouble(m: Any, cls: type, forward: Any = None, hooks: bool = True) -> str | None:
    """Why the blocks can't stand in for module `m` (expected of class `cls`, its instance `forward`
    attribute `forward`), or None: a peft or bitsandbytes layer, a parametrization, another class, a
    forward replaced on the instance, hooks (`hooks`)."""
    what = foreign(m) if type(m) is not cls else None  # (a LoRA layer recorded at patching is let be)
    if what is not None:
        return f"{what[0]}: {what[1]}"
    if parametrize.is_parametrized(m):
        names = ", ".join(m.parametrizations)
        return (
            f"a parametrization of {names} (torch.nn.utils.parametrize): the fused blocks read the stored "
            "parameter, not its parametrized value; remove it (parametrize.remove_parametrizations) or "
            "train the model unpatched"
        )
    if type(m) is not cls and not _fsdp_class(m, cls):
        return (
            f"a {class_name(m)}, not the {class_name(cls)} the fused blocks stand in for; "
            "run this model unpatched, or restore the module"
        )
    if m.__dict__.get("forward") is not forward:
        by = " by accelerate's hooks" if hasattr(m, "_hf_hook") else ""
        return f"its forward was replaced on the instance{by}: {BYPASSED}; run the model unpatched"
    found = module_hooks(m) if hooks else []
    if found:
        return (
            f"{', '.join(found)} registered on it: {BYPASSED}; remove it, hook the causal LM itself "
            f"(whose forward runs), or run the model unpatched ({UNPATCH})"
        )
    return None


def family_classes(model: Any, family: Family) -> dict[str, type]:
    """The classes of the family's modules that the blocks stand in for: from the module that
    defines the model's class (transformers' modeling_<family>.py)."""
    # lazy: transformers is imported by whoever made the model; the patch alone does not need it
    from transformers.activations import ACT2FN

    modeling = sys.modules[type(model).__module__]
    prefix = family.model_class.removesuffix("ForCausalLM")
    out = {k: getattr(modeling, prefix + k) for k in ("RMSNorm", "Attention", "MLP", "RotaryEmbedding")}
    out["Model"] = getattr(modeling, family.base_class or prefix + "Model")
    out["act"] = type(ACT2FN[getattr(model.config, family.act_config)])
    out["Linear"] = torch.nn.Linear
    return out


def norm_names(family: Family) -> list[str]:
    """The names of a decoder layer's norm modules in the family: its input norm (with pre-norms) and
    those its own block reads (`layer_norms`)."""
    return (["input_layernorm"] if family.pre_norm else []) + list(layer_norms(family).values())


def bypassed_modules(model: Any, family: Family) -> list[tuple[str, Any, type]]:
    """(path, module, expected class) of every module whose work the patched forward does in its
    blocks without calling it, in the unpatched model (the projections to fuse among them): the
    base model, the LM head, the rotary embedding, the final norm, and per layer its attention (its
    projections and q/k norms), MLP (projections, activation), norms (`norm_names`) and (Phi-3)
    residual dropouts. The decoder layers, the embedding (called) and the causal LM itself are not
    among them. `check_model` has made sure that each norm is there."""
    c = family_classes(model, family)
    base = model.model
    out = [
        ("model", base, c["Model"]),
        ("lm_head", model.lm_head, c["Linear"]),
        ("model.rotary_emb", base.rotary_emb, c["RotaryEmbedding"]),
        ("model.norm", base.norm, c["RMSNorm"]),
    ]
    norms = norm_names(family)
    for i, layer in enumerate(base.layers):
        p = f"model.layers.{i}"
        out += [
            (f"{p}.self_attn", layer.self_attn, c["Attention"]),
            (f"{p}.mlp", layer.mlp, c["MLP"]),
        ]
        out += [(f"{p}.{n}", getattr(layer, n), c["RMSNorm"]) for n in norms]
        for n in (*family.qkv_parts, "o_proj", "q_norm", "k_norm"):
            sub = getattr(layer.self_attn, n, None)
            if sub is not None:
                out.append((f"{p}.self_attn.{n}", sub, c["RMSNorm"] if n.endswith("norm") else c["Linear"]))
        for n in (*family.gate_up_parts, "down_proj"):
            sub = getattr(layer.mlp, n, None)
            if sub is not None:  # (gate and up are one parameter once patched)
                out.append((f"{p}.mlp.{n}", sub, c["Linear"]))
        act = family.act_name
        out.append((f"{p}.mlp.{act}", getattr(layer.mlp, act), c["act"]))
        out += [(f"{p}.{n}", getattr(layer, n), torch.nn.Dropout) for n in family.resid_dropouts]
    return out


def check_model(model: Any, family: Family) -> None:
    """Raise `refuse(...)` for the first thing about `model` that the blocks of `family` can't run."""
    name = type(model).__name__
    if type(model).__module__.split(".")[0] == "peft":
        raise refuse(
            f"{name} (a peft model's tuner)",
            "patch the PeftModel (get_peft_model's result) or its base model",
        )
    if name != family.model_class:
        raise refuse(name, f"apply_coda_to_{family.name} patches a transformers {family.model_class}")
    if getattr(model, "_coda", None) is not None:
        raise refuse(
            name,
            "this model is patched already",
            "coda_lang.hf.unpatch(model) first to patch it again (e.g. with other loss settings)",
        )
    cfg = model.config
    if str(model.dtype).removeprefix("torch.") not in DTYPES:
        raise refuse(f"dtype {model.dtype}", "coda blocks run in bfloat16, float16 or float32")
    if getattr(cfg, "attention_bias", False):
        raise refuse("attention_bias=True", "the fused QKV and out-projection blocks have no bias")
    if getattr(cfg, "mlp_bias", False):
        raise refuse("mlp_bias=True", "the fused MLP block has no bias")
    act = getattr(cfg, family.act_config, None)
    if act != family.activation:
        mlp = {
            "silu": "SwiGLU (silu)",
            "gelu_pytorch_tanh": "GeGLU (gelu_pytorch_tanh: GELU, tanh-approximated)",
        }
        raise refuse(
            f"{family.act_config}={act!r}",
            f"the {family.model_class}'s MLP block is {mlp[family.activation]}",
        )
    if getattr(cfg, "use_bidirectional_attention", False):
        raise refuse(
            "use_bidirectional_attention=True",
            "the patched forward makes the causal (and sliding-window causal) masks of a causal LM",
            "train this model unpatched",
        )
    check_layer_kinds(cfg, family)
    if (
        getattr(cfg, "loss_type", None) not in (None, "ForCausalLM")
        or model.__dict__.get("loss_type") not in (None, "ForCausalLM")
        or "_loss_function" in model.__dict__
    ):
        raise refuse(
            "a loss function of the model's own (loss_type / model.loss_function)",
            "the fused LM head computes transformers' causal-LM cross-entropy",
            "train this model unpatched",
        )
    check_rope(model, family)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for n in (*family.qkv_parts, "o_proj"):
            proj = getattr(attn, n, None)
            biased = family.qkv_bias and n != "o_proj"  # (Qwen2's q, k and v have biases)
            if proj is None or (
                foreign(proj) is None and (getattr(proj, "bias", None) is not None) != biased
            ):
                raise refuse(
                    f"layer {i}: self_attn.{n}", f"missing or {'without' if biased else 'has'} a bias"
                )
        if family.qk_norm and (
            getattr(attn, "q_norm", None) is None or getattr(attn, "k_norm", None) is None
        ):
            raise refuse(f"layer {i}", f"{family.model_class}'s attention without q_norm/k_norm")
        for n in norm_names(family):
            if getattr(layer, n, None) is None:
                raise refuse(f"layer {i}: {n}", f"missing: the {family.model_class}'s layers have one")
    for path, m, cls in bypassed_modules(model, family):
        if cls is torch.nn.Linear and is_lora(m) and path.rpartition(".")[2] in LORA_TARGETS:
            check_lora(path, m, family.qkv_bias and path.endswith(QKV_PROJ))
            continue
        # the base model's hooks run when it is called alone; the causal LM's forward refuses them
        why = module_trouble(m, cls, hooks=path != "model")
        if why is not None:
            raise refuse(path, why)
        if (
            cls is torch.nn.Linear
            and m.bias is not None
            and not (family.qkv_bias and path.endswith(QKV_PROJ))
        ):
            raise refuse(path, "has a bias, which the fused blocks don't add")
    hooks = global_hooks()
    if hooks:
        raise global_refusal(hooks)
    check_norms(model, family)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        check_fused_parts(f"model.layers.{i}.self_attn", attn, family.qkv_parts, fused_qkv_name(i))
        if family.qkv_bias:
            bias = fused_qkv_name(i).replace("weight", "bias")
            check_fused_parts(f"model.layers.{i}.self_attn", attn, family.qkv_parts, bias, "bias")
        check_fused_parts(
            f"model.layers.{i}.mlp", mlp, family.gate_up_parts, f"model.layers.{i}.mlp.gate_up_weight"
        )
    check_widths(model, model.dtype)


def rope_tables(model: Any, family: Family) -> list[tuple[str, Any, Any, Any]]:
    """(where, rope type, attention scaling, inv_freq) of each RoPE the rotary embedding computes: its
    one (`model.rotary_emb`), or (Gemma 3: `Family.rope_kinds`) one per kind of layer
    (`model.rotary_emb[<kind>]`, from its `<kind>_inv_freq`, `<kind>_attention_scaling` and
    `rope_type[<kind>]`)."""
    rope = model.model.rotary_emb
    if not family.rope_kinds:
        return [("model.rotary_emb", rope.rope_type, rope.attention_scaling, rope.inv_freq)]
    return [
        (
            f"model.rotary_emb[{kind!r}]",
            rope.rope_type.get(kind),
            getattr(rope, f"{kind}_attention_scaling", None),
            getattr(rope, f"{kind}_inv_freq", None),
        )
        for kind in dict.fromkeys(layer_kinds(family, model.config))
    ]


def check_rope(model: Any, family: Family) -> None:
    """RoPE the QKV blocks compute: inverse frequencies fixed at patching (the `inv_freq` the rotary
    embedding holds, of a rope type that changes it only when set, never per call), cos and sin
    unscaled (`attention_scaling` 1), and every column of each q and k head rotated (no partial
    rotary factor); each kind of layer's RoPE so (Gemma 3's local and global layers: `rope_tables`)."""
    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for where, rope_type, scaling, inv in rope_tables(model, family):
        if inv is None:
            raise refuse(
                where, "the rotary embedding has no inv_freq for this kind of layer", "train it unpatched"
            )
        if rope_type not in ROPE_TYPES:
            why = ROPE_WHY.get(rope_type, "it scales cos/sin or changes inv_freq per call")
            raise refuse(
                f"rope_type={rope_type!r}" + (f" ({where})" if family.rope_kinds else ""),
                f"{why}; the QKV blocks rotate q and k by fixed frequencies, unscaled; supported: "
                f"{', '.join(ROPE_TYPES)}",
                "train this model unpatched (or with Liger Kernel)",
            )
        if float(scaling) != 1.0:
            raise refuse(
                f"RoPE attention_scaling={scaling}" + (f" ({where})" if family.rope_kinds else ""),
                "transformers multiplies cos and sin by it; the QKV blocks don't: only 1.0 is supported",
                "train this model unpatched",
            )
        if inv.numel() * 2 != hd:
            params = getattr(cfg, "rope_parameters", None) or {}
            factor = params.get("partial_rotary_factor")
            raise refuse(
                f"partial rotary embedding (partial_rotary_factor={factor}: {2 * inv.numel()} of "
                f"head_dim {hd} columns rotated)",
                "the QKV blocks rotate every column of each q and k head",
                "use partial_rotary_factor=1.0, or train this model unpatched",
            )


# why a rope type is not supported, where more can be said than that it is not among ROPE_TYPES
ROPE_WHY = {
    "longrope": (
        "LongRoPE (Phi-3's 128k variants, Phi-3.5: `rope_scaling` of type longrope or su) scales cos "
        "and sin by its attention factor and switches between its short and long factors with the "
        "sequence length at each call (Phi-3's 4k variants use the default RoPE, which is supported)"
    ),
    "dynamic": "dynamic NTK scaling changes inv_freq with the sequence length at each call",
    "yarn": "YaRN scales cos and sin by its attention factor",
}


def check_layer_kinds(cfg: Any, family: Family) -> None:
    """Sliding-window attention only where the family's attention has it (masks.py), and no kind of
    layer but full and sliding-window attention."""
    if family.sliding is None:
        if getattr(cfg, "use_sliding_window", False) or any(
            t != FULL for t in (getattr(cfg, "layer_types", None) or [])
        ):
            raise refuse(
                "sliding-window attention", f"the {family.model_class}'s attention has no sliding window"
            )
        return
    other = sorted(set(layer_kinds(family, cfg)) - {FULL, SLIDING})
    if other:
        raise refuse(
            f"layer_types {other}", f"the patched layers run {FULL!r} and {SLIDING!r} attention only"
        )


def check_norms(model: Any, family: Family) -> None:
    """Each RMSNorm's epsilon (its `Family.eps_attr`: `variance_epsilon`, Gemma's `eps`) is the
    config's `rms_norm_eps`, which the blocks are built with."""
    eps = model.config.rms_norm_eps
    norm = family_classes(model, family)["RMSNorm"]
    for path, m in model.named_modules():
        e = m.__dict__.get(family.eps_attr) if isinstance(m, norm) else None
        if e is not None and e != eps:
            raise refuse(
                f"{path}.{family.eps_attr}={e}",
                f"the blocks are built with config.rms_norm_eps={eps}, for every norm",
                "make them agree before patching",
            )


def fused_qkv_name(i: int) -> str:
    """Where layer `i`'s fused QKV weight is in a patched model (checkpoint.py moves it to the module
    whose forward reads it)."""
    return ("model.coda_first" if i == 0 else f"model.layers.{i - 1}.coda_next") + ".self_attn.qkv_weight"


def check_fused_parts(
    path: str, parent: Any, names: tuple[str, ...], fused: str, kind: str = "weight"
) -> None:
    """The weights (`kind`; or the biases) of `parent`'s projections `names`, which patching makes
    one parameter `fused`: what each carries must be one for all (requires_grad, dtype, device, a
    plain Parameter, no gradient hooks), since the fused parameter has one of each."""
    ws = [getattr(getattr(parent, n), kind) for n in names]
    first = names[0]
    for n, w in zip(names, ws, strict=True):
        if type(w) is not torch.nn.Parameter:
            raise refuse(
                f"{path}.{n}.{kind}",
                f"a {class_name(w)}, not a torch.nn.Parameter (a sharded or quantized tensor): fusing "
                f"{', '.join(names)} into {fused} would drop what it carries",
                "patch the model before sharding or quantizing it",
            )
        hooks = [h for h in (w._backward_hooks, getattr(w, "_post_accumulate_grad_hooks", None)) if h]
        if hooks:
            raise refuse(
                f"{path}.{n}.{kind}",
                f"a gradient hook (register_hook / register_post_accumulate_grad_hook) on it: patching "
                f"replaces {', '.join(names)} by one parameter {fused}, and the hook would never run",
                f"register it after patching, on {fused} (coda_lang.hf.unfused_grads splits "
                "its gradient into the projections')",
            )
    for n, w in zip(names[1:], ws[1:], strict=True):
        if w.requires_grad != ws[0].requires_grad:
            raise refuse(
                f"{path}.{n}.{kind}.requires_grad={w.requires_grad}",
                f"{first}'s is {ws[0].requires_grad}, and patching makes {', '.join(names)} one "
                f"parameter {fused} with one requires_grad flag",
                f"freeze all of them or none before patching (after patching, {fused}."
                "requires_grad_(False) freezes them all)",
            )
        if w.dtype != ws[0].dtype or w.device != ws[0].device:
            raise refuse(
                f"{path}.{n}.{kind}",
                f"{w.dtype} on {w.device}, {first}'s {ws[0].dtype} on {ws[0].device}: patching makes "
                f"{', '.join(names)} one parameter {fused}, of one dtype on one device",
                "convert the model to one dtype and device before patching (model.to(...))",
            )


def check_widths(model: Any, dtype: torch.dtype) -> None:
    """The widths the blocks' kernels load and store rows of: each a multiple of 16 bytes (TMA), on
    the CPU too (the stand-ins keep the kernels' limits, so that what runs there runs on a GPU)."""
    cfg = model.config
    h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // h
    step = 16 // dtype.itemsize
    name = str(dtype).removeprefix("torch.")
    vocab = model.lm_head.weight.shape[0]
    if vocab % step:
        raise refuse(
            f"a vocabulary of {vocab} tokens",
            f"the LM head's kernels store rows of logits with TMA, which needs rows of a multiple of 16 "
            f"bytes: in {name} a vocabulary of a multiple of {step} (the CPU's stand-ins keep the "
            "kernels' limits)",
            f"pad the vocabulary before patching (model.resize_token_embeddings(n, pad_to_multiple_of="
            f"{step}): the padding tokens' logits then join the softmax), or train the model unpatched",
        )
    for what, n in (
        ("hidden_size", cfg.hidden_size),
        ("intermediate_size", cfg.intermediate_size),
        ("num_attention_heads * head_dim", h * hd),
        ("(num_attention_heads + 2 * num_key_value_heads) * head_dim", (h + 2 * kv) * hd),
    ):
        if n % step:
            raise refuse(
                f"{what} = {n}",
                f"the blocks' kernels load and store rows of it with TMA, which needs rows of a "
                f"multiple of 16 bytes: in {name} a multiple of {step}",
                "train this model unpatched",
            )
