"""Traceable contents: a row says whose data it is; poison and zeros are recognised."""

import pytest
import torch

from poolfuzz.harness.contents import (
    KIND_KV,
    KIND_STATE,
    chain_affine,
    decode_row,
    describe_row,
    fold_chain,
)
from poolfuzz.harness.ledger import ComponentSpec, build_rows, poison_rows

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]


def _spec(dtype, shape=(2, 8), name="full.k", layer=3):
    return ComponentSpec(name=name, layer=layer, space="full", dtype=dtype, row_shape=shape)


class TestRows:
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    def test_kv_rows_decode_to_their_tag(self, dtype):
        """A KV row written for (req 300, pos 1000, layer 3, full.k) reads back as exactly that."""
        rows = build_rows(_spec(dtype), kind=KIND_KV, rid=300, position=torch.tensor([1000, 1001]), chain=0,
                          device="cpu")
        tag = decode_row(rows[0])
        assert (tag.kind, tag.rid, tag.position, tag.layer) == (KIND_KV, 300, 1000, 3)
        assert describe_row(rows[1]) == "req 300 pos 1001 (full.k layer 3)"

    def test_state_rows_carry_gen_and_chain(self):
        """A recurrent-state row names its writer, the tokens consumed and the history hash."""
        spec = _spec(torch.float32, shape=(2, 4, 4), name="mamba.temporal", layer=5)
        row = build_rows(spec, kind=KIND_STATE, rid=7, position=12, chain=201, device="cpu")[0]
        assert describe_row(row) == "req 7 gen 12 chain 201"

    def test_poison_names_the_request_that_freed_the_slot(self):
        """Poison rows say which request freed the slot and when."""
        row = poison_rows(_spec(torch.bfloat16), culprit=4, step=9, n=1, device="cpu")[0]
        assert describe_row(row) == "poison (freed from req 4 at step 9)"

    def test_zeros_and_foreign_bytes(self):
        """Untouched rows read as zeros; rows poolfuzz never wrote are called out."""
        assert describe_row(torch.zeros(2, 8)).startswith("zeros")
        assert describe_row(torch.full((2, 8), 0.5)).startswith("unrecognised")

    def test_torn_rows_are_flagged(self):
        """A row whose tag survives but whose body was overwritten is reported as torn."""
        row = build_rows(_spec(torch.float32), kind=KIND_KV, rid=2, position=3, chain=0, device="cpu")[0].clone()
        row.view(-1)[-1] = (row.view(-1)[-1] + 1) % 256
        assert describe_row(row).endswith("torn (row partly overwritten)")

    def test_rows_of_different_owners_differ_everywhere(self):
        """Filler bytes depend on the owner, so most bytes of two owners' rows differ."""
        spec = _spec(torch.float32, shape=(64,))
        a = build_rows(spec, kind=KIND_KV, rid=1, position=0, chain=0, device="cpu")[0]
        b = build_rows(spec, kind=KIND_KV, rid=2, position=0, chain=0, device="cpu")[0]
        assert int((a[8:] != b[8:]).sum()) > 40


class TestChain:
    def test_affine_form_matches_the_fold(self):
        """(a*c + b) % 251 reproduces the token-by-token fold for every start chain."""
        a, b = chain_affine(5, 3, 11)
        for c in range(251):
            assert (a * c + b) % 251 == fold_chain(c, 5, 3, 11)

    def test_folding_in_pieces_equals_folding_at_once(self):
        """Decoding one token at a time and prefilling a chunk give the same history hash."""
        once = fold_chain(0, 9, 0, 10)
        pieces = 0
        for start in range(10):
            pieces = fold_chain(pieces, 9, start, start + 1)
        assert once == pieces

    def test_different_histories_differ(self):
        """Another request's tokens give another hash (a resumed request on a foreign state shows)."""
        assert fold_chain(0, 1, 0, 8) != fold_chain(0, 2, 0, 8)


def test_the_shared_ledger_tells_shapes_apart():
    """One ledger serves every config in the process: the same component, layer and dtype with
    another row shape (another head size) has other expected checksums, not the first one's."""
    from poolfuzz.harness.ledger import Ledger

    def spec(name, space, dtype, shape):
        return ComponentSpec(name=name, layer=1, space=space, dtype=dtype, row_shape=shape)

    narrow, wide = spec("full.k", "full", torch.bfloat16, (2, 4)), spec("full.k", "full", torch.bfloat16, (2, 8))
    shared = Ledger()
    shared.kv(narrow, owner=1, start=0, end=4)
    assert torch.equal(shared.kv(wide, owner=1, start=0, end=4), Ledger().kv(wide, owner=1, start=0, end=4))

    short, long = spec("mamba.conv0", "mamba", torch.float32, (4, 3)), spec("mamba.conv0", "mamba", torch.float32, (6, 3))
    history = ((1, 0, 3),)
    shared.state(short, history)
    assert shared.state(long, history) == Ledger().state(long, history)
