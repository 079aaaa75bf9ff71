"""Stragglers page: the analysis' straggler table (cause, persistence, slowdown) and the what-if gain.

Rows come from :func:`megascope.analysis.stragglers`, worst first; the gain from
:func:`megascope.analysis.whatif` (step time and MFU if the stragglers ran at their peers'
median, through the step's dependency model). Each rank links to its timeline beside its peers.
"""

from __future__ import annotations

from typing import Any

from dash import Dash, Input, Output, html, no_update
from megascope.dashboard import data, ids, routes
from megascope.dashboard.components import card, contained, notice, table
from megascope.dashboard.runs import RunRegistry, ServedRun
from megascope.dashboard.shell import served_from

from megascope.analysis.whatif import gain_words, host_held
from megascope.topology import format_coords

COLUMNS = ("rank", "host", "coords", "cause", "phase", "slowdown", "steps_slow_frac", "last_arrival_frac",
           "late_at", "tp_compute_ratio", "dp_compute_ratio", "outside_calls_ratio", "behind", "slow_groups",
           "device_idle_frac", "cpu_slowdown")
NAMES = {"steps_slow_frac": "steps slow", "slowdown": "slowdown vs peers (the measure that named it)",
         "last_arrival_frac": "collectives it arrives last at", "late_at": "last at (group)",
         "phase": "where (largest excess)", "cpu_slowdown": "its CPU vs the median rank's (host probe)",
         "tp_compute_ratio": "compute outside TP calls vs its TP partners'",
         "dp_compute_ratio": "forward and backward vs its DP peers' (same stage)",
         "outside_calls_ratio": "forward and backward less the calls inside them vs its peers' (same stage)",
         "behind": "a later stage of the pipeline replica of (its calls late behind that rank's)",
         "slow_groups": "its slow groups and pipeline links: transfers vs the others of their kind, or calls "
                       "completing late on the rank data flows into (a slow link)",
         "device_idle_frac": "its GPU idle, waiting for its host (share of its calls)"}


def shown_frame(frame: Any) -> Any:
    """The straggler frame as a person reads it: shares in %, slowdowns as "x1.15"."""
    out = frame.copy()
    if "coords" in out:
        out["coords"] = [format_coords(c) for c in out["coords"]]
    for column in ("steps_slow_frac", "last_arrival_frac"):
        if column in out:
            out[column] = [f"{100 * float(v):.0f}%" if v == v and v is not None else "" for v in out[column]]
    for column in ("slowdown", "cpu_slowdown", "tp_compute_ratio", "dp_compute_ratio", "outside_calls_ratio"):
        if column in out:
            out[column] = [f"x{float(v):.2f}" if v == v and v is not None else "" for v in out[column]]
    if "slow_groups" in out:
        out["slow_groups"] = [", ".join(v) if isinstance(v, list) else "" for v in out["slow_groups"]]
    if "behind" in out:
        out["behind"] = [f"rank {int(v)}" if v is not None and v == v else "" for v in out["behind"]]
    if "device_idle_frac" in out:
        # The evidence of a `host` cause on a GPU (the report prints it the same way); under
        # HOST_BOUND_FRAC, or for another cause, it tells nothing.
        from megascope.analysis.pipeline import HOST_BOUND_FRAC

        causes = out["cause"] if "cause" in out else [None] * len(out)
        out["device_idle_frac"] = [f"{100 * float(v):.0f}%" if c == "host" and v is not None and v == v
                                   and float(v) >= HOST_BOUND_FRAC else "" for v, c in zip(out["device_idle_frac"], causes,
                                                                                          strict=True)]
    return out


# Shown for every row; the evidence columns after them only where some row has a value, so that a
# run read by one measure is not shown a dozen empty columns of the others.
ALWAYS = ("rank", "host", "coords", "cause", "phase", "slowdown", "steps_slow_frac")


def shown_columns(shown: Any) -> list[str]:
    """The columns of :data:`COLUMNS` the table shows for ``shown`` (a :func:`shown_frame`)."""
    def has_value(column: str) -> bool:
        return any(v is not None and v == v and v != "" for v in shown[column])

    return [c for c in COLUMNS if c in shown and (c in ALWAYS or has_value(c))]


def layout(served: ServedRun, query: dict[str, str]) -> html.Div:
    return html.Div(
        [
            html.Div(id=ids.STRAGGLER_WHATIF, className="cards"),
            html.P("Worst first. Click a rank to open it beside its peers on the timeline.", className="hint"),
            html.Div(id=ids.STRAGGLER_TABLE),
        ]
    )


