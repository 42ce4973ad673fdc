"""Capabilities are one typed record, read once: a misspelt or mistyped one is an error, not a default."""

from __future__ import annotations

import pytest

from poolfuzz.errors import ConfigError
from poolfuzz.harness.contract import check_interface
from poolfuzz.harness.engine import Engine
from poolfuzz.pools.capabilities import Capabilities, capabilities_of, factory_capabilities
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.family import build_family


def _family(**attrs):
    family = build_family(CONFIGS["dense"])
    for name, value in attrs.items():
        object.__setattr__(family, name, value)
    return family


def test_the_builtin_family_declares_its_own():
    caps = capabilities_of(build_family(CONFIGS["swa-ssm"]))
    assert caps.supports_tree_drafts and not caps.supports_next_turn
    assert caps.flush_cache is not None and caps.idle_problem is None
    assert caps.finish is not None  # the protocol groups a finished request's frees


def test_a_family_that_declares_nothing_gets_the_documented_defaults():
    class Bare:
        pass

    assert capabilities_of(Bare()) == Capabilities()


def test_a_misspelt_capability_is_named_when_the_family_is_built():
    family = _family(suports_fork=False, supports_forks=False)
    with pytest.raises(ConfigError, match=r"declares supports_forks, which is no capability \(known: supports_fork"):
        capabilities_of(family)
    assert any("supports_forks" in p for p in check_interface(family))  # the contract test names it too

    def factory(config, **kw):
        return _family(supports_forks=False)

    with pytest.raises(ConfigError, match="supports_forks"):
        Engine(config=CONFIGS["dense"], family_factory=factory)


def test_a_mistyped_flag_is_an_error():
    with pytest.raises(ConfigError, match=r"supports_transfer must be True or False, got 'no'"):
        capabilities_of(_family(supports_transfer="no"))
    with pytest.raises(ConfigError, match="shared_unit_spaces must be a tuple"):
        capabilities_of(_family(shared_unit_spaces="full"))


def test_factory_capabilities_and_their_misspellings():
    def factory(config, **kw):
        return build_family(config, **kw)

    assert factory_capabilities(factory).unsupported_reason is None
    factory.builds_per_node = True
    assert factory_capabilities(factory).builds_per_node
    factory.unsuported_reason = lambda c: None
    with pytest.raises(ConfigError, match=r"declares unsuported_reason, which is no factory capability"):
        factory_capabilities(factory)
