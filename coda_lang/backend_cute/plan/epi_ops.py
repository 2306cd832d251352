"""CuTeDSL epilogue ops of coda_lang's own, for what quack's frontend can't say with its library ops.

What it does: `GroupedReduce(name, combine="add"|"max"|"min"|"lse")` is a grouped reduction complete
inside a tile (`sum(x, over=N, group=g)`, and max, min, logsumexp): quack's `GroupedColStatsBase` (the machinery of its `HeadRstd`, the
per-head rstd of QK-norm) with the finalize left out. The emitted prepass fn returns the value to
reduce under the op's name; the op folds it per (row, run of g columns) in registers, deterministically
(a fixed butterfly, then a fixed-order fold of the per-warp smem planes, no atomics); the main fn
receives the op's name as a value port: the RAW fold of each element's group (`HeadRstd` bakes
`rsqrt(sum / g + eps)` into its finalize instead; coda computes whatever follows in the fn, so one op
serves every grouped sum, max, min or logsumexp; quack's base folds by add or max, min and lse are
ours). Its host argument is the group width as a plain int (a compile-time
constant; quack checks that it divides N and tile_N). `GroupedReduce(...).out(name)` is quack's
`GroupedColStatsOut`: it writes the fold to an f32 [m, N / g] buffer when the stage's result is used
after it. `BoundedColVecSelect(name, idx_op=)` is quack's `ColVecSelect` (pick: the value at column
idx[row] of each row) also leaving alone the rows whose index falls in the ragged last tile past N
(quack's guards rows past M and indices outside the tiles, not columns past N inside the last one).
`GroupColumnLoad(name, group)` is `expand(s, acc)` of s [M, N/g] at a tile whose N divides g: the
one column of s the tile's columns fall in, as quack's ColVecLoad reads a row vector.
`TileIndex(name, axis)` is `row_index()` (axis 0) / `col_index()` (axis 1): a value port giving each
element its global row or column index as an f32 (exact below 2**24; the runtime refuses larger
extents), computed from the epilogue's own coordinates, so nothing is loaded for it.
`BoundedColVecReduce` / `BoundedRowVecReduce` are quack's sum reductions (over the columns / the
rows) that leave out the elements past the end of the reduced dim in the ragged last tile: quack
folds them, counting on them being 0, but the epilogue's value there is f(acc=0, ...), e.g. exp(0)
or a constant, and the accumulator itself is NaN there in a row of A that holds an infinity
(padding.py's `padding_value` decides which sums need it: every sum over the columns of a value of
acc, sums over the rows where they are not 0 there for finite inputs); scaled
(one fma of two factors) or not. With `ragged_only` (a sum that is 0 there for finite inputs) only the
ragged last tile runs their selects, behind a branch uniform over the CTA.
NaN: every max and min these ops and quack's VecReduce fold is IEEE `maximum`/`minimum` (FMNMX.NaN: a
NaN operand gives NaN), as the interpreter's and torch's are; quack's own fold, `_vec_reduce_combine`,
is NaN-quiet (`maximumNumber`: it drops a NaN), so importing this module replaces that function in
quack's module with the NaN-propagating one (`_nan_vec_reduce_combine`, checked against quack's
signature); quack_adapter imports this module before any compile or launch.
What it does not: anything at trace time beyond quack's base class and that one function; it is
imported by emitted epilogue modules and quack_adapter (so importing it imports quack and CuTeDSL).
Invariants: `config_key` holds everything that changes the generated code, and `VERSION`, bumped with
any edit here (quack keys its disk cache of compiled kernels on an op's module, class name and
config_key, not on its source).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import cutlass
import cutlass.cute as cute
import quack.epilogue.ops as _quack_ops
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from quack.compile_utils import make_fake_tensor
from quack.epilogue.ops import (
    ColVecLoad,
    ColVecReduce,
    ColVecSelect,
    GroupedColStatsBase,
    RowVecReduce,
    Scalar,
    colvec_reduce_accumulate,
    rowvec_reduce_accumulate,
)

VERSION = 13


@cute.jit
def _nan_vec_reduce_combine(a: Any, b: Any, combine: Any) -> Any:
    """quack's VecReduce fold (add, max, max of |x|) with max NaN-propagating (FMNMX.NaN)."""
    if cutlass.const_expr(combine == "add"):
        return a + b
    return cute.arch.fmax(a, b, abs=combine == "max_abs", nan=True)


