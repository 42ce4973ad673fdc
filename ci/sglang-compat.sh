#!/usr/bin/env bash
# Which SGLang releases `--family sglang` drives (SGLang's own servers: plain, HiCache, PD decode, and the plain and
# PD decode servers with unified memory):
# install each release in turn into one shared environment (the other dependencies stay; each
# release's own pins are re-applied) and print one row per release: installs, imports, configs
# supported (by any of the servers), harness verdict (each finding with the server it came through).
#
#   ci/sglang-compat.sh [VENV] [VERSION ...]     (default: every release from 0.5.9 to 0.5.23,
#                                                 the last post-release of each)
# A release already installed beside VENV as sglang-VERSION (the venvs .ci/run and ci/newest.sh cache) runs there
# without a reinstall; any other is installed into VENV.
# Budget: POOLFUZZ_COMPAT_EXAMPLES examples per config (default 60). Each config is fuzzed past every
# failure and every distinct signature listed; where one check fails at step 0 on every config (the
# reserved padding row and the free list that hands it out, before 0.5.11), that check is waived and the
# release fuzzed again behind it. The table goes to stdout; each release's install log to
# VENV/compat-VERSION.log and its artifacts (one per signature, with the shrunk program) to
# VENV/compat-VERSION-artifacts/. The configs no server runs are named in the row; every server's reason for each
# goes to VENV/compat-VERSION-declined.txt (a decline of the adapter's, not SGLang's, is a gap to close).
# Judged defects: POOLFUZZ_COMPAT_KNOWN="ci/known/A.txt ci/known/B.txt" marks each verdict those lists do not name
# "NEW" (the verdicts still to judge; every other one is a defect already judged).
# Reach (POOLFUZZ_COMPAT_REACH=0 skips it, 3-5x faster): each campaign runs with --coverage and the
# last one, the furthest past step 0, is kept; the row gives the statements executed of
# memory_pool.py, of the token/paged/SWA/mamba allocators and of all of mem_cache/ (per-file tables and HTML
# under VENV/compat-VERSION-reach/). Triton: "interpreted" where the paged allocator only launches Triton
# kernels and there is no GPU, so its kernels ran in Triton's interpreter (the release needed it).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-${POOLFUZZ_SGLANG_VENVS:-$HOME/.cache/poolfuzz/sglang-venvs}/compat}
shift || true
mkdir -p "$(dirname "$venv")"
if [ "$#" -gt 0 ]; then
  versions=("$@")
