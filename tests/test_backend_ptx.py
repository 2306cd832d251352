"""The CuTeDSL backend compiles stages to PTX for sm_90a without a GPU, and ptxas accepts them.

- llama_mlp's three forward stages compile through quack (TMA + WGMMA mainloop, pingpong, cluster
  2x1): the PTX targets sm_90a, holds `wgmma` and `cp.async.bulk.tensor`, and at the tile
  `select_config` picks, `ptxas -v` reports no spill stores or loads. Also at 128x128.
- qk_norm's grouped sum compiles as quack's epilogue prepass (at a tile holding whole heads).
- min(), grouped min and logsumexp (tests/reduction_programs.py) compile
  in each mode, without spills at some candidate tile.
- The PTX cache is keyed by content: a second compile is a cache hit; `coda compile --emit ptx`.
- E0706 (spills at every tile tried) and E0707 (quack rejects the kernel) are clean diagnostics.
- Slow: every other example and the derived backward of llama_mlp compile without spills.

Marked `toolchain`: needs nvidia-cutlass-dsl, quack-kernels and ptxas (skipped otherwise), not a GPU. Kernels are
compiled into a cache folder of this test session, so each run really compiles (2-8 s a kernel on
2 cores, plus about 10 s to import torch, quack and CuTeDSL once).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from reduction_programs import NEW_REDUCTIONS
from runtime_check import DIMS_AS_VALUES, RAGGED_SUMS
from support import QUANTIZED_EXAMPLES

import coda_lang
from coda_lang.backend_cute.build.compile import CompiledStage, compile_stage
from coda_lang.backend_cute.build.config import CANDIDATES, DEFAULT_CONFIG, TileConfig
from coda_lang.backend_cute.build.select import select_config
from coda_lang.core.diagnostics import CodaError
from coda_lang.ir.nodes import Stage

ROOT = Path(__file__).resolve().parent.parent
MLP = ROOT / "examples" / "llama_mlp.coda"

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"), pytest.mark.toolchain]


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("coda-kernels")


@pytest.fixture(scope="session")
def mlp() -> coda_lang.Block:
    return coda_lang.load(MLP)["llama_mlp"]


def check_ptx(c: CompiledStage) -> None:
    ptx = c.ptx
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA loads of A and B
    assert f"{c.spec.fn_name}_" in ptx  # the kernel is minted from the emitted epilogue


# (stage 1, the longest compile, under -m slow: stages 2 and 3 walk the same candidates)
@pytest.mark.parametrize("index", [pytest.param(1, marks=pytest.mark.slow), 2, 3])
def test_llama_mlp_stage_compiles_without_spills(mlp: coda_lang.Block, cache: Path, index: int) -> None:
    c = select_config(mlp, index, directory=cache)
    check_ptx(c)
    assert c.report is not None
    assert (c.report.spill_stores, c.report.spill_loads) == (0, 0), c.report.text
    assert c.config.tile_m == 128 and c.config.pingpong and c.config.cluster_m == 2
    print(
        f"\nstage {index}: {c.config}: {c.report}; compiled in {c.compile_s:.1f} s"
        + "".join(f"\n  rejected {r}" for r in c.rejected)
    )


@pytest.mark.slow  # (the default run compiles 128x128 kernels of llama_mlp in test_compile_cache.py)
@pytest.mark.parametrize("index", [1, 2, 3])
def test_llama_mlp_at_128x128(mlp: coda_lang.Block, cache: Path, index: int) -> None:
    c = compile_stage(mlp, index, TileConfig(128, 128), directory=cache)
    check_ptx(c)
    assert c.report is not None and not c.report.spills, c.report.text


@pytest.mark.slow  # (four compiles; the override itself: test_epilogue_subtile_override_is_a_cache_key)
def test_narrow_epilogue_subtile_removes_the_norm_backward_spills(mlp: coda_lang.Block, cache: Path) -> None:
    """llama_mlp's norm backward (b4: two tile loads and a column-partial sink) spills at quack's 128x192
    with its 64x32 epilogue subtile; with the subtile 16 columns wide (`epi_n=16`, set through quack's
    `post_init_attrs`) it doesn't, so select_config keeps 128x192 instead of falling back to 128x128."""
    bwd = mlp.derivation(None, "save").backward
    wide = compile_stage(bwd, 4, TileConfig(128, 192), directory=cache)
    narrow = compile_stage(bwd, 4, TileConfig(128, 192, epi_n=16), directory=cache)
    assert wide.report is not None and wide.report.spills, wide.report.text
    assert narrow.report is not None and not narrow.report.spills, narrow.report.text
    assert narrow.ptx_path != wide.ptx_path and narrow.ptx != wide.ptx
    check_ptx(narrow)
    c = select_config(bwd, 4, directory=cache)
    assert c.config == TileConfig(128, 192, epi_n=16) and c.ptx_path == narrow.ptx_path
    assert len(c.rejected) == 1 and "128x192 pingpong, cluster 2x1:" in c.rejected[0]


