#!/usr/bin/env python
"""The malformed-program property at scale, outside CI (issue #17): `coda check`, `coda grad` and
`coda run` never crash, never hang, and `coda_lang.load` raises only CodaError, on N malformed programs.

    python scripts/robustness_stress.py [--programs 10000] [--jobs 2] [--seed 0] [--timeout 60] [--out DIR]

Programs come from `coda_lang.testing.malformed.malformed`: the examples and random valid programs
(`coda_lang.testing.random_blocks`), mutated, deeply nested, given huge literals and other line
endings. Each job runs hypothesis (random, seeded with seed + job) over its share of the programs and
`coda_lang.cli.crash.crash` on each (the three commands in-process, through the CLI's `main`), with a time
limit per program (a hang). Prints the number of programs, how many were distinct, how many loaded,
each command's exit codes, and every crash (its program written to --out, one line of why);
exit status 1 if any program crashed or hung. tests/test_robustness.py runs the same property on a
smaller derandomized sample in CI (`HYPOTHESIS_PROFILE=stress` makes it take 10,000 there too).
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Hang()


def job(args: tuple[int, int, int, str]) -> tuple[Counter[str], set[str], list[tuple[str, str]]]:
    """One job: `n` programs drawn with hypothesis seed `seed`; (counts, digests of the texts, crashes)."""
    n, seed, timeout, out = args
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis import strategies as st

    from coda_lang.cli.crash import crash
    from coda_lang.testing import malformed as mf

    sources = st.one_of(st.sampled_from(mf.examples_sources(str(ROOT / "examples"))), mf.random_sources())
    counts: Counter[str] = Counter()
    digests: set[str] = set()
    crashes: list[tuple[str, str]] = []
    folder = tempfile.mkdtemp(prefix="coda-stress-")
    signal.signal(signal.SIGALRM, _alarm)

    @hypothesis_seed(seed)
    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        phases=[p for p in settings.default.phases if p.name != "shrink"],
    )
    @given(mf.malformed(sources))
    def prop(text: str) -> None:
        counts["programs"] += 1
        digests.add(hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest())
        signal.alarm(timeout)
        try:
            why = crash(text, folder, counts=counts)
        except Hang:
            why = f"no answer within {timeout} s (a hang)"
        finally:
            signal.alarm(0)
        if why:
            name = f"crash-{hashlib.sha256(text.encode('utf-8', 'surrogatepass')).hexdigest()[:10]}.coda"
            with open(
                os.path.join(out, name), "w", encoding="utf-8", errors="surrogatepass", newline=""
            ) as f:
                f.write(text)
            crashes.append((name, why))

    prop()
    return counts, digests, crashes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--programs", type=int, default=10_000)
    p.add_argument("--jobs", type=int, default=max(1, min(os.cpu_count() or 1, 8)))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=60, help="seconds a program may take (default 60)")
    p.add_argument("--out", default=None, help="folder for crashing programs (default: a temporary one)")
    a = p.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="coda-stress-out-")
    os.makedirs(out, exist_ok=True)
    per = -(-a.programs // a.jobs)
    t0 = time.monotonic()
    tasks = [(per, a.seed + j, a.timeout, out) for j in range(a.jobs)]
    if a.jobs == 1:
        results = [job(tasks[0])]
    else:
        with multiprocessing.get_context("fork").Pool(a.jobs) as pool:
            results = pool.map(job, tasks)
    counts: Counter[str] = Counter()
    digests: set[str] = set()
    crashes: list[tuple[str, str]] = []
    for c, d, x in results:
        counts.update(c)
        digests |= d
        crashes += x
    n = counts.pop("programs", 0)
    print(
        f"{n} malformed programs ({len(digests)} distinct) in {time.monotonic() - t0:.0f} s, "
        f"{a.jobs} jobs, seeds {a.seed}..{a.seed + a.jobs - 1}"
    )
    print(f"  loaded (valid after the damage): {counts.pop('loaded', 0)}")
    for cmd in ("check", "grad", "run"):
        codes = {k.split()[1]: v for k, v in counts.items() if k.startswith(cmd + " ")}
        print(f"  coda {cmd}: " + ", ".join(f"exit {c}: {v}" for c, v in sorted(codes.items())))
    for name, why in crashes:
        print(f"CRASH {os.path.join(out, name)}: {why}")
    print(f"{len(crashes)} crashed or hung" + (f" (programs in {out})" if crashes else ""))
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
