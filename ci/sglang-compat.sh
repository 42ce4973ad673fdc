#!/usr/bin/env bash
# Which SGLang releases the sglang family drives: install each release in turn into one shared
# environment (the other dependencies stay; each release's own pins are re-applied) and print one
# row per release: installs, imports, configs supported, harness verdict.
#
#   ci/sglang-compat.sh [VENV] [VERSION ...]     (default: every release from 0.5.9 to 0.5.23,
#                                                 the last post-release of each)
# Budgets: POOLFUZZ_COMPAT_EXAMPLES (swa-ssm, default 150) and POOLFUZZ_COMPAT_OTHER (other configs,
# default 10). The table goes to stdout; each release's install log to VENV/compat-VERSION.log.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-${POOLFUZZ_SGLANG_VENVS:-$HOME/.cache/poolfuzz/sglang-venvs}/compat}
shift || true
mkdir -p "$(dirname "$venv")"
[ -x "$venv/bin/python" ] || python -m venv "$venv"
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

printf '%-13s | %-8s | %-7s | %-60s | %s\n' release installs imports "configs supported (of 8)" "harness verdict"
printf '%s\n' "--------------|----------|---------|--------------------------------------------------------------|----------------"
for v in "${versions[@]}"; do
  log="$(dirname "$venv")/compat-$v.log"
  if ! bash "$repo/ci/sglang-install.sh" "$venv" "$v" --triton >"$log" 2>&1; then
    printf '%-13s | %-8s | %-7s | %-60s | %s\n' "$v" no - - "install failed (see $log)"
    continue
  fi
  "$venv/bin/python" - "$v" <<'PY'
import sys, time, warnings
import torch
torch.set_num_threads(1)
version = sys.argv[1]
def row(imports, configs, verdict):
    print(f"{version:13} | {'yes':8} | {imports:7} | {configs:60} | {verdict}", flush=True)
try:
    from poolfuzz.adapters.sglang import describe, unsupported_reason, build_family
    info = describe()
except Exception as exc:
    row("no", "-", f"{type(exc).__name__}: {str(exc)[:150]}")
    sys.exit(0)
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from poolfuzz.harness.failures import PoolfuzzFailure
from poolfuzz.harness.machine import machine_for
from poolfuzz.pools.config import CONFIGS
import os
budget_ssm = int(os.environ.get("POOLFUZZ_COMPAT_EXAMPLES", "150"))
budget_other = int(os.environ.get("POOLFUZZ_COMPAT_OTHER", "10"))
supported, verdicts = [], []
for name, config in CONFIGS.items():
    try:
        why = unsupported_reason(config)
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
    if why:
        continue
    supported.append(name)
    n = budget_ssm if name == "swa-ssm" else budget_other
    last = {}
    class M(machine_for(config, family_factory=build_family)):
        def __init__(self):
            super().__init__(); last["e"] = self.engine
    M.__name__ = "PoolMachine"
    t = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run_state_machine_as_test(M, settings=settings(max_examples=n, stateful_step_count=30, deadline=None,
                                      derandomize=True, database=None, suppress_health_check=list(HealthCheck)))
    except PoolfuzzFailure as exc:
        d = exc.divergence
        verdicts.append(f"{name}: {type(exc).__name__} {d.component or d.kind} in {len(last['e'].log)} steps")
    except Exception as exc:
        verdicts.append(f"{name}: error {type(exc).__name__}: {str(exc)[:80]}")
paged = [n for n in CONFIGS if n.endswith("-ps4")]
configs = f"{len(supported)}: " + ("all" if len(supported) == len(CONFIGS) else
                                   ", ".join(supported) if len(supported) < len(CONFIGS) else "")
row("yes", configs, "; ".join(verdicts) if verdicts else "pass on all")
PY
done
