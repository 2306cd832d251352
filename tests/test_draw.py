"""`coda draw`: a block's plan as an SVG picture (coda_lang/frontend/verify/draw.py, coda_lang/cli/draw.py).

The command on every example gives well-formed SVG in which every stage, every stored value, every
reduction, every parameter and every output appears as text; the arrows follow the dataflow (llama_mlp's,
checked edge by edge); the same input gives the same bytes; the pictures in docs/images/ are what the
command draws now (`--update-golden` rewrites them); random programs and backward blocks (with an
elementwise stage) draw too; errors exit like every command's.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from hypothesis import given, settings
from support import ROOT, coda, golden, no_traceback

from coda_lang.frontend.source import check_source
from coda_lang.frontend.verify.draw import _esc, _panel, draw
from coda_lang.frontend.verify.plan import BlockPlan
from coda_lang.ir.types import shape_str
from coda_lang.testing import forward_blocks, random_blocks

EXAMPLES = sorted((ROOT / "examples").glob("*.coda"))
PICTURES = ("llama_mlp", "llama_block", "lm_head_ce")  # docs/images/<name>.svg, of examples/<name>.coda
SVG = "{http://www.w3.org/2000/svg}"


def plans_of(path: Path) -> list[BlockPlan]:
    prog, plans, diags = check_source(path.read_text(), str(path))
    assert prog is not None and not diags
    return [plans[b.name] for b in prog.blocks]


def texts(svg: str) -> list[str]:
    """The visible text of a well-formed SVG document: one string per <text> element (tooltips left out)."""
    root = ET.fromstring(svg.encode())
    assert root.tag == f"{SVG}svg"
    return ["".join(t.itertext()) for t in root.iter(f"{SVG}text")]


def assert_shows(svg: str, plans: list[BlockPlan]) -> None:
    """Every block, stage, load, store (with its dtype), reduction, vector line, parameter and output."""
    shown = texts(svg)
    words = set(re.findall(r"[A-Za-z_][A-Za-z_0-9]*", " ".join(shown)))
    for plan in plans:
        b = plan.block
        assert any(t.startswith(f"block {b.name}: ") for t in shown)
        for sp in plan.stages:
            assert f"stage {sp.index}" in shown and sp.text in shown
            for ld in sp.loads:
                assert any(t.startswith(f"{ld.name}: {ld.dtype}") and ld.role in t for t in shown)
            for s in sp.stores:
                assert f"{s.name}: {s.dtype}{shape_str(s.shape)}" in shown
            for r in sp.reductions:
                assert f"{r.name}: f32{shape_str(r.shape)} = {r.op} over {r.over}" in shown
        for p in b.params:
            assert p.var.name in words and any(t.startswith(f"{p.var.name}: ") for t in shown)
        for o in b.outputs:
            assert o.name in words and any(t.startswith(f"{o.name}: {o.type.dtype}") for t in shown)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_draws(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`coda draw EXAMPLE` (in this process: the command line's own process is the tests below')."""
    from coda_lang.cli import main

    assert main(["draw", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert out.startswith('<?xml version="1.0" encoding="UTF-8"?>\n<svg ')
    assert out.isascii()
    assert_shows(out, plans_of(path))


def test_the_arrows_of_llama_mlp() -> None:
    (plan,) = plans_of(ROOT / "examples" / "llama_mlp.coda")
    vec = "vector computation between stages 1 and 2"
    got = {(e.name, e.src.label, e.dst.label, e.dst.rows[e.dst_row].tag) for e in _panel(plan).edges}
    assert got == {
        ("y", "parameter y", "stage 1", "A"),
        ("w_o", "parameter w_o", "stage 1", "B"),
        ("x", "parameter x", "stage 1", "load"),
        ("g", "parameter g", "stage 1", "load"),
        ("ss", "stage 1", vec, ""),
        ("eps", "parameter eps", vec, ""),
        ("hg", "stage 1", "stage 2", "A"),
        ("w_13", "parameter w_13", "stage 2", "B"),
        ("r", vec, "stage 2", "load"),
        ("a", "stage 2", "stage 3", "A"),
        ("w_2", "parameter w_2", "stage 3", "B"),
        ("h", "stage 1", "stage 3", "load"),
        ("x2", "stage 3", "output x2", ""),
    }


def test_a_reduction_feeds_an_output_and_a_vector_computation() -> None:
    (plan,) = plans_of(ROOT / "examples" / "lm_head_ce.coda")
    edges = {(e.name, e.src.label, e.dst.label, e.colour) for e in _panel(plan).edges}
    after = "vector computation after the last stage"
    assert {
        ("lse", "stage 1", "output lse", "reduce"),
        ("lse", "stage 1", after, "reduce"),
        ("tgt", "stage 1", after, "reduce"),
        ("target", "parameter target", after, "input"),
        ("loss", after, "output loss", "vector"),
    } <= edges


def test_same_input_same_bytes(tmp_path: Path) -> None:
    path = ROOT / "examples" / "llama_block.coda"
    runs = [coda("draw", path, env={**os.environ, "PYTHONHASHSEED": seed}) for seed in ("1", "2")]
    assert runs[0].returncode == runs[1].returncode == 0
    assert runs[0].stdout == runs[1].stdout
    out = tmp_path / "pic.svg"
    r = coda("draw", path, "-o", out)
    assert r.returncode == 0 and r.stdout == "" and r.stderr == f"wrote {out}: llama_block\n"
    assert out.read_text() == runs[0].stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pic.svg"]  # no temporary file left


@pytest.mark.parametrize("name", PICTURES)
def test_the_pictures_in_the_docs_are_current(name: str, update_golden: bool) -> None:
    r = coda("draw", ROOT / "examples" / f"{name}.coda")
    assert r.returncode == 0, r.stderr
    golden(ROOT / "docs" / "images" / f"{name}.svg", r.stdout, update_golden)


def test_several_blocks_one_below_the_other(tmp_path: Path) -> None:
    src = (ROOT / "examples" / "llama_mlp.coda").read_text()
    block = src[src.index("block llama_mlp") :]
    path = tmp_path / "two.coda"
    path.write_text(src + "\n" + block.replace("block llama_mlp", "block second", 1))
    r = coda("draw", path)
    assert r.returncode == 0, r.stderr
    titles = [t for t in texts(r.stdout) if t.startswith("block ")]
    assert [t.split(":")[0] for t in titles] == ["block llama_mlp", "block second"]
    r = coda("draw", path, "--block", "second")
    assert r.returncode == 0, r.stderr
    assert [t.split(":")[0] for t in texts(r.stdout) if t.startswith("block ")] == ["block second"]


def test_backward_blocks_draw_with_their_elementwise_stage() -> None:
    import coda_lang

    for name in ("llama_block", "qk_norm"):
        back = coda_lang.load(ROOT / "examples" / f"{name}.coda")[name].grad()
        svg = draw([back.plan])
        assert_shows(svg, [back.plan])
        assert any(t.startswith("elementwise [") for t in texts(svg))


@settings(max_examples=30)
@given(random_blocks() | forward_blocks())
def test_random_programs_draw(fw: object) -> None:
    prog, plans, diags = check_source(fw.text)  # type: ignore[attr-defined]
    assert prog is not None and not diags
    chosen = [plans[b.name] for b in prog.blocks]
    svg = draw(chosen)
    assert svg.isascii() and draw(chosen) == svg
    assert_shows(svg, chosen)


def test_text_is_escaped() -> None:
    assert _esc('a < b && c > "d"') == "a &lt; b &amp;&amp; c &gt; &quot;d&quot;"
    assert _esc("\u00e9\u2192") == "&#233;&#8594;"
    assert _esc("a\x00b\tc\ud800") == "a&#65533;b&#9;c&#65533;"  # what XML 1.0 allows
    ET.fromstring(("<t>" + _esc("x < \x01 & \ud800 \U0001f600") + "</t>").encode())
    (plan,) = plans_of(ROOT / "examples" / "lm_head_ce.coda")
    assert "loss = where(target >= 0, lse - tgt, 0.0)" in texts(draw([plan]))
    assert "target &gt;= 0" in draw([plan])


def test_a_program_with_errors_exits_1_with_its_diagnostic() -> None:
    r = coda("draw", ROOT / "tests" / "bad" / "rmsnorm_same_stage.coda")
    no_traceback(r)
    assert r.returncode == 1
    assert r.stdout == ""
    assert "error[E0503]" in r.stderr and "rmsnorm_same_stage.coda:11:19" in r.stderr
    r = coda("draw", ROOT / "tests" / "bad" / "rmsnorm_same_stage.coda", "--error-format", "short")
    assert r.returncode == 1 and len(r.stderr.strip().split("\n")) == 1 and "E0503" in r.stderr


def test_usage_and_io_errors_exit_2(tmp_path: Path) -> None:
    example = ROOT / "examples" / "llama_mlp.coda"
    r = coda("draw", tmp_path / "missing.coda")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"coda: error: can't read {tmp_path / 'missing.coda'}: No such file or directory\n"
    r = coda("draw", example, "--block", "nope")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"coda: error: no block `nope` in {example}; blocks: llama_mlp\n"
    out = tmp_path / "no" / "such" / "folder" / "pic.svg"
    r = coda("draw", example, "-o", out)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"coda: error: can't write {out}: No such file or directory\n"
    assert not (tmp_path / "no").exists()
    r = coda("draw", example, "-o", tmp_path)  # a folder
    assert r.returncode == 2 and r.stderr.startswith(f"coda: error: can't write {tmp_path}: ")
    assert r.stderr.count("\n") == 1 and list(tmp_path.iterdir()) == []
    r = coda("draw")
    assert r.returncode == 2 and "coda: error:" in r.stderr
    for r in (coda("draw", tmp_path / "missing.coda"), coda("draw", example, "-o", out)):
        no_traceback(r)


def test_help() -> None:
    r = coda("draw", "--help")
    assert r.returncode == 0
    assert r.stdout.startswith("usage: coda draw ")
    for option in ("--block NAME", "-o OUT.svg", "--error-format"):
        assert option in r.stdout
    r = coda("--help")
    assert re.search(r"^\s+draw\s+draw a block's dataflow as SVG$", r.stdout, re.M)
