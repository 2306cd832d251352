"""Reductions: sum, max, min, logsumexp, mean over a dim (optionally in groups), and pick (target gather).

What it does: registers each reduction with its type rule and its combine record (registry.COMBINES:
how per-tile partials combine, sum, max, min or log-sum-exp, in NumPy, torch and quack's epilogue);
`mean` is a decomposition (sum(x / N, over=N)), not an op the later passes see.
What it does not: decide where a partial may be used (frontend/verify/locality rules do).
Invariants: inside a stage a reduction over rows or columns gives a `partial`, complete only after
every tile ran; a grouped reduction (group=g) gives a `group` value, complete inside one tile when the
tile width (over the columns: runs of g columns, [rows, W/g]) or the tile height (over the rows: runs
of g rows, [rows/g, W], `Type.group_axis` 0) is a multiple of g (the checker records that tiling
constraint); between stages a reduction of a vector gives a complete scalar.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from coda_lang.core.diagnostics import Mistake
from coda_lang.ir.nodes import DimRef, Lit
from coda_lang.ir.types import (
    BOOL,
    ERROR_TYPE,
    GROUP,
    MATRIX,
    PARTIAL,
    TILE,
    VEC,
    Dim,
    TileConstraint,
    Type,
)
from coda_lang.ops.registry import (
    COMBINES,
    Ctx,
    Locality,
    Lowerings,
    OpDef,
    ParamSpec,
    Role,
    as_tensor,
    axis_of,
    kind_name,
    np,
    register,
)


def _reduce_rule(name: str, combine: str) -> Any:
    def rule(ctx: Ctx, ins: tuple[Type, ...], params: dict[str, Any]) -> tuple[Type, ...]:
        (t,) = ins
        if t.is_error:
            return (ERROR_TYPE,)
        if t.dtype == BOOL:
            raise Mistake("E0302", f"{name}() of a comparison result (bool)", arg=0)
        dtype = "f32" if name == "logsumexp" or t.dtype != "i32" else "i32"
        over: Dim = params["over"]
        group = params.get("group")
        if ctx.stage is None:
            if t.kind == MATRIX:
                raise Mistake("E0502", f"{name}() of a matrix between stages")
            if group is not None:
                raise Mistake("E0408", "group= is for reductions over the columns of a tile inside a stage")
            if t.kind != VEC:
                raise Mistake("E0404", f"{name}() of a scalar", arg=0)
            if t.shape[0] != over:
                raise Mistake(
                    "E0404", f"{name}() over `{over}`, but the vector runs over `{t.shape[0]}`", arg=0
                )
            return (Type(dtype),)
        if t.kind == GROUP and t.group_axis == 0:
            raise Mistake("E0408", f"{name}() of a value grouped over the rows is not supported yet", arg=0)
        if t.kind == GROUP and group is None and over == t.shape[1] and over != t.shape[0]:
            # a grouped value (one per row and group) reduced over its groups: a partial per row
            return (Type(dtype, (t.shape[0],), PARTIAL, combine=combine),)
        if t.kind != TILE:
            raise Mistake(
                "E0404",
                f"{name}() inside a stage reduces a tile, got a {kind_name(t.kind)}",
                arg=0,
                notes=["reduce vectors between stages, where they are complete"],
            )
        try:
            axis = axis_of(ctx, over, t.shape, f"{name}()")
        except Mistake as m:  # point at the reduced operand
            m.arg = 0 if m.arg is None else m.arg
            raise
        if group is not None:
            if not isinstance(group, int) or group < 1:
                raise Mistake("E0408", f"group= must be a positive integer, got {group}")
            if axis == 0:
                return (_row_group(ctx, t, group, dtype),)
            width = t.shape[1]
            if width.name is None or width.name in ctx.values:  # a known width: whole groups only
                n = width.evaluate(ctx.values)
                if n % group != 0:
                    raise Mistake(
                        "E0408",
                        f"group={group} does not divide the width `{width}`, which is {n}",
                        notes=["each group is a run of `group` adjacent columns; the last one would be cut"],
                    )
            per_acc_col = (
                width.coeff / ctx.stage.cols.coeff if width.name == ctx.stage.cols.name else Fraction(1)
            )
            # The tile of the stage must hold whole groups: tile_N * (width / cols) % group == 0.
            need = Fraction(group) / per_acc_col
            ctx.constraints.append(
                TileConstraint(of="tile_N", multiple_of=need, reason=f"group={group} over `{width}`")
            )
            return (Type(dtype, (t.shape[0], width.scale(Fraction(1, group))), GROUP, group=group),)
        other = t.shape[1 - axis]
        return (Type(dtype, (other,), PARTIAL, combine=combine),)

    return rule


def _row_group(ctx: Ctx, t: Type, group: int, dtype: str) -> Type:
    """A reduction over runs of `group` adjacent rows (a 128x1 group: the scale of a column-quantized
    copy): one value per column and run, complete in a tile whose tile_M is a multiple of the group.
    Only of a tile as tall as the stage (the rows are the stage's own)."""
    rows = t.shape[0]
    if rows.name is None or rows.name in ctx.values:  # a known height: whole groups only
        n = rows.evaluate(ctx.values)
        if n % group != 0:
            raise Mistake(
                "E0408",
                f"group={group} does not divide the rows `{rows}`, which are {n}",
                notes=["each group is a run of `group` adjacent rows; the last one would be cut"],
            )
    ctx.constraints.append(
        TileConstraint(of="tile_M", multiple_of=group, reason=f"group={group} over `{rows}`")
    )
    return Type(dtype, (rows.scale(Fraction(1, group)), t.shape[1]), GROUP, group=group, group_axis=0)


def _reduce_impl(fn: str) -> Any:
    """The NumPy reduction along an axis: the fold of the op's combine record (a reduction of a whole
    tile and the combination of its per-tile partials are the same fold)."""
    fold = COMBINES[{"logsumexp": "lse"}.get(fn, fn)].numpy
    return lambda x, axis: fold(x, axis)


def _reduce_vjp(fn: str) -> Any:
    """The cotangent of a reduction broadcasts back over what it reduced (by kind: a row vector
    over the tile's columns, a group over its columns, a scalar over a vector)."""

    def vjp(b: Any, p: Any, ct: Any) -> list[Any]:
        if fn == "sum":
            return [ct]
        if fn == "logsumexp":  # the softmax
            return [b.mul(ct, b.op("exp", b.sub(p.x[0], p.y[0])))]
        # max, min: the elements that attain it share the cotangent (as in JAX and torch). The count is
        # at least 1 in exact arithmetic; on a GPU the count (an elementwise stage's math) and the mask
        # (recomputed in a GEMM epilogue, by other exp/sigmoid code) can disagree by one rounding, so it
        # is taken as at least 1: a count of 0 would make an infinite gradient (found by coda fuzz)
        mask = b.op("eq", p.x[0], p.y[0])
        count = b.op("maximum", b.ties(p, mask), b.lit(1.0))
        return [b.where(mask, b.div(ct, count), b.lit(0.0))]

    return vjp


REDUCE_PARAMS = (ParamSpec("over", "dim", required=True), ParamSpec("group", "int"))
_REDUCE_DOCS = {
    "sum": "the sum over a dim (a partial inside a stage; group=g: per run of g columns, or of g rows when "
    "over the rows, complete in the tile)",
    "max": "the maximum over a dim (as sum; ties share the gradient)",
    "min": "the minimum over a dim (as sum; ties share the gradient)",
    "logsumexp": "log(sum(exp(x))) over a dim, computed stably (as sum)",
}
for _surface, _combine in [("sum", "sum"), ("max", "max"), ("min", "min"), ("logsumexp", "lse")]:
    # The stand-in reduces a whole vector (between stages); partials fold by the combine record. The
    # CuTeDSL lowering gives the per-element value the kernel folds (the planner picks the quack sink).
    register(
        OpDef(
            name=f"reduce_{_surface}",
            surface=_surface,
            nin=1,
            params=REDUCE_PARAMS,
            type_rule=_reduce_rule(_surface, _combine),
            locality=Locality.REDUCE,
            impl=_reduce_impl(_surface),
            vjp=_reduce_vjp(_surface),
            combine=COMBINES[_combine],
            selects=_combine in ("max", "min"),  # the result is one of the elements: ties share its gradient
            lower=Lowerings(
                cute=lambda x, **params: x,
                torch=lambda x, _c=COMBINES[_combine]: _c.torch(as_tensor(x).reshape(-1), 0),
            ),
            doc=_REDUCE_DOCS[_surface],
        )
    )


def _mean(d: Any, ins: list[Any], params: dict[str, Any]) -> tuple[str, list[Any], dict[str, Any]]:
    """mean(x, over=N) is sum(x / N, over=N): each tile's partial is its share of the mean, so the
    partials combine as a sum (and group=g divides by g instead)."""
    (x,) = ins
    group = params.get("group")
    count = Lit(float(group), "f32") if group is not None else DimRef(params["over"])
    return "reduce_sum", [d.op("div", x, count)], params


register(
    OpDef(
        name="reduce_mean",
        surface="mean",
        nin=1,
        params=REDUCE_PARAMS,
        locality=Locality.REDUCE,
        combine=COMBINES["sum"],
        decompose=_mean,
        doc="the mean over a dim: sum(x / N, over=N)",
    )
)


def _pick_rule(ctx: Ctx, ins: tuple[Type, ...], params: dict[str, Any]) -> tuple[Type, ...]:
    x, idx = ins
    if x.is_error or idx.is_error:
        return (ERROR_TYPE,)
    if idx.dtype != "i32":
        raise Mistake("E0302", f"pick() needs an i32 index, got {idx.dtype}", arg=1)
    if ctx.stage is None:
        if x.kind == MATRIX:
            raise Mistake("E0502", "pick() of a matrix between stages")
        raise Mistake("E0506", "pick() selects from a tile inside a stage", arg=0)
    if x.kind != TILE:
        raise Mistake("E0506", f"pick() selects from a tile, got a {kind_name(x.kind)}", arg=0)
    if idx.kind != VEC:
        raise Mistake(
            "E0506", f"pick() needs a vector of indices (one per row), got a {kind_name(idx.kind)}", arg=1
        )
    axis = axis_of(ctx, idx.shape[0], x.shape, "pick()")
    # An index per row selects along the columns, and the other way round.
    return (Type("f32" if x.dtype != "i32" else "i32", (x.shape[axis],), PARTIAL, combine="sum"),)


def _pick_impl(x: Any, idx: Any, axis: int, start: int = 0) -> Any:
    """x[i, idx[i] - start] along `axis`, zero where the index falls outside this tile."""
    n = x.shape[axis]
    local = idx.astype(np.int64) - start
    ok = (local >= 0) & (local < n)
    safe = np.where(ok, local, 0)
    if axis == 1:
        got = np.take_along_axis(x, safe[:, None], axis=1)[:, 0]
    else:
        got = np.take_along_axis(x, safe[None, :], axis=0)[0, :]
    return np.where(ok, got, 0).astype(x.dtype)


def _pick_vjp(b: Any, p: Any, ct: Any) -> list[Any]:
    """d x = onehot(idx) * ct: where the tile's column (or row) index equals the index. The stage's
    col_index() counts its own columns; a tile of half its width (after pairs) has column k where the
    stage has columns 2k and 2k+1, one of twice its width (after interleave) columns 2j and 2j+1
    where the stage has column j (the stage may be a dgrad GEMM hosting this backward, at the width of
    another tile of the forward stage)."""
    idx = p.x[1]
    if b.type_of(idx).shape[0] != b.stage.rows:  # an index per column selects a row
        return [b.where(b.op("eq", b.op("row_index"), idx), ct, b.lit(0.0)), None]
    width = p.eqn.ins[0].type.shape[1]
    col = b.op("col_index")
    if width == b.stage.cols:
        return [b.where(b.op("eq", col, idx), ct, b.lit(0.0)), None]
    if width == b.stage.cols.scale(Fraction(1, 2)):  # the first column of each pair: 2k == 2 idx
        hit = b.where(b.op("eq", col, b.mul(idx, Lit(2, "i32"))), b.lit(1.0), b.lit(0.0))
        onehot = b.ops("pairs", hit)[0]
    else:  # columns 2j and 2j + 1 of the tile
        even = b.mul(col, Lit(2, "i32"))
        onehot = b.op(
            "interleave",
            b.where(b.op("eq", even, idx), b.lit(1.0), b.lit(0.0)),
            b.where(b.op("eq", b.add(even, Lit(1, "i32")), idx), b.lit(1.0), b.lit(0.0)),
        )
    return [b.mul(onehot, ct), None]


# pick's CuTeDSL lowering gives the per-element value; the planner folds it by quack's ColVecSelect.
register(
    OpDef(
        name="pick",
        nin=2,
        type_rule=_pick_rule,
        locality=Locality.GATHER,
        roles=(Role.VALUE, Role.INDEX),
        impl=_pick_impl,
        vjp=_pick_vjp,
        combine=COMBINES["sum"],
        lower=Lowerings(cute=lambda x, idx: x),
        operand_names=("x", "idx"),
        doc="x[i, idx[i]]: one column per row (a cross-entropy's target logit); 0 where idx is out of range",
    )
)
