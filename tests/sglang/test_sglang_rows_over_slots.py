"""A request pool whose row -> state-slot table is shorter than its rows (SGLang 0.5.9 and 0.5.10 size it by the
state slots) is a pool no server of those releases builds: their model runner caps the rows at the slots over its
mamba ratio. The family is built as those servers size it, a state slot for every row, and its reference counts
that (the compat table's IndexError at the first admission on hybrid-linear and swa-ssm, judged an adapter gap)."""

from types import SimpleNamespace

import pytest
import torch

from poolfuzz.pools.config import CONFIGS


def test_a_table_shorter_than_the_rows_names_the_rows():
    from poolfuzz.adapters.sglang.pools.request_pool import rows_over_slots

    assert rows_over_slots(SimpleNamespace(size=5, req_index_to_mamba_index_mapping=torch.zeros(4))) == 5
    assert rows_over_slots(SimpleNamespace(size=5, req_index_to_mamba_index_mapping=torch.zeros(6))) == 0
    assert rows_over_slots(SimpleNamespace(size=5)) == 0  # a plain request pool keeps no state slots


def test_a_recurrent_server_gives_every_row_a_state_slot_in_its_table(api, scheduling):
    from poolfuzz.adapters.sglang.scheduler.servers import build_driver, unsupported_reason

    c = CONFIGS["hybrid-linear"]
    if why := unsupported_reason(c):
        pytest.skip(why)
    pool = build_driver(c).family.sg_req_pool
    assert pool.req_index_to_mamba_index_mapping.shape[0] >= pool.size
