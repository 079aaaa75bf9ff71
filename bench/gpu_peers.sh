#!/usr/bin/env bash
# The detection sweep on GPUs with the other tools on the same runs (issue: side by side with the
# peers): every job writes PyTorch-profiler traces of its last steps (--profile) and runs NVIDIA's
# straggler detector (nvidia-resiliency-ext, --nvrx-straggler); then, on this machine where the
# traces are, Holistic Trace Analysis and megascope's own Kineto import judge the traces, and the
# traces are deleted (the scores come back, not the traces). Back under $OUT: table.txt,
# sweep.jsonl, peers.jsonl, runs.tar.gz (run directories without traces, for --score-only), smoke.txt
# and smoke-trace.json.gz (rank 0's trace of the smoke job).
#
# Needs, carried in .wheels/ (bench/gpu_setup.sh installs them): duckdb, msgspec, plotly, pydot,
# holistictraceanalysis, nvidia-resiliency-ext, defusedxml, pynvml, and nvidia-cuda-cupti-cu12
# (nvidia-resiliency-ext 0.4.1's extension is linked against CUDA 12's CUPTI).
#
# First a smoke test (a 2-GPU dp2 job of 6 steps with both, then each alone): the sweep keeps what
# ran. A run may start until BUDGET_S; the peers are scored after the sweep.
#
#   OUT=/tmp/o SEED=151 BUDGET_S=300 bash bench/gpu_peers.sh      # after bench/gpu_setup.sh
set -uo pipefail
OUT=${OUT:-gpu-peers}
PY=${PYTHON:-python3}
SEED=${SEED:-151}
BUDGET_S=${BUDGET_S:-300}
PROFILE=${PROFILE:-4}
mkdir -p "$OUT"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
GPUS=$(( NGPU >= 4 ? 4 : 2 ))
WORK=${WORK:-/tmp/gpu-peers-runs}
rm -rf "$WORK" /tmp/peers-smoke; mkdir -p "$WORK" /tmp/peers-smoke
export OMP_NUM_THREADS=1 PYTHONPATH=${PYTHONPATH:-$PWD}
CUPTI12=$(find / -name 'libcupti.so.12*' -path '*cuda_cupti*' 2>/dev/null | head -1)
[ -n "$CUPTI12" ] && export LD_LIBRARY_PATH="$(dirname "$CUPTI12")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv >"$OUT/gpus.txt" 2>&1
{
  echo "libcupti.so.12: ${CUPTI12:-not found}"
  $PY -c "import hta, nvidia_resiliency_ext, nvrx_cupti_module; print('hta, nvrx import')" 2>&1 | tail -1
} >"$OUT/smoke.txt"
smoke() {  # smoke NAME ARGS...: a 2-GPU dp2 job of 6 steps; fails where a trace holds no kernel
  local name=$1; shift
  if timeout 150 $PY -m megascope train --nproc 2 --dp 2 --steps 6 --device cuda -o "/tmp/peers-smoke/$name" "$@" \
      >"/tmp/peers-smoke/$name.log" 2>&1; then
    local kernels=-1
    for f in /tmp/peers-smoke/$name/profiler/*; do kernels=$(zcat "$f" | grep -c -E '"cat": ?"kernel"'); break; done
    echo "$name: ok $(ls /tmp/peers-smoke/$name/profiler 2>/dev/null | wc -l) traces, kernel events in the first: $kernels, nvrx report: $(head -c 300 /tmp/peers-smoke/$name/nvrx_straggler.json 2>/dev/null | tr '\n' ' ')"
    [ "$kernels" != 0 ]
    return
  fi
  echo "$name: FAILED: $(grep -v '^USDT\|STAGE:' "/tmp/peers-smoke/$name.log" | tail -4 | tr '\n' ' ')"
  return 1
}
PEERS=""
if smoke both --profile 2 --nvrx-straggler >>"$OUT/smoke.txt"; then
  PEERS="--hta --nvrx"
else
  smoke nvrx --nvrx-straggler >>"$OUT/smoke.txt" && NVRX_OK=1
  smoke profile --profile 2 >>"$OUT/smoke.txt" && PEERS="--hta"
  # Both work alone but not together: the profiler's traces (HTA) are kept; NVRx's result is in smoke.txt.
  [ -z "$PEERS" ] && [ -n "${NVRX_OK:-}" ] && PEERS="--nvrx"
fi
echo "sweep with: ${PEERS:-no peers}" >>"$OUT/smoke.txt"
# One small trace back, to read here: rank 0 of the first smoke job that wrote one.
for f in /tmp/peers-smoke/{both,profile}/profiler/rank00000*; do [ -f "$f" ] && cp "$f" "$OUT/smoke-trace.json.gz" && break; done
cat "$OUT/smoke.txt"
timeout $(( BUDGET_S + 200 )) $PY bench/detect_sweep.py -o "$WORK" --gpu --gpus "$GPUS" --seed "$SEED" \
  --budget-s "$BUDGET_S" --no-score --profile "$PROFILE" $PEERS ${SWEEP_ARGS:-} >/dev/null 2>"$OUT/sweep-progress.txt"
echo "sweep exit $?" >>"$OUT/sweep-progress.txt"
# The peers where the traces are; then the traces go.
timeout ${PEERS_S:-150} $PY bench/detect_sweep.py -o "$WORK" --gpu --gpus "$GPUS" --seed "$SEED" --peers-only \
  --drop-traces ${SWEEP_ARGS:-} 2>"$OUT/peers-progress.txt"
echo "peers exit $?" >>"$OUT/peers-progress.txt"
find "$WORK" -maxdepth 2 -name profiler -type d -exec rm -rf {} + 2>/dev/null
cp "$WORK/sweep.jsonl" "$WORK/peers.jsonl" "$OUT/" 2>/dev/null
tar -czf "$OUT/runs.tar.gz" -C "$WORK" . 2>/dev/null
ls -la "$OUT"
