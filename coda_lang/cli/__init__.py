"""The `coda` command line: one module per command (check, draw, run, grad, compile, tune, precompile,
fuzz, explain), common.py for what they share.

What it does: `build_parser` registers each command's subparser (each module's `add_parser` sets the
function that runs it); `main` parses, runs the command and maps failures to exit codes: 0 ok, 1 the
program has errors (or a fuzz failure), 2 usage or I/O errors, 3 an internal error.
What it does not: any compiler work itself (frontend/source.py, api.py, the backends).
Invariants: never prints a Python traceback (an internal error prints one line and exits 3; set
CODA_DEBUG=1 to see the traceback); imports nothing heavy (no NumPy, torch or CuTeDSL) on the
`check` path, so it starts fast: each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from coda_lang.cli import check, compile, draw, explain, fuzz, grad, precompile, run, tune
from coda_lang.cli.common import EXIT_INTERNAL, EXIT_OK, EXIT_USAGE, Parser
from coda_lang.core import orphans

COMMANDS = (check, draw, run, grad, compile, tune, precompile, fuzz, explain)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="coda",
        description="coda_lang: GEMM-plus-epilogue programs, checked for fusion before any GPU run.",
    )
    p.add_argument("--version", action="version", version="coda_lang 0.1.0")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    orphans.from_environment()  # (a `coda fuzz --jobs` job: it ends with the coda that started it)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # (as given: `coda fuzz --jobs` reruns it)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return int(args.run(args))
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
