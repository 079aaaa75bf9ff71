"""The analysis engine on synthetic runs with planted faults, and on hand-built runs whose answer
follows from the numbers in them."""

from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from click.testing import Result
from conftest import Synth
from hand_runs import MS, hand_run, host_bound_run, span

from megascope import analysis, layout, schema
from megascope.analysis.base import clock_sample_steps, prepare, solve_offsets
from megascope.analysis.runstate import run_state
from megascope.errors import ConfigError
from megascope.store import open_run


@pytest.fixture(scope="module")
def runs(synth: Synth, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("synth")
    faults = {"healthy": (), "straggler": ("straggler:rank=13,factor=1.25",), "skew": ("skew:rank=6,ms=40",),
              "hang": ("hang:rank=22,step=5",)}
    return {name: synth(base / name, *specs, ranks=32, steps=8, tp=2, pp=2, seed=3, gpus_per_host=4)
            for name, specs in faults.items()}


def test_healthy_run_has_no_findings(runs: dict[str, Path]) -> None:
    run = open_run(runs["healthy"])
    result = analysis.report(run)
    assert result["stragglers"] == []
    assert result["hang"]["hung"] is False and result["hang"]["suspects"] == []
    assert result["run"]["world_size"] == 32 and result["run"]["steps"] == 8
    assert set(analysis.rank_states(run)["state"]) == {"healthy"}


def test_compute_straggler_is_named_with_place_and_cause(runs: dict[str, Path]) -> None:
    run = open_run(runs["straggler"])
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [13]
    row = found.iloc[0]
    expected = run.con.execute("SELECT host, coords['pp'], coords['dp'], coords['tp'] FROM ranks WHERE rank = 13").fetchone()
    assert (row["host"], row["pp"], row["dp"], row["tp"]) == expected
    assert row["cause"] == "compute" and row["phase"] in ("forward", "backward")
    # Own time is mostly compute, so the slowdown is close to the planted factor.
    assert 1.15 < row["slowdown"] < 1.3
    assert row["steps_slow_frac"] > 0.8
    # Its TP peers wait for it: it is the last arriver of its TP collectives.
    assert row["last_arrival_frac"] > 0.8


def test_skew_is_a_host_cause_late_at_dp(runs: dict[str, Path]) -> None:
    run = open_run(runs["skew"])
    found = analysis.stragglers(run)
    assert list(found["rank"]) == [6]
    assert found.iloc[0]["cause"] == "host"
    assert found.iloc[0]["late_at"] == "dp"
    # 40 ms pause: the excess own time per step is about that.
    assert 30 * MS < found.iloc[0]["excess_ns"] < 50 * MS


def test_hang_root_and_states(runs: dict[str, Path]) -> None:
    run = open_run(runs["hang"])
    result = analysis.localize(run)
    assert result["hung"] is True
    top = result["suspects"][0]
    expected = run.con.execute("SELECT host, coords['pp'], coords['dp'], coords['tp'] FROM ranks WHERE rank = 22").fetchone()
    assert top["rank"] == 22
    assert (top["host"], top["coords"]["pp"], top["coords"]["dp"], top["coords"]["tp"]) == expected
    assert top["missing_seq"] == top["last_completed_seq"] + 1
    assert top["waited_on_by"] > 0
    states = analysis.rank_states(run).set_index("rank")["state"]
    assert states[22] == "hung"
    assert (states.drop(22) == "waiting").sum() > 0
    assert set(states) <= set(analysis.hang.STATES)


def test_clock_offsets_recover_the_planted_ones(runs: dict[str, Path]) -> None:
    run = open_run(runs["straggler"])
    truth = run.meta.config["synth"]["clock_offsets_ns"]
    est = analysis.clock_offsets(run).set_index("host")
    for host, planted in truth.items():
        # Offsets are what to add to a host's times; synth adds `planted` to the true time.
        assert abs(est.at[host, "offset_ns"] + planted) <= max(2 * (est.at[host, "error_ns"] or 0), 50_000)
    assert est["samples"].min() > 0


def test_solve_offsets_links_hosts_through_chains() -> None:
    # a-b measured, b-c measured, a-c never: c still gets its offset through b; d is unlinked.
    pairs = pd.DataFrame({
        "host": ["b", "c"], "ref_host": ["a", "b"], "diff_ns": [100.0, -30.0], "mad_ns": [1.0, 1.0],
        "samples": [10, 10],
    })
    out = solve_offsets(["a", "b", "c", "d"], pairs).set_index("host")
    assert out.at["a", "offset_ns"] == pytest.approx(0.0, abs=1e-6)
    assert out.at["b", "offset_ns"] == pytest.approx(-100.0, abs=1e-3)
    assert out.at["c", "offset_ns"] == pytest.approx(-70.0, abs=1e-3)
    assert out.at["d", "offset_ns"] == 0.0 and np.isnan(out.at["d", "error_ns"])


def test_heatmap_bins_keep_the_straggler(runs: dict[str, Path]) -> None:
    run = open_run(runs["straggler"])
    full = analysis.heatmap(run, phase="own")
    assert len(full) == 32 * 8
    assert full.groupby("rank")["norm"].median().idxmax() == 13
    small = analysis.heatmap(run, phase="own", max_ranks=4, max_steps=2)
    assert small["rank_bin"].nunique() == 4 and small["step_bin"].nunique() == 2
    worst = small.loc[small["norm"].idxmax()]
    assert worst["rank"] == 13 and worst["rank_lo"] <= 13 <= worst["rank_hi"]
    with pytest.raises(ConfigError, match="phase"):
        analysis.heatmap(run, phase="nope")


def test_mfu_follows_run_json(runs: dict[str, Path]) -> None:
    run = open_run(runs["healthy"])
    per_step = analysis.mfu(run)
    meta = run.meta
    assert meta.model_flops_per_step and meta.peak_flops_per_device
    expected = meta.model_flops_per_step / (per_step["step_time_ns"] / 1e9 * meta.world_size * meta.peak_flops_per_device)
    assert np.allclose(per_step["mfu"], expected)
    assert (per_step["mfu"] > 0).all() and (per_step["mfu"] < 1).all()


def test_mean_mfu_leaves_out_the_warm_up_step() -> None:
    from megascope.analysis.timeline import steady_mean

    # A first step 20x the others (MFU 0.02 against 0.40 and 0.50): the mean is the later steps'.
    per_step = pd.DataFrame({"step": [7, 8, 9], "mfu": [0.02, 0.40, 0.50], "tokens_per_s": [np.nan] * 3})
    assert steady_mean(per_step, "mfu") == pytest.approx(0.45)
    assert steady_mean(per_step, "tokens_per_s") is None  # no value at all
    assert steady_mean(per_step.iloc[:1], "mfu") == pytest.approx(0.02)  # one step: that step
    # Values missing after the first step: the first one stands.
    assert steady_mean(per_step.assign(mfu=[0.3, np.nan, np.nan]), "mfu") == pytest.approx(0.3)


def test_mean_mfu_leaves_out_the_step_a_job_hung_in(tmp_path: Path) -> None:
    """sample_traces/hang: rank 6 stopped in step 4, which the seven others ended at their 5 s
    collective timeout. That step is no measure of the job's pace."""
    from megascope.analysis.timeline import steady_mean

    sample = Path(__file__).resolve().parent.parent / "sample_traces" / "hang"
    run = open_run(shutil.copytree(sample, tmp_path / "hang", ignore=shutil.ignore_patterns("_cache")))
    per_step = analysis.timeline.mfu(run)
    assert per_step["ranks"].tolist() == [8, 8, 8, 8, 7]
    assert steady_mean(per_step, "mfu") == pytest.approx(per_step["mfu"].iloc[1:4].mean())
    # One step alone with the most ranks: that step stands.
    assert steady_mean(per_step.assign(ranks=[7, 7, 8, 7, 7]), "mfu") == pytest.approx(per_step["mfu"].iloc[2])


def _async_run(path: Path, *, late_ms: float, waits_ms: tuple[float, float, float]) -> Path:
    """Three ranks, four steps of 60-70 ms: each issues an asynchronous all-reduce at 10 ms (rank 2
    ``late_ms`` later), the transfer takes 2 ms after the last arrival, and each rank waits for it
    at its own ``waits_ms`` (a wait span to completion), then works 10 ms more."""
    spans = []
    t0 = 0
    for step in range(4):
        arrive = [t0 + 10 * MS, t0 + 10 * MS, t0 + int((10 + late_ms) * MS)]
        done = max(arrive) + 2 * MS
        waits = [t0 + int(w * MS) for w in waits_ms]
        ends = [max(done, w) for w in waits]
        end = max(ends) + 10 * MS
        for r in range(3):
            spans.append(span(r, step, "step", t0, end - t0))
            spans.append(span(r, step, "forward", t0, arrive[r] - t0))
            spans.append(span(r, step, "collective", arrive[r], ends[r] - arrive[r], group="dp:0", seq=step,
                              name="dp.all_reduce"))
            spans.append(span(r, step, "other", waits[r], ends[r] - waits[r], seq=step, name="dp.all_reduce:wait"))
        t0 = end
    return hand_run(path, spans, [], devices=("cuda:0", "cuda:1", "cuda:2"), source="collector")


def test_whatif_follows_asynchronous_calls_to_their_waits(tmp_path: Path) -> None:
    """A call waited for later holds its ranks at the wait, not where it was issued. Rank 2 issues
    5 ms late a call every rank waits for at 60 ms: the overlap hides it, fixing it saves nothing.
    Rank 2 issues 40 ms late a call the others wait for at 30 ms: they stall until it arrives, and
    fixing it saves the stall. Either way the replay reproduces the measured step."""
    hidden = analysis.whatif(open_run(_async_run(tmp_path / "hidden", late_ms=5, waits_ms=(60, 60, 60))), ranks=[2])
    assert hidden["modeled_baseline_ns"] == pytest.approx(hidden["step_time_ns"], rel=0.02)
    assert hidden["speedup"] == pytest.approx(1.0, abs=0.005)
    exposed = analysis.whatif(open_run(_async_run(tmp_path / "exposed", late_ms=40, waits_ms=(30, 30, 50.5))), ranks=[2])
    assert exposed["modeled_baseline_ns"] == pytest.approx(exposed["step_time_ns"], rel=0.02)
    # Fixed: rank 2 issues at 10 ms with its peers, the call is done at 12 ms, no one stalls at the
    # 30 ms waits, and the step is 30 + 10 ms instead of 52 + 10.
    assert exposed["speedup"] == pytest.approx(62 / 40, rel=0.03)


def _ddp_run(path: Path, *, slow_ms: float, op: str = "all_reduce", gathers: int = 0,
             stream: str = "compute", waits: bool = False) -> Path:
    """Two ranks as a DistributedDataParallel job lays them out, six steps: a 10 ms forward, a 30
    ms backward (rank 1's forward ``slow_ms`` longer, its backward twice that), four gradient
    buckets issued at the quarters of each rank's backward (the last just before it ends), no
    wait span (DDP's reducer waits for them in C++), each done 0.5 ms after its last member
    arrives; the optimizer's 2 ms after the last bucket. Healthy, a step is 42.49 ms.
    ``gathers``: as FSDP does, the group also gathers parameters, that many 0.2 ms all-gathers at
    the forward's start, on stream ``cuda:37`` (both ranks arrive together: no wait); ``stream``
    is the reductions' stream label. ``waits``: as the collector writes FSDP2's reduce-scatters on
    GPU, each has a wait span from where the next bucket is issued (the last: the backward's end)
    to its end, or none where it had ended by then."""
    spans = []
    t0 = 0
    for step in range(6):
        fwd = [10 * MS, int((10 + slow_ms) * MS)]
        bwd = [30 * MS, int((30 + 2 * slow_ms) * MS)]
        arrive = [[t0 + fwd[r] + bwd[r] * (k + 1) // 4 - 10_000 for r in range(2)] for k in range(4)]
        done = [max(a) + MS // 2 for a in arrive]
        end = done[-1] + 2 * MS
        calls = gathers + 4
        for r in range(2):
            spans.append(span(r, step, "step", t0, end - t0))
            spans.append(span(r, step, "forward", t0, fwd[r]))
            spans.append(span(r, step, "backward", t0 + fwd[r], bwd[r]))
            for g in range(gathers):
                row = span(r, step, "collective", t0 + (g + 1) * MS // 2, MS // 5, group="dp:0", seq=calls * step + g)
                spans.append({**row, "name": "all_gather", "op": "all_gather", "stream": "cuda:37"})
            for k in range(4):
                row = span(r, step, "collective", arrive[k][r], done[k] - arrive[k][r], group="dp:0",
                           seq=calls * step + gathers + k)
                spans.append({**row, "name": op, "op": op, "stream": stream})
                wait = arrive[k + 1][r] + 10_000 if k < 3 else t0 + fwd[r] + bwd[r]
                if waits:
                    row = span(r, step, "other", wait, max(done[k] - wait, 0), seq=calls * step + gathers + k)
                    spans.append({**row, "name": f"{op}:wait", "op": op, "stream": stream})
        t0 = end
    return hand_run(path, spans, [], world=2, hosts=("h0", "h1"), devices=("cuda:0", "cuda:0"), source="collector")


def test_whatif_holds_ddp_gradient_buckets_to_the_backward_s_end(tmp_path: Path) -> None:
    """DDP's gradient all-reduces, issued inside the backward and waited for by its reducer as the
    backward ends, with no wait span: the fast rank's backward goes on while its buckets wait for
    the slow rank's. Fixing rank 1 gives the healthy step (42.49 ms, not less: the fast rank's
    compute between its buckets is its own, not a wait); taken as blocking calls, the fix came out
    far below it. A reduce-scatter (FSDP's gradient reduction) is read the same way."""
    healthy_ms = 42.49
    for op in ("all_reduce", "reduce_scatter"):
        slow = analysis.whatif(open_run(_ddp_run(tmp_path / op, slow_ms=3, op=op)), ranks=[1])
        assert slow["step_time_ns"] == pytest.approx(51.49 * MS, rel=0.001)
        assert slow["modeled_baseline_ns"] == pytest.approx(slow["step_time_ns"], rel=0.02)
        assert slow["whatif_step_time_ns"] == pytest.approx(healthy_ms * MS, rel=0.02)
    # A parameter all-gather is needed by the next layer at once: still a blocking call, its wait
    # part of the step the fix frees.
    gather = analysis.whatif(open_run(_ddp_run(tmp_path / "gather", slow_ms=3, op="all_gather")), ranks=[1])
    assert gather["modeled_baseline_ns"] == pytest.approx(gather["step_time_ns"], rel=0.02)
    assert gather["whatif_step_time_ns"] < 0.9 * healthy_ms * MS


def test_own_time_keeps_the_compute_a_backward_did_while_its_buckets_waited(tmp_path: Path) -> None:
    """_ddp_run: rank 0's buckets wait 27 ms a step for rank 1's while its backward goes on; only
    the 9.49 ms after its backward's end held it. Its own time is the step less those (42 ms),
    and rank 1's own time is 1.225x it, its compute's ratio (49 ms against 40), not 2.1x (the step
    less all 27 ms). An all-gather (the next layer waits for it) keeps all its wait."""
    def own(path: Path) -> dict[int, float]:
        run = open_run(path)
        prepare(run.con)
        rows = run.con.execute("SELECT rank, median(own_ns) FROM ms_cache.rank_step WHERE step > 0 GROUP BY rank").fetchall()
        return {int(r): float(v) / MS for r, v in rows}

    hidden = own(_ddp_run(tmp_path / "ddp", slow_ms=3))
    assert hidden[0] == pytest.approx(42.0, abs=0.05) and hidden[1] == pytest.approx(51.49, abs=0.05)
    assert hidden[1] / hidden[0] == pytest.approx(49 / 40, rel=0.01)
    gather = own(_ddp_run(tmp_path / "gather", slow_ms=3, op="all_gather"))
    assert gather[0] == pytest.approx(51.49 - 27, abs=0.05)
    # FSDP on GPU: the group also gathers parameters, and its reduce-scatters go on a stream of
    # their own: they are read as DDP's buckets. On the default stream (a CPU job's calls, which
    # block), the group's wait stays all of it.
    fsdp = own(_ddp_run(tmp_path / "fsdp", slow_ms=3, op="reduce_scatter", gathers=2, stream="cuda:69"))
    assert fsdp[0] == pytest.approx(42.0, abs=0.05) and fsdp[1] / fsdp[0] == pytest.approx(49 / 40, rel=0.01)
    blocking = own(_ddp_run(tmp_path / "blocking", slow_ms=3, op="reduce_scatter", gathers=2))
    assert blocking[0] == pytest.approx(51.49 - 27, abs=0.05)
    # FSDP2's reduce-scatters on GPU with their wait spans (where the next group and the
    # backward's end wait for them): read as before, and the replay fixes rank 1 to the healthy step.
    waited = _ddp_run(tmp_path / "waited", slow_ms=3, op="reduce_scatter", gathers=2, stream="cuda:69", waits=True)
    assert own(waited) == pytest.approx(fsdp, abs=0.05)
    fixed = analysis.whatif(open_run(waited), ranks=[1])
    assert fixed["modeled_baseline_ns"] == pytest.approx(fixed["step_time_ns"], rel=0.02)
    assert fixed["whatif_step_time_ns"] == pytest.approx(42.49 * MS, rel=0.02)


def test_own_time_of_a_rank_killed_mid_backward_reads_its_step(tmp_path: Path) -> None:
    """A DDP job whose rank 1 died in its last step's backward, after the first of eight gradient
    buckets: rank 0's eight buckets have no partner for seven of them. The group's reductions are
    not read as hidden waits there (their instances are incomplete), and nothing in rank 1's row
    is computed from sums over instances it missed: that difference, seven arrival times of about
    1.8e18 ns, overflowed a 64-bit integer and the whole report failed."""
    spans = []
    t0, buckets = 1_790_000_000_000_000_000, 8
    for step in range(3):
        for r in range(2):
            last = step == 2 and r == 1
            spans.append(span(r, step, "forward", t0, 10 * MS))
            spans.append(span(r, step, "backward", t0 + 10 * MS, 30 * MS))
            for k in range(1 if last else buckets):
                row = span(r, step, "collective", t0 + 10 * MS + (k + 1) * 3 * MS, MS, group="dp:0",
                           seq=buckets * step + k)
                spans.append({**row, "name": "all_reduce", "op": "all_reduce"})
            if not last:
                spans.append(span(r, step, "step", t0, 42 * MS))
        t0 += 42 * MS
    run = open_run(hand_run(tmp_path / "run", spans, [], world=2, hosts=("h0", "h1"), devices=("cuda:0", "cuda:0"),
                            source="collector"))
    prepare(run.con)
    rows = dict(run.con.execute("SELECT rank, own_ns FROM ms_cache.rank_step WHERE step = 2").fetchall())
    assert set(rows) == {0, 1} and 0 <= rows[1] <= 42 * MS and 0 <= rows[0] <= 42 * MS
    assert analysis.report(run, with_whatif=False)["run"]["world_size"] == 2


def _fsdp2_run(path: Path, *, pause_ms: float, waits: bool) -> Path:
    """Two ranks as FSDP2 lays them out on GPU, six steps: three 3 ms layers of forward, each
    after its parameters' all-gather (0.5 ms once both ranks arrive, on stream ``cuda:37``), the
    next gather issued as a layer starts (prefetched); the backward's gather prefetched as the
    last layer starts, a 0.5 ms loss, then 6 ms of backward and 0.5 ms of optimizer. Rank 1's host
    pauses ``pause_ms`` after its forward, so it issues the backward's gather that much later.
    ``waits``: each gather has the wait span the collector writes where the compute stream waits
    for it. Healthy, a step is 16.6 ms."""
    spans: list[dict[str, object]] = []
    t0, layer, xfer = 0, 3 * MS, MS // 2
    for step in range(6):
        issue = [t0 + MS // 10] * 2
        need = [t0 + MS // 10] * 2  # where each rank's compute stream needs the next gather
        for k in range(4):  # gathers 0-2: the forward's layers; 3: the backward's
            done = max(issue) + xfer
            for r in range(2):
                row = span(r, step, "collective", issue[r], done - issue[r], group="dp:0", seq=4 * step + k)
                spans.append({**row, "name": "all_gather", "op": "all_gather", "stream": "cuda:37"})
                if waits:
                    wait = span(r, step, "other", need[r], max(done - need[r], 0), seq=4 * step + k,
                                name="all_gather:wait")
                    spans.append({**wait, "op": "all_gather"})
            starts = [max(done, n) for n in need]
            if k < 2:
                issue, need = starts, [s + layer for s in starts]
            elif k == 2:
                issue = [starts[0], starts[1] + layer + int(pause_ms * MS)]
                need = [s + layer + MS // 2 for s in starts]
                need[1] += int(pause_ms * MS)
                forward_end = [s + layer for s in starts]
        backward = starts
        end = max(backward) + 6 * MS + MS // 2
        for r in range(2):
            spans.append(span(r, step, "step", t0, end - t0))
            spans.append(span(r, step, "forward", t0, forward_end[r] - t0))
            spans.append(span(r, step, "backward", backward[r], 6 * MS))
        t0 = end
    return hand_run(path, spans, [], world=2, hosts=("h0", "h1"), devices=("cuda:0", "cuda:0"), source="collector")


def test_whatif_of_fsdp2_s_prefetched_gathers_keeps_the_compute_they_overlapped(tmp_path: Path) -> None:
    """_fsdp2_run: FSDP2's gathers run ahead of the compute on a stream of their own. With the wait
    spans the collector writes where the compute stream waits for them, fixing the paused rank
    gives the healthy step (16.6 ms); without them, the gap from one gather to the next was read
    as the rank's work and the compute they overlapped was lost (13.6 ms)."""
    healthy = 16.6 * MS
    assert analysis.mfu(open_run(_fsdp2_run(tmp_path / "healthy", pause_ms=0, waits=True)))[
        "step_time_ns"].median() == pytest.approx(healthy, rel=0.001)
    paused = analysis.whatif(open_run(_fsdp2_run(tmp_path / "waits", pause_ms=20, waits=True)), ranks=[1])
    assert paused["step_time_ns"] == pytest.approx(36.6 * MS, rel=0.001)
    assert paused["modeled_baseline_ns"] == pytest.approx(paused["step_time_ns"], rel=0.02)
    assert paused["whatif_step_time_ns"] == pytest.approx(healthy, rel=0.02)
    bare = analysis.whatif(open_run(_fsdp2_run(tmp_path / "bare", pause_ms=20, waits=False)), ranks=[1])
    assert bare["whatif_step_time_ns"] < 0.85 * healthy


def test_whatif_gains_only_with_a_straggler(runs: dict[str, Path]) -> None:
    slow = open_run(runs["straggler"])
    fixed = analysis.whatif(slow)
    assert fixed["ranks"] == [13]
    assert fixed["speedup"] > 1.0
    assert fixed["whatif_step_time_ns"] < fixed["step_time_ns"]
    # The model replays the measured step closely.
    assert abs(fixed["modeled_baseline_ns"] / fixed["step_time_ns"] - 1) < 0.1
    healthy = open_run(runs["healthy"])
    assert analysis.whatif(healthy)["speedup"] == pytest.approx(1.0)


def test_whatif_is_held_to_the_hosts_pace_where_the_devices_wait_for_them(tmp_path: Path, cli: Any) -> None:
    """tests/data/gpu-megatron-tp2-host-bound: tests/jobs/megatron_job.py (its default small model)
    on tp2, 2x H200, NCCL: rank 1's GPU 1.5x slow from step 5. The job is host-bound: it ran at
    176-187 ms a step before the fault began and 203 ms after. The replay of device spans frees
    rank 1 to its partner's compute, which its partner ran while its host was far ahead, and says
    120 ms; but rank 0's device waited for its host at a fifth of its calls, and that host took
    183 ms to issue a step. The what-if is held there. The device-bound runs of the same job
    (tests/data/gpu-megatron-tp2-slow) are not held."""
    from megascope.analysis.whatif import host_floor, host_held

    data = Path(__file__).parent / "data"
    run = open_run(shutil.copytree(data / "gpu-megatron-tp2-host-bound", tmp_path / "bound"))
    result = analysis.whatif(run)
    assert result["ranks"] == [1]
    assert 115e6 < result["replay_step_time_ns"] < 125e6 and 200e6 < result["step_time_ns"] < 206e6
    floor = result["host_floor"]
    assert floor["ranks"] == [0] and floor["rank"] == 0 and 180e6 < floor["issue_ns"] < 186e6
    assert result["whatif_step_time_ns"] == floor["issue_ns"] and host_held(result)
    assert result["speedup"] == pytest.approx(result["step_time_ns"] / floor["issue_ns"])
    issue = analysis.pipeline.host_issue(run, steps=result["steps_modeled"], ranks=[0, 1]).set_index("rank")
    assert issue.at[0, "issue_ns"] == floor["issue_ns"] and issue.at[0, "steps"] == len(result["steps_modeled"])
    assert host_floor(run, result["steps_modeled"], [0, 1]) is None      # no other rank left to hold it
    text = cli("report", str(tmp_path / "bound"))
    assert text.exit_code == 0
    assert "what-if fixed: step 203.1 ms -> 183.2 ms" in text.output and "held to the hosts' pace: rank 0's" in text.output
    assert json.loads(cli("report", "--json", str(tmp_path / "bound")).output)["whatif"]["host_floor"]["rank"] == 0

    device = open_run(shutil.copytree(data / "gpu-megatron-tp2-slow", tmp_path / "device"))
    result = analysis.whatif(device)
    assert result["host_floor"] is None and not host_held(result)
    assert result["whatif_step_time_ns"] == result["replay_step_time_ns"]


def test_skew_instances_and_bubbles(runs: dict[str, Path]) -> None:
    run = open_run(runs["skew"])
    dp = analysis.skew(run, group_kind="dp")
    assert set(dp["group_kind"]) == {"dp"}
    rs = dp[dp["name"] == "dp.reduce_scatter"]
    # The paused rank is last at its DP group's reduce-scatter, about 40 ms late.
    ours = rs[rs["last_rank"] == 6]
    assert len(ours) == 8 and (ours["spread_ns"] > 30 * MS).all()
    assert len(analysis.skew(run, limit=5)) == 5
    stages = analysis.bubbles(run)
    assert list(stages["stage"]) == [0, 1]
    assert ((stages["bubble_frac"] > 0) & (stages["bubble_frac"] < 1)).all()
    exposed = analysis.exposed_comm(run)
    assert {"tp", "dp", "p2p"} <= set(exposed["group_kind"])
    assert ((exposed["exposed_frac"] >= 0) & (exposed["exposed_frac"] <= 1)).all()


# --- hand-built runs: the answer follows from the numbers written -------------------------------


def test_bubbles_leave_out_the_warm_up_step(tmp_path: Path) -> None:
    """The first step (1 s, 600 ms of it waiting in receives: the warm-up) is left out of the
    bubbles where the run has later steps (100 ms, 20 ms in receives); a run of that one step
    keeps it."""
    def recv(step: int, start: int, dur: int) -> dict[str, object]:
        return {**span(0, step, "recv", start * MS, dur * MS, group="pp:0", seq=step, name="pp.recv"),
                "op": "recv", "peer": 1}

    spans = [span(0, 0, "step", 0, 1000 * MS), recv(0, 0, 600)]
    for step in (1, 2):
        spans += [span(0, step, "step", step * 1000 * MS, 100 * MS), recv(step, step * 1000, 20)]
    got = analysis.bubbles(open_run(hand_run(tmp_path / "run", spans, [], world=1, hosts=("h0",))))
    assert got[["stage", "ranks", "steps", "bubble_ns", "step_ns"]].values.tolist() == [[0, 1, 2, 20 * MS, 100 * MS]]
    assert got["bubble_frac"].tolist() == [pytest.approx(0.2)]
    one = analysis.bubbles(open_run(hand_run(tmp_path / "one", spans[:2], [], world=1, hosts=("h0",))))
    assert one[["steps", "bubble_ns", "step_ns"]].values.tolist() == [[1, 600 * MS, 1000 * MS]]


def test_collective_arithmetic(tmp_path: Path) -> None:
    # Three ranks, one step: compute 10/10/16 ms, then an all-reduce that completes at 17 ms.
    spans = []
    for r, compute in enumerate((10, 10, 16)):
        spans += [
            span(r, 0, "step", 0, 17 * MS),
            span(r, 0, "forward", 0, compute * MS),
            span(r, 0, "collective", compute * MS, (17 - compute) * MS, group="dp:0", seq=1),
        ]
    run = open_run(hand_run(tmp_path / "run", spans, []))
    prepare(run.con)
    inst = run.con.execute("SELECT n, last_rank, spread_ns, xfer_ns, group_kind FROM ms_cache.inst").fetchall()
    assert inst == [(3, 2, 6 * MS, 1 * MS, "dp")]
    steps = run.con.execute(
        "SELECT rank, own_ns, wait_ns, xfer_ns, last_count FROM ms_cache.rank_step ORDER BY rank").fetchall()
    # Own time is the step minus waiting for others; the transfer (1 ms) is everyone's own.
    assert steps == [(0, 11 * MS, 6 * MS, 1 * MS, 0), (1, 11 * MS, 6 * MS, 1 * MS, 0), (2, 17 * MS, 0, 1 * MS, 1)]


def test_exposed_communication_arithmetic(tmp_path: Path) -> None:
    """One rank, one 100 ms step, every figure follows from the spans written:
    - a blocking TP collective inside a block (40-45 ms): the block encloses it but does not hide it;
    - an asynchronous DP reduce-scatter issued at 10 ms, waited on from 70 to 80 ms: exposed 10 ms,
      overlapped = backward 10-60 ms less the 5 ms stalled in the TP collective = 45 ms;
    - a receive (85-95 ms) and a send (88-98 ms) without wait spans, overlapping each other, outside
      compute: exposed as their union, 10 + 3 ms, not 10 + 10."""
    def comm(kind: str, start: int, dur: int, name: str, group: str, seq: int, op: str) -> dict[str, object]:
        return {**span(0, 0, kind, start * MS, dur * MS, group=group, seq=seq, name=name), "op": op}

    spans = [
        span(0, 0, "step", 0, 100 * MS),
        span(0, 0, "backward", 0, 60 * MS),
        span(0, 0, "backward", 0, 30 * MS, name="layers.1"),
        span(0, 0, "backward", 30 * MS, 30 * MS, name="layers.0"),
        comm("collective", 40, 5, "tp.reduce_scatter", "tp:0", 0, "reduce_scatter"),
        comm("collective", 10, 70, "dp.reduce_scatter", "dp:0", 0, "reduce_scatter"),
        {**span(0, 0, "other", 70 * MS, 10 * MS, seq=0, name="dp.reduce_scatter:wait"), "op": "reduce_scatter"},
        {**comm("recv", 85, 10, "pp.recv", "pp:0", 0, "recv"), "peer": 1},
        {**comm("send", 88, 10, "pp.send", "pp:0", 0, "send"), "peer": 1},
    ]
    run = open_run(hand_run(tmp_path / "run", spans, [], world=1, hosts=("h0",)))
    got = analysis.exposed_comm(run, steps=[0]).set_index("name")
    assert got.loc["tp.reduce_scatter", ["comm_ns", "overlapped_ns", "exposed_ns"]].tolist() == [5 * MS, 0, 5 * MS]
    assert got.loc["dp.reduce_scatter", ["comm_ns", "overlapped_ns", "exposed_ns"]].tolist() == [70 * MS, 45 * MS, 10 * MS]
    assert got.loc["pp.recv", "exposed_ns"] + got.loc["pp.send", "exposed_ns"] == 13 * MS
    assert got["exposed_ns_per_rank_step"].sum() == (5 + 10 + 13) * MS


@pytest.mark.parametrize("first", [0, 100])
def test_clock_samples_are_two_runs_of_steps_that_stay_while_the_run_grows(first: int) -> None:
    for n in (12, 100, 1000, 12288):
        steps = list(range(first, first + n))
        got = clock_sample_steps(steps, 8)
        assert len(got) == 8 and got == sorted(set(got)) and first not in got  # no warm-up step
        runs = [b - a for a, b in zip(got, got[1:], strict=False) if b - a != 1]
        assert len(runs) <= 1, got  # consecutive steps, at most two runs of them
        # The same sample as long as the run has not doubled: the cached estimate stays valid.
        prefix = 1 << (n - 1).bit_length() - 1
        assert clock_sample_steps(list(range(first, first + prefix + 1)), 8) == got or prefix < 9
    assert clock_sample_steps(list(range(1025)), 8) == [257, 258, 259, 260, 769, 770, 771, 772]
    assert clock_sample_steps(list(range(2000)), 8) == clock_sample_steps(list(range(1025)), 8)
    assert clock_sample_steps(list(range(5)), 8) == [0, 1, 2, 3, 4]


def test_exposed_communication_is_the_same_whatever_order_the_spans_are_read_in(tmp_path: Path) -> None:
    """A receive and a send posted at the same moment, without wait spans, overlap: the one counted
    first is exposed whole, the other from where the first ends. Which one is first is fixed by
    kind (receive before send), not by the order the rows are stored in."""
    def comm(kind: str, start: int, dur: int, seq: int) -> dict[str, object]:
        return {**span(0, 0, kind, start * MS, dur * MS, group="pp:0", seq=seq, name=f"pp.{kind}"),
                "op": kind, "peer": 1}

    calls = [comm("send", 20, 10, 0), comm("recv", 20, 6, 1)]
    got = []
    for order in (calls, calls[::-1]):
        spans = [span(0, 0, "step", 0, 100 * MS), *order]
        run = open_run(hand_run(tmp_path / f"run{len(got)}", spans, [], world=1, hosts=("h0",)))
        got.append(analysis.exposed_comm(run, steps=[0]).set_index("name")["exposed_ns"].to_dict())
        run.con.close()
    assert got[0] == got[1] == {"pp.recv": 6 * MS, "pp.send": 4 * MS}


def test_host_lead_names_the_rank_whose_device_waited_for_its_host(tmp_path: Path, cli: Callable[..., Result]) -> None:
    """host_bound_run: rank 1's device reached a quarter of its calls 0.1 ms after the host issued
    them (it had run dry), rank 0's always 10 ms after; rank 2 is host-timed and left out."""
    run = open_run(host_bound_run(tmp_path / "run"))
    got = analysis.host_lead(run, steps=[0]).set_index("rank")
    assert list(got.index) == [0, 1]
    assert got.loc[0, ["calls", "lead_p50_ns", "starved_frac"]].tolist() == [40, 10 * MS, 0.0]
    assert got.loc[1, "starved_frac"] == 0.25 and got.loc[1, "lead_p10_ns"] == 100_000
    lead = analysis.report(run, with_whatif=False)["host_lead"]
    assert [x["rank"] for x in lead["host_bound"]] == [1]
    out = cli("report", str(tmp_path / "run"), "--no-whatif", "-q")
    assert out.exit_code == 0, out.output
    assert "host-bound: rank 1: the device was idle at 25% of 40 calls (lead p10 0.1 ms)" in out.output
    assert "keep the host ahead" in out.output  # and what to do about it
    plain = open_run(host_bound_run(tmp_path / "cpu", devices=None))  # no device recorded: nothing to say
    assert analysis.host_lead(plain, steps=[0]).empty
    # A synthetic run has no host clock apart from its device's: the report leaves it out.
    synth = open_run(host_bound_run(tmp_path / "synth", source="synth"))
    assert analysis.report(synth, with_whatif=False)["host_lead"]["ranks"] == []


def test_host_lead_leaves_out_calls_on_a_stream_of_their_own(tmp_path: Path) -> None:
    """A call issued on a stream that runs nothing else (FSDP's all-gather and reduce-scatter
    streams, the collector labels its span `cuda:<id>`) starts at once however busy the device
    is: rank 1's quarter of such calls says nothing of its host, and rank 1 is not host-bound."""
    run = open_run(host_bound_run(tmp_path / "run", side_stream=True))
    got = analysis.host_lead(run, steps=[0]).set_index("rank")
    assert got.loc[0, ["calls", "starved_frac"]].tolist() == [40, 0.0]
    assert got.loc[1, ["calls", "starved_frac"]].tolist() == [30, 0.0]
    assert analysis.report(run, with_whatif=False)["host_lead"]["host_bound"] == []


def test_pipeline_neighbour_of_a_straggler_is_not_named(tmp_path: Path) -> None:
    """Two stages of two TP ranks, 8 steps of 100 ms. Rank 3 computes 60 ms where its TP peer
    computes 30: the straggler. Rank 1 receives from it, so its receive waits 50 ms where rank 0's
    waits 30, and it reaches the stage's TP collective 5 ms after its receive ends: last every step,
    and 50 ms of own time against rank 0's 47 (1.06x). Its excess over rank 0 is explained by the
    longer receive (20 ms >= 3 ms), so only rank 3 is named."""
    spans: list[dict[str, object]] = []
    for k in range(8):
        t = k * 100 * MS

        def at(rank: int, kind: str, start: int, end: int, k: int = k, t: int = t, **kw: object) -> None:
            spans.append(span(rank, k, kind, t + start * MS, (end - start) * MS, **kw))

        for r in range(4):
            at(r, "step", 0, 100)
        for r, recv_end, arrive in ((0, 50, 52), (1, 70, 75)):  # stage 0
            at(r, "forward", 0, 20)
            at(r, "recv", 20, recv_end, seq=k, peer=r + 2, group="pp:0")
            at(r, "collective", arrive, 77, group="tp:0", seq=k)
            at(r, "backward", 77, 100)
        for r, compute in ((2, 30), (3, 60)):  # stage 1: rank 3 is slow
            at(r, "forward", 0, compute)
            at(r, "collective", compute, 62, group="tp:1", seq=k)
            at(r, "backward", 62, 100)
    path = tmp_path / "run"
    layout.write_run_meta(path, schema.RunMeta(run_id="pp", source="synth", world_size=4,
                                               mesh_sizes={"pp": 2, "dp": 1, "tp": 2}))
    for r in range(4):
        layout.write_part(path, "ranks", pa.Table.from_pylist(
            [{"rank": r, "host": f"h{r}", "coords": {"pp": r // 2, "dp": 0, "tp": r % 2}}], schema=schema.RANKS), rank=r)
        layout.write_part(path, "groups", pa.Table.from_pylist(
            [{"rank": r, "group": f"tp:{r // 2}", "kind": "tp", "group_rank": r % 2, "members": [r // 2 * 2, r // 2 * 2 + 1]}],
            schema=schema.GROUPS), rank=r)
        layout.write_part(path, "spans", pa.Table.from_pylist([x for x in spans if x["rank"] == r], schema=schema.SPANS),
                          rank=r)
    run = open_run(path)
    named = analysis.stragglers(run)
    assert named["rank"].tolist() == [3]
    scores = run.con.execute("SELECT rank, median_slowdown, median_ex_recv_ns, median_ex_own_ns, last_z "
                             "FROM ms_cache.rank_scores WHERE rank = 1").fetchone()
    # Rank 1 is what the rule is for: slower and last every step, but its receive explains it.
    assert scores[1] == pytest.approx(50 / 47) and scores[2] == 20 * MS and scores[3] == 3 * MS and scores[4] >= 3


def test_hang_follows_waiters_to_the_root(tmp_path: Path) -> None:
    # Rank 2 completed seq 1 and never entered seq 2; ranks 0 and 1 sit inside seq 2.
    def marker(rank: int, seq: int, state: str, t: int) -> dict[str, object]:
        return {"rank": rank, "group": "dp:0", "seq": seq, "op": "all_reduce", "state": state, "time_ns": t,
                "step": seq, "bytes": None, "peer": None}

    markers = [marker(r, 1, "enqueued", 10) for r in range(3)] + [marker(r, 1, "completed", 20) for r in range(3)]
    markers += [marker(0, 2, "enqueued", 30), marker(1, 2, "enqueued", 31)]
    run = open_run(hand_run(tmp_path / "run", [], markers))
    result = analysis.localize(run)
    assert result["hung"] is True
    assert result["waiting"] == [0, 1]
    assert [(s["rank"], s["group"], s["last_completed_seq"], s["missing_seq"]) for s in result["suspects"]] == [
        (2, "dp:0", 1, 2)]
    assert result["suspects"][0]["host"] == "h1" and result["suspects"][0]["coords"] == {"pp": 0, "dp": 2, "tp": 0}
    assert result["stuck_groups"] == [{"group": "dp:0", "seq": 2, "waiting": [0, 1], "missing": [2]}]


def test_a_completion_past_a_call_that_a_member_never_entered_is_no_completion(tmp_path: Path) -> None:
    # NCCL on a hang: rank 1's all-reduces 2 and 3 read "completed" (the communicator was aborted
    # at the timeout, or a future fired at launch) though rank 0 never entered call 2. Rank 1
    # entered call 4 at the very end. The completions are set aside: rank 1 waits in call 2 since
    # it entered it, on rank 0.
    def marker(rank: int, seq: int, state: str, t: int) -> dict[str, object]:
        return {"rank": rank, "group": "dp:0", "seq": seq, "op": "all_reduce", "state": state, "time_ns": t,
                "step": seq, "bytes": None, "peer": None}

    s = 1_000_000_000
    markers = [marker(r, 1, st, t) for r in range(2) for st, t in (("enqueued", 10), ("completed", 20))]
    markers += [marker(1, 2, "enqueued", 30), marker(1, 2, "completed", 31),
                marker(1, 3, "enqueued", 32), marker(1, 3, "completed", 33), marker(1, 4, "enqueued", 50 * s)]
    path = hand_run(tmp_path / "run", [], markers, world=2)
    # Both processes seen by their marker agents until they ended, 1 s after rank 1's last entry:
    # the job is over, and a call entered that late would be in flight, not stuck.
    alive = [{"host": "h0", "rank": r, "pid": 1, "time_ns": t, "device": None, "metric": "rank_alive",
              "value": v, "text": None} for r in range(2) for t, v in ((10 * s, 1.0), (51 * s, 0.0))]
    layout.write_part(path, "heartbeats", pa.Table.from_pylist(alive, schema=schema.HEARTBEATS), host="h0")
    result = analysis.localize(open_run(path))
    assert result["hung"] is True
    assert result["waiting"] == [1]
    assert [(x["rank"], x["group"], x["last_completed_seq"], x["missing_seq"]) for x in result["suspects"]] == [
        (0, "dp:0", 1, 2)]
    assert result["stuck_groups"] == [{"group": "dp:0", "seq": 2, "waiting": [1], "missing": [0]}]


def test_completions_set_aside_are_no_progress_while_the_processes_wind_down(tmp_path: Path) -> None:
    # A 2-rank NCCL job with a 20 s collective timeout: rank 0 stops before call 2; rank 1 enters
    # it at 20 s, and NCCL's abort at 40 s makes it read "completed" and ends rank 1's step span
    # there. Read at 45 s, the processes' agents were seen 1 s ago (not yet ended), so run_state
    # decides: the last progress is call 1 at 3 s, not the abort, and the job is hung.
    s = 1_000_000_000

    def marker(rank: int, seq: int, state: str, t: int) -> dict[str, object]:
        return {"rank": rank, "group": "dp:0", "seq": seq, "op": "all_reduce", "state": state, "time_ns": t,
                "step": seq - 1, "bytes": None, "peer": None}

    markers = [marker(r, 1, st, t) for r in range(2) for st, t in (("enqueued", 1 * s), ("completed", 3 * s))]
    markers += [marker(1, 2, "enqueued", 20 * s), marker(1, 2, "completed", 40 * s)]
    spans = [span(r, 0, "step", 0, 3 * s) for r in range(2)] + [span(1, 1, "step", 19 * s, 21 * s)]
    path = hand_run(tmp_path / "run", spans, markers, world=2)
    meta = open_run(path).meta
    layout.write_run_meta(path, dataclasses.replace(meta, config={**meta.config, "collective_timeout_s": 20.0}))
    alive = [{"host": "h0", "rank": r, "pid": 1, "time_ns": t, "device": None, "metric": "rank_alive",
              "value": 1.0, "text": None} for r in range(2) for t in (1 * s, 44 * s)]
    layout.write_part(path, "heartbeats", pa.Table.from_pylist(alive, schema=schema.HEARTBEATS), host="h0")
    result = analysis.localize(open_run(path), now_ns=45 * s)
    assert result["set_aside_since_ns"] == {1: 20 * s}
    assert result["hung"] is True, result["note"]
    assert [x["rank"] for x in result["suspects"]] == [0]
    state = run_state(open_run(path), now_ns=45 * s, hang=result)
    assert state["state"] == "hung" and state["last_progress_ns"] == 3 * s


def test_a_member_with_no_markers_at_all_sets_no_completion_aside(tmp_path: Path) -> None:
    # Rank 2 of the group wrote no marker (its parts lost, or its collector off): that says nothing
    # about the calls ranks 0 and 1 completed together, so nobody is stuck.
    def marker(rank: int, seq: int, state: str, t: int) -> dict[str, object]:
        return {"rank": rank, "group": "dp:0", "seq": seq, "op": "all_reduce", "state": state, "time_ns": t,
                "step": seq, "bytes": None, "peer": None}

    s = 1_000_000_000
    markers = [marker(r, q, st, q * s + (st == "completed")) for r in range(2) for q in range(1, 4)
               for st in ("enqueued", "completed")]
    path = hand_run(tmp_path / "run", [], markers, world=3)
    alive = [{"host": "h0", "rank": r, "pid": 1, "time_ns": t, "device": None, "metric": "rank_alive",
              "value": v, "text": None} for r in range(3) for t, v in ((1 * s, 1.0), (60 * s, 0.0))]
    layout.write_part(path, "heartbeats", pa.Table.from_pylist(alive, schema=schema.HEARTBEATS), host="h0")
    result = analysis.localize(open_run(path))
    assert result["waiting"] == []
    assert result["hung"] is False


def test_a_receive_past_the_sender_s_last_send_is_no_completion_but_a_send_may_be(tmp_path: Path) -> None:
    # Pipeline pair 0 -> 1: rank 0 sent 1 and 2 and then stopped; its send 2 completed unreceived
    # (that is allowed). Rank 1 "completed" receives 3 and 4, which were never sent (NCCL's abort
    # at the timeout), then entered receive 5 at the end. Rank 1 waits in receive 3, on rank 0.
    def marker(rank: int, seq: int, op: str, state: str, t: int) -> dict[str, object]:
        return {"rank": rank, "group": "pp:0", "seq": seq, "op": op, "state": state, "time_ns": t,
                "step": seq, "bytes": None, "peer": 1 - rank}

    s = 1_000_000_000
    markers = [marker(0, q, "send", st, q * 10 + (st == "completed")) for q in (1, 2) for st in ("enqueued", "completed")]
    markers += [marker(1, 1, "recv", "enqueued", 11), marker(1, 1, "recv", "completed", 12)]
    markers += [marker(1, q, "recv", st, q * 10 + (st == "completed")) for q in (3, 4) for st in ("enqueued", "completed")]
    markers += [marker(1, 2, "recv", st, 20 + (st == "completed")) for st in ("enqueued", "completed")]
    markers.append(marker(1, 5, "recv", "enqueued", 50 * s))
    path = hand_run(tmp_path / "run", [], markers, world=2)
    alive = [{"host": "h0", "rank": r, "pid": 1, "time_ns": t, "device": None, "metric": "rank_alive",
              "value": v, "text": None} for r in range(2) for t, v in ((10 * s, 1.0), (51 * s, 0.0))]
    layout.write_part(path, "heartbeats", pa.Table.from_pylist(alive, schema=schema.HEARTBEATS), host="h0")
    state = open_run(path)
    result = analysis.localize(state)
    assert result["hung"] is True
    assert result["waiting"] == [1]
    assert [(x["rank"], x["missing_seq"]) for x in result["suspects"]][:1] == [(0, 3)]


def _dp_trail(rank: int, seqs: range, per_step: int, t0: int = 0) -> list[dict[str, object]]:
    """A rank's markers of all-reduces ``seqs`` of dp:0, ``per_step`` to a step, 10 ms apart."""
    rows: list[dict[str, object]] = []
    for q in seqs:
        t = t0 + q * 10 * MS
        rows += [{"rank": rank, "group": "dp:0", "seq": q, "op": "all_reduce", "state": st, "time_ns": t + dt,
                  "step": q // per_step, "bytes": None, "peer": None} for st, dt in (("enqueued", 0), ("completed", MS))]
    return rows


def test_a_trail_that_ends_before_calls_its_peers_completed_with_it_was_lost_not_stopped(tmp_path: Path) -> None:
    # Three ranks, 4 all-reduces a step. Rank 0 completed every call of steps 0-5 with its peers
    # and stopped at step 6 before its first call; the trails of ranks 1 and 2 end in step 1
    # (their writers never wrote the rest). Rank 0's completions prove they went on: it is the one
    # that stopped, outside its calls; theirs is no "never entered".
    markers = _dp_trail(0, range(24), 4) + _dp_trail(1, range(6), 4) + _dp_trail(2, range(5), 4)
    spans = [span(0, k, "step", k * 40 * MS, 40 * MS) for k in range(6)] + [span(0, 6, "forward", 240 * MS, 5 * MS)]
    spans += [span(r, 0, "step", 0, 40 * MS) for r in (1, 2)]
    path = hand_run(tmp_path / "run", spans, markers, world=3)
    result = analysis.localize(open_run(path))
    assert result["hung"] is True and result["lost"] == [1, 2] and result["waiting"] == []
    assert [(s["rank"], s["state"], s["group"], s["last_completed_seq"]) for s in result["suspects"]] == [
        (0, "hung", "dp:0", 23)]
    assert result["suspects"][0]["where"] == "stopped outside its calls in step 6 (its last call, dp:0 seq 23, completed)"
    assert "1, 2" in result["note"]
    states = analysis.rank_states(open_run(path), hang=result).set_index("rank")["state"]
    assert states.to_dict() == {0: "hung", 1: "lost", 2: "lost"}
    # Read while the job may still run (its last data 5 s old, under the hang threshold: writers
    # that lag): the trails are lost, nobody is stopped yet.
    live = analysis.localize(open_run(path), now_ns=int(result["suspects"][0]["last_seen_ns"]) + 5 * 10**9)
    assert live["hung"] is False and live["lost"] == [1, 2] and live["suspects"] == []


def test_a_rank_whose_last_steps_were_lost_is_still_named_for_the_call_its_peers_wait_in(tmp_path: Path) -> None:
    # The culprit's node went down: rank 2's trail ends in step 1, its peers completed calls with
    # it to the end of step 4 and sit inside the first call of step 5 (a host blocked in it). The
    # calls rank 2 is proven to have made end at seq 19; it never entered 20.
    markers = _dp_trail(0, range(20), 4) + _dp_trail(1, range(20), 4) + _dp_trail(2, range(6), 4)
    markers += [{"rank": r, "group": "dp:0", "seq": 20, "op": "all_reduce", "state": "enqueued",
                 "time_ns": 200 * MS + r, "step": 5, "bytes": None, "peer": None} for r in (0, 1)]
    path = hand_run(tmp_path / "run", [], markers, world=3)
    result = analysis.localize(open_run(path))
    assert result["hung"] is True and result["lost"] == [2] and result["waiting"] == [0, 1]
    assert [(s["rank"], s["missing_seq"], s["where"]) for s in result["suspects"]] == [
        (2, 20, "never entered dp:0 seq 20")]


@pytest.mark.parametrize("ahead", [3, 4])
def test_calls_completed_up_to_a_step_ahead_of_a_member_lose_no_trail(ahead: int, tmp_path: Path) -> None:
    # Rank 1 "completed" calls past rank 0's last, up to a step's worth (4 a step): an abort or
    # futures fired at launch. Rank 0 never entered seq 8 and rank 1 waits on it.
    markers = _dp_trail(0, range(8), 4) + _dp_trail(1, range(8 + ahead), 4)
    markers.append({"rank": 1, "group": "dp:0", "seq": 8 + ahead, "op": "all_reduce", "state": "enqueued",
                    "time_ns": 150 * MS, "step": 3, "bytes": None, "peer": None})
    result = analysis.localize(open_run(hand_run(tmp_path / "run", [], markers, world=2)))
    assert result["lost"] == [] and result["waiting"] == [1]
    assert [(s["rank"], s["missing_seq"]) for s in result["suspects"]] == [(0, 8)]


def test_calls_completed_more_than_a_step_ahead_of_a_member_are_its_lost_trail(tmp_path: Path) -> None:
    # The same with five calls ahead of rank 0: rank 0 made them too (its trail ends early); rank
    # 1, stuck in none and with no later step, is the one that stopped.
    markers = _dp_trail(0, range(8), 4) + _dp_trail(1, range(13), 4)
    result = analysis.localize(open_run(hand_run(tmp_path / "run", [], markers, world=2)))
    assert result["lost"] == [0] and result["waiting"] == []
    assert [(s["rank"], s["where"]) for s in result["suspects"]] == [
        (1, "stopped outside its calls in step 3 (its last call, dp:0 seq 12, completed)")]


@pytest.mark.parametrize("name", ["gpu-hang-lost-trails-dp4", "gpu-hang-lost-trails-tp2dp2",
                                  "gpu-hang-lost-trails-tp2pp2"])
def test_real_nccl_hangs_whose_waiting_ranks_lost_their_trails_name_the_planted_rank(
        name: str, tmp_path: Path, cli: Any) -> None:
    """tests/data/gpu-hang-lost-trails-*: the bundled trainer on 4x H100 (NCCL 2.28.9) with a hang
    planted (run.json's inject), written by a collector whose waiting ranks' writers could not run
    while they waited: their trails end at steps 0-1, the hung rank's reaches its hang step.
    Before, the waiting ranks were named ("never entered world seq 1")."""
    data = Path(__file__).parent / "data"
    path = shutil.copytree(data / name, tmp_path / name)
    planted = json.loads((path / "run.json").read_text())["config"]["inject"][0]
    rank = int(planted.split("rank=")[1].split(",")[0])
    step = int(planted.split("step=")[1].split(",")[0])
    result = analysis.localize(open_run(path))
    assert result["hung"] is True
    first = result["suspects"][0]
    assert first["rank"] == rank, result["suspects"]
    assert first["where"].startswith(f"stopped outside its calls in step {step}")
    assert sorted(result["lost"]) == sorted(set(range(4)) - {rank})
    text = cli("localize", str(path))
    assert text.exit_code == 0 and f"  1. rank {rank} (hung)" in text.output and "note: the trails of" in text.output


def test_a_rank_that_hung_before_its_first_send_is_the_one_its_pipeline_peer_waits_on(
        tmp_path: Path, cli: Any) -> None:
    """tests/data/cpu-2x2x2-hang-before-first-send: the bundled trainer on CPU (gloo, tp2 x pp2 x
    dp2), rank 5 (pp1) hung at step 0 before it sent or received anything. Its pipeline peer, rank
    1, waits in their exchange; no groups table declares a point-to-point pair, so rank 5, with no
    marker there, was not its missing member, and rank 1 (missing from its DP call) was named
    second as hung. Both ends of a pair are its members now: rank 1 is rank 5's victim."""
    path = shutil.copytree(Path(__file__).parent / "data" / "cpu-2x2x2-hang-before-first-send", tmp_path / "run")
    result = analysis.localize(open_run(path))
    assert result["hung"] is True
    assert [s["rank"] for s in result["suspects"]] == [5], result["suspects"]
    assert result["suspects"][0]["waited_on_by"] == 7 and 1 in result["waiting"]
    pair = next(g for g in result["stuck_groups"] if g["group"] == "p2p:5>1")
    assert pair["waiting"] == [1] and pair["missing"] == [5]
    text = cli("localize", str(path))
    assert text.exit_code == 0 and "  1. rank 5 (hung)" in text.output and "  2. " not in text.output


def test_a_rank_frozen_before_its_first_flush_is_the_hang_suspect_in_its_place(tmp_path: Path, cli: Any) -> None:
    """tests/data/cpu-pp4-dp2-frozen-before-first-flush: the bundled trainer on CPU (gloo, pp4 x
    dp2), rank 3 frozen at step 0 holding the interpreter lock before it wrote anything (no ranks
    row, no spans, no markers). Its peers' step spans, closed as their receives timed out, made
    the run read as finished: "not hung", "STRAGGLERS none". Now the job's world size counts, rank
    3 is the silent suspect its peers wait on, its place read off its peers' groups."""
    path = shutil.copytree(Path(__file__).parent / "data" / "cpu-pp4-dp2-frozen-before-first-flush", tmp_path / "run")
    run = open_run(path)
    result = analysis.localize(run)
    assert result["hung"] is True and [s["rank"] for s in result["suspects"]] == [3], result["suspects"]
    suspect = result["suspects"][0]
    assert suspect["state"] == "silent" and suspect["place_inferred"] is True and suspect["host"] == "unknown"
    assert suspect["coords"] == {"pp": 1, "dp": 1, "tp": 0} and suspect["waited_on_by"] == 7
    states = analysis.rank_states(run, hang=result)
    assert states.set_index("rank").loc[3, "state"] == "silent" and len(states) == 8
    assert states.set_index("rank").loc[3, ["pp", "dp", "tp"]].tolist() == [1, 1, 0]
    text = cli("report", str(path), "--no-whatif")
    assert text.exit_code == 0, text.output
    assert "STRAGGLERS not told: the run hung" in text.output
    assert "suspect rank 3 (silent) (it wrote nothing; pp1 dp1 tp0 by its peers' groups, host unknown)" in text.output


def test_cache_follows_a_growing_run_and_serves_cursors(runs: dict[str, Path], tmp_path: Path) -> None:
    spans = [span(r, 0, "step", 0, 5 * MS) for r in range(3)]
    path = hand_run(tmp_path / "run", spans, [])
    run = open_run(path)
    assert len(analysis.step_times(run)) == 3
    layout.write_part(path, "spans", pa.Table.from_pylist([span(0, 1, "step", 5 * MS, 5 * MS)], schema=schema.SPANS),
                      rank=0)
    run.refresh()
    assert len(analysis.step_times(run)) == 4
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(len(analysis.step_times(run.with_cursor()))))
    thread.start()
    thread.join()
    assert seen == [4]


def test_drift_names_the_collective_and_the_rank(tmp_path: Path) -> None:
    # Rank 2 reaches the gradient sync 1 ms later every step (a growing host delay, MegaScale's
    # MFU-drift case); compute is the same for everyone, so step time grows with it.
    spans = []
    t0 = 0
    for step in range(12):
        late = step * MS
        step_len = (20 + 2) * MS + late
        for r in range(3):
            arrive = t0 + 20 * MS + (late if r == 2 else 0)
            spans += [
                span(r, step, "step", t0, step_len),
                span(r, step, "forward", t0, 20 * MS),
                span(r, step, "collective", arrive, t0 + step_len - arrive, group="dp:0", seq=step,
                      name="dp.reduce_scatter"),
            ]
        t0 += step_len
    run = open_run(hand_run(tmp_path / "run", spans, []))
    drift = analysis.skew_drift(run)
    assert drift["drifting"] is True
    top = drift["collectives"][0]
    assert top["name"] == "dp.reduce_scatter" and top["group_kind"] == "dp"
    assert [r["rank"] for r in top["ranks"]] == [2]
    per_step = analysis.mfu(run)
    assert analysis.mfu_drift(per_step)["drifting"] is True
    flat = per_step.assign(step_time_ns=22 * MS)
    assert analysis.mfu_drift(flat)["drifting"] is False


def test_collector_footprint_estimates_device_time_from_the_stamps_per_step() -> None:
    """The median of collector_stamps over rank-steps; on CUDA ranks times ~2 us each against the
    step; on CPU ranks the count alone; nothing for runs without the metric."""
    import duckdb

    from megascope.analysis.report import STAMP_DEVICE_NS, STAMP_HOST_NS, collector_footprint

    con = duckdb.connect()
    metrics = pd.DataFrame({"rank": [0, 0, 1, 1, 1], "step": [0, 1, 0, 1, 1],
                            "name": ["collector_stamps"] * 4 + ["loss"], "value": [1000.0, 1200.0, 1100.0, 9.0, 2.5]})
    ranks = pd.DataFrame({"rank": [0, 1], "device": ["cuda:0", "cuda:1"]})
    con.register("metrics", metrics)
    con.register("ranks", ranks)
    got = collector_footprint(con, step_time_ns=400e6)
    assert got["stamps_per_step"] == 1050.0  # median of 1000, 1200, 1100, 9
    assert got["device_ns_per_step_est"] == 1050.0 * STAMP_DEVICE_NS
    assert got["share_of_step_est"] == pytest.approx(1050.0 * STAMP_DEVICE_NS / 400e6)
    assert got["host_ns_per_step_est"] == 1050.0 * STAMP_HOST_NS
    assert got["host_share_of_step_est"] == pytest.approx(1050.0 * STAMP_HOST_NS / 400e6)
    assert got["host_bound"] is False and collector_footprint(con, 400e6, host_bound=True)["host_bound"] is True
    con.unregister("ranks")
    con.register("ranks", pd.DataFrame({"rank": [0, 1], "device": ["cpu", "cpu"]}))
    cpu = collector_footprint(con, step_time_ns=400e6)
    assert cpu["stamps_per_step"] == 1050.0 and cpu["device_ns_per_step_est"] is None
    assert cpu["host_ns_per_step_est"] is None
    con.unregister("metrics")
    con.register("metrics", metrics[metrics["name"] == "loss"])
    assert collector_footprint(con, step_time_ns=None) == {"stamps_per_step": None}


def test_report_warns_that_on_host_bound_ranks_the_collector_costs_more_than_its_stamps(
        tmp_path: Path, cli: Callable[..., Result], monkeypatch: pytest.MonkeyPatch) -> None:
    """A real 4x H100 run: the COLLECTOR line gives the stamps' device and host time; where some
    rank's device waited for its host, a second line says those sums understate the cost and how
    to measure it. Without host-bound ranks, no second line."""
    report_module = importlib.import_module("megascope.analysis.report")
    run_dir = shutil.copytree(Path(__file__).parent / "data" / "gpu-tp-partner", tmp_path / "run")
    plain = cli("report", str(run_dir))
    assert plain.exit_code == 0
    line = next(x for x in plain.output.splitlines() if x.startswith("COLLECTOR"))
    assert "of device time" in line and "of the training thread's" in line
    assert "MEGASCOPE_DISABLE=1" not in plain.output
    real = report_module.host_lead_summary

    def bound(run: Any) -> dict[str, Any]:
        out = real(run)
        return {**out, "host_bound": [{"rank": 1, "calls": 100, "lead_p10_ns": 0, "lead_p50_ns": 1, "starved_frac": 0.4}]}

    monkeypatch.setattr(report_module, "host_lead_summary", bound)
    warned = cli("report", "--json", str(run_dir))
    assert warned.exit_code == 0 and json.loads(warned.output)["collector"]["host_bound"] is True
    text = cli("report", str(run_dir)).output
    assert "host-bound ranks: there the collector's host time is step time" in text
    assert "MEGASCOPE_DISABLE=1" in text


def test_gc_pauses_inside_steps_per_rank(tmp_path: Path, cli: Callable[..., Result]) -> None:
    """gc.* host spans inside steps add up per rank; a collection outside any step is not counted,
    and other host spans are not collections."""
    spans = []
    for r in range(3):
        for step in range(2):
            spans.append(span(r, step, "step", step * 100 * MS, 100 * MS))
    spans += [span(1, 0, "host", 10 * MS, 40 * MS, name="gc.gen2"), span(1, 1, "host", 110 * MS, 2 * MS, name="gc.gen0"),
              span(2, 1, "host", 150 * MS, 5 * MS, name="gc.gen1"), span(0, 0, "host", 20 * MS, 9 * MS, name="checkpoint")]
    outside = span(0, 0, "host", 250 * MS, 70 * MS, name="gc.gen2")
    outside["step"] = None
    run = open_run(hand_run(tmp_path / "run", spans + [outside], []))
    got = analysis.report(run, with_whatif=False)["gc"]
    assert got["ranks_with_gc"] == 2 and got["ranks"] == 3 and got["total_ns"] == 47 * MS
    assert got["top"] == [{"rank": 1, "steps": 2, "total_ns": 42 * MS, "max_step_ns": 40 * MS},
                          {"rank": 2, "steps": 1, "total_ns": 5 * MS, "max_step_ns": 5 * MS}]
    out = cli("report", str(tmp_path / "run"), "--no-whatif", "-q")
    assert out.exit_code == 0, out.output
    assert "GC PAUSES inside steps: 2 of 3 ranks, 47.0 ms in all; longest: rank 1, 42.0 ms over 2 steps" in out.output


@pytest.mark.parametrize(("step_level", "wait_ms"), [(True, 14), (False, 40)])
def test_sampled_calls_scale_their_wait_and_the_bound_only_for_whole_microbatches(tmp_path: Path, step_level: bool,
                                                                                wait_ms: int) -> None:
    """Eight overlapping asynchronous calls in a step (10 ms each, 1 ms apart), rank 1 5 ms late at
    each; the collector timed calls 0 and 4 and counted 8 (collector_calls). Timed one in N among
    step-level calls (collector_step_calls, a gradient sync's buckets), rank 0's wait is the timed
    waits scaled (2 x 5 ms x 4) bounded by the timed spans' extent, 14 ms; timed in one micro-batch
    of four instead, the bound is scaled with the wait: min(10, 14) x 4 = 40 ms."""
    spans, metrics = [], []
    for r in range(2):
        spans.append(span(r, 0, "step", 0, 100 * MS))
        for i in (0, 4):
            arrive = i * MS + (5 * MS if r == 1 else 0)
            spans.append(span(r, 0, "collective", arrive, 10 * MS - (arrive - i * MS), group="dp:0", seq=i))
        metrics.append({"rank": r, "step": 0, "name": f"{schema.COLLECTOR_CALLS_METRIC}dp:0", "value": 8.0,
                        "time_ns": None})
        if step_level:
            metrics.append({"rank": r, "step": 0, "name": f"{schema.COLLECTOR_STEP_CALLS_METRIC}dp:0", "value": 8.0,
                            "time_ns": None})
    run_dir = hand_run(tmp_path / "run", spans, [], world=2, hosts=("h0", "h0"))
    for r in range(2):
        layout.write_part(run_dir, "metrics", pa.Table.from_pylist([m for m in metrics if m["rank"] == r],
                                                                   schema=schema.METRICS), rank=r)
    con = open_run(run_dir).con
    prepare(con)
    waits = dict(con.execute("SELECT rank, wait_ns FROM ms_cache.rank_step").fetchall())
    assert waits == {0: wait_ms * MS, 1: 0}
