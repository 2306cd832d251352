"""Random programs fuzzed: `fuzz_programs`, and a failing one written to a file.

What it does: hypothesis draws a program (`coda_lang.testing.random_blocks`), the backward's policy
(unless fixed) and the program's cases, runs each as `fuzz_block` runs a block's, and on a mismatch
shrinks program and case together; programs the target can't run (an E07 code) are skipped and
counted; notes count the policies drawn, the chunked cases and the programs whose backward was left
out or unchunked. `save_program` writes a failing program to coda-fuzz-<hash>.coda.
What it does not: compare (compare.py) or make a program's block ready (fuzzer.py).
Invariants: a skipped program is no failure; counts stop at the first failure (the shrinking's
programs are not counted).
"""

from __future__ import annotations

import hashlib
import os
import time

from hypothesis import strategies as st

from coda_lang.api import load
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.core.diagnostics import CodaError, code_counts
from coda_lang.fuzz.case import DRAW, POLICIES, backward_options, first_line
from coda_lang.fuzz.fuzzer import Fuzzer
from coda_lang.fuzz.search import Failure, Progress, Result, check_case, run_search
from coda_lang.ir.types import FLOAT_DTYPES, FP8_DTYPES
from coda_lang.testing import random_blocks


def fuzz_programs(
    programs: int,
    target: str = "interp",
    *,
    examples: int = 5,
    seed: int = 0,
    max_dim: int | None = None,
    special: bool = False,
    backward: bool | BackwardOptions = True,
    shrink: bool = True,
    tile: tuple[int, int] | None = None,
    sim_tile: tuple[int, int] | None = None,
    progress: Progress | None = None,
    remat: str | None = None,
    chunk: int | str | None = DRAW,
    budget: int | None = None,
) -> Result:
    """Fuzz `programs` random blocks (`coda_lang.testing.random_blocks`), `examples` cases each; on a
    failure hypothesis shrinks the program and the case together. `backward` and its shorthands as
    `Fuzzer` takes them, except that without a policy (no `remat`, `backward` not a BackwardOptions)
    each program draws one, and `chunk` defaults to DRAW (each case of a program whose backward can
    run in chunks draws unchunked, a number of rows or a budget). TypeError or ValueError for a bad
    argument, before any program is drawn."""
    options, draw = backward_options(backward, remat, chunk, budget)
    draw_policy = options is not None and remat is None and not isinstance(backward, BackwardOptions)
    t0 = time.monotonic()
    failures: list[Failure] = []
    skipped: list[str] = []
    no_backward: list[str] = []
    no_chunks: list[str] = []
    policies: list[str] = []
    count = [0, 0]
    ran = [0]  # programs run, as counted (hypothesis may draw more than `programs`, or fewer)

    def test(data: st.DataObject) -> None:
        fw = data.draw(
            random_blocks(
                ("f32", "bf16", "f16") if target == "interp" else ("bf16", "f16"),
                # fp8 stores on every target: the kernels store the fp8 tile a stage quantizes (a
                # program whose fp8 use they can't compile yet is E07: skipped and counted)
                FLOAT_DTYPES + FP8_DTYPES,
                block_scales=target == "interp",  # (E0709 on the kernels: a skipped program there)
            ),
            label="program",
        )
        opts = options
        if opts is not None and draw_policy:
            opts = opts.with_(remat=data.draw(st.sampled_from(POLICIES), label="remat"))
        block = load(fw.text)["fwd"]
        try:
            fz = Fuzzer(
                block,
                target,
                backward=False if opts is None else opts,
                chunk=DRAW if draw else None,
                special=special,
                tile=tile,
                sim_tile=sim_tile,
            )
        except CodaError as e:  # the target can't run it (E07): not a failure
            if not failures:
                skipped.append(first_line(e))
            return
        if not failures:
            ran[0] += 1
            if fz.backward_error:
                no_backward.append(fz.backward_error)
            elif opts is not None:
                policies.append(opts.remat)
            if fz.chunk_error:
                no_chunks.append(fz.chunk_error)
        strategy = fz.cases(max_dim)
        for _ in range(examples):
            check_case(fz, data.draw(strategy, label="case"), failures, count, progress, program=fw.text)

    failure = run_search(test, st.data(), programs, seed, shrink, failures)
    if progress:
        progress.done()
    notes = []
    if policies:
        notes.append(
            "backward checked under "
            + ", ".join(f"--remat {p} x{policies.count(p)}" for p in POLICIES if p in policies)
        )
    if no_backward:
        notes.append(f"backward not checked for {len(no_backward)} programs ({code_counts(no_backward)})")
    if count[1]:
        notes.append(f"{count[1]} cases ran the backward in row chunks")
    if no_chunks:
        notes.append(
            f"backward not chunked for {len(no_chunks)} programs ({code_counts(no_chunks)}), checked unchunked"
        )
    return Result(count[0], failure, notes, time.monotonic() - t0, skipped, count[1], programs=ran[0])


def save_program(text: str, folder: str = ".") -> str:
    """Write a failing random program to `folder`/coda-fuzz-<hash>.coda; its path."""
    path = os.path.join(folder, f"coda-fuzz-{hashlib.sha256(text.encode()).hexdigest()[:10]}.coda")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
