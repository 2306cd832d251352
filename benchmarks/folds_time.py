"""The eager fp8 training step with and without the batched amax folds, in one process.

`cuda_block.batched_folds` runs the amax folds a block returns for its next step's scales together at
the end of the block's run (one `torch._foreach_max`) instead of one reduction each where it is made.
This builds benchmarks/hf_train_step.py's coda-fp8 model (Llama-3.2-1B shapes, seq 8192), warms it
up, then times eager steps (no CUDA graph: the launches are what batching saves) in alternating
rounds, batched and not (each CudaBlock's `_folds` and `_after` cleared, as launch_count.py does),
and prints the median of each and their ratio.

    python benchmarks/folds_time.py --rounds 4 --steps 5
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_train_step as hts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="coda-fp8")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("folds_time.py needs a CUDA GPU")
    from coda_lang.backend_cute.runtime import cuda_block

    model, _ = hts.build(args.config, args.layers, "llama")
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq), device="cuda")
    _, step = hts.training_step(model, hts.prepare(model, args.config, "llama"), ids)
    for _ in range(3):
        step()
    import coda_lang.torch as ct

    ct.wait_for_kernels()
    step()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        blocks = [o for o in gc.get_objects() if isinstance(o, cuda_block.CudaBlock)]
    batched = {id(c): (c._folds, c._after) for c in blocks}
    times: dict[str, list[float]] = {"batched": [], "in place": []}
    for _ in range(args.rounds):
        for mode in times:
            for c in blocks:
                c._folds, c._after = batched[id(c)] if mode == "batched" else ({}, frozenset())
            step()  # (one untimed step in each mode before its timed ones)
            for _ in range(args.steps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step()
                b.record()
                b.synchronize()
                times[mode].append(a.elapsed_time(b))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{torch.cuda.get_device_name()}, {args.config}, eager step, {len(blocks)} CUDA blocks")
    for k, v in times.items():
        print(f"  {k:9s} median {med[k]:.1f} ms  (min {min(v):.1f}, max {max(v):.1f}, {len(v)} steps)")
    print(f"  in place / batched: {med['in place'] / med['batched']:.3f}")


if __name__ == "__main__":
    main()
