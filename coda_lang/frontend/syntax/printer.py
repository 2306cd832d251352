"""Print IR as .coda source: `print_block` / `print_program` round-trip through the parser.

What it does: one statement per equation (flat SSA, temporaries by name), stages as `gemm` blocks,
signatures with declared types and defaults; `inline_source` prints equations with single-use
temporaries folded back into expressions, for humans (`--explain`).
What it does not: type anything; it prints what the nodes hold.
Invariants: parse(print_block(b)) lowers to a block equal to b (spans aside), for every block that
the lowering produced (a tested property).
"""

from __future__ import annotations

from collections.abc import Mapping

from coda_lang.ir.nodes import Atom, Block, DimDecl, DimRef, Eqn, ErrAtom, Lit, Program, Stage, Var
from coda_lang.ir.types import Dim, Type, shape_str
from coda_lang.ops import REGISTRY, OpDef

# the grammar's precedence of each operator (an op's `infix`); a comparison binds loosest, a call tightest
_PREC = {"=": 5, "neg": 4, "*": 3, "/": 3, "+": 2, "-": 2}


def _prec(op: str) -> int:
    infix = REGISTRY[op].infix
    if infix in _PREC:
        return _PREC[infix]
    return 1 if infix else 5


def atom_source(a: Atom) -> str:
    if isinstance(a, Var):
        return a.name
    if isinstance(a, Lit):
        return repr(float(a.value)) if a.dtype == "f32" else str(int(a.value))
    if isinstance(a, DimRef):
        return str(a.dim)
    assert isinstance(a, ErrAtom)
    return a.text


def _param_source(v: object) -> str:
    return str(v)


def call_source(e: Eqn, args: list[str]) -> str:
    return op_call_source(
        REGISTRY[e.op], args, {spec.name: e.param(spec.name) for spec in REGISTRY[e.op].params}
    )


def op_call_source(op: OpDef, args: list[str], params: Mapping[str, object]) -> str:
    """A call of `op` on the argument texts in the surface syntax (params that are None are left out)."""
    if op.infix == "=":
        return args[0]
    if op.infix == "neg":
        return f"-{args[0]}"
    if op.infix:
        return f"{args[0]} {op.infix} {args[1]}"
    parts = list(args)
    for spec in op.params:
        v = params.get(spec.name)
        if v is None:
            continue
        text = f'"{v}"' if spec.kind == "choice" else _param_source(v)
        parts.append(text if spec.positional else f"{spec.name}={text}")
    return f"{op.surface}({', '.join(parts)})"


def _targets(e: Eqn) -> str:
    return ", ".join(f"{v.name}: {v.annot}" if v.annot else v.name for v in e.outs)


def eqn_source(e: Eqn) -> str:
    return f"{_targets(e)} = {call_source(e, [atom_source(a) for a in e.ins])}"


def _type_source(t: Type | None) -> str:
    if t is None:
        return "?"
    return t.dtype + (shape_str(t.shape) if t.shape else "")


def dims_source(dims: tuple[DimDecl, ...]) -> str:
    return "dims " + ", ".join(d.name if d.value is None else f"{d.name} = {d.value}" for d in dims)


def print_block(b: Block, *, with_dims: bool = True) -> str:
    lines: list[str] = []
    if with_dims and b.dims:
        lines += [dims_source(b.dims), ""]
    lines += [f"# {n}" for n in b.notes]
    params = []
    for p in b.params:
        s = f"{p.var.name}: {_type_source(p.var.type)}"
        if p.default is not None:
            s += f" = {p.default!r}" if isinstance(p.default, float) else f" = {p.default}"
        params.append(s)
    outs = ", ".join(f"{o.name}: {_type_source(o.type)}" for o in b.outputs)
    lines.append(f"block {b.name}({', '.join(params)}) -> ({outs}) {{")
    for st in b.body:
        if isinstance(st, Stage):
            opt = f', remat="{st.remat}"' if st.remat else ""
            for key, sc in (("scale_a", st.scale_a), ("scale_b", st.scale_b)):
                opt += f", {key}={atom_source(sc)}" if sc is not None else ""
            if st.is_gemm:
                assert st.a is not None and st.b is not None
                a = f"transpose({atom_source(st.a)})" if st.ta else atom_source(st.a)
                bb = f"transpose({atom_source(st.b)})" if st.tb else atom_source(st.b)
                lines.append(f"  gemm {a} @ {bb}{opt} {{")
            else:
                assert st.shape is not None
                lines.append(f"  elementwise {shape_str(st.shape)}{opt} {{")
            lines += [f"    {eqn_source(e)}" for e in st.body]
            lines.append("  }")
        else:
            lines.append(f"  {eqn_source(st)}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def print_program(p: Program) -> str:
    parts = [dims_source(p.dims) + "\n"] if p.dims else []
    parts += [print_block(b, with_dims=False) for b in p.blocks]
    return "\n".join(parts)


def inline_source(eqns: tuple[Eqn, ...] | list[Eqn]) -> list[str]:
    """Statements with single-use temporaries folded into their users' expressions."""
    uses: dict[str, int] = {}
    for e in eqns:
        for a in e.ins:
            if isinstance(a, Var):
                uses[a.name] = uses.get(a.name, 0) + 1
    exprs: dict[str, tuple[str, int]] = {}
    out: list[str] = []
    for e in eqns:
        p = _prec(e.op)
        args = []
        for i, a in enumerate(e.ins):
            text, ap = exprs.pop(a.name) if isinstance(a, Var) and a.name in exprs else (atom_source(a), 5)
            # a right operand of its own precedence keeps its parentheses: `a - (b - c)`, and `g * (r * acc)`,
            # whose `g * r` alone would not type (a vector that repeats needs a tile: docs/language.md)
            right_assoc_risk = i == 1
            if (
                REGISTRY[e.op].infix
                and REGISTRY[e.op].infix != "="
                and (ap < p or (right_assoc_risk and ap == p))
            ):
                text = f"({text})"
            args.append(text)
        src = call_source(e, args)
        if (
            len(e.outs) == 1
            and e.outs[0].name.startswith("_t")
            and uses.get(e.outs[0].name) == 1
            and not e.outs[0].annot
        ):
            exprs[e.outs[0].name] = (src, p)
        else:
            out.append(f"{_targets(e)} = {src}")
    out += [f"{name} = {src}" for name, (src, _) in exprs.items()]
    return out


__all__ = ["print_block", "print_program", "eqn_source", "inline_source", "atom_source", "Dim"]
