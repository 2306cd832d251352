"""`coda check` as a user runs it: a subprocess, its exit code, stdout and stderr.

Exit codes (README): 0 ok, 1 the program has errors, 2 usage or I/O errors; never a
Python traceback.
"""

from __future__ import annotations

import re
from pathlib import Path

from support import coda, no_traceback

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.coda"))
BAD = ROOT / "tests" / "bad"


def test_bad_program_exits_1() -> None:
    r = coda("check", "tests/bad/rmsnorm_same_stage.coda")
    no_traceback(r)
    assert r.returncode == 1
    assert r.stdout == ""
    assert "error[E0503]: row statistic `ss` is used to normalize `n` in its own stage" in r.stderr
    assert "--> tests/bad/rmsnorm_same_stage.coda:11:19" in r.stderr
    assert "error: 1 error found" in r.stderr


def test_examples_exit_0() -> None:
    assert len(EXAMPLES) >= 8
    r = coda("check", *EXAMPLES)
    no_traceback(r)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert [line.split(":")[0] for line in r.stdout.splitlines()] == ["ok"] * len(EXAMPLES)


def test_good_and_bad_files_together() -> None:
    r = coda("check", EXAMPLES[0], "tests/bad/typo_weight_name.coda")
    no_traceback(r)
    assert r.returncode == 1
    assert r.stdout.startswith("ok: ")
    assert "error[E0201]" in r.stderr


def test_missing_file_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope.coda"
    r = coda("check", missing)
    no_traceback(r)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"coda: error: can't read {missing}")


def test_written_file(tmp_path: Path) -> None:
    good = tmp_path / "good.coda"
    good.write_text((ROOT / "examples" / "bias_gelu.coda").read_text())
    bad = tmp_path / "bad.coda"
    bad.write_text("dims M\nblock f(x: f32[M]) -> (y: f32[M]) {\n  y = x +\n}\n")
    assert coda("check", good).returncode == 0
    r = coda("check", bad)
    no_traceback(r)
    assert r.returncode == 1 and "error[E0101]" in r.stderr


def test_no_files_is_usage_error() -> None:
    r = coda("check")
    no_traceback(r)
    assert r.returncode == 2
    assert "usage:" in r.stderr


def test_unknown_flag_is_usage_error() -> None:
    r = coda("check", "--frobnicate", EXAMPLES[0])
    no_traceback(r)
    assert r.returncode == 2
    assert "unrecognized arguments: --frobnicate" in r.stderr


def test_no_command_is_usage_error() -> None:
    r = coda()
    no_traceback(r)
    assert r.returncode == 2


def test_help() -> None:
    r = coda("check", "--help")
    assert r.returncode == 0
    assert "--error-format" in r.stdout and "--explain" in r.stdout
    top = coda("--help")
    assert top.returncode == 0 and "check" in top.stdout


def test_explain_llama_block() -> None:
    r = coda("check", "--explain", "examples/llama_block.coda")
    no_traceback(r)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("block llama_block: 4 GEMM stages, 2 vector computations between stages")
    assert sum(line.startswith("  stage ") for line in lines) == 4
    assert sum(line.startswith("  between stages ") for line in lines) == 2
    assert "  between stages 1 and 2: vector computation" in lines
    assert "  between stages 3 and 4: vector computation" in lines
    assert lines[-1] == "ok: examples/llama_block.coda: 1 block (llama_block), 4 GEMM stages"


def test_summary_counts_elementwise_stages_apart() -> None:
    # llama_block's backward (its golden file) has an elementwise stage at the block's entry
    path = "tests/golden/grad/llama_block.coda"
    lines = [line.strip() for line in (ROOT / path).read_text().splitlines()]
    n_gemm = sum(line.startswith("gemm ") for line in lines)
    assert sum(line.startswith("elementwise [") for line in lines) == 1 and n_gemm > 1
    r = coda("check", path)
    no_traceback(r)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"ok: {path}: 1 block (llama_block_bwd), {n_gemm} GEMM stages + 1 elementwise stage\n"


def test_short_error_format() -> None:
    path = "tests/bad/two_mistakes_lm_head.coda"
    r = coda("check", "--error-format=short", path)
    no_traceback(r)
    assert r.returncode == 1
    lines = r.stderr.splitlines()
    assert len(lines) == 2
    for line, code in zip(lines, ["E0203", "E0302"], strict=True):
        assert re.fullmatch(rf"{re.escape(path)}:\d+:\d+: error\[{code}\]: .+", line), line


def test_short_error_format_syntax_error() -> None:
    r = coda("check", "--error-format", "short", "tests/bad/syntax_missing_comma.coda")
    assert r.returncode == 1
    assert r.stderr == "tests/bad/syntax_missing_comma.coda:4:31: error[E0101]: unexpected `w`\n"


def test_bad_error_format_is_usage_error() -> None:
    r = coda("check", "--error-format=json", EXAMPLES[0])
    assert r.returncode == 2
    assert "invalid choice" in r.stderr
