"""Compile many kernels at once: the candidate tiles of every stage of one or more blocks, in worker
processes.

What it does: `warm(requests, jobs=...)` fills the kernel cache (compile.py) with what later calls of
`compile_spec` will ask for, so that those only read it. Each `Request` is a stage and its candidate
tiles: all of them, or (`first=True`) in order up to the first whose kernel has no spills, as
select_config tries them (the next is compiled only once the one before is known to spill or to be
refused). What the cache already knows (compiled, checked by ptxas, spilling or refused) costs
nothing; the rest is compiled and checked in `jobs` worker processes, or, with one job, here. A worker
runs compile.compile_spec itself, so a kernel is built the same way either way, under the cache's
lock per entry (two processes never build one kernel twice). Several processes compiling at once (the
ranks of a job on one host) share the work: a kernel whose entry another process is building is put
back at the end of the queue (BUSY) while the worker builds another; it is finished as soon as the
cache holds it, or built, waiting for the other process, when nothing else is left. Workers are
spawned, not forked (a child must not inherit CuTeDSL's MLIR state or a CUDA context), import only
compile.py and quack_adapter, hide every GPU (`CUDA_VISIBLE_DEVICES=`) and end with the process that
started them, however it ends (core/orphans.py). `default_jobs`: the CPUs this process may use, at
most one worker per WORKER_BYTES of available memory, divided among this host's ranks
($LOCAL_WORLD_SIZE), at most one per kernel ($CODA_JOBS overrides). A progress display
(coda_lang.core.progress) shows done/total and the time left.
`background=True` queues each stage's first kernel, then each one's second, and so on, returns as
soon as every `first` request has its tile or its stage any kernel without spills (each stage can
run), and leaves the rest compiling: a `Background` says which emitted stages still have kernels on the way
(the tuner waits for them before timing that stage) and cancels what is left when the process exits.
Workers run at a lower priority (nice) than the process that started them, so that its GPU work and
timings keep their CPU.
What it does not: choose a tile (select.select_config, tune.py) or raise a kernel's error: a kernel
quack refuses, or one whose worker failed, is left to the caller's compile_spec, which gives its
error (from the refusal record, or by compiling it here).
Invariants: the caller's __main__ is never re-run in a worker (it is masked while workers start:
a training script without a main guard is safe); a pool that can't start (a daemonic process, such
as a DataLoader worker) or breaks (a worker killed) compiles the rest here; the toolchain missing
stops the work at once (the caller's compile raises BackendUnavailable). In the background, only a
thread of this process touches the schedule, and a broken pool leaves what it did not build to the
caller's compile (nothing is compiled in this process from a background thread).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import multiprocessing
import os
import sys
import threading
import time
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from coda_lang.backend_cute.build.cache import Kernel
from coda_lang.backend_cute.build.compile import _adapter, compile_spec
from coda_lang.backend_cute.build.config import TileConfig, fits
from coda_lang.backend_cute.build.ptxas import BackendUnavailable
from coda_lang.backend_cute.build.store import EntryBusy, cache_dir, checked
from coda_lang.backend_cute.plan.emit import emit_stage, source_hash
from coda_lang.backend_cute.plan.spec import StageSpec
from coda_lang.core.diagnostics import CodaError
from coda_lang.core.orphans import die_with_parent
from coda_lang.core.progress import Progress
from coda_lang.interp.inputs import available_memory

# A compile worker's peak memory, rounded up: torch, CuTeDSL and quack imported and one kernel
# compiled take about 0.7 GB (measured on llama_mlp's forward and backward stages).
WORKER_BYTES = 1 << 30
WORKER_NICE = 10  # how much lower a compile worker's CPU priority is than its parent's


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
    background: Background | None = None  # what still compiles (warm(..., background=True))


_LIVE: weakref.WeakSet[Background] = weakref.WeakSet()  # every Background whose work may be going on


def wait_all(timeout: float | None = None) -> bool:
    """Block until every compile this process left in the background has finished (False when
    `timeout` seconds passed first)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for bg in list(_LIVE):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not bg.wait(timeout=left):
            return False
    return True


