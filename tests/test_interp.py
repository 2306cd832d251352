"""The interpreter's semantics against hand-written NumPy: rounding of stored tiles, partial buffers
in tile mode, combine rules, tile-size invariance, input validation, and the f64 precision."""

from __future__ import annotations

import glob

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import coda_lang
from coda_lang.interp import random_inputs

EXAMPLES = sorted(glob.glob("examples/*.coda"))


def bf(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x).astype(np.float32)


ROUNDING = """
dims M, K, N
block b(x: bf16[M, K], w: bf16[K, N], v: bf16[N, N]) -> (s: f32[M], o: f32[M, N]) {
  gemm x @ w {
    h: bf16 = acc * 3.0
    s = sum(h, over=N)
  }
  gemm h @ v {
    o = acc + h
  }
}
"""


def test_stored_tile_rounded_only_after_its_stage() -> None:
    b = coda_lang.load(ROUNDING)["b"]
    rng = np.random.default_rng(0)
    x, w, v = (rng.standard_normal(s).astype(ml_dtypes.bfloat16) for s in ((7, 5), (5, 6), (6, 6)))
    out = b.run({"x": x, "w": w, "v": v})
    h32 = (f32(x) @ f32(w)) * np.float32(3.0)
    h16 = bf(h32)
    np.testing.assert_allclose(out["s"], h32.sum(1), rtol=1e-6)  # same stage: the f32 value
    np.testing.assert_allclose(out["o"], h16 @ f32(v) + h16, rtol=1e-6)  # later stage: the rounded value
    # and the two really differ, so the test can tell them apart
    assert np.abs(h32.sum(1) - h16.sum(1)).max() > 1e-4


PARTIALS = """
dims M, K, N
block b(x: f32[M, K], w: f32[K, N], t: i32[M]) -> (rs: f32[M], cs: f32[N], mx: f32[M], l: f32[M], p: f32[M]) {
  gemm x @ w {
    rs = sum(acc, over=N)
    cs = sum(acc * acc, over=M)
    mx = max(acc, over=N)
    l = logsumexp(acc, over=N)
    p = pick(acc, t)
  }
}
"""


