"""The spans files' sums (step_sums): what every writer writes beside its spans, and the analysis'
base tables built from them, identical to those built from the spans, with every twin, some or none."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from conftest import Synth, same_answer

from megascope import analysis, layout, schema
from megascope.analysis.base import _sums_source, prepare
from megascope.schema import SPANS
from megascope.stepsums import step_sums
from megascope.store import open_run

# The lvl CTE of sql/base.sql's rank_step, over a table of spans, and the same from sums: the
# two the analysis combines.
_FROM_SPANS = """
SELECT rank, step, CASE WHEN kind = 'collective' THEN "group" END AS grp,
       max(dur_ns) FILTER (WHERE kind = 'step'), min(start_ns) FILTER (WHERE kind = 'step'),
       min(start_ns), max(start_ns + dur_ns),
       sum(dur_ns) FILTER (WHERE kind = 'forward'), sum(dur_ns) FILTER (WHERE kind = 'backward'),
       sum(dur_ns) FILTER (WHERE kind IN ('forward', 'backward') AND name IN ('forward', 'backward')),
       sum(dur_ns) FILTER (WHERE kind = 'host'), sum(dur_ns) FILTER (WHERE kind = 'host' AND starts_with(name, 'gc.')),
       sum(dur_ns) FILTER (WHERE kind = 'collective'), sum(dur_ns) FILTER (WHERE kind = 'recv'),
       sum(start_ns) FILTER (WHERE kind = 'collective'), count(*) FILTER (WHERE kind = 'collective'),
       count(*) FILTER (WHERE kind = 'collective' AND op IN ('all_reduce', 'reduce_scatter')),
       count(*) FILTER (WHERE kind = 'other' AND ends_with(name, ':wait') AND op IN ('all_reduce', 'reduce_scatter')
                        AND NOT starts_with(stream, 'cuda:')),
       min(start_ns) FILTER (WHERE kind = 'backward' AND name = 'backward'),
       max(start_ns + dur_ns) FILTER (WHERE kind = 'backward' AND name = 'backward'),
       count(*) FILTER (WHERE kind = 'collective' AND op IN ('all_reduce', 'reduce_scatter') AND starts_with(stream, 'cuda:')),
       sum(start_ns) FILTER (WHERE kind = 'collective' AND op IN ('all_reduce', 'reduce_scatter')),
       min(start_ns) FILTER (WHERE kind = 'collective' AND op IN ('all_reduce', 'reduce_scatter')),
       max(start_ns + dur_ns) FILTER (WHERE kind = 'collective' AND op IN ('all_reduce', 'reduce_scatter'))
FROM spans_t WHERE step IS NOT NULL GROUP BY ALL
"""
_FROM_SUMS = """
SELECT rank, step, "group" AS grp, max(step_ns), min(step_start_ns), min(first_start_ns), max(last_end_ns),
       sum(forward_ns), sum(backward_ns), sum(top_compute_ns), sum(host_ns), sum(gc_ns), sum(coll_ns), sum(recv_ns),
       sum(arrival_rel_ns::HUGEINT + coll_spans::HUGEINT * first_start_ns), sum(coll_spans)::BIGINT,
       sum(reduce_spans)::BIGINT, sum(wait_spans)::BIGINT, min(backward_start_ns), max(backward_end_ns),
       sum(reduce_side_spans)::BIGINT, sum(reduce_arrival_rel_ns::HUGEINT + reduce_spans::HUGEINT * first_start_ns),
       min(reduce_first_ns), max(reduce_last_ns)
FROM sums_t GROUP BY ALL
"""


def _spans(rng: random.Random, n: int) -> pa.Table:
    """Spans of every kind on 3 ranks, 3 steps (and none), 2 groups, starts near today's epoch."""
    kinds = [k.value for k in schema.SpanKind]
    rows = []
    for _ in range(n):
        kind = rng.choice(kinds)
        name = rng.choice([kind, "layers.1", "gc.gen2", "x", "dp.all_reduce:wait"])
        rows.append({"rank": rng.randrange(3), "step": rng.choice([0, 1, 2, None]), "name": name, "kind": kind,
                     "stream": rng.choice(["host", "comm", "cuda:7"]),
                     "start_ns": 1_790_000_000_000_000_000 + rng.randrange(10**9),
                     "dur_ns": rng.randrange(10**6),
                     "group": rng.choice(["tp:0", "dp:1", None]) if kind in ("collective", "send") else None,
                     # Wait spans carry their call's op and stream: those of gradient reductions issued on
                     # the caller's stream alone are counted.
                     "op": rng.choice(["all_reduce", "reduce_scatter", "all_gather", None])
                     if kind in ("collective", "other") else None})
    return pa.Table.from_pylist(rows, schema=SPANS)


def _diff(con: Any, a: str, b: str) -> int:
    return int(con.execute(f"SELECT count(*) FROM (({a}) EXCEPT ALL ({b})) UNION ALL "
                           f"SELECT count(*) FROM (({b}) EXCEPT ALL ({a}))").fetchall()[0][0])


