"""The kernel cache no one else can use against you (coda_lang/backend_cute/build/store.py).

- A cache folder someone else owns, or that its group or others can write, is not used: a private one
  is used instead and a warning says so (one given as `directory=` is refused: UnsafeCache); a folder
  inside a private cache that someone else can write is refused too. As two users where the machine
  has them (root and `nobody`, the second by os.setuid in a subprocess), skipped otherwise: a cache
  `nobody` made and planted bytecode in is not used by root, and root's is not used by `nobody`.
- An emitted module is run from its verified source text, never from a bytecode cache: a `.pyc`
  planted with a header that matches the `.py` is never read (through `load_epilogue` too, where the
  toolchain is installed), and none is written; a module whose text is not the one its name is the
  hash of is refused.
- Files are written through temporary files no one can guess (symlinks planted at the names an older
  coda_lang used are not followed) and lock files are opened without following a symlink.
- `complete_ptx` tells a whole PTX module from one cut short at any byte.
- `coda tune` with a cache that can't be written (a file in the way, a path under /proc) exits 2 with
  one line, as `coda compile` does.
"""

from __future__ import annotations

import importlib.util
import marshal
import os
import pwd
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from coda_lang.backend_cute.build import store
from coda_lang.backend_cute.build.cache import complete_ptx
from coda_lang.backend_cute.plan.emit import module_name

ROOT = Path(__file__).resolve().parent.parent
LEGIT = "VALUE = 'legit'\n"


def _nobody() -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        return None


NOBODY = _nobody()
two_users = pytest.mark.skipif(
    os.geteuid() != 0 or NOBODY is None or NOBODY.pw_uid == 0,
    reason="needs root and a `nobody` user (a second user, made by os.setuid)",
)


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """A process whose default cache is under tmp_path (a fallback never lands in ~/.cache), with the
    store's memory of checked folders cleared."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("CODA_CACHE_DIR", raising=False)
    store._checked.cache_clear()
    store._fallback.cache_clear()
    store._WARNED.clear()
    yield
    store._checked.cache_clear()
    store._fallback.cache_clear()
    store._WARNED.clear()


def plant_pyc(py: Path, code: str) -> Path:
    """A bytecode file for `py` holding `code`, its header matching `py` (mtime and size), where an
    import through sys.path would find it."""
    st = py.stat()
    header = importlib.util.MAGIC_NUMBER + struct.pack(
        "<III", 0, int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF
    )
    pyc = Path(importlib.util.cache_from_source(str(py)))
    pyc.parent.mkdir(exist_ok=True)
    pyc.write_bytes(header + marshal.dumps(compile(code, str(py), "exec")))
    return pyc


def evil(marker: Path) -> str:
    return f"VALUE = 'evil'\nopen({str(marker)!r}, 'w').write('ran')\n"


# ------------------------------------------------------------------------------------------------
# whose cache


def test_a_cache_others_can_write_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    for mode in (0o777, 0o775, 0o757):
        shared.chmod(mode)
        store._checked.cache_clear()
        store._WARNED.clear()
        monkeypatch.setenv("CODA_CACHE_DIR", str(shared))
        got = store.cache_dir()
        err = capsys.readouterr().err
        assert got != shared and got == store.default_dir(), mode
        assert f"coda: warning: not using the kernel cache {shared}: its group or others can write it" in err
        assert os.environ["CODA_CACHE_DIR"] == str(got)  # (what worker processes will use)
        assert (got.stat().st_mode & 0o777) == 0o700
        with pytest.raises(store.UnsafeCache, match="its group or others can write it"):
            store.write_source(LEGIT, shared)  # given explicitly: refused
    # a folder inside a private cache that others can write (left from before) is refused too
    private = tmp_path / "private"
    (private / "epilogues").mkdir(parents=True)
    private.chmod(0o700)
    (private / "epilogues").chmod(0o777)
    with pytest.raises(store.UnsafeCache, match="not a private folder of yours"):
        store.write_source(LEGIT, private)
    # inside a folder others can write, without the sticky bit: refused; with it (as /tmp): fine
    outer = tmp_path / "outer"
    (outer / "cache").mkdir(parents=True, mode=0o700)
    outer.chmod(0o777)
    with pytest.raises(store.UnsafeCache, match=f"it is inside {outer}, which its group or others"):
        store.trusted(outer / "cache")
    outer.chmod(0o1777)
    assert store.trusted(outer / "cache") == outer / "cache"


def test_the_default_cache_is_made_private(tmp_path: Path) -> None:
    got = store.cache_dir()
    assert got == tmp_path / "home" / ".cache" / "coda_lang" / "kernels"
    assert (got.stat().st_mode & 0o777) == 0o700


def _as_nobody(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`code` run as `nobody`: a Python process of this user imports what it needs, then os.setuid
    (nobody may not be able to read this interpreter's own files)."""
    assert NOBODY is not None
    prelude = (
        "import os, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from pathlib import Path\n"
        "import coda_lang.backend_cute.build.store as store\n"
        "from tests.test_cache_security import plant_pyc, evil, LEGIT\n"
        "os.setgroups([])\n"
        f"os.setgid({NOBODY.pw_gid})\n"
        f"os.setuid({NOBODY.pw_uid})\n"
    )
    return _python(prelude + code, **env)


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1", **env}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full, cwd="/", timeout=120
    )


