"""Lower one block of the parse tree to an `ir.Block`: its signature, stages and statements.

What it does: `BlockLowerer` holds a block's scope (each name bound once: `bind`, E0202 for a second
binding, E0210 for a reserved name) and its temporaries (`fresh`: `_tN`, never a user's name); it
lowers the parameters (with their defaults, E0304), the outputs (E0205 for one never assigned, E0209
for one declared twice), the GEMM stages (operands, `transpose`, the `remat=` option: E0211) and the
elementwise stages (their shape), and each assignment (targets, storage annotations: E0406, the number
of values: E0207), its expression through exprs.py.
What it does not: lower expressions (exprs.py), read dims, shape expressions or types (scope.py's
ProgramScope, which it asks), or type the body (frontend/verify/).
Invariants: a name is bound once per block; a statement that failed still binds its names, so later
uses don't cascade; `acc` is defined only inside a GEMM stage.
"""

from __future__ import annotations

from typing import Any

from coda_lang.core.diagnostics import did_you_mean
from coda_lang.frontend.syntax import exprs
from coda_lang.frontend.syntax.parse import span_of
from coda_lang.frontend.syntax.scope import ProgramScope
from coda_lang.ir.nodes import REMAT, Atom, Block, Eqn, ErrAtom, Output, Param, Span, Stage, Stmt, Var
from coda_lang.ir.types import Dim, Type
from coda_lang.ops import registry

_RESERVED = {"acc", "dims", "block", "gemm", "transpose"}


class BlockLowerer:
    """One block being lowered: its scope, temporaries and the dims it uses; `lower()` makes its Block."""

    def __init__(self, prog: ProgramScope, tree: Any):
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
            str(name_tok), dims, tuple(params), tuple(outputs), tuple(stmts), span_of(self.file, self.tree)
        )

    # ------------------------------------------------------------------ signature

    def bind(self, name: str, var: Var, node: Any) -> bool:
        span = node if isinstance(node, Span) else span_of(self.file, node)
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
        return Param(var, default, span_of(self.file, node))

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
        return Output(name, t, span_of(self.file, node))

    # ------------------------------------------------------------------ body

    def stage(self, node: Any) -> Stage:
        a_node, b_node, *rest = node.children
        opts = [c for c in rest if getattr(c, "data", None) == "stage_opt"]
        body = [c for c in rest if getattr(c, "data", None) != "stage_opt"]
        a, ta = self.operand(a_node)
        b, tb = self.operand(b_node)
        remat, scales = self.stage_options(opts, gemm=True)
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
            span=span_of(self.file, node),
            a_span=span_of(self.file, a_node),
            b_span=span_of(self.file, b_node),
            remat=remat,
            **scales,
        )

    def stage_options(self, opts: list[Any], gemm: bool = False) -> tuple[str | None, dict[str, Any]]:
        """A stage's options (`, remat="save"`, on a gemm or an elementwise stage; `, scale_a=sa`,
        `, scale_b=sb`, on a gemm): the saved-tensor policy of its backward (for an elementwise stage,
        of the tiles it stores), and the operands' block scales as Stage fields (E0211 for anything
        else)."""
        remat: str | None = None
        scales: dict[str, Any] = {}
        seen: set[str] = set()
        known = ("remat", "scale_a", "scale_b") if gemm else ("remat",)
        for opt in opts:
            key, value = str(opt.children[0]), opt.children[1]
            if key not in known:
                if key in ("scale_a", "scale_b"):
                    self.error(
                        "E0211",
                        f"`{key}=` scales a GEMM operand; an elementwise stage has none",
                        opt.children[0],
                        help=[
                            "block scales go on a gemm stage: `gemm a @ b, scale_a=sa, scale_b=sb { ... }`"
                        ],
                    )
                    continue
                self.error(
                    "E0211",
                    f"a stage has no option `{key}=`",
                    opt.children[0],
                    help=[
                        'the stage options are `remat=` (e.g. `gemm a @ b, remat="recompute" { ... }`) and, '
                        "on a gemm, the operands' block scales `scale_a=` and `scale_b=`"
                    ],
                )
                continue
            if key in seen:
                self.error("E0211", f"`{key}=` is given twice on one stage", opt)
                continue
            seen.add(key)
            if key != "remat":
                if getattr(value, "type", None) != "NAME":
                    self.error(
                        "E0211",
                        f"`{key}=` names a matrix of the block, not `{value}`",
                        value,
                        help=[
                            f"e.g. `gemm a @ b, {key}=s {{ ... }}`, with `s: f32[...]` a parameter or an earlier value"
                        ],
                    )
                    continue
                scales[key] = exprs.resolve(self, value, value)
                scales[f"{key}_span"] = span_of(self.file, value)
                continue
            text = str(value)[1:-1] if getattr(value, "type", None) == "STRING" else str(value)
            if text not in REMAT:
                options = ", ".join(f'"{c}"' for c in REMAT)
                self.error(
                    "E0211",
                    f"`remat=` of a stage is one of {options}, not `{value}`",
                    value,
                    help=['e.g. `gemm a @ b, remat="recompute" { ... }`'],
                )
                continue
            remat = text
        return remat, scales

    def ew_stage(self, node: Any) -> Stage:
        shape_node, *rest = node.children
        opts = [c for c in rest if getattr(c, "data", None) == "stage_opt"]
        body = [c for c in rest if getattr(c, "data", None) != "stage_opt"]
        remat, _ = self.stage_options(opts)
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
            span=span_of(self.file, node),
            remat=remat,
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
            return exprs.resolve(self, arg, arg), True
        tok = node.children[0]
        return exprs.resolve(self, tok, tok), False

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
            spans.append(span_of(self.file, t.children[0]))
        eqn_span = span_of(self.file, node)
        top = exprs.expr_top(self, expr, out, len(outs), eqn_span)
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
