"""The .coda text of a LLaMA-family model in the paper's schedule, generated for one model's shapes.

What it does: `model_source(dtype, eps, head_dim, qk_norm, qkv_bias, multipliers, ...)` gives a
program with the blocks the Hugging Face patch runs, each a fused chain of GEMMs and their
epilogues, weights in `nn.Linear` layout ([out, in], used as `transpose(w)`):
  - `first_qkv`: the first layer's input RMSNorm, QKV projection and RoPE (and a q/k norm);
  - `layer`: from layer i's attention output to layer i+1's QKV: out-proj + residual + RMSNorm +
    gate/up + SwiGLU + down + residual + the next layer's input RMSNorm, QKV projection and RoPE;
  - `last`: the last layer's out-proj .. down + residual, then the final norm's weight and row scale;
  - `head_loss` / `head_logits`: the LM head with the row scale and per-token cross-entropy (the logits
    never stored), or the logits;
  - `head_loss_rows`: `head_loss` with the logits made from the accumulator rounded to the model's
    dtype, for "rows" mode, whose backward reads the logits saved in that dtype: the forward's
    log-sum-exp and the backward's softmax then see the same numbers (rounded in the backward only,
    a softmax that does not sum to 1 moved each confident token's gradient p - 1 by up to 2^-9 times
    its logit: 36 times the true gradient once the loss was near 1e-3, H100, 2026-11-27).
The QKV weight holds q, k and v rows (q and k in the interleaved RoPE layout, `coda_lang.layout`),
`freq` the inverse frequency of each column pair (0 for v). `mq` is 1 on the q columns and 0
elsewhere, `mk` 1 on the k columns (constant masks: the v columns are not normalized).
With `qk_norm="head"` (Qwen3; `True` says the same), `gq` and `gk` are the q and k norm weights, one
head's `HD` values each (interleaved like a RoPE head): a vector over the fixed dim HD repeats for
every head (docs/language.md, "Vectors that repeat"), so its gradient comes back folded into one
head's. With `qk_norm="proj"` (OLMo 2) each of q and k is normalized over its projection's whole
width (`NQ` = heads * HD columns, `NK` = kv heads * HD, fixed dims from `heads`), a full-row
reduction that no kernel tile spans: the QKV epilogue stores the projection `zr` and the partial
sums of squares of its q and k columns, and a row stage (an elementwise stage) applies the row
scales, the norm weight `gqk` (q's and k's in the fused columns' order, 1 on v) and RoPE.
Where the norms sit: `pre_norm` (LLaMA) normalizes each branch's input (the input norm before the
QKV projection, the MLP's norm before gate/up), its row scale deferred into the GEMM it feeds.
`post_norm` (OLMo 2; with `pre_norm`, Gemma 2/3's sandwich) normalizes each branch's output before
it joins the residual, `x1 = x + RMSNorm(o) * go` after the out-projection `o` and `x2 = x1 +
RMSNorm(m) * gd` after the down-projection `m`: the residual add needs the row scale on a tile that
feeds no GEMM as a row-scaled operand, so each is a row stage after its GEMM (which stores the
branch and the partial sums of its squares), and that row stage also makes the next pre-norm's
weighted input and statistics when there is one. The MLP's stages without post norms are
coda_lang.torch's `llama_mlp_stages`, the one source of the LLaMA MLP's text.
What it does not: hold parameters or touch transformers (the other modules of coda_lang.hf do).
With `multipliers` (Granite), each branch joins the residual times `rm` (the layer's residual
multiplier) and the logits are divided by `ls` (its logits scaling): scalars in the epilogues.
With `norm_offset` (Gemma: 1) every norm, the q/k norms among them, scales by (1 + w): the
program reads the checkpoint's w and adds the offset where it multiplies (`(1.0 + g)`), so that the
derived backward gives w's gradient. `act` is the MLP gate's activation: "silu" (SwiGLU) or
"gelu_pytorch_tanh" (GeGLU, `gelu` of the tanh approximation: Gemma). `softcap` (Gemma's
`final_logit_softcapping`) caps the heads' logits, `cap * tanh(z / cap)`, a scalar written into
the heads; the attention's soft-capping is the attention function's. A per-head q/k norm of heads
wider than any kernel tile (Gemma 3's 256 columns: the tiles are 64 to 192 columns, and a grouped
reduction completes only in a tile that holds whole groups) is a row stage after the QKV GEMM, as
"proj"'s, its grouped sums complete there (`heads_fit_tiles`).
With `qkv_bias` (Qwen2), `b_qkv` is the QKV projection's bias, q, k and v's in the fused weight's
row order, added in the epilogue before RoPE; its gradient is the column sum of the epilogue's
cotangent, which the derived backward gives.
Invariants: RMSNorm's row scale is deferred into the next GEMM's epilogue (RMSNorm(h)*g @ W ==
r * ((h*g) @ W)), as the examples do, wherever a norm feeds a GEMM; the bias is added after it
(r * ((h*g) @ W) + b). A full-row reduction is never completed inside the stage that makes it: its
partial sums are combined after the stage and applied by a later one (docs/design.md).
"""

from __future__ import annotations

import functools

from coda_lang.backend_cute.build.config import CANDIDATES, PAIRED_SUBTILE
from coda_lang.hf.family import Family
from coda_lang.torch import (
    acc_copy_lines,
    fp8_out_projection,
    fp8_weight,
    llama_mlp_stages,
    llama_mlp_stages_fp8,
    norm_weight,
)

DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def _rope(x: str) -> str:
    """The QKV blocks' last lines: RoPE on the column pairs of `x` (q and k rows interleaved, v's
    angle 0), stored as `qkv`. Every QKV variant below ends with it."""
    return (
        f"    qa, qb = pairs({x})\n    ang = pos * freq\n    c = cos(ang)\n    s = sin(ang)"
        "\n    qkv = interleave(qa * c - qb * s, qa * s + qb * c)"
    )


