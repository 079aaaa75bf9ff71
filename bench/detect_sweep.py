"""Real-run detection sweep: planted stragglers, skews and hangs in the bundled trainer, against what
``report`` names.

Each run is a fresh launch of ``megascope train`` (one job at a time, never two at once), on CPU
with gloo (8 ranks over four meshes) or, with ``--gpu``, on 4 GPUs with NCCL. The planted rank of
each run is drawn from a seeded generator, so a sweep with another ``--seed`` meets other ranks.
Then ``report`` reads each run directory and the run is scored:

* straggler: the planted rank is named first (and with cause ``compute``);
* skew: the planted rank is named first, and with cause ``host``;
* hang: ``hang.hung`` with the planted rank first among the suspects, and no straggler named;
* crash, kill: the run state ``failed`` with the planted rank as its culprit (a rank that raised,
  one killed with SIGKILL), not hung, and no straggler named;
* healthy: nothing named (anything named is a false alarm).

The load average (1 min) is recorded before each run and printed with the table.

    python bench/detect_sweep.py -o /tmp/sweep                     # run and score (CPU, ~20 min)
    python bench/detect_sweep.py -o /tmp/sweep --score-only        # score runs already there
    python bench/detect_sweep.py -o /tmp/sweep --gpu               # 4 GPUs, straggler mode=time
    python bench/detect_sweep.py -o /tmp/sweep --gpu --no-score    # run only; --score-only later
    python bench/detect_sweep.py -o /tmp/sweep --hta               # HTA's straggler analysis too
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CPU_MESHES = [(2, 2, 2), (1, 2, 4), (4, 1, 2), (2, 1, 4)]  # (tp, pp, dp), 8 ranks each
GPU_MESHES = [(2, 1, 2), (1, 2, 2), (1, 1, 4), (2, 2, 1)]  # 4 GPUs
# 2 GPUs: not pp2 alone, whose two stages of one rank each give no rank a peer to be judged
# against (the report says stragglers cannot be told there).
GPU2_MESHES = [(1, 1, 2), (2, 1, 1)]
# On GPUs the model is big enough that the device, not the host, sets the step time: in a host-bound
# run (the trainer's default tiny model on an H100 leaves the device idle most of the time) a slow
# device's extra time falls into idle gaps and slows nothing, so a planted slow GPU is no straggler.
# 8 layers at sequence 1024 were still host-bound on 4x H200 (MFU 7-21%, 2,048 tokens a micro-batch
# on tp2 x dp2); 12 layers at sequence 2048 give each GPU 4,096-8,192 tokens a micro-batch.
GPU_MODEL = ["--layers", "12", "--hidden", "2048", "--heads", "16", "--seq-len", "2048", "--vocab", "50304"]
FACTORS = [1.1, 1.15, 1.15, 1.3, 1.6]
SKEWS_MS = [20.0, 50.0, 50.0, 100.0]
HEALTHY_PER_MESH = 5
RUN_TIMEOUT_S = 300.0


def _numbers(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"every value must be above 0: {text!r}")
    return values


def plan(meshes: list[tuple[int, int, int]], seed: int, *, gpu: bool) -> list[dict[str, Any]]:
    """The sweep's runs: per mesh every factor, every skew, one hang, one crash, one kill and some
    healthy runs.

    On GPUs the runs come in a seeded random order, so a sweep cut short by its time budget still
    has every mesh and kind of fault in it; the failures and then the hangs come last there, as
    each takes a minute or more (NCCL may not end a hung collective, and the launcher stops the job
    at its stall limit)."""
    rng = random.Random(seed)
    runs: list[dict[str, Any]] = []
    for tp, pp, dp in meshes:
        world = tp * pp * dp
        cases: list[tuple[str, str | None]] = []
        mode = ",mode=time" if gpu else ""
        cases += [("straggler", f"straggler:rank={{r}},factor={f:g}{mode}") for f in FACTORS]
        if dp > 1:
            cases += [("skew", f"skew:rank={{r}},ms={ms:g}") for ms in SKEWS_MS]
        cases.append(("hang", "hang:rank={r},step=8"))
        cases += [("healthy", None)] * HEALTHY_PER_MESH
        for kind, spec in cases:
            rank = rng.randrange(world)
            runs.append({"mesh": (tp, pp, dp), "kind": kind, "rank": rank if spec else None,
                         "inject": spec.format(r=rank) if spec else None})
    # A rank that fails (raises, or is killed) per mesh, at steps 6-11 (as the hang at 8: a run with
    # a few steps behind it, where the straggler scoring has something to go on): not a hang
    # (gloo's waiters raise, NCCL's wait until stopped), named by the run state. Drawn from a generator of their own, so that a
    # seed plants the other faults where it did before these were added.
    frng = random.Random(f"{seed}-failures")
    for tp, pp, dp in meshes:
        for kind in ("crash", "kill"):
            rank, step = frng.randrange(tp * pp * dp), frng.randrange(6, 12)
            runs.append({"mesh": (tp, pp, dp), "kind": kind, "rank": rank, "inject": f"{kind}:rank={rank},step={step}"})
    if gpu:
        rng.shuffle(runs)
        # Stable: the shuffled order otherwise; the failures (a minute each) and then the hangs last.
        runs.sort(key=lambda r: {"hang": 2, "crash": 1, "kill": 1}.get(r["kind"], 0))
    for i, r in enumerate(runs):
        tp, pp, dp = r["mesh"]
        tag = r["inject"].replace(":", "-").replace(",", "-").replace("=", "") if r["inject"] else "healthy"
        r["name"] = f"{i:03d}-t{tp}p{pp}d{dp}-{tag}"
    return runs


def mesh_model_args(tp: int, pp: int, dp: int, *, gpu: bool) -> list[str]:
    """The model's arguments for this mesh: the sweep's model (the trainer's default on CPU), with
    as many attention heads as TP ranks where it has fewer, and a global batch that every DP rank's
    micro-batches divide (the trainer's default micro-batches: max(4, pp))."""
    args = list(GPU_MODEL) if gpu else ["--heads", "4"]  # 4: the trainer's default
    at = args.index("--heads") + 1
    args[at] = str(max(int(args[at]), tp))
    per_step = dp * max(4, pp)
    if 16 % per_step:
        args += ["--global-batch", str(per_step * -(-16 // per_step))]
    return args


def launch(r: dict[str, Any], out: Path, *, gpu: bool, steps: int, profile: int | None,
           nvrx: bool = False, train_args: tuple[str, ...] = ()) -> dict[str, Any]:
    tp, pp, dp = r["mesh"]
    cmd = [sys.executable, "-c", "from megascope.cli import main; main()", "train", "--nproc", str(tp * pp * dp), "--tp", str(tp),
           "--pp", str(pp), "--dp", str(dp), "--steps", str(steps), "--seed", str(abs(hash(r["name"])) % 1000),
           "--collective-timeout", "15", "--device", "cuda" if gpu else "cpu", "-o", str(out / r["name"])]
    cmd += mesh_model_args(tp, pp, dp, gpu=gpu)
    if r["inject"]:
        cmd += ["--inject", r["inject"]]
    if profile:
        cmd += ["--profile", str(profile)]
    if nvrx:
        cmd += ["--nvrx-straggler"]
    cmd += train_args
    load = os.getloadavg()[0]
    busy0, kids0 = _busy_cpu_s(), _children_cpu_s()
    t0 = time.perf_counter()
    # A job that outlives RUN_TIMEOUT_S (a hang its launcher did not end) is killed with its whole
    # process group, and the sweep goes on: the run directory holds what it wrote until then.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    _RUNNING[:] = [proc]
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        output += f"\nkilled after {RUN_TIMEOUT_S:g} s\n"
    finally:
        _RUNNING.clear()
    wall = time.perf_counter() - t0
    # The job's own output beside its run directory: where a run's time went, or why it failed.
    (out / f"{r['name']}.log").write_text(output)
    # The 1-minute load average before a run mostly counts the previous run's own ranks. What the
    # run competed with is the CPU that other processes used while it ran: all busy CPU time less
    # the run's own (its process tree), in cores.
    other = max(0.0, (_busy_cpu_s() - busy0) - (_children_cpu_s() - kids0)) / wall
    return {"load": load, "other_cores": round(other, 2), "wall_s": wall, "rc": proc.returncode,
            "err": (output.strip().splitlines() or [""])[-1] if proc.returncode else ""}


# The job running now: its own process group (a hang is killed with the whole group), so a
# signal to the sweep does not reach it; the sweep's SIGTERM handler kills it (a sweep stopped by
# `timeout` left a hung 4-GPU job spinning on the GPUs under the next runs).
_RUNNING: list[subprocess.Popen[str]] = []


def _stop_running(signum: int, _frame: Any) -> None:
    for proc in _RUNNING:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    raise SystemExit(128 + signum)


def _busy_cpu_s() -> float:
    """Seconds of CPU time all processes of the machine have used (non-idle jiffies of /proc/stat)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    import resource
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def score(r: dict[str, Any], path: Path) -> dict[str, Any]:
    from megascope.analysis.report import report
    from megascope.store import open_run

    run = open_run(path)
    res = report(run, with_whatif=False)
    named = [s["rank"] for s in res["stragglers"]]
    first = res["stragglers"][0] if res["stragglers"] else None
    hung = bool(res["hang"].get("hung"))
    suspects = [s["rank"] for s in res["hang"].get("suspects", [])] if hung else []
    kind, want = r["kind"], r["rank"]
    # Each named rank's host probe against the median rank's (None where the run has none): a rank
    # named on a CPU 1.25x slower or more was slowed by the machine, planted or not.
    cpu = {s["rank"]: _number((s.get("evidence") or {}).get("cpu_slowdown")) for s in res["stragglers"]}
    out: dict[str, Any] = {"named": named, "named_cpu": [cpu[n] for n in named], "hung": hung, "suspects": suspects[:3],
                           "cause": first["cause"] if first else None,
                           "confidence": first.get("confidence") if first else None}
    out.update(measured(run, want))
    if kind in ("straggler", "skew"):
        out["first_right"] = bool(first and first["rank"] == want) and not hung
        out["cause_right"] = bool(out["first_right"] and first and first["cause"] == ("host" if kind == "skew" else "compute"))
        out["false"] = [n for n in named if n != want]
    elif kind == "hang":
        out["first_right"] = bool(hung and suspects and suspects[0] == want and not named)
        out["cause_right"] = out["first_right"]
        out["false"] = named
    elif kind in ("crash", "kill"):
        state = res.get("state") or {}
        culprit = (state.get("culprit") or {}).get("rank")
        out.update(state=state.get("state"), culprit=culprit)
        out["first_right"] = bool(state.get("state") == "failed" and culprit == want and not hung and not named)
        out["cause_right"] = out["first_right"]
        out["false"] = named + (["hang"] if hung else [])
    else:
        out["first_right"] = not named and not hung
        out["cause_right"] = out["first_right"]
        out["false"] = named + (["hang"] if hung else [])
    return out


def _number(value: Any) -> float | None:
    return None if value is None or value != value else round(float(value), 3)


def measured(run: Any, planted: int | None) -> dict[str, Any]:
    """What the run's own spans say, planted fault aside: per rank the median over steps (from
    step 3) of its forward + backward time against the median of its pipeline stage, the slowest
    rank and that ratio, and the planted rank's. A machine can slow a rank nobody planted (on a
    host-bound GPU run, a rank whose host launches its kernels slower); a run where such a rank
    is slower than the planted one is a miss of the scoring, not of the detection."""
    frame = run.con.execute("""
        WITH own AS (SELECT step, rank, sum(dur_ns) AS ns FROM spans
                     WHERE step >= 3 AND kind IN ('forward', 'backward') AND name IN ('forward', 'backward')
                     GROUP BY 1, 2),
        per AS (SELECT o.rank, coalesce(r.coords['pp'], 0) AS stage, median(o.ns) AS ns
                FROM own o JOIN ranks r USING (rank) GROUP BY 1, 2)
        SELECT rank, ns / median(ns) OVER (PARTITION BY stage) AS ratio FROM per ORDER BY ratio DESC""").fetchall()
    step = run.con.execute("SELECT median(dur_ns) FROM spans WHERE kind = 'step' AND step >= 3").fetchone()
    step_ms = round(float(step[0]) / 1e6, 2) if step and step[0] is not None else None
    if not frame:
        return {"step_ms": step_ms}
    ratios = {int(r): float(x) for r, x in frame}
    slowest = max(ratios, key=lambda r: ratios[r])
    return {"slowest": slowest, "slowest_ratio": round(ratios[slowest], 3),
            "planted_ratio": round(ratios[planted], 3) if planted in ratios else None, "step_ms": step_ms}


def peers_score(r: dict[str, Any], path: Path) -> dict[str, Any]:
    """What the other tools name on this run: Holistic Trace Analysis and megascope itself on the
    run's profiler traces (``--profile``), NVIDIA's detector from its report (``--nvrx-straggler``)."""
    out: dict[str, Any] = {}
    if (path / "profiler").is_dir():
        out.update(hta_score(r, path / "profiler"))
        out.update(kineto_score(r, path))
    if (path / "nvrx_straggler.json").is_file():
        out.update(nvrx_score(r, json.loads((path / "nvrx_straggler.json").read_text())))
    return out


def _error(exc: Exception) -> str:
    """A tool's failure as a table cell: its message's first line, or the exception's name."""
    return f"error: {(str(exc).splitlines() or [type(exc).__name__])[0][:80]}"


def _right(r: dict[str, Any], ranks: list[int]) -> bool:
    """A peer's pick scored like ours: the planted rank first, or nothing on a healthy run."""
    return bool(ranks and ranks[0] == r["rank"]) if r["rank"] is not None else not ranks


def hta_score(r: dict[str, Any], trace_dir: Path) -> dict[str, Any]:
    """HTA's straggler analysis (``get_potential_stragglers``, one candidate) over the run's profiler
    traces, as HTA ships; where that fails because HTA 0.5 looks for NCCL kernels by their names
    before NCCL 2.19 (``ncclKernel*``, now ``ncclDevKernel*``), again on a copy with the kernels
    renamed, so that its method is judged and not its name list (``hta_renamed``)."""
    try:
        from hta.trace_analysis import TraceAnalysis  # type: ignore[import-not-found]
    except ImportError:
        return {"hta": "not installed"}

    def run(directory: Path) -> list[int] | str:
        try:
            return [int(x) for x in TraceAnalysis(trace_dir=str(directory)).get_potential_stragglers(num_candidates=1)]
        except Exception as exc:  # HTA's own failures are part of the comparison
            return _error(exc)

    out: dict[str, Any] = {"hta": run(trace_dir)}
    if isinstance(out["hta"], list):
        out["hta_right"] = _right(r, out["hta"])
        return out
    import gzip
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        renamed = False
        for f in sorted(trace_dir.glob("*.json*")):
            opener = gzip.open if f.suffix == ".gz" else open
            with opener(f, "rb") as fin:
                data = fin.read()
            renamed |= b"ncclDevKernel" in data
            with opener(Path(tmp) / f.name, "wb") as fout:
                fout.write(data.replace(b"ncclDevKernel", b"ncclKernel"))
        if renamed:
            out["hta_renamed"] = run(Path(tmp))
            if isinstance(out["hta_renamed"], list):
                out["hta_right"] = _right(r, out["hta_renamed"])
    return out


def kineto_score(r: dict[str, Any], path: Path) -> dict[str, Any]:
    """megascope on the same profiler traces HTA reads: ingested (mesh from run.json), then reported."""
    import shutil
    import tempfile

    from megascope.analysis.report import report
    from megascope.ingest import ingest_kineto
    from megascope.store import open_run

    mesh = json.loads((path / "run.json").read_text()).get("mesh_sizes")
    tmp = Path(tempfile.mkdtemp()) / "run"
    try:
        ingest_kineto(path / "profiler", tmp, mesh=mesh)
        res = report(open_run(tmp), with_whatif=False)
        named = [int(s["rank"]) for s in res["stragglers"]]
        return {"kineto": named, "kineto_right": _right(r, named)}
    except Exception as exc:
        return {"kineto": _error(exc)}
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def nvrx_score(r: dict[str, Any], rep: dict[str, Any]) -> dict[str, Any]:
    """NVIDIA's detector: the ranks it names (GPU relative score or the step section's relative
    score under its bar of 0.75), and its lowest-scoring rank by each score."""
    named = sorted(set(rep["named"]["gpu_relative"]) | {x for v in rep["named"]["section_relative"].values() for x in v})

    def lowest(scores: dict[str, float]) -> int | None:
        finite = {int(k): v for k, v in scores.items() if v == v}
        return min(finite, key=lambda k: finite[k]) if finite else None

    return {"nvrx": named, "nvrx_right": _right(r, named), "nvrx_gpu_lowest": lowest(rep["gpu_relative"]),
            "nvrx_gpu_scores": rep["gpu_relative"],
            "nvrx_step_lowest": lowest(rep["section_relative"].get("step", {}))}


def level(r: dict[str, Any]) -> str:
    if r["kind"] == "straggler":
        return f"straggler x{r['inject'].split('factor=')[1].split(',')[0]}"
    if r["kind"] == "skew":
        return f"skew {r['inject'].split('ms=')[1]} ms"
    return r["kind"]


# A planted fault whose run's median step is less than this much slower than the healthy runs of
# its mesh (same sweep) did not slow the job: a host pause the host's lead over its device absorbs,
# a slow GPU on a host-bound run. Naming no rank is then no miss; such runs are counted apart.
EFFECT_MIN = 0.02


def effects(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Run name -> its median step time over the median of the healthy runs of its mesh, minus 1
    (runs without a step time or without healthy runs of their mesh are left out)."""
    healthy: dict[tuple[int, ...], list[float]] = {}
    for r in rows:
        if r["kind"] == "healthy" and r.get("step_ms"):
            healthy.setdefault(tuple(r["mesh"]), []).append(float(r["step_ms"]))
    out = {}
    for r in rows:
        base = sorted(healthy.get(tuple(r["mesh"]), []))
        if base and r.get("step_ms"):
            out[r["name"]] = float(r["step_ms"]) / base[len(base) // 2] - 1.0
    return out


def table(rows: list[dict[str, Any]], *, gpu: bool = True) -> str:
    """The sweep's table; the fault's effect on the step (two columns) on GPU runs only: eight CPU
    ranks sharing two cores vary too much from run to run for one run's step time to tell."""
    order: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        order.setdefault(level(r), []).append(r)
    effect = effects(rows) if gpu else {}
    lines = ["| fault | runs | named first | right cause | other ranks named | of them on a CPU 1.25x slower or more "
             "(host probe) | another rank measured slower than the planted one | runs the fault slowed by 2% or "
             "more (against the mesh's healthy runs): named first | the others: no rank named | "
             "load (1 min), median / max | other processes' cores during the run, median / max |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, group in order.items():
        ok = [g for g in group if "first_right" in g]
        loads = sorted(g["load"] for g in group)
        faults = [g for g in ok if g["kind"] in ("straggler", "skew") and g["name"] in effect]
        felt = [g for g in faults if effect[g["name"]] >= EFFECT_MIN]
        unfelt = [g for g in faults if effect[g["name"]] < EFFECT_MIN]
        lines.append(f"| {name} | {len(group)} | {sum(g['first_right'] for g in ok)}/{len(group)} | "
                     f"{sum(g['cause_right'] for g in ok)}/{len(group)} | "
                     f"{sum(bool(g['false']) for g in ok)} | {_slow_cpu(ok)} | {_overshadowed(group)} | "
                     + (f"{sum(g['first_right'] for g in felt)}/{len(felt)} | "
                        f"{sum(not g.get('named') for g in unfelt)}/{len(unfelt)} | " if faults else "- | - | ")
                     + f"{loads[len(loads) // 2]:.1f} / {loads[-1]:.1f} | "
                     f"{_median_max(group, 'other_cores')} |")
    return "\n".join(lines)


def _slow_cpu(group: list[dict[str, Any]]) -> str:
    """Runs whose wrongly named ranks all sat on a CPU 1.25x slower than the median rank's or more
    (the collector's host probe), or "-" where no run named a wrong rank or none has probes."""
    wrong = [g for g in group if g["false"] and any(f != "hang" for f in g["false"])]
    probed = [g for g in wrong if "named_cpu" in g and any(c is not None for c in g["named_cpu"])]
    if not probed:
        return "-"
    # The bar at which `megascope report` says "a slow or shared CPU".
    from megascope.cli.analyze import CPU_SLOW

    slow = [g for g in probed if all((dict(zip(g["named"], g["named_cpu"], strict=True)).get(f) or 0) >= CPU_SLOW
                                     for f in g["false"] if f != "hang")]
    return f"{len(slow)}/{len(probed)}"


def _overshadowed(group: list[dict[str, Any]]) -> str:
    """Straggler runs where the spans show another rank slower than the planted one, or "-" for
    runs with no planted straggler (a skewed rank pauses outside its spans, which say nothing)."""
    planted = [g for g in group if g.get("kind") == "straggler"  # a skew pauses outside its spans
               and g.get("planted_ratio") is not None and g.get("slowest_ratio") is not None]
    if not planted:
        return "-"
    over = [g for g in planted if g["slowest"] != g.get("rank") and g["slowest_ratio"] > g["planted_ratio"]]
    return f"{len(over)}/{len(planted)}" + (f" (ranks {', '.join(str(g['slowest']) for g in over)})" if over else "")


def _median_max(group: list[dict[str, Any]], key: str) -> str:
    vals = sorted(g[key] for g in group if g.get(key) is not None)
    return f"{vals[len(vals) // 2]:.2f} / {vals[-1]:.2f}" if vals else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--out", type=Path, required=True, help="folder of the run directories")
    parser.add_argument("--seed", type=int, default=22, help="draws the planted ranks")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--gpu", action="store_true", help="4 GPUs (NCCL), straggler mode=time")
    parser.add_argument("--gpus", type=int, default=4, choices=(2, 4), help="with --gpu: 2 or 4 GPUs")
    parser.add_argument("--budget-s", type=float, default=0.0, help="start no run after this many seconds")
    parser.add_argument("--score-only", action="store_true", help="score the runs already in --out")
    parser.add_argument("--no-score", action="store_true",
                        help="only run (score later with --score-only, elsewhere: on GPU time, more runs fit)")
    parser.add_argument("--hta", action="store_true",
                        help="also write profiler traces (--profile) and run HTA and megascope's Kineto import on them")
    parser.add_argument("--profile", type=int, default=4, help="with --hta: profile the last this many steps")
    parser.add_argument("--nvrx", action="store_true", help="also run NVIDIA's straggler detector in each job")
    parser.add_argument("--peers-only", action="store_true",
                        help="only score the other tools on the runs in --out, into peers.jsonl (with "
                             "--drop-traces, then delete each run's profiler traces)")
    parser.add_argument("--drop-traces", action="store_true", help="with --peers-only: see there")
    parser.add_argument("--limit", type=int, default=0, help="only the first N runs (a quick look)")
    parser.add_argument("--train-args", default="", metavar="ARGS",
                        help="more arguments for every run's megascope train, e.g. '--dp-comm-spans rotate'")
    parser.add_argument("--mesh", action="append", default=[], metavar="TPxPPxDP",
                        help="only these meshes (repeatable), e.g. 2x2x2")
    parser.add_argument("--only", action="append", default=[],
                        choices=("straggler", "skew", "hang", "crash", "kill", "healthy"),
                        help="only these kinds of run (repeatable)")
    parser.add_argument("--factors", default=None, metavar="F,F", type=_numbers,
                        help=f"the planted stragglers' factors (default {','.join(f'{x:g}' for x in FACTORS)})")
    parser.add_argument("--skews-ms", default=None, metavar="MS,MS", type=_numbers,
                        help=f"the planted host pauses, milliseconds (default {','.join(f'{x:g}' for x in SKEWS_MS)})")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _stop_running)
    if args.skews_ms:
        SKEWS_MS[:] = args.skews_ms
    if args.factors:
        FACTORS[:] = args.factors
    meshes = (GPU_MESHES if args.gpus == 4 else GPU2_MESHES) if args.gpu else CPU_MESHES
    if args.mesh:
        meshes = [tuple(int(x) for x in m.split("x")) for m in args.mesh]  # type: ignore[misc]
    runs = plan(meshes, args.seed, gpu=args.gpu)
    if args.only:
        runs = [r for r in runs if r["kind"] in args.only]
    if args.limit:
        runs = runs[:args.limit]
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "sweep.jsonl"
    done = {}
    if log.exists():
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            done[rec["name"]] = rec
    if args.peers_only:
        return peers_only(runs, done, args.out, drop_traces=args.drop_traces)
    peers = {}
    if (args.out / "peers.jsonl").exists():
        for line in (args.out / "peers.jsonl").read_text().splitlines():
            rec = json.loads(line)
            peers[rec.pop("name")] = rec
    started = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    rows = []
    not_run: list[str] = []
    began = time.monotonic()
    for r in runs:
        if args.budget_s and time.monotonic() - began > args.budget_s and r["name"] not in done:
            print(f"time budget spent: {r['name']} and later runs not started", file=sys.stderr)
            break
        rec = dict(done.get(r["name"], r))
        rec.update(r)
        if not args.score_only and r["name"] not in done:
            rec.update(launch(r, args.out, gpu=args.gpu, steps=args.steps, profile=args.profile if args.hta else None,
                              nvrx=args.nvrx, train_args=tuple(shlex.split(args.train_args))))
            with log.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        if "load" not in rec or args.no_score:
            continue
        if rec.get("rc") and not (args.out / r["name"] / "run.json").exists():
            # The job never started training (a mesh the model does not fit): no run to score.
            not_run.append(f"{r['name']}: {rec.get('err') or 'exit ' + str(rec['rc'])}")
            continue
        try:
            rec.update(score(rec, args.out / r["name"]))
        except Exception as exc:  # a run that did not leave a readable directory is a miss
            rec.update({"first_right": False, "cause_right": False, "false": [], "error": str(exc).splitlines()[0]})
        if r["name"] in peers:
            rec.update(peers[r["name"]])
        elif args.hta or args.nvrx:
            rec.update(peers_score(rec, args.out / r["name"]))
        rows.append(rec)
        print(json.dumps({k: rec.get(k) for k in ("name", "load", "other_cores", "named", "cause", "confidence", "hung",
                                                   "suspects", "first_right", "cause_right", "false", "hta",
                                                   "hta_renamed", "kineto", "nvrx")}),
              file=sys.stderr, flush=True)
    print(f"{'GPU' if args.gpu else 'CPU'} sweep, seed {args.seed}, {len(rows)} runs, scored {started}, "
          f"load now {os.getloadavg()[0]:.1f}\n")
    print(table(rows, gpu=args.gpu))
    if not_run:
        print(f"\n{len(not_run)} runs did not start and are not scored; the first: {not_run[0]}")
    if any(k in g for g in rows for k in ("hta", "nvrx", "kineto")):
        print()
        print(peers_table(rows))
    return 0


def peers_only(runs: list[dict[str, Any]], done: dict[str, dict[str, Any]], out: Path, *, drop_traces: bool) -> int:
    """Score the other tools on every run already in ``out`` into peers.jsonl (the GPU machine
    scores them where the traces are, and sends back the scores, not the traces)."""
    import shutil

    with (out / "peers.jsonl").open("a") as f:
        for r in runs:
            if r["name"] not in done or not (out / r["name"]).is_dir():
                continue
            t0 = time.perf_counter()
            rec = {"name": r["name"], **peers_score(r, out / r["name"])}
            print(json.dumps(rec | {"seconds": round(time.perf_counter() - t0, 1)}), file=sys.stderr, flush=True)
            f.write(json.dumps(rec) + "\n")
            if drop_traces:
                shutil.rmtree(out / r["name"] / "profiler", ignore_errors=True)
    return 0


def peers_table(rows: list[dict[str, Any]]) -> str:
    """Each tool's hits on the same runs: the planted rank named first (healthy: nothing named)."""
    lines = ["| fault | runs | megascope (its collector) | megascope (the profiler traces) | HTA as shipped | "
             "HTA, NCCL kernels renamed | NVIDIA's detector (named at its 0.75 bar) | NVIDIA's lowest GPU score |",
             "|---|---|---|---|---|---|---|---|"]
    order: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        order.setdefault(level(r), []).append(r)

    def hits(group: list[dict[str, Any]], key: str, right: Any) -> str:
        have = [g for g in group if key in g and not (isinstance(g[key], str))]
        errors = sum(isinstance(g.get(key), str) for g in group)
        if not have:
            return f"error ({errors})" if errors else "-"
        return f"{sum(bool(right(g)) for g in have)}/{len(have)}" + (f" ({errors} errors)" if errors else "")

    for name, group in order.items():
        lines.append(
            f"| {name} | {len(group)} | {hits(group, 'first_right', lambda g: g['first_right'])} | "
            f"{hits(group, 'kineto', lambda g: g.get('kineto_right'))} | "
            f"{hits(group, 'hta', lambda g: _right(g, g['hta']))} | "
            f"{hits(group, 'hta_renamed', lambda g: _right(g, g['hta_renamed']))} | "
            f"{hits(group, 'nvrx', lambda g: g.get('nvrx_right'))} | "
            + ("- |" if name == "healthy" else  # the lowest score is a rank's on every run: no verdict
               f"{hits(group, 'nvrx_gpu_lowest', lambda g: g['nvrx_gpu_lowest'] == g['rank'])} |"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
