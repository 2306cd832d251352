"""A GEMM's max sink whose one reader folds it to a scalar takes the partials whole (cuda_block.whole_folds).

An fp8 amax is `max(abs(x), over=N)` in an epilogue (per-tile partials per row), then `max(amax_rows,
over=M)` between stages. The runtime used to combine the partials into a row vector (one launch) and
then fold that vector (another); it now hands the partials to the fold, whose torch stand-in folds
every element: one launch, the same scalar (max is exact in any order).

- Which sinks: the fp8 layer's three amaxes (x1, a, x2) and fp8_delayed's; not a sum, not a sink read
  twice or returned, not one whose reader is no fold of its rule.
- The emulated run gives the same outputs, bit for bit, with and without it, and with it binds the
  per-tile partials (a matrix) where it bound a vector.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import coda_lang
from coda_lang.backend_cute.runtime.cuda_block import whole_folds

ROOT = Path(__file__).resolve().parent.parent


def _cb(src: str, name: str) -> Any:
    return coda_lang.load(src)[name].cuda(tile=(128, 64), emulate=True)


def _names(cb: Any) -> set[str]:
    return {n for names in cb._whole.values() for n in names}


def test_the_fp8_layers_amaxes_are_folded_whole() -> None:
    from coda_lang.hf.blocks import model_source

    blk = coda_lang.load(model_source("bfloat16", 1e-5, 64, None, fp8="delayed"))["layer"]
    cb = blk.cuda(emulate=True)
    assert _names(cb) == {"amp_x1", "amp_a", "amp_x2"}
    delayed = _cb((ROOT / "examples" / "fp8_delayed.coda").read_text(), "fp8_delayed")
    assert _names(delayed) == {"row_amax"}


SINKS = """dims M, K, N

block b(x: bf16[M, K], w: bf16[K, N]) -> (y: bf16[M, N], s: f32, m2: f32, lo: f32, r: f32[M], t: f32) {
  gemm x @ w {
    y: bf16 = acc
    rs = sum(acc, over=N)
    rm = max(acc, over=N)
    rn = min(acc, over=N)
    r = max(abs(acc), over=N)
    rt = max(acc * acc, over=N)
  }
  s = sum(rs, over=M)
  m2 = max(rm, over=M) + max(rm, over=M)
  lo = min(rn, over=M)
  t = sum(rt, over=M)
}
"""


def test_only_a_max_or_min_sink_with_one_fold_of_its_rule_is_taken() -> None:
    """rs: a sum (its order would change); rm: read by two folds; r: a block output; rt: folded by
    a sum, not its max; rn: a min, folded by a min: taken."""
    cb = _cb(SINKS, "b")
    assert _names(cb) == {"rn"}
    spec = cb.specs[0]
    assert spec is not None and {s.name for s in spec.sinks} >= {"rs", "rm", "rn", "r", "rt"}
    # (a fold in a generated vector run reads a vector as its type says: never taken)
    run = {i for i, s in enumerate(cb.ir.body) if getattr(s, "op", None) == "reduce_min"}
    assert whole_folds(cb.ir, cb.specs, cb.plan.storage, frozenset(run)) == {}


@pytest.mark.parametrize("name", ["fp8_delayed", "sinks"])
def test_the_run_is_the_same_with_the_partials_folded_whole(name: str) -> None:
    """The emulated run (several tiles both ways, ragged last ones) with and without whole folds:
    every output bit for bit; with them the sink is bound as its per-tile partials."""
    if name == "sinks":
        src, blk, sizes = SINKS, "b", {"M": 300, "K": 40, "N": 200}
    else:
        src, blk, sizes = (ROOT / "examples" / "fp8_delayed.coda").read_text(), "fp8_delayed", None
        sizes = {"M": 300, "K": 40, "N": 208, "P": 72}  # (hq's rows: a multiple of 16 bytes)
    block = coda_lang.load(src)[blk]
    g = torch.Generator().manual_seed(7)
    ins: dict[str, Any] = {}
    for p in block.ir.params:
        t = p.var.type
        if not t.shape:
            ins[p.var.name] = torch.tensor(37.5)
            continue
        shape = tuple(int(d.evaluate(sizes)) for d in t.shape)
        x = torch.randn(shape, generator=g) * 2
        ins[p.var.name] = x.to(torch.float8_e4m3fn) if t.dtype == "e4m3" else x.to(torch.bfloat16)
    on = block.cuda(tile=(128, 64), emulate=True)
    off = block.cuda(tile=(128, 64), emulate=True)
    off._whole = {}
    assert on._whole and not off._whole
    got, want = on(ins), off(ins)
    assert got.keys() == want.keys()
    for k in want:
        a, b = got[k], want[k]
        assert a.dtype == b.dtype and a.shape == b.shape, k
        assert torch.equal(
            a.view(torch.uint8) if a.element_size() == 1 else a,
            b.view(torch.uint8) if b.element_size() == 1 else b,
        ), k
    env_on, _, _ = on._run(dict(ins))
    env_off, _, _ = off._run(dict(ins))
    (sink,) = _names(on)
    assert env_off[sink].dim() == 1 and env_on[sink].dim() == 2
    fold = torch.amin if sink == "rn" else torch.amax
    assert torch.equal(fold(env_on[sink]), fold(env_off[sink]))
