"""The Hugging Face patch's elementwise stages at Llama-3.2-1B shapes: the generated Triton kernel
against torch.compile's (Inductor), and the attention layouts the patch hands to sdpa.

Not a test; on a Hopper GPU host (after `source .gpu/env/gpu.sh`):

    python benchmarks/elementwise_bench.py [--M 8192] [--attention]

For each block's backward (layer, first_qkv, last) with the patch's gradients, its elementwise stage
(RoPE's backward, the final norm's backward) runs once as the generated Triton kernel
(backend_triton/generate.py) and once compiled by torch.compile (`dynamic=None`, as the runtime
did before), on the same random inputs (RoPE frequencies <= 1 and positions 0..M-1, as in the model);
each is timed twice with `triton.testing.do_bench` (the two timings show the warm-up was enough), and
its largest error against the eager torch function is printed (relative to the output's largest
value). `--attention` adds one layer's sdpa forward+backward (causal, GQA) on q/k/v as views of the
fused QKV tile (the patch's), as dense [B, S, H, D] tensors (HF's), and as contiguous [B, H, S, D].
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WEIGHTS = {"w_o", "w_13", "w_2", "w_qkv", "g", "g1", "g2", "y", "x", "h"}


def stage_inputs(st: Any, rows: int, sizes: dict[str, int], dev: Any) -> list[Any]:
    import torch

    ins: list[Any] = []
    for ld in st.loads:
        shp = [int(d.coeff * sizes[d.name]) for d in ld.shape]
        if ld.role == "scalar":
            ins.append(0.5)
            continue
        x = torch.randn(*shp, device=dev)
        if ld.name == "pos":
            x = torch.arange(rows, device=dev).float()
        elif ld.name == "freq":
            x = 500000.0 ** (-(torch.arange(shp[0], device=dev) % 32).float() * 2 / 64)
        elif ld.role == "row vector":
            x = x.abs() + 0.5
        ins.append(x.to({"bf16": torch.bfloat16, "f32": torch.float32}[ld.dtype]))
    return ins


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--M", type=int, default=8192)
    p.add_argument("--attention", action="store_true")
    a = p.parse_args()

    import torch
    from triton.testing import do_bench

    import coda_lang
    from coda_lang.backend_triton.elementwise import ElementwiseStage
    from coda_lang.backend_triton.generate import TritonStage
    from coda_lang.hf.blocks import model_source

    dev = torch.device("cuda")
    sizes = {"M": a.M, "P": 1536, "D": 2048, "F": 8192, "K": 2048}
    prog = coda_lang.load(model_source("bfloat16", 1e-5, 64, False))
    torch.manual_seed(0)
    print("| stage | shape | generated Triton (ms) | Inductor (ms) | err Triton | err Inductor |")
    print("|---|---|---|---|---|---|")
    for bn in ("layer", "first_qkv", "last"):
        b = prog[bn]
        g = b.grad(wrt=[q.var.name for q in b.ir.params if q.var.name in WEIGHTS])
        st = ElementwiseStage(g, 1, emulate=False)
        rows, cols = a.M, int(st.cols.coeff * sizes[st.cols.name])
        ins = stage_inputs(st, rows, sizes, dev)
        ref = st._body(rows, cols, sizes, dev, *ins)
        cells = []
        errs = []
        for f in (TritonStage(st), torch.compile(st.own_body(), dynamic=None, fullgraph=True)):
            out = f(rows, cols, sizes, dev, *ins)
            errs.append(
                max(
                    float((o.float() - r.float()).abs().max() / r.float().abs().max())
                    for o, r in zip(out, ref, strict=True)
                )
            )

            def call(f: Any = f, rows: int = rows, cols: int = cols, ins: list[Any] = ins) -> Any:
                return f(rows, cols, sizes, dev, *ins)

            t1 = do_bench(call, warmup=200, rep=500)
            t2 = do_bench(call, warmup=200, rep=500)
            cells.append(f"{t1:.4f} / {t2:.4f}")
        print(
            f"| {bn}_bwd stage 1 | {rows}x{cols} | {cells[0]} | {cells[1]} | {errs[0]:.1e} | {errs[1]:.1e} |"
        )

    if a.attention:
        import torch.nn.functional as F

        B, S, H, KV, HD = 1, a.M, 32, 8, 64
        fused = torch.randn(S, (H + 2 * KV) * HD, device=dev, dtype=torch.bfloat16)
        qs, ks, vs = fused.split([H * HD, KV * HD, KV * HD], dim=1)
        views = (
            qs.view(B, S, H, HD).transpose(1, 2),
            ks.view(B, S, KV, HD).transpose(1, 2),
            vs.view(B, S, KV, HD).transpose(1, 2),
        )
        do = torch.randn(B, S, H * HD, device=dev, dtype=torch.bfloat16).view(B, S, H, HD).transpose(1, 2)
        layouts = {
            "views of the fused QKV tile": lambda: [x.detach() for x in views],
            "dense [B, S, H, D]": lambda: [
                x.detach().clone(memory_format=torch.preserve_format) for x in views
            ],
            "contiguous [B, H, S, D]": lambda: [x.detach().contiguous() for x in views],
        }
        print("\n| q/k/v for sdpa (one layer, causal, GQA) | fwd+bwd (ms) |")
        print("|---|---|")
        for name, make in layouts.items():
            q, k, v = (x.requires_grad_() for x in make())

            def step(q: Any = q, k: Any = k, v: Any = v) -> None:
                q.grad = k.grad = v.grad = None
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(do)

            t1 = do_bench(step, warmup=20, rep=200)
            t2 = do_bench(step, warmup=20, rep=200)
            print(f"| {name} | {t1:.3f} / {t2:.3f} |")
    print(f"\n{torch.cuda.get_device_name()}, M={a.M}, bf16")


if __name__ == "__main__":
    main()
