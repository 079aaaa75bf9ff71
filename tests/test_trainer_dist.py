"""The bundled trainer on several gloo processes: every mesh trains the same model as one process,
and planted faults leave their trace in the run directory.

Tolerance for "the same loss": every layout computes the same sums in fp32, only in a different
order (TP splits matmul reductions and the vocabulary softmax; DP sums gradients across ranks; the
gradient norm is summed shard by shard). One reordered fp32 sum differs by a few ulps (~1e-7
relative); a handful of AdamW steps at lr 3e-3 keep that at the 1e-6 level (measured: <=1e-6
absolute on a loss of ~4). ``rtol=2e-5`` leaves 20x headroom yet is far below what any real
sharding bug produces (a wrong slice, a missing all-reduce or a doubled gradient moves the loss in
the second or third decimal within the first two steps).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest
from click.testing import Result
from conftest import ended_ranks, wait_until

from megascope.inject import parse_injects
from megascope.store import open_run
from megascope.trainer import ModelConfig, TrainConfig, TrainingError, train

pytestmark = pytest.mark.dist

MODEL = ModelConfig(layers=2, hidden=32, heads=4, vocab=64, seq_len=16)
RTOL = 2e-5
# The collective timeout of the planted-hang job. Every collective before the hang must finish
# within it too, or the job fails in the wrong place: with eight processes on a loaded two-core
# machine a healthy rank can be descheduled for seconds (3 s failed the [all] case once at load ~9).
# The test waits the timeout out once, so it is generous rather than long.
HANG_TIMEOUT_S = 15.0


def _cfg(out: Path, tp: int = 1, pp: int = 1, dp: int = 1, **kw: object) -> TrainConfig:
    base = dict(out=out, world_size=tp * pp * dp, tp=tp, pp=pp, dp=dp, steps=3, global_batch=8, micro_batches=2,
                model=MODEL, collective_timeout_s=30.0, peak_flops=1e9, flush_interval_s=0.2)
    base.update(kw)
    return TrainConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return train(_cfg(tmp_path_factory.mktemp("ref") / "run"), nproc=1).losses


@pytest.mark.parametrize(("tp", "pp", "dp"), [(2, 2, 2), (1, 2, 1), (2, 1, 1), (1, 1, 2)],
                         ids=lambda v: str(v))
def test_every_mesh_matches_one_process(tmp_path: Path, reference: list[float], tp: int, pp: int, dp: int) -> None:
    result = train(_cfg(tmp_path / "run", tp, pp, dp), nproc=tp * pp * dp)
    assert result.losses == pytest.approx(reference, rel=RTOL)
    assert reference[-1] < reference[0]  # it learns
    run = open_run(result.out)
    assert run.problems == []
    assert run.meta.mesh_sizes == {"pp": pp, "dp": dp, "tp": tp}
    # Every rank logged the same global loss per step.
    logged = run.con.execute("SELECT step, min(value), max(value), count(*) FROM metrics WHERE name = 'loss' "
                         "GROUP BY step ORDER BY step").fetchall()
    assert [r[3] for r in logged] == [tp * pp * dp] * 3
    assert [r[1] for r in logged] == pytest.approx(result.losses, rel=1e-6)
    assert all(r[1] == r[2] for r in logged)
    # One host: each rank's local rank is its rank (as torchrun would set it), so the host's own
    # heartbeat rows (CPU, memory, network) come from local rank 0 alone.
    assert run.con.execute("SELECT count(*) FROM ranks WHERE local_rank IS DISTINCT FROM rank").fetchone() == (0,)
    if Path("/proc/loadavg").exists():
        host_rows = run.con.execute("SELECT DISTINCT rank FROM heartbeats WHERE metric = 'load_1m'").fetchall()
        assert host_rows == [(0,)]
    if tp * pp * dp == 8:
        _check_3d_run_directory(run.con)


def _check_3d_run_directory(con: object) -> None:
    """A 2x2x2 run records every phase, every group, per-micro-batch and per-block spans."""
    con = cast(Any, con)
    kinds = {k for (k,) in con.execute("SELECT DISTINCT kind FROM spans").fetchall()}
    assert {"step", "data", "forward", "backward", "collective", "send", "recv", "optimizer"} <= kinds
    groups = {g for (g,) in con.execute("SELECT DISTINCT \"group\" FROM spans WHERE \"group\" IS NOT NULL").fetchall()}
    assert {f"{axis}:{i}" for axis in ("tp", "pp", "dp") for i in range(4)} | {"world"} == groups
    per_rank = con.execute("SELECT rank, count(*) FROM spans WHERE name = 'forward' GROUP BY rank").fetchall()
    assert sorted(per_rank) == [(r, 3 * 2) for r in range(8)]  # 3 steps x 2 micro-batches
    assert con.execute("SELECT count(DISTINCT name) FROM spans WHERE name LIKE 'layers.%'").fetchone() == (2,)
    metrics = {m for (m,) in con.execute("SELECT DISTINCT name FROM metrics").fetchall()}
    assert {"loss", "grad_norm", "lr", "tokens", "host_loop_ns"} <= metrics
    # Every collective instance has all its members (each member's arrival recorded).
    incomplete = con.execute("""
        SELECT s."group", s.seq, count(DISTINCT s.rank) AS n, any_value(len(g.members)) AS size
        FROM spans s JOIN groups g ON g.rank = s.rank AND g."group" = s."group"
        WHERE s.kind = 'collective' GROUP BY ALL HAVING n <> size""").fetchall()
    assert incomplete == []


def test_serial_block_plain_tp_window_and_lamb_match_one_process(tmp_path: Path) -> None:
    model = replace(MODEL, parallel_block=False, window=6)
    kw = {"model": model, "optimizer": "lamb", "sequence_parallel": False}
    ref = train(_cfg(tmp_path / "ref", **kw), nproc=1).losses
    got = train(_cfg(tmp_path / "tp", tp=2, **kw), nproc=2).losses
    assert got == pytest.approx(ref, rel=RTOL)
    assert ref[-1] < ref[0]


def _self_compute(con: Any, rank: int) -> float:
    """Forward+backward time of ``rank`` minus the communication inside it (its own compute)."""
    return con.execute(f"""
        WITH c AS (SELECT * FROM spans WHERE rank = {rank} AND kind IN ('forward', 'backward')
                   AND name IN ('forward', 'backward') AND step > 0),
             comm AS (SELECT * FROM spans WHERE rank = {rank} AND kind IN ('collective', 'send', 'recv'))
        SELECT sum(c.dur_ns) - coalesce((SELECT sum(comm.dur_ns) FROM comm JOIN c ON comm.start_ns >= c.start_ns
                AND comm.start_ns + comm.dur_ns <= c.start_ns + c.dur_ns), 0) FROM c""").fetchone()[0]


def test_straggler_does_real_extra_compute(tmp_path: Path) -> None:
    rank = 5
    cfg = _cfg(tmp_path / "run", 2, 2, 2, steps=3, faults=parse_injects([f"straggler:rank={rank},factor=6"]),
               )
    run = open_run(train(cfg, nproc=8).out)
    own = {r: _self_compute(run.con, r) for r in range(8)}
    stage = run.con.execute(f"SELECT rank FROM ranks WHERE coords['pp'] = (SELECT coords['pp'] FROM ranks WHERE rank = {rank}) "
                        f"AND rank <> {rank}").fetchall()
    peers = sorted(own[r] for (r,) in stage)
    assert own[rank] > 2.0 * peers[len(peers) // 2], own
    assert run.meta.config["inject"] == [f"straggler:rank={rank},factor=6"]


@pytest.mark.timing
def test_skew_delays_the_ranks_arrival_at_the_dp_sync(tmp_path: Path) -> None:
    # The pause is a host sleep; what it is measured against is when the rank's dp peer arrived,
    # and a peer descheduled on a loaded machine arrives late by a time of its own (a 300 ms pause
    # once showed as 63 ms at step 2). A pause of 1 s leaves 400 ms of such noise within the bound.
    rank, ms = 6, 1000
    cfg = _cfg(tmp_path / "run", 2, 2, 2, steps=3, faults=parse_injects([f"skew:rank={rank},ms={ms}"]))
    run = open_run(train(cfg, nproc=8).out)
    # First dp reduce-scatter of each step: the skewed rank arrives last, by about the pause.
    gaps = run.con.execute(f"""
        WITH first AS (SELECT rank, step, "group", min(seq) AS seq FROM spans
                       WHERE op = 'reduce_scatter' AND "group" LIKE 'dp:%' GROUP BY ALL),
             arr AS (SELECT s.rank, s.step, s.start_ns FROM spans s JOIN first f USING (rank, step, "group", seq)),
             mine AS (SELECT g."group" FROM groups g WHERE g.rank = {rank} AND g.kind = 'dp')
        SELECT a.step, max(CASE WHEN a.rank = {rank} THEN a.start_ns END)
                       - max(CASE WHEN a.rank <> {rank} THEN a.start_ns END)
        FROM arr a JOIN groups g ON g.rank = a.rank AND g."group" IN (SELECT "group" FROM mine)
        GROUP BY a.step ORDER BY a.step""").fetchall()
    assert len(gaps) == 3
    # Step 0 carries one-time costs (first allocations, lazy initialisation) that differ between
    # ranks by as much as the pause on a loaded machine; from step 1 on the pause stands out.
    assert all(gap > 0.6 * ms * 1e6 for step, gap in gaps if step > 0), gaps


@pytest.mark.timing
@pytest.mark.parametrize("tp_spans", ["all", "first"])
def test_hang_times_out_the_job_and_leaves_the_trail(tmp_path: Path, tp_spans: str) -> None:
    """Also when TP calls are timed in the first micro-batch only: every call keeps its markers."""
    from megascope.analysis import localize

    rank, step = 3, 1
    cfg = _cfg(tmp_path / "run", 2, 2, 2, steps=3, collective_timeout_s=HANG_TIMEOUT_S,
               faults=parse_injects([f"hang:rank={rank},step={step}"]), tp_comm_spans=tp_spans)
    with pytest.raises(TrainingError, match=rf"collective timed out after {HANG_TIMEOUT_S:g} s \(--collective-timeout\)") as err:
        train(cfg, nproc=8)
    assert "\n" not in str(err.value)
    # train() waits a bounded 10 s for the marker agents' last passes; on a loaded machine the
    # killed ranks' agents can take longer, and the trail asserted below is what they write.
    wait_until(lambda: ended_ranks(cfg.out) == set(range(8)), timeout=120,
               message="every rank's marker agent made its last pass")
    run = open_run(cfg.out)
    con = run.con
    # The hung rank finished step 0 and completed nothing in the hang step.
    assert con.execute(f"SELECT max(step) FROM spans WHERE rank = {rank} AND kind = 'step'").fetchone() == (step - 1,)
    assert con.execute(f"SELECT count(*) FROM markers WHERE rank = {rank} AND step = {step} "
                   "AND state = 'completed'").fetchone() == (0,)
    # A peer entered a collective with the hung rank that the hung rank never entered.
    waiting = con.execute(f"""
        SELECT m."group", m.seq FROM markers m JOIN groups g ON g.rank = {rank} AND g."group" = m."group"
        WHERE m.rank <> {rank} AND m.state = 'enqueued' AND NOT EXISTS (
            SELECT 1 FROM markers c WHERE c.rank = m.rank AND c."group" = m."group" AND c.seq = m.seq
              AND c.state = 'completed')
          AND NOT EXISTS (SELECT 1 FROM markers h WHERE h.rank = {rank} AND h."group" = m."group" AND h.seq = m.seq)
    """).fetchall()
    assert waiting
    found = localize(run)
    assert found["hung"] and found["suspects"][0]["rank"] == rank


def test_a_hang_the_backend_does_not_end_is_stopped_by_the_launcher(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL's abort can itself block, so a hung job may outlive its collective timeout: once no rank
    has ended a step for the stall limit, the local launcher stops every rank with one line. Here the
    collective timeout is long (gloo would wait it out) and the stall limit short."""
    from megascope.trainer import launch

    monkeypatch.setattr(launch, "stall_limit_s", lambda timeout_s: 4.0)
    cfg = _cfg(tmp_path / "run", 1, 1, 2, steps=3, collective_timeout_s=600.0,
               faults=parse_injects(["hang:rank=1,step=1"]))
    began = time.monotonic()
    with pytest.raises(TrainingError, match=r"no rank ended a step for \d+ s, past the collective timeout of 600 s") as err:
        train(cfg, nproc=2)
    assert "\n" not in str(err.value)
    assert time.monotonic() - began < 120  # not the 600 s timeout
    # The ranks were stopped, and what their marker agents left names the hung rank.
    from megascope.analysis import localize

    wait_until(lambda: ended_ranks(cfg.out) == {0, 1}, timeout=120,
               message="every rank's marker agent made its last pass")
    found = localize(open_run(cfg.out))
    assert found["hung"] and found["suspects"][0]["rank"] == 1


