#!/usr/bin/env bash
# Muon's measurements, run ON the GPU machine (after scripts/gpu_stage.sh; carry .gpu):
#   PART=tests    the GPU tests (GTEST_FILTER to select)
#   PART=bench    bench-0.6b with AdamW and with Muon, twice each, and torch's bf16 GEMM
#                 rate at the Newton-Schulz shapes
#   PART=compare  Muon against AdamW on tinyshakespeare at equal tokens: the default
#                 shape and a 9.5M one, over learning rates (SMALL_LRS, BIG_ADAMW_LRS,
#                 BIG_MUON_LRS, BIG_STEPS, BIG_EVAL); one summary line per run
# docs/optimizers.md has what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PY=/opt/torch/.venv/bin/python
case "${PART:-tests}" in
tests)
  timeout ${TEST_TIMEOUT:-400} "$STAGE/bin/kiln_gpu_tests" --gtest_brief=1 ${GTEST_FILTER:+--gtest_filter=$GTEST_FILTER} > "$LOGS/gpu_tests.log" 2>&1
  echo "gpu tests exit $?"; grep -E "^\[  FAILED|PASSED|tests ran|largest difference|records|singular|rms|max" "$LOGS/gpu_tests.log" | head -60
  ;;
bench)
  run() {  # name config args...
    local name=$1 config=$2; shift 2
    timeout 150 "$STAGE/bin/kiln" bench $config --steps 10 --warmup 3 --json "$LOGS/bench.jsonl" "$@" > "$LOGS/$name.log" 2>&1
    echo "== $name exit $?"; grep -E "ms per step|memory|muon|newton|adamw|gemm" "$LOGS/$name.log" | head -20
  }
  run 06b-adamw configs/bench-0.6b.toml
  run 06b-muon configs/bench-0.6b.toml --set optim.name=muon
  run 06b-adamw-2 configs/bench-0.6b.toml
  run 06b-muon-2 configs/bench-0.6b.toml --set optim.name=muon
  timeout 120 $PY - <<'PYEOF'
import torch, time
def rate(b, m, k, n, reps=20):
    x = torch.randn(b, m, k, device="cuda", dtype=torch.bfloat16); y = torch.randn(b, k, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3): torch.bmm(x, y)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(reps): torch.bmm(x, y)
    torch.cuda.synchronize(); s = (time.perf_counter() - t) / reps
    return 2 * b * m * k * n / s / 1e12
print("torch", torch.__version__, torch.cuda.get_device_name())
print("bf16 GEMM 8192^3: %.0f TFLOP/s" % rate(1, 8192, 8192, 8192))
for b, m, k, n in [(56, 1024, 3072, 1024), (56, 1024, 1024, 1024), (56, 1024, 1024, 3072), (28, 1024, 2048, 1024), (28, 2048, 1024, 2048)]:
    print("bf16 bmm [%d x %dx%dx%d]: %.0f TFLOP/s" % (b, m, k, n, rate(b, m, k, n)))
PYEOF
  ;;
compare)
  train() {  # name args...
    local name=$1; shift
    local t0=$(date +%s.%N)
    timeout 300 "$STAGE/bin/kiln" train configs/default.toml --set train.device=cuda --set train.out_dir=/tmp/cmp/$name \
      --set train.sample_every=0 --set train.sample_tokens=0 --set checkpoint.every=0 --set checkpoint.save_final=false "$@" > /tmp/cmp-$name.log 2>&1
    local rc=$? t1=$(date +%s.%N)
    $PY - "$name" "$rc" "$t0" "$t1" /tmp/cmp/$name/metrics.jsonl <<'PYEOF'
import json, sys
name, rc, t0, t1, path = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
rows = [json.loads(l) for l in open(path)]
val = [(r["step"], r["loss"], r["elapsed_seconds"]) for r in rows if r.get("kind") == "validation"]
train = [r for r in rows if r.get("kind") == "train"]
best = min(val, key=lambda v: v[1]) if val else (None, float("nan"), float("nan"))
print(f"{name}: rc {rc} | best val {best[1]:.4f} at step {best[0]} ({best[2]:.1f} s) | final val "
      f"{val[-1][1] if val else float('nan'):.4f} | train loss {train[-1]['loss']:.4f} | wall {t1 - t0:.1f} s | "
      f"curve {[(s, round(v, 3)) for s, v, _ in val]}")
PYEOF
  }
  for lr in ${SMALL_LRS:-1e-3 3e-3 1e-2}; do
    train small-adamw-$lr --set optim.lr=$lr
    train small-muon-$lr --set optim.lr=$lr --set optim.name=muon
  done
  big="--set model.hidden=384 --set model.layers=6 --set model.heads=6 --set model.kv_heads=2 --set model.head_dim=64 --set model.ffn_hidden=1024 --set model.max_seq_len=256 --set train.micro_batch_tokens=16384 --set train.steps=${BIG_STEPS:-1500} --set train.eval_every=${BIG_EVAL:-100}"
  for lr in ${BIG_ADAMW_LRS:-1e-3 3e-3}; do train big-adamw-$lr $big --set optim.lr=$lr; done
  for lr in ${BIG_MUON_LRS:-1e-3 3e-3}; do train big-muon-$lr $big --set optim.lr=$lr --set optim.name=muon; done
  ;;
esac
