"""The frame around every page: header, run and page navigation, router, and the live tick.

Role in the data flow: the tick (a ``dcc.Interval``) asks the registry for the run's generation
every few seconds and writes it to the ``generation`` store only when it changed; page callbacks
take that store as input, so a live run redraws its pages when new parts arrive, and an idle run
costs one cheap callback per tick. A second store, ``live-generation``, changes when the step
sums' follower read new steps (``ServedRun.follow``); only the overview redraws on it.

Example::

    app.layout = shell.layout(registry)
    shell.register(app, registry, pages)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from dash import Dash, Input, Output, State, dcc, html, no_update
from megascope.dashboard import data, ids, routes
from megascope.dashboard.components import notice
from megascope.dashboard.runs import RunRegistry, ServedRun

from megascope.topology import ranks_text

log = logging.getLogger(__name__)


def layout(registry: RunRegistry) -> html.Div:
    return html.Div(
        [
            dcc.Location(id=ids.URL, refresh="callback-nav"),
            dcc.Interval(id=ids.TICK, interval=int(registry.poll_interval_s * 1000)),
            dcc.Store(id=ids.GENERATION),
            dcc.Store(id=ids.LIVE_GENERATION),
            html.Header(
                [
                    html.Div([html.Span("megascope", className="brand"), html.Span(id=ids.STATUS, className="status")],
                             className="header-top"),
                    html.Nav(id=ids.NAV),
                ]
            ),
            html.Div(id=ids.PROBLEMS),
            html.Main(id=ids.PAGE),
        ],
        className="shell",
    )


def resolve(registry: RunRegistry, pathname: str | None) -> tuple[ServedRun | None, str]:
    run_id, page = routes.parse_path(pathname)
    if run_id is None and registry.ids:
        run_id = registry.ids[0]
    return registry.get(run_id), page


def nav(registry: RunRegistry, served: ServedRun, page: str) -> list[Any]:
    links: list[Any] = [
        dcc.Link(routes.PAGE_TITLES[p], href=routes.href(served.id, p), id=f"nav-{p}",
                 className="nav-link active" if p == page else "nav-link")
        for p in routes.PAGES
    ]
    if len(registry) > 1:
        links.append(html.Span("runs:", className="nav-sep"))
        links += [
            dcc.Link(s.id, href=routes.href(s.id, page), className="run-link active" if s is served else "run-link")
            for s in registry
        ]
    return links


def age_text(seconds: float | None) -> str:
    """``"4 s"``, ``"12 min"``, ``"3 h"``, ``"5 days"``: how long ago, as a person reads it."""
    if seconds is None:
        return "never"
    from megascope.analysis.runstate import duration_text

    return duration_text(seconds)


def run_state_or_none(served: ServedRun) -> dict[str, Any] | None:
    """The run state, or None while the run cannot be analysed (the pages say why)."""
    if served.run is None:
        return None
    try:
        return data.run_state(served)
    except Exception as exc:  # noqa: BLE001 - the header must render whatever the analysis says
        log.info("run %s: run state unavailable: %s", served.id, exc)
        return None


def _followed_step(served: ServedRun) -> int | None:
    """The highest step some rank ended, as the step sums' follower read it (None: nothing followed)."""
    followed = served.live_steps()
    if followed is None or followed.empty:
        return None
    return int(followed["step"].max())


def status_line(served: ServedRun) -> list[Any]:
    """The header: run id, size, mesh, last step (and the analyses' last, where the follower read
    further), the run state and the age of the newest data."""
    if served.run is None:
        return [f"{served.id}: {served.error or 'waiting for data'}"]
    meta = served.run.meta
    mesh = " x ".join(f"{a}{meta.mesh_sizes[a]}" for a in meta.mesh_axes if a in meta.mesh_sizes)
    parts = [served.id, ranks_text(meta.world_size), mesh]
    state = run_state_or_none(served)
    analysed = state.get("last_step") if state is not None else None
    followed = _followed_step(served)
    if followed is not None and (analysed is None or followed > analysed):
        # On a big live run the full refresh comes minutes apart: the pages' analyses (stragglers,
        # topology, the main heat-map) are older than the steps the overview shows; say how much.
        behind = f"analyses through step {analysed}" if analysed is not None else "no analysis yet"
        parts.append(f"last step {followed} ({behind})")
    elif analysed is not None:
        parts.append(f"last step {analysed}")
    if state is not None:
        parts.append(f"data written {age_text(state.get('last_data_age_s'))} ago")
    if served.refresh_error is not None:
        why, read = served.refresh_error, served.refreshed_ns
        when = f" at {time.strftime('%H:%M:%S', time.gmtime(read / 1e9))} UTC" if read else " earlier"
        parts.append(f"refresh failing ({why}): showing what was read{when}")
    text = " · ".join(p for p in parts if p)
    if state is None:
        return [text]
    return [html.Span(state["state"], id=ids.RUN_STATE, title=state["reason"],
                      className=f"run-state run-state-{state['state']}"), " ", text]


def register(app: Dash, registry: RunRegistry, pages: Mapping[str, ModuleType]) -> None:
    @app.callback(
        Output(ids.PAGE, "children"), Output(ids.NAV, "children"), Output(ids.PROBLEMS, "children"),
        Input(ids.URL, "pathname"), State(ids.URL, "search"),
    )
    def route(pathname: str | None, search: str | None) -> tuple[Any, Any, Any]:
        served, page = resolve(registry, pathname)
        if served is None:
            return notice("No such run on this dashboard. Runs: " + ", ".join(registry.ids), "warn"), [], None
        module = pages.get(page)
        if module is None:
            return notice(f"No page {page!r}. Pages: " + ", ".join(routes.PAGES), "warn"), nav(registry, served, ""), None
        problems = served.run.problems if served.run is not None else []
        shown = (
            html.Details([html.Summary(f"{len(problems)} problem(s) reading this run"),
                          html.Ul([html.Li(p) for p in problems[:50]])], className="problems")
            if problems else None
        )
        return module.layout(served, routes.query_params(search)), nav(registry, served, page), shown

    @app.callback(
        Output(ids.GENERATION, "data"), Output(ids.LIVE_GENERATION, "data"), Output(ids.STATUS, "children"),
        Input(ids.TICK, "n_intervals"), Input(ids.URL, "pathname"), State(ids.GENERATION, "data"),
        State(ids.LIVE_GENERATION, "data"),
    )
    def tick(_n: int | None, pathname: str | None, current: dict[str, Any] | None,
             current_live: dict[str, Any] | None) -> tuple[Any, Any, Any]:
        served, _page = resolve(registry, pathname)
        if served is None:
            return no_update, no_update, ""
        # The state is part of it: a run goes from stalled to hung without new data, and pages must redraw.
        state = run_state_or_none(served)
        latest = {"run": served.id, "gen": served.generation, "state": state["state"] if state else None}
        live = {"run": served.id, "live": served.live_generation}
        return (no_update if latest == current else latest), (no_update if live == current_live else live), \
            status_line(served)


def served_from(registry: RunRegistry, generation: dict[str, Any] | None) -> ServedRun | None:
    """The run a page callback works on, from the generation store (None before the first tick)."""
    if not generation:
        return None
    return registry.get(generation.get("run"))

