"""The data model of a compiled stage: `StageSpec`, what one GEMM stage's quack epilogue is made of.

What it does: defines the records the planner fills and the emitter, the runtime and the emulator read:
the operands the epilogue loads (`Operand`: quack's ColVecLoad / RowVecLoad / TileLoad / Scalar, or
the GEMM's C operand in packed mode), the tiles it stores (`Output`: quack's D or a TileStore), the
partial reductions it folds (`Sink`), the grouped reductions complete in a tile (`Group`), the GEMM
(`Gemm`), and the epilogue mode (`Mode`: "element", "acc_pair", "packed_cd_b16x2"); `describe` turns a
spec into the human lines of the emitted source's header. docs/backend.md explains the modes and limits.
Each closed set of names (a mode, an operand's role, a quack op, a sink's fold and layout) is a
`Literal` type: mypy checks every record built and every comparison's spelling, and the names print
as they always did (the emitted source is a golden file); `member` turns a name that arrives as a
plain string (the checker's plan, an op's combine record) into one, or raises.
What it does not: decide anything (planner.py and its jobs do) or import quack, CuTeDSL or torch.
Invariants: every record is frozen and built with keywords only; a spec fully determines the emitted
source (emit.py), so planning the same stage twice gives equal specs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from coda_lang.ir.nodes import Eqn, Span
from coda_lang.ir.types import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    TILE,
    VEC,
    Dim,
    Shape,
    TileConstraint,
    Type,
    shape_str,
)
from coda_lang.ops import REGISTRY

# The epilogue mode of a stage (docs/backend.md, "Epilogue modes").
Mode = Literal["element", "acc_pair", "packed_cd_b16x2"]
# What a loaded value is, as the checker's plan says it (frontend/verify/plan.py's `Load.role`) ...
LoadRole = Literal["tile", "row vector", "column vector", "scalar", "grouped tile"]
LOAD_ROLES: tuple[LoadRole, ...] = ("tile", "row vector", "column vector", "scalar", "grouped tile")
# ... and what an epilogue operand is: one of those, or an index computed from the coordinates.
Role = Literal["tile", "row vector", "column vector", "scalar", "row index", "column index", "grouped tile"]
# The quack epilogue op of an operand (epi_ops.TileIndex for an index), or "C": the GEMM's C operand.
OperandOp = Literal["TileLoad", "ColVecLoad", "RowVecLoad", "Scalar", "TileIndex", "GroupColumnLoad", "C"]
# The K block, and the side of B's blocks, of the kernels' block-scaled GEMM (plan/block_scaled.py:
# DeepSeek-V3's 1 x 128 and 128 x 128 groups; the mainloop's K tile is one block)
SCALE_BLOCK = 128
# The quack op that folds a sink, the fold of a VecReduce, and what the kernel writes (for the runtime).
SinkOp = Literal["ColVecReduce", "RowVecReduce", "OnlineLSEReduce", "ColVecSelect"]
SinkCombine = Literal["add", "max", "max_abs"]
SINK_COMBINES: tuple[SinkCombine, ...] = ("add", "max", "max_abs")
Layout = Literal["row partials", "column partials", "vector"]
# The fold of a grouped reduction (epi_ops.GroupedReduce; "lse": log-sum-exp).
GroupCombine = Literal["add", "max", "min", "lse"]
GROUP_COMBINES: tuple[GroupCombine, ...] = ("add", "max", "min", "lse")

_Name = TypeVar("_Name", bound=str)


def member(name: str, names: tuple[_Name, ...]) -> _Name:
    """`name` as a member of a closed set of names (one of the tuples above); ValueError if it is none."""
    for n in names:
        if n == name:
            return n
    raise ValueError(f"{name!r} is not one of {', '.join(names)}")


# A value whose name the emitted module imports (names.helper_names()), or that quack reserves (`c` is
# the GEMM's C operand, `D` its output), is renamed `v_<name>` in the emitted function; the epi_args
# key is the renamed one.
QUACK_RESERVED = frozenset({"acc", "c", "D"})

# Quack op for each load role of frontend/verify/plan.py.
LOAD_OPS: dict[LoadRole, OperandOp] = {
    "tile": "TileLoad",
    "row vector": "ColVecLoad",
    "column vector": "RowVecLoad",
    "scalar": "Scalar",
    # `expand(s, acc)` of a matrix [M, N/g] (one value per row and run of g columns): the column of s a
    # tile's columns fall in, loaded as a row vector (epi_ops.GroupColumnLoad; tiles whose N divides g)
    "grouped tile": "GroupColumnLoad",
}

# `row_index()` / `col_index()` in an element-mode stage: an operand of role "row index" / "column
# index" (by the op's `OpDef.index_axis`, 0 / 1), quack op epi_ops.TileIndex (a value port computed from
# the epilogue's coordinates: nothing is loaded; the runtime passes the op's host scalar as 0). The fn
# receives the index as f32.
INDEX_ROLES: tuple[Role, Role] = ("row index", "column index")
INDEX_AXIS: dict[Role, int] = {role: axis for axis, role in enumerate(INDEX_ROLES)}
# an i32 value compared inside an epilogue is compared as f32: exact below this magnitude
F32_EXACT_INT = 2**24

STORE_DTYPES = FLOAT_DTYPES  # what a TileStore / D can hold
GEMM_DTYPES = ("bf16", "f16")  # operand dtypes of quack's SM90 WGMMA path used here


# A dim used as a value inside a stage is a scalar operand named DIM_PREFIX + the dim's name (no coda
# name starts with it); the runtime binds each dim's size under that name (CudaBlock.values shows them)
DIM_PREFIX = "%"


def dim_operand(dim: str) -> str:
    """The operand name of dim `dim`'s size."""
    return DIM_PREFIX + dim


