"""Overview page: MFU, step time, tokens/s and loss over steps, with alerts for what needs a person.

On a big live run the step time and MFU of the newest steps come from the step sums' follower
(``data.live_per_step``) before the analyses reach them. Alerts, most urgent first: a hang (with the suspect rank, host and coordinates), stragglers (rank,
cause, slowdown), host-bound ranks (devices waiting for their hosts) and skew growth. Every number comes from :mod:`megascope.analysis` via
:mod:`megascope.dashboard.data`; the figure from :mod:`megascope.figures.overview`.
"""

from __future__ import annotations

import logging
from typing import Any

import pandas as pd
from dash import Dash, Input, Output, dcc, html, no_update
from megascope.dashboard import data, ids, routes
from megascope.dashboard.components import card, contained, notice
from megascope.dashboard.runs import RunRegistry, ServedRun
from megascope.dashboard.shell import age_text, served_from

from megascope.analysis.hang import place_text
from megascope.analysis.timeline import steady_mean
from megascope.figures.overview import step_series_figure
from megascope.topology import format_coords

log = logging.getLogger(__name__)


def layout(served: ServedRun, query: dict[str, str]) -> html.Div:
    return html.Div(
        [
            html.Div(id=ids.OVERVIEW_CARDS, className="cards"),
            html.Div(id=ids.OVERVIEW_ALERTS, className="alerts"),
            dcc.Graph(id=ids.OVERVIEW_GRAPH, config={"displaylogo": False}),
        ]
    )


def coords_text(coords: Any) -> str:
    """A rank's coordinates as every page shows them (:func:`megascope.topology.format_coords`)."""
    return format_coords(coords)


def slow_steps_text(row: dict[str, Any]) -> str:
    """How often a named straggler was slow: in what share of its steps, or, where no single step
    passed the per-step bar, that it is named on all its steps together (never "0% of steps")."""
    frac = float(row.get("steps_slow_frac") or 0.0)
    if frac > 0:
        return f"slow in {100 * frac:.0f}% of steps"
    last = row.get("last_arrival_frac")
    late = f", last at {100 * float(last):.0f}% of its calls" if last is not None and last == last else ""
    return f"slow over its steps together, none alone past the per-step bar{late}"


def alerts(served: ServedRun) -> list[Any]:
    """The alert lines of a run, most urgent first; each links to the page that explains it."""
    out: list[Any] = []
    state = data.run_state(served)
    hang = data.hang(served)
    if state["state"] == "stalled":
        out.append(html.Div(f"STALLED: {state['reason']}", className="alert alert-stalled", id="overview-stalled"))
    elif state["state"] == "failed":
        out.append(html.Div(f"FAILED: {state['reason']}", className="alert alert-failed", id="overview-failed"))
    if hang.get("hung"):
        suspects = hang.get("suspects") or []
        if suspects:
            s = suspects[0]
            text = f"HANG: rank {s['rank']} {place_text(s)} {s['where']}"
        else:
            text = "HANG: the job stopped making progress (no suspect named)"
        out.append(html.Div([text, " ", dcc.Link("show in the topology", href=routes.href(served.id, "topology"))],
                            className="alert alert-hang"))
    frame = data.stragglers(served)
    for row in frame.head(5).to_dict("records"):
        text = (f"Straggler: rank {row['rank']} ({row.get('host', '?')}, {coords_text(row.get('coords'))}) "
                f"{row.get('phase', '')} x{float(row.get('slowdown', float('nan'))):.2f}, "
                f"cause {row.get('cause', '?')}, {slow_steps_text(row)}")
        out.append(html.Div([text, " ", dcc.Link("details", href=routes.href(served.id, "stragglers"))],
                            className="alert alert-straggler"))
    if len(frame) > 5:
        out.append(html.Div(f"... and {len(frame) - 5} more stragglers", className="alert alert-straggler"))
    out.extend(unsure_alerts(served))
    try:
        out.extend(host_bound_alerts(served))
    except Exception as exc:  # noqa: BLE001 - the other alerts still matter when this analysis fails
        log.warning("run %s: host lead analysis failed: %s", served.id, exc)
    try:
        for line in data.skew_alerts(served):
            out.append(html.Div(line, className="alert alert-skew"))
    except Exception as exc:  # noqa: BLE001 - the other alerts still matter when skew analysis fails
        log.warning("run %s: skew analysis failed: %s", served.id, exc)
        out.append(html.Div(f"skew analysis unavailable: {type(exc).__name__}: {exc}", className="alert alert-skew"))
    if frame.empty and not data.stragglers_told(served):
        out.append(html.Div(data.no_peers(served), className="alert alert-skew"))
    if not out:
        out.append(html.Div(f"No stragglers, host-bound ranks, skew growth or hang found; the run is {state['state']}.",
                            className="alert alert-ok"))
    return out


