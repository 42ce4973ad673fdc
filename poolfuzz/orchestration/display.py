"""What a fuzz session shows: a live block on a terminal (plain lines in CI logs) and the summary."""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from typing import TextIO

@dataclass(frozen=True, kw_only=True)
class Finding:
    """One distinct failure a lane found: shrunk once, one artifact."""

    signature: str
    failure: str  # the shrunk failure's one-line report
    artifact: str | None  # None: it could not be written (``unwritten`` holds it)
    program_steps: int
    examples_to_find: int  # examples into the lane when it was first seen
    seconds_to_find: float
    how: str  # shrunk | interrupted while shrinking | shrink cut at --shrink-seconds
    unwritten: str | None = None


@dataclass
class LaneState:
    lane: object  # the session's Lane
    label: str = ""  # the config, or config#k when several lanes fuzz it
    status: str = "waiting"  # waiting | running | shrinking | PASS | FAIL | stopped | ERROR | API CHANGED
    examples: int = 0
    steps: int = 0
    seconds: float = 0.0
    failure: str | None = None  # the failure being shrunk, or the last one found
    findings: list[Finding] = field(default_factory=list)
    known: dict = field(default_factory=dict)  # signature -> failing examples of known bugs
    waived: dict = field(default_factory=dict)  # check -> violations of waived checks
    device: str = ""
    api_changed: str | None = None  # "API CHANGED: ...": the engine lacks what the family reads; untested
    declined: int = 0  # examples (of ``examples``) whose drawn config the family declined: nothing ran
    declined_reasons: dict = field(default_factory=dict)  # reason -> declined examples
    pools: dict = field(default_factory=dict)  # who built the pools: built_by -> {detail: examples run on them}

    @property
    def tested(self) -> int:
        """Examples that ran steps on a family (declined drawn configs left out)."""
        return max(0, self.examples - self.declined)

    @property
    def artifact(self) -> str | None:
        return ", ".join(f.artifact for f in self.findings if f.artifact) or None


@dataclass
class SessionResult:
    exit_code: int
    lanes: list[LaneState] = field(default_factory=list)
    interrupted: bool = False
    errors: list[str] = field(default_factory=list)

    @property
    def findings(self) -> list[Finding]:
        return [f for s in self.lanes for f in s.findings]

    @property
    def under_tested(self) -> list[str]:
        """Why the run tested less than it was asked, one line per config where it did: no step at all, or
        most of its examples declined by the family."""
        by_config: dict[str, list[LaneState]] = {}
        for st in self.lanes:
            by_config.setdefault(st.lane.title, []).append(st)
        out = []
        for config, sts in by_config.items():
            if any(s.status != "PASS" for s in sts):
                continue  # failed, stopped or untested for another reason: said elsewhere
            examples, declined = sum(s.examples for s in sts), sum(s.declined for s in sts)
            steps = sum(s.steps for s in sts)
            if steps == 0 or declined * 2 > examples:
                reasons: dict[str, int] = {}
                for s in sts:
                    for r, n in s.declined_reasons.items():
                        reasons[r] = reasons.get(r, 0) + n
                top = max(reasons.items(), key=lambda kv: kv[1])[0] if reasons else None
                out.append(f"{config}: {examples - declined} of {examples} examples ran ({steps} steps); "
                           f"{declined} declined by the family" + (f", most often: {top}" if top else ""))
        return out

    @property
    def api_changes(self) -> list[str]:
        return list(dict.fromkeys(s.api_changed for s in self.lanes if s.api_changed))

    @property
    def artifacts(self) -> list[str]:
        return [f.artifact for f in self.findings if f.artifact]


