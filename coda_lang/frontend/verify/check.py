"""The checker: types, shapes, kinds and block-locality of a lowered block.

What it does: walks a block in program order, types every equation through its op's type rule,
tracks what each value is where it is used (inside a stage: tile, row/column vector, scalar, partial,
group; between stages: scalar, vector, matrix), and reports E03/E04/E05 mistakes. It returns the typed
block and its plan (loads, stores with dtype, reductions, tiling constraints, vector computations).
What it does not: parse or resolve names (frontend/syntax/), or run anything.
Invariants: a failing equation poisons its results (type `<error>`), and a poisoned operand never
gives a second diagnostic, so one mistake gives one message; the returned block is a new block (IR
nodes are frozen) whose every Var carries its type.

The locality rules (docs/design.md, "Block-locality"):
- a partial is complete only after its stage: using it inside the stage is E0501 (E0503 with a fix-it
  when it ends up scaling a tile: a row statistic that normalizes in its own stage);
- between stages only vectors and scalars are computed: anything on a matrix is E0502;
- a vector or scalar computed inside a stage stays there (E0504);
- a matrix read inside a stage is a tile load at the same position: its shape must be the stage's
  tile (or its half/double width after pairs/interleave), else E0505.
"""

from __future__ import annotations

from contextlib import suppress
from dataclasses import replace
from fractions import Fraction
from math import lcm
from typing import Any

from coda_lang.core.diagnostics import Diagnostic, Mistake
from coda_lang.frontend.verify.plan import BlockPlan, Load, Reduction, StagePlan, Store
from coda_lang.ir.nodes import Atom, Block, DimRef, Eqn, ErrAtom, Lit, Output, Param, Span, Stage, Var
from coda_lang.ir.types import (
    BOOL,
    ERROR_TYPE,
    GROUP,
    MATRIX,
    PARTIAL,
    SCALAR,
    TILE,
    VEC,
    Dim,
    Type,
    group_size,
    is_float,
    is_fp8,
    shape_str,
)
from coda_lang.ops import REGISTRY, Ctx, StageShape, grouped_reads
from coda_lang.ops.registry import COMBINES, kind_name


def _stage_text(st: Stage) -> str:
    if not st.is_gemm:
        assert st.shape is not None
        return f"elementwise {shape_str(st.shape)}"

    def opnd(a: Atom | None, t: bool) -> str:
        name = a.name if isinstance(a, Var) else getattr(a, "text", "?")
        return f"transpose({name})" if t else name

    scales = "".join(
        f", {key}={opnd(x, False)}"
        for key, x in (("scale_a", st.scale_a), ("scale_b", st.scale_b))
        if x is not None
    )
    return f"gemm {opnd(st.a, st.ta)} @ {opnd(st.b, st.tb)}{scales}"


