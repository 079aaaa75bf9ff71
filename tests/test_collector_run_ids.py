"""Every part the collector writes carries run.json's run id, agreed by all ranks without talking:
the writer thread's spans, markers, metrics, ranks and groups, the marker agent's markers and
``rank_alive`` rows, the heartbeat sampler's samples. A collector part copied in from another run
is skipped and named; a run whose parts carry no id (older collectors) stays readable."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from conftest import wait_until
from megascope.collectors import Collector, CollectorConfig
from megascope.collectors.agent import Control
from megascope.collectors.ring import FLUSHES_AT, MarkerRing
from megascope.collectors.runid import (
    ELASTIC_RUN_ID_VAR,
    FRESH_S,
    RUN_ID_VAR,
    RunId,
    job_run_id,
    resolve_run_id,
)

from megascope import layout
from megascope.schema import RunMeta
from megascope.store import open_run

ROOT = Path(__file__).resolve().parents[1]
JOBS = Path(__file__).resolve().parent / "jobs"


@pytest.fixture(autouse=True)
def _no_launcher_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (RUN_ID_VAR, ELASTIC_RUN_ID_VAR):
        monkeypatch.delenv(name, raising=False)


def _ids_by_part(run: Path) -> dict[Path, str | None]:
    return {p: layout.part_run_id(p) for p in sorted(run.rglob("*.parquet"))}


def _collector(run: Path, rank: int = 0, world: int = 1, **kw: object) -> Collector:
    cfg = CollectorConfig(run_dir=run, flush_interval_s=0.05, device=torch.device("cpu"), handle_sigterm=False,
                          **kw)  # type: ignore[arg-type]
    return Collector(cfg, rank=rank, world_size=world, coords={"pp": 0, "dp": rank, "tp": 0})


def _record(col: Collector, steps: int = 2) -> None:
    for step in range(steps):
        with col.step(step):
            with col.span("forward"):
                pass
            with col.comm("all_reduce", group="world", bytes=8):
                pass
        col.metric("loss", 1.0)


# ---------------------------------------------------------------------------------------- the id's sources
def test_the_launcher_s_id_comes_first_and_torchrun_s_default_is_no_id() -> None:
    assert job_run_id({RUN_ID_VAR: "job-7", ELASTIC_RUN_ID_VAR: "abc"}) == "job-7"
    assert job_run_id({ELASTIC_RUN_ID_VAR: "3f2c-uuid"}) == "3f2c-uuid"
    assert job_run_id({ELASTIC_RUN_ID_VAR: "none"}) is None  # torchrun's --rdzv-id default: every job has it
    assert job_run_id({RUN_ID_VAR: "  ", ELASTIC_RUN_ID_VAR: ""}) is None
    assert job_run_id({}) is None
    env = {ELASTIC_RUN_ID_VAR: "rdzv-1"}
    for rank in (0, 3):  # every rank alike, whatever rank 0's own meta says
        rid = resolve_run_id(rank=rank, world_size=4, run_dir="runs/x", own_id="mine", start_ns=1, environ=env)
        assert rid.get() == "rdzv-1"
    assert resolve_run_id(rank=0, world_size=4, run_dir="runs/x", own_id="mine", start_ns=1, environ={}).get() == "mine"
    assert resolve_run_id(rank=0, world_size=1, run_dir="runs/x", own_id=None, start_ns=5, environ={}).get() == "x-5"


def _write_run_json(run: Path, run_id: str, *, world: int = 2, start_ns: int | None = None) -> None:
    layout.write_run_meta(run, RunMeta(run_id=run_id, source="collector", world_size=world,
                                       start_ns=time.time_ns() if start_ns is None else start_ns))


@pytest.fixture
def looks_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank not knowing the id looks at run.json on every get() instead of at most every 0.2 s,
    so that a test sees the file it has just written without waiting out the interval."""
    from megascope.collectors import runid

    monkeypatch.setattr(runid, "_LOOK_EVERY_S", 0.0)


