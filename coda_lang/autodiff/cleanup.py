"""Clean-up passes over a derived backward body: common subexpressions, dead code, renaming.

What it does: `cse` merges equations computing the same op of the same operands (per stage, and
between stages), `dce` drops equations whose results nobody reads and stages left empty,
`rename` renames values (gradient outputs, cotangents named after their primal), `used_names`.
What it does not: change what is computed.
Invariants: stored (annotated) values and protected names are never merged away.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from coda_lang.ir.nodes import Atom, Eqn, Stage, Stmt, Var
from coda_lang.ops import REGISTRY


def _uses(a: Atom) -> str | None:
    return a.name if isinstance(a, Var) else None


def dce(body: list[Stmt], live_out: set[str]) -> list[Stmt]:
    """Drop equations whose results are never read, and stages left empty."""
    live = set(live_out)
    out: list[Stmt] = []
    for s in reversed(body):
        if isinstance(s, Stage):
            kept = []
            for e in reversed(s.body):
                if any(v.name in live for v in e.outs):
                    kept.append(e)
                    live.update(n for n in map(_uses, e.ins) if n)
            if kept:
                live.update(n for n in map(_uses, s.operands) if n)
                out.append(replace(s, body=tuple(reversed(kept))))
        elif any(v.name in live for v in s.outs):
            out.append(s)
            live.update(n for n in map(_uses, s.ins) if n)
    return list(reversed(out))


def _key(e: Eqn) -> tuple[Any, ...]:
    ins = tuple(("v", a.name) if isinstance(a, Var) else ("a", a) for a in e.ins)
    if REGISTRY[e.op].commutative:
        ins = tuple(sorted(ins, key=repr))
    return (e.op, ins, e.params)


def cse(body: list[Stmt], keep: set[str]) -> list[Stmt]:
    """Merge equations that compute the same op of the same operands (in one stage, or between stages);
    stored or annotated values and names in `keep` are never merged away."""
    subst: dict[str, str] = {}
    block_seen: dict[tuple[Any, ...], tuple[Var, ...]] = {}

    def fix(a: Any) -> Any:
        return Var(subst[a.name], a.type, a.annot) if isinstance(a, Var) and a.name in subst else a

    def visit(eqns: tuple[Eqn, ...] | list[Eqn], seen: dict[tuple[Any, ...], tuple[Var, ...]]) -> list[Eqn]:
        out = []
        for e in eqns:
            e = replace(e, ins=tuple(fix(a) for a in e.ins))
            k = _key(e)
            copy = REGISTRY[e.op].copy  # `y = x` names a value: never merged away, never merged into
            mergeable = all(v.annot is None and v.name not in keep for v in e.outs) and not copy
            if mergeable and k in seen:
                for v, w in zip(e.outs, seen[k], strict=True):
                    subst[v.name] = w.name
                continue
            if not copy:
                seen.setdefault(k, e.outs)
            out.append(e)
        return out

    result: list[Stmt] = []
    for s in body:
        if isinstance(s, Stage):
            local = dict(block_seen)  # block-level values are visible in the stage
            result.append(replace(s.map_operands(fix), body=tuple(visit(s.body, local))))
        else:
            result.extend(visit([s], block_seen))
    return result


def used_names(body: list[Stmt]) -> set[str]:
    used: set[str] = set()
    for s in body:
        eqns = s.body if isinstance(s, Stage) else (s,)
        if isinstance(s, Stage):
            used.update(n for n in map(_uses, s.operands) if n)
        for e in eqns:
            used.update(n for n in map(_uses, e.ins) if n)
    return used


def rename(body: list[Stmt], names: dict[str, str]) -> list[Stmt]:
    if not names:
        return body

    def atom(a: Any) -> Any:
        return Var(names.get(a.name, a.name), a.type, a.annot) if isinstance(a, Var) else a

    def eqn(e: Eqn) -> Eqn:
        outs = tuple(Var(names[v.name], v.type, None) if v.name in names else v for v in e.outs)
        return replace(e, ins=tuple(atom(a) for a in e.ins), outs=outs)

    out: list[Stmt] = []
    for s in body:
        if isinstance(s, Stage):
            out.append(replace(s.map_operands(atom), body=tuple(eqn(e) for e in s.body)))
        else:
            out.append(eqn(s))
    return out
