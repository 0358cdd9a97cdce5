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
    # Built for this CPU but without llama.cpp's AMX kernels: on VMs that report AMX they can die with
    # SIGILL (seen on this project's machines). CMAKE_ARGS, CFLAGS and CXXFLAGS you set win.
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    echo | cc $no_amx -E - >/dev/null 2>&1 || no_amx=""  # a compiler that doesn't know AMX emits none
    CFLAGS="${CFLAGS:-$no_amx}" CXXFLAGS="${CXXFLAGS:-$no_amx}" CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" \
        python -m pip install --quiet -e ".[llamacpp]"
fi
python -m prefixcache fetch
