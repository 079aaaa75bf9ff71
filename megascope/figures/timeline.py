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
    "pause": "#7f7f7f",
    "other": "#d4d4d4",
}
# A gap between a rank's spans inside a step is drawn as a host pause from this length on.
PAUSE_MIN_NS = 2_000_000
_STREAM_ORDER = {"compute": 0, "comm": 1, "host": 2, "copy": 3}


def _lane(rank_label: str, stream: str) -> str:
    return f"{rank_label} · {stream}"


def host_pauses(spans: pd.DataFrame, step_bounds: pd.DataFrame | None = None,
                min_ns: int = PAUSE_MIN_NS) -> pd.DataFrame:
    """Per rank: stretches of at least ``min_ns`` inside its steps that none of its spans covers.

    Columns rank, step, start_ns, dur_ns. Without ``step_bounds`` only gaps between spans count.
    """
    rows: list[dict[str, int]] = []
    timed = spans[spans["step"].notna()] if "step" in spans else spans
    bounds = ({(int(r), int(s)): (int(a), int(a) + int(d)) for r, s, a, d in
               zip(step_bounds["rank"], step_bounds["step"], step_bounds["start_ns"], step_bounds["dur_ns"], strict=True)}
              if step_bounds is not None and not step_bounds.empty else {})
    for (rank, step), part in timed.groupby(["rank", "step"], sort=False):
        starts = part["start_ns"].to_numpy(dtype="int64")
        ends = starts + part["dur_ns"].to_numpy(dtype="int64")
        order = starts.argsort(kind="stable")
        lo, hi = bounds.get((int(rank), int(step)), (int(starts.min()), int(ends.max())))
        reach = lo
        for i in order:
            if starts[i] - reach >= min_ns:
                rows.append({"rank": int(rank), "step": int(step), "start_ns": int(reach), "dur_ns": int(starts[i] - reach)})
            reach = max(reach, int(ends[i]))
        if hi - reach >= min_ns:
            rows.append({"rank": int(rank), "step": int(step), "start_ns": int(reach), "dur_ns": int(hi - reach)})
    return pd.DataFrame(rows, columns=["rank", "step", "start_ns", "dur_ns"])


def timeline_figure(spans: pd.DataFrame, *, labels: Mapping[int, str] | None = None,
                    step_bounds: pd.DataFrame | None = None, title: str | None = None,
                    focus: int | None = None, stopped: Mapping[int, str] | None = None) -> go.Figure:
    """Bars of ``spans`` on a millisecond axis from the selection's first start.

    ``labels`` names ranks on the y axis (default ``r<rank>``); ``step_bounds`` (``rank, step,
    start_ns, dur_ns``, optional) draws each step's start as a thin line. Stretches of a step no
    span covers are drawn as grey "pause" bars on the rank's host lane. ``focus`` (a rank) gets a
    shaded band and bold labels; ``stopped`` maps a rank to what it never did (a hung rank): a
    red mark at the end of its last span says so.
    """
    fig = go.Figure()
    if spans.empty:
        fig.add_annotation(text="no spans in this selection", showarrow=False, x=0.5, y=0.5,
                           xref="paper", yref="paper")
        fig.update_layout(height=200, xaxis_visible=False, yaxis_visible=False)
        return fig
    labels = dict(labels or {})
    pauses = host_pauses(spans, step_bounds)
    if not pauses.empty:
        spans = pd.concat([spans, pauses.assign(name="pause (no span)", kind="pause", stream="host", wait_ns=0)],
                          ignore_index=True)
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
    lane_order = list(reversed(lanes))
    if focus is not None:
        mine = [i for i, lane in enumerate(lane_order) if frame.loc[frame["lane"] == lane, "rank"].iloc[0] == focus]
        if mine:
            fig.add_shape(type="rect", xref="paper", x0=0, x1=1, yref="y", y0=min(mine) - 0.5, y1=max(mine) + 0.5,
                          fillcolor="#fff3b0", opacity=0.45, line={"width": 0}, layer="below")
    for rank, what in (stopped or {}).items():
        mine = frame[frame["rank"] == rank]
        if mine.empty:
            continue
        last = mine.loc[(mine["start_ms"] + mine["dur_ms"]).idxmax()]
        label = f"rank {rank} {what}" if what.startswith("stopped") else f"rank {rank} stopped here: {what}"
        end = float(last["start_ms"] + last["dur_ms"])
        fig.add_trace(go.Scatter(
            x=[end], y=[last["lane"]], mode="markers",
            marker={"symbol": "x-thin", "size": 16, "color": "#d62728", "line": {"width": 3, "color": "#d62728"}},
            name="stopped", showlegend=False, hovertemplate=f"{label}<extra></extra>",
        ))
        # Left of the mark, on a backing of its own: the mark is often the selection's last point,
        # where text to its right would leave the plot.
        fig.add_annotation(x=end, y=last["lane"], text=label, showarrow=False, xanchor="right", xshift=-12,
                           font={"color": "#d62728", "size": 12}, bgcolor="rgba(255,255,255,0.85)")
    if step_bounds is not None and not step_bounds.empty:
        for start_ns in sorted(step_bounds.groupby("step")["start_ns"].min()):
            fig.add_vline(x=(start_ns - t0) / 1e6, line={"color": "#999", "width": 1, "dash": "dot"})
    ticktext = [f"<b>{lane}</b>" if focus is not None and lane.startswith(_lane(labels.get(focus, f"r{focus}"), ""))
                else lane for lane in lane_order]
    fig.update_yaxes(categoryorder="array", categoryarray=lane_order, title_text=None,
                     tickmode="array", tickvals=lane_order, ticktext=ticktext)
    fig.update_xaxes(title_text="ms from the selection's first span")
    fig.update_layout(
        barmode="overlay", bargap=0.25, title={"text": title, "x": 0.01, "xanchor": "left"},
        height=max(240, 28 * len(lanes) + 140), margin={"l": 170, "r": 20, "t": 70 if title else 40, "b": 50},
        legend={"orientation": "h", "y": 1.01, "yanchor": "bottom", "x": 1, "xanchor": "right"},
        uirevision="timeline",
    )
    return fig
