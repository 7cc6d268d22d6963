#!/usr/bin/env bash
# Sourced by the scripts that stage kiln for another machine (scripts/gpu_stage.sh,
# scripts/hf_roundtrip_gpu.sh). runtime_libs BUILD BINARY... prints, as ldd does
# ("name => path (address)"), the shared libraries the binaries need at run time: those ldd
# lists, plus OpenBLAS and its own libraries, which ldd cannot see because kiln loads
# OpenBLAS itself (src/ops/blas.cpp: dlopen, after choosing its kernels) from the folder
# CMake found it in (KILN_OPENBLAS in BUILD's cache). Returns non-zero if it is missing.
runtime_libs() {
  local build=$1 openblas
  shift
  openblas=$(dirname "$(sed -n 's/^KILN_OPENBLAS:FILEPATH=//p' "$build/CMakeCache.txt")")/libopenblas.so.0
  [ -f "$openblas" ] || { echo "runtime_libs: OpenBLAS not found at $openblas" >&2; return 1; }
  for b in "$@" "$openblas"; do ldd "$b"; done
  echo "libopenblas.so.0 => $openblas (loaded by kiln at run time)"
}
