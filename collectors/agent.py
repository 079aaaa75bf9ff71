"""The marker agent: a small process per rank that carries the hang trail to disk.

Role in the data flow: :class:`megascope.collectors.Collector` starts one (``python -m
megascope.collectors.agent``) and writes its markers into a shared-memory ring
(:mod:`megascope.collectors.ring`); every ``interval`` seconds this process reads the ring and
writes a ``markers`` part, plus a ``rank_alive`` heartbeat row that says the training process is
still there. It shares no interpreter lock, no CUDA context and no thread with the training
process, so the markers of every call a rank entered are on disk within one interval whatever
the rank is doing, and a final pass runs when the rank goes away: its stdin is a pipe from the
rank, which reads end-of-file as soon as the rank exits, aborts or is killed (or, where a
process the rank forked still holds that pipe, the agent sees its parent change within one
interval). The last ``rank_alive`` row (value 0) then records when that happened.

Every part carries the run id (``RUN_ID``, ``run.json``'s; :mod:`megascope.collectors.runid`). A
rank that learns it only after starting its agent (a rank other than 0 reading rank 0's
``run.json``) passes an empty ``RUN_ID`` and sends the id later; until then the parts carry none.

Protocol on stdin: a byte ``f`` asks for a flush, answered by advancing the ring's ``flushes``
counter once the part is written; ``r<run id>\n`` gives the run id; end-of-file means the rank is
gone or closed its collector.

Example (what the collector runs)::

    python -m megascope.collectors.agent RING RUN_DIR RANK HOST PID INTERVAL_S [RUN_ID]
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import time
from pathlib import Path

import pyarrow as pa
from megascope.collectors.ring import RingReader

from megascope import layout, schema

log = logging.getLogger("megascope.collectors.agent")

ALIVE_METRIC = "rank_alive"  # heartbeats metric: 1 while the rank's process lives, 0 once it is gone


class _Stop(Exception):
    """SIGTERM: make the last pass now."""


# A SIGTERM sets _STOPPING, and cuts short only the wait for the rank's messages (_WAITING): one
# raised while a pass wrote its part went past the loop, and the agent ended without its last pass
# (no final markers, no rank_alive 0): a launcher's SIGTERM landing in a pass's few milliseconds.
_STOPPING = False
_WAITING = False


def _stop(signum: int, frame: object) -> None:
    global _STOPPING
    first = not _STOPPING
    _STOPPING = True
    if _WAITING and first:  # a second SIGTERM never raises: it may land in the handler of the first
        raise _Stop


class Control:
    """Parses the rank's messages on stdin (module docstring), which may arrive split anywhere."""

    def __init__(self) -> None:
        self._partial = b""  # an ``r`` message whose end has not arrived yet
        self.flushes = 0  # flush requests seen
        self.run_id: str | None = None  # the last run id given

    def feed(self, data: bytes) -> None:
        data = self._partial + data
        self._partial = b""
        i = 0
        while i < len(data):
            byte = data[i:i + 1]
            if byte == b"r":
                end = data.find(b"\n", i)
                if end < 0:
                    self._partial = data[i:]
                    return
                value = data[i + 1:end].decode(errors="replace").strip()
                self.run_id = value or self.run_id
                i = end + 1
                continue
            if byte == b"f":
                self.flushes += 1
            i += 1


class Agent:
    def __init__(self, reader: RingReader, run_dir: Path, *, rank: int, host: str, pid: int,
                 run_id: str | None = None) -> None:
        self.reader = reader
        self.run_dir = run_dir
        self.rank = rank
        self.host = host
        self.pid = pid
        self.run_id = run_id or None
        self.write_errors = 0
        self._lost_reported = 0

    def drain(self) -> int:
        """Write what the ring holds as one markers part; the number of rows written."""
        data = self.reader.read_table()
        if not data.num_rows:
            return 0
        try:
            layout.write_part(self.run_dir, "markers", data, rank=self.rank, run_id=self.run_id)
        except OSError as exc:
            self.write_errors += 1
            if self.write_errors == 1:
                log.warning("megascope marker agent (rank %d): cannot write markers under %s (%s); retrying",
                            self.rank, self.run_dir, exc)
            return 0
        self.reader.commit()
        return data.num_rows

    def alive(self, value: float, text: str | None = None) -> None:
        lost = self.reader.lost
        row = {"host": [self.host], "rank": [self.rank], "pid": [self.pid], "time_ns": [time.time_ns()],
               "device": [None], "metric": [ALIVE_METRIC], "value": [value],
               "text": [text if text is not None else (f"{lost} markers lost to a full ring" if lost else None)]}
        try:
            layout.write_part(self.run_dir, "heartbeats", pa.table(row).cast(schema.HEARTBEATS), host=self.host,
                              run_id=self.run_id)
        except OSError:
            self.write_errors += 1

    def run(self, control: int, interval_s: float, parent: int | None = None) -> None:
        """Pass after pass until the rank is gone: end-of-file on ``control``, a SIGTERM, or, where
        ``parent`` (the rank that started this process) is given, this process having another
        parent. End-of-file needs every copy of the pipe's write end closed, and a process the
        rank forked (a data loader's worker) holds one until it ends too."""
        global _WAITING
        messages = Control()
        gone = False
        next_alive = 0.0
        while not gone:
            asked = messages.flushes
            try:
                _WAITING = True
                if _STOPPING:
                    raise _Stop
                ready, _, _ = select.select([control], [], [], interval_s)
                _WAITING = False
                if ready:
                    data = os.read(control, 4096)
                    gone = not data
                    messages.feed(data)
            except _Stop:
                gone = True
            finally:
                _WAITING = False
            gone = gone or _STOPPING or (parent is not None and os.getppid() != parent)
            self.run_id = messages.run_id or self.run_id
            self.drain()
            if messages.flushes > asked:
                self.reader.ack_flush(messages.flushes)
            now = time.monotonic()
            if not gone and now >= next_alive:
                self.alive(1.0)
                next_alive = now + interval_s
        self.drain()
        self.alive(0.0, "the rank's process ended or closed its collector")


def main(argv: list[str]) -> int:
    ring, run_dir, rank, host, pid, interval, *rest = argv
    run_id = rest[0] if rest else None
    # The rank's Ctrl-C or job-wide signals must not cut the last pass short: the agent ends when
    # its rank does (end-of-file on stdin), and a SIGTERM only hurries that.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _stop)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    reader = RingReader(ring, rank=int(rank))
    os.unlink(ring)  # the rank and this process hold it mapped; nothing else needs its name
    # PID is the rank's, which started this process (AgentLink.start).
    Agent(reader, Path(run_dir), rank=int(rank), host=host, pid=int(pid), run_id=run_id).run(
        0, float(interval), parent=int(pid))
    reader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
