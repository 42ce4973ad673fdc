"""``poolfuzz run``: the main job — fuzz configs on a device within a budget, exit 1 on any failure."""

from __future__ import annotations

import time

from poolfuzz.pools.config import CONFIGS, get_config
from poolfuzz.pools.family import resolve_device
from poolfuzz.pools.faults import FAULTS, get_fault


def register(sub) -> None:
    run = sub.add_parser("run", help="fuzz pool families and report any silent state loss")
    run.add_argument("--config", action="append", metavar="NAME",
                     help=f"config to fuzz (repeatable; default all: {', '.join(CONFIGS)})")
    run.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda or cuda:N")
    budget = run.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, help="wall-clock budget for the whole run (default 1)")
    budget.add_argument("--examples", type=int, help="examples per config instead of a time budget")
    run.add_argument("--seed", type=int, help="seed for Hypothesis (default: derandomized)")
    run.add_argument("--faults", nargs="*", default=[], metavar="ID",
                     help=f"switch on catalogue faults ({', '.join(FAULTS)})")
    run.add_argument("--steps", type=int, default=40, help="steps per example (default 40)")
    run.set_defaults(handler=main)


def main(args) -> int:
    import torch

    from poolfuzz.harness.cli import UsageError
    from poolfuzz.harness.runner import run_machine

    # Per-step tensors are tiny: one intra-op thread per process is fastest and leaves the other
    # cores to other workers.
    torch.set_num_threads(1)
    device = resolve_device(args.device)
    configs = [get_config(n) for n in (args.config or list(CONFIGS))]
    for fid in args.faults:
        get_fault(fid)
    if args.faults:
        configs = [c for c in configs if all(get_fault(f).applies_to(c) for f in args.faults)]
        if not configs:
            raise UsageError(f"no chosen config is one the faults {args.faults} apply to; pick one with --config")
    if args.examples is not None and args.examples < 1:
        raise UsageError("--examples must be at least 1")
    if args.minutes is not None and args.minutes <= 0:
        raise UsageError("--minutes must be positive")
    minutes = args.minutes if args.minutes is not None else (None if args.examples else 1.0)
    deadline = None if minutes is None else time.monotonic() + minutes * 60
    results = []
    print(f"poolfuzz: {len(configs)} config(s) on {device}" + (f", faults {args.faults}" if args.faults else ""))
    for i, config in enumerate(configs):
        if deadline is not None:
            share, examples = max(1.0, (deadline - time.monotonic()) / (len(configs) - i)), 1_000_000
        else:
            share, examples = None, args.examples
        result = run_machine(config, device=device, faults=args.faults, max_examples=examples,
                             steps_per_example=args.steps, seed=args.seed, time_budget=share)
        results.append(result)
        status = "PASS" if result.passed else "FAIL"
        print(f"  {config.name:20} {status}  {result.examples} examples, {result.steps} steps, "
              f"{result.steps / max(result.seconds, 1e-9):.0f} steps/s", flush=True)
        if not result.passed:
            print(f"    {result.failure}")
            for step in result.engine_steps:
                print(f"      {step!r}")
    failed = [r for r in results if not r.passed]
    print(f"poolfuzz: {len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0
