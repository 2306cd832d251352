"""The tolerance rule for comparing a result (a kernel's, or the tile simulation's) with the interpreter.

What it does: `mismatch(name, got, ref, ref64, dtype)` says in one line why `got` is not close enough
to the reference `ref` (the whole-matrix interpreter in its "exact" precision), or returns None.
The rule (as tests/runtime_check.py states it for the GPU tests, and docs/design.md, "Accuracy"):
- shapes equal; non-finite elements where and only where the reference has them, with the same
  value (NaN, +inf or -inf); signed zeros are equal;
- every finite element close: |got - ref| <= r * (|ref| + rms(ref)), r = 2**-7 (one bf16 ulp at the
  value's scale, with a floor at the output's rms for cancellation) for 16-bit dtypes, r = 1e-3 for
  f32 (the kernels use fast-math exp/log/tanh), one fp8 ulp for fp8 (2**-3 e4m3, 2**-2 e5m2);
- or, where that fails and `bound` is given (per element, `coda_lang.interp.bound`: how far a
  correct implementation that rounds where the interpreter rounds may be from it, propagated from
  the magnitudes that went into each value), |got - ref| <= 2 * bound: an element that cancelled
  (a gradient of 1e-4 summed from terms near 10) is judged against the terms, not against itself;
- or, where that fails too and `ref64` (the interpreter in float64, without rounding) is given, the
  paper's rule on the finite elements: max|got - ref64| <= 2 * max|ref - ref64| + 1e-6 (the
  interpreter rounds exactly where a kernel does, so it is the low-precision reference): a result as
  accurate as the interpreter passes even where the problem is ill-conditioned;
- an element whose bound is `ANY` (-inf: another correct implementation may have anything there, NaN
  included, such as inf * sin(x) where sin(x) is within rounding of 0) passes whatever it is.
What it does not: choose what to compare (coda_lang/fuzz/ does).
Invariants: accepts NumPy arrays (bf16 too), Python numbers and torch tensors (converted without
importing torch here); never raises for mismatching values, only says why.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# one ulp at the value's scale (twice the unit roundoff) for the rounded dtypes: bf16's 2^-7, e4m3's
# 2^-3 (unit roundoff 2^-4), e5m2's 2^-2 (2^-3)
REL = {"f32": 1e-3, "bf16": 2.0**-7, "f16": 2.0**-7, "e4m3": 2.0**-3, "e5m2": 2.0**-2}
PAPER_ATOL = 1e-6
F32_MAX = float(np.finfo(np.float32).max)
ANY = -np.inf  # a bound that passes anything (interp/bound.py's ANY)
BOUND_SAFETY = 2.0  # |got - ref| <= BOUND_SAFETY * bound (the bound is first-order: a margin)


def as_float64(x: Any) -> np.ndarray:
    """x as a float64 NumPy array (torch tensors are copied to the CPU; i32 and bool too)."""
    if hasattr(x, "detach") and "torch" in type(x).__module__:
        t = x.detach().cpu()
        x = t.float().numpy() if t.is_floating_point() else t.numpy()
    return np.asarray(x).astype(np.float64)


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x)))) if x.size else 0.0


def _at(idx: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, idx)) + "]" if idx else ""


def mismatch(
    name: str, got: Any, ref: Any, ref64: Any = None, dtype: str = "f32", bound: Any = None
) -> str | None:
    """Why `got` is not within the tolerance of `ref` (see the module docstring); None if it is."""
    g, r = as_float64(got), as_float64(ref)
    if g.shape != r.shape:
        return f"{name}: shape {g.shape}, expected {r.shape}"
    b = as_float64(bound) if bound is not None else None
    b = b if b is not None and b.shape == r.shape else None  # the bound of each element, if given
    fin_g, fin_r = np.isfinite(g), np.isfinite(r)
    odd = (fin_g != fin_r) | (~fin_r & ~((np.isnan(g) & np.isnan(r)) | (g == r)))
    anything = b == ANY if b is not None else np.zeros(r.shape, bool)
    odd &= ~anything
    if odd.any() and b is not None:
        # where the bound exceeds f32's range (an exp of a difference of huge values, an infinity among
        # the inputs), a correct implementation may overflow where the reference does not, or not where
        # it does: an infinity against a finite value passes there (a NaN never does)
        unbounded = (b > F32_MAX) & ~np.isnan(g) & ~np.isnan(r)
        odd &= ~(unbounded & (fin_g != fin_r))
    if odd.any():
        idx = tuple(int(i[0]) for i in np.nonzero(odd)) if g.ndim else ()
        return (
            f"{name}: {int(odd.sum())} of {g.size} elements differ in being finite; first at {_at(idx)}: "
            f"{g[idx]!r} vs {r[idx]!r}"
        )
    rel = REL.get(dtype, REL["f32"])
    gf, rf = g[fin_r], r[fin_r]
    tol = rel * (np.abs(rf) + _rms(rf))
    bad = np.abs(gf - rf) > tol
    if bad.any() and b is not None:
        bf = b[fin_r]
        # (a NaN bound passes nothing; one past f32's range passes any number, infinities too)
        bad &= ~((np.abs(gf - rf) <= BOUND_SAFETY * bf) | (bf > F32_MAX) | (bf == ANY))
    if not bad.any():
        return None
    if ref64 is not None:
        f = as_float64(ref64)
        if f.shape == r.shape:
            judged = fin_r & ~anything
            ok = judged & np.isfinite(f)
            err = float(np.max(np.abs(g[ok] - f[ok]), initial=0.0))
            base = float(np.max(np.abs(r[ok] - f[ok]), initial=0.0))
            if err <= 2 * base + PAPER_ATOL and ok.sum() == judged.sum():
                return None
    k = int(np.argmax(np.where(bad, np.abs(gf - rf) - tol, -np.inf)))
    idx = tuple(int(w[k]) for w in np.nonzero(fin_r)) if g.ndim else ()  # (np.nonzero refuses 0-d arrays)
    within = " and the rounding bound" if bound is not None else ""
    worst = f"worst at {_at(idx)}: {g[idx]:.7g} vs {r[idx]:.7g}"
    if b is not None:
        worst += f" (rounding bound {b[idx]:.3g})"
    return f"{name}: {int(bad.sum())} of {g.size} elements differ beyond {rel:.2g} * (|ref| + rms){within}; {worst}"