@pytest.mark.parametrize("seed", [1, 2])
def test_sums_of_any_split_combine_into_the_aggregation_of_the_whole(seed: int) -> None:
    import duckdb

    rng = random.Random(seed)
    spans = _spans(rng, 600)
    cuts = sorted(rng.sample(range(1, spans.num_rows), 5))
    pieces = [spans.slice(lo, hi - lo) for lo, hi in zip([0, *cuts], [*cuts, spans.num_rows], strict=True)]
    sums = pa.concat_tables([step_sums(p) for p in pieces])
    assert sums.schema == schema.STEP_SUMS
    con = duckdb.connect()
    con.register("spans_t", spans)
    con.register("sums_t", sums)
    assert con.execute("SELECT count(*) FROM (" + _FROM_SPANS + ")").fetchone()[0] > 10
    assert _diff(con, _FROM_SPANS, _FROM_SUMS) == 0
    # Nulls as SQL's FILTER gives them: a (rank, step, group) without step spans has no step time.
    assert con.execute("SELECT count(*) FROM sums_t WHERE step_ns IS NULL").fetchone()[0] > 0
    assert step_sums(spans.filter(pc.is_null(spans.column("step")))).num_rows == 0


def _rank_step(path: Path) -> tuple[pa.Table, tuple[str, str]]:
    run = open_run(path)
    prepare(run.con, persist_cache=False)
    table = run.con.sql("SELECT * FROM ms_cache.rank_step ORDER BY rank, step").to_arrow_table()
    return table, _sums_source(run.con)


def _report(path: Path) -> dict[str, Any]:
    result = analysis.report(open_run(path))
    result.pop("state")  # ages against the wall clock
    result.pop("run")  # its path
    return result


def _copies(path: Path, tmp: Path) -> dict[str, Path]:
    """The run three ways: every twin, none, and every other twin removed."""
    none, some = tmp / "none", tmp / "some"
    for dest in (none, some):
        shutil.copytree(path, dest, ignore=shutil.ignore_patterns("_cache"))
    shutil.rmtree(none / layout.STEP_SUMS_DIR)
    twins = sorted(some.glob(layout.sums_glob()))
    assert len(twins) >= 4
    for twin in twins[::2]:
        twin.unlink()
    return {"all": path, "none": none, "some": some}


def _check_same_answers(path: Path, tmp: Path) -> None:
    spans = sorted(path.glob(layout.table_glob("spans")))
    assert spans and all(layout.sums_twin(f).is_file() for f in spans)
    runs = _copies(path, tmp)
    tables = {name: _rank_step(p) for name, p in runs.items()}
    assert tables["all"][1] == ("spans", "sums_lvl")
    assert tables["none"][1] == ("spans", "spans_lvl")
    assert tables["some"][1] == ("spans_unsummed", "both_lvl")
    assert tables["all"][0].num_rows > 0
    assert tables["all"][0].equals(tables["none"][0])
    assert tables["some"][0].equals(tables["none"][0])
    reports = {name: _report(p) for name, p in runs.items()}
    assert same_answer(reports["all"], reports["none"]) and same_answer(reports["some"], reports["none"])


