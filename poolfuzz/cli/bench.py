"""``poolfuzz bench``: measure and print checksum bandwidth, steps per second and time to #35957."""

from __future__ import annotations

import json

from poolfuzz.orchestration import bench as figures
from poolfuzz.pools.family import resolve_device


def register(sub) -> None:
    p = sub.add_parser("bench", help="measure checksum bandwidth, steps per second and time to first failure")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda or cuda:N")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON to FILE")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads for the bandwidth figures (default 1, what poolfuzz run uses)")
    p.add_argument("--buffer-mib", type=int, default=256, help="checksummed buffer size (default 256 MiB)")
    p.add_argument("--row-bytes", type=int, default=4096, help="bytes per slot row (default 4096)")
    p.add_argument("--reps", type=int, default=7, help="interleaved passes per bandwidth figure (default 7)")
    p.add_argument("--examples", type=int, default=100, help="examples per steps-per-second run (default 100)")
    p.add_argument("--seeds", type=int, default=5, help="seeds for the time to first failure (default 5)")
    p.add_argument("--step-reps", type=int, default=3,
                   help="runs per steps-per-second figure, the best one reported (default 3)")
    p.add_argument("--quick", action="store_true",
                   help="tiny sizes and budgets: checks that the bench runs, its figures mean little")
    p.set_defaults(handler=main)


def main(args) -> int:
    import torch

    from poolfuzz.errors import UsageError

    if min(args.threads, args.reps, args.examples, args.seeds, args.step_reps) < 1:
        raise UsageError("--threads, --reps, --examples, --seeds and --step-reps must be at least 1")
    if args.buffer_mib < 1 or args.row_bytes < 8 or args.row_bytes % 8:
        raise UsageError("--buffer-mib must be >= 1 and --row-bytes a positive multiple of 8")
    if args.quick:
        args.buffer_mib, args.reps, args.examples, args.seeds, args.step_reps = min(args.buffer_mib, 8), 2, 5, 1, 1
    device = resolve_device(args.device)
    results: dict = {"device": str(device), "torch": torch.__version__, "threads": args.threads}
    print(f"poolfuzz bench on {device} (torch {torch.__version__})", flush=True)

    results.update(figures.bandwidth(device, mib=args.buffer_mib, row_bytes=args.row_bytes, reps=args.reps,
                                     threads=args.threads))
    from poolfuzz.orchestration.runner import prepare_process

    prepare_process()  # what poolfuzz run's workers do before fuzzing
    results.update(figures.steps(device, examples=args.examples, small_tokens=figures.SMALL_TOKENS,
                                 large_tokens=figures.LARGE_TOKENS, reps=args.step_reps))
    results.update(figures.engine_steps(device, examples=args.examples, reps=args.step_reps))
    results.update(figures.first_failure(device, seeds=args.seeds))
    results["targets"] = figures.verdicts(results, device.type)

    print_table(results)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, sort_keys=True)
            fh.write("\n")
        print(f"wrote {args.json}")
    return 0


def print_table(results: dict) -> None:
    rows = [
        ("checksum_gbps", "GB/s", "per-slot checksums of a bf16 buffer"),
        ("sum_gbps", "GB/s", "plain sum over rows, same bytes"),
        ("copy_gbps", "GB/s", "device copy, same bytes"),
        ("checksum_ratio", "", "checksum / sum"),
        ("checksum_vs_copy", "", "checksum / copy"),
        ("steps_per_second", "steps/s", f"{figures.DEFAULT_CONFIG}, {results.get('token_slots', '?')} token slots"),
        ("steps_per_second_large", "steps/s", f"{figures.DEFAULT_CONFIG}, {results.get('token_slots_large', '?')} token slots"),
        ("scaling_ratio", "", "large / small"),
        ("steps_per_second_builtin", "steps/s",
         f"{figures.DEFAULT_CONFIG} as built in, {results.get('token_slots_builtin', '?')} token slots"),
        ("steps_per_second_drawn", "steps/s", "--config random: a config drawn per example"),
        ("steps_per_second_vllm_manager", "steps/s",
         f"{figures.VLLM_CONFIG} on vLLM {results.get('vllm_version', '?')}'s KVCacheManager (--family vllm:manager)"),
        ("steps_per_second_vllm_scheduler", "steps/s",
         f"{figures.VLLM_CONFIG} through vLLM {results.get('vllm_version', '?')}'s own Scheduler (--family vllm)"),
        ("steps_per_second_sglang_scheduler", "steps/s",
         f"{figures.SGLANG_CONFIG} through SGLang {results.get('sglang_version', '?')}'s own Scheduler, a batch "
         "step each (--family sglang's plain server)"),
        ("hypothesis_trivial_steps_per_second", "steps/s", "plain Hypothesis, trivial rules (machine load)"),
        ("seconds_to_first_failure", "s", f"median, #35957 ({figures.FAULT_35957})"),
    ]
    targets = results.get("targets", {})
    print(f"  buffer {results['buffer_bytes'] / 2**20:.0f} MiB, rows of {results['row_bytes']} bytes, "
          f"bandwidth with {results['bandwidth_threads']} thread(s) (best of {results['bandwidth_reps']}), "
          f"steps with 1 thread (best of {len(results.get('steps_per_second_runs', []))} runs)")
    print(f"  {'figure':36} {'value':>12}  {'unit':8} {'target':10} {'':5} what")
    for key, unit, what in rows:
        if key not in results:
            continue
        t = targets.get(key)
        target = t["target"] if t else ""
        met = ("ok" if t["met"] else "MISS") if t else ""
        print(f"  {key:36} {_fmt(results[key]):>12}  {unit:8} {target:10} {met:5} {what}")
    if "first_failure_seconds_by_seed" in results:
        seeds = ", ".join(f"{s:.2f}" for s in results["first_failure_seconds_by_seed"])
        print(f"  first failure by seed (s): {seeds}")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if v < 10 else f"{v:.1f}"
    return str(v)