def straggler_card(served: ServedRun, n_stragglers: int) -> Any:
    """Red with stragglers; "-" where no stage has peers; plain (not green) where ranks are late
    at a cost the replay, seeing only some calls, may undervalue (:func:`unsure_alerts`)."""
    if n_stragglers:
        return card("stragglers", str(n_stragglers), "", kind="bad")
    if not data.stragglers_told(served):
        return card("stragglers", "-", "no stage peers to compare")
    if data.dismissed_unsure(served):
        return card("stragglers", "0", f"named; {len(data.stragglers_dismissed(served))} late, cost unsure")
    return card("stragglers", "0", "", kind="good")


def unsure_alerts(served: ServedRun, limit: int = 3) -> list[Any]:
    """One line per rank late but not named where the replay that cleared it saw only some of the
    calls (its saving a lower bound: analysis.stragglers_dismissed' saving_lower_bound): the run
    is not called clean on that evidence."""
    if not data.dismissed_unsure(served):
        return []
    out = []
    for row in data.stragglers_dismissed(served).head(limit).to_dict("records"):
        saving = row.get("saving")
        cost = "-" if saving is None or saving != saving else f"{100 * float(saving):.1f}%"
        text = (f"Late, not named: rank {int(row['rank'])} ({row.get('host', '?')}, {coords_text(row.get('coords'))}) "
                f"x{float(row['slowdown']):.2f} own time; a replay that saw only some of its calls puts its cost "
                f"at {cost} of the step or more")
        out.append(html.Div([text, " ", dcc.Link("details", href=routes.href(served.id, "stragglers"))],
                            className="alert alert-skew"))
    return out


def host_bound_alerts(served: ServedRun, limit: int = 3) -> list[Any]:
    """One line per host-bound rank (its device idle, waiting for the host, at 5% or more of its
    calls), linked to its timeline."""
    bound = data.host_lead(served).get("host_bound") or []
    out: list[Any] = []
    for row in bound[:limit]:
        rank = int(row["rank"])
        text = (f"Host-bound: rank {rank}: its device sat idle, waiting for the host, at "
                f"{100 * float(row['starved_frac']):.0f}% of {int(row['calls'])} calls (host lead p10 "
                f"{float(row['lead_p10_ns']) / 1e6:.1f} ms); host time there is step time")
        out.append(html.Div([text, " ", dcc.Link("timeline", href=routes.href(served.id, "timeline", ranks=[rank]))],
                            className="alert alert-host"))
    if len(bound) > limit:
        out.append(html.Div(f"... and {len(bound) - limit} more host-bound ranks", className="alert alert-host"))
    return out


# Card colour per run state: a finished or running run is good news, the rest needs a person.
STATE_KIND = {"running": "good", "finished": "good", "stalled": "warn", "hung": "bad", "failed": "bad"}


def cards(served: ServedRun, per_step: pd.DataFrame) -> list[Any]:
    state = data.run_state(served)
    state_card = card("state", state["state"], f"data written {age_text(state.get('last_data_age_s'))} ago",
                      kind=STATE_KIND.get(state["state"], ""))
    if per_step.empty:
        return [card("steps", "0", "no completed step yet"), state_card]
    last = per_step.iloc[-1]
    mfu = per_step["mfu"].dropna()
    step_ms = per_step["step_time_ns"].dropna() / 1e6
    # Means over the steps after the first (the warm-up) where there are others.
    mfu_mean, tokens_mean = steady_mean(per_step, "mfu"), steady_mean(per_step, "tokens_per_s")
    n_stragglers = len(data.stragglers(served))
    return [
        card("MFU", f"{100 * mfu_mean:.1f} %" if mfu_mean is not None else "n/a",
             f"last step {100 * mfu.iloc[-1]:.1f} %" if len(mfu) else "needs model FLOPs in run.json"),
        card("step time", f"{step_ms.median():.1f} ms" if len(step_ms) else "n/a",
             f"last {step_ms.iloc[-1]:.1f} ms" if len(step_ms) else ""),
        card("tokens/s", f"{tokens_mean:,.0f}" if tokens_mean is not None else "n/a",
             "mean over steps after the first"),
        card("steps", f"{int(last['step']) + 1}", f"{len(per_step)} with timings"),
        straggler_card(served, n_stragglers),
        state_card,
    ]


def register(app: Dash, registry: RunRegistry) -> None:
    @app.callback(
        Output(ids.OVERVIEW_GRAPH, "figure"), Output(ids.OVERVIEW_ALERTS, "children"),
        Output(ids.OVERVIEW_CARDS, "children"),
        Input(ids.GENERATION, "data"), Input(ids.LIVE_GENERATION, "data"),
    )
    @contained(no_update, no_update)
    def update(generation: dict[str, Any] | None, _live: dict[str, Any] | None = None) -> tuple[Any, Any, Any]:
        served = served_from(registry, generation)
        if served is None or served.run is None:
            return no_update, no_update, notice(served.error if served else "loading...", "info")
        per_step = data.live_per_step(served)
        loss = data.loss(served)
        if len(per_step) == len(data.per_step(served)):
            figure = data.figure(served, ("overview",), lambda: step_series_figure(per_step, loss=loss))
        else:  # steps the analyses have not reached yet: a figure of this follow only, not kept
            figure = step_series_figure(per_step, loss=loss)
        return figure, alerts(served), cards(served, per_step)