class Display:
    """Live block on a terminal; plain timestamped lines otherwise (CI logs)."""

    HEARTBEAT = 30.0

    def __init__(self, plan, lanes: list[LaneState], stream: TextIO, tty: bool):
        self.plan, self.lanes, self.stream, self.tty = plan, lanes, stream, tty
        self.started = time.monotonic()
        self.deadline = None if plan.seconds is None else self.started + plan.seconds
        self.drawn = 0
        self.last_draw = 0.0
        self.last_beat = self.started
        self.by_index = {s.lane.index: s for s in lanes}

    # --- events ---------------------------------------------------------------------------
    def handle(self, ev: dict) -> None:
        kind = ev["type"]
        if kind in ("error", "exit"):
            if kind == "error":
                self.line(f"worker {ev['worker']} failed: {ev['message']}")
            return
        st = self.by_index[ev["lane"]]
        if kind == "start":
            st.status, st.device = "running", ev.get("device", "")
            self.line(f"{st.label}: started on {st.device}", quiet_on_tty=True)
        elif kind == "progress":
            st.examples, st.steps, st.seconds = ev["examples"], ev["steps"], ev["seconds"]
            if ev["status"] == "shrinking":
                st.status = "shrinking"
        elif kind == "failure":  # a new bug, shrinking: the best so far is on disk
            first = st.status != "shrinking" or st.failure is None
            st.status, st.failure = "shrinking", ev["message"]
            if first:
                self.line(f"{st.label}: FAIL {ev['message']}")
                where = ev["artifact"] or f"memory only: cannot write under {self.plan.out}/ ({ev.get('artifact_error')})"
                self.line(f"{st.label}: shrinking {ev['signature']}; best so far ({ev['size']} steps) in {where}")
        elif kind == "finding":  # shrunk (or cut short): one artifact per signature
            how = "shrunk" if ev["shrunk"] else ("interrupted while shrinking" if ev["interrupted"]
                                                  else "shrink cut at --shrink-seconds")
            finding = Finding(signature=ev["signature"], failure=ev["failure"], artifact=ev["artifact"],
                              program_steps=ev["program_steps"], examples_to_find=ev["examples_to_find"],
                              seconds_to_find=ev["seconds_to_find"], how=how, unwritten=ev.get("artifact_text"))
            st.findings.append(finding)
            st.failure, st.status = ev["failure"], "running"
            self.line(f"{st.label}: FAIL {ev['failure']}")
            if finding.artifact is not None:
                self.line(f"{st.label}: {how} to {finding.program_steps} steps -> {finding.artifact}; "
                          "fuzzing on past it")
            else:  # the failure must not be lost with the file: print the artifact itself
                self.line(f"{st.label}: {how} to {finding.program_steps} steps; could not write the artifact under "
                          f"{self.plan.out}/ ({ev.get('artifact_error')}); it follows, save it as a .json "
                          "file to replay it")
                self.raw(f"--- artifact ---\n{finding.unwritten}--- end of artifact ---\n")
        elif kind == "api_changed":
            st.api_changed = st.failure = ev["message"]
            self.line(f"{st.label}: {ev['message']}")
        elif kind == "done":
            st.examples, st.steps, st.seconds = ev["examples"], ev["steps"], ev["seconds"]
            st.known, st.waived = ev["known"], ev["waived"]
            st.declined, st.declined_reasons = ev.get("declined", 0), ev.get("declined_reasons", {})
            st.pools = ev.get("pools", {})
            if st.api_changed and not st.findings:
                st.status = "API CHANGED"
                self.line(f"{st.label}: untested after {_n(st.examples)} examples: no artifact written")
            elif st.findings:
                st.status = "FAIL"
                self.line(f"{st.label}: FAIL  {len(st.findings)} distinct failure(s) in {_n(st.examples)} examples")
            else:
                st.status = "stopped" if ev["interrupted"] else "PASS"
                known = f", {sum(st.known.values())} known failure(s) passed over" if st.known else ""
                declined = f" ({_n(st.declined)} more declined by the family)" if st.declined else ""
                self.line(f"{st.label}: {st.status}  {_n(st.tested)} examples{declined}, {_n(st.steps)} steps, "
                          f"{_rate(st)} steps/s{known}")
        self.refresh()

    def raw(self, text: str) -> None:
        """Text as it is (no timestamp), e.g. an artifact to copy from the terminal."""
        self._clear()
        self.stream.write(text)
        self.stream.flush()

    def line(self, text: str, quiet_on_tty: bool = False) -> None:
        if self.tty:
            if quiet_on_tty:
                return
            self._clear()
            self.stream.write(text + "\n")
        else:
            self.stream.write(f"[{self._clock(time.monotonic() - self.started)}] {text}\n")
        self.stream.flush()

    # --- the live block / heartbeat -------------------------------------------------------
    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.tty:
            if now - self.last_beat >= self.HEARTBEAT:
                self.last_beat = now
                self.stream.write(f"[{self._clock(now - self.started)}] {self._totals(now)}\n")
                self.stream.flush()
            return
        if not force and now - self.last_draw < 0.2:
            return
        self.last_draw = now
        width = max(40, shutil.get_terminal_size((100, 24)).columns - 1)
        rows = [self._totals(now), f"  {'config':20} {'status':10} {'examples':>9} {'steps/s':>8} {'time':>7}"]
        for st in self.lanes:
            rows.append(f"  {st.label:20} {st.status:10} {_n(st.examples):>9} {_rate(st):>8} "
                        f"{st.seconds:6.1f}s  {st.failure or ''}")
        self._clear()
        self.stream.write("".join(r[:width] + "\n" for r in rows))
        self.stream.flush()
        self.drawn = len(rows)

    def _clear(self) -> None:
        if self.tty and self.drawn:
            self.stream.write(f"\x1b[{self.drawn}F\x1b[J")
            self.drawn = 0

    def _totals(self, now: float) -> str:
        examples = sum(s.examples for s in self.lanes)
        steps = sum(s.steps for s in self.lanes)
        # distinct failures: each lane's shrunk ones, and the one it is shrinking now
        failures = sum(len(s.findings) + (s.status == "shrinking") for s in self.lanes)
        rate = steps / max(now - self.started, 1e-9)
        left = "" if self.deadline is None else f", {self._clock(max(0.0, self.deadline - now))} left"
        return (f"{self._clock(now - self.started)} elapsed{left}: {_n(examples)} examples, {_n(int(rate))} steps/s, "
                f"{failures} failure{'s' if failures != 1 else ''} so far")

    @staticmethod
    def _clock(seconds: float) -> str:
        s = int(seconds)
        return f"{s // 60}:{s % 60:02d}"

    def finish(self) -> None:
        self._clear()


