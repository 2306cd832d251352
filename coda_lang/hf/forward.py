"""The patched model's forward: the layers as coda blocks, attention the model's own, each decoder
layer called as a module.

What it does: `causal_lm_forward` (bound as the causal LM's `forward`) and `base_forward` (the base
model's) run the embedding and the first layer's norm + QKV + RoPE block (`hidden`), then call each
decoder layer, whose `layer_forward` (bound to each layer) runs its attention (the model's attention
function on the fused QKV tile, `Heads`: q, k, v as views, their gradients joined in one pass) and its
block: the layer-boundary block to the next layer's residual and QKV tile, or on the last layer the
last block; then the causal LM's forward runs the loss (loss.py) or the logits. Each block reads only
the weights of the module that runs it (checkpoint.py moves them there), and layers are called as
modules, so hooks and wrappers on decoder layers fire: FSDP2's gathers and reduce-scatters per layer,
activation checkpointing (`gradient_checkpointing_enable()`, whose flag Hugging Face's layer
`__call__` reads; `checkpoint_wrapper`). A block input without memory (E0811: a parameter FSDP2 has
resharded) is raised naming the parameter (`run_block`). `output_hidden_states=True` returns Hugging
Face's hidden states (the embedding output, each layer's output, the final normed one last). The
attention function is given what the family's attention module gives it (its mask, window, scaling,
dropout; Gemma 2's soft-capping), eager being that module's own modeling file's; each layer's QKV
gets its kind's RoPE table (Gemma 3); Gemma's embedding scales its rows itself (the tied one-pass
lookup multiplies by its `embed_scale`).
What it does not: build the blocks (state.py), hold parameters (checkpoint.py) or check the model
(checks.py).
Invariants: HF's calling contract (input_ids or inputs_embeds, attention_mask, position_ids, labels,
shift_labels, num_items_in_batch, logits_to_keep, output_hidden_states); the blocks run at the
dtype of the embeddings and weights (under FSDP2's MixedPrecisionPolicy, its param_dtype), made at its
first forward if it is not the dtype at patching; a KV cache, embeddings of another dtype than the
weights, a list of hidden-state layers, or (Phi-3) a residual dropout of p > 0 in training mode is
refused (ValueError); nothing extra is made unless
hidden states are asked for.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch

from coda_lang.backend_cute.runtime.binding import unallocated
from coda_lang.backend_cute.runtime.grad_scales import DelayedScaling
from coda_lang.core.diagnostics import CodaError, error
from coda_lang.hf import fp8, lora
from coda_lang.hf.blocks import DTYPES
from coda_lang.hf.checkpoint import WRAPPED
from coda_lang.hf.checks import base_of, refuse
from coda_lang.hf.contract import check_call, returned
from coda_lang.hf.family import layer_norms
from coda_lang.hf.loss import IGNORE, ChunkedLoss, Embed, TiedGrad, rows_per_chunk, targets, tied_embedding
from coda_lang.hf.masks import layer_masks, window
from coda_lang.hf.split import LORA_C
from coda_lang.hf.state import Blocks, ModelState
from coda_lang.hf.units import gathered
from coda_lang.layout import interleave_rope
from coda_lang.torch import BlockFunction


def qk_norm_weights(st: ModelState, fused: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """Qwen3: the q and k norm weights (of a `FusedQKV`), one head's each in the interleaved RoPE layout (the block repeats
    them for every head and folds their gradients back), and the masks of the fused QKV's q and k
    columns (constants)."""
    gq = interleave_rope(fused.q_norm.weight.float(), st.HD)
    gk = interleave_rope(fused.k_norm.weight.float(), st.HD)
    nq, nk = st.H * st.HD, st.KV * st.HD
    col = torch.arange(st.rope_width + nk, device=device)
    mq = (col < nq).float()
    mk = ((col >= nq) & (col < nq + nk)).float()
    return {"gq": gq, "gk": gk, "mq": mq, "mk": mk}


def qk_proj_norm_weights(st: ModelState, fused: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """OLMo 2: the q and k norm weights (of a `FusedQKV`; each over its projection's whole width) as
    one vector over the fused QKV tile's columns, in its order (q and k heads interleaved for RoPE; 1
    on v, whose gradient goes nowhere), and the masks of the q and k columns (constants)."""
    nq, nk = st.H * st.HD, st.KV * st.HD
    w = (fused.q_norm.weight.float(), fused.k_norm.weight.float())
    g = interleave_rope(torch.cat([*w, w[1].new_ones(nk)]), st.HD, nq + nk)
    col = torch.arange(nq + 2 * nk, device=device)
    return {"gqk": g, "mq": (col < nq).float(), "mk": ((col >= nq) & (col < nq + nk)).float()}


def qkv_inputs(st: ModelState, fused: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """The QKV blocks' inputs beyond the LLaMA layer's, from a `FusedQKV`: Qwen3's or OLMo 2's q/k
    norm weights and masks, Qwen2's bias."""
    norms = {"head": qk_norm_weights, "proj": qk_proj_norm_weights}
    out = norms[st.qk_norm](st, fused, device) if st.qk_norm else {}
    if st.family.qkv_bias:
        out["b_qkv"] = fused.qkv_bias
    return out