def whatif_cards(result: dict[str, Any], *, n_stragglers: int) -> list[Any]:
    """Measured vs what-if step time and MFU, and the gain, as cards."""
    if not n_stragglers:
        return [card("stragglers", "0", "nothing to gain", kind="good")]
    step, fixed = result.get("step_time_ns"), result.get("whatif_step_time_ns")
    mfu, fixed_mfu = result.get("mfu"), result.get("whatif_mfu")
    replayed = list(result.get("ranks") or [])
    ranks = ", ".join(map(str, replayed)) or "none (communication causes only)"
    out = [card("stragglers", str(n_stragglers), f"fixing ranks {ranks}", kind="bad")]
    if not replayed:
        # The replay frees a rank's own work; it has nothing to say of a link's transfers, and its
        # unchanged step time would read as "the slack absorbs it" beside a job a link slowed 3x.
        out.append(card("what-if", "not replayed", "the replay models ranks' own work, not a slow link's transfers"))
        return out
    if step and fixed:
        speedup = float(result.get("speedup") or 1)
        # A straggler off the critical path (pipeline slack absorbs it) is slow yet costs little:
        # say so rather than print a bare x1.000 beside a rank that arrives last everywhere.
        why = (" (the step's slack absorbs most of it)" if speedup < 1.005 else "")
        held = (f" (held to the hosts' pace: rank {result['host_floor']['rank']}'s host takes "
                f"{result['host_floor']['issue_ns'] / 1e6:.1f} ms to issue a step)" if host_held(result) else "")
        out.append(card("step time", f"{step / 1e6:.1f} -> {fixed / 1e6:.1f} ms",
                        f"{gain_words(speedup)} if they ran at their peers' median{why}"
                        + (" (at least: some calls untimed)" if result.get("lower_bound") else "") + held))
    if mfu is not None and fixed_mfu is not None and mfu > 0:
        # Relative gain first: on a machine far from its peak, a 25% faster step is a fraction of
        # a point of MFU, and "+0.0 pts" would hide it.
        gain = fixed_mfu / mfu - 1.0
        pts = 100 * (fixed_mfu - mfu)
        out.append(card("MFU gain", f"{100 * gain:+.1f}%",
                        f"{100 * mfu:.2f}% -> {100 * fixed_mfu:.2f}% ({pts:+.2f} pts)",
                        kind="bad" if gain > 0.01 else ""))
    return out


def dismissed_notes(served: ServedRun, limit: int = 5) -> list[Any]:
    """One line per rank flagged for its host (or, on a data-parallel mesh timed on GPUs, its
    compute) but not named (its delay, replayed away, saves under 0.7% of the step, 0.3% for
    compute), so that a reader who sees it last at every call knows why it is not in the table."""
    frame = data.stragglers_dismissed(served)
    out = []
    for row in frame.head(limit).to_dict("records"):
        last = row.get("last_arrival_frac")
        saving = row.get("saving")
        spans = "in its compute spans" if row.get("cause") == "compute" else "spans as long as its peers'"
        out.append(html.P(
            f"Not named: rank {int(row['rank'])} ({format_coords(row.get('coords'))}) arrived last at "
            f"{'-' if last is None or last != last else f'{100 * float(last):.0f}%'} of its calls "
            f"(own time x{float(row['slowdown']):.2f}, {spans}), but a replay of its steps at "
            f"its peers' pace saves {'at least ' if row.get('saving_lower_bound') else ''}"
            f"{'-' if saving is None or saving != saving else f'{100 * float(saving):.1f}%'} "
            "of the step.", className="hint dismissed"))
    if data.dismissed_unsure(served):
        from megascope.analysis.stragglers import LOWER_BOUND_NOTE

        out.append(html.P(LOWER_BOUND_NOTE, className="hint dismissed"))
    return out


def none_named(served: ServedRun, dismissed: list[Any]) -> tuple[list[Any], str]:
    """The cards and the headline of a run with no straggler named (and some stage with peers):
    every rank keeps up; or the late ones cost nothing measurable; or, where the replay that
    cleared them saw only some calls, their cost is unsure (not "nothing to gain")."""
    if not dismissed:
        return whatif_cards({}, n_stragglers=0), "No stragglers: every rank keeps up with its peers."
    if data.dismissed_unsure(served):
        from megascope.analysis.stragglers import StragglerConfig

        bar = 100 * StragglerConfig().min_host_saving
        return ([card("stragglers", "0", "named; the gain of the late ones is unsure (some calls untimed)")],
                f"No stragglers named: the ranks below are late, at a cost the replay puts under {bar:g}% of the step.")
    return (whatif_cards({}, n_stragglers=0),
            "No stragglers: no rank's delay costs the job a measurable share of its step.")


def register(app: Dash, registry: RunRegistry) -> None:
    @app.callback(
        Output(ids.STRAGGLER_WHATIF, "children"), Output(ids.STRAGGLER_TABLE, "children"),
        Input(ids.GENERATION, "data"),
    )
    @contained(no_update)
    def update(generation: dict[str, Any] | None) -> tuple[Any, Any]:
        served = served_from(registry, generation)
        if served is None or served.run is None:
            return no_update, notice(served.error if served else "loading...")
        frame = data.stragglers(served)
        dismissed = dismissed_notes(served)
        if frame.empty:
            if not data.stragglers_told(served):
                return [card("stragglers", "-", "no stage peers to compare")], notice(data.no_peers(served))
            cards, headline = none_named(served, dismissed)
            return cards, html.Div([notice(headline), *dismissed])
        steps = data.default_steps(served)

        def timeline_of(row: dict[str, Any]) -> str:
            rank = int(row["rank"])
            return routes.href(served.id, "timeline", ranks=data.peers(served, rank), steps=steps) + f"&focus={rank}"

        readable = shown_frame(frame)
        shown = table(readable, id="straggler-rows", columns=shown_columns(readable), names=NAMES,
                      links={"rank": timeline_of})
        return whatif_cards(data.whatif(served), n_stragglers=len(frame)), html.Div([shown, *dismissed])
