"""Stage planning: one checked GEMM stage -> the quack epilogue it becomes (`StageSpec`).

What it does: reads a checked block (`coda_lang.api.Block`: typed IR + plan) and, for one stage,
decides every resource of its quack `@gemm_epilogue`: the operands it loads (row vector ->
`ColVecLoad`, column vector -> `RowVecLoad`, tile -> `TileLoad`, scalar -> `Scalar`; quack names a
vector by the axis it broadcasts along, we by the axis it runs over), the tiles it stores (the main
one is quack's "D", the others `TileStore`s), the partial reductions it folds (`ColVecReduce` per-row
partials, `RowVecReduce` per-column partials, `OnlineLSEReduce` for logsumexp over the columns,
`ColVecSelect` for `pick`), the grouped
reductions complete in a tile (`Group`: quack's epilogue prepass, below), the epilogue mode ("element"; "acc_pair" when the stage splits its full-width tile with `pairs`;
"packed_cd_b16x2" when it works on a tile twice its width, as a SwiGLU backward does: the 16-bit
double-width tile it loads is quack's GEMM C operand and the one it stores is D, both two lanes per
accumulator element), and the live equations the emitter turns into straight-line code.
What it does not: write Python (emit.py) or touch quack (quack_adapter.py); it imports nothing heavy.
Invariants: a valid program the backend can't compile yet raises `CodaError` with an E07 code at the
offending line, never anything else; planning is deterministic (the emitted source is a golden file).

min(): quack's VecReduces fold by add, max or max_abs, so a min is folded as the max of the negated
value (`Sink.negate`: the fn returns `-x`, combine="max"); the kernel's buffer holds -min per tile and
the runtime negates it back (runtime.sink_partials). Exact, infinities included; NaN behaves as in a
max sink (PTX max.f32 returns the other operand).

Choice of D: the last full-width stored tile in program order (llama_mlp stage 1: `hg`, as in quack's
`rms_partial_epi`). In "acc_pair" mode only a full-width tile can be D and half-width tiles are gated
`TileStore`s (16-bit, as quack requires). In "packed_cd_b16x2" mode D is the double-width tile and
full-width tiles are `TileStore`s.

Grouped reductions (`sum(x, over=N, group=g)`, qk-norm's per-head sum of squares) map onto quack's
epilogue PREPASS: a second fn (`StageSpec.prepass`: the equations that compute each reduced value
from `acc` and the operands, per element, duplicated where the main fn needs them too) runs over the
raw accumulator before any store and feeds one `GroupedReduce` op per reduction (epi_ops.py, a
`GroupedColStatsBase` like quack's `HeadRstd`), which folds it per (row, run of g columns) inside the
tile and hands the main fn the raw fold of each element's group as a value (`ss` below); what the
stage computes from it (`rsqrt(ss / 128 + eps)`) is ordinary per-element code. The tile must hold
whole groups (the checker's constraint `tile_N % g == 0`, which quack also validates). A grouped
reduction used after the stage is written by the op's companion `GroupedColStatsOut` (one f32 value
per row and group). A grouped sum, max, min or logsumexp folds by add, max, min (from +inf) or the
log-sum-exp of two values (from -inf): quack's grouped statistics fold by add or max, GroupedReduce
adds the other two. Not compiled (E0705): a grouped reduction of a value that depends on another one
of the same stage (that would need a second prepass), of a value that reads a loaded tile (the
prepass runs before the epilogue's tile loads arrive), of a half-width value (the prepass sees single
elements, not pairs), in packed mode (quack: "prepass + packed C: not supported"), over groups other
than 8, 16 or a multiple of 32 columns (quack folds runs of 8 columns per thread, in subtiles of 32
columns), and a value computed from a grouped reduction used after the stage.
"""

from __future__ import annotations

import keyword
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from coda_lang.backend_cute.names import helper_names
from coda_lang.ir.nodes import DimRef, Eqn, Lit, Span, Stage, Var
from coda_lang.ir.printer import inline_source
from coda_lang.ir.types import FLOAT_DTYPES, GROUP, MATRIX, TILE, VEC, Dim, Shape, Type, shape_str
from coda_lang.ops import REGISTRY
from coda_lang.verify.diagnostics import CodaError, Diagnostic

# A value whose name the emitted module imports (names.helper_names()), or that quack reserves (`c` is
# the GEMM's C operand, `D` its output), is renamed `v_<name>` in the emitted function; the epi_args
# key is the renamed one.
QUACK_RESERVED = frozenset({"acc", "c", "D"})

