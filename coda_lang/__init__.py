"""coda_lang: a checked, file-based language for GEMM-plus-epilogue programs on Hopper GPUs.

The package by job, each layer importing only the layers below it (tests/test_layers.py keeps the
order; docs/CONTRIBUTING.md draws it):
- core/: diagnostics, numerics, progress (the ground floor); ir/: types and nodes; ops/: the registry;
- frontend/: syntax (parse, lower, print) and verify (checker, plans);
- autodiff/: backward blocks, their options and their chunked runs;
- interp/: the NumPy reference interpreter;
- backend_triton/, backend_cute/ (plan, build, runtime): the GPU kernels (the only place GPU
  libraries are imported, lazily);
- api.py, torch.py, testing/, fuzz/, hf/, cli/: what users call.
`coda_lang.load(path_or_text)` is the entry point of the Python API; `coda_lang.BackwardOptions` the
options every backward takes (what it recomputes, its chunks).
"""

from coda_lang.api import Block, Program, load
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.core import VERSION
from coda_lang.core.diagnostics import CodaError, Diagnostic

__version__ = VERSION
__all__ = ["BackwardOptions", "Block", "CodaError", "Diagnostic", "Program", "load"]
