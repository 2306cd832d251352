"""quack's fp8 mainloop against a variant whose promotion overlaps the next K tile's WGMMAs, on one
GPU: `python benchmarks/fp8_promotion_ab.py`.

Not a test, and not the kernels' loop: a measurement of whether the second accumulator's promotion
costs the fp8 GEMMs time. quack 0.6.5's fp8 loop (and so every coda fp8 GEMM at a cooperative tile)
issues each 128-deep K tile's WGMMAs into the accumulator, waits for them (`wait_group(0)`) and adds
the result into a second f32 accumulator, so the tensor cores sit idle while it adds. The variant here
(`_pipelined_mma`) keeps two temporary accumulators: each K tile's WGMMAs are issued before the tile
before it is added (`wait_group(1)`), U tiles an iteration (ptxas serializes the WGMMAs where a
temporary is read across the loop's back edge: warning C7514), the same additions in the same order,
so D is bit for bit quack's. It is installed on quack's kernel object by an epilogue op that the
epilogue never reads (as plan/block_scaled.py does), and compiles without spills at 128x128
cooperative (three accumulators of 64 values a thread under quack's 232-register budget).
Prints, per shape of the fp8 Llama-3.2-1B layer's GEMMs: quack's loop at 128x128 and 128x192
cooperative, the variant at 128x128 with U = 2, 4, 8, and cuBLAS (`torch._scaled_mm`, per-tensor
scales); first, D of each variant against quack's at ragged sizes and odd K-tile counts.
"""

from __future__ import annotations

import importlib
import types
from functools import partial
from typing import Any

import torch
from cuda_events import event_ms


def bench(f: Any) -> float:
    """ms per call: CUDA events over 30 calls after 3 (cuda_events.event_ms)."""
    return event_ms(f, n=30, warmup=3)


