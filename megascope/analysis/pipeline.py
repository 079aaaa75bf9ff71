"""Pipeline bubbles per stage and exposed communication per group kind.

Role in the data flow: thin functions over ``sql/pipeline.sql``; the report and the dashboard
show them. Exposed communication needs an interval join of communication against compute spans,
so it runs on a few sampled steps (all steps of a small run).

Example::

    from megascope.analysis import bubbles, exposed_comm
    bubbles(run.con)          # stage, bubble_frac, ...
    exposed_comm(run.con)     # group_kind, name, exposed_frac, ...
"""

from __future__ import annotations

import duckdb
import pandas as pd

from megascope.analysis import _sql
from megascope.analysis.base import _sample_steps, prepare
from megascope.analysis.timeline import _has_step_spans

EXPOSED_SAMPLE_STEPS = 3
EXPOSED_RANKS_PER_STAGE = 4


def bubbles(con: duckdb.DuckDBPyConnection) -> pd.DataFrame:
    """Per pipeline stage: stage, ranks, steps, bubble_ns, step_ns, bubble_frac."""
    prepare(con)
    return _sql.query_df(con, "pipeline", "bubbles", has_step_spans=_has_step_spans(con))


def exposed_comm(con: duckdb.DuckDBPyConnection, *, steps: list[int] | None = None) -> pd.DataFrame:
    """Per (group_kind, name): spans, comm_ns, overlapped_ns, exposed_ns, exposed_frac, and
    exposed_ns_per_rank_step (exposed_ns over the sampled rank-steps: the stall one rank sees per step).

    ``steps`` defaults to up to three steps spread over the run; up to 4 ranks per pipeline stage
    are sampled. Definitions in ``sql/pipeline.sql``.
    """
    prepare(con)
    if steps is None:
        all_steps = [int(s) for (s,) in con.execute("SELECT DISTINCT step FROM ms_cache.rank_step ORDER BY step").fetchall()]
        steps = _sample_steps(all_steps, EXPOSED_SAMPLE_STEPS)
    # A spread sample of ranks (every stage, many hosts): the overlap join reads only their partitions.
    ranks = [int(r) for (r,) in con.execute(
        f"SELECT rank FROM (SELECT rank, row_number() OVER (PARTITION BY stage ORDER BY hash(rank)) AS k "
        f"FROM ms_cache.rank_info) WHERE k <= {EXPOSED_RANKS_PER_STAGE} ORDER BY rank"
    ).fetchall()]
    step_list = [int(s) for s in steps] or [-1]
    rank_list = ", ".join(map(str, ranks)) or "NULL"
    df = _sql.query_df(con, "pipeline", "exposed", steps=step_list, ranks=_sql.Raw(rank_list))
    ((rank_steps,),) = con.execute(
        f"SELECT count(*) FROM ms_cache.rank_step WHERE rank IN ({rank_list}) AND list_contains(?, step)",
        [step_list]).fetchall()
    df["exposed_ns_per_rank_step"] = df["exposed_ns"].astype(float) / rank_steps if rank_steps else float("nan")
    return df
