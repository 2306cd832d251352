"""Tile choice for a stage when the caller gives none: the first candidate whose kernel does not spill.

What it does: `as_config` reads a tile argument; `choose_config` asks compile.select_config for the
first candidate tile (compile.CANDIDATES) that fits the stage's tiling constraints and compiles without
register spills (cached per emitted source in this process), or takes the first that fits when
emulating or when no ptxas can be found (`find_ptxas`: $CODA_PTXAS, PATH, else Triton's).
What it does not: time anything on the GPU (the CUDA block's tuner does, through tune.py).
Invariants: a stage with no fitting candidate is E0706; any other failure falls back to the first
fitting candidate with a warning, never an exception.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from coda_lang.backend_cute.compile import CANDIDATES, PAIRED_SUBTILE, BackendUnavailable, TileConfig, fits
from coda_lang.backend_cute.emit import emit_stage, source_hash
from coda_lang.backend_cute.spec import StageSpec
from coda_lang.verify.diagnostics import CodaError, Diagnostic

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


def choose_config(block: Any, index: int, spec: StageSpec, emulate: bool) -> TileConfig:
    """select_config's tile for a stage (cached per emitted source); without a usable ptxas, or when
    emulating, the first candidate that fits the stage's tiling constraints."""
    candidates = tuple(c for c in CANDIDATES if fits(spec, c, emulate))
    if not candidates:
        raise CodaError(
            [
                Diagnostic(
                    "E0706",
                    f"stage {index} (`{spec.text}`): no candidate tile satisfies its tiling constraints",
                    spec.span,
                    notes=list(spec.constraints) + [PAIRED_SUBTILE] * spec.paired,
                )
            ]
        )
    if emulate:
        return candidates[0]
    key = (source_hash(emit_stage(spec)), candidates)
    if key not in _SELECTED:
        from coda_lang.backend_cute.compile import select_config

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
