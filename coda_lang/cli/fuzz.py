"""`coda fuzz`: differential testing of a block (or of random programs) against the interpreter.

What it does: parses the options, runs coda_lang.fuzz (the library: the differential runner and the
hypothesis search), prints progress, the smallest failing case and one command that reproduces it.
What it does not: fuzz anything itself (the coda_lang.fuzz package does).
Invariants: exit 0 every case passed, 1 a failure, 2 usage errors or a target this machine can't run;
hypothesis (and torch, for --target cuda/emulate) is imported only when the command runs.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, TextIO

from coda_lang.api import Block
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.cli.common import (
    EXIT_ERRORS,
    EXIT_OK,
    load_block,
    parse_backward,
    parse_dims,
    parse_tile,
    usage_error,
)
from coda_lang.cli.fuzz_jobs import run_jobs, skip_reasons
from coda_lang.core.diagnostics import CodaError, render_all
from coda_lang.ir.nodes import DEFAULT_REMAT, REMAT

if TYPE_CHECKING:
    from coda_lang.fuzz import Case, Failure


MAX_DIM = 8192  # the largest --max-dim: fuzzing draws many cases, each run several times over


def add_parser(sub: Any) -> None:
    f = sub.add_parser(
        "fuzz",
        help="differential testing: kernels or tile simulation against the interpreter",
        description="Fuzz a block: random sizes (including ones that are not multiples of the tile) "
        "and seeded random inputs, run on the path under test and on the whole-matrix interpreter, "
        "forward and backward, compared within the accuracy rule of docs/design.md (section Accuracy). On a mismatch "
        "hypothesis shrinks the case; the smallest failing dims, the input seed and a command that "
        "reproduces it are printed. Exit 0: every case passed; 1: a failure (or the block can't run "
        "on the target); 2: usage errors, or a target this machine can't run.",
    )
    f.add_argument("file", metavar="FILE", nargs="?", help="the .coda file (or --programs N instead)")
    f.add_argument("--block", metavar="NAME", help="the block to fuzz (needed when the file has several)")
    f.add_argument(
        "--target",
        choices=("interp", "cuda", "emulate"),
        default="interp",
        help="interp: the interpreter's tile simulation (default); cuda: the compiled kernels "
        "(Block.cuda(), needs a GPU); emulate: the CUDA runtime with torch stand-ins for the kernels (CPU)",
    )
    f.add_argument(
        "--examples",
        type=int,
        metavar="N",
        help="cases to try (default 100; with --programs: cases per program, default 5)",
    )
    f.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the search (default 0)")
    f.add_argument(
        "--max-dim",
        type=int,
        metavar="K",
        help="largest size of a dim (default: 48 for interp, "
        "520 for cuda, 64 for emulate; cuda and emulate draw multiples of 8)",
    )
    f.add_argument("--dims", metavar="M=..,N=..", help="fix these dims (reproducing a case)")
    f.add_argument(
        "--input-seed", type=int, metavar="S", help="fix the seed of the inputs (reproducing a case)"
    )
    f.add_argument(
        "--sim-tile",
        metavar="MxN",
        help="--target interp: fix the simulated tile (default: small random tiles)",
    )
    f.add_argument(
        "--tile",
        metavar="MxN",
        help="--target cuda, emulate: the kernels' tile (default: the backend's choice)",
    )
    f.add_argument(
        "--special",
        action="store_true",
        help="inputs with special values too: NaN, +-inf, large magnitudes, denormals, signed zeros",
    )
    f.add_argument(
        "--remat",
        metavar="POLICY",
        help=f"the backward's saved-tensor policy, as `coda grad --remat`: {', '.join(REMAT)} "
        f"(default: the API's, {DEFAULT_REMAT}; with --programs: each program draws one)",
    )
    f.add_argument(
        "--chunk",
        metavar="N|auto",
        help="run the backward under test in row chunks (Block.vjp / CudaBlock.autograd chunk=): N rows "
        "at a time, or auto (from a memory budget: --budget, else drawn per case, 1 row to all rows a "
        "chunk); references stay unchunked. A block whose backward can't run in chunks (E0809) is "
        "checked unchunked, with a note (default: unchunked; with --programs: each case draws)",
    )
    f.add_argument(
        "--budget",
        type=int,
        metavar="BYTES",
        help="the budget --chunk auto chooses the chunk from (alone, it means --chunk auto; "
        "reproducing a case)",
    )
    f.add_argument(
        "--chunk-dim",
        metavar="DIM",
        help="run the backward in chunks of this dim (Block.vjp chunk_dim=; e.g. V, a vocabulary's "
        "columns; alone, it means --chunk auto) instead of the rows; with a FILE",
    )
    f.add_argument(
        "--fp8-grads",
        choices=("e5m2", "e4m3"),
        help="quantize the backward's cotangents of each fp8 GEMM stage to this dtype, as `coda grad "
        "--fp8-grads` (BackwardOptions(fp8_grads=)), every scale 1, in the backward under test and its "
        "references; unchunked; with a FILE",
    )
    f.add_argument(
        "--fp8-acc",
        action="store_true",
        help="read each GEMM stage's acc from the scaled fp8 copy the stage stores, as `coda grad "
        "--fp8-acc` (BackwardOptions(fp8_acc=True)), in the backward under test and its references; "
        "unchunked; with a FILE",
    )
    f.add_argument(
        "--requantize-wgrad",
        action="store_true",
        help="block-scaled weight gradients read their activations quantized again in g x 1 groups, as "
        "`coda grad --requantize-wgrad` (BackwardOptions(requantize_wgrad=True)), in the backward under "
        "test and its references; with a FILE",
    )
    f.add_argument(
        "--wrt",
        metavar="P,Q",
        help="the parameters the backward differentiates, as `coda grad --wrt` (default: every float "
        "parameter without a default); the backward under test and its references alike; with a FILE",
    )
    f.add_argument("--no-backward", action="store_true", help="fuzz the forward only")
    f.add_argument("--no-shrink", action="store_true", help="report the first failing case as found")
    f.add_argument("--programs", type=int, metavar="N", help="fuzz N random programs instead of FILE")
    f.add_argument(
        "--save-dir",
        metavar="DIR",
        default=".",
        help="--programs: where to write a failing program (default: .)",
    )
    f.add_argument(
        "--jobs",
        "-j",
        type=int,
        default=1,
        metavar="N",
        help="run the cases in N processes at once (job i searches with seed S+i and takes its share of "
        "--examples, or of --programs); the first failure stops them all (default 1)",
    )
    f.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    f.set_defaults(run=run)


def _repro(args: Any, case: Case, file: str, block: str) -> str:
    import shlex

    cmd = ["coda", "fuzz", file, "--block", block, "--target", args.target] + case.args()
    if args.special:
        cmd.append("--special")
    if args.wrt:
        cmd += ["--wrt", args.wrt]
    if args.no_backward:
        cmd.append("--no-backward")
    return " ".join(shlex.quote(c) for c in cmd)


def _print_failure(args: Any, f: Failure, file: str, block: str, out: TextIO) -> None:
    what = "random program" if f.program is not None else block
    print(
        f"FAILED: {what} on --target {args.target}: the smallest failing case: {f.case.describe()}", file=out
    )
    for m in f.messages:
        print(f"  {m}", file=out)
    if f.flaky:
        print("  (flaky: the case did not fail again when replayed)", file=out)
    print(f"reproduce: {_repro(args, f.case, file, block)}", file=out)


def run(args: Any) -> int:
    """Exit 0 all cases passed, 1 a failure (or the block has errors or can't run on the target), 2 usage
    errors and targets this machine can't run. hypothesis's own folder (`.hypothesis/` in the working
    directory by default: the constants it collects from source) is a temporary one, removed at the
    end (the search keeps no database), unless $HYPOTHESIS_STORAGE_DIRECTORY names one."""
    import os
    import tempfile

    # lazy: imports hypothesis, which only the fuzzer needs
    from hypothesis.configuration import set_hypothesis_home_dir

    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        return _run(args)
    with tempfile.TemporaryDirectory(prefix="coda-fuzz-hypothesis-") as home:
        set_hypothesis_home_dir(home)
        try:
            return _run(args)
        finally:
            set_hypothesis_home_dir(None)


def _run(args: Any) -> int:
    # lazy: imports hypothesis, which only the fuzzer needs
    from coda_lang.fuzz import (
        ALIGN,
        DRAW,
        Fuzzer,
        Progress,
        Unavailable,
        fuzz_block,
        fuzz_programs,
        save_program,
    )

    if args.examples is None:
        args.examples = 100 if args.programs is None else 5
    if args.examples < 1 or (args.programs is not None and args.programs < 1):
        return usage_error("--examples and --programs take a positive number")
    if args.max_dim is not None and args.max_dim < 1:
        return usage_error(f"--max-dim takes a positive size, got {args.max_dim}")
    if args.max_dim is not None and args.max_dim > MAX_DIM:
        return usage_error(
            f"--max-dim {args.max_dim} is more than {MAX_DIM}: every case runs the whole-matrix interpreter "
            f"in float64 too (a {args.max_dim} x {args.max_dim} matrix alone is "
            f"{8 * args.max_dim**2 / 2**30:.1f} GiB)"
        )
    if args.input_seed is not None and not 0 <= args.input_seed < 2**32:
        return usage_error(f"--input-seed takes a number in [0, 2**32), got {args.input_seed}")
    kernel = args.target != "interp"
    if args.tile is not None and not kernel:
        return usage_error(
            "--tile is the kernels' tile (--target cuda, emulate); --target interp's is --sim-tile"
        )
    if args.sim_tile is not None and kernel:
        return usage_error(f"--sim-tile is the interpreter's tile; --target {args.target}'s is --tile")
    flag, text = ("--tile", args.tile) if kernel else ("--sim-tile", args.sim_tile)
    parsed = parse_tile(text)
    if parsed == "bad":
        return usage_error(f"{flag} takes MxN with positive sizes (e.g. 4x8 or 128x192), got {text!r}")
    assert parsed is None or isinstance(parsed, tuple)
    tile, sim_tile = (parsed, None) if kernel else (None, parsed)
    dims = parse_dims(args.dims, "M=5,D=12")
    if isinstance(dims, str):
        return usage_error(dims)
    big = sorted(k for k, v in dims.items() if v > MAX_DIM)
    if big:
        return usage_error(
            f"--dims {big[0]}={dims[big[0]]} is more than {MAX_DIM}, the largest size coda fuzz draws"
        )
    if (args.file is None) == (args.programs is None):
        return usage_error("give a FILE to fuzz, or --programs N for random programs (not both)")
    if args.programs is not None and (dims or args.input_seed is not None or args.block):
        return usage_error("--dims, --input-seed and --block go with a FILE, not with --programs")
    options = parse_backward(args.remat, args.chunk, args.budget, args.chunk_dim)
    if not isinstance(options, BackwardOptions):
        return options
    given = [f for f in ("remat", "chunk", "budget", "chunk_dim") if getattr(args, f) is not None]
    if args.no_backward and given:
        named = " and ".join(f"--{f.replace('_', '-')}" for f in given)
        verb = "chooses" if len(given) == 1 else "choose"
        return usage_error(f"{named} {verb} the backward under test; --no-backward checks none")
    if args.fp8_grads is not None and (args.no_backward or args.programs is not None):
        return usage_error(
            "--fp8-grads quantizes the cotangents of FILE's backward; it goes with a FILE and a backward "
            "(not with --programs or --no-backward)"
        )
    if args.fp8_acc and (args.no_backward or args.programs is not None):
        return usage_error(
            "--fp8-acc chooses what FILE's backward saves; it goes with a FILE and a backward "
            "(not with --programs or --no-backward)"
        )
    if args.requantize_wgrad and (args.no_backward or args.programs is not None):
        return usage_error(
            "--requantize-wgrad chooses what FILE's backward derives; it goes with a FILE and a backward "
            "(not with --programs or --no-backward)"
        )
    if args.fp8_acc and options.chunked:
        return usage_error("--fp8-acc runs the backward unchunked; drop --chunk, --budget and --chunk-dim")
    if args.wrt is not None and (args.no_backward or args.programs is not None):
        return usage_error(
            "--wrt names what FILE's backward differentiates; it goes with a FILE and a backward "
            "(not with --programs or --no-backward)"
        )
    wrt = [w.strip() for w in args.wrt.split(",") if w.strip()] if args.wrt is not None else None
    if wrt is not None and not wrt:
        return usage_error("--wrt takes parameter names separated by commas, e.g. --wrt x,w")
    if args.fp8_grads is not None and options.chunked:
        return usage_error("--fp8-grads runs the backward unchunked; drop --chunk, --budget and --chunk-dim")
    if args.programs is not None and args.chunk_dim is not None:
        return usage_error(
            "--chunk-dim names a dim of FILE's block; it goes with a FILE, not with --programs"
        )
    if args.jobs < 1:
        return usage_error(f"--jobs takes a positive number of processes, got {args.jobs}")
    if args.programs is not None:
        # the folder a failing program is written to: made now, so that a long search doesn't end in an
        # error (created as `mkdir -p` would; one that can't be made or written is a usage error now)
        try:
            os.makedirs(args.save_dir, exist_ok=True)
        except OSError as e:
            return usage_error(f"--save-dir {args.save_dir}: can't make the folder: {e.strerror or e}")
        if not os.access(args.save_dir, os.W_OK | os.X_OK):
            return usage_error(f"--save-dir {args.save_dir}: not a folder this user can write")
    if args.jobs > 1 and (dims or args.input_seed is not None) and args.programs is None:
        return usage_error("--jobs splits a search; --dims and --input-seed reproduce one case (drop --jobs)")
    if args.jobs > 1:
        if args.file is not None:  # the file's errors once, here, not once per job
            checked, code = load_block(args.file, args.block)
            if checked is None:
                return code

        return run_jobs(args, list(getattr(args, "argv", [])))
    out = sys.stdout
    progress_quiet = bool(args.quiet)
    try:
        if args.programs is not None:
            label = f"{args.programs} random programs, {args.examples} cases each, target {args.target}"
            prog = Progress(label, args.programs * args.examples, quiet=progress_quiet)
            res = fuzz_programs(
                args.programs,
                args.target,
                examples=args.examples,
                seed=args.seed,
                max_dim=args.max_dim,
                special=args.special,
                backward=not args.no_backward,
                shrink=not args.no_shrink,
                tile=tile,
                sim_tile=sim_tile,
                progress=prog,
                remat=args.remat,  # (None: each program draws its policy)
                chunk=options.mode if options.chunked else DRAW,
                budget=options.budget,
            )
            for n in res.notes:
                print(f"note: {n}", file=sys.stderr)
            if res.failure is not None:
                assert res.failure.program is not None
                try:
                    path = save_program(res.failure.program, args.save_dir)
                    print(f"wrote the failing program to {path}", file=out)
                except OSError as e:  # (the folder was checked at the start; removed since, or full)
                    path = "PROGRAM.coda"
                    print(
                        f"can't write the failing program to {args.save_dir} ({e.strerror or e}); it is:\n"
                        f"{res.failure.program}\n(save it as {path} to reproduce)",
                        file=out,
                    )
                _print_failure(args, res.failure, path, "fwd", out)
                return EXIT_ERRORS
            ran = res.programs  # (counted: hypothesis draws about, not exactly, --programs)
            skip = (
                f"; {len(res.skipped)} skipped (the target can't run them: {skip_reasons(res.skipped)})"
                if res.skipped
                else ""
            )
            print(
                f"ok: {ran} random programs, {res.cases} cases, target {args.target}, seed {args.seed}{skip} "
                f"({res.seconds:.1f} s)",
                file=out,
            )
            return EXIT_OK
        block, code = load_block(args.file, args.block)
        if block is None:
            return code
        assert isinstance(block, Block)
        if dims:
            unknown = sorted(set(dims) - {d.name for d in block.ir.dims})
            if unknown:
                return usage_error(
                    f"unknown dim {unknown[0]}; {block.name} has dims "
                    f"{', '.join(d.name for d in block.ir.dims)}"
                )
        label = f"{block.name}, target {args.target}"
        try:
            fz = Fuzzer(
                block,
                args.target,
                backward=False if args.no_backward else options.with_(requantize_wgrad=args.requantize_wgrad),
                special=args.special,
                tile=tile,
                sim_tile=sim_tile,
                fp8_grads=args.fp8_grads,
                wrt=wrt,
                fp8_acc=args.fp8_acc,
            )
        except CodaError as e:
            print(render_all(e.diagnostics, e.sources, "human"), file=sys.stderr)
            print(f"coda fuzz: {block.name} can't run on --target {args.target}", file=sys.stderr)
            return EXIT_ERRORS
        except ValueError as e:  # --chunk-dim names no dim of the block, --wrt no parameter
            return usage_error(str(e).replace("wrt= names", "--wrt names"))
        units = fz.units()
        for name, size in dims.items():
            u = units.get(name, 1)
            if size % u:
                return usage_error(
                    f"{name} = {size} is not a multiple of {u}, which the block's extents need"
                    + (
                        f" (and --target {args.target} aligns rows to 16 bytes)"
                        if ALIGN[args.target] > 1
                        else ""
                    )
                )
        prog = Progress(label, args.examples, quiet=progress_quiet)
        res = fuzz_block(
            block,
            args.target,
            examples=args.examples,
            seed=args.seed,
            max_dim=args.max_dim,
            dims=dims or None,
            input_seed=args.input_seed,
            shrink=not args.no_shrink,
            progress=prog,
            fuzzer=fz,
        )
        for n in res.notes:
            print(f"note: {n}", file=sys.stderr)
        if res.failure is not None:
            _print_failure(args, res.failure, args.file, block.name, out)
            return EXIT_ERRORS
        if args.no_backward or fz.derivation is None or (args.target != "interp" and fz.fn is None):
            what = "forward"
        else:
            what = f"forward and backward, --remat {fz.remat}"
            if fz.fp8_grads is not None:
                what += f" --fp8-grads {fz.fp8_grads}"
            if fz.fp8_acc:
                what += " --fp8-acc"
            if fz.options is not None and fz.options.requantize_wgrad:
                what += " --requantize-wgrad"
            if fz.wrt is not None:
                what += f" --wrt {','.join(fz.wrt)}"
            if fz.chunk_plan is not None:
                flags = options.flags()  # (the policy is named above)
                what += "".join(f" {f}" for f in (flags[2:] if flags[:1] == ["--remat"] else flags))
            elif fz.chunk_error is not None:
                what += f", unchunked ({fz.chunk_error})"
        print(
            f"ok: {block.name}: {res.cases} cases ({what}), target {args.target}, seed {args.seed} "
            f"({res.seconds:.1f} s)",
            file=out,
        )
        return EXIT_OK
    except Unavailable as e:
        return usage_error(str(e))
