"""What the CuTeDSL backend refuses (E07): each check the planner makes, with its diagnostic.

What it does: one function per check, named for what it checks, raising `CodaError` with one E07
diagnostic (its message, notes and help as docs/errors.md shows them) where the stage asks for
something the backend can't compile yet, and returning None where it can: a stage without a GEMM
(E0701), or a GEMM with block scales of another form than DeepSeek-V3's (E0709); dtypes the GEMM, a store, a load or an equation can't have (E0702); equations without an
emitter (E0703); widths, packed tiles and repeats the epilogue can't lay out (E0704); reductions and
grouped reductions it can't fold (E0705). planner.py, sinks.py and operands.py call them where they
choose ports, so a refusal's wording lives here and the port choice stays free of it.
What it does not: choose ports, modes or records (planner.py, sinks.py, operands.py), or check what
the checker already guarantees (frontend/verify/).
Invariants: a check only reads (the context, the IR, the registry) and raises nothing but an E07
`CodaError`; the planner calls the checks in a fixed order, so the same stage always gets the same
diagnostic (they are golden files).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from fractions import Fraction

from coda_lang.backend_cute.plan.context import StageContext
from coda_lang.backend_cute.plan.spec import (
    GEMM_DTYPES,
    PACKED_DTYPES,
    SCALE_BLOCK,
    SINK_COMBINES,
    STORE_DTYPES,
    Mode,
    Operand,
    Output,
    fp8_pair_load_on,
    pair_store_on,
)
from coda_lang.core.diagnostics import CodaError, Diagnostic
from coda_lang.frontend.verify.plan import Load, StagePlan, Store
from coda_lang.ir.nodes import Atom, DimRef, Eqn, Span, Stage, Var
from coda_lang.ir.types import FLOAT_DTYPES, GROUP, MATRIX, TILE, Dim, Type, group_size, is_fp8, shape_str
from coda_lang.ops import REGISTRY, Locality


def fail(
    code: str, message: str, span: Span | None, notes: list[str] | None = None, help: list[str] | None = None
) -> CodaError:
    return CodaError([Diagnostic(code, message, span, notes=list(notes or []), help=list(help or []))])


# -- the stage and its GEMM -------------------------------------------------------------------------


def check_gemm_stage(index: int, st: Stage, sp: StagePlan, dtype_of: Callable[[Var], str]) -> None:
    """E0701 for a stage without a GEMM (an elementwise stage: backend_triton compiles it); E0709 for
    block scales of another form than the kernels' (block_scales_unsupported, `dtype_of` its dtypes)."""
    if not st.is_gemm:
        raise fail(
            "E0701",
            f"stage {index} (`{sp.text}`) has no GEMM; the CuTeDSL backend compiles GEMM stages only",
            st.span,
            notes=[
                "an elementwise stage is a memory-bound kernel (autodiff makes one where no GEMM "
                "produces a cotangent): a generated Triton kernel, or a torch.compile kernel where the "
                "generator can't take its ops"
            ],
        )
    if st.scaled:
        why = block_scales_unsupported(st, sp, dtype_of)
        if why is not None:
            raise fail(
                "E0709",
                f"stage {index} (`{sp.text}`): the kernels have no GEMM for these block scales: {why}",
                st.scale_a_span if st.scale_a is not None else st.scale_b_span,
                notes=[
                    "the kernels' block-scaled GEMM is DeepSeek-V3's: `gemm a @ transpose(w), scale_a=sa, "
                    "scale_b=sw` with a and w fp8 (a: [M, K], w stored [N, K]), sa: f32[M, K/128] (1 x 128 "
                    "groups of a) and sw: f32[N/128, K/128] (128 x 128 blocks of w), each 128-deep block of K "
                    "promoted with its scales in the mainloop; also without `scale_a` (w's blocks alone), and "
                    "with w stored [K, N] and sw: f32[K/128, N/128] in a derived backward (its data gradient "
                    "`dacc @ w, scale_b=sw`); the interpreter runs any block scales (`coda run`, "
                    "`--target interp`)"
                ],
                help=[
                    "write the GEMM in that form, or scale per tensor and fold the scales into the epilogue "
                    "(`y = acc * (sa * sb)`, as examples/fp8_delayed.coda does)"
                ],
            )


