"""Running a block in row chunks: rows [i:i+c] of every row-indexed input at a time, results joined.

What it does: `chunk_plan(block, dim)` decides whether a block (a derived backward, typically) can run
in chunks of rows of `dim` and how: every parameter is indexed by `dim` on its first axis (it is sliced)
or not at all (passed whole); every stage either runs over rows of `dim` (a GEMM whose free row dim is
`dim`, or an elementwise stage over `[dim, N]`), or reduces over them as a wgrad GEMM
(`transpose(X) @ dY`, K = `dim`, whose epilogue only names `acc`), or never sees `dim`; every
reduction over `dim` (a column partial in a stage, or a vector reduction between stages) is a sum; a
value summed over `dim` is only copied or returned, never read by a later computation; nothing reads
the size of `dim` as a value, `row_index()`, or picks rows by a column index. Otherwise it raises
CodaError E0809 saying which stage or value is in the way. Outputs indexed by `dim` are concatenated;
outputs summed over `dim` are accumulated: the plan's `block` is the same block with those outputs
stored in f32 (float64 in the f64 precision), added chunk by chunk and rounded once, at the end, to
their declared dtype, so a chunked run equals the unchunked one up to the order of f32 summation.
`chunk_size` validates `chunk=` and `budget=` and picks the chunk: `budget // bytes_per_row` for
"auto", where bytes_per_row is that of the largest tile the block stores for a later stage only (a
transient such as dlogits: bf16[M, V] is 2*V bytes per row). `run_chunks` runs any runtime (the
interpreter's, the CUDA block's) chunk by chunk with the joins given as callables.
What it does not: run stages itself, or change the numerics of a row (each row's computation is the
same chunked or not).
Invariants: a plan's block checks (it is loaded from printed source) and has the same parameters,
outputs and stages as the block it came from, only some outputs wider.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from coda_lang.interp.inputs import extent, fail
from coda_lang.ir.nodes import Block, DimRef, Eqn, Stage, Var
from coda_lang.ir.printer import print_block
from coda_lang.ir.types import TILE, Dim, Type, shape_str
from coda_lang.ops import REGISTRY
from coda_lang.verify.diagnostics import CodaError

CHUNK_CODE = "E0809"
DEFAULT_BUDGET = 256 * 2**20  # bytes of the largest transient of one chunk, for chunk="auto"
ROW_ALIGN = 128  # an automatic chunk of at least this many rows is a multiple of it (a kernel's tile_M)
DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4}

ROW, SUM, CONST = "row", "sum", "const"


@dataclass(frozen=True)
class ChunkPlan:
    dim: str  # the dim whose rows are chunked
    rows: frozenset[str]  # parameters sliced by rows
    concat: tuple[str, ...]  # outputs indexed by rows: concatenated
    summed: dict[str, str]  # outputs summed over the rows -> their declared dtype: accumulated
    whole: tuple[str, ...]  # outputs that do not depend on the rows: taken from the first chunk
    block: Any  # the api.Block each chunk runs (summed outputs stored wide)
    transients: tuple[tuple[str, Dim, str], ...]  # (name, width, dtype) of tiles stored for later stages

    def bytes_per_row(self, sizes: dict[str, int]) -> int:
        """Bytes per row of the largest transient tile (0 when the block stores none)."""
        return max(
            (int(extent(w, sizes)) * DTYPE_BYTES.get(dt, 4) for _, w, dt in self.transients), default=0
        )


def refuse(msg: str, notes: list[str] | None = None) -> CodaError:
    return fail(
        CHUNK_CODE,
        msg,
        notes=notes
        or [
            "a chunked run needs every stage to run over rows of the chunked dim or to sum over them "
            "(docs/design.md, 'Chunked backward')"
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


def chunk_plan(blk: Any, dim: str) -> ChunkPlan:
    """How `blk` (an api.Block) runs in row chunks of `dim`; CodaError E0809 where it can't."""
    ir: Block = blk.ir
    name = ir.name
    if dim not in {d.name for d in ir.dims}:
        raise refuse(f"block {name} has no dim `{dim}` to run in row chunks")
    kind: dict[str, str] = {}

    def row_shape(what: str, t: Type) -> str:
        axes = [i for i, d in enumerate(t.shape) if _is(d, dim)]
        if not axes:
            return CONST
        if axes == [0] and t.shape[0].coeff == 1:
            return ROW
        raise refuse(f"{what} is {shape_str(t.shape)}: only its first axis may be `{dim}` in a chunked run")

    params = {p.var.name for p in ir.params}
    for p in ir.params:
        kind[p.var.name] = row_shape(f"parameter `{p.var.name}` of block {name}", _ty(p.var))

    def read(a: Any, by: str) -> str:
        if isinstance(a, DimRef) and _is(a.dim, dim):
            raise refuse(f"{by} reads the size of `{dim}` as a value, which a chunk does not have")
        if not isinstance(a, Var):
            return CONST
        k = kind.get(a.name, CONST)
        if k == SUM:
            raise refuse(
                f"`{a.name}` sums over `{dim}` and is read by {by}: it is complete only after the last chunk",
                notes=["a value summed over the chunked dim may only be copied or returned"],
            )
        return k

    def sums_over(e: Eqn) -> bool:
        over = e.param("over")
        return REGISTRY[e.op].locality == "reduce" and isinstance(over, Dim) and _is(over, dim)

    def derived(v: Var, ks: list[str], by: str) -> str:
        t = _ty(v)
        if any(_is(d, dim) for d in t.shape):
            return ROW
        if all(k == CONST for k in ks):
            return CONST
        raise refuse(f"`{v.name}` {by} depends on the rows of `{dim}` but is not indexed by them")

    transients: list[tuple[str, Dim, str]] = []
    outputs = {o.name for o in ir.outputs}
    idx = 0
    for s in ir.body:
        if not isinstance(s, Stage):  # between stages: vectors and scalars (and matrix aliases)
            by = f"`{s.outs[0].name}` between stages"
            if s.op == "copy" and isinstance(s.ins[0], Var) and kind.get(s.ins[0].name) == SUM:
                kind[s.outs[0].name] = SUM
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
        if _is(cols, dim):
            raise refuse(f"stage {idx} of block {name} has `{dim}` as its columns; a chunk splits rows only")
        if kdim is not None and _is(kdim, dim):  # a wgrad GEMM, transpose(X) @ dY: it sums over the rows
            if _is(rows, dim):
                raise refuse(f"stage {idx} of block {name} has `{dim}` both as its rows and as its K")
            for e in s.body:
                src = e.ins[0] if e.ins else None
                if not (
                    e.op == "copy"
                    and isinstance(src, Var)
                    and (src.name == "acc" or kind.get(src.name) == SUM)
                ):
                    raise refuse(
                        f"`{e.outs[0].name}` {where} is computed from an accumulator that sums over `{dim}` "
                        "(K): only `name = acc` can be summed across chunks"
                    )
                kind[e.outs[0].name] = SUM
            continue
        row_stage = _is(rows, dim)
        if s.is_gemm:
            ka, kb = read(s.a, f"stage {idx} of block {name}"), read(s.b, f"stage {idx} of block {name}")
            if kb != CONST or (ka == ROW) != row_stage:
                raise refuse(f"stage {idx} of block {name} does not run over rows of `{dim}`")
        stores = {st.name: st for st in blk.plan.stages[idx - 1].stores}
        for e in s.body:
            by = f"`{e.outs[0].name}` {where}"
            ks = [ROW if isinstance(a, Var) and a.name == "acc" else read(a, by) for a in e.ins]
            op = REGISTRY[e.op]
            if row_stage and op.name == "row_index":
                raise refuse(f"{by} reads row_index(): the rows of a chunk are numbered from 0")
            if row_stage and op.locality == "gather" and not _is(_ty(e.ins[1]).shape[0], dim):
                raise refuse(f"{by} picks rows of `{dim}` by a column index")
            if row_stage and sums_over(e):
                if not _is_sum(e) or e.param("group") is not None:
                    raise refuse(f"{by} is a {_surface(e)} over `{dim}`: only sums combine across chunks")
                kind[e.outs[0].name] = SUM
                continue
            for v in e.outs:
                kind[v.name] = ROW if row_stage and _ty(v).kind == TILE else derived(v, ks, where)
                if row_stage and v.name in stores and v.name not in outputs:
                    st = stores[v.name]
                    transients.append((v.name, st.shape[1], st.dtype))
    concat, whole, summed = [], [], {}
    for o in ir.outputs:
        k = kind.get(o.name, CONST)
        if k == ROW:
            row_shape(f"output `{o.name}` of block {name}", o.type)
            concat.append(o.name)
        elif k == SUM:
            summed[o.name] = o.type.dtype
        else:
            whole.append(o.name)
    return ChunkPlan(
        dim,
        frozenset(n for n in params if kind[n] == ROW),
        tuple(concat),
        summed,
        tuple(whole),
        _widened(ir, {n for n, k in kind.items() if k == SUM}, set(summed)),
        tuple(transients),
    )


