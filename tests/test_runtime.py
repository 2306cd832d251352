"""The CUDA runtime's host logic, on the CPU (no GPU, no quack): coda_lang/backend_cute/ (cuda_block, launch, autograd, emulate).

- Each op's torch stand-in (`OpDef.torch`, used between stages, in emulated kernels and in elementwise
  stages) agrees with its NumPy impl, for every op of the registry that has one; every pointwise,
  pair and reduction op has one; each combine record's torch fold agrees with its NumPy fold (sum,
  max, min, log-sum-exp, -inf included); `sink_shape` is quack's rule.
- With `emulate=True` (each stage's launch replaced by a torch stand-in taking the kernel's exact
  arguments), every compilable example runs at sizes that are not multiples of the tile, and its
  outputs and per-tile partial buffers match the interpreter at the same tiles (tests/runtime_check.py
  states the tolerance rules); poisoned buffers show every element is written.
- `autograd()` differentiates through the derived backward block (gradients match Block.vjp).
- `dims=` (on Block.cuda or a call) gives dims no input's shape gives, to the forward and the backward;
  vector ops between stages compute in f32 on 16-bit parameters, as the interpreter does.
- The block traces into one graph with no break under torch.compile (the launches are the custom op
  `coda::stage`), autograd included.
- E07 for stages the backend can't compile; E08 for bad inputs; the interpreter accepts per-stage tiles.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from reduction_programs import NEW_REDUCTIONS  # noqa: E402
from runtime_check import (  # noqa: E402
    DIMS_AS_VALUES,
    GRAD_BLOCKS,
    RAGGED_SUMS,
    check_gradient,
    check_output,
    check_partial,
    example_inputs,
)

import coda_lang  # noqa: E402
from coda_lang.backend_cute.plan.spec import Sink  # noqa: E402
from coda_lang.backend_cute.runtime.launch import (  # noqa: E402
    _operand,
    sink_partials,
    sink_rule,
    sink_shape,
)
from coda_lang.core.diagnostics import CodaError  # noqa: E402
from coda_lang.interp import combine  # noqa: E402
from coda_lang.ops import COMBINES, REGISTRY, Locality  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SMALL = {"M": 300, "D": 200, "F": 264, "K": 200, "N": 264, "V": 264, "P": 136}
TILE = (128, 64)  # several tiles along both dims at SMALL, ragged last ones
COMPILABLE = [
    "llama_mlp",
    "bias_gelu",
    "scale_residual",
    "amax_fp8",
    "lm_head_ce",
    "qkv_rope",
    "llama_block",
    "qk_norm",
]
# qk_norm's per-head sum (group=128) needs 2*P and tile_N multiples of 128: 2*P = 384 is 1.5 tiles of 256
GROUPED_SIZES, GROUPED_TILE = {**SMALL, "P": 192}, (128, 256)


def sizes_and_tile(name: str) -> tuple[dict[str, int], tuple[int, int]]:
    return (GROUPED_SIZES, GROUPED_TILE) if name == "qk_norm" else (SMALL, TILE)


def block(name: str) -> coda_lang.Block:
    return coda_lang.load(EXAMPLES / f"{name}.coda")[name]


# ------------------------------------------------------------------ the torch op table


STAND_INS = sorted(n for n, od in REGISTRY.items() if od.lower.torch is not None)
POSITIVE = {"log", "sqrt", "rsqrt"}  # ops whose operand is drawn positive


def _cases(
    op: str, x: np.ndarray, y: np.ndarray
) -> list[tuple[tuple[Any, ...], tuple[Any, ...], dict[str, Any]]]:
    """(torch args, NumPy args, params) for each way the op is called: by arity and locality, with Python
    numbers for one operand of a binary op, and every choice of each parameter."""
    od = REGISTRY[op]
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    params: list[dict[str, Any]] = [{}]
    for spec in od.params:
        values = (
            list(spec.choices)
            if spec.kind == "choice"
            else ["bf16", "f16", "f32", "i32"]
            if spec.kind == "dtype"
            else []
        )
        if values:
            params = [{**p, spec.name: v} for p in params for v in values] + ([] if spec.required else params)
    if od.name == "where":
        return [((tx > 0, tx, ty), (x > 0, x, y), {}), ((tx > 0, tx, 0.0), (x > 0, x, 0.0), {})]
    if od.name == "expand":  # a broadcast scalar, and a vector repeated to a longer one
        return [((tx[:1], tx), (x[:1], x), {}), ((tx[:8], tx[:256]), (x[:8], x[:256]), {})]
    if od.locality is Locality.VECTOR:  # fold(x, into=G): the stand-in and the impl take G's size
        return [((tx[:256], 8), (x[:256], 8), {}), ((tx[:256], 256), (x[:256], 256), {})]
    if od.locality is Locality.PAIR:
        if od.nin == 1:
            return [((tx.reshape(1, -1)[:, :256],), (x.reshape(1, -1)[:, :256],), {})]
        return [((tx, ty), (x, y), {}), ((tx, 0.0), (x, np.float32(0.0)), {})]
    if od.nin == 2:
        return [
            ((tx, ty), (x, y), {}),
            ((tx, 0.5), (x, np.float32(0.5)), {}),
            ((2.0, ty), (np.float32(2.0), y), {}),
        ]
    scale = 100.0 if od.name == "cast" else 1.0
    return [((tx * scale,), (x * scale,), p) for p in params]


@pytest.mark.parametrize("op", STAND_INS)
def test_torch_stand_ins_match_numpy_impls(op: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(257).astype(np.float32) * 3
    y = rng.standard_normal(257).astype(np.float32)
    y[::5] = x[::5]  # ties for the comparisons and max/min
    if op in POSITIVE:
        x = np.abs(x) + 0.1
    od = REGISTRY[op]
    stand_in = od.lower.torch
    assert od.impl is not None and stand_in is not None
    for targs, nargs, kw in _cases(op, x, y):
        got = stand_in(*targs, **kw)
        want = od.impl(nargs[0], 0) if od.locality is Locality.REDUCE else od.impl(*nargs, **kw)
        for g_t, w in zip(
            got if isinstance(got, tuple) else (got,),
            want if isinstance(want, tuple) else (want,),
            strict=True,
        ):
            g = g_t.double().numpy() if g_t.dtype != torch.bool else g_t.numpy()
            np.testing.assert_allclose(
                g,
                np.asarray(want if not isinstance(want, tuple) else w, dtype=g.dtype),
                rtol=2e-6,
                atol=1e-5,
                err_msg=f"{op} {kw}",
            )


def test_every_op_that_runs_outside_a_kernel_has_a_torch_stand_in() -> None:
    lacking = {
        n
        for n, od in REGISTRY.items()
        if od.locality in (Locality.POINTWISE, Locality.PAIR, Locality.REDUCE) and od.lower.torch is None
    }
    assert lacking == set()


def test_torch_stand_ins_on_integers_and_scalars() -> None:
    t = torch.tensor([3, -100, 7], dtype=torch.int32)

    def run(op: str, *args: Any, **kw: Any) -> Any:
        fn = REGISTRY[op].lower.torch
        assert fn is not None
        return fn(*args, **kw)

    assert run("ge", t, 0).tolist() == [True, False, True]
    assert run("div", t, 2).dtype == torch.float32
    assert run("cast", torch.tensor([1.7, -1.7]), "i32").tolist() == [1, -1]
    assert float(run("exp", 0.0)) == 1.0


@pytest.mark.parametrize("rule", sorted(COMBINES))
def test_torch_folds_match_the_interpreters(rule: str) -> None:
    rng = np.random.default_rng(1)
    buf = rng.standard_normal((9, 4)).astype(np.float32) * 10
    if rule in ("max", "lse"):
        buf[2, 3] = -np.inf  # an empty slot
        buf[5, :] = -np.inf  # an empty row
    for axis in (0, 1):
        got = COMBINES[rule].torch(torch.from_numpy(buf), axis).numpy()
        with np.errstate(divide="ignore"):
            want = combine(buf, rule, axis)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_sink_rules_and_shapes() -> None:
    x = {"value": ("x",), "shape": ()}
    row = Sink(
        name="ss",
        py="ss",
        op="ColVecReduce",
        combine="add",
        layout="row partials",
        scaled=True,
        value=("h", "h"),
        shape=(),
    )
    col = Sink(name="db", py="db", op="RowVecReduce", combine="add", layout="column partials", **x)
    lse = Sink(name="lse", py="lse", op="OnlineLSEReduce", combine=None, layout="row partials", **x)
    amax = Sink(name="a", py="a", op="ColVecReduce", combine="max_abs", layout="row partials", **x)
    pick = Sink(name="t", py="t", op="ColVecSelect", combine=None, layout="vector", index="target", **x)
    rmin = Sink(name="m", py="m", op="ColVecReduce", combine="max", layout="row partials", negate=True, **x)
    cmin = Sink(
        name="m", py="m", op="RowVecReduce", combine="max", layout="column partials", negate=True, **x
    )
    assert [sink_rule(s) for s in (row, col, lse, amax, pick, rmin, cmin)] == [
        ("sum", 1),
        ("sum", 0),
        ("lse", 1),
        ("max", 1),
        ("select", -1),
        ("min", 1),
        ("min", 0),
    ]
    buf = torch.tensor([[1.0, -float("inf")], [float("inf"), -2.0]])
    assert torch.equal(sink_partials(rmin, buf), -buf) and sink_partials(row, buf) is buf
    assert sink_shape(row, 1000, 520, 128, 192) == (1000, 3)
    assert sink_shape(col, 1000, 520, 128, 192) == (8, 520)
    assert sink_shape(pick, 1000, 520, 128, 192) == (1000,)


@pytest.mark.toolchain
def test_sink_shapes_are_quacks() -> None:
    from quack.epilogue.ops import ColVecLoad, ColVecReduce, OnlineLSEReduce, RowVecReduce

    from coda_lang.backend_cute.plan.epi_ops import BoundedColVecSelect

    x = {"name": "a", "py": "a", "value": ("x",), "shape": ()}
    ours = {
        "ColVecReduce": Sink(op="ColVecReduce", combine="add", layout="row partials", **x),
        "RowVecReduce": Sink(op="RowVecReduce", combine="add", layout="column partials", **x),
        "OnlineLSEReduce": Sink(op="OnlineLSEReduce", combine=None, layout="row partials", **x),
        "ColVecSelect": Sink(op="ColVecSelect", combine=None, layout="vector", index="i", **x),
    }
    theirs = {
        "ColVecReduce": ColVecReduce("a"),
        "RowVecReduce": RowVecReduce("a"),
        "OnlineLSEReduce": OnlineLSEReduce("a"),
        "ColVecSelect": BoundedColVecSelect("a", ColVecLoad("i")),
    }  # (the emitted pick: quack's, bounded by N)
    for m, n, tm, tn in [(1000, 520, 128, 192), (16384, 11008, 128, 128), (5, 3, 64, 64)]:
        for k, s in ours.items():
            assert sink_shape(s, m, n, tm, tn) == tuple(theirs[k].sink_alloc_shape((m,), n, tm, tn)), k


# ------------------------------------------------------------------ emulated runs against the interpreter


@pytest.mark.parametrize("name", COMPILABLE)
def test_emulated_block_matches_interpreter(name: str) -> None:
    blk = block(name)
    sizes, tile = sizes_and_tile(name)
    cb = blk.cuda(tile=tile, emulate=True, poison=True)
    inputs = example_inputs(blk, sizes, seed=3)
    outs, partials = cb.run_with_partials(inputs)
    assert cb.tiles == {k: tile for k in range(1, len(blk.plan.stages) + 1)}
    ref, ref_partials = blk.run_with_partials(inputs, sim_tile=cb.tiles)
    ref64 = blk.run(inputs, precision="f64")
    assert set(outs) == set(ref)
    for o in blk.ir.outputs:
        assert o.type is not None
        check_output(o.name, outs[o.name], ref[o.name], ref64[o.name], o.type.dtype)
        assert outs[o.name].dtype == {"bf16": torch.bfloat16, "f32": torch.float32}[o.type.dtype]
    if name in ("llama_mlp", "amax_fp8", "lm_head_ce", "llama_block"):
        assert partials
    for k, buf in partials.items():
        check_partial(k, buf, ref_partials[k])


GROUPED = """dims M, K, N
block p(x: bf16[M, K], w: bf16[K, N], b: f32[N]) -> (y: bf16[M, N], s: f32[M, N/64]) {
  gemm x @ w {
    s = sum(acc * acc, over=N, group=64)
    m = max(abs(acc + b), over=N, group=64)
    y = acc * rsqrt(s / 64.0) / m
  }
}
"""


def test_emulated_grouped_max_and_stored_group_match_interpreter() -> None:
    """A grouped max and a grouped sum stored after the stage (the [m, n / 64] buffer of its writer),
    at a tile with a ragged last column tile (n = 448 = 3.5 tiles of 128)."""
    blk = next(iter(coda_lang.load(GROUPED)))
    cb = blk.cuda(tile=(128, 128), emulate=True, poison=True)
    inputs = example_inputs(blk, {"M": 300, "K": 200, "N": 448}, seed=14)
    outs = cb(inputs)
    ref = blk.run(inputs, sim_tile=(128, 128))
    ref64 = blk.run(inputs, precision="f64")
    assert outs["s"].shape == (300, 7)
    for o in blk.ir.outputs:
        assert o.type is not None
        check_output(o.name, outs[o.name], ref[o.name], ref64[o.name], o.type.dtype)


@pytest.mark.parametrize("name", sorted(NEW_REDUCTIONS))
def test_emulated_min_and_logsumexp_match_interpreter(name: str) -> None:
    """min() and logsumexp() in each mode, at sizes with ragged last tiles along both dims: outputs and
    per-tile partial buffers (a min sink's negated back) match the interpreter at the same tile."""
    text, sizes, tile = NEW_REDUCTIONS[name]
    blk = next(iter(coda_lang.load(text)))
    cb = blk.cuda(tile=tile, emulate=True, poison=True)
    inputs = example_inputs(blk, sizes, seed=21)
    outs, partials = cb.run_with_partials(inputs)
    ref, ref_partials = blk.run_with_partials(inputs, sim_tile=cb.tiles)
    ref64 = blk.run(inputs, precision="f64")
    for o in blk.ir.outputs:
        assert o.type is not None
        check_output(o.name, outs[o.name], ref[o.name], ref64[o.name], o.type.dtype)
    assert set(partials) == {s.name for spec in cb.specs if spec is not None for s in spec.sinks}
    assert bool(partials) == (name != "grouped")
    for k, buf in partials.items():
        check_partial(k, buf, ref_partials[k])


def test_emulated_min_partials_keep_infinities() -> None:
    """min over a value with +-inf (exp of large logits, -exp of them): -max(-x) is exact, so the
    per-tile partials hold the same infinities as the tile simulation."""
    text = """dims M, K, N
block p(x: bf16[M, K], w: bf16[K, N]) -> (r: f32[M], c: f32[N]) {
  gemm x @ w {
    e = exp(acc * 60.0) - exp(acc * -60.0)
    r = min(e, over=N)
    c = min(e, over=M)
  }
}
"""
    blk = next(iter(coda_lang.load(text)))
    cb = blk.cuda(tile=(128, 64), emulate=True, poison=True)
    inputs = example_inputs(blk, {"M": 300, "K": 200, "N": 264}, seed=5)
    _, partials = cb.run_with_partials(inputs)
    _, ref_partials = blk.run_with_partials(inputs, sim_tile=cb.tiles)
    assert np.isinf(ref_partials["r"]).any() and np.isinf(ref_partials["c"]).any()
    for k, buf in partials.items():
        check_partial(k, buf, ref_partials[k])


def test_emulated_backward_reads_a_stored_group_over_its_groups() -> None:
    """The backward of a stored grouped sum, with the forward's acc saved: its elementwise entry stage
    reads the cotangent, one column per group, over each group (`expand`). (The forward's groups of 2
    are too narrow for quack: E0705.)"""
    blk = next(
        iter(
            coda_lang.load(
                "dims M, K, N\nblock p(x: bf16[M, K], w: bf16[K, 2*N]) -> (s: f32[M, N]) {\n"
                "  gemm x @ w {\n    s = sum(acc * acc, over=2*N, group=2)\n  }\n}\n"
            )
        )
    )
    with pytest.raises(CodaError, match="E0705"):
        blk.cuda(emulate=True)
    bwd = blk.grad(remat="save")
    assert any(e.op == "expand" for s in bwd.ir.stages if not s.is_gemm for e in s.body)
    inputs = example_inputs(bwd, {"M": 300, "K": 200, "N": 136}, seed=16)
    outs = bwd.cuda(tile=TILE, emulate=True, poison=True)(inputs)
    ref = bwd.run(inputs, sim_tile=TILE)
    ref64 = bwd.run(inputs, precision="f64")
    for o in bwd.ir.outputs:
        assert o.type is not None
        check_gradient(o.name, outs[o.name], ref[o.name], ref64[o.name], o.type.dtype)


def test_emulated_run_takes_a_dict_or_keywords_and_default_tile() -> None:
    blk = block("llama_mlp")
    cb = blk.cuda(emulate=True)
    inputs = example_inputs(blk, SMALL, seed=4)
    a = cb(inputs)["x2"]
    b = cb(**inputs)["x2"]
    assert torch.equal(a, b)
    assert cb.config(2).tile_n % 32 == 0  # the paired stage's constraint


def test_run_stage_alone_reproduces_the_block_run() -> None:
    blk = block("llama_mlp")
    cb = blk.cuda(tile=TILE, emulate=True)
    env = cb.values(example_inputs(blk, SMALL, seed=5))
    new, partials = cb.run_stage(1, env)
    assert set(new) == {"h", "hg", "ss"} and set(partials) == {"ss"}
    for k in new:
        assert torch.equal(new[k], env[k])


def test_per_stage_tiles_in_the_interpreter() -> None:
    blk = block("llama_mlp")
    inputs = example_inputs(blk, SMALL, seed=6)
    _, p1 = blk.run_with_partials(inputs, sim_tile={1: (128, 64), 2: (128, 64), 3: (128, 64)})
    _, p2 = blk.run_with_partials(inputs, sim_tile=(128, 64))
    np.testing.assert_array_equal(p1["ss"], p2["ss"])
    _, p3 = blk.run_with_partials(inputs, sim_tile={1: (64, 96)})
    assert p3["ss"].shape == (300, 3)


# ------------------------------------------------------------------ autograd


@pytest.mark.parametrize("name", ["linear", "gelu_mlp", "scaled_mlp"])
def test_emulated_autograd_matches_vjp(name: str) -> None:
    blk = coda_lang.load(GRAD_BLOCKS)[name]
    fn = blk.cuda(tile=TILE, emulate=True).autograd()
    inputs = example_inputs(blk, SMALL, seed=7)
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    out = fn(leaves)["out"]
    ct = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    out.backward(ct)
    ref = blk.vjp(inputs, {"out": ct}, sim_tile=TILE)
    ref64 = blk.vjp(inputs, {"out": ct}, precision="f64")
    for p in blk.ir.params:
        g = leaves[p.var.name].grad
        assert g is not None and g.dtype == inputs[p.var.name].dtype
        assert p.var.type is not None
        check_output(f"d{p.var.name}", g, ref[p.var.name], ref64[p.var.name], p.var.type.dtype)


@pytest.mark.parametrize(
    "name", ["llama_mlp", "bias_gelu", "qkv_rope", "lm_head_ce", "llama_block", "qk_norm"]
)
def test_emulated_autograd_of_examples_matches_vjp(name: str) -> None:
    """Every example's backward runs: packed-mode SwiGLU backward (llama_mlp, llama_block), an
    elementwise entry stage (bias_gelu, qkv_rope, llama_block; qk_norm's with grouped sums), a split
    full-width store in a paired stage (the extended forwards of qkv_rope, llama_block and qk_norm save
    the pre-RoPE accumulator)."""
    blk = block(name)
    sizes, tile = sizes_and_tile(name)
    fn = blk.cuda(tile=tile, emulate=True, poison=True).autograd()
    inputs = example_inputs(blk, sizes, seed=11)
    leaves = {k: v.clone().requires_grad_() if v.is_floating_point() else v for k, v in inputs.items()}
    outs = fn(leaves)
    gen = torch.Generator().manual_seed(12)
    cts = {
        o: torch.randn(v.shape, generator=gen).to(v.dtype) for o, v in outs.items() if v.is_floating_point()
    }
    torch.autograd.backward([outs[o] for o in cts], [cts[o] for o in cts])
    ref = blk.vjp(inputs, cts, sim_tile=tile)
    ref64 = blk.vjp(inputs, cts, precision="f64")
    assert ref
    for n in ref:
        g = leaves[n].grad
        assert g is not None and g.dtype == inputs[n].dtype
        t = next(p.var.type for p in blk.ir.params if p.var.name == n)
        assert t is not None
        check_gradient(n, g, ref[n], ref64[n], t.dtype)


# ------------------------------------------------------------------ dims= and the vector ops between stages

DIMS_BLOCKS = """
dims M, K, N, F

block scaled(x: bf16[M, K], w: bf16[K, N], s: f32[M]) -> (out: bf16[M, N]) {
  t = s * F
  gemm x @ w {
    out = acc * t
  }
}

block half_vec(x: bf16[M, K], w: bf16[K, N], p: bf16[N], c: bf16) -> (out: f32[M, N]) {
  v = cos(p) * c
  gemm x @ w {
    out: f32 = acc * v
  }
}

block unused(x: bf16[K, M], w: bf16[N, K], p: f32[M, N], q: f32[N]) -> (out: f32[M, N]) {
  gemm transpose(x) @ transpose(w) {
    out: f32 = acc
  }
}
"""
DIMS = {"M": 40, "K": 24, "N": 48, "F": 7}


def test_dims_no_input_shape_gives() -> None:
    """F is used only as a value: no input's shape gives it, forward or backward (E0804 without it);
    `dims=` on Block.cuda or on the call gives it, and the backward block runs at the forward's dims."""
    blk = coda_lang.load(DIMS_BLOCKS)["scaled"]
    inputs = example_inputs(blk, DIMS, seed=1)
    with pytest.raises(CodaError) as e:
        blk.cuda(tile=(16, 32), emulate=True)(inputs)
    assert e.value.diagnostics[0].code == "E0804" and "F" in e.value.diagnostics[0].message
    ref = blk.run(inputs, dims={"F": 7})["out"]
    ref64 = blk.run(inputs, dims={"F": 7}, precision="f64")["out"]
    check_output(
        "out", blk.cuda(tile=(16, 32), emulate=True, dims={"F": 7})(inputs)["out"], ref, ref64, "bf16"
    )
    check_output(
        "out", blk.cuda(tile=(16, 32), emulate=True)(inputs, dims={"F": 7})["out"], ref, ref64, "bf16"
    )
    assert "F" in {d.name for d in blk.grad().ir.dims}  # the backward's `ds = dt * F`
    for fn, given in (
        (blk.cuda(tile=(16, 32), emulate=True).autograd(tile=(16, 32)), {"F": 7}),
        (blk.cuda(tile=(16, 32), emulate=True, dims={"F": 7}).autograd(tile=(16, 32)), None),
    ):
        leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
        out = fn(leaves, dims=given)["out"]
        ct = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out.dtype)
        out.backward(ct)
        grads = blk.vjp(inputs, {"out": ct}, dims={"F": 7}, sim_tile=(16, 32))
        g64 = blk.vjp(inputs, {"out": ct}, dims={"F": 7}, precision="f64")
        for p in blk.ir.params:
            assert p.var.type is not None
            check_gradient(
                p.var.name, leaves[p.var.name].grad, grads[p.var.name], g64[p.var.name], p.var.type.dtype
            )
    cb = blk.cuda(tile=(16, 32), emulate=True)
    codes = []
    for bad in ({"G": 3}, {"F": 0}, {"F": 2.5}, {"M": 41, "F": 7}):
        with pytest.raises(CodaError) as e:
            cb(inputs, dims=bad)
        codes.append(e.value.diagnostics[0].code)
    assert codes == ["E0804"] * 4
    with pytest.raises(CodaError):
        blk.cuda(emulate=True, dims={"G": 3})


