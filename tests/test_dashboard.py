"""The dashboard's server side: run registry and live refresh, URLs, safety, /metrics, /trace, replay, CLI.

Pages themselves are driven in a real browser in tests/browser/; here everything runs in-process
on small seeded synth runs.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pytest
from click.testing import Result
from conftest import Synth, wait_until
from hand_runs import host_bound_run, overlapped_run
from megascope.dashboard import create_app, registry_of
from megascope.dashboard import data as dash_data
from megascope.dashboard.replay import replay_run
from megascope.dashboard.routes import format_ranks, href, parse_path, parse_ranks, parse_steps
from megascope.dashboard.runs import RunRegistry, run_id_for
from megascope.dashboard.security import check_bind, is_loopback
from megascope.dashboard.shell import status_line

from megascope import analysis, layout, schema
from megascope.errors import ConfigError, RunDirError
from megascope.store import open_run


@pytest.fixture(scope="module")
def runs(synth: Synth, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two seeded 2x2x2 synth runs: one with a compute straggler, one hung."""
    root = tmp_path_factory.mktemp("runs")
    return {name: synth(root / name, spec, ranks=8, steps=10, tp=2, pp=2, gpus_per_host=4, seed=3)
            for name, spec in (("straggler", "straggler:rank=5,factor=1.4"), ("hang", "hang:rank=6,step=5"))}


def _after_last_write(run_dir: Path) -> None:
    """Wait until the file system's clock has moved past the newest modification time under
    ``run_dir``, so that a part written next changes its directory's mtime (what a poll looks at)."""
    newest = max(p.stat().st_mtime_ns for p in [run_dir, *run_dir.rglob("*")])
    probe = run_dir.parent / f".{run_dir.name}.clock"

    def fs_now() -> int:
        probe.touch()
        return probe.stat().st_mtime_ns

    wait_until(lambda: fs_now() > newest, timeout=10, message="the file system clock ticked")
    probe.unlink()


def _metric(text: str, name: str, run: str) -> float:
    match = re.search(rf'^{name}\{{run="{run}"\}} (\S+)$', text, re.M)
    assert match, f"{name} for {run} missing from:\n{text}"
    return float(match.group(1))


def _samples(text: str, name: str) -> list[dict[str, str]]:
    """The label sets of every sample of metric ``name`` (labels in any order)."""
    return [dict(re.findall(r'(\w+)="([^"]*)"', labels))
            for labels in re.findall(rf"^{name}\{{([^}}]*)\}} \S+$", text, re.M)]


# ------------------------------------------------------------------------------------ URLs


def test_rank_and_step_selections_round_trip() -> None:
    assert format_ranks([7, 0, 1, 2, 3, 9, 10]) == "0-3,7,9-10"
    assert parse_ranks("0-3,7,9-10", world_size=16) == [0, 1, 2, 3, 7, 9, 10]
    assert parse_ranks(" ", world_size=4) is None
    assert parse_steps("3") == (3, 3) and parse_steps("3-5") == (3, 5)
    assert parse_path("/run/demo/timeline") == ("demo", "timeline")
    assert parse_path("/") == (None, "overview")
    assert href("demo", "timeline", ranks=[4, 5], steps=(3, 3)) == "/run/demo/timeline?ranks=4-5&steps=3"


@pytest.mark.parametrize("text", ["a", "3-1", "-1", "0-16", "0-70"])
def test_bad_rank_selection_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="ranks"):
        parse_ranks(text, world_size=16 if text != "0-70" else 100)


@pytest.mark.parametrize("text", ["x", "5-2", "0-40"])
def test_bad_step_selection_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="steps"):
        parse_steps(text)


# ------------------------------------------------------------------------------------ safety


def test_binding_beyond_loopback_needs_a_token() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("myhost")
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", "a-long-secret")
    with pytest.raises(ConfigError, match="--token"):
        check_bind("0.0.0.0", None)
    with pytest.raises(ConfigError, match="at least 8"):
        check_bind("0.0.0.0", "short")


def test_token_guard(runs: dict[str, Path]) -> None:
    app = create_app([runs["straggler"]], host="0.0.0.0", token="s3cret-token", start_watcher=False)
    client = app.server.test_client()
    assert client.get("/").status_code == 403
    assert client.get("/metrics").status_code == 403
    assert client.get("/metrics", headers={"Authorization": "Bearer wrong-token"}).status_code == 403
    assert client.get("/metrics", headers={"Authorization": "Bearer s3cret-token"}).status_code == 200
    first = client.get("/run/straggler/overview?token=s3cret-token&x=1")
    assert first.status_code == 302 and "token" not in first.headers["Location"]
    assert "HttpOnly" in first.headers["Set-Cookie"]
    assert client.get("/_dash-layout").status_code == 200  # the cookie now carries the token


def test_create_app_refuses_open_bind_without_token(runs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError):
        create_app([runs["straggler"]], host="0.0.0.0", start_watcher=False)


