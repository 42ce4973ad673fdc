#!/usr/bin/env bash
# Install one vLLM release into a clean virtual environment that keeps the CPU torch wheel.
#
#   ci/vllm-install.sh VENV VERSION
#
# vLLM's own dependency list pulls CUDA builds (torch, xformers, flashinfer, ...). Its v1 KV cache
# manager needs none of them, so vLLM goes in with --no-deps, beside the small pure-Python needs
# its core modules import. Every pip step runs under a constraint pinning torch==2.13.0+cpu, so no
# step can swap in a multi-GB CUDA torch. triton arrives through some of those needs and is never
# used on the CPU, so it is removed at the end. A step that cannot reach a package fails the script.
set -euo pipefail
venv=${1:?usage: ci/vllm-install.sh VENV VERSION}
version=${2:?usage: ci/vllm-install.sh VENV VERSION}
repo=$(cd "$(dirname "$0")/.." && pwd)
constraint=$(mktemp)
echo 'torch==2.13.0+cpu' > "$constraint"
quiet=(--quiet --disable-pip-version-check)

if [ ! -x "$venv/bin/python" ]; then
  python -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install "${quiet[@]}" -c "$constraint")
"${pip[@]}" torch==2.13.0
# --no-compile: byte-compiling vLLM's thousands of modules takes minutes on a busy CPU; the few the
# KV cache manager imports are compiled on first import.
"${pip[@]}" --no-deps --no-compile "vllm==$version"
"${pip[@]}" packaging numpy regex pydantic cbor2 psutil pyzmq requests aiohttp transformers openai \
  openai-harmony pillow pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo prometheus_client \
  fastapi partial_json_parser xgrammar llguidance einops
# Older releases' import chains also reach these.
"${pip[@]}" gguf diskcache mistral_common
"${pip[@]}" hypothesis pytest pytest-xdist coverage
"${pip[@]}" --no-deps -e "$repo"
"$venv/bin/python" -m pip uninstall "${quiet[@]}" -y triton >/dev/null 2>&1 || true
rm -f "$constraint"
"$venv/bin/python" -c "import vllm.v1.core.kv_cache_manager; from importlib.metadata import version; print('vllm', version('vllm'))"
