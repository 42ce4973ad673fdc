"""The detection matrix: for each catalogue fault and config, is it found, how fast, how short."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

from poolfuzz.orchestration.runner import run_machine
from poolfuzz.pools.config import get_config
from poolfuzz.pools.shortest_known import shortest_known
from poolfuzz.strategies import DRAWN_NAME, drawn_configs


@dataclass(frozen=True, kw_only=True)
class HuntRow:
    """One (fault, config) cell; ``fault`` None is the no-fault run, where detections are false alarms."""

    fault: str | None
    config: str
    seeds: int
    detected: int
    median_examples: float | None
    worst_examples: int | None
    median_seconds: float | None
    shrunk_steps: int | None  # median length of the shrunk programs
    message: str | None
    signature: str | None = None  # the signature most seeds found
    signatures: int = 0  # distinct signatures over the seeds (1: the same bug every time)
    shortest_known: int | None = None  # faults.shortest_known: the shortest program known on this config
    worst_shrunk: int | None = None  # the longest shrunk program over the seeds

    @property
    def shrink_within_two(self) -> bool | None:
        """Is every seed's shrunk program within two steps of the shortest known?"""
        if self.shortest_known is None or self.worst_shrunk is None:
            return None
        return self.worst_shrunk <= self.shortest_known + 2


def hunt_cell(config_name: str, fault: str | None, *, seeds: int, budget: int, shrink_seconds: float,
              device="cpu", family_factory=None) -> HuntRow:
    faults = [fault] if fault else []
    # ``random``: every example draws its own config, of a shape the fault applies to.
    config = drawn_configs(faults=faults) if config_name == DRAWN_NAME else get_config(config_name)
    found = []
    for seed in range(seeds):
        result = run_machine(config, device=device, faults=faults, max_examples=budget,
                             seed=seed, shrink_limit=shrink_seconds, family_factory=family_factory)
        if not result.passed:
            # A failure raised while building the machine happens in its first example.
            examples = result.first_failure_examples or 1
            seconds = result.first_failure_seconds if result.first_failure_seconds is not None else result.seconds
            found.append((examples, seconds, len(result.engine_steps), result.failure, result.signature))
    signatures = Counter(f[4] for f in found)
    return HuntRow(
        fault=fault, config=config_name, seeds=seeds, detected=len(found),
        median_examples=statistics.median(f[0] for f in found) if found else None,
        worst_examples=max(f[0] for f in found) if found else None,
        median_seconds=round(statistics.median(f[1] for f in found), 3) if found else None,
        shrunk_steps=int(statistics.median(f[2] for f in found)) if found else None,
        message=found[0][3] if found else None,
        signature=signatures.most_common(1)[0][0] if found else None, signatures=len(signatures),
        # a drawn config has many shapes: the shortest known over all of them
        shortest_known=shortest_known(fault, None if config_name == DRAWN_NAME else config) if fault else None,
        worst_shrunk=max(f[2] for f in found) if found else None,
    )


def format_row(row: HuntRow) -> str:
    def num(v):
        return "-" if v is None else (f"{v:g}" if isinstance(v, float) else str(v))

    within = {True: "", False: " >+2", None: ""}[row.shrink_within_two]
    signature = row.signature or "-"
    if row.signatures > 1:
        signature += f" (+{row.signatures - 1} more)"
    return (f"{row.fault or '(no fault)':34} {row.config:18} {row.detected:>2}/{row.seeds:<3} "
            f"{num(row.median_examples):>7} {num(row.worst_examples):>6} {num(row.median_seconds):>7} "
            f"{num(row.shrunk_steps):>5} {num(row.shortest_known):>5}{within:4}  {signature}")
