"""A GEMM stage's acc saved in fp8 (`BackwardOptions(fp8_acc=True)`, `coda grad --fp8-acc`): where the
stage stores a scaled fp8 copy of its acc itself (`q: e4m3 = acc * s`), the derived backward reads acc
as that copy times 1/s, and no copy of acc in the activation dtype is saved.

- Derivation: what is saved (the copy, not acc), the header's line and bytes, the copies it does not
  take (a copy of another tile, a row-scaled one, a stage whose ties need acc in f32), the options'
  checks, the CLI flag.
- Gradients: the derived backward on the interpreter in float64 against torch autograd of the same
  math, whose backward evaluates the stage's VJP at the dequantized copy (an independent reference:
  torch's own float8 type), and against finite differences' absence of that rounding (the rounding is
  really there: without fp8_acc the gradients differ). Chunked backwards are refused (not yet).
- Kernels (plan, CPU): the forward's paired gate/up stage stores the copy as its D; the SwiGLU
  backward's packed stage loads it as int16 words (tests/test_fp8_loads.py checks that load on a GPU).
- coda_lang.hf (by default; not under $CODA_FP8_SAVE_ACC=0, $CODA_FP8_PAIR_STORE=0 or
  $CODA_FP8_PAIR_LOAD=0): the fp8="delayed" layers save their gate/up acc in e4m3 at a delayed scale
  of its own (`s_u1`, kept by the bank as the other scales), a float32 model against the
  float64 fake-quant reference of that recipe, and the bf16 step's saved bytes.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from support import coda

import coda_lang
from coda_lang import BackwardOptions

torch = pytest.importorskip("torch")

E4M3_MAX = 448.0

SRC = """dims M, K, F
block swiglu(x: bf16[M, K], w: bf16[2*F, K], s_u: f32) -> (h: bf16[M, F], am_u: f32) {
  gemm x @ transpose(w) {
    uq: e4m3 = acc * s_u
    amp_u = max(abs(acc), over=2*F)
    gt, up = pairs(acc)
    h: bf16 = silu(gt) * up
  }
  am_u = detach(max(amp_u, over=M))
}
"""


def swiglu() -> coda_lang.Block:
    return next(iter(coda_lang.load(SRC)))


def test_the_backward_reads_acc_from_the_stages_copy() -> None:
    blk = swiglu()
    plain = blk.derivation(["x", "w"])
    got = blk.derivation(["x", "w"], backward=BackwardOptions(fp8_acc=True))
    assert plain.saved == ("acc1",) and got.saved == ("uq",)
    bwd = str(got.backward)
    assert "# saved per row: 2*F bytes" in bwd and "# saved per row: 4*F bytes" in str(plain.backward)
    assert "stage 1's acc read as uq * (1 / s_u), no copy of acc saved" in bwd
    (uq,) = [o for o in got.forward.ir.outputs if o.name == "uq"]
    assert uq.type is not None and uq.type.dtype == "e4m3"
    # the detached amax needs no f32 acc (its reduction has no backward)
    assert "acc1: bf16" in str(plain.backward)


@pytest.mark.parametrize(
    "line",
    [
        "uq: e4m3 = gt * s_u",  # a copy of another tile
        "uq: e4m3 = acc * v",  # scaled per column
        "uq: bf16 = acc * s_u",  # not fp8
    ],
)
def test_copies_it_does_not_read_as_acc(line: str) -> None:
    src = SRC.replace("uq: e4m3 = acc * s_u", line.replace("gt", "acc") if "gt" in line else line)
    src = src.replace("s_u: f32)", "s_u: f32, v: f32[2*F])")
    if "gt" in line:  # (a copy of the half-width gate: at its own width)
        src = src.replace("    uq: e4m3 = acc * s_u\n", "").replace(
            "    h: bf16", "    uq: e4m3 = gt * s_u\n    h: bf16"
        )
    blk = next(iter(coda_lang.load(src)))
    d = blk.derivation(["x", "w"], backward=BackwardOptions(fp8_acc=True))
    assert "acc1" in d.saved and "uq" not in d.saved, d.saved


def test_without_a_copy_the_header_says_the_option_changed_nothing() -> None:
    src = SRC.replace("    uq: e4m3 = acc * s_u\n", "")
    d = next(iter(coda_lang.load(src))).derivation(["x", "w"], backward=BackwardOptions(fp8_acc=True))
    assert d.saved == ("acc1",)
    assert "no stage whose acc is saved stores a scaled fp8 copy of it" in str(d.backward)
    assert "fp8 acc" not in str(swiglu().derivation(["x", "w"]).backward)


def test_where_ties_need_acc_in_f32_the_copy_is_not_read() -> None:
    """A max over acc whose gradient is wanted compares acc with the max bit for bit: acc stays saved in
    f32, fp8_acc or not."""
    src = SRC.replace("am_u = detach(max(amp_u, over=M))", "am_u = max(amp_u, over=M)")
    blk = next(iter(coda_lang.load(src)))
    d = blk.derivation(["x", "w"], backward=BackwardOptions(fp8_acc=True))
    assert "uq" not in d.saved
    assert "acc1: f32" in str(d.backward)


def test_options() -> None:
    with pytest.raises(TypeError, match="fp8_acc= is 1"):
        BackwardOptions(fp8_acc=1)  # type: ignore[arg-type]
    o = BackwardOptions(fp8_grads="e5m2", fp8_acc=True)
    assert o.flags() == ["--fp8-grads", "e5m2", "--fp8-acc"]
    assert "fp8_acc=True" in str(o)
    assert BackwardOptions.of(None, fp8_acc=True) == BackwardOptions(fp8_acc=True)


def test_cli_flag(tmp_path) -> None:
    f = tmp_path / "s.coda"
    f.write_text(SRC)
    on = coda("grad", f, "--fp8-acc")
    off = coda("grad", f)
    assert on.returncode == 0 and off.returncode == 0, (on.stderr, off.stderr)
    assert "# saved tensors (stored by the forward): uq\n" in on.stdout and "uq: e4m3[M, 2*F]" in on.stdout
    assert "# saved tensors (stored by the forward): acc1\n" in off.stdout and "fp8 acc" not in off.stdout


# ---------------------------------------------------------------------------------------------------
# gradients against torch autograd


def inputs(m: int = 12, k: int = 16, f: int = 24, seed: int = 0) -> dict[str, np.ndarray | float]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(m, k)).astype(np.float32)
    w = rng.normal(size=(2 * f, k)).astype(np.float32) / 4
    to_bf16 = lambda a: torch.from_numpy(a).to(torch.bfloat16).float().numpy()  # noqa: E731
    x, w = to_bf16(x), to_bf16(w)
    amax = float(np.abs(x.astype(np.float64) @ w.T.astype(np.float64)).max())
    return {"x": x, "w": w, "s_u": 2.0 ** np.floor(np.log2(E4M3_MAX / amax))}


def reference(ins: dict, cot: np.ndarray, fp8: bool) -> dict[str, np.ndarray]:
    """torch autograd of h = silu(gt) * up of acc's column pairs, exactly; with `fp8`, its backward
    evaluating that VJP at acc as the kernel saves it, q(acc * s) / s with q torch's float8_e4m3fn
    (test_hf_fp8.SavedSwiGLU, its row scale 1)."""
    from test_hf_fp8 import SavedSwiGLU

    x = torch.tensor(ins["x"], dtype=torch.float64, requires_grad=True)
    w = torch.tensor(ins["w"], dtype=torch.float64, requires_grad=True)
    acc = x @ w.T
    s = torch.tensor(ins["s_u"], dtype=torch.float64)
    if "r" in ins:
        s = torch.tensor(ins["r"], dtype=torch.float64)[:, None] * s
    pairs, one = (acc[:, 0::2], acc[:, 1::2]), torch.ones((), dtype=torch.float64)
    h = SavedSwiGLU.apply(*pairs, one, s) if fp8 else SavedSwiGLU.f(*pairs, one)
    dx, dw = torch.autograd.grad(h, [x, w], torch.tensor(cot, dtype=torch.float64))
    return {"x": dx.numpy(), "w": dw.numpy()}


@pytest.mark.parametrize("per_row", [False, True])
def test_gradients_against_torch_autograd_of_the_same_math(per_row: bool) -> None:
    """The scale a scalar, or a vector over the rows (`c = r * s_u`, as coda_lang.hf's copy of the
    normalized pre-activations)."""
    ins = inputs()
    blk = swiglu()
    if per_row:
        src = SRC.replace("s_u: f32)", "s_u: f32, r: f32[M])").replace(
            "  gemm x @ transpose(w) {\n    uq: e4m3 = acc * s_u",
            "  c = r * s_u\n  gemm x @ transpose(w) {\n    uq: e4m3 = acc * c",
        )
        blk = next(iter(coda_lang.load(src)))
        ins["r"] = 2.0 ** np.random.default_rng(7).integers(-2, 3, 12)
        assert "stage 1's acc read as uq * (1 / c)" in str(
            blk.derivation(["x", "w"], backward=BackwardOptions(fp8_acc=True)).backward
        )
    cot = np.random.default_rng(5).normal(size=(12, 24))
    cots = {"h": cot, "am_u": np.float64(0.0)}
    got = blk.vjp(ins, cots, precision="f64", wrt=["x", "w"], backward=BackwardOptions(fp8_acc=True))
    exact = blk.vjp(ins, cots, precision="f64", wrt=["x", "w"])
    for name in ("x", "w"):
        want = reference(ins, cot, fp8=True)[name]
        plain = reference(ins, cot, fp8=False)[name]
        np.testing.assert_allclose(got[name], want, rtol=1e-10, atol=1e-10 * np.abs(want).max())
        np.testing.assert_allclose(exact[name], plain, rtol=1e-10, atol=1e-10 * np.abs(plain).max())
        # the rounding is really there: fp8 codes are 2^-3 apart relative to their value
        assert np.abs(got[name] - exact[name]).max() > 1e-3 * np.abs(plain).max(), name


def test_chunked_backwards_are_refused_not_run_without_the_copy() -> None:
    with pytest.raises(ValueError, match="does not run in chunks yet"):
        BackwardOptions(fp8_acc=True, chunk=8)
    blk = swiglu()
    cots = {"h": np.zeros((12, 24)), "am_u": np.float64(0.0)}
    with pytest.raises(ValueError, match="does not run in chunks yet"):
        blk.vjp(inputs(), cots, wrt=["x", "w"], fp8_acc=True, chunk=8)


# ---------------------------------------------------------------------------------------------------
# the kernels' plan


def test_the_kernels_store_the_copy_as_d_and_load_it_as_words() -> None:
    from coda_lang.backend_cute.plan.planner import plan_stage
    from coda_lang.backend_cute.plan.spec import FP8_WORDS
    from coda_lang.hf.blocks import model_source

    prog = coda_lang.load(model_source("bfloat16", 1e-5, 64, None, fp8="delayed", fp8_save=True))
    for name in ("layer", "last"):
        d = prog[name].derivation(None, backward=BackwardOptions(fp8_grads="e5m2", fp8_acc=True))
        assert "u1q" in d.saved and not any(
            s.startswith("acc") and s != "acc5" and s != "acc7" for s in d.saved
        )
        fwd = [plan_stage(d.forward, k) for k, st in enumerate(d.forward.ir.stages, 1) if st.a is not None]
        (gate_up,) = [s for s in fwd if s.d is not None and s.d.name == "u1q"]
        assert gate_up.d.dtype == "e4m3" and gate_up.mode == "acc_pair"
        bwd = [plan_stage(d.backward, k) for k, st in enumerate(d.backward.ir.stages, 1) if st.a is not None]
        loads = [(o.name, o.host) for s in bwd for o in s.operands if o.name == "u1q"]
        assert loads == [("u1q", FP8_WORDS)], loads


def test_the_save_is_the_default_where_the_kernels_can_run_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from coda_lang.hf.state import fp8_save

    for var in ("CODA_FP8_SAVE_ACC", "CODA_FP8_PAIR_STORE", "CODA_FP8_PAIR_LOAD"):
        monkeypatch.delenv(var, raising=False)
    assert fp8_save("delayed") and not fp8_save("delayed-forward") and not fp8_save(None)
    for var in ("CODA_FP8_SAVE_ACC", "CODA_FP8_PAIR_STORE", "CODA_FP8_PAIR_LOAD"):
        monkeypatch.setenv(var, "0")
        assert not fp8_save("delayed"), var
        monkeypatch.delenv(var)


def test_a_state_saved_with_the_other_save_says_how_to_resume(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp8 checkpoint of a model that saved its gate/up acc in bf16 (as before the e4m3 save was the
    default), loaded into one that saves it in e4m3, and the other way round: refused at the next
    forward with the variable that resumes it, and resumed with it."""
    from test_hf_fp8 import tiny

    from coda_lang.hf import apply_coda_to_llama, fp8_state_dict, load_fp8_state_dict

    ids = torch.randint(0, 64, (2, 16))
    for saved_on in (False, True):
        _saving(monkeypatch, saved_on)
        m = apply_coda_to_llama(tiny(), fp8="delayed")
        m(input_ids=ids, labels=ids).loss.backward()
        state = fp8_state_dict(m)
        _saving(monkeypatch, not saved_on)
        other = apply_coda_to_llama(tiny(), fp8="delayed")
        load_fp8_state_dict(other, state)
        fix = "unset CODA_FP8_SAVE_ACC" if saved_on else "set CODA_FP8_SAVE_ACC=0"
        with pytest.raises(ValueError, match=fix):
            other(input_ids=ids, labels=ids)
        _saving(monkeypatch, saved_on)
        again = apply_coda_to_llama(tiny(), fp8="delayed")
        load_fp8_state_dict(again, state)
        again(input_ids=ids, labels=ids).loss.backward()  # (resumed: no refusal)


