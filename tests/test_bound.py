"""coda_lang/interp/bound.py: the interpreter with a rounding bound for every element.

- Its values are exactly `Block.run`'s and `Block.vjp`'s (exact precision), on every example.
- The bound holds: the tile simulation at small tiles and the emulated kernels (other implementations
  that round where the interpreter rounds) are within BOUND_SAFETY * bound of the interpreter on every
  example, outputs and gradients, at a case the fuzzer draws; the tile simulation on random programs.
- Where a sum cancels, the bound is relative to its terms: the gradient of `r` in
  tests/fuzz_found/head_norm_row_scale.coda is about 1e-2 with terms near 500; its bound is a small
  fraction of the terms' sum and of the gradient, and holds for the emulated kernel's result.
- The rules one at a time: a bf16 store removes a difference unless something within the bound rounds
  elsewhere; a comparison closer than its bounds lets `where` take either branch; a GEMM's bound is
  relative to |A| @ |B|; a max keeps the largest bound.
- `compare.mismatch(bound=)`: an element within 2 * bound passes; a NaN bound passes nothing (the
  bound never gives one: special inputs, random programs with special inputs, flipped ties); a bound
  of `ANY` passes anything, and comes only where another correct implementation may give anything:
  inf times a value within rounding of 0 (qkv_rope's inf * sin of an angle near 1e8), 0 / 0 and a
  log of a value within rounding of 0, and what is computed from those.
- sin and cos of an operand whose bound spans a period move by 2, not by the endpoints' difference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from support import NO_BACKWARD

import coda_lang
from coda_lang import fuzz
from coda_lang.interp import bound
from coda_lang.testing.compare import BOUND_SAFETY, as_float64, mismatch
from coda_lang.testing.inputs import block_inputs, cotangents

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.coda"))
HEAD_NORM = ROOT / "tests" / "fuzz_found" / "head_norm_row_scale.coda"


def _one_block(path: Path) -> Any:
    return next(iter(coda_lang.load(path)))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_the_values_are_the_interpreters(path: Path) -> None:
    block = _one_block(path)
    fz = fuzz.Fuzzer(block, "interp")
    dims = {name: 16 * unit for name, unit in fz.units().items() if name != "HD"}
    ins = block_inputs(block, dims, 3)
    outs, errs = bound.run(block, ins, dims)
    for k, v in block.run(ins, dims=dims).items():
        assert np.array_equal(as_float64(outs[k]), as_float64(v), equal_nan=True), k
        assert errs[k].shape == np.shape(v) and np.all(errs[k] >= 0), k
    if block.name in NO_BACKWARD:
        return
    cots = cotangents(block, dims, 3)
    grads, gerrs = bound.vjp(block, ins, cots, dims)
    for k, v in block.vjp(ins, cots, dims=dims).items():
        assert np.array_equal(as_float64(grads[k]), as_float64(v), equal_nan=True), k
        assert gerrs[k].shape == np.shape(v) and not np.any(gerrs[k] < 0), k


def _bound_holds(
    monkeypatch: pytest.MonkeyPatch, block: Any, target: str, seed: int, programs: int = 0
) -> int:
    """Every element the fuzzer compares (one drawn case) is within BOUND_SAFETY * bound of the
    interpreter; the number of elements checked."""
    checked = [0]
    outputs = fuzz.Fuzzer._outputs

    def check(self: Any, what: str, got: Any, ref: Any, ref64: Any, dtypes: Any, bounds: Any = None) -> Any:
        assert bounds is not None
        for name, r in ref.items():
            g, want, b = as_float64(got[name]), as_float64(r), as_float64(bounds()[name])
            # (a bound of ANY, -inf, allows anything: the conservative bound after, say, a divisor whose
            # own bound reaches 0; the accuracy rule passes every value there)
            fin = np.isfinite(want) & (b != bound.ANY)
            over = np.abs(g - want)[fin] > BOUND_SAFETY * b[fin]
            assert not over.any(), (what, name, np.abs(g - want)[fin][over][:4], b[fin][over][:4])
            checked[0] += int(fin.sum())
        return outputs(self, what, got, ref, ref64, dtypes, bounds)

    monkeypatch.setattr(fuzz.Fuzzer, "_outputs", check)
    if programs:
        result = fuzz.fuzz_programs(programs, target, examples=2, seed=seed, shrink=False)
    else:
        result = fuzz.fuzz_block(block, target, examples=1, seed=seed, shrink=False)
    assert result.failure is None, result.failure
    return checked[0]


@pytest.mark.parametrize("path", EXAMPLES + [HEAD_NORM], ids=lambda p: p.stem)
def test_the_bound_holds_for_the_tile_simulation(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _bound_holds(monkeypatch, _one_block(path), "interp", 1) > 0


@pytest.mark.parametrize("path", EXAMPLES + [HEAD_NORM], ids=lambda p: p.stem)
def test_the_bound_holds_for_the_emulated_kernels(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    assert _bound_holds(monkeypatch, _one_block(path), "emulate", 2) > 0


def test_the_bound_holds_in_random_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _bound_holds(monkeypatch, None, "interp", 5, programs=12) > 0


def test_a_cancelling_sum_is_bounded_by_its_terms() -> None:
    block = _one_block(HEAD_NORM)
    dims = {"M": 8, "D": 8, "N": 128, "HD": 16}
    ins, cots = block_inputs(block, dims, 16777212), cotangents(block, dims, 16777212)
    grads, errs = bound.vjp(block, ins, cots, dims)
    dr, e = np.asarray(grads["r"], np.float64), errs["r"]
    # the terms of dr: dz * acc over the 128 columns of each row (float64, from the saved acc)
    d = block.derivation()
    fwd = d.forward.run(ins, dims=dims, precision="f64")
    acc = np.asarray(fwd["acc1"], np.float64)
    dq = np.asarray(cots["q"], np.float64) * np.asarray(ins["gq"], np.float64)
    z = acc * np.asarray(ins["r"], np.float64)[:, None]
    ss = (z * z).reshape(8, -1, 16).sum(-1).repeat(16, 1)
    s = 1 / np.sqrt(ss / 16 + 1e-6)
    dz = dq * s - z * s**3 / 16 * (dq * z).reshape(8, -1, 16).sum(-1).repeat(16, 1)
    terms = np.abs(dz * acc).sum(1)
    assert np.allclose((dz * acc).sum(1), dr, rtol=1e-2, atol=1e-4)  # (the terms are dr's)
    big = np.abs(dr) > 5e-3  # rows 2 and 3: dr of 7e-3 and 1.3e-2 from terms of 450 and 560
    assert big.sum() == 2 and np.all(terms[big] > 3e4 * np.abs(dr[big]))
    assert np.all(e < 1e-4 * terms)  # relative to the terms ...
    assert np.all(e[big] < 0.7 * np.abs(dr[big]))  # ... and yet below the cancelled value where it is 1e-2
    torch = pytest.importorskip("torch")
    fz = fuzz.Fuzzer(block, "emulate")
    tensors = {k: fz._tensor(v) for k, v in ins.items()}
    tensors["r"].requires_grad_(True)
    out = fz.fn(tensors, dims=dims)["q"]
    (got,) = torch.autograd.grad([out], [tensors["r"]], [fz._tensor(cots["q"]).to(out.dtype)])
    diff = np.abs(as_float64(got) - dr)
    assert np.all(diff <= e) and diff.max() > 0
    assert mismatch("dr", got, grads["r"]) is not None  # the per-element rule alone fails it
    assert mismatch("dr", got, grads["r"], bound=e) is None


# ------------------------------------------------------------------ the rules


def _program(body: str, params: str, outs: str) -> Any:
    return coda_lang.load(f"dims M, K, N\nblock b({params}) -> ({outs}) {{\n{body}\n}}\n")["b"]


def test_a_store_keeps_a_difference_only_where_it_may_round_elsewhere() -> None:
    block = _program(
        "  gemm x @ w {\n    y: bf16 = acc * s\n  }",
        "x: f32[M, K], w: f32[K, N], s: f32",
        "y: bf16[M, N]",
    )
    one = float(ml_dtypes.bfloat16(1.0))
    half_ulp = 2.0**-8  # 1 + 2^-8 is halfway between 1 and the next bf16
    x = np.array([[1.0], [1.0 + half_ulp], [1.0 + half_ulp / 2]], np.float32)
    w = np.ones((1, 2), np.float32)
    outs, errs = bound.run(block, {"x": x, "w": w, "s": np.float32(one)}, {"M": 3, "K": 1, "N": 2})
    e = errs["y"]
    assert np.all(e[0] == 0)  # 1.0 * 1.0: both sides store the same bf16
    assert np.all(e[1] == 2.0**-7)  # a tie: the least rounding of the product may go either way
    assert np.all(e[2] == 0)  # a quarter ulp from 1: a rounding of the product can't move it past the tie


def test_a_gemm_is_bounded_relative_to_its_magnitudes() -> None:
    block = _program("  gemm x @ w {\n    y = acc\n  }", "x: f32[M, K], w: f32[K, N]", "y: f32[M, N]")
    x = np.array([[1e4, -1e4, 1.0]], np.float32)
    w = np.ones((3, 1), np.float32)
    outs, errs = bound.run(block, {"x": x, "w": w}, {"M": 1, "K": 3, "N": 1})
    assert outs["y"][0, 0] == 1.0
    assert 2 * 3 * 2.0**-24 * 20001 <= errs["y"][0, 0] < 1e-2  # 2 K u |x| @ |w|, not relative to 1


def test_a_comparison_within_its_bounds_may_go_either_way() -> None:
    block = _program(
        "  gemm x @ w {\n    m = where(acc > 1.0, acc, -acc)\n  }",
        "x: f32[M, K], w: f32[K, N]",
        "m: f32[M, N]",
    )
    x = np.array([[1.0, 2.0**-30], [3.0, 0.0]], np.float32)  # acc = 1 (+ a term below its rounding), 3
    w = np.ones((2, 1), np.float32)
    outs, errs = bound.run(block, {"x": x, "w": w}, {"M": 2, "K": 2, "N": 1})
    assert errs["m"][0, 0] >= 2.0  # 1 or -1: `acc > 1` may come out either way
    assert errs["m"][1, 0] < 1e-5  # 3 is far from 1


def test_a_max_keeps_the_largest_bound() -> None:
    block = _program(
        "  gemm x @ w {\n    m = max(acc, over=N)\n  }",
        "x: f32[M, K], w: f32[K, N]",
        "m: f32[M]",
    )
    x = np.array([[3.0, -3.0, 1.0]], np.float32)
    w = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 2.0]], np.float32)  # acc = [0 (from 3 - 3), 2]
    outs, errs = bound.run(block, {"x": x, "w": w}, {"M": 1, "K": 3, "N": 2})
    assert outs["m"][0] == 2.0
    e_acc0 = 2 * 3 * 2.0**-24 * 6  # the cancelled column's bound is the larger
    assert errs["m"][0] == pytest.approx(e_acc0)


def test_a_subnormal_result_may_be_zero() -> None:
    """sigmoid(-90) is 7e-40, below f32's smallest normal: an implementation that flushes it, or
    computes 1 / (1 + exp(90)) and gets 0, is correct too. Its bound reaches 0 (and so does a normal
    result's not), and an infinity times it may be anything (tests/fuzz_found/
    sigmoid_subnormal_special.coda, where torch gave NaN and the interpreter inf)."""
    block = _program(
        "  gemm x @ w {\n    s = sigmoid(acc)\n    y = s * t\n  }",
        "x: f32[M, K], w: f32[K, N], t: f32",
        "s: f32[M, N], y: f32[M, N]",
    )
    x = np.array([[-90.0], [-10.0]], np.float32)
    w = np.ones((1, 1), np.float32)
    outs, errs = bound.run(block, {"x": x, "w": w, "t": np.float32(np.inf)}, {"M": 2, "K": 1, "N": 1})
    tiny = float(np.finfo(np.float32).tiny)
    assert 0 < outs["s"][0, 0] < tiny and errs["s"][0, 0] >= outs["s"][0, 0]
    assert 0 < errs["s"][1, 0] < 1e-3 * outs["s"][1, 0]  # 4.5e-5: a normal result's bound is relative
    assert bool(np.isinf(outs["y"][0, 0])) and errs["y"][0, 0] == bound.ANY  # inf * (maybe 0)
    assert errs["y"][1, 0] != bound.ANY


def test_mismatch_with_a_bound() -> None:
    ref = np.array([1e-4, 2e-4, -3e-4], np.float32)
    got = ref + np.array([5e-5, 0, 0], np.float32)  # 50 % off
    assert mismatch("g", got, ref) is not None
    assert mismatch("g", got, ref, bound=np.array([3e-5, 0, 0])) is None  # within 2 * bound
    msg = mismatch("g", got, ref, bound=np.array([2e-5, 0, 0]))
    assert msg and "and the rounding bound" in msg and "rounding bound 2e-05" in msg
    assert mismatch("g", got, ref, bound=np.array([np.nan, 0, 0])) is not None
    assert mismatch("g", got, ref, bound=np.ones(2)) is not None  # a bound of another shape is not used


def test_an_exact_operand_beside_an_infinite_one_moves_nothing() -> None:
    """An infinity among the inputs (coda fuzz --special) makes inf * 0 among the magnitudes: an exact
    operand beside it moves nothing (0, not NaN); a GEMM's sum of |a| |b| with inf * 0 (acc is NaN
    there) is unbounded (inf). (A NaN bound still passes nothing.)"""
    assert bound._times(np.array([np.inf, np.inf, 2.0]), np.array([0.0, 1.0, 0.5])).tolist() == [
        0.0,
        np.inf,
        1.0,
    ]
    block = _one_block(ROOT / "examples" / "lm_head_ce.coda")
    dims = {"M": 64, "D": 8, "V": 8}
    ins = block_inputs(block, dims, 0, special=True)
    assert any(np.isinf(np.asarray(v, np.float64)).any() for v in ins.values())
    outs, errs = bound.run(block, ins, dims)
    fin = np.isfinite(outs["lse"])
    assert fin.sum() > 40 and not np.isnan(errs["lse"][fin]).any()


def test_an_overflow_within_the_bound_is_not_a_failure() -> None:
    """An element whose bound exceeds f32's range may overflow in a correct implementation (lm_head_ce
    with a logit of 1.25e13 on the H100: its exp(logit - lse) recomputed a few ulps apart is inf):
    an infinity against a finite reference passes there; a NaN, or the same without the bound, fails."""
    ref = np.array([1.0, -6848.0, 5.0])
    got = np.array([1.0, -np.inf, 5.0])
    assert mismatch("g", got, ref, bound=np.array([0.0, np.inf, 0.0])) is None
    assert mismatch("g", got, ref, bound=np.array([0.0, 1e300, 0.0])) is None
    assert mismatch("g", got, ref, bound=np.array([0.0, 1e30, 0.0])) is not None
    assert mismatch("g", got, ref) is not None
    assert mismatch("g", np.array([1.0, np.nan, 5.0]), ref, bound=np.array([0.0, np.inf, 0.0])) is not None


def test_special_inputs_leave_no_bound_unknown() -> None:
    """`coda fuzz --target cuda --special` on the H100 (lm_head_ce, seed 102, dims M=328, D=8, V=8,
    input seed 0): a NaN in `r` and a -inf in `w_lm` made every gradient bound NaN (0 * inf in a GEMM's
    sums and in a product's bounds, a -inf logit in the log-sum-exp), so a row of logits near 1.1e9,
    whose softmax rounding decides (the kernel's exp(logit - lse) was 0 where the interpreter's is 1),
    failed as a mismatch. Now: no NaN bound anywhere; a value that is infinite because an exact input
    is has bound 0; the ill-conditioned row's bound covers the kernel's result; the same rules on
    every example with special inputs."""
    block = _one_block(ROOT / "examples" / "lm_head_ce.coda")
    dims = {"M": 328, "D": 8, "V": 8}
    ins = block_inputs(block, dims, 0, special=True)
    cots = cotangents(block, dims, 0)
    grads, errs = bound.vjp(block, ins, cots, dims, "auto")
    for name, e in errs.items():
        assert not np.isnan(e).any(), name
    ref = as_float64(grads["hg"])
    assert np.isfinite(ref[265, 3]) and abs(ref[265, 3]) > 7e8
    gpu = -3.670016e8  # what the H100's kernels gave (the first of its two terms)
    assert abs(gpu - ref[265, 3]) <= BOUND_SAFETY * errs["hg"][265, 3]
    assert (
        mismatch(
            "hg",
            np.where(np.arange(ref.size).reshape(ref.shape) == 265 * 8 + 3, gpu, ref),
            ref,
            None,
            "f32",
            errs["hg"],
        )
        is None
    )
    # the forward: a -inf in w_lm makes -inf logits, exactly: their bound is 0, not unknown
    outs, ferr = bound.run(block, ins, dims)
    for name, e in ferr.items():
        assert not np.isnan(e).any(), name
    for path in EXAMPLES:
        blk = _one_block(path)
        d = fuzz.Fuzzer(blk, "interp", backward=True).units()
        small = {k: 16 * v for k, v in d.items() if k not in {x.name for x in blk.ir.dims if x.value}}
        ins = block_inputs(blk, small, 3, special=True)
        if blk.name in NO_BACKWARD:
            _, errs = bound.run(blk, ins, small)
        else:
            _, errs = bound.vjp(blk, ins, cotangents(blk, small, 3), small, "auto")
        assert not any(np.isnan(e).any() for e in errs.values()), path.stem


def test_a_flipped_tie_is_not_rounding() -> None:
    """`==` is judged exactly: a backward that finds a max's ties by comparing a recomputed value (one
    that rounds differently) with the forward's max loses the cotangent, a bug the fuzzer must report
    (tests/test_fuzz.py); the bound gives the comparison 0, while `>` near its threshold may flip."""
    block = _program(
        "  gemm x @ w {\n    m = where(acc == 1.0, acc, -acc)\n  }",
        "x: f32[M, K], w: f32[K, N]",
        "m: f32[M, N]",
    )
    x = np.array([[1.0, 2.0**-30]], np.float32)
    w = np.ones((2, 1), np.float32)
    outs, errs = bound.run(block, {"x": x, "w": w}, {"M": 1, "K": 2, "N": 1})
    assert outs["m"][0, 0] == 1.0 and errs["m"][0, 0] < 1e-5


@pytest.mark.parametrize("seed", [6, 7])
def test_special_inputs_in_random_programs_leave_no_bound_unknown(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same over random programs with special inputs (seeds where NaN bounds came out of gelu,
    silu, sigmoid and products of NaN values before): every bound of every compared value is a number
    or inf, never NaN (which would fail an element that rounding explains)."""
    outputs = fuzz.Fuzzer._outputs
    seen = {"values": 0, "nan": []}

    def check(self: Any, what: str, got: Any, ref: Any, ref64: Any, dtypes: Any, bounds: Any = None) -> Any:
        assert bounds is not None
        for name in ref:
            b = as_float64(bounds()[name])
            seen["values"] += 1
            if np.isnan(b).any():
                seen["nan"].append(f"{what} {name}")
        return outputs(self, what, got, ref, ref64, dtypes, bounds)

    monkeypatch.setattr(fuzz.Fuzzer, "_outputs", check)
    result = fuzz.fuzz_programs(12, "interp", examples=2, seed=seed, shrink=False, special=True)
    assert result.failure is None, result.failure
    assert seen["values"] > 20 and not seen["nan"], seen


