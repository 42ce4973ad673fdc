"""A fuzz session: configs split into lanes over worker processes, live progress, artifacts, summary.

A *lane* fuzzes one config with one seed stream. With ``workers <= configs`` each worker takes
every ``workers``-th config in turn and splits its time between them; with more workers than
configs, several lanes fuzz the same config with different seeds. Every lane writes its failure
artifact itself (atomically, and again each time the shrink improves), so an interrupted or
crashed session still leaves the best shrink so far on disk. Worker ``i`` uses ``cuda:i`` on a
machine with several GPUs.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import queue as queue_mod
import signal
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

from poolfuzz.orchestration.display import Display, LaneState, SessionResult, add_pools, summary
from poolfuzz.orchestration.plugins import DEFAULT_FAMILY
from poolfuzz.orchestration.stopping import Interrupts, stop_signals_blocked

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_UNDER_TESTED = 3  # --strict: nothing failed, but some config was tested less than asked (display.under_tested)


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What ``poolfuzz run`` was asked to do, validated; picklable for spawned workers."""

    configs: tuple[str, ...]
    device: str  # auto | cpu | cuda | cuda:N, as given (each worker resolves it)
    faults: tuple[str, ...] = ()
    backup_mode: str | None = None  # --backup-mode: every config's retraction path (None: the family resolves it)
    seed: int = 0
    examples: int | None = None  # per config; None: the time budget rules
    seconds: float | None = None  # wall-clock budget of the whole session
    steps: int = 40
    db: str | None = None  # checked database spec (None: no database)
    out: str = "poolfuzz-failures"
    workers: int = 1
    shrink_seconds: float | None = 60.0
    family: str | None = None  # --family: a plug-in name, a suite or module:factory (None: builtin)
    # Where --family names a suite: the family of each entry of ``configs`` (a config appears once per member that
    # runs it). Empty: every config runs on ``family``.
    lane_families: tuple[str, ...] = ()
    known: tuple[str, ...] = ()  # signatures of known bugs (--known): counted, never reported
    waive: tuple[str, ...] = ()  # checks that count their violations instead of failing (--waive)
    custom: tuple = ()  # ModelConfigs from --config-file, named in ``configs`` (they shadow built-ins)
    coverage: str | None = None  # --coverage DIR: every worker measures the engine's code (orchestration/reach.py)
    coverage_add: bool = False  # --coverage-add: the reach DIR already holds (other families' runs) is added to
    strict: bool = False  # --strict: a run that tested less than it was asked exits EXIT_UNDER_TESTED


@dataclass(frozen=True, kw_only=True)
class Lane:
    index: int
    worker: int
    config: str
    seed: int
    examples: int | None
    family: str = DEFAULT_FAMILY  # the one family the lane fuzzes (a suite's member)
    suite: bool = False  # the plan's --family names several families: titles and artifacts name this one

    @property
    def title(self) -> str:
        """What the run's tables call the lane: its config, after its family in a suite (``sglang:decode/swa``: one
        word, as scripts read the table's first column)."""
        return f"{self.family}/{self.config}" if self.suite else self.config


def plan_lanes(plan: Plan) -> list[list[Lane]]:
    """The lanes of each worker."""
    configs, w = list(plan.configs), max(1, plan.workers)
    families = list(plan.lane_families) or [plan.family or DEFAULT_FAMILY] * len(configs)
    suite = bool(plan.lane_families)
    per_worker: list[list[Lane]] = [[] for _ in range(w)]
    if w <= len(configs):
        for i, name in enumerate(configs):
            seed = _lane_seed(plan.seed, families[i], name, 0)
            per_worker[i % w].append(Lane(index=i, worker=i % w, config=name, seed=seed,
                                          examples=plan.examples, family=families[i], suite=suite))
    else:
        owners = [[wi for wi in range(w) if wi % len(configs) == ci] for ci in range(len(configs))]
        for wi in range(w):
            ci = wi % len(configs)
            examples, part = None, owners[ci].index(wi)
            if plan.examples is not None:  # split exactly: the lanes of a config add up to --examples
                share, extra = divmod(plan.examples, len(owners[ci]))
                examples = max(1, share + (part < extra))
            seed = _lane_seed(plan.seed, families[ci], configs[ci], part)
            per_worker[wi].append(Lane(index=wi, worker=wi, config=configs[ci], seed=seed,
                                       examples=examples, family=families[ci], suite=suite))
    return [lanes for lanes in per_worker if lanes]


