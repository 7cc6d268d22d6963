#!/usr/bin/env bash
# Issue 47's "natural routing": bench-moe-1b's step time with routers trained on real text
# against the randomly initialised ones, ON the GPU machine (after scripts/gpu_stage.sh;
# carry .gpu). 1) `kiln train` bench-moe-1b on the bundled corpus (byte tokens) for STEPS
# steps, so every router learns a routing from text; 2) `kiln bench` of the same shape on
# the same text (--tokens data), from those weights (--init) and from random ones; 3) the
# same two from uniform random tokens. Each bench line carries the sparse layers' busiest
# expert / mean load (load_max) of its last timed step.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
source scripts/gpu_env.sh || exit 1
K="$STAGE/bin/kiln"
CONFIG=configs/bench-moe-1b.toml
RUN=${RUN:-/tmp/moe_natural}
DATA=(--set data.path="$PWD/data/tinyshakespeare.txt")
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

rm -rf "$RUN"
t0=$(date +%s)
timeout "${TRAIN_TIMEOUT:-300}" "$K" train "$CONFIG" "${DATA[@]}" --set train.device=cuda --set train.out_dir="$RUN" \
  --set train.steps="${STEPS:-300}" --set train.eval_every=0 --set train.sample_every=0 --set train.sample_tokens=0 \
  --set checkpoint.every=0 > "$LOGS/moe_natural_train.log" 2>&1
echo "train: rc $? in $(( $(date +%s) - t0 )) s | $(grep -E 'step +[0-9]+' "$LOGS/moe_natural_train.log" | tail -1)"
grep -E "load_max|moe_aux" "$LOGS/moe_natural_train.log" | tail -2

bench_row() {  # name args...
  local name=$1; shift
  timeout 300 "$K" bench "$CONFIG" "${DATA[@]}" --steps 10 --warmup 3 "$@" > "$LOGS/moe_natural_$name.log" 2>&1
  echo "$name: rc $? | $(grep -E 'tokens/s' "$LOGS/moe_natural_$name.log" | tail -1) | $(grep -E 'load_max' "$LOGS/moe_natural_$name.log" | tail -1)"
}
bench_row trained_text --tokens data --init "$RUN/model"
bench_row random_text --tokens data
bench_row trained_random_tokens --init "$RUN/model"
bench_row random_random_tokens
