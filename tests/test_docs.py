"""The docs that ship: the error index (one entry per code, each bad program gets its code at the marked
line and its fixed program checks), `coda explain`, and the generated parts of docs/ (the op table and
the error index) in sync with the code that generates them; README and docs/ link only inside the
project.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support import coda

import coda_lang
from coda_lang import reference
from coda_lang.core.diagnostics import CODES, CodaError

ROOT = Path(__file__).resolve().parent.parent
ENTRIES = reference.entries()


def test_every_code_has_one_entry() -> None:
    assert list(ENTRIES) == sorted(CODES)
    for code, e in ENTRIES.items():
        assert e.title == CODES[code] and e.text.strip(), code
        assert (e.bad is None) == (e.fixed is None), f"{code}: a bad program goes with its fix"


def _codes(text: str, stage: str) -> list[tuple[str, int]]:
    """(code, line) of each error `stage` ("check", "grad", "backend") gives for the program."""
    try:
        prog = coda_lang.load(text)
        if stage == "grad":
            for b in prog:
                b.grad()
        elif stage == "backend":
            from coda_lang.backend_cute.plan.planner import plan_stage

            for b in prog:
                for k in range(1, len(b.plan.stages) + 1):
                    plan_stage(b, k)
    except CodaError as e:
        return [(d.code, d.span.line if d.span else 0) for d in e.diagnostics]
    return []


STAGE = {"E06": "grad", "E07": "backend"}
CHECKED = [c for c, e in ENTRIES.items() if e.bad is not None]


@pytest.mark.parametrize("code", CHECKED)
def test_the_bad_program_gets_its_code_and_the_fixed_one_is_clean(code: str) -> None:
    e = ENTRIES[code]
    assert e.bad is not None and e.fixed is not None
    stage = STAGE.get(code[:3], "check")
    marked = [i + 1 for i, line in enumerate(e.bad.split("\n")) if f"# E: {code}" in line]
    assert len(marked) == 1, f"{code}: mark the line of the error with `# E: {code}`"
    got = _codes(e.bad, stage)
    assert got and got[0][0] == code, got
    assert marked[0] in {line for c, line in got if c == code}, (marked, got)
    assert _codes(e.fixed, stage) == [], f"{code}: the fixed program still has errors"


def test_most_codes_have_a_checked_program() -> None:
    # E0601 and E0707 are bugs of coda_lang (no program should get them); E0701 and E0703-E0708 need
    # the backend in states that a short program does not show, and are explained only
    assert len(CHECKED) >= 39 and {"E0501", "E0503", "E0602", "E0702"} <= set(CHECKED)


def test_explain_prints_the_entry() -> None:
    text = reference.explain("E0503")
    e = ENTRIES["E0503"]
    assert text is not None and e.bad is not None and e.fixed is not None
    assert text.startswith("E0503: row statistic used to normalize in its own stage")
    for line in e.bad.strip().split("\n") + e.fixed.strip().split("\n"):
        assert line in text
    assert reference.explain("E9999") is None


def test_coda_explain_command() -> None:
    r = coda("explain", "e0503")
    assert r.returncode == 0 and r.stdout == reference.explain("E0503"), r.stderr
    r = coda("explain", "E9999")
    assert r.returncode == 2 and "no error code" in r.stderr and not r.stdout
    r = coda("explain")
    assert r.returncode == 0 and len(r.stdout.strip().split("\n")) == len(CODES)


@pytest.mark.parametrize("page", sorted(reference.GENERATED))
def test_generated_docs_are_up_to_date(page: str) -> None:
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    assert reference.regenerate(page, text) == text, "run `python -m coda_lang.reference --write`"


def test_the_op_table_lists_every_op() -> None:
    from coda_lang.ops import BY_SURFACE

    table = (ROOT / "docs" / "language.md").read_text(encoding="utf-8")
    for ops in BY_SURFACE.values():
        for op in ops:
            if op.infix is None:
                assert f"`{op.surface}(" in table or f"= {op.surface}(" in table, op.name
            assert op.doc, f"`{op.name}` has no doc line (OpDef.doc)"


def test_links_stay_inside_the_project() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for bad in ("../shared", "DESIGN.md", "PAPER.md", "shared notes"):
            assert bad not in text, f"{page.name} mentions {bad}"
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), (
                f"{page.name} links to {target}, which is not in the project"
            )
