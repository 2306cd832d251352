"""Automatic differentiation: Block -> backward Block in the same IR (see reverse.py)."""

from coda_lang.autodiff.assemble import Derived
from coda_lang.autodiff.builder import AutodiffError
from coda_lang.autodiff.policy import derive

__all__ = ["AutodiffError", "Derived", "derive"]
