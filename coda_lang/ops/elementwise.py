"""Pointwise ops: arithmetic, comparisons, math functions, where, cast.

What it does: registers each pointwise op with its type rule (dtype promotion + broadcasting of
scalars, vectors and tiles), its locality class (POINTWISE), its NumPy implementation, its VJP, the
facts passes ask of it (exact, commutative, a comparison, ...), its rounding-bound rule and its
lowerings (CuTeDSL, Triton, torch).
What it does not: reductions, pairs, indices (see reductions.py and structural.py).
Invariants: NumPy impls compute in the dtype of their inputs (f32 in a stage, f64 in the gradient
mode) and never round to a storage dtype; the interpreter does that.
"""

from __future__ import annotations

import math
from typing import Any

from coda_lang.core.diagnostics import Mistake
from coda_lang.ir.types import BOOL, ERROR_TYPE, FLOAT_DTYPES, FP8_DTYPES, INT_DTYPES, Type, is_fp8, promote
from coda_lang.ops.registry import (
    FASTMATH_ROUNDING,
    Arith,
    Bound,
    BoundRule,
    Ctx,
    Locality,
    Lowerings,
    OpDef,
    ParamSpec,
    Role,
    as_tensor,
    as_tensors,
    broadcast,
    ieee_rounding,
    np,
    register,
    torch,
    torch_round,
    unary,
)


def _numeric(types: tuple[Type, ...], what: str) -> None:
    for i, t in enumerate(types):
        if t.dtype == BOOL:
            raise Mistake(
                "E0302",
                f"{what} of a comparison result (bool)",
                arg=i,
                notes=["use where(cond, a, b) to turn a condition into numbers"],
            )


def _arith(ctx: Ctx, ins: tuple[Type, ...], params: dict[str, Any]) -> tuple[Type, ...]:
    if any(t.is_error for t in ins):
        return (ERROR_TYPE,)
    _numeric(ins, "arithmetic")
    return (broadcast(ctx, ins, promote(*(t.dtype for t in ins))),)


def _floating(ctx: Ctx, ins: tuple[Type, ...], params: dict[str, Any]) -> tuple[Type, ...]:
    if any(t.is_error for t in ins):
        return (ERROR_TYPE,)
    _numeric(ins, "arithmetic")
    return (broadcast(ctx, ins, "f32"),)


def _compare(ctx: Ctx, ins: tuple[Type, ...], params: dict[str, Any]) -> tuple[Type, ...]:
    if any(t.is_error for t in ins):
        return (ERROR_TYPE,)
    _numeric(ins, "a comparison")
    return (broadcast(ctx, ins, BOOL),)


def _where(ctx: Ctx, ins: tuple[Type, ...], params: dict[str, Any]) -> tuple[Type, ...]:
    if any(t.is_error for t in ins):
        return (ERROR_TYPE,)
    if ins[0].dtype != BOOL:
        raise Mistake("E0302", f"the condition of where() must be a comparison, got {ins[0].dtype}", arg=0)
    _numeric(ins[1:], "where")
    return (broadcast(ctx, ins, promote(ins[1].dtype, ins[2].dtype)),)


def _cast(ctx: Ctx, ins: tuple[Type, ...], params: dict[str, Any]) -> tuple[Type, ...]:
    if ins[0].is_error:
        return (ERROR_TYPE,)
    t = broadcast(ctx, ins, params["dtype"])
    return (t,)


# CuTeDSL emitters (backend_cute/plan/emit.py): `Lowerings.cute(*operands, **params)` maps the operands'
# Python expressions (names or literals: the emitted code is flat) to the expression of one f32 element.
# The emitted module always has `cute`, `cutlass`, `Float32`, `BFloat16`, `Float16` and `Int32`; any other
# name an emitter uses comes with its import (`cute_imports=`), fastmath where quack's own epilogues use it.
def _fn(name: str, **kw: str) -> Any:
    extra = "".join(f", {k}={v}" for k, v in kw.items())
    return lambda *xs: f"{name}({', '.join(xs)}{extra})"


def _quack(module: str, name: str) -> dict[str, Any]:
    """The CuTeDSL lowering of a function of quack's (`from quack.<module> import <name>`) and its import."""
    return {"cute": _fn(name), "cute_imports": ((name, f"from quack.{module} import {name}"),)}


