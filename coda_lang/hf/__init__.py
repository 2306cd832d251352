"""Hugging Face integration: `apply_coda(model)` (or the family's own `apply_coda_to_llama`,
`apply_coda_to_qwen3`, ...) makes a Hugging Face causal LM whose non-attention work runs as coda
blocks; `AutoCodaForCausalLM.from_pretrained(...)` loads one and patches it.

What it does: patches one model instance in place. Per layer, q/k/v projections become one parameter
`qkv_weight` (q and k rows in the interleaved RoPE layout; registered, with the layer's input norm,
under the module whose forward reads it: checkpoint.py) and gate/up one parameter
`mlp.gate_up_weight` (rows interleaved; Phi-3's fused `qkv_proj` and `gate_up_proj` reordered
alike); the model's forward then runs, in the paper's schedule, the
first layer's input norm + QKV + RoPE (+ a q/k norm: Qwen3's and Gemma 3's per head, OLMo 2's over
each projection) as one block, each layer boundary (out-proj + residual + norm + gate/up + SwiGLU +
down + residual + the next layer's norm + QKV + RoPE; OLMo 2's norms after the out- and
down-projections instead, Gemma's before and after them, of 1 + w, with GeGLU) as one block, the last
layer's MLP as one block, and the LM head with the loss (labels given: per-token cross-entropy, logits
never stored; Gemma's soft-capped) or the logits. Attention is the model's own attention function
(`config._attn_implementation`), on q, k in the interleaved layout (q.k is unchanged by permuting q and
k alike). `state_dict()` gives, and `load_state_dict()` takes, the unpatched model's names and layouts,
so checkpoints move between patched and unpatched models (and `save_pretrained`).
What it does not: generation with a KV cache, biases other than a family's own (Qwen2's q/k/v
biases), sliding-window attention in a family without it (where a family has it, its attention
function runs the window: masks.py), RoPE types that scale cos/sin (`attention_scaling` != 1) or
change `inv_freq` per call (Phi-3's LongRoPE), a partial rotary factor, dropout on the residual
branches in training (Phi-3's `resid_pdrop`), peft layers other than plain LoRA on the seven
projections (Phi-3's four), LoRA dropout in training, quantized layers (bitsandbytes, QLoRA), or
anything the fused forward would bypass (hooks on the modules whose work the blocks do, a module
swapped or a config field changed since patching): each raises ValueError naming what it met and
what to do (checks.py at patching, contract.py at each forward;
docs/models.md lists them). peft LoRA applied before patching runs in the blocks (lora.py: each adapted
GEMM adds the adapters' output to its accumulator). `unpatch(model)` gives the transformers model back (generation with a KV cache works
again).
Invariants: the optimizer should be made after patching (the fused weights are new parameters); the
loss follows transformers' contract (labels shifted by one, -100 ignored, the mean over counted tokens
or the sum over `num_items_in_batch`).
The LM head's loss mode and chunk sizes are the patch's keyword arguments (`loss_mode`,
`loss_budget`, `loss_rows`: hf/loss.py, `LossSettings`). `fp8=` trains in fp8 (fp8.py); under DDP
or FSDP2, `reduce_fp8_amaxes(model)` gives every rank the scales of the whole batch;
`fp8_state_dict(model)` / `load_fp8_state_dict(model, state)` save and resume the fp8 scales.

The modules: families.py (the families and their entry points), patch.py (patching one model, and
unpatching it), checks.py (what a model must be), lora.py (the weights a block reads under peft
LoRA), contract.py (what the forward checks has not changed since patching), state.py (the patched
model's blocks and settings), forward.py (the patched forward), masks.py (each layer's attention mask
and sliding window), loss.py (the loss head), checkpoint.py (fused and checkpoint layouts), blocks.py
(the .coda program). Needs `pip install 'coda_lang[hf]'`.
"""

from coda_lang.hf.checkpoint import unfused_grads
from coda_lang.hf.families import (
    AutoCodaForCausalLM,
    apply_coda,
    apply_coda_to_gemma2,
    apply_coda_to_gemma3,
    apply_coda_to_granite,
    apply_coda_to_llama,
    apply_coda_to_ministral,
    apply_coda_to_mistral,
    apply_coda_to_olmo2,
    apply_coda_to_phi3,
    apply_coda_to_qwen2,
    apply_coda_to_qwen3,
)
from coda_lang.hf.fp8 import load_state_dict as load_fp8_state_dict
from coda_lang.hf.fp8 import reduce_amaxes as reduce_fp8_amaxes
from coda_lang.hf.fp8 import state_dict as fp8_state_dict
from coda_lang.hf.patch import unpatch

__all__ = [
    "AutoCodaForCausalLM",
    "apply_coda",
    "apply_coda_to_gemma2",
    "apply_coda_to_gemma3",
    "apply_coda_to_granite",
    "apply_coda_to_llama",
    "apply_coda_to_ministral",
    "apply_coda_to_mistral",
    "apply_coda_to_phi3",
    "apply_coda_to_olmo2",
    "apply_coda_to_qwen2",
    "apply_coda_to_qwen3",
    "fp8_state_dict",
    "load_fp8_state_dict",
    "reduce_fp8_amaxes",
    "unfused_grads",
    "unpatch",
]
