"""Python bytecode cached, as a pip install leaves it, for the benchmarks that time a first run.

Where the environment sets PYTHONDONTWRITEBYTECODE and the packages carry no .pyc files (the GPU
host), every process, each of coda's compile workers included, byte-compiles torch, CuTeDSL and
quack again: 12 s of a warm process there (cProfile, 2026-11-25). A user's install has the .pyc
files, so a benchmark of the first step caches bytecode under PYTHONPYCACHEPREFIX, filled once before
anything is timed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

IMPORTS = "import torch, torch._inductor.compile_fx, cutlass, quack.gemm_runtime.host"


def bytecode_env(tmp: str | None = None) -> dict[str, str]:
    """{} where bytecode is cached already; else the variables that cache it (under `tmp`, or a new
    temporary folder), after filling that cache by importing the heavy packages once."""
    if not os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return {}
    prefix = os.environ.get("PYTHONPYCACHEPREFIX") or str(Path(tmp or tempfile.mkdtemp()) / "pycache")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = prefix
    subprocess.run([sys.executable, "-c", IMPORTS], env=env, check=False)
    return {"PYTHONPYCACHEPREFIX": prefix}


def reexec_with_bytecode() -> None:
    """Run this script again with bytecode cached, if this environment turns it off (call it first)."""
    py = bytecode_env()
    if py:
        print(f"(re-running with Python bytecode cached under {py['PYTHONPYCACHEPREFIX']})", flush=True)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        os.execve(sys.executable, [sys.executable, *sys.argv], {**env, **py})
