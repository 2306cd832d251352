"""Stage planning: one checked GEMM stage -> the quack epilogue it becomes (`spec.StageSpec`).

What it does: `plan_stage` reads a checked block (`coda_lang.api.Block`: typed IR + plan) and, for
one stage, decides every resource of its quack `@gemm_epilogue`, in this order (the order the E07
checks run in): the GEMM, the epilogue mode (element; acc_pair for pairs() and half-width values;
packed_cd_b16x2 for double-width ones), the tiles it stores (D: the last full-width stored tile in
program order; the others TileStores; and the K-major copy of an fp8 tile a later GEMM of a
derived block reads transposed), the partial reductions it folds and the grouped ones complete
in a tile (sinks.py), the live equations the emitter turns into straight-line code, the operands it
loads (operands.py), and the tiling constraints a kernel's tile must meet. docs/backend.md says what
each mode and sink does and what is refused (E07).
The jobs, one module each: context.py (the stage as every job reads it, the Python names of its
values), planner.py (this orchestration, the GEMM, the mode, the stores, the live values),
sinks.py (reductions -> Sink and Group records), operands.py (loads -> Operand records),
refusals.py (each check that raises E07, with its message).
What it does not: write Python (emit.py), hold the data model (spec.py) or touch quack
(quack_adapter.py); it imports nothing heavy.
Invariants: a valid program the backend can't compile yet raises `CodaError` with an E07 code at the
offending line, never anything else, and never folds a reduction some other way than its combine
record says; planning is deterministic (the emitted source is a golden file).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from coda_lang.backend_cute.plan import operands, refusals, sinks
from coda_lang.backend_cute.plan.context import StageContext, live_eqns, stage_context
from coda_lang.backend_cute.plan.spec import (
    FP8_WORDS,
    PACKED,
    PACKED_DTYPES,
    WORDS,
    Gemm,
    Mode,
    Operand,
    Output,
    StageSpec,
    is_wide,
    kmajor_alone_on,
    kmajor_store_on,
    pair_store_on,
    plain_name,
)
from coda_lang.frontend.syntax.printer import inline_source
from coda_lang.ir.nodes import Eqn, Stage, Var
from coda_lang.ir.types import TILE, TileConstraint, is_fp8
from coda_lang.ops import REGISTRY, Locality


def plan_stage(block: Any, index: int, emulated: bool = False) -> StageSpec:
    """The StageSpec of stage `index` (1-based) of a checked `coda_lang.api.Block`. `emulated`: for the
    torch stand-ins only, which also multiply f32 operands (in f32: float32 models on a CPU)."""
    ir, bplan = block.ir, block.plan
    stages = ir.stages
    if not 1 <= index <= len(stages):
        raise ValueError(f"block {ir.name} has {len(stages)} stages, no stage {index}")
    refusals.check_gemm_stage(index, stages[index - 1], bplan.stages[index - 1], bplan.operand_dtype)
    refusals.check_grouped_loads(index, stages[index - 1], bplan.stages[index - 1])
    return run(stage_context(ir, bplan, index, emulated))


def run(ctx: StageContext) -> StageSpec:
    """The plan of the stage: each job in turn, then the spec they make."""
    st, sp = ctx.st, ctx.sp
    gemm = _gemm(ctx)
    live_out = _live_out(ctx)
    mode = _mode(ctx)
    packed = mode == PACKED
    paired = mode == "acc_pair"
    d, outputs = _stores(ctx, paired, packed)

    partials = sinks.partials(ctx, live_out, paired, packed)
    needed = {o.name for o in outputs} | ({d.name} if d else set())
    for s in partials:
        needed |= set(s.value)
    stored_groups = sinks.stored_groups(ctx, live_out)
    eqns = live_eqns(ctx, needed)
    indices = operands.indices(ctx, eqns, mode)
    for e in eqns:
        if not (indices and operands.is_index(e)):
            refusals.check_eqn(ctx, e)
    groups, prepass = sinks.groups(ctx, eqns, stored_groups, packed)
    for e in prepass:
        if not (indices and operands.is_index(e)):
            refusals.check_eqn(ctx, e)
    if indices:  # index values are operands (value ports), not equations of the fn
        eqns = [e for e in eqns if not operands.is_index(e)]
        prepass = [e for e in prepass if not operands.is_index(e)]
    repeats = operands.repeats(ctx, eqns + prepass)
    loads = operands.loads(
        ctx,
        eqns,
        [n for s in partials for n in s.value]
        + [a.name for e in prepass for a in e.ins if isinstance(a, Var)]
        + [g.value for g in groups],
        paired,
        packed,
        repeats,
    )
    loads += indices
    if packed:
        d, outputs, loads = _narrowed(ctx, loads, d, outputs)
        if not any(o.pairs for o in outputs):
            refusals.check_packed_cd(ctx, loads, d)
    outputs = _kmajor_copies(ctx, d, outputs, mode)
    spec = StageSpec(
        block=ctx.ir.name,
        index=ctx.index,
        text=sp.text,
        line=sp.line,
        fn_name=ctx.fn_name,
        mode=mode,
        gemm=gemm,
        operands=tuple(loads),
        d=d,
        outputs=tuple(outputs),
        sinks=tuple(partials),
        eqns=tuple(eqns),
        names=dict(ctx.names),
        temps=dict(ctx.temps),
        tiling=_tiling(
            ctx,
            [g.width for g in groups],
            paired,
            bool(outputs),
            any(o.gated and is_fp8(o.dtype) for o in outputs),
            [s.rows for s in partials if s.rows is not None],
        ),
        source=tuple(inline_source(st.body)),
        span=st.span,
        groups=tuple(groups),
        prepass=tuple(prepass),
        repeats=tuple(repeats.items()),
        derived=ctx.ir.derived,
    )
    # a bare GEMM is one shared kernel per dtype and majors (emit.py writes it without the stage's names)
    return replace(spec, fn_name=plain_name(gemm)) if spec.plain else spec


def _narrowed(
    ctx: StageContext, loads: list[Operand], d: Output | None, outputs: list[Output]
) -> tuple[Output | None, list[Output], list[Operand]]:
    """A packed stage storing an fp8 D (a derived backward's SwiGLU stage with quantized cotangents,
    beside its 16-bit C), quack's packed mode storing one 16-bit dtype. By default (`pair_store_on()`)
    D stored as its fp8 pairs (`Output.pairs`, a TileStore) and C loaded as a TileLoad of float32
    words, the stage running in quack's element mode (`StageSpec.quack_mode`): no 16-bit D written
    and read again. With $CODA_FP8_PAIR_STORE=0, D stored in C's dtype (bf16 or f16), rounded to
    odd, and narrowed by the runtime (`Output.narrow`: exact). A double-width fp8 C (unless
    $CODA_FP8_PAIR_LOAD=0: refusals.check_packed_tile) beside such a D: loaded as int16 words of two
    codes (`FP8_WORDS`), the stage in element mode too. Anything else as it is: (D, the TileStores, the
    loads)."""
    c = next((o for o in loads if o.op == "C"), None)
    if c is not None and is_fp8(c.dtype) and not ctx.emulated:
        refusals.check_fp8_pair_load(ctx, c, d)
        host = FP8_WORDS
    elif d is None or c is None or ctx.emulated or not is_fp8(d.dtype) or c.dtype not in PACKED_DTYPES:
        return d, outputs, loads
    elif not pair_store_on():
        return replace(d, dtype=c.dtype, narrow=d.dtype), outputs, loads
    else:
        host = WORDS
    assert d is not None
    words = replace(c, op="TileLoad", py=ctx.fresh(f"{c.name}_words"), host=host)
    return None, [replace(d, op="TileStore", pairs=True), *outputs], [words if o is c else o for o in loads]


def _gemm(ctx: StageContext) -> Gemm:
    st, sp = ctx.st, ctx.sp
    assert isinstance(st.a, Var) and isinstance(st.b, Var)
    a_dtype, b_dtype = ctx.bplan.operand_dtype(st.a), ctx.bplan.operand_dtype(st.b)
    copy_a, copy_b = _copies(ctx, st)
    if ctx.ir.derived and not ctx.emulated and is_fp8(a_dtype) != is_fp8(b_dtype):
        # beside a 16-bit cotangent: multiplied in that dtype, the runtime casting the fp8 operand
        # first (exact: every fp8 value is a bf16 one)
        wide = next(d for d in (a_dtype, b_dtype) if not is_fp8(d))
        wide = wide if wide in ("bf16", "f16") else "bf16"
        a_dtype, b_dtype = (wide if is_fp8(a_dtype) else a_dtype), (wide if is_fp8(b_dtype) else b_dtype)
    if not (copy_a or copy_b):
        refusals.check_gemm_dtypes(ctx, a_dtype, b_dtype)
    return Gemm(
        a=st.a.name,
        b=st.b.name,
        a_dtype=a_dtype,
        b_dtype=b_dtype,
        ta=st.ta and not copy_a,
        tb=st.tb or copy_b,
        rows=sp.rows,
        cols=sp.cols,
        k=sp.k,
        copy_a=copy_a,
        copy_b=copy_b,
        # (refusals.check_gemm_stage let only DeepSeek-V3's form through: both scales, names)
        scale_a=st.scale_a.name if isinstance(st.scale_a, Var) else None,
        scale_b=st.scale_b.name if isinstance(st.scale_b, Var) else None,
        scale_a_py=ctx.fresh(f"scale_{st.scale_a.name}") if isinstance(st.scale_a, Var) else "",
        scale_b_py=ctx.fresh(f"scale_{st.scale_b.name}") if isinstance(st.scale_b, Var) else "",
        b_columns=refusals.scale_b_per_column(st, sp),
    )


def _copies(ctx: StageContext, st: Stage) -> tuple[bool, bool]:
    """Whether GEMM stage `st` of the block takes K-major copies of its A and B (spec.Gemm's copy_a,
    copy_b): a derived backward's GEMM of two fp8 operands, one or both not K-major (a weight
    gradient's transpose(dacc) @ x, a data gradient's dacc @ w), is compiled K-major, the runtime
    handing it K-major copies of those: written by the stage or pass that made the operand where it
    can (`_kmajor_copies`, TritonStage.kmajor_stores), else made in one transposing pass each (fp8 to
    fp8: cheaper than widening them to bf16, and the GEMM runs at the fp8 rate)."""
    if not (ctx.ir.derived and not ctx.emulated and isinstance(st.a, Var) and isinstance(st.b, Var)):
        return False, False
    a_dtype, b_dtype = ctx.bplan.operand_dtype(st.a), ctx.bplan.operand_dtype(st.b)
    if not (is_fp8(a_dtype) and is_fp8(b_dtype)) or refusals.fp8_gemm_compiles(st, a_dtype, b_dtype):
        return False, False
    return st.ta, not st.tb


def _kmajor_copies(ctx: StageContext, d: Output | None, outputs: list[Output], mode: Mode) -> list[Output]:
    """`outputs` with the K-major copies (Output.kmajor) this stage stores beside its fp8 tiles that a
    later GEMM of the block reads transposed (`_copies`), so that no transposing pass makes them: a
    full-width stored tile's (D or a TileStore) in element or packed mode, and a packed stage's pairs'
    (one copy per lane, into every other row of the copy). Not: a stage over column pairs (acc_pair),
    a D the runtime narrows (that pass writes the copy: launch._narrow_with_kmajor), a half-width tile,
    the emulated kernels (which read any layout), or with $CODA_KMAJOR_STORE=0.
    A TileStore whose every later reader is a GEMM that takes its copy (not a block output) is stored
    as the copy alone (Output.alone): the row-major tile would be written and never read."""
    if ctx.emulated or mode == "acc_pair" or not kmajor_store_on():
        return outputs
    body = ctx.ir.body
    pos = next(i for i, s in enumerate(body) if s is ctx.st)
    wanted: set[str] = set()
    for later in body[pos + 1 :]:
        if isinstance(later, Stage) and later.is_gemm:
            copy_a, copy_b = _copies(ctx, later)
            wanted |= {v.name for v, c in ((later.a, copy_a), (later.b, copy_b)) if c and isinstance(v, Var)}
    plain = read_as_stored(body[pos + 1 :], ctx.ir.outputs, lambda st: _copies(ctx, st))
    copies: list[Output] = []
    alone: set[str] = set()
    for o in ([d] if d is not None else []) + outputs:
        if (
            o.name not in wanted
            or not is_fp8(o.dtype)
            or o.narrow is not None
            or o.gated
            or o.lane is not None
        ):
            continue
        if o.pairs:  # [M, 2N] as two lanes of [M, N]
            for lane in (0, 1):
                py = ctx.fresh(f"{o.py}_t{lane}")
                copies.append(replace(o, py=py, op="TileStore", pairs=False, lane=lane, kmajor=True))
        elif o.shape[1] == ctx.cols:
            only = o.op == "TileStore" and o.name not in plain and kmajor_alone_on()
            if only:
                alone.add(o.name)
            copies.append(replace(o, py=ctx.fresh(f"{o.py}_t"), op="TileStore", kmajor=True, alone=only))
        wanted.discard(o.name)
    return [o for o in outputs if o.name not in alone or o.kmajor] + copies


def read_as_stored(
    body: Sequence[Any], outputs: Sequence[Any], copies: Callable[[Stage], tuple[bool, bool]]
) -> set[str]:
    """The values the statements of `body` read in the layout they are stored in, not as a GEMM
    operand's K-major copy (`copies(stage)`: a GEMM stage's copy_a, copy_b), and the names of
    `outputs` (the block's). A value outside it that a stage stores with its copy is stored as the
    copy alone (Output.alone, TritonStage.kmajor_stores' ALONE)."""
    plain = {o.name for o in outputs}
    for s in body:
        eqns: tuple[Eqn, ...] = (s,) if isinstance(s, Eqn) else ()
        if isinstance(s, Stage):
            eqns = s.body
            copy_a, copy_b = copies(s) if s.is_gemm else (False, False)
            for v, c in ((s.a, copy_a), (s.b, copy_b), (s.scale_a, False), (s.scale_b, False)):
                if isinstance(v, Var) and not c:
                    plain.add(v.name)
        for e in eqns:
            plain |= {a.name for a in e.ins if isinstance(a, Var)}
    return plain


def _live_out(ctx: StageContext) -> set[str]:
    """Names of this stage read after it (later statements, stage operands, block outputs)."""
    body = ctx.ir.body
    pos = next(i for i, s in enumerate(body) if s is ctx.st)
    names: set[str] = {o.name for o in ctx.ir.outputs}
    for s in body[pos + 1 :]:
        if isinstance(s, Stage):
            for a in s.operands:  # (its block scales too: a later stage may read one as `scale_a=`)
                if isinstance(a, Var):
                    names.add(a.name)
            eqns: tuple[Eqn, ...] = s.body
        else:
            eqns = (s,)
        for e in eqns:
            names |= {a.name for a in e.ins if isinstance(a, Var)}
    return names


def _mode(ctx: StageContext) -> Mode:
    """packed_cd_b16x2 with double-width values (typed, or loaded tiles), else acc_pair with pairs()
    or half-width values, else element."""
    wide = [n for n, t in ctx.types.items() if is_wide(t, ctx.cols)]
    wide += [ld.name for ld in ctx.sp.loads if ld.role == "tile" and ld.shape[-1] == ctx.cols.scale(2)]
    if wide:
        refusals.check_packed(ctx, wide)
    paired = not wide and (
        any(REGISTRY[e.op].locality is Locality.PAIR for e in ctx.st.body)
        or any(t.kind == TILE and len(t.shape) == 2 and t.shape[1] != ctx.cols for t in ctx.types.values())
    )
    return PACKED if wide else "acc_pair" if paired else "element"


def _stores(ctx: StageContext, paired: bool, packed: bool) -> tuple[Output | None, list[Output]]:
    """D (the last full-width stored tile, twice the width in packed mode) and the TileStores: a
    full-width one in a paired stage as two lanes, a half-width one gated to one lane."""
    cols = ctx.cols
    full = [s for s in ctx.sp.stores if s.shape[1] == (cols.scale(2) if packed else cols)]
    d_store = full[-1] if full else None
    outputs: list[Output] = []
    d: Output | None = None
    for store in ctx.sp.stores:
        e = ctx.defined[store.name]
        refusals.check_store(ctx, store, e)
        if d_store is not None and store.name == d_store.name:
            d = Output(name=store.name, py=ctx.py(store.name), dtype=store.dtype, shape=store.shape, op="D")
            continue
        gated = paired and store.shape[1] != cols
        split = paired and store.shape[1] == cols  # a second full-width tile: one store per lane
        refusals.check_tile_store(ctx, store, e, gated, split)
        if split:
            py = ctx.py(store.name)
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
                py=ctx.py(store.name),
                dtype=store.dtype,
                shape=store.shape,
                op="TileStore",
                gated=gated,
            )
        )
    return d, outputs


