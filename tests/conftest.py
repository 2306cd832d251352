"""Shared test configuration: hypothesis profiles, the `--update-golden` option, and the test tiers.

Tiers (markers, declared in pyproject.toml): `gpu` tests need a CUDA GPU and are skipped without one;
`toolchain` tests need nvidia-cutlass-dsl, quack-kernels and ptxas (compiling to PTX, no GPU) and are
skipped without them; `slow` tests are left out of the default run (pyproject's `-m 'not slow'`;
`python -m pytest -m slow` runs them, `-m 'slow or not slow'` runs everything).

Hypothesis profiles, chosen with the environment variable HYPOTHESIS_PROFILE:
- "ci" (the default): derandomized (the same examples on every run, so CI is reproducible), no
  deadline, 50 examples per property, failure blobs printed;
- "dev": random examples (a different 50 on each run), for a quick local look around;
- "long": random, 1000 examples per property, for a local run before a release or after touching the
  checker, interpreter or autodiff: `HYPOTHESIS_PROFILE=long python -m pytest -q -p no:cacheprovider`;
- "stress": random, 10,000 examples per property that takes the profile's count (the malformed-program
  property of tests/test_robustness.py: `HYPOTHESIS_PROFILE=stress python -m pytest -q
  tests/test_robustness.py -k malformed`; scripts/robustness_stress.py does the same in parallel jobs).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

# CuTeDSL and quack fix the arch they target when they are first imported (without a GPU they can't
# ask the driver). coda's backend sets Hopper's before it imports them
# (coda_lang/backend_cute/build/quack_adapter.py); a test that imports either directly, before the
# backend, must find the same, or a later test in its process compiles for CuTeDSL's default (sm_100a)
os.environ.setdefault("QUACK_ARCH", "90")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
# One OpenMP thread per test process (torch's intra-op threads, NumPy's BLAS), and so in the commands
# the tests start: the tests' matrices are tiny, so more threads only wait on each other, and on CI's
# 2 cores the 2 xdist workers take a core each already: with torch's default (a thread per core) each
# worker's threads spin in OpenMP's barriers for a multiple of the work (tests/test_hf.py and
# test_hf_fp8.py under -n 2: 3 to 4 times the CPU time). Read by torch and NumPy when first imported
# (after this file); a value set outside wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=50,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=50)
settings.register_profile(
    "long", deadline=None, max_examples=1000, print_blob=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "stress", deadline=None, max_examples=10_000, print_blob=True, suppress_health_check=list(HealthCheck)
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        default=False,
        help="rewrite golden files (tests/golden/) from the current output instead of comparing",
    )


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


def _toolchain_available() -> bool:
    """CuTeDSL, quack and a ptxas ($CODA_PTXAS, on PATH, or Triton's) are here."""
    import importlib.util

    from coda_lang.backend_cute.runtime.tiles import find_ptxas

    return bool(importlib.util.find_spec("cutlass") and importlib.util.find_spec("quack") and find_ptxas())


# The files whose tests take longest (pytest --durations=0 on 2 cores, 2026-11-28), run first, each
# whole and in its own order: with `-n 2` a long file that starts last keeps one worker busy while
# the other has nothing left (test_hf_dist.py's one torchrun takes 20-30 s).
LONG_FIRST = (
    "test_hf_dist.py",
    "test_fuzz.py",
    "test_compile_cache.py",
    "test_fp8_kernels.py",
    "test_robustness.py",
    "test_backend_ptx.py",
)


def _long_first(item: pytest.Item) -> int:
    name = item.path.name
    return LONG_FIRST.index(name) if name in LONG_FIRST else len(LONG_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip tests marked `gpu` when there is no CUDA GPU, and `toolchain` ones without the compile
    toolchain (torch and the finders are consulted only if such tests were collected); run the longest
    files first (LONG_FIRST; a stable sort, so every file keeps its tests together and in order)."""
    items.sort(key=_long_first)
    for marker, available, reason in (
        ("gpu", _cuda_available, "needs a CUDA GPU (torch.cuda.is_available() is False)"),
        ("toolchain", _toolchain_available, "needs nvidia-cutlass-dsl, quack-kernels and ptxas"),
    ):
        marked = [item for item in items if item.get_closest_marker(marker) is not None]
        if marked and not available():
            skip = pytest.mark.skip(reason=reason)
            for item in marked:
                item.add_marker(skip)


@pytest.fixture
def narrowing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed stage's fp8 D planned the way $CODA_FP8_PAIR_STORE=0 plans it: stored in 16 bits,
    rounded to odd, narrowed by the runtime (the default stores its pairs: tests/test_fp8_pairs.py)."""
    monkeypatch.setenv("CODA_FP8_PAIR_STORE", "0")
