"""Compiles shared between the ranks of a job on one host, and between blocks (build/parallel.py,
build/cache.py's entry locks; plan/context.py's names).

Two processes filling one empty cache at once with the same kernels (a fake compiler that sleeps, so
no toolchain is needed; the cache, its entry locks and the schedule are the real ones): each kernel
is built once, by one of them, and they split the work, finishing in about half the time one
process takes (a process skips an entry the other is building and comes back to it). In one
process: a kernel found being built elsewhere is built again only after the rest, waiting for the
lock then, or finished without a worker once the cache holds it; each rank of a job takes its share
of the CPUs for workers ($LOCAL_WORLD_SIZE). The Llama blocks' stages that read the same (the last
layer's MLP stages and the layers') are one kernel per tile: a model's distinct kernels are counted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import coda_lang
from coda_lang.backend_cute.build import parallel
from coda_lang.backend_cute.build.cache import Kernel
from coda_lang.backend_cute.build.config import CANDIDATES, TUNE_CANDIDATES, TileConfig, fits
from coda_lang.backend_cute.plan.emit import emit_stage, source_hash
from coda_lang.backend_cute.plan.planner import plan_stage

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "examples" / "llama_mlp.coda"
DELAY = 1.0  # seconds of a fake compile
TILES = ("128x192", "128x128")  # per stage of llama_mlp: 3 stages x 2 tiles = 6 kernels

# A process compiling llama_mlp's kernels into the cache at argv[1] with a fake compiler (a sleep) and
# fake ptxas reports; it waits for its sibling (argv[2] of argv[3] ready files) and prints what it did.
WORKER = """
import json, sys, time
from pathlib import Path
import coda_lang
from coda_lang.backend_cute.build import cache, compile as cm, parallel
from coda_lang.backend_cute.build.config import TileConfig
from coda_lang.backend_cute.build.ptxas import PtxasReport
from coda_lang.backend_cute.plan.planner import plan_stage

DELAY = {delay}

class FakeAdapter:
    @staticmethod
    def compile_ptx(spec, path, config, root):
        time.sleep(DELAY)
        # (a whole module as cache.complete_ptx tells one: header, an entry, closed braces)
        text = f"// fake PTX of {{spec.fn_name}} at {{config.short}}\\n.version 8.0\\n.target sm_90a\\n"
        return text + ".visible .entry k()\\n{{\\n\\tret;\\n}}\\n", DELAY

cm._adapter = lambda: FakeAdapter
cache.ptxas_executable = lambda: "fake-ptxas"
cache.ptxas_version = lambda exe: "fake ptxas 1.0"
cache.run_ptxas = lambda path, arch="sm_90a": PtxasReport(96, 0, 0, 0, "fake ptxas 1.0", "")

root, me, n = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
block = coda_lang.load({mlp!r})["llama_mlp"]
tiles = [TileConfig(*map(int, t.split("x"))) for t in {tiles!r}]
requests = [parallel.Request(plan_stage(block, k), tuple(tiles)) for k in (1, 2, 3)]
(root / f"ready{{me}}").touch()
while sum(1 for i in range(n) if (root / f"ready{{i}}").exists()) < n:
    time.sleep(0.01)
t0 = time.monotonic()
done = parallel.warm(requests, jobs=1, directory=root, quiet=True)
print(json.dumps({{"seconds": time.monotonic() - t0, "compiled": done.compiled, "cached": done.cached,
                  "built": sorted(p.name for p in done.built)}}))
"""


def fill(root: Path, processes: int) -> list[dict[str, Any]]:
    """`processes` processes filling the cache at `root` at once (WORKER); what each did."""
    root.mkdir(parents=True, exist_ok=True)
    code = WORKER.format(delay=DELAY, mlp=str(MLP), tiles=TILES)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CODA_PROGRESS": "0"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(root), str(i), str(processes)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for i in range(processes)
    ]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=120)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.splitlines()[-1]))
    return out


def test_two_processes_build_each_kernel_once_and_split_the_work(tmp_path: Path) -> None:
    """Two processes, one worker each, the same 6 kernels into one empty cache at once: every kernel
    built by exactly one of them, the other finding it in the cache; each builds some, and both are
    done in well under the 6 compiles' time that one process alone (or two taking turns at the same
    kernel) would take."""
    n = 3 * len(TILES)
    runs = fill(tmp_path / "cache", 2)
    built = [set(r["built"]) for r in runs]
    assert len(built[0] | built[1]) == n and not built[0] & built[1], built
    assert sum(r["compiled"] for r in runs) == n and all(r["compiled"] + r["cached"] == n for r in runs)
    assert all(r["compiled"] >= 1 for r in runs), runs
    assert max(r["seconds"] for r in runs) < 0.75 * n * DELAY, runs  # (about half: 3 compiles each)
    assert len(list((tmp_path / "cache" / "ptx").glob("*.ptx"))) == n


class Elsewhere:
    """A fake build where kernel `busy` is being built by another process: not waiting, it is BUSY;
    it shows in the cache (status "ok") once `done_after` other kernels were built; waiting, it is
    found there (compiled elsewhere)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, busy: tuple[int, str], done_after: int):
        self.calls: list[tuple[int, str, bool]] = []
        self.known: dict[tuple[int, str], str] = {}
        self.busy, self.done_after = busy, done_after
        fake = self

        def name(spec: Any, config: TileConfig) -> tuple[int, str]:
            return spec.index, config.short

        monkeypatch.setattr(Kernel, "status", lambda k: fake.known.get(name(k.spec, k.config)))

        def build(spec: Any, config: TileConfig, root: str, wait: bool = True) -> tuple[str, bool]:
            key = name(spec, config)
            fake.calls.append((*key, wait))
            if key == fake.busy:
                if not wait:
                    return parallel.BUSY, False
                fake.known[key] = "ok"
                return "ok", False  # (the other process's entry, read once its lock was free)
            fake.known[key] = "ok"
            if sum(1 for c in fake.calls if c[:2] != fake.busy) >= fake.done_after:
                fake.known[fake.busy] = "ok"
            return "ok", True

        monkeypatch.setattr(parallel, "build", build)


