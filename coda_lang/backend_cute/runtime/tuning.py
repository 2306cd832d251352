"""When and at which tile a CUDA block's stages are tuned, and the kernels' runtime imported early.

What it does: `Tuner` (one per CudaBlock) gives a stage's runner at the fastest spill-free tile for
its GEMM shape (`tuned`): from this block's memory (`by_shape`), else the tuning cache on disk, else
measured now on the launch's own arguments (`choose`: build/tune.py times the candidates that
select.configs_without_spills leaves, pruned by the nearest shape tuned before, and keeps the choice
on disk; a kernel that hangs is E0810 and recorded). While the block's kernels still compile in the
background (`background`, which tiles.precompile sets) a stage is not timed: it runs at the tile it
has (`measure`), since timings taken while the workers load every CPU are not to be trusted; under a
torch.compile trace, whose graph keeps the tile it is given, it waits for them instead.
`preload_runtime` imports the kernels' runtime (CuTeDSL, quack) in a thread while the first call
waits for the compile workers.
What it does not: compile kernels (tiles.py, build/parallel.py), time them itself (build/tune.py), or
decide whether a stage is tuned at all (the CUDA block's `tune` and given tiles do).
Invariants: a shape's choice is kept (`by_shape`) only once it is final, so a stage timed while
kernels compile is timed again later; without ptxas, or when nothing could be timed, the stage keeps
the runner it was given; nothing here runs while a call is traced except the wait for the compiles.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import sys
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from coda_lang.backend_cute.build import select, tune
from coda_lang.backend_cute.build.config import fp8_tuning_variant
from coda_lang.backend_cute.plan.emit import emit_stage
from coda_lang.backend_cute.runtime.capture import capturing, refuse_in_capture
from coda_lang.backend_cute.runtime.launch import StageRunner
from coda_lang.backend_cute.runtime.tiles import find_ptxas
from coda_lang.core.diagnostics import error
from coda_lang.core.progress import Progress

if TYPE_CHECKING:
    from coda_lang.backend_cute.build.parallel import Background

# (stage, m, n, k): a stage's GEMM shape
ShapeKey = tuple[int, int, int, int]


class Tuner:
    """The tuned runners of one block's stages (see the module docstring); `emulate` and `poison` are
    the block's, for the runners it makes at other tiles."""

    def __init__(self, block: Any, *, emulate: bool = False, poison: bool = False):
        self.block, self.emulate, self.poison = block, emulate, poison
        self.name = block.ir.name
        self.by_shape: dict[ShapeKey, StageRunner] = {}  # (stage, m, n, k) -> tuned
        self.background: Background | None = None  # the tuner's candidates still compiling, if any
        self.warned = False  # (that a CUDA graph was captured while they compiled)

    def tuned(
        self, k: int, r: StageRunner, ins: list[torch.Tensor | None], scalars: list[float]
    ) -> StageRunner:
        """Stage k's runner at the fastest non-spilling tile for this GEMM shape: from this block's
        memory, else the tuning cache on disk, else measured now on these very arguments."""
        A, B = ins[0], ins[1]
        assert A is not None and B is not None
        spec = r.spec
        n = B.shape[0] if spec.gemm.tb else B.shape[1]
        key = (k, int(A.shape[0]), int(n), int(A.shape[1]))
        got = self.by_shape.get(key)
        if got is None:
            got, final = self.measure(k, r, ins, scalars, key, torch.compiler.is_compiling())
            if final:
                self.by_shape[key] = got
        return got

    @torch.compiler.disable
    def measure(
        self,
        k: int,
        r: StageRunner,
        ins: list[torch.Tensor | None],
        scalars: list[float],
        key: ShapeKey,
        wait: bool = False,
    ) -> tuple[StageRunner, bool]:
        """(the runner to launch, whether it is this shape's final choice). While kernels of its
        compile are still compiling in the background: the stage's first compiled tile, not final
        (timings taken while the workers load every CPU are not to be trusted; `wait`: under a
        torch.compile trace, whose graph keeps what it is given, wait for them instead)."""
        bg = self.background
        if bg is not None and not bg.over:
            if not wait:
                if capturing() and not self.warned:
                    self.warned = True
                    warnings.warn(
                        f"coda: a CUDA graph captured block {self.name} while its other candidate tiles "
                        "were still compiling: the graph keeps each stage at the tile it runs now. Call "
                        "coda_lang.torch.wait_for_kernels() and run a step before capturing, for the tuned tiles",
                        stacklevel=2,
                    )
                return r, False
            bg.wait()
        return self.choose(k, r, ins, scalars, key), True

    def choose(
        self,
        k: int,
        r: StageRunner,
        ins: list[torch.Tensor | None],
        scalars: list[float],
        key: ShapeKey,
    ) -> StageRunner:
        """Stage k's runner at the tile the tuning cache holds for this shape and GPU, else at the
        fastest of its spill-free candidates timed now (and stored there); `r` when there is nothing to
        time (no ptxas, or no candidate gave a time)."""
        spec = r.spec
        A = ins[0]
        assert A is not None
        source, shape, device = emit_stage(spec), key[1:], torch.cuda.get_device_name(A.device)
        # (another candidate set: its own choice on disk)
        disk = tune.disk_key(source, shape, device, fp8_tuning_variant(spec))
        cached = tune.lookup(disk)
        if cached is None:
            if not find_ptxas():
                return r
            refuse_in_capture(
                f"stage {k} of {self.name} would be tuned at {'x'.join(map(str, shape))} (timing its tiles "
                "waits for the GPU)",
                "run the step once (after coda_lang.torch.wait_for_kernels()) before capturing it, or give "
                "tiles (tile=) or set CODA_TUNE=0",
            )
            hung = tune.hung(source, device)
            configs, skipped = tune.prune(
                [c for c in select.configs_without_spills(spec) if c not in hung], source, shape, device
            )
            runners = {
                c: r if c == r.config else StageRunner(self.block, k, spec, c, self.emulate, self.poison)
                for c in configs
            }

            def launch(x: StageRunner) -> Callable[[], Any]:
                return lambda: torch.ops.coda.stage(x.key, ins, scalars)

            what = f"coda: tuning stage {k} of {self.name} at {'x'.join(map(str, shape))}"
            with Progress(what, len(runners) * tune.BATCHES, unit="batches") as progress:
                progress.extra = f"{len(runners)} tiles" + (f", {skipped}" if skipped else "")
                try:
                    times = tune.measure({c: launch(x) for c, x in runners.items()}, progress=progress)
                except tune.KernelHang as e:
                    tune.store_hung(source, device, e.config)
                    raise error(
                        "E0810",
                        f"stage {k} of {self.name} (`{spec.text}`) at tile {tune.label(e.config)} did not "
                        f"finish within {e.seconds:g} s on the GPU ({device}): the kernel hangs",
                        notes=[
                            f"the tile is recorded as hung in {tune.cache_file()} and is not tried again: "
                            "run again in a new process",
                            "the GPU stays busy with the kernel until this process exits",
                            "please report it with the stage's epilogue: `coda compile FILE --emit source --backward`",
                        ],
                    ) from None
            if not times:
                return r
            cached = min(times, key=lambda c: times[c])
            tune.store(disk, cached, times, source=source, shape=shape, device=device)
            return runners[cached]
        return (
            r if cached == r.config else StageRunner(self.block, k, spec, cached, self.emulate, self.poison)
        )


