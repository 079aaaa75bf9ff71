#!/usr/bin/env bash
# Bundled trainer on 1-2 GPUs against the plain PyTorch baseline (bench/gpu_baseline.py), same shape:
# a ~1.3B GPT (24 layers, hidden 2048, 16 heads, sequence 2048, vocabulary 50304), bf16 autocast.
#
# Parts (PARTS, default all three; each is one machine call's worth of work, ~8 minutes):
#   1gpu       baseline, then the trainer on 1 GPU with the collector on and off (interleaved,
#              REPEATS times), then the baseline again: trainer vs baseline in the same call
#   overlap    2 GPUs, TP=2, PP=2, DP=2: every overlap on, then every overlap off (--no-overlap all),
#              collector on in both: exposed communication before/after from megascope's analysis
#   collector  2 GPUs, each layout with the collector on and off (MEGASCOPE_DISABLE=1), interleaved
#   tpsched    2 GPUs, TP=2: collector off, on, then on under each of TPVARIANTS (one environment
#              variable each: the side-stream clock, the host clock, no flush during the run, no wait
#              spans, NCCL on a high-priority stream), to find why tp2 is slower with the collector on
#              (docs/benchmarks.md). Not part of the default.
#   whole      the collector's cost as a user measures it: whole runs off and on, interleaved,
#              REPEATS rounds over WHOLE_LAYOUTS (1gpu tp pp dp, and tpdp: tp2 x dp2 on 4 GPUs), within BUDGET_S seconds; mean,
#              median and p90 step time per layout (bench/whole_run_table.py); WHOLE_VARIANTS runs a
#              pair per variant, "default", tag:VAR=value (several: VAR=1,OTHER=0) or tag:--flag=value (e.g. "default q4x:CUDA_SCALE_LAUNCH_QUEUES=4x",
#              CUDA's launch queue four times as deep; "default unbound:MEGASCOPE_CPU_BIND=none", ranks
#              not bound to their GPU's cores); WHOLE_ON_VARIANTS adds per round a run with the
#              collector on under each tag:VAR=value or tag:--flag=value, compared with the round's
#              unrecorded run. Not part of the default.
#   ab         the collector's cost inside one process (megascope train --collector-ab AB_BLOCK): it
#              records blocks of AB_BLOCK steps and is paused for the blocks between, so recorded and
#              unrecorded steps share NCCL communicators, memory layout and clocks; per AB_LAYOUTS
#              (1gpu tp pp dp), REPEATS runs each, plus tp under each of ABVARIANTS (tag:VAR=value
#              for one environment variable, tag:--flag for one trainer flag; default: the writer
#              unpaced). Not part of the default.
# The table at the end (bench/gpu_trainer_table.py) gives median step time, tokens/s and MFU per
# layout (run.json's FLOPs / step time / GPUs / peak), megascope's own MFU for the same runs, the
# collector's step-time overhead, and exposed communication per group kind and overlap setting.
#
#   OUT=/tmp/o PARTS="1gpu" bash bench/gpu_trainer.sh     # torch with CUDA; run gpu_setup.sh first
set -uo pipefail
OUT=${OUT:-runs/gpu-bench}
PY=${PYTHON:-python3}
STEPS=${STEPS:-20}
REPEATS=${REPEATS:-2}
PARTS=${PARTS:-1gpu overlap collector}
LAYOUTS=${LAYOUTS:-tp pp dp}  # the 2-GPU layouts to run
# tpsched: collector-on variants of tp2, each tag:VAR=value (one variable each)
TPVARIANTS=${TPVARIANTS:-side:MEGASCOPE_CLOCK=side-stream host:MEGASCOPE_CLOCK=host \
  noflush:MEGASCOPE_FLUSH_INTERVAL_S=600 nowait:MEGASCOPE_WAIT_SPANS=0 prio:TORCH_NCCL_HIGH_PRIORITY=1}
