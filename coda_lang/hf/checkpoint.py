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
    """q/k/v and gate/up of `layer` made one parameter each (their gradients too, when they have any),
    the projections removed, and the state-dict hooks of the unpatched names registered; the
    attention's and MLP's children's order kept for `unfuse_layer`. checks.py has refused parts whose
    requires_grad, dtype, device or hooks differ."""
    attn, mlp = layer.self_attn, layer.mlp
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    g, u = mlp.gate_proj.weight, mlp.up_proj.weight
    with torch.no_grad():
        qkv = fuse_qkv(q, k, v, hd)
        gu = torch.stack([g, u], 1).flatten(0, 1)
        qkv_grads, gu_grads = _grads(q, k, v), _grads(g, u)
        qkv_grad = fuse_qkv(qkv_grads[0], qkv_grads[1], qkv_grads[2], hd) if qkv_grads else None
        gu_grad = torch.stack(gu_grads, 1).flatten(0, 1) if gu_grads else None
    attn._coda_nq, attn._coda_nk = q.shape[0], k.shape[0]
    attn._coda_children, mlp._coda_children = tuple(attn._modules), tuple(mlp._modules)
    attn.qkv_weight = torch.nn.Parameter(qkv, requires_grad=q.requires_grad)
    mlp.gate_up_weight = torch.nn.Parameter(gu.contiguous(), requires_grad=g.requires_grad)
    attn.qkv_weight.grad, mlp.gate_up_weight.grad = qkv_grad, gu_grad
    del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
    attn._register_state_dict_hook(attn_save_hook)
    attn.register_load_state_dict_pre_hook(attn_load_hook)
    mlp._register_state_dict_hook(mlp_save_hook)
    mlp.register_load_state_dict_pre_hook(mlp_load_hook)


def _grads(*ws: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of `ws` (zeros for those without), or [] when none has one."""
    if all(w.grad is None for w in ws):
        return []
    return [torch.zeros_like(w) if w.grad is None else w.grad for w in ws]


def check_unfusable(path: str, layer: Any) -> None:
    """ValueError unless `layer` (at `path`) has the fused parameters `unfuse_layer` splits."""
    for sub, name in (("self_attn", "qkv_weight"), ("mlp", "gate_up_weight")):
        m = getattr(layer, sub, None)
        if m is None or not isinstance(m._parameters.get(name), torch.Tensor):
            raise ValueError(
                f"coda_lang.hf: {path}.{sub}.{name}: gone since patching; this model can't be unpatched"
            )


def unfuse_layer(path: str, layer: Any) -> None:
    """`fuse_layer` undone: q/k/v and gate/up as `nn.Linear`s again, their weights (and gradients)
    the fused ones' rows exactly, each child in its place; the fused parameters and the state-dict
    hooks removed."""
    check_unfusable(path, layer)
    attn, mlp = layer.self_attn, layer.mlp
    w, gu = attn.qkv_weight, mlp.gate_up_weight
    nq, nk = attn._coda_nq, attn._coda_nk
    parts = dict(
        zip(("q_proj", "k_proj", "v_proj"), split_qkv(w.detach(), attn.head_dim, nq, nk), strict=True)
    )
    grads = (
        dict(zip(parts, split_qkv(w.grad, attn.head_dim, nq, nk), strict=True)) if w.grad is not None else {}
    )
    _restore(attn, parts, grads, w.requires_grad, "qkv_weight", attn_save_hook, attn_load_hook)
    parts = {"gate_proj": gu.detach()[0::2].contiguous(), "up_proj": gu.detach()[1::2].contiguous()}
    grads = (
        {"gate_proj": gu.grad[0::2].contiguous(), "up_proj": gu.grad[1::2].contiguous()}
        if gu.grad is not None
        else {}
    )
    _restore(mlp, parts, grads, gu.requires_grad, "gate_up_weight", mlp_save_hook, mlp_load_hook)
    del attn._coda_nq, attn._coda_nk


def _restore(
    m: Any,
    parts: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    requires_grad: bool,
    fused: str,
    save: Any,
    load: Any,
) -> None:
    for name, t in parts.items():
        lin = torch.nn.utils.skip_init(
            torch.nn.Linear, t.shape[1], t.shape[0], bias=False, device=t.device, dtype=t.dtype
        )
        lin.weight = torch.nn.Parameter(t, requires_grad=requires_grad)
        lin.weight.grad = grads.get(name)
        setattr(m, name, lin)
    delattr(m, fused)
    order = m.__dict__.pop("_coda_children", ())
    children = {**{n: m._modules[n] for n in order if n in m._modules}, **m._modules}
    m._modules.clear()
    m._modules.update(children)
    for key, hook in list(m._state_dict_hooks.items()):
        if hook is save:
            del m._state_dict_hooks[key]
    for key, hook in list(m._load_state_dict_pre_hooks.items()):
        if getattr(hook, "hook", hook) is load:
            del m._load_state_dict_pre_hooks[key]


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
