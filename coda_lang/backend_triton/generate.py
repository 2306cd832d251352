"""Elementwise stages as generated Triton kernels: one pass over the data, each column pair's math once.

What it does: `TritonStage(stage)` turns an `ElementwiseStage` (a stage with no GEMM: RoPE's backward,
an activation's backward at a block's entry) into the source of one Triton kernel and runs it with the
same contract as `ElementwiseStage._body` (stored tiles in their dtype, then the reductions as f32
vectors). Each program takes a few rows and walks their columns in chunks. In a stage that uses
`pairs`/`interleave` the chunks are chunks of column pairs: a full-width tile is held as its two lanes
(the even and the odd columns), a half-width tile (after `pairs`) as one, so that what a pair computes
once (RoPE's cos and sin) is computed once, where a kernel over the output's elements computes both
halves of every pair at each element (Inductor's code for such a stage on the Llama-3.2-1B layer took
0.39-0.47 ms on an H100 against 0.065 ms for this form). Reductions over a row's columns fold in the
program; reductions over the rows leave one partial per program, folded afterwards by the combine's
torch rule. A grouped reduction (`sum(x * x, over=2*P, group=HD)`, a per-head sum) folds in the chunk
that holds its groups whole (chunks are a multiple of the group's power-of-two column units, and start
at one; in a stage over pairs a group of g columns is g/2 pairs in each lane) as [BM, BC / units,
units], stores one value per (row, group) and is held at each of its group's columns for the rest of
the chunk (Qwen3's per-head q/k-norm backward uses it to scale the same head). A vector that repeats
across the columns (one head_dim vector for every head) is a loaded column vector read at each column
modulo its length. Neither is timed on a GPU yet (Inductor's kernel for Qwen3-1.7B's q/k-norm backward
took 0.38 ms per layer on an H100).
`unsupported(stage)` says why a stage can't be generated (an op without a Triton emitter, a group a
chunk can't hold whole, a reduction of a grouped value, a repeating vector that is not a loaded column
vector, an fp8 tile loaded or a cast to fp8 inside the stage, ...); such a stage keeps torch.compile.
A stored tile of an fp8 dtype (e4m3, e5m2: a weight quantized by its scale, `wq: e4m3 = w * s`) is
generated: clamped to +-max (NaN kept), then Triton's f32 -> fp8 conversion, on sm_90 one
`cvt.rn.satfinite.e4m3x2.f32` (`e5m2x2`) per pair of values, nearest even: the interpreter's
saturating store (core/numerics.round_fp8) bit for bit (the tests' `gpu` runs check it). Under
Triton's CPU interpreter (whose own conversion rounds ties away from zero and reads NaN as a finite
e4m3) the helper rounds the value to the fp8 grid in f32 and assembles its code from the bits
(`_fp8_helper`).
Each op's Triton
expression comes from the op registry (`Lowerings.triton`); the helpers it may call (`_exp`, `_sin`, ...)
are libdevice's accurate functions on the GPU and `tl`'s under Triton's CPU interpreter (`interpret=True`,
the tests' way to run the generated kernel without a GPU).
What it does not: fold a reduction's result back into the same stage (a reduction inside a stage is a
partial, used only after it, as the language says; a grouped one is complete in its chunk), or launch when the stage is empty (no rows or no
columns) or its tensors are not on a CUDA device (the eager torch function runs then); take a stage
that loads an fp8 tile or casts to fp8 inside it (`unsupported` says so: torch.compile runs it).
Invariants: numerics follow the interpreter: loads widened to f32, math in f32, rounding only where a
tile is stored (or at `cast`; to nearest even, fp8 saturating first), division and square root
IEEE-rounded; a stored tile comes back in its torch dtype (torch.float8_e4m3fn, torch.float8_e5m2);
the source depends only on the stage and on which scalar operands are tensors, and is built once per
such signature.
"""

from __future__ import annotations

import functools
import linecache
import math
import os
from typing import Any

import torch

from coda_lang.backend_triton import kmajor_width
from coda_lang.backend_triton.interpret import interpreted
from coda_lang.backend_triton.launcher import launch
from coda_lang.ir.nodes import Var
from coda_lang.ir.types import MATRIX, TILE, is_fp8
from coda_lang.ops import REGISTRY, Lanes, Locality
from coda_lang.ops.registry import combine_rule

# the generated module's combine functions, by combine record (tl.reduce's; not tl.sum: Triton's library
# functions are jitted when triton is imported, so its CPU interpreter can't run them unless it was on
# from the start); a reduction folding by another record (logsumexp) keeps torch.compile
_COMBINE = {"sum": "_add", "max": "_nanmax", "min": "_nanmin"}
# a stored tile written K-major only (`TritonStage.kmajor_stores`): nothing reads its row-major tile
ALONE = 2


def kmajor_program() -> tuple[int, int, int]:
    """(rows, column units, warps) of a program of a stage that writes K-major copies:
    $CODA_KMAJOR_PROGRAM=RxCxW, default 64x64x4 (the shape timed on an H200). At 64 x 64 with 4 warps
    (ptxas 13.0, sm_90a, of Triton 3.9's code, 2026-11-29) the fp8 layer backward's start stage of x1q
    and x2q needs 255 registers (and spills 848 bytes where it stores the row-major tiles too), the
    weights' 168, and the RoPE backward's spills 2,264 bytes: a few programs an SM for stages bound by
    memory. At 64x16x16 they use 30-64 registers and spill none, yet the captured 1B step was 2 ms
    slower there (H200, 2026-11-29), so the default stays.
    R: a multiple of 16 (the copy's rows of one column are R contiguous bytes), C and W powers of two,
    W at most 16. ValueError else."""
    return _program(os.environ.get("CODA_KMAJOR_PROGRAM", "64x64x4"))


