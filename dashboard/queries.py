"""Raw-data selections the pages show as they are: spans of a few ranks, loss, heartbeats, diagnostics.

Role in the data flow: the dashboard's only SQL. Derived numbers (MFU, stragglers, states, hang
suspects, heat-maps) come from :mod:`megascope.analysis`; this module only *selects* rows for a
timeline or a table, bounded in size (``LIMIT``, binning), so nothing ships a full run to the
browser. Functions about a few ranks take the :class:`~megascope.store.Run` and read only the
files that hold those ranks, through :meth:`~megascope.store.Run.rank_source`: binding a view
over the ~100k parts of a 12,288-rank run costs seconds per query, reading four parts costs
milliseconds. Run-wide selections take a connection with the store's views. This module builds no
``read_parquet`` of its own: the store is the only way into a run directory.

Example::

    spans = timeline_spans(run, ranks=[4, 5], steps=(3, 3), offsets=offsets_frame)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import duckdb
import pandas as pd

from megascope.store import Run
from megascope.topology import format_coords

log = logging.getLogger(__name__)

MAX_TIMELINE_SPANS = 20_000
MAX_TIMELINE_RANKS = 64

def _int_list(values: Sequence[int]) -> str:
    return ", ".join(str(int(v)) for v in values) or "NULL"


def _with_offsets(con: duckdb.DuckDBPyConnection, offsets: pd.DataFrame | None) -> str:
    """Register per-host clock offsets as ``_dash_offsets`` and return the SQL expression name."""
    frame = offsets if offsets is not None and len(offsets) else pd.DataFrame({"host": pd.Series([], dtype=str),
                                                                                "offset_ns": pd.Series([], dtype="int64")})
    con.register("_dash_offsets", frame[["host", "offset_ns"]])
    return "_dash_offsets"


def rank_info(run: Run, ranks: Sequence[int] | None = None) -> pd.DataFrame:
    """``rank, host, coords`` of the given ranks (all ranks when None), by rank; ``coords`` holds
    every axis of the mesh (axis -> index)."""
    source = run.rank_source("ranks", ranks) if ranks is not None else "ranks"
    return run.con.execute(f"SELECT rank, host, coords FROM {source} ORDER BY rank").df()


def rank_label(row: pd.Series, axes: Sequence[str] = ()) -> str:
    """``"r5 pp0 dp1 tp1"``: a rank as the timeline's y axis names it (``axes``: the run's order)."""
    return f"r{int(row['rank'])} {format_coords(row.get('coords'), axes)}".strip()


def peers_of(run: Run, rank: int, *, limit: int = 8) -> list[int]:
    """``rank`` first, then its tensor-parallel group, then data-parallel peers doing the same work."""
    rows = run.con.execute(
        f"""
        SELECT kind, members FROM {run.rank_source("groups", [rank])}
        WHERE rank = {int(rank)} AND kind IN ('tp', 'dp')
        ORDER BY CASE kind WHEN 'tp' THEN 0 ELSE 1 END
        """
    ).fetchall()
    chosen = [int(rank)]
    for _kind, members in rows:
        for member in members:
            if member not in chosen:
                chosen.append(int(member))
    if len(chosen) == 1:
        # No groups table (an importer without one): fall back to ranks of the same pipeline stage.
        same_stage = run.con.execute(
            """
            SELECT r.rank FROM ranks r, (SELECT coords['pp'] AS pp FROM ranks WHERE rank = ?) me
            WHERE r.coords['pp'] IS NOT DISTINCT FROM me.pp AND r.rank <> ? ORDER BY abs(r.rank - ?) LIMIT ?
            """,
            [int(rank), int(rank), int(rank), limit - 1],
        ).fetchall()
        chosen += [int(r) for (r,) in same_stage]
    return chosen[:limit]


def step_range(con: duckdb.DuckDBPyConnection) -> tuple[int, int] | None:
    """First and last step with any span, or None for a run without steps yet."""
    # fetchall, not fetchone: DuckDB keeps a half-read result open and refuses the next statement.
    (row,) = con.execute("SELECT min(step), max(step) FROM spans WHERE step IS NOT NULL").fetchall()
    if row[0] is None:
        return None
    return int(row[0]), int(row[1])


def last_step_of(run: Run, rank: int) -> int | None:
    """The last step ``rank`` wrote a span or marker for (only its own files are read)."""
    ((last,),) = run.con.execute(
        f"SELECT max(step) FROM (SELECT max(step) AS step FROM {run.rank_source('spans', [rank])} "
        f"UNION ALL SELECT max(step) FROM {run.rank_source('markers', [rank])})"
    ).fetchall()
    return int(last) if last is not None else None


def timeline_spans(
    run: Run,
    *,
    ranks: Sequence[int],
    steps: tuple[int, int],
    offsets: pd.DataFrame | None = None,
    max_spans: int = MAX_TIMELINE_SPANS,
) -> pd.DataFrame:
    """Spans of ``ranks`` in steps ``steps[0]..steps[1]`` on the reference clock, with their waits.

    ``wait_ns`` of a communication span is how long the rank waited for the last member of its
    collective instance (same group and seq) or for its p2p partner (same sender, receiver, seq) to
    arrive: the part of the span that is someone else's lateness. Members outside the selection
    count too (their arrival is read, not drawn), except for the world group, whose members are
    everyone. Columns: rank, step, name, kind, stream, start_ns, dur_ns, wait_ns, microbatch,
    group, seq, op, peer; ordered by rank and start; at most ``max_spans`` rows.
    """
    con = run.con
    ranks = sorted({int(r) for r in ranks})[:MAX_TIMELINE_RANKS]
    first, last = int(steps[0]), int(steps[1])
    rank_list = _int_list(ranks)
    # The ranks whose arrival decides the selected ranks' waits: their groups' members, their p2p peers.
    related = sorted({int(r) for (r,) in con.execute(
        f"""
        SELECT DISTINCT unnest(members) FROM {run.rank_source("groups", ranks)} WHERE kind <> 'world'
        UNION SELECT DISTINCT peer FROM {run.rank_source("spans", ranks)}
        WHERE peer IS NOT NULL AND step BETWEEN {first} AND {last}
        """
    ).fetchall() if r is not None} | set(ranks))
    offsets_view = _with_offsets(con, offsets)
    try:
        return con.execute(
            f"""
            WITH
            shifted AS (
                SELECT s.*, s.start_ns + coalesce(o.offset_ns, 0) AS t_ns,
                       CASE WHEN s.kind = 'collective' THEN s."group" || '#' || s.seq
                            WHEN s.kind = 'send' THEN 'p2p:' || s.rank || '>' || s.peer || '#' || s.seq
                            WHEN s.kind = 'recv' THEN 'p2p:' || s.peer || '>' || s.rank || '#' || s.seq
                       END AS instance
                FROM {run.rank_source("spans", related)} s
                JOIN {run.rank_source("ranks", related)} r ON r.rank = s.rank
                LEFT JOIN {offsets_view} o ON o.host = r.host
                WHERE s.step BETWEEN {first} AND {last}
            ),
            last_arrival AS (
                SELECT instance, max(t_ns) AS last_ns FROM shifted WHERE instance IS NOT NULL GROUP BY instance
            )
            SELECT s.rank, s.step, s.name, s.kind, s.stream, s.t_ns AS start_ns, s.dur_ns,
                   CASE WHEN s.instance IS NOT NULL
                        THEN greatest(0, least(l.last_ns - s.t_ns, s.dur_ns)) END AS wait_ns,
                   s.microbatch, s."group", s.seq, s.op, s.peer
            FROM shifted s LEFT JOIN last_arrival l USING (instance)
            WHERE s.rank IN ({rank_list}) AND s.kind <> 'step'
            ORDER BY s.rank, s.t_ns
            LIMIT {int(max_spans)}
            """
        ).df()
    finally:
        con.unregister(offsets_view)


def step_spans(run: Run, *, ranks: Sequence[int], steps: tuple[int, int],
               offsets: pd.DataFrame | None = None) -> pd.DataFrame:
    """The whole-step spans (kind ``step``) of the selection, on the reference clock."""
    offsets_view = _with_offsets(run.con, offsets)
    try:
        return run.con.execute(
            f"""
            SELECT s.rank, s.step, s.start_ns + coalesce(o.offset_ns, 0) AS start_ns, s.dur_ns
            FROM {run.rank_source("spans", ranks)} s JOIN {run.rank_source("ranks", ranks)} r ON r.rank = s.rank
            LEFT JOIN {offsets_view} o ON o.host = r.host
            WHERE s.kind = 'step' AND s.step BETWEEN ? AND ?
            ORDER BY s.rank, s.step
            """,
            [int(steps[0]), int(steps[1])],
        ).df()
    finally:
        run.con.unregister(offsets_view)


def metric_per_step(con: duckdb.DuckDBPyConnection, name: str) -> pd.DataFrame:
    """``step, value``: the mean over ranks that logged metric ``name`` (loss: the last stage)."""
    return con.execute(
        "SELECT step, avg(value) AS value FROM metrics WHERE name = ? AND value IS NOT NULL GROUP BY step ORDER BY step",
        [name],
    ).df()


def heartbeat_metrics(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Numeric heartbeat metrics present in the run, by name."""
    rows = con.execute(
        "SELECT DISTINCT metric FROM heartbeats WHERE value IS NOT NULL ORDER BY metric"
    ).fetchall()
    return [m for (m,) in rows]


