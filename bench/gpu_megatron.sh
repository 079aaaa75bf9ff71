#!/usr/bin/env bash
# megascope inside a Megatron-core job on NCCL (tests/jobs/megatron_job.py: Megatron's GPTModel,
# parallel_state, pipeline schedule and DDP; megascope's four added statements). On 4 GPUs: a planted
# straggler on tp2 x pp2 named by report, a planted hang on tp2 x dp2 named by localize, and the
# job's step time with megascope off and on (MEGASCOPE_DISABLE=1), interleaved, AB_PAIRS rounds (and
# the AB_EXTRA variants in each round, below).
# On 2 GPUs the same on tp2 alone. On 1 GPU: the model spans Megatron's DDP gets (a forward and a
# backward per micro-batch, check "spans") and the timing pairs on one rank. Needs the
# megatron-core wheel (cp312) in .wheels/ (gpu_setup.sh installs it). Logs under $OUT; summary.txt has one line per check, ab.txt the timing table.
# The checks' faults: SLOW_RANK and FACTOR (the slow GPU, default the mesh's and 1.5), HUNG_RANK and
# HANG_STEP (default the mesh's and 9); "healthy" runs the straggler check's mesh with no fault;
# JOB_ARGS: more arguments of the checks' jobs (e.g. "--hidden 2048 --seq 1024": a larger model).
#
#   OUT=/tmp/o bash bench/gpu_megatron.sh
#   CHECKS="straggler" AB_PAIRS=0 OUT=/tmp/o bash bench/gpu_megatron.sh
set -uo pipefail
OUT=${OUT:-gpu-megatron}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 PYTHONPATH=${PYTHONPATH:-$PWD} TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=8000
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
TR=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU")
if [ "$NGPU" -ge 4 ]; then STRAGGLER_MESH=(--tp 2 --pp 2); AB_MESH=(--tp 2); SLOW=2; HUNG=3
elif [ "$NGPU" -ge 2 ]; then STRAGGLER_MESH=(--tp 2); AB_MESH=(--tp 2); SLOW=1; HUNG=1
else AB_MESH=(--tp 1); fi
if [ "$NGPU" -ge 2 ]; then CHECKS=${CHECKS:-straggler healthy hang}; else CHECKS=${CHECKS:-spans}; fi
if [[ " $CHECKS " == *" spans "* ]]; then  # Megatron's DDP model: forward and backward spans per micro-batch
  timeout 240 "${TR[@]}" tests/jobs/megatron_job.py "$OUT/spans" "${AB_MESH[@]}" --steps 12 >"$OUT/spans.txt" 2>&1
  echo "exit $? (spans)" >>"$OUT/spans.txt"
  "$PY" - "$OUT/spans" <<'PY' | tee -a "$OUT/summary.txt"
from megascope.store import open_run
import sys
con = open_run(sys.argv[1]).con
rows = con.execute("""SELECT kind, count(*) / count(DISTINCT step), round(median(dur_ns) / 1e6, 2)
    FROM spans WHERE kind IN ('forward', 'backward') AND step >= 2 GROUP BY kind ORDER BY kind""").fetchall()
share = con.execute("""SELECT round(sum(dur_ns) FILTER (kind IN ('forward', 'backward'))
    / sum(dur_ns) FILTER (kind = 'step'), 3) FROM spans WHERE step >= 2 AND rank = 0""").fetchone()[0]
print(f"spans: per step and median ms {[(k, n, ms) for k, n, ms in rows]}; share of the step {share}")
PY
fi
check() {  # name job-args... : run the job, then report and localize, one summary line
  local name=$1; shift
  [[ " $CHECKS " == *" $name "* ]] || return 0
  timeout 240 "${TR[@]}" tests/jobs/megatron_job.py "$OUT/$name" "$@" ${JOB_ARGS:-} >"$OUT/$name.txt" 2>&1
  echo "exit $? ($name)" >>"$OUT/$name.txt"
  pkill -9 -f "megatron_job.py $OUT/$name" 2>/dev/null  # ranks a cut-short launcher left behind
  "$PY" -m megascope report --json "$OUT/$name" >"$OUT/$name-report.json" 2>>"$OUT/$name.txt"
  "$PY" -m megascope localize "$OUT/$name" >"$OUT/$name-localize.txt" 2>&1
  "$PY" - "$OUT/$name" "$name" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
from megascope.store import open_run
run = open_run(sys.argv[1])
rep = json.load(open(sys.argv[1] + "-report.json"))
ops = run.con.execute("""SELECT g.kind || ' ' || s.op, count(*) FROM spans s
    LEFT JOIN (SELECT DISTINCT "group", kind FROM groups) g USING ("group")
    WHERE s.kind IN ('collective', 'send', 'recv') GROUP BY 1 ORDER BY 1""").fetchall()
hang = rep["hang"]
print(f"{sys.argv[2]}: mesh {rep['run']['mesh']}; calls {dict(ops)}; "
      f"stragglers {[(s['rank'], s['cause'], round(s['slowdown'], 2)) for s in rep['stragglers']]}; "
      f"hung {hang.get('hung')} suspects {[s['rank'] for s in hang.get('suspects', [])][:3]}")
PY
}
SLOW=${SLOW_RANK:-${SLOW:-0}}; HUNG=${HUNG_RANK:-${HUNG:-0}}
if [ "$NGPU" -ge 2 ]; then
  check straggler "${STRAGGLER_MESH[@]}" --steps 30 --straggler "$SLOW,${FACTOR:-1.5}"
  check healthy "${STRAGGLER_MESH[@]}" --steps 30
  check hang --tp 2 --steps 30 --hang "$HUNG,${HANG_STEP:-9}" --timeout 30
