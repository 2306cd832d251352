"""Saved tiles made again by an elementwise stage at the start of the backward (policy.py chooses them).

What it does: `chain(fwd, name, make)` finds the forward equations that compute stored tile `name`
(of forward stage k) from values the backward holds anyway (`Chain`), or says, as a `NotExact`, why
the backward can't compute it again bit for bit; `build(s, names, make)` emits, at the point of the
backward body being built (the start: reverse.py calls it first), elementwise stages that compute
those tiles again and store them under their forward names, in the dtype the forward stores them in.
Tiles of one shape share a stage (one pass) unless one of them reads another.
What it does not: decide which tiles are made this way (policy.py does, by the bytes held), or make
a tile in an epilogue the backward runs anyway (site.py: the first kind of recomputation).
Invariants: a chain is exact: the same ops in the same order on the same f32 values as the forward's
stage computes, rounded once, at the store, so the copy is bit for bit the forward's. So it reads
only what holds exactly the value the forward's stage read:
- parameters of the block (the backward takes them as inputs);
- tiles of other stages, loaded as stored (the forward's stage loaded the same rounded values), and
  vectors and scalars of other stages or between stages (complete, read or recomputed as any block
  level value is);
- inside stage k, elementwise (pointwise) equations only, computed again; a tile stage k also stores
  (`x1: bf16 = acc + x`) is such an equation, since stage k's own uses see its f32 value, not the
  rounded store; except `cast(v, D)` of a tile v stored in D, which is exactly v's stored value;
- stage k's acc only where the forward saves it in f32 (a bf16 copy is not the f32 value).
Nothing else: no reduction over the stage's rows or columns, no pair op, no index, no acc rounded.
"""

from __future__ import annotations

from dataclasses import dataclass

from coda_lang.autodiff.builder import AutodiffError
from coda_lang.autodiff.forward import ForwardFacts
from coda_lang.autodiff.state import State
from coda_lang.ir.nodes import Atom, Eqn, Stage, Var
from coda_lang.ir.types import MATRIX, SCALAR, TILE, VEC
from coda_lang.ops import REGISTRY, Locality, StageShape


class NotExact(Exception):
    """Why a stored tile can't be computed again bit for bit from what the backward holds."""


@dataclass(frozen=True)
class Chain:
    """How the backward computes stored tile `name` of forward stage `stage` again."""

    name: str
    stage: int
    eqns: tuple[Eqn, ...]  # stage `stage`'s equations to emit again, in the forward's order
    # what the chain reads, by forward name: "param", "saved" (a stored tile, loaded), "acc" (stage
    # `stage`'s acc, saved in f32), "vector" (a vector or scalar read at block level)
    reads: dict[str, str]
    loads: dict[str, str]  # the output of a `cast(v, D)` of a tile v stored in D -> v (its stored copy)
    sources: tuple[tuple[str, str], ...]  # (matrix read, its dtype): what the tile is computed from

    def text(self) -> str:
        """What the chain reads, as the report names it (`w_13`, `s_w_13`)."""
        names = [n if n != "acc" else f"stage {self.stage + 1}'s f32 acc" for n in self.reads]
        return ", ".join(f"`{n}`" if not n.startswith("stage ") else n for n in names)


