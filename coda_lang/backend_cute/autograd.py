"""`CudaBlock.autograd()`: a block's outputs differentiable by torch.autograd through the derived backward.

What it does: `CudaFunction` holds the CUDA blocks of the extended forward (`Block.derivation()
.forward`: the forward that also stores what the backward reads) and of the derived backward block;
its `torch.autograd.Function` runs the first in `forward`, keeps the saved tensors, and runs the second
in `backward` with the incoming cotangents, returning each input's gradient in its dtype.
What it does not: derive anything (autodiff/ does) or launch kernels itself (cuda_block.py).
`chunk=`/`budget=`/`chunk_dim=` run the backward in chunks of one dim, rows of M or columns of V
(interp/chunk.py decides how, picks the dim for "auto", and refuses blocks that can't; its transient
tiles are then bounded by the chunk).
Invariants: the backward runs at the dims of the forward's call; an output nobody differentiates gets a
zero cotangent; a stage either block can't compile is E07 when the function is made, naming the block;
chunked and unchunked backwards agree up to the order of f32 summation.
"""

from __future__ import annotations

from typing import Any

import torch

from coda_lang.backend_cute.cuda_block import CudaBlock, with_sources
from coda_lang.backend_cute.launch import TORCH_DTYPES
from coda_lang.interp.chunk import ChunkPlan, candidate_plans, choose, chunk_mode, run_chunks
from coda_lang.interp.inputs import given_dims
from coda_lang.ir.nodes import DEFAULT_REMAT
from coda_lang.verify.diagnostics import CodaError, Diagnostic


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
        remat: str = DEFAULT_REMAT,
        chunk: int | str | None = None,
        budget: int | None = None,
        chunk_dim: str | None = None,
    ):
        if isinstance(tile, dict):
            raise TypeError("autograd() takes one tile for every stage (or None), not a dict")
        chunk = chunk_mode(chunk, budget, chunk_dim)
        d = cb.block.derivation(wrt, remat)
        self.derivation = d
        try:
            self.forward = CudaBlock(d.forward, tile, emulate=cb.emulate, poison=cb.poison, tune=cb.tune)
        except CodaError as e:
            raise _runtime_error(e, "extended forward", d.forward) from None
        try:
            self.backward = CudaBlock(d.backward, tile, emulate=cb.emulate, poison=cb.poison, tune=cb.tune)
        except CodaError as e:
            raise _runtime_error(e, "backward", d.backward) from None
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
        self.chunk, self.budget = chunk, budget
        self.chunk_plans: list[ChunkPlan] = []
        self.chunked_blocks: dict[str, CudaBlock] = {}
        if chunk is not None or budget is not None:
            self.chunk_plans = candidate_plans(cb.block, wrt, remat, chunk, chunk_dim)
            for plan in self.chunk_plans:
                try:
                    self.chunked_blocks[plan.dim] = CudaBlock(
                        plan.block, tile, emulate=cb.emulate, poison=cb.poison, tune=cb.tune
                    )
                except CodaError as e:
                    raise _runtime_error(e, "chunked backward", plan.block) from None
            self.chunked = self.chunked_blocks[self.chunk_plans[0].dim]
        # the backward's kernels are compiled with the forward's, at the first call (one parallel compile)
        self.forward.compile_with(self.backward, *self.chunked_blocks.values())
        self.forward_dims = frozenset(x.name for x in d.forward.ir.dims)
        self.backward_dims = frozenset(x.name for x in d.backward.ir.dims)

    def __call__(
        self, inputs: dict[str, Any] | None = None, /, *, dims: dict[str, int] | None = None, **tensors: Any
    ) -> dict[str, torch.Tensor]:
        """`dims`: sizes of the block's dims that no input's shape gives (with the CudaBlock's own);
        the backward block runs at the dims of the forward's run."""
        given = {**(inputs or {}), **tensors}
        names = tuple(n for n in self.params if n in given)
        sizes = tuple(sorted({**self.dims, **given_dims(self.ir, dims)}.items()))
        outs = _CodaAutograd.apply(self, names, sizes, *[given[n] for n in names])
        return dict(zip(self.outputs, outs, strict=True))

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
        plan, c = choose(self.chunk_plans, dims, self.chunk, self.budget)
        chunked = self.chunked_blocks[plan.dim]
        keep_all: frozenset[str] | None = frozenset() if consume is not None else None

        def run(sub: dict[str, Any], n: int) -> dict[str, Any]:
            return chunked._call(sub, {**dims, plan.inner: n}, keep_all)[0]

        def empty(part: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
            return torch.empty(shape, dtype=part.dtype, device=part.device)

        def add(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
            return total.add_(part)

        def finish(total: torch.Tensor, dtype: str) -> torch.Tensor:
            return total.to(TORCH_DTYPES[dtype])

        return run_chunks(plan, bins, dims[plan.dim], c, run, empty, add, finish)


class _CodaAutograd(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, fn: CudaFunction, names: tuple[str, ...], sizes: tuple[tuple[str, int], ...], *vals: Any
    ) -> tuple[torch.Tensor, ...]:
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
                bins[d.cotangents[out]] = (
                    g if g is not None else torch.zeros(shape, dtype=dtype, device=device)
                )
        ctx.consumed = bool(ctx.consumable) and not fn.chunk_plans  # a chunked run overwrites nothing
        grads_out = fn.run_backward(bins, ctx.dims, ctx.consumable)
        result: list[Any] = [None, None, None]
        for i, name in enumerate(ctx.names):
            g = d.grads.get(name)
            if g is None or not ctx.needs_input_grad[i + 3]:
                result.append(None)
            else:
                result.append(grads_out[g].to(ctx.in_dtypes[i]))
        return tuple(result)
