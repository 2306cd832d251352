"""Chunked backward runs (coda_lang/autodiff/chunk.py; docs/design.md, "Chunked backward").

- Chunked and unchunked backwards agree: f64 to 1e-12, exact mode to the order of f32 summation (f32
  outputs to 1e-5 of their scale, 16-bit outputs to one ulp of their dtype), for lm_head_ce and its
  cross-entropy variants under --remat recompute (and save), and llama_mlp (whose dw and dg sum over
  M), with a ragged last chunk, chunk=1 and chunk >= M, whole and tiled; on the interpreter
  (`Block.vjp`) and on the torch path (`CudaBlock.autograd`, `coda_lang.torch.function`, emulated).
  The same in chunks of the vocabulary's columns (chunk_dim="V": w_lm sliced, dw_lm joined, dhg and
  dr accumulated, the target shifted by the chunk's start; the smoothed CE reads V whole), and in row
  chunks of a block whose backward compares row_index() with a parameter.
- The chunks really run: one backward run per chunk, each at the chunk's extent of the chunked dim;
  a gradient a GEMM sums over the chunked dim (`dw = acc`) is one f32 buffer that each later chunk's
  GEMM stores `acc + total` over (emulated, and on the GPU's kernels: marked `gpu`).
- `forward_backward`: each row chunk's forward then its backward, against the function's autograd.
- `budget=` picks the chunk the rule says, and "auto" the dim whose run holds the least memory (V for
  the LM head at Llama-3 sizes, M for llama_mlp); bad `chunk=`/`budget=`/`chunk_dim=` and blocks that
  can't run in chunks are E0809 naming the argument or the value in the way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import torch

import coda_lang
import coda_lang.interp
import coda_lang.torch as ct
from coda_lang.autodiff.chunk import candidate_plans, choose, chunk_plan, chunk_size
from coda_lang.autodiff.chunk_run import run_chunks
from coda_lang.autodiff.options import DEFAULT_BUDGET, BackwardOptions
from coda_lang.backend_cute.runtime import autograd
from coda_lang.interp import random_inputs

ROOT = Path(__file__).resolve().parent.parent
CE = ["lm_head_ce", "lm_head_ce_smooth", "lm_head_ce_zloss", "lm_head_ce_softcap"]


def block(name: str) -> coda_lang.Block:
    return coda_lang.load(ROOT / "examples" / f"{name}.coda")[name]


def ce_inputs(m: int = 37, d: int = 16, v: int = 50, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "hg": rng.standard_normal((m, d)).astype(ml_dtypes.bfloat16),
        "r": rng.uniform(0.5, 1.5, m).astype(np.float32),
        "w_lm": (rng.standard_normal((d, v)) * 2).astype(ml_dtypes.bfloat16),
        "target": np.where(np.arange(m) % 6 == 2, -100, rng.integers(0, v, m)).astype(np.int32),
    }


def cotangents(
    blk: coda_lang.Block, ins: dict[str, Any], dims: dict[str, int] | None = None
) -> dict[str, Any]:
    rng = np.random.default_rng(11)
    outs = blk.run(ins, dims=dims)
    return {
        k: rng.standard_normal(np.shape(v)).astype(np.float32)
        for k, v in outs.items()
        if np.asarray(v).dtype.kind == "f"
    }


def assert_same(got: dict[str, Any], want: dict[str, Any], precision: str, what: str) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        g, w = np.asarray(got[k]), np.asarray(want[k])
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{what} d{k}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}"
        )
        g64, w64 = g.astype(np.float64), w.astype(np.float64)
        scale = float(np.max(np.abs(w64))) if w64.size else 0.0
        if precision == "f64":
            tol = 1e-12 * scale + 1e-300
        elif w.dtype == np.float32:
            tol = 1e-5 * scale
        else:  # a 16-bit gradient: the f32 sums may round to the neighbouring value
            ulp = 2.0**-7 if w.dtype == ml_dtypes.bfloat16 else 2.0**-10
            np.testing.assert_array_less(
                np.abs(g64 - w64), ulp * np.abs(w64) + 1e-5 * scale + 1e-30, err_msg=f"{what} d{k}"
            )
            continue
        err = float(np.max(np.abs(g64 - w64))) if w64.size else 0.0
        assert err <= tol, f"{what} d{k}: chunked differs by {err:.3e} (tolerance {tol:.3e})"


# ---------------------------------------------------------------------------- the interpreter


@pytest.mark.parametrize("name", CE)
@pytest.mark.parametrize("precision", ["exact", "f64"])
def test_ce_chunked_equals_unchunked(name: str, precision: str) -> None:
    blk = block(name)
    ins = ce_inputs()
    cts = cotangents(blk, ins)
    for remat in ("recompute", "save"):
        want = blk.vjp(ins, cts, precision=precision, remat=remat)
        for chunk in (1, 5, 16, 37, 1000):  # 37 rows: ragged last chunks of 2, 5 and 1 rows
            got = blk.vjp(ins, cts, precision=precision, remat=remat, chunk=chunk)
            assert_same(got, want, precision, f"{name} {remat} chunk={chunk}")


@pytest.mark.parametrize("remat", ["save", "recompute"])
@pytest.mark.parametrize("precision", ["exact", "f64"])
def test_llama_mlp_chunked_equals_unchunked(remat: str, precision: str) -> None:
    blk = block("llama_mlp")
    dims = {"M": 29, "D": 16, "F": 24}
    ins = random_inputs(blk.ir, dims, seed=2)
    cts = cotangents(blk, ins)
    want = blk.vjp(ins, cts, precision=precision, remat=remat)
    plan = blk.chunk_plan(remat=remat)
    assert set(plan.summed) == {"dw_o", "dg", "dw_13", "dw_2"}  # the M-reductions: wgrads and dg
    for chunk in (1, 7, 29, 64):
        got = blk.vjp(ins, cts, precision=precision, remat=remat, chunk=chunk)
        assert_same(got, want, precision, f"llama_mlp {remat} chunk={chunk}")


def test_chunked_with_simulated_tiles() -> None:
    blk = block("lm_head_ce")
    ins = ce_inputs(m=23, v=40)
    cts = cotangents(blk, ins)
    want = blk.vjp(ins, cts, remat="recompute", sim_tile=(4, 16))
    got = blk.vjp(ins, cts, remat="recompute", sim_tile=(4, 16), chunk=6)
    assert_same(got, want, "exact", "tiled")


def test_every_chunk_runs_at_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """M=37 in chunks of 16: three backward runs at M = 16, 16, 5; dlogits is never [37, V]."""
    seen: list[tuple[int, tuple[int, ...]]] = []
    run_block = coda_lang.interp.run_block

    def spy(ir: Any, plan: Any, env: dict[str, Any], dims: dict[str, int], **kw: Any) -> Any:
        if ir.name.endswith("_bwd"):  # (not the forward's run)
            seen.append((dims["M"], np.shape(env["hg"])))
        return run_block(ir, plan, env, dims, **kw)

    monkeypatch.setattr(coda_lang.interp, "run_block", spy)
    blk = block("lm_head_ce")
    ins = ce_inputs()
    blk.vjp(ins, cotangents(blk, ins), remat="recompute", chunk=16)
    assert seen == [(16, (16, 16)), (16, (16, 16)), (5, (5, 16))]


def test_the_chunked_block_stores_row_sums_wide() -> None:
    plan = block("lm_head_ce").chunk_plan(remat="recompute")
    assert plan.dim == "M" and plan.summed == {"dw_lm": "bf16"} and plan.concat == ("dhg", "dr")
    assert {"hg", "dloss", "dlse", "lse", "target", "r"} == set(plan.rows)
    assert next(o for o in plan.block.ir.outputs if o.name == "dw_lm").type.dtype == "f32"
    assert [(n, str(w), dt) for n, w, dt in plan.transients] == [("dacc1", "V", "bf16")]


# ---------------------------------------------------------------------------- the budget


def test_budget_picks_the_chunk() -> None:
    plan = block("lm_head_ce").chunk_plan(remat="recompute")
    sizes = {"M": 8192, "D": 2048, "V": 50}  # dacc1: bf16[M, V], 100 bytes per row
    assert plan.bytes_per_row(sizes) == 100
    assert chunk_size(plan, 8192, sizes, BackwardOptions(chunk="auto", budget=1000)) == 10
    assert chunk_size(plan, 8192, sizes, BackwardOptions(budget=1000)) == 10  # a budget alone means "auto"
    assert (
        chunk_size(plan, 8192, sizes, BackwardOptions(chunk="auto", budget=100 * 300)) == 256
    )  # a multiple of 128 from 128 rows
    assert chunk_size(plan, 8192, sizes, BackwardOptions(chunk="auto", budget=99)) == 1  # at least one row
    assert chunk_size(plan, 8192, sizes, BackwardOptions(chunk="auto", budget=10**12)) == 8192  # at most M
    assert chunk_size(plan, 8192, sizes, BackwardOptions(chunk=100)) == 100
    assert chunk_size(plan, 8192, sizes, BackwardOptions(chunk=10**6)) == 8192
    assert chunk_size(plan, 8192, sizes, BackwardOptions()) is None
    llama3 = {"M": 8192, "D": 2048, "V": 128256}  # 256 MiB of bf16 dlogits: 1046 rows -> 1024
    assert (
        chunk_size(plan, 8192, llama3, BackwardOptions(chunk="auto"))
        == 1024
        == (DEFAULT_BUDGET // (2 * 128256)) // 128 * 128
    )
    mlp = block("llama_mlp").chunk_plan(remat="recompute")  # dacc2: bf16[M, 2F], dacc1: bf16[M, D]
    assert mlp.bytes_per_row({"M": 64, "D": 16, "F": 24}) == 96
    assert mlp.bytes_per_row({"M": 64, "D": 64, "F": 24}) == 128


def test_vjp_with_a_budget_runs_the_chunks_it_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    rows: list[int] = []
    run_block = coda_lang.interp.run_block

    def spy(ir: Any, plan: Any, env: dict[str, Any], dims: dict[str, int], **kw: Any) -> Any:
        if ir.name.endswith("_bwd"):
            rows.append(dims["M"])
        return run_block(ir, plan, env, dims, **kw)

    monkeypatch.setattr(coda_lang.interp, "run_block", spy)
    blk = block("lm_head_ce")
    ins = ce_inputs()  # V = 50: 100 bytes of dlogits per row
    cts = cotangents(blk, ins)
    want = blk.vjp(ins, cts, remat="recompute")
    assert rows == [37]
    rows.clear()
    got = blk.vjp(ins, cts, remat="recompute", chunk="auto", budget=1000, chunk_dim="M")
    assert rows == [10, 10, 10, 7]
    assert_same(got, want, "exact", "budget")


# ---------------------------------------------------------------------------- the torch path


def _torch_inputs(ins: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in ins.items():
        a = np.asarray(v)
        if a.dtype == ml_dtypes.bfloat16:
            out[k] = torch.tensor(a.astype(np.float32)).bfloat16().requires_grad_()
        elif a.dtype.kind == "f":
            out[k] = torch.tensor(a).requires_grad_()
        else:
            out[k] = torch.tensor(a)
    return out


def _torch_grads(fn: Any, ins: dict[str, np.ndarray], seed: int = 0) -> dict[str, np.ndarray]:
    tens = _torch_inputs(ins)
    outs = fn(tens)
    gen = torch.Generator().manual_seed(seed)
    total = sum(
        (o.float() * torch.randn(o.shape, generator=gen)).sum()
        for o in outs.values()
        if o.is_floating_point()
    )
    total.backward()  # type: ignore[union-attr]
    res = {}
    for k, t in tens.items():
        if t.grad is not None:
            g = t.grad
            res[k] = g.float().numpy().astype(ml_dtypes.bfloat16) if g.dtype == torch.bfloat16 else g.numpy()
    return res


def spy_chunks(fn: Any, monkeypatch: pytest.MonkeyPatch, extent: Any) -> list[tuple[str, int]]:
    """Records (which chunked block, `extent(tensors, dims)`) of each chunk's run of a CudaFunction:
    "M" / "V" the plan's block, "M+" / "V+" the one adding to the running totals."""
    calls: list[tuple[str, int]] = []
    for key, cb in fn.chunked_blocks.items():
        call = cb._call

        def spy(
            tensors: dict[str, Any],
            dims: dict[str, int] | None,
            consume: Any = None,
            call: Any = call,
            key: str = key,
        ) -> Any:
            assert dims is not None
            calls.append((key, extent(tensors, dims)))
            return call(tensors, dims, consume)

        monkeypatch.setattr(cb, "_call", spy)
    return calls


