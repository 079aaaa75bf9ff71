"""What-if: the step time and MFU the job would have if its stragglers ran at their peers' median.

Role in the data flow: reads the base tables for a few sampled steps and replays each step
through a model of its dependencies; the report's ``whatif`` section calls it.

The model, per step: every rank runs a chain ``own work -> communication op -> own work -> ...``.
Own segments are measured (arrival at op k minus completion of op k-1). A collective completes
when its last member arrives plus its measured transfer time; a pipeline send/receive pair
likewise. A call waited for later (the collector's ``<name>:wait`` span) holds its rank at the
wait, not where it was issued, and one waited for in a later step holds nothing in this one: a
data-parallel job's overlapped gradient reductions modeled as blocking made the modeled step
3.5-14x the measured one on 4x H100 runs, and every saving as much smaller. Replaying the
measured segments reproduces the measured step (the model's baseline);
replaying with each straggler's segments replaced by its stage peers' median segments gives the
step time without stragglers. The answer is the measured step time scaled by
``fixed / baseline``, so the model's own bias cancels. Because waits propagate through
collectives and pipeline sends, this is not ``step - excess``: a straggler in a stage whose
slack absorbs it saves nothing, one on the critical path saves all.

The replay knows device time alone. Where the other ranks' devices waited for their hosts (a
host-bound job), a fixed step cannot be shorter than the time those hosts take to issue one
(``pipeline.host_issue``), and the answer is held to it: on a host-bound Megatron-core tp2 job of
2x H200 whose rank ran 1.5x slow, the replay alone said 203 -> 120 ms, while the job ran at
176-187 ms a step before the fault began and its partner's host took 183 ms to issue a step.

Example::

    from megascope.analysis import whatif
    whatif(run)["speedup"]
"""

from __future__ import annotations

import json
import logging
from typing import Any

import duckdb
import numpy as np
import pandas as pd

from megascope.analysis import _sql, persist
from megascope.analysis.base import dp_kinds, kernel_traced, kinds_sql, prepare, sample_steps
from megascope.analysis.pipeline import HOST_BOUND_FRAC, HOST_BOUND_MIN_CALLS, host_issue, host_lead
from megascope.analysis.stragglers import replay_lower_bound, stragglers
from megascope.analysis.timeline import mfu
from megascope.schema import RunSource
from megascope.store import Run

log = logging.getLogger(__name__)

# Steps replayed: as many as hold WHATIF_SMALL_BUDGET events, at least WHATIF_SAMPLE_STEPS and at
# most WHATIF_MAX_STEPS, never more than WHATIF_EVENT_BUDGET events (the replay is Python, ~15 µs
# an event): all 16 steps of an 8-rank run, 5 at 1,024 ranks, 1 at 12,288. Three steps alone were
# too few to dismiss a rank on (stragglers._replay_savings): a 100 ms pause before the gradient sync
# of a dp8 CPU run saved 1-10% in 10 of its 15 steps after the warm-up and nothing in 4, and the
# three steps sampled were three of those 4.
WHATIF_SAMPLE_STEPS = 3
WHATIF_MAX_STEPS = 16
WHATIF_SMALL_BUDGET = 100_000
WHATIF_EVENT_BUDGET = 400_000


