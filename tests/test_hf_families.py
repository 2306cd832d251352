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
    """Every family of the tests is patched by `apply_coda` as by its own entry point (its facts, its
    loss settings), and matches the unpatched model."""
    assert set(KNOWN) == set(FAMILIES)
    for family in sorted(FAMILIES):
        ref = make(family)
        pat = apply_coda(copy.deepcopy(ref), loss_mode="vocab")
        assert pat._coda.family is KNOWN[family] and pat._coda.loss_mode == "vocab"
        ids, labels = batch()
        l0, z0, _ = run(ref, ids, labels)
        l1, z1, _ = run(pat, ids, labels)
        assert rel(l1, l0) < 1e-5 and rel(z1, z0) < 1e-5, family


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
    with pytest.raises(
        ValueError, match="model_type 'gpt2' .*not a family coda_lang.hf patches; supported: llama"
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
    assert set(g1) == set(g0) and len(g0) == len(list(ref.parameters()))
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


# Released Llama-architecture configurations (model_type "llama"), from their config.json: the
# settings the patch reads (widths, heads, tied embeddings, RoPE, epsilon). Two layers each: the
# layer count changes nothing the patch checks.
RELEASED_LLAMA = {
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


@pytest.mark.parametrize("name", sorted(RELEASED_LLAMA))
def test_released_llama_configurations_patch_at_their_widths(name: str) -> None:
    """Each released configuration, at its own widths (on the meta device: no memory, no forward), in
    bf16: the patch's checks pass (widths the kernels can load, the RoPE type, the heads) and its
    fused weights have the model's shapes (one head_dim of 64 or 128, from hidden_size / heads)."""
    over = RELEASED_LLAMA[name]
    cfg = transformers.LlamaConfig(
        **over, num_hidden_layers=2, rms_norm_eps=1e-5, max_position_embeddings=8192
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    apply_coda(model)
    h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
    hd = d // h
    st = model._coda
    assert (st.H, st.KV, st.HD, st.D, st.eps) == (h, kv, hd, d, 1e-5)
    assert model.model.coda_first.self_attn.qkv_weight.shape == ((h + 2 * kv) * hd, d)
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


@pytest.mark.parametrize("name", sorted(TINY_LLAMA))
def test_llama_configurations_match_unpatched(name: str) -> None:
    """Each released configuration's settings at tiny widths: loss, logits and every gradient of the
    patched model are the unpatched model's in float32 (1e-4), over 40 positions."""
    ref = make("llama", rms_norm_eps=1e-5, **TINY_LLAMA[name])
    matches_unpatched(ref, apply_coda(copy.deepcopy(ref)), s=40)
