#!/usr/bin/env bash
# Bundled trainer on 1-2 GPUs against the plain PyTorch baseline (bench/gpu_baseline.py), same shape:
# a ~1.3B GPT (24 layers, hidden 2048, 16 heads, sequence 2048, vocabulary 50304), bf16 autocast.
# Prints the baseline's JSON line, then per trainer layout the median step time and MFU from the
# run directory (model FLOPs per step / step time / GPUs / peak, as run.json defines them).
#
#   bash bench/gpu_trainer.sh [OUT_DIR]          # needs torch with CUDA; 1 GPU minimum
set -euo pipefail
OUT=${1:-runs/gpu-bench}
PY=${PYTHON:-python3}
STEPS=${STEPS:-20}
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
MODEL=(--layers 24 --hidden 2048 --heads 16 --seq-len 2048 --vocab 50304)
mkdir -p "$OUT"

echo "== baseline (plain PyTorch, 1 GPU, batch 8)"
$PY bench/gpu_baseline.py --layers 24 --hidden 2048 --heads 16 --seq 2048 --vocab 50304 --batch 8 --steps "$STEPS"

summarize() {
  $PY - "$1" "$2" <<'PY'
import sys
from megascope.store import open_run
run = open_run(sys.argv[1]); gpus = int(sys.argv[2])
med = run.con.execute("SELECT median(dur_ns) FROM spans WHERE kind = 'step' AND rank = 0 AND step >= 3").fetchone()[0]
m = run.meta
mfu = m.model_flops_per_step / (med / 1e9) / gpus / m.peak_flops_per_device if m.peak_flops_per_device else float("nan")
print(f"{sys.argv[1]}: {m.device_name}, step {med / 1e6:.1f} ms, {m.tokens_per_step / (med / 1e9):,.0f} tokens/s, MFU {mfu:.1%}")
PY
}

echo "== trainer, 1 GPU (global batch 8, 1 micro-batch)"
$PY -m megascope train --nproc 1 "${MODEL[@]}" --global-batch 8 --micro-batches 1 --steps "$STEPS" -o "$OUT/t1p1d1"
summarize "$OUT/t1p1d1" 1

echo "== trainer, 1 GPU, collector off"
MEGASCOPE_DISABLE=1 $PY -m megascope train --nproc 1 "${MODEL[@]}" --global-batch 8 --micro-batches 1 \
  --steps "$STEPS" -o "$OUT/t1p1d1-off"

if [ "$NGPU" -ge 2 ]; then
  for layout in "--tp 2" "--pp 2" "--dp 2"; do
    name=$(echo "$layout" | tr -d ' -')
    echo "== trainer, 2 GPUs, $layout"
    $PY -m megascope train --nproc 2 $layout "${MODEL[@]}" --global-batch 16 --micro-batches 4 \
      --steps "$STEPS" -o "$OUT/$name"
    summarize "$OUT/$name" 2
  done
fi
