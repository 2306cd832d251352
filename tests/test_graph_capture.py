"""A patched model under CUDA graph capture: the fp8 state advances in place, a capture refuses what a
graph can't hold, and the attention mask is the one transformers gives outside a capture.

On the CPU a capture is pretended (`torch.cuda.is_current_stream_capturing` made to say True), which
is what coda and transformers read; the GPU test captures a real training step and replays it against
the same steps run eagerly.
"""

from __future__ import annotations

import math
import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf import SHAPES as HF_SHAPES  # noqa: E402
from test_hf import batch as hf_batch  # noqa: E402
from test_hf_fp8 import bank, tiny  # noqa: E402

import coda_lang.backend_cute.runtime.tuning as tuning  # noqa: E402
from coda_lang.backend_cute.runtime.grad_scales import DelayedScaling  # noqa: E402
from coda_lang.hf import apply_coda_to_llama, apply_coda_to_mistral  # noqa: E402
from coda_lang.hf.families import family_of  # noqa: E402
from coda_lang.hf.fp8 import HISTORY, Bank  # noqa: E402
from coda_lang.hf.masks import layer_masks  # noqa: E402
from coda_lang.torch import CaptureError  # noqa: E402

E4M3_MAX, E5M2_MAX = 448.0, 57344.0


@pytest.fixture
def capture(monkeypatch):
    """A pretended CUDA graph capture, for as long as the test wants it (`on()`, `off()`)."""
    state = {"on": False}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["on"])
    return types.SimpleNamespace(on=lambda: state.update(on=True), off=lambda: state.update(on=False))


def decreasing_amaxes(n: int, width: int) -> list[torch.Tensor]:
    """Amax vectors that fall step by step, so that a scale depends on which steps are in the window."""
    return [torch.tensor([1000.0 / (i + 1) / (j + 1) for j in range(width)]) for i in range(n)]


# -- the state advances on the device, in place -----------------------------------------------------


@pytest.mark.parametrize("frozen", [False, True])
def test_delayed_scaling_advances_on_the_device(frozen: bool) -> None:
    """The cotangents' scales follow the rule (57344 / max of the last `history` amaxes) step after
    step, with the host's step count frozen where a CUDA graph's replays leave it, and in the same
    storage."""
    history = 4
    state = DelayedScaling(initial=1.0, history=history)
    state.bind(["a", "b"], "e5m2")
    state.scales_for(torch.device("cpu"))
    amaxes = decreasing_amaxes(2 * history + 3, 2)
    ptrs = None
    for i, a in enumerate(amaxes):
        if frozen and i >= 2:
            state.steps = 2  # (the host's count as a capture at step 2 leaves it at every replay)
        state.record({"a": a[0], "b": a[1]})
        window = torch.stack(amaxes[max(0, i - history + 1) : i + 1]).amax(0)
        for j, n in enumerate(("a", "b")):
            assert math.isclose(float(state.scales[n]), E5M2_MAX / float(window[j]), rel_tol=1e-6), (i, n)
        now = (state._vec.data_ptr(), state._past.rows.data_ptr(), state._past.count.data_ptr())
        assert ptrs in (None, now), (i, ptrs, now)
        ptrs = now
    assert int(state._past.count) == len(amaxes)


@pytest.mark.parametrize("frozen", [False, True])
def test_bank_advances_on_the_device(frozen: bool) -> None:
    """The bank's scales follow the rule (448 / max of the last HISTORY forwards' amaxes) with the
    host's count frozen, in the same storage; a step's scales, read before the update, stay as they
    ran (activation checkpointing's second run and the backward read them after it)."""
    b = Bank()
    b.add(0, ["x", "w"], torch.device("cpu"))
    amaxes = decreasing_amaxes(HISTORY + 4, 2)
    ptrs = None
    for i, a in enumerate(amaxes):
        if frozen and i >= 2:
            b.steps = 2
        step = types.SimpleNamespace(snapshot=None)
        ran = b.of(0, step)
        before = {n: float(v) for n, v in ran.items()}
        b.record({0: {"x": a[0], "w": a[1]}})
        assert {n: float(v) for n, v in ran.items()} == before, i
        window = torch.stack(amaxes[max(0, i - HISTORY + 1) : i + 1]).amax(0)
        assert b.scales is not None and b.past is not None
        for j in range(2):
            assert math.isclose(float(b.scales[j]), E4M3_MAX / float(window[j]), rel_tol=1e-6), (i, j)
        now = (b.scales.data_ptr(), b.past.rows.data_ptr(), b.past.count.data_ptr())
        assert ptrs in (None, now), (i, ptrs, now)
        ptrs = now


