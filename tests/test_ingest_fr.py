"""Flight-recorder ingest: dumps -> markers/spans/groups, silent ranks, --mesh, and hostile or bad files."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result
from ingest_fixtures import SHARED_DATA, fr_dump, fr_entry, write_pickle

from megascope.errors import IngestError
from megascope.ingest import ingest_flight_recorder, load_dump
from megascope.store import open_run

T0 = 1_795_000_000_000_000_000


def _hung_job(src: Path, *, world: int = 4, hung: int = 2, silent: int | None = None,
              pg_config: dict | None = None) -> None:
    """Every rank runs all-reduces 1..5; ``hung`` never enqueues 5, so its peers wait in 5."""
    src.mkdir()
    pgs = pg_config or {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(world)))}}
    for rank in range(world):
        if rank == silent:
            continue
        entries = []
        last = 4 if rank == hung else 5
        for seq in range(1, last + 1):
            created = T0 + seq * 10_000_000 + rank * 1000
            done = created + 2_000_000 if seq < 5 else None
            entries.append(fr_entry(seq - 1, seq, created=created, completed=done))
        write_pickle(src / f"nccl_trace_rank_{rank}", fr_dump(entries, pgs))


def test_markers_follow_the_dumps(tmp_path: Path) -> None:
    _hung_job(tmp_path / "dumps")
    result = ingest_flight_recorder(tmp_path / "dumps", tmp_path / "run")
    assert result.world_size == 4 and result.missing_ranks == []
    run = open_run(tmp_path / "run")
    con = run.con
    last = dict(con.execute("SELECT rank, max(seq) FROM markers WHERE state = 'enqueued' GROUP BY rank").fetchall())
    assert last == {0: 5, 1: 5, 2: 4, 3: 5}
    done = dict(con.execute("SELECT rank, max(seq) FROM markers WHERE state = 'completed' GROUP BY rank").fetchall())
    assert done == {0: 4, 1: 4, 2: 4, 3: 4}
    # enqueue times are the dumps' time_created_ns
    t = con.execute("SELECT time_ns FROM markers WHERE rank = 3 AND seq = 2 AND state = 'enqueued'").fetchone()
    assert t == (T0 + 2 * 10_000_000 + 3000,)
    # durations exist for completed entries: spans end at discovery, last 0.5 ms
    spans = con.execute("SELECT count(*), min(dur_ns), max(dur_ns) FROM spans").fetchone()
    assert spans == (16, 500_000, 500_000)
    assert con.execute("SELECT DISTINCT \"group\", op, bytes FROM markers").fetchall() == [("world", "all_reduce", 1024)]
    assert run.meta.source == "flight-recorder"


def test_silent_rank_is_recorded_as_missing(tmp_path: Path) -> None:
    _hung_job(tmp_path / "dumps", silent=1, hung=-1)
    result = ingest_flight_recorder(tmp_path / "dumps", tmp_path / "run")
    assert result.missing_ranks == [1]
    run = open_run(tmp_path / "run")
    assert run.meta.config["ingest"]["missing_ranks"] == [1]
    assert run.meta.config["ingest"]["expected_world_size"] == 4
    assert run.con.execute("SELECT rank FROM ranks ORDER BY rank").fetchall() == [(0,), (1,), (2,), (3,)]
    assert any("wrote no spans or markers: 1" in p for p in run.problems)


def test_mesh_option_maps_unnamed_groups(tmp_path: Path) -> None:
    pgs = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
           "1": {"name": "1", "desc": "undefined", "ranks": "[0, 1]"},
           "2": {"name": "2", "desc": "undefined", "ranks": "[2, 3]"}}
    src = tmp_path / "dumps"
    src.mkdir()
    for rank in range(4):
        pg = ("1", "undefined") if rank < 2 else ("2", "undefined")
        entries = [fr_entry(0, 1, pg=pg, created=T0 + rank, completed=T0 + 5_000_000)]
        write_pickle(src / f"fr_{rank}", fr_dump(entries, pgs))
    ingest_flight_recorder(src, tmp_path / "run", mesh={"tp": 2, "dp": 2})
    run = open_run(tmp_path / "run")
    con = run.con
    assert con.execute("SELECT rank, \"group\" FROM markers WHERE state = 'enqueued' ORDER BY rank").fetchall() == [
        (0, "tp:0"), (1, "tp:0"), (2, "tp:1"), (3, "tp:1")]
    assert con.execute("SELECT rank, coords['tp'], coords['dp'] FROM ranks ORDER BY rank").fetchall() == [
        (0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    # the dp groups come from the mesh even though no dump named them
    assert ("dp:0", [0, 2]) in con.execute("SELECT DISTINCT \"group\", members FROM groups").fetchall()


def test_json_dumps_and_gloo_dumps_without_times(tmp_path: Path) -> None:
    src = tmp_path / "dumps"
    src.mkdir()
    pgs = {"": {"name": "", "desc": "", "ranks": "[]"}}  # gloo leaves pg_config empty
    for rank in range(2):
        entries = [fr_entry(i, i + 1, created=T0 + i * 1000, completed=None) for i in range(3)]
        for e in entries[:2]:
            e["retired"] = True
        dump = fr_dump(entries, pgs)
        (src / f"fr_{rank}.json").write_text(json.dumps(dump))
    ingest_flight_recorder(src, tmp_path / "run", world_size=2)
    run = open_run(tmp_path / "run")
    states = run.con.execute("SELECT state, count(*) FROM markers GROUP BY state ORDER BY state").fetchall()
    assert states == [("completed", 4), ("enqueued", 6)]
    assert run.meta.config["ingest"]["completion_times_approximate"] is True
    assert run.con.execute("SELECT count(*) FROM spans").fetchone() == (0,)


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch pwned",))


def test_hostile_pickle_is_refused_and_never_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "nccl_trace_rank_0"
    path.write_bytes(pickle.dumps({"entries": [], "x": _Evil()}))
    with pytest.raises(IngestError, match="refusing to load"):
        load_dump(path)
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (pickle.dumps([1, 2, 3]), "not a flight-recorder dump"),
        (pickle.dumps({"entries": [], "version": "2.10"})[:-5], "truncated or not a dump"),
        (b"", "empty file"),
        (b"{not json", "malformed JSON"),
    ],
)
def test_bad_dumps_fail_cleanly(tmp_path: Path, content: bytes, message: str, cli: Callable[..., Result]) -> None:
    src = tmp_path / "dumps"
    src.mkdir()
    (src / "fr_0").write_bytes(content)
    out = tmp_path / "run"
    with pytest.raises(IngestError, match=message):
        ingest_flight_recorder(src, out)
    assert not out.exists()
    result = cli("ingest", "flight-recorder", str(src), "-o", str(out))
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_mixed_jobs_are_refused(tmp_path: Path) -> None:
    src = tmp_path / "dumps"
    src.mkdir()
    write_pickle(src / "fr_0", fr_dump([], {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}))
    write_pickle(src / "fr_1", fr_dump([], {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"}}))
    with pytest.raises(IngestError, match="mixed jobs"):
        ingest_flight_recorder(src, tmp_path / "run")
    write_pickle(src / "other_0", fr_dump([], {}))
    with pytest.raises(IngestError, match="different prefixes"):
        ingest_flight_recorder(src, tmp_path / "run")


@pytest.mark.skipif(not (SHARED_DATA / "flight-recorder-hang-2rank").is_dir(), reason="shared sample dumps not present")
def test_real_nccl_hang_dumps(tmp_path: Path) -> None:
    src = SHARED_DATA / "flight-recorder-hang-2rank"
    ingest_flight_recorder(src, tmp_path / "run")
    run = open_run(tmp_path / "run")
    con = run.con
    for rank in (0, 1):
        dump = load_dump(src / f"nccl_trace_rank_{rank}")
        seqs = [e["collective_seq_id"] for e in dump["entries"]]
        got = con.execute("SELECT count(*), max(seq) FROM markers WHERE rank = ? AND state = 'enqueued'", [rank]).fetchone()
        assert got == (len(seqs), max(seqs))
    # The rank whose trail stops first is the one its peer waits for: the first seq not every rank entered.
    first_gap = con.execute("""
        SELECT min(seq) FROM (SELECT seq FROM markers WHERE state = 'enqueued' GROUP BY seq HAVING count(DISTINCT rank) < 2)
    """).fetchone()[0]
    absent = con.execute(f"""SELECT rank FROM ranks WHERE rank NOT IN (
        SELECT rank FROM markers WHERE state = 'enqueued' AND seq = {first_gap})""").fetchall()
    assert absent == [(1,)]
    waiting = con.execute(f"SELECT rank, state FROM markers WHERE seq = {first_gap} ORDER BY state").fetchall()
    assert waiting == [(0, "enqueued"), (0, "started")]
    assert run.meta.config["ingest"]["timed"] is True


@pytest.mark.skipif(not (SHARED_DATA / "flight-recorder-hang-2rank").is_dir(), reason="shared sample dumps not present")
def test_localize_names_the_rank_that_never_entered(tmp_path: Path) -> None:
    """End to end: the README's planted hang (rank 1 stops after collective 542)."""
    analysis = pytest.importorskip("megascope.analysis")
    if not hasattr(analysis, "localize"):
        pytest.skip("analysis.localize not available")
    ingest_flight_recorder(SHARED_DATA / "flight-recorder-hang-2rank", tmp_path / "run")
    verdict = analysis.localize(open_run(tmp_path / "run"))
    assert verdict["hung"]
    top = verdict["suspects"][0]
    assert (top["rank"], top["last_completed_seq"], top["missing_seq"]) == (1, 542, 543)


def test_localize_ranks_a_silent_rank_first(tmp_path: Path) -> None:
    analysis = pytest.importorskip("megascope.analysis")
    if not hasattr(analysis, "localize"):
        pytest.skip("analysis.localize not available")
    _hung_job(tmp_path / "dumps", silent=3, hung=-1)
    ingest_flight_recorder(tmp_path / "dumps", tmp_path / "run")
    verdict = analysis.localize(open_run(tmp_path / "run"))
    assert verdict["hung"] and verdict["suspects"][0]["rank"] == 3