_QKV = """
    z = acc{r}{b}
""" + _rope("z")

_QKV_NORM = """
    z = acc{r}{b}
    hs = sum(z * z, over=2*P, group=HD)
    zn = z * rsqrt(hs / HD + eps)
    n = mq * (zn * {gq}) + mk * (zn * {gk}) + (1.0 - mq - mk) * z
""" + _rope("n")

# the per-head q/k norm of heads wider than the kernels' tiles (Gemma 3's 256 columns): the GEMM
# stores the projection, a row stage completes each head's sum of squares (a grouped reduction, whose
# tile in an elementwise stage holds whole heads) and applies it, the norm weights and RoPE
_QKV_NORM_ROWS = """
    zr: {t} = acc{r}{b}
  }}
  elementwise [M, 2*P] {{
    hs = sum(zr * zr, over=2*P, group=HD)
    zn = zr * rsqrt(hs / HD + eps)
    n = mq * (zn * {gq}) + mk * (zn * {gk}) + (1.0 - mq - mk) * zr
""" + _rope("n")

# q and k normalized over each projection's whole width: the GEMM stores the projection and the
# partial sums of squares of its q and k columns, the row stage after it applies the row scales
_QKV_PROJ_NORM = """
    zr: {t} = acc{r}{b}
    ssq = sum(mq * (zr * zr), over=2*P)
    ssk = sum(mk * (zr * zr), over=2*P)
  }}
  rq = rsqrt(ssq / NQ + eps)
  rk = rsqrt(ssk / NK + eps)
  elementwise [M, 2*P] {{
    z = zr * (mq * rq + mk * rk + (1.0 - mq - mk)) * gqk
""" + _rope("z")

# Post norms: each branch (the out-projection's `o`, the down-projection's `m`) stored with the
# partial sums of its squares, normalized and added to the residual in a row stage after its GEMM.
# The out-projection and its norm's row scale, and the down-projection's row stage, are the same in
# the bf16 and the fp8 stages below (but for the out-projection in e4m3: `_OUT_FP8`)
_POST_NORM_OUT = """
  gemm {y} @ transpose({w_o}) {{
    o: {t} = acc{o_scale}
    sso = sum(o * o, over=D)
  }}
  ro = rsqrt(sso / D + eps)"""
_POST_NORM_DOWN = """
  rd = rsqrt(ssm / D + eps)
  elementwise [M, D]{down} {{
    x2: {t} = m * rd * {gd}{residual} + x1{then}
  }}"""
_POST_NORM_STAGES = (
    _POST_NORM_OUT
    + """
  elementwise [M, D] {{
    x1: {t} = o * ro * {go}{residual} + x{pre1}
  }}{r1}
  gemm {x1} @ transpose(w_13) {{{z1}
    gt, up = pairs({z})
    a: {t} = {act}(gt) * up
  }}
  gemm a @ transpose(w_2) {{
    m: {t} = acc
    ssm = sum(m * m, over=D)
  }}"""
    + _POST_NORM_DOWN
)

# The same in e4m3 (fp8="delayed"): the out-projection's row stage also quantizes the gate/up GEMM's
# input (`x1n`: the pre-norm's weighted input x1 * g1, or x1 itself without one) at its delayed scale
# and records its amax; the gate/up GEMM quantizes the GLU output for the down GEMM; the inverse
# scales fold into each GEMM's epilogue. The row stages that quantize a GEMM's input (`x1q` here,
# `x2q` in the down projection's: `{down}`) are remat="rebuild": the backward makes the e4m3 copy
# again at its start (from x1 or x2, which it makes again there anyway), where "auto" would store it
# from the epilogue of the GEMM stage that runs the row stage's backward, `dacc @ w_13q` (or
# `@ w_qkvq`), which then spills registers at every fp8 tile (ptxas, sm_90a, 2026-11-28: OLMo 2's and
# Gemma 2's blocks; scripts/fuzz_hf_blocks.py found it)
REBUILD = ', remat="rebuild"'
_POST_NORM_STAGES_FP8 = (
    _POST_NORM_OUT
    + """
  elementwise [M, D], remat="rebuild" {{
    x1: {t} = o * ro * {go}{residual} + x{x1n}
    x1q: e4m3 = {x1v} * s_x1
    amp_x1 = max(abs({x1v}), over=D)
  }}
  am_x1 = detach(max(amp_x1, over=M)){r1}
  i1 = {r1v} / (s_x1 * s_w_13){u_before}
  gemm x1q @ transpose(w_13q) {{
    z1 = acc * i1{u_line}
    gt, up = pairs(z1)
    a = {act}(gt) * up
    aq: e4m3 = a * s_a
    amp_a = max(abs(a), over=F)
  }}{u_after}
  am_a = detach(max(amp_a, over=M))
  ia = 1.0 / (s_a * s_w_2)
  gemm aq @ transpose(w_2q) {{
    m: {t} = acc * ia
    ssm = sum(m * m, over=D)
  }}"""
    + _POST_NORM_DOWN
)

