"""Timeline page: selected ranks and steps as lanes of spans, waits hatched, bubbles visible.

The selection lives in the URL (``?ranks=4-7&steps=3``), so a heat-map or topology click, a
straggler row and a pasted link all land here the same way. Spans are put on the reference clock
with :func:`megascope.analysis.clock_offsets`. The same selection downloads as a Perfetto trace
(``/trace/<run>.pftrace``, written by :func:`megascope.export.export_perfetto`) or opens in the
Perfetto UI through its postMessage protocol (``assets/perfetto.js``).
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from dash import ClientsideFunction, Dash, Input, Output, State, dcc, html, no_update
from megascope.dashboard import data, ids, queries, routes
from megascope.dashboard.components import contained, notice, table
from megascope.dashboard.runs import RunRegistry, ServedRun
from megascope.dashboard.shell import served_from

from megascope.errors import ConfigError
from megascope.figures.timeline import timeline_figure

PERFETTO_UI = "https://ui.perfetto.dev"


def selection(served: ServedRun, query: dict[str, str]) -> tuple[list[int], tuple[int, int]]:
    """The (ranks, steps) a URL asks for, with defaults: the worst straggler's peers, a recent step."""
    assert served.run is not None
    ranks = routes.parse_ranks(query.get("ranks"), world_size=served.run.meta.world_size)
    steps = routes.parse_steps(query.get("steps"))
    if ranks is None:
        ranks = data.peers(served, data.focus_rank(served))
    if steps is None:
        steps = data.default_steps(served)
    return ranks, steps


def layout(served: ServedRun, query: dict[str, str]) -> html.Div:
    ranks_text, steps_text = query.get("ranks", ""), query.get("steps", "")
    if served.run is not None:
        try:
            ranks, steps = selection(served, query)
            ranks_text = routes.format_ranks(ranks)
            steps_text = routes.selection_query(None, steps).removeprefix("steps=")
        except Exception:  # noqa: BLE001 - the update callback reports the problem on the page
            pass
    return html.Div(
        [
            html.Div(
                [
                    html.Label("ranks", htmlFor=ids.TIMELINE_RANKS),
                    dcc.Input(id=ids.TIMELINE_RANKS, value=ranks_text, debounce=True, placeholder="e.g. 4-7,12",
                              style={"width": "160px"}),
                    html.Label("steps", htmlFor=ids.TIMELINE_STEPS),
                    dcc.Input(id=ids.TIMELINE_STEPS, value=steps_text, debounce=True, placeholder="e.g. 3 or 3-5",
                              style={"width": "90px"}),
                    html.Button("Show", id=ids.TIMELINE_APPLY, n_clicks=0),
                    html.A("Download Perfetto trace", id=ids.TIMELINE_DOWNLOAD_BUTTON, href="", className="button"),
                    html.Button("Open in Perfetto UI", id=ids.TIMELINE_PERFETTO_BUTTON, n_clicks=0),
                    html.Span(id=ids.TIMELINE_PERFETTO_STATUS, className="hint"),
                ],
                className="controls",
            ),
            dcc.Store(id=ids.TIMELINE_TRACE_URL),
            html.Div(id=ids.TIMELINE_NOTE),
            dcc.Loading(dcc.Graph(id=ids.TIMELINE_GRAPH, config={"displaylogo": False}), delay_show=300),
            html.Div(id=ids.TIMELINE_BUBBLES),
        ]
    )


def bubbles_section(frame: pd.DataFrame) -> list[Any] | None:
    """Bubbles per stage in ms per step and % of the step (the analysis keeps nanoseconds); none
    for a run of one stage, which has no pipeline (as the report leaves it out)."""
    if len(frame) < 2:
        return None
    shown = pd.DataFrame({
        "stage": frame["stage"], "ranks": frame["ranks"], "steps": frame["steps"],
        "bubble per step": [f"{float(v) / 1e6:.1f} ms" for v in frame["bubble_ns"]],
        "step": [f"{float(v) / 1e6:.1f} ms" for v in frame["step_ns"]],
        "bubble share": [f"{100 * float(v):.1f}%" for v in frame["bubble_frac"]],
    })
    return [html.H3("Pipeline bubbles per stage (every step after the first, the warm-up)"), table(shown, id="bubble-table")]


