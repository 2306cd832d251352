"""Compile a stage to PTX for sm_90a (no GPU needed) and check it with ptxas.

What it does: `compile_spec` emits a planned stage, compiles it through quack_adapter (or takes the
PTX from the kernel cache, cache.py) and runs `ptxas -v` on it (or reads the report kept beside the
PTX); `compile_stage` plans and compiles stage k of a checked block.
What it does not: choose a tile (select.py, tune.py), run several compiles at once (parallel.py),
plan or emit (plan/), or touch quack itself (quack_adapter.py, imported only when a kernel really has
to be compiled).
Invariants: a program the backend can't compile raises CodaError (E07); a missing toolchain raises
`BackendUnavailable`; a tile quack refused once is refused again from its record (E0707), not
compiled again; two processes asking for one kernel compile it once (the entry's lock); a PTX enters
the cache only whole (`IncompletePTX` otherwise: CuTeDSL's dump cut short by a full disk or a
file-size limit) and once ptxas accepted it; a cached entry ptxas refuses (one an older coda_lang
recorded) is removed and built again.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coda_lang.backend_cute.build.cache import (
    Kernel,
    cached_compile_s,
    cached_ptxas,
    complete_ptx,
    forget,
    read_ptxas_record,
)
from coda_lang.backend_cute.build.config import DEFAULT_CONFIG, TileConfig
from coda_lang.backend_cute.build.ptxas import BackendUnavailable, PtxasReport
from coda_lang.backend_cute.build.store import entry_lock, staged, subfolder, write_atomic, write_source
from coda_lang.backend_cute.plan.planner import plan_stage
from coda_lang.backend_cute.plan.spec import StageSpec


@dataclass
class CompiledStage:
    spec: StageSpec
    source: str
    source_path: Path
    config: TileConfig
    ptx_path: Path
    compile_s: float  # seconds CuTeDSL took (when the PTX was compiled, not cached)
    cached: bool
    report: PtxasReport | None = None
    rejected: tuple[str, ...] = ()  # select_config: the tiles tried first, and why they were not kept

    @property
    def ptx(self) -> str:
        return self.ptx_path.read_text()

    @property
    def setmaxnreg(self) -> tuple[int, ...]:
        """Per-warpgroup register counts the kernel sets (warp-specialized: the producer gives registers
        back, the consumer (MMA + epilogue) warpgroups take them); ptxas's "Used N registers" is the
        launch-time count of all 384 threads."""
        return tuple(
            int(n) for n in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", self.ptx)
        )


def _adapter() -> Any:
    try:
        # lazy: imports CuTeDSL and quack (seconds), which only a real compile or launch needs
        from coda_lang.backend_cute.build import quack_adapter
    except ImportError as e:
        raise BackendUnavailable(
            f"the CuTeDSL backend needs nvidia-cutlass-dsl and quack-kernels: {e}"
        ) from None
    return quack_adapter


def cached(k: Kernel, src_path: Path) -> CompiledStage | None:
    """The entry of `k` as a CompiledStage, when the cache holds it whole (see cache.cached_compile_s)."""
    seconds = cached_compile_s(k.ptx_path, k.meta_path)
    if seconds is None:
        return None
    return CompiledStage(k.spec, k.source, src_path, k.config, k.ptx_path, seconds, True)


class IncompletePTX(OSError):
    """CuTeDSL's PTX of a kernel came back cut short (its dump file was: a full disk, a file-size
    limit): nothing is cached."""


def build(k: Kernel, src_path: Path, ptxas: bool = True) -> CompiledStage:
    """Compile kernel `k` (the caller holds the entry's lock), record its PTX, or its refusal (E0707).
    The PTX enters the cache only whole and, with `ptxas`, once ptxas accepted it (its report kept)."""
    adapter = _adapter()
    try:
        text, seconds = adapter.compile_ptx(k.spec, src_path, k.config, k.root)
    except (MemoryError, OSError):  # not the kernel's fault: nothing recorded
        raise
    except Exception as e:  # quack or CuTeDSL refused the kernel: say where its source is
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        error = f"{type(e).__name__}: {first}"
        write_atomic(k.refused_path, json.dumps({"key": k.key, "error": error}))
        raise k.refused_error(error, src_path) from e
    if not complete_ptx(text):
        raise IncompletePTX(
            errno.EIO,
            f"the PTX CuTeDSL made for {k.spec.block} stage {k.spec.index} at {k.config.short} is cut "
            f"short ({len(text.encode()):,} bytes; a full disk or a file-size limit?); nothing was cached",
        )
    report = None
    with staged(k.ptx_path, text) as tmp:
        if ptxas:  # (RuntimeError when ptxas refuses it: then it never enters the cache)
            report = cached_ptxas(k.ptx_path, staged=tmp)
        os.replace(tmp, k.ptx_path)
    meta = {
        "compile_s": seconds,
        "config": asdict(k.config),
        "source": src_path.name,
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
    }
    write_atomic(k.meta_path, json.dumps(meta))  # last: the entry counts once it names the hash
    k.refused_path.unlink(missing_ok=True)
    return CompiledStage(k.spec, k.source, src_path, k.config, k.ptx_path, seconds, False, report)


def compile_spec(
    spec: StageSpec,
    config: TileConfig = DEFAULT_CONFIG,
    *,
    ptxas: bool = True,
    directory: Path | None = None,
    wait: bool = True,
) -> CompiledStage:
    """Emit, compile (or reuse the cached PTX) and check one planned stage. A tile quack refused once
    is refused again from its record (E0707), not compiled again. `wait=False`: when another process
    is building this kernel, raise store.EntryBusy instead of waiting for it."""
    k = Kernel(spec, config, directory)
    src_path = write_source(k.source, k.root)
    subfolder(k.root, "ptx")
    out = cached(k, src_path)
    if out is None or (ptxas and read_ptxas_record(k.ptx_path) is None):
        with entry_lock(k.lock_path, wait):  # another process may be building it: wait, then look again
            out = cached(k, src_path)
            if out is not None and ptxas:
                try:
                    out.report = cached_ptxas(k.ptx_path)
                except RuntimeError:  # ptxas refuses the cached PTX (an older coda_lang kept it): rebuild
                    forget(k)
                    out = None
            if out is None:
                error = k.refusal()
                if error is not None:
                    raise k.refused_error(error, src_path)
                out = build(k, src_path, ptxas)
    elif ptxas:
        out.report = read_ptxas_record(k.ptx_path)
    return out


def compile_stage(
    block: Any,
    index: int,
    config: TileConfig = DEFAULT_CONFIG,
    *,
    ptxas: bool = True,
    directory: Path | None = None,
) -> CompiledStage:
    """Stage `index` (1-based) of a checked `coda_lang.api.Block`, compiled at tile `config`."""
    return compile_spec(plan_stage(block, index), config, ptxas=ptxas, directory=directory)
