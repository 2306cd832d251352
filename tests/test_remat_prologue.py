"""The saved-tensor policy's second kind of recomputation: an elementwise stage at the start of the
backward that makes a saved tile again (autodiff/prologue.py, chosen by autodiff/policy.py).

- The fp8 Llama layer of coda_lang.hf (fp8="delayed"): under remat auto its backward no longer saves
  the e4m3 weight copies `w_13q`, `w_2q` (made again by elementwise stages [2*F, D] and [D, F] at its
  start, no amax in them), under "save" it still does; `x1q` and `x2q` (their stages' uses see the
  f32 values of x1 and x2, the backward holds only their bf16 stores: not bit for bit) stay saved, each with its reason; the saved bytes fall by the two copies, `3*D*F`, and the header's per
  row line counts only tensors of M rows.
- The same layer quantizing the stored bf16 values (`cast(x2, bf16) * g2`): `x2q` is made again too,
  at the backward's start from the saved `x2`, and `x1q` from `x1` by the same stage (its stage is
  remat="rebuild": not by the gate/up data gradient's epilogue, as "auto" would; with "save" it stays).
- A block of this file's own (two weights quantized by elementwise stages, each copy read first by a
  data-gradient GEMM): both copies made by one stage over [N, K].
- Bit for bit: the gradients of the derived backward on the interpreter equal those of the
  derivation without the second kind (and of "save", where auto recomputes nothing else), for
  fp8_grads None and "e5m2"; on the emulated CUDA runtime too.
- The GPU path: every GEMM stage of the new backwards plans (emulated=False) and emits; the new
  elementwise stages are generated Triton kernels (their source stores e4m3), and the generated
  kernel, run by Triton's CPU interpreter, makes the copies bit for bit.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

import coda_lang
import coda_lang.autodiff.policy as policy
from coda_lang.autodiff.assemble import fixed_bytes, row_bytes, token_rows
from coda_lang.autodiff.forward import ForwardFacts
from coda_lang.autodiff.prologue import NotExact, chain
from coda_lang.hf.blocks import model_source
from coda_lang.ir.nodes import Stage
from coda_lang.testing.inputs import block_inputs, cotangents

WRT = ["y", "x", "w_o", "g1", "w_13", "w_2", "g2", "w_qkv"]
SIZES = {"M": 48, "D": 64, "F": 96, "K": 64, "P": 64}
SCALES = ["s_x1", "s_w_13", "s_a", "s_w_2", "s_x2", "s_w_qkv"]

OWN = """dims M, K, N

block qmlp(x: bf16[M, K], u: bf16[M, K], w: bf16[N, K], v: bf16[N, K], g: f32[K],
           s_x: f32, s_u: f32, s_w: f32, s_v: f32) -> (y: bf16[M, N], am_w: f32) {
  elementwise [N, K] {
    wq: e4m3 = w * s_w
    amp_w = max(abs(w), over=K)
  }
  am_w = detach(max(amp_w, over=N))
  elementwise [N, K] {
    vq: e4m3 = v * s_v
  }
  elementwise [M, K] {
    xq: e4m3 = x * g * s_x
    uq: e4m3 = u * s_u
  }
  i = 1.0 / (s_x * s_w)
  j = 1.0 / (s_u * s_v)
  gemm xq @ transpose(wq) {
    h: bf16 = acc * i
  }
  gemm uq @ transpose(vq) {
    y = acc * j + h * h
  }
}
"""
OWN_SIZES = {"M": 40, "K": 64, "N": 48}


def _layer_source(cast: bool = True, stage: str | None = "rebuild") -> str:
    """The hf fp8 layer; it quantizes the stored bf16 x1 and x2 (`cast(x1, bf16) * g1`); `cast=False`:
    their f32 values, as it did before (the case an elementwise stage can't make again bit for bit).
    `stage`: the out-projection stage's policy (hf's: "rebuild"; None: no option, the block-wide one)."""
    src = model_source("bfloat16", 1e-5, 64, None, fp8="delayed")
    assert src.count("cast(x1, bf16) * g1") == 2 and src.count("cast(x2, bf16) * g2") == 1
    if not cast:
        src = src.replace("x1g = cast(x1, bf16) * g1", "x1g = x1 * g1")
        src = src.replace("x2g = cast(x2, bf16) * g2", "x2g = x2 * g2")
    assert src.count(', remat="rebuild"') == 2  # (the blocks `layer` and `last`)
    return src.replace(', remat="rebuild"', f', remat="{stage}"' if stage else "")


def _layer(**kw: Any) -> coda_lang.Block:
    return coda_lang.load(_layer_source(**kw))["layer"]


def _own() -> coda_lang.Block:
    return coda_lang.load(OWN)["qmlp"]


@contextmanager
def _first_kind_only() -> Iterator[None]:
    """The policy as it was before the second kind: no tile is made at the backward's start."""
    real = policy._startable
    policy._startable = lambda *a: ("(the second kind is off in this test)", None)  # type: ignore[assignment]
    try:
        yield
    finally:
        policy._startable = real  # type: ignore[assignment]


