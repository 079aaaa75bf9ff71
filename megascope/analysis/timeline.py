"""Per-step analyses: step times, the rank x step heat-map, MFU and its drift.

Role in the data flow: thin functions over ``sql/timeline.sql`` and the base tables; the report,
the dashboard's heat-map and MFU pages, and ``megascope heatmap`` call them.

Example::

    from megascope.analysis import heatmap, mfu
    cells = heatmap(run, phase="compute", max_ranks=512, max_steps=200)
    per_step = mfu(run)
"""

from __future__ import annotations

import math

import duckdb
import numpy as np
import pandas as pd

from megascope.analysis import _sql
from megascope.analysis.base import has_step_spans, prepare
from megascope.analysis.stragglers import told
from megascope.errors import ConfigError
from megascope.schema import RunMeta
from megascope.store import Run

# Heat-map phases: name -> SQL expression over ms_cache.rank_step.
PHASES: dict[str, str] = {
    "step": "coalesce(step_ns, extent_ns)",
    "own": "own_ns",
    "compute": "forward_ns + backward_ns + optimizer_ns + compute_ns",
    "forward": "forward_ns",
    "backward": "backward_ns",
    "optimizer": "optimizer_ns",
    "data": "data_ns",
    # Host spans (GC, checkpoints) plus the step's time outside every span: the host pausing
    # or lagging where nothing was timed (ms_cache.host_gaps).
    "host": "host_ns + coalesce(gap_ns, 0)",
    "comm": "comm_ns",
    "wait": "wait_ns",
    "xfer": "xfer_ns",
    "bubble": "p2p_wait_ns",
}


def step_times(run: Run) -> pd.DataFrame:
    """Per (rank, step): start_ns (reference clock) and dur_ns of the step."""
    con = run.con
    prepare(con)
    return _sql.query_df(con, "timeline", "step_times", has_step_spans=has_step_spans(con))


def heatmap(run: Run, *, phase: str = "step", max_ranks: int | None = None,
            max_steps: int | None = None) -> pd.DataFrame:
    """Rank x step cells of ``phase`` normalised within peers, binned server-side.

    Columns: rank_bin, step_bin, rank, step, rank_lo, rank_hi, step_lo, step_hi, value_ns, norm
    (value / peer median; peers = same pipeline stage and step), host, pp, dp, tp. Without
    binning rank_bin and step_bin are positions of rank and step; with binning each cell is its
    bin's worst (largest norm) rank-step, so outliers survive downsampling.
    """
    if phase not in PHASES:
        raise ConfigError(f"unknown heat-map phase {phase!r} (known: {', '.join(PHASES)})")
    for name, value in (("max_ranks", max_ranks), ("max_steps", max_steps)):
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    con = run.con
    prepare(con)
    n_ranks, n_steps = _sql.first(_sql.execute(con, "timeline", "extent")) or (0, 0)
    rank_per_bin = max(1, math.ceil(n_ranks / max_ranks)) if max_ranks else 1
    step_per_bin = max(1, math.ceil(n_steps / max_steps)) if max_steps else 1
    gaps = "(SELECT NULL::INTEGER AS rank, NULL::INTEGER AS step, NULL::BIGINT AS gap_ns WHERE false)"
    if phase == "host":
        with _sql.build_lock():
            if not _sql.cache_is_fresh(con, "host_gaps"):
                _sql.execute(con, "timeline", "host_gaps")
                _sql.mark_built(con, "host_gaps")
        gaps = "ms_cache.host_gaps"
    return _sql.query_df(
        con, "timeline", "heat_cells", value=_sql.Raw(PHASES[phase]), gaps=_sql.Raw(gaps),
        has_step_spans=has_step_spans(con), all_ranks=not told(run),
        rank_per_bin=rank_per_bin, step_per_bin=step_per_bin,
        rank_bins=max_ranks or 0, step_bins=max_steps or 0,
    )


def _tokens(con: duckdb.DuckDBPyConnection, meta: RunMeta, steps: pd.Series) -> pd.Series:
    if meta.tokens_per_step:
        return pd.Series(float(meta.tokens_per_step), index=steps.index)
    logged = _sql.query_df(con, "timeline", "tokens_per_step")
    if logged.empty:
        return pd.Series(np.nan, index=steps.index)
    return steps.map(logged.set_index("step")["tokens"]).astype(float)


