"""The run state rule: running, stalled, hung, finished, failed, on small seeded synth runs and live replays."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import Synth
from megascope.dashboard.replay import replay_run

from megascope import analysis, layout
from megascope.analysis.runstate import decide, run_facts, run_state, thresholds
from megascope.store import open_run

S = 1_000_000_000


@pytest.fixture(scope="module")
def runs(synth: Synth, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("state")
    out = {}
    for name, specs in (("healthy", []), ("hang", ["hang:rank=6,step=5"])):
        out[name] = synth(root / name, *specs, ranks=8, steps=8, tp=2, pp=2, gpus_per_host=4, seed=5)
    # A live job that wrote three of its eight steps so far (times shifted to now).
    replay_run(out["healthy"], root / "partial", step_interval_s=0.0, max_steps=3)
    out["partial"] = root / "partial"
    return out


def _with_config(path: Path, **config: object) -> None:
    """Change ``config`` keys of a run's run.json (as another writer would have written them)."""
    meta = json.loads((path / layout.RUN_JSON).read_text())
    meta["config"] = {**meta.get("config", {}), **config}
    (path / layout.RUN_JSON).write_text(json.dumps(meta))


def test_a_finished_run_reads_finished_whatever_the_time(runs: dict[str, Path]) -> None:
    run = open_run(runs["healthy"])
    facts = run_facts(run)
    for later_s in (0, 10, 10_000_000):
        state = decide(facts, now_ns=facts["last_progress_ns"] + later_s * S)
        assert state["state"] == "finished" and not state["hung"], state
        assert state["last_step"] == 7 and state["ranks_at_last_step"] == 8


def test_a_hung_run_reads_hung_with_its_culprit(runs: dict[str, Path]) -> None:
    run = open_run(runs["hang"])
    found = analysis.localize(run)
    state = run_state(run, hang=found)
    assert state["state"] == "hung" and state["hung"]
    assert state["culprit"]["rank"] == 6 and "rank 6" in state["reason"]
    assert state["in_flight"] == len(found["waiting"]) > 0
    # Without the localize result the markers are read here: still hung, no culprit named.
    alone = run_state(run)
    assert alone["state"] == "hung" and alone["culprit"] is None and alone["in_flight"] > 0


