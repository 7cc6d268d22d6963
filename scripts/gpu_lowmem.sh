#!/usr/bin/env bash
# AdamW's low-memory moments (optim.adamw_state = fp32 | bf16 | int8), run ON the GPU
# machine (after scripts/gpu_stage.sh; carry .gpu). Parts (PART=all runs them in order):
#   PART=tests  the GPU tests of the formats (GpuAdamWLowMem.*, and the training suite's
#               captured-step and resume tests, which loop over the formats)
#   PART=plan   `kiln plan` of bench-0.6b per format: the optimizer state it plans
#   PART=train  the bundled corpus (configs/default.toml, tinyshakespeare) per format for
#               STEPS steps (default 600, the config's) at SIZE=default or SIZE=big (a 9.5M
#               model): best and final validation loss, the trainer's memory line, and the
#               GPU's peak memory in use (nvidia-smi, sampled every 100 ms)
#   PART=bench  bench-0.6b per format: ms per step and device memory in use
# docs/optimizers.md has what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PY=/opt/torch/.venv/bin/python; [ -x "$PY" ] || PY=python3
STATES=${STATES:-fp32 bf16 int8}

tests() {
  local filter=${GTEST_FILTER:-'GpuAdamWLowMem.*:Training.CapturedStepMatchesTheOpByOpStep:Training.GpuResumeAfterKillIsBitwiseEqual'}
  timeout ${TEST_TIMEOUT:-500} "$STAGE/bin/kiln_gpu_tests" --gtest_brief=1 --gtest_filter="$filter" > "$LOGS/gpu_lowmem_tests.log" 2>&1
  echo "gpu tests exit $?"; grep -E "^\[  FAILED|PASSED|tests ran|bytes differ|moments\)|Failure|Expected|Which is" "$LOGS/gpu_lowmem_tests.log" | head -60
}

plan() {
  for s in $STATES; do
    echo "== kiln plan bench-0.6b, adamw_state=$s"
    "$STAGE/bin/kiln" plan configs/bench-0.6b.toml --set optim.adamw_state=$s 2>&1 | grep -E "optimizer state|total|parameters" | head -5
  done
}

train() {
  local size=""
  [ "${SIZE:-default}" = big ] && size="--set model.hidden=384 --set model.layers=6 --set model.heads=6 --set model.kv_heads=2 --set model.head_dim=64 --set model.ffn_hidden=1024 --set model.max_seq_len=256 --set train.micro_batch_tokens=16384"
  for s in $STATES; do
    local name=${SIZE:-default}-$s out=/tmp/lowmem/${SIZE:-default}-$s
    rm -rf "$out"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$LOGS/mem-$name.txt" 2>/dev/null &
    local sampler=$!
    local t0=$(date +%s.%N)
    timeout ${TRAIN_TIMEOUT:-500} "$STAGE/bin/kiln" train configs/default.toml --set train.device=cuda --set train.out_dir=$out \
      --set train.steps=${STEPS:-600} --set train.sample_every=0 --set train.sample_tokens=0 --set checkpoint.every=0 \
      --set checkpoint.save_final=false --set optim.adamw_state=$s $size > "$LOGS/train-$name.log" 2>&1
    local rc=$? t1=$(date +%s.%N)
    kill $sampler 2>/dev/null; wait $sampler 2>/dev/null
    local peak=$(sort -n "$LOGS/mem-$name.txt" | tail -1)
    grep -E "^memory:" "$LOGS/train-$name.log" | head -1
    $PY - "$name" "$rc" "$t0" "$t1" "$out/metrics.jsonl" "${peak:-?}" <<'PYEOF'
import json, sys
name, rc, t0, t1, path, peak = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6]
try:
    rows = [json.loads(l) for l in open(path)]
except OSError:
    rows = []
val = [(r["step"], r["loss"]) for r in rows if r.get("kind") == "validation"]
train = [r for r in rows if r.get("kind") == "train"]
best = min(val, key=lambda v: v[1]) if val else (None, float("nan"))
print(f"{name}: rc {rc} | best val {best[1]:.4f} at step {best[0]} | final val {val[-1][1] if val else float('nan'):.4f} | "
      f"train loss {train[-1]['loss'] if train else float('nan'):.4f} | GPU peak in use {peak} MiB | wall {t1 - t0:.1f} s | "
      f"curve {[(s, round(v, 3)) for s, v in val]}")
PYEOF
  done
}

bench() {
  for s in $STATES; do
    timeout 200 "$STAGE/bin/kiln" bench configs/bench-0.6b.toml --steps 10 --warmup 3 --set optim.adamw_state=$s > "$LOGS/bench-$s.log" 2>&1
    echo "== bench-0.6b adamw_state=$s exit $?"; grep -E "ms per step|memory" "$LOGS/bench-$s.log" | head -4
  done
}

case "${PART:-all}" in
tests) tests ;;
plan) plan ;;
train) train ;;
bench) bench ;;
all) tests; plan; train; bench ;;
*) echo "PART: tests | plan | train | bench | all"; exit 2 ;;
esac
