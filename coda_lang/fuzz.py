"""`coda fuzz`: differential testing of a block's kernels (or tile simulation) against the interpreter.

What it does: draws cases (sizes for the block's dims, including sizes that are not multiples of the
tile; a seed for the inputs and the cotangents; for the interpreter target a small tile) with
hypothesis, runs the block on the path under test and on the whole-matrix interpreter, forward and
backward, and compares them with the tolerance rule of `coda_lang.testing.compare` (where an element
misses its per-element part, with that element's rounding bound, `coda_lang.interp.bound`: a value that
cancelled is judged against the magnitudes that cancelled). Targets:
- `interp`: the interpreter's tile simulation (`Block.run(..., tile=...)`, `Block.vjp(..., tile=...)`);
- `cuda`: the compiled kernels (`Block.cuda()`; backward through `CudaBlock.autograd()`), on a GPU;
  the kernels' per-tile partial buffers are also compared with the tile simulation at their tiles;
- `emulate`: the CUDA runtime with each kernel launch replaced by its torch stand-in, on the CPU
  (tests the runtime's host logic without a GPU).
The backward under test is derived with a saved-tensor policy (`remat`: save, recompute or auto;
docs/design.md, "Saved and recomputed"; default DEFAULT_REMAT, the API's) and can run in row chunks
(`chunk`: a number of rows, or "auto" from a memory budget the search draws; "Chunked backward"); its
references are the whole-matrix interpreter's gradients under the same policy, unchunked, and under
a policy other than save the float64 gradients are also compared with save's (every policy computes
the same function: this catches a wrong recompute derivation, which the reference would share).
On a mismatch hypothesis shrinks the case; the report gives the smallest failing dims, the input seed
(the policy and the chunk) and a one-line command that reproduces exactly that case. `fuzz_programs`
does the same over random programs (`coda_lang.testing.random_blocks`), shrinking the program too;
each program's policy and each case's chunk are drawn by the search unless fixed.
What it does not: parse arguments (cli.py) or decide tolerances (testing/compare.py).
Invariants: no GPU library is imported unless the target needs one; a case that raises anything but a
`CodaError` on either path is a failure (a traceback is a bug); everything is seeded, so the same
command finds the same failure.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Flaky

from coda_lang.api import Block
from coda_lang.core import progress
from coda_lang.core.diagnostics import CodaError
from coda_lang.ir.nodes import DEFAULT_REMAT, REMAT
from coda_lang.testing.compare import mismatch
from coda_lang.testing.dims import dim_sizes, dim_units, tiles
from coda_lang.testing.inputs import block_inputs, cotangents, input_seeds

TARGETS = ("interp", "cuda", "emulate")
REMATS = ("save", "recompute", "auto")  # the saved-tensor policies, save first (hypothesis shrinks to it)
assert set(REMATS) == set(REMAT)
DRAW = "draw"  # chunk=DRAW: each case draws unchunked, a number of rows, or "auto" with a budget
MAX_DIM = {"interp": 48, "cuda": 520, "emulate": 64}
ALIGN = {"interp": 1, "cuda": 8, "emulate": 8}  # TMA: rows of 16 bytes (8 bf16 elements)


EMULATE_TILES = ((16, 32), (16, 64), (32, 128), (64, 128))  # --target emulate: small, so that small sizes
# have several (ragged) tiles


def _small_tiles(cb: Any) -> dict[int, tuple[int, int]]:
    """{stage: the first of EMULATE_TILES that fits it} for the GEMM stages of a CudaBlock."""
    from coda_lang.backend_cute.build.config import TileConfig, fits

    out = {}
    for k, spec in enumerate(cb.specs, 1):
        if spec is None:  # an elementwise stage: no tile
            continue
        for t in EMULATE_TILES:
            if fits(spec, TileConfig(*t)):
                out[k] = t
                break
    return out


class _Once:
    """A value computed on first use (the rounding bounds of a case: only where a comparison needs them)."""

    def __init__(self, make: Callable[[], dict[str, Any]]):
        self.make = make
        self.value: dict[str, Any] | None = None

    def __call__(self) -> dict[str, Any]:
        if self.value is None:
            self.value = self.make()
        return self.value


class Unavailable(Exception):
    """The target can't run here (no torch, no GPU): a usage error, exit 2."""


