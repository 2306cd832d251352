"""`coda fuzz --jobs N`: the cases of one fuzz run in N processes at once.

What it does: `run_jobs(args, argv)` splits the cases (or, with --programs, the programs) into N
shares and runs each as its own `coda fuzz` process: job i searches with seed S + i (S = --seed) and
takes its share of --examples (--programs). A case is CPU-bound (the interpreter's references, the
rounding bound, compiles), so on a machine with many cores N jobs finish about N times sooner; each job
gets its share of the compile workers ($CODA_JOBS). One progress display counts the jobs' cases
together (read from their progress lines). The first job to fail stops the others; its report (the
smallest failing case and the command that reproduces it, which needs no seed) is printed as it
gave it. When all pass, one ok line sums them.
What it does not: fuzz (each job is a plain `coda fuzz` run) or validate options (the caller has).
Invariants: exit 0 when every job passed, 1 when one failed (or the block can't run on the target),
2 when a job reports a usage error; no job outlives the call (Ctrl-C stops them all, and a job ends
with this process however it ends: SIGKILL too, core/orphans.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from coda_lang.cli.common import EXIT_ERRORS, EXIT_OK, EXIT_USAGE
from coda_lang.core.diagnostics import code_counts
from coda_lang.core.orphans import PARENT_ENV

_COUNT = re.compile(r": (\d+)/(\d+)(?: cases)?(?: \(|,|$)")
_OK_BLOCK = re.compile(
    r"^ok: (?P<name>\S+): (?P<cases>\d+) cases \((?P<what>.*)\), target (?P<target>\S+), seed"
)
_OK_PROGRAMS = re.compile(
    r"^ok: (?P<ran>\d+) random programs, (?P<cases>\d+) cases, target \S+, seed \S+?"
    r"(?P<skip>; (?P<skipped>\d+) skipped \(the target can't run them(?:: (?P<why>[^)]*))?\))? \("
)
_CODE = re.compile(r"error\[(E\d{4})\]")
_WHY = re.compile(r"(\S+) x(\d+)")


def skip_reasons(skipped: list[str]) -> str:
    """The diagnostics of the programs a target can't run, as counts by code: `E0702 x30, E0704 x2`
    (in code order; a message without a code counts as `other`)."""
    return code_counts([m.group(1) if (m := _CODE.search(line)) else "other" for line in skipped])


def summed_reasons(parts: list[str | None]) -> str:
    """`skip_reasons` of several jobs, added up by code."""
    return code_counts(
        [code for part in parts for code, n in _WHY.findall(part or "") for _ in range(int(n))]
    )


@dataclass
class Job:
    seed: int
    share: int
    proc: subprocess.Popen[str] | None = None
    done: int = 0
    stdout: str = ""
    stderr: list[str] = field(default_factory=list)
    readers: list[threading.Thread] = field(default_factory=list)


def shares(total: int, jobs: int) -> list[int]:
    """`total` split into at most `jobs` shares of at least one, the larger ones first."""
    jobs = max(1, min(jobs, total))
    return [total // jobs + (1 if i < total % jobs else 0) for i in range(jobs)]


def _read_stdout(job: Job) -> None:
    """The job's report (read as it comes: a pipe left unread could block the job)."""
    assert job.proc is not None and job.proc.stdout is not None
    job.stdout = job.proc.stdout.read()


def _read_stderr(job: Job) -> None:
    assert job.proc is not None and job.proc.stderr is not None
    for line in job.proc.stderr:
        line = line.rstrip("\n")
        m = _COUNT.search(line) if line.startswith("coda fuzz:") else None
        if m:
            job.done = int(m.group(1))
        else:
            job.stderr.append(line)


def _stop(jobs: list[Job]) -> None:
    """Interrupt the jobs still running (as Ctrl-C would: each stops its compile workers), then wait."""
    for j in jobs:
        if j.proc is not None and j.proc.poll() is None:
            j.proc.send_signal(signal.SIGINT)
    for j in jobs:
        if j.proc is not None:
            try:
                j.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                j.proc.kill()
                j.proc.wait()


