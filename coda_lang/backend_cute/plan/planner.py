"""Stage planning: one checked GEMM stage -> the quack epilogue it becomes (`spec.StageSpec`).

What it does: reads a checked block (`coda_lang.api.Block`: typed IR + plan) and, for one stage,
decides every resource of its quack `@gemm_epilogue`: the operands it loads (a row vector is quack's
`ColVecLoad`, a column vector its `RowVecLoad`: quack names a vector by the axis it broadcasts along,
we by the axis it runs over), the tiles it stores (D: the last full-width stored tile in program
order; the others TileStores), the partial reductions it folds (a sink per reduction, chosen by the
op's combine record: ops.registry.Combine.sink), the grouped reductions complete in a tile (quack's
epilogue prepass), the epilogue mode, and the live equations the emitter turns into straight-line
code. docs/backend.md says what each mode and sink does and what is refused (E07).
What it does not: write Python (emit.py), hold the data model (spec.py) or touch quack
(quack_adapter.py); it imports nothing heavy.
Invariants: a valid program the backend can't compile yet raises `CodaError` with an E07 code at the
offending line, never anything else, and never folds a reduction some other way than its combine
record says; planning is deterministic (the emitted source is a golden file).
"""

from __future__ import annotations

import keyword
from dataclasses import replace
from fractions import Fraction
from typing import Any

from coda_lang.backend_cute.plan.names import helper_names
from coda_lang.backend_cute.plan.padding import is_zero, padding_value
from coda_lang.backend_cute.plan.spec import (
    DIM_PREFIX,
    GEMM_DTYPES,
    GROUP_COMBINES,
    INDEX_ROLES,
    LOAD_OPS,
    LOAD_ROLES,
    PACKED,
    PACKED_DTYPES,
    QUACK_RESERVED,
    SINK_COMBINES,
    STORE_DTYPES,
    Gemm,
    Group,
    Layout,
    Mode,
    Operand,
    Output,
    Sink,
    SinkOp,
    StageSpec,
    dim_operand,
    is_wide,
    lanes_of,
    member,
    plain_name,
)
from coda_lang.core.diagnostics import CodaError, Diagnostic
from coda_lang.frontend.syntax.printer import inline_source
from coda_lang.frontend.verify.repeat import repeated
from coda_lang.ir.nodes import DimRef, Eqn, Span, Stage, Var
from coda_lang.ir.types import FLOAT_DTYPES, GROUP, MATRIX, TILE, Dim, TileConstraint, Type, shape_str
from coda_lang.ops import REGISTRY, Arith, Locality


def _is_index(e: Eqn) -> bool:
    """row_index() or col_index(): a TileIndex value port of an element-mode stage."""
    return REGISTRY[e.op].locality is Locality.INDEX


def _fail(
    code: str, message: str, span: Span | None, notes: list[str] | None = None, help: list[str] | None = None
) -> CodaError:
    return CodaError([Diagnostic(code, message, span, notes=list(notes or []), help=list(help or []))])


def plan_stage(block: Any, index: int, emulated: bool = False) -> StageSpec:
    """The StageSpec of stage `index` (1-based) of a checked `coda_lang.api.Block`. `emulated`: for the
    torch stand-ins only, which also multiply f32 operands (in f32: float32 models on a CPU)."""
    ir, bplan = block.ir, block.plan
    stages = ir.stages
    if not 1 <= index <= len(stages):
        raise ValueError(f"block {ir.name} has {len(stages)} stages, no stage {index}")
    st: Stage = stages[index - 1]
    sp = bplan.stages[index - 1]
    if not st.is_gemm:
        raise _fail(
            "E0701",
            f"stage {index} (`{sp.text}`) has no GEMM; the CuTeDSL backend compiles GEMM stages only",
            st.span,
            notes=[
                "an elementwise stage is a memory-bound kernel (autodiff makes one where no GEMM "
                "produces a cotangent): a generated Triton kernel, or a torch.compile kernel where the "
                "generator can't take its ops"
            ],
        )
    return _Planner(block, index, st, sp, emulated).run()


