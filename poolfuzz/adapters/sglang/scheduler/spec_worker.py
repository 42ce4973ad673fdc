"""Speculative decoding (EAGLE / NEXTN, spec v2, top-k 2) on the SGLang scheduler path: the worker's models stood
in, the rest SGLang's own.

What runs is SGLang's: ``Scheduler.run_batch``'s synchronous spec-v2 branch (the forward isolation that undoes the
worker's edits of the batch, ``seq_lens`` advanced by the accepted tokens, the draft input carried to the next
round); ``ScheduleBatch.prepare_for_decode`` -> ``eagle_prepare_for_decode`` -> ``alloc_for_spec_decode`` (each round
a request's slots are topped up, page-aligned, to twice the draft reserve past what it has committed, and written into
its row by the ``assign_req_to_token_pool`` kernel); the verify window's ``assign_extend_cache_locs`` kernel;
``commit_mamba_states_after_verify`` (the accepted node's recurrent state out of the intermediate caches);
``_finalize_accept_tree_path`` (an accepted path off the window's front moved there: ``move_kv_cache``, the tokens
compacted); ``check_decode_mem`` and ``retract_decode`` with the spec-v2 estimate; ``EagleDraftInput.filter_batch`` /
``merge_batch``; the result processor's ``_resolve_spec_v2_tokens`` (``kv_committed_len``, outputs, finish), and
``release_kv_cache``, which frees a finished or retracted request's over-allocated slots. The kernels run in Triton's
interpreter (``shims``), so the real ``triton`` wheel must be installed (:func:`speculative_problem` says so).

What is stood in for, and why (``EAGLEWorkerV2`` loads a target and a draft model on a GPU):

* the target model's verify forward: :meth:`ModelRunner.verify` checks each request's context and state, writes the
  K and V of each tree node at the window's slots and the state after each into the request's intermediate-cache
  row, and gives the target's token after each node;
* the draft model's tree build (``build_tree_kernel_efficient``): the trees reach SGLang's greedy acceptance kernel
  (``verify_tree_greedy``, its Triton variant, interpreted) as the retrieve arrays it makes; the runner's own reading
  of which nodes the target accepts is checked against the kernel's;
* the draft model: it drafts a tree of ``speculative_num_draft_tokens - 1`` nodes after the request's last token, its
  shape and which nodes are right as the sequence's chain says (the vLLM worker's drafter decides the same way); its
  own KV pool and hidden states are not built, and the draft input it hands the next round carries zero top-k scores
  beside the real bonus tokens;
* ``run_eagle_verify`` itself, which needs a ``ForwardBatch`` of a model runner: the worker does its steps in its
  order, calling SGLang for each where one exists (the window's slots, acceptance, the mamba commit, the tree-path
  move), and keeps its own bookkeeping: ``new_seq_lens = seq_lens + accept_lens``, the bonus token (the target's
  after the last accepted node), ``out_cache_loc`` set as ``eagle_prepare_for_verify`` leaves it;
* the attention backend's ``update_mamba_state_after_mtp_verify`` runs unbound on a stand-in holding what it reads
  (the request pool, the batch's working mamba slots), and ``scatter_mamba_states_after_mtp_verify``'s fused Triton
  scatters, which refuse CPU tensors, are the backend's own torch scatter (``compat.torch_state_scatter``).

Checked besides the runner's contents: before each verify, no request's allocation outgrew its request row
(``runner.RowGuard``). Not driven yet: the overlap schedule, the extra buffer's state tracking under speculation, and
the PD decode and HiCache servers' speculative rounds.
"""

from __future__ import annotations

import dataclasses
import types

import torch

from poolfuzz.adapters.sglang.server_args import NO_MODEL
from poolfuzz.pools.config import ModelConfig
from poolfuzz.pools.errors import RowOverflow
from poolfuzz.pools.token_chain import chain_after, draft_choices, sampled_token

ALGORITHM = "NEXTN"  # a model's own MTP layers draft (SGLang runs it as EAGLE)
TOPK = 2  # a tree of drafts (a chain is one of its shapes)


def speculative_flags(config: ModelConfig) -> dict:
    """The speculative flags of the config's server: ``spec_draft_tokens`` verified a round, drafted as a tree of
    top-k 2 and one fewer steps."""
    if not config.spec_draft_tokens:
        return {}
    return dict(speculative_algorithm=ALGORITHM, speculative_num_draft_tokens=config.spec_draft_tokens,
                speculative_num_steps=config.spec_draft_tokens - 1, speculative_eagle_topk=TOPK,
                speculative_draft_model_path=NO_MODEL)


