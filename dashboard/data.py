"""What the pages show, computed once per run generation: thin cached calls into megascope.analysis.

Role in the data flow: every number on a page or on ``/metrics`` comes through here, from
:mod:`megascope.analysis` (MFU, stragglers, states, hang suspects, heat-maps, what-if, bubbles,
host lead, clock offsets) or from :mod:`megascope.dashboard.queries` (raw rows). Each function takes a
:class:`~megascope.dashboard.runs.ServedRun` and returns a frame or dict shared by all callers
until new data arrives. ``WARM`` lists the results the watcher precomputes after each refresh.

Example::

    per_step = data.per_step(served)       # DataFrame[step, step_time_ns, mfu, tokens_per_s]
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pandas as pd
from megascope.dashboard import queries
from megascope.dashboard.runs import ServedRun

from megascope.store import Run

log = logging.getLogger(__name__)

# At most this many rank rows: each keeps its bin's worst cell, and each gets a few pixels (a row
# thinner than a pixel is dropped when the browser scales the image down).
HEATMAP_MAX_RANKS = 256
HEATMAP_MAX_STEPS = 400


def _analysis() -> Any:
    # Imported on first use: the analysis modules load SQL files and are not needed to start up.
    from megascope import analysis

    return analysis


def _compute_per_step(run: Run) -> pd.DataFrame:
    return _analysis().mfu(run)


def _compute_stragglers(run: Run) -> tuple[pd.DataFrame, pd.DataFrame]:
    # One pass gives the named and the dismissed ranks (candidates, launch check, replays).
    return _analysis().stragglers_detect(run)  # type: ignore[no-any-return]


def _compute_stragglers_told(run: Run) -> bool:
    return bool(_analysis().stragglers_told(run))


def _compute_skew_drift(run: Run) -> dict[str, Any]:
    return dict(_analysis().skew_drift(run))


def _compute_hang(run: Run) -> dict[str, Any]:
    return dict(_analysis().localize(run))


# What a page shows of the hang analysis while the run is not hung: nothing.
_NO_HANG: dict[str, Any] = {"hung": False, "suspects": [], "waiting": [], "stuck_groups": [], "stuck_group_count": 0,
                            "silent": []}


def _compute_whatif(run: Run) -> dict[str, Any]:
    return dict(_analysis().whatif(run))


def _compute_offsets(run: Run) -> pd.DataFrame:
    return _analysis().clock_offsets(run)


def _compute_bubbles(run: Run) -> pd.DataFrame:
    return _analysis().bubbles(run)


def _compute_host_lead(run: Run) -> dict[str, Any]:
    return dict(_analysis().host_lead_summary(run))


def _compute_skew(run: Run) -> pd.DataFrame:
    return _analysis().skew(run)


def _compute_loss(run: Run) -> pd.DataFrame:
    return queries.metric_per_step(run.con, "loss")


def _compute_ranks(run: Run) -> pd.DataFrame:
    return queries.rank_info(run)


def per_step(served: ServedRun) -> pd.DataFrame:
    """``step, step_time_ns, mfu, tokens_per_s`` (analysis.mfu)."""
    return served.result(("per_step",), _compute_per_step)


def live_per_step(served: ServedRun) -> pd.DataFrame:
    """:func:`per_step`, then the steps the step sums' follower (``ServedRun.follow``) has read
    beyond its last step: on a big live run the analyses come later, the overview's step time
    and MFU do not wait for them. Only steps every rank has ended count: a step's time is the
    median of its ranks', and a step seen from the ranks that finished it first is faster than
    the job's (the slowest ranks are the ones missing)."""
    frame = per_step(served)
    followed = served.live_steps()
    if followed is None or followed.empty:
        return frame
    last = int(frame["step"].max()) if len(frame) else -1
    world = served.run.meta.world_size if served.run is not None else None
    newer = followed[(followed["step"] > last) & (followed["ranks"] >= (world or 0))]
    if newer.empty:
        return frame
    return pd.concat([frame, newer[[c for c in frame.columns if c in newer.columns]]], ignore_index=True)


