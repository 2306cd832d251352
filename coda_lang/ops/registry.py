"""The op registry: one `OpDef` per op, holding every rule the toolchain needs about it.

What it does: defines `OpDef` (built with keywords only) and the records it is made of: the rules (type
rule, `Locality`, parameters, operand `Role`s), the semantics (NumPy impl, VJP rule, `Combine` record of
a reduction, decomposition) with the facts passes ask of an op (its `Lanes` role, index axis, whether it
is a copy, a rounding, linear, exact, commutative, a comparison, selecting, a product or quotient, its
`Bound` rule, whether random programs draw it), its `Lowerings` (CuTeDSL, Triton, torch) and its doc
line; `Ctx` (what a type rule may know about where it runs) and the helpers that most type rules share
(broadcasting of tiles, vectors and scalars inside and outside a stage).
What it does not: walk a program (frontend/verify/ does), or name any op (the ops/*.py modules register
them).
Invariants: an op's surface name (how it is written) plus its keyword arguments pick exactly one
OpDef; type rules are pure and raise `Mistake` for user errors, never anything else. The registry is
the only place an op is special-cased: a pass asks an OpDef's fields, never compares an op's name
(tests/test_registry_only.py walks the package for such comparisons).

Locality classes (`Locality`): POINTWISE (output at (i, j) reads inputs at (i, j) and broadcast
vectors), PAIR (reads the pair partner column too), REDUCE (a reduction: a partial inside a stage),
INDEX (a row or column index), GATHER (pick: one column per row, a partial), VECTOR (a computation on
whole vectors, between stages only: `fold`).
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from coda_lang.core.diagnostics import Mistake
from coda_lang.ir.types import (
    ERROR_TYPE,
    FP8_MAX,
    GROUP,
    MATRIX,
    PARTIAL,
    SCALAR,
    TILE,
    VEC,
    Dim,
    Shape,
    TileConstraint,
    Type,
    group_size,
    shape_str,
)


class _Lazy:
    """A module imported on first attribute use: `np.exp` or `torch.sigmoid` in a rule imports NumPy or
    torch only when the rule runs (keeps `coda check` fast, and torch optional until it is needed)."""

    def __init__(self, module: str):
        self._module = module

    def __getattr__(self, name: str) -> Any:
        # sys.modules first: torch.compile traces a stand-in through this lookup (it can't trace importlib)
        module = sys.modules.get(self._module)
        if module is None:
            import importlib

            module = importlib.import_module(self._module)
        return getattr(module, name)


np: Any = _Lazy("numpy")
torch: Any = _Lazy("torch")


_TORCH_DTYPE_NAMES = {
    "f32": "float32",
    "bf16": "bfloat16",
    "f16": "float16",
    "e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "i32": "int32",
    "bool": "bool",
}


def torch_dtype(dtype: str) -> Any:
    """The torch dtype of a coda dtype ("f32", "bf16", "f16", "e4m3", "e5m2", "i32", "bool"): the one
    table every runtime (CUDA blocks, generated stages, the quack adapter, `coda tune`'s inputs) uses."""
    return getattr(torch, _TORCH_DTYPE_NAMES[dtype])


def torch_store(x: Any, dtype: Any) -> Any:
    """x (f32) converted for a store of the torch dtype `dtype`: an fp8 one saturates first (to +-max,
    infinities too; NaN stays NaN), as the interpreter stores it; torch's cast does not saturate
    everywhere."""
    for name, m in FP8_MAX.items():
        if dtype == torch_dtype(name):
            return x.clamp(-m, m).to(dtype)
    return x.to(dtype)


def torch_round(x: Any, dtype: str) -> Any:
    """A float tensor rounded to the coda float dtype `dtype` and back to f32 (the value stays f32):
    fp8 saturates first, to +-max, infinities included (torch's own cast to e5m2 overflows to inf), as
    the interpreter's store does (core/numerics.round_fp8)."""
    x = x.float()
    if dtype in FP8_MAX:
        m = FP8_MAX[dtype]
        x = x.clamp(-m, m)  # (NaN stays NaN)
    return x.to(torch_dtype(dtype)).float()


def as_tensor(x: Any) -> Any:
    """A torch stand-in's operand as a tensor (a Python number becomes an f32 scalar tensor)."""
    return x if isinstance(x, torch.Tensor) else torch.tensor(float(x), dtype=torch.float32)


def as_tensors(a: Any, b: Any) -> tuple[Any, Any]:
    """Both operands as tensors, a Python number taking the other one's device (and float dtype). The
    number is filled in on that device (`torch.full`): a copy from the host (`torch.tensor(x,
    device=...)`) would wait for the device's queue to drain at every such operation."""
    if isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor):
        return a, _scalar_like(b, a)
    if isinstance(b, torch.Tensor) and not isinstance(a, torch.Tensor):
        return _scalar_like(a, b), b
    return as_tensor(a), as_tensor(b)


