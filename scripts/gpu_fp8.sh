#!/usr/bin/env bash
# train.precision = fp8_tensorwise / fp8_blockwise on the GPU, run ON the GPU machine (after
# scripts/gpu_stage.sh; carry .gpu). Parts (PART=all runs them in order):
#   PART=tests  GpuFp8.*, GpuFp8Linear.*, GpuFp8BlockwiseLinear.* and GpuFp8Experts.*
#               (kernels, the linear layers and the experts' grouped products against the
#               CPU emulation, small models trained in captured graphs)
#   PART=bench  kiln bench per shape (SHAPES, default 0.6b 1.5b moe-1b) in each of ARMS
#               (default bf16 fp8_tensorwise fp8_blockwise, and fp8_experts on MoE shapes:
#               fp8_tensorwise with train.fp8_experts): ms per step, tokens/s and device
#               memory in use
#   PART=train  `kiln loss-gap` on CONFIG (default configs/default.toml; tinyshakespeare)
#               for STEPS steps (default 300; EXTRA_SETS: more KEY=VALUE for every run):
#               bf16 at two seeds, fp8_tensorwise at the first, then fp8_blockwise at the
#               first compared with the same two (--runs)
#   PART=peer   (not in PART=all) the PyTorch peer, bench/torch_peer.py, per shape (SHAPES,
#               default 0.6b) in each of FLOAT8_ARMS (default none tensorwise rowwise: bf16,
#               then torchao's float8 recipes on the dense Linears) under PEER_MODES (default
#               compile), each arm under `timeout PEER_TIMEOUT` (default 240 s; compiling a
#               float8 arm is slow). Needs torchao: run scripts/torchao_wheel.sh here first
#               and carry .whl (.whl/torchao goes on PYTHONPATH); needs no .gpu.
# docs/fp8.md has what it measured.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${PART:-all}" = peer ]; then  # torch only: no staged kiln
  LOGS=${LOGS:-${OUT:-/tmp/out}}; mkdir -p "$LOGS"
else
  source scripts/gpu_env.sh || exit 1
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

tests() {
  timeout ${TEST_TIMEOUT:-600} "$STAGE/bin/kiln_gpu_tests" --gtest_filter="${GTEST_FILTER:-GpuFp8.*:GpuFp8Linear.*:GpuFp8BlockwiseLinear.*:GpuFp8Experts.*}" \
    > "$LOGS/fp8_tests.log" 2>&1
  echo "gpu tests exit $?"
  grep -E "^\[  FAILED|^\[       OK|PASSED|tests ran|outside the bound|Failure|Expected|Which is|error" "$LOGS/fp8_tests.log" | head -60
}

bench() {
  for shape in ${SHAPES:-0.6b 1.5b moe-1b}; do
    arms="${ARMS:-bf16 fp8_tensorwise fp8_blockwise}"
    [[ $shape == moe* && -z ${ARMS:-} ]] && arms="$arms fp8_experts"  # the routed experts in FP8 too
    for p in $arms; do
      set_args=(--set train.precision=$p)
      [[ $p == fp8_experts ]] && set_args=(--set train.precision=fp8_tensorwise --set train.fp8_experts=true)
      timeout 240 "$STAGE/bin/kiln" bench configs/bench-$shape.toml --steps ${BENCH_STEPS:-10} --warmup 3 \
        "${set_args[@]}" > "$LOGS/bench-$shape-$p.log" 2>&1
      echo "== bench-$shape $p exit $?"; grep -E "tokens/s|memory:|error" "$LOGS/bench-$shape-$p.log" | head -4
      grep -A8 "per op" "$LOGS/bench-$shape-$p.log" | tail -8
    done
  done
}