def replay_step_count(events_per_step: float) -> int:
    """How many steps a replay covers, for steps of ``events_per_step`` calls (see above)."""
    per_step = max(events_per_step, 1.0)
    wanted = min(WHATIF_MAX_STEPS, max(WHATIF_SAMPLE_STEPS, int(WHATIF_SMALL_BUDGET // per_step)))
    return int(max(1, min(wanted, WHATIF_EVENT_BUDGET // per_step)))


def gain_words(speedup: float) -> str:
    """What a what-if ``speedup`` (step time over fixed step time) means, in one unambiguous
    phrase the report and the dashboard share: both the step's shortening and the throughput's
    gain, which differ (a step 674.7 -> 444.2 ms is 34.2% shorter and +51.9% throughput)."""
    shorter = 100 * (1 - 1 / speedup) if speedup > 0 else 0.0
    faster = 100 * (speedup - 1)

    def pct(x: float) -> str:
        return f"{x:.2f}" if abs(x) < 1 else f"{x:.1f}"

    return f"steps {pct(shorter)}% shorter, throughput {'+' if faster >= 0 else ''}{pct(faster)}%"


def _simulate(rank_of_row: np.ndarray, inst_of_row: np.ndarray, own: np.ndarray, tail: dict[int, float],
              xfer: np.ndarray, posted: np.ndarray, start: dict[int, float], waiter: np.ndarray) -> float:
    """Replay one step; rows are ordered by (rank, op order). Returns the modeled step time.

    ``posted`` rows (sends, calls waited for later) contribute their arrival to the instance but
    do not block the rank. ``waiter`` rows (the wait for such a call) are no arrival: they hold
    the rank until the instance completes.

    Each rank runs down its rows until an instance it must wait for is incomplete; the last
    arrival of an instance completes it and releases the ranks held there. The result depends on
    the dependencies alone, not on the order the ranks are taken in.
    """
    n = len(rank_of_row)
    if n == 0:
        return 0.0
    # Ranks by position j: each one's rows are the run [los[j], his[j]).
    cuts = np.flatnonzero(rank_of_row[1:] != rank_of_row[:-1]) + 1
    los: list[int] = np.concatenate(([0], cuts)).tolist()
    his: list[int] = np.concatenate((cuts, [n])).tolist()
    ranks: list[int] = rank_of_row[los].tolist()
    n_inst = int(inst_of_row.max()) + 1
    waits = waiter.astype(bool)
    need = np.bincount(inst_of_row[~waits], minlength=n_inst).tolist()
    inst_l, own_l, xfer_l = inst_of_row.tolist(), own.tolist(), xfer.tolist()
    posted_l, wait_l = posted.astype(bool).tolist(), waits.tolist()
    count = [0] * n_inst
    latest = [0.0] * n_inst
    done_at: list[float | None] = [None] * n_inst
    members: list[list[int]] = [[] for _ in range(n_inst)]
    waiting: list[list[tuple[int, float]]] = [[] for _ in range(n_inst)]
    t = [float(start.get(r, 0.0)) for r in ranks]
    ptr = list(los)
    ready = list(range(len(ranks) - 1, -1, -1))
    while ready:
        j = ready.pop()
        i, hi, tj = ptr[j], his[j], t[j]
        while i < hi:
            k = inst_l[i]
            arrival = tj + own_l[i]
            if wait_l[i]:
                finished = done_at[k]
                if finished is None:
                    waiting[k].append((j, arrival))
                    break
                tj = max(arrival, finished)
                i += 1
                continue
            count[k] += 1
            if arrival > latest[k]:
                latest[k] = arrival
            held = not posted_l[i]
            if held:
                members[k].append(j)
            else:
                tj = arrival
                i += 1
            if count[k] == need[k]:
                ptr[j], t[j] = i, tj
                done = done_at[k] = latest[k] + xfer_l[k]
                for m in members[k]:
                    t[m] = done
                    ptr[m] += 1
                    if m != j:
                        ready.append(m)
                for m, at in waiting[k]:
                    t[m] = max(at, done)
                    ptr[m] += 1
                    ready.append(m)
                i, tj = ptr[j], t[j]
            elif held:
                break
        ptr[j], t[j] = i, tj
    stuck = sum(1 for j in range(len(ranks)) if ptr[j] < his[j])
    if stuck:
        log.info("what-if replay: %d ranks never finished their chain", stuck)
    return max(t[j] + tail.get(r, 0.0) - start.get(r, 0.0) for j, r in enumerate(ranks))


def _float_map(series: pd.Series) -> dict[int, float]:
    return {int(k): float(v) for k, v in series.items()}  # type: ignore[call-overload]


def _steps_frame(con: duckdb.DuckDBPyConnection, steps: list[int]) -> pd.DataFrame:
    """Communication spans of ``steps`` with instance keys, on the reference clock (one scan of
    the spans, kept in the run's analysis cache for the next report; not in memory once read)."""
    step_list = ", ".join(str(int(s)) for s in steps) or "NULL"
    table = "whatif_" + "_".join(str(int(s)) for s in steps)[:200]
    if not persist.load_extra(con, table):
        kernels = kernel_traced(con)
        _sql.execute(con, "whatif", "events", table=table, steps=_sql.Raw(step_list),
                     kernel_backward=_sql.Raw("true" if kernels else "false"), dp_kinds=kinds_sql(dp_kinds(con, kernels)))
        persist.save_extra(con, table)
    try:
        return _sql.query_df(con, "whatif", "events_in_order", table=table)
    finally:
        _sql.execute(con, "whatif", "drop_events", table=table)


def _segments(frame: pd.DataFrame) -> tuple[np.ndarray, pd.Series]:
    """Own time before each op and after the last one, per rank.

    After a send the rank went on at once, so the next segment starts at the send's arrival; after
    a wait for a call that had already completed, at the wait's start.
    """
    resume = frame["end_ns"].clip(lower=frame["arrival_ns"]).where(~frame["posted"], frame["arrival_ns"])
    prev_end = resume.groupby(frame["rank"]).shift(1)
    start = prev_end.fillna(frame["step_start_ns"])
    own = (frame["arrival_ns"] - start).clip(lower=0).to_numpy(dtype=float)
    last = frame.assign(resume=resume).groupby("rank").tail(1).set_index("rank")
    tail = (last["step_end_ns"] - last["resume"]).clip(lower=0).astype(float)
    return own, tail


def replay_step(frame: pd.DataFrame, fixed_ranks: set[int]) -> tuple[float, float]:
    """(baseline, fixed) modeled step time of one step's communication frame, fixing ``fixed_ranks``."""
    frame = frame.reset_index(drop=True)
    if frame.empty:
        return 0.0, 0.0
    inst_of_row = frame["inst"].to_numpy(dtype=np.int64)
    xfer_by_inst = np.zeros(int(inst_of_row.max()) + 1)
    xfer_by_inst[inst_of_row] = frame["xfer_ns"].to_numpy(dtype=float)
    own, tail = _segments(frame)
    rank_arr = frame["rank"].to_numpy()
    posted = frame["posted"].to_numpy(dtype=bool)
    waiter = frame["waiter"].to_numpy(dtype=bool)
    firsts = frame.groupby("rank")["step_start_ns"].first()
    start = _float_map(firsts - firsts.min())
    base = _simulate(rank_arr, inst_of_row, own, _float_map(tail), xfer_by_inst, posted, start, waiter)
    if not fixed_ranks:
        return base, base
    frame = frame.assign(own=own, k=frame.groupby("rank").cumcount())
    peers = frame[~frame["rank"].isin(fixed_ranks)]
    peer_own = peers.groupby(["stage", "k"])["own"].median()
    fixed_own = own.copy()
    is_fixed = frame["rank"].isin(fixed_ranks).to_numpy()
    keys = pd.MultiIndex.from_frame(frame.loc[is_fixed, ["stage", "k"]])
    replacement = peer_own.reindex(keys).to_numpy()
    fixed_own[is_fixed] = np.where(np.isnan(replacement), own[is_fixed], replacement)
    stage_of = frame.groupby("rank")["stage"].first()
    peer_tail = tail[~tail.index.isin(fixed_ranks)].groupby(stage_of).median()
    fixed_tail = tail.copy()
    for r in fixed_ranks:
        if r in fixed_tail.index and stage_of.get(r) in peer_tail.index:
            fixed_tail[r] = peer_tail[stage_of[r]]
    fixed = _simulate(rank_arr, inst_of_row, fixed_own, _float_map(fixed_tail), xfer_by_inst, posted, start, waiter)
    return base, fixed


def host_held(result: dict[str, Any]) -> bool:
    """Whether a :func:`whatif` result was held to the hosts' pace (longer than its replay)."""
    floor, replayed = result.get("host_floor"), result.get("replay_step_time_ns")
    return bool(floor) and replayed is not None and float(result["whatif_step_time_ns"]) > float(replayed)


def host_floor(run: Run, steps: list[int], fixed: list[int]) -> dict[str, Any] | None:
    """The least time a step can take once ``fixed`` run at their peers' pace, set by the hosts of
    the other ranks whose devices waited for them: ``{ranks, rank, issue_ns}`` (the host-bound ranks
    among those :func:`host_lead` samples, and the one whose host issued a step fastest, in
    ``issue_ns``, the median over ``steps``); None where no other rank is host-bound (or the run is
    synthetic: its issue and start stamps are one)."""
    if run.meta.source == RunSource.SYNTH or not steps:
        return None
    lead = host_lead(run, steps=steps)
    if lead.empty:
        return None
    bound = lead[(lead["starved_frac"] >= HOST_BOUND_FRAC) & (lead["calls"] >= HOST_BOUND_MIN_CALLS)
                 & ~lead["rank"].isin(fixed)]
    if bound.empty:
        return None
    issue = host_issue(run, steps=steps, ranks=[int(r) for r in bound["rank"]]).dropna(subset=["issue_ns"])
    if issue.empty:
        return None
    fastest = issue.loc[issue["issue_ns"].idxmin()]
    return {"ranks": sorted(int(r) for r in bound["rank"]), "rank": int(fastest["rank"]),
            "issue_ns": float(fastest["issue_ns"])}


def whatif(run: Run, *, ranks: list[int] | None = None, steps: list[int] | None = None,
           per_step: pd.DataFrame | None = None, hosts: bool = True) -> dict[str, Any]:
    """Step time and MFU if ``ranks`` (default: the detected stragglers) ran at their peers' median.

    Returns {ranks, steps_modeled, step_time_ns (measured median), modeled_baseline_ns,
    modeled_fixed_ns, whatif_step_time_ns, speedup, step_savings, mfu, whatif_mfu, lower_bound,
    replay_step_time_ns, host_floor}. ``lower_bound``:
    some communication calls were not timed (the collector timed a group's calls in some
    micro-batches only), so the replay cannot free the waits behind them and the speedup is a
    lower bound. ``replay_step_time_ns``: the replay's answer; ``whatif_step_time_ns`` is held to
    ``host_floor["issue_ns"]`` where that is longer (:func:`host_floor`; None where no other rank is
    host-bound), and never above the measured step; ``hosts=False`` leaves the hosts out (the
    replay's answer, ``host_floor`` None). ``per_step``: :func:`megascope.analysis.timeline.mfu`
    of the run, where the caller has it.
    """
    con = run.con
    prepare(con)
    if ranks is None:
        found = stragglers(run)
        ranks = [int(r) for r, c in zip(found["rank"], found["cause"], strict=True) if c != "communication"]
    if per_step is None:
        per_step = mfu(run)
    measured = float(per_step["step_time_ns"].median()) if not per_step.empty else 0.0
    mean_mfu = float(per_step["mfu"].mean()) if per_step["mfu"].notna().any() else None
    if steps is None:
        full = per_step[per_step["ranks"] == per_step["ranks"].max()]["step"].astype(int).tolist()
        row = _sql.first(_sql.execute(con, "whatif", "events_per_step"))
        per_step_events = float(row[0]) if row and row[0] else 1.0
        # The first step (warm-up: allocations, first calls) is left out where there are others.
        steps = sample_steps(full[1:] if len(full) > 1 else full, replay_step_count(per_step_events))
    # The replay is a deterministic function of the base tables, the steps and the ranks fixed:
    # kept in the run's analysis cache, a second report does not replay again.
    memo_name = f"whatif-steps:{json.dumps({'steps': [int(s) for s in steps], 'ranks': sorted(int(r) for r in ranks)})}"
    memo = persist.memo_get(con, memo_name)
    if isinstance(memo, list) and all(isinstance(v, list) and len(v) == 2 for v in memo):
        pairs = [(float(b), float(f)) for b, f in memo]
    else:
        frames = _steps_frame(con, [int(s) for s in steps])
        pairs = [replay_step(frame, set(ranks)) for _, frame in frames.groupby("step", sort=True)]
        persist.memo_put(con, memo_name, [[float(b), float(f)] for b, f in pairs])
    base_total, fixed_total = sum(b for b, _ in pairs), sum(f for _, f in pairs)
    speedup = base_total / fixed_total if fixed_total > 0 else 1.0
    # Calls the collector left untimed (CollectorConfig.comm_sample_kinds) are no sync points of
    # the replay: the waits behind them count as the waiting ranks' own work, and the fix saves less.
    lower_bound = replay_lower_bound(run)
    replayed = measured / speedup if speedup > 0 else measured
    # A replay whose fix came out longer than the steps it modeled found no saving (its model of
    # the step, not the fix, is what differs): the step stays as measured.
    fixed_step = min(replayed, measured)
    speedup = max(speedup, 1.0)
    floor = host_floor(run, [int(s) for s in steps], [int(r) for r in ranks]) if ranks and hosts else None
    if floor is not None and floor["issue_ns"] > replayed:
        fixed_step = min(floor["issue_ns"], measured)
        speedup = measured / fixed_step if fixed_step > 0 else 1.0
    return {
        "ranks": ranks,
        "steps_modeled": [int(s) for s in steps],
        "step_time_ns": measured,
        "modeled_baseline_ns": base_total / len(steps) if steps else None,
        "modeled_fixed_ns": fixed_total / len(steps) if steps else None,
        "whatif_step_time_ns": fixed_step,
        "replay_step_time_ns": replayed,
        "host_floor": floor,
        "speedup": speedup,
        # Per step of steps_modeled: the share of its modeled time the fix saves (negative: it lengthens).
        "step_savings": [1.0 - f / b if b > 0 else 0.0 for b, f in pairs],
        "mfu": mean_mfu,
        "whatif_mfu": mean_mfu * speedup if mean_mfu is not None else None,
        "lower_bound": lower_bound,
    }
