#!/usr/bin/env bash
# Install one SGLang release into a clean virtual environment that keeps the CPU torch wheel.
#
#   ci/sglang-install.sh VENV VERSION [--triton]
#
# SGLang's own dependency list pulls CUDA builds (torch, flashinfer, sgl-kernel, ...). Its pools
# need none of them, so SGLang goes in with --no-deps, beside its small pure-Python needs; the
# versions SGLang pins for the few that matter (transformers, openai, xgrammar, ...) are read
# from the installed release's own metadata, not from a table here. Every pip step runs under a
# constraint pinning torch==2.13.0+cpu, so no step can swap in a multi-GB CUDA torch.
# --triton installs the real triton wheel (some releases' import chain needs it; newer ones
# run with poolfuzz's stand-in). A step that cannot reach a package fails the script.
set -euo pipefail
venv=${1:?usage: ci/sglang-install.sh VENV VERSION [--triton]}
version=${2:?usage: ci/sglang-install.sh VENV VERSION [--triton]}
triton=${3:-}
repo=$(cd "$(dirname "$0")/.." && pwd)
constraint=$(mktemp)
echo 'torch==2.13.0+cpu' > "$constraint"
quiet=(--quiet --disable-pip-version-check)

if [ ! -x "$venv/bin/python" ]; then
  python -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install "${quiet[@]}" -c "$constraint")
"${pip[@]}" torch==2.13.0
"${pip[@]}" numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm \
  ipython aiohttp dill sentencepiece loguru gguf sniffio partial_json_parser httpx distro einops
# What managers/scheduler.py imports at module level (the sglang:scheduler family runs its methods).
"${pip[@]}" setproctitle uvicorn fastapi
if [ "$triton" = "--triton" ]; then
  "${pip[@]}" triton
fi
"${pip[@]}" --no-deps "sglang==$version"
# The pins this release declares for the packages its pool imports reach.
mapfile -t pins < <("$venv/bin/python" - <<'PY'
import re
from importlib.metadata import requires
WITH_DEPS = {"transformers", "openai"}
NO_DEPS = {"apache-tvm-ffi", "compressed-tensors", "xgrammar"}
for req in requires("sglang") or []:
    if ";" in req and "extra ==" in req:
        continue
    m = re.match(r"\s*([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*(==\s*[^;\s,]+)?", req)
    name = m.group(1).lower().replace("_", "-")
    pin = (m.group(2) or "").replace(" ", "")
    if name in WITH_DEPS:
        print(f"deps {name}{pin}")
    elif name in NO_DEPS:
        print(f"nodeps {name}{pin}")
PY
)
for line in "${pins[@]}"; do
  kind=${line%% *}; spec=${line#* }
  if [ "$kind" = nodeps ]; then "${pip[@]}" --no-deps "$spec"; else "${pip[@]}" "$spec"; fi
done
"${pip[@]}" hypothesis pytest pytest-xdist coverage
"${pip[@]}" --no-deps -e "$repo"
rm -f "$constraint"
"$venv/bin/python" -c "import poolfuzz.adapters.sglang as a; print('sglang', a.describe())"
