"""Ops that move values between columns: pairs, interleave, expand, fold, and the row/column indices.

What it does: registers `pairs` (adjacent columns -> two half-width tiles), `interleave` (the inverse),
`expand` (a value broadcast to another's shape; a vector over a dim of fixed size repeated to a
longer vector), `fold` (the adjoint of that repetition: a vector's runs of G values summed into G,
between stages) and `row_index()` / `col_index()` (i32 vectors of global indices), with type rules
and NumPy impls.
What it does not: anything pointwise or reducing.
Invariants: pairs and interleave are exact inverses; both are PAIR-local (a value reads only its
own column and its pair partner: pairs splits a value into its two lanes, interleave joins two), and
both need an even width that the checker can prove; `fold` and the repeating `expand` are adjoint
(sum(fold(x) * g) == sum(x * expand(g, x))).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from coda_lang.core.diagnostics import Mistake
from coda_lang.ir.types import (
    BOOL,
    ERROR_TYPE,
    GROUP,
    MATRIX,
    SCALAR,
    TILE,
    VEC,
    Dim,
    Type,
    promote,
    shape_str,
)
from coda_lang.ops.registry import (
    Bound,
    BoundRule,
    Ctx,
    Lanes,
    Locality,
    Lowerings,
    OpDef,
    ParamSpec,
    Role,
    as_tensor,
    as_tensors,
    broadcast,
    check_repeat,
    fixed_size,
    np,
    register,
    repeats_in,
    require_tile,
    torch,
)


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
        name="pairs",
        nin=1,
        nout=2,
        type_rule=_pairs,
        locality=Locality.PAIR,
        impl=_pairs_impl,
        vjp=_pairs_vjp,
        lanes=Lanes.SPLIT,
        lower=Lowerings(cute=lambda z: ((z[0],), (z[1],)), torch=_pairs_impl),
        operand_names=("z",),
        doc="`a, b = pairs(z)`: the even and the odd columns of z (interleaved gate/up, RoPE pairs)",
    )
)
register(
    OpDef(
        name="interleave",
        nin=2,
        type_rule=_interleave,
        locality=Locality.PAIR,
        impl=_interleave_impl,
        vjp=_interleave_vjp,
        lanes=Lanes.JOIN,
        lower=Lowerings(cute=lambda a, b: ((a[0], b[0]),), torch=_interleave_torch),
        doc="the inverse of pairs: a's and b's columns alternating, twice as wide",
    )
)


def _expand(ctx: Ctx, ins: tuple[Type, ...], params: dict[str, Any]) -> tuple[Type, ...]:
    x, like = ins
    if x.is_error or like.is_error:
        return (ERROR_TYPE,)
    if x.kind == MATRIX and ctx.stage is not None:  # a matrix read over its groups (a block scale)
        space = ctx.stage
        whole = like.kind == TILE and like.shape == (space.rows, space.cols)
        if not whole and space.lines_up(x.shape):
            x = x.with_kind(TILE)  # (a tile of the stage after all: `expand(t, g)` below)
            ins = (x, like)
        elif not whole:
            raise Mistake(
                "E0505",
                f"expand() of a matrix {shape_str(x.shape)} reads it over the groups of the stage's tile "
                f"{shape_str((space.rows, space.cols))}; its second operand must be such a tile",
                arg=1,
                help=["write `expand(s, acc)`"],
            )
        else:
            return (Type(promote(x.dtype), like.shape, TILE),)
    if like.kind == GROUP and x.kind == TILE:  # a tile of one column per group, read as a grouped value
        if x.shape != like.shape:
            raise Mistake(
                "E0402", f"expand() of a tile {shape_str(x.shape)} to a grouped value {shape_str(like.shape)}"
            )
        return (Type(promote(x.dtype), like.shape, GROUP, group=like.group, group_axis=like.group_axis),)
    if (
        x.kind == VEC
        and like.kind == VEC
        and x.shape != like.shape
        and fixed_size(ctx, x.shape[0]) is not None
    ):
        # a vector over a dim of fixed size repeated to the length of another vector: between stages, or
        # inside one to a column vector (docs/language.md, "Vectors that repeat")
        d, w = x.shape[0], like.shape[0]
        st = ctx.stage
        if st is None or (w in st.col_widths() and w != st.rows and repeats_in(d, st.rows, st.cols)):
            check_repeat(ctx, d, w)
            return (Type(promote(x.dtype), (w,), VEC),)
    return (broadcast(ctx, ins, promote(x.dtype)),)


# expand(x, like): x broadcast to the shape of x and `like` broadcast together (the values of `like` are
# not read): `expand(r, acc)` is a tile, `expand(r, col_index())` too (a row vector and a column vector
# make a tile), `expand(s, acc)` of a matrix [rows/gr, cols/gc] reads it over its groups (a block scale:
# the executors repeat it where they load it), `expand(t, g)` reads a tile of one column per group as a
# grouped value, and `expand(g,
# v)` of a vector g over a dim of fixed size G and a longer vector v repeats g (element j is g[j mod G]).
# Autodiff uses it to materialize a cotangent that is a vector or scalar where a whole tile is needed,
# and as the VJP of fold. The impls repeat a 1-D x that is shorter than a 1-D like; the executors
# repeat such a vector inside a stage themselves (they know the tile's columns).
def _expand_impl(x: Any, like: Any) -> Any:
    if np.ndim(x) == 1 and np.ndim(like) == 1 and np.shape(x) != np.shape(like):
        return np.asarray(x)[np.arange(np.shape(like)[0]) % np.shape(x)[0]]
    return np.broadcast_to(x, np.broadcast_shapes(np.shape(x), np.shape(like))).copy()


def _expand_torch(x: Any, like: Any) -> Any:
    x, like = as_tensor(x), as_tensor(like)
    if x.dim() == 1 and like.dim() == 1 and x.shape != like.shape:
        return x.repeat(like.shape[0] // x.shape[0])
    return torch.broadcast_to(x, torch.broadcast_shapes(x.shape, like.shape)).clone()


register(
    OpDef(
        name="expand",
        nin=2,
        type_rule=_expand,
        locality=Locality.POINTWISE,
        roles=(Role.VALUE, Role.SHAPE),
        impl=_expand_impl,
        vjp=lambda b, p, ct: [ct, None],
        bound=Bound(rule=BoundRule.BROADCAST),
        random_programs=False,  # it makes tiles of equal columns: a max over them ties
        reads_groups=True,
        lower=Lowerings(cute=lambda x, like: x, torch=_expand_torch),
        operand_names=("x", "like"),
        doc="x broadcast to the shape of x and `like` together (like's values are not read); in a stage, "
        "`expand(s, acc)` of a matrix whose extents are the tile's divided by whole group sizes reads each "
        "group's element (a block scale)",
    )
)


def _fold(ctx: Ctx, ins: tuple[Type, ...], params: dict[str, Any]) -> tuple[Type, ...]:
    (x,) = ins
    if x.is_error:
        return (ERROR_TYPE,)
    if x.dtype == BOOL:
        raise Mistake("E0302", "fold() of a comparison result (bool)", arg=0)
    if ctx.stage is not None:
        raise Mistake(
            "E0507",
            "fold() runs between stages, on a complete vector",
            arg=0,
            notes=[
                "inside a stage a vector's columns are spread over the tiles; it is complete after the stage"
            ],
            help=[
                "reduce over the rows in the stage (`s = sum(t, over=M)`), then `fold(s, into=HD)` after it"
            ],
        )
    if x.kind == MATRIX:
        raise Mistake("E0502", "fold() of a matrix between stages")
    if x.kind != VEC:
        raise Mistake("E0404", f"fold() of a {x.kind}: it folds a vector", arg=0)
    into: Dim = params["into"]
    g = fixed_size(ctx, into)
    if g is None:
        raise Mistake(
            "E0410",
            f"fold() into `{into}`, which has no fixed size",
            help=[f"declare the dim with its size: `dims ..., {into.name or 'G'} = 128`"],
        )
    w = fixed_size(ctx, x.shape[0])
    if w is not None and w % g:
        raise Mistake(
            "E0410",
            f"fold() of a vector over `{x.shape[0]}` ({w} values) into `{into}` ({g}): not a multiple",
            arg=0,
        )
    return (Type(promote(x.dtype), (into,), VEC),)


def _fold_impl(x: Any, n: int) -> Any:
    """out[j] = sum over k of x[k*n + j] (the vector's length is a multiple of n: checked when bound)."""
    x = np.asarray(x)
    return x.reshape(-1, n).sum(axis=0)


# fold(x, into=G): the adjoint of repeating a vector over G across longer columns (`acc * g`, `expand(g, v)`):
# the gradient of such a g is the column sums of its cotangent folded into G. A "vector" op: it runs
# between stages only, on a complete vector; its impl and stand-in take the size of G.
register(
    OpDef(
        name="fold",
        nin=1,
        params=(ParamSpec("into", "dim", required=True),),
        type_rule=_fold,
        locality=Locality.VECTOR,
        impl=_fold_impl,
        vjp=lambda b, p, ct: [b.op("expand", ct, p.x[0])],
        linear=True,
        bound=Bound(rule=BoundRule.FOLD),
        random_programs=False,  # it folds into a dim of fixed size; random forward blocks declare none
        lower=Lowerings(torch=lambda x, n: as_tensor(x).reshape(-1, n).sum(0)),
        doc="a vector's runs of D values added up, `out[j] = sum_k x[k*D + j]` (D of fixed size; between "
        "stages): the gradient of a vector over D that repeats across wider columns",
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
for _name, _axis, _doc in [
    ("row_index", 0, "the global row index of each row of the stage's tile (i32)"),
    ("col_index", 1, "the global column index of each column of the stage's tile (i32)"),
]:
    register(
        OpDef(
            name=_name,
            nin=0,
            type_rule=_index_rule(_axis),
            locality=Locality.INDEX,
            index_axis=_axis,
            impl=lambda start, n: np.arange(start, start + n, dtype=np.int32),
            differentiable=False,
            random_programs=False,  # piecewise constant
            doc=_doc,
        )
    )
