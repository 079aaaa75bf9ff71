"""Heartbeat series: one line per host for one metric (GPU utilisation, temperature, NIC bytes...).

Role in the data flow: pure ``(DataFrame, ...) -> Figure`` over ``host, time_ns, value`` rows,
already binned by the caller (the dashboard's health page bins in SQL).

Example::

    fig = heartbeat_figure(series, metric="gpu_util_pct")
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go


def heartbeat_figure(series: pd.DataFrame, *, metric: str) -> go.Figure:
    """A line per host, or per host's device for a device's metric (``series["host"]``), over wall-clock time (UTC)."""
    fig = go.Figure()
    if series.empty:
        fig.add_annotation(text=f"no heartbeat samples of {metric}", showarrow=False, x=0.5, y=0.5,
                           xref="paper", yref="paper")
        fig.update_layout(height=200, xaxis_visible=False, yaxis_visible=False)
        return fig
    for host, part in series.groupby("host", sort=True):
        fig.add_trace(go.Scatter(
            x=pd.to_datetime(part["time_ns"], unit="ns"), y=part["value"], mode="lines", name=str(host),
            hovertemplate=f"{host}<br>%{{x}}<br>{metric} %{{y:.4g}}<extra></extra>",
        ))
    fig.update_layout(height=360, yaxis_title=metric, margin={"l": 60, "r": 20, "t": 20, "b": 40},
                      uirevision=f"health-{metric}")
    return fig
