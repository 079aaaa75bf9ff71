"""Rank x step heat-map figure from :func:`megascope.analysis.heatmap` cells.

Role in the data flow: a pure function ``(DataFrame, ...) -> go.Figure`` shared by the dashboard,
``megascope heatmap`` and tests. Colour is the value over the peer median (1.0 = like its peers),
so a rank 10% slower than its pipeline stage shows at 1.1 whatever its stage's absolute time (on a
pure pipeline, whose stages have one rank each, over the median of all ranks: the titles say so). The
colour axis is logarithmic with fixed colours at 1.15x, 1.5x and 3x, so a mild straggler and a
gross one look different; the figure is tall enough for every rank row to get pixels.

Example::

    from megascope.analysis import heatmap
    from megascope.figures.heatmap import heatmap_figure
    fig = heatmap_figure(heatmap(run, phase="compute", max_ranks=512), phase="compute")
    fig.write_html("heat.html")
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from megascope.schema import AXIS_ORDER
from megascope.topology import format_coords

# Colours at fixed ratios to the peer median, placed on a log axis: white within 2%, then pale
# orange, orange at 1.15x, red at 1.5x, dark red at 3x and darker past it; blue below. A 1.15x
# straggler and a 38x one never look alike, and noise of a few percent stays white.
_STOPS = ((0.25, "#08306b"), (0.5, "#2171b5"), (0.9, "#9ecae1"), (0.98, "#f7f7f7"), (1.02, "#f7f7f7"),
          (1.06, "#fdd49e"), (1.15, "#fc8d59"), (1.5, "#d7301f"), (3.0, "#990000"), (10.0, "#4d0000"),
          (100.0, "#1a0000"))
_TICKS = (0.25, 0.5, 0.8, 1.0, 1.15, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 100.0)
# Pixels per rank row: below about one, the browser drops rows when it scales the image down.
ROW_PX = 2.5
# Up to this span of ranks (or steps) the axis gets a tick at each whole number.
_WHOLE_TICKS = 16


def colour_range(norm: pd.Series) -> tuple[float, float]:
    """(low, high) ratios the colours span: symmetric on a log axis, at least 0.5-2x, stretched
    to the largest ratio present (at most 100x)."""
    values = norm.replace([np.inf, -np.inf], np.nan).dropna()
    top = float(values.max()) if len(values) else 2.0
    # Fitted to the slow side (what a person hunts); faster cells saturate at the mirror image.
    high = min(max(2.0, top), 100.0)
    return 1.0 / high, high


def colorscale(low: float, high: float) -> list[list[Any]]:
    """The fixed stops of ``_STOPS`` placed on log2 of [low, high] (ends interpolated)."""
    span = math.log2(high) - math.log2(low)

    def at(v: float) -> float:
        return (math.log2(v) - math.log2(low)) / span

    def colour(v: float) -> str:
        # The colour at ratio v between the stops around it (hex interpolation on a log axis).
        below = max((s for s in _STOPS if s[0] <= v), key=lambda s: s[0], default=_STOPS[0])
        above = min((s for s in _STOPS if s[0] >= v), key=lambda s: s[0], default=_STOPS[-1])
        if above[0] == below[0]:
            return below[1]
        t = (math.log2(v) - math.log2(below[0])) / (math.log2(above[0]) - math.log2(below[0]))
        a = [int(below[1][i:i + 2], 16) for i in (1, 3, 5)]
        b = [int(above[1][i:i + 2], 16) for i in (1, 3, 5)]
        return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(a, b, strict=True))

    scale = [[0.0, colour(low)]]
    scale += [[at(v), c] for v, c in _STOPS if low < v < high]
    scale.append([1.0, colour(high)])
    return scale


def _label(lo: pd.Series, hi: pd.Series) -> pd.Series:
    return np.where(lo == hi, lo.astype(str), lo.astype(str) + "-" + hi.astype(str))  # type: ignore[return-value]


def worst_ranks(cells: pd.DataFrame, limit: int = 10, *, min_norm: float = 1.05) -> pd.DataFrame:
    """The ranks of ``cells`` whose worst cell is at least ``min_norm`` x their peers, worst first:
    rank, host, coords (where ``cells`` has them), pp, dp, tp, worst (ratio), step (where),
    slow_steps (cells at ``min_norm`` or more).
    """
    if cells.empty:
        return pd.DataFrame(columns=["rank", "host", "pp", "dp", "tp", "worst", "step", "slow_steps"])
    frame = cells.dropna(subset=["norm"])
    idx = frame.groupby("rank")["norm"].idxmax()
    place = [c for c in ("coords", "pp", "dp", "tp") if c in frame]
    top = frame.loc[idx, ["rank", "host", *place, "norm", "step"]].rename(columns={"norm": "worst"})
    slow = frame[frame["norm"] >= min_norm].groupby("rank").size().rename("slow_steps")
    top = top.join(slow, on="rank").fillna({"slow_steps": 0})
    top = top[top["worst"] >= min_norm]
    # The most persistent first, then the largest: a rank slow in every step beats a one-off blip.
    return top.sort_values(["slow_steps", "worst", "rank"], ascending=[False, False, True]).head(limit).reset_index(drop=True)


def _places(cells: pd.DataFrame) -> list[str]:
    """Each cell's rank's coordinates as text: from ``coords``, or the axis-named columns of a
    frame without one."""
    if "coords" in cells:
        return [format_coords(c) for c in cells["coords"]]
    axes = [a for a in AXIS_ORDER if a in cells]
    return [format_coords(row) for row in cells[axes].to_dict("records")]


def all_ranks(cells: pd.DataFrame) -> bool:
    """Whether ``cells`` were normalised by the median of every rank in the step (``peers`` 'all':
    no pipeline stage has two ranks) rather than by the rank's stage peers."""
    return "peers" in cells and bool((cells["peers"] == "all").any())


