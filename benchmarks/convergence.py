"""Convergence of a small Llama on a fixed offline corpus (this Python's standard library), one training
run per configuration: HF eager, HF + torch.compile, HF + Liger Kernel, HF + coda (bf16, fp8="delayed" and
fp8="delayed-forward"), HF + torchao float8.

Usage:
    python benchmarks/convergence.py prepare --out DIR [--vocab 16384] [--max-files N]
    python benchmarks/convergence.py train --data DIR [--configs eager,compile,liger,coda,coda-fp8,
        coda-fp8-fwd,torchao-tensorwise,torchao-rowwise] [--steps 1000] [--seq 1024] [--batch 8] [--lr 6e-4] [--warmup 100] [--clip 1.0]
        [--eval-every 100] [--eval-batches 8] [--seed 0] [--size 150m|tiny] [--json FILE] [--device cuda|cpu]
    python benchmarks/convergence.py plot FILE.json --out FILE.svg|FILE.png|FILE.pdf
    the run on one GPU: prepare --out DIR, then train --data DIR --json FILE.json (every configuration,
    1,000 steps of 8 x 1024 tokens), then plot FILE.json --out FILE.svg on a machine with matplotlib
    smoke test on the CPU: prepare --out DIR --max-files 30 --vocab 400, then train --data DIR --size tiny
    --device cpu --configs eager,coda --steps 3 --seq 32 --batch 2 --eval-every 2

`prepare`: the corpus is the `.py` files under `sysconfig.get_paths()["stdlib"]`, in the order of their
relative paths, read as UTF-8 (a file that does not decode is skipped and counted, as is one that holds
the text `<|endoftext|>`), without what `EXCLUDED_DIRS` names (third-party packages; the test suites
and their data: `test/`, `tests/`, idlelib's `idle_test/`, which hold files that are broken on purpose;
bytecode caches) and without the files that differ between builds of one Python version
(`_sysconfigdata_*.py`, `config-*/`). A file is in the validation split when the first 8 bytes of the
sha256 of its relative path, mod 1000, are below 50 (about 5 %); `--max-files N` keeps the first N
files, 5 % of them (at least one) from the validation split. A byte-level BPE (`tokenizers`: every byte
in the alphabet, so that any text encodes and decodes back) of `--vocab` tokens, `<|endoftext|>` among
them, is trained on the training split; each file is encoded and followed by `<|endoftext|>`; written
to DIR: tokenizer.json, train.npy and val.npy (uint16, `np.save`) and meta.json (the Python version,
the files of each split, their bytes and tokens, the sha256 of each split's text and of each file
written, the exclusions). The same Python and arguments write the same bytes. Python 3.11.7's: 732 files,
12.1 MB, 2.78M training tokens at 16384 (4.0 bytes a token): 1,000 steps of 8 x 1024 tokens see each
about three times. The GPU host's Python differs (3.12): prepare here and carry DIR there, so that every
run reads the same tokens (meta.json's hashes say which).

`train`: a Llama of `--size` (150m: hidden 1024, 12 layers, 16 query / 4 KV heads of 64, intermediate 2816,
tied embeddings, rope_theta 1e4, sdpa; about 152M parameters at a vocabulary of 16384; tiny: hidden 64, 2
layers, for tests), its vocabulary the tokenizer's, initialized once from `--seed` (on the CPU) and copied
for each configuration, bf16 weights (as hf_train_step.py), trained by AdamW (betas 0.9, 0.95, weight
decay 0.1 on the matrices and embeddings, none on the norms; fused on a GPU), `--lr` warmed up linearly
over `--warmup` steps then cosine-decayed to 10 % at `--steps`, gradients clipped to norm `--clip` (0: not
clipped). The files are checked against meta.json's sha256 first (a mismatch is an error, exit code 1) and
loaded without pickle. Every configuration sees the same batches in the same order: `--batch` windows of
`--seq` tokens of train.npy at offsets drawn by a torch.Generator seeded by `--seed`; the labels are the
inputs, which the model shifts (each window predicts its last seq - 1 tokens), so the loss is
transformers' causal-LM loss computed by each configuration's own head (HF's cross entropy, Liger's and
coda's fused heads, all to the same contract). Every `--eval-every` steps, before the first and after the
last, the validation loss: the mean over `--eval-batches` fixed batches of val.npy (the same for every
configuration; no gradients; the model stays in training mode, which changes nothing in a Llama without
dropout). The configurations (`CONFIGS`: eager, compile, liger, coda, coda-fp8 (e5m2 cotangents) and
coda-fp8-fwd (bf16 cotangents) and coda-fp8-save16 (coda-fp8 saving its gate/up accumulators in bf16,
not e4m3: $CODA_FP8_SAVE_ACC=0 while it is patched) and coda-fp8-head (coda-fp8 with its LM head's GEMMs in fp8
too, loss_mode="fp8"; coda-fp8-head-e4m3 its dlogits in e4m3) and coda-fp8-oproj (coda-fp8 with its layers'
out-projection in e4m3, the default since 2026-11-29: $CODA_FP8_OUT=1 while it is patched) and
coda-fp8-bf16out (with it in the model's dtype, as before: $CODA_FP8_OUT=0) and coda-fp8-blockwise (fp8="blockwise":
widths of whole 128s, as 150m has) as hf_train_step.py makes them; torchao-tensorwise and torchao-rowwise:
torchao's float8 training of that recipe on every nn.Linear but the LM head, then torch.compile) run one after
another in one process, transformers' Llama module restored between them (Liger patches it); what one
needs that is not here (a GPU, a package) is an error before any training, an unknown name a usage error
(exit code 2). Per configuration: the loss of each step, the gradient norm, the validation losses, the
median step time (CUDA events; the host clock on the CPU; the first step, which compiles, left out),
tokens/s, the peak memory (torch.cuda.max_memory_allocated), and the mean of the last 20 training losses;
a progress line every 10 steps on stderr; `--json` is rewritten after each configuration. A markdown table
last, each final validation loss against the first configuration's.

`plot`: the training loss (the mean of the last 20 steps) and the validation losses of each
configuration of a `train --json` file, one axes, written as SVG, PNG or PDF (needs matplotlib).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import gc
import hashlib
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _sibling(name: str) -> Any:
    """The module benchmarks/`name`.py (benchmarks/ is not a package), loaded by its path."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


