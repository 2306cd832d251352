"""The search: hypothesis draws cases, runs each, and on a mismatch shrinks it (`fuzz_block`).

What it does: `fuzz_block` runs a block's cases (or the one case that given dims and seed fix) under
hypothesis's settings for fuzzing (seeded, no database, no deadline, shrinking unless turned off),
stops at the first mismatch and keeps the smallest failing case; `Progress` shows cases done (then
the shrinking tries); `Failure` and `Result` are what a run reports.
What it does not: make the block ready (fuzzer.py), compare (compare.py) or draw programs
(programs.py).
Invariants: the same seed finds the same failure; cases are counted until the first failure only
(the shrinking's tries are not cases); a failure that does not come again when replayed is reported
as flaky, not dropped.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Flaky

from coda_lang.api import Block
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.core import progress
from coda_lang.fuzz.case import Case
from coda_lang.fuzz.fuzzer import Fuzzer


class Progress(progress.Progress):
    """`coda fuzz`'s progress (coda_lang.core.progress): cases done of the total and the time left, the case
    running on a terminal; once a case fails, the shrinking tries instead."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, quiet: bool = False):
        self.failed = 0
        self.shrinks = 0
        self.case: Case | None = None
        super().__init__(f"coda fuzz: {label}", total, unit="cases", stream=stream, quiet=quiet, interval=1.0)

    def step(self, failing: bool, case: Case | None = None) -> None:
        self.case = case
        if self.failed:
            self.shrinks += 1
            self.failed += failing
            self.show()
        else:
            self.failed += failing
            self.advance()

    def text(self) -> str:
        if self.failed:
            return f"{self.label}: failure found after {self.count} cases; shrinking ({self.shrinks} tries)"
        self.what = self.case.describe() if self.case is not None and self.tty else ""
        return super().text()

    def done(self) -> None:
        self.close()


@dataclass
class Failure:
    case: Case
    messages: list[str]
    program: str | None = None  # fuzz_programs: the failing program's source
    flaky: bool = False


@dataclass
class Result:
    cases: int
    failure: Failure | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # fuzz_programs: programs the target can't run
    chunked: int = 0  # cases whose backward ran in row chunks
    programs: int = 0  # fuzz_programs: programs run (skipped ones not counted)


class Mismatch(Exception):
    pass


def _settings(examples: int, shrink: bool) -> settings:
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(
        max_examples=examples,
        database=None,
        deadline=None,
        derandomize=False,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
        print_blob=False,
    )


def run_search(
    test: Callable[..., None],
    strategy: st.SearchStrategy[Any],
    examples: int,
    seed: int,
    shrink: bool,
    failures: list[Failure],
) -> Failure | None:
    wrapped = hypothesis_seed(seed)(_settings(examples, shrink)(given(strategy)(test)))
    try:
        wrapped()
    except Mismatch:
        return failures[-1]
    except Flaky:
        if failures:
            failures[-1].flaky = True
            return failures[-1]
        raise
    return None


def check_case(
    fz: Fuzzer,
    case: Case,
    failures: list[Failure],
    count: list[int],
    progress: Progress | None,
    program: str | None = None,
) -> None:
    """Run one case: count it (until the first failure), report progress, and on a mismatch record
    the failure and stop hypothesis's test (`Mismatch`)."""
    msgs = fz.check(case)
    if not failures:
        count[0] += 1
        count[1] += case.backward is not None and case.backward.chunked
    if progress:
        progress.step(bool(msgs), case)
    if msgs:
        failures.append(Failure(case, msgs, program=program))
        raise Mismatch()


def fuzz_block(
    block: Block,
    target: str = "interp",
    *,
    examples: int = 100,
    seed: int = 0,
    max_dim: int | None = None,
    dims: dict[str, int] | None = None,
    input_seed: int | None = None,
    tile: tuple[int, int] | None = None,
    sim_tile: tuple[int, int] | None = None,
    special: bool = False,
    backward: bool | BackwardOptions = True,
    shrink: bool = True,
    progress: Progress | None = None,
    fuzzer: Fuzzer | None = None,
    remat: str | None = None,
    chunk: int | str | None = None,
    budget: int | None = None,
    chunk_dim: str | None = None,
) -> Result:
    """Fuzz one block (see the package docstring). `backward` and its shorthands (`remat`, `chunk`,
    `budget`, `chunk_dim`) as `Fuzzer` takes them. CodaError if it can't run on the target at all.
    `fuzzer`: a Fuzzer made already (then target, tiles, special and the backward's options are its
    own)."""
    t0 = time.monotonic()
    fz = fuzzer or Fuzzer(
        block,
        target,
        backward=backward,
        special=special,
        tile=tile,
        sim_tile=sim_tile,
        remat=remat,
        chunk=chunk,
        budget=budget,
        chunk_dim=chunk_dim,
    )
    failures: list[Failure] = []
    count = [0, 0]

    def test(case: Case) -> None:
        check_case(fz, case, failures, count, progress)

    single = fz.single_case(dims, input_seed)
    if single is not None:  # everything fixed (reproducing a case): run it once
        with contextlib.suppress(Mismatch):
            test(single)
        failure = failures[-1] if failures else None
    else:
        failure = run_search(test, fz.cases(max_dim, dims, input_seed), examples, seed, shrink, failures)
    if progress:
        progress.done()
    return Result(count[0], failure, fz.notes, time.monotonic() - t0, chunked=count[1])
