"""IR nodes: a block is a flat SSA list of equations and GEMM stages.

What it does: defines the frozen node classes (`Var`, `Lit`, `DimRef`, `Eqn`, `Stage`, `Param`,
`Output`, `Block`, `Program`); every node carries a `Span` (core/diagnostics.py), its source location.
What it does not: type anything (frontend/verify/ fills in `Var.type`), print (frontend/syntax/printer.py) or parse.
Invariants: nodes are frozen; spans never take part in equality, so a block re-parsed from its
printed form compares equal to the original; every name is assigned once per block, except `acc`,
which each stage binds afresh for its own body.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from coda_lang.core.diagnostics import Span
from coda_lang.ir.types import Dim, Type

__all__ = ["Span"]  # (re-exported: the location every node carries is the diagnostics' own record)


NO_SPAN = Span("<generated>", 0, 0, 0, 0)


def _span() -> Span:
    return field(default=NO_SPAN, compare=False, repr=False)


@dataclass(frozen=True)
class Var:
    name: str
    type: Type | None = None
    # The storage dtype the user wrote (`h: bf16 = ...`), or None.
    annot: str | None = None


@dataclass(frozen=True)
class Lit:
    value: float | int
    dtype: str  # "f32" for float literals, "i32" for integer literals


@dataclass(frozen=True)
class DimRef:
    """A dim used as a value (`ss / D`): the extent, an i32 scalar."""

    dim: Dim


@dataclass(frozen=True)
class ErrAtom:
    """Stands for an operand that failed name resolution; every use of it is poisoned."""

    text: str


Atom = Var | Lit | DimRef | ErrAtom

# The saved-tensor policies of autodiff (block-wide, or written on a stage: `Stage.remat`).
REMAT = ("auto", "save", "recompute", "rebuild")
# The default policy: recompute what costs no GEMM, and a loss head's GEMM (docs/design.md, "Saved and
# recomputed"); `save` keeps every tile the backward reads; `rebuild` keeps them too, except copies an
# elementwise stage at the backward's start makes again bit for bit (an fp8 copy of a saved tile).
DEFAULT_REMAT = "auto"

ParamValue = Dim | int | float | str
Params = tuple[tuple[str, ParamValue], ...]


@dataclass(frozen=True)
class Eqn:
    op: str
    ins: tuple[Atom, ...]
    outs: tuple[Var, ...]
    params: Params = ()
    span: Span = _span()
    # One span per input, for carets that point at the offending operand.
    in_spans: tuple[Span, ...] = field(default=(), compare=False, repr=False)

    def param(self, key: str, default: ParamValue | None = None) -> ParamValue | None:
        for k, v in self.params:
            if k == key:
                return v
        return default


@dataclass(frozen=True)
class Stage:
    """`gemm a @ b { body }`: acc = op(a) @ op(b) in f32, then the epilogue `body`.

    `remat` is the saved-tensor policy written on the stage (`gemm a @ b, remat="recompute" {`).
    An elementwise stage (`elementwise [M, N] { body }`, made by autodiff where no GEMM produces a
    cotangent) has no GEMM: `a`, `b` and `acc` are None and `shape` gives its tile space.
    """

    a: Atom | None
    b: Atom | None
    ta: bool  # a is written transpose(a)
    tb: bool
    acc: Var | None
    body: tuple[Eqn, ...]
    shape: tuple[Dim, Dim] | None = None
    span: Span = _span()
    a_span: Span = _span()
    b_span: Span = _span()
    # The saved-tensor policy written on the stage (`gemm a @ b, remat="save" { ... }`): overrides the
    # block-wide one (`coda grad --remat`) for this stage's backward; None: the block-wide one.
    remat: str | None = None
    # Block scales of the operands (`gemm a @ b, scale_a=sa, scale_b=sb { ... }`): matrices laid out as
    # the operand is stored, each extent the operand's divided by a group size; the GEMM sums each
    # block of K in f32, multiplies it by the two scales of that block, and adds the blocks (None: 1)
    scale_a: Atom | None = None
    scale_b: Atom | None = None
    scale_a_span: Span = _span()
    scale_b_span: Span = _span()

    @property
    def is_gemm(self) -> bool:
        return self.shape is None

    @property
    def scaled(self) -> bool:
        """Whether the GEMM's operands carry block scales (`scale_a=` or `scale_b=`)."""
        return self.scale_a is not None or self.scale_b is not None

    @property
    def operands(self) -> tuple[Atom, ...]:
        """What the stage reads besides its body: its GEMM's operands and their block scales."""
        return tuple(x for x in (self.a, self.b, self.scale_a, self.scale_b) if x is not None)

    def map_operands(self, f: Callable[[Atom], Atom]) -> Stage:
        """The stage with `f` applied to each of `operands` (renamed, typed, substituted)."""

        def g(x: Atom | None) -> Atom | None:
            return None if x is None else f(x)

        return replace(self, a=g(self.a), b=g(self.b), scale_a=g(self.scale_a), scale_b=g(self.scale_b))


Stmt = Eqn | Stage


@dataclass(frozen=True)
class Param:
    var: Var
    default: float | int | None = None
    span: Span = _span()


@dataclass(frozen=True)
class Output:
    name: str
    type: Type
    span: Span = _span()


@dataclass(frozen=True)
class DimDecl:
    name: str
    value: int | None = None
    span: Span = _span()


@dataclass(frozen=True)
class Block:
    name: str
    dims: tuple[DimDecl, ...]
    params: tuple[Param, ...]
    outputs: tuple[Output, ...]
    body: tuple[Stmt, ...]
    span: Span = _span()
    # Comment lines printed above the block (e.g. which tensors autodiff saved); not semantics.
    notes: tuple[str, ...] = field(default=(), compare=False)
    # Made by autodiff (a derived backward), not written by a user: its GEMMs' operand layouts are
    # autodiff's, so the kernel backend multiplies an fp8 operand its fp8 GEMM can't read in bf16
    # (the runtime casts it) rather than refusing it. Not printed: a backward printed as .coda source
    # and loaded again is the user's.
    derived: bool = field(default=False, compare=False)

    @property
    def stages(self) -> tuple[Stage, ...]:
        return tuple(s for s in self.body if isinstance(s, Stage))


@dataclass(frozen=True)
class Program:
    dims: tuple[DimDecl, ...]
    blocks: tuple[Block, ...]
    file: str = field(default="<string>", compare=False)
