"""The chunk rewrite: a backward block as each chunk of one dim runs it (IR to IR).

What it does: `widen(ir, ...)` returns `ir` with its values summed over the chunked dim stored in
f32 (so each chunk's part accumulates unrounded), the operands that compare or pick along the chunked
dim reading parameters shifted to the chunk's start, the chunk's extent as a dim of its own where the
block also reads the whole extent as a value, and (for `accumulate`) outputs stored as `acc + total`
so that a GEMM adds each chunk's part to the running total in its epilogue. The result is checked
directly (frontend.source.check_generated), not printed and parsed again.
What it does not: decide what to rewrite (chunk.py's `chunk_plan` does) or run chunks (chunk_run.py).
Invariants: the rewritten block has the parameters, outputs and stages of `ir`, some outputs wider,
plus the shifted parameters and running totals; it checks, or CodaError E0601 (a bug).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from coda_lang.frontend.source import CheckedBlock, check_generated
from coda_lang.ir.nodes import Block, DimDecl, Eqn, Param, Stage, Var
from coda_lang.ir.types import Dim, Type
from coda_lang.ops import REGISTRY


def widen(
    ir: Block,
    sums: set[str],
    summed_outputs: set[str],
    patches: dict[tuple[int, int, int], str],
    shift_of: dict[str, str],
    dim: str,
    inner: str,
    accumulate: dict[str, str] | None = None,
) -> CheckedBlock:
    """The block a chunk runs: `ir` with its values summed over the chunked dim stored in f32 (outputs
    declared f32), so that each chunk's part is accumulated unrounded; the patched operands reading
    the shifted parameters (declared after the parameter each shifts); and, when `inner` is not `dim`,
    every shape's `dim` renamed `inner` (the chunk's extent) while a size read as a value stays `dim`.
    `accumulate` (output -> new parameter): each such output, stored `name = acc`, is stored
    `name = acc + total` instead, `total` an f32 parameter of the output's shape (declared last)."""

    def wide(v: Var) -> Var:
        if v.name not in sums:
            return v
        if v.annot in ("bf16", "f16") or (v.annot is None and v.name not in summed_outputs):
            return replace(v, annot="f32")
        return v

    def rd(d: Any) -> Any:  # a dim in a shape or a parameter, renamed
        return Dim(d.coeff, inner) if isinstance(d, Dim) and d.name == dim else d

    def rt(t: Type | None) -> Type | None:
        return None if t is None else replace(t, shape=tuple(rd(d) for d in t.shape))

    totals = accumulate or {}

    def eqn(e: Eqn, stage: int, j: int) -> Eqn:
        ins = tuple(
            Var(patches[(stage, j, i)]) if (stage, j, i) in patches else a for i, a in enumerate(e.ins)
        )
        op = e.op
        if stage and REGISTRY[e.op].copy and e.outs[0].name in totals:
            op, ins = "add", (*ins, Var(totals[e.outs[0].name]))
        return replace(
            e, op=op, ins=ins, outs=tuple(map(wide, e.outs)), params=tuple((k, rd(v)) for k, v in e.params)
        )

    body: list[Any] = []
    k = 0
    for s in ir.body:
        if isinstance(s, Stage):
            k += 1
            shape = None if s.shape is None else (rd(s.shape[0]), rd(s.shape[1]))
            body.append(replace(s, body=tuple(eqn(e, k, j) for j, e in enumerate(s.body)), shape=shape))
        else:
            body.append(eqn(s, 0, 0))
    params: list[Param] = []
    for p in ir.params:
        params.append(replace(p, var=replace(p.var, type=rt(p.var.type))))
        if p.var.name in shift_of:
            params.append(replace(p, var=replace(p.var, name=shift_of[p.var.name], type=rt(p.var.type))))
    for o in ir.outputs:
        if o.name in totals:
            params.append(Param(Var(totals[o.name], replace(o.type, dtype="f32"))))
    outs = tuple(
        replace(
            o,
            type=replace(
                o.type,
                shape=tuple(rd(d) for d in o.type.shape),
                dtype="f32" if o.name in summed_outputs and o.type.dtype in ("bf16", "f16") else o.type.dtype,
            ),
        )
        for o in ir.outputs
    )
    dims = ir.dims
    if inner != dim:
        at = [d.name for d in dims].index(dim) + 1
        dims = dims[:at] + (DimDecl(inner),) + dims[at:]
    wide_ir = replace(ir, dims=dims, params=tuple(params), body=tuple(body), outputs=outs)
    return check_generated(wide_ir, "the chunked backward", ir.span)