def speculative_problem(config: ModelConfig, driver_cls=None) -> str | None:
    """Why the scheduler path (the server ``driver_cls`` builds, by default ``SglangSchedulerDriver``'s) does not
    drive ``config``'s speculative server on this install, or None."""
    if not config.spec_draft_tokens:
        return None
    if driver_cls is not None and not driver_cls.drives_speculative:
        return f"{driver_cls.label} does not drive speculative decoding yet (sglang:scheduler does)"
    from poolfuzz.adapters.sglang import compat
    from poolfuzz.adapters.sglang.api import load
    from poolfuzz.adapters.sglang.shims import install

    load()  # SGLang imported behind the CPU shims
    if missing := compat.spec_v2_missing():
        return (f"SGLang {compat.release()} lacks what a synchronous spec-v2 round of its scheduler runs on a CPU "
                f"({', '.join(missing)}): speculative decoding is driven from 0.5.20 on")
    if install().get("triton") == "stand-in":
        return ("SGLang's speculative allocation launches Triton kernels (assign_req_to_token_pool, "
                "assign_extend_cache_locs), which run on a CPU in Triton's interpreter: install the real triton wheel "
                "(pip install triton, or ci/sglang-install.sh VENV VERSION --triton)")
    if config.mamba_track_slots:
        return "speculative decoding with the extra buffer's state tracking is not driven yet"
    return None


