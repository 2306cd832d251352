"""coda_lang.hf with fp8="delayed" and fp8="delayed-forward": a patched tiny LLaMA against an independent
torch reference of each recipe (fake quantization to e4m3 at the scales the model ran at, straight-through
gradients, float64 elsewhere; for "delayed" also each quantized GEMM's accumulator's cotangent quantized
to e5m2 at the scales its backward ran at), the delayed-scaling rule across steps (the forward's scales
and the cotangents'), activation checkpointing's recomputation at the first run's scales, and the
refusals (LoRA adapters, a bad recipe name).

On the CPU the blocks run as the kernels' torch stand-ins; the same tests run on a Hopper GPU with the
CuTeDSL kernels (`-m gpu`, where the model is on CUDA).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import FAMILIES as HF  # noqa: E402
from test_hf import SHAPES as HF_SHAPES  # noqa: E402
from test_hf import batch as hf_batch  # noqa: E402
from test_hf import make  # noqa: E402

from coda_lang.hf import apply_coda, apply_coda_to_llama, unfused_grads, unpatch  # noqa: E402
from coda_lang.hf.fp8 import HISTORY  # noqa: E402

E4M3_MAX = 448.0
E5M2_MAX = 57344.0
RECIPES = ("delayed", "delayed-forward")  # (e5m2 cotangents, and the model's dtype's)
SHAPES = {**HF_SHAPES, "num_hidden_layers": 3}  # (test_hf's tiny model, one layer more)


def tiny(dtype: torch.dtype = torch.float32, seed: int = 0, **extra) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**SHAPES, **extra})
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    # norm weights away from 1, so that the reference must apply them where the blocks do
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return model


def two_steps(model: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Two forward and backward passes of `model` on one batch, its gradients zeroed before each (the
    second runs at delayed scales, not at the first step's calibrated ones): the second's loss."""
    for _ in range(2):
        model.zero_grad()
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
    return loss


class GradQuant(torch.autograd.Function):
    """The straight-through quantizer of a cotangent ("delayed"'s e5m2 cotangents): the identity
    forward, and a backward that returns q(g * s) / s, q saturating to +-57344 and rounding to
    torch's float8_e5m2 (nearest even): what the derived backward stores for a GEMM's acc (`fmt` "e4m3":
    to +-448 and float8_e4m3fn)."""

    @staticmethod
    def forward(ctx, v: torch.Tensor, s: torch.Tensor, fmt: str = "e5m2") -> torch.Tensor:
        ctx.s, ctx.fmt = s, fmt
        return v.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        s = ctx.s.to(g.dtype)
        top, dt = (E5M2_MAX, torch.float8_e5m2) if ctx.fmt == "e5m2" else (E4M3_MAX, torch.float8_e4m3fn)
        q = (g * s).clamp(-top, top).to(dt).to(g.dtype)
        return q / s, None, None


