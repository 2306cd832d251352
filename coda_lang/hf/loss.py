"""The LM head's loss in a patched model: transformers' loss contract, run chunk by chunk.

What it does: `LossSettings`, the head's mode and chunk sizes (`apply_coda_to_*`'s `loss_mode=`,
`loss_budget=`, `loss_rows=`, checked when made); `targets` (labels shifted by one, -100 ignored, checked in range); `ChunkedLoss`, the
"rows" mode: the head's forward and backward at once, in chunks of rows (`BlockFunction.
forward_backward`), the gradients scaled in the backward (`scale_round`); with a tied embedding,
`TiedGrad` and `Embed` hand the head's f32 weight-gradient total to the embedding's backward, which
adds its rows and rounds once (`tied_grad`). The chunk sizes: `LOSS_ROWS_BYTES` ("rows") and
`LOSS_CHUNK_BYTES` ("vocab": the head's backward in chunks of the vocabulary).
What it does not: run the layers (forward.py) or choose the mode (the model's state, state.py).
Invariants: the loss is the mean over counted tokens, or the sum over `num_items_in_batch`; on a GPU
the scaling and the tied gradient are one Triton kernel each, elsewhere torch's ops with the same
rounding.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from coda_lang.torch import BlockFunction

IGNORE = -100
LOSS_MODES = ("rows", "vocab", "fp8")


def _count(name: str, value: Any, what: str) -> int | None:
    """`value` (None, or a positive int: not a bool) as an int; TypeError or ValueError otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}= is {value!r}; it takes {what}")
    if value < 1:
        raise ValueError(f"{name}= is {value!r}; it takes {what}")
    return int(value)


@dataclass(frozen=True)
class LossSettings:
    """How a patched model's LM head makes the loss (docs/models.md, "Loss"). `mode`: "rows" (chunks
    of rows, each chunk's backward run at once in the forward: three GEMMs, one [rows, V] tile of
    logits at a time), "vocab" (only the log-sum-exp kept, the backward's GEMM run again in chunks
    of the vocabulary: four GEMMs, less memory) or "fp8" (with fp8="delayed" only: the head's GEMMs in
    fp8, e4m3 forward and e5m2 dlogits, run whole: four GEMMs, the [M, V] dlogits in e5m2 and their
    K-major copy held during the backward). `rows` ("rows"): rows per chunk (None: as many as
    keep a chunk's logits within LOSS_ROWS_BYTES). `budget` ("vocab"): bytes of a chunk's dlogits
    (None: LOSS_CHUNK_BYTES). Checked when made: TypeError for a value of the wrong type, ValueError
    for a mode that is not one, a number below 1, or a setting of the other mode."""

    mode: str = "rows"
    budget: int | None = None
    rows: int | None = None

    def __post_init__(self) -> None:
        modes = " or ".join(map(repr, LOSS_MODES))
        if not isinstance(self.mode, str):
            raise TypeError(f"loss_mode= is {self.mode!r}; it takes {modes}")
        if self.mode not in LOSS_MODES:
            raise ValueError(f"loss_mode= is {self.mode!r}; it takes {modes}")
        object.__setattr__(self, "budget", _count("loss_budget", self.budget, "a positive number of bytes"))
        object.__setattr__(self, "rows", _count("loss_rows", self.rows, "a positive number of rows"))
        if self.budget is not None and self.mode != "vocab":
            raise ValueError(
                f"loss_budget= bounds the chunks of loss_mode='vocab'; loss_mode={self.mode!r} takes loss_rows="
            )
        if self.rows is not None and self.mode != "rows":
            raise ValueError(
                f"loss_rows= sizes the chunks of loss_mode='rows'; loss_mode={self.mode!r} takes loss_budget="
            )


