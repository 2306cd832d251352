"""A stage's loads as epilogue operands: what the emitted fn reads besides the accumulator -> `Operand`s.

What it does: `loads` makes each value the stage loads (the checker's plan: tiles, row and column
vectors, scalars) an operand, in order of first use: a TileLoad, quack's ColVecLoad for a row vector
and RowVecLoad for a column vector (quack names a vector by the axis it broadcasts along, we by the
axis it runs over), a Scalar; in packed mode the double-width tile is the GEMM's C; in a paired stage
a column vector of one value per column pair is passed repeated (`host`) and read in two lanes; a
vector that repeats (`repeats`: docs/language.md, "Vectors that repeat") is passed repeated to the
width it meets (`period`); a dim used as a value is a Scalar holding its size. `indices` makes
row_index() / col_index() of an element-mode stage TileIndex value ports, computed from the
coordinates (nothing is loaded).
What it does not: word refusals (refusals.py: each check is called here, in the order the
diagnostics depend on), choose sinks (sinks.py) or the mode (planner.py).
Invariants: one operand per loaded name, in order of first use (the emitted signature is a golden
file); an integer load is accepted only where it is exact in the f32 quack loads it as.
"""

from __future__ import annotations

from fractions import Fraction

from coda_lang.backend_cute.plan import refusals
from coda_lang.backend_cute.plan.context import StageContext
from coda_lang.backend_cute.plan.spec import (
    INDEX_ROLES,
    LOAD_OPS,
    LOAD_ROLES,
    Mode,
    Operand,
    dim_operand,
    member,
)
from coda_lang.frontend.verify.repeat import repeated
from coda_lang.ir.nodes import DimRef, Eqn, Var
from coda_lang.ir.types import Dim
from coda_lang.ops import REGISTRY, Locality


def is_index(e: Eqn) -> bool:
    """row_index() or col_index(): a TileIndex value port of an element-mode stage."""
    return REGISTRY[e.op].locality is Locality.INDEX


def indices(ctx: StageContext, eqns: list[Eqn], mode: Mode) -> list[Operand]:
    """`row_index()` / `col_index()` of an element-mode stage as TileIndex value ports (nothing is
    loaded: the kernel takes each element's index from its coordinates). In a paired or packed
    stage they have no emitter (E0703); the emulator computes them there as equations."""
    found = [e for e in eqns if is_index(e)]
    if not found:
        return []
    if mode != "element":
        refusals.check_index_mode(ctx, found[0], mode)
        return []
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
                py=ctx.py(v.name),
                role=INDEX_ROLES[axis],
                op="TileIndex",
                dtype="i32",
                shape=shape,
                lanes=1,
            )
        )
    return out


def repeats(ctx: StageContext, eqns: list[Eqn]) -> dict[Dim, Dim]:
    """The width W each dim G of repeating vectors meets in the stage (docs/language.md, "Vectors
    that repeat"): such a vector is passed repeated to W columns (`Operand.period`), so that the
    kernel reads it as a column vector of that width, and what the stage computes from it is a
    column vector of that width too. One width per dim: E0704 for two."""
    out: dict[Dim, Dim] = {}
    for e in eqns:
        for i, g, w in repeated(e, ctx.rows, ctx.cols):
            refusals.check_repeat(e, i, w, out.setdefault(g, w))
    return out


def int_compared_only(name: str, eqns: list[Eqn]) -> bool:
    """Is every use of `name` in the stage's live equations a comparison? (An i32 vector is
    loaded as f32 by quack's vector loads: comparing it with another integer there is exact below
    2**24, arithmetic on it is not.)"""
    uses = [e for e in eqns if any(isinstance(a, Var) and a.name == name for a in e.ins)]
    return bool(uses) and all(REGISTRY[e.op].compares for e in uses)


def loads(
    ctx: StageContext,
    eqns: list[Eqn],
    sink_values: list[str],
    paired: bool,
    packed: bool,
    repeat: dict[Dim, Dim],
) -> list[Operand]:
    """The loads the emitted code reads, in order of first use (packed mode: the double-width tile
    is the GEMM's C operand, `c` in the emitted fn). `repeat`: the stage's repeats()."""
    by_name = {ld.name: ld for ld in ctx.sp.loads}
    used: list[str] = []
    for name in [a.name for e in eqns for a in e.ins if isinstance(a, Var)] + sink_values:
        if name in by_name and name not in used:
            used.append(name)
    out: list[Operand] = []
    for name in used:
        ld = by_name[name]
        role = member(ld.role, LOAD_ROLES)
        e = next(e for e in ctx.st.body if any(isinstance(a, Var) and a.name == name for a in e.ins))
        compared = (
            ld.dtype == "i32"
            and ld.role in ("row vector", "column vector")
            and name not in sink_values
            and int_compared_only(name, eqns)
        )
        refusals.check_operand_dtype(ctx, ld, e, compared)
        group, rows_group = 0, 1
        if ld.role == "grouped tile":  # `expand(s, acc)`, s [M/g1, N/g] (refusals.check_grouped_loads)
            if paired or packed:
                refusals.check_grouped_mode(ctx, ld, e)
            g = refusals.column_group(ld, ctx.sp)
            assert g is not None
            group = g  # (no width of its own: one lane, loaded as it is, below)
            rows_group = refusals.row_group(ld, ctx.sp)
        width = ld.shape[-1] if ld.role in ("tile", "column vector") else None
        period: Dim | None = None
        shape = ld.shape
        if ld.role == "column vector" and width in repeat:  # passed repeated to its width
            period, width = ld.shape[-1], repeat[ld.shape[-1]]
            shape = (width,)
        if packed and ld.role == "tile" and width == ctx.cols.scale(2):
            refusals.check_packed_tile(ctx, ld, e, out)
            out.append(Operand(name=name, py="c", role=role, op="C", dtype=ld.dtype, shape=ld.shape, lanes=2))
            continue
        if paired and ld.role == "column vector" and width == ctx.cols.scale(Fraction(1, 2)):
            out.append(
                Operand(
                    name=name,
                    py=ctx.py(name),
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
        refusals.check_operand_width(ctx, ld, e, width, period)
        lanes = 2 if paired and width is not None else 1
        out.append(
            Operand(
                name=name,
                py=ctx.py(name),
                role=role,
                op=LOAD_OPS[role],
                dtype=ld.dtype,
                shape=shape,
                lanes=lanes,
                period=period,
                group=group,
                row_group=rows_group,
            )
        )
    # a dim used as a value (`acc / K`): a Scalar operand holding its size, passed by the runtime
    for dim in dict.fromkeys(a.dim.name for e in eqns for a in e.ins if isinstance(a, DimRef) and a.dim.name):
        name = dim_operand(dim)
        out.append(
            Operand(
                name=name,
                py=ctx.py(name),
                role="scalar",
                op=LOAD_OPS["scalar"],
                dtype="f32",
                shape=(),
                lanes=1,
            )
        )
    return out
