"""Nothing loads code from a shared or user-writable path: a pickle planted where lark's parser cache
would be (the shared temp directory, under the name lark derives from the grammar) is never read, and
parsing writes nothing there.

The plant is made the way an attacker would: build the parser once with lark's `cache=True` in a
private temp directory to learn the file name, then replace that file by a pickle whose loading runs
code (it creates a marker file). `coda check` and `coda_lang.load` then run in fresh processes with
that directory as their temp directory.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

from coda_lang.frontend.syntax.parse import GRAMMAR

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "llama_mlp.coda"


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


# what coda_lang did before: lark's parser cache in the (shared) temp directory
LARK_CACHED = (
    "from lark import Lark; from coda_lang.frontend.syntax.parse import GRAMMAR; "
    "Lark(GRAMMAR.read_text(), parser='lalr', propagate_positions=True, maybe_placeholders=True, cache=True)"
)


def _plant(tmp: Path, marker: Path) -> list[Path]:
    """Plant a malicious pickle under every name lark's cache would use for our grammar in `tmp`."""
    planted = sorted(tmp.glob(".lark_cache_*.tmp"))
    if not planted:
        env = {**os.environ, "TMPDIR": str(tmp)}
        subprocess.run([sys.executable, "-c", LARK_CACHED], env=env, cwd=ROOT, check=True, timeout=120)
        planted = sorted(tmp.glob(".lark_cache_*.tmp"))
    assert planted, "lark wrote no cache file: the test can't learn the name to plant"
    for f in planted:
        sha = f.read_bytes().split(b"\n", 1)[0]
        f.write_bytes(sha + b"\n" + pickle.dumps(_Payload(marker)))
    return planted


def test_a_planted_parser_cache_is_never_loaded(tmp_path: Path) -> None:
    tmp = tmp_path / "shared-tmp"
    tmp.mkdir()
    marker = tmp_path / "pwned"
    env = {**os.environ, "TMPDIR": str(tmp)}
    _plant(tmp, marker)
    # the plant works: lark with cache=True (what coda_lang used) runs the payload (and then rewrites
    # the file with a good cache, so it is planted again below)
    subprocess.run([sys.executable, "-c", LARK_CACHED], env=env, cwd=ROOT, timeout=120, capture_output=True)
    assert marker.exists(), "the planted pickle did not run under lark's cache: the test would prove nothing"
    marker.unlink()
    planted = _plant(tmp, marker)
    before = {p: p.read_bytes() for p in planted}

    for args in (
        ["-m", "coda_lang.cli", "check", str(EXAMPLE)],  # the command line, and the Python API
        ["-c", f"import coda_lang; coda_lang.load({str(EXAMPLE)!r})"],
    ):
        r = subprocess.run(
            [sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr
    assert not marker.exists(), "coda ran a pickle planted in the shared temp directory"
    assert {p: p.read_bytes() for p in planted} == before, "coda rewrote a file in the shared temp directory"
    assert sorted(tmp.iterdir()) == planted, "parsing left files in the shared temp directory"


def test_the_grammar_is_read_from_the_package() -> None:
    assert GRAMMAR.is_relative_to(ROOT / "coda_lang")
