"""Automatic differentiation: Block -> backward Block in the same IR (see reverse.py)."""

from coda_lang.autodiff.builder import AutodiffError
from coda_lang.autodiff.reverse import Derivation, derive

__all__ = ["AutodiffError", "Derivation", "derive"]
