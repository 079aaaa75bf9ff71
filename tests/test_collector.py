"""The in-job collector in one process (host clock): spans, steps, comm, metrics, hooks, failure modes."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from conftest import wait_until
from megascope.collectors import NOOP, Collector, CollectorConfig, instrument_module, match_modules
from megascope.collectors.buffers import RowBuffer
from megascope.collectors.flight_recorder import entry_markers, op_name

from megascope.errors import ConfigError
from megascope.schema import RunMeta, SpanKind
from megascope.store import open_run
from megascope.topology import Group


def _collector(run: Path, **kw: object) -> Collector:
    cfg = CollectorConfig(run_dir=run, flush_interval_s=0.05, device=torch.device("cpu"), handle_sigterm=False,
                          **kw)  # type: ignore[arg-type]
    return Collector(cfg, rank=0, world_size=1, coords={"pp": 0, "dp": 0, "tp": 0},
                     meta=RunMeta(run_id="t", source="collector", world_size=1))


def _spans(run: Path) -> list[dict]:
    return open_run(run).con.sql("SELECT * FROM spans ORDER BY start_ns").df().to_dict("records")


# ---------------------------------------------------------------------------------------- config
def test_config_env_overrides_and_validation(tmp_path: Path) -> None:
    cfg = CollectorConfig(run_dir=tmp_path / "a", flush_interval_s=1.0)
    env = {"MEGASCOPE_DISABLE": "1", "MEGASCOPE_RUN_DIR": str(tmp_path / "b"), "MEGASCOPE_FLUSH_INTERVAL_S": "0.5",
           "MEGASCOPE_MAX_BUFFERED_ROWS": "10", "MEGASCOPE_FLIGHT_RECORDER": "yes", "MEGASCOPE_WAIT_SPANS": "0",
           "MEGASCOPE_CLOCK": "Side-Stream", "MEGASCOPE_WRITER_DUTY": "0.5"}
    got = cfg.with_env(env)
    assert (got.enabled, got.run_dir, got.flush_interval_s, got.max_buffered_rows, got.flight_recorder,
            got.wait_spans, got.clock, got.writer_duty) == (False, tmp_path / "b", 0.5, 10, True, False,
                                                             "side-stream", 0.5)
    for duty in ("0", "1.5"):
        with pytest.raises(ConfigError, match="writer_duty must be in"):
            cfg.with_env({"MEGASCOPE_WRITER_DUTY": duty})
    with pytest.raises(ConfigError, match="MEGASCOPE_WRITER_DUTY"):
        cfg.with_env({"MEGASCOPE_WRITER_DUTY": "low"})
    with pytest.raises(ConfigError, match="clock must be one of device, side-stream, host"):
        cfg.with_env({"MEGASCOPE_CLOCK": "gpu"})
    assert cfg.with_env({}) is cfg
    assert cfg.model_spans and not cfg.with_env({"MEGASCOPE_MODEL_SPANS": "0"}).model_spans
    with pytest.raises(ConfigError, match="MEGASCOPE_MODEL_SPANS"):
        cfg.with_env({"MEGASCOPE_MODEL_SPANS": "sometimes"})
    with pytest.raises(ConfigError, match="MEGASCOPE_FLUSH_INTERVAL_S"):
        cfg.with_env({"MEGASCOPE_FLUSH_INTERVAL_S": "soon"})
    with pytest.raises(ConfigError, match="MEGASCOPE_DISABLE"):
        cfg.with_env({"MEGASCOPE_DISABLE": "maybe"})
    with pytest.raises(ConfigError, match="flush_interval_s"):
        CollectorConfig(run_dir=tmp_path, flush_interval_s=0)
    with pytest.raises(ConfigError, match="max_buffered_rows"):
        CollectorConfig(run_dir=tmp_path, max_buffered_rows=0)
    with pytest.raises(TypeError):
        CollectorConfig(tmp_path)  # type: ignore[misc]  # keyword-only


def test_a_big_job_flushes_less_often_so_its_ranks_write_a_bounded_number_of_parts(tmp_path: Path) -> None:
    """Past job_parts_per_s ranks, a rank flushes every world_size / job_parts_per_s seconds: the
    job writes about that many parts of a table a second whatever its size."""
    cfg = CollectorConfig(run_dir=tmp_path / "a", flush_interval_s=1.0)
    assert [cfg.flush_interval_for(w) for w in (1, 1024, 4096, 12288)] == [1.0, 1.0, 4.0, 12.0]
    assert CollectorConfig(run_dir=tmp_path, flush_interval_s=20.0).flush_interval_for(12288) == 20.0
    assert CollectorConfig(run_dir=tmp_path, job_parts_per_s=0).flush_interval_for(12288) == 1.0
    assert cfg.with_env({"MEGASCOPE_JOB_PARTS_PER_S": "4096"}).flush_interval_for(12288) == 3.0
    with pytest.raises(ConfigError, match="job_parts_per_s must be >= 0"):
        cfg.with_env({"MEGASCOPE_JOB_PARTS_PER_S": "-1"})
    with pytest.raises(ConfigError, match="MEGASCOPE_JOB_PARTS_PER_S"):
        cfg.with_env({"MEGASCOPE_JOB_PARTS_PER_S": "many"})

    col = Collector(CollectorConfig(run_dir=tmp_path / "run", marker_agent=False, heartbeat_interval_s=None),
                    rank=3, world_size=2048)
    try:
        assert col.flush_interval_s == 2.0 and col._writer.interval_s == 2.0
    finally:
        col.close()


def test_from_env_records_the_flush_interval_a_big_job_uses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """run.json's config.flush_interval_s is the one the ranks use (the run state reads it to tell a
    stalled job from one between flushes)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3072")
    col = Collector.from_env(tmp_path / "run", intercept=False, marker_agent=False)
    try:
        assert col.flush_interval_s == 3.0
    finally:
        col.close()
    assert open_run(tmp_path / "run").meta.config["flush_interval_s"] == 3.0


# ---------------------------------------------------------------------------------------- spans
def test_spans_steps_and_metrics_land_in_the_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    col = _collector(run)

    @col.span("loss", kind=SpanKind.COMPUTE)
    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return y.pow(2).mean()

    for step in range(3):
        with col.step(step):
            for mb in range(2):
                with col.span("forward", kind=SpanKind.FORWARD, microbatch=mb):
                    loss = loss_fn(torch.randn(8, 8, requires_grad=True))
                    time.sleep(0.001)
            with col.span("optimizer", kind=SpanKind.OPTIMIZER):
                pass
        col.metric("loss", loss)  # a tensor, after the step: belongs to the last step
        col.metric("lr", 0.1 * (step + 1), step=step)
    with col.span("after", kind="host"):
        pass
    col.close()
    assert col.stats["rows_dropped"] == 0 and col.stats["write_errors"] == 0

    spans = _spans(run)
    steps = [s for s in spans if s["kind"] == "step"]
    assert [s["step"] for s in steps] == [0, 1, 2]
    forwards = [s for s in spans if s["name"] == "forward"]
    assert [(s["step"], s["microbatch"]) for s in forwards] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    losses = [s for s in spans if s["name"] == "loss"]
    # The decorated function inherits the enclosing micro-batch and nests inside its forward.
    assert [s["microbatch"] for s in losses] == [0, 1, 0, 1, 0, 1]
    for fwd, inner in zip(forwards, losses, strict=True):
        assert fwd["start_ns"] <= inner["start_ns"] and inner["start_ns"] + inner["dur_ns"] <= fwd["start_ns"] + fwd["dur_ns"]
        assert fwd["dur_ns"] >= 1_000_000  # the 1 ms sleep
    for step_span in steps:
        inside = [s for s in spans if s["step"] == step_span["step"] and s["kind"] != "step"]
        assert all(step_span["start_ns"] <= s["start_ns"] <= step_span["start_ns"] + step_span["dur_ns"] for s in inside)
    after = [s for s in spans if s["name"] == "after"]
    assert after[0]["step"] is None or after[0]["step"] != after[0]["step"]  # null outside any step
    assert after[0]["stream"] == "host" and forwards[0]["stream"] == "compute"
    # Wall clock: the spans happened during this test.
    assert abs(spans[0]["start_ns"] - time.time_ns()) < 60e9

    r = open_run(run)
    metrics = r.con.sql("SELECT step, name, value FROM metrics WHERE name <> 'collector_stamps' "
                        "ORDER BY name, step").fetchall()
    # The host probe every 10 steps (CollectorConfig.host_probe_every): at step 0 here.
    assert [m[:2] for m in metrics] == [(0, "host_loop_ns"), (0, "loss"), (1, "loss"), (2, "loss"), (0, "lr"),
                                        (1, "lr"), (2, "lr")]
    assert metrics[4][2] == pytest.approx(0.1) and all(m[2] > 0 for m in metrics)
    # The collector's own footprint per step: two stamps for every span of the step, its own included.
    # A garbage collection of 1 ms or more (likely on a loaded machine) adds a span timed by the
    # interpreter's callback, without stamps.
    stamps = r.con.sql("SELECT step, value FROM metrics WHERE name = 'collector_stamps' ORDER BY step").fetchall()
    per_step = [2 * sum(1 for s in spans if s["step"] == step and not s["name"].startswith("gc.")) for step in range(3)]
    assert stamps == [(step, float(n)) for step, n in enumerate(per_step)] and per_step[0] > 2
    ranks = r.con.sql("SELECT rank, coords['pp'], coords['dp'], coords['tp'], device, pid FROM ranks").fetchall()
    assert ranks[0][:5] == (0, 0, 0, 0, "cpu") and ranks[0][5] > 0
    assert r.meta.run_id == "t" and r.problems == []


