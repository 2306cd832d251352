"""A stage's tile: the one given, checked against its rules, or else the first candidate without spills.

What it does: `as_config` reads a tile argument; `given_tiles` reads a CUDA block's `tile=` (one tile
for every GEMM stage, or a dict by stage) and refuses a tile that breaks one of its stage's rules
(E0805, listing them: build/config.py's `broken`); `choose_config` asks select.select_config for the
first candidate tile (config.CANDIDATES) that fits the stage's tiling constraints and compiles without
register spills (cached per emitted source in this process), or takes the first that fits when
emulating or when no ptxas can be found (`find_ptxas`: $CODA_PTXAS, PATH, else Triton's).
`precompile` compiles, at once and in worker processes (parallel.py), every kernel the first calls of
some CUDA blocks will ask for (a block and its autograd backward together): each stage's given tile,
else its select_config candidates and, when the block tunes, every candidate the tuner times; what
the cache holds already costs nothing. In the background (a first call's default), it returns once
every stage has a kernel without spills, and the other candidates compile on.
`first_compiled` is the stage's tile while kernels compile in the background: the first candidate
(in select_config's order, then the tuner's) that the cache holds without spills.
What it does not: time anything on the GPU (tuning.py's Tuner does, through build/tune.py).
Invariants: a stage with no fitting candidate is E0706; any other failure falls back to the first
fitting candidate with a warning, never an exception; `precompile` never raises for a kernel (the
stage's own compile reports it) and, unless `strict`, not for a missing toolchain either.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coda_lang.backend_cute.build.cache import Kernel
from coda_lang.backend_cute.build.config import (
    TileConfig,
    broken,
    candidates_for,
    fallback_candidates_for,
    fits,
    rules,
    tune_candidates_for,
)
from coda_lang.backend_cute.build.ptxas import BackendUnavailable
from coda_lang.backend_cute.plan.emit import emit_stage, source_hash
from coda_lang.backend_cute.plan.spec import StageSpec
from coda_lang.core.diagnostics import CodaError, Diagnostic, error

if TYPE_CHECKING:
    from coda_lang.backend_cute.build.parallel import Warmed

_SELECTED: dict[tuple[str, tuple[TileConfig, ...]], TileConfig] = {}


def find_ptxas() -> bool:
    """ptxas for select_config's spill check: $CODA_PTXAS, PATH, else the one Triton ships (then
    $CODA_PTXAS is set to it for this process)."""
    if os.environ.get("CODA_PTXAS") or shutil.which("ptxas"):
        return True
    try:
        import triton
    except ImportError:
        return False
    exe = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if exe.is_file() and os.access(exe, os.X_OK):
        os.environ["CODA_PTXAS"] = str(exe)
        return True
    return False


def as_config(tile: Any) -> TileConfig:
    """A TileConfig from a TileConfig or a (tile_M, tile_N) pair (quack's SM90 cluster and pingpong)."""
    if isinstance(tile, TileConfig):
        return tile
    if isinstance(tile, (tuple, list)) and len(tile) == 2 and all(isinstance(x, int) for x in tile):
        return TileConfig(int(tile[0]), int(tile[1]))
    raise TypeError(f"a tile is a TileConfig or (tile_M, tile_N), got {tile!r}")


def given_tiles(
    name: str, specs: Sequence[StageSpec | None], tile: Any, emulate: bool
) -> dict[int, TileConfig]:
    """{stage: tile} of the GEMM stages a CUDA block's `tile=` fixes (`specs`: the block's, None for an
    elementwise stage): every one for a tile, the ones named for a dict, none for None. ValueError for
    a stage that is elementwise or not there; E0805 for a tile that breaks a rule of its stage."""
    gemms = [k for k, spec in enumerate(specs, 1) if spec is not None]
    if isinstance(tile, dict):
        tiles = {int(k): as_config(v) for k, v in tile.items()}
        unknown = sorted(set(tiles) - set(gemms))
        if unknown:
            raise ValueError(
                f"stage {unknown[0]} of block {name} is elementwise: it has no tile"
                if 1 <= unknown[0] <= len(specs)
                else f"block {name} has no stage {unknown[0]}"
            )
    else:
        tiles = {k: as_config(tile) for k in gemms} if tile is not None else {}
    for k, cfg in tiles.items():
        target = specs[k - 1]
        assert target is not None
        why = broken(target, cfg, emulate)
        if why:
            raise error(
                "E0805",
                f"tile {cfg.short} does not fit stage {k} (`{target.text}`): {'; '.join(map(str, why))}",
            )
    return tiles


def choose_config(block: Any, index: int, spec: StageSpec, emulate: bool) -> TileConfig:
    """select_config's tile for a stage (cached per emitted source); without a usable ptxas, or when
    emulating, the first candidate that fits the stage's tiling constraints."""
    candidates = tuple(c for c in candidates_for(spec) if fits(spec, c, emulate))
    if not candidates:  # (where none of its candidates fits, the stage's fallback tiles: config.py)
        candidates = tuple(c for c in fallback_candidates_for(spec) if fits(spec, c, emulate))
    if not candidates:
        raise CodaError(
            [
                Diagnostic(
                    "E0706",
                    f"stage {index} (`{spec.text}`): no candidate tile satisfies its tiling constraints",
                    spec.span,
                    notes=[str(c) for c in rules(spec, emulate)],
                )
            ]
        )
    if emulate:
        return candidates[0]
    key = (source_hash(emit_stage(spec)), candidates)
    if key not in _SELECTED:
        # lazy: imports NumPy, which `coda check` and `import coda_lang` never load
        from coda_lang.backend_cute.build.select import (
            select_config,
        )

        if not find_ptxas():
            warnings.warn(
                f"no ptxas to check stage {index} of {spec.block} for spills; using {candidates[0]}",
                stacklevel=3,
            )
            return candidates[0]
        try:
            _SELECTED[key] = select_config(block, index, candidates).config
        except (BackendUnavailable, RuntimeError) as e:
            warnings.warn(
                f"select_config failed for stage {index} of {spec.block} ({str(e).splitlines()[0]}); "
                f"using {candidates[0]}",
                stacklevel=3,
            )
            return candidates[0]
    return _SELECTED[key]


def first_compiled(spec: StageSpec) -> TileConfig | None:
    """The first candidate (select_config's order, then the tuner's) whose kernel the cache already
    holds without spills: a stage's tile while its other candidates still compile in the background."""

    source = emit_stage(spec)
    for c in dict.fromkeys((*candidates_for(spec), *tune_candidates_for(spec))):
        if fits(spec, c) and Kernel(spec, c, source=source).status() == "ok":
            return c
    return None


def precompile(
    blocks: Sequence[Any],
    *,
    jobs: int | None = None,
    quiet: bool = False,
    strict: bool = False,
    background: bool = False,
) -> Warmed | None:
    """Compile every kernel the first calls of these CUDA blocks (`CudaBlock`s) will ask for, at once
    (see the module docstring); each block is done once per process. None when there was nothing to
    do or no toolchain (`strict`: BackendUnavailable is raised instead). `background`: return once
    each stage has a kernel without spills, the other candidates compiling on (each block's
    `tuner.background` then says whether they are done)."""
    # lazy: imports NumPy, which `coda check` and `import coda_lang` never load
    from coda_lang.backend_cute.build import (
        parallel,
    )

    requests: list[parallel.Request] = []
    names: list[str] = []
    mine: list[Any] = []  # the blocks compiled now
    for cb in blocks:
        if cb.emulate or cb._precompiled:
            continue
        cb._precompiled = True
        mine.append(cb)
        names.append(cb.name)
        for k in cb.gemm_stages:
            spec = cb.specs[k - 1]
            given = cb._tiles.get(k)
            if given is not None:
                if not given.is_cublas:
                    requests.append(parallel.Request(spec, (given,)))
                continue
            requests.append(parallel.Request(spec, candidates_for(spec), first=True))
            if cb.tune:
                requests.append(parallel.Request(spec, tune_candidates_for(spec)))
    if not requests:
        return None
    if not find_ptxas():
        if strict:
            raise BackendUnavailable("ptxas not found (install the CUDA toolkit, or set CODA_PTXAS)")
        return None
    try:
        done = parallel.warm(
            requests,
            jobs=jobs,
            quiet=quiet,
            label=f"coda: compiling {', '.join(dict.fromkeys(names))}",
            background=background,
        )
    except BackendUnavailable:
        if strict:
            raise
        return None
    for cb in mine:
        cb.tuner.background = done.background
    return done