@dataclass(frozen=True, kw_only=True)
class Operand:
    """A value the epilogue loads: a parameter of the emitted fn (and a key of epi_args)."""

    name: str  # coda name
    py: str  # name in the emitted fn
    role: Role
    op: OperandOp  # quack op class, or "C" for the GEMM's C operand (packed mode: not an epilogue op)
    dtype: str
    shape: Shape
    lanes: int  # 2: arrives as a Pair (full-width tile or column vector in acc_pair mode; C in packed mode)
    # How the runtime must pass the argument, when not as is: "repeat_interleave(2)" for a half-width
    # column vector in acc_pair mode (one value per column pair, loaded at the GEMM's width; the
    # epilogue reads lane 0).
    host: str = ""
    # A vector over a dim of fixed size G that repeats across the columns (docs/language.md, "Vectors
    # that repeat"): `period` is G and `shape` the width W it meets; the runtime passes it repeated
    # W / G times (before any repeat_interleave(2)), so the kernel reads a column vector of width W.
    period: Dim | None = None
    # "grouped tile": the columns of the tile per element of the matrix (g of s: [M, N/g]), and the rows
    # (`row_group` g1 of s: [M/g1, N/g]: the runtime passes s repeated over its rows, [M, N/g])
    group: int = 0
    row_group: int = 1


