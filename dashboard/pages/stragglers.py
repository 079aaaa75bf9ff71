"""Stragglers page: the analysis' straggler table (cause, persistence, slowdown) and the what-if gain.

Rows come from :func:`megascope.analysis.stragglers`, worst first; the gain from
:func:`megascope.analysis.whatif` (step time and MFU if the stragglers ran at their peers'
median, through the step's dependency model). Each row links to its timeline.
"""

from __future__ import annotations

from typing import Any

from dash import Dash, Input, Output, State, html, no_update

from megascope.dashboard import data, ids, routes
from megascope.dashboard.components import contained, notice, table
from megascope.dashboard.runs import RunRegistry, ServedRun
from megascope.dashboard.shell import served_from

COLUMNS = ("rank", "host", "coords", "phase", "slowdown", "steps_slow_frac", "cause")
NAMES = {"steps_slow_frac": "share of steps slow", "slowdown": "slowdown (x)"}


def layout(served: ServedRun, query: dict[str, str]) -> html.Div:
    return html.Div(
        [
            html.Div(id=ids.STRAGGLER_WHATIF, className="cards"),
            html.P("Click a row to open the rank beside its peers on the timeline.", className="hint"),
            html.Div(table(data.empty_stragglers(), id=ids.STRAGGLER_TABLE, columns=COLUMNS, names=NAMES),
                     id=f"{ids.STRAGGLER_TABLE}-box"),
        ]
    )


def register(app: Dash, registry: RunRegistry) -> None:
    @app.callback(
        Output(ids.STRAGGLER_TABLE, "data"), Output(ids.STRAGGLER_WHATIF, "children"),
        Input(ids.GENERATION, "data"),
    )
    @contained(no_update)
    def update(generation: dict[str, Any] | None) -> tuple[Any, Any]:
        served = served_from(registry, generation)
        if served is None or served.run is None:
            return no_update, notice(served.error if served else "loading...")
        frame = data.stragglers(served)
        records = table(frame, id="unused", columns=[c for c in COLUMNS if c in frame.columns]).data
        return records, data.whatif_cards(served, n_stragglers=len(frame))

    @app.callback(
        Output(ids.URL, "pathname", allow_duplicate=True), Output(ids.URL, "search", allow_duplicate=True),
        Input(ids.STRAGGLER_TABLE, "active_cell"), State(ids.STRAGGLER_TABLE, "derived_viewport_data"),
        State(ids.GENERATION, "data"), prevent_initial_call=True,
    )
    def open_timeline(active: dict[str, Any] | None, rows: list[dict[str, Any]] | None,
                      generation: dict[str, Any] | None) -> tuple[Any, Any]:
        served = served_from(registry, generation)
        if not active or not rows or served is None or served.run is None:
            return no_update, no_update
        rank = int(rows[active["row"]]["rank"])
        return routes.href(served.id, "timeline"), "?" + routes.selection_query(
            data.peers(served, rank), data.default_steps(served))
