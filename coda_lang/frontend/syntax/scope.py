"""The scope of a file being lowered: its dims, and the shapes, dtypes and types written with them.

What it does: `ProgramScope` holds the file's declared dims, its diagnostics (and `error` to add one)
and its "did you mean" hints (`hint`, at most MAX_HINTS a file), and reads a shape expression
(`shape_expr`: `c*X`, E0409 otherwise; an unknown dim E0204, once per file), a dtype (`known_dtype`)
and a declared type (`type_`).
What it does not: walk the tree (lower.py) or lower a block (blocks.py, which asks here).
Invariants: an unknown dim or a bad shape is reported once per file.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

from coda_lang.core.diagnostics import Diagnostic, did_you_mean
from coda_lang.frontend.syntax.parse import span_of, text_of
from coda_lang.ir.nodes import DimDecl, Span
from coda_lang.ir.types import DTYPES, MATRIX, SCALAR, VEC, Dim, Type


def _kind_of(shape: tuple[Dim, ...]) -> str:
    return (SCALAR, VEC, MATRIX)[len(shape)]


MAX_HINTS = 50  # "did you mean" hints for unknown names, per file


class ProgramScope:
    """The file being lowered: its dims, its diagnostics and "did you mean" hints; the shapes
    (`shape_expr`), dtypes and types written with its dims, which each block's lowering asks here."""

    def __init__(self, file: str, diags: list[Diagnostic]):
        self.file = file
        self.diags = diags
        self.dims: dict[str, DimDecl] = {}
        self.unknown_dims: set[str] = set()  # reported once per file: one missing `dims` entry, one message
        self.bad_shapes: set[str] = set()  # likewise for a shape that is not c*X
        self.hints_left = MAX_HINTS

    def hint(self, name: str, candidates: Callable[[], list[str]]) -> str | None:
        """ "Did you mean" for an unknown name, for the first MAX_HINTS of a file: each compares the name
        with every known one, so a file of unknown names would take time quadratic in its length."""
        if self.hints_left <= 0:
            return None
        self.hints_left -= 1
        return did_you_mean(name, candidates())

    def error(self, code: str, msg: str, node: Any, label: str = "", **kw: Any) -> None:
        span = node if isinstance(node, Span) else span_of(self.file, node)
        self.diags.append(Diagnostic(code, msg, span, label=label, **kw))

    # ------------------------------------------------------------------ shapes

    def shape_expr(self, node: Any) -> Dim | None:
        """A shape expression (`2*F`, `N/2`, `128`) as a Dim, or None after an error."""
        try:
            coeff, name = self._monomial(node)
        except _NotMonomial as e:
            if e.text in self.bad_shapes:  # the same shape written again: one message
                return None
            self.bad_shapes.add(e.text)
            self.error(
                "E0409",
                f"shape `{e.text}` is not of the form c*X",
                node,
                notes=["a shape is an integer, a dim, or a dim times or divided by integers: `2*F`, `N/2`"],
            )
            return None
        except _UnknownDim as e:
            if e.name in self.unknown_dims:
                return None
            self.unknown_dims.add(e.name)
            hint = did_you_mean(e.name, list(self.dims))
            self.error(
                "E0204",
                f"unknown dim `{e.name}`",
                e.node,
                label="not declared by `dims`",
                help=[f"did you mean `{hint}`?"] if hint else [f"declare it: `dims ..., {e.name}`"],
            )
            return None
        if coeff <= 0:
            self.error("E0409", "a shape must be positive", node)
            return None
        if name is None and coeff.denominator != 1:
            self.error("E0409", f"shape `{coeff}` is not an integer", node)
            return None
        value = self.dims[name].value if name is not None else None
        if value is not None and (coeff * value).denominator != 1:
            if str(Dim(coeff, name)) not in self.bad_shapes:  # the same shape written again: one message
                self.bad_shapes.add(str(Dim(coeff, name)))
                self.error(
                    "E0409", f"shape `{Dim(coeff, name)}` is not an integer: `{name}` is {value}", node
                )
            return None
        return Dim(coeff, name)

    def _monomial(self, node: Any) -> tuple[Fraction, str | None]:
        kind = getattr(node, "data", None)
        if kind == "sint":
            return Fraction(int(node.children[0])), None
        if kind == "sname" or kind == "name":
            name = str(node.children[0])
            if name not in self.dims:
                raise _UnknownDim(name, node)
            return Fraction(1), name
        if kind == "int_lit":
            return Fraction(int(node.children[0])), None
        if kind in ("smul", "mul"):
            (ca, na), (cb, nb) = self._monomial(node.children[0]), self._monomial(node.children[1])
            if na is not None and nb is not None:
                raise _NotMonomial(f"{na}*{nb}")
            return ca * cb, na or nb
        if kind in ("sdiv", "div"):
            (ca, na), (cb, nb) = self._monomial(node.children[0]), self._monomial(node.children[1])
            if nb is not None or cb == 0:
                raise _NotMonomial(f"/{nb or cb}")
            return ca / cb, na
        raise _NotMonomial(text_of(node))

    def known_dtype(self, dtype: str, node: Any) -> bool:
        """Whether `dtype` is one; if not, E0208 at `node` with the closest spelling."""
        if dtype in DTYPES:
            return True
        hint = did_you_mean(dtype, list(DTYPES))
        self.error(
            "E0208",
            f"unknown dtype `{dtype}`",
            node,
            help=[f"did you mean `{hint}`?"] if hint else [f"dtypes are {', '.join(DTYPES)}"],
        )
        return False

    def type_(self, node: Any, what: str) -> Type | None:
        dtype = str(node.children[0])
        shape_node = node.children[1]
        ok = True
        if not self.known_dtype(dtype, node.children[0]):
            ok = False
        dims: list[Dim] = []
        if shape_node is not None:
            for sn in shape_node.children:
                if sn is None:
                    continue
                d = self.shape_expr(sn)
                if d is None:
                    ok = False
                else:
                    dims.append(d)
            if len(dims) > 2:
                self.error(
                    "E0409",
                    f"{what} has {len(dims)} dims; values are scalars, vectors or matrices",
                    shape_node,
                )
                ok = False
        if not ok:
            return None
        return Type(dtype, tuple(dims), _kind_of(tuple(dims)))


class _NotMonomial(Exception):
    def __init__(self, text: str):
        self.text = text


class _UnknownDim(Exception):
    def __init__(self, name: str, node: Any):
        self.name, self.node = name, node
