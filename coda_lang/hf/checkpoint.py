"""Parameter layouts and owners: fused, and registered under the module whose forward reads them, in
the patched model; unfused under Hugging Face's names in checkpoints.

What it does: `fuse_and_move(model, hd)` replaces each layer's q/k/v projections by one parameter
`qkv_weight` (q and k rows in the interleaved RoPE layout; `FusedQKV`, which also takes Qwen3's or
OLMo 2's `q_norm` and `k_norm`) and gate/up by `mlp.gate_up_weight` (rows interleaved), then moves each
weight to the module whose forward runs the block that reads it (`Moved` containers): layer i+1's
input norm and QKV under layer i (`layers.i.coda_next`), the final norm under the last layer
(`layers.{L-1}.coda_next.norm`), layer 0's input norm and QKV under the base model (`coda_first`);
a family without input norms (OLMo 2) has only the QKV moved.
Qwen2's q, k and v biases become one parameter `qkv_bias` of the `FusedQKV`, in its rows' order.
Phi-3's checkpoints hold the parts fused already, in other layouts: one `qkv_proj` (q, k and v rows
stacked) and one `gate_up_proj` (the gate rows, then the up rows); they are reordered into coda's
layouts the same way and given back in Phi-3's (`Family.qkv_parts`, `gate_up_parts`: `qkv_fused`,
`qkv_unfused`, `gate_up_fused`, `gate_up_unfused`).
The moved modules stay reachable where Hugging Face had them (`layers[i].input_layernorm`,
`self_attn.q_norm`, `model.model.norm`) as plain attributes, not registered there: every parameter
is registered once, so that a wrapper of a decoder layer (FSDP2's `fully_shard`) holds exactly the
weights its forward reads. State-dict hooks make `state_dict()` give, and `load_state_dict()` take,
the unpatched names, layouts and order (`Layout`), also of a model FSDP2 has sharded (its fused
weights gathered, split and sharded again: `torch.distributed.checkpoint.save(model.state_dict())`
saves Hugging Face's names, and `load` then `load_state_dict` takes them back); `unfused_grads` gives
the gradients under those names.
What it does not: decide whether a model may be patched (checks.py) or run anything (forward.py).
Invariants: unfusing a fused weight gives back the original tensors exactly (a permutation of rows);
a checkpoint saved from a patched model loads into an unpatched one and back; no module is
registered under two names.
"""

from __future__ import annotations

import re
import sys
from typing import Any, cast

import torch

from coda_lang.hf.checks import base_of, is_lora, peft_inner
from coda_lang.hf.family import Family
from coda_lang.layout import deinterleave_rope, interleave_rope

# what torch's checkpoint_wrapper puts into the names under it (its state-dict hooks take it out)
WRAPPED = "_checkpoint_wrapped_module."


def qkv_fused(parts: list[torch.Tensor] | tuple[torch.Tensor, ...], m: Any) -> torch.Tensor:
    """The fused layout of a QKV weight, bias or gradient ([out, in], or [out]) from its checkpoint
    parts (q, k and v; or Phi-3's one `qkv_proj`, their rows stacked), `m` the `FusedQKV` (its
    head_dim, nq, nk): q and k rows in the interleaved RoPE layout."""
    w = parts[0] if len(parts) == 1 else torch.cat(list(parts), 0)
    return interleave_rope(w.t(), m.head_dim, m.nq + m.nk).t().contiguous()


def qkv_unfused(w: torch.Tensor, m: Any) -> list[torch.Tensor]:
    """The checkpoint parts of a fused QKV tensor `w` (`qkv_fused` undone): q, k and v, or one."""
    plain = deinterleave_rope(w.t(), m.head_dim, m.nq + m.nk).t()
    if len(m.parts) == 1:
        return [plain.contiguous()]
    nq, nk = m.nq, m.nk
    return [plain[:nq].contiguous(), plain[nq : nq + nk].contiguous(), plain[nq + nk :].contiguous()]


