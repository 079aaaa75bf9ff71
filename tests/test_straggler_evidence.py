"""Straggler detection on noisy runs: evidence, confidence, cause, and no straggler in a hung run.

The hand-built runs here are what eight ranks sharing few CPU cores look like: every rank's compute
varies by ~15% from step to step (seeded log-normal noise), one collective per step ends when its
last member arrives. A straggler's compute spans stretch; a skewed rank pauses outside every span.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import math
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from click.testing import Result
from conftest import Synth
from hand_runs import MS, hand_run, overlapped_run, span

from megascope import analysis
from megascope.analysis.stragglers import StragglerConfig, p_value
from megascope.errors import ConfigError
from megascope.inject import parse_inject, parse_injects
from megascope.store import open_run

RANKS = 8


def noisy_run(path: Path, *, seed: int, slow: int | None = None, factor: float = 1.0, paused: int | None = None,
              pause_ms: float = 0.0, stretch_ms: float = 0.0, steps: int = 16, noise: float = 0.15,
              idle: int | None = None, on_gpus: bool = False) -> Path:
    """``RANKS`` ranks of one stage; per step a forward span, then (after an optional pause outside
    every span) a data-parallel all-reduce that completes 1 ms after the last arrival. The paused
    rank's forward span is ``stretch_ms`` longer (what a pause leaves behind on a CPU). ``on_gpus``:
    the ranks are timed on CUDA devices and each call's ``enqueued`` marker is written 10 ms before
    its device reaches it (a host ahead of its device), 0.1 ms before on rank ``idle`` (a device
    that had run dry, waiting for its host)."""
    rng = np.random.default_rng(seed)
    spans, markers = [], []
    t0 = 0
    for step in range(steps):
        compute = 50 * MS * np.exp(rng.normal(0.0, noise, RANKS))
        if slow is not None:
            compute[slow] *= factor
        pause = np.zeros(RANKS)
        if paused is not None:
            pause[paused] = pause_ms * MS
            compute[paused] += stretch_ms * MS
        arrival = t0 + compute + pause
        end = int(arrival.max()) + MS
        for r in range(RANKS):
            spans.append(span(r, step, "step", t0, end + MS - t0))
            spans.append(span(r, step, "forward", t0, int(compute[r])))
            spans.append(span(r, step, "collective", int(arrival[r]), end - int(arrival[r]), group="dp:0", seq=step))
            if on_gpus:
                lead = MS // 10 if r == idle else 10 * MS
                markers.append({"rank": r, "group": "dp:0", "seq": step, "op": "all_reduce", "state": "enqueued",
                                "time_ns": int(arrival[r]) - lead, "step": step, "bytes": None, "peer": None})
        t0 = end + 2 * MS
    return hand_run(path, spans, markers, world=RANKS, hosts=tuple(f"h{r // 4}" for r in range(RANKS)),
                    devices=tuple(f"cuda:{r % 4}" for r in range(RANKS)) if on_gpus else None,
                    source="collector" if on_gpus else "synth")


@pytest.mark.parametrize("seed", [1, 2])
def test_a_mild_straggler_in_noisy_steps_is_named_with_its_evidence(tmp_path: Path, seed: int) -> None:
    planted = [5, 2][seed - 1]
    run = open_run(noisy_run(tmp_path / "run", seed=seed, slow=planted, factor=1.2))
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [planted]
    row = found.iloc[0]
    assert row["cause"] == "compute"
    # Its slowdown over all steps, not the median of its slowest ones.
    assert 1.1 < row["slowdown"] < 1.35
    assert row["z"] >= StragglerConfig().z_comb and row["t_own"] > 1
    assert 0.99 < row["confidence"] <= 1.0 and row["p_value"] == pytest.approx(1 - row["confidence"])


def test_a_rank_whose_device_waited_for_its_host_is_slow_for_its_host(tmp_path: Path) -> None:
    """The same stretched compute spans read ``compute`` on a device kept busy (a slow GPU) and
    ``host`` on a device that was idle at every call (its host issued the work slower)."""
    busy = analysis.stragglers(open_run(noisy_run(tmp_path / "busy", seed=4, slow=3, factor=1.3, steps=24,
                                                  on_gpus=True)))
    assert list(busy["rank"]) == [3] and busy.iloc[0]["cause"] == "compute"
    assert busy.iloc[0]["device_idle_frac"] == 0.0
    starved = analysis.stragglers(open_run(noisy_run(tmp_path / "starved", seed=4, slow=3, factor=1.3, steps=24,
                                                     on_gpus=True, idle=3)))
    assert list(starved["rank"]) == [3]
    assert starved.iloc[0]["cause"] == "host" and starved.iloc[0]["phase"] == "host"
    assert starved.iloc[0]["device_idle_frac"] == 1.0
    # Host-timed ranks (CPU) have no such measure and keep their cause.
    cpu = analysis.stragglers(open_run(noisy_run(tmp_path / "cpu", seed=4, slow=3, factor=1.3, steps=24)))
    assert cpu.iloc[0]["cause"] == "compute" and np.isnan(cpu.iloc[0]["device_idle_frac"])


def test_a_rank_late_by_a_steady_offset_at_overlapping_calls_is_not_named(tmp_path: Path, cli: Any) -> None:
    """On GPUs, late by 0.3 ms at each of 30 overlapping calls a step, compute as long as its peers':
    each call counts the offset as its peers' wait, so its own time reads 1.2x theirs and the
    evidence flags it for its host. A replay of its steps at its peers' pace saves under 0.7% of the
    step: it is not named, and the report lists it as dismissed with that saving. A 5 ms pause in
    the same job is named. Timed by the host clock (CPU), the same."""
    run = open_run(overlapped_run(tmp_path / "offset", seed=3, late=2))
    loose = analysis.stragglers(run, StragglerConfig(min_host_saving=0))
    assert list(loose["rank"]) == [2] and loose.iloc[0]["cause"] == "host" and loose.iloc[0]["slowdown"] > 1.15
    assert analysis.stragglers(run).empty
    gone = analysis.stragglers_dismissed(run)
    assert list(gone["rank"]) == [2] and 0 <= gone.iloc[0]["saving"] < 0.007
    result = analysis.report(run, with_whatif=False)
    assert result["stragglers"] == [] and [d["rank"] for d in result["stragglers_dismissed"]] == [2]
    assert result["stragglers_dismissed"][0]["cause"] == "host"
    text = cli("report", str(tmp_path / "offset"))
    assert text.exit_code == 0 and "STRAGGLERS none" in text.output and "not named: rank 2" in text.output
    paused = open_run(overlapped_run(tmp_path / "paused", seed=3, paused=2, pause_ms=5.0))
    found = analysis.stragglers(paused)
    assert list(found["rank"]) == [2] and found.iloc[0]["cause"] == "host"
    assert analysis.stragglers_dismissed(paused).empty
    with pytest.raises(ConfigError, match="min_host_saving"):
        StragglerConfig(min_host_saving=1.0)
    # Where the collector left some of the group's calls untimed, the replay's saving is a lower
    # bound, and the report says so.
    sampled = open_run(overlapped_run(tmp_path / "sampled", seed=3, late=2, untimed=2))
    assert analysis.stragglers(sampled).empty
    unsure = analysis.report(sampled, with_whatif=False)["stragglers_dismissed"]
    assert [(d["rank"], d["saving_lower_bound"]) for d in unsure] == [(2, True)]
    assert result["stragglers_dismissed"][0]["saving_lower_bound"] is False
    text = cli("report", str(tmp_path / "sampled"))
    assert "saves at least 0." in text.output and "a rank not named may still cost the job more" in text.output
    assert "at least" not in cli("report", str(tmp_path / "offset")).output
    # Timed by the host clock (CPU), the same: the replay, not the clock, decides.
    cpu = open_run(overlapped_run(tmp_path / "cpu", seed=3, late=2, on_gpus=False))
    assert analysis.stragglers(cpu).empty and list(analysis.stragglers_dismissed(cpu)["rank"]) == [2]
    cpu_paused = open_run(overlapped_run(tmp_path / "cpu-paused", seed=3, paused=2, pause_ms=5.0, on_gpus=False))
    assert list(analysis.stragglers(cpu_paused)["rank"]) == [2] and analysis.stragglers_dismissed(cpu_paused).empty


def test_a_dismissed_rank_no_longer_shades_a_real_straggler(tmp_path: Path) -> None:
    """A 30 ms host pause (rank 2) carries more evidence than a 1.5x compute straggler (rank 5) and
    shades it; with the pause dismissed (here by asking for a 15% saving, more than its replay's)
    the shadow rule is taken again and rank 5 is named. On this data-parallel mesh timed on devices
    rank 5 is replayed too, with rank 2 taken as fixed: alone, it would save nothing while the
    pause still held every step."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    run = open_run(noisy_run(tmp_path / "run", seed=7, slow=5, factor=1.5, paused=2, pause_ms=30.0, steps=24,
                             on_gpus=True))
    assert list(analysis.stragglers(run)["rank"]) == [2]
    assert straggler_module._replay_saving(run, 2) < 0.15 < straggler_module._replay_saving(run, 5, [2])
    assert straggler_module._replay_saving(run, 5) < 0.01
    strict = StragglerConfig(min_host_saving=0.15)
    found = analysis.stragglers(run, strict)
    assert list(found["rank"]) == [5] and found.iloc[0]["cause"] == "compute"
    assert list(analysis.stragglers_dismissed(run, strict)["rank"]) == [2]


def test_on_a_real_host_bound_gpu_run_the_rank_with_the_slow_host_is_named_for_it(tmp_path: Path) -> None:
    """tests/data/gpu-host-bound: the bundled trainer's default tiny model on 4x H100 (tp1 pp1 dp4,
    16 steps, NCCL), rank 3's GPU planted 1.6x slow (its stream sleeps 0.6x each phase's device
    time). The devices idled most of the time, so the planted sleeps fell into idle gaps, while
    rank 2's host issued its work slower: its spans were 5x its peers' in every step, its device
    idle at every call, its peers waiting for it in every all-reduce. Rank 2 is named, for its host."""
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "gpu-host-bound", tmp_path / "run"))
    own = run.con.execute("""
        SELECT rank, median(ns) FROM (SELECT step, rank, sum(dur_ns) AS ns FROM spans
            WHERE step >= 3 AND name IN ('forward', 'backward') AND kind IN ('forward', 'backward') GROUP BY 1, 2)
        GROUP BY 1 ORDER BY 1""").fetchall()
    peers = float(np.median([ns for _, ns in own]))
    ratio = {int(r): ns / peers for r, ns in own}
    assert 1.2 < ratio[3] < 1.8 and ratio[2] > 3          # the planted GPU shows; rank 2's host shows more
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [2]
    assert found.iloc[0]["cause"] == "host" and found.iloc[0]["device_idle_frac"] > 0.9


