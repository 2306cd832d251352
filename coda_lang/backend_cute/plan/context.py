"""What every planning job reads: one GEMM stage of a checked block, and the Python names of its values.

What it does: `StageContext` is the stage as the planner's jobs (planner.py, sinks.py, operands.py,
refusals.py) see it: the block's IR and plan, the stage and its StagePlan, the rows and cols of its
tile, each value's type and defining equation, and whether the plan is for the torch stand-ins
(`emulated`). It also names the stage's values in Python (`py`; `fresh` for names that are no coda
value), and `live_eqns` gives the equations a set of values depends on. The stage is read without
`detach` (`without_detach`): the identity in a kernel, it only tells autodiff where gradients stop.
The emitted module is named by the stage's meaning, not by where it stands: the function by its
GEMM's operands (`epi_y_w_o`), numbered temporaries (`_t77`, the lowering's and autodiff's)
renumbered `_t1`, `_t2`, ... in the order the stage first reads or writes them (`temps`), so that a
stage whose text two blocks share (a Llama layer's MLP and the last layer's; their backwards) emits
one module, hence one kernel per tile in the cache.
What it does not: choose a port, a mode or a record (planner.py, sinks.py, operands.py) or refuse
anything (refusals.py).
Invariants: the naming tables (`names`, `used`) are a context's only changing state: a value's Python
name is fixed when first asked for, no two values share one, and names are given in the order the
planner asks (the emitted source is a golden file, so planning stays deterministic); nothing of the
block's name, the stage's index or the block's temporary numbering reaches a Python name.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass, field, replace

from coda_lang.backend_cute.plan.names import helper_names
from coda_lang.backend_cute.plan.spec import DIM_PREFIX, QUACK_RESERVED
from coda_lang.frontend.verify.plan import BlockPlan, StagePlan
from coda_lang.ir.nodes import Block, Eqn, Stage, Var
from coda_lang.ir.types import Dim, Type
from coda_lang.ops import REGISTRY


@dataclass(frozen=True)
class StageContext:
    """Stage `index` (1-based) of the checked block `ir`, as planning reads it."""

    ir: Block
    bplan: BlockPlan
    index: int
    st: Stage
    sp: StagePlan
    emulated: bool  # for the torch stand-ins only (which also multiply f32 operands)
    fn_name: str  # the emitted epilogue's function name
    types: dict[str, Type] = field(default_factory=dict)  # each typed value of the stage
    defined: dict[str, Eqn] = field(default_factory=dict)  # each value of the stage -> its equation
    names: dict[str, str] = field(default_factory=dict)  # coda name -> Python name, as given so far
    used: set[str] = field(default_factory=set)  # Python names taken
    temps: dict[str, str] = field(default_factory=dict)  # numbered temporary -> its name in the stage

    @property
    def rows(self) -> Dim:
        return self.sp.rows

    @property
    def cols(self) -> Dim:
        return self.sp.cols

    def py(self, name: str) -> str:
        """The Python name of a coda value (renamed when it would clash with a helper or keyword)."""
        if name in self.names:
            return self.names[name]
        # (a leading underscore, as autodiff's temporaries have, is no name quack takes for an operand
        # or sink: they become fields of its argument dataclasses)
        base = (
            name
            if name == "acc"
            else (
                f"dim_{name[1:]}"
                if name.startswith(DIM_PREFIX)
                else f"v{self.temps.get(name, name)}"
                if name.startswith("_")
                else f"v_{name}"
                if name in helper_names() | QUACK_RESERVED or keyword.iskeyword(name) or name == self.fn_name
                else name
            )
        )
        out = base
        while out in self.used and name != "acc":
            out += "_"
        self.used.add(out)
        self.names[name] = out
        return out

    def fresh(self, base: str) -> str:
        """A Python name no value uses (for names that are not coda values: a group's writer)."""
        out = base
        while out in self.used or out in helper_names() | QUACK_RESERVED or keyword.iskeyword(out):
            out += "_"
        self.used.add(out)
        return out


TEMP = re.compile(r"_t\d+")  # the numbered temporaries of the lowering and of autodiff


def stage_temps(st: Stage) -> dict[str, str]:
    """The stage's numbered temporaries renamed `_t1`, `_t2`, ... in the order the stage first uses
    them (its GEMM's operands, then each equation's inputs and outputs)."""
    seen: dict[str, str] = {}
    atoms = [st.a, st.b, *(a for e in st.body for a in (*e.ins, *e.outs))]
    for a in atoms:
        if isinstance(a, Var) and TEMP.fullmatch(a.name) and a.name not in seen:
            seen[a.name] = f"_t{len(seen) + 1}"
    return seen


def without_detach(st: Stage) -> Stage:
    """The stage as a kernel runs it: `detach` is the identity there (it only tells autodiff that no
    gradient flows). `y = detach(x)` of a value x the stage makes and reads nowhere else names x's
    equation y (a grouped reduction stored as `amax = detach(max(..., group=128))` stays the stored
    reduction); any other is the copy `y = x`. One at a time, so that detach(detach(x)) is one value."""
    body = list(st.body)
    while (i := next((i for i, e in enumerate(body) if REGISTRY[e.op].stops_gradient), None)) is not None:
        e = body[i]
        (x,), (y,) = e.ins, e.outs
        name = x.name if isinstance(x, Var) else None  # (detach of a literal: a copy)
        j = next((j for j, f in enumerate(body) if any(v.name == name for v in f.outs)), None)
        reads = sum(isinstance(a, Var) and a.name == name for f in body for a in f.ins)
        if j is not None and reads == 1 and len(body[j].outs) == 1:
            body[j] = replace(body[j], outs=(y,))
            del body[i]
        else:
            body[i] = replace(e, op=next(name for name, op in REGISTRY.items() if op.copy))
    return st if body == list(st.body) else replace(st, body=tuple(body))


def stage_context(ir: Block, bplan: BlockPlan, index: int, emulated: bool) -> StageContext:
    """The context of stage `index` (1-based, a GEMM stage) of the checked block `ir`."""
    original = ir.stages[index - 1]
    st = without_detach(original)
    if st is not original:  # (the block as the planner reads it: the stage is found by identity)
        ir = replace(ir, body=tuple(st if b is original else b for b in ir.body))
    temps = stage_temps(st)
    operands = [temps.get(x.name, x.name) if isinstance(x, Var) else "x" for x in (st.a, st.b)]
    fn_name = "epi_" + "_".join(operands)  # (the GEMM's, not the block's: see the module docstring)
    ctx = StageContext(
        ir=ir,
        bplan=bplan,
        index=index,
        st=st,
        sp=bplan.stages[index - 1],
        emulated=emulated,
        fn_name=fn_name,
        used={"acc", fn_name, f"{fn_name}_prepass"},
        temps=temps,
    )
    for e in st.body:
        for v in e.outs:
            if v.type is not None:
                ctx.types[v.name] = v.type
            ctx.defined[v.name] = e
    return ctx


def live_eqns(ctx: StageContext, needed: set[str]) -> list[Eqn]:
    """The equations the stored tiles and sinks depend on, in order (reductions are sinks)."""
    want = set(needed)
    keep: list[Eqn] = []
    for e in reversed(ctx.st.body):
        if REGISTRY[e.op].reduces or not {v.name for v in e.outs} & want:
            continue
        keep.append(e)
        want |= {a.name for a in e.ins if isinstance(a, Var)}
    return keep[::-1]