def requests() -> list[parallel.Request]:
    block = coda_lang.load(MLP)["llama_mlp"]
    tiles = (TileConfig(128, 192), TileConfig(128, 128))
    return [parallel.Request(plan_stage(block, k), tiles) for k in (1, 2)]


def test_a_kernel_another_process_builds_is_waited_for_last(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One job, here: the kernel another process holds is skipped (BUSY), the others built, then it
    is asked for again, waiting for the lock, and read from the cache (not counted as compiled)."""
    fake = Elsewhere(monkeypatch, busy=(1, "128x192"), done_after=99)
    done = parallel.warm(requests(), jobs=1, directory=tmp_path, quiet=True)
    assert fake.calls == [
        (1, "128x192", False),
        (1, "128x128", False),
        (2, "128x192", False),
        (2, "128x128", False),
        (1, "128x192", True),
    ]
    assert (done.compiled, done.cached) == (3, 1)


def test_a_busy_kernel_the_cache_holds_by_then_takes_no_worker(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A pool (threads standing in for the workers): the busy kernel, once the other process has
    written it, is finished from the cache without being built again."""
    from concurrent.futures import ThreadPoolExecutor

    fake = Elsewhere(monkeypatch, busy=(1, "128x192"), done_after=1)
    monkeypatch.setattr(parallel, "_executor", lambda n: ThreadPoolExecutor(n))
    done = parallel.warm(requests(), jobs=2, directory=tmp_path, quiet=True)
    assert (1, "128x192", True) not in fake.calls and fake.calls.count((1, "128x192", False)) == 1
    assert (done.compiled, done.cached) == (3, 1)


def test_the_ranks_of_a_host_share_its_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each of a host's ranks ($LOCAL_WORLD_SIZE, as torchrun and Accelerate set it) takes its share of
    the CPUs and memory for compile workers, so that their pools together fill the host once."""
    monkeypatch.delenv("CODA_JOBS", raising=False)
    monkeypatch.setattr(parallel, "cpus", lambda: 16)
    monkeypatch.setattr(parallel, "available_memory", lambda: 100 * parallel.WORKER_BYTES)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert parallel.default_jobs() == 4 and parallel.default_jobs(3) == 3
    monkeypatch.setattr(parallel, "available_memory", lambda: 6 * parallel.WORKER_BYTES)
    assert parallel.default_jobs() == 1  # 6 GB for 4 ranks
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    assert parallel.default_jobs() == 6
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("CODA_JOBS", "8")
    assert parallel.default_jobs() == 8  # (set per process: not divided)


def llama_kernels() -> tuple[int, int, int]:
    """Llama-3.2-1B's blocks as coda_lang.hf makes them (bf16, the "rows" loss head): the GEMM stages
    of a training step's kernels, their distinct emitted epilogues, and the kernels (stage, tile) that
    a first step asks for when no tile spills (each stage's first candidate and the tuner's)."""
    from coda_lang.hf.blocks import model_source
    from coda_lang.torch import function

    prog = coda_lang.load(model_source("bfloat16", 1e-5, 64, False))
    grads = {"w_o", "w_13", "w_2", "w_qkv", "w_lm", "g", "g1", "g2", "h", "y", "x", "hg", "r"}
    stages, kernels = 0, set()
    sources = set()
    for name, options in (
        ("first_qkv", {}),
        ("layer", {}),
        ("last", {}),
        ("head_loss_rows", {"remat": "save", "chunk_dim": "M"}),
    ):
        b = prog[name]
        f = function(b, wrt=[p.var.name for p in b.ir.params if p.var.name in grads], **options)
        for cb in f.kernel_blocks():
            for k in cb.gemm_stages:
                spec = cb.specs[k - 1]
                stages += 1
                src = emit_stage(spec)
                sources.add(source_hash(src))
                first = next(c for c in CANDIDATES if fits(spec, c))
                for c in {first, *(c for c in TUNE_CANDIDATES if fits(spec, c))}:
                    kernels.add(Kernel(spec, c, Path("/nonexistent"), source=src).key)
    return stages, len(sources), len(kernels)


@pytest.mark.slow  # (every block's function made: 25 s on two cores; test_backend_emit checks the sharing)
def test_a_llama_models_stages_that_read_the_same_share_their_kernels() -> None:
    """The 31 GEMM stages of a Llama training step's blocks (forward, backward, the loss head's
    chunked backwards) emit 15 distinct epilogues (19 when each block named its own), so a first step
    asks for 110 kernels when no tile spills (138 before): the last layer's out-proj and gate/up
    stages, and its backward's SwiGLU and norm-backward stages, are the layers'."""
    pytest.importorskip("torch")
    assert llama_kernels() == (31, 15, 110)
