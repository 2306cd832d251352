"""Malformed programs: valid source broken the ways real files are, and the check that nothing crashes.

What it does: `malformed(sources)` draws source text from `sources` (a strategy of valid programs) and
breaks it with any of: one to three edits of its tokens or characters (`mutated`: deleted, duplicated,
swapped, replaced names and numbers, dropped braces, inserted tokens or characters, truncation);
deep nesting (`nested`: an expression, a shape or braces wrapped tens to thousands of levels deep,
around the front end's MAX_DEPTH and far beyond); huge literals (`huge_literals`: numbers of thousands
of digits, exponents past f64's range, in expressions, dims, shapes, defaults and `group=`); and line
endings (`line_endings`: CRLF, lone CR, a mix per line, none at the end). `crash(text)` runs what
`coda check`, `coda grad` and `coda run` run on it, in this process (the CLI's `main`, and
`coda_lang.load`), and says how it crashed: a CLI exit code 3 (an internal error), an exception
escaping `main`, `coda_lang.load` raising anything but `CodaError`, or diagnostics that are not
well formed (`bad_diagnostics`: codes outside the error index, spans outside the text); None when
it did not.
What it does not: judge the diagnostics' contents (tests/test_robustness.py does), or time out a hang
(the caller does: scripts/robustness_stress.py gives each program a time limit).
Invariants: every strategy draws from hypothesis only (seeded, shrinkable); `crash` writes nothing
outside the temporary folder it is given and leaves the process's stdout and stderr as it found them.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from typing import Any

from hypothesis import strategies as st

from coda_lang.ir.types import DTYPES
from coda_lang.ops import BY_SURFACE

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
    from coda_lang.frontend.source import MAX_DEPTH

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


# ------------------------------------------------------------------------------------------------
# The check


SMALL = 4  # the size `coda run` gets for every dim the program does not fix
RUN_MEMORY = 64 << 20  # `coda run` only where the interpreter holds at most this (a huge shape: no)


def crash(
    text: str,
    folder: str,
    commands: tuple[str, ...] = ("check", "grad", "run"),
    counts: dict[str, int] | None = None,
) -> str | None:
    """How `commands` (of `coda check`, `coda grad`, `coda run`) or `coda_lang.load` crash on `text`
    (module docstring); None if none did. `folder`: a temporary folder for the program's file. `grad`
    and `run` run (per block, at most two) only on text that loads: on other text they give the
    diagnostics `check` gives, through the same path. `counts` (if given) counts the texts that loaded
    and each command run, by its exit code: {"loaded": 3, "check 1": 7, "grad 0": 2, ...}."""
    import coda_lang
    from coda_lang.cli import main
    from coda_lang.core.diagnostics import CodaError

    why = bad_diagnostics(text)
    if why:
        return why
    try:
        program = coda_lang.load(text + "\n")  # (a newline: never taken for a file name)
    except CodaError:
        program = None
    except RecursionError:
        return "coda_lang.load raised RecursionError"
    except Exception as e:
        return f"coda_lang.load raised {type(e).__name__}: {e}"
    if counts is not None and program is not None:
        counts["loaded"] = counts.get("loaded", 0) + 1
    path = os.path.join(folder, "prog.coda")
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    runs: list[list[str]] = []
    if "check" in commands:
        runs.append(["check", path])
    if program is not None:
        for block in list(program)[:2]:
            if "grad" in commands:
                runs.append(["grad", path, "--block", block.name])
            if "run" in commands and _memory(block) <= RUN_MEMORY:
                free = [d.name for d in block.ir.dims if d.value is None]
                dims = ["--dims", ",".join(f"{d}={SMALL}" for d in free)] if free else []
                runs.append(["run", path, "--block", block.name, *dims])
    for argv in runs:
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(argv)
        except SystemExit as e:  # argparse: a usage error
            code = e.code if isinstance(e.code, int) else 2
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # anything escaping main is a crash
            return f"coda {argv[0]} raised {type(e).__name__}: {e}"
        if counts is not None:
            counts[f"{argv[0]} {code}"] = counts.get(f"{argv[0]} {code}", 0) + 1
        if code == 3 or "Traceback" in err.getvalue():
            return f"coda {argv[0]} exited {code}: {err.getvalue().strip()[-500:]}"
    return None


def bad_diagnostics(text: str) -> str | None:
    """What is wrong with the diagnostics `check_source` gives for `text` (None: nothing): it must return
    them (not raise), with codes from the error index, spans inside the text (CR and CRLF end lines
    too), and they must render in both formats."""
    from coda_lang.core.diagnostics import CODES, render_all
    from coda_lang.frontend.source import check_source, normalize_newlines

    file = "malformed.coda"
    try:
        prog, _, diags = check_source(text, file)
        if (prog is None) != bool(diags):
            return f"check_source gave a program and {len(diags)} diagnostics"
        lines = normalize_newlines(text).count("\n") + 1
        for d in diags:
            if d.code not in CODES or not d.message:
                return f"a diagnostic with code {d.code!r} and message {d.message!r}"
            for span in [d.span] + [sp for sp, _ in d.related]:
                if span is not None and (span.file != file or not 1 <= span.line <= lines or span.col < 1):
                    return f"{d.short()}: its span {span} lies outside the text ({lines} lines)"
        for fmt in ("human", "short"):
            render_all(diags, {file: text}, fmt)
    except RecursionError:
        return "check_source raised RecursionError"
    except Exception as e:
        return f"check_source raised {type(e).__name__}: {e}"
    return None


def _memory(block: Any) -> int:
    """About the bytes `coda run` holds for `block` at SMALL sizes (0 where it can't tell: let it run)."""
    from coda_lang.interp.inputs import memory_needed

    dims = {d.name: d.value if d.value is not None else SMALL for d in block.ir.dims}
    try:
        return memory_needed(block.ir, dims)
    except Exception:
        return 0


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
    from coda_lang.testing import random_blocks

    return random_blocks().map(lambda fw: fw.text)
