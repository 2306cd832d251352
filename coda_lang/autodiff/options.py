"""The options of a backward, as one value: what it recomputes and how it runs in chunks.

What it does: `BackwardOptions(remat=, chunk=, budget=, chunk_dim=)`, checked once when it is made;
`BackwardOptions.of(options, remat=..., ...)`, the value every entry point builds from its `backward=`
argument or its keyword shorthands (`Block.vjp`, `Block.grad`, `coda_lang.torch.function`,
`CudaBlock.autograd`, the fuzzer, `coda grad` and `coda fuzz`).
- `remat`: which forward tiles the backward recomputes rather than reads saved: "auto" (the default),
  "save" or "recompute" (docs/design.md, "Saved and recomputed");
- `chunk`: None (one run), "auto" (as many elements of the chunked dim as keep the chunk's largest
  transient tile within `budget` bytes), or a number of elements per chunk;
- `budget`: bytes of that transient for "auto" (default 256 MiB); a budget alone means "auto";
- `chunk_dim`: the dim to chunk ("M" for the rows, "V" for a vocabulary's columns); alone it means
  "auto"; by default the forward's row dim for a number, and the dim whose run holds the least
  memory for "auto" (docs/design.md, "Chunked backward");
- `fp8_grads`: None (cotangents in bf16), or "e5m2" / "e4m3": the cotangent of the acc of each GEMM
  stage with an fp8 operand is quantized to that dtype with a delayed per-tensor scale, an input
  of the backward (`dacc<k>_scale`), before its dgrad and wgrad GEMMs, which multiply their acc by
  the inverse scale; the backward also returns the cotangent's amax for the next step
  (`dacc<k>_amax`) (docs/design.md, "The fp8 backward");
- `fp8_acc`: False (a GEMM stage's acc, where the backward reads it, is a copy the forward saves in the
  activation dtype), or True: where the stage stores a scaled fp8 copy of its acc itself
  (`q: e4m3 = acc * s`, s a scalar or a vector over acc's rows from outside the stage: its delayed
  scale), the backward reads acc as that copy times 1/s instead, and no
  other copy is saved: half the bytes or less, the acc the backward sees rounded to fp8
  (straight-through: the forward's own uses saw acc unrounded). Everything the backward computes
  again from that acc comes from the copy too: a tile the stage stores that the backward makes again
  rather than saves (the SwiGLU output a down projection's weight gradient reads) is made from the
  rounded acc, as DeepSeek-V3 recomputes its SwiGLU output from the fp8 inputs it caches
  (docs/design.md, "Saving activations in fp8");
- `requantize_wgrad`: False (the weight gradient of a block-scaled GEMM `a @ transpose(w), scale_a=sa`
  reads `a` in the forward's 1 x g groups along K, which change along its contraction, the rows: the
  exact straight-through gradient, which the interpreter runs and no kernel does), or True:
  DeepSeek-V3's recipe, `a` quantized again in g x 1 groups by an elementwise stage of the backward
  (its codes and a scale per g rows and column), which the weight gradient reads instead: the
  gradient of the requantized operand, each of its values rounded twice (docs/design.md).
What it does not: decide whether a block's backward can run in chunks of a dim (chunk.py: CodaError
E0809 when it can't, a property of the program).
Invariants: a mistake in an argument is a TypeError (a value of the wrong type) or a ValueError (a
value out of range, or two that contradict each other), raised where the value is made, never later
and never a CodaError; a made value is valid.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields, replace
from typing import Any

from coda_lang.ir.nodes import DEFAULT_REMAT, REMAT

FP8_GRADS = ("e5m2", "e4m3")  # what fp8_grads= takes besides None
DEFAULT_BUDGET = 256 * 2**20  # bytes of the largest transient of one chunk, for chunk="auto"

_UNSET: Any = None  # a keyword shorthand not given (None is also "not given" for each of them)


def _whole(name: str, value: Any, what: str) -> int:
    """`value` as an int: an int (not a bool) or a NumPy integer; TypeError otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}= is {value!r}; it takes {what}")
    return int(value)


