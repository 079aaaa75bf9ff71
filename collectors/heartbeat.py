"""Heartbeat sampler: host, process, GPU and NIC health of one rank (or one host), every few seconds.

Role in the data flow: runs inside the training job next to the collector, on its own daemon
thread, and writes the ``heartbeats`` table (``RUN/heartbeats/host=NAME/part-*.parquet``) through
:func:`megascope.layout.write_part`, so a part is either whole or absent and a killed job loses at
most one flush interval. ``megascope.health.health_findings`` reads it back: throttled clocks, high
temperature, XID/ECC errors, and ranks whose heartbeats stopped (silence is data: every sample
writes a ``heartbeat`` row, and the sampler's period is written too, so a reader knows when a rank
is overdue).

What one sample holds (long form, one row per metric; names in ``schema.HeartbeatMetric``):

* always: the heartbeat itself, this process's CPU and resident memory, the caching allocator's
  memory when torch already uses CUDA, new lines of ``log_path``, ``stats_fn()`` counters;
* host-wide (one sampler per host does this, by default local rank 0): CPU, load, memory, NIC
  byte rates (``/sys/class/net``) and InfiniBand port rates, state and link-down counts
  (``/sys/class/infiniband``);
* per GPU, through NVML (nvidia-ml-py) when present: utilization, memory, temperature and its
  slowdown threshold, power and limit, SM clock and its maximum, clock-event (throttle) reasons,
  volatile ECC counts, pending row remaps, and critical XID events.

A probe that fails is counted (``sampler_errors``) and skipped; nothing here raises into the job.
Imports only the standard library, pyarrow and ``megascope.schema``/``megascope.layout``
(torch and pynvml only if they are importable).

Example::

    from megascope.collectors.heartbeat import HeartbeatSampler
    sampler = HeartbeatSampler("runs/job1", rank=3, host="node07", interval_s=5.0,
                               log_path="train.log", stats_fn=lambda: collector.stats).start()
    ...
    sampler.stop()          # takes a last sample and flushes
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from megascope import layout
from megascope.schema import COLLECTOR_METRIC_PREFIX, HEARTBEATS
from megascope.schema import HeartbeatMetric as M

log = logging.getLogger(__name__)

Row = tuple[str | None, str, float | None, str | None]  # (device, metric, value, text)

# NVML clock-event reason bits (nvml.h, nvmlClocksEventReason*): stable across driver versions.
THROTTLE_REASON_NAMES = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}

_LOG_LINE_MAX_CHARS = 1000
_LOG_READ_MAX_BYTES = 64 * 1024


def decode_throttle_reasons(mask: int) -> str:
    """``0x48`` -> ``"hw_slowdown,hw_thermal_slowdown"`` (unknown bits as hex)."""
    names = [name for bit, name in THROTTLE_REASON_NAMES.items() if mask & bit]
    unknown = mask & ~sum(THROTTLE_REASON_NAMES)
    if unknown:
        names.append(hex(unknown))
    return ",".join(names)


# ------------------------------------------------------------------------------------------------
# Probes: each returns rows and keeps what it needs for rates between samples.
# ------------------------------------------------------------------------------------------------


class _HostProbe:
    """Host CPU, load and memory from /proc (Linux); nothing elsewhere."""

    def __init__(self, proc_root: Path) -> None:
        self.proc = proc_root
        self._last_cpu: tuple[int, int] | None = None

    def sample(self) -> list[Row]:
        rows: list[Row] = []
        stat = self.proc / "stat"
        if stat.exists():
            fields = [int(v) for v in stat.read_text().splitlines()[0].split()[1:]]
            idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
            total = sum(fields[:8])  # guest time is already inside user/nice
            if self._last_cpu is not None and total > self._last_cpu[1]:
                busy = 1.0 - (idle - self._last_cpu[0]) / (total - self._last_cpu[1])
                rows.append((None, M.CPU_UTIL_PCT, round(100.0 * busy, 2), None))
            self._last_cpu = (idle, total)
        loadavg = self.proc / "loadavg"
        if loadavg.exists():
            rows.append((None, M.LOAD_1M, float(loadavg.read_text().split()[0]), None))
        meminfo = self.proc / "meminfo"
        if meminfo.exists():
            kib = {}
            for line in meminfo.read_text().splitlines():
                key, _, rest = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    kib[key] = int(rest.split()[0])
            if len(kib) == 2:
                rows.append((None, M.MEM_USED_BYTES, float((kib["MemTotal"] - kib["MemAvailable"]) * 1024), None))
                rows.append((None, M.MEM_AVAILABLE_BYTES, float(kib["MemAvailable"] * 1024), None))
        return rows


class _ProcessProbe:
    """This process: CPU (100 = one core) and resident memory; torch allocator if CUDA is in use.

    ``cuda_device``: the job's CUDA device index. The sampler's own thread cannot ask CUDA for it:
    the current device is a per-thread setting, and a thread the job did not set reads device 0.
    Without it, the current device of the sampling thread is read (a sampler made outside a job).
    """

    def __init__(self, proc_root: Path, cuda_device: int | None = None) -> None:
        self.statm = proc_root / "self" / "statm"
        self.cuda_device = cuda_device
        self._last: tuple[float, float] | None = None

    def sample(self) -> list[Row]:
        rows: list[Row] = []
        times = os.times()
        now = (times.user + times.system, time.monotonic())
        if self._last is not None and now[1] > self._last[1]:
            pct = 100.0 * (now[0] - self._last[0]) / (now[1] - self._last[1])
            rows.append((None, M.PROC_CPU_PCT, round(pct, 2), None))
        self._last = now
        if self.statm.exists():
            rss_pages = int(self.statm.read_text().split()[1])
            rows.append((None, M.PROC_RSS_BYTES, float(rss_pages * os.sysconf("SC_PAGE_SIZE")), None))
        # Only look at torch if the job imported it and already uses CUDA: never initialize it here.
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            dev = self.cuda_device if self.cuda_device is not None else torch.cuda.current_device()
            rows.append((f"gpu{dev}", M.TORCH_MEM_ALLOCATED_BYTES, float(torch.cuda.memory_allocated(dev)), None))
            rows.append((f"gpu{dev}", M.TORCH_MEM_RESERVED_BYTES, float(torch.cuda.memory_reserved(dev)), None))
        return rows


class _NetProbe:
    """Byte rates of network interfaces and InfiniBand ports from sysfs counters."""

    def __init__(self, sys_root: Path) -> None:
        self.net = sys_root / "class" / "net"
        self.ib = sys_root / "class" / "infiniband"
        self._last: dict[tuple[str, str], tuple[int, float]] = {}

    def _rate(self, key: tuple[str, str], counter: int, now: float) -> float | None:
        prev = self._last.get(key)
        self._last[key] = (counter, now)
        if prev is None or now <= prev[1] or counter < prev[0]:  # first sight, or a counter reset
            return None
        return (counter - prev[0]) / (now - prev[1])

    @staticmethod
    def _read_int(path: Path) -> int | None:
        try:
            return int(path.read_text().strip())
        except (OSError, ValueError):
            return None

    def sample(self) -> list[Row]:
        rows: list[Row] = []
        now = time.monotonic()
        if self.net.is_dir():
            for iface in sorted(p.name for p in self.net.iterdir()):
                if iface == "lo":
                    continue
                for direction, metric in (("rx", M.NIC_RX_BYTES_PER_S), ("tx", M.NIC_TX_BYTES_PER_S)):
                    counter = self._read_int(self.net / iface / "statistics" / f"{direction}_bytes")
                    if counter is not None:
                        rate = self._rate((iface, direction), counter, now)
                        if rate is not None:
                            rows.append((iface, metric, rate, None))
        if self.ib.is_dir():
            for hca in sorted(self.ib.iterdir()):
                ports = hca / "ports"
                if not ports.is_dir():
                    continue
                for port in sorted(ports.iterdir()):
                    device = f"{hca.name}:{port.name}"
                    rows.extend(self._ib_port(device, port, now))
        return rows

    def _ib_port(self, device: str, port: Path, now: float) -> list[Row]:
        rows: list[Row] = []
        counters = port / "counters"
        # port_*_data counts 4-byte words (InfiniBand spec), hence the factor.
        for name, metric in (("port_rcv_data", M.IB_RX_BYTES_PER_S), ("port_xmit_data", M.IB_TX_BYTES_PER_S)):
            words = self._read_int(counters / name)
            if words is not None:
                rate = self._rate((device, name), words * 4, now)
                if rate is not None:
                    rows.append((device, metric, rate, None))
        downed = self._read_int(counters / "link_downed")
        if downed is not None:
            rows.append((device, M.IB_LINK_DOWNED, float(downed), None))
        try:
            state = (port / "state").read_text().strip()  # e.g. "4: ACTIVE"
        except OSError:
            state = ""
        if state:
            rows.append((device, M.IB_PORT_ACTIVE, 1.0 if "ACTIVE" in state else 0.0, state))
        return rows


class _NvmlProbe:
    """Per-GPU health through NVML. ``nvml`` is the pynvml module (or a stand-in with its API)."""

    def __init__(self, nvml: Any, indices: Sequence[int] | None) -> None:
        self.nvml = nvml
        nvml.nvmlInit()
        count = nvml.nvmlDeviceGetCount()
        self.indices = [i for i in (range(count) if indices is None else indices) if 0 <= i < count]
        self.handles = {i: nvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices}
        self.unsupported: set[tuple[int, str]] = set()
        self.events: Any = None
        try:
            self.events = nvml.nvmlEventSetCreate()
            for handle in self.handles.values():
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, self.events)
        except nvml.NVMLError as exc:
            log.info("NVML XID events unavailable: %s", exc)
            self.events = None

    def close(self) -> None:
        try:
            if self.events is not None:
                self.nvml.nvmlEventSetFree(self.events)
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass

    def _get(self, index: int, metric: str, fn: Callable[[Any], Any]) -> Any:
        """Call one NVML query; a query the card does not support is not asked again."""
        if (index, metric) in self.unsupported:
            return None
        try:
            return fn(self.handles[index])
        except self.nvml.NVMLError_NotSupported:
            self.unsupported.add((index, metric))
            return None

    def sample(self) -> list[Row]:
        nv = self.nvml
        # (metric, query, scale to the metric's unit)
        simple: list[tuple[str, Callable[[Any], Any], float]] = [
            (M.GPU_TEMP_C, lambda h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU), 1.0),
            (M.GPU_TEMP_SLOWDOWN_C,
             lambda h: nv.nvmlDeviceGetTemperatureThreshold(h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN), 1.0),
            (M.GPU_POWER_W, nv.nvmlDeviceGetPowerUsage, 1e-3),  # NVML reports mW
            (M.GPU_POWER_LIMIT_W, nv.nvmlDeviceGetEnforcedPowerLimit, 1e-3),
            (M.GPU_SM_CLOCK_MHZ, lambda h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), 1.0),
            (M.GPU_SM_CLOCK_MAX_MHZ, lambda h: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM), 1.0),
            (M.GPU_ECC_CORRECTED, lambda h: nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_VOLATILE_ECC), 1.0),
            (M.GPU_ECC_UNCORRECTED, lambda h: nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC), 1.0),
        ]
        rows: list[Row] = []
        for i in self.handles:
            dev = f"gpu{i}"
            util = self._get(i, M.GPU_UTIL_PCT, nv.nvmlDeviceGetUtilizationRates)
            if util is not None:
                rows.append((dev, M.GPU_UTIL_PCT, float(util.gpu), None))
            mem = self._get(i, M.GPU_MEM_USED_BYTES, nv.nvmlDeviceGetMemoryInfo)
            if mem is not None:
                rows.append((dev, M.GPU_MEM_USED_BYTES, float(mem.used), None))
                rows.append((dev, M.GPU_MEM_TOTAL_BYTES, float(mem.total), None))
            for metric, fn, scale in simple:
                value = self._get(i, metric, fn)
                if value is not None:
                    rows.append((dev, metric, float(value) * scale, None))
            reasons = self._get(i, M.GPU_THROTTLE_REASONS, self._throttle_reasons)
            if reasons is not None:
                rows.append((dev, M.GPU_THROTTLE_REASONS, float(reasons), decode_throttle_reasons(int(reasons))))
            remap = self._get(i, M.GPU_REMAPPED_ROWS_PENDING, nv.nvmlDeviceGetRemappedRows)
            if remap is not None:  # (corrected rows, uncorrected rows, pending, failure occurred)
                rows.append((dev, M.GPU_REMAPPED_ROWS_PENDING, float(bool(remap[2])),
                             "row remapping failed" if remap[3] else None))
        rows.extend(self._xid_events())
        return rows

    def _throttle_reasons(self, handle: Any) -> int:
        nv = self.nvml
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(fn(handle))

    def _xid_events(self) -> list[Row]:
        if self.events is None:
            return []
        nv = self.nvml
        rows: list[Row] = []
        index_of = {id(h): i for i, h in self.handles.items()}
        for _ in range(64):  # drain what is queued, never wait
            try:
                event = nv.nvmlEventSetWait_v2(self.events, 0)
            except nv.NVMLError_Timeout:
                break
            index = index_of.get(id(event.device))
            dev = f"gpu{index}" if index is not None else None
            rows.append((dev, M.GPU_XID, float(event.eventData), f"XID {event.eventData}"))
        return rows


def _load_nvml() -> Any:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    return pynvml


def _visible_devices(env: Mapping[str, str]) -> list[str]:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs); empty where it is unset."""
    return [v.strip() for v in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]


