"""``poolfuzz doctor``: is the installed engine one the family can drive, and which configs run on it.

Exit status: 0 every entry point the family needs is there, 2 something it needs is absent or changed
("API CHANGED: ..."; ``poolfuzz run`` refuses with the same words), or the family does not load.
"""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser(
        "doctor", help="check the installed engine against what a family needs of it",
        description="Print the installed engine release, every engine entry point and feature the family "
                    "uses (present, absent or changed) and which configs it can run; exit 2 when something "
                    "the family needs is missing or changed.")
    p.add_argument("--family", metavar="NAME|module:factory",
                   help="pool family to check: builtin (default), sglang (its servers: a suite), sglang:scheduler, "
                        "sglang:decode, vllm or module:factory")
    p.set_defaults(handler=main)


def main(args) -> int:
    from poolfuzz.orchestration.plugins import resolve_members
    from poolfuzz.pools.config import CONFIGS

    plugins = resolve_members(args.family)
    for plugin in plugins:
        print(f"family: {plugin.name} ({plugin.target}, {plugin.origin})")
    printed, change = [], None
    for plugin in plugins:
        report = plugin.engine_report()
        if report in printed:  # a suite's members over one engine share its probes: printed once
            continue
        printed.append(report)
        if report is None:
            print("engine: none (the family's pools are its own: nothing external to check)")
            continue
        print(f"engine: {report.engine} {report.release}")
        width = max(len(p.need.label) for p in report.probes)
        for p in report.probes:
            kind = "needed  " if p.need.required else "optional"
            found = "" if p.status == "present" else f"  ({p.found}; expected {p.need.expected})"
            print(f"  {p.status:8} {kind} {p.need.label:{width}}  {p.need.used_for}{found}")
        change = change or report.change
    if change is not None:
        print(f"configs: none can run until the adapter is updated\n{change.verdict}")
        return 2
    runs, declined = [], []
    for name, config in CONFIGS.items():
        reasons = {plugin.name: plugin.unsupported_reason(config) for plugin in plugins}
        taking = [family for family, reason in reasons.items() if reason is None]
        if not taking:
            declined.append((name, "declined: " + "; ".join(
                reason if len(plugins) == 1 else f"{family}: {reason}" for family, reason in reasons.items())))
        else:
            runs.append((name, "runs" if len(plugins) == 1 else f"runs on {', '.join(taking)}"))
    print(f"configs: {len(runs)} of {len(CONFIGS)} run here")
    width = max(len(n) for n in CONFIGS)
    for name, verdict in runs + declined:
        print(f"  {name:{width}}  {verdict}")
    print("verdict: OK" if runs else "verdict: the family runs none of the built-in configs here")
    return 0 if runs else 2
