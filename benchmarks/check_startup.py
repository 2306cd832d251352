"""Wall time of `coda check examples/llama_block.coda`: the median of 10 runs, each a fresh process.

Usage: python benchmarks/check_startup.py [FILE] [--runs N]

`coda check` is meant to answer before a GPU run is even considered, so its start-up matters: it
imports no NumPy, torch or GPU library (tests/test_api_and_speed.py checks that). This script times
the whole command, interpreter start-up included; it runs the `coda` console script when it is on
PATH, else `python -m coda_lang.cli`. One untimed run first warms lark's grammar cache.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", nargs="?", default=str(ROOT / "examples" / "llama_block.coda"))
    ap.add_argument("--runs", type=int, default=10)
    args = ap.parse_args()
    coda = shutil.which("coda")
    cmd = [coda] if coda else [sys.executable, "-m", "coda_lang.cli"]
    cmd += ["check", args.file]
    subprocess.run(cmd, check=True, capture_output=True)  # warm-up (lark's grammar cache)
    times = []
    for _ in range(args.runs):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    base = []
    for _ in range(args.runs):  # the bare interpreter, for comparison
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        base.append(time.perf_counter() - t0)
    shown = " ".join(Path(c).name if i == 0 else c for i, c in enumerate(cmd))
    print(
        f"{shown}: median {statistics.median(times) * 1000:.0f} ms over {args.runs} runs "
        f"(min {min(times) * 1000:.0f} ms, max {max(times) * 1000:.0f} ms; "
        f"bare `python -c pass`: {statistics.median(base) * 1000:.0f} ms)"
    )


if __name__ == "__main__":
    main()
