"""CuTeDSL epilogue ops of coda_lang's own, for what quack's frontend can't say with its library ops.

What it does: `GroupedReduce(name, combine="add"|"max")` is a grouped reduction complete inside a tile
(`sum(x, over=N, group=g)`): quack's `GroupedColStatsBase` (the machinery of its `HeadRstd`, the
per-head rstd of QK-norm) with the finalize left out. The emitted prepass fn returns the value to
reduce under the op's name; the op folds it per (row, run of g columns) in registers, deterministically
(a fixed butterfly, then a fixed-order fold of the per-warp smem planes, no atomics); the main fn
receives the op's name as a value port: the RAW fold of each element's group (`HeadRstd` bakes
`rsqrt(sum / g + eps)` into its finalize instead; coda computes whatever follows in the fn, so one op
serves every grouped sum or max). Its host argument is the group width as a plain int (a compile-time
constant; quack checks that it divides N and tile_N). `GroupedReduce(...).out(name)` is quack's
`GroupedColStatsOut`: it writes the fold to an f32 [m, N / g] buffer when the stage's result is used
after it.
What it does not: anything at trace time beyond quack's base class; it is imported only by emitted
epilogue modules (so importing it imports quack and CuTeDSL).
Invariants: `config_key` holds everything that changes the generated code, and `VERSION`, bumped with
any edit here (quack keys its disk cache of compiled kernels on an op's module, class name and
config_key, not on its source).
"""

from __future__ import annotations

from typing import Any

import cutlass.cute as cute
from quack.epilogue.ops import GroupedColStatsBase

VERSION = 1


class GroupedReduce(GroupedColStatsBase):
    """Per-(row, group of columns) sum or max of what the prepass fn returns under `name`; the main fn
    reads the raw result at every element of the group."""

    def __init__(self, name: str, combine: str = "add"):
        if combine not in ("add", "max"):
            raise ValueError(f"GroupedReduce folds by add or max, not {combine!r}")
        super().__init__(name)
        # "max" from a -inf identity: exact here because a group never straddles the end of N (quack
        # validates N % width == 0), so the zeros of out-of-bounds columns fill only unused groups
        self.combine = combine

    def config_key(self) -> tuple[Any, ...]:
        return (self.combine, VERSION)

    @cute.jit
    def stat_value(self, total: Any, group_cols: int) -> Any:
        return total
