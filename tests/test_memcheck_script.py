"""scripts/memcheck_examples.py (what scripts/gpu_check.sh runs under compute-sanitizer's memcheck) and its
place in gpu_check.sh, on the CPU.

- `--emulate` runs examples forward and backward (--remat auto and save, and in row chunks) through the
  CUDA runtime's emulated kernels at sizes with ragged tiles, and says so, one line per run; a planted
  bad result (a gradient that is NaN where the interpreter's is finite) fails it with exit 1.
- Without a GPU and without --emulate it is a usage error (exit 2), not a traceback.
- gpu_check.sh runs it under `compute-sanitizer --tool memcheck --report-api-errors no` with
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 and fails on a sanitizer error or a failed run (and parses as bash).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "memcheck_examples.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )


def test_examples_run_forward_and_backward_emulated(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    code = script("memcheck_examples").main(
        ["--emulate", str(ROOT / "examples/llama_mlp.coda"), str(ROOT / "examples/lm_head_ce.coda")]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    for block in ("llama_mlp", "lm_head_ce"):
        for what in (
            "forward",
            "backward --remat auto",
            "backward --remat save",
            "backward --remat auto --chunk",
        ):
            assert any(ln.startswith(f"{block}.coda: ok {block} {what}") for ln in lines), (block, what, out)
    assert "(M=136,D=136,F=136)" in out and lines[-1] == "memcheck_examples: all runs ok"


def test_a_bad_result_fails_it(tmp_path: Path) -> None:
    """The script's check, in-process: a backward whose gradient comes out NaN fails the run."""
    torch = pytest.importorskip("torch")
    mc = script("memcheck_examples")
    import coda_lang

    block = coda_lang.load(ROOT / "examples" / "scale_residual.coda")["scale_residual"]
    lines: list[str] = []
    assert mc.run_block(block, "cpu", True, lines), lines
    grad = torch.autograd.grad

    def nan_grads(*args: object, **kw: object) -> object:
        return tuple(None if g is None else torch.full_like(g, float("nan")) for g in grad(*args, **kw))  # type: ignore[arg-type]

    mp = pytest.MonkeyPatch()
    mp.setattr(torch.autograd, "grad", nan_grads)
    try:
        lines = []
        assert not mc.run_block(block, "cpu", True, lines)
    finally:
        mp.undo()
    assert any(ln.startswith("FAILED scale_residual backward") and "not finite" in ln for ln in lines), lines


def test_no_gpu_is_a_usage_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = _run("examples/llama_mlp.coda")
    assert r.returncode == 2 and "--emulate" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_gpu_check_runs_it_under_memcheck() -> None:
    text = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in text
    assert "--tool memcheck --report-api-errors no --error-exitcode 9" in text
    assert "python scripts/memcheck_examples.py" in text and 'grep -q -E "ERROR SUMMARY: [1-9]"' in text
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_check.sh")]).returncode == 0