# Quack op for each load role of verify/plan.py.
LOAD_OPS = {"tile": "TileLoad", "row vector": "ColVecLoad", "column vector": "RowVecLoad", "scalar": "Scalar"}

STORE_DTYPES = FLOAT_DTYPES  # what a TileStore / D can hold
GEMM_DTYPES = ("bf16", "f16")  # operand dtypes of quack's SM90 WGMMA path used here


# A dim used as a value inside a stage is a scalar operand named DIM_PREFIX + the dim's name (no coda
# name starts with it); the runtime binds each dim's size under that name (CudaBlock.values shows them)
DIM_PREFIX = "%"


REAL = object()  # padding_value: a value made of real inputs, not known when planning


def _is_zero(v: Any) -> bool:
    return v is not REAL and v is not None and v == 0.0


def dim_operand(dim: str) -> str:
    """The operand name of dim `dim`'s size."""
    return DIM_PREFIX + dim


@dataclass(frozen=True)
class Operand:
    """A value the epilogue loads: a parameter of the emitted fn (and a key of epi_args)."""

    name: str  # coda name
    py: str  # name in the emitted fn
    role: str  # "tile" | "row vector" | "column vector" | "scalar"
    op: str  # quack op class, or "C" for the GEMM's C operand (packed mode: not an epilogue op)
    dtype: str
    shape: Shape
    lanes: int  # 2: arrives as a Pair (full-width tile or column vector in acc_pair mode; C in packed mode)
    # How the runtime must pass the argument, when not as is: "repeat_interleave(2)" for a half-width
    # column vector in acc_pair mode (one value per column pair, loaded at the GEMM's width; the
    # epilogue reads lane 0).
    host: str = ""


@dataclass(frozen=True)
class Output:
    """A stored tile: quack's D, or a TileStore (gated: half-width, in acc_pair mode). In acc_pair mode a
    second full-width tile is stored as two gated TileStores, one per lane (`lane` 0: the even
    columns, 1: the odd ones), which the runtime interleaves back (quack's acc_pair mode stores only D
    at full width)."""

    name: str
    py: str
    dtype: str
    shape: Shape
    op: str  # "D" | "TileStore"
    gated: bool = False
    lane: int | None = None


@dataclass(frozen=True)
class Sink:
    """A partial reduction (or pick) the epilogue folds; `value` are the coda names it folds
    (two for a scaled sum of a product: folded as one fma, like quack's `(y, y)`)."""

    name: str
    py: str
    op: str  # ColVecReduce | RowVecReduce | OnlineLSEReduce | ColVecSelect
    combine: str | None  # "add" | "max" | "max_abs" for VecReduces
    scaled: bool
    value: tuple[str, ...]
    shape: Shape
    layout: str  # what the kernel writes, for the runtime: "row partials" | "column partials" | "vector"
    index: str | None = None  # ColVecSelect: py name of its index operand (an extra op, not an fn parameter)
    index_dtype: str | None = None
    pad: str = "0.0"  # acc_pair mode, half-width value: the second lane (the fold's identity)
    lanes: int = 1  # packed mode, double-width value: 2 (its two lanes are folded first, by `combine`)
    # min(): the kernel folds the negation by max (`combine` "max"), so its partial buffer holds -min per
    # tile; the runtime negates the buffer back (exact, infinities included: -max(-x) == min(x))
    negate: bool = False
    # a sum (or max of abs) whose value past the end of the reduced dim, in the ragged last tile, is not
    # known to be 0: quack folds those elements too (its add and max_abs reduces count on the zeros of
    # a padded accumulator), so the kernel uses epi_ops' Bounded*Reduce, which masks them out
    bounded: bool = False


@dataclass(frozen=True)
class Group:
    """A grouped reduction complete in its tile: the prepass computes `value` per element, the op `py`
    (epi_ops.GroupedReduce, a parameter of the main fn) folds it per (row, run of `width` columns of
    the tile) and gives the main fn each element's raw fold. `out`: when the reduction is used after
    the stage, the py name of its writer (quack's GroupedColStatsOut, f32[rows, cols / width])."""

    name: str
    py: str
    combine: str  # "add" | "max" | "min" | "lse" (log-sum-exp)
    width: int  # columns of the stage's tile per group
    value: str  # coda name of the reduced value (computed by the prepass fn)
    shape: Shape  # [rows, cols / width]
    out: str | None = None


@dataclass(frozen=True)
class Gemm:
    a: str
    b: str
    a_dtype: str
    b_dtype: str
    ta: bool  # A is written transpose(a): stored [K, M]
    tb: bool  # B is written transpose(b): stored [N, K]
    rows: Dim
    cols: Dim
    k: Dim


