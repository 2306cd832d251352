"""The kernel cache: keys, entries, atomic writes and locks, and the ptxas reports kept beside the PTX.

The cache (`$CODA_CACHE_DIR`, default ~/.cache/coda_lang/kernels) holds per stage and tile the PTX
(`ptx/<stage>-<tile>-<key>.ptx`), its record (`.json`: the PTX's hash and compile time), the ptxas
report (`.ptxas-<ptxas>.json`, keyed by the ptxas version and arch), or, for a tile quack refused, a
refusal record (`.refused.json`); quack's own object files of the same kernels (`quack/`, loaded by
the runtime instead of compiling again). The key is the emitted source, the emitter version, this
backend's kernel fingerprint (coda_lang's version and the modules that shape a kernel: plan/epi_ops.py,
plan/block_scaled.py, plan/gated_store.py, build/quack_adapter.py), the versions of nvidia-cutlass-dsl and quack-kernels, the arch and the tile
config, never M, N, K: a cache written by another version is never read, and no entry holds an
absolute path, so the folder can be copied to another machine with the same versions.

What it does: `Kernel` (one stage at one tile: its source, key and entry paths; what the cache knows
of it), `ptx_key`, `kernel_fingerprint`, `complete_ptx` (whether a PTX text is whole), and the ptxas
records (`read_ptxas_record`, `cached_ptxas`, `forget`). Where the cache is and whether it can be
trusted, and how its files are written, locked (`entry_lock`; not waiting: `EntryBusy`) and loaded:
store.py.
What it does not: compile (compile.py) or run a kernel.
Invariants: the cache only ever holds complete files (written to a temporary file, then renamed); a
PTX enters it only once ptxas accepted it (compile.py); a damaged or stale entry (truncated PTX, a
missing or unreadable record) reads as missing, so it is rebuilt; one process at a time builds an
entry (a lock file per entry).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import re
from dataclasses import asdict
from pathlib import Path

from coda_lang.backend_cute.build.config import TileConfig
from coda_lang.backend_cute.build.ptxas import (
    ARCH,
    BackendUnavailable,
    PtxasReport,
    ptxas_executable,
    ptxas_version,
    run_ptxas,
)
from coda_lang.backend_cute.build.store import cache_dir, checked, write_atomic
from coda_lang.backend_cute.plan.emit import EMITTER_VERSION, emit_stage, source_hash
from coda_lang.backend_cute.plan.spec import StageSpec
from coda_lang.core import VERSION
from coda_lang.core.diagnostics import CodaError, error


@functools.cache
def library_versions() -> dict[str, str]:
    """The versions of the libraries a kernel is compiled with (part of every cache key)."""
    out = {}
    for dist in ("nvidia-cutlass-dsl", "quack-kernels"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "missing"
    return out


# The modules of this backend whose text shapes a compiled kernel beyond the emitted source: the
# epilogue ops the emitted module imports (the block-scaled mainloop and the gated fp8 store among
# them), and how quack is asked to compile.
KERNEL_MODULES = ("plan/epi_ops.py", "plan/block_scaled.py", "plan/gated_store.py", "build/quack_adapter.py")


@functools.cache
def kernel_fingerprint() -> str:
    """coda_lang's version and the text of KERNEL_MODULES, hashed: part of every cache key, so that a
    cache written by another coda_lang is never read."""
    h = hashlib.sha256(f"coda_lang {VERSION}\n".encode())
    for name in KERNEL_MODULES:
        h.update(name.encode() + b"\n" + (Path(__file__).parent.parent / name).read_bytes())
    return h.hexdigest()[:16]


def ptx_key(source: str, config: TileConfig) -> str:
    # (a field at its default that older keys lack is left out: their cache entries stay valid)
    conf = {k: v for k, v in asdict(config).items() if k not in ("epi_n", "fast_accum") or v}
    key = {
        "source": source_hash(source),
        "emitter": EMITTER_VERSION,
        "coda": kernel_fingerprint(),
        "arch": ARCH,
        "config": conf,
        "libraries": library_versions(),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


_HEADER = re.compile(r"^\s*\.version\s+\d+\.\d+\s*$.*^\s*\.target\s+\S+", re.M | re.S)
_ENTRY = re.compile(r"^\s*(?:\.(?:visible|weak)\s+)?\.entry\s", re.M)


def complete_ptx(text: str) -> bool:
    """Whether `text` is a whole PTX module, as far as can be told without ptxas: its header
    (`.version`, `.target`), a kernel entry, balanced braces, and a last line that closes the last
    function (a PTX cut short by a full disk or a file-size limit fails this)."""
    if not _HEADER.search(text) or not _ENTRY.search(text):
        return False
    body = re.sub(r"//[^\n]*", "", text)  # (comments may hold braces)
    if body.count("{") != body.count("}") or body.count("{") == 0:
        return False
    return body.rstrip().endswith("}") and text.endswith("\n")


def cached_compile_s(ptx_path: Path, meta_path: Path) -> float | None:
    """The compile time recorded for a cached PTX, or None when the entry is missing, unreadable, not
    JSON, its PTX is not the one recorded (truncated, edited, or written by an older coda_lang), or not
    a whole PTX module (one an older coda_lang recorded cut short): then the stage is compiled again and
    the entry rewritten."""
    try:
        meta = json.loads(meta_path.read_text())
        data = ptx_path.read_bytes()
        if meta.get("sha256") != hashlib.sha256(data).hexdigest() or not complete_ptx(data.decode()):
            return None
        return float(meta["compile_s"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


class Kernel:
    """One stage at one tile config: its emitted source, cache key and the paths of its entry."""

    def __init__(
        self, spec: StageSpec, config: TileConfig, directory: Path | None = None, source: str | None = None
    ):
        self.spec, self.config = spec, config
        self.root = checked(directory) if directory is not None else cache_dir()
        self.source = source if source is not None else emit_stage(spec)
        self.key = ptx_key(self.source, config)
        self.ptx_path = self.root / "ptx" / f"{spec.fn_name}-{config.short}-{self.key[:20]}.ptx"

    @property
    def meta_path(self) -> Path:
        return self.ptx_path.with_suffix(".json")

    @property
    def refused_path(self) -> Path:
        return self.ptx_path.with_suffix(".refused.json")

    @property
    def lock_path(self) -> Path:
        return self.ptx_path.with_suffix(".lock")

    def refusal(self) -> str | None:
        """The error quack gave for this kernel, when a valid refusal record says it refused it."""
        try:
            data = json.loads(self.refused_path.read_text())
            if data.get("key") == self.key and isinstance(data.get("error"), str):
                return str(data["error"])
        except (OSError, ValueError, AttributeError):
            pass
        return None

    def status(self) -> str | None:
        """What the cache knows without compiling or running ptxas: "ok" (no spills), "spills",
        "refused", or None (not compiled yet, damaged, or its ptxas report is missing)."""
        if cached_compile_s(self.ptx_path, self.meta_path) is not None:
            report = read_ptxas_record(self.ptx_path)
            return None if report is None else ("spills" if report.spills else "ok")
        return "refused" if self.refusal() is not None else None

    def refused_error(self, error_text: str, src_path: Path) -> CodaError:
        spec, config = self.spec, self.config
        return error(
            "E0707",
            f"the CuTeDSL compiler rejected stage {spec.index} (`{spec.text}`) at tile {config}",
            spec.span,
            notes=[
                error_text,
                f"the emitted epilogue is {src_path}",
                "this is a limit of quack or a bug in coda_lang's emitter; please report it",
            ],
        )


def _record_path(ptx_path: Path, arch: str) -> Path:
    """The ptxas report's record beside a PTX file, named by the ptxas version and the arch (not by the
    executable's path: a cache copied to another machine with the same ptxas is still warm)."""
    ident = f"{ptxas_version(ptxas_executable())}\n{arch}"
    return ptx_path.with_suffix(f".ptxas-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json")


