"""coda_lang.hf's families: `apply_coda` and `AutoCodaForCausalLM` pick the family from the config's
`model_type`; each family's models and released configurations against the same model unpatched.

On the CPU with tiny models (2 layers, random init from a seed): `apply_coda` patches each supported
model type as its own entry point does and refuses any other with the list of those supported;
`AutoCodaForCausalLM` loads a saved model and patches it (an unsupported type refused from its config
alone, before any weights load). Released configurations at their widths (meta device) and their
settings at tiny widths against the unpatched model; sliding windows; Qwen2's biases; OLMo 2's
mutants, contract and bf16 against float64; the post-norm option with pre-norms (Gemma's sandwich)
against a torch layer; Gemma 2's and Gemma 3's mutants (the norms' 1 + w, the soft-capping, a
post-norm, one RoPE for both kinds of layer), contract, refusals, RoPE tables per kind and bf16
against float64; the lines table of docs/models.md.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import FAMILIES, KNOWN, batch, make, rel, run  # noqa: E402

from coda_lang.hf import AutoCodaForCausalLM, apply_coda, unfused_grads, unpatch  # noqa: E402
from coda_lang.hf.family import FAMILIES as BY_TYPE  # noqa: E402


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
    supported = ", ".join(sorted(BY_TYPE))
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
    supported = ", ".join(sorted(BY_TYPE))
    with pytest.raises(
        ValueError, match=f"model_type 'gpt2' .*not a family coda_lang.hf patches; supported: {supported};"
    ):
        AutoCodaForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'gpt2' \\(GPT2Config\\)"):
        AutoCodaForCausalLM.from_config(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2))


def differences(ref: Any, pat: Any, s: int = 24) -> dict[str, float]:
    """The relative differences of the patched model's loss, logits and every parameter's gradient
    (under the unpatched names) from the unpatched model's, by name."""
    ids, labels = batch(s=s)
    l0, z0, g0 = run(ref, ids, labels)
    l1, z1, g1 = run(pat, ids, labels)
    assert set(g1) == set(g0) and len(g0) == sum(p.requires_grad for p in ref.parameters())
    return {"loss": rel(l1, l0), "logits": rel(z1, z0), **{n: rel(g1[n], g0[n]) for n in g0}}


