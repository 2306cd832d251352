"""benchmarks/memory_peak.py (what is alive at a training step's peak, by allocating site), on
hand-made allocator traces: the peak is found inside the step only, blocks freed before it are not
counted, those alive when the step began are, and each block is named by its innermost frame in
code we can name. Without a GPU the script says so in one line."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "memory_peak.py"


def _load() -> Any:
    sys.path.insert(0, str(SCRIPT.parent))  # (it imports hf_train_step beside it)
    try:
        spec = importlib.util.spec_from_file_location("memory_peak", SCRIPT)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        sys.path.remove(str(SCRIPT.parent))


mp = _load()


def frame(path: str, line: int, name: str = "f") -> dict[str, Any]:
    return {"filename": path, "line": line, "name": name}


TORCH = frame("/venv/lib/python3.12/site-packages/torch/nn/functional.py", 10, "linear")
OURS = frame("/repo/coda_lang/backend_cute/runtime/launch.py", 305, "allocate")
HF = frame("/venv/lib/python3.12/site-packages/transformers/modeling_utils.py", 3706, "to")


def alloc(addr: int, size: int, *frames: dict[str, Any]) -> dict[str, Any]:
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def free(addr: int) -> dict[str, Any]:
    return {"action": "free_completed", "addr": addr}


def test_the_peak_is_the_steps_and_each_block_is_named_by_its_site() -> None:
    trace = [
        alloc(1, 1000, TORCH, HF),  # a parameter: alive through the step
        alloc(2, 5000, OURS),  # freed before the step
        free(2),
        # the step (index 3 on)
        alloc(3, 300, TORCH, OURS),  # torch's frame first: named by ours
        alloc(4, 200, OURS),
        free(3),  # after the peak
        alloc(5, 250, OURS),  # 1000 + 200 + 250 = 1450 < 1500: not a new peak
        free(99),  # a block allocated before recording began: ignored
    ]
    peak, at_peak, before = mp.replay(trace, 3)
    assert peak == 1500
    assert at_peak == {
        "modeling_utils.py:3706 to": 1000,
        "coda_lang/backend_cute/runtime/launch.py:305 allocate": 500,
    }
    assert before == {"modeling_utils.py:3706 to": 1000}


def test_a_step_that_allocates_nothing_peaks_where_it_began() -> None:
    trace = [alloc(1, 64, HF), free(1), alloc(2, 32, OURS)]
    assert mp.replay(trace, 3) == (
        32,
        {"coda_lang/backend_cute/runtime/launch.py:305 allocate": 32},
        {"coda_lang/backend_cute/runtime/launch.py:305 allocate": 32},
    )


def test_a_block_with_no_frame_we_can_name() -> None:
    assert mp.where([TORCH]) == f"{TORCH['filename']}:{TORCH['line']}"
    assert mp.where([]) == "?"


def test_without_a_gpu_it_says_so(tmp_path: Path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    r = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == ["memory_peak.py needs a CUDA GPU"], (
        r.stderr
    )