def _widened(ir: Block, sums: set[str], summed_outputs: set[str]) -> Any:
    """`ir` with its values summed over the chunked dim stored in f32 (outputs declared f32): each
    chunk's part is accumulated unrounded."""
    from coda_lang.api import load

    def wide(v: Var) -> Var:
        if v.name not in sums:
            return v
        if v.annot in ("bf16", "f16") or (v.annot is None and v.name not in summed_outputs):
            return replace(v, annot="f32")
        return v

    body: list[Any] = []
    for s in ir.body:
        if isinstance(s, Stage):
            body.append(replace(s, body=tuple(replace(e, outs=tuple(map(wide, e.outs))) for e in s.body)))
        else:
            body.append(replace(s, outs=tuple(map(wide, s.outs))))
    outs = tuple(
        replace(o, type=replace(o.type, dtype="f32"))
        if o.name in summed_outputs and o.type.dtype in ("bf16", "f16")
        else o
        for o in ir.outputs
    )
    wide_ir = replace(ir, body=tuple(body), outputs=outs)
    return load(print_block(wide_ir))[ir.name]


def chunk_size(
    plan: ChunkPlan | None, rows: int, sizes: dict[str, int], chunk: Any, budget: Any
) -> int | None:
    """The rows per chunk of a run over `rows` rows (None: unchunked). `chunk`: None, "auto" or a
    positive int; `budget`: bytes (a positive int) for "auto" (default DEFAULT_BUDGET), which `chunk=None`
    with a budget means too. "auto" takes budget // bytes_per_row rows, a multiple of ROW_ALIGN when
    that is at least ROW_ALIGN, at least 1; every chunk is at most `rows`."""
    check_chunk_args(chunk, budget)
    if chunk is None and budget is None:
        return None
    if chunk is None or chunk == "auto":
        assert plan is not None
        per_row = plan.bytes_per_row(sizes)
        if per_row == 0:
            return rows
        c = int(budget if budget is not None else DEFAULT_BUDGET) // per_row
        if c >= ROW_ALIGN:
            c -= c % ROW_ALIGN
        return max(1, min(c, rows))
    return min(int(chunk), rows)


