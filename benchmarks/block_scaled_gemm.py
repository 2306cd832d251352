"""The block-scaled fp8 mainloop (coda_lang/backend_cute/plan/block_scaled.py) against quack's own fp8
loop and cuBLAS, on one GPU: `python benchmarks/block_scaled_gemm.py [--shape M,N,K]`.

Each kernel stores bf16 D = A @ B^T of e4m3 operands (A [M, K], B [N, K], both K-major). Rows:
- block-scaled: our loop, 1x128 scales of A and 128x128 of B (all 1 here: the timing does not depend on
  their values), 128x128 cooperative tiles, clusters of 2 along M;
- quack fp8: quack 0.6.5's own loop (each K tile promoted into the f32 accumulator, unscaled), at the
  same tile and at 128x192;
- cuBLAS: `torch._scaled_mm` with per-tensor scales, and with 1x128 / 128x128 block scales where this
  torch build takes them.
Times are CUDA events over 20 launches after one warm-up (compiles excluded).
"""

from __future__ import annotations

import argparse
import importlib

import torch
from cuda_events import event_ms

G = 128


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shape", default="8192,8192,2048", help="M,N,K (default: the SwiGLU down projection's dgrad)"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (Hopper)")
    M, N, K = (int(x) for x in args.shape.split(","))
    importlib.import_module("coda_lang.backend_cute.build.quack_adapter")  # (before quack's frontend)
    gemm_epilogue = importlib.import_module("quack.epilogue.frontend").gemm_epilogue
    BlockScale = importlib.import_module("coda_lang.backend_cute.plan.block_scaled").BlockScale

    @gemm_epilogue(extra_ops=(BlockScale("sa", "a", "sb"), BlockScale("sb", "b", "sa")))
    def epi_bs(acc):
        return {"D": acc}

    @gemm_epilogue()
    def epi_plain(acc):
        return {"D": acc}

    A = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
    B = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.ones(M, -(-K // G), device="cuda")
    sb = torch.ones(N // G, -(-K // G), device="cuda")
    D = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    kw = dict(tile_M=128, tile_N=128, cluster_M=2, cluster_N=1, pingpong=False, persistent=True, b_kn=False)
    rows = {
        "block-scaled 128x128": event_ms(
            lambda: epi_bs.gemm(A, B, D, None, epi_args={"sa": sa, "sb": sb}, **kw)
        ),
        "quack fp8 128x128": event_ms(lambda: epi_plain.gemm(A, B, D, None, epi_args={}, **kw)),
        "quack fp8 128x192": event_ms(
            lambda: epi_plain.gemm(A, B, D, None, epi_args={}, **dict(kw, tile_N=192))
        ),
    }
    one = torch.ones((), device="cuda")
    rows["cuBLAS per-tensor"] = event_ms(lambda: torch._scaled_mm(A, B.T, one, one, out_dtype=torch.bfloat16))
    try:
        rows["cuBLAS 1x128 / 128x128"] = event_ms(
            lambda: torch._scaled_mm(A, B.T, sa, sb, out_dtype=torch.bfloat16)
        )
    except RuntimeError as e:
        print(f"cuBLAS block scales: not in this torch ({str(e).splitlines()[0]})")
    print(f"{torch.cuda.get_device_name()}, {M} x {N} x {K}, e4m3 -> bf16")
    for name, ms in rows.items():
        print(f"  {name:26s} {ms:.3f} ms  {2 * M * N * K / ms / 1e9:7.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