@dataclass(frozen=True, kw_only=True)
class Output:
    """A stored tile: quack's D, or a TileStore (gated: half-width, in acc_pair mode). In acc_pair mode a
    second full-width tile is stored as two gated TileStores, one per lane (`lane` 0: the even
    columns, 1: the odd ones), which the runtime interleaves back (quack's acc_pair mode stores only D
    at full width)."""

    name: str
    py: str
    dtype: str
    shape: Shape
    op: Literal["D", "TileStore"]
    gated: bool = False
    lane: int | None = None
    # a packed stage's fp8 D (a derived backward's quantized cotangent of a SwiGLU's gate/up: quack's
    # packed mode stores C's 16-bit dtype only): the kernel stores it in `dtype` (C's: bf16 or f16),
    # rounded to odd from the clamped f32 value, and the runtime rounds that to `narrow` (to nearest
    # even: the same code as rounding the f32 value directly, bf16 keeping 5 bits more than e5m2 or
    # e4m3, f16 7 or more)
    narrow: str | None = None
    # the same D stored by the kernel itself in fp8, as its pairs (the default; `CODA_FP8_PAIR_STORE=0`
    # narrows instead: pair_store_on): a TileStore of one 16-bit word per accumulator
    # element, the two lanes' codes
    # (lane 0 in the low byte: at the lower address, so the buffer is the fp8 [M, 2N] tile itself), the
    # runtime passing the fp8 buffer as an int16 [M, N] view (quack has no uint16). The stage then runs in quack's element
    # mode, its C operand a TileLoad of the 16-bit pairs as float32 words (Operand.host "view(float32)")
    pairs: bool = False
    # the value's K-major copy, for a later GEMM of the block that reads it transposed (an fp8 operand:
    # spec.Gemm's copy_a / copy_b): a TileStore of the same tile into the transposed view of an
    # [N, kmajor_width(M)] buffer (M-major; the columns past M zeros), which the runtime binds under
    # backend_triton.kmajor_key, so the GEMM takes it instead of a transposing pass. `lane`: the
    # copy of one lane of a packed stage's pairs (rows `lane`, `lane` + 2, ... of the [2N, width] buffer,
    # which lane 0's output is; lane 1's follows it, its own buffer an empty stand-in)
    kmajor: bool = False
    # (a K-major copy) the value's only stored form: nothing reads its row-major tile (every later
    # reader is a GEMM that takes this copy, and it is not a block output), so the stage stores none,
    # and the runtime binds the value as the transposed view of the copy (launch.collect)
    alone: bool = False


@dataclass(frozen=True, kw_only=True)
class Sink:
    """A partial reduction (or pick) the epilogue folds; `value` are the coda names it folds
    (two for a scaled sum of a product: folded as one fma, like quack's `(y, y)`)."""

    name: str
    py: str
    op: SinkOp
    combine: SinkCombine | None  # for VecReduces; None for OnlineLSEReduce and ColVecSelect
    scaled: bool = False  # a sum of a product folded as one fma of its two factors (`value`)
    value: tuple[str, ...]
    shape: Shape
    layout: Layout  # what the kernel writes, for the runtime
    index: str | None = None  # ColVecSelect: py name of its index operand (an extra op, not an fn parameter)
    index_dtype: str | None = None
    # acc_pair mode, half-width value: what fills the second lane, "0.0" (a sum's identity) or the value
    # itself ("self": a max's)
    pad: Literal["0.0", "self"] = "0.0"
    lanes: int = 1  # packed mode, double-width value: 2 (its two lanes are folded first, by `combine`)
    # min(): the kernel folds the negation by max (`combine` "max"), so its partial buffer holds -min per
    # tile; the runtime negates the buffer back (exact, infinities included: -max(-x) == min(x))
    negate: bool = False
    # a sum (or max of abs) whose value past the end of the reduced dim, in the ragged last tile, is not
    # known to be 0: quack folds those elements too (its add and max_abs reduces count on the zeros of
    # a padded accumulator), so the kernel uses epi_ops' Bounded*Reduce, which masks them out
    bounded: bool = False
    # a `bounded` sum that is 0 there for finite inputs (the padding's accumulator is NaN only in a row
    # of A holding an infinity): its mask runs in the ragged last tile only, behind a branch uniform over
    # the CTA (a mask of every tile costs selects everywhere; this one a branch, cheaper where one sum
    # has it, but a branch per sink costs registers where a stage has many)
    ragged_only: bool = False
    # a grouped reduction over runs of `rows` rows (a 128x1 group: `max(abs(acc), over=M, group=128)`),
    # stored and not read in its stage: a RowVecReduce at tile_M == rows (planner's rule), so each
    # tile's partial is one group's value, complete; the runtime keeps the [M / rows, N] buffer as it is
    rows: int | None = None


