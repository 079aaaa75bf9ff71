"""The overview figure: MFU, step time, tokens/s and loss over steps, one panel each.

Role in the data flow: pure ``(DataFrame, ...) -> Figure``; the dashboard's overview page and any
CLI HTML export call it with :func:`megascope.analysis.mfu`'s frame
(``step, step_time_ns, mfu, tokens_per_s``) and, optionally, a ``step, value`` frame of the loss.

Example::

    fig = step_series_figure(analysis.mfu(run), loss=loss_frame)
    fig.write_html("overview.html")
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

_PANELS = (
    ("mfu", "MFU (%)", 100.0),
    ("step_time_ns", "step time (ms)", 1e-6),
    ("tokens_per_s", "tokens/s", 1.0),
)


# The step-time panel's axis fits the steady state: a step longer than the upper quartile plus
# OFF_SCALE_IQR interquartile ranges (and than OFF_SCALE_MEDIAN x the median) is drawn at the
# panel's top edge and named in its title. The first step of a real job (process groups, first
# calls, allocations) is 8-70x the next ones (a 2x H200 FSDP2 job: 1,942 ms, then 26-30 ms),
# and an axis fitted to it flattens every later step into one line.
OFF_SCALE_IQR = 3.0
OFF_SCALE_MEDIAN = 1.5


def off_scale(values: pd.Series) -> float | None:
    """The top of the axis for ``values`` when some of them are off its scale, else None (at
    least four values are needed to tell)."""
    v = values.dropna()
    if len(v) < 4:
        return None
    q1, median, q3 = (float(x) for x in v.quantile([0.25, 0.5, 0.75]))
    cap = max(q3 + OFF_SCALE_IQR * (q3 - q1), OFF_SCALE_MEDIAN * median)
    return cap if float(v.max()) > cap else None


def _fit_to_steady_state(fig: go.Figure, per_step: pd.DataFrame, values: pd.Series, *, row: int, label: str) -> str:
    """Clip the step-time panel at ``row`` to its steady state (see :data:`OFF_SCALE_IQR`), the
    steps above it marked at the top edge; returns the panel's title."""
    cap = off_scale(values)
    if cap is None:
        return label
    inside = values[values <= cap]
    low, high = float(inside.min()), float(inside.max())
    pad = max(0.08 * (high - low), 0.02 * high)
    top = high + pad
    fig.update_yaxes(range=[max(0.0, low - pad), top], row=row, col=1)
    off = per_step.loc[values > cap, "step"]
    shown = values[values > cap]
    fig.add_trace(
        go.Scatter(x=off, y=[top] * len(off), mode="markers", name="off scale", cliponaxis=False,
                   marker={"symbol": "triangle-up", "size": 10, "color": "#d7301f"},
                   customdata=shown, hovertemplate=f"step %{{x}}<br>{label} %{{customdata:.4g}} (off scale)<extra></extra>"),
        row=row, col=1,
    )
    if len(off) <= 3:
        told = ", ".join(f"step {int(s)}: {v:,.0f}" for s, v in zip(off, shown, strict=True))
    else:
        told = f"{len(off)} steps, up to {float(shown.max()):,.0f}"
    return f"{label} · off scale: {told}"


def step_series_figure(per_step: pd.DataFrame, *, loss: pd.DataFrame | None = None) -> go.Figure:
    """One shared-x panel per series; panels whose column is missing or all-null are left out."""
    panels = [(col, label, scale) for col, label, scale in _PANELS
              if col in per_step.columns and per_step[col].notna().any()]
    has_loss = loss is not None and len(loss) > 0 and loss["value"].notna().any()
    rows = len(panels) + int(has_loss)
    if rows == 0:
        fig = go.Figure()
        fig.add_annotation(text="no completed steps yet", showarrow=False, x=0.5, y=0.5,
                           xref="paper", yref="paper")
        fig.update_layout(height=200, xaxis_visible=False, yaxis_visible=False, uirevision="overview")
        return fig
    titles = [label for _, label, _ in panels] + (["loss"] if has_loss else [])
    fig = make_subplots(rows=rows, cols=1, shared_xaxes=True, vertical_spacing=0.06, subplot_titles=titles)
    for row, (col, label, scale) in enumerate(panels, start=1):
        values = per_step[col] * scale
        fig.add_trace(
            go.Scatter(x=per_step["step"], y=values, mode="lines+markers", name=label,
                       marker_size=4, hovertemplate=f"step %{{x}}<br>{label} %{{y:.4g}}<extra></extra>"),
            row=row, col=1,
        )
        if col == "step_time_ns":
            # Subplot titles are the figure's annotations, in panel order.
            fig.layout.annotations[row - 1].text = _fit_to_steady_state(fig, per_step, values, row=row, label=label)
    if has_loss:
        assert loss is not None
        fig.add_trace(
            go.Scatter(x=loss["step"], y=loss["value"], mode="lines+markers", name="loss", marker_size=4,
                       hovertemplate="step %{x}<br>loss %{y:.4g}<extra></extra>"),
            row=rows, col=1,
        )
    fig.update_xaxes(title_text="step", row=rows, col=1)
    if len(per_step) and per_step["step"].max() - per_step["step"].min() < 16:
        # Whole steps only: plotly's automatic ticks put half steps between them on short runs.
        fig.update_xaxes(dtick=1, tick0=0)
    fig.update_layout(height=170 * rows + 60, showlegend=False, margin={"l": 60, "r": 20, "t": 30, "b": 40},
                      uirevision="overview")
    return fig
