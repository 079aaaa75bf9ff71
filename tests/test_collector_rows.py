"""The collector's rows: plain tuples whose field orders are declared once
(``megascope.collectors.buffers``) and agree with the tables' schemas; a row that does not fit its
table loses only itself, counted as dropped, never the rows written with it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from megascope.collectors import Collector, CollectorConfig
from megascope.collectors.buffers import (
    MARKER_ROW,
    METRIC_ROW,
    PENDING_MARK_ROW,
    PENDING_METRIC_ROW,
    PENDING_SPAN_ROW,
    SPAN_ROW,
    rows_to_table,
    rows_to_table_dropping,
)

from megascope import schema
from megascope.schema import RunMeta, SpanKind
from megascope.store import open_run


def test_row_layouts_are_the_tables_column_orders() -> None:
    assert tuple(schema.SPANS.names) == SPAN_ROW
    assert tuple(schema.MARKERS.names) == MARKER_ROW
    assert tuple(schema.METRICS.names) == METRIC_ROW
    # What waits for the device: the table's columns (under their names) and the device's handles.
    assert set(PENDING_SPAN_ROW) - set(SPAN_ROW) == {"start", "end", "anchor", "wait"}
    assert set(SPAN_ROW) - set(PENDING_SPAN_ROW) == {"rank", "start_ns", "dur_ns"}
    assert [f for f in PENDING_SPAN_ROW if f in SPAN_ROW] == [f for f in SPAN_ROW if f in PENDING_SPAN_ROW]
    assert set(PENDING_MARK_ROW) - set(MARKER_ROW) == {"mark"}
    assert set(PENDING_METRIC_ROW) - set(METRIC_ROW) == {"host_tensor", "mark"}
    for layout in (PENDING_SPAN_ROW, PENDING_MARK_ROW, PENDING_METRIC_ROW):
        assert len(set(layout)) == len(layout)


def _collector(run: Path, **kw: object) -> Collector:
    cfg = CollectorConfig(run_dir=run, flush_interval_s=3600.0, device=torch.device("cpu"), handle_sigterm=False,
                          marker_agent=False, **kw)  # type: ignore[arg-type]
    return Collector(cfg, rank=0, world_size=1, coords={"pp": 0, "dp": 0, "tp": 0},
                     meta=RunMeta(run_id="rows", source="collector", world_size=1))


def test_every_field_of_a_span_and_its_markers_lands_in_its_column(tmp_path: Path) -> None:
    run = tmp_path / "run"
    col = _collector(run)
    with col.step(7):
        with col.span("fwd", kind=SpanKind.FORWARD, microbatch=3, chunk=1):
            pass
        with col.comm("send", group="pp:0", bytes=4096, kind=SpanKind.SEND, peer=5, name="pp.send"):
            pass
        h = col.comm_begin("all_reduce", group="world", bytes=64)
        h.end()
    col.metric("loss", 2.5)
    col.close()
    r = open_run(run)
    spans = {s["name"]: s for s in r.con.sql("SELECT * FROM spans").df().to_dict("records")}
    fwd, send = spans["fwd"], spans["pp.send"]
    assert (fwd["rank"], fwd["step"], fwd["kind"], fwd["stream"], fwd["microbatch"], fwd["chunk"]) == (
        0, 7, "forward", "compute", 3, 1)
    assert (send["kind"], send["stream"], send["group"], send["seq"], send["op"], send["bytes"], send["peer"]) == (
        "send", "comm", "pp:0", 0, "send", 4096, 5)
    assert fwd["start_ns"] > 1e18 and fwd["dur_ns"] >= 0
    markers = r.con.sql("SELECT rank, \"group\", seq, op, state, step, bytes, peer FROM markers "
                        "ORDER BY \"group\", state").fetchall()
    assert markers == [(0, "pp:0", 0, "send", "completed", 7, 4096, 5), (0, "pp:0", 0, "send", "enqueued", 7, 4096, 5),
                       (0, "world", 0, "all_reduce", "completed", 7, 64, None),
                       (0, "world", 0, "all_reduce", "enqueued", 7, 64, None)]
    loss = r.con.sql("SELECT rank, step, name, value FROM metrics WHERE name = 'loss'").fetchall()
    assert loss == [(0, 7, "loss", 2.5)]


def _span(i: int) -> tuple[object, ...]:
    return (0, 1, f"s{i}", "compute", "compute", time.time_ns(), 10, None, None, None, None, None, None, None)


BAD_ROWS: list[Any] = [
    (0, 1, "short"),  # a wrong length
    (0, "one", "x", "compute", "compute", 1, 1, None, None, None, None, None, None, None),  # a wrong type
    (0, 1, None, "compute", "compute", 1, 1, None, None, None, None, None, None, None),  # a null name
    None,  # not a row at all
]


def test_one_row_that_does_not_fit_loses_only_itself() -> None:
    rows: list[Any] = [_span(i) for i in range(1000)]
    for pos, bad in zip((0, 333, 500, 999), BAD_ROWS, strict=True):
        rows[pos] = bad
    table, dropped = rows_to_table_dropping(rows, schema.SPANS)
    assert dropped == 4 and table.num_rows == 996 and table.schema == schema.SPANS
    assert table.column("name").to_pylist() == [r[2] for r in rows if r not in BAD_ROWS]  # order kept
    with pytest.raises(Exception):  # noqa: B017  (the strict form still refuses)
        rows_to_table(rows, schema.SPANS)
    assert rows_to_table_dropping([], schema.SPANS) == (schema.SPANS.empty_table(), 0)
    good = rows_to_table_dropping(rows[1:333], schema.SPANS)
    assert good[1] == 0 and good[0].equals(rows_to_table(rows[1:333], schema.SPANS))


@pytest.mark.parametrize("paced", [False, True])
def test_a_malformed_row_in_the_writer_is_dropped_and_counted(tmp_path: Path, paced: bool) -> None:
    run = tmp_path / "run"
    col = _collector(run)
    n = 600 if paced else 50  # paced: rows taken a chunk of 256 at a time
    for i in range(n):
        col._sink.spans.put(_span(i))
        if i in (10, 300 if paced else 20):
            col._sink.spans.put(BAD_ROWS[1])
    col._sink.metrics.put((0, 1, "loss", "not a number", 1))
    col._sink.metrics.put((0, 1, "loss", 1.5, 1))
    assert col._writer.flush(paced=paced)
    stats = col.stats
    assert stats["rows_dropped"] == 3 and stats["internal_errors"] == 0 and stats["write_errors"] == 0
    col.close()
    r = open_run(run)
    assert r.con.execute("SELECT count(*) FROM spans WHERE name LIKE 's%'").fetchone() == (n,)
    assert r.con.execute("SELECT value FROM metrics WHERE name = 'loss'").fetchall() == [(1.5,)]
    assert col.stats["rows_dropped"] == 3


def test_rows_stay_plain_tuples() -> None:
    """The garbage collector does not track a tuple of atomic values: rows cost it nothing."""
    import gc

    row = _span(0)
    gc.collect()
    assert type(row) is tuple and not gc.is_tracked(row)
    assert isinstance(rows_to_table([row], schema.SPANS), pa.Table)
