"""The kernel benchmarks' timer: milliseconds per call of `f` by CUDA events over `n` calls, after
`warmup` calls (compiles and first-launch costs excluded). Imported by benchmarks run as scripts from
this folder (block_scaled_gemm.py, fp8_promotion_ab.py, kmajor_store_ab.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def event_ms(f: Callable[[], Any], n: int = 20, warmup: int = 1) -> float:
    for _ in range(warmup):
        f()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n):
        f()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n
