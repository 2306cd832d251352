"""Forward+backward of a coda block against torch.compile and Liger Kernel: time and peak memory.

Not a test; on a Hopper GPU host (after `source .gpu/env/gpu.sh`):

    python benchmarks/fwd_bwd_bench.py lm_head [--M 8192] [--D 2048] [--V 128256,32768]
        [--remat auto,save] [--chunk auto]
    python benchmarks/fwd_bwd_bench.py mlp [--M 16384] [--D 2048,4096] [--remat auto,save]

Workloads (bf16, random inputs, weights scaled by 1/sqrt(K)):
- lm_head: examples/lm_head_ce.coda (logits = (hg @ w_lm) * r, per-row cross-entropy, 5% of the rows
  ignored with target -100), loss = mean over the counted rows. torch.compile: the same math unfused
  (`(hg @ w_lm).float() * r[:, None]`, F.cross_entropy) under torch.compile. Liger 0.8.5:
  LigerFusedLinearCrossEntropyFunction on `hg * r` (bf16) and its own [V, D] weight.
- mlp: examples/llama_mlp.coda (out-proj + residual + RMSNorm + SwiGLU MLP + residual), with a random
  cotangent of x2. torch.compile: the unfused math (benchmarks/gpu_bench.py's torch_mlp). Liger:
  LigerRMSNormFunction + LigerSiLUMulFunction with HF's separate gate and up projections.

Method (/work/.library/device/METHOD.md): every configuration is first checked against float32 torch of
the same math (relative error of the loss or output and of each gradient); then a step (the parameters'
.grad set to None, forward, backward) is timed by triton.testing.do_bench (median, L2 flushed) twice,
the first and the second timing of the same call; then its peak memory: torch.cuda.max_memory_allocated
during one step minus what was allocated before it (the inputs, weights and cotangents), so the
gradients the step makes are counted, less the previous step's gradients that a training step sets to
None before it (the memory before the step holds those, as in a training loop); `grads` is their size.
Prints a table last; writes the rows as JSON to $OUT/fwd_bwd_<workload>.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIB = 2**20


def bench_time(step: Callable[[], Any], warmup: int, rep: int) -> tuple[float, float]:
    from triton.testing import do_bench

    step()
    first = float(do_bench(step, warmup=warmup, rep=rep, return_mode="median"))
    second = float(do_bench(step, warmup=warmup, rep=rep, return_mode="median"))
    return first, second


def peak_memory(step: Callable[[], Any], grads: Callable[[], int]) -> tuple[float, float]:
    import torch

    step()  # a first step outside the measurement (compiles, workspaces, allocator pools)
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / MIB
    return peak, grads() / MIB


def profile(step: Callable[[], Any], steps: int = 3) -> list[tuple[str, float]]:
    """CUDA time per kernel name (ms per step) of a few steps under torch.profiler, largest first."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    torch.cuda.synchronize()
    with tprofile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [
        (e.key[:90], e.device_time_total / 1000 / steps)
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    rows.sort(key=lambda r: -r[1])
    for k, ms in rows[:12]:
        print(f"    {ms:8.3f} ms  {k}", flush=True)
    print(f"    {sum(ms for _, ms in rows):8.3f} ms  total CUDA time per step", flush=True)
    return rows


def rel(a: Any, ref: Any) -> float:
    a, ref = a.double(), ref.double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-300))


class Leaves:
    """Named leaf tensors that require grad; `zero()` sets their .grad to None (a training step's
    zero_grad(set_to_none=True)), `grad_bytes()` the size of the gradients a step left."""

    def __init__(self, **tensors: Any):
        self.t = {k: v.detach().clone().requires_grad_(v.is_floating_point()) for k, v in tensors.items()}

    def __getitem__(self, k: str) -> Any:
        return self.t[k]

    def zero(self) -> None:
        for v in self.t.values():
            v.grad = None

    def grad_bytes(self) -> int:
        return sum(v.grad.numel() * v.grad.element_size() for v in self.t.values() if v.grad is not None)

    def grads(self) -> dict[str, Any]:
        return {k: v.grad for k, v in self.t.items() if v.grad is not None}


# ---------------------------------------------------------------------------------------- lm_head


