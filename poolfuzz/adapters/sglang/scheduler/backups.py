"""The CPU trap of a retraction backup: on a CPU, ``tensor.to("cpu", non_blocking=True)`` returns the tensor itself, and
indexing with a 0-d slot tensor gives a view, so a CPU "backup" can alias the live slot it was taken from; on a GPU the
same call copies. Each tensor of a backup that shares storage with a live pool buffer is copied right after SGLang's
``offload_kv_cache`` returns (before any slot is released) and recorded in ``family.cpu_aliases``, so the run sees
what a GPU would do."""

from __future__ import annotations

import torch


def unalias_backup(sg, family, rid: str) -> None:
    """The CPU trap (see the module): copy every tensor of request ``sg``'s retraction backup that shares storage
    with one of ``family``'s live pool buffers, as a GPU's device-to-host copy gives the backup its own memory, and
    record each in ``family.cpu_aliases`` under ``rid``. Called right after SGLang's ``offload_kv_cache`` returns,
    before any of the request's slots is freed (around ``retract_decode``)."""
    live = {_storage_ptr(c.tensor) for c in family.components()}  # the buffers SGLang reads
    hits: list[str] = []

    def fix(obj, path):
        if isinstance(obj, torch.Tensor):
            if obj.device.type == "cpu" and _storage_ptr(obj) in live:
                hits.append(f"{path} {tuple(obj.shape)}")
                return obj.clone()
            return obj
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return type(obj)(*(fix(v, f"{path}.{f}") for f, v in zip(obj._fields, obj)))
        if isinstance(obj, (list, tuple)):
            return type(obj)(fix(v, f"{path}[{i}]") for i, v in enumerate(obj))
        if isinstance(obj, dict):
            return {k: fix(v, f"{path}[{k!r}]") for k, v in obj.items()}
        return obj

    kv = getattr(sg, "kv", sg)  # 0.5.23 keeps the backup on req.kv
    for holder in (kv, sg):
        if getattr(holder, "retraction_backup", None) is not None:
            holder.retraction_backup = fix(holder.retraction_backup, "retraction_backup")
            break
        if getattr(holder, "kv_cache_cpu", None) is not None:
            holder.kv_cache_cpu = fix(holder.kv_cache_cpu, "kv_cache_cpu")
            break
    if hits:
        family.cpu_aliases.append((rid, tuple(hits)))


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()
