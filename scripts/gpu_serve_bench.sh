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
# PEER=1 also serves each model by llama.cpp's server, the peer the issue names: its GGUF
# (`kiln export gguf --type bf16`, the weights kiln serves in bf16) under llama-server
# (built on this machine by scripts/gpu_llama_server.sh from the carried
# .gpu/llama.cpp-src.tar.xz; LLAMA_SERVER names another binary) with CLIENTS parallel slots
# of LLAMA_CTX tokens each, every layer on the GPU, kiln's default chat template (so both
# render the same prompt), continuous batching; the same serve_bench.py run against it.
# PyPI has no binary of it (llama-cpp-python is published as source), hence the build.
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
PEER=${PEER:-0}
LLAMA_CTX=${LLAMA_CTX:-512}
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

healthy() {  # llama-server answers /health with 200 once the model is loaded
  "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=2)' \
    "$1" >/dev/null 2>&1
}

# llama.cpp's server on MODEL's GGUF, benchmarked as kiln was (label "NAME llama.cpp").
serve_llama_cpp() {
  local model=$1 name=$2 llama port=8199 server
  llama=${LLAMA_SERVER:-$(bash scripts/gpu_llama_server.sh | tail -1)}
  [ -x "$llama" ] || { echo "gpu_serve_bench: no llama-server ($llama)"; return 1; }
  "$KILN" export gguf "$model" "$LOGS/$name.gguf" --type bf16 >"$LOGS/export-$name.log" 2>&1 ||
    { echo "gpu_serve_bench: kiln export gguf $name failed:"; tail -3 "$LOGS/export-$name.log"; return 1; }
  # kiln's default template (docs/serving.md), which kiln serve applied above.
  # (printf of a command substitution: the file ends where the template does, no newline after it)
  printf '%s' "$(cat <<'JINJA'
{% for message in messages %}<|{{ message['role'] }}|>
{{ message['content'] }}
{% endfor %}{% if add_generation_prompt %}<|assistant|>
{% endif %}
JINJA
)" >"$LOGS/kiln-chat.jinja"
  echo "== serving $name by llama.cpp ($llama)"
  "$llama" -m "$LOGS/$name.gguf" --host 127.0.0.1 --port "$port" --alias "$name" --n-gpu-layers 999 \
    --parallel "$CLIENTS" --ctx-size $((CLIENTS * LLAMA_CTX)) --cont-batching --threads-http "$CLIENTS" \
    --jinja --chat-template-file "$LOGS/kiln-chat.jinja" --no-webui >"$LOGS/llama-server-$name.log" 2>&1 &
  server=$!
  for _ in $(seq 600); do
    healthy "$port" && break
    kill -0 "$server" 2>/dev/null || break
    sleep 0.5
  done
  if ! healthy "$port"; then
    echo "gpu_serve_bench: llama-server for $name did not start:"
    tail -8 "$LOGS/llama-server-$name.log"
    kill "$server" 2>/dev/null
    return 1
  fi
  local rc=0
  "$PYTHON" scripts/serve_bench.py --url "http://127.0.0.1:$port" --clients "$CLIENTS" --requests "$REQUESTS" \
    --duration "$DURATION" --max-tokens "$MAX_TOKENS" --label "$name llama.cpp" \
    --json "$LOGS/bench-$name-llama.cpp.json" || rc=1
  kill -TERM "$server"
  wait "$server"
  grep -m3 -i "CUDA0\|flash_attn\|n_ctx_seq" "$LOGS/llama-server-$name.log"
  return $rc
}

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
  [ "$PEER" = 1 ] && { serve_llama_cpp "$model" "$name" || status=1; }
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