def matches_unpatched(ref: Any, pat: Any, s: int = 24, tol: float = 1e-4) -> None:
    """The patched model's loss, logits and every parameter's gradient (under the unpatched names) are
    the unpatched model's in float32, to `tol` relative."""
    off = {k: v for k, v in differences(ref, pat, s).items() if not v < tol}
    assert not off, off


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
PHI3_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
RELEASED_PHI3 = {  # model_type "phi3": the 4k variants (default RoPE); the 128k ones are refused below
    "Phi-3-mini-4k-instruct": dict(  # head_dim 96 (3072 / 32), multi-head
        hidden_size=3072,
        intermediate_size=8192,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32064,
        tie_word_embeddings=False,
        sliding_window=2047,
        rope_parameters=PHI3_ROPE,
    ),
    "Phi-3-medium-4k-instruct": dict(
        hidden_size=5120,
        intermediate_size=17920,
        num_attention_heads=40,
        num_key_value_heads=10,
        vocab_size=32064,
        tie_word_embeddings=False,
        sliding_window=2047,
        rope_parameters=PHI3_ROPE,
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
# Gemma 2 and Gemma 3 (its text models: the 4B-27B checkpoints' text_config), from their config.json
GEMMA2 = dict(  # the settings every Gemma 2 shares
    vocab_size=256000,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
    hidden_activation="gelu_pytorch_tanh",
    sliding_window=4096,
    final_logit_softcapping=30.0,
    attn_logit_softcapping=50.0,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
RELEASED_GEMMA2 = {  # model_type "gemma2": head_dim 256 (2B, 9B) or 128 (27B), not hidden / heads
    "gemma-2-2b": dict(
        GEMMA2,
        hidden_size=2304,
        intermediate_size=9216,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        query_pre_attn_scalar=256,
    ),
    "gemma-2-9b": dict(
        GEMMA2,
        hidden_size=3584,
        intermediate_size=14336,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        query_pre_attn_scalar=256,
    ),
    "gemma-2-27b": dict(
        GEMMA2,
        hidden_size=4608,
        intermediate_size=36864,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        query_pre_attn_scalar=144,
    ),
}
GEMMA3_LOCAL = {"rope_type": "default", "rope_theta": 10000.0}  # (rope_local_base_freq)
GEMMA3_ROPE = {  # the 1B: both kinds unscaled, the global layers' base 1e6
    "sliding_attention": GEMMA3_LOCAL,
    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
}
GEMMA3_ROPE_X8 = {  # the 4B-27B: the global layers' RoPE linearly scaled by 8 (inv_freq / 8)
    "sliding_attention": GEMMA3_LOCAL,
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
}
GEMMA3 = dict(tie_word_embeddings=True, rms_norm_eps=1e-6, final_logit_softcapping=None)
RELEASED_GEMMA3 = {  # model_type "gemma3_text"; head_dim 256 but the 27B's 128
    "gemma-3-1b-pt": dict(
        GEMMA3,
        hidden_size=1152,
        intermediate_size=6912,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=262144,
        sliding_window=512,
        query_pre_attn_scalar=256,
        rope_parameters=GEMMA3_ROPE,
    ),
    "gemma-3-4b-pt (text)": dict(
        GEMMA3,
        hidden_size=2560,
        intermediate_size=10240,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        vocab_size=262208,
        sliding_window=1024,
        query_pre_attn_scalar=256,
        rope_parameters=GEMMA3_ROPE_X8,
    ),
    "gemma-3-27b-pt (text)": dict(
        GEMMA3,
        hidden_size=5376,
        intermediate_size=21504,
        num_attention_heads=32,
        num_key_value_heads=16,
        head_dim=128,
        vocab_size=262208,
        sliding_window=1024,
        query_pre_attn_scalar=168,
        rope_parameters=GEMMA3_ROPE_X8,
    ),
}
RELEASED = {
    **{n: ("llama", c) for n, c in RELEASED_LLAMA.items()},
    **{n: ("mistral", c) for n, c in RELEASED_MISTRAL.items()},
    **{n: ("qwen2", c) for n, c in RELEASED_QWEN2.items()},
    **{n: ("phi3", c) for n, c in RELEASED_PHI3.items()},
    **{n: ("olmo2", c) for n, c in RELEASED_OLMO2.items()},
    **{n: ("gemma2", c) for n, c in RELEASED_GEMMA2.items()},
    **{n: ("gemma3", c) for n, c in RELEASED_GEMMA3.items()},
}


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_configurations_patch_at_their_widths(name: str) -> None:
    """Each released configuration, at its own widths (on the meta device: no memory, no forward), in
    bf16: the patch's checks pass (widths the kernels can load, the RoPE type, the heads, the sliding
    window) and its fused weights have the model's shapes (head_dim 64 to 256: the config's, else
    hidden_size / heads; OLMo 2's q and k norms over all of q's and k's heads, Gemma 3's per head);
    Gemma's soft-capping and Gemma 3's RoPE per kind of layer read from the config."""
    family, over = RELEASED[name]
    config_cls, model_cls, _ = FAMILIES[family]
    over = {"rms_norm_eps": 1e-5, **over}
    if family == "gemma3":  # (two layers of its pattern of 5 local, 1 global: one of each)
        over["layer_types"] = ["sliding_attention", "full_attention"]
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
    if family == "gemma3":  # per head; a local and a global layer (their RoPE: meta has no values)
        assert fused.q_norm.weight.shape == fused.k_norm.weight.shape == (hd,)
        assert st.kinds == ("sliding_attention", "full_attention")
        want = {k: v["rope_type"] for k, v in over["rope_parameters"].items()}
        assert model.model.rotary_emb.rope_type == want
    if family.startswith("gemma"):
        assert st.softcap == over["final_logit_softcapping"]
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
    # Phi-3-mini's head_dim of 96 (not a power of two) and multi-head attention, its RoPE base, a window
    "Phi-3-mini-4k-instruct": (
        "phi3",
        dict(
            hidden_size=192,
            intermediate_size=512,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=96,
            tie_word_embeddings=False,
            sliding_window=16,
            rope_parameters=PHI3_ROPE,
        ),
    ),
    # Phi-3.5-mini's settings with the 4k variants' RoPE (its own LongRoPE is refused: below): head_dim
    # 96, 4 heads, a window longer than the sequence (262144)
    "Phi-3.5-mini-instruct, default RoPE": (
        "phi3",
        dict(
            hidden_size=384,
            intermediate_size=1024,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=96,
            tie_word_embeddings=False,
            sliding_window=262144,
            rope_parameters=PHI3_ROPE,
        ),
    ),
    # Phi-3-medium's 4:1 GQA (40 and 10 heads of 128)
    "Phi-3-medium-4k-instruct": (
        "phi3",
        dict(
            hidden_size=128,
            intermediate_size=448,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
            sliding_window=16,
            rope_parameters=PHI3_ROPE,
        ),
    ),
    # OLMo 2's released settings (multi-head attention, RoPE base 5e5, epsilon 1e-6, untied), at the
    # 1B's 16 heads, and the 7B's MLP 2.6875x the hidden size (8 heads here)
    "OLMo-2-0425-1B": (
        "olmo2",
        dict(
            hidden_size=128,
            intermediate_size=256,
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
    # Gemma 2's released settings (soft-capping at 30 and 50, window 4096, query_pre_attn_scalar 256,
    # epsilon 1e-6, tied): the 2B's 8 query and 4 key/value heads of 256, q wider than the hidden size
    "gemma-2-2b": (
        "gemma2",
        dict(
            {k: v for k, v in GEMMA2.items() if k != "vocab_size"},
            hidden_size=64,
            intermediate_size=256,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            query_pre_attn_scalar=256,
        ),
    ),
    # Gemma 3 1B's: 4 query heads of 256 and 1 key/value head, its pattern of five local layers
    # (RoPE base 1e4, window 512) and one global (1e6): six layers, the RoPE table changing between
    # the QKVs that layer 4's block and the base model's make and those of layers 1-4
    "gemma-3-1b-pt": (
        "gemma3",
        dict(
            GEMMA3,
            hidden_size=64,
            intermediate_size=384,
            num_hidden_layers=6,
            layer_types=None,  # (from sliding_window_pattern 6)
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=512,
            query_pre_attn_scalar=256,
            rope_parameters=GEMMA3_ROPE,
        ),
    ),
    # Gemma 3 4B's text model: 8 and 4 heads of 256, the global layer's RoPE linearly scaled by 8
    "gemma-3-4b-pt (text)": (
        "gemma3",
        dict(
            GEMMA3,
            hidden_size=64,
            intermediate_size=256,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            sliding_window=1024,
            query_pre_attn_scalar=256,
            rope_parameters=GEMMA3_ROPE_X8,
        ),
    ),
    # Gemma 3 27B's: heads of 128, whose per-head q/k norm completes in the QKV GEMM's epilogue (a
    # tile holds whole heads), query_pre_attn_scalar 168, a window shorter than the sequence
    "gemma-3-27b-pt (text)": (
        "gemma3",
        dict(
            GEMMA3,
            hidden_size=64,
            intermediate_size=256,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=128,
            sliding_window=16,
            query_pre_attn_scalar=168,
            rope_parameters=GEMMA3_ROPE_X8,
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
        (
            module.layer_idx,
            mask,
            kw.get("sliding_window", "none given"),
            kw["scaling"],
            kw["dropout"],
            kw.get("softcap", "none given"),
        )
    )
    return sdpa_attention_forward(module, q, k, v, mask, **kw)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_models_own_attention_function_gets_what_it_gets_unpatched(family: str) -> None:
    """The patched layers call the model's own attention function (here one registered with
    transformers' AttentionInterface) with what the unpatched model gives it: each layer's mask (a
    padded batch), sliding window (Mistral's and Phi-3's from the config, Ministral's, Qwen3's,
    Qwen2's and Gemma's from the layer, Llama's none), scaling (Gemma's from query_pre_attn_scalar),
    dropout and soft-capping (Gemma 2's; Gemma 3's attention gives none)."""
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
        "phi3": [16, 16],
        "gemma2": [16, None],
        "gemma3": [16, None],
    }.get(family, [None, 8])
    caps = [c[5] for c in seen[1]]
    assert caps == ([0.2, 0.2] if family == "gemma2" else ["none given"] * 2), caps
    if family.startswith("gemma"):  # (query_pre_attn_scalar's, not head_dim's)
        assert [c[3] for c in seen[1]] == [ref.config.query_pre_attn_scalar**-0.5] * 2


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


# ---- Phi-3: fused checkpoint projections, LongRoPE, residual dropout ----


def test_phi3_checkpoints_keep_its_fused_projections() -> None:
    """Phi-3's checkpoints hold one `qkv_proj` (q, k, v rows stacked) and one `gate_up_proj` (the gate
    rows, then the up rows); the patched model holds coda's layouts (q and k rows in the interleaved
    RoPE layout, gate and up rows interleaved), and its state dict, gradients and unpatch give Phi-3's
    names and layouts back exactly (test_a_checkpoint_round_trip_is_bit_exact: through save_pretrained
    and AutoCodaForCausalLM)."""
    from coda_lang.layout import deinterleave_rope

    ref = make("phi3")
    pat = apply_coda(copy.deepcopy(ref))
    qkv = ref.model.layers[1].self_attn.qkv_proj.weight
    gate, up = ref.model.layers[1].mlp.gate_up_proj.weight.chunk(2)
    fused = pat.model.layers[0].coda_next.self_attn.qkv_weight
    gu = pat.model.layers[1].mlp.gate_up_weight
    nqk = (4 + 2) * 16  # the q and k rows
    assert torch.equal(gu[0::2], gate) and torch.equal(gu[1::2], up)
    assert torch.equal(fused[nqk:], qkv[nqk:])  # v's rows as they are
    assert not torch.equal(fused[:nqk], qkv[:nqk])
    assert torch.equal(deinterleave_rope(fused.t(), 16, nqk).t(), qkv)
    sd = pat.state_dict()
    assert "model.layers.1.self_attn.qkv_proj.weight" in sd and "model.layers.1.mlp.gate_up_proj.weight" in sd
    state_equal(sd, ref.state_dict())
    ids, labels = batch()
    pat(ids, labels=labels).loss.backward()
    names = set(unfused_grads(pat))
    assert names == {n for n, _ in ref.named_parameters()}
    unpatch(pat)
    state_equal(pat.state_dict(), ref.state_dict())
    assert [n for n, _ in pat.named_parameters()] == [n for n, _ in ref.named_parameters()]


PHI35_MINI = dict(  # Phi-3.5-mini-instruct's config.json (LongRoPE's factors: any 48 values here)
    hidden_size=3072,
    intermediate_size=8192,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32064,
    tie_word_embeddings=False,
    sliding_window=262144,
    max_position_embeddings=131072,
    original_max_position_embeddings=4096,
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + i / 48 for i in range(48)],
        "long_factor": [1.0 + i / 4 for i in range(48)],
    },
)


def test_phi3_longrope_and_partial_rotary_are_refused() -> None:
    """The 128k variants' LongRoPE (Phi-3.5-mini, Phi-3-mini-128k: `rope_scaling` longrope or su) scales
    cos and sin and switches factors with the length at each call, which the QKV blocks don't: refused
    when patching, saying so (at Phi-3.5-mini's widths, on the meta device); the same model with the
    4k variants' default RoPE patches. A partial rotary factor is refused too."""
    cls = transformers.Phi3ForCausalLM
    with torch.device("meta"):
        long = cls(transformers.Phi3Config(**PHI35_MINI, num_hidden_layers=2)).to(torch.bfloat16)
        plain = cls(
            transformers.Phi3Config(**{**PHI35_MINI, "rope_parameters": PHI3_ROPE}, num_hidden_layers=2)
        ).to(torch.bfloat16)
    assert float(long.model.rotary_emb.attention_scaling) > 1.0
    with pytest.raises(
        ValueError, match=r"coda_lang.hf: rope_type='longrope': LongRoPE \(Phi-3's 128k variants.*scales cos"
    ):
        apply_coda(long)
    assert getattr(long, "_coda", None) is None
    apply_coda(plain)
    assert plain._coda.HD == 96 and plain.model.coda_first.self_attn.qkv_weight.shape == (9216, 3072)
    half = make("phi3", rope_parameters={**PHI3_ROPE, "partial_rotary_factor": 0.5})
    with pytest.raises(
        ValueError, match=r"partial rotary embedding \(partial_rotary_factor=0.5: 8 of head_dim 16 columns"
    ):
        apply_coda(half)


CALLED: list[Any] = []


def dropout_spy(module: Any, q: Any, k: Any, v: Any, mask: Any, **kw: Any) -> Any:
    """sdpa, recording the dropout the attention function is given."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    CALLED.append(kw["dropout"])
    return sdpa_attention_forward(module, q, k, v, mask, **kw)


def test_phi3_dropouts() -> None:
    """Phi-3's residual dropout (`resid_pdrop`, a Dropout module on each branch of each layer), which
    the blocks don't have: refused at a forward in training mode when p > 0, naming the module; in eval
    mode it is the identity, and the model runs as unpatched. The attention's dropout is the attention
    function's (given as unpatched); `embd_pdrop` is not used by transformers' Phi-3 at all."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    ids, labels = batch()
    ref = make("phi3", resid_pdrop=0.1)
    pat = apply_coda(copy.deepcopy(ref))
    with pytest.raises(
        ValueError,
        match=r"coda_lang.hf: model.layers.0.resid_attn_dropout: dropout p=0.1 in training mode: .*resid_pdrop=0",
    ):
        pat(ids, labels=labels)
    ref.eval()
    pat.eval()
    matches_unpatched(ref, pat)
    pat.train()
    for layer in pat.model.layers:
        layer.resid_attn_dropout.p = 0.0
        with pytest.raises(ValueError, match=rf"{layer._coda_name}.resid_mlp_dropout: dropout p=0.1"):
            pat(ids, labels=labels)
        layer.resid_mlp_dropout.p = 0.0
    pat(ids, labels=labels)
    # the attention dropout reaches the attention function, in training mode only, as unpatched
    AttentionInterface.register("coda_dropout_spy", dropout_spy)
    AttentionMaskInterface.register("coda_dropout_spy", sdpa_mask)
    ref = make("phi3", attention_dropout=0.25, attn_implementation="coda_dropout_spy")
    pat = apply_coda(copy.deepcopy(ref))
    seen = []
    for training in (True, False):
        for m in (ref, pat):
            m.train(training)
            CALLED.clear()
            m(ids)
            seen.append(list(CALLED))
    assert seen == [[0.25, 0.25], [0.25, 0.25], [0.0, 0.0], [0.0, 0.0]]
    emb = make("phi3", embd_pdrop=0.5)
    matches_unpatched(emb, apply_coda(copy.deepcopy(emb)))  # (in training mode)


def within_the_bf16_rule(got: Any, low: Any, want: Any, labels: Any) -> None:
    """The accuracy rule with float64 as the reference, for `run`'s (loss, logits, gradients) of the
    patched bf16 model (`got`), the unpatched bf16 model (`low`) and the unpatched float64 model
    (`want`): each no further from float64 than twice the unpatched bf16 model's distance, plus 1e-6.
    The loss, one number, a mean whose unpatched bf16 error is a draw that may all but cancel, is
    judged against that draw or the standard error of its tokens' errors (test_hf.py's `mean_error`)."""
    from test_hf import mean_error

    pairs = [("loss", got[0], low[0], want[0]), ("logits", got[1], low[1], want[1])]
    pairs += [(n, got[2][n], low[2][n], want[2][n]) for n in want[2]]
    floor = {"loss": mean_error(low[1], want[1], labels)}
    for what, out, lowp, ref in pairs:
        err = float((out.double() - ref).abs().max())
        bound = 2 * max(float((lowp.double() - ref).abs().max()), floor.get(what, 0.0)) + 1e-6
        assert err < bound, f"{what}: |coda - f64| = {err:.3g}, 2 |HF bf16 - f64| + 1e-6 = {bound:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny", "Phi-3-mini-4k-instruct"])
def test_phi3_bf16_within_the_accuracy_rule_against_float64(name: str) -> None:
    """bf16 against a float64 run of the unpatched model (the tiny Phi-3, and Phi-3-mini's settings at
    tiny widths: head_dim 96): the patched model's loss, logits and every gradient are within twice the
    unpatched bf16 run's error, plus 1e-6 (the accuracy rule; on the CPU the blocks are the kernels'
    stand-ins)."""
    over = {} if name == "tiny" else {"rms_norm_eps": 1e-5, **TINY[name][1]}
    ids, labels = batch(s=40)
    ref64 = make("phi3", dtype=torch.float64, **over)
    want = run(ref64, ids, labels)[:2] + ({n: p.grad for n, p in ref64.named_parameters()},)  # (in f64)
    low = run(make("phi3", dtype=torch.bfloat16, **over), ids, labels)
    got = run(apply_coda(make("phi3", dtype=torch.bfloat16, **over)), ids, labels)
    within_the_bf16_rule(got, low, want, labels)


# OLMo 2: mutants of its blocks, which the float32 comparison with the unpatched model must catch.
# The per-head q/k norm is Qwen3's (each head of the tiny model's 16 columns normalized on its own),
# with OLMo 2's weights over the whole width.
OLMO2_MUTANTS = {
    "attention's post-norm dropped": ("_POST_NORM_STAGES", "o * ro * {go}", "o * {go}"),
    "MLP's post-norm dropped": ("_POST_NORM_STAGES", "m * rd * {gd}", "m * {gd}"),
    "q/k norm per head": (
        "_QKV_PROJ_NORM",
        None,
        """
    zr = acc{r}{b}
    hs = sum(zr * zr, over=2*P, group=16)
    zn = zr * rsqrt(hs / 16.0 + eps)
    z = ((mq + mk) * zn + (1.0 - mq - mk) * zr) * gqk
    qa, qb = pairs(z)
    ang = pos * freq
    c = cos(ang)
    s = sin(ang)
    qkv = interleave(qa * c - qb * s, qa * s + qb * c)""",
    ),
}


@pytest.mark.parametrize(
    "mutant",
    # (the MLP's post-norm is the same row stage as the attention's: -m slow)
    [m if "MLP" not in m else pytest.param(m, marks=pytest.mark.slow) for m in sorted(OLMO2_MUTANTS)],
)
def test_olmo2_mutants_fail_the_float32_comparison(mutant: str, monkeypatch: Any) -> None:
    """Each mutant of OLMo 2's blocks (a post-norm dropped, the q/k norm per head instead of over the
    projection) patches and runs, and fails the float32 comparison with the unpatched model that
    test_hf.py's `test_float32_matches_unpatched` and `matches_unpatched` make (loss, logits and every
    gradient within 1e-5 and 1e-4): the logits and most gradients are off by far more."""
    import coda_lang.hf.blocks as hb

    name, old, new = OLMO2_MUTANTS[mutant]
    text = getattr(hb, name)
    assert old is None or old in text
    monkeypatch.setattr(hb, name, new if old is None else text.replace(old, new))
    ref = make("olmo2")
    off = differences(ref, apply_coda(copy.deepcopy(ref)))
    assert off["logits"] > 1e-2 and sum(v > 1e-2 for v in off.values()) > len(off) / 2, off


def test_olmo2_contract() -> None:
    """OLMo 2's modules are under the patch's contract as every family's: hooks on its q/k norms and
    post-norms are refused at patching and at the forward, as are a q/k norm replaced at its Hugging
    Face place, a post-norm's epsilon or the config's `rms_norm_eps` changed; a layer without its
    post-feedforward norm is refused at patching; removed, the model runs again."""
    ids, labels = batch()
    pat = apply_coda(make("olmo2"))
    layer = pat.model.layers[1]
    for path in (
        "model.layers.0.self_attn.q_norm",
        "model.layers.1.self_attn.k_norm",
        "model.layers.1.post_attention_layernorm",
        "model.layers.0.post_feedforward_layernorm",
    ):
        handle = pat.get_submodule(path).register_forward_hook(lambda mod, args, out: out)
        try:
            with pytest.raises(ValueError, match=rf"coda_lang.hf: {path}: a forward hook .*never calls it"):
                pat(ids, labels=labels)
        finally:
            handle.remove()
    q_norm = layer.self_attn.q_norm  # (moved into layer 0's coda_next, reachable where it was)
    layer.self_attn.q_norm = torch.nn.Identity()
    with pytest.raises(ValueError, match="model.layers.1.self_attn.q_norm: replaced after patching by a"):
        pat(ids)
    del layer.self_attn._modules["q_norm"]
    object.__setattr__(layer.self_attn, "q_norm", q_norm)
    layer.post_feedforward_layernorm.variance_epsilon = 1e-3
    with pytest.raises(ValueError, match="post_feedforward_layernorm.variance_epsilon = 0.001: it was 1e-06"):
        pat(ids)
    layer.post_feedforward_layernorm.variance_epsilon = 1e-6
    pat.config.rms_norm_eps = 1e-5
    with pytest.raises(ValueError, match="config.rms_norm_eps = 1e-05: it was 1e-06"):
        pat(ids)
    pat.config.rms_norm_eps = 1e-6
    pat(ids, labels=labels)
    hooked = make("olmo2")
    hooked.model.layers[0].post_feedforward_layernorm.register_forward_pre_hook(lambda mod, args: None)
    with pytest.raises(ValueError, match="model.layers.0.post_feedforward_layernorm: a forward pre-hook"):
        apply_coda(hooked)
    missing = make("olmo2")
    missing.model.layers[1].post_feedforward_layernorm = None
    with pytest.raises(ValueError, match="layer 1: post_feedforward_layernorm: missing"):
        apply_coda(missing)
    assert getattr(missing, "_coda", None) is None


@pytest.mark.slow
def test_olmo2_bf16_against_float64() -> None:
    """The patched bf16 model against the unpatched model in float64 (the accuracy rule with float64 as
    the reference): loss, logits and every gradient no further from float64 than twice the unpatched
    bf16 model's distance (plus 1e-6)."""
    ref64 = make("olmo2").double()
    ref16 = make("olmo2", dtype=torch.bfloat16)
    pat = apply_coda(make("olmo2", dtype=torch.bfloat16))
    ids, labels = batch()
    want, low, got = (run(m, ids, labels) for m in (ref64, ref16, pat))
    within_the_bf16_rule(got, low, want, labels)


def test_post_norms_compose_with_pre_norms() -> None:
    """The post-norm option is a block option, not OLMo 2's alone: with pre-norms too (Gemma 2/3's
    sandwich: input norm, attention, post-attention norm, residual, pre-feedforward norm, MLP,
    post-feedforward norm, residual) the `layer` block computes, in float32 on the emulated kernels,
    what the layer written in torch computes in float64: its outputs (the residual and the next
    layer's QKV tile after RoPE) and the gradient of every input, within 1e-4."""
    import coda_lang
    from coda_lang.hf.blocks import model_source
    from coda_lang.layout import interleave_gate_up
    from coda_lang.torch import function

    m, d, f, hd, nq, nkv = 12, 32, 48, 8, 4, 2
    block = coda_lang.load(model_source("float32", 1e-6, hd, None, pre_norm=True, post_norm=True))["layer"]
    # out-proj, its post-norm's row stage (and the MLP's pre-norm statistics), gate/up, down, the MLP's
    # post-norm's row stage (and the next input norm's statistics), QKV
    assert [s.is_gemm for s in block.ir.stages] == [True, False, True, True, False, True]
    g = torch.Generator().manual_seed(3)

    def rnd(*shape: int, scale: float = 0.2, mean: float = 0.0) -> Any:
        x = mean + scale * torch.randn(*shape, generator=g, dtype=torch.float64)
        return x.requires_grad_()

    norms = ("go", "g1", "gd", "g2")
    ins = dict(
        y=rnd(m, nq * hd, scale=1.0),
        x=rnd(m, d, scale=1.0),
        w_o=rnd(d, nq * hd),
        w_gate=rnd(f, d),
        w_up=rnd(f, d),
        w_2=rnd(d, f),
        w_qkv=rnd((nq + 2 * nkv) * hd, d),
        **{k: rnd(d, scale=0.3, mean=1.0) for k in norms},
    )
    pos = torch.arange(m, dtype=torch.float64) % 5
    inv = 1.0 / 100.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)  # (RoPE's, base 100)
    freq = torch.cat([inv.repeat(nq + nkv), torch.zeros(nkv * hd // 2, dtype=torch.float64)])  # (v: 0)

    def rms(v: Any, weight: Any) -> Any:
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6) * weight

    def reference(i: dict[str, Any]) -> tuple[Any, Any]:
        x1 = i["x"] + rms(i["y"] @ i["w_o"].T, i["go"])
        h = rms(x1, i["g1"])
        mlp = (torch.nn.functional.silu(h @ i["w_gate"].T) * (h @ i["w_up"].T)) @ i["w_2"].T
        x2 = x1 + rms(mlp, i["gd"])
        z = rms(x2, i["g2"]) @ i["w_qkv"].T  # (q and k heads in the interleaved RoPE layout)
        a, b = z[:, 0::2], z[:, 1::2]
        c, s = torch.cos(pos[:, None] * freq), torch.sin(pos[:, None] * freq)
        return x2, torch.stack([a * c - b * s, a * s + b * c], -1).flatten(1)

    fn = function(block, wrt=["y", "x", "w_o", "w_13", "w_2", "w_qkv", *norms])
    w13 = interleave_gate_up(ins["w_gate"].T, ins["w_up"].T).T  # (differentiable: a permutation)
    given = {k: v for k, v in ins.items() if k not in ("w_gate", "w_up")}
    out = fn(**{k: v.float() for k, v in given.items()}, w_13=w13.float(), pos=pos.float(), freq=freq.float())
    got = (out["x2"], out["qkv"])
    want = reference(ins)
    cot = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in want]
    grads_want = torch.autograd.grad(want, list(ins.values()), cot)
    grads_got = torch.autograd.grad(got, list(ins.values()), [c.float() for c in cot])
    for a, b in zip(got, want, strict=True):
        assert rel(a, b) < 1e-4
    for name, a, b in zip(ins, grads_got, grads_want, strict=True):
        assert rel(a, b) < 1e-4, name


# ---- Gemma 2 and Gemma 3 ----

# Mutants of Gemma's blocks and RoPE tables, which the float32 comparison with the unpatched model must
# catch: (what is patched, the text replaced or a function's replacement)
GEMMA_MUTANTS: dict[str, tuple[str, str, Any]] = {
    "gemma2: the norms' 1 + w dropped": ("gemma2", "norm_weight", lambda name, offset: name),
    "gemma2: the final soft-capping dropped": ("gemma2", "_logits", "no cap"),
    "gemma2: the attention's post-norm dropped": (
        "gemma2",
        "_POST_NORM_STAGES",
        ("o * ro * {go}", "o * {go}"),
    ),
    "gemma2: the MLP's post-norm dropped": ("gemma2", "_POST_NORM_STAGES", ("m * rd * {gd}", "m * {gd}")),
    "gemma3: the q/k norms' 1 + w dropped": (
        "gemma3",
        "_QKV_NORM_ROWS",
        ("mq * (zn * {gq}) + mk * (zn * {gk})", "mq * (zn * gq) + mk * (zn * gk)"),
    ),
    "gemma3: one RoPE for every kind of layer": ("gemma3", "freqs", "first"),
}


@pytest.mark.parametrize(
    "mutant",
    [
        m if "MLP" not in m and "q/k" not in m else pytest.param(m, marks=pytest.mark.slow)
        for m in sorted(GEMMA_MUTANTS)
    ],
)
def test_gemma_mutants_fail_the_float32_comparison(mutant: str, monkeypatch: Any) -> None:
    """Each mutant of Gemma's blocks (the norms' 1 + w, the final soft-capping, a post-norm dropped;
    Gemma 3's q/k norms' 1 + w dropped, or one RoPE table for its local and global layers) patches and
    runs, and fails the float32 comparison with the unpatched model that `matches_unpatched` and
    test_hf.py's `test_float32_matches_unpatched` make (1e-4 and 1e-5): its logits are off by more
    than 1e-3. (The MLP's post-norm is the attention's row stage again, the q/k norm's offset the
    norms': -m slow.)"""
    import coda_lang.hf.blocks as hb
    from coda_lang.hf.state import ModelState

    family, name, how = GEMMA_MUTANTS[mutant]
    if name == "freqs":
        real = ModelState.freqs
        monkeypatch.setattr(ModelState, "freqs", lambda st, m, d: (real(st, m, d)[0],) * len(st.kinds))
    elif name == "_logits":
        real_logits = hb._logits
        monkeypatch.setattr(hb, "_logits", lambda acc, scale, cap: real_logits(acc, scale, None))
    elif callable(how):
        monkeypatch.setattr(hb, name, how)
    else:
        old, new = how
        text = getattr(hb, name)
        assert old in text
        monkeypatch.setattr(hb, name, text.replace(old, new))
    ref = make(family)
    off = differences(ref, apply_coda(copy.deepcopy(ref)))
    assert off["logits"] > 1e-3, off


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_contract(family: str) -> None:
    """Gemma's modules are under the patch's contract as every family's: hooks on its sandwich's norms
    and its GELU (and Gemma 3's q/k norms) are refused at the forward, as are its activation swapped
    for another module, a norm's epsilon (Gemma's norms keep it as `eps`) changed, and each config
    field the blocks or the attention read (the soft-capping values, the activation, the attention's
    scaling, the window, the layer kinds, Gemma 3's RoPE per kind); the rotary embedding's per-kind
    scaling and rope types (Gemma 3). Restored, the model runs again."""
    ids, labels = batch()
    pat = apply_coda(make(family))
    paths = [
        "model.layers.1.input_layernorm",
        "model.layers.1.post_attention_layernorm",
        "model.layers.0.pre_feedforward_layernorm",
        "model.layers.1.post_feedforward_layernorm",
        "model.layers.0.mlp.act_fn",
    ]
    if family == "gemma3":
        paths += ["model.layers.0.self_attn.q_norm", "model.layers.1.self_attn.k_norm"]
    for path in paths:
        handle = pat.get_submodule(path).register_forward_hook(lambda mod, args, out: out)
        try:
            with pytest.raises(ValueError, match=rf"coda_lang.hf: {path}: a forward hook .*never calls it"):
                pat(ids, labels=labels)
        finally:
            handle.remove()
    layer = pat.model.layers[1]
    act = layer.mlp.act_fn
    layer.mlp.act_fn = torch.nn.GELU(approximate="tanh")
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.act_fn: replaced after patching by a"):
        pat(ids)
    layer.mlp.act_fn = act
    layer.pre_feedforward_layernorm.eps = 1e-3
    with pytest.raises(
        ValueError, match=r"model.layers.1.pre_feedforward_layernorm.eps = 0.001: it was 1e-06"
    ):
        pat(ids)
    layer.pre_feedforward_layernorm.eps = 1e-6
    changes: list[tuple[str, Any]] = [
        ("final_logit_softcapping", 20.0),
        ("attn_logit_softcapping", 50.0 if family == "gemma2" else 30.0),
        ("hidden_activation", "gelu"),
        ("query_pre_attn_scalar", 256),
        ("sliding_window", 8),
        ("layer_types", ["full_attention", "full_attention"]),
    ]
    if family == "gemma3":
        changes.append(("rope_parameters", GEMMA3_ROPE_X8))
    cfg = vars(pat.config)
    for field, value in changes:
        old = cfg[field]
        cfg[field] = value
        try:
            with pytest.raises(
                ValueError, match=rf"coda_lang.hf: config.{field} = .*: it was .* when the model"
            ):
                pat(ids)
        finally:
            cfg[field] = old
    if family == "gemma3":
        rope = pat.model.rotary_emb
        rope.full_attention_attention_scaling = 2.0
        with pytest.raises(ValueError, match=r"model.rotary_emb.full_attention_attention_scaling = 2.0"):
            pat(ids)
        rope.full_attention_attention_scaling = 1.0
        rope.rope_type["full_attention"] = "dynamic"  # (in place: the record is a copy)
        with pytest.raises(ValueError, match=r"model.rotary_emb.rope_type = "):
            pat(ids)
        rope.rope_type["full_attention"] = "default"
    pat(ids, labels=labels)


def test_what_gemma_the_blocks_cant_run_is_refused() -> None:
    """Refused when patching, by name, nothing changed on the model: another MLP activation than
    GELU-tanh (exact GELU), bidirectional attention (Gemma 3's option: the patched forward makes causal
    masks), a norm whose epsilon is not the config's (Gemma's `eps`), and a RoPE of Gemma 3's global
    layers that scales cos/sin (YaRN), named with its kind. The multimodal Gemma 3 (model_type gemma3,
    Gemma3ForConditionalGeneration) is refused from its config, saying what is patched instead."""
    import types

    exact = make("gemma2", hidden_activation="gelu")
    with pytest.raises(
        ValueError,
        match=r"hidden_activation='gelu': the Gemma2ForCausalLM's MLP block is GeGLU \(gelu_pytorch_tanh",
    ):
        apply_coda(exact)
    both = make("gemma3", use_bidirectional_attention=True)
    with pytest.raises(
        ValueError, match=r"use_bidirectional_attention=True: the patched forward makes the causal"
    ):
        apply_coda(both)
    eps = make("gemma2")
    eps.model.norm.eps = 1e-5
    with pytest.raises(
        ValueError, match=r"model.norm.eps=1e-05: the blocks are built with config.rms_norm_eps"
    ):
        apply_coda(eps)
    yarn = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6, "original_max_position_embeddings": 64}
    scaled = make("gemma3", rope_parameters={"sliding_attention": GEMMA3_LOCAL, "full_attention": yarn})
    with pytest.raises(
        ValueError,
        match=r"rope_type='yarn' \(model.rotary_emb\['full_attention'\]\): YaRN scales cos and sin",
    ):
        apply_coda(scaled)
    for m in (exact, both, eps, scaled):
        assert getattr(m, "_coda", None) is None
    multimodal = transformers.Gemma3Config()
    why = r"model_type 'gemma3' \(.*\): the multimodal Gemma 3 .* its text-only model, Gemma3ForCausalLM"
    with pytest.raises(ValueError, match=why):
        AutoCodaForCausalLM.from_config(multimodal)
    with pytest.raises(ValueError, match=why + r".*; patch a Gemma3ForCausalLM"):
        apply_coda(types.SimpleNamespace(config=multimodal))