class Checker:
    def __init__(self, block: Block, diags: list[Diagnostic]):
        self.block = block
        self.diags = diags
        self.env: dict[str, Type] = {}
        self.defined_in: dict[str, int] = {}  # var -> stage index (0-based) it was defined in
        self.stage_local: set[str] = set()  # vectors/scalars computed in a stage (can't leave it)
        self.typed: dict[str, Var] = {}
        self.reported_partials: set[str] = set()
        self.reported: set[tuple[str, str, str, int]] = set()
        self.tainted: set[str] = set()  # computed in a stage from a partial used there too early
        self.divisors: dict[str, int] = {}
        self.values = {d.name: d.value for d in block.dims if d.value is not None}
        for t in [p.var.type for p in block.params] + [o.type for o in block.outputs]:
            for d in t.shape if t else ():
                if d.name and d.coeff.denominator != 1:
                    self.divisors[d.name] = lcm(self.divisors.get(d.name, 1), d.coeff.denominator)
        self.uses = self._uses()
        self.activation = self._activation()
        self.storage: dict[str, str] = {}

    # ------------------------------------------------------------------ helpers

    def error(self, code: str, msg: str, span: Span, label: str = "", **kw: Any) -> None:
        # One message per mistake: the same error again on the same line is a cascade (e.g. four
        # products in one RoPE statement that all meet the same mis-shaped angle tile).
        key = (code, msg, span.file, span.line)
        if key in self.reported:
            return
        self.reported.add(key)
        self.diags.append(Diagnostic(code, msg, span, label=label, **kw))

    def _activation(self) -> str:
        """The dtype of the first GEMM's operand that is a parameter (a, else b); bf16 where that is fp8
        (a tile is stored in fp8 only where the program says so, with its scale). Where neither operand
        is a parameter (both quantized copies made in the block: `yq: e4m3 = y * s_y`), the dtype of
        what they are made from: the first value, searching back from a, then b, that is a matrix
        parameter or a stored value of a 16- or 32-bit float dtype (an f32 model's blocks keep f32
        tiles; bf16 before, which rounded an f32 model's saved accumulators). Else bf16."""
        for st in self.block.stages:
            if not st.is_gemm:
                continue
            for x in (st.a, st.b):
                if isinstance(x, Var):
                    for p in self.block.params:
                        if p.var.name == x.name and p.var.type is not None and is_float(p.var.type.dtype):
                            return "bf16" if is_fp8(p.var.type.dtype) else p.var.type.dtype
            return self._made_from(st.a, st.b) or "bf16"
        return "bf16"

    def _made_from(self, *xs: Any) -> str | None:
        """The float dtype (not fp8) of the first matrix parameter or annotated value that `xs` are
        computed from, breadth first; None if there is none."""
        params = {p.var.name: p.var.type for p in self.block.params}
        made: dict[str, tuple[Any, ...]] = {}
        for s in self.block.body:
            for e in s.body if isinstance(s, Stage) else (s,):
                for v in getattr(e, "outs", ()):
                    made.setdefault(v.name, tuple(getattr(e, "ins", ())))
        queue, seen = [x for x in xs if isinstance(x, Var)], set()
        while queue:
            x = queue.pop(0)
            if x.name in seen:
                continue
            seen.add(x.name)
            t = params.get(x.name)
            dtype = t.dtype if t is not None and len(t.shape) == 2 else x.annot
            if dtype and is_float(dtype) and not is_fp8(dtype):
                return dtype
            queue.extend(a for a in made.get(x.name, ()) if isinstance(a, Var))
        return None

    def _uses(self) -> dict[str, list[tuple[str, int]]]:
        """Where each name is read: ("stage", k) in stage k's body, ("operand", k), ("between", k), ("output", -1)."""
        uses: dict[str, list[tuple[str, int]]] = {}
        k = -1
        for s in self.block.body:
            if isinstance(s, Stage):
                k += 1
                for a in s.operands:
                    if isinstance(a, Var):
                        uses.setdefault(a.name, []).append(("operand", k))
                for e in s.body:
                    for a in e.ins:
                        if isinstance(a, Var):
                            uses.setdefault(a.name, []).append(("stage", k))
            else:
                for a in s.ins:
                    if isinstance(a, Var):
                        uses.setdefault(a.name, []).append(("between", k))
        for o in self.block.outputs:
            uses.setdefault(o.name, []).append(("output", -1))
        return uses

    def used_after(self, name: str, k: int) -> list[str]:
        why = []
        for where, j in self.uses.get(name, []):
            if where == "stage" and j > k:
                why.append(f"read by stage {j + 1}")
            elif where == "operand" and j > k:
                why.append(f"GEMM operand of stage {j + 1}")
            elif where == "between" and j >= k:
                why.append("read between stages")
            elif where == "output":
                why.append("block output")
        return list(dict.fromkeys(why))

    def output_dtype(self, name: str) -> str | None:
        for o in self.block.outputs:
            if o.name == name:
                return o.type.dtype
        return None

    # ------------------------------------------------------------------ operands

    def use(self, atom: Atom, span: Span, stage: StageShape | None, k: int, grouped: bool = False) -> Type:
        """The type of `atom` as seen by an equation in stage k (or between stages when stage is None).
        `grouped`: the first operand of `expand`, where a matrix whose extents are the stage's divided
        by whole group sizes is read over its groups (it stays a matrix here; expand's rule makes the
        tile)."""
        if isinstance(atom, Lit):
            return Type(atom.dtype)
        if isinstance(atom, DimRef):
            return Type("i32")
        if isinstance(atom, ErrAtom):
            return ERROR_TYPE
        t = self.env.get(atom.name)
        if t is None or t.is_error:
            return ERROR_TYPE
        here = stage is not None and self.defined_in.get(atom.name) == k
        if atom.name in self.stage_local and not here:
            j = self.defined_in[atom.name]
            self.error(
                "E0504",
                f"`{atom.name}` is computed inside stage {j + 1} and can't be used after it",
                span,
                label=f"a {kind_name(t.kind)} computed in a stage's epilogue",
                help=["compute it between stages instead, from vectors and scalars"],
            )
            self.stage_local.discard(atom.name)  # one message per value
            self.env[atom.name] = ERROR_TYPE
            return ERROR_TYPE
        if stage is None or here:
            return t
        if t.kind == MATRIX:  # a tile load
            if grouped and stage.groups_of(t.shape):
                return t  # (read over its groups: expand's rule)
            if stage.lines_up(t.shape):
                return t.with_kind(TILE)
            whole = stage.groups_of(t.shape)
            self.error(
                "E0505",
                f"`{atom.name}` is {t.dtype}{shape_str(t.shape)}, which doesn't line up with this "
                f"stage's tile {shape_str((stage.rows, stage.cols))}",
                span,
                label="read at the tile's position",
                notes=[
                    "an epilogue reads other matrices only at its own tile position (same rows; the same, "
                    "half or double columns)"
                ],
                help=[
                    f"to read one element of `{atom.name}` per group of the tile's rows and columns (a block "
                    f"scale), write `expand({atom.name}, acc)`"
                ]
                if whole
                else [],
            )
            self.env[atom.name] = ERROR_TYPE
            return ERROR_TYPE
        return t

    # ------------------------------------------------------------------ walk

    def run(self) -> tuple[Block, BlockPlan]:
        for p in self.block.params:
            assert p.var.type is not None
            self.env[p.var.name] = p.var.type
            self.typed[p.var.name] = p.var
        body: list[Any] = []
        stage_plans: list[StagePlan] = []
        between: list[list[Eqn]] = [[]]
        k = -1
        for s in self.block.body:
            if isinstance(s, Stage):
                k += 1
                st, sp = self.stage(s, k)
                body.append(st)
                stage_plans.append(sp)
                between.append([])
            else:
                e = self.eqn(s, None, k)
                body.append(e)
                between[-1].append(e)
        outputs = tuple(self.output(o) for o in self.block.outputs)
        typed = replace(self.block, body=tuple(body), outputs=outputs)
        plan = BlockPlan(
            typed, self.activation, tuple(stage_plans), tuple(tuple(b) for b in between), self.storage
        )
        return typed, plan

    def eqn(
        self, e: Eqn, stage: StageShape | None, k: int, ctx: Ctx | None = None, body: tuple[Eqn, ...] = ()
    ) -> Eqn:
        op = REGISTRY[e.op]
        spans = list(e.in_spans) + [e.span] * (len(e.ins) - len(e.in_spans))
        ins = tuple(
            self.use(a, s, stage, k, grouped=op.reads_groups and i == 0)
            for i, (a, s) in enumerate(zip(e.ins, spans, strict=True))
        )
        ctx = ctx or Ctx(stage, self.divisors, self.values)
        outs: tuple[Type, ...] = (ERROR_TYPE,) * op.nout
        partial = next(
            (i for i, (a, t) in enumerate(zip(e.ins, ins, strict=True)) if t.kind == PARTIAL), None
        )
        # A value computed from a misused partial keeps its type (so later statements and stages are still
        # checked) but is exempt from further locality complaints: one mistake, one message.
        tainted = partial is not None or any(isinstance(a, Var) and a.name in self.tainted for a in e.ins)
        if partial is not None:
            self.partial_in_stage(e, partial, spans[partial], k, body)
            completed = tuple(
                t.with_kind(VEC if t.shape else SCALAR) if t.kind == PARTIAL else t for t in ins
            )
            if not any(t.is_error for t in completed):
                with suppress(Mistake):  # on another mistake the results stay poisoned
                    outs = op.type_rule(ctx, completed, dict(e.params))  # type: ignore[misc]
        elif not any(t.is_error for t in ins):
            params = dict(e.params)
            try:
                outs = op.type_rule(ctx, ins, params)  # type: ignore[misc]
            except Mistake as m:
                span = spans[m.arg] if m.arg is not None and m.arg < len(spans) else e.span
                notes, hlp = list(m.notes), list(m.help)
                label = m.label
                if m.code == "E0502":
                    notes += self.between_note(e)
                    mats = [
                        f"`{a.name}`"
                        for a, t in zip(e.ins, ins, strict=True)
                        if isinstance(a, Var) and t.kind == MATRIX and not a.name.startswith("_t")
                    ]
                    label = label or (
                        f"{' and '.join(mats)} {'is a matrix' if len(mats) == 1 else 'are matrices'}"
                        if mats
                        else "a matrix"
                    )
                self.error(m.code, m.message, span, label=label, notes=notes, help=hlp)
        new_outs = []
        for v, t in zip(e.outs, outs, strict=True):
            t = self.annotation(v, t, e.span)
            self.env[v.name] = t
            if stage is not None:
                self.defined_in[v.name] = k
                if tainted:
                    self.tainted.add(v.name)
                elif t.kind in (VEC, SCALAR):
                    self.stage_local.add(v.name)
            nv = Var(v.name, t, v.annot)
            self.typed[v.name] = nv
            new_outs.append(nv)
        new_ins = tuple(
            self.typed.get(a.name, a)
            if isinstance(a, Var) and a.name != "acc"
            else (self.acc_var if isinstance(a, Var) else a)
            for a in e.ins
        )
        return replace(e, ins=new_ins, outs=tuple(new_outs))

    def annotation(self, v: Var, t: Type, span: Span) -> Type:
        if v.annot is None or t.is_error:
            return t
        if t.dtype == BOOL:
            self.error(
                "E0303",
                f"`{v.name}` is a comparison result and can't be stored as {v.annot}",
                span,
                help=["turn it into numbers first: `where(cond, 1.0, 0.0)`"],
            )
            return ERROR_TYPE
        if is_float(t.dtype) and v.annot == "i32":
            self.error(
                "E0303",
                f"`{v.name}` is a float and can't be stored as i32",
                span,
                help=[f"convert explicitly: `{v.name}: i32 = cast(...)`"],
            )
            return ERROR_TYPE
        out = self.output_dtype(v.name)
        if out is not None and out != v.annot:
            o = next(o for o in self.block.outputs if o.name == v.name)
            self.error(
                "E0301",
                f"`{v.name}` is annotated {v.annot} but the block declares the output as {out}",
                span,
                related=[(o.span, f"declared {out} here")],
                help=["drop the annotation or make both agree"],
            )
        return t

    def between_note(self, e: Eqn) -> list[str]:
        for a in e.ins:
            if isinstance(a, Var) and self.env.get(a.name, ERROR_TYPE).kind == MATRIX:
                if a.name in self.defined_in:
                    j = self.defined_in[a.name]
                    return [
                        f"a tile computation between stages would be a separate memory-bound kernel; do it in the "
                        f"epilogue of stage {j + 1}, which produces `{a.name}`"
                    ]
                return [
                    f"a tile computation between stages would be a separate memory-bound kernel; do it in the "
                    f"epilogue of a stage that reads `{a.name}` as a tile"
                ]
        return []

    def partial_in_stage(self, e: Eqn, i: int, span: Span, k: int, body: tuple[Eqn, ...]) -> None:
        a = e.ins[i]
        assert isinstance(a, Var)
        if a.name in self.reported_partials:
            return
        self.reported_partials.add(a.name)
        t = self.env[a.name]
        normalized = self.normalizes(a.name, e, body)
        what = COMBINES[t.combine].noun if t.combine in COMBINES else "a partial reduction"
        shown = self.shown(a.name, t, span)
        per_row = self.row_statistic(t)
        notes = [
            f"{shown} is {what}: each tile sees only its own {'columns' if per_row else 'rows'}, so it is "
            f"complete only after every tile of stage {k + 1} ran"
        ]
        if normalized is not None and (t.combine == "max" or is_fp8(self.stored_dtype(normalized))):
            self.current_scale(shown, t, normalized, span, k, notes)
        elif normalized is not None:
            self.error(
                "E0503",
                f"{'row' if per_row else 'column'} statistic {shown} is used to normalize "
                f"`{normalized}` in its own stage",
                span,
                label="not complete until the stage ends",
                notes=notes,
                help=[
                    f"defer the row scale to the epilogue of the GEMM that consumes `{normalized}`: "
                    "RMSNorm(h)*g @ W == r * ((h*g) @ W)",
                    "store the unnormalized tile here, compute the scale between stages "
                    + (
                        f"(e.g. `r = rsqrt({a.name} / D + eps)`)"
                        if t.combine == "sum" and not a.name.startswith("_t")
                        else f"from {shown}"
                    )
                    + ", and apply `acc * r` in the next stage",
                ],
            )
        else:
            self.error(
                "E0501",
                f"partial reduction {shown} is used in its own stage",
                span,
                label="not complete until the stage ends",
                notes=notes,
                help=["use it after the stage: between stages, or in a later stage's epilogue"],
            )

    def stored_dtype(self, name: str) -> str | None:
        """The dtype `name` is annotated with or declared as an output with, if any."""
        v = self.typed.get(name)
        return (v.annot if v is not None else None) or self.output_dtype(name)

    def stage_dims(self) -> tuple[Dim, Dim]:
        """The (rows, cols) of the stage being checked (M and N where its shape is unknown)."""
        acc = self.acc_var.type
        if acc is None or acc.is_error or len(acc.shape) != 2:
            return Dim.sym("M"), Dim.sym("N")
        return acc.shape[0], acc.shape[1]

    def row_statistic(self, t: Type) -> bool:
        """Whether a partial of type `t` holds one value per row of the stage (reduced over its columns)."""
        return not t.shape or t.shape[0] == self.stage_dims()[0]

    @staticmethod
    def shown(name: str, t: Type, span: Span) -> str:
        """How a diagnostic names a partial: `name`, or for a temporary the user never named (a
        reduction written inline, `_tN`) the reduction and where it is written."""
        if not name.startswith("_t"):
            return f"`{name}`"
        if t.combine is None:
            return f"the reduction at {span.line}:{span.col}"
        op = "logsumexp" if t.combine == "lse" else t.combine
        return f"`{op}(...)` at {span.line}:{span.col}"

    def current_scale(self, shown: str, t: Type, target: str, span: Span, k: int, notes: list[str]) -> None:
        """E0508: an amax (or a statistic that makes an fp8 value) over a whole row or column scales a
        tile in its own stage: rowwise *current* scaling, which no epilogue can fuse. The fix-its name
        the recipes that are local: a 1x128 group scale, or a delayed per-tensor scale. `shown`: the
        statistic as diagnostics name it (`Checker.shown`)."""
        rows, cols = self.stage_dims()
        per_row = self.row_statistic(t)
        over = cols if per_row else rows
        fp8 = self.stored_dtype(target)
        q = fp8 if fp8 is not None and is_fp8(fp8) else "e4m3"
        qmax = "448.0" if q == "e4m3" else "57344.0"
        what = "rows" if per_row else "columns"
        group = (
            f"scale per group of 128 columns instead (the 1x128 recipe, local when the tile's N is a "
            f"multiple of 128): `amax = max(abs(acc), over={cols}, group=128)`, "
            f"`{target}: {q} = acc * ({qmax} / amax)`, and store `amax` (an `f32[{rows}, {cols}/128]` output) "
            "for the dequantization"
            if per_row
            else f"scale per group of 128 rows instead (the 128x1 recipe): `amax = max(abs(acc), over={rows}, "
            f"group=128)`, `{target}: {q} = acc * ({qmax} / amax)`, and store `amax` (an "
            f"`f32[{rows}/128, {cols}]` output) for the dequantization"
        )
        self.error(
            "E0508",
            f"{shown}, a statistic of whole {what} of `{over}`, scales `{target}` in its own stage: "
            f"{'row' if per_row else 'column'}wise current scaling is not block-local",
            span,
            label="not complete until the stage ends",
            notes=notes
            + [
                f"`{target}` could be scaled only after every tile of stage {k + 1} ran: a second pass "
                "over the tensor (a separate amax and cast kernel), which is what fusing avoids"
            ],
            help=[
                group,
                f"or use a delayed per-tensor scale: take last step's scale as a scalar parameter "
                f"(`scale: f32`), quantize with it (`{target}: {q} = acc * scale`), and record this "
                f"step's amax as a partial (`amax = max(abs(acc), over={over})`, its max over the "
                f"{'rows' if per_row else 'columns'} taken between stages) for the next step",
            ],
        )

    def normalizes(self, name: str, first: Eqn, body: tuple[Eqn, ...]) -> str | None:
        """If the partial `name` flows (inside this stage) into a product or quotient with a tile, that tile's result."""
        derived = {name}
        started = False
        for e in body:
            started = started or e is first
            if not started:
                continue
            hit = [isinstance(a, Var) and a.name in derived for a in e.ins]
            if not any(hit):
                continue
            others = [a for a, h in zip(e.ins, hit, strict=True) if not h]
            if REGISTRY[e.op].scales and any(isinstance(a, Var) and self.is_tile_like(a) for a in others):
                return self.named_result(e, body)
            derived.update(v.name for v in e.outs)
        return None

    @staticmethod
    def named_result(e: Eqn, body: tuple[Eqn, ...]) -> str:
        """The user's name for the result of `e`: follows temporaries (`_tN`) to the statement they end in."""
        name = e.outs[0].name
        for later in body[body.index(e) + 1 :]:
            if not name.startswith("_t"):
                break
            if any(isinstance(a, Var) and a.name == name for a in later.ins):
                name = later.outs[0].name
        return name

    def is_tile_like(self, a: Var) -> bool:
        if a.name == "acc":
            return True
        t = self.env.get(a.name)
        return t is not None and t.kind in (TILE, MATRIX, GROUP)

    # ------------------------------------------------------------------ stages

    def stage(self, s: Stage, k: int) -> tuple[Stage, StagePlan]:
        if s.is_gemm:
            assert s.a is not None and s.b is not None
            ta = self.use(s.a, s.a_span, None, k)
            tb = self.use(s.b, s.b_span, None, k)
            shape = self.gemm_shape(s, ta, tb)
            if shape and s.scaled:
                self.gemm_scales(s, ta, tb, k)
        else:  # an elementwise stage: no GEMM, no acc
            assert s.shape is not None
            shape = (s.shape[0], s.shape[1], Dim.const(0))
        rows, cols, kdim = shape if shape else (Dim.const(1), Dim.const(1), Dim.const(1))
        st = StageShape(rows, cols)
        self.acc_var = Var("acc", Type("f32", (rows, cols), TILE) if shape else ERROR_TYPE)
        self.env["acc"], self.defined_in["acc"] = self.acc_var.type, k  # type: ignore[assignment]
        ctx = Ctx(st, self.divisors, self.values)
        body = tuple(
            self.eqn(e, st if shape else None, k, ctx, s.body) if shape else self.poison(e, k) for e in s.body
        )
        plan = self.stage_plan(s, k, st, kdim, body, ctx)
        self.end_stage(body, k)
        del self.env["acc"]

        def typed(x: Atom) -> Atom:
            return self.typed.get(x.name, x) if isinstance(x, Var) else x

        return replace(s.map_operands(typed), acc=self.acc_var if s.is_gemm else None, body=body), plan

    def gemm_scales(self, s: Stage, ta: Type, tb: Type, k: int) -> None:
        """E0411 unless each block scale is a float matrix laid out as its operand is stored, each extent
        the operand's divided by a whole group size, and both divide K into the same blocks."""
        k_groups: list[tuple[int, str]] = []
        for which, sc, span, t, trans in (
            ("a", s.scale_a, s.scale_a_span, ta, s.ta),
            ("b", s.scale_b, s.scale_b_span, tb, s.tb),
        ):
            if sc is None:
                continue
            ts = self.use(sc, span, None, k)
            if ts.is_error:
                continue
            name = sc.name if isinstance(sc, Var) else str(sc)
            kx = 0 if trans == (which == "a") else 1  # the axis of K in the operand as stored
            # DeepSeek-V3's groups: 1 x 128 for A (one scale per row and block of K), 128 x 128 for B
            want = "f32" + shape_str(
                tuple(
                    d.scale(Fraction(1, 128)) if i == kx or which == "b" else d for i, d in enumerate(t.shape)
                )
            )
            if ts.kind != MATRIX or not is_float(ts.dtype) or is_fp8(ts.dtype):
                self.error(
                    "E0411",
                    f"`scale_{which}={name}` is {ts.dtype}{shape_str(ts.shape)}; an operand's block scales are "
                    "a matrix of f32 (or bf16, f16)",
                    span,
                    label=f"a {kind_name(ts.kind)}",
                    help=[f"declare it like `{name}: {want}`"],
                )
                continue
            groups = [group_size(d, g) for d, g in zip(t.shape, ts.shape, strict=True)]
            if None in groups:
                self.error(
                    "E0411",
                    f"`scale_{which}={name}` is {shape_str(ts.shape)}, which doesn't divide the operand "
                    f"{shape_str(t.shape)} into whole groups",
                    span,
                    label="one scale per group of each extent",
                    notes=[
                        "a block scale is laid out as its operand is stored (before `transpose`), each extent "
                        "the operand's divided by a group size: `K/128` for groups of 128 along K, `M` for one "
                        "scale per row"
                    ],
                    help=[f"e.g. `{name}: {want}`"],
                )
                continue
            kg = groups[kx]
            assert kg is not None
            k_groups.append((kg, f"scale_{which}"))
        if len(k_groups) == 2 and k_groups[0][0] != k_groups[1][0]:
            self.error(
                "E0411",
                f"the block scales divide K into blocks of {k_groups[0][0]} (`scale_a`) and {k_groups[1][0]} "
                "(`scale_b`)",
                s.scale_b_span,
                label=f"blocks of {k_groups[1][0]} along K",
                notes=["each block of K is summed once and multiplied by one scale of each operand"],
            )

    def poison(self, e: Eqn, k: int) -> Eqn:
        outs = tuple(Var(v.name, ERROR_TYPE, v.annot) for v in e.outs)
        for v in outs:
            self.env[v.name] = ERROR_TYPE
            self.defined_in[v.name] = k
        return replace(e, outs=outs)

    def gemm_shape(self, s: Stage, ta: Type, tb: Type) -> tuple[Dim, Dim, Dim] | None:
        ok = True
        for t, span, name in ((ta, s.a_span, "left"), (tb, s.b_span, "right")):
            if t.is_error:
                ok = False
            elif t.kind != MATRIX:
                self.error(
                    "E0407",
                    f"the {name} GEMM operand is a {kind_name(t.kind)}, not a matrix",
                    span,
                    label=f"{t.dtype}{shape_str(t.shape)}",
                )
                ok = False
            elif not is_float(t.dtype):
                self.error(
                    "E0305",
                    f"the {name} GEMM operand is {t.dtype}; GEMMs take f32, bf16, f16, e4m3 or e5m2",
                    span,
                )
                ok = False
        if not ok:
            return None
        # The primary span covers `a @ b` (a stage's own span runs to its closing brace).
        gemm_span = Span(s.a_span.file, s.a_span.line, s.a_span.col, s.b_span.end_line, s.b_span.end_col)
        # fp8 operands may meet the other fp8 dtype (e5m2 gradients times e4m3 weights) or a wider float
        # (a derived backward's bf16 cotangent): the product is computed in f32 from the stored values
        if ta.dtype != tb.dtype and not (is_fp8(ta.dtype) or is_fp8(tb.dtype)):
            self.error(
                "E0305",
                f"GEMM operands have different dtypes: {ta.dtype} and {tb.dtype}",
                gemm_span,
                label=f"{ta.dtype} @ {tb.dtype}",
                help=["annotate the stored tile with the weight's dtype, e.g. `h: bf16 = ...`"],
            )
            return None
        r, ka = (ta.shape[1], ta.shape[0]) if s.ta else ta.shape
        kb, c = (tb.shape[1], tb.shape[0]) if s.tb else tb.shape
        if ka != kb:
            hlp = []
            if not s.tb and tb.shape[1] == ka:
                hlp = [
                    f"to multiply by the transpose of the right operand, write `{_stage_text(replace(s, tb=True))}`"
                ]
            self.error(
                "E0401",
                f"GEMM inner dimensions differ: `{ka}` and `{kb}`",
                gemm_span,
                label=f"{shape_str(ta.shape)}{' transposed' if s.ta else ''} @ "
                f"{shape_str(tb.shape)}{' transposed' if s.tb else ''}",
                help=hlp,
            )
            return None
        return r, c, ka

    def stage_plan(
        self, s: Stage, k: int, st: StageShape, kdim: Dim, body: tuple[Eqn, ...], ctx: Ctx
    ) -> StagePlan:
        loads: dict[str, Load] = {}
        grouped = grouped_reads(body, st, lambda a: self.env.get(a.name))
        for e in body:
            for a in e.ins:
                if not isinstance(a, Var) or a.name == "acc" or self.defined_in.get(a.name) == k:
                    continue
                t = self.env.get(a.name)
                if t is None or t.is_error or a.name in loads:
                    continue
                if t.kind == MATRIX:
                    role = "grouped tile" if a.name in grouped else "tile"
                elif t.kind == VEC:
                    role = "row vector" if t.shape[0] == st.rows else "column vector"
                else:
                    role = "scalar"
                loads[a.name] = Load(a.name, t.dtype, t.shape, role)
        stores: list[Store] = []
        reductions: list[Reduction] = []
        for e in body:
            for v in e.outs:
                t = v.type
                if t is None or t.is_error:
                    continue
                why = self.used_after(v.name, k)
                if REGISTRY[e.op].reduces:
                    over = e.param("over")
                    axis = (
                        "columns"
                        if (t.kind == GROUP and t.group_axis == 1)
                        or (t.kind != GROUP and t.shape and t.shape[0] == st.rows)
                        or not t.shape
                        else "rows"
                    )
                    reductions.append(
                        Reduction(
                            v.name,
                            REGISTRY[e.op].surface,
                            over if isinstance(over, Dim) else (st.cols if axis == "columns" else st.rows),
                            axis,
                            t.combine,
                            t.group,
                            t.shape,
                        )
                    )
                if t.kind == TILE and why:
                    dtype = v.annot or self.output_dtype(v.name) or self.activation
                    self.storage[v.name] = dtype
                    stores.append(Store(v.name, dtype, t.shape, tuple(why)))
                elif t.kind in (PARTIAL, GROUP) and why:
                    self.storage[v.name] = v.annot or self.output_dtype(v.name) or "f32"
        return StagePlan(
            k + 1,
            _stage_text(s),
            s.span.line,
            st.rows,
            st.cols,
            kdim,
            tuple(loads.values()),
            tuple(stores),
            tuple(reductions),
            tuple(dict.fromkeys(ctx.constraints)),
        )

    def end_stage(self, body: tuple[Eqn, ...], k: int) -> None:
        """After a stage: tiles become stored matrices, partials complete vectors."""
        for e in body:
            for v in e.outs:
                t = self.env.get(v.name, ERROR_TYPE)
                if t.is_error:
                    continue
                dtype = self.storage.get(v.name, t.dtype)
                if t.kind == TILE or t.kind == GROUP:
                    self.env[v.name] = Type(dtype, t.shape, MATRIX)
                elif t.kind == PARTIAL:
                    self.env[v.name] = Type(dtype, t.shape, VEC if t.shape else SCALAR)

    # ------------------------------------------------------------------ outputs

    def output(self, o: Output) -> Output:
        t = self.env.get(o.name)
        if t is None or t.is_error:
            return o
        if o.name in self.stage_local:
            j = self.defined_in[o.name]
            self.error(
                "E0504",
                f"output `{o.name}` is a {kind_name(t.kind)} computed inside stage {j + 1}",
                o.span,
                help=["compute it between stages instead"],
            )
            return o
        if t.shape != o.type.shape:
            self.error(
                "E0406",
                f"output `{o.name}` is declared {shape_str(o.type.shape)} but its value is "
                f"{shape_str(t.shape)}",
                o.span,
            )
            return o
        if t.dtype == BOOL or (is_float(t.dtype) and o.type.dtype == "i32"):
            self.error(
                "E0303", f"output `{o.name}` is declared {o.type.dtype} but its value is {t.dtype}", o.span
            )
        return o


def check_block(block: Block, diags: list[Diagnostic]) -> tuple[Block, BlockPlan]:
    return Checker(block, diags).run()


__all__ = ["check_block", "Param"]