def gate_up_fused(parts: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The fused gate/up layout (rows interleaved: g0, u0, g1, u1, ...) from its checkpoint parts: gate
    and up, or Phi-3's one `gate_up_proj` (the gate rows, then the up rows)."""
    g, u = parts if len(parts) == 2 else parts[0].chunk(2, 0)
    return torch.stack([g, u], 1).flatten(0, 1).contiguous()


def gate_up_unfused(w: torch.Tensor, n: int) -> list[torch.Tensor]:
    """The `n` checkpoint parts of a fused gate/up tensor (`gate_up_fused` undone)."""
    g, u = w[0::2], w[1::2]
    return [g.contiguous(), u.contiguous()] if n == 2 else [torch.cat([g, u], 0)]


def whole(*ts: torch.Tensor) -> tuple[list[torch.Tensor], Any]:
    """The tensors whole, and how to shard a result as the first one is: None for plain tensors; for
    DTensors (a state dict of a model FSDP2 has sharded) each is gathered, a collective that every
    rank runs, as every rank makes the state dict."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None or not isinstance(ts[0], dtensor.DTensor):
        return list(ts), None
    with torch.no_grad():
        parts: list[Any] = list(ts)  # DTensors
        return [t.full_tensor() for t in parts], (parts[0].device_mesh, parts[0].placements)


def sharded(t: torch.Tensor, how: Any) -> torch.Tensor:
    """`t` sharded as `whole` found its inputs: each rank keeps its own part (no communication)."""
    if how is None:
        return t
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t, how[0], how[1], src_data_rank=None)


def bias_name(weight_key: str) -> str:
    """The bias's state-dict key beside a projection's weight key (`q_proj.weight` -> `q_proj.bias`,
    under peft `q_proj.base_layer.weight` -> `q_proj.base_layer.bias`)."""
    return weight_key[: -len("weight")] + "bias"


def qkv_save_hook(module: Any, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
    for kind in ("weight", "bias"):  # (the bias: Qwen2's)
        key = prefix + f"qkv_{kind}"
        if key not in state_dict:
            continue
        names = module.parts if kind == "weight" else tuple(bias_name(n) for n in module.parts)
        (w,), how = whole(state_dict.pop(key).detach())
        for name, part in zip(names, qkv_unfused(w, module), strict=True):
            state_dict[prefix + name] = sharded(part, how)


def part_names(m: Any, names: tuple[str, ...]) -> tuple[str, ...]:
    """The state-dict keys of the projections `names` of `m`: `<name>.weight`, or under a peft LoRA
    layer `<name>.base_layer.weight` (as the unpatched peft model names them)."""
    return tuple(f"{n}.base_layer.weight" if is_lora(getattr(m, n)) else f"{n}.weight" for n in names)


GATE_UP_PARTS = ("gate_proj.weight", "up_proj.weight")  # (a module patched without `_coda_parts`)


def qkv_load_hook(module: Any, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    for kind in ("weight", "bias"):
        names = module.parts if kind == "weight" else tuple(bias_name(n) for n in module.parts)
        keys = [prefix + n for n in names]
        if all(k in state_dict for k in keys):
            parts, how = whole(*(state_dict.pop(x) for x in keys))
            state_dict[prefix + f"qkv_{kind}"] = sharded(qkv_fused(parts, module), how)


def mlp_save_hook(module: Any, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
    key = prefix + "gate_up_weight"
    if key in state_dict:
        (w,), how = whole(state_dict.pop(key).detach())
        names = getattr(module, "_coda_parts", GATE_UP_PARTS)
        for name, part in zip(names, gate_up_unfused(w, len(names)), strict=True):
            state_dict[prefix + name] = sharded(part, how)


def mlp_load_hook(module: Any, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    keys = [prefix + n for n in getattr(module, "_coda_parts", GATE_UP_PARTS)]
    if all(k in state_dict for k in keys):
        parts, how = whole(*(state_dict.pop(k) for k in keys))
        state_dict[prefix + "gate_up_weight"] = sharded(gate_up_fused(parts), how)


class FusedQKV(torch.nn.Module):
    """One decoder layer's QKV projection as one parameter `qkv_weight` ([(H + 2 KV) * HD, D]: q, k and
    v rows, q and k in the interleaved RoPE layout) and, in Qwen3 and OLMo 2, the attention's
    `q_norm` and `k_norm` (moved here: the QKV block reads them). In a state dict it is its parts'
    weights under its prefix: `q_proj.weight`, `k_proj.weight`, `v_proj.weight` (and the norms), or
    Phi-3's one `qkv_proj.weight` (q, k and v rows stacked, `names` the attention's projections:
    `Family.qkv_parts`). `heads`: (H, KV), the query and key/value heads of `hd` columns. Never
    called: the patched forward reads its weights."""

    def __init__(self, attn: Any, hd: int, names: tuple[str, ...], heads: tuple[int, int]):
        super().__init__()
        self.names = names
        # the state-dict keys of the parts (a peft LoRA layer's base weight: `q_proj.base_layer.weight`)
        self.parts = part_names(attn, names)
        self.head_dim, self.nq, self.nk = hd, heads[0] * hd, heads[1] * hd
        ws = [base_of(getattr(attn, n)).weight for n in names]
        with torch.no_grad():
            qkv = qkv_fused(ws, self)
            grads = _grads(*ws)
            grad = qkv_fused(grads, self) if grads else None
        self.qkv_weight = torch.nn.Parameter(qkv, requires_grad=ws[0].requires_grad)
        self.qkv_weight.grad = grad
        if base_of(getattr(attn, names[0])).bias is not None:  # Qwen2: q, k and v biases, one vector
            self.qkv_bias = fused_bias(attn, self)
        for name in ("q_norm", "k_norm"):
            if isinstance(getattr(attn, name, None), torch.nn.Module):
                move(attn, name, self)
        # a projection with LoRA adapters: the LoRA layer stays where peft put it (its names are what
        # peft saves and loads adapters by), its base layer a FusedPart over qkv_weight's rows, and
        # this module reaches it (`loras`, not registered); the others are removed
        loras = []
        for i, name in enumerate(names):
            m = attn._modules[name]
            if is_lora(m):
                m.base_layer = FusedPart(
                    self, "qkv_weight", i, m.base_layer.out_features, m.base_layer.in_features
                )
                loras.append(m)
            else:
                del attn._modules[name]
                loras.append(None)
        object.__setattr__(self, "loras", tuple(loras))
        self._register_state_dict_hook(qkv_save_hook)
        self.register_load_state_dict_pre_hook(qkv_load_hook)

    def extra_repr(self) -> str:
        return f"qkv_weight: {tuple(self.qkv_weight.shape)}"


def fused_bias(attn: Any, fused: FusedQKV) -> torch.nn.Parameter:
    """The QKV projections' biases (and their gradients) as one parameter, in the order of the fused
    weight's rows; checks.py has refused biases whose requires_grad, dtype or device differ."""
    bs = [base_of(getattr(attn, n)).bias for n in fused.names]
    with torch.no_grad():
        b = torch.nn.Parameter(qkv_fused(bs, fused), requires_grad=bs[0].requires_grad)
        grads = _grads(*bs)
        b.grad = qkv_fused(grads, fused) if grads else None
    return b


