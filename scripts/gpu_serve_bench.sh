#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, with the staged binaries carried (see
# scripts/gpu_stage.sh; by default .gpu/kiln-gpu.tar.xz, or KILN_STAGE=<tarball or folder>):
#   device run: carry [".gpu"], command "bash scripts/gpu_serve_bench.sh", timeout_s 600
# Serving throughput and latency (issue 43): for each shape in CONFIGS (default: the default
# model and bench-0.6b's), a model folder made by `kiln train` for TRAIN_STEPS steps (1: an
# initialized model, which is all throughput needs; `kiln serve` loads a model folder, and
# training is the way to write one), served by `kiln serve` with CLIENTS slots and handler
# threads (a stream holds its handler thread to the end: fewer would queue clients), then
# scripts/serve_bench.py with CLIENTS streaming chat clients, REQUESTS each (or DURATION
# seconds), MAX_TOKENS each (ignore_eos), and the server stopped by SIGTERM. MODELS="dir ..."
# serves those folders instead of training. GRAPH_ROWS is kiln serve's --graph-rows (default
# 16: steps of more rows, such as a decode step of 17 or more busy slots, run uncaptured).
# One JSON per model and a table last; logs, models and JSON under $OUT (or
# /tmp/kiln-serve-bench).
#
# No peer: llama.cpp's server would come from llama-cpp-python, and PyPI has no binary wheel
# of it for Linux x86_64 (`pip download llama-cpp-python --only-binary=:all:
# --platform manylinux2014_x86_64 --python-version 3.12` finds none: source only), nothing
# installs on the GPU machine, and building it there is out of scope. A carried wheel could
# be run against the same shape's GGUF (`kiln export gguf`) by serve_bench.py, which
# speaks plain OpenAI streaming.
set -uo pipefail
cd "$(dirname "$0")/.."

CONFIGS=${CONFIGS:-"configs/default.toml configs/bench-0.6b.toml"}
MODELS=${MODELS:-}
TRAIN_STEPS=${TRAIN_STEPS:-1}
CLIENTS=${CLIENTS:-64}
REQUESTS=${REQUESTS:-4}
DURATION=${DURATION:-0}
MAX_TOKENS=${MAX_TOKENS:-128}
DEVICE=${DEVICE:-auto}
LOGS=${OUT:-/tmp/kiln-serve-bench}
mkdir -p "$LOGS"
rm -f "$LOGS"/bench-*.json
shopt -s nullglob

# The staged binaries (STAGE) and their libraries on LD_LIBRARY_PATH; NVLink multicast off.
source scripts/gpu_env.sh || exit 1
KILN="$STAGE/bin/kiln"
[ -x "$KILN" ] || { echo "gpu_serve_bench: no $KILN (run scripts/gpu_stage.sh and carry it)"; exit 1; }
PYTHON=${BENCH_PYTHON:-python3}  # serve_bench.py needs the standard library only
command -v nvidia-smi >/dev/null &&
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/gpu: /'

status=0
if [ -z "$MODELS" ]; then
  for config in $CONFIGS; do
    name=$(basename "$config" .toml)
    echo "== training $name for $TRAIN_STEPS step(s)"
    "$KILN" train "$config" --set data.path=data/tinyshakespeare.txt --set train.out_dir="$LOGS/run-$name" \
      --set train.steps="$TRAIN_STEPS" --set optim.warmup_steps=0 --set train.eval_every=0 \
      --set train.eval_batches=1 --set train.sample_every=0 >"$LOGS/train-$name.log" 2>&1 ||
      { echo "gpu_serve_bench: training $name failed:"; tail -5 "$LOGS/train-$name.log"; status=1; continue; }
    MODELS+=" $LOGS/run-$name/model@$name"
  done
fi

for entry in $MODELS; do
  model=${entry%@*}
  name=$(basename "$(dirname "$model")")
  [[ $entry == *@* ]] && name=${entry#*@}
  echo "== serving $name ($model)"
  rm -f "$LOGS/$name.port"
  "$KILN" serve "$model" --port 0 --port-file "$LOGS/$name.port" --model-name "$name" --device "$DEVICE" \
    --slots "$CLIENTS" --http-threads "$CLIENTS" --graph-rows "${GRAPH_ROWS:-16}" --no-access-log \
    >"$LOGS/serve-$name.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do  # loading (and CUDA graph capture) may take a while
    [ -s "$LOGS/$name.port" ] && break
    kill -0 "$server" 2>/dev/null || break
    sleep 0.5
  done
  if [ ! -s "$LOGS/$name.port" ]; then
    echo "gpu_serve_bench: the server for $name did not start:"
    tail -5 "$LOGS/serve-$name.log"
    kill "$server" 2>/dev/null
    status=1
    continue
  fi
  "$PYTHON" scripts/serve_bench.py --url "http://127.0.0.1:$(cat "$LOGS/$name.port")" --clients "$CLIENTS" \
    --requests "$REQUESTS" --duration "$DURATION" --max-tokens "$MAX_TOKENS" --label "$name" \
    --json "$LOGS/bench-$name.json" || status=1
  kill -TERM "$server"
  wait "$server" || { echo "gpu_serve_bench: kiln serve for $name exited non-zero"; status=1; }
  tail -1 "$LOGS/serve-$name.log"
done

echo
"$PYTHON" - "$LOGS"/bench-*.json <<'PY' || status=1
import json, sys
rows = [json.load(open(p)) for p in sys.argv[1:]]
cols = ["label", "clients", "requests", "errors", "output_tokens_per_s", "ttft_ms_p50", "ttft_ms_p99",
        "itl_ms_p50", "itl_ms_p99", "tpot_ms_p50", "tpot_ms_p99"]
print(" | ".join(cols))
for r in rows:
    print(" | ".join(str(r.get(c)) for c in cols))
PY
exit $status
