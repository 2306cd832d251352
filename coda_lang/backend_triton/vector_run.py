"""Runs of block-level equations (between two stages) as one generated Triton kernel.

What it does: between its stages a block computes scalars and vectors (an fp8 block's scale products
and reciprocals, the amaxes over the rows, a norm's `rsqrt(ss / D + eps)`). The CUDA runtime ran
each such equation as one torch op: a launch and some tens of microseconds of host time each, several
hundred a training step of an fp8 model, and an fp8 layer's forward is short enough on the GPU that
the host's launches bound it. `VectorRun(eqns, ...)` is a run of consecutive such equations as one
kernel of one program: scalars held in registers; the elementwise equations over vectors of one
length in one loop over that length (chunks of BLOCK), each value kept in registers for the next
equation of the loop and stored; a reduction of a vector over its dim folded in the loop that makes
or loads its operand, complete after it. A loop whose vectors a later loop reads ends with a barrier
(one program: its stores are then visible to every thread of it). Every value the run defines is
stored, in its compute dtype (f32), in one buffer, and comes back as a view of it (a scalar 0-d, a
vector 1-d), 128-byte aligned: what the per-equation path gives, so nothing after the run changes.
`plan_runs(body, ...)` finds the runs of a block's body that the kernel can take.
Measured (H200s, fp8 Llama-3.2-1B step, 2026-11-27): through Triton's Python launcher a run cost about
what the few torch ops it replaces do. Launched through the compiled kernel's own launcher
(launcher.py), in three same-process A/Bs against the per-equation path (medians of 9 steps each),
the step was 4.4 and 1.1 ms shorter, then 6.2 ms longer: within the +-10 ms the steps vary by with
the host's speed; a run's call took about 100 us of host time where each equation takes about 20. No
gain shown, so the runtime uses the runs only where $CODA_VECTOR_RUNS=1. Timed again in a captured
step (H200, 2026-11-29: 130.2-130.5 against 130.0-130.2 ms), where the host's cost is gone: no gain.
Numerics: the ops' Triton expressions are the elementwise stages' (generate.py: libdevice's functions,
division and square root IEEE-rounded), in f32; an annotated value (`r: bf16 = ...`) is rounded to
its dtype and kept in f32, as `round_value` does. A sum over a vector adds in another order than
torch's (chunked, then a tree), within the interpreter's bound for a reduction.
What it does not: take a run with a matrix (an alias), a fold(x, into=G), an index, a comparison's
bool, an integer value, an fp8-annotated value or an op without a Triton expression (`unsupported`
says why; those runs keep the per-equation path), or launch off a CUDA device (the runtime's caller
runs the per-equation path there), or under a torch.compile trace.
Invariants: the kernel reads only the run's inputs and writes only its own buffer; the source depends
only on the equations and on which of the run's scalar inputs are tensors (not Python numbers), and
is built once per such signature; a vector of length 0 is never launched on (the caller's path runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from coda_lang.backend_triton.generate import (
    _COMBINE,
    _fold,
    _literal,
    load_kernel,
    module_head,
)
from coda_lang.backend_triton.launcher import launch
from coda_lang.ir.nodes import DimRef, Eqn, Lit, Var
from coda_lang.ir.types import FLOAT_DTYPES, PARTIAL, SCALAR, VEC, Dim
from coda_lang.ops import REGISTRY, Locality

BLOCK = 1024  # elements per chunk of a loop (4 warps: 8 per thread)
ALIGN = 32  # f32 elements: each value's view starts 128 bytes into the buffer


def _length(t: Any) -> tuple[str | None, int, int] | None:
    """A vector type's length as (dim, numerator, denominator); None for a scalar."""
    if t.kind == SCALAR:
        return None
    d: Dim = t.shape[0]
    return (d.name, d.coeff.numerator, d.coeff.denominator)


