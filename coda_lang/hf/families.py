"""The model families the patch knows, and their entry points (`apply_coda_to_llama`, ...).

What it does: one `Family` per transformers model class (its name, its class, whether its attention
normalizes q and k per head), and `apply_coda_to_<family>`, which patches a model of it (patch.py).
A new family's facts and entry point go here; blocks it needs beyond these, in blocks.py.
What it does not: patch (patch.py) or check (checks.py).
Invariants: a family's blocks are `blocks.model_source(..., qk_norm=family.qk_norm)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coda_lang.hf.loss import LossSettings
from coda_lang.hf.patch import apply


@dataclass(frozen=True)
class Family:
    name: str  # as in `apply_coda_to_<name>`
    model_class: str  # the transformers causal LM it patches
    qk_norm: bool  # per-head RMSNorm of q and k in the QKV blocks' epilogue (Qwen3)


LLAMA = Family("llama", "LlamaForCausalLM", qk_norm=False)
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", qk_norm=True)


def apply_coda_to_llama(
    model: Any, *, loss_mode: str = "rows", loss_budget: int | None = None, loss_rows: int | None = None
) -> Any:
    """Patch a transformers `LlamaForCausalLM` in place (and return it) so that everything outside
    attention runs as coda blocks; see `coda_lang.hf`. Make the optimizer afterwards. The LM head's
    loss: `loss_mode` "rows" (default: chunks of `loss_rows` rows, None: 1 GiB of logits each) or
    "vocab" (less memory, one GEMM more: the backward in chunks of the vocabulary within
    `loss_budget` bytes, None: 256 MiB); TypeError or ValueError for a bad setting, before anything
    is patched (hf/loss.py, `LossSettings`)."""
    return apply(model, LLAMA, LossSettings(loss_mode, loss_budget, loss_rows))


def apply_coda_to_qwen3(
    model: Any, *, loss_mode: str = "rows", loss_budget: int | None = None, loss_rows: int | None = None
) -> Any:
    """Patch a transformers `Qwen3ForCausalLM` in place (and return it): as `apply_coda_to_llama`, with
    Qwen3's per-head q/k RMSNorm in the QKV blocks' epilogue."""
    return apply(model, QWEN3, LossSettings(loss_mode, loss_budget, loss_rows))