def _rope_inputs(pos: list[float]) -> dict[str, Any]:
    """qkv_rope's inputs for one column pair: x = inf (from w_qkv), y = 1, angles `pos`."""
    bf = ml_dtypes.bfloat16
    m = len(pos)
    return {
        "xg": np.ones((m, 1), bf),
        "r": np.ones(m, np.float32),
        "w_qkv": np.array([[np.inf, 1.0]], bf),
        "pos": np.array(pos, np.float32),
        "freq": np.array([1.0], np.float32),
    }


def test_inf_times_a_value_within_rounding_of_zero_may_be_anything() -> None:
    """`coda fuzz examples/qkv_rope.coda --target cuda --special` on the H100 (dims M=8, D=8, P=24,
    input seed 0) failed: NaN from the kernel where the interpreter has inf. An infinite x times
    cos(ang) at an angle near 1e8 (its bound spans periods: the kernel's cos may be 0 or of the other
    sign) is inf, -inf or NaN in a correct implementation: its bound is ANY, and that element passes
    whatever it is; at angle 3 the same inf is exact and a NaN there still fails."""
    block = _one_block(ROOT / "examples" / "qkv_rope.coda")
    outs, errs = bound.run(block, _rope_inputs([1e8, 3.0]), {"M": 2, "D": 1, "P": 1})
    q = as_float64(outs["qkv"])
    assert np.isinf(q).all()
    assert (errs["qkv"][0] == bound.ANY).all() and (errs["qkv"][1] == 0).all()
    for got in (np.nan, -q[0, 0], 1.0):
        g = q.copy()
        g[0, 0] = got
        assert mismatch("qkv", g, q, None, "bf16", errs["qkv"]) is None, got
    g = q.copy()
    g[1, 0] = np.nan
    assert mismatch("qkv", g, q, None, "bf16", errs["qkv"]) is not None
    assert mismatch("qkv", np.where(np.isinf(q), np.nan, q), q, None, "bf16") is not None  # (no bound)


