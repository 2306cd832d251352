"""TRL's SFTTrainer with a patched peft model (issue 32's recipe, docs/models.md "LoRA (peft)").

On the CPU with the tiny Llama of tests/test_hf.py, a word-level tokenizer made here (no hub) and a
dataset of random "text": LoRA applied, the peft model patched, then `SFTTrainer(model=...)`. TRL
1.16 adds its own chunked LM head to the model's forward (`add_fused_lm_head`), which calls the
patched base model (the blocks) and reads the LM head's weight: on one batch its loss and every
adapter gradient equal the unpatched run's (f32), and 2 steps lower the loss as unpatched. A `peft_config` given to
SFTTrainer with a patched model (LoRA after patching) is refused by name.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from test_hf import VOCAB, make  # noqa: E402

from coda_lang.hf import apply_coda_to_llama  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tokenizer() -> Any:
    """A word-level tokenizer of the tiny model's vocabulary: <pad>, <eos>, <unk>, w3 ... w95."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(3, VOCAB)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def dataset() -> Any:
    """16 rows of 23 words, a short motif repeated (so that training lowers the loss), all alike: the
    trainer's shuffling draws from the process's random state, which differs between runs in one
    process, and with rows alike every order gives the same batches."""
    g = torch.Generator().manual_seed(0)
    motif = [f"w{int(x)}" for x in torch.randint(3, VOCAB, (6,), generator=g)]
    rows = [" ".join((motif * 4)[:23])] * 16
    return datasets.Dataset.from_dict({"text": rows})


def peft_model() -> Any:
    model = make("llama")
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    lora = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False
    )
    return peft.get_peft_model(model, lora)


def trainer(model: Any, out: Any, steps: int = 2, **kw: Any) -> Any:
    args = trl.SFTConfig(
        output_dir=str(out),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        max_length=32,
        disable_tqdm=True,
    )
    return trl.SFTTrainer(model=model, args=args, train_dataset=dataset(), processing_class=tokenizer(), **kw)


def test_sft_trainer_trains_a_patched_peft_model_as_the_unpatched_one(tmp_path: Any) -> None:
    """The recipe: LoRA, then the patch, then SFTTrainer. On one batch, SFTTrainer's loss (its own
    chunked head over the patched base model's blocks) and every adapter gradient are the unpatched
    run's within 1e-5 (f32). Then 2 steps each: the loss falls, and the logged losses agree within
    1e-3 (two runs of the unpatched model in one process differ by 5e-5 already: the trainer's own
    state between runs, not the model)."""
    ref = peft_model()
    pat = apply_coda_to_llama(copy.deepcopy(ref))
    trainers = [trainer(m, tmp_path / n) for m, n in ((ref, "ref"), (pat, "pat"))]
    batch = next(iter(trainers[0].get_train_dataloader()))
    got = []
    for t in trainers:
        t.model.train()
        t.model.zero_grad(set_to_none=True)
        loss = t.compute_loss(t.model, {k: v.clone() for k, v in batch.items()})
        loss.backward()
        grads = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
        got.append((float(loss), grads))
        t.model.zero_grad(set_to_none=True)
    (l0, g0), (l1, g1) = got
    assert abs(l1 - l0) < 1e-5 * abs(l0)
    assert set(g0) == set(g1) and len(g0) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    for n, g in g0.items():
        assert float((g1[n] - g).abs().max() / g.abs().max()) < 1e-5, n
    logged = []
    for t in trainers:
        t.train()
        logged.append([h["loss"] for h in t.state.log_history if "loss" in h])
    want, have = logged
    assert len(have) == len(want) == 2 and have[-1] < have[0] - 0.05
    for a, b in zip(have, want, strict=True):
        assert abs(a - b) < 1e-3 * abs(b), logged


def test_a_peft_config_with_a_patched_model_is_refused(tmp_path: Any) -> None:
    """SFTTrainer(peft_config=...) applies LoRA to the model it is given: to a patched one that is
    LoRA after patching, refused (peft itself finds no q/k/v to adapt; o/down adapted are refused at
    the first forward), saying to apply LoRA before patching."""
    model = make("llama")
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    apply_coda_to_llama(model)
    lora = peft.LoraConfig(r=8, target_modules=["o_proj", "down_proj"], lora_dropout=0.0)
    with pytest.raises(ValueError, match="when applied before patching"):
        trainer(model, tmp_path, peft_config=lora).train()
