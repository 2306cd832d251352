"""The corpus of bad programs (tests/bad/*.coda): each reports exactly the errors written inline.

Each line where an error is expected ends with `# E: E0503` (several codes: `# E: E0201 E0203`); the
error's line is the line of its primary span. A program passes when the set of (line, code) the
checker reports equals the set of expectations, so a missing, extra or misplaced diagnostic fails.
Rendered diagnostics of selected programs are pinned by golden files in tests/golden/diagnostics/
(rewrite them with `pytest --update-golden`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support import golden

from coda_lang.core.diagnostics import CHECK_ONLY_EXEMPT, CODES, Diagnostic, render_all
from coda_lang.frontend.source import check_source

ROOT = Path(__file__).resolve().parent.parent
BAD = ROOT / "tests" / "bad"
GOLDEN = ROOT / "tests" / "golden" / "diagnostics"
PROGRAMS = sorted(BAD.glob("*.coda"))
EXPECT = re.compile(r"#\s*E:\s*((?:E\d{4}\s*)+)$")
SHORT = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+):(?P<col>\d+): error\[(?P<code>E\d{4})\]: \S.*$")

# Programs whose full human rendering is pinned (carets, labels, notes, fix-its).
GOLDEN_PROGRAMS = [
    "rmsnorm_same_stage",  # E0503 with its fix-it
    "amax_scale_same_stage",  # E0508: rowwise current fp8 scaling, the local recipes as fix-its
    "amax_scale_columns_same_stage",  # E0508 of a column amax: each tile sees its own rows, the 128x1 fix-it
    "amax_inline_same_stage",  # E0508 of an amax written inline: named by where it is, not `_tN`
    "lse_inline_same_stage",  # E0501 of a logsumexp written inline: named by where it is, not `_tN`
    "unknown_op_did_you_mean",  # E0203 "did you mean"
    "swiglu_odd_width",  # E0403 on a symbolic width
    "rope_fixed_odd_dim",  # E0403 on a fixed odd dim
    "norm_between_stages",  # E0502 with the note naming the stage
    "softmax_same_stage",  # E0501
    "syntax_missing_comma",  # E0101
    "syntax_no_outputs",  # E0104, a named syntax error
    "syntax_unclosed_block",  # E0103
    "down_proj_wrong_weight",  # E0401 with the transpose hint
    "swiglu_full_width",  # E0402 on symbolic dims
    "reassign_in_place",  # E0202 with a secondary span
    "annotation_conflicts_output",  # E0301 with a secondary span on another line
    "two_mistakes_llama_block",  # two errors in one file
    "two_mistakes_lm_head",
    "dims_declared_twice",  # secondary span on the primary's line
    "shared_weight_width",  # E0410: a repeating vector and a width that cuts its last copy
    "shared_weight_with_row_vector",  # E0402 with the fix-it for a repeating vector
    "block_scales_misfit",  # E0411: blocks of K that differ, groups that are not whole, a vector
]


def rel(path: Path) -> str:
    """The file name used in renderings: relative to the repository, so goldens don't depend on the checkout."""
    return path.relative_to(ROOT).as_posix()


def expectations(text: str) -> set[tuple[int, str]]:
    out = set()
    for n, line in enumerate(text.splitlines(), 1):
        m = EXPECT.search(line)
        if m:
            out |= {(n, code) for code in m.group(1).split()}
    return out


def diagnose(path: Path) -> tuple[str, list[Diagnostic]]:
    text = path.read_text()
    prog, _, diags = check_source(text, rel(path))
    assert prog is None, "a program with errors gives no typed program"
    return text, diags


def test_corpus_size() -> None:
    assert len(PROGRAMS) >= 45


@pytest.mark.parametrize("path", PROGRAMS, ids=lambda p: p.stem)
def test_bad_program(path: Path) -> None:
    text, diags = diagnose(path)
    expected = expectations(text)
    assert expected, f"{path.name} has no `# E: ...` expectation"
    assert text.startswith("# "), f"{path.name} should open with a comment saying what the mistake is"
    got = {(d.span.line if d.span else 0, d.code) for d in diags}
    assert got == expected, (
        f"missing: {sorted(expected - got)}, unexpected: {sorted(got - expected)}\n"
        + render_all(diags, {rel(path): text}, "short")
    )
    for d in diags:
        assert d.span is not None and d.span.file == rel(path)


def test_every_code_is_exercised() -> None:
    covered = {code for p in PROGRAMS for _, code in expectations(p.read_text())}
    missing = sorted(set(CODES) - covered - CHECK_ONLY_EXEMPT)
    assert not missing, f"codes no bad program exercises: {missing}"


def test_every_reported_code_is_known() -> None:
    reported = {d.code for p in PROGRAMS for d in diagnose(p)[1]}
    assert reported <= set(CODES), sorted(reported - set(CODES))
    expected = {code for p in PROGRAMS for _, code in expectations(p.read_text())}
    assert expected <= set(CODES), sorted(expected - set(CODES))


@pytest.mark.parametrize("path", PROGRAMS, ids=lambda p: p.stem)
def test_short_form(path: Path) -> None:
    text, diags = diagnose(path)
    lines = render_all(diags, {rel(path): text}, "short").splitlines()
    assert len(lines) == len(diags)
    for line, d in zip(lines, diags, strict=True):
        m = SHORT.match(line)
        assert m, line
        assert m["file"] == rel(path) and m["code"] == d.code
        assert d.span is not None and (int(m["line"]), int(m["col"])) == (d.span.line, d.span.col)
        assert m.group(0).endswith(d.message)


@pytest.mark.parametrize("name", GOLDEN_PROGRAMS)
def test_golden_rendering(name: str, update_golden: bool) -> None:
    path = BAD / f"{name}.coda"
    text, diags = diagnose(path)
    rendered = render_all(diags, {rel(path): text}, "human") + "\n"
    golden(GOLDEN / f"{name}.txt", rendered, update_golden)


def test_golden_files_have_programs() -> None:
    stale = sorted(g.stem for g in GOLDEN.glob("*.txt") if g.stem not in GOLDEN_PROGRAMS)
    assert not stale, f"golden files without a program in GOLDEN_PROGRAMS: {stale}"


def test_fix_it_of_row_statistic() -> None:
    _, diags = diagnose(BAD / "rmsnorm_same_stage.coda")
    (d,) = diags
    assert d.code == "E0503"
    assert any("defer the row scale to the epilogue of the GEMM that consumes `n`" in h for h in d.help)
    assert any("RMSNorm(h)*g @ W == r * ((h*g) @ W)" in h for h in d.help)


def test_did_you_mean() -> None:
    _, diags = diagnose(BAD / "unknown_op_did_you_mean.coda")
    (d,) = diags
    assert d.code == "E0203" and d.help == ["did you mean `logsumexp`?"]
