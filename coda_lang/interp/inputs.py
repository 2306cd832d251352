"""Binding a block's inputs: infer dims from array shapes, validate and convert the arrays.

What it does: `bind` checks that every parameter is given (or has a default), that shapes fit the
declared symbolic shapes (solving `c*X = n` for each dim), that dtypes fit (float for float
parameters, integer for i32), and converts each array to its compute dtype (float inputs of another
float dtype are rounded to the declared dtype first). `random_inputs` draws seeded inputs.
What it does not: run anything.
Invariants: every failure is a CodaError with a one-line diagnostic naming the parameter; NumPy
never raises out of here.
"""

from __future__ import annotations

import os
from fractions import Fraction
from typing import Any

import numpy as np

from coda_lang.core.diagnostics import error
from coda_lang.core.numerics import compute_dtype, round_to
from coda_lang.ir.nodes import Block, Stage, Var
from coda_lang.ir.types import Dim, extent, is_float, shape_str
from coda_lang.ops import REGISTRY, Role

# Codes of run-time input errors (not program errors: they are not in CODES).
INPUT_CODES = {
    "E0801": "missing or unknown input",
    "E0802": "input shape does not fit the declared shape",
    "E0803": "input dtype does not fit the declared dtype",
    "E0804": "dims can't be inferred or contradict each other",
    "E0805": "tile sizes",
    "E0806": "input on the wrong device (the CUDA runtime needs CUDA tensors, all on one device)",
    "E0807": "a size the GPU kernel can't take (stored rows must be a multiple of 16 bytes)",
    "E0808": "sizes whose memory or tile count the interpreter can't have",
    "E0809": "row chunks: a bad chunk= or budget=, or a block that can't run in row chunks",
    "E0810": "a kernel that did not finish on the GPU while tuning (a hang): its tile is not tried again",
    "E0811": "an input tensor without memory to read (a meta tensor, a DTensor, a freed storage such as a resharded FSDP2 parameter's)",
}

MAX_TILES = 200_000  # tiles one stage may simulate: the tile mode takes one NumPy step per tile


