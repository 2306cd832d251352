"""sin and cos in a GEMM's epilogue (backend_cute/plan/epi_ops.py: `sin_rr`, `cos_rr`) at any argument.

The epilogue reduces the argument into [-pi, pi] with 2 pi in three f32 parts (Cody-Waite) and takes
the hardware's sin.approx/cos.approx, which is fast and within about 6e-7 while the reduction is
exact; beyond FAST_TRIG (and at inf and NaN) it takes libdevice's sinf/cosf, whose reduction uses all
the bits of 2/pi (Payne-Hanek), as CUDA's sinf does.

- The reduction, emulated exactly (each fma rounded once), stays within 1.3e-7 of the true reduced
  argument up to FAST_TRIG, and is far off beyond 2^26 (why the slow path exists).
- The accuracy rule catches what the fast path alone computed at 1e30 (a model of the old epilogue:
  values of the wrong size and, times an infinite operand, infinities of the wrong sign) and passes a
  model of the new one (sin/cos's own bound is absolute, 2^-20 (1 + |y|), no longer growing with the
  argument).
- The PTX of a stage with sin and cos has, for each, the branch on FAST_TRIG and libdevice's
  Payne-Hanek reduction (toolchain; compiled on the CPU).
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
    """sin or cos as the epilogue computes it: the reduction then the function, for |a| <= limit; the
    function itself beyond (the new epilogue's libdevice path; the old one had no limit)."""
    out = []
    for v in a:
        with np.errstate(invalid="ignore"):
            fast = bool(np.abs(v) <= limit)
        out.append(fn(reduced(v)) if fast else fn(v))
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
    run libdevice's reduction by the bits of 2/pi (its first words: 0xA2F9836E, 0x4E441529, as PTX
    immediates)."""
    from coda_lang.backend_cute.build.compile import compile_spec
    from coda_lang.backend_cute.build.config import TileConfig
    from coda_lang.backend_cute.plan.planner import plan_stage

    blk = coda_lang.load(TRIG.replace("f32[M, K], w: f32[K, N]", "bf16[M, K], w: bf16[K, N]"))["trig"]
    ptx = compile_spec(plan_stage(blk, 1), TileConfig(128, 128), directory=tmp_path).ptx
    approx = len(re.findall(r"\b(?:sin|cos)\.approx\.f32", ptx))
    # (the compare of one angle serves its sin and its cos, and every element of its column: CSE)
    checks = len(re.findall(r"setp\.\w+\.f32\s+%p\d+, %r\d+, 0f4B000000;", ptx))
    assert approx > 0 and checks > 0, (approx, checks)
    words = [int(w) & 0xFFFFFFFF for w in re.findall(r"mov\.b32\s+%r\d+, (-?\d+);", ptx)]
    assert words.count(0xA2F9836E) >= 1 and words.count(0x4E441529) >= 1
    assert ptx.count("__local_depot") >= 1  # (the slow path's 7 words of the product)


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
