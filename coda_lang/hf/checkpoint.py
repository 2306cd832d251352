"""Parameter layouts: fused in the patched model, unfused (Hugging Face's) in checkpoints.

What it does: `fuse_layer` replaces a layer's q/k/v projections by one parameter
`self_attn.qkv_weight` (q and k rows in the interleaved RoPE layout) and gate/up by
`mlp.gate_up_weight` (rows interleaved), and registers state-dict hooks so that `state_dict()` gives,
and `load_state_dict()` takes, the unpatched names and layouts; `unfused_grads` gives the gradients
under those names.
What it does not: decide whether a model may be patched (checks.py) or run anything.
Invariants: unfusing a fused weight gives back the original tensors exactly (a permutation of rows);
a checkpoint saved from a patched model loads into an unpatched one and back.
"""

from __future__ import annotations

from typing import Any

import torch

from coda_lang.layout import deinterleave_rope, interleave_rope


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hd: int) -> torch.Tensor:
    w = torch.cat([q, k, v], 0)  # [out, in]
    rw = q.shape[0] + k.shape[0]
    return interleave_rope(w.t(), hd, rw).t().contiguous()


def split_qkv(w: torch.Tensor, hd: int, nq: int, nk: int) -> tuple[torch.Tensor, ...]:
    plain = deinterleave_rope(w.t(), hd, nq + nk).t()
    return plain[:nq].contiguous(), plain[nq : nq + nk].contiguous(), plain[nq + nk :].contiguous()


def attn_save_hook(module: Any, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
    key = prefix + "qkv_weight"
    if key not in state_dict:
        return
    q, k, v = split_qkv(state_dict.pop(key).detach(), module.head_dim, module._coda_nq, module._coda_nk)
    state_dict[prefix + "q_proj.weight"] = q
    state_dict[prefix + "k_proj.weight"] = k
    state_dict[prefix + "v_proj.weight"] = v


def attn_load_hook(module: Any, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    keys = [prefix + f"{n}_proj.weight" for n in "qkv"]
    if all(k in state_dict for k in keys):
        q, k, v = (state_dict.pop(x) for x in keys)
        state_dict[prefix + "qkv_weight"] = fuse_qkv(q, k, v, module.head_dim)


def mlp_save_hook(module: Any, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
    key = prefix + "gate_up_weight"
    if key in state_dict:
        w = state_dict.pop(key).detach()
        state_dict[prefix + "gate_proj.weight"] = w[0::2].contiguous()
        state_dict[prefix + "up_proj.weight"] = w[1::2].contiguous()


def mlp_load_hook(module: Any, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    g, u = prefix + "gate_proj.weight", prefix + "up_proj.weight"
    if g in state_dict and u in state_dict:
        state_dict[prefix + "gate_up_weight"] = torch.stack(
            [state_dict.pop(g), state_dict.pop(u)], 1
        ).flatten(0, 1)


def fuse_layer(layer: Any, hd: int) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    with torch.no_grad():
        qkv = fuse_qkv(q, k, v, hd)
        gu = torch.stack([mlp.gate_proj.weight, mlp.up_proj.weight], 1).flatten(0, 1)
    attn._coda_nq, attn._coda_nk = q.shape[0], k.shape[0]
    attn.qkv_weight = torch.nn.Parameter(qkv, requires_grad=q.requires_grad)
    mlp.gate_up_weight = torch.nn.Parameter(gu.contiguous(), requires_grad=mlp.gate_proj.weight.requires_grad)
    del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
    attn._register_state_dict_hook(attn_save_hook)
    attn.register_load_state_dict_pre_hook(attn_load_hook)
    mlp._register_state_dict_hook(mlp_save_hook)
    mlp.register_load_state_dict_pre_hook(mlp_load_hook)


def unfused_grads(model: Any) -> dict[str, torch.Tensor]:
    """The gradients of a patched model's parameters under the unpatched model's names and layouts (as
    its `state_dict()` names them): to compare with an unpatched model, or to log per-projection norms."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, Any] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        if name.endswith("self_attn.qkv_weight") or name.endswith("mlp.gate_up_weight"):
            fused[name] = p.grad
        else:
            out[name] = p.grad
    for name, g in fused.items():
        prefix = name.rsplit(".", 1)[0] + "."
        module = model.get_submodule(prefix[:-1])
        sd = {name.rsplit(".", 1)[1]: g}
        (attn_save_hook if name.endswith("qkv_weight") else mlp_save_hook)(module, sd, "", None)
        out.update({prefix + k: v for k, v in sd.items()})
    return out
