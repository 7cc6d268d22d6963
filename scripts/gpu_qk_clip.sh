#!/usr/bin/env bash
# QK-Clip's measurements, run ON the GPU machine (after scripts/gpu_stage.sh; carry .gpu):
#   PART=bench  bench-0.6b with Muon, then Muon with QK-Clip at tau 100 (the measure's cost:
#               nothing clips) and tau 5 (heads clip every step), twice each, with the
#               per-op profile's attention and QK-Clip rows
#   PART=train  tinyshakespeare, the 9.5M shape of docs/optimizers.md, Muon at a high
#               learning rate (LR) with and without QK-Clip (TAU), with and without q/k
#               norms (QK_NORMS): the largest logit over training and the best validation loss
# The GPU tests are scripts/gpu_muon.sh PART=tests. docs/optimizers.md has what this measured.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PY=/opt/torch/.venv/bin/python
case "${PART:-bench}" in
bench)
  run() {  # name args...
    local name=$1; shift
    timeout 150 "$STAGE/bin/kiln" bench configs/bench-0.6b.toml --steps 10 --warmup 3 --json "$LOGS/bench.jsonl" \
      --set optim.name=muon "$@" > "$LOGS/$name.log" 2>&1
    echo "== $name exit $?"; grep -E "ms per step|memory|attention|max_logits|qk_clip|scale_head|all ops" "$LOGS/$name.log" | head -14
  }
  for round in 1 2; do
    run muon-$round
    run muon-clip100-$round --set optim.qk_clip.enabled=true --set optim.qk_clip.tau=100
    run muon-clip5-$round --set optim.qk_clip.enabled=true --set optim.qk_clip.tau=5
  done
  ;;
train)
  big="--set model.hidden=384 --set model.layers=6 --set model.heads=6 --set model.kv_heads=2 --set model.head_dim=64 --set model.ffn_hidden=1024 --set model.max_seq_len=256 --set train.micro_batch_tokens=16384 --set train.steps=${STEPS:-800} --set train.eval_every=${EVAL:-100} --set optim.name=muon --set optim.lr=${LR:-1e-2} --set log.every=50"
  for arm in none clip; do
    extra=""
    [ $arm = clip ] && extra="--set optim.qk_clip.enabled=true --set optim.qk_clip.tau=${TAU:-30}"
    # The unclipped run measures too (tau far above any logit): its largest logit is logged.
    [ $arm = none ] && extra="--set optim.qk_clip.enabled=true --set optim.qk_clip.tau=1e30"
    for qk in ${QK_NORMS:-false true}; do
      name=$arm-qknorm-$qk
      timeout 280 "$STAGE/bin/kiln" train configs/default.toml --set train.device=cuda --set train.out_dir=/tmp/qkc/$name \
        --set train.sample_every=0 --set train.sample_tokens=0 --set checkpoint.every=0 --set checkpoint.save_final=false \
        --set model.qk_norm=$qk $big $extra > "$LOGS/train-$name.log" 2>&1
      echo "== $name exit $?"
      grep -E "^step .*(00|50)/" "$LOGS/train-$name.log" | sed -E 's/\| lr.*//' | tail -6
      grep -E "validation at" "$LOGS/train-$name.log" | sort -t' ' -k6 -n | head -1
    done
  done
  ;;
esac
