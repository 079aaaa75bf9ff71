"""The mesh of a job as a grid, each rank one cell coloured by its state.

Role in the data flow: pure ``(DataFrame, ...) -> Figure`` over
:func:`megascope.analysis.rank_states`'s frame (``rank, host, coords, state``; a frame with
``pp``, ``dp``, ``tp`` columns instead of ``coords`` also works). The grid is a single heat-map
image (one block of columns per pipeline stage, DP down, every other axis across: ep, cp, tp
nested in that order, tp fastest), so 12,288 ranks are 12,288 numbers in one trace, not 12,288
DOM nodes. Hang suspects are ringed on top.

Example::

    fig = topology_figure(analysis.rank_states(run), suspects=[{"rank": 5, "group": "tp:2"}])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from megascope.schema import AXIS_ORDER, ordered_axes
from megascope.topology import coords_of, format_coords

# Order = colour index. Culprits (hung, silent) in the strongest colours; their victims (waiting)
# pale, so that during a hang the one red cell stands out among hundreds of waiting ones. A rank
# whose trail was lost (its data ends before calls its peers completed with it) is grey: where
# it is cannot be read. In a failed run (no hang: the job ended short of its last step) the rank
# its run state names (it died, left or raised first) is near black.
STATES = ("healthy", "slow", "waiting", "lost", "silent", "hung", "failed")
STATE_COLOURS = {
    "healthy": "#59a14f",
    "slow": "#f28e2b",
    "waiting": "#f6e3a1",
    "lost": "#9e9e9e",
    "silent": "#6b2d8f",
    "hung": "#d62728",
    "failed": "#2b2b2b",
}
_MISSING_COLOUR = "#e8e8e8"
# Past this many data-parallel rows a stage's block is folded into several column groups.
MAX_ROWS = 128


def _discrete_colorscale() -> list[list[Any]]:
    """A stepped colour scale mapping code i (0..n-1) to STATES[i]."""
    n = len(STATES)
    scale: list[list[Any]] = []
    for i, state in enumerate(STATES):
        scale.append([i / n, STATE_COLOURS[state]])
        scale.append([(i + 1) / n, STATE_COLOURS[state]])
    return scale


def grid_positions(states: pd.DataFrame) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Cell (x, y) of each rank: stages side by side, a blank column between them.

    Returns the frame with ``x``, ``y`` added and the geometry (``width``, ``height``, stage
    centres) the figure needs for its axes.
    """
    frame = states.copy()
    places = _places(frame)
    frame["place"] = [format_coords(p) for p in places]
    # Columns within a stage: every axis but pp and dp, the outer ones in blocks (ep, then cp, tp fastest).
    inner_axes = [a for a in ordered_axes({a for p in places for a in p}) if a not in ("pp", "dp")]
    sizes = {a: max((p.get(a, 0) for p in places), default=0) + 1 for a in inner_axes}
    inner = np.zeros(len(frame), dtype=np.int64)
    for axis in inner_axes:
        inner = inner * sizes[axis] + np.array([p.get(axis, 0) for p in places], dtype=np.int64)
    frame["inner"] = inner
    frame["inner_label"] = [format_coords({a: p.get(a, 0) for a in inner_axes}) for p in places]
    frame["pp"] = np.array([p.get("pp", 0) for p in places], dtype=np.int64)
    frame["dp"] = np.array([p.get("dp", 0) for p in places], dtype=np.int64)
    inner_size = math.prod(sizes.values())
    dp_size = int(frame["dp"].max()) + 1 if len(frame) else 1
    pp_size = int(frame["pp"].max()) + 1 if len(frame) else 1
    folds = math.ceil(dp_size / MAX_ROWS)
    rows = math.ceil(dp_size / folds)
    stage_width = inner_size * folds
    frame["x"] = frame["pp"] * (stage_width + 1) + (frame["dp"] // rows) * inner_size + frame["inner"]
    frame["y"] = frame["dp"] % rows
    geometry = {
        "width": pp_size * (stage_width + 1) - 1,
        "height": rows,
        "stage_centres": [p * (stage_width + 1) + (stage_width - 1) / 2 for p in range(pp_size)],
        "pp_size": pp_size,
        "folds": folds,
    }
    return frame, geometry


def _places(frame: pd.DataFrame) -> list[dict[str, int]]:
    """Each row's coordinates: its ``coords``, or the axis-named columns of a frame without one."""
    if "coords" in frame:
        return [coords_of(c) for c in frame["coords"]]
    axes = [a for a in AXIS_ORDER if a in frame]
    return [coords_of(dict(zip(axes, values, strict=True))) for values in zip(*(frame[a] for a in axes), strict=True)] \
        if axes else [{} for _ in range(len(frame))]


def rank_at(states: pd.DataFrame, x: float, y: float) -> int | None:
    """The rank drawn at grid cell (``x``, ``y``) of :func:`topology_figure` (a click's point), or None."""
    frame, _geo = grid_positions(states)
    hit = frame[(frame["x"] == int(round(x))) & (frame["y"] == int(round(y)))]
    return int(hit["rank"].iloc[0]) if len(hit) else None


def topology_figure(states: pd.DataFrame, *, suspects: Sequence[dict[str, Any]] = (),
                    title: str | None = None) -> go.Figure:
    """The grid; ``suspects`` (dicts with at least ``rank``) are ringed and labelled."""
    if states.empty:
        fig = go.Figure()
        fig.add_annotation(text="no ranks reported yet", showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
        fig.update_layout(height=200, xaxis_visible=False, yaxis_visible=False)
        return fig
    frame, geo = grid_positions(states)
    width, height = geo["width"], geo["height"]
    codes = {state: i for i, state in enumerate(STATES)}
    z = np.full((height, width), np.nan)
    rank_grid = np.full((height, width), -1, dtype=np.int64)
    host_grid = np.full((height, width), "", dtype=object)
    state_grid = np.full((height, width), "no data", dtype=object)
    xs, ys = frame["x"].to_numpy(), frame["y"].to_numpy()
    z[ys, xs] = frame["state"].map(codes).to_numpy(dtype=float)
    rank_grid[ys, xs] = frame["rank"].to_numpy()
    host_grid[ys, xs] = frame["host"].astype(str).to_numpy() if "host" in frame else ""
    state_grid[ys, xs] = frame["state"].to_numpy()
    coords_grid = np.full((height, width), "", dtype=object)
    coords_grid[ys, xs] = frame["place"].to_numpy()
    customdata = np.dstack([rank_grid, host_grid, coords_grid, state_grid])
    fig = go.Figure(
        go.Heatmap(
            z=z, customdata=customdata, zmin=-0.5, zmax=len(STATES) - 0.5,
            colorscale=_discrete_colorscale(), showscale=False, xgap=1 if width <= 200 else 0,
            ygap=1 if height <= 100 else 0, hoverongaps=False,
            hovertemplate="rank %{customdata[0]} · %{customdata[3]}<br>%{customdata[1]}<br>%{customdata[2]}<extra></extra>",
            # Rank numbers on the cells while they are big enough to hold them.
            text=np.where(rank_grid >= 0, rank_grid.astype(str), ""), texttemplate="%{text}" if width * height <= 512 else "",
            textfont={"size": 11, "color": "#222"},
        )
    )
    # A legend for the discrete colours: empty scatter traces that only draw legend entries.
    present = set(frame["state"])
    for state in STATES:
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=state, showlegend=True,
                                 marker={"color": STATE_COLOURS[state], "size": 12, "symbol": "square"},
                                 visible=True if state in present else "legendonly"))
    if suspects:
        by_rank = frame.set_index("rank")
        ringed = [s for s in suspects if int(s["rank"]) in by_rank.index]
        if ringed:
            cells = by_rank.loc[[int(s["rank"]) for s in ringed]]
            # Dark ink; red on the near-black cell of a failed run's rank (and in the legend).
            ink = ["#ff6b6b" if state == "failed" else "#111" for state in cells["state"]]
            fig.add_trace(go.Scatter(
                x=cells["x"], y=cells["y"], mode="markers+text", name="suspect",
                text=[f"rank {int(s['rank'])}" for s in ringed], textposition="top center",
                textfont={"color": ink, "size": 13},
                marker={"symbol": "circle-open", "size": 22, "color": ink, "line": {"width": 3}},
                hoverinfo="skip",
            ))
    # Stages across the top; each column's place within its stage (tp, or cp and tp, ...) along
    # the bottom where columns are few enough to read; DP row numbers down the side (every few
    # rows on tall grids).
    fig.update_xaxes(tickvals=geo["stage_centres"], ticktext=[f"pp {p}" for p in range(geo["pp_size"])],
                     showgrid=False, zeroline=False, range=[-0.5, width - 0.5], side="top")
    if width <= 64:
        columns = frame.drop_duplicates("x").sort_values("x")
        for x, label in zip(columns["x"], columns["inner_label"], strict=True):
            fig.add_annotation(x=x, y=0, xref="x", yref="paper", yanchor="top", showarrow=False,
                               text=label, font={"size": 11, "color": "#555"})
    step = max(1, math.ceil(height / 32))
    rows = list(range(0, height, step))
    fig.update_yaxes(title_text="dp" if geo["folds"] == 1 else f"dp (folded x{geo['folds']}: row + {height} x fold)",
                     tickvals=rows, ticktext=[str(r) for r in rows],
                     showgrid=False, zeroline=False, range=[height - 0.5, -0.5])
    cell = max(4, min(28, 700 // max(height, 1)))
    fig.update_layout(
        title=title, height=min(900, max(260, cell * height + 140)), plot_bgcolor=_MISSING_COLOUR,
        margin={"l": 50, "r": 20, "t": 60 if title else 40, "b": 20 if width > 64 else 40},
        legend={"orientation": "h", "y": -0.05 if width > 64 else -0.12},
        uirevision="topology",
    )
    return fig
