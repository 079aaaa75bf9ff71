"""Start the bundled trainer: N local ranks (``--nproc N``) or this process under torchrun.

Role in the data flow: ``megascope train`` calls :func:`train`; it validates nothing itself (the
:class:`TrainConfig` already did, before any process starts), runs the ranks and turns a failed job
into one :class:`TrainingError` line: a collective timeout (what a hung rank causes on its peers)
is named as such, with the ``--collective-timeout`` that fired.

Local ranks are forked on CPU (~0.2 s for 8 ranks; spawn costs ~10 s) and spawned on CUDA (a
forked CUDA context is unusable); they rendezvous through a ``file://`` store in a temporary
directory, so no port is fixed. The launcher names the run (``MEGASCOPE_RUN_ID`` in every rank it
starts: ``run.json``'s ``run_id``, stamped into every part). Under torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` and
``MASTER_ADDR``/``MASTER_PORT`` set) the process trains its own rank with ``env://``.

Example::

    result = train(TrainConfig(out=Path("runs/a"), world_size=8, tp=2, pp=2, steps=5), nproc=8)
    result.losses        # global loss per step
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing.connection as mp_connection
import multiprocessing.process as mp_process
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from megascope.collectors.runid import RUN_ID_VAR, new_run_id
from megascope.trainer.config import TrainConfig, TrainingError
from megascope.trainer.loop import env_rank, pick_device, train_rank

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainResult:
    out: Path
    losses: list[float]  # global loss per step
    step_seconds: list[float]  # rank 0's host time per step (see loop.py on CUDA)
    collector_on: list[bool] | None = None  # --collector-ab: whether the collector recorded each step
    ab_flush_seconds: list[float] | None = None  # --collector-ab: host seconds of each boundary flush
    step_wait_seconds: list[float] | None = None  # CUDA: rank 0's wait for the device per step (loop.py)


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*")  # gloo's "[.../pair.cc:553] "


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return _SOURCE_PREFIX.sub("", text)[:400]


def _is_timeout(message: str) -> bool:
    lowered = message.lower()
    return "timed out" in lowered or "timeout" in lowered


def _rank_entry(local_rank: int, cfg: TrainConfig, init_file: str, scratch: str, run_id: str) -> None:
    # A forked rank must never finalize objects it inherited: a parent's DuckDB connection or
    # thread pool torn down in the child without its threads crashes it (seen as SIGSEGV).
    gc.freeze()
    # The run's id, the same in every rank: run.json's, stamped into every part (this process only).
    os.environ[RUN_ID_VAR] = run_id
    # One host: the local rank is the rank. Set as torchrun sets it, so that the collector's
    # heartbeat reports the host's CPU, memory and network once (from local rank 0), not per rank.
    os.environ["LOCAL_RANK"] = str(local_rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(cfg.world_size)
    torch.set_num_threads(1)
    logging.getLogger("megascope").setLevel(logging.WARNING)
    progress = Path(scratch, f"progress-{local_rank:05d}")
    progress.touch()
    try:
        result = train_rank(cfg, rank=local_rank, world_size=cfg.world_size, local_rank=local_rank,
                            init_method=f"file://{init_file}", progress=progress)
    except BaseException as exc:
        Path(scratch, f"fail-{local_rank:05d}.txt").write_text(_one_line(exc))
        log.debug("rank %d failed", local_rank, exc_info=True)
        sys.exit(1)
    if local_rank == 0:
        Path(scratch, "result.json").write_text(json.dumps(asdict(result)))


_POLL_S = 2.0


def stall_limit_s(collective_timeout_s: float) -> float:
    """How long a job may go without any rank ending a step before the launcher stops it: well past
    the collective timeout, which the backend should have enforced first."""
    return max(4 * collective_timeout_s, 120.0)


class _Stall:
    """Watches the ranks' progress files (their time is set as a rank ends a step). ``check`` gives
    the seconds since any rank last ended a step once that is past the stall limit, or four times
    the longest such gap seen so far (a job whose steps are slow is not a hung one); else None."""

    def __init__(self, scratch: str, collective_timeout_s: float) -> None:
        self.scratch = Path(scratch)
        self.limit_s = stall_limit_s(collective_timeout_s)
        self.last: float | None = None
        self.longest_gap_s = 0.0

    def check(self) -> float | None:
        times = []
        for p in self.scratch.glob("progress-*"):
            try:
                times.append(p.stat().st_mtime)
            except OSError:
                continue
        if not times:
            return None
        newest = max(times)
        if self.last is not None and newest > self.last:
            self.longest_gap_s = max(self.longest_gap_s, newest - self.last)
        self.last = newest
        idle = time.time() - newest
        return idle if idle > max(self.limit_s, 4 * self.longest_gap_s) else None


# SIGTERM's grace: a rank's collector flushes what it holds on SIGTERM (a few seconds at most),
# then exits. A rank that used under TERM_IDLE_CPU of a core over TERM_IDLE_S since the signal is
# not acting on it and is not waited for past that: its handler cannot run (a rank frozen holding
# the interpreter lock, or stuck in a driver call with its signals blocked). Such a CPU rank used
# 2-3% of a core there (its other threads waking to ask for the lock); a flushing one runs a core.
TERM_GRACE_S = 10.0
TERM_IDLE_S = 2.0
TERM_IDLE_CPU = 0.1
_TERM_POLL_S = 0.1


def _cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of process ``pid`` (Linux ``/proc``); None elsewhere or once it
    is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = int(fields[11]) + int(fields[12])  # utime and stime: the stat file's fields 14 and 15
        return ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _await_term(processes: list[Any], grace_s: float | None = None, idle_s: float | None = None) -> None:
    """Wait until every rank in ``processes`` has exited, for at most ``grace_s`` (TERM_GRACE_S), or
    until each one still alive has used under TERM_IDLE_CPU of a core over the last ``idle_s``
    (TERM_IDLE_S; where its CPU can be read)."""
    grace_s = TERM_GRACE_S if grace_s is None else grace_s
    idle_s = TERM_IDLE_S if idle_s is None else idle_s
    start = time.monotonic()
    first: dict[int, tuple[float, float]] = {}  # pid: (time, CPU seconds) of the window's start
    while True:
        now = time.monotonic()
        alive = [p for p in processes if p.is_alive()]
        if not alive or now - start >= grace_s:
            return
        idle = 0
        for p in alive:
            cpu = _cpu_seconds(p.pid)
            if cpu is None:
                continue
            since, cpu0 = first.setdefault(p.pid, (now, cpu))
            if now - since < idle_s:
                continue
            if cpu - cpu0 < TERM_IDLE_CPU * (now - since):
                idle += 1
            else:
                first[p.pid] = (now, cpu)  # it is working: a new window from here
        if idle == len(alive):
            return
        time.sleep(min(_TERM_POLL_S, max(0.0, grace_s - (now - start))))


def _stop(processes: list[Any]) -> list[Any]:
    """SIGTERM every live rank, then SIGKILL those still alive after a few seconds (see
    TERM_GRACE_S); returns those that outlived SIGKILL too, and no longer waits for them, nor lets
    the interpreter's exit do so.

    A rank whose GPU work is stuck (a hung NCCL kernel) can take minutes to die after SIGKILL
    while the driver tears its context down; the job has already failed, and a launcher that waits
    for it hangs too (an unbounded ``join``, or multiprocessing joining its live children at exit).
    Once the launcher exits, the system reaps such a process."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    _await_term(processes)
    for p in processes:
        if p.is_alive():
            p.kill()
    deadline = time.monotonic() + 5.0
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    stuck = [p for p in processes if p.is_alive()]
    for p in stuck:
        # multiprocessing joins every child it started, without a timeout, at exit.
        # (No public way to leave a child behind: the module's set of live children.)
        getattr(mp_process, "_children", set()).discard(p)
        log.warning("rank process %s still alive after SIGKILL (its GPU work may be stuck); not waiting for it", p.pid)
    return stuck


