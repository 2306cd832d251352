"""Reverse-mode autodiff of a block: the schedule of the backward block.

What it does: `derive(block, plan)` walks the forward block backwards, stage by stage. The VJP of
stage k's epilogue runs in the epilogue of the GEMM that produces the cotangent of one of its stored
tiles (the dgrad GEMM of the consumer stage, `dacc_c @ B_c^T`), which is the paper's theorem: a
block-local forward gives a block-local backward. Where no GEMM produces such a cotangent (the
block's entry), or where no such GEMM's tile space holds every tile of the stage (a tile of half
the width can't be read in a GEMM of twice it), the VJP runs in one elementwise stage over the
stage's own tile space, and the derivation reports it. Here: choosing that host GEMM (`Host`), the
dgrad/wgrad GEMMs of each stage's `dacc`, and the VJPs of vector computations between stages (the
block's own, and each stage's vectors computed from vectors alone, recomputed just before its site).
site.py builds each epilogue's VJP; assemble.py sums the gradients and makes the two blocks.
What it does not: check the result (the checker does, and a failure is an autodiff bug, E0601), or
run anything.
Invariants:
- everything the schedule and the sites share is in one `State` (state.py), which the sites change
  only through its methods; site.py does not know this module;
- unbroadcasting is unbroadcast.py's: in a site from the logical type each contribution carries,
  between stages by `unbroadcast.complete` (a vector used as a scalar's broadcast is summed over it,
  a scalar cotangent standing for a vector multiplied by its length);
- the backward reads forward values as recorded in `State.reads`: as saved tensors (tiles the
  forward stores anyway, complete partials and vectors, and `acc` where a VJP needs the
  pre-epilogue value), or recomputed (between stages, in a site's epilogue, or, for the stored tiles
  policy.py chooses, by elementwise stages at the backward's start: prologue.py, built first); the
  extended forward block stores the saved ones;
- cotangent contributions to one matrix accumulate in the epilogue that produces the next one
  (residual accumulation), never as a tile computation between stages;
- every node made here carries the span of the forward line it came from.
"""

from __future__ import annotations

from coda_lang.autodiff import unbroadcast
from coda_lang.autodiff.assemble import Derived, assemble, finalize
from coda_lang.autodiff.builder import AutodiffError, Primals
from coda_lang.autodiff.builder import float_value as _float
from coda_lang.autodiff.forward import ForwardFacts
from coda_lang.autodiff.prologue import build as build_prologue
from coda_lang.autodiff.site import Host, Site
from coda_lang.autodiff.state import Gemm, State
from coda_lang.frontend.verify.plan import BlockPlan
from coda_lang.ir.nodes import DEFAULT_REMAT, REMAT, Atom, Block, Eqn, Lit, Stage, Var
from coda_lang.ir.types import (
    FP8_MAX,
    GROUP,
    MATRIX,
    PARTIAL,
    SCALAR,
    TILE,
    VEC,
    Type,
    cotangent_dtype,
    group_size,
    is_fp8,
)
from coda_lang.ops import REGISTRY, Locality, StageShape
from coda_lang.ops.registry import repeats_in


def stage_policies(block: Block, remat: str) -> list[str]:
    """Each stage's saved-tensor policy: the one written on it (`remat=` in the source), else `remat`."""
    if remat not in REMAT:
        raise ValueError(f"remat is one of {', '.join(REMAT)}, not {remat!r}")
    return [st.remat or remat for st in block.stages]


