"""The tile-tuning cache (coda_lang/backend_cute/build/tune.py), on the CPU: keys and the file on disk.

Timing itself needs a GPU: tests/test_gpu.py::test_tuning_picks_a_measured_tile_and_caches_it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from coda_lang.backend_cute.build import tune  # noqa: E402
from coda_lang.backend_cute.build.config import TileConfig  # noqa: E402


def test_store_and_lookup_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    key = tune.disk_key("def f(acc): pass", (1024, 512, 256), "NVIDIA H100 80GB HBM3")
    assert tune.lookup(key) is None
    best = TileConfig(256, 128, 2, 1, False)
    tune.store(key, best, {TileConfig(): 0.5, best: 0.4})
    assert tune.lookup(key) == best
    other = tune.disk_key("def f(acc): pass", (1024, 512, 257), "NVIDIA H100 80GB HBM3")
    assert other != key and tune.lookup(other) is None
    assert tune.disk_key("def f(acc): pass", (1024, 512, 256), "NVIDIA H200") != key
    data = json.loads((tmp_path / "tuning.json").read_text())
    assert data[key]["ms"] == {"128x192 2x1": 0.5, "256x128 coop 2x1": 0.4}
    assert not list(tmp_path.glob("*.tmp"))


def test_unreadable_cache_counts_as_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    (tmp_path / "tuning.json").write_text("{not json")
    assert tune.lookup("anything") is None
    tune.store("k", TileConfig(), {TileConfig(): 1.0})
    assert tune.lookup("k") == TileConfig()


def test_emulated_blocks_do_not_tune() -> None:
    import coda_lang

    blk = coda_lang.load(Path(__file__).resolve().parent.parent / "examples" / "llama_mlp.coda")["llama_mlp"]
    assert blk.cuda(emulate=True).tune is False
    assert blk.cuda(emulate=True, tune=True).tune is True


def test_plain_stages_may_run_on_cublas() -> None:
    """A stage that only stores its accumulator in the operands' dtype (llama_mlp's wgrad GEMMs and dy)
    is a bare GEMM: the tuner may time it on cuBLAS. Run that way (emulated: torch.matmul on the CPU),
    the backward block still matches the interpreter."""
    import torch
    from runtime_check import check_gradient, example_inputs

    import coda_lang
    from coda_lang.backend_cute.build.config import CUBLAS, is_plain
    from coda_lang.backend_cute.plan.planner import plan_stage

    blk = coda_lang.load(Path(__file__).resolve().parent.parent / "examples" / "llama_mlp.coda")["llama_mlp"]
    bwd = blk.grad(remat="save")
    plain = [k for k in range(1, len(bwd.plan.stages) + 1) if is_plain(plan_stage(bwd, k))]
    assert plain == [1, 3, 5, 6]  # dw_2, dw_13, dw_o, dy; not the SwiGLU or norm backward
    auto = blk.grad()  # auto: the SwiGLU backward stores `a`, dw_2 follows it; dw_13 comes last
    assert [k for k in range(1, 7) if is_plain(plan_stage(auto, k))] == [2, 4, 5, 6]
    assert not any(is_plain(plan_stage(blk, k)) for k in (1, 2, 3))
    inputs = example_inputs(bwd, {"M": 300, "D": 200, "F": 264}, seed=31)
    cb = bwd.cuda(tile={**{k: (128, 64) for k in (2, 4)}, **{k: CUBLAS for k in plain}}, emulate=True)
    outs = cb(inputs)
    assert str(cb.config(1)) == "cuBLAS (torch.matmul)"
    ref = bwd.run(inputs, sim_tile=(128, 64))
    ref64 = bwd.run(inputs, precision="f64")
    for o in bwd.ir.outputs:
        assert o.type is not None
        check_gradient(o.name, outs[o.name], ref[o.name], ref64[o.name], o.type.dtype)
    assert isinstance(outs["dy"], torch.Tensor)


class FakeCuda:
    """torch.cuda's events and synchronize on a fake clock that each launch advances by its cost."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import torch

        clock = self.clock = [0.0]

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.t = 0.0

            def record(self) -> None:
                self.t = clock[0]

            def synchronize(self) -> None:
                pass

            def query(self) -> bool:
                return True

            def elapsed_time(self, end: Event) -> float:
                return end.t - self.t

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def launch(self, order: list[str], name: str, costs: list[float]) -> Any:
        """A launch whose i-th call costs costs[i] (the last cost from then on)."""
        calls = [0]

        def fn() -> None:
            order.append(name)
            self.clock[0] += costs[min(calls[0], len(costs) - 1)]
            calls[0] += 1

        return fn


