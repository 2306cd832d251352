"""The CuTeDSL backend: each GEMM stage becomes one quack `@gemm_epilogue` kernel for Hopper (sm_90a).

The layer map, in the order a stage goes through it:
- spec.py: the data model (`StageSpec`: operands, outputs, sinks, groups, mode);
- planner.py (+ padding.py): a checked stage -> its StageSpec, or an E07 diagnostic;
- names.py + emit.py: StageSpec -> the Python source of the epilogue (content-addressed files);
- quack_adapter.py: the only module that touches quack and CuTeDSL; epi_ops.py: our epilogue ops;
- compile.py: PTX for sm_90a without a GPU, ptxas reports, tile candidates, the kernel cache;
  parallel.py: many kernels at once, in worker processes;
- tiles.py, tune.py: the tile of a stage (first without spills, or the fastest, cached on disk), and
  compiling a block's kernels before its first call;
- launch.py: one stage as the torch custom op `coda::stage`; elementwise.py: a stage with no GEMM,
  triton_stage.py: such a stage as a generated Triton kernel; layouts.py: copies torch makes slowly
  (a paired stage's lanes, the fused QKV gradient, a scaled rounding, a tied weight's gradient) as
  Triton kernels;
- cuda_block.py: `Block.cuda()`, the block on torch tensors; autograd.py: `.autograd()`;
- emulate.py: a torch stand-in for a stage's kernel, to run all of the above without a GPU.
Importing this package imports nothing heavy; the runtime modules import torch, only quack_adapter
imports quack and cutlass, and only triton_stage and layouts import Triton (when first used).
docs/backend.md describes the modes and limits for users.
"""
