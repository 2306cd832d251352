"""Training steps of a Hugging Face LLaMA-3 model on several GPUs: FSDP2 per decoder layer or on the root
only, or DDP; HF eager, HF + Liger Kernel, HF + coda (bf16 or fp8="delayed"; coda-fp8-sync: the ranks' amaxes
reduced every forward, coda_lang.hf.reduce_fp8_amaxes), or HF + torchao float8.

Usage: torchrun --nproc_per_node N benchmarks/dist_train_step.py [--patch none,liger,coda,coda-fp8,
    coda-fp8-sync,torchao-tensorwise,torchao-rowwise]
    [--wrap fsdp-layer,fsdp-layer-keep,fsdp-root,ddp,none] [--compile] [--checkpointing] [--layers 16] [--seq 8192]
    [--batch 1] [--steps 9] [--warmup 3] [--json FILE] [--trace FILE]
    smoke test on the CPU (gloo): --device cpu --layers 2 --hidden 64 --intermediate 128 --heads 4
    --kv-heads 2 --vocab 256 --seq 32 --steps 2 --warmup 1

Llama-3.2-1B shapes by default (benchmarks/hf_train_step.py's `llama_config`; `--hidden`,
`--intermediate`, `--heads`, `--kv-heads`, `--vocab` change them), random init (seed 0), bf16 on a
GPU (f32 on the CPU; `--dtype float32` on a GPU: f32 parameters that FSDP2 gathers in bf16,
torchtitan's way), sdpa attention, AdamW (fused on a GPU), each rank its own batch of random tokens
(`--batch` x `--seq`, labels = inputs). Per configuration (each patch under each wrapping, one after
another): the model is built, patched (`--patch`: none, liger, coda), its layers compiled
(`--compile`: torch.compile per decoder layer) and checkpointed (`--checkpointing`: torch's
checkpoint_wrapper per decoder layer, as torchtitan applies it), then wrapped (`--wrap`:
`fully_shard` per decoder layer and on the root, with `MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=f32)` on a GPU; `fully_shard` on the root only; DDP; none: unwrapped, the one-GPU baseline), its optimizer made, and it trains:
the first step, then (coda: after its kernels' other candidate tiles compiled,
`coda_lang.torch.wait_for_kernels`) `--warmup` steps, then `--steps` timed steps. Printed: the median
step time (CUDA events on a GPU, the host clock on the CPU; the slowest rank's), tokens/s per GPU, the
peak memory per GPU (torch.cuda.max_memory_allocated over the timed steps, the largest rank's), the
first step's time (the slowest rank's) and the losses (the mean over ranks); then a markdown table. `--trace` writes one
profiled step per configuration (rank 0) as a Chrome trace.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_train_step import GIB, llama_config, prepare, release, step_of  # noqa: E402

# hf_train_step's configuration names; coda-fp8: fp8="delayed" (e4m3 forward, e5m2 cotangents);
# torchao-*: torchao's float8 training (`convert_to_float8_training` on every Linear but the LM head),
# each decoder layer compiled (torchtitan's recipe), tensorwise with its fp8 all-gather under FSDP2
PATCHES = {
    "none": "eager",
    "liger": "liger",
    "coda": "coda",
    "coda-fp8": "coda-fp8",
    "coda-fp8-sync": "coda-fp8",  # with coda_lang.hf.reduce_fp8_amaxes: every rank at the same scales
    "torchao-tensorwise": "torchao-tensorwise",
    "torchao-rowwise": "torchao-rowwise",
}
WRAPS = (
    "fsdp-layer",
    "fsdp-layer-keep",
    "fsdp-root",
    "ddp",
    "none",
)  # none: unwrapped (one process: the baseline)


def config(args: argparse.Namespace) -> Any:
    cfg = llama_config(args.layers)
    for name, attr in (
        ("hidden", "hidden_size"),
        ("intermediate", "intermediate_size"),
        ("heads", "num_attention_heads"),
        ("kv_heads", "num_key_value_heads"),
        ("vocab", "vocab_size"),
    ):
        if getattr(args, name) is not None:
            setattr(cfg, attr, getattr(args, name))
    cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    if args.untied:  # Llama-3-8B's: an LM head of its own
        cfg.tie_word_embeddings = False
    return cfg


def build(args: argparse.Namespace, patch: str, wrap: str, device: torch.device) -> tuple[Any, Any]:
    """(the wrapped model, its optimizer) of one configuration."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM(config(args)).to(args.dtype)
    model.train()
    torchao = patch.startswith("torchao-")
    if torchao:
        float8(model, patch.removeprefix("torchao-"), wrap.startswith("fsdp"))
    else:
        prepare(model, PATCHES[patch])
    if patch.endswith("-sync"):
        from coda_lang.hf import reduce_fp8_amaxes

        reduce_fp8_amaxes(model)
    layers = model.model.layers
    for i, layer in enumerate(list(layers)):
        if args.compile or torchao:  # (torchao's float8 casts are separate ops until Inductor fuses them)
            layer.compile()
        if args.checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            layers.register_module(str(i), checkpoint_wrapper(layer, preserve_rng_state=False))
    if wrap == "none":
        pass
    elif wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=ids)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kw: dict[str, Any] = {}
        if device.type == "cuda":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if wrap.startswith("fsdp-layer"):  # -keep: reshard_after_forward=False
            for layer in model.model.layers:
                fully_shard(layer, reshard_after_forward=wrap == "fsdp-layer", **kw)
        fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    return model, opt


