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
    stragglers(run)[["rank", "host", "cause", "slowdown", "steps_slow_frac"]]
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import duckdb
import numpy as np
import pandas as pd

from megascope.analysis import _sql, persist
from megascope.analysis.base import (
    clock_sample_steps,
    has_step_spans,
    kernel_traced,
    peer_kinds_sql,
    prepare,
    sample_steps,
)
from megascope.analysis.pipeline import HOST_BOUND_FRAC, HOST_BOUND_MIN_CALLS, host_lead
from megascope.errors import ConfigError
from megascope.schema import COLLECTOR_CALLS_METRIC, COLLECTOR_STEP_CALLS_METRIC, HOST_PROBE_METRIC, RunSource
from megascope.store import Run

COLUMNS = [
    "rank", "host", "coords", "pp", "dp", "tp", "phase", "cause", "slowdown", "steps_slow_frac", "steps",
    "excess_ns", "base_own_ns", "last_arrival_frac", "late_at", "impact",
    "z", "p_value", "confidence", "t_own", "t_blame", "last_z", "spans_share", "t_spans", "pause_share",
    "device_idle_frac", "cpu_slowdown", "tp_compute_ratio", "dp_compute_ratio", "outside_calls_ratio",
    "slow_groups", "behind",
]
# A rank's host probe (megascope.schema.HOST_PROBE_METRIC) is compared with the median rank's only
# where at least this many ranks wrote at least HOST_PROBE_MIN probes each.
HOST_PROBE_MIN = 2


@dataclass(frozen=True, kw_only=True)
class StragglerConfig:
    """Thresholds of straggler detection.

    ``min_slowdown``: own time at least this multiple of the peer baseline in a slow step.
    ``min_named_slowdown``: a straggler named for its compute (its own spans stretched) is at least
    this multiple of its peers' own time over all its steps (the median ratio); ``min_slowdown``
    suffices for one that pauses outside its spans (cause ``host``), whose pause a TP group's
    waits dilute (real 50 ms skews read 1.07-1.11x). On 60 healthy 8-rank CPU runs over three
    seeds, the three ranks named for their compute at 1.05 were 1.057-1.083x; planted 1.15x
    stragglers measured 1.178x or more (docs/benchmarks.md): 1.10 is MegaScale's "10% slow".
    ``z``: robust z-score a slow step also needs when there are five or more peers.
    ``min_frac``: share of steps that must be slow (persistence; one-off hiccups are not stragglers).
    ``rel_floor``: the z-score's scale is at least this fraction of the median, so noise-free
    synthetic peers do not turn 0.1% differences into huge scores.
    ``last_z``: kept for callers of earlier versions; the last-arrival evidence now enters ``z_comb``.
    ``z_comb``: combined evidence (own time, wait caused, last arrival; see ``sql/stragglers.sql``)
    a straggler needs. On 8-rank CPU runs with eight processes sharing two cores at load average
    12-30, healthy ranks reached 4.3 (docs/benchmarks.md).
    ``shadow``: a second rank is named only with at least this share of the worst one's evidence.
    ``own_shadow``: ... and at least this share of the largest own-time evidence (t_own) named: a
    straggler's TP partner carries much of its evidence (waits inside its spans, its group's late
    arrival at the DP collectives) but little own time (a 1.6x straggler's partner: t_own 3.5
    against 31.8, z 8.7 against 11.1, on a real 8-rank CPU run).
    ``min_host_saving``: a rank named for its host is named only where a replay of its steps at
    its peers' pace saves at least this share of the step, a rank replayed for its compute at
    least this or :data:`COMPUTE_SAVING_BAR`, the lower (0 turns the check off; see
    :func:`_replay_savings`).
    """

    min_slowdown: float = 1.05
    min_named_slowdown: float = 1.10
    z: float = 3.5
    min_frac: float = 0.3
    min_steps: int = 2
    rel_floor: float = 0.01
    last_z: float = 3.0
    z_comb: float = 4.5
    shadow: float = 0.75
    own_shadow: float = 0.5
    min_host_saving: float = 0.007

    def __post_init__(self) -> None:
        if self.min_slowdown <= 1.0:
            raise ConfigError(f"min_slowdown must be > 1, got {self.min_slowdown}")
        if self.min_named_slowdown < 1.0:
            raise ConfigError(f"min_named_slowdown must be >= 1, got {self.min_named_slowdown}")
        if not 0.0 < self.min_frac <= 1.0:
            raise ConfigError(f"min_frac must be in (0, 1], got {self.min_frac}")
        if not 0.0 < self.shadow <= 1.0:
            raise ConfigError(f"shadow must be in (0, 1], got {self.shadow}")
        if not 0.0 < self.own_shadow <= 1.0:
            raise ConfigError(f"own_shadow must be in (0, 1], got {self.own_shadow}")
        if self.z_comb <= 0:
            raise ConfigError(f"z_comb must be > 0, got {self.z_comb}")
        if self.min_steps < 1:
            raise ConfigError(f"min_steps must be >= 1, got {self.min_steps}")
        if not 0.0 <= self.min_host_saving < 1.0:
            raise ConfigError(f"min_host_saving must be in [0, 1), got {self.min_host_saving}")


def score(con: duckdb.DuckDBPyConnection, config: StragglerConfig | None = None) -> None:
    """Build ``ms_cache.rank_scores`` (after :func:`prepare`), through ``ms_cache.peer_step``
    (dropped once read); or read it from the run's analysis cache, where it was kept for the same
    base tables, thresholds and SQL (then ``peer_step`` is not built)."""
    config = config or StragglerConfig()
    _sql.execute(con, "stragglers", "macros")
    spans = has_step_spans(con)
    text = repr((spans, config.rel_floor, config.min_slowdown, config.z, _sql.statements("stragglers")))
    kept = "rank_scores_" + hashlib.sha256(text.encode()).hexdigest()[:16]
    if persist.load_extra(con, kept, table="rank_scores"):
        return
    _sql.execute(con, "stragglers", "peer_step", has_step_spans=spans, rel_floor=config.rel_floor,
                 peer_kinds=peer_kinds_sql(con))
    _sql.execute(con, "stragglers", "rank_scores", min_slowdown=config.min_slowdown, z=config.z)
    _sql.execute(con, "stragglers", "drop_peer_step")
    persist.save_extra(con, kept, table="rank_scores")


def _pos(frame: pd.DataFrame, column: str) -> pd.Series:
    return frame[column].fillna(0.0).clip(lower=0.0)


# A rank is slow in compute when its own compute spans (raw durations) are longer than its
# peers' beyond their noise (t_spans) and carry at least this share of its excess own time. Its
# peers' spans hold their waits for it (collectives nested in forward and backward), which can only
# shrink the share; a host pause outside every span leaves the spans as long as the peers'.
# Either a small share beyond doubt, or a clear share (real skews gave at most 0.22 with t up to
# 1.6, real stragglers at least 0.25 with t from 2, on loaded CPU runs) beyond moderate doubt.
COMPUTE_SHARE = 0.1
# A compute straggler whose device waited for its host at this share of its calls reads ``host``.
LAUNCH_BOUND_FRAC = 0.5
# So does one whose device waited for its host at HOST_BOUND_FRAC of its calls or more, this many
# times as often as its peers' at its stage did (their median, plus one call in a hundred): a GPU
# slow in its own work keeps its device busy and its host ahead. A host that paused a step's launches
# leaves the device idle at the calls after the pause (2x H200, dp2, a device-bound model: a 60 ms
# pause, 15-37% of the rank's calls in four of the 15 steps after the first, its peer's in none;
# planted slow GPUs x1.2-x1.45 in none, 7 runs), where its spans, timed on the device, hold the
# idle time. On a host-bound job every device waits (a Megatron-core tp2 job with a slow GPU: 32%
# of its calls, its partner's 19%).
STARVED_OVER_PEERS = 3.0
# Those shares come from at most this many steps and this many peers of each candidate.
LEAD_STEPS = 128
LEAD_PEERS = 4
COMPUTE_T = 3.0
CLEAR_SHARE = 0.25
CLEAR_T = 2.0


# Time outside every span (sql/stragglers.sql, statement outside: the step's extent less the
# union of the rank's compute and communication spans, on its own clock) tells a pause from slow
# compute where the share above cannot:
#
# - A pause can still stretch the spans after it, a little: on real DDP jobs under torch.profiler
#   (CPU, gloo), a rank sleeping 20-50 ms a step came back to ops 7-10 ms slower than its peers'
#   (cold caches, a CPU given to another rank meanwhile): 11-15% of its excess own time, beyond
#   doubt (t_spans 3.2-3.9), which the small-share rule reads as ``compute``. Its time outside its
#   spans then holds the pause, 22-51 ms beyond its peers', while they wait in their collectives.
#   A row read as ``compute`` on a share under CLEAR_SHARE reads ``host`` where its time outside
#   its spans exceeds its peers' (median over the steps) by at least PAUSE_SHARE of its excess own
#   time and PAUSE_OVER_SPANS times its spans' excess.
# - Its excess own time can also hold what is neither in its spans nor outside them: on those jobs
#   the gradient all-reduces run beside the backward pass, so the peers' waits in them cover some
#   of their own compute, and a rank that arrives last gains that as excess. A 1.15x rank of a
#   5-rank job had 34 ms of excess own time, 4.7 ms of it in its spans (t_spans 2.1) and 0.8 ms
#   outside them, and read ``host``. On a mesh without TP partners (whose spans hold each other's
#   waits, see _tp_stretched), a row read as ``host`` whose spans stretch (t_spans of at least
#   CLEAR_T) by PAUSE_OVER_SPANS times its time outside them beyond its peers', which is under
#   PAUSE_SHARE of its excess own time, reads ``compute``: a host pause is time outside the spans.
# - Where the collectives run inside the spans and block (FSDP's all-gathers inside the forward,
#   its reduce-scatters inside the backward, on gloo), the peers' spans hold their whole wait for
#   a slow rank and the spans stretch no more than theirs: a rank of a 3-rank FSDP1 job doing 3.5x
#   its forward's work had spans 1.5 ms (6% of its 23 ms excess own time) over its peers'. Less
#   the waits inside them (rank_step's compute_excl_ns) they held 99% of it, and nothing was
#   outside them. On a data-parallel-only mesh (no TP partners, no pipeline), a row read as
#   ``host`` whose compute less those waits holds at least EXCL_SHARE of its excess own time (the
#   medians over its slower steps) and PAUSE_OVER_SPANS times its time outside its spans beyond its
#   peers', which is under PAUSE_SHARE of its excess own time, reads ``compute`` too, with phase
#   ``compute``: the spans' excess per phase holds the peers' waits, so which phase is slow is not
#   known. Not with a pipeline: a stage's spans also hold its receives and whatever its schedule
#   does while one is posted: 50-100 ms host pauses of the bundled trainer on pp2 meshes (CPU, 11
#   runs of four sweeps), taken just before a backward, held 0.7-1.3 of their excess there and
#   nothing outside it, and every one would read ``compute``.
#
# A rank slow in its compute has no time outside its spans: they fill its step as its peers' do.
# Where its peers' spans hold their waits for it (a device's collectives inside forward and
# backward), its excess is not in its spans either, but not outside them: the real GPU DDP
# straggler of a 2-rank trace, read ``compute`` on a share of 0.12 (its peer's NCCL kernels hold
# the wait), spent 3.9 ms less outside its spans than its peer.
PAUSE_SHARE = 0.25
PAUSE_OVER_SPANS = 2.0
EXCL_SHARE = 0.5
# Peers whose time outside their spans a candidate's is compared with: at most this many ranks
# at its stage.
PAUSE_PEERS = 8


