"""The kernel cache's folder: where it is, whether it can be trusted, and its files written and read safely.

What it does: `cache_dir()` is $CODA_CACHE_DIR, else ~/.cache/coda_lang/kernels, checked before a
process first uses it. The cache holds code that coda runs as the user who runs it (the emitted
epilogue modules, quack's compiled objects), so a folder someone else can write would let them run
code as that user: a folder is used only when it and each folder inside it that coda uses are owned
by this user and writable by no one else (no group or other write bit), and every folder above it is
owned by this user or root and writable by no one else unless sticky (as /tmp is). A missing cache
is created private (0700). An untrusted one is not used: a private cache is used instead (the
default one, else a new temporary folder, removed at exit) and a warning says so once, as ssh
ignores a key file others can read; `trusted(path)` refuses one given explicitly (`directory=`)
with `UnsafeCache`. A folder that can't be made or used at all (a file in the way, a path under
/proc) is an `OSError` naming it, which the commands report as exit 2. `subfolder` makes and checks
a folder inside the cache. `write_atomic` writes a file whole (a temporary file made with O_EXCL in
the same folder, its name unpredictable, then renamed over the target: a planted symlink is never
followed), `entry_lock` locks an entry (its lock file opened with O_NOFOLLOW), `write_source` stores an
emitted module under the hash of its text, and `load_module` runs one from its verified source text
(its name must be the hash of the text it holds), never through a bytecode cache: no `__pycache__`
file is read or written, and no folder is put on sys.path.
What it does not: decide what an entry holds or whether it is stale (cache.py), compile (compile.py).
Invariants: nothing is written to or loaded from a folder that fails the checks; every file in the
cache appears whole or not at all.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import importlib.machinery
import importlib.util
import os
import shutil
import stat
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path

from coda_lang.backend_cute.plan.emit import module_name


class UnsafeCache(OSError):
    """A cache folder that someone other than this user could write (or that is not a folder of its
    own): coda does not use it."""


def default_dir() -> Path:
    return Path.home() / ".cache" / "coda_lang" / "kernels"


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def problem(path: Path) -> str | None:
    """Why the existing folder `path` can't be trusted as (a folder of) a kernel cache, or None."""
    me = os.geteuid()
    real = Path(os.path.realpath(path))
    st = os.stat(real)
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a folder"
    if st.st_uid != me:
        return f"it is owned by {_owner(st.st_uid)}, not by you"
    if st.st_mode & 0o022:
        return f"its group or others can write it (mode {stat.S_IMODE(st.st_mode):04o})"
    for up in real.parents:
        s = os.stat(up)
        if s.st_uid not in (0, me):
            return f"it is inside {up}, owned by {_owner(s.st_uid)}"
        if s.st_mode & 0o022 and not s.st_mode & stat.S_ISVTX:
            return (
                f"it is inside {up}, which its group or others can write (mode {stat.S_IMODE(s.st_mode):04o})"
            )
    return None


def _make(path: Path) -> None:
    """`path` and the folders above it, made when missing (the cache itself private: 0700)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)


def trusted(path: Path) -> Path:
    """`path` as a cache folder, made when missing; UnsafeCache when it can't be trusted (see the
    module docstring), OSError when it can't be made."""
    _make(path)
    if not os.path.isdir(path):  # (a file in the way: unusable, not untrusted)
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
    why = problem(path)
    if why is not None:
        raise UnsafeCache(f"coda does not use the kernel cache {path}: {why}")
    return path


def subfolder(root: Path, *names: str) -> Path:
    """The folder `names` inside the cache `root`, made when missing; UnsafeCache when someone else
    owns or can write it (a folder left from when the cache was not private)."""
    folder = root.joinpath(*names)
    folder.mkdir(parents=True, exist_ok=True)
    for sub in [root.joinpath(*names[: i + 1]) for i in range(len(names))]:
        st = os.lstat(sub)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise UnsafeCache(
                f"coda does not use the kernel cache {root}: {sub} is not a private folder of yours "
                f"(remove it, or let only you write it)"
            )
    return folder


_WARNED: set[str] = set()


@functools.cache
def _fallback(bad: str) -> Path:
    """A private cache instead of the untrusted `bad`: the default one, else a new temporary folder
    (removed when this process exits)."""
    default = default_dir()
    if str(default) != bad:
        with contextlib.suppress(OSError):
            return trusted(default)
    tmp = Path(tempfile.mkdtemp(prefix="coda-kernels-"))
    pid = os.getpid()

    def remove() -> None:
        if os.getpid() == pid:  # (not in a forked child)
            shutil.rmtree(tmp, ignore_errors=True)

    atexit.register(remove)
    return tmp