def scale_b_per_column(st: Stage, sp: StagePlan) -> bool:
    """Whether the GEMM stage's `scale_b=` is one scale per column of the result and 128-deep block of
    K, laid out [K/128, N] as its B is stored [K, N] (a requantized weight gradient's)."""
    sb = st.scale_b
    if st.tb or not isinstance(sb, Var) or sb.type is None or len(sb.type.shape) != 2:
        return False
    groups = [group_size(d, g) for d, g in zip((sp.k, sp.cols), sb.type.shape, strict=True)]
    return groups == [SCALE_BLOCK, 1]


def block_scales_unsupported(st: Stage, sp: StagePlan, dtype_of: Callable[[Var], str]) -> str | None:
    """Why the kernels' block-scaled GEMM (plan/block_scaled.py) can't run this scaled stage, or None.
    `dtype_of`: the dtype each GEMM operand is multiplied in (the block plan's `operand_dtype`: a value
    stored in e4m3 is an e4m3 operand, whatever its compute type)."""
    if st.scale_b is None:
        return "it scales a only; the kernel takes w's scale, with or without a's"
    if st.ta and st.scale_a is not None:
        return "the kernel reads a scaled a as [M, K] (K-major)"
    if not all(isinstance(x, Var) and is_fp8(dtype_of(x)) for x in (st.a, st.b)):
        return "its operands are not both fp8 (e4m3 or e5m2)"
    sa, sb = st.scale_a, st.scale_b
    scales = [s for s in (sa, sb) if s is not None]
    types = [s.type for s in scales if isinstance(s, Var) and s.type is not None]
    if len(types) != len(scales) or not isinstance(sb, Var) or sb.type is None:
        return "a scale is not a matrix of the block"
    if any(t.dtype != "f32" for t in types):
        return "its scales are not f32"
    # w's blocks laid out as w is stored: [N/128, K/128] for transpose(w), [K/128, N/128] for w
    b_dims = (sp.cols, sp.k) if st.tb else (sp.k, sp.cols)
    groups_b = [group_size(d, g) for d, g in zip(b_dims, sb.type.shape, strict=True)]
    if isinstance(sa, Var) and sa.type is not None:
        groups_a = [group_size(d, g) for d, g in zip((sp.rows, sp.k), sa.type.shape, strict=True)]
        if groups_a != [1, SCALE_BLOCK]:
            return f"scale_a `{sa.name}` is {shape_str(sa.type.shape)}: groups of {groups_a[0]} x {groups_a[1]}, not 1 x {SCALE_BLOCK}"
    if sa is None and scale_b_per_column(st, sp):
        return None  # `BlockScale(..., columns=True)`: a requantized weight gradient's scale per column
    if groups_b != [SCALE_BLOCK, SCALE_BLOCK]:
        return f"scale_b `{sb.name}` is {shape_str(sb.type.shape)}: blocks of {groups_b[0]} x {groups_b[1]}, not {SCALE_BLOCK} x {SCALE_BLOCK}"
    return None


def column_group(ld: Load, sp: StagePlan) -> int | None:
    """g where a matrix the epilogue reads over groups (`expand(s, acc)`) is [M/g1, N/g] of the stage's
    [M, N], g > 1: one value per run of g columns (epi_ops.GroupColumnLoad loads it, the runtime
    passing it repeated over its groups of rows: `row_group`); else None."""
    if len(ld.shape) != 2:
        return None
    rows, cols = group_size(sp.rows, ld.shape[0]), group_size(sp.cols, ld.shape[1])
    return cols if rows is not None and cols is not None and cols > 1 else None


def row_group(ld: Load, sp: StagePlan) -> int:
    """g1 of a matrix the epilogue reads over groups, [M/g1, N/g] (1: one value per row)."""
    return group_size(sp.rows, ld.shape[0]) or 1