hf_train_step = _sibling("hf_train_step")  # its configurations' patches (`prepare`) are reused
GIB = hf_train_step.GIB
EOT = "<|endoftext|>"
# directories left out wherever they are: third-party packages, the test suites (and the test data in
# them, such as lib2to3/tests/data's files that are broken on purpose), bytecode caches
EXCLUDED_DIRS = ("site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__")
# what differs between builds of one Python version: the build's own settings
EXCLUDED_PREFIXES = {"dir": "config-", "file": "_sysconfigdata_"}
VAL_PER_MILLE = 50  # the validation split: sha256(relative path) mod 1000 below this
SMOOTH = 20  # training losses averaged for the plot and the table's last column


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------
# prepare


def excluded_dir(name: str) -> bool:
    return name in EXCLUDED_DIRS or name.startswith(EXCLUDED_PREFIXES["dir"])


def is_val(rel: str) -> bool:
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") % 1000 < VAL_PER_MILLE


def corpus_files(root: Path) -> list[str]:
    """The corpus's files under `root`: relative POSIX paths, sorted (symbolic links to folders not
    followed)."""
    found = []
    for top, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not excluded_dir(d)]  # (not walked into)
        for n in names:
            if n.endswith(".py") and not n.startswith(EXCLUDED_PREFIXES["file"]):
                path = Path(top, n)
                if path.is_file():
                    found.append(path.relative_to(root).as_posix())
    return sorted(found)


def select(files: list[str], max_files: int | None) -> tuple[list[str], list[str]]:
    """(training files, validation files); with `max_files`, the first of each, about 5 % (at least one)
    of them validation files."""
    train = [f for f in files if not is_val(f)]
    val = [f for f in files if is_val(f)]
    if max_files is not None:
        n_val = min(len(val), max(1, round(max_files * VAL_PER_MILLE / 1000)))
        val = val[:n_val]
        train = train[: max(0, max_files - n_val)]
    return train, val


def read_texts(root: Path, rels: list[str], skipped: dict[str, list[str]]) -> tuple[list[str], list[str]]:
    """(the files that are kept, their texts): the undecodable ones and those holding EOT are skipped."""
    kept, texts = [], []
    for rel in rels:
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped["not utf-8"].append(rel)
            continue
        if EOT in text:
            skipped[f"contains {EOT}"].append(rel)
            continue
        kept.append(rel)
        texts.append(text)
    return kept, texts


