"""Per-op programs: tiny programs that use one registry op, every way its type rule allows.

What it does: `op_programs(op)` makes programs using `op` inside a stage on tiles (with every kind of
operand its type rule accepts: acc, tile loads, half tiles, row and column vectors, a vector over the
fixed dim G that repeats across the columns, scalars, literals, conditions, indices), as a stage whose
backward runs in the dgrad epilogue of a consumer GEMM, and between stages on vectors where its type
rule allows. `OpProgram.inputs` draws inputs for one.
What it does not: check or run anything (tests/test_autodiff.py does).
Invariants: every program made here passes the checker (the op's own type rule decides what is
made); operands in a positive position (`positive_args`) get positive values.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import coda_lang
from coda_lang.ir.types import BOOL, FLOAT_DTYPES, GROUP, PARTIAL, SCALAR, TILE, VEC, Dim, Type, is_float
from coda_lang.ops import Ctx, OpDef, StageShape
from coda_lang.testing.inputs import gradcheck_inputs
from coda_lang.testing.rules import op_source, param_decl, positive_args, try_rule

# G: a dim of fixed size (declared `G = 3` by every program): a vector over it repeats across the
# columns of a tile (2*F and F are multiples of 3); M too is a multiple, for fold(.., into=G) of a row sum
OP_SIZES = {"M": 9, "K": 5, "F": 6, "G": 3}
_M, _F, _F2, _G = Dim.sym("M"), Dim.sym("F"), Dim.sym("F", 2), Dim.sym("G")
_FIXED = {"G": OP_SIZES["G"]}
_PARAMS = {  # the parameters a per-op program may read, and their declarations
    "x": "f32[M, K]",
    "w": "f32[K, 2*F]",
    "t": "f32[M, 2*F]",
    "th": "f32[M, F]",
    "rv": "f32[M]",
    "cv": "f32[2*F]",
    "ch": "f32[F]",
    "cg": "f32[G]",
    "s": "f32",
    "idx": "i32[M]",
}


@dataclass(frozen=True)
class Cand:
    """A candidate operand: how it is written, its type, lines that define it, parameters it reads."""

    key: str
    src: str
    type: Type
    setup: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    pos_src: str | None = None  # a positive variant (e.g. of acc)
    pos_setup: tuple[str, ...] = ()


def _tile(*shape: Dim, dtype: str = "f32") -> Type:
    return Type(dtype, tuple(shape), TILE)


STAGE_CANDS = [
    Cand("acc", "acc", _tile(_M, _F2), pos_src="ap", pos_setup=("ap = acc * acc + 0.5",)),
    Cand("t", "t", _tile(_M, _F2), params=("t",)),
    Cand("th", "th", _tile(_M, _F), params=("th",)),
    Cand("rv", "rv", Type("f32", (_M,), VEC), params=("rv",)),
    Cand("cv", "cv", Type("f32", (_F2,), VEC), params=("cv",)),
    Cand("ch", "ch", Type("f32", (_F,), VEC), params=("ch",)),
    Cand("cg", "cg", Type("f32", (_G,), VEC), params=("cg",)),
    Cand("s", "s", Type("f32"), params=("s",)),
    Cand("lit", "0.75", Type("f32")),
    Cand("idx", "idx", Type("i32", (_M,), VEC), params=("idx",)),
    Cand("cond", "c", _tile(_M, _F2, dtype=BOOL), setup=("c = acc > t",), params=("t",)),
    Cand("condr", "cr", Type(BOOL, (_M,), VEC), setup=("cr = rv > 0.25",), params=("rv",)),
]
BETWEEN_CANDS = [  # pn, pv: row sums made by the stage before; cb: a condition between stages
    Cand("pn", "pn", Type("f32", (_M,), VEC), pos_src="pv"),
    Cand("rv", "rv", Type("f32", (_M,), VEC), params=("rv",)),
    Cand("cg", "cg", Type("f32", (_G,), VEC), params=("cg",)),
    Cand("s", "s", Type("f32"), params=("s",)),
    Cand("lit", "0.75", Type("f32")),
    Cand("condb", "cb", Type(BOOL, (_M,), VEC), setup=("cb = pn > rv",), params=("rv",)),
]


@dataclass
class OpProgram:
    label: str
    text: str
    positive: frozenset[str]  # parameters whose inputs must be positive
    sizes: dict[str, int] = field(default_factory=lambda: dict(OP_SIZES))

    def inputs(self, block: coda_lang.Block, rng: np.random.Generator) -> dict[str, np.ndarray]:
        return gradcheck_inputs(block, self.sizes, {"idx": OP_SIZES["F"]}, rng, positive=self.positive)


def _param_choices(op: OpDef, types: tuple[Type, ...], where: str) -> list[dict[str, Any]]:
    per_spec: list[list[tuple[str, Any]]] = []
    for spec in op.params:
        if spec.kind == "dim":
            values: list[Any] = [_M, _G] if where == "between" else [_M, _F2, _F, _G]
        elif spec.kind == "int":
            values = [2]
        elif spec.kind == "choice":
            values = list(spec.choices)
        else:
            values = list(FLOAT_DTYPES)
        if not spec.required:
            values = [None] + values
        per_spec.append([(spec.name, v) for v in values])
    return [dict(c) for c in itertools.product(*per_spec)]


def _combos(
    op: OpDef, cands: list[Cand], where: str
) -> list[tuple[tuple[Cand, ...], dict[str, Any], tuple[Type, ...]]]:
    """Operand and parameter choices the op's type rule accepts, covering each candidate at each
    position and each parameter value at least once (greedy), floats out only."""
    stage = StageShape(_M, _F2) if where == "stage" else None
    ctx = Ctx(stage, {}, dict(_FIXED))
    seen: set[tuple[Any, ...]] = set()
    out = []
    positive = positive_args(op)
    for ins in itertools.product(cands, repeat=op.nin):
        if any(is_float(c.type.dtype) is False and i in positive for i, c in enumerate(ins)):
            continue  # e.g. log(idx): an index may be -1
        for params in _param_choices(op, tuple(c.type for c in ins), where):
            outs = try_rule(op, ctx, tuple(c.type for c in ins), params)
            if outs is None or not all(is_float(t.dtype) for t in outs):
                continue
            if any(t.kind == GROUP and t.group_axis == 0 for t in outs):
                continue  # groups of rows: no backward yet (E0602)
            if where == "between" and any(t.kind not in (VEC, SCALAR) for t in outs):
                continue
            keys: set[tuple[Any, ...]] = {(i, c.key) for i, c in enumerate(ins)}
            keys |= {("p", k, str(v)) for k, v in params.items()}
            keys |= {("out", tuple((t.kind, t.shape) for t in outs))}
            if keys - seen:
                seen |= keys
                out.append((ins, params, outs))
    return out


def _program(name: str, params: list[str], outs: list[tuple[str, str]], body: list[str]) -> str:
    sig = ", ".join(f"{p}: {_PARAMS.get(p, 'f32[2*F, K]' if p == 'w2' else 'f32[F, K]')}" for p in params)
    out_sig = ", ".join(f"{n}: {d}" for n, d in outs)
    lines = "\n".join(f"  {ln}" for ln in body)
    return f"dims M, K, F, G = {_FIXED['G']}\n\nblock {name}({sig}) -> ({out_sig}) {{\n{lines}\n}}\n"


def op_programs(op: OpDef) -> list[OpProgram]:
    """Programs using `op` in a stage (entry and hosted) and between stages, as its type rule allows."""
    name = f"op_{op.name}"
    positive = positive_args(op)
    progs: list[OpProgram] = []
    for where, cands in (("stage", STAGE_CANDS), ("between", BETWEEN_CANDS)):
        for ins, params, outs in _combos(op, cands, where):
            setup: list[str] = []
            used = ["x", "w"]
            pos_params: set[str] = set()
            args = []
            for i, c in enumerate(ins):
                pos = i in positive
                src, lines = (c.pos_src, c.pos_setup) if pos and c.pos_src else (c.src, c.setup)
                args.append(src)
                setup += [ln for ln in lines if ln not in setup]
                used += [p for p in c.params if p not in used]
                if pos:
                    pos_params.update(c.params)
            ys = [f"y{k + 1}" for k in range(len(outs))]
            eqn = f"{', '.join(ys)} = {op_source(op, args, params)}"
            label = f"{name}: {eqn} ({where})"
            if where == "stage":
                hosted = sum(1 for p in progs if "(stage, " in p.label) < 3
                progs += _stage_programs(
                    name, label, used, setup, eqn, ys, outs, frozenset(pos_params), hosted
                )
            else:
                body = ["gemm x @ w {", "  pn = sum(acc, over=2*F)", "  pv = sum(acc * acc, over=2*F)", "}"]
                body += setup + [eqn]
                out_decl = [
                    (y, param_decl(t.with_kind(VEC if t.shape else SCALAR)))
                    for y, t in zip(ys, outs, strict=True)
                ]
                body += ["gemm x @ w {", f"  o = acc * {ys[0]}", "}"]
                out_decl.append(("o", "f32[M, 2*F]"))
                text = _program(name, used, out_decl, body)
                progs.append(OpProgram(label, text, frozenset(pos_params)))
    return progs


def _stage_programs(
    name: str,
    label: str,
    used: list[str],
    setup: list[str],
    eqn: str,
    ys: list[str],
    outs: tuple[Type, ...],
    positive: frozenset[str],
    hosted: bool,
) -> list[OpProgram]:
    """The op in a stage: its results as outputs (the backward's entry stage), and, for the first
    few, consumed by a second GEMM (the backward runs in that GEMM's dgrad epilogue)."""
    body = ["gemm x @ w {"] + [f"  {ln}" for ln in setup] + [f"  {eqn}"]
    out_decl: list[tuple[str, str]] = []
    for y, t in zip(ys, outs, strict=True):
        if t.kind in (VEC, SCALAR):  # a stage-local vector: used on a tile here
            half = t.shape == (_F,)
            body.append(f"  u{y} = {'th' if half else 'acc'} * {y}")
            out_decl.append((f"u{y}", "f32[M, F]" if half else "f32[M, 2*F]"))
            if half and "th" not in used:
                used = used + ["th"]
        elif t.kind == PARTIAL:
            out_decl.append((y, param_decl(t)))
        elif t.kind == GROUP:  # a grouped value broadcast back over its columns in its own stage
            assert t.group is not None
            full = t.shape[1].scale(t.group) == _F2
            body.append(f"  g{y} = {'acc' if full else 'th'} * {y}")
            out_decl.append((f"g{y}", "f32[M, 2*F]" if full else "f32[M, F]"))
            if full:  # stored too: its cotangent, one column per group, is a half-width tile
                out_decl.append((y, "f32[M, F]"))
            if not full and "th" not in used:
                used = used + ["th"]
        else:
            out_decl.append((y, param_decl(t)))
    progs = [OpProgram(label, _program(name, used, out_decl, body + ["}"]), positive)]
    first = outs[0]
    if hosted and first.kind == TILE and len(first.shape) == 2 and first.shape[1] in (_F, _F2):
        w2 = "w2" if first.shape[1] == _F2 else "w1"
        body2 = body + ["}", f"gemm {ys[0]} @ {w2} {{", "  o = acc", "}"]
        decl = [("o", "f32[M, K]")] + out_decl[1:]
        progs.append(
            OpProgram(
                label.replace("(stage)", "(stage, hosted by a dgrad GEMM)"),
                _program(name, used + [w2], decl, body2),
                positive,
            )
        )
    elif hosted and first.kind == PARTIAL and first.shape in ((_M,), (_F2,)):
        body2 = body + ["}", "gemm x @ w {", f"  o = acc * {ys[0]}", "}"]
        progs.append(
            OpProgram(
                label.replace("(stage)", "(stage, used by a later stage)"),
                _program(name, used, out_decl + [("o", "f32[M, 2*F]")], body2),
                positive,
            )
        )
    return progs