def targets(labels: torch.Tensor, shift_labels: Any, vocab: int) -> torch.Tensor:
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    t = shift_labels.reshape(-1)
    bad = (t != IGNORE) & ((t < 0) | (t >= vocab))
    if t.device.type == "cpu":
        if bool(bad.any()):
            raise ValueError(f"labels must be in [0, {vocab}) or {IGNORE}, got {int(t[bad][0])}")
    else:
        torch._assert_async(~bad.any(), f"labels must be in [0, {vocab}) or {IGNORE}")
    return t.to(torch.int32)


# The loss head's backward ("vocab" mode) runs in chunks of the vocabulary whose [M, c] dlogits stay
# under this many bytes.
LOSS_CHUNK_BYTES = 256 * 2**20


class ChunkedLoss(torch.autograd.Function):
    """sum(per-token loss) / denom, with the gradients of hg, r and w_lm made in the forward, chunk
    by chunk (BlockFunction.forward_backward); the backward scales them by the incoming gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        hg: torch.Tensor,
        r: torch.Tensor,
        w_lm: torch.Tensor,
        target: torch.Tensor,
        denom: torch.Tensor,
        head: BlockFunction,
        rows: int,
        tied: TiedGrad | None,
    ) -> torch.Tensor:
        scale = (1.0 / denom.float()).to(hg.device)
        # the weight's gradient stays an f32 total until the backward scales it and rounds it, one pass
        # (the total is no larger than the chunks' working memory it outlives)
        outs, grads = head.forward_backward(
            hg=hg,
            r=r,
            w_lm=w_lm,
            target=target,
            cotangents={"loss": scale.expand(hg.shape[0])},
            chunk=rows,
            rounded=False,
        )
        ctx.kept = tuple(
            grads[n] if ctx.needs_input_grad[i] else None for i, n in enumerate(("hg", "r", "w_lm"))
        )
        ctx.dtypes = (hg.dtype, r.dtype, w_lm.dtype)
        ctx.tied = tied
        return outs["loss"].sum() * scale

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        kept = ctx.__dict__.pop("kept", None)
        if kept is None:
            raise RuntimeError(
                "coda_lang.hf: a second backward through the loss (retain_graph=True): the loss head of "
                "loss_mode='rows' makes its gradients in the forward and hands them to the first backward "
                "only (the f32 weight-gradient total is not kept for another), and the layers' blocks "
                "write their backward over what they saved; run the forward again for another backward"
            )
        dh, dr = (
            None if t is None else scale_round(t, g, dt)
            for t, dt in zip(kept[:2], ctx.dtypes[:2], strict=True)
        )
        dw = None
        if kept[2] is not None:
            if ctx.tied is not None:  # the embedding's backward adds its rows and rounds: Embed
                ctx.tied.total, ctx.tied.scale = kept[2], g
            else:
                dw = scale_round(kept[2], g, ctx.dtypes[2])
        return (dh, dr, dw, None, None, None, None, None)


class TiedGrad:
    """A tied LM head and embedding: the head's weight-gradient total (f32) and the loss's incoming
    gradient, handed from the head's backward to the embedding's, which runs after it (the embedding
    is upstream of every layer). One pass then makes the weight's gradient, accumulated once
    (`tied_grad`), where torch fills a dense [V, D] embedding gradient, scatters into it and adds it
    to the head's."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None