def test_a_compute_straggler_needs_ten_percent_where_a_host_pause_needs_five(tmp_path: Path) -> None:
    """Quiet steps (2% noise): a rank whose compute is 7% longer is not named, one 12% longer is
    (cause compute), and a rank that pauses outside its spans for 7% of its own time is (cause
    host); with ``min_named_slowdown=1.05`` the 7% compute rank is named too."""
    small = open_run(noisy_run(tmp_path / "small", seed=5, slow=2, factor=1.07, noise=0.02, steps=24))
    assert analysis.stragglers(small).empty
    loose = analysis.stragglers(small, StragglerConfig(min_named_slowdown=1.05))
    assert list(loose["rank"]) == [2] and loose.iloc[0]["cause"] == "compute"
    big = analysis.stragglers(open_run(noisy_run(tmp_path / "big", seed=5, slow=2, factor=1.12, noise=0.02, steps=24)))
    assert list(big["rank"]) == [2] and big.iloc[0]["cause"] == "compute" and big.iloc[0]["slowdown"] >= 1.10
    paused = analysis.stragglers(open_run(noisy_run(tmp_path / "paused", seed=5, paused=2, pause_ms=3.5, noise=0.02,
                                                    steps=24)))
    assert list(paused["rank"]) == [2] and paused.iloc[0]["cause"] == "host" and paused.iloc[0]["slowdown"] < 1.10
    with pytest.raises(ConfigError, match="min_named_slowdown"):
        StragglerConfig(min_named_slowdown=0.9)


def test_report_json_carries_confidence_and_evidence(tmp_path: Path) -> None:
    run = open_run(noisy_run(tmp_path / "run", seed=3, slow=6, factor=1.3))
    result = analysis.report(run, with_whatif=False)
    first = result["stragglers"][0]
    assert first["rank"] == 6
    assert set(first["evidence"]) == {"z", "own_time_t", "wait_caused_t", "last_arrival_z", "compute_span_share",
                                      "compute_span_t", "pause_share", "device_idle_frac", "cpu_slowdown",
                                      "tp_compute_ratio", "dp_compute_ratio", "outside_calls_ratio", "slow_groups",
                                      "behind_rank"}
    assert first["evidence"]["slow_groups"] is None  # named for its own time, not for its groups' transfers
    assert first["evidence"]["behind_rank"] is None  # no other stage of its replica named before it
    pause = first["evidence"]["pause_share"]
    assert pause is None or np.isnan(pause)  # a clear share of its excess is in its spans: not checked
    assert first["evidence"]["last_arrival_z"] > 0 and first["evidence"]["wait_caused_t"] > 0
    cpu = first["evidence"]["cpu_slowdown"]
    assert cpu is None or np.isnan(cpu)  # this run's ranks wrote no host probes
    assert 0.0 <= first["p_value"] < 0.01 and first["confidence"] == pytest.approx(1 - first["p_value"])


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_a_pause_outside_every_span_is_a_host_cause(tmp_path: Path, seed: int) -> None:
    run = open_run(noisy_run(tmp_path / "run", seed=seed, paused=3, pause_ms=12.0, noise=0.08))
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [3]
    assert found.iloc[0]["cause"] == "host"
    # Its compute spans are no longer than its peers' beyond their noise.
    from megascope.analysis.stragglers import CLEAR_SHARE, COMPUTE_T
    row = found.iloc[0]
    assert row["t_spans"] < COMPUTE_T and (row["spans_share"] < CLEAR_SHARE or row["t_spans"] < 2.0)


@pytest.mark.parametrize("seed", [4, 5])
def test_a_pause_that_leaves_the_spans_after_it_longer_is_still_a_host_cause(tmp_path: Path, seed: int) -> None:
    """A 40 ms pause that stretches the paused rank's spans by 6 ms, beyond their noise (as sleeping
    ranks of real DDP jobs on shared CPU cores came back): 13% of its excess is in its spans, the
    rest outside all of them, so the cause is ``host``; a rank 6 ms slow in its compute alone, with
    nothing outside its spans, stays ``compute``."""
    from megascope.analysis.stragglers import CLEAR_SHARE, COMPUTE_SHARE, COMPUTE_T, PAUSE_SHARE
    run = open_run(noisy_run(tmp_path / "run", seed=seed, paused=3, pause_ms=40.0, stretch_ms=6.0, noise=0.02))
    row = analysis.stragglers(run).iloc[0]
    assert row["rank"] == 3
    # The spans alone would say compute: a small share of the excess, beyond doubt.
    assert COMPUTE_SHARE <= row["spans_share"] < CLEAR_SHARE and row["t_spans"] >= COMPUTE_T
    assert row["cause"] == "host" and row["phase"] == "host"
    assert row["pause_share"] >= PAUSE_SHARE and row["pause_share"] == pytest.approx(40 / 46, abs=0.1)
    slow = open_run(noisy_run(tmp_path / "slow", seed=seed, slow=3, factor=1.12, noise=0.02))
    row = analysis.stragglers(slow).iloc[0]
    assert row["rank"] == 3 and row["cause"] == "compute"


def sharded_run(path: Path, *, seed: int, slow: int | None = None, factor: float = 1.0, paused: int | None = None,
                pause_ms: float = 0.0, steps: int = 16, noise: float = 0.05) -> Path:
    """``RANKS`` ranks sharding one model, as FSDP does on gloo: per step a forward span holding
    three layers, each a blocking all-gather (ending 0.5 ms after its last member arrives) then
    15 ms of compute, and a backward span holding 5 ms of compute then a reduce-scatter that ends
    1 ms after the last arrival.
    The slow rank's layers compute ``factor`` times longer; the paused rank starts its forward
    ``pause_ms`` late, outside every span."""
    rng = np.random.default_rng(seed)
    spans = []
    t0, seq = 0, 0
    for step in range(steps):
        start = np.full(RANKS, float(t0))
        if paused is not None:
            start[paused] += pause_ms * MS
        t = start.copy()
        for _ in range(3):
            end = int(t.max()) + MS // 2
            for r in range(RANKS):
                spans.append(span(r, step, "collective", int(t[r]), end - int(t[r]), group="dp:0", seq=seq,
                                  name="all_gather"))
            seq += 1
            layer = 15 * MS * np.exp(rng.normal(0.0, noise, RANKS))
            if slow is not None:
                layer[slow] *= factor
            t = end + layer
        back = t + 5 * MS
        end = int(back.max()) + MS
        for r in range(RANKS):
            spans.append(span(r, step, "forward", int(start[r]), int(t[r] - start[r])))
            spans.append(span(r, step, "backward", int(t[r]), end - int(t[r])))
            spans.append(span(r, step, "collective", int(back[r]), end - int(back[r]), group="dp:0", seq=seq,
                              name="reduce_scatter"))
            spans.append(span(r, step, "step", t0, end + MS - t0))
        seq += 1
        t0 = end + 2 * MS
    return hand_run(path, spans, [], world=RANKS, hosts=tuple(f"h{r // 4}" for r in range(RANKS)))