class Heads(torch.autograd.Function):
    """q, k and v as [batch, heads, seq, head_dim] views of the fused [tokens, (H + 2 KV) * HD] QKV
    tile; the backward writes dq, dk and dv into one gradient of that tile, each copied once from
    whatever layout the attention's backward gives (autograd's split would make each contiguous
    in the token-major layout first, then concatenate: two passes)."""

    @staticmethod
    def forward(
        ctx: Any, qkv: torch.Tensor, b: int, s: int, h: int, kv: int, hd: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.shape = (b, s, h, kv, hd)
        x = qkv.view(b, s, h + 2 * kv, hd)
        q, k, v = x.split([h, kv, kv], dim=2)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    @staticmethod
    def backward(ctx: Any, dq: Any, dk: Any, dv: Any) -> tuple[Any, ...]:
        b, s, h, kv, hd = ctx.shape
        like = next(g for g in (dq, dk, dv) if g is not None)
        out = torch.empty((b * s, (h + 2 * kv) * hd), dtype=like.dtype, device=like.device)
        join_heads(out, (dq, dk, dv), b, s, h, kv, hd)
        return out, None, None, None, None, None


def join_heads(
    out: torch.Tensor, grads: tuple[Any, Any, Any], b: int, s: int, h: int, kv: int, hd: int
) -> None:
    """dq, dk, dv ([b, heads, s, hd], or None: zeros) into their columns of the [b * s, (h + 2 kv) * hd]
    tile `out`: on a GPU one Triton kernel per part (backend_triton/layouts.py), else torch's copies."""
    parts = [(g, n, col) for g, n, col in zip(grads, (h, kv, kv), (0, h * hd, (h + kv) * hd), strict=True)]
    if out.device.type == "cuda":
        # lazy: imports Triton, which only a GPU run needs
        from coda_lang.backend_triton import layouts

        if layouts.supported(out, hd) and all(g is None or g.dtype == out.dtype for g, _, _ in parts):
            layouts.join_heads(out, parts, b, s, hd)
            return
    cols = out.view(b, s, h + 2 * kv, hd)
    for g, n, col in parts:
        part = cols[:, :, col // hd : col // hd + n]
        if g is None:
            part.zero_()
        else:
            part.copy_(g.transpose(1, 2))


_EAGER: dict[type, Any] = {}


def eager_attention(attn: Any) -> Any:
    """The eager attention function of the attention module's own modeling file, as its forward calls
    it (Gemma 2's applies the soft-capping; Llama's, the fallback, ignores it): the first class of its
    MRO whose module defines one (FSDP2's class around it is defined elsewhere)."""
    cls = type(attn)
    fn = _EAGER.get(cls)
    if fn is None:
        for c in cls.__mro__:
            fn = getattr(sys.modules.get(c.__module__), "eager_attention_forward", None)
            if fn is not None:
                break
        else:
            from transformers.models.llama.modeling_llama import eager_attention_forward

            fn = eager_attention_forward
        _EAGER[cls] = fn
    return fn


def attention(
    st: ModelState, attn: Any, qkv: torch.Tensor, b: int, s: int, mask: Any, kwargs: dict[str, Any]
) -> torch.Tensor:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    nq = st.H * st.HD
    q, k, v = Heads.apply(qkv, b, s, st.H, st.KV, st.HD)
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention(attn))
    extra = window(st.family, attn)
    if st.family.attn_softcap:  # (Gemma 2's attention passes its soft-capping; under sdpa it is unused)
        extra["softcap"] = attn.attn_logit_softcapping
    out, _ = fn(
        attn,
        q,
        k,
        v,
        mask,
        dropout=0.0 if not attn.training else attn.attention_dropout,
        scaling=attn.scaling,
        **extra,
        **kwargs,
    )
    return out.reshape(b * s, nq)


class Step:
    """What every decoder layer of one forward reads besides its inputs x and qkv: the block functions
    of the forward's dtype, the attention mask of each layer, the batch and sequence lengths, RoPE's
    f32 positions and each layer's frequencies (`freq[i]`: layer i's QKV, which layer i - 1's block
    makes), and the attention function's keyword arguments. One object, not tensors, among a layer's
    arguments: FSDP2 casts a module's floating-point tensor arguments to its MixedPrecisionPolicy's
    param_dtype, and positions in bf16 would lose their low bits."""

    __slots__ = (
        "blocks",
        "mask",
        "b",
        "s",
        "pos",
        "freq",
        "kwargs",
        "given",
        "made",
        "scales",
        "amaxes",
        "snapshot",
    )

    def __init__(
        self,
        blocks: Blocks,
        mask: Any,
        b: int,
        s: int,
        pos: torch.Tensor,
        freq: tuple[torch.Tensor, ...],
        kwargs: dict[str, Any],
    ):
        self.blocks, self.mask, self.b, self.s = blocks, mask, b, s
        self.pos, self.freq, self.kwargs = pos, freq, kwargs
        # per decoder layer (by index): the tensors the patched forward passed it and those its
        # forward made, to see that nothing between them (a hook, a wrapper) changed them
        self.given: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # fp8 models: the delayed scales each call site ran at in this step (by layer index, -1 the
        # first block), which activation checkpointing's second run of a layer reuses (fp8.py)
        self.scales: dict[int, dict[str, torch.Tensor]] = {}
        self.amaxes: dict[int, dict[str, torch.Tensor]] = {}  # (their amaxes, recorded at the end)
        self.snapshot: torch.Tensor | None = None  # (the bank's scales as this step reads them)


def same(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """The same tensors: the same memory and shapes (activation checkpointing passes a layer detached
    copies of its inputs, which share their memory; FSDP2's casts to the dtype they have already are
    the tensors themselves)."""
    return all(x.data_ptr() == y.data_ptr() and x.shape == y.shape for x, y in zip(a, b, strict=True))


CHANGED_FLOW = (
    "the patched decoder layer takes the residual stream and the QKV tile made from it by the layer "
    "before, and returns the next layer's, each [batch * seq, width]; a change of one would not reach "
    "the other, so it is refused, not half-honoured. A hook that only reads them runs (output_hidden_states "
    "gives Hugging Face's hidden states); to change hidden states, run the model unpatched "
    "(coda_lang.hf.unpatch(model))"
)


def run_block(
    owner: Any, fn: BlockFunction, inputs: dict[str, Any], grad_scales: DelayedScaling | None = None
) -> dict[str, torch.Tensor]:
    """`fn(**inputs)`, run by `owner` (the module whose forward it is), with `grad_scales` (an fp8
    model's call site's cotangent scales: fp8.py) when given; a tensor without memory among the
    inputs (E0811: a parameter FSDP2 has resharded) is raised naming `owner`'s parameter."""
    try:
        return fn(inputs, grad_scales=grad_scales)
    except CodaError as e:
        raise named(owner, fn.name, inputs, e) from None


def run_lora(
    owner: Any, blocks: Blocks, name: str, inputs: dict[str, Any], loras: dict[str, lora.Spec | None]
) -> dict[str, torch.Tensor]:
    """Block `name` of `blocks` on `inputs`, run by `owner`: whole, or where `loras` gives active peft
    LoRA adapters of some of its weights, in parts cut before those weights' GEMMs, each of which adds
    the adapters' output to its accumulator (lora.py, split.py). A weight or bias that requires no
    gradient (a frozen base) is not differentiated: no weight-gradient GEMM is made for it."""
    cut = tuple(sorted(k for k, v in loras.items() if v is not None))
    fn = blocks.named(name)
    frozen = tuple(sorted(k for k, v in inputs.items() if k.startswith(("w_", "b_")) and not v.requires_grad))
    if not cut and not frozen:
        return run_block(owner, fn, inputs)
    env = dict(inputs)
    for part, ops in blocks.parts(name, cut, frozen):
        args = {p.var.name: env[p.var.name] for p in part.block.ir.params if p.var.name in env}
        made_again: Any = contextlib.nullcontext()
        if ops is not None:
            xn, wn = ops
            spec = loras[wn]
            assert spec is not None
            args[LORA_C], again = lora.correction(env[xn], spec)
            made_again = lora.kept(args[LORA_C], again)  # (the block's backward makes it again)
        with made_again:
            env.update(run_block(owner, part, args))
    return {o.name: env[o.name] for o in fn.block.ir.outputs}


def run_step(
    owner: Any, step: Step, index: int, name: str, inputs: dict[str, Any], loras: dict[str, lora.Spec | None]
) -> dict[str, torch.Tensor]:
    """Block `name` of the step's blocks, run by `owner` (`run_lora`); in an fp8 model with the delayed
    scales of the call site (`index`: the decoder layer's, -1 the first block's) and its amaxes
    recorded, and with fp8="delayed" its cotangents' grad state (fp8.py)."""
    st: ModelState = owner._coda
    if st.fp8 is None:
        return run_lora(owner, step.blocks, name, inputs, loras)
    fn = step.blocks.named(name)
    assert st.fp8_bank is not None
    return fp8.run_scaled(
        st.fp8_bank, owner, step, index, lambda ins, gs: run_block(owner, fn, ins, gs), fn, inputs, loras
    )


def named(owner: Any, block: str, inputs: dict[str, Any], e: CodaError) -> CodaError:
    """`e`, or for E0811 (an input without memory) an E0811 naming the parameters of `owner` among
    `inputs` that have no memory (patched and Hugging Face's names), and what to do."""
    if e.diagnostics[0].code != "E0811":
        return e
    st: ModelState = owner._coda
    where = getattr(owner, "_coda_name", "")
    found = []
    for name, p in owner.named_parameters():
        for k, v in inputs.items():
            if v is p and (why := unallocated(v)) is not None:
                full = (f"{where}." if where else "") + name.replace(WRAPPED, "")
                hf = st.layout.hf_name(full)
                also = f" (Hugging Face's `{hf}`)" if hf != full else ""
                found.append(f"parameter `{full}`{also}, input `{k}` of block `{block}`, {why}")
    if not found:
        return e
    return error(
        "E0811",
        f"coda_lang.hf: {'; '.join(found)}. A patched model's blocks read the weights of the module "
        "that runs them, and FSDP2 gathers a module's parameters only while its forward or backward "
        "runs: shard after patching, each whole decoder layer and then the model (`for layer in "
        "model.model.layers: fully_shard(layer)`, then `fully_shard(model)`), not a submodule of a "
        "decoder layer; and call the model or its decoder layers",
        notes=['docs/models.md, "Sharded training"'],
    )


def layer_forward(
    self: Any, x: torch.Tensor, qkv: torch.Tensor, step: Step
) -> tuple[torch.Tensor, torch.Tensor]:
    """A patched decoder layer's forward (bound to each layer): its attention on `qkv` (its fused QKV
    tile, [B*S, (H + 2 KV) * HD]), then its block from the attention output on: `layer`, to the next
    layer's residual and QKV tile (x2, qkv), or on the last layer `last`, to the final norm's weighted
    input and row scale (x2g, r2). x: its residual input, [B*S, D]. Every weight it reads is its own
    (checkpoint.py: the next layer's input norm and QKV, or the final norm, under `coda_next`)."""
    st: ModelState = self._coda
    i = self._coda_index
    # (none when activation checkpointing runs the forward again in the backward: nothing checked, nothing kept)
    given = step.given.pop(i, None)
    if given is not None and not same((x, qkv), given):
        raise refuse(
            f"{self._coda_name}: its inputs were changed on the way in (a forward pre-hook or a wrapper)",
            CHANGED_FLOW,
        )
    attn, mlp, nxt = self.self_attn, self.mlp, self.coda_next
    for name in st.family.resid_dropouts:  # (Phi-3's residual dropout, which the blocks don't have)
        drop = getattr(self, name)
        if drop.training and drop.p > 0:
            raise refuse(
                f"{self._coda_name}.{name}: dropout p={drop.p} in training mode",
                "the fused blocks add each branch to the residual without dropout (Phi-3's resid_pdrop)",
                "set resid_pdrop=0 before making the model (Phi-3's released configs have 0.0) or the "
                "dropout modules' p to 0, or train it unpatched; in eval mode dropout is the identity "
                "and runs",
            )
    y = attention(st, attn, qkv, step.b, step.s, step.mask[i], step.kwargs)
    o_proj, down = base_of(attn.o_proj), base_of(mlp.down_proj)
    inputs = dict(
        y=y,
        x=x,
        w_o=o_proj.weight,
        w_13=mlp.gate_up_weight,
        w_2=down.weight,
        **{k: getattr(self, n).weight for k, n in layer_norms(st.family).items()},
    )
    loras = {
        "w_o": lora.linear(attn.o_proj, o_proj.weight.shape[0]),
        "w_13": lora.gate_up(mlp),
        "w_2": lora.linear(mlp.down_proj, down.weight.shape[0]),
    }
    if self._coda_last:
        out = run_step(self, step, i, "last", {**inputs, "g2": nxt.norm.weight}, loras)
        if given is not None:
            step.made[i] = (out["x2g"], out["r2"])
        return out["x2g"], out["r2"]
    fused = nxt.self_attn
    if st.family.pre_norm:
        inputs["g2"] = nxt.input_layernorm.weight
    inputs.update(
        w_qkv=fused.qkv_weight,
        pos=step.pos,
        freq=step.freq[i + 1],  # (the next layer's QKV: Gemma 3's RoPE is per kind of layer)
        **qkv_inputs(st, fused, x.device),
    )
    loras["w_qkv"] = lora.qkv(fused)
    out = run_step(self, step, i, "layer", inputs, loras)
    if given is not None:
        step.made[i] = (out["x2"], out["qkv"])
    return out["x2"], out["qkv"]


def hidden(
    model: Any,
    input_ids: Any,
    attention_mask: Any,
    position_ids: Any,
    past_key_values: Any,
    inputs_embeds: Any,
    use_cache: Any,
    kwargs: dict[str, Any],
    tied: TiedGrad | None = None,
    states: list[torch.Tensor] | None = None,
    steps: list[Step] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The last layer's output times the final norm's weight, and the norm's row scale: [B*S, D], [B*S].
    The embedding and the first layer's QKV block run here, then each decoder layer as a module call
    (its hooks and wrappers fire: FSDP2's gathers, activation checkpointing).
    `tied`: the embedding lookup is `Embed`, whose backward adds the loss head's weight gradient.
    `states`: a list to fill with the embedding output and each layer's output but the last, [B, S, D]
    (Hugging Face's hidden states without the final normed one). `steps`: a list to put the `Step` in,
    for a caller that runs an fp8 block after the layers (loss_mode="fp8"'s head) and then records the
    step's amaxes itself (`fp8.record`); without it they are recorded here."""
    st: ModelState = model._coda
    if past_key_values is not None or use_cache:
        raise refuse(
            "use_cache / past_key_values", "a coda-patched model runs training forwards (no KV cache)"
        )
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    base = model.model
    if inputs_embeds is not None:
        emb = inputs_embeds
    elif tied is not None:
        e = base.embed_tokens
        emb = Embed.apply(e.weight, input_ids, e.padding_idx, tied)
        if st.family.scaled_embedding:  # (Gemma's: times sqrt(hidden_size) in the weight's dtype)
            emb = emb * e.embed_scale.to(e.weight.dtype)
    else:
        emb = base.embed_tokens(input_ids)
    if st.multipliers is not None:  # Granite's embedding multiplier, applied as its model does
        emb = emb * st.multipliers[0]
    first = base.coda_first
    weights = first.self_attn.qkv_weight.dtype
    if emb.dtype != weights or str(weights).removeprefix("torch.") not in DTYPES:
        raise refuse(
            f"dtype {emb.dtype}",
            f"the embeddings are {emb.dtype} and the weights {weights}; the blocks run in one dtype, "
            "bfloat16, float16 or float32",
        )
    b, s, _ = emb.shape
    # the mask sees the caller's positions only: from given positions transformers looks for packed
    # sequences, which reads a value back from the GPU (a synchronization that leaves the GPU idle
    # while the host launches the first layer); the default 0..s-1 packs nothing
    mask = layer_masks(model, st.family, emb, attention_mask, position_ids)  # one per layer
    if position_ids is None:
        pos = st.positions(b, s, emb.device)
    else:
        pos = position_ids.expand(b, s).reshape(-1).to(torch.float32)
    # the attention function gets the caller's position_ids as Hugging Face's attention does (flash
    # attention finds packed sequences from them when there is no mask)
    attn_kwargs = kwargs if position_ids is None else {**kwargs, "position_ids": position_ids}
    step = Step(st.blocks(emb.dtype), mask, b, s, pos, st.freqs(model, emb.device), attn_kwargs)
    h = emb.reshape(b * s, -1)
    fused = first.self_attn
    inputs = dict(
        h=h,
        w_qkv=fused.qkv_weight,
        pos=step.pos,
        freq=step.freq[0],
        **qkv_inputs(st, fused, emb.device),
    )
    if st.family.pre_norm:
        inputs["g"] = first.input_layernorm.weight
    qkv = run_step(model, step, -1, "first_qkv", inputs, {"w_qkv": lora.qkv(fused)})["qkv"]
    if states is not None:
        states.append(emb)
    layers = base.layers
    x = h
    last = len(layers) - 1
    for i, layer in enumerate(layers):
        step.given[i] = (x, qkv)
        # positional x and qkv: what activation checkpointing (use_reentrant=True) differentiates
        x, qkv = layer(x, qkv, step)
        step.given.pop(i, None)
        made = step.made.pop(i, None)
        if made is None or not same((x, qkv), made):
            where = getattr(
                getattr(layer, "_checkpoint_wrapped_module", layer), "_coda_name", f"model.layers.{i}"
            )
            raise refuse(
                f"{where}: its outputs were changed on the way out (a forward hook or a wrapper)"
                if made is not None
                else f"{where}: its patched forward did not run",
                CHANGED_FLOW,
            )
        if states is not None and i < last:
            states.append(x.view(b, s, -1))
    if steps is None:
        fp8.record(st.fp8_bank, step)  # (an fp8 model: every call site's next scales, at once)
    else:
        steps.append(step)
    return x, qkv, b, s  # the last layer's (x2g, r2)


def wants_states(model: Any, kwargs: dict[str, Any]) -> bool:
    """`output_hidden_states` (popped from `kwargs`, else the config's): True or False; a list of layers
    is refused."""
    want = kwargs.pop("output_hidden_states", None)
    if want is None:
        want = getattr(model.config, "output_hidden_states", False)
    if isinstance(want, (list, tuple, set)):
        raise refuse("output_hidden_states=[...]", "a coda-patched model returns all hidden states or none")
    return bool(want)


def normed(hg: torch.Tensor, r: torch.Tensor, b: int, s: int) -> torch.Tensor:
    """The final norm's output, [B, S, D], from its weighted input and row scale."""
    return (hg.float() * r[:, None]).to(hg.dtype).view(b, s, -1)


def causal_lm_forward(
    self: Any,
    input_ids: Any = None,
    attention_mask: Any = None,
    position_ids: Any = None,
    past_key_values: Any = None,
    inputs_embeds: Any = None,
    labels: Any = None,
    use_cache: Any = None,
    logits_to_keep: int | torch.Tensor = 0,
    **kwargs: Any,
) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return_dict = kwargs.pop("return_dict", None)
    check_call(self, input_ids, inputs_embeds, labels, kwargs, past_key_values is not None or bool(use_cache))
    st: ModelState = self._coda
    num_items = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    states: list[torch.Tensor] | None = [] if wants_states(self, kwargs) else None
    with_loss = labels is not None or shift_labels is not None
    # a tied head + embedding in "rows" mode: the weight's gradient made in one pass (TiedGrad)
    tied = (
        TiedGrad()
        if with_loss and st.loss_mode != "vocab" and inputs_embeds is None and tied_embedding(self, st.family)
        else None
    )
    # loss_mode="fp8": the head is an fp8 call site of the step, whose amaxes are recorded after it runs
    steps: list[Step] | None = [] if with_loss and st.loss_mode == "fp8" else None
    hg, r, b, s = hidden(
        self,
        input_ids,
        attention_mask,
        position_ids,
        past_key_values,
        inputs_embeds,
        use_cache,
        kwargs,
        tied,
        states,
        steps,
    )
    if states is not None:
        states.append(normed(hg, r, b, s))
    hs = None if states is None else tuple(states)
    w_lm = gathered(self.lm_head).weight  # (an FSDP2 unit of its own, as Accelerate shards it)
    bl = st.blocks(hg.dtype)
    if with_loss:
        target = targets(labels, shift_labels, self.config.vocab_size)
        denom = torch.as_tensor(num_items if num_items is not None else (target != IGNORE).sum())
        if st.loss_mode == "vocab":
            per_token = run_block(self, bl.vocab_head(), dict(hg=hg, r=r, w_lm=w_lm, target=target))["loss"]
            loss = per_token.sum() / denom.to(per_token.device)
        elif st.loss_mode == "fp8":
            assert steps is not None and st.fp8_bank is not None
            step, fn = steps[0], bl.fp8_head()
            per_token = fp8.run_scaled(
                st.fp8_bank,
                self,
                step,
                fp8.HEAD_SITE,
                lambda ins, gs: run_block(self, fn, ins, gs),
                fn,
                dict(hg=hg, r=r, w_lm=w_lm, target=target),
                {},
            )["loss"]
            fp8.record(st.fp8_bank, step)
            loss = per_token.sum() / denom.to(per_token.device)
        else:
            chunk = st.loss_rows or rows_per_chunk(hg.shape[0], w_lm.shape[0], w_lm.element_size())
            try:
                loss = ChunkedLoss.apply(hg, r, w_lm, target, denom, bl.row_head(), chunk, tied)
            except CodaError as e:
                raise named(self, "head_loss", {"hg": hg, "r": r, "w_lm": w_lm}, e) from None
        return returned(self, CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=hs), return_dict)
    rows = torch.arange(b * s, device=hg.device).view(b, s)
    if isinstance(logits_to_keep, int) and logits_to_keep > 0:
        rows = rows[:, -logits_to_keep:]
    elif isinstance(logits_to_keep, torch.Tensor):
        rows = rows[:, logits_to_keep]
    keep = rows.reshape(-1)
    logits = run_block(self, bl.head_logits, dict(hg=hg[keep], r=r[keep], w_lm=w_lm))["logits"]
    out = CausalLMOutputWithPast(loss=None, logits=logits.view(b, rows.shape[1], -1), hidden_states=hs)
    return returned(self, out, return_dict)


def base_forward(
    self: Any,
    input_ids: Any = None,
    attention_mask: Any = None,
    position_ids: Any = None,
    past_key_values: Any = None,
    inputs_embeds: Any = None,
    use_cache: Any = None,
    **kwargs: Any,
) -> Any:
    from transformers.modeling_outputs import BaseModelOutputWithPast

    owner = self._coda_owner()  # the causal LM holding this base model
    return_dict = kwargs.pop("return_dict", None)
    check_call(
        owner, input_ids, inputs_embeds, None, kwargs, past_key_values is not None or bool(use_cache), True
    )
    states: list[torch.Tensor] | None = [] if wants_states(owner, kwargs) else None
    hg, r, b, s = hidden(
        owner,
        input_ids,
        attention_mask,
        position_ids,
        past_key_values,
        inputs_embeds,
        use_cache,
        kwargs,
        states=states,
    )
    out = normed(hg, r, b, s)
    hs = None if states is None else (*states, out)
    return returned(owner, BaseModelOutputWithPast(last_hidden_state=out, hidden_states=hs), return_dict)