@pytest.mark.parametrize(("mesh", "spec", "said"), [
    ((2, 1, 2), "crash:rank=2,step=2", r"training failed on rank 2: planted crash on rank 2 in step 2$"),
    ((1, 2, 2), "kill:rank=1,step=1", r"training failed: rank 1 ended with signal SIGKILL without a message"),
], ids=["crash", "kill"])
def test_a_rank_that_crashes_or_is_killed_is_the_one_named(tmp_path: Path, mesh: tuple[int, int, int], spec: str,
                                                           said: str) -> None:
    """The launcher's line and the run state name the rank that failed first, not the lowest rank
    among the ones that lost their peer after it (gloo: "Connection closed by peer")."""
    from megascope.analysis import localize
    from megascope.analysis.runstate import run_state

    tp, pp, dp = mesh
    rank = int(spec.split("rank=")[1].split(",")[0])
    cfg = _cfg(tmp_path / "run", tp, pp, dp, steps=4, faults=parse_injects([spec]))
    with pytest.raises(TrainingError, match=said) as err:
        train(cfg, nproc=tp * pp * dp)
    assert "\n" not in str(err.value)
    wait_until(lambda: ended_ranks(cfg.out) == set(range(tp * pp * dp)), timeout=120,
               message="every rank's marker agent made its last pass")
    run = open_run(cfg.out)
    state = run_state(run, hang=localize(run))
    assert state["state"] == "failed" and state["culprit"]["rank"] == rank, state
    if spec.startswith("crash"):
        assert f"rank {rank} raised PlantedCrash in step 2" in state["reason"]
    else:
        assert f"rank {rank} ended with no exception of its own" in state["reason"]


