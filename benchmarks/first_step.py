"""The first training step of a block from an empty kernel cache: how long until forward+backward runs.

Not a test; on a Hopper GPU host (after `source .gpu/env/gpu.sh`):

    python benchmarks/first_step.py [--M 16384] [--D 2048,4096] [--full] [--jobs N]

Phases, each in a fresh process (so imports, compiles and tuning are counted as a user meets them):
1. cold: an empty $CODA_CACHE_DIR (a new temporary folder, or --cache DIR: "given" when it is not
   empty, e.g. filled by `coda tune` first); llama_mlp through coda_lang.torch.function
   (the default policy), the first forward+backward at each D in turn (M rows, F = 5632 for D = 2048
   and 11008 for D = 4096), timed from the call to the end of the backward (torch.cuda.synchronize;
   each stage runs at its first tile without spills while the tuner's other candidates compile in the
   background); then until those are all compiled (`coda_lang.torch.wait_for_kernels`) and until a
   second step, which times them, ended (both from the first call); then the steady step time (triton's do_bench median, the leaves' .grad set to None first) and the
   tile each stage chose at that shape.
2. warm: a new process on the same cache: its import time, its first forward+backward at each D (the
   kernels are loaded, not compiled; the choices read from tuning.json) and the step time.
3. with --full: an empty cache again with CODA_TUNE=full (every candidate timed to the end: the
   exhaustive tuner, as before pruning and early stop): its first-step times, tiles and step time, to
   compare with phase 1's (the tiles should mostly agree; the step times within noise).
Python caches its bytecode as a pip install does: where the environment sets PYTHONDONTWRITEBYTECODE
(the GPU host), under a temporary PYTHONPYCACHEPREFIX filled once before phase 1 (`bytecode_env`).
Prints one JSON line per phase and a summary; writes $OUT/first_step.json when $OUT is set.
The issue's targets (H100, 16 cores): the cold first step at D=2048 within 30 s, at D=4096 (a second
shape: nothing to compile, only timing) within 30 s, the warm process within 3 s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

T_START = time.perf_counter()
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

F_OF = {2048: 5632, 4096: 11008}


def child(args: argparse.Namespace) -> dict[str, Any]:
    """One phase: the first forward+backward at each D, then the step time and the tiles."""
    import torch

    t_import = time.perf_counter()
    import coda_lang.torch as ct

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_bench import make_inputs

    imported = time.perf_counter() - T_START
    names = ("y", "x", "w_o", "g", "w_13", "w_2")
    fn = ct.function(str(ROOT / "examples" / "llama_mlp.coda"))
    out: dict[str, Any] = {"phase": args.child, "import_s": round(imported, 2), "sizes": []}
    for d in [int(x) for x in args.D.split(",")]:
        x = make_inputs(args.M, d, F_OF[d], seed=0)
        ct_ = torch.randn(args.M, d, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        leaves = {k: x[k].detach().clone().requires_grad_(True) for k in names}
        torch.cuda.synchronize()

        def step(leaves: dict[str, Any] = leaves, cot: Any = ct_) -> None:
            for v in leaves.values():
                v.grad = None
            loss = (fn(**leaves)["x2"].float() * cot).sum()
            loss.backward()

        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        out.setdefault("ready_s", round(time.perf_counter() - T_START, 2))  # process start to first step done
        ct.wait_for_kernels()  # (the other candidate tiles, compiling in the background)
        compiled = time.perf_counter() - t0
        step()  # (times each stage's candidates: the tiles the steady state runs)
        torch.cuda.synchronize()
        tuned = time.perf_counter() - t0
        from triton.testing import do_bench

        ms = float(do_bench(step, warmup=50, rep=300, return_mode="median"))
        cf = fn._fn(False)
        tiles = {}
        for what, cb in (("fwd", cf.forward), ("bwd", cf.backward)):
            for k in cb.gemm_stages:
                tiles[f"{what}{k}"] = str(cb.config(k))
        row = {
            "D": d,
            "first_step_s": round(first, 2),
            "all_compiled_s": round(compiled, 2),
            "tuned_s": round(tuned, 2),
            "step_ms": round(ms, 3),
            "tiles": tiles,
        }
        out["sizes"].append(row)
        print(json.dumps({"phase": args.child, **row}), file=sys.stderr, flush=True)
        del x, step
        torch.cuda.empty_cache()
    out["process_s"] = round(time.perf_counter() - T_START, 2)
    out["import_torch_s"] = round(t_import - T_START, 2)
    return out


def run_phase(phase: str, cache: str, args: argparse.Namespace, extra_env: dict[str, str]) -> dict[str, Any]:
    env = {**os.environ, "CODA_CACHE_DIR": cache, **extra_env}
    if "PYTHONPYCACHEPREFIX" in extra_env:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("QUACK_CACHE_DIR", None)  # quack's objects live in the kernel cache (a cold start is cold)
    cmd = [sys.executable, __file__, "--child", phase, "--M", str(args.M), "--D", args.D]
    if args.jobs:
        env["CODA_JOBS"] = str(args.jobs)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        return {"phase": phase, "error": f"exit {r.returncode}"}
    res: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    res["wall_s"] = round(wall, 2)
    print(json.dumps(res), flush=True)
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--M", type=int, default=16384)
    p.add_argument("--D", default="2048,4096", help="hidden sizes, in the order they are first run")
    p.add_argument("--full", action="store_true", help="also the exhaustive tuner (CODA_TUNE=full)")
    p.add_argument("--jobs", type=int, default=0, help="compile workers (default: coda's, one per CPU)")
    p.add_argument(
        "--cache",
        help="the cache folder of phases 1 and 2 (default: a new temporary one; a folder that is not empty, "
        "e.g. filled by `coda tune`, makes phase 1 'given' instead of 'cold')",
    )
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="coda-first-step-") as tmp:
        cache = args.cache or str(Path(tmp) / "cache")
        given = Path(cache).exists() and any(Path(cache).iterdir())  # (e.g. filled by `coda tune`)
        from bytecode import bytecode_env

        py = bytecode_env(tmp)
        if py:
            print(
                f"(Python bytecode cached under {py['PYTHONPYCACHEPREFIX']}: this environment sets "
                "PYTHONDONTWRITEBYTECODE)",
                flush=True,
            )
        results.append(run_phase("given" if given else "cold", cache, args, py))
        results.append(run_phase("warm", cache, args, py))
        if args.full:
            results.append(run_phase("full", str(Path(tmp) / "full"), args, {"CODA_TUNE": "full", **py}))
    print(
        "\nphase  D     first step  all compiled, tuned  step ms   (process: import, first step done, total)"
    )
    for r in results:
        if "error" in r:
            print(f"{r['phase']:6} {r['error']}")
            continue
        for s in r["sizes"]:
            print(
                f"{r['phase']:6} {s['D']:<5} {s['first_step_s']:8.2f} s  {s['all_compiled_s']:6.2f} s, "
                f"{s['tuned_s']:6.2f} s  {s['step_ms']:7.3f}   "
                f"({r['import_s']:.1f} s, {r['ready_s']:.1f} s, {r['process_s']:.1f} s)"
            )
    by = {r["phase"]: r for r in results if "error" not in r}
    if "given" in by:
        by["cold"] = by["given"]
    for ref in ("warm", "full"):
        if "cold" in by and ref in by:
            for a, b in zip(by["cold"]["sizes"], by[ref]["sizes"], strict=False):
                diff = {
                    k: (a["tiles"][k], b["tiles"].get(k))
                    for k in a["tiles"]
                    if a["tiles"][k] != b["tiles"].get(k)
                }
                print(f"tiles cold vs {ref} at D={a['D']}: " + ("same" if not diff else json.dumps(diff)))
    if "cold" in by:
        for s in by["cold"]["sizes"]:
            print(f"cold D={s['D']}: " + "; ".join(f"{k} {v}" for k, v in s["tiles"].items()))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "first_step.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
