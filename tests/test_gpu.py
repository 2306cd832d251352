"""The CUDA runtime on a Hopper GPU: quack kernels against the interpreter (run: pytest -m gpu).

Every test is marked `gpu` and skipped without a CUDA GPU (tests/conftest.py). On the GPU host:
`source .gpu/env/gpu.sh; python -m pytest -q -m gpu tests/test_gpu.py` (scripts/gpu_check.sh).

- Forward of llama_mlp, bias_gelu, scale_residual, amax_fp8, lm_head_ce, qkv_rope, llama_block, qk_norm
  at sizes that are multiples of no tile (M=1000, D=520, F=1000, ...; qk_norm's 2*P = 1152 holds whole
  heads of 128; bf16), each stage at the tile `select_config` picks: outputs against
  `Block.run(..., sim_tile=cb.tiles)` on the same bf16 inputs copied to the CPU, and against float64
  (tests/runtime_check.py states the two tolerance rules: elementwise within a bf16 ulp of the
  interpreter, and an f64 error at most twice the interpreter's); every output buffer is poisoned with
  NaN first, so an unwritten element fails.
- Partial buffers (row partials [m, ceil(n/tile_N)], column partials [ceil(m/tile_M), n]) against
  the interpreter's tile simulation, 1e-3 relative.
- min(), grouped min and logsumexp (tests/reduction_programs.py) in each
  mode: outputs, partial buffers and one launch per stage, as above.
- Exactly one kernel launch per GEMM stage (torch.profiler: one kernel named after the stage's emitted
  epilogue per stage; a stage run alone launches that kernel and nothing else but pick's zero fill).
- Backward: every example's derived backward block (GEMM stages, the packed SwiGLU backward, elementwise
  entry stages) on the GPU against the interpreter on the same inputs, partial buffers against the tile
  simulation, one kernel launch per GEMM stage; and `CudaBlock.autograd()` of every example (and of
  runtime_check.GRAD_BLOCKS) against `Block.vjp` and float64.
- torch.compile (inductor) of a block and of its autograd function, and CUDA-graph replay of a block,
  give the eager results; a scalar passed as a CUDA tensor (a kernel reading it through a pointer)
  gives the same as a Python float.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from reduction_programs import NEW_REDUCTIONS
from runtime_check import (
    DIMS_AS_VALUES,
    GRAD_BLOCKS,
    RAGGED,
    RAGGED_SUMS,
    check_gradient,
    check_output,
    check_partial,
    example_inputs,
)

import coda_lang

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
os.environ.setdefault(
    "CODA_TUNE", "0"
)  # tile tuning has its own test (test_tuning_...); the others use select_config

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FORWARD = [
    "llama_mlp",
    "bias_gelu",
    "scale_residual",
    "amax_fp8",
    "lm_head_ce",
    "qkv_rope",
    "llama_block",
    "qk_norm",
]
# qk_norm's per-head sum (group=128) needs 2*P a multiple of 128: 2*P = 1152 (M = 1000, D = 520 stay ragged)
SIZES = {"qk_norm": {**RAGGED, "P": 576}}


def sizes(name: str) -> dict[str, int]:
    return SIZES.get(name, RAGGED)


def block(name: str) -> coda_lang.Block:
    return coda_lang.load(EXAMPLES / f"{name}.coda")[name]


@dataclass
class Run:
    blk: coda_lang.Block
    cb: Any
    inputs: dict[str, Any]
    outs: dict[str, Any]
    partials: dict[str, Any]
    ref: dict[str, Any]
    ref_partials: dict[str, Any]
    ref64: dict[str, Any]
    ref64_partials: dict[str, Any]  # the tile simulation in float64 (for partials that cancel)


_RUNS: dict[str, Run] = {}


def run(name: str) -> Run:
    """The example at RAGGED sizes on the GPU and on the interpreter (cached for the module's tests)."""
    if name not in _RUNS:
        blk = block(name)
        cb = blk.cuda(poison=True)
        inputs = example_inputs(blk, sizes(name), seed=1, device="cuda")
        outs, partials = cb.run_with_partials(inputs)
        torch.cuda.synchronize()
        cpu = {k: v.cpu() for k, v in inputs.items()}
        ref, ref_partials = blk.run_with_partials(cpu, sim_tile=cb.tiles)
        ref64, ref64_partials = blk.run_with_partials(cpu, sim_tile=cb.tiles, precision="f64")
        _RUNS[name] = Run(blk, cb, inputs, outs, partials, ref, ref_partials, ref64, ref64_partials)
    return _RUNS[name]


@pytest.mark.parametrize("name", FORWARD)
def test_forward_matches_interpreter(name: str) -> None:
    r = run(name)
    print(f"\n{name}: tiles {r.cb.tiles}")
    for o in r.blk.ir.outputs:
        assert o.type is not None
        got = r.outs[o.name]
        assert got.is_cuda
        check_output(o.name, got, r.ref[o.name], r.ref64[o.name], o.type.dtype)


@pytest.mark.parametrize("name", FORWARD)
def test_partials_match_tile_simulation(name: str) -> None:
    r = run(name)
    for spec in r.cb.specs:
        for s in spec.sinks if spec is not None else ():
            assert s.name in r.partials, s.name
    for k, buf in r.partials.items():
        check_partial(k, buf, r.ref_partials[k], r.ref64_partials[k])


def check_against_interpreter(blk: coda_lang.Block, cb: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """One GPU run of `cb` against the interpreter on the same inputs at the kernels' tiles: every output
    (and against float64), every partial buffer against the tile simulation; the partials."""
    outs, partials = cb.run_with_partials(inputs)
    torch.cuda.synchronize()
    cpu = {k: v.cpu() for k, v in inputs.items()}
    ref, ref_partials = blk.run_with_partials(cpu, sim_tile=cb.tiles)
    ref64, ref64_partials = blk.run_with_partials(cpu, sim_tile=cb.tiles, precision="f64")
    for o in blk.ir.outputs:
        assert o.type is not None
        check_output(o.name, outs[o.name], ref[o.name], ref64[o.name], o.type.dtype)
    for k, buf in partials.items():
        check_partial(k, buf, ref_partials[k], ref64_partials[k])
    return partials


@pytest.mark.parametrize("name", sorted(NEW_REDUCTIONS))
def test_min_and_logsumexp_match_interpreter(name: str) -> None:
    """min() (the kernel folds the negation by max),
    grouped min and logsumexp (epi_ops.GroupedReduce) in element, acc_pair and packed mode, at ragged
    sizes and the tile select_config picks: outputs against the interpreter and f64, every partial
    buffer against the tile simulation, one kernel per stage."""
    text, sizes, _ = NEW_REDUCTIONS[name]
    blk = next(iter(coda_lang.load(text)))
    cb = blk.cuda(poison=True)
    inputs = example_inputs(blk, sizes, seed=7, device="cuda")
    partials = check_against_interpreter(blk, cb, inputs)
    print(f"\n{name}: tiles {cb.tiles}")
    assert set(partials) == {s.name for spec in cb.specs if spec is not None for s in spec.sinks}
    check_one_launch_per_gemm_stage(blk.cuda(tile=cb.tiles), inputs)  # (not poisoned: no NaN fills)


def kernel_names(fn: Any) -> list[str]:
    """Names of the CUDA kernels (memsets and copies excluded) that one call of `fn` launches."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    try:  # every activity kineto recorded, GPU kernels included
        names = [
            e.name() for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA
        ]
    except AttributeError:
        names = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    assert names, "the profiler recorded no CUDA activity"
    return [n for n in names if not n.startswith(("Memset", "Memcpy"))]


def check_one_launch_per_gemm_stage(cb: Any, inputs: dict[str, Any]) -> None:
    names = kernel_names(lambda: cb(inputs))
    for spec in cb.specs:
        if spec is None:
            continue
        mine = [n for n in names if f"_{spec.fn_name}_" in n]
        sharing = sum(s is not None and s.fn_name == spec.fn_name for s in cb.specs)  # plain stages share
        assert len(mine) == sharing, (
            f"stage {spec.index}: {len(mine)} launches of {spec.fn_name}; kernels: {names}"
        )
    env = cb.values(inputs)
    for k in cb.gemm_stages:
        spec = cb.specs[k - 1]
        runner = cb.runner(k)
        ins, scalars = runner.arguments(env)
        names = kernel_names(
            lambda runner=runner, ins=ins, scalars=scalars: torch.ops.coda.stage(runner.key, ins, scalars)
        )
        mine = [n for n in names if f"_{spec.fn_name}_" in n]
        others = [n for n in names if n not in mine]
        # a pick's output is prefilled from its indices (launch._prefill_select): zeros, clamp, eq, masked_fill
        fills = 4 * sum(s.op == "ColVecSelect" for s in spec.sinks)
        assert len(mine) == 1 and len(others) <= fills, f"stage {k} alone launched {names}"


@pytest.mark.parametrize("name", FORWARD)
def test_one_kernel_launch_per_stage(name: str) -> None:
    r = run(name)
    check_one_launch_per_gemm_stage(r.blk.cuda(), r.inputs)  # not poisoned: no fill kernels


BWD_TILE = (128, 128)


@dataclass
class BackwardRun:
    bwd: coda_lang.Block
    cb: Any
    inputs: dict[str, Any]


_BWD: dict[str, BackwardRun] = {}


def backward_run(name: str) -> BackwardRun:
    """The example's derived backward block with its inputs: the saved tensors from the extended forward
    run on the GPU, the forward's inputs, random cotangents (cached for the module's tests)."""
    if name not in _BWD:
        blk = block(name)
        d = blk.derivation()
        inputs = example_inputs(blk, sizes(name), seed=5, device="cuda")
        saved = d.forward.cuda(tile=BWD_TILE)(inputs)
        gen = torch.Generator("cuda").manual_seed(6)
        cot = {c: o for o, c in d.cotangents.items()}
        bins: dict[str, Any] = {}
        for p in d.backward.ir.params:
            n = p.var.name
            if n in cot:
                like = saved[cot[n]]
                bins[n] = torch.randn(like.shape, device="cuda", generator=gen).to(like.dtype)
            elif n in saved:
                bins[n] = saved[n]
            elif n in inputs:
                bins[n] = inputs[n]
        _BWD[name] = BackwardRun(d.backward, d.backward.cuda(tile=BWD_TILE, poison=True), bins)
    return _BWD[name]


@pytest.mark.parametrize("name", FORWARD)
def test_backward_block_matches_interpreter(name: str) -> None:
    r = backward_run(name)
    outs, partials = r.cb.run_with_partials(r.inputs)
    torch.cuda.synchronize()
    cpu = {k: v.cpu() for k, v in r.inputs.items()}
    ref, ref_partials = r.bwd.run_with_partials(cpu, sim_tile=BWD_TILE)
    ref64, ref64_partials = r.bwd.run_with_partials(cpu, sim_tile=BWD_TILE, precision="f64")
    print(
        f"\n{r.bwd.name}: GEMM stages {r.cb.gemm_stages}, elementwise {sorted(r.cb.elementwise)}, "
        f"modes {[s.mode for s in r.cb.specs if s is not None]}"
    )
    for o in r.bwd.ir.outputs:
        assert o.type is not None
        check_gradient(o.name, outs[o.name], ref[o.name], ref64[o.name], o.type.dtype)
    for spec in r.cb.specs:
        for s in spec.sinks if spec is not None else ():
            assert s.name in partials, s.name
    for k, buf in partials.items():
        check_partial(k, buf, ref_partials[k], ref64_partials[k])


@pytest.mark.parametrize("name", FORWARD)
def test_backward_one_kernel_launch_per_gemm_stage(name: str) -> None:
    r = backward_run(name)
    check_one_launch_per_gemm_stage(r.bwd.cuda(tile=BWD_TILE), r.inputs)


# under --remat recompute, the backward of these examples' entry stage sums over the rows of a
# half-width (paired) tile, which the planner refuses (E0705); `auto` leaves them saved
RECOMPUTE_REFUSED = {"llama_block", "qk_norm", "qkv_rope"}


@pytest.mark.parametrize("remat", ["save", "auto", "recompute"])
@pytest.mark.parametrize("name", FORWARD)
def test_example_autograd_matches_vjp(name: str, remat: str) -> None:
    blk = block(name)
    if remat == "recompute" and name in RECOMPUTE_REFUSED:
        with pytest.raises(coda_lang.CodaError, match="E0705"):
            blk.cuda(tile=BWD_TILE, poison=True).autograd(remat=remat)
        return
    fn = blk.cuda(tile=BWD_TILE, poison=True).autograd(remat=remat)
    inputs = example_inputs(blk, sizes(name), seed=7, device="cuda")
    leaves = {k: v.clone().requires_grad_() if v.is_floating_point() else v for k, v in inputs.items()}
    outs = fn(leaves)
    gen = torch.Generator("cuda").manual_seed(8)
    cts = {
        o: torch.randn(v.shape, device="cuda", generator=gen).to(v.dtype)
        for o, v in outs.items()
        if v.is_floating_point()
    }
    torch.autograd.backward([outs[o] for o in cts], [cts[o] for o in cts])
    cpu = {k: v.cpu() for k, v in inputs.items()}
    cts_cpu = {k: v.cpu() for k, v in cts.items()}
    ref = blk.vjp(cpu, cts_cpu, sim_tile=BWD_TILE, remat=remat)
    ref64 = blk.vjp(cpu, cts_cpu, precision="f64", remat=remat)
    assert ref
    for n in ref:
        g = leaves[n].grad
        t = next(p.var.type for p in blk.ir.params if p.var.name == n)
        assert g is not None and t is not None and g.dtype == inputs[n].dtype
        check_gradient(n, g, ref[n], ref64[n], t.dtype)


def test_llama_mlp_fresh_inputs_other_tile() -> None:
    blk = block("llama_mlp")
    cb = blk.cuda(tile=(128, 128), poison=True)
    inputs = example_inputs(blk, {**RAGGED, "M": 777, "D": 392, "F": 600}, seed=2, device="cuda")
    outs, partials = cb.run_with_partials(inputs)
    cpu = {k: v.cpu() for k, v in inputs.items()}
    ref, ref_partials = blk.run_with_partials(cpu, sim_tile=(128, 128))
    ref64 = blk.run(cpu, precision="f64")
    check_output("x2", outs["x2"], ref["x2"], ref64["x2"], "bf16")
    check_partial("ss", partials["ss"], ref_partials["ss"])
    again = cb(inputs)["x2"]
    assert torch.equal(again, outs["x2"]), "two runs on the same inputs differ (a race?)"


def test_scalar_operand_as_cuda_tensor() -> None:
    r = run("scale_residual")
    cb = r.blk.cuda()
    as_float = cb({**r.inputs, "alpha": 0.75})["out"]
    as_tensor = cb({**r.inputs, "alpha": torch.tensor(0.75, device="cuda")})["out"]
    assert torch.equal(as_float, as_tensor)
    cpu = {k: v.cpu() for k, v in r.inputs.items()}
    ref = r.blk.run({**cpu, "alpha": np.float32(0.75)}, sim_tile=cb.tiles)
    check_output("out", as_float, ref["out"], None, "bf16")


@pytest.mark.parametrize("name", ["linear", "gelu_mlp", "scaled_mlp"])
def test_backward_matches_vjp(name: str) -> None:
    blk = coda_lang.load(GRAD_BLOCKS)[name]
    tile = (128, 128)
    fn = blk.cuda(tile=tile, poison=True).autograd()
    inputs = example_inputs(blk, RAGGED, seed=3, device="cuda")
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    out = fn(leaves)["out"]
    ct = torch.randn(out.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(4)).to(
        torch.bfloat16
    )
    out.backward(ct)
    cpu = {k: v.cpu() for k, v in inputs.items()}
    ref = blk.vjp(cpu, {"out": ct.cpu()}, sim_tile=tile)
    ref64 = blk.vjp(cpu, {"out": ct.cpu()}, precision="f64")
    check_output("out", out, blk.run(cpu, sim_tile=tile)["out"], blk.run(cpu, precision="f64")["out"], "bf16")
    for p in blk.ir.params:
        g = leaves[p.var.name].grad
        assert g is not None and g.dtype == inputs[p.var.name].dtype
        assert p.var.type is not None
        check_output(f"d{p.var.name}", g, ref[p.var.name], ref64[p.var.name], p.var.type.dtype)


def test_torch_compile_of_a_block() -> None:
    r = run("llama_mlp")
    cb = r.blk.cuda()
    eager = cb(r.inputs)["x2"]
    compiled = torch.compile(lambda **kw: cb(**kw)["x2"], fullgraph=True)
    check_output("x2 (torch.compile)", compiled(**r.inputs), eager, None, "bf16")


def test_torch_compile_of_autograd() -> None:
    blk = coda_lang.load(GRAD_BLOCKS)["gelu_mlp"]
    fn = blk.cuda(tile=(128, 128)).autograd()
    inputs = example_inputs(blk, RAGGED, seed=5, device="cuda")

    def loss(**kw: Any) -> Any:
        return (fn(**kw)["out"].float() ** 2).mean()

    grads = []
    for f in (loss, torch.compile(loss, fullgraph=True)):
        leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
        f(**leaves).backward()
        grads.append({k: v.grad for k, v in leaves.items()})
    for k in grads[0]:
        print(
            f"d{k}: eager max |g| {grads[0][k].abs().max().item():.3e}, compiled {grads[1][k].abs().max().item():.3e}"
        )
    for p in blk.ir.params:
        assert p.var.type is not None
        check_output(
            f"d{p.var.name} (torch.compile)",
            grads[1][p.var.name],
            grads[0][p.var.name],
            None,
            p.var.type.dtype,
        )


def test_cuda_graph_replay() -> None:
    r = run("llama_mlp")
    cb = r.blk.cuda()
    eager = cb(r.inputs)["x2"]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cb(r.inputs)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cb(r.inputs)["x2"]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


def test_tuning_picks_a_measured_tile_and_caches_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With tuning, the first call returns once each stage has its first spill-free tile, the other
    candidates compiling in the background (and runs right at those tiles); each stage's first launch
    after they are compiled times them and keeps the fastest; the choice lands in <cache>/tuning.json
    and a second CudaBlock reuses it without timing."""
    import coda_lang.torch as ct
    from coda_lang.backend_cute.build import tune

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CODA_JOBS", "3")  # (fewer workers than kernels: the first call returns before all)
    blk = block("llama_mlp")
    inputs = example_inputs(blk, RAGGED, seed=21, device="cuda")
    cpu = {k: v.cpu() for k, v in inputs.items()}
    f64 = blk.run(cpu, precision="f64")["x2"]
    cb = blk.cuda(tune=True, poison=True)
    first = cb(inputs)["x2"]
    assert cb.tuner.background is not None and not cb.tuner.background.over  # (compiling the rest)
    check_output("x2", first, blk.run(cpu, sim_tile=cb.tiles)["x2"], f64, "bf16")
    assert ct.wait_for_kernels(timeout=900) and cb.tuner.background.over
    outs, partials = cb.run_with_partials(inputs)
    data = json.loads((tmp_path / "tuning.json").read_text())
    assert len(data) == 3 and all(len(e["ms"]) >= 1 for e in data.values())
    print("\n" + json.dumps(data, indent=1))
    ref, ref_partials = blk.run_with_partials(cpu, sim_tile=cb.tiles)
    check_output("x2", outs["x2"], ref["x2"], f64, "bf16")
    for k, buf in partials.items():
        check_partial(k, buf, ref_partials[k])

    def no_timing(*a: Any, **k: Any) -> Any:
        raise AssertionError("the tuning cache was not used")

    monkeypatch.setattr(tune, "measure", no_timing)
    again = blk.cuda(tune=True)
    assert torch.equal(again(inputs)["x2"], cb(inputs)["x2"])
    assert again.tiles == cb.tiles


def test_fuzz_cuda_target_does_not_tune() -> None:
    """`coda fuzz --target cuda` draws a new shape for every case; tuning would compile and time every tile
    config at each one, so the fuzzer's CudaBlocks (forward and autograd) keep the backend's tile."""
    from coda_lang.fuzz import Fuzzer

    fz = Fuzzer(block("scale_residual"), "cuda")
    assert fz.cb is not None and fz.cb.tune is False
    assert fz.fn is not None and fz.fn.forward.tune is False and fz.fn.backward.tune is False


PICK = """dims M, K, N
block p(x: bf16[M, K], w: bf16[K, N], t: i32[M]) -> (v: f32[M], y: bf16[M, N]) {
  gemm x @ w {
    h = acc + 1.0
    y = h
    v = pick(rsqrt(h * h + 0.5), t)
  }
}
"""


def test_pick_leaves_indices_past_n_alone() -> None:
    """An index in [N, the end of the ragged last column tile) is out of range: the row reads 0, as in the
    interpreter (quack's ColVecSelect alone would select the padded column: rsqrt(1 + 0.5) here; found by
    `coda fuzz --programs` on the H100). Indices: in range, -100, N, N + 1, the tile's last column."""
    blk = next(iter(coda_lang.load(PICK)))
    cb = blk.cuda(tile=(128, 128), poison=True)
    m, n = 200, 264
    inputs = example_inputs(blk, {"M": m, "K": 136, "N": n}, seed=9, device="cuda")
    t = torch.tensor([[5, -100, n, n + 1, 383, n - 1, 0, 130][i % 8] for i in range(m)], dtype=torch.int32)
    inputs["t"] = t.cuda()
    outs = cb(inputs)
    torch.cuda.synchronize()
    ref = blk.run({k: v.cpu() for k, v in inputs.items()})
    got = outs["v"].cpu().numpy()
    out_of_range = (t.numpy() < 0) | (t.numpy() >= n)
    assert (got[out_of_range] == 0).all(), got[out_of_range][:8]
    check_output("v", outs["v"], ref["v"], None, "f32")


def test_dims_used_as_values_match_interpreter() -> None:
    """`acc / K` inside a stage: the kernel reads the call's sizes as Scalar operands (two ragged sizes,
    one CudaBlock)."""
    blk = next(iter(coda_lang.load(DIMS_AS_VALUES)))
    cb = blk.cuda(poison=True)
    for sizes, seed in (({"M": 200, "K": 72, "N": 136}, 3), ({"M": 72, "K": 24, "N": 264}, 4)):
        inputs = example_inputs(blk, sizes, seed=seed, device="cuda")
        assert set(check_against_interpreter(blk, cb, inputs)) == {"s"}


def test_sums_past_the_ragged_end_match_interpreter() -> None:
    """Sums whose epilogue value past the end of the reduced dim is not 0 (exp(0), stale vector loads,
    a real row value under abs) are masked there (epi_ops' Bounded*Reduce); the others are quack's
    plain sums: at ragged sizes along both dims, outputs and partials match the interpreter."""
    blk = next(iter(coda_lang.load(RAGGED_SUMS)))
    cb = blk.cuda(poison=True)
    for sizes, seed in (({"M": 200, "K": 72, "N": 136}, 3), ({"M": 1000, "K": 520, "N": 1000}, 4)):
        inputs = example_inputs(blk, sizes, seed=seed, device="cuda")
        assert set(check_against_interpreter(blk, cb, inputs)) == {"s", "u", "q", "z", "v", "a"}


def test_narrow_epilogue_subtile_matches_interpreter() -> None:
    """128x192 with the 16-column epilogue subtile (`TileConfig(epi_n=16)`, what the tuner and
    select_config take for heavy epilogues) on every stage of llama_mlp's backward (the packed SwiGLU
    backward, the norm backward with its column partials, the plain GEMMs) and on the forward's element
    stages 1 and 3 (the paired stage 2 keeps quack's subtile): outputs and partials against the
    interpreter at ragged sizes."""
    from coda_lang.backend_cute.build.config import TileConfig

    e16 = TileConfig(128, 192, epi_n=16)
    r = backward_run("llama_mlp")
    cb = r.bwd.cuda(tile=e16, poison=True)
    assert {cb.config(k) for k in cb.gemm_stages} == {e16}
    outs, partials = cb.run_with_partials(r.inputs)
    torch.cuda.synchronize()
    cpu = {k: v.cpu() for k, v in r.inputs.items()}
    ref, ref_partials = r.bwd.run_with_partials(cpu, sim_tile=cb.tiles)
    ref64, ref64_partials = r.bwd.run_with_partials(cpu, sim_tile=cb.tiles, precision="f64")
    for o in r.bwd.ir.outputs:
        assert o.type is not None
        check_gradient(o.name, outs[o.name], ref[o.name], ref64[o.name], o.type.dtype)
    assert set(partials) == {"dr", "dg"}
    for k, buf in partials.items():
        check_partial(k, buf, ref_partials[k], ref64_partials[k])
    blk = block("llama_mlp")
    fwd = blk.cuda(tile={1: e16, 2: TileConfig(128, 192), 3: e16}, poison=True)
    check_against_interpreter(blk, fwd, example_inputs(blk, sizes("llama_mlp"), seed=9, device="cuda"))
