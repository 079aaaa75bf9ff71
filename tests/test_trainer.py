"""The bundled trainer's single-process parts: config checks, model FLOPs, data, straggler work, CLI errors."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import Result
from torch.utils.flop_counter import FlopCounterMode

from megascope.errors import ConfigError
from megascope.ingest import ingest_kineto
from megascope.inject import parse_injects
from megascope.store import open_run
from megascope.trainer.config import ModelConfig, TrainConfig
from megascope.trainer.data import Prefetcher, SyntheticLanguage, TokenFile
from megascope.trainer.faults import Burner
from megascope.trainer.flops import matmul_params, model_flops_per_step
from megascope.trainer.model import GPTStage
from megascope.trainer.tp import TPContext
from megascope.trainer.zero import lr_at

TINY = ModelConfig(layers=2, hidden=32, heads=4, vocab=64, seq_len=16)


def _stage(cfg: ModelConfig, seed: int = 0) -> GPTStage:
    tp = TPContext(comm=None, pg=None, size=1, index=0, sequence_parallel=True)
    return GPTStage(cfg, tp, stage=0, stages=1, seed=seed, device=torch.device("cpu"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 4, "tp": 2, "pp": 2, "dp": 2}, "does not match world size 4"),
        ({"world_size": 6, "tp": 4}, "not divisible by tp*pp"),
        ({"world_size": 3, "pp": 3}, "layers are not divisible by 3 pipeline stages"),
        ({"world_size": 8, "tp": 8}, "heads are not divisible"),
        ({"world_size": 2, "dp": 2, "global_batch": 6, "micro_batches": 2}, "does not split into 2 data-parallel"),
        ({"world_size": 2, "faults": parse_injects(["hang:rank=1,step=9"]), "steps": 5}, "past the last step"),
        ({"world_size": 2, "faults": parse_injects(["skew:rank=2,ms=5"])}, "outside a job of 2 ranks"),
        ({"world_size": 1, "tp_comm_spans": "some"}, "unknown --tp-comm-spans 'some'"),
        ({"world_size": 1, "dp_comm_spans": "first"}, "unknown --dp-comm-spans 'first'"),
    ],
)
def test_bad_configs_are_rejected_with_the_reason(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("*", r"\*")):
        TrainConfig(out=tmp_path, model=TINY, **kwargs)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "4", "--tp", "2", "--pp", "2", "--dp", "2"], "does not match world size 4"),
        (["--nproc", "2", "--pp", "2", "--layers", "3"], "3 layers are not divisible by 2 pipeline stages"),
        (["--nproc", "2", "--inject", "slow:rank=1"], "unknown fault kind 'slow'"),
        (["--nproc", "2", "--inject", "straggler:rank=0,factor=0.5"], "factor must be > 1"),
        (["--nproc", "1", "--collector-ab", "1"], "--collector-ab needs blocks of at least 2 steps"),
        (["--nproc", "1", "--steps", "3", "--profile", "4"], "--profile takes between 0 and --steps (3) steps"),
    ],
)
def test_cli_bad_arguments_fail_in_one_line_before_any_rank_starts(tmp_path: Path, args: list[str],
                                                                   message: str, cli: Callable[..., Result]) -> None:
    out = tmp_path / "run"
    result = cli("train", *args, "-o", str(out))
    assert result.exit_code == 1
    assert message in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists()  # nothing was started, nothing written


def test_manual_gc_freezes_disables_and_collects_on_the_same_steps_everywhere() -> None:
    import gc

    from megascope.trainer.loop import manual_gc

    assert gc.isenabled()
    with manual_gc(0) as collect_now:
        assert gc.isenabled() and gc.get_freeze_count() == 0
        assert not any(collect_now(s) for s in range(10))
    with manual_gc(3) as collect_now:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        assert [s for s in range(10) if collect_now(s)] == [3, 6, 9]
    assert gc.isenabled() and gc.get_freeze_count() == 0
    # A process that had frozen objects before (a forked rank) keeps them frozen.
    gc.freeze()
    try:
        with manual_gc(2):
            assert not gc.isenabled()
        assert gc.isenabled() and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()


def test_cli_rejects_a_negative_gc_interval(tmp_path: Path, cli: Callable[..., Result]) -> None:
    result = cli("train", "--nproc", "1", "--gc-interval", "-1", "-o", str(tmp_path / "r"))
    assert result.exit_code != 0 and "--gc-interval" in result.output and "Traceback" not in result.output
    with pytest.raises(ConfigError, match="--gc-interval must be >= 0"):
        TrainConfig(out=tmp_path / "r", world_size=1, gc_interval=-1)


def test_ab_cost_compares_blocks_without_their_first_steps_and_charges_the_flushes() -> None:
    from megascope.trainer.ab import ab_cost

    on = [True, True, False, False, True, True, False, False]
    seconds = [9.0, 1.0, 5.0, 0.9, 5.0, 1.1, 5.0, 0.8]  # every first step of a block is left out
    got = ab_cost(seconds, on, [0.2, 0.2], warmup=0)  # two flushes, each after 2 recorded steps
    assert (got["on_steps"], got["off_steps"]) == (2, 2)
    assert got["on_mean_s"] == pytest.approx(1.05) and got["off_mean_s"] == pytest.approx(0.85)
    assert got["flush_per_step_s"] == pytest.approx(0.1)
    assert got["cost"] == pytest.approx(1.05 / 0.85 - 1)
    assert got["cost_charged"] == pytest.approx(1.15 / 0.85 - 1)
    assert ab_cost(seconds, on, [0.2, 0.2], warmup=2)["on_steps"] == 1  # step 1 is warm-up: step 5 only
    assert ab_cost(seconds, on, [0.2, 0.2], warmup=2)["on_mean_s"] == pytest.approx(1.1)
    with pytest.raises(ValueError, match="recorded and unrecorded"):
        ab_cost(seconds, on, [], warmup=6)
    with pytest.raises(ValueError, match="on/off flags"):
        ab_cost(seconds, on[:-1], [], warmup=0)


def test_model_flops_match_counted_matmuls_plus_attention() -> None:
    """The matmul part of the documented formula equals what torch's FLOP counter sees in one
    forward+backward; the attention part is the documented 12*L*h*min(s, window) per token."""
    for window in (None, 8):
        cfg = ModelConfig(layers=2, hidden=32, heads=4, vocab=64, seq_len=16, window=window)
        stage = _stage(cfg)
        batch = 3
        tokens = torch.randint(0, cfg.vocab, (cfg.seq_len, batch))
        with FlopCounterMode(display=False) as counter:
            stage(tokens, targets=tokens).mean().backward()
        counted_mm = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "mm" in str(op))
        n_tokens = cfg.seq_len * batch
        assert counted_mm == 6 * matmul_params(cfg) * n_tokens
        context = cfg.seq_len if window is None else window
        attention = 12 * cfg.layers * cfg.hidden * context * n_tokens
        assert model_flops_per_step(cfg, tokens=n_tokens) == counted_mm + attention


def test_model_start_depends_on_seed_only(tmp_path: Path) -> None:
    a, b, c = _stage(TINY, seed=1), _stage(TINY, seed=1), _stage(TINY, seed=2)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if pa.dim() >= 2:
            assert not torch.equal(pa, pc), name


def test_sliding_window_limits_what_attention_sees() -> None:
    """With a window of 4, changing token 0 must not change the loss at positions >= 4+1 (two
    layers widen the receptive field to 2*(4-1) positions), but does without a window."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (16, 1))
    changed = tokens.clone()
    changed[0] = (changed[0] + 1) % 64
    for window, far_unchanged in ((4, True), (None, False)):
        stage = _stage(ModelConfig(layers=2, hidden=32, heads=4, vocab=64, seq_len=16, window=window))
        with torch.no_grad():
            base = stage(tokens, targets=tokens)
            other = stage(changed, targets=tokens)
        far = slice(2 * (4 - 1) + 1, 16)
        assert torch.allclose(base[far], other[far]) == far_unchanged
        assert not torch.allclose(base[0], other[0])