# quack's online log-sum-exp (OnlineLSEReduce) turns a row holding +inf into NaN (exp(inf - inf)) and one
# of -inf only into NaN too; the interpreter's is +inf / -inf. Its kernel folds each value clamped to
# [-F32_MAX, F32_MAX] (NaN stays NaN), whose log-sum-exp rounds to +-F32_MAX, and the runtime reads a
# finished log-sum-exp at +-F32_MAX as +-inf (LSE_CLAMP: the runtime's and the emulation's switch).
F32_MAX = 3.4028234663852886e38
LSE_CLAMP = True


@dataclass(frozen=True, kw_only=True)
class Group:
    """A grouped reduction complete in its tile: the prepass computes `value` per element, the op `py`
    (epi_ops.GroupedReduce, a parameter of the main fn) folds it per (row, run of `width` columns of
    the tile) and gives the main fn each element's raw fold. `out`: when the reduction is used after
    the stage, the py name of its writer (quack's GroupedColStatsOut, f32[rows, cols / width])."""

    name: str
    py: str
    combine: GroupCombine
    width: int  # columns of the stage's tile per group
    value: str  # coda name of the reduced value (computed by the prepass fn)
    shape: Shape  # [rows, cols / width]
    out: str | None = None


@dataclass(frozen=True, kw_only=True)
class Gemm:
    a: str
    b: str
    a_dtype: str
    b_dtype: str
    ta: bool  # A is written transpose(a): stored [K, M]
    tb: bool  # B is written transpose(b): stored [N, K]
    rows: Dim
    cols: Dim
    k: Dim
    # a derived backward's fp8 operand stored the other way round from how the fp8 GEMM reads it (K
    # contiguous): the kernel is compiled K-major (ta False / tb True) and the runtime hands it a
    # K-major copy, transposed in one pass (launch.py, `StageRunner.arguments`)
    copy_a: bool = False  # a is stored [K, M]
    copy_b: bool = False  # b is stored [K, N]
    # block scales (`scale_a=sa, scale_b=sb`, DeepSeek-V3's form: sa [M, K/128], sb [N/128, K/128]; or
    # sb alone; sb laid out as B is stored, [K/128, N/128] where B is stored [K, N]: `b_kn`): the coda
    # names of the matrices and their names as the kernel's arguments (the mainloop's,
    # plan/block_scaled.py; the epilogue never reads them)
    scale_a: str | None = None
    scale_b: str | None = None
    scale_a_py: str = ""
    scale_b_py: str = ""
    # B's scale per column of the result and K block, [K/128, N] (refusals.scale_b_per_column)
    b_columns: bool = False

    @property
    def scaled(self) -> bool:
        return self.scale_b is not None

    @property
    def b_kn(self) -> bool:
        """B is stored [K, N] (the kernel reads its K-major copy where `copy_b`)."""
        return self.copy_b or not self.tb


