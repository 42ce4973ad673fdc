"""The model-runner stand-in of the SGLang scheduler path: what a forward does with the KV pool for a ScheduleBatch.

:class:`ModelRunner` does with each batch what SGLang's model runner and attention backend do with the KV cache.
Before the forward it checks that every position each request attends to (``req_to_token[row, :prefix]`` for an
extend, ``[row, :seq_len - 1]`` for a decode) holds, in every layer, the K and V of exactly the request's tokens up
to it; it then writes the K and V of the scheduled positions at the batch's ``out_cache_loc`` through the pool's
own write door (``set_kv_buffer``, ``writes.write_rows``), and samples one token per request, determined by the
tokens so far. Contents derive from tokens alone (``pools.token_chain``), never from SGLang's bookkeeping, so a
radix-tree hit's slots must hold the prefix's own KV, whoever computed it.

A slot's K (or V) row holds its 64-bit tag in its first eight bytes, the rest zero; the check reads the row back
through the pool's read door (``get_key_buffer`` / ``get_value_buffer``, ``reads.read_door``), in place.
"""

from __future__ import annotations

import torch

from poolfuzz.adapters.sglang.reads import read_door
from poolfuzz.adapters.sglang.writes import write_rows
from poolfuzz.pools.errors import LostKv
from poolfuzz.pools.token_chain import COMPONENTS, Tokens, sampled_token, tag

TAG_BYTES = 8


