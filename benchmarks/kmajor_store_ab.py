"""An fp8 GEMM whose epilogue also stores its output's K-major copy, against the GEMM alone and the
transposing pass the copy replaces, on one GPU: `python benchmarks/kmajor_store_ab.py`.

What a derived backward's fp8 GEMM epilogue does since the thirty-first session (spec.Output.kmajor,
docs/backend.md): besides D (e5m2 [M, N], N-major), a TileStore of the same tile into the transposed
view of an [N, K] buffer (K = M padded to 16, zeros past M), which quack stores M-major. Per shape and
tile (128 x 128 cooperative, 128 x 128 and 128 x 96 pingpong): whether the copy is D transposed, code
for code, with zeros past M; the time of the GEMM storing D alone, of the GEMM storing D and the copy,
and of `layouts.transposed` making the copy from D in a pass (what the runtime does without the
epilogue's copy). e4m3 x e4m3, CUDA events over 30 launches after 3, compiles excluded.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from cuda_events import event_ms


def bench(f: Any) -> float:
    """ms per call: CUDA events over 30 calls after 3 (cuda_events.event_ms)."""
    return event_ms(f, n=30, warmup=3)


def main() -> None:
    # (the adapter first: it sets the arch and the caches before quack's frontend is imported)
    importlib.import_module("coda_lang.backend_cute.build.quack_adapter")
    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.ops import TileStore

    from coda_lang.backend_triton import kmajor_width
    from coda_lang.backend_triton.layouts import transposed

    @gemm_epilogue(outputs=(TileStore("t"),))
    def epi_copy(acc: Any) -> Any:
        return {"D": acc, "t": acc}

    @gemm_epilogue()
    def epi_d(acc: Any) -> Any:
        return {"D": acc}

    print(f"{torch.cuda.get_device_name()}, e4m3 x e4m3 -> e5m2 D, ms")
    print("| M x N x K | tile | copy | D alone | D + copy | transposing pass |")
    print("|---|---|---|---|---|---|")
    for m, n, k in ((8192, 2048, 3072), (8192, 2048, 16384), (8192, 3072, 2048), (1000, 384, 640)):
        for line in shape_rows(epi_copy, epi_d, transposed, kmajor_width(m), m, n, k):
            print(line, flush=True)


def shape_rows(epi_copy: Any, epi_d: Any, transposed: Any, width: int, m: int, n: int, k: int) -> list[str]:
    """The table's rows of one shape, one per tile."""
    A = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    B = (torch.randn(n, k, device="cuda") * 0.05).to(torch.float8_e4m3fn)
    D = torch.empty(m, n, device="cuda", dtype=torch.float8_e5m2)
    T = torch.zeros(n, width, device="cuda", dtype=torch.float8_e5m2)
    view = T[:, :m].t()
    rows = []
    for tile_n, pingpong in ((128, False), (128, True), (96, True)):
        kw = dict(
            tile_M=128,
            tile_N=tile_n,
            cluster_M=2,
            cluster_N=1,
            pingpong=pingpong,
            persistent=True,
            b_kn=False,
        )
        epi_copy.gemm(A, B, D, None, epi_args={"t": view}, **kw)
        torch.cuda.synchronize()
        same = torch.equal(view.contiguous().view(torch.uint8), D.view(torch.uint8))
        ok = same and not T[:, m:].view(torch.uint8).any()
        both = bench(lambda kw=kw: epi_copy.gemm(A, B, D, None, epi_args={"t": view}, **kw))
        alone = bench(lambda kw=kw: epi_d.gemm(A, B, D, None, epi_args={}, **kw))
        step = bench(lambda: transposed(D, width))
        tile = f"128x{tile_n} {'pingpong' if pingpong else 'cooperative'}"
        rows.append(
            f"| {m} x {n} x {k} | {tile} | {'D transposed' if ok else 'WRONG'} | {alone:.3f} | {both:.3f} | {step:.3f} |"
        )
    return rows


if __name__ == "__main__":
    main()
