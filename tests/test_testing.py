"""coda_lang.testing: properties of the drawn programs, twins, sizes, inputs and the tolerance rule.

- The checker accepts every drawn program (random_blocks: several dtypes; forward_blocks: what autodiff
  handles), and its printed form parses back to the same IR (print/parse round trip).
- Every broken twin gets exactly one diagnostic, with the twin's code; every kind of mistake fits some
  example, and the twin of every example gets its code too.
- Sizes from `dim_sizes` bind for the block and its backward; `block_inputs` is seeded, in the
  declared dtypes, finite by default, with each kind of special value when asked.
- Tile-size invariance: the tile simulation agrees with the whole-matrix interpreter, forward and
  backward, for random programs at random sizes and tiles (`coda_lang.fuzz.Fuzzer`, which also turns
  any exception other than CodaError into a failure).
- No exception other than CodaError from checking twins or running blocks at odd tiles (and the
  interpreter's tile checks: an odd tile over a half-width load is E0805, an odd-width stage simulates).
- The tolerance rule (`compare.mismatch`) fails what it must and passes what it must.
- Importing coda_lang.testing imports no torch, and `coda check` imports no hypothesis.
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import coda_lang
from coda_lang.core.diagnostics import CodaError
from coda_lang.frontend.source import check_source
from coda_lang.fuzz import Case, Fuzzer
from coda_lang.testing import forward_blocks, random_blocks
from coda_lang.testing.compare import mismatch
from coda_lang.testing.dims import dim_sizes, dim_units, tile_unit, tiles
from coda_lang.testing.inputs import SPECIAL_KINDS, block_inputs, cotangents, input_seeds
from coda_lang.testing.mistakes import MISTAKES, Twin, make_twin, twins

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.coda"))
SLOW = [HealthCheck.too_slow, HealthCheck.data_too_large]


def _codes(text: str) -> list[str]:
    return [d.code for d in check_source(text)[2]]


# ------------------------------------------------------------------ drawn programs


@settings(suppress_health_check=SLOW)
@given(st.one_of(random_blocks(), forward_blocks()))
def test_drawn_programs_check_and_round_trip(fw: object) -> None:
    text = fw.text  # type: ignore[attr-defined]
    assert _codes(text) == [], text
    block = coda_lang.load(text)["fwd"]
    again = coda_lang.load(str(block))["fwd"]
    assert again.ir == block.ir, text
    assert str(again) == str(block)


@settings(suppress_health_check=SLOW)
@given(random_blocks())
def test_the_backward_of_a_drawn_program_checks_or_is_a_coda_error(fw: object) -> None:
    """Every random program (all dtypes) differentiates into a backward block the checker accepts, or
    raises CodaError (E06); never another exception. (Gradients against finite differences, for the
    programs autodiff handles: tests/test_autodiff.py.)"""
    block = coda_lang.load(fw.text)["fwd"]  # type: ignore[attr-defined]
    try:
        bwd = block.grad()
    except CodaError as e:
        assert all(d.code.startswith("E06") for d in e.diagnostics), e
        return
    assert _codes(str(bwd)) == []


def test_random_blocks_have_several_dtypes() -> None:
    seen: set[str] = set()

    @settings(max_examples=40, suppress_health_check=SLOW, database=None)
    @given(random_blocks())
    def run(fw: object) -> None:
        block = coda_lang.load(fw.text)["fwd"]  # type: ignore[attr-defined]
        seen.update(p.var.type.dtype for p in block.ir.params if p.var.type is not None)

    run()
    assert {"f32", "bf16", "f16"} <= seen


# ------------------------------------------------------------------ broken twins


@settings(suppress_health_check=SLOW)
@given(twins())
def test_every_twin_gets_exactly_its_code(tw: Twin) -> None:
    assert _codes(tw.original) == []
    assert _codes(tw.text) == [tw.code], f"{tw.kind}:\n{tw.text}"
    with pytest.raises(CodaError):  # and never another exception
        coda_lang.load(tw.text)


@pytest.mark.parametrize("kind", sorted(MISTAKES))
def test_twins_of_the_examples(kind: str) -> None:
    made = 0
    for path in EXAMPLES:
        for s in range(2):
            tw = make_twin(path.read_text(), kind, random.Random(s).choice)
            if tw is None:
                continue
            made += 1
            assert _codes(tw.text) == [MISTAKES[kind]], f"{path.name}, {kind}:\n{tw.text}"
    assert made, f"no example has a place for a `{kind}` mistake"


def test_a_twin_is_its_original_plus_the_mistake() -> None:
    text = (EXAMPLES[0].parent / "llama_mlp.coda").read_text()
    tw = make_twin(text, "partial_in_stage", lambda xs: list(xs)[0])
    assert tw is not None and tw.code == "E0501"
    added = [ln.strip() for ln in tw.text.splitlines() if ln not in tw.original.splitlines()]
    assert added == ["oops1 = sum(acc, over=D)", "oops2 = acc + oops1"]


# ------------------------------------------------------------------ sizes and inputs


@settings(suppress_health_check=SLOW)
@given(st.data())
def test_drawn_sizes_bind_forward_and_backward(data: st.DataObject) -> None:
    fw = data.draw(forward_blocks())
    block = coda_lang.load(fw.text)["fwd"]
    d = block.derivation()
    align = data.draw(st.sampled_from([1, 8]))
    sizes = data.draw(dim_sizes([block, d.forward, d.backward], 24, align))
    units = dim_units([block], align)
    assert all(sizes[k] % units[k] == 0 for k in units)
    ins = block_inputs(block, sizes, data.draw(input_seeds()))
    outs = block.run(ins, dims=sizes)
    grads = block.vjp(ins, cotangents(block, sizes, 0), dims=sizes)
    assert set(outs) == {o.name for o in block.ir.outputs} and set(grads) == set(d.grads)


def test_units_follow_the_extents() -> None:
    qk = coda_lang.load(ROOT / "examples" / "qk_norm.coda")["qk_norm"]
    assert dim_units([qk])["P"] == 64  # sum(..., over=2*P, group=128): 2*P a multiple of 128
    mlp = coda_lang.load(ROOT / "examples" / "llama_mlp.coda")["llama_mlp"]
    assert dim_units([mlp], align=8) == {"M": 8, "D": 8, "F": 8}
    assert tile_unit([mlp]) == 2  # pairs
    src = "dims M, K, F\nblock b(x: f32[M, K], w: f32[K, F]) -> (o: f32[M, F/2]) {\n  gemm x @ w {\n    a, o = pairs(acc)\n  }\n}\n"
    half = coda_lang.load(src)["b"]
    assert dim_units([half])["F"] == 2 and dim_units([half], align=8)["F"] == 16


def test_block_inputs() -> None:
    lm = coda_lang.load(ROOT / "examples" / "lm_head_ce.coda")["lm_head_ce"]
    sizes = {d.name: 12 for d in lm.ir.dims}
    a, b = block_inputs(lm, sizes, 7), block_inputs(lm, sizes, 7)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    c = block_inputs(lm, sizes, 8)
    assert any(not np.array_equal(a[k], c[k]) for k in a)
    for p in lm.ir.params:
        if p.default is None:
            want = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16, "i32": np.int32}
            assert a[p.var.name].dtype == np.dtype(want[p.var.type.dtype]), p.var.name
            assert np.isfinite(a[p.var.name].astype(np.float64)).all()
    target = np.concatenate([block_inputs(lm, sizes, s)["target"] for s in range(20)])
    width = 12  # V
    assert set(np.unique(target)) <= set(range(width)) | {-100, -1, width}
    assert {-100, -1, width} & set(np.unique(target)), "some rows select nothing"


def test_special_inputs() -> None:
    blk = coda_lang.load(ROOT / "examples" / "bias_gelu.coda")["bias_gelu"]
    sizes = {d.name: 64 for d in blk.ir.dims}
    x = np.concatenate(
        [v.astype(np.float64).ravel() for v in block_inputs(blk, sizes, 0, special=True).values()]
    )
    assert np.isnan(x).any() and np.isposinf(x).any() and np.isneginf(x).any()
    assert (np.abs(x) >= 1e3).any() and ((x != 0) & (np.abs(x) < np.finfo(np.float32).tiny)).any()
    assert (np.signbit(x) & (x == 0)).any()
    only = np.concatenate(
        [v.astype(np.float64).ravel() for v in block_inputs(blk, sizes, 0, special=("nan",)).values()]
    )
    assert np.isnan(only).any() and np.isfinite(only[~np.isnan(only)]).all()
    assert set(SPECIAL_KINDS) == {"nan", "inf", "-inf", "large", "denormal", "zero"}


# ------------------------------------------------------------------ tile-size invariance


@settings(suppress_health_check=SLOW)
@given(st.data())
def test_tile_simulation_matches_whole_matrices(data: st.DataObject) -> None:
    """Random program, sizes, tile and inputs: tile simulation == whole interpreter, forward and
    backward, within the tolerance rule (no exception at all)."""
    fw = data.draw(st.one_of(forward_blocks(), random_blocks()))
    block = coda_lang.load(fw.text)["fwd"]
    fz = Fuzzer(block, "interp")
    case = data.draw(fz.cases(max_dim=20))
    assert fz.check(case) == [], f"{case.describe()}\n{fw.text}"


@settings(suppress_health_check=SLOW)
@given(st.data())
def test_special_inputs_agree_between_tile_and_whole(data: st.DataObject) -> None:
    """With NaN, inf, large and denormal inputs, the tile simulation still agrees (same non-finite
    elements), for the examples, forward only."""
    path = data.draw(st.sampled_from([p for p in EXAMPLES if p.stem != "qk_norm"]))
    block = next(iter(coda_lang.load(path)))
    fz = Fuzzer(block, "interp", backward=False, special=True)
    case = data.draw(fz.cases(max_dim=16))
    assert fz.check(case) == [], f"{path.name}: {case.describe()}"


def test_vjp_with_a_dim_the_backward_drops() -> None:
    """Found by coda fuzz (was API BUG 1): the forward uses a dim only as a value, the backward not at all."""
    src = (
        "dims M, K, N, F\nblock fwd(x: f32[M, K], w: f32[K, F]) -> (o: f32[M, F]) {\n"
        "  gemm x @ w {\n    v = N + 0.5\n    o = acc\n  }\n}\n"
    )
    block = coda_lang.load(src)["fwd"]
    sizes = {"M": 2, "K": 2, "N": 2, "F": 2}
    ins = block_inputs(block, sizes, 0)
    block.vjp(ins, cotangents(block, sizes, 0), dims=sizes)


# ------------------------------------------------------------------ no exception but CodaError


@settings(suppress_health_check=SLOW)
@given(st.data())
def test_odd_tiles_raise_only_coda_errors(data: st.DataObject) -> None:
    """Any tile (not only the ones `tiles()` draws) gives a result or a CodaError (E0805)."""
    path = data.draw(st.sampled_from(EXAMPLES))
    block = next(iter(coda_lang.load(path)))
    sizes = data.draw(dim_sizes([block], 12))
    tile = (data.draw(st.integers(1, 9)), data.draw(st.integers(1, 9)))
    ins = block_inputs(block, sizes, 0)
    try:
        block.run(ins, dims=sizes, sim_tile=tile)
    except CodaError as e:
        assert [d.code for d in e.diagnostics] == ["E0805"]


def test_odd_tile_with_a_half_width_load_is_e0805() -> None:
    """(Was INTERP BUG 1: an IndexError.) A tile_N that splits the column pairs of a half-width tile the
    stage loads is refused as the checker's tiling rule says."""
    src = (
        "dims M, K, N\nblock f(x: f32[M, K], w: f32[K, 2*N], p: f32[M, N], i: i32[M]) -> (v: f32[M]) {\n"
        "  gemm x @ w {\n    v = pick(p, i)\n  }\n}\n"
    )
    block = coda_lang.load(src)["f"]
    sizes = {"M": 1, "K": 1, "N": 1}
    with pytest.raises(CodaError) as e:
        block.run(block_inputs(block, sizes, 0), dims=sizes, sim_tile=(1, 1))
    assert [d.code for d in e.value.diagnostics] == ["E0805"] and "`p`" in e.value.diagnostics[0].message


