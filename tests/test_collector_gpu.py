"""The collector's CUDA path: pooled events, no device synchronization, wall-clock mapping (GPU machine only)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from megascope.collectors import Collector, CollectorConfig, instrument_module

from megascope.schema import RunMeta, SpanKind
from megascope.store import open_run

pytestmark = pytest.mark.gpu

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _collector(run: Path, clock: str = "device", sample: tuple[str, ...] = ()) -> Collector:
    cfg = CollectorConfig(run_dir=run, flush_interval_s=0.2, device=torch.device("cuda"), handle_sigterm=False,
                          clock=clock, comm_sample_kinds=sample)
    return Collector(cfg, rank=0, world_size=1, coords={"pp": 0, "dp": 0, "tp": 0},
                     meta=RunMeta(run_id="gpu", source="collector", world_size=1))


class _Block(torch.nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(h, 4 * h)
        self.down = torch.nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


@needs_cuda
@pytest.mark.parametrize("clock", ["device", "side-stream"])
def test_cuda_spans_need_no_device_sync_and_map_to_wall_clock(tmp_path: Path, clock: str) -> None:
    run = tmp_path / "run"
    col = _collector(run, clock)
    model = torch.nn.Sequential(*[_Block(512) for _ in range(4)]).cuda()
    handles = instrument_module(model, ["*"], collector=col)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(256, 512, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    before_ns = time.time_ns()
    losses = []
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call in the loop raises
    try:
        for step in range(5):
            with col.step(step):
                with col.span("forward", kind=SpanKind.FORWARD, microbatch=0):
                    loss = model(x).pow(2).mean()
                with col.span("backward", kind=SpanKind.BACKWARD, microbatch=0):
                    loss.backward()
                with col.comm(op="all_reduce", group="world", bytes=4 * 512):
                    g = torch.cat([p.grad.flatten() for p in model.parameters()])  # stands in for NCCL
                    g.mul_(1.0)
                with col.span("optimizer", kind=SpanKind.OPTIMIZER):
                    opt.step()
                    opt.zero_grad(set_to_none=False)
            col.metric("loss", loss)  # a device tensor: copied asynchronously
            losses.append(loss.detach().clone())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    after_ns = time.time_ns()
    for h in handles:
        h.remove()
    col.close()
    assert col.stats["rows_dropped"] == 0 and col.stats["spans_pending"] == 0

    r = open_run(run)
    # The device-timed spans (the interpreter's garbage collections are host spans, some from setup).
    spans = r.con.sql("SELECT * FROM spans WHERE name NOT LIKE 'gc.%' ORDER BY start_ns").df()
    assert set(spans["kind"]) >= {"step", "forward", "backward", "collective", "optimizer"}
    assert len(spans[spans["kind"] == "backward"]) == 5 * 4 + 5
    # Device times mapped through the anchor fall inside the host's bracket (2 ms of tolerance).
    assert spans["start_ns"].min() >= before_ns - 2_000_000
    assert (spans["start_ns"] + spans["dur_ns"]).max() <= after_ns + 2_000_000
    steps = spans[spans["kind"] == "step"].sort_values("step")
    assert list(steps["step"]) == [0, 1, 2, 3, 4] and (steps["dur_ns"] > 0).all()
    # Steps follow each other on the device: each begins after the previous ended (less 50 us of rounding).
    ends = (steps["start_ns"] + steps["dur_ns"]).to_numpy()
    assert (steps["start_ns"].to_numpy()[1:] >= ends[:-1] - 50_000).all()
    metrics = r.con.sql("SELECT step, value FROM metrics WHERE name = 'loss' ORDER BY step").fetchall()
    assert [s for s, _ in metrics] == [0, 1, 2, 3, 4]
    assert [v for _, v in metrics] == pytest.approx([float(t) for t in losses], rel=1e-6)


@needs_cuda
@pytest.mark.parametrize("clock", ["device", "side-stream"])
def test_a_span_times_the_device_work_inside_it(tmp_path: Path, clock: str) -> None:
    """A span around 20 GEMMs, issued while the device is still busy with 20 more before it, lasts
    what its GEMMs take on the device (timed by plain CUDA events), not the host's issue time."""
    run = tmp_path / "run"
    col = _collector(run, clock)
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(3):
        a @ a  # warm-up
    ref0, ref1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    with col.step(0):
        for _ in range(20):
            a @ a  # queued work ahead of the span
        ref0.record()
        with col.span("gemms", kind=SpanKind.COMPUTE):
            for _ in range(20):
                a @ a
        ref1.record()
    torch.cuda.synchronize()
    col.close()
    dur_ns = open_run(run).con.sql("SELECT dur_ns FROM spans WHERE name = 'gemms'").fetchall()[0][0]
    ref_ns = ref0.elapsed_time(ref1) * 1e6
    assert ref_ns > 5e6  # the GEMMs take real time
    assert dur_ns == pytest.approx(ref_ns, rel=0.05)


