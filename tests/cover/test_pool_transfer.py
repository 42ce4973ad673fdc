"""PD transfer: main KV by page, then each state component, from a prefill family into a pre-allocated decode family."""

import pytest
import torch

from poolfuzz.pools import CONFIGS, build_family
from poolfuzz.pools.protocol import floor_page
from poolfuzz.pools.request import ReqKv
from poolfuzz.pools.transfer import PDTransfer, TransferMismatch, TransferRecord

from pool_patterns import carried, pattern, rows_of

POISON = 253  # decode rows start out holding this; patterns only use 1..250
LENGTH = 21  # committed prompt positions: past every sliding window, not page-aligned




def window_start(config, length: int) -> int:
    return max(0, length - config.sliding_window) if config.has_swa else 0


def prefill(family, rid: int, length: int) -> ReqKv:
    """Admit, extend and run the prefill forward: every owned row holds the request's pattern."""
    req = ReqKv(rid=rid, seqlen=length + 1)
    family.protocol.admit(req, family)
    family.protocol.extend(req, family, length)
    family.protocol.run_deferred_mamba_ops([req], family)
    req.kv_committed_len = length
    for i, comp in enumerate(carried(family)):
        pos, rows = rows_of(family, comp, req, list(range(length)))
        comp.tensor[comp.at(torch.tensor(rows))] = pattern(i, rid, pos, comp.row_shape, comp.tensor.dtype)
    return req


def mismatches(family, req: ReqKv, rid: int, length: int) -> list[str]:
    """Components of the decode request that differ from the prefill request ``rid``'s pattern."""
    bad = []
    for i, comp in enumerate(carried(family)):
        positions = list(range(window_start(family.config, length) if comp.space == "swa" else 0, length))
        pos, rows = rows_of(family, comp, req, positions)
        if pos != positions and comp.space != "mamba":
            bad.append(f"{comp}: positions {sorted(set(positions) - set(pos))} unmapped")
            continue
        if not torch.equal(comp.tensor[comp.at(torch.tensor(rows))], pattern(i, rid, pos, comp.row_shape, comp.tensor.dtype)):
            bad.append(repr(comp))
    return bad


def decode_family(name: str):
    """A decode family whose first rows and slots are taken, and every row poisoned."""
    family = build_family(CONFIGS[name], device="cpu", backup_mode="cpu_tensor")
    other = ReqKv(rid=50, seqlen=6)
    family.protocol.pre_alloc(other, family, fill_len=5)  # so decode slots differ from prefill's
    for comp in carried(family):
        comp.tensor[:] = POISON
    return family