def mfu(run: Run) -> pd.DataFrame:
    """Per step: step_time_ns (median over ranks), mfu (NaN without FLOPs/peak in run.json), tokens_per_s.

    MFU = model_flops_per_step / (step_time * world_size * peak_flops_per_device).
    """
    con, meta = run.con, run.meta
    prepare(con)
    steps = _sql.query_df(con, "timeline", "step_summary", has_step_spans=has_step_spans(con))
    seconds = steps["step_time_ns"].astype(float) / 1e9
    if meta.model_flops_per_step and meta.peak_flops_per_device:
        steps["mfu"] = meta.model_flops_per_step / (seconds * meta.world_size * meta.peak_flops_per_device)
    else:
        steps["mfu"] = np.nan
    steps["tokens_per_s"] = _tokens(con, meta, steps["step"]) / seconds
    return steps[["step", "step_time_ns", "mfu", "tokens_per_s", "ranks"]]


def steady_mean(per_step: pd.DataFrame, column: str) -> float | None:
    """The mean of ``column`` of :func:`mfu`'s frame over its steps after the first, where it has
    others: a job's first step holds its warm-up (process groups, first calls, allocations), 8-70x
    a later step on real runs, and at 22 steps would take 4% off a mean MFU. Steps fewer ranks
    finished than the run's others are left out too, where others remain: the step a job hung or
    crashed in lasts until its collective timeout (5.3 s against 0.26-0.59 s in the hang sample,
    its MFU mean 0.43% for 0.57%). None where the column has no value."""
    if column not in per_step or not per_step[column].notna().any():
        return None
    frame = per_step
    if "ranks" in frame and frame["ranks"].notna().any():
        whole = frame[frame["ranks"] == frame["ranks"].max()]
        frame = whole if whole[column].notna().any() else frame
    later = frame.loc[frame["step"] > frame["step"].min(), column].dropna()
    return float(later.mean() if len(later) else frame[column].mean())


# Fewer steps than this cannot tell a drift from noise.
MIN_DRIFT_STEPS = 8


def mfu_drift(per_step: pd.DataFrame, *, skip_first: int = 1, min_change: float = 0.03) -> dict[str, object]:
    """Does step time (hence MFU) drift over the run? A robust slope (Theil-Sen) of step time.

    Returns {drifting, slope_ns_per_step, change_frac (fitted change over the run / fitted start),
    first_step, last_step}. ``drifting`` when the fitted change is at least ``min_change``.
    """
    frame = per_step.iloc[skip_first:] if len(per_step) > skip_first + 2 else per_step
    if "ranks" in frame and len(frame):
        # Steps not every rank finished (a hang, a crash) say nothing about drift.
        frame = frame[frame["ranks"] == frame["ranks"].max()]
    x = frame["step"].to_numpy(dtype=float)
    y = frame["step_time_ns"].to_numpy(dtype=float)
    if len(x) < MIN_DRIFT_STEPS:
        return {"drifting": False, "slope_ns_per_step": 0.0, "change_frac": 0.0,
                "first_step": None, "last_step": None}
    # Theil-Sen on at most ~200 points: pairwise slopes of a subsample keep it cheap.
    idx = np.linspace(0, len(x) - 1, min(len(x), 200)).astype(int)
    xs, ys = x[idx], y[idx]
    i, j = np.triu_indices(len(xs), k=1)
    dx = xs[j] - xs[i]
    slope = float(np.median((ys[j] - ys[i])[dx > 0] / dx[dx > 0]))
    intercept = float(np.median(ys - slope * xs))
    start = intercept + slope * xs[0]
    change = slope * (xs[-1] - xs[0]) / start if start > 0 else 0.0
    # A trend must stand out of the scatter around it, not only be large.
    residual = float(np.median(np.abs(ys - (intercept + slope * xs)))) * 1.4826
    clear = abs(slope * (xs[-1] - xs[0])) >= 3.0 * residual
    return {"drifting": bool(abs(change) >= min_change and clear), "slope_ns_per_step": slope, "change_frac": float(change),
            "first_step": int(xs[0]), "last_step": int(xs[-1])}
