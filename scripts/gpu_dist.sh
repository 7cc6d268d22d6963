#!/usr/bin/env bash
# Runs ON the GPU machine (carry .gpu from scripts/gpu_stage.sh): what data parallelism
# costs a single GPU. The benchmark shapes' step (kiln bench, which has no process group),
# the PyTorch peer of bench-0.6b (torch.compile, bf16) in the same run, and a training run
# of bench-0.6b on the bundled corpus (packed short documents) alone against the same run as
# one rank of `kiln launch`: with the gradients reduced in 25 MiB buckets on a
# communication stream during the last backward (dist.bucket_mb's default), and in one
# reduction after it (dist.bucket_mb = 0); the loss sums inside the captured update graph.
# Logs under $OUT. STEPS: the training runs' steps (default 24).
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh || exit 1
LOGS=${OUT:-/tmp/kiln-gpu-dist}
mkdir -p "$LOGS"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PEER_PYTHON=${PEER_PYTHON:-/opt/torch/.venv/bin/python}
if [ "${BENCH:-1}" = 1 ]; then  # BENCH=0: the training runs only
  for config in configs/bench-0.6b.toml configs/bench-moe-1b.toml; do
    "$STAGE/bin/kiln" bench "$config" --steps 5 --warmup 2 --json "$LOGS/bench.jsonl" 2>&1 | tail -3
  done
  "$PEER_PYTHON" bench/torch_peer.py --config configs/bench-0.6b.toml --dtype bf16 --steps 10 --warmup 3 \
    --modes compile 2>"$LOGS/peer.log" | tee -a "$LOGS/bench.jsonl" | tail -2
fi
train=(train configs/bench-0.6b.toml --set data.path=data/tinyshakespeare.txt --set train.steps=${STEPS:-24}
       --set log.every=8 --set train.eval_every=0 --set train.eval_batches=0 --set train.sample_tokens=0
       --set checkpoint.every=0 --set checkpoint.save_final=false)
"$STAGE/bin/kiln" "${train[@]}" --set train.out_dir="$LOGS/alone" 2>&1 | grep -E "^step|error" | tail -3
for bucket_mb in 25 0; do
  "$STAGE/bin/kiln" launch --nproc 1 -- "${train[@]}" --set dist.bucket_mb=$bucket_mb \
    --set train.out_dir="$LOGS/ranked-$bucket_mb" 2>&1 | grep -E "^step|^distributed|error" | tail -4
done