def _options(remat: str, fp8: str | None) -> coda_lang.BackwardOptions:
    return coda_lang.BackwardOptions(remat=remat, fp8_grads=fp8)


def _start_stages(bwd: coda_lang.Block) -> list[Stage]:
    """The elementwise stages before the backward's first GEMM or cotangent read."""
    out = []
    for s in bwd.ir.body:
        if not isinstance(s, Stage):
            continue
        if s.is_gemm or not all(
            e.outs[0].annot is not None and e.outs[0].annot.startswith("e4") for e in s.body[-1:]
        ):
            break
        out.append(s)
    return out


def _eqn(e: Any) -> str:
    """An equation as `out: annot = op(ins)`."""
    ins = ", ".join(a.name if hasattr(a, "name") else repr(a.value) for a in e.ins)
    return f"{e.outs[0].name}: {e.outs[0].annot} = {e.op}({ins})"


def _header(bwd: coda_lang.Block, what: str) -> str:
    line = next((n for n in bwd.ir.notes if n.startswith(what)), None)
    return line or ""


# ---------------------------------------------------------------------------- what is saved


@pytest.mark.parametrize("fp8", [None, "e5m2"])
def test_fp8_layer_recomputes_its_weight_copies_at_the_start(fp8: str | None) -> None:
    blk = _layer(cast=False)
    auto = blk.derivation(WRT, backward=_options("auto", fp8))
    save = blk.derivation(WRT, backward=_options("save", fp8))
    assert {"w_13q", "w_2q", "x1q", "x2q"} <= set(save.saved)
    assert not {"w_13q", "w_2q", "w_qkvq"} & set(auto.saved)
    assert {"x1q", "x2q"} <= set(auto.saved)  # (see the next test)
    assert [o.name for o in auto.forward.ir.outputs if o.name in ("w_13q", "w_2q")] == []
    # the backward starts with one elementwise stage per copy, over the weight's shape, storing e4m3
    # from the weight and its scale: the same equation as the forward's, no amax
    starts = _start_stages(auto.backward)
    got = {(str(s.shape[0]), str(s.shape[1])): [_eqn(e) for e in s.body] for s in starts if s.shape}
    assert got == {
        ("2*F", "D"): ["w_13q: e4m3 = mul(w_13, s_w_13)"],
        ("D", "F"): ["w_2q: e4m3 = mul(w_2, s_w_2)"],
    }, got
    assert not any(e.op == "reduce_max" for s in starts for e in s.body)
    params = {p.var.name for p in auto.backward.ir.params}
    assert {"w_13", "s_w_13", "w_2", "s_w_2"} <= params and not {"w_13q", "w_2q"} & params
    notes = "\n".join(auto.report)
    for name, src, less in (("w_13q", "`w_13`, `s_w_13`", "2*D*F"), ("w_2q", "`w_2`, `s_w_2`", "D*F")):
        assert re.search(
            rf"`{name}` \(line \d+\) is recomputed by an elementwise stage at the backward's start from "
            rf"{re.escape(src)}, bit for bit as the forward stores it, not saved: {re.escape(less)} bytes "
            r"\(not per row\) less \(--remat auto\)",
            notes,
        ), notes
    assert "recomputed by an elementwise stage" not in "\n".join(save.report)