def test_vector_ops_on_16_bit_parameters_compute_in_f32() -> None:
    """`v = cos(p) * c` with p: bf16[N] and c: bf16 runs in f32 on the bf16 values (a Python number for
    c rounded to bf16 first), as the interpreter binds and computes them: no bf16 rounding of v."""
    blk = coda_lang.load(DIMS_BLOCKS)["half_vec"]
    inputs: dict[str, object] = {**example_inputs(blk, DIMS, seed=2), "c": 0.1}
    cb = blk.cuda(tile=(16, 32), emulate=True)
    v = cb.values(inputs)["v"]
    p = inputs["p"]
    assert isinstance(p, torch.Tensor)
    assert v.dtype == torch.float32
    assert torch.equal(v, torch.cos(p.float()) * torch.tensor(0.1).to(torch.bfloat16).float())
    ref = blk.run(inputs)["out"]
    np.testing.assert_allclose(cb(inputs)["out"].numpy(), ref, rtol=1e-6, atol=1e-6)


def test_gradient_stages_that_load_no_tensor() -> None:
    """The backward writes the zero gradients of p and q (no output depends on them) in an elementwise
    stage that loads nothing (`expand` of a row index vector like a column index vector: a tile)."""
    blk = coda_lang.load(DIMS_BLOCKS)["unused"]
    inputs = example_inputs(blk, DIMS, seed=3)
    fn = blk.cuda(tile=(16, 32), emulate=True).autograd(tile=(16, 32))
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    out = fn(leaves)["out"]
    out.backward(torch.ones_like(out))
    assert torch.equal(leaves["p"].grad, torch.zeros_like(inputs["p"]))
    assert torch.equal(leaves["q"].grad, torch.zeros_like(inputs["q"]))
    assert leaves["w"].grad is not None and leaves["w"].grad.abs().max() > 0