def _sleep_cycles(ms: float) -> int:
    """Cycles of ``torch.cuda._sleep`` that keep the device busy about ``ms`` milliseconds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(10_000_000)  # the clock up first
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return int(10_000_000 * ms / start.elapsed_time(end))


@pytest.fixture
def nccl_world(tmp_path: Path) -> Iterator[None]:
    """A one-rank NCCL process group for the test's duration."""
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


@needs_cuda
def test_nccl_collectives_record_arrival_on_the_stream(tmp_path: Path, nccl_world: None) -> None:
    run = tmp_path / "run"
    col = _collector(run)
    t = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(3):
            with col.step(step):
                col.dist.all_reduce(t)
                work = col.dist.all_reduce(t, async_op=True)
                work.wait()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    col.close()
    rows = open_run(run).con.sql("""SELECT seq, state FROM markers ORDER BY seq, state""").fetchall()
    assert rows == [(s, st) for s in range(6) for st in ("completed", "enqueued")]


@needs_cuda
def test_the_nccl_groups_timeout_goes_into_run_json(tmp_path: Path, nccl_world: None) -> None:
    """The one-rank NCCL group's timeout (60 s, the fixture's) is the run's collective timeout."""
    run = tmp_path / "run"
    col = _collector(run)
    with col.step(0):
        pass
    col.close()
    assert open_run(run).meta.config["collective_timeout_s"] == 60.0


@needs_cuda
@pytest.mark.parametrize("record_calls", ["driver", "torch"])
def test_a_call_issued_on_a_stream_of_its_own_is_labelled_with_it(tmp_path: Path, nccl_world: None,
                                                                   record_calls: str) -> None:
    """FSDP issues its all-gathers and reduce-scatters on streams of their own: such a call starts
    when that stream is free, not when the device is, and its span says `cuda:<id>` (the analysis
    leaves it out of the host's lead); a call on the default stream says `comm`."""
    run = tmp_path / "run"
    col = _collector(run)
    if record_calls == "torch":  # the stamps through torch's records, not the driver's
        col._timer._rec = None
    t = torch.ones(1 << 16, device="cuda")
    side = torch.cuda.Stream()
    for step in range(2):
        with col.step(step):
            col.dist.all_reduce(t)
            with torch.cuda.stream(side):
                col.dist.all_reduce(t)
            torch.cuda.current_stream().wait_stream(side)
    col.close()
    rows = open_run(run).con.sql("SELECT seq, stream FROM spans WHERE kind = 'collective' ORDER BY seq").fetchall()
    assert rows == [(s, "comm" if s % 2 == 0 else f"cuda:{side.stream_id}") for s in range(4)]


def _side_stream_job(run: Path, call: Any) -> tuple[Any, ...]:
    """A stream of its own, a call's output and input (made once by ``call``: the communicator's
    creation is the first call's host time), 30 ms of sleep in clock cycles, and a collector whose
    interception is installed."""
    from megascope.collectors.hooks import Interception

    side = torch.cuda.Stream()
    out, inp = torch.zeros(1 << 16, device="cuda"), torch.ones(1 << 16, device="cuda")
    call(out, inp)
    cycles = _sleep_cycles(30)
    col = _collector(run)
    return side, out, inp, cycles, col, Interception(col).install()


