"""The package's layers: no module imports one above its own layer, no import circles, and a
function-level import of a project module only where it keeps a light command light.

The walk reads every module of coda_lang/ as text (ast), including imports inside functions and
imports under `if TYPE_CHECKING:` (annotations only: they never run, but a module that names another's
types depends on it, so they count for the layer order and for circles, not for the lazy rule). `LAYERS` is the order, bottom first
(docs/CONTRIBUTING.md draws it): a module may import modules of its own layer or of any layer below,
never above, and the imports within a layer form no circle.

A function-level import of a project module is allowed only with a `# lazy:` comment on its line or
the line before, saying why, and only when the imported module (through its top-level imports)
brings a heavy library that the importing module does not bring already: deferring the import is
then what keeps `coda check` (which imports neither NumPy nor torch), `coda run`'s start or `import
coda_lang` fast. Any other function-level import hides a circle or is merely untidy: it belongs at
the top of the module.

`python tests/test_layers.py` prints the graph's violations and counts, for a quick look.
"""

from __future__ import annotations

import ast
import functools
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "coda_lang"

# Bottom first. A module belongs to the first layer one of whose prefixes it starts with (a prefix
# matches itself and its submodules).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("coda_lang.core",),  # ground floor: diagnostics, numerics, progress; imports nothing of coda_lang
    ("coda_lang.ir",),  # types and nodes
    ("coda_lang.ops",),  # the op registry
    ("coda_lang.frontend.syntax", "coda_lang.reference"),  # parse, lower, print; the generated docs
    ("coda_lang.frontend",),  # the checker, plans, the text -> checked program entry
    ("coda_lang.autodiff",),  # backward blocks, chunk plans and their rewrite
    ("coda_lang.interp",),  # the NumPy reference interpreter
    ("coda_lang.backend_triton",),  # generated Triton kernels of elementwise stages, layout copies
    ("coda_lang.backend_cute.plan",),  # stage -> StageSpec -> epilogue source
    ("coda_lang.backend_cute.build",),  # PTX, kernel cache, worker processes, tuning
    ("coda_lang.backend_cute.runtime", "coda_lang.backend_cute"),  # launches, CudaBlock, autograd
    ("coda_lang.api", "coda_lang.layout", "coda_lang"),  # Block and Program; `import coda_lang`
    ("coda_lang.torch",),  # torch functions and modules of blocks
    ("coda_lang.testing",),  # hypothesis strategies
    ("coda_lang.fuzz",),  # the differential fuzzer
    ("coda_lang.hf", "coda_lang.cli"),  # the Hugging Face patch; the command line
)

# Libraries whose import takes long enough that a light path must not pay for it.
HEAVY = ("numpy", "torch", "triton", "cutlass", "quack", "hypothesis", "transformers", "ml_dtypes", "lark")


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported project module
    line: int
    function_level: bool
    reason: str  # the `# lazy:` comment's text, "" if none
    annotation: bool = False  # under `if TYPE_CHECKING:`: for annotations only, never run


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The project modules an import statement imports (a `from pkg import mod` names the module)."""
    out: list[str] = []
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name in known:
                out.append(a.name)
        return out
    base = node.module or ""
    if node.level:
        pkg = module.split(".") if is_package else module.split(".")[:-1]
        pkg = pkg[: len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([base] if base else []))
    for a in node.names:
        sub = f"{base}.{a.name}"
        if sub in known:
            out.append(sub)
        elif base in known:
            out.append(base)
    return sorted(set(out))


def _lazy_reason(lines: list[str], first: int, last: int) -> str:
    """The text of a `# lazy:` comment on the statement's lines or the line before it."""
    for text in [lines[first - 2] if first >= 2 else "", *lines[first - 1 : last]]:
        if "# lazy:" in text:
            return text.split("# lazy:", 1)[1].strip()
    return ""


def imports(mods: dict[str, Path] | None = None) -> list[Import]:
    """Every import of a project module by a project module (TYPE_CHECKING blocks left out)."""
    return list(_walk(tuple(sorted((mods if mods is not None else modules()).items()))))


@functools.cache  # (each test of this module walks the same files: read them once per process)
def _walk(items: tuple[tuple[str, Path], ...]) -> tuple[Import, ...]:
    mods = dict(items)
    known = set(mods)
    found: list[Import] = []
    for name, path in mods.items():
        for child, in_function, typing_only, reason in _statements(path.read_text()):
            for t in _targets(child, name, path.name == "__init__.py", known):
                if t != name:
                    found.append(Import(name, t, child.lineno, in_function, reason, typing_only))
    return tuple(found)


@functools.cache  # (a planted copy of the modules walks again only the files it changed)
def _statements(text: str) -> tuple[tuple[ast.Import | ast.ImportFrom, bool, bool, str], ...]:
    """The import statements of a module's text: (statement, in a function, under `if TYPE_CHECKING:`,
    the `# lazy:` reason of one in a function)."""
    lines = text.split("\n")
    found: list[tuple[ast.Import | ast.ImportFrom, bool, bool, str]] = []

    def visit(node: ast.AST, in_function: bool, typing_only: bool = False) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(ast.Module(body=child.body, type_ignores=[]), in_function, True)
                visit(ast.Module(body=child.orelse, type_ignores=[]), in_function, typing_only)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                last = child.end_lineno or child.lineno
                reason = _lazy_reason(lines, child.lineno, last) if in_function else ""
                found.append((child, in_function, typing_only, reason))
                continue
            fn = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, in_function or fn, typing_only)

    visit(_tree(text), False)
    return tuple(found)


@functools.cache
def _tree(text: str) -> ast.Module:
    return ast.parse(text)