@pytest.mark.parametrize("seed", [1, 2])
def test_a_slow_rank_whose_peers_wait_inside_their_spans_is_slow_in_its_compute(
        tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sharded layers (FSDP on gloo): the peers' forward spans hold their waits for the slow rank
    at its all-gathers, so its spans stretch no more than theirs; less those waits, they hold its
    whole excess, and nothing is outside them: cause ``compute``. Read on the spans alone, ``host``.
    A rank that starts its forward late in the same job stays ``host``."""
    module = importlib.import_module("megascope.analysis.stragglers")
    run = open_run(sharded_run(tmp_path / "slow", seed=seed, slow=5, factor=1.3))
    row = analysis.stragglers(run).iloc[0]
    assert row["rank"] == 5 and row["cause"] == "compute" and row["phase"] == "compute"
    assert row["spans_share"] < module.CLEAR_SHARE and abs(row["pause_share"]) < 0.05
    paused = analysis.stragglers(open_run(sharded_run(tmp_path / "paused", seed=seed, paused=2, pause_ms=12.0)))
    assert list(paused["rank"]) == [2] and paused.iloc[0]["cause"] == "host"
    monkeypatch.setattr(module, "EXCL_SHARE", float("inf"))
    assert analysis.stragglers(open_run(sharded_run(tmp_path / "again", seed=seed, slow=5, factor=1.3))).iloc[0][
        "cause"] == "host"


def test_time_outside_the_spans_is_the_step_less_the_union_of_its_spans(tmp_path: Path) -> None:
    """Overlapping spans count once; a step span bounds the step, or else the spans' own extent;
    host and data spans are not the rank's compute or communication, so they leave time outside."""
    from megascope.analysis import _sql

    spans = [span(0, 0, "step", 0, 100 * MS), span(0, 0, "forward", 10 * MS, 20 * MS),
             span(0, 0, "collective", 25 * MS, 15 * MS, group="dp:0", seq=0), span(0, 0, "backward", 60 * MS, 20 * MS),
             span(0, 0, "host", 85 * MS, 10 * MS),
             span(1, 0, "forward", 0, 10 * MS), span(1, 0, "collective", 20 * MS, 10 * MS, group="dp:0", seq=0),
             span(1, 0, "data", 10 * MS, 5 * MS)]
    run = open_run(hand_run(tmp_path / "run", spans, [], world=2, hosts=("h0", "h0")))
    rows = _sql.execute(run.con, "stragglers", "outside", ranks=[0, 1],
                        spans=_sql.Raw(run.rank_source("spans", [0, 1]))).fetchall()
    assert rows == [(0, 0, 50 * MS), (1, 0, 10 * MS)]


@pytest.mark.parametrize("seed", range(10, 16))
def test_noisy_healthy_runs_name_nobody(tmp_path: Path, seed: int) -> None:
    run = open_run(noisy_run(tmp_path / "run", seed=seed))
    assert analysis.stragglers(run).empty


def test_the_fault_does_not_raise_its_own_bar(tmp_path: Path) -> None:
    """Noise is read from the ranks' step-to-step spread, not from the spread between ranks, which a
    gross straggler widens: x1.6 in steps noisier than its slowdown is still named, and alone."""
    run = open_run(noisy_run(tmp_path / "run", seed=7, slow=0, factor=1.6, noise=0.3))
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [0]


def test_p_value_is_bonferroni_over_ranks() -> None:
    assert p_value(0.0, 1) == pytest.approx(0.5)
    assert p_value(3.0, 8) == pytest.approx(8 * 0.0013498980316301, rel=1e-6)
    assert p_value(-5.0, 8) == 1.0


def test_config_refuses_meaningless_thresholds() -> None:
    with pytest.raises(ConfigError, match="shadow"):
        StragglerConfig(shadow=0.0)
    with pytest.raises(ConfigError, match="z_comb"):
        StragglerConfig(z_comb=-1.0)


def _named_from_scores(evidence: dict[int, tuple[float, float, float, float, float]], *, tp: int) -> list[int]:
    """The ``candidates`` rule alone, on per-rank evidence (t_own, t_blame, last_z, t_spans, median
    slowdown) as real 8-rank CPU runs gave it: one stage, ``tp`` ranks per TP group."""
    import duckdb
    import pandas as pd

    from megascope.analysis import _sql

    steps, sigma = 16, 0.06
    unit = 1.25 * sigma / np.sqrt(steps)  # what t_own and t_blame are measured in
    rows = []
    for rank in range(RANKS):
        t_own, t_blame, last_z, t_spans, slowdown = evidence.get(rank, (0.0, 0.0, 0.0, 0.0, 1.0))
        rows.append({"rank": rank, "stage": 0, "steps": steps, "sigma": sigma, "bsigma": sigma, "m_own": t_own * unit,
                     "m_blame": t_blame * unit, "t_spans": t_spans, "last_z": last_z, "median_slowdown": slowdown,
                     "median_ex_spans_ns": 0.0, "blame_ns": 0.0, "slow_steps": 0, "strict_steps": 0,
                     "comm_slow_steps": 0, "slowdown": slowdown, "xfer_slowdown": None, "base_own_ns": 1e8,
                     "median_ex_recv_ns": 0.0, "median_ex_own_ns": 1e6, "last_arrival_frac": 0.2, "max_z": 1.0})
    con = duckdb.connect()
    con.execute("ATTACH ':memory:' AS ms_cache")
    scores = pd.DataFrame(rows)
    places = pd.DataFrame({"rank": range(RANKS), "host": "h0", "pp": 0,
                           "dp": [r // tp for r in range(RANKS)], "tp": [r % tp for r in range(RANKS)]})
    con.register("scores", scores)
    con.register("places", places)
    con.execute("CREATE TABLE ms_cache.rank_scores AS SELECT * FROM scores")
    con.execute("CREATE VIEW ranks AS SELECT rank, host, MAP {'pp': pp, 'dp': dp, 'tp': tp} AS coords FROM places")
    _sql.execute(con, "base", "rank_info")
    cfg = StragglerConfig()
    c = _sql.query_df(con, "stragglers", "candidates", min_frac=cfg.min_frac, min_steps=cfg.min_steps,
                      min_slowdown=cfg.min_slowdown, z_comb=cfg.z_comb, rel_floor=cfg.rel_floor, shadow=cfg.shadow,
                      own_shadow=cfg.own_shadow)
    return sorted(int(r) for r in c.loc[c["straggler"], "rank"])


def test_a_skewed_rank_whose_spans_read_short_is_still_named() -> None:
    # A real 50 ms skew on a tp2 x dp4 CPU run: rank 6 late at the collectives (own time and the
    # wait it caused clear), its compute spans shorter than its peers' (t_spans -3.1: its TP peer's
    # spans held the wait, and it computed faster while the others waited), last less than chance.
    assert _named_from_scores({6: (5.59, 23.28, -2.06, -3.10, 1.14)}, tp=2) == [6]


def test_a_straggler_s_tp_partner_is_not_named_beside_it() -> None:
    # A real 1.6x straggler (rank 0) on a tp4 x dp2 CPU run and its TP partner rank 3: the
    # partner's spans hold the waits and its group is late at the DP collectives, but its own
    # time barely moves (t_own 3.5 against 31.8).
    named = _named_from_scores({0: (31.81, 53.47, 4.24, 29.22, 1.79), 3: (3.47, 10.74, 1.91, 22.19, 1.07)}, tp=4)
    assert named == [0]


def test_a_paused_rank_is_named_where_it_and_its_tp_partner_shade_each_other() -> None:
    # A real 100 ms pause on rank 4 of a tp4 x dp2 CPU run: its own time and the wait it caused
    # are clear (t_own 14.3, t_blame 16.2), its spans short (t_spans -3.2); its TP partner rank 6,
    # whose spans held the wait, has the larger z (t_spans 8.1) but a third of its own time. Each
    # fell short of the other's bar (z under 3/4 of 6's, t_own under half of 4's), and nothing was
    # named; the one with the most own time is.
    evidence = {4: (14.32, 16.22, -0.15, -3.22, 1.22), 5: (2.72, 3.38, 1.45, 8.79, 1.04),
                6: (5.08, 4.50, 0.87, 8.11, 1.07), 7: (0.93, 2.52, -0.75, 8.12, 1.01)}
    assert _named_from_scores(evidence, tp=4) == [4]
    # Where the rank with the largest z passes both bars, the rule is as before: that one alone.
    assert _named_from_scores({4: (14.32, 16.22, 3.0, 6.0, 1.22), 6: (5.08, 4.50, 0.87, 8.11, 1.07)}, tp=4) == [4]


def test_a_hung_run_names_no_straggler(tmp_path: Path, synth: Synth) -> None:
    run = open_run(synth(tmp_path / "run", "straggler:rank=5,factor=1.5", "hang:rank=9,step=5",
                         ranks=16, steps=8, tp=2, pp=2, seed=3, gpus_per_host=4))
    assert not analysis.stragglers(run).empty  # the steps before the hang do show it
    result = analysis.report(run, with_whatif=False)
    assert result["hang"]["hung"] is True and result["hang"]["suspects"][0]["rank"] == 9
    assert result["stragglers"] == []


def test_straggler_mode_is_part_of_the_shared_grammar() -> None:
    fault = parse_inject("straggler:rank=3,factor=1.3,mode=flops")
    assert fault.mode == "flops" and fault.spec() == "straggler:rank=3,factor=1.3,mode=flops"
    faults = parse_injects(["straggler:rank=3,factor=1.3", "straggler:rank=4,factor=1.2,mode=flops"])
    assert faults.straggler_mode(3) == "time" and faults.straggler_mode(4) == "flops"
    assert parse_inject("straggler:rank=3,factor=1.3").spec() == "straggler:rank=3,factor=1.3"
    with pytest.raises(ConfigError, match="mode must be one of time, flops"):
        parse_inject("straggler:rank=3,factor=1.3,mode=sleep")
    with pytest.raises(ConfigError, match="missing factor"):
        parse_inject("straggler:rank=3,mode=time")


def _sweep_module() -> Any:
    spec = importlib.util.spec_from_file_location("detect_sweep", Path(__file__).parents[1] / "bench" / "detect_sweep.py")
    assert spec and spec.loader
    sweep = importlib.util.module_from_spec(spec)
    sys.modules["detect_sweep"] = sweep
    spec.loader.exec_module(sweep)
    return sweep


def test_detect_sweep_plan_covers_the_fault_space() -> None:
    sweep = _sweep_module()
    runs = sweep.plan(sweep.CPU_MESHES, 22, gpu=False)
    assert len(runs) >= 60
    assert {r["mesh"] for r in runs} == set(sweep.CPU_MESHES) and all(tp * pp * dp == 8 for tp, pp, dp in sweep.CPU_MESHES)
    kinds = [r["kind"] for r in runs]
    assert kinds.count("healthy") >= 20 and kinds.count("hang") == 4
    assert kinds.count("crash") == kinds.count("kill") == 4  # a rank that raises, one killed, per mesh
    for r in runs:
        if r["inject"]:
            fault = parse_inject(r["inject"])
            assert fault.rank == r["rank"] and 0 <= fault.rank < 8 and fault.kind == r["kind"]
            assert fault.factor is None or 1.1 <= fault.factor <= 1.6
            assert fault.ms is None or 20 <= fault.ms <= 100
            assert fault.kind not in ("crash", "kill") or 6 <= (fault.step or 0) < 12
    # Another seed meets other ranks.
    assert [r["rank"] for r in runs] != [r["rank"] for r in sweep.plan(sweep.CPU_MESHES, 23, gpu=False)]
    gpu = sweep.plan(sweep.GPU_MESHES, 22, gpu=True)
    assert all("mode=time" in r["inject"] for r in gpu if r["kind"] == "straggler")
    # On GPUs the failures and then the hangs (a minute or more each) come last: a sweep cut short
    # by its budget loses them first.
    kinds = [r["kind"] for r in gpu]
    assert kinds.index("hang") == len(kinds) - kinds.count("hang") == 60
    assert set(kinds[52:60]) == {"crash", "kill"}
    assert set(kinds[:26]) == {"straggler", "skew", "healthy"}  # and the rest shuffled together


def test_pipeline_sweep_plans_every_fault_on_meshes_with_peers_and_refuses_ones_without() -> None:
    """bench/pipeline_sweep.py: each fault and amount ``each`` times and the healthy runs, on the
    meshes asked for, the planted rank inside the world; a mesh without DP peers is refused."""
    import argparse

    spec = importlib.util.spec_from_file_location("pipeline_sweep", Path(__file__).parents[1] / "bench" / "pipeline_sweep.py")
    assert spec and spec.loader
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    cases = sweep.plan(3, [(2, 2), (3, 2)], [1.5, 2.0], [40.0], 4, 2)
    assert len(cases) == 2 * 2 + 2 + 4
    assert sorted((c["fault"], c["amount"]) for c in cases).count(("slow", 1.5)) == 2
    for c in cases:
        assert (c["pp"], c["dp"]) in {(2, 2), (3, 2)} and c["world"] == c["pp"] * c["dp"]
        assert (c["planted"] == -1) == (c["fault"] == "healthy") and c["planted"] < c["world"]
    assert sweep.mesh("3x2") == (3, 2)
    with pytest.raises(argparse.ArgumentTypeError):
        sweep.mesh("2x1")


def test_the_other_tools_are_scored_like_megascope_on_the_same_runs() -> None:
    sweep = _sweep_module()
    slow = {"kind": "straggler", "rank": 2, "inject": "straggler:rank=2,factor=1.15,mode=time"}
    healthy = {"kind": "healthy", "rank": None, "inject": None}
    report = {"named": {"gpu_relative": [], "section_relative": {"step": [3]}},
              "gpu_relative": {"0": 1.0, "1": 0.98, "2": 0.99, "3": float("nan")},
              "section_relative": {"step": {"0": 1.0, "3": 0.7}}}
    nvrx = sweep.nvrx_score(slow, report)
    assert (nvrx["nvrx"], nvrx["nvrx_right"], nvrx["nvrx_gpu_lowest"], nvrx["nvrx_step_lowest"]) == ([3], False, 1, 3)
    assert sweep.nvrx_score(healthy, report | {"named": {"gpu_relative": [], "section_relative": {}}})["nvrx_right"]
    rows = [
        slow | {"first_right": False, "kineto": [2, 3], "kineto_right": True, "hta": "error: argmax",
                "hta_renamed": [1], "nvrx": [], "nvrx_right": False, "nvrx_gpu_lowest": 2},
        healthy | {"first_right": True, "kineto": [0], "kineto_right": False, "hta": "error: argmax",
                   "hta_renamed": [1], "nvrx": [], "nvrx_right": True, "nvrx_gpu_lowest": 2},
        healthy | {"first_right": True},  # a run the other tools did not reach
    ]
    lines = sweep.peers_table(rows).splitlines()
    assert lines[2] == "| straggler x1.15 | 1 | 0/1 | 1/1 | error (1) | 0/1 | 0/1 | 1/1 |"
    # HTA always names a rank, so it is wrong on every healthy run; nobody's lowest score is a verdict.
    assert lines[3] == "| healthy | 2 | 2/2 | 0/1 | error (1) | 0/1 | 1/1 | - |"


@pytest.mark.gpu
def test_device_stretch_slows_a_phase_by_its_factor_in_device_time() -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from megascope.trainer.faults import DeviceStretch

    device = torch.device("cuda", 0)
    stretch = DeviceStretch(1.5, device)
    a = torch.randn(2048, 2048, device=device)

    def phase(burn: bool) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if burn:
            stretch.begin("forward")
        for _ in range(20):
            a @ a
        if burn:
            stretch("forward", 0.0)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    plain = min(phase(False) for _ in range(3))
    for _ in range(3):  # the first calls learn the phase's device time
        phase(True)
    stretched = min(phase(True) for _ in range(3))
    assert 1.3 < stretched / plain < 1.7


def test_a_mesh_whose_stages_have_one_rank_each_says_stragglers_cannot_be_told(
        tmp_path: Path, synth: Synth, cli: Any) -> None:
    """pp=2 on two ranks: a rank's peers are the ranks of its stage, and there are none. The report
    says so rather than "none", in JSON (stragglers_withheld "no_peers") and in text; with a second
    replica the planted rank is named."""
    alone = synth(tmp_path / "alone", "straggler:rank=1,factor=1.6", ranks=2, pp=2, tp=1, steps=6, seed=3)
    result = analysis.report(open_run(alone), with_whatif=False)
    assert result["stragglers"] == [] and result["stragglers_withheld"] == "no_peers"
    text = cli("report", str(alone))
    assert text.exit_code == 0 and "STRAGGLERS not told: no pipeline stage has two ranks" in text.output
    paired = synth(tmp_path / "paired", "straggler:rank=1,factor=1.6", ranks=4, pp=2, tp=1, steps=6, seed=3)
    result = analysis.report(open_run(paired), with_whatif=False)
    assert [s["rank"] for s in result["stragglers"]] == [1] and result["stragglers_withheld"] is None


def test_on_a_real_tp_pair_the_slow_gpu_is_named_for_its_compute_outside_the_tp_calls(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli: Any) -> None:
    """tests/data/gpu-tp-pair: the detection sweep's model on 4x H200 (pp2 x tp2, 16 steps, NCCL,
    TP calls timed in one micro-batch a step), rank 2's GPU planted 1.15x slow. Its TP partner's
    forward and backward spans hold the wait for it, so both read as long and rank 2, last at its
    group's calls, reads ``host``; a replay that sees a quarter of the TP calls saves under 0.7%
    and would dismiss it. Less its TP calls, its compute is 1.2x its partner's in every timed
    micro-batch while the other pair is within 1% of each other: named, for its compute."""
    from megascope.analysis import _sql

    straggler_module = importlib.import_module("megascope.analysis.stragglers")

    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "gpu-tp-pair", tmp_path / "run"))
    tp = _sql.query_df(run.con, "stragglers", "tp_exclusive", ranks=[0, 1, 2, 3], spans="spans",
                       bar=1.1).set_index("rank")
    assert tp.equals(_sql.query_df(run.con, "stragglers", "tp_exclusive", ranks=[0, 1, 2, 3], bar=1.1,
                                   spans=_sql.Raw(run.rank_source("spans", [0, 1, 2, 3]))).set_index("rank"))
    assert 1.15 < tp.at[2, "ratio"] < 1.3 and tp.at[2, "slow_frac"] == 1.0
    assert tp.at[0, "imbalance"] < 1.01 and tp.at[2, "other_imbalance"] < 1.01
    assert tp.at[3, "ratio"] < 0.9                           # its partner: less compute, more waiting
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [2]
    row = found.iloc[0]
    assert row["cause"] == "compute" and 1.15 < row["tp_compute_ratio"] < 1.3 and row["slowdown"] >= 1.1
    assert analysis.report(run, with_whatif=False)["stragglers"][0]["evidence"]["tp_compute_ratio"] > 1.15
    text = cli("report", str(tmp_path / "run"))
    assert text.exit_code == 0 and "rank 2: compute outside its TP calls 1.2" in text.output
    # Without that measure the rank reads host. The replay, which follows the TP calls waited for
    # later to their waits, finds what it costs the step (it once modeled every call as blocking,
    # its step 3.6x the measured one, saved 0.46% and dismissed it).
    monkeypatch.setattr(straggler_module, "TP_SLOW_FRAC", 1.01)
    host = analysis.stragglers(run)
    assert list(host["rank"]) == [2] and host.iloc[0]["cause"] == "host"
    assert analysis.stragglers_dismissed(run).empty
    replay = analysis.whatif(run, ranks=[2])
    assert 1.02 < replay["speedup"] < 1.1
    assert replay["modeled_baseline_ns"] < 1.2 * replay["step_time_ns"]


def _without_clock_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """The analysis as it read runs before it checked each device-timed rank's clock against its
    TP group's (no rank put back), to exercise what follows a partner that reads last."""
    base_module = importlib.import_module("megascope.analysis.base")
    monkeypatch.setattr(base_module, "_rank_skew", lambda con, sample: con.execute(
        "CREATE OR REPLACE TABLE ms_cache.rank_skew (rank INTEGER, skew_ns BIGINT, samples BIGINT)"))


def _named_with_clocks_put_back(tmp_path: Path, name: str) -> tuple[Any, pd.DataFrame]:
    """The run's ranks put back on their TP groups' clocks: the rank skews and what is named."""
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / name, tmp_path / "checked"))
    found = analysis.stragglers(run)
    return run.con.execute("SELECT rank, skew_ns FROM ms_cache.rank_skew").fetchall(), found


