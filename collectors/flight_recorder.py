"""Optional: copy torch's flight-recorder state into the markers table, from inside the job.

Role in the data flow: a poller the writer thread runs each flush when ``CollectorConfig(
flight_recorder=True)`` (or ``MEGASCOPE_FLIGHT_RECORDER=1``). It reads the in-process flight
recorders (``torch._C._distributed_c10d._dump_fr_trace`` and ``_dump_nccl_trace``, each that
exists: in torch 2.11 NCCL's entries are in the second alone, the first holding the other backends';
2.13 has the first only), and writes one marker per new state of each collective: ``enqueued`` (time created),
``started`` and ``completed`` (NCCL with ``TORCH_NCCL_ENABLE_TIMING=1``; on gloo only retirement is
visible, so ``completed`` carries the time the poller first saw it retired).

The flight recorder numbers collectives with torch's own per-group counter, which differs from the
collector's. To keep both trails readable, its markers use the group id ``fr:<group id>`` (the id
given to :meth:`Collector.register_group`, else ``fr:pg:<torch group name>``), with the same kind
and members in the groups table. Point-to-point entries are skipped (their peer is not recorded).

Example::

    col = Collector(CollectorConfig(run_dir=run, flight_recorder=True), rank=r, world_size=w)
"""

from __future__ import annotations

import logging
import pickle
import time
from typing import TYPE_CHECKING, Any

from megascope.schema import CollectiveOp, MarkerState
from megascope.topology import Group

if TYPE_CHECKING:
    from megascope.collectors.collector import Collector

log = logging.getLogger(__name__)

_OPS = {op.value for op in CollectiveOp}
# Flight-recorder profiling names that differ from ours ("nccl:_allgather_base" and the like).
_ALIASES = {
    "allreduce": CollectiveOp.ALL_REDUCE.value,
    "allgather": CollectiveOp.ALL_GATHER.value,
    "_allgather_base": CollectiveOp.ALL_GATHER.value,
    "allgather_into_tensor_coalesced": CollectiveOp.ALL_GATHER.value,
    "reduce_scatter_tensor_coalesced": CollectiveOp.REDUCE_SCATTER.value,
    "_reduce_scatter_base": CollectiveOp.REDUCE_SCATTER.value,
    "reducescatter": CollectiveOp.REDUCE_SCATTER.value,
    "alltoall": CollectiveOp.ALL_TO_ALL.value,
    "alltoall_base": CollectiveOp.ALL_TO_ALL.value,
    "all_to_all_single": CollectiveOp.ALL_TO_ALL.value,
}
_STATE_ORDER = {MarkerState.ENQUEUED.value: 0, MarkerState.STARTED.value: 1, MarkerState.COMPLETED.value: 2}


def dump_functions() -> list[Any]:
    """torch's flight-recorder dump functions, each this torch has (none: an empty list).

    Both where both exist: torch 2.11 keeps NCCL's entries in a recorder of their own, which
    ``_dump_fr_trace`` leaves out (measured on 1x H200: 0 entries, against 50 from
    ``_dump_nccl_trace``). Where the two dump one recorder, its entries come twice, which the
    reader skips as states already seen."""
    try:
        import torch._C._distributed_c10d as c10d
    except ImportError:
        return []
    return [f for f in (getattr(c10d, name, None) for name in ("_dump_fr_trace", "_dump_nccl_trace")) if f is not None]


def dump_entries(dump: list[Any]) -> list[dict[str, Any]]:
    """The entries of every recorder ``dump_functions`` gives, without stack traces. One that
    fails leaves the others' entries; the first error is raised only when all of them fail."""
    entries: list[dict[str, Any]] = []
    failed: list[Exception] = []
    for fn in dump:
        try:
            try:
                raw = fn(includeCollectives=True, includeStackTraces=False, onlyActive=False)
            except TypeError:  # older signatures take fewer keywords
                raw = fn(includeCollectives=True, includeStackTraces=False)
            entries += pickle.loads(raw).get("entries", ())
        except Exception as exc:  # noqa: BLE001 - one recorder's failure must not hide the others'
            failed.append(exc)
    if failed and len(failed) == len(dump):
        raise failed[0]
    return entries


