"""`CudaBlock`: a checked block as a callable on torch tensors, one kernel launch per GEMM stage.

What it does: `Block.cuda(tile=None)` makes one; this module composes the runtime's parts. Made, it
plans every GEMM stage (plan/planner.py: E07 for what the backend can't compile), makes each
elementwise stage (backend_triton/elementwise.py) and reads the tiles given (tiles.given_tiles:
E0805). A call binds the inputs by parameter name (binding.py), then runs the block's body in order:
each GEMM stage as one `coda::stage` launch (launch.py) at the tile given, else its first tile without
register spills (tiles.py) or, when tuning, the fastest at its GEMM shape (tuning.py); each
elementwise stage as one generated kernel; each run of vector equations between stages as one
generated kernel on a GPU where $CODA_VECTOR_RUNS=1 (backend_triton/vector_run.py; off by default:
no gain shown), else (and each equation that kernel can't take) with its op's torch stand-in
(`OpDef.lower.torch`), one by one. A
run that may consume values (an autograd backward) drops each after its last read and stores over
the buffers liveness.py hands out. `run_with_partials` also returns the
kernels' per-tile partial buffers, `values` every named value, `run_stage` runs one stage alone;
`prepare` compiles and chooses the tiles before a first call; `autograd()` gives a differentiable
function (autograd.py), whose blocks `sibling` makes. `emulate=True` runs the torch stand-ins of the
kernels (emulate.py) instead, on any device, so all of this runs without a GPU.
What it does not: plan, emit or compile (plan/, build/), check inputs (binding.py), say what a run
may overwrite (liveness.py), time tiles (tuning.py, build/tune.py), or touch quack.
Invariants: numerics follow the interpreter's (f32 inside a stage and between stages, stored tiles
rounded to their dtype, annotated values rounded where they are defined); nothing the planner
rejects runs (E07 when the CudaBlock is made); importing this module imports torch, never quack.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from coda_lang.autodiff.options import BackwardOptions
from coda_lang.backend_cute.build.config import TileConfig
from coda_lang.backend_cute.build.tune import in_background
from coda_lang.backend_cute.plan.emit import emit_stage
from coda_lang.backend_cute.plan.planner import plan_stage, read_as_stored
from coda_lang.backend_cute.plan.spec import StageSpec, dim_operand, emulate_kernel_plans, kmajor_alone_on
from coda_lang.backend_cute.runtime.autograd import CudaFunction
from coda_lang.backend_cute.runtime.binding import Binder
from coda_lang.backend_cute.runtime.capture import refuse_in_capture
from coda_lang.backend_cute.runtime.grad_scales import DelayedScaling
from coda_lang.backend_cute.runtime.launch import (
    TORCH_DTYPES,
    StageRunner,
    gemm_rows,
    sink_rule,
)
from coda_lang.backend_cute.runtime.liveness import Liveness, reads
from coda_lang.backend_cute.runtime.tiles import choose_config, first_compiled, given_tiles, precompile
from coda_lang.backend_cute.runtime.tuning import Tuner, preload_runtime
from coda_lang.backend_cute.runtime.vector_eqn import VectorStep
from coda_lang.backend_triton import KMAJOR, kmajor_key
from coda_lang.backend_triton.elementwise import ElementwiseStage
from coda_lang.backend_triton.vector_run import VectorRun, plan_runs
from coda_lang.core.diagnostics import CodaError, Diagnostic, with_sources
from coda_lang.ir.nodes import DimRef, Eqn, Stage, Var
from coda_lang.ir.types import Dim
from coda_lang.ops import REGISTRY, Locality

_NONE: frozenset[str] = frozenset()


def whole_folds(
    ir: Any, specs: list[StageSpec | None], storage: dict[str, str], fused: frozenset[int] = frozenset()
) -> dict[int, frozenset[str]]:
    """{GEMM stage: its sinks that `collect` leaves as per-tile partials}: a max (or min) sink, stored
    in f32 and no block output, whose one reader is the equation between stages that folds it by the
    same rule to a scalar (an fp8 amax: `amp = max(abs(x), over=N)` in the epilogue, then
    `max(amp, over=M)`). That equation's stand-in folds every element of what it is given, so it takes
    the partials whole: one launch, where combining them per row first was two. Max and min are exact
    in any order, so the scalar is the same. `fused`: the body indices of equations that run in a
    generated vector run (vector_run.py), which reads a vector as its type says: never taken."""
    outputs = {o.name for o in ir.outputs}
    readers: dict[str, list[Any]] = {}
    for i, item in enumerate(ir.body):
        for n in reads(item):
            readers.setdefault(n, []).append(None if i in fused else item)
    out: dict[int, frozenset[str]] = {}
    for k, spec in enumerate(specs, 1):
        names = set()
        for sk in spec.sinks if spec is not None else ():
            rule, _axis = sink_rule(sk)
            users = readers.get(sk.name, [])
            if (
                rule in ("max", "min")
                and sk.rows is None
                and sk.name not in outputs
                and storage.get(sk.name) in (None, "f32")
                and len(users) == 1
                and isinstance(users[0], Eqn)
                and users[0].op == f"reduce_{rule}"
            ):
                names.add(sk.name)
        if names:
            out[k] = frozenset(names)
    return out


def batched_folds(
    ir: Any, whole: dict[int, frozenset[str]], fused: frozenset[int]
) -> tuple[dict[int, str], frozenset[int]]:
    """({body index: the sink it folds} of the max folds `batch` runs together at the end of a run,
    the body indices of the equations that only pass their results on, run after them). A fold is
    batched when it folds a sink `collect` leaves whole (`whole_folds`: an fp8 amax's partials) and
    (or a vector folded over its one dim: an elementwise stage's amax partials, the weights') and its
    value reaches nothing but block outputs through `detach` or a copy (the amaxes a block returns for
    the next step's scales): no stage and no other equation of the run waits for it. One
    `torch._foreach_max` then folds all of them (two kernels on a GPU, where each fold was one
    launch: an fp8 Llama layer's forward folds six amaxes, its backward three). Max is exact in any
    order, so the values are the same. `fused`: equations of vector runs, never taken."""
    sinks = set().union(*whole.values()) if whole else set()
    outputs = {o.name for o in ir.outputs}
    readers: dict[str, list[Any]] = {}
    for item in ir.body:
        for n in reads(item):
            readers.setdefault(n, []).append(item)
    folds: dict[int, str] = {}
    after: set[int] = set()
    index = {id(item): i for i, item in enumerate(ir.body)}
    for i, item in enumerate(ir.body):
        if not isinstance(item, Eqn) or i in fused or len(item.ins) != 1:
            continue
        od = REGISTRY[item.op]
        if od.locality is not Locality.REDUCE or od.combine is None or od.combine.name != "max":
            continue
        src = item.ins[0]
        if not isinstance(src, Var) or len(item.outs) != 1:
            continue
        t = src.type
        # the whole fold of a GEMM stage's partials, or a vector folded over its one dim
        vector = t is not None and len(t.shape) == 1 and item.param("over") == t.shape[0]
        if src.name not in sinks and not vector:
            continue
        out = item.outs[0].name
        users = readers.get(out, [])
        if not users or out in outputs:
            continue
        passes = [
            u
            for u in users
            if isinstance(u, Eqn)
            and (REGISTRY[u.op].copy or REGISTRY[u.op].stops_gradient)  # (`y = x`, detach: its operand)
            and index[id(u)] not in fused
            and all(v.name in outputs and not readers.get(v.name) for v in u.outs)
        ]
        if len(passes) != len(users):
            continue
        folds[i] = src.name
        after.update(index[id(u)] for u in passes)
    return folds, frozenset(after)


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
        self.ir, self.plan = block.ir, block.plan
        self.binder = Binder(self.ir, dims, emulate=emulate)  # a call's inputs: checked and bound
        self.dims = self.binder.dims
        # measure the non-spilling tiles of each stage on its first launch at a shape (default: on a GPU,
        # for the stages given no tile, unless $CODA_TUNE=0)
        self.tune = (not emulate and os.environ.get("CODA_TUNE", "1") != "0") if tune is None else tune
        self.tuner = Tuner(block, emulate=emulate, poison=poison)
        self._last: dict[int, StageRunner] = {}  # the runner of each stage's latest launch
        # GEMM stages: their StageSpec; elementwise stages (no GEMM): an ElementwiseStage, spec None
        self.specs: list[StageSpec | None] = []
        self.elementwise: dict[int, ElementwiseStage] = {}
        try:
            for k, st in enumerate((s for s in self.ir.body if isinstance(s, Stage)), 1):
                if not st.is_gemm:
                    self.elementwise[k] = ElementwiseStage(block, k, emulate)
                    self.specs.append(None)
                    continue
                spec = plan_stage(block, k, emulated=emulate and not emulate_kernel_plans())
                if not emulate:  # an op the emitter can't write raises E07 now, not at the first call
                    emit_stage(spec)
                self.specs.append(spec)
        except CodaError as e:
            raise with_sources(e) from None
        self._tiles = given_tiles(self.ir.name, self.specs, tile, emulate)  # E0805 for one that does not fit
        self.tile = None if isinstance(tile, dict) else tile  # one tile for every stage: autograd() reuses it
        for s in self.ir.body:
            if not isinstance(s, Stage) and REGISTRY[s.op].lower.torch is None:
                raise CodaError(
                    [
                        Diagnostic(
                            "E0708",
                            f"`{s.op}` between stages has no torch stand-in in the CUDA runtime",
                            s.span,
                            notes=[
                                "an op's torch stand-in is its OpDef's `lower=Lowerings(torch=...)` (coda_lang/ops/)"
                            ],
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
        # each vector equation between stages, prepared once: {body index: its step} (vector_eqn.py)
        self._steps = {
            i: VectorStep(s, self._dimrefs, self._sizes)
            for i, s in enumerate(self.ir.body)
            if not isinstance(s, Stage)
        }
        # runs of consecutive vector equations, each one generated kernel on a GPU (vector_run.py):
        # {body index of its first equation: the run}, and each of its equations' index -> that first
        self._runs: dict[int, VectorRun] = {}
        self._run_of: dict[int, int] = {}
        # Off by default: no gain shown. On H200s (2026-11-27), launched through the compiled kernel's
        # own launcher, three same-process A/Bs of the fp8 Llama-3.2-1B step gave -4.4 to +6.2 ms with
        # them, within the +-10 ms the steps vary by with the host's speed (vector_run.py).
        # $CODA_VECTOR_RUNS=1 turns them on.
        if not emulate and os.environ.get("CODA_VECTOR_RUNS", "0") == "1":
            for first, idx in plan_runs(self.ir.body).items():
                eqns = [self.ir.body[i] for i in idx]
                self._runs[first] = VectorRun(eqns, self._dimrefs, self.ir.name, first)
                self._run_of.update(dict.fromkeys(idx, first))
        # values a GEMM stage reads as a K-major copy (an fp8 operand read transposed: spec.Gemm's
        # copy_a / copy_b): the stage that makes one may write that copy too (launch.kmajor_key)
        self._kmajor = frozenset(
            name
            for spec in self.specs
            if spec is not None
            for name, copy in ((spec.gemm.a, spec.gemm.copy_a), (spec.gemm.b, spec.gemm.copy_b))
            if copy
        )
        # of those, the values nothing reads as they are stored (every reader a GEMM taking the copy,
        # none a block output): an elementwise stage that writes the copy stores it alone
        # (TritonStage.kmajor_stores' ALONE; a GEMM stage's plan decides its own, Output.alone)
        self._alone = self._kmajor - self._read_as_stored() if kmajor_alone_on() else frozenset()
        self._ready = False
        self._precompiled = False  # tiles.precompile: this block's kernels were compiled at once
        self._compile_with: list[CudaBlock] = []
        # what each statement reads last, and what a consuming run (an autograd backward) may overwrite
        self.liveness = Liveness(self.ir)
        self._whole = whole_folds(self.ir, self.specs, self.plan.storage, frozenset(self._run_of))
        self._folds, self._after = batched_folds(self.ir, self._whole, frozenset(self._run_of))

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
        """{stage: (tile_M, tile_N)} of the GEMM stages: what `Block.run(..., sim_tile=cb.tiles)` simulates."""
        return {k: (self.config(k).tile_m, self.config(k).tile_n) for k in self.gemm_stages}

    def launched(self, index: int) -> StageRunner:
        """The runner of stage `index`'s latest launch (with tuning: the tile measured fastest at that
        shape), else `runner(index)`."""
        return self._last.get(index) or self.runner(index)

    def _read_as_stored(self) -> set[str]:
        """planner.read_as_stored of the block, each GEMM stage's copies as its plan takes them."""
        stages = [s for s in self.ir.body if isinstance(s, Stage)]
        plans = {id(st): spec for st, spec in zip(stages, self.specs, strict=True)}

        def copies(st: Stage) -> tuple[bool, bool]:
            spec = plans[id(st)]
            return (spec.gemm.copy_a, spec.gemm.copy_b) if spec is not None else (False, False)

        return read_as_stored(self.ir.body, self.ir.outputs, copies)

    def runner(self, index: int) -> StageRunner:
        r = self._runners.get(index)
        if r is None:
            spec = self.specs[index - 1]
            if spec is None:
                raise ValueError(
                    f"stage {index} of {self.name} is elementwise: it has no GEMM kernel or tile"
                )
            cfg = self._tiles.get(index)
            bg = self.tuner.background
            if cfg is None and bg is not None and not bg.over:
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
            preload_runtime()
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
        `%NAME`): what `run_stage` reads. (Not the K-major copies some stages write beside a value.)"""
        env = self._run({**(inputs or {}), **tensors}, dims)[0]
        return {k: v for k, v in env.items() if not k.endswith(KMAJOR)}

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
            sizes = self.binder.sizes(shapes, self.binder.given(dims))
            self.elementwise[index].run({**env}, sizes, self.plan.storage, out=new)
            return new, partials
        r = self.runner(index)
        ins, scalars = r.arguments(env)
        outs = r.call(ins, scalars)
        r.collect(outs, new, partials, self.plan.storage, rows=gemm_rows(ins[0]))
        return new, partials

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
        a stage that loads one of `consume`, read by nothing after it, may store over its buffer
        instead of a new one (liveness.py: a packed stage's D over its C operand, through
        `coda::stage_into`, or a running total; an elementwise stage's tile over a tile it loads)."""
        env, dims, device = self.binder.bind(tensors, self.binder.given(given))
        env.update({dim_operand(k): v for k, v in dims.items()})  # a dim used as a value inside a stage
        if not self._ready:
            refuse_in_capture(
                f"block {self.name}'s first call (compiling and choosing its kernels)",
                "run the step once (eagerly, as PyTorch's recipe for capturing does on a side stream) before capturing it",
            )
            self.prepare(background=not torch.compiler.is_compiling())
        partials: dict[str, torch.Tensor] = {}
        k = 0
        fused = False  # the current run of vector equations ran as one kernel
        # (body index, partial buffer) of the amax folds run together at the end (`batched_folds`);
        # not under a torch.compile trace, which fuses such folds itself
        batch: list[tuple[int, torch.Tensor]] = []
        batching = bool(self._folds) and not torch.compiler.is_compiling()
        for i, s in enumerate(self.ir.body):
            if batching and (i in self._folds or i in self._after):
                if i in self._folds:
                    batch.append((i, env[self._folds[i]]))
            elif isinstance(s, Stage):
                k += 1
                if k in self.elementwise:
                    es = self.elementwise[k]
                    over = self.liveness.into_loads(es, i, env, consume) if consume else None
                    es.run(env, dims, self.plan.storage, into=over, kmajor=self._kmajor, alone=self._alone)
                else:
                    r = self.runner(k)
                    ins, scalars = r.arguments(env)
                    if self.tune and k not in self._tiles:
                        r = self.tuner.tuned(k, r, ins, scalars)
                    if not torch.compiler.is_compiling():  # (a side effect a traced Function can't hold)
                        self._last[k] = r
                    into = self.liveness.into(r.spec, i, env, consume) if consume is not None else None
                    outs = r.call(ins, scalars, into)
                    r.collect(
                        outs,
                        env,
                        partials,
                        self.plan.storage,
                        self._kmajor,
                        self._whole.get(k, _NONE),
                        gemm_rows(ins[0]),
                    )
            else:
                first = self._run_of.get(i)
                if first == i:
                    fused = not torch.compiler.is_compiling() and self._runs[i](env, dims, device)
                if first is None or not fused:
                    self._steps[i](env, dims, device)
            if consume is not None:
                for n in self.liveness.dead_after[i]:
                    env.pop(n, None)
                    env.pop(kmajor_key(n), None)
        if batch:
            for (i, _), v in zip(batch, torch._foreach_max([b for _, b in batch]), strict=True):
                self._steps[i].bind(env, v, device)
            for i in sorted(self._after):
                self._steps[i](env, dims, device)
        return env, partials, dims

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
        grad_scales: DelayedScaling | None = None,
    ) -> CudaFunction:
        """A function of the block's inputs (by name) whose outputs are differentiable by torch.autograd:
        forward = the extended forward block, backward = the derived backward block, both on CUDA, at
        `tile` (default: this block's own, when it was given one tile for every stage), tuned as this
        block is. The backward's options are one `BackwardOptions` (`backward=`) or its fields as
        keywords (`remat=`, `chunk=`, `budget=`, `chunk_dim=`), as `Block.vjp` takes them: what the
        backward recomputes, and whether it runs in chunks of one dim (docs/design.md, "Chunked
        backward"). With `fp8_grads=` (the backward's cotangents in fp8), `grad_scales` is the
        `DelayedScaling` that keeps their delayed scales (required: ValueError without it; a call may
        name another, one per call site). CodaError (E07) when a stage of either can't run on the
        GPU yet, E0809 for a backward that can't run in chunks; TypeError or ValueError for a bad
        argument."""
        options = BackwardOptions.of(backward, remat=remat, chunk=chunk, budget=budget, chunk_dim=chunk_dim)
        return CudaFunction(self, wrt, tile if tile is not None else self.tile, options, grad_scales)