@pytest.mark.parametrize("name", ["lm_head_ce", "lm_head_ce_softcap", "llama_mlp"])
def test_emulated_autograd_chunked_equals_unchunked(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    blk = block(name)
    if name == "llama_mlp":
        ins = random_inputs(blk.ir, {"M": 29, "D": 16, "F": 24}, seed=3)
        remat, chunks = "save", (1, 8, 29)
    else:
        ins = ce_inputs(m=29, v=48)  # stored rows of the kernels: multiples of 16 bytes
        remat, chunks = "recompute", (1, 8, 29, 100)
    want = _torch_grads(blk.cuda(emulate=True).autograd(remat=remat), ins)
    for chunk in chunks:
        fn = blk.cuda(emulate=True).autograd(remat=remat, chunk=chunk)
        calls = spy_chunks(fn, monkeypatch, lambda tensors, dims: dims["M"])
        got = _torch_grads(fn, ins)
        c = min(chunk, 29)
        # each of these has a weight gradient `dw = acc`: the chunks after the first add to its total
        assert calls == [("M" if i == 0 else "M+", min(c, 29 - i)) for i in range(0, 29, c)]
        assert_same(got, want, "exact", f"{name} autograd chunk={chunk}")


def test_chunks_add_to_the_weight_gradient_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """In row chunks, lm_head_ce's dw_lm (its GEMM sums over the chunk's rows) is one f32 buffer: the
    first chunk's GEMM stores it, each later chunk's GEMM stores `acc + total` over the total it reads
    (Liveness.into), so no chunk allocates a part of it or adds one afterwards; the gradients equal
    the unchunked ones."""
    blk = block("lm_head_ce")
    ins = ce_inputs(m=29, v=48)
    want = _torch_grads(blk.cuda(emulate=True).autograd(remat="recompute"), ins)
    fn = blk.cuda(emulate=True).autograd(remat="recompute", chunk=8, chunk_dim="M")
    plan = fn.chunk_plans[0]
    assert plan.accumulate == {"dw_lm": "dw_lm_total"}
    ptrs: list[tuple[int, int | None]] = []
    for cb in fn.chunked_blocks.values():
        call = cb._call

        def spy(tensors: dict[str, Any], dims: Any, consume: Any = None, call: Any = call) -> Any:
            total = tensors.get("dw_lm_total")
            outs = call(tensors, dims, consume)
            ptrs.append((outs[0]["dw_lm"].data_ptr(), None if total is None else total.data_ptr()))
            return outs

        monkeypatch.setattr(cb, "_call", spy)
    adds: list[int] = []
    monkeypatch.setattr(autograd, "_add", lambda total, part: adds.append(1) or total.add_(part))
    got = _torch_grads(fn, ins)
    assert len(ptrs) == 4 and len({p for p, _ in ptrs}) == 1, ptrs  # one buffer, every chunk
    assert all(t == ptrs[0][0] for _, t in ptrs[1:]) and ptrs[0][1] is None
    assert not adds  # dw_lm's total is never added to outside the kernels (dr is joined over M)
    assert_same(got, want, "exact", "in-place totals")


def test_forward_backward_in_row_chunks() -> None:
    """`BlockFunction.forward_backward` (a loss head that saves its logits, each chunk's backward right
    after its forward) gives the outputs and the gradients of the function's autograd, for cotangents
    given up front (an output left out, here `lse`, has a zero cotangent, as for autograd), the
    weight's as its f32 total with `rounded=False`; refused
    without a row-chunked plan or with a cotangent for no output."""
    blk = block("lm_head_ce")
    ins = _torch_inputs(ce_inputs(m=29, v=48))
    ct_loss = torch.randn(29, generator=torch.Generator().manual_seed(2))
    plain = ct.function(blk, remat="save")
    leaves = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in ins.items()}
    want = plain(leaves)
    want["loss"].backward(ct_loss)
    f = ct.function(blk, remat="save", chunk_dim="M")
    for chunk in (8, 29, 64):
        outs, grads = f.forward_backward(ins, cotangents={"loss": ct_loss}, chunk=chunk)
        assert torch.equal(outs["loss"], want["loss"].detach())
        assert set(grads) == {k for k, v in leaves.items() if v.grad is not None}
        got = {k: g.float().numpy() for k, g in grads.items()}
        ref = {k: leaves[k].grad.float().numpy() for k in grads}  # type: ignore[union-attr]
        assert_same(got, ref, "exact", f"forward_backward chunk={chunk}")
    # rounded=False: the weight's gradient (summed over the rows) comes back as its f32 total, which
    # rounds to the rounded run's; the row-indexed gradients are as before
    _, totals = f.forward_backward(ins, cotangents={"loss": ct_loss}, chunk=8, rounded=False)
    _, grads = f.forward_backward(ins, cotangents={"loss": ct_loss}, chunk=8)
    assert totals["w_lm"].dtype == torch.float32 and grads["w_lm"].dtype == torch.bfloat16
    assert not torch.equal(totals["w_lm"], grads["w_lm"].float())  # more bits than the bf16 gradient
    assert torch.equal(totals["w_lm"].to(torch.bfloat16), grads["w_lm"])
    assert all(torch.equal(totals[k], grads[k]) for k in grads if k != "w_lm")
    with pytest.raises(ValueError, match="chunk_dim='M'"):
        plain.forward_backward(ins, cotangents={"loss": ct_loss}, chunk=8)
    with pytest.raises(ValueError, match="cotangents given for logits, which are not"):
        f.forward_backward(ins, cotangents={"logits": ct_loss}, chunk=8)