def _lane_seed(base: int, family: str, config: str, part: int) -> int:
    """The seed of the ``part``-th lane (0 unless --workers splits one config over several) of ``config`` in
    ``family``: ``--seed`` and the lane's own name, never its place in the run, so ``--family F --config X --seed S``
    alone draws what that lane drew in any larger run with seed S. The name keeps lanes apart: one seed for every lane
    gave each the same run of example sizes (0.5.12's scheduler: four examples of no step in every lane at seed 1).
    ``zlib.crc32``, not ``hash()``: the same in every process."""
    return (base + zlib.crc32(f"{family}/{config}".encode()) + part * 1_000_003) % 2**32


def worker_device(device: str, worker: int, workers: int) -> str:
    """The device a worker fuzzes on: worker i takes cuda:i when several GPUs are visible."""
    from poolfuzz.pools.family import resolve_device

    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None:
        import torch

        count = torch.cuda.device_count()
        return f"cuda:{worker % count}" if workers > 1 and count > 1 else "cuda"
    return str(dev)


# ======================================================================================
# One worker: its lanes in turn. Events go to ``emit`` (the display, or the parent's queue).
# ======================================================================================
def run_lanes(plan: Plan, lanes: list[Lane], emit: Callable[[dict], None], *, deadline: float | None) -> bool:
    """Run lanes one after the other; returns False when interrupted."""

    from poolfuzz.orchestration.database import open_database
    from poolfuzz.orchestration.runner import prepare_process, release_memory

    prepare_process()
    device = worker_device(plan.device, lanes[0].worker, plan.workers)
    database = open_database(plan.db)
    for j, lane in enumerate(lanes):
        budget = None
        if deadline is not None:
            budget = max(0.0, (deadline - time.time()) / (len(lanes) - j))
        emit({"type": "start", "lane": lane.index, "config": lane.config, "device": device})
        try:
            if not _run_campaign(plan, lane, device, database, budget, emit):
                return False
        finally:
            release_memory()  # the next config shares none of this one's cached rows
    return True


def _run_campaign(plan: Plan, lane: Lane, device: str, database, budget: float | None, emit) -> bool:
    """Fuzz one lane's config until its budget is spent, past every failure: each failure with a new
    signature is shrunk once into its own artifact; known ones (--known, or found earlier here) are
    counted, not reported. Returns False when interrupted."""
    from poolfuzz.harness.records import EngineOptions
    from poolfuzz.orchestration.database import KeepingDatabase
    from poolfuzz.orchestration.known import known_on
    from poolfuzz.orchestration.runner import run_machine

    started = time.perf_counter()
    found: set[str] = set()
    totals = {"examples": 0, "steps": 0, "known": {}, "waived": {}, "declined": 0, "declined_reasons": {}, "pools": {}}
    options = EngineOptions(waive=tuple(plan.waive))
    remaining = lane.examples
    last = [0.0]
    interrupted = False
    for round_no in itertools.count():
        left = None if budget is None else budget - (time.perf_counter() - started)
        if (left is not None and left <= 0) or (remaining is not None and remaining <= 0):
            break
        known = known_on(plan.known, lane.config, lane.family)
        round_options = dataclasses.replace(options, known=tuple(dict.fromkeys((*known, *found))))
        writer = _ArtifactWriter(plan, lane, device, round_options)

        def progress(snap, lane=lane, last=last):
            now = time.monotonic()
            if now - last[0] >= 0.5:
                last[0] = now
                emit({"type": "progress", "lane": lane.index, **snap,
                      "examples": totals["examples"] + snap["examples"], "steps": totals["steps"] + snap["steps"]})

        def failure(candidate, lane=lane, writer=writer):
            path = writer.interim(candidate)  # never raises: this runs inside Hypothesis's test
            emit({"type": "failure", "lane": lane.index, "message": candidate.message,
                  "signature": candidate.signature, "size": len(candidate.steps),
                  "artifact": None if path is None else str(path), "artifact_error": writer.error})

        # Each round its own seed: a round that found a bug starts the next one elsewhere.
        round_started = time.perf_counter()
        result = run_machine(lane_config(plan, lane.config), device=device, faults=plan.faults,
                             backup_mode=plan.backup_mode,
                             max_examples=remaining if remaining is not None else 1_000_000,
                             steps_per_example=plan.steps, seed=(lane.seed + round_no * 7919) % 2**32,
                             database=database if not (plan.known or found) or database is None
                             else KeepingDatabase(database),
                             time_budget=left if remaining is None else None,
                             shrink_limit=plan.shrink_seconds, on_progress=progress, on_failure=failure,
                             family_factory=_family_factory(lane.family), options=round_options)
        totals["examples"] += result.examples
        totals["steps"] += result.steps
        totals["declined"] += result.declined
        add_pools(totals["pools"], result.pools)
        for key, source in (("known", result.skipped), ("waived", result.waived),
                            ("declined_reasons", result.declined_reasons)):
            for name, n in source.items():
                totals[key][name] = totals[key].get(name, 0) + n
        if result.api_changed is not None:  # untested from here on: no artifact, the lane stops
            emit({"type": "api_changed", "lane": lane.index, "message": result.api_changed})
            break
        if remaining is not None:
            remaining -= result.examples
        if not result.passed:
            found.add(result.signature)
            seconds_to_find = round_started - started + (result.first_failure_seconds or 0.0)
            path = writer.final(result, plan.db, examples_to_find=totals["examples"],
                                seconds_to_find=round(seconds_to_find, 3))
            unwritten = None if path is not None else writer.text
            emit({"type": "finding", "lane": lane.index, "signature": result.signature, "failure": result.failure,
                  "artifact": None if path is None else str(path),
                  "artifact_error": None if unwritten is None else writer.error, "artifact_text": unwritten,
                  "interrupted": result.interrupted, "shrunk": result.shrunk,
                  "program_steps": len(result.engine_steps), "examples_to_find": totals["examples"],
                  "seconds_to_find": round(seconds_to_find, 2)})
        if result.interrupted:
            interrupted = True
            break
        if result.examples == 0:  # nothing ran (the budget went on setting up): stop, do not spin
            break
    emit({"type": "done", "lane": lane.index, "config": lane.config, "examples": totals["examples"],
          "steps": totals["steps"], "seconds": time.perf_counter() - started, "interrupted": interrupted,
          "known": totals["known"], "waived": totals["waived"], "declined": totals["declined"],
          "declined_reasons": totals["declined_reasons"], "pools": totals["pools"]})
    return not interrupted


