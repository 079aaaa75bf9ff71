"""Stragglers page: the analysis' straggler table (cause, persistence, slowdown) and the what-if gain.

Rows come from :func:`megascope.analysis.stragglers`, worst first; the gain from
:func:`megascope.analysis.whatif` (step time and MFU if the stragglers ran at their peers'
median, through the step's dependency model). Each row links to its timeline.
"""

from __future__ import annotations

from typing import Any

from dash import Dash, Input, Output, State, html, no_update

from megascope.dashboard import data, ids, routes
from megascope.dashboard.components import card, contained, notice, table
from megascope.dashboard.runs import RunRegistry, ServedRun
from megascope.dashboard.shell import served_from

COLUMNS = ("rank", "host", "pp", "dp", "tp", "cause", "phase", "slowdown", "steps_slow_frac", "last_arrival_frac",
           "late_at")
NAMES = {"steps_slow_frac": "share of steps slow", "slowdown": "slowdown (x)",
         "last_arrival_frac": "share of collectives it arrives last", "late_at": "last at (group)"}


def layout(served: ServedRun, query: dict[str, str]) -> html.Div:
    return html.Div(
        [
            html.Div(id=ids.STRAGGLER_WHATIF, className="cards"),
            html.P("Click a row to open the rank beside its peers on the timeline.", className="hint"),
            html.Div(table(data.empty_stragglers(), id=ids.STRAGGLER_TABLE, columns=COLUMNS, names=NAMES),
                     id=f"{ids.STRAGGLER_TABLE}-box"),
        ]
    )


def whatif_cards(result: dict[str, Any], *, n_stragglers: int) -> list[Any]:
    """Measured vs what-if step time and MFU, and the gain, as cards."""
    if not n_stragglers:
        return [card("stragglers", "0", "nothing to gain", kind="good")]
    step, fixed = result.get("step_time_ns"), result.get("whatif_step_time_ns")
    mfu, fixed_mfu = result.get("mfu"), result.get("whatif_mfu")
    ranks = ", ".join(map(str, result.get("ranks") or [])) or "none (communication causes only)"
    out = [card("stragglers", str(n_stragglers), f"fixing ranks {ranks}", kind="bad")]
    if step and fixed:
        out.append(card("step time", f"{step / 1e6:.1f} -> {fixed / 1e6:.1f} ms",
                        f"x{float(result.get('speedup') or 1):.3f} if they ran at their peers' median"))
    if mfu is not None and fixed_mfu is not None:
        out.append(card("MFU gain", f"{100 * (fixed_mfu - mfu):+.1f} pts", f"{100 * mfu:.1f}% -> {100 * fixed_mfu:.1f}%",
                        kind="bad" if fixed_mfu - mfu > 0.005 else ""))
    return out


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
        return records, whatif_cards(data.whatif(served), n_stragglers=len(frame))

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
