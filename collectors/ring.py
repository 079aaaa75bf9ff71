"""A fixed-size ring of marker records in shared memory: the hang trail, out of the training process.

Role in the data flow: the collector writes every ``enqueued`` / ``completed`` marker here, at
the moment it happens, from whichever thread it happens on; a separate process
(:mod:`megascope.collectors.agent`) reads the ring every flush interval and writes the rows as
``markers`` parts of the run directory. The evidence a hang needs then reaches the disk whatever
the training process is doing: blocked in NCCL or CUDA, frozen holding the interpreter lock, or
killed. A put is a few ``struct`` operations on a memory map (no system call, no allocation that
outlives it).

Why a separate process: on a rank whose peer hangs, the device spins in the collective and the
launch queue fills; a thread that then makes a CUDA driver call that needs the driver's lock
(destroying an event, say) blocks behind the stuck launch, and if it holds the interpreter lock
while it waits, every Python thread of the rank stops, the collector's writer included
(docs/collector.md, "Why hangs lost their trail on NCCL").

The file (``/dev/shm`` where it exists, else the temporary directory)::

    header   64 bytes   magic, capacity, record size, string-table size, then five counters:
                        written (records ever put), strings_used (bytes of the string table),
                        consumed (records written to disk by the reader), flushes (flush requests
                        answered by the reader), lost (records the reader lost to wrap-around)
    strings  STRINGS    group and op names, each a u16 length + UTF-8; id = position in the list
    records  CAP x 48   seq, time_ns, step, bytes, peer, group id, op id, state id, flags

Records ``[consumed, written)`` are on their way to disk; a reader more than ``capacity`` records
behind loses the oldest and counts them.

Example::

    ring = MarkerRing.create(capacity=1 << 16)
    ring.put((rank, "tp:0", 17, "all_reduce", "enqueued", time.time_ns(), 3, 4096, None))
    reader = RingReader(ring.path); rows = reader.read(); reader.commit()   # once rows are on disk
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import tempfile
import threading
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megascope.schema import MarkerState

if TYPE_CHECKING:
    import pyarrow as pa

MAGIC = b"MSRING01"
_HEADER = struct.Struct("<8sIIII")  # magic, capacity, record size, strings size, spare
_COUNTER = struct.Struct("<Q")
WRITTEN_AT, STRINGS_USED_AT, CONSUMED_AT, FLUSHES_AT, LOST_AT = 24, 32, 40, 48, 56
HEADER_BYTES = 64
STRINGS_BYTES = 64 * 1024
RECORD = struct.Struct("<qqqqiiHBBxxxx")  # 48 bytes
# The same record as numpy fields (RingReader.read_table).
_RECORD_FIELDS = [("seq", "<i8"), ("time_ns", "<i8"), ("step", "<i8"), ("bytes", "<i8"), ("peer", "<i4"),
                  ("gid", "<i4"), ("oid", "<u2"), ("sid", "u1"), ("flags", "u1"), ("pad", "V4")]
_LEN = struct.Struct("<H")
STATES = tuple(s.value for s in MarkerState)
_STATE_ID = {s: i for i, s in enumerate(STATES)}
_HAS_STEP, _HAS_BYTES, _HAS_PEER = 1, 2, 4
_pack_record = RECORD.pack_into
_pack_counter = _COUNTER.pack_into
_RECORD_SIZE = RECORD.size
DEFAULT_CAPACITY = 1 << 16  # 3 MiB: minutes of a busy rank's calls at one flush a second


def ring_dir() -> str:
    """Where ring files go: shared memory where the system has it (never written back to a disk)."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        return shm
    return tempfile.gettempdir()


