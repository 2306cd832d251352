"""The kernel cache and parallel compiles (coda_lang/backend_cute/build/compile.py, parallel.py), and
`coda compile --jobs` / `coda tune`.

Without the toolchain: which kernels `parallel.warm` builds (a fake build), how many workers it
takes, the CLI's usage errors. Marked `toolchain` (compiling real kernels, no GPU): a stale or damaged
entry (truncated PTX, a missing ptxas report, another library or coda_lang version, a damaged refusal
record) is detected and rebuilt; a refused tile is not compiled again; the cache holds no absolute
path and a copy of it elsewhere is warm; quack's object written by a compile is the one the runtime's
launch asks for; two processes filling one cache at once both succeed, with one result; --jobs 2
writes the same PTX as one job.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import coda_lang
from coda_lang.backend_cute.build import cache as cache_mod
from coda_lang.backend_cute.build import compile as compile_mod
from coda_lang.backend_cute.build import parallel
from coda_lang.backend_cute.build.cache import Kernel
from coda_lang.backend_cute.build.compile import compile_spec
from coda_lang.backend_cute.build.config import CANDIDATES, TUNE_CANDIDATES, TileConfig, fits
from coda_lang.backend_cute.plan.planner import plan_stage
from coda_lang.core.diagnostics import CodaError

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "examples" / "llama_mlp.coda"


@pytest.fixture(scope="module")
def mlp() -> coda_lang.Block:
    return coda_lang.load(MLP)["llama_mlp"]


def coda(*args: str, cache: Path, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CODA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "coda_lang.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


# ------------------------------------------------------------------------------------------------
# parallel.warm's schedule, with a fake build (no toolchain)


class FakeCache:
    """Kernel statuses by (stage, tile) instead of files; `build` records what it was asked to build."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, known: dict[tuple[int, str], str], built: dict):
        self.known, self.built = dict(known), built
        self.calls: list[tuple[int, str]] = []
        cache = self

        def status(k: Kernel) -> str | None:
            return cache.known.get((k.spec.index, k.config.short + str(k.config.cluster_n)))

        def build(spec: Any, config: TileConfig, root: str, wait: bool = True) -> tuple[str, bool]:
            name = (spec.index, config.short + str(config.cluster_n))
            cache.calls.append(name)
            cache.known[name] = cache.built.get(name, "ok")
            return cache.known[name], True

        monkeypatch.setattr(Kernel, "status", status)
        monkeypatch.setattr(parallel, "build", build)


