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

import functools
import logging
import math
import time
from collections import defaultdict, deque
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd

from megascope.analysis import _sql
from megascope.analysis.base import footer_steps, prepare
from megascope.analysis.runstate import run_state, thresholds
from megascope.analysis.stragglers import stragglers
from megascope.analysis.witness import flight_recorder_hang, read_stacks
from megascope.store import Run
from megascope.topology import coords_of

log = logging.getLogger(__name__)

# A rank is silent when its last sign of life is this long before the run's last one, at least
# SILENT_MIN_NS and at least SILENT_STEPS median steps (a rank a step behind is not silent).
SILENT_MIN_NS = 1_000_000_000
SILENT_STEPS = 2.0

STATES = ("healthy", "slow", "waiting", "lost", "silent", "hung")


def _median_step_ns(con: duckdb.DuckDBPyConnection) -> float:
    row = _sql.first(_sql.execute(con, "hang", "median_step"))
    return float(row[0]) if row and row[0] is not None else 0.0


def _silent(activity: pd.DataFrame, median_step_ns: float) -> pd.Series:
    seen = activity["last_seen_ns"]
    if seen.notna().sum() == 0:
        return pd.Series(False, index=activity.index)
    threshold = max(SILENT_MIN_NS, SILENT_STEPS * median_step_ns)
    return seen.isna() | (seen < seen.max() - threshold)


def _step_highs(con: duckdb.DuckDBPyConnection, files: list[Path]) -> dict[Path, int | None]:
    """Per file, the highest step of its rows from its footer's statistics (None: it has no row
    of a step); a file whose footer does not tell (a row group without statistics) is left out."""
    return {Path(name): (None if high is None else int(high))
            for name, _, high, _, _, told in footer_steps(con, [str(f) for f in files]) if told}


def _markers_beyond(con: duckdb.DuckDBPyConnection, run: Run | None, step: int) -> bool:
    """Whether any marker is of a step after ``step``. With the run, from each marker file's
    highest step (its footer, read once in the file's life: a live run's refresh reads its new
    files' only); a file whose footer does not tell, or none, sends the question to the rows."""
    if run is not None:
        files = run.files.get("markers", [])
        try:
            highs = run.per_file("markers_step_high", files, functools.partial(_step_highs, con))
        except duckdb.Error as exc:  # a file removed under us: the rows tell
            log.info("hang: marker footers unreadable (%s)", exc)
        else:
            if any(high is not None and high > step for high in highs.values()):
                return True
            if len(highs) == len(files):
                return False
    beyond = _sql.first(_sql.execute(con, "hang", "markers_beyond", step=step))
    return bool(beyond and beyond[0])


def _finished(con: duckdb.DuckDBPyConnection, run: Run | None = None) -> bool:
    """Whether every rank wrote a step span for the run's last step (then nothing can be stuck).
    The last step is the highest any rank reached in its spans or its markers: markers leave the
    process on their own (the marker agent) and may be all there is of the step a job died in."""
    last = _sql.first(_sql.execute(con, "hang", "last_step"))
    if not last or last[0] is None:
        return False
    # A marker of a later step means the job went on past the last step spans show.
    if _markers_beyond(con, run, int(last[0])):
        return False
    row = _sql.first(_sql.execute(con, "hang", "finished_ranks", step=int(last[0])))
    # Every rank of the job, not only those that wrote: a rank that froze before its first flush
    # (holding the interpreter lock from its first step) left no row anywhere, and its peers' step
    # spans, closed as their calls timed out waiting for it, would read as a finished run.
    world = run.meta.world_size if run is not None else 0
    return bool(row and row[0] and row[0] >= max(int(row[1]), int(world or 0)))


