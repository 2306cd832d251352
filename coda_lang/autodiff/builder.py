"""Emitting backward IR: a builder that names, types and places the equations autodiff creates.

What it does: `Builder` appends equations to the statement list being built (a stage body or the
block level), types each one on the fly through its op's type rule (so autodiff knows every
cotangent's kind: tile, vector, scalar, partial, group), gives it a fresh name and the span of the
forward line it came from. VJP rules (in the op registry) call it: `b.mul(ct, p.x[1])`, `b.op("exp", x)`.
A pointwise equation of complete vectors and scalars only, asked for inside a stage, is hoisted out
of it (`before`: it runs between stages, just before the stage), so its result is a block-level
vector. `ties` gives a max/min reduction's tie count (its VJP splits the cotangent among ties).
What it does not: decide what to differentiate or where it runs (reverse.py, site.py).
Invariants: every emitted equation type-checks when emitted (a Mistake here is an autodiff bug and
is raised as AutodiffError); names are unique in the backward block.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from coda_lang.core.diagnostics import Mistake
from coda_lang.ir.nodes import NO_SPAN, Atom, DimRef, Eqn, Lit, Span, Var
from coda_lang.ir.types import ERROR_TYPE, MATRIX, SCALAR, TILE, VEC, Dim, Type, is_float
from coda_lang.ops import REGISTRY, Ctx, Locality, StageShape


def float_value(t: Type | None) -> bool:
    """Whether a value of type t has a cotangent (a well-typed float)."""
    return t is not None and is_float(t.dtype) and not t.is_error


class AutodiffError(Exception):
    """A program autodiff can't differentiate (E06): code, message and the forward span."""

    def __init__(self, code: str, message: str, span: Span | None = None, notes: list[str] | None = None):
        super().__init__(message)
        self.code, self.message, self.span, self.notes = code, message, span, notes or []


class Names:
    """Unique names for the backward block: `preferred` when free, else `preferred_2`, ..."""

    def __init__(self, taken: set[str]):
        self.taken = set(taken) | {"acc"}
        self.n = 0

    def fresh(self, preferred: str | None = None) -> str:
        if preferred and preferred not in self.taken:
            self.taken.add(preferred)
            return preferred
        if preferred:
            i = 2
            while f"{preferred}_{i}" in self.taken:
                i += 1
            self.taken.add(f"{preferred}_{i}")
            return f"{preferred}_{i}"
        while True:
            self.n += 1
            name = f"_t{self.n}"
            if name not in self.taken:
                self.taken.add(name)
                return name


