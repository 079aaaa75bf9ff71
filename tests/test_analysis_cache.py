"""The base tables kept beside the run (RUN/_cache): reused when the parts are the same, rebuilt when
they change, ignored when damaged, skipped when the run cannot be written; the answers never change."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import Synth, same_answer
from hand_runs import MS, hand_run, span

from megascope import analysis, layout, schema
from megascope.analysis import persist
from megascope.analysis.base import BASE_TABLES, prepare
from megascope.store import open_run


def _report(path: Path) -> dict[str, Any]:
    result = analysis.report(open_run(path))
    # The run's state is measured against the wall clock (ages in seconds): not part of the answer.
    result.pop("state")
    return result


def _uncached(path: Path, tmp: Path) -> dict[str, Any]:
    """The report of a copy of ``path`` made without its cache, built from the parts alone."""
    copy = tmp / f"uncached-{len(list(tmp.iterdir()))}"
    shutil.copytree(path, copy, ignore=shutil.ignore_patterns(persist.CACHE_DIR), copy_function=shutil.copy2)
    result = _report(copy)
    result["run"]["path"] = str(path)
    result["problems"] = [p.replace(str(copy), str(path)) for p in result["problems"]]
    return result


@pytest.fixture
def run(synth: Synth, tmp_path: Path) -> Path:
    return synth(tmp_path / "run", "straggler:rank=5,factor=1.3", ranks=16, steps=6, tp=2, pp=2, seed=5, gpus_per_host=4)


def _key(path: Path) -> dict[str, Any]:
    return json.loads((persist.cache_dir(path) / persist.KEY_FILE).read_text())


def _count_builds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that gets an item at every build of the base tables from the parts."""
    from megascope.analysis import base

    built: list[int] = []
    real_build = base._build
    monkeypatch.setattr(base, "_build", lambda con, say, *a: built.append(1) or real_build(con, say, *a))
    return built


