#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root: builds llama.cpp's server (llama-server) with
# its CUDA backend for the card's architecture from the source scripts/llama_server_source.sh
# packed (.gpu/llama.cpp-src.tar.xz, carried), into build-llama/ (git-ignored, so the device
# tool keeps it between calls while the machine stays warm). Prints the binary's path last.
# Returns at once when build-llama/bin/llama-server is there.
#   device run: carry [".gpu"], command "bash scripts/gpu_llama_server.sh"
# The options: CUDA for sm_90 (Hopper; CUDA_ARCH overrides), no tests, examples or web UI
# download, no OpenSSL or curl (the machine reaches nothing), a static build so that one
# binary moves. About 150 CUDA translation units: minutes on 16 cores.
set -euo pipefail
cd "$(dirname "$0")/.."

PACK=${LLAMA_SOURCE:-.gpu/llama.cpp-src.tar.xz}
BUILD=build-llama
BIN=$BUILD/bin/llama-server
if [ -x "$BIN" ]; then echo "$PWD/$BIN"; exit 0; fi
[ -f "$PACK" ] || { echo "gpu_llama_server: no $PACK (run scripts/llama_server_source.sh here, carry .gpu)"; exit 1; }
# An earlier call's unpacked source and build folder are kept (the device tool keeps
# ignored outputs while the machine stays warm): ninja goes on where a cut-off build stopped.
if [ ! -d "$BUILD/src/llama.cpp" ]; then
  mkdir -p "$BUILD/src"
  tar -xJf "$PACK" -C "$BUILD/src"
fi
export PATH=/usr/local/cuda/bin:$PATH
start=$(date +%s)
log() {  # a failure's log: its last lines here, the whole file under $OUT when there is one
  tail -30 "$1"
  [ -n "${OUT:-}" ] && cp "$1" "$OUT/"
  return 0
}
cmake -S "$BUILD/src/llama.cpp" -B "$BUILD/cmake" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DGGML_NATIVE=OFF -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF >"$BUILD/cmake.log" 2>&1 || { log "$BUILD/cmake.log"; exit 1; }
cmake --build "$BUILD/cmake" -j"$(nproc)" --target llama-server >"$BUILD/build.log" 2>&1 ||
  { log "$BUILD/build.log"; exit 1; }
mkdir -p "$BUILD/bin"
cp "$BUILD/cmake/bin/llama-server" "$BIN"
echo "gpu_llama_server: built in $(( $(date +%s) - start )) s on $(nproc) cores"
echo "$PWD/$BIN"
