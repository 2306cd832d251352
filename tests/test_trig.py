"""sin and cos in a GEMM's epilogue (backend_cute/plan/epi_ops.py: `sin_rr`, `cos_rr`) at any argument.

The epilogue reduces the argument into [-pi, pi] with 2 pi in three f32 parts (Cody-Waite) and takes
the hardware's sin.approx/cos.approx, which is fast and within about 6e-7 while the reduction is
exact; beyond FAST_TRIG (and at inf and NaN) it reduces by the bits of 1/(2 pi) (Payne-Hanek: 64 of
them, from the argument's exponent on) in a short block of inline PTX.

- The reduction, emulated exactly (each fma rounded once), stays within 1.3e-7 of the true reduced
  argument up to FAST_TRIG, and is far off beyond 2^26 (why the slow path exists).
- The accuracy rule catches what the fast path alone computed at 1e30 (a model of the old epilogue:
  values of the wrong size and, times an infinite operand, infinities of the wrong sign) and passes a
  model of the new one (sin/cos's own bound is absolute, 2^-20 (1 + |y|), no longer growing with the
  argument).
- That slow reduction, modelled bit for bit (its words of 1/(2 pi) recomputed from Machin's formula),
  is within 2^-23 of the exact reduced argument at any finite f32 beyond FAST_TRIG.
- The PTX of a stage with sin and cos has, for each, the branch on FAST_TRIG and the slow reduction,
  without local memory and at most three times the PTX of the fast path alone (libdevice's sinf
  inlined at every sin and cos made it nine times: toolchain; compiled on the CPU).
- On a Hopper GPU (marked gpu): the kernel against the interpreter at 0, 1e5, 2^23 and just past it,
  3e7, 1e30, 3.4e38, inf, NaN, each times finite and infinite operands.
"""

from __future__ import annotations

import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import coda_lang
from coda_lang.interp import bound as bounds
from coda_lang.testing.compare import mismatch

TRIG = """dims M, K, N

block trig(x: f32[M, K], w: f32[K, N], a: f32[N]) -> (yc: f32[M, N], ys: f32[M, N]) {
  gemm x @ w {
    yc = acc * cos(a)
    ys = acc * sin(a)
  }
}
"""

# the epilogue's constants (epi_ops.py), here too so that this runs without CuTeDSL; checked equal below
FAST_TRIG = 2.0**23
INV_TWO_PI, TWO_PI = (
    np.float32(0.15915493667125702),
    (6.2831854820251465, -1.7484555314695172e-07, -7.105427357601002e-15),
)
# the first 192 bits of the fraction of 1/(2 pi), as the slow reduction holds them (checked below)
RECIP_TWO_PI_WORDS = (0x28BE60DB, 0x9391054A, 0x7F09D5F4, 0x7D4D3770, 0x36D8A566, 0x4F10E410)
ANGLES = [0.0, 0.5, -2.0, 1e5, -1e5, 2.0**23, 2.0**23 + 2, -(2.0**23 + 2), 3e7, 1e30, -1e30, 3.4e38, -3.4e38]
SPECIAL = [np.inf, -np.inf, np.nan]


def _fma(a: float, b: float, c: float) -> np.float32:
    """a * b + c rounded once to f32 (as the GPU's fma.rn.f32)."""
    if not all(np.isfinite([a, b, c])):
        return np.float32(np.float32(a) * np.float32(b) + np.float32(c))
    return np.float32(float(Fraction(a) * Fraction(b) + Fraction(c)))


def reduced(x: np.float32) -> np.float32:
    """The epilogue's Cody-Waite reduction of an f32 argument (fma by fma)."""
    with np.errstate(invalid="ignore", over="ignore"):
        k = float(np.round(np.float32(x * INV_TWO_PI)))
    r = float(x)
    for part in TWO_PI:
        r = float(_fma(k, -float(np.float32(part)), r))
    return np.float32(r)


def test_the_constants_are_the_epilogues() -> None:
    epi = pytest.importorskip("coda_lang.backend_cute.plan.epi_ops", exc_type=ImportError)
    assert epi.FAST_TRIG == FAST_TRIG and np.float32(epi._INV_TWO_PI) == INV_TWO_PI
    assert (epi._TWO_PI_1, epi._TWO_PI_2, epi._TWO_PI_3) == TWO_PI
    assert epi.RECIP_TWO_PI_WORDS == RECIP_TWO_PI_WORDS