def test_patched_fp8_model_keeps_its_state_in_place() -> None:
    """After the first step, training steps change the fp8 model's scales, amax rings and their counts
    in place: a captured step's replays advance the same tensors."""
    model = apply_coda_to_llama(tiny(), fp8="delayed")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def state() -> dict[str, tuple[int, torch.Tensor]]:
        b = bank(model)
        got = {"scales": b.scales, "past": b.past.rows, "count": b.past.count}
        for site, g in b.grads.items():
            got |= {f"{site}.scales": g._vec, f"{site}.past": g._past.rows, f"{site}.count": g._past.count}
        return {k: (v.data_ptr(), v.detach().clone()) for k, v in got.items()}

    seen = []
    for step in range(4):
        ids, labels = hf_batch(seed=30 + step)
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= 1:  # (the first step calibrates: its grad states' rings are made then)
            seen.append(state())
    assert len(seen[0]) == 3 + 3 * len(bank(model).grads)
    for k, (ptr, value) in seen[0].items():
        assert all(s[k][0] == ptr for s in seen[1:]), k
        if k.endswith("count"):
            assert [int(s[k][1]) for s in seen] == [int(value) + j for j in range(3)], k
    assert not torch.equal(seen[0]["scales"][1], seen[-1]["scales"][1])


# -- what a capture refuses -------------------------------------------------------------------------


def test_capture_refuses_a_first_call_and_a_calibration(capture) -> None:
    """Capturing a fresh model's step is refused at its first block call (compiling and choosing
    kernels); a first backward's calibration of fp8 cotangent scales, and a call site's first
    forward, likewise: a graph would redo them at every replay."""
    ids, labels = hf_batch(seed=3)
    capture.on()
    with pytest.raises(CaptureError, match="first call .*run the step once"):
        apply_coda_to_llama(tiny())(input_ids=ids, labels=labels)
    model = apply_coda_to_llama(tiny(), fp8="delayed")
    with pytest.raises(CaptureError, match="fp8 call site -1 .*calibrates its scales"):
        model(input_ids=ids, labels=labels)
    capture.off()
    model(input_ids=ids, labels=labels)  # (forward only: every call site calibrated, no backward yet)
    capture.on()
    loss = model(input_ids=ids, labels=labels).loss
    with pytest.raises(CaptureError, match="calibrates its cotangent scales"):
        loss.backward()
    capture.off()
    del bank(model).sites[0]  # (a call site the bank has not seen: decoder layer 0)
    capture.on()
    with pytest.raises(CaptureError, match="fp8 call site 0 .*calibrates its scales"):
        model(input_ids=ids, labels=labels)