class PartWeight:
    """A fused parameter's rows of one projection, as peft's merge and unmerge use a base weight:
    `.data` is a copy in Hugging Face's layout, and setting it writes the rows back into the fused
    parameter; `dtype`, `device` and `shape` are the projection's."""

    def __init__(self, part: FusedPart):
        self.part = part

    @property
    def data(self) -> torch.Tensor:
        return self.part.read()

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        self.part.write(value)

    @property
    def dtype(self) -> torch.dtype:
        return self.part.fused().dtype

    @property
    def device(self) -> torch.device:
        return self.part.fused().device

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.part.out_features, self.part.in_features))


class FusedPart(torch.nn.Module):
    """The base layer of a LoRA layer whose base weight is rows of a fused parameter: `owner`'s
    `name` (a FusedQKV's `qkv_weight`: `index` 0, 1, 2 for q, k, v, or 0 for Phi-3's whole
    `qkv_proj`; an MLP's `gate_up_weight`: 0, 1 for gate, up, or 0 for Phi-3's whole `gate_up_proj`).
    No parameters of its own; never called (the blocks read the fused weight)."""

    owner: Any

    def __init__(self, owner: torch.nn.Module, name: str, index: int, out_features: int, in_features: int):
        super().__init__()
        object.__setattr__(self, "owner", owner)  # (not a submodule: the owner holds this one)
        self.fused_name, self.index = name, index
        self.out_features, self.in_features = out_features, in_features

    def fused(self) -> torch.Tensor:
        return cast(torch.Tensor, self.owner._parameters[self.fused_name])

    def parts(self) -> list[torch.Tensor]:
        """The fused parameter's parts in the checkpoint's layout (copies)."""
        w = self.fused().detach()
        if self.fused_name == "qkv_weight":
            return qkv_unfused(w, self.owner)
        return gate_up_unfused(w, len(self.owner._coda_parts))

    def read(self) -> torch.Tensor:
        return self.parts()[self.index].clone()

    def write(self, value: torch.Tensor) -> None:
        w = self.fused()
        parts = self.parts()
        parts[self.index] = value.to(w.dtype)
        fuse = qkv_fused(parts, self.owner) if self.fused_name == "qkv_weight" else gate_up_fused(parts)
        with torch.no_grad():
            w.copy_(fuse)

    @property
    def weight(self) -> PartWeight:
        return PartWeight(self)

    def forward(self, *_: Any) -> Any:
        raise RuntimeError(
            "coda_lang.hf: a fused projection's base layer is read by the blocks, never called"
        )

    def extra_repr(self) -> str:
        return f"rows {self.index} of {self.fused_name}: ({self.out_features}, {self.in_features})"