def test_synthetic_language_is_seeded_and_learnable() -> None:
    lang = SyntheticLanguage(vocab=64, seq_len=32, seed=3)
    a = lang.batch(step=5, global_batch=8)
    assert a.shape == (8, 33) and a.dtype == torch.long
    assert torch.equal(a, SyntheticLanguage(vocab=64, seq_len=32, seed=3).batch(step=5, global_batch=8))
    assert not torch.equal(a, lang.batch(step=6, global_batch=8))
    # Structure: nearly every transition goes to one of the token's few successors.
    prev, nxt = a[:, :-1].reshape(-1), a[:, 1:].reshape(-1)
    hits = (lang.successors[prev] == nxt.unsqueeze(1)).any(dim=1).float().mean()
    assert hits > 0.9


def test_token_file_batches_are_slices_of_the_file(tmp_path: Path) -> None:
    data = (np.arange(5000) % 300).astype(np.uint16)
    path = tmp_path / "train.bin"
    data.tofile(path)
    src = TokenFile(path, dtype="uint16", vocab=300, seq_len=20, seed=0)
    batch = src.batch(step=0, global_batch=4)
    assert batch.shape == (4, 21)
    for row in batch:
        start = int(row[0])
        # consecutive ids modulo 300, as written
        assert torch.equal(row, torch.tensor([(start + i) % 300 for i in range(21)]))
    with pytest.raises(ConfigError, match="outside the model's vocabulary"):
        TokenFile(path, dtype="uint16", vocab=100, seq_len=20, seed=0).batch(step=0, global_batch=4)
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        TokenFile(path, dtype="uint16", vocab=300, seq_len=6000, seed=0)


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_prefetcher_yields_this_ranks_rows_in_step_order(process: bool) -> None:
    lang = SyntheticLanguage(vocab=64, seq_len=8, seed=0)
    with Prefetcher(lang, steps=range(3), global_batch=8, rows=slice(4, 8), process=process) as data:
        got = [data.next() for _ in range(3)]
    for step, batch in enumerate(got):
        assert torch.equal(batch, lang.batch(step, 8)[4:8])


