"""The entry points of the model families the patch knows: `apply_coda_to_<family>`.

What it does: `apply_coda_to_llama`, `apply_coda_to_qwen3`: check the loss settings, then patch a
model of that family (patch.py) with its facts (family.py). A new family's entry point goes here, its
facts in family.py, blocks it needs beyond these in blocks.py.
What it does not: patch (patch.py) or check (checks.py).
"""

from __future__ import annotations

from typing import Any

from coda_lang.hf.family import LLAMA, QWEN3
from coda_lang.hf.loss import LossSettings
from coda_lang.hf.patch import apply


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
