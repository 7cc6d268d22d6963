#!/usr/bin/env bash
# Sourced (not run) by the scripts that take a dependency from a pinned PyPI wheel or
# source archive (scripts/cutlass.sh, cudnn_frontend.sh, arrow.sh; minja.sh, an sdist):
# downloads the file with pip and checks it against its pinned sha256. Only the download is
# shared; what each keeps of its file is its own.
#
#   wheel_python NAME TMP       an interpreter with pip: $PYTHON, the tests' virtualenv
#                               (scripts/python_env.sh), python3; else a throwaway
#                               virtualenv in TMP (Debian's python3 has no pip without
#                               python3-pip). NAME prefixes the messages.
#   fetch_wheel NAME PYTHON TMP WHEEL SHA256 PIP_ARGS...
#                               pip downloads PIP_ARGS (platform flags, then the requirement
#                               last) into TMP/wheel; prints the path of WHEEL there, or
#                               fails when pip fetched another file or the hash differs.
#   fetch_sdist NAME PYTHON TMP ARCHIVE SHA256 REQUIREMENT
#                               the same for a source archive (pip prepares its metadata,
#                               which for some packages takes a minute; nothing is built).

wheel_python() {
  local name=$1 tmp=$2 candidate
  for candidate in "${PYTHON:-}" build/pyenv/bin/python python3; do
    if [ -n "$candidate" ] && "$candidate" -m pip --version >/dev/null 2>&1; then
      echo "$candidate"
      return 0
    fi
  done
  python3 -m venv "$tmp/venv" >&2 || { echo "$name: no pip (install python3-pip or python3-venv)" >&2; return 1; }
  echo "$tmp/venv/bin/python"
}

fetch_wheel() {
  fetch_pinned_file "$1" "$2" "$3" "$4" "$5" --only-binary=:all: "${@:6}"
}

fetch_sdist() {
  fetch_pinned_file "$1" "$2" "$3" "$4" "$5" --no-binary=:all: "${@:6}"
}

fetch_pinned_file() {
  local name=$1 python=$2 tmp=$3 file_name=$4 sha256=$5
  shift 5
  echo "$name: downloading ${!#}" >&2  # the requirement, last
  "$python" -m pip download --quiet --disable-pip-version-check --no-deps "$@" -d "$tmp/wheel" >&2 || return 1
  local file=$tmp/wheel/$file_name
  [ -f "$file" ] || { echo "$name: pip did not fetch $file_name" >&2; return 1; }
  echo "$sha256  $file" | sha256sum -c --quiet - >&2 ||
    { echo "$name: $file_name does not have the pinned sha256" >&2; return 1; }
  echo "$file"
}