def test_urls_never_reach_the_file_system(runs: dict[str, Path]) -> None:
    app = create_app([runs["straggler"]], start_watcher=False)
    client = app.server.test_client()
    assert client.get("/trace/hang.pftrace?ranks=0&steps=0").status_code == 404  # not served here
    # A path in place of an id never matches the trace route; at most Dash's page shell answers.
    for bad in ("/trace/..%2F..%2Fetc.pftrace?ranks=0&steps=0", f"/trace/{runs['hang']}.pftrace?ranks=0&steps=0"):
        response = client.get(bad)
        assert response.mimetype == "text/html" and b"<html" in response.data.lower()
    assert client.get("/trace/straggler.pftrace?ranks=0-99&steps=1").status_code == 400
    assert client.get("/trace/straggler.pftrace").status_code == 400
    assert registry_of(app).get("../straggler") is None


# ------------------------------------------------------------------------------------ registry


def test_run_ids_are_url_safe_and_unique(tmp_path: Path) -> None:
    assert run_id_for(tmp_path / "my run (1)", []) == "my-run-1"
    assert run_id_for(tmp_path / "a", ["a", "a-2"]) == "a-3"


def test_registry_rejects_missing_directories(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="no such run directory"):
        RunRegistry([tmp_path / "nope"])
    with pytest.raises(ConfigError):
        RunRegistry([])


def _spans_for_step(rank: int, step: int) -> pa.Table:
    row = {"rank": rank, "step": step, "name": "step", "kind": "step", "stream": "host",
           "start_ns": 1_000_000_000 * step, "dur_ns": 900_000_000}
    return pa.Table.from_pylist([row], schema=schema.SPANS)


def test_poll_sees_new_parts_and_bumps_the_generation(tmp_path: Path) -> None:
    run_dir = tmp_path / "live"
    layout.write_run_meta(run_dir, schema.RunMeta(run_id="live", source="synth", world_size=2))
    for rank in range(2):
        layout.write_part(run_dir, "spans", _spans_for_step(rank, 0), rank=rank)
    registry = RunRegistry([run_dir])
    served = registry.get("live")
    assert served is not None and served.generation == 1
    calls = []

    def count(run: object) -> int:
        calls.append(1)
        return served.run.con.execute("SELECT count(*) FROM spans").fetchall()[0][0]  # type: ignore[union-attr]

    assert served.result(("n",), count) == 2 and served.result(("n",), count) == 2
    assert len(calls) == 1  # cached within a generation
    served.poll()  # may report once more while the directory's mtime is fresh
    _after_last_write(run_dir)
    layout.write_part(run_dir, "spans", _spans_for_step(1, 1), rank=1)
    assert served.poll() is True
    assert served.result(("n",), count) == 3 and len(calls) == 2
    generation = served.generation
    served._settling = False  # as if two seconds had passed since the last write
    assert served.poll() is False and served.generation == generation


def test_waiting_registry_opens_the_run_when_it_appears(tmp_path: Path) -> None:
    run_dir = tmp_path / "later"
    registry = RunRegistry([run_dir], wait=True)
    served = registry.get("later")
    assert served is not None and served.run is None and "waiting" in (served.error or "")
    with pytest.raises(RunDirError):
        served.result(("x",), lambda run: 1)
    layout.write_run_meta(run_dir, schema.RunMeta(run_id="later", source="synth", world_size=1))
    layout.write_part(run_dir, "spans", _spans_for_step(0, 0), rank=0)
    assert served.poll() is True and served.run is not None and served.generation == 1


def test_watcher_thread_refreshes_and_stops(tmp_path: Path) -> None:
    run_dir = tmp_path / "w"
    layout.write_run_meta(run_dir, schema.RunMeta(run_id="w", source="synth", world_size=1))
    layout.write_part(run_dir, "spans", _spans_for_step(0, 0), rank=0)
    registry = RunRegistry([run_dir], poll_interval_s=0.05)
    served = registry.get("w")
    assert served is not None
    _after_last_write(run_dir)
    registry.start()
    try:
        before = served.generation
        layout.write_part(run_dir, "spans", _spans_for_step(0, 1), rank=0)
        wait_until(lambda: served.generation > before, timeout=30, message="the watcher saw the new part")
        assert served.generation > before
    finally:
        registry.stop()
    assert not any(t.name in ("megascope-watch", "megascope-follow") for t in threading.enumerate())


def test_the_follower_shows_new_steps_before_the_full_refresh(tmp_path: Path) -> None:
    run_dir = tmp_path / "f"
    layout.write_run_meta(run_dir, schema.RunMeta(run_id="f", source="synth", world_size=2))
    for rank in range(2):
        layout.write_spans_part(run_dir, _spans_for_step(rank, 0), rank=rank)
    registry = RunRegistry([run_dir])
    served = registry.get("f")
    assert served is not None
    assert served.follow() and served.live_generation == 1  # what is there: step 0
    assert dash_data.live_per_step(served)["step"].tolist() == [0]
    # A step only some ranks have ended is not shown: its time would be the fastest ranks'.
    layout.write_spans_part(run_dir, _spans_for_step(0, 1), rank=0)
    assert served.follow() and dash_data.live_per_step(served)["step"].tolist() == [0]
    layout.write_spans_part(run_dir, _spans_for_step(1, 1), rank=1)
    assert served.follow() and served.live_generation == 3
    # The analyses have not seen step 1 (no refresh yet); the overview's frame has it.
    assert dash_data.per_step(served)["step"].tolist() == [0]
    shown = dash_data.live_per_step(served)
    assert shown["step"].tolist() == [0, 1] and shown["step_time_ns"].tolist() == [900_000_000] * 2
    from megascope.dashboard.prom import RunsCollector

    last = next(f for f in RunsCollector(registry).collect() if f.name == "megascope_last_step")
    assert [sample.value for sample in last.samples] == [1.0]  # /metrics has the followed step too
    assert served.follow() is False and served.live_generation == 3  # nothing new
    # The header says the pages' analyses are a step behind the overview.
    assert "last step 1 (analyses through step 0)" in str(status_line(served))
    assert served.poll() is True
    assert dash_data.per_step(served)["step"].tolist() == dash_data.live_per_step(served)["step"].tolist() == [0, 1]
    header = str(status_line(served))
    assert "last step 1" in header and "analyses through" not in header


