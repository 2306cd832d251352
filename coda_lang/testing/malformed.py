"""Malformed programs: valid source broken the ways real files are, and the check that nothing crashes.

What it does: `malformed(sources)` draws source text from `sources` (a strategy of valid programs) and
breaks it with any of: one to three edits of its tokens or characters (`mutated`: deleted, duplicated,
swapped, replaced names and numbers, dropped braces, inserted tokens or characters, truncation);
deep nesting (`nested`: an expression, a shape or braces wrapped tens to thousands of levels deep,
around the front end's MAX_DEPTH and far beyond); huge literals (`huge_literals`: numbers of thousands
of digits, exponents past f64's range, in expressions, dims, shapes, defaults and `group=`); and line
endings (`line_endings`: CRLF, lone CR, a mix per line, none at the end).
What it does not: run anything on the text (`coda_lang.cli.crash` runs every command on it and says
how it crashed), or judge the diagnostics' contents (tests/test_robustness.py does).
Invariants: every strategy draws from hypothesis only (seeded, shrinkable).
"""

from __future__ import annotations

import os
import re

from hypothesis import strategies as st

from coda_lang.frontend.source import MAX_DEPTH
from coda_lang.ir.types import DTYPES
from coda_lang.ops import BY_SURFACE
from coda_lang.testing.programs import random_blocks

TOKEN_RE = re.compile(
    r"\s+|#[^\n]*|[A-Za-z_][A-Za-z0-9_]*|[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?\.?|->|<=|>=|==|!=|.", re.S
)


def tokens(text: str) -> list[str]:
    """The text cut into tokens (joined back, they are the text)."""
    return TOKEN_RE.findall(text)


NAMES = sorted(
    set(BY_SURFACE)
    | set(DTYPES)
    | {"acc", "transpose", "gemm", "block", "dims", "bool", "x", "_t1", "M", "N", "K", "D", "F", "w", "r"}
)
NUMBERS = [
    "0",
    "1",
    "2",
    "-1",
    "128",
    "0.5",
    "1e-6",
    "1e400",
    "-1e400",
    ".5",
    "1.",
    "007",
    "2" * 40,
    "9" * 5000,
]
HUGE = [
    "9" * 20,
    "9223372036854775808",  # 2**63
    "1" + "0" * 400,
    "9" * 5000,
    "1e308",
    "1e309",
    "1e-400",
    "1e999999999",
    "0." + "0" * 1000 + "1",
    "1" + "0" * 1000 + ".0",
    "340282366920938463463374607431768211456.0",  # 2**128: past f32
    "123456789" * 300 + "e-2700",
]
PUNCT = list("(){}[],:;=+-*/@<>.#!$`\\'\"") + ["->", "<=", ">=", "==", "!="]
SPACE = [" ", "\n", "\t", "\r\n", "\r", "\f", "  # comment\n", "\u2028", "\x00"]
KEYWORDS = ["dims", "block", "gemm", "transpose", "acc", "over", "group", "pairs", "interleave", "sum"]

token = st.sampled_from(NAMES + NUMBERS + PUNCT + SPACE + KEYWORDS)

EDITS = (
    "delete",
    "duplicate",
    "swap",
    "name",
    "number",
    "brace",
    "insert",
    "char_delete",
    "char_insert",
    "char_swap",
    "truncate",
)