class SpecWorker:
    """``EAGLEWorkerV2`` as ``Scheduler.run_batch`` calls it: an extend is the target's prefill, a decode a verify
    round of the drafter's tree (see the module)."""

    def __init__(self, *, runner, family, config: ModelConfig, vocab: int, server, guard):
        from poolfuzz.adapters.sglang import compat
        from poolfuzz.adapters.sglang.pools.server_models import hf_model_config

        self.runner, self.server, self.guard = runner, server, guard
        self.vocab = vocab
        self.draft_tokens = config.spec_draft_tokens
        self.steps = config.spec_draft_tokens - 1
        self.m = compat.spec_v2_modules()
        self.req_pool = family.sg_req_pool
        self.rounds = self.drafts_accepted = self.drafts_verified = 0
        self.paths_moved = 0  # accepted paths that were not the window's front (their KV moved by SGLang)
        self._target = compat.verify_commit_target(family, hf_model_config(config)) if config.has_mamba else None

    @classmethod
    def attached(cls, driver, *, vocab: int) -> "SpecWorker":
        """The worker of ``driver``'s server (a ``SglangSchedulerDriver``): its ``model_worker``, as ``run_batch`` and
        the result processor read it, with the rest of what ``run_batch`` reads (``compat.run_batch_state``)."""
        from poolfuzz.adapters.sglang import compat

        server = driver.server
        worker = cls(runner=driver.runner, family=driver.family, config=driver.config, vocab=vocab, server=server,
                     guard=driver.row_guard)
        server.__dict__.update(compat.run_batch_state(model_worker=worker, spec_algorithm=server.spec_algorithm,
                                                      req_to_token_pool=server.req_to_token_pool))
        # the result processor (a frozen dataclass) with this worker, wherever the server and its loop hold it
        processor = dataclasses.replace(driver.loop.processor, model_worker=worker)
        driver.loop.processor = server.result_processor = processor
        return worker

    # --- what run_batch and the result processor call ---------------------------------------------
    def forward_batch_generation(self, batch, **kwargs):
        if batch.forward_mode.is_extend():
            tokens = self.runner.forward(batch)
            bonus = torch.tensor(tokens, dtype=torch.int64)
            # spec v2: an extend leaves seq_lens at the prompt; the sampled token is the next round's verify root
            return self.m.GenerationBatchResult(next_token_ids=bonus, new_seq_lens=batch.seq_lens,
                                                next_draft_input=self._draft_input(bonus))
        return self._verify(batch)

    def _check_rows(self, batch) -> None:
        """Before the forward reads the rows: no request's allocation this round outgrew its request row
        (``runner.RowGuard``), and which request's row it overwrote, where one holds it."""
        from poolfuzz.adapters.sglang import compat

        def owners() -> dict:  # the batch's own requests hold their rows, whatever the release's checker lists
            holders = [*batch.reqs, *compat.requests_owning_rows(self.server)]
            return {compat.request_row(req): req.rid for req in holders}

        problem = self.guard.problem(batch.reqs, owners, row_of=compat.request_row)
        if problem:
            raise RowOverflow(f"step {self.runner.step + 1}: {problem}")

    def on_verify_complete_cpu(self, num_correct_drafts, batch_size: int) -> None:
        """The adaptive controller's hook (a no-op for a fixed draft length, as in BaseSpecWorker)."""

    # --- a verify round ----------------------------------------------------------------------------
    def _verify(self, batch):
        from poolfuzz.adapters.sglang import compat

        self._check_rows(batch)
        bs = len(batch.reqs)
        d = self.draft_tokens
        locs = compat.verify_cache_locs(self.m, req_pool_indices=batch.req_pool_indices,
                                        req_to_token=self.req_pool.req_to_token, start_offset=batch.seq_lens,
                                        draft_token_num=d)
        trees = [self._draft(self.runner.tokens[req.rid]) for req in batch.reqs]
        predict, paths = self.runner.verify(batch, locs=locs.tolist(), trees=trees)
        predicted, accept_index, accept_lens = self._accept(batch, trees, predict)
        want = [[i * d + node for node in path] for i, path in enumerate(paths)]
        got = [row[:n] for row, n in zip(accept_index.tolist(), accept_lens.tolist())]
        if got != want:  # SGLang's acceptance kernel against the target's tokens on the drafted trees
            raise AssertionError(f"step {self.runner.step}: verify_tree_greedy accepted nodes {got}, but the target's "
                                 f"tokens accept {want} (trees {trees})")
        if self._target is not None:
            with compat.torch_state_scatter():
                self.m.commit_mamba_states_after_verify(self._target(batch), batch, accept_lens, accept_index, d)
        bonus = torch.tensor([predict[i * d + path[-1]] for i, path in enumerate(paths)], dtype=torch.int32)
        predict = predicted
        if TOPK > 1:  # the accepted path's KV to the front of the window, its tokens with it (the verify's own code)
            batch.out_cache_loc = locs  # as eagle_prepare_for_verify leaves it (run_batch's isolation restores it)
            predict = self.m.finalize_accept_tree_path(batch, accept_index, accept_lens, predict,
                                                       types.SimpleNamespace(hidden_states=None), bs,
                                                       token_to_kv_pool_allocator=batch.token_to_kv_pool_allocator,
                                                       num_draft_tokens=d)
        self.rounds += 1
        self.drafts_verified += bs * self.steps
        self.drafts_accepted += int(accept_lens.sum()) - bs
        self.paths_moved += sum(path != list(range(len(path))) for path in paths)
        return compat.verify_result(self.m, next_token_ids=predict, accept_lens=accept_lens, accept_index=accept_index,
                                    new_seq_lens=batch.seq_lens + accept_lens.to(batch.seq_lens.dtype),
                                    speculative_num_draft_tokens=d, next_draft_input=self._draft_input(bonus))

    def _accept(self, batch, trees, targets: list[int]):
        """``eagle_sample``'s greedy acceptance by SGLang's own ``verify_tree_greedy`` kernel (its Triton variant, the
        one an XPU launches; interpreted here) over the drafted trees, given as the draft model's tree build hands
        them: each node's token (``candidates``), first child (``retrieve_next_token``) and next sibling
        (``retrieve_next_sibling``), and the target's token after each node. Returns the kernel's ``predict``,
        ``accept_index`` and accept lengths (drafts accepted, plus the bonus)."""
        bs, d = len(trees), self.draft_tokens
        candidates = torch.zeros((bs, d), dtype=torch.int64)
        first_child = torch.full((bs, d), -1, dtype=torch.int64)
        next_sibling = torch.full((bs, d), -1, dtype=torch.int64)
        for i, (req, tree) in enumerate(zip(batch.reqs, trees)):
            candidates[i, 0] = self.runner.tokens[req.rid].ids[-1]
            last_child: dict[int, int] = {}
            for node, (parent, token) in enumerate(tree, start=1):
                candidates[i, node] = token
                if parent in last_child:
                    next_sibling[i, last_child[parent]] = node
                else:
                    first_child[i, parent] = node
                last_child[parent] = node
        retrieve_index = torch.arange(bs * d, dtype=torch.int64).view(bs, d)
        predict = torch.zeros(bs * d, dtype=torch.int32)
        accept_index = torch.full((bs, self.steps + 1), -1, dtype=torch.int32)
        correct = torch.zeros(bs, dtype=torch.int32)
        self.m.verify_tree_greedy(predict, accept_index, correct, candidates, retrieve_index, first_child, next_sibling,
                                  target_predict=torch.tensor(targets, dtype=torch.int64).view(bs, d))
        return predict, accept_index, correct + 1

    def _draft(self, tokens) -> list[tuple[int, int]]:
        """The drafter's tree after the request's last token: ``speculative_num_draft_tokens - 1`` nodes, each
        ``(parent, token)`` with an earlier parent that has fewer than top-k children (node 0 is the last token), each
        right (the token the model samples after its parent's path; at most one child of a node) or wrong, as the
        sequence's chain says (a fresh hash of it per node), so trees of every shape SGLang's top-k drafter makes, and
        every accepted length, are drafted."""
        start = len(tokens.ids) - 1
        root = tokens.chain(start)
        chains, depths, children, right_child, nodes = [root], [0], [0], set(), []
        for j in range(1, self.draft_tokens):
            choices = draft_choices(root, j)  # the node's own draw, however many nodes there are
            open_parents = [p for p in range(j) if children[p] < TOPK]
            parent = open_parents[choices % len(open_parents)]
            want = sampled_token(chains[parent], self.vocab)
            right = parent not in right_child and (choices >> 8) & 1
            token = want if right else (want + j) % self.vocab
            if right:
                right_child.add(parent)
            children[parent] += 1
            children.append(0)
            nodes.append((parent, token))
            depths.append(depths[parent] + 1)
            chains.append(chain_after(chains[parent], token, start + depths[-1]))
        return nodes

    def _draft_input(self, bonus: torch.Tensor):
        """What the draft model hands the next round: the bonus tokens (the verify roots) and its top-k, here zero."""
        n = len(bonus)
        return self.m.EagleDraftInput(topk_p=torch.zeros((n, TOPK), dtype=torch.float32),
                                      topk_index=torch.zeros((n, TOPK), dtype=torch.int64), hidden_states=None,
                                      bonus_tokens=bonus)

