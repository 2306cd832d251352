"""Shared by tests/test_runtime.py (CPU, emulated launches) and tests/test_gpu.py (quack kernels on a GPU):
inputs for the examples, and the tolerance rules for comparing the CUDA runtime with the interpreter.

Tolerance rules (stated once, used by both):
- Outputs against the interpreter in its "exact" precision (f32 inside stages, stored tiles rounded
  like the kernel's, same tile): coda_lang.testing.compare.mismatch, the rule `coda fuzz` uses.
  Every element within |got - interp| <= r * (|interp| + rms(interp)), with r = 2**-7 (one bf16 ulp
  at the value's scale, with a floor at the output's rms for cancellation) for 16-bit outputs and
  r = 1e-3 for f32 outputs (the kernels use fast-math exp/log/tanh); or, where an element is not,
  the accuracy rule (docs/design.md, "Accuracy"): max|got - f64| <= 2 * max|interp - f64| + 1e-6. (A gradient at the end
  of a chain of bf16-saved tiles summed over a thousand rows can land a hair past one ulp in one
  element in a million, as the interpreter's own result does against f64; the paper's rule judges
  those by the whole tensor.) A wrong element (indexing, an unwritten tile, a wrong operand) is far
  outside both.
- Outputs, as a whole, against float64 (the interpreter's "f64" precision on the same bf16 inputs):
  ||got - ref64|| <= 2 * ||interp - ref64|| + floor * ||ref64|| (Frobenius norms; floor 1e-6 for 16-bit
  outputs, 1e-5 for f32 ones): the paper's rule with the interpreter, which rounds exactly where the
  kernel does, as the low-precision reference. NaN never passes.
- Partial buffers against the interpreter's tile simulation at the kernel's tile:
  |got - interp| <= 1e-3 * (|interp| + rms(interp)) element by element (pick: the finished vector
  against the simulated buffer summed over the column tiles); where that fails and the tile
  simulation in float64 is given, the paper's rule against it (a partial that cancels, a sum of
  products of bf16-rounded tiles, moves by more than 1e-3 with one rounding).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from coda_lang.interp import random_inputs
from coda_lang.testing.compare import mismatch

# Sizes that are not multiples of any tile (the ragged last tiles are exercised): M=1000, D=520, F=1000.
RAGGED = {"M": 1000, "D": 520, "F": 1000, "K": 520, "N": 1000, "V": 1000, "P": 504}  # rows of 16 bytes (TMA)


def to_torch(a: np.ndarray, device: str = "cpu") -> Any:
    import torch

    # (torch takes no ml_dtypes array: bf16 and fp8 go through f32, exactly)
    narrow = {
        "bfloat16": torch.bfloat16,
        "float8_e4m3fn": torch.float8_e4m3fn,
        "float8_e5m2": torch.float8_e5m2,
    }
    if a.dtype.name in narrow:
        return torch.from_numpy(a.astype(np.float32)).to(narrow[a.dtype.name]).to(device)
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


def to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().float().cpu().numpy() if x.is_floating_point() else x.detach().cpu().numpy()
    return np.asarray(x).astype(np.float64)


def example_inputs(block: Any, sizes: dict[str, int], seed: int, device: str = "cpu") -> dict[str, Any]:
    """Seeded random inputs (never zeros); pick targets get some ignored rows (-100)."""
    dims = {d.name: d.value if d.value is not None else sizes[d.name] for d in block.ir.dims}
    arrays = random_inputs(block.ir, dims, seed)
    for name, a in arrays.items():
        if a.dtype == np.int32 and name == "target":
            a[::7] = -100
    return {k: to_torch(v, device) for k, v in arrays.items()}


def check_output(name: str, got: Any, interp: Any, ref64: Any | None, dtype: str) -> None:
    g, i = to_numpy(got), to_numpy(interp)
    assert g.shape == i.shape, f"{name}: shape {g.shape}, interpreter {i.shape}"
    assert not np.isnan(g).any(), f"{name}: {int(np.isnan(g).sum())} NaN elements (unwritten?)"
    why = mismatch(name, g, i, None if ref64 is None else to_numpy(ref64), dtype)
    assert why is None, why
    if ref64 is not None:
        f = to_numpy(ref64)
        floor = 1e-6 if dtype in ("bf16", "f16") else 1e-5
        err, base = np.linalg.norm(g - f), np.linalg.norm(i - f)
        assert err <= 2 * base + floor * np.linalg.norm(f), (
            f"{name}: ||got - f64|| = {err:.3e} > 2 * ||interp - f64|| = {2 * base:.3e} "
            f"(+ {floor:.0e} * ||f64||)"
        )


def check_partial(name: str, got: Any, interp: np.ndarray, interp64: np.ndarray | None = None) -> None:
    g, i = to_numpy(got), np.asarray(interp, dtype=np.float64)
    f = None if interp64 is None else np.asarray(interp64, dtype=np.float64)
    if g.ndim == 1 and i.ndim == 2:  # pick: the kernel writes the finished vector
        i = i.sum(axis=1)
        f = None if f is None else f.sum(axis=1)
    assert g.shape == i.shape, f"partial {name}: shape {g.shape}, tile simulation {i.shape}"
    assert not np.isnan(g).any(), f"partial {name}: NaN elements (unwritten?)"
    why = mismatch(f"partial {name}", g, i, f, "f32")
    assert why is None, why


# Blocks whose backward is all GEMM stages the backend supports today (every example's backward has an
# elementwise entry stage or a double-width stored tile): for the autograd tests.
GRAD_BLOCKS = """
dims M, K, N, F

