#!/usr/bin/env bash
# On a GPU machine (one device is enough): set up, then what timing one collective costs the
# training thread, by who times it (bench/gpu_nccl_timing.py), and the collector's host cost per
# span by clock (bench/collector_overhead.py --span-cost-only) for comparison, and what torch's own
# per-collective duration measures (--durations). Writes under $OUT. ONLY="--only torch-kept ..."
# limits the first table.
#
#   OUT=/tmp/out bash bench/gpu_nccl_timing.sh
set -uo pipefail
OUT=${OUT:-/tmp/megascope-gpu-out}
mkdir -p "$OUT"
bash bench/gpu_setup.sh > "$OUT/setup.txt" 2>&1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
lscpu | grep -E "Model name|^CPU\(s\)" >> "$OUT/gpu.txt"
python3 bench/gpu_nccl_timing.py --rounds "${ROUNDS:-3}" ${ONLY:-} > "$OUT/nccl_timing.txt" 2>&1
python3 bench/gpu_nccl_timing.py --durations > "$OUT/nccl_durations.txt" 2>&1
python3 bench/collector_overhead.py --gpu-only --span-cost-only --repeats 7 > "$OUT/span_cost.txt" 2>&1
cat "$OUT/setup.txt" "$OUT/gpu.txt" "$OUT/nccl_timing.txt" "$OUT/nccl_durations.txt"
tail -25 "$OUT/span_cost.txt"
