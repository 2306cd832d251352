"""One OpDef is one op: an op registered in a test is checked, interpreted, differentiated, emitted and
run by the emulator with no other file touched; and the ops added this way (softplus, erf, exact
gelu, mean) against independent references (torch, NumPy).

The throwaway op `cube_t(x) = x^3` lives only inside the `throwaway_op` fixture, which registers it
and removes it again, so no other test sees it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from test_autodiff import check_vjp

import coda_lang
from coda_lang.backend_cute.plan.emit import emit_stage
from coda_lang.backend_cute.plan.planner import plan_stage
from coda_lang.ops import BY_SURFACE, REGISTRY, SUGAR, Locality, Lowerings, OpDef
from coda_lang.ops.registry import as_tensor, broadcast, register

CUBE = """dims M, N, K

block cube_block(x: bf16[M, K], w: bf16[K, N], v: f32[M]) -> (y: bf16[M, N], s: f32[M], t: f32[M]) {
  gemm x @ w {
    y = cube_t(acc) + acc
    s = sum(cube_t(acc * 0.5), over=N)
  }
  t = cube_t(v) * s
}
"""


def _cube_rule(ctx: Any, ins: Any, params: Any) -> Any:
    return (broadcast(ctx, ins, "f32"),)


@pytest.fixture
def throwaway_op() -> Iterator[OpDef]:
    """`cube_t`: registered for the test, unregistered after it (whatever it raised)."""
    op = register(
        OpDef(
            name="cube_t",
            nin=1,
            type_rule=_cube_rule,
            locality=Locality.POINTWISE,
            impl=lambda x: x * x * x,
            vjp=lambda b, p, ct: [b.mul(ct, b.mul(b.lit(3.0), b.mul(p.x[0], p.x[0])))],
            lower=Lowerings(cute=lambda x: f"{x} * {x} * {x}", torch=lambda x: as_tensor(x) ** 3),
            doc="x cubed (a test's throwaway op)",
        )
    )
    try:
        yield op
    finally:
        del REGISTRY["cube_t"]
        BY_SURFACE["cube_t"].remove(op)
        if not BY_SURFACE["cube_t"]:
            del BY_SURFACE["cube_t"]


def _inputs(rng: np.random.Generator, m: int = 24, n: int = 16, k: int = 8) -> dict[str, np.ndarray]:
    return {
        "x": rng.standard_normal((m, k)).astype(np.float32),
        "w": rng.standard_normal((k, n)).astype(np.float32),
        "v": rng.standard_normal(m).astype(np.float32),
    }


def test_an_op_is_one_opdef(throwaway_op: OpDef) -> None:
    block = coda_lang.load(CUBE)["cube_block"]  # checked: types, shapes and locality from the one OpDef
    assert "cube_t(acc)" in str(block)  # printed back in its surface syntax

    ins = _inputs(np.random.default_rng(0))
    ins64 = {k: v.astype(np.float64) for k, v in ins.items()}
    outs = block.run(ins64, precision="f64")  # interpreted with its NumPy impl, against NumPy
    acc = ins64["x"] @ ins64["w"]
    s = np.sum((acc * 0.5) ** 3, axis=1)
    np.testing.assert_allclose(outs["y"], acc**3 + acc, rtol=1e-12)
    np.testing.assert_allclose(outs["s"], s, rtol=1e-12)
    np.testing.assert_allclose(outs["t"], ins64["v"] ** 3 * s, rtol=1e-12)

    check_vjp(block, ins64)  # differentiated through its VJP rule, against finite differences in f64

    source = emit_stage(plan_stage(block, 1))  # emitted through its CuTeDSL rule
    assert "acc * acc * acc" in source

    cb = block.cuda(tile=(16, 8), emulate=True, poison=True)  # the emulated kernels run its torch stand-in
    got = cb({k: torch.from_numpy(v) for k, v in ins.items()})
    want = block.run(ins, sim_tile=(16, 8))
    for name in ("y", "s", "t"):
        np.testing.assert_allclose(
            got[name].float().numpy(),
            np.asarray(want[name], np.float32),
            rtol=2e-2,
            atol=2e-2 * float(np.max(np.abs(np.asarray(want[name], np.float32)))),
        )


def test_the_throwaway_op_is_gone_after_its_test() -> None:
    assert "cube_t" not in REGISTRY and "cube_t" not in BY_SURFACE
    with pytest.raises(coda_lang.CodaError, match="E0203"):
        coda_lang.load(CUBE)


# ------------------------------------------------------------------ the ops added through one OpDef each

ACTS = """dims M, N, K

