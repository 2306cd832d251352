"""A process that leaves kernels compiling in the background and exits at once (for
tests/test_compile_cache.py::test_a_process_exits_without_waiting_for_its_background_compiles).

Run as `python tests/background_exit.py CACHE_DIR`: its workers build with `sleepy_build` (the first
tile at once, every other one sleeping for minutes); it prints its workers' process ids once warm has
returned, then exits. The exit must not wait for them, and must end them.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def first_tile(spec: Any) -> Any:
    from coda_lang.backend_cute.build.config import CANDIDATES, fits

    return next(c for c in CANDIDATES if fits(spec, c))


def sleepy_build(spec: Any, config: Any, root: str, wait: bool = True) -> tuple[str, bool]:
    if config != first_tile(spec):
        time.sleep(300)
    return "ok", True


def children() -> list[int]:
    """The process ids whose parent is this process (Linux: /proc)."""
    import os

    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                status = Path("/proc", d, "status").read_text()
            except OSError:
                continue
            ppid = next((ln.split()[1] for ln in status.splitlines() if ln.startswith("PPid:")), "")
            if ppid == str(os.getpid()):
                out.append(int(d))
    return out


def main() -> None:
    sys.path.insert(0, str(ROOT))
    import background_exit  # (this file as a module: the workers unpickle its build by that name)

    import coda_lang
    from coda_lang.backend_cute.build import parallel
    from coda_lang.backend_cute.build.cache import Kernel
    from coda_lang.backend_cute.build.config import CANDIDATES, TUNE_CANDIDATES
    from coda_lang.backend_cute.plan.planner import plan_stage

    parallel.build = background_exit.sleepy_build
    Kernel.status = lambda self: None  # type: ignore[method-assign]
    spec = plan_stage(coda_lang.load(ROOT / "examples" / "llama_mlp.coda")["llama_mlp"], 1)
    stats = parallel.warm(
        [parallel.Request(spec, CANDIDATES, first=True), parallel.Request(spec, TUNE_CANDIDATES)],
        jobs=2,
        directory=Path(sys.argv[1]),
        quiet=True,
        background=True,
    )
    assert stats.background is not None and not stats.background.over, stats
    print("workers", *children(), flush=True)


if __name__ == "__main__":
    main()
