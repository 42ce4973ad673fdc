"""PD transfer over SGLang's own registration (get_contiguous_buf_infos, setup_state_kv_args), moved by descriptor."""

from __future__ import annotations

import pytest

from poolfuzz.harness.engine import Engine
from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.pools.config import CONFIGS


def _engine(api, name):
    from poolfuzz.adapters.sglang import build_family, unsupported_reason
    from poolfuzz.adapters.sglang.disaggregation.pd import pd_problem

    why = unsupported_reason(CONFIGS[name]) or pd_problem(api)
    if why:
        pytest.skip(f"sglang {api.version}: {why}")
    return Engine(config=CONFIGS[name], family_factory=build_family)


def _transferred(e, prompt=9):
    rid = e.admit(prompt)
    e.prefill(rid, prompt)
    e.check()
    assert e.transfer(rid)
    e.check()  # every component of the request is compared on the decode node here
    return rid


@pytest.mark.parametrize(("name", "state_types"), [
    ("dense", ()), ("dense-ps4", ()), ("swa", ("SWA",)), ("hybrid-linear", ("MAMBA",)),
    ("swa-ssm-ps4", ("SWA", "MAMBA")), ("mla", ()), ("hybrid-spec", ("MAMBA",)),
])
def test_a_transferred_request_holds_its_state_on_the_decode_node(api, name, state_types):
    e = _engine(api, name)
    rid = _transferred(e)
    assert e.requests[rid].node == "decode"
    assert e.log[-1].outcome == f"state {list(state_types)}"
    e.decode([rid])
    e.check()


def test_a_kv_item_length_of_half_a_page_is_caught(api, monkeypatch):
    """A registration whose item length is half the real one moves half of every page, from the wrong place."""
    e = _engine(api, "dense-ps4")
    pool_cls = type(e.families["prefill"].sg_kv_pool)
    real = pool_cls.get_contiguous_buf_infos
    monkeypatch.setattr(pool_cls, "get_contiguous_buf_infos",
                        lambda self: (lambda p, lens, items: (p, lens, [i // 2 for i in items]))(*real(self)))
    for fam in e.families.values():
        fam.__dict__.pop("_pd_args", None)
    with pytest.raises(PoolfuzzFailure) as info:
        _transferred(e)
    assert info.value.divergence.space == "full", info.value


def test_a_registration_of_a_temporary_tensor_is_raised_not_copied_into(api, monkeypatch):
    """0.5.14-0.5.15's FP4 MHA pool registers the addresses of dequantised copies that are freed at once; a
    transfer engine writes there anyway. Copying into this process's heap there corrupted it (glibc abort),
    so the transfer checks every descriptor against the node's live pool buffers and raises instead."""
    import torch

    from poolfuzz.adapters.sglang.host_tier.kernel_io import IllegalAddress

    e = _engine(api, "dense")
    pool_cls = type(e.families["decode"].sg_kv_pool)
    real = pool_cls.get_contiguous_buf_infos
    scratch = torch.zeros(1 << 16, dtype=torch.uint8)  # alive, but no pool's: a registration must not point here
    monkeypatch.setattr(pool_cls, "get_contiguous_buf_infos",
                        lambda self: (lambda p, lens, items: ([scratch.data_ptr()] + list(p[1:]), lens, items))(*real(self)))
    for fam in e.families.values():
        fam.__dict__.pop("_pd_args", None)
    rid = e.admit(5)
    e.prefill(rid, 5)
    with pytest.raises(IllegalAddress, match="no live pool buffer"):
        e.transfer(rid)
    assert not scratch.any()  # nothing was written there


def test_a_mamba_registration_without_the_temporal_state_is_caught(api, monkeypatch):
    """The decode node's slot keeps whatever it held if the temporal state is not registered for transfer."""
    e = _engine(api, "hybrid-linear")
    mamba_cls = type(e.families["prefill"].sg_req_pool.mamba_pool)
    if not hasattr(mamba_cls, "_iter_transfer_state_entries"):
        pytest.skip("this release lists its transfer entries inline (no _iter_transfer_state_entries to narrow)")
    real = mamba_cls._iter_transfer_state_entries
    monkeypatch.setattr(mamba_cls, "_iter_transfer_state_entries",
                        lambda self: (entry for entry in real(self) if entry[0] != "temporal"))
    with pytest.raises(PoolfuzzFailure) as info:
        _transferred(e)
    assert info.value.divergence.component == "mamba.temporal", info.value
