"""Round trips: print -> parse -> the same IR, for the examples and for random valid programs.

`programs()` is a hypothesis strategy of random *valid* .coda programs, written as source text: a few
GEMM stages (some transposed, some reading an earlier stage's stored tile) and an occasional
`elementwise [M, N]` stage, epilogues whose ops are drawn from `coda_lang.ops.REGISTRY` (so a new op
is covered as soon as it is registered), pairs and interleave on even widths such as `2*F`,
reductions with `over=` and `group=`, vector computations between stages, scalars, literals
(negative ones too), storage annotations (`h: bf16 = ...`), comments and `;` separators.
The generator decides what is valid by asking each op's own type rule, and tracks the kinds the
checker tracks (tile, vector, scalar, partial, group; stored matrices after a stage), so every
program it makes must pass `coda check`: that is asserted too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import coda_lang
from coda_lang.core.diagnostics import Mistake, render_all
from coda_lang.frontend.source import check_source
from coda_lang.frontend.syntax.printer import print_block, print_program
from coda_lang.ir.types import (
    BOOL,
    DTYPES,
    FLOAT_DTYPES,
    GROUP,
    MATRIX,
    PARTIAL,
    SCALAR,
    TILE,
    VEC,
    Dim,
    Type,
    is_float,
    shape_str,
)
from coda_lang.ops import REGISTRY, Ctx, OpDef, StageShape

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.coda"))


def _load_text(text: str) -> coda_lang.Program:
    prog, plans, diags = check_source(text)
    assert not diags, f"{render_all(diags, {'<string>': text})}\n--- source:\n{text}"
    assert prog is not None
    return coda_lang.api.Program(prog, plans, text)


# ----------------------------------------------------------------------------------------------
# The examples


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_blocks_round_trip(path: Path) -> None:
    program = coda_lang.load(path)
    assert len(program) >= 1
    for block in program:
        text = str(block)
        again = _load_text(text)[block.name]
        assert again.ir == block.ir, text
        assert str(again) == text


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_programs_round_trip(path: Path) -> None:
    program = coda_lang.load(path)
    text = print_program(program.ir)
    again = _load_text(text)
    assert again.ir == program.ir, text
    assert print_program(again.ir) == text
    assert str(again) == text


# ----------------------------------------------------------------------------------------------
# Random valid programs


ROWS = Dim.sym("M")
COL_DIMS = ("N", "F", "P", "Q")
DIM_VALUES = (None, None, None, 64, 96, 7, 128)
GROUPS = (1, 2, 4, 8, 64, 128)
NAME_PREFIXES = ("v", "h", "_t")  # `_t` collides with the lowering's temporaries on purpose


@dataclass
class Val:
    src: str  # how it is written
    type: Type  # its type where it is usable (a stage or between stages)
    name: str | None = None  # a named value of the block (param or assigned)
    annot: str | None = None
    param: bool = False


@dataclass
class BlockGen:
    draw: Any
    name: str
    values: dict[str, int]  # dims with a fixed value
    counter: list[int]
    params: list[str] = field(default_factory=list)  # source of each parameter
    divisors: dict[str, int] = field(default_factory=dict)
    outer: list[Val] = field(default_factory=list)  # named values usable between stages and later
    focus: str | None = None  # an op to try in every stage and between stages
    act: str = "bf16"
    lines: list[str] = field(default_factory=list)

    # ---------------------------------------------------------------- names and params

    def fresh(self, prefix: str | None = None) -> str:
        self.counter[0] += 1
        p = prefix or self.draw(st.sampled_from(NAME_PREFIXES))
        return f"{p}{self.counter[0]}"

    def note_shape(self, shape: tuple[Dim, ...]) -> None:
        for d in shape:
            if d.name and d.coeff.denominator != 1:
                from math import lcm

                self.divisors[d.name] = lcm(self.divisors.get(d.name, 1), d.coeff.denominator)

    def add_param(
        self, dtype: str, shape: tuple[Dim, ...], prefix: str = "p", default: str | None = None
    ) -> Val:
        name = self.fresh(prefix)
        kind = (SCALAR, VEC, MATRIX)[len(shape)]
        text = f"{name}: {dtype}{shape_str(shape) if shape else ''}"
        if default is not None:
            text += f" = {default}"
        self.params.append(text)
        self.note_shape(shape)
        v = Val(name, Type(dtype, shape, kind), name, param=True)
        self.outer.append(v)
        return v

    # ---------------------------------------------------------------- operands

    def literal(self) -> Val:
        draw = self.draw
        if draw(st.booleans()):
            n = draw(st.integers(-5, 300))
            return Val(str(n), Type("i32"))
        x = draw(
            st.sampled_from(["1.5", "2.", ".5", "1e-3", "3E+2", "0.0", "1.0e5", "6.25", "1e-6", "0.044715"])
        )
        neg = draw(st.booleans())
        return Val(("-" if neg else "") + x, Type("f32"))

    def atoms(self, stage: StageShape | None, local: list[Val]) -> list[Val]:
        """Named values usable here, with their types as seen here."""
        out: list[Val] = []
        for v in self.outer:
            t = v.type
            if stage is not None and t.kind == MATRIX:
                if t.shape[0] != stage.rows or t.shape[1] not in stage.col_widths():
                    continue
                t = t.with_kind(TILE)
            out.append(Val(v.src, t, v.name, v.annot, v.param))
        out += [v for v in local if v.type.kind != PARTIAL]
        return out

    def operand(self, stage: StageShape | None, local: list[Val], depth: int) -> Val:
        draw = self.draw
        choice = draw(st.integers(0, 19))
        if choice < 2:
            return self.literal()
        if choice == 2:
            d = draw(st.sampled_from(("M",) + COL_DIMS))
            return Val(d, Type("i32"))
        if choice < 6 and depth < 2:
            nested = self.expr(stage, local, depth + 1, nout=1, tries=4)
            if nested is not None:
                src, (t,) = nested
                if t.kind != PARTIAL:  # a partial can't be used in its own stage
                    return Val(src if src.endswith(")") and not src.startswith("-") else f"({src})", t)
        atoms = self.atoms(stage, local)
        tiles = [v for v in atoms if v.type.kind in (TILE, GROUP)]
        if tiles and choice < 14:
            return draw(st.sampled_from(tiles))
        return draw(st.sampled_from(atoms)) if atoms else self.literal()

    def param_value(self, spec: Any, ins: list[Val], stage: StageShape | None) -> tuple[Any, str]:
        draw = self.draw
        if spec.kind == "dim":
            dims = [d for v in ins for d in v.type.shape]
            if stage is not None:
                dims += [stage.rows, stage.cols]
            dims += [Dim.sym(draw(st.sampled_from(COL_DIMS)))]
            d = draw(st.sampled_from(dims))
            return d, str(d)
        if spec.kind == "int":
            g = draw(st.sampled_from(GROUPS))
            return g, str(g)
        if spec.kind == "choice":
            c = draw(st.sampled_from(spec.choices))
            return c, f'"{c}"'
        assert spec.kind == "dtype", f"the generator does not know parameters of kind {spec.kind!r}"
        dt = draw(st.sampled_from(DTYPES))
        return dt, dt

    def expr(
        self,
        stage: StageShape | None,
        local: list[Val],
        depth: int,
        nout: int | None,
        tries: int,
        only: str | None = None,
    ) -> tuple[str, tuple[Type, ...]] | None:
        """A random application of a registry op (`only`, if given) that its type rule accepts, or None."""
        draw = self.draw
        ops = [
            op for op in REGISTRY.values() if (nout is None or op.nout == nout) and only in (None, op.name)
        ]
        if depth > 0:
            ops = [op for op in ops if op.infix != "="]  # a nested copy is just an atom
        ops.sort(key=lambda op: op.name)
        ctx = Ctx(stage, self.divisors, self.values)
        bad_arg: int | None = None
        ins: list[Val] = []
        for attempt in range(tries):
            if attempt % 4 == 0:  # a few tries per op, so that ops with picky operands get made too
                op: OpDef = draw(st.sampled_from(ops))
                bad_arg = None
            if bad_arg is not None and bad_arg < len(ins):  # the rule named the bad operand: redraw it
                ins[bad_arg] = self.operand(stage, local, depth)
            else:
                ins = [self.operand(stage, local, depth) for _ in range(op.nin)]
            params: dict[str, Any] = {}
            kw: list[str] = []
            pos: list[str] = []
            for spec in op.params:
                if spec.required or draw(st.booleans()):
                    value, text = self.param_value(spec, ins, stage)
                    params[spec.name] = value
                    if spec.positional and not kw and draw(st.booleans()):
                        pos.append(text)
                    else:
                        kw.append(f"{spec.name}={text}")
            if op.type_rule is None:
                continue
            try:
                outs = op.type_rule(ctx, tuple(v.type for v in ins), params)
            except Mistake as m:
                bad_arg = m.arg
                continue
            if any(t.is_error for t in outs):
                continue
            srcs = [v.src for v in ins]
            if op.infix == "=":
                text = srcs[0]
            elif op.infix == "neg":
                text = f"-{srcs[0]}"
            elif op.infix:
                text = f"{srcs[0]} {op.infix} {srcs[1]}"
            else:
                text = f"{op.surface}({', '.join(srcs + pos + kw)})"
            return text, tuple(outs)
        return None

    # ---------------------------------------------------------------- statements

    def sep(self) -> str:
        return self.draw(st.sampled_from(["\n  ", "\n  ", "; ", " ", "  # a comment\n  ", "\n\n  "]))

    def statement(
        self, stage: StageShape | None, local: list[Val], focus: bool = False, fallback: Val | None = None
    ) -> list[Val]:
        got = self.expr(stage, local, 0, None, tries=16, only=self.focus) if focus and self.focus else None
        got = got or self.expr(stage, local, 0, None, tries=16)
        if got is None:  # always valid: a named copy of acc or of a tile (of a literal between stages)
            fallback = fallback or Val("1.0", Type("f32"))
            got = (fallback.src, (fallback.type,))
        text, outs = got
        vals = []
        targets = []
        for t in outs:
            name = self.fresh()
            annot = None
            storable = t.kind in (TILE, PARTIAL, GROUP) and t.dtype != BOOL
            if storable and self.draw(st.integers(0, 3)) == 0:
                annot = self.draw(st.sampled_from(FLOAT_DTYPES if is_float(t.dtype) else DTYPES))
            targets.append(f"{name}: {annot}" if annot else name)
            vals.append(Val(name, t, name, annot))
        self.lines.append(f"{', '.join(targets)} = {text}")
        return vals

    def stage(self, first: bool) -> None:
        draw = self.draw
        if not first and draw(st.integers(0, 4)) == 0:
            return self.elementwise_stage()
        # The left operand: a new parameter, or a tile an earlier stage stored.
        stored = [
            v
            for v in self.outer
            if not v.param and v.type.kind == MATRIX and v.type.shape[0] == ROWS and is_float(v.type.dtype)
        ]
        if not first and stored and draw(st.booleans()):
            a = draw(st.sampled_from(stored))
            a_src, dtype, inner = a.src, a.type.dtype, a.type.shape[1]
        else:
            dtype = self.act if first else draw(st.sampled_from(FLOAT_DTYPES))
            inner = Dim.sym(draw(st.sampled_from(("K", "M", "N"))))
            if draw(st.integers(0, 3)) == 0:
                a_src = f"transpose({self.add_param(dtype, (inner, ROWS), 'x').src})"
            else:
                a_src = self.add_param(dtype, (ROWS, inner), "x").src
        cols = Dim.sym(draw(st.sampled_from(COL_DIMS)), draw(st.sampled_from((1, 2, 2, 4))))
        if draw(st.integers(0, 3)) == 0:
            b_src = f"transpose({self.add_param(dtype, (cols, inner), 'w').src})"
        else:
            b_src = self.add_param(dtype, (inner, cols), "w").src
        acc = Val("acc", Type("f32", (ROWS, cols), TILE))
        self.epilogue(f"gemm {a_src} @ {b_src}", cols, [acc], acc)

    def elementwise_stage(self) -> None:
        """`elementwise [M, cols] { ... }`: a stage without a GEMM (what autodiff makes at a block's entry)."""
        cols = Dim.sym(self.draw(st.sampled_from(COL_DIMS)), self.draw(st.sampled_from((1, 2))))
        tile = self.add_param(self.draw(st.sampled_from(("f32", "bf16"))), (ROWS, cols), "p")
        self.epilogue(
            f"elementwise {shape_str((ROWS, cols))}", cols, [], Val(tile.src, tile.type.with_kind(TILE))
        )

    def epilogue(self, head: str, cols: Dim, local: list[Val], fallback: Val) -> None:
        draw = self.draw
        stage = StageShape(ROWS, cols)
        # Things an epilogue reads: tiles at its position, row and column vectors, scalars.
        half = cols.scale(Fraction(1, 2))
        for shape, p in [
            ((ROWS, cols), 0.5),
            ((ROWS, half), 0.2),
            ((cols,), 0.5),
            ((half,), 0.4),
            ((ROWS,), 0.2),
        ]:
            whole = all(
                d.name not in self.values or (d.coeff * self.values[d.name]).denominator == 1 for d in shape
            )
            if whole and draw(st.floats(0, 1)) < p:
                self.add_param(draw(st.sampled_from(("f32", "bf16", self.act))), shape, "p")
        self.lines.append(f"{head} {{\n      ")
        n = draw(st.integers(1, 5))
        body: list[Val] = []
        for i in range(n):
            vals = self.statement(stage, local, focus=i == n - 1, fallback=fallback)
            local += vals
            body += vals
            self.lines.append(self.sep())
        self.lines.append("}\n  ")
        # After the stage: tiles and groups are stored matrices, partials complete vectors; vectors
        # and scalars computed in the stage stay there.
        for v in body:
            t = v.type
            if t.kind == TILE:
                self.outer.append(Val(v.src, Type(v.annot or self.act, t.shape, MATRIX), v.name, v.annot))
            elif t.kind == GROUP:
                self.outer.append(Val(v.src, Type(v.annot or "f32", t.shape, MATRIX), v.name, v.annot))
            elif t.kind == PARTIAL:
                self.outer.append(
                    Val(v.src, Type(v.annot or "f32", t.shape, VEC if t.shape else SCALAR), v.name, v.annot)
                )

    def between(self) -> None:
        for i in range(self.draw(st.integers(0, 3))):
            vals = self.statement(None, [], focus=i == 0)
            self.outer += vals
            self.lines.append(self.sep())

    def block(self) -> str:
        draw = self.draw
        self.act = draw(st.sampled_from(FLOAT_DTYPES))
        # Parameters every stage may read: row vectors, an index per row, scalars with defaults.
        if draw(st.booleans()):
            self.add_param("f32", (ROWS,), "r")
        if draw(st.integers(0, 3)):
            self.add_param("i32", (ROWS,), "idx")
        for _ in range(draw(st.integers(0, 2))):
            dtype = draw(st.sampled_from(("f32", "f32", "i32")))
            default = None
            if draw(st.booleans()):
                default = (
                    str(draw(st.integers(-100, 100)))
                    if dtype == "i32"
                    else draw(st.sampled_from(["1e-6", "-0.5", "2.0", "-1e-05", "0.0", "3"]))
                )
            self.add_param(dtype, (), "s", default)
        stages = draw(st.integers(1, 3))
        self.between()
        for k in range(stages):
            self.stage(first=k == 0)
            self.between()
        candidates = [v for v in self.outer if not v.param and v.type.dtype != BOOL]
        outs = (
            draw(st.lists(st.sampled_from(candidates), max_size=3, unique_by=lambda v: v.name))
            if candidates
            else []
        )
        if candidates and not outs:
            outs = [candidates[-1]]
        sig = ", ".join(
            f"{v.name}: {v.type.dtype}{shape_str(v.type.shape) if v.type.shape else ''}" for v in outs
        )
        params = ", ".join(self.params)
        return f"block {self.name}({params}) -> ({sig}) {{\n  {''.join(self.lines)}\n}}\n"


@st.composite
def programs(draw: Any, focus: str | None = None) -> str:
    """Source text of a random valid program (one or two blocks sharing a `dims` line).

    `focus`: the name of an op that every stage (and vector computation) tries to use."""
    values = {d: v for d in COL_DIMS if (v := draw(st.sampled_from(DIM_VALUES))) is not None}
    dims = ", ".join(["M", "K"] + [f"{d} = {values[d]}" if d in values else d for d in COL_DIMS])
    counter = [0]
    blocks = [
        BlockGen(draw, f"blk{i}", values, counter, focus=focus).block()
        for i in range(draw(st.integers(1, 2)))
    ]
    return f"# generated\ndims {dims}\n\n" + "\n".join(blocks)


@settings(max_examples=60)
@given(programs())
def test_random_programs_check_and_round_trip(text: str) -> None:
    program = _load_text(text)  # a generated program is valid
    printed = print_program(program.ir)
    again = _load_text(printed)
    assert again.ir == program.ir, printed
    assert print_program(again.ir) == printed
    for block in program:
        assert block.explain()
        text_b = print_block(block.ir)
        again_b = _load_text(text_b)[block.name]
        assert again_b.ir == block.ir, text_b
        assert str(again_b) == text_b


@pytest.mark.parametrize("op", sorted(REGISTRY))
def test_random_programs_with_each_op(op: str) -> None:
    """Each registered op appears in generated programs, which check and round-trip (so a new op
    gets these tests as soon as it is registered)."""
    seen: list[int] = []

    @settings(max_examples=8, database=None)
    @given(programs(focus=op))
    def run(text: str) -> None:
        program = _load_text(text)
        printed = print_program(program.ir)
        again = _load_text(printed)
        assert again.ir == program.ir, printed
        assert print_program(again.ir) == printed
        uses = [e for b in program.ir.blocks for s in b.body for e in getattr(s, "body", (s,)) if e.op == op]
        seen.append(len(uses))

    run()
    assert sum(seen) > 0, f"the program generator never managed to use `{op}`"
