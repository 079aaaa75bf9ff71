"""The collector across gloo ranks: agreement of sequence numbers, arrival order, hangs, SIGKILL, bad disks."""

from __future__ import annotations

import functools
import gc
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp_mp
from conftest import wait_until
from megascope.collectors import Collector, CollectorConfig

from megascope.schema import RunMeta, SpanKind
from megascope.store import open_run
from megascope.topology import Mesh

pytestmark = pytest.mark.dist

INTERVAL_S = 0.2


def _init(rank: int, world: int, tmp: Path) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'init'}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))


def _collector(rank: int, world: int, run: Path, mesh: Mesh, **kw: Any) -> Collector:
    cfg = CollectorConfig(run_dir=run, flush_interval_s=INTERVAL_S, device=torch.device("cpu"), **kw)
    meta = RunMeta(run_id="dist", source="collector", world_size=world, mesh_sizes=mesh.size)
    return Collector(cfg, rank=rank, world_size=world, coords=mesh.coords(rank), meta=meta)


def _frozen_child(fn: Any, *args: Any) -> Any:
    gc.freeze()  # a forked child must never finalize what it inherited (DuckDB objects crash)
    return fn(*args)


def _launch(fn: Any, nprocs: int, args: tuple[Any, ...], *, join: bool = True) -> Any:
    gc.collect()
    return tmp_mp.start_processes(functools.partial(_frozen_child, fn), args=args, nprocs=nprocs,
                                  start_method="fork", join=join)


# ---------------------------------------------------------------------------------------- agreement
def _agreement_rank(rank: int, world: int, tmp: Path, run: Path) -> None:
    _init(rank, world, tmp)
    mesh = Mesh.for_world(world, tp=2)
    col = _collector(rank, world, run, mesh, flight_recorder=True)
    pgs = {}
    for axis in ("tp", "dp"):  # every rank creates every group, in the same order
        for group in mesh.groups(axis):
            pg = dist.new_group(list(group.members))
            if rank in group.members:
                pgs[axis] = pg
                col.register_group(pg, group)
    col.register_group(None, mesh.group_of(rank, "world"))
    tp_peer = mesh.group_of(rank, "tp").members[1 - mesh.coords(rank)["tp"]]
    d = col.dist
    for step in range(2):
        with col.step(step):
            t = torch.full((64,), float(rank))
            d.all_reduce(t, group=pgs["tp"])
            out = torch.empty(128)
            d.all_gather_single(out, torch.ones(64), group=pgs["dp"])
            rs_out = torch.empty(32)
            work = d.reduce_scatter_single(rs_out, torch.ones(64), group=pgs["dp"], async_op=True)
            work.wait()
            d.broadcast(t, src=0)
            d.all_to_all_single(torch.empty(world * 4), torch.ones(world * 4))
            send, recv = torch.full((8,), float(rank)), torch.empty(8)
            reqs = [d.isend(send, tp_peer), d.irecv(recv, tp_peer)]
            for r in reqs:
                r.wait()
            ops = [dist.P2POp(dist.isend, send, tp_peer), dist.P2POp(dist.irecv, recv, tp_peer)]
            for r in d.batch_isend_irecv(ops):
                r.wait()
            assert recv[0].item() == float(tp_peer)
            if step == 1 and rank == world - 1:
                time.sleep(0.08)  # a compute straggler: arrives last at the next collective
            d.all_reduce(torch.ones(4))
            d.barrier()
    col.close()
    dist.destroy_process_group()


