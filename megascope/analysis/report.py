"""The post-mortem report: every analysis of a run in one JSON-ready dict.

Role in the data flow: ``megascope report RUN [--json]`` prints it; the dashboard's overview reads
it. The keys ``run``, ``mfu``, ``stragglers``, ``skew`` and ``hang`` are a contract
(ARCHITECTURE.md); the rest (``state``: running, stalled, hung, finished or failed and why, from
:mod:`megascope.analysis.runstate`; ``clock``, ``bubbles``, ``exposed_comm``, ``host_lead``,
``whatif``, ``problems``, ``stragglers_withheld``, ``stragglers_dismissed``) may grow. Each straggler carries a ``confidence``,
its ``p_value`` and the ``evidence`` that named it; a hung run names none.

Example::

    from megascope.store import open_run
    from megascope.analysis import report
    r = report(open_run("runs/demo"))
    r["stragglers"][0]["cause"]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import duckdb
import pandas as pd

from megascope.analysis import _sql, persist
from megascope.analysis.base import prepare
from megascope.analysis.hang import int_or_none, localize
from megascope.analysis.pipeline import bubbles, exposed_comm, host_lead_summary
from megascope.analysis.runstate import run_state
from megascope.analysis.skew import skew_by_collective, skew_drift
from megascope.analysis.stragglers import StragglerConfig, detect, lone_stages_own, told
from megascope.analysis.timeline import mfu, mfu_drift, steady_mean
from megascope.analysis.whatif import whatif
from megascope.schema import COLLECTOR_STAMPS_METRIC
from megascope.store import Run
from megascope.topology import coords_of


def clock_offsets(run: Run) -> pd.DataFrame:
    """Per host: offset_ns (add it to the host's times to put them on the reference clock, the
    clock of rank 0's host), error_ns (bound on the estimate; NULL without samples), samples
    (collective completions used). Hosts in no multi-host collective keep offset 0."""
    prepare(run.con)
    return _sql.query_df(run.con, "base", "offsets")


def jsonable(value: Any) -> Any:
    """Plain JSON types: NaN/NA -> None, numpy scalars -> Python numbers."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, str | bool):
        return value
    if hasattr(value, "item") and not isinstance(value, int | float):
        value = value.item()
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if value is pd.NA or value is pd.NaT:
        return None
    return value


# Device time one timing event costs between short kernels (1.7-2.9 us measured on H100s,
# docs/benchmarks.md): what the report multiplies the collector's stamps by.
STAMP_DEVICE_NS = 2_000
# The training thread's host time per timing event: an empty span (two stamps and its bookkeeping)
# took 5.9 us of it on one H100 (docs/benchmarks-log.md, "Collector cost in one process").
STAMP_HOST_NS = 3_000


def collector_footprint(con: duckdb.DuckDBPyConnection, step_time_ns: float | None,
                        host_bound: bool = False) -> dict[str, Any]:
    """What the collector itself cost the run, as far as its own records tell: the median number of
    stamps per rank and step and, on CUDA ranks, estimates of their device time (each stamp is a
    timing event, ~2 us of the device) and of the training thread's host time (~3 us a stamp).
    ``host_bound`` (some rank's device waited for its host, from
    :func:`megascope.analysis.pipeline.host_lead_summary`) is passed through: there the host time
    is step time too, and whole runs have lost more than both sums (a 4-GPU tp2 x dp2 job: 3-18%,
    docs/benchmarks.md), which only a run with the collector off measures. Empty
    (``stamps_per_step`` None) for runs without them."""
    row = _sql.first(_sql.execute(con, "report", "collector_stamps", stamps_metric=COLLECTOR_STAMPS_METRIC))
    if not row or not row[1] or row[0] is None:
        return {"stamps_per_step": None}
    stamps = float(row[0])
    device_ns = stamps * STAMP_DEVICE_NS if row[2] else None
    host_ns = stamps * STAMP_HOST_NS if row[2] else None
    return {
        "stamps_per_step": stamps,
        "device_ns_per_step_est": device_ns,
        "share_of_step_est": device_ns / step_time_ns if device_ns is not None and step_time_ns else None,
        "ns_per_stamp_assumed": STAMP_DEVICE_NS,
        "host_ns_per_step_est": host_ns,
        "host_share_of_step_est": host_ns / step_time_ns if host_ns is not None and step_time_ns else None,
        "host_ns_per_stamp_assumed": STAMP_HOST_NS,
        "host_bound": bool(host_bound),
    }


def gc_pauses(con: duckdb.DuckDBPyConnection, *, top: int = 8) -> dict[str, Any]:
    """Python garbage collections inside steps (the collector's ``gc.*`` host spans): how many
    ranks stopped for them, for how long in all, and the ``top`` ranks that stopped longest. A
    collection stops every thread of its rank, and in a synchronous job the others wait."""
    totals = _sql.first(_sql.execute(con, "report", "gc_totals"))
    ranks = _sql.execute(con, "report", "gc_ranks", top=int(top)).fetchall()
    return {
        "ranks_with_gc": int(totals[0]) if totals else 0,
        "ranks": int(totals[2]) if totals else 0,
        "total_ns": int(totals[1]) if totals else 0,
        "top": [{"rank": int(r), "steps": int(n), "total_ns": int(t), "max_step_ns": int(m)} for r, n, t, m in ranks],
    }


def _straggler_list(frame: pd.DataFrame, axes: tuple[str, ...]) -> list[dict[str, Any]]:
    out = []
    for _, row in frame.iterrows():
        out.append({
            "rank": int(row["rank"]), "host": row["host"], "coords": coords_of(row.get("coords"), axes),
            "phase": row["phase"], "slowdown": float(row["slowdown"]), "steps_slow_frac": float(row["steps_slow_frac"]),
            "cause": row["cause"], "excess_ns": row["excess_ns"], "last_arrival_frac": row["last_arrival_frac"],
            "late_at": row["late_at"], "steps": int(row["steps"]),
            "confidence": row.get("confidence"), "p_value": row.get("p_value"),
            "evidence": {
                "z": row.get("z"), "own_time_t": row.get("t_own"), "wait_caused_t": row.get("t_blame"),
                "last_arrival_z": row.get("last_z"), "compute_span_share": row.get("spans_share"),
                "compute_span_t": row.get("t_spans"), "pause_share": row.get("pause_share"),
                "device_idle_frac": row.get("device_idle_frac"),
                "cpu_slowdown": row.get("cpu_slowdown"), "tp_compute_ratio": row.get("tp_compute_ratio"),
                "dp_compute_ratio": row.get("dp_compute_ratio"), "outside_calls_ratio": row.get("outside_calls_ratio"),
                "slow_groups": list(row["slow_groups"]) if isinstance(row.get("slow_groups"), list) else None,
                "behind_rank": int_or_none(row.get("behind")),
            },
        })
    return out


def report(run: Run, *, progress: Callable[[str], None] | None = None,
           config: StragglerConfig | None = None, with_whatif: bool = True) -> dict[str, Any]:
    """Analyse ``run`` and return the ``megascope report --json`` object."""
    say = progress or (lambda msg: None)
    run = run.with_cursor()
    con = run.con
    # The base tables are written to the run's cache beside the analysis below, done when this returns.
    prepare(con, progress=say, save_later=True)
    try:
        return _report(run, say, config, with_whatif)
    finally:
        persist.wait_saves()


def _report(run: Run, say: Callable[[str], None], config: StragglerConfig | None,
            with_whatif: bool) -> dict[str, Any]:
    con = run.con
    axes = tuple(run.meta.mesh_axes)
    extent = _sql.first(_sql.execute(con, "report", "extent"))
    n_steps = int(extent[0]) if extent else 0
    say("localizing hangs")
    hang = localize(run)
    say("scoring stragglers")
    # In a hung run every rank is a hang suspect or its victim: the steps before the hang say
    # nothing an on-call engineer should act on first, so no straggler is named.
    slow, dismissed_frame = detect(run, config)
    if hang.get("hung"):
        slow = slow.iloc[0:0]
        dismissed_frame = dismissed_frame.iloc[0:0]
    withheld = "hung" if hang.get("hung") else None
    if withheld is None and slow.empty and not told(run):
        withheld = "no_peers"
    say("computing MFU")
    per_step = mfu(run)
    drift = mfu_drift(per_step) if not per_step.empty else {"drifting": False}
    median_step = float(per_step["step_time_ns"].median()) if not per_step.empty else None
    causal = slow[slow["cause"] != "communication"] if not slow.empty else slow
    replay: Future[dict[str, Any]] | None = None
    pool = side = None
    if with_whatif and not causal.empty and not per_step.empty:
        say("replaying steps without stragglers (beside the sections below)")
        # The replay is mostly Python: on a thread of its own (and a cursor of its own), beside
        # the SQL of the sections below, which leaves the interpreter free while it runs.
        side = run.with_cursor()
        pool = ThreadPoolExecutor(1, thread_name_prefix="megascope-whatif")
        replay = pool.submit(whatif, side, ranks=[int(r) for r in causal["rank"]], per_step=per_step)
    try:
        say("measuring skew")
        by_collective = skew_by_collective(run)
        skew_drifts = skew_drift(run, step_time_ns=median_step, by_collective=by_collective)
        state = run_state(run, hang=hang)
        say("pipeline bubbles and exposed communication")
        bubble_frame = bubbles(run)
        exposed = exposed_comm(run)
        lead = host_lead_summary(run)
        offsets = clock_offsets(run)
        leads = _sql.query_df(run.con, "base", "rank_leads")
        if replay is not None and not replay.done():
            say("finishing the replay")
        whatif_result = replay.result() if replay is not None else None
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
        if side is not None:
            side.con.close()
    mesh = {a: int(run.meta.mesh_sizes.get(a, 1)) for a in axes} if run.meta.mesh_sizes else run.mesh.size
    result = {
        "run": {
            "path": str(run.path), "source": run.meta.source, "run_id": run.meta.run_id,
            "world_size": run.meta.world_size, "mesh": mesh, "steps": n_steps,
            "first_step": extent[1] if extent else None, "last_step": extent[2] if extent else None,
            "ranks_seen": int(extent[3]) if extent else 0,
            "step_time_ns": median_step,
        },
        "mfu": {
            "mean": steady_mean(per_step, "mfu"),
            "tokens_per_s": steady_mean(per_step, "tokens_per_s"),
            "per_step": per_step[["step", "step_time_ns", "mfu", "tokens_per_s"]].to_dict("records"),
            "drift": drift,
            "missing": _mfu_missing(run.meta) if not per_step["mfu"].notna().any() else None,
        },
        "stragglers": _straggler_list(slow, axes),
        # Why the list is empty: "hung" (slow ranks are hang suspects or victims), "no_peers" (no
        # pipeline stage has two ranks, so no rank has a peer to be compared with).
        "stragglers_withheld": withheld,
        # With "no_peers": each rank's own time against all ranks' median, highest first (the
        # stages do different work; shown, never named: stragglers.lone_stages_own).
        "stages_own": ([{"rank": int(o["rank"]), "coords": coords_of(o["coords"], axes), "own_ns": float(o["own_ns"]),
                         "x": None if pd.isna(o["x"]) else float(o["x"])}
                        for o in lone_stages_own(run).to_dict("records")] if withheld == "no_peers" else None),
        # Ranks flagged for their host (or, on a data-parallel mesh timed on GPUs, their compute)
        # whose delay, replayed away, saves under 0.7% of the step (0.3% for compute): not named
        # (stragglers.dismissed).
        # saving_lower_bound: the replay saw only some of a group's calls (the collector timed them
        # in some micro-batches), so it may save more.
        "stragglers_dismissed": [
            {"rank": int(d["rank"]), "host": d["host"], "coords": coords_of(d["coords"], axes),
             "cause": d["cause"], "slowdown": d["slowdown"], "last_arrival_frac": d["last_arrival_frac"],
             "device_idle_frac": d["device_idle_frac"], "saving": d["saving"],
             "saving_lower_bound": bool(d["saving_lower_bound"])}
            for d in dismissed_frame.head(20).to_dict("records")],
        "skew": {
            "collectives": by_collective.head(20).to_dict("records"),
            "drift": skew_drifts,
        },
        "hang": hang,
        "state": state,
        "clock": {
            "hosts": len(offsets),
            "max_abs_offset_ns": int(offsets["offset_ns"].abs().max()) if not offsets.empty else 0,
            "max_error_ns": int(offsets["error_ns"].max()) if offsets["error_ns"].notna().any() else None,
            "offsets": offsets.head(64).to_dict("records"),
            # Device-timed ranks whose clock read late against their TP group's, put back by it.
            "ranks_put_back": leads.head(64).to_dict("records"),
        },
        "bubbles": bubble_frame.to_dict("records"),
        "exposed_comm": exposed.to_dict("records"),
        "host_lead": lead,
        "collector": collector_footprint(con, median_step, host_bound=bool(lead.get("host_bound"))),
        "gc": gc_pauses(con),
        "whatif": whatif_result,
        "problems": list(run.problems),
    }
    return jsonable(result)


def _mfu_missing(meta: Any) -> str:
    """Why a run has no MFU, and how a job gives it one."""
    need = [k for k in ("model_flops_per_step", "peak_flops_per_device") if getattr(meta, k, None) is None]
    if not need:
        return "no step spans to divide by"
    return (f"run.json has no {' and no '.join(need)}; in the job call col.set_model_flops(model, "
            "tokens_per_step=...) or count one step under col.count_flops() (docs/collector.md)")
