"""A per-element bound on how far another correct implementation of a block may be from the interpreter.

What it does: `run(block, inputs)` and `vjp(block, inputs, cotangents)` run the interpreter in its
exact precision, whole-matrix mode (the fuzzer's reference), and alongside every value `x` an array
`E(x)` bounding |x' - x|, where x' is the same value computed by an implementation that rounds where
the interpreter rounds (stored tiles, casts) but orders and fuses its f32 arithmetic its own way and
uses fast-math functions: a kernel, the emulated kernels, the tile simulation. It is a running error
bound, propagated through the program one equation at a time:
- an f32 result of an op gets its inputs' bounds through the op (|b| E(a) + |a| E(b) for a * b; for a
  function, how far f moves when its input moves by E: max |f(x +- E) - f(x)|) plus the op's own
  rounding in both implementations (`INJECT`, relative; larger for the fast-math tanh/GELU);
- a sum of n terms gets the sum of their bounds plus `gamma(n)` * sum |terms| (the two summation
  orders), a GEMM `|A| @ E(B) + E(A) @ |B| + 2 K u |A| @ |B|` (plus `FP8_MMA_U |A| @ |B|` for two fp8
  operands: the tensor cores' fp8 accumulation keeps fewer bits): this is where cancellation shows: the
  bound of a sum is relative to the magnitudes that cancelled, not to the (tiny) result;
- a max/min keeps the largest bound (it is 1-Lipschitz); an ordering comparison whose operands are
  closer than their bounds may come out either way, and `where` then may pick either branch; `==` and
  `!=` are judged exactly (a backward finds a max's ties by comparing the very values the forward
  compared, so a tie that flips is a bug to report, not rounding);
- an infinity or NaN that comes from an exact infinite or NaN operand has bound 0 (IEEE gives it in
  any order of the arithmetic), and 0 times any bound is 0; a value that overflowed from finite
  operands, or a bound nothing is known of, is unbounded (inf), never NaN;
- a value rounded to bf16/f16 or fp8 has bound 0 where no value within its bound rounds differently
  (both implementations then store the same number), else the distance to what it may round to (up
  to one ulp: 2^-7 relative for bf16, 2^-3 for e4m3, whose unit roundoff is 2^-4, 2^-2 for e5m2); an
  fp8 store saturates, so values beyond its largest one all store it (bound 0 there);
- a value that another correct implementation may have as anything, NaN included, has bound `ANY`
  (-inf, never a real bound): an infinity times (or over) a value whose bound reaches 0 (inf * sin(x)
  where sin's fast-math twin may give 0 or the other sign: inf, -inf or NaN), 0 / 0 within the
  bounds, a function that is NaN within its operand's bound (log, sqrt near 0) or a number within
  it where it is NaN here (rsqrt of a sum that is -47 here, within its bound of 0); everything computed
  from it is `ANY` too, but a comparison (which may then flip: bound 1), a `where` whose chosen branch
  is not `ANY`, and values moved elsewhere.
The inputs, cotangents and literals are the same on both sides (bound 0). Which of these rules an op
follows, and what it adds of its own, is its OpDef's `bound` (a `BoundRule` and its `own` rounding, in
coda_lang/ops/): this module implements the rules and names no op.
What it does not: decide whether a result passes (testing/compare.py), or bound discrete jumps beyond
one comparison (a max's tie, an index that may change); those elements get large or infinite bounds,
and the other parts of the tolerance rule judge them.
Invariants: the values are exactly `Block.run`'s / `Block.vjp`'s in "exact" precision (the same
interpreter, hooks only add the bounds); every bound is >= 0 (inf where nothing is known) or `ANY`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from coda_lang.autodiff.options import BackwardOptions
from coda_lang.core.numerics import round_to
from coda_lang.interp.inputs import bind, check_sizes
from coda_lang.interp.run import Interpreter, _Tile, _type, _type_or_none
from coda_lang.ir.nodes import Atom, Eqn, Stage, Var
from coda_lang.ir.types import GROUP, PARTIAL, TILE, Dim, is_fp8
from coda_lang.ops import REGISTRY, BoundRule, OpDef, StageShape, grouped_reads
from coda_lang.ops.registry import F32_U, FASTMATH_ROUNDING, repeats_in

U = F32_U  # f32's unit roundoff
F32_TINY = float(np.finfo(np.float32).tiny)  # f32's smallest normal, 2^-126


def gamma(n: int) -> float:
    """The bound on the difference of two f32 sums of the same n terms in different orders, relative to
    the sum of their magnitudes: 4 sqrt(n) u (rounding errors of a sum grow as sqrt(n) with high
    probability; a worst case of n u would hide the bugs the bound is for)."""
    return 4.0 * np.sqrt(max(n, 1)) * U


def gamma_gemm(k: int) -> float:
    """A GEMM's K-term accumulation in two implementations (tensor cores may truncate: k u each)."""
    return 2.0 * max(k, 1) * U