def focus_of(served: ServedRun, query: dict[str, str], ranks: list[int]) -> int | None:
    """The rank to highlight: ``?focus=N`` when in the selection, else the hang culprit or worst
    straggler when in it."""
    raw = query.get("focus", "")
    if raw.isdigit() and int(raw) in ranks:
        return int(raw)
    rank = data.focus_rank(served)
    return rank if rank in ranks else None


def stopped_ranks(served: ServedRun, ranks: list[int]) -> dict[int, str]:
    """Hung ranks of the selection and what each never did (only while the run state is hung)."""
    hang = data.hang(served)
    out: dict[int, str] = {}
    for suspect in hang.get("suspects") or []:
        rank = int(suspect["rank"])
        if rank in ranks and rank not in out:
            out[rank] = str(suspect["where"])
    return out


def register(app: Dash, registry: RunRegistry) -> None:
    @app.callback(
        Output(ids.URL, "search", allow_duplicate=True),
        Input(ids.TIMELINE_APPLY, "n_clicks"), Input(ids.TIMELINE_RANKS, "n_submit"),
        Input(ids.TIMELINE_STEPS, "n_submit"),
        State(ids.TIMELINE_RANKS, "value"), State(ids.TIMELINE_STEPS, "value"),
        prevent_initial_call=True,
    )
    def apply(_clicks: int, _r: int | None, _s: int | None, ranks: str | None, steps: str | None) -> str:
        # Validated by the update callback, which says what is wrong; the URL keeps what was typed.
        params = {k: v.strip() for k, v in (("ranks", ranks or ""), ("steps", steps or "")) if v.strip()}
        return "?" + "&".join(f"{k}={v}" for k, v in params.items())

    @app.callback(
        Output(ids.TIMELINE_GRAPH, "figure"), Output(ids.TIMELINE_BUBBLES, "children"),
        Output(ids.TIMELINE_TRACE_URL, "data"), Output(ids.TIMELINE_DOWNLOAD_BUTTON, "href"),
        Output(ids.TIMELINE_NOTE, "children"),
        Input(ids.URL, "search"), Input(ids.GENERATION, "data"),
    )
    @contained(no_update, no_update, no_update, no_update)
    def update(search: str | None, generation: dict[str, Any] | None) -> tuple[Any, ...]:
        served = served_from(registry, generation)
        if served is None or served.run is None:
            return no_update, no_update, no_update, no_update, notice(served.error if served else "loading...")
        try:
            ranks, steps = selection(served, routes.query_params(search))
        except ConfigError as exc:
            return no_update, no_update, no_update, no_update, notice(str(exc), "warn")
        spans, steps_frame, labels = data.timeline(served, ranks, steps)
        title = f"ranks {routes.format_ranks(ranks)} · step {steps[0]}" + (f"-{steps[1]}" if steps[1] != steps[0] else "")
        figure = timeline_figure(spans, labels=labels, step_bounds=steps_frame, title=title,
                                 focus=focus_of(served, routes.query_params(search), ranks),
                                 stopped=stopped_ranks(served, ranks))
        query = routes.selection_query(ranks, steps)
        trace_url = f"/trace/{served.id}.pftrace?{query}"
        note = None
        if len(spans) >= queries.MAX_TIMELINE_SPANS:
            note = notice(f"showing the first {queries.MAX_TIMELINE_SPANS:,} spans; narrow the selection", "warn")
        bubbles = bubbles_section(data.bubbles(served))
        trace = {"url": trace_url, "title": f"megascope {served.id} {title}",
                 "file": f"{served.id}-{query.replace('&', '-').replace('=', '')}.pftrace",
                 "ui": app.server.config.get("MEGASCOPE_PERFETTO_UI", PERFETTO_UI)}
        return figure, bubbles, trace, trace_url + "&download=1", note

    app.clientside_callback(
        ClientsideFunction(namespace="megascope", function_name="openPerfetto"),
        Output(ids.TIMELINE_PERFETTO_STATUS, "children"),
        Input(ids.TIMELINE_PERFETTO_BUTTON, "n_clicks"), State(ids.TIMELINE_TRACE_URL, "data"),
        prevent_initial_call=True,
    )

