"""Runs of block-level equations as one generated Triton kernel (coda_lang/backend_triton/vector_run.py),
on the CPU.

The kernel runs under Triton's CPU interpreter and is compared with the CUDA runtime's own path, one
torch stand-in per equation (`vector_eqn.VectorStep`, checked against the interpreter elsewhere):
- every run of the Hugging Face patch's blocks (bf16 and fp8, forward and backward with the patch's
  gradients), at lengths that are multiples of no chunk, with random inputs, scalars given as tensors
  and as numbers: every value the run defines, within f32 rounding (a sum adds in another order);
- a hand-written run with a NaN and an infinity under a max, a sum, a value annotated bf16, a literal, a
  dim used as a value, and a scalar that reads a fold and feeds a vector of the same loop;
- which equations the planner leaves out of runs (a matrix alias, a fold into a dim) and why;
- where the call declines (off a GPU without the interpreter, an empty vector, an operand of another
  length), leaving the environment as it was;
- that the fp8 Llama layer's between-stage equations all run in kernels of runs, several per kernel.
On a GPU the runtime uses these kernels only where $CODA_VECTOR_RUNS=1 (off by default: no gain shown,
vector_run.py's docstring says what was measured); with them on, tests/test_gpu.py,
tests/test_hf_fp8.py and tests/test_fp8_kernels.py passed on an H200 (2026-11-27, 97 tests).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import coda_lang
from coda_lang.backend_cute.runtime.vector_eqn import VectorStep
from coda_lang.backend_triton.vector_run import VectorRun, plan_runs, unsupported
from coda_lang.hf.blocks import model_source
from coda_lang.ir.nodes import Stage
from coda_lang.ir.types import SCALAR

pytest.importorskip("triton")

HF_WRT = {"w_o", "w_13", "w_2", "w_qkv", "w_lm", "g", "g1", "g2", "h", "y", "x", "hg", "r"}
DIMS = {"M": 1037, "D": 48, "F": 40, "K": 32, "P": 24, "V": 56}


def _blocks() -> list[tuple[str, Any]]:
    out = []
    for fp8 in (None, "delayed"):
        prog = coda_lang.load(model_source("bfloat16", 1e-5, 16, None, fp8=fp8))
        for name in ("first_qkv", "layer", "last"):
            b = prog[name]
            wrt = [p.var.name for p in b.ir.params if p.var.name in HF_WRT]
            opts = coda_lang.BackwardOptions(fp8_grads="e5m2") if fp8 else None
            d = b.derivation(wrt, backward=opts)
            for blk in (d.forward, d.backward):
                out.append((f"{fp8 or 'bf16'}:{blk.ir.name}", blk))
    return out


BLOCKS = _blocks()


def _runs() -> list[tuple[str, Any, tuple[int, ...]]]:
    return [
        (f"{name}@{first}", blk, idx) for name, blk in BLOCKS for first, idx in plan_runs(blk.ir.body).items()
    ]


RUNS = _runs()


def _inputs(vr: VectorRun, dims: dict[str, int], as_tensors: bool, g: torch.Generator) -> dict[str, Any]:
    env: dict[str, Any] = {}
    for v in vr.inputs:
        t = v.type
        if t.kind == SCALAR:
            x = float(torch.rand((), generator=g)) + 0.5
            env[v.name] = torch.tensor(x, dtype=torch.float32) if as_tensors else x
        else:
            d = t.shape[0]
            n = dims[d.name] * d.coeff.numerator // d.coeff.denominator if d.name else int(d.coeff)
            env[v.name] = torch.rand(n, generator=g, dtype=torch.float32) * 3 + 0.25
    return env


def _eager(cb: Any, eqns: list[Any], env: dict[str, Any], dims: dict[str, int]) -> dict[str, Any]:
    env = dict(env)
    for e in eqns:
        VectorStep(e, cb._dimrefs, cb._sizes)(env, dims, torch.device("cpu"))
    return env


def _check(vr: VectorRun, cb: Any, env: dict[str, Any], dims: dict[str, int]) -> None:
    want = _eager(cb, vr.eqns, env, dims)
    got = dict(env)
    assert vr(got, dims, torch.device("cpu"))
    for v in vr.outputs:
        w, x = want[v.name], got[v.name]
        assert isinstance(x, torch.Tensor) and x.dtype == torch.float32, v.name
        assert tuple(x.shape) == tuple(torch.as_tensor(w).shape), v.name
        torch.testing.assert_close(
            x, torch.as_tensor(w, dtype=torch.float32), rtol=2e-6, atol=0, equal_nan=True, msg=v.name
        )


@pytest.mark.parametrize("as_tensors", [True, False], ids=["scalar-tensors", "scalar-numbers"])
@pytest.mark.parametrize(("name", "blk", "idx"), RUNS, ids=[r[0] for r in RUNS])
def test_run_matches_the_equations_one_by_one(
    name: str, blk: Any, idx: tuple[int, ...], as_tensors: bool
) -> None:
    cb = blk.cuda(emulate=True)
    vr = VectorRun([blk.ir.body[i] for i in idx], cb._dimrefs, blk.ir.name, idx[0], interpret=True)
    g = torch.Generator().manual_seed(len(name) * 7 + idx[0])
    _check(vr, cb, _inputs(vr, DIMS, as_tensors, g), DIMS)


def test_the_fp8_layer_runs_its_vector_equations_in_few_kernels() -> None:
    """Every between-stage equation of the fp8 layer's forward and backward but a matrix alias is in a
    run, and the runs are few: the launches the host saves."""
    for name in ("delayed:layer", "delayed:layer_bwd"):
        blk = dict(BLOCKS)[name]
        body = blk.ir.body
        eqns = [i for i, s in enumerate(body) if not isinstance(s, Stage)]
        runs = plan_runs(body)
        covered = {i for idx in runs.values() for i in idx}
        left = [body[i] for i in eqns if i not in covered]
        assert all(e.op == "copy" and e.outs[0].type.kind == "matrix" for e in left), [
            e.outs[0].name for e in left
        ]
        assert len(covered) >= 20 and len(runs) <= 6, (name, len(covered), len(runs))


HAND = """
dims M, N
block b(x: bf16[M, N], w: bf16[N, N], s: f32, t: f32) -> (y: bf16[M, N], am: f32, t2: f32, v: f32[M], u: f32[M]) {
  gemm x @ w {
    y: bf16 = acc
    p = max(abs(acc), over=N)
    q = sum(acc, over=N)
  }
  m = max(p, over=M)
  am = m * s
  tot: bf16 = sum(q, over=M)
  h: bf16 = q / N + t
  v = h * am
  u = v * 0.5 - s
  t2 = tot * s
}
"""


def _hand() -> tuple[Any, VectorRun, Any]:
    blk = coda_lang.load(HAND)["b"]
    cb = blk.cuda(emulate=True)
    runs = plan_runs(blk.ir.body)
    assert len(runs) == 1
    ((first, idx),) = runs.items()
    assert idx == tuple(i for i, s in enumerate(blk.ir.body) if not isinstance(s, Stage))
    return blk, VectorRun([blk.ir.body[i] for i in idx], cb._dimrefs, "b", first, interpret=True), cb


@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf"])
def test_hand_written_run(special: bool) -> None:
    """A scalar that reads a fold (`am`) used by a vector of the same length (`v`: after the loop, so
    in a second one), a bf16-annotated sum and vector, a literal, a dim as a value."""
    blk, vr, cb = _hand()
    dims = {"M": 2500, "N": 64}
    g = torch.Generator().manual_seed(3)
    env = {
        "p": torch.rand(2500, generator=g) * 5,
        "q": torch.randn(2500, generator=g) * 100,
        "s": torch.tensor(1.5),
        "t": 0.3,
    }
    if special:
        env["p"][17] = float("inf")
        env["p"][1999] = float("nan")
    _check(vr, cb, env, dims)
    got = dict(env)
    vr(got, dims, torch.device("cpu"))
    if special:
        assert torch.isnan(got["m"]) and torch.isnan(got["v"]).all()
    else:
        assert got["m"] == env["p"].max()
        assert got["tot"] == got["tot"].to(torch.bfloat16).float()  # rounded to bf16, kept in f32
        assert torch.equal(got["h"], got["h"].to(torch.bfloat16).float())
    src = vr.source((True, False))
    assert src.count("for c0 in range") == 2  # the folds and h in one loop; v and u after `am` in another


def test_a_vector_read_later_is_stored_before_the_barrier() -> None:
    """Each loop ends with a barrier, so that a later loop of the same program loads what it stored."""
    _blk, vr, _cb = _hand()
    src = vr.source((True, False))
    loops = src.split("for c0 in range")
    assert all("tl.debug_barrier()" in part for part in loops[1:])


def test_declines_leave_the_environment_as_it_was() -> None:
    _blk, vr, _cb = _hand()
    g = torch.Generator().manual_seed(0)
    env = {
        "p": torch.rand(100, generator=g),
        "q": torch.rand(100, generator=g),
        "s": torch.tensor(1.0),
        "t": 0.5,
    }
    cpu = torch.device("cpu")
    on_cpu = VectorRun(vr.eqns, vr.dimrefs, "b", 0, interpret=False)
    for run, e, dims in (
        (on_cpu, env, {"M": 100, "N": 8}),  # no GPU, no interpreter
        (vr, {**env, "p": torch.rand(0), "q": torch.rand(0)}, {"M": 0, "N": 8}),  # an empty vector
        (vr, {**env, "p": torch.rand(99, generator=g)}, {"M": 100, "N": 8}),  # another length
        (vr, {**env, "s": torch.ones(2)}, {"M": 100, "N": 8}),  # a scalar that isn't 0-d
        (vr, {**env, "p": torch.ones(100, dtype=torch.int32)}, {"M": 100, "N": 8}),  # not floating
    ):
        before = dict(e)
        assert run(e, dims, cpu) is False
        assert e.keys() == before.keys() and all(e[k] is before[k] for k in e)


def test_the_planner_leaves_out_what_the_kernel_cant_take() -> None:
    src = """