def column_reduction_rows() -> int:
    """Rows per program of an unpaired stage with a reduction over the rows: $CODA_COLUMN_REDUCTION_ROWS,
    default TritonStage.BM_COLUMN_REDUCTIONS (32, measured on the last layer's norm backward). At 32
    rows such a stage of the fp8 layer (a norm backward cut off its GEMM: runtime/split_epilogue.py)
    needs 248 registers a thread (ptxas, sm_90a); fewer rows need fewer, and leave more partials of
    the column sums to fold. A power of two from 1 to 64; ValueError else (read when a stage's kernel
    is made)."""
    v = os.environ.get("CODA_COLUMN_REDUCTION_ROWS")
    if v is None:
        return TritonStage.BM_COLUMN_REDUCTIONS
    r = int(v) if v.strip().isdigit() else 0
    if not (1 <= r <= 64 and r & (r - 1) == 0):
        raise ValueError(f"$CODA_COLUMN_REDUCTION_ROWS is {v!r}; it takes a power of two from 1 to 64")
    return r


@functools.lru_cache(maxsize=8)
def _program(v: str) -> tuple[int, int, int]:
    """kmajor_program's parse of the variable's value (once per value: a stage's launch asks)."""
    try:
        r, c, w = (int(x) for x in v.split("x"))
    except ValueError:
        r = c = w = 0
    if not (r >= 16 and r % 16 == 0 and c >= 1 and c & (c - 1) == 0 and 1 <= w <= 16 and w & (w - 1) == 0):
        raise ValueError(
            f"$CODA_KMAJOR_PROGRAM is {v!r}; it takes RxCxW: rows a multiple of 16, column units and "
            "warps powers of two, warps at most 16 (e.g. 64x16x16)"
        )
    return r, c, w


def _fold(op: str) -> str | None:
    """The combine record a reduction `op` folds by, where the generated kernel has it; else None."""
    od = REGISTRY[op]
    if od.locality is not Locality.REDUCE or od.combine is None or od.combine.name not in _COMBINE:
        return None
    return od.combine.name


# The generated module's one-argument helpers: name -> (its body on the GPU, under Triton's CPU
# interpreter, which has no libdevice: NumPy's functions through `tl`).
_HELPERS = {
    "_exp": ("return libdevice.exp(x)", "return tl.exp(x)"),
    "_log": ("return libdevice.log(x)", "return tl.log(x)"),
    "_rsqrt": ("return libdevice.rsqrt(x)", "return tl.rsqrt(x)"),
    "_sin": ("return libdevice.sin(x)", "return tl.sin(x)"),
    "_cos": ("return libdevice.cos(x)", "return tl.cos(x)"),
    "_tanh": (
        "return libdevice.tanh(x)",
        "e = tl.exp(-2.0 * tl.abs(x))\n    t = tl.math.div_rn(1.0 - e, 1.0 + e)\n    return tl.where(x >= 0, t, -t)",
    ),
    # rounding to bf16, the value staying f32; the interpreter's own f32 -> bf16 conversion truncates,
    # so there the bits are rounded to nearest even by hand
    "_bf16": (
        "return x.to(tl.bfloat16).to(tl.float32)",
        "b = x.to(tl.uint32, bitcast=True)\n    r = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000\n"
        "    return tl.where(x != x, x, r.to(tl.float32, bitcast=True))",
    ),
}

# the fp8 dtypes a tile may be stored as: torch dtype -> (helper, Triton dtype, largest finite value,
# smallest normal exponent, mantissa bits, the NaN code the interpreter's store writes (sign apart))
_FP8 = {
    torch.float8_e4m3fn: ("_e4m3", "tl.float8e4nv", 448.0, -6, 3, 0x7F),
    torch.float8_e5m2: ("_e5m2", "tl.float8e5", 57344.0, -14, 2, 0x7E),
}


def _fp8_helper(tl_dtype: str, fmax: float, emin: int, mant: int, nan: int) -> tuple[str, str]:
    """The bodies (GPU, CPU interpreter) of a helper storing an f32 value as fp8 as the interpreter does
    (core/numerics.round_fp8): saturated to +-max (infinities too), NaN kept, rounded to nearest even.
    On the GPU: the clamp, then Triton's f32 -> fp8 conversion, which on sm_90 is one
    `cvt.rn.satfinite.e4m3x2.f32` (`e5m2x2`) per pair of values. Triton's CPU interpreter converts by
    truncating the mantissa and adding the first dropped bit (ties away from zero, a carry out of the
    mantissa lost) and reads NaN as an e4m3 of 384, so there the helper does without its conversion:
    the magnitude, saturated, is rounded to the fp8 grid in f32 (adding and subtracting 2^23 units of
    the last place of its fp8 exponent, a subnormal's the smallest normal exponent's: NumPy's f32 adds
    round to nearest even), its code assembled from the f32 bits (a normal value: exponent rebiased,
    mantissa's top bits; a subnormal: its count of units), the sign bit put back (-0 too), a NaN given
    the dtype's NaN code (with its sign bit, as ml_dtypes' cast), and the byte bitcast to fp8."""
    gpu = (
        "x = x.to(tl.float32)\n"
        f"    y = tl.where(x != x, x, tl.minimum(tl.maximum(x, {-fmax!r}), {fmax!r}))\n"
        f'    return y.to({tl_dtype}, fp_downcast_rounding="rtne")'
    )
    tiny = 2.0**emin  # the smallest normal value
    cpu = (
        "x = x.to(tl.float32)\n"
        f"    a = tl.minimum(tl.abs(x), {fmax!r})\n"
        f"    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23), {127 + emin})\n"
        f"    u = ((e + {23 - mant}) << 23).to(tl.float32, bitcast=True)\n"
        "    r = (a + u) - u\n"
        "    rb = r.to(tl.int32, bitcast=True)\n"
        f"    normal = (rb >> {23 - mant}) - {(126 + emin) << mant}\n"
        f"    sub = (tl.minimum(r, {tiny!r}) * {2.0 ** (mant - emin)!r}).to(tl.int32)\n"
        f"    code = tl.where(rb >= {(127 + emin) << 23}, normal, sub)\n"
        f"    code = tl.where(x != x, {nan:#x}, code) | ((x.to(tl.int32, bitcast=True) >> 24) & 0x80)\n"
        f"    return code.to(tl.uint8).to({tl_dtype}, bitcast=True)"
    )
    return gpu, cpu


