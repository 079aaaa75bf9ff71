"""Hang evidence that needs no Python of the training process: the marker ring and its agent,
stall stacks, the NCCL flight-recorder settings, and what `localize` makes of them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import wait_until
from megascope.collectors import Collector, CollectorConfig
from megascope.collectors.evidence import AgentLink, enable_nccl_flight_recorder
from megascope.collectors.ring import MarkerRing, RingReader

from megascope.analysis.witness import frame_text, read_stacks
from megascope.schema import MARKERS


def _markers_on_disk(run: Path) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for part in sorted(run.glob("markers/rank=*/part-*.parquet")):
        rows.extend(pq.read_table(part).to_pylist())
    return rows


def test_ring_round_trip_keeps_nulls_and_order(tmp_path: Path) -> None:
    ring = MarkerRing.create(capacity=8, directory=str(tmp_path))
    rows = [
        (3, "tp:1", 0, "all_reduce", "enqueued", 10, 0, 4096, None),
        (3, "tp:1", 0, "all_reduce", "completed", 12, 0, 4096, None),
        (3, "p2p", 7, "send", "enqueued", 13, None, None, 5),
    ]
    for row in rows:
        assert ring.put(row)
    reader = RingReader(ring.path, rank=3)
    assert reader.read() == rows
    reader.commit()
    assert reader.read() == []
    assert len(ring) == 0
    reader.close()
    ring.close()
    assert not ring.path.exists()


def test_a_reader_behind_by_more_than_the_ring_counts_what_it_lost(tmp_path: Path) -> None:
    ring = MarkerRing.create(capacity=4, directory=str(tmp_path))
    for seq in range(10):
        ring.put((0, "dp:0", seq, "all_reduce", "enqueued", seq, 1, None, None))
    reader = RingReader(ring.path, rank=0)
    got = reader.read()
    assert [r[2] for r in got] == [6, 7, 8, 9]
    assert reader.lost == 6
    reader.close()
    ring.close()


@pytest.mark.parametrize("numpy_missing", [False, True])
def test_the_ring_read_as_a_table_holds_the_same_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     numpy_missing: bool) -> None:
    """Column by column (numpy) or row by row (a minimal install without numpy): the rows
    ``read`` gives, nulls, order and wrap-around included, and the same count of lost rows."""
    if numpy_missing:
        monkeypatch.setitem(sys.modules, "numpy", None)  # ``import numpy`` raises ImportError
    ring = MarkerRing.create(capacity=16, directory=str(tmp_path))
    rows = [(3, f"tp:{seq % 3}", seq, "all_reduce" if seq % 4 else "send", "enqueued" if seq % 2 else "completed",
             100 + seq, None if seq % 5 == 0 else seq // 4, None if seq % 3 == 0 else 4096 * seq,
             7 if seq % 4 == 0 else None) for seq in range(12)]
    for row in rows:
        ring.put(row)
    reader = RingReader(ring.path, rank=3)
    table = reader.read_table()
    assert table.schema == MARKERS
    assert [tuple(r.values()) for r in table.to_pylist()] == rows
    reader.commit()
    assert reader.read_table().num_rows == 0
    # Past the ring's end (records 12-15, then 0-5 again), then a reader 40 rows behind a ring of 16.
    more = [(3, "dp:0", seq, "all_gather", "enqueued", 200 + seq, 1, 8, None) for seq in range(12, 22)]
    for row in more:
        ring.put(row)
    assert [tuple(r.values()) for r in reader.read_table().to_pylist()] == more
    for seq in range(22, 52):
        ring.put((3, "dp:0", seq, "all_gather", "enqueued", seq, 1, 8, None))
    lapped = RingReader(ring.path, rank=3)
    assert [r["seq"] for r in lapped.read_table().to_pylist()] == list(range(36, 52)) and lapped.lost == 24
    for r in (reader, lapped):
        r.close()
    ring.close()


def test_a_full_string_table_refuses_and_counts(tmp_path: Path) -> None:
    ring = MarkerRing.create(capacity=4, directory=str(tmp_path))
    accepted = sum(ring.put((0, f"g{i:0>1000}", 0, "all_reduce", "enqueued", 0, None, None, None))
                   for i in range(100))
    assert 0 < accepted < 100
    assert ring.dropped == 100 - accepted
    ring.close()


def test_flush_writes_through_the_agent_and_close_ends_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    col = Collector(CollectorConfig(run_dir=run, flush_interval_s=30.0), rank=0, world_size=1)
    assert col.stats["marker_agent"]
    agent = col._agent
    assert agent is not None
    with col.step(0), col.comm("all_reduce", group="world", bytes=8):
        pass
    col.flush()  # the agent's pass, though its own interval is 30 s away
    states = sorted(r["state"] for r in _markers_on_disk(run))
    assert states == ["completed", "enqueued"]
    col.close()
    assert agent.proc.returncode == 0
    alive = sorted((r for p in run.glob("heartbeats/host=*/part-*.parquet") for r in pq.read_table(p).to_pylist()
                    if r["metric"] == "rank_alive"), key=lambda r: r["time_ns"])
    assert alive and alive[-1]["value"] == 0.0 and alive[-1]["pid"] == os.getpid()


def test_close_writes_the_markers_itself_when_the_agent_is_gone(tmp_path: Path) -> None:
    run = tmp_path / "run"
    col = Collector(CollectorConfig(run_dir=run, flush_interval_s=30.0), rank=0, world_size=1)
    assert col._agent is not None
    col._agent.proc.kill()
    col._agent.proc.wait()
    with col.step(0), col.comm("all_reduce", group="world", bytes=8):
        pass
    col.close()
    assert sorted(r["state"] for r in _markers_on_disk(run)) == ["completed", "enqueued"]


FROZEN_RANK = textwrap.dedent("""
    import ctypes, signal, sys, time
    from pathlib import Path
    from megascope.collectors import Collector, CollectorConfig
    col = Collector(CollectorConfig(run_dir=Path(sys.argv[1]), flush_interval_s=0.2), rank=2, world_size=4)
    with col.step(0):
        for seq in range(5):
            with col.comm("all_reduce", group="dp:0", bytes=64):
                pass
    with col.step(1):
        col.comm_begin("all_reduce", group="dp:0", bytes=64)   # entered, never completed
        print("frozen", flush=True)
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        ctypes.PyDLL(None).sleep(3600)                           # holds the interpreter lock
""")


def test_a_frozen_process_gets_its_markers_out_and_a_sigkill_loses_none(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with subprocess.Popen([sys.executable, "-c", FROZEN_RANK, str(run)], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "frozen"
            # Written while the process is frozen: the agent's doing.
            entered = wait_until(lambda: [r for r in _markers_on_disk(run) if r["step"] == 1], timeout=30,
                                 interval=0.1, message="the frozen rank's markers on disk")
            assert [(r["seq"], r["state"]) for r in entered] == [(5, "enqueued")]
            assert proc.poll() is None  # still frozen
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    ended = wait_until(
        lambda: [r for p in run.glob("heartbeats/host=*/part-*.parquet") for r in pq.read_table(p).to_pylist()
                 if r["metric"] == "rank_alive" and r["value"] == 0.0],
        timeout=30, interval=0.1, message="the agent's last row after its rank was killed")
    assert ended, "the agent wrote no last row after its rank was killed"
    rows = _markers_on_disk(run)
    assert sorted((r["seq"], r["state"]) for r in rows if r["state"] == "enqueued") == [(s, "enqueued") for s in range(6)]
    assert all(r["rank"] == 2 for r in rows)
    assert set(pq.read_schema(next(run.glob("markers/rank=*/part-*.parquet"))).names) >= set(MARKERS.names)


@pytest.mark.timing
def test_a_stalled_step_leaves_every_threads_stack(tmp_path: Path) -> None:
    run = tmp_path / "run"
    col = Collector(CollectorConfig(run_dir=run, stacks_after_s=0.2, marker_agent=False), rank=1, world_size=2)
    with col.step(0):
        pass  # ends in time: nothing dumped
    with col.step(1):
        time.sleep(0.6)  # stalls past the watch
    col.close()
    stacks = read_stacks(run, 1)
    assert stacks is not None and stacks["step"] == 1 and stacks["thread"] == "training"
    assert stacks["threads"] >= 2  # the writer thread too
    innermost = stacks["frames"][0]
    assert innermost["function"] == "test_a_stalled_step_leaves_every_threads_stack"
    assert frame_text(innermost).startswith("tests/test_hang_evidence.py:")


def test_no_stall_no_stacks_file(tmp_path: Path) -> None:
    run = tmp_path / "run"
    col = Collector(CollectorConfig(run_dir=run, stacks_after_s=5.0, marker_agent=False), rank=0, world_size=1)
    for step in range(3):
        with col.step(step):
            pass
    col.close()
    assert not (run / "stacks").exists()
    assert read_stacks(run, 0) is None


def test_flight_recorder_settings_go_into_the_run_unless_the_job_set_its_own(tmp_path: Path) -> None:
    env: dict[str, str] = {}
    assert enable_nccl_flight_recorder(tmp_path / "run", env)
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str((tmp_path / "run").resolve() / "flight_recorder" / "rank_")
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000" and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert (tmp_path / "run" / "flight_recorder").is_dir()
    own = {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/elsewhere/trace_", "TORCH_NCCL_TRACE_BUFFER_SIZE": "50",
           "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}
    assert not enable_nccl_flight_recorder(tmp_path / "other", own)
    assert own == {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/elsewhere/trace_", "TORCH_NCCL_TRACE_BUFFER_SIZE": "50",
                   "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}


def test_the_agent_link_starts_on_a_fresh_ring(tmp_path: Path) -> None:
    link = AgentLink.start(tmp_path / "run", rank=4, host="h", interval_s=0.1)
    try:
        link.ring.put((4, "world", 0, "barrier", "enqueued", time.time_ns(), 0, None, None))
        assert link.flush(timeout_s=10.0)
        assert [(r["rank"], r["op"]) for r in _markers_on_disk(tmp_path / "run")] == [(4, "barrier")]
    finally:
        link.close(timeout_s=10.0)
    assert link.fallback_rows == 0


def test_markers_reach_the_disk_while_the_rank_waits_without_any_flush(tmp_path: Path) -> None:
    run = tmp_path / "run"
    col = Collector(CollectorConfig(run_dir=run, flush_interval_s=0.1), rank=0, world_size=1)
    assert col._agent is not None and col._agent.flush(timeout_s=10.0)  # the agent is up
    with col.step(0):
        col.comm_begin("all_reduce", group="world", bytes=8)  # entered; this thread now only waits
        on_disk = wait_until(lambda: _markers_on_disk(run), timeout=30, message="the marker on disk")
    col.close()
    assert [(r["seq"], r["state"]) for r in on_disk] == [(0, "enqueued")]


@pytest.mark.timing
def test_the_topology_page_shows_the_culprits_stack(tmp_path: Path) -> None:
    from megascope.dashboard.pages.topology import stack_block, suspect_row

    run = tmp_path / "run"
    col = Collector(CollectorConfig(run_dir=run, stacks_after_s=0.2, marker_agent=False), rank=3, world_size=4)
    with col.step(7):
        time.sleep(0.6)
    col.close()
    suspect = {"rank": 3, "host": "h", "group": "tp:1", "evidence": ["markers", "flight_recorder"],
               "stack": read_stacks(run, 3)}
    row = suspect_row(suspect)
    assert row["evidence"] == "markers + flight_recorder" and "stack" not in row
    assert row["stopped_in"].endswith("test_the_topology_page_shows_the_culprits_stack")
    heading, pre = stack_block(suspect)
    assert "rank 3 stopped: the training thread at step 7" in heading.children
    assert pre.children.splitlines()[0] == row["stopped_in"]
    assert stack_block({"rank": 1, "stack": None}) == []


def test_the_agent_process_stays_small_it_never_imports_torch() -> None:
    """One agent runs per rank: importing torch there would cost seconds and hundreds of MiB each."""
    out = subprocess.run([sys.executable, "-c", "import sys, megascope.collectors.agent; "
                          "print(sorted(m for m in ('torch', 'duckdb', 'pandas') if m in sys.modules))"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_rows_that_never_reach_the_disk_are_counted_as_dropped(tmp_path: Path) -> None:
    """Tables whose directory cannot be written (a file stands where it should be; chmod does not
    stop root): what could not be written by close is counted, spans and markers alike."""
    import shutil

    run = tmp_path / "run"
    col = Collector(CollectorConfig(run_dir=run, flush_interval_s=30.0), rank=0, world_size=1)
    with col.step(0), col.comm("all_reduce", group="world", bytes=8):
        pass
    col.flush()
    assert col.stats["rows_dropped"] == 0
    for table in ("spans", "markers", "metrics"):
        shutil.rmtree(run / table)
        (run / table).write_text("not a directory")
    for step in range(1, 4):
        with col.step(step), col.comm("all_reduce", group="world", bytes=8):
            pass
    col.close()
    stats = col.stats
    # 3 steps x (step span + comm span) + 3 stamps metrics + 3 x 2 markers, all lost.
    assert stats["rows_dropped"] >= 3 * 2 + 3 + 3 * 2, stats
    assert stats["write_errors"] > 0


def test_the_fault_grammar_refuses_non_finite_numbers_and_knows_freeze() -> None:
    from megascope.errors import ConfigError
    from megascope.inject import parse_inject, parse_injects

    for spec in ("straggler:rank=1,factor=nan", "straggler:rank=1,factor=inf", "skew:rank=2,ms=nan"):
        with pytest.raises(ConfigError, match="finite"):
            parse_inject(spec)
    faults = parse_injects(["freeze:rank=3,step=2", "hang:rank=1,step=4"])
    assert faults.hang_step(3) == 2 and faults.hang_step(3, ("hang",)) is None
    assert faults.hang_step(1, ("freeze",)) is None and faults.hang_step(1) == 4


RANK_WITH_A_DATA_WORKER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from megascope.collectors import Collector, CollectorConfig
    from megascope.trainer.data import Prefetcher, SyntheticLanguage
    col = Collector(CollectorConfig(run_dir=Path(sys.argv[1]), flush_interval_s=0.2), rank=0, world_size=2)
    # Forked after the agent started: the worker holds a copy of every file the rank had open,
    # the write end of the agent's pipe too. Batches of 2 MB fill the worker's pipe at once.
    data = Prefetcher(SyntheticLanguage(vocab=64, seq_len=4095, seed=0), steps=range(40), global_batch=64,
                      rows=slice(0, 64), process=True)
    data.__enter__()
    data.next()
    print(data._worker.pid, col._agent.proc.pid, flush=True)
    time.sleep(3600)
""")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"  # a zombie has exited
    except FileNotFoundError:
        return True