def run_jobs(args: Any, argv: list[str]) -> int:
    """Run `coda fuzz` as `args.jobs` processes (the module docstring); `argv` is the command's own
    arguments (after `coda`), as given."""
    # lazy: imports hypothesis, which only the fuzzer needs
    from coda_lang.fuzz import Progress

    programs = args.programs is not None
    total = args.programs if programs else args.examples
    parts = shares(total, args.jobs)
    n = len(parts)
    env = dict(os.environ)
    if "CODA_JOBS" not in env:  # each job's compile workers: its share of the CPUs
        env["CODA_JOBS"] = str(max(1, (os.cpu_count() or 1) // n))
    env["PYTHONUNBUFFERED"] = "1"
    env[PARENT_ENV] = str(os.getpid())  # each job ends with this process, however it ends
    jobs = [Job(args.seed + i, share) for i, share in enumerate(parts)]
    # (argparse keeps the last of a repeated option: the job's own seed, share and --jobs 1 win)
    what = "--programs" if programs else "--examples"
    count = total * args.examples if programs else total
    label = (
        f"{args.programs} random programs, target {args.target}, {n} jobs"
        if programs
        else f"{os.path.basename(args.file)}, target {args.target}, {n} jobs"
    )
    progress = Progress(label, count, quiet=bool(args.quiet))
    t0 = time.monotonic()
    failed: Job | None = None
    try:
        for j in jobs:
            cmd = [sys.executable, "-m", "coda_lang.cli", *argv, "--jobs", "1", "--seed", str(j.seed)]
            cmd += [what, str(j.share)]
            j.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            j.readers = [
                threading.Thread(target=f, args=(j,), daemon=True) for f in (_read_stdout, _read_stderr)
            ]
            for t in j.readers:
                t.start()
        running = list(jobs)
        while running:
            time.sleep(0.2)
            done = sum(j.done for j in jobs)  # (cases: a --programs job counts them too)
            if done != progress.count:
                progress.advance(done - progress.count)
            for j in list(running):
                assert j.proc is not None
                if j.proc.poll() is None:
                    continue
                running.remove(j)
                for t in j.readers:
                    t.join(timeout=10)
                if j.proc.returncode != EXIT_OK and failed is None:
                    failed = j
            if failed is not None:
                _stop(running)
                break
    except KeyboardInterrupt:
        _stop(jobs)
        progress.close()
        return 130
    progress.close()
    for i, j in enumerate(jobs):  # (each job's notes count its own cases)
        for line in dict.fromkeys(x for x in j.stderr if x.startswith("note: ")):
            print(f"note (job {i + 1}, seed {j.seed}): {line.removeprefix('note: ')}", file=sys.stderr)
    if failed is not None:
        assert failed.proc is not None
        code = failed.proc.returncode
        rest = [line for line in failed.stderr if not line.startswith("note: ")]
        if rest:
            print("\n".join(rest), file=sys.stderr)
        sys.stdout.write(failed.stdout)
        print(f"(job {jobs.index(failed) + 1} of {n}, seed {failed.seed})", file=sys.stderr)
        if code in (EXIT_ERRORS, EXIT_USAGE):
            return code
        return EXIT_ERRORS if code != 130 else 130
    seconds = time.monotonic() - t0
    seeds = f"seeds {args.seed}..{args.seed + n - 1}"
    oks = [line for j in jobs for line in j.stdout.splitlines() if line.startswith("ok: ")]
    if programs:
        ms = [_OK_PROGRAMS.match(line) for line in oks]
        if not ms or not all(ms):  # (a line of another form: print the jobs' own)
            sys.stdout.write("".join(j.stdout for j in jobs))
            return EXIT_OK
        ran = sum(int(m.group("ran")) for m in ms if m)
        cases = sum(int(m.group("cases")) for m in ms if m)
        skipped = sum(int(m.group("skipped") or 0) for m in ms if m)
        why = summed_reasons([m.group("why") for m in ms if m])
        skip = (
            f"; {skipped} skipped (the target can't run them{': ' + why if why else ''})" if skipped else ""
        )
        print(
            f"ok: {ran} random programs, {cases} cases, target {args.target}, {seeds} ({n} jobs){skip} "
            f"({seconds:.1f} s)"
        )
        return EXIT_OK
    ms = [_OK_BLOCK.match(line) for line in oks]
    if not ms or not all(ms):
        sys.stdout.write("".join(j.stdout for j in jobs))
        return EXIT_OK
    first = ms[0]
    assert first is not None
    cases = sum(int(m.group("cases")) for m in ms if m)
    print(
        f"ok: {first.group('name')}: {cases} cases ({first.group('what')}), target {first.group('target')}, "
        f"{seeds} ({n} jobs) ({seconds:.1f} s)"
    )
    return EXIT_OK
