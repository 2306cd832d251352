"""Compile many kernels at once: the candidate tiles of every stage of one or more blocks, in worker
processes.

What it does: `warm(requests, jobs=...)` fills the kernel cache (compile.py) with what later calls of
`compile_spec` will ask for, so that those only read it. Each `Request` is a stage and its candidate
tiles: all of them, or (`first=True`) in order up to the first whose kernel has no spills, as
select_config tries them (the next is compiled only once the one before is known to spill or to be
refused). What the cache already knows (compiled, checked by ptxas, spilling or refused) costs
nothing; the rest is compiled and checked in `jobs` worker processes, or, with one job, here. A worker
runs compile.compile_spec itself, so a kernel is built the same way either way, under the cache's
lock per entry (two processes never build one kernel twice). Workers are spawned, not forked (a
child must not inherit CuTeDSL's MLIR state or a CUDA context), import only compile.py and
quack_adapter, and hide every GPU (`CUDA_VISIBLE_DEVICES=`). `default_jobs`: the CPUs this process
may use, at most one worker per WORKER_BYTES of available memory, at most one per kernel ($CODA_JOBS
overrides). A progress display (coda_lang.progress) shows done/total and the time left.
What it does not: choose a tile (compile.select_config, tune.py) or raise a kernel's error: a kernel
quack refuses, or one whose worker failed, is left to the caller's compile_spec, which gives its
error (from the refusal record, or by compiling it here).
Invariants: the caller's __main__ is never re-run in a worker (it is masked while workers start:
a training script without a main guard is safe); a pool that can't start (a daemonic process, such
as a DataLoader worker) or breaks (a worker killed) compiles the rest here; the toolchain missing
stops the work at once (the caller's compile raises BackendUnavailable).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import sys
import time
import types
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from coda_lang.backend_cute.compile import BackendUnavailable, Kernel, TileConfig, compile_spec, fits
from coda_lang.backend_cute.emit import cache_dir, emit_stage
from coda_lang.backend_cute.spec import StageSpec
from coda_lang.interp.inputs import available_memory
from coda_lang.progress import Progress
from coda_lang.verify.diagnostics import CodaError

# A compile worker's peak memory, rounded up: torch, CuTeDSL and quack imported and one kernel
# compiled take about 0.7 GB (measured on llama_mlp's forward and backward stages).
WORKER_BYTES = 1 << 30


@dataclass(frozen=True)
class Request:
    """A stage and the tiles to have compiled for it: all of `configs` (those that fit the stage), or
    (`first`) in order up to the first without spills."""

    spec: StageSpec
    configs: tuple[TileConfig, ...]
    first: bool = False


@dataclass
class Warmed:
    """What `warm` did: kernels found in the cache, compiled (of which spilling, refused or failed),
    the number of worker processes (0: compiled here), and the seconds it took."""

    cached: int = 0
    compiled: int = 0
    spills: int = 0
    refused: int = 0
    failed: int = 0
    jobs: int = 0
    seconds: float = 0.0
    built: set[Path] = field(default_factory=set)  # the PTX paths of the kernels compiled


def cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def default_jobs(work: int | None = None) -> int:
    """Worker processes for `work` kernels: $CODA_JOBS if set, else the CPUs this process may use,
    at most one per WORKER_BYTES of available memory; never more than the work, never fewer than 1."""
    n = 0
    env = os.environ.get("CODA_JOBS", "")
    if env.isdigit() and int(env) > 0:
        n = int(env)
    else:
        n = min(cpus(), max(1, available_memory() // WORKER_BYTES))
    if work is not None:
        n = min(n, work)
    return max(1, n)


@contextlib.contextmanager
def _neutral_main() -> Iterator[None]:
    """Hide the caller's __main__ while workers start: a spawned child re-runs the parent's main
    script to rebuild it (multiprocessing's preparation), and our tasks never need it."""
    real = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if real is not None:
            sys.modules["__main__"] = real


def _daemon() -> bool:
    return bool(multiprocessing.current_process().daemon)


def _init_worker() -> None:
    """A compile worker: no GPU (no CUDA context, no driver queries), no progress lines, and the heavy
    imports paid once, at start."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["CODA_PROGRESS"] = "0"
    with contextlib.suppress(BackendUnavailable):
        from coda_lang.backend_cute.compile import _adapter

        _adapter()
    # At exit, skip the interpreter's teardown of torch and CuTeDSL (a second or more a worker): every
    # file a worker writes is complete when its task returns. (Registered last, so it runs first.)
    atexit.register(_exit_now)


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def build(spec: StageSpec, config: TileConfig, root: str) -> tuple[str, bool]:
    """Compile and check one kernel into the cache at `root` (in a worker, or here): its status, "ok",
    "spills" or "refused" (quack refused it, or the emitter can't write the stage: the caller's compile
    says why), and whether it was compiled here (not found in the cache, built by another process
    while this one waited for the entry's lock)."""
    try:
        c = compile_spec(spec, config, directory=Path(root))
    except CodaError as e:
        return "refused", bool(e.__cause__)  # (a refusal re-read from its record has no cause)
    assert c.report is not None
    return ("spills" if c.report.spills else "ok"), not c.cached


def _describe(spec: StageSpec, config: TileConfig) -> str:
    return f"{spec.block} stage {spec.index} at {config.short}"


def warm(
    requests: Sequence[Request],
    *,
    jobs: int | None = None,
    directory: Path | None = None,
    label: str = "coda: compiling kernels",
    quiet: bool = False,
    stream: TextIO | None = None,
) -> Warmed:
    """Compile what the cache lacks for `requests` (see the module docstring); `jobs`: worker
    processes (None: default_jobs; 1: in this process)."""
    t0 = time.monotonic()
    root = directory or cache_dir()
    stats = Warmed()
    queues = [deque(c for c in r.configs if fits(r.spec, c)) for r in requests]
    sources: dict[int, str] = {}
    status: dict[str, str] = {}  # kernel key -> "ok" | "spills" | "refused" | "failed"
    todo: deque[Kernel] = deque()  # kernels to build, in the order they were found
    queued: set[str] = set()
    waiting: dict[str, list[int]] = {}  # kernel key -> first-mode requests waiting for its status

    def kernel(spec: StageSpec, config: TileConfig) -> Kernel:
        src = sources.get(id(spec))
        if src is None:
            src = sources[id(spec)] = emit_stage(spec)
        return Kernel(spec, config, root, source=src)

    def advance(i: int) -> None:
        """Queue request i's next kernels: all it lacks, or (first) up to one not known yet."""
        r, q = requests[i], queues[i]
        while q:
            try:
                k = kernel(r.spec, q.popleft())
            except CodaError:  # the emitter can't write this stage: the caller's compile says so
                q.clear()
                return
            st = status.get(k.key)
            if st is None and k.key not in queued:
                st = k.status()
                if st is not None:
                    status[k.key] = st
                    stats.cached += 1
            if st is None:
                if k.key not in queued:
                    queued.add(k.key)
                    todo.append(k)
                if r.first:
                    waiting.setdefault(k.key, []).append(i)
                    return
                continue
            if r.first and st == "ok":
                q.clear()

    def finish(k: Kernel, result: tuple[str, bool]) -> None:
        st, compiled = result
        status[k.key] = st
        if compiled:
            stats.compiled += 1
            stats.built.add(k.ptx_path)
        elif st != "failed":
            stats.cached += 1
        stats.spills += st == "spills"
        stats.refused += st == "refused"
        stats.failed += st == "failed"
        for i in waiting.pop(k.key, []):
            if st == "ok":
                queues[i].clear()
            else:
                advance(i)

    for i in range(len(requests)):
        advance(i)
    if not todo:
        stats.seconds = time.monotonic() - t0
        return stats
    n = jobs if jobs is not None else default_jobs(len(todo) + sum(len(q) for q in queues))
    n = max(1, n)
    progress = Progress(label, len(todo), unit="kernels", quiet=quiet, stream=stream)
    try:
        # (a daemonic process, e.g. a DataLoader worker, may not start processes: compile here)
        if n >= 2 and len(todo) + sum(len(q) for q in queues) >= 2 and not _daemon():
            stats.jobs = n
            progress.extra = f"{n} workers"
            _run_pool(n, root, todo, finish, progress)
        while todo:  # one job, or what a broken pool left
            k = todo.popleft()
            progress.doing(_describe(k.spec, k.config))
            before = len(todo)
            finish(k, build(k.spec, k.config, str(root)))
            progress.add_total(len(todo) - before)
            progress.advance()
    except BackendUnavailable:
        pass  # the caller's own compile says so
    finally:
        progress.close()
    stats.seconds = time.monotonic() - t0
    return stats


def _run_pool(
    n: int,
    root: Path,
    todo: deque[Kernel],
    finish: Callable[[Kernel, tuple[str, bool]], None],
    progress: Progress,
) -> None:
    """Build `todo` (and what finishing its kernels adds to it) in n spawned workers; on a broken pool,
    return with the unfinished kernels back in `todo`."""
    ctx = multiprocessing.get_context("spawn")
    ex = ProcessPoolExecutor(max_workers=n, mp_context=ctx, initializer=_init_worker)
    running: dict[Future[tuple[str, bool]], Kernel] = {}

    def submit_all() -> None:
        with _neutral_main():
            while todo:
                k = todo[0]
                running[ex.submit(build, k.spec, k.config, str(root))] = k
                todo.popleft()

    try:
        try:
            submit_all()
        except (OSError, RuntimeError, AssertionError):  # no worker could start: compile here
            todo.extendleft(reversed(list(running.values())))
            running.clear()
            return
        while running:
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for f in done:
                k = running.pop(f)
                try:
                    st = f.result()
                except BrokenProcessPool:
                    todo.extendleft(reversed([k, *running.values()]))
                    running.clear()
                    return
                except BackendUnavailable:
                    todo.clear()
                    raise
                except Exception:  # this kernel failed in its worker: the caller compiles it again
                    st = ("failed", False)
                before = len(todo)
                finish(k, st)
                progress.add_total(len(todo) - before)
                progress.advance(what=_describe(k.spec, k.config))
            submit_all()
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