for _name, _tl, _max, _emin, _mant, _nan in _FP8.values():
    _HELPERS[_name] = _fp8_helper(_tl, _max, _emin, _mant, _nan)


def _helpers(interpret: bool) -> str:
    head = "" if interpret else "from triton.language.extra import libdevice\n"
    return head + "".join(
        f"\n\n@_jit\ndef {name}(x):\n    {bodies[1 if interpret else 0]}\n"
        for name, bodies in _HELPERS.items()
    )


_COMMON_HELPERS = """

@_jit
def _sigmoid(x):
    e = _exp(-tl.abs(x))
    return tl.where(x >= 0, tl.math.div_rn(1.0, 1.0 + e), tl.math.div_rn(e, 1.0 + e))


@_jit
def _add(a, b):
    return a + b


@_jit
def _nanmax(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@_jit
def _nanmin(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)
"""

_TL_DTYPES = {
    torch.bfloat16: "tl.bfloat16",
    torch.float16: "tl.float16",
    torch.float32: "tl.float32",
    torch.int32: "tl.int32",
    **{dtype: spec[1] for dtype, spec in _FP8.items()},
}


def unsupported(st: Any) -> str | None:
    """Why stage `st` (an ElementwiseStage) can't be a generated Triton kernel, or None if it can."""
    grouped = [ld.name for ld in st.loads if ld.role == "grouped tile"]
    if grouped:
        return f"`{grouped[0]}` is read over groups of the tile (`expand` of a block scale)"
    if any(st.row_groups):
        return "a reduction over runs of rows (`over=M, group=g`)"
    if st.handed_back:
        return f"the grouped value `{st.handed_back[0]}`, computed from a grouped reduction, is used after the stage"
    for e, (op, _outs, args, info) in zip(st.stage.body, st.steps, strict=True):
        od = REGISTRY[op]
        for i, _g, w in info.get("cycle", ()):
            # (the generated kernel reads a loaded column vector at each column modulo its length)
            a = args[i]
            if not (
                a[0] == "v"
                and any(ld.name == a[1] and ld.role == "column vector" for ld in st.loads)
                and w in ((1, 1), (1, 2) if _paired(st) else (1, 1))
            ):
                return f"`{op}` reads a vector that repeats across the columns"
        if od.locality is Locality.REDUCE:
            if _fold(op) is None:
                return f"the reduction `{op}`"
            if info["ungroup"]:
                return "a reduction of a grouped value"
            if info["group"]:
                units = _group_units(st, info)
                if isinstance(units, str):
                    return units
            x = e.ins[0]
            if not (isinstance(x, Var) and x.type is not None and x.type.kind in (TILE, MATRIX)):
                return f"`{op}` of a value that is not a tile"
        elif od.lanes is not None:
            continue
        elif od.index_axis == 1:
            if info["width"] not in ((1, 1), (1, 2) if _paired(st) else (1, 1)):
                return "col_index() of a tile wider than the stage"
        elif od.index_axis == 0:
            continue
        elif od.lower.triton is None:
            return f"`{op}` has no Triton emitter"
    paired = _paired(st)
    cycled = _cycled(st)
    for w in (
        *(m[2] for m in st.store_meta),
        *(_load_width(st, ld) for ld in st.loads if ld.name not in cycled),
    ):
        if w not in (None, (1, 1), (1, 2)):
            return "a tile wider than the stage"
        if w == (1, 2) and not paired:
            # (half-width values are the lanes of column pairs; in a stage that pairs nothing the
            # generated kernel walked the stage's columns over them: a random program's min backward,
            # [M, 2*N] over [M, N] tiles, came out wrong on the H100 and on Triton's interpreter)
            return "a half-width tile in a stage that pairs no columns"
    # (a grouped reduction's value is complete within the chunk that holds its group: it may be used)
    reduced = {n for n, g in zip(st.reductions, st.groups, strict=True) if not g}
    for e in st.stage.body:
        if REGISTRY[e.op].locality is not Locality.REDUCE and any(
            isinstance(a, Var) and a.name in reduced for a in e.ins
        ):
            return "a reduction's partial used inside its stage"
    for name, dtype, _w in st.store_meta:
        if dtype not in _TL_DTYPES:
            return f"`{name}` stored as {dtype}"
    for ld in st.loads:
        if is_fp8(ld.dtype):
            return f"`{ld.name}` is {ld.dtype} (an fp8 load is not generated yet)"
    for e in st.stage.body:
        if REGISTRY[e.op].rounds and is_fp8(e.param("dtype")):
            return f"a cast to {e.param('dtype')} (a cast to fp8 inside a stage is not generated yet)"
    return None


