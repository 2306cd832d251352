"""The `coda` command line: `coda check FILE...` (later issues add run, grad, compile, fuzz, bench).

What it does: argument parsing, reading files, printing diagnostics (human or short form) and
plans, and exit codes: 0 ok, 1 the program has errors, 2 usage or I/O errors.
What it does not: any compiler work itself (frontend.py, api.py).
Invariants: never prints a Python traceback (an internal error prints one line and exits 3; set
CODA_DEBUG=1 to see the traceback); imports nothing heavy (no NumPy, torch or CuTeDSL) on the
`check` path, so it starts fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

EXIT_OK, EXIT_ERRORS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"coda: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="coda", description="coda_lang: GEMM-plus-epilogue programs, checked for fusion before any GPU run.")
    p.add_argument("--version", action="version", version="coda_lang 0.1.0")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    c = sub.add_parser("check", help="parse and check .coda files: types, shapes, block-locality",
                       description="Check .coda files: names, dtypes, symbolic shapes, stage kinds and "
                       "block-locality (whether every stage fuses into one GEMM epilogue).")
    c.add_argument("files", nargs="+", metavar="FILE", help=".coda files to check")
    c.add_argument("--error-format", choices=("human", "short"), default="human",
                   help="human: rustc-style with source lines (default); short: one line per error")
    c.add_argument("--explain", action="store_true",
                   help="print each block's plan: stages, loads, stores (with dtype), reductions, "
                   "vector computations between stages, tiling constraints")
    c.add_argument("--block", metavar="NAME", help="explain only this block")

    r = sub.add_parser("run", help="run a block with the NumPy reference interpreter",
                       description="Run a block on the NumPy reference interpreter (the executable spec). "
                       "Without --inputs, inputs are random and seeded; dims not given default to 256.")
    r.add_argument("file", metavar="FILE")
    r.add_argument("--block", metavar="NAME", help="the block to run (needed when the file has several)")
    r.add_argument("--dims", metavar="M=..,D=..", help="sizes of the dims, e.g. M=4096,D=1024,F=2816")
    r.add_argument("--inputs", metavar="IN.npz", help="inputs by parameter name (default: random)")
    r.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    r.add_argument("--out", metavar="OUT.npz", help="write the outputs here (written atomically)")
    r.add_argument("--tile", metavar="MxN", help="simulate the kernel's tiling, e.g. 128x256 (default: whole matrices)")
    r.add_argument("--precision", choices=("exact", "f64"), default="exact",
                   help="exact: the kernel's numerics (f32 stages, rounded stored tiles); f64: float64, no rounding")

    g = sub.add_parser("grad", help="derive the backward block (printed as .coda source)",
                       description="Derive the backward block of a block by reverse-mode autodiff and print it as "
                       ".coda source (which `coda check` accepts). The VJP of each stage's epilogue runs in the "
                       "epilogue of the GEMM that produces its cotangent; where none does (the block's entry), "
                       "in one elementwise stage, which is reported. The printed block says which forward "
                       "tensors it reads (saved).")
    g.add_argument("file", metavar="FILE")
    g.add_argument("--block", metavar="NAME", help="the block to differentiate (needed when the file has several)")
    g.add_argument("--wrt", metavar="P,Q", help="parameters to differentiate with respect to "
                   "(default: every float parameter without a default)")
    g.add_argument("--with-forward", action="store_true",
                   help="also print the forward block, extended to store the saved tensors")
    g.add_argument("-o", "--output", metavar="OUT.coda", help="write here instead of standard output (atomically)")
    g.add_argument("--error-format", choices=("human", "short"), default="human")

    k = sub.add_parser("compile", help="compile each GEMM stage to a CuTeDSL epilogue (Python source) or to PTX",
                       description="Compile each GEMM stage of a block for Hopper (sm_90a) on quack's GEMM: "
                       "`--emit source` writes the stage's `@gemm_epilogue` function; `--emit ptx` compiles it with "
                       "CuTeDSL (no GPU needed), checks it with `ptxas -v` and, unless --tile is given, picks the "
                       "first tile (128x192; 128x192 with an epilogue subtile 16 columns wide; 128x176, 128x128, 128x96, "
                       "128x64) whose kernel has no register spills. Writes "
                       "one file per stage, BLOCK_stageK.py or .ptx. Kernels are cached in $CODA_CACHE_DIR "
                       "(default ~/.cache/coda_lang/kernels).")
    k.add_argument("file", metavar="FILE")
    k.add_argument("--block", metavar="NAME", help="the block to compile (needed when the file has several)")
    k.add_argument("--emit", choices=("source", "ptx"), required=True, help="what to write for each stage")
    k.add_argument("-o", "--output-dir", metavar="DIR", default=".", help="where to write (default: .)")
    k.add_argument("--backward", action="store_true", help="compile the derived backward block instead")
    k.add_argument("--tile", metavar="MxN[eS]", help="--emit ptx: this tile only (e.g. 128x128; pingpong, cluster "
                   "2x1); a suffix eS sets the epilogue subtile S columns wide (e.g. 128x192e16)")
    k.add_argument("--error-format", choices=("human", "short"), default="human")
    _fuzz_parser(sub)
    return p


def _fuzz_parser(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser("fuzz", help="differential testing: kernels or tile simulation against the interpreter",
                       description="Fuzz a block: random sizes (including ones that are not multiples of the tile) "
                       "and seeded random inputs, run on the path under test and on the whole-matrix interpreter, "
                       "forward and backward, compared within the tolerance of PAPER.md section 6. On a mismatch "
                       "hypothesis shrinks the case; the smallest failing dims, the input seed and a command that "
                       "reproduces it are printed. Exit 0: every case passed; 1: a failure (or the block can't run "
                       "on the target); 2: usage errors, or a target this machine can't run.")
    f.add_argument("file", metavar="FILE", nargs="?", help="the .coda file (or --programs N instead)")
    f.add_argument("--block", metavar="NAME", help="the block to fuzz (needed when the file has several)")
    f.add_argument("--target", choices=("interp", "cuda", "emulate"), default="interp",
                   help="interp: the interpreter's tile simulation (default); cuda: the compiled kernels "
                   "(Block.cuda(), needs a GPU); emulate: the CUDA runtime with torch stand-ins for the kernels (CPU)")
    f.add_argument("--examples", type=int, metavar="N",
                   help="cases to try (default 100; with --programs: cases per program, default 5)")
    f.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the search (default 0)")
    f.add_argument("--max-dim", type=int, metavar="K", help="largest size of a dim (default: 48 for interp, "
                   "520 for cuda, 64 for emulate; cuda and emulate draw multiples of 8)")
    f.add_argument("--dims", metavar="M=..,N=..", help="fix these dims (reproducing a case)")
    f.add_argument("--input-seed", type=int, metavar="S", help="fix the seed of the inputs (reproducing a case)")
    f.add_argument("--tile", metavar="MxN", help="interp: fix the simulated tile (default: small random tiles); "
                   "cuda, emulate: the kernels' tile (default: the backend's choice)")
    f.add_argument("--special", action="store_true",
                   help="inputs with special values too: NaN, +-inf, large magnitudes, denormals, signed zeros")
    f.add_argument("--no-backward", action="store_true", help="fuzz the forward only")
    f.add_argument("--no-shrink", action="store_true", help="report the first failing case as found")
    f.add_argument("--programs", type=int, metavar="N", help="fuzz N random programs instead of FILE")
    f.add_argument("--save-dir", metavar="DIR", default=".",
                   help="--programs: where to write a failing program (default: .)")
    f.add_argument("-q", "--quiet", action="store_true", help="no progress line")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(f"coda: error: can't read {path}: {reason}", file=sys.stderr)
        return None


def cmd_check(args: argparse.Namespace) -> int:
    from coda_lang.frontend import check_source
    from coda_lang.verify.diagnostics import render_all
    from coda_lang.verify.plan import explain

    status = EXIT_OK
    n_errors = 0
    for path in args.files:
        text = _read(path)
        if text is None:
            status = EXIT_USAGE
            continue
        prog, plans, diags = check_source(text, path)
        if diags:
            n_errors += len(diags)
            print(render_all(diags, {path: text}, args.error_format), file=sys.stderr)
            if args.error_format == "human":
                print(file=sys.stderr)
            status = max(status, EXIT_ERRORS) if status != EXIT_USAGE else status
            continue
        assert prog is not None
        names = [b.name for b in prog.blocks]
        if args.block and args.block not in names:
            print(f"coda: error: no block `{args.block}` in {path}; blocks: {', '.join(names)}", file=sys.stderr)
            status = EXIT_USAGE
            continue
        if args.explain:
            for b in prog.blocks:
                if args.block is None or b.name == args.block:
                    print(explain(plans[b.name]))
        stages = sum(len(plans[n].stages) for n in names)
        print(f"ok: {path}: {len(names)} block{'s' * (len(names) != 1)} ({', '.join(names)}), "
              f"{stages} GEMM stage{'s' * (stages != 1)}")
    if n_errors and args.error_format == "human":
        print(f"error: {n_errors} error{'s' * (n_errors != 1)} found", file=sys.stderr)
    return status


def _usage(msg: str) -> int:
    print(f"coda: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _parse_dims(text: str | None) -> dict[str, int] | None:
    if not text:
        return {}
    out: dict[str, int] = {}
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or not name.strip().isidentifier() or not value.strip().isdigit() or int(value) <= 0:
            return None
        out[name.strip()] = int(value)
    return out


def _parse_tile(text: str | None) -> tuple[int, int] | None | str:
    if not text:
        return None
    m, x, n = text.lower().partition("x")
    if not x or not m.isdigit() or not n.isdigit() or int(m) <= 0 or int(n) <= 0:
        return "bad"
    return int(m), int(n)


def _parse_tile_subtile(text: str | None) -> tuple[int, int, int] | None | str:
    """MxN as (M, N, 0), MxNeS as (M, N, S): S, the epilogue subtile's width."""
    if not text:
        return None
    mn, e, width = text.lower().partition("e")
    tile = _parse_tile(mn)
    if not isinstance(tile, tuple) or (e and not (width.isdigit() and int(width) > 0)):
        return "bad"
    return (*tile, int(width) if e else 0)


