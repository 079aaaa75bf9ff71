"""Following a live run's step sums (megascope.live): each new twin read once, the same step times
as the full analysis, rows of a step split over parts combined, foreign and damaged twins named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from megascope import analysis, layout
from megascope.live import StepSumsTail
from megascope.store import open_run
from megascope.synth import LiveSynth, SynthConfig


def _job(tmp_path: Path, steps: int = 1000) -> LiveSynth:
    return LiveSynth(tmp_path / "run", SynthConfig(ranks=16, steps=steps, tp=2, pp=2, seed=5), threads=1)


def test_each_new_twin_is_read_once_and_step_times_match_the_analysis(tmp_path: Path) -> None:
    job = _job(tmp_path)
    tail = StepSumsTail(job.out)
    assert tail.update().files_read == 0  # nothing written yet
    for _ in range(3):
        job.write_step()
        update = tail.update()
        assert update.files_read == 16  # one twin per rank, this step's only
        assert update.steps == [job.step - 1]
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


def test_a_step_split_over_two_parts_combines(tmp_path: Path) -> None:
    job = _job(tmp_path)
    job.write_step()
    job.close()
    whole = StepSumsTail(job.out)
    whole.update()
    # The same spans again, as a second run cut into two parts per rank (a step across a flush).
    split = tmp_path / "split"
    layout.write_run_meta(split, open_run(job.out).meta)
    tail = StepSumsTail(split)
    for spans_file in sorted(job.out.glob("spans/rank=*/*.parquet")):
        table = pq.read_table(spans_file)
        rank = int(spans_file.parent.name[5:])
        half = table.num_rows // 2
        layout.write_spans_part(split, table.slice(0, half), rank=rank)
        tail.update()
        layout.write_spans_part(split, table.slice(half), rank=rank)
    tail.update()
    for column in ("step_ns", "first_start_ns", "last_end_ns", "compute_ns", "comm_ns", "spans"):
        assert tail.rank_step()[column].tolist() == whole.rank_step()[column].tolist(), column


def test_only_the_newest_steps_are_kept_and_a_late_join_reads_the_newest_parts(tmp_path: Path) -> None:
    job = _job(tmp_path)
    for _ in range(5):
        job.write_step()
    job.close()
    tail = StepSumsTail(job.out, window_steps=2, backfill=3)
    assert tail.update().files_read == 3 * 16  # each rank's three newest parts
    assert tail.steps() == [3, 4]  # of which the two newest steps are kept
    assert tail.per_step()["step"].tolist() == [3, 4]


def test_foreign_and_damaged_twins_are_skipped_and_named(tmp_path: Path) -> None:
    job = _job(tmp_path)
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


def test_a_part_of_several_steps_is_read_once(tmp_path: Path) -> None:
    job = _job(tmp_path)
    tail = StepSumsTail(job.out)
    job.write_step(3)  # a writer flushing every three steps
    update = tail.update()
    assert update.files_read == 16 and update.steps == [0, 1, 2]
    job.close()
    expected = analysis.mfu(open_run(job.out))
    assert tail.per_step()["step_time_ns"].tolist() == expected["step_time_ns"].astype("int64").tolist()


def test_a_reader_behind_the_job_skips_to_the_newest_parts(tmp_path: Path) -> None:
    job = _job(tmp_path)
    tail = StepSumsTail(job.out, most_new=1)
    job.write_step()
    assert tail.update().files_read == 16
    for _ in range(3):  # three flushes while the reader was busy
        job.write_step()
    update = tail.update()
    assert (update.files_read, update.files_skipped, update.steps) == (16, 32, [3])
    assert tail.steps() == [0, 3]
    job.close()
