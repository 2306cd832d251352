"""What a fuzz case is, how the search draws one for a block, and the command that reproduces it.

What it does: `Case` (a block's sizes, the seed of its inputs and cotangents, the simulated or the
kernels' tile, the backward's options: policy and chunk), its one-line description and its `coda fuzz` arguments;
`CaseDraws`, the `Fuzzer`'s hypothesis strategies of cases (sizes, seeds, tiles, chunks: `cases`) and
the one case that given values fix (`single_case`); `backward_options`, the fuzzer's backward
arguments as one `BackwardOptions` (checked there, once) and whether each case draws its chunk
(`DRAW`); the targets and their size limits.
What it does not: run or compare a case (compare.py), or make the block ready (fuzzer.py).
Invariants: a case is a value (frozen, hashable parts); `Case.args()` fixes everything the case
draws, so the printed command runs exactly that case again; strategies draw sizes and chunks apart
(no flatmap), so that hypothesis shrinks each on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from coda_lang.api import Block
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.core.diagnostics import CodaError
from coda_lang.ir.nodes import REMAT
from coda_lang.ir.types import is_fp8
from coda_lang.testing.dims import dim_sizes, dim_units, tiles
from coda_lang.testing.inputs import input_seeds

TARGETS = ("interp", "cuda", "emulate")
POLICIES = ("save", *(p for p in REMAT if p != "save"))  # the policies a search draws: save first (it
# shrinks to the plainest derivation)
DRAW = "draw"  # chunk=DRAW: each case draws unchunked, a number of rows, or "auto" with a budget
MAX_DIM = {"interp": 48, "cuda": 520, "emulate": 64}
ALIGN = {"interp": 1, "cuda": 8, "emulate": 8}  # TMA: rows of 16 bytes (8 bf16 elements)


class Unavailable(Exception):
    """The target can't run here (no torch, no GPU): a usage error, exit 2."""


def backward_options(
    backward: bool | BackwardOptions,
    remat: str | None = None,
    chunk: int | str | None = None,
    budget: int | None = None,
    chunk_dim: str | None = None,
) -> tuple[BackwardOptions | None, bool]:
    """(the options of the backward under test, None when it is not checked; whether each case draws
    its chunk). `backward`: True (checked, under the options the keywords give), False (not checked),
    or a `BackwardOptions`; the keywords are its shorthands (`BackwardOptions.of`), `chunk` may also
    be DRAW. TypeError or ValueError for arguments that contradict each other or are not what they
    take (BackwardOptions' own checks)."""
    draw = isinstance(chunk, str) and chunk == DRAW
    given = [
        k
        for k, v in (("remat", remat), ("chunk", chunk), ("budget", budget), ("chunk_dim", chunk_dim))
        if v is not None and not (k == "chunk" and draw)  # (DRAW: fuzz_programs' default)
    ]
    if backward is False:
        if given:
            raise ValueError(
                f"backward=False checks no backward; {', '.join(f'{k}=' for k in given)} choose its options"
            )
        return None, False
    options = BackwardOptions.of(
        None if backward is True else backward,
        remat=remat,
        chunk=None if draw else chunk,
        budget=budget,
        chunk_dim=chunk_dim,
    )
    if draw and (options.chunk is not None or options.budget is not None):
        raise ValueError(
            f'chunk={DRAW!r} draws each case\'s chunk and budget; budget= fixes them: give chunk="auto"'
        )
    return options, draw


@dataclass(frozen=True)
class Case:
    """One case: the sizes of the block's dims, the seed of its inputs and cotangents, the
    interpreter's simulated tile (interp), the backward's options (None: the backward is not checked)
    and the kernels' tile (cuda, emulate: when one is given). A chunked case's options give the chunk
    explicitly ("auto" with its budget, or a number)."""

    dims: dict[str, int]
    seed: int
    sim_tile: tuple[int, int] | None = None
    backward: BackwardOptions | None = None
    tile: tuple[int, int] | None = None

    def describe(self) -> str:
        parts = ["dims " + ", ".join(f"{k}={v}" for k, v in self.dims.items())]
        if self.sim_tile is not None:
            parts.append(f"sim tile {self.sim_tile[0]}x{self.sim_tile[1]}")
        if self.tile is not None:
            parts.append(f"tile {self.tile[0]}x{self.tile[1]}")
        parts.append(f"input seed {self.seed}")
        b = self.backward
        if b is not None:
            parts.append(f"remat {b.remat}")
            along = "" if b.chunk_dim is None else f" along {b.chunk_dim}"
            if b.mode == "auto":
                parts.append(f"chunk auto{along} (budget {b.budget} bytes)")
            elif b.mode is not None:
                parts.append(
                    f"chunks of {b.mode} rows" if b.chunk_dim is None else f"chunks of {b.mode}{along}"
                )
        return "; ".join(parts)

    def args(self) -> list[str]:
        """The `coda fuzz` arguments that run exactly this case."""
        out = ["--dims", ",".join(f"{k}={v}" for k, v in self.dims.items())]
        if self.sim_tile is not None:
            out += ["--sim-tile", f"{self.sim_tile[0]}x{self.sim_tile[1]}"]
        if self.tile is not None:
            out += ["--tile", f"{self.tile[0]}x{self.tile[1]}"]
        out += ["--input-seed", str(self.seed)]
        if self.backward is not None:
            flags = self.backward.flags()  # (a default policy left out: named all the same)
            out += flags if "--remat" in flags else ["--remat", self.backward.remat, *flags]
        return out