def test_a_step_ended_by_an_exception_records_its_class(tmp_path: Path) -> None:
    """The exception that ends a step leaves a ``step_error:<class>`` metric at that step (how the
    run state tells a rank that died without a word from the ones that failed after it); it still
    propagates, and a step that ends normally records none."""
    run = tmp_path / "run"
    col = _collector(run)
    with col.step(0), col.span("fine"):
        pass
    with pytest.raises(ConnectionError), col.step(1):
        raise ConnectionError("peer gone")
    col.close()
    rows = open_run(run).con.execute("SELECT step, name, value FROM metrics WHERE starts_with(name, 'step_error:')"
                                     ).fetchall()
    assert rows == [(1, "step_error:ConnectionError", 1.0)]


def test_the_process_groups_timeout_goes_into_run_json_at_the_first_step(tmp_path: Path) -> None:
    """A user's job does not say its collective timeout; its process group knows it. Rank 0 writes
    it into run.json at the first step (the run state's hang threshold), unless the job said it."""
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=17))
    try:
        col = _collector(tmp_path / "run")
        with col.step(0):
            pass
        col.close()
        told = Collector(CollectorConfig(run_dir=tmp_path / "told", device=torch.device("cpu"), handle_sigterm=False),
                         rank=0, world_size=1, meta=RunMeta(run_id="t2", source="collector", world_size=1,
                                                            config={"collective_timeout_s": 40.0}))
        with told.step(0):
            pass
        told.close()
    finally:
        dist.destroy_process_group()
    assert open_run(tmp_path / "run").meta.config["collective_timeout_s"] == 17.0
    assert open_run(tmp_path / "told").meta.config["collective_timeout_s"] == 40.0


def test_a_paused_collector_records_nothing_until_resumed(tmp_path: Path) -> None:
    """Paused: steps, spans, calls and metrics are no-ops, but what began before the pause is
    recorded when it ends, and close() while paused still writes everything."""
    run = tmp_path / "run"
    col = _collector(run)
    with col.step(0):
        with col.span("kept"):
            pass
        open_call = col.comm_begin(op="all_reduce", group="world")
    col.pause()
    assert col.paused and not col.recording
    open_call.end()  # begun before the pause: still recorded
    with col.step(1):
        with col.span("dropped"):
            pass
        with col.comm(op="all_reduce", group="world"):
            pass
        col.metric("loss", 1.0)
    col.resume()
    assert col.recording
    with col.step(2), col.span("kept-again"):
        pass
    col.pause()
    col.close()
    assert not col.paused and not col.recording
    rows = _spans(run)
    assert [(r["name"], r["step"]) for r in rows if r["kind"] != "step"] == [
        ("kept", 0), ("world.all_reduce", 0), ("kept-again", 2)]
    assert sorted(r["step"] for r in rows if r["kind"] == "step") == [0, 2]
    con = open_run(run).con
    assert con.execute("SELECT count(*) FROM metrics WHERE name NOT IN ('collector_stamps', 'host_loop_ns')"
                       ).fetchone() == (0,)
    assert con.execute("SELECT step FROM metrics WHERE name = 'collector_stamps' ORDER BY step").fetchall() == [
        (0,), (2,)]
    assert con.execute("SELECT step FROM metrics WHERE name = 'host_loop_ns'").fetchall() == [(0,)]  # every 10
    assert con.execute("SELECT DISTINCT seq FROM markers").fetchall() == [(0,)]


def test_span_closes_on_exception_and_comm_failure_writes_no_completion(tmp_path: Path) -> None:
    run = tmp_path / "run"
    col = _collector(run)
    with col.step(0):
        with pytest.raises(ValueError), col.span("boom", kind=SpanKind.COMPUTE):
            raise ValueError("user error passes through")
        with pytest.raises(RuntimeError), col.comm(op="all_reduce", group="world", bytes=4):
            raise RuntimeError("collective timed out")
        with col.comm(op="all_reduce", group="world", bytes=4):
            pass
    col.close()
    spans = _spans(run)
    assert "boom" in {s["name"] for s in spans}
    markers = open_run(run).con.sql("SELECT seq, state FROM markers ORDER BY seq, state").fetchall()
    # seq 0 failed: enqueued only; seq 1 completed.
    assert markers == [(0, "enqueued"), (1, "completed"), (1, "enqueued")]


def test_comm_sequence_numbers_markers_and_async_handles(tmp_path: Path) -> None:
    run = tmp_path / "run"
    col = _collector(run)
    col.register_group(None, Group("world", "world", (0,)))
    with col.step(5):
        for _ in range(3):
            with col.comm(op="all_reduce", group="tp:0", bytes=128):
                pass
        h = col.comm_begin(op="reduce_scatter", group="dp:0", bytes=64)
        with col.comm(op="all_reduce", group="dp:0", bytes=8):
            pass
        h.end()
        h.end()  # idempotent
        send = col.comm_begin(op="send", group="pp:0", kind=SpanKind.SEND, peer=1, bytes=16)
        recv = col.comm_begin(op="recv", group="pp:0", kind=SpanKind.RECV, peer=1, bytes=16)
        send2 = col.comm_begin(op="send", group="pp:0", kind=SpanKind.SEND, peer=1, bytes=16)
        for x in (send, recv, send2):
            x.end()
    col.close()
    rows = open_run(run).con.sql(
        "SELECT name, kind, stream, \"group\", seq, op, bytes, peer, step, start_ns, dur_ns FROM spans "
        "WHERE \"group\" IS NOT NULL ORDER BY start_ns").fetchall()
    assert [(r[3], r[4], r[5]) for r in rows] == [
        ("tp:0", 0, "all_reduce"), ("tp:0", 1, "all_reduce"), ("tp:0", 2, "all_reduce"),
        ("dp:0", 0, "reduce_scatter"), ("dp:0", 1, "all_reduce"),
        ("pp:0", 0, "send"), ("pp:0", 0, "recv"), ("pp:0", 1, "send"),
    ]
    assert rows[0][:3] == ("tp.all_reduce", "collective", "comm")
    assert {r[8] for r in rows} == {5}
    assert [r[7] for r in rows[5:]] == [1, 1, 1] and rows[5][1] == "send" and rows[6][1] == "recv"
    rs, ar = rows[3], rows[4]  # the async reduce-scatter spans the all-reduce issued inside it
    assert rs[9] <= ar[9] and ar[9] + ar[10] <= rs[9] + rs[10]
    markers = open_run(run).con.sql(
        "SELECT \"group\", seq, op, state, count(*) FROM markers GROUP BY ALL ORDER BY ALL").fetchall()
    assert all(m[4] == 1 for m in markers) and len(markers) == 2 * len(rows)
    groups = open_run(run).con.sql("SELECT \"group\", kind, members FROM groups").fetchall()
    assert groups == [("world", "world", [0])]


def test_sampled_group_kinds_are_timed_in_the_listed_microbatches_and_keep_every_marker(tmp_path: Path) -> None:
    """comm_sample_kinds: calls on tp groups get a span in micro-batch 0, outside micro-batches and
    under step_level() only; every call keeps its enqueued and completed markers and its sequence
    number, and the step's metric says how many tp calls there were. Other kinds are all timed."""
    from megascope.schema import COLLECTOR_CALLS_METRIC

    run = tmp_path / "run"
    col = _collector(run, comm_sample_kinds=("tp",))
    for step in range(2):
        with col.step(step):
            for mb in range(3):
                with col.span("forward", kind=SpanKind.FORWARD, microbatch=mb):
                    with col.comm(op="all_gather", group="tp:0", bytes=64):
                        pass
                    handle = col.comm_begin(op="reduce_scatter", group="tp:0", bytes=64)
                    handle.waiting()
                    handle.end()
                    with col.comm(op="reduce_scatter", group="dp:0", bytes=32):
                        pass
            # A gradient sync, once a step, launched from the last micro-batch's backward:
            with col.span("backward", kind=SpanKind.BACKWARD, microbatch=2), col.step_level(), \
                    col.comm(op="all_reduce", group="tp:0", bytes=16):
                pass
            with col.comm(op="all_reduce", group="tp:0", bytes=8):
                pass
    col.close()
    con = open_run(run).con
    timed = con.sql("""SELECT step, "group", seq, op, microbatch FROM spans WHERE "group" IS NOT NULL
                       ORDER BY step, "group", seq""").fetchall()
    tp = [(step, seq, op, mb) for step, group, seq, op, mb in timed if group == "tp:0"]
    assert tp == [(s, 8 * s + k, op, mb) for s in range(2)
                  for k, op, mb in ((0, "all_gather", 0), (1, "reduce_scatter", 0), (6, "all_reduce", None),
                                    (7, "all_reduce", None))]
    assert [(step, seq, mb) for step, group, seq, _, mb in timed if group == "dp:0"] == [
        (s, 3 * s + mb, mb) for s in range(2) for mb in range(3)]
    waits = con.sql("SELECT name, microbatch FROM spans WHERE name LIKE '%:wait'").fetchall()
    assert waits == [("tp.reduce_scatter:wait", 0)] * 2
    markers = con.sql("""SELECT state, list(seq ORDER BY seq) FROM markers WHERE "group" = 'tp:0'
                         GROUP BY state ORDER BY state""").fetchall()
    assert markers == [("completed", list(range(16))), ("enqueued", list(range(16)))]
    calls = con.sql(f"SELECT step, value FROM metrics WHERE name = '{COLLECTOR_CALLS_METRIC}tp:0' ORDER BY step")
    assert calls.fetchall() == [(0, 8.0), (1, 8.0)]
    assert col.stats["untimed_calls"] == 8


