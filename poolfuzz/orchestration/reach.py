"""Reach: which statements and branches of the engine's own code a run executed (coverage.py, every worker).

A family factory names the source that is "its engine" in the documented attribute ``engine_code``:
a tuple of paths, each relative to the directory that holds the engine's top-level package
(site-packages for an installed engine), a directory or a file. ``poolfuzz run --coverage DIR`` measures
those paths in every worker process, combines the data, prints a per-file table and writes
``coverage.json`` (coverage.py's own), ``reach.json`` (the table) and ``html/`` into DIR.

Why it is done this way:
- coverage is given directories, never module names: naming ``sglang.srt.mem_cache`` would make coverage
  import sglang before poolfuzz's CPU import shims are in place, so the package is located with
  ``find_spec`` of its top-level name, which imports nothing;
- the workers are spawned processes that start measuring at interpreter start-up, through coverage's
  process-start hook (``COVERAGE_PROCESS_START``), before anything is imported: a module imported before
  measurement starts would show its ``def`` and ``class`` lines as never run. The worker also calls the
  hook itself, for installs without coverage's ``.pth`` file;
- the pure-Python tracer: coverage's C tracer crashed while importing torch under Python 3.11 on these
  machines, the pure-Python one did not.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from poolfuzz.errors import UsageError
from poolfuzz.pools.capabilities import factory_capabilities
from poolfuzz.pools.environment import environment_set

ENGINE_CODE_ATTRIBUTE = "engine_code"
TRACER = "pytrace"
RC_NAME = ".poolfuzz-coveragerc"
DATA_NAME = ".coverage"
CODE_NAME = "reach-code.json"  # the engine code (and families) the reach in a directory is of, for --coverage-add
INSTALL_HINT = "python -m pip install 'coverage>=7.6'"


@dataclass(frozen=True, kw_only=True)
class EngineCode:
    """Where a family's engine code lives on this machine."""

    family: str
    root: Path  # the directory that holds the engine's top-level package
    entries: tuple[str, ...]  # as declared: relative to ``root``, directories or files
    absent: tuple[str, ...] = ()  # declared, but not in the installed release: not measured

    @property
    def paths(self) -> tuple[Path, ...]:
        return tuple(self.root / entry for entry in self.entries)

    @property
    def source_dirs(self) -> tuple[Path, ...]:
        """What coverage measures: each declared directory, and the directory of each declared file (the
        report keeps only the declared files of it)."""
        return tuple(dict.fromkeys(p if p.is_dir() else p.parent for p in self.paths))

    @property
    def report_patterns(self) -> tuple[str, ...]:
        return tuple(f"{p}/*" if p.is_dir() else str(p) for p in self.paths)


@dataclass(frozen=True, kw_only=True)
class FileReach:
    """One file's reach: statements and branches (arcs between statements) executed of those it has."""

    path: str  # relative to the engine root
    statements: int
    executed: int
    branches: int
    taken: int

    @property
    def statement_percent(self) -> float:
        return 100.0 * self.executed / self.statements if self.statements else 100.0

    @property
    def branch_percent(self) -> float:
        return 100.0 * self.taken / self.branches if self.branches else 100.0

    def as_json(self) -> dict:
        return {"statements": self.statements, "executed": self.executed, "branches": self.branches,
                "taken": self.taken, "statement_percent": round(self.statement_percent, 2),
                "branch_percent": round(self.branch_percent, 2)}


def require_coverage() -> None:
    """coverage.py is importable here, or a UsageError that says how to install it."""
    try:
        import coverage
    except ImportError:
        raise UsageError(f"--coverage needs coverage.py, which is not installed in this Python; install it "
                         f"({INSTALL_HINT}) or drop --coverage") from None
    if not hasattr(coverage.Coverage, "current"):
        raise UsageError(f"--coverage needs coverage.py 7.6 or later, found {coverage.__version__}; upgrade it "
                         f"({INSTALL_HINT})")