def test_a_state_saved_with_the_other_out_projection_says_how_to_resume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An fp8 checkpoint of a model whose out-projection ran in bf16 ($CODA_FP8_OUT=0), loaded into one
    that runs it in e4m3 (the default), and the other way round, the gate/up save the same or (both=True)
    the other way too: refused at the next forward with every variable that resumes it, and resumed
    once the environment is set as the message says."""
    from test_hf_fp8 import tiny

    from coda_lang.hf import apply_coda_to_llama, fp8_state_dict, load_fp8_state_dict

    def patched(out_on: bool, save_on: bool) -> Any:
        monkeypatch.setenv("CODA_FP8_OUT", "1" if out_on else "0")
        _saving(monkeypatch, save_on)
        return apply_coda_to_llama(tiny(), fp8="delayed")

    ids = torch.randint(0, 64, (2, 16))
    for out_on in (False, True):
        for both in (False, True):
            m = patched(out_on, True)
            m(input_ids=ids, labels=ids).loss.backward()
            state = fp8_state_dict(m)
            other = patched(not out_on, not both)
            load_fp8_state_dict(other, state)
            # (what sets the saved model's setting again: on is the default)
            fix = "unset CODA_FP8_OUT" if out_on else "set CODA_FP8_OUT=0"
            with pytest.raises(ValueError, match=fix) as got:
                other(input_ids=ids, labels=ids)
            assert ("unset CODA_FP8_SAVE_ACC" in str(got.value)) == both, got.value
            # (as the message says: the out-projection's setting, and the save's default)
            if out_on:
                monkeypatch.delenv("CODA_FP8_OUT")
            else:
                monkeypatch.setenv("CODA_FP8_OUT", "0")
            _saving(monkeypatch, True)
            again = apply_coda_to_llama(tiny(), fp8="delayed")
            load_fp8_state_dict(again, state)
            again(input_ids=ids, labels=ids).loss.backward()  # (resumed: no refusal)


def test_an_f16_models_blocks_with_the_save_plan_for_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The save in an f16 model (not only bf16): every GEMM stage of its blocks, forward and backward,
    plans for the kernels, the gate/up stages storing the e4m3 copy as their D and the SwiGLU backward
    loading it as int16 words beside its e5m2 pairs."""
    from test_hf import FAMILIES, make

    from coda_lang.backend_cute.plan.planner import plan_stage
    from coda_lang.backend_cute.plan.spec import FP8_WORDS

    _saving(monkeypatch, True)
    st = FAMILIES["llama"][2](make("llama", torch.float16), fp8="delayed")._coda
    assert st.fp8_save
    copies, loads = [], []
    for fn in (st.first, st.layer, st.last):
        d = fn.block.derivation(fn.wrt, backward=fn.options)
        for blk in (d.forward, d.backward):
            for k, stage in enumerate(blk.ir.stages, 1):
                if stage.a is None:
                    continue
                spec = plan_stage(blk, k)
                if spec.d is not None and spec.d.name == "u1q":
                    copies.append((fn.name, spec.d.dtype))
                loads += [(fn.name, o.dtype) for o in spec.operands if o.host == FP8_WORDS]
    assert copies == loads == [("layer", "e4m3"), ("last", "e4m3")], (copies, loads)


