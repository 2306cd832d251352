"""The saved-tensor policy: which forward values the backward reads saved and which it recomputes.

What it does: `derive(block, plan, wrt, remat)` derives the backward under the block-wide policy
`remat` ("save", "recompute", "auto", "rebuild"), each stage's own policy overriding it where the source writes
one on the stage (`gemm a @ b, remat="save" { ... }`, `elementwise [M, D], remat="rebuild" { ... }`: for
the tiles that stage stores). Three kinds of recomputation, and what each
costs:
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
  that reads it runs after that stage. Elementwise work in an epilogue that runs anyway: ~free;
- in an elementwise stage at the start of the backward (here, and prologue.py): a stored tile that
  the backward reads before its stage's backward runs (an fp8 weight copy `w_13q: e4m3 = w_13 *
  s_w_13`, the B operand of the first data-gradient GEMM that reads it) is computed again by an
  `elementwise [R, C] { ... }` stage over its own shape, the same construct as the forward's
  weight-quantizing stages, from values the backward holds anyway: the block's parameters (an input
  of the backward costs no memory), tiles that stay saved, vectors. Only where that is exact: the
  same equations as the forward's stage, in the same order, on the same f32 values, rounded once at
  the store, so the copy is bit for bit the forward's (prologue.py says what a chain may read: no
  reduction, no rounded copy of a value the forward's stage used in f32, no acc unless saved in
  f32). Its cost is one pass over its sources (a weight's: what the forward's quantizing stage costs)
  and a kernel launch, so it is tried only where the first kind is not taken, and only for a tile
  stored no wider than every matrix it is computed from (the fp8 copies of bf16 weights and
  activations, a bf16 copy of bf16 values): such a copy is redundant with its sources, and the pass
  reads at most the bytes of those sources and writes at most as many. It is not limited to fp8:
  exactness does not depend on the dtype (the stage rounds where the forward rounds), and a bf16
  copy no epilogue can host frees memory the same way; a tile wider than one of its sources (an f32
  product of bf16 tiles) is left saved: the pass would write more bytes than it reads of that
  source, and no block of coda's needs it.
Under "auto" and "recompute" a tile is recomputed by the second or third kind when that lowers the
bytes held (no term grows, one shrinks: bytes per row of the token rows, and bytes of tensors
without those rows, a weight's copy, counted apart as constants of the dims; it does not when
recomputing needs a saved acc as large as the tile itself); each candidate is tried with a
derivation, the second kind first, and kept greedily, in the order the backward first read them.
"save", and `remat="save"` on a stage for that stage's tiles, recomputes nothing. "rebuild" (on a stage:
`remat="rebuild"`) takes the second kind only: a tile is made again at the backward's start where
that is exact and lowers the bytes held, and nothing else is recomputed (for an fp8 copy whose store
in the epilogue of the first kind costs that epilogue more than the pass: the hf fp8 blocks' `x1q`,
coda_lang/torch.py, and the post-norm layers' row stages, hf/blocks.py).
What it does not: build the backward (reverse.py, site.py, prologue.py) or judge time on a device.
Invariants: with every stage's policy "save", `derive` is `derive_with(..., remat)` unchanged; a tile
recomputed in an epilogue or at the start is stored under its forward name, in its forward storage
dtype (at the start, bit for bit the forward's copy); every recomputed value and rerun stage has one
line of the report saying why, as has each candidate kept saved.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from fractions import Fraction
from functools import partial

from coda_lang.autodiff.assemble import Derived, fixed_bytes, fixed_text, itemsize, row_bytes, token_rows
from coda_lang.autodiff.builder import AutodiffError
from coda_lang.autodiff.forward import ForwardFacts
from coda_lang.autodiff.prologue import Chain, NotExact, chain
from coda_lang.autodiff.reverse import derive_with, stage_policies
from coda_lang.autodiff.state import SAVED
from coda_lang.core.diagnostics import Diagnostic
from coda_lang.frontend.verify.check import check_block
from coda_lang.frontend.verify.plan import BlockPlan
from coda_lang.ir.nodes import DEFAULT_REMAT, Block
from coda_lang.ir.types import TILE, Dim

# bytes held: per row (a dim name, None: a constant) and, for tensors without rows, in all (a monomial)
Bytes = dict[str | tuple[str, ...] | None, Fraction]


def derive(
    block: Block,
    plan: BlockPlan,
    wrt: list[str] | None = None,
    remat: str = DEFAULT_REMAT,
    fp8_grads: str | None = None,
    fp8_acc: bool = False,
    requantize_wgrad: bool = False,
) -> Derived:
    """The backward of `block` under the saved-tensor policy `remat` (see the module docstring), its
    fp8 stages' cotangents quantized to `fp8_grads` (reverse.py, `Reverse.quantizes`) where given, and
    with `fp8_acc` each stage's acc read from the fp8 copy the stage stores (`ForwardFacts.acc_copy`),
    and with `requantize_wgrad` each block-scaled weight gradient reading its activation quantized
    again in g x 1 groups (`Reverse.requantized`)."""
    policies = stage_policies(block, remat)
    d = derive_with(
        block, plan, wrt, remat, fp8_grads=fp8_grads, fp8_acc=fp8_acc, requantize_wgrad=requantize_wgrad
    )
    if all(p == "save" for p in policies):
        return d
    fwd = ForwardFacts(block, plan, wrt)
    rows = token_rows(block)
    derive_k = partial(
        derive_with,
        block,
        plan,
        wrt,
        remat,
        fp8_grads=fp8_grads,
        fp8_acc=fp8_acc,
        requantize_wgrad=requantize_wgrad,
    )
    fstage = {v.name: k for k, st in enumerate(block.stages) for e in st.body for v in e.outs}
    fdef = {v.name: e for st in block.stages for e in st.body for v in e.outs}
    made: dict[str, str] = {}  # tiles recomputed in an epilogue -> their report line
    start: dict[str, str] = {}  # tiles made again at the backward's start -> their report line
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
        before = _held(d, rows)
        source = _source(block, k, remat)

        # first kind: in the epilogue that runs stage k's backward (free); not under "rebuild"
        if policies[k] == "rebuild":
            epilogue = f"no epilogue recomputes it under rebuild ({source})"
        else:
            got, epilogue = _trial(
                derive_k,
                rows,
                before,
                name,
                frozenset(made) | {name},
                frozenset(start),
                source,
                f"stage {k + 1}'s backward can't recompute it",
                f"recomputing it in stage {k + 1}'s backward",
            )
            if got is not None:
                made[name] = (
                    f"{where} is recomputed in the epilogue that runs stage {k + 1}'s backward, from what "
                    f"it reads anyway, and stored from there (elementwise, ~free), not saved: {epilogue}"
                )
                d = got
                continue
        # second kind: an elementwise stage at the backward's start (one pass over its sources)
        why, ch = _startable(fwd, name, frozenset(made))
        if ch is not None:
            here = "an elementwise stage at the backward's start"
            got, why = _trial(
                derive_k,
                rows,
                before,
                name,
                frozenset(made),
                frozenset(start) | {name},
                source,
                f"{here} can't make it",
                here,
            )
            if got is not None:
                start[name] = (
                    f"{where} is recomputed by an elementwise stage at the backward's start from "
                    f"{ch.text()}, bit for bit as the forward stores it, not saved: {why}"
                )
                d = got
                continue
        lines.append(f"{where} stays saved: {epilogue}; {why}")
    if not lines and not made and not start:
        return d
    report = list(d.report) + list(made.values()) + list(start.values()) + lines
    notes = tuple(d.backward.notes) + tuple(
        f"note: {line}" for line in (*made.values(), *start.values(), *lines)
    )
    return replace(d, backward=replace(d.backward, notes=notes), report=report)


def _trial(
    derive_k: Callable[..., Derived],
    rows: str | None,
    before: Bytes,
    name: str,
    make: frozenset[str],
    start: frozenset[str],
    source: str,
    cant: str,
    what: str,
) -> tuple[Derived | None, str]:
    """The derivation with tiles `make` recomputed in epilogues and `start` at the backward's start,
    and the bytes it holds less than `before` (with `source`, the policy that allowed it), where it
    derives, passes the checker and no longer saves `name`; else (None, why not: `cant` with the
    error, or `what` would hold no fewer bytes)."""
    try:
        got = derive_k(make, prologue=start)
    except AutodiffError as e:
        return None, f"{cant} ({e.message})"
    after = _held(got, rows)
    if name not in got.saved and _less(after, before) and _checks(got):
        return got, f"{_text(_minus(before, after))} less ({source})"
    return None, f"{what} would hold {_text(after)}, not less than {_text(before)}"


def _startable(fwd: ForwardFacts, name: str, make: frozenset[str]) -> tuple[str, Chain | None]:
    """(why not, None), or ("", its chain) where stored tile `name` may be made again by an elementwise
    stage at the backward's start: its chain is exact (prologue.py) and it is stored no wider than any
    matrix it is computed from (see the module docstring)."""
    try:
        ch = chain(fwd, name, make)
    except NotExact as e:
        return f"nor can an elementwise stage at the backward's start compute it again bit for bit: {e}", None
    dtype = fwd.storage.get(name, fwd.plan.activation)
    wider = [(n, t) for n, t in ch.sources if itemsize(t) < itemsize(dtype)]
    if wider:
        n, t = wider[0]
        src = f"stage {ch.stage + 1}'s acc" if n == "acc" else f"`{n}`"
        return (
            f"an elementwise stage at the backward's start makes only copies no wider than their "
            f"sources, and it is {dtype}, computed from {src} ({t})"
        ), None
    return "", ch


def _source(block: Block, k: int, remat: str) -> str:
    st = block.stages[k]
    return f'remat="{st.remat}" on the stage' if st.remat is not None else f"--remat {remat}"


def _held(d: Derived, rows: str | None) -> Bytes:
    """The bytes the saved tensors of `d` hold: per row of `rows` (keys: dim names, None) and, for
    tensors without those rows (a weight's fp8 copy), in all (keys: tuples of dim names)."""
    types = {p.var.name: p.var.type for p in d.backward.params}
    saved = [t for n in d.saved if (t := types[n]) is not None]
    held: Bytes = {}
    held.update(row_bytes(saved, rows).items())
    held.update(fixed_bytes(saved, rows).items())
    return held


def _less(a: Bytes, b: Bytes) -> bool:
    """No term of `a` is larger than `b`'s, and one is smaller."""
    keys = set(a) | set(b)
    return all(a.get(k, 0) <= b.get(k, 0) for k in keys) and any(a.get(k, 0) < b.get(k, 0) for k in keys)


def _minus(a: Bytes, b: Bytes) -> Bytes:
    return {k: a.get(k, Fraction(0)) - b.get(k, Fraction(0)) for k in set(a) | set(b)}


def _text(held: Bytes) -> str:
    """`held` written as the header writes it: `4*D + 4 bytes per row`, and `2*D*F bytes` (not per
    row) for tensors without rows (`2*D*F bytes (not per row)` where that is all)."""
    per = {k: v for k, v in held.items() if not isinstance(k, tuple)}
    fixed = {k: v for k, v in held.items() if isinstance(k, tuple) and v}
    terms = [str(Dim(c, name)) for name, c in sorted((k, v) for k, v in per.items() if k is not None) if c]
    if per.get(None):
        terms.append(str(per[None]))
    text = (" + ".join(terms) or "0") + " bytes per row"
    if not fixed:
        return text
    rest = fixed_text({k: v for k, v in fixed.items() if isinstance(k, tuple)})
    return f"{rest} (not per row)" if not terms else f"{text} and {rest} not per row"


def _checks(d: Derived) -> bool:
    """Whether both blocks of a trial derivation pass the checker (a trial that doesn't is not taken)."""
    for b in (d.forward, d.backward):
        diags: list[Diagnostic] = []
        check_block(b, diags)
        if diags:
            return False
    return True
