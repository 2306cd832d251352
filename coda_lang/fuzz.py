"""`coda fuzz`: differential testing of a block's kernels (or tile simulation) against the interpreter.

What it does: draws cases (sizes for the block's dims, including sizes that are not multiples of the
tile; a seed for the inputs and the cotangents; for the interpreter target a small tile) with
hypothesis, runs the block on the path under test and on the whole-matrix interpreter, forward and
backward, and compares them with the tolerance rule of `coda_lang.testing.compare`. Targets:
- `interp`: the interpreter's tile simulation (`Block.run(..., tile=...)`, `Block.vjp(..., tile=...)`);
- `cuda`: the compiled kernels (`Block.cuda()`; backward through `CudaBlock.autograd()`), on a GPU;
  the kernels' per-tile partial buffers are also compared with the tile simulation at their tiles;
- `emulate`: the CUDA runtime with each kernel launch replaced by its torch stand-in, on the CPU
  (tests the runtime's host logic without a GPU).
On a mismatch hypothesis shrinks the case; the report gives the smallest failing dims, the input seed
and a one-line command that reproduces exactly that case. `fuzz_programs` does the same over random
programs (`coda_lang.testing.random_blocks`), shrinking the program too.
What it does not: parse arguments (cli.py) or decide tolerances (testing/compare.py).
Invariants: no GPU library is imported unless the target needs one; a case that raises anything but a
`CodaError` on either path is a failure (a traceback is a bug); everything is seeded, so the same
command finds the same failure.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import Flaky

from coda_lang.api import Block
from coda_lang.testing.compare import mismatch
from coda_lang.testing.dims import dim_sizes, dim_units, tiles
from coda_lang.testing.inputs import block_inputs, cotangents, input_seeds
from coda_lang.verify.diagnostics import CodaError

TARGETS = ("interp", "cuda", "emulate")
MAX_DIM = {"interp": 48, "cuda": 520, "emulate": 64}
ALIGN = {"interp": 1, "cuda": 8, "emulate": 8}  # TMA: rows of 16 bytes (8 bf16 elements)


EMULATE_TILES = ((16, 32), (16, 64), (32, 128), (64, 128))  # --target emulate: small, so that small sizes
# have several (ragged) tiles


def _small_tiles(cb: Any) -> dict[int, tuple[int, int]]:
    """{stage: the first of EMULATE_TILES that fits it} for the GEMM stages of a CudaBlock."""
    from coda_lang.backend_cute.compile import TileConfig, fits

    out = {}
    for k, spec in enumerate(cb.specs, 1):
        if spec is None:  # an elementwise stage: no tile
            continue
        for t in EMULATE_TILES:
            if fits(spec, TileConfig(*t)):
                out[k] = t
                break
    return out


class Unavailable(Exception):
    """The target can't run here (no torch, no GPU): a usage error, exit 2."""