def check_grouped_loads(index: int, st: Stage, sp: StagePlan) -> None:
    """E0704 for a matrix the epilogue reads over groups it can't load (`expand(s, acc)` of a matrix
    with one value per column, [M/g1, N]: a tile of f32 values, or groups the dims don't give)."""
    for ld in sp.loads:
        if ld.role == "grouped tile" and column_group(ld, sp) is None:
            span = next(
                (e.span for e in st.body if any(isinstance(a, Var) and a.name == ld.name for a in e.ins)),
                st.span,
            )
            raise fail(
                "E0704",
                f"stage {index} (`{sp.text}`) reads `{ld.name}` {shape_str(ld.shape)} over groups of its tile "
                f"{shape_str((sp.rows, sp.cols))} (`expand`) of one column each; the epilogue has no such load "
                "yet",
                span,
                notes=[
                    f"an epilogue reads a matrix of one value per run of g > 1 columns and per row or run of "
                    f"rows ([{sp.rows}/g1, {sp.cols}/g]); the interpreter and the elementwise stages' torch "
                    "stand-ins run any groups (`coda run`, `--target interp`)"
                ],
            )


def check_grouped_mode(ctx: StageContext, ld: Load, e: Eqn) -> None:
    """E0704 for `expand(s, acc)` in a paired or packed stage: the column a tile's columns fall in is
    loaded for an element-mode epilogue only."""
    raise fail(
        "E0704",
        f"stage {ctx.index} (`{ctx.sp.text}`) reads `{ld.name}` over groups of its columns (`expand`) in a "
        "stage over column pairs; the epilogue loads such a matrix in an element-mode stage only",
        e.span,
        notes=[
            "the interpreter and the elementwise stages' torch stand-ins run it (`coda run`, `--target interp`)"
        ],
    )


def check_gemm_dtypes(ctx: StageContext, a_dtype: str, b_dtype: str) -> None:
    """The GEMM multiplies bf16 or f16 operands of one dtype, or fp8 operands (e4m3, e5m2, mixed) that
    are both K-major (check_fp8_gemm); f32, and fp8 beside any float as the checker allows, run on the
    torch stand-ins only."""
    st = ctx.st
    assert isinstance(st.a, Var) and isinstance(st.b, Var)
    if ctx.emulated and (is_fp8(a_dtype) or is_fp8(b_dtype)):
        return
    if is_fp8(a_dtype) or is_fp8(b_dtype):
        check_fp8_gemm(ctx, a_dtype, b_dtype)
        return
    gemm_dtypes = (*GEMM_DTYPES, "f32") if ctx.emulated else GEMM_DTYPES
    for name, dt, span in ((st.a.name, a_dtype, st.a_span), (st.b.name, b_dtype, st.b_span)):
        if dt not in gemm_dtypes:
            raise fail(
                "E0702",
                f"GEMM operand `{name}` is {dt}; the backend multiplies bf16 or f16 operands",
                span,
                help=[f"declare `{name}` as bf16 (or, for a stored tile, annotate it: `{name}: bf16 = ...`)"],
            )
    if a_dtype != b_dtype:
        raise fail(
            "E0702", f"GEMM operands are {a_dtype} and {b_dtype}; the backend needs equal dtypes", st.span
        )


FP8_GEMM_NOTE = (
    "quack 0.6.5's SM90 GEMM multiplies 8-bit operands (e4m3 or e5m2, either with either) only with "
    "each other and only K-major: K is the contiguous dimension of both (Hopper's fp8 WGMMA reads no "
    "transposed 8-bit tile from shared memory)"
)


def fp8_gemm_compiles(st: Stage, a_dtype: str, b_dtype: str) -> bool:
    """Whether quack's fp8 GEMM multiplies this stage's operands as they are stored: both fp8, both
    K-major (A written `a`, B written `transpose(b)`)."""
    return is_fp8(a_dtype) and is_fp8(b_dtype) and not st.ta and st.tb


