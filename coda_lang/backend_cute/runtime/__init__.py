"""The CUDA runtime: a checked block on torch tensors, one `coda::stage` launch per GEMM stage.

cuda_block.py (`Block.cuda()`) composes binding.py (a call's inputs), tiles.py (a stage's tile, and
compiling a block's kernels before its first call), tuning.py (the fastest tile at a GEMM shape),
launch.py (one stage's launch, the custom ops), liveness.py (what a backward may drop and overwrite)
and backend_triton's elementwise stages; autograd.py makes `.autograd()`'s differentiable function;
emulate.py stands in for each kernel, so everything here runs without a GPU (`emulate=True`). These
modules import torch, never quack at the top (launch.py imports it at a stage's first launch).
"""