def test_model_source_refuses_a_save_without_fp8_cotangents() -> None:
    from coda_lang.hf.blocks import model_source

    for fp8 in (None, "delayed-forward"):
        with pytest.raises(ValueError, match="fp8_save needs fp8 cotangents"):
            model_source("bfloat16", 1e-5, 64, None, fp8=fp8, fp8_save=True)


# ---------------------------------------------------------------------------------------------------
# coda_lang.hf


def _saving(monkeypatch: pytest.MonkeyPatch, on: bool) -> None:
    """The save on (the default: no variable) or off ($CODA_FP8_SAVE_ACC=0)."""
    if on:
        monkeypatch.delenv("CODA_FP8_SAVE_ACC", raising=False)
    else:
        monkeypatch.setenv("CODA_FP8_SAVE_ACC", "0")


def test_hf_model_against_the_fake_quant_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8="delayed" with the gate/up acc saved in e4m3, float32 model, second step: the loss is the
    model's without the save (the forward is the same), the bank keeps the copy's scale `u1` as
    448 / the amax of the acc, and every gradient is close to the float64 reference of the recipe
    whose SwiGLU backward reads the acc quantized at the scales the model ran at; the model without
    the save is much further from that reference for the parameters upstream of a SwiGLU."""
    from test_hf_fp8 import (
        AFTER_THE_LAST_GEMM,
        _rel,
        bank,
        grads_ran_at,
        hf_batch,
        ran_at,
        reference_loss,
        tiny,
    )

    from coda_lang.hf import apply_coda_to_llama, unfused_grads

    base = tiny()
    ids, labels = hf_batch()
    models, losses = {}, {}
    for on in (True, False):
        _saving(monkeypatch, on)
        m = models[on] = apply_coda_to_llama(copy.deepcopy(base), fp8="delayed")
        assert m._coda.fp8_save is on
        for _ in range(2):
            m.zero_grad()
            loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
        losses[on] = loss.item()
    assert losses[True] == losses[False]
    # not degenerate: the gradients stay those of the recipe without the save but for e4m3's rounding
    # of the acc the SwiGLU backward reads (a copy at a scale off by orders of magnitude would
    # saturate or flush it, and the gradients upstream of the SwiGLU would collapse)
    near = {n: _rel(g, unfused_grads(models[False])[n]) for n, g in unfused_grads(models[True]).items()}
    assert max(near.values()) < 0.3, near
    model = models[True]
    first, layers = ran_at(model)
    assert all("u1" in sc for sc in layers), [sorted(sc) for sc in layers]
    ref = copy.deepcopy(base).double()
    want = reference_loss(ref, ids, labels, first, layers, grads_ran_at(model), saved=layers)
    want.backward()
    assert abs(losses[True] - want.item()) < 1e-5 * abs(want.item())
    got, without = unfused_grads(model), unfused_grads(models[False])
    refs = dict(ref.named_parameters())
    mlp_upstream = 0
    for name, g in got.items():
        w = refs[name].grad
        e, o = _rel(g, w), _rel(without[name], w)
        assert e < 1e-2, (name, e)
        if name not in AFTER_THE_LAST_GEMM and "down_proj" not in name and "layers.2.post" not in name:
            mlp_upstream += o > 3 * e
    assert mlp_upstream >= len(got) // 2, mlp_upstream
    # the copy's amax is the gate/up acc's: the bank recorded one per layer
    assert all("u1" in a for a in bank(model).amaxes.values() if "w_13" in a)


@pytest.mark.gpu
def test_gpu_saved_acc_model_as_the_emulated_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model with the gate/up acc saved in e4m3, on a Hopper GPU (the kernels: the paired gate/up
    stage storing the e4m3 copy as its D, the SwiGLU backward loading it as int16 words) against the
    same model on the CPU (the kernels' torch stand-ins), two steps: the same loss, and gradients as
    close as those of the recipe without the save, GPU against CPU. (A bf16 model's e5m2 cotangents
    land on different codes between the two often enough that their gradients differ by several
    percent even without the save: that difference is the yardstick.)"""
    from test_hf_fp8 import _rel, tiny

    from coda_lang.hf import apply_coda_to_llama, unfused_grads
    from coda_lang.torch import uses_kernels

    if not torch.cuda.is_available() or not uses_kernels("cuda"):
        pytest.skip("needs a Hopper GPU")
    shapes = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64, vocab_size=512)
    base = tiny(torch.bfloat16, num_hidden_layers=2, **shapes)
    ids = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(3))
    got = {}
    for on in (True, False):
        _saving(monkeypatch, on)
        for device in ("cpu", "cuda"):
            m = apply_coda_to_llama(copy.deepcopy(base).to(device), fp8="delayed")
            assert m._coda.fp8_save is on
            for _ in range(2):
                m.zero_grad()
                loss = m(input_ids=ids.to(device), labels=ids.to(device)).loss
                loss.backward()
            got[on, device] = (loss.item(), {n: g.cpu() for n, g in unfused_grads(m).items()})
    (l_cpu, g_cpu), (l_gpu, g_gpu) = got[True, "cpu"], got[True, "cuda"]
    assert abs(l_cpu - l_gpu) < 2e-3 * abs(l_cpu), (l_cpu, l_gpu)
    base_cpu, base_gpu = got[False, "cpu"][1], got[False, "cuda"][1]
    for name, g in g_gpu.items():
        assert torch.isfinite(g).all(), name
        e, yard = _rel(g, g_cpu[name]), _rel(base_gpu[name], base_cpu[name])
        assert e < max(0.05, 1.5 * yard), (name, e, yard)