def test_on_a_real_tp_pair_the_slow_gpu_takes_the_name_its_partner_was_flagged_under(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/data/gpu-tp-partner: the same model on 4x H100 (pp2 x tp2, 16 steps), rank 0's GPU
    planted 1.15x slow. Rank 1's clock reads 0.6 ms late against its partner's (a collector before
    its CUDA anchors were checked): put back, rank 0 is flagged and named for its compute.

    Read without that check, its TP partner, rank 1, is the rank flagged (last at 92% of its calls,
    no longer spans: ``host``), and a replay would dismiss it. Rank 0's compute outside its TP calls
    is 1.2x rank 1's in nearly every timed micro-batch, the other pair within 1%: rank 0 takes the
    name, for its compute, with the flagged row's evidence."""
    from megascope.analysis import _sql

    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    skew, checked = _named_with_clocks_put_back(tmp_path, "gpu-tp-partner")
    assert [r for r, _ in skew] == [1] and 500_000 < skew[0][1] < 750_000
    assert list(checked["rank"]) == [0] and checked.iloc[0]["cause"] == "compute"
    assert 1.1 < checked.iloc[0]["slowdown"] < 1.3

    _without_clock_check(monkeypatch)
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "gpu-tp-partner", tmp_path / "run"))
    tp = _sql.query_df(run.con, "stragglers", "tp_exclusive", ranks=[0, 1, 2, 3], spans="spans",
                       bar=1.1).set_index("rank")
    assert 1.15 < tp.at[0, "ratio"] < 1.3 and tp.at[0, "slow_frac"] > 0.9 and tp.at[0, "other_imbalance"] < 1.01
    assert tp.at[1, "ratio"] < 0.9
    config = straggler_module.StragglerConfig()
    pool, sizes = straggler_module._candidates(run, config)
    flagged = pool[pool["straggler"].fillna(False).astype(bool)]
    assert list(flagged["rank"]) == [1]
    attributed = pd.concat([flagged, straggler_module._attribute(flagged, sizes)], axis=1)
    assert list(attributed["cause"]) == ["host"]
    # Without every rank's rows to take from, the flagged rank keeps its cause (its own ratio is low).
    alone = straggler_module._tp_stretched(run, attributed, config)
    assert list(alone["rank"]) == [1] and list(alone["cause"]) == ["host"]
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [0]
    row = found.iloc[0]
    assert row["cause"] == "compute" and row["phase"] == "compute"
    assert row["slowdown"] == pytest.approx(tp.at[0, "ratio"]) and row["steps_slow_frac"] == tp.at[0, "slow_frac"]
    assert row["z"] == pytest.approx(float(flagged.iloc[0]["z"])) and row["confidence"] > 0.99
    assert analysis.stragglers_dismissed(run).empty


def test_on_a_tensor_parallel_only_mesh_the_pair_itself_names_the_slow_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/data/gpu-tp-only: the detection sweep's model on 2x H200 (tp2 alone, 16 steps, NCCL),
    rank 0's GPU planted 1.3x slow. Rank 1's clock reads 4.0 ms late against rank 0's (a collector
    before its CUDA anchors were checked): put back, rank 0 is flagged and named for its compute.

    Read without that check, rank 1, its partner, is flagged (last at 95% of its calls, its
    own time holding its waits for rank 0) and a replay at its peers' pace saves nothing. Rank 0's
    compute outside its TP calls is 1.4x rank 1's in every timed micro-batch. With a single TP
    group there is no other pair to measure the noise by: the pair's own measure decides, and rank
    0 takes the name, for its compute."""
    from megascope.analysis import _sql

    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    skew, checked = _named_with_clocks_put_back(tmp_path, "gpu-tp-only")
    assert [r for r, _ in skew] == [1] and 3_900_000 < skew[0][1] < 4_100_000
    assert list(checked["rank"]) == [0] and checked.iloc[0]["cause"] == "compute"
    assert 1.25 < checked.iloc[0]["slowdown"] < 1.45

    _without_clock_check(monkeypatch)
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "gpu-tp-only", tmp_path / "run"))
    tp = _sql.query_df(run.con, "stragglers", "tp_exclusive", ranks=[0, 1], spans="spans", bar=1.1).set_index("rank")
    assert 1.3 < tp.at[0, "ratio"] < 1.5 and tp.at[0, "slow_frac"] == 1.0
    assert pd.isna(tp.at[0, "other_imbalance"])  # no other TP group
    config = straggler_module.StragglerConfig()
    pool, _sizes = straggler_module._candidates(run, config)
    assert list(pool.loc[pool["straggler"].fillna(False).astype(bool), "rank"]) == [1]
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [0]
    row = found.iloc[0]
    assert row["cause"] == "compute" and row["slowdown"] == pytest.approx(tp.at[0, "ratio"])
    assert analysis.stragglers_dismissed(run).empty
    # The same pair, its rows as if another TP group were unbalanced as much: the noise bar holds.
    noisy = tp.reset_index().assign(other_imbalance=tp.at[0, "ratio"])
    assert not any(straggler_module._tp_clear(r, config) for r in noisy.itertuples())
    assert straggler_module._tp_clear(next(tp.reset_index().itertuples()), config)


def test_a_pause_before_the_gradient_sync_is_named_however_the_replayed_steps_fall(tmp_path: Path) -> None:
    """tests/data/cpu-dp8-pause: the bundled trainer on CPU (gloo, dp8, 16 steps), rank 6 pausing
    100 ms before each step's last backward, where its gradient sync starts. Replaying rank 6 at
    its peers' pace saves 1-10% of 10 of the 15 steps after the warm-up and nothing in 4 of them;
    the three evenly spaced steps a replay used to take were three of those 4, and rank 6 was
    dismissed. The replay now covers every step of so small a run but the warm-up, the median step
    decides, and rank 6 is named, for its host."""
    whatif_module = importlib.import_module("megascope.analysis.whatif")
    straggler_module = importlib.import_module("megascope.analysis.stragglers")

    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-dp8-pause", tmp_path / "run"))
    three = whatif_module.whatif(run, ranks=[6], steps=[1, 6, 11])
    assert three["speedup"] == pytest.approx(1.0, abs=1e-6)
    replayed = whatif_module.whatif(run, ranks=[6])
    assert replayed["steps_modeled"] == list(range(1, 16))  # every step but the warm-up
    savings = replayed["step_savings"]
    assert len(savings) == 15 and sum(s > 0.01 for s in savings) >= 10
    assert straggler_module._replay_saving(run, 6) == pytest.approx(float(np.median(savings)))
    assert np.median(savings) > 2 * straggler_module.StragglerConfig().min_host_saving
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [6]
    assert found.iloc[0]["cause"] == "host"
    assert analysis.stragglers_dismissed(run).empty


def test_the_replay_covers_more_steps_the_fewer_calls_a_step_holds() -> None:
    whatif_module = importlib.import_module("megascope.analysis.whatif")
    count = whatif_module.replay_step_count
    assert count(400) == whatif_module.WHATIF_MAX_STEPS  # an 8-rank run: every step
    assert count(19_456) == 5  # 1,024 ranks of a tp8 x pp8 synth run
    assert count(60_000) == whatif_module.WHATIF_SAMPLE_STEPS
    assert count(233_000) == 1 and count(10**7) == 1  # never past the event budget


def test_the_dp_peer_of_a_paused_rank_is_not_named_for_its_communication(tmp_path: Path) -> None:
    """tests/data/cpu-pp3-dp2-pause: the bundled trainer on CPU (gloo, pp3 x dp2, 6 layers, 16
    steps), rank 0 pausing 90 ms a step before its data-parallel sync. Its DP peer, rank 1, waits for
    it there; the transfer time of rank 1's overlapping calls holds part of that wait (3.2x its
    peers' in over half the steps), and rank 1 was named `communication` beside rank 0. Its
    combined evidence says it waited for its peers far more than they waited for it."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-pp3-dp2-pause", tmp_path / "run"))
    config = straggler_module.StragglerConfig()
    candidates, _ = straggler_module._candidates(run, config)
    victim = candidates.set_index("rank").loc[1]
    assert victim["steps_comm_slow_frac"] >= config.min_frac and victim["steps_slow_frac"] < config.min_frac
    assert victim["z"] < straggler_module.COMM_MIN_Z
    found = analysis.stragglers(run)
    assert [(int(r), c) for r, c in zip(found["rank"], found["cause"], strict=True)] == [(0, "host")]


