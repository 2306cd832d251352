"""Training steps of a Hugging Face model: HF eager, HF + torch.compile, HF + Liger Kernel, HF + coda,
HF + torchao float8.

Usage (on a Hopper GPU): python benchmarks/hf_train_step.py [--configs eager,compile,liger,coda,
    torchao-tensorwise,torchao-rowwise,coda+graph,coda-fp8+graph]
    [--family llama] [--layers N] [--seq 8192] [--batch 1] [--steps 9] [--warmup 3] [--json FILE]
    [--profile] [--trace FILE] [--lora R]

Llama-3.2-1B shapes by default (hidden 2048, 16 layers, 32 query / 8 KV heads of 64, intermediate 8192,
vocab 128256, tied embeddings, rope_theta 5e5 with Llama-3 rope scaling); `--family` picks another
family's shapes (`FAMILY_SHAPES`: Qwen3-1.7B, Qwen2.5-1.5B, a Granite 3.x 2B, Mistral-7B's widths at 8
layers with its 4096-token sliding window, Ministral likewise with alternating layers, Phi-3-mini-4k:
32 heads of 96, its 2047-token sliding window, OLMo-2-0425-1B, Gemma-2-2B: 8 heads of 256, its
alternating 4096-token windows and soft-capping, a vocabulary of 256000; Gemma-3-1B: 4 heads of 256
and 1 KV head, five 512-token local layers to one global, a vocabulary of 262144), `--layers`
another layer count; coda is patched by `coda_lang.hf.apply_coda`, Liger by its
`apply_liger_kernel_to_<family>` (where it has one; Gemma 3's text model: `..._gemma3_text`). Random init (seed 0), bf16,
sdpa attention, fused AdamW, one fixed batch of random tokens (labels = inputs). Per configuration, in
one process one after another: the time to the first step (patching or compiling included, from the
model on the GPU to the end of step 1; Python bytecode cached as a pip install has it:
benchmarks/bytecode.py), the median step time over `--steps` steps after `--warmup`
(CUDA events, each step synchronized; the first and second timed steps are printed too, to show the
warm-up was long enough), the mean step of as many steps again issued back to back with one
synchronization at the end ("back to back": a loop that does not read the loss every step, where the
host may issue a step while the GPU still runs the one before, so a step bound by the host's launches
in its forward can be shorter there), tokens/s (of the synchronized median), peak memory (torch.cuda.max_memory_allocated over the timed steps, weights and optimizer
state included) and the loss after each step. coda's first step runs each stage at its first tile
without spills while the tuner's other candidates compile in the background; the script then waits
for them (`coda_lang.torch.wait_for_kernels`, the time is printed as "all compiled") before the
warm-up steps, the first of which times them. `--profile` adds one profiled step per configuration,
its CUDA time split into attention, GEMM and other kernels. `--lora R`: peft LoRA of rank R (alpha 2R,
dropout 0) on q, k, v, o, gate, up and down (Phi-3: qkv, o, gate_up, down), the base frozen, the optimizer over the adapters: applied
after Liger's patch (which keeps the modules LoRA wraps) and before coda's (which runs LoRA in its
blocks). `coda-fp8`: `apply_coda(model, fp8="delayed")`, e4m3 forward GEMMs and e5m2 cotangents (docs/models.md,
"fp8 training"); `coda-fp8-fwd`:
`fp8="delayed-forward"`, the same forward, bf16 cotangents; `coda-fp8-narrow`: coda-fp8 with
$CODA_FP8_PAIR_STORE=0 (the SwiGLU backward's e5m2 cotangent stored in bf16 and narrowed in a pass
of its own); `coda-fp8-e16`: coda-fp8 whose tuner also times the fp8 tiles at a 16-column epilogue
subtile ($CODA_FP8_E16=1); `coda-fp8-fast`: coda-fp8 with $CODA_FP8_FAST_ACCUM=1; `coda-fp8-fast-e16`: both variables; `coda-fp8-save16`: coda-fp8 whose layers save their gate/up
accumulators in bf16, not e4m3 ($CODA_FP8_SAVE_ACC=0); `coda-fp8-transpose`: coda-fp8 whose GEMM
epilogues leave the K-major copies of the fp8 tiles they store to transposing passes
($CODA_KMAJOR_STORE=0); `coda-fp8-kmajor-all`: coda-fp8 whose elementwise stages over column pairs (the
RoPE backward's) also write the K-major copies ($CODA_KMAJOR_STAGES=all); `coda-fp8-rowmajor`: coda-fp8
storing the row-major tiles nothing reads beside their K-major copies ($CODA_KMAJOR_ALONE=0);
`coda-fp8-fastfwd`: coda-fp8 with $CODA_FP8_FAST_ACCUM=forward; `coda-fp8-kprog`: coda-fp8 with
$CODA_KMAJOR_PROGRAM=64x16x16, `coda-fp8-kprog-all` with $CODA_KMAJOR_STAGES=all too; `coda-fp8-head`:
coda-fp8 with `loss_mode="fp8"` (the LM head's GEMMs in fp8 too), `coda-fp8-head-fastfwd` that with
$CODA_FP8_FAST_ACCUM=forward, `coda-fp8-head-e4m3` with its dlogits in e4m3 ($CODA_FP8_HEAD_GRADS=e4m3);
`coda-fp8-vruns`: coda-fp8 with $CODA_VECTOR_RUNS=1; `coda-fp8-oproj`: coda-fp8 with the out-projection in e4m3 ($CODA_FP8_OUT=1, the default since 2026-11-29); `coda-fp8-bf16out`: with it in bf16 ($CODA_FP8_OUT=0); `coda-fp8-nosplit`: with no epilogue cut off its GEMM ($CODA_SPLIT_EPILOGUES=0; the default, auto, cuts the gate/up data gradient's); `coda-fp8-s36`: both, the fp8 step before they became the defaults; `coda-fp8-blockwise`: `fp8="blockwise"` (DeepSeek-V3's 1x128 and 128x128 current scales); `coda-fp8-blockwise-kind`: it with the K-major copies written by torch.compile's stages ($CODA_KMAJOR_INDUCTOR=1); `coda-fp8-blockwise-kall`: and by the generated stages with reductions too ($CODA_KMAJOR_STAGES=all: no transposing pass left); `coda-fp8-split`: coda-fp8 with the gate/up data gradient's RMSNorm backward cut off into an elementwise stage ($CODA_SPLIT_EPILOGUES=w_13q; `coda-fp8-splitall`: both norm backwards, =all; `coda-fp8-oproj-split`: with the out-projection in e4m3 too; `coda-fp8-split8`: the cut stage at 8-row programs, $CODA_COLUMN_REDUCTION_ROWS=8; `coda-split`: coda's bf16 step with its gate/up data gradient cut the same way, =w_13); `coda-fp8-coop128`: coda-fp8 with its RMSNorm backwards' stages let into 128-row cooperative tiles ($CODA_F32_TILE_RULE=rows128); `coda-fp8-fscales`: with $CODA_FUSED_SCALES=1 (none of
them with --lora); `coda-vruns`: coda with $CODA_VECTOR_RUNS=1. `torchao-tensorwise` / `torchao-rowwise`: torchao's float8 training of that recipe
(`convert_to_float8_training` on every nn.Linear but the LM head), then torch.compile of the model, as
torchao's own benchmarks run it (its wheel: `pip install torchao`; not with --lora). A configuration
with `+graph` (`coda+graph`, `coda-fp8+graph`): after the warm-up, which runs on a side stream, one
whole step (forward, backward, AdamW) is captured in a CUDA graph (`torch.cuda.graph`) and every timed
step is a replay of it (docs/models.md, "CUDA graphs"), and its peak memory includes the capture's
(the graph's memory pool holds what the step allocates); with one such row, every row's AdamW is
`capturable=True`, so that all run the same optimizer. For a model that is not coda's, transformers
materializes the causal mask during a capture (sdpa's slower masked path). An unknown
configuration is a usage error before anything runs, and so is `liger` anywhere but last (Liger replaces
transformers' classes, which every model made after it would use). Prints a markdown table last;
`--json FILE` gets the results as a list, rewritten after each configuration (a run stopped at a time
limit keeps the rows it finished).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

GIB = 2**30


def llama_config(layers: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=layers,
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


# Released models' shapes per family (random init): (transformers config class, its keywords, layers).
# Mistral has no released model of 1-3B: Mistral-7B-v0.1's widths and window at 8 layers.
_COMMON = dict(attn_implementation="sdpa", use_cache=False, max_position_embeddings=32768)
FAMILY_SHAPES: dict[str, tuple[str, dict[str, Any], int]] = {
    "qwen3": (  # Qwen3-1.7B
        "Qwen3Config",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        28,
    ),
    "qwen2": (  # Qwen2.5-1.5B
        "Qwen2Config",
        dict(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_attention_heads=12,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        28,
    ),
    "granite": (  # a Granite 3.x 2B: its widths and multipliers; the vocabulary padded to a multiple of 8
        "GraniteConfig",
        dict(
            vocab_size=49160,
            hidden_size=2048,
            intermediate_size=8192,
            num_attention_heads=32,
            num_key_value_heads=8,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            logits_scaling=8.0,
            attention_multiplier=0.015625,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        40,
    ),
    "mistral": (  # Mistral-7B-v0.1's widths and sliding window
        "MistralConfig",
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            rms_norm_eps=1e-5,
            sliding_window=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        8,
    ),
    "ministral": (  # the same widths, full and sliding-window layers alternating
        "MinistralConfig",
        dict(
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            rms_norm_eps=1e-5,
            sliding_window=4096,
            layer_types=["full_attention", "sliding_attention"] * 4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        8,
    ),
    "phi3": (  # Phi-3-mini-4k-instruct: 32 heads of 96 (multi-head), its 2047-token sliding window
        "Phi3Config",
        dict(
            vocab_size=32064,
            hidden_size=3072,
            intermediate_size=8192,
            num_attention_heads=32,
            num_key_value_heads=32,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            sliding_window=2047,
            bos_token_id=1,
            eos_token_id=32000,
            pad_token_id=32000,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        32,
    ),
    "olmo2": (  # OLMo-2-0425-1B: no pre-norms, post-norms, q/k norms over each projection
        "Olmo2Config",
        dict(
            vocab_size=100352,
            hidden_size=2048,
            intermediate_size=8192,
            num_attention_heads=16,
            num_key_value_heads=16,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        ),
        16,
    ),
    "gemma2": (  # Gemma-2-2B: 8 heads of 256 (q wider than hidden), soft-capping 30 / 50, GeGLU
        "Gemma2Config",
        dict(
            vocab_size=256000,
            hidden_size=2304,
            intermediate_size=9216,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            sliding_window=4096,
            query_pre_attn_scalar=256,
            final_logit_softcapping=30.0,
            attn_logit_softcapping=50.0,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        26,
    ),
    "gemma3": (  # Gemma-3-1B: 4 heads of 256, 1 KV head, 5 local (512 tokens, RoPE 1e4) to 1 global (1e6)
        "Gemma3TextConfig",
        dict(
            vocab_size=262144,
            hidden_size=1152,
            intermediate_size=6912,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            sliding_window=512,
            query_pre_attn_scalar=256,
            final_logit_softcapping=None,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
        ),
        26,
    ),
}
# Liger Kernel's entry point per family, where its name is not apply_liger_kernel_to_<family>
# (its apply_liger_kernel_to_gemma3 patches the multimodal model)
LIGER = {"gemma3": "gemma3_text"}


def family_config(family: str, layers: int | None) -> Any:
    """The benchmark's config of `family` (its released layer count unless `layers`)."""
    if family == "llama":
        return llama_config(layers or 16)
    import transformers

    cls, kw, n = FAMILY_SHAPES[family]
    n = layers or n
    if "layer_types" in kw:
        kw = {**kw, "layer_types": (kw["layer_types"] * n)[:n]}
    return getattr(transformers, cls)(**kw, **_COMMON, num_hidden_layers=n)


