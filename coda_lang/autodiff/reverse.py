"""Reverse-mode autodiff of a block: the backward block, in the same IR, plus the saved tensors.

What it does: `derive(block, plan)` walks the forward block backwards, stage by stage. The VJP of
stage k's epilogue runs in the epilogue of the GEMM that produces the cotangent of one of its stored
tiles (the dgrad GEMM of the consumer stage, `dacc_c @ B_c^T`), which is the paper's theorem: a
block-local forward gives a block-local backward. Where no GEMM produces such a cotangent (the
block's entry), or where no such GEMM's tile space holds every tile of the stage (a tile of half
the width can't be read in a GEMM of twice it), the VJP runs in one elementwise stage over the
stage's own tile space, and the derivation reports it. Each stage's `dacc` (stored in its GEMM
operands' dtype) then feeds its dgrad and wgrad GEMMs; the VJPs of vector computations run between
stages.
What it does not: check the result (the checker does, and a failure is an autodiff bug, E0601), or
run anything.
Invariants:
- unbroadcast happens in one place per level (`Site.reduce_outside`/`Site.unbroadcast_local` in a
  stage, `unbroadcast_block` between stages), from the logical type each cotangent contribution
  carries: a cotangent of a row vector used in a tile is a partial row sum, of a column vector a
  partial column sum, of a scalar a partial row sum then a sum over rows between stages; a vector
  cotangent that stands for a tile (after a sum's VJP) is summed or multiplied by the count;
- the backward reads forward values either as saved tensors (tiles the forward stores anyway, the
  complete partials and vectors, and `acc` where a VJP needs the pre-epilogue value) or recomputes
  them in the epilogue; `saved` lists what the forward must store, and the extended forward block
  stores it;
- cotangent contributions to one matrix accumulate in the epilogue that produces the next one
  (residual accumulation), never as a tile computation between stages;
- every node made here carries the span of the forward line it came from.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from coda_lang.autodiff.builder import AutodiffError, Builder, Names, Primals
from coda_lang.autodiff.builder import float_value as _float
from coda_lang.autodiff.cleanup import cse, dce, rename, used_names
from coda_lang.ir.nodes import Atom, Block, DimRef, Eqn, Lit, Output, Param, Span, Stage, Stmt, Var
from coda_lang.ir.types import GROUP, MATRIX, PARTIAL, SCALAR, TILE, VEC, Dim, Type, is_float
from coda_lang.ops import REGISTRY, StageShape
from coda_lang.verify.plan import BlockPlan


@dataclass
class Derivation:
    forward: Block  # the forward block, extended to store what the backward reads
    backward: Block
    saved: tuple[str, ...]  # forward values the backward reads (params of the backward block)
    cotangents: dict[str, str]  # forward output -> its cotangent's name in the backward block
    grads: dict[str, str]  # forward param -> its gradient's name (an output of the backward block)
    report: list[str] = field(default_factory=list)


class Reverse:
    def __init__(self, block: Block, plan: BlockPlan, wrt: list[str] | None):
        self.f = block
        self.plan = plan
        self.params = {p.var.name: p for p in block.params}
        diff = [p.var.name for p in block.params if _float(p.var.type) and p.default is None]
        if wrt is not None:
            unknown = [w for w in wrt if w not in self.params]
            if unknown:
                raise AutodiffError("E0602", f"no parameter `{unknown[0]}` to differentiate with respect to",
                                    block.span)
            bad = [w for w in wrt if not _float(self.params[w].var.type)]
            if bad:
                raise AutodiffError("E0602", f"`{bad[0]}` is not a float parameter; it has no gradient", block.span)
        self.wrt = list(wrt) if wrt is not None else diff
        # Forward facts: each forward value's type and the stage (0-based) that defines it.
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
        taken = {d.name for d in block.dims} | set(self.params) | set(self.ftype) | {o.name for o in block.outputs}
        self.names = Names(taken)
        self.claimed: set[str] = set()
        divisors: dict[str, int] = {}
        for t in self.ftype.values():
            for d in t.shape:
                if d.name and d.coeff.denominator != 1:
                    divisors[d.name] = max(divisors.get(d.name, 1), d.coeff.denominator)
        values = {d.name: d.value for d in block.dims if d.value is not None}
        self.types: dict[str, Type] = {}
        self.bb = Builder(self.names, self.types, divisors, values)  # block level
        self.body: list[Stmt] = []
        self.bparams: dict[str, Param] = {}
        self.saved: list[str] = []
        self.save_acc: dict[int, str] = {}
        self.ct: dict[str, list[Atom]] = {}  # block-level cotangent contributions, by forward name
        self.dacc: dict[int, Atom] = {}
        self.dgrad_done: set[tuple[int, str]] = set()
        self.report: list[tuple[Span, str]] = []  # kept if the stage survives dead-code removal
        self.cotangents: dict[str, str] = {}
        self.renames: dict[str, str] = {}
        self.cosmetic: dict[str, str] = {}  # temporaries that hold a named value's cotangent
        self.recomputed: dict[str, Var] = {}  # stage-local vectors recomputed between stages

    # ------------------------------------------------------------------ names and params

    def claim(self, name: str) -> str:
        """A forward name reused in the backward for a recomputed value, when no other value has it. A
        value the forward stores keeps its name for the saved tensor the backward may read (a parameter
        of the backward block, claimed by saved_value at any point of the derivation), so a recomputed
        copy of it (a max's ties compare the f32 value, not the stored one) gets a fresh name."""
        if name not in self.claimed and name not in self.storage:
            self.claimed.add(name)
            return name
        return self.names.fresh(name)

    def param(self, name: str, t: Type, span: Span | None = None) -> Var:
        if name not in self.bparams:
            self.bparams[name] = Param(Var(name, t), None, span or self.f.span)
            self.types[name] = t
        return Var(name)

    def forward_param(self, name: str) -> Var:
        p = self.params[name]
        assert p.var.type is not None
        if name not in self.bparams:
            self.claimed.add(name)
            self.bparams[name] = Param(p.var, p.default, p.span)
            self.types[name] = p.var.type
        return Var(name)

    def saved_value(self, name: str) -> Var:
        """A forward value the backward reads as saved: a stored tile or a complete vector."""
        t = self.ftype[name]
        if name not in self.bparams:
            self.claimed.add(name)
            if t.kind in (TILE, GROUP):
                bt = Type(self.storage.get(name, self.plan.activation), t.shape, MATRIX)
            elif t.kind == PARTIAL:
                bt = Type(self.storage.get(name, "f32"), t.shape, VEC if t.shape else SCALAR)
            else:
                bt = Type("f32" if is_float(t.dtype) else t.dtype, t.shape, t.kind)
            self.saved.append(name)
            self.param(name, bt)
        return Var(name)

    def saved_acc(self, k: int) -> Var:
        if k not in self.save_acc:
            name = self.names.fresh(f"acc{k + 1}")
            self.save_acc[k] = name
            st = self.f.stages[k]
            assert st.acc is not None and st.acc.type is not None
            self.saved.append(name)
            self.param(name, Type(self.acc_dtype(k), st.acc.type.shape, MATRIX))
        return Var(self.save_acc[k])

    def acc_dtype(self, k: int) -> str:
        """The dtype stage k's acc is saved in: the activation dtype, or f32 where a max/min reduction's
        backward compares its recomputed operand with the forward's result (rounded, they'd differ)."""
        exact = any(e.op in ("reduce_max", "reduce_min") for e in self.f.stages[k].body)
        return "f32" if exact else self.plan.activation

    # ------------------------------------------------------------------ driver

    def run(self) -> Derivation:
        for o in self.f.outputs:
            t = self.ftype.get(o.name, o.type)
            if not _float(t):
                continue
            name = self.names.fresh(f"d{o.name}")
            self.cotangents[o.name] = name
            self.ct.setdefault(o.name, []).append(self.param(name, Type(o.type.dtype, o.type.shape,
                                                                       (SCALAR, VEC, MATRIX)[len(o.type.shape)])))
        stages = self.f.stages
        self.block_backward(self.plan.between[len(stages)])
        for k in reversed(range(len(stages))):
            self.stage_backward(k)
            self.block_backward(self.plan.between[k])
        grads = self.finalize()
        return self.assemble(grads)

    # ------------------------------------------------------------------ block-level backward

    def block_primal(self, a: Atom) -> Atom:
        if not isinstance(a, Var):
            return a
        if a.name in self.params:
            return self.forward_param(a.name)
        t = self.ftype[a.name]
        if a.name in self.fstage and t.kind in (VEC, SCALAR):  # a stage-local vector: recompute it
            return self.recompute_block(a.name)
        if a.name not in self.fstage and not is_float(t.dtype):  # a mask or index between stages: recompute
            return self.recompute_block(a.name)
        return self.saved_value(a.name)

    def recompute_block(self, name: str) -> Var:
        if name in self.recomputed:
            return self.recomputed[name]
        e = self.fdef[name]
        ins = [self.block_primal(a) for a in e.ins]
        prev = self.bb.span
        self.bb.span = e.span
        outs = self.bb.ops(e.op, *ins, names=tuple(self.claim(v.name) for v in e.outs), params=dict(e.params))
        self.bb.span = prev
        for o, v in zip(outs, e.outs, strict=True):
            self.recomputed[v.name] = o
        return self.recomputed[name]

    def take_ct(self, b: Builder, name: str) -> Atom | None:
        parts = self.ct.pop(name, [])
        total: Atom | None = None
        for p in parts:
            total = p if total is None else b.add(total, p)
        self.name_ct(total, name)
        return total

    def name_ct(self, total: Atom | None, name: str) -> None:
        """Give the cotangent of a user-named value the name `d<name>` in the printed backward."""
        if (isinstance(total, Var) and total.name.startswith("_t") and not name.startswith("_t") and name != "acc"
                and total.name not in self.cosmetic):
            self.cosmetic[total.name] = self.names.fresh(f"d{name}")

    def block_backward(self, eqns: tuple[Eqn, ...]) -> None:
        b = self.bb
        b.out = []
        for e in reversed(eqns):
            self.block_eqn_backward(e)
        self.body.extend(b.out)

    def block_eqn_backward(self, e: Eqn) -> None:
        b = self.bb
        op = REGISTRY[e.op]
        cts = [self.take_ct(b, v.name) if _float(v.type) else None for v in e.outs]
        if all(c is None for c in cts) or op.vjp is None:
            return
        b.span = e.span
        got = op.vjp(b, Primals(e, self.block_primal), cts if op.nout > 1 else cts[0])
        for a, c in zip(e.ins, got, strict=True):
            if c is None or not isinstance(a, Var):
                continue
            if not _float(self.ftype.get(a.name)) or (a.name in self.params and a.name not in self.wrt):
                continue
            target = self.after_type(a.name)
            # a pointwise op's cotangents are of its (broadcast) output; a reduction's of its input
            logical = e.outs[0].type if op.locality == "pointwise" and e.outs[0].type is not None else target
            self.ct.setdefault(a.name, []).append(self.unbroadcast_block(c, logical, target))

    def unbroadcast_block(self, c: Atom, logical: Type, target: Type) -> Atom:
        """Between stages: the cotangent of a vector used as a scalar's broadcast is summed over it (a
        scalar cotangent standing for a vector: multiplied by its length)."""
        ct = self.bb.type_of(c)
        if target.kind == SCALAR and ct.kind == VEC:
            return self.bb.sum_over(c, ct.shape[0])
        if target.kind == SCALAR and logical.kind == VEC:
            return self.bb.mul(c, DimRef(logical.shape[0]))
        return c

    def after_type(self, name: str) -> Type:
        """A forward value's type after its stage: what later stages and the block level see."""
        t = self.ftype[name]
        if name in self.fstage:
            if t.kind in (TILE, GROUP):
                return Type(self.storage.get(name, self.plan.activation), t.shape, MATRIX)
            if t.kind == PARTIAL:
                return Type(t.dtype, t.shape, VEC if t.shape else SCALAR)
        return t

    def operand_dtype(self, k: int) -> str:
        """The dtype of stage k's GEMM operands (the checker makes both the same): its dacc's dtype."""
        a = self.f.stages[k].a
        assert isinstance(a, Var)
        if a.name in self.params:
            t = self.params[a.name].var.type
            assert t is not None
            return t.dtype
        return self.storage.get(a.name, self.plan.activation)

    # ------------------------------------------------------------------ stages

    def stage_backward(self, k: int) -> None:
        st = self.f.stages[k]
        sp = self.plan.stages[k]
        defined = [v.name for e in st.body for v in e.outs]
        hosted = any(c in self.dacc for n in defined for c, _ in self.gemm_uses(n))
        if not hosted and not any(n in self.ct for n in defined):
            return
        host = self.choose_host(k, defined)
        from coda_lang.autodiff.site import Site

        site = Site(self, k, host)
        site.build()
        if not st.is_gemm:
            return
        dacc = self.dacc.get(k)
        if dacc is None:
            return
        self.weight_grads(k, st, dacc, sp.line)

    def gemm_uses(self, name: str) -> list[tuple[int, str]]:
        """(consumer stage, "a" or "b") for each GEMM operand use of a forward matrix."""
        uses = []
        for c, st in enumerate(self.f.stages):
            if isinstance(st.a, Var) and st.a.name == name:
                uses.append((c, "a"))
            if isinstance(st.b, Var) and st.b.name == name:
                uses.append((c, "b"))
        return uses

    def choose_host(self, k: int, defined: list[str]) -> tuple[str, int, str] | None:
        """The GEMM whose output is the cotangent of one of stage k's tiles: (tile, stage, operand); one
        whose tile space holds every tile of stage k's epilogue (of its width, or half or twice it)."""
        cands = sorted({(0 if pos == "a" else 1, c, name, pos) for name in defined for c, pos in self.gemm_uses(name)
                        if c in self.dacc and (c, pos) not in self.dgrad_done})
        best = next((cand for cand in cands if self.host_fits(k, cand[2])), None)
        # every other GEMM use of stage k's tiles runs as its own GEMM, before the site, and adds in
        for _, c, name, pos in cands:
            if best is None or (c, pos) != (best[1], best[3]):
                self.dgrad_done.add((c, pos))
                self.operand_grad(c, pos, name)
        if best is None:
            return None
        _, c, name, pos = best
        self.dgrad_done.add((c, pos))
        return name, c, pos

    def host_fits(self, k: int, tile: str) -> bool:
        """Whether the tile space of `tile` (the output of the GEMM that would host stage k's backward)
        holds every tile and column vector of stage k's epilogue."""
        rows, cols = self.ftype[tile].shape
        host = StageShape(rows, cols)
        st = self.f.stages[k]
        assert st.acc is not None and st.acc.type is not None
        frows = st.acc.type.shape[0]
        types = [st.acc.type] + [a.type if isinstance(a, Var) and a.type is not None else Type("f32")
                                 for e in st.body for a in (*e.ins, *e.outs)]
        local = [v.type for e in st.body for v in e.outs]  # a grouped value of another stage is a tile here
        for t in types:
            if t.kind in (TILE, MATRIX, GROUP) and len(t.shape) == 2:
                width = t.shape[1].scale(t.group) if t.kind == GROUP and t.group and t in local else t.shape[1]
                if t.shape[0] != host.rows or width not in host.col_widths():
                    return False
            elif t.kind in (VEC, PARTIAL) and t.shape and t.shape[0] != frows and t.shape[0] not in host.col_widths():
                return False
        return True

    def gemm_for(self, c: int, pos: str) -> tuple[Atom, Atom, bool, bool]:
        """The GEMM (a, b, ta, tb) giving the cotangent of operand `pos` of forward stage c."""
        st = self.f.stages[c]
        dacc = self.dacc[c]
        assert st.a is not None and st.b is not None
        a_op = self.forward_operand(st.a)
        b_op = self.forward_operand(st.b)
        if pos == "a":
            return (dacc, b_op, False, not st.tb) if not st.ta else (b_op, dacc, st.tb, True)
        return (a_op, dacc, not st.ta, False) if not st.tb else (dacc, a_op, True, st.ta)

    def forward_operand(self, a: Atom) -> Var:
        assert isinstance(a, Var)
        return self.forward_param(a.name) if a.name in self.params else self.saved_value(a.name)

    def operand_grad(self, c: int, pos: str, name: str) -> None:
        """A dgrad/wgrad GEMM whose result is a cotangent contribution to matrix `name`."""
        a, b, ta, tb = self.gemm_for(c, pos)
        st = self.f.stages[c]
        stage_shape = self.gemm_shape(a, b, ta, tb)
        self.open_stage(stage_shape)
        bb = self.bb
        bb.span = st.span
        acc = Var("acc")
        total = self.accumulate(acc, name, bb)
        out = bb.op("copy", total, name=self.names.fresh(f"d{name}"), annot=None if name in self.params else "f32")
        before, body = self.close_stage()
        self.body.extend(before)
        self.body.append(Stage(a, b, ta, tb, Var("acc"), tuple(body), span=st.span))
        self.ct.setdefault(name, []).append(Var(out.name))

    def accumulate(self, value: Atom, name: str, b: Builder) -> Atom:
        """value + every earlier matrix contribution to `name` that this stage can load (residual accumulation)."""
        keep = []
        st = b.stage
        for part in self.ct.pop(name, []):
            t = b.type_of(part)
            if t.kind == TILE and st is not None and t.shape[0] == st.rows and t.shape[1] in st.col_widths():
                value = b.add(value, part)
            else:
                keep.append(part)
        if keep:
            self.ct[name] = keep
        return value

    def gemm_shape(self, a: Atom, b: Atom, ta: bool, tb: bool) -> StageShape:
        sa, sb = self.types[a.name].shape, self.types[b.name].shape  # type: ignore[union-attr]
        rows = sa[1] if ta else sa[0]
        cols = sb[0] if tb else sb[1]
        return StageShape(rows, cols)

    def open_stage(self, shape: StageShape) -> None:
        self.bb.out, self.bb.before = [], []
        self.bb.stage = shape
        self.bb.local = {"acc"}
        self.types["acc"] = Type("f32", (shape.rows, shape.cols), TILE)

    def close_stage(self) -> tuple[list[Eqn], list[Eqn]]:
        """(vector computations hoisted out of the stage, to run just before it; the stage's body)."""
        b = self.bb
        body, before = b.out, b.before
        # after the stage: tiles are stored matrices, partials complete vectors
        for name in b.local:
            t = self.types.get(name)
            if t is None:
                continue
            if t.kind in (TILE, GROUP):
                self.types[name] = Type(t.dtype, t.shape, MATRIX)
            elif t.kind == PARTIAL:
                self.types[name] = Type(t.dtype, t.shape, VEC if t.shape else SCALAR)
        self.types.pop("acc", None)
        b.stage, b.local, b.out, b.before = None, set(), [], []
        return before, body

    def weight_grads(self, k: int, st: Stage, dacc: Atom, line: int) -> None:
        for pos, operand in (("b", st.b), ("a", st.a)):
            assert isinstance(operand, Var)
            if operand.name in self.params and operand.name in self.wrt:
                self.operand_grad(k, pos, operand.name)
            # a forward tile as operand: its producer's site uses this stage's dacc later

    # ------------------------------------------------------------------ gradients

    def finalize(self) -> dict[str, str]:
        grads: dict[str, str] = {}
        for name in self.wrt:
            p = self.params[name]
            t = p.var.type
            assert t is not None
            parts = self.ct.pop(name, [])
            single = parts[0] if len(parts) == 1 and isinstance(parts[0], Var) else None
            if single is not None and single.name.startswith(f"d{name}") and single.name not in self.bparams:
                out_name = single.name  # already named for it
            else:
                out_name = self.names.fresh(f"d{name}")
            grads[name] = out_name
            kind = (SCALAR, VEC, MATRIX)[len(t.shape)]
            if kind == MATRIX:
                self.finalize_matrix(name, parts, out_name, t)
            elif len(parts) == 1 and isinstance(parts[0], Var) and parts[0].name not in self.bparams and \
                    self.types.get(parts[0].name, t).kind == kind:
                if parts[0].name != out_name:
                    self.renames[parts[0].name] = out_name
                else:
                    self.renames[out_name] = out_name
            else:
                self.bb.out = []
                self.bb.span = p.span
                total: Atom = Lit(0.0, "f32")
                for part in parts:
                    total = self.bb.add(total, part)
                if kind == VEC and self.bb.type_of(total).kind != VEC:
                    total = self.bb.op("expand", total, self.forward_param(name))
                self.bb.op("copy", total, name=out_name)
                self.body.extend(self.bb.out)
        return grads

    def finalize_matrix(self, name: str, parts: list[Atom], out_name: str, t: Type) -> None:
        # The usual case: one contribution, made by an equation of this backward: rename it.
        if len(parts) == 1 and isinstance(parts[0], Var) and parts[0].name in self.bparams:
            self.bb.out = []
            self.bb.op("copy", parts[0], name=out_name)  # an alias (e.g. a residual's gradient)
            self.body.extend(self.bb.out)
            return
        if len(parts) == 1 and isinstance(parts[0], Var) and parts[0].name not in self.bparams:
            if parts[0].name != out_name:
                self.renames[parts[0].name] = out_name
            else:
                self.renames[out_name] = out_name  # keeps its annotation-free output form
            return
        shape = StageShape(t.shape[0], t.shape[1])
        self.open_stage(shape)
        self.types.pop("acc", None)
        self.bb.local.discard("acc")
        self.bb.span = self.params[name].span
        total: Atom = Lit(0.0, "f32")
        for part in parts:
            total = self.bb.add(total, part)
        tile = self.bb.stage_tile(total) if self.bb.type_of(total).kind != TILE else total
        if tile is None:  # a square stage: the parameter itself gives the shape
            tile = self.bb.op("expand", total, self.forward_param(name))
        self.bb.op("copy", tile, name=out_name)
        before, body = self.close_stage()
        self.body.extend(before)
        self.body.append(Stage(None, None, False, False, None, tuple(body), (shape.rows, shape.cols),
                               span=self.params[name].span))
        why = "is summed" if parts else "is zero (no output depends on it): written"
        self.report.append((self.params[name].span, f"the gradient of `{name}` {why} in an elementwise stage"))

    # ------------------------------------------------------------------ assembling

    def assemble(self, grads: dict[str, str]) -> Derivation:
        keep = set(grads.values()) | set(self.renames) | {n for n in self.ct}
        body = dce(cse(self.body, keep), set(grads.values()) | set(self.renames))
        body = rename(body, self.renames)
        body = rename(body, {k: v for k, v in self.cosmetic.items() if k not in self.renames})
        alive = {s.span for s in body if isinstance(s, Stage) and not s.is_gemm}
        report = [text for span, text in self.report if span in alive]
        used = used_names(body)
        params = [p for n, p in self.bparams.items() if n in used or n in self.cotangents.values()]
        order = {n: i for i, n in enumerate(list(self.cotangents.values()) + self.saved)}
        params.sort(key=lambda p: order.get(p.var.name, len(order)))
        saved = tuple(n for n in self.saved if n in used)
        outputs = []
        for name, g in grads.items():
            t = self.params[name].var.type
            assert t is not None
            outputs.append(Output(g, Type(t.dtype, t.shape, (SCALAR, VEC, MATRIX)[len(t.shape)]), self.params[name].span))
        used = _used_dims(params, outputs, body)
        dims = tuple(d for d in self.f.dims if d.name in used)
        bname = f"{self.f.name}_bwd"
        notes = [f"backward of `{self.f.name}`, derived by `coda grad`",
                 "saved tensors (stored by the forward): " + (", ".join(saved) or "none"),
                 "cotangents: " + ", ".join(f"{v} (of {k})" for k, v in self.cotangents.items()),
                 "gradients: " + ", ".join(f"{v} (of {k})" for k, v in grads.items())]
        notes += [f"note: {r}" for r in report]
        bwd = Block(bname, dims, tuple(params), tuple(outputs), tuple(body), self.f.span, tuple(notes))
        fwd = self.extend_forward(saved)
        return Derivation(fwd, bwd, saved, dict(self.cotangents), grads, report)

    def extend_forward(self, saved: tuple[str, ...]) -> Block:
        outs = list(self.f.outputs)
        have = {o.name for o in outs}
        acc_names = {v: k for k, v in self.save_acc.items()}
        body: list[Stmt] = []
        k = -1
        for s in self.f.body:
            if isinstance(s, Stage):
                k += 1
                extra = []
                name = self.save_acc.get(k)
                if name in saved:
                    assert s.acc is not None and s.acc.type is not None
                    extra.append(Eqn("copy", (s.acc,), (Var(name, None, self.acc_dtype(k)),), (), s.span, (s.span,)))
                body.append(replace(s, body=s.body + tuple(extra)))
            else:
                body.append(s)
        for name in saved:
            if name in have:
                continue
            if name in acc_names:
                st = self.f.stages[acc_names[name]]
                assert st.acc is not None and st.acc.type is not None
                outs.append(Output(name, Type(self.acc_dtype(acc_names[name]), st.acc.type.shape, MATRIX), st.span))
                continue
            bt = self.types[name]
            outs.append(Output(name, bt, self.f.span))
        notes = tuple(self.f.notes) + ("saved for the backward (extra outputs): " +
                                       (", ".join(n for n in saved if n not in have) or "none"),)
        return replace(self.f, body=tuple(body), outputs=tuple(outs), notes=notes)


def _used_dims(params: list[Param], outputs: list[Output], body: list[Stmt]) -> set[str]:
    """The dims a block names (as the parser finds them): in its signature, as values, as `over=`
    parameters and as elementwise stage shapes. A block declares only those."""
    dims: list[Dim] = [d for p in params if p.var.type for d in p.var.type.shape]
    dims += [d for o in outputs for d in o.type.shape]
    for s in body:
        eqns = s.body if isinstance(s, Stage) else (s,)
        if isinstance(s, Stage) and s.shape is not None:
            dims += list(s.shape)
        for e in eqns:
            dims += [a.dim for a in e.ins if isinstance(a, DimRef)]
            dims += [v for _, v in e.params if isinstance(v, Dim)]
    return {d.name for d in dims if d.name}


def derive(block: Block, plan: BlockPlan, wrt: list[str] | None = None) -> Derivation:
    return Reverse(block, plan, wrt).run()