def _load_block(path: str, block: str | None, fmt: str = "human") -> tuple[object | None, int]:
    """(Block, 0), or (None, exit code) after printing why."""
    from coda_lang.frontend import check_source
    from coda_lang.verify.diagnostics import render_all

    text = _read(path)
    if text is None:
        return None, EXIT_USAGE
    prog, plans, diags = check_source(text, path)
    if diags:
        print(render_all(diags, {path: text}, fmt), file=sys.stderr)
        return None, EXIT_ERRORS
    assert prog is not None
    from coda_lang.api import Block

    names = [b.name for b in prog.blocks]
    if block is None:
        if len(names) > 1:
            return None, _usage(f"{path} has several blocks ({', '.join(names)}); choose one with --block")
        block = names[0]
    if block not in names:
        return None, _usage(f"no block `{block}` in {path}; blocks: {', '.join(names)}")
    b = next(b for b in prog.blocks if b.name == block)
    return Block(b, plans[block]), EXIT_OK


def _write_npz(path: str, arrays: dict[str, object]) -> None:
    """Write atomically: a temporary file in the same folder, renamed over `path` when complete."""
    import tempfile

    import numpy as np

    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".coda-", suffix=".npz", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **{k: _savable(v) for k, v in arrays.items()})  # type: ignore[arg-type]
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _savable(x: object) -> object:
    import numpy as np

    a = np.asarray(x)
    return a.astype(np.float32) if a.dtype.name in ("bfloat16",) else a


