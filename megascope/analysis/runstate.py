"""Run state: is a run running, stalled, hung, finished or failed? One rule for every reader.

Role in the data flow: reads a :class:`~megascope.store.Run` (base tables, the newest marker parts
of each rank, file times) and returns a JSON-ready dict. The dashboard's header, Overview,
Topology and ``/metrics`` show it, and ``megascope localize`` declares a hang only when it says
``hung``: a collective still in flight is not a hang, and a run that finished never reads hung.

The rule, in order:

1. **finished**: every rank wrote a step span for the last step (``config.steps - 1`` from
   ``run.json`` when known, else the highest step any rank reached, once no call is in flight and
   no progress came for ``stall_after_s``).
2. **running**: some rank made progress (a completed collective or p2p call, or a span ending)
   less than ``stall_after_s`` ago. Before the first progress: running until ``hang_after_s``
   after the last write.
3. **stalled**: no progress on any rank for ``stall_after_s`` but less than ``hang_after_s``.
4. **hung**: no progress on any rank for ``hang_after_s`` and at least one call was entered and
   never completed (the collective trail shows who is waiting and on whom).
5. **failed**: no progress for ``hang_after_s``, not finished, and no call in flight: the job
   stopped (exited, was killed, crashed between calls) before its last step. At once, without
   waiting, where every rank's process has ended (their marker agents say so) with no call in
   flight (hung at once where it ended with calls stuck). Where the ranks' steps ended by exceptions (the collector records each one's class),
   the reason says how, and names the first rank that raised an exception of its own (not what
   a rank raises when a peer goes away), or else the rank that died without one while the others
   failed after it (:func:`failure`); all interrupts: stopped from outside. Also at once, with
   calls in flight, where ``localize`` found the rank they wait for died (``died``: its process
   ended before theirs, not after their timeouts as a hung rank's does): NCCL's waiters do not
   fail when a peer dies. In a live job too, as soon as that rank's process has ended while the
   ranks waiting on it still run (they would wait out their timeout, minutes in large jobs).

``hang_after_s`` is the job's collective timeout (``config.collective_timeout_s`` in
``run.json``) when known: the time after which the job itself gives up on a call. Otherwise ten
flush intervals or four median steps, at least 20 s. ``stall_after_s`` defaults to three flush
intervals or two median steps, at least 10 s (never more than ``hang_after_s``).

Progress time is read from the data (host wall clocks), so a run written long ago is judged by
when it stopped, not by when its files were copied. This assumes the job's hosts and the reader
agree on the time within the stall threshold (NTP); a reader that watches a live run can pass
``last_write_ns``, when it last saw new data arrive, which bounds the idle time whatever the clocks
say.

Example::

    from megascope.analysis.runstate import run_state
    state = run_state(run)
    state["state"], state["reason"]      # ("hung", "no progress on any rank for 75 s ...")
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import duckdb

from megascope import layout, schema
from megascope.analysis import _sql
from megascope.analysis.base import prepare
from megascope.store import Run

log = logging.getLogger(__name__)

STATES = ("running", "stalled", "hung", "finished", "failed")

# The collector's default flush interval: a live rank's data is at most this old on disk.
DEFAULT_FLUSH_S = 1.0
# Stalled after this many flush intervals (or STALL_STEPS median steps, at least STALL_MIN_S)
# without progress. A healthy job's writes come a flush apart, but its last steps can reach the
# disk together at exit, seconds after the step before: a shorter threshold flickers.
STALL_FLUSHES = 3.0
STALL_STEPS = 2.0
STALL_MIN_S = 10.0
# Without a collective timeout in run.json: hung after this many flush intervals or median steps
# (at least HANG_MIN_S).
HANG_FLUSHES = 10.0
HANG_STEPS = 4.0
HANG_MIN_S = 20.0
# Newest marker parts read per rank for the last progress (a stuck rank's newest part may hold
# only the call it entered; the one before holds its last completion).
NEWEST_PARTS = 2

_PROGRESS_TABLES = ("spans", "markers", "metrics")


def _config_float(config: Mapping[str, Any], key: str) -> float | None:
    value = config.get(key)
    try:
        number = float(value) if value is not None else None
    except (TypeError, ValueError):
        return None
    return number if number is not None and number > 0 else None


def _expected_steps(config: Mapping[str, Any]) -> int | None:
    value = config.get("steps")
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return None


def newest_write_ns(path: Path) -> int | None:
    """The newest modification time (ns) of the progress tables' partition directories and parts.

    A part is renamed into ``spans/rank=N/``, which moves that directory's time: one stat per
    partition (and per compacted file), no file read. Heartbeats are left out on purpose: a sampler thread keeps writing
    them while every rank is blocked in a hang.
    """
    newest: int | None = None
    for table in _PROGRESS_TABLES:
        # Compacted files (megascope.compact) keep the newest write time of the parts they merged.
        for base, only_data in ((path / table, False), (layout.compacted_dir(path, table), True)):
            try:
                entries = list(os.scandir(base))
            except OSError:
                continue
            for entry in entries:
                if only_data and (entry.name.startswith(".") or not entry.name.endswith(".parquet")):
                    continue
                try:
                    mtime = entry.stat().st_mtime_ns
                except OSError:
                    continue
                newest = mtime if newest is None or mtime > newest else newest
    return newest


def _newest_parts(run: Run, table: str, count: int) -> list[Path]:
    by_dir: dict[Path, list[Path]] = {}
    for f in run.files.get(table, []):
        by_dir.setdefault(f.parent, []).append(f)
    # Part names start with their write time, so the name order is the write order.
    return [p for files in by_dir.values() for p in sorted(files, key=lambda p: p.name)[-count:]]


def _cut_values(cut: Mapping[int, int]) -> _sql.Raw:
    """The progress cut-offs as a relation c(rank, cut_ns), empty without any."""
    if not cut:
        return _sql.Raw("(SELECT NULL::BIGINT AS rank, NULL::BIGINT AS cut_ns WHERE false) c")
    return _sql.Raw("(VALUES " + ", ".join(f"({int(r)}, {int(t)})" for r, t in cut.items()) + ") c(rank, cut_ns)")


def _last_completed(con: duckdb.DuckDBPyConnection, files: list[Path]) -> dict[Path, list[tuple[int, int]]]:
    """Per marker file, each rank's newest completed-call marker in it (host clock): a list of
    (rank, time_ns), empty where it has none."""
    found: dict[Path, list[tuple[int, int]]] = {f: [] for f in files}
    by_name = {str(f): f for f in files}
    rows = con.execute("SELECT filename, rank, max(time_ns) FROM read_parquet(?, filename = true, union_by_name = true) "
                       "WHERE state = 'completed' GROUP BY ALL", [list(by_name)]).fetchall()
    for name, rank, time_ns in rows:
        found[by_name[name]].append((int(rank), int(time_ns)))
    return found


def _last_completion_ns(con: duckdb.DuckDBPyConnection, run: Run, cut: Mapping[int, int]) -> int | None:
    """Newest completed-call marker of any rank (reference clock), from each rank's newest parts;
    a rank in ``cut`` counts only up to its cut-off. Without cut-offs each part's newest
    completions are read once in its life (a live run's refresh reads its new parts' only)."""
    parts = _newest_parts(run, "markers", NEWEST_PARTS)
    if not parts:
        return None
    if not cut:
        try:
            newest = run.per_file("markers_last_completed", parts, functools.partial(_last_completed, con))
            offsets = dict(con.execute("SELECT rank, host_offset_ns FROM ms_cache.rank_clock").fetchall())
        except duckdb.Error as exc:  # a part replaced under us: the spans still tell
            log.info("run state: newest markers unreadable: %s", exc)
            return None
        times = [t + (offsets.get(rank) or 0) for found in newest.values() for rank, t in found]
        return max(times) if times else None
    files = ", ".join("'" + str(p).replace("'", "''") + "'" for p in parts)
    try:
        row = _sql.first(_sql.execute(con, "runstate", "last_completion", files=_sql.Raw(files), cut=_cut_values(cut)))
    except duckdb.Error as exc:  # a part replaced under us: the spans still tell
        log.info("run state: newest markers unreadable: %s", exc)
        return None
    return int(row[0]) if row and row[0] is not None else None


def _in_flight(con: duckdb.DuckDBPyConnection) -> int:
    """Calls some rank entered and never completed (per rank, group and p2p direction)."""
    row = _sql.first(_sql.execute(con, "runstate", "in_flight"))
    return int(row[0]) if row and row[0] is not None else 0


def _step_facts(con: duckdb.DuckDBPyConnection, cut: Mapping[int, int]) -> dict[str, Any]:
    """Ranks, their last finished step, the run's median step and newest span end (reference clock;
    a rank in ``cut`` counts only up to its cut-off)."""
    row = _sql.first(_sql.execute(con, "runstate", "step_facts", cut=_cut_values(cut)))
    assert row is not None
    ranks, last, slowest, at_last, median_step, span_end = row
    return {
        "ranks": int(ranks or 0),
        "last_step": None if last is None else int(last),
        "slowest_last_step": None if slowest is None or slowest < 0 else int(slowest),
        "ranks_at_last_step": int(at_last or 0),
        "median_step_s": float(median_step) / 1e9 if median_step is not None else None,
        "last_span_end_ns": None if span_end is None else int(span_end),
    }


# Exceptions that stop a job from outside (Ctrl-C, a handler's exit), not a fault of the rank.
INTERRUPTS = frozenset({"KeyboardInterrupt", "SystemExit"})
# What a rank raises when a peer went away: its connection closed, its call timed out or was
# aborted (gloo and NCCL raise RuntimeError or torch.distributed's errors). Any other class is the
# rank's own fault (a bug, its device out of memory).
PEER_FAILURES = frozenset({"RuntimeError", "DistError", "DistBackendError", "DistNetworkError", "DistStoreError",
                           "TimeoutError", "ConnectionError", "ConnectionResetError", "BrokenPipeError"})


def _step_errors(con: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    """Each rank's first step that ended by an exception (the collector's ``step_error:`` metrics):
    rank, step, error (the class), time_ns; first in time first."""
    prefix = schema.STEP_ERROR_METRIC
    frame = _sql.query_df(con, "runstate", "step_errors", prefix=prefix, skip=len(prefix) + 1)
    return [{"rank": int(r), "step": int(s), "error": str(e), "time_ns": int(t)}
            for r, s, e, t in zip(frame["rank"], frame["step"], frame["error"], frame["time_ns"], strict=True)]


# A rank's process that ended no later than this after the first exception any rank raised
# ended before the others failed (its marker agent writes its end a moment after the fact; a
# launcher stops the others later than this).
FIRST_END_NS = 20_000_000


def _exceptions_text(errors: list[dict[str, Any]]) -> str:
    """``RuntimeError on ranks 0, 1, 3`` (``on 7 ranks`` past four): each class of exception with
    the ranks whose steps ended by it, the most common first."""
    classes: dict[str, list[int]] = {}
    for e in errors:
        classes.setdefault(e["error"], []).append(int(e["rank"]))
    parts = []
    for name, ranks in sorted(classes.items(), key=lambda c: (-len(c[1]), c[0])):
        ranks = sorted(set(ranks))
        if len(ranks) == 1:
            parts.append(f"{name} on rank {ranks[0]}")
        elif len(ranks) <= 4:
            parts.append(f"{name} on ranks " + ", ".join(map(str, ranks)))
        else:
            parts.append(f"{name} on {len(ranks):,} ranks")
    return ", ".join(parts)


def failure(errors: list[dict[str, Any]], world_size: int,
            ended_ns: Mapping[int, int] | None = None) -> dict[str, Any] | None:
    """How a job that stopped before its last step failed, from the exceptions its ranks' steps
    ended by (:func:`_step_errors`, first in time first): ``{text, culprit}`` (``culprit``:
    ``{rank, step, where}`` or None), or None where no rank recorded one. In this order:

    * every exception an interrupt (Ctrl-C): stopped from outside, no culprit;
    * ranks that raised something other than what a rank raises when a peer goes away (a bug, an
      out-of-memory error; :data:`PEER_FAILURES`): the first of them, whatever the others did (a
      launcher may stop the others before they raise);
    * of the ranks with no exception, the one whose process ended (``ended_ns``: rank -> when its
      marker agent saw it end) before the others failed (:data:`FIRST_END_NS`), where one did: a
      launcher may stop other ranks before they raise, but after;
    * a few ranks (one in eight at most, one at least) with no exception while the others raised
      a peer's failure: the one that died said nothing (killed by a signal or out of memory,
      crashed, exited, or stuck until stopped), the others failed after it.
    """
    if not errors:
        return None
    summary = _exceptions_text(errors)
    if {e["error"] for e in errors} <= INTERRUPTS:
        return {"text": f"stopped from outside ({summary})", "culprit": None}
    own = [e for e in errors if e["error"] not in PEER_FAILURES | INTERRUPTS]
    if own:
        first = own[0]
        also = f" ({len(own) - 1} other rank(s) raised their own too)" if len(own) > 1 else ""
        others = _exceptions_text([e for e in errors if e["rank"] != first["rank"]])
        return {"text": f"rank {first['rank']} raised {first['error']} in step {first['step']}{also}"
                        + (f"; the others failed after it ({others})" if others else ""),
                "others_raised": bool(others),
                "culprit": {"rank": first["rank"], "step": first["step"],
                            "where": f"raised {first['error']} in step {first['step']}"}}
    raised = {e["rank"] for e in errors}
    quiet = sorted(set(range(int(world_size))) - raised)
    first_error = min(e["time_ns"] for e in errors)
    ends = ended_ns or {}
    early = [r for r in quiet if r in ends and int(ends[r]) <= first_error + FIRST_END_NS]
    if len(early) == 1:
        quiet = early
    if quiet and (len(early) == 1 or len(quiet) <= max(1, int(world_size) // 8)):
        who = f"rank {quiet[0]}" if len(quiet) == 1 else "ranks " + ", ".join(map(str, quiet))
        return {"text": f"{who} ended with no exception of its own (killed by a signal or out of memory, crashed, "
                        f"exited, or stuck until stopped); the others failed after it ({summary})",
                "others_raised": True,
                "culprit": {"rank": quiet[0], "step": None, "where": "ended with no exception of its own"}}
    return {"text": f"exceptions: {summary}", "culprit": None}


def thresholds(median_step_s: float | None, *, collective_timeout_s: float | None = None,
               flush_interval_s: float | None = None, stall_after_s: float | None = None,
               hang_after_s: float | None = None) -> tuple[float, float, str]:
    """(stall_after_s, hang_after_s, where the hang threshold comes from)."""
    flush_s = flush_interval_s or DEFAULT_FLUSH_S
    step_s = median_step_s or 0.0
    if hang_after_s is not None:
        source = "as asked"
    elif collective_timeout_s is not None:
        hang_after_s, source = collective_timeout_s, "the collective timeout"
    elif HANG_STEPS * step_s > max(HANG_FLUSHES * flush_s, HANG_MIN_S):
        hang_after_s, source = HANG_STEPS * step_s, f"{HANG_STEPS:.0f} median steps"
    else:
        hang_after_s = max(HANG_FLUSHES * flush_s, HANG_MIN_S)
        source = f"{HANG_FLUSHES:.0f} flush intervals" if HANG_FLUSHES * flush_s >= HANG_MIN_S else "no collective timeout known"
    if stall_after_s is None:
        stall_after_s = max(STALL_FLUSHES * flush_s, STALL_STEPS * step_s, STALL_MIN_S)
    return float(min(stall_after_s, hang_after_s)), float(hang_after_s), source


def _age_s(now_ns: int, then_ns: int | None) -> float | None:
    return None if then_ns is None else max(0.0, (now_ns - then_ns) / 1e9)


def duration_text(seconds: float) -> str:
    """``"4 s"``, ``"12 min"``, ``"3 h"``, ``"5 days"``: a duration as a person reads it."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"


