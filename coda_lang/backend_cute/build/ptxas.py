"""ptxas: the executable, its version, and its register and spill report of a PTX file.

What it does: `ptxas_executable` ($CODA_PTXAS, else `ptxas` on PATH), `run_ptxas` (`ptxas -v` for
sm_90a, reading newer PTX at its own ISA version), `parse_ptxas` (`PtxasReport`), `ptxas_version`;
`BackendUnavailable`, raised wherever the toolchain is missing.
What it does not: keep reports (cache.py keeps them beside the PTX) or judge them (select.py).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ARCH = "sm_90a"


class BackendUnavailable(Exception):
    """The CuTeDSL toolchain (nvidia-cutlass-dsl, quack-kernels, ptxas) can't be used here."""


@dataclass(frozen=True)
class PtxasReport:
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack_frame: int  # bytes
    ptxas: str  # the ptxas version line
    text: str

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    def __str__(self) -> str:
        return (
            f"{self.registers} registers, {self.spill_stores} bytes spill stores, "
            f"{self.spill_loads} bytes spill loads ({self.ptxas})"
        )


def ptxas_executable() -> str:
    """$CODA_PTXAS, else `ptxas` on PATH (CuTeDSL 4.8.1 embeds the ptxas of CUDA 12.9 for the cubin it
    builds; the CUDA 13 ptxas of the toolkit reports more spills on the same PTX, so it is the stricter
    check)."""
    exe = os.environ.get("CODA_PTXAS") or shutil.which("ptxas")
    if not exe or not os.access(exe, os.X_OK):
        raise BackendUnavailable(
            f"ptxas not found{f' at {exe}' if exe else ''} (install the CUDA toolkit, or set CODA_PTXAS)"
        )
    return exe


_RE_REGS = re.compile(r"Used (\d+) registers")
_RE_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(text: str, version: str = "ptxas") -> PtxasReport:
    """Registers and spills of the (largest) kernel in `ptxas -v` output."""
    regs = [int(x) for x in _RE_REGS.findall(text)]
    spills = [tuple(int(y) for y in x) for x in _RE_SPILLS.findall(text)]
    if not regs or not spills:
        raise ValueError(f"no register/spill report in ptxas output:\n{text[-2000:]}")
    stack, stores, loads = max(spills, key=lambda s: (s[1] + s[2], s[0]))
    return PtxasReport(max(regs), stores, loads, stack, version, text)


def run_ptxas(ptx_path: Path, arch: str = ARCH) -> PtxasReport:
    """`ptxas -v -arch=sm_90a` on a PTX file (the object is discarded)."""
    exe = ptxas_executable()
    version = ptxas_version(exe).splitlines()
    r = subprocess.run(
        [exe, "-v", f"-arch={arch}", str(ptx_path), "-o", os.devnull],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = r.stdout + r.stderr
    m = re.search(r"Unsupported \.version (\d+\.\d+); current version is '(\d+\.\d+)'", out)
    if r.returncode != 0 and m:
        # The PTX comes from a newer NVVM than this ptxas (CuTeDSL assembles it with its own embedded
        # ptxas); for the register and spill report, the older ptxas reads it at its own ISA version.
        text = Path(ptx_path).read_text().replace(f".version {m.group(1)}", f".version {m.group(2)}", 1)
        fd, name = tempfile.mkstemp(prefix=".coda-", suffix=f".ptx{m.group(2)}.tmp")  # (O_EXCL: its own)
        older = Path(name)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        try:
            r = subprocess.run(
                [exe, "-v", f"-arch={arch}", str(older), "-o", os.devnull],
                capture_output=True,
                text=True,
                timeout=600,
            )
        finally:
            older.unlink(missing_ok=True)
        out = r.stdout + r.stderr
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed on {ptx_path}:\n{out[-3000:]}")
    line = next(
        (v for v in reversed(version) if v.startswith("Cuda compilation tools")),
        version[-1] if version else "",
    )
    return parse_ptxas(
        out, f"ptxas {line.split('release ')[-1].split(',')[0]}" if "release" in line else "ptxas"
    )


@functools.cache
def _ptxas_identity(exe: str, size: int, mtime: int) -> str:
    """The `--version` text of a ptxas executable (asked once per process and executable file)."""
    return subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()


def ptxas_version(exe: str) -> str:
    st = os.stat(exe)
    return _ptxas_identity(exe, st.st_size, int(st.st_mtime))