def add_pools(into: dict, pools: dict) -> dict:
    """Add one count of who built the pools (built_by -> {detail: examples}) into another; ``into``, returned."""
    for built_by, details in pools.items():
        mine = into.setdefault(built_by, {})
        for detail, n in details.items():
            mine[detail] = mine.get(detail, 0) + n
    return into


# Who built the pools (capabilities.POOLS_BUILDERS), as the summary says it.
POOLS_BUILT_BY = {"engine": "the engine's own code", "adapter": "the adapter's wiring", "poolfuzz": "poolfuzz's own pools"}


def pools_lines(by_config: dict[str, list[LaneState]]) -> list[str]:
    """Who built the pools the examples ran on: the count by builder, then, for each config with examples on the
    adapter's wiring, how many and the most frequent reason (one line where every config's is the same). Nothing
    where every example ran on poolfuzz's own pools (the built-in family) or no family said."""
    totals: dict[str, int] = {}
    wired: dict[str, tuple[int, int, dict]] = {}  # config -> (on the wiring, ran, reason -> examples)
    for config, sts in by_config.items():
        mine: dict[str, dict] = {}
        for st in sts:
            add_pools(mine, st.pools)
        ran = sum(n for details in mine.values() for n in details.values())
        for built_by, details in mine.items():
            totals[built_by] = totals.get(built_by, 0) + sum(details.values())
        if "adapter" in mine:
            wired[config] = (sum(mine["adapter"].values()), ran, mine["adapter"])
    if not totals or set(totals) == {"poolfuzz"}:
        return []
    order = [b for b in POOLS_BUILT_BY if b in totals]
    out = ["who built the pools the examples ran on: "
           + ", ".join(f"{POOLS_BUILT_BY[b]} {_n(totals[b])}" for b in order)]
    reasons = {detail for _, _, details in wired.values() for detail in details}
    if len(wired) == len(by_config) > 1 and len(reasons) == 1 and all(n == ran for n, ran, _ in wired.values()):
        out.append(f"  every config on the adapter's wiring: {reasons.pop()}")
        return out
    for config, (n, ran, details) in wired.items():
        top = max(details.items(), key=lambda kv: kv[1])[0]
        out.append(f"  {config}: {_n(n)} of {_n(ran)} on the adapter's wiring, most often: {top}")
    return out


def _n(x: int) -> str:
    return f"{x:,}"


def _rate(st: LaneState) -> str:
    return _n(int(st.steps / st.seconds)) if st.seconds > 0 else "-"


