#!/usr/bin/env bash
# megascope diagnose on a GPU machine: one card alone, then every local card as ranks (NCCL).
# Writes at most 7 files under $OUT (run directories stay in a temporary folder):
#   nvidia-smi.txt          cards, driver, clocks, power limits
#   diagnose-1gpu.json      report of `megascope diagnose` on cuda:0 alone
#   diagnose-ngpu.json      report of `megascope diagnose --nproc N` (N = local GPUs, at most 8), if N > 1
#   health-1gpu.json        `megascope health` of the 1-GPU run (heartbeats sampled during the tests)
#   summary.txt             the human-readable reports, datasheet comparison included
#   pytest-gpu.txt          the @pytest.mark.gpu tests of the health area
#
#   OUT=/tmp/out bash bench/gpu_diagnose.sh
# Needs torch with CUDA, pyarrow and click (duckdb/pandas for health-1gpu.json, pytest for the tests).
set -uo pipefail
OUT=${OUT:?set OUT to a folder for the results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

"$PY" -c "import torch, pyarrow, click; assert torch.cuda.is_available(), 'no CUDA device'" \
    || { echo "gpu_diagnose: needs torch with CUDA, pyarrow and click" | tee "$OUT/summary.txt"; exit 1; }
# megascope.collectors lives in collectors/: an editable install maps it (no network needed).
"$PY" -c "import megascope.collectors.heartbeat" 2>/dev/null \
    || "$PY" -m pip install -q --no-deps --no-build-isolation -e . >"$WORK/pip.log" 2>&1 \
    || { echo "gpu_diagnose: could not install megascope (see pip)"; cat "$WORK/pip.log"; exit 1; }

nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm,power.limit,temperature.gpu,ecc.errors.uncorrected.volatile.total \
    --format=csv > "$OUT/nvidia-smi.txt" 2>&1 || true
NGPU=$("$PY" -c "import torch; print(min(torch.cuda.device_count(), 8))")

report() {  # $1 = json report -> text
    "$PY" -c "import json, sys; from megascope.health.diagnose import format_report; print(format_report(json.load(open(sys.argv[1]))))" "$1"
}

{
    echo "== $(date -u +%FT%TZ) $(hostname), $NGPU GPU(s), torch $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
    echo "== megascope diagnose (cuda:0 alone)"
    CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} "$PY" -m megascope diagnose --json -o "$WORK/diag-1gpu" >"$OUT/diagnose-1gpu.json" \
        && report "$OUT/diagnose-1gpu.json"
    "$PY" -m megascope health "$WORK/diag-1gpu" --json >"$OUT/health-1gpu.json" 2>&1 || true
    if [ "$NGPU" -gt 1 ]; then
        echo "== megascope diagnose --nproc $NGPU (NCCL)"
        "$PY" -m megascope diagnose --nproc "$NGPU" --json -o "$WORK/diag-ngpu" >"$OUT/diagnose-ngpu.json" \
            && report "$OUT/diagnose-ngpu.json"
    fi
} 2>&1 | tee "$OUT/summary.txt"

"$PY" -m pytest -m gpu -q -p no:cacheprovider tests/test_health_diagnose.py >"$OUT/pytest-gpu.txt" 2>&1 || true
tail -3 "$OUT/pytest-gpu.txt"
