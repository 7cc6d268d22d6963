#!/usr/bin/env bash
# muP's learning-rate sweep, run ON the GPU machine (after scripts/gpu_stage.sh; carry .gpu):
# tinyshakespeare (the bundled corpus), one model family at widths WIDTHS (default "256
# 1024": heads of 64, kv = heads / 2, SwiGLU 3 x width, LAYERS layers, untied head in every
# arm), AdamW at each learning rate of LRS, with muP against base width 256 and without it.
# Prints a table of the last validation loss per (muP, width, lr); with muP the best lr
# should be the same at both widths, without it it should move down as the width grows.
# docs/mup.md has what this measured (not yet: staged, not run).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
common="--set model.layers=${LAYERS:-4} --set model.head_dim=64 --set model.tie_embeddings=false
  --set model.max_seq_len=256 --set train.micro_batch_tokens=16384 --set train.steps=${STEPS:-1000}
  --set train.eval_every=${EVAL:-250} --set train.eval_batches=8 --set optim.name=adamw
  --set optim.warmup_steps=100 --set train.sample_every=0 --set log.every=100
  --set checkpoint.save_final=false --set checkpoint.every=0"
for base in 256 0; do
  for w in ${WIDTHS:-256 1024}; do
    heads=$((w / 64))
    shape="--set model.hidden=$w --set model.heads=$heads --set model.kv_heads=$((heads / 2))
      --set model.ffn_hidden=$((3 * w)) --set model.mup_base_width=$base"
    for lr in ${LRS:-3e-4 1e-3 3e-3 1e-2 3e-2}; do
      name=mup$base-w$w-lr$lr
      timeout "${LIMIT:-280}" "$STAGE/bin/kiln" train configs/default.toml --set train.device=cuda \
        --set train.out_dir="$LOGS/$name" $common $shape --set optim.lr="$lr" > "$LOGS/$name.log" 2>&1
      echo "== $name: exit $?"
      grep -E "^optimizer:" "$LOGS/$name.log" | head -3  # each group's learning rate
    done
  done
done
python3 - "$LOGS" <<'PY'
import glob, json, os, re, sys
rows = {}
for path in glob.glob(os.path.join(sys.argv[1], "mup*-w*-lr*", "metrics.jsonl")):
    base, w, lr = re.match(r"mup(\d+)-w(\d+)-lr(.+)", os.path.basename(os.path.dirname(path))).groups()
    val = [json.loads(l) for l in open(path) if '"kind":"validation"' in l]
    if val: rows[("muP" if base != "0" else "SP", int(w), float(lr))] = val[-1]["loss"]
lrs = sorted({k[2] for k in rows})
print("| param | width | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best lr |")
print("|---|---:|" + "---:|" * (len(lrs) + 1))
for p, w in sorted({k[:2] for k in rows}):
    losses = {lr: rows.get((p, w, lr)) for lr in lrs}
    done = {lr: v for lr, v in losses.items() if v is not None}
    best = min(done, key=done.get) if done else None
    cells = " | ".join(f"{v:.4f}" if v is not None else "-" for v in losses.values())
    print(f"| {p} | {w} | {cells} | {best:g} |" if best else f"| {p} | {w} | {cells} | - |")
PY
