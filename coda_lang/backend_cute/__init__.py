"""The CuTeDSL backend: each GEMM stage becomes one quack `@gemm_epilogue` kernel for Hopper (sm_90a).

plan.py (stage -> StageSpec: operands, outputs, sinks, mode; E07 diagnostics), emit.py (StageSpec ->
Python source, content-addressed files), quack_adapter.py (the only module that touches quack and
CuTeDSL), compile.py (PTX for sm_90a without a GPU, ptxas reports, tile selection, the PTX cache),
runtime.py (`Block.cuda()`: the block on torch CUDA tensors, one `coda::stage` custom op per stage,
autograd through the derived backward block), emulate.py (a torch stand-in for a stage's kernel, to
test the runtime without a GPU).
Importing this package imports nothing heavy; runtime.py and emulate.py import torch, and only
quack_adapter imports quack and cutlass.
"""
