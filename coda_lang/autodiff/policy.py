"""The saved-tensor policy: which forward values the backward reads saved and which it recomputes.

What it does: `derive(block, plan, wrt, remat)` derives the backward under the block-wide policy
`remat` ("save", "recompute", "auto"), each stage's own policy overriding it where the source writes
one on the stage (`gemm a @ b, remat="save" { ... }`). Two kinds of recomputation, and what each costs:
- a GEMM run again (reverse.py, `Reverse.recompute_host`): a stage at the block's entry, whose
  backward no later GEMM's epilogue hosts, runs its GEMM again in the backward (2*M*N*K FLOPs) and its
  backward in that epilogue from the f32 acc, so nothing of its tile is held from forward to backward.
  "recompute" does it for every such stage; "auto" for a stage that stores no tile (a loss head: its
  saved acc would be an [M, N] tensor held only for the backward, while a stage that stores a tile
  keeps memory of that order in the forward anyway, so a rerun would buy at most a constant factor
  for a whole GEMM);
- in an epilogue the backward runs anyway (here): a stored tile of a stage (`a = silu(gt) * up`) that
  the backward reads after that stage's backward ran (as a weight-gradient GEMM's operand, or in an
  earlier stage's backward) is recomputed in the epilogue that runs the stage's backward, from what
  that epilogue reads anyway, and stored from there in the dtype the forward stores it in; the GEMM
  that reads it runs after that stage. Elementwise work in an epilogue that runs anyway: ~free. Under
  "auto" and "recompute" a tile is recomputed this way when that lowers the bytes held per row (no
  term grows, one shrinks: it does not when recomputing it needs a saved acc as large as itself); each
  candidate is tried with a derivation and kept greedily, in the order the backward first read them.
"save" recomputes nothing: the derivation is exactly the one of before these policies.
What it does not: build the backward (reverse.py, site.py) or judge time on a device.
Invariants: with every stage's policy "save", `derive` is `derive_with(..., remat)` unchanged; a tile
recomputed in an epilogue is stored under its forward name, in its forward storage dtype; every
recomputed value and rerun stage has one line of the report saying why.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

from coda_lang.autodiff.assemble import Derived, row_bytes
from coda_lang.autodiff.builder import AutodiffError
from coda_lang.autodiff.reverse import derive_with, stage_policies
from coda_lang.autodiff.state import SAVED
from coda_lang.core.diagnostics import Diagnostic
from coda_lang.frontend.verify.check import check_block
from coda_lang.frontend.verify.plan import BlockPlan
from coda_lang.ir.nodes import DEFAULT_REMAT, Block
from coda_lang.ir.types import TILE, Dim

Bytes = dict[str | None, Fraction]


def derive(
    block: Block,
    plan: BlockPlan,
    wrt: list[str] | None = None,
    remat: str = DEFAULT_REMAT,
    fp8_grads: str | None = None,
) -> Derived:
    """The backward of `block` under the saved-tensor policy `remat` (see the module docstring), its
    fp8 stages' cotangents quantized to `fp8_grads` (reverse.py, `Reverse.quantizes`) where given."""
    policies = stage_policies(block, remat)
    d = derive_with(block, plan, wrt, remat, fp8_grads=fp8_grads)
    if all(p == "save" for p in policies):
        return d
    fstage = {v.name: k for k, st in enumerate(block.stages) for e in st.body for v in e.outs}
    fdef = {v.name: e for st in block.stages for e in st.body for v in e.outs}
    made: dict[str, str] = {}
    lines: list[str] = []
    tried: set[str] = set()
    while True:
        cands = [
            r.value
            for r in d.reads
            if r.how == SAVED
            and r.name in d.saved
            and r.name == r.value  # (not an f32 copy a max's ties compare: State.read_exact)
            and r.value in fstage
            and r.value not in tried
            and policies[fstage[r.value]] != "save"
            and len(fdef[r.value].outs) == 1
            and fdef[r.value].outs[0].type is not None
            and fdef[r.value].outs[0].type.kind == TILE  # type: ignore[union-attr]
        ]
        if not cands:
            break
        name = cands[0]
        tried.add(name)
        k = fstage[name]
        where = f"`{name}` (line {fdef[name].span.line})"
        before = _held(d)
        try:
            trial = derive_with(block, plan, wrt, remat, frozenset(made) | {name}, fp8_grads)
        except AutodiffError as e:
            lines.append(f"{where} stays saved: stage {k + 1}'s backward can't recompute it ({e.message})")
            continue
        after = _held(trial)
        if name in trial.saved or not _less(after, before) or not _checks(trial):
            lines.append(
                f"{where} stays saved: recomputing it in stage {k + 1}'s backward would hold "
                f"{_text(after)} per row, not less than {_text(before)}"
            )
            continue
        made[name] = (
            f"{where} is recomputed in the epilogue that runs stage {k + 1}'s backward, from what it "
            f"reads anyway, and stored from there (elementwise, ~free), not saved: "
            f"{_text(_minus(before, after))} per row less ({_source(block, k, remat)})"
        )
        d = trial
    if not lines and not made:
        return d
    report = list(d.report) + list(made.values()) + lines
    notes = tuple(d.backward.notes) + tuple(f"note: {line}" for line in (*made.values(), *lines))
    return replace(d, backward=replace(d.backward, notes=notes), report=report)


def _source(block: Block, k: int, remat: str) -> str:
    st = block.stages[k]
    return f'remat="{st.remat}" on the stage' if st.remat is not None else f"--remat {remat}"


def _held(d: Derived) -> Bytes:
    """The bytes per row the saved tensors of `d` hold."""
    types = {p.var.name: p.var.type for p in d.backward.params}
    return row_bytes([t for n in d.saved if (t := types[n]) is not None])


def _less(a: Bytes, b: Bytes) -> bool:
    """No term of `a` is larger than `b`'s, and one is smaller."""
    keys = set(a) | set(b)
    return all(a.get(k, 0) <= b.get(k, 0) for k in keys) and any(a.get(k, 0) < b.get(k, 0) for k in keys)


def _minus(a: Bytes, b: Bytes) -> Bytes:
    return {k: a.get(k, Fraction(0)) - b.get(k, Fraction(0)) for k in set(a) | set(b)}


def _text(per: Bytes) -> str:
    """`per` written as bytes_per_row writes it (`4*D + 4 bytes`)."""
    terms = [str(Dim(c, name)) for name, c in sorted((k, v) for k, v in per.items() if k is not None) if c]
    if per.get(None):
        terms.append(str(per[None]))
    return (" + ".join(terms) or "0") + " bytes"


def _checks(d: Derived) -> bool:
    """Whether both blocks of a trial derivation pass the checker (a trial that doesn't is not taken)."""
    for b in (d.forward, d.backward):
        diags: list[Diagnostic] = []
        check_block(b, diags)
        if diags:
            return False
    return True
