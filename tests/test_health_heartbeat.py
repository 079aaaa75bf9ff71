"""Heartbeat sampler: rows land in the store, survive SIGKILL, and the GPU/NIC/log probes read right."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import wait_until
from megascope.collectors.heartbeat import (
    HeartbeatSampler,
    decode_throttle_reasons,
    default_gpu_indices,
    nvml_index,
)

from megascope import layout
from megascope.schema import RunMeta, RunSource
from megascope.store import open_run


def _meta(run: Path, world: int = 1) -> Path:
    layout.write_run_meta(run, RunMeta(run_id="hb", source=RunSource.COLLECTOR, world_size=world))
    return run


def _metrics(run: Path) -> dict[str, int]:
    rows = open_run(run).con.execute("SELECT metric, count(*) FROM heartbeats GROUP BY metric").fetchall()
    return dict(rows)


def test_thread_writes_parts_the_store_reads(tmp_path: Path) -> None:
    run = _meta(tmp_path / "run")
    sampler = HeartbeatSampler(run, rank=0, host="node0", interval_s=0.05, flush_interval_s=0.1, nvml=False,
                               stats_fn=lambda: {"rows_dropped": 3, "name": "not a number"})
    sampler.start()
    wait_until(lambda: sampler.stats["samples"] >= 4 and sampler.stats["parts_written"] >= 2, timeout=30,
               message="four samples in two parts")
    sampler.stop()
    sampler.stop()  # twice is harmless
    stats = sampler.stats
    assert stats["parts_written"] >= 2 and stats["rows_written"] > 0 and stats["errors"] == 0
    r = open_run(run)
    assert r.problems == []
    beats, hosts, ranks = r.con.execute(
        "SELECT count(*), count(DISTINCT host), min(rank) FROM heartbeats WHERE metric = 'heartbeat'").fetchone()
    assert beats == stats["samples"] and beats >= 4
    assert (hosts, ranks) == (1, 0)
    metrics = _metrics(run)
    assert metrics["heartbeat_interval_s"] >= 1 and metrics["collector_rows_dropped"] == beats
    assert "collector_name" not in metrics  # only numbers become metrics
    if Path("/proc/meminfo").exists():  # Linux: host and process probes
        assert {"mem_used_bytes", "proc_rss_bytes", "load_1m"} <= set(metrics)
    files = list((run / "heartbeats" / "host=node0").iterdir())
    assert files and not [f for f in files if f.name.endswith(".tmp")]


def test_survives_sigkill_like_spans(tmp_path: Path) -> None:
    run = _meta(tmp_path / "run")
    script = textwrap.dedent(f"""
        import time
        from megascope.collectors.heartbeat import HeartbeatSampler
        HeartbeatSampler({str(run)!r}, rank=5, host="victim", interval_s=0.02, flush_interval_s=0.02,
                         nvml=False).start()
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        part_dir = run / "heartbeats" / "host=victim"
        wait_until(lambda: len(list(part_dir.glob("*.parquet"))) >= 5, timeout=60, message="five parts written")
    finally:
        os.kill(proc.pid, signal.SIGKILL)  # no atexit, no final flush
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    r = open_run(run)
    assert r.problems == []  # every finished part reads; a half-written one was never visible
    (beats,) = r.con.execute("SELECT count(*) FROM heartbeats WHERE rank = 5 AND metric = 'heartbeat'").fetchone()
    assert beats >= 5


