"""One fuzz case, run on the path under test and on the whole-matrix interpreter, and compared.

What it does: `Comparisons.check(case)` (a mixin of `Fuzzer`): the inputs of the case, the
interpreter's references (exact and float64), the forward on the target (outputs, and the kernels'
partial buffers against the tile simulation at their tiles), the backward under the case's policy
and chunk against the whole-matrix interpreter's gradients under the same policy, unchunked, and
under a policy other than save the float64 gradients against save's; every mismatch as a line.
What it does not: decide tolerances (testing/compare.py: `mismatch`, with the rounding bounds of
interp/bound.py), draw cases (case.py) or search (search.py).
Invariants: an exception on either path is a mismatch line naming the path, never raised (a
traceback is a bug); rounding bounds are computed only where an element misses the per-element rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np

from coda_lang.api import Block
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.core.diagnostics import CodaError
from coda_lang.core.numerics import round_fp8
from coda_lang.fuzz.case import Case, dtype_of, first_line
from coda_lang.interp import bound
from coda_lang.interp.bound import rounded
from coda_lang.ir.types import is_fp8
from coda_lang.testing.compare import mismatch
from coda_lang.testing.inputs import block_inputs, cotangents

T = TypeVar("T")


class _Once(Generic[T]):
    """A value computed on first use (the rounding bounds of a case: only where a comparison needs them)."""

    def __init__(self, make: Callable[[], T]):
        self.make = make
        self.value: T | None = None

    def __call__(self) -> T:
        if self.value is None:
            self.value = self.make()
        return self.value


class Comparisons:
    """`Fuzzer.check` and its parts (a mixin: the attributes below are the Fuzzer's)."""

    block: Block
    target: str
    special: bool | tuple[str, ...]
    remat: str
    fp8_grads: str | None
    fp8_acc: bool
    options: BackwardOptions | None  # the backward under test's (None: backward=False)
    wrt: list[str] | None  # the parameters differentiated (None: every float parameter without a default)
    crash: str | None
    derivation: Any
    cb: Any
    fn: Any
    device: str

    def _chunked_fn(self, options: BackwardOptions) -> Any:
        raise NotImplementedError  # (Fuzzer's)

    def grad_scales(self) -> Any:
        raise NotImplementedError  # (Fuzzer's)

    def _ref_options(self, remat: str) -> BackwardOptions:
        """The backward's options under `remat`, unchunked, with the Fuzzer's fp8 cotangents (each
        scale 1: `Block.vjp`'s default, and the first step of the backward under test's): the
        references', the derivation's and the unchunked function's: the Fuzzer's options (its fp8
        cotangents, its fp8 acc) run whole."""
        return (self.options or BackwardOptions()).unchunked().with_(remat=remat)

    def check(self, case: Case) -> list[str]:
        """Mismatches of the forward (outputs, and the kernels' partial buffers) and the backward."""
        if self.crash:
            return [self.crash]
        ins = block_inputs(self.block, case.dims, case.seed, self.special)
        try:
            ref = self.block.run(ins, dims=case.dims)
            ref64 = self.block.run(ins, dims=case.dims, precision="f64")
        except Exception as e:  # the reference path must run every drawn case
            return [f"the whole-matrix interpreter raised {first_line(e)}"]
        # (one run of the bounds interpreter, for the outputs and the kernels' partial buffers alike)
        evaluated = _Once(lambda: bound.evaluate(self.block, ins, case.dims))
        bounds = _Once(lambda: evaluated().output_bounds)
        try:
            msgs = self._forward(case, ins, ref, ref64, bounds, evaluated)
        except Exception as e:
            return [f"forward on {self.target} raised {first_line(e)}"]
        if self.derivation is None or (self.target != "interp" and self.fn is None):
            return msgs
        cots = cotangents(self.block, case.dims, case.seed)
        remat = self.remat
        try:
            # the references: the whole-matrix interpreter's backward under the case's policy, unchunked
            # (a chunked run equals it up to the order of f32 sums). Its float64 twin is that same
            # derivation too: every policy computes the same function, so save's would do as well, but
            # the same derivation makes rule 3 of the accuracy rule weigh the path under test against
            # the rounding error of the very computation the exact-mode reference rounds. (A policy's
            # own mistakes, which both references would share, are `_policies_agree`'s to find.)
            gref = self.block.vjp(ins, cots, dims=case.dims, wrt=self.wrt, backward=self._ref_options(remat))
            g64 = self.block.vjp(
                ins, cots, dims=case.dims, precision="f64", wrt=self.wrt, backward=self._ref_options(remat)
            )
        except Exception as e:
            return msgs + [f"the whole-matrix interpreter's backward (Block.vjp) raised {first_line(e)}"]
        try:
            msgs += self._policies_agree(case, ins, cots, g64)
        except Exception as e:
            msgs.append(
                f"the whole-matrix interpreter's float64 backward under --remat save raised {first_line(e)}"
            )
        gbounds = _Once(
            lambda: bound.vjp(
                self.block, ins, cots, case.dims, wrt=self.wrt, backward=self._ref_options(remat)
            )[1]
        )
        try:
            msgs += self._backward(case, ins, cots, gref, g64, gbounds)
        except Exception as e:
            msgs.append(f"backward on {self.target} raised {first_line(e)}")
        return msgs

    def _policies_agree(
        self, case: Case, ins: dict[str, Any], cots: dict[str, Any], g64: dict[str, Any]
    ) -> list[str]:
        """Under a policy other than save: its float64 gradients against save's (in float64 every policy
        computes the same function, up to the order of operations). Both references of a case come from
        the same derivation, so a wrong recompute derivation would pass them: this finds it. Not with
        special values (where NaN and inf may come out of different, equally valid, orders), nor with
        fp8_acc: a tile the backward makes again from an acc read from its fp8 copy is made from the
        rounded acc, where save reads the forward's (docs/design.md, "Saving activations in fp8")."""
        if self.remat == "save" or self.special or self.fp8_acc:
            return []
        try:
            save = self.block.derivation(self.wrt, backward=self._ref_options("save"))
        except CodaError:  # save can't derive this block: nothing to compare with
            return []
        s64 = self.block.vjp(
            ins, cots, dims=case.dims, precision="f64", wrt=self.wrt, backward=self._ref_options("save")
        )
        out = []
        for p in save.grads:
            if p in g64 and p in s64:
                what = f"float64 gradient of `{p}` under --remat {self.remat}, against --remat save's"
                m = mismatch(what, g64[p], s64[p], None, "f32")
                if m:
                    out.append(m)
        return out

    def _outputs(
        self,
        what: str,
        got: dict[str, Any],
        ref: dict[str, Any],
        ref64: dict[str, Any],
        dtypes: dict[str, str],
        bounds: _Once[dict[str, Any]] | None = None,
    ) -> list[str]:
        """Each of `ref` against `got` by the accuracy rule; where an element misses its first part,
        with the rounding bound of each element (`bounds`, computed only then: interp.bound)."""
        out = []
        for name, r in ref.items():
            if name not in got:
                out.append(f"{what} `{name}`: missing")
                continue
            args = (f"{what} `{name}`", got[name], r, ref64.get(name), dtypes.get(name, "f32"))
            m = mismatch(*args)
            if m and bounds is not None:
                m = mismatch(*args, bound=bounds().get(name))
            if m:
                out.append(m)
        return out

    def _forward(
        self,
        case: Case,
        ins: dict[str, Any],
        ref: dict[str, Any],
        ref64: dict[str, Any],
        bounds: _Once[dict[str, Any]] | None = None,
        evaluated: _Once[bound.Bounds] | None = None,
    ) -> list[str]:
        dtypes = {o.name: dtype_of(o.type) for o in self.block.ir.outputs}
        if self.target == "interp":
            got = self.block.run(ins, dims=case.dims, sim_tile=case.sim_tile)
            return self._outputs("output", got, ref, ref64, dtypes, bounds)
        outs, parts = self.cb.run_with_partials(
            {k: self._tensor(v) for k, v in ins.items()}, dims=self._dims(self.block, case)
        )
        msgs = self._outputs("output", outs, ref, ref64, dtypes, bounds)
        # the tile simulation at the kernels' tiles, rounded as they round; where a partial misses the
        # per-element rule (one that cancels: a sum of products of bf16-rounded values), the same
        # simulation in float64 gives the tolerance rule's f64 part, and each partial gets its rounding
        # bound (bound.partials: a sum's or max's the whole reduction's, a log-sum-exp's its tile's own;
        # both run only then). Twice the bound: the kernel and the simulation are each within it of the
        # exact interpreter. It is what passes a partial downstream of an fp8 store whose rounding an
        # f32 difference flipped (one e4m3 ulp is 1/8).
        _, sim = self.block.run_with_partials(ins, dims=case.dims, sim_tile=self.cb.tiles)
        sim64: dict[str, Any] | None = None
        pbounds: dict[str, Any] | None = None
        for name, buf in parts.items():
            if name not in sim:
                continue
            what = f"partial buffer `{name}` (tile {self.cb.tiles})"
            pick = (
                getattr(buf, "ndim", 0) == 1 and sim[name].ndim == 2
            )  # the kernel writes the finished vector
            want = sim[name].sum(axis=1) if pick else sim[name]
            if mismatch(what, buf, want, None, "f32") is None:
                continue
            if sim64 is None:
                _, sim64 = self.block.run_with_partials(
                    ins, dims=case.dims, sim_tile=self.cb.tiles, precision="f64"
                )
            want64 = sim64.get(name)
            if pick and want64 is not None:
                want64 = want64.sum(axis=1)
            m = mismatch(what, buf, want, want64, "f32")
            if m and evaluated is not None:
                if pbounds is None:
                    shapes = {k: tuple(np.shape(v)) for k, v in parts.items()}
                    pbounds = bound.partials(evaluated(), shapes, self.cb.tiles)
                if name in pbounds:
                    m = mismatch(what, buf, want, want64, "f32", bound=2.0 * pbounds[name])
            if m:
                msgs.append(m)
        return msgs

    def _backward(
        self,
        case: Case,
        ins: dict[str, Any],
        cots: dict[str, Any],
        gref: dict[str, Any],
        g64: dict[str, Any],
        bounds: _Once[dict[str, Any]] | None = None,
    ) -> list[str]:
        d = self.derivation
        assert d is not None
        # the case's options (a case made by hand may give none: the Fuzzer's policy, unchunked)
        options = case.backward if case.backward is not None else self._ref_options(self.remat)
        out_t = {o.name: o.type for o in d.backward.ir.outputs}
        dtypes = {p: dtype_of(out_t.get(g)) for p, g in d.grads.items()}
        if self.target == "interp":
            got = self.block.vjp(
                ins, cots, dims=case.dims, sim_tile=case.sim_tile, wrt=self.wrt, backward=options
            )
            return self._outputs("gradient of", got, gref, g64, dtypes, bounds)
        import torch

        tensors = {k: self._tensor(v) for k, v in ins.items()}
        wrt = [p for p in d.grads if p in tensors and tensors[p].is_floating_point()]
        for p in wrt:
            tensors[p] = tensors[p].detach().requires_grad_(True)
        fn = self._chunked_fn(options) if options.chunked else self.fn
        scales = self.grad_scales()  # (fp8 cotangents: this case's backward at scales 1)
        outs = fn(tensors, dims=self._dims(self.block, case), **({"grad_scales": scales} if scales else {}))
        pairs = [(outs[o], self._tensor(c)) for o, c in cots.items() if o in outs and outs[o].requires_grad]
        if not pairs or not wrt:
            return []
        grads = torch.autograd.grad(
            [p[0] for p in pairs],
            [tensors[p] for p in wrt],
            grad_outputs=[p[1].to(p[0].dtype) for p in pairs],
            allow_unused=True,
        )
        got = {
            p: (g if g is not None else torch.zeros_like(tensors[p])) for p, g in zip(wrt, grads, strict=True)
        }
        dtypes.update(
            {p: dtype_of(next(x.var.type for x in self.block.ir.params if x.var.name == p)) for p in wrt}
        )
        # autograd gives a leaf its gradient in the leaf's dtype: an fp8 input's is fp8 (saturated), so
        # the interpreter's is rounded so too, and each bound (propagated to the bf16 gradient) rounded
        fp8 = {p for p in wrt if is_fp8(dtypes[p])}
        want = {p: round_fp8(gref[p], dtypes[p]) if p in fp8 else gref[p] for p in wrt}
        if fp8 and bounds is not None:
            raw = bounds
            bounds = _Once(lambda: {**raw(), **{p: rounded(gref[p], raw()[p], dtypes[p]) for p in fp8}})
        return self._outputs("gradient of", got, want, g64, dtypes, bounds)

    @staticmethod
    def _dims(block: Block, case: Case) -> dict[str, int]:
        """The case's sizes of `block`'s dims (a dim used only as a value: no input's shape gives it)."""
        return {d.name: case.dims[d.name] for d in block.ir.dims if d.name in case.dims}

    def _tensor(self, a: Any) -> Any:
        import torch

        a = np.asarray(a)
        narrow = {"bfloat16": "bfloat16", "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}
        if a.dtype.name in narrow:  # (NumPy has no such dtype: through f32, exact)
            dtype = getattr(torch, narrow[a.dtype.name])
            return torch.from_numpy(a.astype(np.float32)).to(dtype).to(self.device)
        return torch.from_numpy(a.copy()).to(self.device)  # (np.ascontiguousarray makes 0-d arrays 1-d)
