#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, with .gpu/ carried (made by scripts/gpu_stage.sh,
# which packs the binaries and the libraries they need into .gpu/kiln-gpu.tar.xz):
#   device run: carry [".gpu"], command "bash scripts/gpu_check.sh", timeout_s 300
# Runs the GPU test binaries (and, later, benchmarks) and prints one table last:
#   suite | tests | passed | failed | skipped | seconds
# Exits non-zero on any failure, crash or skipped test: on this machine a skip means the
# GPU was not used, which must never pass as success. Full logs go to $OUT (or /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."

LOGS=${OUT:-/tmp/kiln-gpu-check}
mkdir -p "$LOGS"
# The staged binaries (STAGE) and their libraries on LD_LIBRARY_PATH; NVLink multicast off.
source scripts/gpu_env.sh || exit 1
# Tests read the repository (golden files, corpus) from here, not the build machine path.
export KILN_SOURCE_DIR="$PWD"
export KILN_BINARY="$STAGE/bin/kiln"

echo "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm --format=csv,noheader |
    sed 's/^/gpu: /'
  nvidia-smi | grep -o 'CUDA Version: [0-9.]*' | head -1 | sed 's/^/driver /'
else
  echo "gpu: nvidia-smi not found"
fi
ldd --version 2>/dev/null | head -1 | sed 's/^/host: /'

rows=()   # "suite|tests|passed|failed|skipped|seconds"
status=0

add_row() {  # suite tests passed failed skipped seconds
  rows+=("$1|$2|$3|$4|$5|$6")
  if (($4 > 0 || $5 > 0)) || [ "$2" = "-" ]; then status=1; fi
}

# One benchmark row from its command's exit status: passed with the seconds since
# start_time, or failed.
bench_row() {  # suite start_time exit_status
  if [ "$3" = 0 ]; then
    add_row "$1" 1 1 0 0 "$(awk -v s="$2" -v e="$(date +%s.%N)" 'BEGIN{printf "%.1f", e - s}')"
  else
    add_row "$1" 1 0 1 0 0
  fi
}

# Runs one gtest binary (under the command in the array WRAP, if set); one table row.
# A crash or a missing summary counts as a failure.
WRAP=()
run_gtest() {  # suite binary [gtest args...]
  local suite=$1 bin=$2
  shift 2
  local log="$LOGS/$suite.log"
  if [ ! -x "$bin" ]; then
    echo "gpu_check: $bin missing (run scripts/gpu_stage.sh here and carry .gpu)"
    add_row "$suite" - 0 1 0 0
    return
  fi
  local unresolved
  unresolved=$(ldd "$bin" | grep 'not found')
  if [ -n "$unresolved" ]; then
    echo "gpu_check: $bin has unresolved libraries:"
    echo "$unresolved"
    add_row "$suite" - 0 1 0 0
    return
  fi
  local start end rc
  start=$(date +%s.%N)
  "${WRAP[@]}" "$bin" --gtest_brief=1 --gtest_output="json:$LOGS/$suite.json" "$@" >"$log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  local total passed failed skipped
  total=$(sed -n 's/^\[==========\] \([0-9]*\) tests\? from .* ran\..*/\1/p' "$log" | tail -1)
  passed=$(sed -n 's/^\[  PASSED  \] \([0-9]*\) tests\?\..*/\1/p' "$log" | tail -1)
  # --gtest_brief prints no "N tests, listed below" for failures: count the failed tests.
  failed=$(grep -cE '^\[  FAILED  \] .*\([0-9]+ ms\)$' "$log")
  skipped=$(sed -n 's/^\[  SKIPPED \] \([0-9]*\) tests\?[,.].*/\1/p' "$log" | tail -1)
  failed=${failed:-0}
  skipped=${skipped:-0}
  passed=${passed:-0}
  if [ -z "$total" ]; then
    echo "gpu_check: $suite exited with status $rc without a gtest summary (crash?)"
    total=-
    failed=$((failed + 1))
  elif ((rc != 0 && failed == 0)) || ((passed + failed + skipped != total)); then
    echo "gpu_check: $suite exited with status $rc; $total tests != $passed passed + $failed failed + $skipped skipped"
    failed=$((failed > 0 ? failed : 1))
  fi
  # The failed tests by name, then the failures' messages (the rest of the log is in $LOGS;
  # progress lines of training runs are left out); for skips, the first reason.
  grep -E '^\[  FAILED  \] .*\([0-9]+ ms\)$' "$log"
  grep -v -E '^\[  (SKIPPED|PASSED  ) \]|: Skipped$|^step +[0-9]+/|^(kiln|data|memory|validation|sample|saved) ' "$log" |
    grep -v -x -F "$(grep -A1 -m1 ': Skipped$' "$log" | tail -1)" | grep -v '^Running main()' | head -80
  ((skipped > 0)) && echo "gpu_check: $skipped skipped in $suite: $(grep -A1 -m1 ': Skipped$' "$log" | tail -1)"
  add_row "$suite" "$total" "$passed" "$failed" "$skipped" "$(awk -v s="$start" -v e="$end" 'BEGIN{printf "%.1f", e - s}')"
}

