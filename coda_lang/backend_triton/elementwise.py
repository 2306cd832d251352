"""Elementwise stages on the GPU: `elementwise [M, N] { ... }` as one fused memory-bound kernel.

What it does: `ElementwiseStage` runs a stage that has no GEMM (autodiff makes one at a block's entry,
where no GEMM produces the incoming cotangent: the backward of a GELU, of RoPE, ...). Its equations
become one torch function over whole matrices (row vectors broadcast as [m, 1], column vectors as
[1, n], reductions over the stage's rows or columns complete, not per-tile partials), which
`torch.compile` (Inductor) fuses into one generated kernel per pass over the data: every input read
once, every stored tile written once. With `emulate=True` (tests without a GPU) the same function runs
eagerly. Stored tiles come back in their storage dtype; reductions as f32 vectors (rounded where the
block says so), as the GEMM stages (launch.py) give them.
A grouped value (`sum(x, over=N, group=g)` and what is computed from it) is held at full width, each
element holding its group's value (as quack's GroupedReduce value port gives it to a GEMM stage's
epilogue); one stored after the stage is one value per row and group, [m, n / g].
Off the emulator a stage runs as a Triton kernel that generate.py writes where it takes the stage's ops
(stored fp8 tiles included: the weight quantizer's `wq: e4m3 = w * s`, once per weight and step, is
spared torch.compile's per-call host overhead, ~245 us in the fp8 model's forward), else as torch.compile's (`generator`).
What it does not: use quack (there is no GEMM to host the epilogue); generate a kernel for a stage
that loads an fp8 tile or casts to fp8 inside (torch.compile runs those).
Invariants: numerics follow the interpreter: f32 inside the stage, rounding only where a tile is
stored; the function is built once per stage and reads only its inputs.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch

from coda_lang.backend_triton import generate, kmajor_key, kmajor_width
from coda_lang.backend_triton.generate import TritonStage
from coda_lang.core.diagnostics import CodaError, Diagnostic
from coda_lang.frontend.verify.repeat import repeated
from coda_lang.ir.nodes import DimRef, Lit, Stage, Var
from coda_lang.ir.types import GROUP, MATRIX, TILE, VEC, Dim, Type, is_fp8
from coda_lang.ops import REGISTRY, Locality
from coda_lang.ops.registry import torch_dtype, torch_round, torch_store

# torch.compile's `dynamic` for the stages' kernels: None (PyTorch's default) compiles for the first
# shape and once more, shape-generic, when a second one comes. True (one shape-generic kernel from the
# start) made the Llama-3.2-1B layer's RoPE backward at M=8192 a kernel of 0.84 ms where the
# shape-specialized one takes under 0.14 ms (H100, benchmarks/hf_block_profile.py --dynamic)
DYNAMIC: bool | None = None


class ElementwiseStage:
    """Stage `index` (1-based) of a checked block, a stage with no GEMM."""

    def __init__(self, block: Any, index: int, emulate: bool):
        self.block, self.index, self.emulate = block, index, emulate
        stages = [s for s in block.ir.body if isinstance(s, Stage)]
        self.stage: Stage = stages[index - 1]
        self.plan = block.plan.stages[index - 1]
        self.rows: Dim = self.plan.rows
        self.cols: Dim = self.plan.cols
        self.loads = [ld for ld in self.plan.loads]
        self.roles = tuple((ld.name, ld.role) for ld in self.loads)
        self.stores = [(s.name, s.dtype, s.shape) for s in self.plan.stores]
        self.store_meta = tuple(
            (s.name, _torch_dtype(s.dtype), self._ratio(s.shape[1])) for s in self.plan.stores
        )
        self.reductions = [r.name for r in self.plan.reductions]
        # each reduction's group over the columns, and over the rows (a g x 1 group: `over=M, group=g`)
        self.groups = tuple((r.group or 0) if r.axis == "columns" else 0 for r in self.plan.reductions)
        self.row_groups = tuple((r.group or 0) if r.axis == "rows" else 0 for r in self.plan.reductions)
        # a grouped value computed from a grouped reduction (`ax = detach(max(abs(x), over=D,
        # group=128))`) that is used after the stage (a later GEMM's `scale_a=`, or a saved tensor of a
        # backward) comes back as the reductions do: one value per row and group (`handed_back`)
        self.handed_back: list[str] = []
        for e in self.stage.body:
            for v in e.outs:
                t = v.type
                if (
                    t is not None
                    and t.kind == GROUP
                    and t.group
                    and v.name not in self.reductions
                    and v.name in block.plan.storage
                ):
                    self.handed_back.append(v.name)
                    self.reductions.append(v.name)
                    self.groups += (t.group if t.group_axis == 1 else 0,)
                    self.row_groups += (t.group if t.group_axis == 0 else 0,)
        for e in self.stage.body:
            od = REGISTRY[e.op]
            if not (od.reduces or od.locality is Locality.INDEX) and od.lower.torch is None:
                raise CodaError(
                    [Diagnostic("E0708", f"`{e.op}` has no torch stand-in for an elementwise stage", e.span)]
                )
        self.steps = [self._step(e) for e in self.stage.body]
        # each grouped reduction: (the group, whether it runs over the rows, the statement): the sizes a
        # run binds must hold whole groups (E0802, `check_groups`), as the interpreter requires
        self._grouped = [
            (int(g), t.group_axis == 0, e)
            for e in self.stage.body
            if REGISTRY[e.op].reduces
            and isinstance(g := e.param("group"), int)
            and g
            and (t := e.outs[0].type) is not None
        ]
        # the stage's extents as (dim, numerator, denominator): plain ints, traceable by torch.compile
        self._rows = (self.rows.name, self.rows.coeff.numerator, self.rows.coeff.denominator)
        self._cols = (self.cols.name, self.cols.coeff.numerator, self.cols.coeff.denominator)
        self._fn: Callable[..., tuple[torch.Tensor, ...]] | None = None

    # -- the static program: plain tuples and numbers only, so that torch.compile (dynamo) traces the
    # function below without meeting the IR. A width is (num, den): that fraction of the stage's width.

    def _ratio(self, d: Dim) -> tuple[int, int]:
        r = Fraction(d.coeff) / Fraction(self.cols.coeff)
        return r.numerator, r.denominator

    def _width(self, t: Type | None) -> tuple[int, int] | None:
        """A tile's width as a fraction of the stage's width (None: not a tile); a grouped value's is the
        width of the columns it covers."""
        if t is not None and t.kind == GROUP and t.group:
            # (one over runs of rows, [rows / g, W], covers the W columns)
            return self._ratio(t.shape[1] if t.group_axis == 0 else t.shape[1].scale(t.group))
        # (a matrix the stage loads is a tile of its width: a block parameter read in the stage, a
        # cotangent `dv: f32[M, N]` summed over its columns in a stage of width 2*N)
        if t is None or t.kind not in (TILE, MATRIX) or len(t.shape) != 2:
            return None
        return self._ratio(t.shape[1])

    def _arg(self, a: Any) -> tuple[str, Any]:
        if isinstance(a, Var):
            return ("v", a.name)
        if isinstance(a, Lit):
            return ("c", a.value)
        assert isinstance(a, DimRef)
        return ("d", (a.dim.name, a.dim.coeff.numerator, a.dim.coeff.denominator))

    def _step(self, e: Any) -> tuple[str, tuple[str, ...], tuple[tuple[str, Any], ...], dict[str, Any]]:
        outs = tuple(v.name for v in e.outs)
        args = tuple(self._arg(a) for a in e.ins)
        # (a grouped value of an earlier stage, loaded as the matrix it was stored as: that matrix's width)
        tiles = {ld.name: ld.shape for ld in self.loads if ld.role == "tile"}
        widths = tuple(
            (self._ratio(tiles[a.name][1]) if a.name in tiles else self._width(a.type))
            if isinstance(a, Var)
            else None
            for a in e.ins
        )
        out = e.outs[0].type
        info: dict[str, Any] = {"widths": widths}
        od = REGISTRY[e.op]
        if od.locality is Locality.REDUCE:
            rows_grouped = out is not None and out.kind == GROUP and out.group_axis == 0
            per_row = bool(out is not None and out.shape and out.shape[0] == self.rows)
            info["per_row"] = per_row
            # a g x 1 group (`over=M, group=g`): one value per column and run of g rows
            info["row_group"] = (e.param("group") or 0) if rows_grouped else 0
            info["group"] = 0 if rows_grouped else e.param("group") or 0
            x = e.ins[0].type if isinstance(e.ins[0], Var) else None
            loaded = isinstance(e.ins[0], Var) and e.ins[0].name in tiles  # (stored one per group already)
            info["ungroup"] = (
                x.group if x is not None and x.kind == GROUP and not loaded else 0
            )  # its groups reduced: one each
            if widths[0] is None:  # a vector or scalar broadcast over the reduced axis
                info["widths"] = ((1, 1),) if per_row else (None,)
        elif od.broadcasts:  # expand
            x = e.ins[0].type if isinstance(e.ins[0], Var) else None
            # a stored tile of one column per group read as a grouped value: each column over its group
            info["repeat"] = (
                out.group
                if out is not None
                and out.kind == GROUP
                and out.group
                and x is not None
                and x.kind in (TILE, MATRIX)
                else 0
            )
            info["params"] = {}
        elif od.locality is Locality.INDEX:
            assert out is not None and out.shape
            info["width"] = self._ratio(out.shape[0]) if od.index_axis == 1 else None
        elif od.locality not in (Locality.PAIR, Locality.GATHER):
            info["params"] = {k: v for k, v in e.params if not isinstance(v, Dim)}
        info["vec"] = tuple(
            None
            if v.type is None or v.type.kind != VEC or not v.type.shape
            else ("row" if v.type.shape[0] == self.rows else "col")
            for v in e.outs
        )
        # a vector over G that repeats across W columns: (operand, G as (dim, num, den), W's ratio)
        info["cycle"] = tuple(
            (i, (g.name, g.coeff.numerator, g.coeff.denominator), self._ratio(w))
            for i, g, w in repeated(e, self.rows, self.cols)
        )
        return e.op, outs, args, info

    @property
    def text(self) -> str:
        return self.plan.text

    def function(self) -> Callable[..., tuple[torch.Tensor, ...]]:
        """The stage as one function of (rows, cols, dim sizes, loads...): eager when emulating, else a
        generated Triton kernel (generate.py) where the stage's ops allow one, else compiled by
        torch.compile; built on first use. `CODA_ELEMENTWISE=inductor` takes torch.compile always."""
        if self._fn is None:
            fn = self._body
            if not self.emulate:
                if self.generator == "triton":
                    fn = TritonStage(self)
                else:
                    fn = InductorStage(self)
            self._fn = fn
        return self._fn

    @property
    def generator(self) -> str:
        """How the stage runs on the GPU: "triton" (a generated kernel) or "inductor" (torch.compile)."""
        if os.environ.get("CODA_ELEMENTWISE", "triton") == "inductor" or generate.unsupported(self):
            return "inductor"
        return "triton"

    def own_body(self) -> Callable[..., tuple[torch.Tensor, ...]]:
        """`_body` bound to this stage through a code object of its own. Dynamo keeps its compiled
        graphs (and its recompile limit, 64 by default) per code object and guards on `self`'s
        program, so with one shared code object every further elementwise stage in a process is a
        recompile of the same function, and the 65th a hard failure (fullgraph): found by `coda fuzz
        --programs` on the H100."""
        f = ElementwiseStage._body
        name = "".join(c if c.isalnum() else "_" for c in f"coda_{self.block.name}_stage{self.index}")
        code = (
            f.__code__.replace(co_name=name, co_qualname=name)
            if hasattr(f.__code__, "co_qualname")
            else f.__code__.replace(co_name=name)
        )
        body = types.FunctionType(code, f.__globals__, name, f.__defaults__, f.__closure__)
        body.__kwdefaults__ = f.__kwdefaults__  # (`kmajor`'s default: FunctionType takes no kwdefaults)
        return types.MethodType(body, self)

    def _body(
        self,
        rows: int,
        cols: int,
        sizes: dict[str, int],
        device: torch.device,
        *ins: Any,
        kmajor: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, ...]:
        """The stage's stored tiles, then its reductions, then (`kmajor`: a flag per stored tile, as
        `InductorStage.kmajor_stores` gives them) the K-major copy of each flagged one, [width,
        kmajor_width(rows)], zero-padded, rounded from the same f32 values as the tile itself."""

        def width(w: tuple[int, int]) -> int:
            return cols * w[0] // w[1]

        def full(x: Any, w: tuple[int, int] | None) -> Any:
            """A tile-shaped value at its tile's extents (a broadcast row vector or scalar expanded)."""
            if w is None or not isinstance(x, torch.Tensor):
                return x
            return torch.broadcast_to(x, (rows, width(w)))

        vals: dict[str, Any] = {}
        for (name, role), x in zip(self.roles, ins, strict=True):
            if role != "scalar" and x.is_floating_point():
                x = x.float()
            if role == "grouped tile":  # (`expand` of a block scale: each element over its group)
                x = x.repeat_interleave(rows // x.shape[0], 0).repeat_interleave(cols // x.shape[1], 1)
            vals[name] = (
                x.reshape(-1, 1)
                if role == "row vector"
                else x.reshape(1, -1)
                if role == "column vector"
                else x
            )
        for op, outs, args, info in self.steps:
            xs = [vals[v] if k == "v" else v if k == "c" else sizes[v[0]] * v[1] // v[2] for k, v in args]
            ws = info["widths"]
            for i, (gname, num, den), w in info["cycle"]:  # column c reads element c mod G
                n = (sizes[gname] if gname is not None else 1) * num // den
                idx = torch.arange(width(w), device=device) % n
                xs[i] = torch.as_tensor(xs[i], device=device).reshape(1, -1)[:, idx]
            od = REGISTRY[op]
            res: tuple[Any, ...]
            if od.locality is Locality.PAIR:  # on whole tiles: a broadcast operand expanded first
                xs = [torch.as_tensor(full(x, w), device=device) for x, w in zip(xs, ws, strict=True)]
                out = od.lower.torch(*xs) if od.lower.torch is not None else None
                res = out if isinstance(out, tuple) else (out,)
            elif od.locality is Locality.REDUCE:
                assert od.combine is not None
                fold = od.combine.torch
                per_row = info["per_row"]
                x = torch.as_tensor(xs[0], dtype=torch.float32, device=device)
                if ws[0] is not None:
                    x = torch.broadcast_to(x, (rows, width(ws[0])))
                else:  # a column vector (or scalar) reduced over the rows
                    x = torch.broadcast_to(x, (rows, x.shape[-1] if x.dim() else 1))
                if info["ungroup"]:
                    x = x[:, :: info["ungroup"]]
                g = info["group"]
                if info["row_group"]:  # one value per column and run of rows, held at each of its rows
                    gr = info["row_group"]
                    r = fold(x.reshape(rows // gr, gr, -1), 1)
                    res = (r.unsqueeze(1).expand(-1, gr, -1).reshape(rows, -1),)
                elif g:  # one value per row and group, held at every column of its group
                    r = fold(x.reshape(rows, -1, g), 2)
                    res = (r.unsqueeze(2).expand(-1, -1, g).reshape(rows, -1),)
                else:
                    r = fold(x, 1 if per_row else 0)
                    res = (r.reshape(-1, 1) if per_row else r.reshape(1, -1),)
            elif od.broadcasts and info["repeat"]:  # a tile of one column per group, as a grouped value
                g = info["repeat"]
                x = torch.as_tensor(xs[0], dtype=torch.float32, device=device)
                res = (x.unsqueeze(2).expand(-1, -1, g).reshape(rows, -1),)
            elif od.locality is Locality.GATHER:  # pick(x, idx): one column per row
                x = full(xs[0], ws[0])
                idx = torch.as_tensor(xs[1], device=device).long().reshape(-1, 1)
                ok = (idx >= 0) & (idx < x.shape[1])
                got = x.gather(1, torch.where(ok, idx, 0))
                res = (torch.where(ok, got, 0.0),)
            elif od.locality is Locality.INDEX:
                n = rows if info["width"] is None else width(info["width"])
                ix = torch.arange(n, dtype=torch.int32, device=device)
                res = (ix.reshape(-1, 1) if od.index_axis == 0 else ix.reshape(1, -1),)
            else:
                stand_in = od.lower.torch
                assert stand_in is not None, f"`{op}` has no torch stand-in"
                out = stand_in(*xs, **info["params"])
                res = out if isinstance(out, tuple) else (out,)
            for name, x, vec in zip(outs, res, info["vec"], strict=True):
                if isinstance(x, torch.Tensor):
                    if x.is_floating_point():
                        x = x.float()
                    if vec is not None and x.dim() == 1:
                        x = x.reshape(-1, 1) if vec == "row" else x.reshape(1, -1)
                vals[name] = x
        results: list[torch.Tensor] = []
        copies: list[torch.Tensor] = []
        for i, (name, dtype, w) in enumerate(self.store_meta):
            x = torch.broadcast_to(
                torch.as_tensor(vals[name], dtype=torch.float32, device=device), (rows, width(w))
            )
            results.append(torch_store(x, dtype).contiguous())
            if kmajor and kmajor[i]:  # (the copy's K is the stage's rows, padded with zero columns)
                pad = kmajor_width(rows) - rows
                copies.append(torch_store(torch.nn.functional.pad(x.t(), (0, pad)), dtype).contiguous())
        for name, g, gr in zip(self.reductions, self.groups, self.row_groups, strict=True):
            x = torch.as_tensor(vals[name], device=device).float()
            if gr:  # one value per run of rows and column, [rows / gr, width]
                x = torch.broadcast_to(x, (rows, x.shape[-1]))
            results.append(x[::gr].contiguous() if gr else x[:, ::g].contiguous() if g else x.reshape(-1))
        return tuple(results + copies)

    def check_groups(self, rows: int, cols: int) -> None:
        """E0802 where a grouped reduction of the stage would split a group: `rows` (or the width it
        reduces, a fraction of `cols`) not a multiple of its group. Without it the torch function's
        reshape would fold values of different groups together, or fail with a bare RuntimeError."""
        for g, over_rows, e in self._grouped:
            x = e.ins[0]
            t = x.type if isinstance(x, Var) else None
            n = rows
            if not over_rows:
                w = self._width(t) if t is not None else None
                n = cols * w[0] // w[1] if w is not None else cols
            if n % g:
                what = "rows" if over_rows else "columns"
                raise CodaError(
                    [
                        Diagnostic(
                            "E0802",
                            f"`{e.outs[0].name}` reduces groups of {g} {what}, and this run has {n}: "
                            f"not a multiple of {g}",
                            e.span,
                            notes=[f"choose sizes that make the grouped {what} a multiple of {g}"],
                        )
                    ]
                )

    def run(
        self,
        env: dict[str, Any],
        dims: dict[str, int],
        storage: dict[str, str],
        out: dict[str, Any] | None = None,
        into: dict[str, torch.Tensor] | None = None,
        kmajor: frozenset[str] = frozenset(),
        alone: frozenset[str] = frozenset(),
    ) -> None:
        """Run the stage on the block's values in `env`; binds what it stores and reduces in `out`
        (default: `env`). `into`: stored tiles to write over a buffer (a tile the stage loads and
        nothing reads later, of the stored tile's shape and dtype): the generated Triton kernel
        loads each element before it stores there; the other paths allocate as usual. `kmajor`:
        values a later GEMM reads as K-major copies: the generated kernel writes the copy of each it
        stores and can (`TritonStage.kmajor_stores`), bound under launch.kmajor_key; the other
        paths write none (the GEMM makes its own). `alone`: those of them nothing reads row-major:
        written K-major only where the kernel writes the copy, the value bound as its transposed view."""
        ins = []
        for ld in self.loads:
            v = env[ld.name]
            if ld.role != "scalar" and isinstance(v, torch.Tensor):
                v = v.contiguous()
            ins.append(v)
        rows = (dims[self._rows[0]] if self._rows[0] is not None else 1) * self._rows[1] // self._rows[2]
        cols = (dims[self._cols[0]] if self._cols[0] is not None else 1) * self._cols[1] // self._cols[2]
        # the block's device (a stage may load no tensor: a zero gradient made from index vectors)
        device = next((v.device for v in ins if isinstance(v, torch.Tensor)), None) or next(
            (v.device for v in env.values() if isinstance(v, torch.Tensor)), torch.device("cpu")
        )
        self.check_groups(rows, cols)
        fn = self.function()
        sizes = {k: int(v) for k, v in dims.items()}
        kw: dict[str, Any] = {}
        if into and hasattr(fn, "into"):
            kw["into"] = [into.get(n) for n, _, _ in self.stores]
        marked: list[str] = []
        if kmajor and hasattr(fn, "kmajor_stores"):
            kw["kmajor"] = fn.kmajor_stores(kmajor, alone)
            marked = [n for (n, _, _), on in zip(self.stores, kw["kmajor"], strict=True) if on]
        outs = fn(rows, cols, sizes, device, *ins, **kw)
        if out is None:
            out = env
        i = 0
        for name, _, _ in self.stores:
            out[name] = outs[i]
            i += 1
        for name in self.reductions:
            x = outs[i]
            i += 1
            dtype = storage.get(name)
            if dtype is not None and (dtype in ("bf16", "f16") or is_fp8(dtype)):
                x = torch_round(x, dtype)
            out[name] = x
        if len(outs) > i:  # the K-major copies the kernel wrote
            for name in marked:
                out[kmajor_key(name)] = outs[i]
                i += 1


# $CODA_KMAJOR_INDUCTOR=1: the stages torch.compile runs write the K-major copies of their one-byte
# tiles that a later GEMM reads transposed (`InductorStage.kmajor_stores`), where the runtime otherwise
# copies each in a transposing pass of its own (launch.kmajor_pair). Off by default until timed on a GPU.
KMAJOR_INDUCTOR_VAR = "CODA_KMAJOR_INDUCTOR"


def kmajor_inductor_on() -> bool:
    """Whether torch.compile's stages write K-major copies ($CODA_KMAJOR_INDUCTOR: 1 on, unset or 0 off;
    another value is a ValueError naming the variable)."""
    got = os.environ.get(KMAJOR_INDUCTOR_VAR, "0")
    if got not in ("0", "1"):
        raise ValueError(f"${KMAJOR_INDUCTOR_VAR} is {got!r}; it takes 0 (the default) or 1")
    return got == "1"


class InductorStage:
    """An elementwise stage that runs as torch.compile's kernels (`ElementwiseStage.generator`
    "inductor": a stage that loads an fp8 tile, reduces over runs of rows or hands a grouped value
    on), called as the stage's function. `compiled=False` runs the same body eagerly (the tests' way
    of checking what the compiled kernels compute, on any device).

    With $CODA_KMAJOR_INDUCTOR=1 it also writes the K-major copies a later GEMM reads
    (`kmajor_stores`): the copy is a second output of the same function, so Inductor writes it from
    the values the stage already holds, where the runtime otherwise reads the stored tile again in a
    transposing pass (blockwise fp8's weights and its activations quantized again for the weight
    gradients are made by such stages)."""

    def __init__(self, stage: ElementwiseStage, compiled: bool = True):
        self.stage = stage
        self.fn: Callable[..., tuple[torch.Tensor, ...]] = (
            torch.compile(stage.own_body(), dynamic=DYNAMIC, fullgraph=True) if compiled else stage._body
        )

    def kmajor_stores(self, names: frozenset[str], alone: frozenset[str] = frozenset()) -> tuple[int, ...]:
        """Which stored tiles among `names` this stage also writes K-major: the one-byte tiles of the
        stage's full width (1 each; never TritonStage's ALONE: the row-major tile is written too, and
        `alone` is not taken), none unless $CODA_KMAJOR_INDUCTOR=1."""
        on = kmajor_inductor_on()
        return tuple(
            1 if on and name in names and w == (1, 1) and dtype.itemsize == 1 else 0
            for name, dtype, w in self.stage.store_meta
        )

    def __call__(
        self, rows: int, cols: int, sizes: dict[str, int], device: torch.device, *ins: Any, **kw: Any
    ) -> tuple[torch.Tensor, ...]:
        kmajor = tuple(kw.pop("kmajor", ()))
        assert not kw, f"InductorStage takes no {sorted(kw)}"
        if any(kmajor):
            return self.fn(rows, cols, sizes, device, *ins, kmajor=kmajor)
        return self.fn(rows, cols, sizes, device, *ins)


def _torch_dtype(dtype: str) -> torch.dtype:
    return torch_dtype(dtype)
