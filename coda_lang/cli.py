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
    return p


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return {"check": cmd_check}[args.command](args)
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
