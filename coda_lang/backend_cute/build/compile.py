"""Compile a stage to PTX for sm_90a (no GPU needed), check it with ptxas, choose its tile.

What it does: `TileConfig` (quack's SM90 default: 128x192 pingpong, cluster 2x1); `compile_spec`
plans and emits a stage, compiles it through quack_adapter (or takes the PTX from the cache) and runs
`ptxas -v` on it (or reads the report kept beside the PTX); `select_config` tries tile configs in order
and keeps the first whose ptxas report shows no register spills (DESIGN.md section 6: heavy epilogues
spill at 128x192); `configs_without_spills` gives every candidate of `TUNE_CANDIDATES` that passes that
check, for the runtime to time on a GPU (cuda_block.py, tune.py). Both take `jobs=`: the kernels they
will read are first compiled in worker processes (parallel.py).
The kernel cache (`$CODA_CACHE_DIR`, default ~/.cache/coda_lang/kernels): per stage and tile, the PTX
(`ptx/<stage>-<tile>-<key>.ptx`), its record (`.json`: the PTX's hash and compile time), the ptxas
report (`.ptxas-<ptxas>.json`, keyed by the ptxas version and arch), or, for a tile quack refused, a
refusal record (`.refused.json`); quack's own object files of the same kernels (`quack/`, loaded by
the runtime instead of compiling again). The key is the emitted source, the emitter version, this
backend's kernel fingerprint (coda_lang's version and the modules that shape a kernel: epi_ops.py,
quack_adapter.py), the versions of nvidia-cutlass-dsl and quack-kernels, the arch and the tile config,
never M, N, K: a cache written by another version is never read, and no entry holds an absolute path,
so the folder can be copied to another machine with the same versions.
What it does not: plan or emit (plan.py, emit.py), or touch quack (quack_adapter.py, imported only
when a kernel really has to be compiled).
Invariants: a program the backend can't compile raises CodaError (E07); a missing toolchain raises
`BackendUnavailable`; the cache only ever holds complete files (written to a temporary file, then
renamed); a damaged or stale entry (truncated PTX, a missing or unreadable record) is rebuilt; one
process at a time compiles a kernel (a lock file per entry), so processes filling one cache at once
each get the same result and compile each kernel once.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import math
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from coda_lang.backend_cute.plan.emit import EMITTER_VERSION, cache_dir, emit_stage, source_hash, write_source
from coda_lang.backend_cute.plan.planner import plan_stage
from coda_lang.backend_cute.plan.spec import StageSpec
from coda_lang.core import VERSION
from coda_lang.core.diagnostics import CodaError, Diagnostic

ARCH = "sm_90a"


class BackendUnavailable(Exception):
    """The CuTeDSL toolchain (nvidia-cutlass-dsl, quack-kernels, ptxas) can't be used here."""


@dataclass(frozen=True)
class TileConfig:
    tile_m: int = 128
    tile_n: int = 192
    cluster_m: int = 2
    cluster_n: int = 1
    pingpong: bool = True
    # The N extent of the epilogue's subtile (the columns each pass over the accumulator handles):
    # 0 is quack's choice (32 for 16-bit outputs); 16 halves the registers the epilogue holds at once,
    # which keeps heavy epilogues (two tile loads and a sink) spill-free at 128x192.
    epi_n: int = 0

    def __str__(self) -> str:
        if self.is_cublas:
            return "cuBLAS (torch.matmul)"
        kind = "pingpong" if self.pingpong else "cooperative"
        epi = f", epilogue subtile N {self.epi_n}" if self.epi_n else ""
        return f"{self.tile_m}x{self.tile_n} {kind}, cluster {self.cluster_m}x{self.cluster_n}{epi}"

    @property
    def short(self) -> str:
        if self.is_cublas:
            return "cublas"
        return f"{self.tile_m}x{self.tile_n}" + (f"e{self.epi_n}" if self.epi_n else "")

    @property
    def is_cublas(self) -> bool:
        """The stand-in config of a plain GEMM stage run by cuBLAS (see `CUBLAS`)."""
        return self.tile_m == 0


