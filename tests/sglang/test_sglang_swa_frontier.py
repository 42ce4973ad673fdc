"""SGLang 0.5.22's SWA frontier at a window that is not a whole number of pages (a real defect, fixed in 0.5.23).

``free_swa_out_of_window_slots`` frees a request's SWA before its tree insert. 0.5.22 kept ``max(window, page)``
tokens live before the frontier; with window 6 and 4-token pages that is 6, floored to a page boundary, so
the insert of the first 8 tokens has only 4 live SWA tokens: the tree's own match rejects the node it just
inserted, the request holds pages the tree also holds, and ``cache_unfinished_req`` later asserts
``new_prefix_len <= len(new_indices)``. 0.5.23 rounds the kept span up to whole pages (8). A window like
Phi-3's 2047 is not a page multiple either. On 0.5.22 this test fails (the request's protected prefix is 0),
and ``poolfuzz run --family sglang --config swa-ps4`` reports it in two steps as an ownership violation.
"""

from __future__ import annotations

import pytest

from poolfuzz.pools.config import CONFIGS


def _engine():
    from poolfuzz.adapters.sglang import build_family
    from poolfuzz.adapters.sglang.api import load
    from poolfuzz.adapters.sglang.tree.trees import tree_problem
    from poolfuzz.harness.engine import Engine

    problem = tree_problem(load(), CONFIGS["swa-ps4"])
    if problem:
        pytest.skip(f"this release's tree is not driven for swa-ps4: {problem}")
    return Engine(config=CONFIGS["swa-ps4"], family_factory=build_family)


def test_the_release_keeps_a_whole_window_live_under_its_first_insert(api):
    config = CONFIGS["swa-ps4"]
    assert config.sliding_window % config.page_size != 0, "the case needs a window that is not whole pages"
    e = _engine()
    rid = e.admit(11)
    e.prefill(rid, 11)
    e.check()
    assert e.requests[rid].kv.cache_protected_len == 8  # the tree matched its own insert, and locked it

