"""Where a CUDA run of a block departs from the interpreter, value by value and stage by stage (GPU host).

    python scripts/stage_diff.py examples/llama_block.coda [--block NAME] [--backward] [--seed S]
                                 [--tile 128x128] [--dims M=1000,D=520,...] [--save FILE.npz]

Runs the block (or its derived backward, on saved tensors from the forward and random cotangents,
as tests/test_gpu.py does) on the GPU and in the interpreter (precision "exact", same tile), then:
1. every named value (inputs, stored tiles, vectors) of the GPU run against the interpreter's, with
   the worst element in units of the per-element bound (coda_lang.testing.compare's 16-bit rule);
2. each stage run alone on the GPU on the interpreter's values, against the interpreter: a stage that
   is wrong by itself shows here; one that only inherits an error does not.
--save writes both runs' values (and the stage-alone results) to an .npz for a closer look.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from runtime_check import RAGGED, example_inputs, to_numpy  # noqa: E402

import coda_lang  # noqa: E402
from coda_lang.interp.inputs import bind  # noqa: E402
from coda_lang.interp.run import Interpreter  # noqa: E402
from coda_lang.ir.nodes import Stage  # noqa: E402


def worst(got: np.ndarray, ref: np.ndarray) -> str:
    g, r = got.astype(np.float64), ref.astype(np.float64)
    if g.shape != r.shape:
        return f"shape {g.shape} vs {r.shape}"
    fin = np.isfinite(r) & np.isfinite(g)
    if not fin.any():
        return "no finite elements"
    rms = float(np.sqrt(np.mean(np.square(r[fin]))))
    bound = 2.0**-7 * (np.abs(r) + rms)
    err = np.where(fin, np.abs(g - r) / np.where(bound > 0, bound, 1.0), 0.0)
    k = np.unravel_index(int(np.argmax(err)), err.shape)
    nbad = int((err > 1).sum())
    return (
        f"worst {float(err[k]):7.3f} bounds at {tuple(int(i) for i in k)}: {g[k]:.6g} vs {r[k]:.6g}; "
        f"{nbad} beyond; rms {rms:.3g}; finite mismatch {int((np.isfinite(g) != np.isfinite(r)).sum())}"
    )


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file")
    ap.add_argument("--block")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--seed", type=int, default=5)
    ap.add_argument("--tile", default="128x128")
    ap.add_argument("--dims", default="")
    ap.add_argument("--save")
    ap.add_argument(
        "--emulate", action="store_true", help="torch stand-ins on the CPU (to try the script itself)"
    )
    a = ap.parse_args()
    tile = tuple(int(x) for x in a.tile.split("x"))
    sizes = dict(RAGGED)
    for kv in filter(None, a.dims.split(",")):
        k, v = kv.split("=")
        sizes[k] = int(v)
    blocks = coda_lang.load(a.file)
    blk = blocks[a.block or Path(a.file).stem]
    dev = "cpu" if a.emulate else "cuda"
    inputs = example_inputs(blk, sizes, seed=a.seed, device=dev)
    if a.backward:
        d = blk.derivation()
        saved = d.forward.cuda(tile=tile, emulate=a.emulate)(inputs)
        gen = torch.Generator(dev).manual_seed(a.seed + 1)
        cot = {c: o for o, c in d.cotangents.items()}
        bins = {}
        for p in d.backward.ir.params:
            n = p.var.name
            if n in cot:
                like = saved[cot[n]]
                bins[n] = torch.randn(like.shape, device=dev, generator=gen).to(like.dtype)
            elif n in saved:
                bins[n] = saved[n]
            elif n in inputs:
                bins[n] = inputs[n]
        blk, inputs = d.backward, bins
    cb = blk.cuda(tile=tile, emulate=a.emulate)
    gpu = cb.values(inputs)
    sync()
    cpu = {k: v.cpu() for k, v in inputs.items()}
    env, dims = bind(
        blk.ir,
        {k: to_numpy(v) if v.dtype == torch.bfloat16 else v.numpy() for k, v in cpu.items()},
        None,
        "exact",
    )
    it = Interpreter(blk.ir, blk.plan, dims, "exact", tile)
    with np.errstate(all="ignore"):
        it.run(env)
    ref = it.env
    print(
        f"== {blk.name}: dims {dims}, tile {tile}; GEMM stages {cb.gemm_stages}, elementwise {sorted(cb.elementwise)}"
    )
    print("== 1. every value of the GPU run against the interpreter's")
    saved_arrays: dict[str, np.ndarray] = {}
    for name, r in ref.items():
        if name not in gpu or not isinstance(gpu[name], torch.Tensor):
            continue
        g = to_numpy(gpu[name])
        rr = np.asarray(r, dtype=np.float64)
        print(f"  {name:14s} {str(tuple(g.shape)):16s} {worst(g, rr)}")
        saved_arrays[f"gpu/{name}"], saved_arrays[f"interp/{name}"] = g, rr
    print("== 2. each stage alone on the interpreter's values")
    cuda_env = {
        k: torch.as_tensor(np.asarray(v, dtype=np.float32)).to(dev) if isinstance(v, np.ndarray) else v
        for k, v in ref.items()
    }
    for p in blk.ir.params:
        if p.var.name in inputs:
            cuda_env[p.var.name] = inputs[p.var.name]
    # stored values in their storage dtypes, as the runtime keeps them
    for name in cb.plan.storage:
        if name in cuda_env and isinstance(cuda_env[name], torch.Tensor) and name in gpu:
            cuda_env[name] = cuda_env[name].to(gpu[name].dtype)
    k = 0
    for s in blk.ir.body:
        if not isinstance(s, Stage):
            continue
        k += 1
        new, _ = cb.run_stage(k, dict(cuda_env), dims)
        sync()
        kind = "elementwise" if k in cb.elementwise else "gemm"
        for name, v in new.items():
            if name in ref and isinstance(v, torch.Tensor):
                g = to_numpy(v)
                print(f"  stage {k} ({kind}) {name:14s} {worst(g, np.asarray(ref[name], dtype=np.float64))}")
                saved_arrays[f"alone/{name}"] = g
    if a.save:
        np.savez_compressed(a.save, **saved_arrays)
        print(f"saved {len(saved_arrays)} arrays to {a.save}")


if __name__ == "__main__":
    main()