def test_warm_builds_what_the_cache_lacks_and_stops_at_the_first_tile_without_spills(
    mlp: coda_lang.Block, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    s1, s2, s3 = (plan_stage(mlp, k) for k in (1, 2, 3))
    fake = FakeCache(
        monkeypatch,
        known={(2, "128x1921"): "spills"},  # stage 2's first tile is known to spill: not built again
        built={(1, "128x1921"): "spills", (3, "128x1921"): "refused"},
    )
    stats = parallel.warm(
        [
            parallel.Request(s1, CANDIDATES, first=True),
            parallel.Request(s2, CANDIDATES, first=True),
            parallel.Request(s3, CANDIDATES, first=True),
            parallel.Request(s3, (TileConfig(128, 192), TileConfig(128, 128))),  # shares a kernel
        ],
        jobs=1,
        directory=tmp_path,
        quiet=True,
    )
    # stage 1: 128x192 spills, so 128x192e16 (ok) and no further; stage 2: from its next fitting tile
    # on (paired: no e16, tile_N % 32 == 0: no 176), the first is ok; stage 3: 128x192 refused (built
    # once for both requests), then 128x192e16; the fourth request adds 128x128. A first tile that
    # spills or is refused sends its stage's next tile to the front of what is queued.
    assert fake.calls == [
        (1, "128x1921"),
        (1, "128x192e161"),
        (2, "128x1281"),
        (3, "128x1921"),
        (3, "128x192e161"),
        (3, "128x1281"),
    ]
    assert (stats.compiled, stats.cached, stats.spills, stats.refused, stats.jobs) == (6, 1, 1, 1, 0)
    again = parallel.warm(
        [parallel.Request(s, CANDIDATES, first=True) for s in (s1, s2, s3)],
        jobs=1,
        directory=tmp_path,
        quiet=True,
    )
    assert again.compiled == 0 and len(fake.calls) == 6  # all known now


def test_warm_all_configs_builds_every_fitting_tile(
    mlp: coda_lang.Block, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = plan_stage(mlp, 2)  # paired: no epilogue subtile narrower than quack's
    fake = FakeCache(monkeypatch, {}, {})
    parallel.warm([parallel.Request(spec, TUNE_CANDIDATES)], jobs=1, directory=tmp_path, quiet=True)
    assert len(fake.calls) == len([c for c in TUNE_CANDIDATES if fits(spec, c)]) == 6  # no e16, no 176


def test_default_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CODA_JOBS", raising=False)
    monkeypatch.setattr(parallel, "cpus", lambda: 16)
    monkeypatch.setattr(parallel, "available_memory", lambda: 100 * parallel.WORKER_BYTES)
    assert parallel.default_jobs() == 16 and parallel.default_jobs(5) == 5
    monkeypatch.setattr(parallel, "available_memory", lambda: int(3.5 * parallel.WORKER_BYTES))
    assert parallel.default_jobs(70) == 3  # bounded by memory
    monkeypatch.setattr(parallel, "available_memory", lambda: 0)
    assert parallel.default_jobs(70) == 1
    monkeypatch.setenv("CODA_JOBS", "4")
    assert parallel.default_jobs(70) == 4 and parallel.default_jobs(2) == 2


class GatedBuild:
    """A fake build in threads (the pool's workers): the kernels of `free` finish at once (those in
    `spills` spilling), every other one waits for `gate`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, free: set[tuple[int, TileConfig]], spills=()) -> None:
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self.gate = threading.Event()
        self.free, self.spills = free, set(spills)
        self.calls: list[tuple[int, TileConfig]] = []
        self.submitted: list[tuple[int, TileConfig]] = []
        self.lock = threading.Lock()
        fake = self

        class Pool(ThreadPoolExecutor):
            def submit(self, fn: Any, spec: Any, config: TileConfig, root: str, *rest: Any) -> Any:  # type: ignore[override]
                fake.submitted.append((spec.index, config))
                return super().submit(fn, spec, config, root, *rest)

        monkeypatch.setattr(Kernel, "status", lambda k: None)
        monkeypatch.setattr(parallel, "build", self.build)
        monkeypatch.setattr(parallel, "_executor", lambda n: Pool(n))
        monkeypatch.setattr(parallel, "_at_exit", lambda fn: None)

    def build(self, spec: Any, config: TileConfig, root: str, wait: bool = True) -> tuple[str, bool]:
        name = (spec.index, config)
        with self.lock:
            self.calls.append(name)
        if name not in self.free:
            assert self.gate.wait(30)
        return ("spills" if name in self.spills else "ok"), True


def test_warm_in_the_background_returns_once_every_stage_has_its_first_tile(
    mlp: coda_lang.Block, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`background=True`: the first requests' kernels are built first, and warm returns as soon as each
    has a tile without spills; a spilling first tile sends its stage's next one ahead of everything
    queued (with two workers both busy otherwise, nothing else would let warm return); the tuner's
    other candidates compile on, `Background.pending` says for which stages, `wait` blocks until they
    are done, and every kernel is built once."""
    from coda_lang.backend_cute.plan.emit import emit_stage

    s1, s2 = plan_stage(mlp, 1), plan_stage(mlp, 2)
    first1 = [c for c in CANDIDATES if fits(s1, c)][:2]
    first2 = next(c for c in CANDIDATES if fits(s2, c))
    fake = GatedBuild(monkeypatch, {(1, first1[0]), (1, first1[1]), (2, first2)}, spills={(1, first1[0])})
    requests = [
        parallel.Request(s2, CANDIDATES, first=True),
        parallel.Request(s2, TUNE_CANDIDATES),
        parallel.Request(s1, CANDIDATES, first=True),
        parallel.Request(s1, TUNE_CANDIDATES),
    ]
    try:
        stats = parallel.warm(requests, jobs=2, directory=tmp_path, quiet=True, background=True)
        bg = stats.background
        assert bg is not None and not bg.over and stats.jobs == 2
        # the first tiles first; stage 1's spills, so its next tile goes ahead of stage 2's candidates
        # (one of which may have taken the worker that stage 2's first tile freed)
        assert fake.submitted[:2] == [(2, first2), (1, first1[0])], fake.submitted
        assert fake.submitted.index((1, first1[1])) in (2, 3), fake.submitted
        assert bg.pending(emit_stage(s1)) and bg.pending(emit_stage(s2))
        assert not bg.wait(timeout=0.2)  # the rest waits for the gate
    finally:
        fake.gate.set()
    assert bg.wait(timeout=30) and parallel.wait_all(timeout=30)
    assert not bg.pending(emit_stage(s1)) and not bg.pending(emit_stage(s2)) and bg.over
    want = {(s.index, c) for s in (s1, s2) for c in TUNE_CANDIDATES if fits(s, c)} | {
        (1, first1[0]),
        (1, first1[1]),
    }
    assert sorted(fake.calls, key=str) == sorted(want, key=str)  # each kernel once


def test_work_left_in_the_background_is_cancelled(
    mlp: coda_lang.Block, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`Background.cancel` (registered to run at the interpreter's exit) drops the work left: nothing is
    pending any more and waiting returns at once; with one job there is no background (all is built
    before warm returns)."""
    s1 = plan_stage(mlp, 1)
    first = next(c for c in CANDIDATES if fits(s1, c))
    fake = GatedBuild(monkeypatch, {(1, first)})
    try:
        stats = parallel.warm(
            [parallel.Request(s1, CANDIDATES, first=True), parallel.Request(s1, TUNE_CANDIDATES)],
            jobs=2,
            directory=tmp_path,
            quiet=True,
            background=True,
        )
        assert stats.background is not None
        stats.background.cancel()
        assert stats.background.over and stats.background.wait(timeout=0.5)
    finally:
        fake.gate.set()
    fake.calls.clear()
    one = parallel.warm(
        [parallel.Request(s1, (first,))], jobs=1, directory=tmp_path, quiet=True, background=True
    )
    assert one.background is None and fake.calls == [(1, first)]


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
def test_a_process_exits_without_waiting_for_its_background_compiles(tmp_path: Path) -> None:
    """A program whose first call left kernels compiling in the background exits at once when it is
    done (not after the compiles), and its compile workers end with it."""
    import time

    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "background_exit.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"},
    )
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr[-3000:]
    workers = [int(x) for x in r.stdout.split()[1:]]
    assert r.stdout.startswith("workers") and len(workers) >= 2, r.stdout
    assert took < 120, took  # (the workers' builds sleep for 300 s)

    def running(p: int) -> bool:
        try:
            state = Path(f"/proc/{p}/status").read_text()
        except OSError:
            return False
        return "State:\tZ" not in state  # (a zombie has ended; only its parent's wait is missing)

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(running(p) for p in workers):
        time.sleep(0.2)
    alive = [p for p in workers if running(p)]
    assert not alive, f"compile workers still running after the process exited: {alive}"


# ------------------------------------------------------------------------------------------------
# CLI usage errors (no toolchain needed: they stop before any compile)


@pytest.mark.parametrize(
    "args,needle",
    [
        ([], "give the sizes to tune at: --dims"),
        (["--dims", "M=16"], "gives no size for D, F"),
        (["--dims", "M=16,D=8,F=8", "--dims", "M=x"], "--dims takes NAME=SIZE pairs"),
        (["--dims", "M=16,D=8,F=8,Q=3"], "unknown dim Q; llama_mlp has dims M, D, F"),
        (["--dims", "M=16,D=8,F=8", "--jobs", "0"], "--jobs takes a positive number"),
        (["--dims", "M=16,D=8,F=8", "--remat", "save"], "--remat chooses the backward's policy"),
    ],
)
def test_coda_tune_usage_errors(args: list[str], needle: str, tmp_path: Path, capsys: Any) -> None:
    from coda_lang.cli import main

    assert main(["tune", str(MLP), *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_coda_tune_bad_files(tmp_path: Path, capsys: Any) -> None:
    from coda_lang.cli import main

    assert main(["tune", str(tmp_path / "nope.coda"), "--dims", "M=8"]) == 2
    assert "can't read" in capsys.readouterr().err
    bad = tmp_path / "bad.coda"
    bad.write_text("dims M\nblock b(x: bf16[M, M]) -> (y: bf16[M, M]) {\n  y = x +\n}\n")
    assert main(["tune", str(bad), "--dims", "M=8"]) == 1
    assert "error" in capsys.readouterr().err


def test_coda_tune_help() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "coda_lang.cli", "tune", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0 and "--dims" in r.stdout and "--backward" in r.stdout and "--jobs" in r.stdout


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--emit", "source", "--jobs", "2"], "--jobs takes a positive number and goes with --emit ptx"),
        (["--emit", "ptx", "--jobs", "two"], "--jobs takes a positive number"),
    ],
)
def test_coda_compile_jobs_usage_errors(args: list[str], needle: str, tmp_path: Path, capsys: Any) -> None:
    from coda_lang.cli import main

    assert main(["compile", str(MLP), "-o", str(tmp_path), *args]) == 2
    assert needle in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------
# Real kernels (toolchain): stage 3 of llama_mlp at 128x128, the cheapest to compile


def _small(mlp: coda_lang.Block) -> Any:
    return plan_stage(mlp, 3)


SMALL = TileConfig(128, 128)


def _no_compiles(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("compiled a kernel the cache holds")

    monkeypatch.setattr(compile_mod, "build", refuse)


@pytest.mark.parametrize(
    "damage", ["truncated ptx", "report missing", "report damaged", "other library", "other coda_lang"]
)
@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_stale_or_damaged_entry_is_detected_and_rebuilt(
    mlp: coda_lang.Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    spec = _small(mlp)
    first = compile_spec(spec, SMALL, directory=tmp_path)
    good = first.ptx_path.read_text()
    assert first.report is not None
    ran: list[object] = []
    real_ptxas = cache_mod.run_ptxas
    monkeypatch.setattr(cache_mod, "run_ptxas", lambda *a, **k: ran.append(a) or real_ptxas(*a, **k))
    records = list(tmp_path.glob("ptx/*.ptxas-*.json"))
    assert len(records) == 1
    if damage == "truncated ptx":
        first.ptx_path.write_text(good[: len(good) // 3])
    elif damage == "report missing":
        records[0].unlink()
    elif damage == "report damaged":
        records[0].write_text('{"registers": 1')
    elif damage == "other library":  # a cache written with another quack: another key, never read
        versions = {**cache_mod.library_versions(), "quack-kernels": "0.0.1"}
        monkeypatch.setattr(cache_mod, "library_versions", lambda: versions)
    else:  # another coda_lang (its kernel modules differ)
        monkeypatch.setattr(cache_mod, "kernel_fingerprint", lambda: "0123456789abcdef")
    if damage.startswith("report"):
        _no_compiles(monkeypatch)  # the PTX is fine: only ptxas runs again
    again = compile_spec(spec, SMALL, directory=tmp_path)
    assert again.ptx_path.read_text() == good and again.report is not None
    assert again.report.registers == first.report.registers
    assert again.cached == damage.startswith("report")  # PTX rebuilt unless only the report was hurt
    # ptxas ran once: on the new entry, or for the lost report (a rebuilt PTX is the same text, whose
    # report is still good)
    assert len(ran) == (damage != "truncated ptx")
    assert (again.ptx_path == first.ptx_path) == (
        damage in ("truncated ptx", "report missing", "report damaged")
    )
    _no_compiles(monkeypatch)
    ran.clear()
    third = compile_spec(spec, SMALL, directory=tmp_path)  # and warm again: no compile, no ptxas
    assert third.cached and third.report == again.report and not ran


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_only_whole_ptx_that_ptxas_accepted_enters_the_cache(
    mlp: coda_lang.Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CuTeDSL's PTX cut short (its dump under a full disk or a 64 KiB file-size limit) is an error and
    is not cached; one ptxas refuses is not cached either; an entry an older coda_lang recorded that
    way (the cut PTX under its own hash, or PTX ptxas refuses) reads as missing and is built again,
    instead of failing every later compile in ptxas."""
    import hashlib

    spec = _small(mlp)
    good = compile_spec(spec, SMALL, directory=tmp_path / "ref").ptx_path.read_text()  # one real compile
    assert len(good) > 64 * 1024
    cut, broken = good[: 64 * 1024], good.replace("ret;", "bogus.instruction;", 1)
    adapter = compile_mod._adapter()
    cache = tmp_path / "cache"

    def made(text: str) -> None:
        monkeypatch.setattr(adapter, "compile_ptx", lambda *a, **k: (text, 1.0))

    def entries() -> list[str]:
        return sorted(p.name.split(".", 1)[1] for p in (cache / "ptx").iterdir() if p.suffix != ".lock")

    made(cut)
    with pytest.raises(compile_mod.IncompletePTX, match="is cut short"):
        compile_spec(spec, SMALL, directory=cache)
    assert entries() == []
    made(broken)
    with pytest.raises(RuntimeError, match="ptxas failed"):
        compile_spec(spec, SMALL, directory=cache)
    assert entries() == []
    k = Kernel(spec, SMALL, cache)
    made(good)
    for old in (cut, broken):  # as an older coda_lang left it: the PTX and its hash, no ptxas report
        k.ptx_path.write_text(old)
        k.meta_path.write_text(
            json.dumps({"compile_s": 1.0, "sha256": hashlib.sha256(old.encode()).hexdigest()})
        )
        assert k.status() is None  # (coda tune counts it as not compiled)
        out = compile_spec(spec, SMALL, directory=cache)
        assert not out.cached and out.ptx == good and out.report is not None
        assert k.status() == ("spills" if out.report.spills else "ok")
        assert [e.split("-")[0] for e in entries()] == ["json", "ptx", "ptxas"]  # (and its report)


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_refused_tile_is_not_compiled_again(
    mlp: coda_lang.Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _small(mlp)
    wide = TileConfig(128, 256)  # pingpong allows tile_N <= 208: quack refuses it
    with pytest.raises(CodaError) as first:
        compile_spec(spec, wide, directory=tmp_path)
    (record,) = tmp_path.glob("ptx/*.refused.json")
    real_build = compile_mod.build
    _no_compiles(monkeypatch)
    with pytest.raises(CodaError) as again:  # from the record: the same diagnostic, nothing compiled
        compile_spec(spec, wide, directory=tmp_path)
    assert [d.code for d in again.value.diagnostics] == ["E0707"]
    assert again.value.diagnostics[0].notes == first.value.diagnostics[0].notes
    assert parallel.build(spec, wide, str(tmp_path)) == ("refused", False)
    record.write_text('{"key": "another key", "error": "x"}')  # a record not of this kernel: compiled
    monkeypatch.setattr(compile_mod, "build", real_build)
    with pytest.raises(CodaError) as third:
        compile_spec(spec, wide, directory=tmp_path)
    assert third.value.diagnostics[0].notes == first.value.diagnostics[0].notes
    assert json.loads(record.read_text())["error"] == first.value.diagnostics[0].notes[0]


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_cache_is_portable(mlp: coda_lang.Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No file of the cache names a path (its own folder, ptxas's, the .coda file's): a copy of it in
    another folder (another machine) is warm: nothing compiles, ptxas doesn't run."""
    here = tmp_path / "here"
    first = compile_spec(_small(mlp), SMALL, directory=here)
    assert first.report is not None
    needles = [str(tmp_path).encode(), str(ROOT).encode(), os.path.expanduser("~").encode()]
    files = [p for p in here.rglob("*") if p.is_file()]
    for p in files:
        data = p.read_bytes()
        assert not any(n in data for n in needles), p
    there = tmp_path / "there"
    shutil.copytree(here, there)
    _no_compiles(monkeypatch)
    monkeypatch.setattr(cache_mod, "run_ptxas", lambda *a, **k: pytest.fail("ptxas ran"))
    copy = compile_spec(_small(mlp), SMALL, directory=there)
    assert copy.cached and copy.report == first.report


# A block of its own (no other test compiles its kernels, so this process compiles them for real and
# writes quack's objects): an epilogue with a tile and a vector load, and a GEMM of a transposed A.
RUNTIME_KEY = """\
dims M, K, N

block rt_key(x: bf16[M, K], w: bf16[K, N], t: bf16[M, N], s: f32[N]) -> (o: bf16[M, N], p: bf16[K, N]) {
  gemm x @ w {
    o = acc * s + t * 0.25
  }
  gemm transpose(x) @ o {
    p = acc * 0.125
  }
}
"""

LAUNCH = """
import sys
sys.path.insert(0, "tests")
import coda_lang
from quack.gemm_runtime import host
from test_compile_cache import RUNTIME_KEY
from test_runtime import _meta_env
from coda_lang.backend_cute.build import quack_adapter
blk = next(iter(coda_lang.load(RUNTIME_KEY)))
cb = blk.cuda(tile=(128, 128))
for k in (1, 2):
    r = cb.runner(k)
    ins, scalars = r.arguments(_meta_env(blk, {"M": 1000, "K": 520, "N": 1000}))
    D, C, epi = r.epilogue_arguments(ins, scalars, r.allocate(ins[0], ins[1]))
    quack_adapter.launch(r.mod, r.spec, r.config, ins[0], ins[1], D, epi, C=C, dry_run=True)
print(host._compile_gemm_epi.cache_info())
"""


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_runtime_launch_loads_the_object_a_compile_wrote(tmp_path: Path) -> None:
    """A stage compiled to PTX leaves quack's object of the kernel in the cache (with no path in it),
    under the key the runtime's launch asks for (its operands' dtypes and majors, a transposed A
    included): a fresh process launching the stages (a dry run, on "meta" tensors) loads them and
    compiles nothing."""
    blk = next(iter(coda_lang.load(RUNTIME_KEY)))
    for k in (1, 2):
        compile_spec(plan_stage(blk, k), SMALL, directory=tmp_path)
    objects = list(tmp_path.glob("quack/*/*/*.o"))
    assert len(objects) == 2
    for o in objects:
        assert str(tmp_path).encode() not in o.read_bytes() and str(ROOT).encode() not in o.read_bytes()
    r = subprocess.run(
        [sys.executable, "-c", LAUNCH],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "CODA_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "hits=2, misses=0" in r.stdout, r.stdout


@pytest.mark.slow  # (two real compiles in fresh processes; tests/test_shared_compiles.py checks the same locking by default)
@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_two_processes_filling_one_cache_at_once(tmp_path: Path) -> None:
    """Two `coda compile` at once on one empty cache: both succeed with the same PTX; each kernel is
    compiled by one of them (the other waits for the entry's lock and reads it); the cache holds one
    entry per kernel and no temporary file."""
    program = tmp_path / "rt_key.coda"
    program.write_text(RUNTIME_KEY)
    cache = tmp_path / "cache"
    env = {**os.environ, "CODA_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "coda_lang.cli",
                "compile",
                str(program),
                "--emit",
                "ptx",
                "--tile",
                "128x160",
                "-j",
                "1",
                "-q",
                "-o",
                str(tmp_path / f"out{i}"),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for i in (0, 1)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    for k in (1, 2):
        name = f"rt_key_stage{k}.ptx"
        assert (tmp_path / "out0" / name).read_text() == (tmp_path / "out1" / name).read_text()
    compiled = [line for out, _ in outs for line in out.splitlines() if "compiled in" in line]
    assert len(compiled) == 2, outs  # each of the two kernels compiled once, by one of the processes
    assert len(list(cache.glob("ptx/*.ptx"))) == 2 and len(list(cache.glob("ptx/*.ptxas-*.json"))) == 2
    assert not [p for p in cache.rglob("*") if p.name.endswith(".tmp") or ".tmp." in p.name]


def _same_as_one_job(block: coda_lang.Block, file: Path, tmp_path: Path) -> None:
    """`coda compile --jobs 2` (spawned workers) and one job (`select_config` in this process): the same
    tiles, the same PTX, byte for byte; a second run (warm) compiles nothing and runs no ptxas."""
    from coda_lang.backend_cute.build.select import select_config

    n = len(block.plan.stages)
    one = [select_config(block, k, directory=tmp_path / "c1", jobs=1) for k in range(1, n + 1)]
    r = coda(
        "compile", str(file), "--emit", "ptx", "-j", "2", "-o", str(tmp_path / "2"), cache=tmp_path / "c2"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("compiled in") == n and "cached" not in r.stdout, r.stdout
    assert "2 workers" in r.stderr  # the progress display (plain lines: not a terminal)
    wrote = [line for line in r.stdout.splitlines() if line.startswith("wrote")]
    for c, line in zip(one, wrote, strict=True):
        assert f"at {c.config}: {c.report}" in line
        name = f"{block.name}_stage{c.spec.index}.ptx"
        assert (tmp_path / "2" / name).read_bytes() == c.ptx_path.read_bytes()
    warm = coda(
        "compile", str(file), "--emit", "ptx", "-j", "2", "-o", str(tmp_path / "2"), cache=tmp_path / "c2"
    )
    assert warm.returncode == 0 and warm.stdout.count("; cached") == n, warm.stdout
    assert "workers" not in warm.stderr  # nothing to compile: no worker started


@pytest.mark.slow  # (25 s on 2 cores; the default run spawns compile workers in the background test)
@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_two_jobs_write_the_same_ptx_as_one(tmp_path: Path) -> None:
    program = tmp_path / "rt_key.coda"
    program.write_text(RUNTIME_KEY)
    _same_as_one_job(next(iter(coda_lang.load(program))), program, tmp_path)


@pytest.mark.slow
@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_two_jobs_write_the_same_ptx_as_one_for_llama_mlp(mlp: coda_lang.Block, tmp_path: Path) -> None:
    """As above, on llama_mlp: stage 1 spills at 128x192 and takes 128x192e16, tried after it."""
    _same_as_one_job(mlp, MLP, tmp_path)


@pytest.mark.slow  # (compiles a forward's and a backward's stages in-process: the CI machine's minutes are few)
@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_coda_tune_without_a_gpu_compiles_everything_and_says_timing_needs_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    """On this machine (no GPU) `coda tune --backward` compiles every candidate of the forward's and
    the backward's stages into the cache, says the timing needs a Hopper GPU, and exits 0; a second
    run finds everything in the cache. (One candidate tile, in this process, to keep it short.)"""
    from coda_lang.backend_cute.build import config
    from coda_lang.cli import main

    monkeypatch.setattr(config, "CANDIDATES", (TileConfig(128, 128),))
    monkeypatch.setattr(config, "TUNE_CANDIDATES", (TileConfig(128, 128),))
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CODA_TUNE", raising=False)
    program = tmp_path / "rt_key.coda"
    program.write_text(RUNTIME_KEY)
    args = ["tune", str(program), "--dims", "M=4096,K=1024,N=2048", "--dims", "M=8192,K=1024,N=2048"]
    assert main([*args, "--backward", "-j", "1", "-q"]) == 0
    out, err = capsys.readouterr()
    assert "kernels of rt_key and rt_key_bwd: " in out and "compiled (in this process" in out, out
    assert "note: no Hopper GPU here" in err and "M=4096,K=1024,N=2048; M=8192,K=1024,N=2048" in err
    assert len(list(tmp_path.glob("ptx/*.ptx"))) >= 4  # the forward's two stages and the backward's
    assert main([*args, "--backward", "-q"]) == 0
    out = capsys.readouterr().out
    assert "kernels of rt_key and rt_key_bwd: all " in out and " in the cache" in out, out


def test_a_first_call_compiles_the_forward_and_the_backward_at_once(
    mlp: coda_lang.Block, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`CudaBlock.autograd()`'s forward compiles the backward's kernels with its own at its first call
    (CudaBlock.prepare -> tiles.precompile): one request per stage for select_config's order and, when
    tuning, one for every candidate the tuner times; a fixed tile is the only request of its stage; a
    cuBLAS stage compiles nothing; each block once per process."""
    from coda_lang.backend_cute.build.config import CUBLAS
    from coda_lang.backend_cute.runtime import tiles

    monkeypatch.delenv("CODA_TUNE", raising=False)  # (tests/test_gpu.py sets it to 0 for the session)
    fn = mlp.cuda().autograd()
    assert fn.forward._compile_with == [fn.backward]
    seen: list[list[parallel.Request]] = []
    monkeypatch.setattr(
        parallel, "warm", lambda requests, **kw: seen.append(list(requests)) or parallel.Warmed()
    )
    monkeypatch.setattr(tiles, "find_ptxas", lambda: True)
    tiles.precompile([fn.forward, *fn.forward._compile_with])
    (requests,) = seen
    assert [(r.spec.block, r.spec.index, r.first) for r in requests] == [
        (b, k, first) for b, n in (("llama_mlp", 3), ("llama_mlp_bwd", 6)) for k in range(1, n + 1)
        for first in (True, False)
    ]  # fmt: skip
    assert {r.configs for r in requests} == {CANDIDATES, TUNE_CANDIDATES}
    assert tiles.precompile([fn.forward, fn.backward]) is None and len(seen) == 1  # done once
    fixed = mlp.cuda(tile={1: TileConfig(128, 128), 2: CUBLAS}, tune=False)
    tiles.precompile([fixed])
    assert [(r.spec.index, r.configs, r.first) for r in seen[1]] == [
        (1, (TileConfig(128, 128),), False),
        (3, CANDIDATES, True),
    ]


def test_every_module_an_emitted_epilogue_imports_is_in_the_kernel_fingerprint() -> None:
    """An edit to a module of ours that an emitted epilogue imports (its ops, the block-scaled mainloop,
    the gated fp8 store) changes the kernel fingerprint, so no cached kernel built from the old text is
    read: each such module is in KERNEL_MODULES."""
    from coda_lang.backend_cute.build.cache import KERNEL_MODULES
    from coda_lang.backend_cute.plan.names import imports

    ours = {line.split()[1] for line in imports().values() if line.startswith("from coda_lang.backend_cute.")}
    paths = {m.removeprefix("coda_lang.backend_cute.").replace(".", "/") + ".py" for m in ours}
    assert paths and paths <= set(KERNEL_MODULES), sorted(paths - set(KERNEL_MODULES))