def test_measure_stops_timing_a_clearly_slower_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """After EARLY_ROUNDS rounds, a config whose fastest batch is over EARLY_MARGIN slower than the best
    median is timed no more (its median so far is its time); one within the margin is timed to the
    end; CODA_TUNE=full (or early=False) times everything. The choice is the same."""
    import io

    from coda_lang.core.progress import Progress

    cuda = FakeCuda(monkeypatch)
    a, b, c = TileConfig(128, 192), TileConfig(128, 128), TileConfig(256, 128, 2, 1, False)
    order: list[str] = []
    monkeypatch.delenv("CODA_TUNE", raising=False)
    out = io.StringIO()
    with Progress("tuning", 3 * tune.BATCHES, stream=out) as p:
        times = tune.measure(
            {
                a: cuda.launch(order, "a", [1.0]),
                b: cuda.launch(order, "b", [1.3]),  # 30% slower: dropped
                c: cuda.launch(order, "c", [1.1]),  # 10% slower: within the margin, timed to the end
            },
            progress=p,
        )
        assert p.count == p.total == 3 * tune.BATCHES - (tune.BATCHES - tune.EARLY_ROUNDS)
    assert times == pytest.approx({a: 1.0, b: 1.3, c: 1.1})
    launched = {n: order.count(n) for n in "abc"}
    assert launched["b"] == tune.WARMUP + tune.EARLY_ROUNDS * tune.BATCH
    assert launched["a"] == launched["c"] == tune.WARMUP + tune.BATCHES * tune.BATCH
    monkeypatch.setenv("CODA_TUNE", "full")
    order.clear()
    full = tune.measure({a: cuda.launch(order, "a", [1.0]), b: cuda.launch(order, "b", [1.3])})
    assert (
        full == pytest.approx({a: 1.0, b: 1.3})
        and order.count("b") == tune.WARMUP + tune.BATCHES * tune.BATCH
    )


def test_measure_takes_turns_and_drops_configs_that_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """tune.measure on a fake CUDA clock (each launch advances it by its cost): the configs time their
    batches in turns, round by round (a clock drift falls on all alike), the median batch is each one's
    time, and a config that raises in its warm-up or while timed is left out."""
    clock = FakeCuda(monkeypatch).clock
    order: list[str] = []

    def launch(name: str, cost: float, fails_after: int | None = None) -> Any:
        calls = [0]

        def fn() -> None:
            calls[0] += 1
            if fails_after is not None and calls[0] > fails_after:
                raise RuntimeError("this tile can't run here")
            order.append(name)
            clock[0] += cost

        return fn

    a, b, c, d = TileConfig(128, 192), TileConfig(128, 128), TileConfig(128, 176), TileConfig(128, 160)
    times = tune.measure(
        {
            a: launch("a", 1.0),
            b: launch("b", 2.0),
            c: launch("c", 1.0, fails_after=1),
            d: launch("d", 3.0, fails_after=tune.WARMUP + tune.BATCH),
        },
        early=False,
    )
    assert times == {a: 1.0, b: 2.0}
    timed = order[3 * tune.WARMUP + 1 :]  # after the warm-ups of a, b and d and c's one launch
    per_round = [name for i, name in enumerate(timed) if i % tune.BATCH == 0]
    assert per_round[:3] == ["a", "b", "d"] and per_round[3:] == ["a", "b"] * (tune.BATCHES - 1)


