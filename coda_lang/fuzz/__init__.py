"""`coda fuzz`'s library: differential testing of a block's kernels (or tile simulation) against the
interpreter.

What it does: draws cases (sizes for the block's dims, including sizes that are not multiples of the
tile; a seed for the inputs and the cotangents; for the interpreter target a small tile) with
hypothesis, runs the block on the path under test and on the whole-matrix interpreter, forward and
backward, and compares them with the tolerance rule of `coda_lang.testing.compare` (where an element
misses its per-element part, with that element's rounding bound, `coda_lang.interp.bound`: a value that
cancelled is judged against the magnitudes that cancelled). Targets:
- `interp`: the interpreter's tile simulation (`Block.run(..., sim_tile=...)`, `Block.vjp(..., sim_tile=...)`);
- `cuda`: the compiled kernels (`Block.cuda()`; backward through `CudaBlock.autograd()`), on a GPU;
  the kernels' per-tile partial buffers are also compared with the tile simulation at their tiles;
- `emulate`: the CUDA runtime with each kernel launch replaced by its torch stand-in, on the CPU
  (tests the runtime's host logic without a GPU).
The backward under test takes its options as the API does, one `BackwardOptions` (`backward=`) or
its keywords: it is derived with a saved-tensor policy (`remat`: save, recompute or auto;
docs/design.md, "Saved and recomputed"; default DEFAULT_REMAT, the API's) and can run in chunks
(`chunk`: a number of rows, "auto" from a memory budget the search draws, or DRAW, each case its
own; `chunk_dim`: along another dim; "Chunked backward"); its
references are the whole-matrix interpreter's gradients under the same policy, unchunked, and under
a policy other than save the float64 gradients are also compared with save's (every policy computes
the same function: this catches a wrong recompute derivation, which the reference would share).
On a mismatch hypothesis shrinks the case; the report gives the smallest failing dims, the input seed
(the policy and the chunk) and a one-line command that reproduces exactly that case. `fuzz_programs`
does the same over random programs (`coda_lang.testing.random_blocks`), shrinking the program too;
each program's policy and each case's chunk are drawn by the search unless fixed.

The modules, by job: case.py (what a case is, how the search draws one, the command that reproduces
it), fuzzer.py (`Fuzzer`: one block made ready on one target), compare.py (one case run on both paths
and compared), search.py (the hypothesis search and its shrinking, `fuzz_block`), programs.py (random
programs, `fuzz_programs`).
What it does not: parse arguments (cli/fuzz.py) or decide tolerances (testing/compare.py).
Invariants: no GPU library is imported unless the target needs one; a case that raises anything but a
`CodaError` on either path is a failure (a traceback is a bug); everything is seeded, so the same
command finds the same failure.
"""

from coda_lang.fuzz.case import ALIGN, DRAW, MAX_DIM, POLICIES, TARGETS, Case, Unavailable
from coda_lang.fuzz.fuzzer import EMULATE_TILES, Fuzzer
from coda_lang.fuzz.programs import fuzz_programs, save_program
from coda_lang.fuzz.search import Failure, Progress, Result, fuzz_block
from coda_lang.ir.nodes import DEFAULT_REMAT

__all__ = [
    "ALIGN",
    "DEFAULT_REMAT",
    "DRAW",
    "EMULATE_TILES",
    "MAX_DIM",
    "POLICIES",
    "TARGETS",
    "Case",
    "Failure",
    "Fuzzer",
    "Progress",
    "Result",
    "Unavailable",
    "fuzz_block",
    "fuzz_programs",
    "save_program",
]
