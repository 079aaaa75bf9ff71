#!/usr/bin/env bash
# Where each thread of every rank sits while a peer hangs, on NCCL: plants a hang on a 2-GPU job,
# then, while the job is stuck and before NCCL's timeout fires, dumps every rank's threads with
# py-spy (Python and native frames) and counts what each rank's trail has on disk.
#
#   OUT=/tmp/o bash bench/gpu_hang_probe.sh [LAYOUT...]     # LAYOUT: dp2 | tp2 | pp2 (default dp2 tp2)
set -uo pipefail
OUT=${OUT:-gpu-hang-probe}
PY=${PYTHON:-python3}
export PATH="$("$PY" -c "import sysconfig; print(sysconfig.get_path('scripts'))"):$PATH"
mkdir -p "$OUT"
bash bench/gpu_setup.sh >"$OUT/setup.txt" 2>&1
MODEL=(--layers 8 --hidden 1024 --heads 8 --seq-len 1024 --vocab 32768 --global-batch 16 --micro-batches 4 --steps 14)
declare -A MESH=([dp2]="--tp 1 --pp 1 --dp 2" [tp2]="--tp 2 --pp 1 --dp 1" [pp2]="--tp 1 --pp 2 --dp 1")
declare -A FAULT=([dp2]="hang:rank=1,step=6" [tp2]="hang:rank=0,step=4" [pp2]="hang:rank=1,step=5")
trail() {  # per rank: the highest step of its markers and spans on disk now
  "$PY" - "$1" <<'PY'
import sys, glob, pyarrow.parquet as pq
run = sys.argv[1]
for table in ("markers", "spans"):
    out = {}
    for part in glob.glob(f"{run}/{table}/rank=*/part-*.parquet"):
        r = int(part.split("rank=")[1].split("/")[0])
        steps = [s for s in pq.read_table(part, columns=["step"]).column("step").to_pylist() if s is not None]
        out[r] = max(out.get(r, -1), max(steps, default=-1))
    print(f"  {table}: max step on disk per rank {dict(sorted(out.items()))}")
PY
}
for layout in "${@:-dp2 tp2}"; do
  run="$OUT/run-$layout"; log="$OUT/train-$layout.txt"
  echo "== $layout ${FAULT[$layout]}" | tee -a "$OUT/probe.txt"
  # shellcheck disable=SC2086
  "$PY" -m megascope train --nproc 2 ${MESH[$layout]} "${MODEL[@]}" --inject "${FAULT[$layout]}" \
    --collective-timeout 60 -o "$run" >"$log" 2>&1 &
  pid=$!
  for t in 30 45; do
    sleep $(( t == 30 ? 30 : 15 ))
    echo "-- t=${t}s" | tee -a "$OUT/probe.txt"
    trail "$run" | tee -a "$OUT/probe.txt"
    for p in $(pgrep -f spawn_main); do
      echo "---- pid $p" >>"$OUT/stacks-$layout-$t.txt"
      timeout 20 py-spy dump --native --pid "$p" >>"$OUT/stacks-$layout-$t.txt" 2>&1
    done
  done
  kill -9 $(pgrep -f spawn_main) 2>/dev/null; kill $pid 2>/dev/null; wait $pid 2>/dev/null
  trail "$run" | sed 's/^/after kill /' | tee -a "$OUT/probe.txt"
  tar czf "$OUT/run-$layout.tar.gz" -C "$OUT" "run-$layout" && rm -rf "$run"
done