def _scalar_like(x: Any, t: Any) -> Any:
    dtype = t.dtype if t.is_floating_point() else torch.float32
    return torch.full((), float(x), dtype=dtype, device=t.device)


def unary(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A torch stand-in of a one-operand function that also takes a Python number."""
    return lambda x: fn(as_tensor(x))


@dataclass(frozen=True)
class Combine:
    """How a reduction's per-tile partials combine, in every vocabulary the toolchain speaks.

    `name` is what a partial's `Type.combine` holds; `noun` is how diagnostics say it ("a partial sum");
    `identity` is the fold of nothing (an empty tile's partial); `numpy` and `torch` fold an array or a
    tensor along an axis (the interpreter's tile simulation, the CUDA runtime's partial combines, the
    emulated kernels and the elementwise stages all use these); `sink` is how quack's epilogue folds
    the per-element value over a tile: "add" or "max" (ColVecReduce / RowVecReduce), "lse" (quack's
    OnlineLSEReduce, along the columns only), None when no epilogue sink can fold it (the backend
    refuses it with E0705, it never folds it some other way); `negate`: the sink folds the negated
    value and the runtime negates the partials back (min(x) == -max(-x), exact); `group` is the fold
    of epi_ops.GroupedReduce for a grouped reduction ("add", "max", "min", "lse"), None if it has none.
    """

    name: str
    noun: str
    identity: float
    numpy: Callable[[Any, int], Any]
    torch: Callable[[Any, int], Any]
    sink: str | None = None
    negate: bool = False
    group: str | None = None


def _lse_numpy(x: Any, axis: int) -> Any:
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    return np.squeeze(m, axis) + np.log(np.sum(np.exp(x - m), axis=axis))


COMBINES: dict[str, Combine] = {
    c.name: c
    for c in (
        Combine(
            "sum",
            "a partial sum",
            0.0,
            lambda x, axis: np.sum(x, axis=axis),
            lambda x, axis: x.sum(axis),
            sink="add",
            group="add",
        ),
        Combine(
            "max",
            "a partial max",
            float("-inf"),
            lambda x, axis: np.max(x, axis=axis),
            lambda x, axis: x.amax(axis),
            sink="max",
            group="max",
        ),
        Combine(
            "min",
            "a partial min",
            float("inf"),
            lambda x, axis: np.min(x, axis=axis),
            lambda x, axis: x.amin(axis),
            sink="max",
            negate=True,
            group="min",
        ),
        Combine(
            "lse",
            "a partial log-sum-exp",
            float("-inf"),
            _lse_numpy,
            lambda x, axis: torch.logsumexp(x, axis),
            sink="lse",
            group="lse",
        ),
    )
}


def combine_rule(name: str | None) -> Combine:
    """The combine record of a partial's `Type.combine` (a pick's partial combines as a sum)."""
    return COMBINES[name or "sum"]


def combine_of_sink(fold: str, negate: bool = False) -> Combine:
    """The combine record of a kernel's epilogue sink: its fold ("add", "max", "max_abs" (folded as a
    max), "lse") and whether it folds the negated value (then the record is min's)."""
    fold = "max" if fold == "max_abs" else fold
    return next(c for c in COMBINES.values() if c.sink == fold and c.negate == negate)


def combine_of_group(fold: str) -> Combine:
    """The combine record of epi_ops.GroupedReduce's fold ("add", "max", "min", "lse")."""
    return next(c for c in COMBINES.values() if c.group == fold)


@dataclass(frozen=True)
class StageShape:
    """The tile space of a stage: acc is f32[rows, cols]."""

    rows: Dim
    cols: Dim

    def col_widths(self) -> tuple[Dim, ...]:
        """Column extents a tile of this stage may have: full, half (after pairs), double."""
        return (self.cols, self.cols.scale(Fraction(1, 2)), self.cols.scale(2))

    def groups_of(self, shape: tuple[Dim, ...]) -> bool:
        """Whether a matrix of `shape` is read over groups of this tile space (`expand(s, acc)` of a
        block scale): not the tile's own shape, each extent the tile's divided by a whole group size."""
        return (
            len(shape) == 2
            and shape != (self.rows, self.cols)
            and group_size(self.rows, shape[0]) is not None
            and group_size(self.cols, shape[1]) is not None
        )

    def lines_up(self, shape: tuple[Dim, ...]) -> bool:
        """Whether a matrix of `shape` is read at the tile's position (the same rows; the same, half or
        double columns), rather than over groups of the tile's rows and columns (`expand` of a block
        scale) or not at all."""
        return len(shape) == 2 and shape[0] == self.rows and shape[1] in self.col_widths()


def grouped_reads(
    eqns: Iterable[Any], stage: StageShape, type_of: Callable[[Any], Type | None]
) -> frozenset[str]:
    """The values that `eqns` (a stage's body over tile space `stage`) read over groups of the tile:
    the first operand of an op that reads groups, `expand(s, acc)`, whose second operand is a whole tile
    of the stage and whose first is a matrix not of the tile's shape, each extent the tile's divided by
    a whole group size. (A half-width matrix read so is a block scale with groups of 2 columns, not a
    tile; `expand(t, g)` of a tile to a grouped value is not such a read.) `type_of(atom)`: its type,
    or None; a stored value's may still be its stage's kind (TILE, GROUP)."""
    out: set[str] = set()
    for e in eqns:
        if not (REGISTRY[e.op].reads_groups and len(e.ins) == 2 and hasattr(e.ins[0], "name")):
            continue
        t, like = (type_of(a) if hasattr(a, "name") else None for a in e.ins)
        if (
            t is not None
            and like is not None
            and t.kind in (MATRIX, TILE, GROUP)
            and like.kind in (TILE, MATRIX)
            and like.shape == (stage.rows, stage.cols)
            and stage.groups_of(t.shape)
        ):
            out.add(e.ins[0].name)
    return frozenset(out)


@dataclass
class Ctx:
    """What a type rule may know: the stage it runs in (None between stages) and dim facts."""

    stage: StageShape | None
    # Divisor known for each dim (from `X/k` in the signature or a fixed value); used by `pairs`.
    divisors: dict[str, int] = field(default_factory=dict)
    values: dict[str, int] = field(default_factory=dict)
    constraints: list[TileConstraint] = field(default_factory=list)


@dataclass(frozen=True)
class ParamSpec:
    """A keyword argument an op takes: `over=D` (a dim), `group=128` (an int), `bf16` (a dtype),
    `approximate="none"` (a choice)."""

    name: str
    kind: str  # "dim" | "int" | "dtype" | "choice" (a string literal, one of `choices`)
    required: bool = False
    positional: bool = False  # may also be given as the next positional argument
    choices: tuple[str, ...] = ()


TypeRule = Callable[[Ctx, tuple[Type, ...], dict[str, Any]], tuple[Type, ...]]


class Locality(enum.StrEnum):
    """Where an op's result elements come from (frontend/verify's locality rules, and how every
    executor runs the op). Its members are their strings ("pointwise", ...), as docs/language.md's op
    table writes them; passes compare members (`is Locality.PAIR`), never strings."""

    POINTWISE = "pointwise"  # output at (i, j) reads inputs at (i, j) and broadcast vectors
    PAIR = "pair"  # reads the pair partner column too (pairs, interleave: see `Lanes`)
    REDUCE = "reduce"  # a reduction: a partial inside a stage, folded by its `Combine`
    INDEX = "index"  # a row or column index of the stage's tile (see `OpDef.index_axis`)
    GATHER = "gather"  # one element per row picked by an index (pick): a partial; quack's ColVecSelect
    VECTOR = "vector"  # a computation on whole vectors, between stages only (fold)

    @property
    def reduces(self) -> bool:
        """REDUCE or GATHER: a partial inside a stage, complete after it (an epilogue sink, never an
        equation of the epilogue's fn)."""
        return self in (Locality.REDUCE, Locality.GATHER)

    @property
    def per_element(self) -> bool:
        """POINTWISE or PAIR: each result element is computed from operand elements at its position
        (or its pair partner's): such an op takes broadcast, grouped and repeating operands."""
        return self in (Locality.POINTWISE, Locality.PAIR)


class Lanes(enum.Enum):
    """A pair op's role on lanes (quack's acc_pair mode holds a full-width value as two lanes, the even
    and the odd columns): SPLIT makes one half-width value of each lane (pairs), JOIN makes one
    full-width value of two half-width ones (interleave: its operands are half as wide as its result)."""

    SPLIT = "split"
    JOIN = "join"


class Role(enum.Enum):
    """What an operand is to its op, where it is not a plain value (`OpDef.roles`)."""

    VALUE = "value"
    CONDITION = "condition"  # a comparison's bool (where's first operand)
    INDEX = "index"  # an i32 vector of indices into operand 0 (pick's second operand)
    SHAPE = "shape"  # only its shape is read (expand's `like`)


class Arith(enum.Enum):
    """The arithmetic an op is, where a pass reasons about it algebraically (`OpDef.arith`)."""

    PRODUCT = "product"  # a * b: a sum of it folds as one fma (the planner's scaled sink); 0 * finite is 0
    QUOTIENT = "quotient"  # a / b


class BoundRule(enum.Enum):
    """How interp/bound.py carries the operands' rounding bounds through an op (`Bound.rule`)."""

    NUMERIC = "numeric"  # how far the impl moves when each operand moves within its bound, + own rounding
    SUM = "sum"  # a + b, a - b: the bounds add, + own rounding
    PRODUCT = "product"  # a * b: |b| E(a) + |a| E(b) + E(a) E(b), + own rounding
    QUOTIENT = "quotient"  # a / b, + own rounding
    PASS = "pass"  # 1-Lipschitz and exact (neg, copy, abs): the operand's bound
    LARGEST = "largest"  # max, min: the larger of the operands' bounds
    BRANCH = "branch"  # where(c, a, b): the chosen branch's, or either where the condition may flip
    FLIP = "flip"  # an ordering comparison: may come out either way where the operands are that close
    EXACT = "exact"  # judged exactly, bound 0: == and != (a max's ties), the indices
    MOVE = "move"  # moves values between columns (pairs, interleave): the impl applied to the bounds
    BROADCAST = "broadcast"  # the value operand's bound broadcast (expand)
    ROUND = "round"  # rounding to the `dtype` parameter (cast)
    REDUCE = "reduce"  # by the op's combine record: a sum's two orders, a max's largest bound, lse's
    GATHER = "gather"  # the picked element's bound, picked as the value is (the impl on the bounds)
    FOLD = "fold"  # runs of a vector added up: a sum of as many terms as runs


F32_U = 2.0**-24  # f32's unit roundoff
FASTMATH_ROUNDING = 2.0**-21  # a fast-math function's own rounding, relative (exp, log, rsqrt: a few ulps)


def ieee_rounding(ax: Any, ay: Any) -> Any:
    """One IEEE operation's own rounding (`Bound.own`): u |y| (the same inputs round the same, but a
    kernel may fuse a product into an add, FMA, where the interpreter rounds it)."""
    return F32_U * ay


def fastmath_rounding(ax: Any, ay: Any) -> Any:
    """The default `Bound.own`: a fast-math function's relative error, in both implementations."""
    return FASTMATH_ROUNDING * ay


@dataclass(frozen=True, kw_only=True)
class Bound:
    """An op's rule in the rounding-bound analysis (interp/bound.py, the fuzzer's tolerance): how its
    operands' bounds reach its result (`rule`; None: its locality's, `OpDef.bound_rule`), and, for the
    NUMERIC, SUM, PRODUCT and QUOTIENT rules, the bound it adds of its own where an f32 result is
    rounded or approximated: `own(ax, ay)` of |x| (its first operand's magnitude, 0 where not finite)
    and |y| (the result's; inf where it overflowed from finite operands), NumPy arrays. `moved(x, e)`:
    for a one-operand NUMERIC op, how far it may move when its operand moves by up to `e` (None: the
    larger of f(x + e) - f(x) and f(x - e) - f(x), which is right for a function monotone on the
    interval but misses a periodic one's swing: sin and cos give min(e, 2))."""

    rule: BoundRule | None = None
    own: Callable[[Any, Any], Any] = fastmath_rounding
    moved: Callable[[Any, Any], Any] | None = None


# The bound rule of an op whose `Bound` names none, by locality (a VECTOR op names its own).
_LOCALITY_BOUND = {
    Locality.POINTWISE: BoundRule.NUMERIC,
    Locality.PAIR: BoundRule.MOVE,
    Locality.REDUCE: BoundRule.REDUCE,
    Locality.GATHER: BoundRule.GATHER,
    Locality.INDEX: BoundRule.EXACT,
}


@dataclass(frozen=True, kw_only=True)
class Lowerings:
    """An op's lowerings, one per backend; None where the backend has none (the tests list which ops
    lack each, tests/test_registry.py).

    `cute`: the CuTeDSL emitter (backend_cute/plan/emit.py): operand expressions -> the expression of one
    f32 element (a pair op's emitter maps lanes: `Lanes`); `cute_imports`: the names the emitter's code
    uses beyond the emitted module's own (cute, cutlass, Float32, ...), each with the import line that
    provides it: ("pexp", "from quack.epilogue.math import pexp").
    `triton`: the Triton expression of one element for the elementwise stages' generated kernels
    (backend_triton/generate.py): the operands' expressions (f32 elements, or bool for a condition) ->
    one element's expression, written with `tl` and that module's helpers (`_exp`, `_sin`, ...:
    libdevice on the GPU). None: a stage using the op is compiled by torch.compile instead.
    `torch`: the torch stand-in, the op on torch tensors (or Python numbers) of any device, as the
    interpreter's impl computes it; used between stages by the CUDA runtime, in the emulated kernels and
    in the elementwise stages. A reduction's stand-in reduces a whole vector (partials fold by its
    `Combine`); fold's takes the size of its `into` dim.
    """

    cute: Callable[..., Any] | None = None
    cute_imports: tuple[tuple[str, str], ...] = ()
    triton: Callable[..., str] | None = None
    torch: Callable[..., Any] | None = None


@dataclass(kw_only=True)
class OpDef:
    """One op: every rule the toolchain needs about it, so that no pass names an op. Built with keywords
    only; the fields come in four groups."""

    # -- rules: how it is written, typed, and where it may run
    name: str  # IR name
    surface: str = ""  # how it is written: a call name (default: `name`), or see `infix`
    nin: int
    nout: int = 1
    infix: str | None = None  # "+", "<", ...; "neg" is prefix "-", "=" the copy `y = x`
    params: tuple[ParamSpec, ...] = ()
    type_rule: TypeRule | None = None
    locality: Locality
    roles: tuple[Role, ...] = ()  # each operand's role (default: all VALUE)

    # -- semantics
    impl: Callable[..., Any] | None = None  # NumPy implementation: the interpreter's, the oracle
    differentiable: bool = True
    # the identity in every run, through which no gradient flows (detach): autodiff drops the
    # cotangents its result gets, the kernels read it as its operand
    stops_gradient: bool = False
    vjp: Callable[..., Any] | None = None  # VJP rule, written with other ops through autodiff's builder
    combine: Combine | None = None  # reductions (and pick): how per-tile partials combine
    # a rewrite into other ops, applied when the source is lowered: `decompose(d, ins, params)` returns
    # the (op name, operands, params) of the top equation, emitting helper equations with `d.op(...)`
    # (frontend/syntax/exprs.py's Decomposer); such an op needs no impl, VJP, lowering of its own
    decompose: Callable[..., Any] | None = None
    # What the passes ask of an op (each names its readers), False/None where it does not hold:
    lanes: Lanes | None = None  # a pair op's role on lanes (emitters, autodiff, repeats, bounds)
    index_axis: int | None = None  # an INDEX op's axis: 0 the rows (row_index), 1 the columns (col_index)
    copy: bool = False  # `y = x`: the operand itself under a new name (CSE keeps it; a bare GEMM's body)
    # the operand rounded to the `dtype` parameter (cast): the same value where rounding is ignored
    # (padding values, random programs' value keys), a stored tile's value where that tile is stored
    # in that dtype (autodiff/prologue.py); its impl takes the interpreter's `precision=`
    rounds: bool = False
    linear: bool = False  # a chunked sum passes through it: f(a + b) == f(a) + f(b) (the chunker: copy, fold)
    # one IEEE operation, correctly rounded: every kernel computes it bit for bit as the interpreter
    # does from the same operands (autodiff's exact tie operands)
    exact: bool = False
    commutative: bool = False  # f(a, b) == f(b, a) (CSE's keys, random programs' value keys)
    compares: bool = False  # a comparison: a bool, only for where's condition (the planner, bounds)
    # the result is one of its operands (or elements) wherever it selects it, so it ties with that one:
    # max, min, where, abs; a reduction that selects (max, min) shares its cotangent among ties (`ties`)
    selects: bool = False
    arith: Arith | None = None  # a product or quotient (the planner's fma fold, padding, the checker)
    bound: Bound = field(default_factory=Bound)  # its rule in the rounding-bound analysis
    random_programs: bool = True  # testing/programs.py's random forward blocks may draw it
    # its first operand, in a stage, may be a matrix read over groups of the tile (expand of a block
    # scale: the checker lets it through, autodiff takes no gradient through it)
    reads_groups: bool = False

    # -- lowerings, one per backend
    lower: Lowerings = field(default_factory=Lowerings)

    # -- docs
    operand_names: tuple[str, ...] = ()  # the operands as docs/language.md's op table writes them
    doc: str = ""  # one line for the language reference (docs/language.md's op table)

    def __post_init__(self) -> None:
        self.surface = self.surface or self.name
        assert len(self.roles) in (0, self.nin), (self.name, self.roles)
        assert (self.index_axis is not None) == (self.locality is Locality.INDEX), self.name
        assert (self.lanes is not None) == (self.locality is Locality.PAIR), self.name

    def role(self, i: int) -> Role:
        """The role of operand i."""
        return self.roles[i] if self.roles else Role.VALUE

    @property
    def reduces(self) -> bool:
        """A partial inside a stage (REDUCE or GATHER locality)."""
        return self.locality.reduces

    @property
    def ties(self) -> bool:
        """A reduction whose result is one of its elements (max, min): its VJP shares the cotangent
        among the elements that attain it, so autodiff compares operand and result exactly (an f32
        copy of the operand, a tie count before the site)."""
        return self.selects and self.locality is Locality.REDUCE

    @property
    def bound_rule(self) -> BoundRule:
        """Its rule in the rounding-bound analysis: `bound.rule`, or its locality's."""
        rule = self.bound.rule or _LOCALITY_BOUND.get(self.locality)
        assert rule is not None, f"`{self.name}` ({self.locality}) names no bound rule"
        return rule

    @property
    def broadcasts(self) -> bool:
        """Its value operand broadcast to the shape of an operand only its shape is read of (expand)."""
        return Role.SHAPE in self.roles

    @property
    def scales(self) -> bool:
        """A product or quotient: a partial flowing into one with a tile scales (normalizes) the tile."""
        return self.arith is not None

    def accepts(self, nargs: int, kwargs: set[str]) -> bool:
        """Whether a call with these positional and keyword arguments means this op."""
        positional = [p.name for p in self.params if p.positional]
        if not self.nin <= nargs <= self.nin + len(positional):
            return False
        given = set(kwargs) | set(positional[: nargs - self.nin])  # a required one may come either way
        required = {p.name for p in self.params if p.required}
        return required <= given and kwargs <= {p.name for p in self.params}


REGISTRY: dict[str, OpDef] = {}  # the ops equations of the IR may have
SUGAR: dict[str, OpDef] = {}  # ops with a `decompose` rule: written in source, never in the IR
BY_SURFACE: dict[str, list[OpDef]] = {}


def register(op: OpDef) -> OpDef:
    assert op.name not in REGISTRY and op.name not in SUGAR, op.name
    (SUGAR if op.decompose is not None else REGISTRY)[op.name] = op
    BY_SURFACE.setdefault(op.infix or op.surface, []).append(op)
    return op


def resolve(surface: str, nargs: int, kwargs: set[str]) -> OpDef | None:
    """The op a call `surface(args..., kwargs...)` means, or None."""
    for op in BY_SURFACE.get(surface, []):
        if op.accepts(nargs, kwargs):
            return op
    return None


def call_names() -> list[str]:
    return sorted(s for s, ops in BY_SURFACE.items() if s.isidentifier())


# ----------------------------------------------------------------------------------------------
# Shared pieces of type rules


def axis_of(ctx: Ctx, dim: Dim, tile: Shape, what: str) -> int:
    """Which axis of a tile shape `dim` names (0 rows, 1 columns); Mistake when none or both."""
    hits = [i for i, d in enumerate(tile) if d == dim]
    if len(hits) == 2:
        raise Mistake(
            "E0405",
            f"{what} over `{dim}` is ambiguous: the tile is {shape_str(tile)}",
            notes=["both axes of the tile have the same extent, so rows and columns can't be told apart"],
        )
    if not hits:
        raise Mistake("E0404", f"{what} over `{dim}`, but the operand is {shape_str(tile)}")
    return hits[0]


def _outer(ctx: Ctx, a: Dim, b: Dim) -> Shape:
    """Shape of the outer product of a vector over `a` and one over `b` inside a stage."""
    st = ctx.stage
    assert st is not None
    rows_a, rows_b = a == st.rows, b == st.rows
    if rows_a and b in st.col_widths() and not rows_b:
        return (a, b)
    if rows_b and a in st.col_widths() and not rows_a:
        return (b, a)
    if rows_a and rows_b:
        raise Mistake(
            "E0405",
            f"vectors over `{a}` and `{b}`: both could be rows of the tile {shape_str((st.rows, st.cols))}",
        )
    raise Mistake(
        "E0402",
        f"vectors over `{a}` and `{b}` don't form a tile of this stage ({shape_str((st.rows, st.cols))})",
        notes=[
            "a vector times a vector makes a tile only when one runs over the rows and the other over the columns"
        ],
    )


def fixed_size(ctx: Ctx, d: Dim) -> int | None:
    """The size of `d` when the program fixes it (a constant, or a multiple of a dim declared `X = n`),
    else None."""
    if d.name is not None and d.name not in ctx.values:
        return None
    n = d.evaluate(ctx.values)
    return int(n) if n.denominator == 1 and n > 0 else None


def repeats_in(d: Dim, rows: Dim | None, cols: Dim | None) -> bool:
    """Whether a vector over `d` used in a stage of tile space (rows, cols) (between stages: both None)
    is one that repeats across the columns (docs/language.md, "Vectors that repeat"): it runs over
    neither the rows nor the stage's column dim (cols, half or double: the same name). In a checked
    program such a vector is over a dim of fixed size and meets a tile (or is expanded to a vector)."""
    if rows is None or cols is None:
        return True
    return d != rows and d.name != cols.name


def check_repeat(ctx: Ctx, d: Dim, width: Dim, tile: Shape | None = None) -> None:
    """A vector over `d` repeating across columns of extent `width` (of the tile shape `tile`, if any):
    `d` must have a fixed size (E0404 otherwise, as any vector over a dim the tile doesn't have) that
    divides the width when the width is known (E0410)."""
    g = fixed_size(ctx, d)
    if g is None:
        where = f"the operand is {shape_str(tile)}" if tile is not None else f"the columns are `{width}`"
        raise Mistake(
            "E0404",
            f"a vector over `{d}`, but {where}",
            notes=[
                "a vector over another dim than the rows and the columns repeats across the columns only "
                f"when its dim has a fixed size (`dims {d.name or 'G'} = 128`); `{d}` has none"
            ],
        )
    w = fixed_size(ctx, width)
    if w is not None and w % g:
        raise Mistake(
            "E0410",
            f"a vector over `{d}` ({g} values) repeats across `{width}` columns, which are {w}: "
            f"not a multiple of {g}",
            notes=[f"column c reads element c mod {g}: the columns must hold whole copies of the vector"],
        )


def broadcast(ctx: Ctx, types: tuple[Type, ...], dtype: str) -> Type:
    """Result type of a pointwise op on `types`: scalars, vectors, tiles and groups broadcast. Inside a
    stage, a vector over a dim of fixed size other than the rows and the columns repeats across the
    columns of a tile operand (docs/language.md, "Vectors that repeat")."""
    if any(t.is_error for t in types):
        return ERROR_TYPE
    if ctx.stage is None:
        return _broadcast_outside(types, dtype)
    tiles = [t for t in types if t.kind == TILE]
    groups = [t for t in types if t.kind == GROUP]
    vecs = [t for t in types if t.kind == VEC]
    shape: Shape | None = None
    for t in tiles:
        if shape is not None and t.shape != shape:
            raise Mistake("E0402", f"tile shapes differ: {shape_str(shape)} and {shape_str(t.shape)}")
        shape = t.shape
    group: int | None = None
    group_axis = 1
    for g in groups:
        assert g.group is not None
        full = g.grouped_shape()
        if group is not None and g.group_axis != group_axis:
            raise Mistake("E0402", "a value grouped over the rows meets one grouped over the columns")
        group_axis = g.group_axis
        if shape is not None and full != shape:
            if tiles:
                raise Mistake(
                    "E0402",
                    f"a grouped value over {shape_str(full)} doesn't broadcast to the tile {shape_str(shape)}",
                )
            raise Mistake("E0402", f"grouped values differ: {shape_str(shape)} and {shape_str(full)}")
        if group is not None and g.group != group:
            raise Mistake("E0402", f"grouped values with groups of {group} and {g.group} columns")
        shape, group = full, g.group
    if shape is None:  # only vectors and scalars
        dims = sorted({t.shape[0] for t in vecs})
        if not dims:
            return Type(dtype)
        if len(dims) == 1:
            return Type(dtype, (dims[0],), VEC)
        st = ctx.stage
        lone = [d for d in dims if fixed_size(ctx, d) is not None and repeats_in(d, st.rows, st.cols)]
        if lone:
            raise Mistake(
                "E0402",
                arg=next(i for i, t in enumerate(types) if t.kind == VEC and t.shape[0] == lone[0]),
                message=f"a vector over `{lone[0]}` meets vectors over "
                + ", ".join(f"`{d}`" for d in dims if d != lone[0])
                + " but no tile",
                notes=[
                    f"a vector over `{lone[0]}` repeats across the columns of a tile it meets; with vectors "
                    "alone there are no columns to repeat it across"
                ],
                help=["use it with the tile first, e.g. `(acc * r) * g`, or expand it: `expand(g, acc)`"],
            )
        if len(dims) > 2:
            raise Mistake("E0402", "vectors over " + ", ".join(f"`{d}`" for d in dims) + " in one op")
        shape = _outer(ctx, dims[0], dims[1])
        return Type(dtype, shape, TILE)
    for i, v in enumerate(types):
        if v.kind != VEC:
            continue
        d = v.shape[0]
        if tiles and d not in shape and repeats_in(d, shape[0], shape[1]):
            try:
                check_repeat(ctx, d, shape[1], shape)  # repeats every `d` columns of the tile
            except Mistake as m:
                m.arg = i  # point at the vector
                raise
            continue
        axis_of(ctx, d, shape, "a vector")
    if group is not None and not tiles:
        if group_axis == 0:  # one value per column and run of rows: column vectors broadcast over it
            if any(v.shape[0] != shape[1] for v in vecs):
                raise Mistake("E0402", "a row vector can't broadcast over a value grouped over the rows")
            return Type(
                dtype, (shape[0].scale(Fraction(1, group)), shape[1]), GROUP, group=group, group_axis=0
            )
        if any(v.shape[0] != shape[0] for v in vecs):
            raise Mistake("E0402", "a column vector can't broadcast over a grouped value")
        return Type(dtype, (shape[0], shape[1].scale(Fraction(1, group))), GROUP, group=group)
    return Type(dtype, shape, TILE)


def _broadcast_outside(types: tuple[Type, ...], dtype: str) -> Type:
    for t in types:
        if t.kind == MATRIX:
            raise Mistake("E0502", "tile computation between stages")
    dims = {t.shape[0] for t in types if t.kind == VEC}
    if len(dims) > 1:
        a, b = sorted(dims)[:2]
        raise Mistake(
            "E0402",
            f"vectors over `{a}` and `{b}` have different lengths",
            notes=["between stages only vectors and scalars are computed; an outer product would be a tile"],
        )
    if dims:
        return Type(dtype, (dims.pop(),), VEC)
    return Type(dtype)


_KIND_NAMES = {VEC: "vector", PARTIAL: "partial reduction", GROUP: "grouped reduction"}


def kind_name(kind: str) -> str:
    """A kind as messages say it: `vector`, not `vec`."""
    return _KIND_NAMES.get(kind, kind)


def require_tile(t: Type, what: str) -> None:
    if t.is_error:
        return
    if t.kind == MATRIX:
        raise Mistake("E0502", f"{what} on a matrix between stages")
    if t.kind != TILE:
        raise Mistake("E0506", f"{what} needs a tile, got a {kind_name(t.kind)}", arg=0)


__all__ = [
    "Arith",
    "Bound",
    "BoundRule",
    "COMBINES",
    "F32_U",
    "FASTMATH_ROUNDING",
    "GROUP",
    "MATRIX",
    "PARTIAL",
    "SCALAR",
    "TILE",
    "VEC",
    "Combine",
    "Ctx",
    "Lanes",
    "Locality",
    "Lowerings",
    "OpDef",
    "ParamSpec",
    "StageShape",
    "REGISTRY",
    "SUGAR",
    "as_tensor",
    "torch_dtype",
    "as_tensors",
    "axis_of",
    "broadcast",
    "combine_of_group",
    "combine_of_sink",
    "check_repeat",
    "combine_rule",
    "fixed_size",
    "kind_name",
    "register",
    "repeats_in",
    "require_tile",
    "resolve",
    "Role",
    "fastmath_rounding",
    "ieee_rounding",
    "np",
    "torch",
    "unary",
]