@dataclass(frozen=True)
class Case:
    dims: dict[str, int]
    seed: int
    tile: tuple[int, int] | None = None
    remat: str | None = None  # the backward's saved-tensor policy (None: the backward is not checked)
    chunk: int | str | None = None  # the backward in row chunks: rows per chunk, or "auto" from `budget`
    budget: int | None = None  # bytes, for chunk="auto"

    def describe(self) -> str:
        parts = ["dims " + ", ".join(f"{k}={v}" for k, v in self.dims.items())]
        if self.tile is not None:
            parts.append(f"tile {self.tile[0]}x{self.tile[1]}")
        parts.append(f"input seed {self.seed}")
        if self.remat is not None:
            parts.append(f"remat {self.remat}")
        if self.chunk == "auto":
            parts.append(f"chunk auto (budget {self.budget} bytes)")
        elif self.chunk is not None:
            parts.append(f"chunks of {self.chunk} rows")
        return "; ".join(parts)

    def args(self) -> list[str]:
        out = ["--dims", ",".join(f"{k}={v}" for k, v in self.dims.items())]
        if self.tile is not None:
            out += ["--tile", f"{self.tile[0]}x{self.tile[1]}"]
        out += ["--input-seed", str(self.seed)]
        if self.remat is not None:
            out += ["--remat", self.remat]
        if self.chunk is not None:
            out += ["--chunk", str(self.chunk)]
        if self.budget is not None:
            out += ["--budget", str(self.budget)]
        return out


