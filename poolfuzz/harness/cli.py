"""Command line: ``poolfuzz run`` fuzzes the built-in (or chosen) configs and prints a summary."""

from __future__ import annotations

import argparse
import sys
import time

from poolfuzz.pools.config import CONFIGS, get_config
from poolfuzz.pools.errors import ConfigError
from poolfuzz.pools.faults import FAULTS, get_fault
from poolfuzz.pools.family import resolve_device


class UsageError(Exception):
    """Bad input: printed as one line, exit status 2."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="poolfuzz", description="Property-based fuzzing of LLM serving memory pools.")
    sub = p.add_subparsers(dest="command", required=True)
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
    sub.add_parser("configs", help="list the built-in configs")
    sub.add_parser("faults", help="list the fault catalogue")
    return p


def run_cli(argv: list[str]) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the usage error
        return 2 if exc.code else 0
    try:
        if args.command == "configs":
            for name, c in CONFIGS.items():
                print(f"{name:20} {c.architecture:12} page_size={c.page_size} full={c.full_layers} "
                      f"swa={c.swa_layers} mamba={c.mamba_layers} kv={c.kv_dtype}")
            return 0
        if args.command == "faults":
            for f in FAULTS.values():
                print(f"{f.id:32} {f.upstream:16} {f.description}")
            return 0
        return _run(args)
    except (UsageError, ConfigError) as exc:
        print(f"poolfuzz: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    import torch

    from poolfuzz.harness.runner import run_machine

    # Per-step tensors are tiny: one intra-op thread per process is fastest and leaves the other
    # cores to other workers.
    torch.set_num_threads(1)
    device = resolve_device(args.device)
    names = args.config or list(CONFIGS)
    configs = [get_config(n) for n in names]
    for fid in args.faults:
        get_fault(fid)
    if args.faults:
        configs = [c for c in configs if all(get_fault(f).applies_to(c) for f in args.faults)]
        if not configs:
            raise UsageError(f"no chosen config is one the faults {args.faults} apply to; pick one with --config")
    if args.examples is not None and args.examples < 1:
        raise UsageError("--examples must be at least 1")
    minutes = args.minutes if args.minutes is not None else (None if args.examples else 1.0)
    deadline = None if minutes is None else time.monotonic() + minutes * 60
    results = []
    print(f"poolfuzz: {len(configs)} config(s) on {device}" + (f", faults {args.faults}" if args.faults else ""))
    for i, config in enumerate(configs):
        if deadline is not None:
            share = max(1.0, (deadline - time.monotonic()) / (len(configs) - i))
            examples = 1_000_000
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
            print("    " + result.program.replace("\n", "\n    "))
    failed = [r for r in results if not r.passed]
    print(f"poolfuzz: {len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0
