"""`coda compile`: compile each GEMM stage to its CuTeDSL epilogue source or to PTX for sm_90a."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from coda_lang.api import Block
from coda_lang.backend_cute.build.compile import compile_spec
from coda_lang.backend_cute.build.config import TileConfig, broken, candidates_for
from coda_lang.backend_cute.build.ptxas import BackendUnavailable
from coda_lang.backend_cute.plan.emit import emit_stage
from coda_lang.backend_cute.plan.planner import plan_stage
from coda_lang.cli.common import (
    EXIT_ERRORS,
    EXIT_OK,
    EXIT_USAGE,
    load_block,
    parse_tile_subtile,
    read_source_file,
    usage_error,
    write_text,
)
from coda_lang.core.diagnostics import CodaError, error, render_all
from coda_lang.ir.nodes import Stage


def add_parser(sub: Any) -> None:
    k = sub.add_parser(
        "compile",
        help="compile each GEMM stage to a CuTeDSL epilogue (Python source) or to PTX",
        description="Compile each GEMM stage of a block for Hopper (sm_90a) on quack's GEMM: "
        "`--emit source` writes the stage's `@gemm_epilogue` function; `--emit ptx` compiles it with "
        "CuTeDSL (no GPU needed), checks it with `ptxas -v` and, unless --tile is given, picks the "
        "first tile (128x192; 128x192 with an epilogue subtile 16 columns wide; 128x176, 128x128, 128x96, "
        "128x64; a GEMM of fp8 operands has tiles of its own, and narrower ones it tries only where "
        "all of those spill) whose kernel has no register spills. Writes "
        "one file per stage, BLOCK_stageK.py or .ptx. The kernels of all stages are compiled at once, "
        "in --jobs worker processes; they are cached in $CODA_CACHE_DIR (default "
        "~/.cache/coda_lang/kernels) with their ptxas reports, so a second run compiles nothing and runs "
        "no ptxas.",
    )
    k.add_argument("file", metavar="FILE")
    k.add_argument("--block", metavar="NAME", help="the block to compile (needed when the file has several)")
    k.add_argument("--emit", choices=("source", "ptx"), required=True, help="what to write for each stage")
    k.add_argument("-o", "--output-dir", metavar="DIR", default=".", help="where to write (default: .)")
    k.add_argument("--backward", action="store_true", help="compile the derived backward block instead")
    k.add_argument(
        "--stage",
        metavar="K",
        help="only stage K (1-based, as `coda check --explain` numbers them), e.g. the one that spills",
    )
    k.add_argument(
        "--tile",
        metavar="MxN[eS]",
        help="--emit ptx: this tile only (e.g. 128x128; pingpong, cluster "
        "2x1); a suffix eS sets the epilogue subtile S columns wide (e.g. 128x192e16)",
    )
    add_jobs_argument(k, "--emit ptx: ")
    k.add_argument("-q", "--quiet", action="store_true", help="no progress line on stderr")
    k.add_argument("--error-format", choices=("human", "short"), default="human")
    k.set_defaults(run=run)


def add_jobs_argument(parser: argparse.ArgumentParser, when: str = "") -> None:
    """`-j/--jobs N`, the compile workers' count, as every compiling command takes it (`when`: what
    the option applies to, e.g. "--emit ptx: "); parse_jobs reads it."""
    parser.add_argument(
        "-j",
        "--jobs",
        metavar="N",
        help=f"{when}worker processes compiling kernels (default: one per CPU, at most one per GB of "
        "available memory, or $CODA_JOBS; 1: one after another in this process)",
    )


def parse_jobs(text: str | None) -> int | None | str:
    """--jobs: None (the default), a positive number, or "bad"."""
    if text is None:
        return None
    return int(text) if text.isascii() and text.isdigit() and int(text) > 0 else "bad"


def run(args: argparse.Namespace) -> int:

    block, code = load_block(args.file, args.block, args.error_format)
    if block is None:
        return code

    assert isinstance(block, Block)
    tile = parse_tile_subtile(args.tile)
    if tile == "bad" or (isinstance(tile, tuple) and args.emit != "ptx"):
        return usage_error(
            f"--tile takes MxN or MxNeS (e.g. 128x128, 128x192e16) and goes with --emit ptx, got "
            f"{args.tile!r}"
        )
    jobs = parse_jobs(args.jobs)
    if jobs == "bad" or (jobs is not None and args.emit != "ptx"):
        return usage_error(f"--jobs takes a positive number and goes with --emit ptx, got {args.jobs!r}")
    assert jobs is None or isinstance(jobs, int)
    only = parse_jobs(args.stage)  # (a positive number, like --jobs)
    if only == "bad":
        return usage_error(f"--stage takes a stage's number (1, 2, ...), got {args.stage!r}")
    text = read_source_file(args.file) or ""

    def report(e: CodaError) -> None:
        print(render_all(e.diagnostics, {args.file: text}, args.error_format), file=sys.stderr)

    if args.backward:
        try:
            block = block.grad()
        except CodaError as e:
            report(e)
            return EXIT_ERRORS
    out_dir = args.output_dir
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        return usage_error(f"can't create {out_dir}: {e.strerror or e}")
    # lazy: imports NumPy, which `coda check` and `import coda_lang` never load
    from coda_lang.backend_cute.build import (
        parallel,
    )

    # lazy: imports NumPy, which `coda check` and `import coda_lang` never load
    from coda_lang.backend_cute.build.select import (
        select_config,
    )

    status = EXIT_OK
    stages = [s for s in block.ir.body if isinstance(s, Stage)]
    if only is not None and not 1 <= int(only) <= len(stages):
        return usage_error(f"--stage {only}: block {block.name} has stages 1 to {len(stages)}")
    chosen = range(1, len(stages) + 1) if only is None else [int(only)]
    fixed = TileConfig(tile[0], tile[1], epi_n=tile[2]) if isinstance(tile, tuple) else None
    built: set[Any] = set()
    if args.emit == "ptx":  # every stage's kernels at once (a stage that can't be planned: below)
        requests = []
        for k in chosen:
            if stages[k - 1].is_gemm:
                try:
                    spec = plan_stage(block, k)
                except CodaError:
                    continue
                requests.append(
                    parallel.Request(spec, (fixed,))
                    if fixed
                    else parallel.Request(spec, candidates_for(spec), first=True)
                )
        try:
            built = parallel.warm(requests, jobs=jobs, quiet=args.quiet).built
        except OSError as e:
            return usage_error(f"can't write {e.filename or 'the kernel cache'}: {e.strerror or e}")
    for k in chosen:
        name = f"{block.name}_stage{k}"
        if not stages[k - 1].is_gemm:
            print(
                f"stage {k} `{block.plan.stages[k - 1].text}`: no GEMM, nothing to emit (at run time it is one "
                "generated Triton kernel, or a torch.compile kernel where the generator can't take its ops)"
            )
            continue
        try:
            spec = plan_stage(block, k)
            if args.emit == "source":
                path = os.path.join(out_dir, name + ".py")
                write_text(path, emit_stage(spec))
                what = [f"D = {spec.d.name}"] if spec.d else []
                what += [f"stores {', '.join(o.name for o in spec.outputs)}"] if spec.outputs else []
                what += [f"reduces {', '.join(s.name for s in spec.sinks)}"] if spec.sinks else []
                print(
                    f"wrote {path}: stage {k} `{spec.text}` ({spec.mode} mode; {'; '.join(what) or 'no outputs'})"
                )
                continue
            why = broken(spec, fixed) if fixed else []
            if why:  # (the runtime's `tile=` says the same: runtime/tiles.py)
                raise error(
                    "E0805",
                    f"tile {fixed} does not fit stage {k} (`{spec.text}`): {'; '.join(map(str, why))}",
                    spec.span,
                    notes=["without --tile, the stage's own candidate tiles are tried"],
                )
            c = compile_spec(spec, fixed) if fixed else select_config(block, k)
            path = os.path.join(out_dir, name + ".ptx")
            write_text(path, c.ptx)
            assert c.report is not None
            how = "cached" if c.cached and c.ptx_path not in built else f"compiled in {c.compile_s:.1f} s"
            regs = f" (setmaxnreg {'/'.join(map(str, c.setmaxnreg))})" if c.setmaxnreg else ""
            print(f"wrote {path}: stage {k} `{spec.text}` at {c.config}: {c.report}{regs}; {how}")
            for r in c.rejected:
                print(f"  (not {r})")
            if c.report.spills:
                print(f"warning: {path} spills registers at the tile you chose", file=sys.stderr)
        except CodaError as e:
            report(e)
            status = EXIT_ERRORS
        except BackendUnavailable as e:
            print(f"coda: error: {e}", file=sys.stderr)
            return EXIT_USAGE
        except OSError as e:  # the output folder or the kernel cache
            return usage_error(f"can't write {e.filename or out_dir}: {e.strerror or e}")
    return status