def test_sin_and_cos_of_an_angle_that_may_move_a_period_may_be_anything_in_range() -> None:
    """The endpoints' rule (f(x +- e) - f(x)) gave cos(1e8) with e near 6 a bound of 0.31, though
    cos swings through [-1, 1] within it: sin and cos move by min(e, 2)."""
    block = _program(
        "  gemm x @ w {\n    c = cos(acc)\n    s = sin(acc)\n  }",
        "x: f32[M, K], w: f32[K, N]",
        "c: f32[M, N], s: f32[M, N]",
    )
    x = np.array([[1e8, 1.0], [0.5, 0.0]], np.float32)
    outs, errs = bound.run(block, {"x": x, "w": np.ones((2, 1), np.float32)}, {"M": 2, "K": 2, "N": 1})
    for name in ("c", "s"):
        assert errs[name][0, 0] >= 2.0, name  # |x| @ |w| near 1e8: the sum's bound is over a period
        assert errs[name][1, 0] < 1e-5, name


def test_a_quotient_or_log_of_a_value_within_rounding_of_zero_may_be_anything() -> None:
    """acc = 1 - 1 + 2^-30 is within its rounding bound of 0: acc / acc may be 0 / 0 (NaN) and
    log(acc) the log of a negative number (NaN) in a correct implementation; at acc = 2 both are
    bounded numbers."""
    block = _program(
        "  gemm x @ w {\n    q = acc / acc\n    l = log(acc)\n    n = q * 0.0 + 1.0\n  }",
        "x: f32[M, K], w: f32[K, N]",
        "q: f32[M, N], l: f32[M, N], n: f32[M, N]",
    )
    x = np.array([[1.0, -1.0, 2.0**-30], [1.0, 1.0, 0.0]], np.float32)
    outs, errs = bound.run(block, {"x": x, "w": np.ones((3, 1), np.float32)}, {"M": 2, "K": 3, "N": 1})
    for name in ("q", "l", "n"):  # (n: computed from q, which may be NaN: anything too)
        assert errs[name][0, 0] == bound.ANY, name
        assert 0 <= errs[name][1, 0] < 1e-5, name


