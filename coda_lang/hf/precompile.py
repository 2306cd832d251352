"""A patched model's kernels from its config alone: what `coda precompile` compiles ahead of training.

What it does: `read_config(path)` reads a transformers config (a config.json, or a folder holding one)
of a family the patch knows (`FAMILIES`: the model types `apply_coda` patches), raising `ConfigError`
with what is wrong. `model_functions(config, dtype, loss_mode, lora, fp8)` gives the block functions a patched
model of that config runs in a training step: the first layer's, the layers', the last layer's and
the loss head of `loss_mode`. They are made the way a training process makes them: the model is
built on the meta device (no weights, no memory), with two layers (every block of a deeper model
appears in two: the first layer's, one layer boundary, the last), and patched; the patch builds the
blocks. `model_kernels(functions)` lists their CUDA blocks (forward, backward, each chunked
backward): the kernels a first training step compiles (`compile_together`), which
`runtime.tiles.precompile` compiles into the kernel cache. `time_tiles(config, ...)`, on a Hopper
GPU: a two-layer patched model with random weights trains two steps on `batch` rows of `seq` tokens,
so that each stage's candidate tiles are timed at the training shapes and the choices cached.
What it does not: parse arguments or print (cli/precompile.py), compile (the backend) or load weights.
Invariants: the kernels depend on the config only through the program's text (dtype, RMSNorm's eps,
head_dim, the family's q/k norm, the fp8 recipe) and the loss mode, never on the hidden size, the vocabulary, the
number of layers or the sequence: the cache is keyed by the emitted epilogue and the tile, not by M,
N, K; a config the patch refuses raises its ValueError.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from coda_lang.hf.families import apply_coda
from coda_lang.hf.family import FAMILIES as KNOWN
from coda_lang.torch import BlockFunction, wait_for_kernels

FAMILIES = sorted(KNOWN)  # the model types it takes: every family the patch knows
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}  # (the kernels multiply 16-bit operands)


class ConfigError(Exception):
    """A config that can't be read (`unreadable`), or is no config of a family the patch knows (the
    message says which)."""

    def __init__(self, message: str, unreadable: bool = False):
        super().__init__(message)
        self.unreadable = unreadable


def read_config(path: str | Path) -> Any:
    """The transformers config at `path` (a JSON file, or a folder holding config.json)."""
    from transformers import AutoConfig

    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"can't read {file}: no such file", unreadable=True) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"can't read {file}: {getattr(e, 'strerror', None) or e}", unreadable=True
        ) from None
    except ValueError as e:
        raise ConfigError(f"{file} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file} is not a transformers config (a JSON object)")
    kind = data.pop("model_type", None)
    if kind not in FAMILIES:
        known = ", ".join(FAMILIES)
        got = f"model_type {kind!r}" if kind is not None else "no model_type"
        raise ConfigError(f"{file} has {got}; coda_lang.hf patches {known}")
    try:
        return AutoConfig.for_model(kind, **data)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{file}: transformers can't make a {kind} config of it: {e}") from None


def _patched(
    config: Any, dtype: torch.dtype, loss_mode: str, device: str, layers: int = 2, fp8: str | None = None
) -> Any:
    """The patched model of `config` (`layers` decoder layers) on `device`, parameters in `dtype`, its
    blocks those of the fp8 recipe `fp8` (None: `dtype`'s)."""
    from transformers import AutoModelForCausalLM

    cfg = type(config).from_dict(config.to_dict())
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    cfg.use_cache = False
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return apply_coda(model, loss_mode=loss_mode, fp8=fp8)


# the block weight each peft LoRA target adapts (Phi-3's fused projections among them)
LORA_WEIGHTS = {
    "q_proj": "w_qkv",
    "k_proj": "w_qkv",
    "v_proj": "w_qkv",
    "qkv_proj": "w_qkv",
    "o_proj": "w_o",
    "gate_proj": "w_13",
    "up_proj": "w_13",
    "gate_up_proj": "w_13",
    "down_proj": "w_2",
}


def model_functions(
    config: Any,
    dtype: torch.dtype = torch.bfloat16,
    loss_mode: str = "rows",
    lora: tuple[str, ...] = (),
    fp8: str | None = None,
) -> list[BlockFunction]:
    """The block functions of a training step of the patched model of `config` (see the module
    docstring); ValueError where the patch refuses the config, or for a `lora` target (a module name
    of peft's `target_modules`) the blocks don't run. With `lora`, the step of a peft LoRA model on
    those targets, its base frozen: each block cut before its adapted GEMMs, no weight differentiated
    (hf/lora.py), as `forward.run_lora` makes them. With `fp8` (a recipe of `apply_coda(fp8=...)`),
    the blocks of a model patched with it."""
    unknown = [t for t in lora if t not in LORA_WEIGHTS]
    if unknown:
        raise ValueError(f"LoRA targets {unknown}: the blocks run LoRA on {', '.join(LORA_WEIGHTS)}")
    st = _patched(config, dtype, loss_mode, "meta", fp8=fp8)._coda
    blocks = st.blocks(dtype)
    head = blocks.loss_head(loss_mode)
    if not lora:
        return [blocks.first, blocks.layer, blocks.last, head]
    adapted = {LORA_WEIGHTS[t] for t in lora}
    out = []
    for fn in (blocks.first, blocks.layer, blocks.last):
        weights = [p.var.name for p in fn.block.ir.params if p.var.name.startswith(("w_", "b_"))]
        cut = tuple(sorted(w for w in weights if w in adapted))
        out += [f for f, _ in blocks.parts(fn.name, cut, tuple(sorted(weights)))]
    return [*out, head]


def model_kernels(functions: list[BlockFunction]) -> list[Any]:
    """The CUDA blocks of `functions`' kernels (forward, backward, chunked backwards), each once."""
    out: list[Any] = []
    for f in functions:
        for cb in f.kernel_blocks():
            if all(cb is not x for x in out):
                out.append(cb)
    return out


def time_tiles(
    config: Any,
    dtype: torch.dtype,
    loss_mode: str,
    seq: int,
    batch: int = 1,
    device: str = "cuda",
    fp8: str | None = None,
) -> tuple[float, float]:
    """On a Hopper GPU: two training steps (forward and backward with labels) of a two-layer patched
    model of `config` with random weights at `batch` x `seq` tokens, the kernels' background compiles
    finished between them; the second step times each stage's tiles at those shapes (tuning.json in
    the kernel cache keeps the choices). Returns the two steps' seconds. (`device`: another runs the
    same steps on the kernels' stand-ins, timing nothing.)"""
    torch.manual_seed(0)
    model = _patched(config, dtype, loss_mode, device, fp8=fp8)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        wait_for_kernels()
    return times[0], times[1]
