"""``poolfuzz replay FILE``: re-run a failure artifact's program step by step and report.

Exit status: 1 the failure reproduces, 0 it does not (the bug may be fixed), 2 bad input or an engine
whose API changed ("API CHANGED": the replay cannot say either way).
An artifact recorded on CUDA replays on CPU and the other way round: the program is engine
operations, and the checks compare checksums, not device pointers.
"""

from __future__ import annotations


import sys


def register(sub) -> None:
    p = sub.add_parser("replay", help="replay a failure artifact step by step; exit 1 if it reproduces",
                       description="Replay a failure artifact's program deterministically; exit 1 if the failure "
                                   "reproduces, 0 if it does not, 2 on bad input.")
    p.add_argument("file", metavar="FILE", help="a JSON artifact written by poolfuzz run")
    p.add_argument("--device", default="auto", help="auto (CUDA if present; default), cpu, cuda or cuda:N")
    p.add_argument("--family", metavar="NAME|module:factory",
                   help="trust this pool family: an artifact that names a module:factory (not an installed "
                        "plug-in) replays only when it is passed here, since a file never chooses code to run")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="also show the recorded outcome of each step and every live request after it")
    p.set_defaults(handler=main)


def main(args, out=None) -> int:
    from poolfuzz.errors import reraise_api_change
    from poolfuzz.harness.program import new_engine
    from poolfuzz.orchestration import artifacts
    from poolfuzz.pools.family import resolve_device

    out = out or sys.stdout
    art, config, faults, options = artifacts.load_checked(args.file, trusted_family=args.family)
    out.write(artifacts.renamed_note(art))
    device = resolve_device(args.device)
    scheduled = False
    if art.family != "builtin":  # a factory that cannot build a family is bad usage, not a reproduction
        from poolfuzz.orchestration.plugins import probe_family, resolve_family

        plugin = resolve_family(art.family)
        plugin.check_engine()  # an engine whose API changed: "API CHANGED", exit 2, never a reproduction
        scheduled = plugin.drives_scheduler
        probe_family(plugin, config, device=device, faults=faults, backup_mode=art.backup_mode)
    if art.program and scheduled != artifacts.is_scheduler_program(art):
        from poolfuzz.errors import UsageError

        raise UsageError(f"artifact {args.file}: its program is {'engine' if scheduled else 'scheduler'} operations, "
                         f"but family {art.family!r} {'drives the engine scheduler' if scheduled else 'takes engine operations'}; "
                         "re-record it with poolfuzz run")
    w = out.write
    family = "" if art.family == "builtin" else f"family {art.family}, "
    w(f"replaying {args.file}\n  {family}config {art.config}, faults {', '.join(faults) or 'none'}, backup mode "
      f"{art.backup_mode}; recorded on {art.device} ({art.status}), replaying on {device}\n"
      f"  recorded: {art.failure}\n")
    if scheduled:
        return _replay_scheduled(w, art, config, device, artifacts.family_factory(art.family))
    try:
        engine = new_engine(config=config, device=device, faults=faults, backup_mode=art.backup_mode,
                            options=options, family_factory=artifacts.family_factory(art.family))
    except Exception as exc:  # the engine's audits run at construction: a failure at step 0
        reraise_api_change(exc)
        w("\nREPRODUCED at step 0 (building the families):\n")
        _report(w, exc, art, op="init")
        return 1
    _pools(w, art, engine.pools_origin)
    with engine:  # a family's storage threads and files go when the replay ends
        return _replay_steps(w, engine, art, device, args.verbose)


def _replay_steps(w, engine, art, device, verbose: bool) -> int:
    from poolfuzz.errors import reraise_api_change
    from poolfuzz.harness.program import replay

    w(f"     0  start\n          {engine.occupancy()}\n")
    for ev in replay(engine, art.program):
        label = "teardown: sweep, drain" if ev.step is None else _call(ev.step)
        if ev.cannot_run:
            w(f"{ev.index:6}  {label}\n\ndid not reproduce: step {ev.index} cannot run here: {ev.cannot_run}; "
              "the pools behaved differently before the recorded failure: the bug may be fixed\n")
            return 0
        w(f"{ev.index:6}  {label}" + (f"  -> {ev.outcome}" if ev.outcome else "") + "\n")
        if verbose and ev.step is not None and ev.step.outcome and ev.step.outcome != ev.outcome:
            w(f"          recorded: {ev.step.outcome}\n")
        w(f"          {ev.occupancy}\n")
        if verbose:
            for line in _requests(engine):
                w(f"          {line}\n")
        if ev.failure is not None:
            reraise_api_change(ev.failure)  # the engine, not the bug: "API CHANGED", exit 2
            where = "the teardown checks" if ev.step is None else f"step {ev.index} ({ev.step.op})"
            w(f"\nREPRODUCED at {where}:\n")
            _report(w, ev.failure, art, op=None if ev.step is None else ev.step.op)
            return 1
    w(f"\ndid not reproduce: the bug may be fixed (all {len(art.program)} steps and the teardown checks passed "
      f"on {device})\n")
    return 0