block linear(x: bf16[M, K], w: bf16[K, N]) -> (out: bf16[M, N]) {
  gemm x @ w {
    out = acc
  }
}

block gelu_mlp(x: bf16[M, K], w1: bf16[K, F], w2: bf16[F, N], b: f32[F]) -> (out: bf16[M, N]) {
  gemm x @ w1 {
    h: bf16 = gelu(acc + b)
  }
  gemm h @ w2 {
    out = acc
  }
}

block scaled_mlp(x: bf16[M, K], w1: bf16[K, F], w2: bf16[F, N], s: f32[M]) -> (out: bf16[M, N]) {
  gemm x @ w1 {
    h: bf16 = acc * s
  }
  gemm h @ w2 {
    out = acc
  }
}
"""


# Gradients that are sums over many cancelling terms of bf16 products (RoPE's position and frequency
# gradients): one bf16 rounding of a saved tile moves single elements by percents, so only the f64
# rule applies to them (docs/design.md, "Accuracy": the error against f64 at most twice the interpreter's).
CANCELLING = frozenset({"pos", "freq", "dpos", "dfreq"})


def check_gradient(name: str, got: Any, interp: Any, ref64: Any, dtype: str) -> None:
    if name not in CANCELLING:
        check_output(name, got, interp, ref64, dtype)
        return
    g, i, f = (to_numpy(x).astype(np.float64) for x in (got, interp, ref64))
    assert g.shape == f.shape and not np.isnan(g).any(), name
    err, base = np.linalg.norm(g - f), np.linalg.norm(i - f)
    assert err <= 2 * base + 1e-6 * np.linalg.norm(f), f"{name}: ||got - f64|| = {err:.3e} > 2 * {base:.3e}"


# Dims used as values inside a stage (Scalar operands the runtime fills with the call's sizes)
DIMS_AS_VALUES = """dims M, K, N
block p(x: bf16[M, K], w: bf16[K, N], b: f32[N]) -> (y: bf16[M, N], s: f32[M]) {
  gemm x @ w {
    h = acc / K + b * N - M
    y = h
    s = sum(h * K, over=N)
  }
}
"""

# Sums whose value past the end of the reduced dim (in the ragged last tile) is not 0, and ones whose
# is: quack's sum folds those elements, so the first kind are `bounded` (masked) in the kernel. s: exp(0)
# is 1; u: the row vector r over the rows is stale shared memory past M; v: the column vector c likewise
# past N; a: max(abs()) of a real row value (|r| there, below it elsewhere); q and z are 0 there (q: 0 * a real row value, scaled).
RAGGED_SUMS = """dims M, K, N
block ragged(x: bf16[M, K], w: bf16[K, N], t: bf16[M, N], r: f32[M], c: f32[N])
    -> (s: f32[M], u: f32[N], q: f32[M], z: f32[M], v: f32[M], a: f32[M]) {
  gemm x @ w {
    s = sum(exp(acc * 0.01), over=N)
    u = sum(acc * r, over=M)
    q = sum(acc * r, over=N)
    z = sum(silu(acc) + t * 2.0, over=N)
    v = sum(acc * c, over=N)
    a = max(abs(r * exp(acc * acc * -1.0)), over=N)
  }
}
"""
