"""A torch stand-in for one stage's quack kernel: the same arguments in, the same buffers filled.

What it does: `run_stage(spec, config, A, B, D, epi_args)` computes what the stage's kernel would
write, with torch ops on any device (CPU included): acc = A @ B in f32, the prepass (each grouped
reduction complete per row and group, bound at every element of its group as the `GroupedReduce`
value port gives it, its writer's [m, n / width] buffer filled), the live equations of the
`StageSpec` on whole matrices, the stored tiles rounded into `D` and the `TileStore` buffers, and
every sink as the kernel's per-tile partial buffer (`ColVecReduce` [m, ceil(n/tile_N)],
`RowVecReduce` [ceil(m/tile_M), n], `OnlineLSEReduce` like ColVecReduce, an fp8 tile saturated
before it is cast (as the interpreter stores it; no kernel writes fp8 yet), a min() sink as its kernel writes it: the max of the negation, -min per tile;
`ColVecSelect` the picked value per row, rows with an index outside [0, n) or a picked -inf left as
they are, as quack's select leaves them); past
the end of a sum's reduced dim, in the ragged last tile, what quack's kernel folds there: the
epilogue's value at a zero accumulator, unless the sum is `bounded` (masked). It takes the arguments exactly
as launch.py hands them to quack (a half-width column vector repeated twice, scalars as numbers
or one-element tensors), so the runtime's host logic (binding, buffers, partial combines, vector
ops, autograd, torch.compile tracing) can be tested on a machine without a GPU.
What it does not: model the kernel's arithmetic order or its fast-math functions (tests compare
both with the interpreter, each within its own tolerance); it is a test device, not a fast path.
Invariants: reads only `epi_args` and the spec; writes only the given output buffers.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import torch

from coda_lang.backend_cute.plan import spec as specs
from coda_lang.backend_cute.plan.spec import INDEX_AXIS, SCALE_BLOCK, WORD_VIEWS, Sink, StageSpec, dim_operand
from coda_lang.ir.nodes import DimRef, Eqn, Lit, Var
from coda_lang.ops import REGISTRY, Locality
from coda_lang.ops.registry import combine_of_group, combine_of_sink, torch_dtype, torch_store


def _store_into(buf: torch.Tensor, x: torch.Tensor) -> None:
    """x written into a stored tile's buffer, rounded to its dtype (an fp8 one saturating first)."""
    buf.copy_(torch_store(x, buf.dtype))


def _operand_values(spec: StageSpec, epi_args: dict[str, Any]) -> dict[str, Any]:
    vals: dict[str, Any] = {}
    for o in spec.operands:
        if o.op == "C" or o.role in INDEX_AXIS:
            continue  # not an epilogue argument (run_stage binds C), or computed there (an index)
        v = epi_args[o.py]
        if o.host in WORD_VIEWS:  # a packed stage's pairs handed over as words: the tile they are
            v = v.view(torch_dtype(o.dtype))
        if o.role in ("tile", "grouped tile"):  # (a grouped tile: repeated over its groups in run_stage)
            vals[o.name] = v.float()
        elif o.role == "row vector":
            vals[o.name] = v.float().reshape(-1, 1)
        elif o.role == "column vector":
            x = v.float().reshape(1, -1)
            vals[o.name] = x[:, 0::2] if o.host == "repeat_interleave(2)" else x
        else:
            vals[o.name] = float(v) if not isinstance(v, torch.Tensor) else v.float().reshape(())
    return vals


def _index(e: Eqn, vals: dict[str, Any], cols: Any) -> torch.Tensor:
    """`row_index()` / `col_index()` over the whole matrix (a half- or double-width value's own width)."""
    acc = vals["acc"]
    m, n = acc.shape
    if REGISTRY[e.op].index_axis == 0:
        return torch.arange(m, device=acc.device, dtype=torch.int32).reshape(-1, 1)
    t = e.outs[0].type
    width = n
    if t is not None and t.shape and cols is not None and t.shape[0] != cols:
        width = n // 2 if t.shape[0] == cols.scale(Fraction(1, 2)) else 2 * n
    return torch.arange(width, device=acc.device, dtype=torch.int32).reshape(1, -1)