def _check_wait_spans(run: Path, side: Any, name: str, op: str) -> None:
    """Six calls on ``side``, each with its wait span: long for the even ones (their stream was
    busy 30 ms), short for the odd ones (compute was)."""
    con = open_run(run).con
    calls = con.sql("SELECT seq, stream FROM spans WHERE kind = 'collective' ORDER BY seq").fetchall()
    assert calls == [(s, f"cuda:{side.stream_id}") for s in range(6)]
    waits = con.sql(f"SELECT seq, op, dur_ns FROM spans WHERE name = '{name}:wait' ORDER BY seq").fetchall()
    assert [(s, o) for s, o, _ in waits] == [(s, op) for s in range(6)]
    # The sleep's length follows the clock the device runs at: bounds far from it either way.
    assert all(d > 10_000_000 for s, _, d in waits if s % 2 == 0), waits   # the call's stream was busy
    assert all(d < 2_000_000 for s, _, d in waits if s % 2 == 1), waits    # compute was


@needs_cuda
def test_a_call_on_a_stream_of_its_own_gets_a_wait_span_where_the_compute_stream_waits(
        tmp_path: Path, nccl_world: None) -> None:
    """FSDP2's shape: an all-gather issued on a stream of its own, the compute stream made to wait
    for it later. Its span is written once, labelled with its stream, and its wait span runs
    from where the compute stream came to wait to the call's completion: long where the gather's
    stream was still busy (30 ms of sleep queued before it), short where compute was."""
    import torch.distributed as dist

    side, out, inp, cycles, col, interception = _side_stream_job(tmp_path / "run", dist.all_gather_into_tensor)

    class Group:
        def __init__(self, busy: str) -> None:
            self.busy = busy

        def unshard(self) -> None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                if self.busy == "gather":
                    torch.cuda._sleep(cycles)
                dist.all_gather_into_tensor(out, inp)

        def wait_for_unshard(self) -> None:
            torch.cuda.current_stream().wait_stream(side)

    interception.hold_until_waited(Group, "unshard", "wait_for_unshard")
    try:
        for step in range(3):
            with col.step(step):
                for busy in ("gather", "compute"):
                    group = Group(busy)
                    group.unshard()
                    if busy == "compute":
                        torch.cuda._sleep(cycles)
                    group.wait_for_unshard()
        torch.cuda.synchronize()
    finally:
        interception.uninstall()
    col.close()
    _check_wait_spans(tmp_path / "run", side, "all_gather_into_tensor", "all_gather")


@needs_cuda
def test_a_reduce_scatter_on_a_stream_of_its_own_gets_a_wait_span_where_the_next_group_waits(
        tmp_path: Path, nccl_world: None) -> None:
    """FSDP2's backward: each group reduce-scatters on a stream of its own in ``post_backward``,
    and the next group's ``post_backward`` makes the compute stream wait for it. The wait span runs
    from there to the call's completion: long where the reduce-scatter's stream was still busy
    (30 ms of sleep queued before it), short where compute was."""
    import torch.distributed as dist

    side, out, inp, cycles, col, interception = _side_stream_job(tmp_path / "run", dist.reduce_scatter_tensor)

    class Group:
        def __init__(self, busy: str) -> None:
            self.busy = busy

        def post_backward(self) -> None:
            torch.cuda.current_stream().wait_stream(side)  # the previous reduce-scatter
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                if self.busy == "scatter":
                    torch.cuda._sleep(cycles)
                dist.reduce_scatter_tensor(out, inp)
            if self.busy == "compute":
                torch.cuda._sleep(cycles)

        def finalize_backward(self) -> None:
            torch.cuda.current_stream().wait_stream(side)

    interception.hold_reductions(Group)
    try:
        for step in range(3):
            with col.step(step):
                for busy in ("scatter", "compute"):
                    Group(busy).post_backward()
                Group("none").finalize_backward()
        torch.cuda.synchronize()
    finally:
        interception.uninstall()
    col.close()
    _check_wait_spans(tmp_path / "run", side, "reduce_scatter_tensor", "reduce_scatter")


