"""Which ranks an ``--around-stragglers`` export keeps: the stragglers and the peers they make wait.

Role in the data flow: used by :mod:`megascope.export.selection` only. The stragglers come from
``megascope.analysis.stragglers`` when that analysis is present (its frame's ``rank`` column, worst
first); otherwise from the last-arrival evidence below, which needs nothing but the spans:

* a collective instance is the set of spans sharing ``(group, seq)``; its last arriver (latest
  corrected ``start_ns``) is the rank everyone else waited for, and the wait it inflicted is the sum
  over the others of ``last arrival - their arrival``;
* a rank is a straggler when it arrives last in at least half of its instances, at least 3 times and
  at least twice as often as chance (``sum(1 / group size)``), ranked by the wait it inflicted.

The peers are every rank that shares a collective group with a straggler (the world group aside:
it would keep everyone) plus its point-to-point partners (the pipeline neighbours that wait in
``recv``).
"""

from __future__ import annotations

import logging

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from megascope.store import Run

log = logging.getLogger(__name__)

MAX_STRAGGLERS = 8


def _from_analysis(run: Run) -> list[int] | None:
    try:
        from megascope.analysis import stragglers  # type: ignore[attr-defined]
    except ImportError:
        return None
    try:
        frame = stragglers(run.with_cursor())
        return [int(r) for r in frame["rank"].tolist()][:MAX_STRAGGLERS]
    except Exception as exc:  # an optional helper: fall back to the spans' own evidence
        log.info("megascope.analysis.stragglers unusable here (%s); using last-arrival counts", exc)
        return None


def last_arrivals(run: Run, rank_offsets_ns: npt.NDArray[np.int64]) -> pa.Table:
    """Per rank: instances, times it arrived last, the chance expectation, the wait it inflicted."""
    cur = run.cursor()
    offsets = pa.table({"rank": pa.array(np.arange(len(rank_offsets_ns)), pa.int32()),
                        "offset_ns": pa.array(rank_offsets_ns, pa.int64())})
    cur.register("_export_offsets", offsets)
    return cur.sql(
        """
        WITH arrivals AS (
            SELECT s."group" AS g, s.seq, s.rank, s.start_ns + coalesce(o.offset_ns, 0) AS t
            FROM spans s LEFT JOIN _export_offsets o USING (rank)
            WHERE s.kind = 'collective' AND s."group" IS NOT NULL AND s.seq IS NOT NULL
        ),
        instances AS (
            SELECT g, seq, count(*) AS n, arg_max(rank, t) AS last_rank,
                   (max(t) - avg(t)) * count(*) AS inflicted_ns
            FROM arrivals GROUP BY g, seq HAVING count(*) >= 2
        ),
        per_last AS (
            SELECT last_rank AS rank, count(*) AS n_last, sum(inflicted_ns) AS inflicted_ns
            FROM instances GROUP BY last_rank
        ),
        per_rank AS (
            SELECT a.rank, count(*) AS n_instances, sum(1.0 / i.n) AS expected_last
            FROM arrivals a JOIN instances i USING (g, seq) GROUP BY a.rank
        )
        SELECT p.rank, p.n_instances, coalesce(l.n_last, 0) AS n_last, p.expected_last,
               coalesce(l.inflicted_ns, 0) AS inflicted_ns
        FROM per_rank p LEFT JOIN per_last l USING (rank)
        ORDER BY inflicted_ns DESC, p.rank
        """
    ).to_arrow_table()


def find_stragglers(run: Run, rank_offsets_ns: npt.NDArray[np.int64]) -> list[int]:
    """Straggler ranks, worst first (at most :data:`MAX_STRAGGLERS`)."""
    from_analysis = _from_analysis(run)
    if from_analysis is not None:
        return from_analysis
    table = last_arrivals(run, rank_offsets_ns).to_pylist()
    out = [
        int(row["rank"])
        for row in table
        if row["n_last"] >= 3
        and row["n_last"] >= 0.5 * row["n_instances"]
        and row["n_last"] >= 2 * row["expected_last"]
        and row["inflicted_ns"] > 0
    ]
    return out[:MAX_STRAGGLERS]


def straggler_neighbourhood(run: Run, rank_offsets_ns: npt.NDArray[np.int64]) -> tuple[list[int], set[int]]:
    """``(stragglers, ranks to keep)``: the stragglers and every peer that waited for them."""
    stragglers = find_stragglers(run, rank_offsets_ns)
    if not stragglers:
        log.warning("no stragglers found; --around-stragglers keeps every rank")
        return [], {int(r) for (r,) in run.cursor().execute("SELECT DISTINCT rank FROM spans").fetchall()}
    listed = ", ".join(str(int(r)) for r in stragglers)
    rows = run.cursor().execute(
        f"""
        SELECT DISTINCT rank FROM spans
        WHERE rank IN ({listed})
           OR peer IN ({listed})
           OR "group" IN (SELECT DISTINCT "group" FROM spans
                          WHERE rank IN ({listed}) AND kind = 'collective'
                            AND "group" IS NOT NULL AND "group" <> 'world')
        UNION SELECT DISTINCT peer FROM spans WHERE rank IN ({listed}) AND peer IS NOT NULL
        """
    ).fetchall()
    return stragglers, {int(r) for (r,) in rows if r is not None}
