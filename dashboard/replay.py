"""Write a finished run again, step by step, as a live job would: for demos and live-update tests.

Role in the data flow: a writer (like the collector), reading a finished run directory through the
store and writing its rows into a new run directory one step at a time, through
:func:`megascope.layout.write_part`, with every time shifted so the replayed job runs *now*.
``megascope demo`` uses it when the bundled trainer is not available; the dashboard's tests use it
to check that new steps appear without reloading the page.

Example::

    stop = threading.Event()
    replay_run("runs/synth-8", "runs/live", step_interval_s=1.0, stop=stop)
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from megascope import layout
from megascope.errors import RunDirError
from megascope.schema import RunMeta
from megascope.store import open_run

log = logging.getLogger(__name__)

# Time columns of each replayed table (shifted by the same amount).
_TIME_COLUMNS = {"spans": ("start_ns",), "markers": ("time_ns",), "metrics": ("time_ns",),
                 "ranks": ("started_at_ns",)}


def _shift(table: pa.Table, name: str, shift_ns: int) -> pa.Table:
    for column in _TIME_COLUMNS.get(name, ()):
        if column in table.column_names:
            index = table.column_names.index(column)
            table = table.set_column(index, column, pc.add(table[column], pa.scalar(shift_ns, pa.int64())))
    return table


def _write_by_rank(dst: Path, name: str, table: pa.Table) -> None:
    if table.num_rows == 0:
        return
    ranks = pc.unique(table["rank"]).to_pylist()
    for rank in sorted(ranks):
        part = table.filter(pc.equal(table["rank"], rank))
        layout.write_part(dst, name, part, rank=rank)


def replay_run(src: Path | str, dst: Path | str, *, step_interval_s: float = 1.0,
               stop: threading.Event | None = None, max_steps: int | None = None) -> int:
    """Copy ``src`` into ``dst`` step by step; return the number of steps written.

    ``dst`` must not hold a run already. ``stop`` ends the replay between steps.
    """
    src, dst = Path(src), Path(dst)
    if (dst / layout.RUN_JSON).exists():
        raise RunDirError(f"{dst}: already holds a run; replay into an empty directory")
    stop = stop or threading.Event()
    run = open_run(src)
    con = run.con
    (first,) = con.execute("SELECT min(start_ns) FROM spans").fetchall()
    if first[0] is None:
        raise RunDirError(f"{src}: no spans to replay")
    shift_ns = time.time_ns() - int(first[0])
    meta_json = run.meta.to_json()
    meta_json["start_ns"] = (run.meta.start_ns or int(first[0])) + shift_ns
    meta_json["run_id"] = f"{run.meta.run_id}-live"
    layout.write_run_meta(dst, RunMeta.from_json(meta_json))
    for name in ("ranks", "groups"):
        _write_by_rank(dst, name, _shift(con.sql(f"SELECT * FROM {name}").to_arrow_table(), name, shift_ns))
    steps = [s for (s,) in con.execute("SELECT DISTINCT step FROM spans WHERE step IS NOT NULL ORDER BY step").fetchall()]
    if max_steps is not None:
        steps = steps[:max_steps]
    written = 0
    for i, step in enumerate(steps):
        if stop.is_set():
            break
        # Rows outside any step go out with the first one.
        where = "step = ?" if i else "(step = ? OR step IS NULL)"
        for name in ("spans", "markers", "metrics"):
            rows = con.sql(f"SELECT * FROM {name} WHERE {where} ORDER BY rank", params=[step]).to_arrow_table()
            _write_by_rank(dst, name, _shift(rows, name, shift_ns))
        written += 1
        log.debug("replayed step %d into %s", step, dst)
        if i + 1 < len(steps) and stop.wait(step_interval_s):
            break
    con.close()
    return written