def check_fp8_gemm(ctx: StageContext, a_dtype: str, b_dtype: str) -> None:
    """An fp8 GEMM compiles where both operands are fp8 and K-major: A stored [M, K] (written `a`, not
    `transpose(a)`), B stored [N, K] (written `transpose(b)`). Otherwise E0702 at the operand, saying
    which layout would compile."""
    st = ctx.st
    assert isinstance(st.a, Var) and isinstance(st.b, Var)
    ops = ((st.a.name, a_dtype, st.a_span, "A"), (st.b.name, b_dtype, st.b_span, "B"))
    for name, dt, span, _ in ops:
        if not is_fp8(dt):
            fp8_name, fp8_dt = next((n, d) for n, d, _, _ in ops if is_fp8(d))
            raise fail(
                "E0702",
                f"GEMM operand `{name}` is {dt} and `{fp8_name}` is {fp8_dt}; an fp8 GEMM needs both "
                "operands in fp8",
                span,
                notes=[FP8_GEMM_NOTE],
                help=[
                    f"quantize `{name}` too (e4m3 with a scale folded in the epilogue), or store "
                    f"`{fp8_name}` as {dt if dt in GEMM_DTYPES else 'bf16'}"
                ],
            )
    if st.ta:
        name = st.a.name
        raise fail(
            "E0702",
            f"fp8 GEMM operand `{name}` is written `transpose({name})`: stored "
            f"{_stored(st.a) or '[K, M]'}, its contiguous dimension is `{ctx.sp.rows}`, not K (`{ctx.sp.k}`); "
            "the fp8 GEMM reads A K-major only",
            st.a_span,
            notes=[FP8_GEMM_NOTE],
            help=[
                f"store `{name}` as {_stored(st.a, swap=True) or '[M, K]'} (K contiguous) and write `{name}` untransposed"
            ],
        )
    if not st.tb:
        name = st.b.name
        raise fail(
            "E0702",
            f"fp8 GEMM operand `{name}` is stored {_stored(st.b) or '[K, N]'}: its contiguous dimension is "
            f"`{ctx.sp.cols}`, not K (`{ctx.sp.k}`); the fp8 GEMM reads B K-major only",
            st.b_span,
            notes=[FP8_GEMM_NOTE],
            help=[
                f"declare `{name}` as {b_dtype}{_stored(st.b, swap=True) or '[N, K]'} (K contiguous: torch's Linear "
                f"weight layout) and write `transpose({name})`"
            ],
        )


def _stored(v: Var, swap: bool = False) -> str | None:
    """The operand's stored shape (`[K, N]`), or its transpose's with `swap`; None if unknown."""
    t = v.type
    if t is None or len(t.shape) != 2:
        return None
    return shape_str(t.shape[::-1] if swap else t.shape)


def check_packed(ctx: StageContext, wide: list[str]) -> None:
    """A stage with double-width values compiles in packed mode: no half-width values beside them."""
    half = ctx.cols.scale(Fraction(1, 2))
    for name, t in ctx.types.items():
        if t.kind == TILE and len(t.shape) == 2 and t.shape[1] == half:
            raise fail(
                "E0704",
                f"`{name}` is half the stage's width while `{wide[0]}` is twice it",
                ctx.defined[name].span,
                notes=[
                    "a stage compiles either paired (half-width values, acc_pair mode) or packed "
                    "(double-width values, packed_cd_b16x2 mode), not both"
                ],
            )


def check_packed_cd(ctx: StageContext, operands: list[Operand], d: Output | None) -> None:
    """A packed stage loads one double-width tile as C and stores one as D, of one 16-bit dtype."""
    c = next((o for o in operands if o.op == "C"), None)
    if d is None or c is None:
        missing = "stores no double-width tile (D)" if d is None else "loads no double-width tile (C)"
        raise fail(
            "E0704",
            f"stage {ctx.index} works on a tile twice its width but {missing}",
            ctx.st.span,
            notes=[
                "quack's packed_cd_b16x2 mode loads one 16-bit double-width tile as the GEMM's C "
                "operand and stores one as D, two lanes per accumulator element"
            ],
        )
    if (c.dtype != d.dtype or d.dtype not in PACKED_DTYPES) and not ctx.emulated:
        raise fail(
            "E0702",
            f"the double-width tile `{c.name}` is {c.dtype} and the stored `{d.name}` is "
            f"{d.dtype}; quack's packed mode needs one 16-bit dtype for both",
            ctx.defined[d.name].span,
            help=[f"annotate it: `{d.name}: {c.dtype} = ...`"],
        )


# -- stores and equations ---------------------------------------------------------------------------