# A stage whose epilogue only stores the accumulator in the operands' dtype (a wgrad or dgrad GEMM
# with nothing fused) is a bare GEMM: the tuner also times it on cuBLAS and takes that when faster.
CUBLAS = TileConfig(0, 0, 1, 1, False)


def is_plain(spec: StageSpec) -> bool:
    """Whether the stage's kernel would be a bare GEMM: D = acc in the operands' dtype, nothing else."""
    return spec.plain


DEFAULT_CONFIG = TileConfig()
# Tried in order by select_config: quack's default, the same tile with a narrower epilogue subtile,
# then narrower tiles (fewer accumulator registers per thread, so more room for the epilogue; quack's
# subtile of 128x176 is 16 columns wide by itself).
CANDIDATES = (
    TileConfig(128, 192),
    TileConfig(128, 192, epi_n=16),
    TileConfig(128, 176),
    TileConfig(128, 128),
    TileConfig(128, 96),
    TileConfig(128, 64),
)


@dataclass(frozen=True)
class PtxasReport:
    registers: int
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack_frame: int  # bytes
    ptxas: str  # the ptxas version line
    text: str

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    def __str__(self) -> str:
        return (
            f"{self.registers} registers, {self.spill_stores} bytes spill stores, "
            f"{self.spill_loads} bytes spill loads ({self.ptxas})"
        )


@dataclass
class CompiledStage:
    spec: StageSpec
    source: str
    source_path: Path
    config: TileConfig
    ptx_path: Path
    compile_s: float  # seconds CuTeDSL took (when the PTX was compiled, not cached)
    cached: bool
    report: PtxasReport | None = None
    rejected: tuple[str, ...] = ()  # select_config: the tiles tried first, and why they were not kept

    @property
    def ptx(self) -> str:
        return self.ptx_path.read_text()

    @property
    def setmaxnreg(self) -> tuple[int, ...]:
        """Per-warpgroup register counts the kernel sets (warp-specialized: the producer gives registers
        back, the consumer (MMA + epilogue) warpgroups take them); ptxas's "Used N registers" is the
        launch-time count of all 384 threads."""
        return tuple(
            int(n) for n in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)", self.ptx)
        )


def ptxas_executable() -> str:
    """$CODA_PTXAS, else `ptxas` on PATH (CuTeDSL 4.8.1 embeds the ptxas of CUDA 12.9 for the cubin it
    builds; the CUDA 13 ptxas of the toolkit reports more spills on the same PTX, so it is the stricter
    check)."""
    exe = os.environ.get("CODA_PTXAS") or shutil.which("ptxas")
    if not exe or not os.access(exe, os.X_OK):
        raise BackendUnavailable(
            f"ptxas not found{f' at {exe}' if exe else ''} (install the CUDA toolkit, or set CODA_PTXAS)"
        )
    return exe


_RE_REGS = re.compile(r"Used (\d+) registers")
_RE_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def parse_ptxas(text: str, version: str = "ptxas") -> PtxasReport:
    """Registers and spills of the (largest) kernel in `ptxas -v` output."""
    regs = [int(x) for x in _RE_REGS.findall(text)]
    spills = [tuple(int(y) for y in x) for x in _RE_SPILLS.findall(text)]
    if not regs or not spills:
        raise ValueError(f"no register/spill report in ptxas output:\n{text[-2000:]}")
    stack, stores, loads = max(spills, key=lambda s: (s[1] + s[2], s[0]))
    return PtxasReport(max(regs), stores, loads, stack, version, text)


