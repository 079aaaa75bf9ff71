#!/usr/bin/env bash
# Planted hangs and freezes on real NCCL jobs: is the planted rank named first by `localize`, from
# the markers alone, from NCCL's flight recorder alone, and joined? Every 2-GPU layout (tp2, pp2,
# dp2) at both ranks and both fault kinds, at steps 3-5; with 4 GPUs also tp2 x dp2, pp2 x dp2,
# tp2 x pp2 and dp4 at two ranks each. Table in $OUT/faults.md (bench/fault_table.py).
#
#   OUT=/tmp/o bash bench/gpu_faults.sh [hang|freeze|both]
set -uo pipefail
OUT=${OUT:-gpu-faults}
PY=${PYTHON:-python3}
KINDS=${1:-both}
mkdir -p "$OUT/runs"
bash bench/gpu_setup.sh >"$OUT/setup.txt" 2>&1
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
MODEL=(--layers 8 --hidden 1024 --heads 8 --seq-len 1024 --vocab 32768 --global-batch 16 --micro-batches 4 --steps 10)
TIMEOUT=${TIMEOUT:-15}
BUDGET_S=${BUDGET_S:-420}  # no new run after this many seconds: the table and the runs still come back
# After a timeout NCCL waits for the flight-recorder dump up to this long before it aborts the
# process (60 s by default): shorter here, so that a run takes seconds, not a minute more.
export TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=${TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC:-8000}
SET=${SET:-full}
declare -a JOBS
for kind in hang freeze; do
  [[ $KINDS == both || $KINDS == "$kind" ]] || continue
  if [[ $SET == half ]]; then  # one rank per layout and kind, the other rank for the other kind
    if [[ $kind == hang ]]; then JOBS+=("tp2:2:--tp 2:$kind:0:4" "pp2:2:--pp 2:$kind:1:4" "dp2:2:--dp 2:$kind:0:3")
    else JOBS+=("tp2:2:--tp 2:$kind:1:3" "pp2:2:--pp 2:$kind:0:5" "dp2:2:--dp 2:$kind:1:5"); fi
  else
    JOBS+=("tp2:2:--tp 2:$kind:0:4" "tp2:2:--tp 2:$kind:1:3" "pp2:2:--pp 2:$kind:0:5" "pp2:2:--pp 2:$kind:1:4"
           "dp2:2:--dp 2:$kind:0:3" "dp2:2:--dp 2:$kind:1:5")
  fi
  if (( NGPU >= 4 )); then
    JOBS+=("tp2dp2:4:--tp 2 --dp 2:$kind:2:4" "tp2dp2:4:--tp 2 --dp 2:$kind:1:3"
           "pp2dp2:4:--pp 2 --dp 2:$kind:3:5" "pp2dp2:4:--pp 2 --dp 2:$kind:0:4"
           "tp2pp2:4:--tp 2 --pp 2:$kind:3:3" "tp2pp2:4:--tp 2 --pp 2:$kind:1:5"
           "dp4:4:--dp 4:$kind:2:4" "dp4:4:--dp 4:$kind:0:3")
  fi
done
T0=$(date +%s)
for job in "${JOBS[@]}"; do
  if (( $(date +%s) - T0 > BUDGET_S )); then echo "budget spent: $job not run" | tee -a "$OUT/jobs.txt"; continue; fi
  IFS=: read -r name nproc mesh kind rank step <<<"$job"
  run="$OUT/runs/$name-$kind-r$rank-s$step"
  start=$(date +%s)
  # shellcheck disable=SC2086
  timeout 150 "$PY" -m megascope train --nproc "$nproc" $mesh "${MODEL[@]}" --inject "$kind:rank=$rank,step=$step" \
    --collective-timeout "$TIMEOUT" -o "$run" >"$run.log" 2>&1
  echo "$name $kind:rank=$rank,step=$step rc=$? $(( $(date +%s) - start )) s: $(tail -c 300 "$run.log" | tr '\n' ' ')" \
    | tee -a "$OUT/jobs.txt"
done
for run in "$OUT"/runs/*/; do ls "$run/flight_recorder" "$run/stacks" 2>/dev/null | tr '\n' ' ' | sed "s|^|$(basename "$run"): |"; echo; done \
  >"$OUT/witness-files.txt"
"$PY" bench/fault_table.py "$OUT"/runs/*/ | tee "$OUT/faults.md"
"$PY" bench/fault_table.py --json "$OUT"/runs/*/ >"$OUT/faults.jsonl"
tar czf "$OUT/runs.tar.gz" -C "$OUT" runs