def stragglers(served: ServedRun) -> pd.DataFrame:
    """One row per straggler, worst first (analysis.stragglers)."""
    return served.result(("stragglers",), _compute_stragglers)[0]


def rank_states(served: ServedRun) -> pd.DataFrame:
    """``rank, host, pp, dp, tp, state`` (analysis.rank_states, reusing the cached stragglers and hang).

    Waiting, silent and hung ranks are marked only while the run state is hung (calls in flight
    of a running job are not a hang); in a failed run, the rank its state names is ``failed``, and
    the ranks its state says were left waiting for it in a call until stopped are ``waiting``.
    """
    slow, shown = stragglers(served), hang(served)
    state = run_state(served)
    failed = state["culprit"] if state["state"] == "failed" and state.get("culprit") else None

    def compute(run: Run) -> pd.DataFrame:
        states = _analysis().rank_states(run, stragglers_frame=slow, hang=shown)
        if shown["hung"] and shown.get("suspects"):
            # The culprit is drawn as the culprit, even where it also went silent (it stopped).
            culprit = int(shown["suspects"][0]["rank"])
            states.loc[states["rank"] == culprit, "state"] = "hung"
        if failed is not None:  # the rank a failed run's state names (it died, left or raised first)
            # the ranks left waiting for it in a call until stopped (NCCL), where it died so
            states.loc[states["rank"].isin([int(r) for r in failed.get("waiting") or []]), "state"] = "waiting"
            states.loc[states["rank"] == int(failed["rank"]), "state"] = "failed"
        return states

    key = ("rank_states", bool(shown["hung"]), None if failed is None else int(failed["rank"]))
    return served.result(key, compute)


def skew_drift(served: ServedRun) -> dict[str, Any]:
    """``{drifting, collectives: [{name, group_kind, late_growth_ns, ranks}]}`` (analysis.skew_drift)."""
    return served.result(("skew_drift",), _compute_skew_drift)


def mfu_drift(served: ServedRun) -> dict[str, Any]:
    """``{drifting, change_frac, ...}``: does step time (hence MFU) drift (analysis.mfu_drift)."""
    frame = per_step(served)
    return served.result(("mfu_drift",), lambda run: dict(_analysis().mfu_drift(frame)))


def skew_alerts(served: ServedRun) -> list[str]:
    """One line per drifting collective, and one if step time drifts, for the overview's alerts."""
    lines = []
    drift = skew_drift(served)
    for item in drift.get("collectives") or []:
        ranks = ", ".join(str(r["rank"]) for r in (item.get("ranks") or [])[:5]) or "no single rank"
        lines.append(f"Skew growing: {item['name']} ({item['group_kind']}) last arrivals "
                     f"+{float(item['late_growth_ns']) / 1e6:.1f} ms later over the run; arriving last: {ranks}")
    steps = mfu_drift(served)
    if steps.get("drifting"):
        lines.append(f"MFU drift: step time changed {100 * float(steps.get('change_frac', 0.0)):+.1f}% over the run")
    return lines


def localized(served: ServedRun) -> dict[str, Any]:
    """``{hung, suspects, waiting, ...}`` as analysis.localize finds it in the data, whatever the run state."""
    return served.result(("hang",), _compute_hang)


def run_facts(served: ServedRun) -> dict[str, Any]:
    """The data behind the run state (analysis.runstate.run_facts), once per generation."""
    from megascope.analysis.runstate import run_facts as facts

    found = localized(served)
    return served.result(("run_facts",), lambda run: facts(run, hang=found))


