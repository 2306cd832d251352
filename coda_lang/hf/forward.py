"""The patched model's forward: the layers as coda blocks, attention the model's own.

What it does: `causal_lm_forward` (bound as the causal LM's `forward`) and `base_forward` (the base
model's): the embedding, the first layer's norm + QKV + RoPE block, per layer the model's attention
function on the fused QKV tile (`Heads`: q, k, v as views, their gradients joined in one pass) and the
layer-boundary block, the last layer's block, then the loss (loss.py) or the logits.
What it does not: build the blocks (state.py), hold parameters (checkpoint.py) or check the model
(checks.py).
Invariants: HF's calling contract (input_ids or inputs_embeds, attention_mask, position_ids, labels,
shift_labels, num_items_in_batch, logits_to_keep, return_dict); a KV cache is refused (ValueError);
each forward first checks that nothing changed since patching (contract.py, `check_call`).
"""

from __future__ import annotations

from typing import Any

import torch

from coda_lang.hf.checks import refuse
from coda_lang.hf.contract import check_call, returned
from coda_lang.hf.loss import IGNORE, ChunkedLoss, Embed, TiedGrad, rows_per_chunk, targets, tied_embedding
from coda_lang.hf.state import ModelState
from coda_lang.layout import interleave_rope


def qk_norm_weights(st: ModelState, attn: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """Qwen3: the q and k norm weights, one head's each in the interleaved RoPE layout (the block repeats
    them for every head and folds their gradients back), and the masks of the fused QKV's q and k
    columns (constants)."""
    gq = interleave_rope(attn.q_norm.weight.float(), st.HD)
    gk = interleave_rope(attn.k_norm.weight.float(), st.HD)
    nq, nk = st.H * st.HD, st.KV * st.HD
    col = torch.arange(st.rope_width + nk, device=device)
    mq = (col < nq).float()
    mk = ((col >= nq) & (col < nq + nk)).float()
    return {"gq": gq, "gk": gk, "mq": mq, "mk": mk}


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


def attention(
    st: ModelState, attn: Any, qkv: torch.Tensor, b: int, s: int, mask: Any, kwargs: dict[str, Any]
) -> torch.Tensor:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    nq = st.H * st.HD
    q, k, v = Heads.apply(qkv, b, s, st.H, st.KV, st.HD)
    fn = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager_attention_forward)
    extra = {"sliding_window": attn.sliding_window} if hasattr(attn, "sliding_window") else {}
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
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The last layer's output times the final norm's weight, and the norm's row scale: [B*S, D], [B*S].
    `tied`: the embedding lookup is `Embed`, whose backward adds the loss head's weight gradient."""
    from transformers.masking_utils import create_causal_mask

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
    else:
        emb = base.embed_tokens(input_ids)
    if emb.dtype != st.dtype or base.layers[0].self_attn.qkv_weight.dtype != st.dtype:
        raise refuse(
            f"dtype {base.layers[0].self_attn.qkv_weight.dtype}",
            f"the model was patched in {st.dtype}; patch it again after changing its dtype",
        )
    b, s, _ = emb.shape
    # the mask sees the caller's positions only: from given positions transformers looks for packed
    # sequences, which reads a value back from the GPU (a synchronization that leaves the GPU idle
    # while the host launches the first layer); the default 0..s-1 packs nothing
    mask = create_causal_mask(
        config=model.config,
        inputs_embeds=emb,
        attention_mask=attention_mask,
        past_key_values=None,
        position_ids=position_ids,
    )
    if position_ids is None:
        pos = st.positions(b, s, emb.device)
    else:
        pos = position_ids.expand(b, s).reshape(-1).to(torch.float32)
    freq = st.freq(model, emb.device)
    layers = base.layers
    h = emb.reshape(b * s, -1)

    def qkn(i: int) -> dict[str, Any]:
        return qk_norm_weights(st, layers[i].self_attn, emb.device) if st.qk_norm else {}

    a0 = layers[0]
    qkv = st.first(
        h=h, g=a0.input_layernorm.weight, w_qkv=a0.self_attn.qkv_weight, pos=pos, freq=freq, **qkn(0)
    )["qkv"]
    x = h
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        y = attention(st, attn, qkv, b, s, mask, kwargs)
        common = dict(
            y=y,
            x=x,
            w_o=attn.o_proj.weight,
            g1=layer.post_attention_layernorm.weight,
            w_13=mlp.gate_up_weight,
            w_2=mlp.down_proj.weight,
        )
        if i + 1 < len(layers):
            nxt = layers[i + 1]
            out = st.layer(
                **common,
                g2=nxt.input_layernorm.weight,
                w_qkv=nxt.self_attn.qkv_weight,
                pos=pos,
                freq=freq,
                **qkn(i + 1),
            )
            x, qkv = out["x2"], out["qkv"]
        else:
            out = st.last(**common, g2=base.norm.weight)
            return out["x2g"], out["r2"], b, s
    raise AssertionError("unreachable")


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
    with_loss = labels is not None or shift_labels is not None
    # a tied head + embedding in "rows" mode: the weight's gradient made in one pass (TiedGrad)
    tied = (
        TiedGrad()
        if with_loss and st.loss_mode != "vocab" and inputs_embeds is None and tied_embedding(self)
        else None
    )
    hg, r, b, s = hidden(
        self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache, kwargs, tied
    )
    w_lm = self.lm_head.weight
    if with_loss:
        target = targets(labels, shift_labels, self.config.vocab_size)
        denom = torch.as_tensor(num_items if num_items is not None else (target != IGNORE).sum())
        if st.loss_mode == "vocab":
            per_token = st.vocab_head()(hg=hg, r=r, w_lm=w_lm, target=target)["loss"]
            loss = per_token.sum() / denom.to(per_token.device)
        else:
            chunk = st.loss_rows or rows_per_chunk(hg.shape[0], w_lm.shape[0], w_lm.element_size())
            loss = ChunkedLoss.apply(hg, r, w_lm, target, denom, st.row_head(), chunk, tied)
        return returned(self, CausalLMOutputWithPast(loss=loss, logits=None), return_dict)  # type: ignore[arg-type]
    rows = torch.arange(b * s, device=hg.device).view(b, s)
    if isinstance(logits_to_keep, int) and logits_to_keep > 0:
        rows = rows[:, -logits_to_keep:]
    elif isinstance(logits_to_keep, torch.Tensor):
        rows = rows[:, logits_to_keep]
    keep = rows.reshape(-1)
    logits = st.head_logits(hg=hg[keep], r=r[keep], w_lm=w_lm)["logits"]
    out = CausalLMOutputWithPast(loss=None, logits=logits.view(b, rows.shape[1], -1))  # type: ignore[arg-type]
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
    hg, r, b, s = hidden(
        owner, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache, kwargs
    )
    out = (hg.float() * r[:, None]).to(hg.dtype)
    return returned(owner, BaseModelOutputWithPast(last_hidden_state=out.view(b, s, -1)), return_dict)  # type: ignore[arg-type]
