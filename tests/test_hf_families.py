"""coda_lang.hf's families: `apply_coda` and `AutoCodaForCausalLM` pick the family from the config's
`model_type`; each family's models and released configurations against the same model unpatched.

On the CPU with tiny models (2 layers, random init from a seed): `apply_coda` patches each supported
model type as its own entry point does and refuses any other with the list of those supported;
`AutoCodaForCausalLM` loads a saved model and patches it (an unsupported type refused from its config
alone, before any weights load).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import FAMILIES, batch, make, rel, run  # noqa: E402

from coda_lang.hf import AutoCodaForCausalLM, apply_coda, unpatch  # noqa: E402
from coda_lang.hf.family import FAMILIES as KNOWN  # noqa: E402


def test_apply_coda_patches_each_family_by_model_type() -> None:
    """Every family of the tests is patched by `apply_coda` as by its own entry point: its facts, its
    loss settings (test_hf.py's tests run each family's model against the unpatched one)."""
    assert set(KNOWN) == set(FAMILIES)
    for family in sorted(FAMILIES):
        pat = apply_coda(make(family), loss_mode="vocab")
        assert pat._coda.family is KNOWN[family] and pat._coda.loss_mode == "vocab"
        assert type(pat) is FAMILIES[family][1]


def test_apply_coda_refuses_what_it_does_not_know() -> None:
    """A model type with no family is refused naming it and listing those supported; a model of a
    known type but another class is refused by the family's check; an object without a config is a
    TypeError; a bad loss setting is refused before anything else."""
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    )
    supported = ", ".join(sorted(KNOWN))
    with pytest.raises(
        ValueError, match=f"model_type 'gpt2' \\(GPT2LMHeadModel\\): .*supported: {supported}"
    ):
        apply_coda(gpt2)
    seq = transformers.LlamaForSequenceClassification(make("llama").config)
    with pytest.raises(ValueError, match="apply_coda_to_llama patches a transformers LlamaForCausalLM"):
        apply_coda(seq)
    with pytest.raises(TypeError, match="a transformers causal LM .* got a Linear"):
        apply_coda(torch.nn.Linear(2, 2))
    model = make("llama")
    with pytest.raises(ValueError, match="loss_mode= is 'logits'"):
        apply_coda(model, loss_mode="logits")
    assert getattr(model, "_coda", None) is None


def test_auto_class_loads_and_patches(tmp_path: Any) -> None:
    """`AutoCodaForCausalLM.from_pretrained` is transformers' `from_pretrained` (its arguments: here a
    dtype) then the patch (its loss settings); `from_config` the same for random weights."""
    ref = make("qwen3")
    ref.save_pretrained(tmp_path)
    pat = AutoCodaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, loss_mode="rows", loss_rows=16)
    assert type(pat) is transformers.Qwen3ForCausalLM and pat._coda.loss_rows == 16
    ids, labels = batch()
    l0, z0, g0 = run(ref, ids, labels)
    l1, z1, _ = run(pat, ids, labels)
    assert rel(l1, l0) < 1e-5 and rel(z1, z0) < 1e-5
    cfg = make("llama").config
    fresh = AutoCodaForCausalLM.from_config(cfg)
    assert type(fresh) is transformers.LlamaForCausalLM and fresh._coda.family.name == "llama"
    assert isinstance(unpatch(fresh).model.layers[0].self_attn.q_proj, torch.nn.Linear)
    with pytest.raises(TypeError, match="from_pretrained"):
        AutoCodaForCausalLM()


def test_auto_class_refuses_an_unsupported_type_before_loading(tmp_path: Any) -> None:
    """Only a config is saved: the refusal comes from it (a ValueError listing the types supported),
    not from transformers looking for weights that are not there."""
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    supported = ", ".join(sorted(KNOWN))
    with pytest.raises(
        ValueError, match=f"model_type 'gpt2' .*not a family coda_lang.hf patches; supported: {supported};"
    ):
        AutoCodaForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'gpt2' \\(GPT2Config\\)"):
        AutoCodaForCausalLM.from_config(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))


def matches_unpatched(ref: Any, pat: Any, s: int = 24, tol: float = 1e-4) -> None:
    """The patched model's loss, logits and every parameter's gradient (under the unpatched names) are
    the unpatched model's in float32, to `tol` relative."""
    ids, labels = batch(s=s)
    l0, z0, g0 = run(ref, ids, labels)
    l1, z1, g1 = run(pat, ids, labels)
    assert rel(l1, l0) < tol, (float(l1), float(l0))
    assert rel(z1, z0) < tol
    assert set(g1) == set(g0) and len(g0) == sum(p.requires_grad for p in ref.parameters())
    for name in g0:
        assert rel(g1[name], g0[name]) < tol, name


