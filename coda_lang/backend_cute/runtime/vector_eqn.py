"""A vector equation between stages as a prepared step: what the CUDA runtime runs for each one.

What it does: `VectorStep(eqn, dimrefs, sizes)` reads once what a block's equation between stages
(`r1 = rsqrt(t)`, `am = detach(max(amp))`, `i = 1.0 / (s_a * s_w)`) needs at each call: where each
operand comes from (a value of the run's environment, widened to f32 where it is a 16-bit or fp8
tensor and the result is no matrix alias; a literal; a dim's size), the op's torch stand-in and
parameters, and each result's compute dtype and storage rounding. A call `step(env, dims, device)`
then only fetches, calls the stand-in and binds. An fp8 decoder layer runs about two dozen such
equations in its forward (its scales' products, the amaxes' folds, the norms' rsqrt), each a
microsecond-scale tensor op whose cost is the host's: looking these up at every call took about
10 us of Python per equation on top of the op (cProfile, the emulated runtime; 2026-11-28).
What it does not: decide which equations run fused (vector_run.py), or run stages.
Invariants: the results are what `CudaBlock` computed equation by equation before (the same stand-in
on the same operands, then `launch.compute_value` and `launch.round_value`): a block-level float is f32,
a scalar result a 0-d tensor on the block's device, a matrix alias the same tensor.
"""

from __future__ import annotations

from typing import Any

import torch

from coda_lang.backend_cute.runtime.launch import NARROW_DTYPES, compute_value, round_value, value_dtype
from coda_lang.ir.nodes import Eqn, Lit, Var
from coda_lang.ir.types import MATRIX, Dim
from coda_lang.ops import REGISTRY
from coda_lang.ops.registry import Locality

_VAR, _LIT, _DIM = 0, 1, 2


class VectorStep:
    """Equation `eqn` as a call on (env, dims, device); `dimrefs`: (first output, operand position)
    -> (dim name, numerator, denominator) of each dim used as a value; `sizes`: (first output) ->
    G as such a triple for `fold(x, into=G)` (both as CudaBlock keeps them)."""

    __slots__ = ("eqn", "args", "widen", "stand_in", "params", "into", "outs")  # (bind: a method)

    def __init__(
        self,
        eqn: Eqn,
        dimrefs: dict[tuple[str, int], tuple[str | None, int, int]],
        sizes: dict[str, tuple[str | None, int, int]],
    ):
        self.eqn = eqn
        first = eqn.outs[0]
        # a matrix alias (`y = x`) stays the same tensor; every other result is computed in f32
        self.widen = first.type is None or first.type.kind != MATRIX
        args: list[tuple[int, Any]] = []
        for i, a in enumerate(eqn.ins):
            if isinstance(a, Var):
                args.append((_VAR, a.name))
            elif isinstance(a, Lit):
                args.append((_LIT, a.value))
            else:  # a dim as a value: integer arithmetic on plain ints (torch.compile traces this)
                args.append((_DIM, dimrefs[(first.name, i)]))
        self.args = tuple(args)
        od = REGISTRY[eqn.op]
        assert od.lower.torch is not None  # checked when the CudaBlock was made (E0708)
        self.stand_in = od.lower.torch
        self.params = {k: v for k, v in eqn.params if not isinstance(v, Dim)}
        # fold(x, into=G): its stand-in takes G's size
        self.into = sizes[first.name] if od.locality is Locality.VECTOR else None
        self.outs = tuple((v.name, value_dtype(v.type), v.annot) for v in eqn.outs)

    def __call__(self, env: dict[str, Any], dims: dict[str, int], device: torch.device) -> None:
        vals: list[Any] = []
        for kind, what in self.args:
            if kind == _VAR:
                x = env[
                    what
                ]  # a 16-bit parameter is bound in its dtype: computed in f32, as the interpreter does
                if self.widen and isinstance(x, torch.Tensor) and x.dtype in NARROW_DTYPES:
                    x = x.float()
                vals.append(x)
            elif kind == _LIT:
                vals.append(what)
            else:
                name, num, den = what
                vals.append((dims[name] if name is not None else 1) * num // den)
        if self.into is not None:
            name, num, den = self.into
            res = self.stand_in(*vals, (dims[name] if name is not None else 1) * num // den)
        else:
            res = self.stand_in(*vals, **self.params)
        self.bind(env, res, device)

    def bind(self, env: dict[str, Any], res: Any, device: torch.device) -> None:
        """The equation's result(s) `res`, computed by its stand-in or elsewhere (CudaBlock's batched
        folds), bound by name in its dtypes, rounded where an output is annotated."""
        res_t = res if isinstance(res, tuple) else (res,)
        for (name, dtype, annot), x in zip(self.outs, res_t, strict=True):
            x = compute_value(x, dtype, device)
            env[name] = round_value(x, annot) if annot else x
