"""coda_lang.testing: hypothesis strategies and helpers for fuzzing coda programs and kernels.

Public API (each module's docstring says more):
- programs.py: `forward_blocks()`, random well-typed, block-local forward blocks drawn from the op
  registry (a `Forward`: source text, sizes of its dims, index ranges, input scales): several GEMM
  stages, vectors between stages, pairs/interleave, ordinary and grouped reductions, tile loads,
  scalars. `random_blocks()` draws from all of it, several dtypes included.
- mistakes.py: `twins()`, a valid block with one well-chosen mistake and the error code the checker
  must give (`Twin`); `MISTAKES` (kind -> code); `make_twin` for a given program.
- dims.py: `dim_sizes(blocks, max_dim, align)`, sizes for a block's symbolic dims that bind (every
  extent a positive integer, optionally aligned); `tiles(blocks)`, small tiles for the tile simulation.
- inputs.py: `block_inputs(block, sizes, seed, special=...)`, seeded inputs in the declared dtypes
  (finite, or with NaN, +-inf, large magnitudes, denormals, signed zeros); `cotangents`;
  `gradcheck_inputs`, float64 inputs for gradient checks.
- compare.py: `mismatch`, the tolerance rule (docs/design.md, "Accuracy") for a result against the interpreter.
- op_programs.py: `op_programs(op)`, tiny programs exercising one registry op every way its type
  rule allows; `OP_SIZES`.
- rules.py: `positive_args`, `differentiable_ops`: what the generators derive from the registry.
`coda_lang.fuzz` (`coda fuzz`) builds differential testing on these.

Importing this package imports hypothesis and NumPy, never torch; `coda check/run/grad` never
import it.
"""

from coda_lang.testing.compare import mismatch
from coda_lang.testing.dims import dim_sizes, dim_units, tiles
from coda_lang.testing.inputs import SPECIAL_KINDS, block_inputs, cotangents, gradcheck_inputs, input_seeds
from coda_lang.testing.mistakes import MISTAKES, Twin, make_twin, twins
from coda_lang.testing.op_programs import OP_SIZES, OpProgram, op_programs
from coda_lang.testing.programs import Forward, forward_blocks, random_blocks
from coda_lang.testing.rules import differentiable_ops, positive_args

__all__ = [
    "MISTAKES",
    "OP_SIZES",
    "SPECIAL_KINDS",
    "Forward",
    "OpProgram",
    "Twin",
    "block_inputs",
    "cotangents",
    "differentiable_ops",
    "dim_sizes",
    "dim_units",
    "forward_blocks",
    "gradcheck_inputs",
    "input_seeds",
    "make_twin",
    "mismatch",
    "op_programs",
    "positive_args",
    "random_blocks",
    "tiles",
    "twins",
]