_TEMPLATE = """# generated by coda_lang.hf for one model's shapes ({t}, eps {eps}, head_dim {hd}{notes})
dims M, D, F, K, P, V{fixed}

block first_qkv(h: {t}[M, D]{g}, w_qkv: {t}[2*P, D]{qkb}, pos: f32[M], freq: f32[P]{qkp}{s_first},
                eps: f32 = {eps}) -> (qkv: {t}[M, 2*P]{am_first}) {{{first}
}}

block layer(y: {t}[M, K], x: {t}[M, D], w_o: {t}[D, K]{g_attn}, w_13: {t}[2*F, D],
            w_2: {t}[D, F]{g_mlp}{g2}, w_qkv: {t}[2*P, D]{qkb}, pos: f32[M], freq: f32[P]{qkp}{s_layer},
            eps: f32 = {eps}{rmp}) -> (x2: {t}[M, D], qkv: {t}[M, 2*P]{am_layer}) {{{mlp}{qkv}
}}

block last(y: {t}[M, K], x: {t}[M, D], w_o: {t}[D, K]{g_attn}, w_13: {t}[2*F, D],
           w_2: {t}[D, F]{g_mlp}, g2: f32[D]{s_last}, eps: f32 = {eps}{rmp}) -> (x2g: {t}[M, D], r2: f32[M]{am_last}) {{{mlp_last}
}}

block head_loss(hg: {t}[M, D], r: f32[M], w_lm: {t}[V, D], target: i32[M]{lsp}) -> (loss: f32[M]) {{
  gemm hg @ transpose(w_lm) {{
    logits = {logits}
    lse = logsumexp(logits, over=V)
    tgt = pick(logits, target)
  }}
  loss = where(target >= 0, lse - tgt, 0.0)
}}

block head_loss_rows(hg: {t}[M, D], r: f32[M], w_lm: {t}[V, D], target: i32[M]{lsp}) -> (loss: f32[M]) {{
  gemm hg @ transpose(w_lm) {{
    logits = {logits_rows}
    lse = logsumexp(logits, over=V)
    tgt = pick(logits, target)
  }}
  loss = where(target >= 0, lse - tgt, 0.0)
}}

block head_logits(hg: {t}[M, D], r: f32[M], w_lm: {t}[V, D]{lsp}) -> (logits: {t}[M, V]) {{
  gemm hg @ transpose(w_lm) {{
    logits = {logits}
  }}
}}{head8}
"""

# loss_mode="fp8" (fp8="delayed"): the loss head's GEMM in e4m3, the weight and the final norm's weighted
# input quantized at their delayed scales by a stage each (their amaxes recorded, detached), the inverse
# scales folded with the row scale into the logits; run whole (no chunks), its backward derived with
# e5m2 cotangents: the GEMM run again, its dlogits stored in e5m2 with their K-major copy, the data and
# weight gradients fp8 GEMMs (docs/models.md, "fp8 training")
_HEAD_FP8 = """

block head_loss_fp8(hg: {t}[M, D], r: f32[M], w_lm: {t}[V, D], target: i32[M]{lsp}, s_hg: f32,
                    s_w_lm: f32) -> (loss: f32[M], am_hg: f32, am_w_lm: f32) {{{w_lm}
  elementwise [M, D] {{
    hgq: e4m3 = hg * s_hg
    amp_hg = max(abs(hg), over=D)
  }}
  am_hg = detach(max(amp_hg, over=M))
  ih = 1.0 / (s_hg * s_w_lm)
  gemm hgq @ transpose(w_lmq) {{
    logits = {logits}
    lse = logsumexp(logits, over=V)
    tgt = pick(logits, target)
  }}
  loss = where(target >= 0, lse - tgt, 0.0)
}}"""

# the first layer's input norm: its weighted input and row statistics, in an elementwise stage (no
# GEMM makes the embeddings)
_INPUT_NORM = """
  elementwise [M, D] {{
    ss = sum(h * h, over=D)
    hg: {t} = h * {g}
  }}
  r = rsqrt(ss / D + eps)"""

# fp8="delayed": the same, the weighted input quantized to e4m3 at its delayed scale `s_h` and its
# amax recorded (detached); `i0` folds the row scale and both inverse scales into the QKV epilogue
_INPUT_NORM_FP8 = """
  elementwise [M, D] {{
    ss = sum(h * h, over=D)
    hg = h * {g}
    hq: e4m3 = hg * s_h
    amp_h = max(abs(hg), over=D)
  }}
  am_h = detach(max(amp_h, over=M))
  r = rsqrt(ss / D + eps)
  i0 = r / (s_h * s_w_qkv)"""

# the next norm's weighted input and row statistics of the residual x2 (the next layer's input norm,
# or the final norm), in the stage that makes x2
_THEN = "\n    x2g: {t} = x2 * {g2}\n    ss2 = sum(x2 * x2, over=D)"
# the same in e4m3 (fp8="delayed"), for the next layer's QKV GEMM
_THEN_FP8 = (
    "\n    x2g = cast(x2, {t}) * {g2}\n    x2q: e4m3 = x2g * s_x2\n    amp_x2 = max(abs(x2g), over=D)"
    "\n    ss2 = sum(x2 * x2, over=D)"
)

# the same for a layer without pre norms (OLMo 2): the residual x2 itself quantized for the next QKV GEMM
_THEN_FP8_PLAIN = "\n    x2q: e4m3 = x2 * s_x2\n    amp_x2 = max(abs(x2), over=D)"

# the first layer's QKV input quantized where no norm stage makes it (OLMo 2: the embeddings)
_INPUT_FP8 = """
  elementwise [M, D] {
    hq: e4m3 = h * s_h
    amp_h = max(abs(h), over=D)
  }
  am_h = detach(max(amp_h, over=M))
  i0 = 1.0 / (s_h * s_w_qkv)"""

