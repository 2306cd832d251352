"""Types of the coda IR: dtypes, symbolic dims and value types.

What it does: defines `Dim` (a symbolic extent `c*X`, with `c` a rational coefficient, or an integer
constant), `Type` (dtype, shape, kind) and the dtype promotion rule shared by every op.
What it does not: decide what an op returns (ops/) or whether a value is allowed where it is used
(frontend/verify/).
Invariants: every class here is frozen and hashable; a `Dim` is normalised (coefficient != 0, a
constant has `name is None`), so structural equality is symbolic equality.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from coda_lang.core.diagnostics import error

FLOAT_DTYPES = ("f32", "bf16", "f16")
INT_DTYPES = ("i32",)
DTYPES = FLOAT_DTYPES + INT_DTYPES  # what a user may write
BOOL = "bool"  # internal: the dtype of comparisons
ERROR = "<error>"  # internal: the dtype of a poisoned value


def is_float(dtype: str) -> bool:
    return dtype in FLOAT_DTYPES


def promote(*dtypes: str) -> str:
    """Result dtype of arithmetic: floats compute in f32, integers stay i32."""
    if ERROR in dtypes:
        return ERROR
    if any(is_float(d) for d in dtypes):
        return "f32"
    if all(d == BOOL for d in dtypes):
        return BOOL
    return "i32"


@dataclass(frozen=True, order=True)
class Dim:
    """`coeff * name`, or the integer `coeff` when `name` is None."""

    coeff: Fraction
    name: str | None = None

    @staticmethod
    def const(n: int) -> Dim:
        return Dim(Fraction(n), None)

    @staticmethod
    def sym(name: str, coeff: Fraction | int = 1) -> Dim:
        return Dim(Fraction(coeff), name)

    def scale(self, f: Fraction | int) -> Dim:
        return Dim(self.coeff * Fraction(f), self.name)

    def evaluate(self, sizes: dict[str, int]) -> Fraction:
        return self.coeff if self.name is None else self.coeff * sizes[self.name]

    def __str__(self) -> str:
        c = self.coeff
        if self.name is None:
            return str(c)
        if c == 1:
            return self.name
        if c.denominator == 1:
            return f"{c.numerator}*{self.name}"
        if c.numerator == 1:
            return f"{self.name}/{c.denominator}"
        return f"{c.numerator}*{self.name}/{c.denominator}"


Shape = tuple[Dim, ...]


def shape_str(shape: Shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


# Kinds. Outside a stage a value is a scalar, a vector or a matrix. Inside a stage a 2-D value is a
# tile (one value per tile position), a vector broadcasts along the other axis, a partial is a
# reduction that is complete only after every tile of the stage ran, and a group is a grouped
# reduction (one value per row and run of `group` adjacent columns).
SCALAR, VEC, MATRIX, TILE, PARTIAL, GROUP = "scalar", "vec", "matrix", "tile", "partial", "group"


@dataclass(frozen=True)
class Type:
    dtype: str
    shape: Shape = ()
    kind: str = SCALAR
    # PARTIAL: the combine rule ("sum", "max", "min", "lse"); GROUP: the group size.
    combine: str | None = None
    group: int | None = None

    @property
    def is_error(self) -> bool:
        return self.dtype == ERROR

    def with_kind(self, kind: str, **kw: object) -> Type:
        fields: dict[str, Any] = {
            "dtype": self.dtype,
            "shape": self.shape,
            "kind": kind,
            "combine": None,
            "group": None,
        }
        fields.update(kw)
        return Type(**fields)

    def __str__(self) -> str:
        if self.is_error:
            return "<error>"
        s = self.dtype + (shape_str(self.shape) if self.shape else "")
        extra = self.kind
        if self.combine:
            extra += f" ({self.combine})"
        if self.group:
            extra += f" (group={self.group})"
        return f"{s} {extra}"


ERROR_TYPE = Type(ERROR)


def extent(d: Dim, sizes: dict[str, int]) -> int:
    """The size of `d` at these sizes of the dims; CodaError E0804 when it is not a whole number
    (`F/2` with F odd)."""
    v = d.evaluate(sizes)
    if v.denominator != 1:
        raise error("E0804", f"extent {d} = {v} is not an integer for these dims")
    return int(v)
