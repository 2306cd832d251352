"""The registry is the only place an op is special-cased: outside coda_lang/ops/, no module compares an
op's name with a string, and none compares a locality with a string.

The walk reads every module of coda_lang/ outside ops/ as text (ast) and reports
- a comparison (`==`, `!=`, `in`, `not in`) of an expression that names an op with an op's name: the
  expression is an equation's `X.op`, an OpDef's `X.name` or `X.surface` (X spelled `op`, `od`,
  `opdef` or `REGISTRY[...]`), or one of the bare names `op`, `name`, `fn`, `opname`, `surface`; the
  name is a string constant that is a registered op's name or surface (alone, or in a tuple, list or
  set), or a module-level table of op names (`INDEX_OPS = ("row_index", "col_index")`: every string
  it holds is one), whose lookups by an op's name, `TABLE[e.op]`, are reported too;
- a comparison of a locality (`X.locality`, or a name `locality`) with a string.
Strings that only look like op names are not reported: a combine record's name (`c.name == "sum"`),
a parse tree's rule (`kind == "neg"`), an operator (`op.infix == "neg"`), a sink's quack op.
A pass asks the OpDef instead (ops/registry.py: `Locality`, `lanes`, `index_axis`, `copy`, ...).

`PENDING` lists the sites in modules this change could not touch (the chunker, the CUDA block), each
file with its exact count: converting them means removing the entry, and a new site anywhere fails.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

import coda_lang.ops as ops

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "coda_lang"

OP_NAMES = frozenset(ops.REGISTRY) | frozenset(ops.SUGAR) | {op.surface for op in ops.REGISTRY.values()}
OP_NAMES |= {op.surface for op in ops.SUGAR.values()}
OPDEF_SPELLINGS = frozenset({"op", "od", "opdef"})  # names an OpDef is held by
OP_NAME_SPELLINGS = frozenset({"op", "name", "fn", "opname", "surface"})  # names an op's name is held by

# (path relative to the repository, kind) -> how many sites remain there, for the lead to convert
PENDING: dict[tuple[str, str], int] = {}  # (none left: every site reads the registry)


@dataclass(frozen=True)
class Site:
    path: str
    line: int
    kind: str  # "op name" | "locality"
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind}: {self.text}"


def _strings(node: ast.AST) -> list[str]:
    """The string constants a literal holds: itself, or the elements of a tuple, list or set (the keys
    of a dict), or of `frozenset(...)` / `set(...)` / `tuple(...)` of one."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    if isinstance(node, ast.Dict):
        return [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("frozenset", "set", "tuple")
        and len(node.args) == 1
    ):
        return _strings(node.args[0])
    return []


def _op_tables(tree: ast.Module) -> set[str]:
    """Module-level names bound to a literal collection of op names (every string it holds is one)."""
    out = set()
    for stmt in tree.body:
        targets: list[ast.expr] = []
        value: ast.expr | None = None
        if isinstance(stmt, ast.Assign):
            targets, value = stmt.targets, stmt.value
        elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
            targets, value = [stmt.target], stmt.value
        if value is None or isinstance(value, ast.Constant):
            continue
        strings = _strings(value)
        if strings and all(s in OP_NAMES for s in strings):
            out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def _is_registry(node: ast.expr) -> bool:
    """`REGISTRY[...]` (or `registry.REGISTRY[...]`): an OpDef."""
    if not isinstance(node, ast.Subscript):
        return False
    v = node.value
    return (isinstance(v, ast.Name) and v.id == "REGISTRY") or (
        isinstance(v, ast.Attribute) and v.attr == "REGISTRY"
    )


def _names_op(node: ast.expr) -> bool:
    """Whether `node` is an expression holding an op's name (module docstring)."""
    if isinstance(node, ast.Attribute):
        if node.attr == "op":
            return True
        if node.attr in ("name", "surface"):
            v = node.value
            return (isinstance(v, ast.Name) and v.id in OPDEF_SPELLINGS) or _is_registry(v)
        return False
    return isinstance(node, ast.Name) and node.id in OP_NAME_SPELLINGS


def _is_locality(node: ast.expr) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "locality") or (
        isinstance(node, ast.Name) and node.id == "locality"
    )


