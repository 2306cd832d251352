"""Numerics shared by the interpreter: NumPy dtypes of coda dtypes, and rounding to a storage dtype.

What it does: maps coda dtypes to NumPy dtypes for each precision ("exact": f32 compute with rounded
storage, the kernel's numerics; "f64": float64 everywhere, no rounding), rounds arrays, and gives the
math functions NumPy lacks (erf). Rounds to the fp8 dtypes (e4m3, e5m2) by saturating first: a value
beyond +-max (an infinity included) becomes +-max, as the fp8 training recipes clamp before they cast,
then it rounds to nearest even; NaN stays NaN.
What it does not: decide *when* to round (run.py does: at the end of the stage that stores a tile).
Invariants: rounding is round-to-nearest-even (ml_dtypes / NumPy casts), and returns the compute
dtype (f32 values that are exactly representable in the storage dtype). Rounding to fp8 is
quantization, part of what a program means: it happens in both precisions (in "f64", from the
float64 value, directly), while rounding to f32, bf16 and f16 happens in "exact" only.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

PRECISIONS = ("exact", "f64")
FLOATS = ("f32", "bf16", "f16", "e4m3", "e5m2")  # (ir.types' float dtypes: core imports nothing above it)
FP8_DTYPES = ("e4m3", "e5m2")

STORAGE = {
    "f32": np.dtype(np.float32),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f16": np.dtype(np.float16),
    "e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "i32": np.dtype(np.int32),
    "bool": np.dtype(np.bool_),
}


def compute_dtype(dtype: str, precision: str) -> np.dtype[Any]:
    """The NumPy dtype a value of coda dtype `dtype` is computed in."""
    if dtype in FLOATS:
        return np.dtype(np.float64 if precision == "f64" else np.float32)
    return STORAGE[dtype]


def saturate(x: np.ndarray, dtype: str) -> np.ndarray:
    """x clamped to the finite range of the fp8 dtype `dtype` (infinities too; NaN stays NaN)."""
    m = float(ml_dtypes.finfo(STORAGE[dtype]).max)  # 448 (e4m3), 57344 (e5m2)
    return np.clip(x, -m, m)


def round_fp8(x: np.ndarray, dtype: str) -> np.ndarray:
    """x (f32 or float64) saturated and rounded to nearest even in the fp8 dtype, returned in x's
    float dtype: the interpreter's fp8 store, bit for bit ml_dtypes' cast of the saturated value."""
    x = np.asarray(x)
    ft = x.dtype if x.dtype in (np.float32, np.float64) else np.dtype(np.float32)
    x = x.astype(ft, copy=False)
    return saturate(x, dtype).astype(STORAGE[dtype]).astype(ft)


def round_to(x: np.ndarray, dtype: str, precision: str) -> np.ndarray:
    """x rounded to the storage dtype, returned in the compute dtype (no-op in f64 mode but for fp8,
    which quantizes in both precisions)."""
    if dtype in FP8_DTYPES:
        return round_fp8(np.asarray(x, dtype=compute_dtype(dtype, precision)), dtype)
    if precision == "f64":
        return x
    if dtype in ("bf16", "f16"):
        with np.errstate(over="ignore"):  # (beyond f16's range: inf, as the kernels round)
            return x.astype(STORAGE[dtype]).astype(np.float32)
    if dtype == "i32" and x.dtype.kind == "f":
        return np.trunc(x).astype(np.int32)
    return x.astype(compute_dtype(dtype, precision), copy=False)


def to_storage(x: np.ndarray, dtype: str, precision: str) -> np.ndarray:
    """An output array in its declared dtype (bf16 as ml_dtypes.bfloat16, e4m3 as
    ml_dtypes.float8_e4m3fn); float64 in f64 mode (an fp8 output's values already quantized)."""
    if precision == "f64" and dtype in FLOATS:
        return np.asarray(x, dtype=np.float64)
    if dtype in FP8_DTYPES:
        return round_fp8(np.asarray(x), dtype).astype(STORAGE[dtype])
    return np.asarray(x).astype(STORAGE[dtype])


_ERF = np.frompyfunc(math.erf, 1, 1)
_ERF_PIECE = 1 << 16


def erf(x: Any) -> Any:
    """The error function elementwise, correctly rounded from float64 (NumPy has none; `math.erf` per
    element), in the dtype of `x` (f32 stays f32)."""
    x = np.asarray(x)
    dtype = x.dtype if x.dtype.kind == "f" else np.dtype(np.float64)
    out = np.empty(x.shape, dtype)
    flat, into = x.reshape(-1), out.reshape(-1)
    # in pieces: math.erf's Python floats (an object array) exist for one piece at a time, so that
    # the interpreter's memory estimate (interp/inputs.py) holds for erf too
    for i in range(0, flat.size, _ERF_PIECE):
        piece = flat[i : i + _ERF_PIECE].astype(np.float64)
        into[i : i + _ERF_PIECE] = np.asarray(_ERF(piece), dtype=np.float64)
    return out