def check_fp8(ctx: StageContext, name: str, dtype: str, span: Span | None, what: str) -> None:
    """An fp8 (e4m3, e5m2) row or column vector loaded into an epilogue runs on the torch stand-ins
    only (`emulate=True`, and every device but a Hopper GPU): the kernels load fp8 tiles (quack's
    TileLoad widens each pair of codes with one `cvt.rn.f16x2.e4m3x2`, exactly), not fp8 vectors (an
    fp8 stored tile is compiled: check_store; fp8 GEMM operands: check_fp8_gemm; a packed stage's
    double-width fp8 tile: check_packed_tile)."""
    if is_fp8(dtype) and not ctx.emulated:
        raise fail(
            "E0702",
            f"{what} `{name}` is {dtype}: fp8 vectors are not compiled by the CuTeDSL backend yet",
            span,
            help=[
                f"load it as a wider vector (declare `{name}` bf16 or f32: every fp8 value is exact there)"
            ],
            notes=[
                "fp8 tiles load into an epilogue; the interpreter and the emulated runtime "
                "(`Block.cuda(emulate=True)`, coda_lang.torch on any device but a Hopper GPU, or "
                "CODA_EMULATE=1) also run fp8 vectors"
            ],
        )


def check_store(ctx: StageContext, store: Store, e: Eqn) -> None:
    """The epilogue stores f32, bf16, f16 or fp8 tiles (D or a TileStore); an fp8 one is saturated by
    the emitted epilogue and rounded by quack's store (emit.py); where quack's store is 16-bit only
    (a paired stage's lanes, packed mode's D) check_tile_store and check_packed_cd refuse it."""
    if store.dtype not in STORE_DTYPES and not is_fp8(store.dtype):
        raise fail(
            "E0702",
            f"stored tile `{store.name}` has dtype {store.dtype}; the epilogue stores f32, bf16 or f16",
            e.span,
        )


def check_tile_store(ctx: StageContext, store: Store, e: Eqn, gated: bool, split: bool) -> None:
    """A TileStore (not D) is as wide as the stage or half of it; a paired one is 16-bit, or fp8 when
    half-width (`gated`: a half-width one in a paired stage, stored by gated_store.GatedFp8Store when
    fp8; `split`: a full-width one there, stored as two half-width lanes, 16-bit only: its lanes are
    quack's gated TileStores, whose fp8 form is untested and whose interleave the runtime does in
    16 bits)."""
    if store.shape[1] not in (ctx.cols, ctx.cols.scale(Fraction(1, 2))):
        raise fail(
            "E0704",
            f"`{store.name}` is stored at width `{store.shape[1]}` in a stage of width `{ctx.cols}`",
            e.span,
            notes=[
                "quack stores tiles at the GEMM's width, half of it after pairs(), or twice it as D in "
                "packed mode"
            ],
        )
    if (gated or split) and (store.dtype == "f32" or split and is_fp8(store.dtype)) and not ctx.emulated:
        what = "half-width" if gated else "full-width (stored as two half-width lanes)"
        raise fail(
            "E0702",
            f"{what} stored tile `{store.name}` is {store.dtype}; quack stores paired outputs as 16-bit "
            "values (or fp8 at half width)",
            e.span,
            notes=[
                "an fp8 tile is compiled where it is the stage's D, a TileStore of an element-mode stage "
                "or a half-width tile of a paired stage"
            ]
            if is_fp8(store.dtype)
            else [],
            help=[f"annotate it, e.g. `{store.name}: bf16 = ...`"],
        )


def check_eqn(ctx: StageContext, e: Eqn) -> None:
    """Can the emitter write this (live, non-reducing) equation?"""
    od = REGISTRY[e.op]
    for a in e.ins:
        if isinstance(a, DimRef) and a.dim.name is None:  # (the checker folds constant extents)
            raise fail("E0703", f"the extent `{a.dim}` is used as a value inside a stage", e.span)
    if od.lower.cute is None and not (
        ctx.emulated and (od.lower.torch is not None or od.locality is Locality.INDEX)
    ):
        raise fail("E0703", f"`{od.surface}` has no CuTeDSL emitter yet", e.span)
    for v in e.outs:
        t = v.type
        if t is None:
            continue
        if t.dtype == "i32" and not ctx.emulated:
            raise fail(
                "E0702",
                f"`{v.name}` is i32: integer arithmetic inside an epilogue is not supported yet",
                e.span,
            )


# -- reductions (sinks.py) --------------------------------------------------------------------------


def check_reduced(e: Eqn, x: Atom) -> None:
    """A reduction (partial or grouped) reduces a value, not a constant."""
    if not isinstance(x, Var):
        raise fail("E0705", f"`{REGISTRY[e.op].surface}()` of a constant", e.span)