class SavedSwiGLU(torch.autograd.Function):
    """silu(acc_g * i) * (acc_u * i) (the gate/up stage: acc scaled by the row vector i, SwiGLU), exact
    forward; its backward evaluates that VJP at the accumulators as the fp8_save blocks keep them for
    it, q(acc * c) / c with c = i * s (the pre-activations acc * i quantized at the scale s) and q
    e4m3 (saturating, nearest even), and i as it is."""

    @staticmethod
    def forward(
        ctx, acc_g: torch.Tensor, acc_u: torch.Tensor, i: torch.Tensor, s: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(*SavedSwiGLU.quantized(acc_g, acc_u, i * s), i)
        return SavedSwiGLU.f(acc_g, acc_u, i)

    @staticmethod
    def quantized(*accs_and_s: torch.Tensor) -> list[torch.Tensor]:
        """Each acc as the blocks save it: q(acc * c) / c (the last argument c)."""
        *accs, s = accs_and_s
        return [
            (a * s).clamp(-E4M3_MAX, E4M3_MAX).float().to(torch.float8_e4m3fn).to(a.dtype) / s for a in accs
        ]

    @staticmethod
    def f(acc_g: torch.Tensor, acc_u: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(acc_g * i) * (acc_u * i)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        with torch.enable_grad():
            ins = [t.detach().requires_grad_(True) for t in ctx.saved_tensors]
            grads = torch.autograd.grad(SavedSwiGLU.f(*ins), ins, g)
        return (*grads, None)


def fake_quant(v: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """v quantized to e4m3 at scale s and back (v * s, saturated to +-448, rounded to nearest even, / s),
    its gradient straight through: the recipe's math, written with torch's own float8 type."""
    scaled = (v * s).float()
    q = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(v.dtype)
    return (v * s + (q - v * s).detach()) / s


def bank(model):
    return model._coda.fp8_bank


def ran_at(model) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The scales the last forward ran at: the first block's, and each decoder layer's block's."""
    last = bank(model).last
    return last[-1], [last[i] for i in range(len(model.model.layers))]


def site_fn(model, site: int):
    """The block function of call site `site` (-1 the first block, i decoder layer i's)."""
    st = model._coda
    if site < 0:
        return st.first
    return st.last if site == len(model.model.layers) - 1 else st.layer


def grads_ran_at(model) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """The e5m2 cotangent scales the last backward ran at (`DelayedScaling.last_scales`), by the weight
    of the GEMM whose accumulator's cotangent each scales: `dacc<k>_scale` is stage k of the forward
    block (1-based among its stages), whose B operand is the e4m3 copy `<weight>q` of a weight. The
    first block's, and each decoder layer's block's."""
    from coda_lang.ir.nodes import Stage

    grads = bank(model).grads
    out: dict[int, dict[str, torch.Tensor]] = {}
    for site, state in grads.items():
        stages = [s for s in site_fn(model, site).block.ir.body if isinstance(s, Stage)]
        by_weight = {}
        for name, scale in state.last_scales.items():
            k = int(name.removeprefix("dacc").removesuffix("_scale"))
            b = stages[k - 1].b.name
            assert b in ("w_qkvq", "w_13q", "w_2q", "w_oq"), (site, name, b)
            by_weight[b.removesuffix("q")] = scale
        out[site] = by_weight
    return out[-1], [out[i] for i in range(len(model.model.layers))]


def reference_loss(ref, ids, labels, first, layers, grads=None, saved=None, head=None) -> torch.Tensor:
    """The fp8 recipe on the unpatched float64 model `ref`: each layer's q/k/v, gate/up and down GEMMs on
    e4m3 fake-quantized inputs (the norm's weighted input x * g, before the row scale, as the blocks
    quantize it; the SwiGLU output) and weights (q, k and v at one scale, gate and up at one), at
    the scales the patched model ran at; the LM head, and the out-projection but where the layers'
    scales have the attention output's (`y`: $CODA_FP8_OUT=1), unquantized. Each GEMM is
    the product of the quantized values in scaled units (the blocks' acc) divided by both scales.
    `grads` ("delayed": (first block's, [each layer's]) cotangent scales by weight, `grads_ran_at`):
    each such acc passes a `GradQuant` at its call site's scale (q, k and v one acc, gate and up one).
    `saved` (the fp8_save blocks: each layer's scales, `ran_at`'s): the SwiGLU's backward reads the
    gate/up acc quantized to e4m3 at the layer's scale `u1` (`SavedSwiGLU`). `head` (loss_mode="fp8": the
    head's scales by name, `hg` and `w_lm`, its cotangent scale `g` and dtype `fmt`): the LM head's GEMM on e4m3
    fake-quantized inputs too (the final norm's weighted input, before the row scale), its acc through
    a `GradQuant` at `g`."""
    m = ref.model
    n_layers = len(m.layers)
    b, s = ids.shape
    x = m.embed_tokens(ids)
    pos = torch.arange(s, device=ids.device)[None].expand(b, s)
    cos, sin = m.rotary_emb(x, pos)
    mask = torch.full((s, s), float("-inf"), dtype=x.dtype, device=ids.device).triu(1)[None, None]
    eps = ref.config.rms_norm_eps

    def r(v: torch.Tensor) -> torch.Tensor:
        return torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)

    def qacc(v, w, sv, sw, sg=None, fmt="e5m2") -> torch.Tensor:
        acc = (fake_quant(v, sv) * sv) @ (fake_quant(w, sw) * sw).T
        return acc if sg is None else GradQuant.apply(acc, sg, fmt)

    def qlin(v, w, sv, sw, sg=None, fmt="e5m2") -> torch.Tensor:
        return qacc(v, w, sv, sw, sg, fmt) / (sv * sw)

    def grad_scale(site: dict[str, torch.Tensor] | None, w: str) -> torch.Tensor | None:
        return None if site is None else site[w]

    for i, layer in enumerate(m.layers):
        attn, mlp = layer.self_attn, layer.mlp
        sc_in = first if i == 0 else layers[i - 1]
        g_in = None if grads is None else grads[0] if i == 0 else grads[1][i - 1]
        s_h = sc_in["h"] if i == 0 else sc_in["x2"]
        hg = x * layer.input_layernorm.weight
        rr = r(x)
        sg = grad_scale(g_in, "w_qkv")
        q = qlin(hg, attn.q_proj.weight, s_h, sc_in["w_qkv"], sg) * rr
        k = qlin(hg, attn.k_proj.weight, s_h, sc_in["w_qkv"], sg) * rr
        v = qlin(hg, attn.v_proj.weight, s_h, sc_in["w_qkv"], sg) * rr
        hd = attn.head_dim
        q = q.view(b, s, -1, hd).transpose(1, 2)
        k = k.view(b, s, -1, hd).transpose(1, 2)
        v = v.view(b, s, -1, hd).transpose(1, 2)
        q, k = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = torch.softmax(q @ k.transpose(-1, -2) * attn.scaling + mask, -1) @ v
        y = att.transpose(1, 2).reshape(b, s, -1)
        sc = layers[i]
        g_here = None if grads is None else grads[1][i]
        if "y" in sc:  # ($CODA_FP8_OUT=1: the out-projection in e4m3 too, its input the attention's output)
            x1 = x + qlin(y, attn.o_proj.weight, sc["y"], sc["w_o"], grad_scale(g_here, "w_o"))
        else:
            x1 = x + y @ attn.o_proj.weight.T
        x1g = x1 * layer.post_attention_layernorm.weight
        r1 = r(x1)
        sg = grad_scale(g_here, "w_13")
        a_again = None  # (the SwiGLU output as the backward computes it again, where it differs)
        if saved is not None:
            acc_g = qacc(x1g, mlp.gate_proj.weight, sc["x1"], sc["w_13"], sg)
            acc_u = qacc(x1g, mlp.up_proj.weight, sc["x1"], sc["w_13"], sg)
            i1 = r1 / (sc["x1"] * sc["w_13"])
            a = SavedSwiGLU.apply(acc_g, acc_u, i1, saved[i]["u1"])
            a_again = SavedSwiGLU.f(*SavedSwiGLU.quantized(acc_g, acc_u, i1 * saved[i]["u1"]), i1).detach()
        else:
            gate = qlin(x1g, mlp.gate_proj.weight, sc["x1"], sc["w_13"], sg) * r1
            up = qlin(x1g, mlp.up_proj.weight, sc["x1"], sc["w_13"], sg) * r1
            a = torch.nn.functional.silu(gate) * up
        if "a" in sc and a_again is not None:
            # the down GEMM's weight gradient multiplies its cotangent by its input made again in the
            # backward from the saved e4m3 acc (the blocks keep no copy of it), its data gradient as usual
            s_a, s_w2 = sc["a"], sc["w_2"]
            xq, xb = fake_quant(a, s_a) * s_a, (fake_quant(a_again, s_a) * s_a).detach()
            wq = fake_quant(mlp.down_proj.weight, s_w2) * s_w2
            acc = xb @ wq.T + xq @ wq.T.detach() - (xb @ wq.T).detach()
            sg2 = grad_scale(g_here, "w_2")
            down = (acc if sg2 is None else GradQuant.apply(acc, sg2)) / (s_a * s_w2)
        elif "a" in sc:
            down = qlin(a, mlp.down_proj.weight, sc["a"], sc["w_2"], grad_scale(g_here, "w_2"))
        else:
            down = a @ mlp.down_proj.weight.T
        x = x1 + down
        assert i < n_layers
    if head is None:
        logits = (x * m.norm.weight * r(x)) @ ref.lm_head.weight.T
    else:
        hq = qlin(x * m.norm.weight, ref.lm_head.weight, head["hg"], head["w_lm"], head["g"], head["fmt"])
        logits = hq * r(x)
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parametrize("out", ["0", "1"])
def test_fp8_model_against_a_fake_quant_reference(out: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8="delayed-forward", float32 model: the loss and every parameter's gradient against the float64
    reference of the same recipe at the same scales (close: only e4m3 codes at a rounding midpoint can
    differ), and much further from the same model unquantized (the quantization is really there).
    With $CODA_FP8_OUT=1 the out-projection is quantized too, and so is the reference's."""
    monkeypatch.setenv("CODA_FP8_OUT", out)
    base = tiny()
    ids, labels = hf_batch()
    ref = copy.deepcopy(base).double()
    plain = copy.deepcopy(base).double()
    model = apply_coda_to_llama(copy.deepcopy(base), fp8="delayed-forward")
    loss = two_steps(model, ids, labels)
    assert bank(model).grads == {}  # (no fp8 cotangents: no grad states)
    first, layers = ran_at(model)
    assert set(first) == {"h", "w_qkv"}
    assert set(layers[0]) >= {"x1", "w_13", "x2", "w_qkv"} and "x2" not in layers[-1]
    assert all(("y" in s and "w_o" in s) == (out == "1") for s in layers)
    want = reference_loss(ref, ids, labels, first, layers)
    want.backward()
    unq = plain(input_ids=ids, labels=labels).loss
    unq.backward()
    err, off = abs(loss.item() - want.item()), abs(unq.item() - want.item())
    assert err < 1e-5 * abs(want.item()), (loss.item(), want.item())
    assert off > 5 * err, (err, off)
    got = unfused_grads(model)
    refs = dict(ref.named_parameters())
    plains = dict(plain.named_parameters())
    for name, g in got.items():
        w, p = refs[name].grad, plains[name].grad
        e, o = _rel(g, w), _rel(p, w)
        assert e < 1e-2, (name, e)
        assert o > 5 * e, (name, e, o)  # the unquantized model's gradient is much further off
    assert len(got) == len(refs)


# the parameters whose gradient no quantized cotangent reaches: the LM head's and the final norm's
# (the loss head is in the model's dtype, and the last block's GEMMs are upstream of the final norm)
AFTER_THE_LAST_GEMM = {"lm_head.weight", "model.norm.weight"}


@pytest.mark.parametrize("out", ["0", "1"])
def test_fp8_grads_against_a_fake_quant_reference(out: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8="delayed" with the gate/up acc saved in the model's dtype ($CODA_FP8_SAVE_ACC=0: the e5m2
    cotangents alone; the e4m3 save, the default, is tests/test_fp8_save.py's), float32 model, second step (delayed cotangent scales, not the calibrated ones):
    the loss and every gradient against the float64 reference of the recipe with one more straight-
    through quantizer on each quantized GEMM's accumulator (identity forward, q(g * s) / s to e5m2 in
    the backward) at the scales the model's backward ran at, within the forward recipe's tolerances;
    and the "delayed-forward" model's gradients (the same forward, bf16 cotangents) much further from
    it, but for the two parameters no quantized cotangent reaches (the cotangent quantization is
    really there, and only there). With $CODA_FP8_OUT=1 the out-projection's GEMM too."""
    monkeypatch.setenv("CODA_FP8_SAVE_ACC", "0")
    monkeypatch.setenv("CODA_FP8_OUT", out)
    base = tiny()
    ids, labels = hf_batch()
    models, losses = {}, {}
    for recipe in RECIPES:
        m = models[recipe] = apply_coda_to_llama(copy.deepcopy(base), fp8=recipe)
        loss = two_steps(m, ids, labels)
        losses[recipe] = loss
    model = models["delayed"]
    first, layers = ran_at(model)
    fwd_first, fwd_layers = ran_at(models["delayed-forward"])
    # (the same forward: the same scales, the same loss)
    for a, b in zip([first, *layers], [fwd_first, *fwd_layers], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses["delayed"].item() == losses["delayed-forward"].item()
    g_first, g_layers = grads_ran_at(model)
    assert set(g_first) == {"w_qkv"}
    o = {"w_o"} if out == "1" else set()
    assert [set(g) for g in g_layers] == [{"w_13", "w_2", "w_qkv"} | o] * 2 + [{"w_13", "w_2"} | o]
    for site, state in bank(model).grads.items():
        assert state.steps == 2 and state.dtype == "e5m2", site
        for n, sc in state.last_scales.items():  # (the second step's: the first step's amaxes' rule)
            assert float(sc) not in (0.0, 1.0) and math.isfinite(float(sc)), (site, n)
    ref = copy.deepcopy(base).double()
    want = reference_loss(ref, ids, labels, first, layers, (g_first, g_layers))
    want.backward()
    loss = losses["delayed"]
    assert abs(loss.item() - want.item()) < 1e-5 * abs(want.item()), (loss.item(), want.item())
    got, fwd = unfused_grads(model), unfused_grads(models["delayed-forward"])
    refs = dict(ref.named_parameters())
    assert set(got) == set(refs) == set(fwd)
    for name, g in got.items():
        w = refs[name].grad
        e, o = _rel(g, w), _rel(fwd[name], w)
        assert e < 1e-2, (name, e)
        if name in AFTER_THE_LAST_GEMM:
            assert o < 1e-2, (name, e, o)
        else:  # the bf16-cotangent model's gradient is much further off
            assert o > 5 * e and o > 1e-3, (name, e, o)


@pytest.mark.parametrize("recipe", RECIPES)
def test_delayed_scales_follow_the_amax_history(recipe: str) -> None:
    """Each step's scales are 448 / the max of the amaxes recorded so far (at most HISTORY of them); the
    first step runs at scales calibrated from its own amaxes (never at 1). "delayed": each call site's
    cotangent scales too, 57344 / the max of its backwards' amaxes (at most HISTORY), the first
    backward's calibrated from its own amaxes (never at 1)."""
    model = apply_coda_to_llama(tiny(), fp8=recipe)
    history: dict[tuple[int, str], list[float]] = {}
    grad_history: dict[tuple[int, str], list[float]] = {}
    steps = HISTORY + 3  # (past the history's length: the ring drops the oldest)
    for step in range(steps):
        ids, labels = hf_batch(seed=10 + step, s=8 + step)
        model(input_ids=ids, labels=labels).loss.backward()
        b = bank(model)
        for site, amaxes in b.amaxes.items():
            for n, a in amaxes.items():
                history.setdefault((site, n), []).append(float(a))
        for site, scales in b.last.items():
            for n, s in scales.items():
                if step == 0:
                    assert float(s) != 1.0, (site, n)
                else:
                    # (the scale this step ran at: from the amaxes of the HISTORY steps before it)
                    want = E4M3_MAX / max(history[site, n][-HISTORY - 1 : -1])
                    assert math.isclose(float(s), want, rel_tol=1e-6), (step, site, n, float(s), want)
        for site, state in b.grads.items():
            assert state.steps == step + 1, (site, state.steps)
            for n, a in state.amaxes.items():
                grad_history.setdefault((site, n), []).append(float(a))
            for n, s in state.last_scales.items():
                if step == 0:  # (calibrated: the rule applied to this backward's own amaxes)
                    want = E5M2_MAX / grad_history[site, n][-1]
                    assert float(s) != 1.0, (site, n)
                else:
                    want = E5M2_MAX / max(grad_history[site, n][-HISTORY - 1 : -1])
                assert math.isclose(float(s), want, rel_tol=1e-6), (step, site, n, float(s), want)
    # (the first block's 2 scales, each layer block's 6 (4 without the SwiGLU output's) and the next
    # QKV's 2; "delayed" also each gate/up acc's copy, one per decoder layer; with the out-projection in
    # e4m3, the default, its input's and weight's, 2 per decoder layer)
    saved = 3 if recipe == "delayed" else 0
    out = 2 if model._coda.fp8_out else 0
    assert model._coda.fp8_out  # (the default with either delayed recipe)
    assert bank(model).steps == steps and len(history) == (6 + out) * 2 + (4 + out) + 2 + saved
    # "delayed": the first block's QKV, each layer boundary's gate/up, down and QKV, the last's gate/up
    # and down, and the out-projection's of each decoder layer (in e4m3); "delayed-forward": none
    want = 1 + 3 * 2 + 2 + 3 if recipe == "delayed" else 0
    assert len(grad_history) == want, sorted(grad_history)


def test_weight_amax_is_the_weights() -> None:
    """The recorded weight amaxes are the weights' own (the fused gate/up weight's, the next layer's QKV
    weight's)."""
    base = tiny()
    model = apply_coda_to_llama(copy.deepcopy(base), fp8="delayed")
    ids, labels = hf_batch()
    model(input_ids=ids, labels=labels).loss.backward()
    st = bank(model).amaxes[0]
    mlp, nxt = base.model.layers[0].mlp, base.model.layers[1].self_attn
    w13 = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).abs().max()
    wqkv = torch.cat([nxt.q_proj.weight, nxt.k_proj.weight, nxt.v_proj.weight]).abs().max()
    assert float(st["w_13"]) == w13.item()
    assert float(st["w_qkv"]) == wqkv.item()
    assert float(st["w_2"]) == mlp.down_proj.weight.abs().max().item()


@pytest.mark.parametrize(
    ("recipe", "reentrant"), [("delayed", False), ("delayed", True), ("delayed-forward", False)]
)
def test_checkpointing_recomputes_at_the_first_runs_scales(recipe: str, reentrant: bool) -> None:
    """Under activation checkpointing a layer's forward runs twice a step; the second run uses the scales
    of the first and records nothing: the gradients equal those without checkpointing. "delayed": the
    backward (of the recomputation's graph under reentrant checkpointing) runs at the call site's
    cotangent scales and records once a step, as without checkpointing."""
    base = tiny()
    ids, labels = hf_batch()
    plain = apply_coda_to_llama(copy.deepcopy(base), fp8=recipe)
    ckpt = copy.deepcopy(base)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ckpt.train()
    apply_coda_to_llama(ckpt, fp8=recipe)
    plain.train()
    for _ in range(2):
        for m in (plain, ckpt):
            m.zero_grad()
            m(input_ids=ids, labels=labels).loss.backward()
    g1, g2 = unfused_grads(plain), unfused_grads(ckpt)
    for k in g1:
        assert torch.equal(g1[k], g2[k]), k
    assert bank(ckpt).steps == 2
    grads, plain_grads = bank(ckpt).grads, bank(plain).grads
    assert set(grads) == set(plain_grads) == (set(range(-1, 3)) if recipe == "delayed" else set())
    for site, state in grads.items():
        assert state.steps == 2, (site, state.steps)
        for n, sc in state.scales.items():
            assert torch.equal(sc, plain_grads[site].scales[n]), (site, n)


@pytest.mark.parametrize("recipe", RECIPES)
def test_bf16_fp8_model_trains(recipe: str) -> None:
    """bf16: 8 AdamW steps on one batch lower the loss as the bf16 patched model's do (within 5%)."""
    base = tiny(torch.bfloat16)
    ids, labels = hf_batch()
    out = []
    for fp8 in (None, recipe):
        m = apply_coda_to_llama(copy.deepcopy(base), fp8=fp8)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        for _ in range(8):
            opt.zero_grad()
            loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
        out.append(float(m(input_ids=ids, labels=labels).loss))
    first = float(tiny(torch.bfloat16)(input_ids=ids, labels=labels).loss)
    assert out[0] < 0.9 * first and out[1] < 0.9 * first, (first, out)
    assert abs(out[1] - out[0]) < 0.05 * out[0], out


def test_refusals() -> None:
    takes = "it takes None \\(bf16 blocks\\) or 'delayed' or 'delayed-forward' or 'blockwise'"
    with pytest.raises(ValueError, match=f"fp8= is 'rowwise'; {takes}"):
        apply_coda_to_llama(tiny(), fp8="rowwise")
    with pytest.raises(TypeError, match=f"fp8= is True; {takes}"):
        apply_coda(tiny(), fp8=True)
    model = tiny()
    with pytest.raises(ValueError, match="fp8= is 'e4m3'"):
        apply_coda_to_llama(model, fp8="e4m3")
    assert getattr(model, "_coda", None) is None  # nothing patched
    with pytest.raises(ValueError, match="rowwise'; .*not block-local"):
        apply_coda_to_llama(model, fp8="rowwise")
    with pytest.raises(ValueError, match="tensorwise'; .*current amax"):
        apply_coda_to_llama(model, fp8="tensorwise")
    with pytest.raises(ValueError, match="fp8='blockwise' .*hidden_size is 64, not a multiple of 128"):
        apply_coda(model, fp8="blockwise")  # (tests/test_hf_fp8_blockwise.py trains it at wider shapes)
    assert getattr(model, "_coda", None) is None


@pytest.mark.parametrize("recipe", RECIPES)
def test_lora_on_an_fp8_model_is_refused_not_skipped(recipe: str) -> None:
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj"], lora_dropout=0.0)
    model = apply_coda_to_llama(peft.get_peft_model(tiny(), cfg), fp8=recipe)
    ids, labels = hf_batch()
    with pytest.raises(ValueError, match="LoRA adapters on w_13.*no adapter path"):
        model(input_ids=ids, labels=labels)
    with torch.no_grad(), pytest.raises(ValueError, match="LoRA adapters on w_13.*no adapter path"):
        model(input_ids=ids, labels=labels)  # (refused before anything runs, with or without grad)
    assert 0 not in bank(model.get_base_model()).sites


@pytest.mark.parametrize("recipe", RECIPES)
def test_unpatch_forgets_the_scales(recipe: str) -> None:
    """Unpatching drops the scales with the patch, the cotangents' too; patching again calibrates
    again (the forward's at the first forward, the cotangents' at the first backward)."""
    base = tiny()
    ids, labels = hf_batch()
    model = apply_coda_to_llama(copy.deepcopy(base), fp8=recipe)
    loss = model(input_ids=ids, labels=labels).loss
    first = loss.item()
    loss.backward()
    calibrated = {site: dict(state.last_scales) for site, state in bank(model).grads.items()}
    model.zero_grad()
    model(input_ids=ids, labels=labels).loss.backward()
    if recipe == "delayed":
        assert len(calibrated) == 4 and all(st.steps == 2 for st in bank(model).grads.values())
    unpatch(model)
    assert getattr(model, "_coda", None) is None
    apply_coda_to_llama(model, fp8=recipe)
    assert bank(model).steps == 0 and bank(model).grads == {}
    loss = model(input_ids=ids, labels=labels).loss
    assert loss.item() == first
    loss.backward()
    again = bank(model).grads
    assert set(again) == set(calibrated)
    for site, state in again.items():
        assert state.steps == 1, site
        for n, sc in state.last_scales.items():
            assert torch.equal(sc, calibrated[site][n]), (site, n)


def test_fp8_model_without_grad() -> None:
    """fp8="delayed" under torch.no_grad (evaluation): the blocks run and record the forward's amaxes,
    the cotangents' states stay untouched (no backward), and training afterwards calibrates them at
    its first backward; the loss is the "delayed-forward" model's, whose forward is the same."""
    base = tiny()
    ids, labels = hf_batch()
    model = apply_coda_to_llama(copy.deepcopy(base), fp8="delayed")
    fwd = apply_coda_to_llama(copy.deepcopy(base), fp8="delayed-forward")
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=ids, labels=labels).loss
        logits = model(input_ids=ids).logits
    assert torch.isfinite(loss) and torch.isfinite(logits).all()
    assert bank(model).steps == 2
    assert set(bank(model).grads) == set(range(-1, 3))
    assert all(st.steps == 0 and not st.scales for st in bank(model).grads.values())
    model.train()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    assert all(st.steps == 1 for st in bank(model).grads.values())
    with torch.no_grad():
        fwd(input_ids=ids, labels=labels)
        fwd(input_ids=ids)
    assert fwd(input_ids=ids, labels=labels).loss.item() == loss.item()


def test_a_block_run_outside_the_forward_has_no_grad_scales() -> None:
    """The "delayed" block functions serve every call site, each passing its own cotangent scales: a
    block called directly (no call site) runs its forward, but its backward raises, naming what to do,
    rather than run at scales shared between layers."""
    model = apply_coda_to_llama(tiny(), fp8="delayed")
    st = model._coda
    first = model.model.coda_first
    h = torch.randn(8, SHAPES["hidden_size"], requires_grad=True)
    inputs = dict(
        h=h,
        g=first.input_layernorm.weight,
        w_qkv=first.self_attn.qkv_weight,
        pos=torch.arange(8.0),
        freq=st.freq(model, h.device),
        s_h=torch.tensor(1.0),
        s_w_qkv=torch.tensor(1.0),
    )
    out = st.first(**inputs)
    with pytest.raises(RuntimeError, match="first_qkv .*ran without its call site's delayed scales"):
        out["qkv"].sum().backward()


def _bf16_against_reference(device: str) -> tuple[float, float, dict[str, tuple[float, float]]]:
    """A bf16 model patched with fp8="delayed-forward" on `device` (on a Hopper GPU: the kernels) against
    the float64 reference of the recipe at the scales it ran at: (loss error, the unquantized model's
    loss error, {parameter: (gradient error, the unquantized model's gradient error)}), relative.
    (Not "delayed": its e5m2 cotangents round the bf16 model's cotangents, a few percent off the
    float64 ones, to codes 25% apart, so the two land on different codes often enough that the
    reference is no sharper than the unquantized model; test_fp8_grads_against_a_fake_quant_reference
    checks it in float32.)"""
    shapes = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64, vocab_size=512)
    base = tiny(torch.bfloat16, num_hidden_layers=2, **shapes)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 512, (2, 128), generator=g).to(device)
    labels = ids.clone()
    ref = copy.deepcopy(base).double().to(device)
    plain = copy.deepcopy(base).double().to(device)
    model = apply_coda_to_llama(copy.deepcopy(base).to(device), fp8="delayed-forward")
    loss = two_steps(model, ids, labels)
    first, layers = ran_at(model)
    want = reference_loss(ref, ids, labels, first, layers)
    want.backward()
    unq = plain(input_ids=ids, labels=labels).loss
    unq.backward()
    w = want.item()
    grads = {}
    refs, plains = dict(ref.named_parameters()), dict(plain.named_parameters())
    for name, gr in unfused_grads(model).items():
        grads[name] = (_rel(gr, refs[name].grad), _rel(plains[name].grad, refs[name].grad))
    return abs(loss.item() - w) / abs(w), abs(unq.item() - w) / abs(w), grads