class _ArtifactWriter:
    """One lane's artifact: written at the first failure, rewritten as the shrink improves."""

    def __init__(self, plan: Plan, lane: Lane, device: str, options=None):
        self.plan, self.lane, self.device, self.options = plan, lane, device, options
        self.path: Path | None = None
        self.error: str | None = None  # why the last write failed (None: it did not)
        self.text: str | None = None  # the last artifact as JSON, written or not

    def _name(self, k: int) -> str:
        from poolfuzz.orchestration.artifacts import artifact_name

        tag = f"lane{self.lane.index}" if self.plan.workers > 1 else ""
        if self.lane.suite:  # two members' lanes of one config never take each other's names
            tag = f"{self.lane.family.replace(':', '-')}{'-' if tag else ''}{tag}"
        return artifact_name(self.lane.config, self.plan.faults, tag=tag if k == 1 else f"{tag}{'-' if tag else ''}{k}")

    def _write(self, **varying) -> Path | None:
        """Write the artifact of this lane (what the lane fixes, plus what the failure says); the path,
        or None when the disk refuses (``error`` says why, ``text`` holds the JSON for the terminal)."""
        from poolfuzz.orchestration import artifacts

        model = varying.pop("model")
        varying["pools"] = artifacts.pools_record(varying.pop("origin"))
        art = artifacts.stamp(config=self.lane.config, model_config=artifacts.recorded_config(model),
                              family=self.lane.family, device=self.device,
                              faults=list(self.plan.faults), seed=self.lane.seed,
                              engine_options=artifacts.current_engine_options(self.options), **varying)
        self.text = artifacts.dumps(art)
        try:
            if self.path is None:  # the first write picks a free name atomically
                self.path = artifacts.write_new_atomic(self.plan.out, self._name, art)
            else:
                artifacts.write_atomic(self.path, art)
        except OSError as exc:  # the disk filled up or went away after the checks: keep fuzzing
            self.error = str(exc.strerror or exc)
            return None
        self.error = None
        return self.path

    def interim(self, candidate):
        return self._write(model=candidate.model_config, backup_mode=candidate.backup_mode,
                           failure=candidate.message, error_type=candidate.error_type, divergence=candidate.divergence,
                           program=list(candidate.steps), status="shrinking", in_teardown=candidate.in_teardown,
                           database=self.plan.db, signature=candidate.signature,
                           origin=candidate.pools_origin)

    def final(self, result, db, *, examples_to_find: int, seconds_to_find: float):
        status = "shrunk" if result.shrunk else ("interrupted" if result.interrupted else "shrink-limit")
        return self._write(model=result.model_config, backup_mode=result.backup_mode, failure=result.failure,
                           error_type=result.error_type,
                           divergence=result.divergence, program=list(result.engine_steps), status=status,
                           in_teardown=result.in_teardown, hypothesis_program=result.program,
                           reproduce_blob=result.reproduce_blob, database=db, database_key=result.database_key,
                           examples=examples_to_find, seconds=seconds_to_find, signature=result.signature,
                           shrink_examples=result.shrink_examples, hypothesis_steps=result.hypothesis_steps,
                           origin=result.pools_origin)