def _epi(name: str) -> dict[str, Any]:
    """The CuTeDSL lowering of a function of coda_lang's epilogue ops (backend_cute/plan/epi_ops.py) and
    its import."""
    return {
        "cute": _fn(name),
        "cute_imports": ((name, f"from coda_lang.backend_cute.plan.epi_ops import {name}"),),
    }


def _cast_emit(x: str, dtype: str) -> str:
    if dtype == "i32":
        raise Mistake("E0703", "cast() to i32 has no CuTeDSL emitter yet")
    if is_fp8(dtype):
        raise Mistake("E0703", f"cast() to {dtype} has no CuTeDSL emitter yet (fp8 is emulated only)")
    return {"f32": f"Float32({x})", "bf16": f"Float32(BFloat16({x}))", "f16": f"Float32(Float16({x}))"}[dtype]


# VJP rules: `vjp(b, p, ct)` returns one cotangent per input (None: no gradient), written with other
# ops through the builder `b` (coda_lang/autodiff/builder.py); `p.x[i]` / `p.y[i]` are the primal
# inputs / outputs, loaded or recomputed on demand. Broadcasting is undone centrally by autodiff.
# Torch stand-ins (`Lowerings.torch`) take tensors or Python numbers (operands of a vector op between
# stages may be plain numbers), and compute what `impl` computes.
# Own roundings (`Bound.own`, interp/bound.py) of the ops that fast math approximates beyond the
# default's few ulps:
_DIV_APPROX = Bound(rule=BoundRule.QUOTIENT, own=lambda ax, ay: 2.0**-22 * ay)  # div.approx
# tanh.approx.f32: a relative error of 2^-11 (GELU: of its tanh, times x/2)
_TANH_APPROX = Bound(own=lambda ax, ay: 2.0**-10 * (ay + ax))
# approximations with an absolute error (softplus, erf)
_ABSOLUTE = Bound(own=lambda ax, ay: 2.0**-20 * (ay + 1.0 + ax))
# sin and cos: the epilogue's reduction is exact at any argument (a slow path beyond 2^23:
# backend_cute/plan/epi_ops.py), then sin.approx/cos.approx (2^-20.9): absolute, whatever the argument
# (1-Lipschitz, and never more than 2 apart: an operand that may move by a period may land anywhere)
_TRIG = Bound(own=lambda ax, ay: 2.0**-20 * (ay + 1.0), moved=lambda x, e: np.minimum(e, 2.0))