def _install_nan_fold() -> None:
    """quack's `_vec_reduce_combine(a, b, combine)`, which every VecReduce fold calls by its module-global
    name at trace time, replaced by `_nan_vec_reduce_combine` (once; a quack whose function has
    another signature is refused rather than patched blindly)."""
    cur = getattr(_quack_ops, "_vec_reduce_combine", None)
    if cur is _nan_vec_reduce_combine:
        return
    params = list(inspect.signature(getattr(cur, "__wrapped__", cur)).parameters) if cur else []
    if params != ["a", "b", "combine"]:
        raise ImportError(
            "quack.epilogue.ops._vec_reduce_combine(a, b, combine) not found: this quack is not the "
            "version coda_lang pins (its NaN-propagating max can't be installed)"
        )
    _quack_ops._vec_reduce_combine = _nan_vec_reduce_combine


_install_nan_fold()


def _install_int16_tiles() -> None:
    """quack's map of torch dtypes to CuTeDSL's (which its TileStore reads for a tensor's element type)
    taught int16, for a packed stage's fp8 pairs stored as one 16-bit word per element (Output.pairs:
    an int16 view of the fp8 buffer; quack's map has no 16-bit integer). Only added, never replaced:
    a quack that maps int16 already keeps its own."""
    import torch
    from quack.cute_dsl_utils import torch2cute_dtype_map

    torch2cute_dtype_map.setdefault(torch.int16, cutlass.Int16)


_install_int16_tiles()

_math: Any = cute.math  # CuTeDSL's math functions (exp, log: generated, so mypy can't see them)


def _lse2(a: Any, b: Any) -> Any:
    """log(exp(a) + exp(b)) = max + log(1 + exp(min - max)), an associative fold with identity -inf
    (one exp and one log per element, fast-math). Where a == b (two -inf, two +inf) the difference is
    taken as 0: max + log 2 is then -inf, +inf or the right value, never NaN."""
    hi = cute.arch.fmax(a, b, nan=True)  # a NaN operand gives NaN
    lo = cute.arch.fmin(a, b, nan=True)
    d = Float32(cutlass.select_(lo == hi, Float32(0.0), lo - hi))
    return hi + _math.log(Float32(1.0) + _math.exp(d, fastmath=True), fastmath=True)


# sin and cos for the epilogues: the argument reduced into [-pi, pi], then the hardware's sin.approx /
# cos.approx (absolute error 2^-20.9 on [-pi, pi]).
# - |x| <= FAST_TRIG (2^23; RoPE's angles reach position x frequency: 1.3e5 at 128k tokens): Cody-Waite,
#   2 pi in three f32 parts, each product with the multiple k exact inside an fma; the reduction's own
#   error stays below 1.3e-7 there (past 2^24 the three parts lose bits: at 1e30 the reduced value was
#   noise, and x * cos(1e30) with x = inf came out -inf or NaN where the interpreter gives +inf).
# - Beyond, behind a branch (as CUDA's sinf takes its slow path): `_reduce_big`, a Payne-Hanek reduction
#   by 64 bits of 1/(2 pi) in one short block of inline PTX, exact to 2^-37 at any finite argument;
#   inf and NaN give NaN, as the interpreter does.
# Why not libdevice's sinf/cosf for that slow path: their Payne-Hanek reduction (a loop over a local
# array) is inlined at every sin and cos of the epilogue, which the frontend unrolls over the tile: the
# Llama-3.2-1B QKV + RoPE stage's PTX grew from 3.6k to 31k lines and its kernel from 0.15 ms to 0.45
# ms (H200, M=8192), though the branch is never taken there.
FAST_TRIG = 2.0**23
_INV_TWO_PI = 0.15915493667125702
_TWO_PI_1 = 6.2831854820251465
_TWO_PI_2 = -1.7484555314695172e-07
_TWO_PI_3 = -7.105427357601002e-15
# the first 192 bits of the fraction 1/(2 pi) = 0.00101000101111100110..., six 32-bit words (2/pi's
# well-known 0xA2F9836E 0x4E441529 ... shifted right by two); tests/test_trig.py recomputes them
RECIP_TWO_PI_WORDS = (0x28BE60DB, 0x9391054A, 0x7F09D5F4, 0x7D4D3770, 0x36D8A566, 0x4F10E410)