def _pi_times(scale: int) -> int:
    """floor(pi * scale), by Machin's formula in integers (scale a power of two well above 2^64)."""

    def arctan_inv(x: int) -> int:
        total = term = (scale << 64) // x
        n, sign = 1, -1
        while term:
            term //= x * x
            n += 2
            total += sign * (term // n)
            sign = -sign
        return total

    return (4 * (4 * arctan_inv(5) - arctan_inv(239))) >> 64


def test_the_slow_reductions_words_are_the_bits_of_one_over_two_pi() -> None:
    pi = _pi_times(1 << 400)
    bits = (1 << (400 + 192)) // (2 * pi)  # floor(2^192 / (2 pi)): the fraction's first 192 bits
    assert tuple((bits >> (32 * (5 - i))) & 0xFFFFFFFF for i in range(6)) == RECIP_TWO_PI_WORDS


def big_reduced(x: np.float32) -> np.float32:
    """The epilogue's slow reduction (epi_ops._big_reduction_ptx) step by step, in integers: |x| = m 2^e,
    the 64 bits of 1/(2 pi) after bit e, their product with m mod 2^64 as a signed turn, times 2 pi /
    2^64 in f64, rounded to f32; the sign of x; NaN at inf and NaN."""
    b32 = int(np.array(x, np.float32).view(np.uint32))
    ex = (b32 >> 23) & 0xFF
    if ex == 255:
        return np.float32(np.nan)
    m = (b32 & 0x7FFFFF) | 0x800000
    e = ex - 150
    w, b = e >> 5, e & 31
    c0, c1, c2 = RECIP_TWO_PI_WORDS[w : w + 3]
    mask = (1 << 64) - 1
    wbits = (((c0 << 32) | c1) << b & mask) | ((c2 << 32) >> (64 - b) if b else 0)
    p = (m * wbits) & mask
    turn = p - (1 << 64) if p >> 63 else p
    r = np.float32(float(turn) * 3.4061215800865545e-19)  # (float(int) rounds to nearest, as cvt.rn)
    return -r if b32 >> 31 else r


def test_the_slow_reduction_is_exact_at_any_finite_argument() -> None:
    """Within 2^-23 (about an f32 ulp of pi) of x mod 2 pi, from just past FAST_TRIG to the largest
    f32, both signs, every exponent (and so every word offset and shift, 0 included)."""
    pi = _pi_times(1 << 400)  # pi * 2^400
    rng = np.random.default_rng(7)
    xs = [np.float32(2.0**23 + 2), np.float32(2.0**24), np.float32(3.4028235e38), np.float32(1e30)]
    for ex in range(151, 255):
        sig = rng.integers(0x800000, 0x1000000, 3)
        xs += [np.float32(np.ldexp(float(s), ex - 150)) for s in sig]
    worst = 0.0
    for v in xs:
        for x in (v, -v):
            # x mod 2 pi into [-pi, pi), exactly, in units of 2^-400
            n = int(x) << 400
            t = n % (2 * pi)
            t = t - 2 * pi if t >= pi else t
            worst = max(worst, abs(float(big_reduced(x)) - t / 2.0**400))
    assert worst < 2.0**-23, worst
    assert np.isnan(big_reduced(np.float32(np.inf))) and np.isnan(big_reduced(np.float32(np.nan)))


def test_the_fast_reduction_is_exact_up_to_its_limit_and_not_far_beyond() -> None:
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.prec = 300
    two_pi = 2 * mpmath.pi

    def worst(lo: float, hi: float) -> float:
        xs = np.random.default_rng(int(lo)).uniform(lo, hi, 60).astype(np.float32)
        out = 0.0
        for x in list(xs) + [np.float32(hi)]:
            r = reduced(x)
            k = mpmath.nint(mpmath.mpf(float(x)) / two_pi)
            true = mpmath.mpf(float(x)) - k * two_pi
            diff = abs(mpmath.mpf(float(r)) - true)
            out = max(out, float(min(diff, abs(diff - two_pi))))  # (k may differ by one: same angle)
        return out

    assert worst(1.0, 1e3) < 1.3e-7
    assert worst(1e6, FAST_TRIG) < 1.3e-7
    assert worst(2.0**26, 2.0**27) > 2.5e-7  # past the limit the three parts lose bits
    assert worst(1e29, 1e30) > 1.0  # (what the old epilogue took sin.approx of)


def _inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    n = len(ANGLES) + len(SPECIAL)
    a = np.array(ANGLES + SPECIAL + [0.25] * (16 - n % 16 if n % 16 else 0), np.float32)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    x[0, 0], x[1, 0] = np.inf, -np.inf  # rows whose acc is +inf and -inf (w's first row is positive)
    w = rng.standard_normal((4, a.size)).astype(np.float32)
    w[0] = np.abs(w[0]) + 0.5
    return {"x": x, "w": w, "a": a}


def _epilogue_model(a: np.ndarray, fn: Any, limit: float) -> np.ndarray:
    """sin or cos as the epilogue computes it: the fast reduction then the function, for |a| <= limit;
    the slow reduction beyond (the epilogue's; the old one had no limit)."""
    out = []
    for v in a:
        with np.errstate(invalid="ignore"):
            fast = bool(np.abs(v) <= limit)
            out.append(fn(reduced(v)) if fast else fn(big_reduced(v)))
    return np.array(out, np.float32)


@pytest.mark.parametrize("limit", [FAST_TRIG, np.inf], ids=["now", "before"])
def test_the_accuracy_rule_judges_trig_at_any_argument(limit: float) -> None:
    """What the fast path alone gave at 1e30 (a value of the wrong size; times +-inf, an infinity of the
    wrong sign or NaN) fails the rule the fuzzer applies; the epilogue with its slow path passes."""
    blk = coda_lang.load(TRIG)["trig"]
    ins = _inputs()
    ref, err = bounds.run(blk, ins)
    ref64 = blk.run(ins, precision="f64")
    acc = ins["x"] @ ins["w"]
    with np.errstate(invalid="ignore", over="ignore"):
        got = {
            "yc": acc * _epilogue_model(ins["a"], np.cos, limit)[None, :],
            "ys": acc * _epilogue_model(ins["a"], np.sin, limit)[None, :],
        }
    # rows 0 and 1: acc is +inf and -inf; the others finite (a wrong value there must fail too: sin
    # and cos's own bound no longer grows with the argument)
    for rows in (slice(0, 2), slice(2, None)):
        why = [
            mismatch(f"output `{k}`", got[k][rows], ref[k][rows], ref64[k][rows], "f32", err[k][rows])
            for k in ("yc", "ys")
        ]
        if limit == FAST_TRIG:
            assert why == [None, None]
        else:
            assert all(w is not None for w in why), why
    at = ANGLES.index(1e30)  # cos(1e30) = -0.61..., sin(1e30) = -0.79...: +inf times them is -inf
    assert np.isneginf(ref["yc"][0, at]) and np.isneginf(ref["ys"][0, at]) and np.isposinf(ref["yc"][1, at])


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_ptx_has_the_slow_path_for_sin_and_cos(tmp_path: Path) -> None:
    """The stage's sin and cos branch on |x| <= 2^23 (0f4B000000) to sin.approx/cos.approx, and else
    run the slow reduction by the words of 1/(2 pi) (PTX immediates of its selects): compact, without
    local memory or calls. (libdevice's sinf/cosf, inlined at each of the unrolled tile's sin and
    cos, made this stage's PTX 145 lines per sin or cos and used local memory; the Llama-3.2-1B QKV +
    RoPE stage took three times as long for it on the GPU.)"""
    from coda_lang.backend_cute.build.compile import compile_spec
    from coda_lang.backend_cute.build.config import TileConfig
    from coda_lang.backend_cute.plan.planner import plan_stage

    blk = coda_lang.load(TRIG.replace("f32[M, K], w: f32[K, N]", "bf16[M, K], w: bf16[K, N]"))["trig"]
    ptx = compile_spec(plan_stage(blk, 1), TileConfig(128, 128), directory=tmp_path).ptx
    approx = len(re.findall(r"\b(?:sin|cos)\.approx\.f32", ptx))
    # (the compare of one angle serves its sin and its cos, and every element of its column: CSE)
    checks = len(re.findall(r"setp\.\w+\.f32\s+%p\d+, %r\d+, 0f4B000000;", ptx))
    slow = len(re.findall(rf"selp\.b32\s+c0, {RECIP_TWO_PI_WORDS[1]}, {RECIP_TWO_PI_WORDS[0]}, p1;", ptx))
    assert approx > 0 and checks > 0 and slow > 0, (approx, checks, slow)
    assert ptx.count("__local_depot") == 0 and not re.search(r"\bcall(\.uni)?\b", ptx)
    assert len(ptx.splitlines()) < 60 * approx, (len(ptx.splitlines()), approx)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_trig_on_the_gpu_at_any_argument() -> None:
    torch = pytest.importorskip("torch")
    blk = coda_lang.load(TRIG.replace("f32[M, K], w: f32[K, N]", "bf16[M, K], w: bf16[K, N]"))["trig"]
    ins = _inputs()
    import ml_dtypes

    ins["x"], ins["w"] = ins["x"].astype(ml_dtypes.bfloat16), ins["w"].astype(ml_dtypes.bfloat16)
    ref, err = bounds.run(blk, ins)
    ref64 = blk.run(ins, precision="f64")
    cuda = {
        k: torch.from_numpy(v.astype(np.float32)).to("cuda").to(torch.bfloat16 if k != "a" else torch.float32)
        for k, v in ins.items()
    }
    got = blk.cuda(tune=False)(cuda)
    for k in ("yc", "ys"):
        why = mismatch(f"output `{k}`", got[k].float().cpu().numpy(), ref[k], ref64[k], "f32", err[k])
        assert why is None, why