def chain(fwd: ForwardFacts, name: str, make: frozenset[str] = frozenset()) -> Chain:
    """How stored tile `name` is computed again from what the backward holds (`make`: tiles a stage's
    backward stores later, which the start of the backward does not have yet); NotExact if it can't be
    (see the module docstring). Walked with a stack of its own (a chain as deep as the program's)."""
    k = fwd.fstage[name]
    shape = fwd.ftype[name].shape
    eqns: dict[str, Eqn] = {}
    reads: dict[str, str] = {}
    loads: dict[str, str] = {}
    sources: list[tuple[str, str]] = []
    vectors = fwd.stage_vectors(k)
    parent: dict[str, str] = {}

    def why(v: str, text: str) -> NotExact:
        path = []  # the stored tiles of stage k on the way: their f32 values are what the stage used
        p = parent.get(v)
        while p is not None and p != name:
            if p in fwd.storage:
                path.append(p)
            p = parent.get(p)
        through = ""
        if path:
            p = path[-1]
            through = (
                f" (through `{p}`: stage {k + 1}'s uses see its f32 value; the backward holds only "
                f"its {fwd.storage[p]} store)"
            )
        return NotExact(text + through)

    def source(n: str, dtype: str) -> None:
        if (n, dtype) not in sources:
            sources.append((n, dtype))

    todo = [name]
    seen: set[str] = set()
    order: list[str] = []
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        if v == "acc":
            if fwd.acc_dtype(k) != "f32":
                raise why(v, f"it needs stage {k + 1}'s acc in f32, which the backward does not have")
            reads["acc"] = "acc"
            source("acc", "f32")
            continue
        if v in fwd.params:
            t = fwd.ftype[v]
            reads[v] = "param"
            if t.kind == MATRIX:
                source(v, t.dtype)
            continue
        t = fwd.ftype[v]
        if fwd.fstage.get(v) != k or v in vectors:
            after = fwd.after_type(v)
            if after.kind == MATRIX:
                if v in make:
                    raise why(v, f"it reads `{v}`, which its stage's backward would store only later")
                reads[v] = "saved"
                source(v, after.dtype)
            elif after.kind in (VEC, SCALAR):
                reads[v] = "vector"
            else:
                raise why(v, f"it reads `{v}`, a {after.kind} the backward does not hold")
            continue
        e = fwd.fdef[v]
        op = REGISTRY[e.op]
        if len(e.outs) != 1 or op.locality is not Locality.POINTWISE:
            raise why(v, f"`{v}` is made by {e.op}, which is not elementwise")
        if t.kind == TILE and t.shape != shape:
            raise why(v, f"`{v}` is a tile of another shape than `{name}`'s")
        x = e.ins[0] if e.ins else None
        if (
            op.rounds
            and v != name
            and isinstance(x, Var)
            and fwd.fstage.get(x.name) == k
            and fwd.storage.get(x.name) == e.param("dtype")
        ):
            if x.name in make:
                raise why(v, f"it reads `{x.name}`, which its stage's backward would store only later")
            loads[v] = x.name  # exactly x as stored: read the stored copy
            reads[x.name] = "saved"
            source(x.name, fwd.storage[x.name])
            order.append(v)
            eqns[v] = e
            continue
        eqns[v] = e
        order.append(v)
        for a in reversed(e.ins):
            if isinstance(a, Var) and a.name not in seen:
                parent.setdefault(a.name, v)
                todo.append(a.name)
    body = tuple(sorted(eqns.values(), key=lambda e: _position(fwd, k, e)))
    return Chain(name, k, body, reads, loads, tuple(sources))


def _position(fwd: ForwardFacts, k: int, e: Eqn) -> int:
    return next(i for i, x in enumerate(fwd.block.stages[k].body) if x is e)


def build(s: State, names: list[str], make: frozenset[str] = frozenset()) -> list[Chain]:
    """Elementwise stages, emitted at this point of the backward body, that compute the stored tiles
    `names` again (each as `chain` says) and store them under their forward names, in their forward
    storage dtype (`State.made`: reads of them read these); AutodiffError (E0602) where one can't be.
    The tiles of one shape share a stage, unless one reads another (it reads the stored copy, made
    by an earlier stage)."""
    fwd = s.fwd
    chains = []
    for n in sorted(names, key=list(fwd.fdef).index):
        try:
            chains.append(chain(fwd, n, make))
        except NotExact as e:
            raise AutodiffError("E0602", f"`{n}` can't be made again at the backward's start: {e}") from e
    groups: list[list[Chain]] = []
    for c in chains:  # (in the forward's order: a tile read by another one is in an earlier stage)
        shape = fwd.ftype[c.name].shape
        g = next((g for g in reversed(groups) if fwd.ftype[g[0].name].shape == shape), None)
        if g is None or any(x.name in c.reads for x in g):
            groups.append([c])
        else:
            g.append(c)
    for g in groups:
        _stage(s, g)
    return chains


def _stage(s: State, group: list[Chain]) -> None:
    fwd = s.fwd
    rows, cols = fwd.ftype[group[0].name].shape
    with s.between_stages():  # vectors and scalars: read (or recomputed) at block level, before
        vecs = {n: s.read_between(Var(n)) for c in group for n, how in c.reads.items() if how == "vector"}
    s.open_stage(StageShape(rows, cols), acc=False)
    env: dict[str, Atom] = dict(vecs)
    for c in group:
        env.pop("acc", None)  # (each chain's own stage's)
        for n, how in c.reads.items():
            if n in env:
                continue
            if how == "param":
                env[n] = s.read_param(n)
            elif how == "saved":
                env[n] = s.read_saved(n)
            elif how == "acc":
                env[n] = s.read_acc(c.stage)  # saved in f32: the forward's acc, bit for bit
        for e in c.eqns:
            v = e.outs[0].name
            if v in env and v != c.name:
                continue
            if v in c.loads:
                env[v] = env[c.loads[v]]
                continue
            ins = [env[a.name] if isinstance(a, Var) else a for a in e.ins]
            store = fwd.storage.get(v, fwd.plan.activation) if v == c.name else None
            (env[v],) = s.recompute(e, ins, c.stage, store)
    before, body = s.close_stage()
    s.emit(before)
    span = fwd.block.stages[group[0].stage].span
    s.emit([Stage(None, None, False, False, None, tuple(body), (rows, cols), span=span)])
