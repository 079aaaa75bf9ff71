"""Pipeline bubbles per stage, exposed communication per group kind, and how far hosts run ahead.

Role in the data flow: thin functions over ``sql/pipeline.sql``; the report and the dashboard
show them. Exposed communication needs an interval join of communication against compute spans,
so it runs on a few sampled steps (all steps of a small run).

Example::

    from megascope.analysis import bubbles, exposed_comm
    bubbles(run)              # stage, bubble_frac, ...
    exposed_comm(run)         # group_kind, name, exposed_frac, ...
    host_lead(run)            # rank, lead_p10_ns, starved_frac
    host_lead_summary(run)    # the same for the report, host-bound ranks named
    host_issue(run, steps=[4, 5], ranks=[0, 1])   # rank, steps, issue_ns: a host's time to issue a step
"""

from __future__ import annotations

from typing import Any

import duckdb
import pandas as pd

from megascope.analysis import _sql
from megascope.analysis.base import has_step_spans, prepare, sample_steps
from megascope.schema import RunSource
from megascope.store import Run

EXPOSED_SAMPLE_STEPS = 3
EXPOSED_RANKS_PER_STAGE = 4
# A call whose span starts within this of its issue found the device idle (launch latency is ~10 us).
HOST_STARVED_NS = 500_000


def _sample(con: duckdb.DuckDBPyConnection, steps: list[int] | None,
            ranks: list[int] | None = None) -> tuple[list[int], str]:
    """(steps, SQL list of ranks): ``steps`` or up to three spread over the run, and ``ranks`` or up
    to four per pipeline stage spread by hash (every stage, many hosts), so joins read few partitions."""
    prepare(con)
    if steps is None:
        all_steps = [int(s) for (s,) in _sql.execute(con, "pipeline", "sample_steps").fetchall()]
        steps = sample_steps(all_steps, EXPOSED_SAMPLE_STEPS)
    if ranks is None:
        ranks = [int(r) for (r,) in _sql.execute(con, "pipeline", "sample_ranks",
                                                 per_stage=EXPOSED_RANKS_PER_STAGE).fetchall()]
    return [int(s) for s in steps] or [-1], ", ".join(str(int(r)) for r in ranks) or "NULL"


def bubbles(run: Run) -> pd.DataFrame:
    """Per pipeline stage: stage, ranks, steps, bubble_ns, step_ns, bubble_frac."""
    prepare(run.con)
    return _sql.query_df(run.con, "pipeline", "bubbles", has_step_spans=has_step_spans(run.con))


def exposed_comm(run: Run, *, steps: list[int] | None = None) -> pd.DataFrame:
    """Per (group_kind, name): op, spans, comm_ns, overlapped_ns, exposed_ns, exposed_frac, calls,
    exposed_all_ns; exposed_ns_per_rank_step (exposed_ns over the sampled rank-steps: the stall one
    rank sees per step); timed_frac (spans / calls: below 1 where the collector timed a group kind's
    calls in some micro-batches only); and exposed_ns_per_rank_step_all, the same stall estimated
    for every call issued (untimed calls counted at the mean of timed calls of their op and size).

    ``steps`` defaults to up to three steps spread over the run; up to 4 ranks per pipeline stage
    are sampled. Definitions in ``sql/pipeline.sql``.
    """
    con = run.con
    step_list, rank_list = _sample(con, steps)
    df = _sql.query_df(con, "pipeline", "exposed", steps=step_list, ranks=_sql.Raw(rank_list))
    ((rank_steps,),) = _sql.execute(con, "pipeline", "rank_steps", ranks=_sql.Raw(rank_list),
                                    steps=step_list).fetchall()
    df["exposed_ns_per_rank_step"] = df["exposed_ns"].astype(float) / rank_steps if rank_steps else float("nan")
    df["timed_frac"] = (df["spans"] / df["calls"]).clip(upper=1.0)
    df["exposed_ns_per_rank_step_all"] = (df["exposed_all_ns"].astype(float) / rank_steps if rank_steps
                                          else float("nan"))
    return df


def host_lead(run: Run, *, steps: list[int] | None = None,
              ranks: list[int] | None = None) -> pd.DataFrame:
    """Per device-timed rank: calls, lead_p10_ns, lead_p50_ns, starved_frac: how far the host ran
    ahead of the device at each communication call (``sql/pipeline.sql``). Sampled like
    :func:`exposed_comm`, or the given ``ranks``. Empty for host-timed runs."""
    step_list, rank_list = _sample(run.con, steps, ranks)
    return _sql.query_df(run.con, "pipeline", "host_lead", steps=step_list, ranks=_sql.Raw(rank_list),
                         starved_ns=HOST_STARVED_NS)


# The report and the dashboard name a rank host-bound when its device was idle at this share of
# its calls, over at least this many calls.
HOST_BOUND_FRAC = 0.05
HOST_BOUND_MIN_CALLS = 20


def host_issue(run: Run, *, steps: list[int], ranks: list[int]) -> pd.DataFrame:
    """Per rank of ``ranks``: steps, issue_ns: the median time its host took to issue a step's
    communication calls over ``steps`` (``sql/pipeline.sql``)."""
    step_list, rank_list = _sample(run.con, steps, ranks)
    return _sql.query_df(run.con, "pipeline", "host_issue", steps=step_list, ranks=_sql.Raw(rank_list))


def host_lead_summary(run: Run) -> dict[str, Any]:
    """``{ranks, host_bound, starved_ns}``: :func:`host_lead` of the sampled ranks (least lead first,
    at most 64) and the host-bound ones among them. Synthetic runs stamp issue and start alike, with
    no host ahead of a device: they get empty lists."""
    lead = host_lead(run) if run.meta.source != RunSource.SYNTH else pd.DataFrame()
    if lead.empty:
        return {"ranks": [], "host_bound": [], "starved_ns": HOST_STARVED_NS}
    bound = lead[(lead["starved_frac"] >= HOST_BOUND_FRAC) & (lead["calls"] >= HOST_BOUND_MIN_CALLS)]
    return {
        "ranks": lead.sort_values(["starved_frac", "lead_p10_ns"], ascending=[False, True]).head(64).to_dict("records"),
        "host_bound": bound.sort_values("starved_frac", ascending=False).to_dict("records"),
        "starved_ns": HOST_STARVED_NS,
    }
