"""SGLang's paged allocator calls, with the keywords the installed release accepts; its switch for pools that move
rows with torch."""

from __future__ import annotations


import torch

from poolfuzz.adapters.sglang.api import accepted_kwargs, switched_on


def _dev_tensor(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def paged_alloc_extend(allocator, *, prefix_len: int, seq_len: int, last_loc: int, **extra):
    """One request's ``alloc_extend`` with the keywords this release takes."""
    dev = allocator.device
    kwargs = dict(prefix_lens=_dev_tensor([prefix_len], dev), prefix_lens_cpu=torch.tensor([prefix_len]),
                  seq_lens=_dev_tensor([seq_len], dev), seq_lens_cpu=torch.tensor([seq_len]),
                  last_loc=_dev_tensor([last_loc], dev), extend_num_tokens=seq_len - prefix_len, **extra)
    fn = allocator.alloc_extend if not extra else allocator.alloc_extend_swa_tail
    return fn(**accepted_kwargs(fn, **kwargs))


NATIVE_MOVE = "SGLANG_NATIVE_MOVE_KV_CACHE"


def native_kv_move():
    """Build pools that move rows with SGLang's native (torch indexing) move."""
    return switched_on(NATIVE_MOVE)
