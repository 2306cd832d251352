"""What autodiff knows about the forward block: types, defining stages, storage, GEMM uses.

What it does: `ForwardFacts` reads the forward block and its plan once (each value's type, the stage
that defines it, its defining equation, its storage dtype, the parameters to differentiate) and
answers the questions the schedule (reverse.py) and the epilogue VJPs (site.py) ask of the forward:
a value's type after its stage, the dtype a stage's `acc` and `dacc` are stored in, the GEMMs that
read a matrix, the vectors of a stage that are recomputed between stages, and which values are
active (`is_active`: they depend on a `wrt` parameter other than through `detach`; only they take
cotangents).
What it does not: emit anything or hold any state of the derivation (state.py does).
Invariants: read-only once built; every value a forward equation defines has a type here (the block
was checked); an unknown or non-float `wrt` is refused (E0602) when it is built.
"""

from __future__ import annotations

from typing import Any

from coda_lang.autodiff.builder import AutodiffError
from coda_lang.autodiff.builder import float_value as _float
from coda_lang.frontend.verify.plan import BlockPlan
from coda_lang.ir.nodes import Atom, Block, Eqn, Lit, Param, Stage, Var
from coda_lang.ir.types import GROUP, MATRIX, PARTIAL, SCALAR, TILE, VEC, Type, cotangent_dtype, is_fp8
from coda_lang.ops import REGISTRY, Locality, StageShape, grouped_reads
from coda_lang.ops.registry import Arith


def is_index(e: Eqn) -> bool:
    """Whether `e` is row_index() or col_index() (an INDEX op)."""
    return REGISTRY[e.op].locality is Locality.INDEX


