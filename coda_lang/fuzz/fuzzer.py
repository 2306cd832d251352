"""`Fuzzer`: one block made ready to fuzz on one target.

What it does: checks the target and the backward's options, derives the backward under test (and
its chunk plan), and for `cuda`/`emulate` makes the CUDA block and its autograd functions now (at
small tiles when emulated, so that small sizes have several ragged tiles), so that a case compiles
nothing; what keeps the backward out (or unchunked) becomes a note, a traceback a crash that every
case reports. Its strategies of cases are case.py's (`CaseDraws`), its check of one case
compare.py's (`Comparisons`).
What it does not: draw or compare cases itself, or search (search.py).
Invariants: no GPU library is imported unless the target needs one; a block that can't run on the
target at all raises CodaError, a target this machine can't run `Unavailable`, both when made.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any

from coda_lang.api import Block
from coda_lang.autodiff.chunk import candidate_plans
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.backend_cute.build.config import TileConfig, fits
from coda_lang.backend_cute.build.ptxas import BackendUnavailable
from coda_lang.core.diagnostics import CodaError
from coda_lang.fuzz.case import TARGETS, CaseDraws, Unavailable, backward_options, first_line
from coda_lang.fuzz.compare import Comparisons
from coda_lang.ir.nodes import DEFAULT_REMAT

EMULATE_TILES = ((16, 32), (16, 64), (32, 128), (64, 128))  # --target emulate: small, so that small sizes
# have several (ragged) tiles


def _small_tiles(cb: Any) -> dict[int, tuple[int, int]]:
    """{stage: the first of EMULATE_TILES that fits it} for the GEMM stages of a CudaBlock."""
    out = {}
    for k, spec in enumerate(cb.specs, 1):
        if spec is None:  # an elementwise stage: no tile
            continue
        for t in EMULATE_TILES:
            if fits(spec, TileConfig(*t)):
                out[k] = t
                break
    return out


class Fuzzer(CaseDraws, Comparisons):
    """One block on one target: `check(case)` gives the mismatches of that case (empty: it passed).

    `backward`: True (the backward is checked too, default), False (the forward only), or the
    backward's options, a `BackwardOptions`; or their fields as keywords (`remat=`, `chunk=`, `budget=`,
    `chunk_dim=`, as `Block.vjp` takes them; not both). `chunk`: None (the backward unchunked), a
    number of rows, "auto" (chunk from `budget` bytes; the search draws the budget when none is
    given), or DRAW (each case draws one of these). A backward that can't run in chunks (E0809) is
    checked unchunked, with a note (`chunk_error`). `sim_tile` (interp): the simulated tile (default:
    each case draws a small one); `tile` (cuda, emulate): the kernels' tile (default: the backend's
    choice; small tiles when emulated).

    Raises TypeError or ValueError for a bad argument, CodaError when the block can't run on the
    target at all (e.g. E07 for a stage the CUDA backend can't compile), Unavailable when the target
    can't run on this machine."""

    def __init__(
        self,
        block: Block,
        target: str = "interp",
        *,
        backward: bool | BackwardOptions = True,
        special: bool | tuple[str, ...] = False,
        tile: tuple[int, int] | None = None,
        sim_tile: tuple[int, int] | None = None,
        remat: str | None = None,
        chunk: int | str | None = None,
        budget: int | None = None,
        chunk_dim: str | None = None,
        fp8_grads: str | None = None,
        wrt: list[str] | None = None,
        fp8_acc: bool = False,
    ):
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
        if target == "interp" and tile is not None:
            raise ValueError(
                "tile= is the kernels' tile (targets cuda, emulate); the interpreter's is sim_tile="
            )
        if target != "interp" and sim_tile is not None:
            raise ValueError(f"sim_tile= is the interpreter's simulated tile; target {target}'s is tile=")
        self.options, self.draw = backward_options(backward, remat, chunk, budget, chunk_dim)
        if self.options is not None:  # a BackwardOptions' own fp8 fields are the keywords' (either way)
            fp8_grads = fp8_grads if fp8_grads is not None else self.options.fp8_grads
            fp8_acc = fp8_acc or self.options.fp8_acc
        # fp8 cotangents (docs/design.md, "The fp8 backward"): the backward under test and the
        # references quantize each fp8 GEMM stage's cotangent, every scale 1 (the first step of a
        # DelayedScaling(initial=1.0)); unchunked (BackwardOptions refuses fp8_grads with chunks)
        self.fp8_grads = fp8_grads
        # the parameters the backward differentiates (None: every float parameter without a default):
        # the references' and the function under test's alike. Checked here: ValueError, TypeError
        block._check_wrt(wrt)
        if wrt is not None and backward is False:
            raise ValueError("wrt= names what the backward differentiates; backward=False checks none")
        self.wrt = list(wrt) if wrt is not None else None
        if fp8_grads is not None:
            if self.options is None:
                raise ValueError("fp8_grads= quantizes the backward's cotangents; backward=False checks none")
            if self.draw or self.options.chunked:
                raise ValueError("fp8_grads= runs the backward unchunked: give no chunk=")
            self.options = replace(self.options, fp8_grads=fp8_grads)  # (checked as it is made)
        # each GEMM stage's acc read from the fp8 copy the stage stores (BackwardOptions.fp8_acc), in
        # the backward under test and the references alike; unchunked
        self.fp8_acc = fp8_acc
        if fp8_acc:
            if self.options is None:
                raise ValueError("fp8_acc= chooses what the backward saves; backward=False checks none")
            if self.draw or self.options.chunked:
                raise ValueError("fp8_acc= runs the backward unchunked: give no chunk=")
            self.options = replace(self.options, fp8_acc=True)
        # the backward's saved-tensor policy (the default one when the backward is not checked)
        self.remat = self.options.remat if self.options is not None else DEFAULT_REMAT
        self.block, self.target, self.special = block, target, special
        self.tile, self.sim_tile = tile, sim_tile
        self.notes: list[str] = []
        self.backward_error: str | None = None  # the code of the error that keeps the backward out
        self.chunk_error: str | None = None  # the code of the error that keeps the backward unchunked
        self.derivation = None
        self.chunk_plan: Any = None  # autodiff.chunk.ChunkPlan, when the backward runs in chunks
        self.crash: str | None = None
        o = self.options
        if o is not None:
            try:
                self.derivation = block.derivation(self.wrt, backward=self._ref_options(o.remat))
            except CodaError as e:
                self.notes.append(f"backward not checked (--remat {o.remat}): {first_line(e)}")
                self.backward_error = e.diagnostics[0].code if e.diagnostics else "?"
            except Exception as e:  # a traceback is a bug: every case fails with it
                self.crash = f"autodiff (Block.derivation, remat={o.remat!r}) raised {first_line(e)}"
        if self.derivation is not None and o is not None and (self.draw or o.chunked):
            try:  # the plan cases draw their chunks by: along chunk_dim, else the rows
                self.chunk_plan = candidate_plans(block, self.wrt, self._chunked(1))[0]
            except CodaError as e:
                self.no_chunks(e, "")
            except ValueError:  # chunk_dim= names no dim of the block: an argument mistake
                raise
            except Exception as e:
                self.crash = f"Block.chunk_plan({self._chunked(1)}) raised {first_line(e)}"
        self.cb: Any = None
        self.fn: Any = None  # CudaBlock.autograd(): the backward unchunked
        self.fns: dict[BackwardOptions, Any] = {}  # ... and in chunks, by a case's options
        self.fn_tile: tuple[int, int] | None = tile
        if target != "interp":
            self._prepare_cuda()

    def _chunked(self, chunk: int) -> BackwardOptions:
        """The Fuzzer's options in chunks of `chunk` (along its chunk_dim, if it has one)."""
        chunk_dim = self.options.chunk_dim if self.options is not None else None
        return BackwardOptions(self.remat, chunk, None, chunk_dim)

    def no_chunks(self, e: CodaError, where: str) -> None:
        """The backward can't run in chunks (`where`: on this target): note it and check it unchunked."""
        self.notes.append(f"backward not chunked{where}, checked unchunked: {first_line(e)}")
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
                f"--target {self.target}: the CUDA backend is not usable here: {first_line(e)}"
            ) from None
        except Exception as e:  # a traceback is a bug: every case fails with it
            self.crash = f"Block.cuda() raised {first_line(e)}"
            return
        if self.derivation is not None:
            try:
                self.fn = self._autograd(emulate)
            except CodaError as e:
                self.notes.append(
                    f"backward not checked on {self.target} (--remat {self.remat}): {first_line(e)}"
                )
                self.backward_error = e.diagnostics[0].code if e.diagnostics else "?"
            except Exception as e:
                self.crash = f"CudaBlock.autograd(remat={self.remat!r}) raised {first_line(e)}"
        if self.fn is not None and self.chunk_plan is not None:
            try:  # the chunked backward's CUDA blocks (E07 if it can't compile): now, not in a case
                self._chunked_fn(self._chunked(1))
            except CodaError as e:
                self.no_chunks(e, f" on {self.target}")
            except Exception as e:
                self.crash = f"CudaBlock.autograd({self._chunked(1)}) raised {first_line(e)}"

    def grad_scales(self) -> Any:
        """A fresh `DelayedScaling(initial=1.0)` for one backward with fp8 cotangents (each case's at
        scales 1, as the references' `Block.vjp`), else None."""
        if self.fp8_grads is None or self.derivation is None or not self.derivation.scales:
            return None
        # lazy: imports torch, which only a backward with fp8 cotangents on the CUDA runtime needs
        from coda_lang.backend_cute.runtime.grad_scales import DelayedScaling

        return DelayedScaling(initial=1.0)

    def _autograd(self, emulate: bool) -> Any:
        """`CudaBlock.autograd()`; emulated, at the first small tile that fits every stage."""
        options = self._ref_options(self.remat)
        if not emulate or self.tile is not None:
            return self.cb.autograd(
                self.wrt, tile=self.tile, backward=options, grad_scales=self.grad_scales()
            )
        for t in EMULATE_TILES:
            try:
                fn = self.cb.autograd(self.wrt, tile=t, backward=options, grad_scales=self.grad_scales())
                self.fn_tile = t
                return fn
            except CodaError as e:
                if [d.code for d in e.diagnostics] != ["E0805"]:
                    raise
        self.fn_tile = None
        return self.cb.autograd(self.wrt, backward=options, grad_scales=self.grad_scales())

    def _chunked_fn(self, options: BackwardOptions) -> Any:
        """`CudaBlock.autograd(backward=options)` at the unchunked function's tile. Made once (chunk=1);
        every other chunk is a shallow copy with its own options (what `run_backward` reads), sharing
        the CUDA blocks: a case's drawn chunk compiles nothing new on the GPU."""
        if options not in self.fns:
            first = self._chunked(1)
            if first not in self.fns:
                self.fns[first] = self.cb.autograd(self.wrt, tile=self.fn_tile, backward=first)
            fn = copy.copy(self.fns[first])
            fn.options = options
            self.fns[options] = fn
        return self.fns[options]
