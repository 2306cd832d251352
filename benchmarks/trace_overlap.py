"""How much of a step's communication runs under its computation, from a Chrome trace of one step
(torch.profiler's export, as `dist_train_step.py --trace` writes them).

Usage: python benchmarks/trace_overlap.py [--top N] TRACE.json [TRACE.json ...]

For each trace: the GPU kernels (events of category `kernel`), split into communication (NCCL's
kernels: the name holds `nccl`) and computation (every other kernel). Printed: the step's span on the
GPU (first kernel start to last kernel end), the computation's busy time, the communication's busy
time, and how much of the communication's busy time has some computation kernel running at the same
moment (hidden) or none (exposed). Busy times are unions of intervals, so kernels on several streams
are not counted twice. Exposed communication is what a perfect overlap would remove from the step.
`--top N`: then, per trace, the N kernels (by name, cut at 60 characters) with the most GPU time, and
how many times each ran: two traces' lists side by side say where one step spends more.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

Interval = tuple[float, float]


def union(spans: list[Interval]) -> list[Interval]:
    """The union of intervals, as sorted disjoint intervals."""
    out: list[Interval] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(spans: list[Interval]) -> float:
    return sum(b - a for a, b in spans)


def intersect(xs: list[Interval], ys: list[Interval]) -> float:
    """The length of the intersection of two sorted disjoint interval lists."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            total += b - a
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def kernels(path: Path) -> list[dict[str, object]]:
    data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("cat") == "kernel" and "dur" in e]


def top(path: Path, n: int) -> list[tuple[str, float, int]]:
    """The n kernel names with the most GPU time: (name, ms, count)."""
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    for e in kernels(path):
        name = str(e.get("name", ""))[:60]
        total[name] = total.get(name, 0.0) + float(e["dur"])  # type: ignore[arg-type]
        count[name] = count.get(name, 0) + 1
    ranked = sorted(total, key=lambda k: -total[k])[:n]
    return [(k, total[k] / 1e3, count[k]) for k in ranked]


def overlap(path: Path) -> dict[str, float]:
    events = kernels(path)
    comm: list[Interval] = []
    comp: list[Interval] = []
    for e in events:
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))  # type: ignore[arg-type]
        (comm if "nccl" in str(e.get("name", "")).lower() else comp).append(span)
    if not comm and not comp:
        raise SystemExit(f"{path}: no GPU kernels in the trace")
    comm_u, comp_u = union(comm), union(comp)
    every = comm_u + comp_u
    hidden = intersect(comm_u, comp_u)
    return {
        "span_ms": (max(b for _, b in every) - min(a for a, _ in every)) / 1e3,
        "compute_ms": length(comp_u) / 1e3,
        "comm_ms": length(comm_u) / 1e3,
        "hidden_ms": hidden / 1e3,
        "exposed_ms": (length(comm_u) - hidden) / 1e3,
    }


def main() -> None:
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if args else 2)
    n = 0
    if args[0] == "--top":
        n, args = int(args[1]), args[2:]
    print("| trace | GPU span | compute | communication | hidden | exposed |")
    print("|---|---|---|---|---|---|")
    for name in args:
        r = overlap(Path(name))
        print(
            f"| {Path(name).name} | {r['span_ms']:.1f} ms | {r['compute_ms']:.1f} ms | {r['comm_ms']:.1f} ms"
            f" | {r['hidden_ms']:.1f} ms | {r['exposed_ms']:.1f} ms |"
        )

    for name in args if n else []:
        print(f"\n{Path(name).name}: the {n} kernels with the most GPU time")
        for k, ms, c in top(Path(name), n):
            print(f"  {ms:8.2f} ms {c:6d}x  {k}")


if __name__ == "__main__":
    main()
