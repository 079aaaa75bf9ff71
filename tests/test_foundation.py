"""Schema, layout and store: round trips, atomic writes and every bad-input case."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megascope import layout, schema
from megascope.errors import ConfigError, RunDirError, SchemaVersionError
from megascope.inject import parse_inject, parse_injects
from megascope.store import open_run
from megascope.topology import Mesh


def _spans(rank: int, n: int = 3) -> pa.Table:
    rows = [
        {
            "rank": rank, "step": i, "name": "forward", "kind": schema.SpanKind.FORWARD,
            "stream": schema.Stream.COMPUTE, "start_ns": 1_000 * i, "dur_ns": 500,
            "microbatch": None, "chunk": None, "group": None, "seq": None, "op": None,
            "bytes": None, "peer": None,
        }
        for i in range(n)
    ]
    return pa.Table.from_pylist(rows, schema=schema.SPANS)


def make_run(tmp_path: Path, world: int = 4, tp: int = 2) -> Path:
    run = tmp_path / "run"
    mesh = Mesh.for_world(world, tp=tp)
    layout.write_run_meta(run, schema.RunMeta(run_id="t", source=schema.RunSource.SYNTH, world_size=world, mesh_sizes=mesh.size))
    for r in range(world):
        layout.write_part(run, "spans", _spans(r), rank=r)
        c = mesh.coords(r)
        layout.write_part(run, "ranks", pa.Table.from_pylist([{"rank": r, "host": f"h{r // 2}", "coords": c}], schema=schema.RANKS), rank=r)
    return run


def test_schema_round_trip(tmp_path: Path) -> None:
    table = _spans(0)
    path = layout.write_part(tmp_path, "spans", table, rank=0)
    assert pq.read_table(path).cast(schema.SPANS).equals(table)
    meta = schema.RunMeta(run_id="x", source="synth", world_size=8, mesh_sizes={"tp": 2, "pp": 2, "dp": 2})
    assert schema.RunMeta.from_json(json.loads(json.dumps(meta.to_json()))) == meta


def test_run_meta_validates() -> None:
    with pytest.raises(ValueError, match="multiply"):
        schema.RunMeta(run_id="x", source="synth", world_size=8, mesh_sizes={"tp": 3})


def test_open_run_views(tmp_path: Path) -> None:
    run = open_run(make_run(tmp_path))
    assert run.con.execute("SELECT count(*) FROM spans").fetchone() == (12,)
    assert run.con.execute("SELECT typeof(rank) FROM spans LIMIT 1").fetchone() == ("INTEGER",)
    assert run.con.execute("SELECT coords['tp'] FROM ranks WHERE rank = 3").fetchone() == (1,)
    assert run.con.execute("SELECT count(*) FROM markers").fetchone() == (0,)
    assert run.problems == []
    assert run.mesh.size == {"pp": 1, "dp": 2, "tp": 2}


def test_atomic_write_never_shows_half_a_file(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    stop = threading.Event()
    seen_bad: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            for f in run.glob("spans/rank=*/*.parquet"):
                try:
                    pq.read_metadata(f)
                except Exception as exc:  # noqa: BLE001 - any failure is the bug we look for
                    seen_bad.append(f"{f}: {exc}")

    t = threading.Thread(target=reader)
    t.start()
    big = pa.concat_tables([_spans(0, 2000)] * 5)
    for _ in range(20):
        layout.write_part(run, "spans", big, rank=0)
    stop.set()
    t.join()
    assert seen_bad == []
    assert not list(run.glob("**/*.tmp"))


def test_truncated_part_is_skipped_and_named(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    victim = next(run.glob("spans/rank=00001/*.parquet"))
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    opened = open_run(run)
    assert opened.con.execute("SELECT count(*) FROM spans").fetchone() == (9,)
    assert any(str(victim) in p and "not a readable Parquet" in p for p in opened.problems)
    # rank 1 now wrote nothing readable: that is reported too
    assert any("ranks wrote no spans" in p and ": 1" in p for p in opened.problems)


def test_foreign_parquet_is_skipped(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    foreign = run / "spans" / "rank=00002" / "part-foreign.parquet"
    pq.write_table(pa.table({"x": [1, 2]}), foreign)
    opened = open_run(run)
    assert opened.con.execute("SELECT count(*) FROM spans").fetchone() == (12,)
    assert any(str(foreign) in p and "missing columns" in p for p in opened.problems)


def test_not_parquet_at_all_is_skipped(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    junk = run / "spans" / "rank=00000" / "part-junk.parquet"
    junk.write_text("hello")
    opened = open_run(run)
    assert opened.con.execute("SELECT count(*) FROM spans").fetchone() == (12,)
    assert any(str(junk) in p for p in opened.problems)


def test_unknown_schema_version(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    meta = json.loads((run / "run.json").read_text())
    meta["schema_version"] = 99
    (run / "run.json").write_text(json.dumps(meta))
    with pytest.raises(SchemaVersionError, match="schema_version 99"):
        open_run(run)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: None, "no such run directory"),
        (lambda p: p.write_text("x"), "not a directory"),
        (lambda p: p.mkdir(), "no run.json and no data"),
        (lambda p: (p.mkdir(), (p / "run.json").write_text("{not json")), "unreadable"),
        (lambda p: (p.mkdir(), (p / "run.json").write_text("[]")), "expected a JSON object"),
    ],
)
def test_bad_run_dirs(tmp_path: Path, setup, message: str) -> None:  # type: ignore[no-untyped-def]
    target = tmp_path / "r"
    setup(target)
    with pytest.raises(RunDirError, match=message):
        open_run(target)


def test_data_without_run_json(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    os.remove(run / "run.json")
    with pytest.raises(RunDirError, match="missing, though the directory holds data"):
        open_run(run)


def test_run_json_without_data_warns(tmp_path: Path) -> None:
    layout.write_run_meta(tmp_path / "r", schema.RunMeta(run_id="x", source="synth", world_size=2))
    run = open_run(tmp_path / "r")
    assert any("no data written yet" in p for p in run.problems)
    assert run.con.execute("SELECT count(*) FROM spans").fetchone() == (0,)


def test_mesh_coordinates_and_groups() -> None:
    mesh = Mesh.for_world(8, tp=2, pp=2)
    assert mesh.axes == ("pp", "dp", "tp")
    assert mesh.coords(5) == {"pp": 1, "dp": 0, "tp": 1}
    assert all(mesh.rank_of(**mesh.coords(r)) == r for r in range(8))
    tp = mesh.group_of(5, "tp")
    assert tp.members == (4, 5) and tp.id == "tp:2"
    assert mesh.group_of(5, "pp").members == (1, 5)
    assert mesh.group_of(5, "dp").members == (5, 7)
    for axis in ("tp", "pp", "dp"):
        groups = list(mesh.groups(axis))
        assert len(groups) == 4
        assert sorted(r for g in groups for r in g.members) == list(range(8))
    odd = Mesh.from_sizes(tp=3, pp=5, dp=7)
    assert odd.world_size == 105 and odd.coords(104) == {"pp": 4, "dp": 6, "tp": 2}


def test_mesh_rejects_bad_sizes() -> None:
    with pytest.raises(ConfigError, match="does not match world size"):
        Mesh.for_world(8, tp=2, pp=2, dp=3)
    with pytest.raises(ConfigError, match="not divisible"):
        Mesh.for_world(6, tp=4)


def test_inject_grammar() -> None:
    faults = parse_injects(["straggler:rank=5,factor=1.3", "hang:rank=2,step=7", "skew:rank=1,ms=40"])
    assert faults.straggler_factor(5) == 1.3 and faults.straggler_factor(0) == 1.0
    assert faults.hang_step(2) == 7 and faults.skew_ms(1) == 40
    assert parse_inject("straggler:rank=5,factor=1.3").spec() == "straggler:rank=5,factor=1.3"
    for bad, msg in [
        ("slow:rank=1", "unknown fault kind"),
        ("straggler", "expected straggler"),
        ("straggler:rank=1", "missing factor"),
        ("straggler:rank=x,factor=2", "not a valid int"),
        ("straggler:rank=1,factor=0.5", "factor must be > 1"),
        ("hang:rank=1,step=2,foo=3", "unknown parameter"),
    ]:
        with pytest.raises(ConfigError, match=msg):
            parse_inject(bad)
    with pytest.raises(ConfigError, match="outside a job of 4"):
        parse_injects(["hang:rank=9,step=1"]).validate(4)
    # A crash and a kill are faults of a process: their steps are asked for by name, never read
    # as a hang's.
    process = parse_injects(["crash:rank=1,step=3", "kill:rank=2,step=4"])
    assert process.hang_step(1) is None and process.hang_step(1, ("crash",)) == 3
    assert process.hang_step(2, ("kill",)) == 4 and process.specs() == ["crash:rank=1,step=3", "kill:rank=2,step=4"]
    with pytest.raises(ConfigError, match="missing step"):
        parse_inject("kill:rank=1")
    with pytest.raises(ConfigError, match="past the last step"):
        parse_injects(["crash:rank=0,step=5"]).validate(2, steps=5)


def test_new_parts_show_without_refresh_and_change_the_parts_view(tmp_path: Path) -> None:
    """Views read through globs when every part is good; ``store_parts`` tells what was seen."""
    run_dir = make_run(tmp_path)
    run = open_run(run_dir)
    before = run.con.execute("SELECT digest, spans FROM store_parts").fetchone()
    layout.write_part(run_dir, "spans", _spans(0, 2), rank=0)
    assert run.con.execute("SELECT count(*) FROM spans").fetchone() == (14,)  # live data, no refresh
    run.refresh()
    after = run.con.execute("SELECT digest, spans FROM store_parts").fetchone()
    assert after[1] == before[1] + 1 and after[0] != before[0]
