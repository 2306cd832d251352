"""What the program generators ask of the op registry: operand domains and type rules.

What it does: `positive_args(op)` finds by probing an op's NumPy impl which operands must be positive
(log, sqrt, rsqrt, the divisor of div), so a new op gets its domain without a hand-written list;
`differentiable_ops()` lists the registry's differentiable ops; `try_rule` asks an op's type rule
whether it accepts operand types (None if not); `op_source` writes a call in the surface syntax.
What it does not: draw anything (programs.py, op_programs.py do).
Invariant: everything here is derived from the registry; no op is named.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from coda_lang.core.diagnostics import Mistake
from coda_lang.frontend.syntax.printer import op_call_source
from coda_lang.ir.types import Type, shape_str
from coda_lang.ops import REGISTRY, Ctx, Locality, OpDef


def positive_args(op: OpDef) -> frozenset[int]:
    """Operand positions where `op`'s impl gives a non-finite value for some input in [-2, 2] (the
    others held at 1): such an operand must be positive (log, sqrt, rsqrt, the divisor of div)."""
    if op.impl is None or op.params or op.locality is not Locality.POINTWISE or op.nin == 0:
        return frozenset()
    probe = np.linspace(-2.0, 2.0, 9)  # holds 0
    out = set()
    with np.errstate(all="ignore"):
        for i in range(op.nin):
            args = [np.ones_like(probe) for _ in range(op.nin)]
            args[i] = probe
            y = np.asarray(op.impl(*args))
            if y.dtype.kind == "f" and not np.all(np.isfinite(y)):
                out.add(i)
    return frozenset(out)


def differentiable_ops() -> list[OpDef]:
    return sorted((op for op in REGISTRY.values() if op.differentiable), key=lambda op: op.name)


def op_source(op: OpDef, args: list[str], params: dict[str, Any]) -> str:
    """The call in the surface syntax, as the IR printer writes it."""
    unknown = set(params) - {spec.name for spec in op.params}
    assert not unknown, f"{op.name} has no parameters {unknown}"
    return op_call_source(op, args, params)


def param_decl(t: Type) -> str:
    return "f32" + (shape_str(t.shape) if t.shape else "")


def try_rule(op: OpDef, ctx: Ctx, types: tuple[Type, ...], params: dict[str, Any]) -> tuple[Type, ...] | None:
    assert op.type_rule is not None
    try:
        outs = op.type_rule(ctx, types, {k: v for k, v in params.items() if v is not None})
    except Mistake:
        return None
    return None if any(t.is_error for t in outs) else tuple(outs)