train() {  # kiln loss-gap: bf16 at two seeds against fp8_tensorwise, then fp8_blockwise (docs/loss-gap.md)
  local config=${CONFIG:-configs/default.toml} out=/tmp/fp8gap
  local sets=(--set train.device=cuda --set train.steps=${STEPS:-300} --set train.sample_every=0
              --set train.sample_tokens=0 --set checkpoint.every=0 --set checkpoint.save_final=false)
  for s in ${EXTRA_SETS:-}; do sets+=(--set "$s"); done  # e.g. EXTRA_SETS="train.micro_batch_tokens=4096"
  rm -rf $out
  timeout ${TRAIN_TIMEOUT:-400} "$STAGE/bin/kiln" loss-gap "$config" --out $out --from-step ${FROM_STEP:-0} \
    --seeds 1 2 --candidate train.precision=fp8_tensorwise "${sets[@]}" > "$LOGS/loss_gap.log" 2>&1
  echo "loss-gap exit $?"; tail -12 "$LOGS/loss_gap.log"
  # The blockwise recipe at the first baseline's seed, compared with the same two baselines.
  timeout ${TRAIN_TIMEOUT:-400} "$STAGE/bin/kiln" train "$config" "${sets[@]}" --set train.precision=fp8_blockwise \
    --set train.seed=1 --set train.out_dir=$out/blockwise-seed1 > "$LOGS/blockwise_run.log" 2>&1
  echo "blockwise run exit $?"; tail -2 "$LOGS/blockwise_run.log"
  "$STAGE/bin/kiln" loss-gap --runs $out/baseline-seed1 $out/baseline-seed2 $out/blockwise-seed1 \
    --from-step ${FROM_STEP:-0} > "$LOGS/loss_gap_blockwise.log" 2>&1
  echo "loss-gap (blockwise) exit $?"; tail -12 "$LOGS/loss_gap_blockwise.log"
}

peer() {  # bench/torch_peer.py: bf16 and torchao float8 (tensorwise, rowwise), one JSON line per mode
  local py=/opt/torch/.venv/bin/python; [ -x "$py" ] || py=python3
  [ -f .whl/torchao/torchao/float8/__init__.py ] ||
    echo "peer: no .whl/torchao (run scripts/torchao_wheel.sh, carry .whl): the float8 arms will stop"
  export PYTHONPATH="$PWD/.whl/torchao${PYTHONPATH:+:$PYTHONPATH}"
  local shape f8 name rc
  for shape in ${SHAPES:-0.6b}; do
    for f8 in ${FLOAT8_ARMS:-none tensorwise rowwise}; do
      name=peer-$shape-$f8
      timeout "${PEER_TIMEOUT:-240}" "$py" -u bench/torch_peer.py --config configs/bench-$shape.toml \
        --modes "${PEER_MODES:-compile}" --steps "${BENCH_STEPS:-10}" --warmup 3 --float8 "$f8" > "$LOGS/$name.log" 2>&1
      rc=$?
      grep '^{' "$LOGS/$name.log" > "$LOGS/$name.json"
      echo "== peer bench-$shape float8 $f8 exit $rc$([ $rc = 124 ] && echo " (timed out after ${PEER_TIMEOUT:-240} s)")"
      "$py" -c '
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    peer, ms, tps, loss, warm = r["peer"], r["ms_per_step"], r["tokens_per_second"], r["loss"], r["warmup_seconds"]
    gib, f8 = r["peak_gib"] or 0.0, r.get("float8_linears")
    print(f"  {peer}: {ms:.1f} ms/step, {tps:.0f} tokens/s, peak {gib:.2f} GiB, warm-up {warm:.0f} s, loss {loss:.3f}"
          + ("" if not f8 else ", %d Linears in float8 (torchao %s), kept %s" % (f8["converted"], f8["torchao"], f8["kept"])))
' "$LOGS/$name.json"
      grep -E "Error|error:|^torch_peer:" "$LOGS/$name.log" | tail -3
    done
  done
}

case "${PART:-all}" in
tests) tests ;;
bench) bench ;;
train) train ;;
peer) peer ;;
all) tests; bench; train ;;
*) echo "PART: tests | bench | train | peer | all"; exit 2 ;;
esac
