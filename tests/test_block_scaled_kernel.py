"""The block-scaled fp8 mainloop (coda_lang/backend_cute/plan/block_scaled.py): on its own, and as the
planner gives it to a stage in DeepSeek-V3's form (`gemm a @ transpose(w), scale_a=sa, scale_b=sw`;
tests/test_block_scales.py has the planning and the emulated runs against the interpreter).

- Toolchain (no GPU): a stage in that form compiles at the one tile that fits it (128 x 128
  cooperative), and quack accepts what the runtime hands it (the scales as two more arguments, "meta"
  tensors). A GEMM of e4m3 operands whose epilogue carries the two scales compiles for
  sm_90a at 128 x 128 (cooperative, clusters of 1 and 2) with our mainloop in it: fp8 WGMMAs, one
  drain per K tile, the scales' loads from global memory, no spills; the same epilogue without the
  scales compiles to quack's own loop (no such loads). The tiles the loop can't run at are refused
  before a trace.
- GPU (marked `gpu`): the kernel against float64 sums of the same e4m3 values, each 128-deep block of
  K scaled by its two scales, at ragged M and K, a cluster of 2 and more tiles than SMs; the planned
  stage under `coda fuzz --target cuda`, forward, against the interpreter.
- The other two forms, a derived backward's data gradient's (`dacc @ w, scale_b=sw`: w's blocks alone,
  laid out [K/128, N/128] as w is stored [K, N], the kernel reading w's K-major copy) and w's scale
  alone in a forward: they compile with the loop reading B's scale only; on the GPU the kernel against
  float64, and the planned stages under `coda fuzz --target cuda`, the data gradient against the
  interpreter's derived backward.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from test_block_scales import CHAIN  # noqa: E402  (a 1x128-quantizing producer and its scaled consumer)


def _mods() -> tuple[Any, Any]:
    import importlib

    # (the adapter first: it sets the arch and the caches before quack's frontend is imported)
    importlib.import_module("coda_lang.backend_cute.build.quack_adapter")
    gemm_epilogue = importlib.import_module("quack.epilogue.frontend").gemm_epilogue
    BlockScale = importlib.import_module("coda_lang.backend_cute.plan.block_scaled").BlockScale

    @gemm_epilogue(extra_ops=(BlockScale("sa", "a", "sb"), BlockScale("sb", "b", "sa")))
    def epi_block_scaled(acc: Any) -> Any:
        return {"D": acc}

    @gemm_epilogue()
    def epi_unscaled(acc: Any) -> Any:
        return {"D": acc}

    return epi_block_scaled, epi_unscaled


def _compile(mod: Any, epi: dict[str, Any], cluster_m: int, cache: Path) -> str:
    from coda_lang.backend_cute.build import quack_adapter as qa

    M, N, K = 1024, 1024, 1024
    meta = lambda shape, dt: torch.empty(shape, dtype=dt, device="meta")  # noqa: E731
    A = meta((M, K), torch.float8_e4m3fn)
    B = meta((N, K), torch.float8_e4m3fn)
    D = meta((M, N), torch.bfloat16)
    args = {k: meta(v, torch.float32) for k, v in epi.items()}
    with tempfile.TemporaryDirectory() as tmp, qa.compile_only(Path(tmp), cache):
        plan = mod.gemm(
            A, B, D, None, epi_args=args, tile_M=128, tile_N=128, cluster_M=cluster_m, cluster_N=1,
            pingpong=False, persistent=True, b_kn=False, _launch=False,
        )  # fmt: skip
        ptx = getattr(plan.compiled_fn, "__ptx__", None)
        if ptx and "\n" not in ptx:
            ptx = Path(ptx).read_text()
    assert ptx, "CuTeDSL kept no PTX"
    return str(ptx)


@pytest.mark.toolchain
# (a cluster of 2, under -m slow: the planned stage below compiles at 128x128 with one by default)
@pytest.mark.parametrize("cluster_m", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_scaled_mainloop_compiles_into_the_kernel(cluster_m: int, tmp_path: Path) -> None:
    from coda_lang.backend_cute.build.ptxas import run_ptxas

    scaled, unscaled = _mods()
    ptx = _compile(scaled, {"sa": (1024, 8), "sb": (8, 8)}, cluster_m, tmp_path)
    assert re.search(r"wgmma\.mma_async\S*\.f32\.e4m3\.e4m3", ptx)
    # ours drains the WGMMAs once per K tile (quack's fp8 loop drains in its prologue and its loop)
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+0", ptx)) == 1
    # a thread's two rows of A's scales and the tile's one block of B's, per K tile
    assert len(re.findall(r"ld\.global\S*\.b32", ptx)) >= 3
    path = tmp_path / "scaled.ptx"
    path.write_text(ptx)
    report = run_ptxas(path)
    assert (report.spill_stores, report.spill_loads) == (0, 0), report.text
    plain = _compile(unscaled, {}, cluster_m, tmp_path)
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+0", plain)) >= 2
    assert not re.findall(r"ld\.global\S*\.b32", plain)


@pytest.mark.toolchain
@pytest.mark.parametrize(
    ("tile_n", "pingpong", "fp8", "why"),
    [
        (192, False, True, "not one of B's 128-row blocks"),
        (128, True, True, "pingpong"),
        (128, False, False, "fp8 operands promoted per K tile"),
    ],
)
def test_tiles_the_loop_cannot_run_at_are_refused(tile_n: int, pingpong: bool, fp8: bool, why: str) -> None:
    from coda_lang.backend_cute.plan.block_scaled import install

    gemm = SimpleNamespace(cta_tile_shape_mnk=(128, tile_n, 128), pingpong=pingpong, fp8_slow_accum=fp8)
    with pytest.raises(ValueError, match=why):
        install(gemm, scale_a="sa", scale_b="sb")
    assert not hasattr(gemm, "mma")  # (nothing installed)


# w's scale alone; its derived backward's data gradient (differentiated with respect to `a`, with e5m2
# cotangents) is `dacc @ w, scale_b=sw`: w's blocks cut the contraction there, and the runtime hands the
# kernel w's K-major copy
ONLY_B = """
dims M, K, N
block only_b(a: e4m3[M, K], w: e4m3[N, K], sw: f32[N/128, K/128]) -> (y: bf16[M, N]) {
  gemm a @ transpose(w), scale_b=sw {
    y: bf16 = acc * 0.5
  }
}
"""

DEEPSEEK = """
dims M, K, N
block scaled(a: e4m3[M, K], sa: f32[M, K/128], w: e4m3[N, K], sw: f32[N/128, K/128]) -> (y: bf16[M, N]) {
  gemm a @ transpose(w), scale_a=sa, scale_b=sw {
    y: bf16 = acc * 0.5
  }
}
"""


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_stage_in_deepseeks_form_compiles_and_takes_the_runtimes_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import coda_lang
    from coda_lang.backend_cute.build import quack_adapter
    from coda_lang.backend_cute.build.config import TileConfig
    from coda_lang.backend_cute.build.select import select_config

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    blk = coda_lang.load(DEEPSEEK)["scaled"]
    c = select_config(blk, 1, directory=tmp_path)
    assert c.config == TileConfig(128, 128, 2, 1, False)
    assert c.report is not None and not c.report.spills, c.report.text
    assert re.search(r"wgmma\.mma_async\S*\.f32\.e4m3\.e4m3", c.ptx)
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+0", c.ptx)) == 1  # (ours)
    m, k, n = 1000, 640, 384
    meta = lambda shape, dt: torch.empty(shape, dtype=dt, device="meta")  # noqa: E731
    env = {
        "a": meta((m, k), torch.float8_e4m3fn),
        "w": meta((n, k), torch.float8_e4m3fn),
        "sa": meta((m, k // 128), torch.float32),
        "sw": meta((n // 128, k // 128), torch.float32),
    }
    r = blk.cuda(tile=c.config).runner(1)
    ins, scalars = r.arguments(env)
    assert [tuple(t.shape) for t in ins[-2:] if t is not None] == [(m, k // 128), (n // 128, k // 128)]
    outs = r.allocate(ins[0], ins[1])
    D, C, epi = r.epilogue_arguments(ins, scalars, outs)
    assert epi[r.spec.gemm.scale_a_py] is ins[-2] and epi[r.spec.gemm.scale_b_py] is ins[-1]
    quack_adapter.launch(r.mod, r.spec, r.config, ins[0], ins[1], D, epi, C=C, dry_run=True)


@pytest.mark.toolchain
@pytest.mark.parametrize("given", [("sa",), ()])
def test_a_missing_scale_is_an_error_not_an_unscaled_gemm(given: tuple[str, ...], tmp_path: Path) -> None:
    """quack leaves out an epilogue op whose argument is None; a BlockScale refuses that instead, so
    the kernel is never compiled (or run) without its scales."""
    scaled, _ = _mods()
    with pytest.raises(ValueError, match="never runs unscaled"):
        _compile(scaled, {k: (1024, 8) for k in given}, 1, tmp_path)


def _reference(A: Any, B: Any, sa: Any, sb: Any, group: int = 128) -> Any:
    """float64: each K block's sum of the e4m3 products, times its row's scale of A (sa None: 1) and
    its column block's scale of B, added in order."""
    K = A.shape[1]
    a, b = A.double(), B.double()
    out = torch.zeros(A.shape[0], B.shape[0], dtype=torch.float64, device=A.device)
    for kb in range(sb.shape[1]):
        sl = slice(kb * group, min(K, (kb + 1) * group))
        cols = sb[:, kb].double().repeat_interleave(group)[: B.shape[0]]
        rows = 1.0 if sa is None else sa[:, kb, None].double()
        out += (a[:, sl] @ b[:, sl].T) * rows * cols[None, :]
    return out


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "n", "k", "cluster_m"),
    [
        (256, 256, 512, 1),
        (1000, 384, 640, 1),
        (512, 1024, 1040, 1),
        (1024, 512, 2048, 2),
        (4096, 2048, 4096, 1),
    ],
)
def test_the_kernel_is_the_block_scaled_sum(m: int, n: int, k: int, cluster_m: int) -> None:
    scaled, _ = _mods()
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    A = (torch.randn(m, k, device="cuda", generator=g) * 3).to(torch.float8_e4m3fn)
    B = (torch.randn(n, k, device="cuda", generator=g) * 3).to(torch.float8_e4m3fn)
    kb = -(-k // 128)
    sa = torch.rand(m, kb, device="cuda", generator=g) * 4 + 0.05
    sb = torch.rand(n // 128, kb, device="cuda", generator=g) * 4 + 0.05
    D = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    scaled.gemm(
        A, B, D, None, epi_args={"sa": sa, "sb": sb}, tile_M=128, tile_N=128, cluster_M=cluster_m,
        cluster_N=1, pingpong=False, persistent=True, b_kn=False,
    )  # fmt: skip
    want = _reference(A, B, sa, sb)
    top = float(want.abs().max())
    # bf16's rounding of the result (2^-9) and f32 sums; a block with a wrong scale is off by its size
    assert float((D.double() - want).abs().max()) <= top * 2**-7
    unscaled_blocks = _reference(A, B, torch.ones_like(sa), torch.ones_like(sb))
    assert float((D.double() - unscaled_blocks).abs().max()) > top * 2**-4  # (the scales matter here)


@pytest.mark.gpu
def test_a_stage_in_deepseeks_form_runs_as_the_interpreter_does() -> None:
    """`coda fuzz --target cuda` of the planned stage, forward: the kernel within the accuracy rule of
    the interpreter at the sizes the fuzzer draws (ragged M, K a multiple of 16)."""
    import coda_lang
    from coda_lang.fuzz.search import fuzz_block

    res = fuzz_block(coda_lang.load(DEEPSEEK)["scaled"], "cuda", examples=4, backward=False)
    assert res.failure is None, res.failure
    assert res.cases == 4


@pytest.mark.gpu
def test_deepseeks_forward_of_two_gemms_runs_as_the_interpreter_does() -> None:
    """The first GEMM quantizes its output in 1x128 groups in its epilogue and writes the amax; the
    second multiplies it, block-scaled, by 128 x 128-scaled weights: `coda fuzz --target cuda`,
    forward, against the interpreter."""
    import coda_lang
    from coda_lang.fuzz.search import fuzz_block

    res = fuzz_block(coda_lang.load(CHAIN)["chain"], "cuda", examples=4, backward=False)
    assert res.failure is None and res.cases == 4, res.failure


def _b_only_mod(kn: bool) -> Any:
    import importlib

    importlib.import_module("coda_lang.backend_cute.build.quack_adapter")
    gemm_epilogue = importlib.import_module("quack.epilogue.frontend").gemm_epilogue
    BlockScale = importlib.import_module("coda_lang.backend_cute.plan.block_scaled").BlockScale

    @gemm_epilogue(extra_ops=(BlockScale("sb", "b", "", kn=kn),))
    def epi_b_only(acc: Any) -> Any:
        return {"D": acc}

    return epi_b_only


@pytest.mark.toolchain
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_data_gradients_form_and_ws_scale_alone_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """w's scale alone (a forward), and the derived data gradient `dacc @ w, scale_b=sw` (e5m2 x e4m3,
    w's blocks laid out [K/128, N/128]): each plans with one BlockScale op (`kn` for the data
    gradient's layout, with w's K-major copy), compiles at 128 x 128 cooperative with our loop (one
    drain a K tile) loading B's scale only (one global word a K tile, none of A's), and takes the
    runtime's arguments: one scale matrix, in w's stored layout."""
    import coda_lang
    from coda_lang.backend_cute.build import quack_adapter
    from coda_lang.backend_cute.build.config import TileConfig
    from coda_lang.backend_cute.build.select import select_config
    from coda_lang.backend_cute.plan.emit import emit_stage
    from coda_lang.backend_cute.plan.planner import plan_stage

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    fwd = coda_lang.load(ONLY_B)["only_b"]
    bwd = coda_lang.load(DEEPSEEK)["scaled"].grad(["a"], backward=coda_lang.BackwardOptions(fp8_grads="e5m2"))
    for blk, i, kn, mma in ((fwd, 1, False, "e4m3.e4m3"), (bwd, 2, True, "e5m2.e4m3")):
        spec = plan_stage(blk, i)
        g = spec.gemm
        assert (g.scale_a, g.scale_b, g.b_kn, g.copy_b) == (None, "sw", kn, kn)
        src = emit_stage(spec)
        assert f'BlockScale("{g.scale_b_py}", "b", ""{", kn=True" if kn else ""})' in src
        assert '"a", ' not in src.split("extra_ops=")[1].split(")")[0]
        c = select_config(blk, i, directory=tmp_path)
        assert c.config == TileConfig(128, 128, 2, 1, False)
        assert c.report is not None and not c.report.spills, c.report.text
        assert re.search(rf"wgmma\.mma_async\S*\.f32\.{mma}", c.ptx)
        assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+0", c.ptx)) == 1  # (ours)
        assert len(re.findall(r"ld\.global\S*\.b32", c.ptx)) == 1  # (B's scale; no row of A's)
    # the data gradient's arguments: dacc [M, N] e5m2, w [N, K] as stored (the runtime makes its
    # K-major copy, [K, N] as the GEMM reads it), sw [N/128, K/128] as given, and the epilogue's sa
    m, k, n = 1000, 640, 384
    meta = lambda shape, dt: torch.empty(shape, dtype=dt, device="meta")  # noqa: E731
    spec = plan_stage(bwd, 2)
    env = {
        spec.gemm.a: meta((m, n), torch.float8_e5m2),
        "w": meta((n, k), torch.float8_e4m3fn),
        "sw": meta((n // 128, k // 128), torch.float32),
        "sa": meta((m, k // 128), torch.float32),
        **{o.name: 1.0 for o in spec.operands if o.role == "scalar"},
    }
    r = bwd.cuda(tile=TileConfig(128, 128, 2, 1, False)).runner(2)
    ins, scalars = r.arguments(env)
    B = ins[1]
    assert B is not None and tuple(B.shape) == (k, n)  # (w's K-major copy)
    assert tuple(ins[-1].shape) == (n // 128, k // 128) and ins[-1].dtype == torch.float32
    outs = r.allocate(ins[0], B)
    D, C, epi = r.epilogue_arguments(ins, scalars, outs)
    assert epi[r.spec.gemm.scale_b_py] is ins[-1] and not r.spec.gemm.scale_a_py
    quack_adapter.launch(r.mod, r.spec, r.config, ins[0], B, D, epi, C=C, dry_run=True)


def test_a_scale_of_a_alone_is_refused_by_the_op() -> None:
    pytest.importorskip("quack")
    from coda_lang.backend_cute.plan.block_scaled import BlockScale

    with pytest.raises(ValueError, match="A's block scale goes with B's"):
        BlockScale("sa", "a", "")


@pytest.mark.gpu
@pytest.mark.parametrize("kn", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [(1000, 384, 640), (512, 1024, 1040), (4096, 2048, 4096)])
def test_the_kernel_with_ws_scale_alone_is_the_block_scaled_sum(kn: bool, m: int, n: int, k: int) -> None:
    """B's scale alone, its blocks [N/128, K/128] or (`kn`, the data gradient's) [K/128, N/128]: the
    kernel against float64 sums of the same fp8 values (A e5m2 as a cotangent is), each 128-deep
    block of K scaled by its block of B's."""
    mod = _b_only_mod(kn)
    g = torch.Generator(device="cuda").manual_seed(m + n + k + kn)
    A = (torch.randn(m, k, device="cuda", generator=g) * 3).to(torch.float8_e5m2)
    B = (torch.randn(n, k, device="cuda", generator=g) * 3).to(torch.float8_e4m3fn)
    kb = -(-k // 128)
    sb = torch.rand(n // 128, kb, device="cuda", generator=g) * 4 + 0.05
    D = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    given = sb.t().contiguous() if kn else sb
    mod.gemm(
        A, B, D, None, epi_args={"sb": given}, tile_M=128, tile_N=128, cluster_M=1, cluster_N=1,
        pingpong=False, persistent=True, b_kn=False,
    )  # fmt: skip
    want = _reference(A, B, None, sb)
    top = float(want.abs().max())
    assert float((D.double() - want).abs().max()) <= top * 2**-7
    assert float((D.double() - _reference(A, B, None, torch.ones_like(sb))).abs().max()) > top * 2**-4


@pytest.mark.gpu
def test_the_data_gradient_and_ws_scale_alone_run_as_the_interpreter_does() -> None:
    """`coda fuzz --target cuda`: w's scale alone (forward and backward: its weight gradient reads w's
    128 x 128 scales over its tile, passed repeated over rows), and DeepSeek's form differentiated with
    respect to `a` with e5m2 cotangents (its backward: the cotangent's quantizing stage, then the data
    gradient `dacc @ w, scale_b=sw` on w's K-major copy), against the interpreter."""
    import coda_lang
    from coda_lang.fuzz.fuzzer import Fuzzer
    from coda_lang.fuzz.search import fuzz_block

    only_b = coda_lang.load(ONLY_B)["only_b"]
    res = fuzz_block(
        only_b, "cuda", examples=3, fuzzer=Fuzzer(only_b, "cuda", fp8_grads="e5m2", wrt=["a", "w"])
    )
    assert res.failure is None and res.cases == 3 and not res.notes, (res.failure, res.notes)
    blk = coda_lang.load(DEEPSEEK)["scaled"]
    res = fuzz_block(blk, "cuda", examples=3, fuzzer=Fuzzer(blk, "cuda", fp8_grads="e5m2", wrt=["a"]))
    assert res.failure is None and res.cases == 3, res.failure
    assert not any("not checked" in note for note in res.notes), res.notes


def _column_mod() -> Any:
    import importlib

    importlib.import_module("coda_lang.backend_cute.build.quack_adapter")
    gemm_epilogue = importlib.import_module("quack.epilogue.frontend").gemm_epilogue
    BlockScale = importlib.import_module("coda_lang.backend_cute.plan.block_scaled").BlockScale

    @gemm_epilogue(extra_ops=(BlockScale("sb", "b", "", kn=True, columns=True),))
    def epi_columns(acc: Any) -> Any:
        return {"D": acc}

    return epi_columns


@pytest.mark.toolchain
def test_the_loop_with_a_scale_per_column_compiles(tmp_path: Path) -> None:
    """B's scale per column and K block (sb [K/128, N]: a requantized weight gradient's, not yet
    reachable from the planner): e5m2 x e4m3 WGMMAs, our loop (one drain a K tile), and at 128 x 128
    each thread's 32 column scales loaded a K tile (2 columns of each of the 16 eight-column groups it
    holds), no spills."""
    from coda_lang.backend_cute.build import quack_adapter as qa
    from coda_lang.backend_cute.build.ptxas import run_ptxas

    M, N, K = 1024, 1024, 1024
    meta = lambda shape, dt: torch.empty(shape, dtype=dt, device="meta")  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp, qa.compile_only(Path(tmp), tmp_path):
        plan = _column_mod().gemm(
            meta((M, K), torch.float8_e5m2), meta((N, K), torch.float8_e4m3fn), meta((M, N), torch.bfloat16),
            None, epi_args={"sb": meta((K // 128, N), torch.float32)}, tile_M=128, tile_N=128, cluster_M=1,
            cluster_N=1, pingpong=False, persistent=True, b_kn=False, _launch=False,
        )  # fmt: skip
        ptx = getattr(plan.compiled_fn, "__ptx__", None)
        if ptx and "\n" not in ptx:
            ptx = Path(ptx).read_text()
    assert ptx
    assert re.search(r"wgmma\.mma_async\S*\.f32\.e5m2\.e4m3", ptx)
    assert len(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+0", ptx)) == 1
    assert len(re.findall(r"ld\.global\S*\.b32", ptx)) == 32
    path = tmp_path / "columns.ptx"
    path.write_text(ptx)
    report = run_ptxas(path)
    assert (report.spill_stores, report.spill_loads) == (0, 0), report.text


def test_a_scale_per_column_is_bs_alone_in_its_layout() -> None:
    pytest.importorskip("quack")
    from coda_lang.backend_cute.plan.block_scaled import BlockScale, check_config

    for args in (("sb", "b", "sa"), ("sb", "a", "sa")):
        with pytest.raises(ValueError, match="B's alone"):
            BlockScale(*args, kn=True, columns=True)
    with pytest.raises(ValueError, match="B's alone"):
        BlockScale("sb", "b", "", kn=False, columns=True)
    assert check_config(192, False, columns=True) is None and check_config(192, False) is not None
    assert check_config(128, True, columns=True) is not None  # (pingpong)


@pytest.mark.gpu
@pytest.mark.parametrize(("m", "n", "k"), [(1000, 384, 640), (512, 1000, 1040), (4096, 2048, 4096)])
def test_the_kernel_with_a_scale_per_column_is_the_column_scaled_sum(m: int, n: int, k: int) -> None:
    """The kernel with B's scale per column and K block against float64 sums of the same fp8 values,
    each 128-deep block of K times each column's scale (passed on an H200, 2026-11-29)."""
    mod = _column_mod()
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    A = (torch.randn(m, k, device="cuda", generator=g) * 3).to(torch.float8_e5m2)
    B = (torch.randn(n, k, device="cuda", generator=g) * 3).to(torch.float8_e4m3fn)
    kb = -(-k // 128)
    sb = torch.rand(kb, n, device="cuda", generator=g) * 4 + 0.05
    D = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    mod.gemm(
        A, B, D, None, epi_args={"sb": sb}, tile_M=128, tile_N=128, cluster_M=1, cluster_N=1,
        pingpong=False, persistent=True, b_kn=False,
    )  # fmt: skip
    a, b = A.double(), B.double()
    want = torch.zeros(m, n, dtype=torch.float64, device="cuda")
    for j in range(kb):
        sl = slice(j * 128, min(k, (j + 1) * 128))
        want += (a[:, sl] @ b[:, sl].T) * sb[j].double()[None, :]
    top = float(want.abs().max())
    assert float((D.double() - want).abs().max()) <= top * 2**-7
    assert float((D.double() - a @ b.T * sb.double().mean()).abs().max()) > top * 2**-4
