"""A timeline of a few ranks: one lane per (rank, stream), bars per span, waits hatched.

Role in the data flow: pure ``(DataFrame, ...) -> Figure`` over the spans the dashboard selects
(``rank, step, name, kind, stream, start_ns, dur_ns, wait_ns, microbatch``). Communication spans
are drawn in two parts: the hatched part is ``wait_ns``, time spent waiting for a late peer, and
the rest is the transfer itself. Gaps between compute bars of a pipeline stage are its bubbles.

Example::

    fig = timeline_figure(spans, labels={5: "r5 pp0 dp1 tp1"})
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd
import plotly.graph_objects as go

KIND_COLOURS = {
    "forward": "#4e79a7",
    "backward": "#a0cbe8",
    "compute": "#76b7b2",
    "optimizer": "#59a14f",
    "collective": "#f28e2b",
    "send": "#edc948",
    "recv": "#b07aa1",
    "data": "#9c755f",
    "host": "#bab0ac",
    "other": "#d4d4d4",
}
_STREAM_ORDER = {"compute": 0, "comm": 1, "host": 2, "copy": 3}


def _lane(rank_label: str, stream: str) -> str:
    return f"{rank_label} · {stream}"


def timeline_figure(spans: pd.DataFrame, *, labels: Mapping[int, str] | None = None,
                    step_bounds: pd.DataFrame | None = None, title: str | None = None) -> go.Figure:
    """Bars of ``spans`` on a millisecond axis from the selection's first start.

    ``labels`` names ranks on the y axis (default ``r<rank>``); ``step_bounds`` (``rank, step,
    start_ns, dur_ns``, optional) draws each step's start as a thin line.
    """
    fig = go.Figure()
    if spans.empty:
        fig.add_annotation(text="no spans in this selection", showarrow=False, x=0.5, y=0.5,
                           xref="paper", yref="paper")
        fig.update_layout(height=200, xaxis_visible=False, yaxis_visible=False)
        return fig
    labels = dict(labels or {})
    t0 = int(spans["start_ns"].min())
    frame = spans.assign(
        lane=[_lane(labels.get(int(r), f"r{int(r)}"), str(s)) for r, s in zip(spans["rank"], spans["stream"], strict=True)],
        start_ms=(spans["start_ns"] - t0) / 1e6,
        dur_ms=spans["dur_ns"] / 1e6,
        wait_ms=(spans["wait_ns"].fillna(0) if "wait_ns" in spans else 0) / 1e6,
    )
    lanes = (
        frame[["rank", "stream", "lane"]].drop_duplicates()
        .assign(order=lambda f: f["stream"].map(_STREAM_ORDER).fillna(9))
        .sort_values(["rank", "order", "stream"])["lane"].tolist()
    )
    frame["busy_start_ms"] = frame["start_ms"] + frame["wait_ms"]
    frame["busy_ms"] = frame["dur_ms"] - frame["wait_ms"]
    hover = ("%{customdata[0]} (%{customdata[1]})<br>step %{customdata[2]} mb %{customdata[3]}"
             "<br>%{customdata[4]:.3f} ms, waited %{customdata[5]:.3f} ms<extra></extra>")
    # numpy arrays, not Series: plotly converts a Series through a dataframe layer on every property.
    custom_columns = ["name", "kind", "step", "microbatch", "dur_ms", "wait_ms"]
    for kind, part in frame.groupby("kind", sort=False):
        colour = KIND_COLOURS.get(str(kind), KIND_COLOURS["other"])
        custom = part[custom_columns].astype(object).where(part[custom_columns].notna(), "-").to_numpy()
        lane = part["lane"].to_numpy()
        fig.add_trace(go.Bar(
            y=lane, x=part["busy_ms"].to_numpy(), base=part["busy_start_ms"].to_numpy(), orientation="h",
            name=str(kind), marker={"color": colour, "line": {"width": 0}}, customdata=custom,
            hovertemplate=hover, legendgroup=str(kind),
        ))
        waited = (part["wait_ms"] > 0).to_numpy()
        if waited.any():
            fig.add_trace(go.Bar(
                y=lane[waited], x=part["wait_ms"].to_numpy()[waited], base=part["start_ms"].to_numpy()[waited],
                orientation="h", name=f"{kind} wait", legendgroup=str(kind), showlegend=False,
                marker={"color": "white", "line": {"color": colour, "width": 1},
                        "pattern": {"shape": "/", "fgcolor": colour, "size": 6}},
                customdata=custom[waited], hovertemplate=hover,
            ))
    if step_bounds is not None and not step_bounds.empty:
        for start_ns in sorted(step_bounds.groupby("step")["start_ns"].min()):
            fig.add_vline(x=(start_ns - t0) / 1e6, line={"color": "#999", "width": 1, "dash": "dot"})
    fig.update_yaxes(categoryorder="array", categoryarray=list(reversed(lanes)), title_text=None)
    fig.update_xaxes(title_text="ms from the selection's first span")
    fig.update_layout(
        barmode="overlay", bargap=0.25, title={"text": title, "x": 0.01, "xanchor": "left"},
        height=max(240, 28 * len(lanes) + 140), margin={"l": 170, "r": 20, "t": 70 if title else 40, "b": 50},
        legend={"orientation": "h", "y": 1.01, "yanchor": "bottom", "x": 1, "xanchor": "right"},
        uirevision="timeline",
    )
    return fig
