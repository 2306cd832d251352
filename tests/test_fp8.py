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

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch
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
    weight w2) against torch autograd of the fake-quant math, the amax's cotangent included."""
    block = _example("fp8_delayed")
    rng = np.random.default_rng(6)
    m, k, n, p = 8, 16, 32, 16
    ins = {
        "x": rng.standard_normal((m, k)),
        "w": rng.standard_normal((k, n)) / 4,
        "scale": np.float64(200.0),  # a few values saturate
        "w2": round_fp8(rng.standard_normal((n, p)) / 6, "e4m3"),
    }
    cots = {"out": rng.standard_normal((m, p)), "amax": np.float64(-0.4)}
    got = block.vjp(ins, cots, precision="f64")
    t = {key: torch.tensor(v, dtype=torch.float64, requires_grad=True) for key, v in ins.items()}
    h = t["x"] @ t["w"]
    hq = _fake_quant(h * t["scale"], "e4m3")
    assert (hq.detach().abs() == 448).any()
    out = (hq @ t["w2"]) * (1.0 / t["scale"])
    grads = torch.autograd.grad(
        [out, h.abs().max()],
        [t[key] for key in ins],
        [torch.tensor(cots["out"]), torch.tensor(-0.4, dtype=torch.float64)],
    )
    for key, gr in zip(ins, grads, strict=True):
        np.testing.assert_allclose(got[key], gr.numpy(), rtol=1e-10, atol=1e-12, err_msg=key)


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
        "w2": (torch.randn(32, 16, generator=g) / 6).to(torch.float8_e4m3fn),
    }
    leaves = {k: v.clone().requires_grad_(True) for k, v in ins.items()}
    outs = ct.function(block)(**leaves)
    ref = block.run({k: v for k, v in ins.items()})
    assert np.array_equal(outs["out"].detach().float().numpy(), ref["out"].astype(np.float32))
    assert float(outs["amax"].detach()) == float(ref["amax"])
    dout = torch.randn(32, 16, generator=g).bfloat16()
    torch.autograd.backward([outs["out"], outs["amax"]], [dout, torch.tensor(0.5)])
    want = block.vjp(ins, {"out": dout, "amax": np.float32(0.5)})
    for k, leaf in leaves.items():
        assert leaf.grad is not None and leaf.grad.dtype == ins[k].dtype, k
        dtype = "e4m3" if k == "w2" else "bf16" if k != "scale" else "f32"
        r = round_fp8(want[k].astype(np.float32), "e4m3") if k == "w2" else want[k]
        assert mismatch(k, leaf.grad, r, dtype=dtype) is None, mismatch(k, leaf.grad, r, dtype=dtype)


def test_emulated_store_saturates_e5m2() -> None:
    """torch's cast to e5m2 overflows to inf: the emulated store clamps first, as the interpreter's."""
    import coda_lang.torch as ct

    block = coda_lang.load(DELAYED.format(t="e5m2"))["delayed"]
    g = torch.Generator().manual_seed(10)
    ins = {
        "x": torch.randn(16, 16, generator=g),
        "w": torch.randn(16, 16, generator=g),
        "s": torch.tensor(3e4),  # |acc * s| up to ~1e5: past e5m2's 57344
        "w2": torch.randn(16, 16, generator=g) / 4,
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


@pytest.mark.parametrize("name", ["fp8_blockwise", "fp8_delayed"])
def test_kernel_backend_refuses_fp8_not_yet(name: str) -> None:
    """The CuTeDSL planner (`coda compile`, `Block.cuda()`) refuses an fp8 store or GEMM operand with a
    clear E0702 at its place, not wrong code; the emulated planner takes the same stage."""
    from coda_lang.backend_cute.plan.planner import plan_stage

    block = _example(name)
    with pytest.raises(CodaError) as ei:
        plan_stage(block, 1)
    (d,) = ei.value.diagnostics
    assert d.code == "E0702" and "fp8 is not compiled by the CuTeDSL backend yet" in d.message
    assert d.span is not None and d.span.line > 1
    assert plan_stage(block, 1, emulated=True) is not None


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


def test_row_groups_not_yet_differentiated_or_compiled() -> None:
    """No backward (E0602) and no kernel (E0705) for groups of rows yet: refused, not wrong."""
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