@dataclass(frozen=True, kw_only=True)
class StageSpec:
    block: str
    index: int  # 1-based
    text: str  # `gemm y @ w_o`
    line: int
    fn_name: str
    mode: Mode
    gemm: Gemm
    operands: tuple[Operand, ...]
    d: Output | None
    outputs: tuple[Output, ...]  # TileStores
    sinks: tuple[Sink, ...]
    eqns: tuple[Eqn, ...]  # the live equations, in order (scaled-sum products dropped)
    names: dict[str, str] = field(compare=False, default_factory=dict)  # coda name -> py name
    # numbered temporaries -> their names in the stage (context.py, `stage_temps`: the emitted text
    # names them so, whatever the block's numbering)
    temps: dict[str, str] = field(compare=False, default_factory=dict)
    # on the tile config: the checker's (whole groups) and the planner's (pairs, paired stores, groups
    # within the epilogue subtile), printed in the emitted source; build/config.py adds the backend's own
    tiling: tuple[TileConstraint, ...] = ()
    source: tuple[str, ...] = ()  # the stage's body as .coda source (for the emitted docstring)
    span: Span | None = field(compare=False, default=None)
    groups: tuple[Group, ...] = ()  # grouped reductions (quack's prepass), in program order
    prepass: tuple[Eqn, ...] = ()  # the prepass fn's equations: what the groups reduce, per element
    # (G, W) for each dim G of repeating vectors: they, and vectors the stage computes over G, are
    # column vectors of width W in the kernel (the runtime passes the loaded ones repeated)
    repeats: tuple[tuple[Dim, Dim], ...] = ()
    # a stage of a derived backward block (the tuner's fast-accumulation candidates may be the forward's
    # only: config.fast_accum_on); not part of the kernel, which the emitted source alone keys
    derived: bool = field(compare=False, default=False)

    @property
    def prepass_name(self) -> str:
        return f"{self.fn_name}_prepass"

    @property
    def paired(self) -> bool:
        return self.mode == "acc_pair"

    @property
    def plain(self) -> bool:
        """Whether the stage's kernel is a bare GEMM: D = acc in the operands' dtype, nothing else."""
        return (
            self.d is not None
            and not self.gemm.scaled
            and not self.operands
            and not self.outputs
            and not self.sinks
            and not self.groups
            and self.mode == "element"
            and self.d.dtype == self.gemm.a_dtype == self.gemm.b_dtype
            and self.d.dtype in GEMM_DTYPES  # (an fp8 D is clamped by the emitted epilogue)
            and all(REGISTRY[e.op].copy for e in self.eqns)
        )

    @property
    def packed(self) -> bool:
        return self.mode == PACKED

    @property
    def quack_mode(self) -> Mode:
        """The mode quack runs the epilogue in: `mode`, except a packed stage storing its fp8 D as pairs
        (Output.pairs), whose lanes the emitted code packs and unpacks itself: element."""
        return "element" if self.packed and any(o.pairs for o in self.outputs) else self.mode

    @property
    def c(self) -> Operand | None:
        """The GEMM's C operand (packed mode: the double-width 16-bit tile the stage loads)."""
        return next((o for o in self.operands if o.op == "C"), None)

    def lanes(self, t: Type | None) -> int:
        if t is not None and t.kind == VEC and t.shape:
            w = dict(self.repeats).get(t.shape[0])
            if w is not None:  # a vector over G, a column vector of width W in the kernel
                t = Type(t.dtype, (w,), VEC)
        if self.packed:
            return 2 if is_wide(t, self.gemm.cols) else 1
        return lanes_of(t, self.gemm.rows, self.gemm.cols) if self.paired else 1


PACKED: Mode = "packed_cd_b16x2"
# Operand.host of a packed stage's 16-bit pairs loaded as float32 words (Output.pairs)
WORDS = "view(float32)"
# Operand.host of a packed stage's double-width fp8 tile loaded as int16 words, two codes each
# (`fp8_pair_load_on`)
FP8_WORDS = "view(int16)"
# the torch dtype (its name) each kind of word is handed to the kernel as
WORD_VIEWS = {WORDS: "float32", FP8_WORDS: "int16"}
PACKED_DTYPES = ("bf16", "f16")


def pair_store_on() -> bool:
    """Whether a packed stage's fp8 D is stored by the kernel as its pairs: by default (checked bit for
    bit against the interpreter on an H200, tests/test_fp8_pairs.py); $CODA_FP8_PAIR_STORE=0 stores it
    in 16 bits and narrows it in a pass of its own, as before."""
    return os.environ.get("CODA_FP8_PAIR_STORE", "1") != "0"


def kmajor_store_on() -> bool:
    """Whether a GEMM stage that stores an fp8 tile a later GEMM of its block reads transposed also
    stores that tile's K-major copy (Output.kmajor): by default; $CODA_KMAJOR_STORE=0 leaves the copy
    to a transposing pass at the reading GEMM, as before."""
    return os.environ.get("CODA_KMAJOR_STORE", "1") != "0"


def emulate_kernel_plans() -> bool:
    """Whether the emulated kernels (`emulate=True`) run the plans the GPU kernels get rather than
    their own ($CODA_EMULATE_KERNEL_PLANS=1, a testing aid): the K-major copies, the values stored as
    their copy alone, the fp8 pairs handed over as words, each stage's torch stand-in reading and
    writing the layouts the kernel would. Off by default: the emulated plans are torch's simplest."""
    return os.environ.get("CODA_EMULATE_KERNEL_PLANS", "0") == "1"


