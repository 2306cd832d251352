"""Attention's forward+backward on q, k, v as views of one fused QKV tile (as the patch passes them)
against q, k, v as separate projections' outputs (as Hugging Face's model passes them).

Not a test; on a GPU host:

    python benchmarks/attn_layout.py [--heads 32,8,128] [--seq 8192]

Both run transformers' sdpa_attention_forward (causal, no mask; `--window`: a sliding window's mask) with the same values; each is timed
fwd+bwd with do_bench (L2 flushed), and the layouts (strides) of the inputs and of the gradients the
backward returns are printed, with the cuDNN/flash kernel time per call from the profiler.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", default="32,8,128", help="H,KV,HD (default Mistral-7B's)")
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--window", type=int, default=0, help="a sliding window (Mistral's mask), 0: none")
    a = p.parse_args()
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from triton.testing import do_bench

    from coda_lang.hf.forward import Heads

    h, kv, hd = (int(x) for x in a.heads.split(","))
    s, dev, dt = a.seq, "cuda", torch.bfloat16

    class Mod(torch.nn.Module):
        is_causal = True
        num_key_value_groups = h // kv
        training = True

    mod = Mod()
    mask = None
    if a.window:
        import transformers.masking_utils as mu
        from transformers import MistralConfig

        cfg = MistralConfig(sliding_window=a.window, num_attention_heads=h, num_key_value_heads=kv)
        cfg._attn_implementation = "sdpa"
        mask = mu.create_sliding_window_causal_mask(
            config=cfg,
            inputs_embeds=torch.empty(1, s, 8, device=dev, dtype=dt),
            attention_mask=None,
            past_key_values=None,
            position_ids=torch.arange(s, device=dev)[None],
        )
        print(f"mask: {type(mask).__name__} {getattr(mask, 'shape', '')} {getattr(mask, 'dtype', '')}")
    torch.manual_seed(0)
    fused = torch.randn(s, (h + 2 * kv) * hd, device=dev, dtype=dt)
    d_out = torch.randn(1, s, h * hd, device=dev, dtype=dt)

    def views() -> tuple[torch.Tensor, ...]:
        x = fused.detach().requires_grad_()
        return (x, *Heads.apply(x, 1, s, h, kv, hd))

    def separate() -> tuple[torch.Tensor, ...]:
        q, k, v = fused.detach().split([h * hd, kv * hd, kv * hd], dim=1)
        ins = [t.contiguous().requires_grad_() for t in (q, k, v)]
        return (
            ins[0],
            *(t.view(1, s, n, hd).transpose(1, 2) for t, n in zip(ins, (h, kv, kv), strict=True)),
        )

    def run(make) -> None:  # type: ignore[no-untyped-def]
        leaf, q, k, v = make()
        out, _ = sdpa_attention_forward(mod, q, k, v, mask, dropout=0.0, scaling=hd**-0.5)
        out.reshape(1, s, h * hd).backward(d_out)

    for name, make in (("fused views (coda)", views), ("separate (HF)", separate)):
        leaf, q, k, v = make()
        out, _ = sdpa_attention_forward(mod, q, k, v, mask, dropout=0.0, scaling=hd**-0.5)
        g = torch.autograd.grad(out.reshape(1, s, h * hd), (q, k, v), d_out)
        ms = do_bench(lambda make=make: run(make), warmup=5, rep=50)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                run(make)
            torch.cuda.synchronize()
        top = sorted(((e.key, e.device_time_total / 3e3) for e in prof.key_averages()), key=lambda t: -t[1])[
            :4
        ]
        print(
            f"{name}: fwd+bwd {ms:.3f} ms; q {tuple(q.stride())}, k {tuple(k.stride())}; "
            f"dq {tuple(g[0].stride())}, dk {tuple(g[1].stride())}"
        )
        for key, t in top:
            print(f"    {t:7.3f} ms  {key[:110]}")


if __name__ == "__main__":
    main()