def _big_reduction_ptx() -> str:
    """|x| = m 2^e (m the 24-bit significand, e = exponent - 23 >= 0 beyond 2^23): x / (2 pi) mod 1 is
    m times the 64 bits of 1/(2 pi) after its e-th, mod 2^64 (the bits before make whole turns; those
    after change it by less than m 2^-64 < 2^-40 turns). That product's low 64 bits, as a signed
    integer, are the turn in [-1/2, 1/2) times 2^64; times 2 pi / 2^64 in f64, the angle in [-pi, pi).
    The three words after bit e: a chain of selects (no local memory); shifts past a register's width
    clamp in PTX (shr of 64 bits by 64 - b is done as two shifts, so that b = 0 gives 0)."""
    c = [str(w) for w in RECIP_TWO_PI_WORDS]
    pick = []
    for out, k in (("c0", 0), ("c1", 1), ("c2", 2)):
        pick.append(f"selp.b32 {out}, {c[k + 1]}, {c[k]}, p1;")
        pick.append(f"selp.b32 {out}, {c[k + 2]}, {out}, p2;")
        pick.append(f"selp.b32 {out}, {c[k + 3]}, {out}, p3;")
    body = [
        ".reg .b32 xb, ex, mm, e, w, b, c0, c1, c2, sh;",
        ".reg .b64 A, B, W, P;",
        ".reg .f64 d;",
        ".reg .pred p1, p2, p3, pn, pf;",
        "mov.b32 xb, $1;",
        "bfe.u32 ex, xb, 23, 8;",
        "and.b32 mm, xb, 8388607;",
        "or.b32 mm, mm, 8388608;",
        "sub.u32 e, ex, 150;",
        "shr.u32 w, e, 5;",
        "and.b32 b, e, 31;",
        "setp.eq.u32 p1, w, 1;",
        "setp.eq.u32 p2, w, 2;",
        "setp.eq.u32 p3, w, 3;",
        *pick,
        "mov.b64 A, {c1, c0};",
        "cvt.u64.u32 B, c2;",
        "shl.b64 B, B, 32;",
        "shl.b64 W, A, b;",
        "sub.u32 sh, 63, b;",
        "shr.b64 B, B, sh;",
        "shr.b64 B, B, 1;",
        "or.b64 W, W, B;",
        "cvt.u64.u32 P, mm;",
        "mul.lo.u64 P, P, W;",
        "cvt.rn.f64.s64 d, P;",
        "mul.f64 d, d, 0d3C1921FB54442D18;",  # 2 pi / 2^64
        "cvt.rn.f32.f64 $0, d;",
        "setp.lt.s32 pn, xb, 0;",
        "@pn neg.f32 $0, $0;",
        "setp.gt.u32 pf, ex, 254;",  # inf, NaN: x - x is NaN
        "@pf sub.f32 $0, $1, $1;",
    ]
    return "{\n\t" + "\n\t".join(body) + "\n}"


_BIG_REDUCTION_PTX = _big_reduction_ptx()