def test_fp8_layer_keeps_what_it_cannot_make_bit_for_bit() -> None:
    """x2q's stage computes it from x2's f32 value (`x2: bf16 = acc * ia + x1` then `x2 * g2` in the
    same epilogue), which the backward does not hold (only x2's bf16 store, and no f32 acc): it stays
    saved, saying so; so does x1q (its stage, remat="rebuild", allows no epilogue to recompute it; with
    remat="save" it is not a candidate at all)."""
    d = _layer(cast=False).derivation(WRT, backward=_options("auto", "e5m2"))
    line = next(n for n in d.report if n.startswith("`x2q`"))
    assert "stays saved" in line and "bit for bit" in line and "through `x2`" in line, line
    line = next(n for n in d.report if n.startswith("`x1q`"))
    assert "stays saved: no epilogue recomputes it under rebuild" in line and "through `x1`" in line, line
    assert {"x1q", "x2q"} <= set(d.saved)
    saved = _layer(cast=False, stage="save").derivation(WRT, backward=_options("auto", "e5m2"))
    assert "x1q" not in "\n".join(saved.report) and "x1q" in saved.saved
    fwd = ForwardFacts(_layer(cast=False).ir, _layer(cast=False).plan, WRT)
    with pytest.raises(NotExact, match="stage 3's acc in f32.*through `x1`"):
        chain(fwd, "x1q")


def test_quantizing_the_stored_values_lets_x2q_and_x1q_go() -> None:
    """With `cast(x2, bf16) * g2` (exactly the stored x2: what the hf fp8 blocks write), x2q is made at
    the backward's start from the saved x2, over [M, D]; so is x1q from the saved x1 (its stage is
    remat="rebuild"), by the same stage. With remat="save" on its stage x1q stays saved; with no option
    (auto), the epilogue that runs its own stage's backward stores it (the first kind, tried first)."""
    d = _layer(cast=True).derivation(WRT, backward=_options("auto", "e5m2"))
    assert not {"w_13q", "w_2q", "x1q", "x2q"} & set(d.saved) and {"x1", "x2"} <= set(d.saved)
    (st,) = [s for s in _start_stages(d.backward) if any(e.outs[0].name == "x2q" for e in s.body)]
    assert st.shape is not None and [str(x) for x in st.shape] == ["M", "D"]
    # cast(x, bf16) is the loaded x itself
    assert [_eqn(e) for e in st.body] == [
        "x1g: None = mul(x1, g1)",
        "x1q: e4m3 = mul(x1g, s_x1)",
        "x2g: None = mul(x2, g2)",
        "x2q: e4m3 = mul(x2g, s_x2)",
    ]
    report = "\n".join(d.report)
    assert re.search(
        r"`x2q` \(line \d+\) is recomputed by an elementwise stage .* from `x2`, `g2`, `s_x2`", report
    )
    assert re.search(
        r"`x1q` \(line \d+\) is recomputed by an elementwise stage .* from `x1`, `g1`, `s_x1`, bit for bit "
        r"as the forward stores it, not saved: D bytes per row less \(remat=\"rebuild\" on the stage\)",
        report,
    ), report
    saved = _layer(cast=True, stage="save").derivation(WRT, backward=_options("auto", "e5m2"))
    assert "x1q" in saved.saved and not {"w_13q", "w_2q", "x2q"} & set(saved.saved)
    free = _layer(cast=True, stage=None).derivation(WRT, backward=_options("auto", "e5m2"))
    assert not {"w_13q", "w_2q", "x1q", "x2q"} & set(free.saved)
    assert re.search(
        r"`x1q` \(line \d+\) is recomputed in the epilogue that runs stage 3's backward",
        "\n".join(free.report),
    )
    # a block-wide rebuild: no epilogue recomputes anything, no GEMM runs again; the copies go
    rb = _layer(cast=True, stage=None).derivation(WRT, backward=_options("rebuild", "e5m2"))
    # (aq stays: it quantizes a's f32 value, which no start stage has; w_qkvq is made at the start)
    assert not {"w_13q", "w_2q", "x1q", "x2q", "w_qkvq"} & set(rb.saved) and "aq" in rb.saved
    assert "recomputed in the epilogue" not in "\n".join(rb.report)


