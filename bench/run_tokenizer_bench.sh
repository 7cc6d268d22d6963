#!/usr/bin/env bash
# Byte-level BPE: kiln against Hugging Face tokenizers on the same text and tokenizers,
# both arms interleaved in one run so they see the same machine load.
#   encode: 32K-vocabulary tokenizers (one trained by kiln, one by tokenizers' BpeTrainer),
#           1 and 2 threads; kiln encode_batch vs tokenizers encode_batch(_fast)
#   train:  32K vocabulary, qwen2 pattern, min frequency 2; kiln vs tokenizers' BpeTrainer
# Usage: bench/run_tokenizer_bench.sh [BUILD_DIR] [CORPUS_MB] [ROUNDS]   (defaults: build 6 3)
# Prints the environment, every raw JSON result, and a table of medians over rounds.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
megabytes=${2:-6}
rounds=${3:-3}
bench=$build/bench/tokenizer_bench
python=$(scripts/python_env.sh)
[ -x "$bench" ] || { echo "build $bench first (cmake --build $build --target tokenizer_bench)" >&2; exit 1; }
work=$(mktemp -d /tmp/kiln-tokenizer-bench-XXXXXX)
results=$work/results.jsonl
export OMP_WAIT_POLICY=passive

echo "date:       $(date -u '+%Y-%m-%d %H:%M UTC')"
echo "cpu:        $(lscpu | sed -n 's/^Model name:[ ]*//p') ($(nproc) cores)"
echo "compiler:   $(${CXX:-g++} --version | head -1)"
echo "pcre2:      $(pkg-config --modversion libpcre2-8)"
echo "tokenizers: $($python -c 'import tokenizers; print(tokenizers.__version__)')"
echo "load:       $(cut -d' ' -f1-3 /proc/loadavg) (1/5/15 min) before"

"$python" bench/tokenizer_corpus.py "$work/corpus.txt" "$megabytes"
echo "corpus:     data/tinyshakespeare.txt + synthetic multilingual text, $(wc -c < "$work/corpus.txt") bytes"

for round in $(seq "$rounds"); do
  for threads in 2 1; do
    "$bench" train "$work/corpus.txt" --vocab-size 32000 --threads "$threads" --out "$work/kiln32k" >> "$results"
    RAYON_NUM_THREADS=$threads "$python" bench/tokenizer_peer.py train "$work/corpus.txt" 32000 "$threads" \
      "$work/hf32k" >> "$results"
  done
done
cp data/tinyshakespeare.txt "$work/shakespeare.txt"
for round in $(seq "$rounds"); do
  for text in corpus shakespeare; do
    for tok in kiln32k hf32k; do
      for threads in 1 2; do
        tag="s/^{/{\"text\": \"$text\", \"tokenizer\": \"$tok\", /"
        "$bench" encode "$work/$tok/tokenizer.json" "$work/$text.txt" --threads "$threads" --repeat 3 |
          sed "$tag" >> "$results"
        RAYON_NUM_THREADS=$threads "$python" bench/tokenizer_peer.py encode "$work/$tok/tokenizer.json" \
          "$work/$text.txt" "$threads" 3 | sed "$tag" >> "$results"
      done
    done
  done
done
echo "load:       $(cut -d' ' -f1-3 /proc/loadavg) (1/5/15 min) after"
cat "$results"

"$python" - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def median(arm, task, threads, tok=None, text=None, key="seconds"):
    v = [r[key] for r in rows if r["arm"] == arm and r["task"] == task and r["threads"] == threads
         and r.get("tokenizer") == tok and r.get("text") == text]
    return statistics.median(v) if v else float("nan")
print("\n| task | text | tokenizer | threads | kiln | tokenizers | kiln speed-up |")
print("|---|---|---|---|---|---|---|")
for text in ("corpus", "shakespeare"):
    for tok in ("kiln32k", "hf32k"):
        for t in (1, 2):
            k = median("kiln", "encode", t, tok, text, "mb_per_s")
            for arm in ("tokenizers.encode_batch", "tokenizers.encode_batch_fast"):
                h = median(arm, "encode", t, tok, text, "mb_per_s")
                print(f"| {arm.split('.')[1]} | {text} | {tok} | {t} | {k:.2f} MB/s | {h:.2f} MB/s | {k / h:.1f}x |")
            kt = {r["tokens"] for r in rows if r["task"] == "encode" and r.get("tokenizer") == tok
                  and r.get("text") == text}
            assert len(kt) == 1, f"token counts differ between arms for {tok} on {text}: {kt}"
for t in (1, 2):
    k, h = median("kiln", "train", t), median("tokenizers.BpeTrainer", "train", t)
    print(f"| train 32K | corpus | - | {t} | {k:.2f} s | {h:.2f} s | {h / k:.1f}x |")
PY
rm -rf "$work"
