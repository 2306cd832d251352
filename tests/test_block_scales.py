"""GEMMs with block scales: `gemm a @ b, scale_a=sa, scale_b=sb { ... }` (docs/language.md, "Block scales").

Checked on the CPU: the options parse and print back; the interpreter's accumulator against float64
NumPy of the dequantized operands (each operand times its scales repeated over their groups), for
DeepSeek-V3's 1x128 and 128x128 groups, for a transposed A, for one operand scaled, and in `--precision
f64` to float64's own rounding; the scales really are per block (one scale per operand would miss);
the checker's E0411s and E0211s (tests/bad/ has their programs); the refusals that keep anything from
running such a stage unscaled: the backward (E0602), the kernels and their emulation (E0709), with
`coda grad`, `coda compile` and `coda fuzz` exiting as documented.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from support import coda

import coda_lang
from coda_lang.core.diagnostics import CodaError
from coda_lang.frontend.syntax.printer import print_program

DEEPSEEK = """
dims M, K, N
block scaled(a: e4m3[M, K], sa: f32[M, K/128], w: e4m3[N, K], sw: f32[N/128, K/128]) -> (y: f32[M, N]) {
  gemm a @ transpose(w), scale_a=sa, scale_b=sw {
    y = acc
  }
}
"""

# A stored [K, M] and written transposed; B stored [K, N]; groups of 64 along K, 32 along N
TRANSPOSED = """
dims M, K, N
block scaled(a: e4m3[K, M], sa: f32[K/64, M], w: e5m2[K, N], sw: f32[K/64, N/32]) -> (y: f32[M, N]) {
  gemm transpose(a) @ w, scale_a=sa, remat="save", scale_b=sw {
    y = acc
  }
}
"""

ONLY_B = """
dims M, K, N
block scaled(a: bf16[M, K], w: bf16[N, K], sw: f32[N, K/32]) -> (y: f32[M, N]) {
  gemm a @ transpose(w), scale_b=sw {
    y = acc
  }
}
"""


def _fp8(rng: np.random.Generator, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    return (rng.standard_normal(shape) * 4).astype(dtype)


def _repeat(s: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """A scale matrix repeated over its groups to its operand's stored shape."""
    return np.repeat(np.repeat(s.astype(np.float64), rows // s.shape[0], 0), cols // s.shape[1], 1)


def _inputs(src: str, m: int, k: int, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    blk = coda_lang.load(src)["scaled"]
    out: dict[str, np.ndarray] = {}
    sizes = {"M": m, "K": k, "N": n}
    for p in blk.ir.params:
        assert p.var.type is not None
        shape = tuple(int(d.evaluate(sizes)) for d in p.var.type.shape)
        dt = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "bf16": ml_dtypes.bfloat16}
        if p.var.type.dtype in dt:
            out[p.var.name] = _fp8(rng, shape, dt[p.var.type.dtype])
        else:  # scales over several octaves, so that a wrong block's scale shows
            out[p.var.name] = np.exp2(rng.integers(-6, 7, shape)).astype(np.float32) * rng.uniform(
                0.5, 1, shape
            ).astype(np.float32)
    return out


def _dequantized_product(
    ins: dict[str, np.ndarray], ta: bool, tb: bool, b_scaled_only: bool = False
) -> np.ndarray:
    """float64: (a times its scales) @ (w times its scales), each operand as stored, then transposed."""
    a = ins["a"].astype(np.float64)
    w = ins["w"].astype(np.float64)
    if not b_scaled_only:
        a = a * _repeat(ins["sa"], *a.shape)
    w = w * _repeat(ins["sw"], *w.shape)
    return (a.T if ta else a) @ (w.T if tb else w)


def _close(got: np.ndarray, want: np.ndarray, k: int) -> None:
    """Within the f32 accumulation of K products (plus the scale products), against the magnitudes."""
    mag = np.abs(want).max()
    assert np.abs(got.astype(np.float64) - want).max() <= 4 * (k + 2) * 2.0**-24 * mag * 8, (
        np.abs(got - want).max(),
        mag,
    )


@pytest.mark.parametrize("sizes", [(64, 384, 256), (3, 128, 128), (200, 640, 384)])
def test_deepseek_groups_against_the_dequantized_product(sizes: tuple[int, int, int]) -> None:
    m, k, n = sizes
    ins = _inputs(DEEPSEEK, m, k, n)
    got = coda_lang.load(DEEPSEEK)["scaled"].run(ins)["y"]
    _close(got, _dequantized_product(ins, False, True), k)


def test_a_transposed_operand_transposes_its_scales() -> None:
    ins = _inputs(TRANSPOSED, 96, 256, 64, seed=3)
    got = coda_lang.load(TRANSPOSED)["scaled"].run(ins)["y"]
    _close(got, _dequantized_product(ins, True, False), 256)


def test_one_operand_scaled() -> None:
    ins = _inputs(ONLY_B, 16, 96, 40, seed=4)
    got = coda_lang.load(ONLY_B)["scaled"].run(ins)["y"]
    _close(got, _dequantized_product(ins, False, True, b_scaled_only=True), 96)


def test_f64_precision_is_float64s_product() -> None:
    ins = _inputs(DEEPSEEK, 32, 256, 128, seed=5)
    got = coda_lang.load(DEEPSEEK)["scaled"].run(ins, precision="f64")["y"]
    want = _dequantized_product(ins, False, True)
    assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


def test_the_scales_are_per_block() -> None:
    """The same operands with each scale matrix replaced by its mean: far from the blockwise product
    (so the comparisons above can fail)."""
    ins = _inputs(DEEPSEEK, 64, 384, 256, seed=6)
    got = coda_lang.load(DEEPSEEK)["scaled"].run(ins)["y"]
    flat = {
        **ins,
        "sa": np.full_like(ins["sa"], ins["sa"].mean()),
        "sw": np.full_like(ins["sw"], ins["sw"].mean()),
    }
    want = _dequantized_product(ins, False, True)
    off = np.abs(_dequantized_product(flat, False, True) - want).max()
    assert off > 0.1 * np.abs(want).max()
    _close(got, want, 384)


@pytest.mark.parametrize("src", [DEEPSEEK, TRANSPOSED, ONLY_B])
def test_prints_back(src: str) -> None:
    prog = coda_lang.load(src)
    again = coda_lang.load(print_program(prog.ir))
    assert again.ir == prog.ir
    st = again["scaled"].ir.stages[0]
    assert st.scaled and (st.scale_a is not None) == (src != ONLY_B)


def test_the_backward_is_refused_at_the_stage() -> None:
    blk = coda_lang.load(DEEPSEEK)["scaled"]
    with pytest.raises(CodaError) as e:
        blk.grad(["a", "w"])
    (d,) = e.value.diagnostics
    assert d.code == "E0602" and "block scales" in d.message and d.span is not None and d.span.line == 4


def test_the_kernels_and_their_emulation_refuse_it() -> None:
    from coda_lang.backend_cute.plan.planner import plan_stage

    blk = coda_lang.load(DEEPSEEK)["scaled"]
    for emulated in (False, True):
        with pytest.raises(CodaError) as e:
            plan_stage(blk, 1, emulated=emulated)
        (d,) = e.value.diagnostics
        assert d.code == "E0709" and d.span is not None and (d.span.line, d.span.col) == (4, 34)


def test_the_commands(tmp_path: Any) -> None:
    f = tmp_path / "scaled.coda"
    f.write_text(DEEPSEEK)
    r = coda("check", str(f))
    assert r.returncode == 0, r.stderr
    r = coda("grad", str(f))
    assert r.returncode == 1 and "E0602" in r.stderr and "Traceback" not in r.stderr and not r.stdout
    r = coda("compile", str(f), "--emit", "source", "-o", str(tmp_path / "out"))
    assert r.returncode == 1 and "E0709" in r.stderr and "Traceback" not in r.stderr
    r = coda("fuzz", str(f), "--target", "interp", "--examples", "4", "--no-backward")
    assert r.returncode == 0, r.stderr
    r = coda("fuzz", str(f), "--target", "emulate", "--examples", "2", "--no-backward")
    assert r.returncode == 1 and "E0709" in r.stdout + r.stderr and "Traceback" not in r.stderr
