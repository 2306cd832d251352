"""Lower one expression of a block to flat SSA equations: operators, op calls, names and literals.

What it does: functions over the block being lowered (`blocks.BlockLowerer`: its scope, temporaries
and diagnostics). `expr_top` lowers the top of an assigned expression to (op, operands, params,
spans), the operands through `atom`, which appends an equation per compound sub-expression to the
statement's list (a temporary `_tN`, `temporary`); `infix` resolves an operator to the op whose
`infix` it is; `call` resolves an op call by name, arity and keywords (E0203 unknown op, E0206
keywords, E0207 arity), lowers its parameters (`param_value`: dims, integers or dims of fixed size,
choices, dtypes) and applies the op's `decompose` rule (`Decomposer`); `resolve` makes a name an atom
(a value in scope, `acc`, a dim; E0201 or E0210 otherwise).
What it does not: bind names or lower statements, stages and signatures (blocks.py), or read dims
and types (lower.py); it never looks at kinds or types of values (frontend/verify/ does).
Invariants: an unknown name or op is reported once per block and lowered to an `ErrAtom`, so one
mistake gives one diagnostic; every equation made here has a span, each operand its own.
"""

from __future__ import annotations

from typing import Any, Protocol

from coda_lang.core.diagnostics import did_you_mean
from coda_lang.frontend.syntax.parse import span_of, text_of
from coda_lang.frontend.syntax.scope import ProgramScope
from coda_lang.ir.nodes import Atom, DimRef, Eqn, ErrAtom, Lit, Span, Var
from coda_lang.ir.types import Dim
from coda_lang.ops import registry


class BlockLowerer(Protocol):
    """What lowering an expression asks of the block it is in (blocks.py's `BlockLowerer`, which calls
    these functions): named here so that the two modules do not import each other."""

    p: ProgramScope  # the file's scope: dims, shapes, types, hints
    file: str
    scope: dict[str, Var]  # the names bound so far
    defined_at: dict[str, Span]
    acc: Var | None  # the stage's accumulator, inside a GEMM stage
    used_dims: set[str]
    unknown: set[str]  # names already reported as unknown
    in_ew: bool  # inside an elementwise stage

    def error(self, *a: Any, **kw: Any) -> None: ...

    def fresh(self) -> str: ...


# the grammar's rules of arithmetic operators -> the operator, the `infix` of the op it writes
_INFIX_RULES = {"add": "+", "sub": "-", "mul": "*", "div": "/", "neg": "neg"}

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


def expr_top(
    bl: BlockLowerer, node: Any, out: list[Eqn], nout: int, span: Span
) -> tuple[str, list[Atom], tuple, list[Span]] | None:
    """The top op of an assigned expression, with its operands lowered into `out`."""
    kind = getattr(node, "data", None)
    if kind == "neg" and getattr(node.children[0], "data", None) in ("float_lit", "int_lit"):
        kind = "literal"  # `-1.0` is a literal, not neg(1.0)
    if kind in _INFIX_RULES or kind == "compare":
        return infix(bl, node, out)
    if kind == "call":
        return call(bl, node, out)
    # A bare atom: `y = x`, `loss = 0.0`.
    at = atom(bl, node, out)
    if at is None:
        return None
    return "copy", [at], (), [span_of(bl.file, node)]


def infix(bl: BlockLowerer, node: Any, out: list[Eqn]) -> tuple[str, list[Atom], tuple, list[Span]] | None:
    """An operator (`a + b`, `-a`, `a < b`): the op whose `infix` it is, on its lowered operands."""
    if node.data == "compare":
        a, sym, b = node.children
        symbol, args = str(sym), [a, b]
    else:
        symbol, args = _INFIX_RULES[node.data], list(node.children)
    opdef = registry.resolve(symbol, len(args), set())  # the op whose `infix` is the operator
    assert opdef is not None, symbol
    op = opdef.name
    atoms = [atom(bl, c, out) for c in args]
    return (
        op,
        [a if a is not None else ErrAtom("?") for a in atoms],
        (),
        [span_of(bl.file, c) for c in args],
    )


