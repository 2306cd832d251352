"""`coda compile --emit ptx` from an empty kernel cache with one job and with two, and from a warm one.

Not a test; on any machine with nvidia-cutlass-dsl, quack and ptxas (no GPU):

    python benchmarks/compile_bench.py [--file examples/llama_mlp.coda] [--runs 3] [--jobs 1,2]

Each run is a fresh `coda compile FILE --emit ptx -o TMP -q` process: cold (an empty $CODA_CACHE_DIR),
then warm (the same command again on that cache). The job counts take turns run by run, so that a
change in the machine's load falls on all alike. First, a check of how much the CPUs run in parallel:
a CPU-bound Python loop alone, then two at once (on a machine whose cores are shared, two at once can
take twice as long each, and then no number of jobs makes a compile faster). Prints every run and the
medians; writes $OUT/compile_bench.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BURN = "import time\nt = time.perf_counter(); x = 0\nfor i in range(20_000_000): x += i\nprint(time.perf_counter() - t)"


def burn(n: int) -> list[float]:
    """Seconds of the loop in each of n processes started at once."""
    procs = [
        subprocess.Popen([sys.executable, "-c", BURN], stdout=subprocess.PIPE, text=True) for _ in range(n)
    ]
    return [float(p.communicate()[0]) for p in procs]


def compile_once(file: str, jobs: int, cache: Path, out: Path) -> float:
    env = {**os.environ, "CODA_CACHE_DIR": str(cache), "CODA_JOBS": str(jobs), "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "coda_lang.cli", "compile", file, "--emit", "ptx", "-o", str(out), "-q"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    took = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"coda compile failed:\n{r.stderr}")
    return took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--file", default="examples/llama_mlp.coda")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--jobs", default="1,2")
    args = p.parse_args()
    one, two = burn(1), burn(2)
    print(f"CPU-bound loop: alone {one[0]:.2f} s; two at once {two[0]:.2f} / {two[1]:.2f} s", flush=True)
    rows: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="coda-compile-bench-") as tmp:
        for run in range(args.runs):
            for jobs in (int(j) for j in args.jobs.split(",")):
                cache, out = Path(tmp) / "cache", Path(tmp) / "out"
                shutil.rmtree(cache, ignore_errors=True)
                cold = compile_once(args.file, jobs, cache, out)
                warm = compile_once(args.file, jobs, cache, out)
                r = rows.setdefault(f"--jobs {jobs}", {"cold": [], "warm": []})
                r["cold"].append(round(cold, 2))
                r["warm"].append(round(warm, 2))
                load = os.getloadavg()[0]
                print(
                    f"run {run + 1} --jobs {jobs}: cold {cold:.2f} s, warm {warm:.2f} s (load {load:.2f})",
                    flush=True,
                )
    print(f"\ncoda compile {args.file} --emit ptx, median of {args.runs}:")
    for name, r in rows.items():
        print(
            f"  {name}: cold {statistics.median(r['cold']):.2f} s, warm {statistics.median(r['warm']):.2f} s"
        )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "compile_bench.json").write_text(
            json.dumps({"burn": {"one": one, "two": two}, "runs": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
