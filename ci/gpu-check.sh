#!/usr/bin/env bash
# The GPU checks, on one machine with a CUDA GPU, in under 8 minutes; a short table is printed last.
#
#   bash ci/gpu-check.sh            # from anywhere; poolfuzz must be installed (pip install -e .)
#
# Checks: the test suite on CUDA; `poolfuzz run` on CUDA passes on the correct families and finds
# SGLang #35957 with its fault on; the CUDA artifact replays on CPU and on CUDA; the emitted
# regression test fails on CUDA with the bug and passes without it; two workers share one database;
# `poolfuzz bench`: checksums at >= 50% of the device's copy bandwidth (its table is printed last).
# Exit 0 when every check passed, 1 when one failed, 2 when no GPU is visible.
# GPU_CHECK_DEVICE=cpu runs the same checks on the CPU (to try the script on a machine without a GPU).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
# The suite took 194 s on an H200 machine with 12 workers (16 cores; 2026-12-04, torch 2.11+cu130) and 255 s on an
# H100 one (2026-12-05, 1908 tests): CUDA launches, not the GPU, bound it.
XDIST=${GPU_CHECK_XDIST:-$(( $(nproc) > 12 ? 12 : $(nproc) ))}
TESTS=${GPU_CHECK_TESTS:-tests}
FAULT=swa-ignores-mamba-backup
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)
ROWS=()
FAILED=0

# --- preflight: a GPU, and poolfuzz importable -------------------------------------------------
if ! INFO=$("$PY" - "$DEVICE" 2>&1 <<'EOF'
import sys
try:
    import torch
    import poolfuzz.cli  # noqa: F401
except Exception as exc:
    print(f"cannot import torch and poolfuzz ({exc}); install them first: python -m pip install -e .")
    sys.exit(2)
if sys.argv[1].startswith("cuda"):
    if not torch.cuda.is_available():
        print(f"no CUDA GPU is visible (torch {torch.__version__}, CUDA build {torch.version.cuda}); "
              "run this on a GPU machine with a CUDA build of torch")
        sys.exit(2)
    print(f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}")
else:
    print(f"CPU dry run, torch {torch.__version__}")
EOF
); then
  echo "gpu-check: $INFO" >&2
  exit 2
fi
echo "gpu-check: $INFO"

# check NAME TIMEOUT EXPECTED_EXIT MUST_MATCH DETAIL_CMD -- COMMAND...: runs COMMAND with a time
# limit, logs to $WORK/NAME.log, records ok / FAIL / timeout and a detail line in the table. A check
# is ok only when the exit code is the expected one AND the log has a line matching MUST_MATCH (an
# extended regex): exit 1 is what a found bug gives, and also what a traceback gives.
check() {
  local name=$1 limit=$2 want=$3 must=$4 detail=$5
  shift 6
  local t0 rc result
  t0=$(date +%s)
  echo "== $name: $*"
  timeout --signal=INT --kill-after=10 "$limit" "$@" >"$WORK/$name.log" 2>&1
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    result=timeout
  elif [ "$rc" -ne "$want" ]; then
    result="FAIL(rc=$rc)"
  elif ! grep -qE "$must" "$WORK/$name.log"; then
    result="FAIL(no line matching '$must')"
  else
    result=ok
  fi
  if [ "$result" != ok ]; then
    FAILED=1
    tail -n 25 "$WORK/$name.log"
  fi
  ROWS+=("$(printf '%-24s %-12s %5ss  %s' "$name" "$result" "$(( $(date +%s) - t0 ))" "$(eval "$detail" 2>/dev/null | head -c 70)")")
}

last_summary() { grep -E '^poolfuzz: [0-9]+ passed' "$WORK/$1.log" | tail -n 1 | sed 's/^poolfuzz: //'; }

check tests 400 0 ' passed' "tail -n 1 '$WORK/tests.log' | tr -d '='" -- \
  env HYPOTHESIS_PROFILE=gpu "$PY" -m pytest -q -p no:cacheprovider --device "$DEVICE" -n "$XDIST" $TESTS

