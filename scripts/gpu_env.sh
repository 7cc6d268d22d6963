#!/usr/bin/env bash
# Sourced (not run) by the scripts that run ON the GPU machine, from the repo root
# (scripts/gpu_check.sh, scripts/gpu_*.sh, scripts/decode_bench.sh). Sets STAGE to the staged binaries and
# libraries made by scripts/gpu_stage.sh: $KILN_STAGE (a tarball or a folder), else
# .gpu/kiln-gpu.tar.xz (or .tar.gz) unpacked into a temporary folder, else .gpu/{bin,lib}; puts the
# libraries on LD_LIBRARY_PATH (bundled ones first, then the PyTorch venv's newer
# cuDNN/NCCL/cuBLAS, then the toolkit's; the driver's libcuda is found by the loader's
# own configuration); keeps NVLink multicast off (see the device tool's KINDS.md).
# Returns non-zero, with a message, when the stage cannot be unpacked.

STAGE=${KILN_STAGE:-.gpu}
if [ -z "${KILN_STAGE:-}" ]; then
  for gpu_env_pack in .gpu/kiln-gpu.tar.xz .gpu/kiln-gpu.tar.gz; do
    [ -f "$gpu_env_pack" ] && { STAGE=$gpu_env_pack; break; }
  done
fi
if [ -f "$STAGE" ]; then
  gpu_env_tarball=$STAGE
  STAGE=$(mktemp -d /tmp/kiln-gpu.XXXXXX)
  # tar picks the compression; where the image lacks xz, Python's tarfile (lzma is in its
  # standard library) unpacks it.
  if [[ $gpu_env_tarball == *.xz ]] && ! command -v xz >/dev/null; then
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$gpu_env_tarball" "$STAGE"
  else
    tar -xf "$gpu_env_tarball" -C "$STAGE"
  fi || { echo "gpu_env: cannot unpack $gpu_env_tarball"; return 1; }
fi
[ -d "$STAGE" ] || { echo "gpu_env: no staged binaries at $STAGE (run scripts/gpu_stage.sh, carry .gpu)"; return 1; }

export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}

gpu_env_libs="$(cd "$STAGE" && pwd)/lib"
for d in /opt/torch/.venv/lib/python3*/site-packages/nvidia/*/lib; do
  [ -d "$d" ] && gpu_env_libs+=":$d"
done
[ -d /usr/local/cuda/lib64 ] && gpu_env_libs+=":/usr/local/cuda/lib64"
export LD_LIBRARY_PATH="$gpu_env_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# What the measuring scripts (gpu_fp8.sh, gpu_kda.sh, ...) share: their logs go to LOGS ($OUT,
# the folder the device tool brings back), and tests that start kiln find it and the sources.
LOGS=${LOGS:-${OUT:-/tmp/out}}  # a script may have chosen its own first
mkdir -p "$LOGS"
export KILN_SOURCE_DIR="$PWD" KILN_BINARY="$STAGE/bin/kiln"