def cmd_run(args: argparse.Namespace) -> int:
    import numpy as np

    from coda_lang.interp import random_inputs
    from coda_lang.interp.inputs import infer_dims
    from coda_lang.verify.diagnostics import CodaError, render_all

    block, code = _load_block(args.file, args.block)
    if block is None:
        return code
    from coda_lang.api import Block

    assert isinstance(block, Block)
    dims = _parse_dims(args.dims)
    if dims is None:
        return _usage(f"--dims takes NAME=SIZE pairs separated by commas (e.g. M=4096,D=1024), got {args.dims!r}")
    tile = _parse_tile(args.tile)
    if tile == "bad":
        return _usage(f"--tile takes MxN with positive sizes (e.g. 128x256), got {args.tile!r}")
    try:
        if args.inputs:
            try:
                with np.load(args.inputs, allow_pickle=False) as z:
                    inputs = {k: z[k] for k in z.files}
            except (OSError, ValueError) as e:
                return _usage(f"can't read {args.inputs}: {e}")
            source = f"inputs from {args.inputs}"
            sizes = infer_dims(block.ir, {k: v.shape for k, v in inputs.items() if k in
                                          {p.var.name for p in block.ir.params}}, dims)
        else:
            sizes = {d.name: dims.get(d.name, d.value or 256) for d in block.ir.dims}
            unknown = set(dims) - set(sizes)
            if unknown:
                return _usage(f"unknown dim {sorted(unknown)[0]}; {block.name} has dims {', '.join(sizes)}")
            sizes = infer_dims(block.ir, {}, sizes)
            inputs = random_inputs(block.ir, sizes, args.seed)
            source = f"random inputs, seed {args.seed}"
        outs = block.run(inputs, dims=sizes, tile=tile, precision=args.precision)  # type: ignore[arg-type]
    except CodaError as e:
        print(render_all(e.diagnostics, {}, "human"), file=sys.stderr)
        return EXIT_ERRORS
    mode = f"tiles of {tile[0]}x{tile[1]}" if isinstance(tile, tuple) else "whole matrices"
    dim_text = ", ".join(f"{k}={v}" for k, v in sizes.items())
    print(f"{block.name} on {dim_text} ({source}; {mode}; {args.precision})")
    rows = [("output", "shape", "dtype", "mean", "max|x|")]
    for name, x in outs.items():
        a = np.asarray(x).astype(np.float64)
        dt = np.asarray(x).dtype.name.replace("float32", "f32").replace("bfloat16", "bf16").replace(
            "float16", "f16").replace("int32", "i32").replace("float64", "f64")
        rows.append((name, str(tuple(a.shape)), dt, f"{a.mean():.6g}" if a.size else "-",
                     f"{np.abs(a).max():.6g}" if a.size else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if args.out:
        try:
            _write_npz(args.out, outs)
        except OSError as e:
            return _usage(f"can't write {args.out}: {e.strerror or e}")
        print(f"wrote {args.out}")
    return EXIT_OK


def _write_text(path: str, text: str) -> None:
    """Write atomically: a temporary file in the same folder, renamed over `path` when complete."""
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".coda-", suffix=".coda", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def cmd_grad(args: argparse.Namespace) -> int:
    from coda_lang.ir.printer import dims_source, print_block
    from coda_lang.verify.diagnostics import CodaError, render_all

    block, code = _load_block(args.file, args.block, args.error_format)
    if block is None:
        return code
    from coda_lang.api import Block

    assert isinstance(block, Block)
    wrt = [w.strip() for w in args.wrt.split(",") if w.strip()] if args.wrt else None
    try:
        d = block.derivation(wrt)
    except CodaError as e:
        text = _read(args.file) or ""
        print(render_all(e.diagnostics, {args.file: text}, args.error_format), file=sys.stderr)
        return EXIT_ERRORS
    parts = []
    dims = d.forward.ir.dims if args.with_forward else d.backward.ir.dims  # the forward's are a superset
    if dims:
        parts.append(dims_source(dims) + "\n")
    if args.with_forward:
        parts.append(print_block(d.forward.ir, with_dims=False))
    parts.append(print_block(d.backward.ir, with_dims=False))
    text = "\n".join(parts)
    for line in d.report:
        print(f"note: {line}", file=sys.stderr)
    if args.output:
        try:
            _write_text(args.output, text)
        except OSError as e:
            return _usage(f"can't write {args.output}: {e.strerror or e}")
        print(f"wrote {args.output}: {d.backward.name} ({len(d.backward.plan.stages)} stages)", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK


def cmd_compile(args: argparse.Namespace) -> int:
    from coda_lang.verify.diagnostics import CodaError, render_all

    block, code = _load_block(args.file, args.block, args.error_format)
    if block is None:
        return code
    from coda_lang.api import Block

    assert isinstance(block, Block)
    tile = _parse_tile_subtile(args.tile)
    if tile == "bad" or (isinstance(tile, tuple) and args.emit != "ptx"):
        return _usage(f"--tile takes MxN or MxNeS (e.g. 128x128, 128x192e16) and goes with --emit ptx, got "
                      f"{args.tile!r}")
    text = _read(args.file) or ""

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
        return _usage(f"can't create {out_dir}: {e.strerror or e}")
    from coda_lang.backend_cute.compile import BackendUnavailable, TileConfig, compile_spec, select_config
    from coda_lang.backend_cute.emit import emit_stage
    from coda_lang.backend_cute.planner import plan_stage
    from coda_lang.ir.nodes import Stage

    status = EXIT_OK
    stages = [s for s in block.ir.body if isinstance(s, Stage)]
    for k in range(1, len(block.plan.stages) + 1):
        name = f"{block.name}_stage{k}"
        if not stages[k - 1].is_gemm:
            print(f"stage {k} `{block.plan.stages[k - 1].text}`: no GEMM, nothing to emit (at run time it is one "
                  "fused elementwise kernel, generated by torch.compile)")
            continue
        try:
            spec = plan_stage(block, k)
            if args.emit == "source":
                path = os.path.join(out_dir, name + ".py")
                _write_text(path, emit_stage(spec))
                what = [f"D = {spec.d.name}"] if spec.d else []
                what += [f"stores {', '.join(o.name for o in spec.outputs)}"] if spec.outputs else []
                what += [f"reduces {', '.join(s.name for s in spec.sinks)}"] if spec.sinks else []
                print(f"wrote {path}: stage {k} `{spec.text}` ({spec.mode} mode; {'; '.join(what) or 'no outputs'})")
                continue
            if isinstance(tile, tuple):
                c = compile_spec(spec, TileConfig(tile[0], tile[1], epi_n=tile[2]))
            else:
                c = select_config(block, k)
            path = os.path.join(out_dir, name + ".ptx")
            _write_text(path, c.ptx)
            assert c.report is not None
            how = "cached" if c.cached else f"compiled in {c.compile_s:.1f} s"
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
            return _usage(f"can't write {e.filename or out_dir}: {e.strerror or e}")
    return status


def cmd_fuzz(args: argparse.Namespace) -> int:
    from coda_lang.fuzz import command  # imports hypothesis (and torch only for --target cuda/emulate)

    return command(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return {"check": cmd_check, "run": cmd_run, "grad": cmd_grad, "compile": cmd_compile,
                "fuzz": cmd_fuzz}[args.command](args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK
    except Exception as e:  # a traceback is a bug; say so in one line
        if os.environ.get("CODA_DEBUG"):
            raise
        print(f"coda: internal error (a bug, please report it): {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_INTERNAL


def entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    entry()
