"""Benchmark: cost of the heartbeat sampler, speed of health_findings at scale, and diagnose on CPU.

    python bench/health_bench.py                      # all three, default sizes
    python bench/health_bench.py --ranks 12288 --samples 60 --skip-diagnose

Tables printed:
1. one heartbeat sample (this machine's probes; NVML where present): time, rows, bytes per part;
2. ``health_findings`` over a synthetic heartbeats table (``--ranks`` ranks, 8 per host, one
   sampler per rank, ``--samples`` samples each, one part per host; one silent rank, one hot GPU);
3. ``megascope diagnose`` wall time on CPU alone and with ``--nproc 4 --tp 2``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from megascope.collectors.heartbeat import HeartbeatSampler

from megascope import layout
from megascope.health import health_findings
from megascope.schema import HEARTBEATS, RunMeta, RunSource
from megascope.store import open_run


def bench_sampler(tmp: Path, n: int = 200) -> None:
    sampler = HeartbeatSampler(tmp / "sampler", rank=0, host="bench", interval_s=5.0)
    sampler.sample_once()  # the first sample sets up NVML and rate baselines
    times, rows = [], []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        rows.append(sampler.sample_once())
        times.append((time.perf_counter_ns() - t0) / 1e3)
    t0 = time.perf_counter_ns()
    path = sampler.flush()
    flush_ms = (time.perf_counter_ns() - t0) / 1e6
    size = path.stat().st_size if path else 0
    print("| probes | samples | median µs/sample | p99 µs/sample | rows/sample | flush of all (ms) | bytes/row on disk |")
    print("|---|---|---|---|---|---|---|")
    probes = "process+host+NIC" + ("+NVML" if sampler._nvml is not None else "")
    print(f"| {probes} | {n} | {statistics.median(times):.0f} | {np.percentile(times, 99):.0f} | "
          f"{statistics.median(rows):.0f} | {flush_ms:.1f} | {size / max(1, sum(rows)):.1f} |")


METRICS = ["heartbeat", "gpu_util_pct", "gpu_temp_c", "gpu_temp_slowdown_c", "gpu_power_w", "gpu_sm_clock_mhz",
           "gpu_sm_clock_max_mhz", "gpu_throttle_reasons", "gpu_mem_used_bytes", "proc_rss_bytes",
           "proc_cpu_pct", "collector_rows_dropped"]


def write_fleet(run: Path, ranks: int, samples: int, per_host: int = 8, period_s: float = 5.0) -> int:
    layout.write_run_meta(run, RunMeta(run_id="bench", source=RunSource.COLLECTOR, world_size=ranks))
    rng = np.random.default_rng(0)
    t0 = 1_800_000_000_000_000_000
    silent_rank, hot_rank = ranks // 3, ranks // 2
    total = 0
    m = len(METRICS)
    for host_index in range(ranks // per_host):
        host = f"node{host_index:05d}"
        host_ranks = np.arange(host_index * per_host, (host_index + 1) * per_host)
        n_samples = np.where(host_ranks == silent_rank, samples // 2, samples)
        rank_col = np.repeat(host_ranks, n_samples * m)
        sample_idx = np.concatenate([np.repeat(np.arange(k), m) for k in n_samples])
        metric_col = np.tile(np.array(METRICS, dtype=object), int(n_samples.sum()))
        values = rng.normal(60.0, 5.0, len(rank_col))
        values[metric_col == "gpu_temp_c"] = rng.normal(60.0, 2.0, int((metric_col == "gpu_temp_c").sum()))
        values[metric_col == "collector_rows_dropped"] = 0.0
        values[metric_col == "gpu_throttle_reasons"] = 4.0
        values[metric_col == "gpu_temp_slowdown_c"] = 87.0
        values[(metric_col == "gpu_temp_c") & (rank_col == hot_rank)] = 89.0
        table = pa.table({
            "host": pa.array([host] * len(rank_col)), "rank": pa.array(rank_col, pa.int32()),
            "pid": pa.array(rank_col + 1000, pa.int64()),
            "time_ns": pa.array(t0 + (sample_idx * period_s * 1e9).astype(np.int64), pa.int64()),
            "device": pa.array([f"gpu{r % per_host}" for r in rank_col]),
            "metric": pa.array(metric_col, pa.string()), "value": pa.array(values, pa.float64()),
            "text": pa.nulls(len(rank_col), pa.string())}, schema=HEARTBEATS)
        interval = pa.Table.from_pylist(
            [{"host": host, "rank": int(r), "pid": 1, "time_ns": t0, "device": None, "metric": "heartbeat_interval_s",
              "value": period_s, "text": None} for r in host_ranks], schema=HEARTBEATS)
        layout.write_part(run, "heartbeats", pa.concat_tables([table, interval]), host=host)
        total += len(rank_col) + len(host_ranks)
    return total


def bench_findings(tmp: Path, ranks: int, samples: int) -> None:
    run = tmp / "fleet"
    t0 = time.perf_counter()
    rows = write_fleet(run, ranks, samples)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    opened = open_run(run)
    open_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    df = health_findings(opened.con)
    find_s = time.perf_counter() - t0
    found = ", ".join(f"{f} rank {r}" for f, r in zip(df["finding"][:5], df["rank"][:5], strict=True))
    found += f" ({len(df)} in all)"
    print("| ranks | samples/rank | heartbeat rows | parts | write (s) | open_run (s) | health_findings (s) | found |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {ranks:,} | {samples} | {rows:,} | {ranks // 8:,} | {write_s:.1f} | {open_s:.1f} | {find_s:.1f} | {found} |")


def bench_diagnose(tmp: Path) -> None:
    print("| command | wall (s) |")
    print("|---|---|")
    for args in (["-o", str(tmp / "d1")], ["--nproc", "4", "--tp", "2", "-o", str(tmp / "d4")]):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "megascope", "diagnose", *args], check=True, capture_output=True)
        shown = " ".join(a if not a.startswith(str(tmp)) else "RUN" for a in args)
        print(f"| `megascope diagnose {shown}` | {time.perf_counter() - t0:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=12288)
    parser.add_argument("--samples", type=int, default=60)
    parser.add_argument("--skip-diagnose", action="store_true")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="health-bench-"))
    try:
        bench_sampler(tmp)
        print()
        bench_findings(tmp, args.ranks, args.samples)
        if not args.skip_diagnose:
            print()
            bench_diagnose(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