_PRELOAD: threading.Thread | None = None


def preload_runtime() -> None:
    """Import the kernels' runtime (CuTeDSL, quack, and the parts of torch they import: seconds) in a
    thread, while this one waits for the compile workers; the first launch imports it otherwise."""
    global _PRELOAD
    if _PRELOAD is None and "quack.epilogue.frontend" not in sys.modules:
        _PRELOAD = threading.Thread(target=_import_runtime, name="coda-import", daemon=True)
        _PRELOAD.start()
        atexit.register(_finish_preload)


def _finish_preload() -> None:
    """At exit, let the import that preload_runtime started finish first (seconds at most). A process
    that ends while a thread is still inside a C extension's import (CuTeDSL's compiler, torch) runs
    that extension's static destructors under the thread, which can end the process in
    std::terminate ("terminate called without an active exception") instead of with its own exit
    status: the likely cause of such an abort seen once after an error (E0706) in `coda fuzz --target
    cuda`, whose first call had started this import."""
    if _PRELOAD is not None:
        _PRELOAD.join(timeout=120)


def _import_runtime() -> None:
    with contextlib.suppress(Exception):  # (a missing toolchain: the launch that needs it says so)
        for name in (
            "coda_lang.backend_cute.build.quack_adapter",
            "quack.epilogue.frontend",
        ):  # (in this order)
            importlib.import_module(name)
