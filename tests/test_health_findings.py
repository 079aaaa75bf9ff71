"""health_findings: each problem is named on the right rank; a healthy run yields none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pytest
from conftest import wait_until
from megascope.collectors.heartbeat import HeartbeatSampler

from megascope import layout
from megascope.errors import ConfigError
from megascope.health import health_findings
from megascope.schema import DIAGNOSTICS, HEARTBEATS, RANKS, RunMeta, RunSource
from megascope.store import open_run

T0 = 1_800_000_000_000_000_000
S = 1_000_000_000


def _run_dir(tmp_path: Path, world: int = 4, ranks_per_host: int = 2) -> Path:
    run = tmp_path / "run"
    layout.write_run_meta(run, RunMeta(run_id="t", source=RunSource.COLLECTOR, world_size=world))
    for r in range(world):
        row = {"rank": r, "host": f"node{r // ranks_per_host}", "local_rank": r % ranks_per_host, "pid": 100 + r,
               "device": f"cuda:{r % ranks_per_host}", "device_name": "GPU", "coords": {"pp": 0, "dp": r, "tp": 0},
               "started_at_ns": T0}
        layout.write_part(run, "ranks", pa.Table.from_pylist([row], schema=RANKS), rank=r)
    return run


def _beats(run: Path, host: str, rank: int | None, rows: list[tuple[int, str | None, str, float | None, str | None]]) -> None:
    table = pa.Table.from_pylist(
        [{"host": host, "rank": rank, "pid": 1, "time_ns": t, "device": d, "metric": m, "value": v, "text": x}
         for t, d, m, v, x in rows], schema=HEARTBEATS)
    layout.write_part(run, "heartbeats", table, host=host)


def _healthy(rank: int, seconds: int = 60, period: float = 5.0) -> list[tuple[int, str | None, str, float | None, str | None]]:
    rows: list[tuple[int, str | None, str, float | None, str | None]] = [
        (T0, None, "heartbeat_interval_s", period, None), (T0, None, "heartbeat_flush_s", period, None)]
    for i, t in enumerate(range(0, seconds + 1, int(period))):
        ts = T0 + t * S
        rows += [(ts, None, "heartbeat", float(i), None),
                 (ts, f"gpu{rank % 2}", "gpu_temp_c", 60.0 + rank, None),
                 (ts, f"gpu{rank % 2}", "gpu_temp_slowdown_c", 87.0, None),
                 (ts, f"gpu{rank % 2}", "gpu_throttle_reasons", 4.0, "sw_power_cap"),
                 (ts, f"gpu{rank % 2}", "gpu_sm_clock_mhz", 1980.0, None),
                 (ts, f"gpu{rank % 2}", "gpu_sm_clock_max_mhz", 1980.0, None),
                 (ts, None, "collector_rows_dropped", 0.0, None)]
    return rows


def _findings(run: Path, **kw: Any) -> list[tuple[int | None, str, str]]:
    df = health_findings(open_run(run).con, **kw)
    return [(None if pd.isna(r) else int(r), f, d) for r, f, d in zip(df["rank"], df["finding"], df["detail"], strict=True)]


def test_healthy_run_has_no_findings(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    for r in range(4):
        _beats(run, f"node{r // 2}", r, _healthy(r))
    df = health_findings(open_run(run).con)
    assert list(df.columns[:4]) == ["rank", "host", "finding", "detail"]
    assert df.empty


def test_throttle_heat_xid_ecc_ib_and_drops_are_named_on_their_rank(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    for r in (0, 1, 3):
        _beats(run, f"node{r // 2}", r, _healthy(r))
    bad = _healthy(2)
    bad += [(T0 + 22 * S, "gpu0", "gpu_throttle_reasons", float(0x4 | 0x40), "sw_power_cap,hw_thermal_slowdown"),
            (T0 + 22 * S, "gpu0", "gpu_sm_clock_mhz", 900.0, None),
            (T0 + 21 * S, "gpu0", "gpu_temp_c", 86.0, None),
            (T0 + 22 * S, "gpu0", "gpu_xid", 79.0, "XID 79"),
            (T0 + 22 * S, "gpu0", "gpu_ecc_uncorrected", 2.0, None),
            (T0 + 30 * S, None, "collector_rows_dropped", 17.0, None)]
    _beats(run, "node1", 2, bad)
    # A host-wide sampler (rank null) on node0 sees an IB port flap.
    _beats(run, "node0", None, [(T0, None, "heartbeat_interval_s", 5.0, None), (T0, None, "heartbeat", 0.0, None),
                                (T0 + 60 * S, None, "heartbeat", 12.0, None),
                                (T0, "mlx5_0:1", "ib_link_downed", 3.0, None),
                                (T0 + 30 * S, "mlx5_0:1", "ib_link_downed", 5.0, None),
                                (T0 + 30 * S, "mlx5_0:1", "ib_port_active", 0.0, "1: DOWN")])
    df = health_findings(open_run(run).con)
    by = {(f, r): d for r, f, d in _findings(run)}
    assert set(by) == {("xid", 2), ("ecc", 2), ("throttled", 2), ("high_temp", 2), ("collector_drops", 2),
                       ("ib_link", None)}
    assert "hw_thermal_slowdown" in by[("throttled", 2)] and "900 of 1980 MHz" in by[("throttled", 2)]
    assert "XID 79" in by[("xid", 2)]
    assert "86 C" in by[("high_temp", 2)]
    assert "2 link-down events" in by[("ib_link", None)] and "DOWN" in by[("ib_link", None)]
    assert list(df["finding"])[0] == "xid"  # most severe first
    assert (df[df["finding"] == "ib_link"]["host"] == "node0").all()


def test_host_wide_gpu_rows_map_to_the_rank_on_that_gpu(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    _beats(run, "node1", None, [(T0, None, "heartbeat_interval_s", 5.0, None), (T0, None, "heartbeat", 0.0, None),
                                (T0, "gpu1", "gpu_xid", 48.0, "XID 48")])
    df = health_findings(open_run(run).con)
    xid = df[df["finding"] == "xid"]
    assert list(xid["rank"]) == [3] and list(xid["host"]) == ["node1"]


def test_silent_rank_is_flagged_from_data(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    for r in (0, 2, 3):
        _beats(run, f"node{r // 2}", r, _healthy(r, seconds=120))
    _beats(run, "node0", 1, _healthy(1, seconds=40))  # stops 80 s (16 periods) before the others
    silent = [(r, d) for r, f, d in _findings(run) if f == "silent"]
    assert [r for r, _ in silent] == [1]
    assert "80.0 s" in silent[0][1]
    # Judged against a later "now" (a live run), everyone is overdue.
    late = [r for r, f, _ in _findings(run, now_ns=T0 + 600 * S) if f == "silent"]
    assert sorted(r for r in late if r is not None) == [0, 1, 2, 3] and len(late) == 4


def test_rank_that_never_sent_a_heartbeat_is_silent(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    for r in (0, 1, 2):
        _beats(run, f"node{r // 2}", r, _healthy(r))
    assert [(r, f) for r, f, _ in _findings(run)] == [(3, "silent")]


def test_diagnostics_failures_and_outliers_join_in(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    rows = [{"time_ns": T0, "host": "node0", "rank": r, "test": "gemm", "group": None, "value": v,
             "unit": "TFLOP/s", "ok": True, "outlier": r == 1, "detail": None} for r, v in enumerate([5.0, 1.0, 5.1, 4.9])]
    rows.append({"time_ns": T0, "host": "node1", "rank": 3, "test": "allreduce", "group": "dp:0", "value": 1.0,
                 "unit": "GB/s", "ok": False, "outlier": False, "detail": "wrong sum at element 7"})
    layout.write_part(run, "diagnostics", pa.Table.from_pylist(rows, schema=DIAGNOSTICS))
    found = _findings(run)
    assert (3, "diagnose_failed", "allreduce dp:0: wrong sum at element 7") in found
    assert any(r == 1 and f == "diagnose_slow" and "TFLOP/s" in d for r, f, d in found)
    assert len(found) == 2


def test_sampler_made_silent_is_flagged(tmp_path: Path) -> None:
    """Real samplers: one stops early (its rank hung or died), the other keeps beating."""
    run = _run_dir(tmp_path, world=2)
    alive = HeartbeatSampler(run, rank=0, host="node0", interval_s=0.05, flush_interval_s=0.05, nvml=False).start()
    dead = HeartbeatSampler(run, rank=1, host="node0", interval_s=0.05, flush_interval_s=0.05, nvml=False,
                            host_wide=False).start()
    wait_until(lambda: dead.stats["samples"] >= 3, timeout=30, message="the second sampler beat")
    dead.stop()
    # Silent: no heartbeat for 3 periods (0.15 s) before the newest one of the run. The live
    # sampler's slots are a period apart at least and none starts before the previous sample ended,
    # so its 12th sample from here (the 1st may have begun before the stop) began 10 periods or more
    # after the other's last beat.
    beats = alive.stats["samples"]
    wait_until(lambda: alive.stats["samples"] >= beats + 12, timeout=30, message="the live sampler beat on")
    alive.stop()
    found = [(r, f) for r, f, _ in _findings(run)]
    assert (1, "silent") in found
    assert (0, "silent") not in found


@pytest.mark.parametrize("silent_after", [0.0, -1.0])
def test_bad_threshold_is_a_config_error(tmp_path: Path, silent_after: float) -> None:
    run = _run_dir(tmp_path, world=1)
    _beats(run, "node0", 0, _healthy(0, seconds=10))
    with pytest.raises(ConfigError, match="silent_after"):
        health_findings(open_run(run).con, silent_after=silent_after)


def test_the_health_graph_draws_a_line_per_gpu_and_per_host(tmp_path: Path) -> None:
    """A device's metric gets a line per host's device (a slow GPU of a host stands out, not an
    average of its host's GPUs); a host's metric a line per host; past max_hosts, the extremes."""
    from megascope.dashboard.queries import heartbeat_series

    run = _run_dir(tmp_path)
    for host, clocks in (("node0", (1980.0, 990.0)), ("node1", (1980.0, 1975.0))):
        _beats(run, host, None, [(T0 + t * S, f"gpu{g}", "gpu_sm_clock_mhz", c, None)
                                 for t in range(0, 30, 5) for g, c in enumerate(clocks)]
               + [(T0 + t * S, None, "load_1m", 2.0 if host == "node0" else 4.0, None) for t in range(0, 30, 5)])
    con = open_run(run).con
    clocks = heartbeat_series(con, "gpu_sm_clock_mhz").groupby("host")["value"].mean().to_dict()
    assert clocks == {"node0 gpu0": 1980.0, "node0 gpu1": 990.0, "node1 gpu0": 1980.0, "node1 gpu1": 1975.0}
    assert heartbeat_series(con, "load_1m").groupby("host")["value"].mean().to_dict() == {"node0": 2.0, "node1": 4.0}
    extremes = set(heartbeat_series(con, "gpu_sm_clock_mhz", max_hosts=2)["host"])
    assert extremes == {"node0 gpu1", "node0 gpu0"}  # lowest mean; highest (a tie of 1980, by name)