def _wait_ranks(processes: list[Any], stall: _Stall, *, timeout_s: float, out: Path) -> tuple[int, int] | None:
    """Wait until every rank has exited: None when all exited 0, else (the first failed rank's
    index, its exit code), the others stopped by :func:`_stop`. Every wait is bounded: torch's
    ``ProcessContext.join`` joins a killed rank without a timeout. Raises :class:`TrainingError`
    for a job that stalled past its limit (:class:`_Stall`), its ranks stopped."""
    pending = {p.sentinel: i for i, p in enumerate(processes)}
    while pending:
        for sentinel in mp_connection.wait(list(pending), timeout=_POLL_S):
            index = pending.pop(sentinel)
            process = processes[index]
            process.join(5.0)  # its sentinel is ready: it has exited, this only reaps it
            if process.exitcode != 0:
                # The others time out or lose their peer within moments; a hung one never exits.
                deadline = time.monotonic() + 2.0
                for p in processes:
                    p.join(max(0.0, deadline - time.monotonic()))
                _stop(processes)
                return index, process.exitcode if process.exitcode is not None else -signal.SIGKILL
        if pending and (stalled := stall.check()) is not None:
            stuck = _stop(processes)
            left = f" ({len(stuck)} still exiting after SIGKILL, not waited for)" if stuck else ""
            raise TrainingError(
                f"training failed: no rank ended a step for {stalled:.0f} s, past the collective timeout "
                f"of {timeout_s:g} s (--collective-timeout) that the backend did not enforce; the "
                f"job hung and its ranks were stopped{left} (megascope localize {out} names the rank)")
    return None


