#!/usr/bin/env bash
# Detection on users' own jobs on GPUs: DDP, FSDP1 and FSDP2 training scripts on NCCL (WRAPS), one
# fault planted per job (a slow GPU, a paused host, or nothing), recorded with megascope's
# collector as docs/collector.md shows, then `megascope report`: is the planted rank named first,
# with the right cause, and nothing named in healthy jobs? (bench/ddp_sweep.py --device cuda; the
# model and faults are described there.)
#
# Back under $OUT: <wrap>.txt (each job's line and the table), <wrap>.jsonl (one row per job) and
# runs.tar.gz (the run directories, to score again elsewhere with `megascope report`).
#
#   OUT=/tmp/o SEED=7 BUDGET_S=240 WRAPS="ddp fsdp2" bash bench/gpu_jobs_sweep.sh   # after bench/gpu_setup.sh
set -uo pipefail
OUT=${OUT:-gpu-jobs}
PY=${PYTHON:-python3}
SEED=${SEED:-7}
BUDGET_S=${BUDGET_S:-240}          # per wrap: no job starts after it
WRAPS=${WRAPS:-"ddp fsdp2"}
FACTORS=${FACTORS:-1.15,1.3,1.5}
PAUSES=${PAUSES:-50,100}
HEALTHY=${HEALTHY:-3}
EACH=${EACH:-2}
ACTIVE=${ACTIVE:-20}
mkdir -p "$OUT"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
WORLDS=$($PY -c "print(','.join(str(w) for w in range(2, min($NGPU, 4) + 1)))")
WORK=${WORK:-/tmp/gpu-jobs-runs}
rm -rf "$WORK"; mkdir -p "$WORK"
export OMP_NUM_THREADS=1 PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv >"$OUT/gpus.txt" 2>&1
i=0
for wrap in $WRAPS; do
  timeout $(( BUDGET_S + 240 )) $PY bench/ddp_sweep.py -o "$WORK/$wrap" --device cuda --record collector \
    --wrap "$wrap" --seed $(( SEED + i )) --worlds "$WORLDS" --factors "$FACTORS" --pause-ms "$PAUSES" \
    --healthy "$HEALTHY" --each "$EACH" --active "$ACTIVE" --timeout-s 180 --budget-s "$BUDGET_S" --keep \
    >"$OUT/$wrap.txt" 2>&1
  echo "exit $?" >>"$OUT/$wrap.txt"
  cp "$WORK/$wrap/results.jsonl" "$OUT/$wrap.jsonl" 2>/dev/null
  find "$WORK/$wrap" -maxdepth 2 -name init -exec rm -rf {} + 2>/dev/null
  i=$(( i + 1 ))
done
tar -czf "$OUT/runs.tar.gz" -C "$WORK" . 2>/dev/null
for wrap in $WRAPS; do echo "== $wrap"; tail -12 "$OUT/$wrap.txt"; done