def test_closing_a_data_worker_runs_none_of_the_rank_s_sigterm_handlers(tmp_path: Path) -> None:
    # A collector in the rank flushes its buffers on SIGTERM; the forked worker must not.
    import signal

    mark = tmp_path / "handled"
    rank = os.getpid()

    def handler(*_: object) -> None:
        if os.getpid() != rank:  # only ever run in a worker: say so, and end it
            mark.write_text(str(os.getpid()))
            os._exit(0)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        data = Prefetcher(SyntheticLanguage(vocab=64, seq_len=8, seed=0), steps=range(50), global_batch=8,
                          rows=slice(0, 8), process=True)
        with data:
            data.next()
        assert data._worker is not None and data._worker.exitcode == -signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert not mark.exists()


def test_a_data_worker_s_error_reaches_the_rank_and_the_worker_ends() -> None:
    class Broken:
        seq_len = 4

        def batch(self, step: int, global_batch: int) -> torch.Tensor:
            if step == 1:
                raise ValueError("token file truncated")
            return torch.zeros(global_batch, 5, dtype=torch.long)

    data = Prefetcher(Broken(), steps=range(3), global_batch=2, rows=slice(0, 2), process=True)
    with data:
        assert data.next().shape == (2, 5)
        with pytest.raises(RuntimeError, match="data worker: ValueError: token file truncated"):
            data.next()
    assert data._worker is not None and not data._worker.is_alive()