def train_tokenizer(texts: list[str], vocab: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode(tok: Any, texts: list[str]) -> np.ndarray:
    """The texts' tokens, each text followed by EOT, as uint16."""
    eot = tok.token_to_id(EOT)
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.asarray([eot], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def text_sha256(texts: list[str]) -> str:
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8"))
        h.update(EOT.encode())
    return h.hexdigest()


def cmd_prepare(args: argparse.Namespace) -> int:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    files = corpus_files(root)
    train_rels, val_rels = select(files, args.max_files)
    skipped: dict[str, list[str]] = {"not utf-8": [], f"contains {EOT}": []}
    train_rels, train_texts = read_texts(root, train_rels, skipped)
    val_rels, val_texts = read_texts(root, val_rels, skipped)
    if not train_texts or not val_texts:
        say(f"convergence: no {'training' if not train_texts else 'validation'} files under {root}")
        return 1
    say(f"prepare: {len(train_rels)} training and {len(val_rels)} validation files under {root}")
    t0 = time.perf_counter()
    tok = train_tokenizer(train_texts, args.vocab)
    vocab = tok.get_vocab_size()
    say(f"prepare: BPE of {vocab} tokens trained in {time.perf_counter() - t0:.1f} s")
    tok.save(str(out / "tokenizer.json"))
    arrays = {"train": encode(tok, train_texts), "val": encode(tok, val_texts)}
    for split, a in arrays.items():
        np.save(out / f"{split}.npy", a, allow_pickle=False)
    texts = {"train": train_texts, "val": val_texts}
    rels = {"train": train_rels, "val": val_rels}
    meta = {
        "python": platform.python_version(),
        "python_build": sys.version,
        "stdlib": str(root),
        "excluded": {
            "dirs": list(EXCLUDED_DIRS),
            "dir_prefix": EXCLUDED_PREFIXES["dir"],
            "file_prefix": EXCLUDED_PREFIXES["file"],
            "val_rule": f"sha256(relative path)[:8] mod 1000 < {VAL_PER_MILLE}",
        },
        "max_files": args.max_files,
        "vocab_requested": args.vocab,
        "vocab_size": vocab,
        "eot_id": tok.token_to_id(EOT),
        "skipped": skipped,
        "splits": {
            split: {
                "files": len(rels[split]),
                "bytes": sum(len(t.encode("utf-8")) for t in texts[split]),
                "tokens": int(arrays[split].size),
                "text_sha256": text_sha256(texts[split]),
                "paths": rels[split],
            }
            for split in ("train", "val")
        },
        "sha256": {name: sha256_file(out / name) for name in ("tokenizer.json", "train.npy", "val.npy")},
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"Python {meta['python']} standard library ({root}), BPE of {vocab} tokens, written to {out}")
    print("| split | files | MB | tokens | bytes/token |")
    print("|---|---|---|---|---|")
    for split in ("train", "val"):
        s = meta["splits"][split]
        print(
            f"| {split} | {s['files']} | {s['bytes'] / 1e6:.2f} | {s['tokens']} | {s['bytes'] / max(1, s['tokens']):.2f} |"
        )
    n_skipped = sum(len(v) for v in skipped.values())
    if n_skipped:
        print("skipped: " + ", ".join(f"{len(v)} {why}" for why, v in skipped.items() if v))
    return 0


# ---------------------------------------------------------------------------------------------------
# configurations


@dataclass(frozen=True)
class Config:
    """A configuration: `prepare` patches or wraps the model (on its device) and returns what to call
    for a step; `packages` (import name, pip name) and `cuda` (a GPU of at least this compute
    capability) are what it needs, checked before any training."""

    prepare: Callable[[Any], Any]
    packages: tuple[tuple[str, str], ...] = ()
    cuda: tuple[int, int] | None = None


def patched_under_env(name: str) -> Callable[[Any], Any]:
    """hf_train_step's `prepare` of configuration `name`, run under the environment that configuration
    is patched under (hf_train_step.CONFIG_ENV: coda-fp8-save16's $CODA_FP8_SAVE_ACC=0), restored after."""

    def prepare(model: Any) -> Any:
        with hf_train_step.config_env(name):
            return hf_train_step.prepare(model, name=name)

    return prepare


CONFIGS: dict[str, Config] = {
    "eager": Config(functools.partial(hf_train_step.prepare, name="eager")),
    "compile": Config(functools.partial(hf_train_step.prepare, name="compile")),
    "liger": Config(
        functools.partial(hf_train_step.prepare, name="liger"),
        packages=(("liger_kernel", "liger-kernel"),),
        cuda=(8, 0),
    ),
    "coda": Config(functools.partial(hf_train_step.prepare, name="coda")),
    "coda-fp8": Config(functools.partial(hf_train_step.prepare, name="coda-fp8")),
    "coda-fp8-fwd": Config(functools.partial(hf_train_step.prepare, name="coda-fp8-fwd")),
    "coda-fp8-save16": Config(patched_under_env("coda-fp8-save16")),
    "coda-fp8-head": Config(functools.partial(hf_train_step.prepare, name="coda-fp8-head")),
    "coda-fp8-head-e4m3": Config(patched_under_env("coda-fp8-head-e4m3")),
    "coda-fp8-blockwise": Config(functools.partial(hf_train_step.prepare, name="coda-fp8-blockwise")),
    "coda-fp8-oproj": Config(patched_under_env("coda-fp8-oproj")),
    "coda-fp8-bf16out": Config(patched_under_env("coda-fp8-bf16out")),
    "torchao-tensorwise": Config(
        functools.partial(hf_train_step.prepare, name="torchao-tensorwise"),
        packages=(("torchao", "torchao"),),
        cuda=(8, 9),
    ),
    "torchao-rowwise": Config(
        functools.partial(hf_train_step.prepare, name="torchao-rowwise"),
        packages=(("torchao", "torchao"),),
        cuda=(8, 9),
    ),
}


def cannot_run(name: str, device: str) -> str | None:
    """Why configuration `name` can't run on `device` here (None: it can)."""
    cfg = CONFIGS[name]
    for module, pip in cfg.packages:
        if importlib.util.find_spec(module) is None:
            return f"{name} needs {module} (pip install {pip})"
    if cfg.cuda is not None:
        if device != "cuda":
            return f"{name} needs a CUDA GPU (--device cuda)"
        if torch.cuda.get_device_capability() < cfg.cuda:
            return f"{name} needs a GPU of compute capability {cfg.cuda[0]}.{cfg.cuda[1]} or more"
    if name.startswith("coda") and device == "cuda":
        import coda_lang.torch as ct

        if ct.uses_kernels("cuda"):
            missing = [
                pip
                for mod, pip in (("cutlass", "nvidia-cutlass-dsl"), ("quack", "quack-kernels"))
                if importlib.util.find_spec(mod) is None
            ]
            if missing:
                return f"{name} on this GPU compiles kernels: needs {' and '.join(missing)}"
        else:
            say(
                f"{name}: coda's blocks run as torch stand-ins on this device (not a Hopper GPU, or CODA_EMULATE=1)"
            )
    return None


# ---------------------------------------------------------------------------------------------------
# train

SIZES: dict[str, dict[str, Any]] = {
    "150m": dict(
        hidden_size=1024,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=2816,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
    ),
}


def llama_config(size: str, vocab: int, seq: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        max_position_embeddings=seq,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attn_implementation="sdpa",
        use_cache=False,
        **SIZES[size],
    )


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """The learning rate of step `step` (0-based) over the peak: linear warmup, cosine decay to 10 %."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - 1 - warmup))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def smooth(values: Sequence[float], window: int = SMOOTH) -> np.ndarray:
    """The trailing mean of `window` values at each position (of the values so far, at the start)."""
    v = np.asarray(values, dtype=np.float64)
    c = np.concatenate([[0.0], np.cumsum(v)])
    i = np.arange(1, len(v) + 1)
    lo = np.maximum(0, i - window)
    return (c[i] - c[lo]) / (i - lo)


class DataError(Exception):
    """The data folder is missing something or does not match its meta.json."""


def load_data(data: Path) -> tuple[dict[str, Any], np.ndarray, np.ndarray, int]:
    """(meta.json, train tokens, validation tokens, vocabulary size), each file checked against meta.json."""
    meta_path = data / "meta.json"
    if not meta_path.is_file():
        raise DataError(f"{meta_path} not found: run `convergence.py prepare --out {data}` first")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    for name, want in meta["sha256"].items():
        path = data / name
        if not path.is_file():
            raise DataError(f"{path} not found (meta.json lists it): run `prepare` again")
        got = sha256_file(path)
        if got != want:
            raise DataError(
                f"{path} does not match meta.json (sha256 {got[:16]}..., meta.json says {want[:16]}...): "
                "run `prepare` again"
            )
    train = np.load(data / "train.npy", allow_pickle=False)
    val = np.load(data / "val.npy", allow_pickle=False)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(data / "tokenizer.json")).get_vocab_size()
    for name, a in (("train.npy", train), ("val.npy", val)):
        if a.dtype != np.uint16 or a.ndim != 1:
            raise DataError(f"{data / name}: expected a 1-D uint16 array, found {a.dtype} {a.shape}")
        if a.size and int(a.max()) >= vocab:
            raise DataError(f"{data / name}: token {int(a.max())} out of the vocabulary of {vocab}")
    return meta, train, val, vocab


def windows(tokens: torch.Tensor, offsets: torch.Tensor, seq: int) -> torch.Tensor:
    """[*offsets.shape, seq]: the windows of `tokens` at `offsets`."""
    return tokens[offsets[..., None] + torch.arange(seq)]


@contextmanager
def restored(module: Any) -> Iterator[None]:
    """Put back what a configuration changed in `module`'s namespace (Liger patches transformers' Llama
    module: its RMSNorm, rotary embedding and loss) when it is done."""
    saved = dict(vars(module))
    try:
        yield
    finally:
        for k in [k for k in vars(module) if k not in saved]:
            delattr(module, k)
        for k, v in saved.items():
            if vars(module).get(k) is not v:
                setattr(module, k, v)


class StepTimer:
    """Each step's time: CUDA events on a GPU (read when `times` is asked), the host clock otherwise."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.pending: list[tuple[Any, Any]] = []
        self.done: list[float] = []

    def start(self) -> None:
        if self.cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            self.pending.append((a, b))
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.pending[-1][1].record()
        else:
            self.done.append((time.perf_counter() - self.t0) * 1e3)

    def times(self) -> list[float]:
        if self.pending:
            self.pending[-1][1].synchronize()
            self.done += [a.elapsed_time(b) for a, b in self.pending]
            self.pending = []
        return self.done


def run_config(
    name: str,
    template: Any,
    batches: torch.Tensor,
    val_batches: torch.Tensor,
    args: argparse.Namespace,
) -> dict[str, Any]:
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    model = copy.deepcopy(template).to(device)
    model.train()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    fwd = CONFIGS[name].prepare(model)
    prepare_s = time.perf_counter() - t0
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=cuda)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, functools.partial(lr_factor, warmup=args.warmup, steps=args.steps)
    )
    val_dev = val_batches.to(device)

    def evaluate() -> float:
        with torch.no_grad():
            total = torch.zeros((), device=device)
            for x in val_dev:
                total += fwd(input_ids=x, labels=x).loss.float()
        return float(total) / len(val_dev)

    timer = StepTimer(cuda)
    losses: list[float] = []
    norms: list[float] = []
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    evals = [[0, evaluate()]]
    first_s = None
    diverged = None
    for i in range(args.steps):
        x = batches[i].to(device, non_blocking=True)
        t0 = time.perf_counter()
        timer.start()
        loss = fwd(input_ids=x, labels=x).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(params, args.clip or math.inf)  # (inf: the norm only)
        opt.step()
        lr = sched.get_last_lr()[0]  # (this step's)
        sched.step()
        opt.zero_grad(set_to_none=True)
        timer.stop()
        pending.append((loss.detach().float(), norm.detach().float()))
        if i == 0:
            if cuda:
                torch.cuda.synchronize()
            first_s = prepare_s + time.perf_counter() - t0  # (patching or compiling included)
            if name.startswith("coda"):  # the other candidate tiles compile on in the background
                import coda_lang.torch as ct

                ct.wait_for_kernels()
        done = i + 1
        is_eval = done % args.eval_every == 0 or done == args.steps
        if done % 10 == 0 or i == 0 or is_eval:
            losses += [float(v) for v, _ in pending]
            norms += [float(n) for _, n in pending]
            pending = []
            if not all(math.isfinite(v) for v in losses[-10:]):
                diverged = next(j for j, v in enumerate(losses) if not math.isfinite(v))
                say(f"{name}: loss {losses[diverged]} at step {diverged}: stopped")
                break
            line = f"{name}: step {done}/{args.steps} loss {losses[-1]:.4f} lr {lr:.2e}"
            line += f" {statistics.median(timer.times()[-10:]):.1f} ms/step"
            if is_eval:
                evals.append([done, evaluate()])
                line += f" eval {evals[-1][1]:.4f}"
            say(line)
    times = timer.times()
    step_ms = statistics.median(times[1:] if len(times) > 1 else times)
    return {
        "losses": losses,
        "grad_norms": norms,
        "eval": evals,
        "step_ms": step_ms,
        "first_step_s": first_s,
        "tokens_per_s": batches.shape[1] * batches.shape[2] / (step_ms / 1e3),
        "peak_gib": torch.cuda.max_memory_allocated() / GIB if cuda else None,
        "final_train_loss_avg": statistics.fmean(losses[-SMOOTH:]) if losses else None,
        "final_eval": evals[-1][1] if diverged is None else None,
        "diverged_at": diverged,
    }


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def table(results: dict[str, dict[str, Any]]) -> str:
    names = list(results)
    first = results[names[0]].get("final_eval") if names else None
    rows = [
        f"| config | final eval loss | vs {names[0] if names else ''} | mean of last {SMOOTH} train losses "
        "| step | tokens/s | peak memory |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, r in results.items():
        if "error" in r:
            rows.append(f"| {n} | failed: {r['error'][:80]} | | | | | |")
            continue
        ev = r["final_eval"]
        if ev is None:
            rows.append(f"| {n} | diverged at step {r['diverged_at']} | | | | | |")
            continue
        vs = f"{(ev / first - 1) * 100:+.2f} %" if first else ""
        peak = f"{r['peak_gib']:.1f} GiB" if r["peak_gib"] is not None else "-"
        rows.append(
            f"| {n} | {ev:.4f} | {vs} | {r['final_train_loss_avg']:.4f} | {r['step_ms']:.1f} ms "
            f"| {r['tokens_per_s'] / 1e3:.1f}k | {peak} |"
        )
    return "\n".join(rows)


def cmd_train(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        p.error(f"unknown configuration {', '.join(unknown) or '(none)'}: choose from {', '.join(CONFIGS)}")
    if len(set(names)) != len(names):
        p.error("a configuration is named twice")
    for k in ("steps", "seq", "batch", "eval_every", "eval_batches"):
        if getattr(args, k) < 1:
            p.error(f"--{k.replace('_', '-')} must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        say("convergence: --device cuda, but torch sees no CUDA GPU (--device cpu runs on the CPU)")
        return 2
    why = [w for w in (cannot_run(n, args.device) for n in names) if w]
    if why:
        say("convergence: " + "; ".join(why))
        return 2
    try:
        corpus, train_np, val_np, vocab = load_data(Path(args.data))
    except DataError as e:
        say(f"convergence: {e}")
        return 1
    for split, a in (("train", train_np), ("val", val_np)):
        if a.size <= args.seq:
            say(f"convergence: {split}.npy has {a.size} tokens, not more than --seq {args.seq}")
            return 1
    train_t = torch.from_numpy(train_np.astype(np.int64))
    val_t = torch.from_numpy(val_np.astype(np.int64))
    g = torch.Generator().manual_seed(args.seed)
    batches = windows(
        train_t,
        torch.randint(0, train_t.numel() - args.seq + 1, (args.steps, args.batch), generator=g),
        args.seq,
    )
    g = torch.Generator().manual_seed(args.seed + 1)
    val_batches = windows(
        val_t,
        torch.randint(0, val_t.numel() - args.seq + 1, (args.eval_batches, args.batch), generator=g),
        args.seq,
    )
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    torch.manual_seed(args.seed)
    template = AutoModelForCausalLM.from_config(llama_config(args.size, vocab, args.seq)).to(torch.bfloat16)
    n_params = sum(p.numel() for p in template.parameters())
    import tokenizers
    import transformers

    meta = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "model": {"size": args.size, "params": n_params, "vocab": vocab, **SIZES[args.size]},
        "corpus": {k: v for k, v in corpus.items() if k != "splits"}
        | {"splits": {s: {k: v for k, v in d.items() if k != "paths"} for s, d in corpus["splits"].items()}},
    }
    say(
        f"convergence: Llama {args.size} ({n_params / 1e6:.1f}M parameters), {train_np.size} training tokens, "
        f"{args.steps} steps of {args.batch} x {args.seq} on {meta['device']}"
    )
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            with restored(modeling_llama):
                results[name] = run_config(name, template, batches, val_batches, args)
        except Exception as e:  # one configuration failing must not hide the others' numbers
            say(f"{name}: failed: {type(e).__name__}: {str(e)[:2000]}")
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:2000]}"}
        release()
        if args.json:
            Path(args.json).write_text(
                json.dumps({"meta": meta, "args": vars(args), "results": results}, indent=1)
            )
    print(
        f"\n{meta['device']}, Llama {args.size} ({n_params / 1e6:.1f}M), {args.steps} steps of {args.batch} x {args.seq}, bf16"
    )
    print(table(results))
    return 1 if any("error" in r for r in results.values()) else 0