def _f32_asm(ptx: str, x: Any, loc: Any, ip: Any) -> Any:
    """`ptx` (inline PTX, `$1` the f32 input, `$0` the f32 result, no side effects) applied to x."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            ptx,
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def _reduce_big(x: Any, *, loc: Any = None, ip: Any = None) -> Any:
    """x reduced into [-pi, pi) for |x| > FAST_TRIG (NaN for inf and NaN): `_big_reduction_ptx`."""
    return _f32_asm(_BIG_REDUCTION_PTX, x, loc, ip)


# x rounded to bf16 by rounding to odd, as an f32 (its low 16 bits cut, the kept part's last bit set
# when any cut bit was): rounding that to 2 or 3 significand bits (e5m2, e4m3) to nearest even gives
# what rounding x directly does, since bf16 keeps 8 (more than 2 extra bits: no double rounding). A
# NaN stays NaN (a cut payload sets the last bit), an infinity and zero stay as they are.
_ROUND_ODD_BF16_PTX = (
    "{\n\t.reg .b32 r, lo;\n\t.reg .pred p;\n\tmov.b32 r, $1;\n\tand.b32 lo, r, 65535;\n\t"
    "and.b32 r, r, -65536;\n\tsetp.ne.u32 p, lo, 0;\n\t@p or.b32 r, r, 65536;\n\tmov.b32 $0, r;\n}"
)


@dsl_user_op
def round_odd_bf16(x: Any, *, loc: Any = None, ip: Any = None) -> Any:
    """x rounded to bf16 by rounding to odd, kept in f32 (exactly a bf16 value): `_ROUND_ODD_BF16_PTX`."""
    return _f32_asm(_ROUND_ODD_BF16_PTX, x, loc, ip)


# the same into f16 (a packed stage of an f16 model): x rounded toward zero to f16, the last bit set
# when that was inexact (a NaN compares unequal: it stays NaN); f16 keeps 11 significand bits, 8 more
# than e5m2 and 7 more than e4m3, its range covers both after the fp8 clamp, and its subnormals reach
# 2^-24, below both fp8 dtypes' (2^-16, 2^-9): rounding the result to fp8 to nearest even is the direct
# rounding again
_ROUND_ODD_F16_PTX = (
    "{\n\t.reg .b16 h;\n\t.reg .f32 back;\n\t.reg .pred p;\n\tcvt.rz.f16.f32 h, $1;\n\t"
    "cvt.f32.f16 back, h;\n\tsetp.neu.f32 p, back, $1;\n\t@p or.b16 h, h, 1;\n\tcvt.f32.f16 $0, h;\n}"
)


@dsl_user_op
def round_odd_f16(x: Any, *, loc: Any = None, ip: Any = None) -> Any:
    """x rounded to f16 by rounding to odd, kept in f32 (exactly an f16 value): `_ROUND_ODD_F16_PTX`."""
    return _f32_asm(_ROUND_ODD_F16_PTX, x, loc, ip)


# A packed stage's 16-bit pairs, loaded as float32 words (Output.pairs: its C operand, a TileLoad of the
# [M, 2N] tile viewed as float32 [M, N]): lane 0, the even column, is the low half (the lower address),
# lane 1 the high half. A bf16 half is the top 16 bits of the f32 it widens to, exactly (NaN payloads
# and signs as they are): lane 0 shifted up, lane 1 with the low half cleared. An f16 half widens by cvt.
_LO_BF16_PTX = "{\n\t.reg .b32 w;\n\tmov.b32 w, $1;\n\tshl.b32 w, w, 16;\n\tmov.b32 $0, w;\n}"
_HI_BF16_PTX = "{\n\t.reg .b32 w;\n\tmov.b32 w, $1;\n\tand.b32 w, w, -65536;\n\tmov.b32 $0, w;\n}"
_LO_F16_PTX = "{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, $1;\n\tcvt.f32.f16 $0, l;\n}"
_HI_F16_PTX = "{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, $1;\n\tcvt.f32.f16 $0, h;\n}"


@dsl_user_op
def unpack_bf16x2(w: Any, *, loc: Any = None, ip: Any = None) -> tuple[Any, Any]:
    """The two bf16 lanes of a float32 word (lane 0: the low half), each as an f32 (exact)."""
    return _f32_asm(_LO_BF16_PTX, w, loc, ip), _f32_asm(_HI_BF16_PTX, w, loc, ip)


@dsl_user_op
def unpack_f16x2(w: Any, *, loc: Any = None, ip: Any = None) -> tuple[Any, Any]:
    """The two f16 lanes of a float32 word (lane 0: the low half), each as an f32 (exact)."""
    return _f32_asm(_LO_F16_PTX, w, loc, ip), _f32_asm(_HI_F16_PTX, w, loc, ip)


# A packed stage's double-width fp8 tile, loaded as int16 words (its C operand's pairs, Operand.host
# FP8_WORDS): quack's TileLoad widens each int16 to an exact f32, so the word comes back by a truncating
# cvt, and its two codes widen to f16 in one cvt (the low byte, lane 0, the even column, into the low
# half: the converse of `_pack_ptx`'s), then to f32: exact, NaN and infinities kept.
def _unpack_fp8_ptx(dtype: str, lane: int) -> str:
    half = "l" if lane == 0 else "h"
    return (
        "{\n\t.reg .b32 w, p;\n\t.reg .b16 c, u, l, h;\n\t"
        "cvt.rzi.s32.f32 w, $1;\n\tmov.b32 {c, u}, w;\n\t"
        f"cvt.rn.f16x2.{dtype}x2 p, c;\n\tmov.b32 {{l, h}}, p;\n\tcvt.f32.f16 $0, {half};\n}}"
    )


@dsl_user_op
def unpack_e4m3x2(w: Any, *, loc: Any = None, ip: Any = None) -> tuple[Any, Any]:
    """The two e4m3 lanes of an int16 word held as an f32 (lane 0: the low byte), each as an f32
    (exact): `_unpack_fp8_ptx`."""
    return _f32_asm(_unpack_fp8_ptx("e4m3", 0), w, loc, ip), _f32_asm(_unpack_fp8_ptx("e4m3", 1), w, loc, ip)


@dsl_user_op
def unpack_e5m2x2(w: Any, *, loc: Any = None, ip: Any = None) -> tuple[Any, Any]:
    """As unpack_e4m3x2, in e5m2."""
    return _f32_asm(_unpack_fp8_ptx("e5m2", 0), w, loc, ip), _f32_asm(_unpack_fp8_ptx("e5m2", 1), w, loc, ip)


def _pack_ptx(dtype: str) -> str:
    # cvt.rn.satfinite.<dtype>x2.f32 d, a, b puts a's code in the high byte and b's in the low one: so
    # lane 1 ($2) first. The word read as an int16 (-32768 to 32767) comes back as an exact f32, which
    # the TileStore converts to the int16 it stores (quack's stores have no uint16): the same 16 bits.
    # No f32 bit pattern reaches the store, so nothing on the way can canonicalize one
    return (
        "{\n\t.reg .b16 h;\n\t.reg .b32 w;\n\t"
        f"cvt.rn.satfinite.{dtype}x2.f32 h, $2, $1;\n\t"
        "cvt.s32.s16 w, h;\n\tcvt.rn.f32.s32 $0, w;\n}"
    )


_PACK_E4M3_PTX = _pack_ptx("e4m3")
_PACK_E5M2_PTX = _pack_ptx("e5m2")


def _f32x2_asm(ptx: str, a: Any, b: Any, loc: Any, ip: Any) -> Any:
    """`ptx` (`$1`, `$2` the f32 inputs, `$0` the f32 result, no side effects) applied to a, b."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
            ptx,
            "=f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def pack_e4m3x2(lo: Any, hi: Any, *, loc: Any = None, ip: Any = None) -> Any:
    """The e4m3 codes of two lanes (clamped to +-448 before: emit.saturate), rounded to nearest even,
    lane 0 in the low byte: the 16-bit word, read as an int16, as an exact f32 (an int16 TileStore
    stores it)."""
    return _f32x2_asm(_PACK_E4M3_PTX, lo, hi, loc, ip)