def check_chunk_args(chunk: Any, budget: Any) -> None:
    """E0809 naming `chunk=` or `budget=` when either is not what a chunked run takes."""
    if chunk is not None and chunk != "auto":
        if isinstance(chunk, bool) or not isinstance(chunk, int) and not _np_int(chunk):
            raise refuse(
                f'chunk= is {chunk!r}; it takes None (no chunks), "auto" (from budget=) or a number of rows',
                notes=["chunk=1024 runs the backward 1024 rows at a time"],
            )
        if int(chunk) < 1:
            raise refuse(
                f"chunk= is {chunk}; a chunk holds at least 1 row", notes=["chunk=None runs unchunked"]
            )
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, int) and not _np_int(budget):
            raise refuse(
                f"budget= is {budget!r}; it takes a number of bytes (an int)",
                notes=["budget=2**28 bounds the largest transient of a chunk to 256 MiB"],
            )
        if int(budget) < 1:
            raise refuse(f"budget= is {budget}; it must be a positive number of bytes")
        if chunk is not None and chunk != "auto":
            raise refuse(
                f'chunk={chunk} and budget={budget} both given; budget= picks the chunk only with chunk="auto"'
            )


def _np_int(x: Any) -> bool:
    import numpy as np

    return isinstance(x, np.integer)


def row_dim(forward: Block) -> str | None:
    """The dim of the token rows of a forward block: the rows of its first stage."""
    for s in forward.stages:
        if s.is_gemm and s.acc is not None and s.acc.type is not None:
            return s.acc.type.shape[0].name
        if s.shape is not None:
            return s.shape[0].name
    return None


def run_chunks(
    plan: ChunkPlan,
    inputs: dict[str, Any],
    rows: int,
    chunk: int,
    run: Callable[[dict[str, Any], int], dict[str, Any]],
    cat: Callable[[list[Any]], Any],
    add: Callable[[Any, Any], Any],
    finish: Callable[[Any, str], Any],
) -> dict[str, Any]:
    """Outputs of `plan.block` run chunk by chunk: `run(inputs of the chunk, its rows)` gives a chunk's
    outputs; row outputs are joined by `cat`, summed ones by `add` and then `finish(total, dtype)`
    (rounding once to the declared dtype), the others are the first chunk's."""
    parts: dict[str, list[Any]] = {n: [] for n in plan.concat}
    totals: dict[str, Any] = {}
    whole: dict[str, Any] = {}
    for i in range(0, rows, chunk):
        j = min(i + chunk, rows)
        sub = {n: (v[i:j] if n in plan.rows else v) for n, v in inputs.items()}
        outs = run(sub, j - i)
        for n in plan.concat:
            parts[n].append(outs[n])
        for n in plan.summed:
            totals[n] = outs[n] if n not in totals else add(totals[n], outs[n])
        if i == 0:
            whole = {n: outs[n] for n in plan.whole}
    return {
        **{n: cat(p) for n, p in parts.items()},
        **{n: finish(t, plan.summed[n]) for n, t in totals.items()},
        **whole,
    }
