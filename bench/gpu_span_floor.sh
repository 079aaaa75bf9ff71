#!/usr/bin/env bash
# The floor under the collector's 1 us-a-span target, on one GPU, in one call: what the CUDA
# driver's event record costs the calling thread from C (bench/gpu_event_floor.c, built here with
# the machine's C compiler), the same call and torch's from Python (bench/gpu_span_floor.py), and
# the collector's own empty span by clock (bench/collector_overhead.py --span-cost-only). Writes
# under $OUT: floor.txt.
#
#   OUT=/tmp/o bash bench/gpu_span_floor.sh
set -uo pipefail
OUT=${OUT:-runs/gpu-span-floor}
PY=${PYTHON:-python3}
N=${N:-200000}
mkdir -p "$OUT"
{
  echo "$(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
  echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  echo
  echo "## C: the driver's calls alone"
  bin=$(mktemp -d)/event_floor
  if ${CC:-cc} -O2 -o "$bin" bench/gpu_event_floor.c -ldl 2>&1; then "$bin" "$N"; else echo "no C compiler: skipped"; fi
  echo
  echo "## Python: the calls a span makes"
  $PY bench/gpu_span_floor.py --n "$N"
  echo
  echo "## The collector's empty span"
  bash bench/gpu_setup.sh >/dev/null 2>&1
  OUT=$OUT $PY bench/collector_overhead.py --gpu-only --span-cost-only --n 50000 --repeats 5 2>&1 | tail -12
} 2>&1 | tee "$OUT/floor.txt"
