"""The Python API (load, Program, Block, CodaError) and the light `coda check` path.

`coda check` must start fast, so its import path holds no NumPy, torch or GPU library: tested here by
importing, not by timing (a timed test is flaky). benchmarks/check_startup.py measures the time.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import coda_lang
from coda_lang import Block, CodaError, Diagnostic, Program
from coda_lang.frontend.syntax.printer import print_block, print_program

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "examples" / "llama_mlp.coda"
BLOCK = ROOT / "examples" / "llama_block.coda"
HEAVY = ("numpy", "torch", "cutlass", "quack", "triton")

TWO_BLOCKS = """\
dims M, K, N

block first(x: bf16[M, K], w: bf16[K, N]) -> (y: bf16[M, N]) {
  gemm x @ w {
    y = acc
  }
}

block second(x: bf16[M, K], w: bf16[K, N], b: f32[N]) -> (y: bf16[M, N]) {
  gemm x @ w {
    y = gelu(acc + b)
  }
}
"""

BAD = """\
dims M, K, N

block bad(x: bf16[M, K], w: bf16[K, N]) -> (y: bf16[M, N]) {
  gemm x @ w {
    y = acc + nope
  }
}
"""


def test_load_from_a_path_string_and_a_path_object() -> None:
    for arg in (str(MLP), MLP):
        program = coda_lang.load(arg)
        assert isinstance(program, Program)
        assert program.file == str(MLP)
        assert program.source == MLP.read_text()
        assert [b.name for b in program] == ["llama_mlp"]


def test_load_from_text() -> None:
    program = coda_lang.load(MLP.read_text())
    assert program.file == "<string>"
    assert program.ir == coda_lang.load(MLP).ir


def test_index_iterate_and_print() -> None:
    program = coda_lang.load(TWO_BLOCKS)
    assert len(program) == 2
    assert [b.name for b in program] == ["first", "second"]
    block = program["second"]
    assert isinstance(block, Block)
    assert block.name == "second" and block.ir.name == "second"
    assert len(block.plan.stages) == 1
    assert "second" in repr(block) and "first" in repr(program)
    assert str(block) == print_block(block.ir)
    assert str(program) == print_program(program.ir)
    assert coda_lang.load(str(program)).ir == program.ir
    assert "stage 1" in block.explain()


def test_unknown_block_is_a_key_error_that_names_the_blocks() -> None:
    program = coda_lang.load(TWO_BLOCKS)
    with pytest.raises(KeyError) as e:
        program["third"]
    msg = e.value.args[0]
    assert "no block `third`" in msg and "first, second" in msg and "<string>" in msg
    with pytest.raises(KeyError, match="llama_mlp.coda"):
        coda_lang.load(MLP)["mlp"]


def test_coda_error_carries_the_diagnostics() -> None:
    with pytest.raises(CodaError) as e:
        coda_lang.load(BAD)
    err = e.value
    assert [d.code for d in err.diagnostics] == ["E0201"]
    d = err.diagnostics[0]
    assert isinstance(d, Diagnostic)
    assert d.span is not None and (d.span.file, d.span.line) == ("<string>", 5)
    assert "error[E0201]" in str(err) and "<string>:5:" in str(err)  # str() is the short form
    human = err.render("human")
    assert "error[E0201]: unknown name `nope`" in human
    assert "--> <string>:5:" in human and "y = acc + nope" in human and "^^^^" in human
    assert err.render("short") == str(err)


def test_coda_error_from_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.coda"
    path.write_text(BAD)
    with pytest.raises(CodaError) as e:
        coda_lang.load(path)
    assert str(path) in e.value.render("human")
    assert e.value.sources == {str(path): BAD}


def test_a_missing_file_is_an_os_error_not_source_text(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        coda_lang.load(str(tmp_path / "missing.coda"))


# ----------------------------------------------------------------------------------------------
# `coda check` imports nothing heavy


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "status"),
    [
        (["check", "examples/llama_block.coda"], 0),
        (["check", "--explain", "examples/llama_block.coda"], 0),
        (["check", "tests/test_api_and_speed.py"], 1),  # not .coda: error diagnostics are rendered
    ],
    ids=["check", "explain", "errors"],
)
def test_coda_check_imports_no_heavy_library(args: list[str], status: int) -> None:
    code = (
        "import sys, coda_lang.cli\n"
        f"rc = coda_lang.cli.main({args!r})\n"
        f"heavy = sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r})\n"
        "print('HEAVY', heavy, file=sys.stderr)\n"
        "sys.exit(rc)\n"
    )
    r = _run(code)
    assert "HEAVY []" in r.stderr, r.stderr
    assert r.returncode == status, r.stderr


def test_coda_check_as_a_module() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "coda_lang.cli", "check", str(BLOCK)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "ok:" in r.stdout and "4 GEMM stages" in r.stdout