def run_ptxas(ptx_path: Path, arch: str = ARCH) -> PtxasReport:
    """`ptxas -v -arch=sm_90a` on a PTX file (the object is discarded)."""
    exe = ptxas_executable()
    version = ptxas_version(exe).splitlines()
    r = subprocess.run(
        [exe, "-v", f"-arch={arch}", str(ptx_path), "-o", os.devnull],
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = r.stdout + r.stderr
    m = re.search(r"Unsupported \.version (\d+\.\d+); current version is '(\d+\.\d+)'", out)
    if r.returncode != 0 and m:
        # The PTX comes from a newer NVVM than this ptxas (CuTeDSL assembles it with its own embedded
        # ptxas); for the register and spill report, the older ptxas reads it at its own ISA version.
        text = Path(ptx_path).read_text().replace(f".version {m.group(1)}", f".version {m.group(2)}", 1)
        older = Path(ptx_path).with_suffix(f".{os.getpid()}.ptx{m.group(2)}.tmp")
        older.write_text(text)
        try:
            r = subprocess.run(
                [exe, "-v", f"-arch={arch}", str(older), "-o", os.devnull],
                capture_output=True,
                text=True,
                timeout=600,
            )
        finally:
            older.unlink(missing_ok=True)
        out = r.stdout + r.stderr
    if r.returncode != 0:
        raise RuntimeError(f"ptxas failed on {ptx_path}:\n{out[-3000:]}")
    line = next(
        (v for v in reversed(version) if v.startswith("Cuda compilation tools")),
        version[-1] if version else "",
    )
    return parse_ptxas(
        out, f"ptxas {line.split('release ')[-1].split(',')[0]}" if "release" in line else "ptxas"
    )


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
# epilogue ops the emitted module imports, and how quack is asked to compile.
KERNEL_MODULES = ("plan/epi_ops.py", "build/quack_adapter.py")


@functools.cache
def kernel_fingerprint() -> str:
    """coda_lang's version and the text of KERNEL_MODULES, hashed: part of every cache key, so that a
    cache written by another coda_lang is never read."""
    h = hashlib.sha256(f"coda_lang {VERSION}\n".encode())
    for name in KERNEL_MODULES:
        h.update(name.encode() + b"\n" + (Path(__file__).parent.parent / name).read_bytes())
    return h.hexdigest()[:16]


def ptx_key(source: str, config: TileConfig) -> str:
    conf = {k: v for k, v in asdict(config).items() if k != "epi_n" or v}
    key = {
        "source": source_hash(source),
        "emitter": EMITTER_VERSION,
        "coda": kernel_fingerprint(),
        "arch": ARCH,
        "config": conf,
        "libraries": library_versions(),
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _adapter() -> Any:
    try:
        from coda_lang.backend_cute.build import quack_adapter
    except ImportError as e:
        raise BackendUnavailable(
            f"the CuTeDSL backend needs nvidia-cutlass-dsl and quack-kernels: {e}"
        ) from None
    return quack_adapter


def _cached_compile(ptx_path: Path, meta_path: Path) -> float | None:
    """The compile time recorded for a cached PTX, or None when the entry is missing, unreadable, not
    JSON, or its PTX is not the one recorded (truncated, edited, or written by an older coda_lang):
    then the stage is compiled again and the entry rewritten."""
    try:
        meta = json.loads(meta_path.read_text())
        if meta.get("sha256") != hashlib.sha256(ptx_path.read_bytes()).hexdigest():
            return None
        return float(meta["compile_s"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_atomic(path: Path, text: str) -> None:
    """`text` into `path` whole: written to a temporary file of this process beside it, then renamed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def entry_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on one cache entry (`path`: its lock file), held while it is built: a second
    process asking for the same kernel waits, then finds it in the cache."""
    try:
        import fcntl
    except ImportError:  # (not POSIX: no locking; writes are still atomic)
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (closing releases the lock)


class Kernel:
    """One stage at one tile config: its emitted source, cache key and the paths of its entry."""

    def __init__(
        self, spec: StageSpec, config: TileConfig, directory: Path | None = None, source: str | None = None
    ):
        self.spec, self.config = spec, config
        self.root = directory or cache_dir()
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
        if _cached_compile(self.ptx_path, self.meta_path) is not None:
            report = read_ptxas_record(self.ptx_path)
            return None if report is None else ("spills" if report.spills else "ok")
        return "refused" if self.refusal() is not None else None

    def cached(self, src_path: Path) -> CompiledStage | None:
        seconds = _cached_compile(self.ptx_path, self.meta_path)
        if seconds is None:
            return None
        return CompiledStage(self.spec, self.source, src_path, self.config, self.ptx_path, seconds, True)

    def refused_error(self, error: str, src_path: Path) -> CodaError:
        spec, config = self.spec, self.config
        return CodaError(
            [
                Diagnostic(
                    "E0707",
                    f"the CuTeDSL compiler rejected stage {spec.index} (`{spec.text}`) at tile {config}",
                    spec.span,
                    notes=[
                        error,
                        f"the emitted epilogue is {src_path}",
                        "this is a limit of quack or a bug in coda_lang's emitter; please report it",
                    ],
                )
            ]
        )

    def build(self, src_path: Path) -> CompiledStage:
        """Compile the kernel (holding the entry's lock), record its PTX, or its refusal (E0707)."""
        adapter = _adapter()
        try:
            text, seconds = adapter.compile_ptx(self.spec, src_path, self.config, self.root)
        except (MemoryError, OSError):  # not the kernel's fault: nothing recorded
            raise
        except Exception as e:  # quack or CuTeDSL refused the kernel: say where its source is
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            error = f"{type(e).__name__}: {first}"
            write_atomic(self.refused_path, json.dumps({"key": self.key, "error": error}))
            raise self.refused_error(error, src_path) from e
        write_atomic(self.ptx_path, text)
        meta = {
            "compile_s": seconds,
            "config": asdict(self.config),
            "source": src_path.name,
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
        }
        write_atomic(self.meta_path, json.dumps(meta))  # last: the entry counts once it names the hash
        self.refused_path.unlink(missing_ok=True)
        return CompiledStage(self.spec, self.source, src_path, self.config, self.ptx_path, seconds, False)


def compile_spec(
    spec: StageSpec, config: TileConfig = DEFAULT_CONFIG, *, ptxas: bool = True, directory: Path | None = None
) -> CompiledStage:
    """Emit, compile (or reuse the cached PTX) and check one planned stage. A tile quack refused once
    is refused again from its record (E0707), not compiled again."""
    k = Kernel(spec, config, directory)
    src_path = write_source(k.source, k.root)
    k.ptx_path.parent.mkdir(parents=True, exist_ok=True)
    out = k.cached(src_path)
    if out is None or (ptxas and read_ptxas_record(k.ptx_path) is None):
        with entry_lock(k.lock_path):  # another process may be building it: wait, then look again
            out = k.cached(src_path)
            if out is None:
                error = k.refusal()
                if error is not None:
                    raise k.refused_error(error, src_path)
                out = k.build(src_path)
            if ptxas:
                out.report = cached_ptxas(k.ptx_path)
    elif ptxas:
        out.report = read_ptxas_record(k.ptx_path)
    return out


@functools.cache
def _ptxas_identity(exe: str, size: int, mtime: int) -> str:
    """The `--version` text of a ptxas executable (asked once per process and executable file)."""
    return subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()


def ptxas_version(exe: str) -> str:
    st = os.stat(exe)
    return _ptxas_identity(exe, st.st_size, int(st.st_mtime))


def _record_path(ptx_path: Path, arch: str) -> Path:
    """The ptxas report's record beside a PTX file, named by the ptxas version and the arch (not by the
    executable's path: a cache copied to another machine with the same ptxas is still warm)."""
    ident = f"{ptxas_version(ptxas_executable())}\n{arch}"
    return ptx_path.with_suffix(f".ptxas-{hashlib.sha256(ident.encode()).hexdigest()[:16]}.json")


def read_ptxas_record(ptx_path: Path, arch: str = ARCH) -> PtxasReport | None:
    """The kept ptxas report of a PTX file, or None when it is missing, damaged, or made from other
    PTX (or when there is no ptxas to name it by)."""
    try:
        record = _record_path(ptx_path, arch)
        data = json.loads(record.read_text())
        if data.pop("ptx_sha256") == hashlib.sha256(ptx_path.read_bytes()).hexdigest():
            return PtxasReport(**data)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, BackendUnavailable):
        pass
    return None


def cached_ptxas(ptx_path: Path, arch: str = ARCH) -> PtxasReport:
    """`run_ptxas`'s report, kept beside the PTX: a record keyed by the ptxas version and the arch,
    holding the hash of the PTX it was made from. A warm compile reads it instead of running ptxas
    again; any mismatch or damage runs ptxas and rewrites it."""
    report = read_ptxas_record(ptx_path, arch)
    if report is not None:
        return report
    report = run_ptxas(ptx_path, arch)
    digest = hashlib.sha256(ptx_path.read_bytes()).hexdigest()
    write_atomic(_record_path(ptx_path, arch), json.dumps({**asdict(report), "ptx_sha256": digest}))
    return report


def compile_stage(
    block: Any,
    index: int,
    config: TileConfig = DEFAULT_CONFIG,
    *,
    ptxas: bool = True,
    directory: Path | None = None,
) -> CompiledStage:
    """Stage `index` (1-based) of a checked `coda_lang.api.Block`, compiled at tile `config`."""
    return compile_spec(plan_stage(block, index), config, ptxas=ptxas, directory=directory)


def select_config(
    block: Any,
    index: int,
    candidates: tuple[TileConfig, ...] = CANDIDATES,
    *,
    directory: Path | None = None,
    jobs: int | None = 1,
) -> CompiledStage:
    """The first candidate tile whose kernel compiles and has no register spills (CodaError E0706 if
    none; E0707 if quack refused every candidate). `jobs`: worker processes for the kernels not in the
    cache yet (None: parallel.default_jobs; 1: compile them here, one after another)."""
    spec = plan_stage(block, index)
    if jobs != 1:
        from coda_lang.backend_cute.build import parallel

        parallel.warm([parallel.Request(spec, candidates, first=True)], jobs=jobs, directory=directory)
    tried: list[str] = []
    refused: list[CodaError] = []
    for config in candidates:
        if not fits(spec, config):
            continue
        try:
            c = compile_spec(spec, config, directory=directory)
        except CodaError as e:  # quack refuses this tile for this epilogue (E0707): try the next
            refused.append(e)
            tried.append(f"{config}: {e.diagnostics[0].notes[0] if e.diagnostics[0].notes else 'refused'}")
            continue
        assert c.report is not None
        if not c.report.spills:
            c.rejected = tuple(tried)
            return c
        tried.append(f"{config}: {c.report}")
    if refused and len(refused) == len(tried):
        raise refused[0]
    raise CodaError(
        [
            Diagnostic(
                "E0706",
                f"stage {index} (`{spec.text}`) spills registers at every tile configuration tried",
                spec.span,
                notes=tried or ["no candidate tile satisfies the stage's tiling constraints"],
                help=["split the epilogue across stages, or store fewer values from this stage"],
            )
        ]
    )


# What the runtime measures on a GPU (quack's SM90 space: pingpong 128xN, cooperative 256xN, clusters
# 2x1 and 1x2), after the ptxas check has dropped the configs that spill.
TUNE_CANDIDATES = (
    TileConfig(128, 192),
    TileConfig(128, 192, epi_n=16),
    TileConfig(128, 176),
    TileConfig(128, 160),
    TileConfig(128, 128),
    TileConfig(128, 192, 1, 2),
    TileConfig(256, 128, 2, 1, False),
    TileConfig(256, 192, 2, 1, False),
)


def configs_without_spills(
    spec: StageSpec,
    candidates: tuple[TileConfig, ...] = TUNE_CANDIDATES,
    *,
    directory: Path | None = None,
    jobs: int | None = 1,
) -> list[TileConfig]:
    """The candidates that fit the stage's tiling constraints, compile, and whose kernels don't spill
    (and `CUBLAS` first for a plain stage). When every one spills, those that spill at most
    `SMALL_SPILL` bytes each way (a few words of the epilogue, e.g. the recomputed LM head's backward
    with five row vectors loaded: 4-12 bytes at 128x128 and 256x128 against 1 KB at 128x192).
    `jobs` as select_config's."""
    if jobs != 1:
        from coda_lang.backend_cute.build import parallel

        parallel.warm([parallel.Request(spec, candidates)], jobs=jobs, directory=directory)
    out = [CUBLAS] if is_plain(spec) else []
    small: list[TileConfig] = []
    for config in candidates:
        if not fits(spec, config):
            continue
        try:
            c = compile_spec(spec, config, directory=directory)
        except CodaError:  # quack refuses this tile for this epilogue (E0707): not a candidate
            continue
        assert c.report is not None
        if not c.report.spills:
            out.append(config)
        elif max(c.report.spill_stores, c.report.spill_loads) <= SMALL_SPILL:
            small.append(config)
    return out if len(out) > is_plain(spec) else out + small


SMALL_SPILL = 16  # bytes: configs_without_spills' fallback when every candidate spills


# A paired stage (acc_pair mode: SwiGLU's half-width stores) keeps quack's epilogue subtile: a
# half-width store of a narrower subtile is a path quack doesn't exercise on SM90.
PAIRED_SUBTILE = "a paired stage keeps quack's epilogue subtile (epi_n=0)"


def narrows_paired_subtile(spec: StageSpec, config: TileConfig) -> bool:
    return spec.paired and 0 < config.epi_n < 32


def epilogue_subtile_n(spec: StageSpec, config: TileConfig) -> int:
    """The N extent of quack's SM90 epilogue subtile for `config`: its `epi_n` when set, else quack's
    default, gcd(32, tile_N) (gcd(64, tile_N), the wider of its choices, for an 8-bit D)."""
    if config.epi_n:
        return config.epi_n
    eight_bit = spec.d is not None and spec.d.dtype.startswith("f8")
    return math.gcd(64 if eight_bit else 32, config.tile_n)


# quack's grouped statistics (GroupedColStatsBase) fold one statistic slot per thread and epilogue
# subtile: a group narrower than the subtile would be folded together with its neighbours.
GROUP_SUBTILE = "a group= width is a multiple of the epilogue subtile's N extent (gcd(32, tile_N) or epi_n)"


def splits_groups(spec: StageSpec, config: TileConfig) -> bool:
    n_e = epilogue_subtile_n(spec, config)
    return any(g.width % n_e for g in spec.groups)


# Seen on an H100 (2026-11-25): the cooperative 256x128 kernel of a stage that moves an f32 tile and
# folds column partials never finished; the tuner's first launch hung the GPU. Twice in the Llama
# training step's RMSNorm backwards: `dx1: f32` loaded beside `sum(.., over=M)` (last_bwd at
# 8192x2048x16384), and `dx1: f32` stored beside one (layer_bwd at 8192x2048x3072). The same stages
# with bf16 tiles (llama_mlp's) run at 256x128; until the cause in quack's epilogue is known, a stage
# that loads or stores an f32 tile beside column partials is given pingpong (128-row) tiles only.
WIDE_F32_TILE = "a stage loading or storing an f32 tile beside column partials takes 128-row (pingpong) tiles"


def moves_f32_tile(spec: StageSpec) -> bool:
    """Whether the stage's epilogue loads or stores an f32 tile (D included)."""
    stored = [*spec.outputs, *([spec.d] if spec.d is not None else [])]
    return any(o.role == "tile" and o.dtype == "f32" for o in spec.operands) or any(
        o.dtype == "f32" for o in stored
    )


def hangs_cooperative(spec: StageSpec, config: TileConfig) -> bool:
    return (
        not config.is_cublas
        and not config.pingpong
        and moves_f32_tile(spec)
        and any(s.layout == "column partials" for s in spec.sinks)
    )


def fits(spec: StageSpec, config: TileConfig, emulated: bool = False) -> bool:
    """Whether `config` satisfies the stage's tiling constraints (plan.py writes them) and, in a paired
    stage, keeps quack's epilogue subtile (PAIRED_SUBTILE); on the kernels (not `emulated`, whose
    grouped folds are exact at any subtile) no group is narrower than the subtile (GROUP_SUBTILE) and
    no stage that hung at a cooperative tile gets one (WIDE_F32_TILE)."""
    if narrows_paired_subtile(spec, config) or not emulated and splits_groups(spec, config):
        return False
    if not emulated and hangs_cooperative(spec, config):
        return False
    for c in spec.constraints:
        m = re.match(r"tile_N % (\d+) == 0", c)
        if m and config.tile_n % int(m.group(1)):
            return False
    return True
