"""Running a block in chunks of one dim: [i:i+c] of that dim of every input indexed by it, results joined.

What it does: `chunk_plan(block, dim)` decides whether a block (a derived backward, typically) can run
in chunks of `dim` (the rows of M, or the columns of a vocabulary V) and how: every parameter is
indexed by `dim` on one axis (it is sliced on that axis) or not at all (passed whole); every stage
runs with `dim` as its free row dim, as its free column dim (N), as its K (a GEMM whose output sums
over `dim`, such as the wgrad `transpose(X) @ dY` of a row chunk or the dgrad `dY @ transpose(W)` of a
column chunk; its epilogue only names `acc`), or never sees `dim`; every reduction over `dim` (a
partial of a stage, or a vector reduction between stages) is a sum, and so is a `pick` along `dim`;
a value summed over `dim` is only copied, folded (`fold`, linear) or returned, never read by a later
computation; no vector repeats across columns of `dim` (they would count from the chunk's start). The chunk's
own index, `row_index()` in a stage whose rows are `dim` or `col_index()` in one whose columns are,
counts from 0 in a chunk: it may only be compared with a parameter (the cross-entropy backward's
`col_index() == target`), which the chunk then receives shifted by its start (`target - v0`: a fresh
parameter, `target_at_V`, holds it, so other uses of `target` still see it whole); a `pick` along
`dim` gets its index shifted the same way. A block that reads the size of `dim` as a value
(`dmlogit / V`) still reads the whole extent: its chunk extent is then a dim of its own (`Vc`).
Otherwise it raises CodaError E0809 saying which stage or value is in the way. Outputs indexed by
`dim` are joined along their axis (written into one preallocated output); outputs summed over `dim`
are accumulated: the plan's `block` is the same block with those outputs stored in f32 (float64 in
the f64 precision), added chunk by chunk and rounded once, at the end, to their declared dtype, so a
chunked run equals the unchunked one up to the order of f32 summation.
`candidate_plans` lists the plans a run may take under a `BackwardOptions` (the given `chunk_dim`,
the forward's row dim for a number of rows, every chunkable dim for "auto") and `choose` picks the one
whose run holds the least memory (`ChunkPlan.memory`: f32 accumulators, transients, a chunk's parts
of the joined outputs). `chunk_size` picks the chunk: `budget // bytes_per_row` for "auto", where
bytes_per_row is the bytes per element of `dim` of the largest tile the block stores for a later
stage only (a transient such as dlogits: bf16[M, V] is 2*V bytes per row of M, 2*M per column of V).
What it does not: rewrite the block (chunk_rewrite.py makes the plan's blocks), run chunks
(chunk_run.py), check the options (options.py), or change the numerics of an element (each
element's computation is the same chunked or not).
Invariants: a plan's blocks check and have the parameters, outputs and stages of the block they came
from, some outputs wider, plus the shifted parameters and a dim for the chunk's extent where they
need them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from coda_lang.autodiff.chunk_rewrite import widen
from coda_lang.autodiff.options import DEFAULT_BUDGET, BackwardOptions
from coda_lang.core.diagnostics import CodaError, error
from coda_lang.frontend.source import CheckedBlock
from coda_lang.frontend.verify.repeat import repeat_uses
from coda_lang.ir.nodes import Block, DimRef, Eqn, Stage, Var
from coda_lang.ir.types import TILE, Dim, Shape, Type, extent, shape_str
from coda_lang.ops import REGISTRY
from coda_lang.ops.registry import Locality

CHUNK_CODE = "E0809"
ROW_ALIGN = 128  # an automatic chunk of at least this many rows is a multiple of it (a kernel's tile_M)
COL_ALIGN = 8  # an automatic chunk of a matrix's last axis is a multiple of it (16-byte rows for TMA)
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "e4m3": 1, "e5m2": 1, "i32": 4}

IDX, SUM, CONST, INDEX = "indexed", "sum", "const", "index"  # what a value is to a chunk


@dataclass(frozen=True)
class ChunkPlan:
    dim: str  # the chunked dim
    inner: str  # the dim of a chunk's extent in `block`: `dim`, unless the block reads dim's size
    sliced: dict[str, int]  # parameters indexed by `dim` -> the axis they are sliced on
    joined: dict[str, int]  # outputs indexed by `dim` -> the axis their chunks' parts are joined on
    summed: dict[str, str]  # outputs summed over `dim` -> their declared dtype: accumulated
    whole: tuple[str, ...]  # outputs that do not depend on the chunk: taken from the first chunk
    shifted: dict[str, tuple[str, Any]]  # parameter of `block` -> (the parameter it is, its default)
    # minus the chunk's start: an index compared with the chunk's row_index()/col_index(), or picked
    block: CheckedBlock  # the block each chunk runs (summed outputs stored wide)
    transients: tuple[tuple[str, Dim, str], ...]  # (name, other axis, dtype) of tiles indexed by
    # `dim` that the block stores for its later stages only
    fixed: tuple[tuple[str, Shape, str], ...]  # (name, shape, dtype) of such tiles not indexed by `dim`
    shapes: dict[str, tuple[Shape, str]]  # each output's declared shape and dtype
    align: int = 1  # COL_ALIGN when `dim` is the last axis of a matrix the block loads or stores
    # summed outputs that a GEMM over the chunked dim stores as they are (`dw = acc`: a weight
    # gradient of a row chunk) -> the parameter of `acc_block` that holds their running total
    accumulate: dict[str, str] = field(default_factory=dict)
    # `block` with each of `accumulate` stored as `acc + total` (its running total, f32, as an input of
    # the same shape): a chunk after the first adds its part inside the GEMM's epilogue, and a runtime
    # that can store a tile over the input it reads (CudaBlock) makes no part and no separate sum
    acc_block: CheckedBlock | None = None

    @property
    def rows(self) -> frozenset[str]:
        """The parameters sliced (the name is from the row chunks, the first kind)."""
        return frozenset(self.sliced)

    @property
    def concat(self) -> tuple[str, ...]:
        """The joined outputs."""
        return tuple(self.joined)

    def bytes_per_row(self, sizes: dict[str, int]) -> int:
        """Bytes per element of `dim` (a row of M, a column of V) of the largest transient tile indexed
        by it (0 when the block stores none)."""
        return max(
            (int(extent(w, sizes)) * DTYPE_BYTES.get(dt, 4) for _, w, dt in self.transients), default=0
        )

    def memory(self, sizes: dict[str, int], chunk: int) -> int:
        """Bytes a run in chunks of `chunk` holds beyond the block's (unchunked) outputs: each summed
        output's f32 accumulator and one chunk's f32 part of it (none for those of `accumulate`, which
        the kernels add up in place), every transient tile (those indexed
        by `dim` at the chunk's extent), and one chunk's part of each joined output."""
        at = {**sizes, self.dim: chunk}

        def numel(shape: Shape, s: dict[str, int]) -> int:
            n = 1
            for d in shape:
                n *= int(extent(d, s))
            return n

        acc = sum(
            (1 if n in self.accumulate else 2) * 4 * numel(self.shapes[n][0], sizes) for n in self.summed
        )
        trans = sum(chunk * int(extent(w, sizes)) * DTYPE_BYTES.get(dt, 4) for _, w, dt in self.transients)
        trans += sum(numel(sh, sizes) * DTYPE_BYTES.get(dt, 4) for _, sh, dt in self.fixed)
        parts = sum(numel(self.shapes[n][0], at) * DTYPE_BYTES.get(self.shapes[n][1], 4) for n in self.joined)
        return acc + trans + parts


def refuse(msg: str, notes: list[str] | None = None) -> CodaError:
    return error(
        CHUNK_CODE,
        msg,
        notes=notes
        or [
            "a chunked run needs every stage to run over the chunked dim (as its rows or columns) or to "
            "sum over it (docs/design.md, 'Chunked backward')"
        ],
    )


def _is(d: Dim, dim: str) -> bool:
    return d.name == dim


def _is_sum(e: Eqn) -> bool:
    c = REGISTRY[e.op].combine
    return c is not None and c.name == "sum"


def _surface(e: Eqn) -> str:
    return REGISTRY[e.op].surface


def _ty(v: Any) -> Type:
    assert isinstance(v, Var) and v.type is not None
    return v.type


def chunk_plan(blk: CheckedBlock, dim: str) -> ChunkPlan:
    """How `blk` runs in chunks of `dim`; CodaError E0809 where it can't."""
    ir: Block = blk.ir
    name = ir.name
    if dim not in {d.name for d in ir.dims}:
        raise refuse(f"block {name} has no dim `{dim}` to run in chunks")
    kind: dict[str, str] = {}

    def axis_of(what: str, t: Type) -> int | None:
        axes = [i for i, d in enumerate(t.shape) if _is(d, dim)]
        if not axes:
            return None
        if len(axes) > 1:
            raise refuse(
                f"{what} is {shape_str(t.shape)}: only one of its axes may be `{dim}` in a chunked run"
            )
        if t.shape[axes[0]].coeff != 1:
            raise refuse(
                f"{what} is {shape_str(t.shape)}: a chunk of `{dim}` can't split `{t.shape[axes[0]]}`"
            )
        return axes[0]

    params = {p.var.name: p for p in ir.params}
    sliced: dict[str, int] = {}
    for p in ir.params:
        ax = axis_of(f"parameter `{p.var.name}` of block {name}", _ty(p.var))
        kind[p.var.name] = CONST if ax is None else IDX
        if ax is not None:
            sliced[p.var.name] = ax
    reads_size = False

    def read(a: Any, by: str) -> str:
        nonlocal reads_size
        if isinstance(a, DimRef) and _is(a.dim, dim):
            reads_size = True  # the chunked block reads the whole extent (see chunk_rewrite.widen)
            return CONST
        if not isinstance(a, Var):
            return CONST
        k = kind.get(a.name, CONST)
        if k == SUM:
            raise refuse(
                f"`{a.name}` sums over `{dim}` and is read by {by}: it is complete only after the last chunk",
                notes=["a value summed over the chunked dim may only be copied or returned"],
            )
        if k == INDEX:
            raise refuse(
                f"{by} computes with `{a.name}`, the chunk's own index, which counts from 0 in a chunk",
                notes=[
                    "only a comparison of row_index()/col_index() with a parameter can be shifted to the chunk"
                ],
            )
        return k

    def sums_over(e: Eqn) -> bool:
        over = e.param("over")
        return REGISTRY[e.op].locality is Locality.REDUCE and isinstance(over, Dim) and _is(over, dim)

    def derived(v: Var, ks: list[str], by: str) -> str:
        t = _ty(v)
        if any(_is(d, dim) for d in t.shape):
            return IDX
        if all(k == CONST for k in ks):
            return CONST
        raise refuse(f"`{v.name}` {by} depends on the chunk of `{dim}` but is not indexed by it")

    shift_of: dict[str, str] = {}  # parameter -> the shifted parameter that replaces it where patched
    taken = {d.name for d in ir.dims} | set(params) | {v.name for s in ir.body for v in _outs(s)}

    def shifted(a: Any, by: str, what: str) -> str:
        if not (isinstance(a, Var) and a.name in params and kind[a.name] == CONST):
            shown = f"`{a.name}`" if isinstance(a, Var) else "a constant"
            raise refuse(
                f"{by} {what} {shown}, which is not a parameter: a chunk can't shift it to its start",
                notes=[
                    f"in a chunk of `{dim}` the chunk's index counts from 0; a parameter compared with it is "
                    "passed shifted by the chunk's start (docs/design.md, 'Chunked backward')"
                ],
            )
        if a.name not in shift_of:
            new = f"{a.name}_at_{dim}"
            while new in taken:
                new += "_"
            taken.add(new)
            shift_of[a.name] = new
        return shift_of[a.name]

    patches: dict[tuple[int, int, int], str] = {}  # (stage, equation, operand) -> shifted parameter
    transients: list[tuple[str, Dim, str]] = []
    fixed: list[tuple[str, Shape, str]] = []
    col_stores = False  # a tile stored whose columns are the chunked dim
    stored_acc: set[str] = set()  # outputs a GEMM over the chunked dim stores as `name = acc`
    outputs = {o.name for o in ir.outputs}
    for u in repeat_uses(ir):
        if _is(u.width, dim) and not u.fold:  # (a fold of a vector over `dim` is refused below)
            where = f"stage {u.stage}" if u.stage else "between stages"
            raise refuse(
                f"`{u.name}` repeats across the columns of `{u.width}` ({where} of block {name}): in a chunk of "
                f"`{dim}` the columns count from the chunk's start",
                notes=["a vector over a fixed dim repeats from the first column of the whole matrix"],
            )
    idx = 0
    for s in ir.body:
        if not isinstance(s, Stage):  # between stages: vectors and scalars (and matrix aliases)
            by = f"`{s.outs[0].name}` between stages"
            if REGISTRY[s.op].linear and isinstance(s.ins[0], Var) and kind.get(s.ins[0].name) == SUM:
                kind[s.outs[0].name] = (
                    SUM  # a copy or a fold (linear) of a sum is the sum of the chunks' ones
                )
                continue
            ks = [read(a, by) for a in s.ins]
            if sums_over(s):
                if not _is_sum(s):
                    raise refuse(f"{by} is a {_surface(s)} over `{dim}`: only sums combine across chunks")
                kind[s.outs[0].name] = SUM
                continue
            for v in s.outs:
                kind[v.name] = derived(v, ks, "between stages")
            continue
        idx += 1
        where = f"in stage {idx} of block {name}"
        if s.is_gemm:
            assert s.acc is not None and s.acc.type is not None
            rows, cols = s.acc.type.shape
            at = _ty(s.a)
            kdim: Dim | None = at.shape[0] if s.ta else at.shape[1]
        else:
            assert s.shape is not None
            rows, cols = s.shape
            kdim = None
        axes = [("rows", rows), ("columns", cols)] + ([("K", kdim)] if kdim is not None else [])
        hits = [n for n, d in axes if _is(d, dim)]
        for n, d in axes:
            if _is(d, dim) and d.coeff != 1:
                raise refuse(
                    f"stage {idx} of block {name} has `{d}` as its {n}: a chunk of `{dim}` can't split it"
                )
        if len(hits) > 1:
            raise refuse(
                f"stage {idx} of block {name} has `{dim}` both as its {hits[0]} and as its {hits[1]}"
            )
        role = hits[0] if hits else None
        if s.is_gemm:
            for x in s.operands:
                read(x, f"stage {idx} of block {name}")
        stores = {st.name: st for st in blk.plan.stages[idx - 1].stores}
        if role == "K":  # a GEMM summing over the chunked dim: its output accumulates across chunks
            for e in s.body:
                src = e.ins[0] if e.ins else None
                if not (
                    REGISTRY[e.op].copy
                    and isinstance(src, Var)
                    and (src.name == "acc" or kind.get(src.name) == SUM)
                ):
                    raise refuse(
                        f"`{e.outs[0].name}` {where} is computed from an accumulator that sums over `{dim}` "
                        "(K): only `name = acc` can be summed across chunks"
                    )
                kind[e.outs[0].name] = SUM
                if src.name == "acc" and e.outs[0].name in outputs:
                    stored_acc.add(e.outs[0].name)
            continue
        chunked = role is not None
        own_axis = 0 if role == "rows" else 1  # the index op counting the chunked dim
        own_index = ("row_index", "col_index")[own_axis]  # (its name, for messages)
        for j, e in enumerate(s.body):
            by = f"`{e.outs[0].name}` {where}"
            op = REGISTRY[e.op]
            if chunked and op.index_axis == own_axis:
                kind[e.outs[0].name] = INDEX
                continue
            at_index = [i for i, a in enumerate(e.ins) if isinstance(a, Var) and kind.get(a.name) == INDEX]
            if at_index and op.compares and len(at_index) == 1:
                other = 1 - at_index[0]
                patches[(idx, j, other)] = shifted(e.ins[other], by, f"compares {own_index}() with")
                v = e.outs[0]
                kind[v.name] = IDX if _ty(v).kind == TILE else derived(v, [CONST], where)
                continue
            if chunked and op.locality is Locality.GATHER and not _is(_ty(e.ins[1]).shape[0], dim):
                # a pick along the chunked dim: 0 in every chunk but the one holding the index, a sum
                read(e.ins[0], by)
                patches[(idx, j, 1)] = shifted(e.ins[1], by, f"picks along `{dim}` by")
                kind[e.outs[0].name] = SUM
                continue
            ks = [IDX if isinstance(a, Var) and a.name == "acc" else read(a, by) for a in e.ins]
            if chunked and sums_over(e):
                if not _is_sum(e) or e.param("group") is not None:
                    raise refuse(f"{by} is a {_surface(e)} over `{dim}`: only sums combine across chunks")
                kind[e.outs[0].name] = SUM
                continue
            for v in e.outs:
                kind[v.name] = IDX if chunked and _ty(v).kind == TILE else derived(v, ks, where)
                if v.name in stores and v.name not in outputs:
                    st = stores[v.name]
                    if chunked:
                        col_stores = col_stores or role == "columns"
                        other_axis = st.shape[1] if role == "rows" else st.shape[0]
                        transients.append((v.name, other_axis, st.dtype))
                    else:
                        fixed.append((v.name, st.shape, st.dtype))
    joined: dict[str, int] = {}
    whole: list[str] = []
    summed: dict[str, str] = {}
    for o in ir.outputs:
        k = kind.get(o.name, CONST)
        if k == IDX:
            ax = axis_of(f"output `{o.name}` of block {name}", o.type)
            assert ax is not None
            joined[o.name] = ax
        elif k == SUM:
            summed[o.name] = o.type.dtype
        else:
            whole.append(o.name)
    last = [_ty(p.var).shape for p in ir.params] + [o.type.shape for o in ir.outputs]
    align = COL_ALIGN if col_stores or any(len(sh) == 2 and _is(sh[1], dim) for sh in last) else 1
    inner = dim
    if reads_size:
        inner = f"{dim}c"
        while inner in taken:
            inner += "c"
    shifts = {new: (old, params[old].default) for old, new in shift_of.items()}
    sums = {n for n, k in kind.items() if k == SUM}
    wide = widen(ir, sums, set(summed), patches, shift_of, dim, inner)
    accumulate: dict[str, str] = {}
    for o in ir.outputs:
        if o.name in summed and o.name in stored_acc:
            new = f"{o.name}_total"
            while new in taken:
                new += "_"
            taken.add(new)
            accumulate[o.name] = new
    acc_block = (
        widen(ir, sums, set(summed), patches, shift_of, dim, inner, accumulate) if accumulate else None
    )
    return ChunkPlan(
        dim,
        inner,
        sliced,
        joined,
        summed,
        tuple(whole),
        shifts,
        wide,
        tuple(transients),
        tuple(fixed),
        {o.name: (o.type.shape, o.type.dtype) for o in ir.outputs},
        align,
        accumulate,
        acc_block,
    )


def _outs(s: Any) -> tuple[Var, ...]:
    if isinstance(s, Stage):
        return tuple(v for e in s.body for v in e.outs)
    return tuple(s.outs)


def chunk_size(
    plan: ChunkPlan | None, rows: int, sizes: dict[str, int], options: BackwardOptions
) -> int | None:
    """The elements of the chunked dim per chunk of a run over `rows` of them (None: unchunked).
    `options.mode`: None, "auto" or a number; for "auto", `options.budget` bytes (default
    DEFAULT_BUDGET) // bytes_per_row, a multiple of ROW_ALIGN when that is at least ROW_ALIGN, else of
    the plan's `align` (COL_ALIGN for a matrix's columns: a kernel stores rows of a multiple of 16
    bytes), at least that; every chunk is at most `rows`."""
    mode = options.mode
    if mode is None:
        return None
    if mode == "auto":
        assert plan is not None
        per_row = plan.bytes_per_row(sizes)
        if per_row == 0:
            return rows
        c = int(options.budget if options.budget is not None else DEFAULT_BUDGET) // per_row
        if c >= ROW_ALIGN:
            c -= c % ROW_ALIGN
        c -= c % plan.align
        return max(plan.align, 1, min(c, rows)) if plan.align <= rows else rows
    return min(int(mode), rows)


def row_dim(forward: Block) -> str | None:
    """The dim of the token rows of a forward block: the rows of its first stage."""
    for s in forward.stages:
        if s.is_gemm and s.acc is not None and s.acc.type is not None:
            return s.acc.type.shape[0].name
        if s.shape is not None:
            return s.shape[0].name
    return None


def candidate_plans(blk: Any, wrt: list[str] | None, options: BackwardOptions) -> list[ChunkPlan]:
    """The plans a chunked backward of `blk` (an api.Block: its `chunk_plan` and `derivation`) may
    take under `options`, the preferred first: along `options.chunk_dim` when it is given (ValueError
    when the block has no such dim; E0809 when it can't be chunked along it); along the forward's row
    dim for a number of rows; for "auto", along every dim of the backward's parameters that it can be
    chunked along (the row dim first), E0809 with the row dim's reason when there is none."""
    dims = [d.name for d in blk.ir.dims]
    remat, chunk_dim = options.remat, options.chunk_dim
    if chunk_dim is not None:
        if chunk_dim not in dims:
            raise ValueError(
                f"chunk_dim= is {chunk_dim!r}; block {blk.name} has no such dim (its dims: {', '.join(dims)})"
            )
        return [blk.chunk_plan(wrt, remat, chunk_dim)]
    if options.mode != "auto":
        return [blk.chunk_plan(wrt, remat)]
    first = row_dim(blk.ir)
    bwd = blk.derivation(wrt, remat).backward.ir
    used = [d.name for d in bwd.dims if any(_is(x, d.name) for p in bwd.params for x in _ty(p.var).shape)]
    order = ([first] if first in used else []) + [n for n in used if n != first]
    plans: list[ChunkPlan] = []
    why: list[CodaError] = []
    for n in order:
        try:
            plans.append(blk.chunk_plan(wrt, remat, n))
        except CodaError as e:
            why.append(e)  # the row dim's reason first
    if not plans:
        if not why:
            raise refuse(f"block {blk.name}'s backward has no dim to run in chunks")
        raise why[0]
    return plans


def choose(plans: list[ChunkPlan], sizes: dict[str, int], options: BackwardOptions) -> tuple[ChunkPlan, int]:
    """The plan (and its chunk) whose run holds the least memory (`ChunkPlan.memory`); the earlier on a tie."""
    best: tuple[int, ChunkPlan, int] | None = None
    for p in plans:
        c = chunk_size(p, sizes[p.dim], sizes, options)
        assert c is not None
        m = p.memory(sizes, c)
        if best is None or m < best[0]:
            best = (m, p, c)
    assert best is not None
    return best[1], best[2]