@dsl_user_op
def pack_e5m2x2(lo: Any, hi: Any, *, loc: Any = None, ip: Any = None) -> Any:
    """As pack_e4m3x2, in e5m2 (clamped to +-57344 before)."""
    return _f32x2_asm(_PACK_E5M2_PTX, lo, hi, loc, ip)


def _reduce_two_pi(x: Any) -> Any:
    k = _math.roundeven(x * Float32(_INV_TWO_PI))
    r = _math.fma(k, Float32(-_TWO_PI_1), x)
    r = _math.fma(k, Float32(-_TWO_PI_2), r)
    return _math.fma(k, Float32(-_TWO_PI_3), r)


@cute.jit
def _reduced(x: Any) -> Any:
    """x reduced into [-pi, pi]: Cody-Waite up to FAST_TRIG, `_reduce_big` beyond (and at inf, NaN)."""
    y = Float32(x)
    if _math.abs(y) <= Float32(FAST_TRIG):
        y = _reduce_two_pi(y)
    else:
        y = _reduce_big(y)
    return y


@cute.jit
def sin_rr(x: Any) -> Any:
    """sin(x) at any argument: the argument reduced (`_reduced`), then sin.approx."""
    return _math.sin(_reduced(x), approx=True)


@cute.jit
def cos_rr(x: Any) -> Any:
    """cos(x) at any argument: the argument reduced (`_reduced`), then cos.approx."""
    return _math.cos(_reduced(x), approx=True)