def _first_line(e: BaseException) -> str:
    if isinstance(e, CodaError):
        d = e.diagnostics[0] if e.diagnostics else None
        return f"error[{d.code}]: {d.message}" if d else str(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _dtype_of(t: Any) -> str:
    return t.dtype if t is not None and t.dtype in ("f32", "bf16", "f16") else "f32"


class Fuzzer:
    """One block on one target: `check(case)` gives the mismatches of that case (empty: it passed).

    `remat`: the backward's saved-tensor policy (default DEFAULT_REMAT). `chunk`: None (the backward
    unchunked), a number of rows, "auto" (chunk from `budget` bytes; the search draws the budget when
    none is given) or DRAW (each case draws one of these). A backward that can't run in chunks (E0809)
    is checked unchunked, with a note (`chunk_error`).

    Raises CodaError when the block can't run on the target at all (e.g. E07 for a stage the CUDA
    backend can't compile), Unavailable when the target can't run on this machine."""

    def __init__(
        self,
        block: Block,
        target: str = "interp",
        *,
        backward: bool = True,
        special: bool | tuple[str, ...] = False,
        tile: tuple[int, int] | None = None,
        remat: str | None = None,
        chunk: int | str | None = None,
        budget: int | None = None,
    ):
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
        remat = DEFAULT_REMAT if remat is None else remat
        if remat not in REMATS:
            raise ValueError(f"remat must be one of {REMATS}, got {remat!r}")
        if chunk not in (None, "auto", DRAW) and not (
            isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 1
        ):
            raise ValueError(f'chunk must be None, a positive int, "auto" or {DRAW!r}, got {chunk!r}')
        if budget is not None and (chunk != "auto" or budget < 1):
            raise ValueError(f'budget (a positive number of bytes) goes with chunk="auto", got {budget!r}')
        self.block, self.target, self.special, self.tile = block, target, special, tile
        self.remat, self.chunk, self.budget = remat, chunk, budget
        self.notes: list[str] = []
        self.backward_error: str | None = None  # the code of the error that keeps the backward out
        self.chunk_error: str | None = None  # the code of the error that keeps the backward unchunked
        self.derivation = None
        self.chunk_plan: Any = None  # interp.chunk.ChunkPlan, when the backward runs in chunks
        self.crash: str | None = None
        if backward:
            try:
                self.derivation = block.derivation(remat=remat)
            except CodaError as e:
                self.notes.append(f"backward not checked (--remat {remat}): {_first_line(e)}")
                self.backward_error = e.diagnostics[0].code if e.diagnostics else "?"
            except Exception as e:  # a traceback is a bug: every case fails with it
                self.crash = f"autodiff (Block.derivation, remat={remat!r}) raised {_first_line(e)}"
        if self.derivation is not None and chunk is not None:
            try:
                self.chunk_plan = block.chunk_plan(remat=remat)
            except CodaError as e:
                self.no_chunks(e, "")
            except Exception as e:
                self.crash = f"Block.chunk_plan(remat={remat!r}) raised {_first_line(e)}"
        self.cb: Any = None
        self.fn: Any = None  # CudaBlock.autograd(): the backward unchunked
        self.fns: dict[tuple[Any, Any], Any] = {}  # ... and in chunks, by (chunk, budget)
        self.fn_tile: tuple[int, int] | None = tile
        if target != "interp":
            self._prepare_cuda()

    def no_chunks(self, e: CodaError, where: str) -> None:
        """The backward can't run in chunks (`where`: on this target): note it and check it unchunked."""
        self.notes.append(f"backward not chunked{where}, checked unchunked: {_first_line(e)}")
        self.chunk_error = e.diagnostics[0].code if e.diagnostics else "?"
        self.chunk_plan = None

    # ---------------------------------------------------------------- setup

    def _prepare_cuda(self) -> None:
        try:
            import torch
        except ImportError as e:
            raise Unavailable(f"--target {self.target} needs torch ({e})") from None
        if self.target == "cuda" and not torch.cuda.is_available():
            raise Unavailable(
                "--target cuda needs a CUDA GPU, and torch.cuda.is_available() is False here "
                "(use --target interp for the tile simulation, or --target emulate)"
            )
        self.device = "cuda" if self.target == "cuda" else "cpu"
        emulate = self.target == "emulate"
        from coda_lang.backend_cute.build.ptxas import BackendUnavailable

        try:
            # choose every stage's tile and compile it now: CodaError (E07) if the block can't run at all.
            # No tuning: it would compile and time every tile config at each drawn shape (minutes a case)
            self.cb = self.block.cuda(tile=self.tile, emulate=emulate, tune=False)
            if emulate and self.tile is None:  # small tiles: several (ragged) tiles at small sizes
                self.cb = self.block.cuda(tile=_small_tiles(self.cb), emulate=True)
            self.cb.prepare()
        except CodaError:
            raise
        except (BackendUnavailable, ImportError) as e:
            raise Unavailable(
                f"--target {self.target}: the CUDA backend is not usable here: {_first_line(e)}"
            ) from None
        except Exception as e:  # a traceback is a bug: every case fails with it
            self.crash = f"Block.cuda() raised {_first_line(e)}"
            return
        if self.derivation is not None:
            try:
                self.fn = self._autograd(emulate)
            except CodaError as e:
                self.notes.append(
                    f"backward not checked on {self.target} (--remat {self.remat}): {_first_line(e)}"
                )
                self.backward_error = e.diagnostics[0].code if e.diagnostics else "?"
            except Exception as e:
                self.crash = f"CudaBlock.autograd(remat={self.remat!r}) raised {_first_line(e)}"
        if self.fn is not None and self.chunk_plan is not None:
            try:  # the chunked backward's CUDA blocks (E07 if it can't compile): now, not in a case
                self._chunked_fn(1, None)
            except CodaError as e:
                self.no_chunks(e, f" on {self.target}")
            except Exception as e:
                self.crash = f"CudaBlock.autograd(remat={self.remat!r}, chunk=1) raised {_first_line(e)}"

    def _autograd(self, emulate: bool) -> Any:
        """`CudaBlock.autograd()`; emulated, at the first small tile that fits every stage."""
        if not emulate or self.tile is not None:
            return self.cb.autograd(tile=self.tile, remat=self.remat)
        for t in EMULATE_TILES:
            try:
                fn = self.cb.autograd(tile=t, remat=self.remat)
                self.fn_tile = t
                return fn
            except CodaError as e:
                if [d.code for d in e.diagnostics] != ["E0805"]:
                    raise
        self.fn_tile = None
        return self.cb.autograd(remat=self.remat)

    def _chunked_fn(self, chunk: int | str, budget: int | None) -> Any:
        """`CudaBlock.autograd(chunk=, budget=)` at the unchunked function's tile. Made once (chunk=1);
        every other chunk is a shallow copy with its own `chunk`/`budget` (what `run_backward` reads),
        sharing the CUDA blocks: a case's drawn chunk compiles nothing new on the GPU."""
        key = (chunk, budget)
        if key not in self.fns:
            if not self.fns:
                self.fns[(1, None)] = self.cb.autograd(tile=self.fn_tile, remat=self.remat, chunk=1)
            base = self.fns[(1, None)]
            if key not in self.fns:
                fn = copy.copy(base)
                fn.options = base.options.with_(chunk=chunk, budget=budget)
                self.fns[key] = fn
        return self.fns[key]

    def blocks(self) -> list[Block]:
        """The blocks that run at a case's sizes (their dims and tiles must fit)."""
        d = self.derivation
        return [self.block] + ([d.forward, d.backward] if d is not None else [])

    def cases(
        self,
        max_dim: int | None = None,
        dims: dict[str, int] | None = None,
        seed: int | None = None,
    ) -> st.SearchStrategy[Case]:
        """Cases for this block: `dims`, `seed` (and the tile, policy and chunk given to the Fuzzer) fix
        what they give."""
        blocks = self.blocks()
        top = max_dim or MAX_DIM[self.target]
        sizes = dim_sizes(blocks, top, ALIGN[self.target], given=dims)
        if self.target == "interp":
            tile_s: st.SearchStrategy[tuple[int, int] | None] = (
                st.just(self.tile) if self.tile else tiles(blocks)
            )
        else:
            tile_s = st.just(self.tile)
        seeds = st.just(seed) if seed is not None else input_seeds()
        if self.derivation is None:
            return st.builds(Case, sizes, seeds, tile_s)
        remat = self.remat

        def make(
            d: dict[str, int], seed: int, tile: tuple[int, int] | None, pick: tuple[str, int, int]
        ) -> Case:
            return Case(d, seed, tile, remat, *self._chunk_of(d, pick))

        return st.builds(make, sizes, seeds, tile_s, self._chunk_picks(top))

    def _chunk_picks(self, top: int) -> st.SearchStrategy[tuple[str, int, int]]:
        """What a case draws for its chunk, before it knows its sizes (no flatmap, so that hypothesis
        shrinks sizes and chunk apart): ("none" | "rows" | "auto", n, r), made a chunk by `_chunk_of`."""
        mode = self.chunk
        if self.chunk_plan is None or mode is None:
            return st.just(("none", 0, 0))
        if isinstance(mode, int) or (mode == "auto" and self.budget is not None):
            return st.just(("fixed", 0, 0))
        n, r = st.integers(1, max(1, top)), st.integers(0, 2**16)
        auto = st.tuples(st.just("auto"), n, r)
        if mode == "auto":
            return auto
        return st.one_of(st.just(("none", 0, 0)), st.tuples(st.just("rows"), n, st.just(0)), auto)

    def _chunk_of(
        self, dims: dict[str, int], pick: tuple[str, int, int]
    ) -> tuple[int | str | None, int | None]:
        """(chunk, budget) of a case at sizes `dims`: drawn chunks run 1 row to all rows at a time (a
        ragged last chunk included); a drawn budget gives such a chunk through chunk="auto"."""
        kind, n, r = pick
        if kind == "none":
            return None, None
        if kind == "fixed":
            return (self.chunk, self.budget) if self.chunk == "auto" else (self.chunk, None)
        plan = self.chunk_plan
        assert plan is not None
        rows = max(1, dims.get(plan.dim, 1))
        c = 1 + (n - 1) % rows  # 1 .. rows: shrinks to 1
        if kind == "rows":
            # a kernel stores rows of 16 bytes: where the dim is a stored matrix's columns (the gradient
            # of a transposed input), a GPU chunk is a multiple of the plan's alignment (as "auto" makes it)
            a = plan.align if self.target != "interp" and plan.align < rows else 1
            return min(rows, a * (1 + (n - 1) % max(1, rows // a))), None
        per_row = plan.bytes_per_row(dims)
        if per_row == 0:  # no transient: any budget gives one chunk
            return "auto", 1 + r
        return "auto", c * per_row + r % per_row

    def single_case(self, dims: dict[str, int] | None, seed: int | None) -> Case | None:
        """The one case that `dims`, `seed` and the Fuzzer's tile, policy and chunk fix, if they fix
        everything."""
        names = {d.name for b in self.blocks() for d in b.ir.dims}
        if (
            seed is None
            or not dims
            or not names <= set(dims)
            or (self.target == "interp" and self.tile is None)
        ):
            return None
        chunk: tuple[int | str | None, int | None] = (None, None)
        if self.chunk_plan is not None:
            if isinstance(self.chunk, int) or (self.chunk == "auto" and self.budget is not None):
                chunk = self._chunk_of(dims, ("fixed", 0, 0))
            else:
                return None
        remat = self.remat if self.derivation is not None else None
        return Case(dict(dims), seed, self.tile, remat, *chunk)

    def units(self) -> dict[str, int]:
        return dim_units(self.blocks(), ALIGN[self.target])

    # ---------------------------------------------------------------- one case

    def check(self, case: Case) -> list[str]:
        """Mismatches of the forward (outputs, and the kernels' partial buffers) and the backward."""
        if self.crash:
            return [self.crash]
        ins = block_inputs(self.block, case.dims, case.seed, self.special)
        try:
            ref = self.block.run(ins, dims=case.dims)
            ref64 = self.block.run(ins, dims=case.dims, precision="f64")
        except Exception as e:  # the reference path must run every drawn case
            return [f"the whole-matrix interpreter raised {_first_line(e)}"]
        from coda_lang.interp import bound

        bounds = _Once(lambda: bound.run(self.block, ins, case.dims)[1])
        try:
            msgs = self._forward(case, ins, ref, ref64, bounds)
        except Exception as e:
            return [f"forward on {self.target} raised {_first_line(e)}"]
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
            gref = self.block.vjp(ins, cots, dims=case.dims, remat=remat)
            g64 = self.block.vjp(ins, cots, dims=case.dims, precision="f64", remat=remat)
        except Exception as e:
            return msgs + [f"the whole-matrix interpreter's backward (Block.vjp) raised {_first_line(e)}"]
        try:
            msgs += self._policies_agree(case, ins, cots, g64)
        except Exception as e:
            msgs.append(
                f"the whole-matrix interpreter's float64 backward under --remat save raised {_first_line(e)}"
            )
        gbounds = _Once(lambda: bound.vjp(self.block, ins, cots, case.dims, remat)[1])
        try:
            msgs += self._backward(case, ins, cots, gref, g64, gbounds)
        except Exception as e:
            msgs.append(f"backward on {self.target} raised {_first_line(e)}")
        return msgs

    def _policies_agree(
        self, case: Case, ins: dict[str, Any], cots: dict[str, Any], g64: dict[str, Any]
    ) -> list[str]:
        """Under a policy other than save: its float64 gradients against save's (in float64 every policy
        computes the same function, up to the order of operations). Both references of a case come from
        the same derivation, so a wrong recompute derivation would pass them: this finds it. Not with
        special values (where NaN and inf may come out of different, equally valid, orders)."""
        if self.remat == "save" or self.special:
            return []
        try:
            save = self.block.derivation(remat="save")
        except CodaError:  # save can't derive this block: nothing to compare with
            return []
        s64 = self.block.vjp(ins, cots, dims=case.dims, precision="f64", remat="save")
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
        bounds: _Once | None = None,
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
        bounds: _Once | None = None,
    ) -> list[str]:
        dtypes = {o.name: _dtype_of(o.type) for o in self.block.ir.outputs}
        if self.target == "interp":
            got = self.block.run(ins, dims=case.dims, tile=case.tile)
            return self._outputs("output", got, ref, ref64, dtypes, bounds)
        outs, parts = self.cb.run_with_partials(
            {k: self._tensor(v) for k, v in ins.items()}, dims=self._dims(self.block, case)
        )
        msgs = self._outputs("output", outs, ref, ref64, dtypes, bounds)
        # the tile simulation at the kernels' tiles, rounded as they round; where a partial misses the
        # per-element rule (one that cancels: a sum of products of bf16-rounded values), the same
        # simulation in float64 gives the tolerance rule's f64 part (run only then)
        _, sim = self.block.run_with_partials(ins, dims=case.dims, tile=self.cb.tiles)
        sim64: dict[str, Any] | None = None
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
                    ins, dims=case.dims, tile=self.cb.tiles, precision="f64"
                )
            want64 = sim64.get(name)
            if pick and want64 is not None:
                want64 = want64.sum(axis=1)
            m = mismatch(what, buf, want, want64, "f32")
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
        bounds: _Once | None = None,
    ) -> list[str]:
        d = self.derivation
        assert d is not None
        out_t = {o.name: o.type for o in d.backward.ir.outputs}
        dtypes = {p: _dtype_of(out_t.get(g)) for p, g in d.grads.items()}
        if self.target == "interp":
            got = self.block.vjp(
                ins,
                cots,
                dims=case.dims,
                tile=case.tile,
                remat=self.remat,
                chunk=case.chunk,
                budget=case.budget,
            )
            return self._outputs("gradient of", got, gref, g64, dtypes, bounds)
        import torch

        tensors = {k: self._tensor(v) for k, v in ins.items()}
        wrt = [p for p in d.grads if p in tensors and tensors[p].is_floating_point()]
        for p in wrt:
            tensors[p] = tensors[p].detach().requires_grad_(True)
        fn = self.fn if case.chunk is None else self._chunked_fn(case.chunk, case.budget)
        outs = fn(tensors, dims=self._dims(self.block, case))
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
            {p: _dtype_of(next(x.var.type for x in self.block.ir.params if x.var.name == p)) for p in wrt}
        )
        return self._outputs("gradient of", got, {p: gref[p] for p in wrt}, g64, dtypes, bounds)

    @staticmethod
    def _dims(block: Block, case: Case) -> dict[str, int]:
        """The case's sizes of `block`'s dims (a dim used only as a value: no input's shape gives it)."""
        return {d.name: case.dims[d.name] for d in block.ir.dims if d.name in case.dims}

    def _tensor(self, a: Any) -> Any:
        import numpy as np
        import torch

        a = np.asarray(a)
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).to(self.device)
        return torch.from_numpy(a.copy()).to(self.device)  # (np.ascontiguousarray makes 0-d arrays 1-d)