def test_a_slow_rank_of_a_pipeline_replica_is_named_by_its_spans_against_its_dp_peer(tmp_path: Path) -> None:
    """tests/data/cpu-pp4-dp2-slow: the bundled trainer on CPU (gloo, pp4 x dp2, 16 steps), rank 3
    (stage 1, replica 1) planted 1.3x slow. Its replica-mates wait for it at their receives and, on
    the two shared cores, their own time reads nearly as slow: its combined evidence stays under
    the bar. Its forward and backward spans are what stand out, against rank 2's at its stage."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    from megascope.analysis import _sql
    from megascope.analysis.base import prepare

    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-pp4-dp2-slow", tmp_path / "run"))
    config = straggler_module.StragglerConfig()
    candidates, _ = straggler_module._candidates(run, config)
    assert not bool(candidates.set_index("rank").at[3, "straggler"])  # the evidence alone misses it
    prepare(run.con)
    dp = _sql.query_df(run.con, "stragglers", "dp_compute", bar=config.min_named_slowdown).set_index("rank")
    assert sorted(dp.index) == list(range(8))
    assert dp.at[3, "ratio"] >= straggler_module.DP_COMPUTE_BAR
    assert dp.at[3, "slow_frac"] >= straggler_module.DP_SLOW_FRAC
    assert dp.drop(index=3)["ratio"].max() < 1.2
    # A pair: rank 2's ratio is the inverse of rank 3's, step by step.
    assert dp.at[2, "ratio"] == pytest.approx(1 / dp.at[3, "ratio"], rel=1e-6)
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [3]
    row = found.iloc[0]
    assert row["cause"] == "compute" and row["phase"] == "compute"
    assert row["slowdown"] == pytest.approx(dp.at[3, "ratio"]) and row["dp_compute_ratio"] == row["slowdown"]
    assert row["steps_slow_frac"] == pytest.approx(dp.at[3, "slow_frac"])


def test_a_pipeline_stage_s_posted_sends_do_not_hide_its_pause(tmp_path: Path) -> None:
    """tests/data/cpu-pp4-dp2-pause-under-sends: the bundled trainer on CPU (gloo, pp4 x dp2, 16
    steps), rank 0 (stage 0, replica 0) pausing 100 ms before its last backward. Its forward reads
    slow too (its forward runs 1.3x its DP peer's in healthy runs of this mesh), and its sends,
    posted in the forward and completing at the step's end, spanned the pause: read as covered, the
    pause was no time outside its spans and the rank read ``compute``. A send covers its rank only
    until its next span of another kind begins."""
    from megascope.analysis import _sql

    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-pp4-dp2-pause-under-sends", tmp_path / "run"))
    found = analysis.stragglers(run)
    assert [(int(r), c) for r, c in zip(found["rank"], found["cause"], strict=True)] == [(0, "host")]
    assert found.iloc[0]["pause_share"] > 0.5
    outside = _sql.query_df(run.con, "stragglers", "outside", ranks=[0, 1],
                            spans=_sql.Raw(run.rank_source("spans", [0, 1])))
    table = outside.pivot_table(index="step", columns="rank", values="outside")
    # About the 100 ms pause more than its DP peer, step by step.
    assert 80e6 < float((table[0] - table[1]).median()) < 120e6


def test_pipeline_links_on_loaded_cores_name_no_slow_link(tmp_path: Path) -> None:
    """Two runs of the bundled trainer on CPU (gloo, pp4 x dp2, 16 steps, load 7-8 on two cores),
    out of sample: a healthy one (tests/data/cpu-pp4-dp2-healthy-noisy-link) whose link 4<>6 read
    2.05x and 1.54x against the other replica's, and one with rank 4 pausing 100 ms
    (tests/data/cpu-pp4-dp2-pause-one-way-noise) in which the other replica's link 1>3 read 3.08x one
    way. Both links were named, first. Links are held to PAIR_BAR both ways, and no one-way link is
    named beside a rank named for its own time."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    data = Path(__file__).parent / "data"

    healthy = open_run(shutil.copytree(data / "cpu-pp4-dp2-healthy-noisy-link", tmp_path / "healthy"))
    assert analysis.stragglers(healthy).empty
    edges = {(a, b): r for a, b, _, r, _ in straggler_module._slow_edges(healthy, 8)}
    assert min(edges[(4, 6)], edges[(6, 4)]) >= straggler_module.LINK_BAR  # what named it before
    assert straggler_module._slow_pairs(healthy, 8).empty

    paused = open_run(shutil.copytree(data / "cpu-pp4-dp2-pause-one-way-noise", tmp_path / "paused"))
    found = analysis.stragglers(paused)
    assert [(int(r), c) for r, c in zip(found["rank"], found["cause"], strict=True)] == [(4, "host")]
    edges = {(a, b): r for a, b, _, r, _ in straggler_module._slow_edges(paused, 8)}
    assert max(edges.values()) >= straggler_module.ONE_WAY_BAR


def test_a_mild_slow_rank_of_a_pipeline_replica_is_not_shaded_by_its_own_wake(tmp_path: Path) -> None:
    """tests/data/cpu-pp4-dp2-mild: the same mesh, rank 0 (stage 0, replica 0) planted 1.15x slow.
    The next stage of its replica, rank 2, waits for it at its receives and reads the largest
    combined evidence of the run, though it is neither flagged nor stretched; rank 0's spans are
    1.34x its DP peer's. The DP-peer rule holds a rank to the strongest straggler's evidence, and
    a wake is none: rank 0 is named, for its compute."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    from megascope.analysis import _sql
    from megascope.analysis.base import prepare

    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-pp4-dp2-mild", tmp_path / "run"))
    config = straggler_module.StragglerConfig()
    candidates, _ = straggler_module._candidates(run, config)
    c = candidates.set_index("rank")
    assert not c["flag"].fillna(False).astype(bool).any()  # nothing flagged: the spans rule alone
    assert c["z"].idxmax() == 2 and c.at[0, "z"] < config.shadow * c.at[2, "z"]
    prepare(run.con)
    dp = _sql.query_df(run.con, "stragglers", "dp_compute", bar=config.min_named_slowdown).set_index("rank")
    assert dp.at[0, "ratio"] >= straggler_module.DP_COMPUTE_BAR and dp.at[2, "ratio"] < 1.1
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [0] and found.iloc[0]["cause"] == "compute"


def test_a_slow_stage_is_named_before_the_later_stage_of_its_replica_that_carries_its_wake(
        tmp_path: Path, cli: Callable[..., Result]) -> None:
    """tests/data/cpu-pp4-dp2-wake: the same mesh, rank 0 (stage 0, replica 0) planted 1.25x slow,
    8 ranks on two cores. Rank 4, stage 2 of the same replica, reaches its DP calls late behind it
    and, its compute sharing the cores with rank 0's, reads slow too: its combined evidence (the
    waits it causes its DP peer, its late arrivals) is the run's strongest. Its own spans stretch
    far less than rank 0's; rank 0 is named first."""
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-pp4-dp2-wake", tmp_path / "run"))
    found = analysis.stragglers(run).set_index("rank", drop=False)
    assert set(found["rank"]) == {0, 4} and set(found["cause"]) == {"compute"}
    assert int(found.at[0, "dp"]) == int(found.at[4, "dp"]) and int(found.at[0, "pp"]) < int(found.at[4, "pp"])
    assert found.at[4, "z"] > found.at[0, "z"]  # by the combined evidence rank 4 would come first
    assert found.at[0, "t_spans"] > 2 * found.at[4, "t_spans"]
    assert list(found["rank"]) == [0, 4]
    assert found.at[4, "behind"] == 0 and found["behind"].isna().sum() == 1  # rank 0 is behind no rank
    result = cli("report", str(run.path), "--json")
    assert result.exit_code == 0, result.output
    slow = json.loads(result.output)["stragglers"]
    assert [(s["rank"], s["evidence"]["behind_rank"]) for s in slow] == [(0, None), (4, 0)]
    text = cli("report", str(run.path)).output
    assert "rank 4: a later stage of rank 0's pipeline replica" in text


