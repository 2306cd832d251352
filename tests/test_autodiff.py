"""Autodiff: Block.grad / Block.vjp / Block.derivation and `coda grad`'s output.

- `check_vjp` (after JAX's): in float64, a central finite difference of <outputs, random cotangents>
  in a random direction of the inputs against sum(grad * direction) from Block.vjp. Run on every
  example, and on every differentiable op of the registry (programs from tests/strategies.py: the op
  in a stage on tiles, in a stage whose backward runs in a dgrad epilogue, between stages on vectors).
- Tile invariance: Block.vjp in tile mode (ragged tiles) equals whole mode, for every example.
- torch.autograd of the independent references (tests/torch_refs.py) in float64 on the ordinary
  (de-interleaved) layouts, gradients mapped through coda_lang.layout, for the LLaMA examples.
- The paper's theorem as a property: random block-local forward blocks have a backward that passes
  the checker (also as printed source) and check_vjp holds.
- The paper's backward schedule for llama_block (docs/design.md, "Where the backward runs"), saved tensors, and golden
  files of `coda grad` (tests/golden/grad/; rewrite with `pytest --update-golden`).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch_refs as ref
from hypothesis import HealthCheck, assume, given, settings
from support import NO_BACKWARD, QUANTIZED_EXAMPLES, coda, golden

import coda_lang
from coda_lang.core.diagnostics import CODES
from coda_lang.ir.nodes import Eqn, Stage, Var
from coda_lang.ir.types import MATRIX, SCALAR, VEC, is_float
from coda_lang.layout import deinterleave_rope, interleave_gate_up, interleave_rope, split_gate_up
from coda_lang.ops import REGISTRY, Locality
from coda_lang.testing import (
    OP_SIZES,
    Forward,
    differentiable_ops,
    forward_blocks,
    gradcheck_inputs,
    op_programs,
)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
GOLDEN = ROOT / "tests" / "golden" / "grad"
NAMES = sorted(p.stem for p in EXAMPLES.glob("*.coda"))

# Small dims, multiples of nothing; qk_norm reduces groups of 128 columns, so 2*P is a multiple of 128.
DIMS = {"M": 11, "K": 13, "N": 9, "D": 13, "F": 9, "V": 17, "P": 7}
DIMS_BY_EXAMPLE = {"qk_norm": {"M": 11, "D": 13, "P": 128}, "fp8_blockwise": {"M": 11, "K": 13, "N": 256}}
TILES = {"qk_norm": [(4, 128), (5, 256)], "fp8_blockwise": [(4, 128)]}  # tile_N a multiple of the group
# examples a finite difference can check (support.QUANTIZED_EXAMPLES says why not the others), and
# those with a backward
FD_NAMES = [n for n in NAMES if n not in QUANTIZED_EXAMPLES]
GRAD_NAMES = [n for n in NAMES if n not in NO_BACKWARD]
DEFAULT_TILES = [(4, 6), (5, 8)]  # even tile_N (pairs); ragged in both directions


# ---------------------------------------------------------------------------- check_vjp


def _fdot(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, float]:
    """sum over keys of <a, b>, and the same sum of |a * b| (the scale a rounding error is relative to)."""
    s = m = 0.0
    for k, x in b.items():
        p = np.asarray(a[k], np.float64) * np.asarray(x, np.float64)
        s += float(np.sum(p))
        m += float(np.sum(np.abs(p)))
    return s, m


def check_vjp(
    block: coda_lang.Block,
    inputs: dict[str, Any],
    *,
    dims: dict[str, int] | None = None,
    wrt: list[str] | None = None,
    seed: int = 0,
    eps: float = 1e-6,
    rtol: float = 1e-6,
) -> None:
    """JAX-style VJP check in float64: (f(x + eps d) - f(x - eps d)) / 2 eps with
    f(x) = <outputs(x), cotangents>, against sum(grad * d) from Block.vjp; d and the cotangents random."""
    rng = np.random.default_rng(seed)
    outs = block.run(inputs, dims=dims, precision="f64")
    cts = {k: rng.standard_normal(np.shape(v)) for k, v in outs.items() if np.asarray(v).dtype.kind == "f"}
    grads = block.vjp(inputs, cts, dims=dims, precision="f64", wrt=wrt)
    expected = (
        wrt
        if wrt is not None
        else [
            p.var.name
            for p in block.ir.params
            if p.default is None and p.var.type and is_float(p.var.type.dtype)
        ]
    )
    assert sorted(grads) == sorted(expected), "Block.vjp gives a gradient per differentiable parameter"
    for k, g in grads.items():
        assert np.shape(g) == np.shape(inputs[k]), (
            f"gradient of `{k}`: shape {np.shape(g)}, input {np.shape(inputs[k])}"
        )
        assert np.all(np.isfinite(g)), f"gradient of `{k}` is not finite"
    dirs = {k: rng.standard_normal(np.shape(inputs[k])) for k in grads}

    def f(step: float) -> tuple[float, float]:
        moved = dict(inputs)
        for k, d in dirs.items():
            moved[k] = np.asarray(inputs[k], np.float64) + step * d
        return _fdot(block.run(moved, dims=dims, precision="f64"), cts)

    (fp, sp), (fm, _) = f(eps), f(-eps)
    fd = (fp - fm) / (2 * eps)
    an, scale = _fdot(grads, dirs)
    # rounding of f (relative ~1e-14 of sum |out * ct|) divided by 2 eps, plus rtol of the VJP's scale
    tol = rtol * max(scale, 1e-300) + 1e-14 * sp / eps
    assert abs(fd - an) <= tol, (
        f"{block.name}: finite difference {fd!r} vs VJP {an!r}: |diff| = {abs(fd - an):.3e} "
        f"> {tol:.3e}\n--- backward:\n{block.grad(wrt)}"
    )


# ---------------------------------------------------------------------------- examples


@functools.cache
def example(name: str) -> coda_lang.Block:
    return coda_lang.load(EXAMPLES / f"{name}.coda")[name]


def example_dims(name: str) -> dict[str, int]:
    b = example(name)
    dims = DIMS_BY_EXAMPLE.get(name, DIMS)
    return {d.name: d.value if d.value is not None else dims[d.name] for d in b.ir.dims}


def example_inputs(name: str, seed: int = 0, defaults: bool = False) -> dict[str, np.ndarray]:
    """float64 inputs (weights scaled by 1/sqrt(fan-in)); targets with ignored rows (-100) for the CE."""
    b = example(name)
    dims = example_dims(name)
    rng = np.random.default_rng(seed)
    ranges = {p.var.name: dims.get("V", 1) for p in b.ir.params if p.var.type and p.var.type.dtype == "i32"}
    scale = {}
    for st in b.ir.stages:
        if isinstance(st.b, Var) and st.b.type is not None:
            fan_in = st.b.type.shape[1 if st.tb else 0]
            scale[st.b.name] = float(fan_in.evaluate(dims)) ** -0.5
    inputs = gradcheck_inputs(b, dims, ranges, rng, scale=scale)
    if "target" in inputs:
        inputs["target"][::4] = -100
    if defaults:  # give parameters with defaults a value of their own, to differentiate them too
        for p in b.ir.params:
            if p.default is not None:
                inputs[p.var.name] = np.asarray(0.3 if p.var.name == "alpha" else 0.01)
    return inputs


@pytest.mark.parametrize("name", FD_NAMES)
def test_check_vjp_examples(name: str) -> None:
    check_vjp(example(name), example_inputs(name), dims=example_dims(name))


@pytest.mark.parametrize("name", FD_NAMES)
def test_check_vjp_examples_every_float_parameter(name: str) -> None:
    """wrt= every float parameter, those with defaults (eps, alpha) too."""
    b = example(name)
    wrt = [p.var.name for p in b.ir.params if p.var.type and is_float(p.var.type.dtype)]
    check_vjp(b, example_inputs(name, seed=1, defaults=True), dims=example_dims(name), wrt=wrt, seed=1)


@pytest.mark.parametrize("name", GRAD_NAMES)
def test_backward_is_tile_invariant(name: str) -> None:
    b = example(name)
    dims = example_dims(name)
    inputs = example_inputs(name, seed=2)
    rng = np.random.default_rng(2)
    outs = b.run(inputs, dims=dims, precision="f64")
    cts = {k: rng.standard_normal(np.shape(v)) for k, v in outs.items() if np.asarray(v).dtype.kind == "f"}
    whole = b.vjp(inputs, cts, dims=dims, precision="f64")
    for tile in TILES.get(name, DEFAULT_TILES):
        tiled = b.vjp(inputs, cts, dims=dims, precision="f64", sim_tile=tile)
        assert sorted(tiled) == sorted(whole)
        for k in whole:
            err = float(np.max(np.abs(tiled[k] - whole[k]))) if np.size(whole[k]) else 0.0
            assert err <= 1e-12 * max(float(np.max(np.abs(whole[k]))), 1.0), (
                f"{name}: d{k} at tile {tile}: {err:.3e}"
            )


@pytest.mark.parametrize("name", FD_NAMES)
def test_vjp_in_exact_precision_is_close_to_f64(name: str) -> None:
    """The kernel's numerics (bf16 storage of dacc and saved tensors, f32 epilogues) stay close to the
    float64 gradient: within 3% of its largest entry (bf16 rounding is 0.4%). A max reduction's
    backward (amax_fp8) compares its recomputed operand with the forward's maximum for equality, so
    the acc it recomputes from is saved in f32; saved in bf16 no element would match (zero gradient)."""
    b, dims, inputs = example(name), example_dims(name), example_inputs(name, seed=3)
    rng = np.random.default_rng(3)
    outs = b.run(inputs, dims=dims, precision="f64")
    cts = {k: rng.standard_normal(np.shape(v)) for k, v in outs.items() if np.asarray(v).dtype.kind == "f"}
    g64 = b.vjp(inputs, cts, dims=dims, precision="f64")
    g32 = b.vjp(inputs, cts, dims=dims, precision="exact")
    for k in g64:
        got = np.asarray(g32[k], np.float64)
        err = float(np.max(np.abs(got - g64[k])))
        assert err <= 0.03 * float(np.max(np.abs(g64[k]))), f"d{k}: {err:.3e}"


# ---------------------------------------------------------------------------- every op of the registry


def _check_programs(name: str, programs: list[Any]) -> None:
    for k, prog in enumerate(programs):
        block = coda_lang.load(prog.text)[f"op_{name}"]
        dims = {d.name: OP_SIZES[d.name] for d in block.ir.dims}  # a block declares the dims it uses
        try:
            check_vjp(block, prog.inputs(block, np.random.default_rng(k)), dims=dims, seed=k)
        except (AssertionError, coda_lang.CodaError) as e:
            raise AssertionError(f"{prog.label}\n--- program:\n{prog.text}\n{e}") from e


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_check_vjp_each_op(name: str) -> None:
    """Each op in every program op_programs makes: in a stage (at the block's entry, hosted by a dgrad
    GEMM, a partial read by a later stage's epilogue) and between stages."""
    op = REGISTRY[name]
    if not op.differentiable:
        pytest.skip(f"`{op.surface}` is not differentiable (its `differentiable` flag is False)")
    assert op.vjp is not None, (
        f"`{op.surface}` is differentiable but has no VJP rule (`vjp=` in coda_lang/ops/)"
    )
    programs = op_programs(op)
    if op.locality is Locality.VECTOR:  # a computation on whole vectors: between stages only
        assert any("(between)" in p.label for p in programs), f"no program uses `{op.surface}`"
    else:
        assert any("(stage" in p.label for p in programs), f"no program uses `{op.surface}` in a stage"
    _check_programs(name, programs)


def test_op_programs_cover_every_differentiable_op() -> None:
    assert {op.name for op in differentiable_ops()} == {n for n, op in REGISTRY.items() if op.differentiable}
    between = {op.name for op in differentiable_ops() if any("(between)" in p.label for p in op_programs(op))}
    for expected in (
        "add",
        "mul",
        "div",
        "rsqrt",
        "exp",
        "maximum",
        "where",
        "reduce_sum",
        "reduce_logsumexp",
    ):
        assert expected in between, f"`{expected}` is not tested between stages"
    hosted = {op.name for op in differentiable_ops() if any("hosted" in p.label for p in op_programs(op))}
    assert {"pairs", "interleave", "silu", "mul", "where"} <= hosted
    later = {
        op.name
        for op in differentiable_ops()
        if any("used by a later stage" in p.label for p in op_programs(op))
    }
    assert {"reduce_sum", "reduce_max", "reduce_min", "reduce_logsumexp", "pick"} <= later


# ---------------------------------------------------------------------------- torch.autograd


def _leaves(**tensors: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v.detach().double().requires_grad_(True) for k, v in tensors.items()}


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def _compare(what: str, ours: np.ndarray, theirs: torch.Tensor | None, rtol: float = 1e-10) -> None:
    assert theirs is not None, f"torch gives no gradient for {what}"
    want = _np(theirs)
    got = np.asarray(ours, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, torch {want.shape}"
    err, scale = float(np.max(np.abs(got - want))), float(np.max(np.abs(want)))
    assert err <= rtol * max(scale, 1e-30), f"{what}: max|ours - torch| = {err:.3e}, max|torch| = {scale:.3e}"


HD = 4  # head_dim of the RoPE examples here: 2*P = 14 columns, 3 rotated heads and 2 columns (v) left as is


def _rope_setup(width: int, gen: torch.Generator) -> tuple[int, torch.Tensor, torch.Tensor]:
    """rope_width (whole heads), positions, and per-head frequencies [heads, HD/2] in float64."""
    rw = (width // HD) * HD
    pos = torch.randn(DIMS["M"], generator=gen, dtype=torch.float64) * 3
    freq = torch.rand(rw // HD, HD // 2, generator=gen, dtype=torch.float64) + 0.1
    return rw, pos, freq


def _ours_freq(freq: torch.Tensor, pairs: int) -> np.ndarray:
    """Per-head frequencies -> `freq` per column pair of the interleaved layout (0 beyond rope_width)."""
    out = np.zeros(pairs)
    flat = _np(freq).reshape(-1)
    out[: flat.size] = flat
    return out


def _cotangent(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def test_llama_mlp_against_torch_autograd() -> None:
    M, D, F = DIMS["M"], DIMS["D"], DIMS["F"]
    gen = torch.Generator().manual_seed(11)
    p = _leaves(
        y=torch.randn(M, D, generator=gen),
        x=torch.randn(M, D, generator=gen),
        o_proj=torch.randn(D, D, generator=gen) / D**0.5,
        norm=torch.rand(D, generator=gen) + 0.5,
        gate_proj=torch.randn(F, D, generator=gen) / D**0.5,
        up_proj=torch.randn(F, D, generator=gen) / D**0.5,
        down_proj=torch.randn(D, F, generator=gen) / F**0.5,
    )
    x2, _ = ref.llama_mlp(
        p["y"], p["x"], p["o_proj"], p["norm"], p["gate_proj"], p["up_proj"], p["down_proj"]
    )
    ct = _cotangent(gen, M, D)
    (x2 * ct).sum().backward()
    inputs = {
        "y": _np(p["y"]),
        "x": _np(p["x"]),
        "w_o": _np(p["o_proj"]).T,
        "g": _np(p["norm"]),
        "w_13": interleave_gate_up(_np(p["gate_proj"]).T, _np(p["up_proj"]).T),
        "w_2": _np(p["down_proj"]).T,
    }
    g = example("llama_mlp").vjp(inputs, {"x2": _np(ct)}, precision="f64")
    _compare("dy", g["y"], p["y"].grad)
    _compare("dx", g["x"], p["x"].grad)
    _compare("dw_o", g["w_o"].T, p["o_proj"].grad)
    _compare("dg", g["g"], p["norm"].grad)
    dgate, dup = split_gate_up(g["w_13"])
    _compare("dw_13 (gate)", dgate.T, p["gate_proj"].grad)
    _compare("dw_13 (up)", dup.T, p["up_proj"].grad)
    _compare("dw_2", g["w_2"].T, p["down_proj"].grad)


def test_qkv_rope_against_torch_autograd() -> None:
    M, D, P = DIMS["M"], DIMS["D"], DIMS["P"]
    gen = torch.Generator().manual_seed(12)
    rw, pos, freq = _rope_setup(2 * P, gen)
    p = _leaves(
        xg=torch.randn(M, D, generator=gen),
        r=torch.rand(M, generator=gen) + 0.5,
        w_qkv=torch.randn(2 * P, D, generator=gen) / D**0.5,
        pos=pos,
        freq=freq,
    )
    qkv = ref.qkv_rope(p["xg"], p["r"], p["w_qkv"], p["pos"], HD, rw, p["freq"])
    ct = _cotangent(gen, M, 2 * P)
    (qkv * ct).sum().backward()
    inputs = {
        "xg": _np(p["xg"]),
        "r": _np(p["r"]),
        "w_qkv": interleave_rope(_np(p["w_qkv"]).T, HD, rw),
        "pos": _np(p["pos"]),
        "freq": _ours_freq(p["freq"], P),
    }
    b = example("qkv_rope")
    out = b.run(inputs, precision="f64")["qkv"]
    _compare("qkv (forward)", deinterleave_rope(out, HD, rw), qkv)
    g = b.vjp(inputs, {"qkv": interleave_rope(_np(ct), HD, rw)}, precision="f64")
    _compare("dxg", g["xg"], p["xg"].grad)
    _compare("dr", g["r"], p["r"].grad)
    _compare("dw_qkv", deinterleave_rope(g["w_qkv"], HD, rw).T, p["w_qkv"].grad)
    _compare("dpos", g["pos"], p["pos"].grad)
    _compare("dfreq", g["freq"][: rw // 2].reshape(-1, HD // 2), p["freq"].grad)
    _check_unrotated_freq(g["freq"], out, _np(ct), _np(p["pos"]), rw)


def _check_unrotated_freq(
    dfreq: np.ndarray, out: np.ndarray, ct: np.ndarray, pos: np.ndarray, rw: int
) -> None:
    """The pairs past rope_width (v) have frequency 0, so angle 0 (torch's reference does not rotate them):
    their gradient is that of a rotation at angle 0, sum over rows of pos * (x dy - y dx)."""
    x, y = out[:, rw::2], out[:, rw + 1 :: 2]
    dx, dy = ct[:, rw::2], ct[:, rw + 1 :: 2]
    want = (pos[:, None] * (x * dy - y * dx)).sum(axis=0)
    assert np.allclose(dfreq[rw // 2 :], want, rtol=1e-10, atol=1e-12)


def test_lm_head_ce_against_torch_autograd() -> None:
    M, D, V = DIMS["M"], DIMS["D"], DIMS["V"]
    gen = torch.Generator().manual_seed(13)
    p = _leaves(
        hg=torch.randn(M, D, generator=gen),
        r=torch.rand(M, generator=gen) + 0.5,
        w_lm=torch.randn(V, D, generator=gen) / D**0.5,
    )
    target = torch.randint(0, V, (M,), generator=gen, dtype=torch.int32)
    target[::4] = -100
    out = ref.lm_head_ce(p["hg"], p["r"], p["w_lm"], target)
    cts = {k: _cotangent(gen, M) for k in ("loss", "lse")}
    torch.stack([(out[k] * cts[k]).sum() for k in cts]).sum().backward()
    inputs = {"hg": _np(p["hg"]), "r": _np(p["r"]), "w_lm": _np(p["w_lm"]).T, "target": target.numpy()}
    g = example("lm_head_ce").vjp(inputs, {k: _np(v) for k, v in cts.items()}, precision="f64")
    _compare("dhg", g["hg"], p["hg"].grad)
    _compare("dr", g["r"], p["r"].grad)
    _compare("dw_lm", g["w_lm"].T, p["w_lm"].grad)


def test_llama_block_against_torch_autograd() -> None:
    M, D, F, P = DIMS["M"], DIMS["D"], DIMS["F"], DIMS["P"]
    gen = torch.Generator().manual_seed(14)
    rw, pos, freq = _rope_setup(2 * P, gen)
    p = _leaves(
        y=torch.randn(M, D, generator=gen),
        x=torch.randn(M, D, generator=gen),
        o_proj=torch.randn(D, D, generator=gen) / D**0.5,
        norm1=torch.rand(D, generator=gen) + 0.5,
        gate_proj=torch.randn(F, D, generator=gen) / D**0.5,
        up_proj=torch.randn(F, D, generator=gen) / D**0.5,
        down_proj=torch.randn(D, F, generator=gen) / F**0.5,
        norm2=torch.rand(D, generator=gen) + 0.5,
        w_qkv=torch.randn(2 * P, D, generator=gen) / D**0.5,
        pos=pos,
        freq=freq,
    )
    out = ref.llama_block(
        p["y"],
        p["x"],
        p["o_proj"],
        p["norm1"],
        p["gate_proj"],
        p["up_proj"],
        p["down_proj"],
        p["norm2"],
        p["w_qkv"],
        p["pos"],
        HD,
        rw,
        p["freq"],
    )
    cts = {"x2": _cotangent(gen, M, D), "qkv": _cotangent(gen, M, 2 * P)}
    torch.stack([(out[k] * cts[k]).sum() for k in cts]).sum().backward()
    inputs = {
        "y": _np(p["y"]),
        "x": _np(p["x"]),
        "w_o": _np(p["o_proj"]).T,
        "g1": _np(p["norm1"]),
        "w_13": interleave_gate_up(_np(p["gate_proj"]).T, _np(p["up_proj"]).T),
        "w_2": _np(p["down_proj"]).T,
        "g2": _np(p["norm2"]),
        "w_qkv": interleave_rope(_np(p["w_qkv"]).T, HD, rw),
        "pos": _np(p["pos"]),
        "freq": _ours_freq(p["freq"], P),
    }
    b = example("llama_block")
    ours_ct = {"x2": _np(cts["x2"]), "qkv": interleave_rope(_np(cts["qkv"]), HD, rw)}
    ours = b.run(inputs, precision="f64")
    for k in ("x2", "qkv"):
        plain = deinterleave_rope(ours[k], HD, rw) if k == "qkv" else ours[k]
        _compare(f"{k} (forward)", plain, out[k])
    g = b.vjp(inputs, ours_ct, precision="f64")
    assert sorted(g) == sorted(inputs)
    for name, theirs in [("y", "y"), ("x", "x"), ("g1", "norm1"), ("g2", "norm2"), ("pos", "pos")]:
        _compare(f"d{name}", g[name], p[theirs].grad)
    _compare("dw_o", g["w_o"].T, p["o_proj"].grad)
    dgate, dup = split_gate_up(g["w_13"])
    _compare("dw_13 (gate)", dgate.T, p["gate_proj"].grad)
    _compare("dw_13 (up)", dup.T, p["up_proj"].grad)
    _compare("dw_2", g["w_2"].T, p["down_proj"].grad)
    _compare("dw_qkv", deinterleave_rope(g["w_qkv"], HD, rw).T, p["w_qkv"].grad)
    _compare("dfreq", g["freq"][: rw // 2].reshape(-1, HD // 2), p["freq"].grad)
    _check_unrotated_freq(g["freq"], ours["qkv"], ours_ct["qkv"], inputs["pos"], rw)


# ---------------------------------------------------------------------------- the theorem, as a property


def _forward_case(fwd: Forward, seed: int) -> tuple[coda_lang.Block, dict[str, np.ndarray]]:
    block = fwd.block
    inputs = fwd.inputs(np.random.default_rng(seed))
    outs = block.run(inputs, dims=fwd.dims, precision="f64")
    # exp of exp of ... may overflow: such draws are not about autodiff
    assume(all(np.all(np.isfinite(v)) and np.all(np.abs(v) < 1e6) for v in outs.values()))
    return block, inputs


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(forward_blocks())
def test_random_block_local_forwards_have_checked_backwards(fwd: Forward) -> None:
    block = fwd.block
    d = block.derivation()  # CodaError here (E0601: the backward does not check) fails the test
    text = str(d.backward)
    again = coda_lang.load(text)[d.backward.name]  # the printed backward is valid source
    assert again.ir == d.backward.ir, text
    assert len(again.plan.stages) == len(d.backward.plan.stages)
    _between_only_vectors(d.backward)


@settings(max_examples=100, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(forward_blocks())
def test_random_block_local_forwards_check_vjp(fwd: Forward) -> None:
    block, inputs = _forward_case(fwd, 0)
    try:
        check_vjp(block, inputs, dims=fwd.dims)
    except AssertionError as e:
        raise AssertionError(f"{e}\n--- forward:\n{fwd.text}") from e


# ---------------------------------------------------------------------------- the paper's backward schedule


def _between_only_vectors(backward: coda_lang.Block) -> None:
    """Between stages only vectors and scalars are computed (a matrix alias `dx = dacc1` is no computation)."""
    for eqns in backward.plan.between:
        for e in eqns:
            for v in e.outs:
                assert v.type is not None
                alias = e.op == "copy" and v.type.kind == MATRIX
                assert v.type.kind in (VEC, SCALAR) or alias, (
                    f"`{v.name}` ({v.type}) is computed between stages"
                )


def _ops(stage: Stage) -> list[str]:
    return [e.op for e in stage.body]


def _reads(stage: Stage) -> set[str]:
    return {a.name for e in stage.body for a in e.ins if hasattr(a, "name")}


def test_llama_block_backward_follows_the_paper_schedule() -> None:
    fwd = example("llama_block")
    d = fwd.derivation(None, "save")  # the paper's schedule reads every tile the forward stores
    bwd = d.backward
    stages = bwd.ir.stages
    cotangents = set(d.cotangents.values())
    # exactly one elementwise stage, the first: the RoPE backward at the block's entry
    elementwise = [k for k, s in enumerate(stages) if not s.is_gemm]
    assert elementwise == [0], [str(s.shape) for s in stages]
    entry = stages[0]
    assert {"pairs", "interleave", "sin", "cos"} <= set(_ops(entry))
    assert "reduce_sum" in _ops(entry), "the entry stage makes the row statistic (ZdZ) of the second norm"
    assert d.report and "elementwise" in d.report[0] and "qkv" in d.report[0]
    gemms = stages[1:]
    wgrad = [s for s in gemms if s.ta]
    dgrad = [s for s in gemms if not s.ta]
    # one wgrad GEMM per weight: transpose(the forward GEMM's saved left operand) @ dacc
    assert sorted(getattr(s.a, "name", "") for s in wgrad) == ["a", "x1g", "x2g", "y"]
    for s in wgrad:
        assert getattr(s.b, "name", "") in cotangents | _stored(bwd), "wgrad's right operand is a dacc"
    # dgrad GEMMs dacc @ transpose(W), in the paper's order: QKV, down-proj, gate/up, out-proj
    assert [getattr(s.b, "name", None) for s in dgrad] == ["w_qkv", "w_2", "w_13", "w_o"]
    assert all(s.tb and not s.ta for s in dgrad)
    by_weight = {getattr(s.b, "name", None): s for s in dgrad}
    # SwiGLU backward in the down-projection's dgrad epilogue, with the ZdZ partial for the first norm
    swiglu = by_weight["w_2"]
    assert {"sigmoid", "interleave", "pairs"} <= set(_ops(swiglu))
    assert _partial_row_sums(swiglu), "the SwiGLU backward makes the row statistic of the first norm"
    # the norm backward (row scale cotangent, norm weight gradient) in the dgrad epilogues of the
    # GEMMs that read the normalized tiles: w_qkv's (second norm) and w_13's (first norm)
    for w, h, g in (("w_qkv", "x2", "g2"), ("w_13", "x1", "g1")):
        s = by_weight[w]
        assert {h, g} <= _reads(s), f"the norm backward in the dgrad of {w} reads {h} and {g}"
        assert any(
            e.op == "reduce_sum" and e.param("over") is not None and str(e.param("over")) == "M"
            for e in s.body
        ), f"dgrad of {w}: the norm weight's gradient is a partial column sum"
    # residual accumulation: a dgrad epilogue loads another cotangent tile and adds it
    residual = [
        s
        for s in dgrad
        if any(
            e.op == "add"
            and any(
                getattr(a, "name", None) in cotangents | _stored(bwd) and _is_matrix(bwd, a) for a in e.ins
            )
            for e in s.body
        )
    ]
    assert residual, "no dgrad epilogue accumulates the residual stream's cotangent"
    assert "dx2" in _reads(by_weight["w_qkv"]), "x2's own cotangent adds in the dgrad epilogue of QKV"
    # the row statistics are completed between stages (one run per norm): only vector computations there
    _between_only_vectors(bwd)
    runs = [
        eqns for eqns in bwd.plan.between if any(e.outs[0].type and e.outs[0].type.kind == VEC for e in eqns)
    ]
    assert len(runs) == 2, runs


def _stored(bwd: coda_lang.Block) -> set[str]:
    return {v.name for s in bwd.ir.stages for e in s.body for v in e.outs if v.annot}


def _is_matrix(bwd: coda_lang.Block, a: Any) -> bool:
    name = getattr(a, "name", None)
    for p in bwd.ir.params:
        if p.var.name == name:
            return p.var.type is not None and len(p.var.type.shape) == 2
    return name in _stored(bwd)


def _partial_row_sums(stage: Stage) -> list[Eqn]:
    return [
        e
        for e in stage.body
        if e.op == "reduce_sum"
        and e.outs[0].type is not None
        and e.outs[0].type.kind == "partial"
        and stage.acc is not None
        and stage.acc.type is not None
        and e.outs[0].type.shape == (stage.acc.type.shape[0],)
    ]


# ---------------------------------------------------------------------------- saved tensors


@pytest.mark.parametrize("name", GRAD_NAMES)
def test_saved_tensors(name: str) -> None:
    b = example(name)
    d = b.derivation()
    fwd_outs = [o.name for o in d.forward.ir.outputs]
    assert fwd_outs[: len(b.ir.outputs)] == [o.name for o in b.ir.outputs], (
        "the forward's own outputs come first"
    )
    assert set(d.saved) <= set(fwd_outs), "the extended forward stores every saved tensor"
    assert len(set(d.saved)) == len(d.saved)
    bwd_params = [p.var.name for p in d.backward.ir.params]
    forward_params = {p.var.name for p in b.ir.params}
    read = _read_names(d.backward)
    expected = set(d.cotangents.values()) | set(d.saved) | (forward_params & read)
    assert set(bwd_params) == expected, f"backward params {bwd_params}, expected {sorted(expected)}"
    assert set(d.saved) <= read, "every saved tensor is read by the backward"
    assert not (set(d.saved) & forward_params), "a forward parameter is read directly, not saved"
    extra = [o.name for o in d.forward.ir.outputs][len(b.ir.outputs) :]
    assert set(extra) <= set(d.saved)
    notes = "\n".join(d.backward.ir.notes)
    assert "saved" in notes and all(s in notes for s in d.saved), (
        "the printed backward says which tensors are saved"
    )
    # the extended forward computes the same outputs as the forward
    inputs, dims = example_inputs(name, seed=4), example_dims(name)
    got, want = d.forward.run(inputs, dims=dims, precision="f64"), b.run(inputs, dims=dims, precision="f64")
    for k in want:
        assert np.array_equal(got[k], want[k])


def _read_names(block: coda_lang.Block) -> set[str]:
    names = set()
    for s in block.ir.body:
        if isinstance(s, Stage):
            names |= {a.name for a in (s.a, s.b) if a is not None and hasattr(a, "name")}
            eqns: tuple[Eqn, ...] = s.body
        else:
            eqns = (s,)
        for e in eqns:
            names |= {a.name for a in e.ins if hasattr(a, "name")}
    return names


def test_llama_block_saves_what_the_paper_saves() -> None:
    """The paper's schedule (docs/design.md, "Where the backward runs") saves y0, x1, x2, r1, r2, Z1, qkv: here the stored tiles and row scales
    (x1, x1g, x2, x2g, a, r1, r2) and the pre-activations of the stages that need them (acc2, acc4),
    no tile that the backward could not load in its epilogues."""
    d = example("llama_block").derivation()
    assert {"x1", "x2", "r1", "r2"} <= set(d.saved)
    for name in d.saved:
        t = next(o.type for o in d.forward.ir.outputs if o.name == name)
        assert t.kind in (MATRIX, VEC) and len(t.shape) in (1, 2)


# ---------------------------------------------------------------------------- golden `coda grad` output


@pytest.mark.parametrize("name", ["llama_mlp", "llama_block"])
def test_golden_grad(name: str, update_golden: bool) -> None:
    got = coda("grad", f"examples/{name}.coda")
    assert got.returncode == 0, got.stderr
    golden(GOLDEN / f"{name}.coda", got.stdout, update_golden)
    coda_lang.load(got.stdout)  # the golden backward checks


# ---------------------------------------------------------------------------- programs autodiff refuses

BAD_GRAD = sorted((ROOT / "tests" / "bad_grad").glob("*.coda"))
WRT = re.compile(r"^#\s*wrt:\s*(.*)$", re.M)
EXPECT = re.compile(r"#\s*E:\s*((?:E\d{4}\s*)+)$")
# Programs of tests/bad_grad/ that autodiff gets wrong today (strict xfail: remove when fixed).
BAD_GRAD_BUGS: dict[str, str] = {}


def _bad_grad_params() -> list[Any]:
    return [
        pytest.param(
            p,
            id=p.stem,
            marks=[pytest.mark.xfail(strict=True, reason=BAD_GRAD_BUGS[p.stem])]
            if p.stem in BAD_GRAD_BUGS
            else [],
        )
        for p in BAD_GRAD
    ]


def test_bad_grad_corpus() -> None:
    assert len(BAD_GRAD) >= 3
    for path in BAD_GRAD:
        text = path.read_text()
        assert text.startswith("# "), (
            f"{path.name} should open with a comment saying why it can't be differentiated"
        )
        assert any(EXPECT.search(ln) for ln in text.splitlines()), (
            f"{path.name} has no `# E: ...` expectation"
        )


@pytest.mark.parametrize("path", _bad_grad_params())
def test_bad_grad(path: Path) -> None:
    """Each program checks, and Block.grad (with the `# wrt:` of the file, if any) raises CodaError with
    exactly the codes written inline, on those lines."""
    text = path.read_text()
    program = coda_lang.load(path)  # it checks: only autodiff refuses it
    (block,) = list(program)
    m = WRT.search(text)
    wrt = [w.strip() for w in m.group(1).split(",")] if m else None
    expected = {
        (n, code)
        for n, line in enumerate(text.splitlines(), 1)
        if (e := EXPECT.search(line))
        for code in e.group(1).split()
    }
    with pytest.raises(coda_lang.CodaError) as info:
        block.grad(wrt)
    got = {(d.span.line if d.span else 0, d.code) for d in info.value.diagnostics}
    assert got == expected, f"{path.name}: got {sorted(got)}, expected {sorted(expected)}\n{info.value}"
    for d in info.value.diagnostics:
        assert d.code in CODES and d.code.startswith("E06")


def test_grad_wrt_errors_through_the_api() -> None:
    """A name that is no parameter is an argument mistake (ValueError, test_arguments.py); an i32
    parameter, which the program gives no gradient, is the program's E0602."""
    b = example("llama_mlp")
    with pytest.raises(ValueError, match="`nope`"):
        b.grad(["w_2", "nope"])
    with pytest.raises(coda_lang.CodaError) as info:
        example("lm_head_ce").vjp({}, {}, wrt=["target"])
    assert [d.code for d in info.value.diagnostics] == ["E0602"]


# ---------------------------------------------------------------------------- regressions
# Minimal reproductions of what autodiff once got wrong (BUG n: silently wrong gradients, E0601 or
# E0602 where the program is differentiable), each checked against finite differences.


def _fwd(text: str) -> coda_lang.Block:
    (block,) = list(coda_lang.load(text))
    return block


def _check_random(
    block: coda_lang.Block,
    dims: dict[str, int],
    positive: frozenset[str] = frozenset(),
    tiles: tuple[tuple[int, int], ...] = ((2, 4), (3, 2)),
) -> None:
    """check_vjp, the printed backward loads back as the same block, and (each tile) the tile
    simulation of Block.vjp equals the whole-matrix one."""
    rng = np.random.default_rng(0)
    ranges = {p.var.name: 3 for p in block.ir.params if p.var.type and p.var.type.dtype == "i32"}
    dims = {d.name: d.value if d.value is not None else dims[d.name] for d in block.ir.dims}
    inputs = gradcheck_inputs(block, dims, ranges, rng, positive)
    check_vjp(block, inputs, dims=dims)
    g = block.grad()
    assert coda_lang.load(str(g))[g.name].ir == g.ir
    outs = block.run(inputs, dims=dims, precision="f64")
    cts = {k: rng.standard_normal(np.shape(v)) for k, v in outs.items() if np.asarray(v).dtype.kind == "f"}
    whole = block.vjp(inputs, cts, dims=dims, precision="f64")
    for tile in tiles:
        tiled = block.vjp(inputs, cts, dims=dims, precision="f64", sim_tile=tile)
        for k in whole:
            err = float(np.max(np.abs(tiled[k] - whole[k]))) if np.size(whole[k]) else 0.0
            assert err <= 1e-12 * max(float(np.max(np.abs(whole[k]))), 1.0), f"d{k} at tile {tile}: {err:.3e}"


def test_index_in_a_stage() -> None:
    """BUG 1: row_index()/col_index() in a stage were recomputed between stages (E0601)."""
    b = _fwd(
        "dims M, K, N\nblock f(x: f32[M, K], w: f32[K, N]) -> (o: f32[M, N]) {\n"
        "  gemm x @ w {\n    o = where(col_index() < 3, acc * acc, acc)\n  }\n}\n"
    )
    _check_random(b, {"M": 5, "K": 3, "N": 7})


def test_index_vector_with_a_cotangent() -> None:
    """An index-dependent float vector in a stage is recomputed in the site, and its cotangent (of the
    tile it is broadcast to) reaches the scalar it is made with."""
    b = _fwd(
        "dims M, K, N\nblock f(x: f32[M, K], w: f32[K, N], s: f32) -> (o: f32[M, N]) {\n"
        "  gemm x @ w {\n    v = cast(col_index(), f32) * s\n    o = acc * v\n  }\n}\n"
    )
    _check_random(b, {"M": 5, "K": 3, "N": 7})


def test_partial_read_by_a_later_stage() -> None:
    """BUG 2 (was a silently wrong gradient): a partial reduction read by a later stage's epilogue had
    its cotangent summed to a scalar."""
    b = _fwd(
        "dims M, K, N\nblock f(x: f32[M, K], w: f32[K, N]) -> (o: f32[M, N]) {\n"
        "  gemm x @ w {\n    s = sum(acc, over=N)\n  }\n  gemm x @ w {\n    o = acc * s\n  }\n}\n"
    )
    _check_random(b, {"M": 5, "K": 3, "N": 4})
    assert "acc1" not in b.derivation().saved, "no tensor is saved just for its shape"


def test_backward_declares_only_the_dims_it_uses() -> None:
    """BUG 3: the backward declared dims only the forward uses, so its printed source loaded back with
    other dims, and Block.vjp with the forward's dims failed."""
    b = _fwd(
        "dims M, K, N, F\nblock f(x: f32[M, K], w: f32[K, F]) -> (o: f32[M, F]) {\n"
        "  gemm x @ w {\n    o = acc * 2.0\n    u = acc * N\n  }\n}\n"
    )
    g = b.grad()
    assert [d.name for d in g.ir.dims] == ["M", "K", "F"]
    again = coda_lang.load(str(g))[g.name]
    assert again.ir == g.ir
    _check_random(b, {"M": 5, "K": 3, "N": 2, "F": 4})


@pytest.mark.parametrize(
    "text",
    [
        # bf16 GEMM, f32 output (and the other way round)
        "dims M, K, N\nblock f(x: bf16[M, K], w: bf16[K, N]) -> (o: f32[M, N]) {\n  gemm x @ w {\n    o = acc\n  }\n}\n",
        "dims M, K, N\nblock f(x: f32[M, K], w: f32[K, N]) -> (o: bf16[M, N]) {\n  gemm x @ w {\n    o = acc\n  }\n}\n",
        # all bf16: a GEMM output read by a later stage's epilogue; its cotangent is stored as `dy: f32`
        "dims M, K, N\nblock f(x: bf16[M, K], w: bf16[K, N], z: bf16[M, K], w2: bf16[K, N]) -> (o: bf16[M, N]) {\n"
        "  gemm x @ w {\n    y = acc\n  }\n  gemm z @ w2 {\n    o = acc + y * y\n  }\n}\n",
        # f32 GEMM, bf16 residual input: its gradient (bf16) is the stage's dacc
        "dims M, K, N\nblock f(x: f32[M, K], w: f32[K, N], p: bf16[M, N]) -> (o: f32[M, N]) {\n"
        "  gemm x @ w {\n    v: f32 = acc + p\n  }\n  gemm x @ w {\n    o = v * v\n  }\n}\n",
    ],
    ids=[
        "bf16-gemm-f32-output",
        "f32-gemm-bf16-output",
        "f32-cotangent-of-a-bf16-tile",
        "bf16-residual-of-an-f32-gemm",
    ],
)
def test_cotangent_dtype_differs_from_the_gemm_operands(text: str) -> None:
    """BUG 4: a cotangent of another dtype than the GEMM operands (an output's, or an f32 `d<name>` from
    a later epilogue) was used as a dgrad/wgrad operand as it was (E0305)."""
    _check_random(_fwd(text), {"M": 5, "K": 3, "N": 4})


@pytest.mark.parametrize("op", ["sum", "max", "logsumexp"])
def test_grouped_reduction_stored(op: str) -> None:
    """BUG 5: a grouped reduction read after its stage (an output, a GEMM operand, a later epilogue):
    its cotangent, one column per group, was never broadcast back over the groups."""
    b = _fwd(
        f"dims M, K, N, P\nblock f(x: f32[M, K], w: f32[K, 2*N], w2: f32[N, P], w3: f32[K, N]) -> "
        f"(m: f32[M, N], o: f32[M, P], o2: f32[M, N]) {{\n"
        f"  gemm x @ w {{\n    m = {op}(acc, over=2*N, group=2)\n  }}\n"
        f"  gemm m @ w2 {{\n    o = acc\n  }}\n  gemm x @ w3 {{\n    o2 = acc * m\n  }}\n}}\n"
    )
    _check_random(b, {"M": 5, "K": 3, "N": 4, "P": 3})


@pytest.mark.parametrize(
    "extra, body, out",
    [
        ("r: f32[M]", "s = sum(acc + r, over=N)", "s: f32[M]"),  # was a wrong gradient, silently
        ("a: f32", "s = sum(acc - a, over=N)", "s: f32[M]"),  # was E0602 "can't reduce the cotangent"
        ("c: f32[N]", "s = sum(acc + c, over=N)", "s: f32[M]"),  # was E0601
        ("", "gt, up = pairs(acc)\n    s = sum(gt, over=N)", "s: f32[M]"),  # was E0601
        ("c: f32[N]", "s = sum(acc * c, over=M)\n    t = sum(acc + c, over=M)", "s: f32[N], t: f32[N]"),
        (
            "r: f32[M], a: f32",
            "s = sum((acc + r) * r - a, over=N)\n    t = sum(acc, over=N)",
            "s: f32[M], t: f32[M]",
        ),
    ],
    ids=["row-vector", "scalar", "column-vector", "pair-half", "over-rows", "vector-of-vectors"],
)
def test_sum_of_a_broadcast(extra: str, body: str, out: str) -> None:
    """BUG 6: sum()'s cotangent was passed on as a vector, unexpanded, through linear ops: a row vector
    or scalar added to the summed tile got it once instead of once per column (d/dr sum(acc + r, over=N)
    is N, not 1)."""
    w = "2*N" if "pairs" in body else "N"
    sep = ", " if extra else ""
    b = _fwd(
        f"dims M, K, N\nblock f(x: f32[M, K], w: f32[K, {w}]{sep}{extra}) -> ({out}) {{\n"
        f"  gemm x @ w {{\n    {body}\n  }}\n}}\n"
    )
    _check_random(b, {"M": 5, "K": 3, "N": 4})


def test_sum_of_a_broadcast_between_stages() -> None:
    """The same between stages: a scalar added to a vector that is summed gets the vector's length."""
    b = _fwd(
        "dims M, K, N\nblock f(x: f32[M, K], w: f32[K, N], a: f32) -> (t: f32) {\n"
        "  gemm x @ w {\n    s = sum(acc, over=N)\n  }\n  t = sum(s + a, over=M)\n}\n"
    )
    _check_random(b, {"M": 5, "K": 3, "N": 4})


@pytest.mark.parametrize(
    "text",
    [
        "dims M, K, F\nblock f(x: f32[M, K], w: f32[K, 2*F], i: i32[M]) -> (t: f32[M]) {\n"
        "  gemm x @ w {\n    gt, up = pairs(acc)\n    t = pick(up, i)\n  }\n}\n",
        "dims M, K, F, P\nblock f(x: f32[M, K], w: f32[K, 2*F], i: i32[M], w2: f32[F, P]) -> (t: f32[M], o: f32[M, P]) {\n"
        "  gemm x @ w {\n    t = pick(acc, i)\n    gt, up = pairs(acc)\n    a = silu(gt) * up\n  }\n"
        "  gemm a @ w2 {\n    o = acc\n  }\n}\n",
        "dims M, K, F\nblock f(x: f32[M, K], w: f32[K, F], i: i32[M]) -> (t: f32[M]) {\n"
        "  gemm x @ w {\n    t = pick(interleave(acc, sin(acc)), i)\n  }\n}\n",
    ],
    ids=["half-width-tile", "stage-hosted-at-half-width", "double-width-tile"],
)
def test_pick_at_another_width(text: str) -> None:
    """BUG 7: pick()'s VJP compared the stage's col_index() with the index, wrong for a tile narrower or
    wider than the stage, or when the stage's backward runs in a dgrad GEMM of another width."""
    _check_random(_fwd(text), {"M": 5, "K": 3, "F": 4, "P": 3})


@pytest.mark.parametrize(
    "text",
    [
        # the double-width tile is the operand of the host GEMM
        "dims M, K, N, P\nblock f(x: f32[M, K], w: f32[K, 2*N], w2: f32[4*N, P]) -> (o: f32[M, P], u: f32[M, N]) {\n"
        "  gemm x @ w {\n    v, u = pairs(acc)\n    h = interleave(sin(acc), acc)\n  }\n"
        "  gemm h @ w2 {\n    o = acc\n  }\n}\n",
        # SwiGLU's half-width output hosts the stage, which also outputs a double-width tile
        "dims M, K, N, P\nblock f(x: f32[M, K], w: f32[K, 2*N], w2: f32[N, P]) -> (o: f32[M, P], d: f32[M, 4*N]) {\n"
        "  gemm x @ w {\n    gt, up = pairs(acc)\n    a = silu(gt) * up\n    d = interleave(acc, acc)\n  }\n"
        "  gemm a @ w2 {\n    o = acc\n  }\n}\n",
    ],
    ids=["operand", "half-width-host"],
)
def test_double_width_tile_in_a_stage_hosted_at_another_width(text: str) -> None:
    """BUG 8: a stage whose backward was hosted by a GEMM of another width than one of its tiles (E0601).
    No GEMM's tile space holds every tile here, so the backward runs as an elementwise stage."""
    b = _fwd(text)
    _check_random(b, {"M": 5, "K": 3, "N": 2, "P": 3})
    assert any("elementwise stage" in r for r in b.derivation().report)


def test_reduction_ties() -> None:
    """BUG 9 (was a silently wrong gradient): max/min reductions gave the whole cotangent to every tied
    element; JAX and torch split it, so a tie of N columns got N times the gradient."""
    b = _fwd(
        "dims M, K, N\nblock f(x: f32[M, K], w: f32[K, N], r: f32[M]) -> (m: f32[M]) {\n"
        "  gemm x @ w {\n    m = max(where(acc > 100.0, acc, r), over=N)\n  }\n}\n"
    )
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((3, 2)), "w": rng.standard_normal((2, 4)), "r": rng.standard_normal(3)}
    g = b.vjp(inputs, {"m": np.ones(3)}, precision="f64")
    assert np.allclose(g["r"], 1.0), g["r"]  # m == r exactly
    assert np.allclose(b.vjp(inputs, {"m": np.ones(3)}, precision="f64", sim_tile=(2, 3))["r"], 1.0)
    assert any("ties" in r for r in b.derivation().report)


@pytest.mark.parametrize(
    "text, want",
    [
        # ties within groups (complete in a tile) and between stages (complete vectors)
        (
            "dims M, K, N\nblock f(x: f32[M, K], w: f32[K, 2*N], r: f32[M]) -> (m: f32[M, N]) {\n"
            "  gemm x @ w {\n    m = min(where(acc > 100.0, acc, r), over=2*N, group=2)\n  }\n}\n",
            4.0,
        ),  # N groups
        (
            "dims M, K, N\nblock f(x: f32[M, K], w: f32[K, N], s: f32) -> (m: f32) {\n"
            "  gemm x @ w {\n    v = sum(acc * 0.0, over=N)\n  }\n  m = max(v + s, over=M)\n}\n",
            1.0,
        ),
    ],
    ids=["group", "between-stages"],
)
def test_reduction_ties_complete_in_place(text: str, want: float) -> None:
    b = _fwd(text)
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((3, 2)), "r": rng.standard_normal(3), "s": np.asarray(0.5)}
    inputs["w"] = rng.standard_normal((2, 8 if "2*N" in text else 4))
    inputs = {p.var.name: inputs[p.var.name] for p in b.ir.params}
    outs = b.run(inputs, precision="f64")
    g = b.vjp(inputs, {k: np.ones(np.shape(v)) for k, v in outs.items()}, precision="f64")
    got = g["r"] if "r" in g else g["s"]
    assert np.allclose(got, want), got
    assert not any("ties" in r for r in b.derivation().report), "no stage to count the ties"


def test_square_double_width_tile() -> None:
    """BUG 10: a scalar broadcast into a square tile (a stage of 2*N rows and N columns, interleaved;
    a half-width tile of a stage of N rows and 2*N columns): `sum() over 2*N is ambiguous` (E0601)."""
    b = _fwd(
        "dims K, N\nblock f(x: f32[K, 2*N], w: f32[K, N], w2: f32[K, 2*N], s: f32, t: f32) -> "
        "(o: f32[2*N, 2*N], o2: f32[N, N]) {\n"
        "  gemm transpose(x) @ w {\n    v = interleave(acc, acc * acc)\n    o = s + v\n  }\n"
        "  gemm transpose(w) @ w2 {\n    a, c = pairs(acc)\n    o2 = a * t\n  }\n}\n"
    )
    _check_random(b, {"K": 3, "N": 2})


@pytest.mark.parametrize("extra, name", [("r: f32[M]", "r"), ("s: f32", "s")])
def test_vector_at_two_widths(extra: str, name: str) -> None:
    """BUG 12: a row vector or scalar used at two tile widths in one stage (before and after pairs): its
    two cotangent tiles were added as they were (E0601)."""
    b = _fwd(
        f"dims M, K, F\nblock f(x: f32[M, K], w: f32[K, 2*F], {extra}) -> (a: f32[M, F]) {{\n"
        f"  gemm x @ w {{\n    z = acc * {name}\n    gt, up = pairs(z)\n    a = silu(gt) * up * {name}\n  }}\n}}\n"
    )
    _check_random(b, {"M": 5, "K": 3, "F": 4})


@settings(max_examples=100, suppress_health_check=list(HealthCheck))
@given(forward_blocks(known_bugs=True))
def test_random_forwards_with_every_feature(fwd: Forward) -> None:
    """forward_blocks(known_bugs=True) also draws what autodiff refuses: E0602 is the only error."""
    block, inputs = _forward_case(fwd, 0)
    try:
        d = block.derivation()
    except coda_lang.CodaError as e:
        assert [x.code for x in e.diagnostics] == ["E0602"], str(e)
        return
    coda_lang.load(str(d.backward))
    check_vjp(block, inputs, dims=fwd.dims)


@pytest.mark.parametrize("w9", ["f32[N, K]", "f32[N, N]"], ids=["rectangular", "square"])
def test_weight_no_output_depends_on(w9: str) -> None:
    """A weight whose GEMM's result is never used gets zeros, written by an elementwise stage (made from
    the index vectors; in a square stage, where they don't make a tile, from the weight's shape)."""
    k = "N" if w9 == "f32[N, N]" else "K"
    b = _fwd(
        f"dims M, K, N\nblock f(x: f32[M, K], w: f32[K, N], w9: {w9}) -> (o: f32[M, N]) {{\n"
        f"  gemm x @ w {{\n    o = acc\n  }}\n  gemm o @ w9 {{\n    u = acc * 2.0\n  }}\n}}\n"
    )
    assert k in str(b.ir.params[2].var.type)
    _check_random(b, {"M": 5, "K": 3, "N": 4})
    inputs = gradcheck_inputs(b, {"M": 5, "K": 3, "N": 4}, {}, np.random.default_rng(0))
    g = b.vjp(inputs, {"o": np.ones((5, 4))}, precision="f64")
    assert np.array_equal(g["w9"], np.zeros_like(inputs["w9"]))
    assert any("is zero" in r for r in b.derivation().report)


def test_a_recomputed_copy_of_a_saved_tile_gets_its_own_name() -> None:
    """A max's ties are counted on the f32 value recomputed from its inputs (one IEEE operation of a
    load: every kernel computes it the same), while a later stage reads the stored tile as a saved
    tensor: the two must not share a name (the printed backward used to define `v5` twice and did not
    load; found by the drawn-program test)."""
    text = """dims M, K, N

block fwd(x1: f32[K, M], w2: f32[2*N, K], p3: f32[M, 2*N], w9: f32[N, M]) -> (v7: f32[2*N], v16: f32[2*N, N]) {
  gemm transpose(x1) @ transpose(w2) {
    v5 = p3 * p3
    v7: f32 = max(v5, over=M)
  }
  gemm transpose(v5) @ transpose(w9) {
    v16: f32 = acc
  }
}
"""
    block = coda_lang.load(text)["fwd"]
    bwd = block.grad(remat="save")  # the saved v5 beside its recomputed copy
    printed = str(bwd)
    assert coda_lang.load(printed)[bwd.name].ir == bwd.ir  # loads, and means the same
    assert [p.var.name for p in bwd.ir.params].count("v5") == 1 and "v5_2 = p3 * p3" in printed
    rng = np.random.default_rng(0)
    sizes = {"M": 3, "K": 2, "N": 2}
    ins = {
        "x1": rng.standard_normal((2, 3)),
        "w2": rng.standard_normal((4, 2)),
        "p3": rng.standard_normal((3, 4)),
        "w9": rng.standard_normal((2, 3)),
    }
    check_vjp(block, ins, dims=sizes)


def test_an_f32_blocks_saved_accumulator_stays_f32_when_its_first_gemm_reads_fp8_copies() -> None:
    """The dtype a block stores and saves its unannotated tiles in is its first GEMM's parameter
    operand's; where both operands are fp8 copies made in the block (`xq: e4m3 = x * s`), it is what
    they are made from (x: f32 here). It was bf16, which rounded an f32 model's saved accumulator (the
    SwiGLU's, read again by the backward) and moved its gradients a percent from float64 (an fp8
    out-projection, tests/test_hf_fp8.py, found it). A bf16 block is unchanged."""
    for t in ("f32", "bf16"):
        src = f"""
dims M, K, N
block b(x: {t}[M, K], w: {t}[2*N, K], s: f32) -> (y: {t}[M, N]) {{
  elementwise [M, K] {{
    xq: e4m3 = x * s
  }}
  elementwise [2*N, K] {{
    wq: e4m3 = w * s
  }}
  gemm xq @ transpose(wq) {{
    g, u = pairs(acc * (1.0 / (s * s)))
    y = silu(g) * u
  }}
}}
"""
        blk = coda_lang.load(src)["b"]
        d = blk.derivation(["x", "w"])
        accs = [p.var for p in d.backward.ir.params if p.var.name.startswith("acc")]
        assert accs and all(v.type is not None and v.type.dtype == t for v in accs), (t, accs)