@dataclass(frozen=True)
class StageSpec:
    block: str
    index: int  # 1-based
    text: str  # `gemm y @ w_o`
    line: int
    fn_name: str
    mode: str  # "element" | "acc_pair" | "packed_cd_b16x2"
    gemm: Gemm
    operands: tuple[Operand, ...]
    d: Output | None
    outputs: tuple[Output, ...]  # TileStores
    sinks: tuple[Sink, ...]
    eqns: tuple[Eqn, ...]  # the live equations, in order (scaled-sum products dropped)
    names: dict[str, str] = field(compare=False, default_factory=dict)  # coda name -> py name
    constraints: tuple[str, ...] = ()  # on the tile config, e.g. "tile_N % 32 == 0"
    source: tuple[str, ...] = ()  # the stage's body as .coda source (for the emitted docstring)
    span: Span | None = field(compare=False, default=None)
    groups: tuple[Group, ...] = ()  # grouped reductions (quack's prepass), in program order
    prepass: tuple[Eqn, ...] = ()  # the prepass fn's equations: what the groups reduce, per element

    @property
    def prepass_name(self) -> str:
        return f"{self.fn_name}_prepass"

    @property
    def paired(self) -> bool:
        return self.mode == "acc_pair"

    @property
    def packed(self) -> bool:
        return self.mode == PACKED

    @property
    def c(self) -> Operand | None:
        """The GEMM's C operand (packed mode: the double-width 16-bit tile the stage loads)."""
        return next((o for o in self.operands if o.op == "C"), None)

    def lanes(self, t: Type | None) -> int:
        if self.packed:
            return 2 if is_wide(t, self.gemm.cols) else 1
        return lanes_of(t, self.gemm.rows, self.gemm.cols) if self.paired else 1


PACKED = "packed_cd_b16x2"
PACKED_DTYPES = ("bf16", "f16")


def is_wide(t: Type | None, cols: Dim) -> bool:
    """A tile twice the stage's width (in packed mode: two lanes per accumulator element)."""
    return t is not None and t.kind == TILE and len(t.shape) == 2 and t.shape[1] == cols.scale(2)


def lanes_of(t: Type | None, rows: Dim, cols: Dim) -> int:
    """In acc_pair mode: 2 for a value over the stage's full width (a Pair), 1 otherwise."""
    if t is None:
        return 1
    if t.kind == TILE and len(t.shape) == 2:
        return 2 if t.shape[1] == cols else 1
    if t.kind == VEC and t.shape and t.shape[0] != rows:
        return 2 if t.shape[0] == cols else 1
    return 1


def _fail(code: str, message: str, span: Span | None, notes: list[str] | None = None,
          help: list[str] | None = None) -> CodaError:
    return CodaError([Diagnostic(code, message, span, notes=list(notes or []), help=list(help or []))])


def plan_block(block: Any) -> list[StageSpec]:
    """Every stage of a checked block (raises the first stage's CodaError)."""
    return [plan_stage(block, k) for k in range(1, len(block.plan.stages) + 1)]


def plan_stage(block: Any, index: int) -> StageSpec:
    """The StageSpec of stage `index` (1-based) of a checked `coda_lang.api.Block`."""
    ir, bplan = block.ir, block.plan
    stages = ir.stages
    if not 1 <= index <= len(stages):
        raise ValueError(f"block {ir.name} has {len(stages)} stages, no stage {index}")
    st: Stage = stages[index - 1]
    sp = bplan.stages[index - 1]
    if not st.is_gemm:
        raise _fail("E0701", f"stage {index} (`{sp.text}`) has no GEMM; the CuTeDSL backend compiles GEMM stages only",
                    st.span, notes=["an elementwise stage is a memory-bound kernel (autodiff makes one where no GEMM "
                                    "produces a cotangent); it will get its own emitter"])
    return _Planner(block, index, st, sp).run()