# ---------------------------------------------------------------------------------------------------
# plot


def cmd_plot(args: argparse.Namespace) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("convergence: plot needs matplotlib (pip install matplotlib)")
        return 2
    run = json.loads(Path(args.file).read_text(encoding="utf-8"))
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, r in run["results"].items():
        if "error" in r or not r.get("losses"):
            continue
        steps = np.arange(len(r["losses"]))
        (line,) = ax.plot(steps, smooth(r["losses"]), label=f"{name} (train, mean of {SMOOTH})", lw=1.2)
        if r["eval"]:
            ev = np.asarray(r["eval"], dtype=np.float64)
            ax.plot(
                ev[:, 0], ev[:, 1], "o--", color=line.get_color(), ms=4, lw=0.8, label=f"{name} (validation)"
            )
    m, a = run.get("meta", {}), run.get("args", {})
    model = m.get("model", {})
    ax.set_title(
        f"Llama {model.get('size', '?')} ({model.get('params', 0) / 1e6:.1f}M), batch {a.get('batch')} x {a.get('seq')}, "
        f"Python {m.get('corpus', {}).get('python', '?')} stdlib; {m.get('device', '')}",
        fontsize=9,
    )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out)
    say(f"wrote {args.out}")
    return 0


# ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="the corpus: tokenizer, train.npy, val.npy, meta.json")
    pp.add_argument("--out", required=True, help="the folder to write")
    pp.add_argument("--vocab", type=int, default=16384, help="BPE vocabulary size (258 to 65535)")
    pp.add_argument("--max-files", type=int, default=None, help="the first N files only (tests)")
    pt = sub.add_parser("train", help="train each configuration on the corpus")
    pt.add_argument("--data", required=True, help="the folder `prepare` wrote")
    pt.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of: {', '.join(CONFIGS)}")
    pt.add_argument("--steps", type=int, default=1000, help="training steps per configuration")
    pt.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    pt.add_argument("--batch", type=int, default=8, help="sequences per step")
    pt.add_argument("--lr", type=float, default=6e-4, help="peak learning rate")
    pt.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    pt.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping (0: none)")
    pt.add_argument("--eval-every", type=int, default=100, help="validation loss every N steps")
    pt.add_argument("--eval-batches", type=int, default=8, help="validation batches (fixed)")
    pt.add_argument("--seed", type=int, default=0, help="the weights' and the batches' seed")
    pt.add_argument("--size", default="150m", choices=list(SIZES), help="the Llama's shapes")
    pt.add_argument("--json", default=None, help="write the results here (after each configuration)")
    pt.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    pl = sub.add_parser("plot", help="the loss curves of a `train --json` file")
    pl.add_argument("file")
    pl.add_argument("--out", required=True, help="FILE.svg or FILE.png")
    args = p.parse_args(argv)
    if args.cmd == "prepare":
        if not 258 <= args.vocab <= 65535:
            pp.error(
                "--vocab must be from 258 (the 256 bytes, <|endoftext|> and one merge) to 65535 (uint16)"
            )
        if args.max_files is not None and args.max_files < 2:
            pp.error("--max-files must be at least 2 (a training and a validation file)")
        return cmd_prepare(args)
    if args.cmd == "train":
        return cmd_train(args, pt)
    if Path(args.out).suffix.lower() not in (".svg", ".png", ".pdf"):
        pl.error(f"--out {args.out}: name an .svg, .png or .pdf file")
    if not Path(args.file).is_file():
        pl.error(f"{args.file} not found")
    return cmd_plot(args)


if __name__ == "__main__":
    sys.exit(main())
