#!/usr/bin/env bash
# The Hugging Face round trip on the GPU machine (transformers and torch live there; kiln's
# Debian libraries do not), in two halves:
#
#   here:  scripts/hf_roundtrip_gpu.sh stage MODEL_DIR...
#          packs build-export's kiln (CPU build: export, import, score and sample run on the
#          CPU), the shared libraries it needs, the model directories (model.safetensors +
#          config.toml) and the gguf wheel into .gpu/hf-roundtrip.tar.gz (git-ignored)
#   there: device run with carry [".gpu"]: bash scripts/hf_roundtrip_gpu.sh check
#          unpacks it, installs the gguf wheel into /tmp, and runs scripts/hf_roundtrip_check.py
#          on every model (the JSON report lands in $OUT), then scripts/hf_import_stock_check.py
#   there: bash scripts/hf_roundtrip_gpu.sh check-staged MODEL_DIR...
#          the same check with the kiln of scripts/gpu_stage.sh's pack (carry .gpu; its kiln
#          runs export, import, score and sample on the CPU too) on model directories
#          carried in .gpu; no gguf wheel, so only the GGUF refusals are checked
#
# Any trained kiln model: dense ones check as Qwen3/Llama/Qwen2, sparse softmax_topk ones as
# Qwen3-MoE, sparse sigmoid_bias ones as Dots1 (dots.llm1), each with the GGUF refusals its
# llama.cpp architecture implies (scripts/hf_roundtrip_check.py).
# BUILD=dir picks another kiln build (default build-export).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/runtime_libs.sh
PACK=.gpu/hf-roundtrip.tar.gz

stage() {
  local build=${BUILD:-build-export} stage_dir
  [ -x "$build/src/kiln" ] || { echo "hf_roundtrip: $build/src/kiln missing (build it first)" >&2; exit 1; }
  (($# > 0)) || { echo "usage: $0 stage MODEL_DIR..." >&2; exit 1; }
  stage_dir=$(mktemp -d /tmp/kiln-hfrt.XXXXXX)
  mkdir -p "$stage_dir/bin" "$stage_dir/lib" "$stage_dir/models" "$stage_dir/wheels"
  strip -o "$stage_dir/bin/kiln" "$build/src/kiln"
  # Everything but glibc and the C++ runtime (newer on the GPU machine's image).
  local system_re='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libresolv|libstdc\+\+|libgcc_s)\.so'
  runtime_libs "$build" "$build/src/kiln" >/dev/null  # stops here if OpenBLAS is missing
  while read -r name arrow path _; do
    [[ -z $name || $name =~ $system_re || $arrow != "=>" || ! -f $path ]] && continue
    cp -L "$path" "$stage_dir/lib/$name"
  done < <(runtime_libs "$build" "$build/src/kiln" | sed 's/^[[:space:]]*//')
  for m in "$@"; do  # a model directory or a run directory with model/; named after the directory given
    local name
    name=$(basename "$(realpath "$m")")
    [ -f "$m/model/config.toml" ] && m="$m/model"
    mkdir -p "$stage_dir/models/$name"
    cp "$m/config.toml" "$m/model.safetensors" "$stage_dir/models/$name/"
  done
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$stage_dir/wheels" gguf==0.19.0 >/dev/null
  mkdir -p .gpu
  tar -czf "$PACK" -C "$stage_dir" bin lib models wheels
  rm -rf "$stage_dir"
  echo "hf_roundtrip: staged $(du -h "$PACK" | cut -f1) in $PACK: $(tar -tzf "$PACK" | grep -c /) files"
}

check() {
  local root
  root=$(mktemp -d /tmp/kiln-hfrt.XXXXXX)
  tar -xzf "$PACK" -C "$root"
  export LD_LIBRARY_PATH="$root/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} PYTHONUNBUFFERED=1
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$root"/wheels/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  "$root/bin/kiln" --version
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
  local out=${OUT:-/tmp/kiln-hfrt-out}
  mkdir -p "$out"
  python3 scripts/hf_roundtrip_check.py --kiln "$root/bin/kiln" --out "$out" "$root"/models/*
  # And the other direction: checkpoints transformers itself saves (Qwen3-MoE, Dots1).
  python3 scripts/hf_import_stock_check.py --kiln "$root/bin/kiln"
}

check_staged() {
  source scripts/gpu_env.sh || exit 1
  "$STAGE/bin/kiln" --version
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
  local out=${OUT:-/tmp/kiln-hfrt-out}
  mkdir -p "$out"
  python3 scripts/hf_roundtrip_check.py --kiln "$STAGE/bin/kiln" --out "$out" "$@"
}

case "${1:-}" in
  stage) shift; stage "$@" ;;
  check) check ;;
  check-staged) shift; check_staged "$@" ;;
  *) echo "usage: $0 stage MODEL_DIR... | check | check-staged MODEL_DIR..." >&2; exit 1 ;;
esac
