"""The op registry: every op has the rules it needs, names resolve unambiguously, type rules behave.

- A table of which rules each op has (type rule, locality, NumPy impl, VJP, CuTeDSL and torch
  lowerings). A type rule and a locality class are required now; for impl, vjp and the lowerings the
  set of ops that lack one is written out below and must match exactly, so filling a rule in means
  updating this test (and an op registered without one shows up here).
- The facts an OpDef declares fit its locality (an index axis exactly for INDEX ops, a lane role
  exactly for PAIR ops, a bound rule of its kind).
- A surface name with a number of operands and a set of keyword arguments means at most one op, and
  each op is reachable from the syntax.
- Every type rule, given well-formed operands of every kind (scalar, vector, tile, grouped value
  inside a stage; scalar, vector, matrix between stages), returns types or raises `Mistake`, and
  nothing else.
"""

from __future__ import annotations

import itertools
from fractions import Fraction
from typing import Any

import pytest

from coda_lang.core.diagnostics import CODES, Mistake
from coda_lang.ir.types import BOOL, DTYPES, ERROR_TYPE, GROUP, MATRIX, SCALAR, TILE, VEC, Dim, Type
from coda_lang.ops import (
    BY_SURFACE,
    REGISTRY,
    BoundRule,
    Ctx,
    Lanes,
    Locality,
    OpDef,
    Role,
    StageShape,
    resolve,
)

RULES = ("type_rule", "locality", "impl", "vjp", "lower.cute", "lower.torch")
REQUIRED = ("type_rule", "locality")

# Ops that lack each optional rule today. Later issues fill these in: shrink the sets as they do.
EXPECTED_MISSING: dict[str, frozenset[str]] = {
    "impl": frozenset(),  # the interpreter issue
    "vjp": frozenset(
        {"col_index", "detach", "eq", "ge", "gt", "le", "lt", "ne", "row_index"}
    ),  # not differentiable
    # the executors know where their tile sits; fold runs between stages only (no epilogue)
    "lower.cute": frozenset({"col_index", "fold", "row_index"}),
    "lower.torch": frozenset(
        {"col_index", "row_index", "pick"}
    ),  # as emit; pick is a sink (or a gather) of its own
}


def _rule(op: OpDef, rule: str) -> object:
    """The OpDef's field `rule` ("lower.cute": a field of its lowerings)."""
    obj: object = op
    for part in rule.split("."):
        obj = getattr(obj, part)
    return obj


def rule_table() -> str:
    names = sorted(REGISTRY)
    width = max(len(n) for n in names)
    lines = [f"{'op'.ljust(width)}  " + "  ".join(r.ljust(11) for r in RULES)]
    for n in names:
        op = REGISTRY[n]
        lines.append(
            f"{n.ljust(width)}  "
            + "  ".join(("yes" if _rule(op, r) is not None else "-").ljust(11) for r in RULES)
        )
    return "\n".join(lines)


def missing(rule: str) -> set[str]:
    return {n for n, op in REGISTRY.items() if _rule(op, rule) is None}


def test_rule_table() -> None:
    """The table has one row per op, and each cell says what the OpDef holds; the rules fit together:
    a differentiable op has a VJP, a non-differentiable one none, a reduction (or pick) a combine
    record whose folds agree with its NumPy impl, and the emitter's imports are pairs of a name and
    an import line that provides it."""
    import numpy as np

    table = rule_table().split("\n")
    assert len(table) == len(REGISTRY) + 1
    for line in table[1:]:
        name, *cells = line.split()
        op = REGISTRY[name]
        assert cells == ["yes" if _rule(op, r) is not None else "-" for r in RULES], name
        assert (op.vjp is not None) == op.differentiable, name
        assert (op.combine is not None) == op.reduces, name
        for ident, line_ in op.lower.cute_imports:
            assert (
                ident.isidentifier() and line_.split()[-1] == ident and line_.startswith(("from ", "import "))
            ), name
    x = np.random.default_rng(0).standard_normal((5, 7))
    for name, op in REGISTRY.items():
        if op.locality is Locality.REDUCE:
            assert op.combine is not None and op.impl is not None
            for axis in (0, 1):  # a whole tile's reduction is the fold of per-tile partials
                parts = (
                    np.stack([op.impl(x[:, :3], axis), op.impl(x[:, 3:], axis)], axis)
                    if axis == 1
                    else np.stack([op.impl(x[:2], axis), op.impl(x[2:], axis)], axis)
                )
                np.testing.assert_allclose(
                    op.combine.numpy(parts, axis), op.impl(x, axis), rtol=1e-12, err_msg=name
                )


@pytest.mark.parametrize("rule", REQUIRED)
def test_required_rules(rule: str) -> None:
    assert missing(rule) == set(), f"ops without a {rule}:\n{rule_table()}"


def test_locality_classes_are_known() -> None:
    assert {n: op.locality for n, op in REGISTRY.items() if not isinstance(op.locality, Locality)} == {}