# Hopper's fp8 WGMMA keeps about 14 bits while it accumulates the products of one instruction (the
# sum is aligned to its largest term and the rest truncated; DeepSeek-V3's report measured it), before
# quack adds each K tile's result into f32: a GEMM of two fp8 operands may be this far off, relative to
# the sum of the magnitudes of its products (twice the 14 bits' unit)
FP8_MMA_U = 2.0**-12

ANY = -np.inf  # the bound of a value another correct implementation may have as anything, NaN included


def _any(e: Any) -> Any:
    """Where bound `e` is `ANY`."""
    return np.asarray(e) == ANY


def _near_zero(x: Any, e: Any) -> Any:
    """Where a value `x` with bound `e` may be 0 or of the other sign in another implementation (its
    bound reaches 0; an exact 0 is exact), or may be anything."""
    x, e = np.asarray(x, np.float64), np.asarray(e, np.float64)
    with np.errstate(invalid="ignore"):
        return ((e > 0) & ~(np.abs(x) > e)) | (e == ANY)


def _infinite(x: Any) -> Any:
    """Where `x` is +-inf (a float array; integers and booleans never are)."""
    x = np.asarray(x)
    return np.isinf(x) if x.dtype.kind == "f" else np.zeros(x.shape, bool)


DEFAULT_INJECT = FASTMATH_ROUNDING  # an op's own rounding, in both implementations (fast-math: a few ulps)


def _times(mag: Any, err: Any) -> Any:
    """mag * err, 0 where either is 0 (an exact operand moves nothing, even beside an infinite one)."""
    mag, err = np.asarray(mag), np.asarray(err)
    with np.errstate(invalid="ignore"):
        # (a NaN magnitude, a NaN value's, against a nonzero bound: unbounded)
        return np.where((err == 0) | (mag == 0), 0.0, np.where(np.isnan(mag * err), np.inf, mag * err))


def _exact_nonfinite(y: Any, xs: list[Any], es: list[Any]) -> Any:
    """Where `y` is +-inf or NaN because an exact operand there is (a non-finite value with bound 0):
    IEEE arithmetic on an infinity or a NaN gives the same non-finite value in any order (inf + finite,
    inf * x, inf - inf, NaN with anything), so another implementation has it too: its bound is 0. Not
    where an operand is non-finite with a nonzero bound (one that overflowed may be finite elsewhere),
    nor where `y` overflowed from finite operands."""
    y = np.asarray(y)
    if y.dtype.kind != "f":
        return np.zeros(y.shape, bool)
    exact = np.zeros(y.shape, bool)
    loose = np.zeros(y.shape, bool)
    for x, e in zip(xs, es, strict=True):
        x = np.asarray(x)
        if x.dtype.kind != "f":
            continue
        shape = np.broadcast_shapes(x.shape, y.shape)
        bad = np.broadcast_to(~np.isfinite(x), shape)
        zero = np.broadcast_to(np.asarray(e) == 0, shape)
        exact = exact | (bad & zero)
        loose = loose | (bad & ~zero)
    return ~np.isfinite(y) & exact & ~loose


def _exact_along(x: np.ndarray, e: Any, axis: int) -> Any:
    """Along `axis`: some element is an exact infinity or NaN (bound 0), and none is a non-finite
    value with a nonzero bound."""
    bad = ~np.isfinite(x)
    return np.any(bad & (e == 0), axis=axis) & ~np.any(bad & (e != 0), axis=axis)


def _exact_sum(x: np.ndarray, e: np.ndarray, y: Any, axis: int) -> Any:
    """Where a sum (or log-sum-exp) over `axis` is non-finite because an exact term is (as
    `_exact_nonfinite`)."""
    return _exact_along(x, e, axis) & ~np.isfinite(y)


def _mag_matmul(mag: np.ndarray, err: np.ndarray) -> np.ndarray:
    """mag @ err for magnitudes and bounds (both >= 0), where 0 times anything is 0: a non-finite
    entry (an infinite magnitude, a NaN input's, an unknown bound) counts only against a nonzero
    entry on the other side, and makes that sum unbounded (inf), never NaN."""
    mag, err = np.asarray(mag, np.float64), np.asarray(err, np.float64)
    bad_m, bad_e = ~np.isfinite(mag), ~np.isfinite(err)
    out = np.where(bad_m, 0.0, mag) @ np.where(bad_e, 0.0, err)
    if bad_m.any() or bad_e.any():
        unb = bad_m.astype(np.float64) @ (err != 0).astype(np.float64) + (mag != 0).astype(
            np.float64
        ) @ bad_e.astype(np.float64)
        out = np.where(unb > 0, np.inf, out)
    return out


