"""The worker stand-in of the scheduler-driven vLLM family: what vLLM's GPU model runner does with the KV cache.

:class:`Worker` does with each ``SchedulerOutput`` what the GPU model runner does with the KV cache. It keeps
each request's block table per KV cache group as the output gives it (new requests, appended blocks, a request
re-sent after preemption), zeroes the blocks the scheduler names and runs its block copies, checks that every
position the forward attends to holds the KV of exactly the request's tokens up to it, writes the K and V of
exactly the scheduled positions, and samples a token determined by the tokens so far. Contents derive from
tokens alone (a chained hash of the token ids up to a position, salted by layer and component), never from
vLLM's bookkeeping, so a prefix hit's blocks (and blocks loaded from a KV connector's store) must hold the
prefix's own KV.

Mamba groups run in cache mode "none" (one state block a request, no prefix caching) and "align" (prefix
caching: a state per block of tokens). In both the worker checks that a forward continuing after ``n`` tokens
reads the recurrent state of exactly those ``n`` tokens (a chained hash of them, as for the KV).

Mode "align", as the GPU model runner runs it (``vllm/v1/worker/mamba_utils.py``: ``preprocess_mamba`` before
the forward, ``postprocess_mamba`` after it, 0.16.0 to 0.23.0; 0.34.0's fused ``preprocess_mamba_align`` /
``precopy_mamba_align`` kernels, and its CPU runner's ``MambaHybridModelState.preprocess_state`` in
``vllm/v1/worker/cpu/model_states/mamba_hybrid.py``, decide the same columns). A request's running state lives
in column ``cdiv(computed + scheduled, block_size) - 1`` of its mamba block table (0.16.0 takes the table's last
column: the same one without draft tokens). Before the forward the state it
continues from is copied there from the previous step's column, or, for a request the worker has no column for
(new, resumed after preemption, a prefix hit), from column ``(computed - 1) // block_size``: the hit's last
cached block. The forward writes the state after its last scheduled token into the running column; when that
token ends a block, the state is copied to that block's column (a no-op without draft tokens). A block the
scheduler caches thus holds the state after whatever token its last forward ended on: the scheduler's
block-aligned split (``Scheduler._mamba_block_aligned_split``) is what makes that its block boundary. The worker
follows those functions' column choice and does their copies on the CPU tensors here: the real ones build
CUDA pointer tables and launch Triton copies (``batch_memcpy`` / the fused kernels), which cannot run on a CPU,
and 0.34.0's CPU runner needs a loaded model's state copy functions and input batch.

Speculative decoding (ngram-style: the worker is its own drafter). A request the output schedules with draft
tokens (``scheduled_spec_decode_tokens``; 0.34's ``-1`` padding slots are filled by the worker's drafter, as
the GPU runner fills them from its own drafts) gets KV written for the drafts at their positions (derived from
the draft tokens, so a rejected draft's KV is not the request's), and the verify accepts drafts while each is
the token the stand-in model samples there, then samples one more: ``sampled_token_ids`` holds the accepted
drafts and that token, and vLLM rolls ``num_computed_tokens`` back over the rejected ones. After the forward
the drafter proposes ``drafts`` tokens for every request that sampled (``take_drafts``): the first few, as
many as the sequence's chain says, are the tokens the model will sample, the rest wrong. Not driven yet:
speculative decoding with a mamba group (vLLM's speculative state blocks).

A KV connector (``connector.py``): before the forward the worker does the step's transfers the connector's
metadata names, saves of a finished request's blocks (every KV cache group's) into the external store and loads
from it into the blocks the scheduler allocated (a mamba group's: the state after the load's last token, into
the column that ends there, where ``preprocess_mamba`` looks for a request's starting state), and reports the
asynchronous ones finished in the output's ``kv_connector_output``.
"""

from __future__ import annotations

import dataclasses
import torch

from poolfuzz.adapters.vllm.storage import copy_block, zero_blocks
from poolfuzz.pools.components import Component
from poolfuzz.pools.errors import LostKv
from poolfuzz.pools.token_chain import COMPONENTS, Tokens, chain_after, drafts_right, sampled_token, tag


