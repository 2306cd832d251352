"""Inputs for blocks: seeded random inputs for fuzzing (optionally with special values), and float64
inputs for gradient checks.

What it does:
- `block_inputs(block, sizes, seed, special=False)`: one array per parameter without a default, in
  its declared dtype (bf16 as `ml_dtypes.bfloat16`): standard normal, GEMM right-hand operands
  scaled by 1/sqrt(K); i32 indices of `pick` mostly within the column range, some outside it (-100,
  -1 and the width itself: rows that select nothing); other i32 values in [0, 100). Finite by default;
  with `special=True` (or a tuple of kinds from `SPECIAL_KINDS`) about one float element in ten is
  replaced by a special value: NaN, +inf, -inf, a large magnitude (1e3 to 3e4, which fits f16 but
  overflows it when squared), a denormal of the parameter's dtype, or a signed zero.
- `cotangents(block, sizes, seed)`: seeded cotangents for every float output, rounded to its dtype.
- `input_seeds()`: the hypothesis strategy of seeds (shrinking towards 0).
- `gradcheck_inputs`: float64 inputs for gradient checks (positive where an operand must be).
What it does not: choose sizes (dims.py) or programs (programs.py).
Invariants: the same (block, sizes, seed, special) always gives the same arrays (NumPy's PCG64);
every array binds without error (`Block.run`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from hypothesis import strategies as st

import coda_lang
from coda_lang.core.numerics import STORAGE, round_fp8
from coda_lang.ir.nodes import Block, Var
from coda_lang.ir.types import Dim, cotangent_dtype, extent, is_float, is_fp8
from coda_lang.ops import REGISTRY, Role

SPECIAL_KINDS = ("nan", "inf", "-inf", "large", "denormal", "zero")
SPECIAL_FRACTION = 0.1
_TINY = {
    "f32": float(np.finfo(np.float32).tiny),
    "bf16": float(np.finfo(np.float32).tiny),
    "f16": float(np.finfo(np.float16).tiny),
    "e4m3": 2.0**-6,  # float8_e4m3fn's smallest normal
    "e5m2": 2.0**-14,
}


def input_seeds() -> st.SearchStrategy[int]:
    return st.integers(0, 2**32 - 1)


def _ir(block: Any) -> Block:
    return block.ir if hasattr(block, "ir") else block


def _pick_ranges(block: Block) -> dict[str, Dim]:
    """{index parameter: the extent it selects within} for every `pick(x, idx)` of a parameter idx."""
    out: dict[str, Dim] = {}
    for s in block.stages:
        rows = (
            s.acc.type.shape[0] if s.acc is not None and s.acc.type is not None else (s.shape or (None,))[0]
        )
        for e in s.body:
            od = REGISTRY[e.op]
            if Role.INDEX not in od.roles:
                continue
            x, idx = e.ins[0], e.ins[od.roles.index(Role.INDEX)]
            if isinstance(idx, Var) and isinstance(x, Var) and x.type is not None and idx.type is not None:
                along_rows = idx.type.shape[0] == rows
                out[idx.name] = x.type.shape[1] if along_rows else x.type.shape[0]
    return out


def _gemm_rhs(block: Block) -> dict[str, Dim]:
    out: dict[str, Dim] = {}
    for s in block.stages:
        if isinstance(s.b, Var) and s.b.type is not None:
            out[s.b.name] = s.b.type.shape[1 if s.tb else 0]
    return out


def _specials(kinds: tuple[str, ...], dtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    which = rng.integers(0, len(kinds), size=n)
    sign = np.where(rng.random(n) < 0.5, -1.0, 1.0)
    vals = np.empty(n)
    for i, k in enumerate(kinds):
        sel = which == i
        m = int(sel.sum())
        if k == "nan":
            vals[sel] = np.nan
        elif k == "inf":
            vals[sel] = np.inf
        elif k == "-inf":
            vals[sel] = -np.inf
        elif k == "large":
            vals[sel] = sign[sel] * rng.uniform(1e3, 3e4, size=m)
        elif k == "denormal":
            vals[sel] = sign[sel] * rng.uniform(0.01, 0.99, size=m) * _TINY.get(dtype, _TINY["f32"])
        elif k == "zero":
            vals[sel] = sign[sel] * 0.0
        else:
            raise ValueError(f"unknown special value kind {k!r}; kinds: {', '.join(SPECIAL_KINDS)}")
    return vals


def _storage(x: np.ndarray, dtype: str) -> np.ndarray:
    import ml_dtypes

    if is_fp8(dtype):  # saturated, as an fp8 input binds
        return round_fp8(x, dtype).astype(STORAGE[dtype])
    return x.astype({"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}[dtype])


def block_inputs(
    block: Any, sizes: dict[str, int], seed: int, special: bool | tuple[str, ...] = False
) -> dict[str, np.ndarray]:
    """Seeded inputs for every parameter of `block` (a Block or its IR) without a default (see the
    module docstring)."""
    ir = _ir(block)
    sizes = {**_fixed(ir), **sizes}
    kinds = SPECIAL_KINDS if special is True else tuple(special) if special else ()
    rng = np.random.default_rng(seed)
    rhs, picks = _gemm_rhs(ir), _pick_ranges(ir)
    out: dict[str, np.ndarray] = {}
    for p in ir.params:
        t = p.var.type
        assert t is not None
        if p.default is not None:
            continue
        name = p.var.name
        shape = tuple(extent(d, sizes) for d in t.shape)
        if t.dtype == "i32":
            if name in picks:
                hi = extent(picks[name], sizes)
                idx = rng.integers(0, hi, size=shape)
                odd = rng.random(shape) < 0.15
                idx = np.where(odd, rng.choice(np.array([-100, -1, hi]), size=shape), idx)
            else:
                idx = rng.integers(0, 100, size=shape)
            out[name] = np.asarray(idx, dtype=np.int32)
            continue
        x: np.ndarray = rng.standard_normal(shape)
        if name in rhs:
            x /= np.sqrt(max(extent(rhs[name], sizes), 1))
        if kinds and x.size:
            hit = rng.random(shape) < SPECIAL_FRACTION
            x = np.asarray(x)
            x[hit] = _specials(kinds, t.dtype, int(hit.sum()), rng)
        out[name] = _storage(np.asarray(x), t.dtype)
    return out


def cotangents(block: Any, sizes: dict[str, int], seed: int) -> dict[str, np.ndarray]:
    """Seeded standard-normal cotangents for every float output, rounded to the dtype of its cotangent
    (the output's; bf16 for an fp8 output: `cotangent_dtype`). An fp8 output's cotangent holds fp8
    values (rounded to the output's dtype first): torch's autograd hands an fp8 tensor an fp8
    gradient, so the emulated runtime can only be given such cotangents."""
    ir = _ir(block)
    sizes = {**_fixed(_ir(block)), **sizes}
    rng = np.random.default_rng([seed, 1])
    out = {}
    for o in ir.outputs:
        if not is_float(o.type.dtype):
            continue
        x = rng.standard_normal(tuple(extent(d, sizes) for d in o.type.shape))
        if is_fp8(o.type.dtype):
            x = _storage(np.asarray(x), o.type.dtype).astype(np.float64)
        out[o.name] = _storage(np.asarray(x), cotangent_dtype(o.type.dtype))
    return out


def gradcheck_inputs(
    block: coda_lang.Block,
    sizes: dict[str, int],
    index_range: dict[str, int],
    rng: np.random.Generator,
    positive: frozenset[str] = frozenset(),
    scale: dict[str, float] | None = None,
) -> dict[str, np.ndarray]:
    """float64 inputs for every parameter without a default: standard normal (times `scale`), uniform
    in [0.5, 1.5] for `positive` ones; i32 indices uniform in [-1, index_range) (-1: no column)."""
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


def _fixed(ir: Any) -> dict[str, int]:
    """The dims a program fixes (`dims HD = 128`): sizes a caller need not give."""
    return {d.name: d.value for d in ir.dims if d.value is not None}