def _inject(op: OpDef, x: list[np.ndarray], y: np.ndarray) -> np.ndarray:
    """The bound an op adds of its own: its result rounded (and approximated) in both implementations,
    by its `Bound.own` rule. (An infinite operand adds nothing through its size: the op's result there
    is exact, +-inf, 0 or NaN, or the operand's own bound already covers it.)"""
    finite_x = np.ones(np.shape(y), bool)
    for v in x:
        finite_x = finite_x & (np.isfinite(v) if np.asarray(v).dtype.kind == "f" else True)
    # |y|; 0 where y is non-finite because an operand is; inf where y overflowed from finite operands
    ay = np.where(np.isfinite(y), np.abs(y), np.where(finite_x, np.inf, 0.0))
    ax = np.where(np.isfinite(x[0]), np.abs(x[0]), 0.0) if x else 0.0
    # a result below f32's smallest normal may come out 0: flushed (fast-math, FTZ) or underflowed in
    # another formula (1 / (1 + exp(-x)) for sigmoid(-90), whose value is 7e-40). Subnormal results
    # (of the interpreter's float64 too) are within that of 0
    flushed = np.where(ay < F32_TINY, ay, 0.0)
    return np.maximum(np.asarray(op.bound.own(ax, ay), np.float64), flushed)


def _f64(x: Any) -> Any:
    a = np.asarray(x)
    return a.astype(np.float64) if a.dtype.kind in "fiu" else a


def _rounding(x: Any, e: Any, dtype: str) -> Any:
    """The bound of `x` (computed with bound `e`) after rounding to `dtype` (the exact precision's
    rounding): the farthest that anything within `e` of `x` rounds from where `x` rounds."""
    if dtype == "f32" or dtype == "bool":
        return e
    if np.isscalar(e) and e in (0, ANY):
        return 0.0 if e == 0 else ANY
    x = np.asarray(x, np.float64)
    e = np.broadcast_to(np.asarray(e, np.float64), x.shape)
    with np.errstate(all="ignore"):
        here = round_to(x.astype(np.float32), dtype, "exact").astype(np.float64)
        lo = round_to((x - e).astype(np.float32), dtype, "exact").astype(np.float64)
        hi = round_to((x + e).astype(np.float32), dtype, "exact").astype(np.float64)
        out = np.maximum(np.abs(hi - here), np.abs(here - lo))
        # the same number whatever moved (both overflow to inf): 0; a difference of infinities: inf
        out = np.where((hi == here) & (lo == here), 0.0, np.where(np.isnan(out), np.inf, out))
    return np.where(e == 0, 0.0, np.where(e == ANY, ANY, out))


def rounded(x: Any, e: Any, dtype: str) -> Any:
    """The bound of `x` (with bound `e`) once rounded to `dtype`: where a caller rounds an
    interpreter's value itself (an fp8 leaf's gradient, which autograd returns in the leaf's dtype)."""
    return _rounding(np.asarray(x, np.float64), e, dtype)