def test_sampled_calls_rotate_over_the_microbatches_step_by_step(tmp_path: Path) -> None:
    """comm_sample_every=N: micro-batch m of step s is timed where (m - s) % N == 0, so over N steps
    every micro-batch is timed once; the untimed calls keep their markers."""
    run = tmp_path / "run"
    col = _collector(run, comm_sample_kinds=("tp",), comm_sample_every=3)
    for step in range(4):
        with col.step(step):
            for mb in range(3):
                with col.span("forward", kind=SpanKind.FORWARD, microbatch=mb), \
                        col.comm(op="all_reduce", group="tp:0", bytes=64):
                    pass
    col.close()
    con = open_run(run).con
    timed = con.sql("""SELECT step, microbatch FROM spans WHERE "group" = 'tp:0' ORDER BY step""").fetchall()
    assert timed == [(0, 0), (1, 1), (2, 2), (3, 0)]
    completed = con.sql("""SELECT count(*) FROM markers WHERE "group" = 'tp:0' AND state = 'completed'""")
    assert completed.fetchall() == [(12,)]
    with pytest.raises(ConfigError, match="comm_sample_every"):
        CollectorConfig(run_dir=Path("r"), comm_sample_every=-1)


def test_step_level_calls_of_sampled_kinds_are_timed_one_in_n_by_their_place_in_the_step(tmp_path: Path) -> None:
    """comm_sample_calls=N: a step-level call on a sampled group is timed where (its place among
    the group's step-level calls of the step - step) % N == 0, once the group issued at least
    N x SAMPLED_CALLS_MIN_TIMED of them the step before; a group issuing fewer (and every group in
    the first step) is timed in full. The untimed calls keep both markers and are counted in
    collector_calls; other kinds are all timed."""
    from megascope.collectors.config import SAMPLED_CALLS_MIN_TIMED

    from megascope.schema import COLLECTOR_CALLS_METRIC

    every, buckets = 3, 3 * SAMPLED_CALLS_MIN_TIMED  # the bucket reduce-scatters, then one all-gather
    run = tmp_path / "run"
    col = _collector(run, comm_sample_kinds=("dp",), comm_sample_calls=every)
    for step in range(4):
        with col.step(step):
            with col.span("backward", kind=SpanKind.BACKWARD, microbatch=1), col.step_level():
                for _ in range(buckets):  # the gradient sync, launched from the last backward
                    handle = col.comm_begin(op="reduce_scatter", group="dp:0", bytes=64)
                    handle.waiting()
                    handle.end()
            with col.comm(op="all_gather", group="dp:0", bytes=64):  # outside any micro-batch
                pass
            for _ in range(2):  # a small group: under the minimum, always timed
                with col.comm(op="all_reduce", group="dp:1", bytes=8):
                    pass
            with col.comm(op="all_reduce", group="world", bytes=8):
                pass
    col.close()
    con = open_run(run).con
    calls = buckets + 1
    timed = con.sql(f"""SELECT step, list(seq - {calls} * step ORDER BY seq) FROM spans WHERE "group" = 'dp:0'
                        AND kind = 'collective' GROUP BY step ORDER BY step""").fetchall()
    assert timed == [(0, list(range(calls)))] + [(s, [i for i in range(calls) if (i - s) % every == 0])
                                                   for s in range(1, 4)]
    waits = con.sql("SELECT count(*) FROM spans WHERE name = 'dp.reduce_scatter:wait'").fetchall()
    assert waits == [(buckets + sum(1 for s in range(1, 4) for i in range(buckets) if (i - s) % every == 0),)]
    small = con.sql("""SELECT count(*) FROM spans WHERE "group" IN ('dp:1', 'world')""").fetchall()
    assert small == [(4 * 3,)]
    markers = con.sql("""SELECT state, count(*) FROM markers WHERE "group" = 'dp:0' GROUP BY state ORDER BY state""")
    assert markers.fetchall() == [("completed", 4 * calls), ("enqueued", 4 * calls)]
    metric = con.sql(f"SELECT step, value FROM metrics WHERE name = '{COLLECTOR_CALLS_METRIC}dp:0' ORDER BY step")
    assert metric.fetchall() == [(s, float(calls)) for s in range(4)]
    assert col.stats["untimed_calls"] == 4 * calls - len([1 for _, seqs in timed for _ in seqs])
    with pytest.raises(ConfigError, match="comm_sample_calls"):
        CollectorConfig(run_dir=Path("r"), comm_sample_calls=-1)
    assert CollectorConfig(run_dir=Path("r")).with_env({"MEGASCOPE_COMM_SAMPLE_CALLS": "4"}).comm_sample_calls == 4


def test_comm_sample_kinds_from_the_environment_and_checked() -> None:
    cfg = CollectorConfig(run_dir=Path("r"))
    assert cfg.with_env({"MEGASCOPE_COMM_SAMPLE": "tp, dp"}).comm_sample_kinds == ("tp", "dp")
    assert cfg.with_env({"MEGASCOPE_COMM_SAMPLE": "none"}).comm_sample_kinds == ()
    sampled = CollectorConfig(run_dir=Path("r"), comm_sample_kinds="tp")  # type: ignore[arg-type]
    assert sampled.comm_sample_kinds == ("tp",)
    assert sampled.with_env({"MEGASCOPE_COMM_SAMPLE": ""}).comm_sample_kinds == ()
    with pytest.raises(ConfigError, match="comm_sample_microbatches"):
        CollectorConfig(run_dir=Path("r"), comm_sample_microbatches=(-1,))


@pytest.mark.parametrize("wait_spans", [True, False])
def test_waiting_on_an_async_call_writes_its_wait_span(tmp_path: Path, wait_spans: bool) -> None:
    """wait() on an asynchronous call: the call's span runs from issue to completion and a
    "<name>:wait" span (no group, same seq/op/peer) from the wait to completion, unless switched off."""
    class Work:
        def wait(self) -> bool:
            time.sleep(0.02)  # the transfer still running when the caller starts waiting
            return True

    from megascope.collectors.dist import TimedWork

    run = tmp_path / "run"
    col = Collector(CollectorConfig(run_dir=run, flush_interval_s=0.05, wait_spans=wait_spans), rank=0, world_size=1)
    with col.step(0):
        work = TimedWork(Work(), col.comm_begin(op="reduce_scatter", group="dp:0", bytes=64))
        time.sleep(0.03)  # compute issued after the call
        assert work.wait() is True
    col.close()
    rows = open_run(run).con.sql(
        'SELECT name, kind, "group", seq, op, dur_ns, start_ns FROM spans WHERE name LIKE \'dp.%\' ORDER BY name'
    ).fetchall()
    call = rows[0]
    assert call[:5] == ("dp.reduce_scatter", "collective", "dp:0", 0, "reduce_scatter")
    assert call[5] >= 50_000_000
    if not wait_spans:
        assert len(rows) == 1
        return
    wait = rows[1]
    assert wait[:5] == ("dp.reduce_scatter:wait", "other", None, 0, "reduce_scatter")
    assert 20_000_000 <= wait[5] < call[5] - 25_000_000
    assert wait[6] + wait[5] == call[6] + call[5]  # one end stamp, shared


def test_writer_resolves_a_span_only_when_both_stamps_are_done() -> None:
    """The writer times a span without asking the device first while the spans before it were
    done, and asks about each end once one was not; a start that is not done (a span whose stamps
    went to different streams) keeps the span pending, and a device error drops it."""
    from megascope.collectors.timing import Anchor
    from megascope.collectors.writer import Sink, resolve_pending

    class Token:
        def __init__(self, ns: int, done: bool = True, broken: bool = False) -> None:
            self.ns, self.done, self.broken = ns, done, broken

    class FakeDeviceTimer:
        is_device = True

        def __init__(self) -> None:
            self.queries = 0

        def ready(self, token: Token) -> bool:
            self.queries += 1
            return token.done

        def wall_ns(self, token: Token, anchor: Anchor) -> int:
            if not token.done or token.broken:
                raise RuntimeError("device not ready" if not token.done else "device error")
            return anchor.wall_ns + token.ns

        def release(self, token: Token) -> None:
            pass

    def item(start: Token, end: Token, name: str) -> tuple:
        return (start, end, Anchor(1_000, None, True), 0, name, "compute", "compute", None, None, None, None,
                None, None, None, None)

    sink, timer = Sink(16), FakeDeviceTimer()
    late_start = Token(10, done=False)
    sink.pending_spans.put(item(Token(10), Token(30), "done"))
    sink.pending_spans.put(item(late_start, Token(40), "start-pending"))
    sink.pending_spans.put(item(Token(10), Token(50, done=False), "end-pending"))
    sink.pending_spans.put(item(Token(10, broken=True), Token(60), "broken"))
    assert resolve_pending(sink, timer, rank=3) == 1  # the broken one, dropped
    assert [(r[0], r[2], r[5], r[6]) for r in sink.spans.drain()] == [(3, "done", 1_010, 20)]
    # "done": timed without asking; "start-pending": its start asked once timing it failed; from
    # there on every end is asked ("end-pending", "broken"), and the broken start once more.
    assert timer.queries == 4
    assert [i[4] for i in sink.pending_spans.drain()] == ["start-pending", "end-pending"]

    # A pass of spans that are all done asks the device nothing; the first that is not costs one
    # question, and every span after it one each, done or not (another stream's, done earlier).
    sink, timer = Sink(16), FakeDeviceTimer()
    for i in range(5):
        sink.pending_spans.put(item(Token(10), Token(20 + i), f"d{i}"))
    sink.pending_spans.put(item(Token(10), Token(90, done=False), "later"))
    sink.pending_spans.put(item(Token(10), Token(30), "other-stream"))
    sink.pending_spans.put(item(Token(10), Token(95, done=False), "latest"))
    assert resolve_pending(sink, timer, rank=0) == 0
    assert [r[2] for r in sink.spans.drain()] == ["d0", "d1", "d2", "d3", "d4", "other-stream"]
    assert timer.queries == 3
    assert [i[4] for i in sink.pending_spans.drain()] == ["later", "latest"]