def test_partial_buffers_are_per_tile_and_combine() -> None:
    b = coda_lang.load(PARTIALS)["b"]
    rng = np.random.default_rng(1)
    M, K, N, tm, tn = 37, 8, 50, 16, 24  # ragged in both directions
    x, w = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
    t = rng.integers(-1, N, M).astype(np.int32)  # -1: an index no tile holds
    out, parts = b.run_with_partials({"x": x, "w": w, "t": t}, sim_tile=(tm, tn))
    acc = x @ w
    col_tiles = [slice(j, min(j + tn, N)) for j in range(0, N, tn)]
    row_tiles = [slice(i, min(i + tm, M)) for i in range(0, M, tm)]
    assert parts["rs"].shape == (M, 3) and parts["cs"].shape == (3, N)
    for c, sl in enumerate(col_tiles):
        np.testing.assert_allclose(parts["rs"][:, c], acc[:, sl].sum(1), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(parts["mx"][:, c], acc[:, sl].max(1), rtol=1e-6)
        lse = np.log(np.exp(acc[:, sl].astype(np.float64)).sum(1))
        np.testing.assert_allclose(parts["l"][:, c], lse, rtol=1e-5)
    for r, sl in enumerate(row_tiles):
        np.testing.assert_allclose(parts["cs"][r], (acc[sl] ** 2).sum(0), rtol=1e-5)
    np.testing.assert_allclose(out["rs"], acc.sum(1), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out["cs"], (acc**2).sum(0), rtol=1e-4)
    np.testing.assert_allclose(out["mx"], acc.max(1))
    np.testing.assert_allclose(out["l"], np.log(np.exp(acc.astype(np.float64)).sum(1)), rtol=1e-5)
    want_p = np.where(t >= 0, acc[np.arange(M), np.clip(t, 0, None)], 0)
    np.testing.assert_allclose(out["p"], want_p, rtol=1e-6)


def test_grouped_reduction_and_tiling_constraint() -> None:
    src = """
dims M, K, N
block b(x: f32[M, K], w: f32[K, N]) -> (o: f32[M, N]) {
  gemm x @ w {
    ss = sum(acc * acc, over=N, group=4)
    o = acc * rsqrt(ss)
  }
}
"""
    b = coda_lang.load(src)["b"]
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((9, 3)).astype(np.float32), rng.standard_normal((3, 20)).astype(np.float32)
    acc = x @ w
    ss = (acc.reshape(9, 5, 4) ** 2).sum(-1)
    want = acc / np.sqrt(np.repeat(ss, 4, axis=1))
    np.testing.assert_allclose(b.run({"x": x, "w": w})["o"], want, rtol=1e-5)
    np.testing.assert_allclose(b.run({"x": x, "w": w}, sim_tile=(4, 8))["o"], want, rtol=1e-5)
    with pytest.raises(coda_lang.CodaError, match="splits the groups"):
        b.run({"x": x, "w": w}, sim_tile=(4, 6))


def test_f64_precision_does_not_round() -> None:
    b = coda_lang.load(ROUNDING)["b"]
    rng = np.random.default_rng(0)
    x, w, v = (rng.standard_normal(s) for s in ((7, 5), (5, 6), (6, 6)))
    out = b.run({"x": x, "w": w, "v": v}, precision="f64")
    assert out["o"].dtype == np.float64
    h = (x @ w) * 3.0
    np.testing.assert_allclose(out["o"], h @ v + h, rtol=1e-12)


def test_float_inputs_converted_to_declared_dtype() -> None:
    b = coda_lang.load(ROUNDING)["b"]
    rng = np.random.default_rng(3)
    x, w, v = (rng.standard_normal(s).astype(np.float32) for s in ((4, 5), (5, 6), (6, 6)))
    a = b.run({"x": x, "w": w, "v": v})
    c = b.run({"x": bf(x), "w": bf(w), "v": bf(v)})
    np.testing.assert_array_equal(a["o"], c["o"])


@pytest.mark.parametrize(
    "inputs, dims, pattern",
    [
        ({"x": np.zeros((4, 5)), "w": np.zeros((5, 6))}, None, "missing input `v`"),
        (
            {"x": np.zeros((4, 5)), "w": np.zeros((5, 6)), "v": np.zeros((6, 6)), "q": 1},
            None,
            "unknown input `q`",
        ),
        ({"x": np.zeros((4, 5)), "w": np.zeros((4, 6)), "v": np.zeros((6, 6))}, None, "K = 4, but K = 5"),
        ({"x": np.zeros((4, 5)), "w": np.zeros((5, 6)), "v": np.zeros((6,))}, None, "has shape"),
        ({"x": np.zeros((4, 5)), "w": np.zeros((5, 6)), "v": np.zeros((6, 6))}, {"M": 3}, "M = 4, but M = 3"),
        ({"x": np.zeros((4, 5)), "w": np.zeros((5, 6)), "v": np.zeros((6, 6))}, {"Q": 3}, "unknown dim `Q`"),
        (
            {"x": np.zeros((4, 5), np.int32), "w": np.zeros((5, 6)), "v": np.zeros((6, 6))},
            None,
            "declared bf16",
        ),
    ],
)
def test_input_errors_are_coda_errors(inputs: dict, dims: dict | None, pattern: str) -> None:
    b = coda_lang.load(ROUNDING)["b"]
    with pytest.raises(coda_lang.CodaError, match=pattern):
        b.run(inputs, dims=dims)


def test_index_input_must_be_integer_and_pairs_need_even_tile() -> None:
    lm = coda_lang.load("examples/lm_head_ce.coda")["lm_head_ce"]
    ins = random_inputs(lm.ir, {"M": 8, "D": 4, "V": 6})
    ins["target"] = ins["target"].astype(np.float32)
    with pytest.raises(coda_lang.CodaError, match="declared i32"):
        lm.run(ins)
    mlp = coda_lang.load("examples/llama_mlp.coda")["llama_mlp"]
    ins = random_inputs(mlp.ir, {"M": 8, "D": 4, "F": 6})
    with pytest.raises(coda_lang.CodaError, match="odd"):
        mlp.run(ins, sim_tile=(4, 5))


# Tile-size invariance: any tiling gives the whole-matrix result up to reassociation.


def _dims_for(block: coda_lang.Block, draw: st.DrawFn) -> dict[str, int]:
    dims = {}
    for d in block.ir.dims:
        if d.value is not None:  # a fixed dim (qk_norm's HD: its weight g is one head's)
            dims[d.name] = d.value
            continue
        lo, hi = (64, 128) if block.name == "qk_norm" and d.name == "P" else (1, 40)
        v = draw(st.integers(lo, hi))
        dims[d.name] = v - v % 64 if block.name == "qk_norm" and d.name == "P" else v
        if block.name == "fp8_blockwise" and d.name == "N":  # groups of 128 columns
            dims[d.name] = 128 * (1 + v % 3)
    return dims


@st.composite
def example_case(draw: st.DrawFn) -> tuple[coda_lang.Block, dict[str, int], tuple[int, int], int]:
    path = draw(st.sampled_from(EXAMPLES))
    block = next(iter(coda_lang.load(path)))
    dims = _dims_for(block, draw)
    tm = draw(st.integers(1, 48))
    tn = draw(st.integers(1, 40)) * (128 if block.name in ("qk_norm", "fp8_blockwise") else 2)
    return block, dims, (tm, tn), draw(st.integers(0, 2**16))


@settings(max_examples=40)
@given(example_case())
def test_tile_size_invariance(case: tuple[coda_lang.Block, dict[str, int], tuple[int, int], int]) -> None:
    block, dims, tile, seed = case
    inputs = random_inputs(block.ir, dims, seed)
    whole = block.run(inputs, precision="f64")
    tiled = block.run(inputs, precision="f64", sim_tile=tile)
    for name in whole:
        np.testing.assert_allclose(
            tiled[name], whole[name], rtol=1e-9, atol=1e-9, err_msg=f"{block.name}.{name}"
        )
    whole32 = block.run(inputs)
    tiled32 = block.run(inputs, sim_tile=tile)
    for name in whole32:
        a, b = f32(whole32[name]), f32(tiled32[name])
        scale = max(float(np.abs(a).max()), 1.0) if a.size else 1.0
        # f32 reassociation may move a bf16 rounding by one ulp (2^-8 relative) somewhere
        assert np.abs(a - b).max() <= scale * 2**-7, f"{block.name}.{name}"
