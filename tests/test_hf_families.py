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