def test_torch_function_takes_chunk_and_budget() -> None:
    ins = ce_inputs(m=29, v=48)  # stored rows of the kernels: multiples of 16 bytes
    blk = block("lm_head_ce_zloss")
    want = _torch_grads(ct.function(blk, remat="recompute"), ins)
    for kw in ({"chunk": 4}, {"chunk": "auto", "budget": 1000}, {"budget": 300}):
        f = ct.function(blk, remat="recompute", **kw)  # type: ignore[arg-type]
        assert_same(_torch_grads(f, ins), want, "exact", f"function {kw}")


# ---------------------------------------------------------------------------- refusals


BAD_ARGS = [
    ({"chunk": 0}, ValueError, "chunk= is 0"),
    ({"chunk": -3}, ValueError, "chunk= is -3"),
    ({"chunk": 2.5}, TypeError, "chunk= is 2.5"),
    ({"chunk": "big"}, ValueError, "chunk= is 'big'"),
    ({"chunk": True}, TypeError, "chunk= is True"),
    ({"budget": 0}, ValueError, "budget= is 0"),
    ({"budget": "1GB"}, TypeError, "budget= is '1GB'"),
    ({"chunk": "auto", "budget": 1.5e9}, TypeError, "budget= is 1500000000.0"),
    ({"chunk": 8, "budget": 1000}, ValueError, "chunk=8 and budget=1000 both given"),
    ({"chunk_dim": 3}, TypeError, "chunk_dim= is 3"),
    ({"chunk_dim": "Q"}, ValueError, "chunk_dim= is 'Q'; block lm_head_ce has no such dim"),
    ({"remat": "never"}, ValueError, "remat= is 'never'"),
    ({"remat": None, "backward": "save"}, TypeError, "backward= is 'save'"),
    ({"backward": BackwardOptions(), "remat": "save"}, TypeError, "backward= and remat= both given"),
]


