#!/usr/bin/env bash
# Ranks that fail on real NCCL jobs, 2 GPUs: a rank that raises, one killed with SIGKILL, one that
# exits without a word, beside a hang and a freeze; in the bundled trainer (tp2, pp2, dp2: `--inject crash:...` / `kill:...`)
# and in a user's DDP job under torchrun (tests/jobs/ddp_job.py --cuda --fail RANK,STEP,HOW). For
# each: the launcher's line, `localize`, and the run state (state, the rank named, why): right when
# the planted rank is named and the state is failed (hung for a hang or freeze). Table in
# $OUT/failures.md; one JSON line per run in $OUT/failures.jsonl; the runs in $OUT/runs.tar.gz.
#
#   OUT=/tmp/o bash bench/gpu_failures.sh
set -uo pipefail
OUT=${OUT:-gpu-failures}
PY=${PYTHON:-python3}
mkdir -p "$OUT/runs"
export OMP_NUM_THREADS=1 PYTHONPATH=${PYTHONPATH:-$PWD} TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=8000
bash bench/gpu_setup.sh >"$OUT/setup.txt" 2>&1
MODEL=(--layers 4 --hidden 512 --heads 8 --seq-len 512 --vocab 8192 --global-batch 8 --micro-batches 4 --steps 12)
BUDGET_S=${BUDGET_S:-300}  # no new job after this many seconds
T0=$(date +%s)
# how:mesh:mesh args:fault:rank:step. Hangs and freezes beside the failures: they must still
# read hung (a rank alive and stuck), where a failure reads failed.
declare -a JOBS=(
  "train:tp2:--tp 2:crash:1:4" "train:pp2:--pp 2:kill:1:3" "train:dp2:--dp 2:kill:0:5"
  "train:dp2:--dp 2:crash:0:3" "train:pp2:--pp 2:crash:0:6" "train:tp2:--tp 2:kill:0:4"
  "ddp:dp2::raise:1:7" "ddp:dp2::kill:0:6" "ddp:dp2::exit:1:5"
  "train:dp2:--dp 2:hang:1:4" "train:pp2:--pp 2:freeze:0:3"
)
if [[ -n ${ONLY:-} ]]; then IFS=";" read -r -a JOBS <<<"$ONLY"; fi  # ONLY="job;job;...": these alone
for job in "${JOBS[@]}"; do
  IFS=: read -r how mesh args kind rank step <<<"$job"
  name="$how-$mesh-$kind-r$rank-s$step"
  if (( $(date +%s) - T0 > BUDGET_S )); then echo "budget spent: $name not run" | tee -a "$OUT/jobs.txt"; continue; fi
  run="$OUT/runs/$name" start=$(date +%s)
  if [[ $how == train ]]; then
    # shellcheck disable=SC2086
    timeout 150 "$PY" -m megascope train --nproc 2 $args "${MODEL[@]}" --inject "$kind:rank=$rank,step=$step" \
      --collective-timeout 20 -o "$run" >"$run.log" 2>&1
  else
    timeout 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 tests/jobs/ddp_job.py "$run" --cuda \
      --steps 20 --timeout 20 --fail "$rank,$step,$kind" >"$run.log" 2>&1
  fi
  echo "$name rc=$? $(( $(date +%s) - start )) s" | tee -a "$OUT/jobs.txt"
done
"$PY" - "$OUT" <<'PY'
import json, re, subprocess, sys
from pathlib import Path

from megascope.analysis import localize
from megascope.analysis.runstate import run_state
from megascope.store import open_run

out = Path(sys.argv[1])
rows = []
for run in sorted(p for p in (out / "runs").iterdir() if p.is_dir()):
    name = run.name
    planted = int(re.search(r"-r(\d+)-s\d+$", name).group(1))
    log = (run.parent / f"{name}.log").read_text(errors="replace").splitlines()
    said = next((line for line in reversed(log) if line.startswith("Error:")), "")
    if "Root Cause (first observed failure):" in log:  # torchrun's: the first rank it saw fail
        block = log[log.index("Root Cause (first observed failure):"):][:8]
        said = "torchrun: " + "; ".join(" ".join(line.split()) for line in block if re.match(r"\s+(rank|exitcode)\s*:", line))
    where = subprocess.run([sys.executable, "-m", "megascope", "localize", str(run)], capture_output=True, text=True)
    try:
        r = open_run(run)
        state = run_state(r, hang=localize(r))
    except Exception as exc:  # a run that cannot be read is a row too
        state = {"state": f"error: {exc}", "culprit": None, "reason": ""}
    culprit = (state.get("culprit") or {}).get("rank")
    expected = "hung" if re.search(r"-(hang|freeze)-", name) else "failed"
    rows.append({"run": name, "planted": planted, "state": state["state"], "named": culprit,
                 "right": culprit == planted and state["state"] == expected, "reason": state.get("reason", ""), "launcher": said[:300],
                 "localize": where.stdout.strip()[:600] or where.stderr.strip()[:300]})
with open(out / "failures.jsonl", "w") as f:
    for row in rows:
        f.write(json.dumps(row) + "\n")
lines = ["| run | planted rank | state | named | right | launcher |", "|---|---|---|---|---|---|"]
lines += [f"| {r['run']} | {r['planted']} | {r['state']} | {r['named']} | {'yes' if r['right'] else '**no**'} | "
          f"{r['launcher'][:160]} |" for r in rows]
lines.append(f"\n{sum(r['right'] for r in rows)} of {len(rows)} right (the planted rank named, failed or hung as planted)")
(out / "failures.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
tar czf "$OUT/runs.tar.gz" --exclude stacks -C "$OUT" runs
