"""K-major copies stored by the GEMM epilogue that makes an fp8 tile (spec.Output.kmajor).

A derived backward's GEMM of two fp8 operands reads some of them transposed (a weight gradient's
`transpose(dacc) @ x`), and Hopper's fp8 WGMMA reads only K-major tiles, so the GEMM takes a K-major
copy of each such operand (spec.Gemm's copy_a / copy_b). Where a GEMM stage stores that fp8 tile, its
epilogue now stores the copy too, a second TileStore into the transposed view of an [N, K] buffer
(M-major), which the runtime binds under backend_triton.kmajor_key; the reading GEMM takes it instead of
a transposing pass. $CODA_KMAJOR_STORE=0 leaves the copies to the passes.

Checked here on the CPU:
- the plan: which stores get a copy, in element mode (examples/fp8_delayed.coda's recomputed `hq`)
  and in packed mode (examples/fp8_mlp_save.coda's SwiGLU backward: a copy of each lane of the e5m2
  cotangent's pairs, and of the e4m3 SwiGLU output); none with the variable at 0, in the emulated
  plan, or for a value no later GEMM reads transposed; the emitted TileStores;
- what the runtime hands the kernel (the copy's transposed views, both lanes in one buffer, the
  padding zeros), what it binds, and that the reading GEMM takes that buffer, not a pass's copy;
- the layout, with the torch stand-in of the kernel: the buffer holds the stored tile transposed;
- (toolchain, slow) quack validates the runtime's arguments and compiles the stage without spills.
On a GPU (`-m gpu`): both examples' backwards against the interpreter with the copies and without.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import coda_lang
from coda_lang.autodiff.options import BackwardOptions
from coda_lang.backend_cute.build.config import TileConfig
from coda_lang.backend_cute.plan.emit import emit_stage
from coda_lang.backend_cute.plan.planner import plan_stage

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default (as a user gets it with the variable unset)."""
    monkeypatch.delenv("CODA_KMAJOR_STORE", raising=False)
    monkeypatch.delenv("CODA_FP8_PAIR_STORE", raising=False)


def _backward(example: str, fp8_acc: bool = False) -> Any:
    block = coda_lang.load((ROOT / "examples" / f"{example}.coda").read_text())[example]
    return block.grad(backward=BackwardOptions(fp8_grads="e5m2", fp8_acc=fp8_acc))


def _copies(bwd: Any, k: int, emulated: bool = False) -> list[tuple[str, int | None]]:
    return [(o.name, o.lane) for o in plan_stage(bwd, k, emulated=emulated).outputs if o.kmajor]


