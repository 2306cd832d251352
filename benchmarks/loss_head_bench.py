"""The LM head + cross-entropy alone, forward and backward, at Llama-3.2-1B shapes: coda's loss head
in its two modes against Liger Kernel's fused linear cross-entropy, torch eager and torch.compile, and
the floor of three cuBLAS GEMMs; and the [tokens, (H + 2 KV) * HD] QKV gradient made from dq, dk, dv.

Not a test; on a Hopper GPU host (after `source .gpu/env/gpu.sh`):

    python benchmarks/loss_head_bench.py [--M 8192] [--rows 1024,2048,4096] [--no-compile] [--heads]

Each configuration computes sum(CE(logits, target)) / n with logits = (hg @ w^T) * r (hg the normed
hidden state before its row scale r, as the patch's blocks keep it; Liger and torch get hg * r) and
the gradients of hg, r and w, on the same random bf16 inputs (about 3% of the targets -100). It is
timed twice with `triton.testing.do_bench` (median; the two timings show the warm-up was enough), and
its peak memory is `torch.cuda.max_memory_allocated` above the inputs during one call. Errors: each
gradient against torch eager's in f32, relative in the 2-norm. `--heads` also times the backward of
the q/k/v split (the patch's `Heads` against autograd's split + transpose) at the layer's shapes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--M", type=int, default=8192)
    p.add_argument("--D", type=int, default=2048)
    p.add_argument("--V", type=int, default=128256)
    p.add_argument("--rows", default="2048,4096", help="row chunks of coda's rows mode")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    p.add_argument("--no-liger", action="store_true", help="skip Liger Kernel")
    p.add_argument("--heads", action="store_true", help="also time the q/k/v split's backward")
    a = p.parse_args()

    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from coda_lang.api import load
    from coda_lang.hf.blocks import model_source
    from coda_lang.hf.loss import LOSS_CHUNK_BYTES, ChunkedLoss
    from coda_lang.torch import function

    dev = torch.device("cuda")
    torch.manual_seed(0)
    m, d, v = a.M, a.D, a.V
    hg = (torch.randn(m, d, device=dev) * 0.5).bfloat16()
    r = torch.rand(m, device=dev) + 0.5
    w = (torch.randn(v, d, device=dev) * 0.02).bfloat16()
    target = torch.randint(0, v, (m,), device=dev, dtype=torch.int32)
    target[torch.rand(m, device=dev) < 0.03] = -100
    n = (target != -100).sum()

    prog = load(model_source("bfloat16", 1e-5, 64, False))
    wrt = ["hg", "r", "w_lm"]
    vocab = function(prog["head_loss"], wrt=wrt, chunk="auto", chunk_dim="V", budget=LOSS_CHUNK_BYTES)
    rows_head = function(prog["head_loss_rows"], wrt=wrt, remat="save", chunk_dim="M")

    def coda_vocab(x: Any, s: Any, wt: Any) -> Any:
        return vocab(hg=x, r=s, w_lm=wt, target=target)["loss"].sum() / n

    def coda_rows(rows: int) -> Any:
        def f(x: Any, s: Any, wt: Any) -> Any:
            return ChunkedLoss.apply(x, s, wt, target, n, rows_head, rows, None)

        return f

    def torch_eager(x: Any, s: Any, wt: Any) -> Any:
        logits = (x @ wt.t()).float() * s[:, None]
        return F.cross_entropy(logits, target.long(), ignore_index=-100, reduction="sum") / n

    configs: list[tuple[str, Any]] = [("torch eager", torch_eager), ("coda vocab", coda_vocab)]
    configs += [
        (f"coda rows {c}" + (" (default)" if c == "4096" else ""), coda_rows(int(c)))
        for c in a.rows.split(",")
        if c
    ]
    if not a.no_liger:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=-100, reduction="sum")

        def liger_fn(x: Any, s: Any, wt: Any) -> Any:
            return liger(wt, (x.float() * s[:, None]).bfloat16(), target.long()) / n

        configs.append(("Liger FLCE 0.8.5", liger_fn))
    if not a.no_compile:
        configs.append(("torch.compile", torch.compile(torch_eager)))

    def step(f: Any) -> tuple[Any, ...]:
        x = hg.detach().requires_grad_()
        s = r.detach().requires_grad_()
        wt = w.detach().requires_grad_()
        loss = f(x, s, wt)
        loss.backward()
        return loss.detach(), x.grad, s.grad, wt.grad

    def floor() -> None:  # the three GEMMs of a fused head, bare: logits, dh, dw
        lg = hg @ w.t()
        torch.mm(lg, w)
        torch.mm(lg.t(), hg)

    base = torch.cuda.memory_allocated()
    ref = step(torch_eager)
    rows_out = []
    t_floor = (do_bench(floor, warmup=200, rep=1000), do_bench(floor, warmup=50, rep=1000))
    print(
        f"{'':24s} {'ms (twice)':>17s} {'x floor':>8s} {'peak GiB':>9s} {'err dh':>9s} {'err dr':>9s} {'err dw':>9s}"
    )
    print(f"{'3 cuBLAS GEMMs (floor)':24s} {t_floor[0]:8.2f} {t_floor[1]:8.2f}")
    for name, f in configs:
        got = step(f)  # warm (compiles, tunes)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        got = step(f)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        errs = [
            float((g.float() - e.float()).norm() / e.float().norm())
            for g, e in zip(got[1:], ref[1:], strict=True)
        ]
        del got
        t = (
            do_bench(lambda f=f: step(f), warmup=200, rep=1000),
            do_bench(lambda f=f: step(f), warmup=50, rep=1000),
        )
        rows_out.append((name, t, peak, errs))
        print(
            f"{name:24s} {t[0]:8.2f} {t[1]:8.2f} {t[1] / t_floor[1]:8.2f}x {peak:9.2f} "
            + " ".join(f"{e:9.1e}" for e in errs),
            flush=True,
        )

    if a.heads:
        heads_bench(dev)


def heads_bench(dev: Any) -> None:
    """The backward of the q/k/v split at one layer's shapes: autograd's split (contiguous copies,
    then a concatenation) against the patch's `Heads` (one copy per part)."""
    import torch

    from coda_lang.hf.forward import Heads

    b, s, h, kv, hd = 1, 8192, 32, 8, 64
    qkv = torch.randn(b * s, (h + 2 * kv) * hd, device=dev).bfloat16().requires_grad_()
    gs = [torch.randn(b, n, s, hd, device=dev).bfloat16() for n in (h, kv, kv)]  # [B, H, S, D] grads

    def split(x: Any) -> Any:
        qs, ks, vs = x.split([h * hd, kv * hd, kv * hd], dim=1)
        return tuple(t.view(b, s, -1, hd).transpose(1, 2) for t in (qs, ks, vs))

    for name, f in (("autograd split", split), ("Heads", lambda x: Heads.apply(x, b, s, h, kv, hd))):

        def run(f: Any = f) -> Any:
            outs = f(qkv)
            return torch.autograd.grad(outs, qkv, gs)[0]

        got = run()
        want = torch.cat([g.transpose(1, 2).reshape(b * s, -1) for g in gs], dim=1)
        assert torch.equal(got, want), name
        # GPU time of the kernels (the call alone is bound by the host's autograd and launches)
        for _ in range(20):
            run()
        torch.cuda.synchronize()
        times = []
        for _ in range(2):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    run()
                torch.cuda.synchronize()
            times.append(sum(e.self_device_time_total for e in prof.key_averages()) / 20)
        print(f"heads backward, {name:16s} {times[0]:8.1f} {times[1]:8.1f} us of kernels per call")


if __name__ == "__main__":
    main()