def _check_bf16(device: str) -> None:
    err, off, grads = _bf16_against_reference(device)
    assert err < 2e-3, (err, off)
    for name, (e, o) in grads.items():
        assert e < 0.1, (name, e, o)
    # the quantization shows: the unquantized model's gradients are further from the recipe's than ours
    mean_e = sum(e for e, _ in grads.values()) / len(grads)
    mean_o = sum(o for _, o in grads.values()) / len(grads)
    assert mean_o > 1.5 * mean_e, (mean_e, mean_o)


def test_bf16_fp8_model_against_the_reference() -> None:
    """bf16 (the blocks' stored tiles rounded to bf16) against the float64 reference of the recipe."""
    _check_bf16("cpu")


@pytest.mark.gpu
def test_gpu_fp8_model_against_the_reference() -> None:
    """The same on a Hopper GPU, where the blocks are the CuTeDSL kernels (fp8 x fp8 GEMMs, e4m3 stores)."""
    from coda_lang.torch import uses_kernels

    if not torch.cuda.is_available() or not uses_kernels("cuda"):
        pytest.skip("needs a Hopper GPU")
    _check_bf16("cuda")


# every family the patch supports trains in fp8
FAMILY_NAMES = (
    "gemma2",
    "gemma3",
    "granite",
    "llama",
    "ministral",
    "mistral",
    "olmo2",
    "phi3",
    "qwen2",
    "qwen3",
)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize(
    "family",
    [
        f if f in ("llama", "qwen3", "olmo2") else pytest.param(f, marks=pytest.mark.slow)
        for f in FAMILY_NAMES
    ],
)
def test_every_family_trains_in_fp8(family: str, recipe: str) -> None:
    """float32 tiny models of each family (Qwen3's q/k norm, Qwen2's bias, Granite's multipliers, Phi-3's
    fused projections, the windows, OLMo 2's and Gemma's post norms): the fp8 model's loss and
    gradients are those of the same model patched without fp8 within e4m3's error (3 mantissa bits;
    OLMo 2 quantizes the residual itself, before any norm, which costs it more) and, with "delayed",
    e5m2's on the cotangents; every gradient finite, and the quantization visible (not the bf16 blocks
    run again). "delayed": every call site's backward ran at its own cotangent scales, one step each."""
    base = make(family)
    ids, labels = hf_batch()
    out = {}
    for fp8 in (None, recipe):
        m = HF[family][2](copy.deepcopy(base), fp8=fp8)
        loss = two_steps(m, ids, labels)
        out[fp8] = (loss.detach(), unfused_grads(m))
    (l0, g0), (l8, g8) = out[None], out[recipe]
    assert abs(l8.item() - l0.item()) < 2e-3 * abs(l0.item()), (l8.item(), l0.item())
    assert l8.item() != l0.item()
    assert set(g8) == set(g0)
    errs = {k: _rel(g8[k], g0[k]) for k in g0}
    # (with the out-projection in e4m3, the default with "delayed", its e5m2 cotangent reaches the q/k
    # norms' weights, whose gradients in these tiny models sum few elements: OLMo 2's moved 0.32 -> 0.40)
    qk_norm_bound = 0.5 if recipe == "delayed" and m._coda.fp8_out else 0.4
    for k, e in errs.items():
        assert torch.isfinite(g8[k]).all(), k
        assert e < (qk_norm_bound if k.endswith(("q_norm.weight", "k_norm.weight")) else 0.4), (k, e)
    assert sum(errs.values()) / len(errs) > 1e-2, errs  # (the blocks really quantized)
    grads = bank(m).grads
    assert set(grads) == (set(bank(m).sites) if recipe == "delayed" else set())
    for site, state in grads.items():
        assert state.steps == 2 and state.names, site
        assert all(math.isfinite(float(v)) and float(v) > 0 for v in state.scales.values()), site


