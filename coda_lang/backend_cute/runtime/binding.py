"""A CUDA block's call inputs: checked, bound by parameter name, and the dims they give.

What it does: `Binder` (one per CudaBlock) holds what a call's inputs are checked against: the
block's parameters, the dims it was given (`Block.cuda(dims=...)`), its shape rules and its vectors
that repeat across columns. `bind` checks the tensors and numbers of a call (E0801: unknown or missing
input, none a tensor; E0803: a dtype that does not fit, or not a tensor; E0806: inputs on two devices,
or not on CUDA unless emulated), binds each in its dtype (a dense tensor; a number for a scalar, a
16-bit one rounded to its dtype as the interpreter binds it; a parameter's default where none is
given), refuses a tensor without memory to read (E0811: a meta tensor, a DTensor, a storage freed as
FSDP2 frees a resharded parameter's: `unallocated`), and infers the dims from the shapes (interp/inputs.py's rules, which the interpreter uses too),
checking that each repeating vector meets widths that hold whole copies of it (E0802). `given` merges
a call's dims with the block's own; `sizes` infers the dims from shapes alone (one stage's run).
What it does not: run, plan or launch anything, or keep state between calls.
Invariants: a bound environment holds every parameter, each tensor on the one device of the call;
binding never writes to a tensor it is given: one already contiguous in its dtype is bound as it is
(no copy), any other as a copy in its dtype.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from coda_lang.backend_cute.runtime.launch import TORCH_DTYPES, dense
from coda_lang.core.diagnostics import error
from coda_lang.frontend.verify.repeat import check_repeats, repeat_uses
from coda_lang.interp.inputs import dims_from_shapes, given_dims, shape_rules
from coda_lang.ir.types import is_fp8
from coda_lang.ops.registry import torch_round


def unallocated(t: torch.Tensor) -> str | None:
    """Why a kernel can't read `t`'s elements (a tensor with elements but no memory of its own), or
    None: a meta tensor, a DTensor (a shard, or a wrapper whose local tensor is elsewhere), or a
    storage of 0 bytes (FSDP2 frees a parameter's gathered storage when it reshards). Two reads of
    the tensor's header on the usual path."""
    if t.data_ptr() != 0 and t.untyped_storage().nbytes() != 0:
        return None
    if t.numel() == 0:
        return None
    if t.is_meta:
        return "is a meta tensor (no data)"
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        return f"is a DTensor {t.placements}, where the whole tensor is needed"
    return "has no memory (a storage of 0 bytes, as FSDP2 leaves a resharded parameter)"


def unallocated_advice(t: torch.Tensor) -> str:
    """What to do about a tensor `unallocated` refuses."""
    if t.is_meta:
        return "materialize it first (to_empty(), then load the weights)"
    return (
        "FSDP2 gathers a module's parameters only while that module's forward or backward runs, so call "
        "the block inside the forward of the module that owns them"
    )


UNALLOCATED_NOTES = [
    "coda_lang.hf: fully_shard each whole decoder layer, then the model, after patching "
    '(docs/models.md, "Sharded training")',
]


class Binder:
    """Checks and binds the inputs of a block's calls (see the module docstring). `dims`: the sizes
    of dims no input's shape gives, as `Block.cuda(dims=...)` takes them; `emulate`: inputs may be on
    any device."""

    def __init__(self, ir: Any, dims: dict[str, int] | None = None, *, emulate: bool = False):
        self.ir, self.emulate = ir, emulate
        self.dims = given_dims(ir, dims)  # the block's own, added to every call's
        self.shape_rules = shape_rules(ir)
        # vectors over a fixed dim that repeat across columns: a run's sizes must hold whole copies
        self.repeats = repeat_uses(ir)
        # the dims of each (shapes, given dims) bound before: inferred and checked once
        self._dims: dict[tuple[Any, ...], dict[str, int]] = {}

    def given(self, dims: dict[str, int] | None) -> dict[str, int]:
        """The dims given to a call, with the block's own."""
        return {**self.dims, **given_dims(self.ir, dims)} if dims else self.dims

    def sizes(self, shapes: dict[str, tuple[int, ...]], given: dict[str, int]) -> dict[str, int]:
        """Every dim's size, from the parameters' shapes and the dims `given`."""
        return dims_from_shapes(self.ir, self.shape_rules, shapes, given)

    def bind(
        self, tensors: dict[str, Any], given: dict[str, int]
    ) -> tuple[dict[str, Any], dict[str, int], torch.device]:
        """(the bound environment, the dims of the call, its device); `given`: as `given()` makes it."""
        names = {p.var.name for p in self.ir.params}
        unknown = sorted(set(tensors) - names)
        if unknown:
            raise error(
                "E0801",
                f"unknown input `{unknown[0]}`; the block's parameters are {', '.join(sorted(names))}",
            )
        env: dict[str, Any] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        device: torch.device | None = None
        check = not torch.compiler.is_compiling()  # (a traced fake tensor has no data pointer)
        for p in self.ir.params:
            name, t = p.var.name, p.var.type
            assert t is not None
            if name not in tensors:
                if p.default is None:
                    raise error("E0801", f"missing input `{name}`")
                env[name] = p.default
                continue
            v = tensors[name]
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not t.shape:
                if t.dtype == "i32" and not isinstance(v, int):
                    raise error("E0803", f"input `{name}` is {v!r}, but it is declared i32")
                # a 16-bit scalar rounded to its dtype, as the interpreter binds it
                env[name] = (
                    int(v)
                    if t.dtype == "i32"
                    else (
                        float(torch.tensor(float(v)).to(TORCH_DTYPES[t.dtype]))
                        if t.dtype in ("bf16", "f16")
                        else float(torch_round(torch.tensor(float(v)), t.dtype))
                        if is_fp8(t.dtype)
                        else float(v)
                    )
                )
                continue
            if not isinstance(v, torch.Tensor):
                raise error(
                    "E0803", f"input `{name}` is a {type(v).__name__}; the CUDA runtime takes torch tensors"
                )
            if check and (why := unallocated(v)) is not None:
                raise error(
                    "E0811",
                    f"input `{name}` of block `{self.ir.name}` {why}: {unallocated_advice(v)}",
                    notes=UNALLOCATED_NOTES,
                )
            if device is None:
                device = v.device
            elif v.device != device:
                raise error("E0806", f"input `{name}` is on {v.device}, but other inputs are on {device}")
            if t.dtype == "i32":
                if v.is_floating_point() or v.is_complex() or v.dtype == torch.bool:
                    raise error("E0803", f"input `{name}` is {v.dtype}, but it is declared i32")
            elif not (v.is_floating_point() or (v.dim() == 0 and v.dtype != torch.bool)):
                raise error("E0803", f"input `{name}` is {v.dtype}, but it is declared {t.dtype}")
            shapes[name] = tuple(v.shape)
            if is_fp8(t.dtype) and v.dtype != TORCH_DTYPES[t.dtype]:
                v = torch_round(v, t.dtype)  # saturating, as the interpreter binds an fp8 input
            env[name] = dense(v, TORCH_DTYPES[t.dtype])
        if device is None:
            raise error("E0801", "no tensor inputs")
        if not self.emulate and device.type != "cuda":
            raise error(
                "E0806",
                f"inputs are on {device}; the CUDA runtime needs CUDA tensors",
                notes=["Block.run runs the interpreter on CPU tensors"],
            )
        key = (tuple(shapes.items()), tuple(given.items()))
        dims = self._dims.get(key)
        if dims is None:  # (a block's calls repeat a few shapes: each is inferred and checked once)
            dims = self.sizes(shapes, given)
            if self.repeats:
                check_repeats(self.repeats, dims)
            if check and len(self._dims) < 64:
                self._dims[key] = dims
        return env, dict(dims), device
