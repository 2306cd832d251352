"""Train a coda-patched Hugging Face Llama (or Qwen3) with the HF Trainer under Accelerate's FSDP2.

    accelerate launch --config_file examples/accelerate/fsdp2.yaml examples/accelerate/train.py \
        [--patch none,coda] [--model CONFIG] [--steps 10] [--seq 8192] [--batch 1] [--json FILE]

For each model (`--model`: a config.json or a folder holding one, repeatable; by default
Llama-3.2-1B's shapes) and each of `--patch` in turn: the model is built from its config with random
weights (seed 0), in bf16 on a GPU, f32 on the CPU; patched with `apply_coda_to_llama` or
`apply_coda_to_qwen3` (`coda`) or not (`none`, the reference); then the Trainer
trains it on random tokens (`--batch` rows of `--seq` tokens per process and step, labels = inputs),
AdamW, constant learning rate. Accelerate wraps it as the config file says: with
examples/accelerate/fsdp2.yaml, `fully_shard` on each decoder layer, on the embedding and the LM head,
then on the root, bf16 gathers of f32 master weights. Patching comes first: it fuses and moves
parameters, which the wrapping then shards.

Printed (rank 0): each step's loss, gradient norm and wall time, and the FSDP2 units; `--json FILE`
writes them, a list of runs. The losses of `coda` and `none` agree (bf16 noise on a GPU, float32
rounding on the CPU, where the blocks run as their torch stand-ins; tests/test_hf_accelerate.py).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch


def llama_1b() -> Any:
    """Llama-3.2-1B's config (benchmarks/hf_train_step.py's), 16 layers."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        attn_implementation="sdpa",
        use_cache=False,
    )


def load_config(path: str | None) -> Any:
    from transformers import AutoConfig

    if path is None:
        return llama_1b()
    p = Path(path)
    cfg = AutoConfig.from_pretrained(str(p.parent if p.is_file() else p))
    cfg.use_cache = False  # (training: a KV cache would grow in a checkpointed layer's recompute)
    return cfg


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Random token rows (seeded by index), labels = inputs."""

    def __init__(self, rows: int, seq: int, vocab: int):
        self.rows, self.seq, self.vocab = rows, seq, vocab

    def __len__(self) -> int:
        return self.rows

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.randint(0, self.vocab, (self.seq,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


def train(cfg: Any, patch: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run: the model of `cfg`, patched or not, trained by the Trainer; its steps and FSDP2 units."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import (
        AutoModelForCausalLM,
        PrinterCallback,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16 if cuda else torch.float32)
    if patch == "coda":
        from coda_lang.hf import apply_coda_to_llama, apply_coda_to_qwen3

        apply = {"llama": apply_coda_to_llama, "qwen3": apply_coda_to_qwen3}[cfg.model_type]
        apply(model)  # before the Trainer wraps it: patching fuses and moves parameters

    steps: list[dict[str, float]] = []

    class Record(TrainerCallback):  # type: ignore[misc]
        t0 = 0.0

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            steps.append({"seconds": time.perf_counter() - self.t0})

        def on_log(self, _args: Any, state: Any, control: Any, logs: Any = None, **k: Any) -> None:
            if logs and "loss" in logs and steps:
                steps[-1].update(loss=float(logs["loss"]), grad_norm=float(logs["grad_norm"]))

    targs = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.01,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_cpu=not cuda,
        seed=0,
    )
    data = Tokens(args.steps * args.batch * 16, args.seq, cfg.vocab_size)
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[Record()])
    trainer.remove_callback(PrinterCallback)  # (the steps are printed at the end)
    trainer.train()
    units = [n or "(root)" for n, m in trainer.model.named_modules() if isinstance(m, FSDPModule)]
    return {
        "patch": patch,
        "model": cfg.model_type,
        "tied": bool(cfg.tie_word_embeddings),
        "steps": steps,
        "units": units,
        "world": trainer.args.world_size,
        "mixed_precision": trainer.accelerator.mixed_precision,
        "rank0": trainer.is_world_process_zero(),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--patch", default="none,coda", help="comma-separated: coda, none (default both)")
    p.add_argument(
        "--model",
        action="append",
        help="a config.json, or a folder holding one; repeatable (default: Llama-3.2-1B shapes)",
    )
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1, help="rows per process and step")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--out", default="/tmp/coda_trainer", help="the Trainer's output_dir (nothing is saved)")
    p.add_argument("--json", help="write the runs' losses, gradient norms and step times here (rank 0)")
    args = p.parse_args(argv)
    patches = args.patch.split(",")
    if not set(patches) <= {"coda", "none"}:
        p.error(f"--patch takes coda and none, got {args.patch!r}")
    runs = []
    for path in args.model or [None]:
        for patch in patches:
            run = train(load_config(path), patch, args)
            runs.append(run)
            if run["rank0"]:
                print(f"{run['model']} ({'tied' if run['tied'] else 'untied'}), patch {patch}:", flush=True)
                for i, st in enumerate(run["steps"]):
                    loss, norm = st.get("loss", float("nan")), st.get("grad_norm", float("nan"))
                    print(
                        f"  step {i}: loss {loss:.6f}, grad norm {norm:.6f}, {st['seconds']:.2f} s",
                        flush=True,
                    )
                print(f"  FSDP2 units: {', '.join(run['units']) or 'none'}", flush=True)
    if args.json and runs and runs[0]["rank0"]:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
