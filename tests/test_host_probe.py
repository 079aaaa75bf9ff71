"""The host probe: the training thread times a fixed loop every few steps, and the analysis compares
ranks' CPUs with it (megascope.collectors.contexts.probe_host, megascope.analysis.stragglers.cpu_slowdown)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from click.testing import CliRunner
from megascope.collectors import Collector, CollectorConfig
from megascope.collectors.contexts import probe_host
from test_straggler_evidence import RANKS, noisy_run

from megascope import layout
from megascope.analysis.stragglers import cpu_slowdown
from megascope.cli import main
from megascope.errors import ConfigError
from megascope.schema import HOST_PROBE_METRIC, RunMeta
from megascope.store import open_run


def _probes(run: Path) -> list[tuple[int, int, float]]:
    rows = open_run(run).con.sql(
        f"SELECT rank, step, value FROM metrics WHERE name = '{HOST_PROBE_METRIC}' ORDER BY rank, step").fetchall()
    return [(int(r), int(s), float(v)) for r, s, v in rows]


def _run_steps(run: Path, steps: int, **kw: object) -> None:
    cfg = CollectorConfig(run_dir=run, flush_interval_s=0.05, device=torch.device("cpu"), handle_sigterm=False,
                          marker_agent=False, **kw)  # type: ignore[arg-type]
    col = Collector(cfg, rank=0, world_size=1, coords={"pp": 0, "dp": 0, "tp": 0},
                    meta=RunMeta(run_id="t", source="collector", world_size=1))
    for step in range(steps):
        with col.step(step):
            pass
    col.close()


def test_the_probe_times_its_loop() -> None:
    short, long = min(probe_host(2_000) for _ in range(5)), min(probe_host(20_000) for _ in range(5))
    assert 0 < short < long


def test_the_probe_is_written_every_n_steps_and_can_be_turned_off(tmp_path: Path) -> None:
    _run_steps(tmp_path / "every2", 5, host_probe_every=2)
    probes = _probes(tmp_path / "every2")
    assert [step for _, step, _ in probes] == [0, 2, 4]
    assert all(rank == 0 and value > 0 for rank, _, value in probes)
    _run_steps(tmp_path / "off", 3, host_probe_every=0)
    assert _probes(tmp_path / "off") == []


def test_the_probe_interval_comes_from_the_environment_and_is_checked(tmp_path: Path) -> None:
    cfg = CollectorConfig(run_dir=tmp_path)
    assert cfg.host_probe_every == 10
    assert cfg.with_env({"MEGASCOPE_HOST_PROBE_EVERY": "0"}).host_probe_every == 0
    with pytest.raises(ConfigError, match="MEGASCOPE_HOST_PROBE_EVERY"):
        cfg.with_env({"MEGASCOPE_HOST_PROBE_EVERY": "often"})
    with pytest.raises(ConfigError, match="host_probe_every"):
        CollectorConfig(run_dir=tmp_path, host_probe_every=-1)


_RANK = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch
    from megascope.collectors import Collector, CollectorConfig, contexts
    from megascope.schema import RunMeta
    run, rank = Path(sys.argv[1]), int(sys.argv[2])
    if rank == 1:
        # A CPU half as fast, as the analysis sees one: the same probe takes twice as long.
        contexts.probe_host.__defaults__ = (2 * contexts.HOST_PROBE_LOOPS,)
    cfg = CollectorConfig(run_dir=run, flush_interval_s=0.05, device=torch.device("cpu"), handle_sigterm=False,
                          marker_agent=False, host_probe_every=1)
    col = Collector(cfg, rank=rank, world_size=2, coords={"pp": 0, "dp": rank, "tp": 0},
                    meta=RunMeta(run_id="t", source="collector", world_size=2) if rank == 0 else None)
    # Both ranks step at the same time: one still importing torch would slow the other's probes.
    (run.parent / f"ready{rank}").touch()
    while not (run.parent / f"ready{1 - rank}").exists():
        time.sleep(0.005)
    time.sleep(0.2)
    for step in range(15):
        with col.step(step):
            time.sleep(0.01)
    col.close()
""")


def test_the_rank_whose_probe_runs_twice_as_long_reads_twice_as_slow(tmp_path: Path) -> None:
    """Two rank processes writing one run; rank 1's probe does twice the work, as on a CPU half
    as fast. The analysis reads each rank's median probe over the median rank's (with two ranks,
    their mean), exactly as written. The times themselves are real: on two shared cores the doubled
    loop once measured only 1.3x the other, so only "clearly longer" is asked of them."""
    run = tmp_path / "run"
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(run), str(r)]) for r in (0, 1)]
    assert [p.wait(timeout=120) for p in ranks] == [0, 0]
    probes = _probes(run)
    assert {rank for rank, _, _ in probes} == {0, 1} and len(probes) == 30
    median = {r: float(np.median([v for rank, _, v in probes if rank == r])) for r in (0, 1)}
    middle = (median[0] + median[1]) / 2
    slow = cpu_slowdown(open_run(run))
    assert slow == pytest.approx({0: median[0] / middle, 1: median[1] / middle})
    assert median[1] / median[0] > 1.2, median
    assert slow[0] < 1.0 < slow[1]


@pytest.mark.parametrize(("factor", "verdict"), [(2.0, "a slow or shared CPU"), (1.0, "when probed: more host work")])
def test_the_report_says_whether_a_host_straggler_sat_on_a_slower_cpu(tmp_path: Path, factor: float,
                                                                      verdict: str) -> None:
    """A rank that pauses outside its spans (cause host), its probes beside its peers': twice as long,
    or the same."""
    run = noisy_run(tmp_path / "run", seed=4, paused=3, pause_ms=12.0, noise=0.08)
    for rank in range(RANKS):
        loop_ns = [300_000.0 * (factor if rank == 3 else 1.0) * (1 + 0.01 * k) for k in range(3)]
        layout.write_part(run, "metrics", pa.table({
            "rank": [rank] * 3, "step": [0, 10, 20], "name": [HOST_PROBE_METRIC] * 3, "value": loop_ns,
            "time_ns": [1, 2, 3]}), rank=rank)
    assert cpu_slowdown(open_run(run))[3] == pytest.approx(factor, rel=0.01)
    result = CliRunner().invoke(main, ["report", str(run)])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if "host probe" in x)
    assert line.strip().startswith("rank 3:") and verdict in line
