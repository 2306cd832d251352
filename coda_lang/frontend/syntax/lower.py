"""Lower a lark parse tree to the IR: resolve names, ops and dims; flatten expressions to SSA.

What it does: turns each block of the tree into an `ir.Block` whose statements are flat equations
(one op each, temporaries named `_tN`) and stages; params and outputs get their declared types;
every node gets a span. Name errors (E02) and shape-expression errors (E0409) are reported here.
What it does not: type the body or check locality (frontend/verify/ does); it never looks at kinds.
Invariants: a name is bound once per block (E0202 otherwise); a failed name becomes an `ErrAtom`,
so one mistake gives one diagnostic; temporaries never collide with user names.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

from coda_lang.core.diagnostics import Diagnostic, did_you_mean
from coda_lang.ir.nodes import (
    REMAT,
    Atom,
    Block,
    DimDecl,
    DimRef,
    Eqn,
    ErrAtom,
    Lit,
    Output,
    Param,
    Program,
    Span,
    Stage,
    Stmt,
    Var,
)
from coda_lang.ir.types import DTYPES, MATRIX, SCALAR, VEC, Dim, Type
from coda_lang.ops import registry

# the grammar's rules of arithmetic operators -> the operator, the `infix` of the op it writes
_INFIX_RULES = {"add": "+", "sub": "-", "mul": "*", "div": "/", "neg": "neg"}
_RESERVED = {"acc", "dims", "block", "gemm", "transpose"}

# Functions users reach for from PyTorch that are not ops here, with how to write them instead (a
# closest-spelling guess would mislead: `relu` is not `gelu`, `softmax` is not `max`).
_NOT_OPS = {
    "relu": "write `max(x, 0.0)`",
    "softmax": "it needs the complete row; compute `lse = logsumexp(x, over=N)` in the stage and "
    "`exp(x - lse)` in a later stage's epilogue",
    "log_softmax": "compute `lse = logsumexp(x, over=N)` in the stage and `x - lse` in a later stage's epilogue",
    "rmsnorm": "split it: a partial `ss = sum(h * h, over=D)` in the stage that makes `h`, `r = rsqrt(ss / D + eps)` "
    "between stages, and `acc * r` in the next GEMM's epilogue",
    "mean": "write `sum(x, over=N) / N`",
    "pow": "write `x * x`",
    "square": "write `x * x`",
    "swish": "it is called `silu`",
    "matmul": "a matrix product is a stage: `gemm a @ b { ... }`",
}


def _span(file: str, node: Any) -> Span:
    meta = getattr(node, "meta", None)
    if meta is not None and not getattr(meta, "empty", True):
        return Span(file, meta.line, meta.column, meta.end_line, meta.end_column)
    line = getattr(node, "line", None)
    if line is not None:
        return Span(file, line, node.column, node.end_line, node.end_column)
    return Span(file, 0, 0, 0, 0)


def _kind_of(shape: tuple[Dim, ...]) -> str:
    return (SCALAR, VEC, MATRIX)[len(shape)]


MAX_HINTS = 50  # "did you mean" hints for unknown names, per file


class Lowerer:
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
        span = node if isinstance(node, Span) else _span(self.file, node)
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
                    self.dims[name] = DimDecl(name, value, _span(self.file, d))
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
            last = _span(self.file, tree.children[-1]) if tree.children else Span(self.file, 1, 1, 1, 2)
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
        raise _NotMonomial(_text(node))

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


def _text(node: Any) -> str:
    if hasattr(node, "children"):
        return " ".join(_text(c) for c in node.children if c is not None)
    return str(node)


class BlockLowerer:
    def __init__(self, prog: Lowerer, tree: Any):
        self.p = prog
        self.tree = tree
        self.file = prog.file
        self.scope: dict[str, Var] = {}
        self.defined_at: dict[str, Span] = {}
        self.user_names = {str(t) for t in tree.scan_values(lambda v: getattr(v, "type", None) == "NAME")}
        self.tmp = 0
        self.acc: Var | None = None
        self.used_dims: set[str] = set()
        self.unknown: set[str] = set()  # names already reported as unknown (or `acc` outside a stage)
        self.in_ew = False  # inside an `elementwise [..] { }` stage

    def error(self, *a: Any, **kw: Any) -> None:
        self.p.error(*a, **kw)

    def fresh(self) -> str:
        while True:
            self.tmp += 1
            name = f"_t{self.tmp}"
            if name not in self.user_names:
                return name

    def lower(self) -> Block:
        name_tok = self.tree.children[0]
        params_nodes = [c for c in self.tree.children[1:] if getattr(c, "data", None) == "param"]
        outputs_node = next(c for c in self.tree.children if getattr(c, "data", None) == "outputs")
        body = [c for c in self.tree.children if getattr(c, "data", None) in ("assign", "stage", "ew_stage")]
        params = [p for p in (self.param(n) for n in params_nodes) if p is not None]
        outputs = [
            o for o in (self.output(n) for n in outputs_node.children if n is not None) if o is not None
        ]
        first_out: dict[str, Output] = {}
        for o in list(outputs):
            if o.name in first_out:
                self.error(
                    "E0209",
                    f"output `{o.name}` is declared twice",
                    o.span,
                    related=[(first_out[o.name].span, "first declared here")],
                )
                outputs.remove(o)
            first_out.setdefault(o.name, o)
        stmts: list[Stmt] = []
        for item in body:
            if item.data == "ew_stage":
                stmts.append(self.ew_stage(item))
            elif item.data == "stage":
                stmts.append(self.stage(item))
            else:
                stmts.extend(self.assign(item))
        for o in outputs:
            if o.name not in self.scope:
                hint = did_you_mean(o.name, list(self.scope))
                self.error(
                    "E0205",
                    f"output `{o.name}` is never assigned",
                    o.span,
                    help=[f"did you mean `{hint}`?"]
                    if hint
                    else [f"assign it in the block: `{o.name} = ...`"],
                )
        declared = [p.var.type for p in params] + [o.type for o in outputs]
        used = self.used_dims | {d.name for t in declared if t is not None for d in t.shape if d.name}
        dims = tuple(d for n, d in self.p.dims.items() if n in used)
        return Block(
            str(name_tok), dims, tuple(params), tuple(outputs), tuple(stmts), _span(self.file, self.tree)
        )

    # ------------------------------------------------------------------ signature

    def bind(self, name: str, var: Var, node: Any) -> bool:
        span = node if isinstance(node, Span) else _span(self.file, node)
        if name == "acc" or name in _RESERVED:
            self.error(
                "E0210",
                f"`{name}` is reserved",
                span,
                label="`acc` is the GEMM result of the enclosing stage" if name == "acc" else "a keyword",
            )
            return False
        if name in self.scope:
            self.error(
                "E0202",
                f"`{name}` is already defined",
                span,
                label="values are assigned once",
                related=[(self.defined_at[name], "first defined here")],
                help=["give the new value its own name"],
            )
            return False
        if name in self.p.dims:
            self.error(
                "E0202",
                f"`{name}` is already a dim",
                span,
                related=[(self.p.dims[name].span, "declared here")],
            )
            return False
        self.scope[name] = var
        self.defined_at[name] = span
        return True

    def param(self, node: Any) -> Param | None:
        name = str(node.children[0])
        t = self.p.type_(node.children[1], f"parameter `{name}`")
        default = None
        if node.children[2] is not None:
            default = self.default(node.children[2], t, name)
        var = Var(name, t)
        if name in self.scope:
            self.error(
                "E0209",
                f"parameter `{name}` is declared twice",
                node.children[0],
                related=[(self.defined_at[name], "first declared here")],
            )
            return None
        if not self.bind(name, var, node.children[0]) or t is None:
            return None
        return Param(var, default, _span(self.file, node))

    def default(self, node: Any, t: Type | None, name: str) -> float | int | None:
        neg = node.data == "neg_default"
        lit = node.children[0]
        tok = lit.children[0]
        value: float | int = float(tok) if lit.data == "float_lit" else int(tok)
        value = -value if neg else value
        if t is None:
            return value
        if t.shape:
            self.error(
                "E0304",
                f"`{name}` has a default but is not a scalar",
                node,
                notes=["only scalar parameters take defaults"],
            )
            return None
        if t.dtype == "i32" and isinstance(value, float):
            self.error("E0304", f"default `{value}` of the i32 parameter `{name}` is not an integer", node)
            return None
        return float(value) if t.dtype != "i32" else value

    def output(self, node: Any) -> Output | None:
        name = str(node.children[0])
        t = self.p.type_(node.children[1], f"output `{name}`")
        if t is None:
            return None
        return Output(name, t, _span(self.file, node))

    # ------------------------------------------------------------------ body

    def stage(self, node: Any) -> Stage:
        a_node, b_node, *rest = node.children
        opts = [c for c in rest if getattr(c, "data", None) == "stage_opt"]
        body = [c for c in rest if getattr(c, "data", None) != "stage_opt"]
        a, ta = self.operand(a_node)
        b, tb = self.operand(b_node)
        remat = self.stage_options(opts)
        acc = Var("acc")
        prev, self.acc = self.acc, acc
        eqns: list[Eqn] = []
        for item in body:
            if item is not None:
                eqns.extend(self.assign(item))
        self.acc = prev
        return Stage(
            a,
            b,
            ta,
            tb,
            acc,
            tuple(eqns),
            span=_span(self.file, node),
            a_span=_span(self.file, a_node),
            b_span=_span(self.file, b_node),
            remat=remat,
        )

    def stage_options(self, opts: list[Any]) -> str | None:
        """A gemm stage's options (`, remat="save"`): the saved-tensor policy of its backward."""
        remat: str | None = None
        seen: set[str] = set()
        for opt in opts:
            key, value = str(opt.children[0]), opt.children[1]
            if key != "remat":
                self.error(
                    "E0211",
                    f"a gemm stage has no option `{key}=`",
                    opt.children[0],
                    help=['the one stage option is `remat=`, e.g. `gemm a @ b, remat="recompute" { ... }`'],
                )
                continue
            if key in seen:
                self.error("E0211", f"`{key}=` is given twice on one stage", opt)
                continue
            seen.add(key)
            text = str(value)[1:-1] if getattr(value, "type", None) == "STRING" else str(value)
            if text not in REMAT:
                options = ", ".join(f'"{c}"' for c in REMAT)
                self.error(
                    "E0211",
                    f"`remat=` of a gemm stage is one of {options}, not `{value}`",
                    value,
                    help=['e.g. `gemm a @ b, remat="recompute" { ... }`'],
                )
                continue
            remat = text
        return remat

    def ew_stage(self, node: Any) -> Stage:
        shape_node, *body = node.children
        dims = [self.p.shape_expr(sn) for sn in shape_node.children if sn is not None]
        if len(dims) != 2 and all(d is not None for d in dims):
            self.error(
                "E0409",
                f"an elementwise stage runs over a matrix shape [rows, cols], got {len(dims)} dims",
                shape_node,
            )
        for d in dims:
            if d is not None and d.name:
                self.used_dims.add(d.name)
        prev, self.acc, self.in_ew = self.acc, None, True
        eqns: list[Eqn] = []
        for item in body:
            if item is not None:
                eqns.extend(self.assign(item))
        self.acc, self.in_ew = prev, False
        shape = (dims[0], dims[1]) if len(dims) == 2 and dims[0] is not None and dims[1] is not None else None
        return Stage(
            None,
            None,
            False,
            False,
            None,
            tuple(eqns),
            shape or (Dim.const(1), Dim.const(1)),
            span=_span(self.file, node),
        )

    def operand(self, node: Any) -> tuple[Atom, bool]:
        if node.data == "operand_call":
            fn, arg = str(node.children[0]), node.children[1]
            if fn != "transpose":
                self.error(
                    "E0203",
                    f"`{fn}(...)` can't be a GEMM operand",
                    node.children[0],
                    help=["a GEMM operand is a matrix name or `transpose(name)`"],
                )
                return ErrAtom(fn), False
            return self.name(arg, arg), True
        tok = node.children[0]
        return self.name(tok, tok), False

    def name(self, tok: Any, node: Any) -> Atom:
        name = str(tok)
        if name == "acc":
            if self.acc is None:
                if name in self.unknown:  # reported once per block: one mistake, one message
                    return ErrAtom(name)
                self.unknown.add(name)
                if getattr(self, "in_ew", False):
                    self.error(
                        "E0210",
                        "`acc` in an elementwise stage",
                        node,
                        label="an elementwise stage has no GEMM, so no `acc`",
                    )
                    return ErrAtom(name)
                self.error(
                    "E0210",
                    "`acc` outside a stage",
                    node,
                    label="`acc` is the GEMM result, defined only inside `gemm a @ b { ... }`",
                )
                return ErrAtom(name)
            return self.acc
        if name in self.scope:
            return self.scope[name]
        if name in self.p.dims:
            self.used_dims.add(name)
            return DimRef(Dim.sym(name))
        if name in self.unknown:  # reported once per block: one mistake, one message
            return ErrAtom(name)
        self.unknown.add(name)
        hint = self.p.hint(name, lambda: list(self.scope) + list(self.p.dims) + (["acc"] if self.acc else []))
        self.error(
            "E0201",
            f"unknown name `{name}`",
            node,
            label="not defined before this use",
            help=[f"did you mean `{hint}`?"] if hint else [],
        )
        return ErrAtom(name)

    def assign(self, node: Any) -> list[Eqn]:
        *targets, expr = node.children
        out: list[Eqn] = []
        outs: list[Var] = []
        spans: list[Span] = []
        for t in targets:
            name = str(t.children[0])
            annot = None
            if t.children[1] is not None:
                tnode = t.children[1]
                annot = str(tnode.children[0])
                if not self.p.known_dtype(annot, tnode.children[0]):
                    annot = None
                if tnode.children[1] is not None:
                    self.error(
                        "E0406",
                        "a statement annotation gives the storage dtype only",
                        tnode.children[1],
                        help=[
                            f"write `{name}: {annot or 'bf16'} = ...`; the shape follows from the expression"
                        ],
                    )
            outs.append(Var(name, None, annot))
            spans.append(_span(self.file, t.children[0]))
        eqn_span = _span(self.file, node)
        top = self.expr_top(expr, out, len(outs), eqn_span)
        if top is None:  # already reported; bind the names so later uses don't cascade
            for v, s in zip(outs, spans, strict=True):
                self.bind(v.name, v, s)
            return out
        op, ins, params, in_spans = top
        if len(outs) != registry.REGISTRY[op].nout:
            n = registry.REGISTRY[op].nout
            self.error(
                "E0207",
                f"`{registry.REGISTRY[op].surface}` gives {n} value{'s' * (n != 1)}, but {len(outs)} "
                f"name{'s are' if len(outs) != 1 else ' is'} assigned",
                node,
                help=[f"write `{', '.join(['a', 'b'][:n]) if n <= 2 else '...'} = ...`"] if n <= 2 else [],
            )
            for v, s in zip(outs, spans, strict=True):
                self.bind(v.name, v, s)
            return out
        bound = [v for v, s in zip(outs, spans, strict=True) if self.bind(v.name, v, s)]
        if len(bound) != len(outs):
            return out
        out.append(Eqn(op, tuple(ins), tuple(outs), params, eqn_span, tuple(in_spans)))
        return out

    def expr_top(
        self, node: Any, out: list[Eqn], nout: int, span: Span
    ) -> tuple[str, list[Atom], tuple, list[Span]] | None:
        """The top op of an assigned expression, with its operands lowered into `out`."""
        kind = getattr(node, "data", None)
        if kind == "neg" and getattr(node.children[0], "data", None) in ("float_lit", "int_lit"):
            kind = "literal"  # `-1.0` is a literal, not neg(1.0)
        if kind in _INFIX_RULES or kind == "compare":
            return self.infix(node, out)
        if kind == "call":
            return self.call(node, out)
        # A bare atom: `y = x`, `loss = 0.0`.
        atom = self.atom(node, out)
        if atom is None:
            return None
        return "copy", [atom], (), [_span(self.file, node)]

    def infix(self, node: Any, out: list[Eqn]) -> tuple[str, list[Atom], tuple, list[Span]] | None:
        if node.data == "compare":
            a, sym, b = node.children
            symbol, args = str(sym), [a, b]
        else:
            symbol, args = _INFIX_RULES[node.data], list(node.children)
        opdef = registry.resolve(symbol, len(args), set())  # the op whose `infix` is the operator
        assert opdef is not None, symbol
        op = opdef.name
        atoms = [self.atom(c, out) for c in args]
        return (
            op,
            [a if a is not None else ErrAtom("?") for a in atoms],
            (),
            [_span(self.file, c) for c in args],
        )

    def call(self, node: Any, out: list[Eqn]) -> tuple[str, list[Atom], tuple, list[Span]] | None:
        fn_tok, *args = node.children
        args = [a for a in args if a is not None]
        fn = str(fn_tok)
        pos = [a for a in args if getattr(a, "data", None) != "kwarg"]
        kws = {str(a.children[0]): a for a in args if getattr(a, "data", None) == "kwarg"}
        twice = [
            a
            for i, a in enumerate(args)
            if getattr(a, "data", None) == "kwarg"
            and any(getattr(b, "data", None) == "kwarg" and b.children[0] == a.children[0] for b in args[:i])
        ]
        if twice:
            self.error("E0206", f"`{twice[0].children[0]}=` is given twice", twice[0].children[0])
            for a in pos:
                self.atom(a, out)
            return None
        candidates = registry.BY_SURFACE.get(fn)
        # an operator is not called by name (`neg(x)`: the surface of an op written as an operator)
        if not candidates or any(c.infix for c in candidates) or not fn.isidentifier():
            hint = did_you_mean(fn, registry.call_names())
            extra = (
                ["`transpose` is written only on GEMM operands: `gemm a @ transpose(b)`"]
                if fn == "transpose"
                else []
            )
            hlp = (
                [f"`{fn}` is not an op: {_NOT_OPS[fn]}"]
                if fn in _NOT_OPS
                else [f"did you mean `{hint}`?"]
                if hint
                else []
            )
            self.error("E0203", f"unknown op `{fn}`", fn_tok, help=hlp, notes=extra)
            for a in pos:
                self.atom(a, out)
            return None
        op = registry.resolve(fn, len(pos), set(kws))
        if op is None:
            op = candidates[0]
            allowed = {p.name for c in candidates for p in c.params}
            bad = [k for k in kws if k not in allowed]
            if bad:
                self.error(
                    "E0206",
                    f"`{fn}` takes no argument `{bad[0]}`",
                    kws[bad[0]].children[0],
                    help=[f"it takes {', '.join(f'`{a}=`' for a in sorted(allowed))}"] if allowed else [],
                )
            else:
                missing = [p for c in candidates for p in c.params if p.required and p.name not in kws]
                arities = sorted({c.nin for c in candidates})
                if missing and any(c.nin == len(pos) for c in candidates):
                    example = {"dim": "N", "int": "128", "dtype": "bf16"}.get(missing[0].kind, "...")
                    self.error(
                        "E0206",
                        f"`{fn}` needs `{missing[0].name}=`",
                        node,
                        help=[f"e.g. `{fn}(x, {missing[0].name}={example})`"],
                    )
                else:
                    want = " or ".join(str(a) for a in arities)
                    self.error(
                        "E0207", f"`{fn}` takes {want} operand{'s' * (arities != [1])}, got {len(pos)}", node
                    )
            for a in pos:
                self.atom(a, out)
            return None
        n_tensor = op.nin
        atoms: list[Atom] = []
        spans: list[Span] = []
        for a in pos[:n_tensor]:
            at = self.atom(a, out)
            atoms.append(at if at is not None else ErrAtom("?"))
            spans.append(_span(self.file, a))
        params: list[tuple[str, Any]] = []
        positional_specs = [p for p in op.params if p.positional]
        given = dict(zip([p.name for p in positional_specs], pos[n_tensor:], strict=False))
        given.update({k: v.children[1] for k, v in kws.items()})
        for spec in op.params:
            if spec.name not in given:
                continue
            value = self.param_value(spec, given[spec.name], fn)
            if value is None:
                return None
            params.append((spec.name, value))
        if op.decompose is not None:  # e.g. mean(x, over=N) -> sum(x / N, over=N)
            span = _span(self.file, node)
            name, ins, kw = op.decompose(Decomposer(self, out, span, tuple(spans)), atoms, dict(params))
            target = registry.REGISTRY[name]
            return (
                name,
                list(ins),
                tuple((p.name, kw[p.name]) for p in target.params if p.name in kw),
                spans[: target.nin] + [span] * (target.nin - len(spans)),
            )
        return op.name, atoms, tuple(params), spans

    def param_value(self, spec: registry.ParamSpec, node: Any, fn: str) -> Any:
        if spec.kind != "choice" and getattr(node, "type", None) == "STRING":
            self.error(
                "E0206",
                f"`{spec.name}=` of `{fn}` takes no string",
                node,
                help=[f"write `{spec.name}=` without quotes"],
            )
            return None
        if spec.kind == "dim":
            d = self.p.shape_expr(node)
            if d is not None and d.name:
                self.used_dims.add(d.name)
            return d
        if spec.kind == "int":
            if getattr(node, "data", None) == "name":  # a dim of fixed size: `dims HD = 128` ... group=HD
                dim = str(node.children[0])
                decl = self.p.dims.get(dim)
                if decl is not None and decl.value is not None:
                    return decl.value
                why = f"`{dim}` has no fixed size" if decl is not None else f"`{dim}` is not a dim"
                self.error(
                    "E0206",
                    f"`{spec.name}=` of `{fn}` takes an integer or a dim of fixed size; {why}",
                    node,
                    help=[f"declare it with its size: `dims ..., {dim} = 128`"]
                    if decl is not None
                    else [f"e.g. `{spec.name}=128`, or `dims HD = 128` and `{spec.name}=HD`"],
                )
                return None
            if getattr(node, "data", None) != "int_lit":
                self.error("E0206", f"`{spec.name}=` of `{fn}` takes an integer or a dim of fixed size", node)
                return None
            return int(node.children[0])
        if spec.kind == "choice":
            text = str(node)
            value = text[1:-1] if getattr(node, "type", None) == "STRING" else None
            if value not in spec.choices:
                options = ", ".join(f'"{c}"' for c in spec.choices)
                self.error(
                    "E0206",
                    f"`{spec.name}=` of `{fn}` is one of {options}",
                    node,
                    help=[f'e.g. `{fn}(x, {spec.name}="{spec.choices[-1]}")`'],
                )
                return None
            return value
        if spec.kind == "dtype":
            name = str(node.children[0]) if getattr(node, "data", None) == "name" else _text(node)
            return name if self.p.known_dtype(name, node) else None
        raise AssertionError(spec.kind)

    def atom(self, node: Any, out: list[Eqn]) -> Atom | None:
        """Lower a sub-expression to an atom, emitting equations for compound ones into `out`."""
        kind = getattr(node, "data", None)
        if kind == "name":
            return self.name(node.children[0], node)
        if kind == "float_lit":
            return Lit(float(node.children[0]), "f32")
        if kind == "int_lit":
            return Lit(int(node.children[0]), "i32")
        if kind == "neg" and getattr(node.children[0], "data", None) in ("float_lit", "int_lit"):
            lit = self.atom(node.children[0], out)
            assert isinstance(lit, Lit)
            return Lit(-lit.value, lit.dtype)
        top = self.expr_top(node, out, 1, _span(self.file, node))
        if top is None:
            return None
        op, ins, params, in_spans = top
        if registry.REGISTRY[op].copy:  # a bare atom
            return ins[0]
        if registry.REGISTRY[op].nout != 1:
            self.error(
                "E0207",
                f"`{registry.REGISTRY[op].surface}` gives {registry.REGISTRY[op].nout} values; "
                "assign them to names first",
                node,
                help=["e.g. `a, b = pairs(z)`"],
            )
            return None
        return self.temporary(out, op, ins, params, _span(self.file, node), tuple(in_spans))

    def temporary(
        self,
        out: list[Eqn],
        op: str,
        ins: Any,
        params: tuple[Any, ...],
        span: Span,
        in_spans: tuple[Span, ...],
    ) -> Var:
        """A fresh value defined by `op` on `ins`, its equation appended to `out`."""
        v = Var(self.fresh())
        self.scope[v.name] = v
        self.defined_at[v.name] = span
        out.append(Eqn(op, tuple(ins), (v,), params, span, in_spans))
        return v


class Decomposer:
    """What an op's `decompose` rule emits with: `op(name, *ins, **params)` appends an equation of the
    registry op `name` at the call's span to the statement being lowered and returns its (fresh)
    result. The checker types these equations like any other."""

    def __init__(self, lowerer: BlockLowerer, out: list[Eqn], span: Span, in_spans: tuple[Span, ...]):
        self.lowerer, self.out, self.span, self.in_spans = lowerer, out, span, in_spans

    def op(self, name: str, *ins: Atom, **params: Any) -> Var:
        target = registry.REGISTRY[name]
        kw = tuple((p.name, params[p.name]) for p in target.params if params.get(p.name) is not None)
        spans = self.in_spans[: len(ins)] + (self.span,) * (len(ins) - len(self.in_spans))
        return self.lowerer.temporary(self.out, name, ins, kw, self.span, spans)


def lower(tree: Any, file: str, diags: list[Diagnostic]) -> Program:
    return Lowerer(file, diags).program(tree)