def state_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The same keys in the same order, every tensor equal bit for bit."""
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_checkpoint_round_trip_is_bit_exact(family: str, tmp_path: Any) -> None:
    """Hugging Face's state dict loaded into a patched model comes back out of it bit for bit (the
    fused weights are permutations of the checkpoint's rows), and so does a `save_pretrained` of the
    patched model, loaded unpatched or through `AutoCodaForCausalLM`; in bf16, with tied embeddings."""
    ref = make(family, dtype=torch.bfloat16, tie_word_embeddings=True)
    want = ref.state_dict()
    pat = apply_coda(make(family, dtype=torch.bfloat16, seed=5, tie_word_embeddings=True))
    pat.load_state_dict(want)
    state_equal(pat.state_dict(), want)
    pat.save_pretrained(tmp_path)
    state_equal(type(ref).from_pretrained(tmp_path, dtype=torch.bfloat16).state_dict(), want)
    again = AutoCodaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    state_equal(again.state_dict(), want)
    state_equal(unpatch(again).state_dict(), want)


# Released configurations, from their config.json: the settings the patch reads (widths, heads,
# head_dim, tied embeddings, RoPE, sliding window, epsilon), by family. Two layers each: the layer count
# changes nothing the patch checks.
RELEASED_LLAMA = {  # model_type "llama"
    "SmolLM-135M": dict(
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "SmolLM2-360M": dict(
        hidden_size=960,
        intermediate_size=2560,
        num_attention_heads=15,
        num_key_value_heads=5,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    "SmolLM2-1.7B": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=49152,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 130000.0},
    ),
    "TinyLlama-1.1B": dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_attention_heads=32,
        num_key_value_heads=4,
        vocab_size=32000,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "DeepSeek-R1-Distill-Llama-8B": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}


RELEASED_MISTRAL = {  # model_type "mistral"
    "Mistral-7B-v0.1": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        tie_word_embeddings=False,
        sliding_window=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "Mistral-7B-v0.3": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32768,
        tie_word_embeddings=False,
        sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "Mistral-Small-24B-2501": dict(  # head_dim 128, not hidden_size / heads (160)
        hidden_size=5120,
        intermediate_size=32768,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=131072,
        tie_word_embeddings=False,
        sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 100000000.0},
    ),
}
QWEN25 = {"rope_type": "default", "rope_theta": 1000000.0}
RELEASED_QWEN2 = {  # model_type "qwen2"
    "Qwen2.5-0.5B": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_parameters=QWEN25,
    ),
    "Qwen2.5-1.5B": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_parameters=QWEN25,
    ),
    "Qwen2.5-7B": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        tie_word_embeddings=False,
        rope_parameters=QWEN25,
    ),
}
OLMO2_ROPE = {"rope_type": "default", "rope_theta": 500000.0}
RELEASED_OLMO2 = {  # model_type "olmo2": no pre-norms, post-norms, q/k norms over each projection
    "OLMo-2-0425-1B": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_attention_heads=16,
        num_key_value_heads=16,
        vocab_size=100352,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_parameters=OLMO2_ROPE,
    ),
    "OLMo-2-1124-7B": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=100352,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        rope_parameters=OLMO2_ROPE,
    ),
}
RELEASED = {
    **{n: ("llama", c) for n, c in RELEASED_LLAMA.items()},
    **{n: ("mistral", c) for n, c in RELEASED_MISTRAL.items()},
    **{n: ("qwen2", c) for n, c in RELEASED_QWEN2.items()},
    **{n: ("olmo2", c) for n, c in RELEASED_OLMO2.items()},
}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_configurations_patch_at_their_widths(name: str) -> None:
    """Each released configuration, at its own widths (on the meta device: no memory, no forward), in
    bf16: the patch's checks pass (widths the kernels can load, the RoPE type, the heads, the sliding
    window) and its fused weights have the model's shapes (head_dim 64 or 128: the config's, else
    hidden_size / heads; OLMo 2's q and k norms over all of q's and k's heads)."""
    family, over = RELEASED[name]
    config_cls, model_cls, _ = FAMILIES[family]
    over = {"rms_norm_eps": 1e-5, **over}
    cfg = config_cls(**over, num_hidden_layers=2, max_position_embeddings=8192)
    with torch.device("meta"):
        model = model_cls(cfg).to(torch.bfloat16)
    apply_coda(model)
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
    hd = over.get("head_dim", d // h)
    st = model._coda
    eps = over["rms_norm_eps"]
    assert (st.family.name, st.H, st.KV, st.HD, st.D, st.eps) == (family, h, kv, hd, d, eps)
    fused = model.model.coda_first.self_attn
    assert fused.qkv_weight.shape == ((h + 2 * kv) * hd, d)
    if family == "olmo2":
        assert fused.q_norm.weight.shape == (h * hd,) and fused.k_norm.weight.shape == (kv * hd,)
    assert model.model.layers[1].mlp.gate_up_weight.shape == (2 * cfg.intermediate_size, d)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == over["tie_word_embeddings"]


# The same settings at tiny widths, to run: each the released model's head counts (9 and 3, 15 and 5)
# or ratio of query to key/value heads (8:1, 4:1, 1:1), its tied or untied embeddings, RoPE type and
# base, and epsilon, with head_dim 8 or 16. DeepSeek's llama3 RoPE scaling starts at position 16 here
# (original_max_position_embeddings), so that the sequence of 40 crosses it.
TINY_LLAMA = {
    "SmolLM-135M": dict(
        hidden_size=144,
        intermediate_size=384,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=16,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "SmolLM2-360M": dict(
        hidden_size=120,
        intermediate_size=320,
        num_attention_heads=15,
        num_key_value_heads=5,
        head_dim=8,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
    "SmolLM2-1.7B": dict(
        hidden_size=64,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 130000.0},
    ),
    "TinyLlama-1.1B": dict(
        hidden_size=128,
        intermediate_size=352,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "DeepSeek-R1-Distill-Llama-8B": dict(
        hidden_size=64,
        intermediate_size=224,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
}


TINY = {
    **{n: ("llama", c) for n, c in TINY_LLAMA.items()},
    # Qwen2.5-0.5B's 14 query and 2 key/value heads, tied embeddings, its RoPE base
    "Qwen2.5-0.5B": (
        "qwen2",
        dict(
            hidden_size=112,
            intermediate_size=608,
            num_attention_heads=14,
            num_key_value_heads=2,
            head_dim=8,
            tie_word_embeddings=True,
            rope_parameters=QWEN25,
        ),
    ),
    # OLMo 2's released settings (multi-head attention, RoPE base 5e5, epsilon 1e-6, untied), at the
    # 1B's 16 heads and its MLP 4x the hidden size, and the 7B's MLP 2.6875x (8 heads here)
    "OLMo-2-0425-1B": (
        "olmo2",
        dict(
            hidden_size=128,
            intermediate_size=512,
            num_attention_heads=16,
            num_key_value_heads=16,
            head_dim=8,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            rope_parameters=OLMO2_ROPE,
        ),
    ),
    "OLMo-2-1124-7B": (
        "olmo2",
        dict(
            hidden_size=128,
            intermediate_size=344,
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=16,
            tie_word_embeddings=False,
            rms_norm_eps=1e-6,
            rope_parameters=OLMO2_ROPE,
        ),
    ),
    # Mistral Small's head_dim wider than hidden_size / heads (here 16, not 8), no sliding window
    "Mistral-Small-24B-2501": (
        "mistral",
        dict(
            hidden_size=64,
            intermediate_size=384,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 100000000.0},
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(TINY))
def test_released_configurations_match_unpatched(name: str) -> None:
    """Each released configuration's settings at tiny widths: loss, logits and every gradient of the
    patched model are the unpatched model's in float32 (1e-4), over 40 positions."""
    family, over = TINY[name]
    ref = make(family, **{"rms_norm_eps": 1e-5, **over})
    matches_unpatched(ref, apply_coda(copy.deepcopy(ref)), s=40)


# Sliding windows: the attention function's business, with the masks the family's forward makes.
# Mistral's every layer (or none: sliding_window None, as Mistral-7B-v0.3), Ministral's, Qwen3's and
# Qwen2's layers by config.layer_types (Qwen3, Qwen2: from use_sliding_window and max_window_layers); a
# window of 8 in a sequence of 40.
WINDOWS = {
    "mistral-8": ("mistral", "eager", {"sliding_window": 8}),
    "mistral-none": ("mistral", "sdpa", {"sliding_window": None}),
    "ministral-8": (
        "ministral",
        "sdpa",
        {"sliding_window": 8, "layer_types": ["full_attention", "sliding_attention"]},
    ),
    "qwen3-8": ("qwen3", "eager", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    "qwen2-8": ("qwen2", "sdpa", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
}


@pytest.mark.parametrize("case", sorted(WINDOWS))
def test_sliding_windows_match_unpatched(case: str) -> None:
    """With and without a sliding window, in every layer or some: loss, logits and every gradient are
    the unpatched model's in float32 (1e-4), under eager or sdpa attention (test_hf_contract.py's
    padding test runs both for each family)."""
    family, attn, over = WINDOWS[case]
    ref = make(family, attn_implementation=attn, **over)
    matches_unpatched(ref, apply_coda(copy.deepcopy(ref)), s=40)


CALLS: list[tuple[Any, ...]] = []


def spy_attention(module: Any, q: Any, k: Any, v: Any, mask: Any, **kw: Any) -> Any:
    """sdpa, recording what the attention function is given besides q, k and v."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    CALLS.append(
        (module.layer_idx, mask, kw.get("sliding_window", "none given"), kw["scaling"], kw["dropout"])
    )
    return sdpa_attention_forward(module, q, k, v, mask, **kw)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_models_own_attention_function_gets_what_it_gets_unpatched(family: str) -> None:
    """The patched layers call the model's own attention function (here one registered with
    transformers' AttentionInterface) with what the unpatched model gives it: each layer's mask (a
    padded batch), sliding window (Mistral's from the config, Ministral's, Qwen3's and Qwen2's from
    the layer, Llama's none), scaling and dropout."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("coda_spy", spy_attention)
    AttentionMaskInterface.register("coda_spy", sdpa_mask)
    over = WINDOWS["qwen3-8"][2] if family in ("qwen3", "qwen2") else {}
    ref = make(family, attn_implementation="coda_spy", **over)
    pat = apply_coda(copy.deepcopy(ref))
    ids, _ = batch(s=24)
    pad = torch.ones_like(ids)
    pad[0, :5] = 0
    seen = []
    for m in (ref, pat):
        CALLS.clear()
        m(ids, attention_mask=pad)
        seen.append(list(CALLS))
    assert len(seen[0]) == len(seen[1]) == 2
    for a, b in zip(*seen, strict=True):
        assert a[0] == b[0] and a[2:] == b[2:], (a[2:], b[2:])
        assert (a[1] is None and b[1] is None) or torch.equal(a[1], b[1]), a[0]
    windows = [c[2] for c in seen[1]]
    none = ["none given"] * 2
    assert windows == {
        "llama": none,
        "granite": none,
        "olmo2": none,
        "mistral": [16, 16],
        "ministral": [16, None],
    }.get(family, [None, 8])


def test_a_sliding_window_the_family_has_not_is_refused() -> None:
    """A Llama config given sliding-window layers (its attention has no window) and a layer kind
    the patched layers don't run are refused when patching, naming them."""
    llama = make("llama", layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(ValueError, match="sliding-window attention: the LlamaForCausalLM's attention has no"):
        apply_coda(llama)
    odd = make("ministral", layer_types=["sliding_attention", "chunked_attention"])
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\]: the patched layers run"):
        apply_coda(odd)


def test_qwen2_biases_are_checked_and_honoured() -> None:
    """Qwen2's q, k and v biases become one parameter `qkv_bias`: each must be there, be a plain
    Parameter without gradient hooks, and agree in requires_grad (frozen together: no gradient, the
    others' still the unpatched model's); an out-projection bias, which the blocks don't add, is
    refused."""
    attn = "model.layers.1.self_attn"
    ref = make("qwen2")
    ref.model.layers[1].self_attn.k_proj.bias.requires_grad_(False)
    with pytest.raises(ValueError, match=f"{attn}.k_proj.bias.requires_grad=False: .*one parameter"):
        apply_coda(copy.deepcopy(ref))
    ref.model.layers[1].self_attn.q_proj.bias.requires_grad_(False)
    ref.model.layers[1].self_attn.v_proj.bias.requires_grad_(False)
    pat = apply_coda(copy.deepcopy(ref))
    assert not pat.model.layers[0].coda_next.self_attn.qkv_bias.requires_grad
    matches_unpatched(ref, pat)  # (the frozen biases have no gradient in either)
    hooked = make("qwen2")
    hooked.model.layers[0].self_attn.v_proj.bias.register_hook(lambda g: g)
    with pytest.raises(ValueError, match="model.layers.0.self_attn.v_proj.bias: a gradient hook"):
        apply_coda(hooked)
    missing = make("qwen2")
    missing.model.layers[0].self_attn.q_proj.bias = None
    with pytest.raises(ValueError, match="layer 0: self_attn.q_proj: missing or without a bias"):
        apply_coda(missing)
    o_bias = make("qwen2")
    o = o_bias.model.layers[1].self_attn.o_proj
    o.bias = torch.nn.Parameter(torch.zeros(o.out_features))
    with pytest.raises(ValueError, match="layer 1: self_attn.o_proj: missing or has a bias"):
        apply_coda(o_bias)


def test_the_lines_table_in_the_docs_is_current() -> None:
    """docs/models.md's table of the .coda and Python lines each family took is what
    scripts/family_lines.py counts now (`python scripts/family_lines.py --write` renews it); Mistral's
    and Ministral's programs are Llama's, Qwen2's differs from it by the bias (two parameters, two
    adds), and every family's Python is counted."""
    import importlib.util
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("family_lines", root / "scripts" / "family_lines.py")
    assert spec is not None and spec.loader is not None
    lines = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = lines  # (its dataclasses look their module up)
    spec.loader.exec_module(lines)
    counts = lines.count()
    doc = (root / "docs" / "models.md").read_text()
    assert f"{lines.BEGIN}\n{lines.table(counts)}{lines.END}" in doc, (
        "run python scripts/family_lines.py --write"
    )
    assert counts.coda["mistral"][1] == counts.coda["ministral"][1] == 0 and counts.coda["qwen2"][1] == 4
    assert all(n > 0 for n in counts.python.values())


@pytest.mark.parametrize("family", [f for f in sorted(FAMILIES) if f not in ("llama", "qwen3")])
def test_hidden_states_are_hugging_faces(family: str) -> None:
    """`output_hidden_states=True` gives the unpatched model's hidden states, each of them (Granite's
    first one its embeddings times the embedding multiplier), and the base model's last state."""
    ref = make(family)
    pat = apply_coda(copy.deepcopy(ref))
    ids, _ = batch()
    want = ref(ids, output_hidden_states=True).hidden_states
    got = pat(ids, output_hidden_states=True).hidden_states
    assert len(got) == len(want) == 3
    for a, b in zip(got, want, strict=True):
        assert rel(a, b) < 1e-5
    assert rel(pat.model(ids).last_hidden_state, ref.model(ids).last_hidden_state) < 1e-5
