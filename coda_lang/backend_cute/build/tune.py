"""Tile tuning on the GPU: time each stage's spill-free tile configs and remember the fastest.

What it does: `measure` times callables (one kernel launch each) with CUDA events after a warm-up,
taking the median of several timed batches, the configs taking turns batch by batch, and stops timing
a config once it is clearly slower (after EARLY_ROUNDS rounds, its fastest batch slower than the best
median by more than EARLY_MARGIN); `prune` orders the candidates by their times at the nearest GEMM
shape tuned before for the same kernel and GPU, and drops those that lost there by more than
PRUNE_MARGIN (keeping the KEEP fastest); `disk_key`, `lookup` and `store` keep the choice and every
config's time in <cache>/tuning.json, keyed by the emitted epilogue's hash, the emitter, kernel and
library versions, the GPU's name and the GEMM shape (m, n, k): a second process reuses it without
timing anything. `$CODA_TUNE=full` times every candidate to the end (no pruning, no early stop: the
exhaustive tuner, to compare with). `random_inputs` and `warm_block` run a block (and its autograd
backward) once on random CUDA inputs, which tunes every stage at those sizes (`coda tune`).
runtime/tuning.py decides when to tune (a stage's first launch at a shape) and which configs are
candidates (select.configs_without_spills: the ptxas check first).
What it does not: compile or launch kernels itself, or tune anything under a torch.compile trace.
Invariants: the cache file is only ever replaced whole (written to a temporary file, then renamed),
under a lock, so that processes storing at once lose no entry; an unreadable cache counts as empty.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from coda_lang.backend_cute.build.cache import kernel_fingerprint, library_versions
from coda_lang.backend_cute.build.config import TileConfig
from coda_lang.backend_cute.build.store import cache_dir, entry_lock, write_atomic
from coda_lang.backend_cute.plan.emit import EMITTER_VERSION, emit_stage, source_hash
from coda_lang.core.progress import Progress
from coda_lang.ir.types import extent
from coda_lang.ops.registry import torch_dtype

WARMUP = 3  # launches before timing (module load, first-touch of the inputs)
BATCH = 5  # launches per timed batch
BATCHES = 7  # timed rounds (one batch per config each); the median batch is kept
EARLY_ROUNDS = 3  # rounds every config times before any is dropped
EARLY_MARGIN = 0.15  # dropped when even its fastest batch is this much slower than the best median
NEAR = 2.0  # the farthest shape that counts as a neighbour: the sum of |log2| of the m, n, k ratios
PRUNE_MARGIN = 1.3  # dropped when it took this many times the best's time at the neighbouring shape
KEEP = 3  # candidates kept at least, whatever the neighbour says
HANG_S = 30.0  # a candidate's first launch not done on the GPU after this long hangs ($CODA_HANG_S)


class KernelHang(Exception):
    """A candidate's first launch did not finish within the hang limit: the GPU is stuck running it."""

    def __init__(self, config: TileConfig, seconds: float):
        super().__init__(f"tile {label(config)} did not finish within {seconds:g} s")
        self.config, self.seconds = config, seconds


def hang_limit() -> float:
    try:
        return max(0.1, float(os.environ.get("CODA_HANG_S", HANG_S)))
    except ValueError:
        return HANG_S


def in_background() -> bool:
    """Whether a first call compiles the tuner's candidates in the background (each stage runs at a
    tile compiled without spills until every kernel is built, then is timed): unless $CODA_TUNE is
    `wait` (compile and time everything before the first call returns) or `full`."""
    return os.environ.get("CODA_TUNE", "1") not in ("wait", "full")


def exhaustive() -> bool:
    """$CODA_TUNE=full: time every candidate to the end (no pruning by neighbours, no early stop)."""
    return os.environ.get("CODA_TUNE", "1") == "full"


def cache_file() -> Path:
    return cache_dir() / "tuning.json"


def versions() -> str:
    """The emitter, kernel and library versions a timing was made with (part of every key)."""
    v = {"emitter": EMITTER_VERSION, "coda": kernel_fingerprint(), "libraries": library_versions()}
    return hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:16]