@cute.jit
def _nan_max(a: Any, b: Any) -> Any:
    return cute.arch.fmax(a, b, nan=True)


@cute.jit
def _nan_min(a: Any, b: Any) -> Any:
    return cute.arch.fmin(a, b, nan=True)


class GroupedReduce(GroupedColStatsBase):
    """Per-(row, group of columns) sum, max or min of what the prepass fn returns under `name`; the main
    fn reads the raw result at every element of the group."""

    def __init__(self, name: str, combine: str = "add"):
        if combine not in ("add", "max", "min", "lse"):
            raise ValueError(f"GroupedReduce folds by add, max, min or lse, not {combine!r}")
        super().__init__(name)
        # "max" from a -inf identity, "min" from +inf: exact here because a group never straddles the end
        # of N (quack validates N % width == 0), so the zeros of out-of-bounds columns fill only unused
        # groups
        self.combine = combine

    def config_key(self) -> tuple[Any, ...]:
        return (self.combine, VERSION)

    # quack's base folds by add or max (NaN-quiet); max and min (NaN-propagating, from -inf / +inf) and
    # lse (`_lse2` from -inf) are ours, used
    # by the fold, the butterfly, the smem planes' fold and the GroupedColStatsOut writer alike
    def _combine_op(self) -> Any:
        return {"max": _nan_max, "min": _nan_min, "lse": _lse2}.get(self.combine) or super()._combine_op()

    def _fold_identity(self) -> float:
        return {"min": math.inf, "lse": -math.inf}.get(self.combine) or super()._fold_identity()

    @cute.jit
    def stat_value(self, total: Any, group_cols: int) -> Any:
        return total


@cute.jit
def _fill_past(
    frag: Any,
    coords: Any,
    limit: Any,
    tile_shape_mn: Any,
    dim: cutlass.Constexpr[int],
    fill: cutlass.Constexpr[float],
) -> None:
    """frag's elements at or past `limit` along tile dim `dim` (0: rows, 1: columns; `limit` counts
    from the tile's start) set to `fill`, in place. `coords`: the fragment's coordinates in the tile,
    partitioned like frag. An element's coordinate is coords[0]'s plus a static offset, so the offset
    (a constant per element) is compared with limit - coords[0]'s. Only the ragged last tile along
    `dim` has such elements: every other tile skips the selects (a branch uniform over the CTA)."""
    along = cute.composition(
        cute.make_layout(tile_shape_mn, stride=(1, 0) if dim == 0 else (0, 1)), coords.layout
    )
    left = limit - coords[0][dim]
    for i in cutlass.range(cute.size(frag), unroll_full=True):
        frag[i] = frag[i] if cute.crd2idx(i, along) < left else Float32(fill)


