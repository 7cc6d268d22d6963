#!/usr/bin/env bash
# Sets up (dependencies + build) and runs every CPU test. The README's second command.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
ctest --test-dir build --output-on-failure -j"$(nproc)" --timeout 900