def kmajor_alone_on() -> bool:
    """Whether a value whose every reader takes its K-major copy (none reads it as stored, and it is
    not a block output) is stored as that copy alone, by a GEMM epilogue (Output.alone) or a
    generated elementwise stage (TritonStage.kmajor_stores' ALONE): by default; $CODA_KMAJOR_ALONE=0
    stores the row-major tile too, as before."""
    return os.environ.get("CODA_KMAJOR_ALONE", "1") != "0"


def fp8_pair_load_on() -> bool:
    """Whether a packed stage may load its double-width tile in fp8, as int16 words of two codes, beside
    an fp8 D stored as pairs: by default (checked bit for bit against the interpreter on an H200,
    2026-11-28, tests/test_fp8_loads.py `-m gpu`); $CODA_FP8_PAIR_LOAD=0 refuses it (E0702)."""
    return os.environ.get("CODA_FP8_PAIR_LOAD", "1") != "0"


def is_wide(t: Type | None, cols: Dim) -> bool:
    """A tile twice the stage's width (in packed mode: two lanes per accumulator element)."""
    return t is not None and t.kind == TILE and len(t.shape) == 2 and t.shape[1] == cols.scale(2)


def lanes_of(t: Type | None, rows: Dim, cols: Dim) -> int:
    """In acc_pair mode: 2 for a value over the stage's full width (a Pair), 1 otherwise."""
    if t is None:
        return 1
    if t.kind == TILE and len(t.shape) == 2:
        return 2 if t.shape[1] == cols else 1
    if t.kind == VEC and t.shape and t.shape[0] != rows:
        return 2 if t.shape[0] == cols else 1
    return 1


