"""`coda grad` as a user runs it: a subprocess, its exit code, stdout and stderr.

It prints the backward block as .coda source that `coda check` accepts, says on stderr where a stage's
backward runs as an elementwise stage, and takes --with-forward, --wrt, --block, -o and
--error-format. Exit codes (README): 0 ok, 1 the program has errors or can't be
differentiated (E06), 2 usage or I/O errors; never a Python traceback.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support import NO_BACKWARD, coda, no_traceback

import coda_lang

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.coda"))


def test_grad_output_passes_coda_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`coda grad EXAMPLE -o OUT` for every example (in this process: the command line's own process
    is the tests' below and the `coda check` here), then one `coda check` of all the outputs."""
    from coda_lang.cli import main

    assert len(EXAMPLES) >= 8
    outs = []
    for path in EXAMPLES:
        out = tmp_path / f"{path.stem}_bwd.coda"
        code = main(["grad", str(path), "-o", str(out)])
        stdout, stderr = capsys.readouterr()
        assert "Traceback" not in stdout + stderr and "internal error" not in stderr
        if path.stem in NO_BACKWARD:  # refused with its code, nothing written
            assert code == 1 and f"error[{NO_BACKWARD[path.stem]}]" in stderr, stderr
            assert not out.exists()
            continue
        assert code == 0, (path.name, stderr)
        assert stdout == ""
        assert f"wrote {out}: {path.stem}_bwd (" in stderr
        outs.append(out)
    checked = coda("check", *outs)
    no_traceback(checked)
    assert checked.returncode == 0, checked.stderr
    assert [ln.split(": ")[1] for ln in checked.stdout.splitlines()] == [str(o) for o in outs]
    # what -o writes is what stdout gets without it
    plain = coda("grad", EXAMPLES[0])
    assert plain.returncode == 0
    assert plain.stdout == outs[0].read_text()


def test_grad_prints_the_backward_with_its_saved_tensors() -> None:
    r = coda("grad", "examples/llama_mlp.coda", "--remat", "save")
    no_traceback(r)
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert text.startswith("dims M, D, F\n")
    assert "block llama_mlp_bwd(dx2: bf16[M, D]" in text
    assert re.search(r"^# saved tensors \(stored by the forward\): .*\bh\b", text, re.M)
    assert "# cotangents: dx2 (of x2)" in text
    assert re.search(
        r"^# gradients: dy \(of y\), dx \(of x\), dw_o \(of w_o\), dg \(of g\), dw_13 \(of w_13\), "
        r"dw_2 \(of w_2\)$",
        text,
        re.M,
    )
    assert text.count("gemm ") == 6  # dgrad + wgrad of each of the 3 GEMMs
    assert "elementwise" not in text  # x2 = acc + h: its cotangent is the down-proj's dacc itself
    assert r.stderr == ""  # no elementwise stage to report
    block = coda_lang.load(text)["llama_mlp_bwd"]
    assert len(block.plan.stages) == 6


def test_grad_notes_the_elementwise_entry_stage() -> None:
    r = coda("grad", "examples/llama_block.coda", "--remat", "save")
    no_traceback(r)
    assert r.returncode == 0, r.stderr
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("note: ")]
    assert len(notes) == 1, r.stderr
    assert re.match(
        r"note: stage 4 \(line \d+\): no GEMM produces the cotangent of `qkv`, so its backward runs "
        r"as an elementwise stage$",
        notes[0],
    ), notes[0]
    assert r.stdout.count("elementwise [M, 2*P] {") == 1
    assert "# note: stage 4" in r.stdout  # also said in the printed block


def test_single_stage_examples_note_their_entry_stage() -> None:
    for name in ("bias_gelu", "qk_norm"):
        r = coda("grad", f"examples/{name}.coda")
        assert r.returncode == 0, r.stderr
        assert "runs as an elementwise stage" in r.stderr, name


def test_with_forward(tmp_path: Path) -> None:
    r = coda("grad", "examples/llama_mlp.coda", "--with-forward")
    no_traceback(r)
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert text.count("dims ") == 1 and text.startswith("dims M, D, F\n")
    assert text.index("block llama_mlp(") < text.index("block llama_mlp_bwd(")
    assert "# saved for the backward (extra outputs): " in text
    prog = coda_lang.load(text)
    assert [b.name for b in prog] == ["llama_mlp", "llama_mlp_bwd"]
    fwd, bwd = prog["llama_mlp"], prog["llama_mlp_bwd"]
    # every forward tensor the backward reads (other than cotangents and forward params) is a forward output
    outs = {o.name for o in fwd.ir.outputs}
    params = {p.var.name for p in fwd.ir.params}
    for p in bwd.ir.params:
        assert p.var.name in outs | params or p.var.name.startswith("d"), p.var.name
    out = tmp_path / "both.coda"
    assert coda("grad", "examples/llama_mlp.coda", "--with-forward", "-o", out).returncode == 0
    checked = coda("check", out)
    assert checked.returncode == 0, checked.stderr
    assert "2 blocks" in checked.stdout