def test_odd_width_stage_with_double_width_tiles_is_simulated() -> None:
    """(Was INTERP LIMIT 1.) llama_mlp's backward at F = 1: the SwiGLU-backward stage is 1 column wide and
    holds acc2 of 2*F columns; a tile that holds the whole width splits no pair, so it simulates, and
    the gradients equal the whole-matrix interpreter's."""
    block = coda_lang.load(ROOT / "examples" / "llama_mlp.coda")["llama_mlp"]
    sizes = {"M": 2, "D": 2, "F": 1}
    ins, cts = block_inputs(block, sizes, 0), cotangents(block, sizes, 0)
    tiled = block.vjp(ins, cts, dims=sizes, sim_tile=(2, 2))
    whole = block.vjp(ins, cts, dims=sizes)
    for k in whole:
        assert mismatch(k, tiled[k], whole[k]) is None, k


def test_tiles_strategy_respects_the_interpreter() -> None:
    block = coda_lang.load(
        "dims M, K, N\nblock f(x: f32[M, K], w: f32[K, 2*N], p: f32[M, N], i: i32[M]) -> "
        "(v: f32[M]) {\n  gemm x @ w {\n    v = pick(p, i)\n  }\n}\n"
    )["f"]

    @settings(max_examples=20, database=None)
    @given(tiles([block]))
    def run(tile: tuple[int, int]) -> None:
        assert tile[1] % 2 == 0

    run()


