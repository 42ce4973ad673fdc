"""``poolfuzz hunt``: print the detection matrix; exit 1 if a fault is missed or a clean run fails."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

from poolfuzz.pools.capabilities import factory_capabilities
from poolfuzz.pools.config import CONFIGS, get_config
from poolfuzz.pools.faults import FAULTS, applicable_configs, get_fault


def register(sub) -> None:
    p = sub.add_parser("hunt", help="measure whether and how fast each catalogue fault is found")
    p.add_argument("--faults", nargs="*", metavar="ID", help="faults to hunt (default: the whole catalogue)")
    p.add_argument("--config", action="append", metavar="NAME",
                   help="restrict to these configs (repeatable); random: configs drawn per example, of the "
                        "shapes each fault applies to")
    p.add_argument("--seeds", type=int, default=3, help="seeds per (fault, config) (default 3)")
    p.add_argument("--budget-examples", type=int, default=300, help="examples per seed before giving up")
    p.add_argument("--shrink-seconds", type=float, default=30.0, help="time to shrink each failure (default 30)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--json", metavar="FILE", help='write {"rows": [...]} to FILE')
    p.add_argument("--no-baseline", action="store_true", help="skip the no-fault (false alarm) runs")
    p.add_argument("--family", metavar="NAME|module:factory",
                   help="hunt on a plug-in family (its own code as shipped: the no-fault runs only, each "
                        "failure named by its signature)")
    p.set_defaults(handler=main)


def main(args) -> int:
    from poolfuzz.errors import UsageError
    from poolfuzz.orchestration.hunt import format_row, hunt_cell
    from poolfuzz.orchestration.runner import prepare_process
    from poolfuzz.pools.family import resolve_device
    from poolfuzz.strategies import DRAWN_NAME

    prepare_process()
    device = resolve_device(args.device)
    if args.seeds < 1 or args.budget_examples < 1:
        raise UsageError("--seeds and --budget-examples must be at least 1")
    factory = None
    if args.family and args.family != "builtin":
        from poolfuzz.orchestration.plugins import resolve_family

        if args.faults:
            raise UsageError(f"--faults are the builtin family's; family {args.family!r} runs its own code: "
                             "drop --faults or --family")
        factory = resolve_family(args.family).factory
        args.no_baseline = False  # a plug-in runs its own code: its no-fault cells are the hunt
    # The whole catalogue by default; none on a plug-in, whose code carries no catalogue fault.
    faults = [] if factory is not None else (args.faults or list(FAULTS))
    for fid in faults:
        get_fault(fid)
    configs = [n if n == DRAWN_NAME else get_config(n).name for n in args.config] if args.config else list(CONFIGS)
    cells = [(fid, c) for fid in faults for c in applicable_configs(fid) + [DRAWN_NAME] if c in configs]
    if factory is not None:
        reason = factory_capabilities(factory).unsupported_reason
        configs = [c for c in configs if c == DRAWN_NAME or reason is None or reason(get_config(c)) is None]
    if not cells and factory is None:
        raise UsageError("no chosen fault applies to the chosen configs; see `poolfuzz faults`")
    baseline = [] if args.no_baseline else [(None, c) for c in configs]
    print(f"{'fault':34} {'config':18} {'found':>6} {'med ex':>7} {'worst':>6} {'med s':>7} {'steps':>5} "
          f"{'short':>5}      signature")
    rows = []
    started = time.perf_counter()
    for fid, config in cells + baseline:
        row = hunt_cell(config, fid, seeds=args.seeds, budget=args.budget_examples,
                        shrink_seconds=args.shrink_seconds, device=device, family_factory=factory)
        rows.append(row)
        print(format_row(row), flush=True)
    missed = [r for r in rows if r.fault and r.detected < r.seeds]
    alarms = [r for r in rows if r.fault is None and r.detected]
    long = [r for r in rows if r.shrink_within_two is False]
    print(f"hunt: {len(cells)} fault cells, {len(cells) - len(missed)} found in every seed; "
          f"{len(alarms)} false alarm(s); {len(cells) - len(long)} shrunk within two steps of the shortest known "
          f"in every seed; {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"rows": [asdict(r) | {"shrink_within_two": r.shrink_within_two} for r in rows]}, fh,
                      indent=1)
    return 1 if missed or alarms else 0
