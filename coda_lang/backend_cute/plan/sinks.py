"""A stage's reductions as epilogue resources: partial reductions -> `Sink`s, grouped ones -> `Group`s.

What it does: `partials` makes each reduction read after the stage a quack sink, by the op's combine
record (ops.registry.Combine.sink): a ColVecReduce (one value per row, folded over the columns) or a
RowVecReduce (one per column), folding by add or max (min as the max of the negation), an
OnlineLSEReduce for logsumexp(), a ColVecSelect for pick(); a sum of a product used nowhere else as
one fma of its two factors (`scaled`, as quack's rms epilogues do); in packed mode a row reduction of
a double-width value folding its two lanes first; and where a sum is masked past the ragged end of
its dim (`bounded`, `ragged_only`: padding.py says what the padding holds); a grouped reduction over
runs of rows that the stage stores and does not read is a RowVecReduce one tile tall (`Sink.rows`,
`row_group`). `groups` makes each
grouped reduction the stage reads (or stores: `stored_groups`) a Group of quack's epilogue prepass,
with the prepass equations that compute what it reduces.
What it does not: word refusals (refusals.py: each check is called here, in the order the
diagnostics depend on), choose loads (operands.py) or the mode (planner.py).
Invariants: a reduction is folded only as its combine record says, never some other way; sinks and
groups come in program order; the Python names of their values are asked for in that order too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from coda_lang.backend_cute.plan import refusals
from coda_lang.backend_cute.plan.context import StageContext, live_eqns
from coda_lang.backend_cute.plan.padding import is_zero, padding_value
from coda_lang.backend_cute.plan.spec import (
    GROUP_COMBINES,
    SINK_COMBINES,
    Group,
    Layout,
    Sink,
    SinkOp,
    is_wide,
    lanes_of,
    member,
)
from coda_lang.ir.nodes import Eqn, Var
from coda_lang.ir.types import GROUP, MATRIX, TILE
from coda_lang.ops import REGISTRY, Arith, Locality


def partials(ctx: StageContext, live_out: set[str], paired: bool, packed: bool) -> list[Sink]:
    """The partial reductions read after the stage, as quack sinks. A sum of a product used
    nowhere else is folded as one fma of the two factors (`scaled`), as quack's rms epilogues do.
    In packed mode a row reduction of a double-width value folds its two lanes first."""
    sinks: list[Sink] = []
    uses: dict[str, int] = {}
    for e in ctx.st.body:
        for a in e.ins:
            if isinstance(a, Var):
                uses[a.name] = uses.get(a.name, 0) + 1
    index_uses: dict[str, int] = {}
    for e in ctx.st.body:
        od = REGISTRY[e.op]
        if not od.reduces:
            continue
        (v,) = e.outs
        t = v.type
        if v.name not in live_out or t is None:
            continue
        x = e.ins[0]
        refusals.check_reduced(e, x)
        assert isinstance(x, Var)
        xt = x.type if x.type is not None else ctx.types.get(x.name)
        if xt is not None and xt.kind == MATRIX and len(xt.shape) == 2:
            # a loaded matrix is read tile by tile in the stage: its width decides its lanes as a
            # computed tile's does (a double-width one in a packed stage, a full-width one in a paired
            # stage; as a matrix it passed for one of the stage's width, or a half-width one)
            xt = replace(xt, kind=TILE)
        rows = row_group(e, ctx, live_out)
        if e.param("group") is not None and rows is None:
            continue  # complete in its tile: a Group (groups()), not a partial
        per_row = bool(t.shape) and t.shape[0] == ctx.rows  # one value per row: reduced over the columns
        half = paired and xt is not None and lanes_of(xt, ctx.rows, ctx.cols) == 1
        wide = packed and is_wide(xt, ctx.cols)
        refusals.check_sink(ctx, e, x, xt, per_row, wide, paired)
        py = ctx.py(v.name)
        rec = od.combine
        assert rec is not None and rec.sink is not None  # (check_sink)
        if rows is not None:
            refusals.check_row_group_sink(e, rec.sink, wide)
        if od.locality is Locality.GATHER:  # quack's ColVecSelect
            idx = e.ins[1]
            assert isinstance(idx, Var)  # (check_sink)
            index_uses[idx.name] = index_uses.get(idx.name, 0) + 1
            ld = next(ld for ld in ctx.sp.loads if ld.name == idx.name)
            sinks.append(
                Sink(
                    name=v.name,
                    py=py,
                    op="ColVecSelect",
                    combine=None,
                    value=(x.name,),
                    shape=t.shape,
                    layout="vector",
                    index=ctx.py(idx.name),
                    index_dtype=ld.dtype,
                )
            )
            continue
        if rec.sink == "lse":  # quack's online log-sum-exp, along the columns (check_sink)
            sinks.append(
                Sink(
                    name=v.name,
                    py=py,
                    op="OnlineLSEReduce",
                    combine=None,
                    value=(x.name,),
                    shape=t.shape,
                    layout="row partials",
                )
            )
            continue
        combine = member(rec.sink, SINK_COMBINES)  # "add" | "max"
        negate = rec.negate  # min(x) = -max(-x): quack folds the negation by max (exact)
        refusals.check_vec_reduce(e, x, per_row, half)
        op: SinkOp = "ColVecReduce" if per_row else "RowVecReduce"
        layout: Layout = "row partials" if per_row else "column partials"
        prod = ctx.defined.get(x.name)
        # quack masks the ragged end of the reduced dim for max (and min, its negation) itself; a
        # sum over the columns is masked there unless its value is 0 there whatever the inputs (the
        # accumulator is NaN there in a row of A, an activation, holding an infinity); a sum over the
        # rows unless it is 0 there for finite inputs (it is NaN only for an infinity in a column of
        # B, a weight as a rule, and its mask would cost the norm backwards their widest tile)
        bounded = combine == "add" and not is_zero(_padding(ctx, x.name, per_row, finite=not per_row))
        # one that is 0 there for finite inputs is masked in the ragged last tile only (Sink.ragged_only),
        # and, a sum of a product, folded as one fma of both factors (both masked); one that is not is
        # masked in every tile and folded plain, as before
        zero_if_finite = combine == "add" and is_zero(_padding(ctx, x.name, per_row))
        if wide:
            sinks.append(
                Sink(
                    name=v.name,
                    py=py,
                    op=op,
                    combine=combine,
                    value=(x.name,),
                    shape=t.shape,
                    layout=layout,
                    lanes=2,
                    negate=negate,
                    bounded=bounded,
                    ragged_only=bounded and zero_if_finite,
                )
            )
            continue
        if (
            rec.name == "sum"
            and not paired
            and zero_if_finite
            and prod is not None
            and REGISTRY[prod.op].arith is Arith.PRODUCT
            and uses.get(x.name) == 1
            and x.name not in live_out
            and all(isinstance(a, Var) for a in prod.ins)
        ):
            ins = tuple(a.name for a in prod.ins if isinstance(a, Var))
            sinks.append(
                Sink(
                    name=v.name,
                    py=py,
                    op=op,
                    combine=combine,
                    scaled=True,
                    value=ins,
                    shape=t.shape,
                    layout=layout,
                    bounded=bounded and rows is None,
                    ragged_only=bounded and rows is None,
                    rows=rows,
                )
            )
            continue
        # max(abs(x)) is folded as a max of the value abs(x), not by quack's max.xorsign.abs (its amax
        # epilogue): that instruction dropped a NaN on the H100 even with .NaN (an amax of a row
        # holding NaN came out inf; coda fuzz --target cuda --special on amax_fp8)
        sinks.append(
            Sink(
                name=v.name,
                py=py,
                op=op,
                combine=combine,
                value=(x.name,),
                shape=t.shape,
                layout=layout,
                pad="0.0" if combine == "add" else "self",
                negate=negate,
                bounded=bounded and rows is None,  # (a group of rows: M is a multiple of it, no ragged end)
                ragged_only=bounded and zero_if_finite and rows is None,
                rows=rows,
            )
        )
    refusals.check_pick_indices(ctx, index_uses, uses)
    return sinks


def row_group(e: Eqn, ctx: StageContext, live_out: set[str]) -> int | None:
    """The group height g of a grouped reduction over runs of g rows (a 128x1 group) that the stage
    stores and does not read itself: a sink (`Sink.rows`). None for any other reduction; a group of
    rows the stage reads is a Group, which refusals.check_group refuses (E0705)."""
    g = e.param("group")
    (v,) = e.outs
    t = v.type
    if g is None or t is None or t.group_axis != 0 or v.name not in live_out:
        return None
    if any(isinstance(a, Var) and a.name == v.name for d in ctx.st.body for a in d.ins):
        return None
    assert isinstance(g, int)
    return g


def _padding(ctx: StageContext, name: str, per_row: bool, finite: bool = True) -> Any:
    """What `name` holds past the end of the reduced dim in the ragged last tile (padding.py)."""
    return padding_value(name, per_row, {ld.name: ld for ld in ctx.sp.loads}, ctx.defined, finite=finite)


def grouped(ctx: StageContext) -> dict[str, Eqn]:
    """The stage's grouped reductions by result name."""
    return {
        e.outs[0].name: e
        for e in ctx.st.body
        if REGISTRY[e.op].locality is Locality.REDUCE and e.param("group") is not None
    }


