#!/usr/bin/env bash
# Fetches minja (Google's header-only Jinja2 subset for chat templates, MIT) into
# .deps/minja/include/minja (git-ignored) and prints .deps/minja/include. `kiln serve`
# renders a Hugging Face model's tokenizer_config.json chat_template with it
# (src/serve/chat_template.cpp); CMake runs this script when the headers are missing,
# scripts/setup.sh runs it always.
#
# PyPI has no C++ Jinja and Debian 12 packages none, so the headers come from the source
# archive of llama-cpp-python, which vendors llama.cpp and with it minja, pinned by version
# and hash; only minja.hpp and chat-template.hpp are kept (with llama.cpp's MIT license,
# the headers carrying their own SPDX line). Later releases replaced minja with llama.cpp's
# own engine. minja includes <nlohmann/json.hpp>, which kiln takes from Debian.
# Idempotent: returns at once when the pinned version is in place.
#
# Usage: scripts/minja.sh        (PYTHON=... picks the interpreter whose pip downloads)
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=0.3.16
ARCHIVE=llama_cpp_python-0.3.16.tar.gz
SHA256=34ed0f9bd9431af045bb63d9324ae620ad0536653740e9bb163a2e1fcb973be6

dest=.deps/minja
if [ -f "$dest/include/minja/chat-template.hpp" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$VERSION" ]; then
  echo "$PWD/$dest/include"
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

source scripts/pinned_wheel.sh
python=$(wheel_python minja "$tmp")
archive=$(fetch_sdist minja "$python" "$tmp" "$ARCHIVE" "$SHA256" "llama-cpp-python==$VERSION")

root=llama_cpp_python-$VERSION/vendor/llama.cpp
tar -xzf "$archive" -C "$tmp" "$root/vendor/minja/minja.hpp" "$root/vendor/minja/chat-template.hpp" "$root/LICENSE"
mkdir -p "$tmp/out/include/minja"
cp "$tmp/$root/vendor/minja/minja.hpp" "$tmp/$root/vendor/minja/chat-template.hpp" "$tmp/out/include/minja/"
cp "$tmp/$root/LICENSE" "$tmp/out/LICENSE"
echo "$VERSION" >"$tmp/out/VERSION"

mkdir -p .deps
rm -rf "$dest"
mv "$tmp/out" "$dest"
echo "$PWD/$dest/include"
