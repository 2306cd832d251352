"""Random block-local forward blocks, drawn from the op registry (a hypothesis strategy).

What it does: `forward_blocks()` draws random block-local forward blocks that `coda check` accepts
and that are differentiable at the inputs `Forward.inputs` draws: several GEMM stages (some reading
an earlier stage's stored tile, some transposed), epilogues of registry ops with tile loads, vectors
and scalars, pairs/interleave on even widths, reductions (grouped ones too), vector computations
between stages, storage annotations.
What it does not: check anything (tests do), or make broken programs (mistakes.py).
Invariants: every program made here passes the checker (the op's own type rule decides what is
made, as in tests/test_roundtrip.py). Inputs stay away from non-differentiable points: operands
in a positive position are written `(u * u + 0.5)`; max/min reductions only reduce *generic* tiles
(whose entries vary independently, so a row has no tied maximum: not `where(c, r, 0.5)`, not
`interleave(u, u)`, tracked by what each value computes); no literal 0 and no dim of size 1 (no
`x * 0.0` or `x * F` for a max to tie on); no `expand` (it makes tiles with equal columns), no
row/col indices and no casts to i32 (piecewise constant); no `fold` (it needs a dim of fixed size,
which these programs don't declare: vectors that repeat are tested by op_programs and
tests/test_group_vectors.py). With `known_bugs=False` (the default),
`forward_blocks` also avoids the one thing autodiff refuses (E0602, marked AUTODIFF LIMIT): a grouped
value read after its stage whose one-column-per-group matrix no tile of the stage can read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
from hypothesis import strategies as st

import coda_lang
from coda_lang.ir.types import (
    BOOL,
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
    promote,
    shape_str,
)
from coda_lang.ops import REGISTRY, Ctx, Lanes, Locality, OpDef, Role, StageShape
from coda_lang.testing.inputs import gradcheck_inputs
from coda_lang.testing.rules import differentiable_ops, op_source, positive_args, try_rule

# ----------------------------------------------------------------------------------------------
# Random forward blocks

ROWS = Dim.sym("M")
INNER = Dim.sym("K")
COL_NAMES = ("N", "F")
LITERALS = ("0.5", "1.5", "-0.75", "2.0", "0.25", "-1.25", "3")
# Not drawn: ops whose OpDef says `random_programs=False` (see the module docstring: expand, row/col
# indices, fold); comparisons only as conditions. A pointwise op that `selects` (max(u, v), min, where,
# abs) equals an operand on part of the domain: max(interleave(max(u, v), v)) ties; a reduction that
# selects (`ties`: max, min) reduces only generic tiles.


@dataclass
class Val:
    src: str
    type: Type
    generic: bool = False  # a tile or group whose entries vary independently (no ties)
    stored: bool = False  # a matrix an earlier stage stored (may be a GEMM operand)
    annot: str | None = None  # its storage annotation (`h: bf16 = ...`)
    partial: bool = False  # a complete partial reduction (a vector after its stage)
    literal: bool = False
    key: str = ""  # what it computes, in terms of atoms (equal keys: equal values)

    @property
    def ident(self) -> str:
        return self.key or self.src


@dataclass
class Forward:
    """A drawn forward block: its source, sizes of its dims, index ranges and input scales."""

    text: str
    sizes: dict[str, int]
    index_range: dict[str, Dim]
    scale: dict[str, float]

    @functools.cached_property
    def block(self) -> coda_lang.Block:
        return coda_lang.load(self.text)["fwd"]

    @functools.cached_property
    def dims(self) -> dict[str, int]:
        """Sizes of the dims the block uses (a block declares only those)."""
        return {d.name: self.sizes[d.name] for d in self.block.ir.dims}

    def inputs(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        ranges = {k: int(d.evaluate(self.sizes)) for k, d in self.index_range.items()}
        return gradcheck_inputs(self.block, self.sizes, ranges, rng, scale=self.scale)


def _weight(op: OpDef) -> int:
    if op.locality is Locality.PAIR:
        return 4
    if op.reduces:
        return 2
    return 1


class ForwardGen:
    def __init__(
        self,
        draw: Any,
        sizes: dict[str, int],
        known_bugs: bool = False,
        gemm_dtypes: tuple[str, ...] = FLOAT_DTYPES,
        store_dtypes: tuple[str, ...] = FLOAT_DTYPES,
        block_scales: bool = False,
    ):
        self.draw = draw
        self.block_scales = block_scales  # GEMM stages may carry `scale_a=` / `scale_b=` (interpreter only)
        self.scaled: list[tuple[int, str, str, Dim, Dim, Dim]] = []  # (line, a, b, rows, inner, cols)
        self.known_bugs = known_bugs
        self.gemm_dtypes = gemm_dtypes  # dtypes of GEMM operands
        self.store_dtypes = store_dtypes  # dtypes of annotated stores and casts
        self.sizes = sizes
        self.n = 0
        self.params: list[str] = []
        self.outer: list[Val] = []
        self.lines: list[str] = []
        self.made: list[Val] = []  # values of statements, usable after their stage (block outputs)
        self.index_range: dict[str, Dim] = {}
        self.scale: dict[str, float] = {}
        self.ops = [op for op in differentiable_ops() if op.random_programs]
        self.compare = [
            op
            for op in REGISTRY.values()
            if not op.differentiable and op.locality is Locality.POINTWISE and op.nin == 2
        ]
        self.compare.sort(key=lambda op: op.name)
        self.weighted = [op for op in self.ops for _ in range(_weight(op))]
        self.act = "bf16"

    def dtype(self, choices: tuple[str, ...]) -> str:
        """A storage dtype."""
        return self.draw(st.sampled_from(choices))

    def fresh(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def add_param(
        self, prefix: str, dtype: str, shape: tuple[Dim, ...], default: str | None = None, scale: float = 1.0
    ) -> Val:
        name = self.fresh(prefix)
        self.params.append(
            f"{name}: {dtype}{shape_str(shape) if shape else ''}" + (f" = {default}" if default else "")
        )
        if scale != 1.0:
            self.scale[name] = scale
        kind = (SCALAR, VEC, MATRIX)[len(shape)]
        v = Val(name, Type(dtype, shape, kind), generic=kind == MATRIX)
        self.outer.append(v)
        return v

    # ---------------------------------------------------------------- operands

    def atoms(self, stage: StageShape | None, local: list[Val]) -> list[Val]:
        out = []
        for v in self.outer:
            t = v.type
            if t.kind == MATRIX:
                if stage is None or t.shape[0] != stage.rows or t.shape[1] not in stage.col_widths():
                    continue
                t = t.with_kind(TILE) if t.kind == MATRIX and not t.group else t
            if t.dtype == "i32" and t.kind == VEC:  # indices: only for pick
                continue
            out.append(Val(v.src, t, v.generic, key=v.ident))
        return out + [v for v in local if v.type.kind != PARTIAL]

    def operand(
        self,
        stage: StageShape | None,
        local: list[Val],
        depth: int,
        positive: bool,
        want_bool: bool,
        want_index: bool,
    ) -> Val:
        draw = self.draw
        if want_index and stage is not None:
            name = self.fresh("i")
            self.params.append(f"{name}: i32[{stage.rows}]")
            # pick's index selects a column of a tile of some width of this stage: within the narrowest
            self.index_range[name] = min(stage.col_widths(), key=lambda d: d.evaluate(self.sizes))
            return Val(name, Type("i32", (stage.rows,), VEC))
        if want_bool:
            return self.condition(stage, local)
        choice = draw(st.integers(0, 19))
        if choice < 2:
            v = self.literal()
        elif choice == 2:
            d = draw(st.sampled_from(("M", "K", "N", "F")))
            v = Val(d, Type("i32"))
        elif choice < 6 and depth < 1:
            got = self.expr(stage, local, depth + 1, tries=6)
            if got is not None and len(got[1]) == 1 and got[1][0].type.kind != PARTIAL:
                text, (out,) = got[0], got[1]
                v = Val(f"({text})", out.type, out.generic, key=out.key)
            else:
                v = self.pick_atom(stage, local, choice)
        else:
            v = self.pick_atom(stage, local, choice)
        if positive and v.type.dtype != BOOL:
            t = Type(promote(v.type.dtype, "f32"), v.type.shape, v.type.kind, group=v.type.group)
            return Val(f"({v.src} * {v.src} + 0.5)", t, v.generic, key=f"pos({v.ident})")
        return v

    def pick_atom(self, stage: StageShape | None, local: list[Val], choice: int) -> Val:
        atoms = self.atoms(stage, local)
        tiles = [v for v in atoms if v.type.kind in (TILE, GROUP)]
        if tiles and choice < 14:
            return self.draw(st.sampled_from(tiles))
        return self.draw(st.sampled_from(atoms)) if atoms else self.literal()

    def literal(self) -> Val:
        text = self.draw(st.sampled_from(LITERALS))
        return Val(text, Type("i32" if text.lstrip("-").isdigit() else "f32"), literal=True)

    def condition(self, stage: StageShape | None, local: list[Val]) -> Val:
        ctx = Ctx(stage, {}, {})
        for _ in range(8):
            op = self.draw(st.sampled_from(self.compare))
            a = self.pick_atom(stage, local, 0)
            b = self.draw(st.sampled_from([self.literal(), self.pick_atom(stage, local, 19)]))
            outs = try_rule(op, ctx, (a.type, b.type), {})
            if outs:
                return Val(f"({a.src} {op.infix} {b.src})", outs[0])
        return Val("(1.0 > 0.5)", Type(BOOL))

    # ---------------------------------------------------------------- expressions

    def params_for(self, op: OpDef, ins: list[Val], stage: StageShape | None) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for spec in op.params:
            if not spec.required and not self.draw(st.booleans()):
                continue
            if spec.kind == "dim":
                dims = [d for v in ins for d in v.type.shape] + ([stage.rows, stage.cols] if stage else [])
                out[spec.name] = self.draw(st.sampled_from(dims or [ROWS]))
            elif spec.kind == "int":
                width = ins[0].type.shape[-1] if ins and ins[0].type.shape else Dim.const(1)
                if spec.name == "group" and out.get("over") not in (None, width):
                    # (groups of rows: no backward yet, and sizes that would have to be multiples of them)
                    continue
                c = width.coeff
                ok = [g for g in (1, 2, 4) if c.denominator == 1 and c.numerator % g == 0]
                out[spec.name] = self.draw(st.sampled_from(ok))
            elif spec.kind == "choice":
                out[spec.name] = self.draw(st.sampled_from(spec.choices))
            else:
                out[spec.name] = self.draw(st.sampled_from(self.store_dtypes))
        return out

    def expr(
        self, stage: StageShape | None, local: list[Val], depth: int, tries: int
    ) -> tuple[str, list[Val]] | None:
        ctx = Ctx(stage, {}, {})
        for _ in range(tries):
            op = self.draw(st.sampled_from(self.weighted))
            if depth > 0 and op.infix == "=":
                continue
            pos = positive_args(op)
            ins = []
            for i in range(op.nin):
                want_bool = op.role(i) is Role.CONDITION
                want_index = op.role(i) is Role.INDEX
                ins.append(self.operand(stage, local, depth, i in pos, want_bool, want_index))
            if op.ties and not ins[0].generic:
                continue
            params = self.params_for(op, ins, stage)
            outs = try_rule(op, ctx, tuple(v.type for v in ins), params)
            if outs is None or not all(is_float(t.dtype) for t in outs):
                continue
            values = [v for i, v in enumerate(ins) if op.role(i) is not Role.CONDITION]
            if op.selects and op.locality is Locality.POINTWISE:  # equal to an operand where it selects it
                generic = False
            elif op.lanes is Lanes.JOIN:  # interleave(u, u) repeats each value: a tie
                generic = all(v.generic for v in values) and values[0].ident != values[1].ident
            else:  # a tile made of generic tiles (a non-generic one may coincide with another value)
                tiles = [v for v in values if v.type.kind in (TILE, GROUP)]
                generic = bool(tiles) and all(v.generic for v in tiles)
            idents = [v.ident for v in ins]
            if op.commutative:
                idents.sort()
            same = op.copy or op.rounds  # the operand's value (rounded)
            key = idents[0] if same else f"{op.name}({', '.join(idents)}; {params})"
            vals = [
                Val("", t, generic and t.kind in (TILE, GROUP), key=key if len(outs) == 1 else f"{key}#{i}")
                for i, t in enumerate(outs)
            ]
            return op_source(op, [v.src for v in ins], params), vals
        return None

    # ---------------------------------------------------------------- statements and stages

    def statement(
        self, stage: StageShape | None, local: list[Val], fallback: Val, copy: bool = False
    ) -> list[Val]:
        got = None if copy else self.expr(stage, local, 0, tries=20)
        text, vals = (
            got
            if got is not None
            else (fallback.src, [Val("", fallback.type, fallback.generic, key=fallback.ident)])
        )
        targets = []
        for v in vals:
            v.src = self.fresh("v")
            if v.type.kind in (TILE, PARTIAL, GROUP) and self.draw(st.integers(0, 4)) == 0:
                v.annot = self.dtype(self.store_dtypes)
            targets.append(f"{v.src}: {v.annot}" if v.annot else v.src)
        self.lines.append(f"{', '.join(targets)} = {text}")
        return vals

    def cols(self, rows: Dim) -> Dim:
        while True:
            d = Dim.sym(self.draw(st.sampled_from(COL_NAMES)), self.draw(st.sampled_from((1, 2, 2, 4))))
            if d != rows:
                return d

    def stage(self, first: bool) -> None:
        draw = self.draw
        stored = [
            v for v in self.outer if v.stored and v.type.kind == MATRIX and v.type.dtype in self.gemm_dtypes
        ]
        if not first and stored and draw(st.integers(0, 4)) < 3:
            a = draw(st.sampled_from(stored))
            dt = a.type.dtype
            if draw(st.integers(0, 4)) == 0:  # transpose(h) @ w: a stage whose rows are h's columns
                a_src, rows, inner = f"transpose({a.src})", a.type.shape[1], a.type.shape[0]
            else:
                a_src, rows, inner = a.src, a.type.shape[0], a.type.shape[1]
        else:
            rows, inner = ROWS, INNER
            dt = self.act if first else draw(st.sampled_from(self.gemm_dtypes))
            if draw(st.integers(0, 3)) == 0:
                a_src = f"transpose({self.add_param('x', dt, (INNER, ROWS)).src})"
            else:
                a_src = self.add_param("x", dt, (ROWS, INNER)).src
        cols = self.cols(rows)
        k = float(inner.evaluate(self.sizes))
        if draw(st.integers(0, 3)) == 0:
            b_src = f"transpose({self.add_param('w', dt, (cols, inner), scale=k**-0.5).src})"
        else:
            b_src = self.add_param("w", dt, (inner, cols), scale=k**-0.5).src
        stage = StageShape(rows, cols)
        half = cols.scale(Fraction(1, 2))
        even = cols.coeff.denominator == 1 and cols.coeff.numerator % 2 == 0
        for shape, p in [
            ((rows, cols), 3),
            ((rows, half), 1 if even else 0),
            ((cols,), 2),
            ((half,), 1 if even else 0),
            ((rows,), 2),
            ((), 1),
        ]:
            if draw(st.integers(0, 4)) < p:
                default = draw(st.sampled_from([None, None, "0.5", "-1.5"])) if not shape else None
                self.add_param("p", self.dtype(("f32", "bf16")), shape, default)
        acc = Val("acc", Type("f32", (rows, cols), TILE), generic=True, key=self.fresh("acc@"))
        if self.block_scales:  # (drawn after the whole block: the rest of it is drawn as without them)
            self.scaled.append((len(self.lines), a_src, b_src, rows, inner, cols))
        self.lines.append(f"gemm {a_src} @ {b_src} {{")
        local = [acc]
        body: list[Val] = []
        for _ in range(draw(st.integers(1, 5))):
            vals = self.statement(stage, local, acc)
            local += vals
            body += vals

        def kept(v: Val) -> bool:  # AUTODIFF LIMIT (E0602): a grouped value whose cotangent, one column per
            # group, is no tile of the stage is not read after it
            t = v.type
            return (
                t.kind in (TILE, PARTIAL)
                or t.kind == GROUP
                and (self.known_bugs or t.shape[1] in stage.col_widths())
            )

        if not any(kept(v) and is_float(v.type.dtype) for v in body):
            body += self.statement(stage, local, acc, copy=True)  # something for later stages to read
        self.lines.append("}")
        for v in body:  # after the stage: tiles and groups are stored, partials complete vectors
            t = v.type
            if t.kind == GROUP and not kept(v):
                continue
            if t.kind in (TILE, GROUP):
                dtype = v.annot or (self.act if t.kind == TILE else "f32")
                after = Val(v.src, Type(dtype, t.shape, MATRIX), v.generic, stored=True, key=v.ident)
            elif t.kind == PARTIAL:
                after = Val(v.src, Type(v.annot or "f32", t.shape, VEC if t.shape else SCALAR), partial=True)
            else:
                continue  # a vector computed in a stage stays there
            self.outer.append(after)
            if is_float(t.dtype):
                self.made.append(after)

    def scales(self, a_src: str, b_src: str, rows: Dim, inner: Dim, cols: Dim) -> str:
        """Sometimes, block scales for the stage's operands (`, scale_a=s1, scale_b=s2`): f32 parameters
        laid out as each operand is stored, each extent divided by a group that divides its coefficient
        (`2*N` by 1 or 2), so that any size of the dim makes whole groups; one group along K for both."""
        draw = self.draw
        if draw(st.integers(0, 3)) != 0:
            return ""

        def group(d: Dim) -> int:
            c = d.coeff.numerator if d.coeff.denominator == 1 else 1
            return draw(st.sampled_from([g for g in range(1, c + 1) if c % g == 0]))

        gk = group(inner)
        which = draw(st.sampled_from(["a", "b", "ab"]))
        out = ""
        for op, src, other in (("a", a_src, rows), ("b", b_src, cols)):
            if op not in which:
                continue
            t = src.startswith("transpose(")
            stored = (inner, other) if t == (op == "a") else (other, inner)
            shape = tuple(d.scale(Fraction(1, gk if d == inner else group(d))) for d in stored)
            out += f", scale_{op}={self.add_param('s', 'f32', shape).src}"
        return out

    def between(self) -> None:
        for _ in range(self.draw(st.integers(0, 2))):
            if not any(v.type.kind in (VEC, SCALAR) for v in self.atoms(None, [])):
                return
            vals = self.statement(None, [], Val("1.5", Type("f32")))
            self.outer += vals
            self.made += [v for v in vals if is_float(v.type.dtype)]

    def block(self) -> str:
        draw = self.draw
        self.act = draw(st.sampled_from(self.gemm_dtypes))
        if draw(st.booleans()):
            self.add_param("r", "f32", (ROWS,))
        if draw(st.booleans()):
            self.add_param("s", "f32", (), draw(st.sampled_from([None, "0.5"])))
        n = draw(st.integers(1, 3))
        for k in range(n):
            self.stage(first=k == 0)
            self.between()
        outs = draw(st.lists(st.sampled_from(self.made), min_size=1, max_size=3, unique_by=lambda v: v.src))
        for line, a_src, b_src, rows, inner, cols in self.scaled:
            self.lines[line] = (
                self.lines[line][: -len(" {")] + self.scales(a_src, b_src, rows, inner, cols) + " {"
            )
        sig = ", ".join(
            f"{v.src}: {v.type.dtype}{shape_str(v.type.shape) if v.type.shape else ''}" for v in outs
        )
        body = "\n".join(f"  {ln}" for ln in self._indent())
        return f"dims M, K, N, F\n\nblock fwd({', '.join(self.params)}) -> ({sig}) {{\n{body}\n}}\n"

    def _indent(self) -> list[str]:
        out, inside = [], False
        for ln in self.lines:
            if ln == "}":
                inside = False
                out.append(ln)
                continue
            out.append(("  " if inside else "") + ln)
            if ln.startswith("gemm "):
                inside = True
        return out


@st.composite
def forward_blocks(
    draw: Any,
    known_bugs: bool = False,
    gemm_dtypes: tuple[str, ...] = FLOAT_DTYPES,
    store_dtypes: tuple[str, ...] = FLOAT_DTYPES,
    block_scales: bool = False,
) -> Forward:
    """A random block-local forward block (see the module docstring), with sizes for its dims.

    `known_bugs=False` avoids what autodiff refuses (E0602): grouped values read after their stage
    whose one-column-per-group matrix is no tile of the stage (groups of 4 columns of a full-width
    tile, of 2 of a half-width one); `known_bugs=True` draws them too.
    `gemm_dtypes`: the dtypes GEMM operands may have (the CUDA backend multiplies bf16 or f16 only);
    `store_dtypes`: the dtypes stored tiles may be annotated with and cast() rounds to (fp8 too, for
    the interpreter and the emulated runtime)."""
    sizes = {
        "M": draw(st.integers(2, 7)),
        "K": draw(st.integers(2, 5)),
        "N": draw(st.integers(2, 5)),
        "F": draw(st.integers(2, 4)),
    }  # no dim of 1: `u * F` would equal u (a tie for max)
    gen = ForwardGen(draw, sizes, known_bugs, gemm_dtypes, store_dtypes, block_scales)
    text = gen.block()
    return Forward(text, sizes, dict(gen.index_range), dict(gen.scale))


def random_blocks(
    gemm_dtypes: tuple[str, ...] = ("f32", "bf16", "f16"),
    store_dtypes: tuple[str, ...] = FLOAT_DTYPES,
    block_scales: bool = False,
) -> st.SearchStrategy[Forward]:
    """Random checked blocks with every feature the generator has: several dtypes (activations, stored
    tiles and GEMM operands in f32, bf16 or f16), grouped values read after their stage, partials read
    by later stages, picks from narrower tiles. Not restricted to what autodiff handles today, so a
    drawn block's backward may raise CodaError (E06); for differential testing that is fine.
    `gemm_dtypes`: the dtypes GEMM operands may have (("bf16", "f16") for the CUDA backend);
    `store_dtypes`: those of annotated stores and casts (with FP8_DTYPES: fp8 stores too);
    `block_scales`: GEMM stages may carry block scales (docs/language.md, "Block scales"), which only
    the interpreter runs."""
    return forward_blocks(
        known_bugs=True, gemm_dtypes=gemm_dtypes, store_dtypes=store_dtypes, block_scales=block_scales
    )