block acts(x: f32[M, K], w: f32[K, N]) -> (sp: f32[M, N], ge: f32[M, N], gt: f32[M, N], er: f32[M, N]) {
  gemm x @ w {
    sp = softplus(acc)
    ge = gelu(acc, approximate="none")
    gt = gelu(acc, approximate="tanh")
    er = erf(acc)
  }
}
"""


def test_new_activations_match_torch() -> None:
    block = coda_lang.load(ACTS)["acts"]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((32, 8)) * 4
    w = rng.standard_normal((8, 16))
    outs = block.run({"x": x, "w": w}, precision="f64")
    acc = torch.from_numpy(x @ w)
    torch.testing.assert_close(
        torch.from_numpy(outs["sp"]), torch.nn.functional.softplus(acc), rtol=1e-12, atol=0
    )
    torch.testing.assert_close(
        torch.from_numpy(outs["ge"]), torch.nn.functional.gelu(acc), rtol=1e-12, atol=1e-15
    )
    torch.testing.assert_close(
        torch.from_numpy(outs["gt"]),
        torch.nn.functional.gelu(acc, approximate="tanh"),
        rtol=1e-12,
        atol=1e-15,
    )
    torch.testing.assert_close(torch.from_numpy(outs["er"]), torch.special.erf(acc), rtol=1e-12, atol=1e-15)
    check_vjp(block, {"x": x, "w": w})


def test_gelu_without_approximate_is_the_tanh_form_as_before() -> None:
    text = ACTS.replace('gelu(acc, approximate="tanh")', "gelu(acc)")
    block = coda_lang.load(text)["acts"]
    rng = np.random.default_rng(2)
    ins = {"x": rng.standard_normal((8, 8)), "w": rng.standard_normal((8, 8))}
    acc = torch.from_numpy(ins["x"] @ ins["w"])
    got = block.run(ins, precision="f64")["gt"]
    torch.testing.assert_close(torch.from_numpy(got), torch.nn.functional.gelu(acc, approximate="tanh"))


def test_a_choice_parameter_round_trips_and_rejects_other_values() -> None:
    block = coda_lang.load(ACTS)["acts"]
    assert 'gelu(acc, approximate="none")' in str(block)
    assert coda_lang.load(str(block))["acts"].ir == block.ir
    for bad, what in (
        ('approximate="erf"', 'is one of "tanh", "none"'),
        ("approximate=none", "is one of"),
        ("approximate=1.0", "is one of"),
    ):
        with pytest.raises(coda_lang.CodaError, match="E0206") as e:
            coda_lang.load(ACTS.replace('approximate="none"', bad))
        assert what in str(e.value)
    with pytest.raises(coda_lang.CodaError, match="E0206"):
        coda_lang.load(ACTS.replace("softplus(acc)", 'sum(acc, over="N")'))


MEAN = """dims M, N, K