def run_state(served: ServedRun) -> dict[str, Any]:
    """``{state, reason, last_data_age_s, culprit, ...}`` now (analysis.runstate): recomputed on
    every call from the cached facts, because a run goes from stalled to hung without new data.

    Hung and failed are told from the calls in flight, which only the full refresh reads. Where
    the job made progress after the files the analyses last read (the follower read newer steps;
    on a big run the full refresh comes minutes apart), those facts cannot tell a hung job from
    one that exited: the state stays stalled until a full refresh reads what came after."""
    from megascope.analysis.runstate import decide, duration_text

    state = decide(run_facts(served), last_write_ns=served.progress_seen_ns)
    seen, read = served.progress_seen_ns, served.refreshed_ns
    if state["state"] in ("hung", "failed") and seen is not None and read is not None and read < seen:
        state = {**state, "state": "stalled", "hung": False, "culprit": None,
                 "reason": (f"no progress on any rank for {duration_text(state['idle_s'])}; hung or exited is "
                            f"told once the files written since the last full read "
                            f"({duration_text((time.time_ns() - read) / 1e9)} ago) are read")}
    return state


def hang(served: ServedRun) -> dict[str, Any]:
    """``{hung, suspects, ...}`` (analysis.localize) when the run state is hung; else no hang at all."""
    if served.run is None or not run_state(served)["hung"]:
        return dict(_NO_HANG)
    # The run state decides, now: localize's own "hung" was judged when its result was cached
    # (at the last new data), and a run turns hung later without new data.
    return {**localized(served), "hung": True}


def whatif(served: ServedRun) -> dict[str, Any]:
    return served.result(("whatif",), _compute_whatif)


def clock_offsets(served: ServedRun) -> pd.DataFrame:
    return served.result(("clock_offsets",), _compute_offsets)


def bubbles(served: ServedRun) -> pd.DataFrame:
    return served.result(("bubbles",), _compute_bubbles)


def host_lead(served: ServedRun) -> dict[str, Any]:
    """``{ranks, host_bound, starved_ns}``: how far hosts ran ahead of their devices (analysis.host_lead_summary)."""
    return served.result(("host_lead",), _compute_host_lead)


def skew(served: ServedRun) -> pd.DataFrame:
    return served.result(("skew",), _compute_skew)


def loss(served: ServedRun) -> pd.DataFrame:
    """``step, value``: mean loss over the ranks that log it."""
    return served.result(("loss",), _compute_loss)


def ranks(served: ServedRun) -> pd.DataFrame:
    """``rank, host, pp, dp, tp`` of every rank."""
    return served.result(("ranks",), _compute_ranks)


def heatmap(served: ServedRun, phase: str) -> pd.DataFrame:
    """The rank x step frame of ``phase``, binned server-side to at most 256 x 400 cells."""
    return served.result(
        ("heatmap", phase),
        lambda run: _analysis().heatmap(run, phase=phase, max_ranks=HEATMAP_MAX_RANKS,
                                        max_steps=HEATMAP_MAX_STEPS),
    )


def live_heatmap(served: ServedRun, phase: str) -> pd.DataFrame | None:
    """The rank x step frame of ``phase`` over the steps the follower read
    (:func:`megascope.live.heat_cells`, binned like :func:`heatmap`), while it holds a step the
    analyses have not reached; None otherwise (nothing followed, or the analyses caught up)."""
    from megascope.live import heat_cells

    followed = served.live_steps()
    if followed is None or followed.empty:
        return None
    done = per_step(served)
    if len(done) and int(followed["step"].max()) <= int(done["step"].max()):
        return None
    places = ranks(served)
    return served.live_result(("heatmap", phase), lambda frame: heat_cells(
        frame, places, phase=phase, max_ranks=HEATMAP_MAX_RANKS, max_steps=HEATMAP_MAX_STEPS))


def figure(served: ServedRun, key: tuple[Any, ...], build: Callable[[], Any]) -> Any:
    """A figure built once per generation: plotly's object model costs more than the numbers."""
    return served.result(("figure", *key), lambda run: build())


def query(served: ServedRun, key: tuple[Any, ...], fn: Callable[[Run], Any]) -> Any:
    """A raw-data query, cached like the analyses (``key`` must name all of its arguments)."""
    return served.result(("query", *key), fn)


# Precomputed by the watcher after each refresh: what the overview, topology and /metrics need.
WARM: list[Callable[[ServedRun], Any]] = [per_step, localized, run_facts, stragglers, rank_states, loss]


