"""`coda tune`: build every kernel of a block and its tile choices at given sizes ahead of a run.

What it does: compiles every candidate tile of every GEMM stage (of the block, or with --backward of
its autograd forward and backward) at once, in --jobs worker processes (tiles.precompile), then, on a
Hopper GPU, runs the block once per --dims on random inputs (and its backward on a random cotangent),
which times the candidates of each stage at those sizes and caches the choice (tune.py); prints each
stage's tile. Everything lands in the kernel cache ($CODA_CACHE_DIR), which a training job then starts
from warm, and which can be copied to another machine with the same GPU and library versions.
Without a Hopper GPU it compiles (and caches) every kernel, says that timing needs a GPU, and exits 0:
a CPU build machine can fill the compile cache for the GPU host.
What it does not: train or check numerics (coda fuzz does), or tune anything a run would not.
Invariants: exit 0 done, 1 the block can't compile or run (an E07/E08 diagnostic), 2 usage errors, a
missing toolchain, or an unwritable cache.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from coda_lang.api import Block
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.backend_cute.build import tune
from coda_lang.backend_cute.build.ptxas import BackendUnavailable
from coda_lang.backend_cute.runtime.tiles import precompile
from coda_lang.cli.common import (
    EXIT_ERRORS,
    EXIT_OK,
    EXIT_USAGE,
    load_block,
    parse_backward,
    parse_dims,
    usage_error,
)
from coda_lang.cli.compile import add_jobs_argument, parse_jobs
from coda_lang.core.diagnostics import CodaError, render_all
from coda_lang.ir.nodes import DEFAULT_REMAT, REMAT


def add_parser(sub: Any) -> None:
    t = sub.add_parser(
        "tune",
        help="compile every kernel of a block and choose its tiles at given sizes, ahead of a run",
        description="Compile every candidate tile of every GEMM stage of a block (with --backward, of "
        "what training runs: its extended forward and derived backward) in --jobs worker processes, "
        "then, on a Hopper GPU, run it once at each --dims on random inputs, which times each stage's "
        "candidates at those sizes, and print the tile each stage will use. The kernels and the "
        "choices are cached in $CODA_CACHE_DIR (default ~/.cache/coda_lang/kernels), so a job started "
        "afterwards compiles and times nothing; the folder can be copied to another machine with the "
        "same GPU and library versions. Without a Hopper GPU the kernels are compiled and cached, and "
        "the timing is left to the GPU (exit 0). Exit 0: done; 1: the block can't compile or run; "
        "2: usage errors, a missing toolchain or an unwritable cache.",
    )
    t.add_argument("file", metavar="FILE")
    t.add_argument("--block", metavar="NAME", help="the block to tune (needed when the file has several)")
    t.add_argument(
        "--dims",
        metavar="M=..,D=..",
        action="append",
        default=[],
        help="the size of every dim of the block, comma-separated; repeat --dims for several sizes",
    )
    t.add_argument(
        "--backward",
        action="store_true",
        help="the forward and backward of training (CudaBlock.autograd), not only the forward",
    )
    t.add_argument(
        "--remat",
        metavar="POLICY",
        help=f"with --backward: the saved-tensor policy of the backward, {', '.join(REMAT)} "
        f"(default {DEFAULT_REMAT})",
    )
    add_jobs_argument(t)
    t.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    t.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """`_run`; a kernel cache that can't be written or trusted (an OSError wherever it shows: a file in
    the way, a path under /proc, a folder someone else can write) is exit 2, as for coda compile."""
    try:
        return _run(args)
    except OSError as e:
        return usage_error(f"can't write {e.filename or 'the kernel cache'}: {e.strerror or e}")


def _run(args: argparse.Namespace) -> int:
    jobs = parse_jobs(args.jobs)
    if jobs == "bad":
        return usage_error(f"--jobs takes a positive number, got {args.jobs!r}")
    assert jobs is None or isinstance(jobs, int)
    options = parse_backward(args.remat)
    if not isinstance(options, BackwardOptions):
        return options
    if options.remat != DEFAULT_REMAT and not args.backward:
        return usage_error("--remat chooses the backward's policy; it goes with --backward")
    if not args.dims:
        return usage_error("give the sizes to tune at: --dims M=...,D=... (every dim of the block)")
    sizes: list[dict[str, int]] = []
    for text in args.dims:
        d = parse_dims(text)
        if isinstance(d, str) or not d:
            return usage_error(
                d
                if isinstance(d, str)
                else f"--dims takes NAME=SIZE pairs separated by commas (e.g. M=4096,D=1024), got {text!r}"
            )
        sizes.append(d)
    block, code = load_block(args.file, args.block)
    if block is None:
        return code

    assert isinstance(block, Block)
    names = [d.name for d in block.ir.dims if d.value is None]
    for d in sizes:
        unknown = sorted(set(d) - {x.name for x in block.ir.dims})
        if unknown:
            return usage_error(
                f"unknown dim {unknown[0]}; {block.name} has dims {', '.join(x.name for x in block.ir.dims)}"
            )
        missing = [n for n in names if n not in d]
        if missing:
            return usage_error(
                f"--dims {_text(d)} gives no size for {', '.join(missing)}: tuning needs every dim of "
                f"{block.name} ({', '.join(names)})"
            )

    def report(e: CodaError) -> int:
        print(render_all(e.diagnostics, e.sources, "human"), file=sys.stderr)
        return EXIT_ERRORS

    try:
        cb = block.cuda()
        target: Any = cb
        blocks = [("forward", cb)]
        if args.backward:
            target = cb.autograd(backward=options)
            blocks = [("forward", target.forward), ("backward", target.backward)]
    except CodaError as e:
        return report(e)
    try:
        done = precompile([b for _, b in blocks], jobs=jobs, quiet=args.quiet, strict=True)
    except BackendUnavailable as e:
        print(f"coda: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    what = " and ".join(b.name for _, b in blocks)
    if done is None:
        print(f"kernels of {what}: nothing to compile")
    elif not done.compiled:
        print(f"kernels of {what}: all {done.cached} in the cache")
    else:
        how = f"{done.jobs} worker processes" if done.jobs else "in this process"
        print(
            f"kernels of {what}: {done.compiled} compiled ({how}, {done.seconds:.1f} s), {done.cached} "
            f"from the cache; {done.spills} spill and {done.refused} were refused: never timed"
        )
    for _, b in blocks:  # a stage no candidate compiles for: E0706/E0707 now, not at the first run
        try:
            for k in b.gemm_stages:
                b.runner(k)
        except CodaError as e:
            return report(e)

    import torch

    if not cb.tune:
        print("note: CODA_TUNE=0: runs take each stage's first tile without spills; nothing to time")
        return EXIT_OK
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print(
            "note: no Hopper GPU here: the kernels are compiled and cached; timing the tiles at "
            f"{'; '.join(_text(d) for d in sizes)} needs one (run coda tune there; a copy of "
            "$CODA_CACHE_DIR saves the compiles)",
            file=sys.stderr,
        )
        return EXIT_OK

    for d in sizes:
        try:
            tune.warm_block(target, d)
        except CodaError as e:
            print(f"coda tune: at {_text(d)}:", file=sys.stderr)
            return report(e)
        except torch.cuda.OutOfMemoryError:
            print(f"coda: error: out of GPU memory at {_text(d)}", file=sys.stderr)
            return EXIT_ERRORS
        print(f"{block.name} at {_text(d)}:")
        for kind, b in blocks:
            for k, shape, config in tune.tuned(b):
                ms = tune.times_of(b, k, shape).get(tune.label(config))
                at = "x".join(map(str, shape))
                took = f", {ms:.3f} ms" if ms is not None else ""
                print(f"  {kind} stage {k} `{b.specs[k - 1].text}` at {at}: {config}{took}")
    return EXIT_OK


def _text(d: dict[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in d.items())