@dataclass(frozen=True)
class Case:
    dims: dict[str, int]
    seed: int
    tile: tuple[int, int] | None = None

    def describe(self) -> str:
        parts = ["dims " + ", ".join(f"{k}={v}" for k, v in self.dims.items())]
        if self.tile is not None:
            parts.append(f"tile {self.tile[0]}x{self.tile[1]}")
        parts.append(f"input seed {self.seed}")
        return "; ".join(parts)

    def args(self) -> list[str]:
        out = ["--dims", ",".join(f"{k}={v}" for k, v in self.dims.items())]
        if self.tile is not None:
            out += ["--tile", f"{self.tile[0]}x{self.tile[1]}"]
        return out + ["--input-seed", str(self.seed)]


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
    ):
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
        self.block, self.target, self.special, self.tile = block, target, special, tile
        self.notes: list[str] = []
        self.backward_error: str | None = None  # the code of the error that keeps the backward out
        self.derivation = None
        self.crash: str | None = None
        if backward:
            try:
                self.derivation = block.derivation()
            except CodaError as e:
                self.notes.append(f"backward not checked: {_first_line(e)}")
                self.backward_error = e.diagnostics[0].code if e.diagnostics else "?"
            except Exception as e:  # a traceback is a bug: every case fails with it
                self.crash = f"autodiff (Block.derivation) raised {_first_line(e)}"
        self.cb: Any = None
        self.fn: Any = None
        if target != "interp":
            self._prepare_cuda()

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
        from coda_lang.backend_cute.compile import BackendUnavailable

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
                self.notes.append(f"backward not checked on {self.target}: {_first_line(e)}")
                self.backward_error = e.diagnostics[0].code if e.diagnostics else "?"
            except Exception as e:
                self.crash = f"CudaBlock.autograd() raised {_first_line(e)}"

    def _autograd(self, emulate: bool) -> Any:
        """`CudaBlock.autograd()`; emulated, at the first small tile that fits every stage."""
        if not emulate or self.tile is not None:
            return self.cb.autograd(tile=self.tile)
        for t in EMULATE_TILES:
            try:
                return self.cb.autograd(tile=t)
            except CodaError as e:
                if [d.code for d in e.diagnostics] != ["E0805"]:
                    raise
        return self.cb.autograd()

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
        """Cases for this block: `dims`, `seed` (and the tile given to the Fuzzer) fix what they give."""
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
        return st.builds(Case, sizes, seeds, tile_s)

    def single_case(self, dims: dict[str, int] | None, seed: int | None) -> Case | None:
        """The one case that `dims`, `seed` and the Fuzzer's tile fix, if they fix everything."""
        names = {d.name for b in self.blocks() for d in b.ir.dims}
        if (
            seed is None
            or not dims
            or not names <= set(dims)
            or (self.target == "interp" and self.tile is None)
        ):
            return None
        return Case(dict(dims), seed, self.tile)

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
        try:
            msgs = self._forward(case, ins, ref, ref64)
        except Exception as e:
            return [f"forward on {self.target} raised {_first_line(e)}"]
        if self.derivation is None or (self.target != "interp" and self.fn is None):
            return msgs
        cots = cotangents(self.block, case.dims, case.seed)
        try:
            gref = self.block.vjp(ins, cots, dims=case.dims)
            g64 = self.block.vjp(ins, cots, dims=case.dims, precision="f64")
        except Exception as e:
            return msgs + [f"the whole-matrix interpreter's backward (Block.vjp) raised {_first_line(e)}"]
        try:
            msgs += self._backward(case, ins, cots, gref, g64)
        except Exception as e:
            msgs.append(f"backward on {self.target} raised {_first_line(e)}")
        return msgs

    def _outputs(
        self,
        what: str,
        got: dict[str, Any],
        ref: dict[str, Any],
        ref64: dict[str, Any],
        dtypes: dict[str, str],
    ) -> list[str]:
        out = []
        for name, r in ref.items():
            if name not in got:
                out.append(f"{what} `{name}`: missing")
                continue
            m = mismatch(f"{what} `{name}`", got[name], r, ref64.get(name), dtypes.get(name, "f32"))
            if m:
                out.append(m)
        return out

    def _forward(
        self, case: Case, ins: dict[str, Any], ref: dict[str, Any], ref64: dict[str, Any]
    ) -> list[str]:
        dtypes = {o.name: _dtype_of(o.type) for o in self.block.ir.outputs}
        if self.target == "interp":
            got = self.block.run(ins, dims=case.dims, tile=case.tile)
            return self._outputs("output", got, ref, ref64, dtypes)
        outs, parts = self.cb.run_with_partials(
            {k: self._tensor(v) for k, v in ins.items()}, dims=self._dims(self.block, case)
        )
        msgs = self._outputs("output", outs, ref, ref64, dtypes)
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
        self, case: Case, ins: dict[str, Any], cots: dict[str, Any], gref: dict[str, Any], g64: dict[str, Any]
    ) -> list[str]:
        d = self.derivation
        assert d is not None
        out_t = {o.name: o.type for o in d.backward.ir.outputs}
        dtypes = {p: _dtype_of(out_t.get(g)) for p, g in d.grads.items()}
        if self.target == "interp":
            got = self.block.vjp(ins, cots, dims=case.dims, tile=case.tile)
            return self._outputs("gradient of", got, gref, g64, dtypes)
        import torch

        tensors = {k: self._tensor(v) for k, v in ins.items()}
        wrt = [p for p in d.grads if p in tensors and tensors[p].is_floating_point()]
        for p in wrt:
            tensors[p] = tensors[p].detach().requires_grad_(True)
        outs = self.fn(tensors, dims=self._dims(self.block, case))
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
        return self._outputs("gradient of", got, {p: gref[p] for p in wrt}, g64, dtypes)

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