# ------------------------------------------------------------------ the tolerance rule


def test_mismatch_rule() -> None:
    ref = np.linspace(-2, 2, 12).reshape(3, 4).astype(np.float32)
    assert mismatch("o", ref, ref) is None
    assert mismatch("o", ref * (1 + 5e-4), ref) is None  # within 1e-3 for f32
    assert mismatch("o", ref * (1 + 5e-3), ref, dtype="bf16") is None  # within 2**-7 for bf16
    assert "differ beyond" in (mismatch("o", ref * (1 + 5e-3), ref) or "")
    bad = ref.copy()
    bad[2, 3] = -bad[2, 3]
    msg = mismatch("o", bad, ref, dtype="bf16")
    assert msg and "1 of 12" in msg and "[2, 3]" in msg
    assert "shape" in (mismatch("o", ref[:2], ref) or "")
    nan = ref.copy()
    nan[0, 0] = np.nan
    assert mismatch("o", nan, nan) is None
    assert "finite" in (mismatch("o", nan, ref) or "") and "finite" in (mismatch("o", ref, nan) or "")
    inf = ref.copy()
    inf[1, 1] = np.inf
    assert mismatch("o", inf, inf) is None and mismatch("o", -inf, -inf) is None
    assert mismatch("o", np.where(inf == np.inf, -np.inf, inf), inf) is not None
    assert mismatch("o", np.float32(-0.0), np.float32(0.0)) is None
    assert "1 of 1" in (mismatch("s", np.float32(1.0), np.float32(2.0)) or "")  # a scalar output
    # the paper's rule: where the interpreter itself is far from float64, a result as accurate passes
    ref64 = ref.astype(np.float64) + 0.05
    assert mismatch("o", ref + 0.04, ref, ref64) is None
    assert mismatch("o", ref + 0.2, ref, ref64) is not None


def test_fuzzer_reports_exceptions_as_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    block = coda_lang.load(ROOT / "examples" / "bias_gelu.coda")["bias_gelu"]
    fz = Fuzzer(block, "interp")
    case = Case({d.name: 8 for d in block.ir.dims}, 0, (4, 4))
    assert fz.check(case) == []

    def boom(*a: object, **k: object) -> None:
        raise ValueError("planted")

    monkeypatch.setattr(coda_lang.Block, "vjp", boom)
    assert fz.check(case) == [
        "the whole-matrix interpreter's backward (Block.vjp) raised ValueError: planted"
    ]


# ------------------------------------------------------------------ imports


def test_imports_stay_light() -> None:
    code = (
        "import sys, coda_lang.testing, coda_lang.fuzz; "
        "assert 'torch' not in sys.modules, 'torch'; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
    code = (
        "import sys; from coda_lang.cli import main; main(['check', 'examples/llama_mlp.coda']); "
        "assert 'hypothesis' not in sys.modules and 'coda_lang.testing' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.strip().endswith("ok"), out.stderr