def test_epilogue_subtile_override_is_a_cache_key() -> None:
    """EpiSubtileN is hashable and picklable by value, as quack's plan cache and compile cache key need
    (what it answers is checked by the compile above: it is called inside the CuTeDSL trace only)."""
    import pickle

    from coda_lang.backend_cute.build.quack_adapter import EpiSubtileN, post_init_attrs

    assert pickle.loads(pickle.dumps(EpiSubtileN(16))) == EpiSubtileN(16)
    assert hash(EpiSubtileN(16)) == hash(EpiSubtileN(16)) and EpiSubtileN(16) != EpiSubtileN(32)
    assert post_init_attrs(TileConfig(128, 192)) == ()
    assert post_init_attrs(TileConfig(128, 192, epi_n=16)) == (
        ("_compute_tile_shape_or_override", EpiSubtileN(16)),
    )


def test_qk_norm_compiles_with_its_prepass(cache: Path) -> None:
    """qk_norm's per-head sum of squares (group=128) runs in quack's epilogue prepass: the first
    candidate tile whose width holds whole heads (128x128) compiles without spills, and the PTX
    holds the GroupedReduce butterfly across the lanes of a head (`shfl.sync.bfly`)."""
    block = coda_lang.load(ROOT / "examples" / "qk_norm.coda")["qk_norm"]
    c = select_config(block, 1, directory=cache)
    check_ptx(c)
    assert c.config == TileConfig(128, 128) and c.report is not None and not c.report.spills, c.report.text
    assert "shfl.sync.bfly" in c.ptx and "epi_x_w_q_prepass" in c.source


# each entry of tests/reduction_programs.py: (program, what its PTX must hold beyond WGMMA and TMA).
# Every max and min the epilogue folds propagates NaN (`.NaN`, as the interpreter's do), except quack's
# online log-sum-exp's running max (NaN-quiet: a NaN still reaches its sum of exponentials)
REDUCTION_PTX = {
    "element": ("max.NaN.f32", "ex2.approx", "lg2.approx", "shfl.sync.bfly"),  # -x folded by max; online LSE
    "paired": ("max.NaN.f32", "shfl.sync.bfly"),
    "packed": ("max.NaN.f32",),
    "grouped": (
        "min.NaN.f32",
        "ex2.approx",
        "lg2.approx",
        "shfl.sync.bfly",
    ),  # GroupedReduce by min and by lse
}
NAN_QUIET_ALLOWED = {"element"}  # the online log-sum-exp


# Where these tests start select_config's walk over the candidate tiles: one tile before the one it
# takes (with ptxas 13.0: element 128x96, grouped and packed 128x128, paired 128x192, the ragged sums
# 128x64; each then sees one tile rejected for spills and takes the next), in two compiles instead of
# up to six (the whole walk of the ragged sums took 69 s on a 2-core machine).
WALK_FROM = {"element": TileConfig(128, 128), "grouped": TileConfig(128, 176), "packed": TileConfig(128, 176)}