def test_every_rank_writes_and_members_agree_on_sequence_numbers(tmp_path: Path) -> None:
    run, world = tmp_path / "run", 4
    _launch(_agreement_rank, world, (world, tmp_path, run))
    r = open_run(run)
    assert r.problems == []
    con = r.con
    ranks = con.sql("SELECT rank, coords['pp'], coords['dp'], coords['tp'] FROM ranks ORDER BY rank").fetchall()
    mesh = Mesh.for_world(world, tp=2)
    assert ranks == [(i, *(mesh.coords(i)[a] for a in ("pp", "dp", "tp"))) for i in range(world)]

    # Collectives: every member of the group took part in every (group, seq) instance, same op.
    rows = con.sql("""
        SELECT s."group", s.seq, list(DISTINCT s.op) AS ops, list(s.rank ORDER BY s.rank) AS ranks,
               any_value(g.members) AS members
        FROM spans s JOIN groups g ON g."group" = s."group" AND g.rank = s.rank
        WHERE s.kind = 'collective' GROUP BY ALL""").fetchall()
    for group, seq, ops, members_seen, members in rows:
        assert len(ops) == 1, (group, seq, ops)
        assert sorted(members_seen) == sorted(members), (group, seq)
    per_group = dict(con.sql("""SELECT "group", count(DISTINCT seq) FROM spans WHERE kind = 'collective'
                                GROUP BY ALL""").fetchall())
    assert per_group == {"tp:0": 2, "tp:1": 2, "dp:0": 4, "dp:1": 4, "world": 8}

    # Point-to-point: every send has the matching recv on its peer with the same (group, seq, bytes).
    unmatched = con.sql("""
        SELECT s.rank, s.peer, s.seq FROM spans s
        LEFT JOIN spans r ON r.kind = 'recv' AND r.rank = s.peer AND r.peer = s.rank
                         AND r."group" = s."group" AND r.seq = s.seq AND r.bytes = s.bytes
        WHERE s.kind = 'send' AND r.rank IS NULL""").fetchall()
    assert unmatched == []
    assert con.sql("SELECT count(*) FROM spans WHERE kind = 'send'").fetchall() == [(world * 2 * 2,)]

    # Markers: every communication span has exactly one enqueued and one completed marker.
    bad = con.sql("""
        SELECT s.rank, s."group", s.seq, s.op, count(m.state) AS n FROM spans s
        LEFT JOIN markers m ON m.rank = s.rank AND m."group" = s."group" AND m.seq = s.seq AND m.op = s.op
        WHERE s."group" IS NOT NULL GROUP BY ALL HAVING n <> 2""").fetchall()
    assert bad == []

    # Arrival: in step 1's first world all-reduce the sleeping rank arrives last; the others wait for it.
    arrivals = con.sql("""
        SELECT rank, start_ns, dur_ns FROM spans WHERE "group" = 'world' AND op = 'all_reduce' AND step = 1
        ORDER BY start_ns""").fetchall()
    assert arrivals[-1][0] == world - 1
    assert all(dur >= 50_000_000 for rank, _, dur in arrivals[:-1])

    # The flight recorder's own trail, under its own group ids, agrees across members too.
    fr = con.sql("""SELECT "group", seq, count(DISTINCT rank) FROM markers
                    WHERE "group" LIKE 'fr:%' AND state = 'enqueued' GROUP BY ALL""").fetchall()
    assert fr and {g for g, _, _ in fr} >= {"fr:world"}
    assert all(n == (world if g == "fr:world" else 2) for g, _, n in fr)


# ---------------------------------------------------------------------------------------- hang
def _hang_rank(rank: int, world: int, tmp: Path, run: Path, hang_step: int) -> None:
    _init(rank, world, tmp)
    mesh = Mesh.for_world(world)
    col = _collector(rank, world, run, mesh)
    col.register_group(None, mesh.group_of(rank, "world"))
    for step in range(hang_step + 2):
        with col.step(step):
            if rank == world - 1 and step == hang_step:
                time.sleep(600)  # stops before its next collective; the test kills it
            with col.span("forward", kind=SpanKind.FORWARD):
                time.sleep(0.002)
            col.dist.all_reduce(torch.ones(16))
    col.close()


def _markers(run: Path) -> list[tuple[int, int, str]]:
    try:
        r = open_run(run)
        try:
            return r.con.sql("SELECT rank, seq, state FROM markers WHERE \"group\" = 'world'").fetchall()
        finally:
            r.con.close()
    except Exception:
        return []


def test_markers_tell_waiting_ranks_from_the_missing_one(tmp_path: Path) -> None:
    run, world, hang_step = tmp_path / "run", 3, 3
    ctx = _launch(_hang_rank, world, (world, tmp_path, run, hang_step), join=False)
    try:
        def told() -> bool:
            """Every rank's completion of the step before the hang, and the waiting ranks' entries."""
            markers = _markers(run)
            waiting = {r for r, seq, st in markers if seq == hang_step and st == "enqueued"}
            done = {r for r, seq, st in markers if seq == hang_step - 1 and st == "completed"}
            return waiting >= {0, 1} and done == set(range(world))

        wait_until(told, timeout=60, interval=0.1, message="the trail of the hang on disk")
        # The job is still hung (no rank has returned from seq hang_step), yet the files tell; two
        # more flush intervals give a wrong marker (a completion, the missing rank's entry) the time
        # to show up.
        time.sleep(2 * INTERVAL_S)
        markers = _markers(run)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        for p in ctx.processes:
            p.join(timeout=30)
    enqueued = {(r, s) for r, s, st in markers if st == "enqueued"}
    completed = {(r, s) for r, s, st in markers if st == "completed"}
    last_completed = {r: max(s for rr, s in completed if rr == r) for r in range(world)}
    assert last_completed == {0: hang_step - 1, 1: hang_step - 1, 2: hang_step - 1}
    waiting = {r for r in range(world) if (r, hang_step) in enqueued and (r, hang_step) not in completed}
    missing = {r for r in range(world) if (r, hang_step) not in enqueued}
    assert waiting == {0, 1} and missing == {2}