def test_capture_refuses_tuning_and_warns_of_compiling_tiles(capture, monkeypatch) -> None:
    """A stage that would be timed (no tuned tile on disk) refuses; one whose candidates still compile
    runs at its tile, with a warning that the graph keeps it."""
    tuner = tuning.Tuner(types.SimpleNamespace(ir=types.SimpleNamespace(name="layer")), emulate=True)
    monkeypatch.setattr(tuning, "emit_stage", lambda spec: "source")
    monkeypatch.setattr(tuning.tune, "lookup", lambda key: None)
    monkeypatch.setattr(tuning, "find_ptxas", lambda: "/usr/bin/ptxas")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "H100")
    r = types.SimpleNamespace(spec=None, config=None)
    ins = [torch.zeros(256, 64), torch.zeros(64, 128)]
    capture.on()
    with pytest.raises(CaptureError, match="stage 3 of layer would be tuned at 256x128x64"):
        tuner.choose(3, r, ins, [], (3, 256, 128, 64))
    tuner.background = types.SimpleNamespace(over=False)
    with pytest.warns(UserWarning, match="still compiling: the graph keeps"):
        got, final = tuner.measure(3, r, ins, [], (3, 256, 128, 64))
    assert got is r and not final
    capture.off()  # (outside a capture: the same call is the tuner's normal wait, no warning)
    assert tuner.measure(3, r, ins, [], (3, 256, 128, 64)) == (r, False)


# -- the attention mask during a capture ------------------------------------------------------------


def sdpa_llama(**extra) -> transformers.LlamaForCausalLM:
    return tiny(**{"attn_implementation": "sdpa", **extra})


def test_mask_in_capture_is_transformers_choice_outside(capture) -> None:
    """A layer with no attention mask and no position ids gets None (sdpa's causal path) during a
    capture where transformers gives that outside one (full attention; a window longer than the
    sequence); during a capture transformers itself materializes it. With a padding mask, position
    ids, eager attention or a window shorter than the sequence, the mask is transformers' own."""
    import transformers.masking_utils as mu

    def ours(model, attention_mask=None, position_ids=None):
        family = family_of(model.config.model_type, "test")
        emb = torch.zeros(2, 24, model.config.hidden_size)
        return layer_masks(model, family, emb, attention_mask, position_ids)

    def theirs(model, attention_mask=None, position_ids=None, maker=mu.create_causal_mask):
        emb = torch.zeros(2, 24, model.config.hidden_size)
        return maker(
            config=model.config,
            inputs_embeds=emb,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=position_ids,
        )

    model = sdpa_llama()
    assert theirs(model) is None  # (outside a capture: sdpa's is_causal)
    capture.on()
    assert isinstance(theirs(model), torch.Tensor)
    assert ours(model) == [None] * model.config.num_hidden_layers
    padded = torch.ones(2, 24, dtype=torch.long)
    padded[1, -4:] = 0
    positions = torch.arange(24).expand(2, 24)
    for kw in ({"attention_mask": padded}, {"position_ids": positions}):
        got, want = ours(model, **kw), theirs(model, **kw)
        assert all(torch.equal(m, want) for m in got), kw
    eager = tiny()  # (eager attention: a None mask would attend to the future)
    assert all(torch.equal(m, theirs(eager)) for m in ours(eager))
    cfg = transformers.MistralConfig(**{**HF_SHAPES, "sliding_window": 16, "attn_implementation": "sdpa"})
    mistral = transformers.MistralForCausalLM(cfg)
    want = theirs(mistral, maker=mu.create_sliding_window_causal_mask)
    assert isinstance(want, torch.Tensor) and all(torch.equal(m, want) for m in ours(mistral))
    apply_coda_to_mistral(mistral)  # (patchable: the masks above are those its forward makes)
    # a window longer than the sequence (24 tokens): transformers' choice outside a capture is None
    cfg = transformers.MistralConfig(**{**HF_SHAPES, "sliding_window": 32, "attn_implementation": "sdpa"})
    wide = transformers.MistralForCausalLM(cfg)
    assert isinstance(theirs(wide, maker=mu.create_sliding_window_causal_mask), torch.Tensor)
    capture.off()
    assert theirs(wide, maker=mu.create_sliding_window_causal_mask) is None
    capture.on()
    assert ours(wide) == [None] * cfg.num_hidden_layers