def _eval(eqns: tuple[Eqn, ...], vals: dict[str, Any], cols: Any = None) -> None:
    """The equations through each op's torch stand-in (the registry's `Lowerings.torch`)."""
    for e in eqns:
        if REGISTRY[e.op].locality is Locality.INDEX:
            vals[e.outs[0].name] = _index(e, vals, cols)
            continue
        ins: list[Any] = [
            vals[a.name]
            if isinstance(a, Var)
            else a.value
            if isinstance(a, Lit)
            else vals[dim_operand(a.dim.name)] * float(a.dim.coeff)
            if isinstance(a, DimRef) and a.dim.name
            else None
            for a in e.ins
        ]
        params = {k: v for k, v in e.params if isinstance(v, (str, int, float))}
        stand_in = REGISTRY[e.op].lower.torch
        assert stand_in is not None, (
            f"`{e.op}` has no torch stand-in (the planner lets only such ops through)"
        )
        out = stand_in(*ins, **params)
        res = out if isinstance(out, tuple) else (out,)
        for v, x in zip(e.outs, res, strict=True):
            vals[v.name] = x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _groups(spec: StageSpec, vals: dict[str, Any], m: int, n: int, epi_args: dict[str, Any]) -> None:
    """The prepass: each grouped reduction folded per (row, group), bound in `vals` at every element of
    its group (what the GroupedReduce value port gives the fn); its writer's buffer filled."""
    pre = dict(vals)
    _eval(spec.prepass, pre)
    for g in spec.groups:
        if n % g.width:  # as quack's GroupedColStatsBase.host_validate
            raise ValueError(f"'{g.py}': stats group width {g.width} must divide N={n}")
        x = torch.as_tensor(pre[g.value], dtype=torch.float32).expand(m, n).reshape(m, n // g.width, g.width)
        folded = combine_of_group(g.combine).torch(x, 2)
        vals[g.name] = folded.repeat_interleave(g.width, dim=1)
        if g.out is not None:
            epi_args[g.out].copy_(folded)


NONFINITE = "\0nonfinite"  # vals' key of (rows of A, columns of B) holding an infinity or a NaN


def _padding(spec: StageSpec, s: Sink, vals: dict[str, Any], m: int, n: int) -> torch.Tensor:
    """What the kernel's epilogue computes for sink `s` past the end of its reduced dim (the columns past
    N of the ragged last column tile, or the rows past M of the last row tile), as a pattern to repeat
    there: [m, p] (p columns: 1, 2 or 4 for a half-, full- or double-width value) or [1, width]. The
    accumulator and the tiles are 0 there (TMA's out-of-bounds fill), a vector along the reduced dim
    is stale shared memory (NaN here, the worst case), a vector along the other dim, a scalar or a dim
    is its real value, a grouped value NaN. The accumulator is a row of A (a column of B) times the
    zeros of the padding: NaN where that row (column) holds an infinity or a NaN (`vals[NONFINITE]`)."""
    per_row = s.op == "ColVecReduce"
    device = vals["acc"].device

    def blank(width: int, fill: float) -> torch.Tensor:
        shape = (m, max(1, 2 * width // n)) if per_row else (1, width)
        return torch.full(shape, fill, device=device)

    pad: dict[str, Any] = {k: v for k, v in vals.items() if not isinstance(v, torch.Tensor) or v.dim() < 2}
    for o in spec.operands:
        v = vals[o.name]
        if not isinstance(v, torch.Tensor) or v.dim() < 2:
            continue
        if o.role in INDEX_AXIS:  # each element's index: along the reduced dim, the padding's own
            if INDEX_AXIS[o.role] == (1 if per_row else 0):
                # (the first indices past the end, as a pattern as wide as the others': a sink that
                # folds the padding unmasked sums a value padding.py proved 0 there, whatever the index)
                first = v.reshape(-1)[0] + (n if per_row else m)
                pad[o.name] = first + torch.arange(2 if per_row else 1, device=device).reshape(1, -1)
            else:
                pad[o.name] = v
        elif o.role == "tile" or o.op == "C":
            pad[o.name] = blank(v.shape[1], 0.0)
        elif (o.role == "column vector") == per_row:  # along the reduced dim
            pad[o.name] = blank(v.shape[1], float("nan"))
        else:
            pad[o.name] = v
    bad = vals.get(NONFINITE)
    pad["acc"] = blank(n, 0.0)
    if bad is not None:  # inf * 0 in the padding's dot products
        rows_or_cols = bad[0] if per_row else bad[1]
        lay = rows_or_cols.reshape(-1, 1) if per_row else rows_or_cols.reshape(1, -1)
        pad["acc"] = torch.where(lay, float("nan"), pad["acc"])
    for g in spec.groups:
        pad[g.name] = torch.full((1, 1), float("nan"), device=device)
    _eval(spec.eqns, pad)
    x = torch.as_tensor(pad[s.value[0]], dtype=torch.float32)
    if s.scaled:
        x = x * pad[s.value[1]]
    return x.reshape(1, 1) if x.dim() == 0 else x


def _sink(
    s: Sink,
    spec: StageSpec,
    vals: dict[str, Any],
    m: int,
    n: int,
    tile_m: int,
    tile_n: int,
    epi_args: dict[str, Any],
) -> torch.Tensor | None:
    """The partial buffer the kernel writes for sink `s` (None for ColVecSelect: written in place).
    Past the end of the reduced dim the kernel folds the fold's identity where it masks (max, min,
    logsumexp, a `bounded` sum) and otherwise what its epilogue computes there (`_padding`)."""
    x = vals[s.value[0]]
    if s.scaled:
        x = x * vals[s.value[1]]
    x = torch.as_tensor(x, dtype=torch.float32)
    if x.dim() < 2:
        x = x.reshape(1, -1) if x.dim() == 1 else x.reshape(1, 1)
    if s.op == "ColVecSelect":
        return None
    # what the kernel folds by: the sink's fold (add, max, max of |x|; lse for OnlineLSEReduce)
    fold = combine_of_sink("lse" if s.op == "OnlineLSEReduce" else s.combine or "")
    if s.combine == "max_abs":
        x = x.abs()
    if s.op == "OnlineLSEReduce" and specs.LSE_CLAMP:  # +-inf folded as +-F32_MAX (spec.LSE_CLAMP)
        x = x.clamp(-specs.F32_MAX, specs.F32_MAX)
    if s.negate:  # min(): the kernel folds -x by max (the runtime negates the buffer back)
        x = -x
    identity = 0.0 if s.combine == "max_abs" else fold.identity
    masked = s.bounded or fold.name in ("max", "lse") and s.combine != "max_abs"
    if s.op in ("ColVecReduce", "OnlineLSEReduce"):  # row partials; else column partials
        width = x.shape[1] if x.shape[1] != 1 else n
        x = x.expand(m, width)
        tw = tile_n * width // n  # a half-width value has tile_N / 2 columns per tile
        tiles = -(-n // tile_n)
        extra = tiles * tw - width
        fill = torch.full((m, extra), identity, device=x.device)
        if extra and not masked:
            p = _padding(spec, s, vals, m, n).expand(m, -1)
            fill = p.abs() if s.combine == "max_abs" else p
            fill = fill.repeat(1, -(-extra // fill.shape[1]))[:, :extra]
        x = torch.cat((x, fill), dim=1)
        if s.op == "OnlineLSEReduce":
            return _online_lse(x.reshape(m, tiles, tw), 2)
        return fold.torch(x.reshape(m, tiles, tw), 2)
    width = x.shape[1]
    x = x.expand(m, width)
    if s.rows is not None:  # a group of rows: one partial per group, at any tile_M the checker allows
        tile_m = s.rows
    tiles = -(-m // tile_m)
    extra = tiles * tile_m - m
    fill = torch.full((extra, width), identity, device=x.device)
    if extra and not masked:
        p = _padding(spec, s, vals, m, n).expand(1, width)
        fill = (p.abs() if s.combine == "max_abs" else p).expand(extra, width)
    x = torch.cat((x, fill), dim=0)
    return fold.torch(x.reshape(tiles, tile_m, width), 1)


def _online_lse(x: torch.Tensor, dim: int) -> torch.Tensor:
    """A tile's log-sum-exp as quack's OnlineLSEReduce computes it: the running max drops NaN (fmax),
    then max + log(sum(exp(x - max))); so a tile holding +inf (or only -inf) gives NaN."""
    m = torch.where(torch.isnan(x), -torch.inf, x).amax(dim, keepdim=True)
    return (m + torch.log(torch.exp(x - m).sum(dim, keepdim=True))).squeeze(dim)


def _block_scaled(
    A: torch.Tensor, B: torch.Tensor, sa: torch.Tensor | None, sb: torch.Tensor, columns: bool = False
) -> torch.Tensor:
    """The block-scaled GEMM's accumulator as the kernel computes it (plan/block_scaled.py): A [M, K],
    B [N, K]; each 128-deep block of K summed in f32, times its row's scale of A (sa [M, K/128]; None:
    B's scale alone) and its column block's of B (sb [N/128, K/128]; `columns`: each column's, sb
    [N, K/128]), the blocks added in order."""
    n, k = B.shape
    acc = torch.zeros(A.shape[0], n, dtype=torch.float32, device=A.device)
    g = SCALE_BLOCK
    for kb in range(-(-k // g)):
        blk = slice(kb * g, min(k, (kb + 1) * g))
        cols = (sb[:, kb].float() if columns else sb[:, kb].float().repeat_interleave(g))[:n][None, :]
        acc += (A[:, blk] @ B[:, blk].t()) * (cols if sa is None else sa[:, kb : kb + 1].float() * cols)
    return acc


def accumulate(spec: StageSpec, A: torch.Tensor, B: torch.Tensor, epi_args: dict[str, Any]) -> torch.Tensor:
    """The stage's accumulator, f32 [M, N]: A @ B (B as the GEMM reads it), or the block-scaled sum."""
    g = spec.gemm
    if g.scaled:  # (B as [N, K] and its blocks as [N/128, K/128], however it is stored)
        sb = epi_args[g.scale_b_py]
        Bt, sbt = (B.float().t(), sb.t()) if g.b_kn and not g.tb else (B.float(), sb.t() if g.b_kn else sb)
        sa = epi_args[g.scale_a_py] if g.scale_a else None
        return _block_scaled(A.float(), Bt, sa, sbt, columns=g.b_columns)
    return A.float() @ (B.float().t() if g.tb else B.float())


def run_stage(
    spec: StageSpec,
    config: Any,
    A: torch.Tensor,
    B: torch.Tensor,
    D: torch.Tensor | None,
    epi_args: dict[str, Any],
    C: torch.Tensor | None = None,
) -> None:
    """Fill `D`, the TileStore buffers and the sink buffers in `epi_args` as the stage's kernel would
    (C: the GEMM's C operand of a packed-mode stage, the double-width tile it loads)."""
    acc = accumulate(spec, A, B, epi_args)
    m, n = acc.shape
    vals = _operand_values(spec, epi_args)
    # `expand(s, acc)` of s [M, N/g]: each value over its g columns, as the kernel reads it
    for ld in spec.operands:
        if ld.role == "grouped tile":
            vals[ld.name] = vals[ld.name].repeat_interleave(ld.group, dim=1)[:, :n]
    if spec.c is not None:
        assert C is not None
        vals[spec.c.name] = C.float()
    vals["acc"] = acc
    # rows of A, columns of B holding a non-finite value: the padding's accumulator is NaN there
    vals[NONFINITE] = (
        ~torch.isfinite(A.float()).all(dim=1),
        ~torch.isfinite(B.float()).all(dim=1 if spec.gemm.tb else 0),
    )
    for ix_op in spec.operands:  # TileIndex: each element's global index as f32, plus the host offset
        if ix_op.role in INDEX_AXIS:
            axis = INDEX_AXIS[ix_op.role]
            ix = torch.arange((m, n)[axis], device=acc.device, dtype=torch.float32) + float(
                epi_args[ix_op.py]
            )
            vals[ix_op.name] = ix.reshape(-1, 1) if axis == 0 else ix.reshape(1, -1)
    _groups(spec, vals, m, n, epi_args)
    _eval(spec.eqns, vals, spec.gemm.cols)
    if spec.d is not None:
        assert D is not None
        _store_into(D, torch.as_tensor(vals[spec.d.name], dtype=torch.float32).expand(D.shape))
    for o in spec.outputs:
        buf = epi_args[o.py]
        if o.pairs:  # (the fp8 tile stored as its pairs, handed over as int16 words: the tile itself)
            buf = buf.view(torch_dtype(o.dtype))
        x = torch.as_tensor(vals[o.name], dtype=torch.float32)
        if o.kmajor and o.lane is not None:  # a lane of pairs, into its rows of the K-major copy
            x = x.expand(m, 2 * n)[:, o.lane :: 2]
        elif o.lane is not None:  # one lane of a full-width tile of a paired stage
            x = x.expand(m, n)[:, o.lane :: 2]
        _store_into(buf, x.expand(buf.shape))  # (a K-major copy's buf: the [M, N] view of its transpose)
    for s in spec.sinks:
        buf = epi_args[s.py]
        got = _sink(s, spec, vals, m, n, config.tile_m, config.tile_n, epi_args)
        if got is not None:
            buf.copy_(got)
            continue
        x = torch.as_tensor(vals[s.value[0]], dtype=torch.float32).expand(m, -1)
        assert s.index is not None
        idx = epi_args[s.index].long()
        ok = (idx >= 0) & (idx < x.shape[1])
        picked = x.gather(1, torch.where(ok, idx, 0).reshape(-1, 1)).reshape(-1)
        # as quack's ColVecSelect: -inf is its "no match" sentinel, never written (launch.py prefills)
        buf.copy_(torch.where(ok & (picked != float("-inf")), picked, buf))
