"""What the patched forward relies on, recorded at patching and checked at every forward: a patched
model never ignores what the user changed since.

What it does: `Contract(model, family, forwards)` records, after patching, each module whose work
the blocks do without calling it (the base model, the LM head, the rotary embedding, the final norm,
per layer the attention, its out-projection (and its q/k norms: Qwen3, OLMo 2), the MLP, its
down-projection and activation, the family's norms; and the containers patching moved weights into): its identity in the
module that registers it, its class, its number of children, its instance `forward` and its hooks;
the Hugging Face places of the moved modules (plain attributes); the layer list's and the decoder
layers' identities and their patched forwards (a decoder layer is called: its hooks run, a
checkpoint wrapper around it is let be); each norm's epsilon and the rotary embedding's settings; the
config fields the blocks were built from; the weights the blocks read (for their dtype).
`check_call(model, ...)`, at the start of each patched forward, compares them all and raises
`refuse(...)` (checks.py) naming the module, parameter or field and what to do: a hook (on such a
module, or global), a module replaced or re-classed (a peft LoRA layer, a parametrization), a forward
replaced on the instance, a changed config field or epsilon, weights of mixed dtypes; it also refuses
`output_attentions`, labels whose count is not the input's tokens and `ignore_index` other than
-100. Weights converted to a new dtype all alike have the widths checked for it (the blocks of that
dtype are made at its first run: state.py). `returned` gives the output as transformers does for
`return_dict` (a tuple when False, from the argument or `config.return_dict`).
What it does not: check what patching itself refuses (checks.py), run anything, or check what flows
between the decoder layers (forward.py refuses inputs or outputs a hook changed).
Invariants: the check costs no measurable step time. It compares columns recorded at patching in
C-level scans (`any(map(...))`: no Python loop per module, no tensor made). Measured with
time.perf_counter on this project's shared 2-core CPU (best of 7 x 200 calls): 100 us on a 16-layer
Llama's module tree, 25 us on the 2-layer test model, whose no-grad forward takes 20 ms there
(tests/test_hf_contract.py, `test_the_check_costs_no_measurable_time`, bounds it to 2%); a
Llama-3.2-1B training step takes 150 ms on an H100: under 0.1%. FSDP2's own hooks and classes on a
bypassed module and its sharded (DTensor) weights are let be: the block that reads such a weight
raises E0811 naming it.
A copy or unpickling of the model copies the record with the modules it names (one memo), so a copy
checks its own modules.
"""

from __future__ import annotations

import copy
import sys
from itertools import repeat
from operator import attrgetter, is_not, ne
from typing import Any

import torch
from torch.nn.modules import module as torch_module

from coda_lang.hf.blocks import DTYPES
from coda_lang.hf.checkpoint import FusedQKV
from coda_lang.hf.checks import (
    UNPATCH,
    base_of,
    bypassed_modules,
    check_widths,
    class_name,
    family_classes,
    foreign,
    global_hooks,
    global_refusal,
    is_lora,
    module_trouble,
    refuse,
)
from coda_lang.hf.family import Family
from coda_lang.hf.masks import layer_kinds

MISSING = "<missing>"  # a sentinel that a copy or pickle keeps equal (an object() would not be)

# config fields the blocks are built from or that the unpatched forward reads (num_hidden_layers:
# transformers runs layers[:num_hidden_layers]); each is compared at every forward
CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "rope_parameters",
    "rope_scaling",
    "attention_bias",
    "mlp_bias",
    "tie_word_embeddings",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "layer_types",
    "loss_type",
    "embedding_multiplier",  # (Granite's)
    "residual_multiplier",
    "logits_scaling",
    "attention_multiplier",
    "hidden_activation",  # (Gemma's)
    "final_logit_softcapping",
    "attn_logit_softcapping",
    "query_pre_attn_scalar",
    "use_bidirectional_attention",
)

CHANGED = f"coda_lang.hf.unpatch(model), make the change, and patch it again ({UNPATCH})"