check run-correct 50 0 '^poolfuzz: [0-9]+ passed' "last_summary run-correct" -- \
  poolfuzz run --device "$DEVICE" --minutes 0.5 --seed 1 --db none --out "$WORK/pass"

check run-fault 50 1 'StateLost: req [0-9]+ resumed' "grep -m1 -o 'StateLost: req [0-9]* resumed; component [a-z.0-9]*' '$WORK/run-fault.log'" -- \
  poolfuzz run --device "$DEVICE" --config swa-ssm --faults "$FAULT" --examples 300 --seed 9 \
  --db "$WORK/db" --out "$WORK/fail" --shrink-seconds 20

ARTIFACT=$(ls "$WORK"/fail/*.json 2>/dev/null | head -n 1)
ARTIFACT=${ARTIFACT:-"$WORK/fail/missing.json"}

check replay-on-cpu 25 1 REPRODUCED "grep -m1 -E 'REPRODUCED|did not reproduce' '$WORK/replay-on-cpu.log'" -- \
  poolfuzz replay "$ARTIFACT" --device cpu
check replay-on-device 25 1 REPRODUCED "grep -m1 -E 'REPRODUCED|did not reproduce' '$WORK/replay-on-device.log'" -- \
  poolfuzz replay "$ARTIFACT" --device "$DEVICE"

# The emitted test, run by a plain pytest on the device: the copy with the bug must fail, the fixed one pass.
check emit-test 40 0 '1 failed, 1 passed' "tail -n 1 '$WORK/emit-test.log'" -- \
  bash -c "poolfuzz emit-test '$ARTIFACT' -o '$WORK/test_regression_bug.py' || exit 3
    sed 's/^FAULTS = .*/FAULTS = []/' '$WORK/test_regression_bug.py' > '$WORK/test_regression_fixed.py'
    POOLFUZZ_DEVICE='$DEVICE' '$PY' -m pytest -q -p no:cacheprovider --rootdir '$WORK' \
      '$WORK/test_regression_bug.py' '$WORK/test_regression_fixed.py' > '$WORK/emitted.log' 2>&1
    tail -n 1 '$WORK/emitted.log'
    grep -q '1 failed, 1 passed' '$WORK/emitted.log'"

check two-workers 40 0 '^poolfuzz: [0-9]+ passed' "last_summary two-workers" -- \
  poolfuzz run --device "$DEVICE" --workers 2 --config dense swa --examples 20 --seed 1 \
  --db "$WORK/db2" --out "$WORK/pass2"

# Speed (issue 6): checksums of a 256 MiB bf16 buffer must run at >= 50% of the device's copy
# bandwidth measured in the same run (on a CPU dry run: of a plain sum); the table is printed last.
cat >"$WORK/bench_gate.py" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
ceiling, name = (d["copy_gbps"], "copy") if "copy_gbps" in d else (d["sum_gbps"], "sum")
ratio = d["checksum_gbps"] / ceiling
print(f"checksum {d['checksum_gbps']:.0f} GB/s = {ratio:.2f} x {name} (>= 0.5)")
sys.exit(0 if ratio >= 0.5 else 1)
EOF
bench_detail() { "$PY" "$WORK/bench_gate.py" "$WORK/bench.json"; }
check bench 240 0 'GB/s = ' "bench_detail" -- \
  bash -c "poolfuzz bench --device '$DEVICE' --examples 50 --seeds 3 --json '$WORK/bench.json' &&
    '$PY' '$WORK/bench_gate.py' '$WORK/bench.json'"

echo
echo "gpu-check on $INFO ($(( $(date +%s) - START ))s)"
printf '%-24s %-12s %6s  %s\n' check result time detail
for row in "${ROWS[@]}"; do echo "$row"; done
sed -n '/^  figure/,$p' "$WORK/bench.log" 2>/dev/null
if [ "$FAILED" -eq 0 ]; then echo "gpu-check: all ${#ROWS[@]} checks ok"; else echo "gpu-check: FAILED"; fi
exit "$FAILED"