def stored_groups(ctx: StageContext, live_out: set[str]) -> set[str]:
    """The grouped reductions used after the stage (their writers store them); any other grouped
    value used after it is E0705."""
    by_name = grouped(ctx)
    out = set()
    for e in ctx.st.body:
        for v in e.outs:
            if v.type is None or v.type.kind != GROUP or v.name not in live_out:
                continue
            if v.name in by_name and row_group(by_name[v.name], ctx, live_out) is not None:
                continue  # a sink (partials)
            refusals.check_stored_group(v, e, by_name)
            out.add(v.name)
    return out


def groups(
    ctx: StageContext, eqns: list[Eqn], stored: set[str], packed: bool
) -> tuple[list[Group], list[Eqn]]:
    """The grouped reductions the main fn reads (or the stage stores), and the prepass equations
    that compute what they reduce, in program order."""
    by_name = grouped(ctx)
    used = {a.name for e in eqns for a in e.ins if isinstance(a, Var)} | stored
    out: list[Group] = []
    keep: set[int] = set()
    for name, e in by_name.items():
        if name not in used:
            continue
        od = REGISTRY[e.op]
        (v,) = e.outs
        x = e.ins[0]
        refusals.check_group(ctx, e, packed)
        assert isinstance(x, Var)  # (check_group)
        prepass = live_eqns(ctx, {x.name})
        refusals.check_group_prepass(ctx, e, prepass, by_name)
        keep |= {id(p) for p in prepass}
        py = ctx.py(v.name)
        writer = ctx.fresh(f"{py}_out") if name in stored else None
        assert od.combine is not None and od.combine.group is not None  # (check_group_prepass)
        group = e.param("group")
        assert isinstance(group, int)  # (check_group)
        out.append(
            Group(
                name=v.name,
                py=py,
                combine=member(od.combine.group, GROUP_COMBINES),
                width=group,
                value=x.name,
                shape=v.type.shape if v.type else (),
                out=writer,
            )
        )
    return out, [e for e in ctx.st.body if id(e) in keep]
