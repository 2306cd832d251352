"""Launching one GEMM stage: its kernel's arguments and buffers, and the torch custom op `coda::stage`.

What it does: `StageRunner` is stage `index` of a block at one tile config: `arguments` turns the
block's values into the op's inputs (A, B, each epilogue operand, pick's indices), `allocate` makes its
outputs (D, the TileStores, each sink's per-tile partial buffer, a grouped reduction's writer; a
K-major copy an [N, K] buffer the kernel stores through its transposed view), `launch`
runs the kernel (quack's, cuBLAS for a plain stage the tuner found faster there, or emulate.py's torch
stand-in) and `collect` binds the results by coda name, each sink's partials combined by its combine
record. The launch is the torch custom op `coda::stage` (a fake impl allocates the same buffers), so
torch.compile traces a block without a graph break. `round_value` / `compute_value` keep the
interpreter's numerics (stored tiles rounded to their dtype, f32 compute).
What it does not: choose tiles (tiles.py, tune.py), bind a call's inputs (binding.py) or plan/emit.
Invariants: every element of every buffer the op returns is written by the kernel (pick's output is
pre-filled: -inf where its index is in range, which the kernel overwrites unless it picks -inf, and 0
where it is not; a K-major copy's columns past M, its K's padding, are zeros from its allocation;
`poison=True` fills the rest with NaN so tests can see an unwritten element).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from fractions import Fraction
from typing import Any

import torch

from coda_lang.backend_cute.build.config import TileConfig
from coda_lang.backend_cute.build.store import write_source
from coda_lang.backend_cute.plan import spec as specs
from coda_lang.backend_cute.plan.emit import emit_stage
from coda_lang.backend_cute.plan.spec import F32_EXACT_INT, INDEX_AXIS, WORD_VIEWS, Sink, StageSpec
from coda_lang.backend_cute.runtime import emulate
from coda_lang.backend_triton import kmajor_key, kmajor_width
from coda_lang.core.diagnostics import error
from coda_lang.ir.types import BOOL, MATRIX, Dim, Type, is_float, is_fp8
from coda_lang.ops.registry import combine_of_sink, combine_rule, torch_dtype, torch_round

TORCH_DTYPES: dict[str, torch.dtype] = {
    d: torch_dtype(d) for d in ("f32", "bf16", "f16", "e4m3", "e5m2", "i32", BOOL)
}
NARROW_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)  # computed in f32


def sink_rule(s: Sink) -> tuple[str, int]:
    """(combine record name, axis) of a sink's partial buffer; ("select", -1) for pick's finished vector."""
    if s.op == "ColVecSelect":
        return "select", -1
    rule = combine_of_sink("lse" if s.op == "OnlineLSEReduce" else s.combine or "", s.negate).name
    return rule, (1 if s.layout == "row partials" else 0)


def sink_partials(s: Sink, buf: torch.Tensor) -> torch.Tensor:
    """The per-tile partials of a sink from the buffer its kernel wrote: a min() sink's kernel folds the
    negation by max, so its buffer holds -min per tile (negated back here, exactly); a log-sum-exp
    tile's +-F32_MAX is +-inf (spec.LSE_CLAMP)."""
    if s.op == "OnlineLSEReduce" and specs.LSE_CLAMP:
        return torch.where(buf.abs() >= specs.F32_MAX, buf * torch.inf, buf)
    return -buf if s.negate else buf


