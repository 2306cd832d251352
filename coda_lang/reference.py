"""The reference pages generated from the code, so they can't drift from it: the op table of the language
reference (from the op registry) and the error index (from the entries shipped in error_index/).

What it does: `op_table_markdown()` renders every op a program can write (coda_lang.ops.BY_SURFACE) with
its operands, keyword arguments, locality, differentiability, combine rule and one-line doc;
`entries()` reads the error index (one file per code: an explanation, a program that gets the code and
the program fixed); `explain(code)` is one entry as terminal text (`coda explain E0503`);
`errors_markdown()` is docs/errors.md. `python -m coda_lang.reference --write` rewrites the generated
parts of docs/ (between `<!-- generated:NAME -->` markers), `--check` fails when they are stale.
What it does not: check the entries' programs (tests/test_docs.py does, against the checker).
Invariants: every code of verify.diagnostics.CODES has exactly one entry; rendering is deterministic.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from coda_lang.ops import BY_SURFACE
from coda_lang.ops.registry import OpDef

INDEX = Path(__file__).resolve().parent / "error_index"
DOCS = Path(__file__).resolve().parent.parent / "docs"


def _signature(op: object) -> str:
    assert isinstance(op, OpDef)
    names = op.operand_names or {0: (), 1: ("x",), 2: ("a", "b"), 3: ("c", "a", "b")}[op.nin]
    if op.infix == "=":
        return "`y = x`"
    if op.infix == "neg":
        return "`-x`"
    if op.infix:
        return f"`a {op.infix} b`"
    args = list(names)
    for p in op.params:
        value = {"dim": "D", "int": "8", "dtype": "bf16"}.get(
            p.kind, f'"{p.choices[0]}"' if p.choices else "..."
        )
        text = value if p.positional else f"{p.name}={value}"
        args.append(text if p.required else f"[{text}]")
    outs = "a, b = " if op.nout == 2 else ""
    return f"`{outs}{op.surface}({', '.join(args)})`"


def op_table_markdown() -> str:
    """The op table: one row per op a program can write, in registry order."""
    rows = ["| op | locality | gradient | partials combine | what it computes |", "|---|---|---|---|---|"]
    seen = set()
    for ops in BY_SURFACE.values():
        for op in ops:
            if op.name in seen:
                continue
            seen.add(op.name)
            grad = "yes" if op.differentiable else "no"
            comb = op.combine.name if op.combine is not None else ""
            if op.decompose is not None:
                grad, locality = "via its rewrite", "rewritten"
            else:
                locality = op.locality.value
            doc = op.doc.replace("|", "\\|")  # a table cell
            rows.append(f"| {_signature(op)} | {locality} | {grad} | {comb} | {doc} |")
    return "\n".join(rows) + "\n"


@dataclass(frozen=True)
class Entry:
    code: str
    title: str
    text: str  # the explanation (markdown paragraphs)
    bad: str | None  # a program that gets the code (with an inline `# E: CODE` at the line), or None
    fixed: str | None  # the same program, fixed


def _parse(code: str, raw: str) -> Entry:
    """An entry file: `# CODE: title`, the explanation, then the sections `--- bad` and `--- fixed`
    (programs), each section optional."""
    head, *sections = re.split(r"^--- (bad|fixed)\n", raw, flags=re.M)
    first, _, text = head.partition("\n")
    m = re.fullmatch(r"# (E\d{4}): (.+)", first.strip())
    assert m and m.group(1) == code, f"{code}: the entry's first line is `# {code}: title`"
    progs = dict(zip(sections[0::2], sections[1::2], strict=True))
    return Entry(code, m.group(2), text.strip() + "\n", progs.get("bad"), progs.get("fixed"))


def entries() -> dict[str, Entry]:
    """Every entry of the error index, by code, in code order."""
    out = {}
    for f in sorted(INDEX.glob("E*.md")):
        out[f.stem] = _parse(f.stem, f.read_text(encoding="utf-8"))
    return out


def explain(code: str) -> str | None:
    """The entry of `code` as terminal text, or None when there is no such code."""
    e = entries().get(code)
    if e is None:
        return None
    parts = [f"{e.code}: {e.title}\n\n{e.text}"]
    if e.bad:
        parts.append("\nA program that gets it:\n\n" + _indent(e.bad))
    if e.fixed:
        parts.append("\nFixed:\n\n" + _indent(e.fixed))
    return "".join(parts)


def _indent(program: str) -> str:
    return "".join(f"    {line}\n" if line else "\n" for line in program.rstrip("\n").split("\n"))


def errors_markdown() -> str:
    """docs/errors.md's generated part: every entry."""
    out = []
    for e in entries().values():
        out.append(f"## {e.code}: {e.title}\n\n{e.text}")
        if e.bad:
            out.append(f"\nA program that gets it:\n\n```\n{e.bad.rstrip()}\n```\n")
        if e.fixed:
            out.append(f"\nFixed:\n\n```\n{e.fixed.rstrip()}\n```\n")
        out.append("\n")
    return "".join(out)


GENERATED = {"language.md": {"ops": op_table_markdown}, "errors.md": {"errors": errors_markdown}}


def regenerate(page: str, text: str) -> str:
    """`text` of docs/`page` with each generated region rewritten."""
    for name, fn in GENERATED[page].items():
        begin, end = f"<!-- generated:{name} -->\n", f"<!-- end:{name} -->"
        a, b = text.index(begin) + len(begin), text.index(end)
        text = text[:a] + fn() + text[b:]
    return text


def main(argv: list[str]) -> int:
    """`--write`: rewrite the generated parts of docs/; `--check`: exit 1 when they are stale."""
    if argv not in (["--write"], ["--check"]):
        print("usage: python -m coda_lang.reference --write | --check", file=sys.stderr)
        return 2
    stale = []
    for page in GENERATED:
        path = DOCS / page
        old = path.read_text(encoding="utf-8")
        new = regenerate(page, old)
        if new != old:
            stale.append(page)
            if argv == ["--write"]:
                path.write_text(new, encoding="utf-8")
    if stale and argv == ["--check"]:
        print(f"stale: {', '.join(stale)} (python -m coda_lang.reference --write)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
