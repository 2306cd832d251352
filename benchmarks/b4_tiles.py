"""Where llama_mlp's norm-backward stage (b4: `dacc2 @ transpose(w_13)`, two tile loads and the dg
column partials) loses against cuBLAS: the stage and the bare GEMM of the same shape, both as quack
kernels through coda, at each spill-free tile, next to cuBLAS. Not a test; on the GPU host:

    python benchmarks/b4_tiles.py [--M 16384] [--D 4096] [--warmup 10] [--rep 60]

If quack's bare GEMM at a tile is as slow as the fused stage, the gap is the mainloop at that tile, not
the epilogue. Medians of triton.testing.do_bench (L2 flushed), one process.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PLAIN = """dims M, N, K
block plain(a: bf16[M, K], w: bf16[N, K]) -> (out: bf16[M, N]) {
  gemm a @ transpose(w) {
    out = acc
  }
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--M", type=int, default=16384)
    ap.add_argument("--D", type=int, default=4096)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rep", type=int, default=60)
    a = ap.parse_args()
    os.environ["CODA_TUNE"] = "0"
    import torch
    from triton.testing import do_bench

    import coda_lang
    from coda_lang.backend_cute.compile import TileConfig

    M, D = a.M, a.D
    F = {2048: 5632, 4096: 11008}.get(D, (8 * D // 3 + 255) // 256 * 256)
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(torch.bfloat16)

    bwd = coda_lang.load(ROOT / "examples" / "llama_mlp.coda")["llama_mlp"].grad()
    env = {"dacc2": randn(M, 2 * F), "w_13": randn(D, 2 * F, scale=D**-0.5), "h": randn(M, D), "dx2": randn(M, D),
           "dss": torch.randn(M, device="cuda", generator=g) * 1e-3, "g": 1 + 0.1 * torch.randn(D, device="cuda")}
    plain = next(iter(coda_lang.load(PLAIN)))
    ins = {"a": env["dacc2"], "w": env["w_13"]}
    ms = lambda fn: do_bench(fn, warmup=a.warmup, rep=a.rep, return_mode="median")  # noqa: E731
    cublas = ms(lambda: torch.matmul(env["dacc2"], env["w_13"].t()))
    print(f"{torch.cuda.get_device_name()}, M={M} D={D} K=2F={2 * F}: cuBLAS {cublas:.3f} ms", flush=True)
    print("| tile | b4 ms | b4/cuBLAS | quack bare GEMM ms | bare/cuBLAS |")
    print("|---|---|---|---|---|")
    for c in (TileConfig(128, 160), TileConfig(128, 128), TileConfig(256, 128, 2, 1, False),
              TileConfig(128, 192), TileConfig(192, 128, 2, 1, False)):
        row = [str(c)]
        try:
            cb = bwd.cuda(tile={4: c}, tune=False)
            r = cb.runner(4)
            args = r.arguments(env)
            torch.ops.coda.stage(r.key, *args)
            t = ms(lambda r=r, args=args: torch.ops.coda.stage(r.key, *args))
            row += [f"{t:.3f}", f"{t / cublas:.2f}"]
        except Exception as e:  # a tile the stage can't take
            row += [f"- ({type(e).__name__})", "-"]
        try:
            pr = plain.cuda(tile=c, tune=False).runner(1)
            pargs = pr.arguments(ins)
            torch.ops.coda.stage(pr.key, *pargs)
            t = ms(lambda pr=pr, pargs=pargs: torch.ops.coda.stage(pr.key, *pargs))
            row += [f"{t:.3f}", f"{t / cublas:.2f}"]
        except Exception as e:
            row += [f"- ({type(e).__name__})", "-"]
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
