"""Where the VJP of one forward stage's epilogue runs, and what it stores.

What it does: `Site` builds the backward of one forward stage's epilogue inside the epilogue of the
GEMM that produces the cotangent of one of the stage's stored tiles (or, at the block's entry, in an
elementwise stage over the stage's tile space): it seeds the cotangents, loads or recomputes the
primal values the VJP rules ask for, runs the rules in reverse, stores `dacc` for the stage's dgrad
and wgrad GEMMs, and turns cotangents of values from outside the stage into stored tiles (matrices)
or partial reductions (vectors, scalars): the one place where broadcasting is undone in a stage.
Where a max/min reduction's ties can't be counted inside one tile, an elementwise stage before the
site counts them (the cotangent is split among the tied elements, as JAX and torch do).
What it does not: choose the host GEMM or order the stages (reverse.py does).
Invariants:
- everything it emits goes through the Builder (typed on the fly); primal values are loaded when the
  forward stores them and recomputed otherwise, never both;
- every cotangent contribution travels with the *logical* type of what it is the cotangent of (a
  `Part`): VJP rules may return a physically smaller value (a row vector standing for a tile whose
  columns are equal, e.g. after sum()'s VJP), and unbroadcasting works from the logical type: a
  vector or scalar received once per column is summed (or multiplied by the count) accordingly;
- tiles are only materialized from vectors with index ops and `expand`, never by loading a tensor
  just for its shape.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from fractions import Fraction
from typing import TYPE_CHECKING

from coda_lang.autodiff.builder import AutodiffError, Primals
from coda_lang.autodiff.builder import float_value as _float
from coda_lang.ir.nodes import Atom, DimRef, Eqn, Lit, Stage, Stmt, Var
from coda_lang.ir.types import GROUP, MATRIX, PARTIAL, SCALAR, TILE, VEC, Dim, Type
from coda_lang.ops import REGISTRY, StageShape

if TYPE_CHECKING:
    from coda_lang.autodiff.reverse import Reverse

Part = tuple[Atom, Type]  # a cotangent contribution, and the logical type of the value it is the cotangent of
INDEX_OPS = ("row_index", "col_index")


def _same(a: Type, b: Type) -> bool:
    return (a.kind, a.shape, a.group) == (b.kind, b.shape, b.group)


class Site:
    """Where the VJP of one forward stage's epilogue runs: a host GEMM's epilogue, or an
    elementwise stage over the forward stage's tile space (the block's entry)."""

    def __init__(self, r: Reverse, k: int, host: tuple[str, int, str] | None):
        self.r, self.k, self.host = r, k, host
        self.st = r.f.stages[k]
        assert self.st.acc is not None and self.st.acc.type is not None
        self.fshape = StageShape(*self.st.acc.type.shape)  # the forward stage's tile space
        self.cache: dict[str, Atom] = {}
        self.exact_cache: dict[str, Atom] = {}
        self.exact = False  # primal values recomputed from f32 sources, never loaded rounded (see `primal`)
        self.cts: dict[str, list[Part]] = {}
        self.outside: dict[str, list[Part]] = {}
        self.pre: list[Eqn] = []
        self.ties: dict[str, Atom] = {}  # max/min reduction -> its tie count (a complete vector)
        self.host_acc = False  # `acc` of the stage being built is the host GEMM's
        self.local_vec = self.vectors()

    def vectors(self) -> set[str]:
        """The stage's vectors and scalars computed from vectors alone: recomputed between stages, where
        their backward runs too. Those that depend on row/col indices stay in the site."""
        indexed: set[str] = set()
        out: set[str] = set()
        for e in self.st.body:
            dep = e.op in INDEX_OPS or any(isinstance(a, Var) and a.name in indexed for a in e.ins)
            for v in e.outs:
                assert v.type is not None
                if dep:
                    indexed.add(v.name)
                elif v.type.kind in (VEC, SCALAR):
                    out.add(v.name)
        return out

    def build(self) -> None:
        r, st = self.r, self.st
        if self.host is not None:
            tile, c, pos = self.host
            ga, gb, ta, tb = r.gemm_for(c, pos)
            shape = r.gemm_shape(ga, gb, ta, tb)
        else:
            shape = self.fshape
        # stage-local vectors are recomputed between stages, before the site
        r.bb.out = []
        for e in st.body:
            if any(v.name in self.local_vec for v in e.outs):
                for v in e.outs:
                    if v.name not in r.types:
                        r.recompute_block(v.name)
        self.pre = r.bb.out
        ties = self.tie_stage()
        r.open_stage(shape)
        self.host_acc = self.host is not None
        b = r.bb
        b.span = st.span
        b.tie_counts = self.tie_count
        # seed: the cotangents of this stage's values that later stages, outputs and vectors gave
        for e in st.body:
            for v in e.outs:
                if v.name in self.local_vec:
                    continue
                for p in r.ct.pop(v.name, []):
                    self.seed(v.name, p)
        if self.host is not None:
            self.seed(self.host[0], Var("acc"))
        for e in reversed(st.body):
            if any(v.name in self.local_vec for v in e.outs):
                continue
            self.eqn_backward(e)
        self.finish(shape, ties)
        b.tie_counts = None

    def seed(self, name: str, ct: Atom) -> None:
        b = self.r.bb
        logical = self.logical(name)
        if logical.kind == GROUP and b.type_of(ct).kind == TILE:  # a stored grouped value: one column per group
            assert b.stage is not None
            if b.type_of(ct).shape[1] not in b.stage.col_widths():
                raise AutodiffError("E0602", f"`{name}` (groups of {logical.group} columns) is used after its stage, "
                                    f"so its cotangent is a matrix of one column per group, {logical.shape[1]} wide, "
                                    "which the stage's tiles can't read (a tile is half, once or twice the stage's "
                                    "width)", self.r.fdef[name].span,
                                    notes=["use group=2, or use the grouped value only inside its stage"])
            ct = b.op("expand", ct, self.group_like(logical))
        self.cts.setdefault(name, []).append((ct, logical))

    # ------------------------------------------------------------------ types and primal values

    def logical(self, name: str) -> Type:
        """The type of a forward value as this stage's epilogue sees it."""
        r = self.r
        if name == "acc":
            assert self.st.acc is not None and self.st.acc.type is not None
            return self.st.acc.type
        t = r.ftype[name]
        if r.fstage.get(name) == self.k:
            return t
        if t.kind in (MATRIX, TILE, GROUP):
            return Type(t.dtype, t.shape, TILE)
        if t.kind == PARTIAL:
            return Type(t.dtype, t.shape, VEC if t.shape else SCALAR)
        return t

    def in_site(self, name: str) -> bool:
        """A value whose cotangent is accumulated in the site (acc and the stage's tiles)."""
        return name == "acc" or (self.r.fstage.get(name) == self.k and name not in self.local_vec)

    def at_forward_width(self) -> bool:
        st = self.r.bb.stage
        return st is not None and (st.rows, st.cols) == (self.fshape.rows, self.fshape.cols)

    def primal(self, a: Atom) -> Atom:
        """A forward value in the site. In `exact` mode (a max/min reduction's backward, which compares
        its operand with the forward's result for equality) tiles of the stage are recomputed from the
        f32 acc rather than loaded as stored (rounded to their storage dtype), as the forward stage
        computed them."""
        r = self.r
        if isinstance(a, (Lit, DimRef)):
            return a
        assert isinstance(a, Var)
        if a.name == "acc":
            return r.saved_acc(self.k)
        cache = self.exact_cache if self.exact else self.cache
        if a.name in cache:
            return cache[a.name]
        if a.name in r.params:
            out: Atom = r.forward_param(a.name)
        elif r.fstage.get(a.name) != self.k:
            out = r.block_primal(a)
        else:
            t = r.ftype[a.name]
            if a.name in self.local_vec:
                out = r.recompute_block(a.name)  # recomputed before the site
            elif t.kind == PARTIAL or t.kind == TILE and a.name in r.storage and not self.exact:
                out = r.saved_value(a.name)
            else:  # a grouped value is recomputed: stored, it is one column per group, not a group
                out = self.recompute(a.name)
        cache[a.name] = out
        return out

    def recompute(self, name: str) -> Atom:
        r, b = self.r, self.r.bb
        e = r.fdef[name]
        if e.op in INDEX_OPS and not self.at_forward_width():
            raise AutodiffError("E0602", f"`{name}` uses {e.op}() in a stage whose backward runs at another "
                                "width; it can't be recomputed there", e.span)
        ins = [self.primal(a) for a in e.ins]
        prev = b.span
        b.span = e.span
        outs = b.ops(e.op, *ins, names=tuple(r.claim(v.name) for v in e.outs), params=dict(e.params))
        b.span = prev
        cache = self.exact_cache if self.exact else self.cache
        for o, v in zip(outs, e.outs, strict=True):
            cache[v.name] = o
        return cache[name]

    def tie_count(self, e: Eqn) -> Atom:
        return self.ties[e.outs[0].name]

    def tie_stage(self) -> list[Stmt]:
        """An elementwise stage over the forward tile space counting the elements that attain each of
        the stage's max/min reductions (over rows or columns: the count is complete only after every
        tile ran, so it can't be made in the site itself)."""
        r = self.r
        eqns = [e for e in self.st.body if e.op in ("reduce_max", "reduce_min") and e.param("group") is None
                and e.outs[0].name in r.ct]
        if not eqns:
            return []
        caches, host = (self.cache, self.exact_cache), self.host
        self.cache, self.exact_cache, self.host, self.exact = {}, {}, None, True
        r.open_stage(self.fshape)
        b = r.bb
        for e in eqns:
            b.span = e.span
            mask = b.op("eq", self.primal(e.ins[0]), self.primal(e.outs[0]))
            over = e.param("over")
            assert isinstance(over, Dim)
            self.ties[e.outs[0].name] = b.sum_over(b.where(mask, b.lit(1.0), b.lit(0.0)), over)
        before, body = r.close_stage()
        (self.cache, self.exact_cache), self.host, self.exact = caches, host, False
        names = ", ".join(f"`{e.outs[0].name}`" for e in eqns)
        r.report.append((self.st.span, f"stage {self.k + 1} (line {self.st.span.line}): the ties of {names} are "
                         "counted in an elementwise stage (a max's cotangent is split among its ties)"))
        return [*before, Stage(None, None, False, False, None, tuple(body), (self.fshape.rows, self.fshape.cols),
                               span=self.st.span)]

    # ------------------------------------------------------------------ broadcasting

    def fill(self, c: Atom, like: Type) -> Atom:
        """c (a vector, scalar or group standing for a tile of type `like`) as a tile of that shape."""
        b = self.r.bb
        st = b.stage
        assert st is not None
        t = b.type_of(c)
        if t.kind == TILE:
            return c
        if like.kind == GROUP:
            if t.kind in (VEC, SCALAR):
                return b.op("expand", c, self.group_like(like))
            return c  # already a group
        rows, width = like.shape
        if self.host_acc and (rows, width) == (st.rows, st.cols):
            return b.op("expand", c, Var("acc"))
        if t.kind == GROUP:
            return b.op("expand", c, self.fill(Lit(0.0, "f32"), like))
        x = b.stage_tile(c)
        if x is None:  # a square stage: row and column vectors don't make a tile; a tile of the site does
            return b.op("expand", c, self.square_like(like))
        have = b.type_of(x).shape[1]
        if have == width:
            return x
        if have.scale(Fraction(1, 2)) == width:
            return b.ops("pairs", x)[0]
        if have.scale(2) == width:
            return b.op("interleave", x, x)
        raise AutodiffError("E0601", f"autodiff can't broadcast a value to a tile of width `{width}` in a stage of "
                            f"width `{st.cols}`", b.span, notes=["this is a bug in coda_lang's autodiff; please report it"])

    def square_like(self, like: Type) -> Atom:
        """A tile of type `like` that the site reads or computes anyway (in a square stage, where index
        vectors don't make tiles); else the forward's saved acc, if it has that shape."""
        b = self.r.bb
        for e in reversed(b.out):
            for a in (*e.outs, *e.ins):
                if isinstance(a, Var) and a.name != "acc" and _same(b.type_of(a), like):
                    return a
        for parts in self.cts.values():
            for a, _ in parts:
                if isinstance(a, Var) and _same(b.type_of(a), like):
                    return a
        if like.shape == (self.fshape.rows, self.fshape.cols):
            return self.primal(Var("acc"))
        raise AutodiffError("E0602", f"can't broadcast a cotangent to a {like} in a square stage", self.st.span)

    def group_like(self, like: Type) -> Atom:
        """A value of the grouped type `like` (zeros), to `expand` a per-group tile or vector to."""
        b = self.r.bb
        assert like.group is not None
        full = Type(like.dtype, (like.shape[0], like.shape[1].scale(like.group)), TILE)
        zeros = self.fill(Lit(0.0, "f32"), full)
        return b.sum_over(zeros, full.shape[1], group=like.group)

    def unbroadcast_local(self, c: Atom, logical: Type, target: Type) -> Part:
        """A cotangent contribution of logical type `logical` (the broadcast operand of the op that made it)
        as a contribution to the in-site value of type `target`: a group broadcast over its columns sums
        them, a vector made from indices keeps the broadcast form."""
        b = self.r.bb
        if _same(logical, target):
            return c, target
        if target.kind == GROUP and logical.kind == TILE:  # a group broadcast over its columns: sum each group
            g = target.group
            assert g is not None and b.stage is not None
            t = b.type_of(c)
            if t.kind == TILE:
                return b.sum_over(c, t.shape[1], group=g), target
            if t.kind in (GROUP, SCALAR) or (t.kind == VEC and t.shape[0] == b.stage.rows):
                return b.mul(c, b.lit(g)), target  # g equal columns per group
            return b.sum_over(self.fill(c, logical), logical.shape[1], group=g), target
        if target.kind in (VEC, SCALAR):  # a vector made from indices: its cotangent keeps the broadcast form
            return c, logical
        raise AutodiffError("E0601", f"autodiff can't turn a cotangent of a {logical} into one of a {target}",
                            b.span, notes=["this is a bug in coda_lang's autodiff; please report it"])

    # ------------------------------------------------------------------ reverse pass

    def take(self, name: str) -> Part | None:
        parts = self.cts.pop(name, [])
        if not parts:
            return None
        logical = parts[0][1]
        total: Atom | None = None
        for p, t in parts:
            if not _same(t, logical):
                raise AutodiffError("E0602", f"`{name}` is broadcast to tiles of two shapes ({logical} and {t}); "
                                    "its cotangents can't be added", self.r.fdef[name].span if name in self.r.fdef
                                    else self.st.span)
            total = p if total is None else self.r.bb.add(total, p)
        self.r.name_ct(total, name)
        assert total is not None
        return total, logical

    def eqn_backward(self, e: Eqn) -> None:
        r, b = self.r, self.r.bb
        op = REGISTRY[e.op]
        taken = [self.take(v.name) if _float(v.type) else None for v in e.outs]
        if all(t is None for t in taken):
            return
        if op.vjp is None:
            if op.differentiable:
                raise AutodiffError("E0601", f"`{op.surface}` has no VJP rule", e.span)
            return
        b.span = e.span
        cts: list[Atom | None] = [t[0] if t is not None else None for t in taken]
        if op.locality == "pair":  # pairs/interleave move columns: they need whole tiles
            cts = [self.fill(t[0], t[1]) if t is not None else None for t in taken]
        self.exact = e.op in ("reduce_max", "reduce_min")
        got = op.vjp(b, Primals(e, self.primal), cts if op.nout > 1 else cts[0])
        self.exact = False
        out_logical = next(t[1] for t in taken if t is not None)
        if e.op == "interleave":  # its operands broadcast to half its width
            rows, wide = out_logical.shape
            out_logical = Type(out_logical.dtype, (rows, wide.scale(Fraction(1, 2))), TILE)
        for a, c in zip(e.ins, got, strict=True):
            if c is None or not isinstance(a, Var):
                continue
            target = self.logical(a.name)
            # a pointwise op's (or interleave's) cotangents are of its broadcast operands; the others' of their inputs
            logical = out_logical if op.locality == "pointwise" or e.op == "interleave" else target
            if self.in_site(a.name):
                if not _float(target):
                    continue
                self.cts.setdefault(a.name, []).append(self.unbroadcast_local(c, logical, target))
                continue
            t = r.ftype.get(a.name)
            if not _float(t) or (a.name in r.params and a.name not in r.wrt):
                continue
            self.outside.setdefault(a.name, []).append((c, logical))

    # ------------------------------------------------------------------ the site's outputs

    def local(self, c: Atom) -> bool:
        return isinstance(c, Var) and c.name in self.r.bb.local

    def finish(self, shape: StageShape, ties: list[Stmt]) -> None:
        r, b = self.r, self.r.bb
        st = self.st
        post: list[Callable[[], None]] = []
        got = self.take("acc")
        dacc_src: Atom | None = None
        aliases: list[tuple[str, Atom]] = []
        od = r.operand_dtype(self.k)
        if got is not None and st.is_gemm:
            assert st.acc is not None and st.acc.type is not None
            dacc = self.fill(got[0], st.acc.type)
            bt = r.types.get(dacc.name) if isinstance(dacc, Var) else None
            if isinstance(dacc, Var) and dacc.name not in b.local and bt is not None and bt.kind == MATRIX \
                    and bt.dtype == od:
                r.dacc[self.k] = dacc  # already a matrix of the GEMM's dtype (e.g. an output's cotangent): no copy
            else:
                out = b.op("copy", dacc, name=r.names.fresh(f"dacc{self.k + 1}"), annot=od)
                r.dacc[self.k] = Var(out.name)
                dacc_src = dacc
        for name, parts in self.outside.items():
            target = r.after_type(name)
            if target.kind != MATRIX:
                self.reduce_outside(name, parts, target, post)
                continue
            like = Type(target.dtype, target.shape, TILE)
            total: Atom | None = None
            for c, _ in parts:
                c = self.fill(c, like)
                total = c if total is None else b.add(total, c)
            assert total is not None
            total = r.accumulate(total, name, b)
            pt = r.params[name].var.type if name in r.params else None
            if isinstance(total, Var) and total.name not in b.local and (pt is None or r.types[total.name].dtype == pt.dtype):
                r.ct.setdefault(name, []).append(total)  # an alias of a loaded matrix
                continue
            if total == dacc_src and pt is not None and pt.dtype == od:
                aliases.append((name, r.dacc[self.k]))  # the same tile as dacc (e.g. a residual's dx)
                continue
            out = b.op("copy", total, name=r.names.fresh(f"d{name}"), annot=None if name in r.params else "f32")
            r.ct.setdefault(name, []).append(Var(out.name))
        before, body = r.close_stage()
        r.body.extend(self.pre)
        r.body.extend(ties)
        r.body.extend(before)
        if body:
            if self.host is not None:
                _, consumer, pos = self.host
                ga, gb, ta, tb = r.gemm_for(consumer, pos)
                r.body.append(Stage(ga, gb, ta, tb, Var("acc"), tuple(body), span=st.span))
            else:
                r.body.append(Stage(None, None, False, False, None, tuple(body), (shape.rows, shape.cols), span=st.span))
                what = ", ".join(f"`{n}`" for n in sorted({v.name for e in st.body for v in e.outs if v.name in r.storage}))
                r.report.append((st.span, f"stage {self.k + 1} (line {st.span.line}): no GEMM produces the cotangent "
                                 f"of {what or 'its outputs'}, so its backward runs as an elementwise stage"))
        r.bb.out = []
        for fn in post:
            fn()
        for name, same in aliases:
            r.ct.setdefault(name, []).append(r.bb.op("copy", same, name=r.names.fresh(f"d{name}")))
        r.body.extend(r.bb.out)
        # the backward of stage-local vector computations runs between stages, after the site
        r.bb.out = []
        for e in reversed(st.body):
            if any(v.name in self.local_vec for v in e.outs):
                r.block_eqn_backward(e)
        r.body.extend(r.bb.out)
        r.bb.out = []

    def reduce_outside(self, name: str, parts: list[Part], target: Type, post: list[Callable[[], None]]) -> None:
        """Cotangents of a vector or scalar from outside the site, broadcast in it: partial sums here (of
        tiles), or, for a vector that is complete already, a sum and a count between stages."""
        r, b = self.r, self.r.bb
        tiles: dict[tuple[object, ...], Atom] = {}
        for c, logical in parts:
            t = b.type_of(c)
            if t.kind in (VEC, SCALAR) and not self.local(c):
                post.append(functools.partial(self.post_unbroadcast, name, c, logical, target))
                continue
            if t.kind in (VEC, SCALAR):
                c = self.fill(c, logical)
                t = b.type_of(c)
            key = (t.kind, t.shape, t.group)  # tiles of one shape add; each shape is reduced on its own
            tiles[key] = b.add(tiles[key], c) if key in tiles else c
        for c in tiles.values():
            t = b.type_of(c)
            if target.kind == VEC:
                rows = t.kind == GROUP or (target.shape[0] == t.shape[0] and target.shape[0] != t.shape[1])
                part = b.sum_over(c, t.shape[1] if rows else t.shape[0])
                r.ct.setdefault(name, []).append(Var(part.name))
            else:  # a scalar: partial row sums here, their sum between stages
                part = self.row_sums(c)
                post.append(functools.partial(self.post_sum, name, Var(part.name), t.shape[0]))

    def post_unbroadcast(self, name: str, c: Atom, logical: Type, target: Type) -> None:
        self.r.ct.setdefault(name, []).append(self.block_unbroadcast(c, logical, target))

    def post_sum(self, name: str, partial: Var, over: Dim) -> None:
        self.r.ct.setdefault(name, []).append(self.r.bb.sum_over(partial, over))

    def row_sums(self, c: Atom) -> Var:
        """Partial sums over the columns of a tile. A square tile's columns can't be named by their extent:
        a double-width one is summed as the two halves of its column pairs, another one interleaved
        with zeros (twice as wide, so no longer square)."""
        b = self.r.bb
        t = b.type_of(c)
        assert b.stage is not None
        if t.kind == TILE and t.shape[0] == t.shape[1]:
            if t.shape[1] == b.stage.cols.scale(2):
                lo, hi = b.ops("pairs", c)
                c = b.add(lo, hi)
            else:
                c = b.op("interleave", c, b.lit(0.0))
            t = b.type_of(c)
        return b.sum_over(c, t.shape[1])

    def block_unbroadcast(self, c: Atom, logical: Type, target: Type) -> Atom:
        """Between stages: a complete vector or scalar `c` that stood for a value of type `logical` in the
        stage, as the cotangent of `target`: sums over the axes `c` has and `target` lacks, times the
        extent of the axes neither has (each element of `target` received `c` that many times)."""
        b = self.r.bb
        t = b.type_of(c)
        axes = {"rows": logical.shape[0], "cols": logical.shape[1]} if len(logical.shape) == 2 else \
            {"rows": logical.shape[0]} if logical.shape else {}

        def axis(d: Dim) -> str:
            return "rows" if axes.get("rows") == d else "cols"

        have = axis(t.shape[0]) if t.kind == VEC else None
        want = axis(target.shape[0]) if target.kind == VEC else None
        if have is not None and have != want:
            c = b.sum_over(c, t.shape[0])
        for ax, d in axes.items():
            if ax not in (have, want):
                c = b.mul(c, DimRef(d))
        return c
