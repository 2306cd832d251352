"""coda_lang.hf's contract: a patched model never ignores what the user changed (issue 32).

On the CPU with the tiny models of tests/test_hf.py, each thing the fused forward would bypass is a
clear ValueError naming it ("coda_lang.hf: <what>: <why>; <what to do>"), at patching or at the
forward: hooks on a bypassed module (or global ones), a module replaced or re-classed (peft's LoRA
layers, bitsandbytes' quantized ones, a parametrization), a forward replaced on the instance, a
changed config field or norm epsilon, what fusing q/k/v and gate/up would merge (requires_grad,
dtype, device, gradient hooks). What it honours matches the unpatched model: a hook on the embedding
or on the base model called alone, left and middle padding, `return_dict=False`, a dtype changed
after patching (the blocks are rebuilt), gradients present before patching; a deep copy or pickle is
a patched model of its own; `unpatch` gives back the Hugging Face model exactly, generation included.
Each test fails on a mutant that drops what it covers (a check removed, the attention mask ignored).
"""

from __future__ import annotations

import copy
import pickle
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import FAMILIES, FIRST, KNOWN, VOCAB, batch, each, make, patch, rel, run  # noqa: E402

import coda_lang  # noqa: E402
from coda_lang.hf import apply_coda_to_llama, unfused_grads, unpatch  # noqa: E402

nn = torch.nn


def pair(family: str = "llama", **over: Any) -> tuple[Any, Any]:
    """An unpatched model and a patched copy of it."""
    ref = make(family, **over)
    return ref, patch(family, copy.deepcopy(ref))


def refused(match: str) -> Any:
    return pytest.raises(ValueError, match=match)


@pytest.fixture(scope="module")
def patched() -> dict[str, Any]:
    """A patched model of each family, shared by the tests that add something and take it away again
    (each removes its hook or restores its module, in a `finally`)."""
    return {f: patch(f, make(f)) for f in FAMILIES}


# ---- hooks on the modules the fused forward bypasses ----

HOOKS = {
    "forward": lambda m: m.register_forward_hook(lambda mod, args, out: out),
    "forward, with_kwargs": lambda m: m.register_forward_hook(lambda mod, a, kw, out: out, with_kwargs=True),
    "forward, always_call": lambda m: m.register_forward_hook(lambda mod, args, out: out, always_call=True),
    "pre": lambda m: m.register_forward_pre_hook(lambda mod, args: None),
    "pre, with_kwargs": lambda m: m.register_forward_pre_hook(lambda mod, a, kw: None, with_kwargs=True),
    "full backward": lambda m: m.register_full_backward_hook(lambda mod, gi, go: None),
    "full backward pre": lambda m: m.register_full_backward_pre_hook(lambda mod, go: None),
}
BYPASSED = [
    "model",  # the base model: the causal LM's forward does not call it
    "lm_head",
    "model.rotary_emb",
    "model.norm",
    "model.layers.0.self_attn",
    "model.layers.0.self_attn.o_proj",
    "model.layers.1.mlp",
    "model.layers.1.mlp.down_proj",
    "model.layers.0.mlp.act_fn",
    "model.layers.0.input_layernorm",
    "model.layers.1.post_attention_layernorm",
]
CASES = [("llama", p, k) for p in BYPASSED for k in HOOKS]
CASES += [
    ("qwen3", p, k)
    for p in ("model.layers.0.self_attn.q_norm", "model.layers.1.self_attn.k_norm")
    for k in HOOKS
]
CASES += [(f, p, "forward") for f in ("qwen3", "mistral") for p in BYPASSED]
CASES += [("ministral", p, "pre") for p in BYPASSED[2:6]]
CASES += [("qwen2", p, "forward") for p in ("model.layers.0.self_attn", "model.layers.0.coda_next.self_attn")]
CASES += [
    ("granite", p, "forward")
    for p in ("model", "model.layers.1.mlp", "model.layers.1.post_attention_layernorm")
]
# Phi-3's own modules: its MLP's activation (`activation_fn`), the residual dropouts, its fused QKV
CASES += [
    ("phi3", p, k)
    for p in (
        "model.layers.0.mlp.activation_fn",
        "model.layers.1.resid_attn_dropout",
        "model.layers.0.resid_mlp_dropout",
        "model.layers.0.coda_next.self_attn",
        "model.layers.1.mlp",
    )
    for k in ("forward", "pre")
]
# the containers patching moves weights into (their forwards never run either)
CASES += [
    ("llama", p, "forward")
    for p in ("model.coda_first", "model.coda_first.self_attn", "model.layers.0.coda_next")
]
CASES += [("qwen3", "model.layers.0.coda_next.self_attn", "pre")]


@pytest.mark.parametrize(("family", "path", "kind"), CASES)
def test_a_hook_on_a_bypassed_module_is_refused(family: str, path: str, kind: str, patched: Any) -> None:
    """The issue's first rows: a forward hook on `layers[0].mlp` fired 0 times (unpatched: once) and an
    ablation hook changed nothing. Every kind of module hook, on every module whose work the blocks do,
    is refused at the forward, naming the module; removed, the model runs again."""
    model = patched[family]
    ids, labels = batch()
    handle = HOOKS[kind](model.get_submodule(path))
    try:
        with refused(rf"coda_lang.hf: {path}: a .*hook .*registered on it: .*never calls it.*; remove it"):
            model(ids, labels=labels)
    finally:
        handle.remove()
    model(ids, labels=labels)


