#!/usr/bin/env bash
# Installs kiln's build dependencies (Debian packages) and builds it into build/.
# Usage: scripts/setup.sh [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake ninja-build pkg-config libfmt-dev nlohmann-json3-dev libcli11-dev
          libtomlplusplus-dev libopenblas-openmp-dev libgtest-dev libcpp-httplib-dev libzstd-dev zlib1g-dev libpcre2-dev libutf8proc-dev libgloo-dev libcairo2-dev fonts-dejavu-core libprotobuf-dev protobuf-compiler python3 python3-venv)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Python oracles for the tests (Hugging Face tokenizers, safetensors, gguf, tensorboard); training never uses them.
kiln_python=$(scripts/python_env.sh)

# Arrow C++ (libarrow, libparquet and headers, from the pinned pyarrow wheel): Parquet files
# and Hugging Face save_to_disk folders as training data.
PYTHON="$kiln_python" scripts/arrow.sh >/dev/null

# minja (header-only Jinja for `kiln serve`'s chat templates), from a pinned PyPI sdist.
PYTHON="$kiln_python" scripts/minja.sh >/dev/null

# The cuDNN frontend headers (the CUDA build's attention) and CUTLASS (the experts' grouped
# GEMM on Hopper): header-only, pinned PyPI wheels.
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  PYTHON="$kiln_python" scripts/cudnn_frontend.sh >/dev/null
  PYTHON="$kiln_python" scripts/cutlass.sh >/dev/null
fi

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DKILN_PYTHON="$kiln_python" "$@" >/dev/null
cmake --build build -j"$(nproc)"