def check_sink(
    ctx: StageContext, e: Eqn, x: Var, xt: Type | None, per_row: bool, wide: bool, paired: bool
) -> None:
    """A partial reduction read after the stage has a quack sink: its combine record names one, and
    the sink folds this value the way it is reduced (`per_row`: over the columns; `wide`: a
    double-width value of a packed stage); check_vec_reduce adds the add and max sinks' own check."""
    od = REGISTRY[e.op]
    if xt is not None and xt.kind == GROUP:
        raise fail(
            "E0705",
            f"`{od.surface}()` of the grouped value `{x.name}` over its groups is not compiled yet",
            e.span,
            notes=[
                "quack's grouped statistics stay inside the kernel; reduce the tile the groups came "
                "from instead"
            ],
        )
    rec = od.combine
    assert rec is not None  # a reduction without a combine record does not check
    if rec.sink is None:
        raise fail(
            "E0705",
            f"`{od.surface}()` has no epilogue sink (its combine record names none)",
            e.span,
            notes=["quack's epilogue reductions fold by add or max, and log-sum-exp along the columns"],
        )
    if wide and (rec.sink not in ("add", "max") or not per_row):
        what = f"{od.surface}() over the rows" if not per_row else f"{od.surface}()"
        raise fail(
            "E0705",
            f"{what} of the double-width tile `{x.name}` is not compiled yet",
            e.span,
            notes=[
                "in packed mode a double-width value is two lanes per accumulator element; "
                "sum(), max() and min() over its columns fold the lanes first"
            ],
        )
    if od.locality is Locality.GATHER:  # quack's ColVecSelect
        if not per_row or not isinstance(e.ins[1], Var):
            raise fail("E0705", "pick() with one index per column is not compiled yet", e.span)
        if paired:
            raise fail("E0705", "pick() in a paired stage is not compiled yet", e.span)
    elif rec.sink == "lse":
        if paired:
            raise fail("E0705", "logsumexp() in a paired stage is not compiled yet", e.span)
        if not per_row:  # quack's online log-sum-exp folds along the columns only
            raise fail(
                "E0705",
                "logsumexp() over the rows is not compiled yet",
                e.span,
                notes=[
                    "quack's OnlineLSEReduce folds a row's columns; a column's rows would "
                    "need an online (max, sum) pair carried through RowVecReduce's exchange"
                ],
            )


def check_vec_reduce(e: Eqn, x: Var, per_row: bool, half: bool) -> None:
    """A ColVecReduce / RowVecReduce folds a half-width value of a paired stage over its columns only."""
    if not per_row and half:
        raise fail(
            "E0705",
            f"a reduction over the rows of the half-width tile `{x.name}` is not compiled yet",
            e.span,
        )


def check_pick_indices(ctx: StageContext, index_uses: dict[str, int], uses: dict[str, int]) -> None:
    """A pick()'s index is read by quack's ColVecSelect only: the stage uses it for nothing else."""
    for n, k in index_uses.items():
        if uses.get(n, 0) != k:
            e = next(e for e in ctx.st.body if any(isinstance(a, Var) and a.name == n for a in e.ins))
            raise fail(
                "E0705",
                f"the pick() index `{n}` is also used as a value",
                e.span,
                notes=["quack's ColVecSelect reads its index itself; the epilogue can't also see it"],
            )


def check_stored_group(v: Var, e: Eqn, grouped: dict[str, Eqn]) -> None:
    """A grouped value used after the stage is a grouped reduction (its writer stores it)."""
    if v.name not in grouped:
        raise fail(
            "E0705",
            f"`{v.name}`, computed from a grouped reduction, is used after the stage: not compiled yet",
            e.span,
            notes=[
                "the kernel can store a grouped reduction itself (one value per row and "
                "group), not values computed from it"
            ],
            help=["use the grouped reduction after the stage, or recompute from it there"],
        )


def check_row_group_sink(e: Eqn, sink: str, wide: bool) -> None:
    """A stored group of rows is a RowVecReduce folding by add or max (sum, max, min): not a
    log-sum-exp, and not of a double-width value (packed mode)."""
    if sink not in SINK_COMBINES or wide:
        raise fail(
            "E0705",
            f"`{e.outs[0].name}` reduces runs of rows with `{REGISTRY[e.op].surface}()`"
            + (" of a double-width value (packed mode)" if wide else "")
            + ": not compiled yet",
            e.span,
            notes=["a stored group of rows compiles as a sum, max or min of a tile as wide as the stage"],
        )