def assert_refused_by_every_entry(kw: dict[str, Any], kind: type[Exception], msg: str) -> None:
    """Block.vjp, Block.grad, CudaBlock.autograd and coda_lang.torch.function each refuse lm_head_ce's
    backward options `kw` with the same exception (a TypeError or ValueError: an argument mistake,
    not a CodaError) and `msg`."""
    blk = block("lm_head_ce")
    ins = ce_inputs(m=8)
    calls = [
        lambda: blk.vjp(ins, {"loss": np.ones(8, np.float32)}, **kw),
        lambda: blk.cuda(emulate=True).autograd(**kw),
        lambda: ct.function(blk, **kw),
    ]
    for call in calls:
        with pytest.raises(kind) as e:
            call()
        assert not isinstance(e.value, coda_lang.CodaError)
        assert msg in str(e.value), str(e.value)


@pytest.mark.parametrize("kw,kind,msg", BAD_ARGS, ids=[str(k) for k, _, _ in BAD_ARGS])
def test_bad_arguments_are_refused(kw: dict[str, Any], kind: type[Exception], msg: str) -> None:
    assert_refused_by_every_entry(kw, kind, msg)


def test_backward_options_are_one_value() -> None:
    """`backward=BackwardOptions(...)` and the keyword shorthands give the same run."""
    blk = block("lm_head_ce")
    ins = ce_inputs(m=24)
    ct_ = {"loss": np.ones(24, np.float32)}
    a = blk.vjp(ins, ct_, backward=BackwardOptions(remat="recompute", chunk=8))
    b = blk.vjp(ins, ct_, remat="recompute", chunk=8)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert BackwardOptions(chunk="auto").mode == "auto" and BackwardOptions(budget=10).mode == "auto"
    assert BackwardOptions(chunk_dim="V").mode == "auto" and BackwardOptions().mode is None
    assert (
        BackwardOptions(chunk=np.int64(4)).chunk == 4
        and type(BackwardOptions(chunk=np.int64(4)).chunk) is int
    )
    assert BackwardOptions(remat="save", chunk=8).flags() == ["--remat", "save", "--chunk", "8"]


def _refused(src: str) -> str:
    blk = coda_lang.load("dims M, N, K\n" + src)
    b = next(iter(blk))
    with pytest.raises(coda_lang.CodaError) as e:
        chunk_plan(b, "M")
    assert "E0809" in str(e.value)
    return str(e.value)