def test_second_report_reads_the_cache_and_answers_the_same(run: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    first = _report(run)
    assert first["stragglers"] and first["stragglers"][0]["rank"] == 5
    key = _key(run)
    assert set(key["tables"]) == set(BASE_TABLES)
    # The what-if replay's sampled spans are kept too (a straggler was found, so it ran).
    assert [t for t in key.get("extra", {}) if t.startswith("whatif_")]
    # The second report builds nothing: the SQL that scans the spans is never run.
    built: list[str] = []
    from megascope.analysis import base
    monkeypatch.setattr(base, "_build", lambda con, say, *a: built.append("built"))
    second = _report(run)
    assert built == []
    assert same_answer(second, first)
    monkeypatch.undo()
    assert same_answer(_uncached(run, tmp_path), first)


def test_the_cache_is_written_beside_the_analysis_and_its_extras_after_it(
        run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A report goes on while its base tables are written: the stragglers are scored before the
    write is done, what they keep meanwhile is written after it, and nothing is missing once the
    report returns."""
    import importlib
    import threading

    report_module = importlib.import_module("megascope.analysis.report")  # the package exports report()

    expected = _uncached(run, tmp_path)
    release = threading.Event()
    order: list[str] = []
    real_save, real_extra, real_detect = persist.save, persist._write_extra, report_module.detect

    def slow_save(*args: Any, **kwargs: Any) -> bool:
        assert release.wait(120)
        order.append("base tables")
        return real_save(*args, **kwargs)

    def extra(con: Any, source: Any, name: str, table: str, shown: str) -> bool:
        order.append(name)
        return real_extra(con, source, name, table, shown)

    def detect(*args: Any, **kwargs: Any) -> Any:
        found = real_detect(*args, **kwargs)
        order.append("scored")
        # The base tables are still being written: nothing kept under the new key is read back.
        source = persist._source(args[0].con)
        assert source is not None and persist._in_flight(source)
        assert persist.load_extra(args[0].con, "rank_scores") is False
        release.set()
        return found

    monkeypatch.setattr(persist, "save", slow_save)
    monkeypatch.setattr(persist, "_write_extra", extra)
    monkeypatch.setattr(report_module, "detect", detect)
    opened = open_run(run)
    first = analysis.report(opened)
    first.pop("state")
    assert same_answer(first, expected)
    assert order[:2] == ["scored", "base tables"]
    assert [n for n in order[2:] if n.startswith("rank_scores")] and [n for n in order[2:] if n.startswith("whatif_")]
    key = _key(run)
    assert set(key["tables"]) == set(BASE_TABLES)
    assert set(key["extra"]) == set(order[2:])
    assert [m for m in key["memo"] if m.startswith("whatif-steps:")]
    # The copies the extras were written from are gone.
    assert not opened.con.execute("SELECT table_name FROM duckdb_tables() WHERE table_name LIKE '\\_aside\\_%' ESCAPE '\\'").fetchall()
    monkeypatch.undo()
    assert same_answer(_report(run), first)


def test_cache_never_read_as_a_table(run: Path) -> None:
    _report(run)
    again = open_run(run)
    assert again.problems == []
    read = [f.relative_to(run).parts[0] for files in again.files.values() for f in files]
    assert read and persist.CACHE_DIR not in read
    # Hive-style readers of the whole directory skip it too (a leading underscore).
    assert persist.CACHE_DIR.startswith("_") and layout.is_run_dir(run)


def _grow(path: Path, ranks: int, *, sums: bool = False, start: int = 0) -> None:
    """One more step for every rank: the spans of the last step written again 1 s later, as a new part
    (with its step_sums twin, as the collector writes them, where ``sums``; without, as an older writer)."""
    store = open_run(path)  # the rows wherever they are: parts or compacted files
    for rank in range(start, ranks):
        rows = store.con.sql(f"SELECT * FROM spans WHERE rank = {rank}").to_arrow_table().to_pylist()
        last = max(r["step"] for r in rows)
        rows = [r for r in rows if r["step"] == last]
        for r in rows:
            r.update(step=last + 1, start_ns=r["start_ns"] + 1_000 * MS, rank=rank)
            if r["seq"] is not None:
                r["seq"] += 10_000
        data = pa.Table.from_pylist(rows, schema=schema.SPANS)
        if sums:
            layout.write_spans_part(path, data, rank=rank)
        else:
            layout.write_part(path, "spans", data, rank=rank)


def test_a_new_part_rebuilds_and_the_answer_follows(run: Path, tmp_path: Path) -> None:
    before = _report(run)
    old_key = _key(run)["key"]
    _grow(run, 16)
    after = _report(run)
    assert _key(run)["key"] != old_key
    assert after["run"]["steps"] == before["run"]["steps"] + 1
    assert same_answer(after, _uncached(run, tmp_path))
    # Only the current key's files stay.
    key = _key(run)
    names = {p.name for p in persist.cache_dir(run).iterdir()}
    kept = {e["file"] for e in [*key["tables"].values(), *key.get("extra", {}).values()]}
    assert names == {persist.KEY_FILE, key["files"]["file"]} | kept


def test_a_growing_run_extends_the_cache(tmp_path: Path, synth: Synth, monkeypatch: pytest.MonkeyPatch) -> None:
    """New steps are read, the others kept: no full build, the same answer as one from scratch."""
    path = synth(tmp_path / "long", "straggler:rank=9,factor=1.3", ranks=16, steps=20, tp=2, pp=2, seed=7,
                 gpus_per_host=4)
    from megascope.analysis import base
    scanned: list[str] = []
    real_execute = base._sql.execute

    def execute(con: Any, module: str, name: str, **params: Any) -> Any:
        if name == "inst":
            scanned.append(str(params["where"]))
        if name in ("clock_samples", "nested_kinds", "slow_edges"):
            scanned.append(name)
        return real_execute(con, module, name, **params)

    monkeypatch.setattr(base._sql, "execute", execute)
    _report(path)
    assert "slow_edges" in scanned and "clock_samples" in scanned
    scanned.clear()
    built = _count_builds(monkeypatch)
    for sums in (True, False):
        _grow(path, 16, sums=sums)
        grown = _report(path)
    # The clock sample (steps 5-8 and 13-16 of 0-21), the nested calls' probe (steps 1-16) and the
    # pipeline links' sample hold no new row: none is read again.
    assert built == [] and scanned == ["s.step >= 20", "s.step >= 21"]
    monkeypatch.undo()
    assert grown["run"]["steps"] == 22 and grown["stragglers"][0]["rank"] == 9
    assert same_answer(grown, _uncached(path, tmp_path))
    # A refreshed run (the dashboard's live view) extends the same way, from the tables it holds:
    # the cache's files are not read back.
    live = open_run(path)
    prepare(live.con)
    _grow(path, 16)
    live.refresh()
    loaded: list[str] = []
    real_load = persist.load
    monkeypatch.setattr(persist, "load", lambda *a, **k: loaded.append(k.get("prefix", "")) or real_load(*a, **k))
    prepare(live.con)
    assert loaded == []
    assert live.con.execute("SELECT max(step) FROM ms_cache.rank_step").fetchone() == (22,)
    monkeypatch.undo()
    fresh = open_run(path)
    prepare(fresh.con)
    for table in BASE_TABLES:
        mine = live.con.execute(f"SELECT * FROM ms_cache.{table} ORDER BY ALL").fetchall()
        assert mine == fresh.con.execute(f"SELECT * FROM ms_cache.{table} ORDER BY ALL").fetchall(), table


@pytest.mark.parametrize("compacted", [False, True])
def test_an_extension_reads_the_older_files_that_hold_its_steps(tmp_path: Path, synth: Synth,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 compacted: bool) -> None:
    """Ranks ahead of the others: their parts of the new steps were read by the last report, the
    others' come after it. The extension reads the files that may hold steps from the first new
    one on (by the step ranges kept with the cache), those older parts among them (or, merged by a
    compaction pass since, the compacted file holding them), and answers as a build from scratch."""
    from megascope.analysis import base
    from megascope.compact import compact

    path = synth(tmp_path / "ahead", "straggler:rank=9,factor=1.3", ranks=16, steps=20, tp=2, pp=2, seed=17,
                 gpus_per_host=4)
    _report(path)
    _grow(path, 16, sums=True)
    _report(path)  # step 20 everywhere; the cache now knows each file's steps
    _grow(path, 8, sums=True)  # ranks 0-7 reach step 21
    _report(path)
    read: list[int] = []
    real = base.store.subset_views

    def subset(con: Any, schema: str, root: Path, spans: list[Path], metrics: list[Path], summed: set[Path]) -> None:
        read.append(len(spans))
        real(con, schema, root, spans, metrics, summed)

    monkeypatch.setattr(base.store, "subset_views", subset)
    if compacted:
        assert compact(path, min_age_s=0, keep_newest=0, grace_s=3600).parts_merged > 0
    _grow(path, 16, sums=True, start=8)  # the others reach step 21
    behind = _report(path)
    # The new parts of ranks 8-15 and the step-21 parts of ranks 0-7 (or the one compacted file
    # holding every merged part), not the others.
    assert read == ([9] if compacted else [16])
    monkeypatch.undo()
    assert behind["run"]["steps"] == 22
    assert same_answer(behind, _uncached(path, tmp_path))


def test_parts_merged_by_a_compaction_extend_the_cache(tmp_path: Path, synth: Synth,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A compaction pass of a live run (parts of any age, none of the ranks and groups files; the
    merged parts left for readers a while, their manifest naming them) that merged only parts the
    cache was built from moves rows, it adds none: the next report extends the cache by the new
    steps alone. A pass that merged a part the cache never saw (its rows
    partly new) makes it build again. Both answer as from scratch."""
    from megascope.compact import compact

    path = synth(tmp_path / "merged", "straggler:rank=9,factor=1.3", ranks=16, steps=20, tp=2, pp=2, seed=13,
                 gpus_per_host=4)
    _report(path)
    built = _count_builds(monkeypatch)
    assert compact(path, min_age_s=0, keep_newest=0, grace_s=3600).parts_merged > 0
    _grow(path, 16, sums=True)
    grown = _report(path)
    assert built == []
    assert same_answer(grown, _uncached(path, tmp_path))
    built.clear()  # the copy's build
    # Another pass merges the new parts with the compacted files: the cache saw them all.
    assert compact(path, min_age_s=0, keep_newest=0, grace_s=3600).parts_merged > 0
    _grow(path, 16, sums=True)
    again = _report(path)
    assert built == [] and again["run"]["steps"] == 22
    assert same_answer(again, _uncached(path, tmp_path))
    built.clear()
    # A part merged before any report read it.
    _grow(path, 16, sums=True)
    assert compact(path, min_age_s=0, keep_newest=0, grace_s=3600).parts_merged > 0
    late = _report(path)
    assert built == [1] and late["run"]["steps"] == 23
    monkeypatch.undo()
    assert same_answer(late, _uncached(path, tmp_path))


def test_a_young_run_whose_clocks_moved_is_built_on_the_extensions_estimate(
        run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run of a few steps grows: every step is in the clock sample, the extension estimates the
    clocks again and, where they moved (made so here: a synth run's clocks agree to the
    nanosecond), the tables are built on that estimate, not a second one, as from scratch."""
    from megascope.analysis import base

    _report(run)
    estimated: list[int] = []
    real_estimate = base._estimate_offsets
    monkeypatch.setattr(base, "_estimate_offsets", lambda con, steps: estimated.append(1) or real_estimate(con, steps))
    built = _count_builds(monkeypatch)
    moved: list[str] = []
    real_execute = base._sql.execute

    def execute(con: Any, module: str, name: str, **params: Any) -> Any:
        if name == "moved_clocks":
            moved.append(name)
            return con.execute("SELECT 3 AS ranks")
        return real_execute(con, module, name, **params)

    monkeypatch.setattr(base._sql, "execute", execute)
    _grow(run, 16, sums=True)
    grown = _report(run)
    # Six steps to seven: the sample is every step, so the extension estimated the clocks.
    assert moved == ["moved_clocks"] and built == [1] and estimated == [1]
    monkeypatch.undo()
    assert same_answer(grown, _uncached(run, tmp_path))


def test_new_rows_of_a_sampled_step_estimate_the_clocks_again(tmp_path: Path, synth: Synth,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A new part holding rows of a step the clock estimate sampled (a rank's late part) makes the
    extension estimate the clocks again; its answer is still the one built from scratch."""
    path = synth(tmp_path / "late", "straggler:rank=9,factor=1.3", ranks=16, steps=20, tp=2, pp=2, seed=11,
                 gpus_per_host=4)
    _report(path)
    from megascope.analysis import base
    estimated: list[str] = []
    real_estimate = base._estimate_offsets
    monkeypatch.setattr(base, "_estimate_offsets", lambda con, steps: estimated.append("x") or real_estimate(con, steps))
    _grow(path, 16, sums=True)
    _report(path)
    assert estimated == []
    # Rank 3's compute spans of step 6 (a sampled step), written again 1 ms later as a new part.
    parts = sorted(layout.table_path(path, "spans", rank=3).glob("*.parquet"))
    rows = [r for r in pa.concat_tables([pq.read_table(p) for p in parts]).to_pylist()
            if r["step"] == 6 and r["kind"] == "compute"]
    for r in rows:
        r.update(start_ns=r["start_ns"] + MS, rank=3)
    layout.write_spans_part(path, pa.Table.from_pylist(rows, schema=schema.SPANS), rank=3)
    late = _report(path)
    assert estimated == ["x"]
    monkeypatch.undo()
    assert same_answer(late, _uncached(path, tmp_path))


def test_new_markers_leave_the_cache_as_it_is(run: Path) -> None:
    _report(run)
    key = _key(run)["key"]
    layout.write_part(run, "markers", pa.Table.from_pylist(
        [{"rank": 0, "group": "dp:0", "seq": 99_999, "op": "all_reduce", "state": "enqueued",
          "time_ns": 1, "step": 5, "bytes": None, "peer": None}], schema=schema.MARKERS), rank=0)
    _report(run)
    assert _key(run)["key"] == key


def test_a_removed_part_rebuilds(run: Path, tmp_path: Path) -> None:
    _report(run)
    victim = sorted(layout.table_path(run, "spans", rank=3).glob("*.parquet"))[0]
    victim.unlink()
    assert same_answer(_report(run), _uncached(run, tmp_path))


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage key", "wrong key", "missing file", "other run"])
def test_damaged_or_stale_cache_falls_back(run: Path, tmp_path: Path, synth: Synth, damage: str) -> None:
    first = _report(run)
    where = persist.cache_dir(run)
    key = _key(run)
    target = where / key["tables"]["rank_step"]["file"]
    if damage == "flip":
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x10
        target.write_bytes(bytes(data))
    elif damage == "truncate":
        target.write_bytes(target.read_bytes()[:100])
    elif damage == "garbage key":
        (where / persist.KEY_FILE).write_text("{not json")
    elif damage == "wrong key":
        # A cache whose files are intact but built from other parts (e.g. copied from another run).
        key["key"] = "0" * 64
        (where / persist.KEY_FILE).write_text(json.dumps(key))
    elif damage == "missing file":
        target.unlink()
    else:
        # Another run's rank_step, with a key.json made to describe it: the key itself differs.
        other = synth(tmp_path / "other", ranks=16, steps=6, tp=2, pp=2, seed=9, gpus_per_host=4)
        _report(other)
        shutil.rmtree(where)
        shutil.copytree(persist.cache_dir(other), where)
    assert same_answer(_report(run), first)


def test_tampered_table_with_matching_digest_is_rejected(run: Path) -> None:
    """A file that matches its recorded size and sha256 but not its recorded rows or columns."""
    first = _report(run)
    where = persist.cache_dir(run)
    key = _key(run)
    entry = key["tables"]["rank_step"]
    target = where / entry["file"]
    table = pq.read_table(target)
    pq.write_table(table.slice(0, table.num_rows // 2), target)
    entry["bytes"] = target.stat().st_size
    entry["sha256"] = persist._sha256(target)
    (where / persist.KEY_FILE).write_text(json.dumps(key))
    assert same_answer(_report(run), first)


def test_unwritable_run_still_reports(run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _uncached(run, tmp_path)
    # Wherever the cache would go cannot be created (as on a read-only mount).
    monkeypatch.setattr(persist, "cache_dir", lambda root: Path(root) / "run.json" / "_cache")
    assert same_answer(_report(run), expected)
    assert not (run / persist.CACHE_DIR).exists()
    assert not [p for p in run.iterdir() if p.name.startswith(".tmp-")]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through read-only permissions")
def test_read_only_run_still_reports(run: Path, tmp_path: Path) -> None:
    expected = _uncached(run, tmp_path)
    modes = {}
    for p in [run, *run.rglob("*")]:
        modes[p] = p.stat().st_mode
        p.chmod(p.stat().st_mode & ~0o222)
    try:
        assert same_answer(_report(run), expected)
        assert not (run / persist.CACHE_DIR).exists()
    finally:
        for p, mode in modes.items():
            p.chmod(mode)


def test_cache_off_builds_in_memory_only(run: Path) -> None:
    con = open_run(run).con
    prepare(con, persist_cache=False)
    assert not persist.cache_dir(run).exists()


def test_hand_built_answers_hold_from_the_cache(tmp_path: Path) -> None:
    """A hand-built run (rank 1 arrives 30 ms late at each all-reduce): the second, cached report
    names the same wait as the first."""
    spans = []
    for step in range(3):
        t0 = step * 200 * MS
        for r in range(3):
            late = 30 * MS if r == 1 else 0
            spans.append(span(r, step, "step", t0, 100 * MS))
            spans.append(span(r, step, "forward", t0, 40 * MS + late))
            spans.append(span(r, step, "collective", t0 + 40 * MS + late, 60 * MS - late, group="dp:0", seq=step))
    path = hand_run(tmp_path / "hand", spans, [])
    first = open_run(path)
    prepare(first.con)
    waits = first.con.execute("SELECT rank, sum(wait_ns) FROM ms_cache.rank_step GROUP BY rank ORDER BY rank").fetchall()
    assert waits == [(0, 90 * MS), (1, 0), (2, 90 * MS)]
    second = open_run(path)
    prepare(second.con)
    assert second.con.execute(
        "SELECT rank, sum(wait_ns) FROM ms_cache.rank_step GROUP BY rank ORDER BY rank").fetchall() == waits


def test_an_extension_reads_parts_of_the_schemas_columns_without_reading_each_footer(
        tmp_path: Path, synth: Synth, monkeypatch: pytest.MonkeyPatch) -> None:
    """The views over the files of an extension's steps read parts the store found all of the
    schema's columns without union_by_name (which reads every file's footer at each statement),
    and by name where an older writer's part has fewer; both answer as a build from scratch."""
    from megascope.analysis import base

    path = synth(tmp_path / "uniform", "straggler:rank=5,factor=1.3", ranks=8, steps=14, tp=2, pp=2, seed=23,
                 gpus_per_host=4)
    _report(path)
    views: list[str] = []
    real = base.store.subset_views

    def subset(con: Any, schema: str, root: Path, spans: list[Path], metrics: list[Path], summed: set[Path]) -> None:
        real(con, schema, root, spans, metrics, summed)
        (sql,) = con.execute("SELECT sql FROM duckdb_views() WHERE schema_name = ? AND view_name = 'spans'",
                             [schema]).fetchone()
        views.append(sql)

    monkeypatch.setattr(base.store, "subset_views", subset)
    _grow(path, 8, sums=True)
    grown = _report(path)
    assert len(views) == 1 and "union_by_name" not in views[0]
    assert same_answer(grown, _uncached(path, tmp_path))
    # An older writer: a part of the next step without the nullable columns it did not know, and
    # no run id in its footer.
    store = open_run(path)
    rows = store.con.sql("SELECT * EXCLUDE (microbatch, chunk) FROM spans WHERE rank = 0 AND step = "
                         "(SELECT max(step) FROM spans)").to_arrow_table().to_pylist()
    store.con.close()
    for r in rows:
        r.update(step=r["step"] + 1, start_ns=r["start_ns"] + 1_000 * MS, seq=None if r["seq"] is None else r["seq"] + 10_000)
    older = pa.Table.from_pylist(rows, schema=pa.schema([f for f in schema.SPANS if f.name not in ("microbatch", "chunk")]))
    pq.write_table(older, path / "spans" / layout.rank_dir_name(0) / layout.part_name())
    _grow(path, 8, sums=True, start=1)
    again = _report(path)
    assert len(views) == 2 and "union_by_name" in views[1]
    assert again["run"]["steps"] == grown["run"]["steps"] + 1
    monkeypatch.undo()
    assert same_answer(again, _uncached(path, tmp_path))
