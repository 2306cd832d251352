"""Every GEMM stage of the blocks coda_lang.hf writes has a kernel tile that satisfies its tiling rules,
forward and derived backward (the one the patch runs), on the CPU: the planner's rules without a GPU.

The class: a block the patch writes for some family and head_dim that no kernel tile can run, which
fails only at the first step on a GPU (E0706 "no candidate tile satisfies its tiling constraints").
One was found so on an H200 (2026-11-28, scripts/fuzz_hf_blocks.py): the fp8 blocks' QKV stage, a
paired one, with a per-head q/k norm of 16-column heads, which no 32-column epilogue subtile holds
whole. Such heads now take the row stage after the GEMM (`blocks.heads_fit_tiles(head_dim, fp8)`), as
heads wider than a tile do. Spills are ptxas's to judge, on the toolchain (tests/test_backend_ptx.py)
and by the harness on a GPU.
"""

from __future__ import annotations

import pytest
from support import script

import coda_lang
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.backend_cute.build.config import candidates_for, fallback_candidates_for, fits
from coda_lang.backend_cute.plan.planner import plan_stage
from coda_lang.hf.blocks import heads_fit_tiles, model_source
from coda_lang.hf.state import block_wrt
from coda_lang.ir.nodes import Stage


def _untileable(block: coda_lang.Block) -> list[str]:
    out = []
    for k, st in enumerate([s for s in block.ir.body if isinstance(s, Stage)], 1):
        if st.is_gemm:
            spec = plan_stage(block, k)
            if not any(fits(spec, c) for c in candidates_for(spec) + fallback_candidates_for(spec)):
                out.append(f"{block.name} stage {k} `{spec.text}`")
    return out


@pytest.mark.parametrize("fp8", [None, "delayed"])
@pytest.mark.parametrize("head_dim", [16, 32, 64, 128, 256])
def test_per_head_norm_blocks_have_tiles(head_dim: int, fp8: str | None) -> None:
    """Qwen 3's blocks (a per-head q/k norm, the narrowest groups a QKV epilogue reduces) at every
    head_dim a model may have, forward and the backward the patch derives."""
    src = model_source("bfloat16", 1e-6, head_dim, "head", heads=(4, 2), fp8=fp8, fp8_save=fp8 is not None)
    prog = coda_lang.load(src)
    options = BackwardOptions(fp8_grads="e5m2", fp8_acc=True) if fp8 else None
    bad = []
    for name in ("first_qkv", "layer", "last"):
        b = prog[name]
        bad += _untileable(b) + _untileable(b.grad(block_wrt(b), backward=options))
    assert not bad, bad
    rows = "(a row stage)" in src.splitlines()[0]
    assert rows == (not heads_fit_tiles(head_dim, fp8 is not None))


def test_narrow_heads_take_the_row_stage_in_fp8_only() -> None:
    assert heads_fit_tiles(16) and not heads_fit_tiles(16, fp8=True)
    assert heads_fit_tiles(32, fp8=True) and heads_fit_tiles(128, fp8=True)
    assert not heads_fit_tiles(256) and not heads_fit_tiles(256, fp8=True)
    # without the row stage, the fp8 QKV stage of 16-column heads has no tile (what the GPU found)
    from coda_lang.hf import blocks

    real = blocks.heads_fit_tiles
    try:
        blocks.heads_fit_tiles = lambda hd, fp8=False: real(hd)  # type: ignore[assignment]
        src = model_source("bfloat16", 1e-6, 16, "head", heads=(4, 2), fp8="delayed")
    finally:
        blocks.heads_fit_tiles = real  # type: ignore[assignment]
    assert "(a row stage)" not in src.splitlines()[0]
    bad = _untileable(coda_lang.load(src)["layer"])
    assert bad and "w_qkvq" in bad[0], bad


@pytest.mark.parametrize("fp8", [None, "delayed"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "granite", "olmo2", "gemma2", "gemma3_text"])
def test_every_family_blocks_have_tiles(family: str, fp8: str | None) -> None:
    """Each family's blocks (as scripts/fuzz_hf_blocks.py writes them, at the family's head_dim), the
    layer blocks and the heads (with fp8, loss_mode="fp8"'s), forward and the backward the patch
    derives, bf16 and fp8."""
    from coda_lang.hf.family import FAMILIES

    harness = script("fuzz_hf_blocks")

    recipe = "delayed" if fp8 else "bf16"
    prog = coda_lang.load(harness.source(FAMILIES[family], recipe))
    options = BackwardOptions(fp8_grads="e5m2", fp8_acc=True) if fp8 else None
    bad = []
    # (an fp8 model's heads are bf16's, but for loss_mode="fp8"'s)
    names = (*harness.LAYERS, *harness.HEADS) if fp8 is None else (*harness.LAYERS, harness.FP8_HEAD)
    for name in names:
        b = prog[name]
        head8 = BackwardOptions(fp8_grads="e5m2")
        opts = options if name in harness.LAYERS else head8 if name == harness.FP8_HEAD else None
        bad += _untileable(b) + _untileable(b.grad(block_wrt(b), backward=opts))
    assert not bad, bad
