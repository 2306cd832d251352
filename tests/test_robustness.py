"""The front end never crashes: any text gives diagnostics, never a Python exception.

Random text (any characters, and random sequences of the language's own tokens) and random
mutations of the example programs (tokens or characters deleted, duplicated, swapped; names and
numbers replaced; braces dropped) go through `check_source`, which must return normally with
diagnostics whose codes are all in CODES, whose spans lie inside the file, and which render in both
formats. `coda_lang.load` raises only `CodaError` for such text.

Malformed programs (`coda_lang.testing.malformed`: the examples and random programs mutated, nested
deeply, given huge literals and other line endings) also go through `coda check`, `coda grad` and
`coda run` (in-process): no exit code 3, no traceback. In CI a derandomized sample of 100;
`HYPOTHESIS_PROFILE=stress` takes 10,000 here, and `scripts/robustness_stress.py` runs 10,000 or more
in parallel jobs with a time limit per program (a hang) and prints what ran.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import coda, no_traceback
from test_roundtrip import programs

import coda_lang
from coda_lang.cli.crash import crash
from coda_lang.core.diagnostics import CODES, render_all
from coda_lang.frontend.source import check_source, normalize_newlines
from coda_lang.frontend.syntax.printer import print_program
from coda_lang.frontend.verify.plan import explain
from coda_lang.ir.types import DTYPES
from coda_lang.ops import BY_SURFACE
from coda_lang.testing.malformed import (
    KEYWORDS,
    NUMBERS,
    PUNCT,
    SPACE,
    malformed,
    mutated,
    random_sources,
    tokens,
)

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.coda"))
SOURCES = {p.name: p.read_text() for p in EXAMPLES}
FILE = "fuzz.coda"

NAMES = sorted(
    {t for src in SOURCES.values() for t in tokens(src) if t[0].isalpha() or t[0] == "_"}
    | set(BY_SURFACE)
    | set(DTYPES)
    | {"acc", "transpose", "gemm", "block", "dims", "bool", "x", "_t1"}
)
token = st.sampled_from(NAMES + NUMBERS + PUNCT + SPACE + KEYWORDS)


def assert_diagnosed(text: str) -> None:
    """check_source returns normally, with well-formed diagnostics that render."""
    prog, plans, diags = check_source(text, FILE)
    assert (prog is None) == bool(diags)
    nlines = normalize_newlines(text).count("\n") + 1  # CR and CRLF end lines too
    for d in diags:
        assert d.code in CODES, d.code
        assert d.message
        for span in [d.span] + [s for s, _ in d.related]:
            if span is None:
                continue
            assert span.file == FILE
            assert 1 <= span.line <= nlines, (d.short(), nlines)
            assert span.col >= 1, d.short()
    for fmt in ("human", "short"):
        out = render_all(diags, {FILE: text}, fmt)
        assert isinstance(out, str)
        if diags:
            assert all(f"[{d.code}]" in out for d in diags)
    if prog is not None:  # a mutation that is still a valid program: it explains and round-trips
        printed = print_program(prog)
        again, _, diags2 = check_source(printed)
        assert not diags2 and again == prog, printed
        for name in plans:
            assert explain(plans[name])
    if diags:  # the Python API raises CodaError, carrying the same diagnostics
        with pytest.raises(coda_lang.CodaError) as e:
            coda_lang.load(text + "\n")  # (a newline: never taken for a file name)
        assert [d.code for d in e.value.diagnostics] == [d.code for d in check_source(text + "\n")[2]]
        assert e.value.render("human") and e.value.render("short")


# ----------------------------------------------------------------------------------------------
# Random text


@settings(max_examples=150)
@given(st.text(max_size=200))
def test_random_text(text: str) -> None:
    assert_diagnosed(text)


@settings(max_examples=200)
@given(st.lists(token, max_size=60).map(" ".join))
def test_random_token_sequences(text: str) -> None:
    assert_diagnosed(text)


@settings(max_examples=200)
@given(st.lists(token, max_size=80).map("".join))
def test_random_token_sequences_unspaced(text: str) -> None:
    assert_diagnosed(text)


# ----------------------------------------------------------------------------------------------
# Mutated examples


mutated_example = mutated(st.sampled_from(sorted(SOURCES.values())), NAMES)


@settings(max_examples=250)
@given(mutated_example)
def test_mutated_examples(text: str) -> None:
    assert_diagnosed(text)


@settings(max_examples=100)
@given(mutated(programs(), NAMES))
def test_mutated_random_programs(text: str) -> None:
    assert_diagnosed(text)


# ----------------------------------------------------------------------------------------------
# Hand-picked odd inputs (each once crashed, or nearly: kept as regression tests)

ODD = {
    "empty": "",
    "only_comment": "# nothing\n",
    "huge_int_dim": "dims M = " + "9" * 5000 + "\nblock f(x: f32[M]) -> (y: f32[M]) { y = x }\n",
    "huge_int_literal": "dims M\nblock f(x: f32[M]) -> (y: f32[M]) { y = x + " + "9" * 5000 + " }\n",
    "huge_shape": "dims M\nblock f(x: f32[" + "9" * 5000 + "*M]) -> (y: f32[M]) { y = x }\n",
    "huge_default": "dims M\nblock f(x: f32[M], e: i32 = " + "9" * 5000 + ") -> (y: f32[M]) { y = x }\n",
    "huge_group": "dims M, N, K\nblock f(a: bf16[M, K], w: bf16[K, N]) -> (s: f32[M]) {\n"
    "  gemm a @ w { s = sum(acc, over=N, group=" + "9" * 5000 + ") }\n}\n",
    "inf_literal": "dims M\nblock f(x: f32[M]) -> (y: f32[M]) { y = x * 1e400 }\n",
    "carriage_returns": "dims M\rblock f(x: f32[M]) -> (y: f32[M]) {\r y = q\r}\r",
    "form_feed_lines": "dims M\n\f\fblock f(x: f32[M]) -> (y: f32[M]) {\n y = q\n}\n",
    "unicode_line_sep": "# a\u2028b\ndims M\nblock f(x: f32[M]) -> (y: f32[M]) {\n y = q\n}\n",
    "nul": "dims M\x00\n",
    "zero_dim": "dims M = 0\nblock f(x: f32[M]) -> (y: f32[M]) { y = x }\n",
    "divide_dim_by_zero": "dims M\nblock f(x: f32[M/0]) -> (y: f32[M]) { y = x }\n",
    "over_zero": "dims M, N, K\nblock f(a: bf16[M, K], w: bf16[K, N]) -> (s: f32[M]) {\n"
    "  gemm a @ w { s = sum(acc, over=0) }\n}\n",
    "group_zero": "dims M, N, K\nblock f(a: bf16[M, K], w: bf16[K, N]) -> (s: f32[M, N]) {\n"
    "  gemm a @ w { g = sum(acc, over=N, group=0)\n s = acc * g }\n}\n",
    "transpose_of_expr": "dims M, N, K\nblock f(a: bf16[M, K], w: bf16[K, N]) -> (s: f32[M, N]) {\n"
    "  gemm a @ transpose(transpose) { s = acc }\n}\n",
    "acc_as_operand": "dims M, N, K\nblock f(a: bf16[M, K], w: bf16[K, N]) -> (s: f32[M, N]) {\n"
    "  gemm acc @ w { s = acc }\n}\n",
    "nested_gemm": "dims M, N, K\nblock f(a: bf16[M, K], w: bf16[K, N]) -> (s: f32[M, N]) {\n"
    "  gemm a @ w { gemm a @ w { s = acc } }\n}\n",
    "pairs_nested": "dims M, N, K\nblock f(a: bf16[M, K], w: bf16[K, 2*N]) -> (s: f32[M, N]) {\n"
    "  gemm a @ w { s = pairs(acc) + 1.0 }\n}\n",
    "three_targets": "dims M, N, K\nblock f(a: bf16[M, K], w: bf16[K, 2*N]) -> (s: f32[M, N]) {\n"
    "  gemm a @ w { s, t, u = pairs(acc) }\n}\n",
    "cast_kw_and_pos": "dims M\nblock f(x: f32[M]) -> (y: f32[M]) { y = cast(x, bf16, dtype=f16) }\n",
    "cast_expr_dtype": "dims M\nblock f(x: f32[M]) -> (y: f32[M]) { y = cast(x, 1 + 2) }\n",
    "annotated_shape": "dims M\nblock f(x: f32[M]) -> (y: f32[M]) { y: bf16[M] = x }\n",
    "three_dim_param": "dims M\nblock f(x: f32[M, M, M]) -> (y: f32[M]) { y = x }\n",
    "scalar_gemm": "dims M\nblock f(x: f32, w: f32) -> (y: f32) { gemm x @ w { y = acc } }\n",
    "bool_output": "dims M\nblock f(x: f32[M]) -> (y: f32[M]) { y = x < 1.0 }\n",
    "dim_as_target": "dims M\nblock f(x: f32[M]) -> (M: f32[M]) { M = x }\n",
    "duplicate_everything": "dims M, M\nblock f(x: f32[M], x: f32[M]) -> (y: f32[M], y: f32[M]) { y = x\n y = x }\n"
    "block f(x: f32[M]) -> (y: f32[M]) { y = x }\n",
}


@pytest.mark.parametrize("text", list(ODD.values()), ids=list(ODD))
def test_odd_inputs(text: str) -> None:
    assert_diagnosed(text)


# Inputs that once crashed or were accepted silently, with the diagnostics they must give now.
EXPECTED = {
    "cast_without_dtype": ("dims M\nblock f(x: f32[M]) -> (y: f32[M]) { y = cast(x) }\n", ["E0206"]),
    "keyword_twice": ("dims M\nblock f(x: f32[M]) -> (y: f32) { y = sum(x, over=M, over=M) }\n", ["E0206"]),
    "output_twice": ("dims M\nblock f(x: f32[M]) -> (y: f32[M], y: f32[M]) { y = x }\n", ["E0209"]),
    "shape_not_integer": ("dims M = 3\nblock f(x: f32[M/2]) -> (y: f32[M/2]) { y = x }\n", ["E0409"]),
    "huge_int": (ODD["huge_int_literal"], ["E0107"]),
    "int_over_64_bits": (
        "dims M = 9223372036854775808\nblock f(x: f32[M]) -> (y: f32[M]) { y = x }\n",
        ["E0107"],
    ),
    "inf_literal": (ODD["inf_literal"], ["E0107"]),
    "eof_after_carriage_returns": ("dims M\rblock f(x: f32[M]) -> (y: f32[M]) {\r", ["E0103"]),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_odd_inputs_give_these_diagnostics(name: str) -> None:
    text, codes = EXPECTED[name]
    assert_diagnosed(text)
    assert [d.code for d in check_source(text, FILE)[2]] == codes


def test_the_largest_64_bit_integer_is_fine() -> None:
    text = "dims M = 9223372036854775807\nblock f(x: f32[M]) -> (y: f32[M]) { y = x }\n"
    assert check_source(text)[2] == []


def test_load_of_a_long_line_of_text_is_text() -> None:
    """A long string with no newline is source text (not a failed attempt to open a file)."""
    with pytest.raises(coda_lang.CodaError):
        coda_lang.load("x" * 5000)
    with pytest.raises(coda_lang.CodaError):
        coda_lang.load("\x00")


# ------------------------------------------------------------------ deep nesting, many errors, line endings

HEAD = "dims M, N, K\nblock b(x: bf16[M, K], w: bf16[K, N]) -> (y: bf16[M, N]) {\n  gemm x @ w {\n    y = "
TAIL = "\n  }\n}\n"


@pytest.mark.parametrize(
    "expr",
    [
        " + ".join(["acc"] * 245),
        "-" * 245 + "acc",
        "exp(" * 326 + "acc" + ")" * 326,
    ],
    ids=["chain", "unary", "calls"],
)
def test_deep_expressions_are_e0108(expr: str, tmp_path: Path) -> None:
    text = HEAD + expr + TAIL
    with pytest.raises(coda_lang.CodaError) as e:
        coda_lang.load(text)
    assert [d.code for d in e.value.diagnostics] == ["E0108"]
    path = tmp_path / "deep.coda"
    path.write_text(text)
    r = coda("check", path)
    no_traceback(r)
    assert r.returncode == 1 and "error[E0108]" in r.stderr


def test_nesting_below_the_limit_checks_prints_and_differentiates() -> None:
    from coda_lang.frontend.source import MAX_DEPTH

    for expr in (
        "(" * 400 + "acc" + ")" * 400,  # parentheses make no nesting of their own
        " + ".join(["acc"] * (MAX_DEPTH - 10)),
        "-" * (MAX_DEPTH - 10) + "acc",
        "exp(" * (MAX_DEPTH - 10) + "acc" + ")" * (MAX_DEPTH - 10),
    ):
        block = coda_lang.load(HEAD + expr + TAIL)["b"]
        assert coda_lang.load(str(block))["b"].ir == block.ir
        assert coda_lang.load(str(block.grad()))  # the backward prints and loads back


def test_many_unknown_names_give_hints_only_for_the_first_ones() -> None:
    from coda_lang.frontend.syntax.scope import MAX_HINTS

    body = "".join(f"    t{i} = acc + t{i}x\n" for i in range(400))  # did you mean `t{i - 1}`?
    text = HEAD.replace("    y = ", "") + body + "    y = acc" + TAIL
    _, _, diags = check_source(text, FILE)
    assert [d.code for d in diags] == ["E0201"] * 400
    hinted = [d for d in diags if any("did you mean" in h for h in d.help)]
    assert 0 < len(hinted) <= MAX_HINTS  # each hint compares the name with every known one


@pytest.mark.parametrize("newline", ["\r", "\r\n", "\n"], ids=["cr", "crlf", "lf"])
def test_line_endings_mean_the_same_in_a_file_and_in_text(newline: str, tmp_path: Path) -> None:
    text = SOURCES["llama_mlp.coda"].replace("\n", newline)
    from_text = coda_lang.load(text)["llama_mlp"]
    path = tmp_path / "mlp.coda"
    path.write_bytes(text.encode())
    assert coda_lang.load(path)["llama_mlp"].ir.body == from_text.ir.body
    assert coda("check", path).returncode == 0
    bad = text.replace("x2 = acc + h", "x2 = acc + hh")
    with pytest.raises(coda_lang.CodaError) as e:
        coda_lang.load(bad)
    (d,) = e.value.diagnostics
    assert (d.span.line, d.span.col) == (25, 16), d.span  # counted as lines, whatever ends them


@pytest.mark.parametrize(
    "args",
    [
        ["compile", "examples/llama_mlp.coda", "--emit", "ptx", "--tile", "128x192e²"],
        ["compile", "examples/llama_mlp.coda", "--emit", "ptx", "--tile", "²x2"],
        ["run", "examples/llama_mlp.coda", "--sim-tile", "１２８x64"],
        ["run", "examples/llama_mlp.coda", "--seed", "-1"],
        ["run", "examples/llama_mlp.coda", "--dims", "M=²"],
    ],
)
def test_odd_options_are_usage_errors(args: list[str]) -> None:
    r = coda(*args)
    no_traceback(r)
    assert r.returncode == 2 and "coda: error:" in r.stderr and not r.stdout, r.stderr


def test_the_emitted_kernel_does_not_change_with_the_layout_of_the_source() -> None:
    from coda_lang.backend_cute.plan.emit import emit_stage
    from coda_lang.backend_cute.plan.planner import plan_stage

    text = SOURCES["llama_mlp.coda"]
    moved = text.replace("dims M, D, F", "# a comment\n\n# and another\ndims M, D, F")
    for k in (1, 2, 3):
        a = emit_stage(plan_stage(coda_lang.load(text)["llama_mlp"], k))
        b = emit_stage(plan_stage(coda_lang.load(moved)["llama_mlp"], k))
        assert a == b  # the kernel's cache key is its text


# ------------------------------------------------------------------ malformed programs, every command


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("malformed")


MALFORMED = malformed(st.one_of(st.sampled_from(sorted(SOURCES.values())), programs(), random_sources()))


@settings(max_examples=max(100, settings.default.max_examples))
@given(MALFORMED)
def test_malformed_programs_crash_no_command(folder: Path, text: str) -> None:
    """Mutations, deep nesting, huge literals and line endings, together: the diagnostics are well
    formed, and `coda check`, `coda grad`, `coda run` (at small dims) and `coda_lang.load` don't crash."""
    assert_diagnosed(text)
    assert crash(text, str(folder)) is None


