"""Every part carries its run's id: parts of another run copied into a run directory are skipped and
named, never read as this run's data."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import Synth
from ingest_fixtures import fr_dump, fr_entry, gpu_trace, write_pickle, write_trace
from safety import megascope

from megascope import layout, schema
from megascope.ingest import ingest_flight_recorder, ingest_kineto
from megascope.store import open_run


@pytest.fixture(scope="module")
def two_runs(synth: Synth, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("runs")
    return (synth(root / "planted", "straggler:rank=5,factor=1.5", ranks=8, steps=6, tp=2, pp=2, seed=1),
            synth(root / "other", "skew:rank=3,ms=400", ranks=8, steps=6, tp=2, pp=2, seed=1))


def _part_ids(run: Path) -> set[str | None]:
    ids = set()
    for part in run.rglob("*.parquet"):
        kv = pq.read_metadata(part).metadata or {}
        raw = kv.get(layout.RUN_ID_KEY)
        ids.add(raw.decode() if raw is not None else None)
    return ids


def test_synth_parts_carry_the_run_id_and_differ_by_faults(two_runs: tuple[Path, Path]) -> None:
    planted, other = two_runs
    a, b = open_run(planted).meta.run_id, open_run(other).meta.run_id
    assert a != b
    assert _part_ids(planted) == {a} and _part_ids(other) == {b}


def test_parts_of_another_run_are_skipped_and_named(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    planted, other = two_runs
    mixed = tmp_path / "mixed"
    shutil.copytree(planted, mixed)
    (spans_before,) = open_run(mixed).con.execute("SELECT count(*) FROM spans").fetchone() or (0,)
    foreign = []
    for table in ("spans", "markers"):
        for part in (other / table).glob("rank=*/*.parquet"):
            dest = mixed / table / part.parent.name / ("copied-" + part.name)
            shutil.copy2(part, dest)
            foreign.append(dest)
    run = open_run(mixed)
    (spans_after,) = run.con.execute("SELECT count(*) FROM spans").fetchone() or (0,)
    assert spans_after == spans_before
    for dest in foreign:
        assert any(str(dest) in p and "another run" in p for p in run.problems), (dest, run.problems)
    proc = megascope("report", mixed, "--json")
    assert proc.returncode == 0, proc.stderr
    import json

    report = json.loads(proc.stdout)
    assert [s["rank"] for s in report["stragglers"]][:1] == [5]
    assert not report["skew"]["drift"].get("drifting")
    assert proc.stderr.count("another run") == len(foreign)  # each named once


def test_a_refresh_checks_the_new_parts_and_names_another_runs(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    planted, other = two_runs
    live = tmp_path / "live"
    shutil.copytree(planted, live)
    run = open_run(live)
    (before,) = run.con.execute("SELECT count(*) FROM spans").fetchone() or (0,)
    own = pq.read_table(next((planted / "spans").glob("rank=*/*.parquet")))
    layout.write_part(live, "spans", own, rank=int(own.column("rank")[0].as_py()), run_id=run.meta.run_id)
    assert run.refresh() == []
    (grown,) = run.con.execute("SELECT count(*) FROM spans").fetchone() or (0,)
    assert grown == before + own.num_rows
    part = next((other / "spans").glob("rank=*/*.parquet"))
    dest = live / "spans" / part.parent.name / ("copied-" + part.name)
    shutil.copy2(part, dest)
    problems = run.refresh()
    assert any(str(dest) in p and "another run" in p for p in problems), problems
    assert run.con.execute("SELECT count(*) FROM spans").fetchone() == (grown,)


def test_write_part_without_a_run_id_still_works(tmp_path: Path) -> None:
    table = pa.Table.from_pylist([{"rank": 0, "step": 1, "name": "loss", "value": 2.0}], schema=schema.METRICS)
    path = layout.write_part(tmp_path, "metrics", table, rank=0)
    assert layout.RUN_ID_KEY not in (pq.read_metadata(path).metadata or {})
    path = layout.write_part(tmp_path, "metrics", table, rank=0, run_id="job-7")
    assert (pq.read_metadata(path).metadata or {})[layout.RUN_ID_KEY] == b"job-7"
    assert pq.read_table(path).to_pylist() == table.to_pylist()


def test_ingests_get_their_own_ids_on_every_part(tmp_path: Path) -> None:
    src = tmp_path / "traces"
    src.mkdir()
    for rank in range(2):
        write_trace(src / f"rank{rank}.json", gpu_trace(rank, 2))
    ingest_kineto(src, tmp_path / "a" / "run", workers=1)
    ingest_kineto(src, tmp_path / "b" / "run", workers=1)
    a, b = open_run(tmp_path / "a" / "run").meta.run_id, open_run(tmp_path / "b" / "run").meta.run_id
    assert a != b
    assert _part_ids(tmp_path / "a" / "run") == {a}
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    pgs = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}
    for rank in range(2):
        write_pickle(dumps / f"nccl_trace_rank_{rank}",
                     fr_dump([fr_entry(0, 1, created=10**18, completed=10**18 + 10**6)], pgs))
    ingest_flight_recorder(dumps, tmp_path / "fr")
    fr_id = open_run(tmp_path / "fr").meta.run_id
    assert _part_ids(tmp_path / "fr") == {fr_id}


def test_a_table_read_from_another_run_takes_the_writers_id(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    """Copying rows (not files) into a new run, as a replay does, stamps them with the new run's id."""
    planted, _ = two_runs
    part = sorted((planted / "spans" / "rank=00000").glob("*.parquet"))[0]
    table = pq.read_table(part)
    assert (table.schema.metadata or {}).get(layout.RUN_ID_KEY) is not None
    unstamped = layout.write_part(tmp_path / "a", "spans", table, rank=0)
    assert layout.part_run_id(unstamped) is None
    restamped = layout.write_part(tmp_path / "b", "spans", table, rank=0, run_id="new-run")
    assert layout.part_run_id(restamped) == "new-run"
    assert pq.read_table(restamped).num_rows == table.num_rows
