#!/usr/bin/env bash
# Builds the CUDA backend HERE (Release, sm_90a, in build-cuda/) and stages what the GPU
# machine needs, so a device run only carries files, never builds:
#   bin/kiln, bin/kiln_gpu_tests   stripped binaries
#   lib/*.so*                      shared libraries the GPU machine's image may lack (it has
#                                  no Debian -dev packages: OpenBLAS, gomp, fmt, toml++ ...;
#                                  and Arrow's libarrow/libparquet from .deps/arrow, ~49 MB
#                                  stripped, ~18 MB of the pack),
#                                  named by soname
# staged in build-cuda/gpu-stage/ and packed as .gpu/kiln-gpu.tar.xz (git-ignored; xz, not
# gzip: with Arrow's libraries the gzip pack (~57 MiB) and the working tree passed the
# device tool's 64 MiB carry limit). scripts/gpu_env.sh unpacks it there. Then, on the device tool: run(carry=[".gpu"], command="bash scripts/gpu_check.sh").
#
# Usage: scripts/gpu_stage.sh [extra cmake args...]     (JOBS=N to limit build parallelism;
#        BUILD=build to stage setup.sh's build, also Release and sm_90a, instead of a second one)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/runtime_libs.sh

BUILD=${BUILD:-build-cuda}
STAGE=$BUILD/gpu-stage
PACK=.gpu/kiln-gpu.tar.xz
LIMIT_MIB=64  # the device tool carries at most 64 MiB, working tree included

cmake -S . -B "$BUILD" -G Ninja -DKILN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a -DCMAKE_BUILD_TYPE=Release "$@" \
  >/dev/null
grep -q '^KILN_CUDA:STRING=ON' "$BUILD/CMakeCache.txt" || { echo "gpu_stage: $BUILD is not a CUDA build" >&2; exit 1; }
cmake --build "$BUILD" -j"${JOBS:-$(nproc)}" --target kiln kiln_gpu_tests

rm -rf "$STAGE/bin" "$STAGE/lib"
mkdir -p "$STAGE/bin" "$STAGE/lib"
binaries=("$BUILD/src/kiln" "$BUILD/tests/kiln_gpu_tests")
for b in "${binaries[@]}"; do strip -o "$STAGE/bin/$(basename "$b")" "$b"; done

# Dependencies by class. Provided by the GPU machine: glibc, libstdc++/libgcc_s (the image
# is newer than this one), and the CUDA libraries (toolkit in /usr/local/cuda, newer ones in
# the PyTorch venv; the driver's libcuda). Everything else is bundled.
system_re='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libresolv|libstdc\+\+|libgcc_s)\.so'
cuda_re='^lib(cuda|cudart|cublas|cublasLt|cudnn.*|nccl|nvrtc.*|nvJitLink|cufft|curand|cusparse|cusolver)\.so'
runtime_libs "$BUILD" "${binaries[@]}" >/dev/null  # stops here if OpenBLAS is missing
declare -A bundled=()
missing=0
while read -r name arrow path _; do
  [ -n "$name" ] || continue
  if [ "$arrow" = "=>" ] && [ "$path" = "not" ]; then
    echo "gpu_stage: $name not found here" >&2
    missing=1
    continue
  fi
  [[ $name =~ $system_re ]] && continue
  [[ $name =~ $cuda_re ]] && continue
  [ "$arrow" = "=>" ] && [ -f "$path" ] || continue
  [ -n "${bundled[$name]:-}" ] && continue
  cp -L "$path" "$STAGE/lib/$name"
  strip --strip-unneeded "$STAGE/lib/$name" 2>/dev/null || true
  bundled[$name]=$path
done < <(runtime_libs "$BUILD" "${binaries[@]}" | sed 's/^[[:space:]]*//')
((missing == 0)) || exit 1

echo "gpu_stage: dynamic dependencies of ${binaries[*]}:"
runtime_libs "$BUILD" "${binaries[@]}" | awk '{print $1}' | sort -u | sed 's/^/  /' | tr '\n' ' '
echo
echo "gpu_stage: bundled into $STAGE/lib (not in a bare CUDA image):"
for name in $(printf '%s\n' "${!bundled[@]}" | sort); do
  printf '  %-28s %8s  <- %s\n' "$name" "$(du -h "$STAGE/lib/$name" | cut -f1)" "${bundled[$name]}"
done
echo "gpu_stage: binaries:"
for f in "$STAGE"/bin/*; do printf '  %-28s %8s\n' "$(basename "$f")" "$(du -h "$f" | cut -f1)"; done

# The newest glibc / libstdc++ symbol versions required (the GPU machine must have them).
glibc=$(objdump -T "$STAGE"/bin/* "$STAGE"/lib/* 2>/dev/null | grep -o 'GLIBC_[0-9.]*' | sort -Vu | tail -1)
glibcxx=$(objdump -T "$STAGE"/bin/* "$STAGE"/lib/* 2>/dev/null | grep -o 'GLIBCXX_[0-9.]*' | sort -Vu | tail -1)
echo "gpu_stage: needs $glibc, $glibcxx on the GPU machine"

rm -rf .gpu/bin .gpu/lib .gpu/kiln-gpu.tar.gz "$PACK"
mkdir -p .gpu
XZ_OPT="-6 -T0" tar -cJf "$PACK" -C "$STAGE" bin lib
stage_kib=$(du -sk "$STAGE" | cut -f1)
carry_kib=$(du -sk .gpu | cut -f1)
tree_kib=$( (git ls-files -z; git ls-files -z -o --exclude-standard) | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
total_mib=$(((carry_kib + tree_kib + 1023) / 1024))
echo "gpu_stage: staged $((stage_kib / 1024)) MiB, packed into $PACK: .gpu/ is $((carry_kib / 1024)) MiB;" \
  "with the working tree ~${total_mib} MiB of ${LIMIT_MIB} MiB allowed"
if ((total_mib >= LIMIT_MIB)); then
  echo "gpu_stage: too large to carry" >&2
  exit 1
fi
echo "gpu_stage: ready: device run with carry [\".gpu\"] and command 'bash scripts/gpu_check.sh'"
