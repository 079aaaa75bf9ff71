"""Heat-map page: rank x step per phase, normalised within peers; a click opens the timeline.

The frame comes from :func:`megascope.analysis.heatmap`, binned server-side to at most 512 rank
rows and 400 step columns, so a 12,288-rank run ships a few hundred thousand numbers at most.
Clicking a cell opens that rank (the first rank of a binned row) and step beside its peers on
the timeline page.

On a big live run the analyses come minutes behind the job; while the step sums' follower holds
steps they have not reached, a second map shows those steps (``data.live_heatmap``: compute,
communication, data or step time per rank and step, over the same peers), redrawn as the
follower reads more.
"""

from __future__ import annotations

from typing import Any

from dash import Dash, Input, Output, State, dcc, html, no_update
from megascope.dashboard import data, ids, routes
from megascope.dashboard.components import contained, notice
from megascope.dashboard.runs import RunRegistry, ServedRun
from megascope.dashboard.shell import served_from

# Own time first: in a synchronous job every rank's *step* takes as long as the slowest, so the
# straggler shows in what it spent itself (step minus waiting for others), the measure the
# Stragglers page ranks by, whatever the cause (compute, data, a host pause). Compute spans of its
# peers hold their waits on it inside tensor-parallel calls, so "compute" can point elsewhere.
DEFAULT_PHASE = "own"
# Ranks listed beside the map, worst first.
TOP_RANKS = 10
PHASE_LABELS = {
    "compute": "compute (forward + backward + optimizer)", "own": "own time (all but waiting)",
    "forward": "forward", "backward": "backward", "optimizer": "optimizer", "wait": "waiting for peers",
    "xfer": "transfer", "comm": "communication", "bubble": "pipeline bubble (p2p wait)", "data": "data loading",
    "host": "host work and pauses outside spans", "step": "step",
}


# Where no stage has two ranks, the map compares each rank with all of them (figures.heatmap).
ALL_RANKS = ("No pipeline stage has two ranks, so no rank has a peer doing the same work: the colours compare "
             "each rank with the median of all ranks in the step. Stages do different work (the first holds "
             "the embedding, the last the loss), so a rank that stands out may be a heavier stage, not a slow one.")


ONE_RANK = ("A run of one rank: there is no rank to compare it with, and every cell reads 1x. The overview's step "
            "time and the timeline show where its time goes.")


def alone_note(cells: Any) -> Any:
    """The notice above a map whose ranks have no stage peers (None where they have)."""
    from megascope.figures.heatmap import all_ranks

    if not all_ranks(cells):
        return None
    return notice(ONE_RANK if cells["rank"].nunique() == 1 else ALL_RANKS, "warn")


# The live map's phases (megascope.live.LIVE_PHASES): what the step sums tell without the spans.
LIVE_LABELS = {"compute": "compute", "comm": "communication", "data": "data loading", "step": "step"}
DEFAULT_LIVE_PHASE = "compute"


def phase_options() -> list[dict[str, str]]:
    from megascope.analysis import PHASES

    return [{"label": PHASE_LABELS.get(p, p), "value": p} for p in
            sorted(PHASES, key=lambda p: list(PHASE_LABELS).index(p) if p in PHASE_LABELS else 99)]


def layout(served: ServedRun, query: dict[str, str]) -> html.Div:
    phase = query.get("phase", DEFAULT_PHASE)
    options = phase_options()
    return html.Div(
        [
            html.Div(
                [html.Label("phase", htmlFor=ids.HEATMAP_PHASE),
                 dcc.Dropdown(id=ids.HEATMAP_PHASE, options=options,  # type: ignore[arg-type]
                              value=phase if phase in {o["value"] for o in options} else DEFAULT_PHASE,
                              clearable=False, style={"width": "300px"}),
                 html.Span("colour: time / median of peers doing the same work (same pipeline stage; all ranks "
                           "where no stage has two); click a cell to open it on the timeline", className="hint")],
                className="controls",
            ),
            html.Div(id=ids.HEATMAP_NOTE),
            html.Div(
                [html.H4("Live: the newest steps, before the analyses reach them"),
                 html.Div(
                     [dcc.RadioItems(id=ids.HEATMAP_LIVE_PHASE, value=DEFAULT_LIVE_PHASE, inline=True,
                                     options=[{"label": LIVE_LABELS[p], "value": p} for p in LIVE_LABELS]),
                      html.Span("from each rank's step sums as they are written; a rank that pauses outside its "
                                "work shows as less communication (its peers wait for it)", className="hint")],
                     className="controls"),
                 html.Div(id=ids.HEATMAP_LIVE_NOTE),
                 dcc.Graph(id=ids.HEATMAP_LIVE_GRAPH, config={"displaylogo": False})],
                id=ids.HEATMAP_LIVE, style={"display": "none"},
            ),
            html.Div(
                [dcc.Loading(dcc.Graph(id=ids.HEATMAP_GRAPH, config={"displaylogo": False}), delay_show=300,
                             parent_className="heatmap-main"),
                 html.Div(id=ids.HEATMAP_TOP, className="heatmap-side")],
                className="heatmap-row",
            ),
        ]
    )


