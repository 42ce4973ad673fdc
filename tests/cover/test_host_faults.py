"""Host-pool catalogue faults: the shortest known program shows each, and passes without it."""

import pytest

from poolfuzz.harness.program import new_engine
from poolfuzz.pools import CONFIGS
from poolfuzz.pools.host_faults import HostLoadStopsAtPoolLayerCount
from poolfuzz.pools.shortest_known import shortest_known

# A request served, retracted into the host pools and resumed: the SWA side pool holds model layers 1
# and 2, so a load bounded by its layer count (2) never loads layer 2 back.
SERVED_RETRACTED_RESUMED = [("admit", {"prompt_len": 6}), ("prefill", {"rid": 1, "chunk": 6}),
                            ("retract", {"rid": 1}), ("resume", {"node": "prefill"})]


def _fails(config, faults, program):
    engine = new_engine(config=CONFIGS[config], faults=faults)
    try:
        for op, args in program:
            getattr(engine, op)(**args)
            engine.check()
        engine.sweep()
        engine.drain()
    except AssertionError as exc:  # a poolfuzz failure
        return exc
    return None


@pytest.mark.parametrize("config", ["swa", "swa-ps4"])
def test_a_load_bounded_by_the_pool_layer_count_loses_the_side_pool_top_layer(config):
    fault = "host-load-stops-at-pool-layer-count"
    assert len(SERVED_RETRACTED_RESUMED) == shortest_known(fault, CONFIGS[config])
    failure = _fails(config, [fault], SERVED_RETRACTED_RESUMED)
    assert failure is not None and type(failure).__name__ == "StateLost"
    assert "component swa." in str(failure) and "layer 2" in str(failure), str(failure)
    assert _fails(config, [], SERVED_RETRACTED_RESUMED) is None


def test_the_bound_is_right_where_the_pool_holds_the_model_first_layers():
    """Dense: the host pool's layers are 0..n-1, so the wrong bound loads every one of them back (the
    fault applies only where layers interleave)."""
    from poolfuzz.pools.faults import get_fault

    layer_ids = CONFIGS["dense"].full_layer_ids
    assert list(layer_ids) == list(range(len(layer_ids)))
    assert not get_fault("host-load-stops-at-pool-layer-count").applies_to(CONFIGS["dense"])
    program = SERVED_RETRACTED_RESUMED
    engine = new_engine(config=CONFIGS["dense"], backup_mode="host_pool")
    pool = engine.families["prefill"].host_pools["host.full"]
    assert type(pool).load_to_device is not HostLoadStopsAtPoolLayerCount.load_to_device
    for op, args in program:
        getattr(engine, op)(**args)
        engine.check()


# A two-token request served and retracted into the host pool: a page stride one layer short puts its
# slot 0 top layer where slot 1's first layer belongs, which the host copy's checksum sees at once.
SERVED_RETRACTED = [("admit", {"prompt_len": 6}), ("prefill", {"rid": 1, "chunk": 6}), ("retract", {"rid": 1})]


@pytest.mark.parametrize("config", ["dense", "dense-ps4"])
def test_a_page_first_host_stride_one_layer_short_shows_the_neighbour_layer(config):
    fault = "host-page-stride-omits-a-layer"
    assert len(SERVED_RETRACTED) == shortest_known(fault, CONFIGS[config])
    failure = _fails(config, [fault], SERVED_RETRACTED)
    assert failure is not None and type(failure).__name__ == "StateLost", failure
    assert "component host.full.k layer 0 position 1" in str(failure) and "layer 1)" in str(failure), str(failure)
    assert _fails(config, [], SERVED_RETRACTED + [("resume", {"node": "prefill"})]) is None


def test_the_page_first_fault_keeps_the_pool_page_first_and_needs_two_layers():
    from poolfuzz.pools.faults import get_fault
    from poolfuzz.pools.host_faults import HostPageStrideOmitsALayer

    fault = get_fault("host-page-stride-omits-a-layer")
    assert fault.applies_to(CONFIGS["dense"]) and not fault.applies_to(CONFIGS["hybrid-linear"])
    engine = new_engine(config=CONFIGS["dense"], faults=["host-page-stride-omits-a-layer"])
    pool = engine.families["prefill"].host_pools["host.full"]
    assert isinstance(pool, HostPageStrideOmitsALayer)
    assert pool.k.data_ptr() == pool.k_pages.data_ptr() and pool.k_pages.shape[1] == len(pool.layer_ids)