# ---------------------------------------------------------------------------------------- SIGKILL
def _steady_rank(rank: int, run: Path, progress: Any) -> None:
    torch.set_num_threads(1)
    col = _collector(rank, 1, run, Mesh.for_world(1))
    step = 0
    while True:
        with col.step(step), col.span("forward", kind=SpanKind.FORWARD):
            time.sleep(0.005)
        progress.value = step  # steps 0..value have finished
        step += 1


@pytest.mark.timing
def test_sigkilled_rank_leaves_a_readable_run_losing_at_most_one_interval(tmp_path: Path) -> None:
    run = tmp_path / "run"
    progress = tmp_mp.get_context("fork").Value("l", -1)
    ctx = _launch(_steady_rank, 1, (run, progress), join=False)
    history: list[tuple[float, int]] = []
    try:
        # A busy machine may take a while to get the child going.
        wait_until(lambda: progress.value >= 5, timeout=60, interval=0.01, message="five steps done")
        # The rank's progress against the clock for 1.5 s: what was done when, to compare with the disk.
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            history.append((time.monotonic(), progress.value))
            time.sleep(0.01)
        killed_at = time.monotonic()
    finally:
        os.kill(ctx.processes[0].pid, signal.SIGKILL)
        ctx.processes[0].join(timeout=30)
    r = open_run(run)
    assert r.problems == []  # every part readable: no half-written file is visible
    steps = [s for (s,) in r.con.sql("SELECT step FROM spans WHERE kind = 'step' ORDER BY step").fetchall()]
    assert steps == list(range(len(steps)))  # a prefix, no holes
    # Everything finished one interval (plus scheduling slack on a busy machine) before the kill is on disk.
    slack_s = 0.5
    done_before = max((v for t, v in history if t <= killed_at - INTERVAL_S - slack_s), default=-1)
    assert done_before > 0 and steps[-1] >= done_before


# ---------------------------------------------------------------------------------------- bad disk
def _bad_disk_rank(rank: int, world: int, tmp: Path, run: Path, results: Any) -> None:
    _init(rank, world, tmp)
    col = _collector(rank, world, run, Mesh.for_world(world))
    total = 0.0
    for step in range(5):
        with col.step(step):
            t = torch.full((4,), float(rank + 1))
            col.dist.all_reduce(t)
            total += float(t[0])
        col.metric("total", total)
    col.close()
    results.put((rank, total, col.stats["write_errors"]))
    dist.destroy_process_group()


def test_unwritable_run_dir_does_not_stop_a_distributed_job(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the run directory should go")
    results = tmp_mp.get_context("fork").SimpleQueue()
    _launch(_bad_disk_rank, 2, (2, tmp_path, blocker / "run", results))
    got = sorted(results.get() for _ in range(2))
    assert [(r, total) for r, total, _ in got] == [(0, 15.0), (1, 15.0)]  # (1+2) x 5 steps on both
    assert all(errors > 0 for _, _, errors in got)


# ---------------------------------------------------------------------------------------- SIGTERM
def _parked_rank(rank: int, run: Path, progress: Any) -> None:
    torch.set_num_threads(1)
    cfg = CollectorConfig(run_dir=run, flush_interval_s=3600.0, device=torch.device("cpu"))  # only SIGTERM flushes
    col = Collector(cfg, rank=rank, world_size=1)
    step = 0
    while True:
        with col.step(step), col.span("forward", kind=SpanKind.FORWARD):
            time.sleep(0.002)
        progress.value = step
        step += 1


def test_sigterm_flushes_then_terminates(tmp_path: Path) -> None:
    run = tmp_path / "run"
    progress = tmp_mp.get_context("fork").Value("l", -1)
    ctx = _launch(_parked_rank, 1, (run, progress), join=False)
    proc = ctx.processes[0]
    try:
        wait_until(lambda: progress.value >= 10, timeout=60, interval=0.01, message="ten steps done")
    finally:
        done = progress.value
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(timeout=30)
    assert proc.exitcode == -signal.SIGTERM  # the default action still happens after the flush
    steps = [s for (s,) in open_run(run).con.sql("SELECT step FROM spans WHERE kind = 'step' ORDER BY 1").fetchall()]
    assert done >= 10 and steps[: done + 1] == list(range(done + 1))