class MarkerRing:
    """The writing side: ``put`` takes a markers row (schema order) from any thread."""

    def __init__(self, path: Path, fd: int, capacity: int) -> None:
        self.path = path
        self.capacity = capacity
        self._fd = fd
        self._map = mmap.mmap(fd, HEADER_BYTES + STRINGS_BYTES + capacity * RECORD.size)
        self._lock = threading.Lock()
        self._strings: dict[str, int] = {}
        self._ids: dict[tuple[str, str, str], tuple[int, int, int]] = {}
        self._strings_used = 0
        self._written = 0
        self.dropped = 0  # rows refused (the string table is full); the ring itself never refuses
        self._base = HEADER_BYTES + STRINGS_BYTES

    @classmethod
    def create(cls, capacity: int = DEFAULT_CAPACITY, directory: str | None = None) -> MarkerRing:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        path = Path(directory or ring_dir()) / f"megascope-{os.getpid()}-{uuid.uuid4().hex[:12]}.ring"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, HEADER_BYTES + STRINGS_BYTES + capacity * RECORD.size)
            ring = cls(path, fd, capacity)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        _HEADER.pack_into(ring._map, 0, MAGIC, capacity, RECORD.size, STRINGS_BYTES, 0)
        return ring

    def _string_id(self, text: str) -> int | None:
        sid = self._strings.get(text)
        if sid is not None:
            return sid
        data = text.encode("utf-8", "replace")[:1024]
        end = self._strings_used + _LEN.size + len(data)
        if end > STRINGS_BYTES:
            return None
        at = HEADER_BYTES + self._strings_used
        _LEN.pack_into(self._map, at, len(data))
        self._map[at + _LEN.size:at + _LEN.size + len(data)] = data
        self._strings_used = end
        _COUNTER.pack_into(self._map, STRINGS_USED_AT, end)  # after the bytes: a reader never sees half
        sid = len(self._strings)
        self._strings[text] = sid
        return sid

    def put(self, row: tuple[Any, ...]) -> bool:
        """One markers row ``(rank, group, seq, op, state, time_ns, step, bytes, peer)``.

        The training thread's hot path (about 0.8 us on a 2-core CPU VM): one lock, one lookup of
        the (group, op, state) ids, two ``pack_into`` calls.
        """
        _, group, seq, op, state, time_ns, step, nbytes, peer = row
        with self._lock:
            ids = self._ids.get((group, op, state))
            if ids is None:
                ids = self._new_ids(group, op, state)
                if ids is None:
                    self.dropped += 1
                    return False
            n = self._written
            try:
                _pack_record(self._map, self._base + (n % self.capacity) * _RECORD_SIZE, seq, time_ns,
                             step or 0, nbytes or 0, peer or 0, ids[0], ids[1], ids[2],
                             (step is not None) | ((nbytes is not None) << 1) | ((peer is not None) << 2))
            except ValueError:  # closed
                self.dropped += 1
                return False
            self._written = n + 1
            _pack_counter(self._map, WRITTEN_AT, n + 1)  # last: the record is whole before it counts
        return True

    def _new_ids(self, group: str, op: str, state: str) -> tuple[int, int, int] | None:
        if self._map.closed or state not in _STATE_ID:
            return None
        gid = self._string_id(group)
        oid = self._string_id(op)
        if gid is None or oid is None:
            return None
        ids = (gid, oid, _STATE_ID[state])
        if len(self._ids) < 65536:
            self._ids[(group, op, state)] = ids
        return ids

    @property
    def written(self) -> int:
        return self._written

    def fileno(self) -> int:
        return self._fd

    def __len__(self) -> int:
        """Rows put and not yet on disk."""
        if self._map.closed:
            return 0
        return min(self._written - self.counter(CONSUMED_AT), self.capacity)

    def counter(self, at: int) -> int:
        return int(_COUNTER.unpack_from(self._map, at)[0])

    def close(self, *, unlink: bool = True) -> None:
        with self._lock, contextlib.suppress(BufferError, ValueError):
            self._map.close()
        with contextlib.suppress(OSError):
            os.close(self._fd)
        if unlink:
            self.path.unlink(missing_ok=True)


