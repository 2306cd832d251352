"""Elementwise stages on the GPU: `elementwise [M, N] { ... }` as one fused memory-bound kernel.

What it does: `ElementwiseStage` runs a stage that has no GEMM (autodiff makes one at a block's entry,
where no GEMM produces the incoming cotangent: the backward of a GELU, of RoPE, ...). Its equations
become one torch function over whole matrices (row vectors broadcast as [m, 1], column vectors as
[1, n], reductions over the stage's rows or columns complete, not per-tile partials), which
`torch.compile` (Inductor) fuses into one generated kernel per pass over the data: every input read
once, every stored tile written once. With `emulate=True` (tests without a GPU) the same function runs
eagerly. Stored tiles come back in their storage dtype; reductions as f32 vectors (rounded where the
block says so), as runtime.py's GEMM stages give them.
What it does not: use quack (there is no GEMM to host the epilogue) or compile grouped reductions
(E0705, like the GEMM path).
Invariants: numerics follow the interpreter: f32 inside the stage, rounding only where a tile is
stored; the function is built once per stage and reads only its inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from coda_lang.interp.inputs import extent
from coda_lang.ir.nodes import DimRef, Lit, Stage, Var
from coda_lang.ir.types import TILE, VEC, Dim, Type
from coda_lang.ops import REGISTRY
from coda_lang.verify.diagnostics import CodaError, Diagnostic

REDUCE_FNS: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
    "reduce_sum": lambda x, d: x.sum(d),
    "reduce_max": lambda x, d: x.amax(d),
    "reduce_min": lambda x, d: x.amin(d),
    "reduce_logsumexp": lambda x, d: torch.logsumexp(x, d),
}


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
        self.stores = [(s.name, s.dtype, s.shape) for s in self.plan.stores]
        self.reductions = [r.name for r in self.plan.reductions]
        for e in self.stage.body:
            od = REGISTRY[e.op]
            if od.locality == "reduce" and (e.param("group") is not None):
                raise CodaError([Diagnostic("E0705", "grouped reductions in an elementwise stage are not compiled yet",
                                            e.span)])
            if od.locality not in ("reduce", "gather", "index") and e.op not in ("pairs", "interleave"):
                from coda_lang.backend_cute.runtime import TORCH_OPS

                if e.op not in TORCH_OPS:
                    raise CodaError([Diagnostic("E0708", f"`{e.op}` has no torch mapping for an elementwise stage",
                                                e.span)])
        self._fn: Callable[..., tuple[torch.Tensor, ...]] | None = None

    @property
    def text(self) -> str:
        return self.plan.text

    def function(self) -> Callable[..., tuple[torch.Tensor, ...]]:
        """The stage as one function of its loads (and the extents of the dims it uses): eager when
        emulating, else compiled by torch.compile (built on first use)."""
        if self._fn is None:
            fn = self._body
            if not self.emulate:
                fn = torch.compile(fn, dynamic=True, fullgraph=True)
            self._fn = fn
        return self._fn

    def _body(self, sizes: dict[str, int], *ins: Any) -> tuple[torch.Tensor, ...]:
        from coda_lang.backend_cute.runtime import TORCH_OPS

        vals: dict[str, Any] = {}
        for ld, x in zip(self.loads, ins, strict=True):
            if ld.role == "tile":
                vals[ld.name] = x.float()
            elif ld.role == "row vector":
                vals[ld.name] = x.float().reshape(-1, 1) if x.is_floating_point() else x.reshape(-1, 1)
            elif ld.role == "column vector":
                vals[ld.name] = x.float().reshape(1, -1) if x.is_floating_point() else x.reshape(1, -1)
            else:
                vals[ld.name] = x
        for e in self.stage.body:
            args = [vals[a.name] if isinstance(a, Var) else a.value if isinstance(a, Lit)
                    else extent(a.dim, sizes) if isinstance(a, DimRef) else None for a in e.ins]
            (first, *_) = e.outs
            if e.op == "pairs":
                z = self._full(args[0], e.ins[0], sizes)
                res: tuple[Any, ...] = (z[:, 0::2], z[:, 1::2])
            elif e.op == "interleave":
                a, b = self._full(args[0], e.ins[0], sizes), self._full(args[1], e.ins[1], sizes)
                a, b = torch.broadcast_tensors(torch.as_tensor(a), torch.as_tensor(b))
                res = (torch.stack((a, b), dim=-1).reshape(a.shape[0], -1),)
            elif e.op in REDUCE_FNS:
                res = (self._reduce(e.op, args[0], e.ins[0], first.type, sizes),)
            elif e.op == "pick":
                x = self._full(args[0], e.ins[0], sizes)
                idx = torch.as_tensor(args[1]).long().reshape(-1, 1)
                ok = (idx >= 0) & (idx < x.shape[1])
                got = x.gather(1, torch.where(ok, idx, 0))
                res = (torch.where(ok, got, 0.0).reshape(-1),)
            elif e.op in ("row_index", "col_index"):
                n = self._extent(first.type, 0, sizes)
                ix = torch.arange(n, dtype=torch.int32, device=self._device(ins))
                res = (ix.reshape(-1, 1) if e.op == "row_index" else ix.reshape(1, -1),)
            else:
                params = {k: v for k, v in e.params if not isinstance(v, Dim)}
                out = TORCH_OPS[e.op](*args, **params)
                res = out if isinstance(out, tuple) else (out,)
            for v, x in zip(e.outs, res, strict=True):
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    x = x.float()
                if v.type is not None and v.type.kind == VEC and isinstance(x, torch.Tensor) and x.dim() == 1:
                    x = x.reshape(-1, 1) if v.type.shape[0] == self.rows else x.reshape(1, -1)
                vals[v.name] = x
        outs: list[torch.Tensor] = []
        for name, dtype, shape in self.stores:
            full = tuple(extent(d, sizes) for d in shape)
            x = torch.broadcast_to(torch.as_tensor(vals[name], dtype=torch.float32), full)
            outs.append(x.to(_torch_dtype(dtype)).contiguous())
        for name in self.reductions:
            outs.append(torch.as_tensor(vals[name]).reshape(-1).float())
        return tuple(outs)

    def _device(self, ins: tuple[Any, ...]) -> torch.device:
        return next(x.device for x in ins if isinstance(x, torch.Tensor))

    def _extent(self, t: Type | None, axis: int, sizes: dict[str, int]) -> int:
        assert t is not None and t.shape
        return extent(t.shape[axis], sizes)

    def _full(self, x: Any, atom: Any, sizes: dict[str, int]) -> Any:
        """A tile-shaped value broadcast to its tile's extents (a vector or scalar stays as it is)."""
        t = atom.type if isinstance(atom, Var) else None
        if t is None or t.kind != TILE or not isinstance(x, torch.Tensor):
            return x
        shape = (extent(t.shape[0], sizes), extent(t.shape[1], sizes))
        return x if tuple(x.shape) == shape else torch.broadcast_to(x, shape)

    def _reduce(self, op: str, x: Any, atom: Any, out: Type | None, sizes: dict[str, int]) -> torch.Tensor:
        """A reduction over the stage's columns (a per-row result) or rows (a per-column result)."""
        assert out is not None
        t = atom.type if isinstance(atom, Var) else None
        per_row = bool(out.shape) and out.shape[0] == self.rows
        if t is not None and t.kind == TILE:
            shape = (extent(t.shape[0], sizes), extent(t.shape[1], sizes))
        else:  # a vector or scalar broadcast over the reduced axis
            other = out.shape[0] if out.shape else self.rows
            width = self.cols if per_row else self.rows
            shape = ((extent(other, sizes), extent(width, sizes)) if per_row
                     else (extent(width, sizes), extent(other, sizes)))
        x = torch.broadcast_to(torch.as_tensor(x, dtype=torch.float32), shape)
        r = REDUCE_FNS[op](x, 1 if per_row else 0)
        return r.reshape(-1, 1) if per_row else r.reshape(1, -1)

    def run(self, env: dict[str, Any], dims: dict[str, int], storage: dict[str, str],
            out: dict[str, Any] | None = None) -> None:
        """Run the stage on the block's values in `env`; binds what it stores and reduces in `out`
        (default: `env`)."""
        ins = []
        for ld in self.loads:
            v = env[ld.name]
            if ld.role != "scalar" and isinstance(v, torch.Tensor):
                v = v.contiguous()
            ins.append(v)
        outs = self.function()(dict(dims), *ins)
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
            if dtype in ("bf16", "f16"):
                x = x.to(_torch_dtype(dtype)).float()
            out[name] = x


def _torch_dtype(dtype: str) -> torch.dtype:
    from coda_lang.backend_cute.runtime import TORCH_DTYPES

    return TORCH_DTYPES[dtype]
