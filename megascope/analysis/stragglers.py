"""Stragglers: who is slow against its peers, how often, by how much, and why.

Role in the data flow: reads the base tables (:mod:`megascope.analysis.base`), runs
``sql/stragglers.sql`` and returns one row per straggler, worst first; the report, the dashboard
and ``rank_states`` use it.

Causes, from the excess own time over the peer baseline in the rank's slow steps:

* ``compute``: its forward/backward/optimizer spans are longer than its peers';
* ``data``: its data-wait spans are longer;
* ``host``: neither, yet it arrives late: host spans (GC, checkpoint) or gaps with no device work
  (launch delay, a pause before a collective);
* ``communication``: normal own time, but its transfers (after every member arrived) are slower
  than its peers' (a bad link or NIC).

Example::

    from megascope.analysis import stragglers
    stragglers(run.con)[["rank", "host", "cause", "slowdown", "steps_slow_frac"]]
"""

from __future__ import annotations

from dataclasses import dataclass

import duckdb
import numpy as np
import pandas as pd

from megascope.analysis import _sql
from megascope.analysis.base import prepare
from megascope.errors import ConfigError

COLUMNS = [
    "rank", "host", "pp", "dp", "tp", "phase", "cause", "slowdown", "steps_slow_frac", "steps",
    "excess_ns", "base_own_ns", "last_arrival_frac", "late_at", "impact",
]


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """Thresholds of straggler detection.

    ``min_slowdown``: own time at least this multiple of the peer baseline in a slow step.
    ``z``: robust z-score a slow step also needs when there are five or more peers.
    ``min_frac``: share of steps that must be slow (persistence; one-off hiccups are not stragglers).
    ``rel_floor``: the z-score's scale is at least this fraction of the median, so noise-free
    synthetic peers do not turn 0.1% differences into huge scores.
    ``last_z``: a rank last to arrive at its collectives this many standard deviations more often
    than chance is a straggler when its own time is at least ``min_slowdown`` x its peers'.
    """

    min_slowdown: float = 1.05
    z: float = 3.5
    min_frac: float = 0.3
    min_steps: int = 2
    rel_floor: float = 0.01
    last_z: float = 3.0

    def __post_init__(self) -> None:
        if self.min_slowdown <= 1.0:
            raise ConfigError(f"min_slowdown must be > 1, got {self.min_slowdown}")
        if not 0.0 < self.min_frac <= 1.0:
            raise ConfigError(f"min_frac must be in (0, 1], got {self.min_frac}")
        if self.min_steps < 1:
            raise ConfigError(f"min_steps must be >= 1, got {self.min_steps}")


def has_step_spans(con: duckdb.DuckDBPyConnection) -> bool:
    row = _sql.first(con.execute("SELECT count(*) FROM ms_cache.rank_step WHERE step_ns IS NOT NULL"))
    return bool(row and row[0])


def score(con: duckdb.DuckDBPyConnection, config: StragglerConfig | None = None) -> None:
    """Build ``ms_cache.peer_step`` and ``ms_cache.rank_scores`` (after :func:`prepare`)."""
    config = config or StragglerConfig()
    _sql.execute(con, "stragglers", "macros")
    _sql.execute(con, "stragglers", "peer_step", has_step_spans=has_step_spans(con), rel_floor=config.rel_floor)
    _sql.execute(con, "stragglers", "rank_scores", min_slowdown=config.min_slowdown, z=config.z)


def _pos(frame: pd.DataFrame, column: str) -> pd.Series:
    return frame[column].fillna(0.0).clip(lower=0.0)


