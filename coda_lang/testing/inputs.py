"""Inputs for blocks: float64 inputs for gradient checks.

What it does: `gradcheck_inputs` draws standard-normal inputs (positive where an operand must be).
What it does not: choose sizes (dims.py) or programs (programs.py).
"""

from __future__ import annotations

import numpy as np

import coda_lang


def gradcheck_inputs(block: coda_lang.Block, sizes: dict[str, int], index_range: dict[str, int],
                     rng: np.random.Generator, positive: frozenset[str] = frozenset(),
                     scale: dict[str, float] | None = None) -> dict[str, np.ndarray]:
    """float64 inputs for every parameter without a default: standard normal (times `scale`), uniform
    in [0.5, 1.5] for `positive` ones; i32 indices uniform in [-1, index_range) (-1: no column)."""
    from coda_lang.interp.inputs import extent

    out: dict[str, np.ndarray] = {}
    for p in block.ir.params:
        t = p.var.type
        assert t is not None
        if p.default is not None:
            continue
        shape = tuple(extent(d, sizes) for d in t.shape)
        name = p.var.name
        if t.dtype == "i32":
            out[name] = rng.integers(-1, index_range[name], size=shape).astype(np.int32)
        elif name in positive:
            out[name] = rng.uniform(0.5, 1.5, size=shape)
        else:
            out[name] = rng.standard_normal(shape) * (scale or {}).get(name, 1.0)
    return out