def engine_code_of(plugins) -> EngineCode:
    """The engine code the resolved family plug-ins declare (one family's, or a suite's members' together),
    located without importing the engine."""
    declared: dict[str, None] = {}
    for plugin in plugins:
        entries = factory_capabilities(plugin.factory).engine_code
        if not entries or isinstance(entries, str) or not all(isinstance(e, str) and e for e in entries):
            raise UsageError(f"--coverage: family {plugin.name!r} ({plugin.target}) declares no engine code to "
                             f"measure; give its factory an {ENGINE_CODE_ATTRIBUTE!r} attribute, a tuple of paths "
                             "relative to the directory holding the engine's top-level package (e.g. ('mypkg/pools',))")
        declared |= dict.fromkeys(entries)
    name = ", ".join(plugin.name for plugin in plugins)
    tops = {Path(entry).parts[0] for entry in declared}
    if len(tops) != 1:
        raise UsageError(f"--coverage: family {name!r} declares engine code under several top-level packages "
                         f"({', '.join(sorted(tops))}); declare one package's files")
    (top,) = tops
    spec = importlib.util.find_spec(top)  # a top-level name: finds the package, imports nothing
    if spec is None or not (spec.submodule_search_locations or spec.origin):
        raise UsageError(f"--coverage: family {name!r} measures package {top!r}, which is not installed in this "
                         "Python; install it or drop --coverage")
    location = list(spec.submodule_search_locations or [])[:1] or [os.path.dirname(spec.origin)]
    root = Path(location[0]).resolve().parent
    # An entry the installed release lacks (SGLang's scheduler_components before 0.5.13) is not measured; a family
    # none of whose entries is here declares the wrong code.
    present = tuple(entry for entry in declared if (root / entry).exists())
    if not present:
        raise UsageError(f"--coverage: family {name!r} declares engine code {', '.join(declared)}, none of which is "
                         f"under {root}; fix the factory's {ENGINE_CODE_ATTRIBUTE!r}")
    return EngineCode(family=name, root=root, entries=present,
                      absent=tuple(entry for entry in declared if entry not in present))


def write_settings(directory: str, code: EngineCode, *, add: bool = False) -> str:
    """The coverage configuration of a run, written into ``directory``; stale data of an earlier run there goes,
    unless ``add`` (``--coverage-add``): then the earlier runs' combined data stays, to be combined with this run's
    (``code`` is then :func:`added_code`'s, theirs and this family's together). Returns the configuration file's path
    (what the workers' start-up hook reads)."""
    out = Path(directory).resolve()
    out.mkdir(parents=True, exist_ok=True)
    earlier = out / DATA_NAME
    for stale in glob.glob(str(out / f"{DATA_NAME}*")):
        if add and Path(stale) == earlier:
            # combined with the workers' files: coverage combines every ``.coverage.*`` file it finds
            earlier.rename(out / f"{DATA_NAME}.earlier-runs")
            continue
        if not (add and stale.endswith(".earlier-runs")):
            os.unlink(stale)
    (out / CODE_NAME).write_text(json.dumps({"root": str(code.root), "entries": list(code.entries),
                                             "families": code.family.split(", ")}) + "\n")
    lines = ["[run]", "branch = True", "parallel = True", f"data_file = {out / DATA_NAME}", f"core = {TRACER}",
             "source =", *(f"    {d}" for d in code.source_dirs),
             "[report]", "include =", *(f"    {p}" for p in code.report_patterns),
             "[html]", f"directory = {out / 'html'}", "[json]", f"output = {out / 'coverage.json'}"]
    rc = out / RC_NAME
    rc.write_text("\n".join(lines) + "\n")
    return str(rc)


def added_code(out: Path, code: EngineCode) -> EngineCode:
    """The engine code of the runs whose reach ``out`` already holds (``reach-code.json``) and ``code``, together:
    the table of an added run is the union over every family measured into the directory. A directory measured
    against another install of the engine is a UsageError (its files are not these)."""
    recorded = out / CODE_NAME
    if not recorded.exists():
        if (out / DATA_NAME).exists():  # data whose engine code nobody recorded: its files cannot be trusted as these
            raise UsageError(f"--coverage-add: {out} holds reach data that no poolfuzz run recorded the engine code of "
                             f"(no {CODE_NAME}); measure into a fresh directory, or drop --coverage-add")
        return code
    try:
        earlier = json.loads(recorded.read_text())
        root, entries, families = Path(earlier["root"]), earlier["entries"], earlier["families"]
        if not (isinstance(entries, list) and all(isinstance(e, str) for e in entries)
                and isinstance(families, list) and all(isinstance(f, str) for f in families)):
            raise ValueError("entries and families must be lists of strings")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--coverage-add: {recorded} is not what an earlier measured run wrote ({exc}); measure "
                         "into a fresh directory, or drop --coverage-add") from None
    if root != code.root:
        raise UsageError(f"--coverage-add: {out} holds the reach of the engine under {root}, not {code.root}; measure "
                         "into a fresh directory, or drop --coverage-add")
    names = ", ".join(dict.fromkeys([*families, code.family]))
    return EngineCode(family=names, root=code.root, entries=tuple(dict.fromkeys([*entries, *code.entries])),
                      absent=code.absent)


@contextmanager
def measuring(rc: str):
    """While inside: every Python process started from this one measures with ``rc`` from its first line
    (coverage's process-start hook reads these variables); this process itself is not measured."""
    with environment_set({"COVERAGE_PROCESS_START": rc, "COVERAGE_CORE": TRACER}):
        yield