@pytest.fixture
def place() -> Iterator[Path]:
    """A folder both users can reach, sticky and writable by all (as /tmp), removed afterwards."""
    p = Path(tempfile.mkdtemp(prefix="coda-two-users-", dir="/tmp"))
    p.chmod(0o1777)
    yield p
    shutil.rmtree(p, ignore_errors=True)


@two_users
def test_a_cache_another_user_made_is_not_used(place: Path) -> None:
    """`nobody` makes a cache (writable only by itself, so mode alone would pass), writes the
    legitimate module into it and plants bytecode beside it; root, pointed at that cache, uses a private
    one instead and never runs the plant. And root's own cache is not used by `nobody`."""
    theirs, marker = place / "theirs", place / "marker"
    r = _as_nobody(
        f"d = Path({str(theirs)!r}); (d / 'epilogues').mkdir(parents=True)\n"
        f"py = d / 'epilogues' / '{module_name(LEGIT)}.py'; py.write_text(LEGIT)\n"
        f"plant_pyc(py, evil(Path({str(marker)!r})))\n"
    )
    assert r.returncode == 0, r.stderr
    assert theirs.stat().st_uid == NOBODY.pw_uid  # type: ignore[union-attr]
    load = (
        "import sys; sys.path.insert(0, '.')\n"
        "from coda_lang.backend_cute.build import store\n"
        "print(store.load_module(store.write_source(LEGIT)).VALUE)\n"
    )
    r = _python(f"LEGIT = {LEGIT!r}\n" + load, CODA_CACHE_DIR=str(theirs), HOME=str(place / "root-home"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "legit" and not marker.exists()
    assert (
        f"not using the kernel cache {theirs}: it is owned by nobody (uid {NOBODY.pw_uid}), not by you"
        in (  # type: ignore[union-attr]
            r.stderr
        )
    )
    # root's cache, as nobody: not used either
    ours = place / "ours"
    ours.mkdir(mode=0o755)
    (place / "nobody-home").mkdir()
    os.chown(place / "nobody-home", NOBODY.pw_uid, NOBODY.pw_gid)  # type: ignore[union-attr]
    r = _as_nobody("print(store.cache_dir())\n", CODA_CACHE_DIR=str(ours), HOME=str(place / "nobody-home"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(place / "nobody-home" / ".cache" / "coda_lang" / "kernels")
    assert f"not using the kernel cache {ours}: it is owned by root (uid 0), not by you" in r.stderr


# ------------------------------------------------------------------------------------------------
# what is loaded


def test_planted_bytecode_is_never_read(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = store.write_source(LEGIT, cache)
    marker = tmp_path / "marker"
    plant_pyc(path, evil(marker))
    sys.modules.pop(path.stem, None)
    try:
        assert store.load_module(path).VALUE == "legit"
    finally:
        sys.modules.pop(path.stem, None)
    assert not marker.exists()


def test_no_bytecode_is_written_and_a_changed_module_is_refused(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    path = store.write_source(LEGIT + "X = 1\n", cache)
    sys.modules.pop(path.stem, None)
    try:
        assert store.load_module(path).X == 1
        assert not (path.parent / "__pycache__").exists()
    finally:
        sys.modules.pop(path.stem, None)
    path.write_text(LEGIT + "X = 2\n")  # another text under the same name
    with pytest.raises(store.UnsafeCache, match="does not hold the text its name is the hash of"):
        store.load_module(path)
    assert path.stem not in sys.modules
    assert store.write_source(LEGIT + "X = 1\n", cache).read_text() == LEGIT + "X = 1\n"  # rewritten


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_load_epilogue_never_reads_planted_bytecode(tmp_path: Path) -> None:
    """What `coda compile` and the runtime load a stage's epilogue through."""
    try:
        from coda_lang.backend_cute.build import quack_adapter
    except ImportError:
        pytest.skip("needs nvidia-cutlass-dsl and quack-kernels")
    text = LEGIT + "# load_epilogue\n"
    path = store.write_source(text, tmp_path / "cache")
    marker = tmp_path / "marker"
    plant_pyc(path, evil(marker))
    sys.modules.pop(path.stem, None)
    try:
        assert quack_adapter.load_epilogue(path, "VALUE") == "legit"
    finally:
        sys.modules.pop(path.stem, None)
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------
# how files are written


def test_planted_symlinks_are_never_followed(tmp_path: Path) -> None:
    """Symlinks at every name an older coda_lang wrote its temporary files under (`.<name>.<pid>.tmp`,
    for this process and its neighbours) and at an entry's lock file: the victim is never written."""
    cache = store.trusted(tmp_path / "cache")
    victim = tmp_path / "victim"
    victim.write_text("mine")
    folder = store.subfolder(cache, "epilogues")
    target = folder / f"{module_name(LEGIT)}.py"
    ptx = store.subfolder(cache, "ptx") / "k.ptx"
    for p in (target, ptx):
        for pid in range(max(1, os.getpid() - 50), os.getpid() + 50):
            (p.parent / f".{p.name}.{pid}.tmp").symlink_to(victim)
    store.write_source(LEGIT, cache)
    store.write_atomic(ptx, "ptx")
    with store.staged(ptx, "again") as tmp:
        assert tmp.read_text() == "again"
    assert victim.read_text() == "mine"
    assert target.read_text() == LEGIT and ptx.read_text() == "ptx"
    lock = ptx.with_suffix(".lock")
    lock.symlink_to(victim)
    with pytest.raises(OSError), store.entry_lock(lock):
        pass
    assert victim.read_text() == "mine"


PTX = """//
// Generated by NVIDIA NVVM Compiler
//

.version 8.8
.target sm_90a
.address_size 64

.visible .entry k(
\t.param .u64 k_param_0
)
{
\t.reg .b32 %r<3>;
\tmov.u32 %r1, 0; // a comment with a brace }
$L__BB0_1:
\t{
\tret;
\t}

}
"""


def test_a_ptx_cut_short_anywhere_is_not_complete() -> None:
    assert complete_ptx(PTX)
    assert not [n for n in range(len(PTX)) if complete_ptx(PTX[:n])]
    assert not complete_ptx(PTX.replace(".visible .entry", ".func"))  # no kernel in it


# ------------------------------------------------------------------------------------------------
# the commands


@pytest.mark.parametrize("where", ["a file", "under /proc"])
def test_coda_tune_with_a_cache_it_cant_write_exits_2(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("torch")
    from coda_lang.cli import main

    if where == "a file":
        bad = tmp_path / "file"
        bad.write_text("")
    else:
        bad = Path("/proc/coda-no-such-folder")
    monkeypatch.setenv("CODA_CACHE_DIR", str(bad))
    code = main(["tune", str(ROOT / "examples" / "bias_gelu.coda"), "--dims", "M=64,K=64,N=64", "-q"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"coda: error: can't write {bad}") and err.count("\n") == 1, err


@pytest.mark.toolchain
def test_cutedsls_own_file_cache_is_inside_the_kernel_cache(tmp_path: Path) -> None:
    """CuTeDSL keeps compiled IR, which it loads and runs, in /tmp/<user>/cutlass_python_cache unless
    told otherwise (a folder another user can make first): coda points it inside its kernel cache, and
    a $CUTE_DSL_CACHE_DIR others can write is refused as the kernel cache would be."""
    code = (
        "import os\n"
        "from coda_lang.backend_cute.build import quack_adapter\n"
        "from cutlass.base_dsl.cache_helpers import get_default_generated_ir_path\n"
        "print(get_default_generated_ir_path())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_CACHE_DIR"}
    env.update(CODA_CACHE_DIR=str(tmp_path / "cache"), HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == str(tmp_path / "cache" / "cute_dsl")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    env["CUTE_DSL_CACHE_DIR"] = str(shared)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode != 0 and "its group or others can write it" in run.stderr
