"""Small programs with the reductions the backend compiles beyond quack's add/max folds: min() (the
kernel folds the negation by max and the runtime negates the partials back), grouped min and logsumexp (epi_ops.GroupedReduce in the prepass), in element,
acc_pair and packed mode. Used by tests/test_runtime.py (emulated) and tests/test_gpu.py (on the GPU):
each entry is (source, sizes with ragged last tiles along both dims, tile for the emulated run).
"""

from __future__ import annotations

# min over the columns and the rows (the kernel folds the negation by max), logsumexp over the columns
# beside them, a grouped min and a stored grouped logsumexp (the prepass)
NEW_REDUCTIONS: dict[str, tuple[str, dict[str, int], tuple[int, int]]] = {
    "element": (
        """dims M, K, N
block p(x: bf16[M, K], w: bf16[K, N], b: f32[N]) -> (y: bf16[M, N], r: f32[M], c: f32[N], k: f32[M]) {
  gemm x @ w {
    h = acc + b
    y = h
    r = min(h, over=N)
    c = min(acc * b, over=M)
    k = logsumexp(h * 0.5, over=N)
  }
}
""",
        {"M": 300, "K": 200, "N": 264},
        (128, 64),
    ),
    "paired": (
        """dims M, K, F
block p(x: bf16[M, K], w: bf16[K, 2*F]) -> (y: bf16[M, F], r: f32[M], c: f32[2*F]) {
  gemm x @ w {
    g, u = pairs(acc)
    y = g * u
    r = min(g, over=F)
    c = min(acc, over=M)
  }
}
""",
        {"M": 300, "K": 200, "F": 136},
        (128, 64),
    ),
    "packed": (
        """dims M, K, F
block p(x: bf16[M, K], w: bf16[K, F], t: bf16[M, 2*F]) -> (y: bf16[M, 2*F], r: f32[M]) {
  gemm x @ w {
    g, u = pairs(t)
    y = interleave(g * acc, u)
    r = min(y, over=2*F)
  }
}
""",
        {"M": 300, "K": 200, "F": 136},
        (128, 64),
    ),
    "grouped": (
        """dims M, K, N
block p(x: bf16[M, K], w: bf16[K, N], b: f32[N]) -> (y: bf16[M, N], s: f32[M, N/64]) {
  gemm x @ w {
    s = logsumexp(acc + b, over=N, group=64)
    m = min(acc, over=N, group=32)
    y = acc - s + m
  }
}
""",
        {"M": 300, "K": 200, "N": 448},
        (128, 128),
    ),
}