def _attribute(c: pd.DataFrame, sizes: dict[str, int]) -> pd.DataFrame:
    """Name each candidate's cause and phase from its excess own time."""
    compute_parts = {
        "forward": _pos(c, "ex_forward_ns"),
        "backward": _pos(c, "ex_backward_ns"),
        "optimizer": _pos(c, "ex_optimizer_ns"),
        "compute": _pos(c, "ex_compute_ns"),
    }
    # Cause from exclusive compute (nested module spans and collective waits inside compute spans
    # removed); the phase from the raw per-kind excess.
    compute = _pos(c, "ex_compute_excl_ns")
    data = _pos(c, "ex_data_ns")
    host_spans = _pos(c, "ex_host_ns")
    # Own time that no compute or data span explains is host time: the CPU lagged or paused.
    residual = (c["ex_own_ns"].fillna(0.0) - compute - data - host_spans).clip(lower=0.0)
    host = host_spans + residual
    excess = pd.DataFrame({"compute": compute, "data": data, "host": host})
    cause = excess.idxmax(axis=1).where(excess.max(axis=1) > 0, "host")
    compute_phase = pd.DataFrame(compute_parts).idxmax(axis=1)
    phase = np.where(cause == "compute", compute_phase, cause)
    # Where it is last more often than chance (1 / group size) says where it arrives late.
    lift = pd.DataFrame({k: c[f"last_{k}"].fillna(0.0) * sizes.get(k, 1) for k in ("tp", "dp", "pp", "other")})
    late_at = lift.idxmax(axis=1).where(lift.max(axis=1) > 1.5, None)
    return pd.DataFrame({"cause": cause, "phase": phase, "late_at": late_at, "excess_ns": c["ex_own_ns"]})


def stragglers(con: duckdb.DuckDBPyConnection, config: StragglerConfig | None = None) -> pd.DataFrame:
    """One row per straggler, worst (largest slowdown x persistence) first; empty when healthy.

    Columns: rank, host, pp, dp, tp, phase, cause (compute | communication | data | host),
    slowdown (own time / peer baseline; transfer time for communication), steps_slow_frac,
    steps, excess_ns (median extra own time per slow step), base_own_ns, last_arrival_frac
    (share of its collectives where it arrived last), late_at (group kind it is most often last
    at), impact.
    """
    config = config or StragglerConfig()
    prepare(con)
    score(con, config)
    c = _sql.query_df(con, "stragglers", "candidates", min_frac=config.min_frac, min_steps=config.min_steps,
                      min_slowdown=config.min_slowdown, z=config.z, last_z=config.last_z)
    if c.empty:
        return pd.DataFrame({col: pd.Series(dtype="object") for col in COLUMNS})
    own_slow = c["straggler"].fillna(False).astype(bool)
    out_own = c[own_slow].copy()
    if not out_own.empty:
        row = _sql.first(con.execute(
            "SELECT count(DISTINCT tp), count(DISTINCT dp), count(DISTINCT pp) FROM ms_cache.rank_info"
        )) or (1, 1, 1)
        sizes = {"tp": max(int(row[0]), 1), "dp": max(int(row[1]), 1), "pp": max(int(row[2]), 1), "other": 2}
        out_own = pd.concat([out_own, _attribute(out_own, sizes)], axis=1)
    out_comm = c[~own_slow & (c["steps_comm_slow_frac"] >= config.min_frac)
                 & (c["steps_slow_frac"] < config.min_frac)].copy()
    if not out_comm.empty:
        out_comm["cause"] = "communication"
        out_comm["phase"] = "comm"
        out_comm["slowdown"] = out_comm["xfer_slowdown"]
        out_comm["steps_slow_frac"] = out_comm["steps_comm_slow_frac"]
        out_comm["excess_ns"] = np.nan
        out_comm["late_at"] = None
    parts = [f for f in (out_own, out_comm) if not f.empty]
    if not parts:
        return pd.DataFrame({col: pd.Series(dtype="object") for col in COLUMNS})
    out = pd.concat(parts, ignore_index=True)
    # Named through arrivals alone: its slowdown over the whole run.
    out["slowdown"] = out["slowdown"].astype(float).fillna(out["median_slowdown"].astype(float))
    out["impact"] = (out["slowdown"].astype(float) - 1.0) * out["steps_slow_frac"].astype(float)
    out = out.sort_values(["impact", "rank"], ascending=[False, True], kind="stable")
    return out[COLUMNS].reset_index(drop=True)
