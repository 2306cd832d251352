"""Command output shown in the docs is what the commands print: every ```console block of README.md and
docs/*.md runs, and its text must match.

A console block is a transcript. A line starting with `$ ` is a command; the lines after it, up to the
next command or the end of the block, are its output: stdout and stderr together, in the order a
terminal shows them (the command runs with stderr into the same pipe and Python unbuffered). A last
output line `[exit N]` records a non-zero exit status; a command without one must exit 0.

The commands run in `sh` from a scratch copy of the project root (its files and folders linked, so that
what a command writes, such as `build/`, stays out of the checkout), one page's commands in order in one
copy, so that a later command may read what an earlier one wrote. `coda` is `python -m coda_lang.cli`
with this checkout's package. `$CODA_PROGRESS=0`: on a terminal a progress line is erased when the work
ends, so what stays is the rest. `$CODA_CACHE_DIR` is a fresh folder and `$COLUMNS` is 80 (`--help`).

Compared line by line, with two normalisations only: trailing spaces are ignored (editors drop them),
and an elapsed time at the end of a line, such as `(0.4 s)`, matches any time. Commands that need a GPU,
take long or print other varying output belong in ```sh blocks, which show commands without output; a
fenced block of another kind must not show a prompt or a line as `coda` prints them (`ok: `,
`error[`, `error: `, `wrote `).

`python -m pytest tests/test_doc_commands.py --update-golden` rewrites the outputs inside the pages
(a time-only difference is left as written) and skips; review the diff.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
EXIT = re.compile(r"^\[exit (\d+)\]$")
ELAPSED = re.compile(r"\(\d+(?:\.\d+)? s\)$")
SHELL_PRELUDE = 'coda() { "$CODA_DOC_PYTHON" -m coda_lang.cli "$@"; }\n'


@dataclass
class Command:
    line: int  # the 1-based line of its `$ ` line in the page
    text: str  # the command, without `$ `
    output: list[str]  # the output lines shown, without the `[exit N]` line
    status: int  # the exit status shown: 0 unless `[exit N]`


@dataclass
class Block:
    start: int  # 0-based index of the block's first line inside the fences
    end: int  # 0-based index of its closing fence
    commands: list[Command]


@dataclass
class Result:
    output: list[str]
    status: int


def fenced(text: str) -> list[tuple[int, int, str]]:
    """(index of the opening fence, index of the closing one, language) of each fenced block."""
    lines = text.split("\n")
    found = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            j = i + 1
            while j < len(lines) and not lines[j].startswith(m.group(1)):
                j += 1
            found.append((i, j, m.group(2)))
            i = j
        i += 1
    return found


def console_blocks(text: str) -> list[Block]:
    """The ```console blocks of a markdown page, parsed into commands and their shown output."""
    lines = text.split("\n")
    blocks: list[Block] = []
    for i, j, lang in fenced(text):
        if lang != "console":
            continue
        commands: list[Command] = []
        for k in range(i + 1, j):
            if lines[k].startswith("$ "):
                commands.append(Command(k + 1, lines[k][2:], [], 0))
            elif commands:
                commands[-1].output.append(lines[k])
            elif lines[k].strip():
                raise ValueError(f"line {k + 1}: a console block starts with a `$ ` command")
        for c in commands:
            if c.output and (e := EXIT.match(c.output[-1])):
                c.output.pop()
                c.status = int(e.group(1))
                if c.status == 0:
                    raise ValueError(f"line {c.line}: leave `[exit 0]` out")
        blocks.append(Block(i + 1, j, commands))
    return blocks


def scratch_root(into: Path) -> None:
    """Make `into` look like the project root: a link to each of its entries but build/ and hidden ones."""
    for entry in ROOT.iterdir():
        if entry.name != "build" and not entry.name.startswith("."):
            (into / entry.name).symlink_to(entry)


def run_commands(commands: list[Command]) -> list[Result]:
    """Run `commands` in order in one scratch copy of the project root; what each printed."""
    with tempfile.TemporaryDirectory(prefix="coda-doc-") as tmp:
        root = Path(tmp) / "root"
        root.mkdir()
        scratch_root(root)
        env = dict(os.environ)
        env.update(
            CODA_DOC_PYTHON=sys.executable,
            PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])]),
            PYTHONUNBUFFERED="1",
            PYTHONIOENCODING="utf-8",
            CODA_PROGRESS="0",
            CODA_CACHE_DIR=str(Path(tmp) / "cache"),
            COLUMNS="80",
        )
        results = []
        for c in commands:
            r = subprocess.run(
                ["sh", "-c", SHELL_PRELUDE + c.text],
                cwd=root,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                timeout=300,
            )
            out = r.stdout.decode("utf-8", errors="replace")
            if out.endswith("\n"):
                out = out[:-1]
            results.append(Result([line.rstrip() for line in out.split("\n")] if out else [], r.returncode))
    return results


def _normal(line: str) -> str:
    return ELAPSED.sub("(<time> s)", line.rstrip())


def mismatches(page: str, commands: list[Command], results: list[Result]) -> list[str]:
    """What differs between the shown output and the printed one, one message per command."""
    found = []
    for c, r in zip(commands, results, strict=True):
        shown, got = [_normal(x) for x in c.output], [_normal(x) for x in r.output]
        if shown != got:
            diff = difflib.unified_diff(shown, got, "shown", "printed", lineterm="", n=1)
            found.append(f"{page}:{c.line}: `$ {c.text}` prints other output:\n" + "\n".join(diff))
        if c.status != r.status:
            found.append(f"{page}:{c.line}: `$ {c.text}` exits {r.status}; the page shows exit {c.status}")
    return found


def transcript(c: Command, r: Result) -> list[str]:
    """A command's lines in a console block: what it printed (the page's own lines where they differ
    only in an elapsed time or trailing spaces), then `[exit N]` if it failed."""
    same = [_normal(x) for x in c.output] == [_normal(x) for x in r.output]
    out = [x.rstrip() for x in c.output] if same else r.output
    return [f"$ {c.text}", *out, *([f"[exit {r.status}]"] if r.status else [])]


def refreshed(text: str, results: list[Result]) -> str:
    """`text` with every console block's output replaced by `results` (one per command, in order)."""
    lines = text.split("\n")
    todo = iter(results)
    out: list[str] = []
    at = 0
    for b in console_blocks(text):
        out += lines[at : b.start]
        out += [line for c in b.commands for line in transcript(c, next(todo))]
        at = b.end
    return "\n".join(out + lines[at:])


def page_commands(text: str) -> list[Command]:
    return [c for b in console_blocks(text) for c in b.commands]


SHOWN = [p for p in PAGES if page_commands(p.read_text(encoding="utf-8"))]


def test_the_pages_that_show_output() -> None:
    # a page whose last console block goes (or whose fences break) would no longer be checked
    assert {p.relative_to(ROOT).as_posix() for p in SHOWN} >= {"README.md", "docs/tutorial.md"}


@pytest.mark.parametrize("page", SHOWN, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_shown_output_is_what_the_commands_print(page: Path, update_golden: bool) -> None:
    text = page.read_text(encoding="utf-8")
    commands = page_commands(text)
    results = run_commands(commands)
    name = page.relative_to(ROOT).as_posix()
    for c, r in zip(commands, results, strict=True):
        joined = "\n".join(r.output)
        assert "Traceback" not in joined and "internal error" not in joined, f"{name}:{c.line}: {joined}"
    if update_golden:
        new = refreshed(text, results)
        if new != text:
            page.write_text(new, encoding="utf-8")
        pytest.skip(f"{'rewrote' if new != text else 'kept'} {name}")
    found = mismatches(name, commands, results)
    assert not found, "\n\n".join(found) + "\n\nif the change is on purpose, run pytest --update-golden"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_other_blocks_show_no_output(page: Path) -> None:
    """Output shown outside a console block would go unchecked: a prompt, or a line `coda` prints."""
    name = page.relative_to(ROOT).as_posix()
    text = page.read_text(encoding="utf-8")
    lines = text.split("\n")
    for i, j, lang in fenced(text):
        for k in range(i + 1, j) if lang != "console" else ():
            assert not lines[k].startswith(("$ ", "ok: ", "error[", "error: ", "wrote ")), (
                f"{name}:{k + 1}: output in a ```{lang} block; make it a ```console block"
            )


# -- the comparison itself, on pages made up here ------------------------------------------------------

PAGE = """Some prose.

```console
$ coda check tests/bad/rmsnorm_same_stage.coda --error-format=short
tests/bad/rmsnorm_same_stage.coda:11:19: error[E0503]: row statistic `ss` is used to normalize `n` in its own stage
[exit 1]
$ echo one; echo two >&2; echo three
one
two
three
```

More prose.

```console
$ echo '(0.4 s)'
(0.4 s)
```
"""


def test_parse_commands_outputs_and_exit_status() -> None:
    blocks = console_blocks(PAGE)
    assert [(b.start, b.end) for b in blocks] == [(3, 10), (15, 17)]
    c = blocks[0].commands
    assert [x.line for x in c] == [4, 7] and c[0].status == 1 and c[1].status == 0
    assert c[0].output == [PAGE.split("\n")[4]] and c[1].output == ["one", "two", "three"]
    with pytest.raises(ValueError, match="starts with a `\\$ ` command"):
        console_blocks("```console\nstray\n$ true\n```\n")
    with pytest.raises(ValueError, match="leave `\\[exit 0\\]` out"):
        console_blocks("```console\n$ true\n[exit 0]\n```\n")


def test_a_changed_output_or_status_fails_and_refresh_restores_it() -> None:
    commands = page_commands(PAGE)
    results = run_commands(commands)
    assert mismatches("page.md", commands, results) == []
    assert refreshed(PAGE, results) == PAGE
    # a line changed, a time changed, the exit status dropped
    changed = PAGE.replace("two\n", "2\n").replace("(0.4 s)\n```", "(12 s)\n```").replace("[exit 1]\n", "")
    found = mismatches("page.md", page_commands(changed), results)
    assert len(found) == 2, found
    assert (
        found[0]
        == "page.md:4: `$ coda check tests/bad/rmsnorm_same_stage.coda --error-format=short` exits 1; the page shows exit 0"
    )
    assert found[1].startswith("page.md:6: `$ echo one; echo two >&2; echo three` prints other output:")
    assert "\n-2\n+two\n" in found[1]
    # the refresh writes the printed output and the status, and keeps the page's time
    assert refreshed(changed, results) == PAGE.replace("(0.4 s)\n```", "(12 s)\n```")


def test_elapsed_time_is_the_only_varying_text_allowed() -> None:
    c = Command(1, "x", ["ok: 20 cases (0.4 s)", "took 0.4 s", "padded  "], 0)
    same = Result(["ok: 20 cases (1.25 s)", "took 0.4 s", "padded"], 0)
    assert mismatches("p.md", [c], [same]) == []
    other = Result(["ok: 20 cases (1.25 s)", "took 1.2 s", "padded"], 0)
    assert len(mismatches("p.md", [c], [other])) == 1
