"""Following a live run's step sums (megascope.live): through the writers' step logs or their twins,
each new record or twin read once, the same step times as the full analysis, rows of a step split
over parts combined, foreign and damaged files named."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from megascope import analysis, layout, steplog
from megascope.live import StepSumsTail
from megascope.schema import RunMeta
from megascope.steplog import StepLog
from megascope.stepsums import step_sums
from megascope.store import open_run
from megascope.synth import LiveSynth, SynthConfig

SOURCES = pytest.mark.parametrize("source", ["log", "twins"])


def _job(tmp_path: Path, steps: int = 1000, source: str = "log") -> LiveSynth:
    return LiveSynth(tmp_path / "run", SynthConfig(ranks=16, steps=steps, tp=2, pp=2, seed=5), threads=1,
                     step_logs=source == "log")


@SOURCES
def test_each_new_twin_is_read_once_and_step_times_match_the_analysis(tmp_path: Path, source: str) -> None:
    job = _job(tmp_path, source=source)
    tail = StepSumsTail(job.out)
    assert tail.update().files_read == 0  # nothing written yet
    assert tail.source == "auto"
    for _ in range(3):
        job.write_step()
        update = tail.update()
        assert update.files_read == 16  # one log or twin per rank, this step's only
        assert update.steps == [job.step - 1]
        assert tail.source == source
    # Nothing new: the partitions are listed (they changed within the clock's tick) but none read.
    assert tail.update().files_read == 0
    job.close()
    expected = analysis.mfu(open_run(job.out))
    got = tail.per_step()
    assert got["step"].tolist() == expected["step"].tolist() == [0, 1, 2]
    assert got["step_time_ns"].tolist() == expected["step_time_ns"].astype("int64").tolist()
    assert np.allclose(got["mfu"], expected["mfu"])
    assert got["ranks"].tolist() == [16, 16, 16]
    frame = tail.rank_step()
    assert len(frame) == 16 * 3 and frame["compute_ns"].gt(0).all() and frame["comm_ns"].gt(0).all()


@SOURCES
def test_a_step_split_over_two_parts_combines(tmp_path: Path, source: str) -> None:
    job = _job(tmp_path, source="twins")
    job.write_step()
    job.close()
    whole = StepSumsTail(job.out)
    whole.update()
    # The same spans again, as a second run cut into two parts per rank (a step across a flush).
    split = tmp_path / "split"
    meta = open_run(job.out).meta
    layout.write_run_meta(split, meta)
    tail = StepSumsTail(split)
    for spans_file in sorted(job.out.glob("spans/rank=*/*.parquet")):
        table = pq.read_table(spans_file)
        rank = int(spans_file.parent.name[5:])
        half = table.num_rows // 2
        for i, part in enumerate((table.slice(0, half), table.slice(half))):
            if source == "log":
                log = StepLog(split, rank=rank)
                log.append(step_sums(part), run_id=meta.run_id)
                log.close()
            layout.write_spans_part(split, part, rank=rank)
            if i == 0:
                tail.update()
    tail.update()
    assert tail.source == source
    for column in ("step_ns", "first_start_ns", "last_end_ns", "compute_ns", "comm_ns", "spans"):
        assert tail.rank_step()[column].tolist() == whole.rank_step()[column].tolist(), column


@SOURCES
def test_only_the_newest_steps_are_kept_and_a_late_join_reads_the_newest_parts(tmp_path: Path, source: str) -> None:
    job = _job(tmp_path, source=source)
    for _ in range(5):
        job.write_step()
    job.close()
    tail = StepSumsTail(job.out, window_steps=2, backfill=3)
    update = tail.update()
    # Each rank's three newest parts, or its log's three newest records (a step each).
    assert (update.files_read, update.rows) == ((16, 3 * 16) if source == "log" else (3 * 16, 3 * 16))
    assert tail.steps() == [3, 4]  # of which the two newest steps are kept
    assert tail.per_step()["step"].tolist() == [3, 4]


def test_foreign_and_damaged_twins_are_skipped_and_named(tmp_path: Path) -> None:
    job = _job(tmp_path, source="twins")
    tail = StepSumsTail(job.out)
    job.write_step()
    job.close()
    sums = sorted(job.out.glob("step_sums/rank=*/*.parquet"))
    foreign = sums[0].with_name("part-9000000000000000000-1-000001.parquet")
    other = pq.read_table(sums[0])
    pq.write_table(other.replace_schema_metadata({layout.RUN_ID_KEY: b"another-run"}), foreign)
    damaged = sums[1].with_name("part-9000000000000000000-1-000002.parquet")
    damaged.write_bytes(b"PAR1 not really")
    update = tail.update()
    assert update.files_read == 18
    assert tail.per_step()["ranks"].tolist() == [16]
    assert len(tail.rank_step()) == 16
    assert any(str(foreign) in p and "another run" in p for p in tail.problems)
    assert any(str(damaged) in p for p in tail.problems)


def test_a_run_without_step_sums_yet_and_a_bad_window(tmp_path: Path) -> None:
    job = _job(tmp_path)
    job.close()
    tail = StepSumsTail(job.out)
    assert tail.update().files_read == 0
    assert tail.per_step().empty and tail.rank_step().empty
    with pytest.raises(ValueError, match="window_steps"):
        StepSumsTail(job.out, window_steps=0)
    with pytest.raises(ValueError, match="backfill"):
        StepSumsTail(job.out, backfill=0)
    with pytest.raises(ValueError, match="most_new"):
        StepSumsTail(job.out, most_new=0)
    with pytest.raises(ValueError, match="source"):
        StepSumsTail(job.out, source="both")


def test_the_live_job_writes_what_synth_writes(tmp_path: Path) -> None:
    job = _job(tmp_path, steps=2)
    # spans, twins, markers; metrics from TP rank 0 of the last stage in each of the 4 DP replicas
    assert job.write_step() == 16 * 3 + 4
    job.write_step()
    with pytest.raises(Exception, match="has ended"):
        job.write_step()
    job.close()
    run = open_run(job.out)
    assert run.problems == []
    assert run.con.execute("SELECT count(DISTINCT step), count(DISTINCT rank) FROM spans").fetchall() == [(2, 16)]
    assert run.con.execute("SELECT count(DISTINCT step) FROM metrics").fetchall() == [(2,)]


@SOURCES
def test_a_part_of_several_steps_is_read_once(tmp_path: Path, source: str) -> None:
    job = _job(tmp_path, source=source)
    tail = StepSumsTail(job.out)
    job.write_step(3)  # a writer flushing every three steps
    update = tail.update()
    assert update.files_read == 16 and update.steps == [0, 1, 2]
    job.close()
    expected = analysis.mfu(open_run(job.out))
    assert tail.per_step()["step_time_ns"].tolist() == expected["step_time_ns"].astype("int64").tolist()


def test_a_reader_behind_the_job_skips_to_the_newest_parts(tmp_path: Path) -> None:
    job = _job(tmp_path, source="twins")
    tail = StepSumsTail(job.out, most_new=1)
    job.write_step()
    assert tail.update().files_read == 16
    for _ in range(3):  # three flushes while the reader was busy
        job.write_step()
    update = tail.update()
    assert (update.files_read, update.files_skipped, update.steps) == (16, 32, [3])
    assert tail.steps() == [0, 3]
    job.close()


def test_a_reader_behind_the_log_skips_to_its_newest_records(tmp_path: Path) -> None:
    job = _job(tmp_path)
    tail = StepSumsTail(job.out, window_steps=1)  # reads at most 4 records a log an update
    job.write_step()
    assert tail.update().steps == [0]
    for _ in range(6):  # six steps while the reader was busy
        job.write_step()
    update = tail.update()
    assert (update.files_read, update.files_skipped, update.steps) == (16, 16, [3, 4, 5, 6])
    assert tail.steps() == [6]
    job.close()


def test_a_log_is_read_in_whole_records_and_a_strange_one_is_named(tmp_path: Path) -> None:
    job = _job(tmp_path)
    tail = StepSumsTail(job.out)
    job.write_step()
    where = steplog.log_dir(job.out, job.run_id)
    logs = sorted(where.glob("*.steps"))
    assert len(logs) == 16 and tail.update().rows == 16
    # A record half written: not read until it is whole.
    record = logs[0].read_bytes()[steplog.HEADER_SIZE:]
    assert len(record) == steplog.RECORD_SIZE
    with logs[0].open("ab") as f:
        f.write(record[:50])
    assert tail.update().rows == 0
    with logs[0].open("ab") as f:
        f.write(record[50:])
    assert tail.update().rows == 1
    # A file that is not a step log of this layout, and another run's logs: skipped.
    (where / "rank=99.steps").write_bytes(b"PAR1" + bytes(60))
    (where / "rank=98.steps").write_bytes(steplog.MAGIC + bytes(8))
    other = steplog.log_dir(job.out, "another-run")
    other.mkdir()
    (other / "rank=0.steps").write_bytes(logs[1].read_bytes())
    job.write_step()
    assert tail.update().rows == 16
    assert tail.per_step()["ranks"].tolist() == [16, 16]
    assert any("rank=99.steps" in p and "not a megascope step log" in p for p in tail.problems)
    assert any("rank=98.steps" in p and "another layout" in p for p in tail.problems)
    job.close()
    expected = analysis.mfu(open_run(job.out))
    # Step 0 of rank 0 was read twice (the record appended again): its max step time is unchanged.
    assert tail.per_step()["step_time_ns"].tolist() == expected["step_time_ns"].astype("int64").tolist()


def test_the_step_log_writer_starts_a_log_per_run_id_and_stops_on_a_foreign_file(tmp_path: Path) -> None:
    job = _job(tmp_path, steps=3, source="twins")
    job.write_step()
    part = pq.read_table(sorted(job.out.glob("spans/rank=00003/*.parquet"))[0])
    sums = step_sums(part)
    log = StepLog(tmp_path / "w", rank=3)
    log.append(sums, run_id=None)  # the id not known yet: nothing
    assert not (tmp_path / "w" / steplog.STEP_LOG_DIR).exists()
    log.append(sums, run_id="job/1")  # not a file name: a digest
    log.append(sums, run_id="job-2")
    log.close()
    dirs = sorted(p.name for p in (tmp_path / "w" / steplog.STEP_LOG_DIR).iterdir())
    assert dirs[0] == "id-" + hashlib.sha256(b"job/1").hexdigest()[:24] and dirs[1] == "job-2"
    data = (tmp_path / "w" / steplog.STEP_LOG_DIR / "job-2" / "rank=00003.steps").read_bytes()
    assert data[:steplog.HEADER_SIZE] == steplog.HEADER
    records = steplog.parse(data[steplog.HEADER_SIZE:])
    assert records[:, 0].tolist() == [3] and records[:, 1].tolist() == [0]
    assert records[0, steplog.FIELDS.index("spans")] == part.num_rows
    # A file of something else where the log would go: the log stops, the rest goes on.
    bad = steplog.log_dir(tmp_path / "x", "job-3")
    bad.mkdir(parents=True)
    (bad / "rank=00003.steps").write_bytes(b"not a log at all")
    log = StepLog(tmp_path / "x", rank=3)
    log.append(sums, run_id="job-3")
    assert log.stopped is not None and "not a step log" in log.stopped
    assert (bad / "rank=00003.steps").read_bytes() == b"not a log at all"
    job.close()


def test_the_collector_writes_the_step_log_the_reader_follows(tmp_path: Path) -> None:
    import torch
    from megascope.collectors import Collector, CollectorConfig

    run = tmp_path / "run"
    cfg = CollectorConfig(run_dir=run, flush_interval_s=0.05, device=torch.device("cpu"), handle_sigterm=False,
                          marker_agent=False)
    col = Collector(cfg, rank=0, world_size=1, coords={"pp": 0, "dp": 0, "tp": 0},
                    meta=RunMeta(run_id="live-1", source="collector", world_size=1))
    tail = StepSumsTail(run)
    for step in range(4):
        with col.step(step), col.span("forward", kind="forward"):
            torch.ones(64, 64) @ torch.ones(64, 64)
        col.flush()
        assert tail.update().steps == [step]
    col.close()
    assert tail.source == "log"
    assert (run / steplog.STEP_LOG_DIR / "live-1" / "rank=00000.steps").exists()
    expected = analysis.mfu(open_run(run))
    assert tail.per_step()["step_time_ns"].tolist() == expected["step_time_ns"].astype("int64").tolist()
    assert tail.rank_step()["compute_ns"].gt(0).all()


def test_the_live_heat_map_finds_a_slow_rank_among_its_stage_peers(tmp_path: Path) -> None:
    from megascope.inject import parse_injects
    from megascope.live import heat_cells

    cfg = SynthConfig(ranks=16, steps=1000, tp=2, pp=2, seed=11, faults=parse_injects(["straggler:rank=13,factor=1.4"]))
    job = LiveSynth(tmp_path / "run", cfg, threads=1)
    tail = StepSumsTail(job.out)
    for _ in range(6):
        job.write_step()
    tail.update()
    job.close()
    places = open_run(job.out).con.execute("SELECT rank, host, coords FROM ranks ORDER BY rank").df()
    cells = heat_cells(tail.rank_step(), places, phase="compute")
    assert len(cells) == 16 * 6 and set(cells["step"]) == set(range(6))
    worst = cells.groupby("rank")["norm"].median()
    assert worst.idxmax() == 13 and worst[13] > 1.25 and worst.drop(13).max() < 1.1, worst.round(3).to_dict()
    assert cells.loc[cells["rank"] == 13, "pp"].unique().tolist() == [1]  # its stage, from its coordinates
    # Binned: each cell is its bin's worst rank-step; every rank and step still covered once.
    binned = heat_cells(tail.rank_step(), places, phase="compute", max_ranks=4, max_steps=2)
    assert (binned["rank_bin"].nunique(), binned["step_bin"].nunique()) == (4, 2)
    assert binned["rank_lo"].tolist()[::2] == [0, 4, 8, 12] and binned["step_hi"].max() == 5
    assert binned.loc[binned["rank_lo"] == 12, "rank"].unique().tolist() == [13]
    # Communication, binned: the slow rank waits least, its peers wait for it; its bin shows it.
    comm = heat_cells(tail.rank_step(), places, phase="comm", max_ranks=4)
    assert comm.loc[comm["rank_lo"] == 12, "rank"].unique().tolist() == [13]
    assert comm.loc[comm["rank_lo"] == 12, "norm"].max() < 0.95
    with pytest.raises(ValueError, match="own"):
        heat_cells(tail.rank_step(), places, phase="own")


def test_the_collector_writes_its_step_log_without_numpy(tmp_path: Path) -> None:
    """The collector's core install (torch, pyarrow, click) has no numpy: the writer's side of the
    step log needs none."""
    code = textwrap.dedent("""
        import sys
        for name in ("numpy", "pandas", "duckdb"):
            sys.modules[name] = None
        from pathlib import Path
        from megascope.steplog import StepLog, log_dir
        import pyarrow as pa
        from megascope.schema import STEP_SUMS
        row = {name: None for name in STEP_SUMS.names}
        row.update(rank=2, step=7, group=None, step_ns=5, spans=3, forward_ns=4)
        log = StepLog(Path(sys.argv[1]), rank=2)
        log.append(pa.Table.from_pylist([row, {**row, "group": "tp:0", "spans": 2}], schema=STEP_SUMS), run_id="r")
        log.close()
        assert log.stopped is None, log.stopped
        print((log_dir(Path(sys.argv[1]), "r") / "rank=00002.steps").stat().st_size)
    """)
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout) == steplog.HEADER_SIZE + steplog.RECORD_SIZE
    records = steplog.parse((steplog.log_dir(tmp_path, "r") / "rank=00002.steps").read_bytes()[steplog.HEADER_SIZE:])
    fields = dict(zip(steplog.FIELDS, records[0].tolist(), strict=True))
    assert (fields["rank"], fields["step"], fields["spans"], fields["step_ns"], fields["forward_ns"]) == (2, 7, 5, 5, 8)
    assert fields["backward_ns"] == steplog.NULL


def test_a_step_log_that_fails_costs_the_collector_no_twin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    import torch
    from megascope.collectors import Collector, CollectorConfig

    def broken(self: StepLog, sums: object, *, run_id: str | None) -> None:
        raise ValueError("no log today")

    monkeypatch.setattr(StepLog, "append", broken)
    run = tmp_path / "run"
    cfg = CollectorConfig(run_dir=run, flush_interval_s=0.05, device=torch.device("cpu"), handle_sigterm=False,
                          marker_agent=False)
    col = Collector(cfg, rank=0, world_size=1, coords={"pp": 0, "dp": 0, "tp": 0},
                    meta=RunMeta(run_id="live-2", source="collector", world_size=1))
    with col.step(0), col.span("forward", kind="forward"):
        torch.ones(8, 8) @ torch.ones(8, 8)
    col.flush()
    stats = col.stats
    col.close()
    assert stats["write_errors"] >= 1
    assert any("cannot write step_log" in r.message and "not retried" in r.message for r in caplog.records)
    spans = sorted(run.glob("spans/rank=*/*.parquet"))
    assert spans and all(layout.sums_twin(p).is_file() for p in spans)