class Builder:
    def __init__(
        self, names: Names, types: dict[str, Type], divisors: dict[str, int], values: dict[str, int]
    ):
        self.names = names
        self.types = types  # backward name -> type as seen at block level
        self.divisors, self.values = divisors, values
        self.out: list[Eqn] = []
        self.before: list[Eqn] = []  # vector computations hoisted out of the stage being built
        self.stage: StageShape | None = None
        self.local: set[str] = set()  # names defined in the current stage
        self.span: Span = NO_SPAN
        # Where a max/min reduction's tie count is not complete in the stage being built, the site
        # counted the ties before it: the count of a reduction equation, as a complete vector.
        self.tie_counts: Callable[[Eqn], Atom] | None = None

    # ------------------------------------------------------------------ typing

    def type_of(self, a: Atom) -> Type:
        if isinstance(a, Lit):
            return Type(a.dtype)
        if isinstance(a, DimRef):
            return Type("i32")
        if isinstance(a, Var):
            t = self.types.get(a.name, ERROR_TYPE)
            if self.stage is not None and a.name not in self.local and t.kind == MATRIX:
                if self.stage.lines_up(t.shape):
                    return t.with_kind(TILE)
                return t  # (not a tile of this stage: an op that reads groups may take it, ops() says)
            return t
        return ERROR_TYPE

    # ------------------------------------------------------------------ emitting

    def ops(
        self,
        op: str,
        *ins: Atom,
        names: tuple[str | None, ...] | None = None,
        annot: str | None = None,
        params: dict[str, Any] | None = None,
        **kw: Any,
    ) -> tuple[Var, ...]:
        params = {**(params or {}), **kw}
        opdef = REGISTRY[op]
        if self.stage is not None and not annot and self.hoistable(opdef.locality, ins):
            try:  # a computation on complete vectors and scalars only: it runs between stages, before the stage
                stage, local, out = self.stage, self.local, self.out
                self.stage, self.local, self.out = None, set(), self.before
                return self.ops(op, *ins, names=names, params=params)
            except AutodiffError:
                pass  # e.g. a row vector and a column vector: their outer product is a tile
            finally:
                self.stage, self.local, self.out = stage, local, out
        in_types = tuple(self.type_of(a) for a in ins)
        if (
            opdef.reads_groups
            and self.stage is not None
            and isinstance(ins[0], Var)
            and ins[0].name not in self.local
        ):
            raw = self.types.get(
                ins[0].name, ERROR_TYPE
            )  # a matrix read over groups of the tile (a block scale)
            if raw.kind == MATRIX and self.stage.groups_of(raw.shape):
                in_types = (raw, *in_types[1:])
        ctx = Ctx(self.stage, self.divisors, self.values)
        try:
            out_types = opdef.type_rule(ctx, in_types, params)  # type: ignore[misc]
        except Mistake as m:
            raise AutodiffError(
                "E0601",
                f"autodiff made an ill-typed `{opdef.surface}`: {m.message}",
                self.span,
                notes=["this is a bug in coda_lang's autodiff; please report it"],
            ) from None
        wanted = names or (None,) * opdef.nout
        # a name given by the caller was reserved by it (Names.fresh or a claimed forward name)
        outs = tuple(Var(n if n else self.names.fresh(), None, annot) for n in wanted)
        for v, t in zip(outs, out_types, strict=True):
            self.types[v.name] = t
            if self.stage is not None:
                self.local.add(v.name)
        order = [p.name for p in opdef.params]
        ordered = tuple((k, params[k]) for k in order if k in params)
        self.out.append(Eqn(op, tuple(ins), outs, ordered, self.span, (self.span,) * len(ins)))
        return outs

    def hoistable(self, locality: Locality, ins: tuple[Atom, ...]) -> bool:
        if locality is not Locality.POINTWISE:
            return False
        for a in ins:
            if isinstance(a, Var) and (
                a.name in self.local or self.types.get(a.name, ERROR_TYPE).kind not in (VEC, SCALAR)
            ):
                return False
        return True

    def op(
        self, op: str, *ins: Atom, name: str | None = None, annot: str | None = None, **params: Any
    ) -> Var:
        return self.ops(op, *ins, names=(name,), annot=annot, **params)[0]

    # Sugar for VJP rules, with the algebraic shortcuts that keep backward blocks small.
    def lit(self, v: float) -> Lit:
        return Lit(float(v), "f32")

    def add(self, a: Atom, b: Atom) -> Atom:
        if _is_zero(a):
            return b
        if _is_zero(b):
            return a
        return self.op("add", a, b)

    def sub(self, a: Atom, b: Atom) -> Atom:
        if _is_zero(b):
            return a
        return self.op("sub", a, b)

    def mul(self, a: Atom, b: Atom) -> Atom:
        if _is_one(a):
            return b
        if _is_one(b):
            return a
        return self.op("mul", a, b)

    def div(self, a: Atom, b: Atom) -> Atom:
        return self.op("div", a, b)

    def neg(self, a: Atom) -> Atom:
        if isinstance(a, Lit):
            return Lit(-a.value, a.dtype)
        return self.op("neg", a)

    def where(self, c: Atom, a: Atom, b: Atom) -> Atom:
        return self.op("where", c, a, b)

    def sum_over(self, a: Atom, over: Dim, group: int | None = None) -> Var:
        if group:
            return self.op("reduce_sum", a, over=over, group=group)
        return self.op("reduce_sum", a, over=over)

    def stage_tile(self, c: Atom) -> Atom | None:
        """A scalar, row or column vector broadcast to the stage's whole tile, with the index vectors
        (`expand(r, col_index())`): nothing is loaded just for its shape. None in a square stage (its
        row and column vectors have the same type: they don't make a tile)."""
        assert self.stage is not None
        if self.stage.rows == self.stage.cols:
            return None
        t = self.type_of(c)
        if t.kind == SCALAR or (t.kind == VEC and t.shape[0] != self.stage.rows):
            c = self.op("expand", c, self.op("row_index"))
        if self.type_of(c).kind == VEC:
            c = self.op("expand", c, self.op("col_index"))
        return c

    def ties(self, p: Primals, mask: Atom) -> Atom:
        """How many elements attain the max/min reduction `p` (where `mask` is true), per reduced row,
        column or group: its cotangent is split among them, as JAX and torch do."""
        over = p.param("over")
        group = p.param("group")
        assert isinstance(over, Dim) and (group is None or isinstance(group, int))
        if self.stage is None or group is not None:  # between stages, or a group complete in its tile
            return self.sum_over(self.where(mask, self.lit(1.0), self.lit(0.0)), over, group)
        assert self.tie_counts is not None, "a max/min reduction's backward runs in a site"
        return self.tie_counts(p.eqn)


def _is_zero(a: Atom) -> bool:
    return isinstance(a, Lit) and a.value == 0


def _is_one(a: Atom) -> bool:
    return isinstance(a, Lit) and a.value == 1


class Primals:
    """Lazy access to the primal inputs (`p.x[i]`) and outputs (`p.y[i]`) of a forward equation,
    as atoms of the backward block: loaded or recomputed only when a VJP rule asks for them."""

    def __init__(self, eqn: Eqn, get: Callable[[Atom], Atom]):
        self.eqn = eqn
        self.x = _Lazy([a for a in eqn.ins], get)
        self.y = _Lazy(list(eqn.outs), get)

    def param(self, key: str) -> Any:
        return self.eqn.param(key)


class _Lazy:
    def __init__(self, atoms: list[Atom], get: Callable[[Atom], Atom]):
        self.atoms, self.get = atoms, get
        self.cache: dict[int, Atom] = {}

    def __getitem__(self, i: int) -> Atom:
        if i not in self.cache:
            self.cache[i] = self.get(self.atoms[i])
        return self.cache[i]

    def __len__(self) -> int:
        return len(self.atoms)
