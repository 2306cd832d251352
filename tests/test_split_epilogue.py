"""Heavy GEMM epilogues cut off into elementwise stages of their own ($CODA_SPLIT_EPILOGUES), on the CPU.

- `heavy` finds the stages config.WIDE_F32_TILE keeps to pingpong tiles (an f32 tile beside column
  partials): in the fp8 Llama layer's backward, the two RMSNorm backwards (the QKV and the gate/up
  data gradients), in the last layer's the gate/up one; none in blockwise's (block-scaled) or the
  first block's.
- `split_epilogues` cuts them: the GEMM stores its f32 accumulator alone, the elementwise stage after
  it runs the epilogue; the block's parameters, outputs and `derived` mark stay; the cut GEMM is free
  of WIDE_F32_TILE (a cooperative tile may be chosen); the new stage is a generated Triton kernel.
  A selection by operand name cuts only the stages that read it.
- The interpreter runs the cut block as the whole one: every output within f32 rounding (a column
  sum's order of addition changes), on ragged sizes.
- The generated kernel of the new stage, under Triton's CPU interpreter, computes what its torch
  function does.
- A patched bf16 fp8 Llama trains the same with and without the cut (the emulated kernels), and the
  default (auto) cuts its gate/up data gradient alone; a bf16 model is not cut.
- The default's rule (`long_fp8`): an fp8 stage whose contraction is at least 4 times its width, at
  the block's bound dims.
- The variable's values, and its ValueError.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import coda_lang  # noqa: E402
from coda_lang.backend_cute.runtime.split_epilogue import (  # noqa: E402
    ALL,
    AUTO,
    heavy,
    split_epilogues,
    split_selection,
)


def _backward(block: str, fp8: str | None = "delayed") -> coda_lang.Block:
    """The derived backward of `block` of the hf model program, as the patch derives it."""
    from coda_lang.hf.blocks import model_source

    opts = {
        "delayed": coda_lang.BackwardOptions(fp8_grads="e5m2"),
        "blockwise": coda_lang.BackwardOptions(fp8_grads="e5m2", requantize_wgrad=True),
        None: coda_lang.BackwardOptions(),
    }[fp8]
    src = model_source("bfloat16", 1e-5, 16, None, fp8=fp8, heads=(8, 4))
    blk = coda_lang.load(src)[block]
    wrt = [p.var.name for p in blk.ir.params if p.var.name not in ("pos", "freq", "eps")]
    wrt = [n for n in wrt if not n.startswith("s_")]
    return blk.derivation(wrt, backward=opts).backward


def _gemm_reads(blk: coda_lang.Block, k: int) -> set[str]:
    st = blk.ir.stages[k - 1]
    return {x.name for x in (st.a, st.b) if x is not None and hasattr(x, "name")}


def test_the_heavy_stages_are_the_norm_backwards() -> None:
    """The stages held to pingpong tiles for an f32 tile beside column partials: the QKV and gate/up
    data gradients of the fp8 layer's backward (the two RMSNorm backwards), the gate/up one in the last
    layer's; none in the first block's or in blockwise's (block-scaled GEMMs)."""
    layer = _backward("layer")
    got = {frozenset(_gemm_reads(layer, k)) for k in heavy(layer)}
    assert got == {frozenset({"dacc7", "w_qkvq"}), frozenset({"dacc4", "w_13q"})}, got
    last = _backward("last")
    assert [_gemm_reads(last, k) for k in heavy(last)] == [{"dacc4", "w_13q"}]
    assert heavy(_backward("first_qkv")) == []
    assert heavy(_backward("layer", "blockwise")) == []


def test_the_cut_block() -> None:
    """Each heavy stage becomes the GEMM storing its f32 accumulator alone and an elementwise stage over
    [M, N] running the epilogue on it; nothing else changes (parameters, outputs, the derived mark, the
    other stages); the cut GEMM has no WIDE_F32_TILE rule, and the new stage is a generated Triton
    kernel. Selected by operand name, only the gate/up data gradient is cut."""
    from coda_lang.backend_cute.build.config import WIDE_F32_TILE, rules
    from coda_lang.backend_cute.plan.planner import plan_stage
    from coda_lang.backend_triton.elementwise import ElementwiseStage

    layer = _backward("layer")
    cut = split_epilogues(layer)
    assert cut.ir.derived and layer.ir.derived
    assert [(p.var.name, p.var.type) for p in cut.ir.params] == [
        (p.var.name, p.var.type) for p in layer.ir.params
    ]
    assert [(o.name, o.type) for o in cut.ir.outputs] == [(o.name, o.type) for o in layer.ir.outputs]
    assert len(cut.ir.stages) == len(layer.ir.stages) + 2
    assert heavy(cut) == []
    n = 0
    for k, st in enumerate(cut.ir.stages, 1):
        if st.is_gemm and len(st.body) == 1 and st.body[0].outs[0].name.startswith("acc_s"):
            n += 1
            (e,) = st.body
            assert e.op == "copy" and e.ins[0].name == "acc" and e.outs[0].annot == "f32"
            assert WIDE_F32_TILE not in rules(plan_stage(cut, k))
            after = cut.ir.stages[k]
            assert not after.is_gemm and any(x.name == e.outs[0].name for q in after.body for x in q.ins)
            assert ElementwiseStage(cut, k + 1, emulate=True).generator == "triton"
    assert n == 2
    one = split_epilogues(layer, frozenset({"w_13q"}))
    assert len(one.ir.stages) == len(layer.ir.stages) + 1
    assert [_gemm_reads(one, k) for k in heavy(one)] == [{"dacc7", "w_qkvq"}]
    assert split_epilogues(layer, frozenset({"nothing"})) is layer