@st.composite
def mutated(draw: st.DrawFn, sources: st.SearchStrategy[str], names: list[str] | None = None) -> str:
    """A program from `sources` with one to three random edits of its tokens or characters; `names`
    (default NAMES) are the names an edit puts in, alone or among the other tokens it inserts."""
    vocab = token if names is None else st.sampled_from(names + NUMBERS + PUNCT + SPACE + KEYWORDS)
    names = names or NAMES
    toks = tokens(draw(sources))
    for _ in range(draw(st.integers(1, 3))):
        if not toks:
            toks = [draw(vocab)]
        i = draw(st.integers(0, len(toks) - 1))
        j = draw(st.integers(0, len(toks) - 1))
        how = draw(st.sampled_from(EDITS))
        if how == "delete":
            del toks[i]
        elif how == "duplicate":
            toks.insert(i, toks[i])
        elif how == "swap":
            toks[i], toks[j] = toks[j], toks[i]
        elif how == "name":
            found = [k for k, t in enumerate(toks) if t[0].isalpha() or t[0] == "_"]
            if found:
                toks[draw(st.sampled_from(found))] = draw(st.sampled_from(names))
        elif how == "number":
            nums = [k for k, t in enumerate(toks) if t[0].isdigit() or (t[0] == "." and len(t) > 1)]
            if nums:
                toks[draw(st.sampled_from(nums))] = draw(st.sampled_from(NUMBERS))
        elif how == "brace":
            braces = [k for k, t in enumerate(toks) if t in "{}()[]"]
            if braces:
                del toks[draw(st.sampled_from(braces))]
        elif how == "insert":
            toks.insert(i, draw(vocab))
        else:
            text = "".join(toks)
            p = draw(st.integers(0, max(len(text) - 1, 0)))
            if how == "char_delete":
                text = text[:p] + text[p + 1 :]
            elif how == "char_insert":
                text = text[:p] + draw(st.characters()) + text[p:]
            elif how == "char_swap" and len(text) > p + 1:
                text = text[:p] + text[p + 1] + text[p] + text[p + 2 :]
            elif how == "truncate":
                text = text[:p]
            toks = tokens(text)
    return "".join(toks)


