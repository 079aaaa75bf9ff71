"""``megascope compact``: every row exactly once, before, during and after; killed at any point; beside a writer."""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest
from conftest import Synth, wait_until
from safety import assert_one_line_error, megascope

from megascope import compact as compaction
from megascope import layout
from megascope.compact import compact
from megascope.remote import PositionalFile, positional
from megascope.schema import RANKS, SPANS
from megascope.store import open_run

# Per table: rows and a sum over a column every row has, so a row lost or read twice shows.
_FINGERPRINT = """
SELECT (SELECT count(*) FROM spans), (SELECT sum(dur_ns) FROM spans), (SELECT sum(start_ns % 1000003) FROM spans),
       (SELECT count(*) FROM markers), (SELECT sum(time_ns % 1000003) FROM markers),
       (SELECT count(*) FROM metrics), (SELECT sum(value) FROM metrics),
       (SELECT count(*) FROM ranks), (SELECT sum(rank) FROM ranks),
       (SELECT count(*) FROM groups), (SELECT sum(len(members)) FROM groups),
       -- The spans as the analysis' sums see them: the step_sums of the spans files that have
       -- them and the spans of those that do not, never both, never neither.
       (SELECT coalesce(sum(spans), 0) FROM step_sums) + (SELECT count(step) FROM spans_unsummed),
       (SELECT coalesce(sum(coll_ns), 0) + coalesce(sum(forward_ns), 0) FROM step_sums)
         + (SELECT coalesce(sum(dur_ns) FILTER (WHERE step IS NOT NULL AND kind IN ('collective', 'forward')), 0)
            FROM spans_unsummed)
"""


def _fingerprint(path: Path) -> tuple[object, ...]:
    run = open_run(path)
    try:
        (row,) = run.con.execute(_FINGERPRINT).fetchall()
        return tuple(round(v, 6) if isinstance(v, float) else v for v in row)
    finally:
        run.con.close()


def _parts(path: Path) -> list[Path]:
    return sorted(p for t in ("spans", "markers", "metrics", "ranks", "groups")
                  for p in path.glob(layout.table_glob(t)))


def _age(path: Path, seconds: float = 3600) -> None:
    """Make every part look ``seconds`` old."""
    then = time.time() - seconds
    for p in _parts(path):
        os.utime(p, (then, then))


