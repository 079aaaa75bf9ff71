"""Topology page: the job's TP/PP/DP grid, every rank coloured by its state.

States come from :func:`megascope.analysis.rank_states` (healthy, slow, waiting, silent, hung) and
hang suspects from :func:`megascope.analysis.localize`; during a hang the banner names the culprit
and the grid rings it, among the pale "waiting" ranks it holds up. The grid is one heat-map image
(:mod:`megascope.figures.topology`), so thousands of ranks cost thousands of numbers, not DOM
nodes. Clicking a rank opens it on the timeline.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from dash import Dash, Input, Output, State, dcc, html, no_update
from megascope.dashboard import data, ids, routes
from megascope.dashboard.components import contained, notice, table
from megascope.dashboard.runs import RunRegistry, ServedRun
from megascope.dashboard.shell import served_from

from megascope.analysis.hang import place_text
from megascope.figures.topology import STATES, rank_at, topology_figure

SUSPECT_COLUMNS = ("rank", "host", "coords", "where", "group", "last_completed_seq", "missing_seq", "evidence",
                   "stopped_in")
STACK_FRAMES = 12


def layout(served: ServedRun, query: dict[str, str]) -> html.Div:
    return html.Div(
        [
            html.Div(id=ids.TOPOLOGY_BANNER),
            dcc.Loading(dcc.Graph(id=ids.TOPOLOGY_GRAPH, config={"displaylogo": False}), delay_show=300),
            html.Div(id=ids.TOPOLOGY_SUSPECTS),
        ]
    )


def banner(served: ServedRun, states: pd.DataFrame, hang: dict[str, Any]) -> list[Any]:
    counts = states["state"].value_counts() if len(states) else pd.Series(dtype=int)
    summary = " · ".join(f"{int(counts[s])} {s}" for s in STATES if s in counts)
    if hang.get("hung") and hang.get("suspects"):
        s = hang["suspects"][0]
        waiting = "; the ranks waiting on it are pale yellow" if hang.get("waiting") else ""
        head = f"HANG: rank {s['rank']} {place_text(s)} {s['where']}{waiting}."
        lost = [html.Div(f"Note: {hang['note']}.", className="hint", id="topology-lost")] if hang.get("lost") else []
        return [html.Div(head, className="alert alert-hang", id="topology-culprit"), *lost,
                html.Div(summary, className="hint")]
    if hang.get("hung"):
        return [html.Div("HANG: progress stopped but no suspect was named", className="alert alert-hang"),
                html.Div(summary, className="hint")]
    state = data.run_state(served)
    lines = [html.Div(f"{state['state'].upper()}: {state['reason']}", className=f"alert alert-{state['state']}",
                     id="topology-state")] if state["state"] in ("stalled", "failed") else []
    if summary and not data.stragglers_told(served):
        # "8 healthy" on a pure pipeline would say no rank is slow, which nothing here can tell.
        one = served.run is not None and served.run.meta.world_size == 1
        summary += " · slow ranks cannot be told: " + ("one rank" if one else "no pipeline stage has two ranks")
    return [*lines, html.Div(summary or "no ranks reported yet", className="hint")]


def register(app: Dash, registry: RunRegistry) -> None:
    @app.callback(
        Output(ids.TOPOLOGY_GRAPH, "figure"), Output(ids.TOPOLOGY_SUSPECTS, "children"),
        Output(ids.TOPOLOGY_BANNER, "children"),
        Input(ids.GENERATION, "data"),
    )
    @contained(no_update, no_update)
    def update(generation: dict[str, Any] | None) -> tuple[Any, Any, Any]:
        served = served_from(registry, generation)
        if served is None or served.run is None:
            return no_update, no_update, notice(served.error if served else "loading...")
        states = data.rank_states(served)
        hang = data.hang(served)
        suspects = list(hang.get("suspects") or []) if hang.get("hung") else []
        state = data.run_state(served)
        ringed = suspects[:3] or ([state["culprit"]] if state["state"] == "failed" and state.get("culprit") else [])
        figure = data.figure(served, ("topology", bool(hang.get("hung")), tuple(int(s["rank"]) for s in ringed)),
                             lambda: topology_figure(states, suspects=ringed))
        suspect_table = None
        if suspects:
            frame = pd.DataFrame([suspect_row(s) for s in suspects])
            suspect_table = [html.H3("Hang suspects, most likely first (a rank opens its timeline)"),
                             table(frame, id="suspect-table", columns=[c for c in SUSPECT_COLUMNS if c in frame],
                                   links={"rank": lambda row: timeline_href(served, int(row["rank"]))}),
                             *stack_block(suspects[0])]
        return figure, suspect_table, banner(served, states, hang)

    @app.callback(
        Output(ids.URL, "pathname", allow_duplicate=True), Output(ids.URL, "search", allow_duplicate=True),
        Input(ids.TOPOLOGY_GRAPH, "clickData"), State(ids.GENERATION, "data"), prevent_initial_call=True,
    )
    def open_timeline(click: dict[str, Any] | None, generation: dict[str, Any] | None) -> tuple[Any, Any]:
        served = served_from(registry, generation)
        if not click or not click.get("points") or served is None or served.run is None:
            return no_update, no_update
        rank = clicked_rank(click["points"][0], data.rank_states(served))
        if rank is None:
            return no_update, no_update
        return routes.href(served.id, "timeline"), "?" + routes.selection_query(
            data.peers(served, rank), data.default_steps(served)) + f"&focus={rank}"


def suspect_row(suspect: dict[str, Any]) -> dict[str, Any]:
    """A suspect as a table row: which witnesses name it and the innermost frame it stopped in."""
    from megascope.analysis.witness import frame_text

    stack = suspect.get("stack") or {}
    frames = stack.get("frames") or []
    return {**{k: v for k, v in suspect.items() if k != "stack"},
            "evidence": " + ".join(suspect.get("evidence") or ["markers"]),
            "stopped_in": frame_text(frames[0]) if frames else ""}


def stack_block(suspect: dict[str, Any]) -> list[Any]:
    """The culprit's stack at the stall (RUN/stacks/), innermost frame first; nothing without one."""
    from megascope.analysis.witness import frame_text

    stack = suspect.get("stack") or {}
    frames = stack.get("frames") or []
    if not frames:
        return []
    thread = "an autograd thread" if stack.get("thread") == "autograd" else "the training thread"
    lines = [frame_text(f) for f in frames[:STACK_FRAMES]]
    more = len(frames) - STACK_FRAMES
    if more > 0:
        lines.append(f"... {more} outer frames")
    return [html.H3(f"Where rank {suspect['rank']} stopped: {thread} at step {stack.get('step')}, innermost first"),
            html.Pre("\n".join(lines), id="culprit-stack", className="stack")]


def clicked_rank(point: dict[str, Any], states: pd.DataFrame) -> int | None:
    """The rank of a clicked grid cell: from its customdata when the browser sends it, else from
    the cell's position (plotly leaves customdata out of heat-map click events)."""
    custom = point.get("customdata")
    try:
        if isinstance(custom, list | tuple) and custom and int(custom[0]) >= 0:
            return int(custom[0])
        if point.get("x") is None or point.get("y") is None:
            return None
        return rank_at(states, float(point["x"]), float(point["y"]))
    except (TypeError, ValueError):
        return None


def timeline_href(served: ServedRun, rank: int) -> str:
    """The timeline of ``rank`` beside its peers at the step the run stopped (or its last step)."""
    steps = data.default_steps(served)
    return routes.href(served.id, "timeline") + "?" + routes.selection_query(data.peers(served, rank), steps) + f"&focus={rank}"
