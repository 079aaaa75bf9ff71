"""Real data-parallel jobs, one fault planted per job, recorded as users record them, then
`megascope report`: is the planted rank named first, with the right cause?

Each job is an MLP (256 -> 1024 -> 1024 -> 256, GELU, Adam, batch 64) under DistributedDataParallel
(``--wrap ddp``, the default), FullyShardedDataParallel (``fsdp1``) or ``fully_shard`` (``fsdp2``),
both of these layer by layer and then as a whole, on gloo, one process per rank, run for
``--active`` steps after one wait and one warm-up step, and recorded one of two ways
(``--record``):

- ``profiler``: ``torch.profiler`` with ``tensorboard_trace_handler`` (gzip, shapes recorded), the
  recipe of the shared ``kineto-cpu-4rank`` sample at other world sizes and ranks; the traces go
  through ``megascope ingest kineto``;
- ``collector``: megascope's collector as docs/collector.md shows it for DDP
  (``Collector.from_env`` before ``init_process_group``, each step under ``col.step``), and with
  ``--modules`` forward and backward spans of the model's layers (``instrument_module``).

A job gets one of:

- ``slow F``: the planted rank also runs the forward and backward of a local copy of the model
  (outside DDP or FSDP) on (F - 1) of its batch: a computational straggler about F times slower in its
  compute. Under the profiler it runs between the model's forward and backward, as the shared
  sample's extra products do (the profiler sees every op); under the collector it runs inside the
  model's own forward and backward (a slow device or CPU slows the model's ops, and the collector
  times the model, not every op);
- ``pause MS``: the planted rank sleeps MS milliseconds a step at the same place (a host pause:
  its ops take no longer, it starts them late);
- ``healthy``: nothing planted; no rank should be named.

With ``--device cuda`` each rank runs on the GPU of its rank over NCCL, the model made
device-bound (four 4096 x 4096 layers, batch 16384, TF32) and the loss read back at every step
end (``loss.item()``, as a loop that logs its loss does, so that the host is never more than a step
ahead of its device). There the faults are those of a slow device and a paused host:

- ``slow F``: the planted rank's stream sleeps (``torch.cuda._sleep``) inside its model's forward
  and backward, (F - 1) times the step's device time measured over its first three steps, a third
  of it in the forward, two thirds in the backward: a GPU F times slower, whatever the work;
- ``pause MS``: the host sleeps MS ms between the forward and the backward it launches; what the
  device had queued runs meanwhile, so the job loses about MS less the forward's device time.

Under the profiler on a GPU the traces hold the kernels too (CPU and CUDA activities), after three
unrecorded steps in which a slow GPU times its steps.

Jobs run one at a time; the table counts, by fault, the runs whose first named straggler is the
planted rank, the cause it was given, and the runs where another rank was named.

    python bench/ddp_sweep.py -o DIR [--record profiler|collector --modules --wrap ddp|fsdp1|fsdp2
                                      --device cpu|cuda --seed 5 --worlds 2,3,4,5,6
                                      --factors 1.15,1.3,1.6 --pause-ms 20,50,100]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

JOB = r'''
import copy, os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
init, out, fault, amount, planted, active, record, wrap, kind = sys.argv[1:10]
amount, planted, active = float(amount), int(planted), int(active)
cuda = kind == "cuda"
torch.set_num_threads(1)
torch.manual_seed(0)
device = torch.device("cuda", rank) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
if record != "profiler":
    from megascope.collectors import Collector, instrument_module
    col = Collector.from_env(out)
dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=120))
if cuda:
    width, batch = 4096, 16384
    layers = nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(width, width), nn.GELU())],
                           nn.Linear(width, width)).to(device)
else:
    width, batch = 256, 64
    layers = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 256))
twin = None if cuda else copy.deepcopy(layers)
if wrap == "fsdp1":
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    model = FullyShardedDataParallel(layers, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=device)
elif wrap == "fsdp2":
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device.type, (world,))
    for layer in layers:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    model = fully_shard(layers, mesh=mesh)
else:
    model = DistributedDataParallel(layers)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x, y = torch.randn(batch, width, device=device), torch.randn(batch, width, device=device)
mine = rank == planted
rows = max(1, round((amount - 1) * x.shape[0])) if fault == "slow" else 0
inside = mine and fault == "slow" and record != "profiler" and not cuda
sleep = {"cycles": 0}  # cuda: the slow GPU's third of its extra time, in clock cycles (set after step 2)
warm = []


def slow_gpu(module, args, output):
    """A slow GPU: its stream sleeps a third of its extra time in the forward, two thirds in the backward."""
    if sleep["cycles"]:
        torch.cuda._sleep(sleep["cycles"])
        if output.requires_grad:
            output.register_hook(lambda grad: torch.cuda._sleep(2 * sleep["cycles"]))


if cuda and mine and fault == "slow":
    from megascope.trainer.faults import sleep_cycles_per_ns
    cycles_per_ns = sleep_cycles_per_ns(device)
    layers[3].register_forward_hook(slow_gpu)


class Slow(torch.autograd.Function):
    """The model's own forward and backward made longer: the twin's on (F - 1) of the batch."""

    @staticmethod
    def forward(ctx, h):
        with torch.no_grad():
            twin(x[:rows])
        return h.view_as(h)

    @staticmethod
    def backward(ctx, g):
        with torch.enable_grad():
            (twin(x[:rows]) - y[:rows]).pow(2).mean().backward()
        twin.zero_grad(set_to_none=True)
        return g


if inside:
    layers[1].register_forward_hook(lambda module, args, out: Slow.apply(out))


def step():
    loss = (model(x) - y).pow(2).mean()
    if mine and fault == "slow" and not inside and not cuda:
        (twin(x[:rows]) - y[:rows]).pow(2).mean().backward()
        twin.zero_grad(set_to_none=True)
    elif mine and fault == "pause":
        time.sleep(amount / 1000)
    loss.backward()
    opt.step()
    opt.zero_grad()
    if cuda:
        loss.item()


def timed_step(i, run):
    """``run()`` (step ``i``); a slow GPU's first three steps timed, its sleep set from the middle one."""
    timing = cuda and mine and fault == "slow" and i < 3
    if timing:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
    run()
    if timing:
        end.record()
        end.synchronize()
        warm.append(begin.elapsed_time(end) * 1e6)
        if len(warm) == 3:
            sleep["cycles"] = int((amount - 1) * sorted(warm)[1] * cycles_per_ns / 3)


