"""benchmarks/triton_registers.py: the generated elementwise stages compiled for sm_90a on the CPU,
their registers and spills from ptxas (slow: it compiles every stage of a block with Triton)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _module() -> object:
    spec = importlib.util.spec_from_file_location(
        "triton_registers", ROOT / "benchmarks" / "triton_registers.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["triton_registers"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.toolchain
def test_the_fp8_layer_backwards_stages_are_reported(capsys: pytest.CaptureFixture[str]) -> None:
    """The fp8 Llama layer's stages: each with its own shape's registers, and the start stages (which
    write K-major copies) also at the copy-writing shapes; the 16-warp shape needs fewer registers."""
    pytest.importorskip("triton")
    mod = _module()
    from coda_lang.backend_cute.runtime.tiles import find_ptxas

    if not find_ptxas():
        pytest.skip("no ptxas")
    assert mod.main(["--blocks", "layer", "--program", "64x16x16"]) == 0  # type: ignore[attr-defined]
    lines = capsys.readouterr().out.strip().splitlines()
    start = [ln for ln in lines if "backward stage  3 x1q,x2q" in ln]
    assert len(start) == 1 and len(lines) >= 5, lines
    got = [(int(r), int(b)) for r, b in re.findall(r"(\d+)r/(\d+)B", start[0])]
    assert len(got) == 3, start  # own shape, the default copy shape, 64x16x16
    assert got[2][0] < got[1][0] and got[2][1] == 0, got


def test_a_bad_program_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    mod = _module()
    with pytest.raises(SystemExit) as e:
        mod.main(["--program", "64x16", "--ptxas", "/bin/true"])  # type: ignore[attr-defined]
    assert e.value.code == 2 and "RxCxW" in capsys.readouterr().err