def call(bl: BlockLowerer, node: Any, out: list[Eqn]) -> tuple[str, list[Atom], tuple, list[Span]] | None:
    """An op call: the op by name, arity and keywords, its operands and parameters, decomposed where
    the op says so; None after an error (reported here)."""
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
        bl.error("E0206", f"`{twice[0].children[0]}=` is given twice", twice[0].children[0])
        for a in pos:
            atom(bl, a, out)
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
        bl.error("E0203", f"unknown op `{fn}`", fn_tok, help=hlp, notes=extra)
        for a in pos:
            atom(bl, a, out)
        return None
    op = registry.resolve(fn, len(pos), set(kws))
    if op is None:
        op = candidates[0]
        allowed = {p.name for c in candidates for p in c.params}
        bad = [k for k in kws if k not in allowed]
        if bad:
            bl.error(
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
                bl.error(
                    "E0206",
                    f"`{fn}` needs `{missing[0].name}=`",
                    node,
                    help=[f"e.g. `{fn}(x, {missing[0].name}={example})`"],
                )
            else:
                want = " or ".join(str(a) for a in arities)
                bl.error(
                    "E0207", f"`{fn}` takes {want} operand{'s' * (arities != [1])}, got {len(pos)}", node
                )
        for a in pos:
            atom(bl, a, out)
        return None
    n_tensor = op.nin
    atoms: list[Atom] = []
    spans: list[Span] = []
    for a in pos[:n_tensor]:
        at = atom(bl, a, out)
        atoms.append(at if at is not None else ErrAtom("?"))
        spans.append(span_of(bl.file, a))
    params: list[tuple[str, Any]] = []
    positional_specs = [p for p in op.params if p.positional]
    given = dict(zip([p.name for p in positional_specs], pos[n_tensor:], strict=False))
    given.update({k: v.children[1] for k, v in kws.items()})
    for spec in op.params:
        if spec.name not in given:
            continue
        value = param_value(bl, spec, given[spec.name], fn)
        if value is None:
            return None
        params.append((spec.name, value))
    if op.decompose is not None:  # e.g. mean(x, over=N) -> sum(x / N, over=N)
        span = span_of(bl.file, node)
        name, ins, kw = op.decompose(Decomposer(bl, out, span, tuple(spans)), atoms, dict(params))
        target = registry.REGISTRY[name]
        return (
            name,
            list(ins),
            tuple((p.name, kw[p.name]) for p in target.params if p.name in kw),
            spans[: target.nin] + [span] * (target.nin - len(spans)),
        )
    return op.name, atoms, tuple(params), spans


def param_value(bl: BlockLowerer, spec: registry.ParamSpec, node: Any, fn: str) -> Any:
    """The value of the parameter `spec` of a call of `fn`, by its kind; None after an error."""
    if spec.kind != "choice" and getattr(node, "type", None) == "STRING":
        bl.error(
            "E0206",
            f"`{spec.name}=` of `{fn}` takes no string",
            node,
            help=[f"write `{spec.name}=` without quotes"],
        )
        return None
    if spec.kind == "dim":
        d = bl.p.shape_expr(node)
        if d is not None and d.name:
            bl.used_dims.add(d.name)
        return d
    if spec.kind == "int":
        if getattr(node, "data", None) == "name":  # a dim of fixed size: `dims HD = 128` ... group=HD
            dim = str(node.children[0])
            decl = bl.p.dims.get(dim)
            if decl is not None and decl.value is not None:
                return decl.value
            why = f"`{dim}` has no fixed size" if decl is not None else f"`{dim}` is not a dim"
            bl.error(
                "E0206",
                f"`{spec.name}=` of `{fn}` takes an integer or a dim of fixed size; {why}",
                node,
                help=[f"declare it with its size: `dims ..., {dim} = 128`"]
                if decl is not None
                else [f"e.g. `{spec.name}=128`, or `dims HD = 128` and `{spec.name}=HD`"],
            )
            return None
        if getattr(node, "data", None) != "int_lit":
            bl.error("E0206", f"`{spec.name}=` of `{fn}` takes an integer or a dim of fixed size", node)
            return None
        return int(node.children[0])
    if spec.kind == "choice":
        text = str(node)
        value = text[1:-1] if getattr(node, "type", None) == "STRING" else None
        if value not in spec.choices:
            options = ", ".join(f'"{c}"' for c in spec.choices)
            bl.error(
                "E0206",
                f"`{spec.name}=` of `{fn}` is one of {options}",
                node,
                help=[f'e.g. `{fn}(x, {spec.name}="{spec.choices[-1]}")`'],
            )
            return None
        return value
    if spec.kind == "dtype":
        name = str(node.children[0]) if getattr(node, "data", None) == "name" else text_of(node)
        return name if bl.p.known_dtype(name, node) else None
    raise AssertionError(spec.kind)


def atom(bl: BlockLowerer, node: Any, out: list[Eqn]) -> Atom | None:
    """Lower a sub-expression to an atom, emitting equations for compound ones into `out`."""
    kind = getattr(node, "data", None)
    if kind == "name":
        return resolve(bl, node.children[0], node)
    if kind == "float_lit":
        return Lit(float(node.children[0]), "f32")
    if kind == "int_lit":
        return Lit(int(node.children[0]), "i32")
    if kind == "neg" and getattr(node.children[0], "data", None) in ("float_lit", "int_lit"):
        lit = atom(bl, node.children[0], out)
        assert isinstance(lit, Lit)
        return Lit(-lit.value, lit.dtype)
    top = expr_top(bl, node, out, 1, span_of(bl.file, node))
    if top is None:
        return None
    op, ins, params, in_spans = top
    if registry.REGISTRY[op].copy:  # a bare atom
        return ins[0]
    if registry.REGISTRY[op].nout != 1:
        bl.error(
            "E0207",
            f"`{registry.REGISTRY[op].surface}` gives {registry.REGISTRY[op].nout} values; "
            "assign them to names first",
            node,
            help=["e.g. `a, b = pairs(z)`"],
        )
        return None
    return temporary(bl, out, op, ins, params, span_of(bl.file, node), tuple(in_spans))


def resolve(bl: BlockLowerer, tok: Any, node: Any) -> Atom:
    """A name as an atom: `acc` in a GEMM stage, a value in scope, a dim; else an ErrAtom."""
    name = str(tok)
    if name == "acc":
        if bl.acc is None:
            if name in bl.unknown:  # reported once per block: one mistake, one message
                return ErrAtom(name)
            bl.unknown.add(name)
            if bl.in_ew:
                bl.error(
                    "E0210",
                    "`acc` in an elementwise stage",
                    node,
                    label="an elementwise stage has no GEMM, so no `acc`",
                )
                return ErrAtom(name)
            bl.error(
                "E0210",
                "`acc` outside a stage",
                node,
                label="`acc` is the GEMM result, defined only inside `gemm a @ b { ... }`",
            )
            return ErrAtom(name)
        return bl.acc
    if name in bl.scope:
        return bl.scope[name]
    if name in bl.p.dims:
        bl.used_dims.add(name)
        return DimRef(Dim.sym(name))
    if name in bl.unknown:  # reported once per block: one mistake, one message
        return ErrAtom(name)
    bl.unknown.add(name)
    hint = bl.p.hint(name, lambda: list(bl.scope) + list(bl.p.dims) + (["acc"] if bl.acc else []))
    bl.error(
        "E0201",
        f"unknown name `{name}`",
        node,
        label="not defined before this use",
        help=[f"did you mean `{hint}`?"] if hint else [],
    )
    return ErrAtom(name)


def temporary(
    bl: BlockLowerer,
    out: list[Eqn],
    op: str,
    ins: Any,
    params: tuple[Any, ...],
    span: Span,
    in_spans: tuple[Span, ...],
) -> Var:
    """A fresh value defined by `op` on `ins`, its equation appended to `out`."""
    v = Var(bl.fresh())
    bl.scope[v.name] = v
    bl.defined_at[v.name] = span
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
        return temporary(self.lowerer, self.out, name, ins, kw, self.span, spans)