# ---- the CLI binary loads (all its libraries resolve) ---------------------------------------
start=$(date +%s.%N)
if version=$("$STAGE/bin/kiln" --version 2>&1); then
  echo "kiln --version: $version"
  add_row "kiln --version" 1 1 0 0 "$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN{printf "%.1f", e - s}')"
else
  echo "gpu_check: kiln does not run: $version"
  ldd "$STAGE/bin/kiln" 2>&1 | grep 'not found'
  add_row "kiln --version" 1 0 1 0 0
fi

# ---- correctness: kernels against the CPU reference ---------------------------------------
# GPU_CHECK_TESTS=0 skips the tests (a benchmark-only run; the table then has no test rows).
if [ "${GPU_CHECK_TESTS:-1}" = 1 ]; then
  run_gtest kiln_gpu_tests "$STAGE/bin/kiln_gpu_tests"
else
  echo "gpu_check: GPU_CHECK_TESTS=0: tests not run"
fi

# Worst measured error per output (recorded by the tests as *_max_rel_err properties).
if command -v python3 >/dev/null && [ -f "$LOGS/kiln_gpu_tests.json" ]; then
  python3 - "$LOGS/kiln_gpu_tests.json" <<'EOF'
import json, sys
worst = {}
for suite in json.load(open(sys.argv[1])).get("testsuites", []):
    for t in suite.get("testsuite", []):
        for k, v in t.items():
            if k.endswith("_max_rel_err"):
                key = (suite["name"].split("/")[-1], k[: -len("_max_rel_err")])
                if float(v) >= worst.get(key, (-1.0, ""))[0]:
                    worst[key] = (float(v), t["name"])
for (suite, out), (err, name) in sorted(worst.items()):
    print(f"worst rel err {suite:16s} {out:5s} {err:.2e}  ({name})")
EOF
fi

# The same kernels under compute-sanitizer's memcheck (out-of-bounds and misaligned
# accesses), on a subset of the op table (test_gpu_op_table.cpp) that covers every kernel
# variant: rms_norm's launch shapes, the unaligned views, and small cases of every other op.
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null)
if [ -n "$sanitizer" ] && [ "${GPU_CHECK_MEMCHECK:-1}" = 1 ]; then
  MEMCHECK_CASES='*r37_*:*r3_c4099*:*r1_c1_*:*_unaligned*:*add_rms_norm_r5_*:*rope_t13_*:*swiglu_n37_f13_*'
  MEMCHECK_CASES+=':*qkv_split_n7_*:*qkv_merge_n7_*:*qkv_prepare_t29_*:*attention_len1_5_17_3_40_h4x1_d72_*'
  MEMCHECK_CASES+=':*linear_n1_*:*OpCuda.MatchesCpu/embedding*:*add_n13_*:*adamw_*:*lm_head_*'
  WRAP=("$sanitizer" --tool memcheck --error-exitcode 86 --print-limit 20)
  run_gtest kiln_gpu_tests.memcheck "$STAGE/bin/kiln_gpu_tests" --gtest_filter="$MEMCHECK_CASES"
  WRAP=()
else
  echo "gpu_check: compute-sanitizer not found (or GPU_CHECK_MEMCHECK=0): no memcheck row"
fi