def test_the_heat_map_maps_the_followed_steps_while_the_analyses_are_behind(tmp_path: Path) -> None:
    from megascope.inject import parse_injects
    from megascope.synth import LiveSynth, SynthConfig

    cfg = SynthConfig(ranks=8, steps=100, tp=2, pp=2, seed=3, faults=parse_injects(["straggler:rank=6,factor=1.5"]))
    job = LiveSynth(tmp_path / "lv", cfg, threads=1)
    job.write_step()
    registry = RunRegistry([job.out])
    served = registry.get(registry.ids[0])
    assert served is not None and served.follow()
    assert dash_data.live_heatmap(served, "compute") is None  # the analyses have step 0 as well
    job.write_step(2)
    assert served.follow()
    frame = dash_data.live_heatmap(served, "compute")
    assert frame is not None and sorted(frame["step"].unique()) == [0, 1, 2] and len(frame) == 8 * 3
    assert frame.groupby("rank")["norm"].median().idxmax() == 6
    assert dash_data.live_heatmap(served, "compute") is frame  # once per follow
    assert served.poll() is True  # the analyses caught up: no live map
    assert dash_data.live_heatmap(served, "compute") is None
    # Between two full refreshes (minutes apart on a big run) the follower's new steps are the
    # progress the run state sees: a writing job is not read as stalled or failed.
    served.progress_seen_ns = time.time_ns() - 600 * 10**9
    assert dash_data.run_state(served)["state"] != "running"
    job.write_step()
    assert served.follow()
    assert dash_data.run_state(served)["state"] == "running", dash_data.run_state(served)["reason"]
    # The job then stops: the analyses last read the files before its last steps, so they cannot
    # tell hung from exited; stalled until a full refresh reads what came after.
    now = time.time_ns()
    served.refreshed_ns, served.progress_seen_ns = now - 700 * 10**9, now - 600 * 10**9
    state = dash_data.run_state(served)
    assert (state["state"], state["hung"]) == ("stalled", False) and "hung or exited" in state["reason"], state
    assert dash_data.hang(served)["hung"] is False
    served.refreshed_ns = now - 500 * 10**9  # a full read after the job went quiet: its facts decide
    assert dash_data.run_state(served)["state"] in ("hung", "failed")
    job.close()


def test_a_slow_full_refresh_waits_its_share(tmp_path: Path) -> None:
    run_dir = tmp_path / "s"
    layout.write_run_meta(run_dir, schema.RunMeta(run_id="s", source="synth", world_size=1))
    layout.write_spans_part(run_dir, _spans_for_step(0, 0), rank=0)
    with pytest.raises(ConfigError, match="full_share"):
        RunRegistry([run_dir], full_share=0)
    registry = RunRegistry([run_dir], full_share=0.5)
    served = registry.get("s")
    assert served is not None
    _after_last_write(run_dir)
    layout.write_spans_part(run_dir, _spans_for_step(0, 1), rank=0)
    served._next_full_s = time.monotonic() + 60  # as after a refresh that took 60 s
    assert registry.poll_all() == []  # not yet: the full refresh waits
    assert served.follow() and dash_data.live_per_step(served)["step"].tolist() == [0, 1]
    served._next_full_s = 0.0
    assert registry.poll_all() == ["s"]