def _replay_scheduled(w, art, config, device, factory) -> int:
    """A scheduler program (``--family vllm``) on a fresh server: the engine's scheduler decides again."""
    from poolfuzz.errors import reraise_api_change
    from poolfuzz.harness.scheduled import INIT_OP, replay, scheduled_machine

    # the retraction path the failing server ran (a decode server's resolved backup, or the one its run named)
    machine = scheduled_machine(config, driver_factory=lambda model: factory(model, device=device, faults=(),
                                                                             backup_mode=art.backup_mode))
    w("     0  start (the engine's scheduler, fed by the worker stand-in)\n")
    told = False
    for ev in replay(machine, art.program):
        if not told and ev.pools_origin is not None:
            told = True
            _pools(w, art, ev.pools_origin)
        label = "build the server" if ev.index == 0 else ("teardown: drain" if ev.step is None else _call(ev.step))
        if ev.cannot_run:
            w(f"{ev.index:6}  {label}\n\ndid not reproduce: step {ev.index} cannot run here: {ev.cannot_run}; "
              "the scheduler behaved differently before the recorded failure: the bug may be fixed\n")
            return 0
        if ev.index:
            w(f"{ev.index:6}  {label}\n")
        if ev.failure is not None:
            reraise_api_change(ev.failure)  # the engine, not the bug: "API CHANGED", exit 2
            where = ("building the server" if ev.index == 0 else "the teardown checks" if ev.step is None
                     else f"step {ev.index} ({ev.step.op})")
            w(f"\nREPRODUCED at {where}:\n")
            # the build's failure is judged at the operation a run records it under (the server's start, "init")
            op = INIT_OP if ev.index == 0 else None if ev.step is None else ev.step.op.removeprefix("scheduler.")
            _report(w, ev.failure, art, op=op)
            return 1
    w(f"\ndid not reproduce: the bug may be fixed (all {len(art.program)} steps and the teardown checks passed "
      f"on {device})\n")
    return 0


def _pools(w, art, origin) -> None:
    """Who built the pools the replay runs on, and, where the recorded run's were built otherwise, those: a
    failure recorded on the engine's own pools and replayed on the adapter's wiring (or back) tests other code."""
    from poolfuzz.orchestration.display import POOLS_BUILT_BY

    if origin is None:
        return  # the family does not say
    recorded = art.pools is None or art.pools == origin.to_json()
    if origin.built_by == "poolfuzz" and recorded:
        return  # the built-in family: no engine code to name
    w(f"          pools: {POOLS_BUILT_BY[origin.built_by]} ({origin.detail})\n")
    if not recorded:
        w(f"          recorded on other pools: {POOLS_BUILT_BY[art.pools['built_by']]} ({art.pools['detail']})\n")


def _call(step) -> str:
    return f"{step.op}({', '.join(f'{k}={v!r}' for k, v in step.args.items())})"


def _requests(engine) -> list[str]:
    rows = []
    for rid, req in sorted(engine.requests.items()):
        kv = req.kv
        mamba = "" if kv.mamba_pool_idx is None else f" mamba slot {kv.mamba_pool_idx}"
        rows.append(f"req {rid}: {req.phase.value} on {req.node}, seqlen {kv.seqlen}, committed "
                    f"{kv.kv_committed_len}, row {kv.req_pool_idx}{mamba}")
    return rows or ["no live requests"]


def _report(w, exc: BaseException, art, *, op: str | None) -> None:
    """The failure replayed, field by field, and whether it is the one recorded. ``op``: the operation of the
    step it came from (None: the teardown), which a crash, carrying no divergence of its own, is judged by."""
    from poolfuzz.harness.failures import PoolfuzzFailure, message_of, signature_of

    w(f"{message_of(exc)}\n")
    d = exc.divergence.to_json() if isinstance(exc, PoolfuzzFailure) else {}
    if d:
        rows = [("kind", d.get("kind")), ("step", f"{d.get('step')} ({d.get('op')})"),
                ("request", _opt(d.get("rid")) + (f" on node {d['node']}" if d.get("node") else "")),
                ("component", _opt(d.get("component")) + (f", layer {d['layer']}" if d.get("layer") is not None else "")),
                ("position", _opt(d.get("position"))),
                ("slots", f"before {_opt(d.get('slot_before'))}, after {_opt(d.get('slot_after'))}"),
                ("expected", _opt(d.get("expected"))), ("found", _opt(d.get("found"))),
                ("detail", d.get("detail") or "-")]
        for k, v in rows:
            w(f"  {k:10} {v}\n")
    recorded = art.divergence or {}
    if d:
        same = (type(exc).__name__ == art.error_type
                and all(d.get(k) == recorded.get(k) for k in ("kind", "op", "rid", "component", "layer")))
    else:  # a crash: the same exception class at the same operation, as its signature names it
        same = signature_of(exc, in_teardown=op is None, op=op) == art.signature
    w("the same failure as recorded\n" if same else f"a different failure than recorded ({art.failure})\n")


def _opt(v) -> str:
    return "-" if v is None else str(v)