class _FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def _slow_host_timer(clock: _FakeClock, cost_s: float) -> Any:
    """A host timer whose every ``ready`` call takes ``cost_s`` of the fake clock."""
    from megascope.collectors.timing import HostTimer

    class SlowTimer(HostTimer):
        def ready(self, token: Any) -> bool:
            clock.now += cost_s
            return True

    return SlowTimer()


def _pending_span(timer: Any, i: int) -> tuple:
    return (timer.stamp(), timer.stamp(), timer.anchor, 0, f"s{i}", "compute", "compute", None, None, None,
            None, None, None, None, None)


def test_paced_writer_sleeps_between_slices_and_not_when_hurried() -> None:
    """Paced, the writer sleeps after each half-millisecond slice of work so that it holds the
    interpreter at most ``duty`` of the time; hurried (someone waits for the flush) it does not."""
    from megascope.collectors.writer import Pacer, Sink, resolve_pending

    clock = _FakeClock()
    timer = _slow_host_timer(clock, 0.0001)  # 0.1 ms per span
    pacer = Pacer(0.25, slice_s=0.0005, clock=lambda: clock.now, sleep=clock.sleep)
    assert pacer.pause_s == pytest.approx(0.0015)
    sink = Sink(100)
    for i in range(20):
        sink.pending_spans.put(_pending_span(timer, i))
    pacer.begin()
    assert resolve_pending(sink, timer, rank=0, pacer=pacer) == 0
    assert len(sink.spans) == 20
    # 2 ms of work in 0.5 ms slices: a pause after each of the first three slices.
    assert clock.sleeps == pytest.approx([0.0015] * 3) and pacer.pauses == 3
    work = 20 * 0.0001
    assert work / (work + sum(clock.sleeps)) == pytest.approx(2.0 / 6.5)

    clock.sleeps.clear()
    for i in range(20):
        sink.pending_spans.put(_pending_span(timer, i))
    pacer.hurry = True
    resolve_pending(sink, timer, rank=0, pacer=pacer)
    assert clock.sleeps == [] and len(sink.spans) == 40
    assert Pacer(1.0).pause_s == 0.0
    with pytest.raises(ValueError, match="duty"):
        Pacer(0.0)


def test_background_passes_are_paced_unless_far_behind(tmp_path: Path) -> None:
    """The writer thread's own passes pace themselves; an explicit flush does not, nor a pass that
    finds a quarter of the span capacity waiting (it catches up at full speed instead)."""
    from megascope.collectors.writer import Sink, Writer

    clock = _FakeClock()
    timer = _slow_host_timer(clock, 0.0002)
    sink = Sink(400)
    writer = Writer(tmp_path, rank=0, sink=sink, timer=timer, interval_s=60.0, capacity=400, duty=0.5)
    writer.pacer._clock, writer.pacer._sleep = (lambda: clock.now), clock.sleep
    for paced, spans, pauses in ((True, 50, True), (False, 50, False), (True, 100, False)):
        clock.sleeps.clear()
        for i in range(spans):
            sink.pending_spans.put(_pending_span(timer, i))
        assert writer.flush(paced=paced)
        assert len(sink.pending_spans) == 0 and (len(clock.sleeps) > 0) == pauses, (paced, spans)
    assert writer.rows_written["spans"] == 200
    assert len(_parquet_rows(tmp_path)) == 200


def test_passes_align_to_steps_every_power_of_two_ranks_agree_on(tmp_path: Path) -> None:
    """The writer's pass is due at the end of a step whose number is a multiple of K, the power of
    two nearest to the interval over the rank's step time: ranks whose step times differ by a few
    percent pick the same steps, and across a rounding edge K and 2K still meet every 2K steps.
    Without steps it waits one interval; with them two intervals or two steps."""
    from megascope.collectors.timing import HostTimer
    from megascope.collectors.writer import Sink, Writer

    def writer(step_s: float, interval_s: float = 1.0, align: bool = True) -> tuple[Writer, list[int]]:
        w = Writer(tmp_path, rank=0, sink=Sink(10), timer=HostTimer(), interval_s=interval_s, capacity=10,
                   align_steps=align)
        now = [0.0]
        w._monotonic = lambda: now[0]
        due: list[int] = []
        for step in range(40):
            now[0] += step_s
            w.step_ended(step)
            if w._due.is_set():
                due.append(step)
                w._due.clear()
        return w, due

    fast, due_fast = writer(0.120)  # 1 s / 0.12 s = 8.3 steps: K = 8
    slow, due_slow = writer(0.126)  # 5% slower, the same K
    assert fast.every_steps == slow.every_steps == 8 and due_fast == due_slow == [8, 16, 24, 32]
    edge_a, due_a = writer(1.0 / 2.7)  # log2(2.7) = 1.43: K = 2
    edge_b, due_b = writer(1.0 / 2.9)  # log2(2.9) = 1.54: K = 4
    assert (edge_a.every_steps, edge_b.every_steps) == (2, 4) and set(due_b) <= set(due_a)
    long_steps, due_long = writer(3.0)  # steps longer than the interval: a pass at every step end
    assert long_steps.every_steps == 1 and due_long == list(range(1, 40))
    assert long_steps._wait_s() == pytest.approx(6.0) and fast._wait_s() == pytest.approx(2.0)
    stalled = fast._last_step_end
    fast._monotonic = lambda: stalled + 2.5  # no step for longer than that: passes by time again
    assert fast._wait_s() == 1.0
    off, due_off = writer(0.120, align=False)
    assert off.every_steps == 0 and due_off == [] and off._wait_s() == 1.0
    huge, _ = writer(1e-6, interval_s=100.0)
    assert huge.every_steps == 4096  # at most


def test_a_collector_starts_its_passes_at_the_aligned_steps_and_by_time_once_steps_stop(tmp_path: Path) -> None:
    """A job marking 10 ms steps (on the writer's clock) with a 0.08 s flush interval: its passes
    are due at the ends of steps 8, 16, 24, ... and no others, and the writer thread makes them
    (a part then holds the spans up to the step running when the pass drains them); once the steps
    stop, the writer goes on by time and the last spans reach the disk without close()."""
    col = Collector(CollectorConfig(run_dir=tmp_path / "run", flush_interval_s=0.08, marker_agent=False,
                                    handle_sigterm=False, host_probe_every=0), rank=0, world_size=1)
    writer = col._writer
    clock, current, due_at = [0.0], [-1], []
    writer._monotonic = lambda: clock[0]
    step_ended, set_due = writer.step_ended, writer._due.set

    def ended(step: int) -> None:
        current[0] = step
        step_ended(step)

    writer.step_ended = ended  # type: ignore[method-assign]
    writer._due.set = lambda: (due_at.append(current[0]), set_due())  # type: ignore[method-assign]
    for step in range(60):
        with col.step(step), col.span("work"):
            time.sleep(0.01)
            clock[0] += 0.01
    assert col.stats["pass_every_steps"] == 8 and due_at == list(range(8, 60, 8))
    wait_until(lambda: _parquet_rows(tmp_path / "run") and max(r["step"] for r in _parquet_rows(tmp_path / "run")) == 59,
               timeout=5.0, message="the last steps' spans on disk after the steps stopped")
    assert col.stats["aligned_passes"] >= 4
    col.close()


def _parquet_rows(run_dir: Path) -> list[Any]:
    return [r for p in sorted((run_dir / "spans").glob("rank=*/*.parquet")) for r in pq.read_table(p).to_pylist()]


# ---------------------------------------------------------------------------------------- modules
def test_match_modules_is_segment_aware() -> None:
    names = ["", "embed", "layers", "layers.0", "layers.0.attn", "layers.0.attn.wq", "layers.1", "head"]
    assert match_modules(names, ["layers.*"]) == ["layers.0", "layers.1"]
    assert match_modules(names, ["layers.**"]) == ["layers", "layers.0", "layers.0.attn", "layers.0.attn.wq", "layers.1"]
    assert match_modules(names, ["**.wq", "head"]) == ["layers.0.attn.wq", "head"]
    assert match_modules(names, ["nope"]) == []


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(16, 16)
        self.mlp = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(torch.relu(self.attn(x)))


