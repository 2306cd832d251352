"""peft LoRA on a patched model (issue 32, "Support, not refusal"), against the unpatched peft model.

On the CPU with the tiny models of tests/test_hf.py: LoRA on q, k, v, o, gate, up and down, applied
before patching (`get_peft_model`, then `apply_coda_to_*` on the peft model), the base frozen. Each
adapted GEMM adds the adapters' output s (x A^T) B^T to its accumulator (hf/lora.py): the loss and
every adapter gradient equal the unpatched peft model's in float32, and so do 10 AdamW steps; LoRA
dropout draws peft's masks; the base gets no gradient (and no weight-gradient GEMM); the state dict
is the peft model's; an adapter saved from the patched model loads into an unpatched one; merge,
unmerge and disabled adapters act as peft's do. What the patch can't run is refused by name: DoRA, a
quantized base (QLoRA), LoRA on other modules, LoRA applied after patching, hooks on a LoRA layer,
an adapter added after patching. On the GPU (-m gpu): bf16 against float64 for every family, and one
AdamW step's effect at 1B width against float64.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_hf import FAMILIES, batch, make, patch, rel  # noqa: E402

from coda_lang.hf import unfused_grads, unpatch  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Phi-3's projections: LoRA on its fused qkv_proj and gate_up_proj adds B A to all their rows
PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]


def targets(family: str) -> list[str]:
    return PHI3_TARGETS if family == "phi3" else TARGETS


def config(r: int = 8, **kw: Any) -> Any:
    # init_lora_weights=False: B is random too (peft's default starts B at zero, where the adapters'
    # effect, and A's gradient, would be zero and a test of them could not fail)
    kw = {
        "lora_alpha": 2 * r,
        "target_modules": TARGETS,
        "lora_dropout": 0.0,
        "init_lora_weights": False,
        **kw,
    }
    return peft.LoraConfig(r=r, **kw)


def pair(family: str = "llama", r: int = 8, **kw: Any) -> tuple[Any, Any]:
    """An unpatched peft model and a patched copy of it (LoRA on every projection of the family)."""
    ref = peft.get_peft_model(make(family), config(r, **{"target_modules": targets(family), **kw}))
    pat = copy.deepcopy(ref)
    assert patch(family, pat) is pat
    return ref, pat


def step(model: Any, ids: Any, labels: Any) -> tuple[Any, dict[str, Any]]:
    """The loss and the gradients (under the unpatched names) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    if getattr(model, "_coda", None) is not None:
        return loss.detach(), unfused_grads(model)
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("family", "r"),
    [("llama", 8), ("llama", 64), *((f, 16) for f in sorted(FAMILIES) if f != "llama")],
)
def test_loss_and_adapter_gradients_are_the_unpatched_peft_models(family: str, r: int) -> None:
    """The issue's row: LoRA applied, then patched, gave the base model's loss (adapters ignored).
    Now the loss and each A and B gradient are peft's within 1e-5 (f32); only the adapters have
    gradients (the base is frozen, its fused weights too); the state dict is the peft model's. Every
    family (Qwen2's q, k and v projections keep their biases under the adapters)."""
    ref, pat = pair(family, r)
    ids, labels = batch()
    l0, g0 = step(ref, ids, labels)
    l1, g1 = step(pat, ids, labels)
    assert rel(l1, l0) < 1e-5
    assert set(g0) == set(g1) and g0 and all(".lora_A." in n or ".lora_B." in n for n in g0)
    for name in g0:
        assert rel(g1[name], g0[name]) < 1e-5, name
    assert all(not p.requires_grad for n, p in pat.named_parameters() if "lora_" not in n)
    # the adapters count: they move the loss far more than the patched model differs from peft's
    # (1e-4 and more, but Granite's logits / 8 and branches x 0.22 leave 7e-5)
    assert rel(l0, make(family)(input_ids=ids, labels=labels).loss) > 100 * rel(l1, l0) + 1e-6
    sd0, sd1 = ref.state_dict(), pat.state_dict()
    assert list(sd1) == list(sd0) and all(torch.equal(sd1[k], sd0[k]) for k in sd0)


