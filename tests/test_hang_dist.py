"""Hangs and freezes of real gloo jobs of the bundled trainer, as `localize` names them, and a job
killed mid-step that must not read as a hang. Ranks, steps and meshes differ from the GPU benchmark's
(bench/gpu_faults.sh), so neither is tuned to the other."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wait_until
from ingest_fixtures import SHARED_DATA

from megascope.analysis import localize
from megascope.inject import parse_injects
from megascope.store import open_run
from megascope.trainer import ModelConfig, TrainConfig, TrainingError, train

pytestmark = pytest.mark.dist

MODEL = ModelConfig(layers=2, hidden=32, heads=4, vocab=64, seq_len=16)


def _cfg(out: Path, tp: int, pp: int, dp: int, **kw: object) -> TrainConfig:
    base = dict(out=out, world_size=tp * pp * dp, tp=tp, pp=pp, dp=dp, steps=6, global_batch=8, micro_batches=2,
                model=MODEL, collective_timeout_s=10.0, peak_flops=1e9, flush_interval_s=0.25)
    base.update(kw)
    return TrainConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(("tp", "pp", "dp", "rank", "step"),
                         [(2, 2, 2, 6, 2), (1, 2, 4, 3, 3), (4, 1, 2, 5, 2), (2, 1, 4, 0, 3)])
def test_a_frozen_rank_is_named_first_with_its_trail_up_to_the_freeze(tmp_path: Path, tp: int, pp: int, dp: int,
                                                                      rank: int, step: int) -> None:
    """The frozen rank holds the interpreter lock: its writer thread and heartbeats stop with it,
    and nothing is flushed for it; what reaches the disk got there through the marker agent."""
    cfg = _cfg(tmp_path / "run", tp, pp, dp, faults=parse_injects([f"freeze:rank={rank},step={step}"]))
    with pytest.raises(TrainingError, match="collective timed out"):
        train(cfg, nproc=8)
    run = open_run(cfg.out)
    entered = run.con.execute(f"SELECT max(step) FROM markers WHERE rank = {rank} AND state = 'enqueued'").fetchone()
    assert entered == (step - 1,) or entered == (step,)  # its trail reaches the freeze
    found = localize(run)
    assert found["hung"], found
    first = found["suspects"][0]
    assert first["rank"] == rank, found["suspects"]
    assert first["stack"] is not None and first["stack"]["frames"][0]["function"] == "freeze"
    assert found["waited_s"] is not None and found["waited_s"] >= 1.0


def test_a_job_killed_mid_step_is_not_a_hang(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "megascope", "train", "--nproc", "4", "--tp", "2", "--dp", "2", "--steps", "400",
           "--layers", "2", "--hidden", "32", "--seq-len", "16", "--vocab", "64", "--global-batch", "4",
           "--micro-batches", "2", "--collective-timeout", "60", "-o", str(out)]
    with subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          start_new_session=True) as proc:
        try:
            def going() -> list[int] | None:
                """The ranks' pids once every rank has finished step 3."""
                try:
                    run = open_run(out)
                    steps = run.con.execute("SELECT min(s) FROM (SELECT rank, max(step) AS s FROM spans "
                                            "WHERE kind = 'step' GROUP BY rank)").fetchone()
                    ranks = run.con.execute("SELECT pid FROM ranks").fetchall()
                except Exception:  # not written yet
                    return None
                if steps and steps[0] is not None and steps[0] >= 3 and len(ranks) == 4:
                    return [int(p) for (p,) in ranks]
                return None

            pids = wait_until(going, timeout=120, interval=0.5, message="the job did not get going")
            assert pids, "the job did not get going"
            for pid in pids:  # every rank at once, mid-step: no hang, a kill
                os.kill(pid, signal.SIGKILL)
        finally:
            proc.wait(timeout=60)
    wait_until(lambda: open_run(out).con.execute(  # the agents' last passes
        "SELECT count(DISTINCT rank) FROM heartbeats WHERE metric = 'rank_alive' AND value = 0").fetchone() == (4,),
        timeout=60, interval=0.2, message="every rank's marker agent made its last pass")
    found = localize(open_run(out))
    assert not found["hung"], found
    # Calls were in flight (entered, their completion lost with the process): read as a kill.
    assert found["note"] is not None and "stopped mid-step" in found["note"], found


@pytest.mark.skipif(not (SHARED_DATA / "flight-recorder-hang-2rank").is_dir(), reason="shared sample dumps not present")
def test_flight_recorder_dumps_in_the_run_are_joined(tmp_path: Path) -> None:
    """A 2-rank job whose rank 1 hangs, with the dumps of a real 2-GPU NCCL job whose rank 1 hung
    in its flight_recorder/ (what the collector sets up on CUDA): both witnesses name rank 1."""
    cfg = _cfg(tmp_path / "run", 1, 1, 2, faults=parse_injects(["hang:rank=1,step=2"]), collective_timeout_s=4.0)
    with pytest.raises(TrainingError):
        train(cfg, nproc=2)
    dumps = cfg.out / "flight_recorder"
    dumps.mkdir()
    for dump in (SHARED_DATA / "flight-recorder-hang-2rank").glob("nccl_trace_rank_*"):
        shutil.copy(dump, dumps / dump.name.replace("nccl_trace_", ""))
    found = localize(open_run(cfg.out))
    assert found["hung"] and found["suspects"][0]["rank"] == 1
    assert found["suspects"][0]["evidence"] == ["markers", "flight_recorder"]
    fr = found["flight_recorder"]
    assert fr["dumps"] == 2 and fr["hung"] and fr["suspects"][0] == 1 and fr["agrees"]
    markers_only = localize(open_run(cfg.out), witnesses=False)
    assert markers_only["suspects"][0]["rank"] == 1 and markers_only["flight_recorder"] is None