class _Model(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _forward_backward(col: Collector, model: torch.nn.Module, *, microbatches: int) -> None:
    """Forward and backward of each micro-batch inside the collector's top-level spans."""
    for mb in range(microbatches):
        with col.span("forward", kind=SpanKind.FORWARD, microbatch=mb):
            out = model(torch.randn(4, 16, requires_grad=True))
        with col.span("backward", kind=SpanKind.BACKWARD, microbatch=mb):
            out.sum().backward()


def test_instrument_module_forward_and_backward_spans(tmp_path: Path) -> None:
    run = tmp_path / "run"
    col = _collector(run)
    model = _Model(3)
    handles = instrument_module(model, ["layers.*"], collector=col, kind_prefix="s0.")
    assert len(handles) == 6
    with col.step(0):
        _forward_backward(col, model, microbatches=2)
        with torch.no_grad():
            model(torch.randn(4, 16))  # forward spans only: no graph, no backward
    for h in handles:
        h.remove()
    with col.step(1):
        model(torch.randn(4, 16, requires_grad=True)).sum().backward()  # hooks removed: nothing
    col.close()
    spans = [s for s in _spans(run) if s["name"].startswith("s0.")]
    fwd = [(s["name"], s["microbatch"]) for s in spans if s["kind"] == "forward"]
    bwd = [(s["name"], s["microbatch"]) for s in spans if s["kind"] == "backward"]
    names = ["s0.layers.0", "s0.layers.1", "s0.layers.2"]
    assert fwd == [(n, 0) for n in names] + [(n, 1) for n in names] + [(n, None) for n in names]
    assert bwd == [(n, 0) for n in reversed(names)] + [(n, 1) for n in reversed(names)]
    assert {s["step"] for s in spans} == {0}
    by_key = {(s["name"], s["kind"], s["microbatch"]): s for s in spans}
    for mb in (0, 1):
        # Backward of layer 2 runs before layer 1's, and after the forward of the same micro-batch.
        b2, b1 = by_key[("s0.layers.2", "backward", mb)], by_key[("s0.layers.1", "backward", mb)]
        assert b2["start_ns"] + b2["dur_ns"] <= b1["start_ns"] + 1
        assert by_key[("s0.layers.2", "forward", mb)]["start_ns"] < b2["start_ns"]



def test_instrument_module_in_chosen_microbatches_only(tmp_path: Path) -> None:
    """microbatches={1}: forward and backward spans of micro-batch 1 only, plus calls made outside
    any micro-batch; the other micro-batches get no hook at all (no backward span either)."""
    run = tmp_path / "run"
    col = _collector(run)
    model = _Model(2)
    instrument_module(model, ["layers.*"], collector=col, microbatches={1})
    with col.step(0):
        _forward_backward(col, model, microbatches=3)
        model(torch.randn(4, 16))
    col.close()
    spans = [(s["name"], s["kind"], s["microbatch"]) for s in _spans(run) if s["name"].startswith("layers.")]
    names = ["layers.0", "layers.1"]
    assert sorted(spans, key=str) == sorted(
        [(n, "forward", 1) for n in names] + [(n, "backward", 1) for n in names]
        + [(n, "forward", None) for n in names], key=str)

# ---------------------------------------------------------------------------------------- failure modes
def test_disabled_collector_is_a_noop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGASCOPE_DISABLE", "1")
    run = tmp_path / "run"
    col = _collector(run)
    assert col.span("x") is NOOP and col.step(1) is NOOP and col.comm(op="all_reduce") is NOOP

    @col.span("f")
    def f() -> int:
        return 3

    with col.step(0), col.span("x"), col.comm(op="barrier") as h:
        h.end()
    col.metric("loss", 1.0, step=0)
    assert f() == 3 and instrument_module(_Model(1), ["layers.*"], collector=col) == []
    t = torch.ones(2)
    col.flush()
    col.close()
    assert not run.exists() and col.stats["enabled"] is False and t.sum() == 2


def test_unwritable_run_dir_does_not_stop_training(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    run = blocker / "run"  # mkdir fails: a file is in the way (works as root too, unlike chmod)
    col = _collector(run, max_buffered_rows=50)
    with caplog.at_level(logging.WARNING, logger="megascope.collectors"):
        for step in range(40):
            with col.step(step), col.span("forward", kind=SpanKind.FORWARD):
                pass
            col.metric("loss", float(step))
        col.flush()
        col.close()
    stats = col.stats
    assert stats["write_errors"] > 0 and stats["rows_written"] == 0
    assert stats["rows_dropped"] > 0  # bounded: 80 span rows cannot all be kept in 50
    assert any("cannot write" in rec.getMessage() for rec in caplog.records)
    assert blocker.read_text() == "not a directory"


def test_writer_retries_after_the_disk_comes_back(tmp_path: Path) -> None:
    blocker = tmp_path / "run"
    blocker.write_text("in the way")
    col = _collector(blocker)
    with col.step(0), col.span("forward", kind=SpanKind.FORWARD):
        pass
    col.flush()
    assert col.stats["write_errors"] > 0
    blocker.unlink()  # the directory can be created now
    with col.step(1), col.span("forward", kind=SpanKind.FORWARD):
        pass
    col.close()
    steps = sorted(s["step"] for s in _spans(blocker) if s["name"] == "forward")
    assert steps == [0, 1]  # the rows of the failed write were kept and written later


def test_row_buffer_is_bounded_and_counts_drops() -> None:
    buf = RowBuffer(capacity=3)
    assert [buf.put(i) for i in range(5)] == [True, True, True, False, False]
    assert buf.dropped == 2 and buf.drain(limit=2) == [0, 1]
    buf.push_front([9])
    assert buf.drain() == [9, 2]


def test_parts_are_written_while_the_job_runs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    col = _collector(run)
    with col.step(0):
        with col.comm(op="all_reduce", group="world"):
            pass
        # The enqueued marker of a call in progress reaches the disk without any flush() call.
        h = col.comm_begin(op="all_reduce", group="world")
        try:
            parts = wait_until(lambda: list((run / "markers").glob("rank=*/*.parquet")), timeout=30,
                               message="a markers part on disk")
            states = [s for p in parts for s in pq.ParquetFile(p).read().column("state").to_pylist()]
        finally:
            h.end()
    col.close()
    assert "enqueued" in states


# ---------------------------------------------------------------------------------------- flight recorder
def test_flight_recorder_entries_become_markers() -> None:
    assert op_name("nccl:all_reduce") == "all_reduce" and op_name("gloo:_allgather_base") == "all_gather"
    assert op_name("nccl:weird_op") == "other"
    done = {"collective_seq_id": 7, "profiling_name": "nccl:all_reduce", "state": "completed",
            "time_created_ns": 100, "time_discovered_started_ns": 150, "time_discovered_completed_ns": 300}
    rows = entry_markers(done, "fr:tp:0", 3, now_ns=999)
    assert [(r[1], r[2], r[4], r[5]) for r in rows] == [
        ("fr:tp:0", 7, "enqueued", 100), ("fr:tp:0", 7, "started", 150), ("fr:tp:0", 7, "completed", 300)]
    gloo = {"collective_seq_id": 2, "profiling_name": "gloo:all_reduce", "state": "scheduled",
            "time_created_ns": 100, "retired": True}
    assert [(r[4], r[5]) for r in entry_markers(gloo, "g", 0, now_ns=999)] == [("enqueued", 100), ("completed", 999)]
    stuck = dict(gloo, retired=False)
    assert [r[4] for r in entry_markers(stuck, "g", 0, now_ns=999)] == ["enqueued"]
    assert entry_markers({"collective_seq_id": 1, "is_p2p": True}, "g", 0, now_ns=1) == []


def test_flight_recorder_poller_reads_every_recorder_and_writes_each_state_once(tmp_path: Path) -> None:
    """torch 2.11 keeps NCCL's entries apart from the other backends' (``_dump_nccl_trace`` beside
    ``_dump_fr_trace``): the poller reads both; an entry both give (one recorder behind two names)
    is written once, and a state reached later is written when it is. Entries made before the
    collector (a group destroyed since, its name and numbers reused) are left out."""
    import pickle

    from megascope.collectors.flight_recorder import FlightRecorderPoller, dump_entries

    t0 = time.time_ns() + 10**9  # after the collector below is made

    def entry(pg: str, seq: int, state: str, **times: int) -> dict[str, object]:
        return {"process_group": (pg, pg), "collective_seq_id": seq, "profiling_name": "nccl:all_reduce",
                "state": state, "time_created_ns": t0 + 100 + seq, **{k: t0 + v for k, v in times.items()}}

    nccl = [entry("1", 1, "completed", time_discovered_started_ns=150, time_discovered_completed_ns=300),
            entry("1", 2, "started", time_discovered_started_ns=400)]
    other = [dict(entry("2", 1, "scheduled"), profiling_name="gloo:all_reduce", retired=True)]
    earlier = dict(nccl[0], time_created_ns=1000)  # the same group and number, from before the collector
    recorders = {"fr": other + nccl[:1], "nccl": [earlier, *nccl]}

    def dumper(name: str) -> Callable[..., bytes]:
        def dump(*, includeCollectives: bool, includeStackTraces: bool, onlyActive: bool) -> bytes:
            return pickle.dumps({"version": "2.10", "entries": recorders[name]})
        return dump

    assert len(dump_entries([dumper("fr"), dumper("nccl")])) == 5

    def broken(**_: bool) -> bytes:
        raise RuntimeError("no recorder here")

    assert len(dump_entries([broken, dumper("nccl")])) == 3  # the other recorder still read
    with pytest.raises(RuntimeError, match="no recorder here"):
        dump_entries([broken])
    col = Collector(CollectorConfig(run_dir=tmp_path / "run"), rank=0, world_size=1)
    poller = FlightRecorderPoller(col)
    poller._dump = [dumper("fr"), dumper("nccl")]
    poller()
    recorders["nccl"] = [nccl[0], entry("1", 2, "completed", time_discovered_started_ns=400,
                                        time_discovered_completed_ns=500)]
    poller()
    col.close()
    rows = open_run(tmp_path / "run").con.execute(
        "SELECT \"group\", seq, state, count(*), min(time_ns) - ? FROM markers WHERE starts_with(\"group\", 'fr:') "
        "GROUP BY ALL ORDER BY ALL", [t0]).fetchall()
    assert rows == [("fr:pg:1", 1, "completed", 1, 300), ("fr:pg:1", 1, "enqueued", 1, 101),
                    ("fr:pg:1", 1, "started", 1, 150), ("fr:pg:1", 2, "completed", 1, 500),
                    ("fr:pg:1", 2, "enqueued", 1, 102), ("fr:pg:1", 2, "started", 1, 400),
                    ("fr:pg:2", 1, "completed", 1, rows[6][4]), ("fr:pg:2", 1, "enqueued", 1, 101)]


def test_heartbeats_from_the_collector_join_its_rank_by_host(tmp_path: Path) -> None:
    cfg = CollectorConfig(run_dir=tmp_path / "run", flush_interval_s=0.2, heartbeat_interval_s=0.1)
    col = Collector(cfg, rank=0, world_size=1)
    with col.step(0), col.span("forward", kind=SpanKind.FORWARD):
        # A step long enough for the sampler (every 0.1 s) to beat during it.
        wait_until(lambda: col._heartbeat.stats["samples"] >= 3, timeout=30, message="three heartbeats")
    col.close()
    run = open_run(tmp_path / "run")
    joined = run.con.execute("""
        SELECT count(*), count(DISTINCT h.metric) FROM heartbeats h JOIN ranks r ON h.host = r.host
        WHERE h.rank = 0
    """).fetchone()
    assert joined[0] > 0 and joined[1] > 3
    # the collector's own counters ride along
    assert run.con.execute("SELECT count(*) FROM heartbeats WHERE metric LIKE 'collector_%'").fetchone()[0] > 0
    assert col.stats["rows_dropped"] == 0


@pytest.mark.parametrize("min_ms", [0.0, None])
def test_garbage_collections_become_host_spans(tmp_path: Path, min_ms: float | None) -> None:
    """Every collection of the interpreter at least gc_span_min_ms long is a host span of the step
    it stopped; None records none, and a closed collector leaves gc.callbacks as it found it."""
    import gc

    callbacks = list(gc.callbacks)
    run = tmp_path / "run"
    col = Collector(CollectorConfig(run_dir=run, gc_span_min_ms=min_ms), rank=0, world_size=1)
    with col.step(4):
        t0 = time.time_ns()
        gc.collect()
        t1 = time.time_ns()
    col.close()
    assert gc.callbacks == callbacks
    rows = open_run(run).con.sql(
        "SELECT name, kind, stream, step, start_ns, dur_ns FROM spans WHERE name LIKE 'gc.%'").fetchall()
    if min_ms is None:
        assert rows == [] and col.stats["gc_spans"] == 0
        return
    full = [r for r in rows if r[0] == "gc.gen2"]
    assert len(full) == 1 and col.stats["gc_spans"] == len(rows)
    name, kind, stream, step, start, dur = full[0]
    assert (kind, stream, step) == ("host", "host", 4)
    assert t0 <= start and start + dur <= t1 + 1_000_000 and dur > 0


def test_gc_span_threshold_from_the_environment() -> None:
    cfg = CollectorConfig(run_dir=Path("r"))
    assert cfg.with_env({"MEGASCOPE_GC_SPAN_MS": "5"}).gc_span_min_ms == 5.0
    assert cfg.with_env({"MEGASCOPE_GC_SPAN_MS": "-1"}).gc_span_min_ms is None
    with pytest.raises(ConfigError):
        CollectorConfig(run_dir=Path("r"), gc_span_min_ms=-2.0)


def test_timed_work_passes_a_timeout_on_only_when_given(tmp_path: Path) -> None:
    """Recorded or not, a wait behaves the same: TimedWork takes Work.wait's timeout and passes it on
    only when given (NCCL blocks the host in a wait with a timeout, so none must appear unasked)."""
    from datetime import timedelta

    from megascope.collectors.dist import TimedWork

    from megascope.trainer.instrument import _accepts_timeout

    class Work:
        def __init__(self) -> None:
            self.calls: list[tuple[Any, ...]] = []

        def wait(self, *args: Any) -> bool:
            self.calls.append(args)
            return True

    col = Collector(CollectorConfig(run_dir=tmp_path / "run"), rank=0, world_size=1)
    work = Work()
    with col.step(0):
        assert TimedWork(work, col.comm_begin(op="recv", kind="recv", peer=1)).wait() is True
        TimedWork(work, col.comm_begin(op="recv", kind="recv", peer=1)).wait(timedelta(seconds=3))
    col.close()
    assert work.calls == [(), (timedelta(seconds=3),)]
    assert _accepts_timeout(TimedWork(work, NOOP)) and not _accepts_timeout(work)  # no parameter: none passed


class _FakeCudaEvent:
    """torch.cuda.Event's surface, on the host clock: recorded = done, times in milliseconds."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.t: int | None = None

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter_ns()

    def query(self) -> bool:
        return self.t is not None

    def elapsed_time(self, other: _FakeCudaEvent) -> float:
        assert self.t is not None and other.t is not None
        return (other.t - self.t) / 1e6

    def wait(self, stream: Any = None) -> None:
        pass


def _fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    class Stream:
        cuda_stream = 7

        def query(self) -> bool:
            return True

    stream = Stream()
    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream())
    monkeypatch.setattr(torch._C, "_CudaEventBase", None, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", None, raising=False)
    from megascope.collectors import timing

    # torch's calls on the stand-in events, also on a machine with a real driver library
    monkeypatch.setattr(timing.DriverEventCalls, "load", classmethod(lambda cls, torch, index, hold=False: None))
    monkeypatch.setattr(timing.DriverRecord, "load", classmethod(lambda cls: None))


@pytest.mark.parametrize("side_stream", [False, True])
def test_cuda_timer_tokens_are_pool_indices_and_anchors_are_kept_by_number(monkeypatch: pytest.MonkeyPatch,
                                                                           side_stream: bool) -> None:
    """The CUDA timer's stamps are indices into its event pool and spans name their anchor by
    number: what a pending span holds is plain integers. Released indices are reused, the pool is
    bounded, and an anchor too old to be kept is an error, not a wrong time."""
    from megascope.collectors import timing

    _fake_cuda(monkeypatch)
    timer = timing.CudaTimer("cuda", max_events=3, anchor_interval_s=0.0, side_stream=side_stream)
    ref = timer.anchor_ref
    t0 = timer.stamp()
    time.sleep(0.002)
    t1 = timer.stamp()
    assert isinstance(t0, int) and isinstance(t1, int) and timer.ready(t1) and timer.stamps == 2
    start, end = timer.wall_ns(t0, ref), timer.wall_ns(t1, ref)
    assert 2_000_000 <= end - start < 1_000_000_000 and abs(start - time.time_ns()) < 1e9
    assert timer.stamp() is not None and timer.stamp() is None  # 3 events at most
    timer.release(t0)
    assert timer.stamp() == t0  # reused
    for _ in range(timing.ANCHOR_SLOTS):
        timer.maybe_refresh()
    assert timer.anchor_ref == ref + timing.ANCHOR_SLOTS
    with pytest.raises(LookupError):
        timer.wall_ns(t1, ref)
    assert abs(timer.wall_ns(t1, timer.anchor_ref) - end) < 1_000_000  # any kept anchor gives the same time


def test_a_cuda_anchor_whose_record_call_comes_back_late_is_not_trusted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The record call lets go of the interpreter lock; getting it back can take milliseconds. An
    anchor timed around such a call would put every span of the rank milliseconds late (seen on
    2x H200: one rank of a TP pair 1.2-4 ms behind its partner for a whole run). The timer keeps
    only records that came back at once: the first anchor tries again, a refresh keeps the old."""
    from megascope.collectors import timing

    late = {"calls": 0}

    class Event(_FakeCudaEvent):
        def record(self, stream: Any = None) -> None:
            super().record(stream)  # the device has it now
            if late["calls"] > 0:  # the call returns 4 ms later, as behind another thread
                late["calls"] -= 1
                time.sleep(0.004)

    _fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    late["calls"] = 3
    timer = timing.CudaTimer("cuda", anchor_interval_s=0.0)
    # (At least: on a loaded machine a call may also come back late by itself.)
    assert timer.anchors_loose >= 3 and timer.anchor.exact and timer.anchor_bracket_max_ns >= 4_000_000
    before = time.time_ns()
    token = timer.stamp()
    after = time.time_ns()
    assert token is not None
    stamped = timer.wall_ns(token, timer.anchor_ref)
    assert before - 200_000 <= stamped <= after + 200_000, (stamped - before, after - stamped)
    # A refresh whose records all come back late keeps the anchor it had.
    ref, loose_before = timer.anchor_ref, timer.anchors_loose
    late["calls"] = timing.ANCHOR_REFRESH_TRIES
    timer.maybe_refresh()
    assert timer.anchor_ref == ref and timer.anchors_loose >= loose_before + timing.ANCHOR_REFRESH_TRIES
    timer.maybe_refresh()  # back at once: taken
    assert timer.anchor_ref == ref + 1
    # With nothing but late records, the first anchor takes the tightest and counts as inexact,
    # until a refresh at an idle moment replaces it.
    late["calls"] = timing.ANCHOR_FIRST_TRIES
    loose = timing.CudaTimer("cuda", anchor_interval_s=0.0)
    assert not loose.anchor.exact and loose.anchors_loose >= timing.ANCHOR_FIRST_TRIES
    first = loose.anchor_ref
    loose.maybe_refresh()
    assert loose.anchor_ref == first + 1 and loose.anchor.exact


def test_cuda_timer_marks_are_timing_free_pooled_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mark (the completion of an untimed call) is a timing-free event from its own pool: it
    takes no stamp, is reused once released, and the pool is bounded like the stamps'."""
    from megascope.collectors import timing

    events: list[bool] = []

    class Event(_FakeCudaEvent):
        def __init__(self, enable_timing: bool = False) -> None:
            super().__init__(enable_timing)
            events.append(enable_timing)

    _fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    timer = timing.CudaTimer("cuda", max_events=2)
    events.clear()  # the first anchor's
    m0, m1 = timer.mark(), timer.mark()
    assert isinstance(m0, int) and m0 != m1 and timer.mark() is None
    assert events == [False, False] and timer.stamps == 0
    assert timer.mark_done(m0) and timer.mark_done(m1)
    timer.release_mark(m0)
    assert timer.mark() == m0 and events == [False, False]


class _FakeDriver:
    """libcuda's event calls over _FakeCudaEvent handles (``cuda_event``): return codes, the
    elapsed time written through its pointer, and which thread set which current context."""

    def __init__(self) -> None:
        self.events: dict[int, _FakeCudaEvent] = {}
        self.current: dict[int, int] = {}  # thread id -> its current context
        self.set_calls: list[tuple[int, int]] = []
        self.fail: int | None = None  # a device error every call returns

        def query(handle: int) -> int:
            if self.fail is not None:
                return self.fail
            return 0 if self.events[handle].t is not None else 600

        def elapsed(ms: Any, start: int, end: int) -> int:
            a, b = self.events[start], self.events[end]
            if a.t is None or b.t is None:
                return 600
            ms._obj.value = (b.t - a.t) / 1e6
            return 0

        def get_current(out: Any) -> int:
            out._obj.value = self.current.get(threading.get_ident())
            return 0

        def set_current(context: int) -> int:
            self.set_calls.append((threading.get_ident(), context))
            self.current[threading.get_ident()] = context
            return 0

        self.cuEventQuery, self.cuEventElapsedTime = query, elapsed
        self.cuCtxGetCurrent, self.cuCtxSetCurrent = get_current, set_current

    def handle(self, event: _FakeCudaEvent) -> int:
        self.events[id(event)] = event
        return id(event)


def _stamps_and_mark(timer: Any) -> tuple[int, int, int]:
    """Two stamps 2 ms apart, then a mark."""
    t0 = timer.stamp()
    time.sleep(0.002)
    t1 = timer.stamp()
    mark = timer.mark()
    assert t0 is not None and t1 is not None and mark is not None
    return t0, t1, mark


def test_cuda_timer_asks_the_driver_without_torch_and_binds_a_bare_thread_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """With event_calls "driver" the writer's calls (ready, wall_ns, mark_done) go to the driver
    library's cuEventQuery and cuEventElapsedTime on the events' handles, with the same answers as
    torch's calls; a thread with no current CUDA context is given the device's once, a thread
    with one keeps it; a device error raises; "torch" never touches the driver."""
    from megascope.collectors import timing

    driver = _FakeDriver()

    class Event(_FakeCudaEvent):
        @property
        def cuda_event(self) -> int:
            return driver.handle(self)

        def query(self) -> bool:
            raise AssertionError("asked through torch")

        def elapsed_time(self, other: _FakeCudaEvent) -> float:
            raise AssertionError("timed through torch")

    _fake_cuda(monkeypatch)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    calls = timing.DriverEventCalls(driver, context=0xC0)
    monkeypatch.setattr(timing.DriverEventCalls, "load", classmethod(lambda cls, torch, index, hold=False: calls))
    driver.current[threading.get_ident()] = 0xAA  # the training thread's own context
    timer = timing.CudaTimer("cuda", anchor_interval_s=3600.0, event_calls="driver")
    assert timer.event_calls == "driver"
    ref = timer.anchor_ref
    t0, t1, mark = _stamps_and_mark(timer)
    assert timer.ready(t1) and timer.mark_done(mark)
    assert 2_000_000 <= timer.wall_ns(t1, ref) - timer.wall_ns(t0, ref) < 1_000_000_000
    assert driver.set_calls == []  # this thread had a context: kept

    got: list[Any] = []
    writer = threading.Thread(target=lambda: got.extend([timer.ready(t1), timer.ready(t0), timer.wall_ns(t1, ref)]))
    writer.start()
    writer.join()
    assert got[:2] == [True, True] and got[2] == timer.wall_ns(t1, ref)
    assert [context for _, context in driver.set_calls] == [0xC0]  # the bare thread, bound once

    pending = timer.stamp()
    assert pending is not None
    timer._events[pending].t = None  # recorded, not done yet
    assert not timer.ready(pending)
    with pytest.raises(RuntimeError, match="600"):
        timer.wall_ns(pending, ref)
    driver.fail = 700
    with pytest.raises(RuntimeError, match="700"):
        timer.ready(t1)

    monkeypatch.setattr(torch.cuda, "Event", _FakeCudaEvent)
    plain = timing.CudaTimer("cuda")
    assert plain.event_calls == "torch"  # the default
    token = plain.stamp()
    assert token is not None and plain.ready(token)


def test_driver_held_event_calls_open_the_driver_through_a_handle_that_keeps_the_interpreter_lock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``event_calls="driver-held"``: the same driver calls through ``ctypes.PyDLL`` (ctypes keeps
    the interpreter lock for the call), ``driver`` through ``ctypes.CDLL`` (it lets go of it)."""
    import contextlib
    import ctypes

    from megascope.collectors import timing

    opened: list[str] = []

    def opener(kind: str) -> Any:
        def open_library(name: str) -> _FakeDriver:
            assert name == "libcuda.so.1"
            opened.append(kind)
            driver = _FakeDriver()
            driver.current[threading.get_ident()] = 0xAB
            return driver
        return open_library

    monkeypatch.setattr(ctypes, "CDLL", opener("CDLL"))
    monkeypatch.setattr(ctypes, "PyDLL", opener("PyDLL"))
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    held = timing.DriverEventCalls.load(torch, 0, hold=True)
    released = timing.DriverEventCalls.load(torch, 0)
    assert held is not None and released is not None and opened == ["PyDLL", "CDLL"]
    assert held._context == released._context == 0xAB


def test_event_calls_fall_back_to_torch_where_the_driver_cannot_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """No driver library (a machine without one, a stripped container): torch's calls, logged."""
    import ctypes

    from megascope.collectors import timing

    def missing(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", missing)
    monkeypatch.setattr(ctypes, "PyDLL", missing)
    assert timing.DriverEventCalls.load(torch, 0) is None
    assert timing.DriverEventCalls.load(torch, 0, hold=True) is None
    _fake_cuda(monkeypatch)
    assert timing.CudaTimer("cuda", event_calls="driver").event_calls == "torch"
    assert timing.CudaTimer("cuda", event_calls="driver-held").event_calls == "torch"
    with pytest.raises(ConfigError, match="event_calls"):
        CollectorConfig(run_dir=Path("r"), event_calls="cuda")
    assert CollectorConfig(run_dir=Path("r")).with_env({"MEGASCOPE_EVENT_CALLS": " Driver"}).event_calls == "driver"
    assert CollectorConfig(run_dir=Path("r")).with_env({"MEGASCOPE_EVENT_CALLS": "driver-held"}).event_calls == "driver-held"


def test_the_training_threads_records_go_to_the_driver_keeping_the_interpreter_lock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``record_calls="driver"`` (the default): a stamp or a mark records its pooled event through
    ``cuEventRecord`` on the current stream's raw handle, opened through ``ctypes.PyDLL`` (the
    call keeps the interpreter lock); torch records an event once, when the pool makes it (torch
    makes its CUDA object then). A record the driver refuses is made through torch, and counted."""
    import ctypes

    from megascope.collectors import timing

    real_load = timing.DriverRecord.__dict__["load"]
    _fake_cuda(monkeypatch)
    by_handle: dict[int, _FakeCudaEvent] = {}
    torch_records: list[int] = []
    driver_records: list[tuple[int, int]] = []

    class Event(_FakeCudaEvent):
        def record(self, stream: Any = None) -> None:
            torch_records.append(id(self))
            super().record(stream)

        @property
        def cuda_event(self) -> int:
            by_handle[id(self)] = self
            return id(self)

    class Driver:
        refuse = False

        def __init__(self) -> None:
            def record(handle: int, stream: int) -> int:
                if self.refuse:
                    return 201  # CUDA_ERROR_INVALID_CONTEXT
                driver_records.append((handle, stream))
                by_handle[handle].t = time.perf_counter_ns()
                return 0

            self.cuEventRecord = record  # a function, as ctypes gives: it takes argtypes

    driver = Driver()
    opened: list[str] = []
    monkeypatch.setattr(ctypes, "PyDLL", lambda name: opened.append(name) or driver)
    monkeypatch.setattr(timing.DriverRecord, "load", real_load)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)  # the default stream
    timer = timing.CudaTimer("cuda", anchor_interval_s=3600.0, record_calls="driver")
    assert timer.record_calls == "driver" and opened == ["libcuda.so.1"]
    anchors = len(torch_records)  # the anchor is recorded through torch (its record is timed)
    ref = timer.anchor_ref
    t0, t1, mark = _stamps_and_mark(timer)
    # Three events made (two timing, one timing-free): torch recorded each once, the driver each stamp.
    assert len(torch_records) == anchors + 3
    assert [stream for _, stream in driver_records] == [0, 0, 0]
    assert timer.ready(t1) and timer.mark_done(mark)
    assert 2_000_000 <= timer.wall_ns(t1, ref) - timer.wall_ns(t0, ref) < 1_000_000_000
    timer.release(t0)
    timer.release_mark(mark)
    assert timer.stamp() == t0 and timer.mark() == mark
    assert len(torch_records) == anchors + 3 and len(driver_records) == 5 and timer.record_fallbacks == 0
    driver.refuse = True
    t2 = timer.stamp()
    assert t2 is not None and timer.ready(t2) and timer.record_fallbacks == 1
    assert len(torch_records) == anchors + 5  # made (through torch), then recorded through torch

    # "torch", or no driver library: torch's records only.
    assert timing.CudaTimer("cuda", record_calls="torch").record_calls == "torch"
    monkeypatch.setattr(ctypes, "PyDLL", lambda name: (_ for _ in ()).throw(OSError(f"{name}: not found")))
    assert timing.CudaTimer("cuda", record_calls="driver").record_calls == "torch"
    assert CollectorConfig(run_dir=Path("r")).record_calls == "driver"
    assert CollectorConfig(run_dir=Path("r")).with_env({"MEGASCOPE_RECORD_CALLS": " Torch"}).record_calls == "torch"
    with pytest.raises(ConfigError, match="record_calls"):
        CollectorConfig(run_dir=Path("r"), record_calls="cuda")


def test_pending_spans_hold_nothing_the_garbage_collector_tracks(tmp_path: Path) -> None:
    """A span waiting for the writer is a tuple of plain values, which the garbage collector stops
    tracking at its first pass: the collector's queue never adds to the interpreter's full
    collections."""
    import gc

    col = Collector(CollectorConfig(run_dir=tmp_path / "run", flush_interval_s=3600.0), rank=0, world_size=1)
    with col.step(0):
        with col.span("x"):
            pass
        handle = col.comm_begin(op="all_reduce", group="world")
        handle.waiting()
        handle.end()
    gc.collect()
    pending = list(col._sink.pending_spans._rows)
    assert len(pending) == 3 and not any(gc.is_tracked(item) for item in pending)
    col.close()


def test_cuda_timer_never_hands_one_event_to_two_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stamps from two threads at once (a backward hook runs on autograd's thread) get distinct
    events, with the interpreter switching threads as often as it can."""
    import sys
    import threading

    from megascope.collectors import timing

    _fake_cuda(monkeypatch)
    timer = timing.CudaTimer("cuda")
    got: list[list[Any]] = [[], []]

    def stamp_many(out: list[Any]) -> None:
        for _ in range(3000):
            out.append(timer.stamp())

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=stamp_many, args=(out,)) for out in got]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    tokens = got[0] + got[1]
    assert None not in tokens and len(set(tokens)) == len(tokens) == 6000 == timer.outstanding


