"""``poolfuzz run``: the main job — fuzz configs on a device within a budget, exit 1 on any failure.

Exit status: 0 nothing failed, 1 a failure was found (its artifact is written), 2 bad usage
(nothing written) or an engine whose API changed ("API CHANGED", no artifact), 3 under ``--strict``
when nothing failed but some config was tested less than asked, 130 interrupted before anything failed.
"""

from __future__ import annotations


import random

from poolfuzz.pools.config import CONFIGS
from poolfuzz.pools.family import BACKUP_MODES
from poolfuzz.pools.faults import FAULTS
from poolfuzz.strategies import DRAWN_NAME

DEFAULT_MINUTES = 1.0


def register(sub) -> None:
    run = sub.add_parser(
        "run", help="fuzz pool families and report any silent state loss",
        description="Fuzz pool families; exit 0 if nothing failed, 1 if a failure was found "
                    "(a JSON artifact is written for it), 2 on bad usage.")
    run.add_argument("--config", action="extend", nargs="+", metavar="NAME",
                     help=f"configs to fuzz (default all: {', '.join(CONFIGS)}); random: a config drawn by "
                          "Hypothesis in every example (alone or beside named ones)")
    run.add_argument("--config-file", action="append", metavar="FILE.toml",
                     help="also fuzz the configs this TOML file describes ([[config]] tables; start from "
                          "`poolfuzz configs --show NAME`)")
    run.add_argument("--device", default="auto", help="auto (CUDA if present; default), cpu, cuda or cuda:N")
    budget = run.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float,
                        help=f"wall-clock budget for the whole run (default {DEFAULT_MINUTES:g})")
    budget.add_argument("--examples", type=int, help="examples per config instead of a time budget")
    run.add_argument("--seed", type=int, help="seed (default: a fresh random one, printed so it can be reused)")
    run.add_argument("--faults", action="extend", nargs="+", default=[], metavar="ID",
                     help=f"switch on catalogue faults ({', '.join(FAULTS)})")
    run.add_argument("--backup-mode", choices=BACKUP_MODES,
                     help="the retraction backup path every config runs (default: the family's own resolution per "
                          "config; for --family sglang:decode, SGLang's --disaggregation-decode-retraction-backup)")
    run.add_argument("--workers", type=int, default=1,
                     help="processes that split configs and seeds (worker i uses cuda:i on several GPUs)")
    run.add_argument("--db", metavar="PATH|redis://HOST:PORT",
                     help="example database shared by workers and later runs: a directory (default "
                          ".hypothesis/examples, where a plain pytest looks too), redis://HOST:PORT "
                          "(needs the redis extra) or none")
    run.add_argument("--out", default="poolfuzz-failures", metavar="DIR",
                     help="where failure artifacts are written (default ./poolfuzz-failures/)")
    run.add_argument("--steps", type=int, default=40, help="steps per example (default 40)")
    run.add_argument("--shrink-seconds", type=float, default=60.0, metavar="S",
                     help="stop shrinking a failure after S seconds and keep the best so far (default 60)")
    run.add_argument("--family", metavar="NAME|module:factory",
                     help="pool family to fuzz: builtin (default), an installed plug-in such as sglang, "
                          "or package.module:factory (see the README)")
    run.add_argument("--known", action="append", default=[], metavar="PATH",
                     help="failures known already: an artifact, a directory of artifacts (a previous --out) or a "
                          "text file of signatures; they are counted, not reported, and fuzzing goes on past "
                          "them (repeatable)")
    run.add_argument("--waive", action="extend", nargs="+", default=[], metavar="CHECK",
                     help="checks that count their violations instead of failing, for a known bug that fires in "
                          "every example (see poolfuzz checks)")
    run.add_argument("--strict", action="store_true",
                     help="exit 3 when nothing failed but some config was tested less than asked (no step ran, or "
                          "the family declined most of its drawn configs)")
    run.add_argument("--coverage", metavar="DIR",
                     help="measure the reach of the run: which statements and branches of the family's engine code "
                          "every worker executed (coverage.py); prints a per-file table, writes JSON and HTML to DIR")
    run.add_argument("--coverage-add", action="store_true",
                     help="with --coverage DIR: add this run's reach to what DIR already holds from earlier measured "
                          "runs (other families of the same engine install), so the table is their union")
    run.set_defaults(handler=main)


