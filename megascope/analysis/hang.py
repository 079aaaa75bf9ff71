"""Hang localization and per-rank state: who stopped the job, where in the mesh, and who waits.

Role in the data flow: reads the ``markers`` trail (plus spans and heartbeats for last signs of
life) through ``sql/hang.sql``; :func:`localize` is ``megascope localize --json`` and the report's
``hang`` section, :func:`rank_states` colours the dashboard's topology page.

How the root is found: in every group where some members are stuck inside call N and a member
never entered N, the stuck members wait on the missing one. A missing member that is itself stuck
in another group passes the blame on; following those edges ends at ranks that wait on nothing.
Those are the suspects, ordered: silent ranks (no markers, spans or heartbeats near the end of
the run) first, then by how many ranks wait on them.

Example::

    from megascope.analysis import localize
    localize(run)["suspects"][0]   # {"rank": 5, "host": "node1", "coords": {...}, "group": "dp:1", ...}
"""

from __future__ import annotations

import logging
from collections import defaultdict, deque
from typing import Any

import duckdb
import pandas as pd

from megascope.analysis import _sql
from megascope.analysis.base import prepare
from megascope.schema import MESH_AXES
from megascope.store import Run

log = logging.getLogger(__name__)

# A rank is silent when its last sign of life is this long before the run's last one, at least
# SILENT_MIN_NS and at least SILENT_STEPS median steps (a rank a step behind is not silent).
SILENT_MIN_NS = 1_000_000_000
SILENT_STEPS = 2.0

STATES = ("healthy", "slow", "waiting", "silent", "hung")


def _coords(row: Any, axes: tuple[str, ...]) -> dict[str, int]:
    return {a: int(getattr(row, a)) for a in axes if a in MESH_AXES and pd.notna(getattr(row, a, None))}


def _median_step_ns(con: duckdb.DuckDBPyConnection) -> float:
    row = con.execute("SELECT median(step_ns) FROM ms_cache.rank_step WHERE step_ns IS NOT NULL").fetchone()
    return float(row[0]) if row and row[0] is not None else 0.0


def _silent(activity: pd.DataFrame, median_step_ns: float) -> pd.Series:
    seen = activity["last_seen_ns"]
    if seen.notna().sum() == 0:
        return pd.Series(False, index=activity.index)
    threshold = max(SILENT_MIN_NS, SILENT_STEPS * median_step_ns)
    return seen.isna() | (seen < seen.max() - threshold)