# Arithmetic (infix). Integer operands stay integer except for `/`.
register(
    OpDef(
        name="add",
        nin=2,
        infix="+",
        type_rule=_arith,
        locality=Locality.POINTWISE,
        impl=lambda a, b: a + b,
        vjp=lambda b, p, ct: [ct, ct],
        exact=True,
        commutative=True,
        bound=Bound(rule=BoundRule.SUM, own=ieee_rounding),
        lower=Lowerings(
            cute=lambda a, b: f"{a} + {b}",
            triton=lambda a, b: f"({a} + {b})",
            torch=lambda a, b: a + b,
        ),
        doc="a + b",
    )
)
register(
    OpDef(
        name="sub",
        nin=2,
        infix="-",
        type_rule=_arith,
        locality=Locality.POINTWISE,
        impl=lambda a, b: a - b,
        vjp=lambda b, p, ct: [ct, b.neg(ct)],
        exact=True,
        bound=Bound(rule=BoundRule.SUM, own=ieee_rounding),
        lower=Lowerings(
            cute=lambda a, b: f"{a} - {b}",
            triton=lambda a, b: f"({a} - {b})",
            torch=lambda a, b: a - b,
        ),
        doc="a - b",
    )
)
register(
    OpDef(
        name="mul",
        nin=2,
        infix="*",
        type_rule=_arith,
        locality=Locality.POINTWISE,
        impl=lambda a, b: a * b,
        vjp=lambda b, p, ct: [b.mul(ct, p.x[1]), b.mul(ct, p.x[0])],
        exact=True,
        commutative=True,
        arith=Arith.PRODUCT,
        bound=Bound(rule=BoundRule.PRODUCT, own=ieee_rounding),
        lower=Lowerings(
            cute=lambda a, b: f"{a} * {b}",
            triton=lambda a, b: f"({a} * {b})",
            torch=lambda a, b: a * b,
        ),
        doc="a * b",
    )
)
register(
    OpDef(
        name="div",
        nin=2,
        infix="/",
        type_rule=_floating,
        locality=Locality.POINTWISE,
        impl=lambda a, b: a / b,
        vjp=lambda b, p, ct: [b.div(ct, p.x[1]), b.neg(b.div(b.mul(ct, p.y[0]), p.x[1]))],
        arith=Arith.QUOTIENT,
        bound=_DIV_APPROX,
        lower=Lowerings(
            cute=lambda a, b: f"{a} / {b}",
            triton=lambda a, b: f"tl.math.div_rn({a}, {b})",
            torch=lambda a, b: as_tensor(a) / b,
        ),
        doc="a / b, always floating",
    )
)
register(
    OpDef(
        name="neg",
        nin=1,
        infix="neg",
        type_rule=_arith,
        locality=Locality.POINTWISE,
        impl=lambda a: -a,
        vjp=lambda b, p, ct: [b.neg(ct)],
        exact=True,
        bound=Bound(rule=BoundRule.PASS),
        lower=Lowerings(
            cute=lambda a: f"-{a}",
            triton=lambda a: f"(-{a})",
            torch=lambda a: -a,
        ),
        doc="-x",
    )
)
register(
    OpDef(
        name="maximum",
        surface="max",
        nin=2,
        type_rule=_arith,
        locality=Locality.POINTWISE,
        impl=lambda a, b: np.maximum(a, b),
        vjp=lambda b, p, ct: _select(b, b.op("ge", p.x[0], p.x[1]), ct),
        exact=True,
        commutative=True,
        selects=True,
        bound=Bound(rule=BoundRule.LARGEST),
        lower=Lowerings(
            # NaN in, NaN out (IEEE maximum), as NumPy and torch
            cute=_fn("cute.math.max", propagate_nan="True"),
            triton=lambda a, b: f"tl.maximum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",
            torch=lambda a, b: torch.maximum(*as_tensors(a, b)),
        ),
        doc="the larger of a and b, elementwise (ties: the gradient goes to a; a NaN operand gives NaN)",
    )
)
register(
    OpDef(
        name="minimum",
        surface="min",
        nin=2,
        type_rule=_arith,
        locality=Locality.POINTWISE,
        impl=lambda a, b: np.minimum(a, b),
        vjp=lambda b, p, ct: _select(b, b.op("le", p.x[0], p.x[1]), ct),
        exact=True,
        commutative=True,
        selects=True,
        bound=Bound(rule=BoundRule.LARGEST),
        lower=Lowerings(
            cute=_fn("cute.math.min", propagate_nan="True"),
            triton=lambda a, b: f"tl.minimum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)",
            torch=lambda a, b: torch.minimum(*as_tensors(a, b)),
        ),
        doc="the smaller of a and b, elementwise (ties: the gradient goes to a; a NaN operand gives NaN)",
    )
)
register(
    OpDef(
        name="abs",
        nin=1,
        type_rule=_arith,
        locality=Locality.POINTWISE,
        impl=lambda a: np.abs(a),
        vjp=lambda b, p, ct: [b.where(b.op("ge", p.x[0], b.lit(0.0)), ct, b.neg(ct))],
        exact=True,
        selects=True,
        bound=Bound(rule=BoundRule.PASS),
        lower=Lowerings(
            cute=_fn("abs"),
            triton=lambda a: f"tl.abs({a})",
            torch=unary(lambda x: x.abs()),
        ),
        doc="|x|",
    )
)

# detach(x): x itself, through which no gradient flows (torch's .detach(), jax's stop_gradient). For a
# statistic the program records for a later step, as an fp8 recipe's amax: `amax = detach(max(row_amax,
# over=M))` gets no cotangent, so the backward neither takes one for it nor saves what a max's ties need.
register(
    OpDef(
        name="detach",
        nin=1,
        type_rule=_arith,
        locality=Locality.POINTWISE,
        impl=lambda a: a,
        differentiable=False,
        stops_gradient=True,
        exact=True,
        linear=True,
        bound=Bound(rule=BoundRule.PASS),
        # a random program's finite differences see through it, its gradient doesn't
        random_programs=False,
        lower=Lowerings(
            cute=lambda a: a,
            triton=lambda a: a,
            torch=lambda a: a,
        ),
        operand_names=("x",),
        doc="x itself; no gradient flows through it (a statistic kept for the next step: an fp8 amax)",
    )
)