class Moved(torch.nn.Module):
    """Modules whose weights a block reads, registered under the module whose forward runs that block:
    `coda_first` on the base model (layer 0's `input_layernorm` and `self_attn`, a `FusedQKV`),
    `coda_next` on each decoder layer (the next layer's, or on the last layer the final `norm`).
    Never called: the patched forward reads its weights."""

    def __init__(self, **modules: torch.nn.Module):
        super().__init__()
        for name, m in modules.items():
            self.add_module(name, m)


def move(src: torch.nn.Module, name: str, dst: torch.nn.Module, as_name: str | None = None) -> None:
    """Register `src`'s submodule `name` under `dst` instead (as `as_name`), leaving `src.<name>` a plain
    attribute that reaches it (not registered: its parameters are `dst`'s alone)."""
    m = src._modules.pop(name)
    dst.add_module(as_name or name, m)
    object.__setattr__(src, name, m)


# Hugging Face's names, relative to the base model, of what a layer's `Moved` container holds
_HF_INPUT = re.compile(
    r"layers\.(\d+)\.((?:input_layernorm|self_attn\.(?:[qkv]_proj|qkv_proj|q_norm|k_norm))\..*)"
)
_NEXT = re.compile(r"layers\.(\d+)\.coda_next\.(.*)")
_FIRST = "coda_first."


def brace(names: tuple[str, ...]) -> str:
    """Projections' names as one: `{q,k,v}_proj`, or a single one itself (`qkv_proj`)."""
    if len(names) == 1:
        return names[0]
    return "{" + ",".join(n.removesuffix("_proj") for n in names) + "}_proj"


