"""benchmarks/hf_train_step.py's configurations that run under an environment of their own
(`CONFIG_ENV`: coda-fp8-narrow, coda-fp8-e16, coda-fp8-fast): the variables are set while the
configuration runs, graphed or not, and put back as they were after it, when it fails too; the
other configurations run in the environment as it is. Every such configuration is a known one."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "hf_train_step.py"


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("hf_train_step_for_tests", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


hts = _load()


def test_every_configuration_with_an_environment_is_a_coda_one() -> None:
    assert set(hts.CONFIG_ENV) <= set(hts.CONFIGS)
    assert set(hts.CONFIG_ENV) <= {*hts.CODA_FP8, "coda-vruns", "coda-split"}


@pytest.mark.parametrize(
    "name", ["coda-fp8-narrow", "coda-fp8-e16+graph", "coda-fp8-fast", "coda-vruns+graph"]
)
def test_the_environment_is_set_while_it_runs_and_restored(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = hts.CONFIG_ENV[name.removesuffix(hts.GRAPH)]
    (var,) = env
    monkeypatch.setenv(var, "before")
    seen: dict[str, Any] = {}

    def run(n: str, args: Any, ids: Any) -> dict[str, Any]:
        seen[n] = os.environ.get(var)
        return {"config": n}

    monkeypatch.setattr(hts, "_run_config", run)
    assert hts.run_config(name, None, None) == {"config": name}
    assert seen == {name: env[var]} and os.environ[var] == "before"

    def fail(n: str, args: Any, ids: Any) -> dict[str, Any]:
        raise RuntimeError("out of memory")

    monkeypatch.setattr(hts, "_run_config", fail)
    monkeypatch.delenv(var)
    with pytest.raises(RuntimeError):
        hts.run_config(name, None, None)
    assert var not in os.environ  # (unset before: unset after)


def test_other_configurations_run_in_the_environment_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CODA_FP8_PAIR_STORE", "0")
    seen = []
    monkeypatch.setattr(
        hts, "_run_config", lambda n, a, i: seen.append(os.environ.get("CODA_FP8_PAIR_STORE"))
    )
    hts.run_config("coda-fp8+graph", None, None)
    assert seen == ["0"]


def test_the_json_is_rewritten_after_each_configuration(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A run stopped at its time limit (here: while the third configuration runs) keeps the rows it
    finished in --json; a configuration that fails leaves no row and does not stop the others."""
    import argparse
    import json

    out = tmp_path / "table.json"
    args = argparse.Namespace(json=str(out))
    seen: list[list[str]] = []

    def run(name: str, a: Any, ids: Any) -> dict[str, Any]:
        seen.append([r["config"] for r in json.loads(out.read_text())] if out.exists() else [])
        if name == "broken":
            raise RuntimeError("no kernel")
        if name == "killed":
            raise KeyboardInterrupt  # (the run stopped while this configuration ran)
        return {"config": name, "step_ms": float(len(name))}

    monkeypatch.setattr(hts, "run_config", run)
    monkeypatch.setattr(hts, "release", lambda: None)
    assert [r["config"] for r in hts.run_all(["coda", "broken", "liger"], args, None)] == ["coda", "liger"]
    assert seen == [[], ["coda"], ["coda"]]
    assert [r["config"] for r in json.loads(out.read_text())] == ["coda", "liger"]
    out.unlink()
    with pytest.raises(KeyboardInterrupt):
        hts.run_all(["coda", "coda-fp8", "killed", "liger"], args, None)
    assert json.loads(out.read_text()) == [
        {"config": "coda", "step_ms": 4.0},
        {"config": "coda-fp8", "step_ms": 8.0},
    ]