def build(config_name: str, layers: int | None, family: str = "llama") -> tuple[Any, Any]:
    """(model on the GPU, the callable to step) for one configuration."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(family_config(family, layers)).to(torch.bfloat16)
    model.train()
    return model, config_name


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Phi-3's checkpoints fuse q, k, v (qkv_proj) and gate, up (gate_up_proj)
PHI3_LORA_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def with_lora(model: Any, r: int) -> Any:
    """The peft model of `model` with LoRA of rank `r` on every linear layer of the decoder (or `model`
    for r 0)."""
    if not r:
        return model
    from peft import LoraConfig, get_peft_model

    targets = PHI3_LORA_TARGETS if model.config.model_type == "phi3" else LORA_TARGETS
    return get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=targets))


def torchao_float8(model: Any, recipe: str) -> Any:
    """torchao's float8 training (`recipe`: tensorwise or rowwise) on every nn.Linear but the LM head,
    then torch.compile of the model (which fuses torchao's amax and cast ops into neighbouring kernels:
    the configuration torchao's own numbers use)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def keep(mod: torch.nn.Module, fqn: str) -> bool:
        return isinstance(mod, torch.nn.Linear) and fqn.split(".")[-1] != "lm_head"

    convert_to_float8_training(
        model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=keep
    )
    return torch.compile(model)


# coda's fp8 configurations, by their recipe: the layers' gate/up, down and QKV GEMMs in e4m3, and
# ("delayed") the cotangents of their accumulators in e5m2, or ("delayed-forward") in bf16
CODA_FP8 = {
    "coda-fp8": "delayed",
    "coda-fp8-fwd": "delayed-forward",
    "coda-fp8-narrow": "delayed",
    "coda-fp8-e16": "delayed",
    "coda-fp8-fast": "delayed",
    "coda-fp8-fast-e16": "delayed",
    "coda-fp8-save16": "delayed",
    "coda-fp8-transpose": "delayed",
    "coda-fp8-kmajor-all": "delayed",
    "coda-fp8-rowmajor": "delayed",
    "coda-fp8-fastfwd": "delayed",
    "coda-fp8-kprog": "delayed",
    "coda-fp8-kprog-all": "delayed",
    "coda-fp8-head": "delayed",
    "coda-fp8-head-fastfwd": "delayed",
    "coda-fp8-head-e4m3": "delayed",
    "coda-fp8-vruns": "delayed",
    "coda-fp8-fscales": "delayed",
    "coda-fp8-blockwise": "blockwise",
    "coda-fp8-blockwise-kind": "blockwise",
    "coda-fp8-blockwise-kall": "blockwise",
    "coda-fp8-split": "delayed",
    "coda-fp8-splitall": "delayed",
    "coda-fp8-oproj-split": "delayed",
    "coda-fp8-split8": "delayed",
    "coda-fp8-coop128": "delayed",
    "coda-fp8-oproj": "delayed",
    "coda-fp8-bf16out": "delayed",
    "coda-fp8-nosplit": "delayed",
    "coda-fp8-s36": "delayed",
}
# the loss mode of a configuration (default "rows"): coda-vocab's lse-only head, and coda-fp8-head's fp8
# head (loss_mode="fp8": the LM head's GEMMs in e4m3 / e5m2 too, run whole)
LOSS_MODE = {
    "coda-vocab": "vocab",
    "coda-fp8-head": "fp8",
    "coda-fp8-head-fastfwd": "fp8",
    "coda-fp8-head-e4m3": "fp8",
}
# the environment a configuration runs under (its blocks planned and compiled under it): coda-fp8-narrow
# is coda-fp8 whose SwiGLU backward stores its e5m2 cotangent in bf16 and narrows it in a pass of its
# own, as before the kernel stored the fp8 pairs itself ($CODA_FP8_PAIR_STORE=0, docs/backend.md);
# coda-fp8-e16 is coda-fp8 whose tuner also times the fp8 tiles at a 16-column epilogue subtile
# ($CODA_FP8_E16=1, build/config.py's FP8_E16_CANDIDATES); coda-fp8-fast is coda-fp8 whose tuner also
# times the fp8 tiles with fast accumulation ($CODA_FP8_FAST_ACCUM=1: other numerics, docs/backend.md);
# coda-fp8-fast-e16 both; coda-fp8-save16 is coda-fp8 whose layers save their gate/up accumulators in
# the model's dtype, as before the e4m3 save became the default ($CODA_FP8_SAVE_ACC=0, read when the
# model is patched: docs/models.md); coda-fp8-transpose is coda-fp8 whose backward GEMMs take the K-major
# copies of the operands that GEMM epilogues make from transposing passes, as before those epilogues
# stored the copies themselves ($CODA_KMAJOR_STORE=0, docs/backend.md); coda-fp8-kmajor-all is coda-fp8
# whose generated elementwise stages over column pairs or with reductions (the RoPE backward's) also
# write the K-major copies their outputs' readers take ($CODA_KMAJOR_STAGES=all); coda-fp8-rowmajor is
# coda-fp8 whose stages also store the row-major tile of a value every reader takes as its K-major copy
# ($CODA_KMAJOR_ALONE=0, as before those were stored as the copy alone); coda-fp8-fastfwd is coda-fp8
# whose tuner also times the forward's fp8 GEMMs (not the backward's) with fast accumulation
# ($CODA_FP8_FAST_ACCUM=forward: TransformerEngine's and torchao's default split); coda-fp8-kprog is
# coda-fp8 whose elementwise stages that write K-major copies run 64 x 16 programs of 16 warps, at
# 30-64 registers a thread against 168-255 ($CODA_KMAJOR_PROGRAM=64x16x16), coda-fp8-kprog-all that with the stages over
# column pairs writing theirs too ($CODA_KMAJOR_STAGES=all); coda-fp8-head-fastfwd is coda-fp8-head with
# $CODA_FP8_FAST_ACCUM=forward, coda-fp8-head-e4m3 with its dlogits in e4m3 ($CODA_FP8_HEAD_GRADS=e4m3);
# coda-fp8-vruns and coda-vruns are coda-fp8 and coda whose runs of block-level equations between stages
# are one generated kernel each ($CODA_VECTOR_RUNS=1: about 300 fewer tiny launches in an fp8 1B step,
# counted from the plans; timed before CUDA graphs, when the host's launches bounded the step, and in a
# captured step on 2026-11-29: no gain); coda-fp8-fscales is coda-fp8 whose delayed-scale updates are one
# Triton kernel each ($CODA_FUSED_SCALES=1; captured, 2026-11-29: no gain beyond the spread)
CONFIG_ENV = {
    "coda-fp8-kmajor-all": {"CODA_KMAJOR_STAGES": "all"},
    "coda-fp8-rowmajor": {"CODA_KMAJOR_ALONE": "0"},
    "coda-fp8-fastfwd": {"CODA_FP8_FAST_ACCUM": "forward"},
    "coda-fp8-head-fastfwd": {"CODA_FP8_FAST_ACCUM": "forward"},
    "coda-fp8-head-e4m3": {"CODA_FP8_HEAD_GRADS": "e4m3"},
    "coda-fp8-vruns": {"CODA_VECTOR_RUNS": "1"},
    "coda-fp8-fscales": {"CODA_FUSED_SCALES": "1"},
    "coda-vruns": {"CODA_VECTOR_RUNS": "1"},
    "coda-split": {"CODA_SPLIT_EPILOGUES": "w_13"},
    "coda-fp8-kprog": {"CODA_KMAJOR_PROGRAM": "64x16x16"},
    "coda-fp8-kprog-all": {"CODA_KMAJOR_PROGRAM": "64x16x16", "CODA_KMAJOR_STAGES": "all"},
    "coda-fp8-transpose": {"CODA_KMAJOR_STORE": "0"},
    "coda-fp8-save16": {"CODA_FP8_SAVE_ACC": "0"},
    "coda-fp8-oproj": {"CODA_FP8_OUT": "1"},
    "coda-fp8-bf16out": {"CODA_FP8_OUT": "0"},
    "coda-fp8-nosplit": {"CODA_SPLIT_EPILOGUES": "0"},
    "coda-fp8-s36": {"CODA_FP8_OUT": "0", "CODA_SPLIT_EPILOGUES": "0"},
    "coda-fp8-blockwise-kind": {"CODA_KMAJOR_INDUCTOR": "1"},
    "coda-fp8-blockwise-kall": {"CODA_KMAJOR_INDUCTOR": "1", "CODA_KMAJOR_STAGES": "all"},
    "coda-fp8-split": {"CODA_SPLIT_EPILOGUES": "w_13q"},
    "coda-fp8-splitall": {"CODA_SPLIT_EPILOGUES": "all"},
    "coda-fp8-oproj-split": {"CODA_FP8_OUT": "1", "CODA_SPLIT_EPILOGUES": "w_13q"},
    "coda-fp8-split8": {"CODA_SPLIT_EPILOGUES": "w_13q", "CODA_COLUMN_REDUCTION_ROWS": "8"},
    "coda-fp8-coop128": {"CODA_F32_TILE_RULE": "rows128"},
    "coda-fp8-narrow": {"CODA_FP8_PAIR_STORE": "0"},
    "coda-fp8-e16": {"CODA_FP8_E16": "1"},
    "coda-fp8-fast": {"CODA_FP8_FAST_ACCUM": "1"},
    "coda-fp8-fast-e16": {"CODA_FP8_FAST_ACCUM": "1", "CODA_FP8_E16": "1"},
}

CONFIGS = (
    "eager",
    "compile",
    "liger",
    "coda",
    "coda-vocab",
    "coda-fp8",
    "coda-fp8-fwd",
    "coda-fp8-narrow",
    "coda-fp8-e16",
    "coda-fp8-fast",
    "coda-fp8-fast-e16",
    "coda-fp8-save16",
    "coda-fp8-transpose",
    "coda-fp8-kmajor-all",
    "coda-fp8-rowmajor",
    "coda-fp8-fastfwd",
    "coda-fp8-kprog",
    "coda-fp8-kprog-all",
    "coda-fp8-head",
    "coda-fp8-head-fastfwd",
    "coda-fp8-head-e4m3",
    "coda-fp8-vruns",
    "coda-fp8-fscales",
    "coda-fp8-blockwise",
    "coda-fp8-blockwise-kind",
    "coda-fp8-blockwise-kall",
    "coda-fp8-split",
    "coda-fp8-splitall",
    "coda-fp8-oproj-split",
    "coda-fp8-split8",
    "coda-fp8-coop128",
    "coda-fp8-oproj",
    "coda-fp8-bf16out",
    "coda-fp8-nosplit",
    "coda-fp8-s36",
    "coda-vruns",
    "coda-split",
    "torchao-tensorwise",
    "torchao-rowwise",
)


def prepare(model: Any, name: str, family: str = "llama", lora: int = 0) -> Any:
    if name == "eager":
        return with_lora(model, lora)
    if name == "compile":
        return torch.compile(with_lora(model, lora))
    if name == "liger":
        import liger_kernel.transformers as liger

        name = f"apply_liger_kernel_to_{LIGER.get(family, family)}"
        patch = getattr(liger, name, None)
        if patch is None:
            raise SystemExit(f"Liger Kernel has no {name}")
        patch(model=model)
        return with_lora(model, lora)
    if name in ("torchao-tensorwise", "torchao-rowwise"):
        if lora:
            raise SystemExit(f"{name}: torchao's float8 training of a LoRA model is not a configuration here")
        return torchao_float8(model, name.removeprefix("torchao-"))
    if name in ("coda", "coda-vocab", "coda-vruns", "coda-split", *CODA_FP8):
        from coda_lang.hf import apply_coda

        # coda-vocab: the loss head's other mode, lse only, the backward in vocabulary chunks
        if name in CODA_FP8 and lora:
            raise SystemExit(f"{name}: fp8 blocks refuse LoRA adapters; not a configuration here")
        model = with_lora(model, lora)
        apply_coda(
            model,
            loss_mode=LOSS_MODE.get(name, "rows"),
            fp8=CODA_FP8.get(name),
        )
        return model
    raise SystemExit(f"unknown configuration {name!r}")


def classify(kernel: str) -> str:
    k = kernel.lower()
    if any(s in k for s in ("flash", "fmha", "attention", "sdpa", "efficient_attention")):
        return "attention"
    if any(
        s in k for s in ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul", "coda", "quack", "kernel_cutlass")
    ):
        return "gemm"
    return "other"


def all_compiled(r: dict[str, Any]) -> str:
    """coda's first step runs each stage at its first tile while the others compile on: when that ended."""
    return f" (all compiled {r['all_compiled_s']:.1f} s)" if r.get("all_compiled_s") else ""


GRAPH = "+graph"


def training_step(
    model: Any, fwd: Any, ids: torch.Tensor, capturable: bool = False
) -> tuple[torch.optim.Optimizer, Callable[[], torch.Tensor]]:
    """The fused AdamW over `model`'s trainable parameters and one eager training step of the prepared
    `fwd` on `ids` (forward, backward, AdamW; the loss detached): what every configuration steps, here
    and in the other benchmarks that build one (memory_peak.py, folds_time.py)."""
    opt = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True, capturable=capturable
    )
    return opt, step_of(fwd, opt, ids)