def test_gemma3_rope_tables_follow_each_kinds_inv_freq() -> None:
    """Gemma 3's layers read their kind's RoPE table, made once per forward shape and again when that
    kind's inv_freq is changed in place or replaced (the unpatched model reads it at each call): the
    patched model still matches the unpatched one."""
    ref = make("gemma3")
    pat = apply_coda(copy.deepcopy(ref))
    ids, _ = batch()
    st = pat._coda
    first = st.freqs(pat, ids.device)
    assert st.freqs(pat, ids.device) is first and not torch.equal(first[0], first[1])
    for how in ("in place", "replaced"):
        for m in (ref, pat):
            rot = m.model.rotary_emb
            if how == "in place":
                rot.full_attention_inv_freq.mul_(0.5)
            else:
                rot.sliding_attention_inv_freq = rot.sliding_attention_inv_freq * 1.5
        new = st.freqs(pat, ids.device)
        assert new is not first
        first = new
        assert rel(pat(ids).logits, ref(ids).logits) < 1e-5, how


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_bf16_against_float64(family: str) -> None:
    """The patched bf16 model against the unpatched model in float64 (the accuracy rule with float64
    as the reference): loss, logits and every gradient no further from float64 than twice the
    unpatched bf16 model's distance (plus 1e-6); the soft-capped logits and Gemma 3's heads of 256.
    The loss, one number, a mean whose unpatched bf16 error is a draw that may all but cancel (Gemma
    2's: 3.8e-5, its tokens' standard error 1.9e-4; the patched model's 3.5e-4), is judged against
    that draw or the standard error of its tokens' errors, as test_hf.py's bf16 test judges it."""
    ref64 = make(family).double()
    ref16 = make(family, dtype=torch.bfloat16)
    pat = apply_coda(make(family, dtype=torch.bfloat16))
    ids, labels = batch()
    want, low, got = (run(m, ids, labels) for m in (ref64, ref16, pat))
    within_the_bf16_rule(got, low, want, labels)