else
  mapfile -t versions < <(python -m pip index versions sglang 2>/dev/null | python -c '
import re, sys
from packaging.version import Version
text = sys.stdin.read()
line = next(l for l in text.splitlines() if l.startswith("Available versions:"))
vs = [Version(v.strip()) for v in line.split(":", 1)[1].split(",")]
last = {}
for v in vs:
    if Version("0.5.9") <= v < Version("0.5.24") and not v.is_prerelease:
        key = v.release[:3]
        if key not in last or v > last[key]:
            last[key] = v
print("\n".join(str(last[k]) for k in sorted(last)))
')
fi
[ "${#versions[@]}" -gt 0 ] || { echo "sglang-compat: could not list SGLang releases" >&2; exit 2; }

printf '%-13s | %-8s | %-7s | %-60s | %-11s | %-36s | %s\n' release installs imports "configs supported (of $(cd "$repo" && python -c 'from poolfuzz.pools.config import CONFIGS; print(len(CONFIGS))'))" triton \
  "reach: memory_pool / allocators / mem_cache" "harness verdict"
printf '%s\n' "--------------|----------|---------|--------------------------------------------------------------|-------------|--------------------------------------|----------------"
cached_venv() {  # a venv beside VENV that already holds exactly this release (sglang-0.5.10 may hold 0.5.10.post1)
  local dir
  for dir in "$(dirname "$venv")/sglang-$1" "$(dirname "$venv")/sglang-${1%.post*}"; do
    if "$dir/bin/python" -c "import sys, importlib.metadata as m; sys.exit(m.version('sglang') != '$1')" 2>/dev/null; then
      echo "$dir"
      return 0
    fi
  done
  return 1
}

for v in "${versions[@]}"; do
  log="$(dirname "$venv")/compat-$v.log"
  # A release already installed beside VENV (as .ci/run and ci/newest.sh leave them) is used as it is: no reinstall.
  if release_venv=$(cached_venv "$v"); then
    echo "sglang-compat: $v from the cached $release_venv" >"$log"
  elif bash "$repo/ci/sglang-install.sh" "$venv" "$v" --triton >"$log" 2>&1; then
    release_venv=$venv
  else
    printf '%-13s | %-8s | %-7s | %-60s | %-11s | %-36s | %s\n' "$v" no - - - - "install failed (see $log)"
    continue
  fi
  # This checkout's poolfuzz, whatever poolfuzz the venv has installed.
  # each venv builds SGLang's page-hash extension into its own directory: releases run side by side would rebuild (and
  # race on) one shared ~/.cache/torch_extensions, each build naming its own torch
  (cd "$repo" && TORCH_EXTENSIONS_DIR="$release_venv/torch-extensions" PYTHONPATH="$repo" "$release_venv/bin/python" - \
    "$v" "$(dirname "$venv")/compat-$v-reach" "$(dirname "$venv")/compat-$v-artifacts" \
    "$(dirname "$venv")/compat-$v-declined.txt" <<'PY'
import sys, time, warnings
import torch
torch.set_num_threads(1)
version, reach_dir, artifacts, declined_path = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
def row(imports, configs, verdict, triton="-", reach="-"):
    print(f"{version:13} | {'yes':8} | {imports:7} | {configs:60} | {triton:11} | {reach:36} | {verdict}", flush=True)
try:
    from poolfuzz.adapters.sglang import describe
    from poolfuzz.orchestration.plugins import resolve_members
    info = describe()
    servers = resolve_members("sglang")
except Exception as exc:
    row("no", "-", f"{type(exc).__name__}: {str(exc)[:150]}")
    sys.exit(0)
import glob, json, os, shutil, subprocess
from poolfuzz.pools.config import CONFIGS
from poolfuzz.harness.failures import WAIVABLE
examples = os.environ.get("POOLFUZZ_COMPAT_EXAMPLES", "60")
# Judged defects (POOLFUZZ_COMPAT_KNOWN: known-list files, space-separated, relative to this checkout): a verdict none
# of them names is marked NEW, what a person still has to judge.
KNOWN = set()
for path in os.environ.get("POOLFUZZ_COMPAT_KNOWN", "").split():
    for line in open(path):
        if entry := line.split("#")[0].strip():
            KNOWN.add(entry)
def judged(name, sig, fam):
    """Whether a known list names this verdict: on its family and config, or on its config alone."""
    return f"{fam} {name} {sig}" in KNOWN or f"{name} {sig}" in KNOWN
def declines_of(reason):
    """Each named config the release does not run with a family whose probe is ``reason``, with the reason."""
    out = {}
    for name, config in CONFIGS.items():
        try:
            why = reason(config)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        if why:
            out[name] = why
    return out

def unsupported_reason(config):
    """None where one of the suite's servers runs ``config``, else every server's reason."""
    reasons = [p.unsupported_reason(config) for p in servers]
    return None if None in reasons else "; ".join(f"{p.name}: {r}" for p, r in zip(servers, reasons))

declined = declines_of(unsupported_reason)
supported = [name for name in CONFIGS if name not in declined]
with open(declined_path, "w") as out:  # every server's reason, per config no server runs
    for name, why in declined.items():
        out.write(f"{name}\n  " + why.replace("; sglang:", "\n  sglang:") + "\n")

class RunFailed(Exception):
    """The campaign's poolfuzz run neither passed nor failed a check: its verdict is not "pass"."""

def campaign(waive, coverage=None, family="sglang", configs=()):
    """Every distinct signature per config, each shrunk once (the run keeps going past each):
    config -> [(signature, steps of its shrunk program, the family it came through)]."""
    out = os.path.join(artifacts, family.replace(":", "-"), "+".join(waive) or "unwaived")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    cmd = [sys.executable, "-m", "poolfuzz.cli", "run", "--family", family, "--config", *configs,
           "--examples", examples, "--seed", "1", "--db", "none", "--out", out, "--shrink-seconds", "20"]
    if waive:
        cmd += ["--waive", *waive]
    if coverage:
        cmd += ["--coverage", coverage]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode not in (0, 1):  # 2: bad usage; anything else: poolfuzz itself broke
        last = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise RunFailed(f"poolfuzz run exited {proc.returncode}: {last[:200]}")
    found = {}
    for path in sorted(glob.glob(f"{out}/*.json")):
        art = json.load(open(path))
        found.setdefault(art["config"], []).append((art["signature"], len(art["program"]), art["family"]))
    return found

def check_of(signature):
    """The check a signature names (StateLost:contents:mamba@resume -> contents), if any."""
    parts = signature.split("@")[0].split(":")
    return parts[1] if len(parts) == 3 else None

def fails_at_step_zero_everywhere(found, waived, configs):
    """Checks, not yet waived, that fail with a zero-step program on every one of ``configs``."""
    if len(found) < len(configs):
        return []
    per_config = [{check_of(sig) for sig, steps, _ in sigs if steps == 0} for sigs in found.values()]
    common = set.intersection(*per_config) - {None} - set(waived)
    return sorted(c for c in common if c in WAIVABLE)

def reach_of(directory):
    """memory_pool.py, the allocators and mem_cache/ as a whole: statements executed, in percent."""
    try:
        files = json.load(open(os.path.join(directory, "reach.json")))["files"]
    except (OSError, ValueError, KeyError):
        return "not measured"
    def pct(names):
        stmts = sum(files[n]["statements"] for n in names)
        return f"{100 * sum(files[n]['executed'] for n in names) / stmts:.0f}%" if stmts else "-"
    pool = [n for n in files if n.endswith("mem_cache/memory_pool.py")]
    allocators = [n for n in files if n.endswith("mem_cache/allocator.py") or any(
        n.endswith(f"mem_cache/allocator/{f}.py") for f in ("base", "token", "paged", "swa", "mamba"))]
    tree = [n for n in files if "/mem_cache/" in n]
    return f"{pct(pool)} / {pct(allocators)} / {pct(tree)}"

measure = os.environ.get("POOLFUZZ_COMPAT_REACH", "1") != "0"
triton = "interpreted" if info.get("kernels_interpreted") and info.get("paged_kernels") else "-"

def fuzzed_row(label, family, configs, *, measured):
    """Fuzz ``configs`` through ``family`` and print its row under ``label`` (a check that fails at step 0 on every
    config is waived and the configs fuzzed again behind it)."""
    global version
    version = label
    waived = []
    reach = reach_dir if measured else None  # each campaign overwrites it: the table shows the last
    try:
        found = campaign(waived, coverage=reach, family=family, configs=configs)
        # A check that fails at step 0 on every config hides everything behind it: waive it and look
        # again, until no such check is left (a few rounds: each round waives at least one more check).
        while step_zero := fails_at_step_zero_everywhere(found, waived, configs):
            waived += step_zero
            found = campaign(waived, coverage=reach, family=family, configs=configs)
    except RunFailed as exc:
        row("yes", f"{len(configs)} supported", f"FAILED: {exc}" + (f" (waived {','.join(waived)})" if waived else ""))
        return
    verdicts = [f"{name}: " + ", ".join(f"{sig} ({steps} steps" + (f", {fam}" if fam != family else "")
                                        + (", NEW)" if KNOWN and not judged(name, sig, fam) else ")")
                                        for sig, steps, fam in sigs) for name, sigs in found.items()]
    if waived:
        verdicts.insert(0, "waived " + ",".join(waived) + " (fails at step 0 everywhere)")
    listed = f"{len(configs)}: " + ("all" if len(configs) == len(CONFIGS) else ", ".join(configs))
    if declined:
        listed += f"; declined {len(declined)}: {', '.join(declined)} (why: {os.path.basename(declined_path)})"
    row("yes", listed, "; ".join(verdicts) if verdicts else "pass on all", triton,
        reach_of(reach_dir) if measured else "not measured")

release = version
if supported:
    fuzzed_row(release, "sglang", supported, measured=measure)
else:  # no server of the suite starts on this release: say why
    why = unsupported_reason(CONFIGS["dense"]) or "-"
    row("yes", "0 (no server starts)", f"DECLINED: {why[:300]}")
PY
  )
done