def test_straggler_burner_does_proportional_matmul_work() -> None:
    stage = _stage(TINY)
    tokens = TINY.seq_len * 2
    forward_flops = 2 * matmul_params(TINY) * tokens  # one forward's GEMMs over these tokens
    for factor, fwd_units in ((3.0, 2.0), (1.5, 0.5)):
        burner = Burner(stage.matmul_weights(), tokens=tokens, factor=factor, autocast=torch.no_grad)
        for phase, units in (("forward", fwd_units), ("backward", 2 * fwd_units)):
            with FlopCounterMode(display=False) as counter:
                burner(phase)
            assert counter.get_total_flops() == pytest.approx(units * forward_flops, rel=0.02)


def test_learning_rate_warms_up_then_decays() -> None:
    lrs = [lr_at(s, base=1.0, warmup=2, total=10) for s in range(10)]
    assert lrs[0] == 0.5 and lrs[1] == 1.0
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:], strict=False))
    assert lrs[-1] >= 0.1


def test_timed_straggler_burner_computes_for_the_missing_time() -> None:
    import time

    burner = Burner(_stage(TINY).matmul_weights(), tokens=32, factor=3.0, autocast=torch.no_grad, timed=True)
    t0 = time.perf_counter()
    burner("forward", 0.05)
    assert time.perf_counter() - t0 >= 2 * 0.05
    assert burner.sink is not None  # it multiplied, it did not sleep


@pytest.mark.parametrize(("setting", "cuda", "cpu"), [("auto", "rotate", "all"), ("first", "first", "first"),
                                                     ("rotate", "rotate", "rotate"), ("all", "all", "all")])
def test_tp_calls_are_sampled_where_timing_events_cost_device_time(tmp_path: Path, setting: str, cuda: str,
                                                                  cpu: str) -> None:
    cfg = TrainConfig(out=tmp_path, model=TINY, world_size=1, tp_comm_spans=setting)
    assert (cfg.tp_comm_spans_on("cuda"), cfg.tp_comm_spans_on("cpu")) == (cuda, cpu)
    assert (cfg.sampled_tp("cuda"), cfg.sampled_tp("cpu")) == (cuda != "all", cpu != "all")


@pytest.mark.parametrize(("tp", "dp", "cuda", "cpu"), [
    ("auto", "auto", (("tp", "dp"), 4, 4), ((), 0, 0)),
    ("all", "rotate", (("dp",), 0, 4), (("dp",), 0, 4)),
    ("rotate", "rotate", (("tp", "dp"), 4, 4), (("tp", "dp"), 4, 4)),
    ("first", "all", (("tp",), 0, 0), (("tp",), 0, 0)),
])
def test_the_collectors_sampling_follows_the_tp_and_dp_span_settings(tmp_path: Path, tp: str, dp: str,
                                                                   cuda: tuple, cpu: tuple) -> None:
    cfg = TrainConfig(out=tmp_path, model=TINY, world_size=1, micro_batches=4, tp_comm_spans=tp, dp_comm_spans=dp)
    assert (cfg.sampled_comm("cuda"), cfg.sampled_comm("cpu")) == (cuda, cpu)


def test_the_launcher_calls_a_job_stalled_past_the_limit_or_four_of_its_longest_gaps(tmp_path: Path) -> None:
    """The stall limit is four collective timeouts (at least 120 s), or four times the longest gap
    between two steps' ends seen so far, whichever is longer: slow steps are not a hang."""
    import time

    from megascope.trainer.launch import _Stall, stall_limit_s

    assert stall_limit_s(15.0) == 120.0 and stall_limit_s(60.0) == 240.0

    def steps_ended(scratch: Path, ago_s: float, *, rank: int = 0) -> None:
        progress = scratch / f"progress-{rank:05d}"
        progress.touch()
        when = time.time() - ago_s
        os.utime(progress, (when, when))

    quick = tmp_path / "quick"
    quick.mkdir()
    stall = _Stall(str(quick), collective_timeout_s=15.0)
    assert stall.check() is None  # no rank started yet
    steps_ended(quick, 50.0)
    steps_ended(quick, 500.0, rank=1)
    assert stall.check() is None  # the newest end counts: 50 s ago
    steps_ended(quick, 200.0)
    steps_ended(quick, 300.0, rank=1)
    idle = stall.check()
    assert idle is not None and 199.0 < idle < 210.0

    slow = tmp_path / "slow"
    slow.mkdir()
    stall = _Stall(str(slow), collective_timeout_s=15.0)
    steps_ended(slow, 1000.0)
    assert stall.check() is not None  # 1,000 s without a step, no gap seen yet
    steps_ended(slow, 900.0)  # a step took 100 s: the limit becomes 400 s
    assert stall.check() is not None  # 900 s
    assert stall.longest_gap_s == pytest.approx(100.0, abs=1.0)
    steps_ended(slow, 300.0)  # a step took 600 s: the limit becomes 2,400 s
    assert stall.check() is None  # 300 s: past 120 s, not past 2,400 s


