"""Helpers of the SGLang tests: the installed release, and a session-keeping server or the test skipped."""

import pytest

from poolfuzz.pools.config import CONFIGS


def release(api):
    """The installed release as a comparable version (the anchored tests pin each release's verdict)."""
    from packaging.version import Version

    return Version(api.version)


def session_driver_or_skip(scheduling, name):
    """A scheduler-path driver of the named config whose server keeps streaming sessions, or the test skipped (the
    release's server refuses the config, with its reason, or keeps no sessions)."""
    from poolfuzz.errors import ConfigError

    try:
        driver = scheduling.SglangSchedulerDriver(CONFIGS[name])
    except ConfigError as exc:
        pytest.skip(str(exc))
    if not driver.streaming_sessions:
        pytest.skip("the scheduler path drives streaming sessions on releases with one global ServerArgs and "
                    "--enable-streaming-session (0.5.10 to 0.5.15)")
    return driver
