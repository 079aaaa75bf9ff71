#!/usr/bin/env bash
# A planted hang on a pp2 x dp2 NCCL job (4 GPUs) whose NCCL abort may block: does the local
# launcher end it? Runs `megascope train` with the detection sweep's GPU model and a 15 s
# collective timeout, and at CHECK_S seconds records every process of the job (state, kernel wait
# channel, age) and py-spy dumps of the launcher and each live rank; the job is killed at KILL_S.
# Under $OUT: hang-stall.txt.
#
#   OUT=/tmp/o CHECK_S=190 KILL_S=230 bash bench/gpu_hang_stall.sh     # after bench/gpu_setup.sh
set -uo pipefail
OUT=${OUT:-gpu-hang-stall}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
R="$OUT/hang-stall.txt"
export OMP_NUM_THREADS=1 PYTHONPATH=${PYTHONPATH:-$PWD}
start=$(date +%s)
setsid $PY -m megascope train --nproc 4 --pp 2 --dp 2 --layers 8 --hidden 2048 --heads 16 --seq-len 1024 \
  --vocab 32000 --steps 16 --collective-timeout 15 --inject hang:rank=1,step=8 -o /tmp/hang-stall-run \
  >"$OUT/train.log" 2>&1 &
launcher=$!
ended=""
for _ in $(seq 1 "${CHECK_S:-190}"); do
  sleep 1
  if ! kill -0 "$launcher" 2>/dev/null; then ended=1; break; fi
done
{
  if [ -n "$ended" ]; then wait "$launcher"; echo "launcher exited with $? after $(( $(date +%s) - start )) s"
  else
    echo "launcher still running after $(( $(date +%s) - start )) s"
    ps -eo pid,ppid,stat,wchan:32,etimes,pcpu,args --forest | grep -v " ps -eo" | grep -E "python|megascope|spawn" | cut -c1-200
    for p in $launcher $(pgrep -P "$launcher"); do echo "== py-spy dump $p"; py-spy dump --pid "$p" 2>&1 | head -40; done
  fi
  echo "== train.log"; tail -20 "$OUT/train.log"
} >"$R" 2>&1
if [ -z "$ended" ]; then
  while kill -0 "$launcher" 2>/dev/null && [ $(( $(date +%s) - start )) -lt "${KILL_S:-230}" ]; do sleep 2; done
  kill -0 "$launcher" 2>/dev/null && { echo "killed at $(( $(date +%s) - start )) s" >>"$R"; kill -9 -- -"$launcher"; }
  echo "== train.log at the end" >>"$R"; tail -5 "$OUT/train.log" >>"$R"
fi
$PY -m megascope localize /tmp/hang-stall-run >>"$R" 2>&1
rm -rf /tmp/hang-stall-run
cat "$R"