# the bound rules an op of each locality may follow (interp/bound.py's dispatch)
_PER_ELEMENT_RULES = set(BoundRule) - {BoundRule.REDUCE, BoundRule.GATHER, BoundRule.FOLD}
BOUND_RULES = {
    Locality.POINTWISE: _PER_ELEMENT_RULES - {BoundRule.MOVE},
    Locality.PAIR: {BoundRule.MOVE},
    Locality.REDUCE: {BoundRule.REDUCE},
    Locality.GATHER: {BoundRule.GATHER},
    Locality.INDEX: {BoundRule.EXACT},
    Locality.VECTOR: {BoundRule.FOLD},
}


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_the_facts_of_an_op_fit_its_locality(name: str) -> None:
    """What an OpDef declares beyond its rules agrees with its locality and arity: a lane role for
    exactly the PAIR ops (a split of one operand, a join of two), an index axis for exactly the INDEX
    ops, a bound rule its locality's executors implement, a role per operand (an index or a shape
    operand beside a value operand), `ties` only for reductions, a comparison non-differentiable."""
    op = REGISTRY[name]
    assert op.bound_rule in BOUND_RULES[op.locality], (name, op.locality, op.bound_rule)
    assert (op.lanes is not None) == (op.locality is Locality.PAIR)
    if op.lanes is not None:
        assert op.nin == (1 if op.lanes is Lanes.SPLIT else 2)
        assert op.nout == (2 if op.lanes is Lanes.SPLIT else 1)
    assert (op.index_axis is not None) == (op.locality is Locality.INDEX)
    assert op.index_axis in (None, 0, 1)
    assert len(op.roles) in (0, op.nin)
    if Role.INDEX in op.roles or Role.SHAPE in op.roles:  # an index into, or the shape for, operand 0
        assert op.role(0) is Role.VALUE
    assert not op.ties or op.locality is Locality.REDUCE
    assert not op.compares or not op.differentiable
    assert not (op.copy and op.rounds)
    assert len(op.operand_names) in (0, op.nin)


@pytest.mark.parametrize("rule", sorted(EXPECTED_MISSING))
def test_optional_rules_match_the_expected_sets(rule: str) -> None:
    lack = missing(rule)
    expected = set(EXPECTED_MISSING[rule])
    filled = expected - lack
    unexpected = lack - expected
    assert not filled, f"now have a {rule} (remove them from EXPECTED_MISSING[{rule!r}]): {sorted(filled)}"
    assert not unexpected, f"lack a {rule}: {sorted(unexpected)}\n{rule_table()}"


# ----------------------------------------------------------------------------------------------
# Names

INFIX = {
    "+",
    "-",
    "*",
    "/",
    "neg",
    "=",
    "<",
    "<=",
    ">",
    ">=",
    "==",
    "!=",
}  # what frontend/syntax/grammar.lark can write
KEYWORDS = {"dims", "block", "gemm", "elementwise", "transpose", "acc"}


def test_every_op_is_reachable_from_the_syntax() -> None:
    for name, op in REGISTRY.items():
        if op.infix:
            assert op.infix in INFIX, f"{name}: infix `{op.infix}` is not in the grammar"
        else:
            assert op.surface.isidentifier() and op.surface not in KEYWORDS, name
        assert op in BY_SURFACE[op.infix or op.surface]


@pytest.mark.parametrize("surface", sorted(BY_SURFACE))
def test_surface_names_resolve_to_at_most_one_op(surface: str) -> None:
    ops = BY_SURFACE[surface]
    kw_names = sorted({p.name for op in ops for p in op.params} | {"bogus"})
    max_args = max(op.nin + len(op.params) for op in ops) + 1
    for nargs in range(max_args + 1):
        for r in range(len(kw_names) + 1):
            for kws in itertools.combinations(kw_names, r):
                accepted = [op.name for op in ops if op.accepts(nargs, set(kws))]
                assert len(accepted) <= 1, f"`{surface}` with {nargs} operands and {kws} means {accepted}"


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_a_call_that_resolves_gives_every_required_parameter(name: str) -> None:
    """If `op.accepts(nargs, kwargs)`, the type rule gets each required parameter (by keyword or as
    one of the extra positional arguments), so it never meets a missing one."""
    op = REGISTRY[name]
    positional = [p.name for p in op.params if p.positional]
    names = sorted({p.name for p in op.params} | {"bogus"})
    for nargs in range(op.nin + len(positional) + 2):
        for r in range(len(names) + 1):
            for kws in map(set, itertools.combinations(names, r)):
                if op.accepts(nargs, kws):
                    given = kws | set(positional[: nargs - op.nin])
                    assert {p.name for p in op.params if p.required} <= given, (name, nargs, kws)


