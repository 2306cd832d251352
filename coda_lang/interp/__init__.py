"""NumPy reference interpreter (whole-matrix and tile-simulation modes); see run.py."""

from coda_lang.core.numerics import PRECISIONS, round_to
from coda_lang.interp.inputs import INPUT_CODES, bind, infer_dims, random_inputs
from coda_lang.interp.run import combine, run_block

__all__ = [
    "INPUT_CODES",
    "PRECISIONS",
    "bind",
    "combine",
    "infer_dims",
    "random_inputs",
    "round_to",
    "run_block",
]