def plan_from_args(args):
    """Validate every argument (nothing is written); the session plan, or a UsageError/ConfigError."""
    import os

    from poolfuzz.errors import UsageError
    from poolfuzz.orchestration.database import check_database
    from poolfuzz.orchestration.paths import check_writable_dir
    from poolfuzz.orchestration.session import Plan
    from poolfuzz.pools.config import get_config
    from poolfuzz.pools.family import resolve_device, resolved_backup_mode
    from poolfuzz.pools.faults import applicable_configs, get_fault

    if args.examples is not None and args.examples < 1:
        raise UsageError(f"--examples must be at least 1, got {args.examples}")
    if args.minutes is not None and not args.minutes > 0:
        raise UsageError(f"--minutes must be positive, got {args.minutes:g}")
    if args.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    if not args.shrink_seconds > 0:
        raise UsageError(f"--shrink-seconds must be positive, got {args.shrink_seconds:g}")
    if args.seed is not None and not 0 <= args.seed < 2**32:
        raise UsageError(f"--seed must be between 0 and 2**32-1, got {args.seed}")
    device = resolve_device(args.device)  # a ConfigError with the fix when there is no such device
    _warn_about_workers(args.workers, device)
    custom = _file_configs(args.config_file or [])
    names = list(dict.fromkeys(args.config or ([] if custom else CONFIGS)))
    for name in names:
        if name in custom:
            raise UsageError(f"config {name!r} is named by --config and defined in a --config-file; rename "
                             "it in the file (its name is what the run and its artifacts call it)")
        if name != DRAWN_NAME:
            get_config(name)
    names += list(custom)
    explicit = bool(args.config or custom)

    def config_of(name):
        return custom[name] if name in custom else get_config(name)

    faults = list(dict.fromkeys(args.faults))
    for fid in faults:
        get_fault(fid)
    if faults:
        for fid in faults:
            fits = applicable_configs(fid)
            misfit = [n for n in names if n != DRAWN_NAME and not get_fault(fid).applies_to(config_of(n))]
            if explicit and misfit:
                raise UsageError(f"fault {fid!r} does not apply to config {misfit[0]!r}; it applies to "
                                 f"{', '.join(fits)} (and drawn configs of that shape: --config random): pick "
                                 "those with --config or drop the fault")
        # A drawn config is drawn to fit the faults; a shape some built-in has proves they can meet.
        names = [n for n in names if (n == DRAWN_NAME and _some_config_takes(faults))
                 or (n != DRAWN_NAME and all(get_fault(f).applies_to(config_of(n)) for f in faults))]
        if not names:
            raise UsageError(f"no config takes all of the faults {', '.join(faults)} at once; "
                             "switch them on one at a time")
        for name in names:  # faults that change the same method, or live on different backup paths
            resolved_backup_mode(_some_config_takes(faults) if name == DRAWN_NAME else config_of(name), faults)
    if args.backup_mode is not None and DRAWN_NAME in names:
        raise UsageError(f"--backup-mode applies to named configs; a drawn config's backup path is the family's "
                         f"resolution of its shape: drop --config {DRAWN_NAME} or --backup-mode")
    if args.backup_mode is not None and not args.family:
        names = _configs_taking_backup(names, config_of, faults, args.backup_mode, explicit=explicit)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out {args.out!r} is a file; pass a directory for the failure artifacts")
    check_writable_dir(args.out, "--out")  # a failure found after an hour must have somewhere to go
    db = check_database(args.db)
    lanes_of: tuple = ()
    if args.family:
        if faults:
            raise UsageError(f"--faults switch on catalogue faults of the builtin family; family {args.family!r} "
                             "runs its own code as shipped: drop --faults or --family")
        names, lanes_of = _family_lanes(args.family, names, config_of, explicit=explicit, backup_mode=args.backup_mode)
    minutes = args.minutes if args.minutes is not None else (None if args.examples else DEFAULT_MINUTES)
    from poolfuzz.harness.failures import CHECKS, WAIVABLE
    from poolfuzz.orchestration.known import load_known

    known = tuple(dict.fromkeys(sig for path in args.known for sig in load_known(path)))
    waive = tuple(dict.fromkeys(args.waive))
    for check in waive:
        if check not in WAIVABLE:
            why = "cannot be waived (once pools and reference disagree, every later step would)" if check in CHECKS \
                else "is not a check"
            raise UsageError(f"--waive {check!r} {why}; waivable checks: {', '.join(sorted(WAIVABLE))}")
    if args.coverage is not None:
        from poolfuzz.orchestration.plugins import resolve_members
        from poolfuzz.orchestration.reach import engine_code_of, require_coverage

        require_coverage()
        engine_code_of(resolve_members(args.family))
        check_writable_dir(args.coverage, "--coverage")
    elif args.coverage_add:
        raise UsageError("--coverage-add adds to the reach in a --coverage DIR: give --coverage DIR too")
    return Plan(configs=tuple(names), device=args.device, faults=tuple(faults), backup_mode=args.backup_mode,
                known=known, waive=waive,
                seed=args.seed if args.seed is not None else random.SystemRandom().randrange(2**32),
                examples=args.examples, seconds=None if minutes is None else minutes * 60, steps=args.steps,
                db=db, out=args.out, workers=args.workers, shrink_seconds=args.shrink_seconds,
                family=args.family, lane_families=lanes_of, custom=tuple(custom.values()), coverage=args.coverage,
                coverage_add=args.coverage_add, strict=args.strict)