def first_line(e: BaseException) -> str:
    if isinstance(e, CodaError):
        d = e.diagnostics[0] if e.diagnostics else None
        return f"error[{d.code}]: {d.message}" if d else str(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def dtype_of(t: Any) -> str:
    return t.dtype if t is not None and t.dtype in ("f32", "bf16", "f16", "e4m3", "e5m2") else "f32"


class CaseDraws:
    """The `Fuzzer`'s strategies of cases (a mixin: the attributes below are the Fuzzer's)."""

    block: Block
    target: str
    tile: tuple[int, int] | None
    sim_tile: tuple[int, int] | None
    options: BackwardOptions | None
    draw: bool
    derivation: Any
    chunk_plan: Any

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
        """Cases for this block: `dims`, `seed` (and the tiles, policy and chunk given to the Fuzzer)
        fix what they give; on interp each case draws a small simulated tile unless one is given."""
        blocks = self.blocks()
        top = max_dim or MAX_DIM[self.target]
        sizes = dim_sizes(blocks, top, self.align(), given=dims)
        sim_tile: st.SearchStrategy[tuple[int, int] | None] = st.just(self.sim_tile)
        if self.target == "interp" and self.sim_tile is None:
            sim_tile = tiles(blocks)
        seeds = st.just(seed) if seed is not None else input_seeds()
        tile = self.tile

        def make(
            d: dict[str, int], seed: int, sim: tuple[int, int] | None, pick: tuple[str, int, int] | None
        ) -> Case:
            return Case(d, seed, sim, None if pick is None else self._chunk_of(d, pick), tile)

        picks = st.none() if self.derivation is None else self._chunk_picks(top)
        return st.builds(make, sizes, seeds, sim_tile, picks)

    def _fixed(self) -> bool:
        """Whether the Fuzzer's options fix the chunk (a number, or "auto" with a budget)."""
        o = self.options
        return o is not None and (isinstance(o.chunk, int) or (o.mode == "auto" and o.budget is not None))

    def _chunk_picks(self, top: int) -> st.SearchStrategy[tuple[str, int, int]]:
        """What a case draws for its chunk, before it knows its sizes (no flatmap, so that hypothesis
        shrinks sizes and chunk apart): ("none" | "rows" | "auto", n, r), made a chunk by `_chunk_of`."""
        o = self.options
        if self.chunk_plan is None or o is None or not (self.draw or o.chunked):
            return st.just(("none", 0, 0))
        if self._fixed():
            return st.just(("fixed", 0, 0))
        n, r = st.integers(1, max(1, top)), st.integers(0, 2**16)
        auto = st.tuples(st.just("auto"), n, r)
        if not self.draw:  # "auto" with no budget: each case draws one
            return auto
        return st.one_of(st.just(("none", 0, 0)), st.tuples(st.just("rows"), n, st.just(0)), auto)

    def _chunk_of(self, dims: dict[str, int], pick: tuple[str, int, int]) -> BackwardOptions:
        """The backward's options of a case at sizes `dims`: drawn chunks run 1 row to all rows at a
        time (a ragged last chunk included); a drawn budget gives such a chunk through chunk="auto"."""
        o = self.options
        assert o is not None
        kind, n, r = pick
        if kind == "none":
            return o.unchunked()
        if kind == "fixed":
            return o if o.chunk is not None else o.with_(chunk="auto")
        plan = self.chunk_plan
        assert plan is not None
        rows = max(1, dims.get(plan.dim, 1))
        c = 1 + (n - 1) % rows  # 1 .. rows: shrinks to 1
        if kind == "rows":
            # a kernel stores rows of 16 bytes: where the dim is a stored matrix's columns (the gradient
            # of a transposed input), a GPU chunk is a multiple of the plan's alignment (as "auto" makes it);
            # where all the rows are fewer than that, one chunk of them all (a chunk of fewer rows would
            # store rows the kernels refuse, E0807: the emulated kernels too)
            a = plan.align if self.target != "interp" else 1
            return BackwardOptions(
                o.remat, min(rows, a * (1 + (n - 1) % max(1, rows // a))), None, o.chunk_dim
            )
        per_row = plan.bytes_per_row(dims)
        if per_row == 0:  # no transient: any budget gives one chunk
            return BackwardOptions(o.remat, "auto", 1 + r, o.chunk_dim)
        return BackwardOptions(o.remat, "auto", c * per_row + r % per_row, o.chunk_dim)

    def single_case(self, dims: dict[str, int] | None, seed: int | None) -> Case | None:
        """The one case that `dims`, `seed` and the Fuzzer's tile, policy and chunk fix, if they fix
        everything."""
        names = {d.name for b in self.blocks() for d in b.ir.dims}
        if (
            seed is None
            or not dims
            or not names <= set(dims)
            or (self.target == "interp" and self.sim_tile is None)
        ):
            return None
        if self.derivation is None:
            return Case(dict(dims), seed, self.sim_tile, None, self.tile)
        o = self.options
        assert o is not None
        if self.chunk_plan is None or not (self.draw or o.chunked):
            return Case(dict(dims), seed, self.sim_tile, o.unchunked(), self.tile)
        if not self._fixed():
            return None
        return Case(dict(dims), seed, self.sim_tile, self._chunk_of(dims, ("fixed", 0, 0)), self.tile)

    def units(self) -> dict[str, int]:
        return dim_units(self.blocks(), self.align())

    def align(self) -> int:
        """The target's row alignment in elements (ALIGN: 16 bytes of a 16-bit dtype), doubled where
        the block has an fp8 matrix (16 bytes are 16 fp8 values)."""
        a = ALIGN[self.target]
        ir, plan = self.block.ir, self.block.plan
        dtypes = [p.var.type.dtype for p in ir.params if p.var.type is not None]
        dtypes += [o.type.dtype for o in ir.outputs] + list(plan.storage.values())
        return 2 * a if a > 1 and any(is_fp8(d) for d in dtypes) else a
