#!/usr/bin/env bash
# The newest release of each engine the package index offers: install it (a venv per release, cached
# outside the clone), run `poolfuzz doctor` and a short `poolfuzz run`, and print one line per config:
#
#   engine  release  config  verdict
#
# so the first red build after an engine release says "API CHANGED" (the adapter needs updating) or
# names a finding, never a false one.
#
#   ci/newest.sh [ENGINE ...]        (default: sglang vllm)
# POOLFUZZ_NEWEST_MINUTES: the run's budget per engine (default 2); POOLFUZZ_NEWEST_VERSION_<ENGINE>
# (e.g. POOLFUZZ_NEWEST_VERSION_VLLM=0.34.0) pins the release instead of asking the index; the venvs
# go to POOLFUZZ_SGLANG_VENVS / POOLFUZZ_VLLM_VENVS, the ones .ci/run uses, so a release .ci/run already
# installed is not installed twice. Known defects of a release (ci/known/ENGINE-VERSION.txt) are passed
# over. Exit status: 0 every engine passed, 1 a finding, 2 an API change or an install that failed.
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
minutes=${POOLFUZZ_NEWEST_MINUTES:-2}
engines=("$@")
[ "${#engines[@]}" -gt 0 ] || engines=(sglang vllm)
status=0

newest_release() {  # the newest release of $1 on the index ("" when the index cannot be asked)
  python -m pip index versions "$1" 2>/dev/null | sed -n "s/^$1 (\(.*\))$/\1/p" | head -n 1
}

worst() {  # keep the worse of two exit codes: 2 (API change, install) over 1 (finding) over 0
  if [ "$1" -eq 2 ] || [ "$2" -eq 2 ]; then echo 2; elif [ "$1" -eq 1 ] || [ "$2" -eq 1 ]; then echo 1; else echo 0; fi
}

for engine in "${engines[@]}"; do
  case "$engine" in
    sglang) venvs=${POOLFUZZ_SGLANG_VENVS:-$HOME/.cache/poolfuzz/sglang-venvs}; installer=ci/sglang-install.sh ;;
    vllm) venvs=${POOLFUZZ_VLLM_VENVS:-$HOME/.cache/poolfuzz/vllm-venvs}; installer=ci/vllm-install.sh ;;
    *) echo "ci/newest.sh: unknown engine '$engine' (sglang or vllm)" >&2; exit 2 ;;
  esac
  pin_var="POOLFUZZ_NEWEST_VERSION_$(echo "$engine" | tr '[:lower:]' '[:upper:]')"
  version=${!pin_var:-$(newest_release "$engine")}
  if [ -z "$version" ]; then
    printf '%-7s %-9s %-24s %s\n' "$engine" "?" "-" "the package index did not answer: no newest release to check"
    status=$(worst "$status" 2)
    continue
  fi
  venv="$venvs/$engine-$version"
  mkdir -p "$venvs"
  log="$venvs/newest-install-$version.log"
  if ! "$venv/bin/python" -c "import sys, importlib.metadata as m; sys.exit(m.version('$engine') != '$version')" 2>/dev/null; then
    if ! bash "$repo/$installer" "$venv" "$version" >"$log" 2>&1; then
      printf '%-7s %-9s %-24s %s\n' "$engine" "$version" "-" "install failed (see $log)"
      status=$(worst "$status" 2)
      continue
    fi
  fi
  py="$venv/bin/python"
  doctor=$(cd "$repo" && PYTHONPATH="$repo" "$py" -m poolfuzz.cli doctor --family "$engine" 2>&1)
  doctor_status=$?
  if [ "$doctor_status" -ne 0 ]; then
    verdict=$(printf '%s\n' "$doctor" | grep -m1 -E '^(API CHANGED|poolfuzz: )' || printf '%s\n' "$doctor" | tail -n 1)
    printf '%-7s %-9s %-24s %s\n' "$engine" "$version" "(doctor)" "$verdict"
    status=$(worst "$status" 2)
    continue
  fi
  known=()
  [ -f "$repo/ci/known/$engine-$version.txt" ] && known=(--known "$repo/ci/known/$engine-$version.txt")
  out=$(mktemp -d)
  run=$(cd "$repo" && PYTHONPATH="$repo" VLLM_LOGGING_LEVEL=ERROR "$py" -m poolfuzz.cli run --family "$engine" \
        --minutes "$minutes" --seed 1 --db none --out "$out/failures" "${known[@]}" 2>&1)
  run_status=$?
  # The summary table: one row per config (status, examples, declined, steps, ...); then any verdict lines.
  printf '%s\n' "$run" | awk -v e="$engine" -v v="$version" '
    /^config +status/ { table = 1; next }
    table && NF == 0 { table = 0 }
    table { two = ($2 == "API");  # "API CHANGED" is the one two-word status
            printf "%-7s %-9s %-24s %s (%s examples)\n", e, v, $1, two ? "API CHANGED" : $2, two ? $4 : $3 }'
  printf '%s\n' "$run" | grep -E '^(API CHANGED|[a-z0-9:/-]+: [A-Za-z]+:)' | sed "s/^/$engine $version   /" || true
  case "$run_status" in
    0) ;;
    1) status=$(worst "$status" 1) ;;
    *) printf '%-7s %-9s %-24s %s\n' "$engine" "$version" "(run)" "exit $run_status: $(printf '%s\n' "$run" | tail -n 1)"
       status=$(worst "$status" 2) ;;
  esac
  rm -rf "$out"
done
exit "$status"