class Embed(torch.autograd.Function):
    """torch's embedding lookup, whose backward adds the loss head's weight gradient left in `tied`
    (without it, as torch's embedding backward: a backward that did not start from the loss)."""

    @staticmethod
    def forward(
        ctx: Any, weight: torch.Tensor, ids: torch.Tensor, padding_idx: int | None, tied: TiedGrad
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.tied, ctx.vocab, ctx.dtype = padding_idx, tied, weight.shape[0], weight.dtype
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (ids,) = ctx.saved_tensors
        tied: TiedGrad = ctx.tied
        total, scale = tied.total, tied.scale
        tied.total = tied.scale = None
        if total is None or scale is None:
            pad = -1 if ctx.padding_idx is None else ctx.padding_idx
            dw = torch.ops.aten.embedding_dense_backward(grad, ids, ctx.vocab, pad, False)
        else:
            dw = tied_grad(total, scale, ids, grad.reshape(-1, grad.shape[-1]), ctx.dtype, ctx.padding_idx)
        return dw, None, None, None


def tied_grad(
    total: torch.Tensor,
    scale: torch.Tensor,
    ids: torch.Tensor,
    rows: torch.Tensor,
    dtype: torch.dtype,
    padding_idx: int | None,
) -> torch.Tensor:
    """total * scale plus each token's row of `rows` added at its id (none at `padding_idx`), in f32,
    rounded to dtype once: on a GPU one Triton kernel (backend_triton/layouts.py), else torch's
    index_add."""
    if total.device.type == "cuda":
        # lazy: imports Triton, which only a GPU run needs
        from coda_lang.backend_triton import layouts

        return layouts.tied_grad(total, scale.reshape(1), ids, rows, dtype, padding_idx)
    out = total.float() * scale.float()
    flat = ids.reshape(-1)
    add = rows.float()
    if padding_idx is not None:
        add = add * (flat != padding_idx % total.shape[0]).unsqueeze(1)
    return out.index_add_(0, flat, add).to(dtype)


def tied_embedding(model: Any, family: Any) -> bool:
    """Whether the embedding lookup may be `Embed`: a plain nn.Embedding (or the family's scaled
    embedding, Gemma's: the forward multiplies by its `embed_scale` as its module does) sharing the LM
    head's weight, with nothing its module call would do besides the lookup (no hooks, max_norm or
    sparse gradients)."""
    from torch.nn.modules import module as m

    e: Any = model.model.embed_tokens
    plain = type(e) is torch.nn.Embedding
    return (
        (plain or (family.scaled_embedding and type(e) is scaled_embedding(model)))
        and e.weight is model.lm_head.weight
        and e.weight.requires_grad
        and torch.is_grad_enabled()
        and e.max_norm is None
        and not e.scale_grad_by_freq
        and not e.sparse
        and "forward" not in e.__dict__
        and not (e._forward_hooks or e._forward_pre_hooks)
        and not (m._global_forward_hooks or m._global_forward_pre_hooks)
    )


def scaled_embedding(model: Any) -> type:
    """The scaled embedding class (`<prefix>TextScaledWordEmbedding`: Gemma's) of the modeling module
    that defines the model's class."""
    import sys

    modeling = sys.modules[type(model).__module__]
    prefix = type(model).__name__.removesuffix("ForCausalLM")
    cls: type = getattr(modeling, f"{prefix}TextScaledWordEmbedding")
    return cls


def scale_round(t: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t * g rounded to dtype, in one pass: on a GPU one Triton kernel (backend_triton/layouts.py), else
    torch's mul into a tensor of that dtype."""
    if t.device.type == "cuda":
        # lazy: imports Triton, which only a GPU run needs
        from coda_lang.backend_triton import layouts

        return layouts.scale_round(t, g.reshape(1), dtype)
    return torch.mul(t, g, out=torch.empty(t.shape, dtype=dtype, device=t.device))


# Rows per chunk of the loss head in "rows" mode: its forward keeps a chunk's bf16 logits, which its
# backward overwrites with their cotangent, one [rows, V] tile within this many bytes (4096 rows of a
# 128256-token vocabulary). Fewer, larger chunks: each chunk's weight-gradient GEMM reads and writes
# the f32 [V, D] total once (D = 2048: 2 GiB per chunk).
LOSS_ROWS_BYTES = 2**30


def rows_per_chunk(m: int, vocab: int, itemsize: int) -> int:
    """Rows per chunk of the loss head: whole multiples of 128 whose [rows, V] tile fits
    LOSS_ROWS_BYTES."""
    rows = max(128, LOSS_ROWS_BYTES // max(1, vocab * itemsize) // 128 * 128)
    return min(m, rows)