def test_blocks_that_cannot_run_in_chunks_are_refused() -> None:
    assert "only `name = acc` can be summed" in _refused(
        "block b(x: bf16[M, K], dy: bf16[M, N]) -> (dw: bf16[K, N]) { gemm transpose(x) @ dy { dw = acc * 2.0 } }"
    )
    assert "is a max over `M`: only sums" in _refused(
        "block b(x: bf16[M, K], w: bf16[K, N]) -> (m: f32[N]) { gemm x @ w { m = max(acc, over=M) } }"
    )
    assert "row_index()" in _refused(
        "block b(x: bf16[M, K], w: bf16[K, N]) -> (y: bf16[M, N]) { gemm x @ w { i = row_index()\n"
        "  y = where(i > 3, acc, 0.0) } }"
    )
    assert "both as its rows and as its columns" in _refused(
        "block b(x: bf16[M, K], w: bf16[K, M]) -> (y: bf16[M, M]) { gemm x @ w { y = acc } }"
    )
    assert "`s` sums over `M` and is read by" in _refused(
        "block b(x: bf16[M, K], w: bf16[K, N]) -> (y: bf16[M, N]) {\n"
        "  gemm x @ w { s = sum(acc, over=M) }\n  gemm x @ w { y = acc * s } }"
    )
    assert "only one of its axes may be `M`" in _refused(
        "block b(x: bf16[M, M], w: bf16[M, N]) -> (y: bf16[M, N]) { gemm x @ w { y = acc } }"
    )
    assert "a chunk of `M` can't split `2*M`" in _refused(
        "block b(x: bf16[2*M, K], w: bf16[K, N]) -> (y: bf16[2*M, N]) { gemm x @ w { y = acc } }"
    )
    assert "computes with `i`, the chunk's own index" in _refused(
        "block b(x: bf16[M, K], w: bf16[K, N]) -> (y: bf16[M, N]) { gemm x @ w { i = row_index()\n"
        "  y = acc * i } }"
    )
    assert "compares row_index() with `n`, which is not a parameter" in _refused(
        "block b(x: bf16[M, K], w: bf16[K, N], t: i32[N]) -> (y: bf16[M, N]) { gemm x @ w { i = row_index()\n"
        "  n = t + 1\n  y = where(i == n, acc, 0.0) } }"
    )


def test_amax_fp8_backward_is_refused_by_name() -> None:
    """Its backward counts the ties of the amax over all rows, then divides every row by the count."""
    blk = block("amax_fp8")
    ins = random_inputs(blk.ir, {"M": 16, "K": 16, "N": 16})
    with pytest.raises(coda_lang.CodaError) as e:
        blk.vjp(ins, cotangents(blk, ins), chunk=4)
    assert "E0809" in str(e.value) and "sums over `M` and is read by" in str(e.value)
    with pytest.raises(coda_lang.CodaError):
        ct.function(blk, chunk=4)


# ---------------------------------------------------------------------------- chunks of other dims


def run_chunked(
    b: coda_lang.Block, dim: str, ins: dict[str, Any], chunk: int, precision: str
) -> dict[str, Any]:
    """Any block (a forward too) run in chunks of `dim` on the interpreter, through `run_chunks`."""
    from coda_lang.core.numerics import round_to, to_storage
    from coda_lang.interp import bind, run_block

    plan = chunk_plan(b, dim)
    env, sizes = bind(b.ir, ins, None, precision)

    def run(sub: dict[str, Any], n: int, acc: bool) -> dict[str, Any]:
        b = plan.acc_block if acc else plan.block
        return run_block(b.ir, b.plan, sub, {**sizes, plan.inner: n}, precision=precision)[0]

    def finish(total: Any, dtype: str) -> Any:
        return to_storage(round_to(total, dtype, precision), dtype, precision)

    return run_chunks(
        plan, env, sizes[dim], chunk, run, lambda p, sh: np.empty(sh, p.dtype), lambda a, b: a + b, finish
    )


@pytest.mark.parametrize("name", CE)
@pytest.mark.parametrize("precision", ["exact", "f64"])
def test_ce_chunked_over_v_equals_unchunked(name: str, precision: str) -> None:
    blk = block(name)
    ins = ce_inputs()  # V = 50
    cts = cotangents(blk, ins)
    for remat in ("recompute", "save"):
        want = blk.vjp(ins, cts, precision=precision, remat=remat)
        for chunk in (1, 7, 8, 50, 1000):  # 7: a ragged last chunk of 1 column
            got = blk.vjp(ins, cts, precision=precision, remat=remat, chunk=chunk, chunk_dim="V")
            assert_same(got, want, precision, f"{name} {remat} chunk={chunk} over V")


def test_ce_chunked_over_v_with_simulated_tiles() -> None:
    blk = block("lm_head_ce_smooth")
    ins = ce_inputs(m=23, v=40)
    cts = cotangents(blk, ins)
    want = blk.vjp(ins, cts, remat="recompute", sim_tile=(8, 16))
    got = blk.vjp(ins, cts, remat="recompute", sim_tile=(8, 16), chunk=24, chunk_dim="V")
    assert_same(got, want, "exact", "tiled over V")