def test_captured_forward_matches_huggingface_in_capture(capture) -> None:
    """The patched model's loss and logits during a (pretended) capture, with the causal mask left to
    sdpa, equal the unpatched model's during one, with transformers' materialized mask."""
    ref = sdpa_llama()
    model = apply_coda_to_llama(sdpa_llama())
    ids, _ = hf_batch(seed=5)
    model(input_ids=ids, labels=ids)  # (the first call compiles and chooses kernels: outside the capture)
    capture.on()
    want, got = ref(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)
    capture.off()
    model(input_ids=ids)  # (the logits' head: its first call)
    capture.on()
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=2e-4, atol=2e-4)


def test_captured_sliding_window_forward_matches_huggingface_in_capture(capture) -> None:
    """The same for a sliding-window family whose window is longer than the sequence (its mask left
    to sdpa during a capture, as transformers leaves it outside one)."""
    cfg = {**HF_SHAPES, "sliding_window": 32, "attn_implementation": "sdpa"}
    torch.manual_seed(0)
    ref = transformers.MistralForCausalLM(transformers.MistralConfig(**cfg))
    model = apply_coda_to_mistral(transformers.MistralForCausalLM(transformers.MistralConfig(**cfg)))
    model.load_state_dict(ref.state_dict())
    ids, _ = hf_batch(seed=6)
    model(input_ids=ids, labels=ids)  # (outside the capture: the blocks' first call)
    capture.on()
    want, got = ref(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-5)


# -- a real capture ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize(
    "fp8, checkpointing",
    [(None, False), ("delayed", False), ("delayed", True)],
    ids=["bf16", "fp8", "fp8-ckpt"],
)
def test_gpu_captured_step_replays_as_eager_steps(fp8, checkpointing) -> None:
    """One training step (forward, backward, AdamW) captured in a CUDA graph and replayed on new
    batches gives the losses, the fp8 scales and the weights of the same steps run eagerly; with
    activation checkpointing too (its second run of each layer, in the backward, at the scales its
    first run used)."""
    from coda_lang.torch import uses_kernels, wait_for_kernels

    if not torch.cuda.is_available() or not uses_kernels("cuda"):
        pytest.skip("needs a Hopper GPU")
    batches = [hf_batch(seed=40 + i) for i in range(7)]
    batches = [(i.cuda(), lab.cuda()) for i, lab in batches]

    def make():
        model = sdpa_llama().to("cuda", torch.bfloat16)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model = apply_coda_to_llama(model, fp8=fp8)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)

    def step(model, opt, ids, labels):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        return loss.detach()

    model, opt = make()
    eager = []
    for ids, labels in batches:
        opt.zero_grad(set_to_none=True)
        eager.append(float(step(model, opt, ids, labels)))
    wait_for_kernels()
    model_g, opt_g = make()
    static_ids, static_labels = batches[0][0].clone(), batches[0][1].clone()
    replayed = []
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # (two eager steps: kernels, tiles, calibration)
        for ids, labels in batches[:2]:
            opt_g.zero_grad(set_to_none=True)
            static_ids.copy_(ids)
            static_labels.copy_(labels)
            replayed.append(float(step(model_g, opt_g, static_ids, static_labels)))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt_g.zero_grad(set_to_none=True)
    static_ids.copy_(batches[2][0])
    static_labels.copy_(batches[2][1])
    with torch.cuda.graph(graph):
        static_loss = step(model_g, opt_g, static_ids, static_labels)
    for ids, labels in batches[2:]:
        static_ids.copy_(ids)
        static_labels.copy_(labels)
        graph.replay()
        replayed.append(float(static_loss))
    torch.testing.assert_close(torch.tensor(replayed), torch.tensor(eager), rtol=2e-3, atol=2e-3)
    for (n, p), q in zip(model.named_parameters(), model_g.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=2e-2, atol=2e-3, msg=n)
    if fp8:
        a, b = bank(model), bank(model_g)
        torch.testing.assert_close(b.scales, a.scales, rtol=1e-2, atol=0)
        assert int(b.past.count) == int(a.past.count) == len(batches)
        for site, g in a.grads.items():
            torch.testing.assert_close(b.grads[site]._vec, g._vec, rtol=1e-2, atol=0)