class ForwardFacts:
    """The forward block, its plan and what follows from them (read-only)."""

    def __init__(self, block: Block, plan: BlockPlan, wrt: list[str] | None):
        self.block = block
        self.plan = plan
        self.params: dict[str, Param] = {p.var.name: p for p in block.params}
        # (a GEMM's block scale takes no gradient: a parameter used as one is not differentiated by default)
        scales = {x.name for st in block.stages for x in (st.scale_a, st.scale_b) if isinstance(x, Var)}
        diff = [
            p.var.name
            for p in block.params
            if _float(p.var.type) and p.default is None and p.var.name not in scales
        ]
        if wrt is not None:
            if isinstance(wrt, str) or not all(isinstance(w, str) for w in wrt):
                raise AutodiffError(
                    "E0602",
                    f"wrt= takes a list of parameter names, got {wrt!r}"
                    + (f" (write wrt=[{wrt!r}])" if isinstance(wrt, str) else ""),
                    block.span,
                )
            unknown = [w for w in wrt if w not in self.params]
            if unknown:
                raise AutodiffError(
                    "E0602", f"no parameter `{unknown[0]}` to differentiate with respect to", block.span
                )
            bad = [w for w in wrt if not _float(self.params[w].var.type)]
            if bad:
                raise AutodiffError(
                    "E0602", f"`{bad[0]}` is not a float parameter; it has no gradient", block.span
                )
        self.wrt = list(wrt) if wrt is not None else diff
        # each forward value's type, the stage (0-based) that defines it, and its equation
        self.ftype: dict[str, Type] = {p.var.name: p.var.type for p in block.params if p.var.type}
        self.fstage: dict[str, int] = {}
        self.fdef: dict[str, Eqn] = {}
        for k, st in enumerate(block.stages):
            for e in st.body:
                for v in e.outs:
                    assert v.type is not None
                    self.ftype[v.name], self.fstage[v.name], self.fdef[v.name] = v.type, k, e
        for eqns in plan.between:
            for e in eqns:
                for v in e.outs:
                    assert v.type is not None
                    self.ftype[v.name], self.fdef[v.name] = v.type, e
        self.storage = plan.storage
        # the values that depend on a `wrt` parameter other than through an op that stops gradients
        # (detach), and the stages whose acc does: only they take cotangents (a detached amax's scale
        # gets none, so its VJP, grouped over the rows or not, is never built)
        self.active: set[str] = set(self.wrt)
        self.active_acc: set[int] = set()
        stages = 0
        for item in block.body:
            acc = isinstance(item, Stage) and any(
                isinstance(x, Var) and x.name in self.active for x in (item.a, item.b)
            )
            if isinstance(item, Stage):
                if acc:
                    self.active_acc.add(stages)
                stages += 1
            for e in item.body if isinstance(item, Stage) else (item,):
                if not REGISTRY[e.op].stops_gradient and any(
                    isinstance(a, Var) and (a.name in self.active or (acc and a.name == "acc")) for a in e.ins
                ):
                    self.active |= {v.name for v in e.outs}
        self.no_gradient_through_scales(block)
        # dim facts for the backward's type rules: divisors (`X/k` in a type) and fixed values
        self.divisors: dict[str, int] = {}
        for t in self.ftype.values():
            for d in t.shape:
                if d.name and d.coeff.denominator != 1:
                    self.divisors[d.name] = max(self.divisors.get(d.name, 1), d.coeff.denominator)
        self.dim_values = {d.name: d.value for d in block.dims if d.value is not None}
        # the values a cotangent reaches: the outputs, and the operands of each statement one reaches,
        # except through an op that stops gradients (detach): a value read only through detach (an
        # fp8 amax) has no backward
        self.reached = {o.name for o in block.outputs}
        for item in reversed(block.body):
            for e in reversed(item.body if isinstance(item, Stage) else (item,)):
                if not REGISTRY[e.op].stops_gradient and any(v.name in self.reached for v in e.outs):
                    self.reached |= {a.name for a in e.ins if isinstance(a, Var)}

    def no_gradient_through_scales(self, block: Block) -> None:
        """E0602 where a block scale (a GEMM's `scale_a=`/`scale_b=`, or a matrix a stage reads over its
        groups with `expand`) depends on a differentiated parameter other than through `detach`: the
        backward treats those scales as constants (straight through the quantizer they undo), so a
        gradient through them would be missed."""
        for k, st in enumerate(block.stages):
            used: list[tuple[Atom, str]] = [
                (x, "a block scale") for x in (st.scale_a, st.scale_b) if isinstance(x, Var)
            ]
            space = st.acc.type.shape if st.acc is not None and st.acc.type is not None else st.shape
            if space is not None:

                def type_of(a: Any, st: Stage = st) -> Type | None:
                    return st.acc.type if st.acc is not None and a.name == "acc" else self.ftype.get(a.name)

                names = grouped_reads(st.body, StageShape(space[0], space[1]), type_of)
                # (a grouped value of this stage broadcast over its groups is differentiated as such)
                used += [
                    (Var(n), "read over its groups (`expand`)")
                    for n in sorted(names)
                    if self.fstage.get(n) != k
                ]
            for x, what in used:
                if isinstance(x, Var) and x.name in self.active:
                    raise AutodiffError(
                        "E0602",
                        f"`{x.name}`, {what}, depends on a differentiated parameter; the backward takes no "
                        "gradient through a block scale",
                        st.span,
                        notes=[
                            "a block scale undoes a quantizer, whose backward is straight through: compute it "
                            "from `detach(...)` of the amax, or leave the parameter out of `wrt`"
                        ],
                    )

    def names(self) -> set[str]:
        """Every name the forward block uses (dims, parameters, values, outputs)."""
        b = self.block
        return {d.name for d in b.dims} | set(self.params) | set(self.ftype) | {o.name for o in b.outputs}

    def is_active(self, name: str, k: int | None) -> bool:
        """Whether a cotangent of `name` (stage k's `acc` for "acc") can reach a `wrt` parameter."""
        return k in self.active_acc if name == "acc" else name in self.active

    def has_gradient(self, name: str) -> bool:
        """Whether cotangents of `name` are wanted: a float value that is active (a parameter outside
        `wrt` never is)."""
        return _float(self.ftype.get(name)) and name in self.active

    def after_type(self, name: str) -> Type:
        """A forward value's type after its stage: what later stages and the block level see."""
        t = self.ftype[name]
        if name in self.fstage:
            if t.kind in (TILE, GROUP):
                return Type(self.storage.get(name, self.plan.activation), t.shape, MATRIX)
            if t.kind == PARTIAL:
                return Type(t.dtype, t.shape, VEC if t.shape else SCALAR)
        return t

    def tile_dtype(self, name: str) -> str:
        """The dtype a stage's tile is kept in after its stage: its storage dtype where the forward
        stores it, else the one its definition names (`q: e4m3 = ...`, a copy only the backward
        reads: stored once it is saved), else the activation dtype."""
        if name in self.storage:
            return self.storage[name]
        e = self.fdef.get(name)
        annot = next((v.annot for v in e.outs if v.name == name), None) if e is not None else None
        return annot or self.plan.activation

    def operand_dtype(self, k: int) -> str:
        """The dtype of stage k's GEMM operands (the checker makes both the same but where one is fp8):
        its dacc's dtype. Where an operand is fp8, the other one's (the dgrad GEMM multiplies dacc by it)
        if that is not fp8 too, else bf16 (`cotangent_dtype`: gradients are not quantized)."""
        st = self.block.stages[k]
        a, b = self.stored_dtype(st.a), self.stored_dtype(st.b)
        if is_fp8(a) and not is_fp8(b):
            return b
        return cotangent_dtype(a)

    def stored_dtype(self, x: Atom | None) -> str:
        """The dtype of a GEMM operand: a parameter's, or the storage dtype of a forward tile."""
        assert isinstance(x, Var)
        if x.name in self.params:
            t = self.params[x.name].var.type
            assert t is not None
            return t.dtype
        return self.storage.get(x.name, self.plan.activation)

    def acc_dtype(self, k: int) -> str:
        """The dtype stage k's acc is saved in: the activation dtype, or f32 where the backward needs it
        exactly (`acc_exact`)."""
        return "f32" if self.acc_exact(k) else self.plan.activation

    def acc_exact(self, k: int) -> bool:
        """Whether the backward needs stage k's acc exactly, in f32: where a max/min reduction's backward
        compares its operand, recomputed from acc, with the forward's result (rounded, they'd differ):
        one whose operand is not saved as it is (`tie_operands`). A reduction no cotangent reaches
        (`reached`: a detached amax) has no backward and needs neither."""
        saved = set(self.tie_operands(k).values())
        return any(
            REGISTRY[e.op].ties
            and e.outs[0].name in self.reached
            and not (isinstance(e.ins[0], Var) and e.ins[0].name in saved)
            for e in self.block.stages[k].body
        )

    def acc_copy(self, k: int) -> tuple[str, Var | Lit] | None:
        """Stage k's scaled fp8 copy of its acc, `q: e4m3 = acc * s` (either order; `s` a literal, or a
        scalar or a vector over acc's rows from outside the stage: a parameter, a value between
        stages), as (q, s): the first such tile the stage stores in fp8 (e4m3 or e5m2), or None.
        `BackwardOptions.fp8_acc` reads acc from it (`acc = q * (1 / s)`) instead of a saved copy; a
        scale of 0 makes that NaN, as it loses acc."""
        st = self.block.stages[k]
        if not st.is_gemm or st.acc is None or st.acc.type is None:
            return None
        for e in st.body:
            if (
                REGISTRY[e.op].arith is not Arith.PRODUCT
                or len(e.outs) != 1
                or not is_fp8(self.tile_dtype(e.outs[0].name))
            ):
                continue
            accs = [i for i, a in enumerate(e.ins) if isinstance(a, Var) and a.name == "acc"]
            if len(accs) != 1:
                continue
            s = e.ins[1 - accs[0]]
            if isinstance(s, Var):
                if self.fstage.get(s.name) == k and s.name not in self.stage_vectors(k):
                    continue  # (a value of the stage's tiles)
                t = self.after_type(s.name) if s.name in self.ftype else None
                rows = st.acc.type.shape[:1]
                if t is None or not (t.kind == SCALAR or t.kind == VEC and tuple(t.shape) == tuple(rows)):
                    continue
            elif not isinstance(s, Lit):
                continue
            return e.outs[0].name, s
        return None

    def tie_operands(self, k: int) -> dict[str, str]:
        """{max/min reduction: its operand} for stage k's reductions over rows or columns (not grouped:
        those are recomputed with their operand, in one epilogue) whose operand the backward could not
        compute again bit for bit: the backward finds the elements that attain the max by comparing
        the operand with the forward's result, so it reads an f32 copy of the operand that the forward
        stores (`State.read_exact`). An operand is computed again exactly when it is `acc`, a value from
        outside the stage (a load, a parameter), or one IEEE operation (`OpDef.exact`) of such values,
        literals and indices: every kernel rounds those the same. Others (a fast-math function, a
        product fused into a sum, a vector the backward recomputes between stages) may come out one
        ulp apart in another kernel, and then no element would equal the max."""
        out: dict[str, str] = {}

        def plain(a: object) -> bool:
            if not isinstance(a, Var) or a.name == "acc" or self.fstage.get(a.name) != k:
                return True
            return is_index(self.fdef[a.name])

        for e in self.block.stages[k].body:
            if not REGISTRY[e.op].ties or e.param("group") is not None or e.outs[0].name not in self.reached:
                continue
            (x,) = e.ins
            if plain(x):
                continue
            assert isinstance(x, Var)
            d = self.fdef[x.name]
            if REGISTRY[d.op].exact and all(plain(a) for a in d.ins):
                continue
            out[e.outs[0].name] = x.name
        return out

    def gemm_uses(self, name: str) -> list[tuple[int, str]]:
        """(consumer stage, "a" or "b") for each GEMM operand use of a forward matrix."""
        uses = []
        for c, st in enumerate(self.block.stages):
            if isinstance(st.a, Var) and st.a.name == name:
                uses.append((c, "a"))
            if isinstance(st.b, Var) and st.b.name == name:
                uses.append((c, "b"))
        return uses

    def stage_vectors(self, k: int) -> set[str]:
        """Stage k's vectors and scalars computed from vectors alone: recomputed between stages, where
        their backward runs too. Those that depend on row/col indices stay in the stage's site."""
        indexed: set[str] = set()
        out: set[str] = set()
        for e in self.block.stages[k].body:
            dep = is_index(e) or any(isinstance(a, Var) and a.name in indexed for a in e.ins)
            for v in e.outs:
                assert v.type is not None
                if dep:
                    indexed.add(v.name)
                elif v.type.kind in (VEC, SCALAR):
                    out.add(v.name)
        return out