class Progress:
    """One progress line on stderr: rewritten in place on a terminal, else at most one line a second."""

    def __init__(self, label: str, total: int, stream: TextIO | None = None, quiet: bool = False):
        self.label, self.total, self.quiet = label, total, quiet
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.n = 0
        self.failed = 0
        self.shrinks = 0
        self.last = 0.0
        self.started = time.monotonic()
        self.show(force=True)

    def step(self, failing: bool, case: Case | None = None) -> None:
        if self.failed:
            self.shrinks += 1
        else:
            self.n += 1
        self.failed += failing
        self.show(case=case)

    def text(self, case: Case | None = None) -> str:
        if self.failed:
            return f"coda fuzz: {self.label}: failure found after {self.n} cases; shrinking ({self.shrinks} tries)"
        return f"coda fuzz: {self.label}: {self.n}/{self.total} cases" + (
            f" ({case.describe()})" if case and self.tty else ""
        )

    def show(self, force: bool = False, case: Case | None = None) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        if self.tty:
            line = self.text(case)[:150]
            self.stream.write("\r" + line.ljust(150)[:150].rstrip() + "\x1b[K")
            self.stream.flush()
        elif force or now - self.last >= 1.0:
            self.stream.write(self.text() + "\n")
            self.stream.flush()
            self.last = now

    def done(self) -> None:
        if self.quiet:
            return
        if self.tty:
            self.stream.write("\r\x1b[K")
        else:
            self.stream.write(self.text() + "\n")
        self.stream.flush()


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
) -> Result:
    """Fuzz one block (see the module docstring). CodaError if it can't run on the target at all.
    `fuzzer`: a Fuzzer made already (then target, tile, special and backward are its own)."""
    t0 = time.monotonic()
    fz = fuzzer or Fuzzer(block, target, backward=backward, special=special, tile=tile)
    failures: list[Failure] = []
    count = [0]

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
    return Result(count[0], failure, fz.notes, time.monotonic() - t0)


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
) -> Result:
    """Fuzz `programs` random blocks (`coda_lang.testing.random_blocks`), `examples` cases each; on a
    failure hypothesis shrinks the program and the case together."""
    import coda_lang
    from coda_lang.testing import random_blocks

    t0 = time.monotonic()
    failures: list[Failure] = []
    skipped: list[str] = []
    no_backward: list[str] = []
    count = [0]

    def test(data: st.DataObject) -> None:
        fw = data.draw(
            random_blocks(("f32", "bf16", "f16") if target == "interp" else ("bf16", "f16")), label="program"
        )
        block = coda_lang.load(fw.text)["fwd"]
        try:
            fz = Fuzzer(block, target, backward=backward, special=special, tile=tile)
        except CodaError as e:  # the target can't run it (E07): not a failure
            if not failures:
                skipped.append(_first_line(e))
            return
        if fz.backward_error and not failures:
            no_backward.append(fz.backward_error)
        strategy = fz.cases(max_dim)
        for _ in range(examples):
            _check(fz, data.draw(strategy, label="case"), failures, count, progress, program=fw.text)

    failure = _run(test, st.data(), programs, seed, shrink, failures)
    if progress:
        progress.done()
    notes = []
    if no_backward:
        codes = ", ".join(f"{c} x{no_backward.count(c)}" for c in sorted(set(no_backward)))
        notes.append(f"backward not checked for {len(no_backward)} programs ({codes})")
    return Result(count[0], failure, notes, time.monotonic() - t0, skipped)


def save_program(text: str, folder: str = ".") -> str:
    """Write a failing random program to `folder`/coda-fuzz-<hash>.coda; its path."""
    path = os.path.join(folder, f"coda-fuzz-{hashlib.sha256(text.encode()).hexdigest()[:10]}.coda")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path
