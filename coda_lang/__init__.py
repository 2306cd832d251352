"""coda_lang: a checked, file-based language for GEMM-plus-epilogue programs on Hopper GPUs.

Layers (DESIGN.md section 7): frontend/syntax/grammar.lark and frontend/syntax/ (parse, lower to IR), ir/ (types, nodes,
printer), ops/ (the op registry), frontend/verify/ (checker, diagnostics, plans), interp/ (NumPy reference),
autodiff/ (backward blocks), backend_cute/ (CuTeDSL kernels; the only place GPU libraries are
imported, lazily). `coda_lang.load(path_or_text)` is the entry point of the Python API;
`coda_lang.BackwardOptions` the options every backward takes (what it recomputes, its chunks).
"""

from coda_lang.api import Block, Program, load
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.core import VERSION
from coda_lang.core.diagnostics import CodaError, Diagnostic

__version__ = VERSION
__all__ = ["BackwardOptions", "Block", "CodaError", "Diagnostic", "Program", "load"]
