"""`coda run`: what a user sees (table, files written atomically, usage errors, exit codes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
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


# ---------------------------------------------------------------------------- bad input files and sizes

LIN = "dims M, K, N\n\nblock lin(x: f32[M, K], w: f32[K, N]) -> (y: f32[M, N]) {\n  gemm x @ w {\n    y = acc\n  }\n}\n"


def _npy(a: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=True)
    return buf.getvalue()


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def _bad_input_files(d: Path) -> dict[str, Path]:
    import pickle

    ok = _npy(np.zeros((4, 8), np.float32))
    files = {
        "empty": d / "empty.npz",
        "bare npy": d / "bare.npy",
        "bare npy named npz": d / "bare.npz",
        "pickle": d / "pickle.npz",
        "text": d / "text.npz",
        "not a zip": d / "garbage.npz",
        "cut short": d / "cut.npz",
    }
    files["empty"].write_bytes(b"")
    files["bare npy"].write_bytes(ok)
    files["bare npy named npz"].write_bytes(ok)
    files["pickle"].write_bytes(pickle.dumps({"x": [1.0, 2.0]}))
    files["text"].write_text("x = 1\n")
    files["not a zip"].write_bytes(b"PK\x03\x04 not really")
    np.savez(d / "good.npz", x=np.zeros((4, 8), np.float32), w=np.zeros((8, 2), np.float32))
    files["cut short"].write_bytes((d / "good.npz").read_bytes()[:300])
    files["member not an array"] = _zip(d / "member.npz", {"x.npy": b"hello, not an array", "w.npy": ok})
    files["member not .npy"] = _zip(d / "txt.npz", {"x.txt": b"hello"})
    files["object array"] = _zip(d / "obj.npz", {"x.npy": _npy(np.array([{"a": 1}, None], dtype=object))})
    files["header larger than the data"] = _zip(d / "big.npz", {"x.npy": ok.replace(b"(4, 8)", b"(4000, 8)")})
    files["header larger than memory"] = _zip(
        d / "huge.npz", {"x.npy": ok.replace(b"(4, 8)", b"(99999999999999, 8)")}
    )
    files["negative extent"] = _zip(d / "neg.npz", {"x.npy": ok.replace(b"(4, 8)", b"(-4, 8)")})
    files["duplicate member"] = _zip(d / "dup.npz", {"x.npy": ok, "w.npy": ok})
    import zipfile

    with zipfile.ZipFile(files["duplicate member"], "a") as z, pytest.warns(UserWarning, match="Duplicate"):
        z.writestr("x.npy", ok)
    files["/dev/null"] = Path("/dev/null")
    files["a folder"] = d
    return files


def test_every_malformed_inputs_file_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An --inputs file that is no .npz archive of plain arrays, whatever is wrong with it, is a one-line
    `coda: error: can't read FILE: ...` (exit 2), never an internal error, never NumPy's advice to load
    it with allow_pickle, and nothing is allocated for a header's claim before it is checked."""
    from coda_lang.cli import main

    prog = tmp_path / "lin.coda"
    prog.write_text(LIN)
    for what, path in _bad_input_files(tmp_path).items():
        code = main(["run", str(prog), "--inputs", str(path)])
        err = capsys.readouterr().err
        assert code == 2, (what, err)
        assert err.startswith(f"coda: error: can't read {path}: ") and err.count("\n") == 1, (what, err)
        assert "allow_pickle" not in err and "internal error" not in err, (what, err)
    assert main(["run", str(prog), "--inputs", str(tmp_path / "good.npz")]) == 0


def test_a_dim_given_twice_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    from coda_lang.cli import main

    for cmd in (["run", "examples/bias_gelu.coda"], ["fuzz", "examples/bias_gelu.coda"]):
        assert main([*cmd, "--dims", "M=4,M=5"]) == 2
        assert "--dims gives M twice (M=4 and M=5)" in capsys.readouterr().err


def test_out_files_get_the_umask_s_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--out (and coda grad -o, coda compile --emit) are written as open() would write them: a new file
    with 0666 less the umask (not mkstemp's 0600), an existing file keeps its mode."""
    import os

    from coda_lang.cli import main

    out = tmp_path / "o.npz"
    old = os.umask(0o022)
    try:
        assert main(["run", "examples/bias_gelu.coda", "--dims", "M=4,K=8,N=8", "--out", str(out)]) == 0
        assert out.stat().st_mode & 0o777 == 0o644
        os.umask(0o027)
        grad = tmp_path / "g.coda"
        assert main(["grad", "examples/bias_gelu.coda", "-o", str(grad)]) == 0
        assert grad.stat().st_mode & 0o777 == 0o640
        out.chmod(0o604)
        assert main(["run", "examples/bias_gelu.coda", "--dims", "M=4,K=8,N=8", "--out", str(out)]) == 0
        assert out.stat().st_mode & 0o777 == 0o604
    finally:
        os.umask(old)
    capsys.readouterr()


def test_sizes_past_the_memory_are_e0808_not_memory_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 2 GiB available, a run that would hold about 2.2 GiB at its peak (0.4 GiB of float64
    random input among it) is refused before anything is allocated (the estimate used to count 1.2)."""
    from coda_lang.cli import main
    from coda_lang.interp import inputs

    monkeypatch.setattr(inputs, "available_memory", lambda: 2 * 2**30)
    prog = tmp_path / "lin.coda"
    prog.write_text(LIN)
    assert main(["run", str(prog), "--dims", "M=100000000,K=1,N=1"]) == 1
    err = capsys.readouterr().err
    assert "error[E0808]" in err and "2.0 GiB are available" in err


def test_the_memory_estimate_covers_every_array_coda_run_makes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`memory_needed` is at least what `coda run` holds at its peak (NumPy's arrays, traced): random
    inputs drawn in float64, bound copies, every value, rounded copies, an op's temporaries (erf's
    Python floats among them), outputs and the printed statistics; for every example and for erf,
    at sizes where the arrays, not the interpreter's own objects, make the peak."""
    import contextlib
    import io
    import tracemalloc

    from coda_lang.cli import main
    from coda_lang.interp.inputs import memory_needed

    erf = tmp_path / "erf.coda"
    erf.write_text(LIN.replace("y = acc", "y = gelu(acc) + erf(acc * 0.5)"))
    runs = [(p, 128) for p in sorted(Path("examples").glob("*.coda"))] + [(erf, 300)]
    for path, n in runs:
        block = next(iter(coda_lang.load(path)))
        dims = {d.name: d.value or n for d in block.ir.dims}
        free = ",".join(
            f"{k}={v}" for k, v in dims.items() if not any(d.name == k and d.value for d in block.ir.dims)
        )
        for precision in ("exact", "f64"):
            # once untraced first: what the process makes once (imports, caches) is not the run's
            # arrays, and alone or first in a file this test would charge it to them
            with contextlib.redirect_stdout(io.StringIO()):
                main(["run", str(path), "--dims", free, "--precision", precision])
            tracemalloc.start()
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    code = main(["run", str(path), "--dims", free, "--precision", precision])
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert code == 0, capsys.readouterr().err
            need = memory_needed(block.ir, dims, precision)
            assert peak <= need, f"{path.name} ({precision}): peak {peak:,} bytes > estimate {need:,}"
