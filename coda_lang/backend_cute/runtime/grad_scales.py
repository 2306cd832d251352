"""`DelayedScaling`: the delayed per-tensor scales of a backward's fp8 cotangents, kept across steps.

What it does: holds, for one call site of a function made with `BackwardOptions(fp8_grads=...)`,
the scale each quantized cotangent is stored with (`dacc<k>_scale`, the backward's inputs) and the
history of its amax (`dacc<k>_amax`, the backward's outputs), and after each backward sets the next
step's scale by one documented rule (docs/design.md, "The fp8 backward", "Through torch autograd"):

    scale = fp8_max / max(last `history` amaxes) / 2**margin      (computed in f32)

kept unchanged where that max is 0 (a cotangent that was all zeros) or not finite (an inf or NaN
gradient: an overflowing loss scale's step, which is skipped anyway). fp8_max is 57344 for e5m2,
448 for e4m3. The first step's scales are what `initial` says, never a silent default:
- a number (every scale) or {scale name: number}: those scales;
- "calibrate": the first backward runs the derived backward again until every scale is the rule
  applied to that same backward's amaxes (current scaling for the first step; one run more than
  there are scales at most, each cotangent's amax depending only on the scales of the cotangents
  before it), and returns the last run's gradients.
What it does not: run anything (runtime/autograd.py's backward calls `scales_for` and `record`), or
share one state between call sites: a function used by several layers takes one state per layer
(`f(..., grad_scales=state)`), since each layer's cotangents have their own magnitude.
Invariants: scales and amaxes are 0-d f32 tensors on the device of the backward's tensors (no host
sync per step); a state is bound to the scale names and fp8 dtype of the first backward it serves
and refuses another's (ValueError). After its first backward, a step changes the state only on the
device and in place (the scales' row, the amax ring and its position), so a CUDA graph that captured
a step advances it at each replay as the step itself would (docs/models.md, "CUDA graphs").
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable
from typing import Any

import torch

from coda_lang.autodiff.options import FP8_GRADS, BackwardOptions
from coda_lang.ir.types import FP8_MAX

__all__ = ["DelayedScaling"]


def f32_row(values: list[torch.Tensor]) -> torch.Tensor:
    """One-element tensors as one detached f32 vector: one stack where they are all 0-d f32 tensors on
    one device (a step's amaxes and scales: a few launches fewer per call site, which the host's
    time of an fp8 step shows), else each reshaped and cast first."""
    if values and all(
        v.dim() == 0 and v.dtype == torch.float32 and v.device == values[0].device for v in values
    ):
        return torch.stack(values).detach()
    return torch.stack([v.detach().reshape(()).to(torch.float32) for v in values])


class AmaxRing:
    """The last `size` amax vectors of `width` scales: `rows` [size, width], 0 where nothing was written
    yet (an amax is >= 0, so a 0 row changes no max; a NaN one stays in the max), and `count` the
    vectors pushed, a 0-d int64 tensor on the device: `push` writes row `count % size` there, so that
    a CUDA graph's replay of a step writes the next row, as the step would have (a position kept on
    the host would be the captured one at every replay). Three small launches a push."""

    def __init__(self, size: int, width: int, device: torch.device):
        self.rows = torch.zeros((size, width), dtype=torch.float32, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)

    def push(self, a: torch.Tensor) -> None:
        self.rows.index_copy_(0, (self.count % self.rows.shape[0]).view(1), a.view(1, -1))
        self.count.add_(1)

    def widen(self, width: int) -> None:
        """`width` more scales, their past amaxes 0 (a call site added to a bank)."""
        self.rows = torch.cat([self.rows, self.rows.new_zeros((self.rows.shape[0], width))], 1)

    def to(self, device: torch.device) -> AmaxRing:
        if self.rows.device != device:
            self.rows, self.count = self.rows.to(device), self.count.to(device)
        return self

    def pushed(self) -> int:
        """How many vectors were pushed (waits for the GPU: for checkpoints)."""
        return int(self.count)

    def oldest_first(self) -> list[torch.Tensor]:
        """The rows written, oldest first (waits for the GPU: for checkpoints)."""
        size, n = self.rows.shape[0], self.pushed()
        k = min(n, size)
        return [self.rows[(n - k + j) % size] for j in range(k)]

    @classmethod
    def loaded(cls, rows: torch.Tensor, pushed: int, device: torch.device) -> AmaxRing:
        """The ring whose rows are `rows` as they lie in one (the next written at `pushed % size`),
        after `pushed` vectors: a checkpoint's."""
        ring = cls(rows.shape[0], rows.shape[1], device)
        ring.rows.copy_(rows.to(device=device, dtype=torch.float32))
        ring.count.fill_(pushed)
        return ring

    @classmethod
    def of(cls, size: int, rows: list[torch.Tensor], pushed: int, device: torch.device) -> AmaxRing:
        """A ring of `size` rows holding `rows` (oldest first) as the last of `pushed` vectors."""
        lying = torch.zeros((size, rows[0].numel() if rows else 0), dtype=torch.float32)
        k = min(len(rows), size)
        for j, r in enumerate(rows[len(rows) - k :]):
            lying[(pushed - k + j) % size] = r.reshape(-1).to(device="cpu", dtype=torch.float32)
        return cls.loaded(lying, pushed, device)


