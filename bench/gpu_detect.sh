#!/usr/bin/env bash
# The detection sweep on GPUs (bench/detect_sweep.py --gpu): planted slow GPUs (mode=time), host
# pauses, hangs and healthy runs of the bundled trainer on NCCL, in the sweep's seeded order, as
# many as BUDGET_S seconds allow; each run reported and scored on the machine. Back under $OUT:
# table.txt (the sweep's table), sweep.jsonl (one line per run), clock.txt (the runs' clock
# agreement) and runs.tar.gz (every run directory and its log, for rescoring elsewhere with
# --score-only).
#
# With NO_SCORE=1 the machine only runs (no report after each run: more runs fit the budget); score
# them afterwards from runs.tar.gz: `python bench/detect_sweep.py -o DIR --gpu --gpus N --seed S
# --score-only`.
#
# A run may start until BUDGET_S and last up to 300 s (a hang the backend does not end waits for the
# launcher's stall limit): the sweep is stopped, with its running job, at BUDGET_S + 330 s.
#
# SWEEP_ARGS: more arguments of the sweep, e.g. "--mesh 1x1x2 --only skew --only healthy --skews-ms 100,150".
#
# LIMIT_S: the seconds the whole command may run (the machine call's limit, setup included, counted
# from the start of the call: CALL_START, seconds since the epoch, default now). The sweep is then
# stopped in time for runs.tar.gz to be written: a call cut off by its own limit brings back
# nothing of a sweep packed only at its end.
#
#   OUT=/tmp/o SEED=83 BUDGET_S=420 bash bench/gpu_detect.sh      # after bench/gpu_setup.sh
set -uo pipefail
OUT=${OUT:-gpu-detect}
PY=${PYTHON:-python3}
SEED=${SEED:-83}
BUDGET_S=${BUDGET_S:-420}
mkdir -p "$OUT"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
GPUS=$(( NGPU >= 4 ? 4 : 2 ))
WORK=${WORK:-/tmp/gpu-detect-runs}
rm -rf "$WORK"; mkdir -p "$WORK"
# PREV: an earlier call's sweep.jsonl of the same seed; its runs are not run again.
[ -n "${PREV:-}" ] && cp "$PREV" "$WORK/sweep.jsonl"
export OMP_NUM_THREADS=1 PYTHONPATH=${PYTHONPATH:-$PWD}
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv >"$OUT/gpus.txt" 2>&1
# How the GPUs are linked: a slower link between two of them reads as a slow pair in the sweep.
nvidia-smi topo -m >>"$OUT/gpus.txt" 2>&1
STOP_S=$(( BUDGET_S + 330 ))
if [ -n "${LIMIT_S:-}" ]; then
  LEFT=$(( LIMIT_S - ($(date +%s) - ${CALL_START:-$(date +%s)}) - 30 ))
  [ "$LEFT" -lt "$STOP_S" ] && STOP_S=$LEFT
fi
timeout "$STOP_S" $PY bench/detect_sweep.py -o "$WORK" --gpu --gpus "$GPUS" --seed "$SEED" \
  --budget-s "$BUDGET_S" ${NO_SCORE:+--no-score} ${SWEEP_ARGS:-} >"$OUT/table.txt" 2>"$OUT/sweep-progress.txt"
echo "sweep exit $?" >>"$OUT/sweep-progress.txt"
cp "$WORK/sweep.jsonl" "$OUT/" 2>/dev/null
tar -czf "$OUT/runs.tar.gz" -C "$WORK" . 2>/dev/null
# Do the ranks' clocks agree (bench/clock_agreement.py)? A rank whose calls never start less than
# milliseconds after its host enqueued them reads late, and so does every analysis of it.
$PY bench/clock_agreement.py "$WORK"/*/ >"$OUT/clock.txt" 2>&1
cat "$OUT/table.txt"