def test_own_block_makes_both_weight_copies_in_one_stage() -> None:
    blk = _own()
    for fp8 in (None, "e5m2"):
        auto = blk.derivation(backward=_options("auto", fp8))
        save = blk.derivation(backward=_options("save", fp8))
        assert {"wq", "vq"} <= set(save.saved) and not {"wq", "vq", "xq", "uq"} & set(auto.saved)
        (first, *_) = _start_stages(auto.backward)
        assert first.shape is not None and [str(x) for x in first.shape] == ["N", "K"]
        assert [_eqn(e) for e in first.body] == ["wq: e4m3 = mul(w, s_w)", "vq: e4m3 = mul(v, s_v)"]
        # the data-gradient GEMMs read the copies first, after the stage
        gemms = [s for s in auto.backward.ir.body if isinstance(s, Stage) and s.is_gemm]
        assert {s.b.name for s in gemms[:2] if s.b is not None} == {"wq", "vq"}


def test_saved_bytes_fall_by_the_weight_copies() -> None:
    """The bytes the fp8 layer's saved tensors hold at Llama-3.2-1B's sizes (tokens 4096): the two
    copies' fall (3*D*F bytes, 48 MiB); per row of M nothing grows; the header says it honestly
    (the weights' copies on a line of their own, not as bytes per row). With the hf blocks' x2q made
    from the stored x2, M*D bytes more fall."""
    blk = _layer(cast=False)
    sizes = {"M": 4096, "D": 2048, "F": 8192, "K": 2048, "P": 1536}

    def held(d: Any) -> tuple[int, int, dict[str | None, Any], dict[tuple[str, ...], Any]]:
        types = {p.var.name: p.var.type for p in d.backward.ir.params}
        saved = [types[n] for n in d.saved]
        total = sum(
            int(np.prod([int(x.evaluate(sizes)) for x in t.shape]))
            * (1 if t.dtype.startswith("e") else 2 if t.dtype == "bf16" else 4)
            for t in saved
        )
        rows = token_rows(d.forward.ir)
        assert rows == "M"
        return total, len(saved), row_bytes(saved, rows), fixed_bytes(saved, rows)

    with _first_kind_only():
        before = held(
            coda_lang.load(_layer_source(cast=False))["layer"].derivation(
                WRT, backward=_options("auto", "e5m2")
            )
        )
    after = held(blk.derivation(WRT, backward=_options("auto", "e5m2")))
    save = held(blk.derivation(WRT, backward=_options("save", "e5m2")))
    assert before[0] - after[0] == 3 * 2048 * 8192
    assert after[2] == before[2]  # per row: the same
    assert before[3] == {("D", "F"): 3} and after[3] == {}
    assert save[3] == {("D", "F"): 3, ("D", "P"): 2}
    assert after[0] < before[0] < save[0]
    hf = held(_layer().derivation(WRT, backward=_options("auto", "e5m2")))
    assert after[0] - hf[0] == 2 * 4096 * 2048  # x2q and x1q
    bwd = blk.derivation(WRT, backward=_options("save", "e5m2")).backward
    assert _header(bwd, "saved per row:").startswith("saved per row: 6*D + 5*F + 4*P + 16 bytes")
    assert _header(bwd, "saved, not per row of M:") == (
        "saved, not per row of M: w_qkvq 2*D*P, w_2q D*F, w_13q 2*D*F (3*D*F + 2*D*P bytes)"
    )
    assert "w_13q" not in _header(bwd, "saved bytes per row:")
    auto = blk.derivation(WRT, backward=_options("auto", "e5m2")).backward
    assert _header(auto, "saved per row:").startswith("saved per row: 6*D + 4*F + 4*P + 16 bytes")
    assert _header(auto, "saved, not per row") == ""


