"""A progress display for long work: kernel compiles, tile tuning, `coda fuzz`.

What it does: `Progress(label, total, unit=...)` shows what is being done, done/total and the time
left (`coda: compiling kernels: 12/72 (llama_mlp stage 3 at 128x192), 2 workers, 0:14 left`). On a
terminal it is one line rewritten in place (at most ten times a second) and cleared when the work
ends; otherwise (a log file, a pipe, CI) it writes plain lines: one when the work starts, at most one
every `interval` seconds while it runs, and one when it ends. `add_total` grows the total when the
work finds more to do (a spilling tile makes its stage try the next).
What it does not: decide what to report (its callers do), or write anywhere but its stream (stderr
by default).
Invariants: `quiet=True` or `$CODA_PROGRESS=0` writes nothing; a stream that can't be written (a
closed pipe) silences it instead of raising; the time left is shown only once something is done.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


def enabled() -> bool:
    """Whether progress displays are on ($CODA_PROGRESS=0 turns them off)."""
    return os.environ.get("CODA_PROGRESS", "1") != "0"


def duration(seconds: float) -> str:
    """0:07, 1:23, 1:02:03."""
    s = max(0, int(round(seconds)))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """One piece of long work: `advance()` per item done, `doing()` for what runs now, `close()` at
    the end (or use it as a context manager)."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        unit: str = "",
        stream: TextIO | None = None,
        quiet: bool = False,
        interval: float = 5.0,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet or not enabled()
        self.interval = interval
        self.clock = clock
        if tty is None:
            try:
                tty = bool(self.stream.isatty())
            except (AttributeError, ValueError):
                tty = False
        self.tty = tty
        self.count = 0
        self.what = ""
        self.extra = ""  # a fixed note after done/total ("2 workers")
        self.started = clock()
        self.last = float("-inf")
        self._shown: tuple[int, int] | None = None  # (count, total) of the last plain line written
        self.closed = False
        self._width = 0
        self.show(force=True)

    # -- what callers call ------------------------------------------------------------------------

    def add_total(self, n: int) -> None:
        self.total += n
        self.show()

    def doing(self, what: str) -> None:
        self.what = what
        self.show()

    def advance(self, n: int = 1, what: str | None = None) -> None:
        self.count += n
        if what is not None:
            self.what = what
        self.show()

    def close(self, summary: str | None = None) -> None:
        """End the display: a terminal's line is cleared (then `summary` is printed, if any); elsewhere
        the last state (or `summary`) is written as a plain line."""
        if self.closed:
            return
        self.closed = True
        if self.quiet:
            return
        if self.tty:
            self._write("\r\x1b[K" + (summary + "\n" if summary else ""))
        elif summary or self._shown != (self.count, self.total):  # (not the line just written again)
            self._write((summary or self.text()) + "\n")

    def detach(self) -> None:
        """The work goes on in the background while the program does other things: a terminal's line
        is cleared and, from now on, plain lines are written (as to a log) instead of one line rewritten
        in place under the program's own output."""
        if self.quiet or self.closed:
            return
        if self.tty:
            self._write("\r\x1b[K")
            self.tty = False
        self.show(force=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- rendering ----------------------------------------------------------------------------------

    def left(self) -> float | None:
        """Seconds left, from the mean time per item so far; None before the first item is done."""
        if self.count <= 0 or self.total <= self.count:
            return None if self.count <= 0 else 0.0
        per = (self.clock() - self.started) / self.count
        return per * (self.total - self.count)

    def text(self) -> str:
        count = f"{self.count}/{self.total}" + (f" {self.unit}" if self.unit else "")
        parts = [f"{self.label}: {count}"]
        if self.what:
            parts[0] += f" ({self.what})"
        if self.extra:
            parts.append(self.extra)
        left = self.left()
        elapsed = self.clock() - self.started
        if left is not None and self.count < self.total:
            parts.append(f"{duration(left)} left")
        else:
            parts.append(duration(elapsed))
        return ", ".join(parts)

    def show(self, force: bool = False) -> None:
        if self.quiet or self.closed:
            return
        now = self.clock()
        if self.tty:
            if not force and now - self.last < 0.1:
                return
            width = self._columns() - 1
            line = self.text()
            if len(line) > width:
                line = line[: max(0, width - 3)] + "..."
            self._write("\r" + line + "\x1b[K")
        elif force or now - self.last >= self.interval:
            self._write(self.text() + "\n")
            self._shown = (self.count, self.total)
        else:
            return
        self.last = now

    def _columns(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            return shutil.get_terminal_size((100, 20)).columns

    def _write(self, s: str) -> None:
        try:
            self.stream.write(s)
            self.stream.flush()
        except (OSError, ValueError):  # a closed pipe or file: stop reporting, never fail the work
            self.quiet = True