AB_BLOCK=${AB_BLOCK:-6}
AB_LAYOUTS=${AB_LAYOUTS:-1gpu tp pp dp}
WHOLE_LAYOUTS=${WHOLE_LAYOUTS:-1gpu tp pp dp}
ABVARIANTS=${ABVARIANTS-unpaced:MEGASCOPE_WRITER_DUTY=1}  # e.g. host:MEGASCOPE_CLOCK=host all:--layer-spans=all
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
MODEL=(--layers 24 --hidden 2048 --heads 16 --seq-len 2048 --vocab 50304 --lr 3e-4)
RUNS="$OUT/runs"
mkdir -p "$RUNS"

baseline() {  # tag
  echo "== baseline $1 (plain PyTorch, 1 GPU, batch 8)"
  CUDA_VISIBLE_DEVICES=0 $PY bench/gpu_baseline.py --layers 24 --hidden 2048 --heads 16 --seq 2048 --vocab 50304 \
    --batch 8 --steps "$STEPS" | tee -a "$OUT/baseline.json"
}

train() {  # name gpus collector(on|off|ab) extra-args...
  local name=$1 gpus=$2 mode=$3; shift 3
  local env=(); [ "$mode" = off ] && env=(MEGASCOPE_DISABLE=1)
  [ "$mode" = ab ] && set -- "$@" --collector-ab "$AB_BLOCK"
  # EXTRA_ENV: one VAR=value, or several joined by commas (VAR=1,OTHER=0)
  [ -n "${EXTRA_ENV:-}" ] && IFS=, read -r -a more <<< "$EXTRA_ENV" && env+=("${more[@]}")
  local devices; devices=$(seq -s, 0 $((gpus - 1)))
  echo "== $name ($gpus GPU, collector $mode ${EXTRA_ENV:-}) $*"
  env "${env[@]}" CUDA_VISIBLE_DEVICES="$devices" timeout 200 $PY -m megascope train --nproc "$gpus" "${MODEL[@]}" \
    --steps "$STEPS" "$@" --result-json "$RUNS/$name-$mode.json" --host-stats "$RUNS/$name-$mode-host" -o "$RUNS/$name-$mode" > "$RUNS/$name-$mode.log" 2>&1 \
    || { echo "failed:"; tail -3 "$RUNS/$name-$mode.log"; }
  # Step times so far, in one small file: what a call cut off at its time limit still brings back.
  tar czf "$OUT/results-so-far.tar.gz" -C "$OUT" runs --exclude='runs/*/*' 2>/dev/null || true
}

layout_args() {  # tp|pp|dp -> the 2-GPU arguments (PP gets 8 micro-batches: a 1/9 bubble instead of 1/5); tpdp: 4 GPUs
  case $1 in
    1gpu) echo "--global-batch 8 --micro-batches 1" ;;
    pp) echo "--pp 2 --global-batch 16 --micro-batches 8" ;;
    tpdp) echo "--tp 2 --dp 2 --global-batch 32 --micro-batches 4" ;;
    *) echo "--$1 2 --global-batch 16 --micro-batches 4" ;;
  esac
}

