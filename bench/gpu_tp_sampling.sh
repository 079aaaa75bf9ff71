#!/usr/bin/env bash
# TP calls timed in one micro-batch a step: does report name a planted slow GPU rather than its TP
# partner, and nothing in a healthy run? The detection sweep's GPU model on tp2 x dp2 (4 GPUs),
# a straggler (SLOW rank, FACTOR, mode=time) and a healthy run, for each --tp-comm-spans in MODES.
# One line per run in $OUT/tp-sampling.txt.
#
#   OUT=/tmp/o MODES="rotate first" bash bench/gpu_tp_sampling.sh     # after bench/gpu_setup.sh
set -uo pipefail
OUT=${OUT:-gpu-tp-sampling}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 PYTHONPATH=${PYTHONPATH:-$PWD}
MODEL=(--layers 8 --hidden 2048 --heads 16 --seq-len 1024 --vocab 32000)
for mode in ${MODES:-rotate}; do
  for inject in "straggler:rank=${SLOW:-3},factor=${FACTOR:-1.15},mode=time" healthy; do
    run=/tmp/tp-sampling-run; rm -rf "$run"
    args=(); [ "$inject" != healthy ] && args=(--inject "$inject")
    timeout 120 $PY -m megascope train --nproc 4 --tp 2 --dp 2 "${MODEL[@]}" --steps 16 --collective-timeout 15 \
      --tp-comm-spans "$mode" "${args[@]}" -o "$run" >"$OUT/train-$mode.log" 2>&1
    $PY -m megascope report --json "$run" 2>>"$OUT/train-$mode.log" | $PY -c "
import json, sys
d = json.load(sys.stdin)
print('$mode', '$inject', [(s['rank'], s['cause'], round(s['slowdown'], 2)) for s in d['stragglers']])" \
      | tee -a "$OUT/tp-sampling.txt"
  done
done
