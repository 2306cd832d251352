"""fp8 storage dtypes (e4m3, e5m2): rounding, straight-through gradients, and the scaling recipes' locality.

- The interpreter's fp8 store (a block that writes `q: e4m3 = x * s`) against ml_dtypes bit for bit,
  after saturating (clamping to +-max, infinities too) as the recipes do, and against an independent
  brute-force nearest-even search over the dtype's 256 codes, on every fp8 value, every midpoint and
  its f32 neighbours, subnormals, the overflow boundary, zeros of both signs, infinities and NaN; in
  both precisions (f64 rounds the float64 value directly); and torch's cast of the clamped value.
- Straight-through gradients: the derived backward in float64 against torch.autograd of the same
  fake-quant math (`v + (q(v) - v).detach()`), for an in-stage 1x8-group fake quant (`cast(acc * s,
  e4m3) / s`) and for a stored e4m3 tile with a delayed per-tensor scale read by an fp8 GEMM.
- The checker: rowwise (and columnwise) current scaling is E0508 with the local recipes as fix-its,
  at the reduction's line and column; the recipes themselves check.
- The rounding bound of an fp8 store (interp/bound.py): at most one fp8 ulp, 0 where saturated.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch
from runtime_check import to_torch
from support import coda

import coda_lang
from coda_lang.core.diagnostics import CodaError
from coda_lang.core.numerics import round_fp8
from coda_lang.interp import bound

FP8 = {
    "e4m3": (ml_dtypes.float8_e4m3fn, 448.0, torch.float8_e4m3fn),
    "e5m2": (ml_dtypes.float8_e5m2, 57344.0, torch.float8_e5m2),
}

STORE = """
dims M, N
block store(x: f32[M, N], s: f32) -> (q: {t}[M, N]) {{
  elementwise [M, N] {{
    q: {t} = x * s
  }}
}}
"""


def _codes(dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The finite non-negative values of the fp8 dtype and their codes (0x00 up), by brute force."""
    ml = FP8[dtype][0]
    codes = np.arange(128, dtype=np.uint8)
    vals = codes.view(ml).astype(np.float64)
    ok = np.isfinite(vals)
    return vals[ok], codes[ok]


def _nearest_even(x: np.ndarray, dtype: str) -> np.ndarray:
    """The fp8 code of each float: saturated to +-max, the nearest value, ties to the even code, the
    sign kept (-0 too); NaN gives 0xFF. Independent of ml_dtypes' conversion (it reads only the table
    of values each code stands for)."""
    vals, codes = _codes(dtype)
    mx = FP8[dtype][1]
    out = np.empty(x.shape, np.uint8)
    for i, v in enumerate(x.reshape(-1).astype(np.float64)):
        if np.isnan(v):
            out.reshape(-1)[i] = 0xFF
            continue
        a = min(abs(v), mx)
        d = np.abs(vals - a)
        best = np.flatnonzero(d == d.min())
        code = codes[best[0]] if len(best) == 1 else next(c for c in codes[best] if c % 2 == 0)
        out.reshape(-1)[i] = code | (0x80 if np.signbit(v) else 0)
    return out


def _sweep(dtype: str, ftype: type = np.float32) -> np.ndarray:
    """Every finite fp8 value, the midpoints between neighbours and the floats next to them, beyond
    the largest value (to the overflow boundary and past it), subnormals, signed zeros, infinities,
    NaN; both signs."""
    vals, _ = _codes(dtype)
    mx = FP8[dtype][1]
    mids = (vals[1:] + vals[:-1]) / 2
    top = vals[-1] + (vals[-1] - vals[-2]) / 2  # where a non-saturating cast would overflow
    pts = np.concatenate([vals, mids, [top, mx * 1.01, mx * 2, 1e30, vals[1] / 2, vals[1] / 3]]).astype(ftype)
    up = np.nextafter(pts, ftype(np.inf))
    down = np.nextafter(pts, ftype(-np.inf))
    rng = np.random.default_rng(0)
    rand = (rng.standard_normal(2000) * 10.0 ** rng.uniform(-6, 5, 2000)).astype(ftype)
    x = np.concatenate([pts, up, down, rand, np.array([np.inf, np.nan, 0.0], ftype)])
    return np.concatenate([x, -x])


def _store(dtype: str, x: np.ndarray, s: float, precision: str) -> np.ndarray:
    block = coda_lang.load(STORE.format(t=dtype))["store"]
    return block.run({"x": x.reshape(1, -1), "s": np.float32(s)}, precision=precision)["q"].reshape(-1)


def _bits(q: np.ndarray, dtype: str) -> np.ndarray:
    """The fp8 codes of stored values (an fp8 array, or float64 values in the f64 precision); NaN 0xFF."""
    q = np.asarray(q)
    if q.dtype != FP8[dtype][0]:
        q = q.astype(FP8[dtype][0])  # exact: the values are fp8 values already (checked below)
    b = q.view(np.uint8).copy()
    b[np.isnan(q.astype(np.float32))] = 0xFF
    return b


@pytest.mark.parametrize("dtype", ["e4m3", "e5m2"])
def test_store_rounds_like_ml_dtypes_saturating(dtype: str) -> None:
    ml, mx, _ = FP8[dtype]
    x = _sweep(dtype)
    got = _store(dtype, x, 1.0, "exact")
    assert got.dtype == ml  # the output in its declared dtype
    want = np.clip(x, -mx, mx).astype(ml)  # ml_dtypes' conversion of the saturated value
    nan = np.isnan(x)
    assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
    assert np.array_equal(got.view(np.uint8)[~nan], want.view(np.uint8)[~nan])
    assert np.array_equal(_bits(got, dtype), _nearest_even(x, dtype))
    # saturation: past the largest value (an infinity too) the store is +-max, never inf or NaN
    assert float(got[x == np.inf][0]) == mx and float(got[x == -np.inf][0]) == -mx
    # subnormals are kept, not flushed: the smallest one and half of it (a tie: rounds to even, 0)
    tiny = float(ml_dtypes.finfo(ml).smallest_subnormal)
    sub = _store(dtype, np.array([tiny, 1.5 * tiny, tiny / 2, -tiny / 2], np.float32), 1.0, "exact")
    assert sub.astype(np.float64).tolist() == [tiny, 2 * tiny, 0.0, 0.0]
    assert np.signbit(sub.astype(np.float32)[3])  # -0 keeps its sign


@pytest.mark.parametrize("dtype", ["e4m3", "e5m2"])
def test_store_applies_the_scale_as_written(dtype: str) -> None:
    """`q = x * s`: the product rounded once to f32 (exact precision), then to fp8; in f64 the float64
    product, rounded directly (no f32 step); torch's cast of the clamped f32 product agrees."""
    ml, mx, tdt = FP8[dtype]
    x = _sweep(dtype)
    s = 3.7
    got = _store(dtype, x, s, "exact")
    prod = (x * np.float32(s)).astype(np.float32)
    assert np.array_equal(_bits(got, dtype), _nearest_even(prod, dtype))
    t = torch.from_numpy(prod).clamp(-mx, mx).to(tdt)
    tb = t.view(torch.uint8).numpy().copy()
    tb[np.isnan(prod)] = 0xFF
    assert np.array_equal(_bits(got, dtype), tb)
    g64 = _store(dtype, x, s, "f64")
    assert g64.dtype == np.float64
    p64 = x.astype(np.float64) * np.float64(np.float32(s))
    assert np.array_equal(_bits(g64, dtype), _nearest_even(p64, dtype))
    assert np.array_equal(round_fp8(p64, dtype), g64, equal_nan=True)


def test_the_fp8_tables_agree() -> None:
    """The ranges the checker, the interpreter and the torch stand-ins saturate to are the formats'."""
    from coda_lang.core import numerics
    from coda_lang.ir import types

    assert numerics.FP8_DTYPES == types.FP8_DTYPES
    assert set(numerics.FLOATS) == set(types.FLOAT_DTYPES + types.FP8_DTYPES)
    for d in types.FP8_DTYPES:
        assert types.FP8_MAX[d] == float(ml_dtypes.finfo(numerics.STORAGE[d]).max) == FP8[d][1]
        assert float(torch.finfo(FP8[d][2]).max) == FP8[d][1]


def test_fp8_input_is_rounded_and_saturated() -> None:
    """A parameter declared e4m3 reads its values rounded (saturating) as any stored dtype does."""
    src = "dims M, N\nblock f(x: e4m3[M, N]) -> (y: f32[M, N]) {\n elementwise [M, N] { y = x * 1.0 }\n}\n"
    y = coda_lang.load(src)["f"].run({"x": np.array([[1000.0, 0.3, -1e9, 17.0]], np.float32)})["y"]
    assert y.tolist() == [[448.0, 0.3125, -448.0, 16.0]]


