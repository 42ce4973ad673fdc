"""Capability audits: what a family declares (``uses_ssm_state``, ``cpu_copy_carries_mamba``)
against what its pools really do, seen through checksums."""

from __future__ import annotations

import torch

from poolfuzz.harness.checksums import row_checksums


def audit_predicate(engine, fail) -> None:
    """The SSM predicate and the backup mode agree with the family that was built."""
    fam = engine.families["prefill"]
    if fam.uses_ssm_state != fam.has_recurrent_state():
        has = "has" if fam.has_recurrent_state() else "has no"
        fail("ssm-predicate",
             f"uses_ssm_state({engine.config.name}) is {fam.uses_ssm_state} but the built family {has} "
             "recurrent-state components: backup decisions read the predicate and would silently "
             "take the wrong path", kind="predicate")
    if fam.backup_mode == "host_pool" and fam.has_recurrent_state():
        fail("backup-mode",
             f"{engine.config.name}: host_pool retraction backup chosen for a model with recurrent state; "
             "PD transfers its MAMBA state but a host_pool backup carries only full KV and SWA, so a "
             "retracted request would resume on a stale state", kind="predicate")


def audit_backup(engine, req, fail, state_checksum) -> None:
    """What the KV pool's CPU copy really carried (seen through checksums) vs what it declares."""
    fam = engine.families[req.node]
    backup = req.kv.retraction_backup
    ref = engine.refs[req.node].request(req.rid)
    if backup.mode != "cpu_tensor" or not fam.has_recurrent_state() or not ref.state:
        return
    specs = [s for s in engine.specs.values() if engine.state_types[s.space].recurrent]
    wanted = {state_checksum(s, ref.state) for s in specs}
    carried = checksums_in(backup.cpu_tensors, {s.row_shape for s in specs}) >= wanted
    in_mamba_cpu = backup.mamba_cpu is not None
    declared = type(fam.kv_pool).cpu_copy_carries_mamba
    name = type(fam.kv_pool).__name__
    if carried != declared:
        did = "carried" if carried else "did not carry"
        fail("carries-mamba",
             f"{name} declares cpu_copy_carries_mamba={declared} but its CPU copy of req {req.rid} {did} "
             "the recurrent state", req.node, space="mamba", kind="capability")
    if carried and in_mamba_cpu:
        fail("backed-up-twice",
             f"req {req.rid}: recurrent state backed up twice (by {name}.get_cpu_copy and in mamba_cpu)",
             req.node, space="mamba", kind="capability")


def checksums_in(payload, row_shapes: set[tuple[int, ...]]) -> set[int]:
    """Checksums of every row of every tensor in an opaque payload whose trailing shape fits."""
    out: set[int] = set()
    stack = [payload]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            for shape in row_shapes:
                k = len(shape)
                if obj.dim() >= k and tuple(obj.shape[-k:]) == shape and obj.numel():
                    out.update(row_checksums(obj.reshape(-1, *shape)).tolist())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dataclass_fields__"):
            stack.extend(getattr(obj, f) for f in obj.__dataclass_fields__)
    return out