block means(x: f32[M, K], w: f32[K, N], v: f32[M]) -> (m: f32[M], g: f32[M, N], t: f32) {
  gemm x @ w {
    m = mean(acc * acc, over=N)
    g = acc - mean(acc, over=N, group=4)
  }
  t = mean(v * m, over=M)
}
"""


def test_mean_is_a_sum_divided_by_the_count() -> None:
    assert "reduce_mean" in SUGAR and "reduce_mean" not in REGISTRY  # it never reaches the IR
    block = coda_lang.load(MEAN)["means"]
    assert "mean(" not in str(block) and "sum(" in str(block)
    rng = np.random.default_rng(3)
    ins = {"x": rng.standard_normal((24, 8)), "w": rng.standard_normal((8, 16)), "v": rng.standard_normal(24)}
    acc = ins["x"] @ ins["w"]
    m = np.mean(acc * acc, axis=1)
    centred = acc - np.repeat(acc.reshape(24, 4, 4).mean(axis=2), 4, axis=1)
    want = {"m": m, "g": centred, "t": np.mean(ins["v"] * m)}
    for tile in (None, (8, 8), (5, 12)):  # tile_N a multiple of the group
        outs = block.run(ins, precision="f64", sim_tile=tile) if tile else block.run(ins, precision="f64")
        for k, ref in want.items():
            np.testing.assert_allclose(outs[k], ref, rtol=1e-12, err_msg=f"{k} at tile {tile}")
    check_vjp(block, ins)


def test_mean_keeps_the_diagnostics_of_sum() -> None:
    with pytest.raises(coda_lang.CodaError) as e:
        coda_lang.load(
            MEAN.replace("m = mean(acc * acc, over=N)", "m = mean(acc * acc, over=N)\n    q = acc * m")
        )
    assert "E0501" in str(e.value) or "E0503" in str(e.value)
    with pytest.raises(coda_lang.CodaError, match="E0206"):
        coda_lang.load(MEAN.replace("mean(v * m, over=M)", "mean(v * m)"))


# ------------------------------------------------------------------ a reduction is one OpDef plus one Combine

PROD = """dims M, N, K

block prods(x: bf16[M, K], w: bf16[K, N]) -> (p: f32[M]) {
  gemm x @ w {
    p = prod_t(acc * 0.5 + 1.0, over=N)
  }
}
"""


@pytest.fixture
def throwaway_reduction() -> Iterator[OpDef]:
    """`prod_t(x, over=D)`: a product reduction with a combine record of its own and no epilogue sink."""
    from coda_lang.ops.reductions import REDUCE_PARAMS, _reduce_rule
    from coda_lang.ops.registry import COMBINES, Combine

    rec = Combine(
        "prod_t",
        "a partial product",
        1.0,
        lambda x, axis: np.prod(x, axis=axis),
        lambda x, axis: x.prod(axis),
    )
    COMBINES[rec.name] = rec
    op = register(
        OpDef(
            name="reduce_prod_t",
            surface="prod_t",
            nin=1,
            params=REDUCE_PARAMS,
            type_rule=_reduce_rule("prod_t", rec.name),
            locality=Locality.REDUCE,
            impl=lambda x, axis: np.prod(x, axis=axis),
            differentiable=False,
            combine=rec,
            lower=Lowerings(cute=lambda x, **params: x, torch=lambda x: as_tensor(x).prod()),
        )
    )
    try:
        yield op
    finally:
        del REGISTRY[op.name], COMBINES[rec.name]
        del BY_SURFACE["prod_t"]


def test_a_new_reduction_combines_by_its_record_and_is_refused_where_no_sink_folds_it(
    throwaway_reduction: OpDef,
) -> None:
    block = coda_lang.load(PROD)["prods"]
    rng = np.random.default_rng(4)
    ins = {"x": rng.standard_normal((12, 4)) * 0.2, "w": rng.standard_normal((4, 20))}
    want = np.prod((ins["x"] @ ins["w"]) * 0.5 + 1.0, axis=1)
    for tile in (None, (4, 8), (5, 6)):  # per-tile partials multiplied together by the record's fold
        got = block.run(ins, precision="f64", sim_tile=tile) if tile else block.run(ins, precision="f64")
        np.testing.assert_allclose(got["p"], want, rtol=1e-12, err_msg=str(tile))
    with pytest.raises(coda_lang.CodaError, match="E0705") as e:
        plan_stage(block, 1)  # never folded as a max (or a sum) on the GPU
    assert "no epilogue sink" in str(e.value)
