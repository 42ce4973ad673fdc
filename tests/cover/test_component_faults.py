"""One five-token request moved the way a pool class's catalogue fault breaks it (retracted and resumed, or
sent to the decode node): with the fault the report names the component left behind, and without it the
same program passes. One table for every pool class whose buffers are components of their own."""

from __future__ import annotations

import pytest

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.pools.config import CONFIGS


def _k_only_index(name):
    return {("msa.index_k", layer) for layer in CONFIGS[name].msa_layer_ids("K")}


# (config, fault, path, does the divergence name the component the fault loses?)
CASES = [
    *[(name, "fp4-mha-copy-drops-scales", "retract", lambda d, n: d.component in ("full.k_scale", "full.v_scale"))
      for name in ("dense-fp4", "dense-fp4-ps4")],
    *[(name, "fp4-copy-drops-scales", "retract", lambda d, n: d.component == "mla.scale")
      for name in ("mla-fp4", "mla-fp4-ps4")],
    *[(name, "msa-copy-skips-k-only-index", "retract", lambda d, n: (d.component, d.layer) in _k_only_index(n))
      for name in ("minimax-sparse", "minimax-sparse-ps4", "minimax-sparse-konly")],
    *[(name, "hybrid-mla-pd-item-of-head-width", "transfer", lambda d, n: d.component in ("mla.latent", "mla.rope"))
      for name in ("mla-ssm", "mla-ssm-ps4")],
    ("dsa-ssm-ps64", "pd-drops-dsa-index", "transfer", lambda d, n: d.component.startswith("dsa.index_")),
    ("dsa-ssm-ps64", "dsa-copy-drops-index", "retract", lambda d, n: d.component.startswith("dsa.index_")),
]


def _move(e: Engine, path: str) -> None:
    rid = e.admit(5)
    e.check()
    e.prefill(rid, 5)
    e.check()
    if path == "transfer":
        e.transfer(rid)
    else:
        node = e.requests[rid].node
        e.retract(rid)
        e.check()
        e.resume(node)
    e.check()


@pytest.mark.parametrize(("name", "fault", "path", "names_it"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_the_fault_is_caught_and_names_what_it_lost(name, fault, path, names_it):
    with pytest.raises(PoolfuzzFailure) as info:
        _move(Engine(config=CONFIGS[name], faults=(fault,)), path)
    assert names_it(info.value.divergence, name), info.value


@pytest.mark.parametrize(("name", "path"), sorted({(c[0], c[2]) for c in CASES}))
def test_the_same_program_passes_without_the_fault(name, path):
    e = Engine(config=CONFIGS[name])
    _move(e, path)
    e.sweep()
    e.drain()
    e.check()
