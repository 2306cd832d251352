"""Helpers shared by the tests: running the `coda` command line, and golden files.

- `coda(*args, cwd=..., env=..., timeout=...)` runs `python -m coda_lang.cli ARGS` in a fresh process (as a
  user would, with this checkout's package) and returns the completed process (text output);
  `no_traceback(r)` asserts it printed no Python traceback and no internal error.
- `QUANTIZED_EXAMPLES`, `NO_BACKWARD`: the examples that gradient checks leave out, and why.
- `script(name)` imports scripts/NAME.py as a module (the scripts are not a package).
- `stage_option_error(text, anchor, message, tmp_path)`: `text` is refused with E0211 (a bad stage
  option) saying `message`, at the line and column of the line that starts with `anchor`, by
  `coda_lang.load` and by `coda check`.
- `golden(path, got, update)` compares `got` with the golden file `path`, or (with pytest's
  `--update-golden`, the `update_golden` fixture of conftest.py) writes it and skips the test.
"""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Examples whose stores quantize to fp8: a finite difference of them measures the quantizer's steps,
# not the straight-through gradient the backward derives (tests/test_fp8.py checks that against torch
# autograd of the same fake-quant math), and their float64 and exact runs differ by whole fp8 ulps
# wherever the quantizer's input (bf16-rounded in exact only) crosses a rounding boundary.
QUANTIZED_EXAMPLES = frozenset({"fp8_blockwise", "fp8_delayed", "fp8_mlp_save"})
# Examples whose backward can't be derived yet, with the code that says so (none now: fp8_blockwise's
# per-group amax, a grouped output whose cotangent no tile of its stage could read, is detached).
NO_BACKWARD: dict[str, str] = {}


def coda(
    *args: str | Path, cwd: Path = ROOT, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coda_lang.cli", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def no_traceback(r: subprocess.CompletedProcess[str]) -> None:
    """No Python traceback, and no "internal error" (exit 3: a bug) either."""
    assert "Traceback" not in r.stdout + r.stderr
    assert "internal error" not in r.stderr


def script(name: str) -> ModuleType:
    """scripts/NAME.py, imported (once per process) as a module."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def stage_option_error(text: str, anchor: str, message: str, tmp_path: Path) -> None:
    """E0211 saying `message` for `text`, at the line starting with `anchor` (stripped of its
    indentation), from `coda_lang.load` and, with the same line and column, from `coda check`."""
    import coda_lang
    from coda_lang.core.diagnostics import CodaError

    with pytest.raises(CodaError) as e:
        coda_lang.load(text)
    (diag,) = e.value.diagnostics
    assert diag.code == "E0211" and message in diag.message, diag.message
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if ln.lstrip().startswith(anchor))
    assert diag.span is not None and diag.span.line == line
    f = tmp_path / "bad.coda"
    f.write_text(text)
    r = coda("check", f, "--error-format", "short")
    assert r.returncode == 1 and re.search(
        rf"bad\.coda:{diag.span.line}:{diag.span.col}: error\[E0211\]", r.stdout + r.stderr
    ), r.stdout + r.stderr


def golden(path: Path, got: str, update: bool) -> None:
    """`got` must equal the golden file at `path` (rewritten instead with --update-golden)."""
    if update:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(got)
        pytest.skip(f"wrote {path.relative_to(ROOT)}")
    assert path.exists(), f"no golden file {path.relative_to(ROOT)}; run pytest --update-golden"
    assert got == path.read_text(), (
        f"{path.relative_to(ROOT)} differs; if the change is on purpose, run --update-golden"
    )