def layer_of(module: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if p == "coda_lang" and module != "coda_lang":
                continue
            if module == p or module.startswith(p + "."):
                return i
    raise AssertionError(f"module {module} is in no layer of tests/test_layers.py's LAYERS")


def upward(found: list[Import]) -> list[Import]:
    """Imports of a module in a higher layer than the importer's."""
    return [i for i in found if layer_of(i.target) > layer_of(i.source)]


def circles(found: list[Import]) -> list[list[str]]:
    """The import circles (strongly connected components of more than one module), each sorted."""
    graph: dict[str, set[str]] = {}
    for i in found:
        graph.setdefault(i.source, set()).add(i.target)
        graph.setdefault(i.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        # iterative Tarjan: (node, iterator over its successors)
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            node, succ = work[-1]
            nxt = next(succ, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def heavy_at_top(mods: dict[str, Path]) -> dict[str, frozenset[str]]:
    """The HEAVY libraries importing each module imports (through top-level imports only)."""
    direct: dict[str, set[str]] = {}
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        tree = _tree(path.read_text())
        libs: set[str] = set()
        for node in tree.body:
            if isinstance(node, ast.Import):
                libs |= {a.name.split(".")[0] for a in node.names} & set(HEAVY)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                libs |= {node.module.split(".")[0]} & set(HEAVY)
        direct[name] = libs
    for i in imports(mods):
        if not i.function_level and not i.annotation:
            edges[i.source].add(i.target)
    # a package's parents are imported first: importing a.b.c imports a and a.b
    for m in mods:
        parts = m.split(".")
        for k in range(1, len(parts)):
            parent = ".".join(parts[:k])
            if parent in mods:
                edges[m].add(parent)
    out: dict[str, frozenset[str]] = {}
    for m in mods:  # everything reachable from m
        seen, stack, libs = {m}, [m], set()
        while stack:
            x = stack.pop()
            libs |= direct[x]
            for y in edges[x] - seen:
                seen.add(y)
                stack.append(y)
        out[m] = frozenset(libs)
    return out


def needless_lazy(found: list[Import], mods: dict[str, Path]) -> list[Import]:
    """Function-level imports without a `# lazy:` reason, or that defer no heavy library (the imported
    module brings none that the importing module does not bring already)."""
    heavy = heavy_at_top(mods)
    return [i for i in found if i.function_level and (not i.reason or not heavy[i.target] - heavy[i.source])]


def _show(i: Import) -> str:
    where = "in a function" if i.function_level else "at the top"
    where += ", for annotations" if i.annotation else ""
    return f"{i.source} (line {i.line}, {where}) imports {i.target}"


# ---------------------------------------------------------------------------------------------


def test_every_module_has_a_layer() -> None:
    for m in modules():
        layer_of(m)


def test_no_module_imports_a_layer_above_its_own() -> None:
    bad = upward(imports())
    assert not bad, "imports that point up the layers:\n" + "\n".join(map(_show, bad))


def test_no_import_circles() -> None:
    found = circles(imports())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_function_level_imports_only_keep_light_paths_light() -> None:
    mods = modules()
    bad = needless_lazy(imports(mods), mods)
    assert not bad, (
        "function-level imports of project modules that are not needed to keep a path light (move "
        "them to the top of the module, or say `# lazy: why` when the module imports a heavy library):\n"
        + "\n".join(f"{_show(i)}{' (no # lazy: reason)' if not i.reason else ''}" for i in bad)
    )


def test_the_ground_floor_imports_nothing_of_the_project() -> None:
    ground = [i for i in imports() if layer_of(i.source) == 0 and layer_of(i.target) != 0]
    assert not ground, "\n".join(map(_show, ground))


def test_an_upward_import_is_caught(tmp_path: Path) -> None:
    """The walk itself: a copy of two modules with an import up the layers added (ops importing the
    interpreter) and one with a circle (the ground floor importing ops, which imports it) must be
    found, at their lines."""
    mods = modules()
    registry = tmp_path / "registry.py"
    registry.write_text(mods["coda_lang.ops.registry"].read_text() + "\nfrom coda_lang.interp import run\n")
    numerics = tmp_path / "numerics.py"
    numerics.write_text(mods["coda_lang.core.numerics"].read_text() + "\nimport coda_lang.ops.registry\n")
    planted = {**mods, "coda_lang.ops.registry": registry, "coda_lang.core.numerics": numerics}
    found = imports(planted)
    up = {(i.source, i.target) for i in upward(found)}
    assert ("coda_lang.ops.registry", "coda_lang.interp.run") in up
    assert ("coda_lang.core.numerics", "coda_lang.ops.registry") in up
    assert any("coda_lang.core.numerics" in c and "coda_lang.ops.registry" in c for c in circles(found))
    # and a function-level import without a reason is reported
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from coda_lang.ir import types\n    return types\n")
    planted = {**mods, "coda_lang.core.lazy": lazy}
    found = imports(planted)
    assert [
        (i.source, i.target) for i in needless_lazy(found, planted) if i.source == "coda_lang.core.lazy"
    ] == [("coda_lang.core.lazy", "coda_lang.ir.types")]


if __name__ == "__main__":
    mods = modules()
    found = imports(mods)
    for i in upward(found):
        print("UP  ", _show(i))
    for c in circles(found):
        print("CIRCLE", " <-> ".join(c))
    lazy = needless_lazy(found, mods)
    for i in lazy:
        print("LAZY", _show(i), "" if i.reason else "(no reason)")
    fn = [i for i in found if i.function_level]
    print(
        f"{len(mods)} modules, {len(found)} imports, {len(fn)} function-level, "
        f"{len(upward(found))} upward, {len(circles(found))} circles, {len(lazy)} unjustified function-level",
        file=sys.stderr,
    )