class _FakeNvml:
    """pynvml's API over two made-up GPUs: gpu1 is hot, throttled and raised an XID."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):  # noqa: N801 (pynvml's names)
        pass

    class NVMLError_Timeout(NVMLError):  # noqa: N801
        pass

    NVML_TEMPERATURE_GPU = 0
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
    NVML_CLOCK_SM = 1
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    nvmlEventTypeXidCriticalError = 8

    def __init__(self) -> None:
        self.handles = [SimpleNamespace(i=0), SimpleNamespace(i=1)]
        self.xids = [SimpleNamespace(device=self.handles[1], eventData=79)]
        self.remap_calls = 0

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlEventSetFree(self, s: Any) -> None: ...
    def nvmlDeviceGetCount(self) -> int: return 2
    def nvmlDeviceGetHandleByIndex(self, i: int) -> Any: return self.handles[i]
    def nvmlEventSetCreate(self) -> object: return object()
    def nvmlDeviceRegisterEvents(self, h: Any, kind: int, s: Any) -> None: ...
    def nvmlDeviceGetUtilizationRates(self, h: Any) -> Any: return SimpleNamespace(gpu=97, memory=40)
    def nvmlDeviceGetMemoryInfo(self, h: Any) -> Any: return SimpleNamespace(used=70e9, total=80e9)
    def nvmlDeviceGetTemperature(self, h: Any, k: int) -> int: return 90 if h.i == 1 else 60
    def nvmlDeviceGetTemperatureThreshold(self, h: Any, k: int) -> int: return 87
    def nvmlDeviceGetPowerUsage(self, h: Any) -> int: return 650_000
    def nvmlDeviceGetEnforcedPowerLimit(self, h: Any) -> int: return 700_000
    def nvmlDeviceGetClockInfo(self, h: Any, k: int) -> int: return 1200 if h.i == 1 else 1980
    def nvmlDeviceGetMaxClockInfo(self, h: Any, k: int) -> int: return 1980
    def nvmlDeviceGetTotalEccErrors(self, h: Any, kind: int, counter: int) -> int: return 0
    def nvmlDeviceGetCurrentClocksEventReasons(self, h: Any) -> int: return 0x4 | (0x40 if h.i == 1 else 0)

    def nvmlDeviceGetRemappedRows(self, h: Any) -> Any:
        self.remap_calls += 1
        raise self.NVMLError_NotSupported()

    def nvmlEventSetWait_v2(self, s: Any, timeout_ms: int) -> Any:
        if not self.xids:
            raise self.NVMLError_Timeout()
        return self.xids.pop()


def test_gpu_probe_reads_nvml_and_the_findings_see_it(tmp_path: Path) -> None:
    from megascope.health import health_findings

    run = _meta(tmp_path / "run")
    nvml = _FakeNvml()
    sampler = HeartbeatSampler(run, rank=None, host="node0", nvml=nvml, host_wide=False)
    sampler.sample_once()
    sampler.sample_once()
    sampler.flush()
    assert nvml.remap_calls == 2  # unsupported queries are asked once per GPU, then skipped
    con = open_run(run).con
    got = dict(con.execute(
        "SELECT device || ' ' || metric, max(value) FROM heartbeats WHERE device LIKE 'gpu%' GROUP BY ALL").fetchall())
    assert got["gpu1 gpu_temp_c"] == 90 and got["gpu0 gpu_power_w"] == pytest.approx(650.0)
    assert got["gpu1 gpu_xid"] == 79 and "gpu0 gpu_xid" not in got
    assert got["gpu0 gpu_mem_total_bytes"] == 80e9
    (text,) = con.execute("SELECT any_value(text) FROM heartbeats WHERE device = 'gpu1' "
                          "AND metric = 'gpu_throttle_reasons'").fetchone()
    assert text == "sw_power_cap,hw_thermal_slowdown"
    findings = health_findings(con)
    assert set(zip(findings["device"], findings["finding"], strict=True)) == {
        ("gpu1", "xid"), ("gpu1", "throttled"), ("gpu1", "high_temp")}


def test_nic_and_infiniband_rates_from_sysfs(tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    eth = sys_root / "class/net/eth0/statistics"
    port = sys_root / "class/infiniband/mlx5_0/ports/1"
    eth.mkdir(parents=True)
    (port / "counters").mkdir(parents=True)
    (sys_root / "class/net/lo/statistics").mkdir(parents=True)

    def counters(rx: int, words: int, downed: int, state: str) -> None:
        (eth / "rx_bytes").write_text(f"{rx}\n")
        (eth / "tx_bytes").write_text("0\n")
        (port / "counters/port_rcv_data").write_text(f"{words}\n")
        (port / "counters/port_xmit_data").write_text("0\n")
        (port / "counters/link_downed").write_text(f"{downed}\n")
        (port / "state").write_text(f"{state}\n")

    run = _meta(tmp_path / "run")
    sampler = HeartbeatSampler(run, rank=None, host="node0", nvml=False, sys_root=sys_root,
                               proc_root=tmp_path / "no-proc")
    counters(1_000, 1_000, 0, "4: ACTIVE")
    sampler.sample_once()
    time.sleep(0.05)
    counters(1_000 + 4_000_000, 1_000 + 1_000_000, 1, "1: DOWN")  # IB counts 4-byte words
    sampler.sample_once()
    sampler.flush()
    rows = {(d, m): v for d, m, v in open_run(run).con.execute(
        "SELECT device, metric, max(value) FROM heartbeats WHERE device IS NOT NULL GROUP BY ALL").fetchall()}
    assert rows[("mlx5_0:1", "ib_rx_bytes_per_s")] == pytest.approx(rows[("eth0", "nic_rx_bytes_per_s")], rel=0.2)
    assert rows[("eth0", "nic_rx_bytes_per_s")] > 0 and rows[("eth0", "nic_tx_bytes_per_s")] == 0
    assert rows[("mlx5_0:1", "ib_link_downed")] == 1
    assert not any(d == "lo" for d, _ in rows)
    (active,) = open_run(run).con.execute(
        "SELECT min(value) FROM heartbeats WHERE metric = 'ib_port_active'").fetchone()
    assert active == 0


def test_log_tail_reads_new_complete_lines_and_follows_rotation(tmp_path: Path) -> None:
    log_path = tmp_path / "train.log"
    log_path.write_text("old 1\nold 2\n")
    run = _meta(tmp_path / "run")
    sampler = HeartbeatSampler(run, rank=0, host="n", nvml=False, log_path=log_path, log_lines=3, host_wide=False)

    def logged() -> list[str]:
        sampler.sample_once()
        sampler.flush()
        return [t for (t,) in open_run(run).con.execute(
            "SELECT text FROM heartbeats WHERE metric = 'log' ORDER BY time_ns, text").fetchall()]

    assert logged() == ["old 1", "old 2"]
    with open(log_path, "a") as f:
        f.write("a\nb\nc\nd\nNCCL WARN half")
    assert logged()[2:] == ["b", "c", "d"]  # only the newest log_lines; the partial line waits
    with open(log_path, "a") as f:
        f.write(" a line\n")
    assert logged()[-1] == "NCCL WARN half a line"
    log_path.write_text("fresh\n")  # rotated: smaller than what was read
    assert logged()[-1] == "fresh"


def test_failing_probe_is_counted_not_raised(tmp_path: Path) -> None:
    run = _meta(tmp_path / "run")

    def broken() -> dict[str, float]:
        raise RuntimeError("collector gone")

    sampler = HeartbeatSampler(run, rank=0, host="n", nvml=False, stats_fn=broken, host_wide=False)
    sampler.sample_once()
    sampler.flush()
    assert sampler.stats["errors"] == 1
    assert _metrics(run)["sampler_errors"] == 1


def test_unwritable_run_dir_keeps_rows_bounded(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    sampler = HeartbeatSampler(blocker, rank=0, host="n", nvml=False, host_wide=False, max_buffered_rows=10)
    for _ in range(20):
        sampler.sample_once()
        assert sampler.flush() is None
    stats = sampler.stats
    assert stats["rows_written"] == 0 and stats["rows_dropped"] > 0 and stats["errors"] >= 20


def test_defaults_and_decoding() -> None:
    assert default_gpu_indices(None, {"LOCAL_RANK": "1"}) is None
    assert default_gpu_indices(3, {}) is None
    assert default_gpu_indices(3, {"LOCAL_RANK": "1"}) == [1]
    assert default_gpu_indices(3, {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,5"}) == [5]
    assert decode_throttle_reasons(0x48) == "hw_slowdown,hw_thermal_slowdown"
    assert decode_throttle_reasons(0x10000) == "0x10000"
    with pytest.raises(ValueError, match="interval_s"):
        HeartbeatSampler("x", rank=0, interval_s=0)


def test_torch_memory_is_read_for_the_jobs_device_not_the_sampling_threads(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """CUDA's current device is a per-thread setting: the sampler's thread reads device 0 whatever
    the job set, so a rank on cuda:2 must name its device to the sampler (the collector does)."""
    allocated = {0: 0.0, 2: 7.0e9}
    cuda = SimpleNamespace(is_initialized=lambda: True, current_device=lambda: 0,
                           memory_allocated=lambda dev: allocated[dev], memory_reserved=lambda dev: 2 * allocated[dev])
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))

    def torch_rows(sampler: HeartbeatSampler) -> dict[str, tuple[str | None, float | None]]:
        sampler.sample_once()
        return {r[2]: (r[1], r[3]) for r in sampler._buffer if r[2].startswith("torch_mem")}

    run = _meta(tmp_path / "run")
    named = HeartbeatSampler(run, rank=2, interval_s=1.0, nvml=False, host_wide=False, cuda_device=2)
    assert torch_rows(named) == {"torch_mem_allocated_bytes": ("gpu2", 7.0e9),
                                 "torch_mem_reserved_bytes": ("gpu2", 1.4e10)}
    unnamed = HeartbeatSampler(run, rank=2, interval_s=1.0, nvml=False, host_wide=False)
    assert torch_rows(unnamed) == {"torch_mem_allocated_bytes": ("gpu0", 0.0),
                                   "torch_mem_reserved_bytes": ("gpu0", 0.0)}


def test_a_rank_watches_the_gpu_of_its_cuda_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A rank started without LOCAL_RANK (the bundled trainer's, a plain multiprocessing job) watches
    the GPU its collector times, through CUDA_VISIBLE_DEVICES, not every GPU of the host."""
    assert nvml_index(2, {}) == [2]
    assert nvml_index(1, {"CUDA_VISIBLE_DEVICES": "4,5"}) == [5]
    assert nvml_index(2, {"CUDA_VISIBLE_DEVICES": "4,5"}) is None  # not a visible device
    assert nvml_index(0, {"CUDA_VISIBLE_DEVICES": "GPU-8f2e"}) is None  # UUIDs: not mapped here
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    run = _meta(tmp_path / "run")
    assert HeartbeatSampler(run, rank=1, nvml=False, cuda_device=1)._gpu_indices == [5]
    assert HeartbeatSampler(run, rank=1, nvml=False)._gpu_indices is None  # all of them, as before
    assert HeartbeatSampler(run, rank=1, nvml=False, cuda_device=1, gpu_indices=[0, 1])._gpu_indices == [0, 1]