def _canonical_calls(op: OpDef) -> list[tuple[int, set[str]]]:
    """(number of positional arguments, keyword names) of the ways to write a call of `op`."""
    required = [p for p in op.params if p.required]
    optional = [p for p in op.params if not p.required]
    calls = []
    for r in range(len(optional) + 1):
        for opt in itertools.combinations(optional, r):
            given = required + list(opt)
            calls.append((op.nin, {p.name for p in given}))
            positional = [p for p in given if p.positional]
            if positional:  # positional parameters written as the next arguments
                calls.append((op.nin + len(positional), {p.name for p in given if not p.positional}))
    return calls


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_each_op_is_what_its_calls_resolve_to(name: str) -> None:
    op = REGISTRY[name]
    for nargs, kws in _canonical_calls(op):
        got = resolve(op.infix or op.surface, nargs, kws)
        assert got is op, (
            f"`{op.surface}` with {nargs} operands and {sorted(kws)} resolves to {got and got.name}"
        )


# ----------------------------------------------------------------------------------------------
# Type rules on every kind of operand

M, N, K = Dim.sym("M"), Dim.sym("N"), Dim.sym("K")
HALF, DOUBLE = N.scale(Fraction(1, 2)), N.scale(2)


def _inside(rows: Dim, cols: Dim) -> list[Type]:
    half, double = cols.scale(Fraction(1, 2)), cols.scale(2)
    out = [Type(dt) for dt in DTYPES + (BOOL,)]
    out += [Type(dt, (rows,), VEC) for dt in ("f32", "bf16", "i32", BOOL)]
    out += [Type("f32", (d,), VEC) for d in (cols, half, double, K)] + [Type("i32", (cols,), VEC)]
    out += [Type(dt, (rows, cols), TILE) for dt in ("f32", "bf16", "i32", BOOL)]
    out += [Type("f32", (rows, d), TILE) for d in (half, double)] + [Type("f32", (K, cols), TILE)]
    out += [
        Type("f32", (rows, cols.scale(Fraction(1, 128))), GROUP, group=128),
        Type("f32", (rows, half.scale(Fraction(1, 4))), GROUP, group=4),
        ERROR_TYPE,
    ]
    return out


BETWEEN = (
    [Type(dt) for dt in DTYPES + (BOOL,)]
    + [Type(dt, (M,), VEC) for dt in ("f32", "bf16", "i32", BOOL)]
    + [
        Type("f32", (N,), VEC),
        Type("i32", (N,), VEC),
        Type("f32", (M, N), MATRIX),
        Type("bf16", (M, N), MATRIX),
        ERROR_TYPE,
    ]
)

CONTEXTS = [
    ("stage", lambda: Ctx(StageShape(M, N), {"N": 2}), _inside(M, N)),
    ("odd_stage", lambda: Ctx(StageShape(M, N), {}, {"N": 7}), _inside(M, N)),
    ("square_stage", lambda: Ctx(StageShape(M, M)), _inside(M, M)),
    ("between", lambda: Ctx(None, {"N": 2}), BETWEEN),
]


def _param_values(op: OpDef) -> list[dict[str, Any]]:
    choices: list[list[tuple[str, Any]]] = []
    for spec in op.params:
        if spec.kind == "dim":
            vals: list[Any] = [M, N, HALF, DOUBLE, K]
        elif spec.kind == "int":
            vals = [1, 2, 4, 128, 0, -3]
        elif spec.kind == "choice":
            vals = list(spec.choices)
        else:
            assert spec.kind == "dtype", spec.kind
            vals = list(DTYPES)
        opts = [(spec.name, v) for v in vals]
        choices.append(opts if spec.required else [("", None)] + opts)
    return [{k: v for k, v in combo if k} for combo in itertools.product(*choices)]


@pytest.mark.parametrize("where", [c[0] for c in CONTEXTS])
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_type_rule_returns_types_or_raises_mistake(name: str, where: str) -> None:
    op = REGISTRY[name]
    assert op.type_rule is not None
    make_ctx, types = next((mk, ts) for w, mk, ts in CONTEXTS if w == where)
    calls = 0
    for ins in itertools.product(types, repeat=op.nin):
        for params in _param_values(op):
            calls += 1
            ctx = make_ctx()
            try:
                outs = op.type_rule(ctx, ins, params)
            except Mistake as m:
                assert m.code in CODES, (name, ins, params, m.code)
                assert m.arg is None or 0 <= m.arg < op.nin, (name, m.arg)
                assert m.message
                continue
            except Exception as e:  # anything else is a bug in the rule
                pytest.fail(
                    f"{name}{tuple(str(t) for t in ins)} {params} in a {where} raised {type(e).__name__}: {e}"
                )
            assert isinstance(outs, tuple) and len(outs) == op.nout, (name, ins, outs)
            assert all(isinstance(t, Type) for t in outs), (name, ins, outs)
            if any(t.is_error for t in ins):
                assert all(t.is_error for t in outs), f"{name}: a poisoned operand must poison the result"
            for t in outs:
                if t.is_error:
                    continue
                assert t.dtype in DTYPES + (BOOL,), (name, t)
                if where == "between":  # vectors and scalars only (or an alias of a matrix operand)
                    assert t.kind in (SCALAR, VEC) or t in ins, f"{name} made a {t.kind} between stages: {t}"
    assert calls > 0
