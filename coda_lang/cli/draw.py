"""`coda draw`: draw a block's dataflow as SVG (frontend/verify/draw.py lays it out)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from coda_lang.cli.common import EXIT_ERRORS, EXIT_OK, EXIT_USAGE, read_source_file, usage_error, write_text
from coda_lang.core.diagnostics import render_all
from coda_lang.frontend.source import check_source
from coda_lang.frontend.verify.draw import draw


def add_parser(sub: Any) -> None:
    d = sub.add_parser(
        "draw",
        help="draw a block's dataflow as SVG",
        description="Draw a block's plan as an SVG picture: its stages in program order (each with "
        "its GEMM operands, what its epilogue loads, stores with which dtype and reduces), the vector "
        "computations between them, the parameters on the left and the outputs on the right, with "
        "an arrow from whatever makes a value to each place that reads it. Without --block, every "
        "block of the file, one below the other.",
    )
    d.add_argument("file", metavar="FILE", help="the .coda file")
    d.add_argument("--block", metavar="NAME", help="draw only this block")
    d.add_argument(
        "-o", "--output", metavar="OUT.svg", help="write here instead of standard output (atomically)"
    )
    d.add_argument(
        "--error-format",
        choices=("human", "short"),
        default="human",
        help="a program's errors: human, with source lines (default); short, one line each",
    )
    d.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    text = read_source_file(args.file)
    if text is None:
        return EXIT_USAGE
    prog, plans, diags = check_source(text, args.file)
    if diags:
        print(render_all(diags, {args.file: text}, args.error_format), file=sys.stderr)
        return EXIT_ERRORS
    assert prog is not None
    names = [b.name for b in prog.blocks]
    if args.block is not None and args.block not in names:
        return usage_error(f"no block `{args.block}` in {args.file}; blocks: {', '.join(names)}")
    chosen = [plans[n] for n in names if args.block is None or n == args.block]
    svg = draw(chosen)
    if args.output:
        try:
            write_text(args.output, svg)
        except OSError as e:
            return usage_error(f"can't write {args.output}: {e.strerror or e}")
        print(f"wrote {args.output}: {', '.join(p.block.name for p in chosen)}", file=sys.stderr)
    else:
        sys.stdout.write(svg)
    return EXIT_OK
