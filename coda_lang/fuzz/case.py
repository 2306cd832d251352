"""What a fuzz case is, how the search draws one for a block, and the command that reproduces it.

What it does: `Case` (a block's sizes, the seed of its inputs and cotangents, the simulated tile, the
backward's policy and chunk), its one-line description and its `coda fuzz` arguments; `CaseDraws`,
the `Fuzzer`'s hypothesis strategies of cases (sizes, seeds, tiles, chunks: `cases`) and the one case
that given values fix (`single_case`); the targets and their size limits.
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
from coda_lang.core.diagnostics import CodaError
from coda_lang.ir.nodes import REMAT
from coda_lang.testing.dims import dim_sizes, dim_units, tiles
from coda_lang.testing.inputs import input_seeds

TARGETS = ("interp", "cuda", "emulate")
REMATS = ("save", "recompute", "auto")  # the saved-tensor policies, save first (hypothesis shrinks to it)
assert set(REMATS) == set(REMAT)
DRAW = "draw"  # chunk=DRAW: each case draws unchunked, a number of rows, or "auto" with a budget
MAX_DIM = {"interp": 48, "cuda": 520, "emulate": 64}
ALIGN = {"interp": 1, "cuda": 8, "emulate": 8}  # TMA: rows of 16 bytes (8 bf16 elements)


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


def first_line(e: BaseException) -> str:
    if isinstance(e, CodaError):
        d = e.diagnostics[0] if e.diagnostics else None
        return f"error[{d.code}]: {d.message}" if d else str(e)
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def dtype_of(t: Any) -> str:
    return t.dtype if t is not None and t.dtype in ("f32", "bf16", "f16") else "f32"


class CaseDraws:
    """The `Fuzzer`'s strategies of cases (a mixin: the attributes below are the Fuzzer's)."""

    block: Block
    target: str
    tile: tuple[int, int] | None
    remat: str
    chunk: int | str | None
    budget: int | None
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
