"""llama_mlp's fused stages at each tile, next to the bare GEMM of the same shape at the same tile (both
quack kernels through coda), quack's own bare GEMM (`quack.gemm_interface.gemm`, its default config)
and cuBLAS. Not a test; on the GPU host:

    python benchmarks/stage_tiles.py [--M 16384] [--D 4096] [--stages f1,f3,b2,b4] [--warmup 10] [--rep 60]

Stages: f1..f3 of the forward as autograd runs it (it also stores what the backward reads), b1..b6 of
the derived backward. If quack's bare GEMM at a tile is as slow as the fused stage, the gap is the
mainloop at that tile, not the epilogue. `e16`: the epilogue subtile 16 columns wide (quack: 32).
Medians of triton.testing.do_bench (L2 flushed), one process, CODA_TUNE=0.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PLAIN = """dims M, N, K
block nn(a: bf16[M, K], w: bf16[K, N]) -> (out: bf16[M, N]) {
  gemm a @ w {
    out = acc
  }
}
block nt(a: bf16[M, K], w: bf16[N, K]) -> (out: bf16[M, N]) {
  gemm a @ transpose(w) {
    out = acc
  }
}
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--M", type=int, default=16384)
    ap.add_argument("--D", type=int, default=4096)
    ap.add_argument("--stages", default="f1,f3,b2,b4", help="comma-separated: f1..f3, b1..b6")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rep", type=int, default=60)
    a = ap.parse_args()
    os.environ["CODA_TUNE"] = "0"
    import torch
    from triton.testing import do_bench

    import coda_lang
    from coda_lang.backend_cute.build.config import TileConfig

    M, D = a.M, a.D
    F = {2048: 5632, 4096: 11008}.get(D, (8 * D // 3 + 255) // 256 * 256)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)

    d = coda_lang.load(ROOT / "examples" / "llama_mlp.coda")["llama_mlp"].derivation()
    f32 = torch.float32
    env = {
        "y": randn(M, D),
        "x": randn(M, D),
        "w_o": randn(D, D, scale=D**-0.5),
        "g": 1 + randn(D, scale=0.1, dtype=f32),
        "w_13": randn(D, 2 * F, scale=D**-0.5),
        "w_2": randn(F, D, scale=F**-0.5),
        "eps": 1e-6,
        "r": 1 + randn(M, scale=0.1, dtype=f32),
        "hg": randn(M, D),
        "h": randn(M, D),
        "a": randn(M, F),
        "dx2": randn(M, D),
        "acc2": randn(M, 2 * F),
        "dacc2": randn(M, 2 * F),
        "dacc1": randn(M, D),
        "dss": randn(M, scale=1e-3, dtype=f32),
    }
    plain = {b.name: b for b in coda_lang.load(PLAIN)}
    ms = lambda fn: do_bench(fn, warmup=a.warmup, rep=a.rep, return_mode="median")  # noqa: E731
    tiles = (
        TileConfig(128, 192),
        TileConfig(128, 192, epi_n=16),
        TileConfig(128, 160),
        TileConfig(128, 128),
        TileConfig(256, 128, 2, 1, False),
        TileConfig(256, 128, 2, 1, False, epi_n=16),
        TileConfig(128, 192, 1, 2),
    )
    print(f"{torch.cuda.get_device_name()}, M={M} D={D} F={F}, bf16", flush=True)
    print("| stage | tile | coda ms | /cuBLAS | bare (coda, same tile) ms | /cuBLAS |")
    print("|---|---|---|---|---|---|")
    for name in a.stages.split(","):
        block = d.forward if name[0] == "f" else d.backward
        k = int(name[1:])
        cb0 = block.cuda(tile={k: TileConfig(128, 128)}, tune=False)
        spec = cb0.runner(k).spec
        g = spec.gemm
        A = env[g.a].t() if g.ta else env[g.a]
        B = env[g.b]
        Bkn = B.t() if g.tb else B
        cublas = ms(lambda A=A, Bkn=Bkn: torch.matmul(A, Bkn))
        try:
            from quack.gemm_interface import gemm as quack_gemm

            qbare = ms(lambda A=A, Bkn=Bkn: quack_gemm(A, Bkn, tuned=False))
            qtxt = f"{qbare:.3f} ms = {qbare / cublas:.2f}x"
        except Exception as e:  # quack's interface refuses this layout
            qtxt = f"- ({type(e).__name__}: {str(e)[:80]})"
        print(
            f"| {name}: `{spec.text}` | cuBLAS {cublas:.3f} ms; quack.gemm default {qtxt} | | | | |",
            flush=True,
        )
        pb = plain["nt" if g.tb else "nn"]
        pins = {"a": A, "w": B}
        for c in tiles:
            row = [name, str(c)]
            for blk, inputs, idx in ((block, env, k), (pb, pins, 1)):
                try:
                    r = blk.cuda(tile={idx: c}, tune=False).runner(idx)
                    args = r.arguments(inputs)
                    torch.ops.coda.stage(r.key, *args)
                    t = ms(lambda r=r, args=args: torch.ops.coda.stage(r.key, *args))
                    row += [f"{t:.3f}", f"{t / cublas:.2f}"]
                except Exception as e:  # a tile the stage can't take
                    row += [f"- ({type(e).__name__})", "-"]
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