def test_hooks_that_run_are_honoured() -> None:
    """The base model called alone runs its own hooks (the causal LM's forward, which bypasses it,
    refuses them); the embedding, which the forward calls, runs its hooks: an ablation hook there gives
    the unpatched model's loss and gradients."""
    ref, pat = pair()
    ids, labels = batch()
    calls: list[int] = []
    h = pat.model.register_forward_hook(lambda m, a, out: calls.append(1))
    want = ref.model(ids).last_hidden_state
    assert rel(pat.model(ids).last_hidden_state, want) < 1e-5 and calls == [1]
    with refused("coda_lang.hf: model: a forward hook"):
        pat(ids)
    h.remove()
    for m in (ref, pat):
        m.model.embed_tokens.register_forward_hook(lambda mod, args, out: out * 0.5)
    l0, z0, g0 = run(ref, ids, labels)
    l1, z1, g1 = run(pat, ids, labels)
    assert rel(l1, l0) < 1e-5 and rel(z1, z0) < 1e-5
    for name in g0:
        assert rel(g1[name], g0[name]) < 1e-5, name


def test_a_decoder_layer_runs_its_hooks_and_refuses_changed_tensors() -> None:
    """A patched decoder layer is called as a module (FSDP2 and activation checkpointing hook it), so a
    hook on it runs, once per forward as unpatched. Its arguments and outputs are the patched layer's
    (the residual stream and the QKV tile made from it): a hook or wrapper that changes one would not
    change the other, so a changed input or output is refused, not half-honoured."""
    ref, pat = pair()
    ids, labels = batch()
    calls: dict[str, int] = {"ref": 0, "pat": 0}
    for name, m in (("ref", ref), ("pat", pat)):
        m.model.layers[1].register_forward_hook(
            lambda mod, a, out, name=name: calls.__setitem__(name, calls[name] + 1)
        )
    l0, _, _ = run(ref, ids, labels)
    l1, _, _ = run(pat, ids, labels)
    assert calls == {"ref": 2, "pat": 2} and rel(l1, l0) < 1e-5  # (run: a loss and a logits forward)
    layer = pat.model.layers[0]
    h = layer.register_forward_hook(lambda mod, a, out: (out[0] * 0.5, out[1]))
    with refused(
        r"coda_lang.hf: model.layers.0: its outputs were changed on the way out .*run the model unpatched"
    ):
        pat(ids, labels=labels)
    h.remove()
    h = layer.register_forward_pre_hook(lambda mod, a: (a[0] + 1.0, *a[1:]))
    with refused(r"coda_lang.hf: model.layers.0: its inputs were changed on the way in"):
        pat(ids, labels=labels)
    h.remove()
    assert rel(pat(ids, labels=labels).loss, l0) < 1e-5


GLOBAL = {
    "forward hook": lambda: nn.modules.module.register_module_forward_hook(lambda m, a, out: None),
    "forward pre-hook": lambda: nn.modules.module.register_module_forward_pre_hook(lambda m, a: None),
    "backward hook": lambda: nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: None),
    "backward pre-hook": lambda: nn.modules.module.register_module_full_backward_pre_hook(lambda m, go: None),
}


@pytest.mark.parametrize("kind", sorted(GLOBAL))
def test_a_global_hook_is_refused(kind: str, patched: Any) -> None:
    """A hook for every module would run for the causal LM and not for the modules it bypasses."""
    model = patched["llama"]
    ids, _ = batch()
    handle = GLOBAL[kind]()
    try:
        with refused(f"coda_lang.hf: a global {kind} "):
            model(ids)
        with refused(f"coda_lang.hf: a global {kind} "):
            model.model(ids)
    finally:
        handle.remove()
    model(ids)


def test_transformers_capture_hooks_are_not_refused() -> None:
    """transformers installs inert output-capturing hooks on the attention modules the first time a
    model is asked for attentions: a model so used before patching still patches and runs."""
    ref = make("llama")
    ids, _ = batch()
    ref(ids, output_attentions=True)
    assert ref.model.layers[0].self_attn._forward_hooks
    pat = apply_coda_to_llama(copy.deepcopy(ref))
    assert rel(pat(ids).logits, ref(ids).logits) < 1e-5


@pytest.mark.parametrize(
    "path",
    [
        "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
        "model.layers.0.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
        "model.layers.0.mlp",
        "model.layers.1.mlp.act_fn",
        "lm_head",
    ],
)
def test_a_hook_before_patching_is_refused_at_patching(path: str) -> None:
    """A hook on a projection that fusing removes would be lost for good: refused when patching (as any
    hook on a bypassed module), and nothing is patched."""
    model = make("llama")
    model.get_submodule(path).register_forward_hook(lambda m, a, out: out)
    with refused(rf"coda_lang.hf: {path}: a forward hook"):
        apply_coda_to_llama(model)
    assert getattr(model, "_coda", None) is None and hasattr(model.model.layers[0].self_attn, "q_proj")


@pytest.mark.parametrize(
    "path",
    [
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.1.mlp.gate_up_proj",
        "model.layers.1.mlp.activation_fn",
        "model.layers.0.resid_attn_dropout",
    ],
)
def test_a_hook_on_phi3s_own_modules_is_refused_at_patching(path: str) -> None:
    """Phi-3's fused checkpoint projections (which patching reorders into coda's layouts), its MLP's
    activation and its residual dropouts: a hook on one is refused when patching, nothing patched."""
    model = make("phi3")
    model.get_submodule(path).register_forward_hook(lambda m, a, out: out)
    with refused(rf"coda_lang.hf: {path}: a forward hook"):
        patch("phi3", model)
    assert getattr(model, "_coda", None) is None and hasattr(model.model.layers[0].self_attn, "qkv_proj")


# ---- modules replaced, re-classed, parametrized; forwards replaced ----


class Doubled(nn.Linear):
    def forward(self, x: Any) -> Any:
        return 2 * super().forward(x)


def _linear_like(m: Any, cls: type = nn.Linear) -> Any:
    new = cls(m.in_features, m.out_features, bias=False)
    new.weight = nn.Parameter(m.weight.detach().clone())
    return new