def test_the_column_plan_of_the_lm_head() -> None:
    """w_lm sliced on its columns, dw_lm joined on them, dhg (K = V) and dr (a sum over V)
    accumulated, the target shifted for `col_index() == target`; the smoothed CE reads V whole."""
    plan = block("lm_head_ce").chunk_plan(remat="recompute", chunk_dim="V")
    assert plan.dim == plan.inner == "V" and plan.sliced == {"w_lm": 1} and plan.joined == {"dw_lm": 1}
    assert plan.summed == {"dhg": "bf16", "dr": "f32"} and plan.shifted == {"target_at_V": ("target", None)}
    assert [(n, str(w), dt) for n, w, dt in plan.transients] == [("dacc1", "M", "bf16")] and plan.align == 8
    text = str(plan.block)
    assert "_t7 = _t6 == target_at_V" in text and "_t1 = target >= 0" in text  # the ignore test: whole
    assert "dhg: f32[M, D]" in text
    smooth = block("lm_head_ce_smooth").chunk_plan(remat="recompute", chunk_dim="V")
    assert (
        smooth.inner == "Vc"
        and "dmlogit / V" in str(smooth.block)
        and "w_lm: bf16[D, Vc]" in str(smooth.block)
    )


def test_every_column_chunk_runs_at_its_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[int, tuple[int, ...], Any]] = []
    run_block = coda_lang.interp.run_block

    def spy(ir: Any, plan: Any, env: dict[str, Any], dims: dict[str, int], **kw: Any) -> Any:
        if ir.name.endswith("_bwd"):
            seen.append((dims["V"], np.shape(env["w_lm"]), env["target_at_V"][:3].tolist()))
        return run_block(ir, plan, env, dims, **kw)

    monkeypatch.setattr(coda_lang.interp, "run_block", spy)
    blk = block("lm_head_ce")
    ins = ce_inputs()
    blk.vjp(ins, cotangents(blk, ins), remat="recompute", chunk=16, chunk_dim="V")
    t = ins["target"][:3].astype(int)
    assert seen == [(n, (16, n), (t - v0).tolist()) for v0, n in ((0, 16), (16, 16), (32, 16), (48, 2))]


def test_row_index_compared_with_a_parameter_is_shifted() -> None:
    """pick(acc, t) with an index per column picks rows: in row chunks its backward's `row_index() == t`
    reads t minus the chunk's first row, and the forward's pick along M is a sum over the chunks."""
    b = coda_lang.load(
        "dims M, N, K\nblock pk(x: bf16[M, K], w: bf16[K, N], t: i32[N]) -> (p: f32[N]) {\n"
        "  gemm x @ w { p = pick(acc, t) }\n}"
    )["pk"]
    ins = random_inputs(b.ir, {"M": 13, "K": 8, "N": 16}, seed=1)
    cts = cotangents(b, ins)
    assert b.chunk_plan().shifted == {"t_at_M": ("t", None)}
    for precision in ("exact", "f64"):
        want = b.vjp(ins, cts, precision=precision)
        for chunk in (1, 4, 13):
            assert_same(
                b.vjp(ins, cts, precision=precision, chunk=chunk), want, precision, f"pk chunk={chunk}"
            )
            fwd = run_chunked(b, "M", ins, chunk, precision)  # the pick along M: summed
            assert_same(fwd, b.run(ins, precision=precision), precision, f"pk forward chunk={chunk}")


def test_a_size_read_as_a_value_stays_whole() -> None:
    """mean(acc, over=M) is sum(acc / M): in row chunks it divides by the whole M, summing the chunks."""
    b = coda_lang.load(
        "dims M, N, K\nblock mn(x: bf16[M, K], w: bf16[K, N]) -> (m: f32[N]) { gemm x @ w { m = mean(acc, over=M) } }"
    )["mn"]
    plan = chunk_plan(b, "M")
    assert plan.inner == "Mc" and plan.summed == {"m": "f32"}
    ins = random_inputs(b.ir, {"M": 21, "K": 8, "N": 16}, seed=4)
    for precision in ("exact", "f64"):
        for chunk in (1, 5, 21):
            assert_same(
                run_chunked(b, "M", ins, chunk, precision), b.run(ins, precision=precision), precision, "mean"
            )


def test_columns_of_a_gemm_chunk() -> None:
    """A stage whose columns (N) are the chunked dim: its B operand sliced on its columns, the output
    joined on them."""
    b = coda_lang.load(
        "dims M, N, K\nblock tc(x: bf16[M, K], w: bf16[N, K]) -> (y: bf16[N, M], s: f32[N]) {\n"
        "  gemm w @ transpose(x) { y = acc\n  s = sum(acc, over=M) } }"
    )["tc"]
    plan = chunk_plan(b, "M")
    assert plan.sliced == {"x": 0} and plan.joined == {"y": 1} and plan.summed == {"s": "f32"}
    ins = random_inputs(b.ir, {"M": 19, "K": 8, "N": 16}, seed=5)
    for precision in ("exact", "f64"):
        for chunk in (1, 8, 19):
            assert_same(
                run_chunked(b, "M", ins, chunk, precision), b.run(ins, precision=precision), precision, "tc"
            )


def test_joins_write_into_one_preallocated_output() -> None:
    plan = block("lm_head_ce").chunk_plan(remat="recompute", chunk_dim="V")
    allocs: list[tuple[int, ...]] = []
    accs: list[bool] = []

    def run(sub: dict[str, Any], n: int, acc: bool) -> dict[str, Any]:
        accs.append(acc)  # dhg = acc (K = V): the chunks after the first add to its running total
        dhg = sub["dhg_total"] + 1.0 if acc else np.ones((4, 3))
        return {"dw_lm": np.full((3, n), float(n), np.float32), "dhg": dhg, "dr": np.ones(4)}

    def empty(part: Any, shape: tuple[int, ...]) -> Any:
        allocs.append(shape)
        return np.empty(shape, part.dtype)

    ins = {"w_lm": np.zeros((3, 10)), "target": np.arange(4, dtype=np.int32)}
    out = run_chunks(plan, ins, 10, 4, run, empty, lambda a, b: a + b, lambda t, dt: t)
    assert allocs == [(3, 10)]
    assert accs == [False, True, True] and plan.accumulate == {"dhg": "dhg_total"}
    np.testing.assert_array_equal(out["dw_lm"][0], [4, 4, 4, 4, 4, 4, 4, 4, 2, 2])
    np.testing.assert_array_equal(out["dhg"], np.full((4, 3), 3.0))