def run_facts(run: Run, *, hang: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What :func:`decide` needs from the data, computed once per version of the run's files.

    ``hang`` as in :func:`run_state`. Keys: ranks, last_step, slowest_last_step,
    ranks_at_last_step, median_step_s, last_progress_ns, last_data_ns, in_flight, suspects, lost,
    expected_steps, failure (:func:`failure`, once every process has ended), ended, died,
    collective_timeout_s, flush_interval_s, meta_mtime_ns.
    """
    con = run.cursor()
    try:
        prepare(con)
        # NCCL's abort "completes" the calls a rank waits in: from when localize says it entered
        # the first of them, that rank's completions and span ends are no sign of progress.
        cut = {int(r): int(t) for r, t in ((hang or {}).get("set_aside_since_ns") or {}).items()}
        facts = _step_facts(con, cut)
        completion = _last_completion_ns(con, run, cut)
        if hang is not None:
            in_flight = len(hang.get("waiting") or [])
        else:
            in_flight = _in_flight(con) if run.files.get("markers") else 0
        # Read once every process has ended, or a rank died (localize says so; the CLI's
        # post-mortem asks always): a live run's refreshes do not scan its metrics for them.
        ended = hang is None or bool(hang.get("ended")) or bool(hang.get("died"))
        errors = _step_errors(con) if ended and run.files.get("metrics") else []
        ends: dict[int, int] = {}
        if errors:  # when each rank's process ended, as its marker agent saw it
            alive = _sql.query_df(con, "hang", "process_alive")
            ends = {int(r): int(t) for r, t, done in zip(alive["rank"], alive["alive_until_ns"], alive["ended"],
                                                         strict=True) if bool(done)}
    finally:
        con.close()
    config = run.meta.config or {}
    candidates = [t for t in (completion, facts.pop("last_span_end_ns")) if t is not None]
    facts.update(
        last_progress_ns=max(candidates) if candidates else None,
        last_data_ns=newest_write_ns(run.path),
        meta_mtime_ns=_mtime_ns(run.path / layout.RUN_JSON),
        in_flight=in_flight,
        suspects=[dict(s) for s in (hang or {}).get("suspects") or []],
        # Ranks whose trails were lost in a hang localize found from the others' trails: where
        # they wait cannot be read, so their calls in flight are not counted but they are not none.
        lost=len((hang or {}).get("lost") or []) if (hang or {}).get("hung") else 0,
        expected_steps=_expected_steps(config),
        failure=failure(errors, run.meta.world_size, ends),
        # Every rank's process has ended, as their marker agents said (localize); None unknown.
        ended=None if hang is None else bool(hang.get("ended")),
        # The rank whose process ended while the others waited for it (localize's ``died``).
        died=(hang or {}).get("died"),
        collective_timeout_s=_config_float(config, "collective_timeout_s"),
        flush_interval_s=_config_float(config, "flush_interval_s"),
    )
    return facts


def run_state(run: Run, *, now_ns: int | None = None, stall_after_s: float | None = None,
              hang_after_s: float | None = None, hang: Mapping[str, Any] | None = None,
              last_write_ns: int | None = None) -> dict[str, Any]:
    """The run's state by the rule of this module's docstring, as a JSON-ready dict.

    Arguments (all optional):

    * ``now_ns``: the reader's wall clock (``time.time_ns()`` when None); tests pass a fixed one.
    * ``stall_after_s`` / ``hang_after_s``: override the thresholds (``hang_after_s`` defaults to
      ``run.json``'s ``config.collective_timeout_s``, else ten flush intervals or four median
      steps, at least 20 s; ``stall_after_s`` to three flush intervals or two median steps, at
      least 10 s).
    * ``hang``: a :func:`megascope.analysis.localize` result already computed; its ``waiting``
      list says which ranks are inside a call and its first suspect becomes the ``culprit``.
      Without it the markers are scanned here for calls in flight and ``culprit`` stays None.
      run_state never calls ``localize`` itself, so ``localize`` may call run_state.
    * ``last_write_ns``: the reader's wall-clock time when it last saw new spans, markers or
      metrics arrive (a live dashboard knows it); it bounds the idle time from above.

    Keys of the result:

    * ``state``: running | stalled | hung | finished | failed; ``reason``: one line saying why.
    * ``hung``: ``state == "hung"`` (what ``localize``'s ``hung`` must be).
    * ``last_step``: highest step some rank finished (None before any); ``expected_steps``: from
      ``run.json`` (None when unknown); ``ranks``, ``ranks_at_last_step``.
    * ``last_progress_ns``: host wall clock of the newest completed call or span end on any rank;
      ``progress_age_s``: now minus that (None when there is no progress yet).
    * ``last_data_ns``: newest modification time of the spans/markers/metrics directories;
      ``last_data_age_s``: now minus that.
    * ``idle_s``: the idle time the rule used; ``stall_after_s``, ``hang_after_s``,
      ``hang_after_source``: the thresholds and where the hang threshold came from.
    * ``in_flight``: calls entered and not completed (ranks waiting, when ``hang`` is given).
    * ``culprit``: the first hang suspect (``rank, host, coords, group, missing_seq, ...``) when
      the state is hung and ``hang`` names one; when it failed, the rank :func:`failure` names
      (``rank, step, where``, and ``waiting``: the ranks left waiting for it in a call until
      stopped, where it died so); else None.
    """
    return decide(run_facts(run, hang=hang), now_ns=now_ns, stall_after_s=stall_after_s,
                  hang_after_s=hang_after_s, last_write_ns=last_write_ns)


def _hang_words(facts: Mapping[str, Any], in_flight: int) -> tuple[dict[str, Any] | None, str]:
    """A hung run's culprit (its first suspect) and what is stuck, in words ending with the
    culprit's: "3 call(s) never completed; rank 1 never entered dp:0 seq 0"."""
    suspects = list(facts.get("suspects") or [])
    culprit = dict(suspects[0]) if suspects else None
    who = f"; rank {culprit['rank']} {culprit['where']}" if culprit else ""
    calls = (f"{in_flight} call(s) never completed" if in_flight
             else f"the trails of {facts['lost']} rank(s) lost where they waited")
    return culprit, calls + who


def decide(facts: Mapping[str, Any], *, now_ns: int | None = None, stall_after_s: float | None = None,
           hang_after_s: float | None = None, last_write_ns: int | None = None) -> dict[str, Any]:
    """:func:`run_state` from :func:`run_facts`: cheap, so a live reader calls it on every look
    (idle time grows while the files stay the same)."""
    now = time.time_ns() if now_ns is None else int(now_ns)
    stall_s, hang_s, source = thresholds(
        facts.get("median_step_s"), collective_timeout_s=facts.get("collective_timeout_s"),
        flush_interval_s=facts.get("flush_interval_s"), stall_after_s=stall_after_s, hang_after_s=hang_after_s)
    last_progress = facts.get("last_progress_ns")
    if last_progress is not None and last_progress > now + int(stall_s * 1e9):
        # Timestamps from the future: the clocks disagree (or an importer's time base is not the
        # wall clock). Fall back on the files' times.
        last_progress = None
    last_data = facts.get("last_data_ns")
    progress_age = _age_s(now, last_progress)
    data_age = _age_s(now, last_data)
    idle = progress_age if progress_age is not None else data_age
    if idle is None:
        idle = _age_s(now, facts.get("meta_mtime_ns")) or 0.0
    seen_age = _age_s(now, last_write_ns)
    if seen_age is not None:
        idle = min(idle, seen_age)

    expected = facts.get("expected_steps")
    ranks, last, in_flight = int(facts.get("ranks") or 0), facts.get("last_step"), int(facts.get("in_flight") or 0)
    everyone_done = ranks > 0 and last is not None and facts.get("slowest_last_step") == last
    if expected is not None:
        finished = everyone_done and last == expected - 1
    else:
        # Without a step count, a live job is not finished until it goes quiet with nothing in
        # flight, or until every rank's process has ended (their marker agents say so); nor where
        # a rank's step ended by an exception (a rank that left its loop early ended its step).
        finished = (everyone_done and in_flight == 0 and (idle >= stall_s or bool(facts.get("ended")))
                    and not facts.get("failure"))

    step_text = f"step {last}" if last is not None else "no finished step"
    of_text = f" of {expected - 1}" if expected is not None else ""
    culprit: dict[str, Any] | None = None
    how = facts.get("failure")
    if finished:
        state = "finished"
        reason = f"every rank ({ranks}) finished its last step ({last}{of_text})"
    elif facts.get("died"):
        # A rank's process ended first, and the others wait (or waited, until they were stopped)
        # for it in a call it never entered: NCCL's waiters do not fail when a peer dies, and
        # sit there until their timeout (minutes in large jobs); localize tells.
        state = "failed"
        died = facts["died"]
        live = not facts.get("ended")
        rank = int(died["rank"])
        if how and how.get("culprit") and int(how["culprit"]["rank"]) == rank:
            what, culprit = how["text"], dict(how["culprit"])
        elif died.get("quiet"):
            on = f" (every rank of host {died['host']} with it)" if died.get("host") else ""
            what = (f"rank {rank} and its marker agent went quiet with no last word{on}: its host down, or its "
                    "process group killed")
            culprit = {"rank": rank, "step": None, "where": "went quiet, its marker agent too"}
        else:
            what = (f"rank {rank} ended with no exception of its own (killed by a signal or out of memory, "
                    "crashed, or exited)")
            culprit = {"rank": rank, "step": None, "where": "ended with no exception of its own"}
        waiters = list(died.get("waiting") or [])
        who = f"rank {waiters[0]}" if len(waiters) == 1 else f"{len(waiters):,} ranks"
        call = f"{died.get('group')} seq {died['seq']}" if died.get("seq") is not None else str(died.get("group"))
        if live:
            gone = f"rank {rank} went quiet" if died.get("quiet") else f"rank {rank}'s process ended"
            reason = (f"{gone} at {step_text}{of_text} while the others still run; {what}; {who} "
                      f"{'waits' if len(waiters) == 1 else 'wait'} for it (it never entered {call})")
            culprit["waiting"] = waiters
        else:
            reason = f"every rank's process ended at {step_text}{of_text}, before its last step; {what}"
            if not (how and how.get("others_raised")):  # they did not fail after it: they waited (NCCL)
                reason += f"; {who} waited for it until stopped (it never entered {call})"
                culprit["waiting"] = waiters
    elif facts.get("ended") and not in_flight and not facts.get("lost") and last_progress is not None:
        # Every rank's process has ended (its marker agent said so) short of the last step, with
        # nothing in flight: no need to wait out the stall threshold to call it.
        state = "failed"
        reason = f"every rank's process ended at {step_text}{of_text}, before its last step, with no call stuck"
        if how:
            reason += f"; {how['text']}"
            culprit = dict(how["culprit"]) if how.get("culprit") else None
    elif facts.get("ended") and (in_flight or facts.get("lost")):
        # Every rank's process has ended with calls stuck (localize counts only calls waited in
        # for its threshold before the end): the job hung, then was stopped.
        state = "hung"
        culprit, calls = _hang_words(facts, in_flight)
        reason = f"every rank's process ended at {step_text}{of_text} with {calls}"
    elif last_progress is None and idle < hang_s:
        state, reason = "running", "no step finished yet; waiting for the first data"
    elif idle < stall_s:
        state = "running"
        reason = f"progress {duration_text(idle)} ago; last finished {step_text}{of_text}"
    elif idle < hang_s:
        state = "stalled"
        waiting = f"; {in_flight} call(s) in flight" if in_flight else ""
        reason = (f"no progress on any rank for {duration_text(idle)} (a hang is declared after "
                  f"{duration_text(hang_s)}, {source}){waiting}")
    elif in_flight or facts.get("lost"):
        state = "hung"
        culprit, calls = _hang_words(facts, in_flight)
        reason = f"no progress on any rank for {duration_text(idle)} (>= {duration_text(hang_s)}, {source}) with {calls}"
    else:
        state = "failed"
        reason = (f"stopped at {step_text}{of_text} with no call stuck and no progress for "
                  f"{duration_text(idle)}: the job exited or was killed before its last step")
        if how:
            reason += f"; {how['text']}"
            culprit = dict(how["culprit"]) if how.get("culprit") else None
    return {
        "state": state,
        "reason": reason,
        "hung": state == "hung",
        "last_step": last,
        "expected_steps": expected,
        "ranks": ranks,
        "ranks_at_last_step": int(facts.get("ranks_at_last_step") or 0),
        "last_progress_ns": last_progress,
        "progress_age_s": progress_age,
        "last_data_ns": last_data,
        "last_data_age_s": data_age,
        "idle_s": idle,
        "stall_after_s": stall_s,
        "hang_after_s": hang_s,
        "hang_after_source": source,
        "in_flight": in_flight,
        "culprit": culprit,
    }


def _mtime_ns(path: Path) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None