@needs_cuda
def test_nccl_calls_left_untimed_keep_their_markers_and_cost_no_timing_event(tmp_path: Path,
                                                                            nccl_world: None) -> None:
    run = tmp_path / "run"
    col = _collector(run, sample=("world",))
    t = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    stamps = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(2):
            with col.step(step):
                for mb in range(3):
                    with col.span("forward", kind=SpanKind.FORWARD, microbatch=mb):
                        before = col._timer.stamps
                        col.dist.all_reduce(t)
                        col.dist.all_reduce(t, async_op=True).wait()
                        stamps.append(col._timer.stamps - before)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    col.close()
    assert stamps == [5, 0, 0] * 2  # blocking 2, asynchronous 3 (its wait shares the end)
    con = open_run(run).con
    assert con.sql("SELECT DISTINCT microbatch FROM spans WHERE \"group\" IS NOT NULL").fetchall() == [(0,)]
    done = con.sql("SELECT seq FROM markers WHERE state = 'completed' ORDER BY seq").fetchall()
    assert done == [(s,) for s in range(12)]
    assert col.stats["untimed_calls"] == 8


@needs_cuda
def test_nccl_flight_recorder_entries_become_markers_in_the_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-job poller (``flight_recorder=True``) reads NCCL's recorder: in torch 2.11 its entries
    are not in ``_dump_fr_trace``, only in ``_dump_nccl_trace``."""
    import torch.distributed as dist

    monkeypatch.setenv("TORCH_NCCL_ENABLE_TIMING", "1")
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "200")
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        run = tmp_path / "run"
        cfg = CollectorConfig(run_dir=run, flush_interval_s=0.2, device=torch.device("cuda"), handle_sigterm=False,
                              flight_recorder=True)
        col = Collector(cfg, rank=0, world_size=1, meta=RunMeta(run_id="gpu-fr", source="collector", world_size=1))
        t = torch.ones(1 << 20, device="cuda")
        torch.cuda.synchronize()
        start_ns = time.time_ns()
        for step in range(3):
            with col.step(step):
                col.dist.all_reduce(t)
                col.dist.all_reduce(t, async_op=True).wait()
        torch.cuda.synchronize()
        time.sleep(2.0)  # NCCL's watchdog marks the entries completed; the writer polls every flush
        col.close()
    finally:
        dist.destroy_process_group()
    # The recorder is the process's: it also holds the groups of this process's earlier tests, which
    # reused this group's name and numbers. The poller leaves their entries out.
    rows = open_run(run).con.execute("""
        SELECT seq, list(DISTINCT state ORDER BY state), min(time_ns) FROM markers
        WHERE starts_with("group", 'fr:') GROUP BY seq ORDER BY seq""").fetchall()
    assert [seq for seq, _, _ in rows] == list(range(1, 7))  # torch numbers a group's collectives from 1
    assert all(states == ["completed", "enqueued", "started"] for _, states, _ in rows)
    assert all(first >= start_ns for _, _, first in rows)


@needs_cuda
@pytest.mark.parametrize("calls", ["driver", "driver-held"])
def test_driver_event_calls_agree_with_torchs_from_any_thread(calls: str) -> None:
    """The writer's calls through the driver give torch's answers on the same events: done or not,
    and the time from the anchor to each, also from a thread that never used CUDA (given the
    device's context at its first call); whether or not the calls keep the interpreter lock."""
    import threading

    from megascope.collectors import timing

    timer = timing.CudaTimer(torch.device("cuda"), anchor_interval_s=3600.0, event_calls=calls)
    assert timer.event_calls == calls
    x = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    ref = timer.anchor_ref
    t0 = timer.stamp()
    for _ in range(20):
        x = x @ x / 2048
    t1 = timer.stamp()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time: the next event is not done for a while
    t2 = timer.stamp()
    assert t0 is not None and t1 is not None and t2 is not None
    assert not timer.ready(t2)
    with pytest.raises(RuntimeError):
        timer.wall_ns(t2, ref)
    torch.cuda.synchronize()
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.extend([timer.ready(t2)] + [timer.wall_ns(t, ref) for t in (t0, t1, t2)]))
    thread.start()
    thread.join()
    anchor = timer.anchor_of(ref)
    via_torch = [anchor.wall_ns + round(anchor.mark.elapsed_time(timer._events[t]) * 1e6) for t in (t0, t1, t2)]
    assert got[0] is True and got[1:] == via_torch
    assert via_torch[0] < via_torch[1] < via_torch[2]


