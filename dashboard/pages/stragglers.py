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

COLUMNS = ("rank", "host", "pp", "dp", "tp", "cause", "phase", "slowdown", "steps_slow_frac", "last_arrival_frac",
           "late_at")
NAMES = {"steps_slow_frac": "share of steps slow", "slowdown": "slowdown (x)",
         "last_arrival_frac": "share of collectives it arrives last", "late_at": "last at (group)"}


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
    ranks = ", ".join(map(str, result.get("ranks") or [])) or "none (communication causes only)"
    out = [card("stragglers", str(n_stragglers), f"fixing ranks {ranks}", kind="bad")]
    if step and fixed:
        out.append(card("step time", f"{step / 1e6:.1f} -> {fixed / 1e6:.1f} ms",
                        f"x{float(result.get('speedup') or 1):.3f} if they ran at their peers' median"
                        + (" (at least: some calls untimed)" if result.get("lower_bound") else "")))
    if mfu is not None and fixed_mfu is not None:
        out.append(card("MFU gain", f"{100 * (fixed_mfu - mfu):+.1f} pts", f"{100 * mfu:.1f}% -> {100 * fixed_mfu:.1f}%",
                        kind="bad" if fixed_mfu - mfu > 0.005 else ""))
    return out


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
        if frame.empty:
            return whatif_cards({}, n_stragglers=0), notice("No stragglers: every rank keeps up with its peers.")
        steps = data.default_steps(served)

        def timeline_of(row: dict[str, Any]) -> str:
            return routes.href(served.id, "timeline", ranks=data.peers(served, int(row["rank"])), steps=steps)

        shown = table(frame, id="straggler-rows", columns=COLUMNS, names=NAMES, links={"rank": timeline_of})
        return whatif_cards(data.whatif(served), n_stragglers=len(frame)), shown
