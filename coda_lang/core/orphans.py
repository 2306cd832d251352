"""No orphans: a worker process ends when the process that started it ends, however that one ends.

What it does: `die_with_parent(parent)` arms the calling process (a compile worker, a `coda fuzz
--jobs` job) to end with `parent`: on Linux the kernel sends it SIGKILL when its parent dies
(prctl PR_SET_PDEATHSIG, through ctypes: it covers SIGKILL of the parent, which no handler sees);
everywhere, a daemon thread also checks once a second that its parent is still `parent` (a process
whose parent died is adopted by another) and ends it otherwise. A parent that died before the call
ends the caller at once. `PARENT_ENV` is the environment variable through which a parent tells a
child it starts with subprocess who its parent is (`from_environment()` arms it).
What it does not: stop workers of a live parent (the pools do that), or clean up: a worker that
ends this way writes nothing more (every cache file is written whole or not at all).
Invariants: never raises (a platform without prctl keeps the thread alone); the child ends with
os._exit, which runs no handler and joins no thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

PARENT_ENV = "CODA_PARENT_PID"
_PR_SET_PDEATHSIG = 1
POLL_S = 1.0


def _pdeathsig() -> None:
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _watch(parent: int) -> None:
    while True:
        time.sleep(POLL_S)
        if os.getppid() != parent:
            os._exit(1)


def die_with_parent(parent: int) -> None:
    """End this process when `parent` (its parent's pid, as the parent knew it) ends."""
    _pdeathsig()
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)
    threading.Thread(target=_watch, args=(parent,), name="coda-parent-watch", daemon=True).start()


def from_environment() -> None:
    """`die_with_parent` for the parent named by $CODA_PARENT_PID (a child that subprocess started),
    if it names one; the variable is removed, so that this process's own children don't inherit it."""
    value = os.environ.pop(PARENT_ENV, "")
    if value.isdigit():
        die_with_parent(int(value))
