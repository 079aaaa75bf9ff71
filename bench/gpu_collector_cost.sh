#!/usr/bin/env bash
# What the collector costs on GPUs, in one call: set up, run the GPU tests, time the collector's host
# cost per span and its writer's stall on a stand-in training thread, then the bundled trainer's
# ~1.4B model as a user compares it: whole runs with the collector off and on, interleaved
# (bench/gpu_trainer.sh PARTS=whole, WHOLE_LAYOUTS, REPEATS rounds, steps 4-23 counted), and beside
# them the in-process A/B (PARTS=ab, AB_LAYOUTS, one run each). Writes under $OUT: tests.txt (setup
# and tests), span_cost.txt (+ collector_overhead.json), whole.txt, and the trainer's table.txt and
# trainer-runs.tar.gz.
#
#   OUT=/tmp/o WHOLE_LAYOUTS="tp dp" AB_LAYOUTS="tp dp" REPEATS=3 bash bench/gpu_collector_cost.sh
#   TESTS=0 SPANS=0 OUT=/tmp/o WHOLE_LAYOUTS="1gpu pp" AB_LAYOUTS="1gpu pp" bash bench/gpu_collector_cost.sh
set -uo pipefail
OUT=${OUT:-runs/gpu-collector-cost}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
bash bench/gpu_setup.sh 2>&1 | tee "$OUT/tests.txt"
if [ "${TESTS:-1}" = 1 ]; then
  # The GPU tests only: the others import dash, plotly and perfetto, which the GPU image lacks.
  $PY -m pytest -m gpu -p no:cacheprovider -q tests/test_collector_gpu.py tests/test_trainer_gpu.py 2>&1 | tail -15 | tee -a "$OUT/tests.txt"
fi
if [ "${SPANS:-1}" = 1 ]; then
  OUT=$OUT $PY bench/collector_overhead.py --gpu-only --span-cost-only --n 50000 --repeats 5 2>&1 \
    | tee "$OUT/span_cost.txt"
fi
# Whole runs: 24 steps, the window (steps 4-23). The A/B needs more steps for its blocks.
OUT=$OUT PARTS=whole STEPS=${STEPS:-24} REPEATS=${REPEATS:-3} WHOLE_LAYOUTS=${WHOLE_LAYOUTS:-1gpu tp pp dp} \
  bash bench/gpu_trainer.sh
mv "$OUT/table.txt" "$OUT/table-whole.txt"; mv "$OUT/trainer-runs.tar.gz" "$OUT/trainer-runs-whole.tar.gz"
if [ -n "${AB_LAYOUTS:-}" ]; then
  OUT=$OUT PARTS=ab STEPS=${AB_STEPS:-36} REPEATS=1 AB_LAYOUTS=$AB_LAYOUTS ABVARIANTS="" bash bench/gpu_trainer.sh
fi