def _worker_main(plan: Plan, lanes: list[Lane], events, deadline: float | None, parent_pid: int | None = None) -> None:
    """Entry point of a spawned worker: the first SIGINT or SIGTERM interrupts, later ones are
    ignored; when the parent dies (even by SIGKILL) the worker saves its best shrink and exits."""
    from poolfuzz.orchestration.stopping import STOP_SIGNALS, Interrupts, watch_parent, worker_ready

    interrupts = Interrupts(once=True)
    for s in STOP_SIGNALS:
        signal.signal(s, interrupts)
    worker = lanes[0].worker
    if plan.coverage:
        from poolfuzz.orchestration.reach import start_in_worker

        start_in_worker()
    try:
        if parent_pid is not None:
            # Orphaned, nobody reads the queue: do not wait at exit for it to drain.
            watch_parent(parent_pid, on_orphaned=events.cancel_join_thread)
        worker_ready()  # a Ctrl-C that came during start-up is taken here, as a clean interrupt
        run_lanes(plan, lanes, events.put, deadline=deadline)
    except KeyboardInterrupt:
        pass
    except BaseException as exc:  # report, never a traceback on the user's terminal
        # A stop signal that landed inside an import (torch's, at start-up) leaves the module half
        # loaded, and the next import of it fails: that is the interrupt, not a worker error.
        if interrupts.signum is None:
            events.put({"type": "error", "worker": worker, "message": f"{type(exc).__name__}: {exc}"})
    finally:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        if plan.coverage:
            from poolfuzz.orchestration.reach import save_in_worker

            save_in_worker()
        events.put({"type": "exit", "worker": worker})


# ======================================================================================
# The session: display, workers, summary.
# ======================================================================================
def run_session(plan: Plan, *, stream: TextIO | None = None, tty: bool | None = None,
                before_closing=None) -> SessionResult:
    """Run the plan; print progress and the summary to ``stream``; return the exit code and lanes.
    ``before_closing(stream)`` runs once every worker has exited, just before the closing count."""
    stream = stream or sys.stdout
    tty = stream.isatty() if tty is None else tty
    per_worker = plan_lanes(plan)
    states = [LaneState(lane=lane) for lanes in per_worker for lane in lanes]
    states.sort(key=lambda s: s.lane.index)
    counts: dict[str, int] = {}
    for st in states:
        counts[st.lane.title] = counts.get(st.lane.title, 0) + 1
        st.label = st.lane.title if plan.workers <= len(plan.configs) else f"{st.lane.title}#{counts[st.lane.title]}"
    display = Display(plan, states, stream, tty)
    budget = f"{plan.seconds:g}s budget" if plan.seconds is not None else f"{plan.examples} examples per config"
    from poolfuzz.pools.family import resolve_device

    device = str(resolve_device(plan.device))
    what = f"{len(plan.configs)} config(s)"
    if plan.lane_families:
        what = (f"{len(set(plan.configs))} config(s) through {len(set(plan.lane_families))} families of "
                f"{plan.family} ({len(plan.configs)} lanes)")
    stream.write(f"poolfuzz run: {what} on {device}, {len(per_worker)} worker(s), "
                 f"{budget}, seed {plan.seed}" + (f", faults {', '.join(plan.faults)}" if plan.faults else "")
                 + f"; database {plan.db or 'off'}; failures to {plan.out}/\n")
    stream.flush()
    from poolfuzz.orchestration.artifacts import sweep_stale_temps

    sweep_stale_temps(plan.out)  # what an earlier run killed mid-write left
    deadline = None if plan.seconds is None else time.time() + plan.seconds
    result = SessionResult(exit_code=EXIT_OK, lanes=states)
    # SIGTERM (a CI timeout, systemd, kill) stops the run as Ctrl-C does: summary, artifacts kept.
    with Interrupts().installed() as interrupts:
        try:
            if len(per_worker) == 1 and not plan.coverage:  # measured runs spawn: coverage starts with them
                ok = run_lanes(plan, per_worker[0], display.handle, deadline=deadline)
                result.interrupted = not ok
            else:
                _run_workers(plan, per_worker, display, deadline, result)
        except KeyboardInterrupt:
            result.interrupted = True
        display.finish()
        summary(plan, result, stream, before_closing=before_closing)
    failed = bool(result.findings) or result.errors
    stopped = 128 + interrupts.signum if interrupts.signum else EXIT_INTERRUPTED  # 130 Ctrl-C, 143 SIGTERM
    # An engine whose API changed left configs untested: bad usage of this release, not a pass (a bug
    # found elsewhere in the run still makes it a failure).
    result.exit_code = (EXIT_FAILED if failed else stopped if result.interrupted
                        else EXIT_USAGE if result.api_changes
                        else EXIT_UNDER_TESTED if plan.strict and result.under_tested else EXIT_OK)
    return result


