#!/usr/bin/env bash
# Bundled trainer on 1-2 GPUs against the plain PyTorch baseline (bench/gpu_baseline.py), same shape:
# a ~1.3B GPT (24 layers, hidden 2048, 16 heads, sequence 2048, vocabulary 50304), bf16 autocast.
# Every trainer layout runs with the collector on and off (MEGASCOPE_DISABLE=1), interleaved and
# repeated; the table at the end gives median step time, tokens/s and MFU (run.json's FLOPs / step
# time / GPUs / peak) per layout and the collector's step-time overhead.
#
#   OUT=/tmp/o bash bench/gpu_trainer.sh        # needs torch with CUDA (1 GPU minimum); run gpu_setup.sh first
set -uo pipefail
OUT=${OUT:-runs/gpu-bench}
PY=${PYTHON:-python3}
STEPS=${STEPS:-20}
REPEATS=${REPEATS:-2}
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
MODEL=(--layers 24 --hidden 2048 --heads 16 --seq-len 2048 --vocab 50304 --lr 3e-4)
RUNS="$OUT/runs"
mkdir -p "$RUNS"

echo "== baseline (plain PyTorch, 1 GPU, batch 8)"
CUDA_VISIBLE_DEVICES=0 $PY bench/gpu_baseline.py --layers 24 --hidden 2048 --heads 16 --seq 2048 --vocab 50304 \
  --batch 8 --steps "$STEPS" | tee "$OUT/baseline.json"

train() {  # name gpus collector(on|off) extra-args...
  local name=$1 gpus=$2 mode=$3; shift 3
  local env=(); [ "$mode" = off ] && env=(MEGASCOPE_DISABLE=1)
  local devices; devices=$(seq -s, 0 $((gpus - 1)))
  echo "== $name ($gpus GPU, collector $mode)"
  env "${env[@]}" CUDA_VISIBLE_DEVICES="$devices" timeout 300 $PY -m megascope train --nproc "$gpus" "${MODEL[@]}" \
    --steps "$STEPS" "$@" --result-json "$RUNS/$name-$mode.json" -o "$RUNS/$name-$mode" > "$RUNS/$name-$mode.log" 2>&1 || { echo "failed:"; tail -3 "$RUNS/$name-$mode.log"; }
}

for r in $(seq "$REPEATS"); do
  train "1gpu-r$r" 1 on --global-batch 8 --micro-batches 1
  train "1gpu-r$r" 1 off --global-batch 8 --micro-batches 1
done
if [ "$NGPU" -ge 2 ]; then
  for layout in tp pp dp; do
    for r in $(seq "$REPEATS"); do
      train "2gpu-$layout-r$r" 2 on --$layout 2 --global-batch 16 --micro-batches 4
      train "2gpu-$layout-r$r" 2 off --$layout 2 --global-batch 16 --micro-batches 4
    done
  done
fi

$PY bench/gpu_trainer_table.py "$RUNS" "$OUT/baseline.json" | tee "$OUT/table.txt"
tar czf "$OUT/trainer-runs.tar.gz" -C "$OUT" runs && rm -rf "$RUNS"