# ---------------------------------------------------------------------------------------- node compaction


def test_node_ranks_come_from_the_launchers_environment() -> None:
    from megascope.collectors.node_compact import node_ranks

    assert node_ranks(16, 32, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "8"}) == (16, 23)
    assert node_ranks(19, 32, {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}) is None  # local rank 0 starts it
    assert node_ranks(0, 1, {}) == (0, 0)
    with pytest.raises(ValueError, match="node's ranks are unknown"):
        node_ranks(0, 4, {"LOCAL_RANK": "0"})
    with pytest.raises(ValueError, match="does not fit"):
        node_ranks(24, 32, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "16"})
    with pytest.raises(ValueError, match="not a number"):
        node_ranks(0, 8, {"LOCAL_RANK": "zero", "LOCAL_WORLD_SIZE": "8"})
    cfg = CollectorConfig(run_dir=Path("r")).with_env({"MEGASCOPE_COMPACT_EVERY_S": "30",
                                                       "MEGASCOPE_COMPACT_MIN_AGE_S": "5"})
    assert (cfg.node_compact_every_s, cfg.node_compact_min_age_s) == (30.0, 5.0)
    assert CollectorConfig(run_dir=Path("r")).with_env({"MEGASCOPE_COMPACT_EVERY_S": "0"}).node_compact_every_s is None
    with pytest.raises(ConfigError, match="node_compact_every_s"):
        CollectorConfig(run_dir=Path("r"), node_compact_every_s=0.5)