def test_a_mild_slow_gpu_of_a_tp_pair_is_named_by_its_compute_outside_the_tp_calls(tmp_path: Path) -> None:
    """tests/data/gpu-tp2-mild: the bundled trainer on 2x H200 (NCCL, tp2), rank 1's GPU planted
    1.1x slow; the job ran 8.3% slower than its healthy runs. The collector times the TP calls of
    one micro-batch a step, and rank 0 waits for rank 1 in the others, inside its forward: rank 1's
    own time reads only 1.05x rank 0's, under the 1.10 a compute straggler needs. Its compute
    outside the TP calls reads 1.14x in every step, and names it."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "gpu-tp2-mild", tmp_path / "run"))
    config = straggler_module.StragglerConfig()
    candidates, _ = straggler_module._candidates(run, config)
    own = candidates.set_index("rank")
    assert bool(own.at[1, "straggler"]) and own.at[1, "median_slowdown"] < config.min_named_slowdown
    tp = straggler_module._tp_exclusive(run, {0, 1}, config, reference_groups=straggler_module.TP_REFERENCE_GROUPS)
    assert tp[1].ratio >= 1.12 and tp[1].slow_frac == 1.0 and tp[0].ratio < 1.0
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [1]
    row = found.iloc[0]
    assert row["cause"] == "compute" and row["slowdown"] == pytest.approx(tp[1].ratio)
    assert row["tp_compute_ratio"] == pytest.approx(tp[1].ratio) and row["steps_slow_frac"] == 1.0


@pytest.mark.parametrize(("name", "late", "named"), [
    ("gpu-tp2-late-clock-slow", 4_049_000, [0]),
    ("gpu-tp2-late-clock-healthy", 3_917_000, []),
])
def test_a_rank_whose_clock_reads_late_is_put_back_on_its_tp_partners(tmp_path: Path, name: str, late: int,
                                                                      named: list[int], cli: Any) -> None:
    """tests/data/gpu-tp2-late-clock-*: the bundled trainer on 2x H200 (NCCL, tp2), recorded before
    the collector checked its CUDA anchors: rank 0's clock reads ~4 ms late for the whole run, so
    rank 1 seemed to wait through every TP call. In the slow run (rank 0's GPU 1.15x) the report
    read rank 0 29.4x slow in 25% of the steps. The pair's TP calls end together, so rank 0's lead
    at their ends is its clock's error: its times are put back by it, and the run reads as it ran."""
    from megascope.analysis.base import prepare

    run = open_run(shutil.copytree(Path(__file__).parent / "data" / name, tmp_path / "run"))
    prepare(run.con, persist_cache=False)
    skew = run.con.execute("SELECT rank, skew_ns, samples FROM ms_cache.rank_skew").fetchall()
    assert [(r, n) for r, _, n in skew] == [(0, 8)] and abs(skew[0][1] - late) < 50_000
    offsets = dict(run.con.execute("SELECT rank, offset_ns FROM ms_cache.rank_clock").fetchall())
    assert offsets == {0: -skew[0][1], 1: 0}
    found = analysis.stragglers(run)
    assert list(found["rank"]) == named
    if named:
        row = found.iloc[0]
        assert row["cause"] == "compute" and 1.1 < row["slowdown"] < 1.3 and row["steps_slow_frac"] > 0.8
    # The report says so, in its clock section.
    result = cli("report", "--json", "--no-whatif", str(run.path))
    assert result.exit_code == 0, result.output
    assert [(r["rank"], r["skew_ns"]) for r in json.loads(result.output)["clock"]["ranks_put_back"]] == [(0, skew[0][1])]
    text = cli("report", "--no-whatif", str(run.path)).output
    assert f"CLOCKS rank 0's clock read {skew[0][1] / 1e6:.1f} ms late against its TP group's" in text


def test_a_healthy_pipeline_and_data_parallel_run_names_no_rank_by_its_spans(tmp_path: Path) -> None:
    """tests/data/cpu-pp4-dp2-healthy: the same mesh with nothing planted. The largest span ratio
    against a DP peer (1.15x, rank 6) stays under the bar, and no rank is named."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    from megascope.analysis import _sql
    from megascope.analysis.base import prepare

    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-pp4-dp2-healthy", tmp_path / "run"))
    prepare(run.con)
    dp = _sql.query_df(run.con, "stragglers", "dp_compute", bar=1.10)
    assert len(dp) == 8 and 1.0 < dp["ratio"].max() < straggler_module.DP_COMPUTE_BAR
    assert analysis.stragglers(run).empty


def test_a_pipeline_rank_whose_fsdp_peer_paused_is_not_named_for_the_wait_inside_its_forward(
        tmp_path: Path) -> None:
    """tests/data/cpu-pipeline-fsdp-pause: tests/jobs/pipeline_job.py on CPU (gloo, 4 ranks, dp2 x
    pp2, each stage sharded with fully_shard over its DP pair, 1F1B over 4 micro-batches, 14
    steps), rank 3 (stage 1) pausing 50 ms a step outside its spans. Its DP peer, rank 1, waits for
    it in the all-gathers FSDP issues inside rank 1's forward: rank 1's spans read 1.4x rank 3's,
    and rank 1 was named for its compute. It caused its peer less wait than it suffered, and is not."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    from megascope.analysis import _sql
    from megascope.analysis.base import prepare

    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-pipeline-fsdp-pause", tmp_path / "run"))
    config = straggler_module.StragglerConfig()
    candidates, _ = straggler_module._candidates(run, config)
    assert candidates.set_index("rank").at[1, "t_blame"] < straggler_module.DP_MIN_T_BLAME
    prepare(run.con)
    dp = _sql.query_df(run.con, "stragglers", "dp_compute", bar=config.min_named_slowdown).set_index("rank")
    assert dp["ratio"].idxmax() == 1 and dp.at[1, "ratio"] >= straggler_module.DP_COMPUTE_BAR
    assert dp.at[1, "slow_frac"] >= straggler_module.DP_SLOW_FRAC
    assert 1 not in set(analysis.stragglers(run)["rank"].astype(int))


def test_a_slow_rank_of_a_pipeline_with_sharded_stages_is_named_for_its_compute(tmp_path: Path) -> None:
    """tests/data/cpu-pipeline-fsdp-slow: the same job, rank 1 (stage 1) doing 2x the matrix work
    of its stage: named for its compute, its spans 1.3x its DP peer's and more."""
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-pipeline-fsdp-slow", tmp_path / "run"))
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [1]
    assert found.iloc[0]["cause"] == "compute" and found.iloc[0]["slowdown"] > 1.25


@pytest.mark.parametrize(("fixture", "paused_peer"), [("cpu-pipeline-fsdp-pause", True),
                                                      ("cpu-pipeline-fsdp-slow", False)])
def test_a_rank_whose_spans_stretch_by_its_peer_s_pause_is_not_named_without_the_blame_check(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixture: str, paused_peer: bool) -> None:
    """The wait given and taken does not always come out against the waiting rank (one run in 14
    of a 60 ms pause named the peer): its peer's extra time outside its spans, and its own extra
    wait for that peer, each as long as half the stretch of its spans, keep it unnamed on their
    own. The slow rank waited less than its peer, so it is still named."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    from megascope.analysis import _sql
    from megascope.analysis.base import prepare

    run = open_run(shutil.copytree(Path(__file__).parent / "data" / fixture, tmp_path / "run"))
    prepare(run.con)
    dp = _sql.query_df(run.con, "stragglers", "dp_compute", bar=1.10)
    assert dp.set_index("rank")["ratio"].idxmax() == 1
    assert straggler_module._waits_for_paused_peer(run, 1, dp) is paused_peer
    assert straggler_module._waits_for_paused_peer(run, 3, dp) is False  # its span excess is negative
    monkeypatch.setattr(straggler_module, "DP_MIN_T_BLAME", -math.inf)  # the blame check off
    named = set(analysis.stragglers(run)["rank"].astype(int))
    assert named == (set() if paused_peer else {1})


def test_ranks_with_tp_partners_are_not_measured_against_dp_peers(tmp_path: Path) -> None:
    """On a tensor-parallel mesh the TP measure decides (a slow rank's partners' spans hold its
    waits, so its DP peers' spans differ from its own for reasons of the TP group): the DP measure
    reads no rank there."""
    from megascope.analysis import _sql
    from megascope.analysis.base import prepare

    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "gpu-tp-pair", tmp_path / "run"))
    prepare(run.con)
    assert _sql.query_df(run.con, "stragglers", "dp_compute", bar=1.10).empty


def test_a_slow_link_under_one_rank_is_named_for_its_communication_and_its_partners_are_not(tmp_path: Path) -> None:
    """tests/data/cpu-tp2-dp2-slow-link: the bundled trainer on CPU (gloo, tp2 x dp2, 12 steps), each
    rank in a network namespace of its own, rank 1's link rate-limited to 60 Mbit/s both ways
    (bench/slow_link.py). Rank 1's TP group and its DP group each transfer ~4x as long as the
    other group of their kind; its TP partner (rank 0) and DP peer (rank 3) share one slow group
    each. tests/data/cpu-tp2-dp2-healthy-links: the same mesh, no limit."""
    from megascope.analysis import _sql

    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-tp2-dp2-slow-link", tmp_path / "run"))
    found = analysis.stragglers(run)
    assert [(int(r), c) for r, c in zip(found["rank"], found["cause"], strict=True)] == [(1, "communication")]
    row = found.iloc[0]
    assert [g.split()[0] for g in row["slow_groups"]] == ["tp:0", "dp:1"]
    assert 3.0 < float(row["slowdown"]) < 5.0 and float(row["steps_slow_frac"]) >= 0.9
    groups = _sql.query_df(run.con, "stragglers", "slow_groups", bar=straggler_module.LINK_BAR).set_index("grp")
    assert set(groups.index) == {"tp:0", "tp:1", "dp:0", "dp:1"}  # world: one group, never compared
    assert groups.loc["tp:0", "ratio"] > 3 > 0.5 > groups.loc["tp:1", "ratio"]  # two groups: each against the other
    assert sorted(groups.loc["dp:1", "members"]) == [1, 3]
    report = analysis.report(run, with_whatif=False)
    assert report["stragglers"][0]["evidence"]["slow_groups"] == list(row["slow_groups"])

    healthy = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-tp2-dp2-healthy-links", tmp_path / "ok"))
    assert analysis.stragglers(healthy).empty
    ratios = _sql.query_df(healthy.con, "stragglers", "slow_groups", bar=straggler_module.LINK_BAR)["ratio"]
    assert len(ratios) == 4 and ratios.max() < straggler_module.LINK_BAR


def test_a_rank_in_one_slow_group_only_is_not_named_for_a_link(tmp_path: Path) -> None:
    """The link rule needs every group of the rank compared, of two kinds or more, to be slow: with
    the limited rank's DP group alone slow (its TP group's transfers set back to the other TP
    group's), no rank is named for a link."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-tp2-dp2-slow-link", tmp_path / "run"))
    analysis.stragglers(run)  # builds the base tables
    # The other TP group's transfers become rank 1's group's, call for call: TP groups read alike.
    run.con.execute("""
        UPDATE ms_cache.inst SET xfer_ns = o.xfer_ns
        FROM (SELECT seq, xfer_ns FROM ms_cache.inst WHERE grp = 'tp:1') o
        WHERE ms_cache.inst.grp = 'tp:0' AND ms_cache.inst.seq = o.seq""")
    links, mates = straggler_module._slow_links(run, straggler_module._candidates(run, straggler_module.StragglerConfig())[0],
                                                straggler_module.StragglerConfig())
    assert links.empty and not mates


def test_a_slow_pipeline_link_names_the_rank_both_its_links_share(tmp_path: Path) -> None:
    """tests/data/cpu-pp3-dp2-slow-link: the bundled trainer on CPU (gloo, pp3 x dp2, 12 steps, 6
    layers), rank 2 (stage 1) on a link rate-limited to 40 Mbit/s both ways (bench/slow_link.py).
    Its DP group has no peer group at its stage, so only its pipeline links tell: the links to the
    stage before it (rank 0) and after it (rank 4) transfer many times as long as the other
    replica's, both ways, and rank 2 alone is on both. Its neighbours are not named."""
    from megascope.analysis import _sql

    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-pp3-dp2-slow-link", tmp_path / "run"))
    found = analysis.stragglers(run)
    assert [(int(r), c) for r, c in zip(found["rank"], found["cause"], strict=True)] == [(2, "communication")]
    assert sorted(g.split()[0] for g in found.iloc[0]["slow_groups"]) == ["p2p:0<>2", "p2p:2<>4"]
    assert float(found.iloc[0]["slowdown"]) > 5
    edges = _sql.query_df(run.con, "stragglers", "slow_edges", bar=straggler_module.LINK_BAR,
                          steps=list(range(12))).set_index("grp")
    # Every link of the run is compared with the other replica's between the same stages, both ways.
    assert set(edges.index) == {"p2p:0>2", "p2p:2>0", "p2p:2>4", "p2p:4>2", "p2p:1>3", "p2p:3>1", "p2p:3>5", "p2p:5>3"}
    assert edges.loc[["p2p:0>2", "p2p:2>0", "p2p:2>4", "p2p:4>2"], "ratio"].min() > 5
    assert edges.loc[["p2p:1>3", "p2p:3>1", "p2p:3>5", "p2p:5>3"], "ratio"].max() < 0.5
    assert sorted(edges.loc["p2p:4>2", "members"]) == [2, 4]
    report = analysis.report(run, with_whatif=False)
    assert [s["rank"] for s in report["stragglers"]] == [2]


def test_a_compute_straggler_s_slow_groups_name_no_link_in_its_place(tmp_path: Path) -> None:
    """tests/data/cpu-tp2-dp2-slow-on-loaded-cores: the bundled trainer on CPU (gloo, tp2 x dp2,
    6 steps, 4 ranks on 2 cores beside a test suite), rank 1 planted 3x slow in its compute. On
    shared cores a collective progresses on its members' CPUs: rank 1's DP group transferred 2.88x
    as long as the other, and rank 3, its DP peer, in that group and in a TP group read 1.76x, was
    their only common member. It was named for a slow link, and rank 1, a member of its slow group,
    dropped as its link's mate. A group holding a rank named for its compute is no evidence of a
    link under another member: rank 1 is named, for its compute, and no link. (A rank named for its
    compute may still be named for its own link: tests/data/cpu-pp3-dp2-slow-link.)"""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-tp2-dp2-slow-on-loaded-cores", tmp_path / "run"))
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [1] and found.iloc[0]["cause"] == "compute" and found.iloc[0]["slowdown"] > 2.5
    assert found["slow_groups"].isna().all()
    pool = straggler_module._candidates(run, straggler_module.StragglerConfig())[0]
    groups = straggler_module._sql.query_df(run.con, "stragglers", "slow_groups", bar=straggler_module.LINK_BAR)
    slow = groups[groups["ratio"] >= straggler_module.LINK_BAR].set_index("grp")
    assert {"dp:1", "tp:1"} <= set(slow.index) and 1 in set(slow.loc["dp:1", "members"])
    # Without the rank named for its compute, its groups name its DP peer for a link, and it goes.
    links, mates = straggler_module._slow_links(run, pool, straggler_module.StragglerConfig())
    assert list(links["rank"]) == [3] and 1 in mates
    links, mates = straggler_module._slow_links(run, pool, straggler_module.StragglerConfig(), {1})
    assert links.empty and not mates


def test_a_compute_straggler_whose_groups_read_slow_is_not_named_for_a_link(tmp_path: Path) -> None:
    """tests/data/cpu-tp2-dp2-slow-on-loaded-cores-self: another run of the same test, the same
    fault. Rank 1's own time read 4.22x its peers' and its two groups 2.98x (DP) and 1.54x (TP):
    it alone is in both, and it was named for a slow link under it, `communication` 1.54x, with
    nothing named for its compute. A slow link stretches a rank's own time less than its transfers
    (the pipeline stage on a 40 Mbit/s link of tests/data/cpu-pp3-dp2-slow-link: 1.6x own time,
    links 25.8x and 27.7x); a rank slow in its compute stretches its groups less than itself."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-tp2-dp2-slow-on-loaded-cores-self",
                                   tmp_path / "run"))
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [1] and found.iloc[0]["cause"] == "compute" and found.iloc[0]["slowdown"] > 4
    pool = straggler_module._candidates(run, straggler_module.StragglerConfig())[0]
    links, _ = straggler_module._slow_links(run, pool, straggler_module.StragglerConfig())
    assert list(links["rank"]) == [1] and min(float(g.split()[1][:-1]) for g in links.iloc[0]["slow_groups"]) < 2
    links, mates = straggler_module._slow_links(run, pool, straggler_module.StragglerConfig(), {1})
    assert links.empty and not mates


def test_a_link_slow_one_way_names_both_ends_not_the_receiver_for_its_compute(tmp_path: Path, cli: Any) -> None:
    """tests/data/cpu-pp2-dp2-one-way-link: pp2 x dp2 on gloo, each rank in a network namespace of
    its own, what rank 0 sends limited to 90 Mbit/s (what it receives not). Rank 1, its DP peer,
    gets the gathered parameters late and its forward waits for them: it read 2.2x in its own time
    and was named ``compute``, rank 0 not at all. Its calls complete later than rank 0's, summed per
    step more than its excess own time, and its compute outside its calls is its peer's: both ends
    of the group are named for their communication."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-pp2-dp2-one-way-link", tmp_path / "run"))
    found = analysis.stragglers(run)
    assert sorted(int(r) for r in found["rank"]) == [0, 1] and set(found["cause"]) == {"communication"}
    for groups in found["slow_groups"]:
        assert len(groups) == 1 and groups[0].startswith("dp:0 0>1 ") and groups[0].endswith("(late, either end)")
    steps = list(range(1, 16))
    lag = straggler_module._sql.query_df(run.con, "stragglers", "late_completion", ranks=[0, 1], steps=steps,
                                         max_members=straggler_module.LATE_GROUP_MAX,
                                         spans=straggler_module._sql.Raw(run.rank_source("spans", [0, 1])))
    late = lag.groupby("rank")["lag_ns"].sum()
    assert late[1] > 100e6 and late[0] < 0.05 * late[1]
    compute = straggler_module._sql.query_df(run.con, "stragglers", "compute_outside_calls", ranks=[0, 1], steps=steps,
                                             spans=straggler_module._sql.Raw(run.rank_source("spans", [0, 1])))
    table = compute.pivot_table(index="step", columns="rank", values="compute")
    assert float((table[1] / table[0]).median()) < 1.1
    text = cli("report", str(tmp_path / "run"))
    assert text.exit_code == 0 and text.output.count("data arriving slowly") == 2
    assert text.output.count("communication  comm") == 2 and "STRAGGLERS (2)" in text.output


