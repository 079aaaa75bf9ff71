"""Hang evidence that does not need the training interpreter: marker agent, stack dumps, NCCL's recorder.

Role in the data flow: three witnesses the :class:`~megascope.collectors.Collector` sets up next to
its writer thread, each of which keeps working when every Python thread of the rank is stopped.

* :class:`AgentLink` starts the rank's marker agent (:mod:`megascope.collectors.agent`) on a
  shared-memory ring and talks to it through a pipe: ``flush`` asks for a write and waits for the
  answer, ``close`` ends it and, if it is not there to answer, writes what the ring still holds
  from this process (so markers are never lost because the agent could not run).
* :class:`StackWatch` arms ``faulthandler.dump_traceback_later`` at every step: a step that has
  not ended ``after_s`` seconds later gets the stacks of every thread written to
  ``RUN/stacks/rank=N.txt`` by faulthandler's own C thread (which needs no interpreter lock), under
  a one-line header naming the rank, step and training thread.
* :func:`enable_nccl_flight_recorder` sets torch's ``TORCH_NCCL_*`` variables so that a collective
  timeout dumps each rank's flight recorder into ``RUN/flight_recorder/``.

Example::

    link = AgentLink.start(run_dir, rank=3, host="node1", interval_s=1.0)
    link.ring.put(marker_row); link.flush(timeout_s=2.0); link.close(timeout_s=10.0)
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from megascope.collectors.ring import CONSUMED_AT, FLUSHES_AT, LOST_AT, MarkerRing, RingReader

log = logging.getLogger(__name__)

STACKS_DIR = "stacks"
FLIGHT_RECORDER_DIR = "flight_recorder"
FLIGHT_RECORDER_PREFIX = "rank_"
STACKS_HEADER = "# megascope stacks"


class AgentLink:
    """The collector's end of its marker agent."""

    def __init__(self, ring: MarkerRing, proc: subprocess.Popen[bytes], run_dir: Path, rank: int,
                 run_id: str | None = None) -> None:
        self.ring = ring
        self.proc = proc
        self.run_dir = run_dir
        self.rank = rank
        self.run_id = run_id  # stamped into the markers parts (the agent's and any written from here)
        self._flushes = 0
        self._lock = threading.Lock()
        self.fallback_rows = 0  # rows this process had to write itself at close
        self.lost_rows = 0  # markers that never reached the disk (ring wrap-around, unwritable run)
        self._closed = False

    @classmethod
    def start(cls, run_dir: Path, *, rank: int, host: str, interval_s: float, run_id: str | None = None) -> AgentLink:
        """Start the agent. ``run_id``: the run id its parts carry; None while this rank does not know it
        yet (:meth:`set_run_id` tells the agent later)."""
        ring = MarkerRing.create()
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            # stdout/stderr inherited: the agent prints only its own warnings.
            proc = subprocess.Popen(
                [sys.executable, "-m", "megascope.collectors.agent", str(ring.path), str(run_dir), str(rank),
                 host, str(os.getpid()), repr(float(interval_s)), run_id or ""],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True,
            )
        except BaseException:
            ring.close()
            raise
        return cls(ring, proc, run_dir, rank, run_id)

    def set_run_id(self, run_id: str) -> None:
        """Tell the agent the run id (learned after it started): its later parts carry it."""
        with self._lock:
            self.run_id = run_id
            if self._closed or self.proc.stdin is None or not self.alive:
                return
            try:
                self.proc.stdin.write(b"r" + run_id.encode() + b"\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                pass

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def flush(self, timeout_s: float) -> bool:
        """Ask the agent to write what the ring holds now; True once it has (within ``timeout_s``)."""
        with self._lock:
            if self._closed or self.proc.stdin is None or not self.alive:
                return False
            self._flushes += 1
            want = self._flushes
            try:
                self.proc.stdin.write(b"f")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError, ValueError):
                return False
        deadline = time.monotonic() + timeout_s
        while self.ring.counter(FLUSHES_AT) < want:
            if time.monotonic() >= deadline or not self.alive:
                return False
            time.sleep(0.002)
        return True

    def close(self, timeout_s: float) -> None:
        """End the agent after its last pass; write from here whatever it did not. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("megascope collector (rank %d): the marker agent did not finish in %.0f s; "
                        "writing the markers from this process", self.rank, timeout_s)
            self.proc.kill()
            self.proc.wait()
        if self.ring.counter(CONSUMED_AT) < self.ring.written:
            try:
                self.fallback_rows = write_ring(self.ring, self.run_dir, self.rank, run_id=self.run_id)
            except OSError as exc:
                log.warning("megascope collector (rank %d): cannot write the last markers under %s (%s)",
                            self.rank, self.run_dir, exc)
        self.lost_rows = self.ring.counter(LOST_AT) + max(0, min(self.ring.written - self.ring.counter(CONSUMED_AT),
                                                                 self.ring.capacity))
        self.ring.close()


def write_ring(ring: MarkerRing, run_dir: Path, rank: int, *, run_id: str | None = None) -> int:
    """Write the ring's unconsumed markers as one part from this process; rows written."""
    from megascope import layout

    reader = RingReader(fd=ring.fileno(), rank=rank)  # the agent may have unlinked the name
    try:
        data = reader.read_table()
        if data.num_rows:
            layout.write_part(run_dir, "markers", data, rank=rank, run_id=run_id)
            reader.commit()
        return data.num_rows
    finally:
        reader.close()