# ---------------------------------------------------------------------------- straight-through gradients

GROUP_FQ = """
dims M, K, N, P
block fq(x: f32[M, K], w: f32[K, N], w2: f32[N, P]) -> (out: f32[M, P]) {{
  gemm x @ w {{
    amax = max(abs(acc), over=N, group=8)
    s = {mx} / amax
    h: f32 = cast(acc * s, {t}) / s
  }}
  gemm h @ w2 {{
    out = acc
  }}
}}
"""

DELAYED = """
dims M, K, N, P
block delayed(x: f32[M, K], w: f32[K, N], s: f32, w2: f32[N, P]) -> (out: f32[M, P], amax: f32) {{
  gemm x @ w {{
    hq: {t} = acc * s
    row_amax = max(abs(acc), over=N)
  }}
  amax = max(row_amax, over=M)
  inv = 1.0 / s
  gemm hq @ w2 {{
    out = acc * inv
  }}
}}
"""

SIZES = {"M": 6, "K": 5, "N": 16, "P": 3}


def _fake_quant(v: torch.Tensor, dtype: str) -> torch.Tensor:
    """Straight-through fake quantization in torch: forward clamp + cast to fp8 and back, backward the
    identity."""
    _, mx, tdt = FP8[dtype]
    q = v.clamp(-mx, mx).to(tdt).to(v.dtype)
    return v + (q - v).detach()


def _inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    m, k, n, p = (SIZES[d] for d in "MKNP")
    return {
        "x": rng.standard_normal((m, k)),
        "w": rng.standard_normal((k, n)),
        "w2": rng.standard_normal((n, p)),
    }


def _vjp64(block: coda_lang.Block, ins: dict[str, np.ndarray], cots: dict[str, np.ndarray]) -> dict:
    return block.vjp(ins, cots, precision="f64")