def disk_key(source: str, shape: tuple[int, ...], device: str, variant: str | None = None) -> str:
    """The tuning cache's key of a stage's choice at a GEMM shape on a device; `variant`: a candidate
    set other than the default (an fp8 GEMM's with fast accumulation), kept apart from it."""
    key = {
        "source": source_hash(source),
        "emitter": EMITTER_VERSION,
        "coda": kernel_fingerprint(),
        "libraries": library_versions(),
        "device": device,
        "shape": list(shape),
        **({"variant": variant} if variant else {}),
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


def label(c: TileConfig) -> str:
    """A config as tuning.json's "ms" names it: 128x192e16 2x1, 256x128 coop 2x1, cublas."""
    if c.is_cublas:
        return "cublas"
    return c.short + ("" if c.pingpong else " coop") + f" {c.cluster_m}x{c.cluster_n}"


def store(
    key: str,
    best: TileConfig,
    times: dict[TileConfig, float],
    *,
    source: str | None = None,
    shape: tuple[int, ...] | None = None,
    device: str | None = None,
) -> None:
    """Record the choice at `key` (and every config's time; with `source`, `shape` and `device`, what
    `prune` needs to use them at a neighbouring shape)."""
    entry: dict[str, Any] = {
        "config": asdict(best),
        "ms": {label(c): round(t, 5) for c, t in times.items()},
        "times": [[asdict(c), round(t, 5)] for c, t in times.items()],
    }
    if source is not None and shape is not None and device is not None:
        entry.update(source=source_hash(source)[:32], shape=list(shape), device=device, versions=versions())
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with entry_lock(path.with_suffix(".lock")):  # read, add, replace: one process at a time
        data = _read()
        data[key] = entry
        write_atomic(path, json.dumps(data, indent=1, sort_keys=True))


def distance(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    """How far apart two GEMM shapes are: the sum over m, n, k of |log2(a/b)|."""
    return sum(abs(math.log2(max(x, 1) / max(y, 1))) for x, y in zip(a, b, strict=True))


def nearest(source: str, shape: tuple[int, ...], device: str) -> tuple[tuple[int, ...], dict] | None:
    """The times of the nearest other shape tuned for this kernel on this GPU with these versions,
    within NEAR: (its shape, {config: ms}), or None."""
    want, ver = source_hash(source)[:32], versions()
    best: tuple[float, tuple[int, ...], dict] | None = None
    for entry in _read().values():
        if not isinstance(entry, dict) or entry.get("source") != want or entry.get("device") != device:
            continue
        if entry.get("versions") != ver or not isinstance(entry.get("shape"), list):
            continue
        try:
            other = tuple(int(x) for x in entry["shape"])
            times = {TileConfig(**c): float(ms) for c, ms in entry["times"]}
        except (TypeError, ValueError, KeyError):
            continue
        if other == tuple(shape) or len(other) != len(shape):
            continue
        d = distance(other, tuple(shape))
        if d <= NEAR and (best is None or d < best[0]):
            best = (d, other, times)
    return None if best is None else (best[1], best[2])


def prune(
    configs: list[TileConfig], source: str, shape: tuple[int, ...], device: str
) -> tuple[list[TileConfig], str]:
    """`configs` to time at `shape`: ordered by their times at the nearest shape tuned before (configs
    not timed there first), without those that took more than PRUNE_MARGIN times the best's time there
    (the KEEP fastest always stay); and a note saying what was dropped ("" when nothing was)."""
    near = None if exhaustive() else nearest(source, shape, device)
    if near is None:
        return list(configs), ""
    other, times = near
    known = [times[c] for c in configs if c in times]
    if not known:
        return list(configs), ""
    best = min(known)
    keep: list[TileConfig] = []
    dropped: list[TileConfig] = []
    for c in sorted(configs, key=lambda c: times.get(c, -1.0)):
        t = times.get(c)
        if t is None or t <= best * PRUNE_MARGIN or len(keep) < KEEP:
            keep.append(c)
        else:
            dropped.append(c)
    if not dropped:
        return keep, ""
    at = "x".join(map(str, other))
    return keep, f"{len(dropped)} of {len(configs)} skipped (over {PRUNE_MARGIN}x the best at {at})"


def measure(
    launches: dict[TileConfig, Callable[[], Any]],
    *,
    early: bool | None = None,
    progress: Progress | None = None,
) -> dict[TileConfig, float]:
    """Milliseconds per launch of each callable: after a warm-up of each, BATCHES rounds in which every
    config times one batch of BATCH launches in turn (so that a drift of the GPU's clock or
    temperature during tuning falls on all configs alike, not on the ones timed last); the median
    batch of each is kept. A config whose launch raises is left out. `early` (default: unless
    $CODA_TUNE=full): after EARLY_ROUNDS rounds, a config whose fastest batch is slower than the best
    median so far by more than EARLY_MARGIN is timed no more (its median so far is its time).
    `progress` advances by one per batch timed (or skipped)."""
    import torch

    if early is None:
        early = not exhaustive()
    live: dict[TileConfig, Callable[[], Any]] = {}
    limit = hang_limit()
    for config, fn in launches.items():
        try:
            _first_launch(fn, config, limit)
            for _ in range(WARMUP - 1):
                fn()
            torch.cuda.synchronize()
        except KernelHang:
            raise
        except Exception:  # a tile this GPU or this shape can't run: not a candidate
            if progress:
                progress.add_total(-BATCHES)
            continue
        live[config] = fn
    batches: dict[TileConfig, list[float]] = {c: [] for c in live}
    for round_ in range(BATCHES):
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
                if progress:
                    progress.add_total(-(BATCHES - round_))
                continue
            batches[config].append(start.elapsed_time(end) / BATCH)
            if progress:
                progress.advance(what=label(config))
        if early and round_ + 1 >= EARLY_ROUNDS and len(live) > 1:
            best = min(_median(batches[c]) for c in live)
            for c in [c for c in live if min(batches[c]) > best * (1 + EARLY_MARGIN)]:
                del live[c]
                if progress:
                    progress.add_total(-(BATCHES - round_ - 1))
    return {c: _median(b) for c, b in batches.items() if b}


def _first_launch(fn: Callable[[], Any], config: TileConfig, limit: float) -> None:
    """Launch once and wait for it, polling, at most `limit` seconds (KernelHang after that: a kernel
    can't be stopped, but the caller can say which tile hung instead of waiting for ever)."""
    import time

    import torch

    fn()
    done = torch.cuda.Event()
    done.record()
    start, pause = time.monotonic(), 1e-4
    while not done.query():
        if time.monotonic() - start > limit:
            raise KernelHang(config, limit)
        time.sleep(pause)
        pause = min(2 * pause, 0.05)


def _hung_key(source: str, device: str) -> str:
    return "hung:" + disk_key(source, (), device)


def hung(source: str, device: str) -> set[TileConfig]:
    """The tiles of this kernel that hung on this GPU before (store_hung): never tried again."""
    entry = _read().get(_hung_key(source, device), {})
    found = set()
    for c in entry.get("configs", []) if isinstance(entry, dict) else []:
        try:
            found.add(TileConfig(**c))
        except TypeError:
            continue
    return found


def store_hung(source: str, device: str, config: TileConfig) -> None:
    """Record that `config` of this kernel hung on this GPU (at any shape: it is not tried again)."""
    key = _hung_key(source, device)
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    with entry_lock(path.with_suffix(".lock")):
        data = _read()
        old = data.get(key, {})
        configs = old.get("configs", []) if isinstance(old, dict) else []
        if asdict(config) not in configs:
            configs.append(asdict(config))
        data[key] = {"configs": configs, "device": device, "source": source_hash(source)[:32]}
        write_atomic(path, json.dumps(data, indent=1, sort_keys=True))


def _median(b: list[float]) -> float:
    return sorted(b)[len(b) // 2]


# ------------------------------------------------------------------------------------------------
# `coda tune`: run a block once on random inputs at given sizes, which tunes every stage there.


def random_inputs(block_ir: Any, dims: dict[str, int], device: Any, seed: int = 0) -> dict[str, Any]:
    """Random CUDA inputs of a block at `dims`, as interp.random_inputs makes them (GEMM weights scaled
    by 1/sqrt(K), i32 indices within the range they index), made on the device."""
    import torch

    # lazy: imports NumPy, which `coda check` and `import coda_lang` never load
    from coda_lang.interp.inputs import (
        input_scales,
    )

    gen = torch.Generator(device=device).manual_seed(seed)
    rhs, pick_range = input_scales(block_ir)
    out: dict[str, Any] = {}
    for p in block_ir.params:
        t = p.var.type
        if p.default is not None:
            continue
        shape = tuple(extent(d, dims) for d in t.shape)
        if t.dtype == "i32":
            hi = extent(pick_range[p.var.name], dims) if p.var.name in pick_range else 100
            out[p.var.name] = torch.randint(0, hi, shape, generator=gen, device=device, dtype=torch.int32)
            continue
        x = torch.randn(shape, generator=gen, device=device)
        if p.var.name in rhs:
            x /= math.sqrt(max(extent(rhs[p.var.name], dims), 1))
        out[p.var.name] = x.to(torch_dtype(t.dtype))
    return out


def tuned(cb: Any) -> list[tuple[int, tuple[int, int, int], TileConfig]]:
    """(stage, GEMM shape m x n x k, tile) of every stage a CudaBlock has tuned, in stage order."""
    rows = [(k, (m, n, kk), r.config) for (k, m, n, kk), r in cb.tuner.by_shape.items()]
    return sorted(rows, key=lambda row: (row[0], row[1]))


def times_of(cb: Any, k: int, shape: tuple[int, int, int]) -> dict[str, float]:
    """The times tuning.json holds for stage k of a CudaBlock at a GEMM shape, by config label."""
    import torch

    spec = cb.specs[k - 1]
    entry = _read().get(disk_key(emit_stage(spec), shape, torch.cuda.get_device_name()))
    ms = entry.get("ms") if isinstance(entry, dict) else None
    return {str(a): float(b) for a, b in ms.items()} if isinstance(ms, dict) else {}


def warm_block(target: Any, dims: dict[str, int], *, seed: int = 0) -> None:
    """Run `target` (a CudaBlock, or a CudaFunction: then its backward too, on a random cotangent) once
    on random CUDA inputs at `dims`, which compiles and tunes every stage at those sizes."""
    import torch

    device = torch.device("cuda")
    ins = random_inputs(target.ir, dims, device, seed)
    if not hasattr(target, "backward"):
        target(ins, dims=dims)
        torch.cuda.synchronize()
        return
    for v in ins.values():
        if v.is_floating_point():
            v.requires_grad_(True)
    outs = target(ins, dims=dims)
    floats = [o for o in outs.values() if o.is_floating_point() and o.requires_grad]
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    torch.autograd.backward(
        floats, [torch.randn(o.shape, generator=gen, device=device).to(o.dtype) for o in floats]
    )
    torch.cuda.synchronize()