def unsupported(e: Eqn) -> str | None:
    """Why equation `e` can't be part of a generated run, or None."""
    od = REGISTRY[e.op]
    for v in e.outs:
        t = v.type
        if t is None or t.kind not in (SCALAR, VEC) or t.dtype not in FLOAT_DTYPES:
            return f"`{v.name}` is not a float scalar or vector"
        if v.annot is not None and v.annot not in FLOAT_DTYPES:
            return f"`{v.name}` is rounded to {v.annot}"
        if t.kind == VEC and len(t.shape) != 1:
            return f"`{v.name}` is not one-dimensional"
    for a in e.ins:
        if isinstance(a, Var):
            t = a.type  # (a stage's reduction, complete after it, is a vector here)
            if t is None or t.kind not in (SCALAR, VEC, PARTIAL) or t.dtype not in FLOAT_DTYPES:
                return f"operand `{a.name}` is not a float scalar or vector"
            if t.kind != SCALAR and len(t.shape) != 1:
                return f"operand `{a.name}` is not one-dimensional"
    if od.reduces:
        if _fold(e.op) is None or e.param("group") is not None:
            return f"`{e.op}` folds by a rule the kernel has no combine for"
        (x,) = [a for a in e.ins if isinstance(a, Var)]
        if x.type is None or x.type.kind == SCALAR or e.outs[0].type.kind != SCALAR:  # type: ignore[union-attr]
            return f"`{e.op}` does not reduce a vector to a scalar"
        return None
    if od.locality in (Locality.VECTOR, Locality.INDEX) or od.lanes is not None:
        return f"`{e.op}` is not elementwise"
    if od.lower.triton is None:
        return f"`{e.op}` has no Triton expression"
    if len(e.outs) != 1:
        return f"`{e.op}` has {len(e.outs)} results"
    return None


def plan_runs(body: Any, min_len: int = 2) -> dict[int, tuple[int, ...]]:
    """{index of a run's first equation: the body indices of its equations}: the maximal runs of at
    least `min_len` consecutive non-stage statements of `body` that the kernel takes."""
    runs: dict[int, tuple[int, ...]] = {}
    cur: list[int] = []

    def close() -> None:
        if len(cur) >= min_len:
            runs[cur[0]] = tuple(cur)
        cur.clear()

    for i, s in enumerate(body):
        if isinstance(s, Eqn) and unsupported(s) is None:
            cur.append(i)
        else:
            close()
    close()
    return runs


@dataclass
class _Loop:
    length: tuple[str | None, int, int]
    pre: list[str] = field(default_factory=list)  # scalar code before the loop (reads no fold of it)
    inits: list[str] = field(default_factory=list)  # the folds' accumulators
    lines: list[str] = field(default_factory=list)  # the loop's body, one chunk
    finals: list[str] = field(default_factory=list)  # the folds completed, after it
    pending: set[str] = field(default_factory=set)  # the scalars its folds make
    in_regs: set[str] = field(default_factory=set)  # the vectors its body holds in registers


