"""Liveness in a block's run: what each statement reads last, and which buffers a consuming run may
overwrite.

What it does: `Liveness` (one per CudaBlock) knows, for each body item of the block (a stage or a
vector equation between stages, by its index in the body), the values whose last read it is
(`dead_after`: what a consuming run drops after it) and, for each value, the item that reads it last
(`last_read`; a block output is never dead). For a run that may consume some values (an autograd
backward: the tensors its forward saved for it alone), it gives the buffers a statement may store
over instead of allocating: `into`, the buffer a GEMM stage writes its D into (its packed C operand,
or a tile it loads at D's shape: a running total `acc + total`), and `into_loads`, the buffers an
elementwise stage stores its tiles over (the loss head's dlogits over its logits). `reads` is the
names a body item reads.
What it does not: run, drop or launch anything (cuda_block.py's run loop does, with what this says),
or decide what a run may consume (autograd.py does).
Invariants: a buffer is handed out only when its value is consumable, read by nothing after the
statement, contiguous, of the stored tile's dtype and shape (and, for a GEMM's D, 16-byte aligned);
each kernel given one reads every element before it stores there (docs/backend.md, "torch.compile and
autograd").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from coda_lang.backend_cute.plan.spec import StageSpec
from coda_lang.backend_cute.runtime.launch import TORCH_DTYPES
from coda_lang.ir.nodes import Stage, Var

if TYPE_CHECKING:
    from coda_lang.backend_triton.elementwise import ElementwiseStage


def reads(item: Any) -> set[str]:
    """The names a body item (a stage or a vector equation) reads."""
    if isinstance(item, Stage):
        names = {a.name for a in item.operands if isinstance(a, Var)}  # (its block scales among them)
        names |= {a.name for e in item.body for a in e.ins if isinstance(a, Var)}
        return names - {"acc"} - {v.name for e in item.body for v in e.outs}
    return {a.name for a in item.ins if isinstance(a, Var)}


class Liveness:
    """The last reads of a block's values, and the buffers a consuming run may store over (see the
    module docstring). `i` below is a statement's index in the block's body."""

    def __init__(self, ir: Any):
        # the body item (statement index) of each value's last read (block outputs are never dead), and
        # the values whose last read is each item: what a consuming run drops after it
        self.last_read: dict[str, int] = {}
        for i, item in enumerate(ir.body):
            for n in reads(item):
                self.last_read[n] = i
        for o in ir.outputs:
            self.last_read[o.name] = len(ir.body)
        self.dead_after: list[list[str]] = [[] for _ in ir.body]
        for n, i in self.last_read.items():
            if i < len(ir.body):
                self.dead_after[i].append(n)

    def into(
        self, spec: StageSpec, i: int, env: dict[str, Any], consume: frozenset[str]
    ) -> torch.Tensor | None:
        """The buffer a stage may write its D into: that of the tile it loads at D's coordinates (a
        packed stage's C operand, or a TileLoad of D's shape: a running total `acc + total`) when
        that tile is consumable, read by nothing after this stage, and of D's dtype. Each tile of the
        GEMM loads its subtile of that input before it stores its D there, and no two tiles share
        elements, so the kernel reads every element before it overwrites it."""
        d = spec.d
        if d is None:
            return None
        src = spec.c
        if src is None:
            src = next(
                (o for o in spec.operands if o.role == "tile" and o.name in consume and o.shape == d.shape),
                None,
            )
        if src is None:
            return None
        t = self.overwritable(src.name, d.dtype, i, env, consume)
        if t is None or t.data_ptr() % 16:
            return None
        return t

    def into_loads(
        self, es: ElementwiseStage, i: int, env: dict[str, Any], consume: frozenset[str]
    ) -> dict[str, torch.Tensor] | None:
        """Buffers an elementwise stage may store its tiles over: for each stored tile, a tile it
        loads of the same shape and dtype that is consumable and read by nothing after it (the loss
        head's backward writes dlogits over the logits it saved)."""
        over: dict[str, torch.Tensor] = {}
        taken: set[str] = set()
        for name, dtype, shape in es.stores:
            for ld in es.loads:
                if ld.role != "tile" or ld.name in taken or ld.shape != shape or ld.dtype != dtype:
                    continue
                t = self.overwritable(ld.name, dtype, i, env, consume)
                if t is not None:
                    over[name] = t
                    taken.add(ld.name)
                    break
        return over or None

    def overwritable(
        self, name: str, dtype: str, i: int, env: dict[str, Any], consume: frozenset[str]
    ) -> torch.Tensor | None:
        """Value `name`'s tensor when statement i may store a `dtype` tile over it: it is consumable,
        read by nothing after statement i, contiguous and of that dtype."""
        if name not in consume or self.last_read.get(name) != i:
            return None
        t = env.get(name)
        if not isinstance(t, torch.Tensor) or not t.is_contiguous() or t.dtype != TORCH_DTYPES[dtype]:
            return None
        return t
