#!/usr/bin/env bash
# Fetches torchao 0.18.0 (PyTorch's float8 training, for bench/torch_peer.py --float8) for the
# GPU machine, which has torch 2.11 in /opt/torch/.venv (Python 3.12) but no network: run
# HERE, on the development machine, then carry .whl (git-ignored) with the GPU call and put
# .whl/torchao on PYTHONPATH there (scripts/gpu_fp8.sh PART=peer does). The wheel is pinned by
# version and hash (scripts/pinned_wheel.sh) and unpacked into .whl/torchao (21 MB), so
# `PYTHONPATH=.whl/torchao python -c "import torchao.float8"` works without pip; its
# dist-info stays beside it, so torchao.__version__ reads 0.18.0. torchao has no required
# dependencies but torch. The wheel is cp310-abi3 (one for CPython >= 3.10); its C++
# extensions are built for torch >= 2.11 (older torch: torchao skips them, the float8
# training path is Python over torch._scaled_mm and does not need them).
# Idempotent: returns at once when the pinned version is in place.
#
# Usage: scripts/torchao_wheel.sh        (PYTHON=... picks the interpreter whose pip downloads)
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.18.0
WHEEL=torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl
SHA256=6540b148e40ba81cbd4de86392225a076a1591146e9cebb099b3b234ba9feebe

dest=.whl/torchao
if [ -f "$dest/torchao/float8/__init__.py" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$VERSION" ]; then
  echo "$PWD/$dest"
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

source scripts/pinned_wheel.sh
python=$(wheel_python torchao "$tmp")
wheel=$(fetch_wheel torchao "$python" "$tmp" "$WHEEL" "$SHA256" --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 "torchao==$VERSION")

# The package and its dist-info (Python's zipfile, as unzip may be absent); not the wheel's
# top-level test/, which on PYTHONPATH would shadow the standard library's test package.
"$python" - "$wheel" "$tmp/out" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [m for m in z.namelist() if not m.startswith("test/")])
EOF
[ -f "$tmp/out/torchao/float8/__init__.py" ] || { echo "torchao: no torchao/float8 in $WHEEL" >&2; exit 1; }
echo "$VERSION" >"$tmp/out/VERSION"

mkdir -p .whl
rm -rf "$dest"
mv "$tmp/out" "$dest"
# An import check where this machine's Python has torch (the development machine usually
# has none: then only the files are checked, above).
if "$python" -c "import torch" 2>/dev/null; then
  PYTHONPATH="$PWD/$dest" "$python" -c "import torchao, torchao.float8; print('torchao', torchao.__version__, 'imports')" >&2
else
  echo "torchao: no torch for $python here; files unpacked, import not checked" >&2
fi
echo "$PWD/$dest"