def _family_module(model: Any, name: str, *args: Any) -> Any:
    import sys

    modeling = sys.modules[type(model).__module__]
    return getattr(modeling, "Llama" + name)(*args)


REPLACED = {
    "model.layers.0.mlp.down_proj": lambda model, m: _linear_like(m, Doubled),
    "model.layers.1.self_attn.o_proj": lambda model, m: _linear_like(m),  # the same class
    "model.layers.0.mlp.act_fn": lambda model, m: nn.GELU(),
    "model.layers.1.input_layernorm": lambda model, m: _family_module(model, "RMSNorm", 64, 1e-6),
    "model.layers.0.post_attention_layernorm": lambda model, m: nn.Identity(),
    "model.norm": lambda model, m: nn.Identity(),
    "model.rotary_emb": lambda model, m: _family_module(model, "RotaryEmbedding", model.config),
    "model.layers.1.mlp": lambda model, m: _family_module(model, "MLP", model.config),
    "model.layers.0.self_attn": lambda model, m: _family_module(model, "Attention", model.config, 0),
    "lm_head": lambda model, m: _linear_like(m),
    "model.layers.1": lambda model, m: copy.deepcopy(m),
    "model.layers": lambda model, m: nn.ModuleList(list(m)),
    "model": lambda model, m: copy.deepcopy(m),
}