@needs_cuda
def test_records_through_the_driver_time_the_work_as_torchs_records_do() -> None:
    """``record_calls="driver"``: stamps and marks recorded by ``cuEventRecord`` on the current
    stream (the default stream, a stream of the job's own, a thread other than the one that made
    the timer) time the same work as torch's records around it; the driver refuses none."""
    import contextlib
    import threading

    from megascope.collectors import timing

    timer = timing.CudaTimer(torch.device("cuda"), anchor_interval_s=3600.0, record_calls="driver")
    assert timer.record_calls == "driver"
    x = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    ref = timer.anchor_ref
    measured: list[tuple[float, float]] = []

    def timed(stream: torch.cuda.Stream | None) -> None:
        nonlocal x
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record()
            t0 = timer.stamp()
            for _ in range(20):
                x = x @ x / 2048
            t1 = timer.stamp()
            after.record()
            mark = timer.mark()
        torch.cuda.synchronize()
        assert t0 is not None and t1 is not None and mark is not None and timer.mark_done(mark)
        measured.append(((timer.wall_ns(t1, ref) - timer.wall_ns(t0, ref)) / 1e6, before.elapsed_time(after)))

    timed(None)
    timed(torch.cuda.Stream())
    thread = threading.Thread(target=lambda: (torch.cuda.set_device(x.device), timed(None)))
    thread.start()
    thread.join()
    assert len(measured) == 3 and timer.record_fallbacks == 0
    for ours, torchs in measured:
        assert 0 < ours <= torchs and ours > 0.8 * torchs


@needs_cuda
@pytest.mark.parametrize("calls", ["driver", "driver-held"])
def test_driver_event_calls_hold_in_a_process_whose_first_cuda_call_is_the_collectors(calls: str) -> None:
    """A collector made before the job touches CUDA (``Collector.from_env`` before
    ``init_process_group``) still gets the driver's calls: the device's context exists once its
    first anchor is recorded."""
    code = ("import torch\nfrom megascope.collectors import timing\n"
            "assert not torch.cuda.is_initialized()\n"
            f"print(timing.CudaTimer(torch.device('cuda', 0), event_calls={calls!r}).event_calls)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == calls


_CPU_JOB = """
import sys, torch
from megascope.collectors import Collector, CollectorConfig
from megascope.schema import RunMeta
col = Collector(CollectorConfig(run_dir=sys.argv[1], flush_interval_s=0.2, handle_sigterm=False), rank=0, world_size=1,
                meta=RunMeta(run_id="cpu-job", source="collector", world_size=1))
kept = torch.ones(256, device="cuda") if sys.argv[2] == "gpu" else None
model = torch.nn.Linear(64, 64).to("cuda" if kept is not None else "cpu")
for step in range(3):
    with col.step(step), col.span("forward", kind="forward"):
        model(torch.randn(32, 64, device=model.weight.device)).sum().backward()
print(col.stats["device"])
col.close()
"""


@needs_cuda
def test_a_job_that_puts_nothing_on_a_gpu_is_timed_by_the_host_clock(tmp_path: Path) -> None:
    """A CPU job on a GPU host, its collector left to choose: by the first step the job has put
    nothing on a GPU, so its spans are stamped on the host clock and the ranks table says ``cpu``
    (events on an idle GPU would read as a device waiting for its host). A job with a tensor on
    its GPU keeps the device clock."""
    for where, device in (("cpu", "cpu"), ("gpu", "cuda:0")):
        run = tmp_path / where
        proc = subprocess.run([sys.executable, "-c", _CPU_JOB, str(run), where], capture_output=True, text=True,
                              timeout=120, env={**os.environ, "LOCAL_RANK": "0"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.split() == [device]
        opened = open_run(run)
        assert opened.con.execute("SELECT device FROM ranks").fetchall() == [(device,)]
        assert opened.con.execute("SELECT count(*) FROM spans WHERE kind = 'forward' AND dur_ns > 0").fetchone() == (3,)
