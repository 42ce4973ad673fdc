"""A storage tier below the host (HiCache's L3): the page audit (harness/storage_audit.py) and the
engine's per-example close of its families (what stops HiCache's storage threads)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import StateLost
from poolfuzz.harness.machine import machine_for
from poolfuzz.pools.components import Component
from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.family import build_family
from poolfuzz.pools.storage_tier import StoredPage


def _stored_copy(engine, rid: int, positions: list[int]) -> list[Component]:
    """What a storage tier would keep of ``rid``'s full-attention KV at ``positions``: its device rows."""
    fam = engine.families["prefill"]
    req = engine.requests[rid]
    slots = torch.as_tensor(engine.lookup.tokens(fam, req.kv.req_pool_idx, 0, req.kv.kv_committed_len))[positions]
    return [Component(name=f"host.{c.name}", layer=c.layer, space="l3", tensor=c.tensor[slots].clone())
            for c in fam.components() if c.space == "full"]


def _family_with_pages(pages: list):
    """The built-in family with a storage tier that holds ``pages`` (each handed to the checks once)."""

    def factory(config, **kwargs):
        fam = build_family(config, **kwargs)
        fam.take_stored_pages = lambda: [pages.pop(0)] if pages else []
        return fam

    return factory


def _prefilled(pages: list) -> tuple[Engine, int]:
    engine = Engine(config=CONFIGS["dense"], family_factory=_family_with_pages(pages))
    rid = engine.admit(6)
    engine.prefill(rid, 6)
    return engine, rid


class TestPageAudit:
    def test_a_page_that_holds_its_keys_positions_passes(self):
        pages: list = []
        engine, rid = _prefilled(pages)
        pages.append(StoredPage(key="k0", first_position=2, owners=(rid, rid),
                                components=tuple(_stored_copy(engine, rid, [2, 3]))))
        engine.check()
        assert not pages  # the audit read it

    def test_a_page_stored_under_another_pages_key_is_named(self):
        pages: list = []
        engine, rid = _prefilled(pages)
        # the rows of positions 4-5, under the key of positions 2-3
        pages.append(StoredPage(key="0123456789abcdef", first_position=2, owners=(rid, rid),
                                components=tuple(_stored_copy(engine, rid, [4, 5]))))
        with pytest.raises(StateLost, match=r"req 1 stored in L3 \(page key 0123456789ab, row 0 of positions 2-3\); "
                                            r"component host\.full\.k layer 0 position 2; slot 0 holds req 1 pos 4 "
                                            r"\(full\.k layer 0\) \(expected req 1 pos 2\)") as info:
            engine.check()
        assert info.value.divergence.check == "storage" and info.value.divergence.space == "l3"

    def test_a_page_with_a_layer_missing_names_the_layer(self):
        pages: list = []
        engine, rid = _prefilled(pages)
        comps = _stored_copy(engine, rid, [0, 1])
        last = max(c.layer for c in comps)
        for c in comps:
            if c.layer == last and c.name == "host.full.v":
                c.tensor.zero_()
        pages.append(StoredPage(key="k0", first_position=0, owners=(rid, rid), components=tuple(comps)))
        with pytest.raises(StateLost, match=rf"component host\.full\.v layer {last} position 0; slot 0 holds zeros"):
            engine.check()


class TestClose:
    def test_the_engine_closes_each_family_that_holds_something(self):
        closed = []

        def factory(config, **kwargs):
            fam = build_family(config, **kwargs)
            fam.close = lambda: closed.append(fam)
            return fam

        engine = Engine(config=CONFIGS["dense"], family_factory=factory)
        engine.close()
        assert closed == list(engine.families.values())

    def test_families_without_a_close_are_left_alone(self):
        engine = Engine(config=CONFIGS["dense"])
        assert all(caps.close is None for caps in engine.caps.values())  # nothing of theirs to call
        engine.close()
        engine.close()  # once only, and a second call is harmless
        assert engine.closed

    def test_every_example_of_the_machine_closes_its_engine(self):
        built, closed = [], []

        def factory(config, **kwargs):
            fam = build_family(config, **kwargs)
            built.append(fam)
            fam.close = lambda: closed.append(fam)
            return fam

        machine = machine_for(CONFIGS["dense"], family_factory=factory)
        run_state_machine_as_test(machine, settings=settings(
            max_examples=5, stateful_step_count=5, deadline=None, derandomize=True, database=None,
            suppress_health_check=list(HealthCheck)))
        assert built and closed == built
