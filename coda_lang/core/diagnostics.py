"""Diagnostics: source spans, error codes, the `Diagnostic` record, and its rustc-style and short renderings.

The ground floor of the package: it imports nothing of coda_lang, and every layer above raises its
errors through it.

What it does: `Span` (a source location), the table of error codes (by family: E01 syntax, E02
names, E03 dtypes, E04 shapes, E05 locality, E06 autodiff, E07 backend limits; E08 runtime inputs are
interp/inputs.py's INPUT_CODES), `Diagnostic`, `CodaError`, `render`, and `error()`, the one way to
make a located error: `raise error("E0801", "missing input `x`", span)`. `Mistake` is what a type
or locality rule raises when it does not know its span yet (the checker locates it).
What it does not: decide when an error occurs (frontend/syntax/, frontend/verify/, the runtimes).
Invariants: every code raised anywhere is in `CODES` (a test checks it); rendering never fails,
even for a span outside the source text.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Span:
    """A source location: file, and the first and one-past-last line and column (1-based)."""

    file: str
    line: int
    col: int
    end_line: int
    end_col: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


CODES: dict[str, str] = {
    # E01 syntax
    "E0101": "unexpected token",
    "E0102": "unexpected character",
    "E0103": "unexpected end of file",
    "E0104": "block signature lacks its output list",
    "E0105": "statement outside a block",
    "E0106": "no block in the file",
    "E0107": "number literal out of range",
    "E0108": "expression nested too deeply",
    # E02 names
    "E0201": "unknown name",
    "E0202": "name defined twice",
    "E0203": "unknown op",
    "E0204": "unknown dim",
    "E0205": "output never assigned",
    "E0206": "bad keyword argument",
    "E0207": "wrong number of operands or results",
    "E0208": "unknown dtype",
    "E0209": "duplicate declaration",
    "E0210": "`acc` outside a stage, or assigned to",
    "E0211": "bad stage option",
    # E03 dtypes
    "E0301": "dtype annotation conflicts with the declared output dtype",
    "E0302": "operand of the wrong dtype",
    "E0303": "storage dtype does not fit the value",
    "E0304": "bad default value",
    "E0305": "GEMM operand dtypes",
    # E04 shapes
    "E0401": "GEMM inner dimensions differ",
    "E0402": "shapes do not match",
    "E0403": "pairs on a width that may be odd",
    "E0404": "reduction over a dim the operand does not have",
    "E0405": "ambiguous broadcast on a square tile",
    "E0406": "shape differs from the declared shape",
    "E0407": "GEMM operand is not a matrix",
    "E0408": "bad grouped reduction",
    "E0409": "shape expression is not of the form c*X",
    "E0410": "repeated vector does not fit the columns",
    "E0411": "block scales that don't fit their GEMM operand",
    # E05 locality
    "E0501": "partial reduction used in its own stage",
    "E0502": "tile computation between stages",
    "E0503": "row statistic used to normalize in its own stage",
    "E0504": "vector computed in a stage used after it",
    "E0505": "tile operand not aligned with the stage's tile",
    "E0506": "op needs a tile inside a stage",
    "E0507": "vector op inside a stage",
    "E0508": "current scale over a whole row or column used in its own stage",
    # E06 autodiff (`coda grad`, Block.grad)
    "E0601": "autodiff made a block that does not check (a bug in coda_lang)",
    "E0602": "can't differentiate this program",
    # E07 backend limits (`coda compile`, coda_lang.backend_cute): valid programs the CuTeDSL backend
    # can't compile yet
    "E0701": "stage has no GEMM (the CuTeDSL backend compiles GEMM stages only)",
    "E0702": "dtype not supported by the CuTeDSL backend",
    "E0703": "op has no CuTeDSL emitter yet",
    "E0704": "column layout not supported by the epilogue",
    "E0705": "reduction not supported by the epilogue",
    "E0706": "no tile configuration compiles without register spills",
    "E0707": "the CuTeDSL compiler rejected the generated kernel",
    "E0708": "op between stages has no torch mapping in the CUDA runtime",
    "E0709": "GEMM with block scales of a form the kernels don't take",
}

# Codes `coda check` can't give: autodiff's (tested by tests/bad_grad/), E0601, which is a bug report, and
# the backend's (tested by tests/test_backend_emit.py, tests/test_backend_ptx.py and tests/test_runtime.py).
CHECK_ONLY_EXEMPT = {
    "E0601",
    "E0602",
    "E0701",
    "E0702",
    "E0703",
    "E0704",
    "E0705",
    "E0706",
    "E0707",
    "E0708",
    "E0709",
}


@dataclass
class Diagnostic:
    code: str
    message: str
    span: Span | None = None
    label: str = ""
    notes: list[str] = field(default_factory=list)
    help: list[str] = field(default_factory=list)
    # Further places to show, each with its own label.
    related: list[tuple[Span, str]] = field(default_factory=list)
    severity: str = "error"

    def short(self) -> str:
        where = f"{self.span}: " if self.span else ""
        return f"{where}{self.severity}[{self.code}]: {self.message}"


class CodaError(Exception):
    """Raised by the Python API when a program has errors; carries the diagnostics."""

    def __init__(self, diagnostics: list[Diagnostic], sources: dict[str, str] | None = None):
        self.diagnostics = list(diagnostics)
        self.sources = dict(sources or {})
        super().__init__(self.render("short"))

    def render(self, fmt: str = "human") -> str:
        return render_all(self.diagnostics, self.sources, fmt)


def error(
    code: str,
    message: str,
    span: Span | None = None,
    *,
    label: str = "",
    notes: list[str] | None = None,
    help: list[str] | None = None,
) -> CodaError:
    """A CodaError carrying one diagnostic (at `span`, when the error has a place in a source): the
    one way the layers above make an error to raise. `raise error(...)`."""
    return CodaError([Diagnostic(code, message, span, label=label, notes=notes or [], help=help or [])])


def with_sources(e: CodaError) -> CodaError:
    """`e` with the text of the files its spans point at (so that it renders with source lines)."""
    if e.sources:
        return e
    sources = {}
    for f in {d.span.file for d in e.diagnostics if d.span is not None}:
        with contextlib.suppress(OSError):
            sources[f] = Path(f).read_text()
    return CodaError(e.diagnostics, sources) if sources else e


class Mistake(Exception):
    """Raised by type and locality rules; the checker turns it into a Diagnostic at the eqn."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        label: str = "",
        arg: int | None = None,
        notes: list[str] | None = None,
        help: list[str] | None = None,
    ):
        super().__init__(message)
        self.code, self.message, self.label, self.arg = code, message, label, arg
        self.notes, self.help = notes or [], help or []


