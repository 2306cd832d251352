"""Hugging Face integration: one call patches a transformers model to run its non-attention work as coda
blocks (`apply_coda_to_llama`, `apply_coda_to_qwen3`; hf/patch.py). Needs `pip install 'coda_lang[hf]'`."""

from coda_lang.hf.patch import apply_coda_to_llama, apply_coda_to_qwen3

__all__ = ["apply_coda_to_llama", "apply_coda_to_qwen3"]