# ------------------------------------------------------------------------------------------------
# The search


class Progress(progress.Progress):
    """`coda fuzz`'s progress (coda_lang.core.progress): cases done of the total and the time left, the case
    running on a terminal; once a case fails, the shrinking tries instead."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, quiet: bool = False):
        self.failed = 0
        self.shrinks = 0
        self.case: Case | None = None
        super().__init__(f"coda fuzz: {label}", total, unit="cases", stream=stream, quiet=quiet, interval=1.0)

    def step(self, failing: bool, case: Case | None = None) -> None:
        self.case = case
        if self.failed:
            self.shrinks += 1
            self.failed += failing
            self.show()
        else:
            self.failed += failing
            self.advance()

    def text(self) -> str:
        if self.failed:
            return f"{self.label}: failure found after {self.count} cases; shrinking ({self.shrinks} tries)"
        self.what = self.case.describe() if self.case is not None and self.tty else ""
        return super().text()

    def done(self) -> None:
        self.close()


@dataclass
class Failure:
    case: Case
    messages: list[str]
    program: str | None = None  # fuzz_programs: the failing program's source
    flaky: bool = False


@dataclass
class Result:
    cases: int
    failure: Failure | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # fuzz_programs: programs the target can't run
    chunked: int = 0  # cases whose backward ran in row chunks


class _Mismatch(Exception):
    pass


def _settings(examples: int, shrink: bool) -> settings:
    phases = [Phase.explicit, Phase.generate] + ([Phase.shrink] if shrink else [])
    return settings(
        max_examples=examples,
        database=None,
        deadline=None,
        derandomize=False,
        phases=phases,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        report_multiple_bugs=False,
        print_blob=False,
    )


def _run(
    test: Callable[..., None],
    strategy: st.SearchStrategy[Any],
    examples: int,
    seed: int,
    shrink: bool,
    failures: list[Failure],
) -> Failure | None:
    wrapped = hypothesis_seed(seed)(_settings(examples, shrink)(given(strategy)(test)))
    try:
        wrapped()
    except _Mismatch:
        return failures[-1]
    except Flaky:
        if failures:
            failures[-1].flaky = True
            return failures[-1]
        raise
    return None


def _check(
    fz: Fuzzer,
    case: Case,
    failures: list[Failure],
    count: list[int],
    progress: Progress | None,
    program: str | None = None,
) -> None:
    """Run one case: count it (until the first failure), report progress, and on a mismatch record
    the failure and stop hypothesis's test (`_Mismatch`)."""
    msgs = fz.check(case)
    if not failures:
        count[0] += 1
        count[1] += case.chunk is not None
    if progress:
        progress.step(bool(msgs), case)
    if msgs:
        failures.append(Failure(case, msgs, program=program))
        raise _Mismatch()


