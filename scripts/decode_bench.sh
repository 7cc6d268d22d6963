#!/usr/bin/env bash
# Runs ON the GPU machine, from the repo root, with the staged binaries carried (see
# scripts/gpu_stage.sh; by default .gpu/kiln-gpu.tar.xz, or KILN_STAGE=<tarball or folder>):
#   device run: carry [".gpu"], command "bash scripts/decode_bench.sh", timeout_s 300
# Decode speed of the 0.6B shape in one run on one card: `kiln bench-decode` (bf16 decoder,
# CUDA-graph steps, static KV cache; also timed with plain projections and without its fused
# kernels) and the
# transformers peer (bench/decode_peer.py:
# generate with a static cache, eager unless PEER_COMPILE=auto), then one table last:
#   batch | kiln ms/token | transformers ms/token | speedup | floor ms | kiln/floor
# ms/token = one decode step (one new token per sequence); floor = weight bytes / copy
# bandwidth (read + write bytes per second of a device-to-device copy). Logs and the JSON
# lines go to $OUT (or /tmp/kiln-decode-bench).
set -uo pipefail
cd "$(dirname "$0")/.."

CONFIG=${CONFIG:-configs/bench-0.6b.toml}
PROMPT=${PROMPT:-128}
TOKENS=${TOKENS:-256}
BATCHES=${BATCHES:-"1 8"}
PEER_COMPILE=${PEER_COMPILE:-off}
LOGS=${OUT:-/tmp/kiln-decode-bench}
mkdir -p "$LOGS"

# The staged binaries (STAGE) and their libraries on LD_LIBRARY_PATH; NVLink multicast off.
source scripts/gpu_env.sh || exit 1
[ -x "$STAGE/bin/kiln" ] || { echo "decode_bench: no $STAGE/bin/kiln (run scripts/gpu_stage.sh and carry it)"; exit 1; }
PEER_PYTHON=${PEER_PYTHON:-/opt/torch/.venv/bin/python}
[ -x "$PEER_PYTHON" ] || PEER_PYTHON=python3

command -v nvidia-smi >/dev/null &&
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | sed 's/^/gpu: /'

batch_args=()
for b in $BATCHES; do batch_args+=(--batch "$b"); done
JSON="$LOGS/decode.jsonl"
rm -f "$JSON"
status=0
"$STAGE/bin/kiln" bench-decode "$CONFIG" "${batch_args[@]}" --prompt "$PROMPT" --tokens "$TOKENS" --ops --plain --json "$JSON" \
  2>&1 | tee "$LOGS/kiln.log" || status=1
PYTHONUNBUFFERED=1 "$PEER_PYTHON" bench/decode_peer.py --config "$CONFIG" "${batch_args[@]}" --prompt "$PROMPT" \
  --tokens "$TOKENS" --compile "$PEER_COMPILE" >>"$JSON" 2> >(tee "$LOGS/peer.log" >&2) || status=1

echo
"$PEER_PYTHON" - "$JSON" <<'PY' || status=1
import json, sys
kiln, chain, ops, plain, peer = {}, {}, {}, {}, {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["who"] != "kiln":
        peer[r["batch"]] = r
    elif r["variant"].startswith("chain"):
        chain[r["batch"]] = r
    else:
        {"ops": ops, "plain": plain}.get(r["variant"], kiln)[r["batch"]] = r
if peer:
    print("peer:", next(iter(peer.values()))["who"])
if kiln:
    k = next(iter(kiln.values()))
    print(f"kiln: {k['device']}; weights {k['weight_bytes'] / 1e9:.3f} GB per step, "
          f"copy bandwidth {k['copy_bandwidth_gbs']:.0f} GB/s (read + write)")
print(f"{'batch':>5} | {'kiln ms/token':>13} | {'transformers ms/token':>21} | {'speedup':>7} | {'floor ms':>8} | {'kiln/floor':>10}")
print("------+---------------+-----------------------+---------+----------+-----------")
for b in sorted(set(kiln) | set(peer)):
    k, p = kiln.get(b), peer.get(b)
    km = f"{k['ms_per_token']:.3f}" if k else "-"
    pm = f"{p['ms_per_token']:.3f}" if p else "-"
    sp = f"{p['ms_per_token'] / k['ms_per_token']:.1f}x" if k and p else "-"
    fl = f"{k['floor_ms']:.3f}" if k else "-"
    xf = f"{k['x_floor']:.2f}" if k else "-"
    print(f"{b:>5} | {km:>13} | {pm:>21} | {sp:>7} | {fl:>8} | {xf:>10}")
if chain:
    print("kiln in greedy chains (" + next(iter(chain.values()))["variant"] + ": one host round trip per chain): " +
          ", ".join(f"batch {b} {r['ms_per_token']:.3f} ms ({r['x_floor']:.2f}x floor)" for b, r in sorted(chain.items())))
if plain:
    print("kiln with plain projections (no fused decode projections): " +
          ", ".join(f"batch {b} {r['ms_per_token']:.3f} ms ({r['x_floor']:.2f}x floor)" for b, r in sorted(plain.items())))
if ops:
    print("kiln without the fused kernels (every op through its front end): " +
          ", ".join(f"batch {b} {r['ms_per_token']:.3f} ms ({r['x_floor']:.2f}x floor)" for b, r in sorted(ops.items())))
PY
exit "$status"