def test_a_function_that_is_nan_here_but_may_be_a_number_may_be_anything() -> None:
    """The reverse of the rule above, found by a CPU sweep of the fp8 blocks on emulated kernels whose
    fp8 GEMMs round as Hopper's may: OLMo 2's blockwise `first_qkv` (random q/k masks, so its sum of
    squares may be negative) had a row where rsqrt(ssk / NK + eps) is NaN here (ssk = -47.6) though ssk's
    bound (1.7e5) reaches positive values, where it is a number. Its bound was inf, which passes a
    finite value against a finite reference but not against a NaN one: the kernel's -48.75 against the
    interpreter's NaN failed. It is ANY now, and what is computed from it; where the operand is
    negative beyond its bound, the NaN is certain and a number there still fails."""
    block = _program(
        "  gemm x @ w {\n    r = rsqrt(acc)\n    z = r * 2.0\n  }",
        "x: f32[M, K], w: f32[K, N]",
        "r: f32[M, N], z: f32[M, N]",
    )
    x = np.array([[1.0, -1.0, -(2.0**-30)], [-1.0, -1.0, 0.0]], np.float32)
    outs, errs = bound.run(block, {"x": x, "w": np.ones((3, 1), np.float32)}, {"M": 2, "K": 3, "N": 1})
    z = as_float64(outs["z"])
    assert np.isnan(z).all()  # (rsqrt of -2^-30 and of -2)
    for name in ("r", "z"):
        assert errs[name][0, 0] == bound.ANY, name
        assert errs[name][1, 0] != bound.ANY, name
    assert mismatch("z", np.array([[-48.75], [np.nan]]), z, None, "f32", errs["z"]) is None
    assert mismatch("z", np.array([[np.nan], [1.0]]), z, None, "f32", errs["z"]) is not None


