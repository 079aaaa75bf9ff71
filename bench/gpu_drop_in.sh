#!/usr/bin/env bash
# megascope dropped into a plain DDP job on NCCL (tests/jobs/ddp_job.py --cuda, 2 GPUs): DDP's
# gradient all-reduce seen without code, a planted straggler named by report, a planted hang named
# by localize (with NCCL's flight-recorder dump joined), and the step time with and without the
# interception (MEGASCOPE_INTERCEPT=1/0, alternated). Logs go to $OUT (or ./gpu-drop-in).
#
#   OUT=/tmp/o bash bench/gpu_drop_in.sh
set -uo pipefail
OUT=${OUT:-gpu-drop-in}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 PYTHONPATH=${PYTHONPATH:-$PWD}
RUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node 2 tests/jobs/ddp_job.py)
timeout 300 "${RUN[@]}" "$OUT/straggler" --cuda --steps 40 --straggler 1,3.5 >"$OUT/straggler.txt" 2>&1
"$PY" -m megascope report "$OUT/straggler" | tee "$OUT/straggler-report.txt" | head -12
timeout 300 "${RUN[@]}" "$OUT/hang" --cuda --steps 40 --hang 0,9 --timeout 30 >"$OUT/hang.txt" 2>&1
"$PY" -m megascope localize "$OUT/hang" | tee "$OUT/hang-localize.txt" | head -12
for i in 1 2 3; do
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