class _Planner:
    def __init__(self, block: Any, index: int, st: Stage, sp: Any):
        self.block, self.index, self.st, self.sp = block, index, st, sp
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

    # -- helpers ------------------------------------------------------------------------------

    def py(self, name: str) -> str:
        """The Python name of a coda value (renamed when it would clash with a helper or keyword)."""
        if name in self.names:
            return self.names[name]
        # (a leading underscore, as autodiff's temporaries have, is no name quack takes for an operand
        # or sink: they become fields of its argument dataclasses)
        base = name if name == "acc" else (f"dim_{name[1:]}" if name.startswith(DIM_PREFIX) else
                                           f"v{name}" if name.startswith("_") else
                                           f"v_{name}" if name in helper_names() | QUACK_RESERVED
                                           or keyword.iskeyword(name) or name == self.fn_name else name)
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
        for s in body[pos + 1:]:
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
        paired = not wide and (any(REGISTRY[e.op].locality == "pair" for e in st.body) or any(
            t.kind == TILE and len(t.shape) == 2 and t.shape[1] != self.cols for t in self.types.values()))
        mode = PACKED if wide else "acc_pair" if paired else "element"
        packed = mode == PACKED

        full = [s for s in sp.stores if s.shape[1] == (self.cols.scale(2) if packed else self.cols)]
        d_store = full[-1] if full else None
        outputs: list[Output] = []
        d: Output | None = None
        for store in sp.stores:
            e = self.defined[store.name]
            if store.dtype not in STORE_DTYPES:
                raise _fail("E0702", f"stored tile `{store.name}` has dtype {store.dtype}; the epilogue stores "
                            "f32, bf16 or f16", e.span)
            if d_store is not None and store.name == d_store.name:
                d = Output(store.name, self.py(store.name), store.dtype, store.shape, "D")
                continue
            if store.shape[1] not in (self.cols, self.cols.scale(Fraction(1, 2))):
                raise _fail("E0704", f"`{store.name}` is stored at width `{store.shape[1]}` in a stage of width "
                            f"`{self.cols}`", e.span, notes=["quack stores tiles at the GEMM's width, half of it "
                                                             "after pairs(), or twice it as D in packed mode"])
            gated = paired and store.shape[1] != self.cols
            split = paired and store.shape[1] == self.cols  # a second full-width tile: one store per lane
            if (gated or split) and store.dtype == "f32":
                what = "half-width" if gated else "full-width (stored as two half-width lanes)"
                raise _fail("E0702", f"{what} stored tile `{store.name}` is f32; quack stores paired outputs as "
                            "16-bit values", e.span, help=[f"annotate it, e.g. `{store.name}: bf16 = ...`"])
            if split:
                py = self.py(store.name)
                for lane in (0, 1):
                    outputs.append(Output(store.name, f"{py}_lane{lane}", store.dtype, store.shape, "TileStore", True,
                                          lane))
                continue
            outputs.append(Output(store.name, self.py(store.name), store.dtype, store.shape, "TileStore", gated))

        sinks = self.sinks(live_out, paired, packed)
        needed = {o.name for o in outputs} | ({d.name} if d else set())
        for s in sinks:
            needed |= set(s.value)
        stored_groups = self.stored_groups(live_out)
        eqns = self.live_eqns(needed)
        for e in eqns:
            self.check_eqn(e)
        groups, prepass = self.groups(eqns, stored_groups, packed)
        for e in prepass:
            self.check_eqn(e)
        operands = self.operands(eqns, [n for s in sinks for n in s.value]
                                 + [a.name for e in prepass for a in e.ins if isinstance(a, Var)]
                                 + [g.value for g in groups], paired, packed)
        if packed:
            c = next((o for o in operands if o.op == "C"), None)
            if d is None or c is None:
                missing = "stores no double-width tile (D)" if d is None else "loads no double-width tile (C)"
                raise _fail("E0704", f"stage {self.index} works on a tile twice its width but {missing}", st.span,
                            notes=["quack's packed_cd_b16x2 mode loads one 16-bit double-width tile as the GEMM's C "
                                   "operand and stores one as D, two lanes per accumulator element"])
            if c.dtype != d.dtype:
                raise _fail("E0702", f"the double-width tile `{c.name}` is {c.dtype} and the stored `{d.name}` is "
                            f"{d.dtype}; quack's packed mode needs one 16-bit dtype for both", self.defined[d.name].span,
                            help=[f"annotate it: `{d.name}: {c.dtype} = ...`"])
        constraints = list(sp.constraints)  # the checker's: tile_N holds whole groups
        if paired:
            constraints.append("tile_N % 2 == 0 (pairs of adjacent columns)")
            if outputs:
                constraints.append("tile_N % 32 == 0 (paired TileStore on SM90)")
        return StageSpec(self.ir.name, self.index, sp.text, sp.line, self.fn_name, mode, gemm, tuple(operands), d,
                         tuple(outputs), tuple(sinks), tuple(eqns), dict(self.names), tuple(constraints),
                         tuple(inline_source(st.body)), st.span, groups=tuple(groups), prepass=tuple(prepass))

    def check_packed(self, wide: list[str]) -> None:
        """A stage with double-width values compiles in packed mode: no half-width values beside them."""
        half = self.cols.scale(Fraction(1, 2))
        for name, t in self.types.items():
            if t.kind == TILE and len(t.shape) == 2 and t.shape[1] == half:
                raise _fail("E0704", f"`{name}` is half the stage's width while `{wide[0]}` is twice it",
                            self.defined[name].span,
                            notes=["a stage compiles either paired (half-width values, acc_pair mode) or packed "
                                   "(double-width values, packed_cd_b16x2 mode), not both"])

    def gemm(self) -> Gemm:
        st, sp = self.st, self.sp
        assert isinstance(st.a, Var) and isinstance(st.b, Var)
        a_dtype, b_dtype = self.param_dtype(st.a), self.param_dtype(st.b)
        for name, dt, span in ((st.a.name, a_dtype, st.a_span), (st.b.name, b_dtype, st.b_span)):
            if dt not in GEMM_DTYPES:
                raise _fail("E0702", f"GEMM operand `{name}` is {dt}; the backend multiplies bf16 or f16 operands",
                            span, help=[f"declare `{name}` as bf16 (or, for a stored tile, annotate it: "
                                        f"`{name}: bf16 = ...`)"])
        if a_dtype != b_dtype:
            raise _fail("E0702", f"GEMM operands are {a_dtype} and {b_dtype}; the backend needs equal dtypes", st.span)
        return Gemm(st.a.name, st.b.name, a_dtype, b_dtype, st.ta, st.tb, sp.rows, sp.cols, sp.k)

    def check_eqn(self, e: Eqn) -> None:
        """Can the emitter write this (live, non-reducing) equation?"""
        od = REGISTRY[e.op]
        for a in e.ins:
            if isinstance(a, DimRef) and a.dim.name is None:  # (the checker folds constant extents)
                raise _fail("E0703", f"the extent `{a.dim}` is used as a value inside a stage", e.span)
        if od.emit is None:
            raise _fail("E0703", f"`{od.surface}` has no CuTeDSL emitter yet", e.span)
        for v in e.outs:
            t = v.type
            if t is None:
                continue
            if t.dtype == "i32":
                raise _fail("E0702", f"`{v.name}` is i32: integer arithmetic inside an epilogue is not supported yet",
                            e.span)

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
            if od.locality not in ("reduce", "gather"):
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
                raise _fail("E0705", f"`{od.surface}()` of the grouped value `{x.name}` over its groups is not "
                            "compiled yet", e.span, notes=["quack's grouped statistics stay inside the kernel; "
                                                           "reduce the tile the groups came from instead"])
            per_row = bool(t.shape) and t.shape[0] == self.rows  # one value per row: reduced over the columns
            half = paired and xt is not None and lanes_of(xt, self.rows, self.cols) == 1
            wide = packed and is_wide(xt, self.cols)
            py = self.py(v.name)
            if wide and (od.surface not in ("sum", "max", "min") or not per_row):
                what = f"{od.surface}() over the rows" if not per_row else f"{od.surface}()"
                raise _fail("E0705", f"{what} of the double-width tile `{x.name}` is not compiled yet", e.span,
                            notes=["in packed mode a double-width value is two lanes per accumulator element; "
                                   "sum(), max() and min() over its columns fold the lanes first"])
            if od.name == "pick":
                idx = e.ins[1]
                if not per_row or not isinstance(idx, Var):
                    raise _fail("E0705", "pick() with one index per column is not compiled yet", e.span)
                if paired:
                    raise _fail("E0705", "pick() in a paired stage is not compiled yet", e.span)
                index_uses[idx.name] = index_uses.get(idx.name, 0) + 1
                ld = next(ld for ld in self.sp.loads if ld.name == idx.name)
                sinks.append(Sink(v.name, py, "ColVecSelect", None, False, (x.name,), t.shape, "vector",
                                  index=self.py(idx.name), index_dtype=ld.dtype))
                continue
            surface = od.surface
            if surface == "logsumexp":
                if paired:
                    raise _fail("E0705", "logsumexp() in a paired stage is not compiled yet", e.span)
                if not per_row:  # quack's online log-sum-exp folds along the columns only
                    raise _fail("E0705", "logsumexp() over the rows is not compiled yet", e.span,
                                notes=["quack's OnlineLSEReduce folds a row's columns; a column's rows would "
                                       "need an online (max, sum) pair carried through RowVecReduce's exchange"])
                sinks.append(Sink(v.name, py, "OnlineLSEReduce", None, False, (x.name,), t.shape, "row partials"))
                continue
            combine = "add" if surface == "sum" else "max"
            negate = surface == "min"  # min(x) = -max(-x): quack folds the negation by max (exact)
            if not per_row and half:
                raise _fail("E0705", f"a reduction over the rows of the half-width tile `{x.name}` is not "
                            "compiled yet", e.span)
            op = "ColVecReduce" if per_row else "RowVecReduce"
            layout = "row partials" if per_row else "column partials"
            prod = self.defined.get(x.name)
            # quack masks the ragged end of the reduced dim for max (and min, its negation) itself
            bounded = combine == "add" and not _is_zero(self.padding_value(x.name, per_row))
            if wide:
                sinks.append(Sink(v.name, py, op, combine, False, (x.name,), t.shape, layout, lanes=2, negate=negate,
                                  bounded=bounded))
                continue
            if (surface == "sum" and not paired and not bounded and prod is not None and prod.op == "mul"
                    and uses.get(x.name) == 1 and x.name not in live_out
                    and all(isinstance(a, Var) for a in prod.ins)):
                ins = tuple(a.name for a in prod.ins if isinstance(a, Var))
                sinks.append(Sink(v.name, py, op, combine, True, ins, t.shape, layout))
                continue
            if (surface == "max" and prod is not None and prod.op == "abs" and uses.get(x.name) == 1
                    and x.name not in live_out and isinstance(prod.ins[0], Var)):
                # max(abs(x)): quack folds |x| with PTX max.abs (its amax epilogue)
                sinks.append(Sink(v.name, py, op, "max_abs", False, (prod.ins[0].name,), t.shape, layout, pad="self",
                                  bounded=not _is_zero(self.padding_value(prod.ins[0].name, per_row))))
                continue
            pad = "0.0" if combine == "add" else "self"
            sinks.append(Sink(v.name, py, op, combine, False, (x.name,), t.shape, layout, pad=pad, negate=negate,
                              bounded=bounded))
        for n, k in index_uses.items():
            if uses.get(n, 0) != k:
                e = next(e for e in self.st.body if any(isinstance(a, Var) and a.name == n for a in e.ins))
                raise _fail("E0705", f"the pick() index `{n}` is also used as a value", e.span,
                            notes=["quack's ColVecSelect reads its index itself; the epilogue can't also see it"])
        return sinks

    def padding_value(self, name: str, per_row: bool, memo: dict[str, Any] | None = None) -> Any:
        """What `name` holds past the end of the reduced dim (the columns past N of the last column tile
        when `per_row`, else the rows past M of the last row tile): a number when it is the same
        whatever the inputs, REAL when it is made of the row's (column's) real values, None when it
        may be anything. There the accumulator and the tile loads are 0 (TMA fills out-of-bounds
        elements with zeros); a vector along the reduced dim holds whatever its shared memory held
        (quack's predicated copy skips those elements): None, as is a grouped value; a vector along
        the other dim, a scalar or a dim holds its real value: REAL. Inputs are taken as finite: 0 *
        REAL is 0, and so is the accumulator (with an infinity in that row of A it is inf * 0 = NaN;
        the kernel's sum is then NaN where the real elements alone give +-inf, README says so)."""
        memo = {} if memo is None else memo
        if name in memo:
            return memo[name]
        memo[name] = None
        loads = {ld.name: ld for ld in self.sp.loads}
        value: Any = None
        if name == "acc":
            value = 0.0
        elif name in loads:
            role = loads[name].role
            along = "column vector" if per_row else "row vector"  # a vector along the reduced dim
            value = 0.0 if role == "tile" else None if role == along else REAL
        elif name in self.defined:
            e = self.defined[name]
            od = REGISTRY[e.op]
            ins: list[Any] = []
            for x in e.ins:
                if isinstance(x, Var):
                    ins.append(self.padding_value(x.name, per_row, memo))
                elif isinstance(x, DimRef):
                    ins.append(REAL if x.dim.name else float(x.dim.coeff))
                elif isinstance(x, Lit) and isinstance(x.value, (int, float)):
                    ins.append(float(x.value))
                else:
                    ins.append(None)
            if od.locality in ("reduce", "gather") or any(v is None for v in ins):
                value = None
            elif e.op == "mul" and any(v is not REAL and v == 0.0 for v in ins):
                value = 0.0
            elif any(v is REAL for v in ins):
                value = REAL
            elif e.op in ("pairs", "copy", "cast"):
                value = ins[0]
            elif e.op == "interleave":
                value = ins[0] if ins[0] == ins[1] else REAL
            elif od.impl is not None and len(e.outs) == 1:
                import numpy as np

                try:
                    with np.errstate(all="ignore"):
                        out = od.impl(*(np.float32(v) for v in ins))
                    value = float(np.asarray(out, dtype=np.float64).reshape(-1)[0])
                except Exception:  # an op whose NumPy form wants more than numbers: unknown
                    value = None
        memo[name] = value
        return value

    def grouped(self) -> dict[str, Eqn]:
        """The stage's grouped reductions by result name."""
        return {e.outs[0].name: e for e in self.st.body
                if REGISTRY[e.op].locality == "reduce" and e.param("group") is not None}

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
                    raise _fail("E0705", f"`{v.name}`, computed from a grouped reduction, is used after the stage: "
                                "not compiled yet", e.span,
                                notes=["the kernel can store a grouped reduction itself (one value per row and "
                                       "group), not values computed from it"],
                                help=["use the grouped reduction after the stage, or recompute from it there"])
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
                raise _fail("E0705", "a grouped reduction in a stage that works on double-width tiles (packed mode) "
                            "is not compiled yet", e.span, notes=['quack: "prepass + packed C: not supported"'])
            if not isinstance(x, Var):
                raise _fail("E0705", f"grouped `{od.surface}()` of a constant", e.span)
            xt = x.type if x.type is not None else self.types.get(x.name)
            if xt is None or xt.kind not in (TILE, MATRIX) or len(xt.shape) != 2 or xt.shape[1] != self.cols:
                raise _fail("E0705", f"a grouped reduction of `{x.name}`, which is not a tile as wide as the stage's "
                            f"({shape_str((self.rows, self.cols))}), is not compiled yet", e.span,
                            notes=["quack's prepass sees the accumulator one element at a time, not in pairs"])
            group = e.param("group")
            assert isinstance(group, int)
            if group % 32 and group not in (8, 16):
                raise _fail("E0705", f"grouped reduction over groups of {group} columns: not compiled", e.span,
                            notes=["quack's grouped statistics fold each thread's runs of 8 adjacent accumulator "
                                   "columns, and the groups must nest with the epilogue's subtiles of 32 columns "
                                   "(SM90): groups of 8, 16 or a multiple of 32 compile"])
            prepass = self.live_eqns({x.name})
            tiles = {ld.name for ld in self.sp.loads if ld.role == "tile"}
            for p in prepass + [e]:
                for a in p.ins:
                    if isinstance(a, Var) and a.name in tiles:
                        raise _fail("E0705", f"the grouped reduction `{v.name}` reduces a value that reads the tile "
                                    f"`{a.name}`: not compiled yet", e.span,
                                    notes=["quack's prepass runs over the accumulator before the epilogue's tile "
                                           "loads arrive; it can read acc, vectors and scalars"])
                    if isinstance(a, Var) and a.name in grouped:
                        raise _fail("E0705", f"the grouped reduction `{v.name}` reduces a value computed from the "
                                    f"grouped reduction `{a.name}` of the same stage: not compiled yet", e.span,
                                    notes=["the epilogue has one prepass over the accumulator; this would need a "
                                           "second one"])
                if REGISTRY[p.op].locality == "pair":
                    raise _fail("E0705", f"the grouped reduction `{v.name}` reduces a value computed with "
                                f"`{REGISTRY[p.op].surface}()`: not compiled yet", e.span,
                                notes=["quack's prepass sees the accumulator one element at a time, not in pairs"])
            keep |= {id(p) for p in prepass}
            py = self.py(v.name)
            out = self.fresh(f"{py}_out") if name in stored else None
            combine = {"sum": "add", "logsumexp": "lse"}.get(od.surface, od.surface)  # add | max | min | lse
            groups.append(Group(v.name, py, combine, group, x.name, v.type.shape if v.type else (), out))
        return groups, [e for e in self.st.body if id(e) in keep]

    def live_eqns(self, needed: set[str]) -> list[Eqn]:
        """The equations the stored tiles and sinks depend on, in order (reductions are sinks)."""
        want = set(needed)
        keep: list[Eqn] = []
        for e in reversed(self.st.body):
            if REGISTRY[e.op].locality in ("reduce", "gather") or not {v.name for v in e.outs} & want:
                continue
            keep.append(e)
            want |= {a.name for a in e.ins if isinstance(a, Var)}
        return keep[::-1]

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
            e = next(e for e in self.st.body if any(isinstance(a, Var) and a.name == name for a in e.ins))
            if ld.dtype not in FLOAT_DTYPES:
                raise _fail("E0702", f"`{name}` is {ld.dtype}: integer operands of the epilogue are not supported yet",
                            e.span)
            width = ld.shape[-1] if ld.role in ("tile", "column vector") else None
            if packed and ld.role == "tile" and width == self.cols.scale(2):
                if any(o.op == "C" for o in out):
                    raise _fail("E0704", f"`{name}` is a second double-width tile load", e.span,
                                notes=["quack's packed_cd_b16x2 mode loads one double-width tile (the GEMM's C)"])
                if ld.dtype not in PACKED_DTYPES:
                    raise _fail("E0702", f"the double-width tile `{name}` is {ld.dtype}; quack's packed mode loads "
                                "16-bit pairs", e.span)
                out.append(Operand(name, "c", ld.role, "C", ld.dtype, ld.shape, 2))
                continue
            if paired and ld.role == "column vector" and width == self.cols.scale(Fraction(1, 2)):
                out.append(Operand(name, self.py(name), ld.role, LOAD_OPS[ld.role], ld.dtype, ld.shape, 2,
                                   host="repeat_interleave(2)"))
                continue
            if width is not None and width != self.cols:
                raise _fail("E0704", f"`{name}` ({ld.dtype}{shape_str(ld.shape)}) is not as wide as the stage's tile "
                            f"({shape_str((self.rows, self.cols))})", e.span,
                            notes=["quack loads tiles at the GEMM's width (column vectors too, except one value "
                                   "per column pair in a paired stage); other widths are not supported yet"])
            lanes = 2 if paired and width is not None else 1
            out.append(Operand(name, self.py(name), ld.role, LOAD_OPS[ld.role], ld.dtype, ld.shape, lanes))
        # a dim used as a value (`acc / K`): a Scalar operand holding its size, passed by the runtime
        for dim in dict.fromkeys(a.dim.name for e in eqns for a in e.ins if isinstance(a, DimRef) and a.dim.name):
            name = dim_operand(dim)
            out.append(Operand(name, self.py(name), "scalar", LOAD_OPS["scalar"], "f32", (), 1))
        return out


