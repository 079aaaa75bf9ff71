#!/usr/bin/env bash
# Why one rank's host falls behind its device on some GPU runs while its peers' do not: the machine's
# CPU limits and topology, then a healthy run of the detection sweep's GPU model (tp2 x dp2 on 4
# GPUs, tp2 on 2) with, once the steps run, each process's CPU use over SAMPLE_S seconds (ranks,
# their data workers and marker agents), its CPU affinity, and a py-spy dump of every rank. Then
# megascope's host-lead view of the same run. Everything under $OUT/hostcheck.txt.
#
#   OUT=/tmp/o bash bench/gpu_host_check.sh      # after bench/gpu_setup.sh
set -uo pipefail
OUT=${OUT:-gpu-host-check}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
R="$OUT/hostcheck.txt"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 4 ]; then MESH=(--nproc 4 --tp 2 --dp 2); else MESH=(--nproc 2 --tp 2); fi
{
  echo "== machine"; nproc; cat /sys/fs/cgroup/cpu.max 2>/dev/null; lscpu | grep -E "^(CPU\(s\)|Model name|NUMA|Thread|Core)" 
  nvidia-smi topo -m 2>&1 | head -12
  uptime
} >"$R" 2>&1
$PY -m megascope train "${MESH[@]}" --layers 8 --hidden 2048 --heads 16 --seq-len 1024 --vocab 32000 \
  --steps "${STEPS:-60}" -o /tmp/hostcheck-run >"$OUT/train.log" 2>&1 &
launcher=$!
sleep "${WARMUP_S:-35}"
pids=$(pgrep -P "$launcher"; for p in $(pgrep -P "$launcher"); do pgrep -P "$p"; done)
# CPU ticks of every thread of a process (a rank's leader thread can read as a zombie while its
# other threads run, and then its own stat counts nothing).
ticks() { cat /proc/"$1"/task/*/stat 2>/dev/null | awk '{s += $14 + $15} END {print s + 0}'; }
declare -A t0
for p in $pids; do t0[$p]=$(ticks "$p"); done
top -b -n 1 -w 200 | head -25 >>"$R"
sleep "${SAMPLE_S:-10}"
hz=$(getconf CLK_TCK)
{
  echo "== CPU use over ${SAMPLE_S:-10} s (cores), affinity, name"
  for p in $pids; do
    t1=$(ticks "$p")
    echo "$p $(awk -v a="${t0[$p]}" -v b="$t1" -v hz="$hz" -v s="${SAMPLE_S:-10}" 'BEGIN{printf "%.2f", (b-a)/hz/s}') \
      $(taskset -cp "$p" 2>/dev/null | awk -F: '{print $2}') $(cat /proc/"$p"/comm 2>/dev/null) \
      threads=$(ls /proc/$p/task 2>/dev/null | wc -l)"
  done
  for p in $(pgrep -P "$launcher"); do echo "== py-spy dump $p"; py-spy dump --pid "$p" 2>&1 | head -60; done
} >>"$R" 2>&1
wait "$launcher"; echo "train exit $?" >>"$R"
$PY -m megascope report /tmp/hostcheck-run >>"$R" 2>&1
rm -rf /tmp/hostcheck-run
cat "$R" | tail -80
