#!/usr/bin/env bash
# KDA on the GPU machine (after scripts/gpu_stage.sh; carry .gpu, and .whl for FLA): one call
# for issue 40's open measurements. Parts (PART=all runs them in order; each prints its lines
# and keeps its logs in $OUT):
#   PART=tests   the KDA GPU tests, both short-convolution kernels (GTEST_FILTER to change)
#   PART=conv    seed 001's K3 at 8 x 4096 with model.kda.conv_gpu_kernel per_element, then sweep
#   PART=kda     `kiln bench-kda` (B 8, T 4096, H 16, D 128 and 64) with each chunk-gradient
#                kernel (TF32, bf16), then FLA's chunk_kda (bench/fla_peer_kda.py; FLA=0 skips it)
#   PART=profile each chunked kernel's time under ncu (one forward, then one forward + backward,
#                B 8, T 4096, H 16, D 128, the default kernels; scripts/ncu_kernel_times.py sums them)
#   PART=hybrid  bench-0.6b as the 3:1 KDA:GQA hybrid (chunked kernels) and as all-attention,
#                at 4K and 32K context (docs/performance.md's earlier rows)
# CONV=per_element runs the hybrid rows with the first convolution kernels (default: sweep).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh || exit 1
K="$STAGE/bin/kiln"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PY=/opt/torch/.venv/bin/python; [ -x "$PY" ] || PY=python3
CONV=${CONV:-sweep}

tests() {
  local filter=${GTEST_FILTER:-GpuKda.*:KdaMixerGpu.*:KdaModelGpu.*:KdaTrainingGpu.*:Dtypes/KdaDecoderGpu.*:KdaDecodeOpsGpu.*}
  timeout "${TEST_TIMEOUT:-300}" "$STAGE/bin/kiln_gpu_tests" --gtest_filter="$filter" > "$LOGS/kda_tests.log" 2>&1
  echo "gpu tests exit $?"; grep -E "^\[  FAILED|PASSED|Failure|Which is" "$LOGS/kda_tests.log" | head -40
}

bench_row() {  # name config args...
  local name=$1; shift
  "$K" bench "$@" > "$LOGS/$name.log" 2>&1
  echo "$name: rc $? | $(grep -E 'tokens/s' "$LOGS/$name.log" | tail -1) | $(grep -E '^ *memory:' "$LOGS/$name.log" | tail -1)"
}

conv() {
  for kernel in per_element sweep; do
    bench_row "k3_conv_$kernel" configs/presets/k3-mini-primary.toml --set train.device=cuda \
      --set model.kda.gpu_kernel=chunked --set model.kda.conv_gpu_kernel=$kernel \
      --set train.micro_batch_tokens=32768 --steps 4 --warmup 2
  done
}

kda() {
  for grads in tf32 bf16; do  # the chunked backward's chunk gradients: TF32 wmma, or bf16 mma (chunked_bf16)
    local flag=(); [ "$grads" = bf16 ] && flag=(--bf16-grads)
    "$K" bench-kda --kernels chunked "${flag[@]}" --json "$LOGS/bench_kda_$grads.json" > "$LOGS/bench_kda_$grads.log" 2>&1
    echo "bench-kda ($grads chunk gradients) exit $?"; tail -3 "$LOGS/bench_kda_$grads.log"
  done
  [ "${FLA:-1}" = 1 ] || return 0  # FLA=0: kiln only (no .whl carried)
  timeout "${FLA_TIMEOUT:-200}" "$PY" -u bench/fla_peer_kda.py --batch 8 --seq 4096 --heads 16 --dims 128,64 \
    --json "$LOGS/fla.json" > "$LOGS/fla.log" 2>&1
  echo "fla exit $?"; tail -3 "$LOGS/fla.log"
}

profile() {
  local ncu; ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$ncu" ] || { echo "profile: no ncu on this machine"; return 1; }
  timeout "${PROFILE_TIMEOUT:-150}" "$ncu" --clock-control none --metrics gpu__time_duration.sum --csv \
    "$K" bench-kda --batch 8 --seq 4096 --heads 16 --dims "${DIMS:-128}" --kernels chunked --bf16-grads \
    --warmup 0 --iters 1 > "$LOGS/ncu_kda.csv" 2> "$LOGS/ncu_kda.err"
  echo "ncu exit $?"; python3 scripts/ncu_kernel_times.py "$LOGS/ncu_kda.csv"
}

hybrid() {
  local kda=(--set model.attention=kda --set model.alt_attention=gqa --set model.alt_attention_layers=every:4
             --set model.kda.gpu_kernel=chunked --set model.kda.conv_gpu_kernel=$CONV)
  for len in 4096 32768; do
    bench_row "hybrid_$len" configs/bench-0.6b.toml --steps 3 --warmup 1 --set model.max_seq_len=$len "${kda[@]}"
    bench_row "attention_$len" configs/bench-0.6b.toml --steps 3 --warmup 1 --set model.max_seq_len=$len
  done
}

case "${PART:-all}" in
  tests) tests ;;
  conv) conv ;;
  kda) kda ;;
  profile) profile ;;
  hybrid) hybrid ;;
  all) tests; conv; kda; hybrid ;;
  *) echo "gpu_kda: PART must be tests, conv, kda, profile, hybrid or all, not '${PART}'"; exit 2 ;;
esac
