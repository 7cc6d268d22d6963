#!/usr/bin/env bash
# Packs llama.cpp's source for building its server ON the GPU machine, the serving peer of
# issue 43 (scripts/gpu_llama_server.sh builds it there, scripts/gpu_serve_bench.sh PEER=1
# runs it). PyPI has no binary of llama.cpp's server for Linux with CUDA, the GPU machine
# fetches nothing, and this machine's two cores would take about an hour over its CUDA
# kernels; the GPU machine has nvcc, CMake and 16 cores. The source is llama.cpp as
# llama-cpp-python 0.3.36 vendors it (the version scripts/llama_cpp_check.py runs here),
# pinned by hash; what the server does not build (model vocabularies, docs, the web UI's
# and tests, benches) is left out to stay under the device tool's 64 MiB carry limit.
# Writes .gpu/llama.cpp-src.tar.xz (git-ignored). Nothing of it enters the repository.
#
# Usage: scripts/llama_server_source.sh        (PYTHON=... picks the interpreter whose pip downloads)
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.36
ARCHIVE=llama_cpp_python-0.3.36.tar.gz
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
PACK=.gpu/llama.cpp-src.tar.xz

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
source scripts/pinned_wheel.sh
python=$(wheel_python llama_server_source "$tmp")
archive=$(fetch_sdist llama_server_source "$python" "$tmp" "$ARCHIVE" "$SHA256" "llama-cpp-python==$VERSION")

tar -xzf "$archive" -C "$tmp"
src=$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp
# tools/CMakeLists.txt adds tools/ui whenever the server is built; its build step fills
# ui.cpp from templates there (configured with LLAMA_USE_PREBUILT_UI=OFF: no download, no
# npm), so only the web UI's sources and tests go.
rm -rf "$src/models" "$src/docs" "$src/tools/ui/src" "$src/tools/ui/tests" "$src/benches" "$src/media" \
  "$src/gguf-py" "$src/conversion"
mkdir -p "$src/models" "$src/docs"
mkdir -p .gpu
XZ_OPT="-6 -T0" tar -cJf "$PACK" -C "$src/.." llama.cpp
echo "llama_server_source: $PACK ($(du -h "$PACK" | cut -f1))"
