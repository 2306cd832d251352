"""`coda check`: parse and check .coda files: names, dtypes, symbolic shapes and block-locality."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from coda_lang.cli.common import (
    EXIT_ERRORS,
    EXIT_OK,
    EXIT_USAGE,
    read_source_file,
)
from coda_lang.core.diagnostics import render_all
from coda_lang.frontend.source import check_source
from coda_lang.frontend.verify.plan import explain


def add_parser(sub: Any) -> None:
    c = sub.add_parser(
        "check",
        help="parse and check .coda files: types, shapes, block-locality",
        description="Check .coda files: names, dtypes, symbolic shapes, stage kinds and "
        "block-locality (whether every stage fuses into one GEMM epilogue).",
    )
    c.add_argument("files", nargs="+", metavar="FILE", help=".coda files to check")
    c.add_argument(
        "--error-format",
        choices=("human", "short"),
        default="human",
        help="human: rustc-style with source lines (default); short: one line per error",
    )
    c.add_argument(
        "--explain",
        action="store_true",
        help="print each block's plan: stages, loads, stores (with dtype), reductions, "
        "vector computations between stages, tiling constraints",
    )
    c.add_argument("--block", metavar="NAME", help="explain only this block")
    c.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:

    status = EXIT_OK
    n_errors = 0
    for path in args.files:
        text = read_source_file(path)
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
            print(
                f"coda: error: no block `{args.block}` in {path}; blocks: {', '.join(names)}", file=sys.stderr
            )
            status = EXIT_USAGE
            continue
        if args.explain:
            for b in prog.blocks:
                if args.block is None or b.name == args.block:
                    print(explain(plans[b.name]))
        stages = [sp for n in names for sp in plans[n].stages]
        n_ew = sum(1 for sp in stages if sp.text.startswith("elementwise"))  # as explain() counts
        n_gemm = len(stages) - n_ew
        ew = f" + {n_ew} elementwise stage{'s' * (n_ew != 1)}" if n_ew else ""
        print(
            f"ok: {path}: {len(names)} block{'s' * (len(names) != 1)} ({', '.join(names)}), "
            f"{n_gemm} GEMM stage{'s' * (n_gemm != 1)}{ew}"
        )
    if n_errors and args.error_format == "human":
        print(f"error: {n_errors} error{'s' * (n_errors != 1)} found", file=sys.stderr)
    return status