for part in $PARTS; do
  case $part in
    1gpu)
      baseline before
      for r in $(seq "$REPEATS"); do
        train "1gpu-r$r" 1 on --global-batch 8 --micro-batches 1
        train "1gpu-r$r" 1 off --global-batch 8 --micro-batches 1
      done
      baseline after ;;
    overlap)
      [ "$NGPU" -ge 2 ] || { echo "overlap needs 2 GPUs"; continue; }
      for layout in $LAYOUTS; do
        # shellcheck disable=SC2046
        train "2gpu-$layout-r0" 2 on $(layout_args $layout)
        # shellcheck disable=SC2046
        train "2gpu-$layout-nooverlap-r0" 2 on $(layout_args $layout) --no-overlap all
      done ;;
    collector)
      [ "$NGPU" -ge 2 ] || { echo "collector needs 2 GPUs"; continue; }
      for layout in $LAYOUTS; do
        for r in $(seq "$REPEATS"); do
          # shellcheck disable=SC2046
          train "2gpu-$layout-r$r" 2 on $(layout_args $layout)
          # shellcheck disable=SC2046
          train "2gpu-$layout-r$r" 2 off $(layout_args $layout)
        done
      done ;;
    tpsched)
      [ "$NGPU" -ge 2 ] || { echo "tpsched needs 2 GPUs"; continue; }
      for r in $(seq "$REPEATS"); do
        # shellcheck disable=SC2046
        train "2gpu-tp-r$r" 2 off $(layout_args tp)
        # shellcheck disable=SC2046
        train "2gpu-tp-r$r" 2 on $(layout_args tp)
        for variant in $TPVARIANTS; do  # tag:VAR=value, collector on
          # shellcheck disable=SC2046
          EXTRA_ENV="${variant#*:}" train "2gpu-tp${variant%%:*}-r$r" 2 on $(layout_args tp)
        done
      done ;;
    whole)
      # Whole runs, collector off and on, interleaved: per round every layout of WHOLE_LAYOUTS once
      # each way, the order alternating by round (off first in odd rounds), so drift over the call
      # falls on both sides. Stops starting runs once BUDGET_S seconds have passed since the part
      # began, so a cut-off call still brings back whole pairs. Table: bench/whole_run_table.py.
      start=$SECONDS
      for r in $(seq "$REPEATS"); do
        for layout in $WHOLE_LAYOUTS; do
          gpus=2; name="2gpu-$layout"; [ "$layout" = 1gpu ] && { gpus=1; name=1gpu; }
          [ "$layout" = tpdp ] && { gpus=4; name=4gpu-tpdp; }
          [ "$NGPU" -ge "$gpus" ] || { echo "$layout needs $gpus GPUs"; continue; }
          [ $((SECONDS - start)) -lt "${BUDGET_S:-100000}" ] || { echo "budget spent: round $r, $layout not run"; break 2; }
          order="off on"; [ $((r % 2)) = 0 ] && order="on off"
          for variant in ${WHOLE_VARIANTS:-default}; do  # a pair per variant: default, tag:VAR=value or tag:--flag=value
            vname=$name; venv=""; vextra=()
            [ "$variant" != default ] && { vname="$name-${variant%%:*}"; venv="${variant#*:}"; }
            case $venv in --*) vextra=("${venv%%=*}" "${venv#*=}"); venv="" ;; esac
            for mode in $order; do
              # shellcheck disable=SC2046
              EXTRA_ENV=$venv train "$vname-r$r" "$gpus" "$mode" $(layout_args "$layout") "${vextra[@]}"
            done
          done
          for variant in ${WHOLE_ON_VARIANTS:-}; do  # tag:VAR=value or tag:--flag, collector on only
            setting="${variant#*:}"; extra=()
            case $setting in --*) extra=("${setting%%=*}" "${setting#*=}"); setting="" ;; esac
            # shellcheck disable=SC2046
            EXTRA_ENV=$setting train "$name-${variant%%:*}-r$r" "$gpus" on $(layout_args "$layout") "${extra[@]}"
          done
        done
      done
      $PY bench/whole_run_table.py "$RUNS" | tee "$OUT/whole.txt" ;;
    ab)
      for r in $(seq "$REPEATS"); do
        for layout in $AB_LAYOUTS; do
          gpus=2; name="2gpu-$layout"; [ "$layout" = 1gpu ] && { gpus=1; name=1gpu; }
          [ "$NGPU" -ge "$gpus" ] || { echo "$layout needs $gpus GPUs"; continue; }
          # shellcheck disable=SC2046
          train "$name-r$r" "$gpus" ab $(layout_args "$layout")
        done
        for variant in $ABVARIANTS; do  # tag:VAR=value or tag:--flag, tp only
          [ "$NGPU" -ge 2 ] || continue
          setting=${variant#*:}
          if [ "${setting#--}" != "$setting" ]; then
            # shellcheck disable=SC2046
            train "2gpu-tp${variant%%:*}-r$r" 2 ab $(layout_args tp) "$setting"
          else
            # shellcheck disable=SC2046
            EXTRA_ENV="$setting" train "2gpu-tp${variant%%:*}-r$r" 2 ab $(layout_args tp)
          fi
        done
      done ;;
    *) echo "unknown part $part" ;;
  esac
done

touch "$OUT/baseline.json"
$PY bench/gpu_trainer_table.py "$RUNS" "$OUT/baseline.json" | tee "$OUT/table.txt"
tar czf "$OUT/trainer-runs.tar.gz" -C "$OUT" runs && rm -rf "$RUNS"
