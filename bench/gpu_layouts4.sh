#!/usr/bin/env bash
# The 2-D layouts of the bundled trainer on 4 GPUs (TPxPP, TPxDP, PPxDP), collector on and off, and
# one planted fault of each kind on a TPxPP run, so that megascope's analyses can be checked on real
# NCCL runs. Run directories and logs are archived to $OUT/layouts4.tar.gz; analyse them with
# `megascope report` / `megascope localize` anywhere.
#
#   OUT=/tmp/o bash bench/gpu_layouts4.sh      # needs 4 GPUs; run gpu_setup.sh first
set -uo pipefail
OUT=${OUT:-runs/gpu-layouts4}
PY=${PYTHON:-python3}
STEPS=${STEPS:-15}
WORK=$(mktemp -d)
RUNS="$WORK/layouts4"
mkdir -p "$RUNS" "$OUT"
BIG=(--layers 24 --hidden 2048 --heads 16 --seq-len 2048 --vocab 50304 --global-batch 16 --micro-batches 4 --lr 3e-4)
SMALL=(--layers 8 --hidden 1024 --heads 8 --seq-len 1024 --vocab 32768 --global-batch 16 --micro-batches 4)

train() {  # name mode args...
  local name=$1 mode=$2; shift 2
  local env=(); [ "$mode" = off ] && env=(MEGASCOPE_DISABLE=1)
  echo "== $name (collector $mode)"
  env "${env[@]}" timeout 240 $PY -m megascope train --nproc 4 "$@" --result-json "$RUNS/$name-r1-$mode.json" \
    -o "$RUNS/$name-r1-$mode" > "$RUNS/$name-$mode.log" 2>&1; echo "rc=$?"; tail -2 "$RUNS/$name-$mode.log"
}

for layout in "--tp 2 --pp 2" "--tp 2 --dp 2" "--pp 2 --dp 2"; do
  name=4gpu-$(echo "$layout" | tr -d ' -')
  train "$name" on $layout "${BIG[@]}" --steps "$STEPS"
  train "$name" off $layout "${BIG[@]}" --steps "$STEPS"
done
# Faults, small model, TP=2 x PP=2 (ranks: pp-major, tp fastest).
train fault-straggler on --tp 2 --pp 2 "${SMALL[@]}" --steps 12 --inject straggler:rank=2,factor=1.5
train fault-skew on --tp 2 --dp 2 "${SMALL[@]}" --steps 12 --inject skew:rank=1,ms=80
train fault-hang on --tp 2 --pp 2 "${SMALL[@]}" --steps 12 --inject hang:rank=3,step=6 --collective-timeout 20
echo '{}' > "$WORK/none.json"
$PY bench/gpu_trainer_table.py "$RUNS" "$WORK/none.json" | tee "$OUT/layouts4-table.txt"
tar czf "$OUT/layouts4.tar.gz" -C "$WORK" layouts4
ls -la "$OUT"