def describe(spec: StageSpec) -> list[str]:
    """Human lines about the stage's interface (the header of the emitted source)."""
    g = spec.gemm
    a = f"transpose({g.a})" if g.ta else g.a
    b = f"transpose({g.b})" if g.tb else g.b
    a += " (a K-major copy of transpose(" + g.a + "))" if g.copy_a else ""
    b += " (a K-major copy of " + g.b + ")" if g.copy_b else ""
    lines = [
        f"GEMM: {a} @ {b}: {g.a_dtype} x {g.b_dtype} -> acc f32{shape_str((g.rows, g.cols))}, K = {g.k}; "
        f"mode {spec.mode}"
        + (f" (run by quack in {spec.quack_mode} mode)" if spec.quack_mode != spec.mode else "")
    ]
    if g.scaled:
        sa = (
            f"{g.scale_a_py} = {g.scale_a}: f32[{g.rows}, {g.k}/128] of A's 1 x 128 groups, "
            if g.scale_a
            else ""
        )
        blocks = f"{g.k}/128, {g.cols}/128" if g.b_kn else f"{g.cols}/128, {g.k}/128"
        what = "128 x 128 blocks"
        if g.b_columns:
            blocks, what = f"{g.k}/128, {g.cols}", "columns, per 128-deep block of K"
        lines.append(
            f"scales {sa}{g.scale_b_py} = {g.scale_b}: f32[{blocks}] of B's {what}"
            + ("" if g.scale_a else " (B's alone)")
            + " (BlockScale: applied in the mainloop, each 128-deep block of K promoted with its scales)"
        )
    for o in spec.operands:
        host = f", passed as {o.py}.{o.host}" if o.host else ""
        shape = o.shape
        if o.period is not None:
            again = f", then .{o.host}" if o.host else ""
            host = f", passed repeated to `{o.shape[0]}` columns{again}"
            shape = (o.period,)
        if o.row_group > 1:
            host = f", passed repeated over its groups of {o.row_group} rows"
        op = "the GEMM's C operand, 16-bit pairs" if o.op == "C" else o.op
        py = f"{o.py} = {o.name}" if o.op == "C" else o.py
        if o.name.startswith(DIM_PREFIX):
            py = f"{o.py} = the size of {o.name[len(DIM_PREFIX) :]}"
        if o.role in INDEX_AXIS:
            lines.append(f"index  {o.py}: each element's {o.role.split()[0]} index, as f32 ({o.op})")
            continue
        lines.append(f"load   {py}: {o.dtype}{shape_str(shape) if shape else ''} {o.role} ({op}{host})")
    if spec.d is not None:
        lines.append(
            f"store  D = {spec.d.py}: {spec.d.dtype}{shape_str(spec.d.shape)}{_quantized(spec.d.dtype)}"
        )
    for out in spec.outputs:
        lane = f", lane {out.lane} of {out.name}" if out.lane is not None else ""
        if out.kmajor:
            rows = f"rows {out.lane}, {out.lane + 2}, ... of " if out.lane is not None else ""
            lines.append(
                f"store  {out.py}: {out.dtype}{shape_str(out.shape)} (TileStore{lane}): the K-major copy of "
                f"`{out.name}` a later GEMM reads transposed, into {rows}its transpose (M-major)"
                + (" (its only store: nothing reads the row-major tile)" if out.alone else "")
            )
            continue
        pairs = (
            ", its pairs: one 16-bit word per accumulator element, lane 0 in the low byte"
            if out.pairs
            else ""
        )
        lines.append(
            f"store  {out.py}: {out.dtype}{shape_str(out.shape)} (TileStore{', gated' if out.gated else ''}"
            f"{lane}{pairs}){_quantized(out.dtype)}"
        )
    for s in spec.sinks:
        fold = {"add": "sum", "max_abs": "max of |x|"}.get(s.combine or "", s.combine)
        if s.negate:
            fold = "min"
        what = {
            "ColVecReduce": f"{fold} over the columns, one partial per column tile",
            "RowVecReduce": f"{fold} over the rows, one partial per row tile"
            + (f" (a group of {s.rows} rows: each partial complete)" if s.rows is not None else ""),
            "OnlineLSEReduce": "logsumexp over the columns, one partial per column tile",
            "ColVecSelect": f"the value at column {s.index} of each row",
        }[s.op]
        scaled = ", scaled" if s.scaled else ", both lanes" if s.lanes == 2 else ""
        scaled += ", max of the negation: the buffer holds -min" if s.negate else ""
        scaled += (
            (
                ", masked past the end"
                + (
                    " (NaN there only from an infinity in A: the ragged last tile only)"
                    if s.ragged_only
                    else ""
                )
            )
            if s.bounded
            else ""
        )
        lines.append(f"reduce {s.py}: f32{shape_str(s.shape)} = {what} ({s.op}{scaled})")
    for gr in spec.groups:
        fold = {"add": "sum", "lse": "logsumexp"}.get(gr.combine, gr.combine)
        writer = f"; stored by {gr.out}" if gr.out else ""
        lines.append(
            f"group  {gr.py}: f32{shape_str(gr.shape)} = {fold} over each run of {gr.width} columns, complete "
            f"in the tile (GroupedReduce, folded by the prepass{writer})"
        )
    for c in spec.tiling:
        lines.append(f"tiling {c}")
    return lines


def _quantized(dtype: str) -> str:
    """What the kernel does to a stored fp8 value (emit.py's clamp, then quack's cvt)."""
    if dtype not in FP8_DTYPES:
        return ""
    return ", clamped to the dtype's range (NaN stays NaN), rounded to nearest even (cvt.rn.satfinite)"


def plain_name(gemm: Gemm) -> str:
    """The function name of the bare-GEMM epilogue (D = acc) for these operand dtypes and majors: one
    emitted module, so one kernel per tile, shared by every plain stage of every block (a weight
    gradient in one block is the same kernel as in another)."""
    dtypes = gemm.a_dtype if gemm.b_dtype == gemm.a_dtype else f"{gemm.a_dtype}_{gemm.b_dtype}"
    return f"plain_{dtypes}_{'t' if gemm.ta else 'n'}{'t' if gemm.tb else 'n'}"