@pytest.mark.parametrize("family", ["llama", pytest.param("phi3", marks=pytest.mark.slow)])
def test_ten_adamw_steps_side_by_side(family: str) -> None:
    """10 AdamW steps on the adapters, the unpatched and the patched peft model side by side: the same
    losses at every step (f32), and the same adapters at the end."""
    ref, pat = pair(family, 16)
    lr = 1e-3
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr) for m in (ref, pat)]
    for i in range(10):
        ids, labels = batch(seed=10 + i)
        losses = []
        for m, opt in zip((ref, pat), opts, strict=True):
            opt.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            losses.append(float(loss))
        assert abs(losses[1] - losses[0]) < 1e-5 * abs(losses[0]), (i, losses)
    a, b = ref.state_dict(), pat.state_dict()
    moved = max(float((a[k] - b[k]).abs().max()) for k in a if "lora_" in k)
    # AdamW moves each element about lr a step; gradients equal to f32 rounding agree to a few % of it
    assert moved < 0.05 * lr, moved
    start = pair(family, 16)[0].state_dict()
    assert max(float((a[k] - start[k]).abs().max()) for k in a if "lora_" in k) > 5 * lr  # they trained


def test_an_adapter_saved_from_a_patched_model_loads_into_an_unpatched_one(tmp_path: Any) -> None:
    """save_pretrained of the patched peft model writes the adapter (A and B under peft's names);
    PeftModel.from_pretrained on a fresh unpatched base gives the patched model's loss and logits."""
    _, pat = pair("qwen3", 8)
    ids, labels = batch()
    opt = torch.optim.AdamW([p for p in pat.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        pat(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    pat.save_pretrained(tmp_path / "adapter")
    back = peft.PeftModel.from_pretrained(make("qwen3"), tmp_path / "adapter")
    assert getattr(back.get_base_model(), "_coda", None) is None
    want = {k: v for k, v in pat.state_dict().items() if "lora_" in k}
    got = {k: v for k, v in back.state_dict().items() if "lora_" in k}
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert rel(back(input_ids=ids, labels=labels).loss, pat(input_ids=ids, labels=labels).loss) < 1e-5


def test_merge_unmerge_and_disabled_adapters_act_as_pefts() -> None:
    """merge_adapter() writes s B A into the base weights (the fused ones of a patched model: its
    state dict then equals the merged unpatched model's) and the forward stops adding the adapters;
    unmerge_adapter() takes it out again; inside disable_adapter() the loss is the base model's."""
    ref, pat = pair("llama", 8)
    ids, labels = batch()
    want = float(ref(input_ids=ids, labels=labels).loss)
    for m in (ref, pat):
        m.merge_adapter()
    sd0, sd1 = ref.state_dict(), pat.state_dict()
    assert all(rel(sd1[k], sd0[k]) < 1e-6 for k in sd0)
    base = make("llama").state_dict()
    assert (
        rel(
            sd1["base_model.model.model.layers.0.self_attn.k_proj.base_layer.weight"],
            base["model.layers.0.self_attn.k_proj.weight"],
        )
        > 1e-3
    )
    l_ref, l_pat = (float(m(input_ids=ids, labels=labels).loss) for m in (ref, pat))
    assert abs(l_pat - l_ref) < 1e-5 * abs(l_ref) and abs(l_pat - want) < 1e-4 * abs(want)
    for m in (ref, pat):
        m.unmerge_adapter()
    sd1 = pat.state_dict()
    assert all(rel(sd1[k], sd0_k) < 1e-6 for k, sd0_k in ref.state_dict().items())
    assert abs(float(pat(input_ids=ids, labels=labels).loss) - want) < 1e-5 * abs(want)
    plain = float(make("llama")(input_ids=ids, labels=labels).loss)
    with pat.disable_adapter():
        assert abs(float(pat(input_ids=ids, labels=labels).loss) - plain) < 1e-5 * abs(plain)
    assert abs(float(pat(input_ids=ids, labels=labels).loss) - want) < 1e-5 * abs(want)


def test_the_active_adapter_is_the_one_that_runs() -> None:
    """Two adapters made before patching: set_adapter() after patching switches the one the blocks
    add, as it does unpatched."""
    ref = peft.get_peft_model(make("llama"), config(), adapter_name="a")
    ref.add_adapter("b", config(4))
    pat = patch("llama", copy.deepcopy(ref))
    ids, labels = batch()
    losses = []
    for name in ("b", "a"):
        for m in (ref, pat):
            m.set_adapter(name)
        l0, l1 = (m(input_ids=ids, labels=labels).loss for m in (ref, pat))
        assert rel(l1, l0) < 1e-5, name
        losses.append(float(l0))
    assert abs(losses[0] - losses[1]) > 1e-4


def test_unpatch_gives_the_peft_model_back() -> None:
    """unpatch on a patched peft model: the LoRA layers over nn.Linear bases again, the state dict and
    the loss the unpatched peft model's."""
    ref, pat = pair("qwen3", 8)
    ids, labels = batch()
    assert unpatch(pat) is pat
    assert type(pat.get_base_model().model.layers[0].self_attn.q_proj.base_layer) is torch.nn.Linear
    sd0, sd1 = ref.state_dict(), pat.state_dict()
    assert list(sd1) == list(sd0) and all(torch.equal(sd1[k], sd0[k]) for k in sd0)
    assert torch.equal(pat(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss)


def test_phi3_lora_on_its_fused_projections() -> None:
    """LoRA on Phi-3's fused qkv_proj and gate_up_proj (B A over all their rows; a FusedPart over the
    whole fused weight is the base layer): merge_adapter() writes it into coda's fused weights (the
    state dict then the merged unpatched model's), unmerge_adapter() takes it out, and unpatch gives
    the peft model back over nn.Linear bases; LoRA on qkv_proj alone runs too."""
    ref, pat = pair("phi3", 8)
    ids, labels = batch()
    for m in (ref, pat):
        m.merge_adapter()
    sd0, sd1 = ref.state_dict(), pat.state_dict()
    assert list(sd1) == list(sd0) and all(rel(sd1[k], sd0[k]) < 1e-6 for k in sd0)
    assert "base_model.model.model.layers.1.self_attn.qkv_proj.base_layer.weight" in sd1
    assert rel(pat(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss) < 1e-5
    for m in (ref, pat):
        m.unmerge_adapter()
    sd0, sd1 = ref.state_dict(), pat.state_dict()
    assert all(rel(sd1[k], sd0[k]) < 1e-6 for k in sd0)
    assert unpatch(pat) is pat
    base = pat.get_base_model().model.layers[0]
    assert (
        type(base.self_attn.qkv_proj.base_layer) is type(base.mlp.gate_up_proj.base_layer) is torch.nn.Linear
    )
    assert rel(pat(input_ids=ids, labels=labels).loss, ref(input_ids=ids, labels=labels).loss) < 1e-6
    ref, pat = pair("phi3", 4, target_modules=["qkv_proj"])
    l0, g0 = step(ref, ids, labels)
    l1, g1 = step(pat, ids, labels)
    assert rel(l1, l0) < 1e-5 and set(g1) == set(g0) and len(g0) == 4
    for name in g0:
        assert rel(g1[name], g0[name]) < 1e-5, name


def test_dropout_in_training_draws_what_peft_draws() -> None:
    """LoRA dropout gives each adapter its own dropped input (the base weight reads x itself): the
    patched model draws the same masks in the same order as peft (q, k, v, o, gate, up, down, layer
    by layer), so with one seed its loss and gradients are the unpatched peft model's; another seed
    gives another loss (dropout acts), and in eval mode dropout is the identity."""
    ref, pat = pair("llama", 8, lora_dropout=0.1)
    ids, labels = batch()
    ref.train()
    pat.train()
    torch.manual_seed(3)
    l0, g0 = step(ref, ids, labels)
    torch.manual_seed(3)
    l1, g1 = step(pat, ids, labels)
    assert rel(l1, l0) < 1e-5 and set(g1) == set(g0)
    for name in g0:
        assert rel(g1[name], g0[name]) < 1e-4, name
    torch.manual_seed(4)
    assert rel(step(pat, ids, labels)[0], l0) > 1e-4
    pat.eval()
    ref.eval()
    evaluated = pat(input_ids=ids, labels=labels).loss
    assert rel(evaluated, ref(input_ids=ids, labels=labels).loss) < 1e-5 and rel(evaluated, l0) > 1e-4


def test_what_the_patch_cant_run_as_one_weight_is_refused() -> None:
    """DoRA, a LoRA bias, a quantized base (QLoRA; a stand-in of bitsandbytes' class), LoRA on the LM
    head, hooks on a LoRA layer's parts: refused when patching, naming the module."""
    model = peft.get_peft_model(make("llama"), config(use_dora=True))
    with pytest.raises(ValueError, match=r"self_attn.q_proj \(adapter 'default'\): DoRA"):
        patch("llama", model)
    model = peft.get_peft_model(make("llama"), config(target_modules=["lm_head", "q_proj"]))
    with pytest.raises(ValueError, match=r"coda_lang.hf: lm_head: a peft adapter layer"):
        patch("llama", model)
    model = peft.get_peft_model(make("llama"), config())
    layer = model.get_base_model().model.layers[1].mlp.up_proj
    bnb = type("Linear4bit", (torch.nn.Linear,), {"__module__": "bitsandbytes.nn.modules"})
    q = bnb(64, 128, bias=False)
    layer.base_layer = q
    with pytest.raises(
        ValueError, match=r"up_proj.base_layer: a bitsandbytes quantized layer .*QLoRA.* not supported"
    ):
        patch("llama", model)
    model = peft.get_peft_model(make("llama"), config())
    model.get_base_model().model.layers[0].self_attn.v_proj.lora_B["default"].register_forward_hook(
        lambda *a: None
    )
    with pytest.raises(ValueError, match=r"v_proj.lora_B.default: a forward hook"):
        patch("llama", model)
    assert getattr(model.get_base_model(), "_coda", None) is None


def test_changes_after_patching_are_refused() -> None:
    """LoRA applied to a patched model (its q, k, v are fused away; peft replaces o_proj and down_proj),
    an adapter added after patching, a hook on a LoRA layer: refused at the forward, saying what
    works (LoRA before patching)."""
    ids, labels = batch()
    pat = patch("llama", make("llama"))
    pm = peft.get_peft_model(pat, peft.LoraConfig(r=4, target_modules=["o_proj", "down_proj"]))
    with pytest.raises(
        ValueError,
        match=r"o_proj: replaced after patching by a peft adapter layer .*when applied before patching",
    ):
        pm(input_ids=ids, labels=labels)
    _, pat = pair("llama", 8)
    pat.add_adapter("other", config())
    with pytest.raises(
        ValueError, match=r"coda_lang.hf: model.layers.0.self_attn.q_proj.lora_\w+: its submodules changed"
    ):
        pat(input_ids=ids, labels=labels)
    _, pat = pair("llama", 8)
    h = pat.get_base_model().model.layers[1].mlp.down_proj.register_forward_pre_hook(lambda *a: None)
    with pytest.raises(ValueError, match=r"coda_lang.hf: model.layers.1.mlp.down_proj: a forward pre-hook"):
        pat(input_ids=ids, labels=labels)
    h.remove()
    pat(input_ids=ids, labels=labels)


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_on_the_gpu_within_the_accuracy_rule(family: str) -> None:
    """bf16 on the GPU: the patched peft model's loss and adapter gradients are as close to a float64
    run of the unpatched peft model as the unpatched bf16 run is (twice its error, and a floor)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    from test_hf import ON_KERNELS

    torch.manual_seed(0)
    kernels = ON_KERNELS.get(family, {})
    ref = peft.get_peft_model(
        make(family, **kernels), config(16, target_modules=targets(family)), autocast_adapter_dtype=False
    )
    f64 = copy.deepcopy(ref).double().cuda()
    bf = copy.deepcopy(ref).to(torch.bfloat16).cuda()
    pat = patch(family, copy.deepcopy(ref).to(torch.bfloat16).cuda())
    ids, labels = (t.cuda() for t in batch(s=64))
    l64, g64 = step(f64, ids, labels)
    lbf, gbf = step(bf, ids, labels)
    lpt, gpt = step(pat, ids, labels)
    assert abs(float(lpt) - float(l64)) <= 2 * abs(float(lbf) - float(l64)) + 1e-2
    for name, g in g64.items():
        assert rel(gpt[name], g) <= 2 * rel(gbf[name], g) + 2e-2, name


def test_an_update_below_the_base_weights_spacing_is_kept() -> None:
    """The LoRA GEMM reads the base weight as it is and adds the adapters' output s (x A^T) B^T to its
    f32 accumulator (lora.py): `correction` is that output exactly (against float64) even where every
    s B A entry is below half of W's bf16 spacing, where W + s B A rounded to bf16 (the design before,
    whose 1B LoRA run drifted from peft's) is W itself."""
    from coda_lang.hf import lora
    from coda_lang.hf.checkpoint import qkv_fused

    _, pat = pair("llama", 8)
    pat = pat.to(torch.bfloat16)
    fused = pat.get_base_model().model.layers[0].coda_next.self_attn  # (layer 1's FusedQKV)
    parts = fused.loras  # q, k and v's LoRA layers
    w = fused.qkv_weight
    with torch.no_grad():
        # every base entry in [2^-6, 2^-5): one bf16 spacing, 2^-13; every s B A entry below 2^-15
        w.copy_(torch.sign(torch.randn_like(w)) * 2.0**-6 * (1 + torch.rand_like(w)))
        for m in parts:
            d = (m.lora_B["default"].weight.float() @ m.lora_A["default"].weight.float()) * m.scaling[
                "default"
            ]
            m.lora_B["default"].weight.mul_(2.0**-15 / float(d.abs().max()))
    spec = lora.qkv(fused)
    assert spec is not None
    x = torch.randn(16, w.shape[1]).to(torch.bfloat16)
    got, again = lora.correction(x, spec)
    assert torch.equal(again(), got)
    ds = [
        (m.lora_B["default"].weight.double() @ m.lora_A["default"].weight.double()) * m.scaling["default"]
        for m in parts
    ]
    want = x.double() @ qkv_fused(ds, fused).t()
    assert got.shape == want.shape and float(want.abs().max()) > 0 and rel(got, want) < 2e-2
    assert torch.equal(w + qkv_fused([d.to(w.dtype) for d in ds], fused), w)  # (the design before)


@pytest.mark.gpu
def test_one_adamw_steps_effect_at_1b_width_is_float64s() -> None:
    """At Llama-3.2-1B's widths (2 layers, seq 2048, r 16 on every projection, peft's init: B = 0),
    after one AdamW step (lr 1e-4) the adapters' effect on the loss (adapters on minus off) is within
    5% of a float64 run's. (peft's own bf16 forward rounds x W^T to bf16 before adding the adapters'
    output and lost 70% of it on one H100, 2026-11-27: -0.0058 against float64's -0.0189.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    from coda_lang.hf import apply_coda_to_llama

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=True,
    )
    ref = peft.get_peft_model(
        transformers.LlamaForCausalLM(cfg).to(torch.bfloat16),
        peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS),
    ).cuda()
    ids = torch.randint(0, 32000, (1, 2048), generator=torch.Generator().manual_seed(1)).cuda()
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-4)
    ref(input_ids=ids, labels=ids).loss.backward()
    opt.step()

    def effect(m: Any) -> float:
        with torch.no_grad():
            on = float(m(input_ids=ids, labels=ids).loss)
            with m.disable_adapter():
                return on - float(m(input_ids=ids, labels=ids).loss)

    want = effect(copy.deepcopy(ref).double())
    got = effect(apply_coda_to_llama(copy.deepcopy(ref)))
    assert abs(want) > 1e-3 and abs(got - want) <= 0.05 * abs(want), (got, want)


def test_a_frozen_base_gets_no_weight_gradient_gemm_and_the_lora_output_is_not_held() -> None:
    """With the base frozen (peft's), the blocks a LoRA step runs differentiate no weight (their
    backward makes no dW GEMM, which peft's layers skip too), and the adapters' [tokens, out] output
    that a block's backward reads is made again there from its thin factors (`lora.kept`), not held
    from the forward."""
    from coda_lang.hf import lora

    _, pat = pair("llama", 8)
    ids, labels = batch()
    step(pat, ids, labels)
    blocks = pat.get_base_model()._coda.blocks(torch.float32)
    made = [fn for parts in blocks._parts.values() for fn, _ in parts]
    assert made and all(not any(n.startswith("w_") for n in fn.wrt) for fn in made)
    assert all(
        any(n == "lora_c" for n in fn.wrt) for fn, cut in blocks._parts[next(iter(blocks._parts))] if cut
    )

    c = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(4, 3, requires_grad=True)
    calls = []

    def again() -> Any:
        calls.append(1)
        return c.detach().clone()

    with lora.kept(c, again):
        y = (c * w).sum()  # (mul saves c for w's gradient)
    y.backward()
    assert calls == [1] and torch.equal(w.grad, c.detach())
    # the other saved tensors go to the hooks around (activation checkpointing's), c does not
    seen: list[Any] = []
    w.grad = None
    outer = torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or ("outer", t), lambda p: p[1])
    with outer, lora.kept(c, again):
        y = (c * w).sum()
    y.backward()
    assert calls == [1, 1] and len(seen) == 1 and seen[0] is w and torch.equal(w.grad, c.detach())