def _depths() -> st.SearchStrategy[int]:
    """How deep to nest: a little, around MAX_DEPTH (the front end's limit), or far beyond it."""

    return st.one_of(
        st.integers(1, 20),
        st.integers(MAX_DEPTH - 3, MAX_DEPTH + 3),
        st.integers(MAX_DEPTH // 2, 3 * MAX_DEPTH),
        st.sampled_from([1000, 5000, 20000]),
    )


NESTS = ("parens", "unary", "calls", "chain", "mixed", "braces", "brackets", "shape", "default")


@st.composite
def nested(draw: st.DrawFn, text: str) -> str:
    """`text` with one place nested deeply: the right-hand side of an assignment (parentheses, unary
    minus, calls, a chain of `+`, a mix of them), or braces, brackets, a shape or a default value."""
    n = draw(_depths())
    how = draw(st.sampled_from(NESTS))
    lines = text.split("\n")
    assigns = [
        k for k, ln in enumerate(lines) if re.search(r"[A-Za-z_0-9\]]\s*=\s*\S", ln) and "dims" not in ln
    ]
    if how in ("parens", "unary", "calls", "chain", "mixed") and assigns:
        k = draw(st.sampled_from(assigns))
        left, _, rhs = lines[k].partition("=")
        rhs = rhs.strip() or "acc"
        if how == "parens":
            rhs = "(" * n + rhs + ")" * n
        elif how == "unary":
            rhs = "-" * n + rhs
        elif how == "calls":
            f = draw(st.sampled_from(["exp", "tanh", "abs", "silu", "nope", "sum"]))
            rhs = f"{f}(" * n + rhs + ")" * n
        elif how == "chain":
            rhs = " + ".join([rhs] * min(n, 3000))
        else:
            parts = [draw(st.sampled_from(["(", "-", "exp(", "1.0 * ("])) for _ in range(min(n, 3000))]
            rhs = "".join(parts) + rhs + "".join(")" for p in reversed(parts) if p.endswith("("))
        lines[k] = f"{left}= {rhs}"
        return "\n".join(lines)
    p = draw(st.integers(0, len(text)))
    if how == "brackets":
        return text[:p] + "[" * n + "M" + "]" * draw(st.integers(0, n)) + text[p:]
    if how == "shape":
        return re.sub(r"\[(\w+)", lambda m: "[" + "(" * n + m.group(1) + ")" * n, text, count=1)
    if how == "default":
        return re.sub(
            r"(\w+: f32) *([,)])", lambda m: f"{m.group(1)} = {'-' * n}1.0{m.group(2)}", text, count=1
        )
    return text[:p] + "{" * n + "}" * draw(st.integers(0, n)) + text[p:]


SITES = {  # where a huge number goes: (pattern, replacement)
    "dim": (r"dims (\w+)", r"dims \1 = BIG"),
    "shape": (r"\[(\w+)", r"[BIG*\1"),
    "default": (r"(\w+: f32) *([,)])", r"\1 = BIG\2"),
    "group": (r"over=(\w+)\)", r"over=\1, group=BIG)"),
}


@st.composite
def huge_literals(draw: st.DrawFn, text: str) -> str:
    """`text` with one to three huge numbers: replacing numbers it has, as a dim's value, in a shape,
    as a default, as a reduction's group, or inserted anywhere."""
    for _ in range(draw(st.integers(1, 3))):
        big = draw(st.sampled_from(HUGE))
        where = draw(st.sampled_from(["number", "dim", "shape", "default", "group", "anywhere"]))
        toks = tokens(text)
        nums = [k for k, t in enumerate(toks) if t[0].isdigit() or (t[0] == "." and len(t) > 1)]
        if where == "number" and nums:
            toks[draw(st.sampled_from(nums))] = big
            text = "".join(toks)
        elif where in SITES:
            pattern, repl = SITES[where]
            whole = big.split("e")[0].split(".")[0]  # an integer where one is expected
            text = re.sub(
                pattern, repl.replace("BIG", whole if where in ("dim", "shape") else big), text, count=1
            )
        else:
            p = draw(st.integers(0, len(text)))
            text = text[:p] + big + text[p:]
    return text


LINE_ENDINGS = ("lf", "crlf", "cr", "mixed", "stray_cr", "no_final")


@st.composite
def line_endings(draw: st.DrawFn, text: str) -> str:
    """`text` with its line endings changed: all CRLF, all lone CR, a mix chosen per line, carriage
    returns inside lines, or the last newline removed."""
    how = draw(st.sampled_from(LINE_ENDINGS))
    lines = text.split("\n")
    if how == "crlf":
        return "\r\n".join(lines)
    if how == "cr":
        return "\r".join(lines)
    if how == "mixed":
        ends = [draw(st.sampled_from(["\n", "\r\n", "\r", "\n\r"])) for _ in lines[:-1]]
        return "".join(ln + e for ln, e in zip(lines, ends, strict=False)) + lines[-1]
    if how == "stray_cr":
        p = draw(st.integers(0, len(text)))
        return text[:p] + "\r" + text[p:]
    if how == "no_final":
        return text.rstrip("\n")
    return text


@st.composite
def malformed(draw: st.DrawFn, sources: st.SearchStrategy[str]) -> str:
    """A program from `sources` mutated, deeply nested, given huge literals and other line endings
    (each of the four with probability about one half, at least one of them)."""
    text = draw(sources)
    kinds = draw(
        st.lists(st.sampled_from(["mutate", "nest", "huge", "newlines"]), min_size=1, max_size=4, unique=True)
    )
    if "mutate" in kinds:
        text = draw(mutated(st.just(text)))
    if "nest" in kinds:
        text = draw(nested(text))
    if "huge" in kinds:
        text = draw(huge_literals(text))
    if "newlines" in kinds:
        text = draw(line_endings(text))
    return text


def examples_sources(folder: str) -> list[str]:
    """The text of every .coda file in `folder` (sorted by name)."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(".coda"))
    out = []
    for n in names:
        with open(os.path.join(folder, n), encoding="utf-8") as f:
            out.append(f.read())
    return out


def random_sources() -> st.SearchStrategy[str]:
    """Source text of random valid programs (`coda_lang.testing.random_blocks`)."""
    return random_blocks().map(lambda fw: fw.text)