def test_autograd_takes_the_blocks_tile() -> None:
    """`blk.cuda(tile=T).autograd()` runs the extended forward and the backward at T too (and a tile
    given to autograd() wins)."""
    blk = block("llama_mlp")
    fn = blk.cuda(tile=(128, 128), emulate=True).autograd()
    assert all(fn.forward.config(k).short == "128x128" for k in fn.forward.gemm_stages)
    assert all(fn.backward.config(k).short == "128x128" for k in fn.backward.gemm_stages)
    other = blk.cuda(tile=(128, 128), emulate=True).autograd(tile=(128, 64))
    assert {other.backward.config(k).short for k in other.backward.gemm_stages} == {"128x64"}


# ------------------------------------------------------------------ torch.compile


def test_block_traces_into_one_graph() -> None:
    blk = block("llama_mlp")
    cb = blk.cuda(tile=TILE, emulate=True)
    inputs = example_inputs(blk, SMALL, seed=9)
    eager = cb(inputs)["x2"]
    explained = torch._dynamo.explain(lambda **kw: cb(**kw)["x2"])(**inputs)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = torch.compile(lambda **kw: cb(**kw)["x2"], backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(**inputs), eager)


def test_eager_launches_skip_the_custom_op_and_traces_record_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """An eager call runs each stage's body directly (torch's Python around a custom op was half of a
    layer forward's host time); a torch.compile trace records the custom op `coda::stage`, whose graph
    gives the eager result."""
    import coda_lang.backend_cute.runtime.launch as launch_mod

    blk = block("llama_mlp")
    cb = blk.cuda(tile=TILE, emulate=True)
    inputs = example_inputs(blk, SMALL, seed=9)
    through_op = []
    real = launch_mod._stage_op

    def counted(key: str, ins: Any, scalars: Any) -> Any:
        through_op.append(key)
        return real(key, ins, scalars)

    with monkeypatch.context() as m:
        m.setattr(torch.ops.coda, "stage", counted)
        eager = cb(inputs)["x2"]
    assert through_op == []
    gm = []

    def backend(g: Any, example_inputs: Any) -> Any:
        gm.append(g)
        return g.forward

    compiled = torch.compile(lambda **kw: cb(**kw)["x2"], backend=backend, fullgraph=True)
    assert torch.equal(compiled(**inputs), eager)
    stages = [n for n in gm[0].graph.nodes if n.op == "call_function" and "coda.stage" in str(n.target)]
    assert len(stages) == len(cb.gemm_stages)


