"""`remat=` on an elementwise stage, and the post-norm fp8 blocks of coda_lang.hf that use it.

- The language: `elementwise [M, D], remat="rebuild" { ... }` parses, prints back with its option
  (`coda grad --with-forward`), and a bad value or an unknown option on an elementwise stage is E0211
  at the option.
- The post-norm fp8 layers (OLMo 2: post norms only; Gemma 2 and 3: sandwich norms): the row stages
  that quantize a GEMM's input (`x1q` after the out-projection, `x2q` after the down projection) are
  remat="rebuild". Their backward makes each copy in an elementwise stage at its start, and no GEMM
  stage's epilogue stores it: under the block-wide "auto" the data gradients `dacc @ w_13q` and
  `dacc @ w_qkvq` stored them, which spilled registers at every fp8 tile on sm_90a
  (scripts/fuzz_hf_blocks.py found it on an H200, 2026-11-28). Without the option (the source edited)
  the epilogue stores the copy again, so the test can fail.
- The option moves where the copy is made, not what it is: the gradients on the interpreter are bit
  for bit those of the block without it, with e5m2 cotangents and the e4m3 save.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import coda, stage_option_error

import coda_lang
from coda_lang.hf.blocks import REBUILD, family_source
from coda_lang.hf.family import FAMILIES
from coda_lang.hf.state import block_wrt
from coda_lang.ir.nodes import Stage
from coda_lang.testing.inputs import block_inputs, cotangents

SIZES = {"M": 40, "D": 32, "F": 48, "K": 32, "P": 32}

ROWS = """dims M, N, K

block rows(x: bf16[M, K], w: bf16[N, K], s_x: f32, s_w: f32) -> (y: bf16[M, N]) {
  elementwise [N, K] {
    wq: e4m3 = w * s_w
  }
  elementwise [M, K]OPT {
    xq: e4m3 = x * s_x
  }
  i = 1.0 / (s_x * s_w)
  gemm xq @ transpose(wq) {
    y = acc * i
  }
}
"""


def _post_norm(family: str, remat: bool = True) -> str:
    src = family_source(FAMILIES[family], "bfloat16", 1e-6, 16, (4, 2), fp8="delayed", fp8_save=True)
    assert REBUILD in src
    return src if remat else src.replace(REBUILD, "")


def _backward(src: str, block: str) -> coda_lang.Block:
    b = coda_lang.load(src)[block]
    return b.grad(block_wrt(b), backward=coda_lang.BackwardOptions(fp8_grads="e5m2", fp8_acc=True))


def _stored_by(bwd: coda_lang.Block, name: str) -> list[str]:
    """The kinds of the backward's stages that store `name`: "gemm" or "elementwise"."""
    return [
        "gemm" if s.is_gemm else "elementwise"
        for s in bwd.ir.body
        if isinstance(s, Stage) and any(o.name == name for e in s.body for o in e.outs)
    ]


def test_an_elementwise_stage_takes_remat(tmp_path: Path) -> None:
    text = ROWS.replace("OPT", REBUILD)
    blk = coda_lang.load(text)["rows"]
    (row,) = [s for s in blk.ir.body if isinstance(s, Stage) and not s.is_gemm and s.shape[0].name == "M"]
    assert row.remat == "rebuild"
    f = tmp_path / "rows.coda"
    f.write_text(text)
    r = coda("grad", f, "--with-forward")
    assert r.returncode == 0, r.stderr
    assert 'elementwise [M, K], remat="rebuild" {' in r.stdout
    assert 'stage 2: remat="rebuild"' in r.stdout  # the backward's header names the stage's policy
    assert "`xq` (line 8) is recomputed by an elementwise stage at the backward's start" in r.stdout


@pytest.mark.parametrize(
    "option, message",
    [
        (
            'remat="never"',
            '`remat=` of a stage is one of "auto", "save", "recompute", "rebuild", not `"never"`',
        ),
        ("tile=64", "a stage has no option `tile=`"),
    ],
)
def test_a_bad_option_on_an_elementwise_stage(option: str, message: str, tmp_path: Path) -> None:
    stage_option_error(ROWS.replace("OPT", f", {option}"), "elementwise [M, K],", message, tmp_path)


@pytest.mark.parametrize(
    "family, block, copies, were_in_epilogue",
    [
        ("olmo2", "last", ["x1q"], ["x1q"]),
        ("olmo2", "layer", ["x1q"], []),
        ("gemma2", "layer", ["x1q", "x2q"], ["x1q"]),
        ("gemma3_text", "last", ["x1q"], ["x1q"]),
    ],
)
def test_post_norm_fp8_copies_are_made_at_the_start(
    family: str, block: str, copies: list[str], were_in_epilogue: list[str]
) -> None:
    with_option = _backward(_post_norm(family), block)
    without = _backward(_post_norm(family, remat=False), block)
    for name in copies:
        assert _stored_by(with_option, name) == ["elementwise"], (family, block, name)
        note = next(n for n in with_option.ir.notes if n.startswith(f"note: `{name}`"))
        assert "an elementwise stage at the backward's start" in note and 'remat="rebuild"' in note, note
        # what "auto" did: a data gradient's epilogue stored the copy
        want = ["gemm"] if name in were_in_epilogue else ["elementwise"]
        assert _stored_by(without, name) == want, (family, block, name)


def _bits(a: Any) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).tobytes()


@pytest.mark.parametrize("family, block", [("olmo2", "last"), ("gemma2", "layer")])
def test_post_norm_rebuild_gradients_are_the_saved_copies(family: str, block: str) -> None:
    """The copy made at the start is the forward's, bit for bit: every gradient equals that of
    remat="save" (which keeps the forward's x1q and x2q), but dw_2, which under fp8_acc reads the
    SwiGLU output made again from the e4m3 copy of the gate/up acc, where "save" reads the forward's
    (docs/design.md: a policy difference by design). The epilogue's copy ("auto" without the option)
    was made from the bf16 store of x1, not the f32 value the forward quantized: its dw_13 differs."""
    src, plain = _post_norm(family), _post_norm(family, remat=False)
    b = coda_lang.load(src)[block]
    sizes = {d.name: SIZES[d.name] for d in b.ir.dims if d.value is None}
    ins: dict[str, Any] = block_inputs(b.ir, sizes, 7)
    for p in b.ir.params:  # scales that spread the e4m3 copies over their range
        if p.var.name.startswith("s_"):
            ins[p.var.name] = np.float32(40.0)
    cts = cotangents(b.ir, sizes, 5)
    wrt = block_wrt(b)

    def grads(text: str, remat: str) -> dict[str, Any]:
        opts = coda_lang.BackwardOptions(remat=remat, fp8_grads="e5m2", fp8_acc=True)
        return coda_lang.load(text)[block].vjp(ins, cts, dims=sizes, wrt=wrt, backward=opts)

    got, saved, epilogue = grads(src, "auto"), grads(plain, "save"), grads(plain, "auto")
    assert sorted(got) == sorted(saved) and set(wrt) <= set(got)
    for k in wrt:
        w = np.asarray(saved[k]).astype(np.float64)
        assert np.isfinite(w).all() and np.abs(w).max() > 0, k
        if k != "w_2":
            assert _bits(got[k]) == _bits(saved[k]), (family, block, k)
    assert _bits(epilogue["w_13"]) != _bits(saved["w_13"])
