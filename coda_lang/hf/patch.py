"""`apply_coda_to_llama` / `apply_coda_to_qwen3`: a Hugging Face causal LM whose non-attention work runs
as coda blocks.

What it does: patches one model instance in place. Per layer, q/k/v projections become one parameter
`self_attn.qkv_weight` (q and k rows in the interleaved RoPE layout) and gate/up one parameter
`mlp.gate_up_weight` (rows interleaved); the model's forward then runs, in the paper's schedule, the
first layer's input norm + QKV + RoPE (+ Qwen3's q/k norm) as one block, each layer boundary (out-proj
+ residual + norm + gate/up + SwiGLU + down + residual + the next layer's norm + QKV + RoPE) as one
block, the last layer's MLP as one block, and the LM head with the loss (labels given: per-token
cross-entropy, logits never stored) or the logits. Attention is the model's own attention function
(`config._attn_implementation`), on q, k in the interleaved layout (q.k is unchanged by permuting q and
k alike). `state_dict()` gives, and `load_state_dict()` takes, the unpatched model's names and layouts,
so checkpoints move between patched and unpatched models (and `save_pretrained`).
What it does not: generation with a KV cache, biases, sliding-window attention, RoPE types that scale
cos/sin (`attention_scaling` != 1) or change `inv_freq` per call, or a model whose dtype changes after
patching: each raises ValueError naming what it met.
Invariants: the optimizer should be made after patching (the fused weights are new parameters); the
loss follows transformers' contract (labels shifted by one, -100 ignored, the mean over counted tokens
or the sum over `num_items_in_batch`).
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch

from coda_lang.api import load
from coda_lang.hf.blocks import DTYPES, model_source
from coda_lang.layout import deinterleave_rope, interleave_rope
from coda_lang.torch import BlockFunction, compile_together, function

__all__ = ["apply_coda_to_llama", "apply_coda_to_qwen3", "unfused_grads"]

_ROPE_TYPES = ("default", "llama3", "linear")
IGNORE = -100


class _Model:
    """The facts of one patched model and its block functions."""

    def __init__(self, model: Any, qk_norm: bool):
        cfg = model.config
        self.qk_norm = qk_norm
        self.H = cfg.num_attention_heads
        self.KV = cfg.num_key_value_heads
        self.HD = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        self.D = cfg.hidden_size
        self.dtype = model.dtype
        src = model_source(str(self.dtype).removeprefix("torch."), cfg.rms_norm_eps, self.HD, qk_norm)
        prog = load(src)
        weights = {"w_o", "w_13", "w_2", "w_qkv", "w_lm", "g", "g1", "g2", "gq", "gk"}

        def fn(name: str, **options: Any) -> BlockFunction:
            b = prog[name]
            wrt = [
                p.var.name
                for p in b.ir.params
                if p.var.name in weights or p.var.name in ("h", "y", "x", "hg", "r")
            ]
            return function(b, wrt=wrt, **options)

        # the default saved-tensor policy (auto): e.g. the SwiGLU output is recomputed in the backward
        self.first, self.layer, self.last = fn("first_qkv"), fn("layer"), fn("last")
        # the loss head. "vocab": it keeps only its log-sum-exp, its backward runs the GEMM again in
        # chunks of the vocabulary (each chunk's weight gradient complete): four GEMMs. "rows": chunks
        # of rows, each chunk's forward keeping its logits and its backward run at once in the
        # forward: three GEMMs, the weight gradient summed over the chunks inside its GEMM
        self.head_logits = fn("head_logits")
        self.loss_mode = "rows"
        self.loss_budget = LOSS_CHUNK_BYTES  # bytes of the largest transient of a chunk ("vocab")
        self.loss_rows = 0  # rows per chunk of the loss head ("rows"); 0: from LOSS_ROWS_BYTES
        self._fn = fn
        # made once, not at each forward (launches while the GPU waits at a step's start): the default
        # positions of the last (batch, seq, device), and the RoPE frequencies of the model's inv_freq
        # buffer while it is the same tensor at the same version (not modified in place)
        self._positions: tuple[tuple[int, int, str], torch.Tensor] | None = None
        self._freq: tuple[Any, int, str, torch.Tensor] | None = None
        self._vocab_heads: dict[int, BlockFunction] = {}
        self._row_head: BlockFunction | None = None
        # a training step's kernels (the first layer's, the layers', the last layer's, the loss head's:
        # forward and backward) compile at once at its first call, in one pool of workers
        compile_together(self.first, self.layer, self.last, self.row_head())

    def row_head(self) -> BlockFunction:
        """The loss head of "rows" mode: its logits saved (remat="save"), run forward and backward
        in chunks of rows (BlockFunction.forward_backward)."""
        if self._row_head is None:
            self._row_head = self._fn("head_loss", remat="save", chunk_dim="M")
        return self._row_head

    def vocab_head(self) -> BlockFunction:
        """The loss head whose backward runs in chunks of V within `loss_budget` bytes."""
        f = self._vocab_heads.get(self.loss_budget)
        if f is None:
            f = self._fn("head_loss", chunk="auto", chunk_dim="V", budget=self.loss_budget)
            self._vocab_heads[self.loss_budget] = f
        return f

    @property
    def rope_width(self) -> int:
        return (self.H + self.KV) * self.HD

    def positions(self, b: int, s: int, device: torch.device) -> torch.Tensor:
        """The f32 positions 0..s-1 of each of b sequences, flattened: the default position_ids."""
        key = (b, s, str(device))
        if self._positions is None or self._positions[0] != key:  # a new shape replaces the last
            self._positions = (key, torch.arange(s, device=device, dtype=torch.float32).repeat(b))
        return self._positions[1]

    def freq(self, model: Any, device: torch.device) -> torch.Tensor:
        """RoPE's frequency of each column of the fused QKV tile's q and k heads (0 for v's)."""
        inv = model.model.rotary_emb.inv_freq
        got = self._freq
        if got is not None and got[0] is inv and got[1] == inv._version and got[2] == str(device):
            return got[3]
        inv32 = inv.to(device=device, dtype=torch.float32)
        f = torch.cat([inv32.repeat(self.H + self.KV), inv32.new_zeros(self.KV * self.HD // 2)])
        self._freq = (inv, inv._version, str(device), f)
        return f


def _refuse(what: str, why: str) -> ValueError:
    return ValueError(f"coda_lang.hf: {what}: {why}")


def _check(model: Any, family: str, qk_norm: bool) -> None:
    cfg = model.config
    name = type(model).__name__
    expect = "LlamaForCausalLM" if family == "llama" else "Qwen3ForCausalLM"
    if name != expect:
        raise _refuse(name, f"apply_coda_to_{family} patches a transformers {expect}")
    if getattr(model, "_coda", None) is not None:
        raise _refuse(name, "this model is patched already")
    if str(model.dtype).removeprefix("torch.") not in DTYPES:
        raise _refuse(f"dtype {model.dtype}", "coda blocks run in bfloat16, float16 or float32")
    if getattr(cfg, "attention_bias", False):
        raise _refuse("attention_bias=True", "the fused QKV and out-projection blocks have no bias")
    if getattr(cfg, "mlp_bias", False):
        raise _refuse("mlp_bias=True", "the fused MLP block has no bias")
    if cfg.hidden_act != "silu":
        raise _refuse(f"hidden_act={cfg.hidden_act!r}", "the MLP block is SwiGLU (silu)")
    if getattr(cfg, "use_sliding_window", False) or any(
        t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])
    ):
        raise _refuse("sliding-window attention", "only full attention layers are supported")
    rope = model.model.rotary_emb
    if rope.rope_type not in _ROPE_TYPES:
        raise _refuse(f"rope_type={rope.rope_type!r}", f"supported: {', '.join(_ROPE_TYPES)}")
    if float(rope.attention_scaling) != 1.0:
        raise _refuse(f"RoPE attention_scaling={rope.attention_scaling}", "only 1.0 is supported")
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if getattr(attn, n, None) is None or getattr(attn, n).bias is not None:
                raise _refuse(f"layer {i}: self_attn.{n}", "missing or has a bias")
        if qk_norm and (getattr(attn, "q_norm", None) is None or getattr(attn, "k_norm", None) is None):
            raise _refuse(f"layer {i}", "Qwen3 attention without q_norm/k_norm")


# -- parameter layout: fused in the model, unfused in checkpoints ----------------------------------


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hd: int) -> torch.Tensor:
    w = torch.cat([q, k, v], 0)  # [out, in]
    rw = q.shape[0] + k.shape[0]
    return interleave_rope(w.t(), hd, rw).t().contiguous()


def _split_qkv(w: torch.Tensor, hd: int, nq: int, nk: int) -> tuple[torch.Tensor, ...]:
    plain = deinterleave_rope(w.t(), hd, nq + nk).t()
    return plain[:nq].contiguous(), plain[nq : nq + nk].contiguous(), plain[nq + nk :].contiguous()


def _attn_save_hook(module: Any, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
    key = prefix + "qkv_weight"
    if key not in state_dict:
        return
    q, k, v = _split_qkv(state_dict.pop(key).detach(), module.head_dim, module._coda_nq, module._coda_nk)
    state_dict[prefix + "q_proj.weight"] = q
    state_dict[prefix + "k_proj.weight"] = k
    state_dict[prefix + "v_proj.weight"] = v


def _attn_load_hook(module: Any, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    keys = [prefix + f"{n}_proj.weight" for n in "qkv"]
    if all(k in state_dict for k in keys):
        q, k, v = (state_dict.pop(x) for x in keys)
        state_dict[prefix + "qkv_weight"] = _fuse_qkv(q, k, v, module.head_dim)


def _mlp_save_hook(module: Any, state_dict: dict[str, Any], prefix: str, _meta: Any) -> None:
    key = prefix + "gate_up_weight"
    if key in state_dict:
        w = state_dict.pop(key).detach()
        state_dict[prefix + "gate_proj.weight"] = w[0::2].contiguous()
        state_dict[prefix + "up_proj.weight"] = w[1::2].contiguous()


def _mlp_load_hook(module: Any, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    g, u = prefix + "gate_proj.weight", prefix + "up_proj.weight"
    if g in state_dict and u in state_dict:
        state_dict[prefix + "gate_up_weight"] = torch.stack(
            [state_dict.pop(g), state_dict.pop(u)], 1
        ).flatten(0, 1)


def _fuse_layer(layer: Any, hd: int) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    with torch.no_grad():
        qkv = _fuse_qkv(q, k, v, hd)
        gu = torch.stack([mlp.gate_proj.weight, mlp.up_proj.weight], 1).flatten(0, 1)
    attn._coda_nq, attn._coda_nk = q.shape[0], k.shape[0]
    attn.qkv_weight = torch.nn.Parameter(qkv, requires_grad=q.requires_grad)
    mlp.gate_up_weight = torch.nn.Parameter(gu.contiguous(), requires_grad=mlp.gate_proj.weight.requires_grad)
    del attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj
    attn._register_state_dict_hook(_attn_save_hook)
    attn.register_load_state_dict_pre_hook(_attn_load_hook)
    mlp._register_state_dict_hook(_mlp_save_hook)
    mlp.register_load_state_dict_pre_hook(_mlp_load_hook)


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
        (_attn_save_hook if name.endswith("qkv_weight") else _mlp_save_hook)(module, sd, "", None)
        out.update({prefix + k: v for k, v in sd.items()})
    return out


# -- the forward ------------------------------------------------------------------------------------


def _qk_norm_weights(st: _Model, attn: Any, device: torch.device) -> dict[str, torch.Tensor]:
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


class _Heads(torch.autograd.Function):
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


def _attention(
    st: _Model, attn: Any, qkv: torch.Tensor, b: int, s: int, mask: Any, kwargs: dict[str, Any]
) -> torch.Tensor:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    nq = st.H * st.HD
    q, k, v = _Heads.apply(qkv, b, s, st.H, st.KV, st.HD)
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


def _hidden(
    model: Any,
    input_ids: Any,
    attention_mask: Any,
    position_ids: Any,
    past_key_values: Any,
    inputs_embeds: Any,
    use_cache: Any,
    kwargs: dict[str, Any],
    tied: _TiedGrad | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The last layer's output times the final norm's weight, and the norm's row scale: [B*S, D], [B*S].
    `tied`: the embedding lookup is `_Embed`, whose backward adds the loss head's weight gradient."""
    from transformers.masking_utils import create_causal_mask

    st: _Model = model._coda
    if past_key_values is not None or use_cache:
        raise _refuse(
            "use_cache / past_key_values", "a coda-patched model runs training forwards (no KV cache)"
        )
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    base = model.model
    if inputs_embeds is not None:
        emb = inputs_embeds
    elif tied is not None:
        e = base.embed_tokens
        emb = _Embed.apply(e.weight, input_ids, e.padding_idx, tied)
    else:
        emb = base.embed_tokens(input_ids)
    if emb.dtype != st.dtype or base.layers[0].self_attn.qkv_weight.dtype != st.dtype:
        raise _refuse(
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
        return _qk_norm_weights(st, layers[i].self_attn, emb.device) if st.qk_norm else {}

    a0 = layers[0]
    qkv = st.first(
        h=h, g=a0.input_layernorm.weight, w_qkv=a0.self_attn.qkv_weight, pos=pos, freq=freq, **qkn(0)
    )["qkv"]
    x = h
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        y = _attention(st, attn, qkv, b, s, mask, kwargs)
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


def _targets(labels: torch.Tensor, shift_labels: Any, vocab: int) -> torch.Tensor:
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:]
    t = shift_labels.reshape(-1)
    bad = (t != IGNORE) & ((t < 0) | (t >= vocab))
    if t.device.type == "cpu":
        if bool(bad.any()):
            raise ValueError(f"labels must be in [0, {vocab}) or {IGNORE}, got {int(t[bad][0])}")
    else:
        torch._assert_async(~bad.any(), f"labels must be in [0, {vocab}) or {IGNORE}")
    return t.to(torch.int32)


# The loss head's backward ("vocab" mode) runs in chunks of the vocabulary whose [M, c] dlogits stay
# under this many bytes.
LOSS_CHUNK_BYTES = 256 * 2**20


class _ChunkedLoss(torch.autograd.Function):
    """sum(per-token loss) / denom, with the gradients of hg, r and w_lm made in the forward, chunk
    by chunk (BlockFunction.forward_backward); the backward scales them by the incoming gradient."""

    @staticmethod
    def forward(
        ctx: Any,
        hg: torch.Tensor,
        r: torch.Tensor,
        w_lm: torch.Tensor,
        target: torch.Tensor,
        denom: torch.Tensor,
        head: BlockFunction,
        rows: int,
        tied: _TiedGrad | None,
    ) -> torch.Tensor:
        scale = (1.0 / denom.float()).to(hg.device)
        # the weight's gradient stays an f32 total until the backward scales it and rounds it, one pass
        # (the total is no larger than the chunks' working memory it outlives)
        outs, grads = head.forward_backward(
            hg=hg,
            r=r,
            w_lm=w_lm,
            target=target,
            cotangents={"loss": scale.expand(hg.shape[0])},
            chunk=rows,
            rounded=False,
        )
        ctx.kept = tuple(
            grads[n] if ctx.needs_input_grad[i] else None for i, n in enumerate(("hg", "r", "w_lm"))
        )
        ctx.dtypes = (hg.dtype, r.dtype, w_lm.dtype)
        ctx.tied = tied
        return outs["loss"].sum() * scale

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        kept = ctx.kept
        del ctx.kept
        dh, dr = (
            None if t is None else scale_round(t, g, dt)
            for t, dt in zip(kept[:2], ctx.dtypes[:2], strict=True)
        )
        dw = None
        if kept[2] is not None:
            if ctx.tied is not None:  # the embedding's backward adds its rows and rounds: _Embed
                ctx.tied.total, ctx.tied.scale = kept[2], g
            else:
                dw = scale_round(kept[2], g, ctx.dtypes[2])
        return (dh, dr, dw, None, None, None, None, None)


class _TiedGrad:
    """A tied LM head and embedding: the head's weight-gradient total (f32) and the loss's incoming
    gradient, handed from the head's backward to the embedding's, which runs after it (the embedding
    is upstream of every layer). One pass then makes the weight's gradient, accumulated once
    (`tied_grad`), where torch fills a dense [V, D] embedding gradient, scatters into it and adds it
    to the head's."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None


class _Embed(torch.autograd.Function):
    """torch's embedding lookup, whose backward adds the loss head's weight gradient left in `tied`
    (without it, as torch's embedding backward: a backward that did not start from the loss)."""

    @staticmethod
    def forward(
        ctx: Any, weight: torch.Tensor, ids: torch.Tensor, padding_idx: int | None, tied: _TiedGrad
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.tied, ctx.vocab, ctx.dtype = padding_idx, tied, weight.shape[0], weight.dtype
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        (ids,) = ctx.saved_tensors
        tied: _TiedGrad = ctx.tied
        total, scale = tied.total, tied.scale
        tied.total = tied.scale = None
        if total is None or scale is None:
            pad = -1 if ctx.padding_idx is None else ctx.padding_idx
            dw = torch.ops.aten.embedding_dense_backward(grad, ids, ctx.vocab, pad, False)
        else:
            dw = tied_grad(total, scale, ids, grad.reshape(-1, grad.shape[-1]), ctx.dtype, ctx.padding_idx)
        return dw, None, None, None


def tied_grad(
    total: torch.Tensor,
    scale: torch.Tensor,
    ids: torch.Tensor,
    rows: torch.Tensor,
    dtype: torch.dtype,
    padding_idx: int | None,
) -> torch.Tensor:
    """total * scale plus each token's row of `rows` added at its id (none at `padding_idx`), in f32,
    rounded to dtype once: on a GPU one Triton kernel (backend_triton/layouts.py), else torch's
    index_add."""
    if total.device.type == "cuda":
        from coda_lang.backend_triton import layouts

        return layouts.tied_grad(total, scale.reshape(1), ids, rows, dtype, padding_idx)
    out = total.float() * scale.float()
    flat = ids.reshape(-1)
    add = rows.float()
    if padding_idx is not None:
        add = add * (flat != padding_idx % total.shape[0]).unsqueeze(1)
    return out.index_add_(0, flat, add).to(dtype)


def _tied_embedding(model: Any) -> bool:
    """Whether the embedding lookup may be `_Embed`: a plain nn.Embedding sharing the LM head's weight,
    with nothing its module call would do besides the lookup (no hooks, max_norm or sparse gradients)."""
    from torch.nn.modules import module as m

    e = model.model.embed_tokens
    return (
        type(e) is torch.nn.Embedding
        and e.weight is model.lm_head.weight
        and e.weight.requires_grad
        and torch.is_grad_enabled()
        and e.max_norm is None
        and not e.scale_grad_by_freq
        and not e.sparse
        and not (e._forward_hooks or e._forward_pre_hooks)
        and not (m._global_forward_hooks or m._global_forward_pre_hooks)
    )


def scale_round(t: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t * g rounded to dtype, in one pass: on a GPU one Triton kernel (backend_triton/layouts.py), else
    torch's mul into a tensor of that dtype."""
    if t.device.type == "cuda":
        from coda_lang.backend_triton import layouts

        return layouts.scale_round(t, g.reshape(1), dtype)
    return torch.mul(t, g, out=torch.empty(t.shape, dtype=dtype, device=t.device))


# Rows per chunk of the loss head in "rows" mode: its forward keeps a chunk's bf16 logits, which its
# backward overwrites with their cotangent, one [rows, V] tile within this many bytes (4096 rows of a
# 128256-token vocabulary). Fewer, larger chunks: each chunk's weight-gradient GEMM reads and writes
# the f32 [V, D] total once (D = 2048: 2 GiB per chunk).
LOSS_ROWS_BYTES = 2**30


def _loss_rows(m: int, vocab: int, itemsize: int) -> int:
    """Rows per chunk of the loss head: whole multiples of 128 whose [rows, V] tile fits
    LOSS_ROWS_BYTES."""
    rows = max(128, LOSS_ROWS_BYTES // max(1, vocab * itemsize) // 128 * 128)
    return min(m, rows)


def _causal_lm_forward(
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

    st: _Model = self._coda
    num_items = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    kwargs.pop("return_dict", None)
    with_loss = labels is not None or shift_labels is not None
    # a tied head + embedding in "rows" mode: the weight's gradient made in one pass (_TiedGrad)
    tied = (
        _TiedGrad()
        if with_loss and st.loss_mode != "vocab" and inputs_embeds is None and _tied_embedding(self)
        else None
    )
    hg, r, b, s = _hidden(
        self, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache, kwargs, tied
    )
    w_lm = self.lm_head.weight
    if with_loss:
        target = _targets(labels, shift_labels, self.config.vocab_size)
        denom = torch.as_tensor(num_items if num_items is not None else (target != IGNORE).sum())
        if st.loss_mode == "vocab":
            per_token = st.vocab_head()(hg=hg, r=r, w_lm=w_lm, target=target)["loss"]
            loss = per_token.sum() / denom.to(per_token.device)
        else:
            chunk = st.loss_rows or _loss_rows(hg.shape[0], w_lm.shape[0], w_lm.element_size())
            loss = _ChunkedLoss.apply(hg, r, w_lm, target, denom, st.row_head(), chunk, tied)
        return CausalLMOutputWithPast(loss=loss, logits=None)  # type: ignore[arg-type]
    rows = torch.arange(b * s, device=hg.device).view(b, s)
    if isinstance(logits_to_keep, int) and logits_to_keep > 0:
        rows = rows[:, -logits_to_keep:]
    elif isinstance(logits_to_keep, torch.Tensor):
        rows = rows[:, logits_to_keep]
    keep = rows.reshape(-1)
    logits = st.head_logits(hg=hg[keep], r=r[keep], w_lm=w_lm)["logits"]
    return CausalLMOutputWithPast(loss=None, logits=logits.view(b, rows.shape[1], -1))  # type: ignore[arg-type]


def _base_forward(
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

    owner = self._coda_owner()  # the causal LM holding this base model (a weak reference: no module cycle)
    hg, r, b, s = _hidden(
        owner, input_ids, attention_mask, position_ids, past_key_values, inputs_embeds, use_cache, kwargs
    )
    out = (hg.float() * r[:, None]).to(hg.dtype)
    return BaseModelOutputWithPast(last_hidden_state=out.view(b, s, -1))  # type: ignore[arg-type]


def _apply(model: Any, family: str, qk_norm: bool) -> Any:
    _check(model, family, qk_norm)
    st = _Model(model, qk_norm)
    for layer in model.model.layers:
        _fuse_layer(layer, st.HD)
    model._coda = st
    object.__setattr__(model.model, "_coda_owner", weakref.ref(model))
    model.forward = types.MethodType(_causal_lm_forward, model)
    model.model.forward = types.MethodType(_base_forward, model.model)
    return model


def apply_coda_to_llama(model: Any) -> Any:
    """Patch a transformers `LlamaForCausalLM` in place (and return it) so that everything outside
    attention runs as coda blocks; see this module's docstring. Make the optimizer afterwards."""
    return _apply(model, "llama", qk_norm=False)


def apply_coda_to_qwen3(model: Any) -> Any:
    """Patch a transformers `Qwen3ForCausalLM` in place (and return it): as `apply_coda_to_llama`, with
    Qwen3's per-head q/k RMSNorm in the QKV blocks' epilogue."""
    return _apply(model, "qwen3", qk_norm=True)
