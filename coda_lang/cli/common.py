"""What every `coda` command shares: the argument parser's error behaviour, reading and writing files,
parsing sizes, loading one block, and the exit codes.

What it does: `Parser` (argparse with usage errors as exit 2 and a `coda: error:` line), `usage_error`,
`read_source_file`, `load_block` (a file's block by name, with diagnostics printed), `parse_dims`,
`parse_tile`, `parse_tile_subtile`, `parse_backward` (--remat, --chunk, --budget, --chunk-dim as one
`BackwardOptions`, checked by it: its TypeError or ValueError is a usage error), and atomic writers (`write_text`, `write_npz`: a temporary file in
the same folder renamed over the target, so no partial output file is ever left; the file gets the mode
open() would give it: the umask's for a new one, an existing one's own).
What it does not: any command's work (the modules beside it) or any compiler work (frontend/source.py, api.py).
Invariants: nothing here imports NumPy, torch or CuTeDSL at import time (`coda check` starts fast).
"""

from __future__ import annotations

import argparse
import os
import stat
import sys

from coda_lang.api import Block
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.core.diagnostics import render_all
from coda_lang.frontend.source import check_source

EXIT_OK, EXIT_ERRORS, EXIT_USAGE, EXIT_INTERNAL = 0, 1, 2, 3


def _digits(text: str) -> bool:
    """A decimal number in ASCII digits (str.isdigit also takes superscripts such as `²`, which int()
    refuses)."""
    return text.isascii() and text.isdigit()


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        print(f"coda: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


def read_source_file(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        print(f"coda: error: can't read {path}: {reason}", file=sys.stderr)
        return None


def usage_error(msg: str) -> int:
    print(f"coda: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def parse_dims(text: str | None, example: str = "M=4096,D=1024") -> dict[str, int] | str:
    """--dims NAME=SIZE,...: the sizes by name, or the one-line reason it is not that (a dim given
    twice too: `M=4,M=5` says nothing one could act on)."""
    if not text:
        return {}
    out: dict[str, int] = {}
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        name = name.strip()
        if not eq or not name.isidentifier() or not _digits(value.strip()) or int(value) <= 0:
            return f"--dims takes NAME=SIZE pairs separated by commas (e.g. {example}), got {text!r}"
        if name in out:
            return (
                f"--dims gives {name} twice ({name}={out[name]} and {name}={int(value)}); give each dim once"
            )
        out[name] = int(value)
    return out


def parse_backward(
    remat: str | None, chunk: str | None = None, budget: int | None = None, chunk_dim: str | None = None
) -> BackwardOptions | int:
    """The backward's options the flags give (`--chunk` a number of elements or auto), or the exit
    code after a one-line usage error: BackwardOptions says what is wrong with them."""
    n: int | str | None = int(chunk) if chunk is not None and _digits(chunk.lstrip("-")) else chunk
    try:
        return BackwardOptions.of(remat=remat, chunk=n, budget=budget, chunk_dim=chunk_dim)
    except (TypeError, ValueError) as e:
        return usage_error(str(e))


def parse_tile(text: str | None) -> tuple[int, int] | None | str:
    if not text:
        return None
    m, x, n = text.lower().partition("x")
    if not x or not _digits(m) or not _digits(n) or int(m) <= 0 or int(n) <= 0:
        return "bad"
    return int(m), int(n)


def parse_tile_subtile(text: str | None) -> tuple[int, int, int] | None | str:
    """MxN as (M, N, 0), MxNeS as (M, N, S): S, the epilogue subtile's width."""
    if not text:
        return None
    mn, e, width = text.lower().partition("e")
    tile = parse_tile(mn)
    if not isinstance(tile, tuple) or (e and not (_digits(width) and int(width) > 0)):
        return "bad"
    return (*tile, int(width) if e else 0)


def load_block(path: str, block: str | None, fmt: str = "human") -> tuple[object | None, int]:
    """(Block, 0), or (None, exit code) after printing why."""

    text = read_source_file(path)
    if text is None:
        return None, EXIT_USAGE
    prog, plans, diags = check_source(text, path)
    if diags:
        print(render_all(diags, {path: text}, fmt), file=sys.stderr)
        return None, EXIT_ERRORS
    assert prog is not None

    names = [b.name for b in prog.blocks]
    if block is None:
        if len(names) > 1:
            return None, usage_error(
                f"{path} has several blocks ({', '.join(names)}); choose one with --block"
            )
        block = names[0]
    if block not in names:
        return None, usage_error(f"no block `{block}` in {path}; blocks: {', '.join(names)}")
    b = next(b for b in prog.blocks if b.name == block)
    return Block(b, plans[block]), EXIT_OK


def _mode(path: str) -> int:
    """The mode a written file gets, as open() would give it: an existing file's own, else what the
    umask leaves of 0666 (mkstemp's temporary file is 0600, which a rename would keep)."""
    try:
        st = os.stat(path)
        if stat.S_ISREG(st.st_mode):
            return stat.S_IMODE(st.st_mode)
    except OSError:
        pass
    umask = os.umask(0o022)  # (read by setting it: there is no call that only reads it)
    os.umask(umask)
    return 0o666 & ~umask


def write_npz(path: str, arrays: dict[str, object]) -> None:
    """Write atomically: a temporary file in the same folder, renamed over `path` when complete."""
    import tempfile

    import numpy as np

    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".coda-", suffix=".npz", dir=folder)
    try:
        os.fchmod(fd, _mode(path))
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **{k: savable(v) for k, v in arrays.items()})  # type: ignore[arg-type]
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def savable(x: object) -> object:
    import numpy as np

    a = np.asarray(x)
    # (np.load reads ml_dtypes' arrays back as raw bytes: stored as f32, exactly)
    return a.astype(np.float32) if a.dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2") else a


def write_text(path: str, text: str) -> None:
    """Write atomically: a temporary file in the same folder, renamed over `path` when complete."""
    import tempfile

    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".coda-", suffix=".coda", dir=folder)
    try:
        os.fchmod(fd, _mode(path))
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