def _tiling(
    ctx: StageContext,
    group_widths: list[int],
    paired: bool,
    stores: bool,
    fp8_gated: bool = False,
    group_rows: list[int] | None = None,
) -> tuple[TileConstraint, ...]:
    """The checker's tiling constraints (tile_N holds whole groups, tile_M whole groups of rows) and
    the kernel's: grouped statistics within the epilogue subtile, pairs of columns, paired TileStores
    (`stores`), a half-width fp8 one's subtile (`fp8_gated`), a group of rows one tile tall
    (`group_rows`)."""
    tiling = list(ctx.sp.tiling)
    for g in sorted(set(group_rows or ())):
        # a 128x1 group folded as the tile's column partial (quack's RowVecReduce: one value per
        # column and tile): the checker's tile_M % g == 0 and this make tile_M == g (the emulated
        # kernels fold each group exactly at any tile_M the checker allows)
        tiling.append(
            TileConstraint(
                of="tile_M",
                divides=g,
                reason=f"a group of {g} rows is one tile's column partial (RowVecReduce)",
                kernel_only=True,
            )
        )
    for w in sorted(set(group_widths)):
        # quack's grouped statistics (GroupedColStatsBase) fold one statistic slot per thread and
        # epilogue subtile: a group narrower than the subtile would be folded together with its
        # neighbours (the emulated kernels fold each group exactly, at any subtile)
        tiling.append(
            TileConstraint(
                of="the epilogue subtile's N",
                divides=w,
                reason="gcd(32, tile_N), gcd(64, tile_N) for an 8-bit D in a pingpong tile, or epi_n; build/config.epilogue_subtile_n",
                kernel_only=True,
            )
        )
    if paired:
        tiling.append(TileConstraint(of="tile_N", multiple_of=2, reason="pairs of adjacent columns"))
        if stores:
            tiling.append(TileConstraint(of="tile_N", multiple_of=32, reason="paired TileStore on SM90"))
        if fp8_gated:
            # a half-width fp8 tile is stored by TMA from a subtile half as wide as the epilogue's: the
            # TMA store's box needs rows of 16 bytes or more, 16 fp8 columns, so the epilogue subtile
            # is at least 32 columns. Held by the rules above (tile_N % 32, and config.PAIRED_SUBTILE:
            # epi_n 0 or a multiple of 32; quack's own subtile is then 32 or 64 columns); said here
            # so that the kernel's reason is written down (gated_store.GatedFp8Store asserts it too)
            tiling.append(
                TileConstraint(
                    of="the epilogue subtile's N",
                    multiple_of=32,
                    reason="a half-width fp8 TileStore's rows of 16 bytes or more (TMA)",
                    kernel_only=True,
                )
            )
    return tuple(tiling)
