"""`coda run`: what a user sees (table, files written atomically, usage errors, exit codes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from support import coda

import coda_lang


def test_run_prints_table_and_writes_npz(tmp_path: Path) -> None:
    out = tmp_path / "o.npz"
    r = coda("run", "examples/llama_mlp.coda", "--dims", "M=40,D=32,F=24", "--seed", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "x2" in r.stdout and "(40, 32)" in r.stdout and "bf16" in r.stdout
    saved = np.load(out)
    block = coda_lang.load("examples/llama_mlp.coda")["llama_mlp"]
    from coda_lang.interp import random_inputs

    want = block.run(random_inputs(block.ir, {"M": 40, "D": 32, "F": 24}, 3))["x2"].astype(np.float32)
    np.testing.assert_array_equal(saved["x2"], want)
    assert [p.name for p in tmp_path.iterdir()] == ["o.npz"]  # no temporary left behind


def test_run_with_inputs_and_tile(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    ins = tmp_path / "in.npz"
    np.savez(
        ins,
        x=rng.standard_normal((10, 6)).astype(np.float32),
        w=rng.standard_normal((6, 12)).astype(np.float32),
        b=rng.standard_normal(12).astype(np.float32),
    )
    out = tmp_path / "o.npz"
    r = coda("run", "examples/bias_gelu.coda", "--inputs", str(ins), "--sim-tile", "4x8", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "tiles of 4x8" in r.stdout
    assert np.load(out)["out"].shape == (10, 12)


def test_run_errors_leave_no_output_file(tmp_path: Path) -> None:
    ins = tmp_path / "in.npz"
    np.savez(
        ins, x=np.zeros((10, 6), np.float32), w=np.zeros((7, 12), np.float32), b=np.zeros(12, np.float32)
    )
    out = tmp_path / "o.npz"
    r = coda("run", "examples/bias_gelu.coda", "--inputs", str(ins), "--out", str(out))
    assert r.returncode == 1
    assert "error[E0804]" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.npz"]


def test_run_usage_errors() -> None:
    for args, pattern in [
        (["--dims", "M=x"], "--dims takes"),
        (["--dims", "Q=4"], "unknown dim Q"),
        (["--sim-tile", "128"], "--sim-tile takes"),
        (["--tile", "128x64"], "coda run simulates a tile: --sim-tile MxN (--tile is the kernels' tile"),
        (["--block", "nope"], "no block `nope`"),
        (["--inputs", "/nonexistent.npz"], "can't read"),
    ]:
        r = coda("run", "examples/llama_mlp.coda", *args)
        assert r.returncode == 2, (args, r.stderr)
        assert pattern in r.stderr and "Traceback" not in r.stderr
    r = coda("run", "/nonexistent.coda")
    assert r.returncode == 2 and "can't read" in r.stderr


def test_run_program_errors_exit_1(tmp_path: Path) -> None:
    bad = tmp_path / "bad.coda"
    bad.write_text("dims M\nblock b(x: f32[M]) -> (y: f32[M]) {\n  y = exq(x)\n}\n")
    r = coda("run", str(bad))
    assert r.returncode == 1 and "E0203" in r.stderr and "did you mean `exp`" in r.stderr


def test_run_needs_block_when_several(tmp_path: Path) -> None:
    two = tmp_path / "two.coda"
    two.write_text(
        "dims M\nblock a(x: f32[M]) -> (y: f32[M]) {\n  y = x\n}\nblock b(x: f32[M]) -> (y: f32[M]) {\n  y = -x\n}\n"
    )
    r = coda("run", str(two))
    assert r.returncode == 2 and "choose one with --block" in r.stderr
    r = coda("run", str(two), "--block", "b", "--dims", "M=3")
    assert r.returncode == 0 and "b on M=3" in r.stdout