def test_coda_grad_prints_what_the_fp8_layer_saves(tmp_path: Any) -> None:
    """`coda grad --block layer --fp8-grads e5m2`: the header's saved tensors have no weight copy
    under auto, and under --remat save list them on their own line, not as bytes per row."""
    from support import coda

    src = tmp_path / "m8.coda"
    src.write_text(_layer_source())
    args = ("grad", src, "--block", "layer", "--fp8-grads", "e5m2", "--wrt", ",".join(WRT))
    auto, save = coda(*args), coda(*args, "--remat", "save")
    assert auto.returncode == 0 and save.returncode == 0, auto.stderr + save.stderr
    head = [line for line in auto.stdout.splitlines() if line.startswith("# saved")]
    assert head[0] == (
        "# saved tensors (stored by the forward): x1, x2, acc7, i2, _t25, r2, ia, acc4, i1, _t11, r1"
    )  # (no x1q, x2q: made again from the stored x1, x2)
    assert head[2] == '# saved per row: 4*D + 4*F + 4*P + 16 bytes (--remat auto; stage 3: remat="rebuild")'
    assert len(head) == 3
    assert "is recomputed by an elementwise stage at the backward's start" in auto.stderr
    assert (
        "# saved, not per row of M: w_qkvq 2*D*P, w_2q D*F, w_13q 2*D*F (3*D*F + 2*D*P bytes)" in save.stdout
    )
    # block-wide --remat rebuild: every copy the start stage can make goes (w_qkvq too), nothing else
    rebuild = coda(*args, "--remat", "rebuild")
    assert rebuild.returncode == 0, rebuild.stderr
    head = [line for line in rebuild.stdout.splitlines() if line.startswith("# saved")]
    assert '(--remat rebuild; stage 3: remat="rebuild")' in head[2], head
    saved = head[0].split(": ", 1)[1].split(", ")
    assert "aq" in saved and not {"x1q", "x2q", "w_13q", "w_2q", "w_qkvq"} & set(saved), saved
    assert "recomputed in the epilogue" not in rebuild.stderr
    assert "is recomputed by an elementwise stage at the backward's start" in rebuild.stderr


# ---------------------------------------------------------------------------- bit for bit


def _layer_inputs(blk: coda_lang.Block, seed: int) -> dict[str, Any]:
    ins = block_inputs(blk.ir, SIZES, seed)
    for s in SCALES:  # scales that put the e4m3 copies across their range (some saturate)
        ins[s] = np.float32(40.0 if s != "s_w_13" else 300.0)
    return ins


def _own_inputs(blk: coda_lang.Block, seed: int) -> dict[str, Any]:
    ins = block_inputs(blk.ir, OWN_SIZES, seed)
    ins.update(s_x=np.float32(30.0), s_u=np.float32(50.0), s_w=np.float32(400.0), s_v=np.float32(60.0))
    return ins


def _same_bits(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        a, b = np.asarray(got[k]), np.asarray(want[k])
        assert a.dtype == b.dtype and a.shape == b.shape, (what, k)
        assert np.array_equal(a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)), (what, k)


def _vjp(src: str, name: str, ins: Any, sizes: Any, wrt: Any, opts: Any, off: bool = False) -> dict[str, Any]:
    blk = coda_lang.load(src)[name]  # (a fresh block: its derivations are cached)
    cts = cotangents(blk.ir, sizes, 5)
    if off:
        with _first_kind_only():
            d = blk.derivation(wrt, backward=opts)
    else:
        d = blk.derivation(wrt, backward=opts)
    assert bool(_start_stages(d.backward)) is (not off and opts.remat != "save")
    scales = {k: 3000.0 for k in d.scales} or None
    return blk.vjp(ins, cts, dims=sizes, wrt=wrt, backward=opts, scales=scales)


