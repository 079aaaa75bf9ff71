#!/usr/bin/env bash
# megascope dropped into other people's jobs on NCCL, 2 GPUs: a plain DDP job (tests/jobs/ddp_job.py
# --cuda) and an FSDP2 job (tests/jobs/fsdp_tp_job.py --cuda, dp2 with --tp 1, and FSDP2 + TP on a
# 1x2 mesh with --tp 2). Their collectives seen without code, a planted straggler named by report,
# a planted hang named by localize (with NCCL's flight-recorder dump joined), and the DDP step time
# with and without the interception (MEGASCOPE_INTERCEPT=1/0, alternated). Logs go to $OUT (or
# ./gpu-drop-in); summary.txt has one line per check.
#
#   OUT=/tmp/o bash bench/gpu_drop_in.sh
#   CHECKS="ddp-hang fsdp-hang" TESTS=0 AB_PAIRS=0 OUT=/tmp/o bash bench/gpu_drop_in.sh   # two checks only
set -uo pipefail
OUT=${OUT:-gpu-drop-in}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 PYTHONPATH=${PYTHONPATH:-$PWD} TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=8000
# The GPU tests of the drop-in path first (DDP straggler and hang, FSDP2 + TP straggler, on NCCL).
[ "${TESTS:-1}" = 1 ] && "$PY" -m pytest -m gpu -p no:cacheprovider -q tests/test_drop_in.py 2>&1 | tail -15 | tee "$OUT/tests.txt"
TR=("$PY" -m torch.distributed.run --standalone --nproc-per-node 2)
RUN=("${TR[@]}" tests/jobs/ddp_job.py)
CHECKS=${CHECKS:-ddp-straggler ddp-hang fsdp-straggler fsdp-hang fsdp-tp-straggler}  # which checks to run
check() {  # name job-args... : run the job, then report (straggler) or localize (hang), one summary line
  local name=$1; shift
  [[ " $CHECKS " == *" $name "* ]] || return 0
  timeout 200 "${TR[@]}" "$@" "$OUT/$name" --cuda >"$OUT/$name.txt" 2>&1
  "$PY" -m megascope report --json "$OUT/$name" >"$OUT/$name-report.json" 2>>"$OUT/$name.txt"
  "$PY" -m megascope localize "$OUT/$name" >"$OUT/$name-localize.txt" 2>&1
  "$PY" - "$OUT/$name" "$name" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
from megascope.store import open_run
run = open_run(sys.argv[1])
rep = json.load(open(sys.argv[1] + "-report.json"))
ops = run.con.execute("SELECT op, count(*) FROM spans WHERE kind = 'collective' GROUP BY 1 ORDER BY 1").fetchall()
hang = rep["hang"]
print(f"{sys.argv[2]}: collectives {dict(ops)}; stragglers {[(s['rank'], s['cause'], round(s['slowdown'], 2)) for s in rep['stragglers']]}; "
      f"hung {hang.get('hung')} suspects {[s['rank'] for s in hang.get('suspects', [])][:3]}")
PY
}
check ddp-straggler tests/jobs/ddp_job.py --steps 40 --straggler 1,3.5
check ddp-hang tests/jobs/ddp_job.py --steps 40 --hang 0,9 --timeout 20
check fsdp-straggler tests/jobs/fsdp_tp_job.py --tp 1 --steps 40 --straggler 0,3
check fsdp-hang tests/jobs/fsdp_tp_job.py --tp 1 --steps 40 --hang 1,9 --timeout 20
check fsdp-tp-straggler tests/jobs/fsdp_tp_job.py --tp 2 --steps 40 --straggler 1,3
for i in $(seq "${AB_PAIRS:-3}"); do
  for flag in 1 0; do
    MEGASCOPE_INTERCEPT=$flag timeout 300 "${RUN[@]}" "$OUT/ab-$i-$flag" --cuda --steps 60 >/dev/null 2>&1
    "$PY" - "$OUT/ab-$i-$flag" "$flag" <<'PY' | tee -a "$OUT/ab.txt"
import sys
from megascope.store import open_run
ms = open_run(sys.argv[1]).con.execute("SELECT median(dur_ns) / 1e6 FROM spans WHERE kind = 'step' AND step >= 5").fetchone()[0]
print(f"intercept={sys.argv[2]} median step {ms:.3f} ms")
PY
  done
done
