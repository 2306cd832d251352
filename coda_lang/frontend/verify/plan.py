"""The plan of a checked block: what each stage loads, stores, reduces, and what runs between stages.

What it does: plain frozen records filled in by the checker, and `explain`, which prints them for
`coda check --explain`.
What it does not: decide anything (check.py does); it is read by the interpreter and the backend.
Invariants: one StagePlan per stage in program order; `between[k]` holds the block-level equations
that run after stage k (k = 0: before the first stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from coda_lang.frontend.syntax.printer import inline_source
from coda_lang.frontend.verify.repeat import repeat_uses
from coda_lang.ir.nodes import Block, Eqn, Var
from coda_lang.ir.types import Dim, Shape, TileConstraint, shape_str


@dataclass(frozen=True)
class Load:
    name: str
    dtype: str
    shape: Shape
    role: str  # "tile" | "grouped tile" (read over its groups: `expand`) | "row vector" | "column vector" | "scalar"


@dataclass(frozen=True)
class Store:
    name: str
    dtype: str
    shape: Shape
    why: tuple[str, ...]


@dataclass(frozen=True)
class Reduction:
    name: str
    op: str
    over: Dim
    axis: str  # "columns" | "rows"
    combine: str | None  # None for a grouped reduction (complete in its tile)
    group: int | None
    shape: Shape


@dataclass(frozen=True)
class StagePlan:
    index: int  # 1-based, as printed
    text: str  # `gemm y @ w_o`
    line: int
    rows: Dim
    cols: Dim
    k: Dim
    loads: tuple[Load, ...]
    stores: tuple[Store, ...]
    reductions: tuple[Reduction, ...]
    tiling: tuple[TileConstraint, ...]  # what the stage's tile must satisfy (whole groups of a group=)

    @property
    def constraints(self) -> tuple[str, ...]:
        """The tiling constraints' text, as `explain` and `coda draw` print them."""
        return tuple(str(c) for c in self.tiling)


@dataclass(frozen=True)
class BlockPlan:
    block: Block  # the typed block
    activation: str
    stages: tuple[StagePlan, ...]
    between: tuple[tuple[Eqn, ...], ...]
    storage: dict[str, str] = field(default_factory=dict)  # every stored value -> its dtype

    def operand_dtype(self, a: Var) -> str:
        """The dtype a GEMM operand is multiplied in: a parameter's declared one, else its storage dtype
        (the planner's GEMM dtypes, the rounding bound's fp8 GEMMs)."""
        for p in self.block.params:
            if p.var.name == a.name and p.var.type is not None:
                return p.var.type.dtype
        return self.storage.get(a.name, a.type.dtype if a.type else "f32")

    @property
    def vector_computations(self) -> int:
        """Runs of vector computation between two stages (the paper's tiny auxiliary reductions)."""
        return sum(1 for k, eqns in enumerate(self.between) if eqns and 0 < k < len(self.stages))


def _source(eqns: tuple[Eqn, ...]) -> list[str]:
    return inline_source(eqns)


def explain(plan: BlockPlan) -> str:
    b = plan.block
    repeats: dict[tuple[int, str], list[str]] = {}  # (stage, vector) -> the widths it repeats across
    for u in repeat_uses(b):
        widths = repeats.setdefault((u.stage, u.name), [])
        if str(u.width) not in widths:
            widths.append(str(u.width))
    dims = ", ".join(d.name for d in b.dims)
    n_ew = sum(1 for sp in plan.stages if sp.text.startswith("elementwise"))
    n_gemm = len(plan.stages) - n_ew
    ew = f" + {n_ew} elementwise stage{'s' * (n_ew != 1)}" if n_ew else ""
    lines = [
        f"block {b.name}: {n_gemm} GEMM stage{'s' * (n_gemm != 1)}{ew}, "
        f"{plan.vector_computations} vector computation{'s' * (plan.vector_computations != 1)} between stages "
        f"(activations {plan.activation}; dims {dims})"
    ]
    for k, sp in enumerate(plan.stages):
        pre = plan.between[k]
        if pre:
            where = "before stage 1" if k == 0 else f"between stages {k} and {k + 1}"
            lines.append(f"  {where}: vector computation")
            lines += [f"      {t}" for t in _source(pre)]
        if sp.text.startswith("elementwise"):
            lines.append(
                f"  stage {sp.index} (line {sp.line}): {sp.text}: tiles of a {shape_str((sp.rows, sp.cols))} matrix, "
                "no GEMM (a memory-bound kernel)"
            )
        else:
            lines.append(
                f"  stage {sp.index} (line {sp.line}): {sp.text} -> acc f32{shape_str((sp.rows, sp.cols))}, K = {sp.k}"
            )
        for ld in sp.loads:
            across = repeats.get((sp.index, ld.name))
            again = f", repeated across `{'`, `'.join(across)}` columns" if across else ""
            lines.append(
                f"    load    {ld.name}: {ld.dtype}{shape_str(ld.shape) if ld.shape else ''} {ld.role}{again}"
            )
        for st in sp.stores:
            lines.append(f"    store   {st.name}: {st.dtype}{shape_str(st.shape)} ({'; '.join(st.why)})")
        for r in sp.reductions:
            if r.group:
                lines.append(
                    f"    reduce  {r.name}: f32{shape_str(r.shape)} = {r.op} over {r.over} in groups of {r.group} "
                    "(complete in its tile)"
                )
            else:
                per = "column tile" if r.axis == "columns" else "row tile"
                lines.append(
                    f"    reduce  {r.name}: f32{shape_str(r.shape)} = {r.op} over {r.over}, one partial per {per}, "
                    f"combined by {r.combine}"
                )
        for c in sp.tiling:
            lines.append(f"    tiling  {c}")
        if not (sp.loads or sp.stores or sp.reductions):
            lines.append("    (epilogue reads and writes nothing but acc)")
    post = plan.between[len(plan.stages)] if len(plan.between) > len(plan.stages) else ()
    if post:
        lines.append("  after the last stage: vector computation")
        lines += [f"      {t}" for t in _source(post)]
    outs = ", ".join(
        f"{o.name}: {o.type.dtype}{shape_str(o.type.shape) if o.type.shape else ''}" for o in b.outputs
    )
    lines.append(f"  outputs: {outs}")
    constraints = [c for sp in plan.stages for c in sp.tiling]
    lines.append(f"  tiling constraints: {len(constraints) or 'none'}")
    return "\n".join(lines)
