"""``poolfuzz bench``: how fast the harness checks, steps and finds a bug, in one run.

Figures (all from the same process, one after the other):

* ``checksum_gbps`` / ``sum_gbps`` / ``checksum_ratio``: per-slot checksums of a large bf16
  component buffer (``--buffer-mib``, rows of ``--row-bytes``) against a plain ``sum`` over the
  rows of the same bytes on the same device, the memory-bound ceiling. Each is the best of
  ``--reps`` interleaved passes, in GB/s of buffer read, with ``--threads`` intra-op threads.
  On CUDA ``copy_gbps`` (bytes copied per second by ``copy_``) is measured too.
* ``steps_per_second`` / ``steps_per_second_large`` / ``scaling_ratio``: state-machine steps per
  second on the default config (swa-ssm) with a small pool (4096 token slots) and with a million
  token slots (the request rows and mamba slots stay as configured, so both run the same kind of
  programs), Hypothesis included, as ``poolfuzz run`` runs them (one intra-op thread); the best of
  ``--step-reps`` identical (derandomized) runs, each run's figure kept in the JSON.
  ``steps_per_second_builtin`` is the built-in config itself (64 slots: pools run full, so more
  programs take the exhaustion paths).
* ``seconds_to_first_failure``: median over ``--seeds`` seeds of the wall time to the first
  failing example with SGLang #35957 (``swa-ignores-mamba-backup``) switched on.
"""

from __future__ import annotations

import json
import statistics
import time

from poolfuzz.pools.family import resolve_device

FAULT_35957 = "swa-ignores-mamba-backup"
DEFAULT_CONFIG = "swa-ssm"
SMALL_TOKENS = 1 << 12
LARGE_TOKENS = 1 << 20

TARGETS = {  # key -> (comparison, threshold, devices it applies to)
    "checksum_ratio": (">=", 0.5, ("cpu",)),
    "checksum_vs_copy": (">=", 0.5, ("cuda",)),
    "steps_per_second": (">=", 1000, ("cpu",)),
    "scaling_ratio": (">=", 0.7, ("cpu", "cuda")),
    "seconds_to_first_failure": ("<=", 5.0, ("cpu",)),
}


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

    from poolfuzz.harness.cli import UsageError

    if min(args.threads, args.reps, args.examples, args.seeds, args.step_reps) < 1:
        raise UsageError("--threads, --reps, --examples, --seeds and --step-reps must be at least 1")
    if args.buffer_mib < 1 or args.row_bytes < 8 or args.row_bytes % 8:
        raise UsageError("--buffer-mib must be >= 1 and --row-bytes a positive multiple of 8")
    if args.quick:
        args.buffer_mib, args.reps, args.examples, args.seeds, args.step_reps = min(args.buffer_mib, 8), 2, 5, 1, 1
    device = resolve_device(args.device)
    results: dict = {"device": str(device), "torch": torch.__version__, "threads": args.threads}
    print(f"poolfuzz bench on {device} (torch {torch.__version__})", flush=True)

    results.update(bandwidth(device, mib=args.buffer_mib, row_bytes=args.row_bytes, reps=args.reps,
                             threads=args.threads))
    torch.set_num_threads(1)  # what poolfuzz run and the tests use
    results.update(steps(device, examples=args.examples, small_tokens=SMALL_TOKENS, large_tokens=LARGE_TOKENS,
                         reps=args.step_reps))
    results.update(first_failure(device, seeds=args.seeds))
    results["targets"] = verdicts(results, device.type)

    print_table(results)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2, sort_keys=True)
            fh.write("\n")
        print(f"wrote {args.json}")
    return 0