class DelayedScaling:
    """Delayed per-tensor scales for the fp8 cotangents of one call site's backward; see the module
    docstring. `initial`: a number, {scale name: number} or "calibrate" (required: there is no
    default first scale that is right for every model); `margin`: the scale is divided by 2**margin
    (headroom for a cotangent that grows between steps); `history`: how many past amaxes the scale
    is computed from (their max). `scales` (the next backward's), `last_scales` (the last one ran at)
    and `amaxes` (the last one's; name -> 0-d f32 tensor, amaxes keyed by the scale's name) show the
    state; `steps` counts the backwards recorded."""

    def __init__(self, initial: float | dict[str, float] | str, *, margin: int = 0, history: int = 1):
        if isinstance(initial, str):
            if initial != "calibrate":
                raise ValueError(
                    f'initial= is {initial!r}; it takes a scale (a number), {{scale name: number}} or "calibrate"'
                )
        elif isinstance(initial, dict):
            for k, v in initial.items():
                _positive(f"initial[{k!r}]", v)
        else:
            _positive("initial", initial)
        if isinstance(margin, bool) or not isinstance(margin, numbers.Integral) or margin < 0:
            raise (ValueError if isinstance(margin, numbers.Integral) else TypeError)(
                f"margin= is {margin!r}; it takes a whole number of powers of 2 (>= 0)"
            )
        if isinstance(history, bool) or not isinstance(history, numbers.Integral) or history < 1:
            raise (ValueError if isinstance(history, numbers.Integral) else TypeError)(
                f"history= is {history!r}; it takes a number of steps (>= 1)"
            )
        self.initial: float | dict[str, float] | str = initial
        self.margin: int = int(margin)
        self.history: int = int(history)
        self.dtype: str | None = None  # the fp8 dtype of the cotangents, once bound
        self.names: tuple[str, ...] = ()  # the scale names, once bound
        self.scales: dict[str, torch.Tensor] = {}  # 0-d views of `_vec`, updated in place
        self.amaxes: dict[str, torch.Tensor] = {}  # the last backward's
        self.last_scales: dict[str, torch.Tensor] = {}  # the scales the last backward ran at
        # the scales as one f32 vector (in `names` order), written in place by each backward's rule
        self._vec: torch.Tensor | None = None
        # the past amaxes, one row per step and a column per name: a ring of history - 1 rows (the
        # current amax is the history's last; AmaxRing). One tensor, so that the rule is a few kernels
        # per step, not a few per name and past step, and nothing in it waits for the GPU
        self._past: AmaxRing | None = None
        # the backwards recorded by the host (a CUDA graph's replays record on the device only: the
        # ring's count is theirs too)
        self.steps: int = 0
        # applied to each backward's amax vector (in `names` order) before the rule: an all-reduce over
        # data-parallel ranks (coda_lang.hf.reduce_fp8_amaxes sets it); None: the amaxes as measured
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __repr__(self) -> str:
        shown = {k: float(v) for k, v in self.scales.items()}
        return (
            f"DelayedScaling(initial={self.initial!r}, margin={self.margin}, history={self.history}; "
            f"steps={self.steps}, scales={shown})"
        )

    def bind(self, names: list[str], dtype: str) -> None:
        """Serve the backward whose cotangent scales are `names`, quantized to `dtype`: ValueError for a
        state bound to another, or an `initial` dict whose names are not these."""
        if dtype not in FP8_GRADS:
            raise ValueError(f"fp8 dtype {dtype!r}; cotangents are quantized to {' or '.join(FP8_GRADS)}")
        if self.dtype is not None:
            if (self.dtype, self.names) != (dtype, tuple(names)):
                raise ValueError(
                    f"this DelayedScaling serves a backward with {self.dtype} scales "
                    f"{', '.join(self.names)}, not one with {dtype} scales {', '.join(names)}: "
                    "give each call site its own"
                )
            return
        if isinstance(self.initial, dict) and set(self.initial) != set(names):
            raise ValueError(
                f"initial= names {', '.join(sorted(self.initial)) or 'no scale'}; this backward's "
                f"scales are {', '.join(names)}"
            )
        self.dtype = dtype
        self.names = tuple(names)

    @property
    def calibrating(self) -> bool:
        """Whether the next backward calibrates (initial="calibrate" and no backward recorded yet)."""
        return self.initial == "calibrate" and self.steps == 0

    def scales_for(self, device: torch.device) -> dict[str, torch.Tensor]:
        """This step's scales (0-d f32 tensors on `device`): the current ones, else the initial ones
        (1.0 for the first run of a calibration)."""
        if not self.scales:
            init = self.initial
            values = [
                1.0 if init == "calibrate" else init[n] if isinstance(init, dict) else init
                for n in self.names
            ]
            self._set(torch.tensor(values, dtype=torch.float32).to(device))  # (one copy, made once)
        if self._vec is not None and self._vec.device != device:
            self._set(self._vec.to(device))
        return dict(self.scales)

    def _set(self, row: torch.Tensor) -> None:
        """The scales from now on: `row` (in `names` order), which the state owns and updates in place."""
        self._vec = row
        self.scales = {n: row[i] for i, n in enumerate(self.names)}

    def _row(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """`values` by name as one f32 vector in the order of `names`."""
        return f32_row([values[n] for n in self.names])

    def next_scales(
        self, amaxes: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The rule: fp8_max / amax / 2**margin in f32, where amax is the max of `amaxes` with the
        history before it; the scale in `scales` where that amax is 0 or not finite."""
        a = self._reduced(self._row(amaxes))
        new = self._rule(a, self._row(scales).to(a.device))
        return {n: new[i] for i, n in enumerate(self.names)}

    def set_scales(self, scales: dict[str, torch.Tensor]) -> None:
        """The next backward's scales (a calibration's), copied into a row the state owns."""
        self._set(self._row(scales).clone())

    def _reduced(self, a: torch.Tensor) -> torch.Tensor:
        return a if self.reduce is None else self.reduce(a)

    def _limit(self) -> float:
        """The rule's numerator: the fp8 dtype's largest value over 2**margin."""
        assert self.dtype is not None
        return FP8_MAX[self.dtype] / 2.0**self.margin

    def _rule(self, a: torch.Tensor, current: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        past = self._past.to(a.device).rows if self._past is not None else None
        return delayed_scales(a, past, current, self._limit(), out=out)

    def record(self, amaxes: dict[str, torch.Tensor]) -> None:
        """A backward's amaxes (by scale name): into the history, and the next step's scales set by
        the rule, in place (`last_scales`: a copy of those the backward ran at). Once the history has
        its ring, on a GPU one kernel (`update_scales`)."""
        a = self._reduced(self._row(amaxes))
        if self._vec is None or self._vec.device != a.device:  # (not reached after a first backward)
            self._set(self._row(self.scales).to(a.device).clone())
        assert self._vec is not None
        last = torch.empty_like(self._vec)
        if self.history > 1 and self._past is None:
            # (made before the first rule: its zero rows change no max of amaxes, which are >= 0 or
            # NaN, so the first update is the fused kernel's too, and it compiles there, before any
            # CUDA graph could capture a step)
            self._past = AmaxRing(self.history - 1, len(self.names), a.device)
        ring = None if self._past is None else self._past.to(a.device)
        update_scales(a, ring, self._vec, self._limit(), last)
        self.amaxes = {n: a[i] for i, n in enumerate(self.names)}
        self.last_scales = {n: last[i] for i, n in enumerate(self.names)}
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        """The scales and amax history (for a checkpoint): `load_state_dict` restores them. (Reads the
        ring's count from the device: it counts a CUDA graph's replays too.)"""
        rows = self._past.oldest_first() if self._past is not None else []
        steps = self._past.pushed() if self._past is not None else self.steps
        return {
            "dtype": self.dtype,
            "names": list(self.names),
            "scales": {k: v.clone() for k, v in self.scales.items()},
            "history": {n: [r[i].clone() for r in rows] for i, n in enumerate(self.names)},
            "steps": steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dtype = state["dtype"]
        self.names = tuple(state["names"])
        self.steps = state["steps"]
        self._vec, self.scales, self._past = None, {}, None
        if state["scales"]:
            first = next(iter(state["scales"].values()))
            self._set(
                torch.stack([state["scales"][n].reshape(()).to(torch.float32) for n in self.names]).to(
                    first.device
                )
            )
        hist = state["history"]
        n = len(hist[self.names[0]]) if self.names and hist else 0
        if self.history > 1 and n:
            first = hist[self.names[0]][0]
            rows = [
                torch.stack([hist[name][k].reshape(()).to(torch.float32) for name in self.names])
                for k in range(n)
            ]
            self._past = AmaxRing.of(self.history - 1, rows, self.steps, first.device)


# Triton's CPU interpreter runs `fused_update`'s kernel on CPU tensors where set (tests: the kernel
# checked against the torch ops it replaces, through the callers)
INTERPRET_FUSED = False
# `fused_update` on a GPU only where $CODA_FUSED_SCALES=1: bit for bit torch's ops on the CPU and on an
# H200, but no faster in a captured step (benchmarks/RESULTS.md, 2026-11-29: inside the spread), so off
# by default (benchmarks/hf_train_step.py's coda-fp8-fscales times it)
FUSED_SCALES_VAR = "CODA_FUSED_SCALES"


def fused_scales_on() -> bool:
    """$CODA_FUSED_SCALES: "1" on, "0" or unset off; ValueError for another value."""
    got = os.environ.get(FUSED_SCALES_VAR, "0")
    if got not in ("0", "1"):
        raise ValueError(f"${FUSED_SCALES_VAR} is {got!r}; it takes 1 (one kernel a scale update) or 0")
    return got == "1"


def update_scales(
    a: torch.Tensor, ring: AmaxRing | None, vec: torch.Tensor, limit: float, last: torch.Tensor | None = None
) -> None:
    """`vec` set in place by the rule from the amaxes `a` and the history `ring` (None: no history),
    then `a` pushed into the ring; `last` (when given) set to `vec` as it was first. One kernel where
    `fused_update` runs, else torch's ops: the same bits."""
    if ring is not None and fused_update(a, ring, vec, limit, last):
        return
    if last is not None:
        last.copy_(vec)
    delayed_scales(a, None if ring is None else ring.rows, vec, limit, out=vec)
    if ring is not None:
        ring.push(a)


def fused_update(
    a: torch.Tensor, ring: AmaxRing, vec: torch.Tensor, limit: float, last: torch.Tensor | None = None
) -> bool:
    """`delayed_scales(a, ring.rows, vec, limit, out=vec)` then `ring.push(a)` (and `last` set to
    `vec` as it was first), as one Triton kernel (backend_triton/scales.py), bit for bit the same;
    True where it ran, False where the caller's torch ops must (off a GPU, without
    $CODA_FUSED_SCALES=1, under a torch.compile trace, or a ring that is not one contiguous f32
    block)."""
    on_gpu = vec.device.type == "cuda" and fused_scales_on()
    if not (on_gpu or INTERPRET_FUSED) or torch.compiler.is_compiling():
        return False
    if not (ring.rows.is_contiguous() and vec.is_contiguous() and ring.rows.device == vec.device):
        return False
    # lazy: imports Triton, which only a GPU run (or the interpreter's test) needs
    from coda_lang.backend_triton.scales import delayed_update

    delayed_update(a, ring.rows, ring.count, vec, limit, last, interpret=vec.device.type != "cuda")
    return True


def delayed_scales(
    amax: torch.Tensor,
    past: torch.Tensor | None,
    current: torch.Tensor,
    limit: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The delayed-scaling rule on vectors: limit / max(amax, each column of `past`: the history's rows,
    0 where none was recorded), `current` where that max is 0 or not finite. A few kernels, and no
    tensor made from a Python number (a pageable copy to the device, which waits for the GPU).
    `out`: written in place (it may be `current` itself)."""
    a = amax if past is None else torch.maximum(amax, past.amax(0))
    keep = torch.isfinite(a) & (a > 0)
    if out is None:
        return torch.where(keep, limit / a, current)
    return torch.where(keep, limit / a, current, out=out)


def _positive(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name}= is {v!r}; a scale is a positive number")
    if not (math.isfinite(float(v)) and float(v) > 0):
        raise ValueError(f"{name}= is {v!r}; a scale is a positive finite number")


def check_grad_scales(
    state: DelayedScaling | None, options: BackwardOptions, d: Any, name: str
) -> DelayedScaling | None:
    """The delayed scales of a function with fp8 cotangents, bound to its backward's scales: a
    ValueError when there are none (the first step's scale is the user's choice) or they are not a
    DelayedScaling; None for a function without fp8 cotangents, which takes none."""
    if options.fp8_grads is None or not d.scales:
        if state is not None:
            raise ValueError(
                f"block {name}: grad_scales= given, but its backward has no fp8 cotangents "
                "(BackwardOptions(fp8_grads=...) on a block with an fp8 GEMM stage makes them)"
            )
        return None
    if state is None:
        raise ValueError(
            f"block {name}: fp8_grads={options.fp8_grads!r} quantizes the backward's cotangents with delayed "
            f"scales ({', '.join(d.scales)}), which autograd keeps in a DelayedScaling: pass "
            'grad_scales=DelayedScaling(initial=...) (a first scale, or initial="calibrate")'
        )
    if not isinstance(state, DelayedScaling):
        raise TypeError(
            f"grad_scales= is a {type(state).__name__}; it takes a coda_lang.torch.DelayedScaling"
        )
    state.bind(list(d.scales), options.fp8_grads)
    return state
