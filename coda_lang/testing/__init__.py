"""coda_lang.testing: hypothesis strategies and helpers for fuzzing coda programs and kernels.

Public API (each module's docstring says more):
- programs.py: `forward_blocks()`, random well-typed, block-local forward blocks drawn from the op
  registry (a `Forward`: source text, sizes of its dims, index ranges, input scales).
- op_programs.py: `op_programs(op)`, tiny programs exercising one registry op every way its type
  rule allows; `OP_SIZES`.
- inputs.py: `gradcheck_inputs`, float64 inputs for gradient checks.
- rules.py: `positive_args`, `differentiable_ops`: what the generators derive from the registry.

Importing this package imports hypothesis and NumPy, never torch; `coda check/run/grad` never
import it.
"""

from hypothesis import strategies as st

from coda_lang.testing.inputs import gradcheck_inputs
from coda_lang.testing.op_programs import OP_SIZES, OpProgram, op_programs
from coda_lang.testing.programs import Forward, forward_blocks
from coda_lang.testing.rules import differentiable_ops, positive_args


def random_blocks(gemm_dtypes: tuple[str, ...] = ("f32", "bf16", "f16")) -> st.SearchStrategy[Forward]:
    """Random checked blocks with every feature the generator has: several dtypes (activations, stored
    tiles and GEMM operands in f32, bf16 or f16), grouped values read after their stage, partials read
    by later stages, picks from narrower tiles. Not restricted to what autodiff handles today, so a
    drawn block's backward may raise CodaError (E06); for differential testing that is fine.
    `gemm_dtypes`: the dtypes GEMM operands may have (("bf16", "f16") for the CUDA backend)."""
    return forward_blocks(known_bugs=True, gemm_dtypes=gemm_dtypes)

__all__ = [
    "OP_SIZES",
    "Forward",
    "OpProgram",
    "differentiable_ops",
    "forward_blocks",
    "gradcheck_inputs",
    "op_programs",
    "positive_args",
    "random_blocks",
]
