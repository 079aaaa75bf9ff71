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
        fig.add_trace(
            go.Scatter(x=per_step["step"], y=per_step[col] * scale, mode="lines+markers", name=label,
                       marker_size=4, hovertemplate=f"step %{{x}}<br>{label} %{{y:.4g}}<extra></extra>"),
            row=row, col=1,
        )
    if has_loss:
        assert loss is not None
        fig.add_trace(
            go.Scatter(x=loss["step"], y=loss["value"], mode="lines+markers", name="loss", marker_size=4,
                       hovertemplate="step %{x}<br>loss %{y:.4g}<extra></extra>"),
            row=rows, col=1,
        )
    fig.update_xaxes(title_text="step", row=rows, col=1)
    fig.update_layout(height=170 * rows + 60, showlegend=False, margin={"l": 60, "r": 20, "t": 30, "b": 40},
                      uirevision="overview")
    return fig