def test_a_refresh_that_fails_is_tried_again_and_the_watcher_goes_on(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Any error of one run's refresh (DuckDB's own, not only OSError) is logged and tried again
    next poll, even with no new file: the watcher thread serves every run and must not die."""
    run_dir = tmp_path / "s"
    layout.write_run_meta(run_dir, schema.RunMeta(run_id="s", source="synth", world_size=1))
    layout.write_spans_part(run_dir, _spans_for_step(0, 0), rank=0)
    registry = RunRegistry([run_dir])
    served = registry.get("s")
    assert served is not None and served.run is not None
    _after_last_write(run_dir)
    layout.write_spans_part(run_dir, _spans_for_step(0, 1), rank=0)
    real = type(served.run).refresh
    failures = [duckdb.IOException("IO Error: No files found that match the pattern")]

    def refresh(run: Any) -> list[str]:
        if failures:
            raise failures.pop()
        return real(run)

    monkeypatch.setattr(type(served.run), "refresh", refresh)
    generation = served.generation
    assert registry.poll_all() == []  # logged, not raised
    assert served.generation == generation
    # Every page's header says the views are the last good refresh's, and why.
    assert served.refresh_error is not None and "No files found" in served.refresh_error
    header = str(status_line(served))
    assert "refresh failing (IO Error: No files found that match the pattern)" in header, header
    assert registry.poll_all() == ["s"]  # nothing new on disk, and still tried again
    assert served.generation == generation + 1
    assert served.refresh_error is None and "refresh failing" not in str(status_line(served))
    steps = served.run.con.execute("SELECT DISTINCT step FROM spans ORDER BY step").fetchall()
    assert steps == [(0,), (1,)]


def test_an_analysis_over_parts_a_pass_removed_reads_them_from_the_compacted_files(
        tmp_path: Path, synth: Synth) -> None:
    """A job's last pass (no grace) may remove parts between the watcher's refresh and a page's
    analysis: the analysis reads the run as it now is, never an error about a removed file."""
    from megascope.compact import compact

    run_dir = synth(tmp_path / "c", ranks=4, steps=6, tp=2, pp=1, seed=5, chunk_rows=200)
    query = "SELECT (SELECT count(*) FROM spans_unsummed), (SELECT coalesce(sum(spans), 0) FROM step_sums)"
    registry = RunRegistry([run_dir])
    served = registry.get("c")
    assert served is not None and served.run is not None
    expected = served.run.con.execute(query).fetchall()
    assert compact(run_dir, everything=True).parts_merged > 0
    assert not list(run_dir.glob(layout.table_glob("spans")))
    got = served.result(("count",), lambda run: run.con.execute(query).fetchall())
    assert got == expected


# ------------------------------------------------------------------------------------ data


def test_dashboard_numbers_are_the_analysis_numbers(runs: dict[str, Path]) -> None:
    app = create_app([runs["straggler"], runs["hang"]], start_watcher=False)
    registry = registry_of(app)
    straggler, hang = registry.get("straggler"), registry.get("hang")
    assert straggler is not None and hang is not None
    run = open_run(runs["straggler"])
    expected = analysis.stragglers(run)
    assert dash_data.stragglers(straggler)["rank"].tolist() == expected["rank"].tolist()
    assert dash_data.focus_rank(straggler) == int(expected.iloc[0]["rank"])
    states = dash_data.rank_states(hang).set_index("rank")["state"]
    assert states[6] == "hung" and (states.drop(6) == "waiting").all()
    assert dash_data.focus_rank(hang) == 6
    peers = dash_data.peers(straggler, 5)
    assert peers[0] == 5 and set(peers) == {4, 5, 7}  # its TP group (4, 5) and DP peer (7)


def test_overview_names_a_host_bound_rank(tmp_path: Path) -> None:
    """The overview's alerts carry the report's host-bound ranks, each linked to its timeline."""
    from megascope.dashboard.pages.overview import alerts

    app = create_app([host_bound_run(tmp_path / "hostbound")], start_watcher=False)
    served = registry_of(app).get("hostbound")
    assert served is not None
    assert dash_data.host_lead(served) == analysis.report(open_run(tmp_path / "hostbound"),
                                                          with_whatif=False)["host_lead"]
    text = [str(a) for a in alerts(served) if "alert-host" in str(a)]
    assert len(text) == 1 and "Host-bound: rank 1" in text[0] and "at 25% of 40 calls" in text[0]
    assert "/run/hostbound/timeline?ranks=1" in text[0]


def test_a_mesh_without_peers_says_stragglers_cannot_be_told(synth: Synth, tmp_path: Path) -> None:
    """pp=2 on two ranks: the overview and the stragglers page say that no rank has a peer, not
    "no stragglers"; a mesh with peers keeps "no stragglers" on the overview."""
    from megascope.dashboard.pages.overview import alerts

    alone = synth(tmp_path / "alone", "straggler:rank=1,factor=1.6", ranks=2, pp=2, tp=1, steps=6, seed=3)
    served = registry_of(create_app([alone], start_watcher=False)).get("alone")
    assert served is not None and not dash_data.stragglers_told(served)
    text = [str(a) for a in alerts(served)]
    assert any("no pipeline stage has two ranks" in t for t in text)
    assert not any("No stragglers" in t for t in text)
    healthy = synth(tmp_path / "healthy", ranks=4, pp=2, tp=1, steps=6, seed=3)
    served = registry_of(create_app([healthy], start_watcher=False)).get("healthy")
    assert served is not None and dash_data.stragglers_told(served)
    text = [str(a) for a in alerts(served)]
    assert any("No stragglers" in t for t in text) and not any("no pipeline stage" in t for t in text)


def test_a_straggler_named_on_its_steps_together_is_never_said_slow_in_no_step(tmp_path: Path) -> None:
    """A rank named for its steps together, though no single step passed the per-step bar (a real
    dp8 run's 50 ms pause read "slow in 0% of steps"), is said to be that; a rank slow in some
    steps keeps the share (tests/data/cpu-dp8-pause, a real gloo run: rank 6, 2 of 16 steps)."""
    import shutil

    from megascope.dashboard.pages.overview import alerts, slow_steps_text

    assert slow_steps_text({"steps_slow_frac": 0.0, "last_arrival_frac": 0.29}) == \
        "slow over its steps together, none alone past the per-step bar, last at 29% of its calls"
    assert slow_steps_text({"steps_slow_frac": 0.0, "last_arrival_frac": float("nan")}) == \
        "slow over its steps together, none alone past the per-step bar"
    run_dir = shutil.copytree(Path(__file__).parent / "data" / "cpu-dp8-pause", tmp_path / "pause")
    served = registry_of(create_app([run_dir], start_watcher=False)).get("pause")
    assert served is not None
    frame = dash_data.stragglers(served)
    assert list(frame["rank"]) == [6] and float(frame.iloc[0]["steps_slow_frac"]) == 0.125
    text = " ".join(str(a) for a in alerts(served))
    assert "Straggler: rank 6" in text and "cause host, slow in 12% of steps" in text


def test_the_stragglers_page_says_why_a_rank_late_at_every_call_is_not_named(tmp_path: Path) -> None:
    """A rank late by a steady offset at overlapping calls (analysis: flagged for its host, not
    named) gets a line under the empty table with the replay's saving; a run without one, none."""
    from megascope.dashboard.pages.overview import alerts, straggler_card
    from megascope.dashboard.pages.stragglers import dismissed_notes, none_named

    overlapped_run(tmp_path / "offset", seed=3, late=2)
    served = registry_of(create_app([tmp_path / "offset"], start_watcher=False)).get("offset")
    assert served is not None and dash_data.stragglers(served).empty
    notes = [str(n) for n in dismissed_notes(served)]
    assert len(notes) == 1 and "Not named: rank 2" in notes[0] and "saves 0." in notes[0]
    assert not any("At least" in n for n in notes) and any("No stragglers" in str(a) for a in alerts(served))
    overlapped_run(tmp_path / "plain", seed=3)
    served = registry_of(create_app([tmp_path / "plain"], start_watcher=False)).get("plain")
    assert served is not None and dismissed_notes(served) == []
    # Some calls untimed: the replay's saving is a lower bound; the page and the overview say so,
    # and the overview does not call the run clean.
    overlapped_run(tmp_path / "sampled", seed=3, late=2, untimed=2)
    served = registry_of(create_app([tmp_path / "sampled"], start_watcher=False)).get("sampled")
    assert served is not None and dash_data.stragglers(served).empty
    notes = [str(n) for n in dismissed_notes(served)]
    assert "saves at least 0." in notes[0] and "At least: the collector timed some calls" in notes[1]
    text = [str(a) for a in alerts(served)]
    assert any("Late, not named: rank 2" in t for t in text) and not any("No stragglers" in t for t in text)
    assert "cost unsure" in str(straggler_card(served, 0)) and "good" not in str(straggler_card(served, 0))
    cards, headline = none_named(served, dismissed_notes(served))
    assert headline.startswith("No stragglers named:") and "unsure" in str(cards[0]) and "nothing to gain" not in str(cards)
    cards, headline = none_named(served, [])
    assert "every rank keeps up" in headline and "nothing to gain" in str(cards[0])


def test_synth_runs_have_no_host_bound_alert(runs: dict[str, Path]) -> None:
    from megascope.dashboard.pages.overview import host_bound_alerts

    served = registry_of(create_app([runs["straggler"]], start_watcher=False)).get("straggler")
    assert served is not None and host_bound_alerts(served) == []


def test_timeline_waits_come_from_the_last_arrival(runs: dict[str, Path]) -> None:
    registry = RunRegistry([runs["straggler"]])
    served = registry.get("straggler")
    assert served is not None
    spans, steps, labels = dash_data.timeline(served, [4, 5], (3, 3))
    assert set(spans["rank"]) == {4, 5} and set(spans["step"]) == {3}
    assert labels == {4: "r4 pp1 dp0 tp0", 5: "r5 pp1 dp0 tp1"}
    tp = spans[spans["group"].astype(str).str.startswith("tp:")]
    for _seq, members in tp.groupby("seq"):
        assert len(members) == 2
        last = members["start_ns"].max()
        for row in members.itertuples():
            assert row.wait_ns == min(last - row.start_ns, row.dur_ns)
    # The straggler (rank 5, slow compute) arrives last: its TP peer waits for it, it waits little.
    waits = tp.groupby("rank")["wait_ns"].sum()
    assert waits[4] > 3 * waits[5]
    assert len(steps) == 2


def test_metrics_endpoint(runs: dict[str, Path]) -> None:
    app = create_app([runs["straggler"], runs["hang"]], start_watcher=False)
    response = app.server.test_client().get("/metrics")
    assert response.status_code == 200 and response.mimetype == "text/plain"
    text = response.get_data(as_text=True)
    run = open_run(runs["straggler"])
    expected = analysis.stragglers(run)
    per_step = analysis.mfu(run)
    assert _metric(text, "megascope_stragglers", "straggler") == len(expected) > 0
    assert _metric(text, "megascope_straggler_worst_slowdown_ratio", "straggler") == pytest.approx(
        expected["slowdown"].max())
    assert _metric(text, "megascope_mfu_ratio", "straggler") == pytest.approx(per_step["mfu"].iloc[-1])
    assert _metric(text, "megascope_step_time_seconds", "straggler") == pytest.approx(
        per_step["step_time_ns"].iloc[-1] / 1e9)
    assert _metric(text, "megascope_hung", "straggler") == 0
    assert _metric(text, "megascope_hung", "hang") == 1
    assert _metric(text, "megascope_run_up", "hang") == 1


def test_metrics_carry_the_run_state_and_the_culprit(runs: dict[str, Path]) -> None:
    app = create_app([runs["straggler"], runs["hang"]], start_watcher=False)
    response = app.server.test_client().get("/metrics")
    assert response.headers["Content-Type"].count("charset") == 1
    text = response.get_data(as_text=True)
    states = dict(re.findall(r'^megascope_run_state\{run="hang",state="(\w+)"\} (\S+)$', text, re.M))
    assert set(states) == {"running", "stalled", "hung", "finished", "failed"}
    assert {k for k, v in states.items() if float(v) == 1.0} == {"hung"}
    assert re.search(r'^megascope_run_state\{run="straggler",state="finished"\} 1\.0$', text, re.M)
    culprits = _samples(text, "megascope_hang_culprit")
    assert [(c["run"], c["rank"], c["pp"], c["dp"], c["tp"]) for c in culprits] == [("hang", "6", "1", "1", "0")]
    assert culprits[0]["host"] and culprits[0]["group"]
    assert _metric(text, "megascope_last_data_age_seconds", "hang") >= 0
    worst = [w for w in _samples(text, "megascope_straggler_worst") if w["run"] == "straggler"]
    assert len(worst) == 1 and worst[0]["rank"] == "5" and worst[0]["cause"] == "compute"


def test_a_live_run_with_calls_in_flight_shows_no_hang(runs: dict[str, Path], tmp_path: Path) -> None:
    # The hung run replayed up to its hang, with times shifted to now: exactly what a healthy live
    # job looks like between two flushes (calls entered, not yet completed).
    live = tmp_path / "live"
    replay_run(runs["hang"], live, step_interval_s=0.0)
    app = create_app([live], start_watcher=False)
    served = registry_of(app).get("live")
    assert served is not None
    assert dash_data.localized(served)["waiting"], "the replay should leave calls in flight"
    state = dash_data.run_state(served)
    assert state["state"] == "running" and not state["hung"]
    assert dash_data.hang(served)["hung"] is False and dash_data.hang(served)["suspects"] == []
    assert set(dash_data.rank_states(served)["state"]) <= {"healthy", "slow"}
    text = app.server.test_client().get("/metrics").get_data(as_text=True)
    assert _metric(text, "megascope_hung", "live") == 0
    assert re.search(r'^megascope_run_state\{run="live",state="running"\} 1\.0$', text, re.M)


@pytest.mark.timing
def test_a_live_run_turns_hung_after_the_collective_timeout_without_new_data(runs: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    live = tmp_path / "live"
    replay_run(runs["hang"], live, step_interval_s=0.0)
    meta = json.loads((live / layout.RUN_JSON).read_text())
    meta["config"]["collective_timeout_s"] = 2.0
    (live / layout.RUN_JSON).write_text(json.dumps(meta))
    app = create_app([live], start_watcher=False)
    served = registry_of(app).get("live")
    assert served is not None
    client = app.server.test_client()
    first = client.get("/metrics").get_data(as_text=True)
    assert _metric(first, "megascope_hung", "live") == 0
    generation = served.generation
    # The replay shifted the run's first span to "now", so its last progress lies a little ahead:
    # wait until the collective timeout has passed since then. (The served run state reads the wall
    # clock and takes no other: the time going by without new data is what this test is about.)
    facts = dash_data.run_facts(served)
    last = max(t for t in (facts["last_progress_ns"], facts["last_data_ns"]) if t is not None)
    time.sleep(max(0.0, last / 1e9 + 2.0 + 0.5 - time.time()))
    later = client.get("/metrics").get_data(as_text=True)
    assert served.generation == generation, "no new data arrived"
    assert _metric(later, "megascope_hung", "live") == 1
    assert re.search(r'^megascope_run_state\{run="live",state="hung"\} 1\.0$', later, re.M)
    assert dash_data.hang(served)["suspects"][0]["rank"] == 6
    assert dash_data.rank_states(served).set_index("rank")["state"][6] == "hung"


def test_straggler_page_speaks_in_percent_and_relative_gains() -> None:
    import pandas as pd
    from megascope.dashboard.pages.stragglers import shown_columns, shown_frame, whatif_cards

    def text(component: object) -> str:
        found: list[str] = []

        def walk(node: object) -> None:
            if isinstance(node, str):
                found.append(node)
            elif isinstance(node, list | tuple):
                for child in node:
                    walk(child)
            elif getattr(node, "children", None) is not None:
                walk(node.children)  # type: ignore[attr-defined]

        walk(component)
        return " ".join(found)

    frame = shown_frame(pd.DataFrame({"rank": [5, 6], "slowdown": [5.6229, 1.2], "steps_slow_frac": [0.6269, 0.5],
                                      "last_arrival_frac": [0.957, 0.5], "cpu_slowdown": [1.914, float("nan")],
                                      "tp_compute_ratio": [float("nan"), 1.2016]}))
    assert frame.iloc[0].tolist() == [5, "x5.62", "63%", "96%", "x1.91", ""]
    assert frame.iloc[1]["cpu_slowdown"] == ""  # no host probes
    assert frame.iloc[1]["tp_compute_ratio"] == "x1.20"  # named for its compute outside the TP calls
    # How often a host straggler's GPU sat idle waiting for it: shown for `host` at 5% or more only.
    idle = shown_frame(pd.DataFrame({"rank": [1, 2, 3, 4], "cause": ["host", "host", "compute", "host"],
                                     "device_idle_frac": [0.0741, 0.02, 0.3, float("nan")]}))
    assert idle["device_idle_frac"].tolist() == ["7%", "", "", ""]
    # A later stage of a slow rank's pipeline replica, listed after it: the rank it is behind.
    behind = shown_frame(pd.DataFrame({"rank": [0, 4], "behind": [float("nan"), 0.0]}))
    assert behind["behind"].tolist() == ["", "rank 0"]
    # Evidence columns that no row has a value in are left out of the table; the rest stay.
    rows = shown_frame(pd.DataFrame({"rank": [0, 4], "cause": ["compute", "host"], "slowdown": [1.2, 1.1],
                                     "behind": [float("nan"), 0.0], "tp_compute_ratio": [float("nan")] * 2,
                                     "slow_groups": [None, None], "device_idle_frac": [0.5, 0.01]}))
    assert shown_columns(rows) == ["rank", "cause", "slowdown", "behind"]
    gross = " ".join(text(c) for c in whatif_cards(
        {"step_time_ns": 569e6, "whatif_step_time_ns": 455e6, "speedup": 569 / 455, "mfu": 0.0016,
         "whatif_mfu": 0.0016 * 569 / 455, "ranks": [5]}, n_stragglers=1))
    assert "569.0 -> 455.0 ms" in gross and "steps 20.0% shorter, throughput +25.1%" in gross and "pts" in gross
    slack = " ".join(text(c) for c in whatif_cards(
        {"step_time_ns": 642.4e6, "whatif_step_time_ns": 642.1e6, "speedup": 1.0005, "mfu": 0.2788,
         "whatif_mfu": 0.2788 * 1.0005, "ranks": [77]}, n_stragglers=1))
    assert "steps 0.05% shorter, throughput +0.05%" in slack and "slack" in slack and "hosts' pace" not in slack
    # Held to the hosts' pace (a host-bound job): the card says what holds it.
    held = " ".join(text(c) for c in whatif_cards(
        {"step_time_ns": 203.1e6, "whatif_step_time_ns": 183.2e6, "replay_step_time_ns": 119.9e6, "speedup": 203.1 / 183.2,
         "host_floor": {"ranks": [0], "rank": 0, "issue_ns": 183.2e6}, "ranks": [1]}, n_stragglers=1))
    assert "203.1 -> 183.2 ms" in held and "held to the hosts' pace: rank 0's host takes 183.2 ms to issue a step" in held
    # A slow link named alone: nothing was replayed, and no step time is shown as if it had been.
    link = " ".join(text(c) for c in whatif_cards(
        {"step_time_ns": 1733e6, "whatif_step_time_ns": 1733e6, "speedup": 1.0, "ranks": []}, n_stragglers=1))
    assert "communication causes only" in link and "not replayed" in link and "ms" not in link and "slack" not in link


# ------------------------------------------------------------------------------------ replay, CLI


def test_replay_writes_a_run_step_by_step(runs: dict[str, Path], tmp_path: Path) -> None:
    dst = tmp_path / "live"
    before = time.time_ns()
    assert replay_run(runs["straggler"], dst, step_interval_s=0.0, max_steps=4) == 4
    src, out = open_run(runs["straggler"]), open_run(dst)
    assert out.problems == [] and out.meta.world_size == 8
    assert out.con.execute("SELECT max(step) FROM spans").fetchall() == [(3,)]
    count = "SELECT count(*) FROM spans WHERE step <= 3"
    assert out.con.execute(count).fetchall() == src.con.execute(count).fetchall()
    (first,) = out.con.execute("SELECT min(start_ns) FROM spans").fetchall()[0]
    assert before <= first <= time.time_ns()
    # one part per rank per step and table: what a live collector's flushes look like
    assert len(list(dst.glob("spans/rank=00005/*.parquet"))) == 4
    with pytest.raises(RunDirError, match="already holds a run"):
        replay_run(runs["straggler"], dst)


def test_serve_refuses_open_bind_without_token(runs: dict[str, Path], cli: Callable[..., Result]) -> None:
    result = cli("serve", str(runs["straggler"]), "--host", "0.0.0.0")
    assert result.exit_code != 0
    assert "--token" in result.output and "Traceback" not in result.output


def test_serve_missing_run_is_one_line(tmp_path: Path, cli: Callable[..., Result]) -> None:
    result = cli("serve", str(tmp_path / "nope"))
    assert result.exit_code != 0 and "no such run directory" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_demo_bad_inject_is_one_line(cli: Callable[..., Result]) -> None:
    result = cli("demo", "--inject", "straggler:rank=x")
    assert result.exit_code != 0 and "not a valid int" in result.output


def test_a_failing_analysis_is_not_rerun_until_new_data(tmp_path: Path) -> None:
    run_dir = tmp_path / "f"
    layout.write_run_meta(run_dir, schema.RunMeta(run_id="f", source="synth", world_size=1))
    layout.write_part(run_dir, "spans", _spans_for_step(0, 0), rank=0)
    served = RunRegistry([run_dir]).get("f")
    assert served is not None
    calls = []

    def broken(run: object) -> None:
        calls.append(1)
        raise ConfigError("cannot analyse this yet")

    for _ in range(3):
        with pytest.raises(ConfigError, match="cannot analyse"):
            served.result(("broken",), broken)
    assert len(calls) == 1
    _after_last_write(run_dir)
    layout.write_part(run_dir, "spans", _spans_for_step(0, 1), rank=0)
    assert served.poll()
    with pytest.raises(ConfigError):
        served.result(("broken",), broken)
    assert len(calls) == 2


def test_demo_launches_the_trainer_on_a_2x2x2_mesh_with_the_straggler(tmp_path: Path) -> None:
    from megascope.dashboard.demo import trainer_command

    command = trainer_command(tmp_path / "run", steps=7, inject="straggler:rank=5,factor=1.6")
    args = " ".join(command[1:])
    assert args.startswith("-m megascope train --nproc 8")
    for expected in ("--tp 2", "--pp 2", "--dp 2", "--steps 7", "--inject straggler:rank=5,factor=1.6",
                     f"-o {tmp_path / 'run'}"):
        assert expected in args


def test_demo_says_how_its_training_ended_and_keeps_a_trainer_that_failed_at_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer that fails (a planted crash) is said so in one line with the launcher's own words,
    while the dashboard keeps showing the run; one that ends before the start probe but wrote its
    run is kept (it ran and failed), not taken for a missing trainer replaced by a synthetic run."""
    import subprocess

    from megascope.dashboard import demo

    said: list[str] = []
    log_path = tmp_path / "run.train.log"
    log_path.write_text("rank 1: noise\nError: training failed on rank 1: planted crash on rank 1 in step 3\n")
    failing = subprocess.Popen(["bash", "-c", "sleep 0.2; exit 1"], start_new_session=True)
    demo.DemoJob(out=tmp_path, process=failing, log_path=log_path).watch_end(said.append).join(10)  # type: ignore[union-attr]
    assert said == ["demo: training failed on rank 1: planted crash on rank 1 in step 3; the dashboard shows the "
                    "run as it stopped (Ctrl-C stops it)"]
    done = subprocess.Popen(["true"], start_new_session=True)
    demo.DemoJob(out=tmp_path, process=done).watch_end(said.append).join(10)  # type: ignore[union-attr]
    assert said[-1].startswith("demo: the training finished")
    stopped = subprocess.Popen(["sleep", "30"], start_new_session=True)
    job = demo.DemoJob(out=tmp_path, process=stopped)
    watcher = job.watch_end(said.append)
    job.stop(timeout_s=4)
    watcher.join(10)  # type: ignore[union-attr]
    assert len(said) == 2  # stopped by the demo itself: nothing said

    out = tmp_path / "crashed"
    script = (f"mkdir -p {out} && echo '{{}}' > {out}/run.json && "
              "echo 'Error: training failed on rank 0: planted crash on rank 0 in step 0'; exit 1")
    monkeypatch.setattr(demo, "trainer_command", lambda out, steps, inject: ["bash", "-c", script])
    job = demo.start_trainer(out, steps=3, inject="crash:rank=0,step=0", probe_s=10)
    assert job is not None and job.process is not None
    assert "ended: training failed on rank 0: planted crash on rank 0 in step 0" in job.description


def test_demo_stop_ends_the_whole_job(tmp_path: Path) -> None:
    import os
    import subprocess

    from megascope.dashboard.demo import DemoJob

    # A launcher with a child, like the trainer and its ranks, in its own process group.
    process = subprocess.Popen(["bash", "-c", "sleep 60 & echo $! > child.pid; wait"], cwd=tmp_path,
                               start_new_session=True)
    pid_file = tmp_path / "child.pid"
    wait_until(lambda: pid_file.exists() and pid_file.read_text().strip(), timeout=30, message="the child started")
    child = int(pid_file.read_text())
    DemoJob(out=tmp_path, process=process).stop(timeout_s=4)
    assert process.poll() is not None

    def child_gone() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return True
        return False

    wait_until(child_gone, timeout=5, message="the launcher's child survived")


def test_the_watcher_follows_a_run_that_writes(tmp_path: Path) -> None:
    run_dir = tmp_path / "lw"
    layout.write_run_meta(run_dir, schema.RunMeta(run_id="lw", source="synth", world_size=1))
    layout.write_spans_part(run_dir, _spans_for_step(0, 0), rank=0)
    registry = RunRegistry([run_dir], poll_interval_s=0.05)
    served = registry.get("lw")
    assert served is not None
    _after_last_write(run_dir)
    registry.start()
    try:
        time.sleep(0.3)
        assert served.live_generation == 0  # nothing written while served: not followed
        layout.write_spans_part(run_dir, _spans_for_step(0, 1), rank=0)
        wait_until(lambda: served.live_generation > 0, timeout=30, message="the follower read the new step")
        assert 1 in served.live_steps()["step"].tolist()
    finally:
        registry.stop()


def test_metrics_name_the_rank_a_failed_run_lost(tmp_path: Path) -> None:
    """tests/data/cpu-2x2x2-rank-killed: rank 6 killed with SIGKILL; /metrics says the run failed
    and which rank its state names."""
    import shutil

    run = shutil.copytree(Path(__file__).parent / "data" / "cpu-2x2x2-rank-killed", tmp_path / "killed")
    app = create_app([run], start_watcher=False)
    text = app.server.test_client().get("/metrics").get_data(as_text=True)
    assert re.search(r'^megascope_run_state\{run="killed",state="failed"\} 1\.0$', text, re.M)
    failed = _samples(text, "megascope_failed_rank")
    assert [(f["run"], f["rank"], f["where"]) for f in failed] == [("killed", "6", "ended with no exception of its own")]
    assert _samples(text, "megascope_hang_culprit") == []
