#!/usr/bin/env bash
# bf16 master weights (optim.master_weights = fp32 | bf16), run ON the GPU machine (after
# scripts/gpu_stage.sh; carry .gpu). Parts (PART=all runs them in order):
#   PART=tests  GpuBf16Masters.* (the kernel against the CPU reference, bit for bit)
#   PART=train  `kiln loss-gap` on configs/default.toml (tinyshakespeare) for STEPS steps
#               (default 600, the config's): fp32 masters at two seeds, bf16 masters at
#               the first; the gap against the seeds' noise, each run's memory line
#   PART=bench  bench-1.5b per setting: ms per step and device memory in use
# docs/optimizers.md has what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PY=/opt/torch/.venv/bin/python; [ -x "$PY" ] || PY=python3
SETTINGS=${SETTINGS:-fp32 bf16}

tests() {
  timeout ${TEST_TIMEOUT:-300} "$STAGE/bin/kiln_gpu_tests" --gtest_filter="${GTEST_FILTER:-GpuBf16Masters.*}" \
    > "$LOGS/bf16m_tests.log" 2>&1
  echo "gpu tests exit $?"; grep -E "^\[  FAILED|PASSED|tests ran|bytes differ|Failure|Expected|Which is" "$LOGS/bf16m_tests.log" | head -40
}

train() {  # kiln loss-gap: fp32 masters at two seeds against bf16 masters (docs/loss-gap.md)
  rm -rf /tmp/bf16m
  timeout ${TRAIN_TIMEOUT:-400} "$STAGE/bin/kiln" loss-gap configs/default.toml --out /tmp/bf16m \
    --candidate optim.master_weights=bf16 --set train.device=cuda --set train.steps=${STEPS:-600} \
    --set train.sample_every=0 --set train.sample_tokens=0 --set checkpoint.every=0 --set checkpoint.save_final=false \
    > "$LOGS/loss_gap.log" 2>&1
  echo "loss-gap exit $?"; cat "$LOGS/loss_gap.log"
  for run in /tmp/bf16m/*/; do echo "$(basename $run): $(grep -E '^memory:' /tmp/bf16m/$(basename $run).log | head -1)"; done
}

bench() {
  for s in $SETTINGS; do
    timeout 200 "$STAGE/bin/kiln" bench configs/bench-1.5b.toml --steps 10 --warmup 3 --set optim.master_weights=$s \
      > "$LOGS/bench-$s.log" 2>&1
    echo "== bench-1.5b master_weights=$s exit $?"; grep -E "ms per step|memory" "$LOGS/bench-$s.log" | head -4
  done
}

case "${PART:-all}" in
tests) tests ;;
train) train ;;
bench) bench ;;
all) tests; train; bench ;;
*) echo "PART: tests | train | bench | all"; exit 2 ;;
esac