class BoundedColVecSelect(ColVecSelect):
    """pick(x, idx): quack's ColVecSelect, except that an index in [N, the end of the last column tile)
    selects nothing. quack compares idx[row] with the tile's columns, and the ragged last tile's columns
    past N hold the epilogue's value of a zero accumulator, so such an index (an out-of-range target)
    would write that value; the interpreter leaves the row alone (0, the runtime's fill). Before
    quack's select runs, the elements of this sink's fragment past N are set to -inf, the value
    ColVecSelect's store treats as "no match" (the fragment is this sink's own copy). The N limit is
    appended to quack's state (begin, begin_loop) and taken off again before quack's flush sees it.
    """

    _NEG_INF = -math.inf

    def config_key(self) -> tuple[Any, ...]:
        return (*super().config_key(), "bounded_n", VERSION)

    @cute.jit
    def begin(self, gemm: Any, param: Any, smem_tensor: Any, ctx: Any) -> Any:
        state = ColVecSelect.begin(self, gemm, param, smem_tensor, ctx)
        limit_n = (
            ctx.varlen_manager.len_n() - ctx.tile_coord_mnkl[1] * ctx.tile_N
        )  # columns left, tile-relative
        return (*state, limit_n)

    @cute.jit
    def begin_loop(self, gemm: Any, state: Any, epi_coord: Any) -> Any:
        return (*ColVecSelect.begin_loop(self, gemm, state[:-1], epi_coord), state[-1])

    @cute.jit
    def fn_sink_flush(self, gemm: Any, state: Any, frag: Any) -> None:
        limit_n = state[-1]
        inner = state[:-1]
        coords = inner[2]  # this subtile's (row, column) coordinates in the tile, partitioned like frag
        if limit_n < gemm.cta_tile_shape_mnk[1]:  # the ragged last tile only (uniform over the CTA)
            _fill_past(frag, coords, limit_n, gemm.cta_tile_shape_mnk[:2], 1, self._NEG_INF)
        ColVecSelect.fn_sink_flush(self, gemm, inner, frag)


class _Bounded:
    """Mixed into a quack VecReduce: its out-of-bounds mask (quack's `check_oob` machinery, which it
    runs for max only) on for every combine, filling the fold's identity (0 for add and max_abs, -inf
    for max). The mask compares each element's offset along the reduced dim (a constant per element)
    with the elements left in this tile, as quack's own max mask does."""

    combine: str

    def __init__(self, name: str, combine: str = "add", scaled: bool = False, ragged_only: bool = False):
        super().__init__(name, combine=combine, scaled=scaled)  # type: ignore[call-arg]
        self.ragged_only = ragged_only  # the selects in the ragged last tile only (behind a branch)

    def config_key(self) -> tuple[Any, ...]:
        return (*super().config_key(), "bounded", self.ragged_only, VERSION)  # type: ignore[misc]

    def _mask_oob_active(self) -> bool:
        return True

    @cute.jit
    def _mask_oob(self, frag: Any, coords: Any, limit: Any, tile_shape_mn: Any) -> None:
        _fill_past(
            frag,
            coords,
            limit,
            tile_shape_mn,
            self._reduce_dim(),  # type: ignore[attr-defined]
            -math.inf if self.combine == "max" else 0.0,
        )

    @cute.jit
    def fn_sink_flush(self, gemm: Any, state: Any, frag: Any, scale: Any = None) -> None:
        """quack's flush, with both factors of a scaled sum (`sum(h * h)`, folded as one fma of its
        (value, scale) fragments) masked: past the end, the accumulator of a row of A holding an
        infinity is inf * 0 = NaN, and a zero value times a NaN scale would still be NaN."""
        acc, coords, limit = state
        tile = gemm.cta_tile_shape_mnk[:2]
        if cutlass.const_expr(self.ragged_only):
            if limit < tile[self._reduce_dim()]:  # type: ignore[attr-defined]  # (uniform over the CTA)
                self._mask_oob(frag, coords, limit, tile)
                if cutlass.const_expr(scale is not None):
                    self._mask_oob(scale, coords, limit, tile)
        else:
            self._mask_oob(frag, coords, limit, tile)
            if cutlass.const_expr(scale is not None):
                self._mask_oob(scale, coords, limit, tile)
        if cutlass.const_expr(self.dim == 0):  # type: ignore[attr-defined]
            colvec_reduce_accumulate(gemm, acc, frag, rScale=scale, combine=self.combine)
        else:
            rowvec_reduce_accumulate(gemm, acc, frag, rScale=scale, combine=self.combine)