class Bounds(Interpreter):
    """The interpreter (exact precision, whole mode) with a bound for every value (module docstring)."""

    def __init__(self, block: Any, plan: Any, dims: dict[str, int]):
        super().__init__(block, plan, dims, "exact", None)
        self.err: dict[str, Any] = {}  # name -> bound of a block-level value (0.0: none)
        self.serr: dict[str, Any] = {}  # name -> bound of a value of the stage running now
        self.out_err: dict[str, Any] = {}
        # name -> (op, params, operand type, operand, its bound) of each partial log-sum-exp in a stage:
        # a tile's partial is bounded from its own terms (`partials`), not from the whole reduction's
        self.lse_terms: dict[str, tuple[OpDef, dict[str, Any], Any, Any, Any]] = {}
        self.outputs: dict[str, np.ndarray] = {}  # (`evaluate`'s: the run's outputs and their bounds)
        self.output_bounds: dict[str, Any] = {}

    def run_bounds(
        self, env: dict[str, np.ndarray], err: dict[str, Any]
    ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        self.err = dict(err)
        with np.errstate(all="ignore"):
            outs = self.run(env)
        return outs, {
            k: np.broadcast_to(np.asarray(v, np.float64), np.shape(outs[k])) for k, v in self.out_err.items()
        }

    # ------------------------------------------------------------------ hooks of the interpreter

    def stage(self, s: Stage) -> None:
        self.serr = {}
        super().stage(s)
        self.serr = {}

    def gemm(self, s: Stage) -> np.ndarray:
        acc = super().gemm(s)
        assert isinstance(s.a, Var) and isinstance(s.b, Var)
        a, b = _f64(self.env[s.a.name]), _f64(self.env[s.b.name])
        ea = np.broadcast_to(self.err.get(s.a.name, 0.0), a.shape)
        eb = np.broadcast_to(self.err.get(s.b.name, 0.0), b.shape)
        if s.ta:
            a, ea = a.T, ea.T
        if s.tb:
            b, eb = b.T, eb.T
        k = a.shape[1]
        if s.scaled:  # the operands scaled block by block, as exact values (two more roundings a term)
            a, ea, b, eb = self.scaled_operands(s, a, ea, b, eb)
            k += 2
        aa, ab = np.abs(a), np.abs(b)
        with np.errstate(invalid="ignore"):  # inf * 0 in sum |a| |b|: acc is NaN there, unbounded
            mag = aa @ ab
        mag = np.where(np.isnan(mag), np.inf, mag)
        e = _mag_matmul(aa, eb) + _mag_matmul(ea, ab) + _mag_matmul(ea, eb) + gamma_gemm(k) * mag
        if is_fp8(self.plan.operand_dtype(s.a)) and is_fp8(self.plan.operand_dtype(s.b)):
            e = e + FP8_MMA_U * mag  # (the fp8 tensor cores' accumulation: FP8_MMA_U)
        # a row of A or a column of B holding an exact infinity or NaN: acc is non-finite there in any
        # order of the sum (module docstring), and another implementation's is the same
        xa, xb = _exact_along(a, ea, 1), _exact_along(b, eb, 0)
        e = np.where((xa[:, None] | xb[None, :]) & ~np.isfinite(acc), 0.0, e)
        # anything: an infinity times a term that may be 0 or of the other sign, a term that may be anything
        f = np.float64
        anything = (_infinite(a).astype(f) @ _near_zero(b, eb).astype(f)) + (
            _near_zero(a, ea).astype(f) @ _infinite(b).astype(f)
        )
        anything = (anything > 0) | np.any(_any(ea), axis=1)[:, None] | np.any(_any(eb), axis=0)[None, :]
        self.serr["acc"] = np.where(anything, ANY, e)
        return acc

    def scaled_operands(
        self, s: Stage, a: np.ndarray, ea: np.ndarray, b: np.ndarray, eb: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """A scaled GEMM's operands (as multiplied: [M, K] and [K, N]) times their block scales, in
        float64, with their bounds: each scale's own bound carried (|x| e_s + e_x |s| + e_x e_s)."""
        g, sa, sb = self.block_scales(s)
        esa = esb = np.zeros(1)
        for sc, t, m in ((s.scale_a, s.ta, "a"), (s.scale_b, s.tb, "b")):
            if isinstance(sc, Var):
                e = np.asarray(self.err.get(sc.name, 0.0), np.float64)
                shape = np.shape(self.env[sc.name])
                e = np.broadcast_to(e, shape)
                e = e.T if t else e
                if m == "a":
                    esa = np.repeat(e, sa.shape[0] // e.shape[0], axis=0)
                else:
                    esb = np.repeat(e, sb.shape[1] // e.shape[1], axis=1)
        xa, xea = np.repeat(_f64(sa), g, axis=1), np.repeat(np.broadcast_to(esa, sa.shape), g, axis=1)
        xb, xeb = np.repeat(_f64(sb), g, axis=0), np.repeat(np.broadcast_to(esb, sb.shape), g, axis=0)
        with np.errstate(invalid="ignore", over="ignore"):
            ea2 = np.where(_any(ea) | _any(xea), ANY, np.abs(a) * xea + ea * np.abs(xa) + ea * xea)
            eb2 = np.where(_any(eb) | _any(xeb), ANY, np.abs(b) * xeb + eb * np.abs(xb) + eb * xeb)
            return a * xa, ea2, b * xb, eb2

    def store(self, name: str, x: Any, dtype: str | None) -> None:
        super().store(name, x, dtype)
        e = self.serr[name] if name in self.serr else self.err.get(name, 0.0)
        self.err[name] = _rounding(x, e, dtype) if dtype else e

    def output(self, name: str, dtype: str) -> np.ndarray:
        out = super().output(name, dtype)
        self.out_err[name] = _rounding(self.env[name], self.err.get(name, 0.0), dtype)
        return out

    def apply(
        self, e: Eqn, vals: list[Any], t: _Tile | None, senv: dict[str, Any] | None = None
    ) -> tuple[Any, ...]:
        outs = super().apply(e, vals, t, senv)
        grouped = t is not None and bool(grouped_reads((e,), StageShape(t.rows, t.cols), _type_or_none))
        errs = [self.bound_of(a, vals[i], t, senv, i == 0 and grouped) for i, a in enumerate(e.ins)]
        # a vector repeating across a tile's columns: its value and its bound laid out as apply lays it
        vals, errs = self.repeat_operands(e, vals, t), self.repeat_operands(e, errs, t)
        bounds = self.rule(e, vals, errs, outs, t, senv)
        where = self.serr if t is not None else self.err
        for v, b in zip(e.outs, bounds, strict=True):
            where[v.name] = b
        return outs

    # ------------------------------------------------------------------ the rules

    def bound_of(
        self, a: Atom, x: Any, t: _Tile | None, senv: dict[str, Any] | None, grouped: bool = False
    ) -> Any:
        """The bound of operand `a` (value `x`), placed as the interpreter places its value (`grouped`:
        a matrix read over groups of the tile, each element its group's)."""
        if not isinstance(a, Var):
            return 0.0  # a literal or a dim: the same number on both sides
        if senv is not None and a.name in senv:
            return self.serr.get(a.name, 0.0)
        e = self.err.get(a.name, 0.0)
        if np.ndim(e) == 0 or t is None:
            return e
        full = self.env[a.name]
        if grouped and full.ndim == 2:
            return self.grouped_tile(np.broadcast_to(e, full.shape), t)
        if full.ndim == 2:
            return e[t.r0 : t.r1, t.col_slice(_type(a).shape[1])]
        if full.ndim == 1:
            if _type(a).shape[0] == t.rows:
                return e[t.r0 : t.r1, None]
            if repeats_in(_type(a).shape[0], t.rows, t.cols):  # whole: repeated as apply repeats it
                return e[None, :]
            return e[None, t.col_slice(_type(a).shape[0])]
        return e

    def rule(
        self,
        e: Eqn,
        vals: list[Any],
        errs: list[Any],
        outs: tuple[Any, ...],
        t: _Tile | None,
        senv: dict[str, Any] | None,
    ) -> list[Any]:
        op = REGISTRY[e.op]
        outs_t = [_type(v) for v in e.outs]
        params = {k: v for k, v in e.params}
        rule = op.bound_rule
        if op.locality.per_element and outs_t[0].kind == TILE:
            # grouped values broadcast over their groups' columns (as apply does)
            grouped = [
                _type(a).kind == GROUP and (senv is None or isinstance(a, Var) and a.name in senv)
                for a in e.ins
            ]
            vals = [
                np.repeat(x, _type(a).group or 1, axis=_type(a).group_axis) if g else x
                for a, x, g in zip(e.ins, vals, grouped, strict=True)
            ]
            errs = [
                np.repeat(x, _type(a).group or 1, axis=_type(a).group_axis) if g and np.ndim(x) else x
                for a, x, g in zip(e.ins, errs, grouped, strict=True)
            ]
        if rule is BoundRule.REDUCE:
            if outs_t[0].kind == GROUP and outs_t[0].group_axis == 0:
                params["_rows"] = True  # runs of rows (the layout run.py's apply reduces)
            if outs_t[0].kind == PARTIAL and op.combine is not None and op.combine.name == "lse":
                self.lse_terms[e.outs[0].name] = (op, dict(params), _type(e.ins[0]), vals[0], errs[0])
            b = self.reduce(op, params, _type(e.ins[0]), vals[0], errs[0], outs[0], t)
            return [np.where(self.reduced_any(params, _type(e.ins[0]), vals[0], errs[0], t), ANY, b)]
        if rule is BoundRule.GATHER:
            x, idx = vals
            ex = np.broadcast_to(np.asarray(errs[0], np.float64), np.shape(x))
            assert t is not None and op.impl is not None
            idx = np.asarray(idx).reshape(-1)
            if _type(e.ins[1]).shape[0] == t.rows:  # the picked element's bound, as the value is picked
                return [op.impl(ex, idx, 1, t.col_slice(_type(e.ins[0]).shape[1]).start)]
            return [op.impl(ex, idx, 0, t.r0)]
        if rule is BoundRule.FOLD:  # runs of a vector added up: a sum of as many terms as runs
            x = _f64(vals[0]).reshape(-1)
            n = np.size(outs[0])
            ex = np.broadcast_to(np.asarray(errs[0], np.float64), x.shape).reshape(-1, n)
            b = self.summed(x.reshape(-1, n), ex, _f64(outs[0]), 0)
            return [np.where(np.any(_any(ex.reshape(-1, n)), axis=0), ANY, b)]
        if rule is BoundRule.EXACT:
            # == and != are judged exactly: the backward's ties compare the values the forward computed
            # (bit for bit, by design), and integers (picks, indices) are exact anyway; but an operand
            # that may be anything makes a comparison that may flip (1) and an integer anything
            tainted = self.tainted(errs)
            if tainted is None:
                return [0.0] * len(outs)
            return [np.where(tainted, 1.0 if np.asarray(y).dtype == np.bool_ else ANY, 0.0) for y in outs]
        assert op.locality.per_element, f"no rounding bound for `{op.name}` ({op.locality}, {rule})"
        bounds = self.pointwise(op, params, vals, errs, outs)
        tainted = self.tainted(errs) if rule not in (BoundRule.MOVE, BoundRule.BRANCH) else None
        if tainted is None:  # (MOVE moves `ANY` with the values; BRANCH decides for itself)
            return bounds
        flips = rule is BoundRule.FLIP or np.asarray(outs[0]).dtype == np.bool_
        return [np.where(tainted, 1.0 if flips else ANY, b) for b in bounds]

    @staticmethod
    def tainted(errs: list[Any]) -> Any:
        """Where some operand's bound is `ANY` (None where none is)."""
        marks = [_any(x) for x in errs]
        if not any(m.any() for m in marks):
            return None
        return np.logical_or.reduce(np.broadcast_arrays(*marks)) if len(marks) > 1 else marks[0]

    def reduced_any(self, params: dict[str, Any], xt: Any, x: Any, e: Any, t: _Tile | None) -> Any:
        """Where a reduction (laid out as `reduce` lays it) has a term whose bound is `ANY`."""
        e = np.broadcast_to(np.asarray(e, np.float64), np.shape(x))
        if not _any(e).any():
            return False
        group = params.get("group")
        if t is None:
            return np.any(_any(e), axis=0)
        if group is not None and params.get("_rows"):
            g = int(group)
            return np.any(_any(e).reshape(e.shape[0] // g, g, e.shape[1]), axis=1)
        if group is not None:
            g = int(group)
            return np.any(_any(e).reshape(e.shape[0], e.shape[1] // g, g), axis=2)
        over = params["over"]
        axis = 1 if (xt.shape[1] == over and xt.shape[0] != over) else 0
        return np.any(_any(e), axis=axis)

    def pointwise(
        self, op: OpDef, params: dict[str, Any], vals: list[Any], errs: list[Any], outs: tuple[Any, ...]
    ) -> list[Any]:
        """The bound of a POINTWISE or PAIR op's results, by its `Bound.rule`."""
        x = [_f64(v) for v in vals]
        y = _f64(outs[0])
        ev = [np.asarray(v, np.float64) for v in errs]
        rule = op.bound_rule
        if rule is BoundRule.FLIP:  # may come out either way where the operands are closer than their bounds
            a, b = x
            slack = ev[0] + ev[1]
            return [np.where((slack > 0) & ~(np.abs(a - b) > slack), 1.0, 0.0)]
        if rule is BoundRule.MOVE:  # values moved between columns: their bounds move the same way
            assert op.impl is not None
            shaped = [np.broadcast_to(b, np.shape(v)) for b, v in zip(ev, x, strict=True)]
            res = op.impl(*shaped)
            return list(res) if isinstance(res, tuple) else [res]
        if rule is BoundRule.BROADCAST:
            return [np.broadcast_to(ev[0], np.broadcast_shapes(np.shape(x[0]), np.shape(x[1])))]
        if rule is BoundRule.ROUND:
            dtype = params["dtype"]
            if x[0].dtype == np.bool_:
                return [ev[0]]  # 0 or 1, as the comparison may come out
            if dtype == "i32":
                lo, hi = np.trunc(x[0] - ev[0]), np.trunc(x[0] + ev[0])
                return [np.maximum(np.abs(hi - y), np.abs(y - lo))]
            return [_rounding(x[0], ev[0], dtype)]
        if rule is BoundRule.BRANCH:
            c, a, b = x
            pick = np.where(c, ev[1], ev[2])
            with np.errstate(invalid="ignore"):  # (inf - inf, NaN: either branch may be anything)
                apart = np.abs(a - b)
            either = np.maximum(ev[1], ev[2]) + np.where(np.isnan(apart), np.inf, apart)
            either = np.where(_any(ev[1]) | _any(ev[2]), ANY, either)
            return [np.where((ev[0] > 0) | _any(ev[0]), either, pick)]
        if rule is BoundRule.PASS:  # |f(x') - f(x)| <= |x' - x|, and exact
            return [ev[0]]
        if rule is BoundRule.LARGEST:
            return [np.maximum(ev[0], ev[1])]
        anything: Any = False
        if rule is BoundRule.SUM:
            moved = ev[0] + ev[1]
        elif rule is BoundRule.PRODUCT:
            moved = _times(np.abs(x[1]), ev[0]) + _times(np.abs(x[0]), ev[1]) + _times(ev[0], ev[1])
            # inf times a value that may be 0 or of the other sign: inf, -inf or NaN
            anything = (_infinite(x[0]) & _near_zero(x[1], ev[1])) | (
                _infinite(x[1]) & _near_zero(x[0], ev[0])
            )
        elif rule is BoundRule.QUOTIENT:
            b = np.abs(x[1])
            moved = np.where(
                b > ev[1], (ev[0] + _times(np.abs(y), ev[1])) / np.where(b > ev[1], b - ev[1], 1.0), np.inf
            )
            # inf over a value that may be 0 or of the other sign; 0 / 0 within the bounds
            zero_den = _near_zero(x[1], ev[1])
            anything = zero_den & (_infinite(x[0]) | _near_zero(x[0], ev[0]))
        else:
            assert rule is BoundRule.NUMERIC, f"`{op.name}`: {rule} is not a rule of a pointwise op"
            moved, anything = self.moved(op, params, x, ev, y)
        if y.dtype.kind != "f":  # integer arithmetic is exact
            return [np.where(anything, ANY, moved)]
        return [np.where(anything, ANY, np.where(_exact_nonfinite(y, x, ev), 0.0, moved + _inject(op, x, y)))]

    def moved(
        self, op: OpDef, params: dict[str, Any], x: list[Any], ev: list[Any], y: np.ndarray
    ) -> tuple[np.ndarray, Any]:
        """How far an op moves when each input moves within its bound (one at a time, summed), and
        where it may be NaN then though it is not here (log or sqrt of a value that may be negative:
        anything), or a number though it is NaN here (the same near 0 from below: anything too)."""
        impl: Callable[..., Any] = op.impl  # type: ignore[assignment]
        kw = {k: v for k, v in params.items() if not isinstance(v, Dim)}
        f0 = _f64(impl(*x, **kw))
        total = np.zeros(np.broadcast_shapes(*[np.shape(v) for v in x], np.shape(y)))
        anything: Any = False
        for i, e in enumerate(ev):
            if not np.any(e):
                continue
            if x[i].dtype == np.bool_:  # a condition that may flip: anything may happen
                total = total + np.where(e > 0, np.inf, 0.0)
                continue
            if op.bound.moved is not None and len(x) == 1:  # the op's own rule (sin, cos)
                total = total + np.where(e > 0, np.asarray(op.bound.moved(x[0], e), np.float64), 0.0)
                continue
            far: Any = 0.0
            for sign in (1.0, -1.0):
                moved = list(x)
                moved[i] = x[i] + sign * e
                f1 = _f64(impl(*moved, **kw))
                d = np.abs(f1 - f0)
                far = np.maximum(far, np.where(np.isnan(d), np.inf, d))
                # NaN within the bound where it is a number here (log of a value that may be negative),
                # or a number within it where it is NaN here (rsqrt of a value that may be positive)
                anything = anything | ((e > 0) & (np.isnan(f1) != np.isnan(f0)))
            total = total + np.where(e > 0, far, 0.0)
        return total, anything

    def reduce(
        self, op: Any, params: dict[str, Any], xt: Any, x: Any, e: Any, y: Any, t: _Tile | None
    ) -> Any:
        x = _f64(x)
        e = np.broadcast_to(np.asarray(e, np.float64), x.shape)
        y = _f64(y)
        group = params.get("group")
        if t is None:
            axis = 0
        elif group is not None and params.get("_rows"):
            g = int(group)
            x = x.reshape(x.shape[0] // g, g, x.shape[1])
            e = e.reshape(x.shape)
            axis = 1
        elif group is not None:
            g = int(group)
            x = x.reshape(x.shape[0], x.shape[1] // g, g)
            e = e.reshape(x.shape)
            axis = 2
        else:
            over = params["over"]
            axis = 1 if (xt.shape[1] == over and xt.shape[0] != over) else 0
        n = x.shape[axis] if x.ndim else 1
        kind = op.combine.name if op.combine is not None else None
        if kind == "sum":
            return self.summed(x, e, y, axis)
        bad = ~np.isfinite(x)
        if kind in ("max", "min"):
            return np.max(e, axis=axis, initial=0.0)
        elif kind == "lse":
            p = np.exp(x - np.expand_dims(y, axis))  # 0 for a term of -inf beside finite ones
            finite = np.where(bad, 0.0, np.abs(x))
            b = (
                np.sum(_times(p, e), axis=axis)
                + gamma(n)
                + DEFAULT_INJECT * (np.abs(y) + np.max(finite, axis=axis, initial=0.0))
            )
            # a NaN term whose bound is not 0 (it may be a number elsewhere) makes p NaN: unbounded
            b = np.where(np.isnan(b), np.inf, b)
        else:
            return np.full(np.shape(y), np.inf)
        return np.where(_exact_sum(x, e, y, axis), 0.0, b)

    @staticmethod
    def summed(x: np.ndarray, e: np.ndarray, y: Any, axis: int) -> Any:
        """The bound of a sum over `axis` of terms `x` with bounds `e`: theirs plus both orders' rounding."""
        finite = np.where(np.isfinite(x), np.abs(x), np.inf)  # (a NaN term: its sum is unbounded, or exact)
        b = np.sum(e, axis=axis) + gamma(x.shape[axis] if x.ndim else 1) * np.sum(finite, axis=axis)
        return np.where(_exact_sum(x, e, y, axis), 0.0, b)


# ------------------------------------------------------------------------------------------------
# Blocks


def run(
    block: Any,
    inputs: dict[str, Any],
    dims: dict[str, int] | None = None,
    errors: dict[str, Any] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """`block.run(inputs, dims=dims)` (an `api.Block`) and a bound for every output element (module
    docstring). `errors`: bounds of inputs that are themselves computed (default: none)."""
    b = evaluate(block, inputs, dims, errors)
    return b.outputs, b.output_bounds


def evaluate(
    block: Any,
    inputs: dict[str, Any],
    dims: dict[str, int] | None = None,
    errors: dict[str, Any] | None = None,
) -> Bounds:
    """The bounds interpreter run over `block` (an `api.Block`): what `run` returns (`outputs`,
    `output_bounds`), and every block-level value's bound (`err`) and the stages' log-sum-exp terms,
    which `partials` reads."""
    env, sizes = bind(block.ir, inputs, dims, "exact")
    check_sizes(block.ir, sizes, "exact", None)
    b = Bounds(block.ir, block.plan, sizes)
    b.outputs, b.output_bounds = b.run_bounds(env, errors or {})
    return b


# the partial reductions whose whole bound bounds each tile's partial too: a sum's (the partial's
# terms, their bounds and magnitudes are a subset of the whole's, gamma grows with n) and a max's or
# min's (the largest bound of a subset). Not a log-sum-exp's: a tile's terms weigh more in its own,
# so its partials are bounded tile by tile (`_lse_tiles`).
SUBSET_BOUNDED = ("sum", "max", "min")


def partials(
    b: Bounds,
    shapes: dict[str, tuple[int, ...]],
    tiles: tuple[int, int] | dict[int, tuple[int, int]] | None = None,
) -> dict[str, np.ndarray]:
    """From a block's bounds (`evaluate`'s), a bound for every element of a kernel's per-tile partial
    buffers, by name, shaped as in `shapes`
    (the buffers' shapes, the interpreter's tile layout: a row partial [rows, column tiles], a column
    partial [row tiles, columns], or the finished vector). A `SUBSET_BOUNDED` combine's: the bound of
    the whole reduction, over each tile's partial along the tiles' axis. A log-sum-exp's: each tile's
    own, from its terms and their bounds, at the stage's tile in `tiles` (the kernels' tiles, as
    `Block.run(sim_tile=)` takes them; none without it)."""
    layout: dict[str, tuple[str, bool]] = {}  # name -> (combine, whether a row partial)
    stage_of: dict[str, int] = {}  # name -> its stage's index (1-based, as `tiles` counts)
    for k, st in enumerate(b.block.stages, 1):
        space = st.acc.type.shape if st.acc is not None and st.acc.type is not None else st.shape
        rows = space[0] if space else None
        for e in st.body:
            for v in e.outs:
                t = v.type
                if t is not None and t.kind == PARTIAL:
                    layout[v.name] = (t.combine or "sum", bool(t.shape) and t.shape[0] == rows)
                    stage_of[v.name] = k
    out = {}
    for name, shape in shapes.items():
        tile = tiles.get(stage_of.get(name, 0)) if isinstance(tiles, dict) else tiles
        if name in b.lse_terms and name in layout and tile is not None:
            lse = _lse_tiles(b, name, layout[name][1], tile, shape)
            if lse is not None:
                out[name] = lse
            continue
        if name not in layout or layout[name][0] not in SUBSET_BOUNDED or name not in b.err:
            continue
        whole = np.broadcast_to(np.asarray(b.err[name], np.float64), np.shape(b.env[name])).reshape(-1)
        if shape == whole.shape:  # the finished vector
            out[name] = whole.copy()
        elif len(shape) == 2:  # per tile: along the tiles' axis (a scalar's: one column)
            along = whole[:, None] if layout[name][1] else whole[None, :]
            if along.shape[0] in (1, shape[0]) and along.shape[1] in (1, shape[1]):
                out[name] = np.broadcast_to(along, shape).copy()
    return out


def _lse_tiles(
    b: Bounds, name: str, row_partial: bool, tile: tuple[int, int], shape: tuple[int, ...]
) -> np.ndarray | None:
    """Each tile's bound of the partial log-sum-exp `name` (a row partial: over each tile's columns,
    [rows, column tiles]; else over its rows, [row tiles, columns]): `Bounds.reduce` on the tile's
    own terms and their bounds, at the tile's own log-sum-exp. None where the layout is not that one
    (a half-width operand, a vector): the partial then gets no bound."""
    op, params, xt, x, e = b.lse_terms[name]
    x = _f64(x)
    if x.ndim != 2:
        return None
    e = np.broadcast_to(np.asarray(e, np.float64), x.shape)
    axis, width = (1, tile[1]) if row_partial else (0, tile[0])
    n = x.shape[axis]
    whole = _Tile(xt.shape[0], xt.shape[1], 0, x.shape[0], 0, x.shape[1])  # (`reduce` takes the axis from it)
    parts = []
    with np.errstate(all="ignore"):
        for j in range(0, n, width):
            sl = (slice(None), slice(j, j + width)) if axis == 1 else (slice(j, j + width), slice(None))
            xs, es = x[sl], e[sl]
            m = np.max(np.where(np.isnan(xs), -np.inf, xs), axis=axis, keepdims=True)
            mf = np.where(np.isfinite(m), m, 0.0)
            y = np.squeeze(mf + np.log(np.sum(np.exp(xs - mf), axis=axis, keepdims=True)), axis=axis)
            bnd = b.reduce(op, params, xt, xs, es, y, whole)
            parts.append(np.where(b.reduced_any(params, xt, xs, es, whole), ANY, bnd))
    got = np.stack(parts, axis=axis)
    return got if got.shape == tuple(shape) else None


def vjp(
    block: Any,
    inputs: dict[str, Any],
    cotangents: dict[str, Any],
    dims: dict[str, int] | None = None,
    remat: str | None = None,
    wrt: list[str] | None = None,
    *,
    backward: BackwardOptions | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """`block.vjp(inputs, cotangents, dims=dims, wrt=wrt, backward=...)` (unchunked, exact precision,
    every fp8 cotangent scale 1 as `Block.vjp`'s default) and a bound for every gradient element: the
    saved tensors carry the forward's bounds into the backward. The backward's options: `remat` alone,
    or `backward=` (a BackwardOptions, its fp8 cotangents and fp8 acc included; run whole)."""
    d = block.derivation(wrt, backward=BackwardOptions.of(backward, remat=remat).unchunked())
    fwd, ferr = run(d.forward, inputs, dims)
    bins, bdims = block.backward_inputs(d, inputs, cotangents, fwd, dims)
    bins.update({s: 1.0 for s in d.scales if s not in bins})
    grads, gerr = run(
        d.backward, bins, bdims, {k: v for k, v in ferr.items() if k in bins and k not in inputs}
    )
    return {p: grads[g] for p, g in d.grads.items()}, {p: gerr[g] for p, g in d.grads.items()}
