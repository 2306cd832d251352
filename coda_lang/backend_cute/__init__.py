"""The CuTeDSL backend: each GEMM stage becomes one quack `@gemm_epilogue` kernel for Hopper (sm_90a).

The layer map, in the order a stage goes through it (each package below the one after it: plan/ imports
nothing of build/ or runtime/, build/ nothing of runtime/):
- plan/: a checked stage -> the Python source of its epilogue, without quack, CuTeDSL or torch.
  spec.py: the data model (`StageSpec`: operands, outputs, sinks, groups, mode, its tiling
  constraints; keyword-built records, closed sets of names as Literal types); planner.py: a checked
  stage -> its StageSpec, or an E07 diagnostic, with a module per job (context.py: the stage and its
  values' Python names; sinks.py: reductions -> sinks and groups, padding.py: what a ragged tile's
  padding holds; operands.py: loads -> operands; refusals.py: the E07 checks); names.py + emit.py:
  StageSpec -> the epilogue's source (content-addressed files);
  epi_ops.py: our own CuTeDSL epilogue ops (imported by the emitted modules, not by the planner).
- build/: kernels, without a GPU. config.py: tile configs, the candidate lists and the rules a
  stage's config must satisfy (`fits`); ptxas.py: ptxas and its register/spill report; cache.py: the
  kernel cache on disk; compile.py: PTX for sm_90a of one stage at one tile; parallel.py: many kernels
  at once, in worker processes; select.py: the first candidate without spills, or every such one;
  quack_adapter.py: the only module that touches quack and CuTeDSL; tune.py: timing candidates on the
  GPU and the tuning cache.
- runtime/: the block on torch tensors. launch.py: one stage as the torch custom op `coda::stage`;
  tiles.py: the tile of a stage (given, or the first without spills) and compiling a block's kernels
  before its first call; tuning.py: the fastest tile at a GEMM shape, timed at the stage's first
  launch there; binding.py: a call's inputs; liveness.py: what a consuming run (a backward) may drop
  and overwrite; cuda_block.py: `Block.cuda()`, composing them; autograd.py: `.autograd()`;
  emulate.py: a torch stand-in for a stage's kernel, to run all of the above without a GPU.
- backend_triton/ (beside this package, below it): a stage with no GEMM (elementwise.py; generate.py:
  as a generated Triton kernel, else torch.compile) and layouts.py: copies torch makes slowly (a
  paired stage's lanes, the fused QKV gradient, a scaled rounding, a tied weight's gradient) as Triton
  kernels.
Importing this package imports nothing heavy; the runtime modules import torch, only quack_adapter
and epi_ops (which quack_adapter and the emitted modules import) import quack and cutlass, and only
backend_triton's generated stages and layouts import Triton (when first used). docs/backend.md
describes the modes and limits for users.
"""
