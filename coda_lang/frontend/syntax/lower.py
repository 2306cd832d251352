"""Lower a lark parse tree to the IR: resolve names, ops and dims; flatten expressions to SSA.

What it does: `lower` turns each block of the tree into an `ir.Block` whose statements are flat
equations (one op each, temporaries named `_tN`) and stages; params and outputs get their declared
types; every node gets a span. Name errors (E02) and shape-expression errors (E0409) are reported
here. The jobs, one module each: lower.py (the entry, `Lowerer`: the program's dims and blocks, shape
expressions, dtypes and types), blocks.py (a block: its scope, signature, stages and statements),
exprs.py (an expression: operators, op calls and their parameters, decompositions, names).
What it does not: type the body or check locality (frontend/verify/ does); it never looks at kinds.
Invariants: a name is bound once per block (E0202 otherwise); a failed name becomes an `ErrAtom`,
so one mistake gives one diagnostic; temporaries never collide with user names; a dim or block is
declared once per file (E0209), an unknown dim or bad shape reported once per file.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

from coda_lang.core.diagnostics import Diagnostic, did_you_mean
from coda_lang.frontend.syntax.blocks import BlockLowerer
from coda_lang.frontend.syntax.parse import span_of, text_of
from coda_lang.ir.nodes import Block, DimDecl, Program, Span
from coda_lang.ir.types import DTYPES, MATRIX, SCALAR, VEC, Dim, Type


def _kind_of(shape: tuple[Dim, ...]) -> str:
    return (SCALAR, VEC, MATRIX)[len(shape)]


MAX_HINTS = 50  # "did you mean" hints for unknown names, per file


class Lowerer:
    """The file being lowered: its dims, its diagnostics and "did you mean" hints; `program()` lowers
    the tree, blocks.BlockLowerer each block, asking here for shapes (`shape_expr`) and types."""

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

    # ------------------------------------------------------------------ program

    def program(self, tree: Any) -> Program:
        blocks: list[Block] = []
        seen_blocks: dict[str, Span] = {}
        for item in tree.children:
            if item.data == "dims_decl":
                for d in item.children:
                    name = str(d.children[0])
                    value = int(d.children[1]) if d.children[1] is not None else None
                    if name in self.dims:
                        self.error(
                            "E0209",
                            f"dim `{name}` is declared twice",
                            d,
                            related=[(self.dims[name].span, "first declared here")],
                        )
                        continue
                    if value is not None and value <= 0:
                        self.error("E0409", f"dim `{name}` must be positive, got {value}", d)
                    self.dims[name] = DimDecl(name, value, span_of(self.file, d))
            elif item.data == "block":
                b = BlockLowerer(self, item).lower()
                if b.name in seen_blocks:
                    self.error(
                        "E0209",
                        f"block `{b.name}` is defined twice",
                        item.children[0],
                        related=[(seen_blocks[b.name], "first defined here")],
                    )
                    continue
                seen_blocks[b.name] = b.span
                blocks.append(b)
            elif item.data == "stray_stmt":
                self.error(
                    "E0105",
                    "statement outside a block",
                    item,
                    label="statements go inside `block name(...) -> (...) { ... }`",
                )
        if not blocks and not any(d.code.startswith("E01") for d in self.diags):
            # Point at the last thing the file does hold (not at a leading comment), if anything.
            last = span_of(self.file, tree.children[-1]) if tree.children else Span(self.file, 1, 1, 1, 2)
            self.diags.append(
                Diagnostic(
                    "E0106",
                    "no block in the file",
                    last,
                    label="the file ends after this" if tree.children else "",
                    help=["a file holds `dims ...` and one or more `block name(...) -> (...) { ... }`"],
                )
            )
        return Program(tuple(self.dims.values()), tuple(blocks), self.file)

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


def lower(tree: Any, file: str, diags: list[Diagnostic]) -> Program:
    """The program of a parse tree (parse.py's), its diagnostics appended to `diags`."""
    return Lowerer(file, diags).program(tree)