class HostData(torch.overrides.TorchFunctionMode):
    """Records each tensor made from host data (a list, an array, a number) for a device named by
    the call: on a GPU that is a host-to-device copy, which a CUDA graph can't capture (and, uncaptured,
    a copy every step)."""

    MAKERS = ("tensor", "as_tensor", "asarray")

    def __init__(self) -> None:
        super().__init__()
        self.made: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        named = getattr(func, "__name__", "") in self.MAKERS and kwargs.get("device") is not None
        if named and args and not isinstance(args[0], torch.Tensor) and (where := self.caller()):
            self.made.append(f"torch.{func.__name__}({type(args[0]).__name__}, device=...) at {where}")
        return func(*args, **kwargs)

    @staticmethod
    def caller() -> str | None:
        """file:line of the call if coda_lang made it (not transformers: its eager attention's mask
        is made so on the CPU, and is not what a patched model runs on a GPU)."""
        f = sys._getframe(2)
        while f is not None and "/torch/" in f.f_code.co_filename:
            f = f.f_back
        if f is None or "/coda_lang/" not in f.f_code.co_filename:
            return None
        return f"{f.f_code.co_filename.rsplit('/coda_lang/', 1)[1]}:{f.f_lineno}"


@pytest.mark.parametrize(
    "family, fp8",
    [(f, None) for f in sorted(FAMILIES)] + [(f, "delayed") for f in ("gemma3", "llama", "olmo2", "qwen3")],
)
def test_a_step_makes_no_tensor_from_host_data(family: str, fp8: str | None) -> None:
    """A patched model's training step (after its first) makes no tensor from host data for a device:
    the step must be capturable in a CUDA graph. (Qwen 3's and OLMo 2's q/k norm weights were
    permuted with an index tensor made from a NumPy array in every forward: `torch.cuda.graph`
    refused the copy, 2026-11-28.) In bf16, and with `fp8="delayed"` for a pre-norm family and the
    families with their own q/k norms and post-norms."""
    model = apply_coda(make(family), fp8=fp8)
    ids, labels = batch()
    model(ids, labels=labels).loss.backward()
    with HostData() as spy:
        model(ids, labels=labels).loss.backward()
    assert not spy.made, spy.made
