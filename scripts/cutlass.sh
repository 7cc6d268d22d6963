#!/usr/bin/env bash
# Fetches CUTLASS (NVIDIA's header-only CUDA C++ templates for GEMMs, BSD-3-Clause) into
# .deps/cutlass/include (git-ignored) and prints that directory. The CUDA build needs it
# for the experts' grouped GEMM on Hopper (src/ops/moe/grouped_gemm_sm90.cu); CMake runs
# this script when the headers are missing, scripts/setup.sh runs it where a CUDA toolkit is.
#
# The headers come from the PyPI wheel nvidia-cutlass (pure Python, one wheel for every
# platform), pinned by version and hash; only its include/ is kept (with the license).
# Idempotent: returns at once when the pinned version is in place.
#
# Usage: scripts/cutlass.sh        (PYTHON=... picks the interpreter whose pip downloads)
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=4.2.0.0
WHEEL=nvidia_cutlass-4.2.0.0-py3-none-any.whl
SHA256=f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6

dest=.deps/cutlass
if [ -f "$dest/include/cutlass/cutlass.h" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$VERSION" ]; then
  echo "$PWD/$dest/include"
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

source scripts/pinned_wheel.sh
python=$(wheel_python cutlass "$tmp")
wheel=$(fetch_wheel cutlass "$python" "$tmp" "$WHEEL" "$SHA256" "nvidia-cutlass==$VERSION")

# The headers live under cutlass_library/source/include/ in the wheel (which also holds the
# Python packages, the examples and the tools). Python's zipfile, as unzip may be absent.
"$python" - "$wheel" "$tmp/out" <<'EOF'
import os, sys, zipfile
prefix = "cutlass_library/source/include/"
license = "nvidia_cutlass-4.2.0.0.dist-info/licenses/LICENSE.txt"
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in z.namelist():
        if name.startswith(prefix) and not name.endswith("/"):
            target = os.path.join(sys.argv[2], "include", name[len(prefix):])
        elif name == license:
            target = os.path.join(sys.argv[2], "LICENSE.txt")
        else:
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with z.open(name) as src, open(target, "wb") as dst:
            dst.write(src.read())
EOF
[ -f "$tmp/out/include/cutlass/cutlass.h" ] || { echo "cutlass: no include/cutlass/cutlass.h in $WHEEL" >&2; exit 1; }
echo "$VERSION" >"$tmp/out/VERSION"

mkdir -p .deps
rm -rf "$dest"
mv "$tmp/out" "$dest"
echo "$PWD/$dest/include"
