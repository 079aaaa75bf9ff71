#!/usr/bin/env bash
# The writer's event calls through the CUDA driver (`event_calls="driver"`) against torch's, on GPUs,
# in parts that each fit one machine call (PARTS, default "tests megatron"):
#   tests     set up, then the GPU tests with the build's default (the collector's config says which)
#   megatron  a Megatron-core job on GPU 0 alone (bench/gpu_megatron.sh): megascope off, on with the
#             default, and on with the other event calls, interleaved, MEG_ROUNDS rounds
#   tp        the bundled trainer's ~1.4B model on tp2 (bench/gpu_trainer.sh PARTS=whole): off, on with
#             the default, and on with the other event calls, interleaved, TP_ROUNDS rounds
# Under $OUT: setup.txt, tests.txt, megatron-ab.txt, tp-whole.txt (tables), at most 8 files.
#
#   OUT=/tmp/o PARTS="tests megatron" bash bench/gpu_event_calls.sh
#   OUT=/tmp/o PARTS="megatron tp" MEG_ROUNDS=3 TP_ROUNDS=2 bash bench/gpu_event_calls.sh
set -uo pipefail
OUT=${OUT:-runs/gpu-event-calls}
PY=${PYTHON:-python3}
PARTS=${PARTS:-tests megatron}
WORK=${WORK:-/tmp/megascope-event-calls}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
("$PY" -c "import duckdb, megatron.core" 2>/dev/null && echo "set up already") >"$OUT/setup.txt" 2>&1 \
  || bash bench/gpu_setup.sh >"$OUT/setup.txt" 2>&1
default=$("$PY" -c "from pathlib import Path; from megascope.collectors.config import CollectorConfig
print(CollectorConfig(run_dir=Path('r')).event_calls)")
other=torch; [ "$default" = torch ] && other=driver
echo "default event calls: $default; compared with: $other; $(date -u)" | tee -a "$OUT/setup.txt"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >>"$OUT/setup.txt" 2>&1
for part in $PARTS; do
  case $part in
    tests)
      timeout "${TESTS_S:-420}" "$PY" -m pytest -q -m gpu -W ignore::pytest.PytestUnraisableExceptionWarning \
        -p no:cacheprovider tests/test_drop_in.py tests/test_collector_gpu.py tests/test_straggler_evidence.py \
        tests/test_trainer_gpu.py >"$OUT/tests.txt" 2>&1
      echo "exit $? ($(date -u))" >>"$OUT/tests.txt" ;;
    megatron)
      rm -rf "$WORK/meg"
      CUDA_VISIBLE_DEVICES=0 CHECKS=none AB_PAIRS=${MEG_ROUNDS:-3} AB_EXTRA="$other:MEGASCOPE_EVENT_CALLS=$other" \
        OUT="$WORK/meg" bash bench/gpu_megatron.sh >"$WORK/meg.log" 2>&1
      { echo "Megatron-core, 1 GPU, on = event calls $default; $(date -u)"; cat "$WORK/meg/ab.txt"; } \
        >"$OUT/megatron-ab.txt" 2>&1 ;;
    tp)
      rm -rf "$WORK/tp"
      OUT="$WORK/tp" PARTS=whole STEPS=24 REPEATS=${TP_ROUNDS:-2} WHOLE_LAYOUTS=tp \
        WHOLE_ON_VARIANTS="$other:MEGASCOPE_EVENT_CALLS=$other" bash bench/gpu_trainer.sh >"$WORK/tp.log" 2>&1
      { echo "tp2 whole runs, on = event calls $default; $(date -u)"; cat "$WORK/tp/whole.txt"; } \
        >"$OUT/tp-whole.txt" 2>&1 ;;
    *) echo "unknown part: $part" >&2; exit 2 ;;
  esac
done