def fuzz_block(
    block: Block,
    target: str = "interp",
    *,
    examples: int = 100,
    seed: int = 0,
    max_dim: int | None = None,
    dims: dict[str, int] | None = None,
    input_seed: int | None = None,
    tile: tuple[int, int] | None = None,
    special: bool = False,
    backward: bool = True,
    shrink: bool = True,
    progress: Progress | None = None,
    fuzzer: Fuzzer | None = None,
    remat: str | None = None,
    chunk: int | str | None = None,
    budget: int | None = None,
) -> Result:
    """Fuzz one block (see the module docstring). CodaError if it can't run on the target at all.
    `fuzzer`: a Fuzzer made already (then target, tile, special, backward, remat, chunk and budget are
    its own)."""
    t0 = time.monotonic()
    fz = fuzzer or Fuzzer(
        block, target, backward=backward, special=special, tile=tile, remat=remat, chunk=chunk, budget=budget
    )
    failures: list[Failure] = []
    count = [0, 0]

    def test(case: Case) -> None:
        _check(fz, case, failures, count, progress)

    single = fz.single_case(dims, input_seed)
    if single is not None:  # everything fixed (reproducing a case): run it once
        with contextlib.suppress(_Mismatch):
            test(single)
        failure = failures[-1] if failures else None
    else:
        failure = _run(test, fz.cases(max_dim, dims, input_seed), examples, seed, shrink, failures)
    if progress:
        progress.done()
    return Result(count[0], failure, fz.notes, time.monotonic() - t0, chunked=count[1])


