#!/usr/bin/env bash
# Which vLLM releases the vllm family drives: install each release in turn into one shared
# environment (ci/vllm-install.sh swaps vLLM and keeps the rest) and print one row per release:
# installs, imports, configs supported, harness verdict (every distinct failure signature) and the
# #44409 anchor (tests/vllm/test_vllm_44409.py; expected to catch the bug before 0.24.0).
#
#   ci/vllm-compat.sh [VENV] [VERSION ...]     (default: 0.16.0 to 0.34.0)
# Budget: POOLFUZZ_COMPAT_EXAMPLES examples per config (default 60). The table goes to stdout; each
# release's install log to VENV/../compat-VERSION.log and its failure artifacts (the shrunk program
# of every distinct signature) to POOLFUZZ_COMPAT_OUT/VERSION (default VENV/../compat-out/VERSION),
# listed under the row as "config: signature (N steps)". Feature detection only: nothing here or in
# the adapter switches on the version string.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${1:-${POOLFUZZ_VLLM_VENVS:-$HOME/.cache/poolfuzz/vllm-venvs}/compat}
shift || true
mkdir -p "$(dirname "$venv")"
if [ "$#" -gt 0 ]; then
  versions=("$@")
else
  versions=()
  for minor in $(seq 16 34); do versions+=("0.$minor.0"); done
fi
examples=${POOLFUZZ_COMPAT_EXAMPLES:-60}
artifacts=${POOLFUZZ_COMPAT_OUT:-$(dirname "$venv")/compat-out}

printf '%-8s | %-8s | %-7s | %-28s | %-60s | %s\n' release installs imports "configs supported" \
  "harness verdict" "#44409 anchor"
printf '%s\n' "---------|----------|---------|------------------------------|--------------------------------------------------------------|--------------"
for v in "${versions[@]}"; do
  log="$(dirname "$venv")/compat-$v.log"
  # A venv that holds this release already (e.g. .ci/run's vllm-0.33.0) is used as it is.
  if "$venv/bin/python" -c "import sys, importlib.metadata as m; sys.exit(m.version('vllm') != '$v')" 2>/dev/null; then
    echo "vllm $v already installed in $venv" >"$log"
  elif ! bash "$repo/ci/vllm-install.sh" "$venv" "$v" >"$log" 2>&1; then
    printf '%-8s | %-8s | %-7s | %-28s | %-60s | %s\n' "$v" no - - "install failed (see $log)" -
    continue
  fi
  out="$artifacts/$v"
  rm -rf "$out" && mkdir -p "$out"
  (cd "$repo" && VLLM_LOGGING_LEVEL=ERROR PYTHONPATH="$repo" "$venv/bin/python" - "$v" "$examples" "$out" 2>/dev/null <<'PY'
import glob, json, subprocess, sys
version, examples, out = sys.argv[1:4]
def row(imports, configs, verdict, anchor="-"):
    print(f"{version:8} | {'yes':8} | {imports:7} | {configs:28} | {verdict:60} | {anchor}", flush=True)
try:
    from poolfuzz.adapters.vllm import describe, scheduler_unsupported_reason
    describe()
except Exception as exc:
    row("no", "-", f"{type(exc).__name__}: {str(exc)[:120]}")
    sys.exit(0)
from poolfuzz.pools.config import CONFIGS
ok = [n for n in CONFIGS if scheduler_unsupported_reason(CONFIGS[n]) is None]  # what --family vllm runs
run = subprocess.run([sys.executable, "-m", "poolfuzz.cli", "run", "--family", "vllm", "--examples", examples,
                      "--seed", "1", "--db", "none", "--out", out], capture_output=True, text=True)
found = {}
for f in sorted(glob.glob(f"{out}/*.json")):
    art = json.load(open(f))
    found.setdefault((art.get("config"), art.get("signature", "?")), len(art.get("program", ())))
sigs = sorted({sig for _, sig in found})
changed = next((line for line in (run.stdout + run.stderr).splitlines() if "API CHANGED" in line), None)
verdict = ("pass" if run.returncode == 0 else changed[changed.index("API CHANGED"):][:120] if changed
           else ("; ".join(sigs) or f"exit {run.returncode}"))
anchor = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         "tests/vllm/test_vllm_44409.py"], capture_output=True, text=True)
tail = anchor.stdout.strip().splitlines()[-1] if anchor.stdout.strip() else f"exit {anchor.returncode}"
row("yes", f"{len(ok)} of {len(CONFIGS)}", verdict, tail)
for (config, sig), steps in sorted(found.items()):
    print(f"{'':8} |   {config}: {sig} ({steps} steps)", flush=True)
PY
  )
done