class Contract:
    """The record of one patched model (see the module's docstring). `modules`: (path, module,
    parent, name in the parent, class, children, instance forward) of each bypassed module, the base
    model first and the LM head second (a call of the base model alone skips both: its own hooks run,
    the head is not used), then those of the layers (a moved one under the module that registers it
    now: `coda_first`, `coda_next`, a `FusedQKV`), then those containers; `present`: (path, module,
    parent, name) of modules only their identity matters of (the layer list, each decoder layer: its
    forward runs, so its hooks do too; a checkpoint wrapper around it is let be); `aliases`: (path,
    object, attribute, module) of the moved modules' Hugging Face places (`layers[i].input_layernorm`,
    `model.model.norm`, Qwen3's and OLMo 2's `self_attn.q_norm`), plain attributes that must still reach them;
    `attrs`: (path, object, attribute, value) read from the object's `__dict__` (each norm's epsilon,
    the rotary embedding's settings, each decoder layer's patched forward, no loss function of the
    model's own); `config`: (field, value) of the config's `__dict__`; `weights`: (path, module,
    parameter name) of the weights the blocks read; `forwards`: the causal LM's and the base model's
    installed forwards.

    `check` reads them as columns (`_columns`: a tuple per field), each compared in one C-level
    `any(map(...))` over all the rows: no Python loop per module, no tensor made; only when one
    fails does the slow path find the row and explain it."""

    def __init__(self, model: Any, family: Family, forwards: tuple[Any, Any]):
        base = model.model
        self.forwards = forwards
        parents = {id(m): (p, n) for p in model.modules() for n, m in p._modules.items() if m is not None}
        layers = list(base.layers)
        containers: list[tuple[str, Any]] = [("model.coda_first", base.coda_first)]
        containers += [(f"model.layers.{i}.coda_next", layer.coda_next) for i, layer in enumerate(layers)]
        containers += [(f"{p}.self_attn", m.self_attn) for p, m in containers if "self_attn" in m._modules]
        rows = [(path, m, type(m)) for path, m, _cls in bypassed_modules(model, family)]
        # a LoRA layer's parts (its base layer, its adapters' A, B and dropout, and their dicts: an
        # adapter added since patching changes their children)
        rows += [
            (sub_path, sub, type(sub))
            for path, m, _ in list(rows)
            if is_lora(m)
            for sub_path, sub in m.named_modules(prefix=path)
            if sub is not m
        ]
        rows += [(path, m, type(m)) for path, m in containers]
        self.modules: list[tuple[str, Any, Any, str, type, int, Any]] = []
        for path, m, cls in rows:
            parent, name = parents[id(m)]
            fwd = forwards[1] if m is base else None
            self.modules.append((path, m, parent, name, cls, len(m._modules), fwd))
        self.present = [("model.layers", base.layers, base, "layers")] + [
            (f"model.layers.{i}", layer, base.layers, str(i)) for i, layer in enumerate(layers)
        ]
        # what each place in `present` holds now: the module, or a wrapper of it let be (`wrapped`)
        self._held = [m for _, m, _, _ in self.present]
        self.aliases: list[tuple[str, Any, str, Any]] = [("model.norm", base, "norm", base.norm)]
        for i, layer in enumerate(layers):
            if "input_layernorm" in layer.__dict__:  # (moved; OLMo 2's layers have none)
                self.aliases.append(
                    (f"model.layers.{i}.input_layernorm", layer, "input_layernorm", layer.input_layernorm)
                )
            attn = layer.self_attn
            self.aliases += [
                (f"model.layers.{i}.self_attn.{n}", attn, n, attn.__dict__[n])
                for n in ("q_norm", "k_norm", *family.qkv_parts)
                if n in attn.__dict__
            ]
        eps = family.eps_attr  # (Gemma's norms: `eps`)
        norm = family_classes(model, family)["RMSNorm"]
        self.attrs: list[tuple[str, Any, str, Any]] = [
            (path, m, eps, m.__dict__[eps])
            for path, m, *_ in self.modules
            if isinstance(m, norm) and eps in m.__dict__
        ]
        rope = base.rotary_emb
        scalings = ["attention_scaling"]
        if family.rope_kinds:  # (Gemma 3: a rope type and scaling per kind of layer)
            scalings = [f"{k}_attention_scaling" for k in dict.fromkeys(layer_kinds(family, model.config))]
        self.attrs += [
            ("model.rotary_emb", rope, k, copy.deepcopy(rope.__dict__.get(k)))
            for k in ("rope_type", *scalings)
        ]
        self.attrs += [
            (f"model.layers.{i}", layer, "forward", layer.__dict__["forward"])
            for i, layer in enumerate(layers)
        ]
        self.attrs.append(("model", model, "_loss_function", MISSING))
        self.attrs.append(("model", model, "loss_type", model.__dict__.get("loss_type", MISSING)))
        cfg = vars(model.config)
        # fields kept in the config's __dict__, or absent (to stay absent); read from it at each forward
        # (a PretrainedConfig's getattr costs a microsecond)
        self.config = [(k, copy.deepcopy(cfg.get(k, MISSING))) for k in CONFIG_FIELDS]
        self.weights: list[tuple[str, Any, str]] = [("lm_head.weight", model.lm_head, "weight")]
        self.weights += [
            (f"{p}.qkv_weight", m, "qkv_weight") for p, m in containers if isinstance(m, FusedQKV)
        ]
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            p = f"model.layers.{i}"
            self.weights += [
                (f"{p}.self_attn.o_proj.weight", base_of(attn.o_proj), "weight"),
                (f"{p}.mlp.gate_up_weight", mlp, "gate_up_weight"),
                (f"{p}.mlp.down_proj.weight", base_of(mlp.down_proj), "weight"),
            ]
        # the dtypes whose widths were checked (check_widths): the one at patching, and any the
        # model's weights were converted to since
        self.dtypes = {model.dtype}
        self._columns()

    def _columns(self) -> None:
        """The records as columns, which `check` scans: made at patching (a copy of the model copies
        them with the rows and the modules, one memo)."""

        def cols(rows: list[Any], *idx: int) -> tuple[tuple[Any, ...], ...]:
            return tuple(tuple(r[i] for r in rows) for i in idx)

        self._all = cols(self.modules, 1, 2, 3, 4, 5, 6)
        self._below_base = cols(self.modules[2:], 1, 2, 3, 4, 5, 6)
        self._present = (tuple(self._held), *cols(self.present, 2, 3))
        self._aliases = cols(self.aliases, 1, 2, 3)
        self._attrs = cols(self.attrs, 1, 2, 3)
        self._config = cols(self.config, 0, 1)
        self._weights = cols(self.weights, 1, 2)

    def check(self, model: Any, base_call: bool) -> None:
        """Raise `refuse(...)` for the first thing changed since patching."""
        g = torch_module
        if (
            g._global_forward_hooks
            or g._global_forward_pre_hooks
            or g._global_backward_hooks
            or g._global_backward_pre_hooks
        ):
            raise global_refusal(global_hooks())
        objs, keys, mods = self._aliases
        if any(map(is_not, map(dict.get, map(_DICT, objs), keys), mods)):
            for path, obj, key, m in self.aliases:
                now = obj.__dict__.get(key, obj._modules.get(key))
                if now is not m:
                    raise replaced(path, now, type(m))
        mods, parents, names, classes, children, fwds = self._below_base if base_call else self._all
        if (
            any(map(is_not, map(dict.get, map(_MODULES, parents), names), mods))
            or any(map(is_not, map(type, mods), classes))
            or any(map(ne, map(len, map(_MODULES, mods)), children))
            or any(map(is_not, map(dict.get, map(_DICT, mods), repeat("forward")), fwds))
            or any(map(_FORWARD_HOOKS, mods))
            or any(map(_FORWARD_PRE_HOOKS, mods))
            or any(map(_BACKWARD_HOOKS, mods))
            or any(map(_BACKWARD_PRE_HOOKS, mods))
        ):
            self.explain(self.modules[2:] if base_call else self.modules)
        held, parents, names = self._present
        if any(map(is_not, map(dict.get, map(_MODULES, parents), names), held)):
            self.wrapped()
        objs, keys, values = self._attrs
        if any(map(ne, map(dict.get, map(_DICT, objs), keys, repeat(MISSING)), values)):
            for path, obj, key, value in self.attrs:
                if obj.__dict__.get(key, MISSING) != value:
                    raise attr_changed(path, key, obj.__dict__.get(key, MISSING), value)
        cfg = vars(model.config)
        keys, values = self._config
        if any(map(ne, map(cfg.get, keys, repeat(MISSING)), values)):
            for key, value in self.config:
                now = cfg.get(key, MISSING)
                if now != value:
                    raise refuse(
                        f"config.{key} = {None if now == MISSING else now!r}",
                        f"it was {None if value == MISSING else value!r} when the model was patched, and "
                        "the blocks were built from it",
                        CHANGED,
                    )
        mods, names = self._weights
        try:
            dtypes = set(map(_DTYPE, map(dict.get, map(_PARAMETERS, mods), names)))
        except AttributeError:  # a weight removed: its None has no dtype
            dtypes = set()
        if len(dtypes) != 1 or not dtypes <= self.dtypes:
            self.weights_changed(model)

    def wrapped(self) -> None:
        """A place of `present` holds another module than the last check saw: a decoder layer in a
        wrapper that contains it (torch's checkpoint_wrapper) is let be, and remembered; anything else
        is refused, naming the place."""
        for k, (path, m, parent, name) in enumerate(self.present):
            now = parent._modules.get(name)
            if now is self._held[k]:
                continue
            if k > 0 and now is not None and now is not m and any(x is m for x in now.modules()):
                self._held[k] = now
                continue
            raise replaced(path, now, type(m))
        self._present = (tuple(self._held), *self._present[1:])

    def explain(self, rows: list[tuple[str, Any, Any, str, type, int, Any]]) -> None:
        """Raise the refusal for the first module record of `rows` that fails; nothing when the only
        hooks found are transformers' inert output-capturing ones, or FSDP2's own (fully_shard on a
        module the blocks bypass: its parameters are never gathered, and the block that reads them
        raises E0811 naming them)."""
        for path, m, parent, name, cls, _, _ in rows:  # a module replaced or removed names itself
            now = parent._modules.get(name)
            if now is not m:
                raise replaced(path, now, cls)
        for row in rows:
            path, mod, cls, n, fwd = row[0], row[1], row[4], row[5], row[6]
            children = ", ".join(mod._modules) or "none"
            if len(mod._modules) != n and type(mod) is cls:
                raise refuse(
                    path,
                    f"its submodules changed after patching (now {children}); the "
                    "fused blocks read the weights of the modules patched",
                    CHANGED,
                )
            why = module_trouble(mod, cls, fwd)
            if why is not None:
                raise refuse(path, why)

    def weights_changed(self, model: Any) -> None:
        """A weight the blocks read is gone, or the weights' dtypes are not one the widths were checked
        for: refused when one is gone or they disagree (sharded ones aside: under FSDP2 a DTensor is
        stored in its own dtype and gathered in the MixedPrecisionPolicy's), else the widths checked
        for the new dtype (`check_widths`) and it remembered. The blocks of a new dtype are made at its
        first run (state.py)."""
        dtensor = sys.modules.get("torch.distributed.tensor")
        seen: dict[torch.dtype, str] = {}
        for path, m, name in self.weights:
            p = m._parameters.get(name)
            if p is None:
                raise refuse(path, "removed after patching: the fused blocks read it", CHANGED)
            if dtensor is None or not isinstance(p, dtensor.DTensor):
                seen.setdefault(p.dtype, path)
        if len(seen) > 1:
            (d0, p0), (d1, p1) = list(seen.items())[:2]
            raise refuse(
                f"{p1} is {str(d1).removeprefix('torch.')}",
                f"{p0} is {str(d0).removeprefix('torch.')}: the fused blocks run one dtype for the whole model",
                "convert the whole model (model.to(dtype))",
            )
        for new in seen:
            if new not in self.dtypes:
                if str(new).removeprefix("torch.") not in DTYPES:
                    raise refuse(f"dtype {new}", "coda blocks run in bfloat16, float16 or float32")
                check_widths(model, new)
                self.dtypes.add(new)