def test_autograd_traces_under_torch_compile() -> None:
    blk = coda_lang.load(GRAD_BLOCKS)["gelu_mlp"]
    fn = blk.cuda(tile=TILE, emulate=True).autograd()
    inputs = example_inputs(blk, SMALL, seed=10)

    def loss(**kw: torch.Tensor) -> torch.Tensor:
        return (fn(**kw)["out"].float() ** 2).sum()

    grads = []
    for f in (loss, torch.compile(loss, backend="aot_eager", fullgraph=True)):
        leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
        f(**leaves).backward()
        grads.append({k: v.grad for k, v in leaves.items()})
    for k in inputs:
        assert torch.equal(grads[0][k], grads[1][k]), k


OUTPUTS_BLOCK = """
dims M, K, N

block outs(x: bf16[M, K], w: bf16[K, N], b: f32[N]) -> (h: bf16[M, N], ss: f32[M], r: f32[M]) {
  gemm x @ w {
    h: bf16 = acc + b
    ss = sum(h * h, over=N)
  }
  r = rsqrt(ss / N + 0.000001)
}
"""


def test_compiled_autograd_outputs_are_tensors_of_their_own() -> None:
    """torch.compile of the autograd function gives eager's gradients for outputs made every way (a
    stored tile, a row reduction combined after its stage, a vector op between stages), and no output
    of the traced forward is a no-op (`x.to(x.dtype)`, `.contiguous()`, `.float()`) of an intermediate:
    PyTorch 2.11 (the GPU host's) drops the gradient of such an output, and every gradient came out
    zero (test_gpu.py::test_torch_compile_of_autograd; PyTorch 2.13 gets them right either way)."""
    blk = coda_lang.load(OUTPUTS_BLOCK)["outs"]
    fn = blk.cuda(tile=(16, 32), emulate=True).autograd(tile=(16, 32))
    inputs = example_inputs(blk, DIMS, seed=14)
    graphs = []

    def backend(gm: torch.fx.GraphModule, example: list[torch.Tensor]) -> object:
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example)

    def loss(**kw: torch.Tensor) -> torch.Tensor:
        outs = fn(**kw)
        return sum(((outs[k].float() * (i + 1)) ** 2).mean() for i, k in enumerate(sorted(outs)))

    grads = []
    for f in (loss, torch.compile(loss, backend=backend, fullgraph=True)):
        leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
        f(**leaves).backward()
        grads.append({k: v.grad for k, v in leaves.items()})
    for k in inputs:
        assert grads[0][k].abs().max() > 0, k
        assert torch.equal(grads[0][k], grads[1][k]), k
    (gm,) = graphs
    (apply,) = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.autograd_function_apply]
    forward = getattr(gm, apply.args[0].target)
    (ret,) = [n for n in forward.graph.nodes if n.op == "output"]
    outs = torch.utils._pytree.tree_leaves(ret.args[0])[: len(fn.outputs)]  # the outputs, then what it saves
    for n in outs:
        same = [a.name for a in n.all_input_nodes if a.meta["example_value"] is n.meta["example_value"]]
        assert not same, f"output `{n.name}` ({n.target}) is the tensor `{same[0]}` itself"