def check_group(ctx: StageContext, e: Eqn, packed: bool) -> None:
    """A grouped reduction quack's prepass folds: outside packed mode, of a full-width tile, over
    groups of 8, 16 or a multiple of 32 columns."""
    od = REGISTRY[e.op]
    x = e.ins[0]
    out = e.outs[0].type
    if out is not None and out.group_axis == 0:
        raise fail(
            "E0705",
            f"`{e.outs[0].name}` reduces runs of {out.group} rows (a 128x1 group) and is read in its "
            "stage: not compiled yet",
            e.span,
            notes=[
                "quack's grouped statistics fold runs of columns in the prepass; runs of rows would "
                "fold across the warps that hold a column before the stage's stores (the interpreter "
                "runs it)",
                "a group of rows the stage only stores compiles: one tile's column partial",
            ],
            help=["store the group's value and use it after the stage"],
        )
    if packed:
        raise fail(
            "E0705",
            "a grouped reduction in a stage that works on double-width tiles (packed mode) is not "
            "compiled yet",
            e.span,
            notes=['quack: "prepass + packed C: not supported"'],
        )
    if not isinstance(x, Var):
        raise fail("E0705", f"grouped `{od.surface}()` of a constant", e.span)
    xt = x.type if x.type is not None else ctx.types.get(x.name)
    if xt is None or xt.kind not in (TILE, MATRIX) or len(xt.shape) != 2 or xt.shape[1] != ctx.cols:
        raise fail(
            "E0705",
            f"a grouped reduction of `{x.name}`, which is not a tile as wide as the stage's "
            f"({shape_str((ctx.rows, ctx.cols))}), is not compiled yet",
            e.span,
            notes=["quack's prepass sees the accumulator one element at a time, not in pairs"],
        )
    group = e.param("group")
    assert isinstance(group, int)
    if group % 32 and group not in (8, 16):
        raise fail(
            "E0705",
            f"grouped reduction over groups of {group} columns: not compiled",
            e.span,
            notes=[
                "quack's grouped statistics fold each thread's runs of 8 adjacent accumulator "
                "columns, and the groups must nest with the epilogue's subtiles of 32 columns "
                "(SM90): groups of 8, 16 or a multiple of 32 compile"
            ],
        )


def check_group_prepass(ctx: StageContext, e: Eqn, prepass: list[Eqn], grouped: dict[str, Eqn]) -> None:
    """What a grouped reduction reduces is computed in the one prepass over the accumulator (no tile
    loads, no other grouped reduction, no pairs), and its combine record has a fold there."""
    (v,) = e.outs
    tiles = {ld.name for ld in ctx.sp.loads if ld.role == "tile"}
    for p in prepass + [e]:
        for a in p.ins:
            if isinstance(a, Var) and a.name in tiles:
                raise fail(
                    "E0705",
                    f"the grouped reduction `{v.name}` reduces a value that reads the tile `{a.name}`: "
                    "not compiled yet",
                    e.span,
                    notes=[
                        "quack's prepass runs over the accumulator before the epilogue's tile "
                        "loads arrive; it can read acc, vectors and scalars"
                    ],
                )
            if isinstance(a, Var) and a.name in grouped:
                raise fail(
                    "E0705",
                    f"the grouped reduction `{v.name}` reduces a value computed from the "
                    f"grouped reduction `{a.name}` of the same stage: not compiled yet",
                    e.span,
                    notes=["the epilogue has one prepass over the accumulator; this would need a second one"],
                )
        if REGISTRY[p.op].locality is Locality.PAIR:
            raise fail(
                "E0705",
                f"the grouped reduction `{v.name}` reduces a value computed with "
                f"`{REGISTRY[p.op].surface}()`: not compiled yet",
                e.span,
                notes=["quack's prepass sees the accumulator one element at a time, not in pairs"],
            )
    od = REGISTRY[e.op]
    if od.combine is None or od.combine.group is None:
        raise fail("E0705", f"grouped `{od.surface}()` has no fold in the epilogue's prepass", e.span)


# -- loads (operands.py) ----------------------------------------------------------------------------