def _compute_phase(c: pd.DataFrame) -> pd.Series:
    """The compute phase holding most of each row's excess."""
    return pd.DataFrame({
        "forward": _pos(c, "ex_forward_ns"),
        "backward": _pos(c, "ex_backward_ns"),
        "optimizer": _pos(c, "ex_optimizer_ns"),
        "compute": _pos(c, "ex_compute_ns"),
    }).idxmax(axis=1)


def _attribute(c: pd.DataFrame, sizes: dict[str, int]) -> pd.DataFrame:
    """Name each candidate's cause and phase from its excess own time."""
    own = c["median_ex_own_ns"].astype(float)
    spans = c["median_ex_spans_ns"].astype(float)
    share = (spans / own.where(own > 0)).fillna(0.0)
    data = _pos(c, "ex_data_ns")
    data_wins = (data > spans.clip(lower=0.0)) & (data >= 0.5 * own.clip(lower=0.0)) & (data > 0)
    t_spans = c["t_spans"].astype(float).fillna(0.0)
    stretched = ((share >= COMPUTE_SHARE) & (t_spans >= COMPUTE_T)) | ((share >= CLEAR_SHARE) & (t_spans >= CLEAR_T))
    cause = pd.Series(np.where(data_wins, "data", np.where(stretched, "compute", "host")), index=c.index)
    phase = np.where(cause == "compute", _compute_phase(c), cause)
    # Where it is last more often than chance (1 / group size) says where it arrives late.
    lift = pd.DataFrame({k: c[f"last_{k}"].fillna(0.0) * sizes.get(k, 1) for k in ("tp", "dp", "pp", "other")})
    late_at = lift.idxmax(axis=1).where(lift.max(axis=1) > 1.5, None)
    return pd.DataFrame({"cause": cause, "phase": phase, "late_at": late_at, "excess_ns": c["ex_own_ns"],
                         "spans_share": share})


def _stages(run: Run) -> dict[int, int]:
    """Rank -> its pipeline stage."""
    places = _sql.query_df(run.con, "base", "places")
    return dict(zip(places["rank"].astype(int), places["stage"].astype(int), strict=True))


def _stage_peers(stage: dict[int, int], rank: int, limit: int) -> list[int]:
    """At most ``limit`` other ranks at ``rank``'s stage, lowest first."""
    return [r for r in sorted(stage) if r != rank and stage[r] == stage.get(rank)][:limit]


def _outside_excess(run: Run, rank: int, stage: dict[int, int]) -> float | None:
    """The median over the steps of ``rank``'s time outside its spans less the median of at most
    PAUSE_PEERS peers' at its stage, in ns; None without peers or common steps."""
    peers = _stage_peers(stage, rank, PAUSE_PEERS)
    if not peers:
        return None
    read = [rank, *peers]
    outside = _sql.query_df(run.con, "stragglers", "outside", ranks=read, spans=_sql.Raw(run.rank_source("spans", read)))
    table = outside.pivot_table(index="step", columns="rank", values="outside")
    if rank not in table.columns or len(table.columns) < 2:
        return None
    excess = (table[rank] - table.drop(columns=[rank]).median(axis=1)).dropna()
    return float(excess.median()) if not excess.empty else None


def _outside_spans(run: Run, frame: pd.DataFrame, sizes: dict[str, int]) -> pd.DataFrame:
    """The causes of the rows the spans' share cannot settle, from their time outside their spans
    (see PAUSE_SHARE), and ``pause_share``: that time beyond their peers', as a share of their
    excess own time, for the rows checked (NaN for the others)."""
    out = frame.copy()
    out["pause_share"] = np.nan
    out["excl_only"] = 0.0  # 1: read ``compute`` on its compute less the waits inside it alone
    share = out["spans_share"].astype(float)
    weak = (out["cause"] == "compute") & (share < CLEAR_SHARE)
    solo_host = (out["cause"] == "host") & (sizes.get("tp", 1) <= 1)
    stretched = solo_host & (out["t_spans"].astype(float) >= CLEAR_T) & (out["median_ex_spans_ns"].astype(float) > 0)
    excl = out["ex_compute_excl_ns"].astype(float)
    inside = (solo_host & (sizes.get("pp", 1) <= 1) & (excl >= EXCL_SHARE * out["ex_own_ns"].astype(float))
              & (excl > 0))
    if not (weak | stretched | inside).any():
        return out
    stage = _stages(run)
    for idx in out.index[weak | stretched | inside]:
        own = float(out.at[idx, "median_ex_own_ns"])
        pause = _outside_excess(run, int(out.at[idx, "rank"]), stage) if own > 0 else None
        if pause is None:
            continue
        out.at[idx, "pause_share"] = pause / own
        spans = float(out.at[idx, "median_ex_spans_ns"])
        if weak[idx] and pause >= PAUSE_SHARE * own and pause >= PAUSE_OVER_SPANS * spans:
            out.at[idx, "cause"] = "host"
            out.at[idx, "phase"] = "host"
        elif stretched[idx] and pause < PAUSE_SHARE * own and spans >= PAUSE_OVER_SPANS * max(pause, 0.0):
            out.at[idx, "cause"] = "compute"
            out.at[idx, "phase"] = _compute_phase(out.loc[[idx]]).iloc[0]
        elif inside[idx] and pause < PAUSE_SHARE * own and excl[idx] >= PAUSE_OVER_SPANS * max(pause, 0.0):
            # The spans' excess per phase holds the peers' waits: which phase is slow is not known.
            out.at[idx, "cause"] = "compute"
            out.at[idx, "phase"] = "compute"
            out.at[idx, "excl_only"] = 1.0
    return out


# TP-exclusive compute (sql/stragglers.sql, statement tp_exclusive): a rank read as ``host`` whose
# compute outside its TP calls is at least ``min_named_slowdown`` times its partners' (median over
# the timed micro-batches), in at least this share of them, while no other TP group read is
# unbalanced by more than half its excess (a run with a single TP group: its pair's measure alone),
# is named for its compute. Where that rank is not the one
# read as ``host`` but its TP partner, the partner's name goes to it. Besides its own group's, the
# spans of at most TP_REFERENCE_GROUPS other TP groups are read for that noise.
TP_SLOW_FRAC = 0.5
TP_REFERENCE_GROUPS = 4


def _tp_clear(row: Any, config: StragglerConfig) -> bool:
    """Whether one ``tp_exclusive`` row names its rank for its compute (see above). A run with a
    single TP group (a tensor-parallel-only mesh) has no other group to measure the noise by: the
    pair's own measure decides, and a rank whose device waited for its host still reads ``host``
    afterwards (:func:`_launch_bound`), where the replay checks its cost."""
    if pd.isna(row.ratio):
        return False
    ratio = float(row.ratio)
    noise_ok = pd.isna(row.other_imbalance) or float(row.other_imbalance) <= 1.0 + (ratio - 1.0) / 2
    return (ratio >= config.min_named_slowdown and float(row.slow_frac) >= TP_SLOW_FRAC
            and int(row.samples) >= config.min_steps and noise_ok)


def _tp_exclusive(run: Run, ranks: set[int], config: StragglerConfig, *, reference_groups: int = 0) -> dict[int, Any]:
    """The ``tp_exclusive`` rows, by rank, of the members of the TP groups that hold ``ranks``
    and of up to ``reference_groups`` other TP groups (read for the noise); empty without TP groups."""
    members = _sql.query_df(run.con, "stragglers", "tp_members")
    own: list[list[int]] = []
    others: list[list[int]] = []
    for listed in members["members"]:
        group = [int(r) for r in listed]
        (own if ranks.intersection(group) else others).append(group)
    read = sorted({r for group in own + others[:reference_groups] for r in group})
    if not read:
        return {}
    tp = _sql.query_df(run.con, "stragglers", "tp_exclusive", ranks=read, spans=_sql.Raw(run.rank_source("spans", read)),
                       bar=float(config.min_named_slowdown))
    return {int(row.rank): row for row in tp.itertuples()}


def _tp_explained(run: Run, frame: pd.DataFrame, config: StragglerConfig) -> pd.DataFrame:
    """``frame`` without the rows named for their compute whose compute outside their
    tensor-parallel calls is under ``config.min_named_slowdown`` times their TP partners' (where
    the collector timed those calls inside the rank's forward and backward spans).

    A TP call inside a forward span carries its transfer into the span: where one rank's link is
    slow, every member of its TP group has longer spans than the ranks of the other groups, and one
    of them may be named for its compute, the limited rank or a partner (real gloo runs,
    bench/slow_link.py: 0.90x, 0.94x and 0.97x its partners' outside the TP calls). Over the 40
    ranks named for their compute on TP meshes in the kept runs (planted slow ranks, CPU and GPU),
    that measure read 1.20x to over 1.4x."""
    compute = frame["cause"] == "compute"
    if not compute.any():
        return frame
    by_rank = _tp_exclusive(run, {int(r) for r in frame.loc[compute, "rank"]}, config)
    if not by_rank:
        return frame
    keep = pd.Series(True, index=frame.index)
    for idx in frame.index[compute]:
        row = by_rank.get(int(frame.at[idx, "rank"]))
        if (row is not None and not pd.isna(row.ratio) and int(row.samples) >= config.min_steps
                and float(row.ratio) < config.min_named_slowdown):
            keep[idx] = False
    return frame[keep]