FP8_GEMM = """
dims M, K, N
block g(a: {a}[M, K], b: {b}[N, K]) -> (c: f32[M, N]) {{
  gemm a @ transpose(b) {{
    c = acc
  }}
}}
"""


def test_an_fp8_gemm_is_bounded_by_the_tensor_cores_fp8_accumulation() -> None:
    """A GEMM of two fp8 operands: its bound holds FP8_MMA_U times the sum of its products' magnitudes
    (Hopper's fp8 WGMMA keeps about 14 bits as it accumulates), which a bf16 GEMM's does not; the
    same values in both."""
    rng = np.random.default_rng(0)
    m, k, n = 8, 64, 16
    a = rng.standard_normal((m, k)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    b = rng.standard_normal((n, k)).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    mag = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)).T
    errs = {}
    for dt in ("e4m3", "bf16"):
        (blk,) = coda_lang.load(FP8_GEMM.format(a=dt, b=dt if dt == "bf16" else "e5m2")).blocks.values()
        _, e = bound.run(blk, {"a": a, "b": b}, {"M": m, "K": k, "N": n})
        errs[dt] = np.asarray(e["c"], np.float64)
    assert np.all(errs["e4m3"] >= bound.FP8_MMA_U * mag)
    assert np.all(errs["bf16"] < bound.FP8_MMA_U * mag / 10)
