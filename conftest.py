"""Hypothesis profiles, chosen by HYPOTHESIS_PROFILE, and the device the tests run the pools on."""

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

# dev: the default on a laptop; modest budgets, the local example database replays failures.
settings.register_profile("dev", max_examples=40, deadline=None)
# ci: the CPU gate. Derandomized so a red build is reproducible from the log, no database to carry
# between runs, and the reproduce blob printed with every failure.
settings.register_profile(
    "ci", max_examples=40, deadline=None, derandomize=True, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
# gpu: the same suite on CUDA (the --device default becomes cuda); kernels launch asynchronously, so no deadline.
settings.register_profile("gpu", max_examples=60, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
# fuzz: long local or nightly sessions with the database on, so every failure replays later.
settings.register_profile("fuzz", max_examples=5_000, deadline=None, print_blob=True,
                          phases=list(Phase), suppress_health_check=[HealthCheck.too_slow])

_default = "ci" if os.environ.get("CI") else "dev"
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", _default)
settings.load_profile(PROFILE)


def pytest_configure(config):
    # The pools under test are tiny: torch's intra-op threads only spin against each other, and
    # under xdist (one process per core) they oversubscribe the machine tenfold.
    import torch

    torch.set_num_threads(1)
    # Hypothesis draws literals from every loaded "local" module, and which modules are local depends
    # on the clone's path and on what a worker imported first: frozen for the whole session, a seeded
    # or derandomized test draws the same examples here, in CI's fresh clone, alone or after others.
    from contextlib import ExitStack

    from poolfuzz.harness.hypothesis_compat import local_constants_frozen

    frozen = ExitStack()
    frozen.enter_context(local_constants_frozen())
    config.add_cleanup(frozen.close)


def pytest_addoption(parser):
    default = os.environ.get("POOLFUZZ_DEVICE", "cuda" if PROFILE == "gpu" else "cpu")
    parser.addoption("--device", default=default,
                     help="torch device the pools are built on: cpu, cuda or cuda:N "
                          "(default cpu; cuda under HYPOTHESIS_PROFILE=gpu)")


@pytest.fixture(scope="session")
def device(request):
    from poolfuzz.pools.family import resolve_device
    from poolfuzz.pools.errors import ConfigError

    try:
        dev = resolve_device(request.config.getoption("--device"))
    except ConfigError as exc:
        pytest.exit(str(exc), returncode=2)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...: one xdist worker per GPU
    if dev.type == "cuda" and dev.index is None and worker.startswith("gw"):
        import torch

        dev = torch.device("cuda", int(worker[2:]) % torch.cuda.device_count())
    return dev


def pytest_collection_modifyitems(config, items):
    # tests/quality ("hard bugs are really found": every catalogue fault on every config it applies to)
    # is the slow tier as a whole; `-m "not slow"` is the contributors' fast tier (README).
    quality = os.path.join(os.path.dirname(__file__), "tests", "quality") + os.sep
    for item in items:
        if str(item.path).startswith(quality):
            item.add_marker(pytest.mark.slow)
    # Probe CUDA once, after collection, never at import: CPU CI and xdist workers import cleanly.
    if not any("requires_cuda" in item.keywords for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="requires_cuda: no CUDA GPU is visible on this machine")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)