def hang_tables(con: duckdb.DuckDBPyConnection, run: Run | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(member_state, activity) frames, built after :func:`prepare`; ``run``: the run ``con``
    reads, whose per-file memo spares reading every marker file's footer again."""
    prepare(con)
    _sql.execute(con, "hang", "member_state", scan=not _finished(con, run))
    members = _sql.query_df(con, "hang", "waiting_members")
    activity = _sql.query_df(con, "hang", "activity")
    activity["silent"] = _silent(activity, _median_step_ns(con))
    return members, activity


Record = dict[str, Any]


def int_or_none(value: Any) -> int | None:
    return None if value is None or pd.isna(value) else int(value)


def _roots(members: list[Record]) -> tuple[list[tuple[int, str]], dict[int, int]]:
    """Follow waiting ranks to the ranks they wait on; return (root (rank, group)), blocked counts."""
    stuck = [m for m in members if m["stuck"]]
    stuck_groups = {m["grp"] for m in stuck}
    missing = [m for m in members if m["missing"] and m["grp"] in stuck_groups]
    # The group where a missing rank was first waited for is where the job stopped: sequence
    # numbers of different groups are not comparable, times (reference clock) are.
    first_wait: dict[str, float] = {}
    for m in stuck:
        since = m["stuck_since_ns"]
        since_f = float(since) if since is not None and not pd.isna(since) else math.inf
        first_wait[m["grp"]] = min(first_wait.get(m["grp"], math.inf), since_f)
    missing_by_group: dict[str, list[int]] = defaultdict(list)
    for m in missing:
        missing_by_group[m["grp"]].append(int(m["rank"]))
    waits_on: dict[int, set[int]] = defaultdict(set)
    for m in stuck:
        for target in missing_by_group.get(m["grp"], []):
            if target != m["rank"]:
                waits_on[int(m["rank"])].add(target)
    stuck_ranks = {int(m["rank"]) for m in stuck}
    roots: list[tuple[int, str]] = []
    seen: set[int] = set()
    for m in sorted(missing, key=lambda m: (first_wait.get(m["grp"], math.inf), int(m["rank"]), m["grp"])):
        rank = int(m["rank"])
        # A missing member that is itself stuck elsewhere is a victim; the blame moves on.
        if rank in stuck_ranks and waits_on.get(rank):
            continue
        if rank not in seen:
            seen.add(rank)
            roots.append((rank, str(m["grp"])))
    if not roots:
        # Everyone waits on everyone (a cycle): keep the missing members as they are.
        for m in missing:
            if int(m["rank"]) not in seen:
                seen.add(int(m["rank"]))
                roots.append((int(m["rank"]), str(m["grp"])))
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


def inferred_place(con: duckdb.DuckDBPyConnection, rank: int, places: dict[int, Record],
                   axes: tuple[str, ...]) -> Record | None:
    """The place of a rank that wrote nothing (no ranks row: it froze or died before its first
    flush), read off its peers' groups: in a group of an axis of the mesh its coordinate on that
    axis is its index among the members (the order the groups table keeps), and on the other axes
    the coordinates of the member beside it. None where no group tells, or two tell differently.
    Its host stays unknown."""
    coords: dict[str, int] | None = None
    for _, kind, members in _sql.execute(con, "hang", "groups_with", rank=int(rank)).fetchall():
        members = [int(m) for m in members]
        if kind not in axes or rank not in members:
            continue
        beside = next((places[m] for m in members if m != rank and m in places), None)
        if beside is None:
            continue
        guess = {**coords_of(beside.get("coords"), axes), str(kind): members.index(rank)}
        if coords is not None and guess != coords:
            return None
        coords = guess
    return None if coords is None else {"rank": rank, "host": "unknown", "coords": coords, "inferred": True}


def place_text(suspect: Record) -> str:
    """Where a suspect is, in words to follow its rank: "on host h7 (pp1 dp1 tp0)", or for a rank
    that wrote nothing "(it wrote nothing; pp1 dp1 tp0 by its peers' groups, host unknown)"."""
    from megascope.topology import format_coords

    coords = format_coords(suspect.get("coords") or {})
    if suspect.get("place_inferred"):
        return f"(it wrote nothing; {coords} by its peers' groups, host unknown)"
    if not coords and suspect.get("host") in (None, "unknown"):
        return "(it wrote nothing; host and place unknown)"
    return f"on host {suspect.get('host')} ({coords or '-'})"


def where_text(grp: str, missing_seq: int | None) -> str:
    """What a suspect found from its group did, in words: "never entered tp:0 seq 74" or "stuck in tp:0"."""
    return f"never entered {grp} seq {missing_seq}" if missing_seq is not None else f"stuck in {grp}"


def _suspect(rank: int, grp: str, state: Record | None, place: Record | None, axes: tuple[str, ...],
             kind: str, waited_on_by: int, last_seen: Any, where: str | None = None) -> Record:
    missing = int_or_none(state["missing_seq"]) if state and kind != "waiting" else None
    return {
        "rank": rank,
        "host": str(place["host"]) if place is not None else "unknown",
        "coords": coords_of(place.get("coords"), axes) if place is not None else {},
        # the rank wrote nothing: its coordinates are read off its peers' groups (inferred_place)
        "place_inferred": bool(place is not None and place.get("inferred")),
        "group": grp,
        "last_completed_seq": int_or_none(state["last_done"]) if state else None,
        "missing_seq": missing,
        "state": kind,
        "waited_on_by": waited_on_by,
        "last_seen_ns": int_or_none(last_seen),
        # what it did wrong, in words ("never entered tp:0 seq 74")
        "where": where if where is not None else where_text(grp, missing),
    }


def _ranks_text(ranks: list[int], shown: int = 8) -> str:
    more = f" and {len(ranks) - shown} more" if len(ranks) > shown else ""
    return ", ".join(map(str, ranks[:shown])) + more


def _stopped_outside_calls(con: duckdb.DuckDBPyConnection, activity: pd.DataFrame, lost: list[int],
                           places: dict[int, Record], axes: tuple[str, ...], silent_ranks: list[int]) -> list[Record]:
    """Where some trails were lost: the intact ranks that stopped outside their calls. A rank
    stopped outside its calls when it is stuck in none, or only in calls of a step before the last
    one its host reached (calls it issued and went on from: a host blocked in a call does not
    start the next step)."""
    lost_set = set(lost)
    intact = [r for r in sorted(places) if r not in lost_set]
    if not intact:
        return []
    trail = _sql.query_df(con, "hang", "rank_trail", ranks=intact)
    steps = {int(r): s for r, s in zip(activity["rank"], activity["last_step"], strict=True)}
    seen = {int(r): v for r, v in zip(activity["rank"], activity["last_seen_ns"], strict=True)}
    # Per rank, the latest step of a call it is stuck in (a step not known counts as the latest),
    # and its latest completed call (the rows come latest group first).
    held = trail[trail["stuck"]].assign(at=lambda f: f["last_enq_step"].fillna(2**62)).groupby("rank")["at"].max()
    last_done = trail[trail["last_done"].notna()].groupby("rank").head(1).set_index("rank")
    out: list[Record] = []
    for rank in intact:
        step = int_or_none(steps.get(rank))
        if rank in held.index and (step is None or int(held[rank]) >= step):
            continue
        if rank in last_done.index:
            last = last_done.loc[rank]
            grp, state = str(last["grp"]), {"last_done": last["last_done"], "missing_seq": None}
            call = f" (its last call, {grp} seq {int(last['last_done'])}, completed)"
        else:
            grp, state, call = "", None, ""
        where = f"stopped outside its calls{f' in step {step}' if step is not None else ''}{call}"
        out.append(_suspect(rank, grp, state, places.get(rank), axes,
                            "silent" if rank in silent_ranks else "hung", 0, seen.get(rank), where=where))
    return out


def _job_end_ns(activity: pd.DataFrame, alive: pd.DataFrame) -> int | None:
    """The last moment anything of the job was seen: a sign of life or its agent's process check."""
    values = [v for v in (activity["last_seen_ns"].max(), alive["alive_until_ns"].max() if len(alive) else None)
              if v is not None and not pd.isna(v)]
    return int(max(values)) if values else None


def _wait_threshold_s(run: Run, con: duckdb.DuckDBPyConnection) -> float:
    """How long members must have waited inside a call, by the time every process ended, for it to
    be stuck rather than in flight.

    A job killed mid-step dies with the completions its writer had not yet flushed (up to a flush
    interval or two) and with the call it was in (under a step); a hung job's waiters wait until
    the collective timeout aborts them, seconds to minutes. So: three flush intervals or three
    median steps, at least 2 s, and at most half the hang threshold (the collective timeout when
    run.json has it)."""
    flush, median, hang = _thresholds(run, con)
    return min(max(3 * flush, 3 * median, 2.0), hang / 2)


def _thresholds(run: Run, con: duckdb.DuckDBPyConnection) -> tuple[float, float, float]:
    """(flush interval, median step, hang threshold) in seconds, from run.json and the steps."""
    config = run.meta.config or {}

    def number(key: str) -> float | None:
        try:
            value = float(config[key]) if config.get(key) is not None else None
        except (TypeError, ValueError):
            return None
        return value if value is not None and value > 0 else None

    median = _median_step_ns(con) / 1e9
    flush = number("flush_interval_s") or 1.0
    _, hang, _ = thresholds(median or None, collective_timeout_s=number("collective_timeout_s"),
                            flush_interval_s=flush)
    return flush, median, hang


def localize(run: Run, *, witnesses: bool = True, now_ns: int | None = None) -> dict[str, Any]:
    """The ``megascope localize --json`` object: is the job hung, and who is behind it.

    Keys: ``hung`` (bool), ``suspects`` (list of {rank, host, coords, group, last_completed_seq,
    missing_seq, state, waited_on_by, last_seen_ns, evidence, stack}, most likely first),
    ``waiting`` (ranks stuck inside a call), ``stuck_groups`` (group, seq, members stuck, members
    missing), ``silent`` (ranks with no sign of life near the end), ``markers`` (whether the run
    has a marker trail), ``ended`` (every rank's process was seen to end), ``waited_s`` (how long
    the first stuck call had waited when the evidence ends), ``note`` (why calls in flight are
    not a hang, where that applies), ``flight_recorder`` (what torch's dumps say, or None),
    ``set_aside_since_ns`` (rank -> when it entered the call its set-aside completions belong to:
    what it wrote later is no progress, see hang.sql), and ``died`` where the rank the others wait
    (or waited) for died rather than hung, its process ended or gone quiet with its marker agent
    (:func:`_who_died`; ``hung`` is then False: the job failed).

    A call counts as stuck only if its members had waited in it for run_state's stall threshold
    by the time the job's evidence ends, so a job killed mid-step is not a hang. On a live run
    (processes still there) the hang is declared by :func:`megascope.analysis.runstate.run_state`'s
    rule, the one the dashboard uses. ``witnesses``: also read the flight-recorder dumps and stack
    dumps in the run directory (``megascope.analysis.witness``).
    """
    con = run.cursor()
    member_frame, activity = hang_tables(con, run)
    members: list[Record] = [{str(k): v for k, v in m.items()} for m in member_frame.to_dict("records")]
    alive = _sql.query_df(con, "hang", "process_alive")
    row = _sql.first(_sql.execute(con, "hang", "has_markers"))
    has_markers = bool(row and row[0])
    places: dict[int, Record] = {
        int(r["rank"]): {str(k): v for k, v in r.items()}
        for r in _sql.query_df(con, "base", "places").to_dict("records")
    }
    last_seen = {int(r): v for r, v in zip(activity["rank"], activity["last_seen_ns"], strict=True)}
    silent_ranks = sorted(int(r) for r in activity.loc[activity["silent"], "rank"])
    axes = tuple(run.meta.mesh_axes)
    job_end = _job_end_ns(activity, alive)
    # A rank's process has ended when its agent said so, or when the agent itself went silent
    # (its rows come every flush interval while it runs).
    now = time.time_ns() if now_ns is None else now_ns
    try:
        flush_s = float((run.meta.config or {}).get("flush_interval_s") or 1.0)
    except (TypeError, ValueError):
        flush_s = 1.0
    gone_after_ns = 5e9 * max(1.0, flush_s)
    ended = (bool(len(alive)) and len(alive) >= len(places)
             and bool((alive["ended"] | (now - alive["alive_until_ns"] > gone_after_ns)).all()))
    note: str | None = None
    waited_s: float | None = None
    stuck_since = [float(m["stuck_since_ns"]) for m in members
                   if m["stuck"] and m["stuck_since_ns"] is not None and not pd.isna(m["stuck_since_ns"])]
    if stuck_since and job_end is not None:
        waited_s = max(0.0, (job_end - min(stuck_since)) / 1e9)
    if ended and any(m["stuck"] for m in members) and job_end is not None:
        # Every process has ended and its marker agent said when: calls entered just before the
        # end were in flight, not stuck (a job killed mid-step). A live job keeps its calls in
        # flight as they are; run_state's idle time decides there.
        threshold_ns = _wait_threshold_s(run, con) * 1e9
        short = 0
        for m in members:
            since = m["stuck_since_ns"]
            if m["stuck"] and since is not None and not pd.isna(since) and job_end - float(since) < threshold_ns:
                m["stuck"] = False
                m["in_flight"] = True
                short += 1
        if short and not any(m["stuck"] for m in members):
            note = (f"{short} call(s) were in flight when the evidence ends, entered less than "
                    f"{threshold_ns / 1e9:.0f} s before it: the job stopped mid-step (killed or exited), "
                    "it did not hang")
    stuck = [m for m in members if m["stuck"]]
    state_of = {(m["grp"], int(m["rank"])): m for m in members}
    roots, blocked = _roots(members)
    # A rank its peers wait on that wrote nothing at all (it froze before its first flush) is as
    # silent as a rank can be; its place is read off its peers' groups.
    for rank, _ in roots:
        if rank not in places and (place := inferred_place(con, rank, places, axes)) is not None:
            places[rank] = place
    suspects = [
        _suspect(rank, grp, state_of.get((grp, rank)), places.get(rank), axes,
                 "silent" if rank in silent_ranks or rank not in last_seen else "hung", blocked.get(rank, 0),
                 last_seen.get(rank))
        for rank, grp in roots
    ]
    lost = sorted({int(m["rank"]) for m in members if m.get("lost")})
    stopped: list[Record] = []
    if lost:  # only a run not finished is read for its markers (hang_tables)
        # With trails lost, calls in flight cannot be seen where they were lost: a rank reads as
        # stopped only once nothing of the job has been seen for the hang threshold (a live run
        # whose writers lag is not hung).
        quiet_s = (now - job_end) / 1e9 if job_end is not None else math.inf
        if quiet_s >= _thresholds(run, con)[2]:
            stopped = _stopped_outside_calls(con, activity, lost, places, axes, silent_ranks)
        # Furthest trail first: a rank that stopped outside its calls lets its writer catch up,
        # where ranks that wait in theirs may not (the way these trails get lost). At the same
        # step: a rank named for missing a call, then one that stopped outside its calls, then a
        # lost rank whose place its peers proved.
        reached = {int(r): -1 if int_or_none(s) is None else int(s)
                   for r, s in zip(activity["rank"], activity["last_step"], strict=True)}
        named = {s["rank"] for s in suspects}
        ranked = [(0 if s["rank"] not in lost else 2, s) for s in suspects]
        ranked += [(1, s) for s in stopped if s["rank"] not in named]
        ranked.sort(key=lambda x: (-reached.get(x[1]["rank"], -1), x[0]))
        suspects = [s for _, s in ranked]
        note = (f"the trails of rank(s) {_ranks_text(lost)} end before calls their peers completed with them "
                "(their data stopped reaching the disk, not their progress); read from the other ranks' trails")
    if stuck and not suspects:
        # Every member entered the call and none finished: the fault is in the transfer itself.
        firsts: dict[str, Record] = {}
        for m in stuck:
            firsts.setdefault(m["grp"], m)
        suspects = [
            _suspect(int(m["rank"]), str(m["grp"]), m, places.get(int(m["rank"])), axes, "waiting", 0,
                     last_seen.get(int(m["rank"])))
            for m in firsts.values()
        ]
    if not lost:
        suspects.sort(key=lambda s: (s["state"] != "silent", -s["waited_on_by"], s["last_seen_ns"] or 0, s["rank"]))
    by_group: dict[str, list[Record]] = defaultdict(list)
    for m in stuck:
        by_group[m["grp"]].append(m)
    stuck_groups: list[dict[str, Any]] = [
        {
            "group": grp, "seq": max(int(m["stuck_seq"]) for m in ms),
            "waiting": sorted(int(m["rank"]) for m in ms),
            "missing": sorted(int(m["rank"]) for m in members if m["grp"] == grp and m["missing"]),
        }
        for grp, ms in sorted(by_group.items())
    ]
    stuck_groups.sort(key=lambda g: (-len(g["waiting"]), g["group"]))
    result: dict[str, Any] = {
        "hung": bool(stuck) or bool(stopped),
        "suspects": suspects,
        "waiting": sorted({int(m["rank"]) for m in stuck}),
        "stuck_groups": stuck_groups[:50],
        "stuck_group_count": len(stuck_groups),
        "silent": silent_ranks,
        "markers": has_markers,
        "ended": ended,
        "waited_s": waited_s if stuck else None,
        # Ranks whose completions were set aside (NCCL's abort "completes" a waiting call): from
        # when each entered the call it waits in; later spans and completions of it are no progress.
        "set_aside_since_ns": _set_aside_since(stuck),
        # Ranks whose trails end before calls their peers completed with them (hang.sql).
        "lost": lost,
        "note": note,
        "flight_recorder": None,
    }
    for s in suspects:
        s["evidence"] = ["markers"]
    if witnesses:
        _join_witnesses(run, result, places, axes)
    # Agents gone quiet without their last row (its host lost, or killed with its rank): when each
    # was last heard from.
    quiet = {int(r): int(t) for r, t, done in zip(alive["rank"], alive["alive_until_ns"], alive["ended"], strict=True)
             if not bool(done) and now - t > gone_after_ns} if len(alive) else {}
    died = _who_died(run, con, result, members, places, axes, alive, ended, quiet, now) if len(alive) else None
    if died is not None:
        # NCCL's waiters do not fail when a peer dies: they wait in the call it never entered
        # until stopped. The job failed there; it did not hang.
        result["hung"] = False
        result["died"] = died
        result["note"] = died["text"]
    if result["hung"] and len(alive) and not ended:
        # A live job: hung only by the dashboard's rule (no progress anywhere for the hang threshold).
        state = run_state(run, hang=result, now_ns=now_ns)
        if not state["hung"]:
            result["hung"] = False
            result["note"] = f"not (yet) a hang: the run is {state['state']} ({state['reason']})"
    return result


# A dead rank's process ends before those waiting on it by at least this much (a launcher stops
# the others after it sees the death: torchrun polls every 0.1 s); a hung rank's ends with or after
# theirs (their timeouts go first).
DIED_BEFORE_NS = 100_000_000


def _who_died(run: Run, con: duckdb.DuckDBPyConnection, result: Record, members: list[Record],
              places: dict[int, Record], axes: tuple[str, ...], alive: pd.DataFrame, ended: bool,
              quiet: dict[int, int], now: int) -> Record | None:
    """The rank that died while others wait (or waited) for it in a call it never entered
    (:func:`_died_first`), or None. Where calls are stuck, the markers' first suspect, if it died
    rather than hung: in a live job, its process has ended while every rank waiting on it still
    runs (NCCL's waiters sit in their call until their timeout, minutes in large jobs); once every
    process has ended, its own ended first. Where the calls were only in flight (the launcher
    stopped the waiters moments after the death, as torchrun does), the rank missing from them
    that ended first, where NCCL's flight recorder names it too. In a live job, a rank whose
    marker agent went quiet without its last row (``quiet``: rank -> when it was last heard from)
    while the ranks waiting on it still report, died with it: its host lost, or its process group
    killed. A flight recorder that names another rank keeps the hang."""
    suspects = result["suspects"]
    stuck = [m for m in members if m["stuck"]]
    ends: dict[int, int | None] = {
        int(r): (int(t) if bool(done) else None)
        for r, t, done in zip(alive["rank"], alive["alive_until_ns"], alive["ended"], strict=True)}
    died: Record | None = None
    if stuck and suspects:
        # Live, only waits as old as a stuck call's (a rank whose files reach the reader late is
        # missing from the calls in flight for a moment, its agent quiet; its peers' calls then
        # complete).
        since = None if ended else now - int(_wait_threshold_s(run, con) * 1e9)
        died = _died_first(suspects[0], ends, stuck, _thresholds(run, con)[2], DIED_BEFORE_NS, live=not ended,
                           quiet={} if ended else quiet, waits_since_ns=since)
        if died is not None and died.get("quiet"):
            # A host lost takes every rank on it: say so where each of its ranks went quiet.
            host = places.get(died["rank"], {}).get("host")
            on_host = sorted(r for r, p in places.items() if host is not None and p.get("host") == host)
            if host not in (None, "unknown") and len(on_host) > 1 and all(r in quiet for r in on_host):
                died["host"] = str(host)
                died["text"] += f"; every rank of host {host} went quiet with it ({_ranks_text(on_host)})"
    elif ended and (flight := [m for m in members if m.get("in_flight")]) and (
            (result.get("flight_recorder") or {}).get("hung")):
        # Only with a witness that someone waited on: the marker agents see the processes of a job
        # killed all at once end up to a quarter second apart, as far apart as a launcher stops the
        # others after one died; NCCL's flight recorder dumps only where a rank was waited on.
        roots, _ = _roots([dict(m, stuck=bool(m.get("in_flight"))) for m in members])
        if roots:
            rank, grp = roots[0]
            state = next((m for m in members if int(m["rank"]) == rank and m["grp"] == grp), None)
            suspect = _suspect(rank, grp, state, places.get(rank), axes, "hung", 0, None)
            # No hang to tell it from: only which rank went first.
            died = _died_first(suspect, ends, flight, math.inf, 0, live=False)
    fr = result.get("flight_recorder") or {}
    if died is not None and fr.get("hung") and fr.get("suspects") and int(fr["suspects"][0]) != died["rank"]:
        return None
    if died is not None and not stuck and not (fr.get("suspects") and int(fr["suspects"][0]) == died["rank"]):
        return None  # in flight only: the flight recorder must name the same rank
    return died


def _died_first(suspect: Record, ends: dict[int, int | None], stuck: list[Record], hang_s: float,
                before_ns: int, *, live: bool, quiet: dict[int, int] | None = None,
                waits_since_ns: int | None = None) -> Record | None:
    """Whether ``suspect``, whom ranks wait for (``stuck``: their calls), died rather than hung: its
    process ended (``ends``: rank -> when its marker agent saw it end, None while it runs) within
    half the hang threshold of the first of their waits beginning, and, ``live``, while every rank
    waiting on it still runs, else before each of them ended (by ``before_ns``). A hung rank is
    alive until its peers' calls time out (the hang threshold after their waits began) and is
    stopped with or after them. ``quiet`` (live only): ranks whose marker agent went quiet without
    its last row, and when: the suspect's process ended then, unseen (``quiet`` in the result);
    a waiter's cannot be told to run. ``waits_since_ns``: the first wait began no later than this
    (live: waits old enough to be stuck). Returns ``{rank, ended_ns, waiting, group, seq, live,
    quiet, text}`` or None."""
    rank = int(suspect["rank"])
    quiet = quiet or {}
    end = ends.get(rank)
    unseen = end is None and rank in quiet
    if unseen:
        end = quiet[rank]
    # Waiters gone quiet too went with it (the other ranks of a lost host): the ranks that still
    # report are the ones waiting on it.
    waiting = sorted({int(m["rank"]) for m in stuck} - {rank} - set(quiet))
    since = [float(m["stuck_since_ns"]) for m in stuck
             if int(m["rank"]) in waiting and m["stuck_since_ns"] is not None and not pd.isna(m["stuck_since_ns"])]
    if end is None or not waiting or not since or any(w not in ends for w in waiting):
        return None
    waiter_ends = [ends[w] for w in waiting]
    if live and any(e is not None for e in waiter_ends):
        return None
    if not live and (any(e is None for e in waiter_ends) or end + before_ns >= min(e for e in waiter_ends if e is not None)):
        return None
    first_wait = min(since)
    if end - first_wait > hang_s * 1e9 / 2 or (waits_since_ns is not None and first_wait > waits_since_ns):
        return None
    group, seq = str(suspect.get("group") or ""), int_or_none(suspect.get("missing_seq"))
    after = (end - first_wait) / 1e9
    when = f"{after:.1f} s after the first wait began" if after >= 0 else f"{-after:.1f} s before the first wait began"
    who = f"rank {waiting[0]}" if len(waiting) == 1 else f"ranks {_ranks_text(waiting)}"
    call = f"{group} seq {seq}" if seq is not None else group
    waits = ("wait" if len(waiting) > 1 else "waits") if live else "waited"
    if unseen:
        text = (f"rank {rank} and its marker agent went quiet ({when}, no last row) while {who} {waits} on it "
                f"(it never entered {call}): its host or its process group died, it did not hang")
    else:
        text = (f"rank {rank}'s process ended ({when}) while {who} {waits} on it (it never entered {call}): "
                "it died (raised, was killed or exited), it did not hang")
    return {"rank": rank, "ended_ns": end, "waiting": waiting, "group": group, "seq": seq, "live": live,
            "quiet": unseen, "text": text}


def _set_aside_since(stuck: list[Record]) -> dict[int, int]:
    """Per rank whose completions past the frontier were set aside: when it entered its first such call."""
    since: dict[int, int] = {}
    for m in stuck:
        t = m["stuck_since_ns"]
        if m.get("set_aside") and t is not None and not pd.isna(t):
            since[int(m["rank"])] = min(int(t), since.get(int(m["rank"]), int(t)))
    return since


def _evidence_order(suspect: Record) -> int:
    evidence = set(suspect["evidence"])
    return 0 if {"markers", "flight_recorder"} <= evidence else 1 if "markers" in evidence else 2


def _join_witnesses(run: Run, result: dict[str, Any], places: dict[int, Record], axes: tuple[str, ...]) -> None:
    """Add the flight recorder's verdict and the suspects' stacks (megascope.analysis.witness)."""
    fr = flight_recorder_hang(run)
    suspects: list[Record] = result["suspects"]
    if fr is not None:
        fr_ranks = [int(s["rank"]) for s in fr["suspects"]]
        ours = [int(s["rank"]) for s in suspects]
        for s in suspects:
            if int(s["rank"]) in fr_ranks:
                s["evidence"].append("flight_recorder")
        if fr["hung"] and fr_ranks:
            known = set(ours)
            for s in fr["suspects"]:
                if int(s["rank"]) not in known:
                    place = places.get(int(s["rank"]))
                    suspects.append(dict(s, evidence=["flight_recorder"],
                                         host=str(place["host"]) if place is not None else s.get("host", "unknown")))
            if not result["hung"]:
                result["hung"] = True
                result["note"] = "hung by the flight recorder's dumps; the markers show no stuck call"
        # Named by both first, then by the markers, then by the flight recorder alone.
        suspects.sort(key=_evidence_order)
        agree = bool(ours and fr_ranks and ours[0] == fr_ranks[0]) or (not ours and not fr_ranks)
        fr_summary = {"dumps": fr["dumps"], "missing": fr.get("missing", []), "hung": fr["hung"],
                      "suspects": fr_ranks[:10], "agrees": agree, "error": fr["error"]}
        if not agree and fr["error"] is None and (ours or fr_ranks):
            fr_summary["disagreement"] = (
                f"markers name {', '.join(map(str, ours[:3])) or 'nobody'}; the flight recorder names "
                f"{', '.join(map(str, fr_ranks[:3])) or 'nobody'}")
        result["flight_recorder"] = fr_summary
    for s in suspects:
        s["stack"] = read_stacks(run.path, int(s["rank"]))


def rank_states(run: Run, *, stragglers_frame: pd.DataFrame | None = None,
                hang: dict[str, Any] | None = None) -> pd.DataFrame:
    """Per rank: rank, host, pp, dp, tp, state (healthy | slow | waiting | lost | silent | hung).

    ``hung`` marks the hang's root suspects, ``silent`` ranks with no sign of life near the end
    (a silent root is ``silent``), ``lost`` ranks whose trail ends before calls their peers
    completed with them (silent or not: their data stopped, not they), ``waiting`` ranks stuck
    inside a call, ``slow`` stragglers. A suspect that wrote nothing (no ranks row) gets a row at
    the place its peers' groups give it (:func:`inferred_place`).
    Pass already computed ``stragglers_frame`` / ``hang`` to skip recomputing them.
    """
    run = run.with_cursor()
    con = run.con
    prepare(con)
    info = _sql.query_df(con, "base", "places")[["rank", "host", "coords", "pp", "dp", "tp"]]
    hang = hang if hang is not None else localize(run)
    slow = stragglers_frame if stragglers_frame is not None else stragglers(run)
    state = pd.Series("healthy", index=info.index, dtype="object")
    state[info["rank"].isin(set(slow["rank"]))] = "slow"
    state[info["rank"].isin(set(hang["waiting"]))] = "waiting"
    state[info["rank"].isin(set(hang["silent"]))] = "silent"
    state[info["rank"].isin(set(hang.get("lost") or []))] = "lost"
    roots = {s["rank"] for s in hang["suspects"] if s["state"] == "hung"}
    state[info["rank"].isin(roots)] = "hung"
    out = info.assign(state=state)
    # A suspect that wrote nothing has no row of its own: its place read off its peers' groups.
    unseen = [s for s in hang["suspects"] if s.get("place_inferred") and s["rank"] not in set(info["rank"])]
    if unseen:
        rows = pd.DataFrame([{"rank": s["rank"], "host": s["host"], "coords": s["coords"],
                              **{a: s["coords"].get(a) for a in ("pp", "dp", "tp")}, "state": s["state"]}
                             for s in unseen])
        out = pd.concat([out, rows], ignore_index=True).sort_values("rank", ignore_index=True)
    return out