def test_calls_in_flight_are_not_a_hang_before_the_timeout(runs: dict[str, Path]) -> None:
    run = open_run(runs["hang"])
    facts = run_facts(run, hang=analysis.localize(run))
    last = facts["last_progress_ns"]
    stall, hang_after, _source = thresholds(facts["median_step_s"])
    assert decide(facts, now_ns=last + S // 2)["state"] == "running"
    stalled = decide(facts, now_ns=last + int((stall + hang_after) / 2 * S))
    assert stalled["state"] == "stalled" and not stalled["hung"] and stalled["culprit"] is None
    assert decide(facts, now_ns=last + int((hang_after + 1) * S))["state"] == "hung"


def test_the_collective_timeout_is_the_hang_threshold(runs: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "hang"
    shutil.copytree(runs["hang"], copy)
    _with_config(copy, collective_timeout_s=120.0)
    facts = run_facts(open_run(copy))
    assert facts["collective_timeout_s"] == 120.0
    last = facts["last_progress_ns"]
    assert decide(facts, now_ns=last + 100 * S)["state"] == "stalled"
    hung = decide(facts, now_ns=last + 121 * S)
    assert hung["state"] == "hung" and hung["hang_after_s"] == 120.0 and hung["hang_after_source"] == "the collective timeout"


def test_a_live_run_is_running_then_failed_when_it_stops_between_calls(runs: dict[str, Path]) -> None:
    run = open_run(runs["partial"])
    facts = run_facts(run)
    assert facts["last_step"] == 2 and facts["in_flight"] == 0 and facts["expected_steps"] == 8
    last = facts["last_progress_ns"]
    running = decide(facts, now_ns=last + S)
    assert running["state"] == "running" and running["progress_age_s"] == pytest.approx(1.0)
    failed = decide(facts, now_ns=last + 3600 * S)
    assert failed["state"] == "failed" and "step 2 of 7" in failed["reason"]
    # Without a step count (a job that never said), a quiet run with every rank at the same step
    # and nothing in flight has finished.
    unknown = {**facts, "expected_steps": None}
    assert decide(unknown, now_ns=last + S)["state"] == "running"
    assert decide(unknown, now_ns=last + 3600 * S)["state"] == "finished"
    # Every rank's process has ended (their marker agents said so): said at once, not after the
    # stall time; finished without a step count (every rank at the same step), failed short of it.
    assert decide({**unknown, "ended": True}, now_ns=last + S)["state"] == "finished"
    ended = decide({**facts, "ended": True}, now_ns=last + S)
    assert ended["state"] == "failed" and ended["reason"].startswith("every rank's process ended at step 2 of 7")
    # Ended with calls stuck: hung at once.
    assert decide({**facts, "ended": True, "in_flight": 3}, now_ns=last + S)["state"] == "hung"


def test_a_reader_that_saw_new_data_bounds_the_idle_time(runs: dict[str, Path]) -> None:
    facts = run_facts(open_run(runs["hang"]))
    now = facts["last_progress_ns"] + 3600 * S
    assert decide(facts, now_ns=now)["state"] == "hung"
    # Host clocks behind the reader's: the data looks an hour old, yet parts arrived a second ago.
    assert decide(facts, now_ns=now, last_write_ns=now - S)["state"] == "running"


def test_timestamps_from_the_future_fall_back_on_file_times(runs: dict[str, Path]) -> None:
    facts = dict(run_facts(open_run(runs["partial"])))
    facts["last_progress_ns"] = facts["last_data_ns"] + 10 ** 6 * S
    state = decide(facts, now_ns=facts["last_data_ns"] + S, stall_after_s=5.0)
    assert state["last_progress_ns"] is None and state["idle_s"] == pytest.approx(1.0)
    assert state["state"] == "running"


def test_a_growing_run_reads_each_marker_file_once_and_answers_as_a_fresh_open(
        runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whether markers go past the last step, and the newest completion: a refreshed run asks
    only its new marker files, and answers what a run opened afresh answers."""
    import shutil

    import pyarrow as pa

    from megascope import schema
    from megascope.analysis import hang, runstate

    path = tmp_path / "grow"
    shutil.copytree(runs["healthy"], path)
    asked: dict[str, list[int]] = {"steps": [], "completions": []}
    step_highs, last_completed = hang._step_highs, runstate._last_completed
    monkeypatch.setattr(hang, "_step_highs", lambda con, files: asked["steps"].append(len(files)) or step_highs(con, files))
    monkeypatch.setattr(runstate, "_last_completed",
                        lambda con, files: asked["completions"].append(len(files)) or last_completed(con, files))
    run = open_run(path)
    before, facts = analysis.localize(run), run_facts(run)
    assert not before["waiting"]
    marker_files = len(run.files["markers"])
    assert asked["steps"] == [marker_files] and len(asked["completions"]) == 1
    # Rank 3 goes on to a call of step 8 (past every step span) and completes it, a second later.
    group, seq, last_ns, step = run.con.execute(
        "SELECT \"group\", max(seq), max(time_ns), max(step) FROM markers WHERE rank = 3 AND peer IS NULL "
        "GROUP BY 1 ORDER BY 1 LIMIT 1").fetchone()
    rows = [{"rank": 3, "group": group, "seq": seq + 1, "op": "all_reduce", "state": state, "time_ns": last_ns + k * S,
             "step": step + 1, "bytes": None, "peer": None} for k, state in ((1, "enqueued"), (2, "completed"))]
    layout.write_part(path, "markers", pa.Table.from_pylist(rows, schema=schema.MARKERS), rank=3,
                      run_id=run.meta.run_id)
    run.refresh()
    asked = {"steps": [], "completions": []}
    grown, grown_facts = analysis.localize(run), run_facts(run)
    assert asked["steps"] == [1] and asked["completions"] == [1]
    fresh = open_run(path)
    again, again_facts = analysis.localize(fresh), run_facts(fresh)
    # The new markers count: the run is no longer finished (its markers are read for calls in
    # flight) and its newest completion is rank 3's.
    assert grown["waiting"] and grown["waiting"] == again["waiting"]
    assert grown["stuck_groups"] == again["stuck_groups"]
    assert grown_facts["last_progress_ns"] == again_facts["last_progress_ns"] > facts["last_progress_ns"]
    assert grown_facts == again_facts


def test_marker_files_whose_footers_do_not_tell_their_steps_are_read_row_by_row(
        runs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from megascope.analysis import hang

    run = open_run(runs["healthy"])
    con = run.cursor()
    analysis.localize(run)  # the base tables
    last = int(con.execute("SELECT max(step) FROM ms_cache.rank_step").fetchone()[0])
    told = [hang._markers_beyond(con, run, step) for step in (last - 1, last)]
    monkeypatch.setattr(hang, "_step_highs", lambda con, files: {})
    fresh = open_run(runs["healthy"])
    fresh_con = fresh.cursor()
    analysis.localize(fresh)
    assert [hang._markers_beyond(fresh_con, fresh, step) for step in (last - 1, last)] == told == [True, False]


def test_how_a_job_failed_is_read_off_the_exceptions_its_steps_ended_by() -> None:
    from megascope.analysis.runstate import failure

    def err(rank: int, error: str, step: int = 7) -> dict[str, object]:
        return {"rank": rank, "step": step, "error": error, "time_ns": 10**18 + rank}

    assert failure([], 8) is None
    interrupted = failure([err(r, "KeyboardInterrupt") for r in range(8)], 8)
    assert interrupted == {"text": "stopped from outside (KeyboardInterrupt on 8 ranks)", "culprit": None}
    # One rank died without a word; the seven others failed on the closed connection.
    died = failure([err(r, "RuntimeError") for r in range(8) if r != 5], 8)
    assert died is not None and died["culprit"] == {"rank": 5, "step": None, "where": "ended with no exception of its own"}
    assert died["text"].startswith("rank 5 ended with no exception of its own")
    # Half the ranks said nothing (stopped from outside before they raised): nobody is named.
    assert failure([err(r, "RuntimeError") for r in range(4)], 8) == {
        "text": "exceptions: RuntimeError on ranks 0, 1, 2, 3", "culprit": None}
    # A rank raised an exception of its own (a bug), the others failed after it: it, even where the
    # launcher stopped one of the others before it raised (it reads as quiet).
    bug = failure([err(3, "ValueError", 4)] + [err(r, "RuntimeError", 4) for r in range(8) if r not in (3, 0)], 8)
    assert bug is not None and bug["culprit"] == {"rank": 3, "step": 4, "where": "raised ValueError in step 4"}
    # The others' exceptions are told by rank, the culprit's left out of them: "on 3" never reads
    # as a rank when it counts them.
    assert bug["text"] == "rank 3 raised ValueError in step 4; the others failed after it (RuntimeError on 6 ranks)"
    few = failure([err(2, "PlantedCrash", 5)] + [err(r, "RuntimeError", 5) for r in (0, 1, 3)], 4)
    assert few is not None and few["text"].endswith("(RuntimeError on ranks 0, 1, 3)")
    # Several ranks out of memory: the first of them.
    oom = failure([err(6, "OutOfMemoryError"), err(2, "OutOfMemoryError")] + [err(r, "DistBackendError")
                                                                                 for r in (0, 1, 3, 4, 5, 7)], 8)
    assert oom is not None and oom["culprit"]["rank"] == 6 and "1 other rank(s) raised their own too" in oom["text"]
    # Two ranks said nothing (the launcher stopped one before it raised): the one whose process
    # ended before the others failed, not later.
    two = [err(r, "RuntimeError") for r in (0, 2)]
    ends = {3: 10**18 + 300_000, 1: 10**18 + 85_000_000}
    assert failure(two, 4, ends)["culprit"]["rank"] == 3  # type: ignore[index]
    assert failure(two, 4, {3: 10**18 + 60_000_000, 1: 10**18 + 85_000_000})["culprit"] is None  # type: ignore[index]
    # Peers' failures of two kinds (a closed connection, a timeout) and nobody quiet: nobody named.
    assert failure([err(r, "RuntimeError" if r % 2 else "DistBackendError") for r in range(8)],
                   8)["culprit"] is None  # type: ignore[index]


def test_a_real_job_whose_rank_was_killed_names_it(tmp_path: Path, cli: object) -> None:
    """tests/data/cpu-2x2x2-rank-killed: the bundled trainer on CPU (gloo, tp2 x pp2 x dp2), rank 6
    killed with SIGKILL at step 46. The seven others failed on the closed connection (their steps
    ended by RuntimeError, which the collector records); rank 6 recorded none. Before, the run read
    "running" and then "failed" with no word of who; the report said "HANG none"."""
    import shutil

    path = shutil.copytree(Path(__file__).parent / "data" / "cpu-2x2x2-rank-killed", tmp_path / "run")
    run = open_run(path)
    state = run_state(run, hang=analysis.localize(run))
    assert state["state"] == "failed" and state["culprit"]["rank"] == 6, state
    assert "rank 6 ended with no exception of its own" in state["reason"] and "RuntimeError on 7 ranks" in state["reason"]
    text = cli("report", str(path), "--no-whatif")  # type: ignore[operator]
    assert text.exit_code == 0 and "FAILED: every rank's process ended at step 46 of 299" in text.output
    where = cli("localize", str(path))  # type: ignore[operator]
    assert where.exit_code == 0 and where.output.startswith("not hung: ")
    assert "FAILED: " in where.output and "rank 6 ended with no exception of its own" in where.output


def test_a_real_torchrun_job_whose_rank_raised_names_it(tmp_path: Path) -> None:
    """tests/data/cpu-ddp-rank-raised: a DDP job under torchrun (gloo, 4 ranks, the collector as
    docs/collector.md shows it), rank 2 raising ValueError in step 12. Ranks 1 and 3 failed on the
    closed connection (RuntimeError); torchrun stopped rank 0 before it raised. Rank 2 is named,
    not rank 0 (the one that recorded nothing)."""
    import shutil

    path = shutil.copytree(Path(__file__).parent / "data" / "cpu-ddp-rank-raised", tmp_path / "run")
    run = open_run(path)
    state = run_state(run, hang=analysis.localize(run))
    assert state["state"] == "failed" and state["culprit"] == {"rank": 2, "step": 12,
                                                              "where": "raised ValueError in step 12"}, state


def test_a_real_torchrun_job_whose_rank_was_killed_at_its_first_step_names_it(tmp_path: Path) -> None:
    """tests/data/cpu-ddp-rank-killed-at-start: a DDP job under torchrun (gloo, 4 ranks), rank 3
    killing itself with SIGKILL in step 0. Ranks 0 and 2 failed on the closed connection; torchrun
    stopped rank 1 before it raised. Two ranks said nothing: rank 3's process ended with the first
    exception, rank 1's 85 ms later."""
    import shutil

    path = shutil.copytree(Path(__file__).parent / "data" / "cpu-ddp-rank-killed-at-start", tmp_path / "run")
    run = open_run(path)
    state = run_state(run, hang=analysis.localize(run))
    assert state["state"] == "failed" and state["culprit"]["rank"] == 3, state


def test_a_real_torchrun_job_whose_rank_hung_at_its_first_step_reads_hung(tmp_path: Path) -> None:
    """tests/data/cpu-ddp-rank-hung-at-start: a DDP job under torchrun (gloo, 4 ranks, a 15 s
    process-group timeout), rank 1 stuck before its first all-reduce; the others timed out, then
    torchrun stopped every rank. The collector wrote the group's timeout into run.json (the job
    did not say it), so the 15 s waits count as a hang; before, with the one (hung) step as the
    median step, they read as shorter than the threshold and the run as failed. Every process has
    ended with the calls stuck: hung at once, rank 1 the culprit."""
    import shutil

    path = shutil.copytree(Path(__file__).parent / "data" / "cpu-ddp-rank-hung-at-start", tmp_path / "run")
    run = open_run(path)
    assert run.meta.config["collective_timeout_s"] == 15.0
    found = analysis.localize(run)
    assert found["hung"] is True and [s["rank"] for s in found["suspects"]] == [1]
    state = run_state(run, hang=found)
    assert state["state"] == "hung" and state["culprit"]["rank"] == 1, state
    assert state["reason"].startswith("every rank's process ended at step 0 with 3 call(s) never completed; rank 1 ")


def test_a_real_torchrun_job_whose_rank_left_its_loop_failed(tmp_path: Path) -> None:
    """tests/data/cpu-ddp-rank-left-its-loop: a DDP job under torchrun (gloo, 4 ranks, no step
    count in run.json), rank 2 leaving its loop with ``break`` in step 12: its step ended cleanly,
    the others' by the closed connection. Every rank reached step 12, so without a step count the
    run could read finished; a step ended by an exception says it did not: failed, rank 2."""
    import shutil

    path = shutil.copytree(Path(__file__).parent / "data" / "cpu-ddp-rank-left-its-loop", tmp_path / "run")
    run = open_run(path)
    assert run.meta.config.get("steps") is None
    state = run_state(run, hang=analysis.localize(run))
    assert state["state"] == "failed" and state["culprit"]["rank"] == 2, state


@pytest.mark.parametrize(("name", "rank", "how", "waited"), [
    ("gpu-dp2-rank-killed", 0, "rank 0 ended with no exception of its own", "rank 1 waited for it until stopped (it never entered world seq 5)"),
    ("gpu-tp2-rank-raised", 1, "rank 1 raised PlantedCrash in step 4", "rank 0 waited for it until stopped (it never entered tp:0 seq 360)"),
])
def test_a_rank_that_died_on_nccl_is_named_failed_not_hung(tmp_path: Path, cli: object, name: str, rank: int,
                                                           how: str, waited: str) -> None:
    """Real NCCL jobs on 2x H200 (bench/gpu_failures.sh): the bundled trainer's rank killed with
    SIGKILL in step 5 (dp2) or raising in step 4 (tp2). NCCL's waiters do not fail when a peer
    dies: they wait in the call it never entered until stopped, so the runs read "hung" with the
    dead rank as the suspect. The dead rank's process ended before its waiters': failed, named."""
    import shutil

    path = shutil.copytree(Path(__file__).parent / "data" / name, tmp_path / "run")
    run = open_run(path)
    found = analysis.localize(run)
    assert found["hung"] is False and found["died"]["rank"] == rank, found
    state = run_state(run, hang=found)
    assert state["state"] == "failed" and state["culprit"]["rank"] == rank, state
    assert how in state["reason"] and state["reason"].endswith(waited), state["reason"]
    where = cli("localize", str(path))  # type: ignore[operator]
    assert where.exit_code == 0 and where.output.startswith(f"not hung: rank {rank}'s process ended (")
    assert "it died (raised, was killed or exited), it did not hang" in where.output
    assert "FAILED: every rank's process ended at step " in where.output


def test_a_rank_that_left_while_calls_were_only_in_flight_needs_the_flight_recorder(tmp_path: Path) -> None:
    """tests/data/gpu-ddp-rank-exited: a DDP job under torchrun on 2x H200 whose rank 1 exited in
    step 5; torchrun stopped rank 0 0.2 s later, its all-reduce only in flight. The marker agents
    see the processes of a job killed all at once end up to a quarter second apart too (4 gloo
    ranks SIGKILLed together: 11-250 ms), so from the markers alone nobody is named; on the GPU
    machine NCCL's flight-recorder dump (left out of the test data) named rank 1, and so did this."""
    import shutil

    path = shutil.copytree(Path(__file__).parent / "data" / "gpu-ddp-rank-exited", tmp_path / "run")
    run = open_run(path)
    found = analysis.localize(run)
    assert found["hung"] is False and "died" not in found, found
    state = run_state(run, hang=found)
    assert state["state"] == "failed" and state["culprit"] is None, state


def test_a_rank_hung_on_nccl_still_reads_hung(tmp_path: Path) -> None:
    """The control of the test above, from the same machine and script: rank 1 of a dp2 NCCL job
    stopped before a collective in step 4 and was alive until its peer's timeout aborted that
    peer: its process ended after its waiter's, so it hung, it did not die."""
    import shutil

    path = shutil.copytree(Path(__file__).parent / "data" / "gpu-dp2-rank-hung", tmp_path / "run")
    run = open_run(path)
    found = analysis.localize(run)
    assert found["hung"] is True and "died" not in found and found["suspects"][0]["rank"] == 1
    state = run_state(run, hang=found)
    assert state["state"] == "hung" and state["culprit"]["rank"] == 1, state


def _as_if_still_running(path: Path, ranks: set[int]) -> int:
    """Drop the last ``rank_alive`` row (value 0) of ``ranks`` from a compacted run, as if their
    processes still ran: returns the newest heartbeat time left (a reader's "now" just after)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    newest = 0
    for part in (path / "compacted" / "heartbeats").glob("*.parquet"):
        table = pq.read_table(part)
        gone = pc.and_(pc.and_(pc.equal(table["metric"], "rank_alive"), pc.equal(table["value"], 0.0)),
                       pc.is_in(table["rank"], value_set=pa.array(sorted(ranks), table["rank"].type)))
        table = table.filter(pc.invert(gone))
        pq.write_table(table, part)
        newest = max(newest, int(pc.max(table["time_ns"]).as_py()))
    return newest


def test_a_rank_that_died_is_named_while_the_others_still_wait(tmp_path: Path) -> None:
    """tests/data/gpu-dp2-rank-killed as it stood before the launcher stopped rank 1: rank 0's
    process has ended, rank 1 still runs, waiting in the all-reduce rank 0 never entered. NCCL's
    timeout is minutes in large jobs; the state says failed at once and who, not stalled, then
    hung. A hung rank's run read the same way (its process still runs) is not called so."""
    import shutil

    path = shutil.copytree(Path(__file__).parent / "data" / "gpu-dp2-rank-killed", tmp_path / "run")
    now = _as_if_still_running(path, {1}) + 1_000_000_000
    run = open_run(path)
    found = analysis.localize(run, now_ns=now)
    assert found["ended"] is False and found["hung"] is False and found["died"]["rank"] == 0, found
    assert found["died"]["live"] and "while rank 1 waits on it (it never entered world seq 5)" in found["note"]
    state = run_state(run, hang=found, now_ns=now)
    assert state["state"] == "failed" and state["culprit"]["rank"] == 0 and state["culprit"]["waiting"] == [1], state
    assert state["reason"].startswith("rank 0's process ended at step 4 of 11 while the others still run; rank 0 ")
    assert state["reason"].endswith("; rank 1 waits for it (it never entered world seq 5)")
    # Read moments after the death, the wait is as young as any call in flight (a rank whose files
    # reach the reader late looks the same for a moment): not yet.
    early = analysis.localize(run, now_ns=found["died"]["ended_ns"] + 500_000_000)
    assert "died" not in early, early.get("died")

    hung = shutil.copytree(Path(__file__).parent / "data" / "gpu-dp2-rank-hung", tmp_path / "hung")
    now = _as_if_still_running(hung, {0, 1}) + 1_000_000_000
    found = analysis.localize(open_run(hung), now_ns=now)
    assert "died" not in found and found["suspects"][0]["rank"] == 1


def test_a_rank_whose_host_went_quiet_is_named_while_the_others_still_wait(tmp_path: Path) -> None:
    """The same run as the host of rank 0 going down would leave it: rank 0 and its marker agent
    stop reporting at once, with no last row; rank 1's agent goes on while it waits in the
    all-reduce rank 0 never entered. Failed, rank 0 named as gone quiet (not as a hung process: its
    agent, a separate process, would still report then)."""
    import shutil

    path = shutil.copytree(Path(__file__).parent / "data" / "gpu-dp2-rank-killed", tmp_path / "run")
    now = _as_if_still_running(path, {0, 1}) + 1_000_000_000
    run = open_run(path)
    found = analysis.localize(run, now_ns=now)
    assert found["ended"] is False and found["hung"] is False and found["died"]["quiet"], found
    assert found["note"].startswith("rank 0 and its marker agent went quiet (")
    state = run_state(run, hang=found, now_ns=now)
    assert state["state"] == "failed" and state["culprit"] == {
        "rank": 0, "step": None, "where": "went quiet, its marker agent too", "waiting": [1]}, state
    assert state["reason"].startswith("rank 0 went quiet at step 4 of 11 while the others still run; rank 0 and its "
                                      "marker agent went quiet with no last word: its host down")


def test_a_lost_host_s_other_ranks_are_not_counted_among_those_waiting() -> None:
    """Eight ranks, rank 5 never entered the call the others are in; ranks 4 and 5 (one host) went
    quiet together, ranks 0-3, 6 and 7 still report. Rank 5 went with its host; rank 4, stuck in the
    call too, went with it rather than waiting on it. With every waiter quiet, nobody is said to
    wait, and a hung rank (its agent still reporting) is never read so."""
    from megascope.analysis.hang import _died_first

    t0 = 10**18
    stuck = [{"rank": r, "stuck_since_ns": t0 + r * 1_000_000} for r in (0, 1, 2, 3, 4, 6, 7)]
    suspect = {"rank": 5, "group": "dp:0", "missing_seq": 12}
    running: dict[int, int | None] = {r: None for r in range(8)}
    died = _died_first(suspect, running, stuck, 20.0, 0, live=True, quiet={4: t0 + 5_000_000, 5: t0 + 4_000_000})
    assert died is not None and died["quiet"] and died["waiting"] == [0, 1, 2, 3, 6, 7], died
    assert died["text"].startswith("rank 5 and its marker agent went quiet (") and "dp:0 seq 12" in died["text"]
    assert _died_first(suspect, running, [s for s in stuck if s["rank"] == 4], 20.0, 0, live=True,
                       quiet={4: t0, 5: t0}) is None
    assert _died_first(suspect, running, stuck, 20.0, 0, live=True, quiet={}) is None  # hung: its agent reports


def test_a_rank_that_closed_a_collector_and_opened_another_has_not_ended(tmp_path: Path) -> None:
    """A marker agent's last row (value 0) says its rank's process ended or closed its collector;
    a rank that opened another collector after it (its agent's rows go on) has not ended: its
    latest row decides, not any 0 among them."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    from megascope.analysis import _sql
    from megascope.analysis.base import prepare

    path = shutil.copytree(Path(__file__).parent / "data" / "gpu-dp2-rank-killed", tmp_path / "run")
    part = next((path / "compacted" / "heartbeats").glob("*.parquet"))
    table = pq.read_table(part)
    rows = table.to_pylist()
    last = max(r["time_ns"] for r in rows if r["rank"] == 0 and r["metric"] == "rank_alive")
    again = dict(next(r for r in rows if r["rank"] == 0 and r["metric"] == "rank_alive"), value=1.0, time_ns=last + 10**9)
    pq.write_table(pa.Table.from_pylist(rows + [again], schema=table.schema), part)
    run = open_run(path)
    prepare(run.con)
    alive = _sql.query_df(run.con, "hang", "process_alive").set_index("rank")
    assert not bool(alive.loc[0, "ended"]) and bool(alive.loc[1, "ended"])