def default_gpu_indices(rank: int | None, env: Mapping[str, str] = os.environ) -> list[int] | None:
    """NVML indices a sampler watches: all for a host-wide sampler, else the rank's own GPU.

    The rank's GPU is ``LOCAL_RANK`` mapped through ``CUDA_VISIBLE_DEVICES`` when that lists indices
    (NVML ignores ``CUDA_VISIBLE_DEVICES``).
    """
    if rank is None or "LOCAL_RANK" not in env:
        return None
    local = int(env["LOCAL_RANK"])
    visible = _visible_devices(env)
    if visible and all(v.isdigit() for v in visible):
        return [int(visible[local % len(visible)])]
    return [local]


def nvml_index(cuda_device: int, env: Mapping[str, str] = os.environ) -> list[int] | None:
    """The NVML index of the job's CUDA device ``cuda_device``: mapped through
    ``CUDA_VISIBLE_DEVICES`` when that lists indices; None when it lists UUIDs (not mapped here)."""
    visible = _visible_devices(env)
    if not visible:
        return [cuda_device]
    if all(v.isdigit() for v in visible) and cuda_device < len(visible):
        return [int(visible[cuda_device])]
    return None


# ------------------------------------------------------------------------------------------------
# The sampler
# ------------------------------------------------------------------------------------------------


