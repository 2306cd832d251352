"""Where the VJP of one forward stage's epilogue runs, and what it stores.

What it does: `Site` builds the backward of one forward stage's epilogue inside the epilogue of the
GEMM that produces the cotangent of one of the stage's stored tiles (a `Host`, chosen by reverse.py)
or, at the block's entry, in an elementwise stage over the stage's tile space: it seeds the
cotangents, loads or recomputes the primal values the VJP rules ask for, runs the rules in reverse,
stores `dacc` for the stage's dgrad and wgrad GEMMs, and turns cotangents of values from outside the
stage into stored tiles (matrices) or partial reductions (vectors, scalars, with unbroadcast.py).
Where a max/min reduction's ties can't be counted inside one tile, an elementwise stage before the
site counts them (the cotangent is split among the tied elements, as JAX and torch do).
What it does not: choose the host GEMM, order the stages, or run the backward of the stage's vector
computations between stages (reverse.py does); it knows nothing of reverse.py: it reads the forward
facts and changes the shared `State` only through its methods (reads of the forward, cotangent
contributions, `set_dacc`, the stages it emits, report notes), emitting through the state's builder.
Invariants:
- primal values are loaded when the forward stores them and recomputed otherwise, never both in one
  place (a max/min reduction's backward recomputes from f32 what it compares: see `primal`);
- every cotangent contribution travels with the *logical* type of what it is the cotangent of (a
  `Part`): VJP rules may return a physically smaller value (a row vector standing for a tile whose
  columns are equal, e.g. after sum()'s VJP), and unbroadcasting works from the logical type;
- tiles are only materialized from vectors with index ops and `expand`, never by loading a tensor
  just for its shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from coda_lang.autodiff import unbroadcast
from coda_lang.autodiff.builder import AutodiffError, Primals
from coda_lang.autodiff.builder import float_value as _float
from coda_lang.autodiff.forward import is_index
from coda_lang.autodiff.state import Gemm, State
from coda_lang.autodiff.unbroadcast import Later, Part, same_shape
from coda_lang.frontend.verify.repeat import repeated
from coda_lang.ir.nodes import Atom, DimRef, Eqn, Lit, Span, Stage, Var
from coda_lang.ir.types import GROUP, MATRIX, PARTIAL, SCALAR, TILE, VEC, Dim, Type, cotangent_dtype, is_fp8
from coda_lang.ops import REGISTRY, Lanes, Locality, StageShape


def _elementwise(body: list[Eqn], shape: StageShape, span: Span) -> Stage:
    """An elementwise stage (no GEMM) over tile space `shape`."""
    return Stage(None, None, False, False, None, tuple(body), (shape.rows, shape.cols), span=span)


@dataclass(frozen=True)
class Host:
    """The GEMM whose epilogue hosts a site: its output (of tile space `shape`) is the cotangent of
    the forward tile `tile`; `gemm` is its (a, b, ta, tb). Or (`recompute`) the forward stage's own GEMM
    run again in the backward: its `acc` is the forward's f32 accumulator, so the site reads it
    instead of a saved copy (rematerialization), and no tile of the stage is kept from the forward."""

    tile: str | None
    gemm: Gemm
    shape: StageShape
    recompute: bool = False


class Site:
    """Where the VJP of one forward stage's epilogue runs: a host GEMM's epilogue, or an
    elementwise stage over the forward stage's tile space (the block's entry)."""

    def __init__(self, s: State, k: int, host: Host | None, make: frozenset[str] = frozenset()):
        self.s, self.fwd, self.k, self.host = s, s.fwd, k, host
        # stored tiles of the stage that the site recomputes and stores (remat in an epilogue), so that
        # the forward need not keep them for what runs after the site
        self.make = make
        self.st = s.fwd.block.stages[k]
        if self.st.acc is not None:  # the forward stage's tile space
            assert self.st.acc.type is not None
            self.fshape = StageShape(*self.st.acc.type.shape)
        else:  # an elementwise stage of the forward
            assert self.st.shape is not None
            self.fshape = StageShape(*self.st.shape)
        self.cache: dict[str, Atom] = {}
        self.exact_cache: dict[str, Atom] = {}
        self.exact = False  # primal values recomputed from f32 sources, never loaded rounded (see `primal`)
        self.cts: dict[str, list[Part]] = {}
        self.outside: dict[str, list[Part]] = {}
        self.ties: dict[str, Atom] = {}  # max/min reduction -> its tie count (a complete vector)
        self.host_acc = False  # `acc` of the stage being built is the host GEMM's
        self.local_vec = s.fwd.stage_vectors(k)  # recomputed, and differentiated, between stages

    def build(self) -> None:
        s, st = self.s, self.st
        shape = self.host.shape if self.host is not None else self.fshape
        self.tie_stage()
        s.open_stage(shape)
        self.host_acc = self.host is not None
        b = s.b
        b.span = st.span
        b.tie_counts = self.tie_count
        # seed: the cotangents of this stage's values that later stages, outputs and vectors gave (a
        # value made by an op no gradient flows through, detach, drops them: none reaches the stage)
        for e in st.body:
            for v in e.outs:
                if v.name in self.local_vec:
                    continue
                parts = s.take_cotangents(v.name)
                if parts and REGISTRY[e.op].stops_gradient:
                    continue
                for p in parts:
                    self.seed(v.name, p)
        if self.host is not None and self.host.tile is not None:
            self.seed(self.host.tile, s.dequantize(self.host.gemm, Var("acc")))
        for e in reversed(st.body):
            if any(v.name in self.local_vec for v in e.outs):
                continue
            self.eqn_backward(e)
        self.finish(shape)
        b.tie_counts = None

    def seed(self, name: str, ct: Atom) -> None:
        b = self.s.b
        logical = self.logical(name)
        if logical.kind == GROUP and b.type_of(ct).kind in (
            TILE,
            MATRIX,
        ):  # a stored grouped value: one column per group (a matrix where it doesn't line up)
            assert b.stage is not None
            if b.type_of(ct).shape[1] not in b.stage.col_widths():
                raise AutodiffError(
                    "E0602",
                    f"`{name}` (groups of {logical.group} columns) is used after its stage, "
                    f"so its cotangent is a matrix of one column per group, {logical.shape[1]} wide, "
                    "which the stage's tiles can't read (a tile is half, once or twice the stage's "
                    "width)",
                    self.fwd.fdef[name].span,
                    notes=[
                        "use group=2, or use the grouped value only inside its stage, or `detach` it "
                        "if no gradient should flow through it (a statistic such as an fp8 amax: "
                        "`amax = detach(max(abs(acc), over=N, group=128))`)"
                    ],
                )
            ct = b.op("expand", ct, self.group_like(logical))
        self.cts.setdefault(name, []).append((ct, logical))

    # ------------------------------------------------------------------ types and primal values

    def logical(self, name: str) -> Type:
        """The type of a forward value as this stage's epilogue sees it."""
        fwd = self.fwd
        if name == "acc":
            assert self.st.acc is not None and self.st.acc.type is not None
            return self.st.acc.type
        t = fwd.ftype[name]
        if fwd.fstage.get(name) == self.k:
            return t
        if t.kind in (MATRIX, TILE, GROUP):
            return Type(t.dtype, t.shape, TILE)
        if t.kind == PARTIAL:
            return Type(t.dtype, t.shape, VEC if t.shape else SCALAR)
        return t

    @property
    def remat(self) -> bool:
        """The site runs in its stage's own GEMM, run again: `acc` is the forward's, and the stage's
        tiles are recomputed from it rather than read as saved (not in a tie-count stage before it)."""
        return self.host_acc and self.host is not None and self.host.recompute

    def in_site(self, name: str) -> bool:
        """A value whose cotangent is accumulated in the site (acc and the stage's tiles)."""
        return name == "acc" or (self.fwd.fstage.get(name) == self.k and name not in self.local_vec)

    def at_forward_width(self) -> bool:
        st = self.s.b.stage
        return st is not None and (st.rows, st.cols) == (self.fshape.rows, self.fshape.cols)

    def primal(self, a: Atom) -> Atom:
        """A forward value in the site. In `exact` mode (a max/min reduction's backward, which compares
        its operand with the forward's result for equality) tiles of the stage are recomputed from the
        f32 acc rather than loaded as stored (rounded to their storage dtype), as the forward stage
        computed them."""
        s, fwd = self.s, self.fwd
        if isinstance(a, (Lit, DimRef)):
            return a
        assert isinstance(a, Var)
        if a.name == "acc":
            copy = None if self.remat or self.exact else s.acc_copy(self.k)
            if copy is None:
                return Var("acc") if self.remat else s.read_acc(self.k)
            if "acc" not in self.cache:  # (BackwardOptions.fp8_acc: read from the stage's fp8 copy)
                q, scale = copy
                inv = s.b.div(s.b.lit(1.0), s.read_between(scale))
                self.cache["acc"] = s.b.mul(s.read_saved(q), inv)
                s.acc_copies[self.k] = (q, scale)
            return self.cache["acc"]
        cache = self.exact_cache if self.exact else self.cache
        if a.name in cache:
            return cache[a.name]
        if self.recomputes(a.name):
            return self.recompute(a.name)
        if a.name in fwd.params:
            out: Atom = s.read_param(a.name)
        elif fwd.fstage.get(a.name) != self.k:
            out = s.read_between(a)
        elif a.name in self.local_vec:
            out = s.recompute_between(a.name)  # recomputed before the site
        elif self.reads_group(a.name):
            out = self.saved_group(a.name)
        else:
            out = s.read_saved(a.name)
        cache[a.name] = out
        return out

    def reads_group(self, name: str) -> bool:
        """Whether grouped value `name` of the stage is read from the forward's stored copy rather than
        recomputed: a detached grouped reduction the forward stores anyway (a block scale, one column
        per group: `ax = detach(max(abs(x), over=D, group=128))`) of a stage whose backward runs in a
        GEMM epilogue at the forward's width, where recomputing it would reduce over groups of a
        tile the epilogue loads (which the kernels don't fold). Read over its groups (`expand`), it
        is the same f32 values."""
        fwd = self.fwd
        t = fwd.ftype.get(name)
        e = fwd.fdef.get(name)
        return (
            t is not None
            and t.kind == GROUP
            and t.group_axis == 1
            and name in fwd.storage
            and fwd.storage[name] == "f32"
            and e is not None
            and REGISTRY[e.op].stops_gradient
            and not self.exact
            and not self.remat
            and self.at_forward_width()
        )

    def saved_group(self, name: str) -> Atom:
        """The stored copy of grouped value `name` (reads_group), read over its groups: a tile."""
        t = self.fwd.ftype[name]
        assert t.group is not None
        b = self.s.b
        full = Type(t.dtype, (t.shape[0], t.shape[1].scale(t.group)), TILE)
        st = b.stage
        like: Atom
        if self.host_acc and st is not None and full.shape == (st.rows, st.cols):
            like = Var("acc")
        else:
            like = self.fill(Lit(0.0, "f32"), full)
        return b.op("expand", self.s.read_saved(name), like)

    def recomputes(self, name: str) -> bool:
        """Whether `primal` gets value `name` of the stage by recomputing it in the site, not by reading it
        (a parameter, a value of another stage or between stages, a saved tile). A grouped value is
        recomputed: stored, it is one column per group, not a group. So is a tile the stage stores in
        fp8: the stage's own uses saw its f32 value, and the straight-through backward differentiates
        that value (a VJP that reads its op's result, sqrt's or exp's, reads the f32 one), not the
        quantized copy, which is an fp8 ulp (6% in e4m3) away."""
        fwd = self.fwd
        if name in fwd.params or fwd.fstage.get(name) != self.k or name in self.local_vec:
            return False
        if self.reads_group(name):
            return False
        t = fwd.ftype[name]
        return not (
            t.kind == PARTIAL
            or t.kind == TILE
            and name in fwd.storage
            and not (self.exact or self.remat or is_fp8(fwd.storage[name]))
            and (name not in self.make or self.s.is_saved(name))
        )

    def recompute(self, name: str) -> Atom:
        """Value `name` of the stage recomputed in the site, after what it reads: a chain of statements
        as deep as the program's, walked with a stack of its own, not Python's (no depth limit), each
        operand got in the order the statement reads them, as a recursive walk gets them."""
        cache = self.exact_cache if self.exact else self.cache
        self.check_recompute(name)
        todo: list[tuple[str, int]] = [(name, 0)]
        while todo:
            top, i = todo[-1]
            e = self.fwd.fdef[top]
            if i < len(e.ins):
                todo[-1] = (top, i + 1)
                a = e.ins[i]
                if isinstance(a, Var) and a.name != "acc" and a.name not in cache and self.recomputes(a.name):
                    self.check_recompute(a.name)
                    todo.append((a.name, 0))
                else:
                    self.primal(a)
                continue
            todo.pop()
            if top not in cache or not todo:  # (a statement's other output may have made it)
                self.recompute_one(top)
        return cache[name]

    def check_recompute(self, name: str) -> None:
        e = self.fwd.fdef[name]
        if is_index(e) and not self.at_forward_width():
            raise AutodiffError(
                "E0602",
                f"`{name}` uses {e.op}() in a stage whose backward runs at another "
                "width; it can't be recomputed there",
                e.span,
            )

    def recompute_one(self, name: str) -> Atom:
        """`name`'s statement emitted again, on operands got already."""
        e = self.fwd.fdef[name]
        ins = [self.primal(a) for a in e.ins]
        store = None
        if name in self.make and not self.exact and name not in self.s.made and not self.s.is_saved(name):
            store = self.fwd.storage.get(name, self.fwd.plan.activation)
        outs = self.s.recompute(e, ins, self.k, store)
        cache = self.exact_cache if self.exact else self.cache
        for o, v in zip(outs, e.outs, strict=True):
            cache[v.name] = o
        return cache[name]

    def exact_operand(self, e: Eqn) -> None:
        """Before a max/min reduction `e`'s ties are compared: an operand that another kernel could not
        compute again bit for bit is read as the forward's own f32 copy (ForwardFacts.tie_operands)."""
        x = self.fwd.tie_operands(self.k).get(e.outs[0].name)
        if x is None or x in self.exact_cache:
            return
        if self.fwd.storage.get(x, self.fwd.plan.activation) == "f32" and self.fwd.ftype[x].kind == TILE:
            self.exact_cache[x] = self.s.read_saved(x)  # the forward stores it in f32: that copy
        else:
            self.exact_cache[x] = self.s.read_exact(x, self.k)

    def tie_count(self, e: Eqn) -> Atom:
        return self.ties[e.outs[0].name]

    def tie_stage(self) -> None:
        """An elementwise stage over the forward tile space counting the elements that attain each of
        the stage's max/min reductions (over rows or columns: the count is complete only after every
        tile ran, so it can't be made in the site itself)."""
        s = self.s
        eqns = [
            e
            for e in self.st.body
            if REGISTRY[e.op].ties and e.param("group") is None and s.has_cotangent(e.outs[0].name)
        ]
        if not eqns:
            return
        caches = (self.cache, self.exact_cache)
        self.cache, self.exact_cache, self.exact = {}, {}, True
        s.open_stage(self.fshape)
        b = s.b
        for e in eqns:
            b.span = e.span
            self.exact_operand(e)
            mask = b.op("eq", self.primal(e.ins[0]), self.primal(e.outs[0]))
            over = e.param("over")
            assert isinstance(over, Dim)
            self.ties[e.outs[0].name] = b.sum_over(b.where(mask, b.lit(1.0), b.lit(0.0)), over)
        before, body = s.close_stage()
        (self.cache, self.exact_cache), self.exact = caches, False
        names = ", ".join(f"`{e.outs[0].name}`" for e in eqns)
        s.note(
            self.st.span,
            f"stage {self.k + 1} (line {self.st.span.line}): the ties of {names} are "
            "counted in an elementwise stage (a max's cotangent is split among its ties)",
        )
        s.emit([*before, _elementwise(body, self.fshape, self.st.span)])

    # ------------------------------------------------------------------ broadcasting

    def fill(self, c: Atom, like: Type) -> Atom:
        """c (a vector, scalar or group standing for a tile of type `like`) as a tile of that shape."""
        b = self.s.b
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
        raise AutodiffError(
            "E0601",
            f"autodiff can't broadcast a value to a tile of width `{width}` in a stage of width `{st.cols}`",
            b.span,
            notes=["this is a bug in coda_lang's autodiff; please report it"],
        )

    def square_like(self, like: Type) -> Atom:
        """A tile of type `like` that the site reads or computes anyway (in a square stage, where index
        vectors don't make tiles); else the forward's saved acc, if it has that shape."""
        b = self.s.b
        for e in reversed(b.out):
            for a in (*e.outs, *e.ins):
                if isinstance(a, Var) and a.name != "acc" and same_shape(b.type_of(a), like):
                    return a
        for parts in self.cts.values():
            for a, _ in parts:
                if isinstance(a, Var) and same_shape(b.type_of(a), like):
                    return a
        if like.shape == (self.fshape.rows, self.fshape.cols):
            return self.primal(Var("acc"))
        raise AutodiffError(
            "E0602", f"can't broadcast a cotangent to a {like} in a square stage", self.st.span
        )

    def group_like(self, like: Type) -> Atom:
        """A value of the grouped type `like` (zeros), to `expand` a per-group tile or vector to."""
        b = self.s.b
        assert like.group is not None
        full = Type(like.dtype, (like.shape[0], like.shape[1].scale(like.group)), TILE)
        zeros = self.fill(Lit(0.0, "f32"), full)
        return b.sum_over(zeros, full.shape[1], group=like.group)

    # ------------------------------------------------------------------ reverse pass

    def take(self, name: str) -> Part | None:
        parts = self.cts.pop(name, [])
        if not parts:
            return None
        logical = parts[0][1]
        total: Atom | None = None
        for p, t in parts:
            if not same_shape(t, logical):
                raise AutodiffError(
                    "E0602",
                    f"`{name}` is broadcast to tiles of two shapes ({logical} and {t}); "
                    "its cotangents can't be added",
                    self.fwd.fdef[name].span if name in self.fwd.fdef else self.st.span,
                )
            total = p if total is None else self.s.b.add(total, p)
        self.s.name_cotangent(total, name)
        assert total is not None
        return total, logical

    def eqn_backward(self, e: Eqn) -> None:
        b = self.s.b
        op = REGISTRY[e.op]
        taken = [self.take(v.name) if _float(v.type) else None for v in e.outs]
        if all(t is None for t in taken):
            return
        if op.vjp is None:
            if op.differentiable:
                raise AutodiffError("E0601", f"`{op.surface}` has no VJP rule", e.span)
            return
        if not any(isinstance(a, Var) and self.fwd.is_active(a.name, self.k) for a in e.ins):
            return  # no cotangent of it reaches a parameter (it depends on none but through detach)
        b.span = e.span
        cts: list[Atom | None] = [t[0] if t is not None else None for t in taken]
        if op.locality is Locality.PAIR or (
            op.locality is Locality.POINTWISE and repeated(e, self.fshape.rows, self.fshape.cols)
        ):  # pairs/interleave move columns, and a repeating vector repeats across a tile's columns (a
            # row vector's cotangent times it would have no width): they need whole tiles
            cts = [self.fill(t[0], t[1]) if t is not None else None for t in taken]
        self.exact = op.ties
        if self.exact:
            self.exact_operand(e)
        got = op.vjp(b, Primals(e, self.primal), cts if op.nout > 1 else cts[0])
        self.exact = False
        out_logical = next(t[1] for t in taken if t is not None)
        joins = op.lanes is Lanes.JOIN
        if joins:  # interleave: its operands broadcast to half its width
            rows, wide = out_logical.shape
            out_logical = Type(out_logical.dtype, (rows, wide.scale(Fraction(1, 2))), TILE)
        for a, c in zip(e.ins, got, strict=True):
            if c is None or not isinstance(a, Var) or not self.fwd.is_active(a.name, self.k):
                continue
            target = self.logical(a.name)
            # a pointwise op's (or interleave's) cotangents are of its broadcast operands; the others' of their inputs
            logical = out_logical if op.locality is Locality.POINTWISE or joins else target
            if self.in_site(a.name):
                if not _float(target):
                    continue
                self.cts.setdefault(a.name, []).append(unbroadcast.in_stage(b, c, logical, target, self.fill))
                continue
            if not self.fwd.has_gradient(a.name):
                continue
            self.outside.setdefault(a.name, []).append((c, logical))

    # ------------------------------------------------------------------ the site's outputs

    def finish(self, shape: StageShape) -> None:
        """Store dacc and the cotangents of values from outside the stage; emit the stage, then what
        completes between stages."""
        s, b, fwd, st = self.s, self.s.b, self.fwd, self.st
        later: list[tuple[str, Later]] = []
        got = self.take("acc")
        dacc_src: Atom | None = None  # the tile stored as dacc, where it is stored by a copy
        stored: Atom | None = None  # the matrix stored as dacc
        aliases: list[tuple[str, Atom]] = []
        od = fwd.operand_dtype(self.k) if st.is_gemm else None
        amax_of: tuple[Var, str, Dim] | None = None  # a quantized dacc's amax: (partial, output, rows)
        if got is not None and st.is_gemm:
            assert st.acc is not None and st.acc.type is not None
            dacc = self.fill(got[0], st.acc.type)
            bt = s.types.get(dacc.name) if isinstance(dacc, Var) else None
            if s.quantizes(self.k):
                # straight-through quantization of the cotangent (BackwardOptions.fp8_grads): stored
                # scaled and saturated in fp8, as the forward's stores; its amax, for the next step
                assert s.fp8_grads is not None
                scale, amax = s.grad_scale(self.k)
                out = b.op(
                    "copy", b.mul(dacc, scale), name=s.names.fresh(f"dacc{self.k + 1}"), annot=s.fp8_grads
                )
                stored = Var(out.name)  # (no dacc_src: a gradient equal to dacc is not this tile)
                s.qscale[out.name] = scale.name
                cols = st.acc.type.shape[1]
                amax_part = b.op("reduce_max", b.op("abs", dacc), over=cols)
                amax_of = (amax_part, amax, st.acc.type.shape[0])
            elif (
                isinstance(dacc, Var)
                and dacc.name not in b.local
                and bt is not None
                and bt.kind == MATRIX
                and bt.dtype == od
            ):
                stored = dacc  # already a matrix of the GEMM's dtype (e.g. an output's cotangent): no copy
            else:
                out = b.op("copy", dacc, name=s.names.fresh(f"dacc{self.k + 1}"), annot=od)
                stored, dacc_src = Var(out.name), dacc
            s.set_dacc(self.k, stored)
        for name, parts in self.outside.items():
            target = fwd.after_type(name)
            if target.kind != MATRIX:
                now, then = unbroadcast.outside(b, parts, target, self.fill)
                for c in now:
                    s.add_cotangent(name, c)
                later += [(name, f) for f in then]
                continue
            like = Type(target.dtype, target.shape, TILE)
            total: Atom | None = None
            for c, _ in parts:
                c = self.fill(c, like)
                total = c if total is None else b.add(total, c)
            assert total is not None
            total = s.accumulate(total, name)
            pt = fwd.params[name].var.type if name in fwd.params else None
            if (
                isinstance(total, Var)
                and total.name not in b.local
                and (pt is None or s.types[total.name].dtype == cotangent_dtype(pt.dtype))
            ):
                s.add_cotangent(name, total)  # an alias of a loaded matrix
                continue
            if (
                total == dacc_src
                and stored is not None
                and pt is not None
                and od is not None
                and cotangent_dtype(pt.dtype) == od
            ):
                aliases.append((name, stored))  # the same tile as dacc (e.g. a residual's dx)
                continue
            out = b.op(
                "copy", total, name=s.names.fresh(f"d{name}"), annot=None if name in fwd.params else "f32"
            )
            s.add_cotangent(name, Var(out.name))
        for name in sorted(self.make, key=list(fwd.fdef).index):
            if name not in s.made and not s.is_saved(name):
                self.recompute(name)  # not needed by the VJP: recomputed only to be stored
        before, body = s.close_stage()
        s.emit(before)
        if body:
            if self.host is not None:
                stage = self.host.gemm.stage(tuple(body), st.span)
                if self.host.recompute:  # the forward's operands and scales, read now that the stage is made
                    stage = stage.map_operands(s.read_operand)
                s.emit([stage])
            else:
                s.emit([_elementwise(body, shape, st.span)])
                what = ", ".join(
                    f"`{n}`"
                    for n in sorted({v.name for e in st.body for v in e.outs if v.name in fwd.storage})
                )
                s.note(
                    st.span,
                    f"stage {self.k + 1} (line {st.span.line}): no GEMM produces the cotangent "
                    f"of {what or 'its outputs'}, so its backward runs as an elementwise stage",
                )
        with s.between_stages():
            if amax_of is not None:
                amax_part, amax, rows = amax_of
                b.span = st.span
                b.op("copy", b.op("reduce_max", amax_part, over=rows), name=amax)
            for name, f in later:
                s.add_cotangent(name, f(b))
            for name, same in aliases:
                s.add_cotangent(name, b.op("copy", same, name=s.names.fresh(f"d{name}")))
