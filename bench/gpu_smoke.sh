#!/usr/bin/env bash
# A short check that megascope's GPU paths work on this machine, before long measurements:
# the @pytest.mark.gpu tests of the collector and trainer, then a few steps of the ~1.3B trainer and
# of the plain baseline on one GPU. Logs go to $OUT (or ./gpu-smoke).
#
#   OUT=/tmp/o bash bench/gpu_smoke.sh
set -uo pipefail
OUT=${OUT:-gpu-smoke}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
bash bench/gpu_setup.sh 2>&1 | tee "$OUT/setup.txt"
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
timeout 240 "$PY" -m pytest -m gpu -q -p no:cacheprovider -x tests/test_collector_gpu.py tests/test_trainer_gpu.py \
  >"$OUT/pytest-gpu.txt" 2>&1; echo "pytest rc=$?" | tee -a "$OUT/pytest-gpu.txt"
tail -15 "$OUT/pytest-gpu.txt"
MODEL=(--layers 24 --hidden 2048 --heads 16 --seq-len 2048 --vocab 50304)
timeout 150 "$PY" bench/gpu_baseline.py --layers 24 --hidden 2048 --heads 16 --seq 2048 --vocab 50304 --batch 8 \
  --steps 6 --warmup 2 2>&1 | tail -3 | tee "$OUT/baseline.txt"
timeout 200 "$PY" -m megascope train --nproc 1 "${MODEL[@]}" --global-batch 8 --micro-batches 1 --steps 8 \
  -o "$OUT/run-1gpu" >"$OUT/train-1gpu.txt" 2>&1; echo "train rc=$?" | tee -a "$OUT/train-1gpu.txt"
tail -5 "$OUT/train-1gpu.txt"
"$PY" - "$OUT/run-1gpu" <<'PY' 2>&1 | tee -a "$OUT/train-1gpu.txt"
import sys
from megascope.store import open_run
run = open_run(sys.argv[1]); m = run.meta
rows = run.con.execute("SELECT step, dur_ns / 1e6 FROM spans WHERE kind = 'step' AND rank = 0 ORDER BY step").fetchall()
print("step ms:", [round(ms, 1) for _, ms in rows])
med = sorted(ms for s, ms in rows if s >= 3)[len([1 for s, _ in rows if s >= 3]) // 2]
print(f"{m.device_name}: median step {med:.1f} ms, MFU {m.model_flops_per_step / (med / 1e3) / m.peak_flops_per_device:.1%}"
      f" (flops/step {m.model_flops_per_step:.3e}, peak {m.peak_flops_per_device:.3e})")
print(run.con.execute("SELECT kind, count(*), median(dur_ns)/1e6 FROM spans WHERE rank = 0 GROUP BY kind ORDER BY 1").fetchall())
PY
tar czf "$OUT/run-1gpu.tar.gz" -C "$OUT" run-1gpu && rm -rf "$OUT/run-1gpu"
