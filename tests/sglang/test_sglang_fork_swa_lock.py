"""A fork's SWA budget counts what the tree can evict with the fork's hit locked
(adapters/sglang/tree/tree_reference.py).

The fork locks its hit before it allocates, and the lock protects the hit's window of SWA. The reference
once counted the tree's evictable SWA without that lock and predicted a fork SGLang's pools refused (a false
alarm found on swa, seed 3, after a host_pool resume). Program shrunk from that run.
"""

from __future__ import annotations

import pytest

from poolfuzz.pools.config import CONFIGS


def test_a_fork_after_a_host_pool_resume_waits_as_the_locked_tree_says(api):
    from poolfuzz.adapters.sglang import build_family
    from poolfuzz.adapters.sglang.host_tier.host import host_pool_problem
    from poolfuzz.adapters.sglang.tree.trees import tree_problem
    from poolfuzz.harness.engine import Engine

    config = CONFIGS["swa"]
    for problem in (tree_problem(api, config), host_pool_problem(api, config)):
        if problem:
            pytest.skip(f"sglang {api.version}: {problem}")
    e = Engine(config=config, family_factory=build_family, backup_mode="host_pool")
    rid = e.admit(17)
    e.prefill(rid, 17)
    e.decode_speculative(rid, 3, 2)
    e.decode_speculative(rid, 1, 1)
    e.retract(rid)
    assert e.resume("prefill") == rid
    e.check()
    fam = e.families["prefill"]
    assert e.fork(rid, 1) is None  # SGLang's pools are short of SWA once the hit is locked; so says the reference
    e.check()
    prefix = e.requests[rid].kv.kv_committed_len
    _, _, swa_locked = fam.protocol.peek_hit(fam, rid, prefix, prefix + 1)
    assert swa_locked < fam.tree_swa()[1]  # the hit's lock protects part of the tree's evictable window
