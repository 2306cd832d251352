"""Automatic differentiation: a block -> its backward block, in the same IR, and how that backward runs.

- reverse.py (with site.py, state.py, forward.py, unbroadcast.py, builder.py, cleanup.py,
  assemble.py): reverse mode over a block; policy.py: what the backward recomputes (`remat`);
- options.py: `BackwardOptions`, the one value of a backward's options (remat, chunk, budget,
  chunk_dim), checked once;
- chunk.py: whether and how a backward runs in chunks of one dim (`ChunkPlan`), chunk_rewrite.py: the
  block each chunk runs (IR to IR, checked directly), chunk_run.py: running a plan's chunks with any
  runtime's callables.

Imports the front end and the registry, never the interpreter or a backend (they run what it makes).
"""

from coda_lang.autodiff.assemble import Derived
from coda_lang.autodiff.builder import AutodiffError
from coda_lang.autodiff.policy import derive

__all__ = ["AutodiffError", "Derived", "derive"]
