"""Which candidate tiles the tuner chose, from a kernel cache's tuning.json: the data for dropping
candidates that never win (each one dropped is a kernel fewer per stage to compile).

Not a test; after a GPU run (e.g. benchmarks/hf_train_step.py --configs coda, or `coda precompile
--seq`), with the same $CODA_CACHE_DIR:

    python benchmarks/tile_wins.py [--cache DIR] [--within 0.02]

Prints one line per tuned stage and shape (the GEMM from the emitted epilogue's header, the shape, the
tile chosen and each timed candidate's time relative to the best), then per candidate how often it
won and how often it was within `--within` of the best. A candidate that is never within a few percent
of the best on any stage is one the tuner can do without.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter
from pathlib import Path


def stage_names(cache: Path) -> dict[str, str]:
    """Emitted epilogue hash (its first 24 hex digits) -> the GEMM its header names."""
    out = {}
    for path in (cache / "epilogues").glob("coda_epi_*.py"):
        head = path.read_text().split("\n", 1)[0]
        m = re.search(r"`(gemm [^`]*)`", head) or re.search(r"(a bare GEMM[^.]*)", head)
        out[path.stem.removeprefix("coda_epi_")] = m.group(1) if m else head
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = os.environ.get("CODA_CACHE_DIR") or str(Path.home() / ".cache" / "coda_lang" / "kernels")
    p.add_argument("--cache", default=default)
    p.add_argument("--within", type=float, default=0.02, help="a candidate counts as close within this")
    args = p.parse_args()
    cache = Path(args.cache)
    data = json.loads((cache / "tuning.json").read_text())
    names = stage_names(cache)
    wins: Counter[str] = Counter()
    close: Counter[str] = Counter()
    timed: Counter[str] = Counter()
    for entry in data.values():
        ms = entry.get("ms") if isinstance(entry, dict) else None
        if not ms:
            continue
        best = min(ms.values())
        chosen = min(ms, key=ms.get)
        wins[chosen] += 1
        for label, t in ms.items():
            timed[label] += 1
            close[label] += t <= best * (1 + args.within)
        source = str(entry.get("source", ""))[:24]
        shape = "x".join(map(str, entry.get("shape", [])))
        rel = ", ".join(f"{label} {t / best:.3f}" for label, t in sorted(ms.items(), key=lambda x: x[1]))
        print(f"{names.get(source, source)} at {shape}: {chosen}; {rel}")
    print()
    print(f"| candidate | timed | won | within {args.within:.0%} |")
    print("|---|---|---|---|")
    for label in sorted(timed, key=lambda x: (-wins[x], -close[x])):
        print(f"| {label} | {timed[label]} | {wins[label]} | {close[label]} |")


if __name__ == "__main__":
    main()
