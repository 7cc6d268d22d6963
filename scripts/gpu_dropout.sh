#!/usr/bin/env bash
# Dropout's measurement, run ON the GPU machine (after scripts/gpu_stage.sh; carry .gpu):
# tinyshakespeare, the 9.5M shape of docs/optimizers.md (large enough to overfit the 1.1M
# bytes), trained for STEPS steps at each model.dropout of DROPOUTS (default "0 0.1 0.2";
# model.embed_dropout = EMBED in the arms with dropout): each run's best validation loss, the
# step it came at and the wall time to it, and the last validation loss. docs/dropout.md
# has what this measured.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
shape="--set model.hidden=384 --set model.layers=6 --set model.heads=6 --set model.kv_heads=2 --set model.head_dim=64
  --set model.ffn_hidden=1024 --set model.max_seq_len=256 --set train.micro_batch_tokens=16384
  --set train.steps=${STEPS:-3000} --set train.eval_every=${EVAL:-100} --set train.eval_batches=4
  --set optim.lr=${LR:-1e-3} --set optim.warmup_steps=100 --set train.sample_every=0 --set log.every=100
  --set checkpoint.save_final=false --set checkpoint.every=0"
for p in ${DROPOUTS:-0 0.1 0.2}; do
  e=${EMBED:-0}
  [ "$p" = 0 ] && e=0
  name=dropout-$p
  dir=$LOGS/$name
  timeout "${LIMIT:-280}" "$STAGE/bin/kiln" train configs/default.toml --set train.device=cuda \
    --set train.out_dir="$dir" $shape --set model.dropout="$p" --set model.embed_dropout="$e" > "$LOGS/$name.log" 2>&1
  echo "== $name (dropout $p, embed_dropout $e): exit $?"
  grep -E "parameters|tokens/s" "$LOGS/$name.log" | head -3
  python3 - "$dir/metrics.jsonl" <<'PY'
import json, sys
val = [json.loads(l) for l in open(sys.argv[1]) if '"kind":"validation"' in l]
best = min(val, key=lambda r: r["loss"])
print(f"best val {best['loss']:.4f} at step {best['step']} after {best['elapsed_seconds']:.1f} s; "
      f"last val {val[-1]['loss']:.4f} at step {val[-1]['step']} after {val[-1]['elapsed_seconds']:.1f} s")
print("val curve:", " ".join(f"{r['step']}:{r['loss']:.3f}" for r in val[::2]))
PY
done