@pytest.mark.usefixtures("looks_every_time")
def test_a_rank_reads_rank_0_s_id_from_run_json_and_never_guesses(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    rid = resolve_run_id(rank=1, world_size=2, run_dir=run, own_id="ignored", start_ns=time.time_ns(), environ={})
    assert rid.get() is None  # no run.json yet: no id, never this rank's own
    seen: list[str] = []
    rid.on_known(seen.append)
    _write_run_json(run, "job-a", world=3)
    assert rid.get() is None  # another world size: not this job's
    _write_run_json(run, "job-a")
    assert rid.get() == "job-a" and seen == ["job-a"]
    _write_run_json(run, "job-b")
    assert rid.get() == "job-a"  # once known, it stays


@pytest.mark.usefixtures("looks_every_time")
def test_a_stale_run_json_is_left_for_rank_0_to_replace(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    old_ns = time.time_ns() - int(3 * FRESH_S * 1e9)
    _write_run_json(run, "last-week", start_ns=old_ns)
    os.utime(run / "run.json", ns=(old_ns, old_ns))
    rid = RunId.from_run_json(run, world_size=2, since_ns=time.time_ns())
    assert rid.get() is None
    _write_run_json(run, "this-job")  # rank 0 of this job, a moment later
    assert rid.get() == "this-job"
    # A run.json written moments before this rank started is rank 0's: taken at once.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    _write_run_json(fresh, "now")
    assert RunId.from_run_json(fresh, world_size=2, since_ns=time.time_ns()).get() == "now"


# ---------------------------------------------------------------------------------------- in one process
def test_every_part_of_two_ranks_carries_run_json_s_id(tmp_path: Path) -> None:
    """Rank 0 writes run.json as it starts; rank 1 reads the id from it; writer, marker agent and
    heartbeat sampler stamp every part with it, and the store reads every part."""
    run = tmp_path / "run"
    cols = [_collector(run, rank, 2, heartbeat_interval_s=0.05) for rank in (0, 1)]
    run_id = layout.read_run_json(run)["run_id"]
    assert [c.run_id for c in cols] == [run_id, run_id]
    for col in cols:
        _record(col)
    for col in cols:
        col.close()
    ids = _ids_by_part(run)
    tables = {p.relative_to(run).parts[0] for p in ids}
    assert {"spans", "markers", "metrics", "heartbeats", "ranks", "groups"} <= tables
    assert set(ids.values()) == {run_id}, {str(p.relative_to(run)): i for p, i in ids.items() if i != run_id}
    r = open_run(run)
    assert r.problems == []
    assert r.con.execute("SELECT count(DISTINCT rank) FROM spans").fetchone() == (2,)
    assert r.con.execute("SELECT count(*) FROM markers").fetchone() == (8,)


@pytest.mark.usefixtures("looks_every_time")
def test_a_rank_that_starts_before_rank_0_learns_the_id_and_tells_its_agent(tmp_path: Path) -> None:
    run = tmp_path / "run"
    late = _collector(run, 1, 2)  # rank 1 first: no run.json, its marker agent starts without an id
    assert late.run_id is None and late._agent is not None and late._agent.run_id is None
    first = _collector(run, 0, 2)
    run_id = first.run_id
    late.flush()  # the writer reads run.json and passes the id to the agent
    assert late.run_id == run_id and late._agent.run_id == run_id
    for col in (first, late):
        _record(col)
        col.close()
    ids = _ids_by_part(run)
    # Nothing stamped with another id; what rank 1 wrote before it knew carries none and is read.
    assert set(ids.values()) <= {run_id, None}
    markers = [i for p, i in ids.items() if p.relative_to(run).parts[:2] == ("markers", "rank=00001")]
    assert markers and set(markers) == {run_id}  # the agent's parts, after it was told
    r = open_run(run)
    assert r.problems == []
    assert r.con.execute("SELECT count(*) FROM markers WHERE rank = 1").fetchone() == (4,)


def test_a_collector_part_of_another_run_is_skipped_and_named(tmp_path: Path) -> None:
    runs = []
    for name in ("a", "b"):
        col = _collector(tmp_path / name / "job")  # the same directory name, two runs
        _record(col, steps=3 if name == "a" else 5)
        col.close()
        runs.append(tmp_path / name / "job")
    a, b = runs
    assert layout.read_run_json(a)["run_id"] != layout.read_run_json(b)["run_id"]
    before = open_run(a).con.execute("SELECT count(*) FROM spans").fetchone()
    copied = []
    for table in ("spans", "markers", "metrics"):
        for part in (b / table / "rank=00000").glob("*.parquet"):
            dest = a / table / "rank=00000" / ("copied-" + part.name)
            shutil.copy2(part, dest)
            copied.append(dest)
    assert copied
    r = open_run(a)
    assert r.con.execute("SELECT count(*) FROM spans").fetchone() == before
    assert r.con.execute("SELECT max(step) FROM metrics").fetchone() == (2,)
    for dest in copied:
        assert any(str(dest) in p and "another run" in p for p in r.problems), (dest, r.problems)


def test_a_run_whose_parts_carry_no_id_stays_readable(tmp_path: Path) -> None:
    """What collectors wrote before parts carried run ids."""
    run = tmp_path / "run"
    col = _collector(run, heartbeat_interval_s=0.05)
    _record(col)
    col.close()
    for part in run.rglob("*.parquet"):
        table = pq.read_table(part)
        pq.write_table(table.replace_schema_metadata(None), part)
        assert layout.part_run_id(part) is None
    r = open_run(run)
    assert r.problems == []
    assert r.con.execute("SELECT count(*) FROM spans WHERE name = 'forward'").fetchone() == (2,)
    assert r.con.execute("SELECT count(*) FROM markers").fetchone() == (4,)


# ---------------------------------------------------------------------------------------- the marker agent
def test_the_agent_s_control_messages_may_arrive_split_anywhere() -> None:
    control = Control()
    control.feed(b"fr")
    control.feed(b"job-f1")  # an "f" inside the id is no flush
    assert control.flushes == 1 and control.run_id is None
    control.feed(b"\nff")
    assert control.flushes == 3 and control.run_id == "job-f1"


def _agent_parts(run: Path) -> dict[Path, str | None]:
    return {p: i for p, i in _ids_by_part(run).items() if p.relative_to(run).parts[0] in ("markers", "heartbeats")}


def _start_agent(run: Path, ring: MarkerRing, run_id: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "megascope.collectors.agent", str(ring.path), str(run), "0",
                             socket.gethostname(), str(os.getpid()), "30.0", run_id], stdin=subprocess.PIPE)


def _flush(proc: subprocess.Popen[bytes], ring: MarkerRing, message: bytes, answers: int) -> None:
    assert proc.stdin is not None
    proc.stdin.write(message)
    proc.stdin.flush()
    wait_until(lambda: ring.counter(FLUSHES_AT) >= answers or proc.poll() is not None, timeout=30,
               message="the agent answered the flush")
    assert ring.counter(FLUSHES_AT) >= answers, f"the agent ended with {proc.returncode}"


def _end(proc: subprocess.Popen[bytes], ring: MarkerRing) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
    ring.close()


def _marker(ring: MarkerRing, seq: int) -> None:
    assert ring.put((0, "world", seq, "all_reduce", "enqueued", time.time_ns(), 0, 8, None))


def test_the_marker_agent_stamps_every_part_with_the_id_it_was_started_with(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    ring = MarkerRing.create(capacity=64, directory=str(tmp_path))
    _marker(ring, 0)
    proc = _start_agent(run, ring, "job-9")
    try:
        _flush(proc, ring, b"f", 1)
    finally:
        _end(proc, ring)
    parts = _agent_parts(run)
    assert {p.relative_to(run).parts[0] for p in parts} == {"markers", "heartbeats"}
    assert set(parts.values()) == {"job-9"}


def test_the_marker_agent_stamps_what_it_writes_after_it_is_told_the_id(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    ring = MarkerRing.create(capacity=64, directory=str(tmp_path))
    proc = _start_agent(run, ring, "")  # a rank that did not know the id yet
    try:
        _flush(proc, ring, b"rjob-", 0)
        time.sleep(0.1)
        _flush(proc, ring, b"9\nf", 1)
        _marker(ring, 0)
        _flush(proc, ring, b"f", 2)
    finally:
        _end(proc, ring)
    parts = _agent_parts(run)
    markers = [i for p, i in parts.items() if p.relative_to(run).parts[0] == "markers"]
    assert markers == ["job-9"]
    # Its first rank_alive row may have gone out before it was told: no id, never another one.
    assert set(parts.values()) <= {"job-9", None}
    last = max((p for p in parts if p.relative_to(run).parts[0] == "heartbeats"), key=lambda p: p.name)
    assert parts[last] == "job-9"


# ---------------------------------------------------------------------------------------- real jobs
def _all_stamped_and_read(run: Path) -> str:
    run_id = layout.read_run_json(run)["run_id"]
    ids = _ids_by_part(run)
    assert ids and set(ids.values()) == {run_id}, {str(p.relative_to(run)): i for p, i in ids.items() if i != run_id}
    tables = {p.relative_to(run).parts[0] for p in ids}
    assert {"spans", "markers", "metrics", "ranks", "groups"} <= tables
    assert open_run(run).problems == []
    return str(run_id)


@pytest.mark.dist
def test_the_bundled_trainer_s_ranks_stamp_the_launcher_s_id(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MEGASCOPE_HEARTBEAT_S": "0.2"}
    args = ["train", "--nproc", "2", "--dp", "2", "--steps", "3", "--layers", "2", "--hidden", "32", "--seq-len",
            "16", "--vocab", "64", "--global-batch", "4", "--micro-batches", "2", "--device", "cpu", "-o", str(out)]
    proc = subprocess.run([sys.executable, "-m", "megascope", *args], capture_output=True, text=True, env=env,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_id = _all_stamped_and_read(out)
    assert run_id.startswith("run-")
    assert any(p.parts[0] == "heartbeats" for p in (q.relative_to(out) for q in _ids_by_part(out)))
    r = open_run(out)
    assert r.con.execute("SELECT count(DISTINCT rank) FROM spans").fetchone() == (2,)
    assert r.con.execute("SELECT count(DISTINCT step) FROM spans WHERE kind = 'step'").fetchone() == (3,)


def _torchrun(nproc: int, script: Path, *args: str, cwd: Path, launcher: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGASCOPE_RUN_DIR"):
        env.pop(name, None)
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", *launcher, "--nproc-per-node", str(nproc),
                           str(script), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=240)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.dist
@pytest.mark.parametrize("launcher", ["standalone", "static"])
def test_a_torchrun_job_through_from_env_stamps_one_id(tmp_path: Path, launcher: str) -> None:
    """--standalone: torchrun's rendezvous id (a fresh uuid) names the run. A static rendezvous
    with a fixed port has the id "none": rank 0 names the run and the others read run.json."""
    run = tmp_path / "run"
    how = ["--standalone"] if launcher == "standalone" else ["--master-port", str(_free_port()), "--nnodes", "1"]
    proc = _torchrun(2, JOBS / "ddp_job.py", str(run), "--steps", "3", cwd=tmp_path, launcher=how)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((run / "run.json").read_text())
    run_id = meta["run_id"]
    if launcher == "standalone":
        _all_stamped_and_read(run)
        assert len(run_id) == 36  # torchrun's uuid
    else:
        assert run_id.startswith("run-")
        ids = _ids_by_part(run)
        # Rank 0 stamps from its first part; rank 1 from the moment it has read run.json (before
        # that, parts carry no id and are read as this run's). Never another id.
        assert set(ids.values()) <= {run_id, None}
        assert all(i == run_id for p, i in ids.items() if "rank=00000" in p.parts)
        assert any(i == run_id for p, i in ids.items() if "rank=00001" in p.parts)
        assert open_run(run).problems == []
    r = open_run(run)
    assert r.con.execute("SELECT count(DISTINCT rank) FROM spans").fetchone() == (2,)
