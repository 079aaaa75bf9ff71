"""Per-rank step logs: the per-(rank, step) sums of a live job appended to one small binary file per
rank, so that a viewer follows a job of any size with one read per rank.

Role in the data flow: beside the ``step_sums`` twins, for live readers only
(:class:`megascope.live.StepSumsTail`). A twin is a Parquet file (~0.5 ms of CPU to open and read);
a job of 12,288 ranks flushing every second writes 12,288 of them a second, more than two cores
read. The collector's writer also appends each spans part's sums, combined per (rank, step), to
its rank's log (``step_log/<run id>/rank=00003.steps``); a reader keeps an offset per log and reads
what was appended since, ~10 µs a rank. The logs are not part of the run's tables: the store and
the analyses never read them, compaction leaves them alone, and a run without them (an older
writer, a run written by an importer) is followed through its twins.

Format: a 16-byte header (``MAGIC``, then the number of fields and the record's size as two
little-endian uint32), then records of ``FIELDS`` as little-endian int64, ``NULL`` for a sum over
no span of its kind. Records are appended whole with ``O_APPEND`` by the one writer of the rank;
a reader uses only whole records (a write in progress shows as a partial record, read next time).
A write that fails or comes out short stops the log (the twins still hold everything). Rows of one
(rank, step) in several records (a step across a flush) combine as the twins' do (SUM, MIN, MAX).

Example::

    log = StepLog("runs/job-1234", rank=3)
    log.append(step_sums(spans_part), run_id="job-1234")
    records = parse(open(path, "rb").read()[HEADER_SIZE:])   # int64 array, one row per record
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa

from megascope.layout import rank_dir_name

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

STEP_LOG_DIR = "step_log"
MAGIC = b"MSSTEPS1"
# Per field, how two records of one (rank, step) combine.
COMBINE = {
    "rank": "key", "step": "key",
    "step_ns": "max", "step_start_ns": "min", "first_start_ns": "min", "last_end_ns": "max",
    "forward_ns": "sum", "backward_ns": "sum", "optimizer_ns": "sum", "compute_ns": "sum", "data_ns": "sum",
    "host_ns": "sum", "coll_ns": "sum", "recv_ns": "sum", "send_ns": "sum", "spans": "sum",
}
FIELDS = tuple(COMBINE)
RECORD_SIZE = 8 * len(FIELDS)
HEADER = MAGIC + struct.pack("<II", len(FIELDS), RECORD_SIZE)
HEADER_SIZE = len(HEADER)
NULL = -(2**63)
_SAFE_ID = re.compile(r"[A-Za-z0-9._-]{1,100}")


def log_dir(run_dir: Path | str, run_id: str) -> Path:
    """The folder of one run's step logs: the run id itself where it is a plain file name, else a
    digest of it (ids come from the launcher's environment)."""
    name = run_id if _SAFE_ID.fullmatch(run_id) and run_id not in (".", "..") else \
        "id-" + hashlib.sha256(run_id.encode()).hexdigest()[:24]
    return Path(run_dir) / STEP_LOG_DIR / name


def log_name(rank: int) -> str:
    return f"{rank_dir_name(rank)}.steps"


def records(sums: pa.Table) -> bytes:
    """The per-(rank, step) records of a batch of step sums (``schema.STEP_SUMS``, one row per
    rank, step and group), combined over their groups."""
    if sums.num_rows == 0:
        return b""
    aggs = [(f, how) for f, how in COMBINE.items() if how != "key"]
    grouped = sums.group_by(["rank", "step"], use_threads=False).aggregate(aggs)
    # A sum over no span of its kind is NULL in the twin (SUM over nothing); the aggregation over
    # groups gives NULL only where every group's is. A handful of rows a flush: plain Python (the
    # collector's core install has no numpy).
    columns = [grouped.column(f if how == "key" else f"{f}_{how}").cast(pa.int64()).fill_null(NULL).to_pylist()
               for f, how in COMBINE.items()]
    return struct.pack(f"<{grouped.num_rows * len(FIELDS)}q", *(v for row in zip(*columns, strict=True) for v in row))


def parse(data: bytes) -> np.ndarray:
    """Whole records of ``data`` (bytes after the header) as an int64 array of shape (n, fields)."""
    import numpy as np  # the readers' side (the analysis extra); the writers need none

    whole = len(data) - len(data) % RECORD_SIZE
    return np.frombuffer(data, dtype="<i8", count=whole // 8).reshape(-1, len(FIELDS))


def check_header(head: bytes) -> str | None:
    """None for a log this version reads, else why not."""
    if len(head) < HEADER_SIZE:
        return "no header yet"
    if head[:len(MAGIC)] != MAGIC:
        return "not a megascope step log"
    if head != HEADER:
        return "a step log of another layout (another megascope version)"
    return None


class StepLog:
    """One writer's step log: opened at its first append for a run id, appended to after each
    spans part; a new run id (a job that learnt its id late) starts that id's log."""

    def __init__(self, run_dir: Path | str, *, rank: int) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self._fd: int | None = None
        self._run_id: str | None = None
        self.stopped: str | None = None  # why the log stopped, once it has

    def append(self, sums: pa.Table, *, run_id: str | None) -> None:
        """Append the records of ``sums``; nothing before the run id is known, nothing once stopped."""
        if run_id is None or self.stopped is not None:
            return
        data = records(sums)
        if not data:
            return
        try:
            if run_id != self._run_id:
                self._open(run_id)
            assert self._fd is not None
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(f"wrote {written} of {len(data)} bytes")
        except OSError as exc:
            self._stop(f"step log stopped: {exc}")

    def _open(self, run_id: str) -> None:
        self.close()
        where = log_dir(self.run_dir, run_id)
        where.mkdir(parents=True, exist_ok=True)
        fd = os.open(where / log_name(self.rank), os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                os.write(fd, HEADER)
            elif os.pread(fd, HEADER_SIZE, 0) != HEADER:
                raise OSError("the file there is not a step log of this layout")
            elif (size - HEADER_SIZE) % RECORD_SIZE:  # an earlier writer of this rank died mid-record
                os.ftruncate(fd, size - (size - HEADER_SIZE) % RECORD_SIZE)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._run_id = fd, run_id

    def _stop(self, why: str) -> None:
        self.stopped = why
        log.warning("megascope (rank %d): %s; live views fall back to the step sums files", self.rank, why)
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