def swap(model: Any, path: str, new: Any) -> Any:
    """Put `new` at `path` as a user would (`parent.<name> = new`), and return what undoes it. A module
    patching moved (an input norm, the final norm, Qwen3's q/k norms) is reachable at its Hugging Face
    place through a plain attribute: setting it registers the new module there."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    if name in parent._modules:
        old = parent._modules[name]
        parent._modules[name] = new

        def undo() -> None:
            parent._modules[name] = old

        return undo
    old = parent.__dict__[name]
    setattr(parent, name, new)

    def undo_alias() -> None:
        del parent._modules[name]
        object.__setattr__(parent, name, old)

    return undo_alias


@pytest.mark.parametrize("path", sorted(REPLACED))
def test_a_module_replaced_after_patching_is_refused(path: str, patched: Any) -> None:
    """The issue's `down_proj` replaced (output x2) and `act_fn` set to GELU, and every other module
    the blocks stand in for (at its Hugging Face place, also where patching moved it from): refused,
    naming the module and what replaced it."""
    model = patched["llama"]
    ids, labels = batch()
    undo = swap(model, path, REPLACED[path](model, model.get_submodule(path)))
    try:
        with refused(rf"coda_lang.hf: {path}: replaced after patching by a .*; coda_lang.hf.unpatch"):
            model(ids, labels=labels)
    finally:
        undo()
    model(ids, labels=labels)


@pytest.mark.parametrize(
    "path",
    ["model.layers.0.mlp.act_fn", "model.layers.1.self_attn.o_proj", "model.norm", "model.layers.0.mlp"],
)
def test_a_module_reclassed_or_its_forward_replaced_is_refused(path: str, patched: Any) -> None:
    """A module whose class changed in place (`m.__class__ = ...`), whose forward was replaced on the
    instance (as accelerate's hooks and Liger's instance patches do), or that lost a child."""
    model = patched["llama"]
    ids, _ = batch()
    m = model.get_submodule(path)
    cls = type(m)
    m.__class__ = type("Other", (cls,), {})
    try:
        with refused(rf"coda_lang.hf: {path}: a .*Other, not the .*{cls.__name__}"):
            model(ids)
    finally:
        m.__class__ = cls
    m.forward = lambda *a, **k: None
    try:
        with refused(rf"coda_lang.hf: {path}: its forward was replaced on the instance"):
            model(ids)
    finally:
        del m.forward
    model(ids)


PHI3_REPLACED = {
    "model.layers.0.mlp.activation_fn": lambda m: nn.GELU(),
    "model.layers.1.resid_mlp_dropout": lambda m: nn.Dropout(0.1),
    "model.layers.0.resid_attn_dropout": lambda m: nn.Identity(),
    "model.layers.1.mlp.down_proj": lambda m: _linear_like(m, Doubled),
    "model.layers.1.input_layernorm": lambda m: copy.deepcopy(m),
}


@pytest.mark.parametrize("path", sorted(PHI3_REPLACED))
def test_a_phi3_module_replaced_after_patching_is_refused(path: str, patched: Any) -> None:
    """Phi-3's activation (`activation_fn`), its residual dropouts (one swapped for dropout of p 0.1, one
    for an identity), a projection and a moved norm (at its Hugging Face place), each replaced after
    patching: refused at the forward, naming the module."""
    model = patched["phi3"]
    ids, labels = batch()
    undo = swap(model, path, PHI3_REPLACED[path](model.get_submodule(path)))
    try:
        with refused(rf"coda_lang.hf: {path}: replaced after patching by a .*; coda_lang.hf.unpatch"):
            model(ids, labels=labels)
    finally:
        undo()
    model(ids, labels=labels)


def test_a_child_added_or_removed_is_refused() -> None:
    """A projection put back on a patched attention (its q, k, v are one fused parameter) would be
    ignored; an activation deleted would be too."""
    ids, _ = batch()
    _, pat = pair()
    attn = pat.model.layers[0].self_attn
    attn.q_proj = nn.Linear(64, 64, bias=False)
    with refused(
        r"coda_lang.hf: model.layers.0.self_attn: its submodules changed after patching \(now o_proj, q_proj\)"
    ):
        pat(ids)
    del attn.q_proj
    pat(ids)
    del pat.model.layers[1].mlp.act_fn
    with refused("coda_lang.hf: model.layers.1.mlp.act_fn: removed after patching"):
        pat(ids)


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("model.layers.0.self_attn.o_proj", "weight"),
        ("model.layers.1.mlp.down_proj", "weight"),
        ("model.layers.0.input_layernorm", "weight"),
        ("lm_head", "weight"),
        ("model.coda_first.self_attn", "qkv_weight"),
        ("model.layers.0.coda_next.self_attn", "qkv_weight"),
        ("model.layers.1.mlp", "gate_up_weight"),
    ],
)
def test_a_parametrization_is_refused(path: str, name: str, patched: Any) -> None:
    """The blocks read the stored parameter, not a parametrized value (torch.nn.utils.parametrize)."""
    from torch.nn.utils import parametrize

    class Half(nn.Module):
        def forward(self, w: Any) -> Any:
            return w * 0.5

    model = patched["llama"]
    ids, _ = batch()
    m = model.get_submodule(path)
    parametrize.register_parametrization(m, name, Half())
    try:
        with refused(rf"coda_lang.hf: {path}: a parametrization of {name}"):
            model(ids)
    finally:
        parametrize.remove_parametrizations(m, name, leave_parametrized=False)
    model(ids)
    fresh = make("llama")
    parametrize.register_parametrization(fresh.model.layers[0].self_attn.q_proj, "weight", Half())
    with refused(r"coda_lang.hf: model.layers.0.self_attn.q_proj: a parametrization of weight"):
        apply_coda_to_llama(fresh)


# ---- config fields and settings the blocks were built from ----


@pytest.mark.parametrize(
    ("field", "value", "family"),
    [
        ("rms_norm_eps", 1e-5, "llama"),
        ("hidden_act", "gelu", "llama"),
        ("rope_parameters", {"rope_type": "default", "rope_theta": 500000.0}, "llama"),
        ("head_dim", 32, "llama"),
        ("vocab_size", 128, "llama"),
        ("num_hidden_layers", 1, "llama"),
        ("num_key_value_heads", 4, "llama"),
        ("tie_word_embeddings", True, "llama"),
        ("loss_type", "ForMaskedLM", "llama"),
        ("sliding_window", 4, "mistral"),
        ("residual_multiplier", 0.5, "granite"),
        ("logits_scaling", 2.0, "granite"),
        ("embedding_multiplier", 2.0, "granite"),
        ("sliding_window", 8, "phi3"),
        (
            "rope_parameters",
            {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            "phi3",
        ),
        ("intermediate_size", 128, "phi3"),
    ],
)
def test_a_changed_config_field_is_refused(field: str, value: Any, family: str, patched: Any) -> None:
    """A config field the blocks were built from (or that transformers' forward reads, as
    num_hidden_layers; Mistral's window, Granite's multipliers), changed since patching."""
    model = patched[family]
    ids, _ = batch()
    cfg = model.config
    had = field in vars(cfg)
    old = vars(cfg).get(field)
    vars(cfg)[field] = value
    try:
        with refused(rf"coda_lang.hf: config.{field} = .*: it was .* when the model was patched"):
            model(ids)
    finally:
        if had:
            vars(cfg)[field] = old
        else:
            del vars(cfg)[field]
    model(ids)


def test_changed_settings_of_modules_are_refused() -> None:
    """A norm's epsilon and the rotary embedding's scaling, baked into the blocks; a loss function of
    the model's own; and a norm epsilon that disagrees with the config at patching."""
    ids, labels = batch()
    _, pat = pair()
    norm = pat.model.layers[1].post_attention_layernorm
    norm.variance_epsilon = 1e-3
    with refused(
        r"coda_lang.hf: model.layers.1.post_attention_layernorm.variance_epsilon = 0.001: it was 1e-06"
    ):
        pat(ids)
    norm.variance_epsilon = 1e-6
    pat.model.rotary_emb.attention_scaling = 2.0
    with refused(r"coda_lang.hf: model.rotary_emb.attention_scaling = 2.0"):
        pat(ids)
    pat.model.rotary_emb.attention_scaling = 1.0
    pat.loss_function = lambda *a, **k: 0.0
    with refused(r"coda_lang.hf: model.loss_function: set after patching"):
        pat(ids, labels=labels)
    del pat._loss_function
    pat.loss_type = "ForMaskedLM"
    with refused(r"coda_lang.hf: model.loss_type = 'ForMaskedLM': it was 'ForCausalLM'"):
        pat(ids, labels=labels)
    pat.loss_type = "ForCausalLM"
    pat(ids, labels=labels)
    model = make("llama")
    model.model.norm.variance_epsilon = 1e-5
    with refused(
        r"coda_lang.hf: model.norm.variance_epsilon=1e-05: the blocks are built with config.rms_norm_eps=1e-06"
    ):
        apply_coda_to_llama(model)


# ---- what fusing q/k/v and gate/up merges ----


@pytest.mark.parametrize(
    ("frozen", "fused"),
    [
        (["self_attn.v_proj"], "qkv_weight"),
        (["self_attn.q_proj"], "qkv_weight"),
        (["mlp.up_proj"], "gate_up_weight"),
        (["mlp.gate_proj"], "gate_up_weight"),
    ],
)
def test_partial_freezing_is_refused_at_patching(frozen: list[str], fused: str) -> None:
    """Freezing only v_proj (or up_proj) used to train it anyway, and freezing only q_proj froze k and v
    too: the fused parameter has one flag. Refused, saying how to freeze."""
    model = make("llama")
    for p in frozen:
        model.model.layers[1].get_submodule(p).weight.requires_grad_(False)
    with refused(
        rf"coda_lang.hf: model.layers.1.{frozen[0].split('.')[0]}\.\w+\.weight\.requires_grad=.*one requires_grad flag.*{fused}"
    ):
        apply_coda_to_llama(model)