def available_memory() -> int:
    """Bytes this process can still have: MemAvailable of /proc/meminfo, else the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, AttributeError):
        return 1 << 62


# Bytes per element of a run's largest value that one step may hold beyond the values themselves: an
# op's temporaries, a random input drawn in float64, `coda run`'s statistics of an output (float64)
SCRATCH = 16


def memory_needed(block: Block, dims: dict[str, int], precision: str = "exact") -> int:
    """About the most bytes a run of the interpreter holds at these sizes, from its inputs to `coda
    run`'s report (an upper bound: tests/test_cli_run.py measures runs against it): every
    parameter, output and value of the block at its full extent (whole mode computes each over whole
    matrices) in the compute dtype, counted twice (a stage's results and their rounded copies); the
    inputs and the outputs again in their own dtypes; and SCRATCH bytes per element of the largest."""
    itemsize = 8 if precision == "f64" else 4
    values = [p.var for p in block.params]
    for s in block.body:
        for e in s.body if isinstance(s, Stage) else (s,):
            values.extend(e.outs)
    for st in block.stages:
        if st.acc is not None:
            values.append(st.acc)

    def count(t: Any) -> int:
        n = 1
        for d in t.shape:
            n *= max(int(d.evaluate(dims)), 1)
        return n

    total = largest = 0
    seen: set[str] = set()
    for v in values:
        if v.type is None or (v.name in seen and v.name != "acc"):
            continue
        seen.add(v.name)
        n = count(v.type)
        total += 2 * n * itemsize
        largest = max(largest, n)
    for t in [p.var.type for p in block.params] + [o.type for o in block.outputs]:
        if t is not None:
            size = 8 if precision == "f64" and is_float(t.dtype) else _ITEMSIZE.get(t.dtype, 4)
            total += count(t) * size
    return total + SCRATCH * largest


_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "e4m3": 1, "e5m2": 1, "i32": 4, "bool": 1}


def check_sizes(block: Block, dims: dict[str, int], precision: str = "exact", tile: Any = None) -> None:
    """E0808 before anything is allocated when these sizes need more memory than this machine has, or
    when a simulated tile would make a stage take more than MAX_TILES steps."""
    need, have = memory_needed(block, dims, precision), available_memory()
    if need > have:
        sizes = ", ".join(f"{k}={v}" for k, v in dims.items())
        raise error(
            "E0808",
            f"at {sizes} the interpreter needs about {need / 2**30:.1f} GiB; "
            f"{have / 2**30:.1f} GiB are available",
            notes=["choose smaller dims"],
        )
    tiles = [tile] if isinstance(tile, tuple) else list(tile.values()) if isinstance(tile, dict) else []
    for st in block.stages:
        if st.acc is None or st.acc.type is None:
            continue
        rows, cols = (int(d.evaluate(dims)) for d in st.acc.type.shape)
        for tm, tn in tiles:
            count = -(-rows // max(tm, 1)) * -(-cols // max(tn, 1))
            if count > MAX_TILES:
                raise error(
                    "E0808",
                    f"a {tm}x{tn} tile makes {count:,} tiles of a {rows}x{cols} stage; the "
                    f"tile simulation takes one step per tile (at most {MAX_TILES:,})",
                    notes=["choose a larger tile, or whole matrices (no tile)"],
                )


def _solve(d: Dim, n: int, dims: dict[str, int], where: str, given: dict[str, int]) -> None:
    if d.name is None:
        if Fraction(n) != d.coeff:
            raise error("E0802", f"{where} has extent {n}, but the declared extent is {d}")
        return
    x = Fraction(n) / d.coeff
    if x.denominator != 1 or x <= 0:
        raise error("E0802", f"{where} has extent {n}, which is not {d} for any integer {d.name}")
    value = int(x)
    if d.name in dims and dims[d.name] != value:
        src = "given" if d.name in given else "inferred"
        raise error(
            "E0804", f"{where} gives {d.name} = {value}, but {d.name} = {dims[d.name]} was {src} before"
        )
    dims[d.name] = value


def infer_dims(
    block: Block, shapes: dict[str, tuple[int, ...]], dims: dict[str, int] | None
) -> dict[str, int]:
    given = dict(dims or {})
    for name in given:
        if name not in {d.name for d in block.dims}:
            raise error(
                "E0804", f"unknown dim `{name}`; the block's dims are {', '.join(d.name for d in block.dims)}"
            )
        if not isinstance(given[name], (int, np.integer)) or given[name] <= 0:
            raise error("E0804", f"dim {name} must be a positive integer, got {given[name]!r}")
    out = {k: int(v) for k, v in given.items()}
    for d in block.dims:
        if d.value is not None:
            if d.name in out and out[d.name] != d.value:
                raise error("E0804", f"dim {d.name} is fixed to {d.value} by the program, got {out[d.name]}")
            out[d.name] = d.value
    for p in block.params:
        t = p.var.type
        assert t is not None
        if p.var.name not in shapes:
            continue
        shape = shapes[p.var.name]
        if len(shape) != len(t.shape):
            raise error(
                "E0802",
                f"input `{p.var.name}` has shape {tuple(shape)}, but it is declared "
                f"{t.dtype}{shape_str(t.shape) if t.shape else ' (a scalar)'}",
            )
        for axis, (ext, n) in enumerate(zip(t.shape, shape, strict=True)):
            _solve(ext, n, out, f"axis {axis} of input `{p.var.name}`", given)
    missing = [d.name for d in block.dims if d.name not in out]
    if missing:
        raise error(
            "E0804", f"dims {', '.join(missing)} can't be inferred from the inputs; give them (dims={{...}})"
        )
    # Every declared extent must be a positive integer for these dims (X/2 needs an even X).
    for p in block.params:
        for ext in p.var.type.shape if p.var.type else ():
            v = ext.evaluate(out)
            if v.denominator != 1 or v <= 0:
                raise error("E0804", f"parameter `{p.var.name}` has extent {ext} = {v} for these dims")
    return out


def _to_numpy(x: Any) -> np.ndarray:
    """NumPy view of an input; torch tensors (bf16 included) are copied to the CPU first."""
    if hasattr(x, "detach") and hasattr(x, "dtype") and "torch" in type(x).__module__:
        t = x.detach().cpu()
        ml = _ML_DTYPES.get(str(t.dtype))
        if ml is not None:  # (NumPy has no such dtype: through f32, exact)
            import ml_dtypes

            return t.float().numpy().astype(getattr(ml_dtypes, ml))
        return t.numpy()
    return np.asarray(x)


# torch dtypes NumPy lacks -> their ml_dtypes names; and the names of ml_dtypes' float arrays, which
# NumPy gives the kind "V"
_ML_DTYPES = {
    "torch.bfloat16": "bfloat16",
    "torch.float8_e4m3fn": "float8_e4m3fn",
    "torch.float8_e5m2": "float8_e5m2",
}
_ML_FLOATS = frozenset(_ML_DTYPES.values())


def bind(
    block: Block, inputs: dict[str, Any], dims: dict[str, int] | None, precision: str
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    names = {p.var.name for p in block.params}
    unknown = sorted(set(inputs) - names)
    if unknown:
        raise error(
            "E0801", f"unknown input `{unknown[0]}`; the block's parameters are {', '.join(sorted(names))}"
        )
    arrays: dict[str, np.ndarray] = {}
    for p in block.params:
        if p.var.name in inputs:
            try:
                arrays[p.var.name] = _to_numpy(inputs[p.var.name])
            except Exception as e:  # e.g. ragged lists
                raise error("E0803", f"input `{p.var.name}` is not an array: {e}") from None
            if (
                arrays[p.var.name].dtype.kind not in "fiub"
                and arrays[p.var.name].dtype.name not in _ML_FLOATS
            ):
                raise error(
                    "E0803",
                    f"input `{p.var.name}` is an array of {arrays[p.var.name].dtype} "
                    "(void, record, string or object elements); it must hold numbers",
                )
        elif p.default is None:
            raise error("E0801", f"missing input `{p.var.name}`")
    shapes = {k: tuple(v.shape) for k, v in arrays.items()}
    sizes = infer_dims(block, shapes, dims)
    env: dict[str, np.ndarray] = {}
    for p in block.params:
        t = p.var.type
        assert t is not None
        if p.var.name not in arrays:
            with np.errstate(over="ignore"):  # a default past f32's range is +-inf in f32, as a kernel has it
                env[p.var.name] = np.asarray(p.default, dtype=compute_dtype(t.dtype, precision))
            continue
        a = arrays[p.var.name]
        kind = a.dtype.kind
        if is_float(t.dtype):
            if kind != "f" and not (kind in "iu" and a.ndim == 0) and a.dtype.name not in _ML_FLOATS:
                raise error("E0803", f"input `{p.var.name}` is {a.dtype}, but it is declared {t.dtype}")
            x = a.astype(compute_dtype("f32", precision))
            env[p.var.name] = round_to(x, t.dtype, precision)
        else:
            if kind not in "iu":
                raise error("E0803", f"input `{p.var.name}` is {a.dtype}, but it is declared i32")
            if a.size and (a.max() > np.iinfo(np.int32).max or a.min() < np.iinfo(np.int32).min):
                raise error("E0803", f"input `{p.var.name}` has values outside the i32 range")
            env[p.var.name] = a.astype(np.int32)
    return env, sizes


def input_scales(block: Any) -> tuple[dict[str, Dim], dict[str, Dim]]:
    """What random inputs of a checked block's IR scale by: the contracted dim of each GEMM's right-hand
    operand (by name), and the dim each pick() index ranges over (by the index's name)."""
    rhs: dict[str, Dim] = {}
    pick_range: dict[str, Dim] = {}
    for st in block.stages:
        if isinstance(st.b, Var) and st.b.type is not None:
            rhs[st.b.name] = st.b.type.shape[1 if st.tb else 0]
        for e in st.body:
            od = REGISTRY[e.op]
            if Role.INDEX not in od.roles:
                continue
            src, idx = e.ins[0], e.ins[od.roles.index(Role.INDEX)]
            if isinstance(idx, Var) and isinstance(src, Var) and src.type is not None:
                pick_range[idx.name] = src.type.shape[1]
    return rhs, pick_range


def random_inputs(block: Block, dims: dict[str, int], seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs of a sensible scale: GEMM weights scaled by 1/sqrt(K), i32 indices within range."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    rhs, pick_range = input_scales(block)
    out: dict[str, np.ndarray] = {}
    for p in block.params:
        t = p.var.type
        assert t is not None
        if p.default is not None:
            continue
        shape = tuple(extent(d, dims) for d in t.shape)
        if t.dtype == "i32":
            hi = extent(pick_range[p.var.name], dims) if p.var.name in pick_range else 100
            out[p.var.name] = rng.integers(0, hi, size=shape, dtype=np.int32)
            continue
        x = rng.standard_normal(shape).astype(np.float32)
        if p.var.name in rhs:
            x /= np.sqrt(max(extent(rhs[p.var.name], dims), 1))
        dt = {
            "f32": np.float32,
            "bf16": ml_dtypes.bfloat16,
            "f16": np.float16,
            "e4m3": ml_dtypes.float8_e4m3fn,
            "e5m2": ml_dtypes.float8_e5m2,
        }[t.dtype]
        out[p.var.name] = x.astype(dt)
    return out


# Dim inference for callers that bind many times (the CUDA runtime, traced by torch.compile): the
# declared extents as plain ints, and a fast path that defers to infer_dims on anything inconsistent.


def shape_rules(block: Any) -> tuple[tuple[str, int, str | None, int, int], ...]:
    """(param, axis, dim, numerator, denominator) for every declared extent `c*X` (c = num/den):
    plain ints, so that inferring dims from tensor shapes is traceable by torch.compile."""
    rules = []
    for p in block.params:
        for axis, d in enumerate(p.var.type.shape if p.var.type else ()):
            rules.append((p.var.name, axis, d.name, d.coeff.numerator, d.coeff.denominator))
    return tuple(rules)


def given_dims(block: Any, dims: dict[str, int] | None) -> dict[str, int]:
    """`dims=` as plain ints, checked: E0804 for a dim the block doesn't declare or a size that is not
    a positive integer (a fixed dim or a shape that contradicts it: when a call binds its inputs)."""
    if not dims:
        return {}
    names = [d.name for d in block.dims]
    out = {}
    for name, v in dims.items():
        if name not in names:
            raise error("E0804", f"unknown dim `{name}`; the block's dims are {', '.join(names) or '(none)'}")
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise error("E0804", f"dim {name} must be a positive integer, got {v!r}")
        out[name] = int(v)
    return out


def dims_from_shapes(
    block: Any,
    rules: tuple[tuple[str, int, str | None, int, int], ...],
    shapes: dict[str, tuple[int, ...]],
    given: dict[str, int] | None = None,
) -> dict[str, int]:
    """Dims from `given` (checked by _given_dims) and input shapes, in integer arithmetic; any
    inconsistency defers to the interpreter's checks (infer_dims), which give the diagnostic."""
    dims: dict[str, int] = {d.name: d.value for d in block.dims if d.value is not None}
    for name, value in (given or {}).items():
        if dims.setdefault(name, value) != value:
            return infer_dims(block, shapes, given)
    for name, axis, dim, num, den in rules:
        shape = shapes.get(name)
        if shape is None or len(shape) <= axis:
            return infer_dims(block, shapes, given)
        n = int(shape[axis])
        if dim is None:
            if n * den != num:
                return infer_dims(block, shapes, given)
            continue
        if (n * den) % num:
            return infer_dims(block, shapes, given)
        value = n * den // num
        if dims.setdefault(dim, value) != value:
            return infer_dims(block, shapes, given)
    if len(dims) < len(block.dims):
        return infer_dims(block, shapes, given)
    return dims
