#!/usr/bin/env bash
# Fetches Apache Arrow's C++ libraries (libarrow, libparquet; Apache-2.0) and their headers
# into .deps/arrow/{lib,include} (git-ignored) and prints .deps/arrow. kiln reads Parquet
# files and Arrow IPC streams (Hugging Face `save_to_disk` folders) with them
# (src/data/readers/parquet.cpp, arrow_stream.cpp); CMake runs this script when they are
# missing, scripts/setup.sh runs it always.
#
# Debian 12 packages no Arrow, so they come from the PyPI wheel pyarrow, pinned by version
# and hash: it ships libarrow.so and libparquet.so, built with the new C++ ABI
# (_GLIBCXX_USE_CXX11_ABI=1, as Debian's g++) and needing nothing beyond glibc and
# libstdc++, and the C++ headers under pyarrow/include. The wheel is built per Python
# version, but its libraries and headers are the same in each: one wheel (CPython 3.11,
# x86-64) is pinned, whatever the interpreter running pip. Only those two libraries, the
# headers and the license are kept (~62 MB of the wheel's ~200 MB unpacked).
# Idempotent: returns at once when the pinned version is in place.
#
# Usage: scripts/arrow.sh        (PYTHON=... picks the interpreter whose pip downloads)
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=26.0.1
SOVERSION=2600
WHEEL=pyarrow-26.0.1-cp311-cp311-manylinux_2_28_x86_64.whl
SHA256=39cb0f2418282c24bea6ceda77b03e5a8f0a5766b63a8bf194d4e2a2c423548c

dest=.deps/arrow
if [ -f "$dest/include/parquet/arrow/reader.h" ] && [ -f "$dest/lib/libparquet.so.$SOVERSION" ] &&
  [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$VERSION" ]; then
  echo "$PWD/$dest"
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

source scripts/pinned_wheel.sh
python=$(wheel_python arrow "$tmp")
wheel=$(fetch_wheel arrow "$python" "$tmp" "$WHEEL" "$SHA256" --python-version 3.11 --implementation cp --abi cp311 --platform manylinux_2_28_x86_64 \
  "pyarrow==$VERSION")

# Python's zipfile, as unzip may be absent. The libraries get their unversioned names as
# links too, for the linker.
"$python" - "$wheel" "$tmp/out" "$VERSION" "$SOVERSION" <<'EOF'
import os, sys, zipfile
wheel, out, version, soversion = sys.argv[1:]
libraries = {f"pyarrow/lib{name}.so.{soversion}": name for name in ("arrow", "parquet")}
licenses = f"pyarrow-{version}.dist-info/licenses/"
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.endswith("/"):
            continue
        if name.startswith("pyarrow/include/"):
            target = os.path.join(out, "include", name[len("pyarrow/include/"):])
        elif name in libraries:
            target = os.path.join(out, "lib", os.path.basename(name))
        elif name.startswith(licenses):
            target = os.path.join(out, os.path.basename(name))
        else:
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with z.open(name) as src, open(target, "wb") as dst:
            dst.write(src.read())
for name in libraries.values():
    os.symlink(f"lib{name}.so.{soversion}", os.path.join(out, "lib", f"lib{name}.so"))
EOF
[ -f "$tmp/out/include/parquet/arrow/reader.h" ] && [ -f "$tmp/out/lib/libparquet.so.$SOVERSION" ] ||
  { echo "arrow: no parquet/arrow/reader.h or libparquet.so.$SOVERSION in $WHEEL" >&2; exit 1; }
echo "$VERSION" >"$tmp/out/VERSION"

mkdir -p .deps
rm -rf "$dest"
mv "$tmp/out" "$dest"
echo "$PWD/$dest"
