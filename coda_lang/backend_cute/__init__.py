"""The CuTeDSL backend: each GEMM stage becomes one quack `@gemm_epilogue` kernel for Hopper (sm_90a).

plan.py (stage -> StageSpec: operands, outputs, sinks, mode; E07 diagnostics), emit.py (StageSpec ->
Python source, content-addressed files), quack_adapter.py (the only module that touches quack and
CuTeDSL), compile.py (PTX for sm_90a without a GPU, ptxas reports, tile selection, the PTX cache).
Importing this package imports nothing heavy; only quack_adapter imports quack, cutlass and torch.
"""
