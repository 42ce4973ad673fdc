"""What the scheduler path asks of a release where SGLang 0.5.16 and 0.5.17 answer otherwise than 0.5.18 on
(``adapters/sglang/compat/``): stand-ins shaped as each release's objects, no SGLang needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from poolfuzz.adapters.sglang import compat


class _Context0517:
    """0.5.17's RuntimeContext: config namespaces, but no ``is_config_namespace_published``; ``config_bag`` fails
    closed until a ServerArgs is projected."""

    def __init__(self, bags=None):
        self._bags = bags

    def config_bag(self, name):
        if not self._bags or name not in self._bags:
            raise ValueError(f"config namespace {name!r} not published")
        return self._bags[name]


class _Context0518(_Context0517):
    def is_config_namespace_published(self, name):
        return bool(self._bags) and name in self._bags


class _Context0516:
    """0.5.16's RuntimeContext: no config namespaces at all; ``server_args`` raises ValueError until one is set."""

    def __init__(self, bags=None):
        self._args = None if bags is None else SimpleNamespace(**bags)

    @property
    def server_args(self):
        if self._args is None:
            raise ValueError("Global server args is not set yet!")
        return self._args


def test_on_0_5_16_the_published_server_args_are_every_namespace():
    assert not compat.namespace_published(_Context0516(), "memory")
    assert compat.namespace_published(_Context0516({"page_size": 1}), "memory")


@pytest.mark.parametrize("context_cls", [_Context0517, _Context0518])
def test_a_namespace_is_published_only_once_a_server_is(context_cls):
    assert not compat.namespace_published(context_cls(), "memory")
    published = context_cls({"memory": SimpleNamespace()})
    assert compat.namespace_published(published, "memory")
    assert not compat.namespace_published(published, "disagg")


def test_the_token_ratio_tracker_is_built_as_the_release_builds_it():
    """0.5.18 on: ``from_config()`` reads the context; a tracker without it is the older one (``from_server_args``),
    which needs SGLang's published arguments, so only the newer form is taken here without SGLang."""
    built = SimpleNamespace()

    class Tracker:
        @classmethod
        def from_config(cls):
            return built

    assert compat.token_ratio(Tracker) is built


def test_the_host_tier_is_read_from_a_group_wherever_the_release_keeps_it():
    """A tree's host pools: 0.5.20 on keep a ``host_pool_group``; 0.5.17 keeps the group as its
    ``token_to_kv_pool_host``; 0.5.18's HiRadixCache has one host pool mirroring one device pool."""
    entry = SimpleNamespace(host_pool="host-kv", device_pool="device-kv")
    group = SimpleNamespace(entries=[entry])
    assert compat.host_tier_pools(SimpleNamespace(host_pool_group=group)) == [("host-kv", "device-kv")]
    assert compat.host_tier_pools(SimpleNamespace(token_to_kv_pool_host=group)) == [("host-kv", "device-kv")]
    single = SimpleNamespace(device_pool="device-kv")
    assert compat.host_tier_pools(SimpleNamespace(token_to_kv_pool_host=single)) == [(single, "device-kv")]
    assert compat.host_tier_pools(SimpleNamespace()) == []