# --------------------------------------------------------------------------------------------
# Bandwidth
# --------------------------------------------------------------------------------------------
def bandwidth(device, *, mib: int, row_bytes: int, reps: int, threads: int) -> dict:
    import torch

    from poolfuzz.harness.checksums import row_checksums

    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = (mib << 20) // row_bytes
        gen = torch.Generator(device="cpu").manual_seed(0)
        # Random bit patterns (including NaNs and infinities) in bf16: what a KV cache holds.
        buf = torch.randint(-(1 << 15), 1 << 15, (rows, row_bytes // 2), dtype=torch.int16, generator=gen)
        buf = buf.view(torch.bfloat16).to(device)
        nbytes = buf.numel() * buf.element_size()
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        passes = {"sum": lambda: buf.sum(1), "checksum": lambda: row_checksums(buf)}
        if device.type == "cuda":
            dst = torch.empty_like(buf)
            passes["copy"] = lambda: dst.copy_(buf)
        best = {k: float("inf") for k in passes}
        for f in passes.values():  # warm-up: allocator, weights, kernels
            f()
        sync()
        for _ in range(reps):
            for name, f in passes.items():
                sync()
                t = time.perf_counter()
                f()
                sync()
                best[name] = min(best[name], time.perf_counter() - t)
        out = {f"{k}_gbps": nbytes / v / 1e9 for k, v in best.items()}
        out["checksum_ratio"] = out["checksum_gbps"] / out["sum_gbps"]
        if "copy_gbps" in out:
            out["checksum_vs_copy"] = out["checksum_gbps"] / out["copy_gbps"]
        out.update(buffer_bytes=nbytes, row_bytes=row_bytes, bandwidth_threads=threads, bandwidth_reps=reps)
        return out
    finally:
        torch.set_num_threads(old_threads)


# --------------------------------------------------------------------------------------------
# State machine
# --------------------------------------------------------------------------------------------
def steps(device, *, examples: int, small_tokens: int, large_tokens: int, reps: int = 3) -> dict:
    from poolfuzz.harness.runner import run_machine
    from poolfuzz.pools.config import CONFIGS

    builtin = CONFIGS[DEFAULT_CONFIG]
    ps = builtin.page_size

    def sized(tokens: int, tag: str):
        tokens = tokens // ps * ps
        return builtin.replace(name=f"{builtin.name}-{tag}", full_tokens=tokens, swa_tokens=tokens)

    out = {}
    for key, config in (("", sized(small_tokens, "small")), ("_large", sized(large_tokens, "large")),
                        ("_builtin", builtin)):
        run_machine(config, device=device, max_examples=2, seed=1)  # warm caches and imports
        rates = []
        for _ in range(reps):  # the same derandomized run each time; the best one is the figure
            r = run_machine(config, device=device, max_examples=examples, seed=0)
            if not r.passed:
                raise RuntimeError(f"bench: {config.name} failed without a fault: {r.failure}")
            rates.append(r.steps / r.seconds)
        out[f"steps_per_second{key}"] = max(rates)
        out[f"steps_per_second{key}_runs"] = rates
        out[f"steps{key}"] = r.steps
        out[f"examples{key}"] = r.examples
        out[f"token_slots{key}"] = config.full_tokens
    out["scaling_ratio"] = out["steps_per_second_large"] / out["steps_per_second"]
    out["hypothesis_trivial_steps_per_second"] = trivial_steps_per_second(examples)
    return out


def trivial_steps_per_second(examples: int) -> float:
    """Plain Hypothesis with two trivial rules, same budget: the ceiling on this machine right now
    (it moves with the machine's load, and so does every figure above)."""
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

    count = [0]

    class Trivial(RuleBasedStateMachine):
        total = 0

        @rule(v=st.integers(0, 10))
        def add(self, v):
            self.total += v

        @rule(v=st.integers(0, 10), w=st.integers(0, 3))
        def sub(self, v, w):
            self.total -= v

        @invariant()
        def counted(self):
            count[0] += 1

    chosen = settings(max_examples=examples, stateful_step_count=40, deadline=None, database=None,
                      derandomize=True, suppress_health_check=list(HealthCheck))
    started = time.perf_counter()
    run_state_machine_as_test(Trivial, settings=chosen)
    return count[0] / (time.perf_counter() - started)


def first_failure(device, *, seeds: int) -> dict:
    from poolfuzz.harness.runner import run_machine
    from poolfuzz.pools.config import CONFIGS

    times = []
    for seed in range(seeds):
        r = run_machine(CONFIGS[DEFAULT_CONFIG], device=device, faults=[FAULT_35957], max_examples=1000, seed=seed,
                        shrink_limit=0)  # the first failure is the figure; no need to shrink it
        if r.first_failure_seconds is None:
            raise RuntimeError(f"bench: #35957 was not found with seed {seed} in 1000 examples")
        times.append(r.first_failure_seconds)
    return {"seconds_to_first_failure": statistics.median(times), "first_failure_seconds_by_seed": times}


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------
def verdicts(results: dict, device_type: str) -> dict:
    out = {}
    for key, (op, threshold, devices) in TARGETS.items():
        if device_type not in devices or key not in results:
            continue
        value = results[key]
        ok = value >= threshold if op == ">=" else value <= threshold
        out[key] = {"target": f"{op} {threshold:g}", "met": bool(ok)}
    return out


def print_table(results: dict) -> None:
    rows = [
        ("checksum_gbps", "GB/s", "per-slot checksums of a bf16 buffer"),
        ("sum_gbps", "GB/s", "plain sum over rows, same bytes"),
        ("copy_gbps", "GB/s", "device copy, same bytes"),
        ("checksum_ratio", "", "checksum / sum"),
        ("checksum_vs_copy", "", "checksum / copy"),
        ("steps_per_second", "steps/s", f"{DEFAULT_CONFIG}, {results.get('token_slots', '?')} token slots"),
        ("steps_per_second_large", "steps/s", f"{DEFAULT_CONFIG}, {results.get('token_slots_large', '?')} token slots"),
        ("scaling_ratio", "", "large / small"),
        ("steps_per_second_builtin", "steps/s",
         f"{DEFAULT_CONFIG} as built in, {results.get('token_slots_builtin', '?')} token slots"),
        ("hypothesis_trivial_steps_per_second", "steps/s", "plain Hypothesis, trivial rules (machine load)"),
        ("seconds_to_first_failure", "s", f"median, #35957 ({FAULT_35957})"),
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
