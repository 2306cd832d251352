"""coda_lang.core.progress: one updating line on a terminal, plain throttled lines elsewhere, silence on
request; coda fuzz's progress on top of it."""

from __future__ import annotations

import io

import pytest

from coda_lang.core.progress import Progress, duration


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_duration() -> None:
    assert [duration(s) for s in (0, 7.4, 83, 3723)] == ["0:00", "0:07", "1:23", "1:02:03"]


def test_terminal_one_updating_line_with_done_total_and_time_left(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CODA_PROGRESS", raising=False)
    out, clock = Tty(), Clock()
    p = Progress("coda: compiling kernels", 4, unit="kernels", stream=out, clock=clock)
    assert out.getvalue() == "\rcoda: compiling kernels: 0/4 kernels, 0:00\x1b[K"
    clock.t += 10
    p.advance(what="llama_mlp stage 1 at 128x192")
    assert out.getvalue().endswith(
        "\rcoda: compiling kernels: 1/4 kernels (llama_mlp stage 1 at 128x192), 0:30 left\x1b[K"
    )
    assert "\n" not in out.getvalue()  # one line, rewritten in place
    clock.t += 0.01
    p.advance()  # within a tenth of a second of the last update: not drawn
    assert out.getvalue().count("\r") == 2
    clock.t += 10
    p.add_total(2)  # more work found: 2 of 6 done in 20 s, 40 s left
    assert out.getvalue().endswith("2/6 kernels (llama_mlp stage 1 at 128x192), 0:40 left\x1b[K")
    p.close("compiled 6 kernels")
    assert out.getvalue().endswith("\r\x1b[Kcompiled 6 kernels\n")  # the line cleared, then the summary
    p.advance()
    assert out.getvalue().endswith("compiled 6 kernels\n")  # nothing after close


def test_terminal_line_fits_the_width(monkeypatch: pytest.MonkeyPatch) -> None:
    out = Tty()
    p = Progress("x" * 300, 3, stream=out, clock=Clock())
    monkeypatch.setattr(p, "_columns", lambda: 40)
    p.show(force=True)
    line = out.getvalue().split("\r")[-1].removesuffix("\x1b[K")
    assert len(line) == 39 and line.endswith("...")


def test_not_a_terminal_plain_lines_at_most_one_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CODA_PROGRESS", raising=False)
    out, clock = io.StringIO(), Clock()
    with Progress("coda fuzz: llama_mlp", 10, unit="cases", stream=out, interval=5.0, clock=clock) as p:
        for _ in range(4):
            clock.t += 2
            p.advance()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert lines == [
        "coda fuzz: llama_mlp: 0/10 cases, 0:00",  # when it starts
        "coda fuzz: llama_mlp: 3/10 cases, 0:14 left",  # 6 s later (the 2nd advance was 4 s in)
        "coda fuzz: llama_mlp: 4/10 cases, 0:12 left",  # at the end
    ]
    # the end is not written twice: a last line that already says the final count stands
    out, clock = io.StringIO(), Clock()
    with Progress("coda fuzz: bias_gelu", 2, unit="cases", stream=out, interval=1.0, clock=clock) as p:
        clock.t += 2
        p.advance(2)
        clock.t += 0.5
    assert out.getvalue().splitlines() == [
        "coda fuzz: bias_gelu: 0/2 cases, 0:00",
        "coda fuzz: bias_gelu: 2/2 cases, 0:02",
    ]


def test_quiet_and_coda_progress_0_write_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    out = Tty()
    Progress("a", 2, stream=out, quiet=True).advance()
    monkeypatch.setenv("CODA_PROGRESS", "0")
    p = Progress("a", 2, stream=out)
    p.advance()
    p.close("done")
    assert out.getvalue() == ""


def test_a_closed_stream_silences_it() -> None:
    out = io.StringIO()
    p = Progress("a", 2, stream=out)
    out.close()
    p.advance()  # no ValueError
    p.close()
    assert p.quiet


def test_fuzz_progress_counts_cases_then_shrinks() -> None:
    from coda_lang.fuzz import Progress as FuzzProgress

    out = io.StringIO()
    p = FuzzProgress("llama_mlp, target interp", 3, stream=out)
    p.step(False)
    p.step(True)
    p.step(False)  # shrinking
    p.done()
    assert out.getvalue().splitlines()[0] == "coda fuzz: llama_mlp, target interp: 0/3 cases, 0:00"
    assert out.getvalue().splitlines()[-1] == (
        "coda fuzz: llama_mlp, target interp: failure found after 2 cases; shrinking (1 tries)"
    )