def _from(tile: TileConfig) -> tuple[TileConfig, ...]:
    return CANDIDATES[CANDIDATES.index(tile) :]


# (the element, packed and paired programs' walks under -m slow, for CI minutes: the grouped one
# compiles the min and logsumexp folds, its shuffles, ex2 and lg2)
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow) if n in ("element", "packed", "paired") else n
        for n in sorted(REDUCTION_PTX)
    ],
)
def test_min_and_logsumexp_compile_without_spills(cache: Path, name: str) -> None:
    """min() (a max of the negation) beside logsumexp() over the columns, grouped min and logsumexp (epi_ops.GroupedReduce): quack compiles them, and a candidate tile has no spills."""
    block = next(iter(coda_lang.load(NEW_REDUCTIONS[name][0])))
    c = select_config(block, 1, _from(WALK_FROM.get(name, CANDIDATES[0])), directory=cache)
    check_ptx(c)
    assert c.report is not None and not c.report.spills, c.report.text
    for needle in REDUCTION_PTX[name]:
        assert needle in c.ptx, needle
    if name not in NAN_QUIET_ALLOWED:
        quiet = re.findall(r"\b(?:max|min)(?:\.ftz)?(?:\.xorsign\.abs)?\.f32\b", c.ptx)
        assert not quiet, f"NaN-quiet float max/min in the epilogue: {sorted(set(quiet))}"
    print(f"\n{name}: {c.config}: {c.report}")


def test_ptx_cache_hits_by_content(mlp: coda_lang.Block, cache: Path) -> None:
    first = compile_stage(mlp, 3, DEFAULT_CONFIG, directory=cache)
    again = compile_stage(mlp, 3, DEFAULT_CONFIG, directory=cache)
    assert again.cached and again.ptx_path == first.ptx_path
    assert again.source_path == first.source_path and again.source_path.read_text() == again.source


