"""Choose a stage's tile by compiling: the first candidate without register spills, or every such one.

What it does: `select_config` tries tile configs in order and keeps the first whose ptxas report
shows no register spills (heavy epilogues spill at quack's default 128x192); `configs_without_spills`
gives every candidate of `TUNE_CANDIDATES` that passes that check, for the runtime to time on a GPU
(runtime/tuning.py, tune.py). Both take `jobs=`: the kernels they will read are first compiled in
worker processes (parallel.py).
What it does not: time kernels (tune.py) or compile them itself (compile.py).
Invariants: CodaError E0706 when every candidate spills, E0707 when quack refused every candidate.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coda_lang.backend_cute.build import parallel
from coda_lang.backend_cute.build.compile import CompiledStage, compile_spec
from coda_lang.backend_cute.build.config import (
    CUBLAS,
    SMALL_SPILL,
    TileConfig,
    candidates_for,
    fallback_candidates_for,
    fits,
    is_plain,
    rules,
    tune_candidates_for,
)
from coda_lang.backend_cute.plan.planner import plan_stage
from coda_lang.backend_cute.plan.spec import StageSpec
from coda_lang.core.diagnostics import CodaError, error


def select_config(
    block: Any,
    index: int,
    candidates: tuple[TileConfig, ...] | None = None,
    *,
    directory: Path | None = None,
    jobs: int | None = 1,
    fallback: bool = True,
) -> CompiledStage:
    """The first candidate tile whose kernel compiles and has no register spills (CodaError E0706 if
    none; E0707 if quack refused every candidate); `candidates`: default candidates_for(the stage);
    `fallback`: where every candidate spills, the stage's fallback tiles next (config.py).
    `jobs`: worker processes for the kernels not in the
    cache yet (None: parallel.default_jobs; 1: compile them here, one after another)."""
    spec = plan_stage(block, index)
    if candidates is None:
        candidates = candidates_for(spec)
    if jobs != 1:
        parallel.warm([parallel.Request(spec, candidates, first=True)], jobs=jobs, directory=directory)
    tried: list[str] = []
    refused: list[CodaError] = []
    # where every candidate spills (or none fits), the stage's fallback tiles after them
    # (config.FALLBACK_CANDIDATES); not where quack refused every one it tried (E0707, below)
    more = tuple(c for c in fallback_candidates_for(spec) if c not in candidates) if fallback else ()
    for i, config in enumerate(candidates + more):
        if i == len(candidates):
            if tried and len(refused) == len(tried):
                break
            if jobs != 1:
                parallel.warm([parallel.Request(spec, more, first=True)], jobs=jobs, directory=directory)
        if not fits(spec, config):
            continue
        try:
            c = compile_spec(spec, config, directory=directory)
        except CodaError as e:  # quack refuses this tile for this epilogue (E0707): try the next
            refused.append(e)
            tried.append(f"{config}: {e.diagnostics[0].notes[0] if e.diagnostics[0].notes else 'refused'}")
            continue
        assert c.report is not None
        if not c.report.spills:
            c.rejected = tuple(tried)
            return c
        tried.append(f"{config}: {c.report}")
    if refused and len(refused) == len(tried):
        raise refused[0]
    if not tried:  # (no candidate, nor fallback, satisfies the stage's rules: nothing was compiled)
        raise error(
            "E0706",
            f"stage {index} (`{spec.text}`): no candidate tile satisfies its tiling constraints",
            spec.span,
            notes=[str(c) for c in rules(spec)],
            help=[
                'write the stage so that one of the backend\'s tiles fits it (docs/backend.md, "Tiles and tuning")'
            ],
        )
    raise error(
        "E0706",
        f"stage {index} (`{spec.text}`) spills registers at every tile configuration tried",
        spec.span,
        notes=tried or ["no candidate tile satisfies the stage's tiling constraints"],
        help=["split the epilogue across stages, or store fewer values from this stage"],
    )


def configs_without_spills(
    spec: StageSpec,
    candidates: tuple[TileConfig, ...] | None = None,
    *,
    directory: Path | None = None,
    jobs: int | None = 1,
) -> list[TileConfig]:
    """The candidates that fit the stage's tiling constraints, compile, and whose kernels don't spill
    (and `CUBLAS` first for a plain stage), then those that spill at most `SMALL_SPILL` bytes each way
    (a few words of the epilogue, e.g. the recomputed LM head's backward with five row vectors loaded:
    4-12 bytes at 128x128 and 256x128 against 1 KB at 128x192). The tuner times them all and keeps
    the fastest: a few words of spill can be the faster kernel (the fp8 QKV data gradient's 4 bytes at
    128x96 on an H200), or not (the SwiGLU backward's 8 at 128x192 with its K-major copies).
    `jobs` as select_config's; `candidates`: default tune_candidates_for(spec)."""
    if candidates is None:
        candidates = tune_candidates_for(spec)
    if jobs != 1:
        parallel.warm([parallel.Request(spec, candidates)], jobs=jobs, directory=directory)
    out = [CUBLAS] if is_plain(spec) else []
    small: list[TileConfig] = []
    for config in candidates:
        if not fits(spec, config):
            continue
        try:
            c = compile_spec(spec, config, directory=directory)
        except CodaError:  # quack refuses this tile for this epilogue (E0707): not a candidate
            continue
        assert c.report is not None
        if not c.report.spills:
            out.append(config)
        elif max(c.report.spill_stores, c.report.spill_loads) <= SMALL_SPILL:
            small.append(config)
    if len(out) > is_plain(spec) or small:
        return out + small
    fallback = tuple(c for c in fallback_candidates_for(spec) if c not in candidates)
    if not fallback:
        return out
    # every candidate spills: the fallback tiles (config.FALLBACK_CANDIDATES), which only such a stage tries
    return out + [
        c for c in configs_without_spills(spec, fallback, directory=directory, jobs=jobs) if c is not CUBLAS
    ]
