#!/usr/bin/env bash
# Compiles every CUDA source of kiln for GPUs other than the Hopper target (compile only,
# no link, no run), so code that needs a newer architecture stays behind a guard.
# Usage: scripts/check_cuda_archs.sh ["80;89;120"]     (build folder: build-archs/)
set -euo pipefail
cd "$(dirname "$0")/.."
ARCHS=${1:-"80;89;120"}
BUILD=build-archs
command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ] || { echo "check_cuda_archs: no nvcc"; exit 1; }
[ -f .deps/cudnn-frontend/include/cudnn_frontend.h ] || PYTHON=${PYTHON:-python3} scripts/cudnn_frontend.sh >/dev/null
[ -f .deps/cutlass/include/cutlass/cutlass.h ] || PYTHON=${PYTHON:-python3} scripts/cutlass.sh >/dev/null
cmake -S . -B "$BUILD" -G Ninja -DKILN_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" >/dev/null
mapfile -t objects < <(ninja -C "$BUILD" -t targets all | sed -n 's/^\(.*\.cu\.o\): .*/\1/p')
((${#objects[@]})) || { echo "check_cuda_archs: no CUDA objects in $BUILD"; exit 1; }
ninja -C "$BUILD" -j"$(nproc)" "${objects[@]}"
echo "check_cuda_archs: ${#objects[@]} CUDA sources compile for sm ${ARCHS//;/, }"