@pytest.mark.parametrize("fp8", [None, "e5m2"])
@pytest.mark.parametrize("cast", [False, True])
def test_layer_gradients_bit_for_bit_on_the_interpreter(fp8: str | None, cast: bool) -> None:
    """The fp8 layer's gradients under auto equal those of auto without the second kind, bit for bit
    (auto's first kind, `aq` from the bf16 acc4, is in both; "save" differs from both by that)."""
    src = _layer_source(cast=cast)
    blk = coda_lang.load(src)["layer"]
    ins = _layer_inputs(blk, 3)
    opts = _options("auto", fp8)
    got = _vjp(src, "layer", ins, SIZES, WRT, opts)
    want = _vjp(src, "layer", ins, SIZES, WRT, opts, off=True)
    _same_bits(got, want, f"layer fp8_grads={fp8} cast={cast}")


@pytest.mark.parametrize("fp8", [None, "e5m2"])
def test_own_block_gradients_bit_for_bit_against_save(fp8: str | None) -> None:
    blk = _own()
    ins = _own_inputs(blk, 4)
    got = _vjp(OWN, "qmlp", ins, OWN_SIZES, None, _options("auto", fp8))
    want = _vjp(OWN, "qmlp", ins, OWN_SIZES, None, _options("save", fp8))
    _same_bits(got, want, f"qmlp fp8_grads={fp8}")
    # the forward's copies are made (a saturated code among them: s_w = 400)
    fwd = blk.derivation(backward=_options("save", fp8)).forward.run(ins, dims=OWN_SIZES)
    assert np.any(np.abs(np.asarray(fwd["wq"], np.float32)) == 448.0)


def _torch_grads(
    src: str, name: str, ins: dict[str, Any], wrt: list[str], fp8: str | None, off: bool
) -> dict:
    import torch
    from runtime_check import to_torch

    import coda_lang.torch as ct

    blk = coda_lang.load(src)[name]
    opts = _options("auto" if name == "layer" else ("save" if off else "auto"), fp8)
    kw: dict[str, Any] = {"grad_scales": ct.DelayedScaling(3000.0)} if fp8 else {}
    if off and name == "layer":
        with _first_kind_only():
            blk.derivation(wrt, backward=opts)  # (cached on the block: the autograd function uses it)
    f = blk.cuda(emulate=True).autograd(wrt, backward=opts, **kw)
    d = blk.derivation(wrt, backward=opts)
    assert bool(_start_stages(d.backward)) is not off  # (the backward under test makes copies)
    tens = {k: to_torch(np.asarray(v)) for k, v in ins.items()}
    for k in wrt:
        tens[k].requires_grad_(True)
    outs = f(tens)
    gen = torch.Generator().manual_seed(0)
    total = sum(
        (o.float() * torch.randn(o.shape, generator=gen)).sum()
        for o in outs.values()
        if o.is_floating_point()
    )
    total.backward()  # type: ignore[union-attr]
    return {k: tens[k].grad for k in wrt}


@pytest.mark.parametrize("fp8", [None, "e5m2"])
@pytest.mark.parametrize("which", ["layer", "qmlp"])
def test_emulated_runtime_runs_the_new_backward_bit_for_bit(fp8: str | None, which: str) -> None:
    """CudaBlock.autograd on the emulated runtime (the CUDA runtime's torch stand-ins, CPU): the
    backward with its copies made at the start gives the gradients of the one without (the layer) or
    of "save" (the block of this file), bit for bit."""
    torch = pytest.importorskip("torch")
    if which == "layer":
        src, name, wrt = _layer_source(cast=True), "layer", WRT
        ins = _layer_inputs(coda_lang.load(src)["layer"], 6)
    else:
        src, name = OWN, "qmlp"
        wrt = ["x", "u", "w", "v", "g"]
        ins = _own_inputs(_own(), 6)
    got = _torch_grads(src, name, ins, wrt, fp8, off=False)
    want = _torch_grads(src, name, ins, wrt, fp8, off=True)
    for k in wrt:
        assert got[k] is not None and torch.equal(got[k], want[k]), (which, fp8, k)


