"""The tile-tuning cache (coda_lang/backend_cute/tune.py), on the CPU: keys and the file on disk.

Timing itself needs a GPU: tests/test_gpu.py::test_tuning_picks_a_measured_tile_and_caches_it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")

from coda_lang.backend_cute import tune  # noqa: E402
from coda_lang.backend_cute.compile import TileConfig  # noqa: E402


def test_store_and_lookup_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    key = tune.disk_key("def f(acc): pass", (1024, 512, 256), "NVIDIA H100 80GB HBM3")
    assert tune.lookup(key) is None
    best = TileConfig(256, 128, 2, 1, False)
    tune.store(key, best, {TileConfig(): 0.5, best: 0.4})
    assert tune.lookup(key) == best
    other = tune.disk_key("def f(acc): pass", (1024, 512, 257), "NVIDIA H100 80GB HBM3")
    assert other != key and tune.lookup(other) is None
    assert tune.disk_key("def f(acc): pass", (1024, 512, 256), "NVIDIA H200") != key
    data = json.loads((tmp_path / "tuning.json").read_text())
    assert data[key]["ms"] == {"128x192 2x1": 0.5, "256x128 coop 2x1": 0.4}
    assert not list(tmp_path.glob("*.tmp"))


def test_unreadable_cache_counts_as_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODA_CACHE_DIR", str(tmp_path))
    (tmp_path / "tuning.json").write_text("{not json")
    assert tune.lookup("anything") is None
    tune.store("k", TileConfig(), {TileConfig(): 1.0})
    assert tune.lookup("k") == TileConfig()


def test_emulated_blocks_do_not_tune() -> None:
    import coda_lang

    blk = coda_lang.load(Path(__file__).resolve().parent.parent / "examples" / "llama_mlp.coda")["llama_mlp"]
    assert blk.cuda(emulate=True).tune is False
    assert blk.cuda(emulate=True, tune=True).tune is True
