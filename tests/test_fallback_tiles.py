"""The fallback tiles of a GEMM stage (build/config.py's FALLBACK_CANDIDATES, less the stage's own
candidates): tried only where every candidate spills, by `select_config` (the first tile without
spills) and by `configs_without_spills` (the tuner's list), for fp8 and 16-bit stages alike; where
none of its candidates fits, the runtime's `choose_config` takes the first fallback that does. A fake compile stands in
for CuTeDSL and ptxas: which tiles spill is the test's choice; the order, the filtering by the stage's
tiling rules, and the E0706 report listing every tile tried are the code's.

The real case (ptxas, sm_90a): Gemma 2's fp8 layer backward `dacc9 @ w_qkvq` spills at every
candidate, fp8 (e5m2 cotangents) and 16-bit ("delayed-forward"), and at none of some fallback
(`test_gemma2_dgrad_takes_a_fallback_tile`, toolchain, slow).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import coda_lang
from coda_lang.backend_cute.build import select
from coda_lang.backend_cute.build.config import (
    FALLBACK_CANDIDATES,
    candidates_for,
    fallback_candidates_for,
    fits,
)
from coda_lang.backend_cute.plan.planner import plan_stage
from coda_lang.core.diagnostics import CodaError
from coda_lang.ir.nodes import Stage

FP8 = """dims M, N, K

