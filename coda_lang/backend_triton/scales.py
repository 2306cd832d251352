"""The delayed-scaling rule's update as one Triton kernel: a step's amaxes into the history ring, and the
next scales, in one launch.

What it does: `delayed_update(a, rows, count, vec, limit, last=None)` is, for a vector `a` of this
step's amaxes (f32, W of them), the ring `rows` [SIZE, W] of the last SIZE steps' amaxes with its
position `count` (a 0-d int64: the next row written is count % SIZE), and the scales `vec` (f32, W):
    m = max(a, every row of `rows`)        (NaN kept: a NaN amax in the history keeps the scale)
    vec = limit / m where m is finite and > 0, else vec as it was   (f32: 1 / m rounded, times limit)
    last = vec before that (when given); rows[count % SIZE] = a; count += 1
which is what grad_scales.py's torch ops do in about ten launches (`delayed_scales`, then
`AmaxRing.push`): a CUDA graph of an fp8 step replays each of those as a kernel of a few microseconds,
and a step makes one such update per call site of its blocks' backwards (one a decoder layer) and one
for the forward's scales.
What it does not: reduce the amaxes over ranks (the caller does, before), make the ring, or run on the
CPU but under Triton's interpreter (`interpret=True`, the tests' path): the callers keep torch's ops
there.
Invariants: one program reads every value it needs before it writes any (the row it overwrites is in
the max, as in the torch ops, which take the rule before the push); the results are torch's bit for
bit: max and the comparisons are exact, and `limit / m` is computed as torch computes a number divided
by a tensor (`Tensor.__rtruediv__`: the reciprocal, rounded to nearest, times the number).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from coda_lang.backend_triton.generate import _jit
from coda_lang.backend_triton.launcher import launch


def _delayed_kernel(
    a, rows, count, vec, last, limit, W, SIZE: tl.constexpr, BW: tl.constexpr, LAST: tl.constexpr
):
    j = tl.arange(0, BW)
    m = j < W
    amax = tl.load(a + j, mask=m, other=0.0)
    cur = tl.load(vec + j, mask=m, other=1.0)
    mx = amax
    for k in tl.static_range(SIZE):
        mx = tl.maximum(mx, tl.load(rows + k * W + j, mask=m, other=0.0), propagate_nan=tl.PropagateNan.ALL)
    keep = (mx == mx) & (mx != float("inf")) & (mx > 0.0)
    # (torch's `limit / a` is `a.reciprocal() * limit`: an IEEE reciprocal, then a product)
    new = tl.where(keep, tl.math.div_rn(tl.full([BW], 1.0, tl.float32), mx) * limit, cur)
    c = tl.load(count)
    if LAST:
        tl.store(last + j, cur, mask=m)
    tl.store(vec + j, new, mask=m)
    tl.store(rows + (c % SIZE) * W + j, amax, mask=m)
    tl.store(count, c + 1)


_kernels: dict[bool, Any] = {}


def delayed_update(
    a: torch.Tensor,
    rows: torch.Tensor,
    count: torch.Tensor,
    vec: torch.Tensor,
    limit: float,
    last: torch.Tensor | None = None,
    interpret: bool = False,
) -> None:
    """The rule and the push, in place (see the module docstring): `a`, `vec` and `last` f32 vectors of
    W, `rows` a contiguous f32 [SIZE, W] ring (SIZE >= 1), `count` its 0-d int64 position; CUDA tensors,
    or any under the interpreter."""
    width = a.numel()
    assert rows.dim() == 2 and rows.shape[1] == width and rows.shape[0] >= 1 and rows.is_contiguous()
    assert (
        vec.numel() == width and vec.is_contiguous() and a.dtype == vec.dtype == rows.dtype == torch.float32
    )
    assert count.numel() == 1 and count.dtype == torch.int64
    assert last is None or (last.numel() == width and last.is_contiguous())
    assert interpret or a.device.type == "cuda"
    if width == 0:
        count.add_(1)
        return
    k = _kernels.get(interpret)
    if k is None:
        k = _kernels[interpret] = _jit(interpret)(_delayed_kernel)
    a = a.contiguous()
    launch(
        k,
        (1,),
        a,
        rows,
        count,
        vec,
        vec if last is None else last,
        float(limit),
        width,
        SIZE=rows.shape[0],
        BW=max(16, triton.next_power_of_2(width)),
        LAST=last is not None,
    )