# Comparisons give a bool, usable only as the condition of where(). An ordering comparison whose operands
# are closer than their rounding bounds may come out either way; == and != are judged exactly (a max's
# backward finds its ties by comparing the very values the forward compared: a tie that flips is a bug).
_ORDERING, _EQUALITY = Bound(rule=BoundRule.FLIP), Bound(rule=BoundRule.EXACT)
for _name, _sym, _impl, _symmetric in [
    ("lt", "<", lambda a, b: a < b, False),
    ("le", "<=", lambda a, b: a <= b, False),
    ("gt", ">", lambda a, b: a > b, False),
    ("ge", ">=", lambda a, b: a >= b, False),
    ("eq", "==", lambda a, b: a == b, True),
    ("ne", "!=", lambda a, b: a != b, True),
]:
    register(
        OpDef(
            name=_name,
            nin=2,
            infix=_sym,
            type_rule=_compare,
            locality=Locality.POINTWISE,
            impl=_impl,
            differentiable=False,
            compares=True,
            commutative=_symmetric,
            bound=_EQUALITY if _symmetric else _ORDERING,
            lower=Lowerings(
                cute=lambda a, b, _sym=_sym: f"{a} {_sym} {b}",
                triton=lambda a, b, _sym=_sym: f"({a} {_sym} {b})",
                torch=lambda a, b, _impl=_impl: _impl(*as_tensors(a, b)),
            ),
            doc=f"a {_sym} b: a bool, only for the condition of where()",
        )
    )


def _where_torch(c: Any, a: Any, b: Any) -> Any:
    if not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        a = torch.full((), float(a), dtype=torch.float32, device=c.device)  # no host copy: no sync
    return torch.where(c, a, b)


register(
    OpDef(
        name="where",
        nin=3,
        type_rule=_where,
        locality=Locality.POINTWISE,
        roles=(Role.CONDITION, Role.VALUE, Role.VALUE),
        impl=lambda c, a, b: np.where(c, a, b),
        vjp=lambda b, p, ct: [None, b.where(p.x[0], ct, b.lit(0.0)), b.where(p.x[0], b.lit(0.0), ct)],
        selects=True,
        bound=Bound(rule=BoundRule.BRANCH),
        lower=Lowerings(
            cute=_fn("cutlass.select_"),
            triton=lambda c, a, b: f"tl.where({c}, {a}, {b})",
            torch=_where_torch,
        ),
        doc="a where the comparison c holds, else b",
    )
)


def _select(b: Any, first: Any, ct: Any) -> list[Any]:
    """Cotangents of max/min: the chosen operand gets ct (ties go to the first)."""
    return [b.where(first, ct, b.lit(0.0)), b.where(first, b.lit(0.0), ct)]


def _silu_vjp(b: Any, x: Any, ct: Any) -> Any:
    s = b.op("sigmoid", x)  # silu'(x) = s * (1 + x * (1 - s))
    return b.mul(ct, b.mul(s, b.add(b.lit(1.0), b.mul(x, b.sub(b.lit(1.0), s)))))


def _gelu_vjp(b: Any, p: Any, ct: Any) -> Any:
    x = p.x[0]
    if p.param("approximate") == "none":  # gelu(x) = x Phi(x): gelu' = Phi(x) + x phi(x)
        phi = b.mul(b.lit(_INV_SQRT_2PI), b.op("exp", b.mul(b.lit(-0.5), b.mul(x, x))))
        cdf = b.mul(b.lit(0.5), b.add(b.lit(1.0), b.op("erf", b.mul(x, b.lit(_INV_SQRT_2)))))
        return b.mul(ct, b.add(cdf, b.mul(x, phi)))
    # gelu(x) = x/2 (1 + t), t = tanh(c (x + k x^3)); gelu' = (1 + t)/2 + x/2 (1 - t^2) c (1 + 3k x^2)
    x2 = b.mul(x, x)
    t = b.op("tanh", b.mul(b.lit(_GELU_C), b.mul(x, b.add(b.lit(1.0), b.mul(b.lit(0.044715), x2)))))
    d1 = b.mul(b.lit(0.5), b.add(b.lit(1.0), t))
    d2 = b.mul(
        b.mul(b.lit(0.5 * _GELU_C), x),
        b.mul(b.sub(b.lit(1.0), b.mul(t, t)), b.add(b.lit(1.0), b.mul(b.lit(3 * 0.044715), x2))),
    )
    return b.mul(ct, b.add(d1, d2))