def heat_peers(cells: pd.DataFrame) -> str:
    """What ``cells``' colour is a ratio to, in words for a title."""
    if all_ranks(cells):
        return "median of all ranks (no pipeline stage has two ranks; stages do different work)"
    return "peer median (same pipeline stage)"


def heatmap_figure(cells: pd.DataFrame, *, phase: str = "step", title: str | None = None,
                   flagged: Sequence[int] = (), spread: float | None = None) -> go.Figure:
    """A heat-map of ``norm`` per (rank bin, step bin) on a log colour axis.

    ``cells`` has the columns of :func:`megascope.analysis.heatmap`. Hover names the worst rank
    of each bin with its host and coordinates. ``flagged`` ranks (the stragglers) are
    marked beside the rank axis, so they stay findable however many ranks share a pixel row.
    ``spread`` fixes the colour range to 1/(1+spread)..1+spread instead of fitting it to the data.
    """
    fig = go.Figure()
    if cells.empty:
        fig.update_layout(title=title or f"{phase}: no data", xaxis_title="step", yaxis_title="rank")
        return fig
    against = "median of all ranks" if all_ranks(cells) else "peer median"
    ranks = cells.drop_duplicates("rank_bin").set_index("rank_bin").sort_index()
    steps = cells.drop_duplicates("step_bin").set_index("step_bin").sort_index()
    z = cells.pivot(index="rank_bin", columns="step_bin", values="norm").reindex(index=ranks.index, columns=steps.index)
    cells = cells.assign(
        ranks_label=_label(cells["rank_lo"], cells["rank_hi"]),
        steps_label=_label(cells["step_lo"], cells["step_hi"]),
        coords=_places(cells),
        ms=cells["value_ns"].astype(float) / 1e6,
    )
    text = cells.pivot(index="rank_bin", columns="step_bin", values="ranks_label").reindex_like(z)
    hover_cols = ["rank", "step", "host", "coords", "ms", "steps_label", "norm"]
    custom = np.stack(
        [cells.pivot(index="rank_bin", columns="step_bin", values=c).reindex_like(z).to_numpy(dtype=object)
         for c in hover_cols],
        axis=-1,
    )
    binned = bool((cells["rank_lo"] != cells["rank_hi"]).any() or (cells["step_lo"] != cells["step_hi"]).any())
    low, high = (1.0 / (1.0 + spread), 1.0 + spread) if spread else colour_range(cells["norm"])
    ratios = z.to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_z = np.log2(np.clip(ratios, low, high))
    # Fine ticks near 1 only where the range is narrow enough to keep them apart.
    ticks: list[float] = []
    for t in (t for t in _TICKS if low <= t <= high and (high <= 2.5 or t not in (0.8, 1.15))):
        # At least a tenth of the axis apart, 1x always kept.
        if not ticks or t == 1.0 or math.log2(t) - math.log2(ticks[-1]) >= (math.log2(high) - math.log2(low)) / 10:
            ticks.append(t)
    fig.add_trace(go.Heatmap(
        z=log_z, x=steps["step_lo"].to_numpy(), y=ranks["rank_lo"].to_numpy(),
        text=text.to_numpy(dtype=object), customdata=custom,
        colorscale=colorscale(low, high), zmin=math.log2(low), zmax=math.log2(high),
        colorbar={"title": "x median<br>of all ranks" if all_ranks(cells) else "x peer<br>median", "tickvals": [math.log2(t) for t in ticks],
                  "ticktext": [f"{t:g}x" for t in ticks]},
        hovertemplate=(
            "ranks %{text}, steps %{customdata[5]}<br>worst: rank %{customdata[0]} step %{customdata[1]}"
            "<br>host %{customdata[2]}, pp/dp/tp %{customdata[3]}<br>%{customdata[4]:.2f} ms"
            f" = %{{customdata[6]:.3f}} x {against}<extra></extra>"
        ),
    ))
    rows = len(ranks)
    if flagged:
        # A marker left of the map at each flagged rank's row (the bin holding it).
        bins = ranks.reset_index()[["rank_lo", "rank_hi"]]
        marks = [(int(r), int(b["rank_lo"])) for r in flagged
                 for _, b in bins.iterrows() if b["rank_lo"] <= int(r) <= b["rank_hi"]]
        if marks:
            fig.add_trace(go.Scatter(
                x=[0.0] * len(marks), y=[y for _, y in marks], xaxis="x2", mode="markers+text",
                marker={"symbol": "triangle-right", "size": 11, "color": "#d7301f"},
                text=[f"r{r}" for r, _ in marks], textposition="middle left", textfont={"size": 11, "color": "#990000"},
                hovertemplate="rank %{text}: a straggler<extra></extra>", showlegend=False, name="stragglers",
            ))
    # Ranks and steps are whole numbers: where few rows or columns would leave the axis to place
    # ticks between them (0.5, 1.5), one tick per row or column.
    def whole(values: Any) -> dict[str, Any]:
        return {"dtick": 1} if len(values) and float(np.ptp(values)) <= _WHOLE_TICKS else {}

    fig.update_layout(
        title=title or f"{phase} time / {heat_peers(cells)}" + (", worst per bin" if binned else ""),
        xaxis={"title": "step", "domain": [0.06, 1.0], **whole(steps["step_lo"].to_numpy())},
        xaxis2={"domain": [0.0, 0.05], "range": [-1.0, 0.4], "visible": False, "fixedrange": True},
        # The stragglers' marks sit left of the rank axis: its title goes left of them.
        yaxis={"title": {"text": "rank", "standoff": 34 if flagged else 0}, "autorange": "reversed",
               **whole(ranks["rank_lo"].to_numpy())},
        margin={"l": 84 if flagged else 60, "r": 20, "t": 50, "b": 50},
        height=int(min(900, max(360, ROW_PX * rows + 150))), plot_bgcolor="white",
    )
    return fig
