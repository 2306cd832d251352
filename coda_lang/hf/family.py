"""The facts of each model family the patch knows: one `Family` per transformers model class.

What it does: `Family` (its name, its causal LM class, whether its attention normalizes q and k per
head) and the families known (`LLAMA`, `QWEN3`). The checks, the model's state and the patch read a
family's facts from here; families.py holds the entry points.
What it does not: anything but describe (no import of transformers, torch or the patch).
Invariants: a family's blocks are `blocks.model_source(..., qk_norm=family.qk_norm)`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    name: str  # as in `apply_coda_to_<name>`
    model_class: str  # the transformers causal LM it patches
    qk_norm: bool  # per-head RMSNorm of q and k in the QKV blocks' epilogue (Qwen3)


LLAMA = Family("llama", "LlamaForCausalLM", qk_norm=False)
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", qk_norm=True)