# ---------------------------------------------------------------------------- choosing the dim


LLAMA3 = {"M": 8192, "D": 2048, "V": 128256}


@pytest.mark.parametrize("remat", ["recompute", "auto", "save"])
def test_auto_chunks_the_lm_head_over_v(remat: str) -> None:
    """Row chunks hold dw_lm's [D, V] f32 sum (1 GiB; each chunk's GEMM adds to it in place); column
    chunks hold dhg's [M, D] (64 MiB, likewise), dr's sum and a chunk's part of it, and a [D, c] part of
    dw_lm; both a 256 MiB dlogits chunk."""
    blk = block("lm_head_ce")
    plans = {p.dim: p for p in candidate_plans(blk, None, BackwardOptions(remat=remat, chunk="auto"))}
    assert {"M", "V"} <= set(plans)
    m, v = plans["M"], plans["V"]
    cm, cv = (chunk_size(p, LLAMA3[p.dim], LLAMA3, BackwardOptions(chunk="auto")) for p in (m, v))
    assert (cm, cv) == (1024, 16384)  # 256 MiB of bf16 dlogits: [1024, V] or [M, 16384]
    assert m.memory(LLAMA3, cm) == 4 * 2048 * 128256 + 1024 * 2 * 128256 + 1024 * (2 * 2048 + 4)
    assert v.memory(LLAMA3, cv) == 4 * 8192 * 2048 + 2 * 4 * 8192 + 8192 * 2 * 16384 + 2048 * 16384 * 2
    plan, c = choose(list(plans.values()), LLAMA3, BackwardOptions(chunk="auto"))
    assert (plan.dim, c) == ("V", 16384)


def test_auto_chunks_llama_mlp_over_m() -> None:
    blk = block("llama_mlp")
    plans = candidate_plans(blk, None, BackwardOptions(remat="recompute", chunk="auto"))
    assert [p.dim for p in plans] == ["M"]  # D is both rows and K of its GEMMs, F is paired (2*F)
    sizes = {"M": 8192, "D": 2048, "F": 8192}
    assert choose(plans, sizes, BackwardOptions(chunk="auto", budget=2**26))[0].dim == "M"


def test_auto_in_vjp_runs_the_chosen_dim(monkeypatch: pytest.MonkeyPatch) -> None:
    dims: list[dict[str, int]] = []
    run_block = coda_lang.interp.run_block

    def spy(ir: Any, plan: Any, env: dict[str, Any], d: dict[str, int], **kw: Any) -> Any:
        if ir.name.endswith("_bwd"):
            dims.append(dict(d))
        return run_block(ir, plan, env, d, **kw)

    monkeypatch.setattr(coda_lang.interp, "run_block", spy)
    blk = block("lm_head_ce")
    ins = ce_inputs(m=37, d=16, v=48)
    cts = cotangents(blk, ins)
    want = blk.vjp(ins, cts, remat="recompute")
    dims.clear()
    # V: 74 bytes of dlogits per column, 16 f32 values of dhg per row; M: 96 bytes per row, 16 x 48 of dw_lm
    got = blk.vjp(ins, cts, remat="recompute", budget=1200)
    assert [(d["M"], d["V"]) for d in dims] == [(37, 16)] * 3
    assert_same(got, want, "exact", "auto")


def test_chunk_dim_alone_means_auto() -> None:
    blk = block("lm_head_ce")
    ins = ce_inputs()
    cts = cotangents(blk, ins)
    want = blk.vjp(ins, cts, remat="recompute", precision="f64")
    assert_same(blk.vjp(ins, cts, remat="recompute", precision="f64", chunk_dim="V"), want, "f64", "V alone")


# ---------------------------------------------------------------------------- columns on the torch path