def test_the_nodes_first_rank_compacts_the_nodes_parts_while_it_runs(tmp_path: Path) -> None:
    from megascope import layout

    run = tmp_path / "run"
    col = _collector(run, marker_agent=False, node_compact_every_s=1.0, node_compact_min_age_s=0.0)
    process = col._node_compaction.process
    recorded = 0

    def committed() -> bool:
        manifests, _ = layout.read_manifests(run, "spans")
        return any(layout.compacted_scope(m.path.name) == "r00000_00000" for m in manifests)

    try:
        step = 0
        deadline = time.monotonic() + 60
        while not committed() and time.monotonic() < deadline:
            with col.step(step):
                with col.span("work"):
                    time.sleep(0.01)
                recorded += 1
            step += 1
            time.sleep(0.05)
        assert committed(), "no pass of the node's compaction committed in 60 s"
        assert process.poll() is None  # still running beside the job
    finally:
        col.close()
    assert process.poll() is not None  # stopped with the collector
    count = open_run(run).con.execute("SELECT count(*) FROM spans WHERE name = 'work'").fetchone()
    assert count == (recorded,)


def test_cli_every_stops_once_the_process_it_watches_has_ended(tmp_path: Path) -> None:
    import subprocess
    import sys
    import threading

    from megascope import layout

    run = tmp_path / "run"
    _collector(run, marker_agent=False).close()
    assert layout.read_run_json(run)
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])
    reaper = threading.Thread(target=watched.wait)  # reaped as soon as it ends, so its pid is gone
    reaper.start()
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megascope", "compact", str(run), "--ranks", "0", "--every", "30",
                           "--while-pid", str(watched.pid)], capture_output=True, text=True, timeout=60)
    reaper.join()
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - started < 20  # not the 30 s of its period
    lone = subprocess.run([sys.executable, "-m", "megascope", "compact", str(run), "--while-pid", "1"],
                          capture_output=True, text=True, timeout=60)
    assert lone.returncode == 2 and "--while-pid goes with --every" in lone.stderr