class HeartbeatSampler:
    """Samples every ``interval_s`` on a daemon thread; writes a part every ``flush_interval_s``.

    ``rank=None`` makes a host-wide sampler. ``host_wide`` (default: rank is None or the process is
    local rank 0) adds host CPU, memory and NIC rows, so a host of eight ranks reports them once.
    ``gpu_indices`` are NVML indices (default: the GPU of ``cuda_device`` where that is given, see
    :func:`nvml_index`, else :func:`default_gpu_indices`); ``nvml`` replaces the
    pynvml module (``False`` turns NVML off). ``proc_root``/``sys_root`` point the probes at another
    /proc and /sys. ``run_id``: run.json's run id, stamped into every part (see
    :mod:`megascope.collectors.runid`). ``cuda_device``: the job's CUDA device index, whose torch
    allocator is sampled (default: the sampling thread's current device, 0 in a thread the job did
    not set).
    """

    def __init__(
        self,
        run_dir: Path | str,
        *,
        rank: int | None,
        host: str | None = None,
        interval_s: float = 5.0,
        log_path: Path | str | None = None,
        stats_fn: Callable[[], Mapping[str, Any]] | None = None,
        flush_interval_s: float | None = None,
        host_wide: bool | None = None,
        gpu_indices: Sequence[int] | None = None,
        log_lines: int = 20,
        max_buffered_rows: int = 50_000,
        nvml: Any = None,
        proc_root: Path | str = "/proc",
        sys_root: Path | str = "/sys",
        run_id: str | Callable[[], str | None] | None = None,
        cuda_device: int | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.run_dir = Path(run_dir)
        # run.json's run_id, stamped into every part: a string, or a function that gives it (None
        # while the rank does not know it yet); None: parts without one.
        self._run_id = run_id
        self.rank = rank
        self.host = host or socket.gethostname()
        self.pid = os.getpid()
        self.interval_s = float(interval_s)
        # Default: a part per sample up to 30 s; slower samplers write one part per sample.
        self.flush_interval_s = float(flush_interval_s if flush_interval_s is not None else max(self.interval_s, 30.0))
        self.log_path = Path(log_path) if log_path is not None else None
        self.stats_fn = stats_fn
        self.log_lines = log_lines
        self.max_buffered_rows = max_buffered_rows
        if host_wide is None:
            host_wide = rank is None or os.environ.get("LOCAL_RANK", "0") == "0"
        self.host_wide = host_wide
        if gpu_indices is None and cuda_device is not None:
            gpu_indices = nvml_index(cuda_device)
        self._gpu_indices = list(gpu_indices) if gpu_indices is not None else default_gpu_indices(rank)
        self._nvml_module = nvml
        self._probes: list[Any] = [_ProcessProbe(Path(proc_root), cuda_device)]
        if host_wide:
            self._probes += [_HostProbe(Path(proc_root)), _NetProbe(Path(sys_root))]
        self._nvml: _NvmlProbe | None = None
        self._nvml_tried = False
        self._log_offset: int | None = None
        self._log_partial = b""
        self._buffer: list[tuple[int, str | None, str, float | None, str | None]] = []
        self._lock = threading.Lock()  # buffer + counters: sample_once may run on the caller's thread
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_flush = time.monotonic()
        self._samples = 0
        self._errors = 0
        self._stats = {"samples": 0, "rows_written": 0, "parts_written": 0, "rows_dropped": 0, "errors": 0}

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> HeartbeatSampler:
        """Start the daemon thread (first sample at once); returns ``self``."""
        if self._thread is not None:
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=f"megascope-heartbeat-{self.rank}", daemon=True)
        self._thread.start()
        atexit.register(self.stop)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop the thread, take a last sample and flush. Safe to call twice."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        atexit.unregister(self.stop)
        self._stop.set()
        thread.join(timeout_s)
        self.sample_once()
        self.flush()
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None

    def __enter__(self) -> HeartbeatSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats, errors=self._errors, samples=self._samples)

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            self.sample_once()
            if time.monotonic() - self._last_flush >= self.flush_interval_s:
                self.flush()
            next_at += self.interval_s
            # A sample that overran its period is not made up for: skip to the next slot.
            next_at = max(next_at, time.monotonic())
            self._stop.wait(next_at - time.monotonic())

    # -- sampling --------------------------------------------------------------------------------

    def _nvml_probe(self) -> _NvmlProbe | None:
        if not self._nvml_tried:
            self._nvml_tried = True
            module = self._nvml_module if self._nvml_module is not None else _load_nvml()
            if module:
                try:
                    self._nvml = _NvmlProbe(module, self._gpu_indices)
                except Exception as exc:  # no driver, no GPU: NVML is optional
                    log.info("NVML not available on %s: %s", self.host, exc)
        return self._nvml

    def _safe(self, probe: Callable[[], Iterable[Row]]) -> list[Row]:
        try:
            return list(probe())
        except Exception as exc:  # a probe never stops the sampler, let alone the job
            self._errors += 1
            if self._errors <= 3:
                log.warning("heartbeat probe %s failed on %s: %s", getattr(probe, "__qualname__", probe), self.host, exc)
            return []

    def sample_once(self) -> int:
        """Take one sample now (also callable from the job's thread); returns rows buffered."""
        now_ns = time.time_ns()
        rows: list[Row] = [(None, M.HEARTBEAT, float(self._samples), None)]
        if self._samples == 0 or time.monotonic() - self._last_flush >= self.flush_interval_s:
            rows.append((None, M.INTERVAL_S, self.interval_s, None))
            rows.append((None, M.FLUSH_S, self.flush_interval_s, None))
        for probe in self._probes:
            rows += self._safe(probe.sample)
        nvml = self._nvml_probe()
        if nvml is not None:
            rows += self._safe(nvml.sample)
        if self.log_path is not None:
            rows += self._safe(self._log_tail)
        if self.stats_fn is not None:
            rows += self._safe(self._collector_stats)
        if self._errors:
            rows.append((None, M.SAMPLER_ERRORS, float(self._errors), None))
        with self._lock:
            self._samples += 1
            room = self.max_buffered_rows - len(self._buffer)
            if room < len(rows):  # the writer is failing: keep memory bounded, count the loss
                self._stats["rows_dropped"] += len(rows) - max(room, 0)
                rows = rows[: max(room, 0)]
            self._buffer.extend((now_ns, *row) for row in rows)
        return len(rows)

    def _collector_stats(self) -> list[Row]:
        assert self.stats_fn is not None
        rows: list[Row] = []
        for key, value in self.stats_fn().items():
            if isinstance(value, bool | int | float):
                rows.append((None, f"{COLLECTOR_METRIC_PREFIX}{key}", float(value), None))
        return rows

    def _log_tail(self) -> list[Row]:
        """New complete lines of the log since the last sample, at most ``log_lines`` of them."""
        assert self.log_path is not None
        try:
            size = self.log_path.stat().st_size
        except FileNotFoundError:
            return []
        if self._log_offset is None or size < self._log_offset:  # first look, or the log was rotated
            self._log_offset = max(0, size - _LOG_READ_MAX_BYTES)
            self._log_partial = b""
        if size == self._log_offset:
            return []
        with open(self.log_path, "rb") as f:
            # Read only the tail of a burst: the last lines are the ones an on-call engineer wants.
            start = max(self._log_offset, size - _LOG_READ_MAX_BYTES)
            if start > self._log_offset:
                self._log_partial = b""
            f.seek(start)
            data = self._log_partial + f.read(size - start)
        self._log_offset = size
        *lines, self._log_partial = data.split(b"\n")
        if len(self._log_partial) > _LOG_READ_MAX_BYTES:
            self._log_partial = b""
        out = [ln.decode("utf-8", "replace").rstrip("\r")[:_LOG_LINE_MAX_CHARS] for ln in lines if ln.strip()]
        return [(None, M.LOG, None, line) for line in out[-self.log_lines:]]

    # -- writing ---------------------------------------------------------------------------------

    def flush(self) -> Path | None:
        """Write buffered rows as one part; on failure keep them for the next try."""
        with self._lock:
            rows, self._buffer = self._buffer, []
            self._last_flush = time.monotonic()
        if not rows:
            return None
        cols = list(zip(*rows, strict=True))
        n = len(rows)
        table = pa.table(
            {
                "host": pa.array([self.host] * n, pa.string()),
                "rank": pa.array([self.rank] * n, pa.int32()),
                "pid": pa.array([self.pid] * n, pa.int64()),
                "time_ns": pa.array(cols[0], pa.int64()),
                "device": pa.array(cols[1], pa.string()),
                "metric": pa.array([str(m) for m in cols[2]], pa.string()),
                "value": pa.array(cols[3], pa.float64()),
                "text": pa.array(cols[4], pa.string()),
            },
            schema=HEARTBEATS,
        )
        try:
            run_id = self._run_id() if callable(self._run_id) else self._run_id
            path = layout.write_part(self.run_dir, "heartbeats", table, host=self.host, run_id=run_id)
        except Exception as exc:  # a full disk must not kill training: retry next flush
            with self._lock:
                self._errors += 1
                self._buffer[:0] = rows[: self.max_buffered_rows]
                self._stats["rows_dropped"] += max(0, len(rows) - self.max_buffered_rows)
            log.warning("heartbeat write failed on %s: %s", self.host, exc)
            return None
        with self._lock:
            self._stats["rows_written"] += n
            self._stats["parts_written"] += 1
        return path
