"""``megascope watch``: a line per step of a live job from its step logs, the slow rank named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import wait_until

from megascope.cli import main
from megascope.inject import parse_injects
from megascope.store import open_run
from megascope.synth import LiveSynth, SynthConfig

ROOT = Path(__file__).resolve().parents[1]


def _job(tmp_path: Path, step_logs: bool = True) -> LiveSynth:
    cfg = SynthConfig(ranks=32, steps=100, tp=2, pp=2, seed=4,
                      faults=parse_injects(["straggler:rank=19,factor=1.4", "skew:rank=6,ms=80"]))
    return LiveSynth(tmp_path / "run", cfg, threads=1, step_logs=step_logs)


def test_once_prints_a_line_per_step_naming_the_slow_rank(tmp_path: Path) -> None:
    job = _job(tmp_path)
    for _ in range(3):
        job.write_step()
    job.close()
    result = CliRunner().invoke(main, ["watch", str(job.out), "--once"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert lines[0].split()[:3] == ["step", "step", "time"]
    assert [line.split()[0] for line in lines[1:]] == ["0", "1", "2"]
    assert all("rank 19 node00002 pp1 dp1 tp1 1.3" in line or "rank 19 node00002 pp1 dp1 tp1 1.4" in line
               for line in lines[1:]), lines
    assert "32 ranks, pp2 x dp8 x tp2" in result.stderr


def test_json_and_twins_give_the_same_steps(tmp_path: Path) -> None:
    rows = {}
    for logs in (True, False):
        job = _job(tmp_path / str(logs), step_logs=logs)
        for _ in range(2):
            job.write_step()
        job.close()
        result = CliRunner().invoke(main, ["watch", str(job.out), "--once", "--json"])
        assert result.exit_code == 0, result.output
        rows[logs] = [json.loads(line) for line in result.stdout.splitlines()]
    assert rows[True] == rows[False]
    assert [r["step"] for r in rows[True]] == [0, 1] and {r["slow_rank"] for r in rows[True]} == {19}
    assert all(r["ranks"] == 32 and r["slow_x"] > 1.25 and 0 < r["mfu"] < 1 for r in rows[True])
    # The rank that pauses before its collectives communicates least: its peers wait for it.
    assert {r["quiet_rank"] for r in rows[True]} <= {6, 19}


def test_a_live_job_is_followed_as_it_writes(tmp_path: Path) -> None:
    job = _job(tmp_path)
    job.write_step()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "megascope", "watch", str(job.out), "--interval", "0.2", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    seen: list[int] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(json.loads(line)["step"])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        wait_until(lambda: seen == [0], timeout=60, message="watch printed step 0")
        job.write_step()
        job.write_step()
        wait_until(lambda: seen == [0, 1, 2], timeout=60, message="watch printed the new steps, once each")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        reader.join(timeout=30)
        assert proc.stdout is not None
        proc.stdout.close()
        job.close()
    assert seen == [0, 1, 2]


def test_a_run_with_no_finished_step_and_a_bad_directory(tmp_path: Path) -> None:
    job = _job(tmp_path)
    job.close()
    result = CliRunner().invoke(main, ["watch", str(job.out), "--once"])
    assert result.exit_code == 0 and "no step every rank has ended yet" in result.stdout
    proc = subprocess.run([sys.executable, "-m", "megascope", "watch", str(tmp_path / "nothing"), "--once"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "run.json" in proc.stderr
    result = CliRunner().invoke(main, ["watch", str(job.out), "--interval", "0"])
    assert result.exit_code == 2 and "interval" in result.output


def test_a_run_opened_for_its_ranks_alone(tmp_path: Path) -> None:
    job = _job(tmp_path)
    job.write_step()
    job.close()
    run = open_run(job.out, tables=("ranks",))
    assert run.con.execute("SELECT count(*), count(DISTINCT host) FROM ranks").fetchall() == [(32, 4)]
    assert set(run.files) == {"ranks"}
    with pytest.raises(ValueError, match="unknown tables"):
        open_run(job.out, tables=("nope",))
