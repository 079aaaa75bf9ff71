"""Build (once per run, again when it grows) the base tables every analysis reads.

Role in the data flow: ``store`` gives views over the Parquet parts; this module turns them into
the small derived tables of ``sql/base.sql`` in schema ``ms_cache``: rank places and clocks,
communication instances and the (rank, step) time split. Analyses call :func:`prepare` first;
it returns at once when the tables are current.

Clock offsets are estimated here because every cross-host comparison needs them: members of a
collective finish together, so each host's median deviation from its instances' median
completion is its clock offset. Two passes, the second on corrected times, settle it when many
hosts are off at once.

Example::

    from megascope.analysis.base import prepare
    prepare(run.con)
    run.con.sql("SELECT * FROM ms_cache.rank_step LIMIT 5")
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import duckdb
import pandas as pd

from megascope.analysis import _sql

log = logging.getLogger(__name__)

Progress = Callable[[str], None] | None

# Steps sampled for clock-offset estimation: enough samples per host, a bounded cost at any size.
CLOCK_SAMPLE_STEPS = 8
CLOCK_PASSES = 2
_BASE_TABLES = ("rank_info", "clock_offsets", "rank_clock", "comm", "inst", "rank_step")


def _sample_steps(steps: list[int], count: int) -> list[int]:
    if len(steps) <= count:
        return steps
    # Evenly spaced, skipping the first step (warm-up) when there is a choice.
    pool = steps[1:] if len(steps) > count + 1 else steps
    stride = len(pool) / count
    return sorted({pool[int(i * stride)] for i in range(count)})


def _estimate_offsets(con: duckdb.DuckDBPyConnection, steps: list[int]) -> pd.DataFrame:
    con.execute(
        "CREATE OR REPLACE TABLE ms_cache.clock_offsets (host VARCHAR, offset_ns BIGINT, error_ns BIGINT, samples BIGINT)"
    )
    _sql.execute(con, "base", "clock_samples", steps=_sample_steps(steps, CLOCK_SAMPLE_STEPS) or [-1])
    hosts = [h for (h,) in con.execute("SELECT host FROM ms_cache.rank_info GROUP BY host ORDER BY min(rank)").fetchall()]
    offsets = pd.DataFrame({"host": hosts, "offset_ns": 0.0, "error_ns": math.nan, "samples": 0})
    for _ in range(CLOCK_PASSES):
        passed = _sql.query_df(con, "base", "clock_pass")
        if passed.empty:
            break
        merged = offsets.merge(passed, on="host", how="left")
        offsets["offset_ns"] = merged["offset_ns"] - merged["dev_ns"].fillna(0.0)
        # The spread of one sample over the square root of their number bounds the median's error.
        offsets["error_ns"] = 1.4826 * merged["mad_ns"] / merged["samples"].clip(lower=1) ** 0.5
        offsets["samples"] = merged["samples"].fillna(0).astype("int64")
        ref = offsets["offset_ns"].iloc[0] if len(offsets) else 0.0
        offsets["offset_ns"] = offsets["offset_ns"] - ref
        con.execute("DELETE FROM ms_cache.clock_offsets")
        con.register("_ms_offsets_df", offsets.assign(offset_ns=offsets["offset_ns"].round().astype("int64")))
        con.execute(
            "INSERT INTO ms_cache.clock_offsets SELECT host, offset_ns, "
            "CASE WHEN isnan(error_ns) THEN NULL ELSE ceil(error_ns)::BIGINT END, samples FROM _ms_offsets_df"
        )
        con.unregister("_ms_offsets_df")
    con.execute("DROP TABLE IF EXISTS ms_cache.clock_samples")
    return offsets


def prepare(con: duckdb.DuckDBPyConnection, *, progress: Progress = None) -> None:
    """Build the base tables unless they are current for this run's files."""
    with _sql.build_lock():
        _sql.ensure_schema(con)
        if _sql.cache_is_fresh(con, "base"):
            return
        say = progress or (lambda msg: None)
        say("reading ranks")
        _sql.execute(con, "base", "rank_info")
        steps = [int(s) for (s,) in _sql.execute(con, "base", "step_list").fetchall()]
        say("estimating clock offsets")
        _estimate_offsets(con, steps)
        _sql.execute(con, "base", "rank_clock")
        say("matching collectives")
        _sql.execute(con, "base", "comm")
        _sql.execute(con, "base", "inst")
        say("splitting step time per rank")
        _sql.execute(con, "base", "rank_step")
        _sql.mark_built(con, "base")
        log.info("base tables built for %d steps", len(steps))