class _StuckRank:
    """A rank process that outlives SIGTERM and SIGKILL, as one whose NCCL kernel is stuck while the
    driver tears its context down: every join times out."""

    def __init__(self) -> None:
        self.pid = 4_000_000
        self.signals: list[str] = []
        self.joined: list[float | None] = []

    def is_alive(self) -> bool:
        return True

    def terminate(self) -> None:
        self.signals.append("TERM")

    def kill(self) -> None:
        self.signals.append("KILL")

    def join(self, timeout: float | None = None) -> None:
        self.joined.append(timeout)


def test_the_launcher_leaves_a_rank_that_outlives_sigkill_behind_instead_of_hanging(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """After SIGTERM and SIGKILL, a rank still alive is given up on: every join has a timeout, and it
    leaves multiprocessing's children, which the interpreter would otherwise join forever at exit."""
    import multiprocessing.process as mp_process
    import time

    from megascope.trainer import launch
    from megascope.trainer.launch import _stop

    monkeypatch.setattr(launch, "TERM_GRACE_S", 1.0)  # its CPU cannot be read: the whole grace

    stuck = _StuckRank()
    mp_process._children.add(stuck)  # type: ignore[attr-defined]
    try:
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="megascope.trainer.launch"):
            left = _stop([stuck])
        assert time.monotonic() - t0 < 20.0
        assert left == [stuck]
        assert stuck.signals == ["TERM", "KILL"]
        assert stuck.joined and all(t is not None for t in stuck.joined)
        assert stuck not in mp_process._children  # type: ignore[attr-defined]
        assert "still alive after SIGKILL" in caplog.text
    finally:
        mp_process._children.discard(stuck)  # type: ignore[attr-defined]


@pytest.mark.timing
def test_sigterm_s_grace_ends_for_a_rank_that_cannot_act_on_it_not_for_one_that_works() -> None:
    """A rank that ignores SIGTERM and uses no CPU (frozen, its handler unable to run) is given up
    on after the idle window; one that keeps a core busy (flushing) gets the whole grace."""
    import subprocess
    import sys
    import time

    from megascope.trainer.launch import _await_term

    class Rank:
        def __init__(self, body: str) -> None:
            code = f"import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint(flush=True)\n{body}\n"
            self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
            self.pid = self.proc.pid

        def is_alive(self) -> bool:
            return self.proc.poll() is None

    frozen, busy = Rank("time.sleep(60)"), Rank("while True:\n    pass")
    try:
        for rank in (frozen, busy):
            assert rank.proc.stdout is not None and rank.proc.stdout.readline() == b"\n"  # SIGTERM ignored now
        t0 = time.monotonic()
        _await_term([frozen], grace_s=8.0, idle_s=1.0)
        idle_wait = time.monotonic() - t0
        t0 = time.monotonic()
        _await_term([frozen, busy], grace_s=3.0, idle_s=1.0)
        busy_wait = time.monotonic() - t0
    finally:
        for rank in (frozen, busy):
            rank.proc.kill()
            rank.proc.communicate()
    assert 1.0 <= idle_wait < 4.0, idle_wait
    assert busy_wait >= 3.0, busy_wait