def test_freezing_all_the_parts_is_honoured() -> None:
    """q, k and v (gate and up) all frozen before patching: the fused parameter is frozen, and the
    other gradients match the unpatched model's."""
    ref = make("llama")
    for n in ("q_proj", "k_proj", "v_proj"):
        ref.model.layers[0].self_attn.get_submodule(n).weight.requires_grad_(False)
    for n in ("gate_proj", "up_proj"):
        ref.model.layers[1].mlp.get_submodule(n).weight.requires_grad_(False)
    pat = apply_coda_to_llama(copy.deepcopy(ref))
    assert not pat.model.coda_first.self_attn.qkv_weight.requires_grad
    assert not pat.model.layers[1].mlp.gate_up_weight.requires_grad
    assert pat.model.layers[0].coda_next.self_attn.qkv_weight.requires_grad
    ids, labels = batch()
    l0, _, g0 = run(ref, ids, labels)
    l1, _, g1 = run(pat, ids, labels)
    assert set(g1) == set(g0) and rel(l1, l0) < 1e-5
    for name in g0:
        assert rel(g1[name], g0[name]) < 1e-5, name


@pytest.mark.parametrize(
    ("path", "how"),
    [
        ("self_attn.q_proj", "register_hook"),
        ("self_attn.k_proj", "register_post_accumulate_grad_hook"),
        ("mlp.up_proj", "register_hook"),
    ],
)
def test_a_gradient_hook_on_a_fused_weight_is_refused(path: str, how: str) -> None:
    """A parameter hook on a weight that fusing replaces would never run."""
    model = make("llama")
    getattr(model.model.layers[0].get_submodule(path).weight, how)(lambda *a: None)
    with refused(
        rf"coda_lang.hf: model.layers.0.{path}.weight: a gradient hook .*register it after patching"
    ):
        apply_coda_to_llama(model)


def test_gradient_hooks_on_weights_the_blocks_read_run() -> None:
    """A gradient hook on a weight that stays what it was (o_proj's) runs, as unpatched, and one on a
    fused weight registered after patching runs too."""
    ref, pat = pair()
    ids, labels = batch()
    seen: dict[str, list[Any]] = {"ref": [], "pat": [], "qkv": []}
    ref.model.layers[1].self_attn.o_proj.weight.register_hook(lambda g: seen["ref"].append(g.clone()))
    pat.model.layers[1].self_attn.o_proj.weight.register_hook(lambda g: seen["pat"].append(g.clone()))
    pat.model.coda_first.self_attn.qkv_weight.register_hook(lambda g: seen["qkv"].append(1))
    run(ref, ids, labels)
    run(pat, ids, labels)
    assert len(seen["pat"]) == len(seen["ref"]) == 1 and seen["qkv"] == [1]
    assert rel(seen["pat"][0], seen["ref"][0]) < 1e-5


def test_parts_of_another_dtype_device_or_tensor_type_are_refused() -> None:
    model = make("llama")
    model.model.layers[1].self_attn.v_proj.to(torch.bfloat16)
    with refused(
        r"coda_lang.hf: model.layers.1.self_attn.v_proj.weight: torch.bfloat16 on cpu, q_proj's torch.float32"
    ):
        apply_coda_to_llama(model)
    model = make("llama")
    model.model.layers[0].mlp.up_proj.to("meta")
    with refused(r"coda_lang.hf: model.layers.0.mlp.up_proj.weight: torch.float32 on meta"):
        apply_coda_to_llama(model)

    class Tagged(nn.Parameter):
        pass

    model = make("llama")
    proj = model.model.layers[0].self_attn.k_proj
    proj.weight = Tagged(proj.weight.detach())
    with refused(
        r"coda_lang.hf: model.layers.0.self_attn.k_proj.weight: a .*Tagged, not a torch.nn.Parameter"
    ):
        apply_coda_to_llama(model)


def test_gradients_present_before_patching_are_fused() -> None:
    """Gradients accumulated before patching (q/k/v and gate/up's among them) are kept: a backward
    after patching adds to them, as it would unpatched."""
    ref = make("llama")
    pat = copy.deepcopy(ref)
    ids, labels = batch()
    for m in (ref, pat):
        m(ids, labels=labels).loss.backward()
    apply_coda_to_llama(pat)
    ref(ids, labels=labels).loss.backward()
    pat(ids, labels=labels).loss.backward()
    got = unfused_grads(pat)
    for name, p in ref.named_parameters():
        assert rel(got[name], p.grad) < 1e-5, name


# ---- the adversarial list ----


def test_a_deep_copy_is_a_patched_model_of_its_own() -> None:
    """The base model's owner used to be a weak reference that a deep copy shared: `copy.model(...)`
    gave the original's hidden states. Now a copy runs its own weights, with blocks and a contract of
    its own (a hook on the copy's module refuses the copy only)."""
    ref, pat = pair()
    ids, labels = batch()
    cp = copy.deepcopy(pat)
    ref2 = copy.deepcopy(ref)
    with torch.no_grad():
        for m in (cp, ref2):
            for p in m.parameters():
                p.mul_(0.9)
    assert cp._coda is not pat._coda and cp._coda.first is not pat._coda.first
    assert rel(cp.model(ids).last_hidden_state, ref2.model(ids).last_hidden_state) < 1e-5
    assert rel(cp(ids, labels=labels).loss, ref2(ids, labels=labels).loss) < 1e-5
    assert rel(pat.model(ids).last_hidden_state, ref.model(ids).last_hidden_state) < 1e-5
    cp.model.layers[0].mlp.register_forward_hook(lambda m, a, out: out)
    with refused("coda_lang.hf: model.layers.0.mlp: a forward hook"):
        cp(ids)
    pat(ids)