block q(xq: e4m3[M, K], wq: e4m3[N, K], s: f32) -> (y: bf16[M, N]) {
  gemm xq @ transpose(wq) {
    y = acc * s
  }
}
"""
BF16 = FP8.replace("e4m3", "bf16")


def _fake(spilling: set[Any], compiled: list[Any]) -> Any:
    def compile_spec(spec: Any, config: Any, directory: Any = None) -> Any:
        compiled.append(config)
        n = 64 if config in spilling else 0
        report = SimpleNamespace(spills=bool(n), spill_stores=n, spill_loads=n, __str__=lambda: f"{n} bytes")
        return SimpleNamespace(config=config, report=report, rejected=())

    return compile_spec


def _block(text: str) -> coda_lang.Block:
    return coda_lang.load(text)["q"]


def test_fallbacks_are_not_the_stages_own_candidates() -> None:
    for text in (FP8, BF16):
        spec = plan_stage(_block(text), 1)
        got = fallback_candidates_for(spec)
        assert got and set(got) <= set(FALLBACK_CANDIDATES)
        assert not set(got) & set(candidates_for(spec)), text
    assert fallback_candidates_for(plan_stage(_block(FP8), 1)) == FALLBACK_CANDIDATES


def test_select_tries_the_fallbacks_only_after_every_candidate_spilled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = plan_stage(_block(FP8), 1)
    regular = [c for c in candidates_for(spec) if fits(spec, c)]
    compiled: list[Any] = []
    # every candidate and the first fallback spill: the second fallback is chosen
    spilling = set(candidates_for(spec)) | {FALLBACK_CANDIDATES[0]}
    monkeypatch.setattr(select, "compile_spec", _fake(spilling, compiled))
    c = select.select_config(_block(FP8), 1)
    assert c.config == FALLBACK_CANDIDATES[1]
    assert compiled == regular + list(FALLBACK_CANDIDATES[:2])
    # a candidate without spills: no fallback is compiled
    compiled.clear()
    monkeypatch.setattr(select, "compile_spec", _fake(set(regular[:-1]), compiled))
    assert select.select_config(_block(FP8), 1).config == regular[-1]
    assert compiled == regular
    assert not set(compiled) & set(FALLBACK_CANDIDATES)


def test_e0706_lists_the_fallbacks_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = plan_stage(_block(FP8), 1)
    every = set(candidates_for(spec)) | set(FALLBACK_CANDIDATES)
    monkeypatch.setattr(select, "compile_spec", _fake(every, []))
    with pytest.raises(CodaError) as e:
        select.select_config(_block(FP8), 1)
    (d,) = e.value.diagnostics
    assert d.code == "E0706"
    tried = [c for c in [*candidates_for(spec), *FALLBACK_CANDIDATES] if fits(spec, c)]
    assert [n.split(":")[0] for n in d.notes] == [str(c) for c in tried]


def test_no_fallback_where_quack_refused_every_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """E0707 stays E0707: a fallback is for a stage whose kernels spill, not one quack refuses."""
    from coda_lang.core.diagnostics import error

    compiled: list[Any] = []

    def refuse(spec: Any, config: Any, directory: Any = None) -> Any:
        compiled.append(config)
        raise error("E0707", "quack refused this tile", None, notes=["refused in a test"])

    monkeypatch.setattr(select, "compile_spec", refuse)
    with pytest.raises(CodaError) as e:
        select.select_config(_block(FP8), 1)
    assert e.value.diagnostics[0].code == "E0707"
    spec = plan_stage(_block(FP8), 1)
    assert compiled == [c for c in candidates_for(spec) if fits(spec, c)]


def test_a_bf16_stage_falls_back_too(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = plan_stage(_block(BF16), 1)
    compiled: list[Any] = []
    monkeypatch.setattr(select, "compile_spec", _fake(set(candidates_for(spec)), compiled))
    c = select.select_config(_block(BF16), 1)
    fallback = [f for f in fallback_candidates_for(spec) if fits(spec, f)]
    assert c.config == fallback[0]
    assert compiled == [x for x in candidates_for(spec) if fits(spec, x)] + fallback[:1]


def test_choose_config_takes_a_fallback_where_no_candidate_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    from coda_lang.backend_cute.runtime import tiles

    spec = plan_stage(_block(FP8), 1)
    # (a stage whose own candidates all break a rule: here, every tile but the fallbacks' is refused)
    monkeypatch.setattr(tiles, "fits", lambda sp, c, emulate=False: c in FALLBACK_CANDIDATES)
    assert tiles.choose_config(_block(FP8), 1, spec, emulate=True) == FALLBACK_CANDIDATES[0]
    monkeypatch.setattr(tiles, "fits", lambda sp, c, emulate=False: False)
    with pytest.raises(CodaError) as e:
        tiles.choose_config(_block(FP8), 1, spec, emulate=True)
    assert e.value.diagnostics[0].code == "E0706"


def test_the_tuners_list_falls_back_too(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = plan_stage(_block(FP8), 1)
    tune = select.tune_candidates_for(spec)
    # all candidates spill: the fallbacks without spills are the list
    monkeypatch.setattr(select, "compile_spec", _fake(set(tune) | {FALLBACK_CANDIDATES[2]}, []))
    got = select.configs_without_spills(spec)
    assert got == [c for c in FALLBACK_CANDIDATES if c != FALLBACK_CANDIDATES[2] and fits(spec, c)]
    # one candidate without spills: only it
    compiled: list[Any] = []
    monkeypatch.setattr(select, "compile_spec", _fake(set(tune[1:]), compiled))
    assert select.configs_without_spills(spec) == [tune[0]]
    assert not set(compiled) & set(FALLBACK_CANDIDATES)


@pytest.mark.toolchain
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("recipe", ["delayed", "delayed-forward"])
def test_gemma2_dgrad_takes_a_fallback_tile(recipe: str, tmp_path: Any) -> None:
    pytest.importorskip("quack")
    from coda_lang.hf.blocks import family_source
    from coda_lang.hf.family import FAMILIES
    from coda_lang.hf.state import block_wrt

    src = family_source(
        FAMILIES["gemma2"], "bfloat16", 1e-6, 256, (4, 2), fp8=recipe, fp8_save=recipe == "delayed"
    )
    b = coda_lang.load(src)["layer"]
    opts = coda_lang.BackwardOptions(fp8_grads="e5m2", fp8_acc=True) if recipe == "delayed" else None
    g = b.grad(block_wrt(b), backward=opts)
    stages = [s for s in g.ir.body if isinstance(s, Stage)]
    k = next(
        k for k, s in enumerate(stages, 1) if s.is_gemm and g.plan.stages[k - 1].text == "gemm dacc9 @ w_qkvq"
    )
    c = select.select_config(g, k, directory=tmp_path)
    assert c.config in FALLBACK_CANDIDATES and not c.report.spills, c.report
    assert len(c.rejected) >= 2 and all("spill" in r for r in c.rejected), c.rejected
