"""Ops that move values between columns: pairs, interleave, and the row/column indices.

What it does: registers `pairs` (adjacent columns -> two half-width tiles), `interleave` (the inverse)
and `row_index()` / `col_index()` (i32 vectors of global indices), with type rules and NumPy impls.
What it does not: anything pointwise or reducing.
Invariants: pairs and interleave are exact inverses; both are "pair"-local (a value reads only its
own column and its pair partner), and both need an even width that the checker can prove.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from coda_lang.ir.types import ERROR_TYPE, GROUP, SCALAR, TILE, VEC, Dim, Type, promote, shape_str
from coda_lang.ops.registry import (
    Ctx,
    OpDef,
    as_tensor,
    as_tensors,
    broadcast,
    np,
    register,
    require_tile,
    torch,
)
from coda_lang.verify.diagnostics import Mistake


def provably_even(ctx: Ctx, width: Dim) -> bool | None:
    """True if `width` is even for every allowed size of its dim, False if it is known odd."""
    if width.name is None:
        n = width.coeff
        return n.denominator == 1 and n.numerator % 2 == 0
    if width.name in ctx.values:
        n = width.coeff * ctx.values[width.name]
        if n.denominator != 1:
            return False
        return n.numerator % 2 == 0
    c = width.coeff * ctx.divisors.get(width.name, 1)
    if c.denominator == 1 and c.numerator % 2 == 0:
        return True
    return None


def _pairs(ctx: Ctx, ins: tuple[Type, ...], params: dict[str, Any]) -> tuple[Type, ...]:
    (t,) = ins
    if t.is_error:
        return (ERROR_TYPE, ERROR_TYPE)
    require_tile(t, "pairs()")
    assert ctx.stage is not None
    rows, width = t.shape
    if width not in (ctx.stage.cols, ctx.stage.cols.scale(2)):
        raise Mistake(
            "E0505",
            f"pairs() of a tile of width `{width}`; the stage's tile is {shape_str((ctx.stage.rows, ctx.stage.cols))}",
            notes=["pairs() splits the stage's full-width tile (or an interleaved double-width one)"],
        )
    even = provably_even(ctx, width)
    if even is not True:
        why = "is odd" if even is False else "may be odd"
        hint = (
            f"declare the width as an even multiple, e.g. `2*{width.name}`, so that it is even for every size"
            if width.name
            else "pairs() needs an even number of columns"
        )
        raise Mistake(
            "E0403", f"pairs() needs an even number of columns, and `{width}` {why}", arg=0, help=[hint]
        )
    half = Type("f32", (rows, width.scale(Fraction(1, 2))), TILE)
    return (half, half)


def _interleave(ctx: Ctx, ins: tuple[Type, ...], params: dict[str, Any]) -> tuple[Type, ...]:
    if any(t.is_error for t in ins):
        return (ERROR_TYPE,)
    # One operand may be a scalar or vector broadcast over the other's tile (e.g. interleave(dg, 0.0)).
    tiles = [t for t in ins if t.kind == TILE]
    if not tiles:
        require_tile(ins[0] if ins[0].kind != SCALAR else ins[1], "interleave()")
        raise Mistake("E0506", "interleave() needs a tile", arg=0)
    a, b = ins
    if a.kind == TILE and b.kind == TILE and a.shape != b.shape:
        raise Mistake("E0402", f"interleave() of tiles {shape_str(a.shape)} and {shape_str(b.shape)}", arg=1)
    assert ctx.stage is not None
    rows, width = broadcast(ctx, ins, "f32").shape
    wide = width.scale(2)
    if wide not in (ctx.stage.cols, ctx.stage.cols.scale(2)):
        raise Mistake(
            "E0505",
            f"interleave() would make a tile of width `{wide}` in a stage of width `{ctx.stage.cols}`",
        )
    return (Type("f32", (rows, wide), TILE),)


def _pairs_impl(z: Any) -> tuple[Any, Any]:
    return z[..., 0::2], z[..., 1::2]


def _interleave_impl(a: Any, b: Any) -> Any:
    a, b = np.broadcast_arrays(a, b)
    out = np.empty(a.shape[:-1] + (2 * a.shape[-1],), dtype=np.result_type(a, b))
    out[..., 0::2] = a
    out[..., 1::2] = b
    return out


def _pairs_vjp(b: Any, p: Any, ct: list[Any]) -> list[Any]:
    zero = b.lit(0.0)
    return [b.op("interleave", ct[0] if ct[0] is not None else zero, ct[1] if ct[1] is not None else zero)]


def _interleave_vjp(b: Any, p: Any, ct: Any) -> list[Any]:
    return list(b.ops("pairs", ct))


# CuTeDSL emitters of the pair ops work on lanes (quack's acc_pair mode: a full-width value is a pair of
# adjacent columns, one expression per lane): pairs maps its operand's lanes to one lane per result,
# interleave two values to the lanes of one.
def _interleave_torch(a: Any, b: Any) -> Any:
    a, b = torch.broadcast_tensors(*as_tensors(a, b))
    return torch.stack((a, b), dim=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])


register(
    OpDef(
        "pairs",
        "pairs",
        1,
        nout=2,
        type_rule=_pairs,
        locality="pair",
        impl=_pairs_impl,
        vjp=_pairs_vjp,
        emit=lambda z: ((z[0],), (z[1],)),
        torch=_pairs_impl,
        doc="`a, b = pairs(z)`: the even and the odd columns of z (interleaved gate/up, RoPE pairs)",
    )
)
register(
    OpDef(
        "interleave",
        "interleave",
        2,
        type_rule=_interleave,
        locality="pair",
        impl=_interleave_impl,
        vjp=_interleave_vjp,
        emit=lambda a, b: ((a[0], b[0]),),
        torch=_interleave_torch,
        doc="the inverse of pairs: a's and b's columns alternating, twice as wide",
    )
)


def _expand(ctx: Ctx, ins: tuple[Type, ...], params: dict[str, Any]) -> tuple[Type, ...]:
    x, like = ins
    if x.is_error or like.is_error:
        return (ERROR_TYPE,)
    if like.kind == GROUP and x.kind == TILE:  # a tile of one column per group, read as a grouped value
        if x.shape != like.shape:
            raise Mistake(
                "E0402", f"expand() of a tile {shape_str(x.shape)} to a grouped value {shape_str(like.shape)}"
            )
        return (Type(promote(x.dtype), like.shape, GROUP, group=like.group),)
    return (broadcast(ctx, ins, promote(x.dtype)),)


# expand(x, like): x broadcast to the shape of x and `like` broadcast together (the values of `like` are
# not read): `expand(r, acc)` is a tile, `expand(r, col_index())` too (a row vector and a column vector
# make a tile), and `expand(t, g)` reads a tile of one column per group as a grouped value. Autodiff
# uses it to materialize a cotangent that is a vector or scalar where a whole tile is needed.
def _expand_torch(x: Any, like: Any) -> Any:
    x, like = as_tensor(x), as_tensor(like)
    return torch.broadcast_to(x, torch.broadcast_shapes(x.shape, like.shape)).clone()


register(
    OpDef(
        "expand",
        "expand",
        2,
        type_rule=_expand,
        locality="pointwise",
        impl=lambda x, like: np.broadcast_to(x, np.broadcast_shapes(np.shape(x), np.shape(like))).copy(),
        vjp=lambda b, p, ct: [ct, None],
        emit=lambda x, like: x,
        torch=_expand_torch,
        doc="x broadcast to the shape of x and `like` together (like's values are not read)",
    )
)


def _index_rule(axis: int) -> Any:
    def rule(ctx: Ctx, ins: tuple[Type, ...], params: dict[str, Any]) -> tuple[Type, ...]:
        if ctx.stage is None:
            raise Mistake(
                "E0506",
                f"{('row_index', 'col_index')[axis]}() is only defined inside a stage",
                notes=["between stages, there is no tile to index"],
            )
        dim = ctx.stage.rows if axis == 0 else ctx.stage.cols
        return (Type("i32", (dim,), VEC),)

    return rule


# The impls receive the stage's (row offset, row count) or (column offset, column count) of the
# tile being computed; the interpreter passes the whole range in whole-matrix mode. They have no
# emitter or torch stand-in: each executor knows where its tile sits (the epilogue's coordinates).
register(
    OpDef(
        "row_index",
        "row_index",
        0,
        type_rule=_index_rule(0),
        locality="index",
        differentiable=False,
        impl=lambda start, n: np.arange(start, start + n, dtype=np.int32),
        doc="the global row index of each row of the stage's tile (i32)",
    )
)
register(
    OpDef(
        "col_index",
        "col_index",
        0,
        type_rule=_index_rule(1),
        locality="index",
        differentiable=False,
        impl=lambda start, n: np.arange(start, start + n, dtype=np.int32),
        doc="the global column index of each column of the stage's tile (i32)",
    )
)