def hang_tables(con: duckdb.DuckDBPyConnection) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(member_state, activity) frames, built after :func:`prepare`."""
    prepare(con)
    _sql.execute(con, "hang", "member_state")
    members = con.execute("SELECT * FROM ms_cache.member_state WHERE missing OR stuck").df()
    activity = _sql.query_df(con, "hang", "activity")
    activity["silent"] = _silent(activity, _median_step_ns(con))
    return members, activity


def _roots(members: pd.DataFrame) -> tuple[list[tuple[int, str]], dict[int, int]]:
    """Follow waiting ranks to the ranks they wait on; return (root (rank, group)), blocked counts."""
    stuck_groups = set(members.loc[members["stuck"], "grp"])
    missing = members[members["missing"] & members["grp"].isin(stuck_groups)]
    waits_on: dict[int, set[int]] = defaultdict(set)
    missing_by_group: dict[str, list[int]] = defaultdict(list)
    for row in missing.itertuples():
        missing_by_group[row.grp].append(int(row.rank))
    for row in members[members["stuck"]].itertuples():
        for m in missing_by_group.get(row.grp, []):
            if m != row.rank:
                waits_on[int(row.rank)].add(m)
    stuck_ranks = set(members.loc[members["stuck"], "rank"].astype(int))
    # The group where a missing rank was first waited for is where the job stopped: sequence
    # numbers of different groups are not comparable, times (reference clock) are.
    first_wait = members[members["stuck"]].groupby("grp")["stuck_since_ns"].min()
    missing = missing.assign(first_wait_ns=missing["grp"].map(first_wait))
    roots: list[tuple[int, str]] = []
    seen: set[int] = set()
    for row in missing.sort_values(["first_wait_ns", "rank", "grp"]).itertuples():
        rank = int(row.rank)
        # A missing member that is itself stuck elsewhere is a victim; the blame moves on.
        if rank in stuck_ranks and waits_on.get(rank):
            continue
        if rank not in seen:
            seen.add(rank)
            roots.append((rank, str(row.grp)))
    if not roots and not missing.empty:
        # Everyone waits on everyone (a cycle): keep the missing members as they are.
        for row in missing.itertuples():
            if int(row.rank) not in seen:
                seen.add(int(row.rank))
                roots.append((int(row.rank), str(row.grp)))
    # How many ranks wait, directly or through others, on each root.
    waited_by: dict[int, set[int]] = defaultdict(set)
    for waiter, targets in waits_on.items():
        for t in targets:
            waited_by[t].add(waiter)
    blocked: dict[int, int] = {}
    for rank, _ in roots:
        reach: set[int] = set()
        queue = deque([rank])
        while queue:
            node = queue.popleft()
            for w in waited_by.get(node, ()):
                if w not in reach and w != rank:
                    reach.add(w)
                    queue.append(w)
        blocked[rank] = len(reach)
    return roots, blocked


def localize(run: Run) -> dict[str, Any]:
    """The ``megascope localize --json`` object: is the job hung, and who is behind it.

    Keys: ``hung`` (bool), ``suspects`` (list of {rank, host, coords, group, last_completed_seq,
    missing_seq, state, waited_on_by, last_seen_ns}, most likely first), ``waiting`` (ranks stuck
    inside a call), ``stuck_groups`` (group, seq, members stuck, members missing), ``silent``
    (ranks with no sign of life near the end), ``markers`` (whether the run has a marker trail).
    """
    con = run.cursor()
    members, activity = hang_tables(con)
    has_markers = bool(con.execute("SELECT count(*) > 0 FROM markers").fetchone()[0])  # type: ignore[index]
    info = con.execute("SELECT * FROM ms_cache.rank_info").df().set_index("rank")
    axes = tuple(run.meta.mesh_axes)
    act = activity.set_index("rank")
    silent_ranks = sorted(int(r) for r in act.index[act["silent"]])
    stuck = members[members["stuck"]]
    roots, blocked = _roots(members)
    hung = bool(not stuck.empty)
    state_of = members.set_index(["grp", "rank"])
    suspects = []
    for rank, grp in roots:
        row = state_of.loc[(grp, rank)]
        place = info.loc[rank] if rank in info.index else None
        suspects.append({
            "rank": rank,
            "host": str(place["host"]) if place is not None else "unknown",
            "coords": _coords(place, axes) if place is not None else {},
            "group": grp,
            "last_completed_seq": None if pd.isna(row["last_done"]) else int(row["last_done"]),
            "missing_seq": None if pd.isna(row["missing_seq"]) else int(row["missing_seq"]),
            "state": "silent" if rank in silent_ranks else "hung",
            "waited_on_by": blocked.get(rank, 0),
            "last_seen_ns": None if rank not in act.index or pd.isna(act.at[rank, "last_seen_ns"])
            else int(act.at[rank, "last_seen_ns"]),
        })
    if hung and not suspects:
        # Every member entered the call and none finished: the fault is in the transfer itself.
        for row in stuck.drop_duplicates("grp").itertuples():
            suspects.append({
                "rank": int(row.rank), "host": str(info.at[row.rank, "host"]) if row.rank in info.index else "unknown",
                "coords": _coords(info.loc[row.rank], axes) if row.rank in info.index else {},
                "group": str(row.grp), "last_completed_seq": None if pd.isna(row.last_done) else int(row.last_done),
                "missing_seq": None, "state": "waiting", "waited_on_by": 0, "last_seen_ns": None,
            })
    suspects.sort(key=lambda s: (s["state"] != "silent", -s["waited_on_by"], s["last_seen_ns"] or 0, s["rank"]))
    stuck_groups = []
    for grp, g in stuck.groupby("grp", sort=True):
        miss = members[(members["grp"] == grp) & members["missing"]]
        stuck_groups.append({
            "group": str(grp), "seq": int(g["stuck_seq"].max()),
            "waiting": sorted(int(r) for r in g["rank"]), "missing": sorted(int(r) for r in miss["rank"]),
        })
    stuck_groups.sort(key=lambda g: (-len(g["waiting"]), g["group"]))
    return {
        "hung": hung,
        "suspects": suspects,
        "waiting": sorted(int(r) for r in set(stuck["rank"])),
        "stuck_groups": stuck_groups[:50],
        "stuck_group_count": len(stuck_groups),
        "silent": silent_ranks,
        "markers": has_markers,
    }


def rank_states(run: Run, *, stragglers_frame: pd.DataFrame | None = None,
                hang: dict[str, Any] | None = None) -> pd.DataFrame:
    """Per rank: rank, host, pp, dp, tp, state (healthy | slow | waiting | silent | hung).

    ``hung`` marks the hang's root suspects, ``silent`` ranks with no sign of life near the end
    (a silent root is ``silent``), ``waiting`` ranks stuck inside a call, ``slow`` stragglers.
    Pass already computed ``stragglers_frame`` / ``hang`` to skip recomputing them.
    """
    from megascope.analysis.stragglers import stragglers

    con = run.cursor()
    prepare(con)
    info = con.execute("SELECT rank, host, pp, dp, tp FROM ms_cache.rank_info ORDER BY rank").df()
    hang = hang if hang is not None else localize(run)
    slow = stragglers_frame if stragglers_frame is not None else stragglers(con)
    state = pd.Series("healthy", index=info.index, dtype="object")
    state[info["rank"].isin(set(slow["rank"]))] = "slow"
    state[info["rank"].isin(set(hang["waiting"]))] = "waiting"
    state[info["rank"].isin(set(hang["silent"]))] = "silent"
    roots = {s["rank"] for s in hang["suspects"] if s["state"] == "hung"}
    state[info["rank"].isin(roots)] = "hung"
    out = info.assign(state=state)
    return out
