#!/usr/bin/env bash
# Where a recorded tp2 rank's host time goes: the bundled trainer's ~1.4B model on 2 GPUs (TP=2,
# collector on), and py-spy sampling rank 0's process (every thread, idle samples included) for
# PROFILE_S seconds once the steps run. Writes under $OUT: profile.txt (py-spy's collapsed stacks,
# one line per stack and thread), steps.txt (step times) and train.log.
#
#   OUT=/tmp/o PROFILE_S=15 bash bench/gpu_host_profile.sh     # after bench/gpu_setup.sh
set -uo pipefail
OUT=${OUT:-runs/gpu-host-profile}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
$PY -m megascope train --nproc 2 --tp 2 --layers 24 --hidden 2048 --heads 16 --seq-len 2048 --vocab 50304 --lr 3e-4 \
  --global-batch 16 --micro-batches 4 --steps "${STEPS:-60}" --result-json "$OUT/result.json" -o "$OUT/run" \
  > "$OUT/train.log" 2>&1 &
launcher=$!
sleep "${WARMUP_S:-40}"  # model build, NCCL set-up and the first steps
rank0=$(pgrep -P "$launcher" -f spawn_main | sort -n | head -1)
echo "launcher $launcher, rank 0 pid ${rank0:-none}"
[ -n "$rank0" ] && py-spy record --pid "$rank0" --threads --idle --rate 200 --format raw -d "${PROFILE_S:-15}" \
  -o "$OUT/profile.txt" >/dev/null 2>&1
wait "$launcher"
$PY -c "import json,sys; s=json.load(open(sys.argv[1]))['step_seconds']; print(' '.join(f'{x*1e3:.0f}' for x in s))" \
  "$OUT/result.json" > "$OUT/steps.txt" 2>&1
rm -rf "$OUT/run"