def start_in_worker() -> None:
    """A worker's first act: start measuring if the start-up hook has not (no-op when it has)."""
    import coverage

    coverage.process_startup()


def save_in_worker() -> None:
    """A worker's last act: stop and write its data now, not only at interpreter exit (which a worker torn
    down by its parent may not reach)."""
    import coverage

    cov = coverage.Coverage.current()
    if cov is not None:
        cov.stop()
        cov.save()


def combine(rc: str, code: EngineCode) -> list[FileReach]:
    """Combine the workers' data, write coverage.json, reach.json and html/ beside ``rc``; the per-file reach
    of the engine code (sorted by path). A UsageError when no worker left any data."""
    import coverage
    from coverage.exceptions import NoDataError

    out = Path(rc).parent
    cov = coverage.Coverage(config_file=rc)
    try:
        cov.combine(data_paths=[str(out)], keep=False)
    except NoDataError:
        raise UsageError(f"--coverage: no worker left coverage data in {out}; was the run stopped before it "
                         "started?") from None
    cov.save()
    cov.json_report(outfile=str(out / "coverage.json"))
    cov.html_report(directory=str(out / "html"))
    data = json.loads((out / "coverage.json").read_text())
    root = code.root
    files = []
    for name, entry in data["files"].items():
        summary = entry["summary"]
        files.append(FileReach(path=_relative(name, root), statements=summary["num_statements"],
                               executed=summary["covered_lines"], branches=summary.get("num_branches", 0),
                               taken=summary.get("covered_branches", 0)))
    files.sort(key=lambda f: f.path)
    (out / "reach.json").write_text(json.dumps(
        {"root": str(root), "files": {f.path: f.as_json() for f in files}, "total": total(files).as_json()},
        indent=1) + "\n")
    return files


def total(files: list[FileReach]) -> FileReach:
    return FileReach(path="total", statements=sum(f.statements for f in files),
                     executed=sum(f.executed for f in files), branches=sum(f.branches for f in files),
                     taken=sum(f.taken for f in files))


def print_table(files: list[FileReach], directory: str, stream: TextIO) -> None:
    """The per-file reach table (statements and branches executed, of those each file has)."""
    width = max([len(f.path) for f in files] + [len("file")])
    stream.write(f"\nreach: engine code executed, every worker combined (coverage.py, {TRACER} tracer)\n")
    stream.write(f"{'file':<{width}}  {'stmts':>6} {'run':>6} {'stmt%':>6}  {'branches':>8} {'taken':>6} "
                 f"{'branch%':>7}\n")
    for f in [*files, total(files)]:
        stream.write(f"{f.path:<{width}}  {f.statements:>6} {f.executed:>6} {f.statement_percent:>5.1f}%  "
                     f"{f.branches:>8} {f.taken:>6} {f.branch_percent:>6.1f}%\n")
    out = Path(directory)
    stream.write(f"reach written to {out / 'reach.json'}, {out / 'coverage.json'} and {out / 'html' / 'index.html'}\n")


def _relative(name: str, root: Path) -> str:
    try:
        return str(Path(name).resolve().relative_to(root))
    except ValueError:
        return name


def run_measured(plan, run_session, *, stream: TextIO | None = None) -> int:
    """``poolfuzz run --coverage DIR``: ``run_session(plan, stream=)`` with each worker measured, then the combined
    reach; the session's exit code (a run whose data could not be combined says so on stderr and keeps its
    verdict). The session is passed in: it imports this module in its workers."""
    import sys

    from poolfuzz.orchestration.plugins import resolve_members

    stream = stream or sys.stdout
    code = engine_code_of(resolve_members(plan.family))
    if plan.coverage_add:  # the union with what the directory holds: its families' code and this one's
        code = added_code(Path(plan.coverage).resolve(), code)
    rc = write_settings(plan.coverage, code, add=plan.coverage_add)
    def reach_table(out: TextIO) -> None:  # every worker has exited and saved its data by now
        try:
            files = combine(rc, code)
        except UsageError as exc:
            print(f"poolfuzz: {exc}", file=sys.stderr)
            return
        print_table(files, plan.coverage, out)
        if code.absent:
            out.write(f"not in this release, not measured: {', '.join(code.absent)}\n")
        if plan.coverage_add:
            out.write(f"reach of {code.family}, every run added into {plan.coverage} combined\n")

    with measuring(rc):
        # The table comes before the closing "N passed, N failed" line, which stays the last one.
        result = run_session(plan, stream=stream, before_closing=reach_table)
    return result.exit_code
