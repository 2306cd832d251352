"""Where a GPU stream idles in one profiled step: the largest gaps between consecutive kernels.

Not a test. Reads a Chrome trace written by torch.profiler (`benchmarks/hf_train_step.py --profile
--trace FILE`) and prints the GPU's busy and idle time, and the largest gaps with the kernels before
and after each, so that a gap can be traced to what the host did there (a synchronization, a loop of
small launches, an allocation):

    python benchmarks/gaps.py TRACE.json [--top 15] [--min-us 20]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter


def kernels(trace: dict) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of every GPU kernel, memcpy and memset, in start order."""
    out = []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or ev.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        out.append((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0)), str(ev.get("name", "?"))))
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--top", type=int, default=15)
    p.add_argument(
        "--min-us", type=float, default=20.0, help="gaps shorter than this are not counted in the table"
    )
    a = p.parse_args(argv)
    try:
        with open(a.trace) as f:
            trace = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        print(f"gaps.py: {a.trace}: {e}", file=sys.stderr)
        return 2
    ks = kernels(trace)
    if not ks:
        print(f"gaps.py: {a.trace}: no GPU kernels in the trace", file=sys.stderr)
        return 1
    span = ks[-1][1] - ks[0][0]
    busy, end = 0.0, ks[0][0]
    gaps = []
    for i, (s, e, _n) in enumerate(ks):
        if s > end:
            gaps.append((s - end, i))
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    idle = span - busy
    print(f"{len(ks)} kernels over {span / 1e3:.2f} ms: busy {busy / 1e3:.2f} ms, idle {idle / 1e3:.2f} ms")
    big = [(g, i) for g, i in gaps if g >= a.min_us]
    print(f"{len(big)} gaps of at least {a.min_us:g} us: {sum(g for g, _ in big) / 1e3:.2f} ms")
    after = Counter()
    for g, i in big:
        after[ks[i][2][:60]] += g
    print("idle before each kernel name (largest):")
    for name, g in after.most_common(a.top):
        print(f"  {g / 1e3:7.3f} ms  {name}")
    print("largest gaps:")
    for g, i in sorted(big, reverse=True)[: a.top]:
        t = (ks[i][0] - ks[0][0]) / 1e3
        print(f"  {g:8.1f} us at {t:8.2f} ms: {ks[i - 1][2][:50]}  ->  {ks[i][2][:50]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