def check_index_mode(ctx: StageContext, e: Eqn, mode: Mode) -> None:
    """row_index() / col_index() have an emitter in element-mode stages only (the torch stand-ins
    compute them anywhere)."""
    if mode != "element" and not ctx.emulated:
        raise fail(
            "E0703",
            f"`{e.op}()` in a stage of mode {mode} has no CuTeDSL emitter yet",
            e.span,
            notes=[
                "the kernel gives row_index()/col_index() to element-mode stages (no pairs(), no "
                "double-width tiles)"
            ],
        )


def check_repeat(e: Eqn, i: int, width: Dim, other: Dim) -> None:
    """The vectors over one dim repeat to one width per stage (`other`: the width met first)."""
    if other != width:
        a = e.ins[i]
        raise fail(
            "E0704",
            f"`{getattr(a, 'name', a)}` repeats across `{width}` columns here and across "
            f"`{other}` columns elsewhere in the stage",
            e.span,
            notes=[
                "the kernel reads a vector over a fixed dim repeated to one width per stage "
                "(the runtime repeats it before the launch)"
            ],
        )


def check_operand_dtype(ctx: StageContext, ld: Load, e: Eqn, compared: bool) -> None:
    """The epilogue loads float values (fp8 ones as tiles only), and i32 vectors that are only
    compared (`compared`)."""
    if ld.role != "tile":
        check_fp8(ctx, ld.name, ld.dtype, e.span, f"loaded {ld.role}")
    if ld.dtype not in FLOAT_DTYPES and not is_fp8(ld.dtype) and not ctx.emulated and not compared:
        raise fail(
            "E0702",
            f"`{ld.name}` is {ld.dtype}: integer operands of the epilogue are not supported yet",
            e.span,
            notes=["an i32 row or column vector that is only compared (==, <, ...) is supported"],
        )


def check_packed_tile(ctx: StageContext, ld: Load, e: Eqn, operands: Sequence[Operand]) -> None:
    """Packed mode loads one double-width tile (the GEMM's C), of 16-bit pairs."""
    if any(o.op == "C" for o in operands):
        raise fail(
            "E0704",
            f"`{ld.name}` is a second double-width tile load",
            e.span,
            notes=["quack's packed_cd_b16x2 mode loads one double-width tile (the GEMM's C)"],
        )
    if ld.dtype not in PACKED_DTYPES and not ctx.emulated and not (is_fp8(ld.dtype) and fp8_pair_load_on()):
        raise fail(
            "E0702",
            f"the double-width tile `{ld.name}` is {ld.dtype}; quack's packed mode loads 16-bit pairs",
            e.span,
            notes=[
                "$CODA_FP8_PAIR_LOAD=0 is set; without it an fp8 one loads beside an fp8 D stored as pairs"
            ]
            if is_fp8(ld.dtype)
            else [],
        )


def check_fp8_pair_load(ctx: StageContext, c: Operand, d: Output | None) -> None:
    """A packed stage's double-width fp8 tile loads as int16 words of two codes only where its D is an
    fp8 tile stored as pairs too: the stage then runs in quack's element mode, every tile [M, N]."""
    if d is not None and is_fp8(d.dtype) and pair_store_on():
        return
    e = next((e for e in ctx.st.body if any(isinstance(a, Var) and a.name == c.name for a in e.ins)), None)
    raise fail(
        "E0702",
        f"the double-width tile `{c.name}` is {c.dtype}; a packed stage loads it in fp8 only beside an fp8 "
        "D stored as pairs",
        e.span if e is not None else ctx.st.span,
        help=["store the stage's double-width result in fp8 too, or load the tile as bf16"],
    )


def check_operand_width(ctx: StageContext, ld: Load, e: Eqn, width: Dim | None, period: Dim | None) -> None:
    """A tile or column vector is loaded at the stage's width (`width`: the one it is loaded at,
    `period`: its own, where it repeats to `width`)."""
    if width is not None and width != ctx.cols:
        shown = f"{ld.dtype}{shape_str(ld.shape)}"
        if period is not None:
            shown += f", repeated to `{width}` columns"
        raise fail(
            "E0704",
            f"`{ld.name}` ({shown}) is not as wide as the stage's tile ({shape_str((ctx.rows, ctx.cols))})",
            e.span,
            notes=[
                "quack loads tiles at the GEMM's width (column vectors too, except one value "
                "per column pair in a paired stage); other widths are not supported yet"
            ],
        )
