"""Where the VJP of one forward stage's epilogue runs, and what it stores.

What it does: `Site` builds the backward of one forward stage's epilogue inside the epilogue of the
GEMM that produces the cotangent of one of the stage's stored tiles (or, at the block's entry, in an
elementwise stage over the stage's tile space): it seeds the cotangents, loads or recomputes the
primal values the VJP rules ask for, runs the rules in reverse, stores `dacc` for the stage's dgrad
and wgrad GEMMs, and turns cotangents of values from outside the stage into stored tiles (matrices)
or partial reductions (vectors, scalars): the one place where broadcasting is undone.
What it does not: choose the host GEMM or order the stages (reverse.py does).
Invariants: everything it emits goes through the Builder (typed on the fly); primal values are
loaded when the forward stores them and recomputed otherwise, never both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from coda_lang.autodiff.builder import AutodiffError, Primals
from coda_lang.autodiff.builder import float_value as _float
from coda_lang.ir.nodes import Atom, DimRef, Eqn, Lit, Stage, Var
from coda_lang.ir.types import GROUP, MATRIX, PARTIAL, SCALAR, TILE, VEC, Dim, Type
from coda_lang.ops import REGISTRY, StageShape

if TYPE_CHECKING:
    from coda_lang.autodiff.reverse import Reverse


class Site:
    """Where the VJP of one forward stage's epilogue runs: a host GEMM's epilogue, or an
    elementwise stage over the forward stage's tile space (the block's entry)."""

    def __init__(self, r: Reverse, k: int, host: tuple[str, int, str] | None):
        self.r, self.k, self.host = r, k, host
        self.st = r.f.stages[k]
        self.cache: dict[str, Atom] = {}
        self.cts: dict[str, list[Atom]] = {}
        self.outside: dict[str, list[Atom]] = {}
        self.pre: list[Eqn] = []

    def build(self) -> None:
        r, st = self.r, self.st
        local_vec = {v.name for e in st.body for v in e.outs if v.type is not None and v.type.kind in (VEC, SCALAR)}
        if self.host is not None:
            tile, c, pos = self.host
            ga, gb, ta, tb = r.gemm_for(c, pos)
            shape = r.gemm_shape(ga, gb, ta, tb)
        else:
            assert st.acc is not None or st.shape is not None
            rows, cols = st.acc.type.shape if st.acc is not None and st.acc.type else st.shape  # type: ignore[misc]
            shape = StageShape(rows, cols)
        # stage-local vectors are recomputed between stages, before the site
        r.bb.out = []
        for e in st.body:
            if any(v.name in local_vec for v in e.outs):
                for v in e.outs:
                    if v.name not in r.types:
                        r.recompute_block(v.name)
        self.pre = r.bb.out
        r.open_stage(shape)
        b = r.bb
        b.span = st.span
        # seed: the cotangents of this stage's values that later stages, outputs and vectors gave
        for e in st.body:
            for v in e.outs:
                if v.name in local_vec:
                    continue
                parts = r.ct.pop(v.name, [])
                if parts:
                    self.cts.setdefault(v.name, []).extend(parts)
        if self.host is not None:
            self.cts.setdefault(self.host[0], []).append(Var("acc"))
        for e in reversed(st.body):
            if any(v.name in local_vec for v in e.outs):
                continue
            self.eqn_backward(e)
        self.finish(shape)

    # primal values inside the site
    def primal(self, a: Atom) -> Atom:
        r = self.r
        if isinstance(a, (Lit, DimRef)):
            return a
        assert isinstance(a, Var)
        if a.name == "acc":
            return r.saved_acc(self.k)
        if a.name in self.cache:
            return self.cache[a.name]
        if a.name in r.params:
            out: Atom = r.forward_param(a.name)
        elif r.fstage.get(a.name) != self.k:
            out = r.block_primal(a)
        else:
            t = r.ftype[a.name]
            if t.kind in (VEC, SCALAR):
                out = r.recompute_block(a.name)  # recomputed before the site
            elif t.kind == PARTIAL or t.kind in (TILE, GROUP) and a.name in r.storage:
                out = r.saved_value(a.name)
            else:
                out = self.recompute(a.name)
        self.cache[a.name] = out
        return out

    def recompute(self, name: str) -> Atom:
        r, b = self.r, self.r.bb
        e = r.fdef[name]
        if e.op in ("row_index", "col_index") and self.host is not None:
            raise AutodiffError("E0602", f"`{name}` uses {e.op}() in a stage whose backward runs at another "
                                "width; it can't be recomputed there", e.span)
        ins = [self.primal(a) for a in e.ins]
        prev = b.span
        b.span = e.span
        outs = b.ops(e.op, *ins, names=tuple(r.claim(v.name) for v in e.outs), params=dict(e.params))
        b.span = prev
        for o, v in zip(outs, e.outs, strict=True):
            self.cache[v.name] = o
        return self.cache[name]

    def take(self, name: str) -> Atom | None:
        parts = self.cts.pop(name, [])
        total: Atom | None = None
        for p in parts:
            total = p if total is None else self.r.bb.add(total, p)
        self.r.name_ct(total, name)
        return total

    def eqn_backward(self, e: Eqn) -> None:
        r, b = self.r, self.r.bb
        op = REGISTRY[e.op]
        cts = [self.take(v.name) if _float(v.type) else None for v in e.outs]
        if all(c is None for c in cts):
            return
        if op.vjp is None:
            if op.differentiable:
                raise AutodiffError("E0601", f"`{op.surface}` has no VJP rule", e.span)
            return
        b.span = e.span
        got = op.vjp(b, Primals(e, self.primal), cts if op.nout > 1 else cts[0])
        for a, c in zip(e.ins, got, strict=True):
            if c is None or not isinstance(a, Var):
                continue
            if a.name == "acc":
                self.cts.setdefault("acc", []).append(c)
                continue
            t = r.ftype.get(a.name)
            if not _float(t) or (a.name in r.params and a.name not in r.wrt):
                continue
            if r.fstage.get(a.name) == self.k and t is not None and t.kind not in (VEC, SCALAR):
                if t.kind == GROUP and b.type_of(c).kind == TILE:  # unbroadcast over each group's columns
                    c = b.sum_over(c, b.type_of(c).shape[1], group=t.group)
                self.cts.setdefault(a.name, []).append(c)
            else:
                self.outside.setdefault(a.name, []).append(c)

    def finish(self, shape: StageShape) -> None:
        r, b = self.r, self.r.bb
        st = self.st
        post: list[Eqn] = []
        deferred: list[tuple[str, Atom, Dim]] = []
        dacc = self.take("acc")
        dacc_src: Atom | None = None
        aliases: list[tuple[str, Atom]] = []
        if dacc is not None and st.is_gemm:
            if b.type_of(dacc).kind != TILE:
                dacc = b.op("expand", dacc, self.primal(Var("acc")))
            if isinstance(dacc, Var) and dacc.name not in b.local and r.types.get(dacc.name, Type("f32")).kind == MATRIX:
                r.dacc[self.k] = dacc  # already a matrix (e.g. an output's cotangent): no copy
            else:
                out = b.op("copy", dacc, name=r.names.fresh(f"dacc{self.k + 1}"), annot=r.plan.activation)
                r.dacc[self.k] = Var(out.name)
                dacc_src = dacc
        for name, parts in self.outside.items():
            total: Atom = parts[0]
            for p in parts[1:]:
                total = b.add(total, p)
            target = r.ftype[name]
            ct = b.type_of(total)
            if target.kind == MATRIX or target.kind in (TILE, GROUP):
                if ct.kind not in (TILE,):
                    total = b.op("expand", total, self.primal(Var(name)))
                total = r.accumulate(total, name, b)
                if isinstance(total, Var) and total.name not in b.local:
                    r.ct.setdefault(name, []).append(total)  # an alias of a loaded matrix
                    continue
                pt = r.params[name].var.type if name in r.params else None
                if total == dacc_src and pt is not None and pt.dtype == r.plan.activation:
                    aliases.append((name, r.dacc[self.k]))  # the same tile as dacc (e.g. a residual's dx)
                    continue
                out = b.op("copy", total, name=r.names.fresh(f"d{name}"),
                           annot=None if name in r.params else "f32")
                r.ct.setdefault(name, []).append(Var(out.name))
            elif ct.kind in (VEC, SCALAR) and not (isinstance(total, Var) and total.name in b.local):
                r.ct.setdefault(name, []).append(total)  # a block-level vector already
            elif ct.kind in (TILE, GROUP):
                assert b.stage is not None
                if target.kind == VEC:
                    over = ct.shape[1] if target.shape[0] == ct.shape[0] else ct.shape[0]
                    part = b.sum_over(total, over)
                    r.ct.setdefault(name, []).append(Var(part.name))
                else:  # a scalar: partial row sums here, their sum between stages
                    part = b.sum_over(total, ct.shape[1])
                    deferred.append((name, Var(part.name), ct.shape[0]))
            else:
                raise AutodiffError("E0602", f"can't reduce the cotangent of `{name}` (a {ct.kind}) to a {target.kind}",
                                    st.span)
        body = r.close_stage()
        r.body.extend(self.pre)
        if body:
            if self.host is not None:
                _, c, pos = self.host
                ga, gb, ta, tb = r.gemm_for(c, pos)
                r.body.append(Stage(ga, gb, ta, tb, Var("acc"), tuple(body), span=st.span))
            else:
                r.body.append(Stage(None, None, False, False, None, tuple(body), (shape.rows, shape.cols), span=st.span))
                what = ", ".join(f"`{n}`" for n in sorted({v.name for e in st.body for v in e.outs if v.name in r.storage}))
                r.report.append((st.span, f"stage {self.k + 1} (line {st.span.line}): no GEMM produces the cotangent "
                                 f"of {what or 'its outputs'}, so its backward runs as an elementwise stage"))
        r.bb.out = []
        for name, partial, over in deferred:
            r.ct.setdefault(name, []).append(r.bb.sum_over(partial, over))
        for name, same in aliases:
            r.ct.setdefault(name, []).append(r.bb.op("copy", same, name=r.names.fresh(f"d{name}")))
        r.body.extend(r.bb.out + post)
        # the backward of stage-local vector computations runs between stages, after the site
        r.bb.out = []
        for e in reversed(st.body):
            if any(v.type is not None and v.type.kind in (VEC, SCALAR) for v in e.outs):
                r.block_eqn_backward(e)
        r.body.extend(r.bb.out)
        r.bb.out = []
