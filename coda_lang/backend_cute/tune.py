"""Tile tuning on the GPU: time each stage's spill-free tile configs and remember the fastest.

What it does: `measure` times callables (one kernel launch each) with CUDA events after a warm-up,
taking the median of several timed batches, the configs taking turns batch by batch; `disk_key`, `lookup` and `store` keep the choice in
<cache>/tuning.json, keyed by the emitted epilogue's hash, the emitter and library versions, the GPU's
name and the GEMM shape (m, n, k): a second process reuses it without timing anything. cuda_block.py
decides when to tune (a stage's first launch at a shape) and which configs are candidates
(compile.configs_without_spills: the ptxas check first).
What it does not: compile or launch kernels itself, or tune anything under a torch.compile trace.
Invariants: the cache file is only ever replaced whole (written to a temporary file, then renamed);
an unreadable cache counts as empty.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from coda_lang.backend_cute.compile import TileConfig, library_versions
from coda_lang.backend_cute.emit import EMITTER_VERSION, cache_dir, source_hash

WARMUP = 3  # launches before timing (module load, first-touch of the inputs)
BATCH = 5  # launches per timed batch
BATCHES = 7  # timed rounds (one batch per config each); the median batch is kept


def cache_file() -> Path:
    return cache_dir() / "tuning.json"


def disk_key(source: str, shape: tuple[int, ...], device: str) -> str:
    key = {
        "source": source_hash(source),
        "emitter": EMITTER_VERSION,
        "libraries": library_versions(),
        "device": device,
        "shape": list(shape),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def _read() -> dict[str, Any]:
    try:
        data = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def lookup(key: str) -> TileConfig | None:
    entry = _read().get(key)
    if not isinstance(entry, dict) or not isinstance(entry.get("config"), dict):
        return None
    try:
        return TileConfig(**entry["config"])
    except TypeError:
        return None


def store(key: str, best: TileConfig, times: dict[TileConfig, float]) -> None:
    data = _read()
    data[key] = {
        "config": asdict(best),
        "ms": {
            c.short + ("" if c.pingpong else " coop") + f" {c.cluster_m}x{c.cluster_n}": round(t, 5)
            for c, t in times.items()
        },
    }
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


def measure(launches: dict[TileConfig, Callable[[], Any]]) -> dict[TileConfig, float]:
    """Milliseconds per launch of each callable: after a warm-up of each, BATCHES rounds in which every
    config times one batch of BATCH launches in turn (so that a drift of the GPU's clock or
    temperature during tuning falls on all configs alike, not on the ones timed last); the median
    batch of each is kept. A config whose launch raises is left out."""
    import torch

    live: dict[TileConfig, Callable[[], Any]] = {}
    for config, fn in launches.items():
        try:
            for _ in range(WARMUP):
                fn()
            torch.cuda.synchronize()
        except Exception:  # a tile this GPU or this shape can't run: not a candidate
            continue
        live[config] = fn
    batches: dict[TileConfig, list[float]] = {c: [] for c in live}
    for _ in range(BATCHES):
        for config, fn in list(live.items()):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            try:
                start.record()
                for _ in range(BATCH):
                    fn()
                end.record()
                end.synchronize()
            except Exception:
                del live[config], batches[config]
                continue
            batches[config].append(start.elapsed_time(end) / BATCH)
    return {c: sorted(b)[len(b) // 2] for c, b in batches.items()}