# ------------------------------------------------------------------ errors


def test_unsupported_stages_are_e07(tmp_path: Path) -> None:
    """A stage the backend can't compile (a grouped max over groups of 48 columns) is E0705 when the
    CudaBlock is made, with the source line; for autograd() too."""
    src = tmp_path / "g48.coda"
    src.write_text(
        GROUPED.replace("max(abs(acc + b), over=N, group=64)", "max(abs(acc + b), over=N, group=48)")
    )
    blk = next(iter(coda_lang.load(src)))
    for make in (lambda: blk.cuda(emulate=True), lambda: blk.cuda(emulate=True).autograd()):
        with pytest.raises(CodaError) as e:
            make()
        assert e.value.diagnostics[0].code == "E0705"
        assert "g48.coda:5:" in e.value.render("short") and "group=48" in e.value.render()
    bwd = block("bias_gelu").grad()
    cb = bwd.cuda(emulate=True)  # its elementwise entry stage runs as one fused (torch.compile) kernel
    assert cb.gemm_stages == [k for k in range(1, len(bwd.plan.stages) + 1) if k not in cb.elementwise]
    assert len(cb.elementwise) == 1


@pytest.mark.parametrize("red", ["logsumexp", "min", "sum", "max"])
def test_grouped_reductions_of_one_column_are_e0705(red: str) -> None:
    """`logsumexp(acc, over=N, group=1)` (found by coda fuzz) is a clean E0705 (quack folds runs of 8
    columns at least), not a KeyError in plan/emit."""
    src = f"""
dims M, K, N
block b(x: bf16[M, K], w: bf16[K, N]) -> (out: f32[M, N]) {{
  gemm x @ w {{
    l = {red}(acc, over=N, group=1)
    out: f32 = acc - l
  }}
}}
"""
    with pytest.raises(CodaError) as e:
        coda_lang.load(src)["b"].cuda(emulate=True)
    assert [d.code for d in e.value.diagnostics] == ["E0705"]


def test_stored_rows_must_be_16_bytes() -> None:
    """quack's TMA stores need rows of a multiple of 16 bytes: F = 100 gives llama_mlp's stored `a`
    (bf16[M, F]) rows of 200 bytes, a clean E0807 before any launch."""
    blk = block("llama_mlp")
    inputs = example_inputs(blk, {**SMALL, "F": 100}, seed=13)
    with pytest.raises(CodaError) as e:
        blk.cuda(tile=TILE, emulate=True)(inputs)
    (d,) = e.value.diagnostics
    assert d.code == "E0807" and "`a`" in d.message and "200 bytes" in d.message


def test_groups_must_divide_the_width() -> None:
    """qk_norm without its weight, with 2*P = 272, not a multiple of its group of 128: a clean E0802 from
    the runtime (before any launch; quack would raise a ValueError) and from the interpreter. With its
    weight g, one head's (128 values), the repeated g is refused first, when the inputs are bound."""
    text = (EXAMPLES / "qk_norm.coda").read_text()
    unweighted = coda_lang.load(text.replace("g: f32[HD], ", "").replace(" * g ", " "))["qk_norm"]
    for blk, name in ((unweighted, "ss"), (block("qk_norm"), "g")):
        inputs = example_inputs(blk, {**SMALL, "P": 136}, seed=15)
        for run in (blk.cuda(emulate=True), blk.run):
            with pytest.raises(CodaError) as e:
                run(inputs)
            (d,) = e.value.diagnostics
            assert d.code == "E0802" and f"`{name}`" in d.message and "272" in d.message, d.message
            assert "not a multiple of 128" in d.message