# the fp8 recipes of a patched model (`fp8=`), both the same program (`model_source`: the gate/up, down
# and QKV GEMMs in e4m3 at per-tensor scales from past steps' amaxes); they differ in the backward:
# "delayed" quantizes the cotangent of each of those GEMMs' accumulators to e5m2 at a delayed
# per-tensor scale of its own (`BackwardOptions(fp8_grads="e5m2")`, hf/fp8.py keeping the scales), so
# that the backward GEMMs multiply fp8 by fp8; "delayed-forward" keeps the cotangents in the model's dtype
# `FP8_GRADS`: each recipe, and the dtype its backward quantizes those cotangents to
# (`BackwardOptions.fp8_grads`)
FP8_GRADS: dict[str, str | None] = {"delayed": "e5m2", "delayed-forward": None, "blockwise": "e5m2"}
FP8_RECIPES = tuple(FP8_GRADS)
# the recipes whose per-tensor scales come from past steps' amaxes (hf/fp8.py's `Bank` keeps them):
# "blockwise" scales each 1 x 128 group and 128 x 128 block by its own current amax, in the block
DELAYED = ("delayed", "delayed-forward")
# whether a patched fp8="delayed" model saves its gate/up accumulators in e4m3 (`model_source`'s
# `fp8_save`): by default; $CODA_FP8_SAVE_ACC=0 saves them in the model's dtype, as before (docs/models.md)
FP8_SAVE_VAR = "CODA_FP8_SAVE_ACC"
# the quantized value of that copy, by its scale's name `s_<name>` (fp8.py's scale names)
FP8_SAVE_SCALE = "u1"


# fp8="blockwise" (DeepSeek-V3's recipe; docs/models.md, "fp8 training"): the input of every gate/up,
# down and QKV GEMM quantized to e4m3 in 1 x 128 groups of its rows, each at its group's current amax
# (`ga_<x>`, detached), by an elementwise stage (`_group_quantized`: a stage of its own, or the row
# stage that makes the input); each of their weights in 128 x 128 blocks at each block's amax
# (`wb_<w>`, three stages at the block's start: `blockwise_weight`). Each GEMM scales its 128-deep
# blocks of K in the mainloop (`scale_a=` the groups' amaxes, `scale_b=` the blocks'), both amaxes
# mapped to 448, so the epilogue multiplies by 1 / 448^2 (`DEQ`). No scale comes from past steps.
# The backward (state.py) is derived with e5m2 cotangents and the weight gradients reading their
# activations quantized again in 128 x 1 groups (`BackwardOptions(requantize_wgrad=True)`). Why a stage
# of its own: a GEMM's epilogue folds a grouped amax of its accumulator only (docs/backend.md,
# "Reductions"), and each of these inputs is a residual sum or a GLU output (E0705 there).
SCALE_GROUP = 128
DEQ = repr(1.0 / 200704.0)  # 1 / (448 * 448): e4m3's largest value, once for each operand


def _group_quantized(v: str, q: str, over: str) -> str:
    """An elementwise stage's lines quantizing its value `v` to e4m3 `{q}q` in 1 x 128 groups along
    `over`, at each group's amax `ga_{q}` (detached: no gradient through a scale)."""
    return (
        f"\n    ga_{q} = detach(max(abs({v}), over={over}, group={SCALE_GROUP}))"
        f"\n    {q}q: e4m3 = {v} * (448.0 / max(ga_{q}, 1e-12))"
    )


def blockwise_weight(name: str, rows: str, cols: str) -> str:
    """Three elementwise stages (.coda text) quantizing the weight `name` ([rows, cols], both multiples of
    128) to e4m3 `{name}q` in 128 x 128 blocks, at each block's amax `wb_{name}` ([rows/128, cols/128]):
    the amax of each 1 x 128 group, its max over runs of 128 rows, the codes."""
    g = SCALE_GROUP
    return (
        f"\n  elementwise [{rows}, {cols}] {{\n    wa_{name} = detach(max(abs({name}), over={cols}, group={g}))\n  }}"
        f"\n  elementwise [{rows}, {cols}/{g}] {{\n    wb_{name} = max(wa_{name}, over={rows}, group={g})\n  }}"
        f"\n  elementwise [{rows}, {cols}] {{"
        f"\n    {name}q: e4m3 = {name} * (448.0 / max(expand(wb_{name}, {name}), 1e-12))\n  }}"
    )


def _block_scaled(x: str, w: str) -> str:
    """The block scales of the GEMM of `{x}q` (quantized by `_group_quantized`) and `{w}q`."""
    return f", scale_a=ga_{x}, scale_b=wb_{w}"


def _mlp_blockwise(
    t: str,
    residual: str,
    pre_norm: bool,
    post_norm: bool,
    then: bool,
    act: str,
    offset: float,
    then_fp8: bool,
) -> str:
    """`_mlp`'s stages in the blockwise recipe: the out-projection in the model's dtype; the gate/up
    input (x1's norm-weighted value, or x1), the GLU output and (`then_fp8`) the next QKV GEMM's input
    each quantized in 1 x 128 groups; the gate/up and down GEMMs on 128 x 128-scaled e4m3 weights.
    `then`: the next norm's weight and row statistics of x2 follow (`x2q`, `r2` with `then_fp8`; else
    `x2g`, `r2` in the model's dtype, the last block's)."""
    g1, g2 = norm_weight("g1", offset), norm_weight("g2", offset)
    x1v = "x1g" if pre_norm else "x1"
    pre1 = f"\n    x1g = cast(x1, {t}) * {g1}" if pre_norm else ""
    stages = blockwise_weight("w_13", "2*F", "D") + blockwise_weight("w_2", "D", "F")
    if post_norm:
        stages += _POST_NORM_OUT.format(t=t, **_OUT_FP8[False])
        stages += f"\n  elementwise [M, D]{REBUILD} {{\n    x1: {t} = o * ro * {norm_weight('go', offset)}{residual} + x"
        stages += (
            pre1 + ("\n    ss1 = sum(x1 * x1, over=D)" if pre_norm else "") + _group_quantized(x1v, "x1", "D")
        )
        stages += "\n  }"
    else:
        stages += (
            f"\n  gemm y @ transpose(w_o) {{\n    x1: {t} = acc{residual} + x\n    ss1 = sum(x1 * x1, over=D)\n  }}"
            f"\n  elementwise [M, D] {{{pre1}{_group_quantized(x1v, 'x1', 'D')}\n  }}"
        )
    r1 = "r1" if pre_norm else "1.0"
    stages += "\n  r1 = rsqrt(ss1 / D + eps)" if pre_norm else ""
    stages += (
        f"\n  i1 = {r1} * {DEQ}"
        f"\n  gemm x1q @ transpose(w_13q){_block_scaled('x1', 'w_13')} {{"
        f"\n    z1 = acc * i1\n    gt, up = pairs(z1)\n    a: {t} = {act}(gt) * up\n  }}"
        f"\n  elementwise [M, F] {{{_group_quantized('a', 'a', 'F')}\n  }}"
        f"\n  gemm aq @ transpose(w_2q){_block_scaled('a', 'w_2')} {{"
    )
    if then_fp8:
        x2v = "x2g" if pre_norm else "x2"
        nxt = f"\n    x2g = cast(x2, {t}) * {g2}\n    ss2 = sum(x2 * x2, over=D)" if pre_norm else ""
        nxt += _group_quantized(x2v, "x2", "D")
    else:
        nxt = _THEN.format(t=t, g2=g2) if then else ""
    if post_norm:
        stages += f"\n    m: {t} = acc * {DEQ}\n    ssm = sum(m * m, over=D)\n  }}"
        # (the row stages that quantize a GEMM's input are remat="rebuild", as the delayed post-norm
        # blocks': the backward makes the e4m3 copy again at its start rather than store it from the
        # epilogue of the data gradient that folds the stage's backward)
        stages += _POST_NORM_DOWN.format(
            t=t, down=REBUILD if then_fp8 else "", residual=residual, gd=norm_weight("gd", offset), then=nxt
        )
    elif then_fp8:
        stages += f"\n    x2: {t} = acc * {DEQ}{residual} + x1\n  }}"
        stages += f"\n  elementwise [M, D] {{{nxt}\n  }}"
    else:
        stages += f"\n    x2: {t} = acc * {DEQ}{residual} + x1{nxt}\n  }}"
    return stages + ("\n  r2 = rsqrt(ss2 / D + eps)" if then else "")


