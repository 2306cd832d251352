"""The op registry: one `OpDef` per op, holding every rule the toolchain needs about it.

What it does: defines `OpDef` (type rule, locality class, NumPy impl, VJP rule, CuTeDSL emitter),
`Ctx` (what a type rule may know about where it runs) and the helpers that most type rules share
(broadcasting of tiles, vectors and scalars inside and outside a stage).
What it does not: walk a program (verify/ does), or name any op (the ops/*.py modules register them).
Invariants: an op's surface name (how it is written) plus its keyword arguments pick exactly one
OpDef; type rules are pure and raise `Mistake` for user errors, never anything else.

Locality classes: "pointwise" (output at (i, j) reads inputs at (i, j) and broadcast vectors),
"pair" (reads the pair partner column too), "reduce" (a reduction: a partial inside a stage),
"index" (a row or column index), "gather" (pick: one column per row, a partial).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from coda_lang.ir.types import (
    ERROR_TYPE,
    GROUP,
    MATRIX,
    PARTIAL,
    SCALAR,
    TILE,
    VEC,
    Dim,
    Shape,
    Type,
    shape_str,
)
from coda_lang.verify.diagnostics import Mistake


class _LazyNumpy:
    """`np.exp` etc. without importing NumPy until an impl runs (keeps `coda check` fast)."""

    def __getattr__(self, name: str) -> Any:
        import numpy

        return getattr(numpy, name)


np: Any = _LazyNumpy()


@dataclass(frozen=True)
class StageShape:
    """The tile space of a stage: acc is f32[rows, cols]."""

    rows: Dim
    cols: Dim

    def col_widths(self) -> tuple[Dim, ...]:
        """Column extents a tile of this stage may have: full, half (after pairs), double."""
        return (self.cols, self.cols.scale(Fraction(1, 2)), self.cols.scale(2))


@dataclass
class Ctx:
    """What a type rule may know: the stage it runs in (None between stages) and dim facts."""

    stage: StageShape | None
    # Divisor known for each dim (from `X/k` in the signature or a fixed value); used by `pairs`.
    divisors: dict[str, int] = field(default_factory=dict)
    values: dict[str, int] = field(default_factory=dict)
    constraints: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ParamSpec:
    """A keyword argument an op takes: `over=D` (a dim), `group=128` (an int), `bf16` (a dtype)."""

    name: str
    kind: str  # "dim" | "int" | "dtype"
    required: bool = False
    positional: bool = False  # may also be given as the next positional argument


TypeRule = Callable[[Ctx, tuple[Type, ...], dict[str, Any]], tuple[Type, ...]]


@dataclass
class OpDef:
    name: str  # IR name
    surface: str  # how it is written: a call name, or an infix/prefix operator
    nin: int
    nout: int = 1
    type_rule: TypeRule | None = None
    locality: str | None = None  # see the module docstring
    params: tuple[ParamSpec, ...] = ()
    infix: str | None = None  # "+", "<", ...; "neg" is prefix "-"
    differentiable: bool = True
    combine: str | None = None  # reductions: how per-tile partials combine
    impl: Callable[..., Any] | None = None  # NumPy implementation (filled by the interpreter issue)
    vjp: Callable[..., Any] | None = None  # VJP rule (filled by the autodiff issue)
    emit: Callable[..., Any] | None = None  # CuTeDSL emitter (filled by the backend issue)
    doc: str = ""  # one line for the language reference (docs/language.md's op table)

    def accepts(self, nargs: int, kwargs: set[str]) -> bool:
        """Whether a call with these positional and keyword arguments means this op."""
        positional = [p.name for p in self.params if p.positional]
        if not self.nin <= nargs <= self.nin + len(positional):
            return False
        given = set(kwargs) | set(positional[:nargs - self.nin])  # a required one may come either way
        required = {p.name for p in self.params if p.required}
        return required <= given and kwargs <= {p.name for p in self.params}


REGISTRY: dict[str, OpDef] = {}
BY_SURFACE: dict[str, list[OpDef]] = {}


def register(op: OpDef) -> OpDef:
    assert op.name not in REGISTRY, op.name
    REGISTRY[op.name] = op
    BY_SURFACE.setdefault(op.infix or op.surface, []).append(op)
    return op


def resolve(surface: str, nargs: int, kwargs: set[str]) -> OpDef | None:
    """The op a call `surface(args..., kwargs...)` means, or None."""
    for op in BY_SURFACE.get(surface, []):
        if op.accepts(nargs, kwargs):
            return op
    return None


def call_names() -> list[str]:
    return sorted(s for s, ops in BY_SURFACE.items() if s.isidentifier())


# ----------------------------------------------------------------------------------------------
# Shared pieces of type rules


def axis_of(ctx: Ctx, dim: Dim, tile: Shape, what: str) -> int:
    """Which axis of a tile shape `dim` names (0 rows, 1 columns); Mistake when none or both."""
    hits = [i for i, d in enumerate(tile) if d == dim]
    if len(hits) == 2:
        raise Mistake(
            "E0405",
            f"{what} over `{dim}` is ambiguous: the tile is {shape_str(tile)}",
            notes=["both axes of the tile have the same extent, so rows and columns can't be told apart"],
        )
    if not hits:
        raise Mistake("E0404", f"{what} over `{dim}`, but the operand is {shape_str(tile)}")
    return hits[0]


def _outer(ctx: Ctx, a: Dim, b: Dim) -> Shape:
    """Shape of the outer product of a vector over `a` and one over `b` inside a stage."""
    st = ctx.stage
    assert st is not None
    rows_a, rows_b = a == st.rows, b == st.rows
    if rows_a and b in st.col_widths() and not rows_b:
        return (a, b)
    if rows_b and a in st.col_widths() and not rows_a:
        return (b, a)
    if rows_a and rows_b:
        raise Mistake("E0405", f"vectors over `{a}` and `{b}`: both could be rows of the tile {shape_str((st.rows, st.cols))}")
    raise Mistake(
        "E0402",
        f"vectors over `{a}` and `{b}` don't form a tile of this stage ({shape_str((st.rows, st.cols))})",
        notes=["a vector times a vector makes a tile only when one runs over the rows and the other over the columns"],
    )


def broadcast(ctx: Ctx, types: tuple[Type, ...], dtype: str) -> Type:
    """Result type of a pointwise op on `types`: scalars, vectors, tiles and groups broadcast."""
    if any(t.is_error for t in types):
        return ERROR_TYPE
    if ctx.stage is None:
        return _broadcast_outside(types, dtype)
    tiles = [t for t in types if t.kind == TILE]
    groups = [t for t in types if t.kind == GROUP]
    vecs = [t for t in types if t.kind == VEC]
    shape: Shape | None = None
    for t in tiles:
        if shape is not None and t.shape != shape:
            raise Mistake("E0402", f"tile shapes differ: {shape_str(shape)} and {shape_str(t.shape)}")
        shape = t.shape
    group: int | None = None
    for g in groups:
        assert g.group is not None
        full = (g.shape[0], g.shape[1].scale(g.group))
        if shape is not None and full != shape:
            if tiles:
                raise Mistake("E0402", f"a grouped value over {shape_str(full)} doesn't broadcast to the tile {shape_str(shape)}")
            raise Mistake("E0402", f"grouped values differ: {shape_str(shape)} and {shape_str(full)}")
        if group is not None and g.group != group:
            raise Mistake("E0402", f"grouped values with groups of {group} and {g.group} columns")
        shape, group = full, g.group
    if shape is None:  # only vectors and scalars
        dims = sorted({t.shape[0] for t in vecs})
        if not dims:
            return Type(dtype)
        if len(dims) == 1:
            return Type(dtype, (dims[0],), VEC)
        if len(dims) > 2:
            raise Mistake("E0402", "vectors over " + ", ".join(f"`{d}`" for d in dims) + " in one op")
        shape = _outer(ctx, dims[0], dims[1])
        return Type(dtype, shape, TILE)
    for v in vecs:
        axis_of(ctx, v.shape[0], shape, "a vector")
    if group is not None and not tiles:
        if any(v.shape[0] != shape[0] for v in vecs):
            raise Mistake("E0402", "a column vector can't broadcast over a grouped value")
        return Type(dtype, (shape[0], shape[1].scale(Fraction(1, group))), GROUP, group=group)
    return Type(dtype, shape, TILE)


def _broadcast_outside(types: tuple[Type, ...], dtype: str) -> Type:
    for t in types:
        if t.kind == MATRIX:
            raise Mistake("E0502", "tile computation between stages")
    dims = {t.shape[0] for t in types if t.kind == VEC}
    if len(dims) > 1:
        a, b = sorted(dims)[:2]
        raise Mistake("E0402", f"vectors over `{a}` and `{b}` have different lengths",
                      notes=["between stages only vectors and scalars are computed; an outer product would be a tile"])
    if dims:
        return Type(dtype, (dims.pop(),), VEC)
    return Type(dtype)


_KIND_NAMES = {VEC: "vector", PARTIAL: "partial reduction", GROUP: "grouped reduction"}


def kind_name(kind: str) -> str:
    """A kind as messages say it: `vector`, not `vec`."""
    return _KIND_NAMES.get(kind, kind)


def require_tile(t: Type, what: str) -> None:
    if t.is_error:
        return
    if t.kind == MATRIX:
        raise Mistake("E0502", f"{what} on a matrix between stages")
    if t.kind != TILE:
        raise Mistake("E0506", f"{what} needs a tile, got a {kind_name(t.kind)}", arg=0)


__all__ = [
    "GROUP", "MATRIX", "PARTIAL", "SCALAR", "TILE", "VEC", "Ctx", "OpDef", "ParamSpec", "StageShape",
    "REGISTRY", "axis_of", "broadcast", "kind_name", "register", "require_tile", "resolve", "np",
]
