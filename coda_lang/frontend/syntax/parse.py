"""Parse .coda text into a lark tree with positions, turning every lark error into a Diagnostic.

What it does: builds (once per process, never cached on disk) the LALR parser of frontend/syntax/grammar.lark and maps
UnexpectedCharacters / UnexpectedToken / UnexpectedEOF to E01 diagnostics with a caret and, where
the mistake is a common one, a named message (lark's `match_examples`); `span_of` and `text_of`
give a node's position and words, for lowering's diagnostics.
What it does not: resolve names or know any op (lower.py, blocks.py, exprs.py, ops/).
Invariants: `parse` returns either a tree or exactly one diagnostic; it never raises.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from coda_lang.core.diagnostics import Diagnostic
from coda_lang.ir.nodes import Span

GRAMMAR = Path(__file__).resolve().parent / "grammar.lark"

_TOKEN_NAMES = {
    "NAME": "a name",
    "INT": "an integer",
    "FLOAT": "a number",
    "STRING": "a string",
    "LPAR": "`(`",
    "RPAR": "`)`",
    "LBRACE": "`{`",
    "RBRACE": "`}`",
    "LSQB": "`[`",
    "RSQB": "`]`",
    "COMMA": "`,`",
    "COLON": "`:`",
    "EQUAL": "`=`",
    "SEMICOLON": "`;`",
    "PLUS": "`+`",
    "MINUS": "`-`",
    "STAR": "`*`",
    "SLASH": "`/`",
    "AT": "`@`",
    "CMP_OP": "a comparison",
    "GEMM": "`gemm`",
    "BLOCK": "`block`",
    "DIMS": "`dims`",
    "ELEMENTWISE": "`elementwise`",
    "__ANON_0": "`->`",
    "$END": "end of file",
    "MORETHAN": "`>`",
    "LESSTHAN": "`<`",
}

# Named syntax errors: (code, message, help, examples that produce the same parser state).
# lark compares parser states by stack depth, so each example comes with and without items before
# it (`dims ...`), and with zero, one, several parameters and a trailing comma.
_SIGNATURES = [
    "block f() {",
    "block f(x: f32) {",
    "block f(x: f32[M], y: f32) {",
    "block f(x: f32,) {",
    "block f(x: f32, y: f32,) {",
]
_NAMED: list[tuple[str, str, str, list[str]]] = [
    (
        "E0104",
        "block signature lacks its output list",
        "write the outputs after `->`, e.g. `-> (out: bf16[M, N])`",
        _SIGNATURES + ["dims M\n" + s for s in _SIGNATURES],
    ),
]


@lru_cache(maxsize=1)
def parser() -> Any:
    """The LALR parser, built from the grammar once per process (about 30 ms). Never lark's `cache=True`:
    that loads a pickle from the shared temp directory under a predictable name, which any local
    user could plant (code execution as whoever runs coda)."""
    from lark import Lark

    return Lark(GRAMMAR.read_text(), parser="lalr", propagate_positions=True, maybe_placeholders=True)


def _describe(tok_type: str, value: str) -> str:
    if tok_type in ("NAME",) and value:
        return f"`{value}`"
    return _TOKEN_NAMES.get(tok_type, f"`{value}`" if value else tok_type)


def _expected(names: set[str] | frozenset[str]) -> str:
    shown = sorted({_TOKEN_NAMES.get(n, n) for n in names if not n.startswith("__ANON") or n == "__ANON_0"})
    if len(shown) > 6:
        return ""
    return "expected " + ", ".join(shown)


def _numbers(tree: Any) -> list[Any]:
    """The INT and FLOAT tokens of a parse tree in source order, found without recursion (lark's
    `scan_values` recurses once per level: a chain of thousands of `+` would overflow the stack before
    the depth check, E0108, sees it)."""
    found = []
    stack = [tree]
    while stack:
        node = stack.pop()
        children = getattr(node, "children", None)
        if children is None:
            if getattr(node, "type", None) in ("INT", "FLOAT"):
                found.append(node)
            continue
        stack.extend(reversed(children))
    return found


def _check_numbers(tree: Any, file: str) -> Diagnostic | None:
    """E0107 for a number literal out of range: an integer that needs more than 64 bits (Python's
    int() refuses some of them outright), or a float that overflows to infinity."""
    for tok in _numbers(tree):
        digits = str(tok).lstrip("0")
        big = (
            len(digits) > 19 or int(digits or "0") >= 2**63
            if tok.type == "INT"
            else float(tok) == float("inf")
        )
        if big:
            shown = str(tok) if len(str(tok)) <= 24 else str(tok)[:20] + "..."
            span = Span(file, tok.line, tok.column, tok.end_line, tok.end_column)
            return Diagnostic(
                "E0107",
                f"number `{shown}` is out of range",
                span,
                label="an integer must fit in 64 bits" if tok.type == "INT" else "overflows to infinity",
            )
    return None


def parse(text: str, file: str) -> tuple[Any | None, Diagnostic | None]:
    from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

    p = parser()
    try:
        tree = p.parse(text)
        return (None, bad) if (bad := _check_numbers(tree, file)) else (tree, None)
    except UnexpectedInput as e:
        line, col = max(getattr(e, "line", 1) or 1, 1), max(getattr(e, "column", 1) or 1, 1)
        named = None
        try:
            named = e.match_examples(
                p.parse, {i: ex for i, (_, _, _, ex) in enumerate(_NAMED)}, use_accepts=True
            )
        except Exception:  # match_examples re-parses examples; never let that escape
            named = None
        if isinstance(e, UnexpectedCharacters):
            pos = e.pos_in_stream if e.pos_in_stream is not None else -1
            ch = text[pos] if 0 <= pos < len(text) else "?"
            span = Span(file, line, col, line, col + 1)
            return None, Diagnostic(
                "E0102", f"unexpected character `{ch}`", span, label="not part of the language"
            )
        if isinstance(e, UnexpectedEOF) or (isinstance(e, UnexpectedToken) and e.token.type == "$END"):
            lines = text.split("\n")  # lark counts lines by "\n" only (not "\r", "\f", "\u2028", ...)
            if len(lines) > 1 and not lines[-1]:
                lines.pop()  # point at the last line, not past the final newline
            last = len(lines)
            span = Span(file, last, len(lines[-1]) + 1, last, len(lines[-1]) + 2)
            exp = _expected(getattr(e, "accepts", None) or getattr(e, "expected", set()) or set())
            return None, Diagnostic(
                "E0103",
                "unexpected end of file",
                span,
                label=exp or "the file ends here",
                notes=["a `{` is probably missing its `}`"]
                if "RBRACE" in (getattr(e, "expected", None) or ())
                else [],
            )
        assert isinstance(e, UnexpectedToken)
        tok = e.token
        width = max(len(str(tok)), 1)
        span = Span(file, line, col, line, col + width)
        if named is not None:
            code, msg, hlp, _ = _NAMED[named]
            return None, Diagnostic(
                code, msg, span, label=f"found {_describe(tok.type, str(tok))}", help=[hlp]
            )
        start = getattr(tok, "start_pos", None)
        if tok.type == "STAR" and start and text[start - 1] == "*":  # PyTorch's power operator
            return None, Diagnostic(
                "E0101",
                "unexpected `**`: there is no power operator",
                Span(file, line, col - 1, line, col + 1),
                label="not part of the language",
                help=["write the product: `h * h` for a square"],
            )
        exp = _expected(e.accepts or e.expected)  # accepts: exact, where LALR lookaheads over-approximate
        return None, Diagnostic("E0101", f"unexpected {_describe(tok.type, str(tok))}", span, label=exp)


def span_of(file: str, node: Any) -> Span:
    """Where a node of the tree (a rule's subtree, or a token) is in `file` (line 0 when lark kept no
    position for it)."""
    meta = getattr(node, "meta", None)
    if meta is not None and not getattr(meta, "empty", True):
        return Span(file, meta.line, meta.column, meta.end_line, meta.end_column)
    line = getattr(node, "line", None)
    if line is not None:
        return Span(file, line, node.column, node.end_line, node.end_column)
    return Span(file, 0, 0, 0, 0)


def text_of(node: Any) -> str:
    """A node's tokens, joined by spaces (for a message that quotes what was written)."""
    if hasattr(node, "children"):
        return " ".join(text_of(c) for c in node.children if c is not None)
    return str(node)