@pytest.mark.parametrize("how", ["chain", "unary", "calls"])
def test_thousands_of_levels_are_e0108_not_a_recursion_error(how: str) -> None:
    """(lark's scan_values, which looked for out-of-range numbers before the depth check, recursed once
    per level: a chain of 3000 `+` overflowed the stack)"""
    expr = {
        "chain": " + ".join(["acc"] * 5000),
        "unary": "-" * 5000 + "acc",
        "calls": "exp(" * 5000 + "acc" + ")" * 5000,
    }[how]
    with pytest.raises(coda_lang.CodaError) as e:
        coda_lang.load(HEAD + expr + TAIL)
    assert [d.code for d in e.value.diagnostics] == ["E0108"]


def _chain(n: int) -> str:
    """One epilogue of `n` statements, each reading the one before it (and acc)."""
    body = "\n".join(f"    t{i} = t{i - 1} * 1.5 + acc" for i in range(1, n))
    return (
        "dims M, K, N\n\nblock chain(x: f32[M, K], w: f32[K, N]) -> (y: f32[M, N]) {\n  gemm x @ w {\n"
        f"    t0 = acc * 1.5\n{body}\n    y = t{n - 1}\n  }}\n}}\n"
    )


def test_a_long_chain_of_statements_differentiates(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`coda check` takes an epilogue of 600 dependent statements; `coda grad` must too, under each
    policy (the backward recomputes the chain from acc, which walked it recursively, one Python frame
    group per statement: a RecursionError from 163 statements on)."""
    from coda_lang.cli import main

    path = tmp_path / "chain.coda"
    path.write_text(_chain(600))
    assert main(["check", str(path)]) == 0
    for remat in ("auto", "recompute", "save"):
        assert main(["grad", str(path), "--remat", remat, "-o", str(tmp_path / "g.coda")]) == 0, remat
        text = (tmp_path / "g.coda").read_text()
        # every statement's value and its cotangent: at least two lines each, whatever the policy
        assert "dx = acc" in text and "dw = acc" in text and text.count("\n") > 2 * 600, remat
    capsys.readouterr()


@pytest.mark.slow
def test_ten_thousand_statements_differentiate(tmp_path: Path) -> None:
    path = tmp_path / "chain.coda"
    path.write_text(_chain(10_000))
    r = coda("grad", path, "-o", tmp_path / "g.coda", timeout=600)
    no_traceback(r)
    assert r.returncode == 0, r.stderr


SEEN: dict[str, int] = {}


@settings(max_examples=120, derandomize=True, database=None)
@given(malformed(st.just(SOURCES["llama_mlp.coda"])))
def _draw_malformed(text: str) -> None:
    for what, hit in {
        "crlf": "\r\n" in text,
        "lone cr": bool(re.search("\r(?!\n)", text)),
        "deep": "(" * 90 in text or "-" * 90 in text or "exp(" * 90 in text or "[" * 90 in text,
        "huge": "9" * 1000 in text or "0" * 400 in text or "e999999999" in text,
        "mutated": "gemm y @ w_o" not in text or "x2 = acc + h" not in text,
    }.items():
        SEEN[what] = SEEN.get(what, 0) + hit


def test_the_malformed_strategies_make_what_they_say() -> None:
    """Each way of breaking a program shows in what 120 draws make: CRLF and lone CR line endings,
    nesting around MAX_DEPTH, numbers of a thousand digits, edits."""
    SEEN.clear()
    _draw_malformed()
    assert all(SEEN.get(k, 0) >= 2 for k in ("crlf", "lone cr", "deep", "huge", "mutated")), SEEN
