"""GPU benchmark of the CUDA runtime on llama_mlp (bf16, Hopper): each generated stage against the bare
cuBLAS GEMM of the same shape and against quack's hand-written library epilogue, and the whole forward
against the sum of its bare GEMMs and torch.compile of the unfused torch code. Not a test; on the GPU
host (after `source .gpu/env/gpu.sh`; scripts/gpu_check.sh runs it):

    python benchmarks/gpu_bench.py [--M 16384] [--D 2048,4096] [--warmup 25] [--rep 200]

Method (/work/.library/device/METHOD.md): random inputs (weights scaled by 1/sqrt(K), never zeros);
correctness first (the forward against float64 on the GPU, next to plain bf16 torch's error); then
medians of triton.testing.do_bench (CUDA events, L2 flushed between runs, warm-up first, so compiles
and module loads stay out); the coda forward is timed first and last, their difference is the noise.
F = 5632 for D = 2048 and 11008 for D = 4096 (roundup256(8D/3), the paper's shapes).

Rows: stage k (coda: one `coda::stage` launch, the kernel alone; cuBLAS: torch.matmul of the stage's
GEMM shape, bf16 out; quack: its library epilogue doing the same work at the same tile: stage 1
`rms_partial_epi`, stage 2 `rstd_swiglu_epi` (the row scale then SwiGLU), stage 3 `residual_epi`),
then the forward (all stages and the tiny vector ops between them; also replayed from a CUDA graph),
the sum of the three bare GEMMs, eager torch and torch.compile of the same math. The design notes' anchor:
stages 1+2 at D=2048 by quack's epilogues 1.339 ms, bare cuBLAS 1.331 ms, torch.compile 1.548 ms (H200).
Prints a short table last; writes everything to $OUT/gpu_bench.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

F_OF = {2048: 5632, 4096: 11008}


def roundup256(x: float) -> int:
    return int(math.ceil(x / 256) * 256)


def make_inputs(M: int, D: int, F: int, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g) * scale

    bf = torch.bfloat16
    return {
        "y": randn(M, D).to(bf),
        "x": randn(M, D).to(bf),
        "w_o": randn(D, D, scale=D**-0.5).to(bf),
        "g": 1 + 0.1 * randn(D),
        "w_13": randn(D, 2 * F, scale=D**-0.5).to(bf),
        "w_2": randn(F, D, scale=F**-0.5).to(bf),
    }


def torch_mlp(y: Any, x: Any, w_o: Any, g: Any, w_13: Any, w_2: Any, eps: float = 1e-6) -> Any:
    """The unfused math (gate/up columns interleaved like coda's w_13), in the inputs' dtype."""
    import torch
    import torch.nn.functional as F

    h = y @ w_o + x
    hf = h.float()
    n = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * g).to(y.dtype)
    z = n @ w_13
    a = (F.silu(z[:, 0::2].float()) * z[:, 1::2].float()).to(y.dtype)
    return a @ w_2 + h


def rel_err(a: Any, ref: Any) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def bench(fn: Any, warmup: int, rep: int) -> float:
    from triton.testing import do_bench

    fn()
    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def library_stages(env: dict[str, Any], cfgs: dict[int, Any]) -> dict[int, Any]:
    """quack's hand-written epilogues doing each stage's work, as callables (or the error)."""
    import torch
    from quack.epilogue import library as L

    M, D = env["y"].shape
    F = env["w_2"].shape[0]

    def kw(k: int) -> dict[str, Any]:
        c = cfgs[k]
        return dict(
            tile_M=c.tile_m,
            tile_N=c.tile_n,
            cluster_M=c.cluster_m,
            cluster_N=c.cluster_n,
            pingpong=c.pingpong,
            persistent=True,
            b_kn=True,
        )

    hg = torch.empty(M, D, dtype=torch.bfloat16, device="cuda")
    h = torch.empty_like(hg)
    sq = torch.empty(M, -(-D // cfgs[1].tile_n), dtype=torch.float32, device="cuda")
    a = torch.empty(M, F, dtype=torch.bfloat16, device="cuda")
    x2 = torch.empty_like(hg)
    out: dict[int, Any] = {
        1: lambda: L.rms_partial_epi.gemm(
            env["y"],
            env["w_o"],
            hg,
            env["x"],
            epi_args={"weight": env["g"], "resid_out": h, "sqsum": sq},
            **kw(1),
        ),
        2: lambda: L.rstd_swiglu_epi.gemm(
            env["hg"], env["w_13"], None, None, epi_args={"rstd": env["r"], "postact": a}, **kw(2)
        ),
        3: lambda: L.residual_epi.gemm(env["a"], env["w_2"], x2, None, epi_args={"res": env["h"]}, **kw(3)),
    }
    checks = {1: (hg, "hg"), 2: (a, "a"), 3: (x2, "x2")}
    for k, fn in list(out.items()):
        try:
            fn()
            torch.cuda.synchronize()
            got, name = checks[k]
            diff = (got.float() - env[name].float()).abs().max().item()
            out[k] = (fn, diff)
        except Exception as e:  # a library epilogue that can't run here: report, don't stop
            out[k] = (None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return out


def run_size(blk: Any, M: int, D: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    F = F_OF.get(D, roundup256(8 * D / 3))
    inputs = make_inputs(M, D, F, seed=D)
    res: dict[str, Any] = {"M": M, "D": D, "F": F}
    cb = blk.cuda()
    out = cb(inputs)["x2"]
    torch.cuda.synchronize()
    res["tiles"] = {k: str(cb.config(k)) for k in range(1, 4)}

    # correctness first: against float64 on the GPU, next to plain bf16 torch's own error
    with torch.no_grad():
        ref64 = torch_mlp(*(inputs[k].double() for k in ("y", "x", "w_o", "g", "w_13", "w_2")))
        plain = torch_mlp(**inputs)
    res["err_coda_vs_f64"] = rel_err(out, ref64)
    res["err_torch_bf16_vs_f64"] = rel_err(plain, ref64)
    res["nan"] = bool(torch.isnan(out).any())
    del ref64
    torch.cuda.empty_cache()

    env = cb.values(inputs)
    stages = []
    lib = library_stages(env, {k: cb.config(k) for k in range(1, 4)})
    for k, spec in enumerate(cb.specs, 1):
        r = cb.launched(k)
        ins, sc = r.arguments(env)
        A = env[spec.gemm.a]
        B = env[spec.gemm.b]
        row: dict[str, Any] = {"stage": k, "text": spec.text, "shape": [A.shape[0], A.shape[1], B.shape[1]]}
        row["coda_ms"] = bench(
            lambda r=r, ins=ins, sc=sc: torch.ops.coda.stage(r.key, ins, sc), args.warmup, args.rep
        )
        row["coda_with_combine_ms"] = bench(lambda k=k: cb.run_stage(k, env), args.warmup, args.rep)
        row["cublas_ms"] = bench(lambda A=A, B=B: torch.matmul(A, B), args.warmup, args.rep)
        fn, info = lib[k]
        row["quack_lib_ms"] = bench(fn, args.warmup, args.rep) if fn is not None else None
        row["quack_lib_note"] = info if fn is None else f"max |lib - coda| = {info:.3g}"
        flops = 2 * A.shape[0] * A.shape[1] * B.shape[1]
        row["coda_tflops"] = flops / row["coda_ms"] / 1e9
        row["cublas_tflops"] = flops / row["cublas_ms"] / 1e9
        stages.append(row)
    res["stages"] = stages
    res["sum_cublas_ms"] = sum(s["cublas_ms"] for s in stages)
    res["sum_coda_stages_ms"] = sum(s["coda_ms"] for s in stages)

    res["coda_fwd_ms"] = bench(lambda: cb(inputs), args.warmup, args.rep)
    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            cb(inputs)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            cb(inputs)
        res["coda_fwd_graph_ms"] = bench(graph.replay, args.warmup, args.rep)
    except Exception as e:
        res["coda_fwd_graph_ms"] = None
        res["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    res["torch_eager_ms"] = bench(lambda: torch_mlp(**inputs), args.warmup, args.rep)
    try:
        compiled = torch.compile(torch_mlp)
        res["torch_compile_ms"] = bench(lambda: compiled(**inputs), args.warmup, args.rep)
    except Exception as e:
        res["torch_compile_ms"] = None
        res["compile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    res["coda_fwd_again_ms"] = bench(lambda: cb(inputs), args.warmup, args.rep)
    if not args.no_backward:
        res.update(run_backward(blk, inputs, args))
    return res


def library_backward(env: dict[str, Any], bcb: Any) -> dict[int, Any]:
    """quack's hand-written SwiGLU-backward epilogue (`dswiglu_rstd_preact_mod`: packed C/D, the row
    scale, the norm's row statistic; it also stores the recomputed activation, which coda reads from
    the forward's saved `a`) at the tile coda chose for that stage, keyed by the stage index."""
    import torch
    from quack.epilogue import library as L

    out: dict[int, Any] = {}
    for k in bcb.gemm_stages:
        spec = bcb.specs[k - 1]
        if spec.mode != "packed_cd_b16x2":
            continue
        c = bcb.config(k)
        dx2, w_2, acc2, r = env[spec.gemm.a], env[spec.gemm.b], env["acc2"], env["r"]
        M, F = dx2.shape[0], w_2.shape[0]
        D = torch.empty_like(acc2)
        post = torch.empty(M, F, dtype=torch.bfloat16, device="cuda")
        dsum = torch.empty(M, -(-F // c.tile_n), dtype=torch.float32, device="cuda")

        def fn(
            dx2: Any = dx2,
            w_2: Any = w_2,
            D: Any = D,
            acc2: Any = acc2,
            r: Any = r,
            post: Any = post,
            dsum: Any = dsum,
            c: Any = c,
        ) -> None:
            L.dswiglu_rstd_preact_mod.gemm(
                dx2,
                w_2,
                D,
                acc2,
                epi_args={"rstd": r, "postact": post, "dsum": dsum},
                tile_M=c.tile_m,
                tile_N=c.tile_n,
                cluster_M=c.cluster_m,
                cluster_N=c.cluster_n,
                pingpong=c.pingpong,
                persistent=True,
                b_kn=False,
            )

        try:
            fn()
            torch.cuda.synchronize()
            out[k] = (fn, "dswiglu_rstd_preact_mod")
        except Exception as e:
            out[k] = (None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    return out


def run_backward(blk: Any, inputs: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The derived backward block stage by stage (against cuBLAS of each stage's GEMM, and quack's
    dgated epilogue for the SwiGLU backward), and forward+backward through autograd against the sum of
    all nine bare GEMMs and torch.compile of the unfused code's forward+backward."""
    import torch

    res: dict[str, Any] = {}
    fn = blk.cuda().autograd()
    bcb = fn.backward
    d = fn.derivation
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    x2 = fn(leaves)["x2"]
    ct = torch.randn(x2.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(3)).to(x2.dtype)
    x2.backward(ct)
    torch.cuda.synchronize()

    # gradients against float64 autograd of the unfused math, next to plain bf16 torch's error
    def grads_of(f: Any, dtype: Any) -> dict[str, Any]:
        lv = {k: v.detach().to(dtype).requires_grad_() for k, v in inputs.items()}
        f(**lv).backward(ct.to(dtype))
        return {k: v.grad for k, v in lv.items()}

    ref = grads_of(torch_mlp, torch.float64)
    plain = grads_of(torch_mlp, torch.bfloat16)
    res["grad_err"] = {
        k: (rel_err(leaves[k].grad.float(), ref[k]), rel_err(plain[k].float(), ref[k])) for k in ref
    }
    del ref, plain
    torch.cuda.empty_cache()

    saved = d.forward.cuda()(inputs)
    bins = {
        p.var.name: (
            ct if p.var.name == d.cotangents["x2"] else saved.get(p.var.name, inputs.get(p.var.name))
        )
        for p in d.backward.ir.params
        if p.var.name in saved or p.var.name in inputs or p.var.name == d.cotangents["x2"]
    }
    env = bcb.values(bins)
    lib = library_backward(env, bcb)
    res["bwd_tiles"] = {k: str(bcb.config(k)) for k in bcb.gemm_stages}
    rows = []
    for k in bcb.gemm_stages:
        spec = bcb.specs[k - 1]
        r = bcb.launched(k)
        ins, sc = r.arguments(env)
        A = env[spec.gemm.a].t() if spec.gemm.ta else env[spec.gemm.a]
        B = env[spec.gemm.b].t() if spec.gemm.tb else env[spec.gemm.b]
        row: dict[str, Any] = {
            "stage": k,
            "text": spec.text,
            "mode": spec.mode,
            "shape": [A.shape[0], A.shape[1], B.shape[1]],
        }
        row["coda_ms"] = bench(
            lambda r=r, ins=ins, sc=sc: torch.ops.coda.stage(r.key, ins, sc), args.warmup, args.rep
        )
        row["cublas_ms"] = bench(lambda A=A, B=B: torch.matmul(A, B), args.warmup, args.rep)
        f, info = lib.get(k, (None, None))
        row["quack_lib_ms"] = bench(f, args.warmup, args.rep) if f is not None else None
        row["quack_lib_note"] = info
        rows.append(row)
    res["bwd_stages"] = rows
    res["sum_cublas_bwd_ms"] = sum(r["cublas_ms"] for r in rows)
    res["coda_bwd_ms"] = bench(lambda: bcb(bins), args.warmup, args.rep)

    def fresh(params: dict[str, Any]) -> dict[str, Any]:
        for v in params.values():  # as a training step's zero_grad(set_to_none=True): no accumulation
            v.grad = None
        return params

    def step() -> None:
        fn(fresh(leaves))["x2"].backward(ct)

    res["coda_fwd_bwd_ms"] = bench(step, args.warmup, args.rep)
    tleaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    res["torch_eager_fwd_bwd_ms"] = bench(
        lambda: torch_mlp(**fresh(tleaves)).backward(ct), args.warmup, args.rep
    )
    try:
        compiled = torch.compile(torch_mlp)
        res["torch_compile_fwd_bwd_ms"] = bench(
            lambda: compiled(**fresh(tleaves)).backward(ct), args.warmup, args.rep
        )
    except Exception as e:
        res["torch_compile_fwd_bwd_ms"] = None
        res["compile_bwd_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    res["coda_fwd_bwd_again_ms"] = bench(step, args.warmup, args.rep)
    return res


def table(results: list[dict[str, Any]]) -> str:
    def f(x: Any, nd: int = 3) -> str:
        return "-" if x is None else f"{x:.{nd}f}"

    lines = []
    for r in results:
        lines.append(f"M={r['M']} D={r['D']} F={r['F']}  tiles {r['tiles']}")
        lines.append(
            f"  accuracy: ||coda - f64||/||f64|| = {r['err_coda_vs_f64']:.2e}, plain bf16 torch "
            f"{r['err_torch_bf16_vs_f64']:.2e} (ratio {r['err_coda_vs_f64'] / r['err_torch_bf16_vs_f64']:.2f})"
        )
        lines.append(
            f"  {'stage':<22}{'coda ms':>9}{'cuBLAS':>9}{'quack':>9}{'/cuBLAS':>9}{'/quack':>8}{'TFLOP/s':>9}"
        )
        for s in r["stages"]:
            lib = s["quack_lib_ms"]
            lines.append(
                f"  {s['stage']}: {s['text']:<19}{f(s['coda_ms']):>9}{f(s['cublas_ms']):>9}{f(lib):>9}"
                f"{f(s['coda_ms'] / s['cublas_ms'], 2):>9}"
                f"{(f(s['coda_ms'] / lib, 2) if lib else '-'):>8}{f(s['coda_tflops'], 0):>9}"
            )
        fwd = r["coda_fwd_ms"]
        lines.append(
            f"  forward: coda {f(fwd)} ms (again {f(r['coda_fwd_again_ms'])}; CUDA graph "
            f"{f(r['coda_fwd_graph_ms'])}), sum of bare GEMMs {f(r['sum_cublas_ms'])}, torch eager "
            f"{f(r['torch_eager_ms'])}, torch.compile {f(r['torch_compile_ms'])}"
        )
        tc = r["torch_compile_ms"]
        lines.append(
            f"  ratios: coda/bare GEMMs {fwd / r['sum_cublas_ms']:.3f}, coda/torch.compile "
            f"{(f(fwd / tc, 3) if tc else '-')}; stages 1+2: coda "
            f"{f(r['stages'][0]['coda_ms'] + r['stages'][1]['coda_ms'])} ms, cuBLAS "
            f"{f(r['stages'][0]['cublas_ms'] + r['stages'][1]['cublas_ms'])} ms"
        )
        if "bwd_stages" not in r:
            continue
        lines.append(f"  backward tiles {r['bwd_tiles']}")
        for s in r["bwd_stages"]:
            lib = s["quack_lib_ms"]
            lines.append(
                f"  b{s['stage']}: {s['text']:<30}{f(s['coda_ms']):>9}{f(s['cublas_ms']):>9}{f(lib):>9}"
                f"{f(s['coda_ms'] / s['cublas_ms'], 2):>9}{(f(s['coda_ms'] / lib, 2) if lib else '-'):>8}"
            )
        bare = r["sum_cublas_ms"] + r["sum_cublas_bwd_ms"]
        fb, tc = r["coda_fwd_bwd_ms"], r["torch_compile_fwd_bwd_ms"]
        lines.append(
            f"  backward block: coda {f(r['coda_bwd_ms'])} ms, sum of its bare GEMMs {f(r['sum_cublas_bwd_ms'])}"
        )
        lines.append(
            f"  forward+backward: coda {f(fb)} ms (again {f(r['coda_fwd_bwd_again_ms'])}), bare GEMMs "
            f"{f(bare)}, torch eager {f(r['torch_eager_fwd_bwd_ms'])}, torch.compile {f(tc)}"
        )
        lines.append(
            f"  ratios: coda/bare GEMMs {fb / bare:.3f}, torch.compile/coda {(f(tc / fb, 3) if tc else '-')}"
        )
        worst = max(r["grad_err"].items(), key=lambda kv: kv[1][0] / kv[1][1])
        lines.append(
            f"  gradients: worst ||coda - f64||/||f64|| over plain bf16 torch's: d{worst[0]} "
            f"{worst[1][0]:.2e} vs {worst[1][1]:.2e}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--M", type=int, default=16384)
    ap.add_argument("--D", default="2048,4096")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=int, default=200, help="do_bench repetitions, ms")
    ap.add_argument("--no-backward", action="store_true", help="time the forward only")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_bench: no CUDA GPU")
        return 2
    import coda_lang

    blk = coda_lang.load(ROOT / "examples" / "llama_mlp.coda")["llama_mlp"]
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    try:
        import importlib.metadata as md

        meta |= {d: md.version(d) for d in ("nvidia-cutlass-dsl", "quack-kernels", "triton")}
    except Exception:
        pass
    print(json.dumps(meta))
    results = []
    for D in (int(x) for x in args.D.split(",")):
        try:
            results.append(run_size(blk, args.M, D, args))
        except Exception:
            traceback.print_exc()
            results.append({"M": args.M, "D": D, "error": traceback.format_exc()[-2000:]})
        torch.cuda.empty_cache()
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "gpu_bench.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    ok = [r for r in results if "error" not in r]
    for r in results:
        if "error" in r:
            print(f"D={r['D']}: FAILED\n{r['error']}")
    print(table(ok))
    return 0 if len(ok) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