def _group_units(st: Any, info: dict[str, Any]) -> int | str:
    """A grouped reduction's group as the number of adjacent column units it covers in one lane of a
    chunk (a group of g columns of a full-width value in a stage over column pairs: g/2 pairs, in both
    lanes), or why the generated kernel can't hold its groups whole in one chunk."""
    g = info["group"]
    if not info["per_row"]:
        return "a grouped reduction over the rows"
    units = g // 2 if _paired(st) and info["widths"][0] == (1, 1) else g
    if _paired(st) and info["widths"][0] == (1, 1) and g % 2:
        return f"a group of {g} columns split over column pairs"
    if units < 1 or units & (units - 1) or units > 1024:
        return f"a group of {g} columns (a chunk holds whole groups: a power of two, at most 1024 units)"
    return units


def _cycled(st: Any) -> set[str]:
    """The loaded vectors read only as vectors that repeat across the columns (`info["cycle"]`)."""
    through: set[str] = set()
    direct: set[str] = set()
    for _op, _o, args, info in st.steps:
        cyc = {i for i, _g, _w in info.get("cycle", ())}
        for i, (k, v) in enumerate(args):
            if k == "v":
                (through if i in cyc else direct).add(v)
    return through - direct


def _paired(st: Any) -> bool:
    """Whether the stage uses pairs/interleave (a pair op: `Lanes`): its chunks are of column pairs."""
    return any(REGISTRY[op].lanes is not None for op, *_ in st.steps)


def _load_width(st: Any, ld: Any) -> tuple[int, int] | None:
    if ld.role == "tile":
        return st._ratio(ld.shape[1])
    if ld.role == "column vector":
        return st._ratio(ld.shape[0])
    return None


class _Val:
    """A value in the generated kernel: its kind ("tile" [BM, BC], "row" [BM, 1], "col" [1, BC],
    "scalar"), its width for tiles and column vectors ("full": the stage's columns, "half": its
    column pairs) and one expression per lane (two for a full-width value when the stage walks
    column pairs, else one)."""

    def __init__(self, kind: str, width: str | None, exprs: tuple[str, ...], literal: bool = False):
        self.kind, self.width, self.exprs, self.literal = kind, width, exprs, literal

    def lane(self, i: int) -> str:
        return self.exprs[i] if len(self.exprs) > 1 else self.exprs[0]


def _combine_kinds(kinds: list[str]) -> str:
    if "tile" in kinds or ("row" in kinds and "col" in kinds):
        return "tile"
    return "col" if "col" in kinds else "row" if "row" in kinds else "scalar"


