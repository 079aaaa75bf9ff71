#!/usr/bin/env bash
# Do ranks fall behind their devices because of where they run? One call: the machine's CPU and
# GPU topology and how far its CPUs differ in speed (bench/smt_probe.py); then healthy runs of the
# detection sweep's GPU model (tp2 x dp2 on 4 GPUs, tp2 on 2) with the ranks unbound and each on
# its own slice of its GPU's NUMA node (`--cpu-bind none|slice`; on a machine of one NUMA node the
# default, `node`, changes nothing), interleaved over ROUNDS rounds. For each run: the processes'
# affinity and the cores their threads ran on (sampled once the steps run), the share of CPU time
# the hypervisor stole, the step times, and from `megascope report --json` the stragglers named and
# each rank's share of calls at which its device waited for its host. Then, when WHOLE_REPEATS > 0,
# the collector's cost as whole runs of the ~1.4B model (bench/gpu_trainer.sh PARTS=whole) with
# WHOLE_VARIANTS (e.g. "default slice:MEGASCOPE_CPU_BIND=slice"). Everything under $OUT
# (affinity.txt, runs.tar.gz, whole.txt).
#
#   OUT=/tmp/o ROUNDS=2 WHOLE_REPEATS=3 WHOLE_LAYOUTS=tpdp bash bench/gpu_affinity.sh   # after gpu_setup.sh
set -uo pipefail
OUT=${OUT:-gpu-affinity}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
R="$OUT/affinity.txt"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 4 ]; then MESH=(--nproc 4 --tp 2 --dp 2); else MESH=(--nproc 2 --tp 2); fi
WORK=${WORK:-/tmp/gpu-affinity-runs}
rm -rf "$WORK"; mkdir -p "$WORK"
{
  echo "== machine ($(date -u +%FT%TZ))"
  nproc; cat /sys/fs/cgroup/cpuset.cpus.effective 2>/dev/null
  lscpu | grep -E "^(CPU\(s\)|Model name|Socket|NUMA|Thread|Core)"
  nvidia-smi topo -m 2>&1 | head -12
  $PY - <<'PY'
import torch
from megascope.trainer.affinity import describe, device_cores, pci_address
for i in range(torch.cuda.device_count()):
    a = pci_address(torch.cuda.get_device_properties(i))
    print(f"cuda:{i} {a} local cores {describe(device_cores(a))}")
PY
  uptime
  # How far the machine's CPUs differ in speed and slow each other (a rank's host runs as fast as
  # the CPU its launching thread lands on).
  $PY bench/smt_probe.py --seconds 0.25
} >"$R" 2>&1

node_of() {  # core -> NUMA node
  local c=$1 n
  for n in /sys/devices/system/node/node*; do
    [ -e "$n/cpu$c" ] && { basename "$n" | tr -dc 0-9; return; }
  done
  echo "?"
}

descendants() {  # pid -> every process below it
  local c
  for c in $(pgrep -P "$1"); do echo "$c"; descendants "$c"; done
}

steal() {  # the machine's CPU ticks: total and stolen by the hypervisor (/proc/stat)
  awk '/^cpu /{t = 0; for (i = 2; i <= NF; i++) t += $i; print t, $9}' /proc/stat
}

run() {  # name bind
  local name=$1 bind=$2 dir="$WORK/$1"
  local s0; s0=$(steal)
  MEGASCOPE_CPU_BIND=$bind timeout 300 $PY -m megascope train "${MESH[@]}" --layers 8 --hidden 2048 --heads 16 \
    --seq-len 1024 --vocab 32000 --steps "${STEPS:-40}" --result-json "$dir.json" -o "$dir" >"$dir.log" 2>&1 &
  local launcher=$!
  sleep "${WARMUP_S:-30}"
  {
    echo "== $name (cpu-bind $bind): threads per NUMA node of the core they last ran on"
    for p in $(descendants "$launcher"); do
      local nodes
      nodes=$(ps -L -o psr= -p "$p" 2>/dev/null | while read -r c; do node_of "$c"; done | sort | uniq -c | tr '\n' ' ')
      echo "  pid $p $(tr -d '\0' </proc/"$p"/cmdline 2>/dev/null | tail -c 60) affinity" \
        "$(taskset -cp "$p" 2>/dev/null | awk -F': ' '{print $2}'), threads by node: $nodes," \
        "cores now: $(ps -L -o psr= -p "$p" 2>/dev/null | sort -n | uniq | tr '\n' ' ')"
    done
  } >>"$R"
  wait "$launcher"; echo "  exit $?" >>"$R"
  echo "  $(steal) $s0" | awk '{printf "  CPU time stolen by the hypervisor during the run: %.2f%%\n", 100 * ($2 - $4) / ($1 - $3)}' >>"$R"
  $PY -m megascope report "$dir" --json >"$dir.report.json" 2>>"$R"
  $PY - "$dir.json" "$dir.report.json" >>"$R" 2>&1 <<'PY'
import json, statistics, sys
steps = [s * 1e3 for s in json.load(open(sys.argv[1]))["step_seconds"][5:]]
steps.sort()
print(f"  steps 5+: mean {statistics.fmean(steps):.1f} ms, median {statistics.median(steps):.1f}, "
      f"p90 {steps[int(0.9 * (len(steps) - 1))]:.1f}")
rep = json.load(open(sys.argv[2]))
print("  stragglers:", [(s.get("rank"), s.get("cause"), round(s.get("slowdown") or 0, 3)) for s in rep.get("stragglers", [])])
for r in sorted(rep.get("host_lead", {}).get("ranks", []), key=lambda r: r["rank"]):
    print(f"  rank {r['rank']}: device waited for the host at {r['starved_frac']:.1%} of {r['calls']} calls, "
          f"lead p10 {r['lead_p10_ns'] / 1e6:.1f} ms, p50 {r['lead_p50_ns'] / 1e6:.1f} ms")
PY
}

for r in $(seq "${ROUNDS:-2}"); do
  if [ $((r % 2)) = 1 ]; then run "none-r$r" none; run "slice-r$r" slice; else run "slice-r$r" slice; run "none-r$r" none; fi
done
tar -czf "$OUT/runs.tar.gz" -C "$WORK" . 2>/dev/null
if [ "${WHOLE_REPEATS:-0}" -gt 0 ]; then
  s0=$(steal)
  OUT=$OUT PARTS=whole STEPS=24 REPEATS=$WHOLE_REPEATS WHOLE_LAYOUTS=${WHOLE_LAYOUTS:-tpdp} \
    WHOLE_VARIANTS=${WHOLE_VARIANTS:-default} BUDGET_S=${WHOLE_BUDGET_S:-100000} bash bench/gpu_trainer.sh >"$OUT/whole-log.txt" 2>&1
  echo "$(steal) $s0" | awk '{printf "CPU time stolen by the hypervisor during the whole runs: %.2f%%\n", 100 * ($2 - $4) / ($1 - $3)}' >>"$OUT/whole.txt"
fi
cat "$R"
cat "$OUT/whole.txt" 2>/dev/null
