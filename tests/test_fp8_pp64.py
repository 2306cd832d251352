"""64-row pingpong tiles for fp8 GEMMs (build/config.py's FP8_PP64_CANDIDATES, $CODA_FP8_PP64=1).

Checked on the CPU: the tuner times them only with the variable set, under their own tuning-cache
name; (toolchain, slow) the fp8 Llama layer's SwiGLU-backward stage compiles for sm_90a at each without
spills, and the paired gate/up stage is kept off the 16-column subtile by its rule.
On a GPU (`-m gpu`): the pair store bit for bit at each tile, and the fp8 Llama layer's forward and
e5m2-cotangent backward on the kernels against the interpreter with these tiles tried first.
"""

from __future__ import annotations

import os

import pytest
from test_fp8_pairs import _llama_swiglu_backward, _packed
from test_fp8_kernels import packed_bit_for_bit

import coda_lang
from coda_lang.backend_cute.build import config
from coda_lang.backend_cute.build.config import (
    FP8_CANDIDATES,
    FP8_PP64_CANDIDATES,
    TileConfig,
    fits,
    fp8_tuning_variant,
    tune_candidates_for,
)
from coda_lang.backend_cute.plan.planner import plan_stage


def _llama_fp8_layer() -> coda_lang.Block:
    from coda_lang.hf.blocks import model_source

    return coda_lang.load(model_source("bfloat16", 1e-5, 64, None, fp8="delayed"))["layer"]


def test_timed_only_with_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    bwd, k = _llama_swiglu_backward()
    spec = plan_stage(bwd, k)
    monkeypatch.delenv("CODA_FP8_PP64", raising=False)
    monkeypatch.delenv("CODA_FP8_E16", raising=False)
    monkeypatch.delenv("CODA_FP8_FAST_ACCUM", raising=False)
    assert not set(FP8_PP64_CANDIDATES) & set(tune_candidates_for(spec))
    assert fp8_tuning_variant(spec) is None
    monkeypatch.setenv("CODA_FP8_PP64", "1")
    assert tune_candidates_for(spec) == FP8_CANDIDATES + FP8_PP64_CANDIDATES
    assert fp8_tuning_variant(spec) == "fp8-pp64"
    # a 16-bit stage's tiles are not changed by it
    fwd = _llama_fp8_layer()
    bf16 = [i for i in range(1, len(fwd.ir.stages) + 1) if fwd.ir.stages[i - 1].is_gemm]
    plain = [plan_stage(fwd, i) for i in bf16 if not config.fp8_operands(plan_stage(fwd, i))]
    assert plain and all(not set(FP8_PP64_CANDIDATES) & set(tune_candidates_for(s)) for s in plain)


def test_the_tiles_are_64_row_pingpong() -> None:
    assert all(c.tile_m == 64 and c.pingpong for c in FP8_PP64_CANDIDATES)
    assert not set(FP8_PP64_CANDIDATES) & set(FP8_CANDIDATES)


def test_the_paired_stage_keeps_its_subtile_rule() -> None:
    """The gate/up forward stores SwiGLU's half-width pairs: its rule (quack's subtile or wider) keeps
    it off the 16-column subtile, at 64 rows as at 128."""
    fwd = _llama_fp8_layer()
    paired = [
        i
        for i, st in enumerate(fwd.ir.stages, 1)
        if st.is_gemm and plan_stage(fwd, i).mode == "acc_pair" and config.fp8_operands(plan_stage(fwd, i))
    ]
    assert paired
    for i in paired:
        spec = plan_stage(fwd, i)
        assert not fits(spec, TileConfig(64, 192, 2, 1, True, epi_n=16))
        assert fits(spec, TileConfig(64, 128, 2, 1, True))


@pytest.mark.toolchain
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("cfg", FP8_PP64_CANDIDATES, ids=lambda c: c.short)
def test_the_swiglu_backward_fits(cfg: TileConfig, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The fp8 Llama layer's SwiGLU-backward stage (the epilogue that runs after its mainloop at
    128x192 cooperative) compiles without spills at each 64-row pingpong tile."""
    from coda_lang.backend_cute.build.compile import compile_stage

    bwd, k = _llama_swiglu_backward()
    c = compile_stage(bwd, k, cfg, directory=tmp_path_factory.mktemp("pp64"))
    assert c.report is not None and not c.report.spills, c.report.text


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("cfg", FP8_PP64_CANDIDATES, ids=lambda c: c.short)
@pytest.mark.parametrize("scale", [1.0, 2.0**-10])
def test_gpu_pairs_bit_for_bit_at_64_rows(scale: float, cfg: TileConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SwiGLU backward's e5m2 pair store at each tile, code for code against the interpreter."""
    monkeypatch.delenv("CODA_FP8_PAIR_STORE", raising=False)
    packed_bit_for_bit(_packed(), scale, "bf16", tile=cfg)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_gpu_llama_layer_at_64_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp8 Llama layer, forward and derived backward (e5m2 cotangents, the e4m3 save), on the
    kernels against the interpreter, with the 64-row tiles tried first for every fp8 GEMM: each such
    stage runs at one of them where it fits without spills."""
    import torch

    from coda_lang.backend_cute.runtime import tiles
    from coda_lang.fuzz.fuzzer import Fuzzer
    from coda_lang.fuzz.search import fuzz_block
    from coda_lang.hf.state import block_wrt

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setattr(config, "FP8_CANDIDATES", FP8_PP64_CANDIDATES + FP8_CANDIDATES)
    monkeypatch.setenv("CODA_TUNE", "0")
    tiles._SELECTED.clear()
    blk = _llama_fp8_layer()
    fz = Fuzzer(blk, "cuda", fp8_grads="e5m2", fp8_acc=True, wrt=list(block_wrt(blk)))
    res = fuzz_block(blk, "cuda", examples=3, fuzzer=fz)
    assert res.failure is None, res.failure
    chosen = list(tiles._SELECTED.values())
    assert sum(c.tile_m == 64 for c in chosen) >= 6, chosen
    assert os.environ["CODA_TUNE"] == "0"