def read_ptxas_record(ptx_path: Path, arch: str = ARCH, staged: Path | None = None) -> PtxasReport | None:
    """The kept ptxas report of a PTX file (`staged`: the PTX of entry `ptx_path` not yet in the
    cache), or None when it is missing, damaged, or made from other PTX (or when there is no ptxas to
    name it by)."""
    try:
        record = _record_path(ptx_path, arch)
        data = json.loads(record.read_text())
        if data.pop("ptx_sha256") == hashlib.sha256((staged or ptx_path).read_bytes()).hexdigest():
            return PtxasReport(**data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, BackendUnavailable):
        pass
    return None


def cached_ptxas(ptx_path: Path, arch: str = ARCH, staged: Path | None = None) -> PtxasReport:
    """`run_ptxas`'s report, kept beside the PTX: a record keyed by the ptxas version and the arch,
    holding the hash of the PTX it was made from. A warm compile reads it instead of running ptxas
    again; any mismatch or damage runs ptxas and rewrites it. `staged`: the file holding entry
    `ptx_path`'s new PTX, checked before it is put in the cache (RuntimeError when ptxas refuses it)."""
    report = read_ptxas_record(ptx_path, arch, staged)
    if report is not None:
        return report
    report = run_ptxas(staged or ptx_path, arch)
    digest = hashlib.sha256((staged or ptx_path).read_bytes()).hexdigest()
    write_atomic(_record_path(ptx_path, arch), json.dumps({**asdict(report), "ptx_sha256": digest}))
    return report


def forget(k: Kernel) -> None:
    """Remove kernel `k`'s entry (its PTX, record and ptxas reports): one found bad, to be rebuilt."""
    for p in [k.meta_path, k.ptx_path, *k.ptx_path.parent.glob(k.ptx_path.stem + ".ptxas-*.json")]:
        p.unlink(missing_ok=True)
