#!/usr/bin/env bash
# Creates .venv with everything prefixcache needs and fetches the default model (once).
# torch==2.13.0 is pinned first: on this kind of machine pip takes its CPU build from local disk;
# elsewhere it comes from PyPI.
# PREFIXCACHE_LLAMACPP=1 also installs the `llamacpp` extra (llama-cpp-python, the speed benchmark's
# llama.cpp baseline): it compiles llama.cpp, which needs cmake and a C++ compiler and takes minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test]"
if [ "${PREFIXCACHE_LLAMACPP:-0}" = "1" ]; then
    CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" python -m pip install --quiet -e ".[llamacpp]"
fi
python -m prefixcache fetch