_DICT = attrgetter("__dict__")
_MODULES = attrgetter("_modules")
_PARAMETERS = attrgetter("_parameters")
_DTYPE = attrgetter("dtype")
_FORWARD_HOOKS = attrgetter("_forward_hooks")
_FORWARD_PRE_HOOKS = attrgetter("_forward_pre_hooks")
_BACKWARD_HOOKS = attrgetter("_backward_hooks")
_BACKWARD_PRE_HOOKS = attrgetter("_backward_pre_hooks")


def replaced(path: str, now: Any, cls: type) -> ValueError:
    """The refusal for a module replaced (or removed) since patching."""
    if now is None:
        return refuse(path, "removed after patching: the fused blocks stand in for it", CHANGED)
    what = foreign(now)
    if what is not None:
        return refuse(path, f"replaced after patching by {what[0]}", what[1])
    return refuse(
        path,
        f"replaced after patching by a {class_name(now)} (it was a {class_name(cls)}): the fused blocks "
        "read the weights of the module patched and never call a module's forward, so the new one "
        "would be ignored",
        CHANGED,
    )


def attr_changed(path: str, key: str, now: Any, value: Any) -> ValueError:
    if key == "_loss_function":
        return refuse(
            "model.loss_function",
            "set after patching: the fused LM head computes transformers' causal-LM cross-entropy",
            "train with a loss of your own unpatched",
        )
    return refuse(
        f"{path}.{key} = {None if now == MISSING else now!r}",
        f"it was {value!r} when the model was patched, and the blocks were built with it",
        CHANGED,
    )


