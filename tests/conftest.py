"""Capability markers and seeds.

Tests say what they need (needs_cuda, needs_multi_gpu, needs_rocm) and are skipped, with the
reason, on machines that lack it. No test skips by vendor name.

Seeds are fixed by default: each test starts with Python's, NumPy's and torch's generators
seeded from the run's base seed (0) and its id, and hypothesis runs derandomized, so a run
repeats exactly. `--random-seed` (or LONGMOE_TEST_SEED=random) draws a fresh base seed and
LONGMOE_TEST_SEED=N reruns with base N; the base is printed in the header and beside every
failure.
"""

from __future__ import annotations

import os
import random

import pytest

from _seed import ENV as SEED_ENV
from _seed import base_seed, seed_for

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence triton 3.9 default-change warning


def pytest_addoption(parser):
    parser.addoption("--random-seed", action="store_true",
                     help=f"draw a fresh base seed for this run (same as {SEED_ENV}=random)")


def pytest_configure(config):
    asked = os.environ.get(SEED_ENV, "").strip()
    drawn = config.getoption("--random-seed") or asked.lower() == "random"
    if drawn:
        base = random.SystemRandom().randrange(2**31)
    elif asked:
        try:
            base = int(asked)
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV}: expected an integer or 'random', got {asked!r}")
    else:
        base = 0
    os.environ[SEED_ENV] = str(base)  # read by tests/_seed.py here and in child processes
    config._longmoe_seed = (base, drawn)
    try:
        from hypothesis import settings
    except ImportError:
        return
    settings.register_profile("longmoe-fixed", derandomize=True)
    settings.register_profile("longmoe-random", derandomize=False)
    settings.load_profile("longmoe-random" if drawn else "longmoe-fixed")


def pytest_report_header(config):
    base, drawn = config._longmoe_seed
    how = "drawn for this run" if drawn else (
        "fixed; --random-seed or LONGMOE_TEST_SEED=random draws one")
    return f"longmoe test seed: {SEED_ENV}={base} ({how})"


@pytest.fixture(autouse=True)
def _seeded(request):
    """Every generator a test might use without its own seed starts from the test's seed."""
    seed = seed_for(request.node.nodeid)
    random.seed(seed)
    try:
        import numpy
        numpy.random.seed(seed)
    except ImportError:
        pass
    import torch
    torch.manual_seed(seed)
    request.node.user_properties.append(("seed", seed))
    yield


@pytest.fixture(scope="session", autouse=True)
def _shared_ranks():
    """Every CPU `run_ranks` call of the run reuses one group of gloo ranks per world size
    (longmoe/paired/rank_pool.py) instead of starting two to four interpreters per call.
    LONGMOE_TEST_FRESH_RANKS=1 starts fresh ranks for every call instead."""
    if os.environ.get("LONGMOE_TEST_FRESH_RANKS", "") not in ("", "0"):
        yield
        return
    from longmoe.paired.rank_pool import shared_ranks
    with shared_ranks():
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("longmoe seed", f"rerun with {SEED_ENV}={base_seed()} "
                                                f"(this test's seed {seed_for(item.nodeid)})"))


def _capabilities() -> dict[str, str | None]:
    from longmoe.backends import active_backend
    b = active_backend()
    gpus = (b.probe().get("device_count") or 0) if b.device_type != "cpu" else 0
    return {
        "needs_cuda": None if gpus >= 1 else "needs a GPU (CUDA or ROCm device); none here",
        "needs_multi_gpu": None if gpus >= 2 else f"needs two or more GPUs; {gpus} here",
        "needs_rocm": None if b.name == "rocm" else f"needs a ROCm device; backend is {b.name}",
    }


def pytest_collection_modifyitems(config, items):
    caps = None
    for item in items:
        for mark in ("needs_cuda", "needs_multi_gpu", "needs_rocm"):
            if item.get_closest_marker(mark):
                caps = caps or _capabilities()
                if caps[mark]:
                    item.add_marker(pytest.mark.skip(reason=caps[mark]))