def test_a_pickled_model_is_a_patched_model_of_its_own(tmp_path: Any) -> None:
    """`torch.save(model)` used to fail ("cannot pickle weakref"): now it saves, and loads as a patched
    model that trains as the original, with a contract on its own modules."""
    ref, pat = pair()
    ids, labels = batch()
    path = tmp_path / "model.pt"
    torch.save(pat, path)
    back = torch.load(path, weights_only=False)
    again = pickle.loads(pickle.dumps(pat))
    l0, z0, g0 = run(ref, ids, labels)
    for m in (back, again):
        l1, z1, g1 = run(m, ids, labels)
        assert rel(l1, l0) < 1e-5 and rel(z1, z0) < 1e-5
        for name in g0:
            assert rel(g1[name], g0[name]) < 1e-5, name
    back.model.norm.register_forward_pre_hook(lambda m, a: None)
    with refused("coda_lang.hf: model.norm: a forward pre-hook"):
        back(ids)
    again(ids)


def test_return_dict_false_returns_a_tuple_as_transformers_does() -> None:
    ref, pat = pair()
    ids, labels = batch()
    for kw in ({}, {"labels": labels}):
        want, got = ref(ids, return_dict=False, **kw), pat(ids, return_dict=False, **kw)
        assert isinstance(got, tuple) and isinstance(want, tuple)
        # the loss with labels (the logits are never made), else the logits
        assert rel(got[0], want[0]) < 1e-5
    base = pat.model(ids, return_dict=False)
    assert isinstance(base, tuple) and rel(base[0], ref.model(ids, return_dict=False)[0]) < 1e-5
    pat.config.return_dict = False
    assert isinstance(pat(ids), tuple) and isinstance(
        pat(ids, return_dict=True), transformers.modeling_outputs.ModelOutput
    )


@pytest.mark.parametrize("loss_mode", ["rows", "vocab"])
@pytest.mark.parametrize("extra", [3, -4])
def test_labels_of_another_length_are_refused(loss_mode: str, extra: int) -> None:
    """Labels longer than input_ids gave a loss in "rows" mode (forward_backward sliced every input to
    the first one's rows), where transformers raises. Both raise ValueError now, for labels and
    shift_labels, longer or shorter."""
    ref = make("llama")
    pat = apply_coda_to_llama(copy.deepcopy(ref), loss_mode=loss_mode)
    ids, labels = batch()
    bad = torch.cat([labels, labels[:, :extra]], 1) if extra > 0 else labels[:, :extra]
    with pytest.raises(ValueError, match="Expected input batch_size"):
        ref(ids, labels=bad)
    with refused(
        rf"coda_lang.hf: labels of shape \(2, {24 + extra}\): {2 * (24 + extra)} labels for the 48 tokens"
    ):
        pat(ids, labels=bad)
    with refused(r"coda_lang.hf: shift_labels of shape"):
        pat(ids, shift_labels=bad)


def test_forward_backward_refuses_inputs_whose_rows_disagree() -> None:
    """BlockFunction.forward_backward runs in chunks of rows: inputs and cotangents of another number of
    rows are refused, not sliced to the first input's."""
    st = apply_coda_to_llama(make("llama"))._coda
    head = st.row_head()
    w = torch.randn(VOCAB, 64)
    hg, r, t = torch.randn(48, 64), torch.rand(48), torch.randint(0, VOCAB, (54,), dtype=torch.int32)
    # (the whole inputs are checked as a plain call checks them: E0804 for the rows, E0802 for a
    # cotangent not of its output's shape)
    with pytest.raises(coda_lang.CodaError, match="E0804"):
        head.forward_backward(hg=hg, r=r, w_lm=w, target=t, cotangents={"loss": torch.ones(48)}, chunk=16)
    with pytest.raises(coda_lang.CodaError, match="E0802"):
        head.forward_backward(
            hg=hg, r=r, w_lm=w, target=t[:48], cotangents={"loss": torch.ones(50)}, chunk=16
        )
    outs, grads = head.forward_backward(
        hg=hg, r=r, w_lm=w, target=t[:48], cotangents={"loss": torch.ones(48)}, chunk=16
    )
    assert outs["loss"].shape == (48,) and set(grads) == {"hg", "r", "w_lm"}


@pytest.mark.parametrize("family", each(costly=True))
def test_a_dtype_changed_after_patching_rebuilds_the_blocks(family: str) -> None:
    """`.to(torch.bfloat16)` after patching used to say "patch it again", and patching again was refused.
    The forward now rebuilds the blocks for the new dtype: the same loss, logits and gradients as a
    model patched in bf16 (bit for bit). Weights of mixed dtypes are refused by name. (Untied
    embeddings, Gemma's too: the embedding is converted alone below.)"""
    ref = make(family, tie_word_embeddings=False)
    a = patch(family, copy.deepcopy(ref))
    b = patch(family, copy.deepcopy(ref).to(torch.bfloat16))
    a.to(torch.bfloat16)
    ids, labels = batch()
    la, za, ga = run(a, ids, labels)
    lb, zb, gb = run(b, ids, labels)
    assert torch.bfloat16 in a._coda._blocks
    assert torch.equal(la, lb) and torch.equal(za, zb)
    for name in gb:
        assert torch.equal(ga[name], gb[name]), name
    a.model.layers[1].float()
    with refused(r"coda_lang.hf: model.layers.1.\S+ is float32: lm_head.weight is bfloat16"):
        a(ids)
    with refused(
        r"coda_lang.hf: dtype torch.float32: the embeddings are torch.float32 and the weights torch.bfloat16"
    ):
        b(inputs_embeds=torch.randn(2, 24, 64))
    b.model.embed_tokens.float()
    with refused(
        r"coda_lang.hf: dtype torch.float32: the embeddings are torch.float32 and the weights torch.bfloat16"
    ):
        b(ids)