# ---------------------------------------------------------------------------- the GPU path


def _backwards() -> list[tuple[str, coda_lang.Block]]:
    out = []
    for fp8 in (None, "e5m2"):
        for label, blk, wrt in (
            ("layer", _layer(), WRT),
            ("layer-cast", _layer(cast=True, stage=None), WRT),
            ("qmlp", _own(), None),
        ):
            out.append((f"{label} {fp8}", blk.derivation(wrt, backward=_options("auto", fp8)).backward))
    return out


def test_gpu_planner_and_triton_accept_the_new_backward() -> None:
    """Every GEMM stage of the new backwards plans for the GPU (not emulated) and emits its CuTeDSL
    source; every stage at the start is a generated Triton kernel whose source stores e4m3."""
    pytest.importorskip("triton")
    from coda_lang.backend_cute.plan.emit import emit_stage
    from coda_lang.backend_cute.plan.planner import plan_stage
    from coda_lang.backend_triton.elementwise import ElementwiseStage
    from coda_lang.backend_triton.generate import TritonStage, unsupported

    for label, bwd in _backwards():
        stages = [s for s in bwd.ir.body if isinstance(s, Stage)]
        starts = _start_stages(bwd)
        assert starts, label
        for k, s in enumerate(stages, 1):
            if s.is_gemm:
                assert emit_stage(plan_stage(bwd, k, emulated=False)), (label, k)
            elif s in starts:
                st = ElementwiseStage(bwd, k, emulate=True)
                assert unsupported(st) is None, (label, k)
                assert ElementwiseStage(bwd, k, emulate=False).generator == "triton", (label, k)
                names = [n for n, role in st.roles if role == "scalar"]
                src = TritonStage(st).source(tuple(False for _ in names))
                assert 'tl.float8e4nv, fp_downcast_rounding="rtne"' in src, (label, k)


def test_generated_kernel_makes_the_copies_bit_for_bit() -> None:
    """The start stage of the block of this file's backward as the generated kernel (Triton's CPU
    interpreter), on the backward's inputs, against the copies the forward stores under "save", bit
    for bit (a saturated code among them)."""
    pytest.importorskip("triton")
    import torch
    from runtime_check import to_torch

    from coda_lang.backend_triton.elementwise import ElementwiseStage
    from coda_lang.backend_triton.generate import TritonStage

    blk = _own()
    d = blk.derivation(backward=_options("auto", "e5m2"))
    bwd = d.backward
    ins = _own_inputs(blk, 8)
    want = blk.derivation(backward=_options("save", "e5m2")).forward.run(ins, dims=OWN_SIZES)
    stages = [s for s in bwd.ir.body if isinstance(s, Stage)]
    k = stages.index(_start_stages(bwd)[0]) + 1
    st = ElementwiseStage(bwd, k, emulate=True)
    args = []
    for name, role in st.roles:
        v = np.asarray(ins[name])
        args.append(float(v) if role == "scalar" else to_torch(v))
    rows, cols = int(st.rows.evaluate(OWN_SIZES)), int(st.cols.evaluate(OWN_SIZES))
    got = TritonStage(st, interpret=True)(rows, cols, dict(OWN_SIZES), torch.device("cpu"), *args)
    names = [n for n, *_ in st.store_meta]
    assert names == ["wq", "vq"]
    for i, name in enumerate(names):
        g = got[i]
        assert g.dtype == torch.float8_e4m3fn
        w = np.asarray(want[name])
        assert np.array_equal(g.view(torch.uint8).numpy().reshape(-1), w.reshape(-1).view(np.uint8)), name
    assert np.any(np.abs(np.asarray(want["wq"], np.float32)) == 448.0)
