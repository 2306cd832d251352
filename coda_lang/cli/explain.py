"""`coda explain CODE`: the error index's entry for a diagnostic code (what it means, a program that
gets it, and the same program fixed).

What it does: prints `coda_lang.reference.explain(code)`; `coda explain` alone lists every code.
What it does not: check anything (the entries are checked by tests/test_docs.py).
Invariants: exit 0 for a known code, 2 (a usage error) for an unknown one.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from coda_lang.cli.common import EXIT_OK, usage_error
from coda_lang.core.diagnostics import CODES
from coda_lang.reference import explain


def add_parser(sub: Any) -> None:
    e = sub.add_parser(
        "explain",
        help="explain an error code, e.g. `coda explain E0503`",
        description="Print the error index's entry for a diagnostic code: what it means, a program "
        "that gets it and the same program fixed (docs/errors.md holds them all). Without CODE, "
        "list the codes.",
    )
    e.add_argument("code", metavar="CODE", nargs="?", help="an error code such as E0503")
    e.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:

    if args.code is None:
        for code, title in CODES.items():
            print(f"{code}  {title}")
        return EXIT_OK
    code = args.code.strip().upper()
    text = explain(code)
    if text is None:
        return usage_error(f"no error code {args.code!r}; `coda explain` lists them (E0101 ... E0708)")
    sys.stdout.write(text)
    return EXIT_OK
