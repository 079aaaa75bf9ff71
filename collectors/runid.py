"""The run id a rank stamps into every part it writes, agreed by all ranks without talking.

Role in the data flow: every part the collector writes (spans, markers, metrics, ranks, groups from
the writer thread; markers and ``rank_alive`` rows from the marker agent; heartbeats) carries the
run's id in its Parquet metadata (:func:`megascope.layout.write_part`), so that the store skips,
and names, a part copied in from another run. The id must be ``run.json``'s ``run_id`` on every
rank: a rank that stamped another one would have its own parts skipped. No rank asks another
(the collector may start before the process group exists); the id comes, in this order, from

1. ``MEGASCOPE_RUN_ID``: set by ``megascope train`` for the ranks it starts, or by the operator;
2. ``TORCHELASTIC_RUN_ID``: torchrun's rendezvous id, the same in every rank of the job (a fresh
   uuid with ``--standalone`` or on one node; ``--rdzv-id`` otherwise; its default ``none`` is
   not an id and is ignored);
3. otherwise rank 0's own (its ``RunMeta.run_id``, or a new one), which it writes into
   ``run.json`` as it starts; the other ranks read it from there (:meth:`RunId.from_run_json`).
   Until they have read it, their parts carry no id, and a part without one is read as this
   run's: a rank never stamps a guess. A ``run.json`` that was already there when the rank
   started is taken only if it is recent (rank 0 of this job wrote it moments before) and of the
   same world size; an older one is left for rank 0 to replace.

Imports the standard library only: the marker agent, which must stay small, uses it too.

Example::

    run_id = resolve_run_id(rank=3, world_size=8, run_dir=Path("runs/job"), own_id=None,
                            start_ns=time.time_ns())
    run_id.get()     # the id, or None while rank 0's run.json is not there yet
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

RUN_ID_VAR = "MEGASCOPE_RUN_ID"
ELASTIC_RUN_ID_VAR = "TORCHELASTIC_RUN_ID"
# torchrun's default --rdzv-id when none is given (static rendezvous on several nodes): every job
# launched that way has it, so it names no job.
_NOT_IDS = frozenset({"", "none"})
# A run.json already there when a rank starts is this job's only if written this recently before
# the rank started (rank 0 got there first) by the host's clock or the file system's.
FRESH_S = 120.0
# How often a rank that waits for rank 0's run.json looks for it.
_LOOK_EVERY_S = 0.2
_RUN_JSON = "run.json"


def clean_run_id(value: str) -> str:
    """An id as stamped: surrounding blanks removed, line breaks replaced (the agent's control pipe
    is line-based)."""
    return " ".join(value.split("\n")).replace("\r", " ").strip()


def job_run_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The run id the launcher gave every rank of the job alike, or None (module docstring, 1-2)."""
    env = os.environ if environ is None else environ
    for name in (RUN_ID_VAR, ELASTIC_RUN_ID_VAR):
        value = clean_run_id(env.get(name) or "")
        if value.lower() not in _NOT_IDS:
            return value
    return None


def new_run_id(run_dir: Path | str, start_ns: int | None = None) -> str:
    """A fresh id for a run written into ``run_dir``: its name and the start time in nanoseconds."""
    name = Path(run_dir).name or "run"
    return f"{name}-{start_ns if start_ns is not None else time.time_ns()}"


def _identity(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


class RunId:
    """The id this rank stamps: known from the start, or read from rank 0's ``run.json``.

    :meth:`get` is cheap once the id is known; before, it looks at ``run.json`` at most every
    0.2 s. ``on_known`` callbacks run once, on the thread that first learns the id.
    """

    def __init__(self, value: str | None = None) -> None:
        self._value = clean_run_id(value) if value is not None else None
        self._run_dir: Path | None = None
        self._world_size: int | None = None
        self._since_ns = 0
        self._seen: tuple[int, int, int] | None = None
        self._next_look = 0.0
        self._lock = threading.Lock()
        self._on_known: list[Callable[[str], None]] = []

    @classmethod
    def from_run_json(cls, run_dir: Path | str, *, world_size: int | None, since_ns: int) -> RunId:
        """An id to be read from ``run_dir/run.json`` once rank 0 has written it. ``since_ns``: when
        this rank started (host wall clock)."""
        run_id = cls(None)
        run_id._run_dir = Path(run_dir)
        run_id._world_size = world_size
        run_id._since_ns = since_ns
        run_id._seen = _identity(run_id._run_dir / _RUN_JSON)  # the file (if any) there before this rank
        return run_id

    @property
    def known(self) -> bool:
        return self._value is not None

    def on_known(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(id)`` once the id is known (now, if it already is)."""
        with self._lock:
            if self._value is None:
                self._on_known.append(callback)
                return
            value = self._value
        callback(value)

    def get(self) -> str | None:
        value = self._value
        if value is not None or self._run_dir is None:
            return value
        now = time.monotonic()
        with self._lock:
            if self._value is not None or now < self._next_look:
                return self._value
            self._next_look = now + _LOOK_EVERY_S
            value = self._read()
            if value is None:
                return None
            self._value = value
            callbacks, self._on_known = self._on_known, []
        for callback in callbacks:
            with contextlib.suppress(Exception):  # telling the agent must never stop a writer
                callback(value)
        return value

    def _read(self) -> str | None:
        assert self._run_dir is not None
        path = self._run_dir / _RUN_JSON
        identity = _identity(path)
        if identity is None:
            return None
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None  # being replaced, or damaged: look again later
        if not isinstance(data, dict):
            return None
        value = data.get("run_id")
        world = data.get("world_size")
        if not isinstance(value, str) or not clean_run_id(value):
            return None
        if self._world_size is not None and world != self._world_size:
            return None  # another job's
        if identity == self._seen:
            # There before this rank started: rank 0's only if it is recent by either clock.
            start_ns = data.get("start_ns")
            written_ns = max(identity[1], start_ns if isinstance(start_ns, int) else 0)
            if written_ns < self._since_ns - int(FRESH_S * 1e9):
                return None
        return clean_run_id(value)


def resolve_run_id(*, rank: int, world_size: int, run_dir: Path | str, own_id: str | None, start_ns: int,
                   environ: Mapping[str, str] | None = None) -> RunId:
    """The run id of this rank (module docstring): the launcher's, else rank 0's own (``own_id``
    or a new one), which the other ranks read from ``run.json``."""
    job = job_run_id(environ)
    if job is not None:
        return RunId(job)
    if rank == 0 or world_size == 1:
        return RunId(own_id if own_id is not None and clean_run_id(own_id) else new_run_id(run_dir, start_ns))
    return RunId.from_run_json(run_dir, world_size=world_size, since_ns=start_ns)