def _line(src: str | None, n: int) -> str | None:
    if src is None:
        return None
    lines = src.split("\n")  # as lark counts lines: "\r", "\f", "\u2028" ... don't end one
    return lines[n - 1].rstrip("\r") if 1 <= n <= len(lines) else None


def _snippet(
    span: Span, label: str, src: str | None, gutter: int, mark: str = "^", show_line: bool = True
) -> list[str]:
    text = _line(src, span.line)
    pad = " " * gutter
    if text is None:
        return []
    text = text.replace("\t", " ")
    start = max(span.col, 1)
    end = span.end_col if span.end_line == span.line and span.end_col > start else len(text) + 1
    carets = mark * max(1, min(end, len(text) + 1) - start)
    out = [f"{str(span.line).rjust(gutter)} | {text}"] if show_line else []
    out.append(f"{pad} | {' ' * (start - 1)}{carets}")
    if label:
        out[-1] += f" {label}"
    return out


def render(d: Diagnostic, sources: dict[str, str], fmt: str = "human") -> str:
    if fmt == "short":
        return d.short()
    head = f"{d.severity}[{d.code}]: {d.message}"
    if d.span is None:
        lines = [head]
        lines += [f"  = note: {n}" for n in d.notes] + [f"  = help: {h}" for h in d.help]
        return "\n".join(lines)
    spans = [d.span] + [s for s, _ in d.related]
    gutter = max(len(str(s.line)) for s in spans)
    pad = " " * gutter
    lines = [head, f"{pad}--> {d.span}", f"{pad} |"]
    lines += _snippet(d.span, d.label, sources.get(d.span.file), gutter)
    prev = d.span
    for span, label in d.related:  # secondary spans, marked `-` as in rustc
        if span.file != d.span.file:
            lines.append(f"{pad}::: {span}")
        if (span.file, span.line) == (prev.file, prev.line):  # same source line: only another marker line
            lines += _snippet(span, label, sources.get(span.file), gutter, "-", show_line=False)
        else:
            lines += [f"{pad} |"] + _snippet(span, label, sources.get(span.file), gutter, "-")
        prev = span
    if d.notes or d.help:
        lines.append(f"{pad} |")
    lines += [f"{pad} = note: {n}" for n in d.notes]
    lines += [f"{pad} = help: {h}" for h in d.help]
    return "\n".join(lines)


def render_all(diags: list[Diagnostic], sources: dict[str, str], fmt: str = "human") -> str:
    sep = "\n" if fmt == "short" else "\n\n"
    return sep.join(render(d, sources, fmt) for d in diags)


def code_counts(codes: list[str]) -> str:
    """How many of `codes` (diagnostic codes) are each code, in code order: `E0702 x30, E0704 x2`."""
    return ", ".join(f"{c} x{codes.count(c)}" for c in sorted(set(codes)))


def did_you_mean(name: str, candidates: list[str] | tuple[str, ...] | set[str]) -> str | None:
    """The closest candidate within a small edit distance, for 'did you mean' hints."""
    import difflib

    best = difflib.get_close_matches(name, sorted(candidates), n=1, cutoff=0.6)
    return best[0] if best else None