# the out-projection's operand, weight and the inverse scales its epilogue folds, in the model's dtype
# (False) or in e4m3 (True: `fp8_out_projection`'s stages before it)
_OUT_FP8 = {
    False: {"y": "y", "w_o": "w_o", "o_scale": ""},
    True: {"y": "yq", "w_o": "w_oq", "o_scale": " * io"},
}
# $CODA_FP8_OUT, read when a model is patched with fp8="delayed" or "delayed-forward": the layers'
# out-projection in e4m3 too (model_source's `fp8_out`; the default, 1, since its convergence run; 0 keeps
# it in the model's dtype)
FP8_OUT_VAR = "CODA_FP8_OUT"
# the scales a layer's call site has only with the out-projection in e4m3 (its input's and weight's)
FP8_OUT_SCALES = frozenset({"y", "w_o"})


# the MLP's gate activations the blocks run, by the config's name: the .coda op of each (`gelu` is the
# tanh approximation, torch's `gelu(x, approximate="tanh")`)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu"}


def _mlp(
    t: str,
    residual: str,
    pre_norm: bool,
    post_norm: bool,
    then: bool,
    act: str,
    offset: float,
    fp8: bool = False,
    act_fp8: bool = True,
    then_fp8: bool = False,
    save_acc: bool = False,
    out_fp8: bool = False,
) -> str:
    """The layer's stages from the attention output `y` to the residual `x2`: the LLaMA MLP's (x1 and
    g1 its residual and norm; coda_lang.torch's, the one source) or, with `post_norm`, the branches
    normalized before they join the residual (with `pre_norm` too, the MLP's input normalized as
    well); `then`: followed by the next norm's weight and row statistics of x2 (`x2g`, `r2`); `act`
    the gate's .coda op; `offset` the norms' weight offset; `fp8`: the gate/up GEMM (and with
    `act_fp8` the down GEMM) in e4m3 (`llama_mlp_stages_fp8`), `then_fp8` the next norm's weighted
    input quantized for the next QKV GEMM (`x2q`, its amax `am_x2`); `save_acc` (with `fp8`): the
    gate/up GEMM also stores an e4m3 copy of its acc for the backward (`acc_copy_lines`); `out_fp8`
    (with `fp8`): the out-projection in e4m3 too (`fp8_out_projection`)."""
    nxt = (_THEN_FP8 if then_fp8 else _THEN).format(t=t, g2=norm_weight("g2", offset)) if then else ""
    if fp8:
        tail = ""
        if then:
            tail = "\n  am_x2 = detach(max(amp_x2, over=M))" if then_fp8 else ""
            tail += "\n  r2 = rsqrt(ss2 / D + eps)"
        elif then_fp8:  # (no pre norm: the residual itself is the next QKV GEMM's input)
            nxt, tail = _THEN_FP8_PLAIN, "\n  am_x2 = detach(max(amp_x2, over=M))"
        stages = fp8_weight("w_13", "2*F", "D") + (fp8_weight("w_2", "D", "F") if act_fp8 else "")
        stages += fp8_out_projection() if out_fp8 else ""
        if post_norm:
            assert act_fp8, "the post-norm fp8 blocks quantize the GLU output"
            g1 = norm_weight("g1", offset)
            u_before, u_line, u_after = acc_copy_lines("1") if save_acc else ("", "", "")
            stages += _POST_NORM_STAGES_FP8.format(
                **_OUT_FP8[out_fp8],
                t=t,
                u_before=u_before,
                u_line=u_line,
                u_after=u_after,
                residual=residual,
                x1n=f"\n    x1g = x1 * {g1}\n    ss1 = sum(x1 * x1, over=D)" if pre_norm else "",
                x1v="x1g" if pre_norm else "x1",
                r1="\n  r1 = rsqrt(ss1 / D + eps)" if pre_norm else "",
                r1v="r1" if pre_norm else "1.0",
                then=nxt,
                down=REBUILD if then_fp8 else "",
                act=act,
                go=norm_weight("go", offset),
                gd=norm_weight("gd", offset),
            )
        else:
            assert pre_norm, "a layer without norms"
            stages += llama_mlp_stages_fp8(
                t,
                h="x1",
                n="1",
                stored=True,
                then=nxt,
                residual=residual,
                act=act,
                norm_offset=offset,
                act_fp8=act_fp8,
                save_acc=save_acc,
                out_fp8=out_fp8,
            )
        return stages + tail
    if not post_norm:
        assert pre_norm, "a layer without norms"
        stages = llama_mlp_stages(
            t, h="x1", n="1", stored=True, then=nxt, residual=residual, act=act, norm_offset=offset
        )
    else:
        g1 = norm_weight("g1", offset)
        pre1 = f"\n    x1g: {t} = x1 * {g1}\n    ss1 = sum(x1 * x1, over=D)" if pre_norm else ""
        stages = _POST_NORM_STAGES.format(
            **_OUT_FP8[False],
            t=t,
            residual=residual,
            pre1=pre1,
            r1="\n  r1 = rsqrt(ss1 / D + eps)" if pre_norm else "",
            x1="x1g" if pre_norm else "x1",
            z1="\n    z1 = acc * r1" if pre_norm else "",
            z="z1" if pre_norm else "acc",
            then=nxt,
            down="",
            act=act,
            go=norm_weight("go", offset),
            gd=norm_weight("gd", offset),
        )
    return stages + ("\n  r2 = rsqrt(ss2 / D + eps)" if then else "")


