"""Generated Triton kernels: elementwise stages (a stage with no GEMM: elementwise.py runs it, as a
kernel generate.py writes from the stage's ops, or compiled by torch.compile where the generator can't
take them, or eagerly with torch stand-ins when emulating) and the layout copies torch makes slowly
(layouts.py: a paired stage's lanes, the fused QKV gradient, a scaled rounding, a tied embedding's
gradient).

Below backend_cute/ (whose runtime runs these stages between its GEMM stages); imports torch, and
Triton only when a kernel is first generated or launched.
"""