class ModelRunner:
    """The forward of a dense MHA model over SGLang's pools (see the module)."""

    def __init__(self, *, kv_pool, req_to_token_pool, layers: tuple[int, ...], vocab: int):
        self.kv_pool = kv_pool
        self.req_to_token = req_to_token_pool.req_to_token
        self.layers = layers
        self.vocab = vocab
        self.tokens: dict[str, Tokens] = {}  # req id -> its tokens (prompt, then the samples it was given)
        self.writers: dict[int, tuple[str, int]] = {}  # a tag written -> (req id, position): whose data it is
        self.given: dict[str, int] = {}  # req id -> tokens the model sampled for it (each kept once by SGLang)
        self.step = 0
        raw = kv_pool.k_buffer[0]
        self.row_bytes = raw[0].numel() * raw.element_size()
        if self.row_bytes < TAG_BYTES:
            raise ValueError(f"a K row of {self.row_bytes} bytes cannot hold a {TAG_BYTES}-byte tag")

    # --- rows ----------------------------------------------------------------------------------
    def _rows(self, tags: list[int]) -> torch.Tensor:
        """``[len(tags), heads, head_dim]`` rows of the pool's stored dtype, each tag in its first bytes."""
        raw = self.kv_pool.k_buffer[0]
        out = torch.zeros(len(tags), self.row_bytes, dtype=torch.uint8)
        if tags:
            out[:, :TAG_BYTES] = torch.tensor(tags, dtype=torch.int64).view(torch.uint8).view(len(tags), TAG_BYTES)
        return out.view(raw.dtype).view(len(tags), *raw.shape[1:])

    def _buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool = self.kv_pool
        return (read_door(pool, "get_key_buffer", layer, pool.k_buffer[layer]),
                read_door(pool, "get_value_buffer", layer, pool.v_buffer[layer]))

    @staticmethod
    def _tag_of(buffer: torch.Tensor, slot: int) -> int:
        return int(buffer[slot].reshape(-1).view(torch.uint8)[:TAG_BYTES].view(torch.int64)[0])

    # --- the forward ---------------------------------------------------------------------------
    def forward(self, batch) -> list[int]:
        """Check what the batch's requests attend to, write their new positions, return one token per request."""
        self.step += 1
        rows = batch.req_pool_indices_cpu.tolist()
        seq_lens = batch.seq_lens_cpu.tolist()
        extend = batch.forward_mode.is_extend()
        starts = list(batch.prefix_lens) if extend else [s - 1 for s in seq_lens]
        writes: list[tuple[str, int, int]] = []  # (req id, position, slot)
        loc = batch.out_cache_loc.tolist()
        fed = []  # the token ids the forward computes, request by request
        for req, row, start, end in zip(batch.reqs, rows, starts, seq_lens):
            tokens = self.tokens[req.rid]
            self._sync(req, tokens)
            if end > len(tokens.ids):
                raise AssertionError(f"req {req.rid} step {self.step}: the batch computes positions up to {end - 1}, "
                                     f"but the request has {len(tokens.ids)} tokens")
            self._check_context(req.rid, row, start)
            writes += [(req.rid, p, int(self.req_to_token[row, p])) for p in range(start, end)]
            fed += tokens.ids[start:end]
        if [slot for _, _, slot in writes] != loc:
            raise AssertionError(f"step {self.step}: out_cache_loc {loc} is not the requests' rows' slots "
                                 f"{[slot for _, _, slot in writes]} for the positions the batch computes")
        # An extend feeds the ids prepare_for_extend staged; a decode's input is run_batch's token relay (its future
        # map), stood in for: the request's last token, which _sync has just checked is the last sample.
        inputs = batch.prefill_input_ids_cpu if extend else None
        if inputs is not None and [int(t) for t in inputs] != fed:
            raise AssertionError(f"step {self.step}: the batch feeds tokens {[int(t) for t in inputs]}, not the "
                                 f"requests' tokens {fed} at the positions it computes")
        self._write(writes)
        sampled = []
        for req, end in zip(batch.reqs, seq_lens):
            tokens = self.tokens[req.rid]
            token = sampled_token(tokens.chain(end - 1), self.vocab)
            if end == len(tokens.ids):  # the forward reached its last token: SGLang must keep this sample, once
                self.given[req.rid] = self.given.get(req.rid, 0) + 1
                tokens.ids.append(token)
            sampled.append(token)  # a middle chunk's is discarded by SGLang, and not recorded here
        return sampled

    def _sync(self, req, tokens: Tokens) -> None:
        """SGLang's tokens for the request (prompt, then its outputs) must be exactly the prompt it was given and
        every token the model sampled for it: none dropped, duplicated or changed."""
        ids = list(req.origin_input_ids) + list(req.output_ids)
        if ids != tokens.ids:
            raise AssertionError(f"req {req.rid} step {self.step}: SGLang holds tokens {ids}, but it was given "
                                 f"{tokens.ids} (prompt, then the {self.given.get(req.rid, 0)} the model sampled)")

    def _check_context(self, rid: str, row: int, start: int) -> None:
        tokens = self.tokens[rid]
        if start == 0:
            return
        slots = self.req_to_token[row, :start].tolist()
        for layer in self.layers:
            for c, buffer in enumerate(self._buffers(layer)):
                for p, slot in enumerate(slots):
                    want = tag(tokens.chain(p), layer, c)
                    got = self._tag_of(buffer, slot)
                    if got != want:
                        raise self._lost(rid, layer, COMPONENTS[c], p, slot, want, got)

    def _write(self, writes: list[tuple[str, int, int]]) -> None:
        if not writes:
            return
        chains = [self.tokens[rid].chain(p) for rid, p, _ in writes]
        slots = torch.tensor([slot for _, _, slot in writes], dtype=torch.int64)
        rows = {}
        for layer in self.layers:
            for c, name in enumerate(COMPONENTS):
                tags = [tag(chain, layer, c) for chain in chains]
                for t, (rid, p, _) in zip(tags, writes):
                    self.writers.setdefault(t, (rid, p))
                rows[(f"full.{name}", layer)] = self._rows(tags)
        write_rows(self.kv_pool, mha_layers=[("full", layer) for layer in self.layers], mla_layers=(),
                   slots=slots, rows=rows)

    def _lost(self, rid: str, layer: int, name: str, position: int, slot: int, want: int, got: int) -> LostKv:
        if got == 0:
            why = "zeros (never written, or cleared)"
        elif got in self.writers:
            owner, pos = self.writers[got]
            why = f"req {owner}'s position {pos}" + (" (another prefix)" if owner != rid else "")
        else:
            why = f"a value nobody wrote ({got & ((1 << 64) - 1):#x})"
        return LostKv(rid=rid, step=self.step, space="full", component=f"full.{name}", layer=layer, position=position,
                      block=slot, slot=slot, expected=f"{want:#x}", found=f"{got & ((1 << 64) - 1):#x}", whose=why)