dims M, N, G = 4
block b(x: bf16[M, N], w: bf16[N, N], s: f32) -> (z: f32[M, N], f: f32[G], c: f32) {
  gemm x @ w {
    y = acc
    p = sum(acc, over=N)
    k = sum(acc, over=M)
  }
  z = y
  f = fold(k, into=G)
  c = sum(p, over=M) * s
}
"""
    blk = coda_lang.load(src)["b"]
    body = blk.ir.body
    why = {s.outs[0].name: unsupported(s) for s in body if not isinstance(s, Stage)}
    assert "not a float scalar or vector" in why["z"]  # a matrix alias
    assert "not elementwise" in why["f"]  # fold(p, into=G)
    assert why["c"] is None
    runs = plan_runs(body)
    assert all(body[i].outs[0].name not in ("z", "f") for idx in runs.values() for i in idx)


def test_an_equation_of_literals_is_made_on_the_device_not_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """A block-level equation of literals only (`k = 1.0 / 200704.0`) is computed on the host by its
    stand-in; its value is made on the block's device (`torch.full`), never copied there: a copy from
    pageable host memory is refused while a CUDA graph captures the step (the blockwise Llama step
    failed so on an H200). Stood in for here by a Tensor.to that refuses, and the meta device."""
    from coda_lang.backend_cute.runtime.launch import compute_value

    def refuse(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a copy from the host")

    monkeypatch.setattr(torch.Tensor, "to", refuse)
    v = compute_value(torch.tensor(2.5, dtype=torch.float64), torch.float32, torch.device("meta"))
    assert v.device.type == "meta" and v.shape == () and v.dtype == torch.float32
    on_host = compute_value(torch.tensor(2.5), torch.float32, torch.device("cpu"))
    assert on_host.item() == 2.5
