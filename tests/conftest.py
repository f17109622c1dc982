import collections
import importlib.metadata
import os
import pathlib
import sys
import zlib

# The applications in examples/ (outside the package) import each other by file name, as
# `python examples/X.py` runs them; the tests import them the same way.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "examples"))

# 8 simulated CPU devices for the sharding tests (must be set before JAX initializes its backend).
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# Compiling thousands of small programs is most of the suite's time on a CPU: LLVM's optimization
# level 0 compiles them about a quarter faster. It changes code generation only, not values (XLA's
# CPU backend emits no fast-math). Left alone where a GPU plugin is installed (the GPU tests run the
# kernels as users compile them) or where XLA_FLAGS already sets a level.
_GPU_PLUGIN = any((d.metadata["Name"] or "").startswith(("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm"))
                  for d in importlib.metadata.distributions())
if not _GPU_PLUGIN and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"

import numpy as np
import pytest
from hypothesis import HealthCheck, settings


def pytest_xdist_auto_num_workers(config):
    """Workers for pyproject's ``-n auto``: two on a CPU-only install with two or more cores (the
    suite is mostly compiling small programs, one core each: the default tier took 354 s instead
    of 597 s on 2 cores, 2026-12-05), none (one process) where a GPU plugin is installed, since
    the GPU tests share one device."""
    return 0 if _GPU_PLUGIN or (os.cpu_count() or 1) < 2 else 2

# Property tests: 10 examples each in the default tier; `--hypothesis-profile=thorough` runs 200
# (hypothesis' own pytest option); HYPOTHESIS_MAX_EXAMPLES=N overrides the default tier's count.
settings.register_profile(
    "ci", deadline=None, max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "10")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", parent=settings.get_profile("ci"), max_examples=200)
settings.load_profile("ci")


# ---- test tiers
# `pytest -q tests` runs the default tier (pyproject.toml: -m "not slow"); `pytest -m slow tests` the
# rest. A parametrized test marked ``sweep(keep=N)`` runs its first N cases in the default tier and
# the others in the slow tier, so every function keeps a case in the default tier.


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    seen = collections.Counter()
    for item in items:
        mark = item.get_closest_marker("sweep")
        if mark is None:
            continue
        key = (str(item.path), getattr(item, "originalname", item.name))
        seen[key] += 1
        if seen[key] > mark.kwargs.get("keep", 1):
            item.add_marker(pytest.mark.slow)


# ---- replayable randomness
# Every test that needs random data takes the ``rng`` fixture (or ``jax_key``): a generator seeded from
# a base seed and the test's node id, so each test draws the same numbers on every run, whatever runs
# before it. The base seed is 0 unless ``--seed N`` or ``JAX_MXFP4_TEST_SEED=N`` says otherwise; a
# failed test's report names both parts of its seed.

_SEED_ENV = "JAX_MXFP4_TEST_SEED"


def pytest_addoption(parser):
    parser.addoption(
        "--seed", type=int, default=None,
        help=f"base seed of the rng / jax_key fixtures (default: ${_SEED_ENV} or 0)",
    )


def _base_seed(config) -> int:
    opt = config.getoption("--seed", default=None)
    if opt is not None:
        return int(opt)
    return int(os.environ.get(_SEED_ENV, "0"))


def _test_seed(config, nodeid: str) -> tuple[int, int]:
    return _base_seed(config), zlib.crc32(nodeid.encode())


def pytest_report_header(config):
    return f"rng base seed: {_base_seed(config)} (--seed N or {_SEED_ENV}=N to change)"


@pytest.fixture
def rng(request) -> np.random.Generator:
    """A NumPy generator seeded from the base seed and this test's node id."""
    return np.random.default_rng(np.random.SeedSequence(list(_test_seed(request.config, request.node.nodeid))))


@pytest.fixture
def jax_key(request):
    """A JAX PRNG key from the same seed as ``rng`` (an independent stream)."""
    import jax

    base, crc = _test_seed(request.config, request.node.nodeid)
    seed = int(np.random.SeedSequence([base, crc]).generate_state(1, np.uint32)[0])
    return jax.random.key(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and ("rng" in getattr(item, "fixturenames", ()) or "jax_key" in getattr(item, "fixturenames", ())):
        base, crc = _test_seed(item.config, item.nodeid)
        report.sections.append(
            ("rng seed", f"base={base} (--seed {base} or {_SEED_ENV}={base} replays it), nodeid crc={crc}"))