def step_of(fwd: Any, opt: torch.optim.Optimizer, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One training step of `fwd` on `ids` with `opt` (forward, backward, step, zero_grad; the loss
    detached): training_step's, and dist_train_step.py's with its sharded model's optimizer."""

    def step() -> torch.Tensor:
        loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


@contextlib.contextmanager
def config_env(name: str) -> Iterator[None]:
    """Configuration `name`'s environment (`CONFIG_ENV`) set while the block runs, as it was after."""
    env = CONFIG_ENV.get(name.removesuffix(GRAPH), {})
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v


def run_config(name: str, args: argparse.Namespace, ids: torch.Tensor) -> dict[str, Any]:
    with config_env(name):
        return _run_config(name, args, ids)


def _run_config(name: str, args: argparse.Namespace, ids: torch.Tensor) -> dict[str, Any]:
    base, graphed = name.removesuffix(GRAPH), name.endswith(GRAPH)
    model, _ = build(base, args.layers, args.family)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fwd = prepare(model, base, args.family, args.lora)
    # (capturable: the optimizer's step count on the GPU, which a CUDA graph needs; every row of a run
    # with a graphed row uses it, so that each runs the same optimizer)
    opt, step = training_step(model, fwd, ids, args.capturable)
    side = torch.cuda.Stream()  # (PyTorch's recipe: the steps before a capture run on a side stream)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side) if graphed else contextlib.nullcontext():
        losses = [step()]
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        compiled = None
        if base.startswith("coda"):  # the other candidate tiles compile on in the background: wait for them
            import coda_lang.torch as ct

            ct.wait_for_kernels()
            compiled = time.perf_counter() - t0
        for _ in range(args.warmup - 1):
            losses.append(step())
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # (for a graphed row: its capture's allocations count too)
    if graphed:  # one step (forward, backward, AdamW) captured; a step is then a replay
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            loss = fwd(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            static_loss = loss.detach()

        def step() -> torch.Tensor:
            graph.replay()
            return static_loss.clone()

        losses.append(step())  # (the first replay uploads the graph)
        torch.cuda.synchronize()
    times, host = [], []
    window = [time.time()]  # wall clock of the timed steps (to match against sampled GPU clocks)
    for _ in range(args.steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        h0 = time.perf_counter()
        losses.append(step())
        host.append((time.perf_counter() - h0) * 1e3)  # the host's time to issue the step
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    window.append(time.time())
    peak = torch.cuda.max_memory_allocated() / GIB
    # the same number of steps issued back to back, one synchronization at the end (a loop that does
    # not read the loss every step): the host may then issue a step while the GPU runs the one before
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(args.steps):
        losses.append(step())
    b.record()
    b.synchronize()
    back_to_back = a.elapsed_time(b) / args.steps
    if args.host_profile and name.startswith("coda"):
        import cProfile
        import io
        import pstats

        prof_c = cProfile.Profile()
        prof_c.enable()
        losses.append(step())
        prof_c.disable()
        torch.cuda.synchronize()
        out = io.StringIO()
        pstats.Stats(prof_c, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue()[-6000:], flush=True)
    split = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            losses.append(step())
            torch.cuda.synchronize()
        if args.trace:  # the profiled step's kernels on a timeline (chrome://tracing, or gaps.py)
            prof.export_chrome_trace(args.trace.replace("{config}", name))
        split = {"attention": 0.0, "gemm": 0.0, "other": 0.0}
        kernels = []
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
            if ev.device_type is not None and str(ev.device_type).endswith("CUDA"):
                split[classify(ev.key)] += t / 1e3
                kernels.append((t / 1e3, ev.count, ev.key[:90]))
        split["top"] = [[round(t, 2), n, k] for t, n, k in sorted(kernels, reverse=True)[: args.top]]
    med = statistics.median(times)
    res = {
        "config": name,
        "first_step_s": first,
        "all_compiled_s": compiled,
        "step_ms": med,
        "back_to_back_ms": back_to_back,
        "first_two_ms": times[:2],
        "host_ms": statistics.median(host),
        "tokens_per_s": ids.numel() / (med / 1e3),
        "peak_gib": peak,
        "losses": [float(x) for x in losses],
        "profile_ms": split,
        "timed_window": window,
    }
    print(json.dumps(res), flush=True)
    return res


def release() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()


def run_all(names: list[str], args: argparse.Namespace, ids: torch.Tensor) -> list[dict[str, Any]]:
    """Each configuration in turn, in this process; the results of those that ran. `args.json` is
    rewritten after each, so a run stopped at a time limit keeps the rows it finished."""
    results: list[dict[str, Any]] = []
    for name in names:
        try:
            results.append(run_config(name, args, ids))
        except Exception as e:  # one configuration failing must not hide the others' numbers
            print(f"{name}: failed: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            traceback.print_exc(limit=-12)  # (the innermost frames: where it failed)
        release()
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="eager,compile,liger,coda")
    p.add_argument("--family", default="llama", choices=["llama", *FAMILY_SHAPES])
    p.add_argument(
        "--layers", type=int, default=None, help="layers (default: the family's model's; Llama 16)"
    )
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None, help="the results, rewritten after each configuration")
    p.add_argument(
        "--lora", type=int, default=0, help="peft LoRA of this rank on every linear layer (0: none)"
    )
    p.add_argument("--profile", action="store_true")
    p.add_argument("--top", type=int, default=12, help="kernels listed per profiled configuration")
    p.add_argument(
        "--trace",
        default=None,
        help="with --profile: write each configuration's profiled step as a Chrome trace to this path "
        "({config} is replaced by the configuration's name); benchmarks/gaps.py lists where the GPU idles",
    )
    p.add_argument("--host-profile", action="store_true", help="cProfile one coda step (host time)")
    args = p.parse_args(argv)
    unknown = [c for c in args.configs.split(",") if c.removesuffix(GRAPH) not in CONFIGS]
    if unknown:
        p.error(
            f"unknown configuration {unknown[0]!r}; the configurations: {', '.join(CONFIGS)}, each "
            f"optionally with {GRAPH}"
        )
    names = [c.removesuffix(GRAPH) for c in args.configs.split(",")]
    args.capturable = any(c.endswith(GRAPH) for c in args.configs.split(","))
    if args.capturable and args.lora:
        p.error(f"{GRAPH} with --lora is not a configuration here")
    if "liger" in names and names[-1] != "liger":
        # (Liger's apply_liger_kernel_to_* replaces transformers' classes, so every model made after it
        # runs Liger's kernels: a torchao or torch.compile row after it would not be what it says)
        after = ", ".join(n for n in names[names.index("liger") + 1 :] if n != "liger")
        p.error(
            f"list liger last: Liger patches transformers' classes, which the models of {after} would use"
        )
    if not torch.cuda.is_available():
        print("hf_train_step: needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bytecode import reexec_with_bytecode

    reexec_with_bytecode()  # (first steps timed as a pip install runs them: bytecode cached)
    g = torch.Generator(device="cuda").manual_seed(1)
    vocab = family_config(args.family, 1).vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq), device="cuda", generator=g)
    layers = family_config(args.family, args.layers).num_hidden_layers
    results = run_all(args.configs.split(","), args, ids)
    print(
        f"\n{torch.cuda.get_device_name()}, {args.family}, {layers} layers, seq {args.seq} x batch {args.batch}, bf16"
    )
    print(
        "| | step | back to back | tokens/s | peak memory | first step | loss after | first two steps (ms) | host |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['config']} | {r['step_ms']:.1f} ms | {r['back_to_back_ms']:.1f} ms | {r['tokens_per_s'] / 1e3:.1f}k "
            f"| {r['peak_gib']:.2f} GiB "
            f"| {r['first_step_s']:.1f} s{all_compiled(r)} | {r['losses'][-1]:.4f} | {r['first_two_ms'][0]:.1f}, {r['first_two_ms'][1]:.1f} "
            f"| {r['host_ms']:.1f} ms |"
        )
    for r in results:
        if r["profile_ms"]:
            s = r["profile_ms"]
            print(
                f"{r['config']}: CUDA time per step: "
                + ", ".join(f"{k} {v:.1f} ms" for k, v in s.items() if k != "top")
            )
            for t, n, k in s["top"]:
                print(f"    {t:8.2f} ms  {n:4d}x  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
