"""CUDA graph capture: whether one is under way, and the refusal of work that a graph can't hold.

What it does: `capturing()` says whether the current CUDA stream is capturing a graph
(`torch.cuda.graph`, `make_graphed_callables`); `refuse_in_capture(what, fix)` raises `CaptureError`
during a capture, for a step of coda's that would be wrong or impossible inside a graph: compiling or
timing kernels (the tuner waits for the GPU), and a first step's calibration of fp8 scales (a graph
would redo it at every replay). Each of those happens in the first eager steps, which PyTorch's own
recipe for capturing runs first.
What it does not: capture anything, or change what a step computes.
Invariants: `capturing()` is False without CUDA, and inside a torch.compile trace (which captures
nothing itself).
"""

from __future__ import annotations

import torch


class CaptureError(RuntimeError):
    """A step of coda's that a CUDA graph can't hold, met while capturing one."""


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (False without CUDA, or while traced)."""
    if torch.compiler.is_compiling():
        return False
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except (RuntimeError, AssertionError):  # (a torch without CUDA)
        return False


def refuse_in_capture(what: str, fix: str) -> None:
    """CaptureError while a CUDA graph is being captured: `what` can't be in one; `fix` says what to
    run first."""
    if capturing():
        raise CaptureError(f"coda: {what} while a CUDA graph is being captured; {fix}")
