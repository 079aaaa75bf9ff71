"""The trainer's per-step host counters (megascope.trainer.hoststats)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from safety import assert_one_line_error, megascope

from megascope.trainer.hoststats import HostMeter


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_a_busy_step_counts_cpu_and_a_sleeping_step_counts_waits(tmp_path: Path) -> None:
    meter = HostMeter()
    _spin(0.05)
    meter.tick()
    for _ in range(20):
        time.sleep(0.005)
    meter.tick()
    busy, asleep = (meter.steps["thread_cpu_s"][i] for i in (0, 1))
    assert busy >= 0.05 and asleep < 0.02
    assert meter.steps["seconds"][1] >= 0.1
    # The process's CPU holds the thread's (and whatever else ran meanwhile).
    assert meter.steps["process_cpu_s"][0] >= busy * 0.9
    if sys.platform.startswith("linux"):
        # Each sleep blocks the thread: a voluntary context switch.
        assert meter.steps["voluntary"][1] >= 20
        assert meter.steps["voluntary"][0] < meter.steps["voluntary"][1]
    path = meter.write(tmp_path / "host", rank=3)
    data = json.loads(path.read_text())
    assert path.name == "rank-3.json" and data["rank"] == 3 and data["thread_cpu_s"] == meter.steps["thread_cpu_s"]


def test_without_proc_the_switches_are_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    import megascope.trainer.hoststats as hs

    monkeypatch.setattr(hs, "_STATUS", Path("/nonexistent/status"))
    meter = HostMeter()
    meter.tick()
    assert meter.steps["voluntary"] == [] and len(meter.steps["thread_cpu_s"]) == 1


@pytest.mark.parametrize("where", ["under-a-file", "inside-the-run"])
def test_an_unusable_host_stats_directory_is_one_line_before_the_job(tmp_path: Path, where: str) -> None:
    (tmp_path / "f.txt").write_text("x")
    target = tmp_path / "f.txt" / "host" if where == "under-a-file" else tmp_path / "run" / "host"
    proc = megascope("train", "--nproc", "1", "--steps", "1", "--host-stats", str(target), "-o", str(tmp_path / "run"),
                     cwd=tmp_path)
    assert_one_line_error(proc, mentions="host" if where == "under-a-file" else "inside the run directory")
    assert not (tmp_path / "run").exists()  # nothing started
