#!/usr/bin/env bash
# Sets up (dependencies + build) and trains the default byte-level model on the bundled
# tinyshakespeare corpus. The README's first command. Extra arguments go to `kiln train`
# (e.g. --set train.steps=100).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec build/src/kiln train configs/default.toml "$@"