def expected_state_items(config, length: int) -> tuple[tuple[str, str, int], ...]:
    ps = config.page_size
    swa_pages = -(-(length - floor_page(window_start(config, length), ps)) // ps)
    items = []
    if config.has_swa:
        items.append(("SWA", "kv_pool", swa_pages))
    if config.has_mamba:
        items.append(("MAMBA", "kv_pool" if not config.has_swa else "req_pool", 1))
    if config.attention == "dsa":
        items.append(("DSA", "kv_pool", -(-length // ps)))  # the index cache's pages
    if config.kv_scale_block or config.kv_quant == "fp4_mx_block16":  # MXFP8's and FP4 MLA's scale rows
        items.append(("BLOCK_SCALE", "kv_pool", -(-length // ps)))
    if config.attention == "msa":  # MiniMax's index caches, by the page of main KV
        items.append(("MINIMAX_INDEX", "kv_pool", -(-length // ps)))
    return tuple(items)


class TestPDTransfer:
    @pytest.mark.parametrize("name", list(CONFIGS))
    def test_every_component_arrives(self, name):
        """Full KV, the SWA window and the recurrent state land in the decode request's own rows."""
        config = CONFIGS[name]
        src_family = build_family(config, device="cpu", backup_mode="cpu_tensor")
        dst_family = decode_family(name)
        src = prefill(src_family, rid=7, length=LENGTH)
        dst = ReqKv(rid=7, seqlen=LENGTH + 1)
        dst_family.protocol.pre_alloc(dst, dst_family, fill_len=src.kv_committed_len)
        assert mismatches(dst_family, dst, 7, LENGTH) != []  # nothing has arrived yet
        record = src_family.transfer.transfer(src=src, src_family=src_family, dst=dst, dst_family=dst_family)
        assert isinstance(record, TransferRecord)
        assert record.kv_pages == -(-LENGTH // config.page_size)
        assert record.state_items == expected_state_items(config, LENGTH)
        assert mismatches(dst_family, dst, 7, LENGTH) == []
        # The decode slots really differ from the prefill slots, so correspondence was by position.
        assert not torch.equal(src_family.req_pool.read(src.req_pool_idx, 0, LENGTH),
                               dst_family.req_pool.read(dst.req_pool_idx, 0, LENGTH))

    @pytest.mark.parametrize("name", ["swa-ssm", "swa-ssm-ps4"])
    def test_swa_ssm_state_comes_from_the_request_pool_fallback(self, name):
        """SWAKVPool knows nothing of mamba: MAMBA is appended after SWA from the request pool."""
        family = build_family(CONFIGS[name], device="cpu")
        assert PDTransfer().state_components(family) == [("SWA", "kv_pool"), ("MAMBA", "req_pool")]
        src = prefill(family, rid=3, length=LENGTH)
        dst_family = decode_family(name)
        dst = ReqKv(rid=3, seqlen=LENGTH + 1)
        dst_family.protocol.pre_alloc(dst, dst_family, fill_len=LENGTH)
        record = family.transfer.transfer(src=src, src_family=family, dst=dst, dst_family=dst_family)
        assert record.state_types == ("SWA", "MAMBA")
        assert record.state_items[1] == ("MAMBA", "req_pool", 1)

    @pytest.mark.parametrize(("name", "components"), [
        ("dense", []),
        ("swa", [("SWA", "kv_pool")]),
        ("hybrid-linear", [("MAMBA", "kv_pool")]),
        ("mla", []),
        ("dsa-ps4", [("DSA", "kv_pool")]),
        ("fp8-scaled", [("BLOCK_SCALE", "kv_pool")]),
    ])
    def test_state_components_per_pool(self, name, components):
        """Dense sends no state, SWA its window, hybrid-linear MAMBA from its own KV pool."""
        assert PDTransfer().state_components(build_family(CONFIGS[name], device="cpu")) == components

    def test_mismatched_state_types_are_refused(self):
        """A prefill and a decode family with different state components cannot transfer."""
        # Same main KV layout (one full layer, bfloat16), but swa-ssm also sends MAMBA.
        src_family = build_family(CONFIGS["swa"].replace(name="swa-bf16", kv_dtype="bfloat16"), device="cpu")
        dst_family = build_family(CONFIGS["swa-ssm"], device="cpu")
        src = prefill(src_family, rid=1, length=LENGTH)
        dst = ReqKv(rid=1, seqlen=LENGTH + 1)
        dst_family.protocol.pre_alloc(dst, dst_family, fill_len=LENGTH)
        with pytest.raises(TransferMismatch, match="state types differ"):
            src_family.transfer.transfer(src=src, src_family=src_family, dst=dst, dst_family=dst_family)

    def test_decode_mamba_slot_is_not_cleared_before_transfer(self):
        """The decode slot of a pre-allocated request keeps its stale contents until the transfer writes it."""
        dst_family = decode_family("hybrid-linear")
        dst = ReqKv(rid=1, seqlen=LENGTH + 1)
        dst_family.protocol.pre_alloc(dst, dst_family, fill_len=LENGTH)
        temporal = dst_family.req_pool.mamba_pool.temporal
        assert set(temporal[:, dst.mamba_pool_idx].unique().tolist()) == {POISON}