def _run_workers(plan: Plan, per_worker: list[list[Lane]], display: Display, deadline, result) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    events = ctx.Queue()
    procs = {lanes[0].worker: ctx.Process(target=_worker_main, args=(plan, lanes, events, deadline, os.getpid()),
                                          name=f"poolfuzz-worker-{lanes[0].worker}")
             for lanes in per_worker}
    exited: set[int] = set()
    interrupted_at = None
    forwarded = 0.0

    def interrupted() -> None:
        nonlocal interrupted_at
        interrupted_at = time.monotonic()
        result.interrupted = True
        display.line("interrupted: workers are saving their best shrink (Ctrl-C again to stop now)")

    try:
        try:
            with stop_signals_blocked():  # workers inherit the mask: no start-up tracebacks
                for p in procs.values():
                    p.start()
        except KeyboardInterrupt:  # the signal that came while they started
            interrupted()
        while len(exited) < len(procs):
            try:
                try:
                    ev = events.get(timeout=0.2)
                except queue_mod.Empty:
                    ev = None
                if ev is not None:
                    if ev["type"] == "exit":
                        exited.add(ev["worker"])
                    elif ev["type"] == "error":
                        result.errors.append(f"worker {ev['worker']}: {ev['message']}")
                    display.handle(ev)
                else:
                    display.refresh()
            except KeyboardInterrupt:
                if interrupted_at is not None:  # a second Ctrl-C: stop at once
                    break
                interrupted()
                continue
            now = time.monotonic()
            # A signal sent to the parent alone (SIGTERM, kill -INT) reaches the workers too; it is
            # re-sent each second, as a worker ignores it until its imports are done.
            if interrupted_at is not None and now - interrupted_at > 0.5 and now - forwarded >= 1.0:
                forwarded = now
                for w, p in procs.items():
                    if w not in exited and p.is_alive():
                        os.kill(p.pid, signal.SIGINT)
            if interrupted_at is not None and now - interrupted_at > 20:
                break
            for w, p in procs.items():  # a worker that died without saying goodbye
                if w not in exited and not p.is_alive() and p.exitcode is not None and events.empty():
                    exited.add(w)
                    if p.exitcode != 0:
                        result.errors.append(f"worker {w} died (exit code {p.exitcode})")
                        display.line(f"worker {w} died (exit code {p.exitcode}); its lanes are incomplete")
    finally:
        for p in procs.values():
            if p.pid is None:  # never started
                continue
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        events.close()


def lane_config(plan: Plan, name: str):
    """What a lane fuzzes: a --config-file config, drawn configs (``random``) or a built-in one."""
    from poolfuzz.pools.config import get_config
    from poolfuzz.strategies import DRAWN_NAME

    custom = {c.name: c for c in plan.custom}
    if name in custom:
        return custom[name]
    # Drawn configs: machine_for draws them from the space the family accepts, counting what it declines.
    return DRAWN_NAME if name == DRAWN_NAME else get_config(name)


def _family_factory(family: str):
    """The factory of the family a lane fuzzes, resolved in the worker (factories need not pickle); None for the
    built-in one."""
    if family == DEFAULT_FAMILY:
        return None
    from poolfuzz.orchestration.plugins import resolve_family

    return resolve_family(family).factory