def _how(exitcode: int) -> str:
    """``signal SIGABRT`` for a rank killed by a signal, else ``exit code N``."""
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


# What a rank says when its peer went away (gloo's closed socket, NCCL's remote error): it failed
# after another rank, not on its own.
_PEER_LOST = ("closed by peer", "reset by peer", "broken pipe", "remote worker", "remote process exited",
              "connection refused")


def _peer_lost(message: str) -> bool:
    lowered = message.lower()
    return any(p in lowered for p in _PEER_LOST)


def _first_sentence(message: str) -> str:
    """``Connection closed by peer [127.0.0.1]:40598`` of gloo's message, without the advice after it."""
    return re.split(r"\.\s", message, maxsplit=1)[0]


def failure_message(failures: dict[int, str], timeout_s: float, exited: str | None = None,
                    first: int | None = None) -> str:
    """One line for a failed job, naming the rank that failed first on its own where it can be told.

    ``failures``: rank -> its exception's one line; ``first``: the rank whose process ended first
    (``exited`` says how). In this order: that rank's own message; another rank's message that is
    neither a timeout nor a lost peer (a rank that raised); the collective timeout, where a rank hit
    it; the first rank's exit where it said nothing (killed) while the others lost it; else the
    lowest rank's message.
    """
    own = {r: m for r, m in failures.items() if not _is_timeout(m) and not _peer_lost(m)}
    if first is not None and first in own:
        return f"training failed on rank {first}: {own[first]}"
    if own:
        rank = min(own)
        return f"training failed on rank {rank}: {own[rank]}"
    timed_out = sorted(r for r, msg in failures.items() if _is_timeout(msg))
    if timed_out:
        shown = ", ".join(map(str, timed_out[:8])) + (" ..." if len(timed_out) > 8 else "")
        return (f"training failed: collective timed out after {timeout_s:g} s (--collective-timeout) on "
                f"rank(s) {shown}; a rank stopped answering (hung or dead): {failures[timed_out[0]]}")
    if exited and "SIGABRT" in exited:
        # NCCL's watchdog aborts the process when a collective outlives its timeout.
        return (f"training failed: {exited}: NCCL aborted it, most likely a collective timed out after "
                f"{timeout_s:g} s (--collective-timeout) because a rank stopped answering (hung or dead)")
    if first is not None and first not in failures and failures:
        rank = min(failures)
        return (f"training failed: {exited or f'rank {first} exited'} without a message (killed? out of memory?); "
                f"the others lost it (rank {rank}: {_first_sentence(failures[rank])})")
    if failures:
        rank = min(failures)
        return f"training failed on rank {rank}: {failures[rank]}"
    return f"training failed: {exited or 'a rank exited'} without a message (killed? out of memory?)"