@pytest.mark.dist
def test_a_gloo_run_of_the_trainer_gives_the_same_tables_from_its_sums(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from megascope.inject import parse_injects
    from megascope.trainer import ModelConfig, TrainConfig, train

    # Flushes every 0.2 s: steps cross parts, so one (rank, step, group) has rows in several twins.
    cfg = TrainConfig(out=tmp_path / "run", world_size=8, tp=2, pp=2, dp=2, steps=4, global_batch=8, micro_batches=2,
                      model=ModelConfig(layers=2, hidden=32, heads=4, vocab=64, seq_len=16), collective_timeout_s=30.0,
                      peak_flops=1e9, flush_interval_s=0.2, faults=parse_injects(["straggler:rank=5,factor=3"]))
    path = train(cfg, nproc=8).out
    sums = pa.concat_tables([pq.read_table(f) for f in path.glob(layout.sums_glob())])
    split = sums.group_by(["rank", "step", "group"]).aggregate([("spans", "count")])
    assert pc.max(split.column("spans_count")).as_py() > 1
    _check_same_answers(path, tmp_path)
    _check_compacted_splits(path, tmp_path, monkeypatch)


def _check_compacted_splits(path: Path, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compacted files of a few hundred rows cut ranks in two, so a step that crossed a flush has
    a row in two files' sums: they are looked for only among the ranks where two files' rank and
    step ranges overlap, and the table is the one summed from the spans."""
    from megascope import compact as compact_module
    from megascope.analysis.base import _split_filter

    dest = tmp / "compacted"
    shutil.copytree(path, dest, ignore=shutil.ignore_patterns("_cache"))
    monkeypatch.setattr(compact_module, "FILE_ROWS", 400)
    compact_module.compact(dest, everything=True, min_age_s=0.0, keep_newest=0)
    twins = sorted((dest / layout.COMPACTED_DIR / layout.STEP_SUMS_DIR).glob("*.parquet"))
    assert len(twins) >= 2 and not list(dest.glob(layout.sums_glob()))
    sums = pa.concat_tables([pq.read_table(f) for f in twins])
    split = sums.group_by(["rank", "step", "group"]).aggregate([("spans", "count")]).filter(
        pc.field("spans_count") > 1)
    assert split.num_rows > 0
    where = _split_filter(open_run(dest).con)
    assert where.startswith("(s.rank BETWEEN")
    searched = {int(r) for (r,) in open_run(dest).con.execute(
        f"SELECT DISTINCT rank FROM step_sums s WHERE {where}").fetchall()}
    assert set(split.column("rank").to_pylist()) <= searched
    summed, source = _rank_step(dest)
    assert source == ("spans", "sums_lvl")
    assert summed.equals(_rank_step(tmp / "none")[0])


def test_a_synth_run_gives_the_same_tables_from_its_sums(synth: Synth, tmp_path: Path) -> None:
    path = synth(tmp_path / "run", "straggler:rank=5,factor=1.3", ranks=16, steps=6, tp=2, pp=2, seed=5,
                 gpus_per_host=4, chunk_rows=1500)
    _check_same_answers(path, tmp_path)


def test_twins_without_their_spans_or_damaged_are_not_read(synth: Synth, tmp_path: Path) -> None:
    path = synth(tmp_path / "run", ranks=8, steps=4, tp=2, pp=2, seed=3, gpus_per_host=4)
    expected, _ = _rank_step(path)
    spans = sorted(path.glob(layout.table_glob("spans")))
    # A twin whose spans part is gone (removed, or merged by compaction): never read.
    spans[1].unlink()
    run = open_run(path)
    assert layout.sums_twin(spans[1]) not in run.files["step_sums"]
    assert len(run.files["step_sums"]) == len(spans) - 1 and run.files["spans_unsummed"] == []
    counted = run.con.execute("SELECT (SELECT sum(spans) FROM step_sums), (SELECT count(step) FROM spans)").fetchone()
    assert counted[0] == counted[1]
    # Damaged twins: the spans are summed instead, the same table. Found by the query (a later
    # file), or already while the view is made (the file DuckDB takes the columns from).
    shutil.rmtree(path / layout.STEP_SUMS_DIR / spans[1].parent.name)
    spans[1].parent.rename(tmp_path / "kept")  # every other rank whole, so the two builds compare
    none = tmp_path / "none"
    shutil.copytree(path, none)
    shutil.rmtree(none / layout.STEP_SUMS_DIR)
    from_spans, source = _rank_step(none)
    assert source == ("spans", "spans_lvl") and from_spans.num_rows < expected.num_rows
    for damaged, read_as in ((spans[-1], ("spans", "sums_lvl")), (spans[0], ("spans", "spans_lvl"))):
        layout.sums_twin(damaged).write_bytes(b"PAR1 not a parquet file")
        rebuilt, source = _rank_step(path)
        assert source == read_as and rebuilt.equals(from_spans)


def test_the_sums_read_count_in_the_cache_key(synth: Synth, tmp_path: Path) -> None:
    """Deleting a twin changes what the base tables are read from: the cache is rebuilt, the answer
    the same."""
    path = synth(tmp_path / "run", ranks=8, steps=4, tp=2, pp=2, seed=3, gpus_per_host=4)
    first = _report(path)
    key = json.loads((path / "_cache" / "key.json").read_text())["key"]
    next(path.glob(layout.sums_glob())).unlink()
    assert same_answer(_report(path), first)
    assert json.loads((path / "_cache" / "key.json").read_text())["key"] != key


def test_a_kineto_ingest_writes_the_sums_of_its_spans(tmp_path: Path) -> None:
    from ingest_fixtures import gpu_trace, write_trace

    from megascope.ingest import ingest_kineto

    src = tmp_path / "src"
    src.mkdir()
    for rank in range(3):
        write_trace(src / f"rank{rank}.pt.trace.json", gpu_trace(rank, 3, slow_rank=1))
    ingest_kineto(src, tmp_path / "run", workers=1)
    spans = sorted((tmp_path / "run").glob(layout.table_glob("spans")))
    assert len(spans) == 3 and all(layout.sums_twin(f).is_file() for f in spans)
    none = tmp_path / "none"
    shutil.copytree(tmp_path / "run", none)
    shutil.rmtree(none / layout.STEP_SUMS_DIR)
    with_sums, source = _rank_step(tmp_path / "run")
    assert source == ("spans", "sums_lvl") and with_sums.num_rows > 0
    assert with_sums.equals(_rank_step(none)[0])


def test_the_search_for_split_sums_reads_every_row_of_a_run_of_parts(synth: Synth, tmp_path: Path) -> None:
    from megascope.analysis.base import _split_filter

    path = synth(tmp_path / "run", ranks=8, steps=4, tp=2, pp=2, seed=3)
    assert _split_filter(open_run(path).con) == "true"
    compact_run = tmp_path / "compacted"
    shutil.copytree(path, compact_run)
    from megascope.compact import compact

    compact(compact_run, everything=True, min_age_s=0.0, keep_newest=0)
    # One compacted file: no two files to split a rank-step between.
    assert _split_filter(open_run(compact_run).con) == "false"
