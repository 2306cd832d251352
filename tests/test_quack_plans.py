"""quack_adapter.launch keeps the plan quack returned for a call and replays it for a later call whose
tensors have the same metadata and whose scalars are the same values, at the same tile config, and
only then (the fast path must never replay a plan compiled for other arguments).

A stand-in EpiMod records its `gemm` calls and returns a plan; quack's `run_gemm_epi_plan` is replaced
by a recorder. Real quack is imported (the toolchain tier), no GPU is used.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.toolchain


class _Mod:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def gemm(self, A: Any, B: Any, D: Any, C: Any = None, **kw: Any) -> Any:
        plan = ("plan", len(self.calls))
        self.calls.append((A, B, D, C, kw))
        return plan


class _Spec:
    class gemm:  # noqa: N801  (the attribute quack_adapter reads)
        tb = True


@pytest.fixture
def qa(monkeypatch: pytest.MonkeyPatch) -> Any:
    from coda_lang.backend_cute.build import quack_adapter

    replays: list[Any] = []
    monkeypatch.setattr(quack_adapter.quack_host, "run_gemm_epi_plan", lambda *a: replays.append(a))
    return quack_adapter, replays


def _cfg(tile_n: int = 128) -> Any:
    from coda_lang.backend_cute.build.config import TileConfig

    return TileConfig(tile_m=128, tile_n=tile_n)


def _args(m: int = 64, scale: Any = 2.0, d_dtype: torch.dtype = torch.bfloat16) -> tuple[Any, ...]:
    A = torch.zeros(m, 32, dtype=torch.bfloat16)
    B = torch.zeros(48, 32, dtype=torch.bfloat16)
    D = torch.zeros(m, 48, dtype=d_dtype)
    epi = {"r": torch.zeros(m), "s": scale, "out": torch.zeros(m, 2)}
    return A, B, D, epi


def test_a_repeated_call_replays_the_plan(qa: Any) -> None:
    quack_adapter, replays = qa
    mod, cfg = _Mod(), _cfg()
    A, B, D, epi = _args()
    quack_adapter.launch(mod, _Spec, cfg, A, B, D, epi)
    assert len(mod.calls) == 1 and not replays
    A2, B2, D2, epi2 = _args()
    quack_adapter.launch(mod, _Spec, cfg, A2, B2, D2, epi2)
    assert len(mod.calls) == 1
    ((plan, a, b, d, c, e),) = replays
    assert plan == ("plan", 0) and a is A2 and b is B2 and d is D2 and c is None and e is epi2


@pytest.mark.parametrize("change", ["shape", "stride", "dtype", "scalar", "scalar kind", "tile", "None arg"])
def test_anything_a_plan_depends_on_makes_a_new_one(qa: Any, change: str) -> None:
    quack_adapter, replays = qa
    mod = _Mod()
    A, B, D, epi = _args()
    quack_adapter.launch(mod, _Spec, _cfg(), A, B, D, epi)
    cfg = _cfg()
    if change == "shape":
        A, B, D, epi = _args(m=80)
    elif change == "stride":
        A = torch.zeros(32, 64, dtype=torch.bfloat16).t()  # the same shape, column-major
    elif change == "dtype":
        A, B, D, epi = _args(d_dtype=torch.float16)
    elif change == "scalar":
        A, B, D, epi = _args(scale=1.0)  # (quack compiles a scalar of 1.0 out)
    elif change == "scalar kind":
        A, B, D, epi = _args(scale=torch.ones(1))
    elif change == "tile":
        cfg = _cfg(tile_n=256)
    elif change == "None arg":
        epi = {**epi, "r": None}
    quack_adapter.launch(mod, _Spec, cfg, A, B, D, epi)
    assert len(mod.calls) == 2 and not replays, change
    quack_adapter.launch(mod, _Spec, cfg, A, B, D, epi)  # kept under its own key
    assert len(mod.calls) == 2 and len(replays) == 1 and replays[0][0] == ("plan", 1), change


def test_a_dry_run_keeps_nothing(qa: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import contextlib

    quack_adapter, replays = qa
    monkeypatch.setattr(quack_adapter, "compile_only", lambda *a: contextlib.nullcontext())
    mod = _Mod()
    A, B, D, epi = _args()
    quack_adapter.launch(mod, _Spec, _cfg(), A, B, D, epi, dry_run=True)
    quack_adapter.launch(mod, _Spec, _cfg(), A, B, D, epi)
    assert len(mod.calls) == 2 and not replays
    assert mod.calls[0][4]["_launch"] is False and "_launch" not in mod.calls[1][4]
