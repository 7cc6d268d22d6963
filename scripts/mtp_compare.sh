#!/usr/bin/env bash
# Multi-token prediction's measurement (docs/mtp.md): the same model and data trained for
# the same steps (so the same tokens) without MTP and with each form at depths 1 and 2;
# for each arm, the main head's validation loss (last and best), each depth's last training
# loss, the median step time (meaningful only on an otherwise idle machine) and the tokens. Runs where it is started: on the CPU with build/src/kiln
# (default), or on the GPU machine with KILN=$STAGE/bin/kiln and ARGS="--set
# train.device=cuda ...". CONFIG (default configs/default.toml), STEPS (300), EVAL (50) and
# ARMS choose the runs; extra settings go in ARGS.
set -euo pipefail
cd "$(dirname "$0")/.."
KILN=${KILN:-build/src/kiln}
OUT=${OUT:-/tmp/kiln-mtp-compare}
mkdir -p "$OUT"
ARMS=${ARMS:-"none sequential:1 sequential:2 parallel:1 parallel:2"}
for arm in $ARMS; do
  mtp=""
  if [ "$arm" != none ]; then mtp="--set model.mtp.form=${arm%%:*} --set model.mtp.depth=${arm##*:}"; fi
  dir="$OUT/${arm/:/-}"
  rm -rf "$dir"
  # shellcheck disable=SC2086  # the settings are words
  "$KILN" train "${CONFIG:-configs/default.toml}" --set train.out_dir="$dir" --set train.steps="${STEPS:-300}" \
    --set train.eval_every="${EVAL:-50}" --set train.sample_every=0 --set checkpoint.save_final=false \
    --set checkpoint.every=0 $mtp ${ARGS:-} > "$dir.log" 2>&1 || { echo "$arm: failed (see $dir.log)"; continue; }
  python3 - "$arm" "$dir/metrics.jsonl" <<'PY'
import json, statistics, sys
arm, path = sys.argv[1], sys.argv[2]
records = [json.loads(line) for line in open(path)]
val = [r for r in records if r["kind"] == "validation"]
train = [r for r in records if r["kind"] == "train"]
depths = " ".join(f"{k} {v:.4f}" for k, v in train[-1].items() if k.startswith("mtp.") and isinstance(v, float))
step_ms = 1000 * statistics.median(r["step_seconds"] / r["window_steps"] for r in train[1:])
best = min(val, key=lambda r: r["loss"])
print(f"{arm:14s} val {val[-1]['loss']:.4f} (best {best['loss']:.4f} at {best['step']}) | "
      f"{step_ms:.1f} ms/step | {sum(r['tokens'] for r in train)} tokens | {depths or 'no depths'}")
PY
done