def test_a_failed_rank_stops_the_others_and_names_its_exit(tmp_path: Path) -> None:
    """One rank exits non-zero while another blocks forever: the launcher returns the failed rank and
    its exit code within seconds, the blocked one stopped."""
    import multiprocessing as std_mp
    import time

    from megascope.trainer.launch import _Stall, _wait_ranks

    ctx = std_mp.get_context("fork")
    failing = ctx.Process(target=os._exit, args=(3,))
    blocked = ctx.Process(target=time.sleep, args=(600,))
    blocked.start()
    failing.start()
    t0 = time.monotonic()
    result = _wait_ranks([blocked, failing], _Stall(str(tmp_path), 15.0), timeout_s=15.0, out=tmp_path)
    assert result == (1, 3)
    assert not blocked.is_alive() and blocked.exitcode == -15  # SIGTERM
    assert time.monotonic() - t0 < 15.0


def test_the_failure_line_names_the_rank_that_failed_first_not_the_lowest() -> None:
    """Messages as gloo words them when a peer goes away: the lowest rank's "Connection closed by
    peer" was named before, not the rank that raised or was killed."""
    from megascope.trainer.launch import failure_message

    closed = ("Connection closed by peer [127.0.0.1]:40598. This is typically caused by a remote worker "
              "crashing. Check the logs of the remote worker before reporting an error.")
    reset = "Read error [127.0.0.1]:20102: Connection reset by peer. This is typically caused by a remote worker hanging"
    crashed = {0: closed, 1: closed, 2: "planted crash on rank 2 in step 5", 3: closed}
    assert failure_message(crashed, 10.0, "rank 2 ended with exit code 1", first=2) == (
        "training failed on rank 2: planted crash on rank 2 in step 5")
    # Whoever exited first, a rank that raised its own error is named over those that lost it.
    assert failure_message(crashed, 10.0, "rank 0 ended with exit code 1", first=0).startswith("training failed on rank 2:")
    killed = {0: reset, 2: reset, 3: closed}
    line = failure_message(killed, 10.0, "rank 1 ended with signal SIGKILL", first=1)
    assert line == ("training failed: rank 1 ended with signal SIGKILL without a message (killed? out of memory?); "
                    "the others lost it (rank 0: Read error [127.0.0.1]:20102: Connection reset by peer)")
    # A hang: the ranks that timed out waiting, and not the one that lost its peer after them.
    hung = {0: "Timed out waiting 5000ms for recv operation to complete", 1: closed}
    assert failure_message(hung, 5.0, "rank 0 ended with exit code 1", first=0).startswith(
        "training failed: collective timed out after 5 s (--collective-timeout) on rank(s) 0;")
    assert failure_message({}, 5.0, "rank 3 ended with signal SIGABRT", first=3).startswith(
        "training failed: rank 3 ended with signal SIGABRT: NCCL aborted it")


@pytest.mark.skipif(importlib.util.find_spec("nvidia_resiliency_ext") is not None,
                    reason="nvidia-resiliency-ext is installed here")
def test_nvrx_straggler_without_its_package_fails_in_one_line_before_any_rank_starts(
        tmp_path: Path, cli: Callable[..., Result]) -> None:
    out = tmp_path / "run"
    result = cli("train", "--nproc", "1", "--nvrx-straggler", "-o", str(out))
    assert result.exit_code == 1
    assert "--nvrx-straggler needs the nvidia-resiliency-ext package" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.dist
