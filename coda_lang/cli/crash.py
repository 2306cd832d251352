"""Does any command crash on a text? The harness of the no-crash property (tests/test_robustness.py,
scripts/robustness_stress.py) over `coda_lang.testing.malformed`'s programs.

What it does: `crash(text, folder)` runs what `coda check`, `coda grad` and `coda run` run on the
text, in this process (the CLI's `main`, and `coda_lang.load`), and says how it crashed: a CLI exit
code 3 (an internal error), an exception escaping `main`, `coda_lang.load` raising anything but
`CodaError`, or diagnostics that are not well formed (`bad_diagnostics`: codes outside the error
index, spans outside the text); None when it did not.
What it does not: time out a hang (the caller does: scripts/robustness_stress.py gives each program a
time limit), or judge the diagnostics' contents (tests/test_robustness.py does).
Invariants: `crash` writes nothing outside the temporary folder it is given and leaves the process's
stdout and stderr as it found them.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import Any

import coda_lang
from coda_lang.cli import main
from coda_lang.core.diagnostics import CODES, CodaError, render_all
from coda_lang.frontend.source import check_source, normalize_newlines
from coda_lang.interp.inputs import memory_needed

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
    dims = {d.name: d.value if d.value is not None else SMALL for d in block.ir.dims}
    try:
        return memory_needed(block.ir, dims)
    except Exception:
        return 0
