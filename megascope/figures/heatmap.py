"""Rank x step heat-map figure from :func:`megascope.analysis.heatmap` cells.

Role in the data flow: a pure function ``(DataFrame, ...) -> go.Figure`` shared by the dashboard,
``megascope heatmap`` and tests. Colour is the value over the peer median (1.0 = like its peers),
so a rank 10% slower than its pipeline stage shows at 1.1 whatever its stage's absolute time.

Example::

    from megascope.analysis import heatmap
    from megascope.figures.heatmap import heatmap_figure
    fig = heatmap_figure(heatmap(run.con, phase="compute", max_ranks=512), phase="compute")
    fig.write_html("heat.html")
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

# Diverging around 1.0: blue faster than peers, white like them, red slower.
_COLORSCALE = [[0.0, "#2166ac"], [0.45, "#f7f7f7"], [0.55, "#f7f7f7"], [0.8, "#ef8a62"], [1.0, "#b2182b"]]


def _label(lo: pd.Series, hi: pd.Series) -> pd.Series:
    return np.where(lo == hi, lo.astype(str), lo.astype(str) + "-" + hi.astype(str))  # type: ignore[return-value]


def heatmap_figure(cells: pd.DataFrame, *, phase: str = "step", title: str | None = None,
                   spread: float = 0.2) -> go.Figure:
    """A heat-map of ``norm`` per (rank bin, step bin); colour range 1 +- ``spread``.

    ``cells`` has the columns of :func:`megascope.analysis.heatmap`. Hover names the worst rank
    of each bin with its host and pp/dp/tp coordinates.
    """
    fig = go.Figure()
    if cells.empty:
        fig.update_layout(title=title or f"{phase}: no data", xaxis_title="step", yaxis_title="rank")
        return fig
    ranks = cells.drop_duplicates("rank_bin").set_index("rank_bin").sort_index()
    steps = cells.drop_duplicates("step_bin").set_index("step_bin").sort_index()
    z = cells.pivot(index="rank_bin", columns="step_bin", values="norm").reindex(index=ranks.index, columns=steps.index)
    cells = cells.assign(
        ranks_label=_label(cells["rank_lo"], cells["rank_hi"]),
        steps_label=_label(cells["step_lo"], cells["step_hi"]),
        coords=cells["pp"].astype("string").fillna("-") + "/" + cells["dp"].astype("string").fillna("-") + "/"
        + cells["tp"].astype("string").fillna("-"),
        ms=cells["value_ns"].astype(float) / 1e6,
    )
    text = cells.pivot(index="rank_bin", columns="step_bin", values="ranks_label").reindex_like(z)
    hover_cols = ["rank", "step", "host", "coords", "ms", "steps_label"]
    custom = np.stack(
        [cells.pivot(index="rank_bin", columns="step_bin", values=c).reindex_like(z).to_numpy(dtype=object)
         for c in hover_cols],
        axis=-1,
    )
    binned = bool((cells["rank_lo"] != cells["rank_hi"]).any() or (cells["step_lo"] != cells["step_hi"]).any())
    fig.add_trace(go.Heatmap(
        z=z.to_numpy(dtype=float), x=steps["step_lo"].to_numpy(), y=ranks["rank_lo"].to_numpy(),
        text=text.to_numpy(dtype=object), customdata=custom,
        colorscale=_COLORSCALE, zmin=1.0 - spread, zmax=1.0 + spread,
        colorbar={"title": "x peer median"},
        hovertemplate=(
            "ranks %{text}, steps %{customdata[5]}<br>worst: rank %{customdata[0]} step %{customdata[1]}"
            "<br>host %{customdata[2]}, pp/dp/tp %{customdata[3]}<br>%{customdata[4]:.2f} ms"
            " = %{z:.3f} x peer median<extra></extra>"
        ),
    ))
    fig.update_layout(
        title=title or f"{phase} time / peer median (same pipeline stage)" + (", worst per bin" if binned else ""),
        xaxis_title="step", yaxis_title="rank", yaxis_autorange="reversed",
        margin={"l": 60, "r": 20, "t": 50, "b": 50},
    )
    return fig