def describe(spec: StageSpec) -> list[str]:
    """Human lines about the stage's interface (the header of the emitted source)."""
    g = spec.gemm
    a = f"transpose({g.a})" if g.ta else g.a
    b = f"transpose({g.b})" if g.tb else g.b
    lines = [f"GEMM: {a} @ {b}: {g.a_dtype} x {g.b_dtype} -> acc f32{shape_str((g.rows, g.cols))}, K = {g.k}; "
             f"mode {spec.mode}"]
    for o in spec.operands:
        host = f", passed as {o.py}.{o.host}" if o.host else ""
        op = "the GEMM's C operand, 16-bit pairs" if o.op == "C" else o.op
        py = f"{o.py} = {o.name}" if o.op == "C" else o.py
        if o.name.startswith(DIM_PREFIX):
            py = f"{o.py} = the size of {o.name[len(DIM_PREFIX):]}"
        lines.append(f"load   {py}: {o.dtype}{shape_str(o.shape) if o.shape else ''} {o.role} ({op}{host})")
    if spec.d is not None:
        lines.append(f"store  D = {spec.d.py}: {spec.d.dtype}{shape_str(spec.d.shape)}")
    for out in spec.outputs:
        lane = f", lane {out.lane} of {out.name}" if out.lane is not None else ""
        lines.append(f"store  {out.py}: {out.dtype}{shape_str(out.shape)} (TileStore{', gated' if out.gated else ''}"
                     f"{lane})")
    for s in spec.sinks:
        fold = {"add": "sum", "max_abs": "max of |x|"}.get(s.combine or "", s.combine)
        if s.negate:
            fold = "min"
        what = {"ColVecReduce": f"{fold} over the columns, one partial per column tile",
                "RowVecReduce": f"{fold} over the rows, one partial per row tile",
                "OnlineLSEReduce": "logsumexp over the columns, one partial per column tile",
                "ColVecSelect": f"the value at column {s.index} of each row"}[s.op]
        scaled = ", scaled" if s.scaled else ", both lanes" if s.lanes == 2 else ""
        scaled += ", max of the negation: the buffer holds -min" if s.negate else ""
        scaled += ", masked past the end" if s.bounded else ""
        lines.append(f"reduce {s.py}: f32{shape_str(s.shape)} = {what} ({s.op}{scaled})")
    for gr in spec.groups:
        fold = {"add": "sum", "lse": "logsumexp"}.get(gr.combine, gr.combine)
        writer = f"; stored by {gr.out}" if gr.out else ""
        lines.append(f"group  {gr.py}: f32{shape_str(gr.shape)} = {fold} over each run of {gr.width} columns, complete "
                     f"in the tile (GroupedReduce, folded by the prepass{writer})")
    for c in spec.constraints:
        lines.append(f"tiling {c}")
    return lines