def test_runs_under_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "megascope", "train", "--pp", "2",
         "--steps", "2", "--layers", "2", "--hidden", "32", "--seq-len", "16", "--vocab", "64",
         "--global-batch", "4", "--micro-batches", "2", "--collective-timeout", "60", "-o", str(out)],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "2 steps on 2 ranks (pp=2 dp=1 tp=1)" in proc.stdout
    run = open_run(out)
    assert run.con.execute("SELECT count(DISTINCT rank) FROM spans").fetchone() == (2,)


def test_collector_ab_pauses_the_collector_for_every_other_block(tmp_path: Path, cli: Callable[..., Result]) -> None:
    """--collector-ab 2: steps 0-1 and 4-5 recorded, 2-3 not; the result says which were, and the
    training itself is what it is without the A/B (or with the garbage collector run by hand)."""
    import json

    out, result_json = tmp_path / "ab", tmp_path / "ab.json"
    result = cli(
        "train", "--nproc", "2", "--dp", "2", "--steps", "6", "--layers", "2", "--hidden", "32", "--heads", "4",
        "--vocab", "64", "--seq-len", "16", "--global-batch", "8", "--micro-batches", "2", "--lr", "3e-3",
        "--collector-ab", "2", "--gc-interval", "2", "--result-json", str(result_json),
        "--host-stats", str(tmp_path / "host"), "-o", str(out), env={"MEGASCOPE_GC_SPAN_MS": "0"})
    assert result.exit_code == 0, result.output
    record = json.loads(result_json.read_text())
    # --host-stats: each rank's host counters for each of its 6 steps.
    for rank in (0, 1):
        host = json.loads((tmp_path / "host" / f"rank-{rank}.json").read_text())
        assert host["rank"] == rank and all(len(host[k]) == 6 for k in ("seconds", "thread_cpu_s", "process_cpu_s"))
        assert sum(host["process_cpu_s"]) >= sum(host["thread_cpu_s"]) > 0
    assert record["collector_on"] == [True, True, False, False, True, True]
    assert len(record["ab_flush_seconds"]) == 1 and len(record["step_seconds"]) == 6
    plain = train(_cfg(tmp_path / "plain", dp=2, steps=6), nproc=2)
    assert record["losses"] == pytest.approx(plain.losses, rel=1e-6)
    run = open_run(out)
    assert run.problems == []
    for table in ("spans", "metrics"):
        # (Setup's own automatic collections are recorded too, outside every step.)
        steps = run.con.execute(f"SELECT DISTINCT rank, step FROM {table} WHERE step IS NOT NULL "
                                "ORDER BY rank, step").fetchall()
        assert steps == [(r, s) for r in (0, 1) for s in (0, 1, 4, 5)], table
    assert plain.collector_on is None and plain.ab_flush_seconds is None
    # Per-layer spans in the first micro-batch of each step only (--layer-spans first, the default).
    layer_mbs = run.con.execute("SELECT DISTINCT kind, microbatch FROM spans WHERE name LIKE 'layers.%' "
                                "ORDER BY ALL").fetchall()
    assert layer_mbs == [("backward", 0), ("forward", 0)]
    # --gc-interval 2: full collections at steps 2 and 4 on both ranks; step 2 was not recorded.
    gcs = run.con.execute("SELECT DISTINCT rank, step FROM spans WHERE name LIKE 'gc.%' AND step IS NOT NULL "
                          "ORDER BY ALL").fetchall()
    assert gcs == [(0, 4), (1, 4)]
    # The collector's own footprint: its stamps per recorded step, summed up by the report.
    stamps = run.con.execute("SELECT DISTINCT step FROM metrics WHERE name = 'collector_stamps' "
                             "ORDER BY step").fetchall()
    assert stamps == [(0,), (1,), (4,), (5,)]
    report = cli("report", str(out))
    assert report.exit_code == 0 and "stamps a rank-step" in report.output, report.output


