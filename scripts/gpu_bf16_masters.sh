#!/usr/bin/env bash
# bf16 master weights (optim.master_weights = fp32 | bf16), run ON the GPU machine (after
# scripts/gpu_stage.sh; carry .gpu). Parts (PART=all runs them in order):
#   PART=tests  GpuBf16Masters.* (the kernel against the CPU reference, bit for bit)
#   PART=train  configs/default.toml (tinyshakespeare) per setting for STEPS steps (default
#               600, the config's): best and final validation loss, the trainer's memory
#               line, wall time
#   PART=bench  bench-1.5b per setting: ms per step and device memory in use
# docs/optimizers.md has what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
LOGS=${OUT:-/tmp/out}; mkdir -p "$LOGS"
source scripts/gpu_env.sh || exit 1
export KILN_SOURCE_DIR="$PWD" KILN_BINARY="$STAGE/bin/kiln"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PY=/opt/torch/.venv/bin/python; [ -x "$PY" ] || PY=python3
SETTINGS=${SETTINGS:-fp32 bf16}

tests() {
  timeout ${TEST_TIMEOUT:-300} "$STAGE/bin/kiln_gpu_tests" --gtest_filter="${GTEST_FILTER:-GpuBf16Masters.*}" \
    > "$LOGS/bf16m_tests.log" 2>&1
  echo "gpu tests exit $?"; grep -E "^\[  FAILED|PASSED|tests ran|bytes differ|Failure|Expected|Which is" "$LOGS/bf16m_tests.log" | head -40
}

summary() {  # name rc metrics.jsonl
  $PY - "$@" <<'PYEOF'
import json, sys
name, rc, path = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    rows = [json.loads(l) for l in open(path)]
except OSError:
    rows = []
val = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "validation"]
train = [r for r in rows if r.get("kind") == "train"]
best = min(val, key=lambda v: v[1]) if val else (None, float("nan"))
print(f"{name}: rc {rc} | best val {best[1]:.5f} at step {best[0]} | final val {val[-1][1] if val else float('nan'):.6f} | "
      f"train loss {train[-1]['loss'] if train else float('nan'):.5f} | curve {[(s, round(v, 4)) for s, v in val]}")
PYEOF
}

run_train() {  # name out extra-args...
  local name=$1 out=$2; shift 2
  local t0=$(date +%s.%N)
  timeout ${TRAIN_TIMEOUT:-300} "$STAGE/bin/kiln" train configs/default.toml --set train.device=cuda --set train.out_dir=$out \
    --set train.steps=${STEPS:-600} --set train.sample_every=0 --set train.sample_tokens=0 "$@" > "$LOGS/train-$name.log" 2>&1
  local rc=$? t1=$(date +%s.%N)
  grep -E "^memory:" "$LOGS/train-$name.log" | head -1
  echo "$name wall $(echo "$t1 - $t0" | bc) s"
  summary "$name" "$rc" "$out/metrics.jsonl"
  [ $rc = 0 ] || tail -5 "$LOGS/train-$name.log"
}

train() {
  for s in $SETTINGS; do
    rm -rf /tmp/bf16m/$s
    run_train "$s" /tmp/bf16m/$s --set checkpoint.every=0 --set checkpoint.save_final=false --set optim.master_weights=$s
  done
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