def train(cfg: TrainConfig, *, nproc: int | None = None) -> TrainResult:
    """Run ``cfg``: ``nproc`` local ranks, or this process's rank under torchrun."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    env = env_rank()
    if nproc is None and env is not None:
        rank, world, local_rank = env
        try:
            result = train_rank(cfg, rank=rank, world_size=world, local_rank=local_rank, init_method="env://")
        except Exception as exc:
            msg = _one_line(exc)
            raise TrainingError(failure_message({rank: msg}, cfg.collective_timeout_s)) from None
        return TrainResult(cfg.out, result.losses, result.step_seconds, result.collector_on,
                           result.ab_flush_seconds, result.step_wait_seconds)
    nproc = nproc or 1
    if cfg.peak_flops is None and pick_device(cfg, 0).type == "cpu":
        # Measured once here rather than in 8 ranks fighting over the same cores.
        from dataclasses import replace

        from megascope.trainer.flops import measure_cpu_flops

        cfg = replace(cfg, peak_flops=measure_cpu_flops())
    start_method = "spawn" if pick_device(cfg, 0).type == "cuda" else "fork"
    if start_method == "spawn":
        # Growable segments keep the allocator from fragmenting between the pipeline's micro-batches
        # (torchtitan sets the same); spawned ranks inherit it. A user's own setting wins.
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    gc.collect()  # finalize the parent's garbage here, not in each forked rank
    # A rank that is killed leaves its marker agent to make a last pass: it becomes our child, and
    # the run is returned only once that pass is written.
    from megascope.collectors.evidence import adopt_orphaned_agents, wait_for_agents

    adopt_orphaned_agents()
    try:
        return _run_local(cfg, nproc, start_method)
    finally:
        wait_for_agents(timeout_s=max(10.0, 3 * cfg.flush_interval_s))


def _run_local(cfg: TrainConfig, nproc: int, start_method: str) -> TrainResult:
    with tempfile.TemporaryDirectory(prefix="megascope-train-") as scratch:
        init_file = os.path.join(scratch, "rendezvous")
        run_id = new_run_id(cfg.out)
        ctx = mp.start_processes(_rank_entry, args=(cfg, init_file, scratch, run_id), nprocs=nproc, join=False,
                                 start_method=start_method)
        # After the first failure, the others time out or lose their peer within moments; a hung
        # rank never exits by itself and is stopped. A job in which no rank ends a step long past
        # the collective timeout hangs where its backend did not end it (NCCL's abort can itself
        # block): its ranks are stopped (_Stall).
        failed = _wait_ranks(ctx.processes, _Stall(scratch, cfg.collective_timeout_s),
                             timeout_s=cfg.collective_timeout_s, out=cfg.out)
        if failed is not None:
            index, code = failed
            failures = {int(p.stem.split("-")[1]): p.read_text() for p in Path(scratch).glob("fail-*.txt")}
            raise TrainingError(failure_message(failures, cfg.collective_timeout_s, f"rank {index} ended with {_how(code)}",
                                               first=index))
        data = json.loads(Path(scratch, "result.json").read_text())
    return TrainResult(cfg.out, data["losses"], data["step_seconds"], data.get("collector_on"),
                       data.get("ab_flush_seconds"), data.get("step_wait_seconds"))
