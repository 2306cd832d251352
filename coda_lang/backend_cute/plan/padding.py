"""What a ragged last tile's padding holds: the value of an epilogue expression past the end of a dim.

What it does: `padding_value` evaluates, for one value of a stage, what the epilogue computes at the
elements past the end of the reduced dim in the ragged last tile (where quack's add and max_abs
reductions also fold): a number when it is the same whatever the inputs, `REAL` when it is made of real
values, None when it may be anything. The planner masks a sum over the columns there (a
Bounded*Reduce) unless its summand is known to be 0 whatever the inputs, infinities in A included
(`is_zero` of `finite=False`), and a sum over the rows unless it is 0 there for finite inputs.
What it does not: choose sinks (sinks.py) or run anything.
Invariants: pure (reads the stage's loads and definitions only); recursion is memoized per call.
"""

from __future__ import annotations

from typing import Any

from coda_lang.frontend.verify.plan import Load
from coda_lang.ir.nodes import DimRef, Eqn, Lit, Var
from coda_lang.ops import REGISTRY, Arith, Locality

REAL = object()  # a value made of real inputs, not known when planning


def is_zero(v: Any) -> bool:
    """Known to be 0 whatever the inputs."""
    return v is not REAL and v is not None and v == 0.0


def padding_value(
    name: str,
    per_row: bool,
    loads: dict[str, Load],
    defined: dict[str, Eqn],
    memo: dict[str, Any] | None = None,
    finite: bool = True,
) -> Any:
    """What `name` holds past the end of the reduced dim (the columns past N of the last column tile
    when `per_row`, else the rows past M of the last row tile): a number when it is the same
    whatever the inputs, REAL when it is made of the row's (column's) real values, None when it
    may be anything. There the tile loads are 0 (TMA fills out-of-bounds elements with zeros); a
    vector along the reduced dim holds whatever its shared memory held (quack's predicated copy
    skips those elements): None, as is a grouped value; a vector along the other dim, a scalar or a
    dim holds its real value: REAL. The accumulator is a row of A times zeros: 0 with finite inputs
    (`finite`), but inf * 0 = NaN in a row of A that holds an infinity (or a NaN), so not known
    (None) when `finite` is False, and neither is 0 * REAL then (the planner asks so: a sum it
    leaves unmasked must be 0 there whatever the inputs)."""
    memo = {} if memo is None else memo
    if name in memo:
        return memo[name]
    memo[name] = None
    value: Any = None
    if name == "acc":
        value = 0.0 if finite else None
    elif name in loads:
        role = loads[name].role
        along = "column vector" if per_row else "row vector"  # a vector along the reduced dim
        value = 0.0 if role == "tile" else None if role == along else REAL
    elif name in defined:
        e = defined[name]
        od = REGISTRY[e.op]
        ins: list[Any] = []
        for x in e.ins:
            if isinstance(x, Var):
                ins.append(padding_value(x.name, per_row, loads, defined, memo, finite))
            elif isinstance(x, DimRef):
                ins.append(REAL if x.dim.name else float(x.dim.coeff))
            elif isinstance(x, Lit) and isinstance(x.value, (int, float)):
                ins.append(float(x.value))
            else:
                ins.append(None)
        if od.reduces or any(v is None for v in ins):
            value = None
        elif (
            od.arith is Arith.PRODUCT
            and any(v is not REAL and v == 0.0 for v in ins)
            and (finite or REAL not in ins)
        ):
            value = 0.0
        elif any(v is REAL for v in ins):
            value = REAL
        elif od.copy or od.rounds:  # the operand's value (rounded: a padding value is 0 or a constant)
            value = ins[0]
        elif od.locality is Locality.PAIR:  # values moved between columns: mixed unless all the same
            value = ins[0] if all(v == ins[0] for v in ins[1:]) else REAL
        elif od.impl is not None and len(e.outs) == 1:
            import numpy as np

            try:
                with np.errstate(all="ignore"):
                    out = od.impl(*(np.float32(v) for v in ins))
                value = float(np.asarray(out, dtype=np.float64).reshape(-1)[0])
            except Exception:  # an op whose NumPy form wants more than numbers: unknown
                value = None
    memo[name] = value
    return value