def _tp_stretched(run: Run, frame: pd.DataFrame, config: StragglerConfig,
                  pool: pd.DataFrame | None = None, sizes: dict[str, int] | None = None) -> pd.DataFrame:
    """Cause ``compute`` (phase ``compute``) for the rows read as ``host`` whose compute outside
    their tensor-parallel calls is longer than their TP partners', and ``tp_compute_ratio``: that
    ratio for the rows read as ``host`` on a TP mesh, NaN for the others.

    A row read as ``compute`` whose own time is under ``config.min_named_slowdown`` times its
    peers' takes that measure as its slowdown where it is clear (``tp_compute_ratio`` too): on a
    device, the partner waits for it in the TP calls of the micro-batches the collector does not
    time, inside its forward, and its own time holds that wait. A 1.1x slow GPU on tp2 (2x H200)
    slowed the job 8.3% and read 1.052x by its own time, 1.142x outside the TP calls in every
    step; healthy pairs of the same runs 0.988-1.013x.

    On a device, a TP call inside forward or backward holds its members' wait for the slowest one:
    a rank whose GPU is 1.15x slow and its TP partner then have spans of the same length, and the
    slow rank, late at its group's calls with no longer spans, reads ``host``. Its compute less its
    TP calls does not hold the partner's wait. On 4x H200 runs of a 2x2x1 mesh, healthy TP pairs
    measured within 1% of each other and planted 1.15x ranks 1.20x. On a host-bound tp2 x dp2 run
    the pairs are unbalanced by 1.3-1.9x whatever is planted (each rank's host sets its pace); the
    other groups' imbalance is then as large, and the row keeps its cause.

    The rank read as ``host`` may also be the slow GPU's partner: on a 2x2x1 mesh of 4x H100, the
    partner of a 1.15x rank arrived last at 92% of its calls (at the pipeline's sends) while the
    slow rank measured 1.21x outside the TP calls. A row of ``pool`` (every rank's candidate row;
    ``sizes`` as for :func:`_attribute`) then takes the row's place when its own measure is clear and the
    flagged row's is not: cause ``compute``, ``median_slowdown`` and ``steps_slow_frac`` from the
    TP measure (its own time holds the partner's wait), and the flagged row's ``z`` (the evidence
    that something in the pair is slow).
    """
    out = frame.copy()
    out["tp_compute_ratio"] = np.nan
    host = out["cause"] == "host"
    mild = (out["cause"] == "compute") & (out["median_slowdown"].astype(float) < config.min_named_slowdown)
    if not (host | mild).any():
        return out
    by_rank = _tp_exclusive(run, {int(r) for r in out.loc[host | mild, "rank"]}, config,
                            reference_groups=TP_REFERENCE_GROUPS)
    if not by_rank:
        return out
    for idx in out.index[mild]:
        row = by_rank.get(int(out.at[idx, "rank"]))
        if row is not None and _tp_clear(row, config):
            out.at[idx, "tp_compute_ratio"] = float(row.ratio)
            out.at[idx, "median_slowdown"] = float(row.ratio)
            out.at[idx, "steps_slow_frac"] = float(row.slow_frac)
    pool_by_rank = _index_by_rank(pool) if pool is not None else {}
    listed = {int(r) for r in out["rank"]}
    swapped: dict[Any, pd.Series] = {}
    for idx in out.index[host]:
        row = by_rank.get(int(out.at[idx, "rank"]))
        if row is None or pd.isna(row.ratio):
            continue
        out.at[idx, "tp_compute_ratio"] = float(row.ratio)
        if _tp_clear(row, config):
            out.at[idx, "cause"] = "compute"
            out.at[idx, "phase"] = "compute"
            continue
        partners = [p for p in by_rank.values() if p.grp == row.grp and int(p.rank) != int(row.rank)
                    and int(p.rank) not in listed and int(p.rank) in pool_by_rank and _tp_clear(p, config)]
        if not partners or pool is None:
            continue
        best = max(partners, key=lambda p: float(p.ratio))
        picked = pool.loc[[pool_by_rank[int(best.rank)]]]
        new = pd.concat([picked, _attribute(picked, sizes or {})], axis=1).iloc[0].copy()
        new["cause"] = "compute"
        new["phase"] = "compute"
        new["tp_compute_ratio"] = float(best.ratio)
        new["median_slowdown"] = float(best.ratio)
        new["steps_slow_frac"] = float(best.slow_frac)
        new["z"] = out.at[idx, "z"]
        listed.add(int(best.rank))
        swapped[idx] = new
    for idx, new in swapped.items():
        out.loc[idx] = new.reindex(out.columns)
    return out


# Compute against the data-parallel peers (sql/stragglers.sql, statement dp_compute), on meshes
# without tensor-parallel partners: a rank whose forward and backward spans are at least
# DP_COMPUTE_BAR times its peers' at the same stage (median over the steps), and at least
# ``min_named_slowdown`` times in DP_SLOW_FRAC of the steps, is named for its compute even where
# the combined evidence falls short, provided that evidence is at least ``shadow`` times the
# strongest rank's. On a pipeline-and-data-parallel mesh a slow rank makes its whole replica slow
# (its replica-mates wait at their receives, and on shared CPU cores their own time reads nearly as
# slow), so its own time stands out little: planted 1.3x and 1.6x ranks of pp4 x dp2 CPU runs
# scored z 2.7 and 4.2 against the bar of 4.5, with spans 1.39x and 1.29x their peers'. Over the
# healthy and host-pause runs of five CPU sweeps on such meshes (45 runs), no rank's spans measured
# more than 1.17x its peers'; over 17 GPU runs, 1.00x.
DP_COMPUTE_BAR = 1.25
DP_SLOW_FRAC = 0.7
DP_MIN_T_BLAME = 0.0
# A rank whose spans stretch because it waits inside them for a peer that paused outside its own
# (FSDP gathers layers inside the forward) has that peer's pause for its excess. Over 12 real
# dp2 x pp2 CPU runs of a 60 ms pause on a sharded stage that read the paused rank's DP peer's
# spans 1.25x and more, their excess was 22-39 ms a step; the paused rank spent 0.89x-1.29x of it
# more time outside its spans than that peer, and that peer waited 0.84x-1.62x of it more in their
# collectives. Both at least this share of the excess: not named for its spans. Either alone is not
# enough: a DDP peer waits for a slow rank outside its spans too (0.24x-0.83x of the slow rank's
# excess in two kept CPU runs), but in their collectives the slow rank waited no less than its peers
# (-1.43x to -0.09x).
DP_PAUSE_SHARE = 0.5

# Compute outside the calls (sql/stragglers.sql, statement compute_outside_calls): where nothing
# else is named nor dismissed (a replay that found a rank's fix saves nothing stands), on
# host-timed ranks of a mesh without tensor parallelism, a rank whose combined evidence is at
# least OUTSIDE_CALLS_MIN_Z, and whose forward and backward less the calls inside them are at least
# OUTSIDE_CALLS_BAR times its stage peers' (median over the steps read) and at least
# ``min_named_slowdown`` times in DP_SLOW_FRAC of them, is named for its compute. FSDP's
# spans hold its gathers and reductions, which on gloo are most of its step: a rank computing
# 1.25-1.6x its peers' waits less inside its spans, and its spans (dp_compute) read 1.00x, its own
# time 1.04-1.08x, its combined evidence 2.8-4.5. On 62 kept real 2-5 rank CPU runs of DDP and
# FSDP2 jobs under the collector (20 healthy, 20 paused, 22 slow; the bars were read off them), the
# planted ranks that nothing named read 1.20-1.51x in 71-100% of the steps at z 2.8-4.5, and no
# rank that was not planted, at z 2.5 or more, over 1.15x in more than 64% of the steps (a healthy
# 2-rank job's: 1.25x, in 9 steps of 14).
OUTSIDE_CALLS_MIN_Z = 2.5
OUTSIDE_CALLS_BAR = 1.15
OUTSIDE_CALLS_RANKS = 4  # the candidates read, strongest evidence first

# The bar of ``min_named_slowdown`` on a run whose GPU ranks were traced kernel by kernel
# (torch.profiler's CUDA activity; base.kernel_traced): each kernel's device time, and the
# reducer's wait read off the gap before its last reduction ends (sql/base.sql, rank_step's
# kbwd), leave little noise. On 2x H200 DDP jobs under the profiler (seed 2731), healthy ranks read
# 0.99-1.02x their peer, none flagged (combined evidence 2.8 or less); GPUs 1.1x slow read 1.053x
# and 1.059x (the job 1.05x slower, evidence 11.6 and 11.9, last at 97.5% of the reductions), and
# the shared 2-rank sample's rank with 8 extra GEMMs a forward 1.061x (evidence 10.3, last at all
# of them). The collector's GPU runs keep 1.10: their healthy ranks read up to 1.08x, flagged.
KERNEL_NAMED_SLOWDOWN = 1.04

# A rank named for its communication (its transfers slow, its own time not) is not one whose
# combined evidence is below this: a rank that waited for its peers far more than they waited for
# it is their victim, and the transfer time of its overlapping calls holds that wait. On two real
# CPU runs of the trainer (pp3 x dp2 and pp4 x dp2) with a 90 ms host pause on rank 0, its DP peer
# read transfers 3.2x and 5.7x its peers' at z -3.6 and -3.5 and was named `communication` beside
# the paused rank; no other rank of those runs read below -1.7.
COMM_MIN_Z = -2.0

# A slow link or NIC under one rank slows the transfers of every group it is in, and those alone:
# a rank whose groups of two kinds or more each transfer at least LINK_BAR times as long as the
# other groups of their kind doing the same work (sql/stragglers.sql, statement slow_groups), in
# ``min_frac`` of the steps, is named for its communication. Its partners share one slow group
# each, and their own spans hold the slow transfers of the calls made inside them (a TP call
# inside a forward), so they are not named for that. Over the 114 kept CPU runs with two kinds of
# groups compared (TP x DP meshes, healthy and planted stragglers and pauses), no rank's groups
# read more than 1.12x (one group alone up to 1.92x: the DP group of a planted 1.6x compute
# straggler); real gloo runs with one rank's link rate-limited (bench/slow_link.py) read 3.9x and
# 4.5x at 60 and 20 Mbit/s, 1.25x at 250 Mbit/s (the job 1.25x slower, not named).
# Pipeline links count as well, each pair of ranks compared with the other pairs between the same
# two stages (statement slow_edges), both ways: a slow link slows both directions, noise one.
# Over the 114 kept CPU runs with pipeline links compared, one direction alone read up to 2.43x
# (pp4 x dp2, a 1.7x compute straggler), both directions at most 1.37x; the rate-limited runs
# 3.4x to 29x both ways. A rank whose two links (to the stages before and after it), or whose
# link and groups, are slow is named alone; a slow link between two ranks that nothing else tells
# apart names both ends.
LINK_BAR = 1.5
# Pipeline links are held to PAIR_BAR both ways: on pp4 x dp2 at load 7-10 (8 ranks on 2 cores,
# out-of-sample sweeps 3011 and 3037), a healthy run's link read 2.05x and 1.54x (named, a false
# alarm), others up to 1.48x; the rate-limited runs of tests/data read 16.6x-27.7x, bench/slow_link.py's
# 3.4x and more.
PAIR_BAR = 2.0
# A group or link that holds a rank named for its compute is no evidence of a slow link under
# another of its members: on shared CPU cores a collective progresses on its members' CPUs, and a
# rank slow in its compute slows its groups' transfers too. A 3x compute straggler of a tp2 x dp2
# CPU run (4 ranks on 2 loaded cores) read its DP group 2.88x; its DP peer, in that group and a TP
# group read 1.76x, was the two groups' only common member and was named for a slow link in its
# place, the straggler dropped as its mate. The rank itself is named for its link where its
# slowest-reading link or group is still at least as slow as its own time: a slow link stretches
# a rank's own time less than its transfers (a pipeline stage whose spans hold its slow receives
# reads slow in its compute: 1.11x-1.6x own time against links of 1.77x-27.7x over the kept
# slow-link runs), a rank slow in its compute its groups less than itself (the same 3x straggler
# in another run of that test: 4.22x own time, its groups 2.98x and 1.54x, named for a link with
# nothing else named).
# Steps the pipeline links are compared over: every step of a short run, else two runs of
# consecutive steps (the clock sample's steps), which share their row groups in a compacted run.
# 16 up to 1,024 ranks, fewer beyond (4 from 4,096 ranks), so that about as many transfers are
# read at any size: 0.3 s at 1,024 ranks x 1,000 steps (pp8, 16 transfers a rank-step) against
# 1.1 s for 64 steps spread over the run; 0.6 s at 12,288 ranks (4 steps; 1.4 s for 16).
LINK_SAMPLE_STEPS = 16