def cache_dir() -> Path:
    """The kernel cache (see the module docstring): $CODA_CACHE_DIR, else the default, when it can be
    trusted; else a private one, said once on stderr. The choice is put in $CODA_CACHE_DIR, so that
    the worker processes this one starts use it too. OSError when the folder can't be made."""
    env = os.environ.get("CODA_CACHE_DIR")
    path = Path(env) if env else default_dir()
    try:
        return _checked(str(path), os.geteuid())
    except UnsafeCache as e:
        why = str(e).split(": ", 1)[-1]
    instead = _fallback(str(path))
    if str(path) not in _WARNED:
        _WARNED.add(str(path))
        print(
            f"coda: warning: not using the kernel cache {path}: {why}; using {instead} instead (the "
            "cache holds code that coda runs: only you may write it)",
            file=sys.stderr,
        )
    os.environ["CODA_CACHE_DIR"] = str(instead)
    return instead


@functools.lru_cache(maxsize=16)
def _checked(path: str, uid: int) -> Path:
    return trusted(Path(path))


def checked(path: Path) -> Path:
    """`trusted(path)`, checked once per process (a folder given as `directory=`)."""
    return _checked(str(path), os.geteuid())


def _file_mode() -> int:
    umask = os.umask(0o022)  # (read by setting it: there is no call that only reads it)
    os.umask(umask)
    return 0o666 & ~umask


def write_atomic(path: Path, text: str) -> None:
    """`text` into `path` whole: written to a new temporary file beside it (mkstemp: O_EXCL, a name no
    one can guess, so a planted symlink is never followed), then renamed over `path`."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def staged(path: Path, text: str) -> Iterator[Path]:
    """A new temporary file beside `path` holding `text` (made as `write_atomic` makes its own), for
    the caller to check and then rename over `path`; removed if it is still there afterwards."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _file_mode())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        yield Path(tmp)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


class EntryBusy(Exception):
    """Another process holds the entry's lock: it is building that kernel now (`entry_lock(wait=False)`)."""


@contextlib.contextmanager
def entry_lock(path: Path, wait: bool = True) -> Iterator[None]:
    """An exclusive lock on one cache entry (`path`: its lock file, opened without following a
    symlink), held while it is built: a second process asking for the same kernel waits, then finds it
    in the cache. `wait=False`: raise EntryBusy instead of waiting (a compile worker then builds
    another kernel first)."""
    try:
        import fcntl
    except ImportError:  # (not POSIX: no locking; writes are still atomic)
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeCache(f"the lock file {path} is not a plain file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            raise EntryBusy(str(path)) from None
        yield
    finally:
        os.close(fd)  # (closing releases the lock)


def write_source(source: str, directory: Path | None = None) -> Path:
    """Write `source` to <cache>/epilogues/<hash>.py (atomically; an existing file with that text is
    kept, one with any other is replaced)."""
    folder = subfolder(checked(directory) if directory is not None else cache_dir(), "epilogues")
    path = folder / f"{module_name(source)}.py"
    try:
        same = path.read_text(encoding="utf-8") == source
    except (OSError, UnicodeDecodeError):
        same = False
    if not same:
        write_atomic(path, source)
    return path


class _VerifiedSource(importlib.machinery.SourceFileLoader):
    """Runs a module from the text it was given (checked by the caller), never from a bytecode cache."""

    def __init__(self, name: str, path: str, text: str):
        super().__init__(name, path)
        self.text = text

    def get_source(self, fullname: str) -> str:
        return self.text

    def get_code(self, fullname: str) -> types.CodeType:
        return compile(self.text, self.path, "exec", dont_inherit=True)


def load_module(path: Path) -> types.ModuleType:
    """The emitted module at `path` (<cache>/epilogues/<hash>.py), run once per process from its text,
    after checking that the text is the one its name is the hash of (UnsafeCache otherwise)."""
    name = path.stem
    module = sys.modules.get(name)
    if module is not None:
        return module
    text = path.read_text(encoding="utf-8")
    if module_name(text) != name:
        raise UnsafeCache(f"{path} does not hold the text its name is the hash of; coda does not run it")
    loader = _VerifiedSource(name, str(path), text)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module
