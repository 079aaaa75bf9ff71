"""Build (once per run, again when it grows) the base tables every analysis reads.

Role in the data flow: ``store`` gives views over the Parquet parts; this module turns them into
the small derived tables of ``sql/base.sql`` in schema ``ms_cache``: rank places and clocks,
communication instances and the (rank, step) time split. The time split reads the writers'
per-(rank, step, group) sums (view ``step_sums``) for every spans file that has them and
aggregates the spans of the others only (view ``spans_unsummed``): the same table either way. Analyses call :func:`prepare` first;
it returns at once when the tables are current.

Clock offsets are estimated here because every cross-host comparison needs them: members of a
collective (and both ends of a pipeline send) finish together, so their completion times differ
by their hosts' clock offsets. Pairwise host differences (medians, robust to jitter) are combined
by least squares over the host graph, which links hosts that share no collective through chains
of pipeline sends.

Example::

    from megascope.analysis.base import prepare
    prepare(run.con)
    run.con.sql("SELECT * FROM ms_cache.rank_step LIMIT 5")
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pandas as pd

from megascope import store
from megascope.analysis import _sql, persist
from megascope.schema import COLLECTOR_CALLS_METRIC, COLLECTOR_STEP_CALLS_METRIC

log = logging.getLogger(__name__)

Progress = Callable[[str], None] | None

# Steps sampled for clock-offset estimation: enough samples per host, a bounded cost at any size.
CLOCK_SAMPLE_STEPS = 8
# Steps of one rank probed for collectives nested in compute spans (a structural property of the
# job: any few steps tell it).
NESTED_PROBE_STEPS = 16


def sample_steps(steps: list[int], count: int) -> list[int]:
    if len(steps) <= count:
        return steps
    # Evenly spaced, skipping the first step (warm-up) when there is a choice.
    pool = steps[1:] if len(steps) > count + 1 else steps
    stride = len(pool) / count
    return sorted({pool[int(i * stride)] for i in range(count)})


def clock_sample_steps(steps: list[int], count: int) -> list[int]:
    """Steps for clock-offset estimation: two runs of ``count // 2`` consecutive steps, at a
    quarter and at three quarters of the longest power-of-two prefix of the run (after the
    warm-up step, at least ``count`` steps), so that

    * the sample, and with it the estimate, stays the same while a live run grows until it
      doubles: the base tables of the steps already read stay valid and are extended rather than
      rebuilt;
    * it is cheap to read: compacted spans keep whole steps together in row groups of many steps
      each, and consecutive steps share them (eight steps spread over a 1,024-rank run read eight
      of its step bands, a quarter of the run's communication spans, for 1/128 of them kept).
    """
    if len(steps) <= count + 1:
        return sample_steps(steps, count)
    pool = steps[1:]
    pool = pool[:max(count, 1 << (len(pool).bit_length() - 1))]
    half = max(count // 2, 1)
    picked: set[int] = set()
    for at in (len(pool) // 4, (3 * len(pool)) // 4):
        lo = min(at, len(pool) - half)
        picked.update(pool[lo:lo + half])
    for step in pool:  # an odd count, or the two runs overlapping in a short run
        if len(picked) >= count:
            break
        picked.add(step)
    return sorted(picked)


def solve_offsets(hosts: list[str], pairs: pd.DataFrame) -> pd.DataFrame:
    """Least-squares host offsets from pairwise clock differences.

    ``pairs`` has host, ref_host, diff_ns (clock(host) - clock(ref_host)), mad_ns, samples. The
    first host is the reference (offset 0). Hosts not linked to it by any chain of pairs keep
    offset 0 and a NULL error. Returns host, offset_ns, error_ns, samples.
    """
    index = {h: i for i, h in enumerate(hosts)}
    n = len(hosts)
    out = pd.DataFrame({"host": hosts, "offset_ns": 0.0, "error_ns": math.nan, "samples": 0})
    pairs = pairs[pairs["host"].isin(index) & pairs["ref_host"].isin(index)]
    if n == 0 or pairs.empty:
        return out
    a = pairs["host"].map(index).to_numpy()
    b = pairs["ref_host"].map(index).to_numpy()
    # Weight by samples, capped: a pair seen a thousand times is not a thousand times surer
    # once clock drift and transfer jitter dominate.
    w = np.minimum(pairs["samples"].to_numpy(dtype=float), 64.0)
    target = -pairs["diff_ns"].to_numpy(dtype=float)  # offset(host) - offset(ref_host)
    # Normal equations of sum w (o_a - o_b - target)^2: a weighted graph Laplacian.
    lap = np.zeros((n, n))
    np.add.at(lap, (a, a), w)
    np.add.at(lap, (b, b), w)
    np.add.at(lap, (a, b), -w)
    np.add.at(lap, (b, a), -w)
    rhs = np.zeros(n)
    np.add.at(rhs, a, w * target)
    np.add.at(rhs, b, -w * target)
    # Pin every connected component at one host (the reference host for its component) so the
    # system is regular; offsets of components not holding the reference stay unknown.
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for x, y in zip(a.tolist(), b.tolist(), strict=True):
        parent[find(x)] = find(y)
    roots = {find(i) for i in range(n)}
    anchor = {r: min(i for i in range(n) if find(i) == r) for r in roots}
    for i in anchor.values():
        lap[i, i] += 1e6
    offsets = np.linalg.solve(lap, rhs)
    linked = np.array([find(i) == find(0) for i in range(n)])
    offsets = np.where(linked, offsets - offsets[0], 0.0)
    residual = np.abs(offsets[a] - offsets[b] - target)
    edge_err = residual + 1.4826 * pairs["mad_ns"].to_numpy(dtype=float) / np.sqrt(np.maximum(w, 1.0))
    err = np.full(n, math.nan)
    samples = np.zeros(n, dtype=np.int64)
    for ends in (a, b):
        for i, e, k in zip(ends.tolist(), edge_err.tolist(), pairs["samples"].tolist(), strict=True):
            err[i] = e if math.isnan(err[i]) else max(err[i], e)
            samples[i] += int(k)
    err[~linked] = math.nan
    err[0] = 0.0 if linked.any() else math.nan
    out["offset_ns"] = offsets
    out["error_ns"] = err
    out["samples"] = samples
    return out


def _clock_ranks(con: duckdb.DuckDBPyConnection) -> list[int]:
    """Ranks whose spans suffice for clock offsets (``sql/base.sql``'s clock_ranks)."""
    return [int(r) for (r,) in _sql.execute(con, "base", "clock_ranks").fetchall()]


def _clock_hosts(con: duckdb.DuckDBPyConnection) -> list[str]:
    """The hosts, the reference clock's first."""
    return [str(h) for (h,) in _sql.execute(con, "base", "clock_hosts").fetchall()]


def _rank_skew(con: duckdb.DuckDBPyConnection, sample: list[int]) -> None:
    """``ms_cache.rank_skew`` over the clock sample's steps: from the writers' sums where every
    spans file has them, else from the spans' TP calls (``sql/base.sql``, rank_skew)."""
    _, lvl = _sums_source(con)
    ends = {
        "sums_lvl": 'SELECT rank, "group" AS grp, step, last_end_ns FROM step_sums',
        "both_lvl": 'SELECT rank, "group" AS grp, step, last_end_ns FROM step_sums UNION ALL '
                    'SELECT rank, "group", step, start_ns + dur_ns FROM spans_unsummed WHERE kind = \'collective\'',
        "spans_lvl": 'SELECT rank, "group" AS grp, step, start_ns + dur_ns AS last_end_ns FROM spans '
                     'WHERE kind = \'collective\'',
    }[lvl]
    try:
        _sql.execute(con, "base", "rank_skew", steps=sample or [-1], ends=_sql.Raw(f"({ends})"))
    except duckdb.Error as exc:  # a run without device names or groups: no rank is put back
        log.info("rank clocks not checked against their TP groups (%s)", exc)
        _no_rank_skew(con)


def _no_rank_skew(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(f"CREATE OR REPLACE TABLE {_sql.CACHE_SCHEMA}.rank_skew (rank INTEGER, skew_ns BIGINT, samples BIGINT)")


def _estimate_offsets(con: duckdb.DuckDBPyConnection, steps: list[int]) -> pd.DataFrame:
    ranks = _clock_ranks(con)
    sample = clock_sample_steps(steps, CLOCK_SAMPLE_STEPS)
    _rank_skew(con, sample)
    _sql.execute(con, "base", "clock_samples", steps=sample or [-1],
                 ranks=_sql.Raw(", ".join(map(str, ranks)) or "NULL"))
    hosts = _clock_hosts(con)
    pairs = _sql.query_df(con, "base", "clock_pairs")
    offsets = solve_offsets(hosts, pairs)
    frame = offsets.assign(
        offset_ns=offsets["offset_ns"].round().astype("int64"),
        error_ns=np.ceil(offsets["error_ns"]).astype("Int64"),
    )
    con.register("_ms_offsets_df", frame)
    _sql.execute(con, "base", "clock_offsets", frame="_ms_offsets_df")
    con.unregister("_ms_offsets_df")
    _sql.execute(con, "base", "drop_clock_samples")
    return offsets


def estimate_clock_offsets(con: duckdb.DuckDBPyConnection,
                           spans_of: Callable[[list[int]], str] | None = None) -> pd.DataFrame:
    """Per host: host, offset_ns, error_ns (NULL without samples), samples, as :func:`prepare`
    estimates them, without building the other base tables (an export needs only the offsets).

    Read from the base tables where they are current; otherwise estimated from the sampled
    ranks' communication alone (``rank_info`` and ``clock_samples``; no rank's own clock lead is
    put back, which needs its TP group's sums: a device-timed rank's late clock stays in an
    export), the host pairs taken in a fixed order so that the same spans give the same offsets
    however the run is stored. The base
    tables are not marked built: the next :func:`prepare` builds them as before. ``spans_of``
    (e.g. ``Run.rank_source`` for spans) gives a SQL source of the sampled ranks' spans, read in
    place of the whole ``spans`` view: on a run of many part files, only those ranks' files.
    """
    con.execute("SET enable_progress_bar = false")
    with _sql.build_lock():
        _sql.ensure_schema(con)
        if _sql.cache_is_fresh(con, "base"):
            return _sql.query_df(con, "base", "offsets")
        _sql.execute(con, "base", "rank_info")
        ranks = _clock_ranks(con)
        # The ranks' own clock leads (rank_skew) need every TP member's sums, more than the
        # sampled ranks' files: an export reads the hosts' offsets without them.
        _no_rank_skew(con)
        sql = _sql.render("base", "clock_samples", steps=clock_sample_steps(_steps(con), CLOCK_SAMPLE_STEPS) or [-1],
                          ranks=_sql.Raw(", ".join(map(str, ranks)) or "NULL"))
        if spans_of is not None:
            assert sql.count("FROM spans s ") == 1
            sql = sql.replace("FROM spans s ", f"FROM {spans_of(ranks)} s ")
        con.execute(sql)
        hosts = _clock_hosts(con)
        pairs = _sql.query_df(con, "base", "clock_pairs").sort_values(["host", "ref_host"], ignore_index=True)
        _sql.execute(con, "base", "drop_clock_samples")
        offsets = solve_offsets(hosts, pairs)
        return offsets.assign(
            offset_ns=offsets["offset_ns"].round().astype("int64"),
            error_ns=np.ceil(offsets["error_ns"]).astype("Int64"),
        ).sort_values("host", ignore_index=True)


def _steps(con: duckdb.DuckDBPyConnection) -> list[int]:
    """The run's steps, read from one rank's partition (the lowest rank with spans)."""
    for (rank,) in _sql.execute(con, "base", "first_ranks").fetchall():
        steps = [int(x) for (x,) in _sql.execute(con, "base", "step_list", rank=int(rank)).fetchall()]
        if steps:
            return steps
    return [int(x) for (x,) in _sql.execute(con, "base", "all_steps").fetchall()]


# The base tables, as kept beside the run (megascope.analysis.persist).
BASE_TABLES = ["rank_info", "group_kind", "clock_offsets", "rank_clock", "inst", "rank_step"]


def has_step_spans(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether any rank-step has a step span (after :func:`prepare`); the analyses' SQL takes
    step times from step spans when there are any, else from the spans' extent."""
    row = _sql.first(_sql.execute(con, "base", "has_step_spans"))
    return bool(row and row[0])


def prepare(con: duckdb.DuckDBPyConnection, *, progress: Progress = None, persist_cache: bool = True,
            save_later: bool = False) -> None:
    """Build the base tables unless they are current for this run's files.

    With ``persist_cache`` (and a run directory behind ``con``): read them from the run's cache
    (``RUN/_cache``, :mod:`megascope.analysis.persist`) when it was built from the same files;
    extend it when the run only grew (new span or metric parts, the clock estimate unchanged):
    the steps the new parts hold are computed, the others kept; else build them from the parts.
    What was built is kept there for the next reader, where the run can be written: before this
    returns, or with ``save_later`` on the cache's writer thread while the caller goes on (it then
    calls :func:`megascope.analysis.persist.wait_saves` before it is done).
    """
    # Cursors do not inherit the connection's settings; DuckDB's progress bar would go to stdout.
    con.execute("SET enable_progress_bar = false")
    with _sql.build_lock():
        _sql.ensure_schema(con)
        if _sql.cache_is_fresh(con, "base"):
            return
        # A save of this process still going on is finished first: the key it writes is the one
        # compared below.
        persist.wait_saves()
        say = progress or (lambda msg: None)
        root = persist.run_dir(con) if persist_cache else None
        now = None
        if root is not None:
            try:
                now = persist.key(con, root)
            except (OSError, ValueError, duckdb.Error) as exc:
                log.info("analysis cache: no key for %s (%s)", root, exc)
        meta = persist.read_meta(root) if root is not None and now is not None else None
        # Whether this process's base tables are the cache's (then an extension starts from them);
        # from here on they are being replaced, and stand for no cache until done.
        held = root is not None and meta is not None and persist.holds(con, root, meta)
        persist.forget(con)
        clocked: list[int] | None = None  # the run's steps, where an extension left the ranks and clocks current
        if root is not None and meta is not None and now is not None:
            if meta.get("key") == now.digest:
                say("reading the analysis cache")
                if held or persist.load(con, root, meta, BASE_TABLES):
                    persist.remember(con, root, now.digest)
                    _sql.mark_built(con, "base")
                    log.info("base tables read from %s", persist.cache_dir(root))
                    return
            elif (growth := persist.appended(con, root, meta, now)) is not None:
                say("extending the analysis cache")
                extended = _extend(con, root, meta, now, growth, say, held=held)
                if isinstance(extended, tuple):
                    params, ranges, first = extended
                    _keep(con, root, now, params, save_later, say, ranges)
                    persist.carry_memos(con, meta, first)
                    _sql.mark_built(con, "base")
                    return
                clocked = extended
        params = _build(con, say, clocked)
        if root is not None and now is not None:
            _keep(con, root, now, params, save_later, say)
        else:
            persist.remember(con, None, now.digest if now is not None else None)
        _sql.mark_built(con, "base")


def _keep(con: duckdb.DuckDBPyConnection, root: Path, now: persist.Key, params: dict[str, Any], later: bool,
          say: Callable[[str], None], ranges: dict[str, tuple[int, int]] | None = None) -> None:
    """Write the base tables to the run's cache (now, or on the cache's writer thread), with the
    step ranges of the files known (an extension's: the next reads only the files that may hold
    its new steps)."""
    if later:
        say("keeping the base tables beside the run (while the analysis goes on)")
        persist.save_later(con, root, now, BASE_TABLES, params, ranges)
        persist.remember(con, root, now.digest)
        return
    say("keeping the base tables beside the run")
    saved = persist.save(con, root, now, BASE_TABLES, params, ranges)
    persist.remember(con, root if saved else None, now.digest)


def footer_steps(con: duckdb.DuckDBPyConnection, files: list[str]) -> list[tuple[Any, ...]]:
    """Per file of ``files`` (absolute paths) that has a step column, from its footer: name, lowest
    and highest step in the statistics, whether a row group has no statistics of its steps, and
    the rows without a step (None where not told)."""
    if not files:
        return []
    # Inline with a bound parameter: the part files' paths are a list of strings, which the SQL
    # modules' placeholders do not take (no path reaches SQL text).
    return con.execute(
        "SELECT file_name, min(TRY_CAST(stats_min_value AS BIGINT)), max(TRY_CAST(stats_max_value AS BIGINT)), "
        "bool_or(stats_min_value IS NULL), sum(stats_null_count), "
        "bool_and(stats_min_value IS NOT NULL AND stats_max_value IS NOT NULL "
        "OR stats_null_count IS NOT NULL AND stats_null_count = row_group_num_rows) "
        "FROM parquet_metadata(?) WHERE path_in_schema = 'step' GROUP BY file_name", [files]).fetchall()


def _step_ranges(rows: list[tuple[Any, ...]]) -> dict[str, tuple[int, int]]:
    """The lowest and highest step of each file of :func:`footer_steps` whose footer tells them:
    every row group with statistics of its non-null steps (rows without a step belong to no
    step). A file left out may hold any step."""
    return {str(name): (int(low), int(high)) for name, low, high, _, _, told in rows
            if told and low is not None and high is not None}


def _first_new_step(con: duckdb.DuckDBPyConnection,
                    new: dict[str, list[str]]) -> tuple[int | None, dict[str, tuple[int, int]]]:
    """The lowest step in the new parts, from their footers' statistics (None where that cannot
    be told: no statistics, or spans without a step, which belong to no step the cache could
    keep), and the step range of each new part whose footer tells it."""
    files = [f for fs in new.values() for f in fs]
    rows = footer_steps(con, files)
    if not files or len(rows) != len(files):
        return None, {}
    spans = set(new.get("spans", []))
    lows = []
    for name, low, _, unknown, nulls, _ in rows:
        if name in spans and (nulls is None or nulls > 0):
            return None, {}
        if low is None or unknown:
            if name in spans:
                return None, {}
            continue  # a metrics part of step-less rows only
        lows.append(int(low))
    return (min(lows) if lows else None), _step_ranges(rows)


# Where an extension's views over the files that may hold its new steps live (store.subset_views).
_SUBSET_SCHEMA = "ms_extend"


def _extension_files(con: duckdb.DuckDBPyConnection, root: Path, now: persist.Key, growth: persist.Growth,
                     first: int, new_ranges: dict[str, tuple[int, int]],
                     ) -> tuple[list[Path], list[Path], set[Path], dict[str, tuple[int, int]]]:
    """The spans and metrics files that may hold a step from ``first`` on (the new ones, and those
    the cache was built from whose highest step is ``first`` or later, or not known), the step
    sums twins the store reads, and the step range of every file known now (kept with the cache).
    ``new_ranges``: the new parts' (absolute paths), read with ``first``."""
    root_abs = Path(os.path.abspath(root))
    ranges = dict(growth.ranges)
    for name, found in new_ranges.items():
        ranges[os.path.relpath(name, root_abs)] = found
    unknown = [str(root_abs / rel) for rel, (table, _, _) in now.files.items()
               if table in ("spans", "metrics") and rel not in ranges]
    for name, found in _step_ranges(footer_steps(con, unknown)).items():
        ranges[os.path.relpath(name, root_abs)] = found
    spans: list[Path] = []
    metrics: list[Path] = []
    summed: set[Path] = set()
    for rel, (table, _, _) in now.files.items():
        if table == "step_sums":
            summed.add(root_abs / rel)
        elif table in ("spans", "metrics") and (rel not in ranges or ranges[rel][1] >= first):
            (spans if table == "spans" else metrics).append(root_abs / rel)
    return spans, metrics, summed, ranges


def _extend(con: duckdb.DuckDBPyConnection, root: Path, meta: dict[str, Any], now: persist.Key,
            growth: persist.Growth, say: Callable[[str], None], *,
            held: bool = False) -> tuple[dict[str, Any], dict[str, tuple[int, int]], int] | list[int] | None:
    """Extend the cached base tables by the steps the new parts (``growth``) hold, reading only the
    files that may hold those steps. Returns the build's parameters, the files' step ranges and
    the first step it read;
    where the result could differ from a build from scratch (the clock estimate moved, the peers
    or nesting of collectives changed, a call spans the new steps' edge, the cache is unusable)
    the caller builds, and is given the run's steps where the ranks and clocks were estimated
    afresh and hold for the build (a young run's clock sample grows with it), else None."""
    try:
        first, new_ranges = _first_new_step(con, growth.new)
    except duckdb.Error as exc:
        log.info("analysis cache: new parts unreadable (%s)", exc)
        return None
    if first is None or not _old_tables(con, root, meta, held=held):
        return None
    try:
        old = meta.get("params") or {}
        say("reading ranks")
        _sql.execute(con, "base", "rank_info")
        _sql.execute(con, "base", "group_kind")
        steps = _steps(con)
        sample = clock_sample_steps(steps, CLOCK_SAMPLE_STEPS)
        if sample and old.get("clock_sample") == sample and first > max(sample):
            # Every row the estimate reads (the sampled steps' calls, the ranks, the groups) is in
            # the files the cache was built from, as they were: it would come out the same.
            _sql.execute(con, "base", "keep_clock_offsets")
            _sql.execute(con, "base", "keep_rank_clock")
        else:
            say("estimating clock offsets")
            _estimate_offsets(con, steps)
            _sql.execute(con, "base", "rank_clock")
            moved = _sql.first(_sql.execute(con, "base", "moved_clocks"))
            if moved and moved[0]:
                log.info("analysis cache: clock estimate changed; rebuilding")
                return steps
        params = _params(con, steps, old=old, first=first)
        if _compared(params) != _compared(old):
            log.info("analysis cache: parameters changed; rebuilding")
            return None
        say(f"finding the files of steps {first} on")
        spans, metrics, summed, ranges = _extension_files(con, root, now, growth, first, new_ranges)
        store.subset_views(con, _SUBSET_SCHEMA, root, spans, metrics, summed)
        # The statements below read spans, step_sums, spans_unsummed and metrics: these files'.
        con.execute(f"SET search_path = '{_SUBSET_SCHEMA},main'")
        say(f"matching collectives of steps {first} on")
        _sql.execute(con, "base", "inst", where=_sql.Raw(f"s.step >= {int(first)}"))
        overlap = _sql.first(_sql.execute(con, "base", "calls_across_edge", first=int(first)))
        if overlap and overlap[0]:
            log.info("analysis cache: calls span step %d's edge; rebuilding", first)
            return None
        _sql.execute(con, "base", "extend_inst", first=int(first))
        say(f"splitting step time per rank, steps {first} on")
        _rank_step(con, params, where=f"s.step >= {int(first)}", metrics_where=f"step >= {int(first)}")
        _sql.execute(con, "base", "extend_rank_step", first=int(first))
        _sql.execute(con, "base", "add_unknown_ranks")
        log.info("base tables extended from step %d (%d spans and %d metrics files read of %d)", first,
                 len(spans), len(metrics), len(now.files))
        return params, ranges, int(first)
    except (duckdb.Error, OSError, ValueError) as exc:
        log.info("analysis cache: extension failed (%s); rebuilding", exc)
        return None
    finally:
        with contextlib.suppress(duckdb.Error):
            con.execute("RESET search_path")
            con.execute(f"DROP SCHEMA IF EXISTS {_SUBSET_SCHEMA} CASCADE")
        persist.drop(con, BASE_TABLES, prefix="old_")


def _params(con: duckdb.DuckDBPyConnection, steps: list[int], *, old: dict[str, Any] | None = None,
            first: int | None = None) -> dict[str, Any]:
    """What rank_step is built with beside the spans: the group kinds whose collectives run inside
    compute spans (probed on one rank, in the first :data:`NESTED_PROBE_STEPS` of the run's
    ``steps`` after the warm-up: the same answer while the run grows), and the group kinds whose
    members are peers; with them the steps the build sampled (``clock_sample``, ``nested_steps``),
    which an extension compares (:func:`_compared` leaves them out).

    ``old``: the parameters of the cached build an extension from step ``first`` on starts from;
    its probe is kept where the probed steps are the same and all before ``first``."""
    shape = _sql.first(_sql.execute(con, "base", "rank_shape"))
    probe = int(shape[0]) if shape and shape[0] is not None else 0
    window = steps[1:NESTED_PROBE_STEPS + 1] if len(steps) > NESTED_PROBE_STEPS else steps
    if (old is not None and first is not None and window and old.get("nested_steps") == [probe, *window]
            and first > max(window) and isinstance(old.get("nested_kinds"), list)):
        nested = [str(k) for k in old["nested_kinds"]]
    else:
        nested = [str(k) for (k,) in _sql.execute(con, "base", "nested_kinds", rank=probe,
                                                  steps=window or [-1]).fetchall()]
    kernels = kernel_backward(con, probe, window)
    return {"nested_kinds": sorted(k for k in nested if k.isalnum()), "peer_kinds": _peer_kinds(shape),
            "kernel_backward": kernels, "dp_kinds": dp_kinds(con, kernels),
            "clock_sample": clock_sample_steps(steps, CLOCK_SAMPLE_STEPS), "nested_steps": [probe, *window]}


def kernel_backward(con: duckdb.DuckDBPyConnection, rank: int, steps: list[int]) -> bool:
    """Whether the run's backward is its kernels alone (a Kineto trace of GPU ranks), probed on
    ``rank``'s spans in ``steps`` (sql/base.sql, statement kernel_backward): rank_step and the
    what-if then take the backward's window from its kernels."""
    row = _sql.first(_sql.execute(con, "base", "kernel_backward", rank=rank, steps=steps or [-1]))
    return bool(row and row[0])


def kernel_traced(con: duckdb.DuckDBPyConnection) -> bool:
    """:func:`kernel_backward` of a prepared run (after rank_step), probed on its lowest rank in
    the first :data:`NESTED_PROBE_STEPS` steps it has."""
    shape = _sql.first(_sql.execute(con, "base", "rank_shape"))
    probe = int(shape[0]) if shape and shape[0] is not None else 0
    steps = [int(s) for (s,) in con.execute(
        f"SELECT DISTINCT step FROM {_sql.CACHE_SCHEMA}.rank_step WHERE rank = ? ORDER BY step LIMIT ?",
        [probe, NESTED_PROBE_STEPS]).fetchall()]
    return kernel_backward(con, probe, steps)


def dp_kinds(con: duckdb.DuckDBPyConnection, kernels: bool) -> list[str]:
    """The group kinds whose gradient reductions may be hidden by the backward: ``dp``, and
    ``world`` in a Kineto trace of GPU ranks (``kernels``) whose groups are all of that kind (a
    data-parallel job's one process group, as torch.profiler names it)."""
    if kernels:
        row = _sql.first(_sql.execute(con, "base", "world_only"))
        if row and row[0]:
            return ["dp", "world"]
    return ["dp"]


# Parameters that record what a build sampled rather than what it was built with.
_SAMPLED = ("clock_sample", "nested_steps")


def _compared(params: dict[str, Any]) -> dict[str, Any]:
    """What must be the same for an extension to equal a build from scratch."""
    return {k: v for k, v in params.items() if k not in _SAMPLED}


def _old_tables(con: duckdb.DuckDBPyConnection, root: Path, meta: dict[str, Any], *, held: bool) -> bool:
    """``ms_cache.old_<table>`` for each base table, as the cache ``meta`` describes them: copied
    from this process's own base tables where they are that cache's (``held``: a dashboard
    refreshing its run), else read from its files."""
    if held:
        try:
            for table in BASE_TABLES:
                con.execute(f"CREATE OR REPLACE TABLE {_sql.CACHE_SCHEMA}.old_{table} AS "
                            f"SELECT * FROM {_sql.CACHE_SCHEMA}.{table}")
            return True
        except duckdb.Error as exc:
            log.info("analysis cache: base tables in memory unusable (%s)", exc)
            persist.drop(con, BASE_TABLES, prefix="old_")
    return persist.load(con, root, meta, BASE_TABLES, prefix="old_")


def _peer_kinds(shape: Any) -> list[str]:
    """Groups whose members do the same work: TP and DP; with one stage every group (a DDP or
    FSDP job's world, as torch.profiler's traces name it)."""
    return ["tp", "dp"] if shape and shape[1] > 1 else ["tp", "dp", "pp", "other"]


def peer_kinds_sql(con: duckdb.DuckDBPyConnection) -> _sql.Raw:
    """:func:`_peer_kinds` of the run (after ``rank_info``), as a SQL list of group kinds, every
    kind but tp, dp and pp read as ``other``."""
    return kinds_sql(_peer_kinds(_sql.first(_sql.execute(con, "base", "rank_shape"))))


def kinds_sql(kinds: list[str]) -> _sql.Raw:
    """``kinds`` as a SQL list of strings."""
    return _sql.Raw("[" + ", ".join(f"'{k}'" for k in kinds) + "]::VARCHAR[]")


def _sums_source(con: duckdb.DuckDBPyConnection) -> tuple[str, str]:
    """Where rank_step's per-(rank, step, group) sums come from: (the spans view it aggregates,
    the CTE of ``sql/base.sql`` it reads). The writers' sums (view ``step_sums``) where every
    spans file has them; the spans where none has (or the views are not the store's); else both."""
    try:
        row = _sql.first(con.execute("SELECT step_sums, spans_unsummed FROM store_parts"))
    except duckdb.Error:
        row = None
    if not row or not row[0]:
        return "spans", "spans_lvl"
    return ("spans_unsummed", "both_lvl") if row[1] else ("spans", "sums_lvl")


def _rank_step(con: duckdb.DuckDBPyConnection, params: dict[str, Any], *, where: str = "true",
               metrics_where: str = "true") -> None:
    spans, lvl = _sums_source(con)
    if lvl != "spans_lvl":
        try:
            _rank_step_from(con, params, spans, lvl, where, metrics_where)
            return
        except duckdb.Error as exc:  # a damaged twin: the spans say the same
            log.info("step sums unreadable (%s); summing the spans", exc)
    _rank_step_from(con, params, "spans", "spans_lvl", where, metrics_where)


# At most this many step_sums files have their footers read to narrow the search for rows split
# across files (_split_filter): a compacted run has a few dozen; a run of parts has thousands
# (read through a glob), and its rows are searched instead.
SPLIT_CHECK_MAX_FILES = 2000
# Ranks searched by name at most; past it every row is searched.
SPLIT_CHECK_MAX_RANKS = 256


def _split_filter(con: duckdb.DuckDBPyConnection) -> str:
    """A predicate on ``s.rank`` for the step_sums rows that may be split across files.

    Within one file a (rank, step, group) has one row (a writer's part, or a compacted file's
    sums rebuilt from its rows), so a split needs two files whose rank ranges and step ranges
    overlap: the ranks where they do, from the files' footers. 'true' (every row) where the
    footers cannot tell: a glob of parts, a file without statistics, a step without a value."""
    files = persist.view_files(con, "step_sums")
    if not files or len(files) > SPLIT_CHECK_MAX_FILES:
        return "true"
    try:
        rows = con.execute(
            "SELECT file_name, path_in_schema, min(TRY_CAST(stats_min_value AS BIGINT)), "
            "max(TRY_CAST(stats_max_value AS BIGINT)), bool_or(stats_min_value IS NULL OR stats_max_value IS NULL), "
            "sum(stats_null_count) FROM parquet_metadata(?) WHERE path_in_schema IN ('rank', 'step') GROUP BY ALL",
            [files]).fetchall()
    except duckdb.Error:
        return "true"
    boxes: dict[str, dict[str, tuple[int, int]]] = {}
    for name, column, low, high, unknown, nulls in rows:
        if unknown or low is None or high is None or nulls is None or nulls > 0:
            return "true"
        boxes.setdefault(name, {})[column] = (int(low), int(high))
    if len(boxes) != len(set(files)) or any(len(b) != 2 for b in boxes.values()):
        return "true"
    ordered = sorted((b["rank"], b["step"]) for b in boxes.values())
    shared: list[tuple[int, int]] = []
    for i, ((_low, r1), (s0, s1)) in enumerate(ordered):
        for (q0, q1), (t0, t1) in ordered[i + 1:]:
            if q0 > r1:
                break
            if t0 <= s1 and s0 <= t1:
                shared.append((q0, min(r1, q1)))
    if not shared:
        return "false"
    merged: list[list[int]] = []
    for low, high in sorted(shared):
        if merged and low <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], high)
        else:
            merged.append([low, high])
    if sum(high - low + 1 for low, high in merged) > SPLIT_CHECK_MAX_RANKS:
        return "true"
    return "(" + " OR ".join(f"s.rank BETWEEN {low} AND {high}" for low, high in merged) + ")"


# The step_sums columns that tell a group of gradient reductions whose waits the backward hid
# (sql/base.sql, rank_step), as sums_lvl reads them from one row and from rows combined.
_HIDDEN_ONE = ("s.reduce_spans, s.wait_spans, s.backward_start_ns AS bwd_start_raw, "
               "s.backward_end_ns AS bwd_end_raw, s.reduce_side_spans, "
               "s.reduce_arrival_rel_ns::HUGEINT + s.reduce_spans::HUGEINT * s.first_start_ns AS red_arrival_sum, "
               "s.reduce_first_ns AS red_first_raw, s.reduce_last_ns AS red_last_raw")
_HIDDEN_COMBINED = ("sum(s.reduce_spans)::BIGINT AS reduce_spans, sum(s.wait_spans)::BIGINT AS wait_spans, "
                    "min(s.backward_start_ns) AS bwd_start_raw, max(s.backward_end_ns) AS bwd_end_raw, "
                    "sum(s.reduce_side_spans)::BIGINT AS reduce_side_spans, "
                    "sum(s.reduce_arrival_rel_ns::HUGEINT + s.reduce_spans::HUGEINT * s.first_start_ns) AS red_arrival_sum, "
                    "min(s.reduce_first_ns) AS red_first_raw, max(s.reduce_last_ns) AS red_last_raw")
_HIDDEN_NONE = ("NULL::BIGINT AS reduce_spans, NULL::BIGINT AS wait_spans, NULL::BIGINT AS bwd_start_raw, "
                "NULL::BIGINT AS bwd_end_raw, NULL::BIGINT AS reduce_side_spans, NULL::HUGEINT AS red_arrival_sum, "
                "NULL::BIGINT AS red_first_raw, NULL::BIGINT AS red_last_raw")


def _sums_hidden(con: duckdb.DuckDBPyConnection) -> tuple[str, str]:
    """sums_lvl's columns of the hidden reductions: read where the twins have them, nulls where
    they come from a writer that had none (its groups then keep the extent as their bound)."""
    try:
        names = {d[0] for d in con.execute("SELECT * FROM step_sums LIMIT 0").description or ()}
    except duckdb.Error:
        names = set()
    if "reduce_last_ns" in names:
        return _HIDDEN_ONE, _HIDDEN_COMBINED
    return _HIDDEN_NONE, _HIDDEN_NONE


def _rank_step_from(con: duckdb.DuckDBPyConnection, params: dict[str, Any], spans: str, lvl: str, where: str,
                    metrics_where: str) -> None:
    split = _split_filter(con) if lvl != "spans_lvl" else "true"
    one, combined = _sums_hidden(con) if lvl != "spans_lvl" else (_HIDDEN_NONE, _HIDDEN_NONE)
    _sql.execute(con, "base", "rank_step", spans=spans, lvl=lvl, split_where=_sql.Raw(split),
                 sums_hidden=_sql.Raw(one), sums_hidden_combined=_sql.Raw(combined),
                 calls_prefix=_sql.Raw(COLLECTOR_CALLS_METRIC),
                 calls_prefix_len=len(COLLECTOR_CALLS_METRIC),
                 step_calls_prefix=_sql.Raw(COLLECTOR_STEP_CALLS_METRIC),
                 step_calls_prefix_len=len(COLLECTOR_STEP_CALLS_METRIC), where=_sql.Raw(where),
                 metrics_where=_sql.Raw(metrics_where),
                 peer_kinds=kinds_sql(params["peer_kinds"]), nested_kinds=kinds_sql(params["nested_kinds"]),
                 kernel_backward=_sql.Raw("true" if params.get("kernel_backward") else "false"),
                 dp_kinds=kinds_sql(params.get("dp_kinds", ["dp"])))


def _ranks_and_clock(con: duckdb.DuckDBPyConnection, say: Callable[[str], None]) -> list[int]:
    """The ranks and groups tables and each rank's clock offset; returns the run's steps."""
    say("reading ranks")
    _sql.execute(con, "base", "rank_info")
    _sql.execute(con, "base", "group_kind")
    steps = _steps(con)
    say("estimating clock offsets")
    _estimate_offsets(con, steps)
    _sql.execute(con, "base", "rank_clock")
    return steps


def _build(con: duckdb.DuckDBPyConnection, say: Callable[[str], None], steps: list[int] | None = None) -> dict[str, Any]:
    """Build the base tables from the parts (under the build lock); returns their parameters.
    ``steps``: the run's steps, where ``rank_info``, ``group_kind``, ``clock_offsets`` and
    ``rank_clock`` are current already (not estimated again)."""
    if steps is None:
        steps = _ranks_and_clock(con, say)
    say("matching collectives")
    _sql.execute(con, "base", "inst", where=_sql.Raw("true"))
    say("splitting step time per rank")
    params = _params(con, steps)
    _rank_step(con, params)
    _sql.execute(con, "base", "add_unknown_ranks")
    log.info("base tables built for %d steps", len(steps))
    return params
