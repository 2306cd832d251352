"""Pointwise ops: arithmetic, comparisons, math functions, where, cast.

What it does: registers each pointwise op with its type rule (dtype promotion + broadcasting of
scalars, vectors and tiles), its locality class ("pointwise") and its NumPy implementation.
What it does not: reductions, pairs, indices (see reductions.py and structural.py).
Invariants: NumPy impls compute in the dtype of their inputs (f32 in a stage, f64 in the gradient
mode) and never round to a storage dtype; the interpreter does that.
"""

from __future__ import annotations

import math
from typing import Any

from coda_lang.ir.types import BOOL, ERROR_TYPE, FLOAT_DTYPES, INT_DTYPES, Type, promote
from coda_lang.ops.registry import Ctx, OpDef, ParamSpec, broadcast, np, register
from coda_lang.verify.diagnostics import Mistake


def _numeric(types: tuple[Type, ...], what: str) -> None:
    for i, t in enumerate(types):
        if t.dtype == BOOL:
            raise Mistake("E0302", f"{what} of a comparison result (bool)", arg=i,
                          notes=["use where(cond, a, b) to turn a condition into numbers"])


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


def _pointwise(name: str, surface: str, nin: int, rule: Any, impl: Any, *, infix: str | None = None,
               differentiable: bool = True, params: tuple[ParamSpec, ...] = ()) -> OpDef:
    return register(OpDef(name, surface, nin, type_rule=rule, locality="pointwise", impl=impl,
                          infix=infix, differentiable=differentiable, params=params))


# Arithmetic (infix). Integer operands stay integer except for `/`.
_pointwise("add", "add", 2, _arith, lambda a, b: a + b, infix="+")
_pointwise("sub", "sub", 2, _arith, lambda a, b: a - b, infix="-")
_pointwise("mul", "mul", 2, _arith, lambda a, b: a * b, infix="*")
_pointwise("div", "div", 2, _floating, lambda a, b: a / b, infix="/")
_pointwise("neg", "neg", 1, _arith, lambda a: -a, infix="neg")
_pointwise("maximum", "max", 2, _arith, lambda a, b: np.maximum(a, b))
_pointwise("minimum", "min", 2, _arith, lambda a, b: np.minimum(a, b))
_pointwise("abs", "abs", 1, _arith, lambda a: np.abs(a))

# Comparisons give a bool, usable only as the condition of where().
for _name, _sym, _fn in [
    ("lt", "<", lambda a, b: a < b), ("le", "<=", lambda a, b: a <= b),
    ("gt", ">", lambda a, b: a > b), ("ge", ">=", lambda a, b: a >= b),
    ("eq", "==", lambda a, b: a == b), ("ne", "!=", lambda a, b: a != b),
]:
    _pointwise(_name, _name, 2, _compare, _fn, infix=_sym, differentiable=False)

_pointwise("where", "where", 3, _where, lambda c, a, b: np.where(c, a, b))


def _sigmoid(x: Any) -> Any:
    # exp of a non-positive number only, so no overflow warnings for large |x|.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


_GELU_C = math.sqrt(2.0 / math.pi)

# Math functions: float in, f32 out.
_pointwise("exp", "exp", 1, _floating, lambda x: np.exp(x))
_pointwise("log", "log", 1, _floating, lambda x: np.log(x))
_pointwise("sqrt", "sqrt", 1, _floating, lambda x: np.sqrt(x))
_pointwise("rsqrt", "rsqrt", 1, _floating, lambda x: 1 / np.sqrt(x))
_pointwise("tanh", "tanh", 1, _floating, lambda x: np.tanh(x))
_pointwise("sigmoid", "sigmoid", 1, _floating, _sigmoid)
_pointwise("silu", "silu", 1, _floating, lambda x: x * _sigmoid(x))
def _gelu(x: Any) -> Any:
    x = np.asarray(x)
    c, k = x.dtype.type(_GELU_C), x.dtype.type(0.044715)
    return 0.5 * x * (1 + np.tanh(c * (x + k * x * x * x)))


_pointwise("gelu", "gelu", 1, _floating, _gelu)
_pointwise("sin", "sin", 1, _floating, lambda x: np.sin(x))
_pointwise("cos", "cos", 1, _floating, lambda x: np.cos(x))

def _cast_impl(x: Any, dtype: str, precision: str = "exact") -> Any:
    """Round to `dtype` (no-op for floats in the f64 gradient-check precision); i32 truncates."""
    from coda_lang.interp.numerics import round_to

    x = np.asarray(x)
    if dtype == "i32":
        return np.trunc(x).astype(np.int32) if x.dtype.kind == "f" else x.astype(np.int32)
    return round_to(x.astype(np.float64 if precision == "f64" else np.float32), dtype, precision)


# cast(x, bf16): rounds to the dtype (the value is still computed in f32 afterwards).
_pointwise("cast", "cast", 1, _cast, _cast_impl,
           params=(ParamSpec("dtype", "dtype", required=True, positional=True),),
           differentiable=True)

CAST_TARGETS = FLOAT_DTYPES + INT_DTYPES


def _copy(ctx: Ctx, ins: tuple[Type, ...], params: dict[str, Any]) -> tuple[Type, ...]:
    (t,) = ins
    if t.is_error:
        return (ERROR_TYPE,)
    return (broadcast(ctx, ins, promote(t.dtype)),)


# `y = x`: a named copy (an output that is exactly `acc`, an alias of a parameter).
_pointwise("copy", "copy", 1, _copy, lambda x: x, infix="=")