@pytest.mark.parametrize("name", CE)
def test_emulated_autograd_chunked_over_v(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    blk = block(name)
    ins = ce_inputs(m=29, v=48)  # stored rows of the kernels: multiples of 16 bytes
    want = _torch_grads(blk.cuda(emulate=True).autograd(remat="recompute"), ins)
    for chunk in (8, 40, 48, 100):  # 40: a ragged last chunk of 8 columns
        fn = blk.cuda(emulate=True).autograd(remat="recompute", chunk=chunk, chunk_dim="V")

        def extent(tensors: dict[str, Any], dims: dict[str, int]) -> int:
            n = dims.get("Vc", dims["V"])  # the smoothed CE's chunks run at Vc (it reads V whole)
            assert dims["V"] == 48 or "Vc" not in dims
            assert tuple(tensors["w_lm"].shape) == (16, n)
            return n

        calls = spy_chunks(fn, monkeypatch, extent)
        got = _torch_grads(fn, ins)
        c = min(chunk, 48)
        assert calls == [("V" if i == 0 else "V+", min(c, 48 - i)) for i in range(0, 48, c)]
        assert_same(got, want, "exact", f"{name} autograd chunk={chunk} over V")


def test_emulated_autograd_refuses_a_column_chunk_the_kernels_cannot_store() -> None:
    """One column of bf16 dlogits is a 2-byte row; the kernels' TMA stores take multiples of 16 bytes
    (the interpreter runs chunk=1 column; "auto" takes multiples of 8 columns)."""
    blk = block("lm_head_ce")
    fn = blk.cuda(emulate=True).autograd(remat="recompute", chunk=1, chunk_dim="V")
    with pytest.raises(coda_lang.CodaError) as e:
        _torch_grads(fn, ce_inputs(m=29, v=48))
    assert "E0807" in str(e.value)


def test_torch_function_and_module_take_chunk_dim() -> None:
    ins = ce_inputs(m=29, v=48)
    blk = block("lm_head_ce_zloss")
    want = _torch_grads(ct.function(blk, remat="recompute"), ins)
    for kw in ({"chunk": 16, "chunk_dim": "V"}, {"chunk_dim": "V", "budget": 29 * 2 * 16}, {"budget": 1200}):
        f = ct.function(blk, remat="recompute", **kw)  # type: ignore[arg-type]
        assert_same(_torch_grads(f, ins), want, "exact", f"function {kw}")
    tens = _torch_inputs(ins)
    mod = ct.BlockModule(blk, {"w_lm": tens.pop("w_lm").detach()}, remat="recompute", chunk=8, chunk_dim="V")
    outs = mod(**tens)
    (outs["loss"].sum() + outs["lse"].sum()).backward()
    ref = _torch_inputs(ins)
    routs = ct.function(blk, remat="recompute")(ref)
    (routs["loss"].sum() + routs["lse"].sum()).backward()
    g, r = mod.w_lm.grad, ref["w_lm"].grad
    assert g is not None and r is not None
    assert_same({"w": g.float().numpy()}, {"w": r.float().numpy()}, "exact", "module")


BAD_DIMS = [
    ({"chunk_dim": 3}, TypeError, "chunk_dim= is 3"),
    (
        {"chunk": 4, "chunk_dim": "X"},
        ValueError,
        "chunk_dim= is 'X'; block lm_head_ce has no such dim (its dims: M, D, V)",
    ),
    ({"chunk_dim": "D", "remat": "recompute"}, coda_lang.CodaError, "sums over `D` (K): only `name = acc`"),
]


@pytest.mark.parametrize("kw,kind,msg", BAD_DIMS, ids=[str(k) for k, _, _ in BAD_DIMS])
def test_bad_chunk_dims_are_refused(kw: dict[str, Any], kind: type[Exception], msg: str) -> None:
    """An argument mistake (a dim's name that is not a str, a dim the block lacks) is a TypeError or a
    ValueError; a dim the program can't be chunked along is the program's CodaError E0809."""
    if kind is coda_lang.CodaError:
        blk = block("lm_head_ce")
        for call in (
            lambda: blk.vjp(ce_inputs(m=8), {"loss": np.ones(8, np.float32)}, **kw),
            lambda: blk.cuda(emulate=True).autograd(**kw),
            lambda: ct.function(blk, **kw),
        ):
            with pytest.raises(coda_lang.CodaError) as e:
                call()
            assert "E0809" in str(e.value) and msg in str(e.value)
    else:
        assert_refused_by_every_entry(kw, kind, msg)
    with pytest.raises(coda_lang.CodaError) as e:
        block("llama_mlp").chunk_plan(chunk_dim="F")
    assert "a chunk of `F` can't split `2*F`" in str(e.value)


def _cuda_grads(fn: Any, ins: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    tens = {k: v.cuda().detach().requires_grad_(v.is_floating_point()) for k, v in _torch_inputs(ins).items()}
    outs = fn(tens)
    gen = torch.Generator().manual_seed(0)
    total = sum(
        (o.float() * torch.randn(o.shape, generator=gen).cuda()).sum()
        for o in outs.values()
        if o.is_floating_point()
    )
    total.backward()  # type: ignore[union-attr]
    return {k: t.grad for k, t in tens.items() if t.grad is not None}


@pytest.mark.gpu
@pytest.mark.parametrize("dim, chunk", [("M", 64), ("V", 128)])
def test_kernels_add_chunks_inside_the_gemm(dim: str, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CUDA kernels: lm_head_ce's backward in chunks of rows (dw_lm summed) or of the vocabulary
    (dhg summed) equals the unchunked one up to the order of f32 summation (each bf16 gradient within
    one rounding), and the summed gradient is one f32 buffer that every chunk's GEMM stores over."""
    from coda_lang.torch import uses_kernels

    if not uses_kernels("cuda"):
        pytest.skip("needs a Hopper GPU (compute capability 9.0) for the kernels")
    monkeypatch.setenv("CODA_TUNE", "0")
    blk = block("lm_head_ce")
    ins = ce_inputs(m=300, d=64, v=520)
    want = _cuda_grads(blk.cuda().autograd(remat="recompute"), ins)
    fn = blk.cuda().autograd(remat="recompute", chunk=chunk, chunk_dim=dim)
    summed = next(iter(fn.chunk_plans[0].accumulate))
    ptrs: list[int] = []
    for cb in fn.chunked_blocks.values():
        call = cb._call

        def spy(tensors: dict[str, Any], dims: Any, consume: Any = None, call: Any = call) -> Any:
            outs = call(tensors, dims, consume)
            ptrs.append(outs[0][summed].data_ptr())
            return outs

        monkeypatch.setattr(cb, "_call", spy)
    got = _cuda_grads(fn, ins)
    assert len(ptrs) > 2 and len(set(ptrs)) == 1, ptrs
    for k, w in want.items():
        g = got[k].float()
        w = w.float()
        ulp = w.abs() * 2.0**-7 + 1e-30 if got[k].dtype == torch.bfloat16 else w.abs() * 1e-5 + 1e-6
        assert bool(((g - w).abs() <= ulp).all()), (k, float((g - w).abs().max()))