def heads_fit_tiles(head_dim: int, fp8: bool = False) -> bool:
    """Whether a kernel tile can hold whole heads of `head_dim` columns (some candidate tile's N a
    multiple of it: backend_cute/build/config.py), so that a per-head reduction completes in the QKV
    GEMM's epilogue; else (Gemma 3's 256) it completes in a row stage after the GEMM. `fp8`: the fp8
    blocks' QKV stage, a paired one, whose epilogue subtile is 32 columns or wider (`PAIRED_SUBTILE`),
    and a group must be whole subtiles: heads narrower than that (16 columns) take the row stage too."""
    if fp8 and head_dim % int(PAIRED_SUBTILE.multiple_of or 1):
        return False
    return any(c.tile_n % head_dim == 0 for c in CANDIDATES)


def _qkv(
    t: str,
    src: str,
    r: str,
    qk_norm: str | None,
    bias: bool,
    offset: float,
    hd: int,
    rows: bool = False,
    w: str = "w_qkv",
    fp8: bool = False,
    scales: str = "",
) -> str:
    """The QKV projection's stage reading `src` (its row scale `r`, or "" for none) through RoPE,
    with the q/k norm `qk_norm` (and, for "proj", heads wider than the kernels' tiles or `rows`, the
    row stage after it); `offset` the norm weights' offset, `hd` the head dim, `w` the weight (its e4m3
    copy `w_qkvq` in fp8 blocks, `fp8` set), `scales` the GEMM's block scales (", scale_a=..,
    scale_b=..": fp8="blockwise")."""
    if qk_norm == "head" and (rows or not heads_fit_tiles(hd, fp8)):
        body = _QKV_NORM_ROWS
    else:
        body = {None: _QKV, "head": _QKV_NORM, "proj": _QKV_PROJ_NORM}[qk_norm]
    scale = f" * {r}" if r else ""
    text = body.format(
        t=t,
        r=scale,
        b=" + b_qkv" if bias else "",
        gq=norm_weight("gq", offset),
        gk=norm_weight("gk", offset),
    )
    return f"\n  gemm {src} @ transpose({w}){scales} {{{text}\n  }}"


def _logits(acc: str, logit_scale: float | None, softcap: float | None) -> str:
    """The LM head's logits from the accumulator expression `acc` and the row scale `r`: divided by
    Granite's logits scaling `ls`, soft-capped by Gemma's `cap` (cap * tanh(z / cap))."""
    z = f"{acc} * r" + ("" if logit_scale is None else " / ls")
    return z if softcap is None else f"cap * tanh({z} / cap)"


def family_source(
    family: Family,
    dtype: str,
    eps: float,
    head_dim: int,
    heads: tuple[int, int],
    multipliers: tuple[float, float, float] | None = None,
    softcap: float | None = None,
    *,
    head_rows: bool = False,
    fp8: str | None = None,
    fp8_save: bool = False,
    fp8_head: bool = False,
    fp8_out: bool = False,
) -> str:
    """`model_source` for a model of `family`: the family's facts (its q/k norm, QKV bias, norms and
    their offset, activation) with the model's own numbers (dtype, eps, head_dim, `heads` (query,
    key/value), Granite's `multipliers`, Gemma's logit `softcap`) and the patch's settings."""
    return model_source(
        dtype,
        eps,
        head_dim,
        family.qk_norm,
        family.qkv_bias,
        multipliers,
        pre_norm=family.pre_norm,
        post_norm=family.post_norm,
        heads=heads,
        norm_offset=family.norm_offset,
        act=family.activation,
        softcap=softcap,
        head_rows=head_rows,
        fp8=fp8,
        fp8_save=fp8_save,
        fp8_head=fp8_head,
        fp8_out=fp8_out,
    )


