#!/usr/bin/env bash
# Creates build/pyenv, a virtualenv with the Python packages kiln's tests use as
# independent oracles (Hugging Face tokenizers, safetensors, gguf, tensorboard). kiln
# itself never needs Python. Prints the interpreter path. Idempotent: reinstalls only when
# scripts/python-requirements.txt changed.
set -euo pipefail
cd "$(dirname "$0")/.."
env_dir=build/pyenv
requirements=scripts/python-requirements.txt
python=${PYTHON:-python3}
if ! "$python" -c "import venv, ensurepip" >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3-venv >/dev/null
fi
if [ ! -x "$env_dir/bin/python" ]; then
  "$python" -m venv "$env_dir" >&2
fi
stamp="$env_dir/.requirements"
if ! cmp -s "$requirements" "$stamp" 2>/dev/null; then
  "$env_dir/bin/python" -m pip install -q --disable-pip-version-check -r "$requirements" >&2
  cp "$requirements" "$stamp"
fi
echo "$PWD/$env_dir/bin/python"