@pytest.mark.parametrize("block", ["layer", "last"])
def test_the_interpreter_runs_the_cut_block_as_the_whole_one(block: str) -> None:
    """The reference interpreter on the cut backward and on the whole one, the same inputs, at sizes
    that are no multiple of a tile: every output equal within f32 rounding (the column sums of the
    norm weights' gradients add in another order)."""
    from coda_lang.testing.inputs import block_inputs

    whole = _backward(block)
    cut = split_epilogues(whole)
    sizes = {"M": 40, "D": 48, "F": 80, "K": 128, "P": 64}
    sizes = {d.name: sizes[d.name] for d in whole.ir.dims}  # (the last block has no P)
    inputs = block_inputs(whole, sizes, seed=5)
    want = whole.run(inputs, dims=sizes)
    assert isinstance(cut, coda_lang.Block)  # (the class it was given)
    got = cut.run(inputs, dims=sizes)
    assert set(got) == set(want)
    for name, w in want.items():
        g = np.asarray(got[name], dtype=np.float64)
        w = np.asarray(w, dtype=np.float64)
        scale = float(np.abs(w).max()) or 1.0
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * scale, err_msg=name)


@pytest.mark.parametrize("program_rows", [None, "8"])
def test_the_new_stages_kernel_computes_its_torch_function(
    program_rows: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate/up data gradient's new elementwise stage, as generate.py writes it, under Triton's CPU
    interpreter: its stored tile and its column sum are what the stage's torch function gives, at
    its default program (32 rows) and at $CODA_COLUMN_REDUCTION_ROWS=8 (of 40 rows: a ragged last
    program at 32, five whole ones at 8). A value of that variable that is no power of two up to 64 is a ValueError."""
    pytest.importorskip("triton")
    from coda_lang.backend_triton.generate import column_reduction_rows

    if program_rows is None:
        monkeypatch.delenv("CODA_COLUMN_REDUCTION_ROWS", raising=False)
    else:
        monkeypatch.setenv("CODA_COLUMN_REDUCTION_ROWS", program_rows)
    assert column_reduction_rows() == (32 if program_rows is None else int(program_rows))
    from test_kmajor_copies import _arguments

    from coda_lang.backend_triton.elementwise import ElementwiseStage
    from coda_lang.backend_triton.generate import TritonStage

    cut = split_epilogues(_backward("layer"), frozenset({"w_13q"}))
    k = next(i for i, st in enumerate(cut.ir.stages, 1) if not st.is_gemm and any(
        x.name.startswith("acc_s") for e in st.body for x in e.ins if hasattr(x, "name")))  # fmt: skip
    st = ElementwiseStage(cut, k, emulate=True)
    sizes = {"M": 40, "D": 48, "F": 80, "K": 128, "P": 64}
    args = _arguments(cut, st, sizes, 3, "cpu")
    rows, cols = int(st.rows.evaluate(sizes)), int(st.cols.evaluate(sizes))
    want = st._body(rows, cols, dict(sizes), torch.device("cpu"), *args)
    ts = TritonStage(st, interpret=True)
    assert ts.bm == column_reduction_rows()
    got = ts(rows, cols, dict(sizes), torch.device("cpu"), *args)
    assert len(got) == len(want) >= 2
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.float(), w.float(), rtol=1e-5, atol=1e-5 * float(w.float().abs().max()))
    for bad in ("3", "128", "0", "eight"):
        monkeypatch.setenv("CODA_COLUMN_REDUCTION_ROWS", bad)
        with pytest.raises(ValueError, match="CODA_COLUMN_REDUCTION_ROWS is"):
            column_reduction_rows()


def test_a_patched_model_trains_the_same_with_the_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 Llama patched with fp8="delayed", two steps on the emulated kernels, with
    $CODA_SPLIT_EPILOGUES=all, =w_13q and unset (auto: the tiny model's gate/up contraction is 4 times
    its width, its QKV one's less) against 0: its backward blocks have the cut stages, and the losses and
    every gradient are the same within f32 rounding of the norm weights' column sums. A bf16 model is
    not cut by default."""
    from test_hf import batch as hf_batch
    from test_hf_fp8 import HF, make, two_steps, unfused_grads

    base = make("llama", torch.bfloat16, intermediate_size=128)  # (gate/up: 2F = 4 D)
    ids, labels = hf_batch()
    runs: dict[str, Any] = {}
    cfg = base.config
    assert 2 * cfg.intermediate_size >= 4 * cfg.hidden_size  # (so that auto cuts the gate/up stage)
    assert (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim < 4 * cfg.hidden_size
    for value, extra in (("0", 0), (ALL, 2), ("w_13q", 1), ("auto", 1)):
        if value == "auto":
            monkeypatch.delenv("CODA_SPLIT_EPILOGUES")
        else:
            monkeypatch.setenv("CODA_SPLIT_EPILOGUES", value)
        m = HF["llama"][2](copy.deepcopy(base), fp8="delayed")
        loss = two_steps(m, ids, labels)
        bwd = m._coda.blocks(torch.bfloat16).layer._made(True).backward
        runs[value] = (bwd, loss.item(), unfused_grads(m))
        assert len(bwd.ir.stages) == len(runs["0"][0].ir.stages) + extra, value
    # (the cut stage is the gate/up data gradient's, as with w_13q)
    assert runs["auto"][0].ir == runs["w_13q"][0].ir
    for value in (ALL, "w_13q", "auto"):
        _, loss, grads = runs[value]
        assert abs(loss - runs["0"][1]) <= 1e-5 * abs(runs["0"][1]), value
        for name, g in grads.items():
            w = runs["0"][2][name].float()
            assert torch.allclose(g.float(), w, rtol=1e-2, atol=1e-3 * float(w.abs().max())), (value, name)
    m = HF["llama"][2](copy.deepcopy(base))
    two_steps(m, ids, labels)
    bf16 = m._coda.blocks(torch.bfloat16).layer._made(True)
    assert bf16.backward.ir == bf16.derivation.backward.ir  # (not cut)


def test_the_default_cut_is_the_long_fp8_contraction() -> None:
    """`long_fp8` (the default, auto): at Llama-3.2-1B's widths the fp8 layer's gate/up data gradient
    (K = 2F = 8 D) is cut and its QKV one (K = 2P = 1.5 D) is not; at widths where the gate/up
    contraction is under 4 D, neither; a bf16 block's stages never; and without the block's widths
    (a dim not bound), nothing: `split_epilogues(..., AUTO)` then gives the block itself."""
    from coda_lang.backend_cute.runtime.split_epilogue import long_fp8

    sizes = {"M": 8192, "D": 2048, "F": 8192, "P": 1536, "K": 64}
    layer = _backward("layer")
    got = {frozenset(_gemm_reads(layer, k)): long_fp8(layer, k, sizes) for k in heavy(layer)}
    assert got == {frozenset({"dacc7", "w_qkvq"}): False, frozenset({"dacc4", "w_13q"}): True}, got
    assert not any(long_fp8(layer, k, {**sizes, "F": 4095}) for k in heavy(layer))  # (2F < 4D)
    assert any(long_fp8(layer, k, {**sizes, "F": 4096}) for k in heavy(layer))  # (2F = 4D)
    bf16 = _backward("layer", None)
    assert heavy(bf16) and not any(long_fp8(bf16, k, sizes) for k in heavy(bf16))
    assert not any(long_fp8(layer, k, {"M": 8192}) for k in heavy(layer))
    assert split_epilogues(layer, AUTO) is layer
    assert len(split_epilogues(layer, AUTO, sizes).ir.stages) == len(layer.ir.stages) + 1


def test_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset or auto: auto (the default); empty or 0: off; all or 1; a comma-separated list of operand
    names; anything else a ValueError naming the variable."""
    monkeypatch.delenv("CODA_SPLIT_EPILOGUES", raising=False)
    assert split_selection() == AUTO
    monkeypatch.setenv("CODA_SPLIT_EPILOGUES", " auto")
    assert split_selection() == AUTO
    for off in ("0", "", " 0 "):
        monkeypatch.setenv("CODA_SPLIT_EPILOGUES", off)
        assert split_selection() is None
    for on in ("all", "1"):
        monkeypatch.setenv("CODA_SPLIT_EPILOGUES", on)
        assert split_selection() == ALL
    monkeypatch.setenv("CODA_SPLIT_EPILOGUES", "w_13q, w_qkvq")
    assert split_selection() == frozenset({"w_13q", "w_qkvq"})
    for bad in ("2", "w_13q,", "w-13q", "yes please"):
        monkeypatch.setenv("CODA_SPLIT_EPILOGUES", bad)
        with pytest.raises(ValueError, match="CODA_SPLIT_EPILOGUES is"):
            split_selection()


def test_a_cut_the_checker_refuses_leaves_the_stage_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the cut block does not check (here: a cut whose elementwise stage spans [N, N], not its
    tiles' [M, N]), the stage stays as it was, and so does the block: never a block that runs
    something else."""
    from dataclasses import replace

    from coda_lang.backend_cute.runtime import split_epilogue
    from coda_lang.ir import nodes

    real = split_epilogue._cut

    def broken(ir: nodes.Block, k: int) -> nodes.Block:
        out = real(ir, k)
        body = list(out.body)
        i = next(j for j, st in enumerate(body) if isinstance(st, nodes.Stage) and not st.is_gemm and any(
            x.name.startswith("acc_s") for e in st.body for x in e.ins if isinstance(x, nodes.Var)))  # fmt: skip
        assert body[i].shape is not None
        _, cols = body[i].shape
        body[i] = replace(body[i], shape=(cols, cols))
        return replace(out, body=tuple(body))

    monkeypatch.setattr(split_epilogue, "_cut", broken)
    layer = _backward("layer")
    assert split_epilogues(layer) is layer


def test_a_generated_block_that_reads_an_undefined_value_does_not_check() -> None:
    """`check_generated` (what every pass's block goes through: autodiff's backwards, the chunker's, the
    cut) refuses a block that reads a value nothing defines before it, as the parser's E0201 does for
    text: E0601, naming the value. The same block with the value defined checks."""
    from dataclasses import replace

    from coda_lang.core.diagnostics import CodaError
    from coda_lang.frontend.source import check_generated
    from coda_lang.ir import nodes

    layer = _backward("layer")
    ir = layer.ir
    check_generated(ir, "the backward")
    i, st = next((j, s) for j, s in enumerate(ir.body) if isinstance(s, nodes.Stage) and s.is_gemm)
    e = st.body[-1]
    ghost = nodes.Var("ghost", e.ins[0].type if isinstance(e.ins[0], nodes.Var) else None)
    bad = replace(st, body=(*st.body[:-1], replace(e, ins=(ghost, *e.ins[1:]))))
    with pytest.raises(CodaError, match="E0601") as got:
        check_generated(replace(ir, body=(*ir.body[:i], bad, *ir.body[i + 1 :])), "a pass's block")
    assert "`ghost` is read before anything defines it" in got.value.render()


def _on_the_kernels(device: str, sizes: dict[str, int]) -> None:
    """The fp8 Llama layer's backward, cut (`all`) and whole, as CUDA blocks (emulated on the CPU), the
    same inputs: every output the same within the f32 rounding of the column sums and the rounding of
    the stored bf16 and fp8 tiles."""
    from runtime_check import example_inputs

    whole = _backward("layer")
    cut = split_epilogues(whole)
    assert len(cut.ir.stages) == len(whole.ir.stages) + 2
    emulate = device == "cpu"
    inputs = example_inputs(whole, sizes, seed=7, device=device)
    want = whole.cuda(emulate=emulate)(inputs, dims=sizes)
    got = cut.cuda(emulate=emulate)(inputs, dims=sizes)
    assert set(got) == set(want)
    for name, w in want.items():
        g, w = got[name].float().cpu(), w.float().cpu()
        scale = float(w.abs().max()) or 1.0
        # (the stand-ins round alike: f32 rounding of the column sums at most; the GPU's kernels round
        # each stored tile where they compute it, in another order)
        rtol, atol = (1e-5, 1e-6) if emulate else (2e-2, 2e-3)
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol * scale, msg=name)


def test_the_cut_backward_on_the_emulated_kernels() -> None:
    """The cut and the whole backward as CUDA blocks on the kernels' torch stand-ins, at ragged sizes."""
    _on_the_kernels("cpu", {"M": 40, "D": 48, "F": 80, "K": 128, "P": 64})


@pytest.mark.gpu
def test_gpu_the_cut_backward_on_the_kernels() -> None:
    """The same on a GPU (CuTeDSL kernels, generated stages), at Llama-3.2-1B's widths and 1000 tokens."""
    _on_the_kernels("cuda", {"M": 1000, "D": 2048, "F": 8192, "K": 2048, "P": 1536})