def test_prune_by_the_nearest_shape_tuned_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel tuned at one shape: at a neighbouring shape (within NEAR) its candidates are ordered by
    the times there and those that took over PRUNE_MARGIN times the best are skipped, keeping KEEP at
    least; a far shape, another GPU, another kernel, or CODA_TUNE=full prune nothing."""
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CODA_TUNE", raising=False)
    src, dev = "def f(acc): pass", "NVIDIA H100 80GB HBM3"
    a, b, c, d, e = (
        TileConfig(128, 192),
        TileConfig(128, 192, epi_n=16),
        TileConfig(128, 128),
        TileConfig(256, 128, 2, 1, False),
        TileConfig(128, 160),
    )
    shape = (16384, 2048, 2048)
    times = {a: 1.00, b: 1.05, c: 1.5, d: 2.0, e: 1.4}
    tune.store(tune.disk_key(src, shape, dev), a, times, source=src, shape=shape, device=dev)
    new = TileConfig(128, 176)  # not timed there: kept, first
    keep, note = tune.prune([d, c, b, a, e, new], src, (16384, 4096, 4096), dev)
    assert keep == [new, a, b] and note == "3 of 6 skipped (over 1.3x the best at 16384x2048x2048)"
    keep, _ = tune.prune([d, c, e], src, (16384, 4096, 4096), dev)
    assert keep == [e, c, d]  # KEEP at least, the fastest there first
    assert tune.prune([d, a], src, (16384, 8192, 8192), dev) == ([d, a], "")  # too far (distance 4)
    assert tune.prune([d, a], src, (16384, 4096, 4096), "NVIDIA H200")[1] == ""
    assert tune.prune([d, a], "def g(acc): pass", (16384, 4096, 4096), dev)[1] == ""
    monkeypatch.setenv("CODA_TUNE", "full")
    assert tune.prune([d, c, b, a], src, (16384, 4096, 4096), dev) == ([d, c, b, a], "")


def test_store_keeps_every_entry_of_processes_storing_at_once(tmp_path: Path) -> None:
    """Two processes each storing 40 choices into one tuning.json at once: all 80 are there (the file is
    read, added to and replaced under a lock)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    script = (
        "import sys\n"
        "from coda_lang.backend_cute.build import tune\n"
        "from coda_lang.backend_cute.build.config import TileConfig\n"
        "for i in range(40):\n"
        "    tune.store(f'{sys.argv[1]}{i}', TileConfig(), {TileConfig(): 1.0})\n"
    )
    env = {**os.environ, "CODA_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(root)}
    procs = [subprocess.Popen([sys.executable, "-c", script, w], cwd=root, env=env) for w in "ab"]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    data = json.loads((tmp_path / "tuning.json").read_text())
    assert sorted(data) == sorted(f"{w}{i}" for w in "ab" for i in range(40))


def test_a_stage_that_hung_at_a_cooperative_tile_is_given_pingpong_tiles_only() -> None:
    """The Llama training step's RMSNorm backwards hung the GPU at 256x128 cooperative (H100,
    2026-11-25): one loads an f32 tile `dx1` beside the column partials of `dg1` (last_bwd stage 4), one
    stores it beside those of `dg2` (layer_bwd stage 2). Such stages are refused cooperative tiles
    (candidates, and a tile asked for by name is E0805 saying why), while llama_mlp's, whose tiles are
    bf16, keep them."""
    import coda_lang.hf.blocks as hb
    from coda_lang.api import load
    from coda_lang.backend_cute.build.config import TUNE_CANDIDATES, WIDE_F32_TILE, TileConfig, fits
    from coda_lang.backend_cute.plan.planner import plan_stage
    from coda_lang.core.diagnostics import CodaError

    program = load(hb.model_source("bfloat16", 1e-5, 64, False))
    last, layer = program["last"], program["layer"]
    last_bwd = last.derivation(["y", "x", "w_o", "g1", "w_13", "w_2", "g2"], "auto").backward
    layer_bwd = layer.derivation([p.var.name for p in layer.ir.params], "auto").backward
    loads, stores = plan_stage(last_bwd, 4), plan_stage(layer_bwd, 2)
    assert any(o.name == "dx1" and o.dtype == "f32" for o in loads.operands)
    assert not any(o.role == "tile" and o.dtype == "f32" for o in stores.operands)
    assert any(o.name == "dx1" and o.dtype == "f32" for o in stores.outputs)
    coop = [c for c in TUNE_CANDIDATES if not c.pingpong]
    for spec in (loads, stores):
        assert any(s.layout == "column partials" for s in spec.sinks)
        assert coop and not any(fits(spec, c) for c in coop)
        assert all(fits(spec, c, emulated=True) for c in coop)  # the stand-ins run anything
        assert any(fits(spec, c) for c in TUNE_CANDIDATES if c.pingpong)
    mlp_bwd = load("examples/llama_mlp.coda")["llama_mlp"].derivation(None, "auto").backward
    assert all(fits(plan_stage(mlp_bwd, 3), c) for c in coop)
    for bwd, k in ((last_bwd, 4), (layer_bwd, 2)):
        with pytest.raises(CodaError, match="pingpong"):
            bwd.cuda(tile={k: TileConfig(256, 128, 2, 1, False)})
    assert "pingpong" in str(WIDE_F32_TILE)


def test_the_f32_tile_rule_can_let_in_128_row_cooperative_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """$CODA_F32_TILE_RULE=rows128: an RMSNorm backward of the kind (the fp8 layer's gate/up data
    gradient, whose fp8 candidates include 128-row cooperative tiles) takes cooperative tiles of 128
    rows (as a block-scaled stage does: COOPERATIVE_F32_TILE), never the 256-row tile that hung;
    unset, pingpong only; another value is a ValueError naming the variable."""
    import coda_lang.hf.blocks as hb
    from coda_lang import BackwardOptions
    from coda_lang.api import load
    from coda_lang.backend_cute.build.config import TileConfig, candidates_for, fits
    from coda_lang.backend_cute.plan.planner import plan_stage

    layer = load(hb.model_source("bfloat16", 1e-5, 64, None, fp8="delayed"))["layer"]
    wrt = [p.var.name for p in layer.ir.params if p.var.name not in ("pos", "freq", "eps")]
    bwd = layer.derivation(
        [n for n in wrt if not n.startswith("s_")], backward=BackwardOptions(fp8_grads="e5m2")
    ).backward
    k = next(
        i for i, st in enumerate(bwd.ir.stages, 1)
        if st.is_gemm and getattr(st.b, "name", "") == "w_13q" and not st.ta
    )  # fmt: skip
    spec = plan_stage(bwd, k)
    assert any(s.layout == "column partials" for s in spec.sinks)
    coop128 = [c for c in candidates_for(spec) if not c.pingpong and c.tile_m == 128]
    assert coop128
    monkeypatch.setenv("CODA_F32_TILE_RULE", "rows128")
    assert all(fits(spec, c) for c in coop128)
    assert not fits(spec, TileConfig(256, 128, 2, 1, False))
    monkeypatch.delenv("CODA_F32_TILE_RULE")
    assert not any(fits(spec, c) for c in coop128)
    monkeypatch.setenv("CODA_F32_TILE_RULE", "all")
    with pytest.raises(ValueError, match="CODA_F32_TILE_RULE is 'all'"):
        fits(spec, coop128[0])


def test_a_first_launch_that_does_not_finish_is_reported_as_a_hang(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tune.measure waits for each candidate's first launch at most $CODA_HANG_S seconds: a kernel that
    never finishes raises KernelHang naming its tile (instead of waiting for ever), before any timing;
    store_hung records it per kernel and GPU, at every shape, and hung() reads it back."""
    import time

    import torch

    cuda = FakeCuda(monkeypatch)
    stuck = [False]
    Event = torch.cuda.Event

    class Hanging(Event):  # type: ignore[misc, valid-type]
        def query(self) -> bool:
            return not stuck[0]

    monkeypatch.setattr(torch.cuda, "Event", Hanging)
    a, b = TileConfig(128, 192), TileConfig(256, 128, 2, 1, False)
    order: list[str] = []
    launch_b = cuda.launch(order, "b", [1.0])

    def hangs() -> None:
        stuck[0] = True
        launch_b()

    monkeypatch.setenv("CODA_HANG_S", "0.2")
    t0 = time.monotonic()
    with pytest.raises(tune.KernelHang) as e:
        tune.measure({a: cuda.launch(order, "a", [1.0]), b: hangs})
    assert 0.2 <= time.monotonic() - t0 < 5
    assert e.value.config == b and "256x128 coop 2x1" in str(e.value)
    assert order == ["a"] * tune.WARMUP + ["b"]  # a warmed up; b launched once, never timed
    stuck[0] = False
    assert tune.measure({a: cuda.launch(order, "a", [1.0])}) == pytest.approx({a: 1.0})

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    assert tune.hung("src", "H100") == set()
    tune.store_hung("src", "H100", b)
    tune.store_hung("src", "H100", b)
    tune.store_hung("src", "H100", a)
    assert tune.hung("src", "H100") == {a, b}
    assert tune.hung("other src", "H100") == set() and tune.hung("src", "H200") == set()
    assert tune.nearest("src", (1, 2, 3), "H100") is None  # not a timing entry


HANG_SCRIPT = """
import sys, time
import torch
import coda_lang.hf.blocks as hb
from coda_lang.api import load
from coda_lang.backend_cute.build import config as cc
from coda_lang.backend_cute.build import select as sel
from coda_lang.backend_cute.build import tune
from coda_lang.backend_cute.build.config import TileConfig
from coda_lang.core.diagnostics import CodaError

coop = TileConfig(256, 128, 2, 1, False)
rules = cc.rules
# the guard off (WIDE_F32_TILE left out of the stage's rules): the cooperative tile is a candidate
cc.rules = lambda spec, emulated=False: [r for r in rules(spec, emulated) if r != cc.WIDE_F32_TILE]
if sys.argv[1] == "first":  # ... and the only one
    sel.configs_without_spills = lambda spec, *a, **k: [coop]
layer = load(hb.model_source("bfloat16", 1e-5, 64, False))["layer"]
bwd = layer.derivation([p.var.name for p in layer.ir.params], "auto").backward
gemms = bwd.cuda(emulate=True).gemm_stages
cb = bwd.cuda(tile={k: TileConfig(128, 128) for k in gemms if k != 2})  # stage 2 tunes
dims = {"M": 8192, "D": 2048, "K": 2048, "P": 1536, "F": 8192}
ins = tune.random_inputs(bwd.ir, dims, torch.device("cuda"))
t0 = time.monotonic()
try:
    cb(ins, dims=dims)
    torch.cuda.synchronize()
    print("ran", cb.config(2), flush=True)
except CodaError as e:
    print(str(e), flush=True)
    print(f"after {time.monotonic() - t0:.1f} s", flush=True)
    sys.exit(3)
"""


@pytest.mark.gpu
def test_a_hanging_tile_is_reported_recorded_and_skipped_next_time(tmp_path: Path) -> None:
    """On the GPU: layer_bwd stage 2 of the Llama model at its cooperative 256x128 tile (the guard
    above turned off, that tile its only candidate) hangs; the tuner says so (E0810) within
    $CODA_HANG_S, the process exits, and a new process with every candidate (the guard still off)
    skips the recorded tile and runs."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "CODA_CACHE_DIR": str(tmp_path), "CODA_HANG_S": "5", "CODA_PROGRESS": "0"}
    env["CODA_TUNE"] = "wait"  # (the first call times the tile, instead of compiling it in the background)
    script = tmp_path / "hang.py"
    script.write_text(HANG_SCRIPT)
    root = Path(__file__).resolve().parent.parent
    first = subprocess.run(
        [sys.executable, str(script), "first"], env=env, cwd=root, capture_output=True, text=True, timeout=400
    )
    assert first.returncode == 3, first.stdout + first.stderr[-3000:]
    assert "E0810" in first.stdout and "256x128 coop 2x1" in first.stdout, first.stdout
    second = subprocess.run(
        [sys.executable, str(script), "again"], env=env, cwd=root, capture_output=True, text=True, timeout=400
    )
    assert second.returncode == 0 and "ran" in second.stdout, second.stdout + second.stderr[-3000:]
    data = json.loads((tmp_path / "tuning.json").read_text())
    hung = [v for k, v in data.items() if k.startswith("hung:")]
    assert [c["tile_m"] for v in hung for c in v["configs"]] == [256]


class FakeBackground:
    """parallel.Background's interface over a set of sources still compiling (no workers)."""

    def __init__(self, pending: set[str]) -> None:
        self.left = set(pending)
        self.waited = 0

    @property
    def over(self) -> bool:
        return not self.left

    def wait(self, source: str | None = None, timeout: float | None = None) -> bool:
        self.waited += 1
        self.left.clear()
        return True


def test_a_stage_runs_at_its_first_tile_until_its_candidates_are_compiled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """While kernels compile in the background (a first call's default), each stage launches at its
    first tile and is not timed (the workers load every CPU); at its first launch after they are all
    compiled it is timed, once per shape, and the choice kept. Under a torch.compile trace (`wait`) it
    waits for them instead, since a traced graph keeps the tile it was given."""
    import torch

    import coda_lang
    from coda_lang.backend_cute.plan.emit import emit_stage
    from coda_lang.backend_cute.runtime.tuning import Tuner

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))  # (no compiled kernel: the first fitting tile)
    blk = coda_lang.load(Path(__file__).resolve().parent.parent / "examples" / "llama_mlp.coda")["llama_mlp"]
    cb = blk.cuda(emulate=True, tune=True)
    timed: list[tuple[int, tuple[int, int, int, int]]] = []

    def choose(self: Any, k: int, r: Any, ins: Any, scalars: Any, key: Any) -> Any:
        timed.append((k, key))
        return r  # (timing needs a GPU: tests/test_gpu.py)

    monkeypatch.setattr(Tuner, "choose", choose)
    sources = {k: emit_stage(cb.specs[k - 1]) for k in cb.gemm_stages}
    bg = FakeBackground({sources[1]})
    cb.tuner.background = bg
    inputs = tune.random_inputs(blk.ir, {"M": 64, "D": 32, "F": 48}, torch.device("cpu"))
    want = blk.cuda(emulate=True)(**inputs)["x2"]
    for _ in range(2):
        got = cb(**inputs)["x2"]
        assert torch.equal(got, want)
    assert timed == [] and cb.tuner.by_shape == {}  # still compiling: first tiles, nothing timed
    bg.left.clear()
    assert torch.equal(cb(**inputs)["x2"], want)
    cb(**inputs)
    assert [k for k, _ in timed] == [1, 2, 3] and len(cb.tuner.by_shape) == 3  # each stage once
    # at another shape: timed again, at once (nothing is compiling any more)
    cb(**tune.random_inputs(blk.ir, {"M": 32, "D": 32, "F": 48}, torch.device("cpu")))
    assert [k for k, _ in timed] == [1, 2, 3, 1, 2, 3]
    # a traced call waits for the compiles, then times the stage
    traced = blk.cuda(emulate=True, tune=True)
    traced.tuner.background = bg2 = FakeBackground({sources[2]})
    r = traced.runner(1)
    ins, scalars = r.arguments(traced.binder.bind(inputs, {})[0])
    runner, final = traced.tuner.measure(1, r, ins, scalars, (1, 64, 32, 32), wait=False)
    assert not final and runner is r and len(timed) == 6  # not traced: the first tile, not timed
    runner, final = traced.tuner.measure(1, r, ins, scalars, (1, 64, 32, 32), wait=True)
    assert final and runner is r and bg2.waited == 1 and timed[-1] == (1, (1, 64, 32, 32))