fi
# AB_EXTRA: more variants run in every round beside off and on, as NAME:VAR=VALUE[,VAR=VALUE]
# (e.g. "spans0:MEGASCOPE_MODEL_SPANS=0 host:MEGASCOPE_CLOCK=host"); the order rotates by round.
variants=("1:MEGASCOPE_DISABLE=1" "0:MEGASCOPE_DISABLE=0")
for extra in ${AB_EXTRA:-}; do variants+=("$extra"); done
for i in $(seq "${AB_PAIRS:-2}"); do
  n=${#variants[@]}
  for k in $(seq 0 $((n - 1))); do
    v=${variants[$(((k + i - 1) % n))]}
    name=${v%%:*}; envs=${v#*:}
    env ${envs//,/ } timeout 240 "${TR[@]}" tests/jobs/megatron_job.py "$OUT/ab-$i-$name" "${AB_MESH[@]}" \
      --steps 44 >"$OUT/ab-$i-$name.txt" 2>&1
  done
done
"$PY" - "$OUT" <<'PY' | tee "$OUT/ab.txt"
import re, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
def steps(path):  # steps 4-43 of rank 0's "step N ms" lines
    ms = [float(m.group(2)) for m in re.finditer(r"^step (\d+) ([\d.]+) ms$", path.read_text(), re.M)
          if 4 <= int(m.group(1)) < 44]
    return ms if len(ms) == 40 else None
def p90(xs):
    s = sorted(xs); return s[min(len(s) - 1, round(0.9 * (len(s) - 1)))]
pooled = {"on": [], "off": []}
print("| pair | off mean (median, p90) ms | on mean (median, p90) ms | on vs off, mean |")
print("|---|---|---|---|")
for f in sorted(out.glob("ab-*-1.txt")):
    i = f.stem.split("-")[1]
    off, on = steps(f), steps(out / f"ab-{i}-0.txt")
    if not off or not on:
        print(f"| {i} | incomplete | | |"); continue
    pooled["off"] += off; pooled["on"] += on
    print(f"| {i} | {statistics.fmean(off):.2f} ({statistics.median(off):.2f}, {p90(off):.2f}) | "
          f"{statistics.fmean(on):.2f} ({statistics.median(on):.2f}, {p90(on):.2f}) | "
          f"{statistics.fmean(on) / statistics.fmean(off) - 1:+.2%} |")
if pooled["off"]:
    a, b = pooled["off"], pooled["on"]
    print(f"| all | {statistics.fmean(a):.2f} ({statistics.median(a):.2f}, {p90(a):.2f}) | "
          f"{statistics.fmean(b):.2f} ({statistics.median(b):.2f}, {p90(b):.2f}) | "
          f"mean {statistics.fmean(b) / statistics.fmean(a) - 1:+.2%}, median {statistics.median(b) / statistics.median(a) - 1:+.2%}, "
          f"p90 {p90(b) / p90(a) - 1:+.2%} |")
extras = sorted({f.stem.split("-", 2)[2] for f in out.glob("ab-*-*.txt")} - {"0", "1"})
if extras and pooled["off"]:  # the AB_EXTRA variants against off, over the rounds where both are complete
    print("\n| variant | rounds | mean (median, p90) ms | vs off, mean (off over the same rounds) |")
    print("|---|---|---|---|")
    for name in ["0", *extras]:
        xs, base = [], []
        for f in sorted(out.glob(f"ab-*-{name}.txt")):
            i = f.stem.split("-")[1]
            got, off = steps(f), steps(out / f"ab-{i}-1.txt")
            if got and off:
                xs += got; base += off
        if xs:
            label = "on" if name == "0" else name
            print(f"| {label} | {len(xs) // 40} | {statistics.fmean(xs):.2f} ({statistics.median(xs):.2f}, {p90(xs):.2f}) | "
                  f"{statistics.fmean(xs) / statistics.fmean(base) - 1:+.2%} |")
PY