def _family_lanes(family: str, names: list[str], config_of, *, explicit: bool, backup_mode: str | None):
    """(configs, the family of each) for ``--family``: every chosen config once per family ``family`` names (one, or
    a suite's members) that runs it; a declined config is skipped with the reason, and a named config no family
    runs is bad usage. Each family's engine is checked and one of its servers built here first: a factory that
    raises or returns something else is bad usage (exit 2), not a failure found in the pools."""
    from poolfuzz.errors import UsageError
    from poolfuzz.orchestration.plugins import (ENGINE_PROGRAMS_OF, SUITES, probe_family, resolve_members,
                                                select_configs)

    plugins = resolve_members(family)
    suite = family in SUITES
    fixed = [config_of(n) for n in names if n != DRAWN_NAME]
    runs: list[tuple[str, str]] = []
    for plugin in plugins:
        plugin.check_engine()  # what `poolfuzz doctor` checks: an engine that changed is refused here, in its words
        drawn = DRAWN_NAME in names and not (plugin.drives_scheduler and not plugin.takes_drawn_configs)
        if DRAWN_NAME in names and not drawn and not suite:
            raise UsageError(f"family {plugin.name!r} drives the engine's own scheduler over named configs only; "
                             f"drop --config {DRAWN_NAME}" + (f" (or use --family {ENGINE_PROGRAMS_OF[plugin.name]}, "
                             "which takes drawn configs)" if plugin.name in ENGINE_PROGRAMS_OF else ""))
        # in a suite, a named config one member declines is another member's: only none running it is bad usage
        chosen, skipped = select_configs(plugin, fixed, explicit=explicit and not suite, backup_mode=backup_mode)
        for name, why in skipped:
            print(f"poolfuzz: family {plugin.name} skips {name}: {why}")
        # Drawn configs the family declines are rejected example by example, never reported.
        taken = {c.name for c in chosen}
        mine = [n for n in names if (n == DRAWN_NAME and drawn) or n in taken]
        if not mine:
            if not suite:
                raise UsageError(f"family {plugin.name!r} supports none of the chosen configs")
            continue
        probe = chosen[0] if chosen else next((c for c in CONFIGS.values() if plugin.unsupported_reason(c) is None),
                                              None)
        if probe is None:
            raise UsageError(f"family {plugin.name!r} supports none of the built-in configs; it cannot be probed")
        probe_family(plugin, probe, backup_mode=backup_mode)
        runs += [(n, plugin.name) for n in mine]
    if suite:
        run_by_none = [n for n in names if n not in {name for name, _ in runs}]
        if explicit and run_by_none:
            raise UsageError(f"no family of {family!r} ({', '.join(SUITES[family])}) runs config "
                             f"{run_by_none[0]!r} here (the reasons are above); drop it from --config")
        if not runs:
            raise UsageError(f"no family of {family!r} supports any of the chosen configs")
    # a lane per (family, config), grouped by config so a config's lanes sit together in the table
    order = {n: i for i, n in enumerate(names)}
    runs.sort(key=lambda run: order[run[0]])
    return [n for n, _ in runs], tuple(f for _, f in runs) if suite else ()


