#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz/) with clang++-14 -fsanitize=fuzzer,address,undefined
# into build-fuzz/ and runs each for a bounded time, as many at once as there are cores.
# Usage: scripts/fuzz.sh [SECONDS per target, default 30] [TARGET...]   (CI: .ci/run, 30 s)
#
# Each target starts from its committed corpus (tests/fuzz/corpus/TARGET, read only) and
# keeps what it finds in build-fuzz/corpus/TARGET. A crash, leak, timeout or out-of-memory
# input is written to build-fuzz/artifacts/ and fails the script: fix the bug at its root,
# then commit the input to tests/fuzz/corpus/TARGET/ as a regression input (ctest replays
# every corpus file through the same targets with gcc: fuzz_corpus.TARGET).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=${1:-30}
shift || true
build=build-fuzz

# clang and its libFuzzer/sanitizer runtimes (Debian packages), installed when missing.
packages=(clang-14 libclang-rt-14-dev)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  echo "fuzz: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

started=$(date +%s)
launcher=()
command -v ccache >/dev/null 2>&1 && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S tests/fuzz -B "$build" -G Ninja -DCMAKE_CXX_COMPILER=clang++-14 "${launcher[@]}" >/dev/null
# Quiet unless it fails: then the build's own output says why.
if ! cmake --build "$build" -j"$(nproc)" >"$build/build.log" 2>&1; then
  echo "fuzz: building the targets failed ($build/build.log):"
  grep -E "error|undefined reference" "$build/build.log" | head -20
  exit 1
fi
built=$(date +%s)
echo "fuzz: targets built in $((built - started)) s"

if (($#)); then targets=("$@"); else
  targets=()
  for f in tests/fuzz/targets/*.cpp; do targets+=("$(basename "$f" .cpp)"); done
fi
rm -rf "$build/artifacts" "$build/logs"  # what an earlier run found is not this run's
mkdir -p "$build/artifacts" "$build/logs"

run_target() {
  local t=$1 dict=()
  mkdir -p "$build/corpus/$t"
  [ -f "tests/fuzz/dict/$t.dict" ] && dict=(-dict="tests/fuzz/dict/$t.dict")
  # -timeout: an input slower than 10 s is a bug (a hang); -rss_limit_mb: so is 2 GB.
  "$build/fuzz_$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=16384 \
    -print_final_stats=1 -artifact_prefix="$build/artifacts/$t-" "${dict[@]}" \
    "$build/corpus/$t" "tests/fuzz/corpus/$t" >"$build/logs/$t.log" 2>&1
}

pids=() names=() failed=0
for t in "${targets[@]}"; do
  while (($(jobs -rp | wc -l) >= $(nproc))); do wait -n || true; done
  run_target "$t" &
  pids+=($!) names+=("$t")
done
status=()
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then status[$i]=ok; else status[$i]=FAILED; failed=1; fi
done

printf '%-20s %8s %12s %9s %7s %7s %7s  %s\n' target seconds execs execs/s cov ft corpus result
for i in "${!names[@]}"; do
  t=${names[$i]} log="$build/logs/${names[$i]}.log"
  execs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' || echo "?")
  rate=$(grep -oE 'stat::average_exec_per_sec: *[0-9]+' "$log" | grep -oE '[0-9]+$' || echo "?")
  last=$(grep -E '^#[0-9]+' "$log" | tail -1)
  cov=$(grep -o 'cov: [0-9]*' <<<"$last" | grep -o '[0-9]*' || echo "?")
  ft=$(grep -o 'ft: [0-9]*' <<<"$last" | grep -o '[0-9]*' || echo "?")
  corp=$(grep -o 'corp: [0-9]*' <<<"$last" | grep -o '[0-9]*' || echo "?")
  printf '%-20s %8s %12s %9s %7s %7s %7s  %s\n' "$t" "$seconds" "$execs" "$rate" "$cov" "$ft" "$corp" "${status[$i]}"
  if [ "${status[$i]}" != ok ]; then
    echo "--- $log (tail)"
    tail -40 "$log"
  fi
done
echo "fuzz: build $((built - started)) s, runs $(($(date +%s) - built)) s"
if ((failed)); then
  echo "fuzz: a target found a bug; its input is in $build/artifacts/" >&2
  exit 1
fi
