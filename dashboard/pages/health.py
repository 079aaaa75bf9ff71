"""Health page: heartbeats per host, silent hosts first, recent log lines and self-test results.

Shows what the run holds: heartbeat samples (``heartbeats`` table, from the collector's sampler),
diagnostics (``megascope diagnose``) and, when the node-health module is installed, its findings
(throttling, temperature, XID/ECC, silence). A run without any of these says so.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from dash import Dash, Input, Output, dcc, html, no_update
from megascope.dashboard import data, ids, queries
from megascope.dashboard.components import contained, notice, table
from megascope.dashboard.runs import RunRegistry, ServedRun
from megascope.dashboard.shell import served_from

from megascope.figures.health import heartbeat_figure
from megascope.schema import HeartbeatMetric

# The first of these a run has is shown first: what tells a slow or sick node apart soonest.
PREFERRED_METRICS = tuple(str(m) for m in (
    HeartbeatMetric.GPU_UTIL_PCT, HeartbeatMetric.GPU_SM_CLOCK_MHZ, HeartbeatMetric.GPU_TEMP_C,
    HeartbeatMetric.GPU_POWER_W, HeartbeatMetric.LOAD_1M, HeartbeatMetric.MEM_USED_BYTES,
    HeartbeatMetric.NIC_RX_BYTES_PER_S, HeartbeatMetric.CPU_UTIL_PCT,
))


def layout(served: ServedRun, query: dict[str, str]) -> html.Div:
    return html.Div(
        [
            html.Div(id=ids.HEALTH_FINDINGS),
            html.Div([html.Label("metric", htmlFor=ids.HEALTH_METRIC),
                      dcc.Dropdown(id=ids.HEALTH_METRIC, clearable=False, style={"width": "260px"})],
                     className="controls"),
            dcc.Graph(id=ids.HEALTH_GRAPH, config={"displaylogo": False}),
            html.Div(id=ids.HEALTH_HOSTS),
            html.Div(id=ids.HEALTH_DIAGNOSTICS),
        ]
    )


def _section(title: str, frame: pd.DataFrame, table_id: str, empty: str) -> list[Any]:
    if frame.empty:
        return [html.H3(title), notice(empty, "info")]
    return [html.H3(title), table(frame, id=table_id, max_rows=100)]


def register(app: Dash, registry: RunRegistry) -> None:
    @app.callback(
        Output(ids.HEALTH_METRIC, "options"), Output(ids.HEALTH_METRIC, "value"),
        Output(ids.HEALTH_HOSTS, "children"), Output(ids.HEALTH_DIAGNOSTICS, "children"),
        Output(ids.HEALTH_FINDINGS, "children"),
        Input(ids.GENERATION, "data"),
    )
    @contained(no_update, no_update, no_update, no_update)
    def update(generation: dict[str, Any] | None) -> tuple[Any, ...]:
        served = served_from(registry, generation)
        if served is None or served.run is None:
            return no_update, no_update, no_update, no_update, notice(served.error if served else "loading...")
        metrics = data.query(served, ("heartbeat_metrics",), lambda run: queries.heartbeat_metrics(run.con))
        hosts = data.query(served, ("host_summary",), lambda run: queries.host_summary(run.con))
        logs = data.query(served, ("recent_logs",), lambda run: queries.recent_logs(run.con))
        diagnostics = data.query(served, ("diagnostics",), lambda run: queries.diagnostics_rows(run.con))
        findings = data.health_findings(served)
        host_part = _section("Hosts (silent first)", hosts, "host-table",
                             "No heartbeats in this run (the collector's heartbeat sampler was off).")
        if not logs.empty:
            host_part += [html.H3("Recent log lines"), table(logs, id="log-table", max_rows=50)]
        diag_part = _section("Self-tests", diagnostics, "diagnostics-table",
                             "No self-test results (run megascope diagnose to add them).")
        finding_part = _section("Findings", findings, "findings-table", "No health findings.") \
            if findings is not None else None
        preferred = [m for m in PREFERRED_METRICS if m in metrics]
        default = preferred[0] if preferred else (metrics[0] if metrics else None)
        return metrics, default, host_part, diag_part, finding_part

    @app.callback(
        Output(ids.HEALTH_GRAPH, "figure"), Input(ids.HEALTH_METRIC, "value"), Input(ids.GENERATION, "data"),
    )
    def series(metric: str | None, generation: dict[str, Any] | None) -> Any:
        served = served_from(registry, generation)
        if served is None or served.run is None:
            return no_update
        if not metric:
            return heartbeat_figure(pd.DataFrame(columns=["host", "time_ns", "value"]), metric="heartbeats")
        frame = data.query(served, ("heartbeat_series", metric), lambda run: queries.heartbeat_series(run.con, metric))
        return heartbeat_figure(frame, metric=metric)