def _file_configs(paths) -> dict:
    """The configs of every --config-file, by name; a name twice (or ``random``) is a UsageError."""
    from poolfuzz.errors import UsageError
    from poolfuzz.pools.config_file import load_config_file

    out = {}
    for path in paths:
        for config in load_config_file(path):
            if config.name in out or config.name == DRAWN_NAME:
                raise UsageError(f"--config-file {path!r}: config name {config.name!r} is "
                                 f"{'reserved for drawn configs' if config.name == DRAWN_NAME else 'taken'}; "
                                 "rename it in the file")
            out[config.name] = config
    return out


def _configs_taking_backup(names, config_of, faults, backup_mode: str, *, explicit: bool) -> list[str]:
    """The builtin family's configs that run ``backup_mode`` (its own resolution says whether the pools carry every
    component through it); a named config that cannot is bad usage, a default one is skipped with the reason."""
    from poolfuzz.errors import UsageError
    from poolfuzz.pools.errors import ConfigError
    from poolfuzz.pools.family import resolved_backup_mode

    kept = []
    for name in names:
        try:
            resolved_backup_mode(config_of(name), faults, backup_mode)
        except ConfigError as exc:
            if explicit:
                raise UsageError(f"--backup-mode {backup_mode}: {exc}") from None
            print(f"poolfuzz: skips {name}: {exc}")
            continue
        kept.append(name)
    if not kept:
        raise UsageError(f"no chosen config runs --backup-mode {backup_mode}")
    return kept


def _some_config_takes(faults):
    """A built-in config every fault applies to (None: no shape takes them all together)."""
    from poolfuzz.pools.faults import get_fault

    return next((c for c in CONFIGS.values() if all(get_fault(f).applies_to(c) for f in faults)), None)


def _warn_about_workers(workers: int, device) -> None:
    """More workers than CPUs (or GPUs) only makes them take turns, each slower: say so, run anyway."""
    import os
    import sys

    if device.type == "cuda":
        import torch

        have, what = torch.cuda.device_count(), "GPUs"
    else:
        have, what = os.cpu_count() or 1, "CPUs"
    if workers > have:
        print(f"poolfuzz: warning: --workers {workers} is more than the {have} {what} here; the workers will "
              f"take turns on them, each slower (--workers {have} fuzzes as fast)", file=sys.stderr)


def main(args) -> int:
    from poolfuzz.orchestration.session import run_session

    plan = plan_from_args(args)
    if plan.coverage is not None:
        from poolfuzz.orchestration.reach import run_measured

        return run_measured(plan, run_session)
    return run_session(plan).exit_code
