"""``poolfuzz shortest``: the shortest program of a small vocabulary that fails with these faults."""

from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("shortest", help="search every short program for the shortest that fails (with faults planted)")
    p.add_argument("--config", required=True, metavar="NAME", help="a named config (poolfuzz catalogue lists them)")
    p.add_argument("--faults", nargs="*", default=[], metavar="ID", help="catalogue faults to plant")
    p.add_argument("--max-steps", type=int, default=5,
                   help="longest program to try (default 5; each step multiplies the time by the branching)")
    p.add_argument("--backup-mode", default=None, help="retraction backup mode (default: the config's)")
    p.set_defaults(handler=main)


def main(args, out=None) -> int:
    from poolfuzz.errors import UsageError
    from poolfuzz.harness.program import new_engine
    from poolfuzz.harness.shortest import prompt_lengths, shortest_failure
    from poolfuzz.pools.config import get_config
    from poolfuzz.pools.faults import applicable_configs, get_fault

    out = out or sys.stdout
    if not 0 <= args.max_steps <= 12:
        raise UsageError(f"--max-steps {args.max_steps}: give 0 to 12 (the search grows exponentially with it)")
    config = get_config(args.config)
    for fid in args.faults:
        if not get_fault(fid).applies_to(config):
            raise UsageError(f"fault {fid!r} does not apply to config {config.name!r}; configs it applies to: "
                             f"{', '.join(applicable_configs(fid))}")
    prompts = prompt_lengths(config)
    out.write(f"searching every program of up to {args.max_steps} steps on {config.name} with faults "
              f"{', '.join(args.faults) or 'none'} (prompts {list(prompts)}; chunks of 1 or the rest; one "
              "request per decode, or all)\n")

    def build():
        return new_engine(config=config, faults=args.faults, backup_mode=args.backup_mode)

    def progress(length, explored):
        out.write(f"  no failing program of {length} steps ({explored:,} programs run so far)\n")
        out.flush()

    result, explored = shortest_failure(build, max_steps=args.max_steps, prompts=prompts, on_length=progress)
    if result is None:
        out.write(f"no program of up to {args.max_steps} steps fails ({explored:,} programs run)\n")
        return 0
    where = "at teardown (sweep, drain)" if result.in_teardown else f"at step {len(result.steps)}"
    out.write(f"shortest: {len(result.steps)} steps, fails {where} ({result.explored:,} programs run)\n"
              f"  {result.signature}: {result.failure}\n")
    for i, s in enumerate(result.steps, 1):
        out.write(f"  {i:3}  {s.op}({', '.join(f'{k}={v}' for k, v in s.args.items())})\n")
    return 1
