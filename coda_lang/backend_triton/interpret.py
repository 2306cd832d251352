"""Triton's CPU interpreter, with its reductions by a combine function done a slice at a time.

What it does: `interpreted()` is the decorator the generated kernels and the layout copies take when
they run under Triton's CPU interpreter (CPU users, the tests). The generated kernels fold their
reductions with `tl.reduce` and combine functions of their own (`_add`, `_nanmax`, `_nanmin`:
generate.py says why). The interpreter folds such a reduction one element at a time, calling the
combine function on one-element tensors: a stage's test spent most of its time there. `interpreted()`
first replaces that fold (`ReduceOps.generic_reduce`) by one that calls the combine function on
whole slices along the reduced axis, in the same order (element 0, then 1, 2, ...), so that each
output element is the same left fold as before, bit for bit.
What it does not: touch the GPU path (`triton.jit`), scans, or the interpreter's own fast paths
(tl.sum, tl.max, argmin and argmax keep NumPy's).
Invariants: the result's shape, dtype and values are those of the interpreter's own fold (tests/
test_triton_interpret.py compares the two); where the interpreter has no `ReduceOps.generic_reduce`
(another Triton), nothing is replaced.
"""

from __future__ import annotations

from typing import Any

_ORIGINAL: list[Any] = []  # the interpreter's own fold, once replaced (what the tests compare with)


def _slice_fold(self: Any, input: Any) -> Any:
    """`ReduceOps.generic_reduce`, folding along the axis a slice at a time (a method of ReduceOps)."""
    import numpy as np
    import triton.language as tl

    original_axis = self.axis
    tensors, axis = self.unravel(input, self.axis)
    datas = [t.handle.data for t in tensors]
    shape = datas[0].shape
    if shape[axis] == 0:  # (nothing to fold: the interpreter's own zeros)
        return _ORIGINAL[0](self, input)
    out_shape = shape[:axis] + shape[axis + 1 :]

    def tensor(a: Any, j: int) -> Any:
        return self.to_tensor(np.ascontiguousarray(a), tensors[j].dtype)

    acc = [np.take(d, 0, axis=axis) for d in datas]
    for k in range(1, shape[axis]):
        ret = self.combine_fn.fn(
            *(tensor(a, j) for j, a in enumerate(acc)),
            *(tensor(np.take(d, k, axis=axis), j) for j, d in enumerate(datas)),
        )
        ret = ret if isinstance(ret, tuple) else (ret,)
        acc = [
            np.asarray(r.handle.data if isinstance(r, tl.core.tensor) else r)
            .reshape(out_shape)
            .astype(datas[j].dtype)
            for j, r in enumerate(ret)
        ]
    out = []
    for j, data in enumerate(acc):  # (each in its input's dtype and out_shape, as np.take gives it)
        if self.keep_dims:
            if original_axis is not None:
                data = np.expand_dims(data, axis)
            else:
                for _ in range(len(shape)):
                    data = np.expand_dims(data, 0)
        elif original_axis is None:
            data = data.item()
        out.append(self.to_tensor(data, tensors[j].dtype))
    return out


def speed_up_reductions() -> bool:
    """Replace the interpreter's element-at-a-time fold by `_slice_fold` (once); whether it is in place."""
    if _ORIGINAL:
        return True
    from triton.runtime import interpreter

    ops = getattr(interpreter, "ReduceOps", None)
    if ops is None or not callable(getattr(ops, "generic_reduce", None)):
        return False
    _ORIGINAL.append(ops.generic_reduce)
    ops.generic_reduce = _slice_fold
    return True


def interpreted() -> Any:
    """The decorator of a function run by Triton's CPU interpreter, its reductions sped up."""
    from triton.runtime.interpreter import InterpretedFunction

    speed_up_reductions()
    return InterpretedFunction


__all__ = ["interpreted", "speed_up_reductions"]