class TritonStage:
    """Stage `st` (an ElementwiseStage that `unsupported` accepts) as a generated Triton kernel; called
    as `ElementwiseStage._body` is: (rows, cols, dim sizes, device, *loads) -> outputs."""

    BM = 1  # rows per program
    BM_COLUMN_REDUCTIONS = 32  # rows per program when a reduction runs over the rows (fewer partials)
    BM_PAIRED_COLUMN_REDUCTIONS = 4  # the same in a stage over column pairs (two lanes: more registers)

    def __init__(self, st: Any, interpret: bool = False):
        why = unsupported(st)
        assert why is None, why
        self.st, self.interpret = st, interpret
        self.paired = _paired(st)
        # each reduction's (fold, over the columns of a row, of a half-width value, group (0: none)), in
        # output order
        self.reductions = [
            (fold, bool(info["per_row"]), info["widths"][0] == (1, 2), info["group"])
            for op, _o, _a, info in st.steps
            if (fold := _fold(op)) is not None
        ]
        self.col_reductions = any(not per_row for _f, per_row, _h, _g in self.reductions)
        # program shapes measured on an H100 (the Llama layer's RoPE backward, [8192, 3072]: 1 row x
        # 128 pairs 0.068 ms, 4 x 128 0.116 ms; the last layer's norm backward with its reduction over
        # the rows, [8192, 2048]: 32 rows x 128 columns, 8 warps 0.096 ms; OLMo 2's q/k-norm and RoPE
        # backward, paired with column sums, [8192, 6144], 8 warps: 32 rows 1.448 ms, 16 0.699, 8 0.321,
        # 4 0.254, 2 0.285, 1 0.381; 4 warps slower at every row count, 2026-11-27)
        if not self.col_reductions:
            self.bm = self.BM
        else:
            self.bm = self.BM_PAIRED_COLUMN_REDUCTIONS if self.paired else column_reduction_rows()
        # a grouped reduction's groups lie whole in a chunk: chunks are a multiple of the (power of two)
        # column units of the largest group, and start at a multiple of it
        units = [
            _group_units(st, info) for op, _o, _a, info in st.steps if _fold(op) is not None and info["group"]
        ]
        self.group_units = max([u for u in units if isinstance(u, int)], default=1)
        self.bc = max(128, self.group_units)  # column units (pairs, or columns) per chunk
        self.num_warps = 8 if self.col_reductions else 4
        # an unpaired stage over long rows (the loss head's dlogits, [4096, 128256]) takes 1024 columns
        # at a time: 8 adjacent elements per thread, so its loads and stores are 16 bytes wide
        self.bc_wide = self.bc if self.paired or self.col_reductions else 1024
        self.dims = sorted({v for _op, _o, args, _i in st.steps for k, v in args if k == "d"})
        # the lengths of the vectors that repeat across the columns, as (dim, num, den): int arguments
        self.cycles = sorted({g for *_x, info in st.steps for _i, g, _w in info["cycle"]}, key=repr)
        self._kernels: dict[tuple[tuple[bool, ...], tuple[int, ...]], Any] = {}

    # -- the source

    def source(self, scalar_tensors: tuple[bool, ...], kmajor: tuple[int, ...] = ()) -> str:
        """The kernel module's text; `scalar_tensors[i]`: the i-th scalar operand is a tensor (read
        through a pointer) rather than a Python number (a kernel argument); `kmajor[j]`: the j-th stored
        tile is also written K-major (`kmajor_stores`), through the pointer argument `kt{j}`, each
        element (r, c) at c * W + r; `kmajor[j] == ALONE`: only K-major (its row-major tile, which
        nothing reads, is not stored)."""
        st = self.st
        lanes = 2 if self.paired else 1
        name = self.kernel_name()
        kgrid = any(kmajor)  # (a grid of row blocks x column chunks: `kmajor_stores`)
        args: list[str] = []
        pre: list[str] = []  # before the column loop
        body: list[str] = []  # in it
        post: list[str] = []  # after it
        vals: dict[str, _Val] = {}
        scalars = iter(scalar_tensors)

        def row_len(width: str | None) -> str:
            return "C" if width == "full" else "(C // 2)"

        def col_index(width: str, lane: int, one_d: bool = False) -> str:
            c = "cols1" if one_d else "cols"
            if width == "half" or not self.paired:
                return c
            return f"(2 * {c} + {lane})" if lane else f"(2 * {c})"

        cycled = _cycled(st)
        load_ptr: dict[str, tuple[str, str]] = {}
        for k, ld in enumerate(st.loads):
            p = f"in{k}"
            args.append(p)
            load_ptr[ld.name] = (p, ld.dtype)
            if ld.name in cycled:  # read at each column modulo its length, where it is used
                continue
            if ld.role == "scalar":
                if next(scalars):
                    pre.append(
                        f"s{k} = tl.load({p}).to(tl.float32)"
                        if _floating(ld.dtype)
                        else f"s{k} = tl.load({p})"
                    )
                    vals[ld.name] = _Val("scalar", None, (f"s{k}",))
                else:
                    vals[ld.name] = _Val("scalar", None, (p,))
            elif ld.role == "row vector":
                pre.append(f"r{k} = {_widen(f'tl.load({p} + rows, mask=rmask, other=0)', ld.dtype)}")
                vals[ld.name] = _Val("row", None, (f"r{k}",))
            else:
                width = "full" if _load_width(st, ld) == (1, 1) else "half"
                n = lanes if width == "full" else 1
                exprs = []
                for lane in range(n):
                    v = f"t{k}_{lane}"
                    if ld.role == "tile":
                        ptr = f"{p} + roff * {row_len(width)} + {col_index(width, lane)}"
                        body.append(f"{v} = {_widen(f'tl.load({ptr}, mask=m, other=0)', ld.dtype)}")
                    else:
                        ptr = f"{p} + {col_index(width, lane)}"
                        body.append(f"{v} = {_widen(f'tl.load({ptr}, mask=cmask, other=0)', ld.dtype)}")
                    exprs.append(v)
                vals[ld.name] = _Val("tile" if ld.role == "tile" else "col", width, tuple(exprs))
        dim_args = {d: f"dim{i}" for i, d in enumerate(self.dims)}
        args += dim_args.values()
        cyc_args = {g: f"cyc{i}" for i, g in enumerate(self.cycles)}
        args += cyc_args.values()

        def operand(kind: str, v: Any) -> _Val:
            if kind == "v":
                return vals[v]
            if kind == "c":
                return _Val("scalar", None, (_literal(v),), literal=True)
            return _Val("scalar", None, (dim_args[v],))

        outs_args: list[str] = []  # the stored tiles', then the reductions' outputs
        red_args: list[str] = []
        tmp = 0
        for op, outs, eargs, info in st.steps:
            cyc_vals: dict[int, _Val] = {}
            for i, g, w in info["cycle"]:  # column c (or pair c) reads element c mod G
                p, dtype = load_ptr[eargs[i][1]]
                width = "full" if w == (1, 1) else "half"
                exprs = []
                for lane in range(lanes if width == "full" else 1):
                    v = f"y{tmp}_{i}_{lane}"
                    ptr = f"{p} + {col_index(width, lane)} % {cyc_args[g]}"
                    body.append(f"{v} = {_widen(f'tl.load({ptr}, mask=cmask, other=0)', dtype)}")
                    exprs.append(v)
                cyc_vals[i] = _Val("col", width, tuple(exprs))
            xs = [cyc_vals[i] if i in cyc_vals else operand(k, v) for i, (k, v) in enumerate(eargs)]
            od = REGISTRY[op]
            if od.lanes is Lanes.SPLIT:  # pairs: one half-width value per lane
                (x,) = xs
                for o, lane in zip(outs, (0, 1), strict=True):
                    vals[o] = _Val(x.kind, "half", (x.lane(lane),))
                continue
            if od.lanes is Lanes.JOIN:  # interleave: two half-width values are the two lanes
                kind = _combine_kinds([x.kind for x in xs])
                vals[outs[0]] = _Val(kind, "full", (xs[0].lane(0), xs[1].lane(0)))
                continue
            if od.index_axis == 0:  # row_index: i32, as the torch stand-in's
                vals[outs[0]] = _Val("row", None, ("rows",))
                continue
            if od.index_axis == 1:  # col_index: the stage's full width: both lanes; after pairs: a pair's
                width = "full" if info["width"] == (1, 1) else "half"
                n = lanes if width == "full" else 1
                vals[outs[0]] = _Val("col", width, tuple(col_index(width, lane) for lane in range(n)))
                continue
            fold = _fold(op)
            if fold is not None:
                grouped = self._reduction(
                    fold, outs[0], info, xs[0], lanes, pre, body, post, red_args, col_index, row_len, kgrid
                )
                if grouped is not None:
                    vals[outs[0]] = grouped
                continue
            triton = od.lower.triton
            assert triton is not None
            width_of: str | None = next((x.width for x in xs if x.width is not None), None)
            n = lanes if width_of == "full" else 1
            exprs = []
            for lane in range(n):
                v = f"v{tmp}_{lane}"
                body.append(f"{v} = {triton(*(x.lane(lane) for x in xs), **info['params'])}")
                exprs.append(v)
            tmp += 1
            vals[outs[0]] = _Val(_combine_kinds([x.kind for x in xs]), width_of, tuple(exprs))

        kt_args: list[str] = []
        for j, (sname, dtype, w) in enumerate(st.store_meta):
            p = f"out{j}"
            outs_args.append(p)
            x = vals[sname]
            width = "full" if w == (1, 1) else "half"
            n = lanes if width == "full" else 1
            transposed = j < len(kmajor) and kmajor[j]
            if transposed:
                assert width == "full", "a K-major copy of a full-width tile"
                kt_args.append(f"kt{j}")
            for lane in range(n):
                ptr = f"{p} + roff * {row_len(width)} + {col_index(width, lane)}"
                value = (
                    x.lane(lane)
                    if x.kind == "tile"
                    else f"tl.full((BM, BC), {x.lane(lane)}, tl.float32)"
                    if x.literal
                    else f"tl.broadcast_to({x.lane(lane)}, (BM, BC))"
                )
                value = _to(value, dtype)
                if transposed:
                    q = f"q{j}_{lane}"
                    body.append(f"{q} = {value}")
                    if kmajor[j] != ALONE:
                        body.append(f"tl.store({ptr}, {q}, mask=m)")
                    # transposed in registers (tl.trans), then stored along its rows: each column's
                    # rows of a program (kmajor_program) are contiguous bytes of the copy (a store along the columns of the
                    # untransposed tile wrote one byte per column and was 5x slower, H200); in a stage
                    # over pairs each lane's columns are every other row of the copy
                    col = col_index(width, lane, one_d=True)
                    body.append(
                        f"tl.store(kt{j} + ({col})[:, None].to(tl.int64) * W + rows1[None, :], tl.trans({q}), "
                        "mask=tl.trans(m))"
                    )
                else:
                    body.append(f"tl.store({ptr}, {value}, mask=m)")

        signature = ", ".join(
            [
                *args,
                *outs_args,
                *kt_args,
                *red_args,
                "R",
                "C",
                *(["W"] if kt_args else []),
                "BM: tl.constexpr",
                "BC: tl.constexpr",
            ]
        )
        lines = [
            *module_head(self.interpret),
            f"def {name}({signature}):",
            f"    # {st.block.name}, stage {st.index}: {st.text}",
            "    pid = tl.program_id(0)",
            "    rows1 = pid * BM + tl.arange(0, BM)",
            "    rows = rows1[:, None]",
            "    rmask = rows < R",
            "    roff = rows.to(tl.int64)",
            f"    CW = {'C // 2' if self.paired else 'C'}",
            *("    " + s for s in pre),
            # (with K-major copies: a grid of row blocks x column chunks, each program its own chunks)
            "    for c0 in range(tl.program_id(1) * BC, CW, BC * tl.num_programs(1)):"
            if kt_args
            else "    for c0 in range(0, CW, BC):",
            "        cols1 = c0 + tl.arange(0, BC)",
            "        cols = cols1[None, :]",
            "        cmask = cols < CW",
            "        m = rmask & cmask",
            *("        " + s for s in body),
            *("    " + s for s in post),
            "",
        ]
        return "\n".join(lines)

    def _reduction(
        self,
        fold: str,
        out: str,
        info: dict[str, Any],
        x: _Val,
        lanes: int,
        pre: list[str],
        body: list[str],
        post: list[str],
        red_args: list[str],
        col_index: Any,
        row_len: Any,
        kgrid: bool = False,
    ) -> _Val | None:
        """Emit reduction `out`; a grouped one's value (used in the stage) is returned. `kgrid`: the
        programs are a grid of row blocks x column chunks, so a reduction over a row's columns leaves
        one partial per (row, program column), folded after the launch."""
        ident = {"sum": "0.0", "max": "float('-inf')", "min": "float('inf')"}[fold]
        n = lanes if x.width == "full" else 1
        p = f"red_{out}"
        if info["group"]:
            # each group's units lie in this chunk (in each lane): fold them as [BM, BC // U, U], store
            # one value per (row, group), and hold it at each unit of its group for what follows
            units = _group_units(self.st, info)
            assert isinstance(units, int)
            ng = f"(BC // {units})"
            parts = [
                f"tl.reduce(tl.reshape(tl.where(m, {x.lane(lane)}, {ident}), (BM, {ng}, {units})), 2, "
                f"{_COMBINE[fold]})"
                for lane in range(n)
            ]
            acc = f"grp_{out}"
            body.append(f"{acc} = {parts[0]}")
            for part in parts[1:]:
                body.append(f"{acc} = {_fold_expr(fold, acc, part)}")
            gcols = f"(c0 // {units} + tl.arange(0, {ng}))[None, :]"
            body.append(
                f"tl.store({p} + roff * (CW // {units}) + {gcols}, {acc}, mask=rmask & ({gcols} < CW // {units}))"
            )
            held = f"held_{out}"
            body.append(
                f"{held} = tl.reshape(tl.broadcast_to({acc}[:, :, None], (BM, {ng}, {units})), (BM, BC))"
            )
            red_args.append(p)
            return _Val("tile", x.width, (held,))
        if info["per_row"]:
            acc = f"acc_{out}"
            pre.append(f"{acc} = tl.full((BM, BC), {ident}, tl.float32)")
            for lane in range(n):
                term = f"tl.where(m, {x.lane(lane)}, {ident})"
                body.append(f"{acc} = {_fold_expr(fold, acc, term)}")
            total = f"tl.reduce({acc}, 1, {_COMBINE[fold]})"
            if kgrid:
                post.append(
                    f"tl.store({p} + rows1 * tl.num_programs(1) + tl.program_id(1), {total}, mask=rows1 < R)"
                )
            else:
                post.append(f"tl.store({p} + rows1, {total}, mask=rows1 < R)")
        else:
            for lane in range(n):
                term = f"tl.where(m, {x.lane(lane)}, {ident})"
                part = f"tl.reduce({term}, 0, {_COMBINE[fold]})"
                body.append(
                    f"tl.store({p} + pid * {row_len(x.width)} + {col_index(x.width, lane, one_d=True)}, {part}, "
                    "mask=cols1 < CW)"
                )
        red_args.append(p)
        return None

    def kernel_name(self) -> str:
        st = self.st
        return "".join(c if c.isalnum() else "_" for c in f"coda_{st.block.name}_stage{st.index}")

    # -- building and running

    def kernel(self, scalar_tensors: tuple[bool, ...], kmajor: tuple[int, ...] = ()) -> Any:
        k = self._kernels.get((scalar_tensors, kmajor))
        if k is None:
            k = self._kernels[(scalar_tensors, kmajor)] = load_kernel(
                self.source(scalar_tensors, kmajor), self.kernel_name(), self.interpret
            )
        return k

    def kmajor_stores(self, names: frozenset[str], alone: frozenset[str] = frozenset()) -> tuple[int, ...]:
        """Which stored tiles among `names` this kernel can also write K-major (1; ALONE for those
        among `alone`, which nothing reads row-major: written K-major only; 0 the others) (the layout a
        GEMM that reads the tile transposed takes, launch.kmajor_pair's): one-byte tiles of the stage's full
        width, in a stage with no group wider than a program's column units: its programs are then a grid
        of blocks of rows x chunks of column units (`kmajor_program`; columns, or pairs in a stage over pairs:
        each lane's columns are every other row of the copy), so that each column's bytes of a copy
        are written together and a weight's few row blocks still fill the GPU, where they are
        otherwise blocks of rows that walk all the columns. A reduction over a row's columns then
        leaves one partial per program column, folded after the launch (a sum in another order than
        without copies: within f32 rounding; a max the same); one over the rows, and a grouped one,
        are written as they are without copies.
        Only stages over single columns with no reduction (the fp8 layer backward's start stages,
        timed on an H200) write copies unless `$CODA_KMAJOR_STAGES=all`: the others (the RoPE
        backward's, 1 row x 128 pairs a program without copies, and the last layer's norm backward)
        were slower at 64 x 64 programs (which spill: `kmajor_program`) than their own program shape
        and a transpose pass (H200, 2026-11-29)."""
        if self.group_units > 1 and self.group_units > kmajor_program()[1]:
            return tuple(0 for _ in self.st.store_meta)
        if (self.paired or self.reductions) and os.environ.get("CODA_KMAJOR_STAGES", "plain") != "all":
            return tuple(0 for _ in self.st.store_meta)
        return tuple(
            (ALONE if name in alone else 1) if name in names and w == (1, 1) and dtype.itemsize == 1 else 0
            for name, dtype, w in self.st.store_meta
        )

    into = True  # (ElementwiseStage.run: the call takes buffers for its stored tiles)

    def __call__(
        self,
        rows: int,
        cols: int,
        sizes: dict[str, int],
        device: torch.device,
        *ins: Any,
        into: list[torch.Tensor | None] | None = None,
        kmajor: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, ...]:
        """The stage's stored tiles and reductions; `into[i]`, when given, is the buffer of the i-th
        stored tile (one the stage loads: each program loads an element before it stores there).
        `kmajor` (`kmajor_stores`'s): after them, the K-major copy of each stored tile marked, [cols,
        W] with W the rows rounded up to 16 (rows R to W zeros), from the same kernel; none where
        nothing is launched (the GEMM that reads it makes its own then). A tile marked ALONE is
        returned as its copy's transposed view ([R, cols], the copy's first R columns)."""
        st = self.st
        if rows == 0 or cols == 0 or (device.type != "cuda" and not self.interpret):
            return st._body(rows, cols, sizes, device, *ins)  # nothing to launch, or no GPU to launch on
        scalar_tensors = tuple(
            isinstance(x, torch.Tensor)
            for (_n, role), x in zip(st.roles, ins, strict=True)
            if role == "scalar"
        )
        kmajor = kmajor if any(kmajor) else ()
        kern = self.kernel(scalar_tensors, kmajor)
        args: list[Any] = []
        for (_n, role), x in zip(st.roles, ins, strict=True):
            if role == "scalar" and not isinstance(x, torch.Tensor):
                args.append(float(x) if not isinstance(x, bool) else x)
            else:
                args.append(x.contiguous())
        args += [float(sizes[d[0]] * d[1] // d[2] if d[0] is not None else d[1] // d[2]) for d in self.dims]
        args += [(sizes[g[0]] if g[0] is not None else 1) * g[1] // g[2] for g in self.cycles]
        bm, bc_k, warps = kmajor_program() if kmajor else (self.bm, 0, self.num_warps)
        nprog = math.ceil(rows / bm)
        wk = kmajor_width(rows)
        new = torch.zeros if wk > rows else torch.empty  # (rows R to W of a copy: zeros)
        copies = [
            new((cols, wk), dtype=dtype, device=device)
            for (_n, dtype, _w), on in zip(st.store_meta, kmajor, strict=False)
            if on
        ]
        copy_of = iter(copies)
        outs: list[torch.Tensor] = []
        for j, (_name, dtype, w) in enumerate(st.store_meta):
            shape = (rows, cols * w[0] // w[1])
            copy = next(copy_of) if j < len(kmajor) and kmajor[j] else None
            if copy is not None and kmajor[j] == ALONE:  # (the kernel stores no row-major tile)
                outs.append(copy[:, :rows].t())
                continue
            buf = into[j] if into else None
            if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype or not buf.is_contiguous():
                buf = torch.empty(shape, dtype=dtype, device=device)
            outs.append(buf)
        bc = bc_k if kmajor else self.bc_wide if cols >= self.bc_wide else self.bc
        # with copies, a grid of row blocks x chunks of column units (pairs in a stage over pairs)
        g1 = math.ceil((cols // 2 if self.paired else cols) / bc) if kmajor else 1
        grid = (nprog, g1) if kmajor else (nprog,)  # (g1: a row's partials, one per program column)
        reds = [
            torch.empty(
                (rows, (cols // 2 if half else cols) // g)
                if g
                else ((rows, g1) if kmajor else rows)
                if per_row
                else (nprog, cols // 2 if half else cols),
                dtype=torch.float32,
                device=device,
            )
            for _f, per_row, half, g in self.reductions
        ]
        sizes_: tuple[int, ...] = (rows, cols, wk) if kmajor else (rows, cols)
        launch(kern, grid, *args, *outs, *copies, *reds, *sizes_, BM=bm, BC=bc, num_warps=warps)
        folded = [
            r
            if g
            else (combine_rule(fold).torch(r, 1) if kmajor else r)
            if per_row
            else combine_rule(fold).torch(r, 0)
            for r, (fold, per_row, _h, g) in zip(reds, self.reductions, strict=True)
        ]
        return (*outs, *folded, *copies)


def module_head(interpret: bool) -> list[str]:
    """The lines a generated kernel module starts with, up to its function's `def`: the imports, the
    helpers (libdevice's on a GPU, `tl`'s under the interpreter) and the decorator."""
    return [
        "import triton",
        "import triton.language as tl",
        _helpers(interpret),
        _COMMON_HELPERS,
        "",
        "@_jit",
    ]


def load_kernel(src: str, name: str, interpret: bool) -> Any:
    """The jitted function `name` of the generated module `src` (registered in linecache, where
    triton.jit reads its source through inspect); Triton's CPU interpreter's with `interpret`."""
    import triton  # noqa: F401  (the generated module imports it; fail here if it is missing)

    filename = f"<coda-triton {name} {abs(hash(src)):x}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
    namespace: dict[str, Any] = {"__name__": f"coda_triton_{name}", "_jit": _jit(interpret)}
    exec(compile(src, filename, "exec"), namespace)
    return namespace[name]


def _fold_expr(fold: str, acc: str, term: str) -> str:
    return f"{acc} + {term}" if fold == "sum" else f"{_COMBINE[fold]}({acc}, {term})"


def _to(x: str, dtype: torch.dtype) -> str:
    """`x` (an f32 block) converted for a store of `dtype`, rounded to nearest even as torch's `.to`
    (bf16 through `_bf16` first: Triton's CPU interpreter truncates; the conversion is then exact)."""
    if dtype == torch.bfloat16:
        return f"_bf16({x}).to(tl.bfloat16)"
    if dtype == torch.float16:
        return f'{x}.to(tl.float16, fp_downcast_rounding="rtne")'
    if dtype in _FP8:  # (saturated, rounded to nearest even, returned in the fp8 dtype)
        return f"{_FP8[dtype][0]}({x})"
    return f"{x}.to({_TL_DTYPES[dtype]})"


def _floating(dtype: str) -> bool:
    return dtype in ("f32", "bf16", "f16")


def _widen(load: str, dtype: str) -> str:
    return f"{load}.to(tl.float32)" if _floating(dtype) and dtype != "f32" else load


def _literal(v: Any) -> str:
    """A literal's Python text (a non-finite float as `float('inf')`, `float('nan')`, ...)."""
    return f"float('{v!r}')" if isinstance(v, float) and not math.isfinite(v) else repr(v)


def _jit(interpret: bool) -> Any:
    """The decorator of the generated functions: triton.jit, or Triton's CPU interpreter."""
    import triton

    if not interpret:
        return triton.jit
    return interpreted()


__all__ = ["TritonStage", "load_kernel", "module_head", "unsupported"]
