"""The one module that touches quack's API (and, through it, CuTeDSL).

What it does: prepares a process for compile-only work (no GPU: `QUACK_ARCH=90`,
`CUTE_DSL_ARCH=sm_90a`, the driver query `get_max_active_clusters` replaced by a constant while a
compile runs, CuTeDSL told to keep the PTX); imports an emitted epilogue module from its
content-addressed file; compiles one stage through quack's own path (`EpiMod.gemm(..., _launch=False)`:
kind pinning, kernel-class minting, `_compile_gemm_epi` against fake symbolic tensors) with torch
"meta" tensors standing in for the operands; returns the PTX. quack's on-disk object cache is kept in
the kernel cache (`<cache>/quack/<kernel fingerprint>`, unless $QUACK_CACHE_DIR is set), as is
CuTeDSL's own file cache (`<cache>/cute_dsl`, unless $CUTE_DSL_CACHE_DIR is set), and a
compile-only run writes the kernel's object there too: the runtime's first launch of that stage and
tile (same dtypes and majors, so the same quack key) loads it instead of compiling again.
At run time (launch.py), `launch` runs one stage's kernel on CUDA tensors through the same
`EpiMod.gemm` (quack's on-disk cache on, the real driver query) and `sink_alloc_shape` gives quack's
partial-buffer shapes.
What it does not: choose tile configurations or run ptxas (compile.py), or plan and emit (plan.py,
emit.py).
Invariants: importing this module imports quack, cutlass and torch (it is only imported lazily, by
compile.py and launch.py), points quack's object cache at the kernel cache and (through epi_ops) makes
quack's VecReduce max fold NaN-propagating; everything else it changes in those libraries is restored
when a compile returns.

Why meta tensors: quack validates a call and derives its compile key (dtypes, majors, ranks, scalar
modes) from tensor metadata only; the compiled kernel is generic in M, N, K (symbolic), so nominal
sizes are enough. Why CuTeDSL's envar object rather than only environment variables: they are read
once when cutlass is imported, which may have happened before us.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from coda_lang.backend_cute.build.cache import kernel_fingerprint
from coda_lang.backend_cute.build.store import cache_dir, checked, load_module, subfolder
from coda_lang.backend_cute.plan.spec import SCALE_BLOCK, WORD_VIEWS
from coda_lang.ops.registry import torch_dtype

ARCH = "sm_90a"

# Before quack and cutlass are imported: without a GPU they can't ask the driver which arch to
# target, and quack's answer is cached for the life of the process.
os.environ.setdefault("QUACK_ARCH", "90")
os.environ.setdefault("CUTE_DSL_ARCH", ARCH)
# CuTeDSL's own file cache of compiled IR (which it loads and runs) is by default a folder under the
# shared temp directory (/tmp/<user>/cutlass_python_cache: a folder another user can make first): it
# goes inside the kernel cache instead, or where $CUTE_DSL_CACHE_DIR says if that passes the same
# checks (store.py). (CuTeDSL reads the variable each time it looks for its cache.)
if os.environ.get("CUTE_DSL_CACHE_DIR"):
    checked(Path(os.environ["CUTE_DSL_CACHE_DIR"]))
else:
    os.environ["CUTE_DSL_CACHE_DIR"] = str(subfolder(cache_dir(), "cute_dsl"))

import quack.cache  # noqa: E402
import quack.gemm_runtime.host as quack_host  # noqa: E402
import torch  # noqa: E402
from cutlass.cutlass_dsl import CuTeDSL  # noqa: E402
from quack.gemm_sm90 import GemmSm90  # noqa: E402

import coda_lang.backend_cute.plan.epi_ops  # noqa: E402, F401  (installs quack's NaN-propagating max fold)

_H100_SMS = 132
NOMINAL = 3072  # the size every named dim gets for validation (the kernel is shape-generic)


@dataclass(frozen=True)
class EpiSubtileN:
    """quack's SM90 epilogue subtile with its N extent set to `n` (its M extent is quack's own).

    quack 0.6.5 has no parameter for the subtile; it computes it in the static method
    `GemmSm90._compute_tile_shape_or_override`. `post_init_attrs` (quack's knob for setting attributes
    on the kernel object before the trace) sets an instance of this class under that method's name, so
    the instance answers instead. Frozen and defined at module level: quack hashes `post_init_attrs`
    for its plan cache and pickles them for its compile cache key and its compile workers.
    """

    n: int

    def __call__(
        self,
        cta_tile_shape_mnk: Any,
        atom_layout_mnk: Any,
        element_type: Any = None,
        epi_tile_override: Any = None,
    ) -> tuple[int, int]:
        tile_m, _ = GemmSm90._compute_tile_shape_or_override(
            cta_tile_shape_mnk, atom_layout_mnk, element_type
        )
        return tile_m, math.gcd(self.n, int(cta_tile_shape_mnk[1]))


def post_init_attrs(config: Any) -> tuple[tuple[str, Any], ...]:
    """The attributes quack sets on the kernel object for `config`: its epilogue subtile, if not
    quack's, and for fast fp8 accumulation quack's own flag off (`GemmSm90.fp8_slow_accum`: its
    mainloop then keeps no second accumulator; a 16-bit GEMM never has one)."""
    attrs: tuple[tuple[str, Any], ...] = ()
    if config.epi_n:
        attrs += (("_compute_tile_shape_or_override", EpiSubtileN(config.epi_n)),)
    if config.fast_accum:
        attrs += (("fp8_slow_accum", False),)
    return attrs


def quack_cache_dir(root: Path | None = None) -> Path:
    """Where quack keeps its compiled objects of coda's kernels (which the runtime loads and runs):
    beside coda's kernel cache (`root`, default $CODA_CACHE_DIR), in a folder of this backend's kernel
    fingerprint (quack keys an epilogue's ops by class name, not by their code); $QUACK_CACHE_DIR, when
    set, instead. Either is checked as the kernel cache is (store.py: UnsafeCache when someone else
    could write it)."""
    if os.environ.get("QUACK_CACHE_DIR"):
        return checked(Path(os.environ["QUACK_CACHE_DIR"]))
    return subfolder(root or cache_dir(), "quack", kernel_fingerprint())


quack.cache.CACHE_DIR = str(quack_cache_dir())


@contextlib.contextmanager
def compile_only(dump_dir: Path, root: Path | None = None) -> Iterator[None]:
    """Compile without a GPU, keeping the PTX in `dump_dir` and quack's object in the kernel cache at
    `root` (default $CODA_CACHE_DIR); restores everything afterwards."""
    env = CuTeDSL._get_dsl().envar
    saved = (
        quack.cache.CACHE_DIR,
        quack_host.get_max_active_clusters,
        env.keep_ptx,
        env.dump_dir,
        env.arch,
    )
    quack.cache.CACHE_DIR = str(quack_cache_dir(root))
    if not torch.cuda.is_available():
        quack_host.get_max_active_clusters = lambda cluster_size, *a, **k: _H100_SMS // max(1, cluster_size)
    else:  # quack's driver queries need a current CUDA context (a fresh process has none before torch's first op)
        torch.cuda.init()
        torch.empty(1, device="cuda")
    env.keep_ptx = True
    env.dump_dir = str(dump_dir)
    env.arch = ARCH
    try:
        yield
    finally:
        (
            quack.cache.CACHE_DIR,
            quack_host.get_max_active_clusters,
            env.keep_ptx,
            env.dump_dir,
            env.arch,
        ) = saved


def load_epilogue(path: Path, fn_name: str) -> Any:
    """The EpiMod defined by an emitted module, run from its verified source text (store.load_module:
    never from a bytecode cache, never found on sys.path)."""
    return getattr(load_module(path), fn_name)


def _size(dim: Any) -> int:
    n = dim.coeff * (NOMINAL if dim.name is not None else 1)
    if n.denominator != 1:
        raise ValueError(f"dim {dim} is not an integer at the nominal size")
    return int(n)


def _meta(shape: tuple[int, ...], dtype: str) -> Any:
    return torch.empty(shape, dtype=torch_dtype(dtype), device="meta")


def compile_ptx(spec: Any, path: Path, config: Any, root: Path | None = None) -> tuple[str, float]:
    """Compile stage `spec` (emitted at `path`) for sm_90a with tile `config`; (PTX text, seconds).
    quack's object of the kernel goes to the kernel cache at `root` (default $CODA_CACHE_DIR)."""
    mod = load_epilogue(path, spec.fn_name)
    g = spec.gemm
    m, n, k = _size(g.rows), _size(g.cols), _size(g.k)
    if spec.groups:  # whole groups (quack validates N % width), and an even width for half-width values
        unit = math.lcm(2, *(gr.width for gr in spec.groups))
        n = -(-n // unit) * unit
    A = _meta((k, m), g.a_dtype).T if g.ta else _meta((m, k), g.a_dtype)
    B = _meta((n, k), g.b_dtype) if g.tb else _meta((k, n), g.b_dtype)
    wide = 2 * n if spec.mode == "packed_cd_b16x2" else n  # packed mode: C and D are double-width
    D = _meta((m, wide), spec.d.dtype) if spec.d is not None else None
    C = None
    epi: dict[str, Any] = {}
    for o in spec.operands:
        if o.op == "C":
            C = _meta((m, wide), o.dtype)
        elif o.host in WORD_VIEWS:  # a packed stage's pairs read as words (16-bit: float32, fp8: int16)
            epi[o.py] = torch.empty((m, n), dtype=getattr(torch, WORD_VIEWS[o.host]), device="meta")
        elif o.role == "tile":
            epi[o.py] = _meta((m, n), o.dtype)
        elif o.role == "row vector":
            epi[o.py] = _meta((m,), o.dtype)
        elif o.role == "grouped tile":  # s [M, N/g], one column of it per tile (GroupColumnLoad)
            epi[o.py] = _meta((m, -(-n // o.group)), o.dtype)
        elif o.role == "column vector":
            epi[o.py] = _meta((n,), o.dtype)
        else:
            epi[o.py] = 1.0 if o.dtype != "i32" else 1
    for out in spec.outputs:
        if out.pairs:  # an fp8 tile's pairs: one int16 word per accumulator element
            epi[out.py] = torch.empty((m, n), dtype=torch.int16, device="meta")
            continue
        if out.kmajor:  # the transposed view of a K-major copy (every other row of it for a lane)
            if out.lane is None:
                epi[out.py] = _meta((n, m), out.dtype).T
            else:
                epi[out.py] = _meta((2 * n, m), out.dtype)[out.lane :: 2].T
            continue
        epi[out.py] = _meta((m, n // 2 if out.gated else n), out.dtype)  # a lane of a split store: gated
    for s in spec.sinks:
        shape = mod.sinks[s.py].sink_alloc_shape((m,), n, config.tile_m, config.tile_n)
        epi[s.py] = _meta(tuple(shape), "f32")
        if s.index is not None:
            epi[s.index] = _meta((m,), s.index_dtype or "i32")
    if g.scaled:  # the block scales the mainloop reads: [M, K/128] and [N/128, K/128] (or [K/128, N/128])
        blocks, nb = -(-k // SCALE_BLOCK), -(-n // SCALE_BLOCK)
        if g.scale_a is not None:
            epi[g.scale_a_py] = _meta((m, blocks), "f32")
        epi[g.scale_b_py] = _meta(
            (blocks, n) if g.b_columns else (blocks, nb) if g.b_kn else (nb, blocks), "f32"
        )
    for gr in spec.groups:  # a grouped reduction: its width (a compile-time int); its writer's buffer
        epi[gr.py] = gr.width
        if gr.out is not None:
            epi[gr.out] = _meta((m, n // gr.width), "f32")

    def compile() -> tuple[str | None, float]:
        t0 = time.perf_counter()
        plan = mod.gemm(
            A,
            B,
            D,
            C,
            epi_args=epi,
            tile_M=config.tile_m,
            tile_N=config.tile_n,
            cluster_M=config.cluster_m,
            cluster_N=config.cluster_n,
            pingpong=config.pingpong,
            persistent=True,
            b_kn=not g.tb,
            post_init_attrs=post_init_attrs(config),
            _launch=False,
        )
        seconds = time.perf_counter() - t0
        ptx = getattr(plan.compiled_fn, "__ptx__", None)  # (none on a module loaded from quack's cache)
        if ptx and "\n" not in ptx and os.path.exists(ptx):  # a path when the file was not read yet
            ptx = Path(ptx).read_text()
        return ptx, seconds

    with tempfile.TemporaryDirectory(prefix="coda-ptx-") as tmp, compile_only(Path(tmp), root):
        ptx, seconds = compile()
        if not ptx:  # quack had the object (from its disk cache): compile it once more, for the PTX
            enabled = quack.cache.CACHE_ENABLED
            mod._plan_cache.clear()
            quack_host._compile_gemm_epi.cache_clear()
            quack.cache.CACHE_ENABLED = False
            try:
                ptx, seconds = compile()
            finally:
                quack.cache.CACHE_ENABLED = enabled
    if not ptx:
        raise RuntimeError("CuTeDSL kept no PTX for the kernel")
    return ptx, seconds


def launch(
    mod: Any,
    spec: Any,
    config: Any,
    A: Any,
    B: Any,
    D: Any,
    epi_args: dict[str, Any],
    *,
    C: Any = None,
    dry_run: bool = False,
) -> None:
    """One launch of stage `spec`'s kernel on the current stream (the runtime's only call into quack).

    A: (m, k), either major (a `transpose(a)` operand is the stored tensor's `.t()` view); B: the
    stored (k, n) tensor, or (n, k) for `transpose(b)`; D: the main stored tile or None; epi_args:
    the epilogue's operands, TileStore buffers and sink buffers by their names in the emitted fn; C:
    the GEMM's C operand (the double-width 16-bit tile of a packed-mode stage) or None.
    The kernel is compiled on the first call for these dtypes and majors (quack's jit cache, on disk
    too). A later call whose tensors have the metadata of an earlier one (dtype, shape, strides: what
    quack's own plan key reads of them) and whose scalar epilogue arguments are the same values, at the
    same tile config, launches the plan quack returned then (`run_gemm_epi_plan`), skipping quack's
    per-call key (its `EpiMod.gemm` warm path does the same after building its key: our key is finer,
    it holds the scalars' values, not only their compile modes, and cheaper). `dry_run=True` (tests
    without a GPU, on "meta" tensors): quack validates the arguments and compiles the kernel, nothing
    is launched.
    """
    key = None
    if not dry_run:
        key = (
            config,
            _keyed(A),
            _keyed(B),
            _keyed(D),
            _keyed(C),
            *[(k, _keyed(v)) for k, v in epi_args.items()],
        )
        plans: dict[Any, Any] = mod.__dict__.setdefault("_coda_plans", {})
        plan = plans.get(key)
        if plan is not None:
            quack_host.run_gemm_epi_plan(plan, A, B, D, C, epi_args)
            return
    kw = dict(
        epi_args=epi_args,
        tile_M=config.tile_m,
        tile_N=config.tile_n,
        cluster_M=config.cluster_m,
        cluster_N=config.cluster_n,
        pingpong=config.pingpong,
        persistent=True,
        b_kn=not spec.gemm.tb,
        post_init_attrs=post_init_attrs(config),
    )
    if not dry_run:
        plan = mod.gemm(A, B, D, C, **kw)
        if plan is not None:
            mod.__dict__["_coda_plans"][key] = plan
        return
    with tempfile.TemporaryDirectory(prefix="coda-dry-") as tmp, compile_only(Path(tmp)):
        mod.gemm(A, B, D, C, _launch=False, **kw)


def _keyed(v: Any) -> Any:
    """What a plan depends on of a launch argument: a tensor's dtype, shape and strides; anything else
    (a scalar, a group width, None) by its type and value."""
    if hasattr(v, "stride"):
        return (v.dtype, v.shape, v.stride())
    return (type(v), v)


def sink_alloc_shape(mod: Any, name: str, m: int, n: int, config: Any) -> tuple[int, ...]:
    """quack's buffer shape for sink `name` of an (m, n) GEMM at `config` (SM90: per-CTA tile = tile)."""
    return tuple(int(x) for x in mod.sinks[name].sink_alloc_shape((m,), n, config.tile_m, config.tile_n))