def _sigmoid(x: Any) -> Any:
    # exp of a non-positive number only, so no overflow warnings for large |x|.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


_GELU_C = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
# softplus(x) is x above this (as torch's and quack's softplus: exp(-20) is below f32's resolution at 20)
SOFTPLUS_LINEAR = 20.0

# Math functions: float in, f32 out.
register(
    OpDef(
        name="exp",
        nin=1,
        type_rule=_floating,
        locality=Locality.POINTWISE,
        impl=lambda x: np.exp(x),
        vjp=lambda b, p, ct: [b.mul(ct, p.y[0])],
        # ex2.approx of x * log2(e): the product's rounding grows with |x|
        bound=Bound(own=lambda ax, ay: FASTMATH_ROUNDING * (1.0 + ax) * ay),
        lower=Lowerings(
            triton=lambda x: f"_exp({x})",
            torch=unary(lambda x: x.exp()),
            **_quack("epilogue.math", "pexp"),
        ),
        doc="e^x",
    )
)
register(
    OpDef(
        name="log",
        nin=1,
        type_rule=_floating,
        locality=Locality.POINTWISE,
        impl=lambda x: np.log(x),
        vjp=lambda b, p, ct: [b.div(ct, p.x[0])],
        lower=Lowerings(
            cute=_fn("cute.math.log", fastmath="True"),
            triton=lambda x: f"_log({x})",
            torch=unary(lambda x: x.log()),
        ),
        doc="natural logarithm",
    )
)
register(
    OpDef(
        name="sqrt",
        nin=1,
        type_rule=_floating,
        locality=Locality.POINTWISE,
        impl=lambda x: np.sqrt(x),
        vjp=lambda b, p, ct: [b.div(b.mul(ct, b.lit(0.5)), p.y[0])],
        lower=Lowerings(
            cute=_fn("cute.math.sqrt", fastmath="True"),
            triton=lambda x: f"tl.sqrt_rn({x})",
            torch=unary(lambda x: x.sqrt()),
        ),
        doc="square root",
    )
)
register(
    OpDef(
        name="rsqrt",
        nin=1,
        type_rule=_floating,
        locality=Locality.POINTWISE,
        impl=lambda x: 1 / np.sqrt(x),  # d/dx x^-1/2 = -y^3 / 2
        vjp=lambda b, p, ct: [b.mul(b.mul(ct, b.lit(-0.5)), b.mul(p.y[0], b.mul(p.y[0], p.y[0])))],
        lower=Lowerings(
            cute=_fn("cute.math.rsqrt", fastmath="True"),
            triton=lambda x: f"_rsqrt({x})",
            torch=unary(lambda x: x.rsqrt()),
        ),
        doc="1 / sqrt(x)",
    )
)
register(
    OpDef(
        name="tanh",
        nin=1,
        type_rule=_floating,
        locality=Locality.POINTWISE,
        impl=lambda x: np.tanh(x),
        vjp=lambda b, p, ct: [b.mul(ct, b.sub(b.lit(1.0), b.mul(p.y[0], p.y[0])))],
        bound=_TANH_APPROX,
        lower=Lowerings(
            triton=lambda x: f"_tanh({x})",
            torch=unary(lambda x: x.tanh()),
            **_quack("activation", "tanh"),
        ),
        doc="hyperbolic tangent",
    )
)
register(
    OpDef(
        name="sigmoid",
        nin=1,
        type_rule=_floating,
        locality=Locality.POINTWISE,
        impl=_sigmoid,
        vjp=lambda b, p, ct: [b.mul(ct, b.mul(p.y[0], b.sub(b.lit(1.0), p.y[0])))],
        lower=Lowerings(
            triton=lambda x: f"_sigmoid({x})",
            torch=unary(lambda x: x.sigmoid()),
            **_quack("activation", "sigmoid"),
        ),
        doc="1 / (1 + e^-x)",
    )
)
register(
    OpDef(
        name="silu",
        nin=1,
        type_rule=_floating,
        locality=Locality.POINTWISE,
        impl=lambda x: x * _sigmoid(x),
        vjp=lambda b, p, ct: [_silu_vjp(b, p.x[0], ct)],
        lower=Lowerings(
            triton=lambda x: f"({x} * _sigmoid({x}))",
            torch=unary(lambda x: torch.nn.functional.silu(x)),
            **_quack("activation", "silu"),
        ),
        doc="x * sigmoid(x) (SwiGLU's gate)",
    )
)