def op_name(profiling_name: str) -> str:
    """``"nccl:all_reduce"`` -> ``"all_reduce"``; unknown names -> ``"other"``."""
    base = profiling_name.split(":", 1)[-1].strip().split(" ")[0]
    if base in _OPS:
        return base
    return _ALIASES.get(base, CollectiveOp.OTHER.value)


def entry_markers(entry: dict[str, Any], group: str, rank: int, now_ns: int) -> list[tuple[Any, ...]]:
    """Marker rows (schema order) for every state one flight-recorder entry has reached."""
    seq = entry.get("collective_seq_id")
    if entry.get("is_p2p") or seq is None:
        return []
    op = op_name(str(entry.get("profiling_name", "")))
    state = str(entry.get("state", "scheduled"))
    rows = [(rank, group, int(seq), op, MarkerState.ENQUEUED.value, int(entry.get("time_created_ns") or now_ns),
             None, None, None)]
    started = entry.get("time_discovered_started_ns")
    if started is not None or state in ("started", "completed"):
        rows.append((rank, group, int(seq), op, MarkerState.STARTED.value, int(started or now_ns), None, None, None))
    completed = entry.get("time_discovered_completed_ns")
    if completed is not None or state == "completed" or entry.get("retired"):
        rows.append((rank, group, int(seq), op, MarkerState.COMPLETED.value, int(completed or now_ns),
                     None, None, None))
    return rows


class FlightRecorderPoller:
    """Run by the writer thread: dump the flight recorder, queue markers for states not seen before."""

    def __init__(self, collector: Collector) -> None:
        self._col = collector
        self._dump = dump_functions()
        # (torch group name, seq) -> highest state already written, bounded by pruning old seqs.
        self._seen: dict[tuple[str, int], int] = {}
        # The recorder is the process's: entries made before this collector (a group destroyed
        # since, whose successor reuses its name and numbers) are not this run's.
        self._since_ns = time.time_ns()
        if not self._dump:
            log.warning("megascope collector: this torch has no flight-recorder dump; flight_recorder ignored")

    def _group_for(self, pg_name: str) -> str:
        col = self._col
        group = col._groups_by_name.get(pg_name)
        fr_id = f"fr:{group.id}" if group is not None else f"fr:pg:{pg_name}"
        if fr_id not in col._groups:
            members = group.members if group is not None else (col.rank,)
            kind = group.kind if group is not None else "other"
            col._add_group(Group(fr_id, kind, members))
        return fr_id

    def __call__(self) -> None:
        if not self._dump:
            return
        entries = dump_entries(self._dump)
        now = time.time_ns()
        sink = self._col._sink
        latest: dict[str, int] = {}
        for entry in entries:
            if int(entry.get("time_created_ns") or now) < self._since_ns:
                continue
            pg = entry.get("process_group") or ("", "")
            pg_name = str(pg[0] if isinstance(pg, list | tuple) else pg)
            rows = entry_markers(entry, "", self._col.rank, now)
            if not rows:
                continue
            seq = rows[0][2]
            latest[pg_name] = max(latest.get(pg_name, seq), seq)
            key = (pg_name, seq)
            done = self._seen.get(key, -1)
            group = self._group_for(pg_name)
            for row in rows:
                order = _STATE_ORDER[row[4]]
                if order > done:
                    sink.markers.put((row[0], group, *row[2:]))  # MARKER_ROW, group named
                    done = order
            self._seen[key] = done
        # Forget entries that fell out of the ring buffer long ago (the dump holds the newest ones).
        if len(self._seen) > 4 * max(1, len(entries)) + 1024:
            keep = {k: v for k, v in self._seen.items() if k[1] >= latest.get(k[0], 0) - 4096}
            self._seen = keep