@dataclass(frozen=True)
class BackwardOptions:
    """What a backward recomputes (`remat`) and how it runs in chunks (`chunk`, `budget`,
    `chunk_dim`); see the module docstring. Made once, checked once: TypeError or ValueError for an
    argument that is not what it takes."""

    remat: str = DEFAULT_REMAT
    chunk: int | str | None = None
    budget: int | None = None
    chunk_dim: str | None = None
    fp8_grads: str | None = None
    fp8_acc: bool = False
    requantize_wgrad: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.remat, str):
            raise TypeError(f"remat= is {self.remat!r}; it takes one of {', '.join(map(repr, REMAT))}")
        if self.remat not in REMAT:
            raise ValueError(f"remat= is {self.remat!r}; it takes one of {', '.join(map(repr, REMAT))}")
        chunk = self.chunk
        if chunk is not None and chunk != "auto":
            if isinstance(chunk, str):
                raise ValueError(
                    f'chunk= is {chunk!r}; it takes None (no chunks), "auto" (from budget=) or a number '
                    "of elements per chunk, e.g. chunk=1024"
                )
            chunk = _whole("chunk", chunk, 'None (no chunks), "auto" or a number of elements per chunk')
            if chunk < 1:
                raise ValueError(
                    f"chunk= is {chunk}; a chunk holds at least 1 element (chunk=None: unchunked)"
                )
            object.__setattr__(self, "chunk", chunk)
        if self.budget is not None:
            budget = _whole("budget", self.budget, "a number of bytes, e.g. budget=2**28 (256 MiB)")
            if budget < 1:
                raise ValueError(f"budget= is {budget}; it must be a positive number of bytes")
            if isinstance(self.chunk, int):
                raise ValueError(
                    f'chunk={self.chunk} and budget={budget} both given; budget= picks the chunk only with chunk="auto"'
                )
            object.__setattr__(self, "budget", budget)
        if self.chunk_dim is not None and not isinstance(self.chunk_dim, str):
            raise TypeError(
                f'chunk_dim= is {self.chunk_dim!r}; it takes the name of a dim (a str), e.g. chunk_dim="V"'
            )

        if self.fp8_grads is not None:
            if self.fp8_grads not in FP8_GRADS:
                raise (ValueError if isinstance(self.fp8_grads, str) else TypeError)(
                    f"fp8_grads= is {self.fp8_grads!r}; it takes None (bf16 cotangents), "
                    f"{' or '.join(map(repr, FP8_GRADS))} (cotangents quantized with a delayed per-tensor scale)"
                )
            if self.chunked:
                raise ValueError(
                    "fp8_grads= and chunked backwards both given; a backward with fp8 cotangents does not "
                    "run in chunks yet (run it unchunked)"
                )
        if not isinstance(self.fp8_acc, bool):
            raise TypeError(
                f"fp8_acc= is {self.fp8_acc!r}; it takes True (read each GEMM stage's acc from the fp8 copy "
                "the stage stores, where it stores one) or False"
            )
        if not isinstance(self.requantize_wgrad, bool):
            raise TypeError(
                f"requantize_wgrad= is {self.requantize_wgrad!r}; it takes True (a block-scaled GEMM's weight "
                "gradient reads its activation quantized again in g x 1 groups) or False"
            )
        if self.fp8_acc and self.chunked:
            raise ValueError(
                "fp8_acc=True and chunked backwards both given; a backward that reads acc from its fp8 copy "
                "does not run in chunks yet (run it unchunked)"
            )

    @classmethod
    def of(
        cls,
        options: BackwardOptions | None = None,
        *,
        remat: str | None = _UNSET,
        chunk: int | str | None = _UNSET,
        budget: int | None = _UNSET,
        chunk_dim: str | None = _UNSET,
        fp8_grads: str | None = _UNSET,
        fp8_acc: bool | None = _UNSET,
    ) -> BackwardOptions:
        """The options of a call: `options` (a `backward=` argument) or the keyword shorthands, not both
        (TypeError); `BackwardOptions()` when neither is given."""
        given: dict[str, Any] = {
            k: v
            for k, v in (
                ("remat", remat),
                ("chunk", chunk),
                ("budget", budget),
                ("chunk_dim", chunk_dim),
                ("fp8_grads", fp8_grads),
                ("fp8_acc", fp8_acc),
            )
            if v is not None
        }
        if options is None:
            return cls(**given)
        if not isinstance(options, BackwardOptions):
            raise TypeError(f"backward= is {options!r}; it takes a coda_lang.BackwardOptions")
        if given:
            raise TypeError(
                f"backward= and {', '.join(f'{k}=' for k in given)} both given; put "
                f"{'it' if len(given) == 1 else 'them'} in the BackwardOptions"
            )
        return options

    @property
    def chunked(self) -> bool:
        """Whether the backward runs in chunks (any of chunk=, budget=, chunk_dim= given)."""
        return self.chunk is not None or self.budget is not None or self.chunk_dim is not None

    @property
    def mode(self) -> int | str | None:
        """The chunk a run takes: None (unchunked), "auto", or a number of elements."""
        if self.chunk is not None:
            return self.chunk
        return "auto" if self.chunked else None

    def unchunked(self) -> BackwardOptions:
        """These options with no chunks: the backward they derive, run whole (every other field kept)."""
        return replace(self, chunk=None, budget=None, chunk_dim=None)

    def with_(self, **changes: Any) -> BackwardOptions:
        """A copy with some fields changed (checked again)."""
        return replace(self, **changes)

    def flags(self) -> list[str]:
        """The command-line flags that give these options (`coda grad`, `coda fuzz`), defaults left out."""
        out: list[str] = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v != f.default:
                flag = f"--{f.name.replace('_', '-')}"
                out += [flag] if isinstance(v, bool) else [flag, str(v)]
        return out

    def __str__(self) -> str:
        parts = [f"remat={self.remat}"]
        if self.chunked:
            parts.append(f"chunk={self.mode}")
            if self.budget is not None:
                parts.append(f"budget={self.budget}")
            if self.chunk_dim is not None:
                parts.append(f"chunk_dim={self.chunk_dim}")
        if self.fp8_grads is not None:
            parts.append(f"fp8_grads={self.fp8_grads}")
        if self.fp8_acc:
            parts.append("fp8_acc=True")
        if self.requantize_wgrad:
            parts.append("requantize_wgrad=True")
        return ", ".join(parts)