def float8(model: Any, recipe: str, fsdp: bool) -> None:
    """torchao's float8 training of `recipe` (tensorwise, rowwise) on every nn.Linear but the LM head;
    tensorwise under FSDP2 all-gathers its weights in float8 (torchtitan's fastest configuration)."""
    from dataclasses import replace

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    cfg = Float8LinearConfig.from_recipe_name(recipe)
    if fsdp and recipe == "tensorwise":
        cfg = replace(cfg, enable_fsdp_float8_all_gather=True)

    def keep(mod: torch.nn.Module, fqn: str) -> bool:
        return isinstance(mod, torch.nn.Linear) and fqn.split(".")[-1] != "lm_head"

    convert_to_float8_training(model, config=cfg, module_filter_fn=keep)


def run_config(
    args: argparse.Namespace, patch: str, wrap: str, ids: torch.Tensor, device: torch.device
) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    cuda = device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    sync()
    dist.barrier()
    t0 = time.perf_counter()
    model, opt = build(args, patch, wrap, device)
    step = step_of(model, opt, ids)

    losses = [step()]
    sync()
    first = time.perf_counter() - t0
    if patch.startswith("coda"):  # the other candidate tiles compile on in the background: wait for them
        import coda_lang.torch as ct

        ct.wait_for_kernels()
    dist.barrier()
    for _ in range(args.warmup):
        losses.append(step())
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(args.steps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            losses.append(step())
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            h0 = time.perf_counter()
            losses.append(step())
            times.append((time.perf_counter() - h0) * 1e3)
    if args.trace and rank == 0:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            losses.append(step())
            sync()
        prof.export_chrome_trace(args.trace.replace("{config}", f"{patch}-{wrap}"))
    elif args.trace:
        losses.append(step())
    # the slowest rank's median step and first step, the largest rank's peak memory, the mean loss
    stats = torch.tensor(
        [statistics.median(times), torch.cuda.max_memory_allocated() / GIB if cuda else 0.0, first],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    mean = torch.stack(losses).float()
    dist.all_reduce(mean)
    med, peak, first = float(stats[0]), float(stats[1]), float(stats[2])
    res = {
        "patch": patch,
        "wrap": wrap,
        "world": world,
        "compile": args.compile,
        "checkpointing": args.checkpointing,
        "first_step_s": first,
        "step_ms": med,
        "tokens_per_s_per_gpu": ids.numel() / (med / 1e3),
        "peak_gib_per_gpu": peak if cuda else None,
        "losses": [float(x) for x in mean / world],
    }
    if rank == 0:
        print(json.dumps(res), flush=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--patch", default="none,liger,coda", help="comma-separated: " + ", ".join(PATCHES))
    p.add_argument("--wrap", default="fsdp-layer,ddp", help="comma-separated: " + ", ".join(WRAPS))
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    p.add_argument("--checkpointing", action="store_true", help="checkpoint_wrapper on each decoder layer")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default=None, help="bfloat16 (default on a GPU) or float32 (on the CPU)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--intermediate", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--untied", action="store_true", help="an LM head apart from the embedding (Llama-3-8B)")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--trace", default=None, help="Chrome trace of one step per configuration ({config})")
    args = p.parse_args(argv)
    patches, wraps = args.patch.split(","), args.wrap.split(",")
    bad = [x for x in patches if x not in PATCHES] + [x for x in wraps if x not in WRAPS]
    if bad:
        p.error(f"unknown --patch or --wrap value {bad[0]!r}")
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    if "RANK" not in os.environ:
        p.error("run it under torchrun (torchrun --nproc_per_node N benchmarks/dist_train_step.py ...)")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("dist_train_step: no CUDA GPU (--device cpu runs on the CPU)", file=sys.stderr)
            return 2
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator(device=device).manual_seed(1 + rank)  # each rank its own batch
    ids = torch.randint(0, config(args).vocab_size, (args.batch, args.seq), device=device, generator=g)
    results = []
    for patch in patches:
        for wrap in wraps:
            results.append(run_config(args, patch, wrap, ids, device))
            if device.type == "cuda":
                release()
    if rank == 0:
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
        extra = "".join(
            [
                ", torch.compile per layer" if args.compile else "",
                ", checkpointing" if args.checkpointing else "",
            ]
        )
        print(
            f"\n{dist.get_world_size()} x {name}, {args.layers} layers, seq {args.seq} x batch {args.batch} "
            f"per GPU, {str(args.dtype).removeprefix('torch.')}{extra}"
        )
        print("| patch | wrap | step | tokens/s per GPU | peak memory per GPU | first step | loss after |")
        print("|---|---|---|---|---|---|---|")
        for r in results:
            peak = "-" if r["peak_gib_per_gpu"] is None else f"{r['peak_gib_per_gpu']:.1f} GiB"
            print(
                f"| {r['patch']} | {r['wrap']} | {r['step_ms']:.1f} ms | {r['tokens_per_s_per_gpu']:,.0f} "
                f"| {peak} | {r['first_step_s']:.1f} s | {r['losses'][-1]:.4f} |"
            )
    dist.barrier()  # (a rank leaving while another's gloo work is pending aborts it)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