def violations(source: str, path: str = "<planted>") -> list[Site]:
    """The op-name and locality-string comparisons of one module's source (module docstring)."""
    tree = ast.parse(source)
    tables = _op_tables(tree)
    out: list[Site] = []

    def site(node: ast.AST, kind: str) -> None:
        text = ast.get_source_segment(source, node) or ""
        out.append(Site(path, getattr(node, "lineno", 0), kind, " ".join(text.split())[:100]))

    def op_names(node: ast.expr) -> bool:
        if isinstance(node, ast.Name) and node.id in tables:
            return True
        return any(s in OP_NAMES for s in _strings(node))

    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            if not all(isinstance(o, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for o in node.ops):
                continue
            sides = [node.left, *node.comparators]
            if any(_names_op(a) for a in sides) and any(op_names(b) for b in sides if not _names_op(b)):
                site(node, "op name")
            if any(_is_locality(a) for a in sides) and any(_strings(b) for b in sides if not _is_locality(b)):
                site(node, "locality")
        elif isinstance(node, ast.Subscript):  # TABLE[e.op]
            if isinstance(node.value, ast.Name) and node.value.id in tables and _names_op(node.slice):
                site(node, "op name")
        elif isinstance(node, ast.Call):  # TABLE.get(e.op)
            f = node.func
            if (
                isinstance(f, ast.Attribute)
                and f.attr == "get"
                and isinstance(f.value, ast.Name)
                and f.value.id in tables
                and node.args
                and _names_op(node.args[0])
            ):
                site(node, "op name")
    return out


def package_violations(root: Path = ROOT) -> list[Site]:
    """Every site in the modules of `root`/coda_lang outside ops/."""
    out: list[Site] = []
    for p in sorted((root / "coda_lang").rglob("*.py")):
        rel = p.relative_to(root)
        if rel.parts[1] == "ops":
            continue
        out += violations(p.read_text(encoding="utf-8"), rel.as_posix())
    return out


def check(found: list[Site]) -> None:
    """No site outside `PENDING`, and exactly the pending ones there."""
    new = [s for s in found if (s.path, s.kind) not in PENDING]
    assert not new, "compare an OpDef's fields instead (ops/registry.py):\n" + "\n".join(map(str, new))
    counts: dict[tuple[str, str], int] = {}
    for s in found:
        counts[(s.path, s.kind)] = counts.get((s.path, s.kind), 0) + 1
    changed = {k: (counts.get(k, 0), n) for k, n in PENDING.items() if counts.get(k, 0) != n}
    assert not changed, (
        "pending sites (found, expected) changed; update PENDING (remove converted files):\n"
        + "\n".join(f"{k}: {v}" for k, v in changed.items())
    )


def test_no_module_outside_ops_special_cases_an_op_by_name() -> None:
    check(package_violations())


def test_no_locality_is_compared_with_a_string() -> None:
    found = [s for s in package_violations() if s.kind == "locality"]
    assert [str(s) for s in found if (s.path, "locality") not in PENDING] == []
    assert len(found) == sum(n for (_, kind), n in PENDING.items() if kind == "locality")


# ------------------------------------------------------------------ the walk itself: planted snippets

PLANTED = {
    'if e.op == "interleave":\n    pass': "op name",
    'x = op.name in ("pairs", "interleave")': "op name",
    'x = e.op not in ("reduce_max", "reduce_min")': "op name",
    'x = name == "exp"': "op name",
    'x = REGISTRY[e.op].name != "pick"': "op name",
    'x = od.surface == "max"': "op name",  # a surface name
    'x = fn in {"add", "copy"}': "op name",
    'INDEX_OPS = ("row_index", "col_index")\nx = e.op in INDEX_OPS': "op name",
    'ROLES = {"row_index": "row index"}\nx = ROLES[e.op]': "op name",
    'ROLES = {"row_index": "row index"}\nx = ROLES.get(e.op)': "op name",
    'x = od.locality == "pointwise"': "locality",
    'x = REGISTRY[e.op].locality in ("reduce", "gather")': "locality",
    'x = locality != "pair"': "locality",
}

LEGITIMATE = [
    'x = c.name == "sum"',  # a combine record's name
    'x = rec.sink not in ("add", "max")',  # an epilogue sink's fold
    'x = kind in ("smul", "mul")',  # a parse tree's rule
    'x = op.infix == "neg"',  # an operator
    'x = s.op == "ColVecSelect"',  # a sink's quack op, not an op name
    'KERNELS = {"join": 1, "interleave": 2}\nx = KERNELS[name]',  # a table of other things's names
    'NOT_OPS = {"relu": "max(x, 0.0)", "mean": "..."}\nx = fn in NOT_OPS',
    'x = name == "acc"',  # a value's name
    'x = b.op("exp", y)',  # building an equation of an op (a VJP rule does)
    "x = od.locality is Locality.PAIR",  # what passes do
    "x = REGISTRY[e.op].lanes is Lanes.JOIN",
    'LOAD_OPS = {"tile": "TileLoad"}\nx = LOAD_OPS[ld.role]',
]


def test_the_walk_finds_each_planted_site() -> None:
    for snippet, kind in PLANTED.items():
        got = violations(snippet)
        assert [s.kind for s in got] == [kind], (snippet, got)


def test_the_walk_leaves_legitimate_code_alone() -> None:
    for snippet in LEGITIMATE:
        assert violations(snippet) == [], snippet


def test_a_planted_site_in_a_package_module_fails_the_test(tmp_path: Path) -> None:
    """The package check itself fails on a comparison planted in a copy of one of its modules."""
    (tmp_path / "coda_lang" / "interp").mkdir(parents=True)
    source = (PACKAGE / "interp" / "run.py").read_text(encoding="utf-8")
    planted = source + '\n\ndef _planted(e):\n    return e.op == "cast"\n'
    (tmp_path / "coda_lang" / "interp" / "run.py").write_text(planted, encoding="utf-8")
    found = package_violations(tmp_path)
    line = planted.count("\n")
    assert [str(s) for s in found] == [f'coda_lang/interp/run.py:{line}: op name: e.op == "cast"']
    with pytest.raises(AssertionError, match="compare an OpDef's fields instead"):
        check(found)
