#!/usr/bin/env bash
# What the collector costs on GPUs, in one call: set up, run the GPU tests, time the collector's host
# cost per span and its writer's stall on a stand-in training thread, then the in-process A/B of
# the bundled trainer (bench/gpu_trainer.sh PARTS=ab) for AB_LAYOUTS. Writes under $OUT:
# tests.txt (setup and tests), span_cost.txt (+ collector_overhead.json), and the trainer's
# table.txt and trainer-runs.tar.gz.
#
#   OUT=/tmp/o AB_LAYOUTS="tp" REPEATS=2 bash bench/gpu_collector_cost.sh
#   TESTS=0 SPANS=0 OUT=/tmp/o AB_LAYOUTS="1gpu pp dp" bash bench/gpu_collector_cost.sh
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
OUT=$OUT PARTS=ab STEPS=${STEPS:-42} REPEATS=${REPEATS:-2} AB_LAYOUTS=${AB_LAYOUTS:-1gpu tp pp dp} \
  bash bench/gpu_trainer.sh