def test_cli_trains_from_a_token_file(tmp_path: Path, cli: Callable[..., Result]) -> None:
    import numpy as np

    data = tmp_path / "train.bin"
    rng = np.random.default_rng(0)
    # A learnable stream: a repeating pattern with occasional noise.
    stream = np.tile(np.arange(40, dtype=np.uint32), 500)
    stream[rng.random(stream.size) < 0.05] = 7
    stream.tofile(data)
    out = tmp_path / "run"
    result = cli(
        "train", "--nproc", "2", "--dp", "2", "--steps", "4", "--layers", "2", "--hidden", "32", "--vocab", "64",
        "--seq-len", "16", "--global-batch", "8", "--micro-batches", "2", "--data", str(data),
        "--data-dtype", "uint32", "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "4 steps on 2 ranks (pp=1 dp=2 tp=1)" in result.output
    run = open_run(out)
    assert run.meta.config["data"] == str(data)
    losses = [v for (v,) in run.con.execute(
        "SELECT value FROM metrics WHERE name = 'loss' AND rank = 0 ORDER BY step").fetchall()]
    assert len(losses) == 4 and losses[-1] < losses[0]


def test_overlap_is_what_the_exposed_comm_analysis_sees(tmp_path: Path, reference: list[float]) -> None:
    """With DP overlap the gradient reduce-scatters run under the backward pass (part of each one is
    hidden) and the parameter all-gathers under the next forward; with ``overlap`` off both are
    waited on where they are issued (nothing hidden).
    Both compute the same loss; every asynchronous call leaves its wait span."""
    from megascope.analysis import exposed_comm

    def dp_rs(overlap: frozenset[str]) -> tuple[list[float], Any]:
        cfg = _cfg(tmp_path / "-".join(sorted(overlap) or ["none"]), tp=2, pp=2, dp=2, bucket_mb=0.004,
                   model=replace(MODEL, layers=4), overlap=overlap)
        result = train(cfg, nproc=8)
        run = open_run(result.out)
        waits = {n for (n,) in run.con.execute("SELECT DISTINCT name FROM spans WHERE name LIKE '%:wait'").fetchall()}
        assert {"dp.reduce_scatter:wait", "dp.all_gather:wait"} <= waits
        if "pp" in overlap:
            assert {"pp.send:wait", "pp.recv:wait"} <= waits
        if "tp" in overlap:
            assert {"tp.all_gather:wait", "tp.reduce_scatter:wait"} <= waits
        rows = exposed_comm(run, steps=[1, 2]).set_index(["group_kind", "name"])
        return result.losses, rows.loc[("dp", "dp.reduce_scatter")], rows.loc[("dp", "dp.all_gather")]

    on_losses, on, on_ag = dp_rs(frozenset({"tp", "pp", "dp"}))
    off_losses, off, off_ag = dp_rs(frozenset())
    assert on_losses == pytest.approx(off_losses, rel=RTOL)
    # The parameter all-gathers: left in flight under the next step's forward, or waited at once.
    assert off_ag["overlapped_ns"] == 0 and on_ag["overlapped_ns"] > 0
    assert on["exposed_ns"] + on["overlapped_ns"] <= on["comm_ns"]
    assert off["exposed_ns"] + off["overlapped_ns"] <= off["comm_ns"]
    # Off, every reduce-scatter is issued and waited on after the backward pass: no compute under it.
    assert off["overlapped_ns"] == 0
    # On, the early buckets run under the rest of the backward pass (how much of each span that is
    # depends on this machine's load; that some of it is, does not).
    assert on["overlapped_ns"] > 1_000_000 and on["overlapped_ns"] / on["comm_ns"] > 0.05


def test_dp_calls_timed_one_in_four_keep_every_marker_and_still_find_the_straggler(tmp_path: Path) -> None:
    """--dp-comm-spans rotate: the gradient sync's reduce-scatters and the parameters' all-gathers
    (56 calls a step here) get spans one in four after the first step, by their place in
    the step, the same calls on every rank; every call keeps both markers, the calls metric counts
    them all, and the planted straggler is still named first, cause compute."""
    from megascope.analysis import stragglers
    from megascope.analysis.base import prepare

    rank = 2
    cfg = _cfg(tmp_path / "run", dp=4, steps=6, global_batch=16, micro_batches=2, bucket_mb=0.002,
               model=replace(MODEL, layers=6),
               faults=parse_injects([f"straggler:rank={rank},factor=3"]), dp_comm_spans="rotate")
    run = open_run(train(cfg, nproc=4).out)
    assert run.meta.config["dp_comm_spans"] == "rotate"
    con = run.con
    (issued, done, timed, with_mb), = con.execute("""SELECT count(*) FILTER (WHERE m.state = 'enqueued'),
        count(*) FILTER (WHERE m.state = 'completed'),
        (SELECT count(*) FROM spans WHERE "group" LIKE 'dp:%' AND kind = 'collective'),
        (SELECT count(*) FROM spans WHERE "group" LIKE 'dp:%' AND microbatch IS NOT NULL)
        FROM markers m WHERE m."group" LIKE 'dp:%'""").fetchall()
    assert issued == done and issued >= 4 * 6 * 40 and 2 * timed < issued and with_mb == 0
    per_step = dict(con.execute("""SELECT step, count(*) FROM spans WHERE "group" LIKE 'dp:%' AND kind = 'collective'
                                   AND rank = 0 GROUP BY step""").fetchall())
    assert per_step[0] == issued // (4 * 6) and all(3 * per_step[s] < per_step[0] for s in range(1, 6))
    calls = con.execute("SELECT sum(value) FROM metrics WHERE name LIKE 'collector_calls:dp:%'").fetchone()[0]
    assert calls == issued
    # Every rank timed the same calls: each timed (group, seq) has a span on all four ranks.
    members = con.execute("""SELECT DISTINCT count(*) FROM spans WHERE "group" LIKE 'dp:%' AND kind = 'collective'
                             GROUP BY "group", seq""").fetchall()
    assert members == [(4,)]
    # The steps whose DP calls were sampled say so (collector_step_calls), so the analysis scales
    # the peers' wait in those overlapping buckets without scaling its bound
    # (test_analysis.py::test_sampled_calls_scale_their_wait_and_the_bound_only_for_whole_microbatches).
    sampled_steps = [s for (s,) in con.execute("""SELECT DISTINCT step FROM metrics
                                                  WHERE name LIKE 'collector_step_calls:dp:%' ORDER BY step""").fetchall()]
    assert sampled_steps == list(range(1, 6))
    prepare(con)
    own = dict(con.execute("SELECT rank, median(own_ns) FROM ms_cache.rank_step WHERE step > 0 GROUP BY rank").fetchall())
    assert own[rank] > 1.4 * max(own[r] for r in range(4) if r != rank)
    found = stragglers(run).sort_values("slowdown", ascending=False)
    assert found["rank"].tolist()[0] == rank and found["cause"].tolist()[0] == "compute"


@pytest.mark.parametrize("tp_spans", ["rotate", "first"])
def test_tp_calls_timed_in_one_microbatch_a_step_still_find_the_straggler(tmp_path: Path, tp_spans: str) -> None:
    """--tp-comm-spans rotate (the default on CUDA) and first: TP calls get spans in one micro-batch a
    step (a different one each step, or the first) and in the once-a-step gradient sync only, yet
    every call keeps its markers, the waits of the untimed ones are counted at the timed ones' mean,
    and the straggler is named first, its TP peer's own time well below its own.

    The planted straggler burns its extra time after each forward and backward pass, so half of
    the peer's wait falls on the first call of the next micro-batch. With the first micro-batch
    alone timed, the estimate misses part of it (measured: the peer's own time 1.75-2.35x its DP
    counterparts', ~1.5x with every call timed), and on a loaded machine the peer can be named as a
    lesser straggler too; rotating over the micro-batches samples them all."""
    from megascope.analysis import exposed_comm, stragglers

    rank = 1
    cfg = _cfg(tmp_path / "run", tp=2, dp=2, steps=6, global_batch=16, micro_batches=4,
               faults=parse_injects([f"straggler:rank={rank},factor=3"]), tp_comm_spans=tp_spans)
    run = open_run(train(cfg, nproc=4).out)
    assert run.meta.config["tp_comm_spans"] == tp_spans
    con = run.con
    mbs = {mb for (mb,) in con.execute("""SELECT DISTINCT microbatch FROM spans
                                          WHERE "group" LIKE 'tp:%' AND kind = 'collective'""").fetchall()}
    assert mbs == ({0, None} if tp_spans == "first" else {0, 1, 2, 3, None})
    (issued, done, timed), = con.execute("""SELECT count(*) FILTER (WHERE m.state = 'enqueued'),
        count(*) FILTER (WHERE m.state = 'completed'),
        (SELECT count(*) FROM spans WHERE "group" LIKE 'tp:%' AND kind = 'collective')
        FROM markers m WHERE m."group" LIKE 'tp:%'""").fetchall()
    assert issued == done and 3 * timed < issued
    calls = con.execute("SELECT sum(value) FROM metrics WHERE name LIKE 'collector_calls:tp:%'").fetchone()[0]
    assert calls == issued
    found = stragglers(run).sort_values("slowdown", ascending=False)
    assert found["rank"].tolist()[0] == rank and found["cause"].tolist()[0] == "compute"
    assert set(found["rank"]) <= {rank, 0}  # the straggler and at most its TP peer
    own = dict(con.execute("SELECT rank, median(own_ns) FROM ms_cache.rank_step WHERE step > 0 GROUP BY rank").fetchall())
    assert own[rank] > 1.4 * own[0]
    tp = exposed_comm(run).query("group_kind == 'tp'")
    assert (tp["timed_frac"] < 0.5).all() and (tp["exposed_all_ns"] > tp["exposed_ns"]).all()