@pytest.mark.parametrize("dtype", ["e4m3", "e5m2"])
def test_group_fake_quant_gradient_is_straight_through(dtype: str) -> None:
    mx = FP8[dtype][1]
    block = coda_lang.load(GROUP_FQ.format(t=dtype, mx=mx))["fq"]
    ins = _inputs(1)
    cot = np.random.default_rng(2).standard_normal((SIZES["M"], SIZES["P"]))
    got = _vjp64(block, ins, {"out": cot})
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in ins.items()}
    acc = t["x"] @ t["w"]
    m, n = acc.shape
    amax = acc.abs().reshape(m, n // 8, 8).amax(-1).repeat_interleave(8, dim=1)
    s = mx / amax
    h = _fake_quant(acc * s, dtype) / s
    out = h @ t["w2"]
    # the forward quantized, and the same on both sides
    assert not torch.allclose(h, acc)
    fwd = block.run(ins, precision="f64")["out"]
    np.testing.assert_allclose(fwd, out.detach().numpy(), rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out, [t["x"], t["w"], t["w2"]], torch.tensor(cot))
    for name, g in zip(("x", "w", "w2"), grads, strict=True):
        np.testing.assert_allclose(got[name], g.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("dtype", ["e4m3", "e5m2"])
def test_delayed_scale_gradient_is_straight_through(dtype: str) -> None:
    """A stored fp8 tile (some elements saturated: the quantizer's gradient is the identity there too)
    read by a GEMM of an fp8 and an f32 operand, the per-tensor scale a parameter, differentiated."""
    block = coda_lang.load(DELAYED.format(t=dtype))["delayed"]
    ins = _inputs(3)
    mx = FP8[dtype][1]
    acc = ins["x"] @ ins["w"]
    s = 1.5 * mx / np.abs(acc).max()  # last step's scale: a few of this step's values saturate
    ins["s"] = np.float64(s)
    rng = np.random.default_rng(4)
    cots = {"out": rng.standard_normal((SIZES["M"], SIZES["P"])), "amax": np.float64(0.7)}
    got = _vjp64(block, ins, cots)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in ins.items()}
    acc_t = t["x"] @ t["w"]
    hq = _fake_quant(acc_t * t["s"], dtype)
    assert (hq.detach().abs() == mx).any()  # saturated somewhere
    out = (hq @ t["w2"]) * (1.0 / t["s"])
    amax = acc_t.abs().max()
    ref = block.run(ins, precision="f64")
    np.testing.assert_allclose(ref["out"], out.detach().numpy(), rtol=1e-12, atol=1e-12)
    names = ("x", "w", "s", "w2")
    grads = torch.autograd.grad(
        [out, amax],
        [t[n] for n in names],
        [torch.tensor(cots["out"]), torch.tensor(0.7, dtype=torch.float64)],
    )
    for name, g in zip(names, grads, strict=True):
        np.testing.assert_allclose(got[name], g.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("remat", ["save", "auto"])
def test_a_vjp_reads_the_unquantized_result(remat: str) -> None:
    """exp's VJP reads its result: straight through an fp8 store that is exp(v), not the stored e4m3
    copy (an ulp, 6%, away), under every policy (saved tiles included)."""
    src = (
        "dims M, K, N\nblock f(x: f32[M, K], w: f32[K, N]) -> (q: e4m3[M, N]) {\n"
        " gemm x @ w { q: e4m3 = exp(acc) }\n}\n"
    )
    block = coda_lang.load(src)["f"]
    ins = {k: v / 2 for k, v in _inputs(8).items() if k in ("x", "w")}
    cot = round_fp8(np.random.default_rng(9).standard_normal((SIZES["M"], SIZES["N"])), "e4m3")
    got = block.vjp(ins, {"q": cot}, precision="f64", remat=remat)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in ins.items()}
    q = _fake_quant((t["x"] @ t["w"]).exp(), "e4m3")
    grads = torch.autograd.grad(q, [t["x"], t["w"]], torch.tensor(cot))
    for name, g in zip(("x", "w"), grads, strict=True):
        np.testing.assert_allclose(got[name], g.numpy(), rtol=1e-10, atol=1e-12, err_msg=name)


def test_cotangents_of_fp8_values_are_bf16() -> None:
    """The derived backward keeps gradients of fp8 values in bf16 (quantizing a gradient needs a scale
    the program writes): the output's cotangent, the fp8 GEMM's dacc, an fp8 parameter's gradient."""
    src = DELAYED.format(t="e4m3").replace("x: f32[M, K], w: f32[K, N]", "x: e4m3[M, K], w: e4m3[K, N]")
    d = coda_lang.load(src)["delayed"].derivation()
    text = str(d.backward)
    assert "dx: bf16[M, K]" in text and "dw: bf16[K, N]" in text
    assert ": e4m3" not in text.split("->")[1].split("{")[0]  # no fp8 gradient output
    stored = [line for line in text.splitlines() if "dacc" in line and ": " in line and "=" in line]
    assert stored and all("e4m3" not in line for line in stored), stored


# ---------------------------------------------------------------------------- locality of the recipes

ROWWISE = """
dims M, K, N
block quant(x: bf16[M, K], w: bf16[K, N]) -> (q: {t}[M, N]) {{
  gemm x @ w {{
    row_amax = {stat}(abs(acc), over={over})
    q = acc * ({mx} / row_amax)
  }}
}}
"""


def _diags(src: str) -> list:
    with pytest.raises(CodaError) as ei:
        coda_lang.load(src)
    return ei.value.diagnostics


def test_rowwise_current_scale_is_refused_with_the_local_recipes(tmp_path: Path) -> None:
    path = tmp_path / "quant.coda"
    path.write_text(ROWWISE.format(t="e4m3", stat="max", over="N", mx=448.0))
    (d,) = _diags(str(path))
    assert d.code == "E0508"
    assert (d.span.file, d.span.line, d.span.col) == (str(path), 6, 24)
    assert "rowwise current scaling is not block-local" in d.message
    assert "`row_amax`" in d.message and "`q`" in d.message
    group, delayed = d.help
    assert "1x128" in group and "max(abs(acc), over=N, group=128)" in group and "f32[M, N/128]" in group
    assert "q: e4m3 = acc * (448.0 / amax)" in group
    assert "delayed per-tensor scale" in delayed and "scale: f32" in delayed
    assert "max(abs(acc), over=N)" in delayed


def test_rowwise_refusal_in_coda_check(tmp_path: Path) -> None:
    """`coda check` shows it with its place and fix-its; `coda explain E0508` has the entry."""
    path = tmp_path / "quant.coda"
    path.write_text(ROWWISE.format(t="e4m3", stat="max", over="N", mx=448.0))
    r = coda("check", str(path))
    assert r.returncode == 1
    assert f"{path}:6:24" in r.stderr and "error[E0508]" in r.stderr
    assert "help: scale per group of 128 columns instead (the 1x128 recipe" in r.stderr
    assert "help: or use a delayed per-tensor scale" in r.stderr
    r = coda("explain", "E0508")
    assert r.returncode == 0 and "1x128" in r.stdout and "delayed per-tensor scale" in r.stdout


def test_current_scale_refusals_by_axis_and_dtype() -> None:
    # columnwise (a statistic over the rows): the 128x1 recipe
    (d,) = _diags(ROWWISE.format(t="e5m2", stat="max", over="M", mx=57344.0))
    assert d.code == "E0508" and "columnwise" in d.message
    assert "128x1" in d.help[0] and "over=M, group=128" in d.help[0] and "q: e5m2" in d.help[0]
    # a sum that scales a tile stored as fp8 is a current scale too
    (d,) = _diags(ROWWISE.format(t="e4m3", stat="sum", over="N", mx=448.0))
    assert d.code == "E0508"
    # ... but not a bf16 one: that is RMSNorm's E0503, with its own fix-it
    (d,) = _diags(ROWWISE.format(t="bf16", stat="sum", over="N", mx=448.0))
    assert d.code == "E0503"


def test_local_recipes_check() -> None:
    """The fix-its' recipes are block-local: a 1x128 group scale (a tiling constraint of 128 columns)
    and a delayed per-tensor scale (the amax a partial, combined after the stage)."""
    group = ROWWISE.format(t="e4m3", stat="max", over="N, group=128", mx=448.0)
    plan = coda_lang.load(group)["quant"].explain()
    assert "tile_N % 128 == 0" in plan and "store   q: e4m3[M, N]" in plan
    col = ROWWISE.format(t="e5m2", stat="max", over="M, group=128", mx=57344.0)  # the columnwise fix-it's
    assert "tile_M % 128 == 0" in coda_lang.load(col)["quant"].explain()
    delayed = coda_lang.load(DELAYED.format(t="e4m3"))["delayed"].explain()
    assert "store   hq: e4m3[M, N]" in delayed and "combined by max" in delayed


# ---------------------------------------------------------------------------- rounding bound


def test_bound_of_an_fp8_store() -> None:
    """A value within its bound of a rounding boundary may store as either neighbour (one e4m3 ulp
    apart); one far from a boundary, or saturated, stores the same number anywhere: bound 0."""
    src = "dims M, K, N\nblock b(x: f32[M, K], w: f32[K, N]) -> (q: e4m3[M, N]) {\n gemm x @ w { q: e4m3 = acc }\n}\n"
    block = coda_lang.load(src)["b"]
    # acc = x @ w with K = 64 terms: a GEMM bound of about 2 K u |x| |w|
    x = np.full((1, 64), 1.0, np.float32)
    w = np.zeros((64, 3), np.float32)
    w[:, 0] = 17.0 / 64  # acc 17: the midpoint of e4m3's 16 and 18 (ties to 16)
    w[:, 1] = 17.5 / 64  # 17.5: a quarter ulp from the midpoint, far beyond the GEMM's bound
    w[:, 2] = 1000.0 / 64  # saturated
    outs, errs = bound.run(block, {"x": x, "w": w})
    q, e = outs["q"].astype(np.float64)[0], np.asarray(errs["q"])[0]
    assert q.tolist() == [16.0, 18.0, 448.0]
    assert e[0] == 2.0 and e[1] == 0.0 and e[2] == 0.0


# ---------------------------------------------------------------------------- the examples, emulated, refused

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example(name: str) -> coda_lang.Block:
    return coda_lang.load(EXAMPLES / f"{name}.coda")[name]


def test_blockwise_example_against_torch() -> None:
    """examples/fp8_blockwise.coda against the unfused torch it replaces (its comment's code): the e4m3
    tile bit for bit (the f32 GEMM of bf16 values is exact here: K terms of 8-bit mantissas), the
    per-group amax equal."""
    g = torch.Generator().manual_seed(5)
    m, k, n = 24, 16, 256
    x = (torch.randn(m, k, generator=g) * 4).round().bfloat16()  # small integers: an exact GEMM
    w = (torch.randn(k, n, generator=g) * 4).round().bfloat16()
    y = x.double() @ w.double()
    amax = y.abs().unflatten(1, (-1, 128)).amax(-1)
    s = 448.0 / amax.clamp(min=1e-12).repeat_interleave(128, 1)
    yq = (y.float() * s.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
    out = _example("fp8_blockwise").run({"x": x.float().numpy(), "w": w.float().numpy()})
    assert np.array_equal(out["amax"], amax.float().numpy())
    assert np.array_equal(out["yq"].view(np.uint8), yq.view(torch.uint8).numpy())
    assert float(np.abs(out["yq"].astype(np.float32)).max()) == 448.0  # each group's amax maps to 448


def test_delayed_example_gradients_against_torch() -> None:
    """examples/fp8_delayed.coda: float64 straight-through gradients (of x, w, the scale and the e4m3
    weight w2) against torch autograd of the fake-quant math; the amax is detached there, so a
    cotangent given for it changes nothing (torch: the amax made from h.detach())."""
    block = _example("fp8_delayed")
    rng = np.random.default_rng(6)
    m, k, n, p = 8, 16, 32, 16
    ins = {
        "x": rng.standard_normal((m, k)),
        "w": rng.standard_normal((k, n)) / 4,
        "scale": np.float64(200.0),  # a few values saturate
        "w2": round_fp8(rng.standard_normal((p, n)) / 6, "e4m3"),  # [P, N], read transposed
    }
    cots = {"out": rng.standard_normal((m, p)), "amax": np.float64(-0.4)}
    got = block.vjp(ins, cots, precision="f64")
    t = {key: torch.tensor(v, dtype=torch.float64, requires_grad=True) for key, v in ins.items()}
    h = t["x"] @ t["w"]
    hq = _fake_quant(h * t["scale"], "e4m3")
    assert (hq.detach().abs() == 448).any()
    out = (hq @ t["w2"].T) * (1.0 / t["scale"])
    assert float(block.run(ins, precision="f64")["amax"]) == float(h.detach().abs().max())
    grads = torch.autograd.grad([out], [t[key] for key in ins], [torch.tensor(cots["out"])])
    for key, gr in zip(ins, grads, strict=True):
        np.testing.assert_allclose(got[key], gr.numpy(), rtol=1e-10, atol=1e-12, err_msg=key)
    # the amax's cotangent reaches nothing: the same gradients without it
    alone = block.vjp(ins, {**cots, "amax": np.float64(0.0)}, precision="f64")
    for key in ins:
        assert np.array_equal(alone[key], got[key]), key


def test_emulated_runtime_runs_fp8() -> None:
    """coda_lang.torch on the CPU (the CUDA runtime's torch stand-ins): the fp8 forward equals the
    interpreter's bit for bit, the saturated store included, and its autograd gives the interpreter's
    gradients within the accuracy rule (the e4m3 weight's gradient comes back in e4m3, as autograd
    needs a leaf's gradient in its dtype)."""
    import coda_lang.torch as ct
    from coda_lang.testing.compare import mismatch

    block = _example("fp8_delayed")
    g = torch.Generator().manual_seed(7)
    ins = {
        "x": torch.randn(32, 32, generator=g).bfloat16(),
        "w": (torch.randn(32, 32, generator=g) / 6).bfloat16(),
        "scale": torch.tensor(300.0),
        "w2": (torch.randn(16, 32, generator=g) / 6).to(torch.float8_e4m3fn),
    }
    leaves = {k: v.clone().requires_grad_(True) for k, v in ins.items()}
    outs = ct.function(block)(**leaves)
    ref = block.run({k: v for k, v in ins.items()})
    assert np.array_equal(outs["out"].detach().float().numpy(), ref["out"].astype(np.float32))
    assert float(outs["amax"].detach()) == float(ref["amax"])
    dout = torch.randn(32, 16, generator=g).bfloat16()
    assert not outs["amax"].requires_grad  # detached in the program: no gradient flows from it
    torch.autograd.backward([outs["out"]], [dout])
    want = block.vjp(ins, {"out": dout, "amax": np.float32(0.0)})
    for k, leaf in leaves.items():
        assert leaf.grad is not None and leaf.grad.dtype == ins[k].dtype, k
        dtype = "e4m3" if k == "w2" else "bf16" if k != "scale" else "f32"
        r = round_fp8(want[k].astype(np.float32), "e4m3") if k == "w2" else want[k]
        assert mismatch(k, leaf.grad, r, dtype=dtype) is None, mismatch(k, leaf.grad, r, dtype=dtype)


SWIGLU8 = """
dims M, D, F
block g(x: e4m3[M, D], w: e4m3[2*F, D], r: f32[M], s: f32) -> (aq: {t}[M, F]) {{
  gemm x @ transpose(w) {{
    z = acc * r
    gt, up = pairs(z)
    aq: {t} = silu(gt) * up * s
  }}
}}
"""


@pytest.mark.parametrize("t", ["e4m3", "e5m2"])
def test_emulated_gated_fp8_store(t: str) -> None:
    """A paired stage's half-width fp8 store (SwiGLU's gate/up GEMM of fp8 operands, tests/
    test_fp8_kernels.py's SWIGLU8) on the emulated runtime (CPU): the interpreter's codes bit for bit,
    saturated values included, at ragged sizes and scales from 1/100 to 10^4."""
    import coda_lang.torch as ct

    block = coda_lang.load(SWIGLU8.format(t=t))["g"]
    want_dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[t]
    top = {"e4m3": 448.0, "e5m2": 57344.0}[t]
    saturated = 0
    for seed, (f, s) in enumerate([(48, 0.01), (80, 1.0), (16, 37.0), (208, 1e4)]):
        g = torch.Generator().manual_seed(seed)
        ins = {
            "x": (torch.randn(77, 48, generator=g) * 2).to(torch.float8_e4m3fn),
            "w": torch.randn(2 * f, 48, generator=g).to(torch.float8_e4m3fn),
            "r": torch.rand(77, generator=g) * 4,
            "s": torch.tensor(s),
        }
        with torch.no_grad():
            got = ct.function(block)(**ins)["aq"]
        ref = np.asarray(block.run(ins)["aq"], np.float32)
        assert got.dtype == want_dtype and tuple(got.shape) == (77, f)
        assert np.array_equal(got.float().numpy(), ref), (t, seed)
        saturated += int((np.abs(ref) == top).sum())
    assert saturated > 0


def dyadic(t: torch.Tensor, per: int) -> torch.Tensor:
    """`t` rounded to multiples of 1 / `per`: few bits, so that the sums of products of such values are
    exact in f32 in any order."""
    return torch.round(t * per) / per


def test_emulated_store_saturates_e5m2() -> None:
    """torch's cast to e5m2 overflows to inf: the emulated store clamps first, as the interpreter's."""
    import coda_lang.torch as ct

    block = coda_lang.load(DELAYED.format(t="e5m2"))["delayed"]
    g = torch.Generator().manual_seed(10)
    # (on a grid of few bits, so that every sum of products is exact in f32 and no BLAS's order of
    # summation changes a bit: a GEMM's rounding is not what this test is about)
    ins = {
        "x": dyadic(torch.randn(16, 16, generator=g), 8),
        "w": dyadic(torch.randn(16, 16, generator=g), 8),
        "s": torch.tensor(3e4),  # |acc * s| up to ~1e5: past e5m2's 57344
        "w2": dyadic(torch.randn(16, 16, generator=g) / 4, 16),
    }
    with torch.no_grad():
        outs = ct.function(block)(**ins)
    ref = block.run({k: v.numpy() for k, v in ins.items()})
    assert np.isfinite(ref["out"]).all() and torch.isfinite(outs["out"]).all()
    assert np.array_equal(outs["out"].numpy(), ref["out"])


def test_emulated_fp8_vector_between_stages() -> None:
    """A partial stored as e4m3 and computed on between stages, forward and backward (which reads it
    saved, an e4m3 tensor): the emulated runtime computes it in f32 (torch has no comparisons of
    float8 tensors), as the interpreter does."""
    import coda_lang.torch as ct

    src = (
        "dims M, K, N\nblock f(x: f32[M, K], w: f32[K, N]) -> (r: f32[M]) {\n"
        " gemm x @ w { s: e4m3 = sum(acc, over=N) }\n r = where(s >= 0.0, s, 0.0)\n}\n"
    )
    block = coda_lang.load(src)["f"]
    g = torch.Generator().manual_seed(11)
    ins = {"x": torch.randn(16, 16, generator=g), "w": torch.randn(16, 16, generator=g)}
    leaves = {k: v.clone().requires_grad_(True) for k, v in ins.items()}
    got = ct.function(block)(**leaves)["r"]
    plain = {k: v.numpy() for k, v in ins.items()}
    assert np.array_equal(got.detach().numpy(), block.run(plain)["r"])
    dr = torch.randn(16, generator=g)
    got.backward(dr)
    want = block.vjp(plain, {"r": dr.numpy()})
    for k, leaf in leaves.items():
        assert leaf.grad is not None and np.allclose(leaf.grad.numpy(), want[k], rtol=1e-5, atol=1e-5), k


def test_kernel_backend_plans_the_fp8_example() -> None:
    """The CuTeDSL planner (`coda compile`, `Block.cuda()`) compiles both of fp8_delayed's stages: the
    quantizing epilogue and the e4m3 x e4m3 GEMM of K-major operands (tests/test_fp8_kernels.py has
    what it still refuses: an N-major fp8 operand, fp8 beside bf16)."""
    from coda_lang.backend_cute.plan.planner import plan_stage

    block = _example("fp8_delayed")
    assert plan_stage(block, 1).d is not None
    assert plan_stage(_example("fp8_blockwise"), 1).d is not None
    g = plan_stage(block, 2).gemm
    assert (g.a_dtype, g.b_dtype, g.ta, g.tb) == ("e4m3", "e4m3", False, True)
    assert plan_stage(block, 2, emulated=True) is not None


# ---------------------------------------------------------------------------- 128x1 groups (runs of rows)

COLQ = """
dims M, K, N
block colq(x: f32[M, K], w: f32[K, N]) -> (yq: e4m3[M, N], amax: f32[M/128, N]) {
  gemm x @ w {
    amax = max(abs(acc), over=M, group=128)
    yq: e4m3 = acc * (448.0 / max(amax, 1e-12))
  }
}
"""


def test_row_groups_quantize_a_column_copy() -> None:
    """A 128x1 group (one amax per column and run of 128 rows, the scales of the copy a weight gradient
    reads): against NumPy, whole and in tiles (tile_M a multiple of 128), with its tiling constraint."""
    block = coda_lang.load(COLQ)["colq"]
    assert "tile_M % 128 == 0 (group=128 over `M`)" in block.explain()
    rng = np.random.default_rng(12)
    ins = {
        "x": rng.standard_normal((384, 8)).astype(np.float32),
        "w": rng.standard_normal((8, 24)).astype(np.float32),
    }
    y = ins["x"] @ ins["w"]
    amax = np.abs(y).reshape(3, 128, 24).max(axis=1)
    s = (448.0 / np.repeat(amax, 128, axis=0)).astype(np.float32)
    want = np.clip(y * s, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    for tile in (None, (128, 16), (256, 8)):
        out = block.run(ins, sim_tile=tile)
        assert np.array_equal(out["amax"], amax), tile
        assert np.array_equal(out["yq"].view(np.uint8), want.view(np.uint8)), tile
    with pytest.raises(CodaError, match="tile_M = 64 splits the groups of 128 rows"):
        block.run(ins, sim_tile=(64, 16))
    with pytest.raises(CodaError, match="not a multiple of 128"):
        block.run({"x": ins["x"][:200], "w": ins["w"]})


def test_detached_row_group_amax_is_differentiated() -> None:
    """The 128x1 recipe with its amax detached: no cotangent reaches the row-grouped values (the amax,
    the scale made from it), so the backward is derived and recomputes them as values; float64
    straight-through gradients against torch autograd of the same fake-quant math, in the interpreter."""
    block = coda_lang.load(
        COLQ.replace(
            "amax = max(abs(acc), over=M, group=128)", "amax = detach(max(abs(acc), over=M, group=128))"
        )
    )["colq"]
    rng = np.random.default_rng(12)
    m, k, n = 256, 8, 16
    ins = {"x": rng.standard_normal((m, k)), "w": rng.standard_normal((k, n))}
    cots = {"yq": rng.standard_normal((m, n)), "amax": rng.standard_normal((m // 128, n))}
    got = block.vjp(ins, cots, precision="f64")
    t = {key: torch.tensor(v, dtype=torch.float64, requires_grad=True) for key, v in ins.items()}
    y = t["x"] @ t["w"]
    amax = y.detach().abs().unflatten(0, (-1, 128)).amax(1)  # [M/128, N]
    yq = _fake_quant(y * (448.0 / amax.clamp(min=1e-12)).repeat_interleave(128, 0), "e4m3")
    np.testing.assert_allclose(block.run(ins, precision="f64")["amax"], amax.numpy(), rtol=1e-14)
    grads = torch.autograd.grad([yq], [t["x"], t["w"]], [torch.tensor(cots["yq"])])
    for key, gr in zip(ins, grads, strict=True):
        np.testing.assert_allclose(got[key], gr.numpy(), rtol=1e-10, atol=1e-12, err_msg=key)


def test_row_groups_not_yet_differentiated_or_compiled() -> None:
    """No backward (E0602) for groups of rows a cotangent reaches, and no kernel (E0705) for groups of
    rows yet: refused, not wrong."""
    from coda_lang.backend_cute.plan.planner import plan_stage

    block = coda_lang.load(COLQ)["colq"]
    with pytest.raises(CodaError) as ei:
        block.grad()
    (d,) = ei.value.diagnostics
    assert d.code == "E0602" and "grouped over the rows" in d.message
    src = COLQ.replace("f32[M, K]", "bf16[M, K]").replace("f32[K, N]", "bf16[K, N]")
    bf16 = coda_lang.load(src.replace(": e4m3", ": bf16").replace("e4m3[", "bf16["))["colq"]
    with pytest.raises(CodaError) as ei:
        plan_stage(bf16, 1)
    (d,) = ei.value.diagnostics
    assert d.code == "E0705" and "runs of 128 rows" in d.message


# A 128x1 group the stage stores and does not read: one amax per column and run of 128 rows, beside
# the stage's bf16 store (what a producing GEMM can hand the next step's column scales, or a
# column-quantizing pass, without an amax pass of its own)
COLQ_STORED = """
dims M, K, N
block colq(x: bf16[M, K], w: bf16[K, N]) -> (y: bf16[M, N], amax_c: f32[M/128, N]) {
  gemm x @ w {
    y: bf16 = acc
    amax_c = detach(max(abs(acc), over=M, group=128))
  }
}
"""


def test_a_stored_row_group_is_a_tile_tall_column_partial() -> None:
    """Planned as quack's RowVecReduce (one value per column and tile) with `Sink.rows`, at tiles whose
    tile_M is the group: 128-row tiles fit, a 256-row tile is E0805 for the kernel (the emulated
    kernels take it: they fold each group whole); the header says so."""
    from coda_lang.backend_cute.build.config import TileConfig, fits
    from coda_lang.backend_cute.plan.emit import emit_stage
    from coda_lang.backend_cute.plan.planner import plan_stage

    block = coda_lang.load(COLQ_STORED)["colq"]
    spec = plan_stage(block, 1)
    (sink,) = spec.sinks
    assert (sink.op, sink.combine, sink.rows, sink.layout) == ("RowVecReduce", "max", 128, "column partials")
    assert not spec.groups
    assert fits(spec, TileConfig(128, 128)) and fits(spec, TileConfig(128, 192, 2, 1, False))
    assert not fits(spec, TileConfig(256, 128, 2, 1, False))
    assert fits(spec, TileConfig(256, 128, 2, 1, False), emulated=True)
    src = emit_stage(spec)
    assert 'RowVecReduce("amax_c", combine="max")' in src
    assert "(a group of 128 rows: each partial complete)" in src
    with pytest.raises(CodaError) as ei:
        block.cuda(tile=TileConfig(256, 128, 2, 1, False))
    assert ei.value.diagnostics[0].code == "E0805"
    assert "a group of 128 rows is one tile's column partial" in ei.value.diagnostics[0].message
    # a kernel launch at such a tile, past those rules, stops before any buffer is made
    from coda_lang.backend_cute.runtime.launch import StageRunner

    a, b = (torch.empty(shape, device="meta", dtype=torch.bfloat16) for shape in ((512, 64), (64, 128)))
    outs = StageRunner(block, 1, spec, TileConfig(128, 128), False, False).allocate(a, b)
    assert [tuple(o.shape) for o in outs] == [(512, 128), (4, 128)]
    runner = StageRunner(block, 1, spec, TileConfig(256, 128, 2, 1, False), False, False)
    with pytest.raises(AssertionError, match="colq"):
        runner.allocate(a, b)


@pytest.mark.parametrize("tile", [(128, 128), (128, 64), (256, 128)])
def test_a_stored_row_group_runs_as_the_interpreter_does(tile: tuple[int, int]) -> None:
    """The emulated kernels (the runtime's torch stand-ins, on the CPU) against the interpreter, bit
    for bit: the groups' amaxes, NaN and infinities kept; rows that are not a multiple of the group
    are E0802 at the call."""
    from coda_lang.backend_cute.build.config import TileConfig

    block = coda_lang.load(COLQ_STORED)["colq"]
    rng = np.random.default_rng(5)
    # (values on a grid of quarters: every acc exact in f32, whatever order a BLAS sums in)
    x = (np.round(rng.standard_normal((512, 32)) * 4) / 4).astype(ml_dtypes.bfloat16)
    w = (np.round(rng.standard_normal((32, 96)) * 4) / 4).astype(ml_dtypes.bfloat16)
    x[7, 3] = np.nan  # row 7's acc is NaN: group 0's amax of every column is NaN
    x[300, :] = np.inf  # row 300: +-inf (or NaN) in group 2
    want = block.run({"x": x, "w": w})
    m, n = tile
    cb = block.cuda(tile=TileConfig(m, n, 2, 1, m == 128), emulate=True)
    got = cb(x=to_torch(x), w=to_torch(w))
    assert got["amax_c"].shape == (4, 96)
    assert np.array_equal(got["amax_c"].numpy(), np.asarray(want["amax_c"]), equal_nan=True)
    assert np.isnan(want["amax_c"][0]).all() and not np.isnan(want["amax_c"][1]).any()
    assert np.array_equal(got["y"].float().numpy(), np.asarray(want["y"], np.float32), equal_nan=True)
    with pytest.raises(CodaError, match="in groups of 128 rows, but it has 300 rows"):
        cb(x=to_torch(x[:300]), w=to_torch(w))


ROW_FOLDS = """
dims M, K, N
block rg(x: bf16[M, K], w: bf16[K, N], v: f32[N]) -> (y: bf16[M, N], s: f32[M/128, N], lo: f32[M/128, N]) {
  gemm x @ w {
    y: bf16 = acc
    s = sum(acc * v, over=M, group=128)
    lo = min(acc, over=M, group=128)
  }
}
"""


def test_stored_row_groups_sum_a_product_and_take_a_min() -> None:
    """A sum of a product over runs of rows (folded as one fma of its factors) and a min (the max of
    the negation) are stored groups of rows too, each at tile_M == 128, and run as the interpreter
    does; a logsumexp over runs of rows stays E0705."""
    from coda_lang.backend_cute.build.config import TileConfig
    from coda_lang.backend_cute.plan.planner import plan_stage

    block = coda_lang.load(ROW_FOLDS)["rg"]
    spec = plan_stage(block, 1)
    assert [(s.name, s.scaled, s.negate, s.rows) for s in spec.sinks] == [
        ("s", True, False, 128),
        ("lo", False, True, 128),
    ]
    rng = np.random.default_rng(1)
    ins = {  # (x and w on a grid of quarters: every acc exact in f32, whatever order a BLAS sums in)
        "x": (np.round(rng.standard_normal((256, 16)) * 4) / 4).astype(ml_dtypes.bfloat16),
        "w": (np.round(rng.standard_normal((16, 64)) * 4) / 4).astype(ml_dtypes.bfloat16),
        "v": rng.standard_normal(64).astype(np.float32),
    }
    want = block.run(ins)
    for tile in (TileConfig(128, 64), TileConfig(256, 128, 2, 1, False)):
        got = block.cuda(tile=tile, emulate=True)({k: to_torch(a) for k, a in ins.items()})
        assert np.array_equal(got["lo"].numpy(), np.asarray(want["lo"]))
        np.testing.assert_allclose(got["s"].numpy(), np.asarray(want["s"]), rtol=1e-5, atol=1e-5)
    lse = ROW_FOLDS.replace("lo = min(acc, over=M, group=128)", "lo = logsumexp(acc, over=M, group=128)")
    with pytest.raises(CodaError) as ei:
        plan_stage(coda_lang.load(lse)["rg"], 1)
    assert ei.value.diagnostics[0].code == "E0705"


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_stored_row_group_compiles_to_ptx(tmp_path: Path) -> None:
    """quack's RowVecReduce of |acc| by max at 128x128 for sm_90a: no spills, every max NaN-propagating
    (`max.NaN.f32`, no NaN-quiet float max in the epilogue)."""
    import re

    from coda_lang.backend_cute.build.compile import compile_stage
    from coda_lang.backend_cute.build.config import TileConfig

    c = compile_stage(coda_lang.load(COLQ_STORED)["colq"], 1, TileConfig(128, 128), directory=tmp_path)
    assert c.report is not None and not c.report.spills, c.report.text
    assert "wgmma.mma_async" in c.ptx and "max.NaN.f32" in c.ptx
    assert not re.findall(r"\b(?:max|min)(?:\.ftz)?\.f32\b", c.ptx)


@pytest.mark.gpu
def test_a_stored_row_group_on_the_gpu() -> None:
    """The compiled kernel on a Hopper GPU at 8192 x 1024 x 2048 (its tuned tile): the groups' amaxes
    equal the interpreter's rule applied to the kernel's own bf16-exact f32 product, bit for bit."""
    block = coda_lang.load(COLQ_STORED)["colq"]
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(8192, 1024, device="cuda", generator=g).bfloat16()
    w = torch.randn(1024, 2048, device="cuda", generator=g).bfloat16()
    x[9, 5] = float("nan")
    got = block.cuda()(x=x, w=w)
    torch.cuda.synchronize()
    acc = x.float() @ w.float()  # (the same products; f32 sums in another order: compared per group)
    want = acc.abs().unflatten(0, (-1, 128)).amax(1)
    assert got["amax_c"].shape == want.shape
    assert torch.isnan(got["amax_c"][0]).all() and not torch.isnan(got["amax_c"][1:]).any()
    torch.testing.assert_close(got["amax_c"][1:], want[1:], rtol=1e-5, atol=0)
    torch.testing.assert_close(
        got["amax_c"][1:], got["y"][128:].float().abs().unflatten(0, (-1, 128)).amax(1), rtol=2**-8, atol=0
    )


# ---------------------------------------------------------------------------- fp8 cotangents (fp8_grads=)

TWO = """
dims M, K, N, P
block two(xq: e4m3[M, K], w1: e4m3[K, N], s: f32, w2: e4m3[N, P]) -> (out: bf16[M, P]) {
  gemm xq @ w1 {
    hq: e4m3 = silu(acc) * s
  }
  inv = 1.0 / s
  gemm hq @ w2 {
    out = acc * inv
  }
}
"""
WRT = ["xq", "w1", "w2"]  # the recipes differentiate no scale


class _GradQuant(torch.autograd.Function):
    """Identity forward; backward quantizes the incoming gradient as the derived backward's dacc store
    does (times the scale, saturated, rounded to fp8) and takes the scale off again, recording the
    gradient's amax (what fp8_grads= returns as `dacc<k>_amax`)."""

    @staticmethod
    def forward(ctx, x, scale, dtype, amaxes):  # type: ignore[no-untyped-def, override]
        ctx.scale, ctx.dtype, ctx.amaxes = scale, dtype, amaxes
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        _, mx, tdt = FP8[ctx.dtype]
        ctx.amaxes.append(float(g.abs().max()))
        return (g * ctx.scale).clamp(-mx, mx).to(tdt).to(g.dtype) / ctx.scale, None, None, None


def _two_inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    m, k, n, p = 8, 16, 32, 16
    return {
        "xq": round_fp8(rng.standard_normal((m, k)) * 2, "e4m3"),
        "w1": round_fp8(rng.standard_normal((k, n)) / 4, "e4m3"),
        "s": np.float64(64.0),
        "w2": round_fp8(rng.standard_normal((n, p)) / 6, "e4m3"),
    }


def _two_torch(ins: dict, dout: np.ndarray, dtype: str, g1: float, g2: float) -> tuple[dict, list]:
    """Gradients of xq, w1, w2 by torch autograd of the fake-quant math, float64, and the cotangent
    amaxes (of dacc2, then dacc1: the order the backward meets them)."""
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k in WRT) for k, v in ins.items()}
    amaxes: list[float] = []
    acc1 = _GradQuant.apply(t["xq"] @ t["w1"], g1, dtype, amaxes)
    hq = _fake_quant(torch.nn.functional.silu(acc1) * t["s"], "e4m3")
    acc2 = _GradQuant.apply(hq @ t["w2"], g2, dtype, amaxes)
    out = acc2 * (1.0 / t["s"])
    grads = torch.autograd.grad(out, [t[k] for k in WRT], torch.tensor(dout))
    return {k: g.numpy() for k, g in zip(WRT, grads, strict=True)}, amaxes


@pytest.mark.parametrize("dtype", ["e5m2", "e4m3"])
def test_fp8_cotangents_against_torch(dtype: str) -> None:
    """fp8_grads=: both stages' cotangents quantized, stage 2's in its elementwise entry stage, stage 1's
    in the epilogue of stage 2's dgrad GEMM; float64 gradients and amaxes against torch autograd of
    the same fake-quant math (a straight-through quantize of each GEMM output's gradient), the scales
    chosen so that some cotangents saturate; and the quantization changes the gradients (the bf16
    backward differs), so the comparison can tell."""
    block = coda_lang.load(TWO)["two"]
    ins = _two_inputs(12)
    dout = np.random.default_rng(13).standard_normal((8, 16))
    d = block.derivation(WRT, backward=coda_lang.BackwardOptions(fp8_grads=dtype))
    assert d.scales == {"dacc2_scale": "dacc2_amax", "dacc1_scale": "dacc1_amax"}
    text = str(d.backward)
    assert f"dacc1: {dtype}" in text and f"dacc2: {dtype}" in text
    assert "dacc2_scale: f32" in text and "dacc1_amax: f32" in text
    # every backward GEMM multiplies fp8 by fp8
    types = {p.var.name: p.var.type.dtype for p in d.backward.ir.params}
    types.update({"dacc1": dtype, "dacc2": dtype, "hq": "e4m3"})
    for st in d.backward.ir.stages:
        if st.is_gemm:
            assert {types[st.a.name], types[st.b.name]} <= {"e4m3", "e5m2"}, (st.a, st.b)
    # this step's amaxes with scale 1, then scales that saturate a few of each cotangent (delayed)
    _, mx, _ = FP8[dtype]
    first = block.vjp(ins, {"out": dout}, precision="f64", wrt=WRT, fp8_grads=dtype)
    g1, g2 = 1.3 * mx / first["dacc1_amax"], 1.3 * mx / first["dacc2_amax"]
    scales = {"dacc1_scale": g1, "dacc2_scale": g2}
    got = block.vjp(ins, {"out": dout}, precision="f64", wrt=WRT, fp8_grads=dtype, scales=scales)
    want, amaxes = _two_torch(ins, dout, dtype, g1, g2)
    for k in WRT:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-12, err_msg=k)
    np.testing.assert_allclose([got["dacc2_amax"], got["dacc1_amax"]], amaxes, rtol=1e-12)
    plain = block.vjp(ins, {"out": dout}, precision="f64", wrt=WRT)
    for k in WRT:
        assert not np.allclose(plain[k], want[k], rtol=1e-3, atol=0), k


def test_fp8_cotangents_exact_and_emulated() -> None:
    """The derived backward in exact precision and on the emulated runtime (the CUDA runtime's torch
    stand-ins, on the CPU), on the same inputs, within the accuracy rule; the forward of
    examples/fp8_delayed.coda with its e5m2 cotangent read by the e5m2 @ e4m3 dgrad and the
    e4m3 @ e5m2 wgrad."""
    from coda_lang.testing.compare import mismatch

    block = _example("fp8_delayed")
    wrt = ["x", "w", "w2"]
    d = block.derivation(wrt, backward=coda_lang.BackwardOptions(fp8_grads="e5m2"))
    assert list(d.scales) == ["dacc2_scale"]
    rng = np.random.default_rng(14)
    m, k, n, p = 16, 32, 32, 16
    ins = {
        "x": rng.standard_normal((m, k)).astype(np.float32),
        "w": (rng.standard_normal((k, n)) / 4).astype(np.float32),
        "scale": np.float32(200.0),
        "w2": round_fp8(rng.standard_normal((p, n)) / 6, "e4m3").astype(np.float32),
    }
    cots = {"out": rng.standard_normal((m, p)).astype(np.float32), "amax": np.float32(0.0)}
    fwd = d.forward.run(ins)
    bins, bdims = block.backward_inputs(d, ins, cots, fwd, None)
    bins["dacc2_scale"] = np.float32(3000.0)
    ref = d.backward.run(bins, dims=bdims)
    ref64 = d.backward.run(bins, dims=bdims, precision="f64")
    assert any(np.asarray(v).dtype.name == "float8_e4m3fn" for v in bins.values())  # the saved e4m3 hq
    got = d.backward.cuda(emulate=True)({key: to_torch(np.asarray(v)) for key, v in bins.items()})
    for key, dt in (("dx", "bf16"), ("dw", "bf16"), ("dw2", "bf16"), ("dacc2_amax", "f32")):
        assert mismatch(key, got[key], ref[key], ref64[key], dtype=dt) is None, mismatch(
            key, got[key], ref[key], ref64[key], dtype=dt
        )


def test_fp8_cotangent_with_a_bf16_operand_is_refused(tmp_path: Path) -> None:
    """A stage multiplying e4m3 by bf16: its wgrad would multiply the e5m2 cotangent with bf16 `x`,
    which fp8 kernels don't run: E0602 at the stage, naming the operand and the two ways out; without
    --fp8-grads the block derives as before; through autograd too."""
    src = tmp_path / "mixed.coda"
    src.write_text(
        "dims M, K, N\nblock mixed(x: bf16[M, K], w: e4m3[K, N]) -> (y: bf16[M, N]) {\n"
        "  gemm x @ w {\n    y = acc\n  }\n}\n"
    )
    r = coda("grad", src, "--fp8-grads", "e5m2")
    assert r.returncode == 1, r.stderr
    assert "error[E0602]" in r.stderr and f"--> {src}:3:3" in r.stderr, r.stderr
    assert "`x`" in r.stderr and "store `x` in fp8" in r.stderr and "without --fp8-grads" in r.stderr
    assert coda("grad", src).returncode == 0
    block = coda_lang.load(src)["mixed"]
    import coda_lang.torch as ct

    fp8 = coda_lang.BackwardOptions(fp8_grads="e5m2")
    with pytest.raises(CodaError, match="E0602"):
        block.cuda(emulate=True).autograd(backward=fp8, grad_scales=ct.DelayedScaling(1.0))
    with pytest.raises(CodaError, match="E0602"):
        ct.function(block, backward=fp8)
    with pytest.raises(ValueError, match="fp8_grads="):
        coda_lang.BackwardOptions(fp8_grads="e3m4")
    with pytest.raises(ValueError, match="chunks"):
        coda_lang.BackwardOptions(fp8_grads="e5m2", chunk=64)


def _rule(hist: list[float], prev: np.float32, dtype: str, margin: int) -> np.float32:
    """The next scale, written independently of DelayedScaling: fp8 max / max(history) / 2**margin in
    f32, the previous scale where that amax is 0 or not finite."""
    a = np.float32(max(hist))
    if not (np.isfinite(a) and a > 0):
        return prev
    return np.float32(np.float32(FP8[dtype][1]) / a) / np.float32(2.0**margin)


def _ref_steps(ins: dict, douts: list, dtype: str, initial: Any, margin: int, history: int) -> list:
    """(gradients, amaxes {scale: amax}, scales used {scale: f32}) per step, by torch autograd of the
    fake-quant math (float64) with the delayed-scale rule applied step by step; initial="calibrate":
    the first step reruns until its scales are the rule of its own amaxes."""
    names = ["dacc2_scale", "dacc1_scale"]
    hist: dict[str, list[float]] = {n: [] for n in names}
    if initial == "calibrate":
        scales = {n: np.float32(1.0) for n in names}
    else:
        scales = {n: np.float32(initial[n] if isinstance(initial, dict) else initial) for n in names}
    out = []
    for step, dout in enumerate(douts):
        while True:
            grads, am = _two_torch(
                ins, dout, dtype, float(scales["dacc1_scale"]), float(scales["dacc2_scale"])
            )
            amaxes = dict(zip(names, am, strict=True))
            if not (initial == "calibrate" and step == 0):
                break
            nxt = {n: _rule([amaxes[n]], scales[n], dtype, margin) for n in names}
            if nxt == scales:
                break
            scales = nxt
        out.append((grads, amaxes, dict(scales)))
        for n in names:
            hist[n] = (hist[n] + [amaxes[n]])[-history:]
            scales[n] = _rule(hist[n], scales[n], dtype, margin)
    return out


@pytest.mark.parametrize(
    "dtype, initial, margin, history",
    [("e5m2", "calibrate", 1, 2), ("e4m3", {"dacc2_scale": 512.0, "dacc1_scale": 4.0}, 0, 1)],
)
def test_fp8_cotangents_through_torch_function(dtype: str, initial: Any, margin: int, history: int) -> None:
    """coda_lang.torch.function with fp8_grads= on the emulated runtime, four steps of a training loop
    whose cotangents grow 8x at the second step (so its delayed scales saturate some) and shrink at the
    third: each step's gradients against torch autograd of the same straight-through quantization with
    the rule's scales (_rule, written apart from DelayedScaling), the recorded amaxes and the scales it
    ran at against the reference's; the saturating step differs from the one at its own (current)
    scales, so a rule off by a step fails."""
    import coda_lang.torch as ct

    block = coda_lang.load(TWO)["two"]
    ins = _two_inputs(12)
    rng = np.random.default_rng(15)
    douts = [
        torch.tensor(rng.standard_normal((8, 16)) * m, dtype=torch.bfloat16).double().numpy()
        for m in (1.0, 8.0, 0.25, 1.0)
    ]
    want = _ref_steps(ins, douts, dtype, initial, margin, history)
    state = ct.DelayedScaling(initial, margin=margin, history=history)
    # remat="save": the backward reads the forward's e4m3 `hq` (under "auto" it recomputes it from a bf16
    # `acc1`, a rounding the float64 reference does not have)
    options = coda_lang.BackwardOptions(fp8_grads=dtype, remat="save")
    f = ct.function(block, wrt=WRT, backward=options, grad_scales=state)
    assert f.grad_scales is state and state.names == ("dacc2_scale", "dacc1_scale")
    for step, (dout, (wgrads, wamax, wscales)) in enumerate(zip(douts, want, strict=True)):
        t = {k: torch.tensor(v, dtype=torch.float32, requires_grad=k in WRT) for k, v in ins.items()}
        out = f(**t)["out"]
        out.backward(torch.tensor(dout, dtype=torch.bfloat16))
        for n in wscales:  # the scales this backward ran at (the state moved on to the next ones)
            # (f32 and bf16 in the runtime, float64 in the reference: amaxes agree to ~1e-4)
            np.testing.assert_allclose(
                float(state.last_scales[n]), wscales[n], rtol=1e-3, err_msg=f"{step} {n}"
            )
            np.testing.assert_allclose(float(state.amaxes[n]), wamax[n], rtol=1e-3, err_msg=f"{step} {n}")
        for k in WRT:
            g, w = t[k].grad.double().numpy(), wgrads[k]
            np.testing.assert_allclose(
                g, w, rtol=2e-2, atol=2e-2 * np.abs(w).max(), err_msg=f"step {step} d{k}"
            )
    assert state.steps == 4
    # the second step saturated: at its own amax's scales (current scaling) the gradients differ
    _, amax2, used2 = want[1]
    cur = {n: _rule([amax2[n]], used2[n], dtype, margin) for n in used2}
    now, _ = _two_torch(ins, douts[1], dtype, float(cur["dacc1_scale"]), float(cur["dacc2_scale"]))
    assert any(not np.allclose(now[k], want[1][0][k], rtol=5e-2, atol=0) for k in WRT)


def test_fp8_cotangents_torch_function_refusals() -> None:
    """fp8_grads= through coda_lang.torch.function without a DelayedScaling is a ValueError naming the
    scales (the first scale is the user's choice); a state bound to one backward refuses another's;
    grad_scales= on a function without fp8 cotangents is refused; bad recipes are refused when made."""
    import coda_lang.torch as ct

    block = coda_lang.load(TWO)["two"]
    fp8 = coda_lang.BackwardOptions(fp8_grads="e5m2")
    with pytest.raises(ValueError, match="dacc2_scale, dacc1_scale.*DelayedScaling"):
        ct.function(block, wrt=WRT, backward=fp8)
    with pytest.raises(ValueError, match="no fp8 cotangents"):
        ct.function(block, wrt=WRT, grad_scales=ct.DelayedScaling(1.0))
    s = ct.DelayedScaling(1.0)
    ct.function(block, wrt=WRT, backward=fp8, grad_scales=s)
    with pytest.raises(ValueError, match="its own"):
        ct.function(block, wrt=WRT, backward=coda_lang.BackwardOptions(fp8_grads="e4m3"), grad_scales=s)
    with pytest.raises(ValueError, match="initial= names"):
        ct.function(block, wrt=WRT, backward=fp8, grad_scales=ct.DelayedScaling({"dacc2_scale": 1.0}))
    with pytest.raises(ValueError, match="initial="):
        ct.DelayedScaling("auto")
    with pytest.raises(ValueError, match="positive"):
        ct.DelayedScaling(0.0)
    with pytest.raises(ValueError, match="history="):
        ct.DelayedScaling(1.0, history=0)
    with pytest.raises(TypeError, match="margin="):
        ct.DelayedScaling(1.0, margin=0.5)


DETACHED = """
dims M, K, N
block b(x: f32[M, K], w: f32[K, N], s: f32) -> (y: f32[M, N], m: f32) {
  gemm x @ w {
    t = acc * detach(acc) * s
    y = t + detach(t * s)
    rm = max(abs(acc), over=N)
  }
  m = detach(max(rm, over=M)) * s
}
"""


def test_detach_passes_no_gradient_against_torch() -> None:
    """detach(x) is x in the forward and stops the gradient, in a stage and between stages, as torch's
    .detach() does (float64 vjp against torch autograd of the same math)."""
    block = coda_lang.load(DETACHED)["b"]
    rng = np.random.default_rng(3)
    ins = {"x": rng.standard_normal((4, 8)), "w": rng.standard_normal((8, 6)), "s": np.float64(0.7)}
    cots = {"y": rng.standard_normal((4, 6)), "m": np.float64(1.3)}
    got = block.vjp(ins, cots, precision="f64")
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in ins.items()}
    acc = t["x"] @ t["w"]
    tt = acc * acc.detach() * t["s"]
    y = tt + (tt * t["s"]).detach()
    m = acc.detach().abs().max() * t["s"]
    out = block.run(ins, precision="f64")
    np.testing.assert_allclose(out["y"], y.detach().numpy(), rtol=1e-12)
    assert math.isclose(float(out["m"]), float(m.detach()), rel_tol=1e-12)
    grads = torch.autograd.grad(
        [y, m], [t[k] for k in ins], [torch.tensor(cots["y"]), torch.tensor(1.3, dtype=torch.float64)]
    )
    for k, g in zip(ins, grads, strict=True):
        np.testing.assert_allclose(got[k], g.numpy(), rtol=1e-10, atol=1e-12, err_msg=k)


def test_delayed_backward_saves_the_fp8_tile_not_an_f32_one() -> None:
    """With the amax detached, fp8_delayed's backward reads the e4m3 hq the forward stores (1 byte an
    element) and no f32 accumulator or max-tie tile: the saved tensors are the fp8 copies."""
    d = _example("fp8_delayed").derivation(["x", "w", "w2"])
    saved = {p.var.name: p.var.type for p in d.backward.ir.params if p.var.name in d.saved}
    assert "hq" in saved and saved["hq"].dtype == "e4m3", saved
    assert all(t.dtype != "f32" or not t.shape for t in saved.values()), saved


def test_blockwise_example_gradients_against_torch() -> None:
    """examples/fp8_blockwise.coda, its amax detached: float64 straight-through gradients of x and w
    against torch autograd of the fake-quant math at the forward's scales (dacc = dyq * 448 / amax);
    a cotangent given for the amax changes nothing."""
    block = _example("fp8_blockwise")
    rng = np.random.default_rng(8)
    m, k, n = 8, 16, 256
    ins = {"x": rng.standard_normal((m, k)), "w": rng.standard_normal((k, n)) / 4}
    cots = {"yq": rng.standard_normal((m, n)), "amax": rng.standard_normal((m, n // 128))}
    got = block.vjp(ins, cots, precision="f64")
    t = {key: torch.tensor(v, dtype=torch.float64, requires_grad=True) for key, v in ins.items()}
    y = t["x"] @ t["w"]
    amax = y.detach().abs().unflatten(1, (-1, 128)).amax(-1)
    s = (448.0 / amax.clamp(min=1e-12)).repeat_interleave(128, 1)
    yq = _fake_quant(y * s, "e4m3")
    out = block.run(ins, precision="f64")
    np.testing.assert_array_equal(out["amax"], amax.numpy())
    np.testing.assert_array_equal(out["yq"], yq.detach().numpy())
    grads = torch.autograd.grad([yq], [t["x"], t["w"]], [torch.tensor(cots["yq"])])
    for key, gr in zip(ins, grads, strict=True):
        np.testing.assert_allclose(got[key], gr.numpy(), rtol=1e-10, atol=1e-12, err_msg=key)
    alone = block.vjp(ins, {**cots, "amax": np.zeros_like(cots["amax"])}, precision="f64")
    for key in ins:
        assert np.array_equal(alone[key], got[key]), key


def test_a_detached_output_is_not_differentiable_through_torch() -> None:
    """coda_lang.torch.function of examples/fp8_delayed.coda (emulated runtime): the detached amax comes
    back without a grad_fn (torch's mark_non_differentiable), out with one; the backward of out gives
    the interpreter's gradients; and a block whose output depends on no differentiated parameter
    returns it without a grad_fn too."""
    import coda_lang.torch as ct

    block = _example("fp8_delayed")
    f = ct.function(block, wrt=["x", "w"])
    rng = np.random.default_rng(4)
    ins = {
        "x": torch.tensor(rng.standard_normal((8, 16)), dtype=torch.bfloat16, requires_grad=True),
        "w": torch.tensor(rng.standard_normal((16, 32)) / 4, dtype=torch.bfloat16, requires_grad=True),
        "scale": 200.0,
        "w2": torch.tensor(rng.standard_normal((16, 32)) / 6).to(torch.float8_e4m3fn),
    }
    res = f(**ins)
    assert res["amax"].grad_fn is None and not res["amax"].requires_grad
    assert res["out"].requires_grad
    res["out"].float().sum().backward()
    assert ins["x"].grad is not None and float(ins["x"].grad.float().abs().sum()) > 0
    plain = coda_lang.load(
        """
dims M, K, N
block b(x: f32[M, K], w: f32[K, N], s: f32[N]) -> (y: f32[M, N], z: f32[M, N]) {
  gemm x @ w {
    y = acc
    z = acc + s
  }
}
"""
    )["b"]
    d = plain.derivation(["s"])
    assert d.detached == frozenset({"y"}), d.detached


def test_parameters_reached_only_through_detach_get_zero_gradients() -> None:
    """x and w reach the output only through detach: their gradients are zeros of their shapes (torch
    gives none for them), and the backward builds no GEMM for them; s's is the column sum."""
    block = coda_lang.load(
        """
dims M, K, N
block b(x: f32[M, K], w: f32[K, N], s: f32[N]) -> (y: f32[M, N]) {
  gemm x @ w {
    y = detach(acc) + s
  }
}
"""
    )["b"]
    rng = np.random.default_rng(2)
    ins = {"x": rng.standard_normal((4, 3)), "w": rng.standard_normal((3, 5)), "s": rng.standard_normal(5)}
    dy = rng.standard_normal((4, 5))
    got = block.vjp(ins, {"y": dy}, precision="f64")
    assert got["x"].shape == (4, 3) and not got["x"].any()
    assert got["w"].shape == (3, 5) and not got["w"].any()
    np.testing.assert_allclose(got["s"], dy.sum(0), rtol=1e-12)
    assert not any(st.is_gemm for st in block.derivation().backward.ir.stages)


def test_delayed_scaling_state_dict_round_trip() -> None:
    """A DelayedScaling saved after more steps than its history and loaded into a fresh one gives the same
    scales, and the same next scales after one more step (the ring of past amaxes in its order)."""
    import coda_lang.torch as ct

    g = torch.Generator().manual_seed(0)
    steps = [{"a": torch.rand((), generator=g) * 10, "b": torch.rand((), generator=g)} for _ in range(7)]
    one = ct.DelayedScaling(1.0, history=4)
    one.bind(["a", "b"], "e4m3")
    one.scales_for(torch.device("cpu"))
    for am in steps[:6]:
        one.record(am)
    two = ct.DelayedScaling(1.0, history=4)
    two.load_state_dict(one.state_dict())
    assert {k: float(v) for k, v in two.scales.items()} == {k: float(v) for k, v in one.scales.items()}
    one.record(steps[6])
    two.record(steps[6])
    for n in ("a", "b"):
        want = 448.0 / max(float(s[n]) for s in steps[3:7])
        assert float(one.scales[n]) == float(two.scales[n])
        assert math.isclose(float(one.scales[n]), want, rel_tol=1e-6), (n, float(one.scales[n]), want)


def test_delayed_scaling_reduces_its_amaxes_before_the_rule() -> None:
    """`DelayedScaling.reduce` (what coda_lang.hf.reduce_fp8_amaxes sets to an all-reduce over the
    data-parallel ranks) is applied to each backward's amaxes before the rule: here a stand-in for
    another rank's larger amax sets the next scale, and the state keeps the reduced amaxes."""
    import coda_lang.torch as ct

    s = ct.DelayedScaling(1.0, history=2)
    s.bind(["dacc2_scale", "dacc1_scale"], "e5m2")
    s.scales_for(torch.device("cpu"))
    other = torch.tensor([8.0, 0.5])  # (in names' order)
    seen: list[torch.Tensor] = []
    s.reduce = lambda a: seen.append(a.clone()) or torch.maximum(a, other)
    s.record({"dacc2_scale": torch.tensor(2.0), "dacc1_scale": torch.tensor(4.0)})
    assert len(seen) == 1 and seen[0].tolist() == [2.0, 4.0]
    assert float(s.scales["dacc2_scale"]) == _rule([8.0], np.float32(1.0), "e5m2", 0)
    assert float(s.scales["dacc1_scale"]) == _rule([4.0], np.float32(1.0), "e5m2", 0)
    assert float(s.amaxes["dacc2_scale"]) == 8.0
    nxt = s.next_scales({"dacc2_scale": torch.tensor(1.0), "dacc1_scale": torch.tensor(1.0)}, s.scales)
    assert len(seen) == 2 and float(nxt["dacc2_scale"]) == _rule([8.0, 8.0], np.float32(1.0), "e5m2", 0)
