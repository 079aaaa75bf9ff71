"""A real gloo job under torch.profiler, one rank slowed by real extra work, then a planted hang
captured by the flight recorder: both ingested, the slow rank and the hung rank named."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import pytest

from megascope.ingest import ingest_flight_recorder, ingest_kineto
from megascope.store import open_run

WORLD = 3
SLOW_RANK = 1
HUNG_RANK = 2
STEPS = 5  # 1 wait + 1 warmup + 3 recorded


def _job(rank: int, init_file: str, trace_dir: str, fr_dir: str) -> None:
    import gc

    gc.freeze()  # a forked child must never finalize what it inherited (DuckDB objects crash)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.profiler import ProfilerActivity, profile, schedule

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    model = DistributedDataParallel(nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 128)
    extra = torch.randn(256, 256)

    def handler(prof: profile) -> None:
        prof.export_chrome_trace(f"{trace_dir}/rank{rank}.pt.trace.json.gz")

    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=STEPS - 2),
                 on_trace_ready=handler) as prof:
        for _ in range(STEPS):
            loss = model(x).pow(2).mean()
            if rank == SLOW_RANK:
                for _ in range(30):  # real extra compute, nothing labels it
                    extra = torch.tanh(extra @ extra)
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step()

    # The hang: every rank but HUNG_RANK enters one more all-reduce; all dump the flight recorder
    # while the collective is stuck, then HUNG_RANK joins late so the job ends cleanly.
    t = torch.ones(4)
    dump = torch._C._distributed_c10d._dump_fr_trace
    if rank != HUNG_RANK:
        work = dist.all_reduce(t, async_op=True)
        Path(f"{fr_dir}/fr_{rank}").write_bytes(dump(includeStackTraces=False))
        Path(f"{fr_dir}/.done{rank}").touch()
        work.wait()
    else:
        deadline = time.monotonic() + 60
        while sum(1 for r in range(WORLD) if Path(f"{fr_dir}/.done{r}").exists()) < WORLD - 1:
            if time.monotonic() > deadline:
                raise TimeoutError("peers did not dump")
            time.sleep(0.02)
        Path(f"{fr_dir}/fr_{rank}").write_bytes(dump(includeStackTraces=False))
        dist.all_reduce(t)
    dist.destroy_process_group()
    # Leave without torch's teardown: destroying the DDP model's reducer at exit frees the gloo
    # group, whose thread may still be releasing a finished work's tensors and waits for the
    # interpreter lock that the destroying thread holds while it joins that thread (a child of
    # this test hung there, once). Everything this job writes is written and closed by now.
    os._exit(0)


@pytest.mark.dist
def test_real_gloo_job_slow_rank_and_hang(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    traces = tmp_path / "traces"
    dumps = tmp_path / "dumps"
    traces.mkdir()
    dumps.mkdir()
    import gc

    gc.collect()
    # Spawned, not forked: a forked child inherits torch's flight recorder, with the entries of every
    # process group this test process used before (other tests' in-process groups named "0" too),
    # and its dump then shows collectives the job never issued.
    mp.start_processes(_job, args=(str(tmp_path / "init"), str(traces), str(dumps)), nprocs=WORLD,
                       start_method="spawn", join=True)
    for p in dumps.glob(".done*"):
        p.unlink()

    ingest_kineto(traces, tmp_path / "run")
    run = open_run(tmp_path / "run")
    con = run.con
    assert run.meta.world_size == WORLD and run.problems == []
    steps = con.execute("SELECT rank, count(*) FROM spans WHERE kind = 'step' GROUP BY rank ORDER BY rank").fetchall()
    assert steps == [(r, STEPS - 2) for r in range(WORLD)]
    # every collective instance has all ranks, and the slow rank arrives last at most of them
    sizes = con.execute("SELECT DISTINCT count(*) FROM spans WHERE kind = 'collective' GROUP BY seq").fetchall()
    assert sizes == [(WORLD,)]
    last = dict(con.execute("""SELECT last, count(*) FROM (SELECT seq, arg_max(rank, start_ns) AS last FROM spans
                               WHERE kind = 'collective' GROUP BY seq) GROUP BY last""").fetchall())
    assert max(last, key=lambda r: last[r]) == SLOW_RANK
    compute = con.execute("""SELECT rank FROM spans WHERE kind IN ('forward', 'backward', 'compute')
                             GROUP BY rank ORDER BY sum(dur_ns) DESC LIMIT 1""").fetchone()
    assert compute == (SLOW_RANK,)
    analysis = pytest.importorskip("megascope.analysis")
    if hasattr(analysis, "report"):
        report = analysis.report(run)
        assert report["stragglers"] and report["stragglers"][0]["rank"] == SLOW_RANK

    ingest_flight_recorder(dumps, tmp_path / "hang", world_size=WORLD)
    hang = open_run(tmp_path / "hang")
    hcon = hang.con
    last_enq = dict(hcon.execute("SELECT rank, max(seq) FROM markers WHERE state = 'enqueued' GROUP BY rank").fetchall())
    stuck = max(last_enq.values())
    assert {r for r, s in last_enq.items() if s == stuck} == set(range(WORLD)) - {HUNG_RANK}
    assert last_enq[HUNG_RANK] == stuck - 1
    if hasattr(analysis, "localize"):
        verdict = analysis.localize(hang)
        assert verdict["hung"] and verdict["suspects"][0]["rank"] == HUNG_RANK


def _rs_job(rank: int, init_file: str, trace_dir: str) -> None:
    import gc

    gc.freeze()
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    grads, shard, norm = torch.ones(2 * 4096), torch.empty(4096), torch.ones(1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):  # FSDP's gradient reduction, then a norm: 3 reduce-scatters, 3 all-reduces
            dist.reduce_scatter_tensor(shard, grads)
            dist.all_reduce(norm)
    prof.export_chrome_trace(f"{trace_dir}/rank{rank}.pt.trace.json")
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.dist
def test_gloo_reduce_scatter_pairs_with_the_all_reduce_gloo_runs_it_as(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    traces = tmp_path / "traces"
    traces.mkdir()
    import gc

    gc.collect()
    mp.start_processes(_rs_job, args=(str(tmp_path / "init"), str(traces)), nprocs=2, start_method="fork", join=True)
    result = ingest_kineto(traces, tmp_path / "run")
    assert not any("no execution" in w or "without an enqueue" in w for w in result.warnings), result.warnings
    con = open_run(tmp_path / "run").con
    ops = con.execute("SELECT rank, list(op ORDER BY start_ns) FROM spans WHERE kind = 'collective' GROUP BY 1 "
                      "ORDER BY 1").fetchall()
    assert ops == [(r, ["reduce_scatter", "all_reduce"] * 3) for r in range(2)]
    # Each execution is its own call's: it starts after the call was enqueued.
    late = con.execute("""SELECT count(*) FROM spans s JOIN markers m ON s.rank = m.rank AND s.seq = m.seq
                          AND s."group" = m."group" AND m.state = 'enqueued'
                          WHERE s.kind = 'collective' AND s.start_ns + 1000 < m.time_ns""").fetchone()
    assert late == (0,)
