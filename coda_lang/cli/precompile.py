"""`coda precompile`: fill the kernel cache with a Hugging Face model's kernels before training starts.

What it does: reads a transformers config (a config.json, or a folder holding one, of any family
`coda_lang.hf.apply_coda` patches),
makes the blocks the model patched by coda_lang.hf would run in a training step, without weights (the
model built on the meta device: hf/precompile.py), and compiles every kernel of their forwards and
backwards that a first training step asks for (each GEMM stage's candidate tiles, as `coda tune`
does) in --jobs worker processes, into $CODA_CACHE_DIR. A training process with the same cache, the
same dtype and loss mode then compiles nothing. With --seq on a Hopper GPU it also times each stage's
tiles at the training shapes (a two-layer model with random weights, two steps of --batch x --seq
tokens), so the first step times nothing either; without one it says that timing needs a GPU.
What it does not: load weights, train, or compile the Triton kernels of elementwise stages (those
compile at the first GPU call, in Triton's own cache).
Invariants: progress on stderr, the summary on stdout; exit 0 done, 1 a config that is not one the
patch takes (not JSON, another model_type, a setting the patch refuses) or a kernel that can't
compile (an E07 diagnostic), 2 usage errors, an unreadable config, a missing toolchain or
transformers, an unwritable cache.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from coda_lang.backend_cute.build.ptxas import BackendUnavailable
from coda_lang.backend_cute.build.store import cache_dir
from coda_lang.backend_cute.runtime.tiles import precompile
from coda_lang.cli.common import EXIT_ERRORS, EXIT_OK, EXIT_USAGE, usage_error
from coda_lang.cli.compile import add_jobs_argument, parse_jobs
from coda_lang.core.diagnostics import CodaError, render_all

DTYPES = ("bf16", "f16")  # (the kernels multiply 16-bit operands: an f32 GEMM is E0702)
FP8_RECIPES = ("delayed", "delayed-forward", "blockwise")  # apply_coda's fp8= (hf/blocks.py FP8_RECIPES)
LOSS_MODES = ("rows", "vocab", "fp8")  # apply_coda's loss_mode= (hf/loss.py LOSS_MODES)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "precompile",
        help="compile a Hugging Face model's kernels into the cache before training",
        description="Compile every kernel that the first training step of a Hugging Face model "
        "patched by coda_lang.hf compiles (any family apply_coda patches: its blocks' forwards and backwards, each GEMM "
        "stage's candidate tiles) from the model's config alone, without weights, in --jobs worker "
        "processes, into $CODA_CACHE_DIR (default ~/.cache/coda_lang/kernels). A training process "
        "using that cache then compiles nothing. The kernels do not depend on the model's sizes, only "
        "on --dtype (or --fp8), RMSNorm's eps, head_dim and the loss mode. With --seq on a Hopper GPU, each "
        "stage's tiles are also timed at the training shapes. No GPU is needed to compile: the cache "
        "folder can be copied to a GPU host with the same library versions. Exit 0: done; 1: the "
        "config is not one the patch takes, or a kernel can't compile; 2: usage errors, an unreadable "
        "config, a missing toolchain or an unwritable cache.",
    )
    p.add_argument(
        "--model",
        metavar="CONFIG",
        required=True,
        help="the model's config.json, or a folder holding it (a Hugging Face checkpoint's folder)",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bf16",
        help="the dtype the layers run in (default bf16; under FSDP2's MixedPrecisionPolicy its param_dtype)",
    )
    p.add_argument(
        "--loss-mode",
        choices=LOSS_MODES,
        default="rows",
        help="the loss head's mode, as apply_coda_to_*(loss_mode=...) (default rows)",
    )
    p.add_argument(
        "--fp8",
        choices=FP8_RECIPES,
        help="the kernels of a model patched with apply_coda_to_*(fp8=RECIPE) (its fp8 blocks: "
        "quantizing epilogues, fp8 GEMMs, their backward) instead of the --dtype ones",
    )
    p.add_argument(
        "--seq",
        metavar="N",
        help="on a Hopper GPU: also time each stage's tiles at N tokens per sequence (the training shape)",
    )
    p.add_argument("--batch", metavar="N", default="1", help="with --seq: sequences per step (default 1)")
    p.add_argument(
        "--lora",
        metavar="TARGETS",
        help="the kernels of a peft LoRA model's step instead (its base frozen): the target modules, "
        "comma-separated, as LoraConfig(target_modules=...) names them (q_proj,k_proj,v_proj,o_proj,"
        "gate_proj,up_proj,down_proj; Phi-3: qkv_proj, gate_up_proj)",
    )
    add_jobs_argument(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    jobs = parse_jobs(args.jobs)
    if jobs == "bad":
        return usage_error(f"--jobs takes a positive number, got {args.jobs!r}")
    assert jobs is None or isinstance(jobs, int)
    seq, batch = args.seq, args.batch
    if seq is not None and not (seq.isascii() and seq.isdigit() and int(seq) > 0):
        return usage_error(f"--seq takes a positive number, got {seq!r}")
    if not (batch.isascii() and batch.isdigit() and int(batch) > 0):
        return usage_error(f"--batch takes a positive number, got {batch!r}")
    if batch != "1" and seq is None:
        return usage_error("--batch goes with --seq (the shape to time the tiles at)")
    try:
        # lazy: imports torch and transformers, which `coda --help` and `coda check` never load
        from coda_lang.hf import precompile as hfp
    except ImportError as e:
        return usage_error(f"coda precompile needs transformers (pip install 'coda_lang[hf]'): {e}")
    try:
        config = hfp.read_config(args.model)
    except hfp.ConfigError as e:
        if e.unreadable:
            return usage_error(str(e))
        print(f"coda precompile: {e}", file=sys.stderr)
        return EXIT_ERRORS
    lora = tuple(t.strip() for t in (args.lora or "").split(",") if t.strip())
    if args.lora is not None and not lora:
        return usage_error("--lora takes target module names, comma-separated (q_proj,v_proj,...)")
    if lora and args.fp8:
        return usage_error("--lora goes without --fp8 (the patch refuses peft LoRA adapters on an fp8 model)")
    if args.loss_mode == "fp8" and args.fp8 != "delayed":
        return usage_error("--loss-mode fp8 goes with --fp8 delayed (the fp8 loss head takes fp8 cotangents)")
    if lora and seq is not None:
        return usage_error(
            "--seq times a plain model's tiles; --lora goes without it (the tiles are the same)"
        )
    fp8 = f", fp8 {args.fp8}" if args.fp8 else ""
    adapters = f", LoRA on {','.join(lora)}" if lora else ""
    what = f"{config.model_type} ({args.dtype}{fp8}, loss mode {args.loss_mode}{adapters})"
    try:
        functions = hfp.model_functions(config, hfp.DTYPES[args.dtype], args.loss_mode, lora, args.fp8)
        blocks = hfp.model_kernels(functions)
    except ValueError as e:
        print(f"coda precompile: {args.model}: {e}", file=sys.stderr)
        return EXIT_ERRORS
    except CodaError as e:
        print(render_all(e.diagnostics, e.sources, "human"), file=sys.stderr)
        return EXIT_ERRORS
    try:
        done = precompile(blocks, jobs=jobs, quiet=args.quiet, strict=True)
    except BackendUnavailable as e:
        print(f"coda: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        return usage_error(f"can't write {e.filename or 'the kernel cache'}: {e.strerror or e}")
    names = ", ".join(dict.fromkeys(b.name for b in blocks))  # (the chunked backwards share a name)
    if done is None:
        print(f"kernels of {what}: nothing to compile ({names})")
    elif not done.compiled:
        print(f"kernels of {what}: all {done.cached} in the cache ({names})")
    else:
        how = f"{done.jobs} worker processes" if done.jobs else "in this process"
        print(
            f"kernels of {what}: {done.compiled} compiled ({how}, {done.seconds:.1f} s), {done.cached} "
            f"from the cache; {done.spills} spill and {done.refused} were refused: never run ({names})"
        )
    print(f"kernel cache: {cache_dir()}")
    for b in blocks:  # a stage no candidate compiles for: E0706/E0707 now, not at the first step
        try:
            for k in b.gemm_stages:
                b.runner(k)
        except CodaError as e:
            print(render_all(e.diagnostics, e.sources, "human"), file=sys.stderr)
            return EXIT_ERRORS
    if seq is None:
        return EXIT_OK

    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print(
            f"note: no Hopper GPU here: the kernels are compiled and cached; timing the tiles at "
            f"{batch} x {seq} tokens needs one (run coda precompile --seq there; a copy of "
            "$CODA_CACHE_DIR saves the compiles)",
            file=sys.stderr,
        )
        return EXIT_OK
    try:
        first, second = hfp.time_tiles(
            config, hfp.DTYPES[args.dtype], args.loss_mode, int(seq), int(batch), fp8=args.fp8
        )
    except torch.cuda.OutOfMemoryError:
        print(f"coda: error: out of GPU memory at {batch} x {seq} tokens", file=sys.stderr)
        return EXIT_ERRORS
    except CodaError as e:
        print(render_all(e.diagnostics, e.sources, "human"), file=sys.stderr)
        return EXIT_ERRORS
    print(
        f"tiles timed at {batch} x {seq} tokens (two steps of a two-layer model: {first:.1f} s, {second:.1f} s)"
    )
    return EXIT_OK
