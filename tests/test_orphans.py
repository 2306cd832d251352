"""No worker outlives the process that started it (coda_lang/core/orphans.py), however that one ends.

A command is started in a subprocess, its workers are found (the processes whose parent it is), it is
killed with SIGKILL (which no handler sees) or SIGTERM, and its workers must be gone within a few
seconds: the compile pool's spawned workers (parallel._executor, which `coda compile` without --tile,
`coda tune` and a first call use) and the jobs of `coda fuzz --jobs N`. The whole commands, compiling
real kernels, are marked toolchain and slow.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def children(pid: int) -> set[int]:
    """The live processes whose parent is `pid`."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.add(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"  # (a zombie no one reaps yet has ended)


def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "CODA_PROGRESS": "0", **(env or {})}
    return subprocess.Popen(
        args, cwd=ROOT, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for_children(proc: subprocess.Popen[str], n: int, timeout: float = 120) -> set[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = children(proc.pid)
        if len(kids) >= n:
            return kids
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"{n} workers did not start within {timeout} s")


def kill_and_check(proc: subprocess.Popen[str], workers: set[int], sig: int, within: float = 6.0) -> None:
    proc.send_signal(sig)
    proc.wait(timeout=30)
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(alive(w) for w in workers):
        time.sleep(0.1)
    left = {w for w in workers if alive(w)}
    for w in left:  # (don't leave them behind for the next test)
        os.kill(w, signal.SIGKILL)
    assert not left, f"workers {sorted(left)} outlived their parent by {within} s"


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")

POOL = (
    "import sys, time, os\n"
    "from coda_lang.backend_cute.build import parallel\n"
    "ex = parallel._executor(2)\n"
    "futures = [ex.submit(time.sleep, 600) for _ in range(2)]\n"
    "print(' '.join(map(str, ex._processes)), flush=True)\n"
    "time.sleep(600)\n"
)


@needs_proc
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_compile_workers_end_with_their_parent(sig: int) -> None:
    """The pool's workers, busy with a task of ten minutes, end when the process that started them is
    killed."""
    proc = start([sys.executable, "-c", POOL])
    assert proc.stdout is not None
    workers = {int(p) for p in proc.stdout.readline().split()}
    assert len(workers) == 2 and workers <= children(proc.pid)
    time.sleep(1.0)  # (the workers start, and are busy)
    kill_and_check(proc, workers, sig)


@needs_proc
def test_fuzz_jobs_end_with_their_parent() -> None:
    proc = start(
        [sys.executable, "-m", "coda_lang.cli", "fuzz", "examples/llama_mlp.coda", "--examples", "100000"]
        + ["--jobs", "2", "-q"]
    )
    jobs = wait_for_children(proc, 2)
    time.sleep(2.0)  # (each job is fuzzing)
    kill_and_check(proc, jobs, signal.SIGKILL)


@needs_proc
@pytest.mark.slow
@pytest.mark.toolchain
@pytest.mark.parametrize(
    "command",
    [
        ["compile", "examples/llama_mlp.coda", "--emit", "ptx", "--backward"],
        ["tune", "examples/llama_mlp.coda", "--dims", "M=128,D=128,F=256", "--backward"],
    ],
    ids=["compile", "tune"],
)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_commands_leave_no_compile_workers(command: list[str], sig: int, tmp_path: Path) -> None:
    args = [sys.executable, "-m", "coda_lang.cli", *command]
    if command[0] == "compile":
        args += ["-o", str(tmp_path / "out")]
    proc = start(args, {"CODA_CACHE_DIR": str(tmp_path / "cache"), "CODA_JOBS": "2"})
    workers = wait_for_children(proc, 2)
    time.sleep(3.0)  # (compiling)
    kill_and_check(proc, workers, sig)