def check_call(
    model: Any,
    input_ids: Any,
    inputs_embeds: Any,
    labels: Any,
    kwargs: dict[str, Any],
    cache: bool = False,
    base: bool = False,
) -> None:
    """At the start of each patched forward (`base`: the base model called alone): what changed since
    patching (`Contract.check`; a new dtype of every weight rebuilds the blocks), and the arguments
    the patched forward can't honour (`cache`: use_cache or past_key_values given)."""
    model._coda.contract.check(model, base)
    if cache:
        raise refuse(
            "use_cache / past_key_values",
            "a coda-patched model runs training forwards (no KV cache)",
            "coda_lang.hf.unpatch(model) gives the transformers model back for generation",
        )
    cfg = model.config
    if kwargs.get("output_attentions", getattr(cfg, "output_attentions", False)):
        raise refuse(
            "output_attentions=True",
            "the patched forward calls the model's attention function on the fused QKV tile and keeps "
            "no attention weights (sdpa and flash attention never make them)",
            f"run the model unpatched to look at attention weights ({UNPATCH})",
        )
    if kwargs.get("ignore_index", -100) != -100:
        raise refuse(
            f"ignore_index={kwargs['ignore_index']}", "the fused loss ignores the label -100", "use -100"
        )
    if labels is None and kwargs.get("shift_labels") is None:
        return
    tokens = input_ids if input_ids is not None else inputs_embeds
    if tokens is None:
        return
    n = tokens.numel() if input_ids is not None else tokens[..., 0].numel()
    for what, t in (("labels", labels), ("shift_labels", kwargs.get("shift_labels"))):
        if t is not None and t.numel() != n:
            raise refuse(
                f"{what} of shape {tuple(t.shape)}",
                f"{t.numel()} labels for the {n} tokens of the input (of shape {tuple(tokens.shape)}); "
                "transformers' loss raises too (\"Expected input batch_size ... to match target "
                'batch_size ...")',
                f"give {what} of the input's shape",
            )


def returned(model: Any, out: Any, return_dict: bool | None) -> Any:
    """`out` as transformers returns it: a tuple (its fields that are not None) when `return_dict` is
    False, or when it is None and `config.return_dict` is False."""
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    return out if return_dict else out.to_tuple()