class _Planner:
    def __init__(self, block: Any, index: int, st: Stage, sp: Any, emulated: bool = False):
        self.block, self.index, self.st, self.sp = block, index, st, sp
        self.emulated = emulated
        self.gemm_dtypes = (*GEMM_DTYPES, "f32") if emulated else GEMM_DTYPES
        self.ir, self.bplan = block.ir, block.plan
        self.rows: Dim = sp.rows
        self.cols: Dim = sp.cols
        self.types: dict[str, Type] = {}
        self.defined: dict[str, Eqn] = {}
        for e in st.body:
            for v in e.outs:
                if v.type is not None:
                    self.types[v.name] = v.type
                self.defined[v.name] = e
        self.fn_name = f"{self.ir.name}_stage{index}"
        self.names: dict[str, str] = {}
        self.used_py: set[str] = {"acc", self.fn_name, f"{self.fn_name}_prepass"}
        self.repeat: dict[Dim, Dim] = {}  # dim of repeating vectors -> the width they meet (repeats())

    # -- helpers ------------------------------------------------------------------------------

    def py(self, name: str) -> str:
        """The Python name of a coda value (renamed when it would clash with a helper or keyword)."""
        if name in self.names:
            return self.names[name]
        # (a leading underscore, as autodiff's temporaries have, is no name quack takes for an operand
        # or sink: they become fields of its argument dataclasses)
        base = (
            name
            if name == "acc"
            else (
                f"dim_{name[1:]}"
                if name.startswith(DIM_PREFIX)
                else f"v{name}"
                if name.startswith("_")
                else f"v_{name}"
                if name in helper_names() | QUACK_RESERVED or keyword.iskeyword(name) or name == self.fn_name
                else name
            )
        )
        out = base
        while out in self.used_py and name != "acc":
            out += "_"
        self.used_py.add(out)
        self.names[name] = out
        return out

    def fresh(self, base: str) -> str:
        """A Python name no value uses (for names that are not coda values: a group's writer)."""
        out = base
        while out in self.used_py or out in helper_names() | QUACK_RESERVED or keyword.iskeyword(out):
            out += "_"
        self.used_py.add(out)
        return out

    def live_out(self) -> set[str]:
        """Names of this stage read after it (later statements, stage operands, block outputs)."""
        body = self.ir.body
        pos = next(i for i, s in enumerate(body) if s is self.st)
        names: set[str] = {o.name for o in self.ir.outputs}
        for s in body[pos + 1 :]:
            if isinstance(s, Stage):
                for a in (s.a, s.b):
                    if isinstance(a, Var):
                        names.add(a.name)
                eqns: tuple[Eqn, ...] = s.body
            else:
                eqns = (s,)
            for e in eqns:
                names |= {a.name for a in e.ins if isinstance(a, Var)}
        return names

    def storage_dtype(self, name: str, fallback: str) -> str:
        return self.bplan.storage.get(name, fallback)

    def param_dtype(self, a: Any) -> str:
        assert isinstance(a, Var)
        for p in self.ir.params:
            if p.var.name == a.name and p.var.type is not None:
                return p.var.type.dtype
        return self.storage_dtype(a.name, a.type.dtype if a.type else "f32")

    # -- the plan -----------------------------------------------------------------------------

    def run(self) -> StageSpec:
        st, sp = self.st, self.sp
        gemm = self.gemm()
        live_out = self.live_out()
        wide = [n for n, t in self.types.items() if is_wide(t, self.cols)]
        wide += [ld.name for ld in sp.loads if ld.role == "tile" and ld.shape[-1] == self.cols.scale(2)]
        if wide:
            self.check_packed(wide)
        paired = not wide and (
            any(REGISTRY[e.op].locality is Locality.PAIR for e in st.body)
            or any(
                t.kind == TILE and len(t.shape) == 2 and t.shape[1] != self.cols for t in self.types.values()
            )
        )
        mode: Mode = PACKED if wide else "acc_pair" if paired else "element"
        packed = mode == PACKED

        full = [s for s in sp.stores if s.shape[1] == (self.cols.scale(2) if packed else self.cols)]
        d_store = full[-1] if full else None
        outputs: list[Output] = []
        d: Output | None = None
        for store in sp.stores:
            e = self.defined[store.name]
            if store.dtype not in STORE_DTYPES:
                raise _fail(
                    "E0702",
                    f"stored tile `{store.name}` has dtype {store.dtype}; the epilogue stores "
                    "f32, bf16 or f16",
                    e.span,
                )
            if d_store is not None and store.name == d_store.name:
                d = Output(
                    name=store.name, py=self.py(store.name), dtype=store.dtype, shape=store.shape, op="D"
                )
                continue
            if store.shape[1] not in (self.cols, self.cols.scale(Fraction(1, 2))):
                raise _fail(
                    "E0704",
                    f"`{store.name}` is stored at width `{store.shape[1]}` in a stage of width `{self.cols}`",
                    e.span,
                    notes=[
                        "quack stores tiles at the GEMM's width, half of it "
                        "after pairs(), or twice it as D in packed mode"
                    ],
                )
            gated = paired and store.shape[1] != self.cols
            split = paired and store.shape[1] == self.cols  # a second full-width tile: one store per lane
            if (gated or split) and store.dtype == "f32" and not self.emulated:
                what = "half-width" if gated else "full-width (stored as two half-width lanes)"
                raise _fail(
                    "E0702",
                    f"{what} stored tile `{store.name}` is f32; quack stores paired outputs as 16-bit values",
                    e.span,
                    help=[f"annotate it, e.g. `{store.name}: bf16 = ...`"],
                )
            if split:
                py = self.py(store.name)
                for lane in (0, 1):
                    outputs.append(
                        Output(
                            name=store.name,
                            py=f"{py}_lane{lane}",
                            dtype=store.dtype,
                            shape=store.shape,
                            op="TileStore",
                            gated=True,
                            lane=lane,
                        )
                    )
                continue
            outputs.append(
                Output(
                    name=store.name,
                    py=self.py(store.name),
                    dtype=store.dtype,
                    shape=store.shape,
                    op="TileStore",
                    gated=gated,
                )
            )

        sinks = self.sinks(live_out, paired, packed)
        needed = {o.name for o in outputs} | ({d.name} if d else set())
        for s in sinks:
            needed |= set(s.value)
        stored_groups = self.stored_groups(live_out)
        eqns = self.live_eqns(needed)
        indices = self.index_operands(eqns, mode)
        for e in eqns:
            if not (indices and _is_index(e)):
                self.check_eqn(e)
        groups, prepass = self.groups(eqns, stored_groups, packed)
        for e in prepass:
            if not (indices and _is_index(e)):
                self.check_eqn(e)
        if indices:  # index values are operands (value ports), not equations of the fn
            eqns = [e for e in eqns if not _is_index(e)]
            prepass = [e for e in prepass if not _is_index(e)]
        repeats = self.repeats(eqns + prepass)
        operands = self.operands(
            eqns,
            [n for s in sinks for n in s.value]
            + [a.name for e in prepass for a in e.ins if isinstance(a, Var)]
            + [g.value for g in groups],
            paired,
            packed,
        )
        operands += indices
        if packed:
            c = next((o for o in operands if o.op == "C"), None)
            if d is None or c is None:
                missing = "stores no double-width tile (D)" if d is None else "loads no double-width tile (C)"
                raise _fail(
                    "E0704",
                    f"stage {self.index} works on a tile twice its width but {missing}",
                    st.span,
                    notes=[
                        "quack's packed_cd_b16x2 mode loads one 16-bit double-width tile as the GEMM's C "
                        "operand and stores one as D, two lanes per accumulator element"
                    ],
                )
            if c.dtype != d.dtype and not self.emulated:
                raise _fail(
                    "E0702",
                    f"the double-width tile `{c.name}` is {c.dtype} and the stored `{d.name}` is "
                    f"{d.dtype}; quack's packed mode needs one 16-bit dtype for both",
                    self.defined[d.name].span,
                    help=[f"annotate it: `{d.name}: {c.dtype} = ...`"],
                )
        tiling = list(sp.tiling)  # the checker's: tile_N holds whole groups
        for w in sorted({g.width for g in groups}):
            # quack's grouped statistics (GroupedColStatsBase) fold one statistic slot per thread and
            # epilogue subtile: a group narrower than the subtile would be folded together with its
            # neighbours (the emulated kernels fold each group exactly, at any subtile)
            tiling.append(
                TileConstraint(
                    of="the epilogue subtile's N",
                    divides=w,
                    reason="gcd(32, tile_N), or epi_n; compile.fits",
                    kernel_only=True,
                )
            )
        if paired:
            tiling.append(TileConstraint(of="tile_N", multiple_of=2, reason="pairs of adjacent columns"))
            if outputs:
                tiling.append(TileConstraint(of="tile_N", multiple_of=32, reason="paired TileStore on SM90"))
        spec = StageSpec(
            block=self.ir.name,
            index=self.index,
            text=sp.text,
            line=sp.line,
            fn_name=self.fn_name,
            mode=mode,
            gemm=gemm,
            operands=tuple(operands),
            d=d,
            outputs=tuple(outputs),
            sinks=tuple(sinks),
            eqns=tuple(eqns),
            names=dict(self.names),
            tiling=tuple(tiling),
            source=tuple(inline_source(st.body)),
            span=st.span,
            groups=tuple(groups),
            prepass=tuple(prepass),
            repeats=tuple(repeats.items()),
        )
        # a bare GEMM is one shared kernel per dtype and majors (emit.py writes it without the stage's names)
        return replace(spec, fn_name=plain_name(gemm)) if spec.plain else spec

    def check_packed(self, wide: list[str]) -> None:
        """A stage with double-width values compiles in packed mode: no half-width values beside them."""
        half = self.cols.scale(Fraction(1, 2))
        for name, t in self.types.items():
            if t.kind == TILE and len(t.shape) == 2 and t.shape[1] == half:
                raise _fail(
                    "E0704",
                    f"`{name}` is half the stage's width while `{wide[0]}` is twice it",
                    self.defined[name].span,
                    notes=[
                        "a stage compiles either paired (half-width values, acc_pair mode) or packed "
                        "(double-width values, packed_cd_b16x2 mode), not both"
                    ],
                )

    def gemm(self) -> Gemm:
        st, sp = self.st, self.sp
        assert isinstance(st.a, Var) and isinstance(st.b, Var)
        a_dtype, b_dtype = self.param_dtype(st.a), self.param_dtype(st.b)
        for name, dt, span in ((st.a.name, a_dtype, st.a_span), (st.b.name, b_dtype, st.b_span)):
            if dt not in self.gemm_dtypes:
                raise _fail(
                    "E0702",
                    f"GEMM operand `{name}` is {dt}; the backend multiplies bf16 or f16 operands",
                    span,
                    help=[
                        f"declare `{name}` as bf16 (or, for a stored tile, annotate it: `{name}: bf16 = ...`)"
                    ],
                )
        if a_dtype != b_dtype:
            raise _fail(
                "E0702", f"GEMM operands are {a_dtype} and {b_dtype}; the backend needs equal dtypes", st.span
            )
        return Gemm(
            a=st.a.name,
            b=st.b.name,
            a_dtype=a_dtype,
            b_dtype=b_dtype,
            ta=st.ta,
            tb=st.tb,
            rows=sp.rows,
            cols=sp.cols,
            k=sp.k,
        )

    def check_eqn(self, e: Eqn) -> None:
        """Can the emitter write this (live, non-reducing) equation?"""
        od = REGISTRY[e.op]
        for a in e.ins:
            if isinstance(a, DimRef) and a.dim.name is None:  # (the checker folds constant extents)
                raise _fail("E0703", f"the extent `{a.dim}` is used as a value inside a stage", e.span)
        if od.lower.cute is None and not (
            self.emulated and (od.lower.torch is not None or od.locality is Locality.INDEX)
        ):
            raise _fail("E0703", f"`{od.surface}` has no CuTeDSL emitter yet", e.span)
        for v in e.outs:
            t = v.type
            if t is None:
                continue
            if t.dtype == "i32" and not self.emulated:
                raise _fail(
                    "E0702",
                    f"`{v.name}` is i32: integer arithmetic inside an epilogue is not supported yet",
                    e.span,
                )

    def sinks(self, live_out: set[str], paired: bool, packed: bool) -> list[Sink]:
        """The partial reductions read after the stage, as quack sinks. A sum of a product used
        nowhere else is folded as one fma of the two factors (`scaled`), as quack's rms epilogues do.
        In packed mode a row reduction of a double-width value folds its two lanes first."""
        sinks: list[Sink] = []
        uses: dict[str, int] = {}
        for e in self.st.body:
            for a in e.ins:
                if isinstance(a, Var):
                    uses[a.name] = uses.get(a.name, 0) + 1
        index_uses: dict[str, int] = {}
        for e in self.st.body:
            od = REGISTRY[e.op]
            if not od.reduces:
                continue
            (v,) = e.outs
            t = v.type
            if v.name not in live_out or t is None:
                continue
            x = e.ins[0]
            if not isinstance(x, Var):
                raise _fail("E0705", f"`{od.surface}()` of a constant", e.span)
            xt = x.type if x.type is not None else self.types.get(x.name)
            if e.param("group") is not None:
                continue  # complete in its tile: a Group (groups()), not a partial
            if xt is not None and xt.kind == GROUP:
                raise _fail(
                    "E0705",
                    f"`{od.surface}()` of the grouped value `{x.name}` over its groups is not compiled yet",
                    e.span,
                    notes=[
                        "quack's grouped statistics stay inside the kernel; "
                        "reduce the tile the groups came from instead"
                    ],
                )
            per_row = bool(t.shape) and t.shape[0] == self.rows  # one value per row: reduced over the columns
            half = paired and xt is not None and lanes_of(xt, self.rows, self.cols) == 1
            wide = packed and is_wide(xt, self.cols)
            py = self.py(v.name)
            rec = od.combine
            assert rec is not None  # a reduction without a combine record does not check
            if rec.sink is None:
                raise _fail(
                    "E0705",
                    f"`{od.surface}()` has no epilogue sink (its combine record names none)",
                    e.span,
                    notes=[
                        "quack's epilogue reductions fold by add or max, and log-sum-exp along the columns"
                    ],
                )
            if wide and (rec.sink not in ("add", "max") or not per_row):
                what = f"{od.surface}() over the rows" if not per_row else f"{od.surface}()"
                raise _fail(
                    "E0705",
                    f"{what} of the double-width tile `{x.name}` is not compiled yet",
                    e.span,
                    notes=[
                        "in packed mode a double-width value is two lanes per accumulator element; "
                        "sum(), max() and min() over its columns fold the lanes first"
                    ],
                )
            if od.locality is Locality.GATHER:  # quack's ColVecSelect
                idx = e.ins[1]
                if not per_row or not isinstance(idx, Var):
                    raise _fail("E0705", "pick() with one index per column is not compiled yet", e.span)
                if paired:
                    raise _fail("E0705", "pick() in a paired stage is not compiled yet", e.span)
                index_uses[idx.name] = index_uses.get(idx.name, 0) + 1
                ld = next(ld for ld in self.sp.loads if ld.name == idx.name)
                sinks.append(
                    Sink(
                        name=v.name,
                        py=py,
                        op="ColVecSelect",
                        combine=None,
                        value=(x.name,),
                        shape=t.shape,
                        layout="vector",
                        index=self.py(idx.name),
                        index_dtype=ld.dtype,
                    )
                )
                continue
            if rec.sink == "lse":
                if paired:
                    raise _fail("E0705", "logsumexp() in a paired stage is not compiled yet", e.span)
                if not per_row:  # quack's online log-sum-exp folds along the columns only
                    raise _fail(
                        "E0705",
                        "logsumexp() over the rows is not compiled yet",
                        e.span,
                        notes=[
                            "quack's OnlineLSEReduce folds a row's columns; a column's rows would "
                            "need an online (max, sum) pair carried through RowVecReduce's exchange"
                        ],
                    )
                sinks.append(
                    Sink(
                        name=v.name,
                        py=py,
                        op="OnlineLSEReduce",
                        combine=None,
                        value=(x.name,),
                        shape=t.shape,
                        layout="row partials",
                    )
                )
                continue
            combine = member(rec.sink, SINK_COMBINES)  # "add" | "max"
            negate = rec.negate  # min(x) = -max(-x): quack folds the negation by max (exact)
            if not per_row and half:
                raise _fail(
                    "E0705",
                    f"a reduction over the rows of the half-width tile `{x.name}` is not compiled yet",
                    e.span,
                )
            op: SinkOp = "ColVecReduce" if per_row else "RowVecReduce"
            layout: Layout = "row partials" if per_row else "column partials"
            prod = self.defined.get(x.name)
            # quack masks the ragged end of the reduced dim for max (and min, its negation) itself; a
            # sum over the columns is masked there unless its value is 0 there whatever the inputs (the
            # accumulator is NaN there in a row of A, an activation, holding an infinity); a sum over the
            # rows unless it is 0 there for finite inputs (it is NaN only for an infinity in a column of
            # B, a weight as a rule, and its mask would cost the norm backwards their widest tile)
            bounded = combine == "add" and not is_zero(
                self.padding_value(x.name, per_row, finite=not per_row)
            )
            # one that is 0 there for finite inputs is masked in the ragged last tile only (Sink.ragged_only),
            # and, a sum of a product, folded as one fma of both factors (both masked); one that is not is
            # masked in every tile and folded plain, as before
            zero_if_finite = combine == "add" and is_zero(self.padding_value(x.name, per_row))
            if wide:
                sinks.append(
                    Sink(
                        name=v.name,
                        py=py,
                        op=op,
                        combine=combine,
                        value=(x.name,),
                        shape=t.shape,
                        layout=layout,
                        lanes=2,
                        negate=negate,
                        bounded=bounded,
                        ragged_only=bounded and zero_if_finite,
                    )
                )
                continue
            if (
                rec.name == "sum"
                and not paired
                and zero_if_finite
                and prod is not None
                and REGISTRY[prod.op].arith is Arith.PRODUCT
                and uses.get(x.name) == 1
                and x.name not in live_out
                and all(isinstance(a, Var) for a in prod.ins)
            ):
                ins = tuple(a.name for a in prod.ins if isinstance(a, Var))
                sinks.append(
                    Sink(
                        name=v.name,
                        py=py,
                        op=op,
                        combine=combine,
                        scaled=True,
                        value=ins,
                        shape=t.shape,
                        layout=layout,
                        bounded=bounded,
                        ragged_only=bounded,
                    )
                )
                continue
            # max(abs(x)) is folded as a max of the value abs(x), not by quack's max.xorsign.abs (its amax
            # epilogue): that instruction dropped a NaN on the H100 even with .NaN (an amax of a row
            # holding NaN came out inf; coda fuzz --target cuda --special on amax_fp8)
            sinks.append(
                Sink(
                    name=v.name,
                    py=py,
                    op=op,
                    combine=combine,
                    value=(x.name,),
                    shape=t.shape,
                    layout=layout,
                    pad="0.0" if combine == "add" else "self",
                    negate=negate,
                    bounded=bounded,
                    ragged_only=bounded and zero_if_finite,
                )
            )
        for n, k in index_uses.items():
            if uses.get(n, 0) != k:
                e = next(e for e in self.st.body if any(isinstance(a, Var) and a.name == n for a in e.ins))
                raise _fail(
                    "E0705",
                    f"the pick() index `{n}` is also used as a value",
                    e.span,
                    notes=["quack's ColVecSelect reads its index itself; the epilogue can't also see it"],
                )
        return sinks

    def padding_value(self, name: str, per_row: bool, finite: bool = True) -> Any:
        """What `name` holds past the end of the reduced dim in the ragged last tile (padding.py)."""
        return padding_value(
            name, per_row, {ld.name: ld for ld in self.sp.loads}, self.defined, finite=finite
        )

    def grouped(self) -> dict[str, Eqn]:
        """The stage's grouped reductions by result name."""
        return {
            e.outs[0].name: e
            for e in self.st.body
            if REGISTRY[e.op].locality is Locality.REDUCE and e.param("group") is not None
        }

    def stored_groups(self, live_out: set[str]) -> set[str]:
        """The grouped reductions used after the stage (their writers store them); any other grouped
        value used after it is E0705."""
        grouped = self.grouped()
        out = set()
        for e in self.st.body:
            for v in e.outs:
                if v.type is None or v.type.kind != GROUP or v.name not in live_out:
                    continue
                if v.name not in grouped:
                    raise _fail(
                        "E0705",
                        f"`{v.name}`, computed from a grouped reduction, is used after the stage: "
                        "not compiled yet",
                        e.span,
                        notes=[
                            "the kernel can store a grouped reduction itself (one value per row and "
                            "group), not values computed from it"
                        ],
                        help=["use the grouped reduction after the stage, or recompute from it there"],
                    )
                out.add(v.name)
        return out

    def groups(self, eqns: list[Eqn], stored: set[str], packed: bool) -> tuple[list[Group], list[Eqn]]:
        """The grouped reductions the main fn reads (or the stage stores), and the prepass equations
        that compute what they reduce, in program order."""
        grouped = self.grouped()
        used = {a.name for e in eqns for a in e.ins if isinstance(a, Var)} | stored
        groups: list[Group] = []
        keep: set[int] = set()
        for name, e in grouped.items():
            if name not in used:
                continue
            od = REGISTRY[e.op]
            (v,) = e.outs
            x = e.ins[0]
            if packed:
                raise _fail(
                    "E0705",
                    "a grouped reduction in a stage that works on double-width tiles (packed mode) "
                    "is not compiled yet",
                    e.span,
                    notes=['quack: "prepass + packed C: not supported"'],
                )
            if not isinstance(x, Var):
                raise _fail("E0705", f"grouped `{od.surface}()` of a constant", e.span)
            xt = x.type if x.type is not None else self.types.get(x.name)
            if xt is None or xt.kind not in (TILE, MATRIX) or len(xt.shape) != 2 or xt.shape[1] != self.cols:
                raise _fail(
                    "E0705",
                    f"a grouped reduction of `{x.name}`, which is not a tile as wide as the stage's "
                    f"({shape_str((self.rows, self.cols))}), is not compiled yet",
                    e.span,
                    notes=["quack's prepass sees the accumulator one element at a time, not in pairs"],
                )
            group = e.param("group")
            assert isinstance(group, int)
            if group % 32 and group not in (8, 16):
                raise _fail(
                    "E0705",
                    f"grouped reduction over groups of {group} columns: not compiled",
                    e.span,
                    notes=[
                        "quack's grouped statistics fold each thread's runs of 8 adjacent accumulator "
                        "columns, and the groups must nest with the epilogue's subtiles of 32 columns "
                        "(SM90): groups of 8, 16 or a multiple of 32 compile"
                    ],
                )
            prepass = self.live_eqns({x.name})
            tiles = {ld.name for ld in self.sp.loads if ld.role == "tile"}
            for p in prepass + [e]:
                for a in p.ins:
                    if isinstance(a, Var) and a.name in tiles:
                        raise _fail(
                            "E0705",
                            f"the grouped reduction `{v.name}` reduces a value that reads the tile "
                            f"`{a.name}`: not compiled yet",
                            e.span,
                            notes=[
                                "quack's prepass runs over the accumulator before the epilogue's tile "
                                "loads arrive; it can read acc, vectors and scalars"
                            ],
                        )
                    if isinstance(a, Var) and a.name in grouped:
                        raise _fail(
                            "E0705",
                            f"the grouped reduction `{v.name}` reduces a value computed from the "
                            f"grouped reduction `{a.name}` of the same stage: not compiled yet",
                            e.span,
                            notes=[
                                "the epilogue has one prepass over the accumulator; this would need a "
                                "second one"
                            ],
                        )
                if REGISTRY[p.op].locality is Locality.PAIR:
                    raise _fail(
                        "E0705",
                        f"the grouped reduction `{v.name}` reduces a value computed with "
                        f"`{REGISTRY[p.op].surface}()`: not compiled yet",
                        e.span,
                        notes=["quack's prepass sees the accumulator one element at a time, not in pairs"],
                    )
            keep |= {id(p) for p in prepass}
            py = self.py(v.name)
            out = self.fresh(f"{py}_out") if name in stored else None
            if od.combine is None or od.combine.group is None:
                raise _fail(
                    "E0705", f"grouped `{od.surface}()` has no fold in the epilogue's prepass", e.span
                )
            groups.append(
                Group(
                    name=v.name,
                    py=py,
                    combine=member(od.combine.group, GROUP_COMBINES),
                    width=group,
                    value=x.name,
                    shape=v.type.shape if v.type else (),
                    out=out,
                )
            )
        return groups, [e for e in self.st.body if id(e) in keep]

    def live_eqns(self, needed: set[str]) -> list[Eqn]:
        """The equations the stored tiles and sinks depend on, in order (reductions are sinks)."""
        want = set(needed)
        keep: list[Eqn] = []
        for e in reversed(self.st.body):
            if REGISTRY[e.op].reduces or not {v.name for v in e.outs} & want:
                continue
            keep.append(e)
            want |= {a.name for a in e.ins if isinstance(a, Var)}
        return keep[::-1]

    def index_operands(self, eqns: list[Eqn], mode: Mode) -> list[Operand]:
        """`row_index()` / `col_index()` of an element-mode stage as TileIndex value ports (nothing is
        loaded: the kernel takes each element's index from its coordinates). In a paired or packed
        stage they have no emitter (E0703); the emulator computes them there as equations."""
        found = [e for e in eqns if _is_index(e)]
        if not found:
            return []
        if mode != "element":
            if self.emulated:
                return []
            e = found[0]
            raise _fail(
                "E0703",
                f"`{e.op}()` in a stage of mode {mode} has no CuTeDSL emitter yet",
                e.span,
                notes=[
                    "the kernel gives row_index()/col_index() to element-mode stages (no pairs(), "
                    "no double-width tiles)"
                ],
            )
        out: list[Operand] = []
        for e in found:
            (v,) = e.outs
            if any(o.name == v.name for o in out):
                continue
            shape = v.type.shape if v.type is not None else ()
            axis = REGISTRY[e.op].index_axis
            assert axis is not None
            out.append(
                Operand(
                    name=v.name,
                    py=self.py(v.name),
                    role=INDEX_ROLES[axis],
                    op="TileIndex",
                    dtype="i32",
                    shape=shape,
                    lanes=1,
                )
            )
        return out

    def repeats(self, eqns: list[Eqn]) -> dict[Dim, Dim]:
        """The width W each dim G of repeating vectors meets in the stage (docs/language.md, "Vectors
        that repeat"): such a vector is passed repeated to W columns (`Operand.period`), so that the
        kernel reads it as a column vector of that width, and what the stage computes from it is a
        column vector of that width too. One width per dim: E0704 for two."""
        out: dict[Dim, Dim] = {}
        for e in eqns:
            for i, g, w in repeated(e, self.rows, self.cols):
                if out.setdefault(g, w) != w:
                    a = e.ins[i]
                    raise _fail(
                        "E0704",
                        f"`{getattr(a, 'name', a)}` repeats across `{w}` columns here and across "
                        f"`{out[g]}` columns elsewhere in the stage",
                        e.span,
                        notes=[
                            "the kernel reads a vector over a fixed dim repeated to one width per stage "
                            "(the runtime repeats it before the launch)"
                        ],
                    )
        self.repeat = out
        return out

    def int_compared_only(self, name: str, eqns: list[Eqn]) -> bool:
        """Is every use of `name` in the stage's live equations a comparison? (An i32 vector is
        loaded as f32 by quack's vector loads: comparing it with another integer there is exact below
        2**24, arithmetic on it is not.)"""
        uses = [e for e in eqns if any(isinstance(a, Var) and a.name == name for a in e.ins)]
        return bool(uses) and all(REGISTRY[e.op].compares for e in uses)

    def operands(self, eqns: list[Eqn], sink_values: list[str], paired: bool, packed: bool) -> list[Operand]:
        """The loads the emitted code reads, in order of first use (packed mode: the double-width tile
        is the GEMM's C operand, `c` in the emitted fn)."""
        loads = {ld.name: ld for ld in self.sp.loads}
        used: list[str] = []
        for name in [a.name for e in eqns for a in e.ins if isinstance(a, Var)] + sink_values:
            if name in loads and name not in used:
                used.append(name)
        out: list[Operand] = []
        for name in used:
            ld = loads[name]
            role = member(ld.role, LOAD_ROLES)
            e = next(e for e in self.st.body if any(isinstance(a, Var) and a.name == name for a in e.ins))
            compared = (
                ld.dtype == "i32"
                and ld.role in ("row vector", "column vector")
                and name not in sink_values
                and self.int_compared_only(name, eqns)
            )
            if ld.dtype not in FLOAT_DTYPES and not self.emulated and not compared:
                raise _fail(
                    "E0702",
                    f"`{name}` is {ld.dtype}: integer operands of the epilogue are not supported yet",
                    e.span,
                    notes=["an i32 row or column vector that is only compared (==, <, ...) is supported"],
                )
            width = ld.shape[-1] if ld.role in ("tile", "column vector") else None
            period: Dim | None = None
            shape = ld.shape
            if ld.role == "column vector" and width in self.repeat:  # passed repeated to its width
                period, width = ld.shape[-1], self.repeat[ld.shape[-1]]
                shape = (width,)
            if packed and ld.role == "tile" and width == self.cols.scale(2):
                if any(o.op == "C" for o in out):
                    raise _fail(
                        "E0704",
                        f"`{name}` is a second double-width tile load",
                        e.span,
                        notes=["quack's packed_cd_b16x2 mode loads one double-width tile (the GEMM's C)"],
                    )
                if ld.dtype not in PACKED_DTYPES and not self.emulated:
                    raise _fail(
                        "E0702",
                        f"the double-width tile `{name}` is {ld.dtype}; quack's packed mode loads "
                        "16-bit pairs",
                        e.span,
                    )
                out.append(
                    Operand(name=name, py="c", role=role, op="C", dtype=ld.dtype, shape=ld.shape, lanes=2)
                )
                continue
            if paired and ld.role == "column vector" and width == self.cols.scale(Fraction(1, 2)):
                out.append(
                    Operand(
                        name=name,
                        py=self.py(name),
                        role=role,
                        op=LOAD_OPS[role],
                        dtype=ld.dtype,
                        shape=shape,
                        lanes=2,
                        host="repeat_interleave(2)",
                        period=period,
                    )
                )
                continue
            if width is not None and width != self.cols:
                shown = f"{ld.dtype}{shape_str(ld.shape)}"
                if period is not None:
                    shown += f", repeated to `{width}` columns"
                raise _fail(
                    "E0704",
                    f"`{name}` ({shown}) is not as wide as the stage's tile "
                    f"({shape_str((self.rows, self.cols))})",
                    e.span,
                    notes=[
                        "quack loads tiles at the GEMM's width (column vectors too, except one value "
                        "per column pair in a paired stage); other widths are not supported yet"
                    ],
                )
            lanes = 2 if paired and width is not None else 1
            out.append(
                Operand(
                    name=name,
                    py=self.py(name),
                    role=role,
                    op=LOAD_OPS[role],
                    dtype=ld.dtype,
                    shape=shape,
                    lanes=lanes,
                    period=period,
                )
            )
        # a dim used as a value (`acc / K`): a Scalar operand holding its size, passed by the runtime
        for dim in dict.fromkeys(
            a.dim.name for e in eqns for a in e.ins if isinstance(a, DimRef) and a.dim.name
        ):
            name = dim_operand(dim)
            out.append(
                Operand(
                    name=name,
                    py=self.py(name),
                    role="scalar",
                    op=LOAD_OPS["scalar"],
                    dtype="f32",
                    shape=(),
                    lanes=1,
                )
            )
        return out