if record == "profiler":
    # On a GPU the kernels too (CUDA activity), and three steps before the trace's window, in
    # which a slow GPU times its steps.
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    before = 3 if cuda else 1
    with profile(activities=activities, record_shapes=True,
                 schedule=schedule(wait=before, warmup=1, active=active),
                 on_trace_ready=tensorboard_trace_handler(out, worker_name=f"rank{rank}", use_gzip=True)) as prof:
        for i in range(active + before + 1):
            timed_step(i, step)
            prof.step()
else:
    if record == "collector+modules":
        instrument_module(layers, ["*"], collector=col)
    for i in range(active + 2):
        def recorded(i=i):
            with col.step(i):
                step()
        timed_step(i, recorded)
    col.close()
dist.barrier()
dist.destroy_process_group()
'''


def _numbers(text: str, kind: type) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def plan(seed: int, worlds: list[int], factors: list[float], pauses: list[float], healthy: int,
         each: int) -> list[dict]:
    rng = random.Random(seed)
    cases = [{"fault": "slow", "amount": f} for f in factors for _ in range(each)]
    cases += [{"fault": "pause", "amount": ms} for ms in pauses for _ in range(each)]
    cases += [{"fault": "healthy", "amount": 0} for _ in range(healthy)]
    for case in cases:
        case["world"] = rng.choice(worlds)
        case["planted"] = rng.randrange(case["world"]) if case["fault"] != "healthy" else -1
    rng.shuffle(cases)
    return cases


def run_job(case: dict, where: Path, active: int, timeout_s: float, record: str, wrap: str,
            kind: str = "cpu") -> float:
    """One job, every rank its own process, writing ``where/traces`` (profiler) or ``where/run``
    (collector); returns its wall time."""
    traces = where / ("traces" if record == "profiler" else "run")
    where.mkdir(parents=True)
    init = where / "init"
    t0 = time.perf_counter()
    procs = []
    for rank in range(case["world"]):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(case["world"]),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, "-c", JOB, str(init), str(traces), case["fault"], str(case["amount"]),
             str(case["planted"]), str(active), record, wrap, kind], env=env, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE))
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError("job timed out") from None
        if p.returncode:
            errors.append(err.decode(errors="replace").strip().splitlines()[-1:])
    if errors:
        raise RuntimeError(f"job failed: {errors}")
    return time.perf_counter() - t0


def megascope(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "megascope", *args], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"megascope {args[0]} failed: {out.stderr.strip()[-300:]}")
    return out.stdout


def score(case: dict, report: dict) -> dict:
    named = report.get("stragglers") or []
    first = named[0] if named else None
    hit = first is not None and first["rank"] == case["planted"]
    others = sorted({int(s["rank"]) for s in named} - {case["planted"]})
    return {"first": None if first is None else int(first["rank"]), "cause": None if first is None else first.get("cause"),
            "hit": hit, "others": others, "slowdown": None if first is None else first.get("slowdown")}


def report_and_log(i: int, case: dict, run_dir: Path, where: str, load: float, wall: float, log: Any) -> dict:
    """`megascope report` of job ``i``'s run, scored; its row written to ``log`` and a line printed."""
    report = json.loads(megascope("report", "--json", "-q", str(run_dir)))
    step_ns = (report.get("run") or {}).get("step_time_ns")
    fixed_ns = (report.get("whatif") or {}).get("whatif_step_time_ns")
    row = {**case, **score(case, report), "load": round(load, 2), "wall_s": round(wall, 1),
           "step_ms": None if step_ns is None else round(step_ns / 1e6, 2),
           "whatif_ms": None if fixed_ns is None else round(fixed_ns / 1e6, 2)}
    log.write(json.dumps(row) + "\n")
    log.flush()
    print(f"{i:3d} {case['fault']:7s} {case['amount']:>5} {where} planted {case['planted']:2d}: "
          f"first {row['first']} ({row['cause']}, {row['slowdown']}) others {row['others']} "
          f"step {row['step_ms']} ms (what-if {row['whatif_ms']}) load {load:.1f} {wall:.0f} s", flush=True)
    return row


def _median(values: list[float]) -> float | None:
    values = sorted(values)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def print_table(results: list[dict]) -> None:
    """The sweep's table: by fault and amount, the runs, those whose first named rank is the
    planted one and the causes they were given, those that named another rank, the load; and
    what a fault cost against what the report's what-if said fixing it would give: the runs' step
    and what-if step (medians) against the healthy runs' step of the same world size."""
    healthy: dict[int, list[float]] = {}
    for r in results:
        if r["fault"] == "healthy" and r.get("step_ms"):
            healthy.setdefault(r["world"], []).append(r["step_ms"])
    print("| fault | runs | planted rank named first | cause | another rank named | load (min-max) "
          "| step, ms | what-if step, ms | healthy step, ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key in sorted({(r["fault"], r["amount"]) for r in results}, key=lambda k: (k[0], k[1])):
        rows = [r for r in results if (r["fault"], r["amount"]) == key]
        causes: dict[str, int] = {}
        for r in rows:
            if r["hit"]:
                causes[str(r["cause"])] = causes.get(str(r["cause"]), 0) + 1
        label = "healthy" if key[0] == "healthy" else f"{key[0]} {key[1]:g}"
        hits = "-" if key[0] == "healthy" else f"{sum(r['hit'] for r in rows)}/{len(rows)}"
        loads = [r["load"] for r in rows]

        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f}"

        steps = _median([r["step_ms"] for r in rows if r.get("step_ms")])
        fixed = _median([r["whatif_ms"] for r in rows if r.get("whatif_ms")])
        base = _median([h for r in rows for h in healthy.get(r["world"], [])])
        print(f"| {label} | {len(rows)} | {hits} | {', '.join(f'{k} {v}' for k, v in sorted(causes.items())) or '-'} "
              f"| {sum(bool(r['others']) for r in rows)} | {min(loads):.1f}-{max(loads):.1f} "
              f"| {ms(steps)} | {ms(fixed)} | {ms(base)} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-o", "--out", type=Path, required=True, help="work directory (traces and runs)")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--worlds", type=lambda t: _numbers(t, int), default=[2, 3, 4, 5, 6])
    parser.add_argument("--factors", type=lambda t: _numbers(t, float), default=[1.15, 1.3, 1.6],
                        help="compute slowdowns of the planted rank")
    parser.add_argument("--pause-ms", type=lambda t: _numbers(t, float), default=[20, 50, 100])
    parser.add_argument("--healthy", type=int, default=6)
    parser.add_argument("--each", type=int, default=3, help="jobs per fault and amount")
    parser.add_argument("--active", type=int, default=12, help="profiled steps")
    parser.add_argument("--timeout-s", type=float, default=600)
    parser.add_argument("--keep", action="store_true", help="keep each job's traces and run")
    parser.add_argument("--record", choices=("profiler", "collector"), default="profiler")
    parser.add_argument("--modules", action="store_true",
                        help="with --record collector: forward and backward spans of the model's layers")
    parser.add_argument("--wrap", choices=("ddp", "fsdp1", "fsdp2"), default="ddp",
                        help="the model's data parallelism: DDP, FullyShardedDataParallel or fully_shard, layer by "
                             "layer, then the whole model")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no job after this many seconds of sweep (the table counts the jobs run)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: each rank on the GPU of its rank, NCCL, a device-bound model (needs as "
                             "many GPUs as the largest world)")
    args = parser.parse_args()
    if args.modules and args.record != "collector":
        parser.error("--modules needs --record collector")
    record = "collector+modules" if args.modules else args.record
    if args.healthy < 0 or args.each < 1 or args.active < 2:
        parser.error("--healthy must be >= 0, --each >= 1 and --active >= 2")
    if any(w < 2 for w in args.worlds):
        parser.error("--worlds: a distributed job needs at least 2 ranks")
    if any(f <= 1 or f > 2 for f in args.factors):
        parser.error("--factors: each must be above 1 and at most 2")
    args.out.mkdir(parents=True, exist_ok=True)
    cases = plan(args.seed, args.worlds, args.factors, args.pause_ms, args.healthy, args.each)
    results = []
    log = (args.out / "results.jsonl").open("a")
    started = time.monotonic()
    for i, case in enumerate(cases):
        if args.budget_s is not None and time.monotonic() - started > args.budget_s:
            print(f"budget of {args.budget_s:g} s spent: {len(cases) - i} of {len(cases)} jobs not run", flush=True)
            break
        where = args.out / f"job{i:03d}"
        shutil.rmtree(where, ignore_errors=True)
        load = os.getloadavg()[0]
        wall = run_job(case, where, args.active, args.timeout_s, record, args.wrap, args.device)
        if record == "profiler":
            megascope("ingest", "kineto", str(where / "traces"), "-o", str(where / "run"))
        results.append(report_and_log(i, case, where / "run", f"world {case['world']}", load, wall, log))
        if not args.keep:
            shutil.rmtree(where, ignore_errors=True)
    print()
    print_table(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