def test_the_switch_interval_is_the_collector_s_while_it_is_open_and_the_job_s_after(tmp_path: Path) -> None:
    """switch_interval_us (MEGASCOPE_SWITCH_INTERVAL_US): the interpreter's switch interval while
    the collector is open, the job's put back at close (unless the job changed it meanwhile)."""
    import sys

    cfg = CollectorConfig(run_dir=tmp_path / "a")
    assert cfg.with_env({"MEGASCOPE_SWITCH_INTERVAL_US": "500"}).switch_interval_us == 500
    assert cfg.with_env({"MEGASCOPE_SWITCH_INTERVAL_US": "0"}).switch_interval_us is None
    with pytest.raises(ConfigError, match="MEGASCOPE_SWITCH_INTERVAL_US"):
        cfg.with_env({"MEGASCOPE_SWITCH_INTERVAL_US": "fast"})
    with pytest.raises(ConfigError, match="switch_interval_us must be > 0"):
        CollectorConfig(run_dir=tmp_path, switch_interval_us=-5)
    job = sys.getswitchinterval()
    try:
        col = _collector(tmp_path / "b", switch_interval_us=500)
        assert sys.getswitchinterval() == pytest.approx(500e-6)
        col.close()
        assert sys.getswitchinterval() == job
        col = _collector(tmp_path / "c", switch_interval_us=500)
        sys.setswitchinterval(0.002)  # the job's own change after the collector's is kept
        col.close()
        assert sys.getswitchinterval() == pytest.approx(0.002)
        col = _collector(tmp_path / "d")
        assert sys.getswitchinterval() == pytest.approx(0.002)
        col.close()
    finally:
        sys.setswitchinterval(job)


def test_a_sigterm_during_a_marker_agent_s_pass_still_gets_its_last_pass(tmp_path: Path) -> None:
    """A SIGTERM (a launcher stopping the job) that lands while the marker agent writes a pass
    ends the agent after that pass with its last one (the final markers, rank_alive 0), not at
    once without it: raised there, it went past the agent's loop."""
    import os
    import signal

    import pyarrow as pa
    from megascope.collectors import agent

    class Ring:  # nothing to write; its second read is where the SIGTERM lands
        lost = 0
        reads = 0

        def read_table(self) -> pa.Table:
            self.reads += 1
            if self.reads == 2:
                os.kill(os.getpid(), signal.SIGTERM)
            return pa.table({})

        def commit(self) -> None:
            pass

        def ack_flush(self, flushes: int) -> None:
            pass

    previous = signal.signal(signal.SIGTERM, agent._stop)
    read_end, write_end = os.pipe()
    ring = Ring()
    try:
        agent.Agent(ring, tmp_path, rank=3, host="h0", pid=os.getpid()).run(read_end, 0.05)
    finally:
        signal.signal(signal.SIGTERM, previous)
        agent._STOPPING = False
        os.close(read_end)
        os.close(write_end)
    assert ring.reads == 4  # the pass the signal landed in, one more, and the last
    rows = sorted((r for part in tmp_path.glob("heartbeats/host=*/part-*.parquet")
                   for r in pq.read_table(part, columns=["rank", "metric", "value", "time_ns"]).to_pylist()),
                  key=lambda r: r["time_ns"])
    alive = [r["value"] for r in rows if r["metric"] == "rank_alive" and r["rank"] == 3]
    assert alive[-1] == 0.0 and alive.count(0.0) == 1