class StackWatch:
    """faulthandler's watchdog, re-armed at every step, writing into ``RUN/stacks/rank=N.txt``."""

    def __init__(self, run_dir: Path, rank: int, after_s: float) -> None:
        self.after_s = after_s
        self.rank = rank
        path = run_dir / STACKS_DIR / f"rank={rank:05d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "w+b", buffering=0)  # noqa: SIM115  (kept open for faulthandler)
        self._main = threading.main_thread().ident or 0
        self._dirty = False

    def arm(self, step: int, thread_ident: int | None = None) -> None:
        """A new step: forget an earlier stall's stacks, dump again if this step stalls."""
        f = self._file
        if self._dirty:
            f.seek(0)
            f.truncate()
        header = (f"{STACKS_HEADER} rank={self.rank} pid={os.getpid()} step={step} "
                  f"thread=0x{(thread_ident or self._main):016x} armed_ns={time.time_ns()} "
                  f"after_s={self.after_s:g}\n")
        f.write(header.encode())
        self._dirty = True
        faulthandler.dump_traceback_later(self.after_s, repeat=False, file=f, exit=False)

    def disarm(self) -> None:
        """The step ended in time."""
        faulthandler.cancel_dump_traceback_later()

    def close(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        try:
            empty = self._file.tell() == 0 or b"(most recent call first)" not in self._read()
            self._file.close()
            if empty:
                self.path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    self.path.parent.rmdir()
        except OSError:
            pass

    def _read(self) -> bytes:
        self._file.seek(0)
        return self._file.read()


def enable_nccl_flight_recorder(run_dir: Path, environ: Any = None) -> bool:
    """Set torch's flight-recorder variables (where unset) to dump into ``RUN/flight_recorder/``.

    True if the dump location is this run's. They must be set before the NCCL process groups are
    created. A location or buffer size the job already set (under torch's current names or the
    ``TORCH_NCCL_*`` ones from before torch 2.9) is the job's choice and wins.
    """
    env = os.environ if environ is None else environ
    prefix = str(run_dir.resolve() / FLIGHT_RECORDER_DIR / FLIGHT_RECORDER_PREFIX)
    if "TORCH_FR_DUMP_TEMP_FILE" not in env and "TORCH_NCCL_DEBUG_INFO_TEMP_FILE" not in env:
        try:
            Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        except OSError:
            return False
        env["TORCH_FR_DUMP_TEMP_FILE"] = prefix
    if "TORCH_FR_BUFFER_SIZE" not in env and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env:
        env["TORCH_FR_BUFFER_SIZE"] = "2000"
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    return env.get("TORCH_FR_DUMP_TEMP_FILE", env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")) == prefix


AGENT_MODULE = "megascope.collectors.agent"
_PR_SET_CHILD_SUBREAPER = 36


def adopt_orphaned_agents() -> bool:
    """Make this process the parent of marker agents whose rank dies first (Linux), so that
    :func:`wait_for_agents` can wait for their last pass. A launcher calls it before starting ranks."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _agent_children() -> list[int]:
    me = os.getpid()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
            if ppid != me:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if AGENT_MODULE.encode() in f.read():
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found


def wait_for_agents(timeout_s: float) -> int:
    """Wait (at most ``timeout_s``) for this process's adopted marker agents to finish their last
    pass; the number still running at the end."""
    deadline = time.monotonic() + timeout_s
    pending = set(_agent_children())
    while pending:
        for pid in list(pending):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                pending.discard(pid)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    return len(pending)
