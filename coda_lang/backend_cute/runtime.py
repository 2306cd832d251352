"""The torch runtime of the CuTeDSL backend: a checked block as a callable on CUDA tensors.

What it does: `CudaBlock` (made by `Block.cuda(tile=None)`) runs a block on torch tensors keyed by
parameter name. Each GEMM stage is ONE launch of its quack kernel (the emitted `@gemm_epilogue`, at
the tile given, or else the fastest of the tiles without register spills, measured on the stage's first
launch at a GEMM shape and cached on disk (tune.py); `select_config`'s first tile without spills when
tuning is off), recorded as the torch
custom op `coda::stage` so that torch.compile traces through it: the stage's stored tiles are
allocated as its outputs, its partial reductions as quack's per-tile partial buffers
(`ColVecReduce` [m, ceil(n/tile_N)], `RowVecReduce` [ceil(m/tile_M), n]), which tiny torch ops then
combine (sum, max, log-sum-exp). The vector computations between stages are tiny torch ops too, one
per equation, through `TORCH_OPS` (registry op name -> torch function). `run_with_partials` also
returns the partial buffers, to compare with the interpreter's tile simulation. `CudaBlock.autograd()`
gives a function whose `torch.autograd.Function` runs the extended forward (`Block.derivation()
.forward`) and, for the backward, the derived backward block's kernels.
What it does not: plan, emit or compile (plan.py, emit.py, compile.py) or touch quack
(quack_adapter.py, imported on the first launch); an elementwise stage (no GEMM) runs as one fused
kernel that torch.compile generates (elementwise.py); nothing the planner rejects runs (E07, raised
when the CudaBlock is made).
Invariants: numerics follow the interpreter's (interp/run.py): f32 inside a stage and between
stages, stored tiles rounded to their dtype by the kernel, annotated values rounded where they are
defined; every stage's kernel writes every element of its buffers (pick's output is pre-filled
with zeros, the kernel leaves rows whose index is outside the row alone). Importing this module
imports torch, never quack. `emulate=True` replaces the quack launch by a torch stand-in
(emulate.py) so that everything else here runs, and is tested, without a GPU.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import sys
import warnings
import weakref
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import torch

from coda_lang.backend_cute.compile import (
    CANDIDATES,
    PAIRED_SUBTILE,
    BackendUnavailable,
    TileConfig,
    fits,
    narrows_paired_subtile,
)
from coda_lang.backend_cute.elementwise import ElementwiseStage
from coda_lang.backend_cute.emit import emit_stage, source_hash, write_source
from coda_lang.backend_cute.planner import plan_stage
from coda_lang.backend_cute.spec import Sink, StageSpec, dim_operand
from coda_lang.interp.inputs import fail, infer_dims
from coda_lang.ir.nodes import DimRef, Eqn, Lit, Stage, Var
from coda_lang.ir.types import BOOL, MATRIX, Dim, Type
from coda_lang.ops import REGISTRY
from coda_lang.ops.registry import combine_of_sink, combine_rule
from coda_lang.verify.diagnostics import CodaError, Diagnostic

TORCH_DTYPES: dict[str, torch.dtype] = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16,
                                        "i32": torch.int32, BOOL: torch.bool}
_HALF = (torch.bfloat16, torch.float16)

def sink_rule(s: Sink) -> tuple[str, int]:
    """(combine record name, axis) of a sink's partial buffer; ("select", -1) for pick's finished vector."""
    if s.op == "ColVecSelect":
        return "select", -1
    rule = combine_of_sink("lse" if s.op == "OnlineLSEReduce" else s.combine or "", s.negate).name
    return rule, (1 if s.layout == "row partials" else 0)


def sink_partials(s: Sink, buf: torch.Tensor) -> torch.Tensor:
    """The per-tile partials of a sink from the buffer its kernel wrote: a min() sink's kernel folds the
    negation by max, so its buffer holds -min per tile (negated back here, exactly)."""
    return -buf if s.negate else buf


def sink_shape(s: Sink, m: Any, n: Any, tile_m: int, tile_n: int) -> tuple[Any, ...]:
    """quack's buffer shape for a sink of an (m, n) GEMM at tile (tile_m, tile_n) on SM90
    (`sink_alloc_shape` with lead (m,)): per-tile partials along the reduced dim."""
    if s.op == "ColVecSelect":
        return (m,)
    if s.layout == "row partials":
        return (m, -(-n // tile_n))
    return (-(-m // tile_m), n)


def _width(shape_dim: Dim, cols: Dim, n: Any) -> Any:
    """The extent of a stage value's column dim `shape_dim` when the stage's width `cols` is n."""
    ratio = Fraction(shape_dim.coeff) / Fraction(cols.coeff)
    return n if ratio == 1 else n * ratio.numerator // ratio.denominator


def _aligned(t: Any) -> Any:
    """A tensor whose data pointer is 16-byte aligned (TMA and the vector loads assume it)."""
    if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.data_ptr() % 16:
        return t.clone()
    return t


# ------------------------------------------------------------------------------------------------
# One stage: its spec, tile config, epilogue module, and the custom op that launches it.

_STAGES: weakref.WeakValueDictionary[str, _StageRunner] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


class _StageRunner:
    """Stage `index` of a block at a fixed tile config; `launch` is the body of `coda::stage`."""

    def __init__(self, block: Any, index: int, spec: StageSpec, config: TileConfig, emulate: bool,
                 poison: bool = False):
        self.block, self.index, self.spec, self.config, self.emulate = block, index, spec, config, emulate
        self.poison = poison
        self.key = f"{spec.fn_name}:{config.short}:{next(_KEYS)}"
        self.index_names = [(s.index, _coda_name(spec, s.index)) for s in spec.sinks if s.index is not None]
        self._mod: Any = None
        _STAGES[self.key] = self

    @property
    def mod(self) -> Any:
        """The quack EpiMod of the emitted epilogue (imports quack on first use)."""
        if self._mod is None:
            from coda_lang.backend_cute import quack_adapter

            path = write_source(emit_stage(self.spec))
            self._mod = quack_adapter.load_epilogue(path, self.spec.fn_name)
        return self._mod

    # host side (traced by torch.compile): the op's arguments from the block's values
    def arguments(self, env: dict[str, Any]) -> tuple[list[torch.Tensor | None], list[float]]:
        spec, g = self.spec, self.spec.gemm
        A = env[g.a].to(TORCH_DTYPES[g.a_dtype]).contiguous()
        B = env[g.b].to(TORCH_DTYPES[g.b_dtype]).contiguous()
        ins: list[torch.Tensor | None] = [A.t() if g.ta else A, B]  # B: (k, n), or (n, k) for transpose(b)
        scalars: list[float] = []
        for o in spec.operands:
            v = env[o.name]
            if o.role == "scalar":
                if isinstance(v, torch.Tensor):
                    ins.append(v.to(TORCH_DTYPES[o.dtype]).reshape(1))
                else:
                    ins.append(None)
                    scalars.append(float(v))
                continue
            t = v.to(TORCH_DTYPES[o.dtype])
            if o.host == "repeat_interleave(2)":
                t = t.repeat_interleave(2)
            ins.append(t.contiguous())
        for _, name in self.index_names:
            ins.append(env[name].to(torch.int32).contiguous())
        return ins, scalars

    def allocate(self, A: torch.Tensor, B: torch.Tensor) -> list[torch.Tensor]:
        """The stage's output buffers: [D?] + TileStores + sinks (also the fake impl of the op)."""
        spec, g, cfg = self.spec, self.spec.gemm, self.config
        m, n = A.shape[0], (B.shape[0] if g.tb else B.shape[1])
        dev = A.device

        def new(shape: tuple[Any, ...], dtype: torch.dtype) -> torch.Tensor:
            if self.poison:  # tests: an element the kernel does not write stays NaN
                return torch.full(shape, float("nan"), dtype=dtype, device=dev)
            return torch.empty(shape, dtype=dtype, device=dev)

        outs = []
        if spec.d is not None:
            outs.append(new((m, _width(spec.d.shape[1], g.cols, n)), TORCH_DTYPES[spec.d.dtype]))
        for o in spec.outputs:
            width = _width(o.shape[1], g.cols, n)
            outs.append(new((m, width // 2 if o.lane is not None else width), TORCH_DTYPES[o.dtype]))
        stored = ([spec.d.name] if spec.d is not None else []) + [o.name for o in spec.outputs]
        for t, name in zip(outs, stored, strict=True):
            if isinstance(t.shape[1], int) and (t.shape[1] * t.element_size()) % 16:
                raise fail("E0807", f"stage {spec.index} (`{spec.text}`) stores `{name}` with rows of {t.shape[1]} "
                           f"values, {t.shape[1] * t.element_size()} bytes: the kernel's TMA stores need rows of a multiple "
                           "of 16 bytes", notes=["choose dims that make every stored row a multiple of 16 bytes "
                                                 "(8 bf16 values); the interpreter (Block.run) takes any size"])
        for gr in spec.groups:  # quack's GroupedColStatsBase needs whole groups (it raises ValueError)
            if isinstance(n, int) and n % gr.width:
                raise fail("E0802", f"stage {spec.index} (`{spec.text}`) reduces `{gr.name}` in groups of {gr.width} "
                           f"columns, but its width is {n}: not a multiple of {gr.width}",
                           notes=["choose sizes that make the grouped width a multiple of the group"])
        for s in spec.sinks:
            shape = sink_shape(s, m, n, cfg.tile_m, cfg.tile_n)
            # pick leaves rows whose index is outside [0, n) alone: they read 0, as in the interpreter
            outs.append(torch.zeros(shape, dtype=torch.float32, device=dev) if s.op == "ColVecSelect"
                        else new(shape, torch.float32))
        for gr in spec.groups:  # a grouped reduction used after the stage: one f32 per row and group
            if gr.out is not None:
                outs.append(new((m, n // gr.width), torch.float32))
        return outs

    # device side (the op's body): one kernel launch
    def launch(self, ins: list[torch.Tensor | None], scalars: list[float]) -> list[torch.Tensor]:
        A, B = _aligned(ins[0]), _aligned(ins[1])
        assert A is not None and B is not None
        outs = self.allocate(A, B)
        D, C, epi = self.epilogue_arguments(ins, scalars, outs)
        if self.config.is_cublas:  # a plain stage (compile.is_plain) the tuner found faster on cuBLAS
            assert D is not None
            torch.matmul(A, B.t() if self.spec.gemm.tb else B, out=D)
        elif self.emulate:
            from coda_lang.backend_cute import emulate

            emulate.run_stage(self.spec, self.config, A, B, D, epi, C=C)
        else:
            from coda_lang.backend_cute import quack_adapter

            quack_adapter.launch(self.mod, self.spec, self.config, A, B, D, epi, C=C)
        return outs

    def epilogue_arguments(self, ins: list[torch.Tensor | None], scalars: list[float], outs: list[torch.Tensor]
                           ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, Any]]:
        """(D, C, epi_args by the emitted fn's names) for quack's `EpiMod.gemm`, from the op's arguments
        (C: the GEMM's C operand of a packed-mode stage, else None)."""
        spec = self.spec
        epi: dict[str, Any] = {}
        it = iter(scalars)
        j = 2
        C = None
        for o in spec.operands:
            t = ins[j]
            j += 1
            if o.op == "C":
                C = _aligned(t)
                continue
            epi[o.py] = (next(it) if t is None else t) if o.role == "scalar" else _aligned(t)
        for py, _ in self.index_names:
            epi[py] = _aligned(ins[j])
            j += 1
        i = 0
        D = None
        if spec.d is not None:
            D, i = outs[0], 1
        for out in spec.outputs:
            epi[out.py] = outs[i]
            i += 1
        for s in spec.sinks:
            epi[s.py] = outs[i]
            i += 1
        for gr in spec.groups:  # GroupedReduce's host argument: the group width (compile-time)
            epi[gr.py] = gr.width
            if gr.out is not None:
                epi[gr.out] = outs[i]
                i += 1
        return D, C, epi

    def collect(self, outs: list[torch.Tensor], env: dict[str, Any], partials: dict[str, torch.Tensor],
                storage: dict[str, str]) -> None:
        """Bind the stage's results by coda name: stored tiles, and each sink combined across tiles."""
        spec = self.spec
        i = 0
        if spec.d is not None:
            env[spec.d.name] = outs[0]
            i = 1
        lanes: dict[str, list[torch.Tensor]] = {}
        for o in spec.outputs:
            if o.lane is not None:  # one lane of a full-width tile of a paired stage: interleave them back
                lanes.setdefault(o.name, []).append(outs[i])
                if len(lanes[o.name]) == 2:
                    even, odd = lanes[o.name]
                    env[o.name] = torch.stack((even, odd), dim=-1).reshape(even.shape[0], -1)
            else:
                env[o.name] = outs[i]
            i += 1
        for s in spec.sinks:
            buf = sink_partials(s, outs[i])
            i += 1
            partials[s.name] = buf
            rule, axis = sink_rule(s)
            x = buf if rule == "select" else combine_rule(rule).torch(buf, axis)
            dtype = storage.get(s.name)
            env[s.name] = _round(x, dtype) if dtype else x
        for gr in spec.groups:
            if gr.out is not None:
                dtype = storage.get(gr.name)
                env[gr.name] = _round(outs[i], dtype) if dtype else outs[i]
                i += 1


def _coda_name(spec: StageSpec, py: str) -> str:
    for name, p in spec.names.items():
        if p == py:
            return name
    return py


# The schema is given, not inferred from the annotations (stable across torch versions).
@torch.library.custom_op("coda::stage", mutates_args=(), schema="(str key, Tensor?[] ins, float[] scalars) -> Tensor[]")
def _stage_op(key: str, ins: list[torch.Tensor | None], scalars: list[float]) -> list[torch.Tensor]:
    """One GEMM stage of a coda block: one kernel launch; returns [D?] + stored tiles + sink buffers."""
    return _STAGES[key].launch(ins, scalars)


@_stage_op.register_fake
def _stage_op_fake(key: str, ins: list[torch.Tensor | None], scalars: list[float]) -> list[torch.Tensor]:
    A, B = ins[0], ins[1]
    assert A is not None and B is not None
    return _STAGES[key].allocate(A, B)


# ------------------------------------------------------------------------------------------------
# Tile selection


_SELECTED: dict[tuple[str, tuple[TileConfig, ...]], TileConfig] = {}


def _find_ptxas() -> bool:
    """ptxas for select_config's spill check: $CODA_PTXAS, PATH, else the one Triton ships (then
    $CODA_PTXAS is set to it for this process)."""
    if os.environ.get("CODA_PTXAS") or shutil.which("ptxas"):
        return True
    try:
        import triton
    except ImportError:
        return False
    exe = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if exe.is_file() and os.access(exe, os.X_OK):
        os.environ["CODA_PTXAS"] = str(exe)
        return True
    return False


def as_config(tile: Any) -> TileConfig:
    """A TileConfig from a TileConfig or a (tile_M, tile_N) pair (quack's SM90 cluster and pingpong)."""
    if isinstance(tile, TileConfig):
        return tile
    if isinstance(tile, (tuple, list)) and len(tile) == 2 and all(isinstance(x, int) for x in tile):
        return TileConfig(int(tile[0]), int(tile[1]))
    raise TypeError(f"a tile is a TileConfig or (tile_M, tile_N), got {tile!r}")


def choose_config(block: Any, index: int, spec: StageSpec, emulate: bool) -> TileConfig:
    """select_config's tile for a stage (cached per emitted source); without a usable ptxas, or when
    emulating, the first candidate that fits the stage's tiling constraints."""
    candidates = tuple(c for c in CANDIDATES if fits(spec, c))
    if not candidates:
        raise CodaError([Diagnostic("E0706", f"stage {index} (`{spec.text}`): no candidate tile satisfies its "
                                    "tiling constraints", spec.span, notes=list(spec.constraints))])
    if emulate:
        return candidates[0]
    key = (source_hash(emit_stage(spec)), candidates)
    if key not in _SELECTED:
        from coda_lang.backend_cute.compile import select_config

        if not _find_ptxas():
            warnings.warn(f"no ptxas to check stage {index} of {spec.block} for spills; using {candidates[0]}",
                          stacklevel=3)
            return candidates[0]
        try:
            _SELECTED[key] = select_config(block, index, candidates).config
        except (BackendUnavailable, RuntimeError) as e:
            warnings.warn(f"select_config failed for stage {index} of {spec.block} ({str(e).splitlines()[0]}); "
                          f"using {candidates[0]}", stacklevel=3)
            return candidates[0]
    return _SELECTED[key]


# ------------------------------------------------------------------------------------------------
# The block


def _round(x: Any, dtype: str | None) -> Any:
    """x rounded to a storage dtype, kept in its compute dtype (interp.numerics.round_to)."""
    if dtype is None or not isinstance(x, torch.Tensor):
        return x
    if dtype in ("bf16", "f16"):
        return x.to(TORCH_DTYPES[dtype]).float() if x.is_floating_point() else x
    if dtype == "i32":
        return x.trunc().to(torch.int32) if x.is_floating_point() else x.to(torch.int32)
    return x.float() if dtype == "f32" else x


def _compute(x: Any, t: Type | None, device: torch.device) -> Any:
    """A block-level value in its compute dtype (f32 for floats), as a tensor on the block's device."""
    if t is None or t.kind == MATRIX:
        return x  # a matrix alias (`y = x`) is the same tensor
    dtype = torch.float32 if t.dtype in ("f32", "bf16", "f16") else TORCH_DTYPES.get(t.dtype, torch.float32)
    if not isinstance(x, torch.Tensor):
        return torch.full((), x, dtype=dtype, device=device)
    return x.to(device=device, dtype=dtype)


class CudaBlock:
    """A checked block as a callable on torch tensors: `cb(**tensors)` or `cb({name: tensor})` gives
    the block's outputs by name. Made by `Block.cuda(tile=None)`.

    `tile`: None (each stage's tile chosen by `select_config`: no register spills), a
    `(tile_M, tile_N)` pair or a `TileConfig` for every stage, or a dict {stage: tile}.
    `emulate=True`: each stage's launch is replaced by a torch stand-in (emulate.py) that runs on any
    device; for testing the runtime without a GPU, not for speed. `poison=True`: output buffers are
    filled with NaN before each launch (tests: every element must be written). `dims`: sizes of dims
    that no input's shape gives (a dim used only as a value), as `Block.run(..., dims=)` takes them;
    a call may give more (`cb(inputs, dims={...})`; `dims` is a reserved word, never a parameter).

    torch.compile traces a call into one graph (the launches are the custom op `coda::stage`); call the
    block once eagerly (or `prepare()`) first, so that tile selection and kernel compilation happen
    outside the trace, and keep the CudaBlock alive while a compiled graph uses it (the op finds its
    stage by a key in a weak registry). Calling it on tensors that require grad gives outputs whose
    backward raises; use `autograd()` for gradients.
    """

    def __init__(self, block: Any, tile: Any = None, *, emulate: bool = False, poison: bool = False,
                 tune: bool | None = None, dims: dict[str, int] | None = None):
        self.block, self.emulate, self.poison = block, emulate, poison
        self.dims = _given_dims(block.ir, dims)
        # measure the non-spilling tiles of each stage on its first launch at a shape (default: on a GPU,
        # for the stages given no tile, unless $CODA_TUNE=0)
        self.tune = (not emulate and os.environ.get("CODA_TUNE", "1") != "0") if tune is None else tune
        self._by_shape: dict[tuple[int, int, int, int], _StageRunner] = {}  # (stage, m, n, k) -> tuned
        self._last: dict[int, _StageRunner] = {}  # the runner of each stage's latest launch
        self.ir, self.plan = block.ir, block.plan
        self._shape_rules = _shape_rules(self.ir)
        # GEMM stages: their StageSpec; elementwise stages (no GEMM): an ElementwiseStage, spec None
        self.specs: list[StageSpec | None] = []
        self.elementwise: dict[int, ElementwiseStage] = {}
        try:
            for k, st in enumerate((s for s in self.ir.body if isinstance(s, Stage)), 1):
                if not st.is_gemm:
                    self.elementwise[k] = ElementwiseStage(block, k, emulate)
                    self.specs.append(None)
                    continue
                spec = plan_stage(block, k)
                emit_stage(spec)  # an op the emitter can't write raises E07 now, not at the first call
                self.specs.append(spec)
        except CodaError as e:
            raise with_sources(e) from None
        gemms = [k for k, spec in enumerate(self.specs, 1) if spec is not None]
        if isinstance(tile, dict):
            self._tiles = {int(k): as_config(v) for k, v in tile.items()}
            unknown = sorted(set(self._tiles) - set(gemms))
            if unknown:
                raise ValueError(f"stage {unknown[0]} of block {self.ir.name} is elementwise: it has no tile"
                                 if unknown[0] in self.elementwise else
                                 f"block {self.ir.name} has no stage {unknown[0]}")
        else:
            self._tiles = {k: as_config(tile) for k in gemms} if tile is not None else {}
        self.tile = None if isinstance(tile, dict) else tile  # one tile for every stage: autograd() reuses it
        for k, cfg in self._tiles.items():
            target = self.specs[k - 1]
            assert target is not None
            if not fits(target, cfg):
                why = [*target.constraints, *([PAIRED_SUBTILE] if narrows_paired_subtile(target, cfg) else [])]
                raise fail("E0805", f"tile {cfg.short} does not fit stage {k} (`{target.text}`): {'; '.join(why)}")
        for s in self.ir.body:
            if not isinstance(s, Stage) and REGISTRY[s.op].torch is None:
                raise CodaError([Diagnostic("E0708", f"`{s.op}` between stages has no torch stand-in in the CUDA "
                                            "runtime", s.span, notes=["an op's torch stand-in is its OpDef's `torch=` "
                                                                      "(coda_lang/ops/)"])])
        self._runners: dict[int, _StageRunner] = {}
        # (first output, argument position) -> (dim name, numerator, denominator) of each dim used as a
        # value between stages, so that no Fraction is touched while a call is traced
        self._dimrefs = {(s.outs[0].name, i): (a.dim.name, a.dim.coeff.numerator, a.dim.coeff.denominator)
                         for s in self.ir.body if not isinstance(s, Stage)
                         for i, a in enumerate(s.ins) if isinstance(a, DimRef)}
        self._ready = False

    @property
    def name(self) -> str:
        return self.ir.name

    def __repr__(self) -> str:
        how = " (emulated)" if self.emulate else ""
        return f"<coda CudaBlock {self.name}: {len(self.specs)} stages{how}>"

    # -- configuration ------------------------------------------------------------------------

    def config(self, index: int) -> TileConfig:
        """The tile config of stage `index` (1-based) at its latest launch (with tuning, the one measured
        fastest at that shape); before any launch, the one `select_config` chooses."""
        return self.launched(index).config

    @property
    def gemm_stages(self) -> list[int]:
        """The 1-based indices of the GEMM stages (the others are elementwise)."""
        return [k for k, spec in enumerate(self.specs, 1) if spec is not None]

    @property
    def tiles(self) -> dict[int, tuple[int, int]]:
        """{stage: (tile_M, tile_N)} of the GEMM stages: what `Block.run(..., tile=cb.tiles)` simulates."""
        return {k: (self.config(k).tile_m, self.config(k).tile_n) for k in self.gemm_stages}

    def launched(self, index: int) -> _StageRunner:
        """The runner of stage `index`'s latest launch (with tuning: the tile measured fastest at that
        shape), else `runner(index)`."""
        return self._last.get(index) or self.runner(index)

    def runner(self, index: int) -> _StageRunner:
        r = self._runners.get(index)
        if r is None:
            spec = self.specs[index - 1]
            if spec is None:
                raise ValueError(f"stage {index} of {self.name} is elementwise: it has no GEMM kernel or tile")
            cfg = self._tiles.get(index) or choose_config(self.block, index, spec, self.emulate)
            r = self._runners[index] = _StageRunner(self.block, index, spec, cfg, self.emulate, self.poison)
        return r

    @torch.compiler.disable
    def prepare(self) -> CudaBlock:
        """Choose every stage's tile and import its epilogue now (a first call does it otherwise)."""
        for k in self.gemm_stages:
            r = self.runner(k)
            if not self.emulate:
                r.mod  # noqa: B018 (imports quack and the emitted module)
        self._ready = True
        return self

    # -- running ------------------------------------------------------------------------------

    def __call__(self, inputs: dict[str, Any] | None = None, /, *, dims: dict[str, int] | None = None,
                 **tensors: Any) -> dict[str, torch.Tensor]:
        return self.run_with_partials(inputs, dims=dims, **tensors)[0]

    def run_with_partials(self, inputs: dict[str, Any] | None = None, /, *, dims: dict[str, int] | None = None,
                          **tensors: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Outputs by name, and every stage's partial buffers by the name of the reduction, as the
        kernel wrote them (row partials [m, ceil(n/tile_N)], column partials [ceil(m/tile_M), n]; a
        pick gives its finished [m] vector). `dims`: sizes of dims (with the CudaBlock's own `dims`)."""
        outs, partials, _ = self._call({**(inputs or {}), **tensors}, dims)
        return outs, partials

    def values(self, inputs: dict[str, Any] | None = None, /, *, dims: dict[str, int] | None = None,
               **tensors: Any) -> dict[str, Any]:
        """Every named value of a run (inputs as bound, stored tiles, vectors, and each dim's size under
        `%NAME`): what `run_stage` reads."""
        return self._run({**(inputs or {}), **tensors}, dims)[0]

    def run_stage(self, index: int, env: dict[str, Any], dims: dict[str, int] | None = None
                  ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Stage `index` alone (one kernel launch plus its partial combines; an elementwise stage: its
        fused kernel) on the values in `env`: (the values it defines, its partial buffers)."""
        new: dict[str, Any] = {}
        partials: dict[str, torch.Tensor] = {}
        if index in self.elementwise:
            shapes = {p.var.name: tuple(env[p.var.name].shape) for p in self.ir.params
                      if isinstance(env.get(p.var.name), torch.Tensor)}
            sizes = _dims_of(self.ir, self._shape_rules, shapes, self._given(dims))
            self.elementwise[index].run({**env}, sizes, self.plan.storage, out=new)
            return new, partials
        r = self.runner(index)
        ins, scalars = r.arguments(env)
        outs = torch.ops.coda.stage(r.key, ins, scalars)
        r.collect(outs, new, partials, self.plan.storage)
        return new, partials

    def _given(self, dims: dict[str, int] | None) -> dict[str, int]:
        """The dims given to a call, with the CudaBlock's own."""
        return {**self.dims, **_given_dims(self.ir, dims)} if dims else self.dims

    def _call(self, tensors: dict[str, Any], dims: dict[str, int] | None
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, int]]:
        """(outputs by name in their dtypes, partial buffers, the dims of the run)."""
        env, partials, sizes = self._run(tensors, dims)
        outs = {}
        for o in self.ir.outputs:
            x = env[o.name]
            outs[o.name] = x.to(TORCH_DTYPES[o.type.dtype]) if isinstance(x, torch.Tensor) else x
        return outs, partials, sizes

    def _run(self, tensors: dict[str, Any], given: dict[str, int] | None = None
             ) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, int]]:
        env, dims, device = self._bind(tensors, self._given(given))
        env.update({dim_operand(k): v for k, v in dims.items()})  # a dim used as a value inside a stage
        if not self._ready:
            self.prepare()
        partials: dict[str, torch.Tensor] = {}
        k = 0
        for s in self.ir.body:
            if isinstance(s, Stage):
                k += 1
                if k in self.elementwise:
                    self.elementwise[k].run(env, dims, self.plan.storage)
                    continue
                r = self.runner(k)
                ins, scalars = r.arguments(env)
                if self.tune and k not in self._tiles:
                    r = self._tuned(k, r, ins, scalars)
                if not torch.compiler.is_compiling():  # (a side effect a traced autograd.Function can't hold)
                    self._last[k] = r
                outs = torch.ops.coda.stage(r.key, ins, scalars)
                r.collect(outs, env, partials, self.plan.storage)
            else:
                self._vector_eqn(s, env, dims, device)
        return env, partials, dims

    def _tuned(self, k: int, r: _StageRunner, ins: list[torch.Tensor | None], scalars: list[float]) -> _StageRunner:
        """Stage k's runner at the fastest non-spilling tile for this GEMM shape: from this block's
        memory, else the tuning cache on disk, else measured now on these very arguments."""
        A, B = ins[0], ins[1]
        assert A is not None and B is not None
        spec = r.spec
        n = B.shape[0] if spec.gemm.tb else B.shape[1]
        key = (k, int(A.shape[0]), int(n), int(A.shape[1]))
        if key not in self._by_shape:
            self._by_shape[key] = self._measure(k, r, ins, scalars, key)
        return self._by_shape[key]

    @torch.compiler.disable
    def _measure(self, k: int, r: _StageRunner, ins: list[torch.Tensor | None], scalars: list[float],
                 key: tuple[int, int, int, int]) -> _StageRunner:
        from coda_lang.backend_cute import tune

        spec = r.spec
        A = ins[0]
        assert A is not None
        disk = tune.disk_key(emit_stage(spec), key[1:], torch.cuda.get_device_name(A.device))
        cached = tune.lookup(disk)
        if cached is None:
            if not _find_ptxas():
                return r
            from coda_lang.backend_cute.compile import configs_without_spills

            print(f"coda: tuning stage {k} of {self.name} (`{spec.text}`) at {key[1]}x{key[2]}x{key[3]}: compiling "
                  "and timing its tile configs once; the choice is cached (CODA_TUNE=0 skips this)",
                  file=sys.stderr)
            runners = {c: r if c == r.config else _StageRunner(self.block, k, spec, c, self.emulate, self.poison)
                       for c in configs_without_spills(spec)}
            def launch(x: _StageRunner) -> Callable[[], Any]:
                return lambda: torch.ops.coda.stage(x.key, ins, scalars)

            times = tune.measure({c: launch(x) for c, x in runners.items()})
            if not times:
                return r
            cached = min(times, key=lambda c: times[c])
            tune.store(disk, cached, times)
            return runners[cached]
        return r if cached == r.config else _StageRunner(self.block, k, spec, cached, self.emulate, self.poison)

    def _vector_eqn(self, e: Eqn, env: dict[str, Any], dims: dict[str, int], device: torch.device) -> None:
        vals = []
        upcast = e.outs[0].type is None or e.outs[0].type.kind != MATRIX  # a matrix alias stays the same tensor
        for a in e.ins:
            if isinstance(a, Var):
                x = env[a.name]  # a 16-bit parameter is bound in its dtype: computed in f32, as the interpreter does
                vals.append(x.float() if upcast and isinstance(x, torch.Tensor) and x.dtype in _HALF else x)
            elif isinstance(a, Lit):
                vals.append(a.value)
            else:  # a dim as a value: integer arithmetic on plain ints (torch.compile traces this)
                name, num, den = self._dimrefs[(e.outs[0].name, len(vals))]
                vals.append((dims[name] if name is not None else 1) * num // den)
        params = {k: v for k, v in e.params if not isinstance(v, Dim)}
        stand_in = REGISTRY[e.op].torch
        assert stand_in is not None  # checked when the CudaBlock was made (E0708)
        res = stand_in(*vals, **params)
        res_t = res if isinstance(res, tuple) else (res,)
        for v, x in zip(e.outs, res_t, strict=True):
            x = _compute(x, v.type, device)
            env[v.name] = _round(x, v.annot) if v.annot else x

    def _bind(self, tensors: dict[str, Any], given: dict[str, int]
              ) -> tuple[dict[str, Any], dict[str, int], torch.device]:
        names = {p.var.name for p in self.ir.params}
        unknown = sorted(set(tensors) - names)
        if unknown:
            raise fail("E0801", f"unknown input `{unknown[0]}`; the block's parameters are {', '.join(sorted(names))}")
        env: dict[str, Any] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        device: torch.device | None = None
        for p in self.ir.params:
            name, t = p.var.name, p.var.type
            assert t is not None
            if name not in tensors:
                if p.default is None:
                    raise fail("E0801", f"missing input `{name}`")
                env[name] = p.default
                continue
            v = tensors[name]
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not t.shape:
                if t.dtype == "i32" and not isinstance(v, int):
                    raise fail("E0803", f"input `{name}` is {v!r}, but it is declared i32")
                # a 16-bit scalar rounded to its dtype, as the interpreter binds it
                env[name] = int(v) if t.dtype == "i32" else (
                    float(torch.tensor(float(v)).to(TORCH_DTYPES[t.dtype])) if t.dtype in ("bf16", "f16") else float(v))
                continue
            if not isinstance(v, torch.Tensor):
                raise fail("E0803", f"input `{name}` is a {type(v).__name__}; the CUDA runtime takes torch tensors")
            if device is None:
                device = v.device
            elif v.device != device:
                raise fail("E0806", f"input `{name}` is on {v.device}, but other inputs are on {device}")
            if t.dtype == "i32":
                if v.is_floating_point() or v.is_complex() or v.dtype == torch.bool:
                    raise fail("E0803", f"input `{name}` is {v.dtype}, but it is declared i32")
            elif not (v.is_floating_point() or (v.dim() == 0 and v.dtype != torch.bool)):
                raise fail("E0803", f"input `{name}` is {v.dtype}, but it is declared {t.dtype}")
            shapes[name] = tuple(v.shape)
            env[name] = v.to(TORCH_DTYPES[t.dtype]).contiguous()
        if device is None:
            raise fail("E0801", "no tensor inputs")
        if not self.emulate and device.type != "cuda":
            raise fail("E0806", f"inputs are on {device}; the CUDA runtime needs CUDA tensors",
                       notes=["Block.run runs the interpreter on CPU tensors"])
        dims = _dims_of(self.ir, self._shape_rules, shapes, given)
        return env, dims, device

    # -- autograd -----------------------------------------------------------------------------

    def autograd(self, wrt: list[str] | None = None, tile: Any = None) -> CudaFunction:
        """A function of the block's inputs (by name) whose outputs are differentiable by torch.autograd:
        forward = the extended forward block, backward = the derived backward block, both on CUDA, at
        `tile` (default: this block's own, when it was given one tile for every stage), tuned as this
        block is. CodaError (E07) when a stage of either can't run on the GPU yet."""
        return CudaFunction(self, wrt, tile if tile is not None else self.tile)


def _shape_rules(block: Any) -> tuple[tuple[str, int, str | None, int, int], ...]:
    """(param, axis, dim, numerator, denominator) for every declared extent `c*X` (c = num/den):
    plain ints, so that inferring dims from tensor shapes is traceable by torch.compile."""
    rules = []
    for p in block.params:
        for axis, d in enumerate(p.var.type.shape if p.var.type else ()):
            rules.append((p.var.name, axis, d.name, d.coeff.numerator, d.coeff.denominator))
    return tuple(rules)


def _given_dims(block: Any, dims: dict[str, int] | None) -> dict[str, int]:
    """`dims=` as plain ints, checked: E0804 for a dim the block doesn't declare or a size that is not
    a positive integer (a fixed dim or a shape that contradicts it: when a call binds its inputs)."""
    if not dims:
        return {}
    names = [d.name for d in block.dims]
    out = {}
    for name, v in dims.items():
        if name not in names:
            raise fail("E0804", f"unknown dim `{name}`; the block's dims are {', '.join(names) or '(none)'}")
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise fail("E0804", f"dim {name} must be a positive integer, got {v!r}")
        out[name] = int(v)
    return out


def _dims_of(block: Any, rules: tuple[tuple[str, int, str | None, int, int], ...],
             shapes: dict[str, tuple[int, ...]], given: dict[str, int] | None = None) -> dict[str, int]:
    """Dims from `given` (checked by _given_dims) and input shapes, in integer arithmetic; any
    inconsistency defers to the interpreter's checks (infer_dims), which give the diagnostic."""
    dims: dict[str, int] = {d.name: d.value for d in block.dims if d.value is not None}
    for name, value in (given or {}).items():
        if dims.setdefault(name, value) != value:
            return infer_dims(block, shapes, given)
    for name, axis, dim, num, den in rules:
        shape = shapes.get(name)
        if shape is None or len(shape) <= axis:
            return infer_dims(block, shapes, given)
        n = int(shape[axis])
        if dim is None:
            if n * den != num:
                return infer_dims(block, shapes, given)
            continue
        if (n * den) % num:
            return infer_dims(block, shapes, given)
        value = n * den // num
        if dims.setdefault(dim, value) != value:
            return infer_dims(block, shapes, given)
    if len(dims) < len(block.dims):
        return infer_dims(block, shapes, given)
    return dims


def with_sources(e: CodaError) -> CodaError:
    """`e` with the text of the files its spans point at (so that it renders with source lines)."""
    if e.sources:
        return e
    sources = {}
    for f in {d.span.file for d in e.diagnostics if d.span is not None}:
        with contextlib.suppress(OSError):
            sources[f] = Path(f).read_text()
    return CodaError(e.diagnostics, sources) if sources else e


def _runtime_error(e: CodaError, what: str, block: Any) -> CodaError:
    diags = []
    for d in e.diagnostics:
        notes = list(d.notes) + [f"this stage is in the {what} block `{block.name}` that autograd needs (`coda grad` "
                                 "prints it); Block.vjp runs it on the interpreter"]
        diags.append(Diagnostic(d.code, d.message, d.span, d.label, notes, list(d.help), list(d.related), d.severity))
    return with_sources(CodaError(diags, e.sources))


class CudaFunction:
    """`CudaBlock.autograd()`: call with the block's inputs by name; returns the outputs by name, which
    torch.autograd differentiates through the derived backward block's kernels."""

    def __init__(self, cb: CudaBlock, wrt: list[str] | None, tile: Any):
        if isinstance(tile, dict):
            raise TypeError("autograd() takes one tile for every stage (or None), not a dict")
        d = cb.block.derivation(wrt)
        self.derivation = d
        try:
            self.forward = CudaBlock(d.forward, tile, emulate=cb.emulate, poison=cb.poison, tune=cb.tune)
        except CodaError as e:
            raise _runtime_error(e, "extended forward", d.forward) from None
        try:
            self.backward = CudaBlock(d.backward, tile, emulate=cb.emulate, poison=cb.poison, tune=cb.tune)
        except CodaError as e:
            raise _runtime_error(e, "backward", d.backward) from None
        self.params = [p.var.name for p in cb.ir.params]
        self.outputs = [o.name for o in cb.ir.outputs]
        self.needs = [p.var.name for p in d.backward.ir.params if p.var.name not in set(d.cotangents.values())]
        self.ir, self.dims = cb.ir, cb.dims
        self.forward_dims = frozenset(x.name for x in d.forward.ir.dims)
        self.backward_dims = frozenset(x.name for x in d.backward.ir.dims)

    def __call__(self, inputs: dict[str, Any] | None = None, /, *, dims: dict[str, int] | None = None,
                 **tensors: Any) -> dict[str, torch.Tensor]:
        """`dims`: sizes of the block's dims that no input's shape gives (with the CudaBlock's own);
        the backward block runs at the dims of the forward's run."""
        given = {**(inputs or {}), **tensors}
        names = tuple(n for n in self.params if n in given)
        sizes = tuple(sorted({**self.dims, **_given_dims(self.ir, dims)}.items()))
        outs = _CodaAutograd.apply(self, names, sizes, *[given[n] for n in names])
        return dict(zip(self.outputs, outs, strict=True))


class _CodaAutograd(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: CudaFunction, names: tuple[str, ...], sizes: tuple[tuple[str, int], ...],
                *vals: Any) -> tuple[torch.Tensor, ...]:
        inputs = dict(zip(names, vals, strict=True))
        res, _, dims = fn.forward._call(inputs, {k: v for k, v in sizes if k in fn.forward_dims})
        ctx.dims = {k: v for k, v in {**dict(sizes), **dims}.items() if k in fn.backward_dims}
        keep = {n: res[n] if n in res else inputs[n] for n in fn.needs if n in res or n in inputs}
        tensor_names = [n for n, v in keep.items() if isinstance(v, torch.Tensor)]
        ctx.save_for_backward(*[keep[n] for n in tensor_names])
        ctx.fn, ctx.names, ctx.tensor_names = fn, names, tensor_names
        ctx.others = {n: v for n, v in keep.items() if not isinstance(v, torch.Tensor)}
        ctx.in_dtypes = [v.dtype if isinstance(v, torch.Tensor) else None for v in vals]
        # Each output is a tensor object of its own (detach: no copy). Under torch.compile, PyTorch 2.11
        # drops the gradient of a Function output that is an intermediate passed through a no-op
        # (`x.to(x.dtype)`, `.contiguous()`, `.float()`, as `_call`, `_round` and `_compute` do): the
        # backward then ran on zero cotangents and every gradient came out zero (fixed in 2.13).
        outs = tuple(res[o].detach() for o in fn.outputs)
        ctx.out_meta = [(x.shape, x.dtype, x.device) for x in outs]
        ctx.mark_non_differentiable(*[x for x in outs if not x.is_floating_point()])
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        fn: CudaFunction = ctx.fn
        d = fn.derivation
        bins: dict[str, Any] = dict(zip(ctx.tensor_names, ctx.saved_tensors, strict=True))
        bins.update(ctx.others)
        for out, g, (shape, dtype, device) in zip(fn.outputs, grads, ctx.out_meta, strict=True):
            if out in d.cotangents:
                bins[d.cotangents[out]] = g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
        grads_out = fn.backward._call(bins, ctx.dims)[0]
        result: list[Any] = [None, None, None]
        for i, name in enumerate(ctx.names):
            g = d.grads.get(name)
            if g is None or not ctx.needs_input_grad[i + 3]:
                result.append(None)
            else:
                result.append(grads_out[g].to(ctx.in_dtypes[i]))
        return tuple(result)


__all__ = ["TORCH_DTYPES", "CudaBlock", "CudaFunction", "as_config", "choose_config", "sink_partials", "sink_rule",
           "sink_shape"]

