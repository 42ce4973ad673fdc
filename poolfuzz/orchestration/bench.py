"""The bench figures: how fast the harness checks, steps and finds a bug, measured in one process.

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
  programs take the exhaustion paths). ``steps_per_second_drawn`` is ``--config random``: every
  example draws its own config (one in five a 65536-token context with prompts of thousands of
  tokens), so it moves with what the strategy draws as much as with the harness.
* ``seconds_to_first_failure``: median over ``--seeds`` seeds of the wall time to the first
  failing example with SGLang #35957 (``swa-ignores-mamba-backup``) switched on.
"""

from __future__ import annotations

import statistics
import time


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
    from poolfuzz.orchestration.runner import run_machine
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
    from poolfuzz.strategies import drawn_configs

    run_machine(drawn_configs(), device=device, max_examples=2, seed=1)
    rates = []
    for _ in range(reps):
        r = run_machine(drawn_configs(), device=device, max_examples=examples, seed=0)
        if not r.passed:
            raise RuntimeError(f"bench: a drawn config failed without a fault: {r.failure}")
        rates.append(r.steps / r.seconds)
    out.update(steps_per_second_drawn=max(rates), steps_per_second_drawn_runs=rates, steps_drawn=r.steps,
               examples_drawn=r.examples)
    out["scaling_ratio"] = out["steps_per_second_large"] / out["steps_per_second"]
    out["hypothesis_trivial_steps_per_second"] = trivial_steps_per_second(examples)
    return out


VLLM_CONFIG = "swa"  # full attention + sliding window: two KV cache groups over one block pool
# Sliding window and recurrent state: #35957's model, SGLang's hybrid pools, through SGLang's own scheduler.
SGLANG_CONFIG = "swa-ssm"
# (family, config, figure, engine package): the engine families' rates, each where its engine is installed.
ENGINE_RATES = (("vllm:manager", VLLM_CONFIG, "steps_per_second_vllm_manager", "vllm"),
                ("vllm", VLLM_CONFIG, "steps_per_second_vllm_scheduler", "vllm"),
                ("sglang:scheduler", SGLANG_CONFIG, "steps_per_second_sglang_scheduler", "sglang"))


def engine_steps(device, *, examples: int, reps: int = 3) -> dict:
    """Steps/s of the engine families, measured in one run, each where its engine is installed: ``--family
    vllm:manager`` (the harness plays the scheduler over vLLM's real KVCacheManager), ``--family vllm``
    (vLLM's own Scheduler, fed by the worker stand-in: a step is one ``schedule()`` of the whole batch with its
    forward and checks) and ``--family sglang:scheduler`` (SGLang's own Scheduler methods over SGLang's pools, the
    plain server of ``--family sglang``: a step is one event-loop iteration of the whole batch)."""
    from importlib.metadata import PackageNotFoundError, version

    from poolfuzz.orchestration.plugins import resolve_family
    from poolfuzz.orchestration.runner import run_machine
    from poolfuzz.pools.config import CONFIGS
    from poolfuzz.pools.errors import ConfigError

    out: dict = {}
    for name, config_name, key, package in ENGINE_RATES:
        config = CONFIGS[config_name]
        plugin = resolve_family(name)
        try:
            version(package)
            if plugin.unsupported_reason(config) is not None:
                continue
            run_machine(config, device=device, max_examples=2, seed=1, family_factory=plugin.factory)
        except (PackageNotFoundError, ConfigError):  # the engine is not installed here, or cannot build it
            continue
        rates = []
        for _ in range(reps):
            r = run_machine(config, device=device, max_examples=examples, seed=0, family_factory=plugin.factory)
            if not r.passed:
                raise RuntimeError(f"bench: the {name} family failed on {config.name}: {r.failure}")
            rates.append(r.steps / r.seconds)
        out.update({key: max(rates), f"{key}_runs": rates, f"{package}_version": version(package)})
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
    from poolfuzz.orchestration.runner import run_machine
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