def fuzz_programs(
    programs: int,
    target: str = "interp",
    *,
    examples: int = 5,
    seed: int = 0,
    max_dim: int | None = None,
    special: bool = False,
    backward: bool = True,
    shrink: bool = True,
    tile: tuple[int, int] | None = None,
    progress: Progress | None = None,
    remat: str | None = None,
    chunk: int | str | None = DRAW,
    budget: int | None = None,
) -> Result:
    """Fuzz `programs` random blocks (`coda_lang.testing.random_blocks`), `examples` cases each; on a
    failure hypothesis shrinks the program and the case together. `remat`: every program's policy
    (None: each program draws one); `chunk`, `budget`: as Fuzzer's (DRAW: each case of a program whose
    backward can run in chunks draws unchunked, a number of rows or a budget)."""
    import coda_lang
    from coda_lang.testing import random_blocks

    t0 = time.monotonic()
    failures: list[Failure] = []
    skipped: list[str] = []
    no_backward: list[str] = []
    no_chunks: list[str] = []
    policies: list[str] = []
    count = [0, 0]

    def test(data: st.DataObject) -> None:
        fw = data.draw(
            random_blocks(("f32", "bf16", "f16") if target == "interp" else ("bf16", "f16")), label="program"
        )
        policy = remat
        if policy is None and backward:
            policy = data.draw(st.sampled_from(REMATS), label="remat")
        block = coda_lang.load(fw.text)["fwd"]
        try:
            fz = Fuzzer(
                block,
                target,
                backward=backward,
                special=special,
                tile=tile,
                remat=policy,
                chunk=chunk,
                budget=budget,
            )
        except CodaError as e:  # the target can't run it (E07): not a failure
            if not failures:
                skipped.append(_first_line(e))
            return
        if not failures:
            if fz.backward_error:
                no_backward.append(fz.backward_error)
            elif policy is not None:
                policies.append(policy)
            if fz.chunk_error:
                no_chunks.append(fz.chunk_error)
        strategy = fz.cases(max_dim)
        for _ in range(examples):
            _check(fz, data.draw(strategy, label="case"), failures, count, progress, program=fw.text)

    failure = _run(test, st.data(), programs, seed, shrink, failures)
    if progress:
        progress.done()
    notes = []
    if policies:
        notes.append(
            "backward checked under "
            + ", ".join(f"--remat {p} x{policies.count(p)}" for p in REMATS if p in policies)
        )
    if no_backward:
        codes = ", ".join(f"{c} x{no_backward.count(c)}" for c in sorted(set(no_backward)))
        notes.append(f"backward not checked for {len(no_backward)} programs ({codes})")
    if count[1]:
        notes.append(f"{count[1]} cases ran the backward in row chunks")
    if no_chunks:
        codes = ", ".join(f"{c} x{no_chunks.count(c)}" for c in sorted(set(no_chunks)))
        notes.append(f"backward not chunked for {len(no_chunks)} programs ({codes}), checked unchunked")
    return Result(count[0], failure, notes, time.monotonic() - t0, skipped, count[1])


def save_program(text: str, folder: str = ".") -> str:
    """Write a failing random program to `folder`/coda-fuzz-<hash>.coda; its path."""
    path = os.path.join(folder, f"coda-fuzz-{hashlib.sha256(text.encode()).hexdigest()[:10]}.coda")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