def summary(plan, result: SessionResult, stream: TextIO, *, before_closing=None) -> None:
    """The per-config table, every distinct failure (signature, cost to find, how to replay it), the
    known failures passed over, the waived checks, ``before_closing(stream)`` (the reach table of a
    measured run) and the closing count."""
    from poolfuzz.orchestration.artifacts import slug

    by_config: dict[str, list[LaneState]] = {}
    for st in result.lanes:
        by_config.setdefault(st.lane.title, []).append(st)
    w = max(20, *(len(c) for c in by_config))
    thin = {line.split(": ", 1)[0]: line for line in result.under_tested}  # a suite's titles hold ":"
    stream.write("\n" + f"{'config':{w}}  {'status':12} {'examples':>9} {'declined':>9} {'steps':>9} {'steps/s':>8} "
                 f"{'time':>7}  new failures\n")
    for config, sts in by_config.items():
        statuses = {s.status for s in sts}
        status = ("FAIL" if any(s.findings for s in sts) else
                  "API CHANGED" if "API CHANGED" in statuses else
                  "UNDER-TESTED" if config in thin else
                  "PASS" if statuses == {"PASS"} else
                  "ERROR" if result.errors and statuses & {"running", "shrinking", "waiting"} else
                  "stopped" if statuses & {"stopped", "running", "shrinking"} else "not run")
        tested, steps = sum(s.tested for s in sts), sum(s.steps for s in sts)
        declined = sum(s.declined for s in sts)
        seconds = max(s.seconds for s in sts)
        rate = _n(int(steps / seconds)) if seconds > 0 else "-"
        found = sum(len(s.findings) for s in sts)
        stream.write(f"{config:{w}}  {status:12} {_n(tested):>9} {_n(declined) if declined else '-':>9} {_n(steps):>9} "
                     f"{rate:>8} {seconds:6.1f}s  {found or '-'}\n")
    for config, sts in by_config.items():
        for f in sorted((f for s in sts for f in s.findings), key=lambda f: f.examples_to_find):
            stream.write(f"\n{config}: {f.signature}\n  {f.failure}\n"
                         f"  found after {_n(f.examples_to_find)} examples ({f.seconds_to_find:.1f} s); "
                         f"{f.how} to {f.program_steps} steps\n")
            if f.artifact is None:
                stream.write(f"  the artifact could not be written under {plan.out}/; it is printed above between "
                             "'--- artifact ---' lines: save it as FILE.json, then\n"
                             "  replay:    poolfuzz replay FILE.json\n")
                continue
            stream.write(f"  replay:    poolfuzz replay {f.artifact}\n")
            stream.write(f"  as a test: poolfuzz emit-test {f.artifact} -o test_regression_{slug(config)}.py\n")
    known: dict[str, int] = {}
    waived: dict[str, int] = {}
    for st in result.lanes:
        for sig, n in st.known.items():
            known[sig] = known.get(sig, 0) + n
        for check, n in st.waived.items():
            waived[check] = waived.get(check, 0) + n
    if known:
        stream.write("\nknown failures passed over (not reported; --known or found earlier in the run):\n")
        for sig, n in sorted(known.items(), key=lambda kv: -kv[1]):
            stream.write(f"  {sig}  x{n}\n")
    pools = pools_lines(by_config)
    if pools:
        stream.write("\n" + "".join(f"{line}\n" for line in pools))
    if plan.waive:
        stream.write("\nwaived checks (--waive): " + ", ".join(
            f"{c} ({waived.get(c, 0)} violation{'s' if waived.get(c, 0) != 1 else ''})" for c in plan.waive) + "\n")
    for change in result.api_changes:
        stream.write(f"\n{change}\n")
    if thin:
        stream.write("\ntested less than asked" + (" (--strict: exit 3)" if plan.strict else "") + ":\n"
                     + "".join(f"  {line}\n" for line in thin.values()))
    for e in result.errors:
        stream.write(f"\nerror: {e}\n")
    passed = sum(1 for c, sts in by_config.items() if all(s.status == "PASS" for s in sts) and c not in thin)
    failed = sum(1 for c, sts in by_config.items() if any(s.findings for s in sts))
    tail = ""
    if result.interrupted:
        tail = " (interrupted)"
    elif result.api_changes:
        tail = f" ({len(by_config) - passed - failed} untested: the engine's API changed)"
    elif thin:
        tail = f" ({len(thin)} under-tested)"
    elif passed + failed < len(by_config):
        tail = f" ({len(by_config) - passed - failed} not finished)"
    new = len(result.findings)
    if new or known:
        stream.write(f"\n{new} new failure{'s' if new != 1 else ''} (distinct signatures)"
                     + (f", {sum(known.values())} known failing examples passed over" if known else "") + "\n")
    if before_closing is not None:
        before_closing(stream)
    # The closing line reads "N passed, N failed" alone, as test runners print it.
    stream.write(f"\npoolfuzz: {passed} passed, {failed} failed{tail}\n")
    stream.flush()