def _olmo2_reference(ref, ids, labels, bank) -> torch.Tensor:
    """OLMo 2's fp8 recipe on the unpatched float64 model, by hooks: OLMo 2 has no pre norms, so each
    quantized value is a module's input itself (q/k/v's: the residual; gate/up's: the residual after
    attention; down's: the SwiGLU output; the out-projection's, where the model ran it in e4m3: the
    attention's output), fake-quantized at the scale the patched model ran at, and
    each weight fake-quantized in place (its gradient is then the straight-through one)."""
    last = bank.last
    hooks = []
    layers = ref.model.layers

    def pre(s):
        return lambda _m, args: (fake_quant(args[0], s),)

    with torch.no_grad():
        for i, layer in enumerate(layers):
            qkv_site = last[-1] if i == 0 else last[i - 1]
            s_in = qkv_site["h"] if i == 0 else qkv_site["x2"]
            for name in ("q_proj", "k_proj", "v_proj"):
                lin = getattr(layer.self_attn, name)
                lin.weight.copy_(fake_quant(lin.weight, qkv_site["w_qkv"].double()))
                hooks.append(lin.register_forward_pre_hook(pre(s_in.double())))
            site = last[i]
            if "y" in site:  # ($CODA_FP8_OUT=1: the out-projection in e4m3)
                o = layer.self_attn.o_proj
                o.weight.copy_(fake_quant(o.weight, site["w_o"].double()))
                hooks.append(o.register_forward_pre_hook(pre(site["y"].double())))
            for name in ("gate_proj", "up_proj"):
                lin = getattr(layer.mlp, name)
                lin.weight.copy_(fake_quant(lin.weight, site["w_13"].double()))
                hooks.append(lin.register_forward_pre_hook(pre(site["x1"].double())))
            down = layer.mlp.down_proj
            down.weight.copy_(fake_quant(down.weight, site["w_2"].double()))
            hooks.append(down.register_forward_pre_hook(pre(site["a"].double())))
    try:
        return ref(input_ids=ids, labels=labels).loss
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("out", ["0", "1"])
def test_olmo2_fp8_against_a_fake_quant_reference(out: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """OLMo 2 (post norms, no pre norms, q/k norm over each projection), fp8="delayed-forward", in float32
    against its float64 fake-quant reference at the same scales: the loss to 1e-5, every gradient to 1e-2 relative, and
    the unquantized model much further off. With $CODA_FP8_OUT=1 the out-projection is quantized too, and
    so is the reference's."""
    monkeypatch.setenv("CODA_FP8_OUT", out)
    base = make("olmo2")
    ids, labels = hf_batch()
    model = HF["olmo2"][2](copy.deepcopy(base), fp8="delayed-forward")
    loss = two_steps(model, ids, labels)
    ref = copy.deepcopy(base).double()
    plain = copy.deepcopy(base).double()
    want = _olmo2_reference(ref, ids, labels, bank(model))
    want.backward()
    unq = plain(input_ids=ids, labels=labels).loss
    unq.backward()
    err, off = abs(loss.item() - want.item()), abs(unq.item() - want.item())
    assert err < 1e-5 * abs(want.item()) and off > 5 * err, (err, off)
    refs, plains = dict(ref.named_parameters()), dict(plain.named_parameters())
    for name, g in unfused_grads(model).items():
        e, o = _rel(g, refs[name].grad), _rel(plains[name].grad, refs[name].grad)
        assert e < 1e-2 and o > 5 * e, (name, e, o)


@pytest.mark.parametrize("recipe", ["delayed", "delayed-forward"])
@pytest.mark.parametrize(
    "family",
    [
        f if f in ("llama", "olmo2", "gemma3") else pytest.param(f, marks=pytest.mark.slow)
        for f in FAMILY_NAMES
    ],
)
def test_every_familys_fp8_blocks_plan_for_the_kernels(family: str, recipe: str) -> None:
    """Each family's fp8 blocks as the patch makes them (first layer, layers, last layer), forward and
    the backward its autograd derives (with "delayed", its e5m2 cotangents): every GEMM stage plans for
    the CuTeDSL kernels (no refusal), and the forward's gate/up, down and QKV GEMMs multiply e4m3 by
    e4m3. With "delayed" the backward's data and weight gradients of those GEMMs multiply e5m2 by
    e4m3 (K-major copies where stored otherwise), the SwiGLU stage's e5m2 cotangent stored in bf16
    and narrowed; with "delayed-forward" no backward GEMM is fp8 (no GPU needed: the plan, not a
    launch)."""
    from coda_lang.backend_cute.plan.planner import plan_stage

    model = HF[family][2](make(family, torch.bfloat16), fp8=recipe)
    st = model._coda
    fp8_gemms = set()
    backward_fp8: dict[str, int] = {}
    for fn in (st.first, st.layer, st.last):
        assert fn.options.fp8_grads == ("e5m2" if recipe == "delayed" else None)
        d = fn.block.derivation(fn.wrt, backward=fn.options)
        for blk in (d.forward, d.backward):
            for k, stage in enumerate(blk.ir.stages, 1):
                if stage.a is None:  # (an elementwise stage: no GEMM)
                    continue
                spec = plan_stage(blk, k)
                g = spec.gemm
                if blk is d.forward and g.a_dtype == g.b_dtype == "e4m3":
                    fp8_gemms.add((fn.name, g.b))
                if blk is d.backward and "e5m2" in (g.a_dtype, g.b_dtype):
                    assert recipe == "delayed" and g.b_dtype == "e4m3" and not g.ta and g.tb, (fn.name, g)
                    backward_fp8[fn.name] = backward_fp8.get(fn.name, 0) + 1
                    assert spec.d is None or spec.d.dtype != "e5m2"  # (a packed D is narrowed)
    assert fp8_gemms >= {
        ("first_qkv", "w_qkvq"),
        ("layer", "w_13q"),
        ("layer", "w_2q"),
        ("layer", "w_qkvq"),
        ("last", "w_13q"),
        ("last", "w_2q"),
    }, fp8_gemms
    # each e4m3 GEMM's dgrad and wgrad: 2 in the first block, 6 in a layer's, 4 in the last's, and the
    # out-projection's 2 in each of those two (in e4m3 by default)
    assert st.fp8_out
    want = {"first_qkv": 2, "layer": 8, "last": 6} if recipe == "delayed" else {}
    assert backward_fp8 == want, backward_fp8


@pytest.mark.parametrize("pair_store", ["1", "0"])
def test_an_f16_models_delayed_blocks_plan_for_the_kernels(
    pair_store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An f16 model's "delayed" blocks with the gate/up acc saved in the model's dtype
    ($CODA_FP8_SAVE_ACC=0): the SwiGLU backward's packed stage (its saved gate/up tile f16) stores its
    e5m2 cotangent as a bf16 model's does: by default as its e5m2 pairs, reading the f16 tile as
    float32 words; with $CODA_FP8_PAIR_STORE=0 in f16, rounded to odd and narrowed. Every GEMM stage
    plans (no refusal). (The e4m3 save: tests/test_fp8_save.py.)"""
    from coda_lang.backend_cute.plan.planner import plan_stage
    from coda_lang.backend_cute.plan.spec import WORDS

    monkeypatch.setenv("CODA_FP8_PAIR_STORE", pair_store)
    monkeypatch.setenv("CODA_FP8_SAVE_ACC", "0")
    model = HF["llama"][2](make("llama", torch.float16), fp8="delayed")
    narrowed, paired = [], []
    for fn in (model._coda.first, model._coda.layer, model._coda.last):
        d = fn.block.derivation(fn.wrt, backward=fn.options)
        for k, stage in enumerate(d.backward.ir.stages, 1):
            if stage.a is None:
                continue
            spec = plan_stage(d.backward, k)
            if spec.d is not None and spec.d.narrow is not None:
                narrowed.append((fn.name, spec.d.dtype, spec.d.narrow))
            for o in spec.outputs:
                if o.pairs:
                    words = [w.dtype for w in spec.operands if w.host == WORDS]
                    paired.append((fn.name, o.dtype, *words))
    want = [("layer", "f16", "e5m2"), ("last", "f16", "e5m2")]
    if pair_store == "0":
        assert (narrowed, paired) == (want, []), (narrowed, paired)
    else:
        assert (narrowed, paired) == ([], [("layer", "e5m2", "f16"), ("last", "e5m2", "f16")]), (
            narrowed,
            paired,
        )


def test_reduce_fp8_amaxes_refuses_what_it_cannot_serve() -> None:
    """`reduce_fp8_amaxes`: a model not patched, one patched without fp8, and no process group are
    each refused by name (tests/test_hf_dist.py runs it on 2 processes)."""
    import torch.distributed as dist

    from coda_lang.hf import reduce_fp8_amaxes

    with pytest.raises(ValueError, match="not patched by coda_lang.hf"):
        reduce_fp8_amaxes(tiny())
    with pytest.raises(ValueError, match="patched without fp8"):
        reduce_fp8_amaxes(apply_coda_to_llama(tiny()))
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group exists already")
    with pytest.raises(ValueError, match="needs a process group"):
        reduce_fp8_amaxes(apply_coda_to_llama(tiny(), fp8="delayed"))


def reduced_and_not(
    model: Any, ids: torch.Tensor, steps: int = 3
) -> tuple[list[tuple[list[float], Any]], list[int]]:
    """On a gloo process group of one rank: two models made by `model()`, the second with
    `reduce_fp8_amaxes`, each trained `steps` forwards and backwards on `ids`: ([(losses, fp8 bank)]
    without and with the reduction, the sizes of the reduced model's all_reduce calls). Skips where a
    process group exists already."""
    import torch.distributed as dist

    from coda_lang.hf import reduce_fp8_amaxes

    if dist.is_initialized():
        pytest.skip("a process group exists already")
    calls: list[int] = []
    real = dist.all_reduce

    def counting(t: Any, *a: Any, **k: Any) -> Any:
        calls.append(t.numel())
        return real(t, *a, **k)

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        runs = []
        for reduce in (False, True):
            m = model()
            if reduce:
                assert reduce_fp8_amaxes(m) is m
                dist.all_reduce = counting
            try:
                losses = []
                for _ in range(steps):
                    loss = m(input_ids=ids, labels=ids).loss
                    loss.backward()
                    losses.append(float(loss))
            finally:
                dist.all_reduce = real
            runs.append((losses, bank(m)))
        return runs, calls
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("recipe", RECIPES)
def test_reduced_amaxes_on_one_rank_change_nothing(recipe: str) -> None:
    """On a process group of one rank, reducing the amaxes is the identity: the same losses, forward
    scales and (with "delayed") cotangent scales as the model that does not reduce them. The forward
    reduces once, after each call site's calibration once; "delayed"'s backward reduces its call
    site's cotangent amaxes (so more reductions than that); "delayed-forward"'s reduces nothing."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    runs, calls = reduced_and_not(lambda: apply_coda_to_llama(tiny(), fp8=recipe), ids)
    (plain, b0), (reduced, b1) = runs
    assert plain == reduced
    assert torch.equal(b0.scales, b1.scales)
    assert b0.grads.keys() == b1.grads.keys()
    for k, state in b0.grads.items():
        assert all(torch.equal(v, b1.grads[k].scales[n]) for n, v in state.scales.items()), k
    sites = len(b1.sites)  # (the first block and each layer's)
    assert sites == SHAPES["num_hidden_layers"] + 1, b1.sites
    forward = sites + 3  # each site's calibration, then one per forward
    if recipe == "delayed-forward":
        assert len(calls) == forward, calls
    else:  # (each backward of each site: one at least)
        assert len(b0.grads) == sites and len(calls) >= forward + 3 * sites, calls


def resume_runs(
    fresh: Any, tmp_path: Any, steps: int, tokens: int
) -> tuple[list[float], dict[str, Any], list[float], list[float]]:
    """The save-and-resume harness: `steps` AdamW steps of `fresh()`'s (patched model, optimizer) on
    seeded batches of 2 x `tokens`, then the model's state_dict, the optimizer's and `fp8_state_dict`
    saved to `tmp_path` (read back with `weights_only=True`), then `steps` more. Returns the losses of
    those later steps, the checkpoint read back, and the losses of the same steps of a fresh model and
    optimizer that load the checkpoint with its fp8 state and without it."""
    from coda_lang.hf import fp8_state_dict, load_fp8_state_dict

    def run(model: Any, opt: Any, span: range) -> list[float]:
        out = []
        for step in span:
            ids = torch.randint(0, 64, (2, tokens), generator=torch.Generator().manual_seed(100 + step))
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(float(loss))
        return out

    model, opt = fresh()
    run(model, opt, range(steps))
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "fp8": fp8_state_dict(model)}, path)
    whole = run(model, opt, range(steps, 2 * steps))
    saved = torch.load(path, weights_only=True)
    resumed = []
    for with_fp8 in (True, False):
        m, o = fresh()
        m.load_state_dict(saved["model"])
        o.load_state_dict(saved["opt"])
        if with_fp8:
            load_fp8_state_dict(m, saved["fp8"])
        resumed.append(run(m, o, range(steps, 2 * steps)))
    return whole, saved, resumed[0], resumed[1]


@pytest.mark.parametrize("recipe", ["delayed", pytest.param("delayed-forward", marks=pytest.mark.slow)])
def test_a_saved_fp8_state_resumes_training_where_it_stopped(recipe: str, tmp_path) -> None:
    """Four AdamW steps, then the model's state_dict, the optimizer's and `fp8_state_dict` saved (and
    read back with `weights_only=True`); a fresh patched model and optimizer load them and train four
    steps more: their losses are those of the run that never stopped, bit for bit. Without the fp8
    state, the resumed model calibrates again and they are not."""

    def fresh():
        model = apply_coda_to_llama(tiny(), fp8=recipe)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    whole, saved, resumed, without = resume_runs(fresh, tmp_path, 4, 16)
    assert resumed == whole
    assert without != whole
    assert len(saved["fp8"]["sites"]) == SHAPES["num_hidden_layers"] + 1
    assert (len(saved["fp8"]["grads"]) > 0) == (recipe == "delayed")


def test_an_fp8_state_of_another_recipe_or_model_is_refused() -> None:
    from coda_lang.hf import fp8_state_dict, load_fp8_state_dict

    ids = torch.randint(0, 64, (2, 16))
    m = apply_coda_to_llama(tiny(), fp8="delayed")
    m(input_ids=ids, labels=ids).loss.backward()
    state = fp8_state_dict(m)
    with pytest.raises(ValueError, match="cotangents are e5m2, loaded into one whose are in its dtype"):
        load_fp8_state_dict(apply_coda_to_llama(tiny(), fp8="delayed-forward"), state)
    with pytest.raises(ValueError, match="patched without fp8"):
        load_fp8_state_dict(apply_coda_to_llama(tiny()), state)
    cut = {**state, "scales": state["scales"][:-1]}  # (a damaged state: a scale short)
    with pytest.raises(ValueError, match="its scales do not match its call sites"):
        load_fp8_state_dict(apply_coda_to_llama(tiny(), fp8="delayed"), cut)
    with torch.device("meta"):
        unloaded = tiny()
    with pytest.raises(ValueError, match="meta device"):
        load_fp8_state_dict(apply_coda_to_llama(unloaded, fp8="delayed"), state)
    # a state whose call sites' scales are not this model's blocks' (its first site given a layer's)
    other = apply_coda_to_llama(tiny(), fp8="delayed")
    names = {i: n for i, n in state["sites"]}
    assert names[-1] != names[0]
    bad = {**state, "sites": [[i, names[{-1: 0, 0: -1}.get(i, i)]] for i, _ in state["sites"]]}
    load_fp8_state_dict(other, bad)
    with pytest.raises(ValueError, match="the state is another model's"):
        other(input_ids=ids, labels=ids)


def test_no_backward_reads_the_cotangent_of_a_detached_output() -> None:
    """Every family's fp8 blocks (and loss_mode="fp8"'s head): the cotangent of each detached output
    (the amaxes) is a parameter of the derived backward that no statement reads, so the runtime hands
    it one shared zero (autograd.py, `_shared_zero`) rather than a fill kernel per output and step;
    and the patched model's autograd makes no zeros for them."""
    import sys
    from pathlib import Path

    import coda_lang
    from coda_lang.hf.family import FAMILIES
    from coda_lang.hf.state import block_wrt
    from coda_lang.ir.nodes import Var

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import fuzz_hf_blocks

    def reads(x: object, out: set[str]) -> set[str]:
        if isinstance(x, Var):
            out.add(x.name)
        elif isinstance(x, (list, tuple)):
            for y in x:
                reads(y, out)
        elif hasattr(x, "__dataclass_fields__"):
            for f in x.__dataclass_fields__:
                if f != "outs":  # (what a statement defines, not what it reads)
                    reads(getattr(x, f), out)
        return out

    checked = 0
    for family in ("llama", "olmo2", "gemma2"):
        prog = coda_lang.load(fuzz_hf_blocks.source(FAMILIES[family], "delayed"))
        for name in ("first_qkv", "layer", "last", "head_loss_fp8"):
            b = prog[name]
            opts = coda_lang.BackwardOptions(fp8_grads="e5m2", fp8_acc=name != "head_loss_fp8")
            d = b.derivation(block_wrt(b), backward=opts)
            read = reads(d.backward.ir.body, set())
            for o in d.detached:
                assert d.cotangents[o] not in read, (family, name, o)
                checked += 1
    assert checked > 40

    from torch.utils._python_dispatch import TorchDispatchMode

    class Zeros(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket is torch.ops.aten.zeros:
                Zeros.n += 1
            return func(*args, **(kwargs or {}))

    model = apply_coda_to_llama(tiny(), fp8="delayed")
    ids, labels = hf_batch()
    model(input_ids=ids, labels=labels).loss.backward()  # (the first step calibrates)
    with Zeros():
        model(input_ids=ids, labels=labels).loss.backward()
    assert Zeros.n <= 1, Zeros.n  # (the loss head's weight-gradient total, made once a step)


def gemm_stages(fns: Any) -> Iterator[tuple[Any, int, Any, Any]]:
    """(block, stage index, its plan, the tile the runtime chooses for it) for every GEMM stage of the
    block functions' forwards and the backwards their autograd derives (no GPU: the plan and the tile,
    not a launch; E0706 or E0707 where a stage gets none)."""
    from coda_lang.backend_cute.plan.planner import plan_stage
    from coda_lang.backend_cute.runtime.tiles import choose_config

    for fn in fns:
        d = fn.block.derivation(fn.wrt, backward=fn.options)
        for blk in (d.forward, d.backward):
            for k, stage in enumerate(blk.ir.stages, 1):
                if stage.is_gemm:
                    spec = plan_stage(blk, k)
                    yield blk, k, spec, choose_config(blk, k, spec, False)


@pytest.mark.parametrize(
    "family",
    [
        f if f in ("llama", "qwen3", "olmo2") else pytest.param(f, marks=pytest.mark.slow)
        for f in FAMILY_NAMES
    ],
)
def test_the_fp8_out_projection_plans_and_gets_kernel_tiles(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """$CODA_FP8_OUT=1 with fp8="delayed" (e4m3 save, e5m2 cotangents): each family's blocks, forward and
    backward, plan every GEMM stage for the kernels and get a tile from the runtime (no E0706), and the
    out-projection, its data gradient and its weight gradient multiply fp8 by fp8 (no GPU: the plan and
    the tile, not a launch). Unset does the same (the default); 0 keeps it in the model's dtype; a value
    other than 0 or 1 is a ValueError naming the variable."""
    monkeypatch.setenv("CODA_FP8_OUT", "1")
    model = HF[family][2](make(family, torch.bfloat16), fp8="delayed")
    st = model._coda
    assert st.fp8_out
    out_gemms: dict[str, int] = {}
    for blk, k, spec, _ in gemm_stages((st.layer, st.last)):
        g = spec.gemm
        if "w_oq" in (g.a, g.b) or "yq" in (g.a, g.b):
            assert {g.a_dtype, g.b_dtype} <= {"e4m3", "e5m2"}, (blk.name, k, g)
            out_gemms[blk.name] = out_gemms.get(blk.name, 0) + 1
    assert out_gemms == {"layer": 1, "layer_bwd": 2, "last": 1, "last_bwd": 2}, out_gemms
    monkeypatch.delenv("CODA_FP8_OUT")
    assert HF[family][2](make(family, torch.bfloat16), fp8="delayed")._coda.fp8_out
    monkeypatch.setenv("CODA_FP8_OUT", "0")
    assert not HF[family][2](make(family, torch.bfloat16), fp8="delayed")._coda.fp8_out
    monkeypatch.setenv("CODA_FP8_OUT", "yes")
    with pytest.raises(ValueError, match="CODA_FP8_OUT is 'yes'"):
        HF[family][2](make(family, torch.bfloat16), fp8="delayed")