def stragglers_told(served: ServedRun) -> bool:
    """False on a mesh whose pipeline stages have one rank each: no rank has a peer to be judged
    against, and an empty straggler list says nothing (analysis.stragglers_told)."""
    return bool(served.result(("stragglers_told",), _compute_stragglers_told))


def stragglers_dismissed(served: ServedRun) -> pd.DataFrame:
    """Ranks flagged for their host but not named: a replay without their delay saves too little
    of the step (analysis.stragglers_dismissed: rank, host, coords, slowdown, last_arrival_frac,
    device_idle_frac, saving, saving_lower_bound, z)."""
    return served.result(("stragglers",), _compute_stragglers)[1]


def dismissed_unsure(served: ServedRun) -> bool:
    """Whether ranks are late but not named on a replay that saw only some calls (its saving a
    lower bound): the run is not to be called clean on that evidence."""
    gone = stragglers_dismissed(served)
    return not gone.empty and bool(gone["saving_lower_bound"].astype(bool).any())


NO_PEERS = ("Stragglers cannot be told: no pipeline stage has two ranks, so no rank has a peer doing the same "
            "work to be compared with.")
ONE_RANK = "Stragglers cannot be told: a run of one rank has no peer to be compared with."


def no_peers(served: ServedRun) -> str:
    """Why stragglers cannot be told in ``served``: one rank, or stages of one rank each."""
    run = served.run
    return ONE_RANK if run is not None and run.meta.world_size == 1 else NO_PEERS


def empty_stragglers() -> pd.DataFrame:
    return pd.DataFrame(columns=["rank", "host", "coords", "pp", "dp", "tp", "phase", "cause", "slowdown", "steps_slow_frac"])


def peers(served: ServedRun, rank: int) -> list[int]:
    """``rank`` and the ranks doing the same work beside it (its TP group, then DP peers)."""
    return list(served.result(("peers", int(rank)), lambda run: queries.peers_of(run, int(rank))))


def focus_rank(served: ServedRun) -> int:
    """The rank a page opens on when none is asked for: the hang suspect, else the worst straggler."""
    hang_result = hang(served)
    if hang_result.get("hung") and hang_result.get("suspects"):
        return int(hang_result["suspects"][0]["rank"])
    frame = stragglers(served)
    if len(frame):
        return int(frame.iloc[0]["rank"])
    return 0


def default_steps(served: ServedRun) -> tuple[int, int]:
    """The step a timeline opens on: where the hang happened, else the last step with timings.

    Both read a few files only: the per-step frame is cached, and the hang step comes from the
    suspect's own partition.
    """
    if hang(served).get("hung"):
        rank = focus_rank(served)
        last = served.result(("last_step_of", rank), lambda run: queries.last_step_of(run, rank))
        if last is not None:
            return last, last
    frame = per_step(served)
    if len(frame):
        last = int(frame["step"].max())
        return last, last
    bounds = served.result(("step_range",), lambda run: queries.step_range(run.con))
    return (bounds[1], bounds[1]) if bounds is not None else (0, 0)


def timeline(served: ServedRun, ranks: list[int], steps: tuple[int, int]
             ) -> tuple[pd.DataFrame, pd.DataFrame, dict[int, str]]:
    """Spans, step spans and lane labels of a selection, on the reference clock."""
    key = ("timeline", tuple(ranks), tuple(steps))

    def compute(run: Run) -> tuple[pd.DataFrame, pd.DataFrame, dict[int, str]]:
        offsets = clock_offsets(served)
        spans = queries.timeline_spans(run, ranks=ranks, steps=steps, offsets=offsets)
        bounds = queries.step_spans(run, ranks=ranks, steps=steps, offsets=offsets)
        info = queries.rank_info(run, ranks)
        labels = {int(row["rank"]): queries.rank_label(row) for _, row in info.iterrows()}
        return spans, bounds, labels

    return served.result(key, compute)


def health_findings(served: ServedRun) -> pd.DataFrame | None:
    """The node-health module's findings, or None where that module is not installed."""
    try:
        from megascope.health import health_findings as findings
    except ImportError:
        return None
    return served.result(("health_findings",), lambda run: findings(run.con))