def heartbeat_series(con: duckdb.DuckDBPyConnection, metric: str, *, max_points: int = 400,
                     max_hosts: int = 32) -> pd.DataFrame:
    """``host, time_ns, value``: metric ``metric`` averaged per line into at most ``max_points`` bins.

    A line is a host, or for a metric of a device (a GPU's clock, temperature, utilization) a host's
    device (``host`` then reads "node7 gpu3"): one slow GPU of eight averaged into its host's line
    would move it by an eighth. Past ``max_hosts`` lines only the extremes are kept (lowest and
    highest mean): a person reads the outliers, not a thousand lines.
    """
    return con.execute(
        """
        WITH src AS (SELECT CASE WHEN device IS NULL THEN host ELSE host || ' ' || device END AS line,
                            time_ns, value
                     FROM heartbeats WHERE metric = ? AND value IS NOT NULL),
        span AS (SELECT min(time_ns) AS t0, greatest(max(time_ns) - min(time_ns), 1) AS width FROM src),
        per_line AS (SELECT line, avg(value) AS mean FROM src GROUP BY line),
        ranked AS (SELECT line, row_number() OVER (ORDER BY mean, line) AS lo,
                          row_number() OVER (ORDER BY mean DESC, line) AS hi FROM per_line),
        chosen AS (SELECT line FROM ranked WHERE lo <= ? OR hi <= ?)
        SELECT s.line AS host,
               min(s.time_ns) AS time_ns,
               avg(s.value) AS value
        FROM src s, span
        WHERE s.line IN (SELECT line FROM chosen)
        GROUP BY s.line, floor((s.time_ns - span.t0) * ? / span.width)
        ORDER BY s.line, time_ns
        """,
        [metric, max_hosts // 2, max_hosts - max_hosts // 2, max_points - 1],
    ).df()


def host_summary(con: duckdb.DuckDBPyConnection, *, limit: int = 200) -> pd.DataFrame:
    """Per host: last heartbeat, seconds silent against the newest heartbeat of the run, samples.

    Silent hosts first: at 3 a.m. the host that stopped talking is the one to look at.
    """
    return con.execute(
        """
        WITH last AS (SELECT max(time_ns) AS newest FROM heartbeats)
        SELECT host, count(*) AS samples,
               strftime(make_timestamp(max(time_ns) // 1000), '%Y-%m-%d %H:%M:%S') AS last_seen_utc,
               round((last.newest - max(time_ns)) / 1e9, 1) AS silent_s,
               count(DISTINCT rank) AS ranks
        FROM heartbeats, last
        GROUP BY host, last.newest
        ORDER BY silent_s DESC, host
        LIMIT ?
        """,
        [limit],
    ).df()


def recent_logs(con: duckdb.DuckDBPyConnection, *, limit: int = 50) -> pd.DataFrame:
    """The newest text lines of the heartbeats (log tails, error strings)."""
    return con.execute(
        """
        SELECT strftime(make_timestamp(time_ns // 1000), '%H:%M:%S') AS time_utc, host, rank, metric, text
        FROM heartbeats WHERE text IS NOT NULL ORDER BY time_ns DESC LIMIT ?
        """,
        [limit],
    ).df()


def diagnostics_rows(con: duckdb.DuckDBPyConnection, *, limit: int = 500) -> pd.DataFrame:
    """Self-test results, failures and outliers first."""
    return con.execute(
        """
        SELECT host, rank, test, "group", value, unit, ok, outlier, detail FROM diagnostics
        ORDER BY (ok IS NOT DISTINCT FROM false) DESC, outlier DESC NULLS LAST, test, rank
        LIMIT ?
        """,
        [limit],
    ).df()