def _softplus(x: Any) -> Any:
    x = np.asarray(x)
    return np.where(x > SOFTPLUS_LINEAR, x, np.log1p(np.exp(np.minimum(x, SOFTPLUS_LINEAR))))


register(
    OpDef(
        name="softplus",
        nin=1,
        type_rule=_floating,
        locality=Locality.POINTWISE,
        impl=_softplus,
        vjp=lambda b, p, ct: [b.mul(ct, b.op("sigmoid", p.x[0]))],
        bound=_ABSOLUTE,
        lower=Lowerings(
            torch=unary(lambda x: torch.nn.functional.softplus(x, threshold=SOFTPLUS_LINEAR)),
            **_quack("activation", "softplus"),
        ),
        doc=f"log(1 + e^x) (x itself above {SOFTPLUS_LINEAR:g}, as torch's)",
    )
)


def _gelu(x: Any, approximate: str | None = None) -> Any:
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.floating):  # a dim or an integer literal: in float64, as NumPy's
        x = x.astype(np.float64)  # ufuncs take an integer (its constants below would round to 0 in it)
    if approximate == "none":
        # lazy: imports NumPy, which `coda check` and `import coda_lang` never load
        from coda_lang.core.numerics import erf

        return 0.5 * x * (1 + erf(x * x.dtype.type(_INV_SQRT_2)))
    c, k = x.dtype.type(_GELU_C), x.dtype.type(0.044715)
    return 0.5 * x * (1 + np.tanh(c * (x + k * x * x * x)))


def _gelu_torch(x: Any, approximate: str | None = None) -> Any:
    """The torch stand-in: the exact GELU as quack's gelu_erf computes it, 0.5 (x erf(x / sqrt 2) + x),
    which is inf at +inf as the interpreter's is (torch's own float32 GELU on the CPU gives NaN there);
    the tanh approximation is torch's."""
    x = as_tensor(x)
    if approximate == "none":
        return 0.5 * (x * torch.erf(x * _INV_SQRT_2) + x)
    return torch.nn.functional.gelu(x, approximate="tanh")


def _gelu_emit(x: str, approximate: str | None = None) -> str:
    return f"gelu_erf({x})" if approximate == "none" else f"gelu_tanh_approx({x})"


register(
    OpDef(
        name="gelu",
        nin=1,
        params=(ParamSpec("approximate", "choice", choices=("tanh", "none")),),
        type_rule=_floating,
        locality=Locality.POINTWISE,
        impl=_gelu,
        vjp=lambda b, p, ct: [_gelu_vjp(b, p, ct)],
        bound=_TANH_APPROX,
        lower=Lowerings(
            cute=_gelu_emit,
            cute_imports=(
                ("gelu_tanh_approx", "from quack.activation import gelu_tanh_approx"),
                ("gelu_erf", "from quack.activation import gelu_erf"),
            ),
            torch=_gelu_torch,
        ),
        doc='GELU: tanh approximation (default, or approximate="tanh"); exact with approximate="none"',
    )
)
register(
    OpDef(
        name="erf",
        nin=1,
        type_rule=_floating,
        locality=Locality.POINTWISE,
        impl=lambda x: _erf(x),
        vjp=lambda b, p, ct: [
            b.mul(ct, b.mul(b.lit(2.0 / math.sqrt(math.pi)), b.op("exp", b.neg(b.mul(p.x[0], p.x[0])))))
        ],
        bound=_ABSOLUTE,
        lower=Lowerings(
            cute=_fn("cute.math.erf"),
            torch=unary(lambda x: torch.special.erf(x)),
        ),
        doc="the error function",
    )
)
register(
    OpDef(
        name="sin",
        nin=1,
        type_rule=_floating,
        locality=Locality.POINTWISE,
        impl=lambda x: np.sin(x),
        vjp=lambda b, p, ct: [b.mul(ct, b.op("cos", p.x[0]))],
        bound=_TRIG,
        lower=Lowerings(
            triton=lambda x: f"_sin({x})",
            torch=unary(lambda x: x.sin()),
            **_epi("sin_rr"),
        ),
        doc="sine (RoPE)",
    )
)
register(
    OpDef(
        name="cos",
        nin=1,
        type_rule=_floating,
        locality=Locality.POINTWISE,
        impl=lambda x: np.cos(x),
        vjp=lambda b, p, ct: [b.neg(b.mul(ct, b.op("sin", p.x[0])))],
        bound=_TRIG,
        lower=Lowerings(
            triton=lambda x: f"_cos({x})",
            torch=unary(lambda x: x.cos()),
            **_epi("cos_rr"),
        ),
        doc="cosine (RoPE)",
    )
)


