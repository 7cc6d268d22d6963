#!/usr/bin/env bash
# Fetches the cuDNN frontend (NVIDIA's header-only C++ graph API over cuDNN, MIT licensed)
# into .deps/cudnn-frontend/include (git-ignored) and prints that directory. The CUDA build
# needs it for the cuDNN attention (src/ops/attention/attention_cudnn.cu); CMake runs this
# script when the headers are missing, scripts/setup.sh runs it where a CUDA toolkit is.
#
# The headers come from the PyPI wheel nvidia-cudnn-frontend, pinned by version and hash.
# The wheel is built per Python version, but its include/ is the same in each: one wheel
# (CPython 3.11, x86-64) is pinned, whatever the interpreter or machine running pip.
# Idempotent: returns at once when the pinned version is in place.
#
# Usage: scripts/cudnn_frontend.sh        (PYTHON=... picks the interpreter whose pip downloads)
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=1.32.0
WHEEL=nvidia_cudnn_frontend-1.32.0-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl
SHA256=c6006556017a4d1c914c52a556c71b1267f2d6a0500f742e7b4edef539878df0

dest=.deps/cudnn-frontend
if [ -f "$dest/include/cudnn_frontend.h" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$VERSION" ]; then
  echo "$PWD/$dest/include"
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

source scripts/pinned_wheel.sh
python=$(wheel_python cudnn_frontend "$tmp")
wheel=$(fetch_wheel cudnn_frontend "$python" "$tmp" "$WHEEL" "$SHA256" --python-version 3.11 --implementation cp --abi cp311 --platform manylinux_2_28_x86_64 \
  "nvidia-cudnn-frontend==$VERSION")

# Only include/ (the wheel also holds the Python bindings); Python's zipfile, as unzip may be absent.
"$python" - "$wheel" "$tmp/out" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [m for m in z.namelist() if m.startswith("include/")])
EOF
[ -f "$tmp/out/include/cudnn_frontend.h" ] || { echo "cudnn_frontend: no include/cudnn_frontend.h in $WHEEL" >&2; exit 1; }
echo "$VERSION" >"$tmp/out/VERSION"

mkdir -p .deps
rm -rf "$dest"
mv "$tmp/out" "$dest"
echo "$PWD/$dest/include"
