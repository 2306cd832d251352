"""CUDA time per kernel of one Hugging Face patch block's forward+backward (Llama-3.2-1B shapes or `--widths`).

Not a test; on a Hopper GPU host (after `source .gpu/env/gpu.sh`):

    python benchmarks/hf_block_profile.py [--block layer] [--M 8192] [--steps 3]

The block is the one `coda_lang.hf` runs for each decoder layer (`layer`: out-proj .. the next layer's
QKV and RoPE; `first_qkv`; `last`), in bf16 with random inputs (weights scaled by 1/sqrt(K)), a random
cotangent for each output, the tiles untuned (CODA_TUNE=0 unless set; with CODA_TUNE=1 the tuner's
candidates compile and are timed before the profile). Prints the CUDA time per kernel
name per step, largest first, and the step's total, so that a stage that takes far longer than its
memory traffic shows (the elementwise stages run as torch.compile'd kernels). `--cublas` adds a
table of each GEMM stage (forward, backward) next to cuBLAS's bare GEMM of the same shape and
operand layouts (torch.matmul, bf16 out; do_bench medians), the ratio being what the stage's
epilogue and tile cost over the GEMM alone.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--block", default="layer", choices=["layer", "first_qkv", "last"])
    p.add_argument("--M", type=int, default=8192)
    p.add_argument(
        "--widths",
        default="2048,32,8,64,8192",
        help="D,H,KV,HD,F: hidden size, query heads, key/value heads, head size, MLP width "
        "(default Llama-3.2-1B's; Mistral-7B's: 4096,32,8,128,14336)",
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--cublas", action="store_true", help="each GEMM stage against cuBLAS's bare GEMM")
    p.add_argument("--device", default="cuda", help="cpu: the emulated kernels (a dry run)")
    p.add_argument(
        "--fp8",
        action="store_true",
        help='the block of a model patched with fp8="delayed" (e4m3 GEMMs, e5m2 cotangents, no gradient '
        "of the scales, as the patch differentiates it); its fp8 stages against cuBLAS's fp8 GEMM "
        "(torch._scaled_mm, both operands K-major, bf16 out, --fast-accum as given)",
    )
    p.add_argument(
        "--fp8-save16",
        action="store_true",
        help="with --fp8: the gate/up acc saved in bf16, not e4m3 (a patched model's blocks under "
        "$CODA_FP8_SAVE_ACC=0; --fp8 alone profiles the patch's default, hf.state.fp8_save)",
    )
    p.add_argument(
        "--fast-accum",
        action="store_true",
        help="with --fp8: cuBLAS's fp8 GEMM with fast accumulation (coda's: $CODA_FP8_FAST_ACCUM)",
    )
    p.add_argument(
        "--dynamic",
        default="auto",
        choices=["true", "false", "auto"],
        help="torch.compile's `dynamic` for the elementwise stages (auto: PyTorch's default, the runtime's)",
    )
    a = p.parse_args()
    os.environ.setdefault("CODA_TUNE", "0")

    import torch
    from fwd_bwd_bench import profile

    import coda_lang.backend_triton.elementwise as elementwise
    from coda_lang import load
    from coda_lang.autodiff.options import BackwardOptions
    from coda_lang.hf.blocks import model_source
    from coda_lang.hf.state import fp8_save
    from coda_lang.torch import DelayedScaling, function, wait_for_kernels

    elementwise.DYNAMIC = {"true": True, "false": False, "auto": None}[a.dynamic]
    try:
        D, H, KV, HD, F = (int(w) for w in a.widths.split(","))
    except ValueError:
        p.error(f"--widths takes five integers D,H,KV,HD,F, not {a.widths!r}")
    P = (H + 2 * KV) * HD // 2
    K = H * HD
    if a.fp8_save16 and not a.fp8:
        p.error("--fp8-save16 goes with --fp8")
    save = a.fp8 and not a.fp8_save16 and fp8_save("delayed")
    src = model_source("bfloat16", 1e-5, HD, False, fp8="delayed" if a.fp8 else None, fp8_save=save)
    blk = load(src)[a.block]
    shapes = {"M": a.M, "D": D, "K": K, "F": F, "P": P}
    dev = torch.device(a.device)
    torch.manual_seed(0)
    ins: dict[str, torch.Tensor] = {}
    for prm in blk.ir.params:
        n = prm.var.name
        if prm.default is not None:
            continue
        shp = [int(d.coeff * shapes[d.name]) for d in prm.var.type.shape]
        dt = {"bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32}[prm.var.type.dtype]
        if n.startswith("s_"):  # an fp8 scale: weights ~ 1/sqrt(K) quantized at sqrt(K), activations at 1
            w = (
                next((q for q in blk.ir.params if q.var.name == "w_" + n[4:]), None)
                if n.startswith("s_w_")
                else None
            )
            x = torch.tensor(
                float(int(w.var.type.shape[-1].coeff * shapes[w.var.type.shape[-1].name]) ** 0.5)
                if w
                else 1.0,
                device=dev,
            )
        elif n == "pos":
            x = torch.arange(a.M, device=dev, dtype=dt)
        elif n == "freq":
            x = 500000.0 ** (-(torch.arange(P, device=dev, dtype=dt) % (HD // 2)) * 2 / HD)  # <= 1
        elif n.startswith("w_"):
            x = (torch.randn(*shp, device=dev) / shp[-1] ** 0.5).to(dt)
        else:
            x = (
                (1 + 0.1 * torch.randn(*shp, device=dev)).to(dt)
                if n.startswith("g")
                else torch.randn(*shp, device=dev).to(dt)
            )
        ins[n] = x.requires_grad_(n not in ("pos", "freq") and not n.startswith("s_"))
    wrt = [n for n in ins if ins[n].requires_grad]
    fn = (
        function(
            blk,
            wrt=wrt,
            backward=BackwardOptions(fp8_grads="e5m2", fp8_acc=save),
            grad_scales=DelayedScaling(initial=1.0),
        )
        if a.fp8
        else function(blk, wrt=wrt)
    )

    def step() -> None:
        for v in ins.values():
            v.grad = None
        outs = fn(**ins)
        outs = (
            tuple(outs.values()) if isinstance(outs, dict) else outs if isinstance(outs, tuple) else (outs,)
        )
        torch.autograd.backward(
            [o for o in outs if o.requires_grad], [torch.ones_like(o) for o in outs if o.requires_grad]
        )

    step()
    # (the first step runs each stage at its first tile without spills while the others compile in the
    # background; the steps after them tune: profiled before then, a stage shows its stand-in tile)
    wait_for_kernels()
    for _ in range(3):
        step()
    if a.device == "cpu":
        print("ran on the CPU (emulated kernels): nothing to profile")
        return
    torch.cuda.synchronize()
    rows = profile(step, a.steps)
    print(f"{a.block} at M={a.M}, widths {a.widths}: {len(rows)} kernel names; top {a.top}:")
    for k, ms in rows[: a.top]:
        print(f"    {ms:8.3f} ms  {k}")
    if a.cublas:
        against_cublas(fn, shapes, rows, a.fast_accum)


FP8 = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}


def against_cublas(
    fn: Any, shapes: dict[str, int], rows: list[tuple[str, float]], fast: bool = False
) -> None:
    """Each GEMM stage's CUDA time per step (from the profile's kernel names) next to torch.matmul's
    bare GEMM of the stage's [rows, k] x [k, cols] with the same majors; an fp8 stage next to
    torch._scaled_mm's (cuBLAS's fp8 GEMM; both operands K-major, as Hopper's fp8 WGMMA and coda's
    K-major copies have them; bf16 out, unit scales; `fast`: its fast accumulation)."""
    import torch
    from triton.testing import do_bench

    def bare(g: Any, m: int, n: int, kk: int) -> Any:
        if g.a_dtype in FP8 or g.b_dtype in FP8:
            a8 = torch.randn(m, kk, device="cuda").to(getattr(torch, FP8.get(g.a_dtype, "float8_e4m3fn")))
            b8 = torch.randn(n, kk, device="cuda").to(getattr(torch, FP8.get(g.b_dtype, "float8_e4m3fn")))
            one = torch.ones((), device="cuda")
            return lambda: torch._scaled_mm(
                a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast
            )
        a = (
            torch.randn(kk, m, device="cuda", dtype=torch.bfloat16).t()
            if g.ta
            else torch.randn(m, kk, device="cuda", dtype=torch.bfloat16)
        )
        b = (
            torch.randn(n, kk, device="cuda", dtype=torch.bfloat16).t()
            if g.tb
            else torch.randn(kk, n, device="cuda", dtype=torch.bfloat16)
        )
        return lambda: torch.matmul(a, b)

    def size(d: Any) -> int:
        return int(d.coeff * (shapes[d.name] if d.name else 1))

    print("| stage | GEMM | M x N x K | tile | coda ms | cuBLAS ms | x cuBLAS |")
    print("|---|---|---|---|---|---|---|")
    tot_c = tot_b = plain_b = 0.0
    for cb in fn.kernel_blocks():
        for k, spec in enumerate(cb.specs, 1):
            if spec is None:
                continue
            # the stage's kernel by its epilogue's identity in quack's kernel class names (the function's
            # name and a digest of its meaning: a stage that reads as another is the same kernel)
            tag = f"_{cb.launched(k).mod._ident}_"
            ms = 0.0 if spec.plain else sum(t for name, t in rows if tag in name)
            g = spec.gemm
            m, n, kk = size(g.rows), size(g.cols), size(g.k)
            ref = do_bench(bare(g, m, n, kk), warmup=25, rep=100)
            tot_b += ref
            if not ms:  # an epilogue-free stage runs a shared kernel (`plain_<dtype>_<majors>`): summed below
                plain_b += ref
                print(f"| {cb.name} {k} | `{spec.text}` | {m} x {n} x {kk} | | (shared) | {ref:.3f} | |")
                continue
            tot_c += ms
            print(
                f"| {cb.name} {k} | `{spec.text}` | {m} x {n} x {kk} | {cb.launched(k).config.short} | {ms:.3f} "
                f"| {ref:.3f} | {ms / ref:.2f}x |"
            )
    plain = sum(t for name, t in rows if "GemmMod_plain_" in name)
    if plain_b:
        print(f"| shared plain GEMMs | | | | {plain:.3f} | {plain_b:.3f} | {plain / plain_b:.2f}x |")
    tot_c += plain
    print(f"| all GEMM stages | | | | {tot_c:.3f} | {tot_b:.3f} | {tot_c / tot_b:.2f}x |")


if __name__ == "__main__":
    main()
