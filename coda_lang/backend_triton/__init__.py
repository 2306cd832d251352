"""Generated Triton kernels: elementwise stages (a stage with no GEMM: elementwise.py runs it, as a
kernel generate.py writes from the stage's ops, or compiled by torch.compile where the generator can't
take them, or eagerly with torch stand-ins when emulating) and the layout copies torch makes slowly
(layouts.py: a paired stage's lanes, the fused QKV gradient, a scaled rounding, a tied embedding's
gradient).

Below backend_cute/ (whose runtime runs these stages between its GEMM stages); imports torch, and
Triton only when a kernel is first generated or launched.
"""


def kmajor_key(name: str) -> str:
    """The key, in a CUDA block's run, of value `name`'s K-major copy where the stage that made the
    value wrote one too (the layout a GEMM that reads it transposed takes: backend_cute's
    launch.kmajor_pair): a name no .coda identifier can take."""
    return name + "^T"
