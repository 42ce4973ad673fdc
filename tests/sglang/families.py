"""A built sglang family for a named config, or the test skipped with the reason the release gives."""

import pytest

from poolfuzz.pools.config import CONFIGS


def family_or_skip(api, name):
    from poolfuzz.adapters.sglang import build_family, unsupported_reason

    why = unsupported_reason(CONFIGS[name])
    if why:
        pytest.skip(f"sglang {api.version}: {why}")
    return build_family(CONFIGS[name])
