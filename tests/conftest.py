"""Shared test configuration: hypothesis profiles, the `--update-golden` option, and skipping `gpu` tests
without a CUDA GPU.

Hypothesis profiles, chosen with the environment variable HYPOTHESIS_PROFILE:
- "ci" (the default): derandomized (the same examples on every run, so CI is reproducible), no
  deadline, 50 examples per property, failure blobs printed;
- "dev": random examples (a different 50 on each run), for a quick local look around;
- "long": random, 1000 examples per property, for a local run before a release or after touching the
  checker, interpreter or autodiff: `HYPOTHESIS_PROFILE=long python -m pytest -q -p no:cacheprovider`.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, deadline=None, max_examples=50, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=50)
settings.register_profile("long", deadline=None, max_examples=1000, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite golden files (tests/golden/) from the current output instead of comparing")


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    """True when pytest runs with --update-golden: golden tests write their files instead of comparing."""
    return bool(request.config.getoption("--update-golden"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` when there is no CUDA GPU (torch is imported only if such tests exist)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_items and not _cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
        for item in gpu_items:
            item.add_marker(skip)