class BoundedColVecReduce(_Bounded, ColVecReduce):
    """sum over the columns (one partial per row and column tile), the columns past N left out."""


class BoundedRowVecReduce(_Bounded, RowVecReduce):
    """sum over the rows (one partial per column and row tile), the rows past M left out."""


class TileIndex(Scalar):
    """row_index() (axis 0) / col_index() (axis 1) as an apply port: the fn calls `name(acc)` where it
    needs the index and gets the element's global row or column index as an f32 (what the stage's
    comparisons with an i32 vector, loaded as f32 too, need; exact while the extent stays below
    2**24). The index is the element's coordinate in the tile (quack's epilogue partition of an
    identity tensor, sliced per subtile as ColVecSelect slices its coordinates) plus the tile's offset
    plus the op's host scalar (an Int32 immediate the runtime passes as 0: quack compiles an op out
    when its argument is None, and the Scalar schema gives this op an argument that costs no load).
    Computed per element at its use rather than as a dense fragment per subtile, so that it holds no
    registers across the subtile (a fragment of indices made a 128x192 tile spill). SM90 element mode
    only (the planner refuses index values in paired and packed stages)."""

    fn_port = "apply"

    def __init__(self, name: str, axis: int):
        if axis not in (0, 1):
            raise ValueError(f"TileIndex axis is 0 (rows) or 1 (columns), not {axis!r}")
        super().__init__(name, dtype=Int32)
        self.axis = axis

    def config_key(self) -> tuple[Any, ...]:
        return (*super().config_key(), self.axis, "tile_index", VERSION)

    @cute.jit
    def begin(self, gemm: Any, param: Any, smem_tensor: Any, ctx: Any) -> Any:
        coords = ctx.partition_for_epilogue_fn(cute.make_identity_tensor((ctx.tile_M, ctx.tile_N)))
        extent = ctx.tile_M if cutlass.const_expr(self.axis == 0) else ctx.tile_N
        base = ctx.tile_coord_mnkl[self.axis] * extent + Int32(param)
        return (coords, base)

    @cute.jit
    def begin_loop(self, gemm: Any, state: Any, epi_coord: Any) -> Any:
        coords, base = state
        return (coords[None, None, None, epi_coord[0], epi_coord[1]], base)

    def fn_prepare(self, gemm: Any, state: Any, paired: bool) -> Any:
        assert not paired, "TileIndex: element mode only"
        return state

    def fn_apply(self, gemm: Any, pstate: Any, i: Any, value: Any) -> Any:
        cur, base = pstate
        return Float32(cur[i][self.axis] + base)


class GroupColumnLoad(ColVecLoad):
    """`expand(s, acc)` of a matrix s [M, N/g] (one value per row and run of g columns of the tile
    space): at a tile whose N divides g, every column of the tile falls in one run, so the tile reads
    one column of s, `s[:, tile's first column / g]`, as quack's ColVecLoad reads a row vector (the
    fn receives each element's row value). The planner keeps such a stage at tiles with tile_N
    dividing g (config.rules) and element mode (refusals.check_grouped_mode)."""

    def __init__(self, name: str, group: int):
        if group < 1:
            raise ValueError(f"GroupColumnLoad group is a whole number of columns, not {group!r}")
        super().__init__(name)
        self.group = group

    def config_key(self) -> tuple[Any, ...]:
        return (self.group, "group_column", VERSION)

    def host_fake_arg(self, key: Any, fctx: Any) -> Any:
        dtype, _ = key
        return make_fake_tensor(dtype, (fctx.m, cute.sym_int()), leading_dim=1, divisibility=1)

    @cute.jit
    def _get_gmem_vec(self, param: Any, ctx: Any) -> Any:
        return param[None, ctx.tile_coord_mnkl[1] * ctx.tile_N // self.group]
