"""`CudaBlock`: a checked block as a callable on torch tensors, one kernel launch per GEMM stage.

What it does: `Block.cuda(tile=None)` makes one. A call binds the inputs by parameter name (dtypes,
devices, dims from the shapes: interp/inputs.py's rules, which the interpreter uses too), runs each
GEMM stage as one `coda::stage` launch (launch.py) at the tile given, or else the fastest of the tiles
without register spills, measured on the stage's first launch at a GEMM shape and cached on disk
(tune.py), runs an elementwise stage as one torch.compile'd kernel (elementwise.py), and computes the
vector equations between stages with each op's torch stand-in (`OpDef.torch`). `run_with_partials`
also returns the kernels' per-tile partial buffers; `autograd()` gives a differentiable function
(autograd.py). `emulate=True` runs the torch stand-ins of the kernels (emulate.py) instead, on any
device, so all of this runs without a GPU.
What it does not: plan, emit or compile (planner.py, emit.py, compile.py) or touch quack.
Invariants: numerics follow the interpreter's (f32 inside a stage and between stages, stored tiles
rounded to their dtype, annotated values rounded where they are defined); nothing the planner
rejects runs (E07 when the CudaBlock is made); importing this module imports torch, never quack.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from coda_lang.autodiff.options import BackwardOptions
from coda_lang.backend_cute.build import select
from coda_lang.backend_cute.build.config import TileConfig, broken
from coda_lang.backend_cute.plan.emit import emit_stage
from coda_lang.backend_cute.plan.planner import plan_stage
from coda_lang.backend_cute.plan.spec import StageSpec, dim_operand
from coda_lang.backend_cute.runtime.autograd import CudaFunction
from coda_lang.backend_cute.runtime.launch import (
    HALF_DTYPES,
    TORCH_DTYPES,
    StageRunner,
    compute_value,
    dense,
    round_value,
)
from coda_lang.backend_cute.runtime.tiles import as_config, choose_config, find_ptxas, first_compiled
from coda_lang.backend_triton.elementwise import ElementwiseStage
from coda_lang.core.diagnostics import CodaError, Diagnostic, error, with_sources
from coda_lang.frontend.verify.repeat import check_repeats, repeat_uses
from coda_lang.interp.inputs import dims_from_shapes, given_dims, shape_rules
from coda_lang.ir.nodes import DimRef, Eqn, Lit, Stage, Var
from coda_lang.ir.types import MATRIX, Dim
from coda_lang.ops import REGISTRY

if TYPE_CHECKING:
    from coda_lang.backend_cute.build.parallel import Background


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

    def __init__(
        self,
        block: Any,
        tile: Any = None,
        *,
        emulate: bool = False,
        poison: bool = False,
        tune: bool | None = None,
        dims: dict[str, int] | None = None,
    ):
        self.block, self.emulate, self.poison = block, emulate, poison
        self.dims = given_dims(block.ir, dims)
        # measure the non-spilling tiles of each stage on its first launch at a shape (default: on a GPU,
        # for the stages given no tile, unless $CODA_TUNE=0)
        self.tune = (not emulate and os.environ.get("CODA_TUNE", "1") != "0") if tune is None else tune
        self._by_shape: dict[tuple[int, int, int, int], StageRunner] = {}  # (stage, m, n, k) -> tuned
        self._last: dict[int, StageRunner] = {}  # the runner of each stage's latest launch
        self.ir, self.plan = block.ir, block.plan
        self._shape_rules = shape_rules(self.ir)
        # GEMM stages: their StageSpec; elementwise stages (no GEMM): an ElementwiseStage, spec None
        self.specs: list[StageSpec | None] = []
        self.elementwise: dict[int, ElementwiseStage] = {}
        try:
            for k, st in enumerate((s for s in self.ir.body if isinstance(s, Stage)), 1):
                if not st.is_gemm:
                    self.elementwise[k] = ElementwiseStage(block, k, emulate)
                    self.specs.append(None)
                    continue
                spec = plan_stage(block, k, emulated=emulate)
                if not emulate:  # an op the emitter can't write raises E07 now, not at the first call
                    emit_stage(spec)
                self.specs.append(spec)
        except CodaError as e:
            raise with_sources(e) from None
        gemms = [k for k, spec in enumerate(self.specs, 1) if spec is not None]
        if isinstance(tile, dict):
            self._tiles = {int(k): as_config(v) for k, v in tile.items()}
            unknown = sorted(set(self._tiles) - set(gemms))
            if unknown:
                raise ValueError(
                    f"stage {unknown[0]} of block {self.ir.name} is elementwise: it has no tile"
                    if unknown[0] in self.elementwise
                    else f"block {self.ir.name} has no stage {unknown[0]}"
                )
        else:
            self._tiles = {k: as_config(tile) for k in gemms} if tile is not None else {}
        self.tile = None if isinstance(tile, dict) else tile  # one tile for every stage: autograd() reuses it
        for k, cfg in self._tiles.items():
            target = self.specs[k - 1]
            assert target is not None
            why = broken(target, cfg, self.emulate)
            if why:
                raise error(
                    "E0805",
                    f"tile {cfg.short} does not fit stage {k} (`{target.text}`): {'; '.join(map(str, why))}",
                )
        for s in self.ir.body:
            if not isinstance(s, Stage) and REGISTRY[s.op].torch is None:
                raise CodaError(
                    [
                        Diagnostic(
                            "E0708",
                            f"`{s.op}` between stages has no torch stand-in in the CUDA runtime",
                            s.span,
                            notes=["an op's torch stand-in is its OpDef's `torch=` (coda_lang/ops/)"],
                        )
                    ]
                )
        self._runners: dict[int, StageRunner] = {}
        # (first output, argument position) -> (dim name, numerator, denominator) of each dim used as a
        # value between stages, so that no Fraction is touched while a call is traced
        self._dimrefs = {
            (s.outs[0].name, i): (a.dim.name, a.dim.coeff.numerator, a.dim.coeff.denominator)
            for s in self.ir.body
            if not isinstance(s, Stage)
            for i, a in enumerate(s.ins)
            if isinstance(a, DimRef)
        }
        # (first output) -> G as (dim name, numerator, denominator) of each fold(x, into=G) between stages
        self._sizes = {
            s.outs[0].name: (d.name, d.coeff.numerator, d.coeff.denominator)
            for s in self.ir.body
            if not isinstance(s, Stage) and isinstance(d := s.param("into"), Dim)
        }
        # vectors over a fixed dim that repeat across columns: a run's sizes must hold whole copies
        self._repeats = repeat_uses(self.ir)
        self._ready = False
        self._precompiled = False  # tiles.precompile: this block's kernels were compiled at once
        self._background: Background | None = None  # the tuner's candidates still compiling, if any
        self._compile_with: list[CudaBlock] = []
        # the body item (statement index) of each value's last read (block outputs are never dead), and
        # the values whose last read is each item: what a consuming run drops after it
        self._last_read: dict[str, int] = {}
        for i, item in enumerate(self.ir.body):
            for n in _reads(item):
                self._last_read[n] = i
        for o in self.ir.outputs:
            self._last_read[o.name] = len(self.ir.body)
        self._dead_after: list[list[str]] = [[] for _ in self.ir.body]
        for n, i in self._last_read.items():
            if i < len(self.ir.body):
                self._dead_after[i].append(n)

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

    def launched(self, index: int) -> StageRunner:
        """The runner of stage `index`'s latest launch (with tuning: the tile measured fastest at that
        shape), else `runner(index)`."""
        return self._last.get(index) or self.runner(index)

    def runner(self, index: int) -> StageRunner:
        r = self._runners.get(index)
        if r is None:
            spec = self.specs[index - 1]
            if spec is None:
                raise ValueError(
                    f"stage {index} of {self.name} is elementwise: it has no GEMM kernel or tile"
                )
            cfg = self._tiles.get(index)
            if cfg is None and self._background is not None and not self._background.over:
                cfg = first_compiled(spec)  # (the others may still be compiling; the tuner picks later)
            cfg = cfg or choose_config(self.block, index, spec, self.emulate)
            r = self._runners[index] = StageRunner(self.block, index, spec, cfg, self.emulate, self.poison)
        return r

    def compile_with(self, *others: CudaBlock) -> None:
        """Compile these blocks' kernels together with this block's, at its first call (an autograd
        function's backward with its forward: one parallel compile of both, tiles.precompile)."""
        self._compile_with = [*self._compile_with, *others]

    @torch.compiler.disable
    def prepare(self, background: bool = False) -> CudaBlock:
        """Choose every stage's tile and import its epilogue now (a first call does it otherwise); the
        kernels of every stage (and of the blocks given to `compile_with`) are compiled first, at once.
        `background` (a first call's, unless $CODA_TUNE is `wait` or `full`): return once every stage has
        a kernel without spills (its first such tile, or any compiled by then: tiles.first_compiled);
        the tuner's other candidates compile on, and once they are all compiled each stage is timed
        at its next launch (until then it runs at that tile)."""
        if not self.emulate:
            from coda_lang.backend_cute.build.tune import in_background
            from coda_lang.backend_cute.runtime.tiles import precompile

            _preload_runtime()
            precompile([self, *self._compile_with], background=background and self.tune and in_background())
        for k in self.gemm_stages:
            r = self.runner(k)
            if not self.emulate:
                r.mod  # noqa: B018 (imports quack and the emitted module)
        self._ready = True
        return self

    # -- running ------------------------------------------------------------------------------

    def __call__(
        self, inputs: dict[str, Any] | None = None, /, *, dims: dict[str, int] | None = None, **tensors: Any
    ) -> dict[str, torch.Tensor]:
        return self.run_with_partials(inputs, dims=dims, **tensors)[0]

    def run_with_partials(
        self, inputs: dict[str, Any] | None = None, /, *, dims: dict[str, int] | None = None, **tensors: Any
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Outputs by name, and every stage's partial buffers by the name of the reduction, as the
        kernel wrote them (row partials [m, ceil(n/tile_N)], column partials [ceil(m/tile_M), n]; a
        pick gives its finished [m] vector). `dims`: sizes of dims (with the CudaBlock's own `dims`)."""
        outs, partials, _ = self._call({**(inputs or {}), **tensors}, dims)
        return outs, partials

    def values(
        self, inputs: dict[str, Any] | None = None, /, *, dims: dict[str, int] | None = None, **tensors: Any
    ) -> dict[str, Any]:
        """Every named value of a run (inputs as bound, stored tiles, vectors, and each dim's size under
        `%NAME`): what `run_stage` reads."""
        return self._run({**(inputs or {}), **tensors}, dims)[0]

    def run_stage(
        self, index: int, env: dict[str, Any], dims: dict[str, int] | None = None
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Stage `index` alone (one kernel launch plus its partial combines; an elementwise stage: its
        fused kernel) on the values in `env`: (the values it defines, its partial buffers)."""
        new: dict[str, Any] = {}
        partials: dict[str, torch.Tensor] = {}
        if index in self.elementwise:
            shapes = {
                p.var.name: tuple(env[p.var.name].shape)
                for p in self.ir.params
                if isinstance(env.get(p.var.name), torch.Tensor)
            }
            sizes = dims_from_shapes(self.ir, self._shape_rules, shapes, self._given(dims))
            self.elementwise[index].run({**env}, sizes, self.plan.storage, out=new)
            return new, partials
        r = self.runner(index)
        ins, scalars = r.arguments(env)
        outs = r.call(ins, scalars)
        r.collect(outs, new, partials, self.plan.storage)
        return new, partials

    def _given(self, dims: dict[str, int] | None) -> dict[str, int]:
        """The dims given to a call, with the CudaBlock's own."""
        return {**self.dims, **given_dims(self.ir, dims)} if dims else self.dims

    def _call(
        self, tensors: dict[str, Any], dims: dict[str, int] | None, consume: frozenset[str] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, int]]:
        """(outputs by name in their dtypes, partial buffers, the dims of the run); `consume` as `_run`."""
        env, partials, sizes = self._run(tensors, dims, consume)
        outs = {}
        for o in self.ir.outputs:
            x = env[o.name]
            if isinstance(x, torch.Tensor) and x.dtype != TORCH_DTYPES[o.type.dtype]:
                x = x.to(TORCH_DTYPES[o.type.dtype])
            outs[o.name] = x
        return outs, partials, sizes

    def _run(
        self,
        tensors: dict[str, Any],
        given: dict[str, int] | None = None,
        consume: frozenset[str] | None = None,
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, int]]:
        """Run the block. `consume` (an autograd backward: the forward's saved intermediates, which
        nothing else reads): each value is dropped from the run's environment after its last read, and
        a packed stage whose C operand is one of `consume`, read by nothing after it, writes its D into
        C's buffer (`coda::stage_into`) instead of a new one."""
        env, dims, device = self._bind(tensors, self._given(given))
        env.update({dim_operand(k): v for k, v in dims.items()})  # a dim used as a value inside a stage
        if not self._ready:
            self.prepare(background=not torch.compiler.is_compiling())
        partials: dict[str, torch.Tensor] = {}
        k = 0
        for i, s in enumerate(self.ir.body):
            if isinstance(s, Stage):
                k += 1
                if k in self.elementwise:
                    es = self.elementwise[k]
                    over = self._into_loads(es, i, env, consume) if consume else None
                    es.run(env, dims, self.plan.storage, into=over)
                else:
                    r = self.runner(k)
                    ins, scalars = r.arguments(env)
                    if self.tune and k not in self._tiles:
                        r = self._tuned(k, r, ins, scalars)
                    if not torch.compiler.is_compiling():  # (a side effect a traced Function can't hold)
                        self._last[k] = r
                    into = self._into(r.spec, i, env, consume) if consume is not None else None
                    outs = r.call(ins, scalars, into)
                    r.collect(outs, env, partials, self.plan.storage)
            else:
                self._vector_eqn(s, env, dims, device)
            if consume is not None:
                for n in self._dead_after[i]:
                    env.pop(n, None)
        return env, partials, dims

    def _into(
        self, spec: StageSpec, i: int, env: dict[str, Any], consume: frozenset[str]
    ) -> torch.Tensor | None:
        """The buffer a stage may write its D into: that of the tile it loads at D's coordinates (a
        packed stage's C operand, or a TileLoad of D's shape: a running total `acc + total`) when
        that tile is consumable, read by nothing after this stage, and of D's dtype. Each tile of the
        GEMM loads its subtile of that input before it stores its D there, and no two tiles share
        elements, so the kernel reads every element before it overwrites it."""
        d = spec.d
        if d is None:
            return None
        src = spec.c
        if src is None:
            src = next(
                (o for o in spec.operands if o.role == "tile" and o.name in consume and o.shape == d.shape),
                None,
            )
        if src is None:
            return None
        t = self._overwritable(src.name, d.dtype, i, env, consume)
        if t is None or t.data_ptr() % 16:
            return None
        return t

    def _into_loads(
        self, es: Any, i: int, env: dict[str, Any], consume: frozenset[str]
    ) -> dict[str, torch.Tensor] | None:
        """Buffers an elementwise stage may store its tiles over: for each stored tile, a tile it
        loads of the same shape and dtype that is consumable and read by nothing after it (the loss
        head's backward writes dlogits over the logits it saved)."""
        over: dict[str, torch.Tensor] = {}
        taken: set[str] = set()
        for name, dtype, shape in es.stores:
            for ld in es.loads:
                if ld.role != "tile" or ld.name in taken or ld.shape != shape or ld.dtype != dtype:
                    continue
                t = self._overwritable(ld.name, dtype, i, env, consume)
                if t is not None:
                    over[name] = t
                    taken.add(ld.name)
                    break
        return over or None

    def _overwritable(
        self, name: str, dtype: str, i: int, env: dict[str, Any], consume: frozenset[str]
    ) -> torch.Tensor | None:
        """Value `name`'s tensor when statement i may store a `dtype` tile over it: it is consumable,
        read by nothing after statement i, contiguous and of that dtype."""
        if name not in consume or self._last_read.get(name) != i:
            return None
        t = env.get(name)
        if not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.dtype != TORCH_DTYPES[dtype]:
            return None
        return t

    def _tuned(
        self, k: int, r: StageRunner, ins: list[torch.Tensor | None], scalars: list[float]
    ) -> StageRunner:
        """Stage k's runner at the fastest non-spilling tile for this GEMM shape: from this block's
        memory, else the tuning cache on disk, else measured now on these very arguments."""
        A, B = ins[0], ins[1]
        assert A is not None and B is not None
        spec = r.spec
        n = B.shape[0] if spec.gemm.tb else B.shape[1]
        key = (k, int(A.shape[0]), int(n), int(A.shape[1]))
        got = self._by_shape.get(key)
        if got is None:
            got, final = self._measure(k, r, ins, scalars, key, torch.compiler.is_compiling())
            if final:
                self._by_shape[key] = got
        return got

    @torch.compiler.disable
    def _measure(
        self,
        k: int,
        r: StageRunner,
        ins: list[torch.Tensor | None],
        scalars: list[float],
        key: tuple[int, int, int, int],
        wait: bool = False,
    ) -> tuple[StageRunner, bool]:
        """(the runner to launch, whether it is this shape's final choice). While kernels of its
        compile are still compiling in the background: the stage's first compiled tile, not final
        (timings taken while the workers load every CPU are not to be trusted; `wait`: under a
        torch.compile trace, whose graph keeps what it is given, wait for them instead)."""
        bg = self._background
        if bg is not None and not bg.over:
            if not wait:
                return r, False
            bg.wait()
        return self._choose(k, r, ins, scalars, key), True

    def _choose(
        self,
        k: int,
        r: StageRunner,
        ins: list[torch.Tensor | None],
        scalars: list[float],
        key: tuple[int, int, int, int],
    ) -> StageRunner:
        from coda_lang.backend_cute.build import tune

        spec = r.spec
        A = ins[0]
        assert A is not None
        source, shape, device = emit_stage(spec), key[1:], torch.cuda.get_device_name(A.device)
        disk = tune.disk_key(source, shape, device)
        cached = tune.lookup(disk)
        if cached is None:
            if not find_ptxas():
                return r
            from coda_lang.core.progress import Progress

            hung = tune.hung(source, device)
            configs, skipped = tune.prune(
                [c for c in select.configs_without_spills(spec) if c not in hung], source, shape, device
            )
            runners = {
                c: r if c == r.config else StageRunner(self.block, k, spec, c, self.emulate, self.poison)
                for c in configs
            }

            def launch(x: StageRunner) -> Callable[[], Any]:
                return lambda: torch.ops.coda.stage(x.key, ins, scalars)

            what = f"coda: tuning stage {k} of {self.name} at {'x'.join(map(str, shape))}"
            with Progress(what, len(runners) * tune.BATCHES, unit="batches") as progress:
                progress.extra = f"{len(runners)} tiles" + (f", {skipped}" if skipped else "")
                try:
                    times = tune.measure({c: launch(x) for c, x in runners.items()}, progress=progress)
                except tune.KernelHang as e:
                    tune.store_hung(source, device, e.config)
                    raise error(
                        "E0810",
                        f"stage {k} of {self.name} (`{spec.text}`) at tile {tune.label(e.config)} did not "
                        f"finish within {e.seconds:g} s on the GPU ({device}): the kernel hangs",
                        notes=[
                            f"the tile is recorded as hung in {tune.cache_file()} and is not tried again: "
                            "run again in a new process",
                            "the GPU stays busy with the kernel until this process exits",
                            "please report it with the stage's epilogue: `coda compile FILE --emit source --backward`",
                        ],
                    ) from None
            if not times:
                return r
            cached = min(times, key=lambda c: times[c])
            tune.store(disk, cached, times, source=source, shape=shape, device=device)
            return runners[cached]
        return (
            r if cached == r.config else StageRunner(self.block, k, spec, cached, self.emulate, self.poison)
        )

    def _vector_eqn(self, e: Eqn, env: dict[str, Any], dims: dict[str, int], device: torch.device) -> None:
        vals = []
        upcast = (
            e.outs[0].type is None or e.outs[0].type.kind != MATRIX
        )  # a matrix alias stays the same tensor
        for a in e.ins:
            if isinstance(a, Var):
                x = env[
                    a.name
                ]  # a 16-bit parameter is bound in its dtype: computed in f32, as the interpreter does
                vals.append(
                    x.float() if upcast and isinstance(x, torch.Tensor) and x.dtype in HALF_DTYPES else x
                )
            elif isinstance(a, Lit):
                vals.append(a.value)
            else:  # a dim as a value: integer arithmetic on plain ints (torch.compile traces this)
                name, num, den = self._dimrefs[(e.outs[0].name, len(vals))]
                vals.append((dims[name] if name is not None else 1) * num // den)
        params = {k: v for k, v in e.params if not isinstance(v, Dim)}
        od = REGISTRY[e.op]
        stand_in = od.torch
        assert stand_in is not None  # checked when the CudaBlock was made (E0708)
        if od.locality == "vector":  # fold(x, into=G): its stand-in takes G's size
            name, num, den = self._sizes[e.outs[0].name]
            res = stand_in(*vals, (dims[name] if name is not None else 1) * num // den)
        else:
            res = stand_in(*vals, **params)
        res_t = res if isinstance(res, tuple) else (res,)
        for v, x in zip(e.outs, res_t, strict=True):
            x = compute_value(x, v.type, device)
            env[v.name] = round_value(x, v.annot) if v.annot else x

    def _bind(
        self, tensors: dict[str, Any], given: dict[str, int]
    ) -> tuple[dict[str, Any], dict[str, int], torch.device]:
        names = {p.var.name for p in self.ir.params}
        unknown = sorted(set(tensors) - names)
        if unknown:
            raise error(
                "E0801",
                f"unknown input `{unknown[0]}`; the block's parameters are {', '.join(sorted(names))}",
            )
        env: dict[str, Any] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        device: torch.device | None = None
        for p in self.ir.params:
            name, t = p.var.name, p.var.type
            assert t is not None
            if name not in tensors:
                if p.default is None:
                    raise error("E0801", f"missing input `{name}`")
                env[name] = p.default
                continue
            v = tensors[name]
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not t.shape:
                if t.dtype == "i32" and not isinstance(v, int):
                    raise error("E0803", f"input `{name}` is {v!r}, but it is declared i32")
                # a 16-bit scalar rounded to its dtype, as the interpreter binds it
                env[name] = (
                    int(v)
                    if t.dtype == "i32"
                    else (
                        float(torch.tensor(float(v)).to(TORCH_DTYPES[t.dtype]))
                        if t.dtype in ("bf16", "f16")
                        else float(v)
                    )
                )
                continue
            if not isinstance(v, torch.Tensor):
                raise error(
                    "E0803", f"input `{name}` is a {type(v).__name__}; the CUDA runtime takes torch tensors"
                )
            if device is None:
                device = v.device
            elif v.device != device:
                raise error("E0806", f"input `{name}` is on {v.device}, but other inputs are on {device}")
            if t.dtype == "i32":
                if v.is_floating_point() or v.is_complex() or v.dtype == torch.bool:
                    raise error("E0803", f"input `{name}` is {v.dtype}, but it is declared i32")
            elif not (v.is_floating_point() or (v.dim() == 0 and v.dtype != torch.bool)):
                raise error("E0803", f"input `{name}` is {v.dtype}, but it is declared {t.dtype}")
            shapes[name] = tuple(v.shape)
            env[name] = dense(v, TORCH_DTYPES[t.dtype])
        if device is None:
            raise error("E0801", "no tensor inputs")
        if not self.emulate and device.type != "cuda":
            raise error(
                "E0806",
                f"inputs are on {device}; the CUDA runtime needs CUDA tensors",
                notes=["Block.run runs the interpreter on CPU tensors"],
            )
        dims = dims_from_shapes(self.ir, self._shape_rules, shapes, given)
        if self._repeats:
            check_repeats(self._repeats, dims)
        return env, dims, device

    # -- autograd -----------------------------------------------------------------------------

    def sibling(self, block: Any, tile: Any = None) -> CudaBlock:
        """A CUDA block of another checked block with this one's settings (emulated or not, poisoned
        outputs, tuning): the blocks an autograd function runs (its extended forward, its backward, the
        chunked backwards)."""
        return CudaBlock(block, tile, emulate=self.emulate, poison=self.poison, tune=self.tune)

    def autograd(
        self,
        wrt: list[str] | None = None,
        *,
        tile: Any = None,
        backward: BackwardOptions | None = None,
        remat: str | None = None,
        chunk: int | str | None = None,
        budget: int | None = None,
        chunk_dim: str | None = None,
    ) -> CudaFunction:
        """A function of the block's inputs (by name) whose outputs are differentiable by torch.autograd:
        forward = the extended forward block, backward = the derived backward block, both on CUDA, at
        `tile` (default: this block's own, when it was given one tile for every stage), tuned as this
        block is. The backward's options are one `BackwardOptions` (`backward=`) or its fields as
        keywords (`remat=`, `chunk=`, `budget=`, `chunk_dim=`), as `Block.vjp` takes them: what the
        backward recomputes, and whether it runs in chunks of one dim (docs/design.md, "Chunked
        backward"). CodaError (E07) when a stage of either can't run on the GPU yet, E0809 for a
        backward that can't run in chunks; TypeError or ValueError for a bad argument."""
        options = BackwardOptions.of(backward, remat=remat, chunk=chunk, budget=budget, chunk_dim=chunk_dim)
        return CudaFunction(self, wrt, tile if tile is not None else self.tile, options)


_PRELOAD: threading.Thread | None = None


def _preload_runtime() -> None:
    """Import the kernels' runtime (CuTeDSL, quack, and the parts of torch they import: seconds) in a
    thread, while this one waits for the compile workers; the first launch imports it otherwise."""
    global _PRELOAD
    if _PRELOAD is None and "quack.epilogue.frontend" not in sys.modules:
        _PRELOAD = threading.Thread(target=_import_runtime, name="coda-import", daemon=True)
        _PRELOAD.start()


def _import_runtime() -> None:
    import importlib

    with contextlib.suppress(Exception):  # (a missing toolchain: the launch that needs it says so)
        for name in (
            "coda_lang.backend_cute.build.quack_adapter",
            "quack.epilogue.frontend",
        ):  # (in this order)
            importlib.import_module(name)


def _reads(item: Any) -> set[str]:
    """The names a body item (a stage or a vector equation) reads."""
    if isinstance(item, Stage):
        names = {a.name for a in (item.a, item.b) if isinstance(a, Var)}
        names |= {a.name for e in item.body for a in e.ins if isinstance(a, Var)}
        return names - {"acc"} - {v.name for e in item.body for v in e.outs}
    return {a.name for a in item.ins if isinstance(a, Var)}