def test_a_vocabulary_the_kernels_cant_store_is_refused_at_patching() -> None:
    """One added pad token (97) failed only at the first forward, with TMA jargon, even on the CPU:
    refused when patching, saying what to do; 100 tokens run in f32 (rows of 400 bytes), not in bf16
    (200), also when the dtype changes after patching."""
    ids, labels = batch()
    for dtype in (torch.float32, torch.bfloat16):
        model = make("llama", vocab_size=97).to(dtype)
        with refused(r"coda_lang.hf: a vocabulary of 97 tokens: .*pad_to_multiple_of"):
            apply_coda_to_llama(model)
        assert getattr(model, "_coda", None) is None
    ref = make("llama", vocab_size=100)
    pat = apply_coda_to_llama(copy.deepcopy(ref))
    assert rel(pat(ids, labels=labels).loss, ref(ids, labels=labels).loss) < 1e-5
    with refused(r"coda_lang.hf: a vocabulary of 100 tokens: .* in bfloat16 a vocabulary of a multiple of 8"):
        apply_coda_to_llama(copy.deepcopy(ref).to(torch.bfloat16))
    pat.to(torch.bfloat16)
    with refused(r"coda_lang.hf: a vocabulary of 100 tokens"):
        pat(ids)


@pytest.mark.parametrize("loss_mode", ["rows", "vocab"])
def test_a_second_backward_is_a_clear_error(loss_mode: str) -> None:
    """A second backward (retain_graph=True) raised AttributeError in "rows" mode: now a RuntimeError
    that says why and what to do, in either mode."""
    pat = apply_coda_to_llama(make("llama"), loss_mode=loss_mode)
    ids, labels = batch()
    loss = pat(ids, labels=labels).loss
    loss.backward(retain_graph=True)
    with pytest.raises(
        RuntimeError, match=r"coda(_lang.hf)?: .*(second backward|can't run twice).*run the forward again"
    ):
        loss.backward()


def test_output_attentions_is_refused() -> None:
    """The attention function runs on the fused QKV tile without its weights: `output_attentions`
    (argument or config) is refused rather than answered with None; so is an `ignore_index` other
    than -100, and generation (a KV cache), pointing at `unpatch`."""
    _, pat = pair()
    ids, labels = batch()
    with refused(r"coda_lang.hf: output_attentions=True: .*no attention weights"):
        pat(ids, output_attentions=True)
    with refused(r"coda_lang.hf: output_attentions=True"):
        pat.model(ids, output_attentions=True)
    pat.config.output_attentions = True
    with refused(r"coda_lang.hf: output_attentions=True"):
        pat(ids)
    pat.config.output_attentions = False
    with refused(r"coda_lang.hf: ignore_index=0"):
        pat(ids, labels=labels, ignore_index=0)
    with refused(r"coda_lang.hf: use_cache / past_key_values: .*no KV cache.*unpatch\(model\) gives"):
        pat.generate(ids[:, :4], attention_mask=torch.ones_like(ids[:, :4]), max_new_tokens=2, pad_token_id=0)


# ---- the attention mask: a test that can fail ----


def _padded(where: str) -> tuple[Any, Any, Any]:
    """Two rows of 24 tokens, the first padded: 6 pads at its left, or a masked run of 5 in its middle."""
    ids, labels = batch()
    mask = torch.ones_like(ids)
    if where == "left":
        mask[0, :6] = 0
    else:
        mask[0, 9:14] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = labels.masked_fill(mask == 0, -100)
    return ids, labels, mask


PADDINGS = [
    (f, where, attn)
    for f in sorted(FAMILIES)
    for where in ("left", "middle")
    for attn in ("eager", "sdpa")
    # the other families (sliding windows shorter than the rows) two of the four: each kind once
    if f in FIRST or (where, attn) in (("left", "eager"), ("middle", "sdpa"))
]