class Background:
    """Kernels still compiling after `warm(..., background=True)` returned. `pending(source)`: whether
    an emitted stage (its source text) still has kernels on the way; `wait(source)` blocks until it has
    none (`wait()`: until nothing is left); `cancel()` stops the work (its workers are ended: every
    cache entry is written whole or not at all). Safe to call from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._left: dict[str, int] = {}  # source hash -> kernels of it not finished
        self._over = False
        self._cancel: Callable[[], None] | None = None
        _LIVE.add(self)

    def _add(self, sources: set[str]) -> None:
        with self._lock:
            for h in sources:
                self._left[h] = self._left.get(h, 0) + 1

    def _finished(self, sources: set[str]) -> None:
        with self._changed:
            for h in sources:
                self._left[h] -= 1
                if self._left[h] <= 0:
                    del self._left[h]
            self._changed.notify_all()

    def _end(self) -> None:
        with self._changed:
            self._over = True
            self._left.clear()
            self._changed.notify_all()

    @property
    def over(self) -> bool:
        with self._lock:
            return self._over

    def pending(self, source: str) -> bool:
        with self._lock:
            return source_hash(source) in self._left

    def wait(self, source: str | None = None, timeout: float | None = None) -> bool:
        """Block until `source` (None: everything) has nothing left to compile; False on timeout."""
        h = None if source is None else source_hash(source)
        with self._changed:
            return self._changed.wait_for(lambda: self._over if h is None else h not in self._left, timeout)

    def cancel(self) -> None:
        fn = self._cancel
        if fn is not None:
            fn()
        self._end()


def cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def local_processes() -> int:
    """The processes of this job on this host, which compile the same kernels at the same time:
    $LOCAL_WORLD_SIZE (torchrun's and Accelerate's ranks per host), else 1."""
    env = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(env) if env.isascii() and env.isdigit() and int(env) > 0 else 1


def default_jobs(work: int | None = None) -> int:
    """Worker processes for `work` kernels: $CODA_JOBS if set, else the CPUs this process may use,
    at most one per WORKER_BYTES of available memory, shared by this host's ranks (`local_processes`:
    each rank of a 4-rank job takes a quarter; they split the kernels by the entries' locks); never
    more than the work, never fewer than 1."""
    n = 0
    env = os.environ.get("CODA_JOBS", "")
    if env.isdigit() and int(env) > 0:
        n = int(env)
    else:
        n = min(cpus(), max(1, available_memory() // WORKER_BYTES)) // local_processes()
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


def _init_worker(parent: int) -> None:
    """A compile worker: it ends with `parent`, the process that started it, however that one ends
    (core/orphans.py: a worker holds about 0.7 GB); no GPU (no CUDA context, no driver queries), no
    progress lines, and the heavy imports paid once, at start."""
    die_with_parent(parent)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["CODA_PROGRESS"] = "0"
    with contextlib.suppress(AttributeError, OSError):
        os.nice(WORKER_NICE)  # the starting process's GPU work and timings keep their CPU
    with contextlib.suppress(BackendUnavailable):
        _adapter()
    # At exit, skip the interpreter's teardown of torch and CuTeDSL (a second or more a worker): every
    # file a worker writes is complete when its task returns. (Registered last, so it runs first.)
    atexit.register(_exit_now)


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


BUSY = "busy"  # build's status of a kernel another process is building (not waited for)


class _Queue(deque[Kernel]):
    """The kernels to build, and (`busy`) those found being built by another process once: tried again
    at the back of the queue, then waiting for that process."""

    def __init__(self) -> None:
        super().__init__()
        self.busy: set[str] = set()


def build(spec: StageSpec, config: TileConfig, root: str, wait: bool = True) -> tuple[str, bool]:
    """Compile and check one kernel into the cache at `root` (in a worker, or here): its status, "ok",
    "spills" or "refused" (quack refused it, or the emitter can't write the stage: the caller's compile
    says why), and whether it was compiled here (not found in the cache, built by another process
    while this one waited for the entry's lock). `wait=False`: BUSY when another process is building
    it (this worker builds another kernel meanwhile)."""
    try:
        c = compile_spec(spec, config, directory=Path(root), wait=wait)
    except EntryBusy:
        return BUSY, False
    except CodaError as e:
        return "refused", bool(e.__cause__)  # (a refusal re-read from its record has no cause)
    assert c.report is not None
    return ("spills" if c.report.spills else "ok"), not c.cached


def _busy(todo: deque[Kernel]) -> set[str]:
    return todo.busy if isinstance(todo, _Queue) else set()


def _later(todo: deque[Kernel], k: Kernel) -> None:
    """`k`, found busy: to the back of the queue, to be built (waiting for the other process) then."""
    todo.append(k)
    _busy(todo).add(k.key)


def _wait_for(todo: deque[Kernel], k: Kernel) -> bool:
    """Whether `k` was found busy once (its next build waits for the other process)."""
    return k.key in _busy(todo)


def _finish_busy(
    todo: deque[Kernel], finish: Callable[[Kernel, tuple[str, bool]], None], progress: Progress
) -> None:
    """The queued busy kernels that the other process has built by now, finished without a worker."""
    busy = _busy(todo)
    for k in [k for k in todo if k.key in busy]:
        st = k.status()
        if st is not None:
            todo.remove(k)
            busy.discard(k.key)
            before = len(todo)
            finish(k, (st, False))
            progress.add_total(len(todo) - before)
            progress.advance(what=_describe(k.spec, k.config))


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
    background: bool = False,
) -> Warmed:
    """Compile what the cache lacks for `requests` (see the module docstring); `jobs`: worker
    processes (None: default_jobs; 1: in this process). `background`: return once every `first`
    request has its tile or its stage any kernel without spills, the rest compiling on (`Warmed.background`; with one job, or where no
    worker can start, everything is compiled before returning)."""
    t0 = time.monotonic()
    root = checked(directory) if directory is not None else cache_dir()  # (OSError: unusable, said now)
    stats = Warmed()
    queues = [deque(c for c in r.configs if fits(r.spec, c)) for r in requests]
    sources: dict[int, str] = {}
    status: dict[str, str] = {}  # kernel key -> "ok" | "spills" | "refused" | "failed"
    todo: deque[Kernel] = _Queue()  # kernels to build, in the order they were found
    queued: set[str] = set()
    waiting: dict[str, list[int]] = {}  # kernel key -> first-mode requests waiting for its status
    bg = Background() if background else None
    ok: set[str] = set()  # the stages (source hashes) with a kernel without spills

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
                    if st == "ok":
                        ok.add(source_hash(k.source))
            if st is None:
                if k.key not in queued:
                    queued.add(k.key)
                    todo.append(k)
                    if bg is not None:
                        bg._add({source_hash(k.source)})
                if r.first:
                    if started:  # a first tile spilled: its stage's next one goes ahead of the rest
                        promote(k.key)
                    waiting.setdefault(k.key, []).append(i)
                    return
                continue
            if r.first and st == "ok":
                q.clear()

    def promote(key: str) -> None:
        """Move a queued kernel not submitted yet to the front of the queue."""
        for j, k in enumerate(todo):
            if k.key == key:
                del todo[j]
                todo.appendleft(k)
                return

    def finish(k: Kernel, result: tuple[str, bool]) -> None:
        st, compiled = result
        status[k.key] = st
        if st == "ok":
            ok.add(source_hash(k.source))
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
        if bg is not None:  # (last: a first request's next tile of this stage is queued by now)
            bg._finished({source_hash(k.source)})

    # the first requests' kernels first: with the work in the background, those are what a call waits for
    started = False
    for i in sorted(range(len(requests)), key=lambda i: not requests[i].first):
        advance(i)
    started = True
    if bg is not None:  # each stage's first kernel, then each one's second, ...: every stage soon has one
        by_stage: dict[str, list[Kernel]] = {}
        for k in todo:
            by_stage.setdefault(source_hash(k.source), []).append(k)
        interleaved = [k for rank in itertools.zip_longest(*by_stage.values()) for k in rank if k is not None]
        todo.clear()
        todo.extend(interleaved)
    if not todo:
        stats.seconds = time.monotonic() - t0
        return stats
    work = len(todo) + sum(len(q) for q in queues)
    n = max(1, jobs if jobs is not None else default_jobs(work))
    # (a daemonic process, e.g. a DataLoader worker, may not start processes: compile here)
    pool = n >= 2 and work >= 2 and not _daemon()
    progress = Progress(label, len(todo), unit="kernels", quiet=quiet, stream=stream)
    if bg is not None and pool:
        n = min(n, len(todo))
        firsts = {
            i: source_hash(sources[id(r.spec)]) for i, r in enumerate(requests) if id(r.spec) in sources
        }

        def ready() -> bool:
            """Every stage has a tile to run at: its first request's, or any without spills."""
            unresolved = {i for waiters in waiting.values() for i in waiters}
            return all(firsts[i] in ok for i in unresolved)

        return _warm_in_background(n, root, todo, finish, progress, stats, bg, ready, t0)
    try:
        if pool:
            stats.jobs = n
            progress.extra = f"{n} workers"
            _run_pool(n, root, todo, finish, progress)
        _build_here(root, todo, finish, progress)  # one job, or what a broken pool left
    except BackendUnavailable:
        pass  # the caller's own compile says so
    finally:
        progress.close()
        if bg is not None:
            bg._end()
    stats.seconds = time.monotonic() - t0
    return stats


def _build_here(
    root: Path,
    todo: deque[Kernel],
    finish: Callable[[Kernel, tuple[str, bool]], None],
    progress: Progress,
) -> None:
    """Build `todo` (and what finishing its kernels adds to it) in this process, one after another."""
    while todo:
        k = todo.popleft()
        progress.doing(_describe(k.spec, k.config))
        st = build(k.spec, k.config, str(root), _wait_for(todo, k))
        if st[0] == BUSY:  # another process builds it: another kernel first
            _later(todo, k)
            continue
        before = len(todo)
        finish(k, st)
        progress.add_total(len(todo) - before)
        progress.advance()


def _warm_in_background(
    n: int,
    root: Path,
    todo: deque[Kernel],
    finish: Callable[[Kernel, tuple[str, bool]], None],
    progress: Progress,
    stats: Warmed,
    bg: Background,
    ready: Callable[[], bool],
    t0: float,
) -> Warmed:
    """warm's background mode: the pool's loop in a thread of this process; return once `ready()`
    (every stage has a tile to run at) or the loop ended. Every worker starts here, in the calling
    thread (while the caller's __main__ is hidden from them: `n` is at most the kernels queued now)."""
    stats.jobs = n
    progress.extra = f"{n} workers"
    is_ready = threading.Event()
    ex = _executor(n)
    running: dict[Future[tuple[str, bool]], Kernel] = {}
    try:
        _submit(ex, n, root, todo, running)
    except (OSError, RuntimeError, AssertionError):  # no worker could start: compile here, all of it
        ex.shutdown(wait=False, cancel_futures=True)
        todo.extendleft(reversed(list(running.values())))
        try:
            _build_here(root, todo, finish, progress)
        except BackendUnavailable:
            pass
        finally:
            progress.close()
            bg._end()
        stats.seconds = time.monotonic() - t0
        return stats

    def cancel() -> None:
        progress.quiet = True  # (a process exiting says nothing about the work it drops)
        procs = list((getattr(ex, "_processes", None) or {}).values())  # (shutdown forgets them)
        ex.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.terminate()

    bg._cancel = cancel

    def check() -> None:
        if ready():
            is_ready.set()

    def loop() -> None:
        try:
            _pool_loop(ex, n, root, todo, running, finish, progress, check, False)
        except BaseException:  # (BackendUnavailable, a cancelled pool: the callers' compiles say so)
            pass
        finally:
            ex.shutdown(wait=False, cancel_futures=True)
            progress.close()
            bg._end()
            is_ready.set()

    if ready():
        is_ready.set()
    threading.Thread(target=loop, name="coda-compile", daemon=True).start()
    _at_exit(bg.cancel)
    is_ready.wait()
    if not bg.over:
        progress.extra = f"{n} workers, in the background"
        progress.detach()
        stats.background = bg
    stats.seconds = time.monotonic() - t0
    return stats


def _executor(n: int) -> Executor:
    """n spawned compile workers (see _init_worker)."""
    return ProcessPoolExecutor(
        max_workers=n,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_init_worker,
        initargs=(os.getpid(),),
    )


def _at_exit(fn: Callable[[], None]) -> None:
    """Run `fn` when the interpreter exits, before it joins the executors' threads (so that it does not
    wait for compiles nobody needs any more)."""
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is not None:
            register(fn)
            return
    except RuntimeError:  # (already shutting down)
        return
    atexit.register(fn)


def _submit(
    ex: Executor,
    n: int,
    root: Path,
    todo: deque[Kernel],
    running: dict[Future[tuple[str, bool]], Kernel],
    hide_main: bool = True,
) -> None:
    """Submit kernels from the front of `todo` until n are running (one per worker: the rest stays
    in `todo`, where a kernel can still move ahead). A submission may start a worker: with
    `hide_main`, the caller's __main__ is hidden meanwhile (a background thread must not touch it: the
    pool's n workers all started in the calling thread, at the first n submissions)."""
    with _neutral_main() if hide_main else contextlib.nullcontext():
        while todo and len(running) < n:
            k = todo[0]
            running[ex.submit(build, k.spec, k.config, str(root), _wait_for(todo, k))] = k
            todo.popleft()


def _pool_loop(
    ex: Executor,
    n: int,
    root: Path,
    todo: deque[Kernel],
    running: dict[Future[tuple[str, bool]], Kernel],
    finish: Callable[[Kernel, tuple[str, bool]], None],
    progress: Progress,
    on_finish: Callable[[], None] | None = None,
    hide_main: bool = True,
) -> None:
    """Finish the kernels in `running` as they come back (submitting what finishing them adds to
    `todo`); on a broken pool, return with the unfinished kernels back in `todo`."""
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
            except Exception:  # it failed in its worker (or was cancelled): the caller compiles it again
                st = ("failed", False)
            if st[0] == BUSY:  # another process builds it: this worker takes another kernel first
                _later(todo, k)
                continue
            before = len(todo)
            finish(k, st)
            progress.add_total(len(todo) - before)
            progress.advance(what=_describe(k.spec, k.config))
            if on_finish is not None:
                on_finish()
        _finish_busy(todo, finish, progress)
        if on_finish is not None:
            on_finish()
        _submit(ex, n, root, todo, running, hide_main)


def _run_pool(
    n: int,
    root: Path,
    todo: deque[Kernel],
    finish: Callable[[Kernel, tuple[str, bool]], None],
    progress: Progress,
) -> None:
    """Build `todo` (and what finishing its kernels adds to it) in n spawned workers; on a broken pool,
    return with the unfinished kernels back in `todo`."""
    ex = _executor(n)
    running: dict[Future[tuple[str, bool]], Kernel] = {}
    try:
        try:
            _submit(ex, n, root, todo, running)
        except (OSError, RuntimeError, AssertionError):  # no worker could start: compile here
            todo.extendleft(reversed(list(running.values())))
            running.clear()
            return
        _pool_loop(ex, n, root, todo, running, finish, progress)
    finally:
        ex.shutdown(wait=False, cancel_futures=True)
