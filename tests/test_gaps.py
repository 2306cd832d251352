"""benchmarks/gaps.py (where a GPU idles in a profiled step), on hand-made Chrome traces: busy and idle
time, the largest gap named by the kernels around it, CPU events ignored; a missing or unreadable
trace is a one-line error with exit code 2, a trace with no GPU kernels exit code 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gaps.py"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_busy_idle_and_the_largest_gap(tmp_path: Path) -> None:
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm_a", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "rope_b", "ts": 400, "dur": 50},  # 300 us idle before it
        {"ph": "X", "cat": "kernel", "name": "norm_c", "ts": 420, "dur": 80},  # overlaps rope_b
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "ts": 530, "dur": 10},  # 30 us idle
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # not on the GPU
    ]
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    r = run(str(trace), "--min-us", "20")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "4 kernels over 0.54 ms: busy 0.21 ms, idle 0.33 ms" in out
    assert "2 gaps of at least 20 us: 0.33 ms" in out
    assert "300.0 us at     0.40 ms: gemm_a  ->  rope_b" in out
    assert "30.0 us at     0.53 ms: norm_c  ->  Memset (Device)" in out
    assert "aten::mm" not in out


def test_bad_traces_are_one_line_errors(tmp_path: Path) -> None:
    r = run(str(tmp_path / "missing.json"))
    assert r.returncode == 2 and r.stdout == "" and "missing.json" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    r = run(str(bad))
    assert r.returncode == 2 and "bad.json" in r.stderr and "Traceback" not in r.stderr
    empty = tmp_path / "empty.json"
    empty.write_text(
        json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "x", "ts": 0, "dur": 1}]})
    )
    r = run(str(empty))
    assert r.returncode == 1 and "no GPU kernels" in r.stderr