class Worker:
    """The GPU model runner's handling of a ``SchedulerOutput``, on real tensors (see the module)."""

    def __init__(self, *, groups, num_blocks: int, block_size: int, sliding_window: int | None,
                 vocab: int, output_cls, mamba_mode: str = "none"):
        self.output_cls = output_cls  # the release's ModelRunnerOutput, what the forward hands back
        self.output_fields = {f.name for f in dataclasses.fields(self.output_cls)}
        self.groups = groups  # manager.Group per KV cache group
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.vocab = vocab
        self.mamba_mode = mamba_mode
        # One int64 component per (group, layer, K/V), a value per token slot (block * size + offset), and one
        # recurrent state per block of a mamba group (mode "none": a request's one state block; "align": a state
        # per block of tokens, the running one and those the prefix cache keeps).
        self.kv = {(g.index, layer, c): Component(name=f"{g.space}.{name}", layer=layer, space=g.space,
                                                  tensor=torch.zeros(num_blocks * block_size, dtype=torch.int64))
                   for g in groups if g.space != "mamba" for layer in g.layer_ids for c, name in enumerate(COMPONENTS)}
        self.state = {(g.index, layer): Component(name="mamba.state", layer=layer, space="mamba",
                                                  tensor=torch.zeros(num_blocks, dtype=torch.int64))
                      for g in groups if g.space == "mamba" for layer in g.layer_ids}
        self.kv_components, self.state_components = list(self.kv.values()), list(self.state.values())
        self.tables: dict[str, list[list[int]]] = {}  # req id -> block ids per group, as the output gave them
        self.tokens: dict[str, Tokens] = {}  # req id -> its tokens (kept across preemption, as the request's are)
        self.writers: dict[int, tuple[str, int]] = {}  # a tag written -> (req id, position): whose data it is
        self.store = None  # connector.ExternalStore where the server has the KV connector
        self.stored: dict[str, int] = {}  # req id -> its whole blocks stored so far (from its current table)
        self.connector_output_cls = None  # the release's KVConnectorOutput, with the store
        self.drafts = 0  # draft tokens the drafter proposes per request that sampled (set by the harness)
        self.proposed: dict[str, list[int]] = {}  # req id -> the drafts proposed after the last forward
        self.drafts_verified = self.drafts_accepted = 0  # draft tokens the forwards verified / accepted
        self.state_idx: dict[str, int] = {}  # align: req id -> the table column of its running state (vLLM's
        # mamba_state_idx: forgotten when it finishes, is preempted or resumes)
        self.step = 0

    # --- what the scheduler hands over ----------------------------------------------------------
    def execute(self, out) -> object:
        """One forward over ``out``; the ``ModelRunnerOutput`` vLLM's ``update_from_output`` takes."""
        self.step += 1
        for rid in out.finished_req_ids:
            self.tables.pop(rid, None)
            self.state_idx.pop(rid, None)
            self.stored.pop(rid, None)
        for rid in getattr(out, "preempted_req_ids", None) or ():
            self.tables.pop(rid, None)  # re-sent in full when it resumes
            self.state_idx.pop(rid, None)
            self.stored.pop(rid, None)
        computed: dict[str, int] = {}
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = [list(ids) for ids in new.block_ids]
            self.stored.pop(new.req_id, None)
            computed[new.req_id] = new.num_computed_tokens
        cached = out.scheduled_cached_reqs
        resumed = self._resumed(cached)
        for i, rid in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            if rid in resumed or rid not in self.tables:
                self.tables[rid] = [list(ids) for ids in (blocks or ())]
                self.state_idx.pop(rid, None)
                self.stored.pop(rid, None)
            elif blocks is not None:
                for table, ids in zip(self.tables[rid], blocks):
                    table.extend(ids)
            computed[rid] = cached.num_computed_tokens[i]
        zero = getattr(out, "new_block_ids_to_zero", None) or ()
        zero_blocks(self.kv_components, zero, self.block_size)
        zero_blocks(self.state_components, zero, 1)
        # Copy-on-write of a hit's tail block (hits inside a block): the GPU runner copies the block in every KV
        # cache tensor (copy_kv_cache_blocks_inplace), the mamba states' included.
        for copy in getattr(out, "kv_cache_block_copies", None) or ():
            for g in self.groups:
                components, rows = (self.state_components, 1) if g.space == "mamba" else (self.kv_components,
                                                                                         self.block_size)
                copy_block(components, g.space, copy.src_block_id, copy.dst_block_id, rows)
        finished = self._transfer(getattr(out, "kv_connector_metadata", None))
        if self.mamba_mode == "align":  # preprocess_mamba: every request's state moves before any forward
            for rid, n in out.num_scheduled_tokens.items():
                self._carry_state(rid, computed[rid], computed[rid] + n)
        req_ids, sampled = [], []
        specs = getattr(out, "scheduled_spec_decode_tokens", None) or {}
        self.proposed = {}
        for rid, n in out.num_scheduled_tokens.items():
            start = computed[rid]
            tokens = self.tokens[rid]
            drafts = self._drafts(rid, specs.get(rid) or ())
            if drafts and self.state:
                raise AssertionError(f"req {rid}: draft tokens scheduled on a mamba model, which the worker "
                                     "does not model (vLLM's speculative state blocks)")
            if drafts and len(tokens.ids) + len(drafts) != start + n:
                raise AssertionError(f"req {rid}: {n} tokens scheduled from {start} with {len(drafts)} drafts, but "
                                     f"it has {len(tokens.ids)} tokens: the drafts do not end the scheduled span")
            self._check_context(rid, start)
            if self.mamba_mode != "align":
                self._check_state(rid, start)
            self._write(rid, start, start + n - len(drafts))
            self._write_drafts(rid, drafts)
            self._write_state(rid, start + n - len(drafts))
            if start + n >= len(tokens.ids):  # the forward reached the last known token: it samples
                new = self._verify(tokens, drafts)
                tokens.ids.extend(new)
                sampled.append(new)
                if self.drafts:
                    self.proposed[rid] = self._propose(tokens, self.drafts)
            else:
                sampled.append([])
            req_ids.append(rid)
        self._store_progress(getattr(out, "kv_connector_metadata", None))
        return self._output(req_ids, sampled, finished)

    # --- a KV connector's transfers (connector.py) ------------------------------------------------
    def _transfer(self, meta) -> tuple[set[str], set[str]] | None:
        """The step's saves (every group's blocks' values into the store, under the token prefix each block
        ends) and loads (the store's values into the blocks the scheduler allocated, and the recurrent state after
        the load's last token into the mamba column that ends there), before the forward; the requests whose
        transfer is reported finished (sending, receiving)."""
        if meta is None or self.store is None:
            return None
        sending, receiving = set(), set()
        bs = self.block_size
        for load in meta.loads:
            end = load.start + load.count
            for index in range(load.start // bs, end // bs):
                values = self.store.values.get(load.tokens[:(index + 1) * bs], {})
                for g in self.groups:
                    block = self._table_block(load.blocks, g, index)
                    if g.space == "mamba" and index != end // bs - 1:
                        continue  # a load restores the state after its last token only
                    if block:
                        self._fill(g, block, values)
            if load.report:
                receiving.add(load.rid)
        for save in meta.saves:
            self._store(save.tokens, save.blocks, 0, save.count // bs)
            sending.add(save.rid)
        return sending, receiving

    def _store_progress(self, meta) -> None:
        """After the forward: the whole blocks of the tokens each scheduled request had computed before the step,
        into the store. Not before it: a prefix hit counts tokens computed that another request's forward of
        this very step writes (vLLM caches a block when it is scheduled)."""
        if meta is None or self.store is None:
            return
        bs = self.block_size
        for rid, computed in getattr(meta, "stores", {}).items():
            done = self.stored.get(rid, 0)
            if rid in self.tables and computed // bs > done:
                self._store(self.tokens[rid].ids, self.tables[rid], done, computed // bs, live=computed)
                self.stored[rid] = computed // bs

    def _store(self, tokens, blocks, first: int, last: int, *, live: int | None = None) -> None:
        """Blocks ``[first, last)`` of every group into the store under the token prefix each ends; what the
        store holds already is kept (a prefix's contents are its tokens', whoever computed them). ``live``: the
        blocks are a running request's table as the outputs gave it, ``live`` tokens computed, which lists
        blocks vLLM has since released without telling the worker (window blocks a forward from ``live`` does
        not read, mamba states before the one it continues from): only the rest are read."""
        bs = self.block_size
        for index in range(first, last):
            entry = self.store.values.setdefault(tuple(tokens[:(index + 1) * bs]), {})
            for g in self.groups:
                block = self._table_block(blocks, g, index)
                if live is not None and not self._held(g, index, live):
                    continue
                if block:  # a null block (out of the window, a state not kept) holds nothing to save
                    for key, value in self._block_values(g, block).items():
                        entry.setdefault(key, value)

    def _held(self, group, index: int, computed: int) -> bool:
        """Whether block ``index`` of a running request's ``group`` is surely still its own at ``computed`` tokens."""
        end = (index + 1) * self.block_size
        if group.space == "mamba":
            return end == computed  # the state it continues from
        if group.space == "swa" and self.sliding_window is not None:
            return end > computed - (self.sliding_window - 1)  # attended by its next token
        return True

    @staticmethod
    def _table_block(blocks, group, index: int) -> int | None:
        table = blocks[group.index] if group.index < len(blocks) else ()
        return table[index] if index < len(table) else None

    def _block_values(self, group, block: int) -> dict:
        """The values one block of ``group`` holds: a token slot range per attention layer, a state per mamba one."""
        if group.space == "mamba":
            return {key: c.tensor[block].clone() for key, c in self.state.items() if key[0] == group.index}
        span = slice(block * self.block_size, (block + 1) * self.block_size)
        return {key: c.tensor[span].clone() for key, c in self.kv.items() if key[0] == group.index}

    def _fill(self, group, block: int, values: dict) -> None:
        span = slice(block * self.block_size, (block + 1) * self.block_size)
        for key, value in values.items():
            if key[0] != group.index:
                continue
            if group.space == "mamba":
                self.state[key].tensor[block] = value
            else:
                self.kv[key].tensor[span] = value

    # --- speculative decoding -------------------------------------------------------------------
    def _propose(self, tokens: Tokens, count: int) -> list[int]:
        """The drafter's ``count`` tokens after the request's last token: as many right as its chain says."""
        position = len(tokens.ids) - 1
        chain = tokens.chain(position)
        right = drafts_right(chain, count)
        proposal = []
        for i in range(count):
            token = sampled_token(chain, self.vocab)
            if i >= right:
                token = (token + 1) % self.vocab
            proposal.append(token)
            chain = chain_after(chain, token, position + 1 + i)
        return proposal

    def _drafts(self, rid: str, scheduled) -> list[int]:
        """The draft tokens scheduled for ``rid``, a ``-1`` padding slot filled by the drafter."""
        drafts = list(scheduled)
        if any(t < 0 for t in drafts):
            own = self._propose(self.tokens[rid], len(drafts))
            drafts = [own[i] if t < 0 else t for i, t in enumerate(drafts)]
        return drafts

    def _verify(self, tokens: Tokens, drafts: list[int]) -> list[int]:
        """What the rejection sampler returns: the drafts accepted in order, then the model's own token."""
        chain, position, out = tokens.chain(len(tokens.ids) - 1), len(tokens.ids), []
        for draft in drafts:
            token = sampled_token(chain, self.vocab)
            if draft != token:
                break
            out.append(token)
            chain = chain_after(chain, token, position)
            position += 1
        self.drafts_verified += len(drafts)
        self.drafts_accepted += len(out)
        out.append(sampled_token(chain, self.vocab))
        return out

    def _write_drafts(self, rid: str, drafts: list[int]) -> None:
        """The KV of the draft tokens at the positions after the request's last token (from the drafts)."""
        tokens = self.tokens[rid]
        position = len(tokens.ids)
        chain = tokens.chain(position - 1)
        for draft in drafts:
            chain = chain_after(chain, draft, position)
            self._write_at(rid, position, chain, ("draft", rid, position))
            position += 1

    def take_drafts(self) -> tuple[list[str], list[list[int]]]:
        """The drafts proposed after the last forward (the engine core hands them to ``update_draft_token_ids``)."""
        rids = list(self.proposed)
        return rids, [self.proposed[r] for r in rids]

    def _resumed(self, cached) -> set[str]:
        """Requests the output re-sends whole (older releases flag them among the cached ones)."""
        flags = getattr(cached, "resumed_from_preemption", None)
        if flags is not None:
            return {rid for rid, f in zip(cached.req_ids, flags) if f}
        return set(getattr(cached, "resumed_req_ids", None) or ())

    def _output(self, req_ids: list[str], sampled: list[list[int]], finished=None):
        kw = dict(req_ids=req_ids, sampled_token_ids=sampled)
        if finished is not None:
            kw["kv_connector_output"] = self.connector_output_cls(finished_sending=finished[0] or None,
                                                                  finished_recving=finished[1] or None)
        optional = dict(req_id_to_index={r: i for i, r in enumerate(req_ids)}, logprobs=None,
                        prompt_logprobs_dict={}, pooler_output=[])
        kw.update({k: v for k, v in optional.items() if k in self.output_fields})
        return self.output_cls(**kw)

    # --- the KV a forward reads and writes --------------------------------------------------------
    def _slot(self, rid: str, group: int, position: int) -> int | None:
        table = self.tables[rid][group]
        index = position // self.block_size
        if index >= len(table):
            return None
        return table[index] * self.block_size + position % self.block_size

    def _attended(self, group, start: int) -> range:
        """The positions before ``start`` the forward's first token attends to in ``group``."""
        if group.space == "swa" and self.sliding_window is not None:
            return range(max(0, start - (self.sliding_window - 1)), start)
        return range(start)

    def _check_context(self, rid: str, start: int) -> None:
        tokens = self.tokens[rid]
        for g in self.groups:
            if g.space == "mamba":
                continue
            for p in self._attended(g, start):
                slot = self._slot(rid, g.index, p)
                chain = tokens.chain(p)
                for layer in g.layer_ids:
                    for c, name in enumerate(COMPONENTS):
                        want = tag(chain, layer, c)
                        got = None if slot is None else int(self.kv[(g.index, layer, c)].tensor[slot])
                        if got != want:
                            raise self._lost(rid, g, layer, name, p, slot, want, got)

    def _state_block(self, rid: str, group) -> int | None:
        table = self.tables[rid][group.index]
        if self.mamba_mode == "align":
            column = self.state_idx.get(rid)
            return table[column] if column is not None and 0 <= column < len(table) else None
        return table[-1] if table else None

    def _column_block(self, rid: str, group, column: int) -> int | None:
        table = self.tables[rid][group.index]
        return table[column] if 0 <= column < len(table) else None

    def _carry_state(self, rid: str, start: int, end: int) -> None:
        """Mode align, ``preprocess_mamba``: the state a forward over ``[start, end)`` continues from is in the
        previous step's running column, or for a request without one (new, resumed, a prefix hit) in column
        ``(start - 1) // block_size``. It must be the state of exactly ``start`` tokens; it is copied into the
        running column ``cdiv(end, block_size) - 1`` the forward reads and writes."""
        mamba = [g for g in self.groups if g.space == "mamba"]
        if not mamba:
            return
        size = mamba[0].block_size
        prev = self.state_idx.get(rid)
        if prev is None:
            prev = (start - 1) // size  # -1 at 0: a first forward starts from no state
        curr = -(-end // size) - 1
        self.state_idx[rid] = curr
        if start == 0:
            return
        chain = self.tokens[rid].chain(start - 1)
        for g in mamba:
            src = self._column_block(rid, g, prev)
            for layer in g.layer_ids:
                want = tag(chain, layer, len(COMPONENTS))
                got = None if not src else int(self.state[(g.index, layer)].tensor[src])
                if got != want:
                    why = None if src else (f"column {prev} of its mamba table is "
                                            + ("the null block" if src == 0 else "missing"))
                    raise self._lost(rid, g, layer, "state", start - 1, src or None, want, got, block_size=1, why=why)
            dst = self._column_block(rid, g, curr)
            if prev != curr and dst is not None:
                copy_block(self.state_components, "mamba", src, dst, 1)

    def _checkpoint_state(self, rid: str, end: int) -> None:
        """Mode align, ``postprocess_mamba``: a forward whose last token ends a block leaves that block's
        column the state after it (the running column already, without draft tokens)."""
        for g in self.groups:
            if g.space != "mamba" or end % g.block_size:
                continue
            src, dst = self._state_block(rid, g), self._column_block(rid, g, end // g.block_size - 1)
            if src is not None and dst is not None and src != dst:
                copy_block(self.state_components, "mamba", src, dst, 1)

    def _check_state(self, rid: str, start: int) -> None:
        """A forward continuing from ``start`` tokens reads the recurrent state of exactly those tokens
        (none at 0: a first forward starts from no state, vLLM's ``has_initial_state`` False)."""
        if start == 0:
            return
        chain = self.tokens[rid].chain(start - 1)
        for g in self.groups:
            if g.space != "mamba":
                continue
            block = self._state_block(rid, g)
            for layer in g.layer_ids:
                want = tag(chain, layer, len(COMPONENTS))
                got = None if block is None else int(self.state[(g.index, layer)].tensor[block])
                if got != want:
                    raise self._lost(rid, g, layer, "state", start - 1, block, want, got, block_size=1)

    def _write_state(self, rid: str, end: int) -> None:
        chain = self.tokens[rid].chain(end - 1)
        for g in self.groups:
            if g.space != "mamba":
                continue
            block = self._state_block(rid, g)
            if not block:
                raise self._lost(rid, g, g.layer_ids[0], "state", end - 1, None, None, None,
                                 why="no state block in the mamba table the output gave" if block is None
                                 else "its running state's column is the null block")
            for layer in g.layer_ids:
                value = tag(chain, layer, len(COMPONENTS))
                self.state[(g.index, layer)].tensor[block] = value
                self.writers.setdefault(value, (rid, end - 1))
        if self.mamba_mode == "align":
            self._checkpoint_state(rid, end)

    def _write(self, rid: str, start: int, end: int) -> None:
        tokens = self.tokens[rid]
        for p in range(start, end):
            self._write_at(rid, p, tokens.chain(p), (rid, p))

    def _write_at(self, rid: str, p: int, chain: int, writer: tuple) -> None:
        """The K and V of position ``p`` (derived from ``chain``) into its slot of every attention group."""
        for g in self.groups:
            if g.space == "mamba":
                continue
            slot = self._slot(rid, g.index, p)
            if slot is None:
                raise self._lost(rid, g, g.layer_ids[0], "k", p, None, None, None,
                                 why=f"position {p} has no block in the {g.space} table the output gave")
            for layer in g.layer_ids:
                for c in range(len(COMPONENTS)):
                    value = tag(chain, layer, c)
                    self.kv[(g.index, layer, c)].tensor[slot] = value
                    self.writers.setdefault(value, writer)

    def _lost(self, rid, g, layer, name, position, slot, want, got, why: str | None = None,
              block_size: int | None = None) -> LostKv:
        if why is None:
            if got == 0:
                why = "zeros (never written, or cleared)"
            elif got in self.writers and name == "state":
                owner, pos = self.writers[got]
                tokens = self.tokens[rid]
                own = pos < len(tokens.ids) and tag(tokens.chain(pos), layer, len(COMPONENTS)) == got
                why = (f"the state after {pos + 1} tokens, not {position + 1}: "
                       + (f"its own first {pos + 1}" if own else "another prefix's")
                       + f", written by req {owner}")
            elif got in self.writers and self.writers[got][0] == "draft":
                _, owner, pos = self.writers[got]
                why = f"the KV of a draft token req {owner} proposed at position {pos} (rejected)"
            elif got in self.writers:
                owner, pos = self.writers[got]
                why = f"req {owner}'s position {pos}" + (" (another prefix)" if owner != rid else "")
            else:
                why = f"a value nobody wrote ({got:#x})"
        return LostKv(rid=rid, step=self.step, space=g.space, component=f"{g.space}.{name}", layer=layer,
                      position=position, block=None if slot is None else slot // (block_size or self.block_size),
                      slot=slot,
                      expected="" if want is None else f"{want:#x}", found="" if got is None else f"{got:#x}",
                      whose=why)