@contextlib.contextmanager
def _killed_rank(script: str, run: Path) -> Iterator[tuple[int, int]]:
    """Run ``script`` as a rank writing ``run``; once it has printed two pids (a process it forked,
    its agent), SIGKILL it and hand them over; SIGKILL them afterwards, whatever the test found."""
    with subprocess.Popen([sys.executable, "-c", script, str(run)], stdout=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None
            child, agent = (int(x) for x in proc.stdout.readline().split())
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    try:
        yield child, agent
    finally:
        for pid in (child, agent):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _last_alive(run: Path) -> float:
    alive = [r for p in run.glob("heartbeats/host=*/part-*.parquet") for r in pq.read_table(p).to_pylist()
             if r["metric"] == "rank_alive"]
    return float(sorted(alive, key=lambda r: r["time_ns"])[-1]["value"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_rank_s_data_worker_and_agent_end_though_the_worker_holds_the_agent_s_pipe(tmp_path: Path) -> None:
    # On a GPU rank the trainer's batches come from a forked worker. When a hung rank was killed,
    # the worker stayed (its exit waited to flush a batch nobody would read) and kept the agent's
    # stdin open, so the agent never made its last pass and ran on, holding the job's output open.
    run = tmp_path / "run"
    with _killed_rank(RANK_WITH_A_DATA_WORKER, run) as (worker, agent):
        wait_until(lambda: _gone(worker), timeout=20, interval=0.1, message="the data worker ending after its rank")
        wait_until(lambda: _gone(agent), timeout=20, interval=0.1, message="the agent ending after its rank")
    assert _last_alive(run) == 0.0


RANK_WITH_A_LINGERING_FORK = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from megascope.collectors import Collector, CollectorConfig
    col = Collector(CollectorConfig(run_dir=Path(sys.argv[1]), flush_interval_s=0.2), rank=0, world_size=2)
    child = os.fork()
    if child == 0:  # a user's loader worker that outlives its rank a while, the agent's pipe open
        time.sleep(3600)
        os._exit(0)
    print(child, col._agent.proc.pid, flush=True)
    time.sleep(3600)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_agent_ends_with_its_rank_while_a_process_the_rank_forked_holds_its_pipe(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with _killed_rank(RANK_WITH_A_LINGERING_FORK, run) as (child, agent):
        wait_until(lambda: _gone(agent), timeout=20, interval=0.1, message="the agent ending after its rank")
        assert not _gone(child)  # the pipe's write end was still open all along
    assert _last_alive(run) == 0.0