def test_while_compiling_a_stage_takes_the_first_candidate_compiled_without_spills(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tiles.first_compiled: select_config's order, then the tuner's, skipping what is not compiled yet
    or spills; None when nothing is compiled."""
    import coda_lang
    from coda_lang.backend_cute.build.cache import Kernel
    from coda_lang.backend_cute.build.config import CANDIDATES, TUNE_CANDIDATES, fits
    from coda_lang.backend_cute.plan.planner import plan_stage
    from coda_lang.backend_cute.runtime.tiles import first_compiled

    blk = coda_lang.load(Path(__file__).resolve().parent.parent / "examples" / "llama_mlp.coda")["llama_mlp"]
    spec = plan_stage(blk, 1)
    order = [c for c in dict.fromkeys((*CANDIDATES, *TUNE_CANDIDATES)) if fits(spec, c)]
    known: dict[TileConfig, str] = {}
    monkeypatch.setattr(Kernel, "status", lambda k: known.get(k.config))
    assert first_compiled(spec) is None
    known[order[3]] = "ok"
    assert first_compiled(spec) == order[3]
    known[order[0]] = "spills"
    known[order[1]] = "ok"
    assert first_compiled(spec) == order[1]
    tune_only = next(c for c in TUNE_CANDIDATES if c not in CANDIDATES and fits(spec, c))
    known.clear()
    known[tune_only] = "ok"
    assert first_compiled(spec) == tune_only


def test_coda_tune_chooses_whether_first_calls_compile_in_the_background(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """$CODA_TUNE: unset, 1 or 0 compile in the background; `wait` and `full` make the first call wait
    for every kernel. `coda_lang.torch.wait_for_kernels` returns at once when nothing is compiling, and
    False when its timeout passes first."""
    import coda_lang.torch as ct
    from coda_lang.backend_cute.build import parallel

    monkeypatch.delenv("CODA_TUNE", raising=False)
    assert tune.in_background()
    for value, want in (("1", True), ("0", True), ("wait", False), ("full", False)):
        monkeypatch.setenv("CODA_TUNE", value)
        assert tune.in_background() is want, value
    assert ct.wait_for_kernels(timeout=0) is True
    busy = parallel.Background()
    try:
        assert ct.wait_for_kernels(timeout=0.05) is False  # (its work is not over)
    finally:
        busy._end()
    assert ct.wait_for_kernels(timeout=0.05) is True


def test_a_process_exits_after_the_runtime_import_it_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """`preload_runtime` registers, at exit, a wait for the import thread it starts: a process that ends
    (an error exit, say) while that thread is still inside CuTeDSL's or quack's import (C extensions)
    lets it finish first, so no extension is torn down under it. Checked with a stand-in import that
    takes 0.5 s: the registered handler returns only after it is done."""
    import threading
    import time

    import coda_lang.backend_cute.runtime.tuning as tuning

    done = threading.Event()

    def slow_import() -> None:
        time.sleep(0.5)
        done.set()

    at_exit: list[Any] = []
    monkeypatch.setattr(tuning, "_PRELOAD", None)
    monkeypatch.setattr(tuning, "_import_runtime", slow_import)
    monkeypatch.delitem(tuning.sys.modules, "quack.epilogue.frontend", raising=False)
    monkeypatch.setattr(tuning.atexit, "register", at_exit.append)
    tuning.preload_runtime()
    assert at_exit == [tuning._finish_preload] and not done.is_set()
    at_exit[0]()
    assert done.is_set()