class RingReader:
    """The reading side (the agent, or the collector itself when no agent could run).

    ``read`` returns the rows not yet consumed and how many were lost to wrap-around; after they
    are safely on disk, ``commit`` advances the shared ``consumed`` counter, so another reader
    taking over later starts where this one stopped.
    """

    def __init__(self, path: Path | str | None = None, *, fd: int | None = None, rank: int = 0) -> None:
        if fd is None:
            if path is None:
                raise ValueError("a path or an fd")
            fd = os.open(path, os.O_RDWR)
            own = True
        else:
            own = False
        try:
            size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size)
        finally:
            if own:
                os.close(fd)
        magic, capacity, record_size, strings_size, _ = _HEADER.unpack_from(self._map, 0)
        if magic != MAGIC or record_size != RECORD.size or strings_size != STRINGS_BYTES:
            raise ValueError(f"not a megascope marker ring (magic {magic!r})")
        self.capacity = capacity
        self.rank = rank
        self._base = HEADER_BYTES + STRINGS_BYTES
        self._strings: list[str] = []
        self._strings_read = 0
        self._pending_commit: int | None = None
        self.lost = self._counter(LOST_AT)  # a reader taking over counts on from the last one

    def _counter(self, at: int) -> int:
        return int(_COUNTER.unpack_from(self._map, at)[0])

    def _load_strings(self) -> None:
        used = self._counter(STRINGS_USED_AT)
        at = self._strings_read
        while at < used:
            (n,) = _LEN.unpack_from(self._map, HEADER_BYTES + at)
            start = HEADER_BYTES + at + _LEN.size
            self._strings.append(bytes(self._map[start:start + n]).decode("utf-8", "replace"))
            at += _LEN.size + n
        self._strings_read = at

    def read(self, limit: int | None = None) -> list[tuple[Any, ...]]:
        """Markers rows put since the last commit (at most ``limit``), oldest first."""
        start, written = self._window()
        end = written if limit is None else min(written, start + limit)
        cap, size, base = self.capacity, RECORD.size, self._base
        raw = [RECORD.unpack_from(self._map, base + (n % cap) * size) for n in range(start, end)]
        raw = raw[self._lapped(start, len(raw)):]
        strings, rank = self._strings, self.rank
        rows = []
        for seq, time_ns, step, nbytes, peer, gid, oid, sid, flags in raw:
            if gid >= len(strings) or oid >= len(strings) or sid >= len(STATES):
                self.lost += 1
                continue
            rows.append((rank, strings[gid], seq, strings[oid], STATES[sid], time_ns,
                         step if flags & _HAS_STEP else None, nbytes if flags & _HAS_BYTES else None,
                         peer if flags & _HAS_PEER else None))
        self._read_to(end)
        return rows

    def read_table(self) -> pa.Table:
        """The rows :meth:`read` would return, as a ``markers`` table built column by column (numpy
        over the records, no Python object per row: the agent spends 3-4x less CPU per marker than
        with ``read`` and ``rows_to_table``, bench/collector_cpu.py); :meth:`read`'s rows where
        numpy is missing."""
        import pyarrow as pa

        from megascope import schema

        try:
            import numpy as np
        except ImportError:  # a minimal install: the row path
            from megascope.collectors.buffers import rows_to_table

            return rows_to_table(self.read(), schema.MARKERS)
        start, written = self._window()
        cap, size, base = self.capacity, RECORD.size, self._base
        first, count = start % cap, written - start
        head = min(count, cap - first)
        dtype = np.dtype(_RECORD_FIELDS)
        view = np.frombuffer(self._map, dtype=dtype, count=head, offset=base + first * size)
        records = np.concatenate([view, np.frombuffer(self._map, dtype=dtype, count=count - head, offset=base)])
        del view  # no export of the map may outlive this call (close() could not unmap it)
        records = records[self._lapped(start, len(records)):]
        strings = self._strings
        valid = ((records["gid"] >= 0) & (records["gid"] < len(strings)) & (records["oid"] < len(strings))
                 & (records["sid"] < len(STATES)))
        self.lost += int(len(valid) - np.count_nonzero(valid))
        records = records[valid]
        names = pa.array(strings, pa.string())
        flags = records["flags"]
        data = pa.table({
            "rank": pa.array(np.full(len(records), self.rank, dtype=np.int32)),
            "group": names.take(pa.array(records["gid"])),
            "seq": pa.array(records["seq"]),
            "op": names.take(pa.array(records["oid"].astype(np.int32))),
            "state": pa.array(STATES, pa.string()).take(pa.array(records["sid"].astype(np.int32))),
            "time_ns": pa.array(records["time_ns"]),
            "step": pa.array(records["step"].astype(np.int32), mask=(flags & _HAS_STEP) == 0),
            "bytes": pa.array(records["bytes"], mask=(flags & _HAS_BYTES) == 0),
            "peer": pa.array(records["peer"], mask=(flags & _HAS_PEER) == 0),
        }, schema=schema.MARKERS)
        self._read_to(written)
        return data

    def _window(self) -> tuple[int, int]:
        """(first record not yet consumed, records written); the records a reader more than the
        ring behind can no longer have count as lost. Loads the strings put since the last read."""
        written = self._counter(WRITTEN_AT)
        start = self._counter(CONSUMED_AT)
        if written - start > self.capacity:
            self.lost += written - start - self.capacity
            start = written - self.capacity
        self._load_strings()
        return start, written

    def _lapped(self, start: int, copied: int) -> int:
        """How many of the ``copied`` records from ``start`` a writer that lapped the ring while
        they were copied may have overwritten (the oldest); counted as lost."""
        overwritten = min(max(self._counter(WRITTEN_AT) - self.capacity - start, 0), copied)
        self.lost += overwritten
        return overwritten

    def _read_to(self, end: int) -> None:
        """The last read reached ``end``: :meth:`commit` moves ``consumed`` there; the lost count is shared."""
        self._pending_commit = end
        _COUNTER.pack_into(self._map, LOST_AT, self.lost)

    def commit(self) -> None:
        """The rows of the last ``read`` (or ``read_table``) are on disk."""
        if self._pending_commit is not None:
            _COUNTER.pack_into(self._map, CONSUMED_AT, self._pending_commit)
            self._pending_commit = None

    def ack_flush(self, request: int) -> None:
        _COUNTER.pack_into(self._map, FLUSHES_AT, request)

    def close(self) -> None:
        with contextlib.suppress(BufferError, ValueError):
            self._map.close()
