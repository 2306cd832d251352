"""Interpreter speed: llama_mlp on the reference interpreter against the same math hand-written in
NumPy (same f32 GEMMs, same bf16 rounding points), as a ratio. Not a test; run it by hand:

    python benchmarks/interp_bench.py [--M 4096 --D 1024 --F 2816 --repeats 5]

Prints the median wall time of each and their ratio (target: at most 1.5x).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import ml_dtypes
import numpy as np

import coda_lang
from coda_lang.interp import random_inputs

ROOT = Path(__file__).resolve().parent.parent


def by_hand(ins: dict[str, np.ndarray], eps: float = 1e-6) -> np.ndarray:
    f = np.float32
    bf = ml_dtypes.bfloat16
    y, x, w_o, g = ins["y"].astype(f), ins["x"].astype(f), ins["w_o"].astype(f), ins["g"].astype(f)
    w_13, w_2 = ins["w_13"].astype(f), ins["w_2"].astype(f)
    h = y @ w_o + x
    ss = (h * h).sum(1)
    hs = h.astype(bf).astype(f)
    hg = (h * g).astype(bf).astype(f)
    r = 1 / np.sqrt(ss / f(h.shape[1]) + f(eps))
    z = (hg @ w_13) * r[:, None]
    gt, up = z[:, 0::2], z[:, 1::2]
    a = (gt / (1 + np.exp(-gt)) * up).astype(bf).astype(f)
    return (a @ w_2 + hs).astype(bf)


def median_time(fn, repeats: int) -> float:  # type: ignore[no-untyped-def]
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--M", type=int, default=4096)
    ap.add_argument("--D", type=int, default=1024)
    ap.add_argument("--F", type=int, default=2816)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    block = coda_lang.load(ROOT / "examples" / "llama_mlp.coda")["llama_mlp"]
    dims = {"M": a.M, "D": a.D, "F": a.F}
    ins = random_inputs(block.ir, dims, 0)
    got = block.run(ins)["x2"].astype(np.float32)
    want = by_hand(ins).astype(np.float32)
    ulp = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    t_interp = median_time(lambda: block.run(ins), a.repeats)
    t_hand = median_time(lambda: by_hand(ins), a.repeats)
    print(
        f"llama_mlp M={a.M} D={a.D} F={a.F}: interpreter {t_interp * 1e3:.1f} ms, hand-written NumPy "
        f"{t_hand * 1e3:.1f} ms, ratio {t_interp / t_hand:.2f}x (max rel. difference {ulp:.1e})"
    )


if __name__ == "__main__":
    main()