@pytest.fixture(scope="module")
def source_run(synth: Synth, tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Small chunks: several parts per rank, as a live job's flushes leave them.
    return synth(tmp_path_factory.mktemp("compact") / "src", ranks=16, steps=8, tp=2, pp=2, seed=3, gpus_per_host=4,
                 chunk_rows=1500)


@pytest.fixture
def run(source_run: Path, tmp_path: Path) -> Path:
    path = tmp_path / "run"
    shutil.copytree(source_run, path)
    _age(path)
    return path


@pytest.fixture(scope="module")
def expected(source_run: Path) -> tuple[object, ...]:
    return _fingerprint(source_run)


def test_compaction_keeps_every_row_once_and_leaves_few_files(run: Path, expected: tuple[object, ...]) -> None:
    before = len(_parts(run))
    assert before > 5 * 16  # several parts per rank and table
    result = compact(run, everything=True)
    assert result.parts_merged == before
    assert _parts(run) == []
    tables = [p for p in (run / "compacted").glob("*/*.parquet") if p.parent.name != layout.STEP_SUMS_DIR]
    assert len(tables) == result.files_written <= 7
    # Each compacted spans file has its sums, and no other sums are left.
    spans = sorted(p for p in tables if p.parent.name == "spans")
    assert sorted((run / "compacted" / layout.STEP_SUMS_DIR).glob("*.parquet")) == [layout.sums_twin(p) for p in spans]
    assert list(run.glob(layout.sums_glob())) == []
    assert _fingerprint(run) == expected
    reopened = open_run(run)
    assert reopened.problems == []
    assert reopened.ranks_written() == set(range(16))


def test_compaction_is_idempotent(run: Path, expected: tuple[object, ...]) -> None:
    compact(run, everything=True)
    files = sorted((run / "compacted").rglob("*"))
    again = compact(run, everything=True)
    assert (again.parts_merged, again.files_written, again.removed) == (0, 0, 0)
    assert sorted((run / "compacted").rglob("*")) == files
    assert _fingerprint(run) == expected


def test_a_live_run_keeps_each_ranks_newest_parts_and_the_young_ones(run: Path, expected: tuple[object, ...]) -> None:
    young = run / "spans" / layout.rank_dir_name(0)
    newest = sorted(young.glob("*.parquet"))[-1]
    os.utime(newest, None)  # written just now
    result = compact(run, min_age_s=60, keep_newest=2)
    assert result.parts_merged > 0
    for table in ("spans", "markers"):
        for rank_dir in (run / table).iterdir():
            assert len(list(rank_dir.glob("*.parquet"))) >= min(2, 1)
    assert newest.exists()
    # Single-file tables are rewritten by a live writer: merged only with everything=True.
    assert len(list((run / "ranks").glob("*.parquet"))) == 16
    assert _fingerprint(run) == expected
    # A later pass merges what became old, and the small compacted files of the first pass with it.
    second = compact(run, everything=True)
    assert second.parts_merged > 0
    manifests, _ = layout.read_manifests(run, "spans")
    assert len(layout.active_manifests(manifests)) == 1
    assert _fingerprint(run) == expected


@pytest.mark.parametrize("stage", ["written", "committed", "removing"])
def test_a_pass_stopped_at_any_stage_leaves_the_same_rows(run: Path, expected: tuple[object, ...], stage: str) -> None:
    class Stop(Exception):
        pass

    calls = {"n": 0}

    def hook(at: str) -> None:
        if at == stage:
            calls["n"] += 1
            if calls["n"] == 2:  # in the second table, after the first one completed
                raise Stop

    with pytest.raises(Stop):
        compact(run, everything=True, _hook=hook)
    assert _fingerprint(run) == expected
    compact(run, everything=True)
    assert _fingerprint(run) == expected
    assert _parts(run) == []
    # No file left that no manifest commits.
    for table in ("spans", "markers", "metrics", "ranks", "groups"):
        manifests, problems = layout.read_manifests(run, table)
        assert problems == []
        named = {f.path for m in layout.active_manifests(manifests) for f in m.files}
        on_disk = {p.relative_to(run).as_posix() for p in layout.compacted_dir(run, table).glob("*")}
        assert on_disk <= named | {m.name for m in layout.active_manifests(manifests)}


def test_sigkill_at_random_moments_loses_nothing_and_counts_nothing_twice(tmp_path: Path, synth: Synth) -> None:
    path = synth(tmp_path / "big", ranks=32, steps=8, tp=2, pp=4, seed=4, gpus_per_host=8, chunk_rows=3000)
    _age(path)
    expected = _fingerprint(path)
    # Small files: a pass writes many, so there are many moments to be killed at. The pass says
    # where it is (written a file, committed a table, removing replaced parts); each kill comes a
    # random few milliseconds after the n-th such word, so kills land inside every stage.
    script = ("import sys; from megascope import compact as c; c.FILE_ROWS = 20000; c.REMERGE_ROWS = 0; "
              "c.compact(sys.argv[1], everything=True, _hook=lambda stage: print(stage, flush=True))")
    rng = random.Random(7)
    seen = []
    for target in (1, 2, 3, 2, 4, 3):
        proc = subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout is not None
        stages = []
        for line in proc.stdout:
            stages.append(line.strip())
            if len(stages) == target:
                break
        time.sleep(rng.uniform(0, 0.02))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        seen += stages[-1:]
        assert _fingerprint(path) == expected
    assert {"written", "committed", "removing"} <= set(seen), seen
    compact(path, everything=True)
    assert _fingerprint(path) == expected
    assert _parts(path) == []


def test_compaction_beside_a_writer_and_a_reader(run: Path, expected: tuple[object, ...]) -> None:
    run_id = layout.read_run_json(run)["run_id"]
    base_rows = expected[0]
    written = {"rows": 0, "begun": 0}  # rows in parts written; rows in parts whose write has begun
    stop = threading.Event()
    errors: list[str] = []

    def part(rank: int, i: int) -> pa.Table:
        rows = [{"rank": rank, "step": 100 + i, "name": "extra", "kind": "other", "stream": "host",
                 "start_ns": j, "dur_ns": 1} for j in range(50)]
        return pa.Table.from_pylist(rows, schema=SPANS)

    def writer() -> None:
        i = 0
        while not stop.is_set():
            # Every other part with its sums, as the collector writes them; the others without
            # (an older writer): compaction keeps the sums consistent with the spans either way.
            write = layout.write_spans_part if i % 2 else functools.partial(layout.write_part, table="spans")
            # A reader may see the part between its rename and the count that follows it.
            written["begun"] += 50
            write(run, data=part(i % 16, i), rank=i % 16, run_id=run_id)
            written["rows"] += 50
            i += 1
            time.sleep(0.002)

    reader_run = open_run(run)

    def reader() -> None:
        cur = reader_run.cursor()
        while not stop.is_set():
            try:
                low = written["rows"]
                reader_run.refresh()
                ((count,),) = cur.execute("SELECT count(*) FROM spans").fetchall()
                high = written["begun"]
                if not base_rows + low <= count <= base_rows + high:
                    errors.append(f"read {count} spans, expected {base_rows + low}..{base_rows + high}")
            except duckdb.Error as exc:
                errors.append(str(exc))

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    try:
        for _ in range(3):
            # A live pass: new parts stay; replaced ones wait (grace) for the readers' refresh.
            compact(run, min_age_s=0, keep_newest=1, grace_s=30)
            # New parts on every rank before the next pass (not a guessed pause).
            target = written["rows"] + 16 * 50
            wait_until(lambda target=target: written["rows"] >= target, timeout=60,
                       message="the writer added a part per rank")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []
    assert len(layout.active_manifests(layout.read_manifests(run, "spans")[0])) >= 1
    # Past the grace, a pass removes what was replaced.
    removed = compact(run, min_age_s=0, keep_newest=1, grace_s=0).removed
    assert removed > 0
    final = _fingerprint(run)
    assert final[0] == base_rows + written["rows"]
    assert final[3:11] == expected[3:11]
    assert final[11] == expected[11] + written["rows"]  # every span, once, through its sums or not
    assert final[12] == expected[12]


def test_parts_of_another_run_stay_skipped(run: Path, source_run: Path, tmp_path: Path, synth: Synth,
                                           expected: tuple[object, ...]) -> None:
    other = synth(tmp_path / "other", ranks=16, steps=2, tp=2, pp=2, seed=99, gpus_per_host=4)
    stray = run / "spans" / layout.rank_dir_name(2) / "part-0000000000000000001-1-000000.parquet"
    shutil.copy(next((other / "spans" / layout.rank_dir_name(2)).glob("*.parquet")), stray)
    os.utime(stray, (1, 1))
    result = compact(run, everything=True)
    assert any("another run" in line for line in result.tables["spans"].skipped)
    assert stray.exists()
    reopened = open_run(run)
    assert any(str(stray) in p and "another run" in p for p in reopened.problems)
    assert _fingerprint(run) == expected
    # Another run's compacted files and manifest copied in are not this run's either.
    compact(other, everything=True)
    for f in (other / "compacted" / "metrics").iterdir():
        shutil.copy(f, run / "compacted" / "metrics" / f.name)
    reopened = open_run(run)
    assert any("compaction manifest of another run" in p for p in reopened.problems)
    assert _fingerprint(run) == expected


def test_plain_duckdb_reads_parts_and_compacted_files_with_hive_partitioning(run: Path,
                                                                             expected: tuple[object, ...]) -> None:
    compact(run, min_age_s=0, keep_newest=1)
    con = duckdb.connect()
    parts = con.execute(f"SELECT count(*), sum(dur_ns) FROM read_parquet('{run}/spans/*/*.parquet', "
                        "hive_partitioning=true, union_by_name=true)").fetchall()[0]
    merged = con.execute(f"SELECT count(*), sum(dur_ns) FROM read_parquet('{run}/compacted/spans/*.parquet', "
                         "union_by_name=true)").fetchall()[0]
    assert parts[0] > 0 and merged[0] > 0
    assert (parts[0] + merged[0], parts[1] + merged[1]) == expected[:2]


@pytest.mark.parametrize("group_rows", [300, 1000])
def test_span_row_groups_hold_one_kind_of_whole_steps_or_of_a_steps_rank_range(
        run: Path, monkeypatch: pytest.MonkeyPatch, group_rows: int) -> None:
    import pyarrow.parquet as pq

    monkeypatch.setattr(compaction, "ROW_GROUP_ROWS", group_rows)
    compact(run, everything=True)
    (path,) = layout.compacted_dir(run, "spans").glob("*.parquet")
    file = pq.ParquetFile(path)
    meta = file.metadata
    groups = []  # per row group: (step min, step max, kind, rank min, rank max, rows)
    for i in range(meta.num_row_groups):
        stats = {meta.row_group(i).column(j).path_in_schema: meta.row_group(i).column(j).statistics
                 for j in range(meta.num_columns)}
        step, kind, rank = stats["step"], stats["kind"], stats["rank"]
        assert kind.min == kind.max  # one kind a row group
        assert meta.row_group(i).num_rows <= group_rows
        groups.append((step.min, step.max, kind.min, rank.min, rank.max, meta.row_group(i).num_rows))
        rows = file.read_row_group(i, columns=["step", "rank", "start_ns"]).to_pylist()
        keys = [(r["step"], r["rank"], r["start_ns"]) for r in rows]
        assert keys == sorted(keys)
    data = file.read(columns=["step", "kind", "rank", "start_ns"]).to_pylist()
    keys = [(r["step"], r["kind"], r["rank"], r["start_ns"]) for r in data]
    if group_rows < 464:  # a step (16 ranks x 29 spans) has more rows: each step's kinds cut at common rank bounds
        assert keys == sorted(keys)
        for s in {g[0] for g in groups}:
            of_step = [g for g in groups if g[0] == s == g[1]]
            assert sum(g[5] for g in of_step) == sum(1 for k in keys if k[0] == s)  # every row group of one step
            starts = {g[3] for g in of_step}
            assert len(starts) > 1  # cut into ranges of ranks
            assert not any(g[3] < b <= g[4] for g in of_step for b in starts)  # the same bounds for every kind
    else:  # two whole steps a band, kind by kind within it
        assert keys == sorted(keys, key=lambda k: (k[0] // 2, k[1], k[0], k[2], k[3]))
        assert {(g[0], g[1], g[3], g[4]) for g in groups} == {(s, s + 1, 0, 15) for s in range(0, 8, 2)}
    # The kind filter reads only the collectives' row groups: every other one is skipped by its statistics.
    read = sum(g[5] for g in groups if g[2] <= "collective" <= g[2])
    assert read == sum(1 for k in keys if k[1] == "collective") < len(keys) / 2
    # Markers keep their order: (step, rank, time_ns).
    (markers,) = layout.compacted_dir(run, "markers").glob("*.parquet")
    rows = pq.read_table(markers, columns=["step", "rank", "time_ns"]).to_pylist()
    order = [(r["step"] is None, r["step"], r["rank"], r["time_ns"]) for r in rows]
    assert order == sorted(order)


def test_dashboard_selections_and_exports_read_the_same_after_compaction(run: Path, tmp_path: Path) -> None:
    from megascope.dashboard import queries

    from megascope.export.chrome import export_chrome

    def views(path: Path) -> tuple[object, ...]:
        r = open_run(path)
        spans = queries.timeline_spans(r, ranks=[1, 2, 5], steps=(2, 4))
        spans = spans.sort_values(["rank", "start_ns", "name"]).reset_index(drop=True)
        return (spans.to_json(), queries.rank_info(r, [3, 4]).to_json(), queries.peers_of(r, 5),
                queries.last_step_of(r, 7))

    def events(path: Path, out: Path) -> list[str]:
        export_chrome(open_run(path), out, ranks=[0, 1, 2, 3, 9])
        data = json.loads(out.read_text())
        items = data["traceEvents"] if isinstance(data, dict) else data
        return sorted(json.dumps(e, sort_keys=True) for e in items)

    before, before_events = views(run), events(run, tmp_path / "a.json")
    compact(run, everything=True)
    assert views(run) == before
    assert events(run, tmp_path / "b.json") == before_events


# ------------------------------------------------------------------------------------ scoped passes


def _heartbeats(run: Path, host: str, parts: int) -> pa.Table:
    """``parts`` heartbeat parts of ``host`` (synth runs have none), aged; returns their rows."""
    from megascope.schema import HEARTBEATS

    run_id = layout.read_run_json(run)["run_id"]
    tables = []
    for i in range(parts):
        data = pa.Table.from_pylist([{"host": host, "rank": None, "pid": 1, "time_ns": 10**9 * i + j,
                                      "device": "gpu0", "metric": "gpu_util_pct", "value": float(j)}
                                     for j in range(20)], schema=HEARTBEATS)
        layout.write_part(run, "heartbeats", data, host=host, run_id=run_id)
        tables.append(data)
    _age_all(run)
    return pa.concat_tables(tables)


def _age_all(run: Path) -> None:
    then = time.time() - 3600
    for p in run.glob("*/*=*/*.parquet"):
        os.utime(p, (then, then))


def _ranks_with_parts(run: Path, table: str) -> set[int]:
    return {int(d.name.split("=")[1]) for d in (run / table).glob("rank=*") if any(d.glob("*.parquet"))}


def test_scoped_passes_merge_their_own_ranks_and_host_and_nothing_else(run: Path,
                                                                      expected: tuple[object, ...]) -> None:
    beats = _heartbeats(run, "node-a", 3)
    _heartbeats(run, "node-b", 2)
    ranks_before = len(list((run / "ranks").glob("*.parquet")))
    result = compact(run, min_age_s=0, keep_newest=1, scope=compaction.Scope(ranks=(4, 7), host="node-a"))
    assert set(result.tables) == {"spans", "markers", "metrics", "heartbeats"}
    assert result.tables["heartbeats"].parts_merged == 2  # the host's newest part stays, as a rank's does
    # Ranks 4-7 keep their newest part each; every other rank keeps all of its parts.
    for table in ("spans", "markers"):
        for rank_dir in (run / table).glob("rank=*"):
            rank = int(rank_dir.name.split("=")[1])
            left = len(list(rank_dir.glob("*.parquet")))
            assert left == 1 if 4 <= rank <= 7 else left > 1, (table, rank, left)
    assert len(list((run / "heartbeats" / layout.host_dir_name("node-b")).glob("*.parquet"))) == 2
    assert len(list((run / "heartbeats" / layout.host_dir_name("node-a")).glob("*.parquet"))) == 1
    assert len(list((run / "ranks").glob("*.parquet"))) == ranks_before  # no scope's
    # The files carry their scope's name, and hold those ranks only.
    for table in ("spans", "markers"):
        (m,) = layout.active_manifests(layout.read_manifests(run, table)[0])
        assert layout.compacted_scope(m.path.name) == "r00004_00007"
        assert all(lo >= 4 and hi <= 7 for f in m.files for lo, hi in f.ranks)
    (hb,) = layout.active_manifests(layout.read_manifests(run, "heartbeats")[0])
    assert layout.compacted_scope(hb.path.name) == "hnode-a"
    assert _fingerprint(run) == expected
    opened = open_run(run)
    assert opened.con.execute("SELECT count(*), sum(value) FROM heartbeats WHERE host = 'node-a'").fetchone() == (
        beats.num_rows, sum(beats.column("value").to_pylist()))
    # A second pass of the same scope merges its earlier small files with what became old.
    for p in (run / "spans" / layout.rank_dir_name(5)).glob("*.parquet"):
        os.utime(p, (1, 1))
    again = compact(run, min_age_s=0, keep_newest=0, scope=compaction.Scope(ranks=(4, 7)))
    assert again.tables["spans"].parts_merged >= 1
    assert len(layout.active_manifests(layout.read_manifests(run, "spans")[0])) == 1
    assert _fingerprint(run) == expected
    # The job's last, unscoped pass takes the scoped files in with everything else.
    compact(run, everything=True)
    assert _parts(run) == []
    assert len(layout.active_manifests(layout.read_manifests(run, "spans")[0])) == 1
    assert _fingerprint(run) == expected


def test_an_overlapping_scope_later_never_merges_a_part_twice(run: Path, expected: tuple[object, ...]) -> None:
    # The first pass's replaced parts stay (a grace for readers) and must count once.
    compact(run, min_age_s=0, keep_newest=0, grace_s=3600, scope=compaction.Scope(ranks=(0, 7)))
    assert _ranks_with_parts(run, "spans") == set(range(16))  # replaced, not yet removed
    second = compact(run, min_age_s=0, keep_newest=0, grace_s=3600, scope=compaction.Scope(ranks=(4, 11)))
    assert second.tables["spans"].parts_merged > 0
    (later,) = [m for m in layout.read_manifests(run, "spans")[0] if "r00004_00011" in m.path.name]
    # Ranks 4-7 were the first pass's: the later one merged ranks 8-11 alone.
    assert {int(rel.split("rank=")[1][:5]) for rel in later.replaces if rel.startswith("spans/")} == set(range(8, 12))
    assert _fingerprint(run) == expected
    # Past the grace, each scope removes what it replaced, and an unscoped pass what is left.
    compact(run, min_age_s=0, keep_newest=0, grace_s=0, scope=compaction.Scope(ranks=(0, 7)))
    assert _ranks_with_parts(run, "spans") == set(range(8, 16))
    assert _fingerprint(run) == expected
    compact(run, everything=True)
    assert _parts(run) == []
    assert _fingerprint(run) == expected


def test_disjoint_scopes_run_at_once_and_overlapping_ones_wait(run: Path, expected: tuple[object, ...]) -> None:
    inside = threading.Event()
    go_on = threading.Event()
    errors: list[BaseException] = []

    def hold(stage: str) -> None:
        if stage == "written" and not inside.is_set():
            inside.set()
            assert go_on.wait(60)

    def first() -> None:
        try:
            compact(run, min_age_s=0, keep_newest=1, scope=compaction.Scope(ranks=(0, 3)), _hook=hold)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    t = threading.Thread(target=first)
    t.start()
    try:
        assert inside.wait(60)
        with pytest.raises(compaction.CompactionBusy, match="rank=00003"):
            compact(run, min_age_s=0, keep_newest=1, scope=compaction.Scope(ranks=(3, 5)))
        with pytest.raises(compaction.CompactionBusy, match="another compaction"):
            compact(run, min_age_s=0, keep_newest=1)  # an unscoped pass runs alone
        beside = compact(run, min_age_s=0, keep_newest=1, scope=compaction.Scope(ranks=(8, 15)))
        assert beside.parts_merged > 0
    finally:
        go_on.set()
        t.join()
    assert errors == []
    assert _ranks_with_parts(run, "spans") == set(range(16))
    assert all(len(list((run / "spans" / layout.rank_dir_name(r)).glob("*.parquet"))) == 1
               for r in [*range(4), *range(8, 16)])
    assert _fingerprint(run) == expected


def test_sigkilled_scoped_passes_leave_the_same_rows_and_their_next_pass_cleans_up(
        tmp_path: Path, synth: Synth) -> None:
    path = synth(tmp_path / "big", ranks=16, steps=8, tp=2, pp=2, seed=5, gpus_per_host=4, chunk_rows=800)
    _age(path)
    expected = _fingerprint(path)
    script = ("import sys; from megascope import compact as c; c.FILE_ROWS = 3000; c.REMERGE_ROWS = 0; "
              "c.compact(sys.argv[1], min_age_s=0, keep_newest=1, grace_s=0, scope=c.Scope(ranks=(0, 7)), "
              "_hook=lambda stage: print(stage, flush=True))")
    rng = random.Random(11)
    for target in (1, 3, 2):
        proc = subprocess.Popen([sys.executable, "-c", script, str(path)], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
        assert proc.stdout is not None
        for n, _line in enumerate(proc.stdout, 1):
            if n == target:
                break
        time.sleep(rng.uniform(0, 0.01))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        assert _fingerprint(path) == expected
    compact(path, min_age_s=0, keep_newest=1, grace_s=0, scope=compaction.Scope(ranks=(0, 7)))
    # Nothing of the scope's is left uncommitted.
    for table in ("spans", "markers", "metrics"):
        manifests, problems = layout.read_manifests(path, table)
        assert problems == []
        named = {f.path for m in manifests for f in m.files} | {m.name for m in manifests}
        base = layout.compacted_dir(path, table)
        on_disk = {p.relative_to(path).as_posix() for p in base.iterdir()} if base.is_dir() else set()
        assert on_disk <= named, on_disk - named
    assert _fingerprint(path) == expected


# ------------------------------------------------------------------------------------ command line


@pytest.fixture
def cli_run(run: Path) -> Iterator[Path]:
    yield run


def test_cli_compacts_and_says_what_it_did(cli_run: Path, expected: tuple[object, ...]) -> None:
    proc = megascope("compact", cli_run, "--all", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["parts_merged"] > 0 and out["files_written"] >= 5
    assert _fingerprint(cli_run) == expected
    proc = megascope("compact", cli_run)
    assert proc.returncode == 0 and "merged 0 parts" in proc.stdout


def test_cli_all_keeps_what_the_first_report_reads(cli_run: Path, tmp_path: Path) -> None:
    from megascope.analysis import report

    untouched = tmp_path / "untouched"
    shutil.copytree(cli_run, untouched)
    proc = megascope("compact", cli_run, "--all", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["analysis_s"] > 0
    said: list[str] = []
    run = open_run(cli_run)
    warm = report(run, progress=said.append)
    run.con.close()
    assert "reading the analysis cache" in said and "matching collectives" not in said, said
    # The same report as one that builds everything from the compacted parts.
    shutil.rmtree(cli_run / "_cache")
    said.clear()
    run = open_run(cli_run)
    cold = report(run, progress=said.append)
    run.con.close()
    assert "matching collectives" in said
    assert _comparable(warm) == _comparable(cold)
    # Not asked for: nothing is kept, and a pass without --all builds nothing unless asked.
    proc = megascope("compact", untouched, "--all", "--no-analyze")
    assert proc.returncode == 0, proc.stderr
    assert "analysis tables" not in proc.stdout and not (untouched / "_cache").exists()
    proc = megascope("compact", untouched, "--analyze", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["analysis_s"] > 0 and (untouched / "_cache" / "key.json").is_file()
    assert_one_line_error(megascope("compact", untouched, "--analyze", "--ranks", "0-3"), mentions="--analyze")


def _comparable(value: object) -> object:
    """A report as two reports of the same run agree on: the ages measured from now left out, floats
    to 9 digits (regression slopes differ in their last bits with the order rows were read in)."""
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items() if k not in ("idle_s", "progress_age_s", "last_data_age_s")}
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    if isinstance(value, float):
        return float(f"{value:.9g}")
    return value


def test_an_analysis_that_fails_after_a_compaction_is_a_warning(tmp_path: Path) -> None:
    from megascope.cli.compact import _analysis_note

    seconds, problem = _analysis_note(tmp_path / "nowhere")
    assert seconds is None
    assert problem is not None and "analysis tables not kept" in problem and "nowhere" in problem


def test_cli_errors_are_one_line(cli_run: Path, tmp_path: Path) -> None:
    assert_one_line_error(megascope("compact", tmp_path / "nowhere"), mentions="no such run directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(megascope("compact", empty), mentions="not a megascope run directory")
    afile = tmp_path / "file"
    afile.write_text("x")
    assert_one_line_error(megascope("compact", afile))
    assert_one_line_error(megascope("compact", cli_run, "--min-age", "-1"))
    # Another pass holding the lock.
    lock_dir = cli_run / "compacted"
    lock_dir.mkdir(exist_ok=True)
    import fcntl

    with open(lock_dir / ".lock", "ab") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        assert_one_line_error(megascope("compact", cli_run, "--all"), mentions="another compaction")


def test_cli_scoped_passes_and_their_errors(cli_run: Path, expected: tuple[object, ...]) -> None:
    proc = megascope("compact", cli_run, "--ranks", "0-7", "--min-age", "0", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["parts_merged"] > 0 and set(out["tables"]) == {"spans", "markers", "metrics"}
    assert _ranks_with_parts(cli_run, "spans") == set(range(16))
    proc = megascope("compact", cli_run, "--ranks", "8", "--min-age", "0")
    assert proc.returncode == 0 and "(ranks 8-8)" in proc.stdout
    assert _fingerprint(cli_run) == expected
    assert_one_line_error(megascope("compact", cli_run, "--ranks", "7-3"), mentions="not a range of ranks")
    assert_one_line_error(megascope("compact", cli_run, "--ranks", "a-b"), mentions="--ranks")
    assert_one_line_error(megascope("compact", cli_run, "--all", "--every", "5"), mentions="--every")
    assert_one_line_error(megascope("compact", cli_run, "--host", " "), mentions="host name is empty")


def test_cli_every_repeats_until_stopped(cli_run: Path, expected: tuple[object, ...]) -> None:
    import pyarrow.parquet as pq

    extra = pq.read_table(next(cli_run.glob(layout.table_glob("metrics")))).slice(0, 5)
    proc = subprocess.Popen([sys.executable, "-m", "megascope", "compact", str(cli_run), "--ranks", "0-15",
                             "--min-age", "0", "--keep-newest", "0", "--grace", "0", "--every", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: not any(_ranks_with_parts(cli_run, t) for t in ("spans", "markers", "metrics")),
                   timeout=60, message="the first pass")
        # A part written later is merged by a later pass.
        run_id = layout.read_run_json(cli_run)["run_id"]
        layout.write_part(cli_run, "metrics", extra, rank=3, run_id=run_id)
        wait_until(lambda: not _ranks_with_parts(cli_run, "metrics"), timeout=60, message="a later pass")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert err == ""
    assert "merged" in out
    assert _fingerprint(cli_run)[5] == expected[5] + 5


def test_cli_every_warns_of_a_part_it_leaves_once(cli_run: Path) -> None:
    broken = cli_run / "spans" / layout.rank_dir_name(2) / "part-0000000000000000003-1-000000.parquet"
    broken.write_bytes(b"not parquet")
    os.utime(broken, (1, 1))
    proc = subprocess.Popen([sys.executable, "-m", "megascope", "compact", str(cli_run), "--ranks", "0-15",
                             "--min-age", "0", "--every", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: layout.read_manifests(cli_run, "spans")[0] != [], timeout=60, message="the first pass")
        time.sleep(3.5)  # three passes more, each finding the same part
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    lines = [line for line in err.splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith(f"warning: {broken}: not a readable Parquet file"), err
    assert out.count("merged") == 1  # the passes after the first found nothing to do, and said nothing


def test_cli_on_a_read_only_run_is_one_line(cli_run: Path, tmp_path: Path) -> None:
    where = tmp_path / "ro"
    where.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot mount a filesystem here")
        try:
            shutil.copytree(cli_run, where / "run")
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
            line = assert_one_line_error(megascope("compact", where / "run", "--all"))
            assert "cannot write" in line
        finally:
            subprocess.run(["umount", str(where)], check=False)
    else:
        shutil.copytree(cli_run, where / "run")
        (where / "run").chmod(0o500)
        try:
            assert_one_line_error(megascope("compact", where / "run", "--all"), mentions="cannot write")
        finally:
            (where / "run").chmod(0o700)


# ------------------------------------------------------------------------------------ other filesystems


def test_a_run_reads_through_an_fsspec_filesystem_registered_in_duckdb(run: Path, expected: tuple[object, ...]) -> None:
    """What docs/run-directory.md shows for object stores, on fsspec's in-memory filesystem and on
    the local disk under a protocol of its own: the same SQL, the same rows."""
    fsspec = pytest.importorskip("fsspec")
    from fsspec.implementations.local import LocalFileSystem
    from fsspec.implementations.memory import MemoryFileSystem

    compact(run, min_age_s=0, keep_newest=1)  # half the rows in parts, half in compacted files
    memory = MemoryFileSystem()
    for p in run.rglob("*"):
        if p.is_file():
            memory.pipe(f"/bucket/run/{p.relative_to(run).as_posix()}", p.read_bytes())

    class RunsFileSystem(LocalFileSystem):  # the local disk, as "runs://"
        protocol = "runs"

    for fs, url in ((memory, "memory://bucket/run"), (RunsFileSystem(), f"runs://{run}")):
        con = duckdb.connect()
        # Registered plain, DuckDB's threads tear each other's seek + read on one file object
        # (megascope.remote); compacted spans then read "Out of buffer" about every other time.
        con.register_filesystem(positional(fs))
        # Committed compacted files: the manifests name them (and the parts they replace).
        manifests = [json.loads(fs.cat(m)) for m in fs.glob(f"{url}/compacted/spans/*.manifest.json")]
        replaced = {rel for m in manifests for rel in m["replaces"]}
        named = [f"{url}/{f['path']}" for m in manifests if m["table"] == "spans" for f in m["files"]]
        assert named and not replaced & {f["path"] for m in manifests for f in m["files"]}
        parts = con.execute(
            f"SELECT count(*), sum(dur_ns) FROM read_parquet('{url}/spans/*/*.parquet', hive_partitioning=true, "
            "hive_types={'rank': INTEGER}, union_by_name=true)").fetchall()[0]
        merged = con.execute("SELECT count(*), sum(dur_ns) FROM read_parquet(?)", [named]).fetchall()[0]
        assert (parts[0] + merged[0], parts[1] + merged[1]) == expected[:2]
        con.close()
    assert fsspec is not None


def test_a_positional_file_keeps_each_threads_place(tmp_path: Path) -> None:
    """Two threads seek one file object in turn, then read: each reads from where it sought, as
    DuckDB's threads need (a plain file object would give both the last seek's bytes)."""
    path = tmp_path / "data"
    path.write_bytes(bytes(range(256)))
    f = PositionalFile(path.open("rb"))
    sought, go, got = threading.Barrier(2), threading.Event(), {}

    def reader(at: int) -> None:
        f.seek(at)
        sought.wait()
        go.wait()
        got[at] = (f.read(4), f.tell(), f.read(2))

    threads = [threading.Thread(target=reader, args=(at,)) for at in (10, 200)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join()
    assert got == {10: (bytes(range(10, 14)), 14, bytes([14, 15])), 200: (bytes(range(200, 204)), 204, bytes([204, 205]))}
    buffer = bytearray(3)
    assert f.seek(-2, 2) == 254 and f.readinto(buffer) == 2 and bytes(buffer[:2]) == bytes([254, 255])
    f.close()


def test_the_dashboard_watcher_compacts_when_asked(run: Path, expected: tuple[object, ...]) -> None:
    pytest.importorskip("dash")
    from megascope.dashboard.runs import RunRegistry

    off = RunRegistry([run])
    assert off.compact_due() == []
    registry = RunRegistry([run], compact_every_s=3600)
    (served,) = list(registry)
    generation = served.generation
    assert registry.compact_due() == [served.id]
    registry.wait_compactions(60)
    assert registry.compact_due() == []  # not again before its period
    assert list((run / "compacted" / "spans").glob("*.manifest.json"))
    assert served.poll() and served.generation == generation + 1  # the commit is noticed
    assert served.run is not None and served.run.compacted["spans"]
    (row,) = served.run.con.execute(_FINGERPRINT).fetchall()
    assert tuple(round(v, 6) if isinstance(v, float) else v for v in row) == expected


def test_a_ranks_file_rewritten_after_compaction_replaces_its_merged_rows(run: Path) -> None:
    compact(run, everything=True)
    run_id = layout.read_run_json(run)["run_id"]
    r = open_run(run)
    row = r.con.execute("SELECT * FROM ranks WHERE rank = 3").df()
    row["host"] = "moved-host"
    layout.write_part(run, "ranks", pa.Table.from_pandas(row, schema=RANKS, preserve_index=False), rank=3, run_id=run_id)

    def hosts() -> tuple[int, list[str]]:
        con = open_run(run).con
        ((n,),) = con.execute("SELECT count(*) FROM ranks").fetchall()
        return n, [h for (h,) in con.execute("SELECT host FROM ranks WHERE rank = 3").fetchall()]

    assert hosts() == (16, ["moved-host"])  # the file beside the merged rows wins
    compact(run, everything=True)
    assert not (run / "ranks" / "rank=00003.parquet").exists()
    assert hosts() == (16, ["moved-host"])  # merged again: once, the new version
    assert len(layout.active_manifests(layout.read_manifests(run, "ranks")[0])) == 1


def test_a_compacted_run_without_its_run_json_is_still_a_run(run: Path, tmp_path: Path) -> None:
    from megascope.errors import RunDirError

    compact(run, everything=True)
    (run / layout.RUN_JSON).unlink()
    assert layout.is_run_dir(run)
    with pytest.raises(RunDirError, match="missing, though the directory holds data"):
        open_run(run)
    assert_one_line_error(megascope("compact", run), mentions="not a megascope run directory")


def test_run_state_reads_the_data_s_age_after_compacting_everything(run: Path) -> None:
    """The parts are an hour old; once merged (rank folders gone), the compacted files keep that
    age rather than the merge's time, and the finished run still reads finished."""
    from megascope.analysis.runstate import newest_write_ns, run_state

    before = newest_write_ns(run)
    state_before = run_state(open_run(run))["state"]
    compact(run, everything=True)
    assert not list(run.glob("spans/rank=*/*.parquet"))
    after = newest_write_ns(run)
    assert after is not None and before is not None
    assert after <= time.time_ns() - 3000 * 10**9
    assert run_state(open_run(run))["state"] == state_before


# ------------------------------------------------------------------------------------ readers beside a pass


def test_a_part_removed_between_listing_and_reading_is_no_problem(run: Path, expected: tuple[object, ...]) -> None:
    """A compaction pass may remove a part between a reader's listing and its check of it (a
    live run's refresh): the part was merged, so nothing is wrong, and a problem kept in
    ``run.problems`` would be shown long after. A part that is there and broken still is one."""
    from megascope import store

    opened = open_run(run)
    parts = sorted(run.glob(layout.table_glob("spans")))
    gone = run / "spans" / layout.rank_dir_name(0) / "part-0000000000000000001-1-000000.parquet"
    broken = run / "spans" / layout.rank_dir_name(1) / "part-0000000000000000002-1-000000.parquet"
    broken.write_bytes(b"not parquet")
    scanned = store._scan_each(opened, "spans", [*parts, gone, broken])
    assert scanned.files == parts
    assert not any(str(gone) in p for p in opened.problems)
    assert any(str(broken) in p and "not a readable Parquet file" in p for p in opened.problems)


def test_a_manifest_superseded_while_read_is_no_problem(run: Path, monkeypatch: pytest.MonkeyPatch,
                                                         expected: tuple[object, ...]) -> None:
    """A reader that read the manifests just before a later pass merged one of them again and
    removed its files (no grace) finds those files gone: that manifest is replaced, not broken."""
    compact(run, min_age_s=0, keep_newest=1)
    stale = {t: layout.read_manifests(run, t) for t in ("spans", "markers", "metrics")}
    compact(run, everything=True)  # merges the first pass's files again and removes them
    real = layout.read_manifests
    first: set[str] = set()

    def read_manifests(run_dir: Path, table: str, names: object = None) -> object:
        if table in stale and table not in first:
            first.add(table)
            return stale[table]
        return real(run_dir, table, names)  # type: ignore[arg-type]

    monkeypatch.setattr(layout, "read_manifests", read_manifests)
    opened = open_run(run)
    assert first == {"spans", "markers", "metrics"}
    assert not any("not a readable Parquet file" in p for p in opened.problems), opened.problems
    monkeypatch.setattr(layout, "read_manifests", real)
    opened.refresh()  # the next refresh reads the run as it is
    (row,) = opened.con.execute(_FINGERPRINT).fetchall()
    assert tuple(round(v, 6) if isinstance(v, float) else v for v in row) == expected


def test_parts_removed_while_the_views_are_built_are_read_from_the_compacted_files(
        run: Path, monkeypatch: pytest.MonkeyPatch, expected: tuple[object, ...]) -> None:
    """A pass with no grace (a job's last) may remove parts after a refresh listed them and before
    DuckDB bound a view over them: the refresh lists the run again, never fails on that."""
    from megascope import store

    opened = open_run(run)
    real = store._create_table_views
    passes: list[int] = []

    def listed_then_compacted(r: store.Run, *args: object) -> None:
        real(r, *args)  # type: ignore[arg-type]
        if not passes:
            passes.append(compact(run, everything=True).parts_merged)

    monkeypatch.setattr(store, "_create_table_views", listed_then_compacted)
    opened.refresh()
    assert passes and passes[0] > 0
    assert not list(run.glob(layout.table_glob("spans")))  # every part the first listing named is gone
    (row,) = opened.con.execute(_FINGERPRINT).fetchall()
    assert tuple(round(v, 6) if isinstance(v, float) else v for v in row) == expected
    assert opened.problems == []


def test_a_file_that_stays_unreadable_still_fails_the_refresh(run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a removed file makes the views be built again; any other read error is the caller's."""
    from megascope import store

    opened = open_run(run)
    calls: list[int] = []

    def failing(r: store.Run) -> None:
        calls.append(1)
        raise duckdb.IOException("IO Error: something else")

    monkeypatch.setattr(store, "_create_views_once", failing)
    with pytest.raises(duckdb.IOException, match="something else"):
        opened.refresh()
    assert calls == [1]


def test_a_refresh_checks_only_the_compacted_files_it_has_not_seen(run: Path, expected: tuple[object, ...],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A compacted file is never rewritten: found good once, it is not read again at each refresh."""
    from megascope import store

    checked: list[Path] = []
    check_part = store._check_part
    monkeypatch.setattr(store, "_check_part", lambda path, *a, **k: checked.append(path) or check_part(path, *a, **k))
    compact(run, min_age_s=60, keep_newest=2)
    reader = open_run(run)
    first = set(checked)
    assert first and all(layout.COMPACTED_DIR in p.parts for p in first)
    checked.clear()
    reader.refresh()
    assert checked == []
    compact(run, everything=True, grace_s=0)  # merges the first pass's files again and removes them
    reader.refresh()
    assert checked and not set(checked) & first
    assert set(checked) == {f for files in reader.compacted.values() for f in files}
    (row,) = reader.con.execute(_FINGERPRINT).fetchall()
    assert tuple(round(v, 6) if isinstance(v, float) else v for v in row) == expected
