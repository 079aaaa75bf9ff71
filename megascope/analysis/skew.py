"""Collective arrival skew and its drift: the MegaScale case where MFU leaked away because some
ranks reached the reduce-scatter later and later (GC, CPU work between steps).

Role in the data flow: thin functions over ``sql/skew.sql`` and the base tables (arrivals are on
the reference clock, clock offsets applied); the report's ``skew`` section and the dashboard use
them.

Example::

    from megascope.analysis import skew, skew_drift
    skew(run, group_kind="dp").nlargest(5, "spread_ns")
    skew_drift(run)["drifting"]
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from megascope.analysis import _sql
from megascope.analysis.base import prepare
from megascope.errors import ConfigError
from megascope.schema import GroupKind
from megascope.store import Run

GROUP_KINDS = tuple(str(k) for k in GroupKind)
MIN_DRIFT_STEPS = 8
MIN_R2 = 0.5


def skew(run: Run, *, group_kind: str | None = None, limit: int | None = None) -> pd.DataFrame:
    """Per collective instance: group, seq, step, name, op, group_kind, n, spread_ns (arrival
    spread), last_late_ns (last minus median arrival), xfer_ns, last_rank and its host and coordinates
    (last_coords, every axis; last_pp, last_dp, last_tp).

    At 12k ranks there are millions of instances: filter by ``group_kind`` or ``limit`` them.
    """
    if group_kind is not None and group_kind not in GROUP_KINDS:
        raise ConfigError(f"unknown group kind {group_kind!r} (known: {', '.join(GROUP_KINDS)})")
    if limit is not None and limit < 1:
        raise ConfigError(f"limit must be >= 1, got {limit}")
    prepare(run.con)
    return _sql.query_df(run.con, "skew", "instances", kind_filter=group_kind or "", limit=limit or 0)


def skew_by_collective(run: Run) -> pd.DataFrame:
    """Per collective (span name, group kind): spread statistics, top last arriver, lateness growth."""
    prepare(run.con)
    return _sql.query_df(run.con, "skew", "by_collective")


def skew_drift(run: Run, *, step_time_ns: float | None = None,
               min_growth_frac: float = 0.02, by_collective: pd.DataFrame | None = None) -> dict[str, object]:
    """Name the collectives whose last arrivals grow later over the run, and the ranks behind it.

    A collective drifts when its last arriver's lateness (last minus mean arrival) grows by at
    least ``min_growth_frac`` of the median step time over the run, steadily (the linear trend
    explains at least half of its variance) and over at least eight steps. Returns {drifting (bool),
    collectives: [{name, group_kind, late_growth_ns, late_slope_ns_per_step, ranks: [{rank,
    times_last, late_growth_ns}]}]}. ``by_collective``: :func:`skew_by_collective`'s frame, where
    the caller has it already.
    """
    con = run.con
    by = skew_by_collective(run) if by_collective is None else by_collective
    if step_time_ns is None:
        row = _sql.first(_sql.execute(con, "skew", "median_step"))
        step_time_ns = float(row[0]) if row and row[0] is not None else 0.0
    threshold = max(min_growth_frac * step_time_ns, 1.0)
    by = by.reset_index(drop=True)
    con.register("_ms_skew_df", by.assign(idx=range(len(by)))[["idx", "name", "group_kind"]])
    _sql.execute(con, "skew", "collectives", frame="_ms_skew_df")
    con.unregister("_ms_skew_df")
    drifting: list[dict[str, Any]] = []
    for idx, coll in enumerate(by.to_dict("records")):
        # Growth that is large, steady (the trend explains the scatter) and seen over enough steps.
        if coll["late_growth_ns"] < threshold or coll["steps"] < MIN_DRIFT_STEPS or coll["late_r2"] < MIN_R2:
            continue
        ranks = _sql.query_df(con, "skew", "growing_ranks", name_index=idx)
        ranks = ranks[ranks["late_growth_ns"] >= threshold / 2]
        drifting.append({
            "name": coll["name"], "group_kind": coll["group_kind"],
            "late_growth_ns": float(coll["late_growth_ns"]), "late_slope_ns_per_step": float(coll["late_slope_ns_per_step"]),
            "ranks": [{"rank": int(r.rank), "times_last": int(r.times_last), "late_growth_ns": float(r.late_growth_ns)}
                      for r in ranks.itertuples()],
        })
    return {"drifting": bool(drifting), "threshold_ns": threshold, "collectives": drifting[:10]}
