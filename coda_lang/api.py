"""The Python API: `load` a program, index its blocks, print them.

What it does: `Program` (blocks by name) and `Block` (a typed IR block with its plan), the objects
that later layers extend (`Block.run`, `Block.grad`, `Block.cuda`).
What it does not: parse or check by itself (frontend.py).
Invariants: a `Program` only exists for text without errors; `str(block)` is .coda source that
loads back to an equal block.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from coda_lang.frontend import check_source, read_source
from coda_lang.ir import nodes
from coda_lang.ir.printer import print_block, print_program
from coda_lang.verify.diagnostics import CodaError
from coda_lang.verify.plan import BlockPlan, explain


class Block:
    """One checked block: `ir` is its typed IR, `plan` what each stage loads, stores and reduces."""

    def __init__(self, ir: nodes.Block, plan: BlockPlan):
        self.ir = ir
        self.plan = plan

    @property
    def name(self) -> str:
        return self.ir.name

    def run(self, inputs: dict[str, Any], *, dims: dict[str, int] | None = None,
            tile: tuple[int, int] | None = None, precision: str = "exact") -> dict[str, Any]:
        """Run the block on NumPy arrays with the reference interpreter; outputs by name.

        `precision="exact"` follows the kernel's numerics (f32 in stages, stored tiles rounded to
        their dtype); `"f64"` computes everything in float64 without rounding (gradient checks).
        `tile=(tile_M, tile_N)` simulates the kernel's tiling (partials per tile, then combined).
        """
        return self.run_with_partials(inputs, dims=dims, tile=tile, precision=precision)[0]

    def run_with_partials(self, inputs: dict[str, Any], *, dims: dict[str, int] | None = None,
                          tile: tuple[int, int] | None = None, precision: str = "exact"
                          ) -> tuple[dict[str, Any], dict[str, Any]]:
        """`run`, plus the per-tile partial buffers of every partial reduction (tile mode)."""
        from coda_lang.interp import PRECISIONS, bind, run_block

        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        env, sizes = bind(self.ir, inputs, dims, precision)
        return run_block(self.ir, self.plan, env, sizes, precision=precision, tile=tile)

    def explain(self) -> str:
        return explain(self.plan)

    def __str__(self) -> str:
        return print_block(self.ir)

    def __repr__(self) -> str:
        return f"<coda Block {self.name}: {len(self.plan.stages)} stages>"


class Program:
    def __init__(self, ir: nodes.Program, plans: dict[str, BlockPlan], source: str):
        self.ir = ir
        self.source = source
        self.blocks = {b.name: Block(b, plans[b.name]) for b in ir.blocks}

    @property
    def file(self) -> str:
        return self.ir.file

    def __getitem__(self, name: str) -> Block:
        try:
            return self.blocks[name]
        except KeyError:
            raise KeyError(f"no block `{name}` in {self.file}; blocks: {', '.join(self.blocks)}") from None

    def __iter__(self) -> Iterator[Block]:
        return iter(self.blocks.values())

    def __len__(self) -> int:
        return len(self.blocks)

    def __str__(self) -> str:
        return print_program(self.ir)

    def __repr__(self) -> str:
        return f"<coda Program {self.file}: {', '.join(self.blocks)}>"


def load(path_or_text: str | os.PathLike[str]) -> Program:
    """Parse and check a .coda file (a path) or source text; raises CodaError carrying the diagnostics."""
    text, file = read_source(path_or_text)
    prog, plans, diags = check_source(text, file)
    if prog is None:
        raise CodaError(diags, {file: text})
    return Program(prog, plans, text)
