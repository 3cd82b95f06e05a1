#!/usr/bin/env bash
# Build the llama.cpp CPU baseline used by the benchmarks.
#
# This is NOT a project dependency: everything lands in the git-ignored
# folder bench_out/llama_cpp/ and nothing in kvshare imports it.
#
#   bench_out/llama_cpp/venv/               separate venv with llama-cpp-python
#   bench_out/llama_cpp/src/                downloaded sdist + unpacked source
#   bench_out/llama_cpp/build-server/       cmake build dir for llama-server
#   bench_out/llama_cpp/bin/llama-server    the llama-server binary
#   bench_out/llama_cpp/bin/llama-bench     llama.cpp's own speed benchmark
#   bench_out/llama_cpp/bin/llama-quantize  makes the real-shape GGUFs (benchmarks/real_shape_gguf.py)
#
# Idempotent: each step is skipped when its output already exists.
# Plain CPU build with native optimizations (no BLAS, no CUDA).
#
# Usage: benchmarks/build_llama_cpp.sh   (env JOBS=N to change parallelism)
set -euo pipefail

LLAMA_CPP_PY_VERSION="0.3.36"
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-python3}"

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${REPO_ROOT}/bench_out/llama_cpp"
VENV="${OUT}/venv"
SRC="${OUT}/src"
BUILD="${OUT}/build-server"
BIN="${OUT}/bin"

# Shared CPU-only cmake flags.
CPU_CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_BLAS=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF -DGGML_OPENMP=ON -DLLAMA_CURL=OFF"

mkdir -p "${OUT}" "${SRC}" "${BIN}"

log() { printf '[build_llama_cpp] %s\n' "$*"; }

# --- step 0: venv with build tools -------------------------------------------
if [[ ! -x "${VENV}/bin/python" ]]; then
    log "creating venv ${VENV}"
    "${PYTHON}" -m venv "${VENV}"
fi
VPY="${VENV}/bin/python"
if ! "${VPY}" -c "import cmake, ninja" >/dev/null 2>&1; then
    log "installing build tools (pip, cmake, ninja) into venv"
    "${VPY}" -m pip install --quiet --upgrade pip
    "${VPY}" -m pip install --quiet cmake ninja
fi
export PATH="${VENV}/bin:${PATH}"
CMAKE="${VENV}/bin/cmake"
NINJA="${VENV}/bin/ninja"

# --- step a: llama-cpp-python in the venv -------------------------------------
installed_ver="$("${VPY}" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null || true)"
if [[ "${installed_ver}" == "${LLAMA_CPP_PY_VERSION}" ]]; then
    log "step a: llama-cpp-python ${installed_ver} already installed, skipping"
else
    log "step a: building llama-cpp-python==${LLAMA_CPP_PY_VERSION} from sdist (CPU, native)"
    t0=$(date +%s)
    CMAKE_ARGS="${CPU_CMAKE_ARGS}" \
    CMAKE_BUILD_PARALLEL_LEVEL="${JOBS}" \
    FORCE_CMAKE=1 \
        "${VPY}" -m pip install --no-cache-dir --no-binary llama-cpp-python \
            "llama-cpp-python==${LLAMA_CPP_PY_VERSION}"
    log "step a: done in $(( $(date +%s) - t0 ))s"
fi

# --- step b: llama-server from the vendored llama.cpp -------------------------
TOOLS="llama-server llama-bench llama-quantize"
if [[ -x "${BIN}/llama-server" && -x "${BIN}/llama-bench" && -x "${BIN}/llama-quantize" ]]; then
    log "step b: ${TOOLS} already exist in ${BIN}, skipping"
else
    t0=$(date +%s)
    SDIST="$(ls "${SRC}"/llama_cpp_python-"${LLAMA_CPP_PY_VERSION}".tar.gz 2>/dev/null || true)"
    if [[ -z "${SDIST}" ]]; then
        log "step b: downloading sdist"
        # --no-binary only for llama-cpp-python: with ':all:' pip would also
        # insist on building the sdist's *build* deps (cmake!) from source just
        # to prepare metadata. The downloaded file is the same sdist.
        "${VPY}" -m pip download --no-deps --no-binary llama-cpp-python \
            "llama-cpp-python==${LLAMA_CPP_PY_VERSION}" -d "${SRC}"
        SDIST="$(ls "${SRC}"/llama_cpp_python-"${LLAMA_CPP_PY_VERSION}".tar.gz)"
    fi
    UNPACKED="${SRC}/llama_cpp_python-${LLAMA_CPP_PY_VERSION}"
    if [[ ! -f "${UNPACKED}/vendor/llama.cpp/CMakeLists.txt" ]]; then
        log "step b: unpacking ${SDIST}"
        tar -xzf "${SDIST}" -C "${SRC}"
    fi
    LLAMA_SRC="${UNPACKED}/vendor/llama.cpp"
    log "step b: configuring llama-server build in ${BUILD}"
    # shellcheck disable=SC2086
    "${CMAKE}" -S "${LLAMA_SRC}" -B "${BUILD}" -G Ninja \
        -DCMAKE_MAKE_PROGRAM="${NINJA}" \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF \
        ${CPU_CMAKE_ARGS}
    log "step b: building targets ${TOOLS} (-j${JOBS})"
    # shellcheck disable=SC2086
    "${CMAKE}" --build "${BUILD}" --config Release --target ${TOOLS} -j "${JOBS}"
    for tool in ${TOOLS}; do cp -f "${BUILD}/bin/${tool}" "${BIN}/${tool}"; done
    log "step b: done in $(( $(date +%s) - t0 ))s"
fi

# --- summary ----------------------------------------------------------------
log "done."
log "  venv python     : ${VPY}  (import llama_cpp)"
log "  llama-server    : ${BIN}/llama-server"
log "  llama-bench     : ${BIN}/llama-bench"
log "  llama-quantize  : ${BIN}/llama-quantize"
log "  llama.cpp source: ${SRC}/llama_cpp_python-${LLAMA_CPP_PY_VERSION}/vendor/llama.cpp"
"${BIN}/llama-server" --version 2>&1 | sed 's/^/[build_llama_cpp]   /' || true
