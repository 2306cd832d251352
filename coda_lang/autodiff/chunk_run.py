"""Running a chunk plan: the inputs of each chunk, and its outputs joined or summed.

What it does: `chunk_inputs` slices a chunk's inputs (and shifts the parameters a chunk compares with
its own index); `ChunkResults` collects the chunks' outputs (joined along their axis into one
preallocated output, summed ones added, the rest taken from the first chunk); `run_chunks` runs any
runtime (the interpreter's, a CUDA block's) chunk by chunk, with allocation and accumulation given
as callables (NumPy or torch); `chunk_at` and `join_part` are the slicing helpers.
What it does not: plan (chunk.py) or rewrite (chunk_rewrite.py), or compute anything of a chunk.
Invariants: a chunked run equals the unchunked one up to the order of f32 summation; nothing here
imports NumPy or torch (the callables do the work).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coda_lang.autodiff.chunk import ChunkPlan


def chunk_at(axis: int, i: int, j: int) -> tuple[slice, ...]:
    """The index of elements [i, j) along `axis`."""
    return (slice(None),) * axis + (slice(i, j),)


def join_part(
    joined: dict[str, Any],
    name: str,
    part: Any,
    axis: int,
    size: int,
    i: int,
    j: int,
    empty: Callable[[Any, tuple[int, ...]], Any],
) -> None:
    """Write chunk [i, j)'s `part` of output `name` into its slice of joined[name], which the first
    chunk allocates (`empty(part, whole shape)`, `size` elements along `axis`)."""
    if name not in joined:
        shape = list(part.shape)
        shape[axis] = size
        joined[name] = empty(part, tuple(shape))
    joined[name][chunk_at(axis, i, j)] = part


class ChunkResults:
    """The outputs of a run in chunks of `plan.dim` (`size` elements), taken chunk by chunk: each joined
    output allocated once by `empty(first part, whole shape)` and every chunk's part copied into its
    slice; summed ones `add(total, part)` (which may add in place into `total`, the first chunk's part)
    and at the end `finish(total, dtype)` (rounding once to the declared dtype); the others the first
    chunk's. Outputs of `plan.accumulate` come from the chunk's run of `plan.acc_block` (`totals()`
    gives its inputs) already summed: they are the new totals."""

    def __init__(
        self,
        plan: ChunkPlan,
        size: int,
        empty: Callable[[Any, tuple[int, ...]], Any],
        add: Callable[[Any, Any], Any],
        finish: Callable[[Any, str], Any],
    ):
        self.plan, self.size, self.empty, self.add, self.finish = plan, size, empty, add, finish
        self.joined: dict[str, Any] = {}
        self.sums: dict[str, Any] = {}
        self.whole: dict[str, Any] | None = None

    def totals(self) -> dict[str, Any] | None:
        """The running totals by `plan.acc_block`'s parameter names, for the next chunk's run of it;
        None when that chunk runs `plan.block` (the first chunk, or a plan with nothing to accumulate)."""
        if not self.plan.accumulate or self.whole is None:
            return None
        return {p: self.sums[n] for n, p in self.plan.accumulate.items()}

    def take(self, outs: dict[str, Any], i: int, j: int, accumulated: bool) -> None:
        """Chunk [i, j)'s outputs (`accumulated`: from a run of `plan.acc_block`)."""
        plan = self.plan
        for n, ax in plan.joined.items():
            join_part(self.joined, n, outs[n], ax, self.size, i, j, self.empty)
        for n in plan.summed:
            if n not in self.sums or (accumulated and n in plan.accumulate):
                self.sums[n] = outs[n]
            else:
                self.sums[n] = self.add(self.sums[n], outs[n])
        if self.whole is None:
            self.whole = {n: outs[n] for n in plan.whole}

    def result(self) -> dict[str, Any]:
        return {
            **self.joined,
            **{n: self.finish(t, self.plan.summed[n]) for n, t in self.sums.items()},
            **(self.whole or {}),
        }


def chunk_inputs(plan: ChunkPlan, inputs: dict[str, Any], i: int, j: int) -> dict[str, Any]:
    """The inputs of chunk [i, j) of `plan.dim`: sliced where indexed by it, shifted parameters
    minus the chunk's start, the others whole."""
    sub = {n: (v if n not in plan.sliced else v[chunk_at(plan.sliced[n], i, j)]) for n, v in inputs.items()}
    for new, (old, default) in plan.shifted.items():
        base = inputs.get(old, default)
        if base is not None:
            sub[new] = base - i
    return sub


def run_chunks(
    plan: ChunkPlan,
    inputs: dict[str, Any],
    size: int,
    chunk: int,
    run: Callable[[dict[str, Any], int, bool], dict[str, Any]],
    empty: Callable[[Any, tuple[int, ...]], Any],
    add: Callable[[Any, Any], Any],
    finish: Callable[[Any, str], Any],
) -> dict[str, Any]:
    """Outputs of `plan.block` run chunk by chunk over `size` elements of `plan.dim`: `run(inputs of
    the chunk, its extent, acc)` gives a chunk's outputs (run `plan.acc_block` when `acc`, whose
    inputs then hold the running totals, else `plan.block`, with `plan.inner` at that extent);
    the outputs are collected as `ChunkResults` says."""
    res = ChunkResults(plan, size, empty, add, finish)
    for i in range(0, size, chunk):
        j = min(i + chunk, size)
        sub = chunk_inputs(plan, inputs, i, j)
        totals = res.totals()
        if totals is not None:
            sub.update(totals)
        outs = run(sub, j - i, totals is not None)
        res.take(outs, i, j, totals is not None)
        del outs, sub
    return res.result()