def _erf(x: Any) -> Any:
    # lazy: imports NumPy, which `coda check` and `import coda_lang` never load
    from coda_lang.core.numerics import erf

    return erf(np.asarray(x))


def _cast_impl(x: Any, dtype: str, precision: str = "exact") -> Any:
    """Round to `dtype` (no-op for floats in the f64 gradient-check precision); i32 truncates."""
    # lazy: imports NumPy, which `coda check` and `import coda_lang` never load
    from coda_lang.core.numerics import round_to

    x = np.asarray(x)
    if dtype == "i32":
        return np.trunc(x).astype(np.int32) if x.dtype.kind == "f" else x.astype(np.int32)
    return round_to(x.astype(np.float64 if precision == "f64" else np.float32), dtype, precision)


_TORCH_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


def _cast_triton(x: str, dtype: str) -> str:
    if is_fp8(dtype):  # (the stage generator refuses fp8 programs before it lowers an op)
        raise Mistake("E0703", f"cast() to {dtype} has no Triton lowering yet")
    if dtype == "i32":  # truncates toward zero, as the interpreter's cast
        return f"{x}.to(tl.int32)"
    if dtype == "f32":
        return f"{x}.to(tl.float32)"
    if dtype == "bf16":
        return f"_bf16({x})"  # the generated module's rounding to bf16 (the value stays f32)
    return f'{x}.to(tl.{_TORCH_DTYPES[dtype]}, fp_downcast_rounding="rtne").to(tl.float32)'


def _cast_torch(x: Any, dtype: str) -> Any:
    """cast(x, dtype) on torch: round to dtype (the value stays f32), or truncate to i32."""
    x = as_tensor(x)
    if dtype == "i32":
        return x.trunc().to(torch.int32) if x.is_floating_point() else x.to(torch.int32)
    return torch_round(x, dtype)


# cast(x, bf16): rounds to the dtype (the value is still computed in f32 afterwards). Its VJP passes the
# cotangent straight through (a cast to i32 has none).
register(
    OpDef(
        name="cast",
        nin=1,
        params=(ParamSpec("dtype", "dtype", required=True, positional=True),),
        type_rule=_cast,
        locality=Locality.POINTWISE,
        impl=_cast_impl,
        differentiable=True,
        vjp=lambda b, p, ct: [None if p.param("dtype") == "i32" else ct],
        rounds=True,
        bound=Bound(rule=BoundRule.ROUND),
        lower=Lowerings(
            cute=_cast_emit,
            triton=_cast_triton,
            torch=_cast_torch,
        ),
        doc="x rounded to a dtype (the value stays f32; fp8 saturates to +-max first); i32 truncates",
    )
)

CAST_TARGETS = FLOAT_DTYPES + FP8_DTYPES + INT_DTYPES


def _copy(ctx: Ctx, ins: tuple[Type, ...], params: dict[str, Any]) -> tuple[Type, ...]:
    (t,) = ins
    if t.is_error:
        return (ERROR_TYPE,)
    if ctx.stage is None and t.kind == "matrix":
        return (t,)  # between stages, `y = x` of a matrix is an alias: no computation, no kernel
    return (broadcast(ctx, ins, promote(t.dtype)),)


# `y = x`: a named copy (an output that is exactly `acc`, an alias of a parameter).
register(
    OpDef(
        name="copy",
        nin=1,
        infix="=",
        type_rule=_copy,
        locality=Locality.POINTWISE,
        impl=lambda x: x,
        vjp=lambda b, p, ct: [ct],
        copy=True,
        linear=True,
        exact=True,
        bound=Bound(rule=BoundRule.PASS),
        lower=Lowerings(
            cute=lambda x: x,
            triton=lambda x: x,
            torch=lambda x: x,
        ),
        doc="`y = x`: a named copy (or, between stages, an alias of a matrix)",
    )
)