@pytest.mark.parametrize(("family", "where", "attn"), PADDINGS)
def test_a_padding_mask_is_honoured(family: str, where: str, attn: str) -> None:
    """A mutant that ignored `attention_mask` passed every test of tests/test_hf.py, its left-padded
    logits 75% off. Left padding (and a masked run in the middle of a row): logits at every position,
    the loss and every gradient match the unpatched model's."""
    ref = make(family, attn_implementation=attn)
    pat = patch(family, copy.deepcopy(ref))
    ids, labels, mask = _padded(where)
    out = {}
    for name, m in (("ref", ref), ("pat", pat)):
        m.zero_grad(set_to_none=True)
        loss = m(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        g = unfused_grads(m) if name == "pat" else {n: p.grad for n, p in m.named_parameters()}
        out[name] = (loss.detach(), m(ids, attention_mask=mask).logits.detach(), g)
    (l0, z0, g0), (l1, z1, g1) = out["ref"], out["pat"]
    assert rel(z1[0], z0[0]) < 1e-5  # the padded row (the mutant: 40-98% off)
    assert rel(z1, z0) < 1e-5
    assert rel(l1, l0) < 1e-5
    for name in g0:
        assert rel(g1[name], g0[name]) < 1e-5, name


# ---- peft LoRA and bitsandbytes ----


def test_peft_lora_after_patching_is_refused_at_the_forward() -> None:
    """get_peft_model on a patched model replaces the projections it finds (o_proj, down_proj): the
    forward refuses, naming them and saying that LoRA applied before patching works
    (tests/test_hf_lora.py); the default targets (q_proj, v_proj) are fused away, which peft reports
    itself."""
    peft = pytest.importorskip("peft")
    ids, labels = batch()
    _, pat = pair()
    pm = peft.get_peft_model(pat, peft.LoraConfig(r=4, target_modules=["o_proj", "down_proj"]))
    with refused(
        r"coda_lang.hf: model.layers.0.self_attn.o_proj: replaced after patching by a peft adapter layer .*"
        r"supported on q, k, v, o, gate, up and down when applied before patching"
    ):
        pm(input_ids=ids, labels=labels)
    with pytest.raises(ValueError, match="Target modules .* not found"):
        peft.get_peft_model(pair()[1], peft.LoraConfig(r=4))


def _bnb_class() -> type:
    """A stand-in of bitsandbytes' Linear4bit (not installed here): a Linear subclass of that module."""
    return type("Linear4bit", (nn.Linear,), {"__module__": "bitsandbytes.nn.modules"})


def test_quantized_layers_are_refused_by_class() -> None:
    """QLoRA's 4-bit (and 8-bit) base layers, before patching or put in after."""
    cls = _bnb_class()
    model = make("llama")
    proj = model.model.layers[1].mlp.gate_proj
    model.model.layers[1].mlp.gate_proj = _linear_like(proj, cls)
    with refused(
        r"coda_lang.hf: model.layers.1.mlp.gate_proj: a bitsandbytes quantized layer .*QLoRA.*not supported"
    ):
        apply_coda_to_llama(model)
    _, pat = pair()
    pat.model.layers[0].mlp.down_proj = _linear_like(pat.model.layers[0].mlp.down_proj, cls)
    with refused(r"coda_lang.hf: model.layers.0.mlp.down_proj: replaced after patching by a bitsandbytes"):
        pat(batch()[0])


# ---- unpatch ----


@pytest.mark.parametrize("family", each(costly=True))
def test_unpatch_gives_the_transformers_model_back(family: str) -> None:
    """`coda_lang.hf.unpatch` splits q/k/v and gate/up back out of the fused weights exactly: the same
    parameter names in the same order, a state dict equal bit for bit, the same logits, gradients kept,
    and generation with a KV cache giving the original's tokens; patching again works."""
    ref, pat = pair(family)
    ids, labels = batch()
    pat.model.layers[0].coda_next.self_attn.qkv_weight.requires_grad_(False)  # layer 1's
    pat(ids, labels=labels).loss.backward()
    grads = unfused_grads(pat)
    assert unpatch(pat) is pat
    assert (
        getattr(pat, "_coda", None) is None
        and "forward" not in vars(pat)
        and "forward" not in vars(pat.model)
    )
    assert [n for n, _ in pat.named_parameters()] == [n for n, _ in ref.named_parameters()]
    sd0, sd1 = ref.state_dict(), pat.state_dict()
    assert list(sd1) == list(sd0) and all(torch.equal(sd1[k], sd0[k]) for k in sd0)
    for name, g in grads.items():
        assert torch.equal(pat.get_parameter(name).grad, g), name
    parts = KNOWN[family].qkv_parts  # (q, k and v; Phi-3's one qkv_proj)
    k = "k_proj" if "k_proj" in parts else parts[0]
    assert not getattr(pat.model.layers[1].self_attn, k).weight.requires_grad
    assert getattr(pat.model.layers[0].self_attn, k).weight.requires_grad
    assert torch.equal(pat(ids).logits, ref(ids).logits)
    getattr(ref.model.layers[1].self_attn, k).weight.requires_grad_(False)
    prompt = ids[:, :6]
    mask = torch.ones_like(prompt)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(pat.generate(prompt, **kw), ref.generate(prompt, **kw))
    patch(family, pat)
    assert rel(pat(ids).logits, ref(ids).logits) < 1e-5


def test_unpatch_after_a_dtype_change_and_its_errors() -> None:
    ref, pat = pair()
    ids, _ = batch()
    pat.to(torch.bfloat16)
    pat(ids)
    unpatch(pat)
    assert torch.equal(pat(ids).logits, ref.to(torch.bfloat16)(ids).logits)
    with refused(r"coda_lang.hf: LlamaForCausalLM: not patched by coda_lang.hf"):
        unpatch(pat)
    _, pat = pair()
    inner = pat.forward
    pat.forward = lambda *a, **k: inner(*a, **k)
    with refused(r"coda_lang.hf: model.forward: replaced or wrapped since patching"):
        unpatch(pat)
    _, pat = pair()
    pat.model.layers[1].mlp = _family_module(pat, "MLP", pat.config)
    with refused(r"coda_lang.hf: model.layers.1.mlp.gate_up_weight: gone since patching"):
        unpatch(pat)
    assert hasattr(pat.model.coda_first.self_attn, "qkv_weight") and pat._coda is not None


# ---- the check's cost ----


@pytest.mark.slow  # (a timing; its numbers are in hf/contract.py's docstring: kept out of CI's run)
def test_the_check_costs_no_measurable_time() -> None:
    """The per-forward check: a walk of C-level scans over columns made at patching. Timed alone on a
    16-layer model's module tree (about 4-7 us per layer on a 2-core CPU; the bound is 30x that), and
    on the 2-layer model against that model's no-grad forward: under 2% of it. Each is the best of
    several runs, so that other work on the machine (which makes a forward vary 10x here) does not
    count."""
    model = apply_coda_to_llama(make("llama", num_hidden_layers=16))

    def best(f: Any, n: int, reps: int = 7) -> float:
        out = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            for _ in range(n):
                f()
            out = min(out, (time.perf_counter() - t) / n)
        return out

    alone = best(lambda: model._coda.contract.check(model, False), 200)
    assert alone < 3e-3, f"{alone * 1e6:.0f} us"
    small = apply_coda_to_llama(make("llama"))
    ids, _ = batch()

    def fwd() -> None:
        with torch.no_grad():
            small(ids)

    fwd()
    forward = best(fwd, 3)
    check = best(lambda: small._coda.contract.check(small, False), 200)
    print(
        f"check: {alone * 1e6:.1f} us (16 layers), {check * 1e6:.1f} us (2 layers); forward {forward * 1e3:.2f} ms"
    )
    assert check < 0.02 * forward
