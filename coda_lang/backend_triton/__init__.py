"""Generated Triton kernels: elementwise stages (a stage with no GEMM: elementwise.py runs it, as a
kernel generate.py writes from the stage's ops, or compiled by torch.compile where the generator can't
take them, or eagerly with torch stand-ins when emulating) and the layout copies torch makes slowly
(layouts.py: a paired stage's lanes, the fused QKV gradient, a scaled rounding, a tied embedding's
gradient).

Below backend_cute/ (whose runtime runs these stages between its GEMM stages); imports torch, and
Triton only when a kernel is first generated or launched.
"""

KMAJOR = "^T"  # the suffix of a K-major copy's key: no .coda identifier can end so
KMAJOR_ROWS = 16  # a K-major copy's rows (the GEMM's K) are padded to a multiple of this: 16 fp8 bytes


def kmajor_key(name: str) -> str:
    """The key, in a CUDA block's run, of value `name`'s K-major copy where the stage that made the
    value wrote one too (the layout a GEMM that reads it transposed takes: backend_cute's
    launch.kmajor_pair)."""
    return name + KMAJOR


def kmajor_width(k: int) -> int:
    """The width of the K-major copy of an operand with K = `k`: k rounded up to KMAJOR_ROWS (TMA
    loads rows of a multiple of 16 bytes; the padding is zeros). What a producer writes and what the
    GEMM takes agree through this one rule."""
    return -(-k // KMAJOR_ROWS) * KMAJOR_ROWS
