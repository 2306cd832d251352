"""Every example block against an independent torch (CPU) reference of the ordinary, unfused math.

Each case builds a small checkpoint in the ordinary layouts (torch `nn.Linear` weights [out, in],
gate and up separate, rotate-half RoPE heads), converts it with `coda_lang.layout`, runs the block
with the reference interpreter, and compares with torch code written the way a model would be.
Accuracy rule (docs/design.md, "Accuracy"), per output: ref64 is the torch reference in float64 and ref16
the same code run the ordinary way in bfloat16, both from the same bf16-valued inputs; then
    max|ours - ref64| <= 2 * max|ref16 - ref64| + 1e-6
for `Block.run(precision="exact")`, whole and tiled (ragged tiles in both directions). The "f64"
precision never rounds, so it must agree with ref64 to 1e-12 relative (measured: ~1e-15).
qk_norm's program reduces groups of 128 columns, so its heads are 128 wide (the others use 16).
The torch references themselves live in tests/torch_refs.py (shared with the gradient tests).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import test_examples_ce as ce
import torch
import torch.nn.functional as F
import torch_refs as ref
from support import QUANTIZED_EXAMPLES
from torch_refs import BASE, inv_freq

import coda_lang
from coda_lang.layout import deinterleave_rope, interleave_gate_up, interleave_rope, rope_freq

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
M, D, F_MLP, V = 96, 64, 80, 200  # F even, not a multiple of any tile; V ragged too
HEAD_DIM, HQ, HKV = 16, 4, 2  # fused QKV: 4 q heads, 2 k heads, 2 v heads of 16
QK_HEAD_DIM, QK_HEADS = 128, 2  # qk_norm.coda groups 128 columns
TILE = (40, 48)  # 96 rows -> 40 + 40 + 16; columns ragged in every stage


# ---------------------------------------------------------------------------- the accuracy rule


def max_abs(a: np.ndarray) -> float:
    return float(np.max(np.abs(a))) if a.size else 0.0


def check_rule(what: str, ours: np.ndarray, ref64: torch.Tensor, ref16: torch.Tensor) -> float:
    """The accuracy rule (docs/design.md, "Accuracy"): max|ours - ref64| <= 2 max|ref16 - ref64| + 1e-6; returns the error ratio."""
    r64 = ref64.detach().double().numpy()
    r16 = ref16.detach().double().numpy()
    got = np.asarray(ours).astype(np.float64)
    assert got.shape == r64.shape, f"{what}: shape {got.shape}, reference {r64.shape}"
    err, base = max_abs(got - r64), max_abs(r16 - r64)
    ratio = err / base if base else float("inf") if err else 0.0
    print(f"{what}: max|ours - ref64| = {err:.3e}, max|ref16 - ref64| = {base:.3e}, ratio {ratio:.3f}")
    assert err <= 2 * base + 1e-6, (
        f"{what}: max|ours - ref64| = {err:.3e} exceeds 2 * {base:.3e} + 1e-6 "
        f"(bf16 torch error); ratio {ratio:.2f}"
    )
    return ratio


def check_f64(what: str, ours: np.ndarray, ref64: torch.Tensor, rtol: float = 1e-12) -> None:
    """The interpreter's float64 mode never rounds: it must match the float64 reference closely."""
    got = np.asarray(ours)
    assert got.dtype == np.float64, f"{what}: precision='f64' returned {got.dtype}"
    r64 = ref64.detach().double().numpy()
    err, scale = max_abs(got - r64), max_abs(r64)
    assert err <= rtol * scale, f"{what}: f64 error {err:.3e} > {rtol} * {scale:.3e}"


# ---------------------------------------------------------------------------- inputs and torch helpers