def _mods() -> dict[str, tuple[Any, dict[str, Any]]]:
    # (the adapter first: it sets the arch and the caches before quack's frontend is imported)
    importlib.import_module("coda_lang.backend_cute.build.quack_adapter")
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32, const_expr
    from cutlass.cute.nvgpu import warpgroup
    from quack.compile_utils import make_fake_tensor
    from quack.cute_dsl_utils import torch2cute_dtype_map
    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.ops import EpiOp

    @cute.jit
    def _pipelined_mma(
        self: Any,
        ab_pipeline: Any,
        ab_read_state: Any,
        mma_fn: Any,
        acc: cute.Tensor,
        acc_slow: cute.Tensor,
        k_tile_cnt: Int32,
        warp_group_idx: Int32,
    ) -> Any:
        unroll = self._unroll
        tiled_mma, _, tCrA, tCrB = mma_fn.args
        acc1 = cute.make_rmem_tensor(acc.shape, Float32)
        temps = (acc, acc1)
        mmas = (mma_fn, partial(mma_fn.func, tiled_mma, acc1, tCrA, tCrB))
        release = ab_read_state.clone()
        acc_slow.fill(0.0)
        for _ in cutlass.range(k_tile_cnt // unroll, unroll=1):
            for j in cutlass.range_constexpr(unroll):
                ab_pipeline.consumer_wait(ab_read_state)
                mmas[j % 2](A_idx=ab_read_state.index, B_idx=ab_read_state.index, zero_init=True)
                ab_read_state.advance()
                if const_expr(j > 0):
                    warpgroup.wait_group(1)
                    ab_pipeline.consumer_release(release)
                    release.advance()
                    acc_slow.store(acc_slow.load() + temps[(j - 1) % 2].load())
            warpgroup.wait_group(0)
            ab_pipeline.consumer_release(release)
            release.advance()
            acc_slow.store(acc_slow.load() + temps[(unroll - 1) % 2].load())
        for _ in cutlass.range(k_tile_cnt % unroll, unroll=1):
            ab_pipeline.consumer_wait(ab_read_state)
            mma_fn(A_idx=ab_read_state.index, B_idx=ab_read_state.index, zero_init=True)
            ab_read_state.advance()
            warpgroup.wait_group(0)
            ab_pipeline.consumer_release(release)
            release.advance()
            acc_slow.store(acc_slow.load() + acc.load())
        acc.store(acc_slow.load())
        return ab_read_state

    class Pipelined(EpiOp):
        """Installs `_pipelined_mma` (U K tiles an iteration) on the kernel object; carries a dummy tensor
        (quack leaves out an op without one)."""

        fn_port = None

        def __init__(self, name: str, unroll: int) -> None:
            super().__init__(name)
            self.unroll = unroll

        def config_key(self) -> tuple[Any, ...]:
            return ("pipelined-promotion", 2, self.unroll)

        def host_arg_key(self, value: Any) -> Any:
            return (torch2cute_dtype_map[value.dtype], value.ndim)

        def host_fake_arg(self, key: Any, fctx: Any) -> Any:
            return make_fake_tensor(key[0], (cute.sym_int(),), leading_dim=0, divisibility=1)

        def param_fields(self) -> list[tuple[str, Any, Any]]:
            return [(self.name, object, None)]

        def to_params(self, gemm: Any, args: Any) -> dict[str, Any]:
            assert gemm.fp8_slow_accum and not gemm.pingpong
            gemm._unroll = self.unroll
            gemm.mma = types.MethodType(_pipelined_mma, gemm)
            return {self.name: getattr(args, self.name)}

    @gemm_epilogue()
    def epi_plain(acc: Any) -> Any:
        return {"D": acc}

    mods: dict[str, tuple[Any, dict[str, Any]]] = {"quack": (epi_plain, {})}
    for u in (2, 4, 8):

        @gemm_epilogue(extra_ops=(Pipelined("pp", u),))
        def epi(acc: Any) -> Any:
            return {"D": acc}

        mods[f"pipelined U={u}"] = (epi, {"pp": torch.zeros(1, device="cuda")})
    return mods


def kw(tile_n: int) -> dict[str, Any]:
    return dict(
        tile_M=128, tile_N=tile_n, cluster_M=2, cluster_N=1, pingpong=False, persistent=True, b_kn=False
    )


SHAPES = {
    "gate/up forward": (8192, 16384, 2048),
    "gate/up dgrad": (8192, 2048, 16384),
    "SwiGLU backward": (8192, 8192, 2048),
    "down forward": (8192, 2048, 8192),
    "QKV forward": (8192, 3072, 2048),
    "gate/up wgrad": (16384, 2048, 8192),
    "down wgrad": (2048, 8192, 8192),
    "QKV dgrad": (8192, 2048, 3072),
}


def main() -> None:
    mods = _mods()
    quack, _ = mods["quack"]
    for m, n, k in ((1000, 384, 640), (512, 256, 128 * 7), (4096, 2048, 4096), (256, 256, 128)):
        g = torch.Generator(device="cuda").manual_seed(m + k)
        A = (torch.randn(m, k, device="cuda", generator=g) * 3).to(torch.float8_e4m3fn)
        B = (torch.randn(n, k, device="cuda", generator=g) * 3).to(torch.float8_e4m3fn)
        outs = {}
        for name, (mod, extra) in mods.items():
            D = torch.empty(m, n, device="cuda", dtype=torch.float32)
            mod.gemm(A, B, D, None, epi_args=extra, **kw(128))
            torch.cuda.synchronize()
            outs[name] = D
        same = [
            f"{nm}: {'bit for bit' if torch.equal(o, outs['quack']) else 'DIFFERS'}"
            for nm, o in outs.items()
            if nm != "quack"
        ]
        print(f"{m}x{n}x{k}, D against quack's: " + ", ".join(same), flush=True)
    cols = ["quack 128x128", "quack 128x192", *[n for n in mods if n != "quack"], "cuBLAS"]
    print(f"{torch.cuda.get_device_name()}, e4m3 x e4m3 -> bf16, ms")
    print("| GEMM | M x N x K | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for label, (M, N, K) in SHAPES.items():
        row = time_shape(mods, M, N, K)
        print(
            f"| {label} | {M} x {N} x {K} | " + " | ".join("" if t != t else f"{t:.3f}" for t in row) + " |",
            flush=True,
        )


def time_shape(mods: dict[str, tuple[Any, dict[str, Any]]], M: int, N: int, K: int) -> list[float]:
    """ms of quack's loop at 128x128 and 128x192 (NaN where N is no multiple of 192), each variant at
    128x128, and cuBLAS, at one shape."""
    quack, _ = mods["quack"]
    A = torch.randn(M, K, device="cuda").to(torch.float8_e4m3fn)
    B = torch.randn(N, K, device="cuda").to(torch.float8_e4m3fn)
    D = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    one = torch.ones((), device="cuda")
    row = [bench(lambda: quack.gemm(A, B, D, None, epi_args={}, **kw(128)))]
    row.append(
        bench(lambda: quack.gemm(A, B, D, None, epi_args={}, **kw(192))) if N % 192 == 0 else float("nan")
    )
    for name, (mod, extra) in mods.items():
        if name != "quack":
            row.append(bench(lambda mod=mod, extra=extra: mod.gemm(A, B, D, None, epi_args=extra, **kw(128))))
    row.append(bench(lambda: torch._scaled_mm(A, B.t(), one, one, out_dtype=torch.bfloat16)))
    return row


if __name__ == "__main__":
    main()
