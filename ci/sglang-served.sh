#!/usr/bin/env bash
# How many named configs each SGLang release's own code builds the pools of (issue 35): per release, the configs whose
# family runs on the pools SGLang built for the listed server ("served"), those whose family runs on pools SGLang built
# otherwise than the listing's (the family's server is sized from SGLang's answer: "differs"), those declined (the
# adapter's wiring, which stood in where SGLang built other pools, was deleted at stop 67), and those whose server
# crashes at startup (a failure `poolfuzz run` reports). Exit 1 where a listing accounts for fewer configs than it lists
# (it stopped short: a traceback), with the listing's end.
#
#   ci/sglang-served.sh [VERSION ...]   (default: every release cached under the venvs directory)
#
# Reads `poolfuzz configs --family F` in each release's cached venv (POOLFUZZ_SGLANG_VENVS, default
# ~/.cache/poolfuzz/sglang-venvs/sglang-VERSION, as .ci/run and ci/sglang-compat.sh leave them) with this checkout's
# poolfuzz. Families: POOLFUZZ_SERVED_FAMILIES (default: sglang:scheduler, the plain server; the others list theirs too).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venvs=${POOLFUZZ_SGLANG_VENVS:-$HOME/.cache/poolfuzz/sglang-venvs}
families=${POOLFUZZ_SERVED_FAMILIES:-sglang:scheduler}
if [ "$#" -gt 0 ]; then
  versions=("$@")
else
  mapfile -t versions < <(ls -d "$venvs"/sglang-* 2>/dev/null | sed 's|.*/sglang-||' | sort -V)
fi
[ "${#versions[@]}" -gt 0 ] || { echo "sglang-served: no SGLang venv under $venvs; install one with ci/sglang-install.sh" >&2; exit 2; }
cd "$repo"
for v in "${versions[@]}"; do
  python="$venvs/sglang-$v/bin/python"
  [ -x "$python" ] || { echo "$v: no venv at $venvs/sglang-$v (ci/sglang-install.sh $venvs/sglang-$v $v --triton)"; continue; }
  for family in $families; do
    out=$(PYTHONPATH="$repo" "$python" -m poolfuzz.cli configs --family "$family" 2>&1)
    served=$(grep -c "^    family runs on them" <<<"$out")
    declined=$(grep -c "^    family: declines" <<<"$out")
    crashed=$(awk '/^[a-z0-9-]+ +[a-z(]/{name=$1} /^    family: crashes/{printf "%s%s", sep, name; sep=", "}' <<<"$out")
    differs=$(awk '/^[a-z0-9-]+ +[a-z(]/{name=$1}
                   /^    family (differs|builds:)/{if (!(name in seen)) {seen[name]=1; printf "%s%s", sep, name; sep=", "}}' \
              <<<"$out")
    echo "$v $family: served $served, declined $declined, differs: ${differs:-none}, crash at startup: ${crashed:-none}"
    # every listed config is counted once: a listing that stopped short (a traceback) is no count at all
    listed=$(grep -E "^[a-z0-9-]+ +[a-z(]" <<<"$out" | grep -vc "(drawn)")
    counted=$(awk '/^[a-z0-9-]+ +[a-z(]/{name=$1}
                   /^    family( runs on them| differs| builds:|: declines|: crashes)/{if (!(name in seen)) n++; seen[name]=1}
                   END{print n + 0}' <<<"$out")
    if [ "$listed" -eq 0 ] || [ "$counted" -ne "$listed" ]; then
      echo "$v $family: the listing accounts for $counted of $listed configs; its end:" >&2
      tail -n 5 <<<"$out" >&2
      status=1
    fi
  done
done
exit "${status:-0}"
