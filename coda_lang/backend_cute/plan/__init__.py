"""Planning and emission: a checked GEMM stage -> its `StageSpec` -> the source of its quack epilogue.

spec.py holds the data model; planner.py decides it, with a module per job: context.py (the stage as
every job reads it, the Python names of its values), planner.py itself (the orchestration, the GEMM,
the mode, the stores), sinks.py (reductions -> Sink and Group records; padding.py: what a ragged
tile's padding holds), operands.py (loads -> Operand records), refusals.py (each check that raises
E07, for what the backend can't compile yet). emit.py writes it (names.py: the emitted module's
imports). epi_ops.py is CuTeDSL code, our own epilogue ops: only the emitted modules and quack_adapter
import it, and importing it imports quack and CuTeDSL; no other module here imports quack, CuTeDSL or
torch, or anything of build/ or runtime/. The emitted source is deterministic (a golden file per
example stage).
"""