# ---------------------------------------------------------------------------------------------------
# coda fuzz --fp8-acc

EXAMPLE = "examples/fp8_mlp_save.coda"
FUZZ = ["--fp8-grads", "e5m2", "--fp8-acc", "--wrt", "x,w13,w2"]


def test_fuzz_checks_the_backward_that_reads_the_copy() -> None:
    """`coda fuzz FILE --fp8-acc`: the backward under test and its references are the one that reads
    acc from the copy (the example's e5m2 cotangents and e4m3 copy, the kernels' torch stand-ins). (The
    command's own run: the GPU test below, which reads its report.)"""
    from pathlib import Path

    from coda_lang.fuzz.fuzzer import Fuzzer
    from coda_lang.fuzz.search import fuzz_block

    blk = next(iter(coda_lang.load(Path(__file__).resolve().parent.parent / EXAMPLE)))
    fz = Fuzzer(blk, "emulate", fp8_grads="e5m2", fp8_acc=True, wrt=["x", "w13", "w2"])
    assert fz.derivation is not None and "uq" in fz.derivation.saved and fz.options.fp8_acc
    res = fuzz_block(blk, "emulate", examples=4, fuzzer=fz)
    assert res.failure is None, res.failure


@pytest.mark.parametrize(
    "extra, why",
    [
        (["--chunk", "4"], "--fp8-acc runs the backward unchunked"),
        (["--no-backward"], "--fp8-acc chooses what FILE's backward saves"),
    ],
)
def test_fuzz_flag_usage_errors(extra: list[str], why: str) -> None:
    r = coda("fuzz", EXAMPLE, "--fp8-acc", "--target", "interp", *extra)
    assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.gpu
def test_gpu_fuzz_of_the_example_on_the_kernels() -> None:
    """The example's forward (the paired gate/up stage storing the e4m3 copy as its D) and backward (the
    packed SwiGLU stage reading it as int16 words beside its e5m2 pairs) on the CuTeDSL kernels against
    the interpreter, ordinary and special values."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    for special in ([], ["--special"]):
        r = coda("fuzz", EXAMPLE, *FUZZ, "--target", "cuda", "--examples", "12", "-q", *special)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "ok: fp8_mlp_save: 12 cases" in r.stdout and "--fp8-acc" in r.stdout, r.stdout
