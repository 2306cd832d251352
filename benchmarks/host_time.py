"""Where a patched model's training step spends its host time, and same-process A/Bs of the runtime's
host-side options.

Usage (on a Hopper GPU): python benchmarks/host_time.py [--config coda-fp8] [--split] [--ab] [--kmajor-ab]
    [--reps 3]

Builds one configuration of benchmarks/hf_train_step.py (Llama-3.2-1B shapes, seq 8192, fused AdamW, one
fixed batch), warms it up (its kernels compiled and tuned), then:
- `--split`: five steps with the runtime's pieces wrapped in wall-clock timers; prints, per forward,
  each piece's inclusive time, calls and time per call (the pieces nest: indentation shows it), and
  the forward's host time (instrumented: a wrapped call costs about a microsecond more);
- `--ab`: the step under each mode of {vector runs on, off} x {Triton kernels launched directly, through
  Triton's JIT}, the modes interleaved `--reps` times, 3 timed steps each after 2 untimed: the median
  step (CUDA events, synchronized per step), the forward's and the whole step's host time. The vector
  runs are built ($CODA_VECTOR_RUNS=1 is set here) and switched per block afterwards;
- `--kmajor-ab`: the same for $CODA_KMAJOR_STAGES=plain and =all (the generated stages over column
  pairs or with reductions writing their K-major copies, or the runtime transposing them).
Prints a table last.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
os.environ["CODA_VECTOR_RUNS"] = "1"

import torch  # noqa: E402

T: dict[str, float] = collections.defaultdict(float)
N: collections.Counter[str] = collections.Counter()


def wrap(owner: Any, attr: str, label: str) -> None:
    f = getattr(owner, attr)

    @functools.wraps(f)
    def g(*a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            T[label] += time.perf_counter() - t
            N[label] += 1

    setattr(owner, attr, g)


def instrument() -> None:
    import coda_lang.hf.forward as hff
    import coda_lang.hf.fp8 as hf8
    from coda_lang.backend_cute.build import quack_adapter
    from coda_lang.backend_cute.runtime import autograd, binding, cuda_block, launch, vector_eqn
    from coda_lang.backend_triton import elementwise, launcher, vector_run

    for owner, attr, label in [
        (hf8, "run_scaled", "run_scaled"),
        (hff, "run_block", "run_block"),
        (hff, "attention", "attention"),
        (autograd._CodaAutograd, "forward", "Function.forward"),
        (cuda_block.CudaBlock, "_run", "  CudaBlock._run"),
        (binding.Binder, "bind", "    bind"),
        (vector_eqn.VectorStep, "__call__", "    vector equation"),
        (vector_run.VectorRun, "__call__", "    VectorRun"),
        (elementwise.ElementwiseStage, "run", "    elementwise.run"),
        (launch.StageRunner, "arguments", "    gemm.arguments"),
        (launch.StageRunner, "launch", "    gemm.launch"),
        (launch.StageRunner, "allocate", "      allocate"),
        (quack_adapter, "launch", "      quack_adapter.launch"),
        (launch.StageRunner, "collect", "    gemm.collect"),
        (launcher, "launch", "      triton launch"),
    ]:
        wrap(owner, attr, label)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="coda-fp8")
    p.add_argument("--split", action="store_true")
    p.add_argument("--ab", action="store_true")
    p.add_argument("--kmajor-ab", action="store_true")
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args(argv)
    if not (args.split or args.ab or args.kmajor_ab):
        p.error("give --split, --ab, --kmajor-ab or several")
    if not args.config.startswith("coda"):
        p.error("--config: a coda configuration of hf_train_step.py (coda, coda-fp8, coda-fp8-fwd)")
    import hf_train_step as h

    import coda_lang.backend_triton.launcher as launcher
    import coda_lang.torch as ct
    from coda_lang.backend_cute.runtime.cuda_block import CudaBlock

    torch.manual_seed(0)
    model, _ = h.build(args.config, None, "llama")
    fwd = h.prepare(model, args.config, "llama", 0)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4, fused=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 128000, (1, 8192), device="cuda", generator=g)
    F: dict[str, float] = collections.defaultdict(float)
    FN: collections.Counter[str] = collections.Counter()

    def step() -> tuple[float, float]:
        before, nb = dict(T), N.copy()
        t0 = time.perf_counter()
        loss = fwd(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        for k in T:
            F[k] += T[k] - before.get(k, 0.0)
            FN[k] += N[k] - nb.get(k, 0)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return t1 - t0, time.perf_counter() - t0

    t = time.perf_counter()
    step()
    torch.cuda.synchronize()
    ct.wait_for_kernels()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    print(f"{args.config}: warm after {time.perf_counter() - t:.1f} s", flush=True)
    rows = []

    def timed(set_mode: Any, modes: list[Any], label: Any) -> None:
        """Each mode's 3 timed steps after 2 untimed, the modes interleaved `--reps` times: a table row
        each (the median step, the forward's and the step's host time)."""
        res: dict[Any, list[tuple[float, float, float]]] = {m: [] for m in modes}
        for _ in range(args.reps):
            for m in modes:
                set_mode(m)
                step()
                step()
                torch.cuda.synchronize()
                for _ in range(3):
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    f, whole = step()
                    b.record()
                    b.synchronize()
                    res[m].append((a.elapsed_time(b), f * 1e3, whole * 1e3))
        for m in modes:
            r = res[m]
            rows.append(
                f"| {label(m)} | {statistics.median(x[0] for x in r):.1f} ms "
                f"| {statistics.median(x[1] for x in r):.1f} ms | {statistics.median(x[2] for x in r):.1f} ms "
                f"| {', '.join(f'{x[0]:.1f}' for x in r)} |"
            )

    if args.kmajor_ab:  # (read at each stage's launch: the kernels of both modes compile in the warm-up)
        timed(
            lambda m: os.environ.__setitem__("CODA_KMAJOR_STAGES", m),
            ["plain", "all"],
            lambda m: f"CODA_KMAJOR_STAGES={m}",
        )
        os.environ["CODA_KMAJOR_STAGES"] = "plain"
    if args.ab:
        blocks = [o for o in gc.get_objects() if isinstance(o, CudaBlock)]
        runs = {id(c): c._run_of for c in blocks}
        direct = launcher._direct

        def set_mode(m: tuple[bool, bool]) -> None:
            for c in blocks:
                c._run_of = runs[id(c)] if m[0] else {}
            launcher._direct = direct if m[1] else (lambda k: False)  # type: ignore[assignment]

        timed(
            set_mode,
            [(False, False), (False, True), (True, False), (True, True)],
            lambda m: f"runs {'on' if m[0] else 'off'}, {'direct' if m[1] else 'JIT'} launches",
        )
        for c in blocks:
            c._run_of = {}
        launcher._direct = direct  # type: ignore[assignment]
    if args.split:
        instrument()
        T.clear()
        N.clear()
        F.clear()
        FN.clear()
        n, tf = 5, 0.0
        for _ in range(n):
            torch.cuda.synchronize()
            tf += step()[0]
            torch.cuda.synchronize()
        print(f"\n{args.config}: the forward's host time {tf / n * 1e3:.1f} ms (instrumented), per forward:")
        for k in sorted(F, key=lambda k: -F[k]):
            if FN[k]:
                print(
                    f"  {k:32s} {F[k] / n * 1e3:7.2f} ms {FN[k] // n:5d} calls {F[k] / FN[k] * 1e6:7.1f} us/call"
                )
    if rows:
        print(f"\n{torch.cuda.get_device_name()}, {args.config}, Llama-3.2-1B shapes, seq 8192")
        print("| mode | step | forward's host time | step's host time | steps (ms) |")
        print("|---|---|---|---|---|")
        print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