def randn(gen: torch.Generator, *shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """A bf16 tensor (checkpoints and activations are bf16)."""
    return (torch.randn(*shape, generator=gen) * scale + shift).bfloat16()


def linear(gen: torch.Generator, out_features: int, in_features: int) -> torch.Tensor:
    """An nn.Linear-style weight [out, in] in bf16, scaled like the default init."""
    return randn(gen, out_features, in_features, scale=in_features**-0.5)


def np_bf16(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy().astype(ml_dtypes.bfloat16)


def np_f32(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy()


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype)


def positions() -> torch.Tensor:
    return torch.arange(M, dtype=torch.float32) * 3 + 5  # up to 290: angles of many turns


# ---------------------------------------------------------------------------- cases

Reference = Callable[[torch.dtype], dict[str, torch.Tensor]]


@dataclass
class Case:
    block: str
    inputs: dict[str, np.ndarray]  # for Block.run, converted layouts
    reference: Reference  # ordinary torch math, in the given dtype
    plain: dict[str, Callable[[np.ndarray], np.ndarray]] = field(
        default_factory=dict
    )  # our layout -> ordinary
    tile: tuple[int, int] = TILE


def mlp_checkpoint(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "y": randn(gen, M, D),
        "x": randn(gen, M, D),
        "o_proj": linear(gen, D, D),
        "norm": randn(gen, D, scale=0.2, shift=1.0),
        "gate_proj": linear(gen, F_MLP, D),
        "up_proj": linear(gen, F_MLP, D),
        "down_proj": linear(gen, D, F_MLP),
    }


def mlp_inputs(ck: dict[str, torch.Tensor], norm: str = "g") -> dict[str, np.ndarray]:
    return {
        "y": np_bf16(ck["y"]),
        "x": np_bf16(ck["x"]),
        "w_o": np_bf16(ck["o_proj"].T),
        norm: np_f32(ck["norm"]),
        "w_13": np_bf16(interleave_gate_up(ck["gate_proj"].T, ck["up_proj"].T)),
        "w_2": np_bf16(ck["down_proj"].T),
    }


def mlp_reference(ck: dict[str, torch.Tensor], dt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 = down(silu(gate(n)) * up(n)) + h, n = RMSNorm(h) * g, h = o_proj(y) + x; returns (x2, h)."""
    p = {k: cast(v, dt) for k, v in ck.items()}
    return ref.llama_mlp(p["y"], p["x"], p["o_proj"], p["norm"], p["gate_proj"], p["up_proj"], p["down_proj"])


def qkv_checkpoint(gen: torch.Generator) -> torch.Tensor:
    """The fused QKV projection as an nn.Linear weight [(HQ + 2 HKV) * head_dim, D]."""
    return torch.cat(
        [linear(gen, HQ * HEAD_DIM, D), linear(gen, HKV * HEAD_DIM, D), linear(gen, HKV * HEAD_DIM, D)], dim=0
    )


def qkv_layout() -> tuple[int, int]:
    return (HQ + HKV) * HEAD_DIM, (HQ + 2 * HKV) * HEAD_DIM


def case_llama_mlp() -> Case:
    ck = mlp_checkpoint(torch.Generator().manual_seed(1))
    return Case("llama_mlp", mlp_inputs(ck), lambda dt: {"x2": mlp_reference(ck, dt)[0]})


def case_llama_block() -> Case:
    gen = torch.Generator().manual_seed(2)
    ck = mlp_checkpoint(gen)
    norm2, w_qkv = randn(gen, D, scale=0.2, shift=1.0), qkv_checkpoint(gen)
    rw, width = qkv_layout()
    pos = positions()
    inputs = mlp_inputs(ck, norm="g1")
    inputs.update(
        g2=np_f32(norm2),
        w_qkv=np_bf16(interleave_rope(w_qkv.T, HEAD_DIM, rw)),
        pos=np_f32(pos),
        freq=rope_freq(HEAD_DIM, rw, width, BASE),
    )

    def reference(dt: torch.dtype) -> dict[str, torch.Tensor]:
        p = {k: cast(v, dt) for k, v in ck.items()}
        return ref.llama_block(
            p["y"],
            p["x"],
            p["o_proj"],
            p["norm"],
            p["gate_proj"],
            p["up_proj"],
            p["down_proj"],
            cast(norm2, dt),
            cast(w_qkv, dt),
            pos,
            HEAD_DIM,
            rw,
        )

    return Case("llama_block", inputs, reference, plain={"qkv": lambda q: deinterleave_rope(q, HEAD_DIM, rw)})


def case_qkv_rope() -> Case:
    gen = torch.Generator().manual_seed(3)
    # The stage before stored xg = h * g (bf16) and the row scale r = rstd(h).
    xg, r, w_qkv = randn(gen, M, D), randn(gen, M, scale=0.2, shift=1.0).float(), qkv_checkpoint(gen)
    rw, width = qkv_layout()
    pos = positions()
    inputs = {
        "xg": np_bf16(xg),
        "r": np_f32(r),
        "w_qkv": np_bf16(interleave_rope(w_qkv.T, HEAD_DIM, rw)),
        "pos": np_f32(pos),
        "freq": rope_freq(HEAD_DIM, rw, width, BASE),
    }

    def reference(dt: torch.dtype) -> dict[str, torch.Tensor]:
        return {"qkv": ref.qkv_rope(cast(xg, dt), cast(r, dt), cast(w_qkv, dt), pos, HEAD_DIM, rw)}

    return Case("qkv_rope", inputs, reference, plain={"qkv": lambda q: deinterleave_rope(q, HEAD_DIM, rw)})


def case_qk_norm() -> Case:
    gen = torch.Generator().manual_seed(4)
    hd, width = QK_HEAD_DIM, QK_HEAD_DIM * QK_HEADS
    x, w_q, gq = randn(gen, M, D), linear(gen, width, D), randn(gen, hd, scale=0.2, shift=1.0)
    pos = positions()
    inputs = {
        "x": np_bf16(x),
        "w_q": np_bf16(interleave_rope(w_q.T, hd)),
        "g": np_f32(interleave_rope(gq, hd)),  # one head's weight: it repeats for every head
        "pos": np_f32(pos),
        "freq": rope_freq(hd, width, width, BASE),
    }

    def reference(dt: torch.dtype) -> dict[str, torch.Tensor]:
        return {"q": ref.qk_norm(cast(x, dt), cast(w_q, dt), cast(gq, dt), pos, hd)}

    return Case(
        "qk_norm",
        inputs,
        reference,
        plain={"q": lambda q: deinterleave_rope(q, hd)},
        tile=(TILE[0], QK_HEAD_DIM),
    )


def case_lm_head_ce() -> Case:
    gen = torch.Generator().manual_seed(5)
    hg, r, w_lm = randn(gen, M, D), randn(gen, M, scale=0.2, shift=1.0).float(), linear(gen, V, D)
    target = torch.randint(0, V, (M,), generator=gen, dtype=torch.int32)
    target[::7] = -100  # ignored rows (padding)
    inputs = {"hg": np_bf16(hg), "r": np_f32(r), "w_lm": np_bf16(w_lm.T), "target": target.numpy()}

    def reference(dt: torch.dtype) -> dict[str, torch.Tensor]:  # bf16: the usual logits.float()
        return ref.lm_head_ce(cast(hg, dt), cast(r, dt), cast(w_lm, dt), target, upcast=dt == torch.bfloat16)

    return Case("lm_head_ce", inputs, reference)


def _ce_variant(name: str, seed: int, loss: Callable[..., torch.Tensor], extra: dict[str, float]) -> Case:
    """A cross-entropy variant of lm_head_ce (examples/lm_head_ce_*.coda): the same inputs and lse,
    `loss(logits, lse, target)` in the ordinary torch way (bf16: the usual `logits.float()`)."""
    gen = torch.Generator().manual_seed(seed)
    hg, r, w_lm = randn(gen, M, D), randn(gen, M, scale=0.2, shift=1.0).float(), linear(gen, V, D)
    target = torch.randint(0, V, (M,), generator=gen, dtype=torch.int32)
    target[::7] = -100
    inputs = {"hg": np_bf16(hg), "r": np_f32(r), "w_lm": np_bf16(w_lm.T), "target": target.numpy()}

    def reference(dt: torch.dtype) -> dict[str, torch.Tensor]:
        logits = F.linear(cast(hg, dt) * cast(r, dt)[:, None], cast(w_lm, dt))
        logits = logits.float() if dt == torch.bfloat16 else logits
        return loss(logits, target.long(), **extra)

    return Case(name, inputs, reference)


def case_lm_head_ce_smooth() -> Case:
    return _ce_variant("lm_head_ce_smooth", 9, ce.ce_smooth, {"smoothing": 0.1})


def case_lm_head_ce_zloss() -> Case:
    return _ce_variant("lm_head_ce_zloss", 10, ce.ce_zloss, {"z": 1e-4})


def case_lm_head_ce_softcap() -> Case:
    return _ce_variant("lm_head_ce_softcap", 11, ce.ce_softcap, {"cap": 30.0})


def case_bias_gelu() -> Case:
    gen = torch.Generator().manual_seed(6)
    x, w, b = randn(gen, M, D), linear(gen, F_MLP, D), randn(gen, F_MLP, scale=0.5)
    inputs = {"x": np_bf16(x), "w": np_bf16(w.T), "b": np_f32(b)}
    return Case(
        "bias_gelu",
        inputs,
        lambda dt: {"out": F.gelu(F.linear(cast(x, dt), cast(w, dt), cast(b, dt)), approximate="tanh")},
    )


def case_scale_residual() -> Case:
    gen = torch.Generator().manual_seed(7)
    x, w, res = randn(gen, M, D), linear(gen, F_MLP, D), randn(gen, M, F_MLP)
    alpha = 0.375
    inputs = {"x": np_bf16(x), "w": np_bf16(w.T), "res": np_bf16(res), "alpha": np.array(alpha, np.float32)}
    return Case(
        "scale_residual",
        inputs,
        lambda dt: {"out": alpha * F.linear(cast(x, dt), cast(w, dt)) + cast(res, dt)},
    )


def case_amax_fp8() -> Case:
    gen = torch.Generator().manual_seed(8)
    x, w = randn(gen, M, D), linear(gen, F_MLP, D)

    def reference(dt: torch.dtype) -> dict[str, torch.Tensor]:
        out = F.linear(cast(x, dt), cast(w, dt))
        amax = out.to(torch.float32 if dt == torch.bfloat16 else dt).abs().max()
        return {"out": out, "amax": amax, "scale": 448.0 / amax}

    return Case("amax_fp8", {"x": np_bf16(x), "w": np_bf16(w.T)}, reference)


CASES: dict[str, Callable[[], Case]] = {
    "llama_mlp": case_llama_mlp,
    "lm_head_ce": case_lm_head_ce,
    "lm_head_ce_smooth": case_lm_head_ce_smooth,
    "lm_head_ce_zloss": case_lm_head_ce_zloss,
    "lm_head_ce_softcap": case_lm_head_ce_softcap,
    "qkv_rope": case_qkv_rope,
    "qk_norm": case_qk_norm,
    "llama_block": case_llama_block,
    "bias_gelu": case_bias_gelu,
    "scale_residual": case_scale_residual,
    "amax_fp8": case_amax_fp8,
}


@functools.cache
def prepared(name: str) -> tuple[Case, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    case = CASES[name]()
    with torch.no_grad():
        return case, case.reference(torch.float64), case.reference(torch.bfloat16)


@functools.cache
def block(name: str) -> coda_lang.Block:
    return coda_lang.load(EXAMPLES / f"{name}.coda")[name]


def run(name: str, **kw: object) -> dict[str, np.ndarray]:
    case = prepared(name)[0]
    outs = block(name).run(case.inputs, **kw)  # type: ignore[arg-type]
    return {k: case.plain.get(k, lambda a: a)(v) for k, v in outs.items()}


# ---------------------------------------------------------------------------- tests


def test_every_example_has_a_case() -> None:
    """(The fp8 examples are compared with torch's fp8 casts in tests/test_fp8.py: the bf16 accuracy
    rule here does not measure quantization.)"""
    assert sorted(CASES) == sorted(
        p.stem for p in EXAMPLES.glob("*.coda") if p.stem not in QUANTIZED_EXAMPLES
    )


def test_rope_freq_matches_the_reference_inv_freq() -> None:
    rw, width = qkv_layout()
    f = rope_freq(HEAD_DIM, rw, width, BASE)
    inv = inv_freq(HEAD_DIM).numpy()
    assert np.array_equal(
        f, np.concatenate([np.tile(inv, HQ + HKV), np.zeros(HKV * HEAD_DIM // 2, np.float32)])
    )


@pytest.mark.parametrize("tiled", [False, True], ids=["whole", "tiled"])
@pytest.mark.parametrize("name", CASES)
def test_exact_within_twice_bf16_error(name: str, tiled: bool) -> None:
    case, ref64, ref16 = prepared(name)
    ours = run(name, precision="exact", sim_tile=case.tile if tiled else None)
    assert sorted(ours) == sorted(ref64)
    for out in ours:
        check_rule(
            f"{name}.{out} ({'tile ' + str(case.tile) if tiled else 'whole'})",
            ours[out],
            ref64[out],
            ref16[out],
        )


@pytest.mark.parametrize("name", CASES)
def test_f64_matches_float64_reference(name: str) -> None:
    case, ref64, _ = prepared(name)
    ours = run(name, precision="f64")
    for out in ours:
        check_f64(f"{name}.{out}", ours[out], ref64[out])
    ours_tiled = run(name, precision="f64", sim_tile=case.tile)
    for out in ours_tiled:
        check_f64(f"{name}.{out} (tiled)", ours_tiled[out], ref64[out])