def test_bad_tiles_and_inputs() -> None:
    blk = block("llama_mlp")
    with pytest.raises(CodaError) as e:
        blk.cuda(tile=(128, 48), emulate=True)  # stage 2 stores a paired tile: tile_N % 32 == 0
    assert e.value.diagnostics[0].code == "E0805"
    from coda_lang.backend_cute.build.config import TileConfig

    with pytest.raises(CodaError) as e:  # stage 2 is paired: quack's own epilogue subtile only
        blk.cuda(tile=TileConfig(128, 192, epi_n=16), emulate=True)
    (d,) = e.value.diagnostics
    assert d.code == "E0805" and "stage 2" in d.message and "keeps quack's epilogue subtile" in d.message
    blk.cuda(tile={1: TileConfig(128, 192, epi_n=16), 3: TileConfig(128, 192, epi_n=16)}, emulate=True)
    cb = blk.cuda(tile=TILE, emulate=True)
    inputs = example_inputs(blk, SMALL, seed=11)
    codes = []
    for bad in (
        {k: v for k, v in inputs.items() if k != "y"},
        {**inputs, "nope": inputs["y"]},
        {**inputs, "y": inputs["y"][:, :10]},
        {**inputs, "g": inputs["g"].numpy()},
        {**inputs, "y": inputs["y"].to(torch.int32)},
    ):
        with pytest.raises(CodaError) as e:
            cb(bad)
        codes.append(e.value.diagnostics[0].code)
    assert codes == ["E0801", "E0801", "E0804", "E0803", "E0803"]
    with pytest.raises(CodaError) as e:
        blk.cuda(tile=TILE)(inputs)  # the real runtime: CPU tensors are refused before anything compiles
    assert e.value.diagnostics[0].code == "E0806"


def test_importing_coda_lang_imports_no_torch() -> None:
    import subprocess
    import sys

    code = "import sys, coda_lang; coda_lang.load('examples/llama_mlp.coda'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------ quack accepts the runtime's arguments


def _meta_env(blk: coda_lang.Block, sizes: dict[str, int]) -> dict[str, object]:
    """A "meta" tensor (or a number, for scalars) for every named value of the block, in the dtype the
    runtime holds it in (stored values in their storage dtype, vectors in f32)."""
    from coda_lang.backend_cute.runtime.launch import TORCH_DTYPES
    from coda_lang.ir.nodes import Stage
    from coda_lang.ir.types import extent

    dims = {d.name: sizes[d.name] for d in blk.ir.dims}
    types = {p.var.name: p.var.type for p in blk.ir.params}
    for s in blk.ir.body:
        for e in s.body if isinstance(s, Stage) else (s,):
            types |= {v.name: v.type for v in e.outs}
    env: dict[str, object] = {}
    for name, t in types.items():
        if t is None or t.dtype == "<error>":
            continue
        if not t.shape:
            env[name] = 0.5
            continue
        dtype = blk.plan.storage.get(name) or (
            "f32"
            if t.dtype in ("bf16", "f16")
            and t.kind != "matrix"
            and name not in {p.var.name for p in blk.ir.params}
            else t.dtype
        )
        env[name] = torch.empty([extent(d, dims) for d in t.shape], dtype=TORCH_DTYPES[dtype], device="meta")
    return env


def _dry_run(blk: coda_lang.Block, index: int) -> None:
    from coda_lang.backend_cute.build import quack_adapter

    cb = blk.cuda(tile=(128, 192))
    r = cb.runner(index)
    ins, scalars = r.arguments(
        _meta_env(
            blk, {**SMALL, **{"M": 1000, "D": 520, "F": 1000, "K": 520, "N": 1000, "V": 1000, "P": 500}}
        )
    )
    assert ins[0] is not None and ins[1] is not None
    outs = r.allocate(ins[0], ins[1])
    D, C, epi = r.epilogue_arguments(ins, scalars, outs)
    quack_adapter.launch(r.mod, r.spec, r.config, ins[0], ins[1], D, epi, C=C, dry_run=True)


QUACK = pytest.mark.toolchain
DRY = [
    ("llama_mlp", 1),
    pytest.param("lm_head_ce", 1, marks=pytest.mark.slow),
    ("qkv_rope", 1),
    ("gelu_mlp_bwd", 2),
    pytest.param("gelu_mlp_bwd", 3, marks=pytest.mark.slow),
    pytest.param("llama_mlp", 2, marks=pytest.mark.slow),
    pytest.param("llama_mlp", 3, marks=pytest.mark.slow),
    pytest.param("amax_fp8", 1, marks=pytest.mark.slow),
    pytest.param("scale_residual", 1, marks=pytest.mark.slow),
    pytest.param("bias_gelu", 1, marks=pytest.mark.slow),
    pytest.param("scaled_mlp_bwd", 2, marks=pytest.mark.slow),
    pytest.param("gelu_mlp_bwd", 1, marks=pytest.mark.slow),
    pytest.param("gelu_mlp_bwd", 4, marks=pytest.mark.slow),
]


@QUACK
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize(("name", "index"), DRY)
def test_quack_accepts_the_runtime_arguments(
    name: str, index: int, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the runtime hands quack (operands, stored tiles, partial buffers, the transposed views of a
    backward's GEMMs), as "meta" tensors: quack validates it and compiles the kernel, without a GPU."""
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "coda-kernels"))
    if name.endswith("_bwd"):
        blk = coda_lang.load(GRAD_BLOCKS)[name[:-4]].grad()
    else:
        blk = block(name)
    _dry_run(blk, index)


def test_each_elementwise_stage_compiles_as_its_own_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile keeps compiled graphs, and its recompile limit, per code object: with one shared
    `_body`, every further elementwise stage in a process recompiled it, and the 65th failed
    (FailOnRecompileLimitHit, found by `coda fuzz --programs` on the H100). With the limit at 1, two
    stages (of two blocks: a shared body would recompile at the second) compile and give what the
    eager stage gives."""
    import functools

    import torch._dynamo

    from coda_lang.backend_triton.elementwise import ElementwiseStage

    torch._dynamo.reset()
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    monkeypatch.setenv("CODA_ELEMENTWISE", "inductor")  # (else these stages are generated Triton kernels)
    # Dynamo's graphs and its recompile limit are per code object whatever the backend: the eager
    # backend traces as Inductor does but skips its C++ build (20 s on 2 cores). Inductor's own kernels
    # of these stages are compared with the torch function by tests/test_triton_stage.py's CPU runs.
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    gen = torch.Generator().manual_seed(0)
    for scale in ("1.0", "2.0"):
        blk = next(
            iter(
                coda_lang.load(f"""dims M, K, N