class VectorRun:
    """Equations `eqns` (consecutive, each accepted by `unsupported`) of block `block_name` as one
    kernel. `dimrefs`: (first output, argument position) -> (dim, numerator, denominator) of each dim
    used as a value, as CudaBlock keeps them. Called with the run's environment and dims: binds every
    value the run defines (views of one f32 buffer), or returns False where it can't launch (then
    nothing was bound)."""

    def __init__(
        self,
        eqns: list[Eqn],
        dimrefs: dict[tuple[str, int], tuple[str | None, int, int]],
        block_name: str,
        first: int,
        interpret: bool = False,
    ):
        self.eqns, self.interpret = eqns, interpret
        self.name = "".join(c if c.isalnum() else "_" for c in f"coda_{block_name}_run{first}")
        defined: set[str] = set()
        inputs: list[Var] = []
        for e in eqns:
            for a in e.ins:
                if isinstance(a, Var) and a.name not in defined and a.name not in {v.name for v in inputs}:
                    inputs.append(a)
            defined |= {v.name for v in e.outs}
        self.inputs = inputs
        self.outputs = [v for e in eqns for v in e.outs]
        # each argument of a dim's value, in order: (first output, position) -> kernel argument
        self.dimrefs = {
            (e.outs[0].name, i): dimrefs[(e.outs[0].name, i)]
            for e in eqns
            for i, a in enumerate(e.ins)
            if isinstance(a, DimRef)
        }
        lengths = [_length(v.type) for v in [*inputs, *self.outputs]]
        self.lengths = sorted({x for x in lengths if x is not None}, key=repr)
        self._kernels: dict[tuple[bool, ...], Any] = {}
        self._layouts: dict[tuple[int, ...], tuple[list[int], int]] = {}

    # -- the source

    def source(self, scalar_tensors: tuple[bool, ...]) -> str:
        """The kernel module's text; `scalar_tensors[i]`: the i-th scalar input is a tensor (loaded
        through a pointer), not a Python number (an argument)."""
        n_of = {ln: f"n{i}" for i, ln in enumerate(self.lengths)}
        args: list[str] = []
        head: list[str] = []
        where: dict[str, str] = {}  # a vector's pointer (input or its place in the buffer)
        scal: dict[str, str] = {}  # a scalar's register
        flags = iter(scalar_tensors)
        for k, v in enumerate(self.inputs):
            p = f"in{k}"
            args.append(p)
            if _length(v.type) is None:
                if next(flags):
                    head.append(f"s_in{k} = tl.load({p}).to(tl.float32)")
                    scal[v.name] = f"s_in{k}"
                else:
                    scal[v.name] = p
            else:
                where[v.name] = p
        dim_args = [f"dv{i}" for i in range(len(self.dimrefs))]
        dim_of = dict(zip(self.dimrefs, dim_args, strict=True))
        offs = [f"o{j}" for j in range(len(self.outputs))]
        off_of = {v.name: o for v, o in zip(self.outputs, offs, strict=True)}
        code: list[str] = []
        loop: _Loop | None = None

        def close() -> None:
            nonlocal loop
            if loop is None:
                return
            n = n_of[loop.length]
            code.extend(loop.pre + loop.inits)
            code.append(f"for c0 in range(0, {n}, BLOCK):")
            code.append("    idx = c0 + offs")
            code.append(f"    msk = idx < {n}")
            code.extend("    " + s for s in loop.lines)
            code.extend(loop.finals)
            code.append("tl.debug_barrier()")  # (its stores, before a later loop loads them)
            loop = None

        def operand(e: Eqn, i: int, a: Any) -> str:
            if isinstance(a, Lit):
                return _literal(float(a.value))
            if isinstance(a, DimRef):
                return dim_of[(e.outs[0].name, i)]
            if a.name in scal:
                return scal[a.name]
            assert loop is not None
            r = f"r_{a.name}"
            if a.name not in loop.in_regs:  # loaded from the input or the buffer, once a chunk
                loop.lines.append(f"{r} = tl.load({where[a.name]} + idx, mask=msk, other=0).to(tl.float32)")
                loop.in_regs.add(a.name)
            return r

        def rounded(x: str, annot: str | None) -> str:
            if annot == "bf16":
                return f"_bf16({x})"
            if annot == "f16":
                return f'{x}.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)'
            return x

        def reads_pending(e: Eqn) -> bool:
            return loop is not None and any(isinstance(a, Var) and a.name in loop.pending for a in e.ins)

        for e in self.eqns:
            od = REGISTRY[e.op]
            o = e.outs[0]
            if od.reduces:  # a vector folded to a scalar, in the loop over its length
                fold = _fold(e.op)
                assert fold is not None
                (j, x), *_ = [(i, a) for i, a in enumerate(e.ins) if isinstance(a, Var)]
                ln = _length(x.type)
                assert ln is not None
                if loop is None or loop.length != ln:
                    close()
                    loop = _Loop(ln)
                xv = operand(e, j, x)
                ident = {"sum": "0.0", "max": "float('-inf')", "min": "float('inf')"}[fold]
                acc, reg = f"acc_{o.name}", f"s_{o.name}"
                loop.inits.append(f"{acc} = tl.full((BLOCK,), {ident}, tl.float32)")
                term = f"tl.where(msk, {xv}, {ident})"
                loop.lines.append(
                    f"{acc} = {acc} + {term}" if fold == "sum" else f"{acc} = {_COMBINE[fold]}({acc}, {term})"
                )
                loop.finals.append(f"{reg} = {rounded(f'tl.reduce({acc}, 0, {_COMBINE[fold]})', o.annot)}")
                loop.finals.append(f"tl.store(buf + {off_of[o.name]}, {reg})")
                loop.pending.add(o.name)
                scal[o.name] = reg
                continue
            params = {k: v for k, v in e.params if not isinstance(v, Dim)}
            triton = od.lower.triton
            assert triton is not None
            ln = _length(o.type)
            if (
                ln is None
            ):  # a scalar: straight-line code, before the open loop or after it if it reads its folds
                xs = [operand(e, i, a) for i, a in enumerate(e.ins)]
                reg = f"s_{o.name}"
                if loop is None:
                    target = code
                elif reads_pending(e):
                    target = loop.finals
                    loop.pending.add(o.name)
                else:
                    target = loop.pre
                target.append(f"{reg} = {rounded(triton(*xs, **params), o.annot)}")
                target.append(f"tl.store(buf + {off_of[o.name]}, {reg})")
                scal[o.name] = reg
                continue
            if loop is None or loop.length != ln or reads_pending(e):
                close()
                loop = _Loop(ln)
            xs = [operand(e, i, a) for i, a in enumerate(e.ins)]
            r = f"r_{o.name}"
            loop.lines.append(f"{r} = {rounded(triton(*xs, **params), o.annot)}")
            loop.lines.append(f"tl.store(buf + {off_of[o.name]} + idx, {r}, mask=msk)")
            loop.in_regs.add(o.name)
            where[o.name] = f"buf + {off_of[o.name]}"
        close()
        signature = ", ".join(
            [*args, "buf", *offs, *(n_of[ln] for ln in self.lengths), *dim_args, "BLOCK: tl.constexpr"]
        )
        lines = [
            *module_head(self.interpret),
            f"def {self.name}({signature}):",
            "    offs = tl.arange(0, BLOCK)",
            *("    " + s for s in head),
            *("    " + s for s in code),
            "",
        ]
        return "\n".join(lines)

    # -- building and running

    def kernel(self, scalar_tensors: tuple[bool, ...]) -> Any:
        k = self._kernels.get(scalar_tensors)
        if k is None:
            k = self._kernels[scalar_tensors] = load_kernel(
                self.source(scalar_tensors), self.name, self.interpret
            )
        return k

    def layout(self, lens: tuple[int, ...]) -> tuple[list[int], int]:
        """Each output's offset in the buffer (ALIGN-aligned), and the buffer's size, at these lengths."""
        got = self._layouts.get(lens)
        if got is None:
            size = dict(zip(self.lengths, lens, strict=True))
            offsets, end = [], 0
            for v in self.outputs:
                ln = _length(v.type)
                offsets.append(end)
                end += -(-(1 if ln is None else size[ln]) // ALIGN) * ALIGN
            got = self._layouts[lens] = (offsets, max(end, 1))
        return got

    def __call__(self, env: dict[str, Any], dims: dict[str, int], device: torch.device) -> bool:
        """Bind every value the run defines into `env` (one launch); False where the kernel can't run
        on these values (off a GPU, an empty vector, an operand that isn't what the types say): then
        `env` is unchanged and the caller runs the equations one by one."""
        if device.type != "cuda" and not self.interpret:
            return False
        lens = tuple((dims[n] if n is not None else 1) * num // den for n, num, den in self.lengths)
        if any(n <= 0 for n in lens):
            return False
        size = dict(zip(self.lengths, lens, strict=True))
        args: list[Any] = []
        flags: list[bool] = []
        for v in self.inputs:
            x = env.get(v.name)
            ln = _length(v.type)
            if isinstance(x, torch.Tensor):
                if x.device != device or not x.is_floating_point():
                    return False
                if ln is None:
                    if x.dim() != 0:
                        return False
                    flags.append(True)
                elif x.dim() != 1 or x.shape[0] != size[ln]:
                    return False
                args.append(x if x.is_contiguous() else x.contiguous())
            elif ln is None and isinstance(x, (int, float)) and not isinstance(x, bool):
                flags.append(False)
                args.append(float(x))
            else:
                return False
        offsets, total = self.layout(lens)
        buf = torch.empty(total, dtype=torch.float32, device=device)
        dvals = [
            float((dims[n] if n is not None else 1) * num // den) for n, num, den in self.dimrefs.values()
        ]
        launch(self.kernel(tuple(flags)), (1,), *args, buf, *offsets, *lens, *dvals, BLOCK=BLOCK, num_warps=4)
        for v, off in zip(self.outputs, offsets, strict=True):
            ln = _length(v.type)
            env[v.name] = buf[off] if ln is None else buf[off : off + size[ln]]
        return True


__all__ = ["VectorRun", "plan_runs", "unsupported"]
