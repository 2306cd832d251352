"""Broken twins: a valid block with one well-chosen mistake, and the error code the checker must give.

What it does: `MISTAKES` maps a kind of mistake to the code `coda check` must report for it, e.g.
"partial_in_stage" (a partial reduction used in its own stage) -> E0501, "tile_between_stages" ->
E0502, "shape_mismatch" -> E0402. `make_twin(text, kind, choose)` prints the (first) block of a valid
program in canonical form and edits it: a statement added at the end of a stage, between stages or
as a new stage, a parameter or output added to the signature; the IR's types decide what is written
(which dims, which widths, which values exist), so it works for any valid block, the examples
included. `twins()` is the hypothesis strategy: a random valid block (`random_blocks()`, or the
strategy of program texts you give) and one applicable mistake.
What it does not: check anything (tests/test_testing.py asserts that the checker gives exactly the
expected code, once).
Invariants: a twin differs from its valid original by one mistake, written with fresh names (`oops1`,
...) that nothing else uses, so the checker gives exactly one diagnostic, with `Twin.code`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from hypothesis import strategies as st

from coda_lang.api import load
from coda_lang.frontend.syntax.printer import print_block
from coda_lang.ir.nodes import Block, Stage
from coda_lang.ir.types import Dim
from coda_lang.testing.programs import random_blocks

T = TypeVar("T")
Choose = Callable[[Sequence[T]], T]

# kind -> the code the checker must give
MISTAKES: dict[str, str] = {
    "partial_in_stage": "E0501",  # oops = acc + sum(acc, over=N) in the same stage
    "row_stat_normalizes": "E0503",  # acc * sum(acc * acc, over=N): RMSNorm's scale in its own stage
    "tile_between_stages": "E0502",  # exp(x) of a matrix between stages
    "acc_between_stages": "E0210",  # acc outside a stage
    "stage_vector_used_after": "E0504",  # a vector computed in a stage, used after it
    "shape_mismatch": "E0402",  # a row vector + a vector of another length, between stages
    "tile_misaligned": "E0505",  # acc + a tile load of another width
    "gemm_inner_dims": "E0401",  # a GEMM whose operands' inner dims differ
    "gemm_dtypes": "E0305",  # a GEMM of bf16 and f16 operands
    "pairs_odd_width": "E0403",  # pairs(acc) on a width that may be odd
    "reduce_missing_dim": "E0404",  # sum over a dim the tile does not have
    "unknown_name": "E0201",
    "unknown_op": "E0203",
    "name_defined_twice": "E0202",
    "output_never_assigned": "E0205",
    "output_shape": "E0406",  # an output declared with another shape than its value's
    "unknown_dtype": "E0208",  # `oops: f8 = acc`
    "store_float_as_int": "E0303",  # `oops: i32 = acc`
    "float_index": "E0302",  # pick(acc, a float vector)
}


@dataclass(frozen=True)
class Twin:
    text: str  # the broken program
    code: str  # the error code the checker must give (once)
    kind: str  # a key of MISTAKES
    original: str  # the valid program it was made from (canonical form)


@dataclass
class _Src:
    """The canonical source of a block, split into lines, with where each stage starts and ends."""

    block: Block
    lines: list[str]
    header: int
    stages: list[tuple[int, int]]  # (line of `gemm ... {`, line of its `}`)
    end: int  # the block's closing `}`

    @staticmethod
    def of(block: Block) -> _Src:
        lines = print_block(block).split("\n")
        header = next(i for i, ln in enumerate(lines) if ln.startswith("block "))
        stages, start = [], None
        for i, ln in enumerate(lines):
            if ln.startswith("  gemm ") or ln.startswith("  elementwise "):
                start = i
            elif ln == "  }" and start is not None:
                stages.append((start, i))
                start = None
        end = max(i for i, ln in enumerate(lines) if ln == "}")
        return _Src(block, lines, header, stages, end)


class _Edit:
    def __init__(self, src: _Src):
        self.src = src
        self.inserts: dict[int, list[str]] = {}  # before line i
        self.params: list[str] = []
        self.outputs: list[str] = []
        self.n = 0

    def fresh(self) -> str:
        self.n += 1
        return f"oops{self.n}"

    def before(self, line: int, *stmts: str, indent: int = 2) -> None:
        self.inserts.setdefault(line, []).extend(" " * indent + s for s in stmts)

    def text(self) -> str:
        out = []
        for i, ln in enumerate(self.src.lines):
            out += self.inserts.get(i, [])
            if i == self.src.header and (self.params or self.outputs):
                m = re.match(r"^block (\w+)\((.*)\) -> \((.*)\) \{$", ln)
                assert m, ln
                params = ", ".join(self.params + ([m.group(2)] if m.group(2) else []))
                outs = ", ".join(self.outputs + [m.group(3)])
                ln = f"block {m.group(1)}({params}) -> ({outs}) {{"
            out.append(ln)
        return "\n".join(out)


def _gemm_stages(src: _Src) -> list[int]:
    return [
        k
        for k, s in enumerate(src.block.stages)
        if s.is_gemm and s.acc is not None and s.acc.type is not None
    ]


def _shape(s: Stage) -> tuple[Dim, Dim]:
    assert s.acc is not None and s.acc.type is not None
    rows, cols = s.acc.type.shape
    return rows, cols


def _dim_names(src: _Src) -> list[str]:
    return [d.name for d in src.block.dims]


def _in_stage(kind: str, src: _Src, ed: _Edit, choose: Choose[Any]) -> bool:
    stages = _gemm_stages(src)
    if not stages:
        return False
    k = choose(stages)
    rows, cols = _shape(src.block.stages[k])
    end = src.stages[k][1]
    a, b = ed.fresh(), ed.fresh()
    if kind == "partial_in_stage":
        ed.before(end, f"{a} = sum(acc, over={cols})", f"{b} = acc + {a}", indent=4)
    elif kind == "row_stat_normalizes":
        ed.before(end, f"{a} = sum(acc * acc, over={cols})", f"{b} = acc * {a}", indent=4)
    elif kind == "stage_vector_used_after":
        ed.params.append(f"{a}: f32[{rows}]")
        ed.before(end, f"{b} = {a} * 2.0", indent=4)
        ed.before(end + 1, f"{ed.fresh()} = {b} + 1.0")
    elif kind == "tile_misaligned":
        other = cols.scale(3)  # 3*N: no stage's tile has that width
        ed.params.append(f"{a}: f32[{rows}, {other}]")
        ed.before(end, f"{b} = acc + {a}", indent=4)
    elif kind == "pairs_odd_width":
        if cols.name is None or cols.coeff.denominator != 1 or cols.coeff.numerator % 2 == 0:
            return False
        # a width the signature makes even (`f32[M, N/128]`: N is a multiple of 128) may pair
        types = [p.var.type for p in src.block.params] + [o.type for o in src.block.outputs]
        if any(d.name == cols.name and d.coeff.denominator % 2 == 0 for t in types if t for d in t.shape):
            return False
        ed.before(end, f"{a}, {b} = pairs(acc)", indent=4)
    elif kind == "reduce_missing_dim":
        others = [d for d in _dim_names(src) if Dim.sym(d) not in (rows, cols)]
        if not others:
            return False
        ed.before(end, f"{a} = sum(acc, over={choose(others)})", indent=4)
    elif kind == "unknown_name":
        ed.before(end, f"{a} = acc * {b}", indent=4)
    elif kind == "unknown_op":
        ed.before(end, f"{a} = frobnicate(acc)", indent=4)
    elif kind == "name_defined_twice":  # a parameter (uses of a redefined value would give more errors)
        ed.before(end, f"{choose([p.var.name for p in src.block.params])} = acc", indent=4)
    elif kind == "unknown_dtype":
        ed.before(end, f"{a}: f8 = acc", indent=4)
    elif kind == "store_float_as_int":
        ed.before(end, f"{a}: i32 = acc", indent=4)
    elif kind == "float_index":
        ed.params.append(f"{a}: f32[{rows}]")
        ed.before(end, f"{b} = pick(acc, {a})", indent=4)
    else:
        raise AssertionError(kind)
    return True


def make_twin(text: str, kind: str, choose: Choose[Any]) -> Twin | None:
    """The first block of the valid program `text` with one mistake of `kind` (a key of MISTAKES);
    None where the block has no place for it (e.g. `pairs_odd_width` with only even widths).
    `choose(options)` picks among options (`random.Random(s).choice`, or a hypothesis draw)."""
    block = next(iter(load(text))).ir
    src = _Src.of(block)
    original = "\n".join(src.lines)
    ed = _Edit(src)
    if kind in ("tile_between_stages", "acc_between_stages"):
        if not src.stages:
            return None
        k = choose(range(len(src.stages)))
        mats = [p.var.name for p in block.params if p.var.type is not None and len(p.var.type.shape) == 2]
        if kind == "tile_between_stages":
            if not mats:
                return None
            ed.before(src.stages[k][1] + 1, f"{ed.fresh()} = exp({choose(mats)})")
        else:
            ed.before(src.stages[k][1] + 1, f"{ed.fresh()} = acc * 2.0")
    elif kind == "shape_mismatch":
        dims = _dim_names(src)
        if not src.stages or not dims:
            return None
        x = choose(dims)
        a, b = ed.fresh(), ed.fresh()
        ed.params += [f"{a}: f32[{x}]", f"{b}: f32[{Dim.sym(x, 3)}]"]
        ed.before(src.stages[choose(range(len(src.stages)))][1] + 1, f"{ed.fresh()} = {a} + {b}")
    elif kind in ("gemm_inner_dims", "gemm_dtypes"):
        dims = _dim_names(src)
        if len(dims) < 2:
            return None
        x = choose(dims)
        y = choose([d for d in dims if d != x])
        a, b, o = ed.fresh(), ed.fresh(), ed.fresh()
        if kind == "gemm_inner_dims":  # [x, y] @ [x, y]: inner y against x
            ed.params += [f"{a}: bf16[{x}, {y}]", f"{b}: bf16[{x}, {y}]"]
        else:
            ed.params += [f"{a}: bf16[{x}, {y}]", f"{b}: f16[{y}, {x}]"]
        ed.before(src.end, f"gemm {a} @ {b} {{", f"  {o} = acc", "}")
    elif kind == "output_never_assigned":
        ed.outputs.append(f"{ed.fresh()}: f32[{choose(_dim_names(src)) if _dim_names(src) else 4}]")
    elif kind == "output_shape":
        outs = [o for o in block.outputs if len(o.type.shape) >= 1]
        if not outs:
            return None
        o = choose(outs)
        wrong = tuple(
            Dim.sym(d.name, d.coeff * 3) if d.name else Dim.const(int(d.coeff) + 1) for d in o.type.shape
        )
        decl = f"{o.name}: {o.type.dtype}[{', '.join(map(str, o.type.shape))}]"
        header = src.lines[src.header]
        assert decl in header, (decl, header)
        src.lines[src.header] = header.replace(
            decl, f"{o.name}: {o.type.dtype}[{', '.join(map(str, wrong))}]"
        )
    elif not _in_stage(kind, src, ed, choose):
        return None
    return Twin(ed.text() + "\n", MISTAKES[kind], kind, original)


@st.composite
def twins(
    draw: Any, programs: st.SearchStrategy[str] | None = None, kinds: Sequence[str] | None = None
) -> Twin:
    """A broken twin of a random valid program: `programs` draws program texts (default: the text of
    `random_blocks()`), `kinds` limits the mistakes (default: every kind in MISTAKES)."""
    if programs is None:
        programs = random_blocks().map(lambda f: f.text)
    text = draw(programs)
    options = list(kinds or MISTAKES)
    while options:
        kind = draw(st.sampled_from(options))
        twin = make_twin(text, kind, lambda xs: draw(st.sampled_from(list(xs))))
        if twin is not None:
            return twin
        options.remove(kind)
    raise AssertionError("no mistake fits this program")  # every program has a stage: unknown_name fits