@pytest.mark.parametrize("damage", ["truncated ptx", "record not json", "record missing", "ptx missing"])
def test_a_damaged_cache_entry_is_compiled_again(mlp: coda_lang.Block, tmp_path: Path, damage: str) -> None:
    first = compile_stage(mlp, 3, DEFAULT_CONFIG, directory=tmp_path)
    good = first.ptx_path.read_text()
    meta = first.ptx_path.with_suffix(".json")
    if damage == "truncated ptx":
        first.ptx_path.write_text(good[: len(good) // 2])
    elif damage == "record not json":
        meta.write_text('{"compile_s": 1.0, "sha')
    elif damage == "record missing":
        meta.unlink()
    else:
        first.ptx_path.unlink()
    again = compile_stage(mlp, 3, DEFAULT_CONFIG, directory=tmp_path)
    assert not again.cached and again.ptx_path.read_text() == good  # rebuilt, the same kernel
    assert compile_stage(mlp, 3, DEFAULT_CONFIG, directory=tmp_path).cached  # and cached again


def test_cli_compile_ptx(mlp: coda_lang.Block, cache: Path, tmp_path: Path) -> None:
    """`coda compile --emit ptx --tile 128x128 --stage 3`: the stage's PTX, its spill report, and the
    kernel a compile in this process left in the cache reused by the command's process. (At a fixed
    tile: select_config's walk over the candidates is test_llama_mlp_stage_compiles_without_spills';
    one stage, the CI machine's minutes being few: the command's loop over stages is the same.)"""
    compile_stage(mlp, 3, TileConfig(128, 128), directory=cache)  # warm the cache: the CLI reuses it
    env = {**os.environ, "CODA_CACHE_DIR": str(cache)}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "coda_lang.cli",
            "compile",
            str(MLP),
            "--emit",
            "ptx",
            "--tile",
            "128x128",
            "--stage",
            "3",
            "-o",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama_mlp_stage3.ptx"]
    wrote = [line for line in r.stdout.splitlines() if line.startswith("wrote")]
    assert len(wrote) == 1 and "0 bytes spill stores, 0 bytes spill loads" in wrote[0], wrote
    assert wrote[0].endswith("; cached"), wrote  # a second process compiles nothing
    assert "wgmma" in (tmp_path / "llama_mlp_stage3.ptx").read_text()


def test_the_tile_argument_takes_an_epilogue_subtile() -> None:
    """`--tile MxN` and `--tile MxNeS` (S: the epilogue subtile's width), as `coda compile` reads them."""
    from coda_lang.cli.common import parse_tile_subtile

    assert parse_tile_subtile("128x192e16") == (128, 192, 16)
    assert parse_tile_subtile("128X64") == (128, 64, 0)
    assert parse_tile_subtile(None) is None
    for bad in ("128x192e", "128x192e0", "128e16", "x192e16", "128x192ex"):
        assert parse_tile_subtile(bad) == "bad", bad


@pytest.mark.slow  # (a compile of its own in a fresh process; the compile itself is the test above's)
def test_cli_compile_ptx_at_a_narrow_epilogue_subtile(cache: Path, tmp_path: Path) -> None:
    """`--tile 128x192e16 --stage 4` compiles llama_mlp's norm backward (stage 4 of its backward, alone)
    at 128x192 with a 16-column epilogue subtile: no spills (at 128x192 itself it spills:
    test_narrow_epilogue_subtile_...)."""
    env = {**os.environ, "CODA_CACHE_DIR": str(cache)}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "coda_lang.cli",
            "compile",
            str(MLP),
            "--backward",
            "--emit",
            "ptx",
            "--tile",
            "128x192e16",
            "--stage",
            "4",
            "-o",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    wrote = [line for line in r.stdout.splitlines() if line.startswith("wrote")]
    assert len(wrote) == 1 and "stage4" in wrote[0], r.stdout  # that stage only
    b4 = wrote[0]
    assert "128x192 pingpong, cluster 2x1, epilogue subtile N 16" in b4 and "0 bytes spill stores" in b4, b4


def test_quack_rejection_is_e0707(mlp: coda_lang.Block, cache: Path) -> None:
    with pytest.raises(CodaError) as info:
        compile_stage(mlp, 3, TileConfig(128, 256), directory=cache)  # pingpong allows tile_N <= 208
    (d,) = info.value.diagnostics
    assert d.code == "E0707" and d.span is not None and d.span.line == 24
    assert any("the emitted epilogue is" in n for n in d.notes)


def test_select_config_skips_a_refused_tile_and_says_e0707_when_all_are(
    mlp: coda_lang.Block, cache: Path
) -> None:
    """A candidate quack refuses (E0707) is skipped and named among the rejected; when every candidate
    is refused, the user sees quack's E0707, not E0706 (spills)."""
    c = select_config(mlp, 3, (TileConfig(128, 256), TileConfig(128, 128)), directory=cache)
    assert c.config == TileConfig(128, 128)
    assert len(c.rejected) == 1 and c.rejected[0].startswith("128x256 pingpong, cluster 2x1: ")
    with pytest.raises(CodaError) as info:
        select_config(mlp, 3, (TileConfig(128, 256),), directory=cache)
    assert [d.code for d in info.value.diagnostics] == ["E0707"]


HEAVY = """\
dims M, K, N

block heavy(x: bf16[M, K], w: bf16[K, N], t: bf16[M, N], b: f32[N], u: f32[M])
    -> (o1: bf16[M, N], o2: f32[M, N], o3: bf16[M, N], m1: f32[M], m2: f32[N], m3: f32[M]) {
  gemm x @ w {
    a1 = exp(acc * u) + log(abs(acc) + 1.0) + sqrt(abs(t)) + rsqrt(abs(b) + 1.0)
    a2 = tanh(a1) * sigmoid(acc) - silu(t) / gelu(u + acc)
    o1 = a1
    o2: f32 = a2 * b
    o3 = a1 * a2 + t
    m1 = max(a2, over=N)
    m2 = sum(a2 * a1, over=M)
    m3 = sum(t * a1, over=N)
  }
}
"""


@pytest.mark.slow
def test_spills_everywhere_is_e0706(cache: Path) -> None:
    block = coda_lang.load(HEAVY)["heavy"]
    with pytest.raises(CodaError) as info:
        select_config(block, 1, (DEFAULT_CONFIG,), directory=cache, fallback=False)
    (d,) = info.value.diagnostics
    assert d.code == "E0706" and d.notes and "spill stores" in d.notes[0]


def _example_stages() -> list[tuple[str, str, int]]:
    """(example, "forward" | "backward", stage) for every GEMM stage of every example's extended forward
    (what autograd runs: the forward plus the tiles it saves) and derived backward. Not the fp8
    examples' forwards: their stores and fp8_delayed's e4m3 GEMM compile in tests/test_fp8_kernels.py.
    Their backwards are here: bf16 GEMMs, fp8_delayed's fp8 operands multiplied in bf16."""
    out = []
    for path in sorted((ROOT / "examples").glob("*.coda")):
        for block in coda_lang.load(path):
            d = block.derivation()
            kinds = [("backward", d.backward)]
            if path.stem not in QUANTIZED_EXAMPLES:
                kinds.insert(0, ("forward", d.forward))
            for kind, b in kinds:
                stages = [s for s in b.ir.body if isinstance(s, Stage)]
                out += [(path.stem, kind, k) for k, s in enumerate(stages, 1) if s.is_gemm]
    return out


EXAMPLE_STAGES = _example_stages()


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,kind,index", EXAMPLE_STAGES, ids=[f"{n}-{k}-{i}" for n, k, i in EXAMPLE_STAGES]
)
def test_examples_compile_without_spills(cache: Path, name: str, kind: str, index: int) -> None:
    """Every GEMM stage of every example, forward and backward: PTX for sm_90a with WGMMA and TMA, and
    a tile at which ptxas reports no spills (select_config raises E0706 otherwise)."""
    block = coda_lang.load(ROOT / "examples" / f"{name}.coda")[name]
    d = block.derivation()
    b = d.forward if kind == "forward" else d.backward
    c = select_config(b, index, directory=cache)
    check_ptx(c)
    assert c.report is not None and not c.report.spills, c.report.text
    print(f"\n{name} {kind} stage {index}: {c.config}: {c.report}")


def _olmo2_stages() -> list[tuple[str, int]]:
    """The GEMM stages of the OLMo 2 `layer` block coda_lang.hf generates (at head_dim 128, the released
    models'), forward and the backward the patch runs: (forward or backward, index)."""
    b = _olmo2_layer()
    bwd = _olmo2_backward(b)
    return [
        (kind, k)
        for kind, x in (("forward", b), ("backward", bwd))
        for k, s in enumerate(x.ir.stages, 1)
        if s.is_gemm
    ]


def _olmo2_layer() -> coda_lang.Block:
    from coda_lang.hf.blocks import model_source

    src = model_source("bfloat16", 1e-6, 128, "proj", pre_norm=False, post_norm=True, heads=(16, 16))
    return coda_lang.load(src)["layer"]


def _olmo2_backward(b: coda_lang.Block) -> coda_lang.Block:
    wrt = {"w_o", "w_13", "w_2", "w_qkv", "go", "gd", "gqk", "y", "x"}
    return b.derivation([p.var.name for p in b.ir.params if p.var.name in wrt], "auto").backward


@pytest.mark.slow
@pytest.mark.parametrize("kind,index", _olmo2_stages(), ids=[f"{k}-{i}" for k, i in _olmo2_stages()])
def test_olmo2_layer_stages_compile_without_spills(cache: Path, kind: str, index: int) -> None:
    """OLMo 2's layer block (post norms: the out- and down-projections storing their branch and its
    partial sums of squares; the QKV projection storing its tile and the q and k columns' partial
    sums) and its backward: PTX for sm_90a with WGMMA and TMA at a tile without spills. (On this
    project's 2-core CPU: forward at 128x192, the QKV stages at epilogue subtile N 16, the post norms'
    backward in the dgrad epilogues of QKV and gate/up at 128x96 and 128x64.)"""
    b = _olmo2_layer()
    c = select_config(b if kind == "forward" else _olmo2_backward(b), index, directory=cache)
    check_ptx(c)
    assert c.report is not None and not c.report.spills, c.report.text
    print(f"\nolmo2 layer {kind} stage {index}: {c.config}: {c.report}")


def test_every_example_stage_is_covered() -> None:
    names = {n for n, _, _ in EXAMPLE_STAGES}
    assert names == {p.stem for p in (ROOT / "examples").glob("*.coda")}
    for name in QUANTIZED_EXAMPLES:
        assert {k for n, k, _ in EXAMPLE_STAGES if n == name} == {"backward"}, name
    assert sum(1 for n, k, _ in EXAMPLE_STAGES if (n, k) == ("llama_mlp", "backward")) == 6


@pytest.mark.slow  # (test_backend_emit checks the Scalar dims' source; this compiles it)
def test_dims_used_as_values_compile(cache: Path) -> None:
    """Dims inside a stage are Scalar operands: the stage compiles without spills, reading them by name."""
    block = next(iter(coda_lang.load(DIMS_AS_VALUES)))
    c = select_config(block, 1, directory=cache)
    check_ptx(c)
    assert c.report is not None and not c.report.spills, c.report.text
    assert 'Scalar("dim_K")' in c.source and "acc / dim_K" in c.source


@pytest.mark.slow  # (test_backend_emit checks the Bounded reductions' source; this compiles it)
def test_masked_sums_compile(cache: Path) -> None:
    """Sums masked past the ragged end (epi_ops' Bounded*Reduce, quack's out-of-bounds mask on for add
    and max_abs) compile at a candidate tile without spills."""
    block = next(iter(coda_lang.load(RAGGED_SUMS)))
    c = select_config(block, 1, _from(TileConfig(128, 96)), directory=cache)
    check_ptx(c)
    assert c.report is not None and not c.report.spills, c.report.text
    assert "BoundedColVecReduce(" in c.source and "BoundedRowVecReduce(" in c.source


def test_a_warm_compile_reads_the_ptxas_report_instead_of_running_ptxas(
    mlp: coda_lang.Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from coda_lang.backend_cute.build import cache as cache_mod

    first = compile_stage(mlp, 3, DEFAULT_CONFIG, directory=tmp_path)
    assert first.report is not None

    def no_ptxas(*args: object, **kwargs: object) -> None:
        raise AssertionError("ptxas ran on a warm cache")

    monkeypatch.setattr(cache_mod, "run_ptxas", no_ptxas)
    again = compile_stage(mlp, 3, DEFAULT_CONFIG, directory=tmp_path)
    assert again.cached and again.report == first.report  # registers, spills, stack, version, text
    for record in tmp_path.glob("ptx/*.ptxas-*.json"):  # a damaged record: ptxas runs again
        record.write_text('{"registers": ')
    monkeypatch.undo()
    rerun = compile_stage(mlp, 3, DEFAULT_CONFIG, directory=tmp_path).report
    assert rerun is not None and str(rerun) == str(first.report)  # (its text holds ptxas's own timing)
    records = list(tmp_path.glob("ptx/*.ptxas-*.json"))
    assert records and all(json.loads(r.read_text())["registers"] == first.report.registers for r in records)
