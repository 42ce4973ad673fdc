"""A request pool whose row -> state-slot table is shorter than its rows (SGLang 0.5.9 and 0.5.10 size it by the
state slots) is a pool no server of those releases builds: their model runner caps the rows at the slots over its
mamba ratio. The family is built as those servers size it, a state slot for every row, and its reference counts
that (the compat table's IndexError at the first admission on hybrid-linear and swa-ssm, judged an adapter gap)."""

from types import SimpleNamespace

import torch

from poolfuzz.pools.config import CONFIGS


def test_a_table_shorter_than_the_rows_names_the_rows():
    from poolfuzz.adapters.sglang.pools.request_pool import rows_over_slots

    assert rows_over_slots(SimpleNamespace(size=5, req_index_to_mamba_index_mapping=torch.zeros(4))) == 5
    assert rows_over_slots(SimpleNamespace(size=5, req_index_to_mamba_index_mapping=torch.zeros(6))) == 0
    assert rows_over_slots(SimpleNamespace(size=5)) == 0  # a plain request pool keeps no state slots


def test_a_recurrent_family_gives_every_row_a_state_slot_in_its_table(api):
    from poolfuzz.adapters.sglang import build_family
    from poolfuzz.adapters.sglang.tree.trees import tree_sized

    c = CONFIGS["hybrid-linear"]
    family = build_family(c)
    pool = family.sg_req_pool
    assert pool.req_index_to_mamba_index_mapping.shape[0] >= pool.size == c.request_rows
    # the config as the pools path sizes it (for its tree, where it has one), its slots raised to the rows only where
    # the release's table would have been shorter: nothing else of the config moves
    sized = tree_sized(api, c)
    assert family.config in (sized, sized.replace(mamba_slots=c.request_rows)), family.config
