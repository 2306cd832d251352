"""What is alive on the GPU at a training step's peak, by where it was allocated.

For each configuration (benchmarks/hf_train_step.py's names: coda, coda-fp8, liger, ...), in one
process: the model built and prepared as hf_train_step.py does, two warm-up steps, then one step
recorded with torch's allocator history (`torch.cuda.memory._record_memory_history`, on from before
the model is built, so that every block has its allocating stack). The recorded events are replayed
to find the instant the step's allocated bytes peak, and the blocks alive then, and those alive when
the step began, are grouped by the innermost frame of the allocating stack that is in coda_lang, transformers,
torch.optim or this repository's benchmarks (else the innermost frame). Prints, per configuration,
the peak and the largest groups; `--json` writes them.

    python benchmarks/memory_peak.py --configs coda,coda-fp8 --top 20
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_train_step as hts  # noqa: E402

OURS = ("coda_lang", "transformers", "torch/optim", "benchmarks", "liger_kernel", "torchao")


def where(frames: list[dict[str, Any]]) -> str:
    """The allocating stack's innermost frame in code we can name (frames: innermost first)."""
    for f in frames:
        name = f.get("filename", "")
        if any(s in name for s in OURS) and "memory_peak" not in name:
            short = name[name.find("coda_lang") :] if "coda_lang" in name else name.rsplit("/", 2)[-1]
            return f"{short}:{f.get('line')} {f.get('name')}"
    return f"{frames[0].get('filename', '?')}:{frames[0].get('line')}" if frames else "?"


def replay(trace: list[dict[str, Any]], start: int) -> tuple[int, dict[str, int], dict[str, int]]:
    """From one device's allocator trace (recorded since before the model was built; the step's events
    from index `start`): (the step's peak bytes, {site: bytes alive at the peak}, {site: bytes alive
    when the step began})."""
    alive: dict[int, tuple[int, str]] = {}
    now = peak = 0
    before: dict[int, tuple[int, str]] = {}
    at_peak: dict[int, tuple[int, str]] = {}
    for i, e in enumerate(trace):
        if i == start:
            before, peak, at_peak = dict(alive), now, dict(alive)
        a = e["action"]
        if a == "alloc":
            alive[e["addr"]] = (e["size"], where(e.get("frames", [])))
            now += e["size"]
            if i >= start and now > peak:
                peak, at_peak = now, dict(alive)
        elif a == "free_completed" and e["addr"] in alive:
            now -= alive.pop(e["addr"])[0]
    if start >= len(trace):  # (a step that recorded no event: its peak is what it began with)
        before, peak, at_peak = dict(alive), now, dict(alive)
    return peak, grouped(at_peak), grouped(before)


def grouped(blocks: dict[int, tuple[int, str]]) -> dict[str, int]:
    groups: dict[str, int] = {}
    for size, site in blocks.values():
        groups[site] = groups.get(site, 0) + size
    return groups


def top(groups: dict[str, int], n: int) -> list[dict[str, Any]]:
    return [{"site": s, "gib": b / 2**30} for s, b in sorted(groups.items(), key=lambda kv: -kv[1])[:n]]


def measure(name: str, args: argparse.Namespace, ids: torch.Tensor) -> dict[str, Any]:
    torch.cuda.memory._record_memory_history(max_entries=4_000_000)
    model, _ = hts.build(name, args.layers, args.family)
    _, step = hts.training_step(model, hts.prepare(model, name, args.family), ids)
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    dev = torch.cuda.current_device()
    start = len(torch.cuda.memory._snapshot()["device_traces"][dev])
    step()
    torch.cuda.synchronize()
    trace = torch.cuda.memory._snapshot()["device_traces"][dev]
    torch.cuda.memory._record_memory_history(enabled=None)
    if len(trace) >= 4_000_000:
        raise SystemExit("memory_peak.py: the allocator's history overflowed its ring; fewer --layers")
    peak, at_peak, before = replay(trace, start)
    return {
        "config": name,
        "peak_gib": peak / 2**30,
        "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "before_gib": sum(before.values()) / 2**30,
        "at_peak": top(at_peak, args.top),
        "before": top(before, args.top),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="coda,coda-fp8")
    ap.add_argument("--family", default="llama")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("memory_peak.py needs a CUDA GPU")
    torch.manual_seed(0)
    vocab = hts.family_config(args.family, args.layers).vocab_size
    ids = torch.randint(0, vocab, (1, args.seq), device="cuda")
    rows = []
    for name in args.configs.split(","):
        r = measure(name, args, ids)
        gc.collect()
        torch.cuda.empty_cache()
        rows.append(r)
        print(f"\n{name}: peak {r['peak_gib']:.3f} GiB (max allocated {r['max_allocated_gib']:.3f} GiB)")
        for g in r["at_peak"]:
            print(f"  {g['gib']:7.3f} GiB  {g['site']}")
        print(f"{name}: alive when the step began {r['before_gib']:.3f} GiB")
        for g in r["before"]:
            print(f"  {g['gib']:7.3f} GiB  {g['site']}")
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