# ---- benchmarks: add them here, one add_row each -------------------------------------------
# A benchmark is a row of the same table (suite = "bench:<name>"): run it, check its own
# accuracy, write its numbers under $LOGS, then add_row "bench:<name>" 1 1 0 0 <seconds>
# (or failed=1 when it does not run or its accuracy check fails).
# GPU_CHECK_BENCH: space-separated configs to benchmark (empty = none); each runs kiln bench
# and the PyTorch peer (eager and torch.compile; bf16 autocast and plain fp32) on this card.
# GPU_CHECK_PEER_DTYPES: the peer's precisions (default "bf16 fp32"; empty = no peer);
# GPU_CHECK_PEER_MODES: its modes (default "eager,compile").
# GPU_CHECK_BENCH_ARGS: extra arguments of kiln bench (e.g. "--set train.deterministic=false").
BENCH_CONFIGS=${GPU_CHECK_BENCH-configs/bench-124m.toml}
PEER_PYTHON=${PEER_PYTHON:-/opt/torch/.venv/bin/python3}
[ -x "$PEER_PYTHON" ] || PEER_PYTHON=python3
for config in $BENCH_CONFIGS; do
  name=$(basename "$config" .toml)
  start=$(date +%s.%N)
  # shellcheck disable=SC2086  # GPU_CHECK_BENCH_ARGS is a list of words
  "$STAGE/bin/kiln" bench "$config" --steps 5 --warmup 2 --json "$LOGS/bench.jsonl" ${GPU_CHECK_BENCH_ARGS:-} \
    >"$LOGS/$name.kiln.log" 2>&1
  bench_row "bench:$name kiln" "$start" $?
  cat "$LOGS/$name.kiln.log"
  for dtype in ${GPU_CHECK_PEER_DTYPES-bf16 fp32}; do
    start=$(date +%s.%N)
    "$PEER_PYTHON" bench/torch_peer.py --config "$config" --dtype "$dtype" --steps 10 --warmup 3 \
      --modes "${GPU_CHECK_PEER_MODES:-eager,compile}" >>"$LOGS/bench.jsonl" 2>"$LOGS/$name.peer.$dtype.log"
    peer_status=$?
    ((peer_status == 0)) || tail -5 "$LOGS/$name.peer.$dtype.log"
    bench_row "bench:$name torch $dtype" "$start" "$peer_status"
  done
done
# GPU_CHECK_DECODE: batch sizes of the decode benchmark (default "1 8"; empty = none): kiln
# bench-decode of GPU_CHECK_DECODE_CONFIG (default the 0.6B shape) with
# GPU_CHECK_DECODE_ARGS (default prompt 128, 256 timed greedy steps); its accuracy is the
# decoder tests' (DecoderGpu, DecodeAttentionGpu). The transformers peer of that benchmark
# is scripts/decode_bench.sh.
DECODE_BATCHES=${GPU_CHECK_DECODE-1 8}
DECODE_CONFIG=${GPU_CHECK_DECODE_CONFIG:-configs/bench-0.6b.toml}
if [ -n "$DECODE_BATCHES" ]; then
  decode_args=()
  for b in $DECODE_BATCHES; do decode_args+=(--batch "$b"); done
  name=$(basename "$DECODE_CONFIG" .toml)
  start=$(date +%s.%N)
  # shellcheck disable=SC2086  # GPU_CHECK_DECODE_ARGS is a list of words
  "$STAGE/bin/kiln" bench-decode "$DECODE_CONFIG" "${decode_args[@]}" ${GPU_CHECK_DECODE_ARGS:---prompt 128 --tokens 256} \
    >"$LOGS/$name.decode.log" 2>&1
  bench_row "bench:$name decode" "$start" $?
  cat "$LOGS/$name.decode.log"
fi

if [ -f "$LOGS/bench.jsonl" ]; then
  echo "benchmarks (tokens/s, ms/step, memory GiB):"
  "$PEER_PYTHON" - "$LOGS/bench.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    who = r.get("peer") or "kiln " + r["device"]
    mem = r.get("peak_gib", r.get("device_gib", 0))
    name = r["model"] if isinstance(r["model"], str) else ""
    print(f"  {who:<40} {name:<18} {r['tokens_per_second']:>12.0f} tok/s {r['ms_per_step']:>9.1f} ms {mem:>7.2f} GiB")
PY
fi

# ---- summary table (printed last: the device tool returns the end of the output) -----------
echo
printf '%-24s | %6s | %6s | %6s | %7s | %7s\n' suite tests passed failed skipped seconds
printf '%s\n' "-------------------------+--------+--------+--------+---------+--------"
for r in "${rows[@]}"; do
  IFS='|' read -r s t p f k sec <<<"$r"
  printf '%-24s | %6s | %6s | %6s | %7s | %7s\n' "$s" "$t" "$p" "$f" "$k" "$sec"
done
if ((status == 0)); then echo "gpu_check: OK"; else echo "gpu_check: FAILED (failures or skips above)"; fi
exit "$status"