def test_profile_writes_each_rank_s_trace_of_the_last_steps_for_other_tools(tmp_path: Path,
                                                                            cli: Callable[..., Result]) -> None:
    out = tmp_path / "run"
    result = cli("train", "--nproc", "2", "--dp", "2", "--steps", "4", "--profile", "2", "--device", "cpu",
                 "--no-compact", "-o", str(out))
    assert result.exit_code == 0, result.output
    traces = sorted((out / "profiler").iterdir())
    assert [t.name for t in traces] == ["rank00000.pt.trace.json.gz", "rank00001.pt.trace.json.gz"]
    for rank, trace in enumerate(traces):
        with gzip.open(trace, "rt") as f:
            doc = json.load(f)
        # What Holistic Trace Analysis and megascope's importer read a rank from.
        assert (doc["distributedInfo"]["rank"], doc["distributedInfo"]["world_size"]) == (rank, 2)
        steps = {e["name"] for e in doc["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")}
        assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
    # The job's own spans are all there: profiling changed nothing the collector writes.
    run = open_run(out)
    assert run.con.execute("SELECT count(DISTINCT step), count(DISTINCT rank) FROM spans WHERE kind = 'step'"
                           ).fetchone() == (4, 2)
    ingest_kineto(out / "profiler", tmp_path / "kineto", mesh={"dp": 2})
    steps = open_run(tmp_path / "kineto").con.execute(
        "SELECT rank, list(DISTINCT step ORDER BY step) FROM spans WHERE kind = 'step' GROUP BY 1 ORDER BY 1").fetchall()
    assert steps == [(0, [2, 3]), (1, [2, 3])]


class _NvrxReport:
    """The two things nvrx_summary reads of NVIDIA's report: its scores and identify_stragglers."""

    gpu_relative_perf_scores = {0: 1.0, 1: 0.62, 2: float("nan")}
    gpu_individual_perf_scores = {0: 0.99, 1: 0.97, 2: 1.0}
    section_relative_perf_scores = {"step": {0: 1.0, 1: 0.99, 2: 0.7}}
    section_individual_perf_scores = {"step": {0: 1.0, 1: 1.0, 2: 1.0}}

    def identify_stragglers(self, **bars: float) -> dict[str, object]:
        from collections import namedtuple

        straggler = namedtuple("straggler", "rank node")

        def below(scores: dict[int, float], bar: float) -> set[tuple[int, str]]:
            return {straggler(r, "n") for r, v in scores.items() if v < bar}

        return {"straggler_gpus_relative": below(self.gpu_relative_perf_scores, bars["gpu_rel_threshold"]),
                "straggler_gpus_individual": below(self.gpu_individual_perf_scores, bars["gpu_indiv_threshold"]),
                "straggler_sections_relative": {s: below(v, bars["section_rel_threshold"])
                                                for s, v in self.section_relative_perf_scores.items()},
                "straggler_sections_individual": {}}


def test_nvrx_summary_keeps_every_score_and_the_ranks_named_at_its_default_bars() -> None:
    from megascope.trainer.peers import NVRX_THRESHOLD, nvrx_summary

    summary = nvrx_summary(_NvrxReport())
    assert summary["threshold"] == NVRX_THRESHOLD == 0.75
    assert summary["gpu_relative"]["1"] == 0.62 and summary["gpu_relative"]["2"] != summary["gpu_relative"]["2"]
    assert summary["named"]["gpu_relative"] == [1]
    assert summary["named"]["section_relative"] == {"step": [2]}
    assert json.loads(json.dumps(summary))["section_relative"]["step"]["2"] == 0.7


def test_the_cpu_peak_is_the_best_product_over_a_window_longer_than_a_scheduler_slice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A machine busy for the first 50 ms (every product 100x slow) and free after: the peak is the
    # free core's, because the products go on for min_s of wall time, not 40 products alone.
    from megascope.trainer import flops

    clock = {"t": 0.0}

    def perf_counter() -> float:
        return clock["t"]

    class Slow:
        def __matmul__(self, other: object) -> None:
            clock["t"] += 0.02 if clock["t"] < 0.05 else 0.0002

    monkeypatch.setattr(flops.time, "perf_counter", perf_counter)
    monkeypatch.setattr(flops.torch, "randn", lambda *shape: Slow())
    peak = flops.measure_cpu_flops(n=256, repeats=3, min_s=0.3)
    assert peak == pytest.approx(2 * 256**3 / 0.0002, rel=1e-6)
    clock["t"] = 0.0
    assert flops.measure_cpu_flops(n=256, repeats=3, min_s=0.0) == pytest.approx(2 * 256**3 / 0.02, rel=1e-6)
