"""Heavy GEMM epilogues cut off into an elementwise stage of their own ($CODA_SPLIT_EPILOGUES).

What it does: `split_epilogues(block)` gives `block` with each GEMM stage whose epilogue moves an f32
tile beside column partials (`heavy`: the stages that config.WIDE_F32_TILE keeps to 128-row pingpong
tiles, such as the RMSNorm backward in a fp8 Llama layer's gate/up data gradient, 8192 x 2048 x 16384
at Llama-3.2-1B's shapes) cut in two: the GEMM, storing its f32 accumulator and nothing else, and an
elementwise stage over the same [M, N] that runs the epilogue on that stored accumulator. The GEMM
then takes any tile (no f32 tile beside column partials is left in it), and the epilogue's loads,
stores and column sums run in a memory-bound kernel of their own. The cost is one more write and
read of the accumulator in f32 (64 MB at that shape), so it pays where the contraction is long (that
stage's K is 8 times its N) and not where it is short (the QKV data gradient's). By default (`AUTO`,
`long_fp8`) the heavy stages of fp8 GEMMs whose contraction is at least LONG_K times their N are cut:
on an H200 the fp8 Llama-3.2-1B step was 0.8-1.3 ms faster with the gate/up one cut (2026-11-29).
`split_selection` reads the variable (also none, all, or the stages reading named operands);
`autograd.CudaFunction` applies it to a derived backward, at the block's bound dims.
What it does not: cut a block-scaled GEMM (its own mainloop takes 128-row tiles anyway), a paired,
packed or gated stage, or a stage whose epilogue is light; change any value: the elementwise stage
computes in f32 from the exact f32 accumulator, as the epilogue did (only a column sum's order of
addition differs: the GEMM's per-tile partials against the stage's own reduction).
Invariants: the result is checked as a pass's block is (`check_generated`), marked derived as
`block` is; its parameters and outputs are `block`'s; a stage whose cut does not check stays as it
was.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from coda_lang.backend_cute.build.config import f32_tile_beside_partials
from coda_lang.backend_cute.plan.planner import plan_stage
from coda_lang.core.diagnostics import CodaError
from coda_lang.frontend.source import check_generated
from coda_lang.ir import nodes
from coda_lang.ir.types import FP8_DTYPES

SPLIT_VAR = "CODA_SPLIT_EPILOGUES"


ALL = "all"
# the default: the heavy stages of one-byte (fp8) GEMMs whose contraction is at least LONG_K times their
# N, where the block's sizes say so (`long_fp8`)
AUTO = "auto"
LONG_K = 4


def split_selection() -> str | frozenset[str] | None:
    """Which heavy stages derived backwards are cut in ($CODA_SPLIT_EPILOGUES): AUTO (unset or "auto",
    the default: `long_fp8`'s), None (0: none), ALL ("all" or 1: every one), or the operand names of a
    comma-separated list (a heavy stage is cut where its GEMM reads one of them: `w_13q` for the fp8
    Llama layers' gate/up data gradient). Another value (an empty name, a name that is no identifier)
    is a ValueError naming the variable."""
    got = os.environ.get(SPLIT_VAR, AUTO).strip()
    if got == AUTO:
        return AUTO
    if got in ("", "0"):
        return None
    if got in ("1", ALL):
        return ALL
    names = [n.strip() for n in got.split(",")]
    if not all(n.isidentifier() for n in names):
        raise ValueError(
            f"${SPLIT_VAR} is {got!r}; it takes auto (the default), 0 (none), all (or 1), or the comma-separated "
            "names of the GEMM operands whose stages to cut (e.g. w_13q)"
        )
    return frozenset(names)


def long_fp8(block: Any, k: int, sizes: dict[str, int]) -> bool:
    """Whether stage `k` of `block` (a heavy one) is cut by default: a GEMM of one-byte operands whose
    contraction is at least LONG_K times its N at `sizes` (a block's bound dims; a dim not among them: no).
    Timed on an H200 (2026-11-29): the fp8 Llama-3.2-1B layers' gate/up data gradient (K = 8 N), 1 ms a
    step faster cut; the QKV one's contraction is short (1.5 N), where the cut's extra f32 write and
    read may cost more than its tile gains (not timed alone). bf16 stages are not cut by default: not
    timed."""
    st = block.ir.stages[k - 1]
    if not all(isinstance(x, nodes.Var) and x.annot in FP8_DTYPES for x in (st.a, st.b)):
        return False
    try:
        kk = st.a.type.shape[0 if st.ta else 1].evaluate(sizes)
        n = st.acc.type.shape[1].evaluate(sizes)
    except KeyError:
        return False
    return bool(kk >= LONG_K * n)


def heavy(block: Any) -> list[int]:
    """The GEMM stages of `block` (1-based, among all its stages, as plan_stage numbers them) that
    `split_epilogues` may cut: planned for the kernels, in element mode, not block-scaled, moving an
    f32 tile (loaded or stored) beside column partials."""
    out = []
    for k, st in enumerate(block.ir.stages, 1):
        if not st.is_gemm or st.scaled:
            continue
        try:
            spec = plan_stage(block, k)
        except CodaError:  # (no kernel plan: an f32 GEMM, which the emulated kernels alone run)
            continue
        if spec.mode != "element" or spec.paired:
            continue
        if f32_tile_beside_partials(spec):
            out.append(k)
    return out


def _fresh(block: nodes.Block, base: str) -> str:
    taken = {p.var.name for p in block.params} | {o.name for o in block.outputs}
    for st in block.body:
        eqns = st.body if isinstance(st, nodes.Stage) else (st,)
        taken |= {v.name for e in eqns for v in e.outs}
    name, i = base, 1
    while name in taken:
        i += 1
        name = f"{base}{i}"
    return name


def _swap(x: nodes.Atom, name: str, to: nodes.Var) -> nodes.Atom:
    return to if isinstance(x, nodes.Var) and x.name == name else x


def _cut(ir: nodes.Block, k: int) -> nodes.Block:
    """`ir` with its k-th stage (a GEMM) cut into the GEMM storing its f32 accumulator and an
    elementwise stage running the epilogue on it."""
    body: list[nodes.Stmt] = []
    n = 0
    for st in ir.body:
        if not isinstance(st, nodes.Stage):
            body.append(st)
            continue
        n += 1
        if n != k:
            body.append(st)
            continue
        acc = st.acc
        assert acc is not None and acc.type is not None
        stored = nodes.Var(_fresh(ir, f"acc_s{k}"), acc.type, "f32")
        body.append(replace(st, body=(nodes.Eqn("copy", (acc,), (stored,)),)))

        eqns = tuple(replace(e, ins=tuple(_swap(x, acc.name, stored) for x in e.ins)) for e in st.body)
        rows, cols = acc.type.shape  # (an accumulator is [M, N])
        body.append(nodes.Stage(a=None, b=None, ta=False, tb=False, acc=None, body=eqns, shape=(rows, cols)))
    return replace(ir, body=tuple(body))


def _reads(st: nodes.Stage) -> set[str]:
    return {x.name for x in (st.a, st.b) if isinstance(x, nodes.Var)}


def split_epilogues(
    block: Any, which: str | frozenset[str] = ALL, sizes: dict[str, int] | None = None
) -> Any:
    """`block` (a checked block: a CheckedBlock, or a class of one made as one, `cls(ir, plan)`, such as
    api.Block) with its `heavy` stages cut in two (module docstring): every one (`which` ALL), those
    `long_fp8` takes at `sizes` (AUTO), or those whose GEMM reads an operand named in `which`; `block`
    itself where none is."""
    cut = block
    stages = block.ir.stages

    def chosen_(k: int) -> bool:
        if which == ALL:
            return True
        if which == AUTO:
            return long_fp8(block, k, sizes or {})
        return bool(_reads(stages[k - 1]) & set(which))

    chosen = [k for k in heavy(block) if chosen_(k)]
    # (from the last, so that the stage numbers of the ones before stay as they are)
    for k in reversed(chosen):
        try:
            new = check_generated(_cut(cut.ir, k), "the cut backward")
        except CodaError:  # (a cut the checker refuses: the stage stays whole, as it ran before)
            continue
        # (of `block`'s own class: an api.Block stays one, with its interpreter and backends)
        cut = type(block)(replace(new.ir, derived=block.ir.derived), new.plan)
    return cut