class Layout:
    """Names relative to the base model, patched and Hugging Face's, for a model of `layers` decoder
    layers; `order`: the unpatched model's state-dict keys (relative), which `state_dict()` keeps;
    `qkv`, `gate_up`: the projections the fused weights hold (`Family.qkv_parts`, `gate_up_parts`)."""

    def __init__(self, layers: int, order: list[str], qkv: tuple[str, ...], gate_up: tuple[str, ...]):
        self.layers = layers
        self.rank = {k: i for i, k in enumerate(order)}
        self.qkv, self.gate_up = qkv, gate_up

    def to_hf(self, rel: str) -> str:
        """The Hugging Face name of the patched model's key `rel` (unfused keys: `qkv_weight` is split
        into q/k/v_proj.weight by FusedQKV's own hook first)."""
        if rel.startswith(_FIRST):
            return "layers.0." + rel[len(_FIRST) :]
        m = _NEXT.fullmatch(rel)
        if m is None:
            return rel
        i, rest = int(m[1]), m[2]
        return rest if i == self.layers - 1 else f"layers.{i + 1}.{rest}"

    def to_patched(self, rel: str) -> str:
        """The patched model's key of Hugging Face's key `rel` (the inverse of `to_hf`)."""
        m = _HF_INPUT.fullmatch(rel)
        if m is not None:
            j = int(m[1])
            return (_FIRST if j == 0 else f"layers.{j - 1}.coda_next.") + m[2]
        if rel.startswith("norm."):
            return f"layers.{self.layers - 1}.coda_next.{rel}"
        return rel

    def hf_name(self, name: str) -> str:
        """Hugging Face's name of a parameter named `name` in the patched causal LM (its base model
        `model.`), fused weights by both of their parts: for messages."""
        if name.startswith("model."):
            name = "model." + self.to_hf(name[len("model.") :])
        qkv, gate_up = brace(self.qkv), brace(self.gate_up)
        return (
            name.replace("qkv_weight", f"{qkv}.weight")
            .replace("qkv_bias", f"{qkv}.bias")
            .replace("gate_up_weight", f"{gate_up}.weight")
        )

    def save_hook(self, module: Any, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
        """The base model's state-dict hook (run after its children's): Hugging Face's names, in the
        unpatched model's order (keys it does not know stay after the key they followed)."""
        keys = [k for k in state_dict if k.startswith(prefix)]
        items = []
        last = -1
        for n, k in enumerate(keys):
            hf = self.to_hf(k[len(prefix) :])
            r = self.rank.get(hf)
            last = last if r is None else r
            items.append(((last, r is None, n), prefix + hf, state_dict.pop(k)))
        for _, k, v in sorted(items, key=lambda t: t[0]):
            state_dict[k] = v

    def load_hook(self, module: Any, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
        """The base model's load pre-hook (run before its children's): the patched model's names."""
        for k in [k for k in state_dict if k.startswith(prefix)]:
            new = prefix + self.to_patched(k[len(prefix) :])
            if new != k:
                state_dict[new] = state_dict.pop(k)


def _grads(*ws: torch.Tensor) -> list[torch.Tensor]:
    """The gradients of `ws` (zeros for those without), or [] when none has one."""
    if all(w.grad is None for w in ws):
        return []
    return [torch.zeros_like(w) if w.grad is None else w.grad for w in ws]


def fuse_and_move(model: Any, family: Family, hd: int, heads: tuple[int, int]) -> Layout:
    """Fuse every layer's weights (and the gradients they have) and move each to the module that reads
    it (see the module docstring); register the state-dict hooks; keep each touched module's order of
    children (`_coda_children`) for `unfuse_and_restore`. Returns the model's `Layout`. checks.py has
    refused parts to fuse whose requires_grad, dtype, device or hooks differ. The parts are the
    family's (`Family.qkv_parts`, `gate_up_parts`); `heads`: (H, KV), of `hd` columns each."""
    base = model.model
    layers = list(base.layers)
    order = list(base.state_dict(keep_vars=True).keys())  # references: no copy
    for m in (base, *layers, *(x for layer in layers for x in (layer.self_attn, layer.mlp))):
        m._coda_children = tuple(m._modules)
    qkvs = []
    names = family.gate_up_parts
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkvs.append(FusedQKV(attn, hd, family.qkv_parts, heads))
        ws = [base_of(getattr(mlp, n)).weight for n in names]
        mlp._coda_names = names
        mlp._coda_parts = part_names(mlp, names)
        with torch.no_grad():
            gu = gate_up_fused(ws)
            grads = _grads(*ws)
        mlp.gate_up_weight = torch.nn.Parameter(gu, requires_grad=ws[0].requires_grad)
        mlp.gate_up_weight.grad = gate_up_fused(grads) if grads else None
        for i, name in enumerate(names):  # LoRA layers stay, over gate_up_weight's rows
            m = mlp._modules[name]
            if is_lora(m):
                m.base_layer = FusedPart(
                    mlp, "gate_up_weight", i, m.base_layer.out_features, m.base_layer.in_features
                )
            else:
                del mlp._modules[name]
        mlp._register_state_dict_hook(mlp_save_hook)
        mlp.register_load_state_dict_pre_hook(mlp_load_hook)
    for i, layer in enumerate(layers):
        owner, name = (base, "coda_first") if i == 0 else (layers[i - 1], "coda_next")
        owner.add_module(name, Moved())
        if "input_layernorm" in layer._modules:  # (a family with pre-norms: OLMo 2 has none)
            move(layer, "input_layernorm", getattr(owner, name))
        getattr(owner, name).add_module("self_attn", qkvs[i])
    layers[-1].add_module("coda_next", Moved())
    move(base, "norm", layers[-1].coda_next)
    layout = Layout(len(layers), order, family.qkv_parts, family.gate_up_parts)
    base._register_state_dict_hook(layout.save_hook)
    base.register_load_state_dict_pre_hook(layout.load_hook)
    return layout


def moved_parts(model: Any) -> list[tuple[Any, Any, Any]]:
    """(decoder layer, its FusedQKV, its input norm or None in a family without one) of each layer of
    a patched model, where `fuse_and_move` registered them (a layer in a checkpoint wrapper
    unwrapped); ValueError naming what is gone since patching."""
    base = model.model
    without_norm = not model._coda.family.pre_norm  # (OLMo 2's layers have no input norm)
    layers = [getattr(x, "_checkpoint_wrapped_module", x) for x in base.layers]
    owners = [(base, "model.coda_first")] + [
        (layer, f"model.layers.{i}.coda_next") for i, layer in enumerate(layers[:-1])
    ]
    out = []
    for i, (layer, (owner, where)) in enumerate(zip(layers, owners, strict=True)):
        moved = owner._modules.get(where.rpartition(".")[2])
        fused = None if moved is None else moved._modules.get("self_attn")
        norm = None if moved is None else moved._modules.get("input_layernorm")
        mlp = layer._modules.get("mlp")
        for what, ok in (
            (f"{where}.self_attn.qkv_weight", fused is not None and "qkv_weight" in fused._parameters),
            (f"{where}.input_layernorm", norm is not None or without_norm),
            (f"model.layers.{i}.mlp.gate_up_weight", mlp is not None and "gate_up_weight" in mlp._parameters),
        ):
            if not ok:
                raise ValueError(f"coda_lang.hf: {what}: gone since patching; this model can't be unpatched")
        out.append((layer, fused, norm))
    last = layers[-1]._modules.get("coda_next")
    if last is None or "norm" not in last._modules:
        raise ValueError(
            f"coda_lang.hf: model.layers.{len(layers) - 1}.coda_next.norm: gone since patching; this model "
            "can't be unpatched"
        )
    return out


def unfuse_and_restore(model: Any, layout: Layout) -> None:
    """`fuse_and_move` undone on a patched model: q/k/v and gate/up as `nn.Linear`s again, their weights
    (and gradients, and requires_grad) the fused ones' rows exactly; every moved module registered
    where Hugging Face has it, each module's children in their order; the `Moved` containers and the
    state-dict hooks removed. `moved_parts` has checked that everything is there."""
    base = model.model
    parts = moved_parts(model)
    final = parts[-1][0].coda_next.norm
    for layer, fused, norm in parts:
        attn, mlp = layer.self_attn, layer.mlp
        w = fused.qkv_weight
        split = qkv_unfused(w.detach(), fused)
        grads = qkv_unfused(w.grad, fused) if w.grad is not None else [None] * len(split)
        for n, t, g in zip(fused.names, split, grads, strict=True):
            lin = _linear(t, g, w.requires_grad)
            lora = attn._modules.get(n)
            if lora is not None and is_lora(lora):  # over a Linear of its own again
                lora.base_layer = lin
            else:
                attn._modules[n] = lin
        b = fused._parameters.get("qkv_bias")
        if b is not None:
            bgrads = qkv_unfused(b.grad, fused) if b.grad is not None else [None] * len(split)
            for n, t, g in zip(fused.names, qkv_unfused(b.detach(), fused), bgrads, strict=True):
                lin = attn._modules[n]
                if is_lora(lin):
                    lin = lin.base_layer
                lin.bias = torch.nn.Parameter(t.contiguous(), requires_grad=b.requires_grad)
                lin.bias.grad = None if g is None else g.contiguous()
        for n in ("q_norm", "k_norm"):
            if n in fused._modules:
                attn.__dict__.pop(n, None)
                attn._modules[n] = fused._modules[n]
        gu = mlp.gate_up_weight
        names = mlp._coda_names
        split = gate_up_unfused(gu.detach(), len(names))
        grads = gate_up_unfused(gu.grad, len(names)) if gu.grad is not None else [None] * len(names)
        for n, t, g in zip(names, split, grads, strict=True):
            lin = _linear(t, g, gu.requires_grad)
            lora = mlp._modules.get(n)
            if lora is not None and is_lora(lora):
                lora.base_layer = lin
            else:
                mlp._modules[n] = lin
        del mlp.gate_up_weight
        mlp.__dict__.pop("_coda_parts", None)
        mlp.__dict__.pop("_coda_names", None)
        _drop_hooks(mlp, mlp_save_hook, mlp_load_hook)
        if norm is not None:
            layer.__dict__.pop("input_layernorm", None)
            layer._modules["input_layernorm"] = norm
    for layer, _, _ in parts:
        layer._modules.pop("coda_next", None)
        for m in (layer, layer.self_attn, layer.mlp):
            _reorder(m)
    base.__dict__.pop("norm", None)
    base._modules["norm"] = final
    base._modules.pop("coda_first", None)
    _reorder(base)
    _drop_hooks(base, layout.save_hook, layout.load_hook)


def _linear(w: torch.Tensor, grad: torch.Tensor | None, requires_grad: bool) -> torch.nn.Linear:
    lin = torch.nn.utils.skip_init(
        torch.nn.Linear, w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype
    )
    lin.weight = torch.nn.Parameter(w.contiguous(), requires_grad=requires_grad)
    lin.weight.grad = None if grad is None else grad.contiguous()
    return lin


def _reorder(m: Any) -> None:
    """`m`'s children in the order recorded at patching (`_coda_children`), any new ones after."""
    order = m.__dict__.pop("_coda_children", ())
    children = {**{n: m._modules[n] for n in order if n in m._modules}, **m._modules}
    m._modules.clear()
    m._modules.update(children)


def _drop_hooks(m: Any, save: Any, load: Any) -> None:
    for key, hook in list(m._state_dict_hooks.items()):
        if hook == save:
            del m._state_dict_hooks[key]
    for key, hook in list(m._load_state_dict_pre_hooks.items()):
        if getattr(hook, "hook", hook) == load:
            del m._load_state_dict_pre_hooks[key]


def unfused_grads(model: Any) -> dict[str, torch.Tensor]:
    """The gradients of a patched model's parameters under the unpatched model's names and layouts (as
    its `state_dict()` names them): to compare with an unpatched model, or to log per-projection norms.
    Under `checkpoint_wrapper` the names are the unwrapped ones; a sharded gradient (a DTensor, under
    FSDP2) is gathered whole, a collective: call it on every rank."""
    layout: Layout = model._coda.layout
    inner = peft_inner(model)  # (a peft model's names have its prefix)
    base = next(n for n, m in model.named_modules() if m is inner.model)
    prefix = base + "." if base else ""
    dt = sys.modules.get("torch.distributed.tensor")
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        if dt is not None and isinstance(g, dt.DTensor):
            g = g.full_tensor()
        name = name.replace(WRAPPED, "")
        owner, _, leaf = name.rpartition(".")
        sd = {leaf: g}
        if leaf in ("qkv_weight", "qkv_bias"):
            qkv_save_hook(_unwrapped(model, owner), sd, "", None)
        elif leaf == "gate_up_weight":
            mlp_save_hook(_unwrapped(model, owner), sd, "", None)
        for k, v in sd.items():
            full = f"{owner}.{k}" if owner else k
            if full.startswith(prefix):
                full = prefix + layout.to_hf(full[len(prefix) :])
            out[full] = v
    return out


def _unwrapped(model: Any, name: str) -> Any:
    """The submodule of `model` named `name` as the unwrapped names give it."""
    m = model
    for part in name.split("."):
        m = getattr(m, part)
        m = getattr(m, "_checkpoint_wrapped_module", m)
    return m
