"""Types of the coda IR: dtypes, symbolic dims and value types.

What it does: defines `Dim` (a symbolic extent `c*X`, with `c` a rational coefficient, or an integer
constant), `Type` (dtype, shape, kind), the dtype promotion rule shared by every op, and
`TileConstraint`, a rule on the tile configuration of a stage's kernel with its reason (the checker
makes them from the program, the CUDA backend adds its own and evaluates them all, one loop).
What it does not: decide what an op returns (ops/) or whether a value is allowed where it is used
(frontend/verify/), or which tiles a kernel is tried at (backend_cute/build/config.py).
Invariants: every class here is frozen and hashable; a `Dim` is normalised (coefficient != 0, a
constant has `name is None`), so structural equality is symbolic equality; a `TileConstraint` prints
as the text `coda check --explain` and the emitted kernels' headers show.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal

from coda_lang.core.diagnostics import error

FLOAT_DTYPES = ("f32", "bf16", "f16")
# fp8 storage dtypes (OCP): e4m3 is float8_e4m3fn (max 448, NaN, no infinities), e5m2 is float8_e5m2
# (max 57344, infinities). Values of them compute in f32 like bf16's; a store saturates to +-max.
FP8_DTYPES = ("e4m3", "e5m2")
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
INT_DTYPES = ("i32",)
DTYPES = FLOAT_DTYPES + FP8_DTYPES + INT_DTYPES  # what a user may write
BOOL = "bool"  # internal: the dtype of comparisons
ERROR = "<error>"  # internal: the dtype of a poisoned value


def is_float(dtype: str) -> bool:
    """A floating-point dtype: f32, bf16, f16 or an fp8 one."""
    return dtype in FLOAT_DTYPES or dtype in FP8_DTYPES


def is_fp8(dtype: str | None) -> bool:
    return dtype in FP8_DTYPES


def cotangent_dtype(dtype: str) -> str:
    """The dtype a derived backward stores the cotangent of a value of `dtype` in: its own, but bf16
    for an fp8 value (the backward through an fp8 store is straight-through; quantizing a gradient
    needs a scale, which only the program can write)."""
    return "bf16" if dtype in FP8_DTYPES else dtype


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


def group_size(extent: Dim, scaled: Dim) -> int | None:
    """The group size g with `scaled` = `extent` / g, a positive whole number (`K` and `K/128`: 128;
    `M` and `M`: 1), or None."""
    if extent.name != scaled.name or scaled.coeff <= 0:
        return None
    g = extent.coeff / scaled.coeff
    return int(g) if g.denominator == 1 and g >= 1 else None


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
    # PARTIAL: the combine rule ("sum", "max", "min", "lse"); GROUP: the group size, and the axis its
    # groups run along: 1, runs of `group` adjacent columns (shape [rows, W/group]); 0, runs of `group`
    # adjacent rows (shape [rows/group, W]: a 128x1 group)
    combine: str | None = None
    group: int | None = None
    group_axis: int = 1

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
            "group_axis": 1,
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
            extra += f" (group={self.group}{', rows' if self.group_axis == 0 else ''})"
        return f"{s} {extra}"

    def grouped_shape(self) -> Shape:
        """The tile shape a grouped value broadcasts over: its groups widened back to their runs."""
        assert self.group is not None
        if self.group_axis == 0:
            return (self.shape[0].scale(self.group), self.shape[1])
        return (self.shape[0], self.shape[1].scale(self.group))


ERROR_TYPE = Type(ERROR)


def extent(d: Dim, sizes: dict[str, int]) -> int:
    """The size of `d` at these sizes of the dims; CodaError E0804 when it is not a whole number
    (`F/2` with F odd)."""
    v = d.evaluate(sizes)
    if v.denominator != 1:
        raise error("E0804", f"extent {d} = {v} is not an integer for these dims")
    return int(v)


# What a tile constraint is about: an extent of a stage's tile configuration (quack's tile_M and
# tile_N; epi_n, the epilogue subtile's N extent asked for, 0 for quack's choice; the epilogue
# subtile's N extent the kernel gets), or whether its kernel is quack's cooperative one (1; 0 for a
# pingpong kernel or cuBLAS). The CUDA backend gives their values for a config (build/config.py).
TileQuantity = Literal["tile_M", "tile_N", "epi_n", "the epilogue subtile's N", "cooperative"]


@dataclass(frozen=True, kw_only=True)
class TileConstraint:
    """A rule a stage's tile configuration must satisfy, and why. Exactly one relation is given:
    `of % multiple_of == 0` (a whole number of `multiple_of`, which may be a fraction: a tile of half
    the stage's width holds whole groups of 3 when tile_N is a multiple of 3/2), `divides % of == 0`,
    or `of == equals`. `kernel_only`: a rule of the compiled kernel alone; what stands in for it (the
    CUDA runtime's emulated kernels, the interpreter) holds at any tile.

    `TileConstraint(of="tile_N", multiple_of=128, reason="group=128 over `N`")` prints as
    `tile_N % 128 == 0 (group=128 over `N`)`."""

    of: TileQuantity
    reason: str
    multiple_of: int | Fraction | None = None
    divides: int | None = None
    equals: int | None = None
    kernel_only: bool = False

    def __post_init__(self) -> None:
        given = [r for r in (self.multiple_of, self.divides, self.equals) if r is not None]
        if len(given) != 1:
            raise ValueError(
                f"a TileConstraint has one relation (multiple_of, divides or equals), got {given}"
            )
        if (
            self.multiple_of is not None
            and self.multiple_of <= 0
            or self.divides is not None
            and self.divides <= 0
        ):
            raise ValueError(f"a TileConstraint's multiple_of and divides are positive: {self!r}")

    def holds(self, values: Mapping[TileQuantity, int]) -> bool:
        """Whether the rule holds where the quantity `of` has its value in `values`."""
        v = values[self.of]
        if self.multiple_of is not None:
            return Fraction(v) % Fraction(self.multiple_of) == 0
        if self.divides is not None:
            return v != 0 and self.divides % v == 0
        return v == self.equals

    def __str__(self) -> str:
        if self.multiple_of is not None:
            rule = f"{self.of} % {self.multiple_of} == 0"
        elif self.divides is not None:
            rule = f"{self.divides} % {self.of} == 0"
        else:
            rule = f"{self.of} == {self.equals}"
        return f"{rule} ({self.reason})"