def _index_by_rank(frame: pd.DataFrame) -> dict[int, Any]:
    """Rank -> the index label of its row in ``frame`` (one row per rank, as the candidates)."""
    return {int(r): i for i, r in frame["rank"].items()}


def _link_row(row: dict[str, Any], slowdown: float, frac: float, notes: list[str]) -> dict[str, Any]:
    """A candidate ``row`` named for a slow link: cause ``communication``, phase ``comm``, its
    ``slowdown`` and ``steps_slow_frac`` those of the link's measure, ``slow_groups`` ``notes``; no
    own-time evidence (the evidence is the link's transfers)."""
    return {**row, "cause": "communication", "phase": "comm", "slowdown": slowdown, "median_slowdown": slowdown,
            "steps_slow_frac": frac, "excess_ns": np.nan, "late_at": None, "spans_share": np.nan,
            "slow_groups": notes, "z": np.nan}


def _link_steps(run: Run, ranks: int) -> list[int]:
    """The steps the pipeline links (and late completions) are read over, see LINK_SAMPLE_STEPS;
    ``ranks``: the run's."""
    count = max(4, min(LINK_SAMPLE_STEPS, LINK_SAMPLE_STEPS * 1024 // max(ranks, 1)))
    return clock_sample_steps([int(s) for (s,) in _sql.execute(run.con, "pipeline", "sample_steps").fetchall()], count)


def _slow_edges(run: Run, ranks: int) -> list[tuple[int, int, int, float, float]]:
    """Each pipeline direction (sender, receiver) as sql/stragglers.sql's statement slow_edges reads
    it over :func:`_link_steps`: (sender, receiver, steps, ratio, slow_frac). Kept beside the run's
    analysis (a second report reads them back), and through an extension of the analysis' tables
    that leaves the sampled steps as they were (a live run's next refresh)."""
    steps = _link_steps(run, ranks)
    kept = persist.memo_get(run.con, "slow_edges")
    if isinstance(kept, dict) and kept.get("steps") == steps and isinstance(kept.get("rows"), list):
        return [(int(a), int(b), int(n), float(r), float(f)) for a, b, n, r, f in kept["rows"]]
    edges = _sql.query_df(run.con, "stragglers", "slow_edges", bar=PAIR_BAR, steps=steps or [-1])
    rows = [(int(row.members[0]), int(row.members[1]), int(row.steps), float(row.ratio), float(row.slow_frac))
            for row in edges.itertuples() if pd.notna(row.ratio)]
    persist.memo_put(run.con, "slow_edges", {"steps": steps, "rows": [list(r) for r in rows]},
                     before=max(steps) + 1 if steps else None)
    return rows


def _slow_pairs(run: Run, ranks: int) -> pd.DataFrame:
    """The pipeline links slow both ways (each direction's median at PAIR_BAR or more;
    :func:`_slow_edges`; ``ranks``: the run's), one row per pair of ranks, in slow_groups'
    columns: ``grp`` "p2p:S<>R", ``kind`` "p2p", the lesser of its two directions' ``ratio`` and
    ``slow_frac``."""
    columns = ["grp", "kind", "members", "steps", "ratio", "slow_frac"]
    pairs: dict[tuple[int, int], list[tuple[float, float, int]]] = {}
    for src, dst, steps, ratio, frac in _slow_edges(run, ranks):
        pairs.setdefault((min(src, dst), max(src, dst)), []).append((ratio, frac, steps))
    rows = [[f"p2p:{a}<>{b}", "p2p", [a, b], min(n for *_, n in both), min(r for r, *_ in both),
             min(f for _, f, _ in both)]
            for (a, b), both in sorted(pairs.items()) if len(both) == 2 and min(r for r, *_ in both) >= PAIR_BAR]
    return pd.DataFrame(rows, columns=columns)


# A pipeline link slow one way (a NIC whose transmit or receive side alone is slow): each
# direction is compared as slow_edges reads it, and noise reads one direction alone up to 2.43x
# (the kept CPU runs; a 1.7x compute straggler's link on pp4 x dp2). A direction at ONE_WAY_BAR or
# more, in ``min_frac`` of the steps, is a slow link one way: a rank every one of whose directions
# in (or out), two or more, is such, is named alone ("into it", "out of it"); a slow direction
# nothing else tells names both its ends ("either end"). Real gloo runs with one rank's receiving
# side limited (bench/slow_link.py --direction in, pp4 x dp2, 2026-11-30): 40 Mbit/s, both links
# into a middle stage's rank 13x and 22x; 120 Mbit/s, a first stage's one link in 3.8x; nothing
# named before. Not on GPU runs (a GPU named in run.json): there a pipeline's transfers,
# timed on the device, read one way up to 5.35x in a run with no slow link (tests/data/gpu-tp-partner,
# a slow GPU on tp2 x pp2). Nor where a rank is named for its own time (slow or paused): it moves
# when its pipeline's transfers run against the other replicas' on shared cores, and directions
# read 3.08x, 3.17x and 3.76x one way in three such runs of sweep 3037 (pp4 x dp2, a 1.6x
# straggler and pauses of 20 and 100 ms), two of them in the other replica; each was named first.
ONE_WAY_BAR = 3.0


def _one_way_links(run: Run, pool: pd.DataFrame, config: StragglerConfig, told: AbstractSet[int],
                   own_time: AbstractSet[int] = frozenset()) -> pd.DataFrame:
    """Rows of ``pool`` (every rank's candidate row) for slow links one way (see ONE_WAY_BAR),
    cause ``communication``, leaving out directions with an end in ``told`` (ranks named already)
    and links slow both ways (:func:`_slow_pairs` names those); none where ``own_time`` (ranks
    named for their own time) has one."""
    if (run.meta.device_name or "cpu").lower() != "cpu" or own_time:
        return pool.iloc[0:0]
    edges = _slow_edges(run, len(pool))
    ratio = {(a, b): r for a, b, _, r, _ in edges}
    slow = [(a, b, r, f) for a, b, _, r, f in edges
            if r >= ONE_WAY_BAR and f >= config.min_frac and ratio.get((b, a), 0.0) < PAIR_BAR
            and not {a, b} & set(told)]
    if not slow:
        return pool.iloc[0:0]
    pool_by_rank = _index_by_rank(pool)
    rows: dict[int, dict[str, Any]] = {}

    def name(rank: int, notes: list[str], worst: float, frac: float) -> None:
        if rank in pool_by_rank and rank not in rows:
            rows[rank] = _link_row(pool.loc[pool_by_rank[rank]].to_dict(), worst, frac, notes)

    explained: set[tuple[int, int]] = set()
    for end, side in ((1, "into it"), (0, "out of it")):
        by_rank: dict[int, list[tuple[int, int, float, float]]] = {}
        for a, b, r, f in slow:
            by_rank.setdefault((a, b)[end], []).append((a, b, r, f))
        for rank, mine in sorted(by_rank.items()):
            every = [e for e in edges if (e[0], e[1])[end] == rank]
            if len(every) >= 2 and len(mine) == len(every):
                name(rank, [f"p2p:{a}>{b} {r:.2f}x ({side})" for a, b, r, _ in mine],
                     min(r for *_, r, _ in mine), min(f for *_, f in mine))
                explained.update((a, b) for a, b, _, _ in mine)
    for a, b, r, f in slow:
        if (a, b) not in explained and not {a, b} & rows.keys():
            for rank in (a, b):
                name(rank, [f"p2p:{a}>{b} {r:.2f}x (one way, either end)"], r, f)
    return pd.DataFrame(list(rows.values())) if rows else pool.iloc[0:0]


def _slow_links(run: Run, pool: pd.DataFrame, config: StragglerConfig,
                computing: AbstractSet[int] = frozenset()) -> tuple[pd.DataFrame, set[int]]:
    """Rows of ``pool`` (every rank's candidate row) for the ranks a slow link is under (see
    LINK_BAR): cause ``communication``, phase ``comm``, ``slowdown`` and ``steps_slow_frac`` the
    least of its slow groups' and links', ``slow_groups`` those ("tp:0 4.04x", "p2p:2<>4
    9.10x"); and the other members of those groups and links. A rank is named alone when its
    slow groups and links have it alone in common and every group it is in that was compared is
    slow; the two ends of a slow pipeline link that no rank explains are both named ("either
    end"): the link is told, its end is not. A group or link holding a rank of ``computing``
    (named for its compute) is no evidence of a link under another of its members, and such a
    rank is named for its own link (or as an end of one) only where none of its slow groups and
    links reads less than its own time (``median_slowdown``)."""
    found = [f for f in (_sql.query_df(run.con, "stragglers", "slow_groups", bar=LINK_BAR), _slow_pairs(run, len(pool)))
             if not f.empty]
    if not found:
        return pool.iloc[0:0], set()
    units = pd.concat(found, ignore_index=True)
    slow = (units["ratio"].astype(float) >= LINK_BAR) & (units["slow_frac"].astype(float) >= config.min_frac)
    if not slow.any():
        return pool.iloc[0:0], set()
    by_rank: dict[int, list[tuple[str, str, float, float, bool]]] = {}
    members: dict[str, set[int]] = {}
    for row, is_slow in zip(units.itertuples(), slow, strict=True):
        members[str(row.grp)] = {int(r) for r in (row.members if row.members is not None else [])}
        for rank in members[str(row.grp)]:
            by_rank.setdefault(rank, []).append(
                (str(row.grp), str(row.kind), float(row.ratio), float(row.slow_frac), bool(is_slow)))
    pool_by_rank = _index_by_rank(pool)

    def row_of(rank: int, own: list[tuple[str, str, float, float, bool]], note: str = "") -> dict[str, Any]:
        return _link_row(pool.loc[pool_by_rank[rank]].to_dict(), min(ratio for _, _, ratio, _, _ in own),
                         min(frac for _, _, _, frac, _ in own),
                         [f"{grp} {ratio:.2f}x{note}" for grp, _, ratio, _, _ in sorted(own, key=lambda g: -g[2])])

    def slower_than(rank: int, ratio: float) -> bool:
        """A rank named for its compute whose own time reads slower than ``ratio``: its links and
        groups hold its slowness, not it theirs."""
        return rank in computing and ratio < float(pool.at[pool_by_rank[rank], "median_slowdown"])

    rows: list[dict[str, Any]] = []
    mates: set[int] = set()
    for rank, own in sorted(by_rank.items()):
        own = [u for u in own if not (computing & members[u[0]]) - {rank}]  # another rank's compute
        hit = [u for u in own if u[4]]
        if not hit or rank not in pool_by_rank or not all(u[4] for u in own if u[1] != "p2p"):
            continue
        if set.intersection(*(members[grp] for grp, *_ in hit)) != {rank}:
            continue
        if slower_than(rank, min(u[2] for u in hit)):
            continue
        rows.append(row_of(rank, hit))
        for grp, *_ in hit:
            mates.update(members[grp] - {rank})
    told = {int(r["rank"]) for r in rows} | mates
    either: dict[int, list[tuple[str, str, float, float, bool]]] = {}
    for row in units[slow & (units["kind"] == "p2p")].itertuples():
        ends = members[str(row.grp)]
        if not ends & told and ends <= pool_by_rank.keys() and not any(slower_than(e, float(row.ratio)) for e in ends):
            for rank in ends:
                either.setdefault(rank, []).append((str(row.grp), "p2p", float(row.ratio), float(row.slow_frac), True))
    rows.extend(row_of(rank, links, " (either end)") for rank, links in sorted(either.items()))
    if not rows:
        return pool.iloc[0:0], set()
    return pd.DataFrame(rows), mates - {int(r["rank"]) for r in rows}


# A rank named for its compute whose collective calls complete later than their other members'
# (sql/stragglers.sql, statement late_completion) by at least LATE_SHARE of its excess own time,
# summed per step, and whose forward and backward less the calls inside them are under
# ``min_named_slowdown`` times its stage peers' (statement compute_outside_calls), is slow in the
# data arriving into it, not in its compute: a call completes on every member at about the same
# time once the last one arrived, and a member whose data comes late completes late at every call.
# Real gloo runs with one rank's sending side alone rate-limited (bench/slow_link.py --direction
# out, 2026-11-30): on pp2 x dp2, pp3 x dp2 and dp4 the rank receiving from it was named
# `compute` first (1.34-2.95 times its excess own time in late completions), the limited rank
# first in none. Planted compute stragglers on CPU read 0.01-0.33 but for a sharded pipeline
# stage's (1.01), whose compute outside its calls read 1.57x its peer's (x1.15-x1.2 stragglers:
# 1.24-1.47x). On a device clock the measure does not hold (slow GPUs on dp2 complete their
# asynchronous calls 2.0-2.8 times their excess late): host clocks only.
LATE_SHARE = 0.5
# Groups read for late completions: at most this many members (every member's spans are read), and
# not the world's. Steps: as many as the pipeline links read (LINK_SAMPLE_STEPS, fewer past 1,024 ranks).
LATE_GROUP_MAX = 64


def _late_inbound(run: Run, frame: pd.DataFrame, pool: pd.DataFrame,
                  config: StragglerConfig) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``frame`` (named rows) without the rows named for their compute whose excess is data
    arriving late (see LATE_SHARE), and those rows again, cause ``communication``: in a group of
    two, both ends of the slow direction (the sender's row from ``pool``, every rank's candidate
    row), ``slow_groups`` "dp:0 3>1 312 ms a step late (late, either end)": the sender's link or
    the receiver's; in a larger group the receiving rank alone, "... late (late, into it)"."""
    none = frame.iloc[0:0]
    idle = frame["device_idle_frac"] if "device_idle_frac" in frame else pd.Series(np.nan, index=frame.index)
    pick = (frame["cause"] == "compute") & idle.isna() & (frame["median_ex_own_ns"].astype(float) > 0)
    if not pick.any() or run.meta.source == RunSource.SYNTH:
        return frame, none
    stage = _stages(run)
    ranks = sorted(int(r) for r in frame.loc[pick, "rank"])
    members = {str(g): [int(r) for r in m] for g, m in _sql.execute(
        run.con, "stragglers", "group_members", max_members=LATE_GROUP_MAX).fetchall()}
    read = sorted(set(ranks).union(*(m for m in members.values() if set(m) & set(ranks))))
    steps = _link_steps(run, len(pool))
    if not steps:
        return frame, none
    lag = _sql.query_df(run.con, "stragglers", "late_completion", ranks=ranks, steps=steps, max_members=LATE_GROUP_MAX,
                        spans=_sql.Raw(run.rank_source("spans", read)))
    rows: list[dict[str, Any]] = []
    moved: set[int] = set()
    pool_by_rank = _index_by_rank(pool)
    for idx in frame.index[pick]:
        rank = int(frame.at[idx, "rank"])
        own = lag[lag["rank"] == rank]
        late = float(own["lag_ns"].sum())
        if late < LATE_SHARE * float(frame.at[idx, "median_ex_own_ns"]):
            continue
        peers = _stage_peers(stage, rank, PAUSE_PEERS)
        compute = _sql.query_df(run.con, "stragglers", "compute_outside_calls", ranks=[rank, *peers], steps=steps,
                                spans=_sql.Raw(run.rank_source("spans", [rank, *peers])))
        table = compute.pivot_table(index="step", columns="rank", values="compute")
        if rank not in table.columns or len(table.columns) < 2:
            continue
        ratio = float((table[rank] / table.drop(columns=[rank]).median(axis=1)).median())
        if not ratio < config.min_named_slowdown:
            continue
        moved.add(rank)
        row = frame.loc[idx].to_dict()
        # Both ends read the receiving rank's own time over its peers'.
        slowdown, frac = float(row["median_slowdown"]), float(row["steps_slow_frac"])
        for grp, ns in sorted(zip(own["grp"], own["lag_ns"].astype(float), strict=True), key=lambda g: -g[1]):
            if ns < LATE_SHARE * late:
                continue
            others = [r for r in members.get(str(grp), []) if r != rank]
            if len(others) == 1 and others[0] in pool_by_rank:
                note = [f"{grp} {others[0]}>{rank} {ns / 1e6:.0f} ms a step late (late, either end)"]
                rows.append(_link_row(row, slowdown, frac, note))
                rows.append(_link_row(pool.loc[pool_by_rank[others[0]]].to_dict(), slowdown, frac, note))
            else:
                rows.append(_link_row(row, slowdown, frac, [f"{grp} {ns / 1e6:.0f} ms a step late (late, into it)"]))
    if not rows:
        return frame, none
    out = pd.DataFrame(rows).drop_duplicates(subset="rank")
    return frame[~frame["rank"].isin(moved)], out


def _dp_stretched(run: Run, pool: pd.DataFrame, sizes: dict[str, int], config: StragglerConfig,
                  named: set[int]) -> pd.DataFrame:
    """Rows of ``pool`` (every rank's candidate row) for the ranks not in ``named`` whose compute
    spans stretch against their data-parallel peers' (see above): cause ``compute``, the ratio as
    ``median_slowdown`` and ``dp_compute_ratio``, the share of its steps over the bar as
    ``steps_slow_frac``; a rank whose device waited for its host reads ``host`` after it
    (:func:`_launch_bound`)."""
    dp = _sql.query_df(run.con, "stragglers", "dp_compute", bar=float(config.min_named_slowdown))
    if dp.empty:
        return pool.iloc[0:0]
    clear = dp[(dp["ratio"].astype(float) >= DP_COMPUTE_BAR) & (dp["slow_frac"].astype(float) >= DP_SLOW_FRAC)
               & (dp["samples"].astype(int) >= config.min_steps) & ~dp["rank"].astype(int).isin(named)]
    # Not a rank that waits for its peers: a rank whose spans hold collectives (FSDP gathers its
    # layers inside the forward) waits there for a peer that paused outside its own spans, and its
    # spans stretch with that wait. The wait it caused its peers is then below the wait they caused
    # it (t_blame < DP_MIN_T_BLAME): on a real dp2 x pp2 CPU run with sharded stages, the paused
    # rank's DP peer read spans 1.40x its own in 85% of the steps, t_blame -2.2; planted slow ranks
    # of real runs (sharded pipeline stages, DDP, the trainer's pp4 x dp2) read 0.4 to 12.5.
    if "t_blame" in pool:
        waiting = pool.loc[pool["t_blame"].astype(float) < DP_MIN_T_BLAME, "rank"].astype(int)
        clear = clear[~clear["rank"].astype(int).isin(waiting)]
    # The same, where the wait given and taken came out even (one run in 14 of that pause): the
    # peer's pause outside its spans matches the stretch of this rank's (DP_PAUSE_SHARE).
    if not clear.empty:
        clear = clear[[not _waits_for_paused_peer(run, int(r), dp) for r in clear["rank"]]]
    # Not the wake of a worse rank: its combined evidence at least ``shadow`` times the strongest
    # of the ranks that are stragglers themselves (flagged, named, or stretched here): a
    # replica-mate of a slow rank had spans 1.22x its DP peer's, on a real pp4 x dp2 CPU run, with
    # a third of the slow rank's evidence. A rank that is none of these is no worse rank, only a
    # wake: the next stage of a 1.15x rank's replica, waiting at its receives, read z 4.1 against
    # the slow rank's 3.0 (spans 1.34x its DP peer's in 87% of the steps) and kept it unnamed.
    ranks = pool["rank"].astype(int)
    stretched = ranks.isin(clear["rank"].astype(int))
    strong = stretched | ranks.isin(named)
    if "flag" in pool:
        strong |= pool["flag"].fillna(False).astype(bool)
    top = float(pool.loc[strong, "z"].astype(float).max()) if strong.any() else float("nan")
    rows = pool[stretched & (pool["z"].astype(float) >= config.shadow * top)]
    if rows.empty:
        return pool.iloc[0:0]
    ratio = dict(zip(clear["rank"].astype(int), clear["ratio"].astype(float), strict=True))
    frac = dict(zip(clear["rank"].astype(int), clear["slow_frac"].astype(float), strict=True))
    out = pd.concat([rows, _attribute(rows, sizes)], axis=1)
    out["cause"] = "compute"
    out["phase"] = "compute"
    out["median_slowdown"] = [ratio[int(r)] for r in out["rank"]]
    out["steps_slow_frac"] = [frac[int(r)] for r in out["rank"]]
    out["dp_compute_ratio"] = out["median_slowdown"]
    return _launch_bound(run, out)


def _outside_calls_stretched(run: Run, pool: pd.DataFrame, sizes: dict[str, int],
                             config: StragglerConfig) -> pd.DataFrame:
    """Rows of ``pool`` (every rank's candidate row) for the ranks whose compute outside their calls
    stretches against their stage peers' (see OUTSIDE_CALLS_BAR), where nothing else was named:
    cause ``compute``, the ratio as ``median_slowdown`` and ``outside_calls_ratio``, the share of
    the steps read at ``min_named_slowdown`` or more as ``steps_slow_frac``."""
    none = pool.iloc[0:0]
    if run.meta.source == RunSource.SYNTH or sizes["tp"] > 1 or "z" not in pool:
        return none
    timed = {int(r) for (r,) in _sql.execute(run.con, "stragglers", "device_timed").fetchall()}
    z = pool["z"].astype(float)
    pick = pool[(z >= OUTSIDE_CALLS_MIN_Z) & ~pool["rank"].astype(int).isin(timed)]
    pick = pick.sort_values("z", ascending=False).head(OUTSIDE_CALLS_RANKS)
    if pick.empty:
        return none
    stage = _stages(run)
    steps = _link_steps(run, len(pool))
    peers = {int(r): [p for p in _stage_peers(stage, int(r), PAUSE_PEERS) if p not in timed] for r in pick["rank"]}
    read = sorted(set(peers).union(*peers.values()))
    if not steps or len(read) < 2:
        return none
    # One read of the candidates' and their peers' spans (they share their stage's peers).
    table = _sql.query_df(run.con, "stragglers", "compute_outside_calls", ranks=read, steps=steps,
                          spans=_sql.Raw(run.rank_source("spans", read))
                          ).pivot_table(index="step", columns="rank", values="compute")
    ratios: dict[int, tuple[float, float]] = {}
    for rank, mine in peers.items():
        others = [p for p in mine if p in table.columns]
        if rank not in table.columns or not others:
            continue
        ratio = (table[rank] / table[others].median(axis=1)).replace([np.inf, -np.inf], np.nan).dropna()
        if len(ratio) < config.min_steps:
            continue
        mid, frac = float(ratio.median()), float((ratio >= config.min_named_slowdown).mean())
        if mid >= OUTSIDE_CALLS_BAR and frac >= DP_SLOW_FRAC:
            ratios[rank] = (mid, frac)
    rows = pick[pick["rank"].astype(int).isin(ratios)]
    if rows.empty:
        return none
    out = pd.concat([rows, _attribute(rows, sizes)], axis=1)
    out["cause"] = "compute"
    out["phase"] = "compute"
    out["median_slowdown"] = [ratios[int(r)][0] for r in out["rank"]]
    out["steps_slow_frac"] = [ratios[int(r)][1] for r in out["rank"]]
    out["outside_calls_ratio"] = out["median_slowdown"]
    return out


def _waits_for_paused_peer(run: Run, rank: int, dp: pd.DataFrame) -> bool:
    """Whether one of ``rank``'s data-parallel peers (``dp``: the ``dp_compute`` rows; its peers
    are the ranks at its stage and TP coordinate, at most PAUSE_PEERS, those whose spans read
    shortest first) both spent more time outside its spans than ``rank`` did and made ``rank`` wait
    for it in their collectives more than it waited for ``rank``, each by at least DP_PAUSE_SHARE
    of ``rank``'s span excess over its peers (medians over the steps)."""
    places = _sql.query_df(run.con, "base", "places").set_index("rank")
    if rank not in places.index:
        return False
    here = places.loc[rank]
    same = places[(places["stage"] == here["stage"]) & (places["tp"].isna() if pd.isna(here["tp"])
                                                        else places["tp"] == here["tp"])]
    ratio = dp.set_index("rank")["ratio"].astype(float)
    peers = [int(r) for r in ratio[ratio.index.isin(same.index) & (ratio.index != rank)]
             .sort_values().index[:PAUSE_PEERS]]
    if not peers:
        return False
    read = [rank, *peers]
    steps = _sql.query_df(run.con, "stragglers", "step_compute", ranks=read)
    outside = _sql.query_df(run.con, "stragglers", "outside", ranks=read,
                            spans=_sql.Raw(run.rank_source("spans", read)))
    spans = steps.pivot_table(index="step", columns="rank", values="compute")
    waits = steps.pivot_table(index="step", columns="rank", values="coll_wait")
    out = outside.pivot_table(index="step", columns="rank", values="outside")
    peers = [p for p in peers if p in spans.columns and p in out.columns]
    if rank not in spans.columns or rank not in out.columns or not peers:
        return False
    excess = (spans[rank] - spans[peers].median(axis=1)).dropna()
    if excess.empty or not float(excess.median()) > 0:
        return False
    bar = DP_PAUSE_SHARE * float(excess.median())
    for peer in peers:
        paused = (out[peer] - out[rank]).dropna()
        waited = (waits[rank] - waits[peer]).dropna()
        if (not paused.empty and not waited.empty and float(paused.median()) >= bar
                and float(waited.median()) >= bar):
            return True
    return False


def p_value(z: float, ranks: int) -> float:
    """One-sided normal tail of ``z``, times the ranks tested (Bonferroni), at most 1."""
    return min(1.0, 0.5 * math.erfc(z / math.sqrt(2.0)) * max(ranks, 1))


def stragglers(run: Run, config: StragglerConfig | None = None) -> pd.DataFrame:
    """One row per straggler, strongest evidence first; empty when healthy.

    Columns: rank, host, coords (axis -> index, every axis of the mesh), pp, dp, tp, phase, cause (compute | communication | data | host),
    slowdown (own time / peer baseline; transfer time for communication), steps_slow_frac,
    steps, excess_ns (median extra own time per step it was slower), base_own_ns,
    last_arrival_frac (share of its collectives where it arrived last), late_at (group kind it is
    most often last at), impact, and the evidence: z (combined), p_value (one-sided, times the
    ranks tested), confidence (1 - p_value), t_own, t_blame, last_z, spans_share (share of its
    excess own time inside its own compute spans), t_spans (that excess over its noise),
    device_idle_frac (share of its communication calls at which its device was idle, waiting for
    its host; for stragglers named for their compute or host and timed on a device, else NaN): a
    compute straggler at ``LAUNCH_BOUND_FRAC`` or more reads ``host`` (see :func:`_launch_bound`), and cpu_slowdown
    (its host probe over the median rank's: how much slower the CPU under its training thread ran
    a fixed loop; NaN where the run has no probes, see :func:`cpu_slowdown`), tp_compute_ratio and
    dp_compute_ratio (its compute against its TP partners' or its data-parallel peers', for the
    ranks those measures named; see :func:`_tp_stretched` and :func:`_dp_stretched`), and
    outside_calls_ratio (its forward and backward less the calls inside them against its stage
    peers', for the ranks that measure named; see :func:`_outside_calls_stretched`).
    """
    return detect(run, config)[0]


def detect(run: Run, config: StragglerConfig | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(:func:`stragglers`, :func:`dismissed`) of one pass: the report wants both. Without a
    ``config``, the defaults; on a run whose GPU ranks were traced kernel by kernel (a Kineto
    trace), a compute straggler is named from :data:`KERNEL_NAMED_SLOWDOWN`."""
    if config is None:
        prepare(run.con)
        config = StragglerConfig(min_named_slowdown=KERNEL_NAMED_SLOWDOWN) if kernel_traced(run.con) else StragglerConfig()
    c, sizes = _candidates(run, config)
    gone: list[pd.DataFrame] = []
    if c.empty:
        return _empty(COLUMNS), _dismissed_frame(run, gone)
    own_slow = c["straggler"].fillna(False).astype(bool)
    out_own = c[own_slow].copy()
    first_pass = set(out_own["rank"])  # a rank whose TP partner took its row does not come back below
    if not out_own.empty:
        out_own = _causes(run, out_own, sizes, config, c)
        replayed = [int(r) for r in out_own["rank"]]
        saving = _replay_savings(run, out_own, config, sizes)
        costless = _costless(out_own, saving, config)
        gone.append(out_own[costless].assign(saving=saving[costless]))
        if costless.any():
            # A dismissed rank no longer shades the others: the shadow rule (sql/stragglers.sql,
            # statement candidates) is taken again over the flagged ranks that are left.
            flagged = c[c["flag"].fillna(False).astype(bool) & ~c["rank"].isin(out_own.loc[costless, "rank"])]
            top_z, top_own = flagged["z"].astype(float).max(), flagged["t_own"].astype(float).max()
            shaded = flagged[(flagged["z"].astype(float) >= config.shadow * top_z)
                             & (flagged["t_own"].astype(float) >= config.own_shadow * top_own)
                             & ~flagged["rank"].isin(out_own["rank"]) & ~flagged["rank"].isin(first_pass)]
            out_own = out_own[~costless]
            if not shaded.empty:
                shaded = _causes(run, shaded, sizes, config, c)
                shaded = shaded[~shaded["rank"].isin(out_own["rank"])]
                saving = _replay_savings(run, shaded, config, sizes, fixed=replayed)
                costless = _costless(shaded, saving, config)
                out_own = pd.concat([out_own, shaded[~costless]])
                gone.append(shaded[costless].assign(saving=saving[costless]))
    stretched = _dp_stretched(run, c, sizes, config, named={int(r) for r in out_own["rank"]})
    if not stretched.empty:
        out_own = pd.concat([out_own, stretched]) if not out_own.empty else stretched
        own_slow = own_slow | c["rank"].isin(stretched["rank"])
    if out_own.empty and not any(not g.empty for g in gone):  # none named, none dismissed
        out_own = _outside_calls_stretched(run, c, sizes, config)
        own_slow = own_slow | c["rank"].isin(out_own["rank"])
    if not out_own.empty:
        out_own = _tp_explained(run, out_own, config)
    out_comm = c[~own_slow & (c["steps_comm_slow_frac"] >= config.min_frac)
                 & (c["steps_slow_frac"] < config.min_frac) & ~(c["z"].astype(float) < COMM_MIN_Z)].copy()
    if not out_comm.empty:
        out_comm["cause"] = "communication"
        out_comm["phase"] = "comm"
        out_comm["slowdown"] = out_comm["xfer_slowdown"]
        out_comm["steps_slow_frac"] = out_comm["steps_comm_slow_frac"]
        out_comm["excess_ns"] = np.nan
        out_comm["late_at"] = None
        out_comm["spans_share"] = np.nan
    out_late = out_own.iloc[0:0]
    if not out_own.empty:
        out_own, out_late = _late_inbound(run, out_own, c, config)
    computing = ({int(r) for r, cause in zip(out_own["rank"], out_own["cause"], strict=True) if cause == "compute"}
                 if "cause" in out_own else set())
    out_link, mates = _slow_links(run, c, config, computing)
    if not out_link.empty:
        # The named link's partners are stretched by it: their rows go, as does the rank's own.
        gone_ranks = mates | set(out_link["rank"])
        out_own = out_own[~out_own["rank"].isin(gone_ranks)]
        out_comm = out_comm[~out_comm["rank"].isin(gone_ranks)]
        out_late = out_late[~out_late["rank"].isin(out_link["rank"])]
    out_comm = out_comm[~out_comm["rank"].isin(out_late["rank"])]
    told = {int(r) for f in (out_link, out_late, out_own) for r in f["rank"]} | mates
    out_oneway = _one_way_links(run, c, config, told, own_time={int(r) for r in out_own["rank"]})
    out_comm = out_comm[~out_comm["rank"].isin(out_oneway["rank"])]
    parts = [f for f in (out_link, out_late, out_oneway, out_own, out_comm) if not f.empty]
    if not parts:
        return _empty(COLUMNS), _dismissed_frame(run, gone)
    out = pd.concat(parts, ignore_index=True)
    # Own-time stragglers: the median over all its steps (the median over its slow steps alone
    # overstates a mild straggler on noisy steps).
    own_rows = out["cause"] != "communication"
    out.loc[own_rows, "slowdown"] = out.loc[own_rows, "median_slowdown"].astype(float)
    out["slowdown"] = out["slowdown"].astype(float).fillna(out["median_slowdown"].astype(float))
    ranks = int(len(c))
    out["p_value"] = [p_value(float(z), ranks) if pd.notna(z) else None for z in out["z"]]
    out["confidence"] = [1.0 - p if p is not None else None for p in out["p_value"]]
    out["impact"] = (out["slowdown"].astype(float) - 1.0) * out["steps_slow_frac"].astype(float)
    # Worst first: strongest evidence (a straggler named on noisy steps has few slow steps, so
    # slowdown x persistence would put its own wake ahead of it), then impact.
    # A named link first: it slows every group it is in, and with them the whole job.
    out["_z"] = out["z"].astype(float).where(out["cause"] != "communication", -np.inf)
    if "slow_groups" in out:
        out.loc[out["slow_groups"].notna(), "_z"] = np.inf
    out = _replica_order(out.sort_values(["_z", "impact", "rank"], ascending=[False, False, True], kind="stable"))
    for column in ("device_idle_frac", "tp_compute_ratio", "dp_compute_ratio", "outside_calls_ratio", "pause_share",
                   "slow_groups"):
        if column not in out:
            out[column] = np.nan
    probe = cpu_slowdown(run)
    out["cpu_slowdown"] = [probe.get(int(r), np.nan) for r in out["rank"]]
    return out[COLUMNS].reset_index(drop=True), _dismissed_frame(run, gone)


def _replica_order(out: pd.DataFrame) -> pd.DataFrame:
    """``out`` (sorted worst first) with the ranks named for their compute in one pipeline replica
    (one DP index, other stages) reordered among the places they hold: the one whose own spans
    stretch most (``t_spans``) first. A slow stage holds back the later stages of its replica,
    which then reach their DP calls late and are waited for by their DP peers: their ``z`` carries
    the slow stage's wake, their spans do not. ``behind``: for a later stage of such a replica
    named after that rank, that rank (NaN for the others)."""
    out = out.assign(behind=np.nan)
    pick = out[(out["cause"] == "compute") & out["pp"].notna() & out["dp"].notna()]
    order = list(out.index)
    for _, group in pick.groupby("dp"):
        if len(group) < 2 or group["pp"].nunique() < 2:
            continue
        places = sorted(order.index(i) for i in group.index)
        ranked = group.sort_values("t_spans", ascending=False, na_position="last", kind="stable").index
        for place, i in zip(places, ranked, strict=True):
            order[place] = i
        first = ranked[0]
        later = [i for i in ranked[1:] if float(out.at[i, "pp"]) > float(out.at[first, "pp"])]
        out.loc[later, "behind"] = float(out.at[first, "rank"])
    return out.loc[order]


def _causes(run: Run, flagged: pd.DataFrame, sizes: dict[str, int], config: StragglerConfig,
            pool: pd.DataFrame | None = None) -> pd.DataFrame:
    """Flagged candidates with their cause and phase: from their excess own time, then their
    time outside their spans, their compute outside the TP calls (where a TP partner in
    ``pool``, every rank's candidate row, may take a row's place), the compute bar, and whether
    their device waited for its host."""
    attributed = _outside_spans(run, pd.concat([flagged, _attribute(flagged, sizes)], axis=1), sizes)
    return _launch_bound(run, _floor(_tp_stretched(run, attributed, config, pool, sizes), config))


def _candidates(run: Run, config: StragglerConfig) -> tuple[pd.DataFrame, dict[str, int]]:
    """The ``candidates`` statement's rows (after :func:`prepare` and :func:`score`) and the mesh's
    sizes on the axes a straggler's place is told on (``other``: 2, a group of two)."""
    con = run.con
    prepare(con)
    score(con, config)
    c = _sql.query_df(con, "stragglers", "candidates", min_frac=config.min_frac, min_steps=config.min_steps,
                      min_slowdown=config.min_slowdown, z_comb=config.z_comb, rel_floor=config.rel_floor, shadow=config.shadow,
                      own_shadow=config.own_shadow)
    row = _sql.first(_sql.execute(con, "stragglers", "axis_sizes")) or (1, 1, 1)
    return c, {"tp": max(int(row[0]), 1), "dp": max(int(row[1]), 1), "pp": max(int(row[2]), 1), "other": 2}


def _floor(frame: pd.DataFrame, config: StragglerConfig) -> pd.DataFrame:
    """Without the rows named for their compute whose median slowdown is under
    ``config.min_named_slowdown`` (taken on the cause the spans give, before
    :func:`_launch_bound` reads a launch-bound one as ``host``)."""
    return frame[(frame["cause"] != "compute")
                 | (frame["median_slowdown"].astype(float) >= config.min_named_slowdown)]


def told(run: Run) -> bool:
    """Whether stragglers can be told at all: some pipeline stage has two ranks or more. A rank is
    judged against the ranks of its stage, doing the same work; on a mesh of pipeline stages of
    one rank each (pp=2 on two GPUs) no rank has a peer, and "no straggler" would say nothing."""
    prepare(run.con)
    row = _sql.first(_sql.execute(run.con, "stragglers", "largest_stage"))
    return bool(row and int(row[0]) >= 2)


def lone_stages_own(run: Run) -> pd.DataFrame:
    """Where :func:`told` is False: every rank's own time against all ranks' median (rank, coords,
    own_ns, x), highest first: a slow stage reads high, and so does a heavier one (the stages of a
    pure pipeline do different work), so it is shown for a reader who knows the split, never named."""
    prepare(run.con)
    return _sql.query_df(run.con, "stragglers", "lone_stages_own")


def dismissed(run: Run, config: StragglerConfig | None = None) -> pd.DataFrame:
    """The ranks :func:`stragglers` would name for their host (or, on a data-parallel mesh timed on
    GPUs, their compute) but does not, because a replay of their steps without their delay saves
    under ``config.min_host_saving`` of the step (:data:`COMPUTE_SAVING_BAR` for compute; see
    :func:`_replay_savings`): rank, host, coords, cause, slowdown, last_arrival_frac,
    device_idle_frac, saving (the share of the step the replay saves), saving_lower_bound (the
    replay saw only some of a group's calls, so the saving may be more: :func:`replay_lower_bound`),
    z; strongest evidence first."""
    return detect(run, config)[1]


DISMISSED_COLUMNS = ["rank", "host", "coords", "cause", "slowdown", "last_arrival_frac", "device_idle_frac",
                     "saving", "saving_lower_bound", "z"]


def _empty(columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame({col: pd.Series(dtype="object") for col in columns})


def _dismissed_frame(run: Run, parts: list[pd.DataFrame]) -> pd.DataFrame:
    parts = [p for p in parts if not p.empty]
    if not parts:
        return _empty(DISMISSED_COLUMNS)
    out = pd.concat(parts)
    out["slowdown"] = out["median_slowdown"].astype(float)
    out["saving_lower_bound"] = replay_lower_bound(run)
    return out.sort_values("z", ascending=False)[DISMISSED_COLUMNS].reset_index(drop=True)


def replay_lower_bound(run: Run) -> bool:
    """Whether the replay's saving is only a lower bound: the collector timed some group's calls in
    some micro-batches only (by default, on GPUs, the TP calls of one micro-batch a step). The
    replay has no sync point at an untimed call; the wait behind it counts as the waiting rank's
    own work, so fixing the rank it waited for frees less than it would (a 1.15x straggler on a
    2x2x1 mesh of 4x H200, the steps 11.7% longer than healthy ones, replayed at 0.46%)."""
    row = _sql.first(_sql.execute(run.con, "whatif", "sampled_groups", calls_prefix=_sql.Raw(COLLECTOR_CALLS_METRIC)))
    return bool(row and row[0])


# What the report and the dashboard say under ranks dismissed on a lower-bound replay.
LOWER_BOUND_NOTE = ("At least: the collector timed some calls in one micro-batch a step, and the replay cannot free "
                    "the waits behind the others; a rank not named may still cost the job more. To settle it, time "
                    "every call for a few steps: the bundled trainer's --tp-comm-spans all and --dp-comm-spans all, "
                    "or torch.profiler and "
                    "'megascope ingest kineto', which sees every kernel.")


# At most this many ranks flagged for their host are replayed (a replay is Python over a few
# steps' calls); any further ones keep their name.
HOST_REPLAYS = 8


def _replay_saving(run: Run, rank: int, others: Sequence[int] = ()) -> float | None:
    """The share of its step a replay saves with ``rank`` at its peers' median pace, in the median
    step replayed (:func:`megascope.analysis.whatif.whatif`); None where it modeled nothing.

    With ``others`` (the other candidates), what ``rank`` adds to their fix: the replay with all of
    them at their peers' pace less the replay with ``others`` alone, step by step. Fixed alone, a
    slow rank saves nothing while a slower one still holds every step."""
    from megascope.analysis.whatif import whatif  # whatif reads stragglers: imported here

    others = sorted({int(r) for r in others} - {rank})
    result = whatif(run, ranks=[rank, *others], hosts=False)  # the replay's own savings, step by step
    savings = result.get("step_savings") or []
    if not result.get("modeled_baseline_ns") or not savings:
        return None
    if others:
        rest = whatif(run, ranks=others, hosts=False).get("step_savings") or []
        if len(rest) != len(savings):
            return None
        savings = [a - b for a, b in zip(savings, rest, strict=True)]
    # The median step's, not the total's: a few steps the replay models badly (a rank's own time
    # replaced by its peers' median can lengthen a step by 8-11% on a loaded CPU) do not decide.
    steps = [int(s) for s in result.get("steps_modeled") or []]
    period = sample_period(run, rank, steps) if len(steps) == len(savings) else 1
    if period <= 1:
        return float(np.median(savings))
    # Where the collector timed some calls in turn, a step replays only the waits behind the calls
    # it timed: a host pause before one gradient bucket of four shows in one step of four (2x H200,
    # dp2, a 100 ms pause that slowed the job 24%: 15-17% saved in those steps, 0-3% in the others,
    # 0.66% the median). The median step of each place in the rotation, then their mean.
    places: dict[int, list[float]] = {}
    for step, saving in zip(steps, savings, strict=True):
        places.setdefault(step % period, []).append(saving)
    return float(np.mean([np.median(v) for v in places.values()]))


# The longest rotation :func:`sample_period` reports (the trainer's is 4 DP buckets, or as many
# micro-batches as a step has for the TP calls).
MAX_SAMPLE_PERIOD = 16


def sample_period(run: Run, rank: int, steps: Sequence[int]) -> int:
    """Steps after which the collector's choice of timed calls repeats for ``rank`` (1: every call
    timed): the least common multiple of its sampled groups' periods (calls issued over calls timed,
    per step), read over ``steps``; at most :data:`MAX_SAMPLE_PERIOD`."""
    if not steps:
        return 1
    frame = _sql.query_df(run.con, "whatif", "sample_periods", rank=int(rank), steps=[int(s) for s in steps],
                          calls_prefix=_sql.Raw(COLLECTOR_CALLS_METRIC),
                          calls_prefix_len=len(COLLECTOR_CALLS_METRIC),
                          step_calls_prefix=_sql.Raw(COLLECTOR_STEP_CALLS_METRIC),
                          step_calls_prefix_len=len(COLLECTOR_STEP_CALLS_METRIC))
    period = 1
    for value in frame["period"].dropna():
        n = int(round(float(value)))
        if n > 1:
            period = math.lcm(period, n)
    return min(period, MAX_SAMPLE_PERIOD)


# The bar a rank flagged for its compute (replayed on a data-parallel mesh, timed on GPUs) must
# save, at most ``StragglerConfig.min_host_saving``. On 2x H200 dp2 runs the peers that read
# ``compute`` beside a pause the host's lead absorbed replayed at 0.02-0.03% (named wrongly before),
# planted slow GPUs at 3.1-6.0%, and paused ranks read ``compute`` at 0.05% (the job 2% slower) and
# 0.65% (5% slower, a lower bound: the DP calls timed one in four). Chosen having seen them all,
# with the median step's saving; read by the places of the rotation (_replay_saving), the same runs
# replay at 0.05%, 3.6-11.7%, 0.06% and 0.84%, and healthy runs' ranks at 0.05% or less.
COMPUTE_SAVING_BAR = 0.003


def _costless(frame: pd.DataFrame, saving: pd.Series, config: StragglerConfig) -> pd.Series:
    """Rows whose replay saves under their bar: ``config.min_host_saving``, or for a rank flagged for
    its compute the lower :data:`COMPUTE_SAVING_BAR`."""
    bar = np.where(frame["cause"] == "compute", min(COMPUTE_SAVING_BAR, config.min_host_saving),
                   config.min_host_saving)
    return pd.Series(saving.to_numpy(dtype=float) < bar, index=frame.index)


def _replay_savings(run: Run, frame: pd.DataFrame, config: StragglerConfig, sizes: dict[str, int],
                    fixed: Sequence[int] = ()) -> pd.Series:
    """Per row, the share of the step a replay without its delay saves, for rows named for their
    host (cause ``host``) and, on a data-parallel mesh (no TP, no pipeline), for device-timed rows
    named for their compute; NaN for the others. Under ``config.min_host_saving``: not named. The
    replay takes the other rows' ranks and ``fixed`` (earlier candidates) as fixed already.

    A rank named for its host is late with compute spans as long as its peers': the evidence is
    its arrival order and its own time (step time less its waits). A rank late at every call by a
    steady offset, its device busy all along, reads the same way: its asynchronous collectives
    carry the offset through the step, and each call counts it as its peers' wait, so its own time
    reads 1.2x theirs. On 2x H200 runs (data parallel, a device-bound model), every healthy run
    named such a rank (the same GPU each time), and so did runs whose planted host pause the
    host's lead over its device absorbed (step time unchanged); on 8-rank CPU runs, 2 of 80
    healthy runs named one. The replay tells them apart: it saved 0.1-0.46% of the step for each
    GPU one and -0.5% and 0.4% for the CPU ones, 3.1-10.7% for planted pauses of 100-200 ms that
    slowed GPU jobs 23-79%, and 0.89-10.2% for every planted pause of 50 ms or more on the CPU runs;
    the bar, 0.7%, lies between the two, chosen having seen them all (docs/benchmarks.md). Those
    figures are of a replay of three steps and its total; it now replays up to 16 and reads the
    median step's saving (whatif.replay_step_count), with which every sweep kept scored the same in
    the targets' rows but for a dp8 CPU run's 100 ms pause, dismissed before and named now. The
    replay starts each step where its ranks began it, so it undervalues a pause whose delay carries
    into its group's next step (a synthetic 40 ms pause just before the step's last collective
    replayed at 0): synthetic runs keep their name (their pauses are planted, no offset is drawn).
    On real CPU runs the pause before the gradient sync still replayed at 0.89% or more. Compute
    stragglers are not replayed: the replay undervalues a rank whose own spans hold its peers'
    waits (pipeline stages, tensor parallelism), and so it does a host straggler on a mesh whose
    TP calls the collector timed in one micro-batch a step (a 1.15x straggler read as ``host`` on
    2x2x1, 4x H200, replayed at 0.46%).

    On a mesh of data parallelism alone, no rank's spans hold a TP partner's or a pipeline
    neighbour's work, but a sharded model's gathers sit inside the forward on a stream of their own:
    a host pause the host's lead absorbed (step time unchanged) still delays a gather, and the peer
    that waits for it inside its forward reads as a compute straggler, its device busy and on time.
    2x H200, dp2, a device-bound model: such a peer (1.33x, z 10, step time that of healthy runs)
    replayed at 0.02%, while each of six planted slow GPUs (x1.2-x1.5) replayed at 3.1-6.0%; its
    bar is :data:`COMPUTE_SAVING_BAR`. Ranks timed by the host clock keep their name: there a pause
    is never absorbed."""
    replayed = frame["cause"] == "host"
    if sizes.get("tp", 1) <= 1 and sizes.get("pp", 1) <= 1 and "device_idle_frac" in frame:
        replayed |= (frame["cause"] == "compute") & frame["device_idle_frac"].notna()
    out = pd.Series(np.nan, index=frame.index)
    if not replayed.any() or config.min_host_saving <= 0 or run.meta.source == RunSource.SYNTH:
        return out
    order = frame[replayed].sort_values("z", ascending=False).index[:HOST_REPLAYS]
    candidates = {int(r) for r in frame["rank"]} | {int(r) for r in fixed}
    for idx in order:
        saving = _replay_saving(run, int(frame.at[idx, "rank"]), sorted(candidates))
        out.at[idx] = np.nan if saving is None else saving
    return out


def cpu_slowdown(run: Run) -> dict[int, float]:
    """Rank -> its host probe's median over the median rank's (1.0: a CPU as fast as its peers';
    1.9: its training thread ran the same loop 1.9 times as long). Empty where fewer than two
    ranks wrote :data:`HOST_PROBE_MIN` probes or more.

    A rank named for its host (its device waiting for its launches) on a CPU as fast as its
    peers' does more host work than they do (its code, its data loader), or its CPU slowed between
    the probes (a probe is ~0.3 ms every few steps: on a 4x H100 machine a rank named at 2.43x
    probed 1.04x); on a slower CPU, the machine is the cause: another tenant, a busy thread beside
    it, a CPU that runs slower."""
    probes = _sql.query_df(run.con, "stragglers", "host_probe", probe_metric=HOST_PROBE_METRIC)
    probes = probes[probes["probes"] >= HOST_PROBE_MIN]
    if len(probes) < 2:
        return {}
    middle = float(probes["loop_ns"].median())
    if not middle > 0:
        return {}
    return {int(r): float(v) / middle for r, v in zip(probes["rank"], probes["loop_ns"], strict=True)}


def _launch_bound(run: Run, out: pd.DataFrame) -> pd.DataFrame:
    """``device_idle_frac`` of each ``compute`` or ``host`` straggler timed on a device (NaN for the
    others), and cause ``host`` for a compute one whose device was idle, waiting for its host, at
    ``LAUNCH_BOUND_FRAC`` of its communication calls or more.

    Its compute spans are long, but on a device that ran dry: each kernel began as soon as its host
    launched it, so a span lasted as long as the host took to issue its work. Its host is slower
    (Python, a busy core, a data loader on the same core), not its GPU; a slow GPU keeps its device
    busy and its host ahead. On 4x H100 runs of a small host-bound model, every rank named for its
    compute had its device idle at 68-100% of its calls, and the ranks whose GPU was planted slow
    at 0-18% (docs/benchmarks.md). Host-timed ranks (CPU) and synthetic runs have no such
    measure and keep their cause.
    """
    out = out.copy()
    out["device_idle_frac"] = np.nan
    compute = out["cause"] == "compute"
    timed = out["cause"].isin(["compute", "host"])
    if not timed.any() or run.meta.source == RunSource.SYNTH:
        return out
    steps = [int(s) for (s,) in _sql.execute(run.con, "pipeline", "sample_steps").fetchall()]
    # Not the run's first step where there are others: every device waits for its host there
    # (allocations, the communicator's connections; 2x H200 dp2: 22-46% of a rank's calls in
    # step 0, none in the 15 after it).
    steps = steps[1:] if len(steps) >= 4 else steps
    # A long run's share from steps spread over it: the read grows with the ranks times the steps.
    steps = sample_steps(steps, LEAD_STEPS)
    candidates = sorted({int(r) for r in out.loc[timed, "rank"]})
    stage = _stages(run)
    # Peers' shares only for the compute rows: only they may read ``host`` by them.
    peers = {int(r): _stage_peers(stage, int(r), LEAD_PEERS) for r in out.loc[compute, "rank"]}
    lead = host_lead(run, steps=steps, ranks=sorted(set(candidates).union(*peers.values())))
    if lead.empty:
        return out
    lead = lead[lead["calls"] >= HOST_BOUND_MIN_CALLS]
    idle = dict(zip(lead["rank"].astype(int), lead["starved_frac"].astype(float), strict=True))
    out["device_idle_frac"] = [idle.get(int(r), np.nan) for r in out["rank"]]

    def peers_idle(rank: int) -> float:
        seen = [idle[p] for p in peers.get(rank, []) if p in idle]
        return float(np.median(seen)) if seen else np.nan

    alone = out["device_idle_frac"] >= STARVED_OVER_PEERS * (out["rank"].map(lambda r: peers_idle(int(r))) + 0.01)
    bound = compute & ((out["device_idle_frac"] >= LAUNCH_BOUND_FRAC)
                       | ((out["device_idle_frac"] >= HOST_BOUND_FRAC) & alone))
    # Read ``compute`` on its compute less the waits inside it alone (_outside_spans), on a device
    # clock, its spans no longer than its peers' beyond their noise: its device did its work at their
    # pace and never ran dry; the excess is its peers' waiting for it inside their spans, for calls
    # it issued late. Its host paused and the host's lead over its device absorbed the pause (2x
    # H200, dp2: a 55 ms pause, t_spans 1.5, the job ~1% slower; a slow GPU x1.15, t_spans 50).
    if "excl_only" in out:
        bound |= (compute & (out["excl_only"].fillna(0.0) > 0) & out["device_idle_frac"].notna()
                  & (out["t_spans"].astype(float).fillna(0.0) < CLEAR_T))
    out.loc[bound, "cause"] = "host"
    out.loc[bound, "phase"] = "host"
    return out