def test_the_stores_that_get_a_copy(copies: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8_delayed's data gradient `dacc2 @ w2` recomputes and stores `hq`, which the weight gradient
    `transpose(dacc2) @ hq` reads transposed: one copy. fp8_mlp_save's SwiGLU backward stores the
    e5m2 cotangent as pairs (read transposed by `transpose(dacc1) @ x`) and `aq` (by `transpose(dacc2)
    @ aq`): one copy per lane, one of aq. No other stage stores one; nor the emulated plan (torch reads
    any layout), nor with $CODA_KMAJOR_STORE=0."""
    delayed, mlp = _backward("fp8_delayed"), _backward("fp8_mlp_save", fp8_acc=True)
    assert plan_stage(delayed, 5).gemm.copy_b and plan_stage(mlp, 3).gemm.copy_a
    assert _copies(delayed, 2) == [("hq", None)]
    assert _copies(mlp, 2) == [("dacc1", 0), ("dacc1", 1), ("aq", None)]
    # aq's only reader is the weight gradient, which takes the copy: the stage stores the copy alone
    # (Output.alone); dacc1 is read row-major too (`dacc1 @ w13`), hq is D (kept), so both stay
    swiglu = plan_stage(mlp, 2).outputs
    assert [(o.name, o.lane, o.kmajor) for o in swiglu if o.alone] == [("aq", None, True)]
    assert [o.name for o in swiglu if not o.kmajor] == ["dacc1"]
    assert not any(o.alone for o in plan_stage(delayed, 2).outputs) and plan_stage(delayed, 2).d.name == "hq"
    assert "its only store: nothing reads the row-major tile" in emit_stage(plan_stage(mlp, 2))
    monkeypatch.setenv("CODA_KMAJOR_ALONE", "0")  # the row-major tile stored too, as before
    swiglu = plan_stage(mlp, 2).outputs
    assert not any(o.alone for o in swiglu) and [o.name for o in swiglu if not o.kmajor] == ["dacc1", "aq"]
    assert mlp.cuda(emulate=True)._alone == frozenset()
    monkeypatch.delenv("CODA_KMAJOR_ALONE")
    for bwd, k in ((delayed, 3), (delayed, 4), (delayed, 5), (mlp, 3), (mlp, 4), (mlp, 5)):
        assert _copies(bwd, k) == [], k
    assert _copies(delayed, 2, emulated=True) == [] and _copies(mlp, 2, emulated=True) == []
    spec = plan_stage(delayed, 2)
    (copy,) = [o for o in spec.outputs if o.kmajor]
    assert copy.dtype == "e4m3" and copy.op == "TileStore" and not copy.gated
    src = emit_stage(spec)
    assert f'TileStore("{copy.py}")' in src and f'"{copy.py}": ' in src and "K-major copy of `hq`" in src
    monkeypatch.setenv("CODA_KMAJOR_STORE", "0")
    assert _copies(delayed, 2) == [] and _copies(mlp, 2) == []


def test_the_runtime_hands_the_kernel_the_transposed_views(copies: None) -> None:
    """The SwiGLU backward's runner: the cotangent's copy is one [2F, K] buffer (K: M padded to 16,
    the padding zeros; lane 1's own output an empty stand-in, since a custom op's outputs may not
    alias) whose even rows lane 0 stores and odd rows lane 1, each through an M-major view;
    aq's copy an [F, K] buffer. collect binds the buffers under kmajor_key; the weight gradient's runner
    then takes the copy the stage wrote, no transposing pass."""
    from coda_lang.backend_triton import kmajor_key, kmajor_width

    bwd = _backward("fp8_mlp_save", fp8_acc=True)
    cb = bwd.cuda(tile=TileConfig(128, 128, 2, 1, False))
    r = cb.runner(2)
    m, d, f = 1000, 64, 528
    k = kmajor_width(m)
    assert k == 1008
    env: dict[str, Any] = {o.name: None for o in r.spec.operands}
    env.update(
        {
            "dacc2": torch.randn(m, d).to(torch.float8_e5m2),
            "w2": torch.randn(d, f).to(torch.float8_e4m3fn),
        }
    )
    for o in r.spec.operands:  # the other operands at their shapes (values do not matter here)
        if env.get(o.name) is None:
            if o.role == "scalar":
                env[o.name] = 1.0
            elif o.role == "row vector":
                env[o.name] = torch.ones(m)
            else:
                env[o.name] = torch.zeros(m, 2 * f, dtype=coda_dtype(o.dtype))
    ins, scalars = r.arguments(env)
    outs = r.allocate(ins[0], ins[1])
    kinds = [o for o in r.spec.outputs]
    pos = {(o.name, o.lane, o.kmajor): i + (r.spec.d is not None) for i, o in enumerate(kinds)}
    lane0, lane1, aq = pos[("dacc1", 0, True)], pos[("dacc1", 1, True)], pos[("aq", None, True)]
    # (one buffer for both lanes; lane 1's output an empty stand-in: the op's outputs may not alias)
    assert tuple(outs[lane0].shape) == (2 * f, k) and outs[lane1].numel() == 0
    assert tuple(outs[aq].shape) == (f, k) and outs[aq].dtype == torch.float8_e4m3fn
    assert not outs[lane0][:, m:].view(torch.uint8).any() and not outs[aq][:, m:].view(torch.uint8).any()
    _, _, epi = r.epilogue_arguments(ins, scalars, outs)
    py = {(o.name, o.lane): o.py for o in kinds if o.kmajor}
    v0, v1, va = epi[py[("dacc1", 0)]], epi[py[("dacc1", 1)]], epi[py[("aq", None)]]
    assert tuple(v0.shape) == (m, f) and v0.stride() == (1, 2 * k) and v0.data_ptr() == outs[lane0].data_ptr()
    assert v1.stride() == (1, 2 * k) and v1.data_ptr() == outs[lane0].data_ptr() + k  # (one byte a code)
    assert tuple(va.shape) == (m, f) and va.stride() == (1, k)
    got: dict[str, Any] = {}
    r.collect(outs, got, {}, {}, rows=m)
    assert got[kmajor_key("dacc1")] is outs[lane0] and got[kmajor_key("aq")] is outs[aq]
    # aq, stored as its copy alone, is bound as the copy's transposed view (no row-major buffer)
    assert ("aq", None, False) not in pos and len(outs) == len(kinds) + (r.spec.d is not None) + len(
        r.spec.sinks
    )
    assert tuple(got["aq"].shape) == (m, f) and got["aq"].data_ptr() == outs[aq].data_ptr()
    assert got["aq"].stride() == (1, k)
    # the weight gradient `transpose(dacc1) @ x` takes the copy the stage wrote
    w = cb.runner(3)
    env2 = {**got, "x": torch.randn(m, d).to(torch.float8_e4m3fn)}
    for o in w.spec.operands:
        env2.setdefault(o.name, 1.0)
    ins2, _ = w.arguments(env2)
    assert ins2[0] is not None and ins2[0].data_ptr() == outs[lane0].data_ptr()
    # `transpose(dacc2) @ aq` takes aq's copy as it is: the view bound as aq is not made dense
    env3 = {**got, "dacc2": env["dacc2"]}
    w5 = cb.runner(5)
    for o in w5.spec.operands:
        env3.setdefault(o.name, 1.0)
    ins5, _ = w5.arguments(env3)
    assert ins5[1] is not None and ins5[1].data_ptr() == outs[aq].data_ptr()


def coda_dtype(name: str) -> Any:
    from coda_lang.backend_cute.runtime.launch import TORCH_DTYPES

    return TORCH_DTYPES[name]


def test_the_copy_is_the_stored_tile_transposed(copies: None) -> None:
    """The torch stand-in of the kernel (emulate.run_stage) run on the stage the kernels plan
    (fp8_delayed's `dacc2 @ w2`, which stores `hq` and its copy): the copy's buffer holds the stored
    e4m3 tile transposed, code for code, and zeros past M."""
    from coda_lang.backend_cute.runtime import emulate
    from coda_lang.backend_triton import kmajor_key

    bwd = _backward("fp8_delayed")
    cb = bwd.cuda(tile=TileConfig(128, 128, 2, 1, False))
    r = cb.runner(2)
    m, n, p, k = 200, 96, 64, 40
    gen = torch.Generator().manual_seed(5)
    env: dict[str, Any] = {
        "dacc2": (torch.randn(m, p, generator=gen) * 8).to(torch.float8_e5m2),
        "w2": torch.randn(p, n, generator=gen).to(torch.float8_e4m3fn),
        "acc1": (torch.randn(m, n, generator=gen) * 30).to(torch.bfloat16),
        "x": torch.randn(m, k, generator=gen).to(torch.bfloat16),
    }
    for o in r.spec.operands:
        env.setdefault(o.name, 0.75)
    ins, scalars = r.arguments(env)
    outs = r.allocate(ins[0], ins[1])
    D, C, epi = r.epilogue_arguments(ins, scalars, outs)
    emulate.run_stage(r.spec, r.config, ins[0], ins[1], D, epi, C=C)
    got: dict[str, Any] = {}
    r.collect(outs, got, {}, {})
    copy = got[kmajor_key("hq")]
    assert tuple(copy.shape) == (n, 208)
    assert torch.equal(copy[:, :m].view(torch.uint8), got["hq"].t().view(torch.uint8))
    assert not copy[:, m:].view(torch.uint8).any()
    assert got["hq"].view(torch.uint8).any()  # (not a copy of zeros)


@pytest.mark.toolchain
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_quack_takes_the_runtime_arguments_and_the_stage_compiles(
    copies: None, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the runtime hands quack for fp8_delayed's `dacc2 @ w2` (its copy's M-major view among
    them, on "meta" tensors): quack validates it and compiles the kernel, without a GPU; ptxas finds no
    spills at the stage's tile."""
    from coda_lang.backend_cute.build import quack_adapter
    from coda_lang.backend_cute.build.compile import compile_spec

    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path_factory.mktemp("kmajor-dry")))
    r = _backward("fp8_delayed").cuda(tile=TileConfig(128, 128, 2, 1, False)).runner(2)
    m, n, p = 1000, 96, 64
    meta = lambda shape, dt: torch.empty(shape, dtype=dt, device="meta")  # noqa: E731
    env: dict[str, Any] = {
        "dacc2": meta((m, p), torch.float8_e5m2),
        "w2": meta((p, n), torch.float8_e4m3fn),
        "acc1": meta((m, n), torch.bfloat16),
    }
    for o in r.spec.operands:
        env.setdefault(o.name, 0.75)
    ins, scalars = r.arguments(env)
    assert ins[0] is not None and ins[1] is not None
    outs = r.allocate(ins[0], ins[1])
    D, C, epi = r.epilogue_arguments(ins, scalars, outs)
    quack_adapter.launch(r.mod, r.spec, r.config, ins[0], ins[1], D, epi, C=C, dry_run=True)
    c = compile_spec(r.spec, r.config)
    assert c.report is not None and not c.report.spills, c.report.text


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("store", ["1", "0"])
def test_gpu_backwards_with_and_without_the_copies(store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both examples' derived backwards (e5m2 cotangents) on the kernels against the interpreter, at
    sizes the fuzzer draws (M ragged: the copies' padding), with the copies the epilogues store and
    with the transposing passes instead."""
    from coda_lang.fuzz.search import fuzz_block

    monkeypatch.setenv("CODA_KMAJOR_STORE", store)
    for example, acc in (("fp8_delayed", False), ("fp8_mlp_save", True)):
        block = coda_lang.load((ROOT / "examples" / f"{example}.coda").read_text())[example]
        res = fuzz_block(block, "cuda", examples=3, backward=BackwardOptions(fp8_grads="e5m2", fp8_acc=acc))
        assert res.failure is None, (example, res.failure)


@pytest.mark.parametrize("example, acc", [("fp8_delayed", False), ("fp8_mlp_save", True)])
def test_a_backward_on_the_kernels_plans_against_the_interpreter(
    example: str, acc: bool, copies: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both examples' derived backwards run on the plans the kernels get, each kernel replaced by its
    torch stand-in: fp8_delayed's `hq` copy stored by the data gradient's epilogue; fp8_mlp_save's
    packed SwiGLU backward storing the e5m2 cotangent as pairs (int16 words), a copy per lane, and
    `aq` as its copy alone (bound as the copy's transposed view); the weight gradients taking the
    copies. `coda fuzz --target emulate`'s cases against the interpreter, M ragged (the padding),
    under $CODA_EMULATE_KERNEL_PLANS=1 (scripts/fuzz_hf_blocks.py --kernel-plans sets it)."""
    from coda_lang.fuzz.search import fuzz_block

    monkeypatch.setenv("CODA_EMULATE_KERNEL_PLANS", "1")
    block = coda_lang.load((ROOT / "examples" / f"{example}.coda").read_text())[example]
    opts = BackwardOptions(fp8_grads="e5m2", fp8_acc=acc)
    res = fuzz_block(block, "emulate", examples=3, backward=opts)
    assert res.failure is None and res.cases == 3, res.failure
    plans = [s for s in block.grad(backward=opts).cuda(emulate=True).specs if s is not None]
    outs = [o for s in plans for o in s.outputs]  # (the plans run are the kernels')
    assert any(o.kmajor for o in outs) and any(s.gemm.copy_b for s in plans)
    if acc:
        assert any(o.alone for o in outs) and any(o.pairs for o in outs)
    monkeypatch.delenv("CODA_EMULATE_KERNEL_PLANS")
    assert not any(
        o.kmajor for s in block.grad(backward=opts).cuda(emulate=True).specs if s for o in s.outputs
    )
