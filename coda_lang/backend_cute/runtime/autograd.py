"""`CudaBlock.autograd()`: a block's outputs differentiable by torch.autograd through the derived backward.

What it does: `CudaFunction` holds the CUDA blocks of the extended forward (`Block.derivation()
.forward`: the forward that also stores what the backward reads) and of the derived backward block;
its `torch.autograd.Function` runs the first in `forward`, keeps the saved tensors, and runs the second
in `backward` with the incoming cotangents, returning each input's gradient in its dtype.
What it does not: derive anything (autodiff/ does) or launch kernels itself (cuda_block.py, whose
`CudaBlock.sibling` makes the blocks it runs, so this module needs no import of it). A
`BackwardOptions` with `chunk=`/`budget=`/`chunk_dim=` runs the backward in chunks of one dim, rows
of M or columns of V (autodiff/chunk.py decides how, picks the dim for "auto", and refuses blocks
that can't; its transient tiles are then bounded by the chunk).
Invariants: the backward runs at the dims of the forward's call; an output nobody differentiates gets a
zero cotangent; an input name the block does not have is E0801 and inputs (cotangents too) whose
shapes disagree are E0804/E0802 before anything runs, chunked or not: nothing is dropped or sliced to
fit; there is no double backward (`create_graph=True` is refused: never a silent first-order one); a stage either block can't compile is E07 when the function is made, naming the block;
chunked and unchunked backwards agree up to the order of f32 summation.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from coda_lang.autodiff.chunk import ChunkPlan, candidate_plans, choose, row_dim
from coda_lang.autodiff.chunk_run import ChunkResults, chunk_at, chunk_inputs, join_part, run_chunks
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.backend_cute.runtime.capture import refuse_in_capture
from coda_lang.backend_cute.runtime.grad_scales import DelayedScaling, check_grad_scales
from coda_lang.backend_cute.runtime.launch import TORCH_DTYPES
from coda_lang.backend_cute.runtime.split_epilogue import split_epilogues, split_selection
from coda_lang.core.diagnostics import CodaError, Diagnostic, error, with_sources
from coda_lang.interp.inputs import given_dims
from coda_lang.ir.types import extent, shape_str
from coda_lang.ops.registry import torch_store


class CudaBlock(Protocol):
    """What this module asks of a CUDA block (runtime/cuda_block.py's `CudaBlock`, which imports this
    module): named here so that the two do not import each other."""

    block: Any  # the checked block (api.Block: its derivation and chunk plans)
    ir: Any
    dims: dict[str, int]
    specs: list[Any]
    binder: Any  # its inputs' checks (runtime/binding.py's Binder)

    @property
    def name(self) -> str: ...

    def sibling(self, block: Any, tile: Any = None) -> CudaBlock: ...

    def compile_with(self, *others: Any) -> None: ...

    def _call(
        self, tensors: dict[str, Any], dims: dict[str, int] | None, consume: frozenset[str] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, int]]: ...


def _runtime_error(e: CodaError, what: str, block: Any) -> CodaError:
    diags = []
    for d in e.diagnostics:
        notes = list(d.notes) + [
            f"this stage is in the {what} block `{block.name}` that autograd needs (`coda grad` "
            "prints it); Block.vjp runs it on the interpreter"
        ]
        diags.append(
            Diagnostic(d.code, d.message, d.span, d.label, notes, list(d.help), list(d.related), d.severity)
        )
    return with_sources(CodaError(diags, e.sources))


class CudaFunction:
    """`CudaBlock.autograd()`: call with the block's inputs by name; returns the outputs by name, which
    torch.autograd differentiates through the derived backward block's kernels."""

    def __init__(
        self,
        cb: CudaBlock,
        wrt: list[str] | None,
        tile: Any,
        options: BackwardOptions,
        grad_scales: DelayedScaling | None = None,
    ):
        if isinstance(tile, dict):
            raise TypeError("autograd() takes one tile for every stage (or None), not a dict")
        d = cb.block.derivation(wrt, backward=options)
        self.derivation = d
        # fp8 cotangents: the delayed scales of the call site a call names, else these
        self.grad_scales = check_grad_scales(grad_scales, options, d, cb.name)
        try:
            self.forward = cb.sibling(d.forward, tile)
        except CodaError as e:
            raise _runtime_error(e, "extended forward", d.forward) from None
        # (the heavy epilogues cut off into stages of their own, where $CODA_SPLIT_EPILOGUES asks)
        which = split_selection()
        backward = d.backward if which is None else split_epilogues(d.backward, which, cb.dims)
        try:
            self.backward = cb.sibling(backward, tile)
        except CodaError as e:
            raise _runtime_error(e, "backward", backward) from None
        # saved tensors a packed backward stage may overwrite with its D (CudaBlock._run's `consume`)
        self.inplace = frozenset(
            spec.c.name for spec in self.backward.specs if spec is not None and spec.c is not None
        )
        self.params = [p.var.name for p in cb.ir.params]
        self.outputs = [o.name for o in cb.ir.outputs]
        self.needs = [
            p.var.name for p in d.backward.ir.params if p.var.name not in set(d.cotangents.values())
        ]
        self.ir, self.dims = cb.ir, cb.dims
        # chunks of the backward (docs/design.md, "Chunked backward"): the plans it may take (one dim,
        # or every chunkable dim for "auto", chosen per call by memory), and the CUDA block of each
        # plan's widened backward (gradients summed over the chunked dim stored in f32, added across
        # chunks); `chunked` is the first's
        self.options = options
        self.chunk_plans: list[ChunkPlan] = []
        self.chunked_blocks: dict[str, CudaBlock] = {}
        if options.chunked:
            self.chunk_plans = candidate_plans(cb.block, wrt, options)
            for plan in self.chunk_plans:
                # (and the block of the chunks after the first, which add to the weight gradients'
                # running totals in their GEMMs' epilogues: key "<dim>+")
                for key, blk in ((plan.dim, plan.block), (plan.dim + "+", plan.acc_block)):
                    if blk is None:
                        continue
                    try:
                        self.chunked_blocks[key] = cb.sibling(blk, tile)
                    except CodaError as e:
                        raise _runtime_error(e, "chunked backward", blk) from None
            self.chunked = self.chunked_blocks[self.chunk_plans[0].dim]
        # the backward's kernels are compiled with the forward's, at the first call (one parallel compile)
        self.forward.compile_with(self.backward, *self.chunked_blocks.values())
        self.forward_dims = frozenset(x.name for x in d.forward.ir.dims)
        self.backward_dims = frozenset(x.name for x in d.backward.ir.dims)

    def __call__(
        self,
        inputs: dict[str, Any] | None = None,
        /,
        *,
        dims: dict[str, int] | None = None,
        grad_scales: DelayedScaling | None = None,
        **tensors: Any,
    ) -> dict[str, torch.Tensor]:
        """`dims`: sizes of the block's dims that no input's shape gives (with the CudaBlock's own);
        the backward block runs at the dims of the forward's run. `grad_scales`: with fp8 cotangents,
        the delayed scales of this call site (default: the function's own), which its backward reads
        and updates."""
        given = {**(inputs or {}), **tensors}
        self._known(given)
        names = tuple(n for n in self.params if n in given)
        sizes = tuple(sorted({**self.dims, **given_dims(self.ir, dims)}.items()))
        state = (  # (the function's own was checked when it was made)
            self.grad_scales
            if grad_scales is None
            else check_grad_scales(grad_scales, self.options, self.derivation, self.forward.name)
        )
        outs = _CodaAutograd.apply(self, names, sizes, state, *[given[n] for n in names])
        return dict(zip(self.outputs, outs, strict=True))

    def forward_backward(
        self,
        inputs: dict[str, Any],
        cotangents: dict[str, Any],
        chunk: int,
        dims: dict[str, int] | None = None,
        rounded: bool = True,
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(outputs, gradients by input name) of the forward and, at once, the backward with the given
        cotangents (by output name; an output not given has a zero cotangent), `chunk` rows at a time:
        each chunk's forward, then its backward, so what the forward saves for the backward (a loss
        head's logits, `remat="save"`) lives for one chunk only, and no tensor is kept for later.
        Outputs are joined over the rows; gradients of inputs indexed by the rows joined, of the
        others summed (in f32, rounded once; a weight gradient adds each chunk inside its GEMM:
        `ChunkPlan.acc_block`; `rounded=False`: those come back as their f32 totals, for a caller
        that scales them before rounding, in one pass). The function must be made with `chunk_dim=`
        the forward's row dim. No autograd graph is recorded."""
        row = row_dim(self.forward.ir)
        plan = next((p for p in self.chunk_plans if p.dim == row), None)
        if plan is None or row is None:
            raise ValueError(
                f"block {self.forward.name}: forward_backward runs in chunks of its rows; make the "
                f"function with chunk_dim={row!r}"
            )
        if chunk < 1:
            raise ValueError(f"chunk= is {chunk}; a chunk holds at least 1 row")
        d = self.derivation
        given = {**self.dims, **given_dims(self.ir, dims)} if dims else dict(self.dims)
        rows_of = {p.var.name: _axis(p.var.type, row) for p in self.ir.params}
        outs_of: dict[str, int] = {}
        for o in self.forward.ir.outputs:
            if o.name in self.outputs:
                ax = _axis(o.type, row)
                if ax is None:
                    raise ValueError(
                        f"block {self.forward.name}: output `{o.name}` is not indexed by its rows `{row}`, "
                        "so forward_backward can't run it in chunks"
                    )
                outs_of[o.name] = ax
        unknown = [o for o in cotangents if o not in d.cotangents]
        if unknown:
            raise ValueError(
                f"block {self.forward.name}: cotangents given for {', '.join(unknown)}, which are not "
                f"differentiable outputs ({', '.join(d.cotangents)})"
            )
        zero = [o for o in d.cotangents if o not in cotangents]  # as autograd: an unused output's is 0
        size = self._whole(inputs, cotangents, given)[row]
        full = {**inputs, **{d.cotangents[o]: g for o, g in cotangents.items() if o in d.cotangents}}
        wanted = [p.var.name for p in plan.block.ir.params]
        res = ChunkResults(plan, size, _empty, _add, _finish if rounded else _unrounded)
        joined: dict[str, torch.Tensor] = {}
        run: Any = None
        with torch.no_grad():
            for i in range(0, size, chunk):
                j = min(i + chunk, size)
                sub = {
                    n: v if (ax := rows_of.get(n)) is None else v[chunk_at(ax, i, j)]
                    for n, v in inputs.items()
                }
                fres, _, fdims = self.forward._call(sub, given)
                for n, ax in outs_of.items():
                    join_part(joined, n, fres[n], ax, size, i, j, _empty)
                if run is None:
                    bdims = {k: v for k, v in {**given, **fdims}.items() if k in self.backward_dims}
                    # what the chunk's forward saved is the chunk's own: its backward may write over it
                    own = frozenset(n for n in self.needs if n in fres and n not in inputs)
                    run = self.chunk_runner(plan, bdims, own=own)
                bins = chunk_inputs(plan, {n: full[n] for n in wanted if n in full}, i, j)
                bins.update({n: fres[n] for n in self.needs if n in fres})
                bins.update({d.cotangents[o]: torch.zeros_like(fres[o]) for o in zero})
                totals = res.totals()
                if totals is not None:
                    bins.update(totals)
                res.take(run(bins, j - i, totals is not None), i, j, totals is not None)
                del fres, bins
        grads = res.result()
        return joined, {n: grads[g] for n, g in d.grads.items() if g in grads}

    def _known(self, given: dict[str, Any]) -> None:
        """E0801 for a name that is no input of the block (a misspelled one would otherwise be left
        out, and its default used), as a CUDA block's call gives it."""
        unknown = sorted(set(given) - set(self.params))
        if unknown:
            raise error(
                "E0801",
                f"unknown input `{unknown[0]}`; the block's parameters are {', '.join(sorted(self.params))}",
            )

    def _whole(
        self, inputs: dict[str, Any], cotangents: dict[str, Any], given: dict[str, int]
    ) -> dict[str, int]:
        """The dims of the whole inputs of a run in chunks, checked before any is sliced: E0801 for an
        unknown name, E0804 for inputs that disagree (a row-indexed one longer or shorter than the
        others), E0802 for a cotangent not of its output's shape."""
        self._known(inputs)
        shapes = {n: tuple(v.shape) for n, v in inputs.items() if isinstance(v, torch.Tensor)}
        dims = self.forward.binder.sizes(shapes, given)
        outputs = {o.name: o.type for o in self.ir.outputs}
        for o, g in cotangents.items():
            want = tuple(extent(x, dims) for x in outputs[o].shape)
            if not isinstance(g, torch.Tensor) or tuple(g.shape) != want:
                got = tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
                raise error(
                    "E0802",
                    f"the cotangent of output `{o}` is {got}, but `{o}` is "
                    f"{outputs[o].dtype}{shape_str(outputs[o].shape)} = {want} for these inputs",
                )
        return dims

    def run_backward(
        self, bins: dict[str, Any], dims: dict[str, int], consume: frozenset[str] | None = None
    ) -> dict[str, Any]:
        """The backward block's outputs: in one run, or in chunks of one dim (slices of the inputs
        indexed by it, outputs indexed by it written into their slices of one preallocated output,
        gradients summed over it added in f32 and rounded once). `consume`: saved tensors the run may
        drop and overwrite (CudaBlock._run); a chunked run only drops values (an input passed whole to
        every chunk must not be overwritten by the first)."""
        if not self.chunk_plans:
            return self.backward._call(bins, dims, consume)[0]
        plan, c = choose(self.chunk_plans, dims, self.options)
        run = self.chunk_runner(plan, dims, consume)
        return run_chunks(plan, bins, dims[plan.dim], c, run, _empty, _add, _finish)

    def chunk_runner(
        self,
        plan: ChunkPlan,
        dims: dict[str, int],
        consume: frozenset[str] | None = None,
        own: frozenset[str] = frozenset(),
    ) -> Any:
        """`run(inputs of a chunk, its extent, acc)` for `run_chunks`: the chunk's run of `plan.block`,
        or with `acc` of `plan.acc_block`, whose running totals it overwrites with the new ones (their
        GEMMs store `acc + total` over `total`: Liveness.into). `consume` as `run_backward`'s: a
        chunk otherwise only drops values (an input passed whole to every chunk must not be
        overwritten by the first). `own`: inputs made for each chunk alone (what its forward saved),
        which its run may overwrite."""
        keep: frozenset[str] | None = own if consume is not None or own else None
        totals = frozenset(plan.accumulate.values())

        def run(sub: dict[str, Any], n: int, acc: bool) -> dict[str, Any]:
            at = {**dims, plan.inner: n}
            if acc:
                return self.chunked_blocks[plan.dim + "+"]._call(sub, at, totals | own)[0]
            return self.chunked_blocks[plan.dim]._call(sub, at, keep)[0]

        return run


def _axis(t: Any, dim: str) -> int | None:
    """The axis of `dim` in type `t`'s shape, if any."""
    return next((k for k, x in enumerate(t.shape) if x.name == dim and x.coeff == 1), None)


def _empty(part: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, dtype=part.dtype, device=part.device)


def _add(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    return total.add_(part)


def _finish(total: torch.Tensor, dtype: str) -> torch.Tensor:
    return total.to(TORCH_DTYPES[dtype])


def _unrounded(total: torch.Tensor, dtype: str) -> torch.Tensor:
    return total


class _CodaAutograd(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        fn: CudaFunction,
        names: tuple[str, ...],
        sizes: tuple[tuple[str, int], ...],
        grad_scales: DelayedScaling | None,
        *vals: Any,
    ) -> tuple[torch.Tensor, ...]:
        inputs = dict(zip(names, vals, strict=True))
        res, _, dims = fn.forward._call(inputs, {k: v for k, v in sizes if k in fn.forward_dims})
        ctx.dims = {k: v for k, v in {**dict(sizes), **dims}.items() if k in fn.backward_dims}
        keep = {n: res[n] if n in res else inputs[n] for n in fn.needs if n in res or n in inputs}
        tensor_names = [n for n, v in keep.items() if isinstance(v, torch.Tensor)]
        ctx.save_for_backward(*[keep[n] for n in tensor_names])
        ctx.fn, ctx.names, ctx.tensor_names = fn, names, tensor_names
        ctx.grad_scales = grad_scales
        ctx.others = {n: v for n, v in keep.items() if not isinstance(v, torch.Tensor)}
        ctx.in_dtypes = [v.dtype if isinstance(v, torch.Tensor) else None for v in vals]
        # Each output is a tensor object of its own (detach: no copy). Under torch.compile, PyTorch 2.11
        # drops the gradient of a Function output that is an intermediate passed through a no-op
        # (`x.to(x.dtype)`, `.contiguous()`, `.float()`, as `_call`, `_round` and `_compute` do): the
        # backward then ran on zero cotangents and every gradient came out zero (fixed in 2.13).
        outs = tuple(res[o].detach() for o in fn.outputs)
        ctx.out_meta = [(x.shape, x.dtype, x.device) for x in outs]
        # integer outputs, and those no gradient flows back from (a detached amax): no grad_fn
        ctx.mark_non_differentiable(
            *[
                x
                for o, x in zip(fn.outputs, outs, strict=True)
                if not x.is_floating_point() or o in fn.derivation.detached
            ]
        )
        # no zeros made by autograd for the outputs no gradient reached (each detached amax of an fp8
        # block, every backward: a fill kernel each); the backward makes what it needs
        ctx.set_materialize_grads(False)
        # what the backward may overwrite: tensors this forward made (not the caller's inputs, not memory
        # an output shares) that a packed backward stage reads as its C operand (not under a
        # torch.compile trace, which can't follow storages: there the backward allocates as before)
        ctx.consumable = frozenset()
        if fn.inplace and not torch.compiler.is_compiling():
            out_mem = {x.untyped_storage().data_ptr() for x in outs}
            ctx.consumable = frozenset(
                n
                for n in tensor_names
                if n in fn.inplace
                and n in res
                and n not in inputs
                and keep[n].untyped_storage().data_ptr() not in out_mem
            )
        ctx.consumed = False
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        fn: CudaFunction = ctx.fn
        d = fn.derivation
        if torch.is_grad_enabled():  # create_graph=True: the kernels' gradients have no graph of their own
            raise RuntimeError(
                f"coda: block {fn.forward.name} has no double backward, so its gradient can't be "
                "differentiated again: create_graph=True is refused (the gradient would be a constant "
                "and a second backward through it would silently miss this block's terms)"
            )
        if ctx.consumed:
            raise RuntimeError(
                f"coda: the backward of block {fn.forward.name} ran already and wrote into the tensors it "
                f"saved ({', '.join(sorted(ctx.consumable))}: the SwiGLU backward overwrites the saved "
                "pre-activation with its cotangent), so it can't run twice (retain_graph=True); run the "
                "forward again"
            )
        bins: dict[str, Any] = dict(zip(ctx.tensor_names, ctx.saved_tensors, strict=True))
        bins.update(ctx.others)
        for out, g, (shape, dtype, device) in zip(fn.outputs, grads, ctx.out_meta, strict=True):
            if out in d.cotangents:
                if g is None:
                    # a detached output's cotangent is never read (its gradient is 0 by definition):
                    # one shared zero, made once; any other output's, zeros of its own
                    g = (
                        _shared_zero(shape, dtype, device)
                        if out in d.detached
                        else torch.zeros(shape, dtype=dtype, device=device)
                    )
                bins[d.cotangents[out]] = g
        ctx.consumed = bool(ctx.consumable) and not fn.chunk_plans  # a chunked run overwrites nothing
        if ctx.grad_scales is None:
            grads_out = fn.run_backward(bins, ctx.dims, ctx.consumable)
        else:
            grads_out = _fp8_backward(fn, ctx.grad_scales, bins, ctx.dims, ctx.consumable)
        result: list[Any] = [None, None, None, None]
        for i, name in enumerate(ctx.names):
            g = d.grads.get(name)
            if g is None or not ctx.needs_input_grad[i + 4]:
                result.append(None)
            else:
                # in the input's dtype, as autograd needs (an fp8 input's gradient saturates)
                result.append(torch_store(grads_out[g], ctx.in_dtypes[i]))
        return tuple(result)


_ZEROS: dict[tuple[Any, ...], torch.Tensor] = {}


def _shared_zero(shape: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor of this shape, dtype and device, made once and shared: the cotangent of a detached
    output, which no backward reads or writes."""
    key = (tuple(shape), dtype, device)
    z = _ZEROS.get(key)
    if z is None:
        z = _ZEROS[key] = torch.zeros(shape, dtype=dtype, device=device)
    return z


def _fp8_backward(
    fn: CudaFunction,
    state: DelayedScaling,
    bins: dict[str, Any],
    dims: dict[str, int],
    consume: frozenset[str] | None,
) -> dict[str, Any]:
    """The backward with fp8 cotangents: run at the state's scales, its amaxes recorded (the next
    step's scales set by the state's rule). The first backward of initial="calibrate" runs again, its
    saved tensors kept, until the scales it ran at are the rule applied to its own amaxes (at most one
    run more than there are scales: each cotangent's amax depends only on the scales before it)."""
    d = fn.derivation
    device = next((v.device for v in bins.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    scales = state.scales_for(device)
    if not state.calibrating:
        out = fn.run_backward({**bins, **scales}, dims, consume)
    else:
        refuse_in_capture(
            f"block {fn.forward.name}'s first fp8 backward calibrates its cotangent scales (it compares "
            "them on the host)",
            "run a step's backward once before capturing it",
        )
        for _ in range(len(d.scales) + 1):
            out = fn.run_backward({**bins, **scales}, dims, None)
            amaxes = {s: out[a] for s, a in d.scales.items()}
            nxt = state.next_scales(amaxes, scales)
            if all(torch.equal(nxt[s], scales[s]) for s in d.scales):
                break
            scales = nxt
        else:  # (not reached: the last run's scales are each the rule of amaxes that depend on no later one)
            raise RuntimeError(f"block {fn.forward.name}: the fp8 cotangent scales did not settle")
        state.set_scales(scales)
    state.record({s: out[a] for s, a in d.scales.items()})
    return out