class Reverse:
    def __init__(
        self,
        block: Block,
        plan: BlockPlan,
        wrt: list[str] | None,
        remat: str = DEFAULT_REMAT,
        make: frozenset[str] = frozenset(),
        fp8_grads: str | None = None,
        prologue: frozenset[str] = frozenset(),
        fp8_acc: bool = False,
        requantize_wgrad: bool = False,
    ):
        self.policy = stage_policies(block, remat)
        self.fwd = ForwardFacts(block, plan, wrt)
        self.s = State(self.fwd)
        self.s.fp8_grads = fp8_grads
        self.s.fp8_acc = fp8_acc
        self.s.requantize_wgrad = requantize_wgrad
        # (forward stage, operand name) -> its requantized copy and scale (`requantized`), made once
        self.requant: dict[tuple[int, str], tuple[Var, Var]] = {}
        self.remat = remat
        # stored forward tiles that their stage's backward recomputes and stores (policy.py chooses)
        self.make = make
        # stored forward tiles made again by elementwise stages at the backward's start (prologue.py;
        # policy.py chooses them)
        self.prologue = prologue
        # forward stage -> weight-gradient GEMMs (consumer stage, operand, parameter) that read a tile
        # of that stage, made after its backward (which stores the tile: `make`)
        self.deferred: dict[int, list[tuple[int, str, str]]] = {}
        self.dgrad_done: set[tuple[int, str]] = set()  # (consumer stage, operand) whose dgrad GEMM is made

    def run(self) -> Derived:
        fwd, s = self.fwd, self.s
        reached = fwd.reached
        for k, st in enumerate(fwd.block.stages):
            for e in st.body:
                t = e.outs[0].type
                # (a value no cotangent reaches, one read only through detach, is recomputed as a value)
                needed = e.outs[0].name in reached and fwd.is_active(e.outs[0].name, k)
                if t is not None and t.kind == GROUP and t.group_axis == 0 and needed:
                    raise AutodiffError(
                        "E0602",
                        f"`{e.outs[0].name}` is grouped over the rows (group= of a reduction over "
                        f"`{e.param('over')}`): its backward is not derived yet",
                        e.span,
                        notes=["reductions over runs of columns (group= over the stage's columns) have one"],
                    )
        for o in fwd.block.outputs:
            if _float(fwd.ftype.get(o.name, o.type)):
                s.cotangent_param(
                    o.name,
                    Type(
                        cotangent_dtype(o.type.dtype), o.type.shape, (SCALAR, VEC, MATRIX)[len(o.type.shape)]
                    ),
                )
        stages = fwd.block.stages
        if self.prologue:
            build_prologue(s, sorted(self.prologue), self.make)
        self.block_backward(fwd.plan.between[len(stages)])
        for k in reversed(range(len(stages))):
            self.stage_backward(k)
            self.block_backward(fwd.plan.between[k])
        grads, renames = finalize(s)
        return assemble(s, grads, renames, self.remat)

    # ------------------------------------------------------------------ between stages

    def block_backward(self, eqns: tuple[Eqn, ...]) -> None:
        with self.s.between_stages():
            for e in reversed(eqns):
                self.block_eqn_backward(e)

    def block_eqn_backward(self, e: Eqn) -> None:
        s, b = self.s, self.s.b
        op = REGISTRY[e.op]
        cts = [s.sum_cotangents(v.name) if _float(v.type) else None for v in e.outs]
        if all(c is None for c in cts) or op.vjp is None:
            return
        if not any(isinstance(a, Var) and self.fwd.is_active(a.name, None) for a in e.ins):
            return  # no cotangent of it reaches a parameter
        b.span = e.span
        got = op.vjp(b, Primals(e, s.read_between), cts if op.nout > 1 else cts[0])
        for a, c in zip(e.ins, got, strict=True):
            if c is None or not isinstance(a, Var) or not self.fwd.has_gradient(a.name):
                continue
            target = self.fwd.after_type(a.name)
            # a pointwise op's cotangents are of its (broadcast) output; a reduction's of its input
            logical = (
                e.outs[0].type if op.locality is Locality.POINTWISE and e.outs[0].type is not None else target
            )
            s.add_cotangent(a.name, unbroadcast.complete(b, c, logical, target))

    # ------------------------------------------------------------------ stages

    def stage_backward(self, k: int) -> None:
        self.stage_site(k)
        for c, pos, name in self.deferred.pop(k, []):
            self.operand_grad(c, pos, name)

    def stage_site(self, k: int) -> None:
        fwd, s = self.fwd, self.s
        st = fwd.block.stages[k]
        defined = [v.name for e in st.body for v in e.outs]
        hosted = any(c in s.dacc for n in defined for c, _ in fwd.gemm_uses(n))
        if not hosted and not any(s.has_cotangent(n) for n in defined):
            return
        host = self.choose_host(k, defined)
        vectors = fwd.stage_vectors(k)
        with s.between_stages():  # the stage's vectors, recomputed before its site
            for e in st.body:
                if any(v.name in vectors for v in e.outs):
                    for v in e.outs:
                        if v.name not in s.types:
                            s.recompute_between(v.name)
        Site(s, k, host, frozenset(n for n in self.make if fwd.fstage.get(n) == k)).build()
        with s.between_stages():  # and differentiated after it
            for e in reversed(st.body):
                if any(v.name in vectors for v in e.outs):
                    self.block_eqn_backward(e)
        if st.is_gemm and k in s.dacc:
            self.weight_grads(k)

    def choose_host(self, k: int, defined: list[str]) -> Host | None:
        """The GEMM whose output is the cotangent of one of stage k's tiles; one whose tile space holds
        every tile of stage k's epilogue (of its width, or half or twice it)."""
        cands = sorted(
            {
                (0 if pos == "a" else 1, c, name, pos)
                for name in defined
                for c, pos in self.fwd.gemm_uses(name)
                if c in self.s.dacc and (c, pos) not in self.dgrad_done
            }
        )
        best = next((cand for cand in cands if self.host_fits(k, cand[2])), None)
        # every other GEMM use of stage k's tiles runs as its own GEMM, before the site, and adds in
        for _, c, name, pos in cands:
            if best is None or (c, pos) != (best[1], best[3]):
                self.dgrad_done.add((c, pos))
                self.operand_grad(c, pos, name)
        if best is None:
            return self.recompute_host(k)
        _, c, name, pos = best
        self.dgrad_done.add((c, pos))
        gemm = self.gemm_for(c, pos)
        return Host(name, gemm, self.gemm_shape(gemm))

    def recompute_host(self, k: int) -> Host | None:
        """Stage k's own GEMM run again in the backward, to host its site (no GEMM produces a cotangent of
        its tiles: the block's entry), or None (an elementwise stage over its tile space, reading what
        the forward saved). The policy: "save" and "rebuild" never recompute; "recompute" does for every GEMM stage;
        "auto" does for a stage that stores no tile in the forward (its results are reductions, as a
        loss head's are): saving would make the forward store an [rows, cols] tile (its acc) only for
        the backward, the largest tensor of an LM head, while running the GEMM again costs FLOPs but no
        memory held from forward to backward. A stage whose max/min ties are counted before its site
        keeps its acc saved for that count, so it is not recomputed."""
        st = self.fwd.block.stages[k]
        policy = self.policy[k]
        if policy in ("save", "rebuild") or not st.is_gemm or st.a is None or st.b is None:
            return None
        ties = [e for e in st.body if REGISTRY[e.op].ties and e.param("group") is None]
        if ties:
            return None
        assert isinstance(st.a, Var) and st.acc is not None and st.acc.type is not None
        rows, cols = st.acc.type.shape
        sa = self.fwd.ftype[st.a.name].shape
        flops = f"2*{rows}*{cols}*{sa[0] if st.ta else sa[1]} FLOPs"
        why = self.policy_source(k)
        if policy == "auto" and self.fwd.plan.stages[k].stores:
            self.s.note(
                st.span,
                f"stage {k + 1} (line {st.span.line}): its acc stays saved, its GEMM is not run again "
                f"({flops}): the forward stores a {rows} x {cols} tile of it anyway, so the "
                f"rerun would buy at most a constant factor of memory ({why})",
            )
            return None
        assert isinstance(st.b, Var)
        # its operands are read (saved) only if the site's stage survives: Site.finish reads them
        scale_a, scale_b = (Var(x.name) if isinstance(x, Var) else None for x in (st.scale_a, st.scale_b))
        gemm = Gemm(Var(st.a.name), Var(st.b.name), st.ta, st.tb, scale_a=scale_a, scale_b=scale_b)
        shape = StageShape(rows, cols)
        reason = (
            f"it stores no tile, so saving its acc would keep a {rows} x {cols} tensor only for the backward; "
            if policy == "auto"
            else ""
        )
        self.s.note(
            st.span,
            f"stage {k + 1} (line {st.span.line}): its GEMM runs again in the backward ({flops}), "
            f"whose epilogue runs the stage's backward from the recomputed f32 acc; {reason}nothing "
            f"of its {shape.rows} x {shape.cols} tile is kept from the forward ({why})",
            gemm=True,
        )
        return Host(None, gemm, shape, recompute=True)

    def policy_source(self, k: int) -> str:
        """Where stage k's policy comes from, as the report says it."""
        st = self.fwd.block.stages[k]
        if st.remat is not None:
            return f'remat="{st.remat}" on the stage'
        return f"--remat {self.remat}"

    def host_fits(self, k: int, tile: str) -> bool:
        """Whether the tile space of `tile` (the output of the GEMM that would host stage k's backward)
        holds every tile and column vector of stage k's epilogue."""
        rows, cols = self.fwd.ftype[tile].shape
        host = StageShape(rows, cols)
        st = self.fwd.block.stages[k]
        if st.acc is not None:
            assert st.acc.type is not None
            space: Type = st.acc.type
        else:  # an elementwise stage: its tile space
            assert st.shape is not None
            space = Type("f32", st.shape, TILE)
        frows, fcols = space.shape
        types = [space] + [
            a.type if isinstance(a, Var) and a.type is not None else Type("f32")
            for e in st.body
            for a in (*e.ins, *e.outs)
        ]
        local = [v.type for e in st.body for v in e.outs]  # a grouped value of another stage is a tile here
        for t in types:
            if t.kind in (TILE, MATRIX, GROUP) and len(t.shape) == 2:
                width = (
                    t.shape[1].scale(t.group) if t.kind == GROUP and t.group and t in local else t.shape[1]
                )
                if t.shape[0] != host.rows or width not in host.col_widths():
                    return False
            elif (
                t.kind in (VEC, PARTIAL)
                and t.shape
                and t.shape[0] != frows
                and t.shape[0] not in host.col_widths()
                and not repeats_in(t.shape[0], frows, fcols)  # a vector repeating across any width
            ):
                return False
        return True

    # ------------------------------------------------------------------ dgrad and wgrad GEMMs

    def gemm_for(self, c: int, pos: str) -> Gemm:
        """The GEMM giving the cotangent of operand `pos` of forward stage c (in that operand's stored
        layout). Of a GEMM with block scales: the other operand keeps its scale, in whichever slot it
        takes, and the acc is multiplied by this operand's own (`Gemm.out_scale`): the contraction
        runs over the other operand's blocks, and this operand's scale is constant over its groups of
        the result."""
        st = self.fwd.block.stages[c]
        dacc = self.s.dacc[c]
        assert st.a is not None and st.b is not None
        if isinstance(dacc, Var) and dacc.name in self.s.qscale:
            other = st.b if pos == "a" else st.a
            self.fp8_operand(c, other, "dgrad" if pos == "a" else "wgrad")

        def read(x: Atom | None) -> Atom | None:
            return None if x is None else self.forward_operand(x)

        if pos == "a":
            b_op, sb = self.forward_operand(st.b), read(st.scale_b)
            if not st.ta:
                return Gemm(dacc, b_op, False, not st.tb, scale_b=sb, out_scale=st.scale_a)
            return Gemm(b_op, dacc, st.tb, True, scale_a=sb, out_scale=st.scale_a)
        a_op, sa = self.forward_operand(st.a), read(st.scale_a)
        if isinstance(sa, Var) and self.s.requantize_wgrad and not st.ta:
            a_op, sa = self.requantized(c, a_op, sa)
        if not st.tb:
            return Gemm(a_op, dacc, not st.ta, False, scale_a=sa, out_scale=st.scale_b)
        return Gemm(dacc, a_op, True, st.ta, scale_b=sa, out_scale=st.scale_b)

    def requantized(self, c: int, a: Var, sa: Var) -> tuple[Var, Var]:
        """BackwardOptions.requantize_wgrad: forward stage c's operand `a` ([M, K], fp8, its scale `sa`
        [M, K/g]: 1 x g groups along K), which its weight gradient contracts over M, where `sa` changes
        every row, quantized again in g x 1 groups (DeepSeek-V3's recipe): an elementwise stage over
        [M, K] dequantizes it, takes each g x 1 group's amax, and stores the codes `ac` (a's fp8 dtype,
        at the dtype's largest value over the amax) and their scale `sc` = amax / that largest value
        ([M/g, K], a scale per g rows and column: constant over each g-deep block of the contraction).
        The gradient is then that of the requantized operand, not of the forward's codes. (a, sa) as they
        are where `sa`'s groups are not 1 x g along K."""
        s, fwd = self.s, self.fwd
        t_a, t_s = s.types.get(a.name), s.types.get(sa.name)
        if t_a is None or t_s is None or len(t_a.shape) != 2 or len(t_s.shape) != 2:
            return a, sa
        rows, cols = t_a.shape
        g_rows, g = group_size(rows, t_s.shape[0]), group_size(cols, t_s.shape[1])
        st = fwd.block.stages[c]
        dtype = fwd.stored_dtype(st.a)
        if g_rows != 1 or g is None or g == 1 or dtype not in FP8_MAX:
            return a, sa
        key = (c, a.name)
        if key not in self.requant:
            b, top = s.b, float(FP8_MAX[dtype])
            names = (s.names.fresh(f"{a.name}c"), s.names.fresh(f"{sa.name}c"))
            prev, b.span = b.span, st.span
            s.open_stage(StageShape(rows, cols), acc=False)
            v = b.mul(a, b.op("expand", sa, a))
            am = b.op("detach", b.op("reduce_max", b.op("abs", v), over=rows, group=g))
            r = b.op("maximum", am, Lit(1e-12, "f32"))
            (sc,) = b.ops("mul", r, Lit(1.0 / top, "f32"), names=(names[1],))
            (ac,) = b.ops("mul", v, b.div(Lit(top, "f32"), r), names=(names[0],), annot=dtype)
            s.made_dtype[ac.name] = dtype
            before, body = s.close_stage()
            s.emit(before)
            s.emit([Stage(None, None, False, False, None, tuple(body), (rows, cols), span=st.span)])
            b.span = prev
            s.note(
                st.span,
                f"stage {c + 1} (line {st.span.line}): its weight gradient reads `{a.name}` quantized again in "
                f"{g} x 1 groups (`{ac.name}`, scales `{sc.name}`), made by an elementwise stage from the "
                f"forward's codes and their 1 x {g} scales (requantize_wgrad)",
            )
            self.requant[key] = (Var(ac.name), Var(sc.name))
            s.requantized.append(a.name)
        return self.requant[key]

    def fp8_operand(self, c: int, other: Atom, what: str) -> None:
        """Refuse a GEMM of stage c's quantized dacc with a forward operand not stored in fp8 (E0602):
        fp8 with bf16 is a GEMM the fp8 kernels don't run, and quantizing that operand in the
        backward would be a separate pass (the forward's store is where it fuses)."""
        assert isinstance(other, Var)
        dtype = self.fwd.stored_dtype(other)
        if is_fp8(dtype):
            return
        st = self.fwd.block.stages[c]
        raise AutodiffError(
            "E0602",
            f"stage {c + 1}'s {what} GEMM would multiply its {self.s.fp8_grads} cotangent with `{other.name}`, "
            f"stored in {dtype}: fp8_grads= quantizes the cotangents of stages with an fp8 operand, and "
            "each of their backward GEMMs must have fp8 operands on both sides",
            st.span,
            notes=[
                f"store `{other.name}` in fp8 where it is made (a parameter `{other.name}: e4m3[...]`, or a "
                "tile `name: e4m3 = acc * scale` in the stage that produces it), with its scale folded "
                "into this stage's epilogue",
                "or derive this block without fp8_grads= (`coda grad` without --fp8-grads): its "
                "cotangents stay bf16",
            ],
        )

    def forward_operand(self, a: Atom) -> Var:
        return self.s.read_operand(a)

    def gemm_shape(self, g: Gemm) -> StageShape:
        sa, sb = self.s.types[g.a.name].shape, self.s.types[g.b.name].shape  # type: ignore[union-attr]
        rows = sa[1] if g.ta else sa[0]
        cols = sb[0] if g.tb else sb[1]
        return StageShape(rows, cols)

    def operand_grad(self, c: int, pos: str, name: str) -> None:
        """A dgrad/wgrad GEMM whose result is a cotangent contribution to matrix `name`."""
        s = self.s
        g = self.gemm_for(c, pos)
        st = self.fwd.block.stages[c]
        s.open_stage(self.gemm_shape(g))
        s.b.span = st.span
        total = s.accumulate(s.dequantize(g, Var("acc")), name)
        out = s.b.op(
            "copy", total, name=s.names.fresh(f"d{name}"), annot=None if name in self.fwd.params else "f32"
        )
        before, body = s.close_stage()
        s.emit(before)
        s.emit([g.stage(tuple(body), st.span)])
        s.add_cotangent(name, Var(out.name))

    def weight_grads(self, k: int) -> None:
        st = self.fwd.block.stages[k]
        for pos, operand in (("b", st.b), ("a", st.a)):
            assert isinstance(operand, Var)
            if operand.name in self.fwd.params and operand.name in self.fwd.wrt:
                other = st.a if pos == "b" else st.b
                assert isinstance(other, Var)
                if other.name in self.make and other.name not in self.s.made:
                    # the other operand is a tile its stage's backward stores: after that stage
                    self.deferred.setdefault(self.fwd.fstage[other.name], []).append((k, pos, operand.name))
                    continue
                self.operand_grad(k, pos, operand.name)
            # a forward tile as operand: its producer's site uses this stage's dacc later


def derive_with(
    block: Block,
    plan: BlockPlan,
    wrt: list[str] | None,
    remat: str,
    make: frozenset[str] = frozenset(),
    fp8_grads: str | None = None,
    prologue: frozenset[str] = frozenset(),
    fp8_acc: bool = False,
    requantize_wgrad: bool = False,
) -> Derived:
    """The backward of `block` under policy `remat` (stage reruns: Reverse.recompute_host), with the
    tiles `make` recomputed and stored by their stage's backward and the tiles `prologue` by
    elementwise stages at its start (prologue.py; policy.py chooses both), and the cotangents of its
    fp8 stages quantized to `fp8_grads` where given (`Reverse.quantizes`), with `fp8_acc` each
    stage's acc read from its fp8 copy where it stores one (`ForwardFacts.acc_copy`), and with
    `requantize_wgrad` each block-scaled weight gradient reading its operand quantized again in g x 1
    groups (`Reverse.requantized`)."""
    return Reverse(block, plan, wrt, remat, make, fp8_grads, prologue, fp8_acc, requantize_wgrad).run()
