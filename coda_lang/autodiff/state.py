"""The state of one derivation, shared by the schedule (reverse.py) and the epilogue VJPs (site.py).

What it does: `State` holds what the backward being built has so far: the forward facts, the names
generator, the builder and the backward types, the backward body and parameters, the cotangent
contributions waiting for their value's VJP, each stage's `dacc`, the report, and `reads`, the one
record of what the backward reads from the forward and how (`Read`: a forward parameter, a saved
tensor, or a value recomputed between stages or in a stage's backward). Its methods are the only
way the schedule, the sites and assemble.py change it (they read its fields directly): `read_*` and
`recompute*` (forward values); `cotangent_param`, `add_cotangent`, `take_cotangents`,
`sum_cotangents`, `accumulate`, `name_cotangent` and `set_dacc` (cotangents); `open_stage`,
`close_stage`, `between_stages` and `emit` (the backward body, whose equations the builder `b`
emits); `note` (the report).
What it does not: decide what to differentiate, where a VJP runs, or how a cotangent is unbroadcast
(reverse.py, site.py, unbroadcast.py). Whether a forward value is saved or recomputed is decided in
two places, by the kind of value: `read_between` here (a value read at block level) and
`Site.primal` (in a stage's backward); both record the choice in `reads`.
A stored tile the policy has made again (in a stage's backward, or at the backward's start by
prologue.py) is read from `made` instead of a saved copy.
Invariants:
- every forward value the backward reads is in `reads`, once per way it is read (a value recomputed
  in a stage's backward: once per place); `saved()` (what the forward must store) is exactly its
  SAVED reads, in the order the backward first asked for them;
- a forward parameter or saved tensor is one parameter of the backward block, of the name it has in
  the forward (`acc` of stage k: a fresh `acck`); a recomputed value reuses the forward name when free;
- cotangent contributions are kept by forward name, in the order they were made (sums add them in
  that order), until the VJP of that value's equation takes them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from coda_lang.autodiff.builder import Builder, Names
from coda_lang.autodiff.forward import ForwardFacts
from coda_lang.ir.nodes import Atom, Eqn, Lit, Param, Span, Stage, Stmt, Var
from coda_lang.ir.types import GROUP, MATRIX, PARTIAL, SCALAR, TILE, VEC, Type, is_float, is_fp8
from coda_lang.ops import StageShape

PARAM = "param"  # a forward parameter, passed to the backward too
SAVED = "saved"  # stored by the forward (an extra output where it doesn't store it anyway)
RECOMPUTED = "recomputed"  # computed again by the backward from what it reads


@dataclass(frozen=True)
class Read:
    """A forward value the backward reads, and how."""

    value: str  # a forward name, or "acc" (the accumulator of forward stage `stage`, before its epilogue)
    how: str  # PARAM, SAVED or RECOMPUTED
    name: str  # what holds it in the backward block
    type: Type  # its type there
    # "acc", or SAVED under a name of its own (an f32 copy of a tile: `read_exact`): its forward stage;
    # RECOMPUTED: the forward stage whose backward recomputes it in its epilogue (or in a stage
    # counting its ties, or, for a tile made at the backward's start, the stage that defines it);
    # None: between stages (or not a stage's)
    stage: int | None = None


@dataclass(frozen=True)
class Gemm:
    """A GEMM of the backward: `gemm [transpose(]a[)] @ [transpose(]b[)]`, its operands' block scales
    (`scale_a=`, `scale_b=`: a forward operand's own, which goes with it), and `out_scale`: the block
    scale of the forward operand whose cotangent it gives, laid out as that operand (and this GEMM's
    output) is stored; its acc is multiplied by it, read over its groups (`expand`)."""

    a: Atom
    b: Atom
    ta: bool
    tb: bool
    scale_a: Atom | None = None
    scale_b: Atom | None = None
    out_scale: Atom | None = None

    def stage(self, body: tuple[Eqn, ...], span: Span) -> Stage:
        """This GEMM as a backward stage whose epilogue is `body`."""
        return Stage(
            self.a,
            self.b,
            self.ta,
            self.tb,
            Var("acc"),
            body,
            span=span,
            scale_a=self.scale_a,
            scale_b=self.scale_b,
        )


class State:
    """Everything the schedule and the sites share while one backward block is built."""

    def __init__(self, fwd: ForwardFacts):
        self.fwd = fwd
        self.names = Names(fwd.names())
        self.claimed: set[str] = set()  # forward names taken by the backward
        self.types: dict[str, Type] = {}  # backward name -> type as seen at block level
        self.b = Builder(self.names, self.types, fwd.divisors, fwd.dim_values)
        self.body: list[Stmt] = []
        self.bparams: dict[str, Param] = {}
        self.reads: list[Read] = []
        self._read: dict[tuple[str, str, int | None], Read] = {}  # (how, value, stage) -> its read
        self.ct: dict[str, list[Atom]] = {}  # block-level cotangent contributions, by forward name
        self.dacc: dict[int, Atom] = {}  # forward stage -> the cotangent of its acc (a matrix)
        self.cotangents: dict[str, str] = {}  # forward output -> the backward parameter of its cotangent
        self.cosmetic: dict[str, str] = {}  # temporaries that hold a named value's cotangent -> `d<name>`
        # (span, text, gemm): kept if an elementwise stage (a GEMM stage, when `gemm`) at `span` survives
        # dead-code removal
        self.report: list[tuple[Span, str, bool]] = []
        # forward tile -> the backward matrix holding it, recomputed and stored by a stage's backward
        # (remat in an epilogue) or by an elementwise stage at the backward's start (prologue.py):
        # read instead of a saved copy by whatever runs after that stage
        self.made: dict[str, str] = {}
        self.made_dtype: dict[str, str] = {}  # such a matrix -> its storage dtype (the forward's)
        # fp8 cotangents (BackwardOptions.fp8_grads): the dtype a quantized dacc is stored in; each
        # quantized dacc matrix -> its scale (an input of the backward); each scale -> the output
        # holding this step's amax of the cotangent it scales
        self.fp8_grads: str | None = None
        self.qscale: dict[str, str] = {}
        self.scales: dict[str, str] = {}
        # BackwardOptions.fp8_acc: a GEMM stage's acc read from the fp8 copy the stage stores, where it
        # stores one (`acc_copy`)
        self.fp8_acc = False
        # BackwardOptions.requantize_wgrad, and the operands quantized again for it (Reverse.requantized)
        self.requantize_wgrad = False
        self.requantized: list[str] = []
        self.acc_copies: dict[int, tuple[str, Var | Lit]] = {}  # stage -> (its copy, its scale) read as acc

    # ------------------------------------------------------------------ names and parameters

    def _claim(self, name: str) -> str:
        """A forward name reused in the backward for a recomputed value, when no other value has it. A
        value the forward stores keeps its name for the saved tensor the backward may read (a parameter
        of the backward block, claimed when it is read as saved, at any point of the derivation), so a
        recomputed copy of it (a max's ties compare the f32 value, not the stored one) gets a fresh name."""
        if name not in self.claimed and name not in self.fwd.storage:
            self.claimed.add(name)
            return name
        return self.names.fresh(name)

    def _param(self, name: str, t: Type) -> Var:
        """A parameter of the backward block (a cotangent or a saved tensor)."""
        if name not in self.bparams:
            self.bparams[name] = Param(Var(name, t), None, self.fwd.block.span)
            self.types[name] = t
        return Var(name)

    def cotangent_param(self, output: str, t: Type) -> None:
        """The cotangent of forward output `output`: a parameter `d<output>` of the backward block."""
        name = self.names.fresh(f"d{output}")
        self.cotangents[output] = name
        self.add_cotangent(output, self._param(name, t))

    def note(self, span: Span, text: str, gemm: bool = False) -> None:
        """A line of the derivation's report about the (elementwise, or `gemm`) stage at `span`
        (dropped if the stage is)."""
        self.report.append((span, text, gemm))

    # ------------------------------------------------------------------ reading the forward

    def _record(self, r: Read, key: tuple[str, str, int | None] | None = None) -> Read:
        self.reads.append(r)
        if key is not None:
            self._read[key] = r
        return r

    def saved(self) -> list[str]:
        """The names of the saved tensors, in the order the backward first read them."""
        return [r.name for r in self.reads if r.how == SAVED]

    def read_param(self, name: str) -> Var:
        """A forward parameter."""
        if (PARAM, name, None) not in self._read:
            p = self.fwd.params[name]
            assert p.var.type is not None
            self.claimed.add(name)
            self.bparams[name] = Param(p.var, p.default, p.span)
            self.types[name] = p.var.type
            self._record(Read(name, PARAM, name, p.var.type), (PARAM, name, None))
        return Var(name)

    def read_saved(self, name: str) -> Var:
        """A forward value the backward reads as saved: a stored tile or a complete vector (or the
        copy of that tile a stage's backward recomputed and stored before, when there is one)."""
        if name in self.made:
            return Var(self.made[name])
        if (SAVED, name, None) not in self._read:
            t = self.fwd.ftype[name]
            storage = self.fwd.storage
            self.claimed.add(name)
            if t.kind in (TILE, GROUP):
                bt = Type(self.fwd.tile_dtype(name), t.shape, MATRIX)
            elif t.kind == PARTIAL:
                bt = Type(storage.get(name, "f32"), t.shape, VEC if t.shape else SCALAR)
            else:
                bt = Type("f32" if is_float(t.dtype) else t.dtype, t.shape, t.kind)
            self._record(Read(name, SAVED, name, bt), (SAVED, name, None))
            self._param(name, bt)
        return Var(name)

    def read_operand(self, a: Atom) -> Var:
        """A forward GEMM operand: a parameter or a saved matrix."""
        assert isinstance(a, Var)
        return self.read_param(a.name) if a.name in self.fwd.params else self.read_saved(a.name)

    def read_acc(self, k: int) -> Var:
        """Forward stage k's acc, saved (in `fwd.acc_dtype(k)`)."""
        key = (SAVED, "acc", k)
        if key not in self._read:
            name = self.names.fresh(f"acc{k + 1}")
            acc = self.fwd.block.stages[k].acc
            assert acc is not None and acc.type is not None
            t = Type(self.fwd.acc_dtype(k), acc.type.shape, MATRIX)
            self._record(Read("acc", SAVED, name, t, k), key)
            self._param(name, t)
        return Var(self._read[key].name)

    def acc_copy(self, k: int) -> tuple[str, Var | Lit] | None:
        """Stage k's fp8 copy of its acc and that copy's scale, where the backward reads acc from it
        (`fp8_acc` given, and `ForwardFacts.acc_copy` finds one), else None. Not where the backward
        needs acc exactly (`ForwardFacts.acc_exact`: a max/min reduction's ties compare it)."""
        if not self.fp8_acc or self.fwd.acc_exact(k):
            return None
        return self.fwd.acc_copy(k)

    def read_exact(self, name: str, k: int) -> Var:
        """Stage k's tile `name` as the forward computed it, in f32 before any rounding: a copy the
        forward stores for the backward (`ForwardFacts.tie_operands`: what a max/min reduction's ties
        compare, bit for bit), under a fresh name `<name>_f32`."""
        key = (SAVED, name, k)
        if key not in self._read:
            t = Type("f32", self.fwd.ftype[name].shape, MATRIX)
            fresh = self.names.fresh(f"{name}_f32")
            self._record(Read(name, SAVED, fresh, t, k), key)
            self._param(fresh, t)
        return Var(self._read[key].name)

    def read_between(self, a: Atom) -> Atom:
        """A forward value at block level: a parameter, a saved tensor, or a value recomputed between
        stages (a stage-local vector; a mask or index computed between stages)."""
        if not isinstance(a, Var):
            return a
        fwd = self.fwd
        if a.name in fwd.params:
            return self.read_param(a.name)
        t = fwd.ftype[a.name]
        if a.name in fwd.fstage and t.kind in (VEC, SCALAR):  # a stage-local vector: recompute it
            return self.recompute_between(a.name)
        if a.name not in fwd.fstage and not is_float(t.dtype):  # a mask or index between stages: recompute
            return self.recompute_between(a.name)
        return self.read_saved(a.name)

    def recompute_between(self, name: str) -> Var:
        """A forward value recomputed between stages (once), from values read the same way."""
        got = self._read.get((RECOMPUTED, name, None))
        if got is not None:
            return Var(got.name)
        e = self.fwd.fdef[name]
        self.recompute(e, [self.read_between(a) for a in e.ins], None)
        return Var(self._read[(RECOMPUTED, name, None)].name)

    def is_saved(self, name: str) -> bool:
        """Whether forward value `name` was read as a saved tensor so far."""
        return (SAVED, name, None) in self._read

    def recompute(
        self, e: Eqn, ins: list[Atom], stage: int | None, store: str | None = None
    ) -> tuple[Var, ...]:
        """Forward equation `e` emitted again on `ins` (with its span): between stages (stage None,
        remembered for later reads) or in the backward of forward stage `stage` (its site caches it).
        `store` (a dtype): its one output is stored by that stage, under its forward name, as the
        forward stores it, for what runs later to read instead of a saved copy (`made`)."""
        b = self.b
        prev = b.span
        b.span = e.span
        if store is not None:
            (v,) = e.outs
            assert v.name not in self.claimed and not self.is_saved(v.name)
            self.claimed.add(v.name)
            self.names.taken.add(v.name)
            outs = b.ops(e.op, *ins, names=(v.name,), annot=store, params=dict(e.params))
            self.made[v.name] = v.name
            self.made_dtype[v.name] = store
        else:
            outs = b.ops(e.op, *ins, names=tuple(self._claim(v.name) for v in e.outs), params=dict(e.params))
        b.span = prev
        for o, v in zip(outs, e.outs, strict=True):
            read = Read(v.name, RECOMPUTED, o.name, self.types[o.name], stage)
            self._record(read, (RECOMPUTED, v.name, None) if stage is None else None)
        return outs

    # ------------------------------------------------------------------ cotangents

    def add_cotangent(self, name: str, c: Atom) -> None:
        """A contribution to the cotangent of forward value `name`, of its type after its stage."""
        self.ct.setdefault(name, []).append(c)

    def has_cotangent(self, name: str) -> bool:
        return name in self.ct

    def take_cotangents(self, name: str) -> list[Atom]:
        """The contributions to `name`'s cotangent so far (they are the taker's now)."""
        return self.ct.pop(name, [])

    def sum_cotangents(self, name: str) -> Atom | None:
        """The cotangent of `name` at block level: the sum of its contributions (None: it has none)."""
        total: Atom | None = None
        for p in self.take_cotangents(name):
            total = p if total is None else self.b.add(total, p)
        self.name_cotangent(total, name)
        return total

    def accumulate(self, value: Atom, name: str) -> Atom:
        """value + every earlier matrix contribution to `name` that the stage being built can load
        (residual accumulation); the others stay."""
        keep = []
        b = self.b
        st = b.stage
        for part in self.ct.pop(name, []):
            t = b.type_of(part)
            if t.kind == TILE and st is not None and t.shape[0] == st.rows and t.shape[1] in st.col_widths():
                value = b.add(value, part)
            else:
                keep.append(part)
        if keep:
            self.ct[name] = keep
        return value

    def name_cotangent(self, total: Atom | None, name: str) -> None:
        """Give the cotangent of a user-named value the name `d<name>` in the printed backward."""
        if (
            isinstance(total, Var)
            and total.name.startswith("_t")
            and not name.startswith("_t")
            and name != "acc"
            and total.name not in self.cosmetic
        ):
            self.cosmetic[total.name] = self.names.fresh(f"d{name}")

    def quantizes(self, k: int) -> bool:
        """Whether forward stage k's dacc is stored in fp8: `fp8_grads` is given and one of the stage's
        GEMM operands is fp8 (its dgrad and wgrad GEMMs then multiply fp8 by fp8)."""
        st = self.fwd.block.stages[k]
        return (
            self.fp8_grads is not None
            and st.is_gemm
            and any(is_fp8(self.fwd.stored_dtype(x)) for x in (st.a, st.b))
        )

    def grad_scale(self, k: int) -> tuple[Var, str]:
        """(The scale of forward stage k's quantized dacc, a scalar input of the backward; the name of
        the output holding this step's amax of that cotangent, unscaled)."""
        name = self.names.fresh(f"dacc{k + 1}_scale")
        amax = self.names.fresh(f"dacc{k + 1}_amax")
        self.scales[name] = amax
        return self._param(name, Type("f32", (), SCALAR)), amax

    def dequantize(self, gemm: Gemm, acc: Atom) -> Atom:
        """`acc`, the accumulator of a GEMM on operands `gemm` (in the stage being built), as the
        cotangent product it stands for: times the inverse scale of the quantized dacc it reads, if any
        (one multiply in the epilogue, as the forward folds its own inverse scale), and times the block
        scale of the forward operand it is the cotangent of (`gemm.out_scale`, read over its groups)."""
        for x in (gemm.a, gemm.b):
            if isinstance(x, Var) and x.name in self.qscale:
                inv = self.b.div(Lit(1.0, "f32"), Var(self.qscale[x.name]))  # hoisted: a scalar
                acc = self.b.mul(acc, inv)
                break
        if gemm.out_scale is not None:
            acc = self.b.mul(acc, self.b.op("expand", self.read_operand(gemm.out_scale), Var("acc")))
        return acc

    def set_dacc(self, k: int, dacc: Atom) -> None:
        """The cotangent of forward stage k's acc: a matrix of its GEMM operands' dtype."""
        self.dacc[k] = dacc

    # ------------------------------------------------------------------ the backward body

    def emit(self, stmts: Iterable[Stmt]) -> None:
        self.body.extend(stmts)

    @contextmanager
    def between_stages(self) -> Iterator[None]:
        """Equations the builder emits inside the `with` run between stages, at this point of the body."""
        self.b.out = []
        yield
        self.body.extend(self.b.out)
        self.b.out = []

    def open_stage(self, shape: StageShape, acc: bool = True) -> None:
        """Start a stage's body in the builder, of tile space `shape`; `acc` (f32 tiles of that shape)
        is defined in it unless `acc` is False."""
        b = self.b
        b.out, b.before = [], []
        b.stage = shape
        b.local = {"acc"} if acc else set()
        if acc:
            self.types["acc"] = Type("f32", (shape.rows, shape.cols), TILE)
        else:
            self.types.pop("acc", None)

    def close_stage(self) -> tuple[list[Eqn], list[Eqn]]:
        """(vector computations hoisted out of the stage, to run just before it; the stage's body)."""
        b = self.b
        body, before = b.out, b.before
        # after the stage: tiles are stored matrices, partials complete vectors
        for name in b.local:
            t = self.types.get(name)
            if t is None:
                continue
            if t.kind in (TILE, GROUP):
                self.types[name] = Type(self.made_dtype.get(name, t.dtype), t.shape, MATRIX)
            elif t.kind == PARTIAL:
                self.types[name] = Type(t.dtype, t.shape, VEC if t.shape else SCALAR)
        self.types.pop("acc", None)
        b.stage, b.local, b.out, b.before = None, set(), [], []
        return before, body
