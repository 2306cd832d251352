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
and refuses another's (ValueError).
"""

from __future__ import annotations

import math
import numbers
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
        self.scales: dict[str, torch.Tensor] = {}
        self.amaxes: dict[str, torch.Tensor] = {}  # the last backward's
        self.last_scales: dict[str, torch.Tensor] = {}  # the scales the last backward ran at
        # the past amaxes, one row per step and a column per name: a ring of history - 1 rows (the
        # current amax is the history's last), 0 where no step wrote yet (an amax is >= 0, so a 0 row
        # changes no max; a NaN one stays in the max, as the rule says); the next row to write is
        # steps % (history - 1). One tensor, so that the rule is a few kernels per step, not a few per
        # name and past step, and nothing in it waits for the GPU
        self._past: torch.Tensor | None = None
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
            row = torch.tensor(values, dtype=torch.float32).to(device)  # (one copy, made once)
            self.scales = {n: row[i] for i, n in enumerate(self.names)}
        return {n: s if s.device == device else s.to(device) for n, s in self.scales.items()}

    def _row(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """`values` by name as one f32 vector in the order of `names`."""
        return f32_row([values[n] for n in self.names])

    def next_scales(
        self, amaxes: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The rule: fp8_max / amax / 2**margin in f32, where amax is the max of `amaxes` with the
        history before it; the scale in `scales` where that amax is 0 or not finite."""
        return self._rule(self._reduced(self._row(amaxes)), scales)

    def _reduced(self, a: torch.Tensor) -> torch.Tensor:
        return a if self.reduce is None else self.reduce(a)

    def _rule(self, a: torch.Tensor, scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        assert self.dtype is not None
        past = self._past.to(a.device) if self._past is not None and self.steps > 0 else None
        limit = FP8_MAX[self.dtype] / 2.0**self.margin
        out = delayed_scales(a, past, self._row(scales).to(a.device), limit)
        return {n: out[i] for i, n in enumerate(self.names)}

    def record(self, amaxes: dict[str, torch.Tensor]) -> None:
        """A backward's amaxes (by scale name): into the history, and the next step's scales set by
        the rule."""
        a = self._reduced(self._row(amaxes))
        nxt = self._rule(a, self.scales)
        if self.history > 1:
            if self._past is None or self._past.device != a.device:
                self._past = a.new_zeros((self.history - 1, len(self.names)))
            self._past[self.steps % (self.history - 1)] = a
        self.amaxes = {n: a[i] for i, n in enumerate(self.names)}
        self.last_scales, self.scales = self.scales, nxt
        self.steps += 1

    def _past_rows(self) -> list[torch.Tensor]:
        """The recorded past amax rows, oldest first."""
        if self._past is None:
            return []
        ring = self.history - 1
        n = min(self.steps, ring)
        return [self._past[(self.steps - n + j) % ring] for j in range(n)]

    def state_dict(self) -> dict[str, Any]:
        """The scales and amax history (for a checkpoint): `load_state_dict` restores them."""
        rows = self._past_rows()
        return {
            "dtype": self.dtype,
            "names": list(self.names),
            "scales": {k: v.clone() for k, v in self.scales.items()},
            "history": {n: [r[i].clone() for r in rows] for i, n in enumerate(self.names)},
            "steps": self.steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dtype = state["dtype"]
        self.names = tuple(state["names"])
        self.scales = {k: v.clone() for k, v in state["scales"].items()}
        self.steps = state["steps"]
        self._past = None
        hist = state["history"]
        n = len(hist[self.names[0]]) if self.names and hist else 0
        if self.history > 1 and n:
            ring = self.history - 1
            first = hist[self.names[0]][0]
            self._past = torch.zeros((ring, len(self.names)), dtype=torch.float32, device=first.device)
            for j in range(min(n, ring)):
                k = n - min(n, ring) + j
                self._past[(self.steps - min(n, ring) + j) % ring] = torch.stack(
                    [hist[name][k].reshape(()).to(torch.float32) for name in self.names]
                )


def delayed_scales(
    amax: torch.Tensor, past: torch.Tensor | None, current: torch.Tensor, limit: float
) -> torch.Tensor:
    """The delayed-scaling rule on vectors: limit / max(amax, each column of `past`: the history's rows,
    0 where none was recorded), `current` where that max is 0 or not finite. A few kernels, and no
    tensor made from a Python number (a pageable copy to the device, which waits for the GPU)."""
    a = amax if past is None else torch.maximum(amax, past.amax(0))
    return torch.where(torch.isfinite(a) & (a > 0), limit / a, current)


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
