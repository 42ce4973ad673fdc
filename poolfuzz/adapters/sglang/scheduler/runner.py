"""The model-runner stand-in of the SGLang scheduler path: what a forward does with the pools for a ScheduleBatch.

:class:`ModelRunner` does with each batch what SGLang's model runner and attention backends do with the KV cache
and the recurrent state. Before the forward it checks that every position each request attends to
(``req_to_token[row, :prefix]`` for an extend, ``[row, :seq_len - 1]`` for a decode) holds, in every full-attention
layer, the K and V of exactly the request's tokens up to it (in a sliding-window layer, the positions the first
computed token's window reads, at the SWA slots the pool's ``translate_loc_from_full_to_swa`` gives), and that the recurrent state a request continues from
(its working mamba slot, ``get_mamba_indices``) is, in every mamba layer, the state of exactly the tokens before
the ones the batch computes. It then writes the K and V of the scheduled positions at the batch's
``out_cache_loc`` through the pool's own write door (``set_kv_buffer``, ``writes.write_rows``: MHA's K and V, MLA's
latent and rope parts; what the door does not take, such as scale rows, FP4 bytes and sparse index caches, is stored
where the pool keeps it, as the harness's forward does; "K and V" below means every KV component), the state after the
last computed token into each working slot, and, where the batch asks to track a state for the radix tree
(``mamba_track_mask``), the state the kernel snapshots into ``mamba_track_indices``: after ``mamba_track_seqlens``
tokens for an extend, after the decoded token for a decode. It samples one token per request, determined by the
tokens so far. Contents derive from tokens alone (``pools.token_chain``), never from SGLang's bookkeeping, so a
radix-tree hit's slots and the mamba state it copies must hold the prefix's own data, whoever computed it.

Before an extend the deferred copy-on-write and clearing of the requests' mamba slots (a tree hit's state copied
into the request's slot, a fresh slot zeroed) run as the GPU model runner runs them: SGLang's own
``ModelRunner._maybe_execute_deferred_mamba_cow_and_clear``, unbound, on a stand-in holding the request pool.

A slot's K (or V, or state) row holds its 64-bit tag in its first eight bytes; the checks read the pools' buffers
in place, as the kernels get them (``family.components()``: the KV through the pool's read door, each mamba layer's
state through ``mamba2_layer_cache``; on the unified memory pool, through SGLang's virtual -> physical tables).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from poolfuzz.adapters.sglang import compat
from poolfuzz.pools.errors import LostKv
from poolfuzz.pools.speculative import draft_step, state_component_of
from poolfuzz.pools.token_chain import COMPONENTS, Tokens, chain_after, sampled_token, tag

TAG_BYTES = 8


KV_SPACES = ("full", "swa")


def _tags_of(c, slots: torch.Tensor) -> list[int]:
    """The 64-bit tag each of ``slots``' rows of ``c`` holds, in one gather (a long-context request's prefix is
    thousands of slots)."""
    if not len(slots):
        return []
    rows = c.tensor[c.at(slots)].reshape(len(slots), -1).view(torch.uint8)
    # copied into rows of their own: a row need not be a whole number of 8 bytes (a single row's slice would keep
    # its parent's stride, which an int64 view refuses)
    tags = torch.empty((len(slots), TAG_BYTES), dtype=torch.uint8)
    tags.copy_(rows[:, :TAG_BYTES])
    return tags.view(torch.int64)[:, 0].tolist()


def _set_tag(c, slot: int, value: int) -> None:
    row = c.tensor[c.at(slot)].reshape(-1).view(torch.uint8)
    row.zero_()
    row[:TAG_BYTES] = torch.tensor([value], dtype=torch.int64).view(torch.uint8)


def _tagged_rows(c, tags: list[int]) -> torch.Tensor:
    """Rows of component ``c`` in its own dtype and shape, each zero but for its tag in its first eight bytes."""
    row_bytes = c.tensor.element_size()
    for d in c.row_shape:
        row_bytes *= d
    out = torch.zeros(len(tags), row_bytes, dtype=torch.uint8)
    out[:, :TAG_BYTES] = torch.tensor(tags, dtype=torch.int64).view(torch.uint8).view(len(tags), TAG_BYTES)
    return out.view(c.tensor.dtype).view(len(tags), *c.row_shape)


def component_indices(kv: list, states: list) -> dict[str, int]:
    """The tag salt of each component name: K and V as ``token_chain.COMPONENTS`` numbers them (full and SWA alike),
    the recurrent states next, then every other KV component (MLA's latent and rope parts, scales, sparse indexes)."""
    out = {c.name: COMPONENTS.index(c.name.split(".")[-1]) for c in kv if c.name.split(".")[-1] in COMPONENTS}
    later = dict.fromkeys([c.name for c in states] + [c.name for c in kv if c.name not in out])
    return out | {name: len(COMPONENTS) + i for i, name in enumerate(later)}


class ModelRunner:
    """The forward of a model of full-attention and (optionally) mamba layers over SGLang's pools (see the module)."""

    def __init__(self, *, family, vocab: int, cow_and_clear=None, aligned_lens=None):
        comps = family.components()
        kv = [c for c in comps if c.space in KV_SPACES]
        self.states = [c for c in comps if c.space == "mamba"]
        # a speculative server's intermediate state caches: (state component, layer, draft step) -> its rows
        self.scratch = {(state_component_of(c.name), c.layer, draft_step(c.name)): c for c in comps
                        if draft_step(c.name) is not None}
        index = component_indices(kv, self.states)
        self.kv = [(c, index[c.name]) for c in kv]  # each KV component with its tag salt
        self.state_index = {c.name: index[c.name] for c in self.states}
        self.kv_pool = family.kv_pool  # the write door
        # whether a transfer names physical rows, which only the kernels' translation maps slot ids to (unified pool)
        self.lands_physically = any(c.translate is not None for c, _ in self.kv)
        # a sliding-window layer's rows live at SWA slots: a full slot translates through the allocator's mapping, the
        # one the pool's translate_loc_from_full_to_swa reads (an all-SWA pool hands out SWA slots itself)
        config = family.config
        self.to_swa = family.allocator.translate if config.has_swa and config.has_full else None
        self.window = family.config.sliding_window
        self.req_pool = family.sg_req_pool
        self.req_to_token = self.req_pool.req_to_token
        self.vocab = vocab
        # SGLang's model runner's deferred mamba copy-on-write / clear, unbound (None: no mamba state)
        self.cow_and_clear = cow_and_clear if self.states else None
        self.aligned_lens = aligned_lens  # SGLang's ForwardBatch.mamba_track_aligned_lens, unbound
        self.tokens: dict[str, Tokens] = {}  # req id -> its tokens (prompt, then the samples it was given)
        self.writers: dict[int, tuple[str, int]] = {}  # a tag written -> (req id, position): whose data it is
        self.given: dict[str, int] = {}  # req id -> tokens the model sampled for it (each kept once by SGLang)
        self.step = 0
        for c in [c for c, _ in self.kv] + self.states:
            row_bytes = c.tensor[c.at(0)].numel() * c.tensor.element_size()
            if row_bytes < TAG_BYTES:
                raise ValueError(f"a {c.name} row of {row_bytes} bytes cannot hold a {TAG_BYTES}-byte tag")

    # --- the forward ---------------------------------------------------------------------------
    def forward(self, batch) -> list[int]:
        """Check what the batch's requests attend to and continue from, write their new positions and states,
        return one token per request."""
        self.step += 1
        rows = compat.batch_rows(batch).tolist()
        seq_lens = batch.seq_lens_cpu.tolist()
        extend = batch.forward_mode.is_extend()
        starts = list(batch.prefix_lens) if extend else [s - 1 for s in seq_lens]
        writes: list[tuple[str, int, int]] = []  # (req id, position, slot)
        loc = batch.out_cache_loc.tolist()
        fed = []  # the token ids the forward computes, request by request
        if extend and self.cow_and_clear is not None:
            self.cow_and_clear(batch)
        state_slots = self._state_slots(rows)
        for i, (req, row, start, end) in enumerate(zip(batch.reqs, rows, starts, seq_lens)):
            tokens = self._checked(req, row, start, state_slots[i] if state_slots else None)
            if end > len(tokens.ids):
                raise AssertionError(f"req {req.rid} step {self.step}: the batch computes positions up to {end - 1}, "
                                     f"but the request has {len(tokens.ids)} tokens")
            writes += [(req.rid, p, int(self.req_to_token[row, p])) for p in range(start, end)]
            fed += tokens.ids[start:end]
        if [slot for _, _, slot in writes] != loc:
            raise AssertionError(f"step {self.step}: out_cache_loc {loc} is not the requests' rows' slots "
                                 f"{[slot for _, _, slot in writes]} for the positions the batch computes")
        # An extend feeds the ids prepare_for_extend staged; a decode's input is run_batch's token relay (its future
        # map), stood in for: the request's last token, which _sync has just checked is the last sample.
        inputs = compat.batch_prefill_inputs(batch) if extend else None
        if inputs is not None and [int(t) for t in inputs] != fed:
            raise AssertionError(f"step {self.step}: the batch feeds tokens {[int(t) for t in inputs]}, not the "
                                 f"requests' tokens {fed} at the positions it computes")
        self._write(writes)
        if state_slots:
            for req, slot, end in zip(batch.reqs, state_slots, seq_lens):
                self._write_state(req.rid, slot, end)
            self._track(batch, seq_lens, extend)
        sampled = []
        for req, end in zip(batch.reqs, seq_lens):
            tokens = self.tokens[req.rid]
            token = sampled_token(tokens.chain(end - 1), self.vocab)
            if end == len(tokens.ids):  # the forward reached its last token: SGLang must keep this sample, once
                self.given[req.rid] = self.given.get(req.rid, 0) + 1
                tokens.ids.append(token)
            sampled.append(token)  # a middle chunk's is discarded by SGLang, and not recorded here
        return sampled

    def verify(self, batch, *, locs: list[int], trees: list[list[tuple[int, int]]]) -> tuple[list[int], list[list[int]]]:
        """A target-verify forward of draft trees (EAGLE): request ``i`` of the batch, whose KV holds its first
        ``seq_lens[i]`` tokens and whose last token (the bonus of its last round) has none yet, feeds a tree of ``D``
        nodes: node 0 that token, node ``j`` (``trees[i][j - 1]``: its parent, an earlier node, and its token) at
        position ``seq_lens[i]`` plus its depth. A chain is the tree whose parents are ``j - 1``. Checked first, as for
        a decode: the request's context and the state it continues from. Written: each node's K and V at
        ``locs[i * D + j]``, which must be the request row's slot ``seq_lens[i] + j`` (SGLang's verify window, by node),
        derived from the tokens on the node's path, so a rejected draft's KV is not the request's; and into row ``i``
        of the intermediate state caches (SGLang's verify scratch rows are batch positions) at step ``j``, the state
        after node ``j``'s path. Returns what ``eagle_sample`` gives for greedy sampling: the target's token after each
        node (``D`` per request), and per request the accepted path of nodes from the root (a child is accepted where
        its token is the target's after its parent; the target's own token follows the last). The path's tokens then
        join the request's."""
        self.step += 1
        rows = compat.batch_rows(batch).tolist()
        seq_lens = batch.seq_lens_cpu.tolist()
        width = 1 + len(trees[0]) if trees else 0
        state_slots = self._state_slots(rows)
        predict, paths = [], []
        for i, (req, row, start) in enumerate(zip(batch.reqs, rows, seq_lens)):
            tokens = self._checked(req, row, start, state_slots[i] if state_slots else None)
            if len(tokens.ids) != start + 1:
                raise AssertionError(f"req {req.rid} step {self.step}: the verify starts at position {start}, but the "
                                     f"request's last token is at {len(tokens.ids) - 1} (its KV must cover all but it)")
            nodes = [(None, tokens.ids[-1])] + list(trees[i])
            depth, chains, targets = [], [], []
            for parent, token in nodes:
                depth.append(0 if parent is None else depth[parent] + 1)
                before = (tokens.chain(start - 1) if start else 0) if parent is None else chains[parent]
                chains.append(chain_after(before, token, start + depth[-1]))
                targets.append(sampled_token(chains[-1], self.vocab))
            path = [0]
            while child := next((j for j, (parent, token) in enumerate(nodes)
                                 if parent == path[-1] and token == targets[path[-1]]), None):
                path.append(child)
            slots = locs[i * width:(i + 1) * width]
            want = [int(self.req_to_token[row, start + j]) for j in range(width)]
            if slots != want:
                raise AssertionError(f"req {req.rid} step {self.step}: the verify writes its {width} nodes at slots "
                                     f"{slots}, not the request row's {want} (positions {start}..{start + width - 1})")
            rejected = set(range(width)) - set(path)
            self._write([(req.rid, start + depth[j], slot) for j, slot in enumerate(slots)], chains=chains,
                        rejected=rejected)
            for c in self.states:
                for j, ch in enumerate(chains):
                    t = tag(ch, c.layer, self.state_index[c.name])
                    self.writers.setdefault(t, (req.rid, _draft_position(start + depth[j], j in rejected)))
                    _set_tag(self.scratch[(c.name, c.layer, j)], i, t)
            tokens.ids += [targets[j] for j in path]
            self.given[req.rid] = self.given.get(req.rid, 0) + len(path)
            predict += targets
            paths.append(path)
        return predict, paths

    def _checked(self, req, row: int, start: int, state_slot: int | None) -> Tokens:
        """Before a forward computes positions ``start`` on: the request's tokens are SGLang's, every position before
        ``start`` holds its own KV, and its working mamba slot (where it has one) the state after them. Its tokens."""
        tokens = self.tokens[req.rid]
        self._sync(req, tokens)
        self._check_context(req.rid, row, start)
        if state_slot is not None and start:
            self._check_state(req.rid, state_slot, start)
        return tokens

    def _sync(self, req, tokens: Tokens) -> None:
        """SGLang's tokens for the request (prompt, then its outputs) must be exactly the prompt it was given and
        every token the model sampled for it: none dropped, duplicated or changed."""
        ids = list(req.origin_input_ids) + list(req.output_ids)
        if ids != tokens.ids:
            raise AssertionError(f"req {req.rid} step {self.step}: SGLang holds tokens {ids}, but it was given "
                                 f"{tokens.ids} (prompt, then the {self.given.get(req.rid, 0)} the model sampled)")

    # --- KV --------------------------------------------------------------------------------------
    def _check_context(self, rid: str, row: int, start: int) -> None:
        """Every position before ``start`` holds the request's own K and V in every full-attention layer; in a
        sliding-window layer, the positions the first computed token's window reads (``start - window + 1`` on: the
        rest may have been evicted)."""
        tokens = self.tokens[rid]
        if start == 0:
            return
        slots = torch.as_tensor(self.req_to_token[row, :start], dtype=torch.int64)
        swa_from = max(0, start - self.window + 1)
        swa_slots = slots[swa_from:]
        if self.to_swa is not None and len(swa_slots):
            swa_slots = self.to_swa(swa_slots)
        for c, index in self.kv:
            first, where = (swa_from, swa_slots) if c.space == "swa" else (0, slots)
            for p, (slot, got) in enumerate(zip(where.tolist(), _tags_of(c, where)), start=first):
                want = tag(tokens.chain(p), c.layer, index)
                if got != want:
                    raise self._lost(rid, c, p, slot, want, got)

    def receive_prefill(self, rid: str, *, start: int, slots: list[int],
                        swa_rows: tuple[int, list[int]] | None = None) -> None:
        """What a prefill node's KV transfer lands on a PD decode server: the K and V of the request's prompt from
        ``start`` on, in the ``slots`` the decode side named (in position order). On a pool whose kernels translate
        slot ids (the unified memory pool) the decode side names physical rows (``translate_kv_indices_for_transfer``)
        and the transfer's bytes land there, the sliding-window layers' at ``swa_rows`` (the first position they hold,
        and the physical SWA rows its window payload named)."""
        if not self.lands_physically:
            self._write([(rid, start + i, slot) for i, slot in enumerate(slots)])
            return
        self._land(rid, range(start, start + len(slots)), slots, space="full")
        if swa_rows is not None:
            first, rows = swa_rows
            positions = range(first, min(first + len(rows), len(self.tokens[rid].ids)))
            self._land(rid, positions, rows[:len(positions)], space="swa")

    def _land(self, rid: str, positions: range, rows: list[int], *, space: str) -> None:
        """The K and V of ``positions`` written as a transfer writes them: bytes at the physical ``rows``."""
        tagged = self._kv_rows([(rid, p, row) for p, row in zip(positions, rows)], space=space)
        where = torch.tensor(rows, dtype=torch.int64)
        for c, _ in self.kv:
            if c.space == space:
                c.tensor[where] = tagged[(c.name, c.layer)]

    def _kv_rows(self, writes: list[tuple[str, int, int]], *, chains: list[int] | None = None,
                 rejected: set[int] = frozenset(), space: str | None = None) -> dict:
        """Each KV component's rows (of ``space``'s, or all) for ``writes``, ``(name, layer) -> rows``, their tags
        derived from the requests' tokens (or ``chains``); every tag's writer recorded, to name whose data a slot
        holds (a draft the target rejected, numbered in ``rejected``, as such)."""
        chains = chains or [self.tokens[rid].chain(p) for rid, p, _ in writes]
        rows = {}
        for c, index in self.kv:
            if space is not None and c.space != space:
                continue
            tags = [tag(chain, c.layer, index) for chain in chains]
            for j, (t, (rid, p, _)) in enumerate(zip(tags, writes)):
                self.writers.setdefault(t, (rid, _draft_position(p, j in rejected)))
            rows[(c.name, c.layer)] = _tagged_rows(c, tags)
        return rows

    def receive_prefill_state(self, rid: str, *, slot: int, tokens: int) -> None:
        """The recurrent state a prefill node transfers: every mamba layer's state after the first ``tokens`` tokens,
        into the physical mamba ``slot`` the decode side named."""
        self._write_state(rid, slot, tokens)

    def receive_first_token(self, rid: str, token: int) -> None:
        """The token the prefill node sampled after the prompt, handed over with the transfer."""
        self.tokens[rid].ids.append(token)
        self.given[rid] = self.given.get(rid, 0) + 1

    def _write(self, writes: list[tuple[str, int, int]], *, chains: list[int] | None = None,
               rejected: set[int] = frozenset()) -> None:
        """The K and V of each ``(req id, position, slot)``, derived from the request's tokens (or from ``chains``, a
        verify's nodes, of which the writes numbered in ``rejected`` are drafts the target rejected)."""
        if not writes:
            return
        slots = torch.tensor([slot for _, _, slot in writes], dtype=torch.int64)
        rows = self._kv_rows(writes, chains=chains, rejected=rejected)
        done = self.kv_pool.write_rows(slots, rows)
        # What the pool's door does not take (a sparse index, MXFP8 scales, FP4 bytes the quantiser cannot carry a
        # tag through) is stored where the pool keeps it, as the harness's forward stores it (``harness.forward``)
        swa_slots = None
        for c, _ in self.kv:
            if (c.name, c.layer) in done:
                continue
            where = slots
            if c.space == "swa" and self.to_swa is not None:
                swa_slots = self.to_swa(slots) if swa_slots is None else swa_slots
                where = swa_slots
            c.tensor[c.at(where)] = rows[(c.name, c.layer)]

    # --- recurrent state -------------------------------------------------------------------------
    def _state_slots(self, rows: list[int]) -> list[int]:
        """Each request's working mamba slot, as the linear-attention backends index the state: the request pool's
        ``get_mamba_indices`` of its row, translated to the physical slot (``translate_mamba_indices``)."""
        if not self.states:
            return []
        pool = self.req_pool
        index = pool.get_mamba_indices(torch.tensor(rows, dtype=torch.int64))
        return [int(s) for s in compat.physical_mamba_slots(pool, index).tolist()]

    def _state_tag(self, rid: str, c, tokens: int) -> int:
        """The state of component ``c`` after the request's first ``tokens`` tokens."""
        return tag(self.tokens[rid].chain(tokens - 1), c.layer, self.state_index[c.name])

    def _check_state(self, rid: str, slot: int, tokens: int) -> None:
        for c in self.states:
            want, got = self._state_tag(rid, c, tokens), _tags_of(c, torch.tensor([slot]))[0]
            if got != want:
                raise self._lost(rid, c, tokens - 1, slot, want, got, state=True)

    def _write_state(self, rid: str, slot: int, tokens: int) -> None:
        for c in self.states:
            t = self._state_tag(rid, c, tokens)
            self.writers.setdefault(t, (rid, tokens - 1))
            _set_tag(c, slot, t)

    def _track(self, batch, seq_lens: list[int], extend: bool) -> None:
        """The kernels' snapshot for the radix tree: for each request the batch tracks, into its
        ``mamba_track_indices`` slot (translated to the physical slot), the state after its decoded token (a decode)
        or, for an extend, after its prefix and the part of the extend SGLang's ``mamba_track_aligned_lens`` says the
        snapshot covers (the last chunk boundary it crossed, whether the kernel takes it from its final state or
        from an intermediate chunk state ``h``)."""
        mask = batch.mamba_track_mask
        if mask is None or not bool(mask.any()):
            return
        pool = self.req_pool
        dests = compat.physical_mamba_slots(pool, batch.mamba_track_indices).tolist()
        if extend:
            prefix = torch.tensor(list(batch.prefix_lens), dtype=torch.int64)
            extend_lens = torch.tensor(list(batch.extend_lens), dtype=torch.int64)
            covered = self.aligned_lens(mask.cpu(), batch.mamba_track_seqlens.cpu(), prefix, extend_lens)
            lens = (prefix + covered).tolist()
        else:
            lens = seq_lens
        for i, tracked in enumerate(mask.tolist()):
            if tracked and lens[i] > 0:
                self._write_state(batch.reqs[i].rid, int(dests[i]), int(lens[i]))

    def _lost(self, rid: str, c, position: int, slot: int, want: int, got: int, *, state: bool = False) -> LostKv:
        if got == 0:
            why = "zeros (never written, or cleared)"
        elif got in self.writers:
            owner, pos = self.writers[got]
            what = f"the state after req {owner}'s position {pos}" if state else f"req {owner}'s position {pos}"
            why = what + (" (another prefix)" if owner != rid else "")
        else:
            why = f"a value nobody wrote ({got & ((1 << 64) - 1):#x})"
        # the block is where the row lives: on the unified pool the physical row SGLang's table maps the slot to
        block = int(c.at(slot)) if c.translate is not None else slot
        return LostKv(rid=rid, step=self.step, space=c.space, component=c.name, layer=c.layer, position=position,
                      block=block, slot=slot, expected=f"{want:#x}", found=f"{got & ((1 << 64) - 1):#x}", whose=why)


class RowGuard:
    """Instrumentation of the request pool: SGLang's kernels index ``req_to_token`` rows from the tensor's base
    without a bound, so an allocation that outgrows its row writes the next row's first columns. Here the tensor
    lives in a buffer one row longer, whose last row (the canary) no request owns: a write past the last row lands
    in it and is reported, not past the allocation (a crash of the interpreter, or on a GPU an illegal address or
    another tensor's memory). Installed before anything holds the tensor (the tree, the runner, the future map)."""

    def __init__(self, req_pool):
        rows, width = req_pool.req_to_token.shape
        buffer = torch.zeros((rows + 1, width), dtype=req_pool.req_to_token.dtype, device=req_pool.req_to_token.device)
        buffer[:rows] = req_pool.req_to_token
        req_pool.req_to_token = buffer[:rows]
        self.req_pool, self.width, self.canary = req_pool, width, buffer[rows]

    def problem(self, reqs, owners, *, row_of) -> str | None:
        """Where a request's allocated KV (``kv_allocated_len``, the slots SGLang recorded in its row) outgrows the
        row, whose positions of which request were overwritten (``owners()``: row -> request id, asked only then); or a
        write into the canary. None if neither."""
        for req in reqs:
            allocated, row = req.kv.kv_allocated_len, row_of(req)
            if row is None or allocated <= self.width:
                continue
            spill = allocated - self.width
            victim = owners().get(row + 1)
            if row + 1 == len(self.req_pool.req_to_token):
                where = "the tensor's end (the canary row after the last request row)"
            else:
                holder = f"req {victim}'s" if victim else "a row no running request holds"
                where = f"row {row + 1}'s positions 0..{spill - 1} ({holder})"
            return (f"req {req.rid}: SGLang allocated {allocated} KV slots for it (kv_allocated_len) in a request row "
                    f"of {self.width} (req_to_token {tuple(self.req_pool.req_to_token.shape)}): the last {spill} "
                    f"went past its row {row}, over {where}")
        if bool(self.canary.any()):
            return (f"SGLang wrote past the last request row of req_to_token {tuple(self.req_pool.req_to_token.shape)}"
                    f" (columns {self.canary.nonzero().flatten().tolist()} of the row after it)")
        return None


def _draft_position(position: int, rejected: bool):
    """A writer's position as a failure names it: a rejected draft's KV or state is not the request's own."""
    return f"{position} (a rejected draft)" if rejected else position


def deferred_cow_and_clear(req_pool):
    """SGLang's ``ModelRunner._maybe_execute_deferred_mamba_cow_and_clear`` (0.5.23; 0.5.13: the mamba attention
    backend's ``_execute_deferred_mamba_cow_and_clear``) as a function of a batch, or None where the release has
    none. The model runner (backend) is stood in for by what the method reads of it (the request pool; a target
    worker)."""
    method = compat.deferred_mamba_cow_and_clear()
    if method is None:
        return None
    runner = SimpleNamespace(req_to_token_pool=req_pool, is_draft_worker=False)

    def run(batch) -> None:
        method(runner, SimpleNamespace(forward_mode=batch.forward_mode, mamba_clear_indices=batch.mamba_clear_indices,
                                       mamba_cow_src_indices=batch.mamba_cow_src_indices,
                                       mamba_cow_dst_indices=batch.mamba_cow_dst_indices))

    return run