def test_a_link_slow_into_a_rank_only_names_it(tmp_path: Path, cli: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/data/cpu-pp4-dp2-one-way-in: pp4 x dp2 on gloo, each rank in a network namespace of
    its own, what rank 3 (stage 1) receives limited to 40 Mbit/s, what it sends not. Its two links
    read 13x and 22x into it and under 1.5x out of it: slow both ways neither, so nothing was
    named, the job 2x slower than healthy. Every direction into it is slow one way: it alone is
    named. On a GPU run the one-way rule is off (a slow GPU's pipeline read 5.35x one way, read
    with a rank's clock 0.6 ms late, as the analysis did before it put such clocks back)."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-pp4-dp2-one-way-in", tmp_path / "run"))
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [3] and found.iloc[0]["cause"] == "communication"
    assert sorted(g.split()[0] for g in found.iloc[0]["slow_groups"]) == ["p2p:1>3", "p2p:5>3"]
    assert all(g.endswith("(into it)") for g in found.iloc[0]["slow_groups"])
    edges = {(a, b): r for a, b, _, r, _ in straggler_module._slow_edges(run, 8)}
    assert min(edges[(1, 3)], edges[(5, 3)]) >= straggler_module.ONE_WAY_BAR
    assert max(edges[(3, 1)], edges[(3, 5)]) < straggler_module.LINK_BAR
    assert straggler_module._slow_pairs(run, 8).empty
    text = cli("report", str(tmp_path / "run"))
    assert text.exit_code == 0 and "slow one way only" in text.output and "what this rank receives" in text.output

    _without_clock_check(monkeypatch)
    gpu = open_run(shutil.copytree(Path(__file__).parent / "data" / "gpu-tp-partner", tmp_path / "gpu"))
    pool = straggler_module._candidates(gpu, StragglerConfig())[0]
    assert max(r for *_, r, _ in straggler_module._slow_edges(gpu, len(pool))) >= straggler_module.ONE_WAY_BAR
    assert straggler_module._one_way_links(gpu, pool, StragglerConfig(), set()).empty


def test_a_link_slower_than_its_end_s_own_time_names_both_ends_and_one_slower_does_not(tmp_path: Path) -> None:
    """tests/data/cpu-pp2-dp2-slow-link (rank 2 on a 60 Mbit/s link, its link to rank 0 read over
    5x both ways): were rank 2 named for its compute, the link still names both its ends, being
    slower than rank 2's own time. Were rank 2's own time slower than the link, the link would hold
    its slowness: no end is named for it."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-pp2-dp2-slow-link", tmp_path / "run"))
    config = straggler_module.StragglerConfig()
    pool = straggler_module._candidates(run, config)[0]
    ratio = float(straggler_module._slow_pairs(run, 4).set_index("grp").loc["p2p:0<>2", "ratio"])
    idx = pool.index[pool["rank"] == 2][0]
    assert float(pool.at[idx, "median_slowdown"]) < ratio
    links, _ = straggler_module._slow_links(run, pool, config, {2})
    assert sorted(links["rank"]) == [0, 2]
    pool.at[idx, "median_slowdown"] = ratio * 1.2
    links, mates = straggler_module._slow_links(run, pool, config, {2})
    assert links.empty and not mates


def test_a_slow_pipeline_link_nothing_else_locates_names_both_its_ends(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/data/cpu-pp2-dp2-slow-link: pp2 x dp2, rank 2 (stage 1) on a 60 Mbit/s link. Each rank
    has one pipeline link and a DP group with no peer group at its stage: the slow link 0<>2 is
    told, its end is not. Both ends are named, "either end", and not rank 0 alone for its host
    (as before pipeline links were compared: its own time doubled beside the link it sends on).
    With the direction 2>0 read as the other replica's, the link is slow one way only: no pair,
    nothing named for a slow link both ways, and the one-way rule names both its ends."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-pp2-dp2-slow-link", tmp_path / "run"))
    found = analysis.stragglers(run)
    assert [(int(r), c) for r, c in zip(found["rank"], found["cause"], strict=True)] == [
        (0, "communication"), (2, "communication")]
    for groups in found["slow_groups"]:
        assert len(groups) == 1 and groups[0].startswith("p2p:0<>2 ") and groups[0].endswith("x (either end)")
    pairs = straggler_module._slow_pairs(run, 4).set_index("grp")  # the links slow both ways
    assert list(pairs.index) == ["p2p:0<>2"] and pairs.loc["p2p:0<>2", "ratio"] > 5

    query = straggler_module._sql.query_df

    def one_way(con: Any, module: str, name: str, **params: Any) -> pd.DataFrame:
        got = query(con, module, name, **params)
        if name == "slow_edges":
            got.loc[got["grp"] == "p2p:2>0", "ratio"] = 1.0
        return got

    monkeypatch.setattr(straggler_module._sql, "query_df", one_way)
    monkeypatch.setattr(straggler_module.persist, "memo_get", lambda con, name: None)  # not the kept pairs
    config = straggler_module.StragglerConfig()
    assert straggler_module._slow_pairs(run, 4).empty
    pool = straggler_module._candidates(run, config)[0]
    links, mates = straggler_module._slow_links(run, pool, config)
    assert links.empty and not mates
    one_way = straggler_module._one_way_links(run, pool, config, set())
    assert sorted(one_way["rank"]) == [0, 2]
    assert all(g == [f"p2p:0>2 {g[0].split()[1]} (one way, either end)"] for g in one_way["slow_groups"])


def test_a_rank_whose_spans_hold_slow_tp_transfers_is_not_named_for_its_compute(tmp_path: Path) -> None:
    """On the slow-link run (tests/data/cpu-tp2-dp2-slow-link) rank 1's spans are long because its TP
    calls inside them transfer slowly: its own time reads as a compute straggler's, but its compute
    outside the TP calls is its partner's. That row goes; a GPU rank planted slow on a TP pair
    (tests/data/gpu-tp-pair: 1.20x its partner's outside the TP calls) keeps its name."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    config = straggler_module.StragglerConfig()
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-tp2-dp2-slow-link", tmp_path / "link"))
    candidates, sizes = straggler_module._candidates(run, config)
    flagged = straggler_module._causes(run, candidates[candidates["straggler"].fillna(False).astype(bool)], sizes,
                                       config, candidates)
    assert [(int(r), c) for r, c in zip(flagged["rank"], flagged["cause"], strict=True)] == [(1, "compute")]
    assert straggler_module._tp_explained(run, flagged, config).empty

    slow = open_run(shutil.copytree(Path(__file__).parent / "data" / "gpu-tp-pair", tmp_path / "pair"))
    named = analysis.stragglers(slow)
    assert named.iloc[0]["cause"] == "compute"
    kept = straggler_module._tp_explained(slow, named, config)
    assert list(kept["rank"]) == list(named["rank"])


def test_a_megatron_job_on_nccl_names_its_slow_gpu_for_its_compute(tmp_path: Path, cli: Any) -> None:
    """tests/data/gpu-megatron-tp2-slow and -healthy: tests/jobs/megatron_job.py (Megatron-core's
    GPTModel, hidden 2048, sequence 1024, 8 layers) on tp2, 2x H200, NCCL, 30 steps. In the slow run
    rank 0's stream sleeps inside its model's forward and backward from step 5 on, 0.25 times the
    step (a 1.25x slow GPU). Megatron's schedule marks no micro-batches: the model spans and the TP
    calls carry none, and the TP measure compares whole steps. The TP partner's spans hold the
    wait, so without that measure rank 0 reads ``host``. The healthy run (the same job, no fault):
    the pair within 0.1% of each other, nothing named."""
    from megascope.analysis import _sql

    data = Path(__file__).parent / "data"
    slow = open_run(shutil.copytree(data / "gpu-megatron-tp2-slow", tmp_path / "slow"))
    marked = slow.con.execute("""SELECT count(*), count(microbatch) FROM spans
        WHERE kind IN ('forward', 'backward') AND step IS NOT NULL""").fetchone()
    assert marked[0] == 2 * 30 * 8 and marked[1] == 0        # a forward and a backward per micro-batch, unmarked
    tp = _sql.query_df(slow.con, "stragglers", "tp_exclusive", ranks=[0, 1], spans="spans", bar=1.1).set_index("rank")
    assert list(tp["samples"]) == [30, 30]                    # one sample a step
    assert 1.2 < tp.at[0, "ratio"] < 1.4 and tp.at[0, "slow_frac"] > 0.75
    assert tp.at[1, "ratio"] < 0.85 and tp.at[1, "slow_frac"] == 0.0
    found = analysis.stragglers(slow)
    assert list(found["rank"]) == [0]
    assert found.iloc[0]["cause"] == "compute" and 1.2 < found.iloc[0]["slowdown"] < 1.35
    report = analysis.report(slow)
    # the healthy run's steps took 531 ms; fixed, this one's modeled at 520-570 ms
    assert 520e6 < report["whatif"]["whatif_step_time_ns"] < 570e6
    text = cli("report", str(tmp_path / "slow"))
    assert text.exit_code == 0 and "rank 0: compute outside its TP calls 1.3" in text.output

    healthy = open_run(shutil.copytree(data / "gpu-megatron-tp2-healthy", tmp_path / "healthy"))
    tp = _sql.query_df(healthy.con, "stragglers", "tp_exclusive", ranks=[0, 1], spans="spans", bar=1.1)
    assert tp["imbalance"].max() < 1.01
    assert analysis.stragglers(healthy).empty and analysis.report(healthy)["stragglers"] == []


def test_a_gpu_host_pause_reads_host_and_one_its_lead_absorbed_names_nobody(tmp_path: Path, cli: Any) -> None:
    """tests/data/gpu-dp2-pause and -absorbed: the bundled trainer on dp2 (ZeRO: its gathers inside
    the forward), 2x H200, NCCL, a device-bound model (12 layers, hidden 2048, sequence 2048), 16
    steps; the host runs ~60 ms ahead of its device. In the first, rank 1's host pauses 60 ms a
    step: the job runs 199 ms a step against 182-185 ms healthy, and rank 1's device waits for its
    host at the calls after the pause, its peer's never. Its spans, timed on the device, hold that
    idle time, so the spans' measures alone read ``compute``. In the second, rank 0 pauses 45 ms
    and the lead absorbs it (182 ms a step); only a gather it issued late waits inside rank 1's
    forward, and rank 1, its device busy and on time, reads 1.33x ``compute`` until a replay
    without its delay saves nothing."""
    from megascope.analysis.pipeline import host_lead

    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    data = Path(__file__).parent / "data"
    paused = open_run(shutil.copytree(data / "gpu-dp2-pause", tmp_path / "paused"))
    found = analysis.stragglers(paused)
    assert list(found["rank"]) == [1] and found.iloc[0]["cause"] == "host"
    lead = host_lead(paused, steps=list(range(1, 16)), ranks=[0, 1]).set_index("rank")
    assert lead.at[1, "starved_frac"] >= 0.05 and lead.at[0, "starved_frac"] < 0.01
    assert found.iloc[0]["device_idle_frac"] == pytest.approx(lead.at[1, "starved_frac"])
    text = cli("report", str(tmp_path / "paused")).output
    assert f"rank 1: its GPU sat idle, waiting for its host, at {100 * lead.at[1, 'starved_frac']:.0f}%" in text

    absorbed = open_run(shutil.copytree(data / "gpu-dp2-pause-absorbed", tmp_path / "absorbed"))
    found, gone = straggler_module.detect(absorbed)
    assert found.empty
    assert list(gone["rank"]) == [1] and gone.iloc[0]["saving"] < StragglerConfig().min_host_saving
    result = analysis.report(absorbed)
    assert result["stragglers"] == []
    assert [(d["rank"], d["cause"]) for d in result["stragglers_dismissed"]] == [(1, "compute")]
    text = cli("report", str(tmp_path / "absorbed"))
    assert text.exit_code == 0 and "not named: rank 1" in text.output and "in its compute spans" in text.output


def test_a_pause_behind_one_timed_bucket_in_four_is_replayed_at_every_place_of_the_rotation(tmp_path: Path) -> None:
    """tests/data/gpu-dp2-pause-sampled: the same trainer and machine as gpu-dp2-pause, rank 0's
    host pausing 100 ms a step: 229 ms a step against 184 ms healthy. The collector timed the DP
    calls one bucket in four, a different one each step, so a step's replay frees rank 1's wait
    only where the bucket behind the pause was timed: one step in four. The median step's saving
    alone (0.7%) left the rank unnamed; each place of the rotation's median, averaged, names it."""
    from megascope.analysis.whatif import whatif

    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "gpu-dp2-pause-sampled", tmp_path / "run"))
    steps = list(range(1, 16))
    assert straggler_module.sample_period(run, 0, steps) == 4
    replay = whatif(run, ranks=[0], hosts=False)
    savings = np.array(replay["step_savings"])
    assert replay["steps_modeled"] == steps
    by_place = [float(np.median(savings[np.array(steps) % 4 == k])) for k in range(4)]
    assert max(by_place) > 0.1 and float(np.median(savings)) < StragglerConfig().min_host_saving
    assert straggler_module._replay_saving(run, 0) == pytest.approx(float(np.mean(by_place)))
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [0] and found.iloc[0]["cause"] == "host"


def test_a_gpu_host_pause_whose_device_never_ran_dry_reads_host(tmp_path: Path) -> None:
    """tests/data/gpu-dp2-pause-hidden: rank 1's host pauses 65 ms a step (193 ms a step against
    184 ms healthy); its device waited for its host at under 2% of its calls, so the device-idle
    check cannot tell. Its compute spans are no longer than its peer's; only its compute less the
    waits inside it stands out, and that is its peer's waiting inside the forward for the gathers
    it issued late. It read ``compute`` on that alone; now ``host``."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "gpu-dp2-pause-hidden", tmp_path / "run"))
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [1]
    row = found.iloc[0]
    assert row["cause"] == "host" and row["device_idle_frac"] < 0.05
    candidates, sizes = straggler_module._candidates(run, StragglerConfig())
    spans_read = straggler_module._outside_spans(
        run, pd.concat([candidates, straggler_module._attribute(candidates, sizes)], axis=1), sizes)
    one = spans_read[spans_read["rank"] == 1].iloc[0]
    assert one["cause"] == "compute" and one["excl_only"] == 1.0 and one["t_spans"] < 2.0


def test_a_rank_flagged_for_its_compute_is_dismissed_under_a_lower_replay_bar() -> None:
    # A host rank goes under 0.7% of the step; a compute rank (replayed on a data-parallel mesh timed
    # on GPUs) under 0.3%, never above the configured host bar; a rank not replayed (NaN) stays.
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    frame = pd.DataFrame({"cause": ["host", "compute", "compute", "host", "compute"]})
    saving = pd.Series([0.005, 0.005, 0.002, float("nan"), float("nan")])
    got = straggler_module._costless(frame, saving, StragglerConfig())
    assert list(got) == [True, False, True, False, False]
    strict = straggler_module._costless(frame, saving, StragglerConfig(min_host_saving=0.001))
    assert list(strict) == [False, False, False, False, False]


def test_a_slow_fsdp2_rank_is_named_by_its_compute_outside_its_calls(tmp_path: Path,
                                                                      cli: Callable[..., Result]) -> None:
    """tests/data/cpu-fsdp2-slow: an FSDP2 job on CPU (gloo, 3 ranks, 14 steps), rank 1 doing 1.5x
    its peers' compute. FSDP's spans hold its gathers and reductions, most of a gloo step: rank 1
    waits less inside them, its spans read no longer than its peers' and its own time 1.08x, its
    evidence under the bar. Its forward and backward less the calls inside them stand out.
    tests/data/cpu-fsdp2-healthy (4 ranks): a rank with evidence of the same order (z 3.0), its
    compute outside its calls no slower than its peers': nothing named."""
    straggler_module = importlib.import_module("megascope.analysis.stragglers")
    from megascope.analysis import _sql
    from megascope.analysis.base import prepare

    config = straggler_module.StragglerConfig()
    run = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-fsdp2-slow", tmp_path / "slow"))
    c, _ = straggler_module._candidates(run, config)
    c = c.set_index("rank")
    assert not c["flag"].fillna(False).astype(bool).any()  # the evidence alone misses it
    assert c["z"].idxmax() == 1 and c.at[1, "z"] >= straggler_module.OUTSIDE_CALLS_MIN_Z
    prepare(run.con)
    dp = _sql.query_df(run.con, "stragglers", "dp_compute", bar=config.min_named_slowdown).set_index("rank")
    assert dp.at[1, "ratio"] < straggler_module.DP_COMPUTE_BAR  # the spans do not stretch
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [1]
    row = found.iloc[0]
    assert row["cause"] == "compute" and row["slowdown"] >= straggler_module.OUTSIDE_CALLS_BAR
    assert row["outside_calls_ratio"] == row["slowdown"] and row["steps_slow_frac"] >= straggler_module.DP_SLOW_FRAC
    assert np.isnan(row["dp_compute_ratio"])
    text = cli("report", str(tmp_path / "slow")).output
    assert f"rank 1: forward and backward less the calls inside them {row['slowdown']:.2f}x its peers'" in text

    healthy = open_run(shutil.copytree(Path(__file__).parent / "data" / "cpu-fsdp2-healthy", tmp_path / "healthy"))
    c, _ = straggler_module._candidates(healthy, config)
    assert c["z"].astype(float).max() >= straggler_module.OUTSIDE_CALLS_MIN_Z
    assert analysis.stragglers(healthy).empty