def test_with_forward_declares_the_forwards_dims(tmp_path: Path) -> None:
    src = tmp_path / "f.coda"
    src.write_text(
        "dims M, K, N, F\nblock f(x: f32[M, K], w: f32[K, F]) -> (o: f32[M, F]) {\n"
        "  gemm x @ w {\n    o = acc * 2.0\n    u = acc * N\n  }\n}\n"
    )
    out = tmp_path / "both.coda"
    r = coda("grad", src, "--with-forward", "-o", out)
    assert r.returncode == 0, r.stderr
    checked = coda("check", out)
    no_traceback(checked)
    assert checked.returncode == 0, checked.stderr


def test_wrt() -> None:
    r = coda("grad", "examples/llama_mlp.coda", "--wrt", "g, w_2")
    no_traceback(r)
    assert r.returncode == 0, r.stderr
    assert "# gradients: dg (of g), dw_2 (of w_2)\n" in r.stdout
    block = coda_lang.load(r.stdout)["llama_mlp_bwd"]
    assert [o.name for o in block.ir.outputs] == ["dg", "dw_2"]
    assert "dw_o" not in r.stdout and "dy" not in r.stdout  # nothing computed for y and w_o
    # a parameter with a default is differentiable when asked for
    r = coda("grad", "examples/llama_mlp.coda", "--wrt", "eps")
    assert r.returncode == 0, r.stderr
    assert "-> (deps: f32)" in r.stdout


def test_block_option(tmp_path: Path) -> None:
    two = tmp_path / "two.coda"
    two.write_text(
        (ROOT / "examples" / "bias_gelu.coda").read_text()
        + "\n"
        + "block twice(x: bf16[M, K], w: bf16[K, N]) -> (o: bf16[M, N]) {\n"
        "  gemm x @ w {\n    o = acc * acc\n  }\n}\n"
    )
    r = coda("grad", two)
    no_traceback(r)
    assert r.returncode == 2
    assert "has several blocks (bias_gelu, twice); choose one with --block" in r.stderr
    r = coda("grad", two, "--block", "twice")
    assert r.returncode == 0, r.stderr
    assert "block twice_bwd(do: bf16[M, N]" in r.stdout
    assert "bias_gelu" not in r.stdout
    r = coda("grad", two, "--block", "nope")
    no_traceback(r)
    assert r.returncode == 2
    assert "no block `nope`" in r.stderr and "blocks: bias_gelu, twice" in r.stderr


def test_unknown_wrt_is_a_usage_error() -> None:
    """--wrt naming no parameter of the block is a mistake in the command line: exit 2, one line."""
    r = coda("grad", "examples/llama_mlp.coda", "--wrt", "g,nope")
    no_traceback(r)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr == (
        "coda: error: --wrt names `nope`, which is not a parameter of block llama_mlp "
        "(its parameters: y, x, w_o, g, w_13, w_2, eps)\n"
    ), r.stderr


def test_integer_wrt_exits_1_with_e0602() -> None:
    r = coda("grad", "examples/lm_head_ce.coda", "--wrt", "target")
    no_traceback(r)
    assert r.returncode == 1
    assert "error[E0602]: `target` is not a float parameter; it has no gradient" in r.stderr


def test_program_with_errors_exits_1() -> None:
    r = coda("grad", "tests/bad/rmsnorm_same_stage.coda")
    no_traceback(r)
    assert r.returncode == 1
    assert r.stdout == ""
    assert "error[E0503]" in r.stderr


def test_missing_file_exits_2(tmp_path: Path) -> None:
    r = coda("grad", tmp_path / "nope.coda")
    no_traceback(r)
    assert r.returncode == 2
    assert r.stdout == ""
    assert "can't read" in r.stderr and "nope.coda" in r.stderr


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    r = coda("grad")
    no_traceback(r)
    assert r.returncode == 2
    assert "FILE" in r.stderr
    r = coda("grad", "examples/llama_mlp.coda", "-o", tmp_path / "no" / "such" / "dir.coda")
    no_traceback(r)
    assert r.returncode == 2
    assert "can't write" in r.stderr
    r = coda("grad", "examples/llama_mlp.coda", "--frobnicate")
    no_traceback(r)
    assert r.returncode == 2


def test_no_traceback_for_odd_inputs(tmp_path: Path) -> None:
    cases = {
        "empty.coda": "",
        "binary.coda": "\x00\x01\x02 block",
        "partial.coda": "dims M, K, N\nblock b(x: f32[M, K], w: f32[K, N]) -> (o: f32[M, N]) {\n  gemm x @ w {\n",
    }
    for name, text in cases.items():
        path = tmp_path / name
        path.write_text(text)
        r = coda("grad", path)
        no_traceback(r)
        assert r.returncode in (1, 2), (name, r.returncode, r.stderr)
    r = coda("grad", tmp_path)  # a directory
    no_traceback(r)
    assert r.returncode == 2


def test_a_bad_policy_is_a_usage_error() -> None:
    """--remat is parsed into a BackwardOptions (coda grad, coda tune); what it refuses is one line and
    exit 2."""
    mlp = "examples/llama_mlp.coda"
    for args in (["grad", mlp], ["tune", mlp, "--backward", "--dims", "M=8,D=8,F=8"]):
        r = coda(*args, "--remat", "never")
        no_traceback(r)
        assert r.returncode == 2, r.stderr
        assert (
            r.stderr.strip()
            == "coda: error: remat= is 'never'; it takes one of 'auto', 'save', 'recompute', 'rebuild'"
        )