def lm_head_inputs(M: int, D: int, V: int, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    hg = torch.randn(M, D, device="cuda", generator=g).to(torch.bfloat16)
    r = 1 + 0.1 * torch.rand(M, device="cuda", generator=g)
    w_lm = (torch.randn(D, V, device="cuda", generator=g) * D**-0.5 * 3).to(torch.bfloat16)
    target = torch.randint(0, V, (M,), device="cuda", generator=g, dtype=torch.int32)
    target[torch.rand(M, device="cuda", generator=g) < 0.05] = -100
    return {"hg": hg, "r": r, "w_lm": w_lm, "target": target}


def lm_head_torch(hg: Any, r: Any, w_lm: Any, target: Any) -> Any:
    import torch.nn.functional as F

    logits = (hg @ w_lm).float() * r[:, None]
    return F.cross_entropy(logits, target.long(), ignore_index=-100)


def lm_head_configs(x: dict[str, Any], args: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    """name -> a factory of (step, leaves, loss_fn) for each configuration."""
    import torch

    out: dict[str, Any] = {}
    count = float((x["target"] >= 0).sum())

    for remat in args.remat.split(","):
        for chunk in args.chunk.split(","):

            def make(remat: str = remat, chunk: str = chunk) -> Any:
                import coda_lang.torch as ct

                kw: dict[str, Any] = {"remat": remat}
                if chunk != "none":
                    kw["chunk"] = int(chunk) if chunk.isdigit() else chunk
                fn = ct.function(str(ROOT / "examples" / "lm_head_ce.coda"), **kw)
                lv = Leaves(hg=x["hg"], r=x["r"], w_lm=x["w_lm"])

                def loss() -> Any:
                    return (
                        fn(hg=lv["hg"], r=lv["r"], w_lm=lv["w_lm"], target=x["target"])["loss"].sum() / count
                    )

                return lv, loss

            out[f"coda remat={remat}" + (f" chunk={chunk}" if chunk != "none" else "")] = make

    def make_compile() -> Any:
        f = torch.compile(lm_head_torch)
        lv = Leaves(hg=x["hg"], r=x["r"], w_lm=x["w_lm"])
        return lv, lambda: f(lv["hg"], lv["r"], lv["w_lm"], x["target"])

    out["torch.compile"] = make_compile

    def make_liger() -> Any:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        lv = Leaves(hg=x["hg"], r=x["r"], w_vd=x["w_lm"].t().contiguous())

        def loss() -> Any:
            xn = (lv["hg"].float() * lv["r"][:, None]).to(torch.bfloat16)
            res = LigerFusedLinearCrossEntropyFunction.apply(xn, lv["w_vd"], x["target"].long())
            return res[0] if isinstance(res, tuple) else res

        return lv, loss

    out["liger"] = make_liger
    return out


def lm_head_reference(x: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    import torch

    lv = Leaves(hg=x["hg"].float(), r=x["r"], w_lm=x["w_lm"].float())
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    loss = lm_head_torch(lv["hg"], lv["r"], lv["w_lm"], x["target"])
    loss.backward()
    torch.backends.cuda.matmul.allow_tf32 = prev
    return loss.detach(), lv.grads()


# ---------------------------------------------------------------------------------------------- mlp


def mlp_configs(x: dict[str, Any], args: argparse.Namespace) -> dict[str, Callable[[], Any]]:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_bench import torch_mlp

    out: dict[str, Any] = {}
    names = ("y", "x", "w_o", "g", "w_13", "w_2")
    for remat in args.remat.split(","):

        def make(remat: str = remat) -> Any:
            import coda_lang.torch as ct

            fn = ct.function(str(ROOT / "examples" / "llama_mlp.coda"), remat=remat)
            lv = Leaves(**{k: x[k] for k in names})
            return lv, lambda: (fn(**{k: lv[k] for k in names})["x2"].float() * x["ct"]).sum()

        out[f"coda remat={remat}"] = make

    def make_compile() -> Any:
        f = torch.compile(torch_mlp)
        lv = Leaves(**{k: x[k] for k in names})
        return lv, lambda: (f(*[lv[k] for k in names]).float() * x["ct"]).sum()

    out["torch.compile"] = make_compile

    def make_liger() -> Any:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        lv = Leaves(
            y=x["y"],
            x=x["x"],
            w_o=x["w_o"],
            g=x["g"].to(torch.bfloat16),
            w_gate=x["w_13"][:, 0::2].contiguous(),
            w_up=x["w_13"][:, 1::2].contiguous(),
            w_2=x["w_2"],
        )

        def loss() -> Any:
            h = lv["y"] @ lv["w_o"] + lv["x"]
            n = LigerRMSNormFunction.apply(h, lv["g"], 1e-6)
            a = LigerSiLUMulFunction.apply(n @ lv["w_gate"], n @ lv["w_up"])
            return ((a @ lv["w_2"] + h).float() * x["ct"]).sum()

        return lv, loss

    out["liger"] = make_liger
    return out


def mlp_reference(x: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_bench import torch_mlp

    names = ("y", "x", "w_o", "g", "w_13", "w_2")
    lv = Leaves(**{k: x[k].float() for k in names})
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    out = (torch_mlp(*[lv[k] for k in names]) * x["ct"]).sum()
    out.backward()
    torch.backends.cuda.matmul.allow_tf32 = prev
    return out.detach(), lv.grads()


# ------------------------------------------------------------------------------------------ driver


def run_config(
    name: str, make: Any, ref: tuple[Any, dict[str, Any]], args: argparse.Namespace
) -> dict[str, Any]:
    import torch

    row: dict[str, Any] = {"config": name}
    try:
        lv, loss_fn = make()

        def step() -> None:
            lv.zero()
            loss_fn().backward()

        lv.zero()
        loss = loss_fn()
        loss.backward()
        torch.cuda.synchronize()
        ref_loss, ref_grads = ref
        row["err loss"] = rel(loss.detach().reshape(()), ref_loss.reshape(()))
        errs = {}
        for k, g in lv.grads().items():
            want = ref_grads.get(k)
            if want is None and k == "w_vd":
                want = ref_grads["w_lm"].t()
            if want is None and k in ("w_gate", "w_up"):
                want = ref_grads["w_13"][:, (0 if k == "w_gate" else 1) :: 2]
            if want is not None:
                errs[k] = rel(g, want)
        row["err grads"] = max(errs.values()) if errs else None
        row["err worst"] = max(errs, key=lambda k: errs[k]) if errs else None
        row["ms first"], row["ms second"] = bench_time(step, args.warmup, args.rep)
        row["peak MiB"], row["grads MiB"] = peak_memory(step, lv.grad_bytes)
        if args.profile and name.startswith("coda"):
            row["kernels"] = profile(step)
    except Exception as e:  # a configuration that fails is reported, the others still run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        traceback.print_exc()
    gc.collect()
    torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict[str, Any]]) -> str:
    cols = [
        "size",
        "config",
        "ms first",
        "ms second",
        "peak MiB",
        "grads MiB",
        "transient MiB",
        "err loss",
        "err grads",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c)
            if c == "ms first" and "error" in r:
                v = r["error"]
            cells.append(
                "-"
                if v is None
                else f"{v:.3g}"
                if isinstance(v, float) and c.startswith("err")
                else f"{v:.3f}"
                if isinstance(v, float) and c.startswith("ms")
                else f"{v:.0f}"
                if isinstance(v, float)
                else str(v)
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("workload", choices=["lm_head", "mlp"])
    p.add_argument("--M", type=int, default=None)
    p.add_argument("--D", default=None, help="hidden size(s), comma-separated")
    p.add_argument("--V", default="128256,32768", help="lm_head: vocabulary size(s)")
    p.add_argument("--remat", default="auto,save", help="coda policies to time, comma-separated")
    p.add_argument("--chunk", default="none", help="lm_head: coda chunk settings (none, auto, rows)")
    p.add_argument("--configs", default="", help="only these configs (substrings, comma-separated)")
    p.add_argument("--profile", action="store_true", help="print the CUDA time per kernel of coda's steps")
    p.add_argument("--warmup", type=int, default=100, help="do_bench warm-up, ms")
    p.add_argument("--rep", type=int, default=400, help="do_bench repetitions, ms")
    args = p.parse_args()

    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    rows: list[dict[str, Any]] = []
    if args.workload == "lm_head":
        M, D = args.M or 8192, int(args.D or 2048)
        sizes = [{"M": M, "D": D, "V": int(v)} for v in args.V.split(",")]
    else:
        M = args.M or 16384
        F_OF = {2048: 5632, 4096: 11008}
        sizes = [{"M": M, "D": int(d), "F": F_OF[int(d)]} for d in (args.D or "2048,4096").split(",")]
    for sz in sizes:
        if args.workload == "lm_head":
            x = lm_head_inputs(sz["M"], sz["D"], sz["V"], seed=0)
            ref = lm_head_reference(x)
            configs = lm_head_configs(x, args)
        else:
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from gpu_bench import make_inputs

            x = make_inputs(sz["M"], sz["D"], sz["F"], seed=0)
            x["ct"] = torch.randn(
                sz["M"], sz["D"], device="cuda", generator=torch.Generator("cuda").manual_seed(1)
            )
            ref = mlp_reference(x)
            configs = mlp_configs(x, args)
        gc.collect()
        torch.cuda.empty_cache()
        only = [s for s in args.configs.split(",") if s]
        for name, make in configs.items():
            if only and not any(s in name for s in only):
                continue
            row = run_config(name, make, ref, args)
            row["size"] = " ".join(f"{k}={v}" for k, v in sz.items())
            rows.append(row)
        del x, ref, configs
        gc.collect()
        torch.cuda.empty_cache()
    print(f"\n{args.workload} forward+backward, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(table(rows))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"fwd_bwd_{args.workload}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