def sink_shape(s: Sink, m: Any, n: Any, tile_m: int, tile_n: int) -> tuple[Any, ...]:
    """quack's buffer shape for a sink of an (m, n) GEMM at tile (tile_m, tile_n) on SM90
    (`sink_alloc_shape` with lead (m,)): per-tile partials along the reduced dim."""
    if s.op == "ColVecSelect":
        return (m,)
    if s.layout == "row partials":
        return (m, -(-n // tile_n))
    if s.rows is not None:  # a group of rows: one partial per group (tile_M == rows in the kernel)
        return (-(-m // s.rows), n)
    return (-(-m // tile_m), n)


def _width(shape_dim: Dim, cols: Dim, n: Any) -> Any:
    """The extent of a stage value's column dim `shape_dim` when the stage's width `cols` is n."""
    num, den = _ratio(shape_dim.coeff, cols.coeff)
    return n if num == den else n * num // den


@functools.lru_cache(maxsize=1024)
def _ratio(a: Any, b: Any) -> tuple[int, int]:
    """a / b as (numerator, denominator), remembered: a launch asks for the same few ratios every time
    (Fraction arithmetic was a visible part of a stage launch's host time)."""
    r = Fraction(a) / Fraction(b)
    return r.numerator, r.denominator


def dense(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t in `dtype`, contiguous: t itself when it is both (what `.to(dtype).contiguous()` returns
    then too, skipping the two dispatches: a block call binds a few dozen tensors, each a few us)."""
    if t.dtype != dtype:
        if t.dtype in FP8_TORCH and t.device.type == "cuda" and dtype in WIDER:
            # lazy: Triton, which only a GPU run needs (an fp8 operand multiplied in bf16: exact)
            from coda_lang.backend_triton.layouts import widen

            return widen(t, dtype)
        t = t.to(dtype)
    return t if t.is_contiguous() else t.contiguous()


FP8_TORCH = (torch.float8_e4m3fn, torch.float8_e5m2)


def kmajor_copy(t: torch.Tensor, width: int) -> torch.Tensor:
    """The [C, width] K-major copy of an [R, C] tensor (its transpose, columns R to `width` zeros),
    with torch: what `layouts.transposed` writes on a GPU, for the CPU and emulated runs."""
    out = torch.zeros((t.shape[1], width), dtype=t.dtype, device=t.device)
    out[:, : t.shape[0]] = t.t()
    return out


def kmajor_pair(
    A: torch.Tensor,
    B: torch.Tensor,
    copy_a: bool,
    copy_b: bool,
    made: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
) -> tuple[torch.Tensor, torch.Tensor]:
    """The operands of a derived backward's fp8 GEMM compiled K-major (spec.Gemm's copy_a / copy_b),
    as (A [M, K], B [N, K]), K contiguous: `A` as stored ([K, M] where `copy_a`, else [M, K]) and `B`
    ([K, N] where `copy_b`, else [N, K]), each stored the other way round copied transposed in one
    pass. A K that is not a multiple of 16 (a weight gradient's K is the tokens) is padded to one
    with zero columns in both, which add nothing to any product (TMA loads rows of a multiple of
    16 bytes): the copy is written at that width, the other operand copied into it only then. `made`:
    the K-major copies of A and B that the stages that made them wrote (kmajor_key), used where one
    is given at that width instead of copying again."""
    k = A.shape[0] if copy_a else A.shape[1]
    width = kmajor_width(k)

    def kmajor(t: torch.Tensor, copy: bool, given: torch.Tensor | None) -> torch.Tensor:
        if (
            copy
            and given is not None
            and tuple(given.shape) == (t.shape[1], width)
            and given.dtype == t.dtype
        ):
            return given
        t = t if t.is_contiguous() else t.contiguous()  # (a view of a copy of another width)
        if copy and t.device.type == "cuda":
            # lazy: Triton, which only a GPU run needs
            from coda_lang.backend_triton.layouts import transposed

            return transposed(t, width)
        if copy:
            return kmajor_copy(t, width)
        if width == k:
            return t
        out = torch.zeros((t.shape[0], width), dtype=t.dtype, device=t.device)
        out[:, :k] = t
        return out

    return kmajor(A, copy_a, made[0]), kmajor(B, copy_b, made[1])


WIDER = (torch.bfloat16, torch.float16, torch.float32)  # what an fp8 value widens to exactly


def _aligned(t: Any) -> Any:
    """A tensor whose data pointer is 16-byte aligned (TMA and the vector loads assume it)."""
    if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.data_ptr() % 16:
        return t.clone()
    return t


def _operand(t: Any) -> Any:
    """A GEMM operand TMA can load: 16-byte aligned, and a matrix whose rows (along its contiguous dim)
    start every multiple of 16 bytes. A row of K = 4 bf16 values (8 bytes) is copied into rows padded
    to 16 bytes and viewed at its own width (the kernel reads only its K columns: the padding is never
    loaded); quack's launch would refuse it (`strides[0] ... divisible by 8`)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta" or t.dim() != 2:
        return _aligned(t)
    unit = 16 // t.element_size()
    major = 1 if t.stride(1) == 1 else 0 if t.stride(0) == 1 else None
    if major is None or t.stride(1 - major) % unit == 0 or t.shape[1 - major] <= 1:
        return _aligned(t)
    width = -(-t.shape[major] // unit) * unit
    if major == 1:
        padded = torch.zeros((t.shape[0], width), dtype=t.dtype, device=t.device)[:, : t.shape[1]]
    else:
        padded = torch.zeros((t.shape[1], width), dtype=t.dtype, device=t.device).t()[: t.shape[0]]
    padded.copy_(t)
    return padded


# ------------------------------------------------------------------------------------------------
# One stage: its spec, tile config, epilogue module, and the custom op that launches it.

_STAGES: weakref.WeakValueDictionary[str, StageRunner] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


class StageRunner:
    """Stage `index` of a block at a fixed tile config; `launch` is the body of `coda::stage`."""

    def __init__(
        self, block: Any, index: int, spec: StageSpec, config: TileConfig, emulate: bool, poison: bool = False
    ):
        self.block, self.index, self.spec, self.config, self.emulate = block, index, spec, config, emulate
        self.poison = poison
        self.key = f"{spec.fn_name}:{config.short}:{next(_KEYS)}"
        self.index_names = [(s.index, _coda_name(spec, s.index)) for s in spec.sinks if s.index is not None]
        self._mod: Any = None
        # each (m, n) launched: its output buffers' (shape, dtype, zero-filled), checked (`_layout`)
        self._layouts: dict[tuple[int, int], list[tuple[tuple[Any, ...], torch.dtype, bool]]] = {}
        _STAGES[self.key] = self

    @property
    def mod(self) -> Any:
        """The quack EpiMod of the emitted epilogue (imports quack on first use)."""
        if self._mod is None:
            # lazy: imports CuTeDSL and quack (seconds), which only a real compile or launch needs
            from coda_lang.backend_cute.build import (
                quack_adapter,
            )

            path = write_source(emit_stage(self.spec))
            self._mod = quack_adapter.load_epilogue(path, self.spec.fn_name)
        return self._mod

    # host side (traced by torch.compile): the op's arguments from the block's values
    def arguments(self, env: dict[str, Any]) -> tuple[list[torch.Tensor | None], list[float]]:
        spec, g = self.spec, self.spec.gemm
        made = (
            env.get(kmajor_key(g.a)) if g.copy_a else None,
            env.get(kmajor_key(g.b)) if g.copy_b else None,
        )
        # (an operand whose copy is made is not densified: it may be bound as a view of that copy,
        # Output.alone, and kmajor_pair reads only its shape then)
        A = env[g.a] if made[0] is not None else dense(env[g.a], TORCH_DTYPES[g.a_dtype])
        B = env[g.b] if made[1] is not None else dense(env[g.b], TORCH_DTYPES[g.b_dtype])
        if g.copy_a or g.copy_b:
            A, B = kmajor_pair(A, B, g.copy_a, g.copy_b, made)
        ins: list[torch.Tensor | None] = [A.t() if g.ta else A, B]  # B: (k, n), or (n, k) for transpose(b)
        k = A.shape[0] if g.ta else A.shape[1]
        if is_fp8(g.a_dtype) and not self.emulate and isinstance(k, int) and k % 16:
            # (the planner compiles fp8 operands K-major only: K is the rows' length of A and B)
            raise error(
                "E0807",
                f"stage {spec.index} (`{spec.text}`) multiplies fp8 operands with K = {k}: the kernel's TMA "
                "loads need rows of a multiple of 16 bytes, 16 fp8 values",
                notes=["choose a K that is a multiple of 16; the interpreter (Block.run) takes any size"],
            )
        scalars: list[float] = []
        n = B.shape[0] if g.tb else B.shape[1]
        for o in spec.operands:
            if o.role in INDEX_AXIS:  # computed in the kernel from its coordinates; nothing to pass
                extent = A.shape[0] if INDEX_AXIS[o.role] == 0 else n
                if extent > F32_EXACT_INT:
                    raise error(
                        "E0703",
                        f"stage {spec.index}: `{o.name}` indexes {extent} {o.role.split()[0]}s; the kernel "
                        f"holds an index as f32, exact up to {F32_EXACT_INT}",
                    )
                ins.append(None)
                continue
            v = env[o.name]
            if o.role == "scalar":
                if isinstance(v, torch.Tensor):
                    ins.append(v.to(TORCH_DTYPES[o.dtype]).reshape(1))
                else:
                    ins.append(None)
                    scalars.append(float(v))
                continue
            t = v if v.dtype == TORCH_DTYPES[o.dtype] else v.to(TORCH_DTYPES[o.dtype])
            if o.period is not None:  # a vector over G repeating across W columns: passed repeated
                w = _width(o.shape[0], g.cols, n)
                if w % t.shape[0]:
                    raise error(
                        "E0802",
                        f"stage {spec.index}: `{o.name}` ({t.shape[0]} values) repeats across {w} columns: "
                        f"not a multiple of {t.shape[0]}",
                    )
                t = t.repeat(w // t.shape[0])
            if o.host == "repeat_interleave(2)":
                t = t.repeat_interleave(2)
            if o.row_group > 1:  # a matrix over groups of rows too: passed one row per row of the stage
                t = t.repeat_interleave(o.row_group, dim=0)[: A.shape[1] if g.ta else A.shape[0]]
            if o.host in WORD_VIEWS:  # pairs read as words: 16-bit ones as float32, fp8 ones as int16
                t = (t if t.is_contiguous() else t.contiguous()).view(getattr(torch, WORD_VIEWS[o.host]))
            ins.append(t if t.is_contiguous() else t.contiguous())
        for _, name in self.index_names:
            ins.append(dense(env[name], torch.int32))
        if g.scaled:  # the block scales the mainloop reads (plan/block_scaled.py), f32 and row-major
            assert g.scale_b is not None
            ins += [dense(env[s], torch.float32) for s in (g.scale_a, g.scale_b) if s is not None]
        return ins, scalars

    def allocate(
        self, A: torch.Tensor, B: torch.Tensor, d_out: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """The stage's output buffers: [D?] + TileStores + sinks (also the fake impl of the op). `d_out`:
        D's buffer, given (`coda::stage_into`), not allocated."""
        g = self.spec.gemm
        m, n = A.shape[0], (B.shape[0] if g.tb else B.shape[1])
        dev = A.device
        layout = self._layouts.get((m, n)) if isinstance(m, int) and isinstance(n, int) else None
        if layout is None:
            layout = self._layout(m, n)
            if isinstance(m, int) and isinstance(n, int):
                self._layouts[(m, n)] = layout
        outs: list[torch.Tensor] = []
        for j, (shape, dtype, zeros) in enumerate(layout):
            if j == 0 and self.spec.d is not None and d_out is not None:
                assert tuple(d_out.shape) == shape and d_out.dtype == dtype, (
                    f"stage_into: D is {tuple(d_out.shape)} {d_out.dtype}, the stage stores {shape} {self.spec.d.dtype}"
                )
                assert d_out.is_contiguous()
                outs.append(d_out)
            elif zeros:
                outs.append(torch.zeros(shape, dtype=dtype, device=dev))
            elif self.poison:  # tests: an element the kernel does not write stays NaN
                outs.append(torch.full(shape, float("nan"), dtype=dtype, device=dev))
            else:
                outs.append(torch.empty(shape, dtype=dtype, device=dev))
        return outs

    def _layout(self, m: Any, n: Any) -> list[tuple[tuple[Any, ...], torch.dtype, bool]]:
        """(shape, dtype, zero-filled) of each output buffer of an (m, n) launch, in `allocate`'s order;
        E0807 / E0802 for sizes the kernel can't store or reduce (checked once per (m, n): a block's
        launches repeat the same few)."""
        spec, g, cfg = self.spec, self.spec.gemm, self.config
        layout: list[tuple[tuple[Any, ...], torch.dtype, bool]] = []
        if spec.d is not None:
            layout.append(((m, _width(spec.d.shape[1], g.cols, n)), TORCH_DTYPES[spec.d.dtype], False))
        for o in spec.outputs:
            width = _width(o.shape[1], g.cols, n)
            if o.kmajor and o.lane == 1:  # (lane 0's buffer holds both lanes: an empty stand-in, as
                layout.append(((0,), TORCH_DTYPES[o.dtype], False))  # the op's outputs may not alias)
                continue
            if o.kmajor:  # the [N, K] copy, its K (this stage's M) padded to 16 with zeros
                k = kmajor_width(m)
                layout.append(((width, k), TORCH_DTYPES[o.dtype], not isinstance(m, int) or k != m))
                continue
            layout.append(((m, width // 2 if o.lane is not None else width), TORCH_DTYPES[o.dtype], False))
        stored = ([spec.d.name] if spec.d is not None else []) + [o.name for o in spec.outputs]
        for (shape, dtype, _z), name in zip(layout, stored, strict=True):
            size = dtype.itemsize
            if len(shape) == 2 and isinstance(shape[1], int) and (shape[1] * size) % 16:
                raise error(
                    "E0807",
                    f"stage {spec.index} (`{spec.text}`) stores `{name}` with rows of {shape[1]} "
                    f"values, {shape[1] * size} bytes: the kernel's TMA stores need rows of a multiple "
                    "of 16 bytes",
                    notes=[
                        "choose dims that make every stored row a multiple of 16 bytes "
                        "(8 bf16 values); the interpreter (Block.run) takes any size"
                    ],
                )
        for gr in spec.groups:  # quack's GroupedColStatsBase needs whole groups (it raises ValueError)
            if isinstance(n, int) and n % gr.width:
                raise error(
                    "E0802",
                    f"stage {spec.index} (`{spec.text}`) reduces `{gr.name}` in groups of {gr.width} "
                    f"columns, but its width is {n}: not a multiple of {gr.width}",
                    notes=["choose sizes that make the grouped width a multiple of the group"],
                )
        for s in spec.sinks:
            if s.rows is not None and isinstance(m, int) and m % s.rows:
                raise error(
                    "E0802",
                    f"stage {spec.index} (`{spec.text}`) reduces `{s.name}` in groups of {s.rows} rows, "
                    f"but it has {m} rows: not a multiple of {s.rows}",
                    notes=["choose sizes that make the rows a multiple of the group"],
                )
            # (the kernel writes one partial per tile of rows: only a tile as tall as the group makes
            # them the groups' values; config.rules keep every other tile away from this stage)
            assert s.rows is None or self.emulate or cfg.tile_m == s.rows, (spec.block, spec.index, cfg)
            # pick: zeros here; `launch` prefills it from the indices (_prefill_select) before the kernel
            layout.append(
                (sink_shape(s, m, n, cfg.tile_m, cfg.tile_n), torch.float32, s.op == "ColVecSelect")
            )
        for gr in spec.groups:  # a grouped reduction used after the stage: one f32 per row and group
            if gr.out is not None:
                layout.append(((m, n // gr.width), torch.float32, False))
        return layout

    def call(
        self, ins: list[torch.Tensor | None], scalars: list[float], into: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """The stage's launch as the block runs it: [D] + stored tiles + sink buffers (D written into
        `into` when given). Under a torch.compile trace through the custom ops `coda::stage` /
        `coda::stage_into`, which the graph records; eagerly, their body directly (the dispatcher's
        Python layers around a custom op cost tens of microseconds per launch, and a layer's forward
        launches its stages faster than the GPU runs them only without them)."""
        if torch.compiler.is_compiling():
            if into is not None:
                return [into, *torch.ops.coda.stage_into(self.key, into, ins, scalars)]
            return list(torch.ops.coda.stage(self.key, ins, scalars))
        return self.launch(ins, scalars, d_out=into)  # (D first: `into` itself when given)

    # device side (the op's body): one kernel launch
    def launch(
        self, ins: list[torch.Tensor | None], scalars: list[float], d_out: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        A, B = _operand(ins[0]), _operand(ins[1])
        assert A is not None and B is not None
        outs = self.allocate(A, B, d_out)
        D, C, epi = self.epilogue_arguments(ins, scalars, outs)
        n = B.shape[0] if self.spec.gemm.tb else B.shape[1]
        for s in self.spec.sinks:
            if s.op == "ColVecSelect" and s.index is not None:
                _prefill_select(epi[s.py], epi[s.index], n)
        if self.config.is_cublas:  # a plain stage (compile.is_plain) the tuner found faster on cuBLAS
            assert D is not None
            torch.matmul(A, B.t() if self.spec.gemm.tb else B, out=D)
        elif self.emulate:
            emulate.run_stage(self.spec, self.config, A, B, D, epi, C=C)
        else:
            # lazy: imports CuTeDSL and quack (seconds), which only a real compile or launch needs
            from coda_lang.backend_cute.build import (
                quack_adapter,
            )

            quack_adapter.launch(self.mod, self.spec, self.config, A, B, D, epi, C=C)
        return outs

    def epilogue_arguments(
        self, ins: list[torch.Tensor | None], scalars: list[float], outs: list[torch.Tensor]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, dict[str, Any]]:
        """(D, C, epi_args by the emitted fn's names) for quack's `EpiMod.gemm`, from the op's arguments
        (C: the GEMM's C operand of a packed-mode stage, else None)."""
        spec = self.spec
        epi: dict[str, Any] = {}
        it = iter(scalars)
        j = 2
        C = None
        for o in spec.operands:
            t = ins[j]
            j += 1
            if o.op == "C":
                C = _operand(t)
                continue
            if o.role in INDEX_AXIS:
                epi[o.py] = 0  # TileIndex's host scalar: an offset added to every index
                continue
            if o.role == "scalar":
                epi[o.py] = next(it) if t is None else t
            else:
                # a tile: TMA loads rows that start every multiple of 16 bytes (an e4m3 tile of 8
                # columns, a bf16 one of 4, is handed over in rows padded to 16 bytes: `_operand`)
                assert t is not None
                padded = o.op == "TileLoad" and t.dim() == 2 and t.stride(0) * t.element_size() % 16
                epi[o.py] = _operand(t) if padded else _aligned(t)
        for py, _ in self.index_names:
            epi[py] = _aligned(ins[j])
            j += 1
        if spec.gemm.scaled:
            for py in (spec.gemm.scale_a_py, spec.gemm.scale_b_py):
                if py:  # (no A scale where B's is alone)
                    epi[py] = _aligned(ins[j])
                    j += 1
        i = 0
        D = None
        if spec.d is not None:
            D, i = outs[0], 1
        for out in spec.outputs:
            # (an fp8 tile stored as its pairs: the kernel's int16 [m, n] view of the fp8 [m, 2 n] buffer)
            if out.kmajor:  # what the kernel stores into: the copy's transposed view (a lane's rows)
                # (both lanes of pairs store into lane 0's buffer, the one before lane 1's stand-in)
                buf = outs[i - 1] if out.lane == 1 else outs[i]
                rows = buf[out.lane :: 2] if out.lane is not None else buf
                epi[out.py] = rows[:, : gemm_rows(ins[0])].t()
            else:
                epi[out.py] = outs[i].view(torch.int16) if out.pairs else outs[i]
            i += 1
        for s in spec.sinks:
            epi[s.py] = outs[i]
            i += 1
        for gr in spec.groups:  # GroupedReduce's host argument: the group width (compile-time)
            epi[gr.py] = gr.width
            if gr.out is not None:
                epi[gr.out] = outs[i]
                i += 1
        return D, C, epi

    def collect(
        self,
        outs: list[torch.Tensor],
        env: dict[str, Any],
        partials: dict[str, torch.Tensor],
        storage: dict[str, str],
        kmajor: frozenset[str] = frozenset(),
        whole: frozenset[str] = frozenset(),
        rows: int | None = None,
    ) -> None:
        """Bind the stage's results by coda name: stored tiles, and each sink combined across tiles.
        `kmajor`: values a later GEMM of the block reads as a K-major copy (an fp8 operand it reads
        transposed): a narrowed D among them gets its copy from the narrowing pass (kmajor_key).
        `whole`: sinks bound as their per-tile partials, uncombined (cuda_block.whole_folds: their
        one reader folds every element). `rows`: the launch's M (`gemm_rows` of its A), which a value
        stored as its K-major copy alone (Output.alone) is bound as the transposed view of."""
        spec = self.spec
        i = 0
        if spec.d is not None:
            d = spec.d
            if d.narrow is None:
                env[d.name] = outs[0]
            elif d.name in kmajor:
                env[d.name], env[kmajor_key(d.name)] = _narrow_with_kmajor(outs[0], d.narrow)
            else:
                env[d.name] = _narrow(outs[0], d.narrow)
            i = 1
        lanes: dict[str, list[torch.Tensor]] = {}
        for o in spec.outputs:
            if o.kmajor:  # the value's K-major copy ([N, K]; both lanes of pairs write lane 0's)
                if o.lane != 1:
                    env[kmajor_key(o.name)] = outs[i]
                if o.alone:  # (no row-major tile stored: the value is the copy's transposed view)
                    assert rows is not None, f"collect: `{o.name}` is stored as its K-major copy alone"
                    env[o.name] = outs[i][:, :rows].t()
            elif o.lane is not None:  # one lane of a full-width tile of a paired stage: interleave them back
                lanes.setdefault(o.name, []).append(outs[i])
                if len(lanes[o.name]) == 2:
                    even, odd = lanes[o.name]
                    env[o.name] = _interleave(even, odd)
            else:
                env[o.name] = outs[i]
            i += 1
        for s in spec.sinks:
            buf = sink_partials(s, outs[i])
            i += 1
            partials[s.name] = buf
            if s.name in whole:
                env[s.name] = buf
                continue
            rule, axis = sink_rule(s)
            # (a group of rows: each partial is one group's value, complete)
            x = buf if rule == "select" or s.rows is not None else combine_rule(rule).torch(buf, axis)
            dtype = storage.get(s.name)
            env[s.name] = round_value(x, dtype) if dtype else x
        for gr in spec.groups:
            if gr.out is not None:
                dtype = storage.get(gr.name)
                env[gr.name] = round_value(outs[i], dtype) if dtype else outs[i]
                i += 1


def gemm_rows(a: torch.Tensor | None) -> int:
    """M: the rows of the GEMM's A as the launch takes it ([M, K], a transposed view where stored [K, M])."""
    assert a is not None
    return int(a.shape[0])


def _narrow(t: torch.Tensor, dtype: str) -> torch.Tensor:
    """A packed stage's fp8 D, stored by the kernel in bf16 or f16 rounded to odd and clamped (Output.narrow),
    rounded to `dtype` to nearest even: one Triton kernel on a GPU (layouts.narrowed), torch's cast
    elsewhere or under a torch.compile trace (both exact: the value is in range or NaN)."""
    want = TORCH_DTYPES[dtype]
    if t.device.type == "cuda" and not torch.compiler.is_compiling():
        # lazy: Triton, which only a GPU run needs
        from coda_lang.backend_triton.layouts import narrowed

        return narrowed(t, want)
    return t.to(want)


def _narrow_with_kmajor(t: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`_narrow(t, dtype)` and its K-major copy (kmajor_pair's, rows padded to 16), in one Triton pass
    on a GPU (layouts.narrowed_with_kmajor), with torch elsewhere or under a torch.compile trace."""
    want = TORCH_DTYPES[dtype]
    width = kmajor_width(t.shape[0])
    if t.device.type == "cuda" and not torch.compiler.is_compiling():
        # lazy: Triton, which only a GPU run needs
        from coda_lang.backend_triton.layouts import narrowed_with_kmajor

        return narrowed_with_kmajor(t, want, width)
    row = t.to(want)
    return row, kmajor_copy(row, width)


def _interleave(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
    """A full-width tile from its two lanes (columns 2 j and 2 j + 1): one Triton kernel on a GPU
    (layouts.interleave), torch's stack elsewhere or under a torch.compile trace."""
    if even.device.type == "cuda" and not torch.compiler.is_compiling():
        # lazy: imports Triton, which only a GPU run needs
        from coda_lang.backend_triton import layouts

        return layouts.interleave(even, odd)
    return torch.stack((even, odd), dim=-1).reshape(even.shape[0], -1)


def _prefill_select(out: torch.Tensor, idx: torch.Tensor, n: int) -> None:
    """pick's output before its kernel runs: -inf in the rows whose index falls in [0, n), 0 elsewhere.
    quack's ColVecSelect writes the picked value of each row whose index it finds in its tile, except a
    value of -inf (its "no match" sentinel); rows whose index is outside [0, n) it never writes. So a
    row that picks -inf keeps this -inf, and a row with an index out of range reads 0, as in the
    interpreter (with a prefill of 0, a picked -inf read 0)."""
    if n <= 0:
        return
    hit = torch.eq(idx.clamp(0, n - 1), idx).reshape(out.shape)  # (two small kernels)
    out.masked_fill_(hit, float("-inf"))  # `out` comes zeroed (allocate)


def _coda_name(spec: StageSpec, py: str) -> str:
    for name, p in spec.names.items():
        if p == py:
            return name
    return py


# The schema is given, not inferred from the annotations (stable across torch versions).
@torch.library.custom_op(
    "coda::stage", mutates_args=(), schema="(str key, Tensor?[] ins, float[] scalars) -> Tensor[]"
)
def _stage_op(key: str, ins: list[torch.Tensor | None], scalars: list[float]) -> list[torch.Tensor]:
    """One GEMM stage of a coda block: one kernel launch; returns [D?] + stored tiles + sink buffers."""
    return _STAGES[key].launch(ins, scalars)


@_stage_op.register_fake
def _stage_op_fake(key: str, ins: list[torch.Tensor | None], scalars: list[float]) -> list[torch.Tensor]:
    A, B = ins[0], ins[1]
    assert A is not None and B is not None
    return _STAGES[key].allocate(A, B)


# A packed stage whose C operand is dead after it writes D into C's buffer (the two have one shape and
# dtype; each tile reads its C subtile before it stores its D subtile, and no two tiles share elements):
# the backward of SwiGLU overwrites the saved pre-activation with its cotangent, as hand-written
# kernels do, instead of holding both. `d` is that buffer, mutated; the result is the stage's other
# buffers (stored tiles, sinks). CudaBlock decides when this is allowed (only for tensors the caller
# hands over as consumable: the forward's saved intermediates in an autograd backward).
@torch.library.custom_op(
    "coda::stage_into",
    mutates_args=("d",),
    schema="(str key, Tensor(a!) d, Tensor?[] ins, float[] scalars) -> Tensor[]",
)
def _stage_into_op(
    key: str, d: torch.Tensor, ins: list[torch.Tensor | None], scalars: list[float]
) -> list[torch.Tensor]:
    return _STAGES[key].launch(ins, scalars, d_out=d)[1:]


@_stage_into_op.register_fake
def _stage_into_op_fake(
    key: str, d: torch.Tensor, ins: list[torch.Tensor | None], scalars: list[float]
) -> list[torch.Tensor]:
    A, B = ins[0], ins[1]
    assert A is not None and B is not None
    return _STAGES[key].allocate(A, B, d_out=d)[1:]


def round_value(x: Any, dtype: str | None) -> Any:
    """x rounded to a storage dtype, kept in its compute dtype (interp.numerics.round_to)."""
    if dtype is None or not isinstance(x, torch.Tensor):
        return x
    if dtype in ("bf16", "f16"):
        return x.to(TORCH_DTYPES[dtype]).float() if x.is_floating_point() else x
    if is_fp8(dtype):  # saturating, as the interpreter's store (torch's cast may not saturate)
        return torch_round(x, dtype) if x.is_floating_point() else x
    if dtype == "i32":
        return x.trunc().to(torch.int32) if x.is_floating_point() else x.to(torch.int32)
    return x.float() if dtype == "f32" else x


def value_dtype(t: Type | None) -> torch.dtype | None:
    """The compute dtype of a block-level value of type `t` (f32 for floats); None for a matrix alias
    (`y = x`), which stays the same tensor."""
    if t is None or t.kind == MATRIX:
        return None
    return torch.float32 if is_float(t.dtype) else TORCH_DTYPES.get(t.dtype, torch.float32)


def compute_value(x: Any, dtype: torch.dtype | None, device: torch.device) -> Any:
    """A block-level value in its compute dtype (`value_dtype`'s), as a tensor on the block's
    device; unchanged where that is None."""
    if dtype is None:
        return x
    if not isinstance(x, torch.Tensor):
        return torch.full((), x, dtype=dtype, device=device)
    if x.dim() == 0 and x.device.type == "cpu" and device.type != "cpu":
        # (an equation of literals only: its stand-in computed it on the host. Made on the device, not
        # copied there: a copy from pageable memory is refused while a CUDA graph captures the step)
        return torch.full((), x.item(), dtype=dtype, device=device)
    if x.dtype == dtype and x.device == device:
        return x  # (what .to returns then, without its dispatch)
    return x.to(device=device, dtype=dtype)