block s{scale[0]}(x: bf16[M, K], w: bf16[K, N], b: f32[N]) -> (out: bf16[M, N]) {{
  gemm x @ w {{
    out = gelu(acc + b) * {scale}
  }}
}}
""")
            )
        ).grad()
        m, n = 24, 16
        env = {
            "dout": torch.randn(m, n, generator=gen).bfloat16(),
            "acc1": torch.randn(m, n, generator=gen).bfloat16(),
            "b": torch.randn(n, generator=gen),
        }
        eager: dict[str, Any] = {}
        compiled: dict[str, Any] = {}
        ElementwiseStage(blk, 1, True).run(dict(env), {"M": m, "N": n, "K": 8}, {}, out=eager)
        stage = ElementwiseStage(blk, 1, False)
        stage.run(dict(env), {"M": m, "N": n, "K": 8}, {}, out=compiled)
        assert stage.own_body().__func__.__code__.co_name == f"coda_s{scale[0]}_bwd_stage1"
        assert set(compiled) == set(eager) and torch.equal(compiled["dacc1"], eager["dacc1"])


def test_emulated_dims_used_as_values_match_interpreter() -> None:
    """Dims inside a stage (`acc / K`) are Scalar operands the runtime fills with the call's sizes: at
    two ragged sizes the same CudaBlock matches the interpreter, and `values()` shows the sizes."""
    blk = next(iter(coda_lang.load(DIMS_AS_VALUES)))
    cb = blk.cuda(tile=(64, 64), emulate=True, poison=True)
    for sizes, seed in (({"M": 200, "K": 72, "N": 136}, 3), ({"M": 72, "K": 24, "N": 264}, 4)):
        inputs = example_inputs(blk, sizes, seed=seed)
        outs, partials = cb.run_with_partials(inputs)
        ref, ref_partials = blk.run_with_partials(inputs, sim_tile=(64, 64))
        for o in blk.ir.outputs:
            assert o.type is not None
            check_output(o.name, outs[o.name], ref[o.name], None, o.type.dtype)
        check_partial("s", partials["s"], ref_partials["s"])
        vals = cb.values(inputs)
        assert {k: vals[k] for k in ("%M", "%K", "%N")} == {f"%{k}": v for k, v in sizes.items()}


def test_emulated_sums_past_the_ragged_end_match_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """quack's sums fold the ragged last tile's elements past the end of the reduced dim, where the
    epilogue computes f(acc = 0, ...), not 0; the emulated kernel folds what quack's would (stale shared
    memory as NaN). With the planner's masks (`bounded` sums: exp(0), stale vectors; a max of abs()
    is quack's max, masked by quack itself) outputs and partials match the interpreter at ragged sizes along both dims; without
    them, the same emulated run does not (which is what the GPU did before the masks)."""
    from coda_lang.backend_cute.plan import sinks

    blk = next(iter(coda_lang.load(RAGGED_SUMS)))
    sizes, tile = {"M": 200, "K": 72, "N": 136}, (64, 64)
    inputs = example_inputs(blk, sizes, seed=5)
    ref, ref_partials = blk.run_with_partials(inputs, sim_tile=tile)
    outs, partials = blk.cuda(tile=tile, emulate=True, poison=True).run_with_partials(inputs)
    for o in blk.ir.outputs:
        assert o.type is not None
        check_output(o.name, outs[o.name], ref[o.name], None, o.type.dtype)
    for k, buf in partials.items():
        check_partial(k, buf, ref_partials[k])
    monkeypatch.setattr(sinks, "is_zero", lambda v: True)  # no masks: every sum trusted to be 0 there
    unmasked, _ = blk.cuda(tile=tile, emulate=True, poison=True).run_with_partials(inputs)
    for name in ("s", "u", "v"):  # the masked ones: wrong, or NaN from the stale vectors
        got, want = unmasked[name].double(), torch.as_tensor(np.asarray(ref[name], dtype=np.float64))
        assert not torch.allclose(got, want, rtol=1e-3, atol=1e-3), name
    for name in ("q", "z"):  # 0 past the end either way
        check_output(name, unmasked[name], ref[name], None, "f32")


def test_tile_constraints_are_typed_values() -> None:
    """A tiling constraint is a TileConstraint (ir/types.py): the checker's (whole groups), the planner's
    (pairs, paired stores, groups within the epilogue subtile) and the backend's own rules print as
    `coda check --explain` and the emitted source show them, and `fits` evaluates them on a config's
    values without reading text; a tile given that breaks some is E0805 listing those, only those."""
    from fractions import Fraction

    from coda_lang.backend_cute.build.config import PAIRED_SUBTILE, TileConfig, broken, rules, tile_values
    from coda_lang.backend_cute.plan.planner import plan_stage
    from coda_lang.ir.types import TileConstraint

    c = TileConstraint(of="tile_N", multiple_of=128, reason="group=128 over `N`")
    assert str(c) == "tile_N % 128 == 0 (group=128 over `N`)"
    assert c.holds({"tile_N": 256}) and not c.holds({"tile_N": 192})
    half = TileConstraint(of="tile_N", multiple_of=Fraction(3, 2), reason="group=3 over `2*N`")
    assert str(half) == "tile_N % 3/2 == 0 (group=3 over `2*N`)"
    assert half.holds({"tile_N": 9}) and not half.holds({"tile_N": 4})
    sub = TileConstraint(of="the epilogue subtile's N", divides=16, reason="whole groups")
    assert str(sub) == "16 % the epilogue subtile's N == 0 (whole groups)"
    assert sub.holds({"the epilogue subtile's N": 16}) and not sub.holds({"the epilogue subtile's N": 32})
    assert str(TileConstraint(of="cooperative", equals=0, reason="r")) == "cooperative == 0 (r)"
    for relations in ({}, {"multiple_of": 2, "equals": 0}, {"multiple_of": 0}):
        with pytest.raises(ValueError):
            TileConstraint(of="tile_N", reason="r", **relations)

    blk = block("llama_mlp")
    spec = plan_stage(blk, 2)  # paired, with a TileStore
    assert [str(c) for c in spec.tiling] == [
        "tile_N % 2 == 0 (pairs of adjacent columns)",
        "tile_N % 32 == 0 (paired TileStore on SM90)",
    ]
    assert rules(spec) == [*spec.tiling, PAIRED_SUBTILE]
    assert tile_values(spec, TileConfig(128, 48))["tile_N"] == 48
    assert broken(spec, TileConfig(128, 48)) == [spec.tiling[1]]
    assert broken(spec, TileConfig(128, 48, epi_n=16)) == [spec.tiling[1], PAIRED_SUBTILE]
    with pytest.raises(CodaError) as e:
        blk.cuda(tile=(128, 48), emulate=True)
    (d,) = e.value.diagnostics
    assert d.code == "E0805" and d.message.endswith("`): tile_N % 32 == 0 (paired TileStore on SM90)")
    (checked,) = block("qk_norm").plan.stages[0].tiling  # the checker's, as the plan holds it
    assert checked == TileConstraint(of="tile_N", multiple_of=128, reason="group=128 over `2*P`")
    assert block("qk_norm").plan.stages[0].constraints == (str(checked),)  # (what coda draw prints)


def test_a_group_narrower_than_the_epilogue_subtile_is_refused() -> None:
    """quack's grouped statistics fold one slot per thread and epilogue subtile (N = gcd(32, tile_N)
    unless epi_n says otherwise): a group of 16 columns under a 32-column subtile would be folded with
    its neighbour (found on an H100: Qwen3's q/k norm at head_dim 16 came out scaled by ~1/sqrt 2). Only
    tiles whose subtile divides the group fit; a tile given that doesn't is E0805 naming the rule."""
    from coda_lang.backend_cute.build.config import CANDIDATES, TileConfig, epilogue_subtile_n, fits
    from coda_lang.backend_cute.plan.planner import plan_stage

    src = EXAMPLES.joinpath("qk_norm.coda").read_text().replace("HD = 128", "HD = 16")  # group=HD
    blk = coda_lang.load(src)["qk_norm"]
    spec = plan_stage(blk, 1)
    ok = [c for c in CANDIDATES if fits(spec, c)]
    assert ok and all(16 % epilogue_subtile_n(spec, c) == 0 for c in ok)
    assert TileConfig(128, 192) not in ok and TileConfig(128, 176) in ok
    with pytest.raises(CodaError) as e:
        blk.cuda(tile=(128, 192), emulate=False)
    (d,) = e.value.diagnostics
    assert d.code == "E0805" and "epilogue subtile" in d.message
    blk.cuda(tile=(128, 192), emulate=True)  # the stand-ins fold each group exactly at any subtile
    at128 = plan_stage(block("qk_norm"), 1)
    assert TileConfig(128, 128) in [c for c in CANDIDATES if fits(at128, c)]


def test_consumed_run_writes_packed_d_into_c_and_drops_dead_values() -> None:
    """A backward run with `consume` (what autograd's backward passes: the forward's saved intermediates)
    equals the plain run; its packed SwiGLU-backward stage writes dacc2 into the saved acc2's buffer
    (one [M, 2F] buffer instead of two), and values are dropped after their last read."""
    import torch

    blk = coda_lang.load(EXAMPLES / "llama_mlp.coda")["llama_mlp"]
    d = blk.derivation(None, "save")
    inputs = example_inputs(blk, {"M": 96, "D": 64, "F": 40}, seed=3)
    saved = d.forward.cuda(emulate=True, tile=(64, 64))(inputs)
    gen = torch.Generator().manual_seed(4)
    bins: dict[str, Any] = {}
    for p in d.backward.ir.params:
        n = p.var.name
        if n in d.cotangents.values():
            bins[n] = torch.randn(saved["x2"].shape, generator=gen).to(torch.bfloat16)
        else:
            bins[n] = saved[n] if n in saved else inputs[n]
    cb = d.backward.cuda(emulate=True, tile=(64, 64))
    plain = cb._call(dict(bins), None)[0]
    spec = next(s for s in cb.specs if s is not None and s.c is not None)
    c_name = spec.c.name
    c_before = bins[c_name].clone()
    ptr = bins[c_name].data_ptr()
    env, _, _ = cb._run(dict(bins), None, frozenset({c_name}))
    assert spec.d is not None
    assert not torch.equal(bins[c_name], c_before)  # overwritten in place ...
    consumed = cb._call({**bins, c_name: c_before.clone()}, None, frozenset({c_name}))[0]
    for k, v in plain.items():
        assert torch.equal(consumed[k], v), k
    assert c_name not in env and spec.d.name not in env  # ... and both dropped after their last read
    assert bins[c_name].data_ptr() == ptr
    # without `consume`, nothing the caller passed is written
    again = dict(bins)
    again[c_name] = c_before.clone()
    keep = again[c_name].clone()
    cb._call(again, None)
    assert torch.equal(again[c_name], keep)


def test_autograd_backward_overwrites_only_its_own_saved_tensor_and_refuses_a_second_run() -> None:
    """llama_mlp's SwiGLU backward writes its cotangent into the saved pre-activation (made by the
    forward, never the caller's); the gradients still match Block.vjp, the caller's inputs are untouched,
    and a second backward through the same graph (retain_graph=True) is refused with a clear error."""
    import torch

    blk = coda_lang.load(EXAMPLES / "llama_mlp.coda")["llama_mlp"]
    fn = blk.cuda(emulate=True, tile=(64, 64)).autograd(remat="save")
    assert fn.inplace == {"acc2"}
    inputs = example_inputs(blk, {"M": 96, "D": 64, "F": 40}, seed=5)
    copies = {k: v.clone() for k, v in inputs.items()}
    leaves = {k: v.clone().requires_grad_() if v.is_floating_point() else v for k, v in inputs.items()}
    x2 = fn(leaves)["x2"]
    ct = torch.randn(x2.shape, generator=torch.Generator().manual_seed(6)).to(x2.dtype)
    x2.backward(ct, retain_graph=True)
    ref = blk.vjp(inputs, {"x2": ct}, sim_tile=(64, 64), remat="save")
    for n, g in ref.items():
        want = torch.from_numpy(np.asarray(g, dtype=np.float64))
        assert torch.allclose(leaves[n].grad.double(), want, rtol=2e-2, atol=1e-2), n
    for k, v in inputs.items():
        assert torch.equal(v, copies[k]), k
    with pytest.raises(RuntimeError, match="retain_graph"):
        x2.backward(ct)


def test_an_index_past_what_f32_holds_exactly_is_refused() -> None:
    """col_index() reaches the kernel as an f32: a stage wider than 2**24 columns is E0703 before
    anything is launched (the same check on the emulated path)."""
    import torch

    text = (
        "dims M, K, N\nblock p(x: bf16[M, K], w: bf16[K, N], t: i32[M]) -> (y: bf16[M, N]) {\n"
        "  gemm x @ w {\n    y = where(col_index() == t, acc, 0.0)\n  }\n}\n"
    )
    cb = coda_lang.load(text)["p"].cuda(emulate=True, tile=(64, 64))
    ok = cb(
        {
            "x": torch.ones(2, 1, dtype=torch.bfloat16),
            "w": torch.ones(1, 16, dtype=torch.bfloat16),
            "t": torch.tensor([3, -1], dtype=torch.int32),
        }
    )["y"]
    assert ok[0].tolist() == [0.0] * 3 + [1.0] + [0.0] * 12 and not ok[1].any()
    n = 2**24 + 8
    with pytest.raises(CodaError, match="E0703") as e:
        cb(
            {
                "x": torch.ones(1, 1, dtype=torch.bfloat16),
                "w": torch.ones(1, n, dtype=torch.bfloat16),
                "t": torch.zeros(1, dtype=torch.int32),
            }
        )
    assert f"indexes {n} columns" in str(e.value)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_operands_with_short_rows_are_padded_for_tma(dtype: str) -> None:
    """A GEMM operand whose rows are not a multiple of 16 bytes (K = 4 bf16 values) goes to the kernel as
    a copy in rows padded to 16 bytes, viewed at its own shape and with its own major dim (quack's
    launch refused the 8-byte rows of tests/test_trig.py's GPU test: `strides[0] ... divisible by
    8`); an aligned operand is passed as it is."""
    torch = pytest.importorskip("torch")
    t = getattr(torch, dtype)
    unit = 16 // torch.empty((), dtype=t).element_size()
    rows = torch.randn(6, 3, dtype=t)  # K-major, 3 values a row
    cols = torch.randn(3, 6, dtype=t).t()  # M-major, rows of 3 along dim 0
    for x in (rows, cols):
        y = _operand(x)
        assert y.shape == x.shape and torch.equal(y, x)
        major = 1 if x.stride(1) == 1 else 0
        assert y.stride(major) == 1 and y.stride(1 - major) % unit == 0, (x.stride(), y.stride())
        assert y.data_ptr() % 16 == 0
    ok = torch.randn(6, unit * 2, dtype=t)
    assert _operand(ok) is ok