def model_source(
    dtype: str,
    eps: float,
    head_dim: int,
    qk_norm: bool | str | None,
    qkv_bias: bool = False,
    multipliers: tuple[float, float, float] | None = None,
    *,
    pre_norm: bool = True,
    post_norm: bool = False,
    heads: tuple[int, int] | None = None,
    norm_offset: float = 0.0,
    act: str = "silu",
    softcap: float | None = None,
    head_rows: bool = False,
    fp8: str | None = None,
    fp8_act: bool = True,
    fp8_save: bool = False,
    fp8_head: bool = False,
    fp8_out: bool = False,
) -> str:
    """The program's text for a model of parameter dtype `dtype` (a torch dtype's name); `qk_norm`:
    None (or False), "head" (or True: per head, Qwen3, Gemma 3) or "proj" (over each projection: OLMo
    2, which needs `heads`, the numbers of query and key/value heads); `multipliers`: Granite's
    (embedding, residual, logits), the last two written into the blocks; `pre_norm` / `post_norm`:
    where the layer's norms sit (at least one); `norm_offset`: every norm (q/k norms included) scales
    by (norm_offset + w) (Gemma: 1); `act`: the gate's activation, a key of `ACTIVATIONS`; `softcap`:
    the logits soft-capped at it (Gemma's final_logit_softcapping), written into the heads;
    `head_rows`: a per-head q/k norm in a row stage after the QKV GEMM even where heads fit the
    tiles (the blocks of peft LoRA on q, k or v, whose GEMM adds the adapters' output, a tile the
    backend's grouped reductions don't read yet: hf/lora.py); `fp8`: None (bf16 blocks) or a recipe of
    `FP8_RECIPES` (both write the same program but for `fp8_save`, its header saying "fp8 delayed";
    the recipes differ in the backward's options: every layer's gate/up, down and QKV GEMMs in e4m3, their inputs
    quantized in the epilogue or stage that makes them at delayed per-tensor scales, the weights by a
    stage at the block's start; the out-projection, whose input is the attention's output, and the LM
    head stay in the model's dtype; with post norms the row stage after the out-projection quantizes
    the gate/up input, and without pre norms the residual itself is quantized for the QKV GEMM);
    `fp8_act`: the SwiGLU output quantized in the gate/up epilogue and the down GEMM in e4m3 (else
    both in the model's dtype); `fp8_save` (with fp8="delayed"): the gate/up GEMMs also store an e4m3
    copy of their pre-activations at a delayed scale of its own (`s_u1`, `am_u1`: `FP8_SAVE_SCALE`),
    which the layers' backward, derived with `BackwardOptions(fp8_acc=True)`, reads as their acc
    instead of a bf16 copy (hf/state.py's `fp8_save` decides it for a patched model); `fp8_head` (with
    fp8="delayed"): the program also has `head_loss_fp8`, the loss head with its GEMM in e4m3 (a patched
    model's loss_mode="fp8"); `fp8_out` (with a delayed recipe): the layers' out-projection in e4m3 too,
    its input `y` (the attention's output) quantized by a stage of its own at a delayed scale `s_y`
    (`fp8_out_projection`; $CODA_FP8_OUT, `FP8_OUT_VAR`)."""
    if fp8 is not None and fp8 not in FP8_RECIPES:
        raise ValueError(f"fp8 must be None or one of {', '.join(map(repr, FP8_RECIPES))}, got {fp8!r}")
    if fp8_head and (fp8 is None or FP8_GRADS[fp8] is None):
        raise ValueError(
            f"fp8_head needs fp8 cotangents (fp8='delayed'), got fp8={fp8!r}: the fp8 loss head's backward "
            "multiplies its e5m2 dlogits by the e4m3 weight and input"
        )
    if fp8_save and (fp8 is None or FP8_GRADS[fp8] is None):
        raise ValueError(
            f"fp8_save needs fp8 cotangents (fp8='delayed'), got fp8={fp8!r}: the SwiGLU backward reads "
            "an fp8 copy of the gate/up acc only beside an fp8 cotangent"
        )
    if fp8_out and fp8 not in DELAYED:
        raise ValueError(
            f"fp8_out needs a delayed recipe (fp8='delayed' or 'delayed-forward'), got fp8={fp8!r}"
        )
    if fp8 == "blockwise" and (fp8_head or fp8_save or not fp8_act):
        raise ValueError(
            "fp8='blockwise' quantizes the GLU output (fp8_act=True) and has no fp8 loss head or e4m3 save "
            "of the gate/up acc (fp8_head, fp8_save: fp8='delayed')"
        )
    if fp8 is not None and post_norm and not fp8_act:
        raise ValueError("fp8 blocks of post-norm layers quantize the GLU output (fp8_act=True)")
    kind = ("head" if qk_norm else None) if isinstance(qk_norm, bool) else qk_norm
    if kind not in (None, "head", "proj"):
        raise ValueError(f"qk_norm must be None, 'head' or 'proj', got {qk_norm!r}")
    if not (pre_norm or post_norm):
        raise ValueError("a layer needs pre_norm or post_norm (or both)")
    if kind == "proj" and heads is None:
        raise ValueError("qk_norm='proj' needs heads=(query heads, key/value heads)")
    if act not in ACTIVATIONS:
        raise ValueError(f"act must be one of {', '.join(ACTIVATIONS)}, got {act!r}")
    op = ACTIVATIONS[act]
    residual, logit_scale = (None, None) if multipliers is None else multipliers[1:]
    rm = "" if residual is None else " * rm"
    t = DTYPES[dtype]
    fixed = ""
    if kind == "head":
        fixed = f", HD = {head_dim}"
    elif kind == "proj":
        assert heads is not None
        fixed = f", NQ = {heads[0] * head_dim}, NK = {heads[1] * head_dim}"
    qkp = {
        None: "",
        "head": ", gq: f32[HD], gk: f32[HD], mq: f32[2*P], mk: f32[2*P]",
        "proj": ", gqk: f32[2*P], mq: f32[2*P], mk: f32[2*P]",
    }[kind]
    notes = {None: "", "head": ", per-head q/k norm", "proj": ", q/k norm over each projection"}[kind]
    # (a block-scaled GEMM's tile is 128 x 128: heads that don't divide it take the row stage)
    wide = fp8 == "blockwise" and SCALE_GROUP % head_dim != 0
    rows = kind == "head" and (head_rows or wide or not heads_fit_tiles(head_dim, bool(fp8)))
    notes += " (a row stage)" if rows else ""
    notes += ", QKV bias" if qkv_bias else ""
    notes += ", post norms" if post_norm else ""
    notes += "" if pre_norm else ", no pre norms"
    notes += f", norms of ({float(norm_offset)!r} + w)" if norm_offset else ""
    notes += f", {act}" if act != "silu" else ""
    notes += f", logits soft-capped at {float(softcap)!r}" if softcap is not None else ""
    notes += (  # (both delayed recipes' program, but for the save: they differ in the backward's options)
        ", fp8 blockwise"
        if fp8 == "blockwise"
        else ", fp8 delayed"
        + ("" if fp8_act else " (SwiGLU output and down GEMM in the model's dtype)")
        + (", gate/up acc saved in e4m3" if fp8_save else "")
        + (", out-projection in e4m3" if fp8_out else "")
        if fp8
        else ""
    )
    notes += ", fp8 loss head" if fp8_head else ""
    qkv = functools.partial(_qkv, t, qk_norm=kind, bias=qkv_bias, offset=norm_offset, hd=head_dim, rows=rows)
    blockwise = fp8 == "blockwise"
    if blockwise:
        first = blockwise_weight("w_qkv", "2*P", "D") + "\n  elementwise [M, D] {"
        if pre_norm:
            first += f"\n    ss = sum(h * h, over=D)\n    hg = h * {norm_weight('g', norm_offset)}"
        first += _group_quantized("hg" if pre_norm else "h", "h", "D") + "\n  }"
        first += "\n  r = rsqrt(ss / D + eps)" if pre_norm else ""
        first += f"\n  i0 = {'r' if pre_norm else '1.0'} * {DEQ}"
        first += qkv("hq", "i0", w="w_qkvq", fp8=True, scales=_block_scaled("h", "w_qkv"))
    elif fp8:
        first = fp8_weight("w_qkv", "2*P", "D")
        first += _INPUT_NORM_FP8.format(g=norm_weight("g", norm_offset)) if pre_norm else _INPUT_FP8
        first += qkv("hq", "i0", w="w_qkvq", fp8=True)
    elif pre_norm:
        first = _INPUT_NORM.format(t=t, g=norm_weight("g", norm_offset)) + qkv("hg", "r")
    else:
        first = qkv("h", "")
    mlp = (
        functools.partial(_mlp_blockwise, t, rm, pre_norm, post_norm, act=op, offset=norm_offset)
        if blockwise
        else functools.partial(
            _mlp,
            t,
            rm,
            pre_norm,
            post_norm,
            act=op,
            offset=norm_offset,
            fp8=bool(fp8),
            act_fp8=fp8_act,
            save_acc=fp8_save,
            out_fp8=fp8_out,
        )
    )
    # fp8: each block's delayed scales (inputs) and the amaxes it records (detached outputs)
    mlp8 = ["x1", "w_13"] + ([FP8_SAVE_SCALE] if fp8_save else []) + (["a", "w_2"] if fp8_act else [])
    mlp8 = (["y", "w_o"] if fp8_out else []) + mlp8
    f8 = {"first": ["h", "w_qkv"], "layer": [*mlp8, "x2", "w_qkv"], "last": mlp8} if fp8 in DELAYED else {}

    def scales(block: str) -> str:
        return "".join(f", s_{v}: f32" for v in f8.get(block, ()))

    def amaxes(block: str) -> str:
        return "".join(f", am_{v}: f32" for v in f8.get(block, ()))

    if blockwise:
        layer_qkv = blockwise_weight("w_qkv", "2*P", "D") + f"\n  i2 = {'r2' if pre_norm else '1.0'} * {DEQ}"
        layer_qkv += qkv("x2q", "i2", w="w_qkvq", fp8=True, scales=_block_scaled("x2", "w_qkv"))
    elif fp8:
        r2 = "r2" if pre_norm else "1.0"
        layer_qkv = fp8_weight("w_qkv", "2*P", "D") + f"\n  i2 = {r2} / (s_x2 * s_w_qkv)"
        layer_qkv += qkv("x2q", "i2", w="w_qkvq", fp8=True)
    else:
        layer_qkv = qkv("x2g" if pre_norm else "x2", "r2" if pre_norm else "")
    head_params = "" if logit_scale is None else f", ls: f32 = {float(logit_scale)!r}"
    head_params += "" if softcap is None else f", cap: f32 = {float(softcap)!r}"
    return _TEMPLATE.format(
        t=t,
        eps=repr(float(eps)),
        hd=head_dim,
        notes=notes,
        fixed=fixed,
        g=", g: f32[D]" if pre_norm else "",
        qkb=", b_qkv: f32[2*P]" if qkv_bias else "",
        qkp=qkp,
        first=first,
        g_attn=(", go: f32[D]" if post_norm else "") + (", g1: f32[D]" if pre_norm else ""),
        g_mlp=", gd: f32[D]" if post_norm else "",
        g2=", g2: f32[D]" if pre_norm else "",
        mlp=mlp(then=pre_norm, then_fp8=bool(fp8)),
        qkv=layer_qkv,
        s_first=scales("first"),
        am_first=amaxes("first"),
        s_layer=scales("layer"),
        am_layer=amaxes("layer"),
        s_last=scales("last"),
        am_last=amaxes("last"),
        mlp_last=mlp(then=True, then_fp8=False),
        rmp="" if residual is None else f", rm: f32 = {float(residual)!r}",
        lsp=head_params,
        logits=_logits("acc", logit_scale, softcap),
        logits_rows=_logits(f"cast(acc, {t})", logit_scale, softcap),
        head8=_HEAD_FP8.format(
            t=t,
            lsp=head_params,
            w_lm=fp8_weight("w_lm", "V", "D"),
            logits=_logits("acc * ih", logit_scale, softcap),
        )
        if fp8_head
        else "",
    )