def top_list(served: ServedRun, cells: Any, phase: str) -> list[Any]:
    """The worst ranks of the map beside it, each a link to its timeline at its worst step."""
    from megascope.figures.heatmap import all_ranks, worst_ranks

    worst = worst_ranks(cells, TOP_RANKS)
    heading = "Highest against all ranks" if all_ranks(cells) else "Worst ranks"
    if worst.empty:
        return [html.H4(heading), html.Div("none at 1.05x or more", className="hint")]
    rows = []
    for row in worst.to_dict("records"):
        rank, step = int(row["rank"]), int(row["step"])
        href = (routes.href(served.id, "timeline") + "?" + routes.selection_query(data.peers(served, rank), (step, step))
                + f"&focus={rank}")
        rows.append(html.Tr([html.Td(dcc.Link(f"rank {rank}", href=href)), html.Td(f"{float(row['worst']):.2f}x"),
                             html.Td(f"{int(row['slow_steps'])}")]))
    return [html.H4(f"{heading} ({PHASE_LABELS.get(phase, phase).split(' (')[0]})"),
            html.Table([html.Thead(html.Tr([html.Th("rank"), html.Th("worst"), html.Th("cells >= 1.05x")])),
                        html.Tbody(rows)], className="table", id="heatmap-top-table")]


def cell_target(point: dict[str, Any]) -> tuple[int, int] | None:
    """(rank, step) of a clicked heat-map cell: customdata[0:2] when the figure carries it, else y, x."""
    custom = point.get("customdata")
    try:
        if isinstance(custom, list | tuple) and len(custom) >= 2:
            return int(custom[0]), int(custom[1])
        return int(point["y"]), int(point["x"])
    except (KeyError, TypeError, ValueError):
        return None


def register(app: Dash, registry: RunRegistry) -> None:
    @app.callback(
        Output(ids.HEATMAP_GRAPH, "figure"), Output(ids.HEATMAP_TOP, "children"), Output(ids.HEATMAP_NOTE, "children"),
        Input(ids.GENERATION, "data"), Input(ids.HEATMAP_PHASE, "value"),
    )
    @contained(no_update, no_update)
    def update(generation: dict[str, Any] | None, phase: str) -> tuple[Any, Any, Any]:
        served = served_from(registry, generation)
        if served is None or served.run is None:
            return no_update, no_update, notice(served.error if served else "loading...")
        frame = data.heatmap(served, phase)
        if frame.empty:
            return no_update, no_update, notice(f"no {phase} spans in this run", "info")
        from megascope.figures.heatmap import heatmap_figure

        flagged = [int(r) for r in data.stragglers(served)["rank"]]
        figure = data.figure(served, ("heatmap", phase),
                             lambda: heatmap_figure(frame, phase=phase, flagged=flagged))
        return figure, top_list(served, frame, phase), alone_note(frame)

    @app.callback(
        Output(ids.HEATMAP_LIVE, "style"), Output(ids.HEATMAP_LIVE_GRAPH, "figure"),
        Output(ids.HEATMAP_LIVE_NOTE, "children"),
        Input(ids.GENERATION, "data"), Input(ids.LIVE_GENERATION, "data"), Input(ids.HEATMAP_LIVE_PHASE, "value"),
    )
    @contained(no_update, no_update)
    def update_live(generation: dict[str, Any] | None, _live: dict[str, Any] | None, phase: str) -> tuple[Any, Any, Any]:
        served = served_from(registry, generation)
        hidden = {"display": "none"}
        if served is None or served.run is None:
            return hidden, no_update, None
        frame = data.live_heatmap(served, phase if phase in LIVE_LABELS else DEFAULT_LIVE_PHASE)
        if frame is None:
            return hidden, no_update, None
        if frame.empty:
            return {}, no_update, notice(f"no {LIVE_LABELS.get(phase, phase)} time in the followed steps", "info")
        from megascope.figures.heatmap import heatmap_figure

        steps = f"steps {int(frame['step_lo'].min())}-{int(frame['step_hi'].max())}"
        figure = heatmap_figure(frame, phase=phase, title=f"{LIVE_LABELS.get(phase, phase)}, {steps} (live)")
        return {}, figure, alone_note(frame)

    @app.callback(
        Output(ids.URL, "pathname", allow_duplicate=True), Output(ids.URL, "search", allow_duplicate=True),
        Input(ids.HEATMAP_GRAPH, "clickData"), State(ids.GENERATION, "data"),
        prevent_initial_call=True,
    )
    def open_timeline(click: dict[str, Any] | None, generation: dict[str, Any] | None) -> tuple[Any, Any]:
        served = served_from(registry, generation)
        if not click or not click.get("points") or served is None or served.run is None:
            return no_update, no_update
        target = cell_target(click["points"][0])
        if target is None:
            return no_update, no_update
        rank, step = target
        peers = data.peers(served, rank)
        return routes.href(served.id, "timeline"), "?" + routes.selection_query(peers, (step, step)) + f"&focus={rank}"
