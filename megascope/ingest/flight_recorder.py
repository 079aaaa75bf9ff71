"""``megascope ingest flight-recorder``: PyTorch flight-recorder dumps (one per rank) -> a run directory.

Role in the data flow: a foreign-trace writer for hangs. When a collective times out, PyTorch's
flight recorder dumps each rank's recent collectives to ``<TORCH_NCCL_DEBUG_INFO_TEMP_FILE><rank>``
(a pickle of plain dicts; ``_dump_fr_trace_json`` writes the same as JSON). Each entry becomes
markers (``enqueued`` at ``time_created_ns``, ``started`` / ``completed`` at the watchdog's
``time_discovered_*_ns``) and, where the entry has ``duration_ms`` (NCCL with
``TORCH_NCCL_ENABLE_TIMING=1``), a span; ``pg_config`` becomes groups. ``localize`` then names the
rank that never entered the collective its peers wait in.

Safety: dumps are read with an unpickler that refuses every class or function reference, so a
hostile file cannot run code; only dicts, lists, tuples, strings, numbers, booleans and None load.

Silence is information: a rank of the job that wrote no dump gets a ``ranks`` row and no markers,
and ``run.json`` lists it under ``config.ingest.missing_ranks``.

Gloo dumps carry no times but enqueue (``state`` stays ``scheduled``); a ``retired`` entry, or one
at or below ``pg_status.last_completed_collective``, gets a ``completed`` marker stamped with its
enqueue time (a lower bound, flagged in ``run.json``), p2p is not recorded at all.

Example::

    from megascope.ingest import ingest_flight_recorder
    ingest_flight_recorder("dumps/", "runs/hang", mesh={"tp": 2, "dp": 2})
"""

from __future__ import annotations

import io
import json
import logging
import math
import pickle
import re
import struct
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Any

import pyarrow as pa

from megascope import layout
from megascope.errors import IngestError
from megascope.ingest.groups import GroupPlan, ProcessGroup, parse_ranks, plan_groups
from megascope.ingest.kineto import IngestResult
from megascope.ingest.kineto_map import dtype_bytes, normalize_op
from megascope.ingest.runwriter import RankInfo, StagedRun, check_out_dir, write_rank_tables, write_rows
from megascope.schema import CollectiveOp, MarkerState, RunMeta, RunSource, SpanKind, Stream

log = logging.getLogger(__name__)

_DUMP_NAME = re.compile(r"^(?P<prefix>.*?)(?P<rank>\d+)(?P<ext>\.json|\.pkl|\.pickle)?$")
_P2P_NAME = re.compile(r"(\d+)\s*(?:->|<-)\s*(\d+)")
MAX_DUMP_BYTES = 2 << 30


class _PlainDataUnpickler(pickle._Unpickler):
    """Loads builtin containers and scalars only; any class or function reference is refused.

    The pure-Python unpickler: a damaged length field makes it stop at the end of the data, where
    the C one may try to allocate the length first (and leave interpreter noise on stderr)."""

    def __init__(self, data: bytes, path: Path) -> None:
        super().__init__(io.BytesIO(data))
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        raise IngestError(
            f"{self._path}: the pickle references {module}.{name}; flight-recorder dumps hold plain data only, "
            "refusing to load it"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise IngestError(f"{self._path}: the pickle uses persistent ids; not a flight-recorder dump")


def load_dump(path: Path) -> dict[str, Any]:
    """One dump as a dict, from the pickle or JSON form; IngestError for anything else."""
    try:
        size = path.stat().st_size
        if size > MAX_DUMP_BYTES:
            raise IngestError(f"{path}: {size} bytes is too large for a flight-recorder dump")
        data = path.read_bytes()
    except OSError as exc:
        raise IngestError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not data:
        raise IngestError(f"{path}: empty file; not a flight-recorder dump")
    if data.lstrip()[:1] == b"{":
        try:
            dump = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise IngestError(f"{path}: malformed JSON ({exc}); not a flight-recorder dump") from None
    else:
        try:
            dump = _PlainDataUnpickler(data, path).load()
        except IngestError:
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, IndexError, struct.error,
                OverflowError, AttributeError, MemoryError, RecursionError, UnicodeDecodeError) as exc:
            raise IngestError(f"{path}: not a readable pickle ({type(exc).__name__}: {exc}); truncated or not a dump") from None
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        raise IngestError(f"{path}: not a flight-recorder dump (expected a dict with an 'entries' list)")
    return dump


def find_dumps(src: Path, prefix: str | None = None) -> dict[int, Path]:
    """Rank -> dump file. ``src`` is a directory of ``<prefix><rank>`` files or one such file."""
    src = Path(src)
    if src.is_file():
        candidates = [src]
    elif src.is_dir():
        candidates = sorted(p for p in src.iterdir() if p.is_file() and not p.name.startswith("."))
    else:
        raise IngestError(f"{src}: no such file or directory")
    by_prefix: dict[str, dict[int, Path]] = defaultdict(dict)
    for p in candidates:
        m = _DUMP_NAME.match(p.name)
        if not m or (prefix is not None and not p.name.startswith(prefix)):
            continue
        if prefix is not None and m.group("prefix") != prefix:
            continue
        rank = int(m.group("rank"))
        found = by_prefix[m.group("prefix")]
        if rank in found:
            raise IngestError(f"duplicate rank {rank}: {found[rank].name} and {p.name}")
        found[rank] = p
    if not by_prefix:
        what = f"named {prefix}<rank>" if prefix is not None else "named <prefix><rank>"
        raise IngestError(f"{src}: no flight-recorder dumps {what} found")
    if len(by_prefix) > 1:
        names = ", ".join(repr(k) for k in sorted(by_prefix))
        raise IngestError(f"{src}: dumps with different prefixes ({names}); pass --prefix to pick one job")
    return next(iter(by_prefix.values()))


@dataclass
class _Dump:
    rank: int
    path: Path
    data: dict[str, Any]

    @property
    def pgs(self) -> list[ProcessGroup]:
        out = []
        config = self.data.get("pg_config") or {}
        if not isinstance(config, dict):
            raise IngestError(f"{self.path}: pg_config is a {type(config).__name__}, not an object of process "
                              "groups; not a flight-recorder dump")
        for key, cfg in config.items():
            if not isinstance(cfg, dict):
                continue
            try:
                ranks = parse_ranks(cfg.get("ranks", "[]"))
            except ValueError:
                raise IngestError(f"{self.path}: pg_config {key!r} has unreadable ranks {cfg.get('ranks')!r}") from None
            out.append(ProcessGroup(str(cfg.get("name", key)), str(cfg.get("desc", "")), ranks))
        return out


def _world_size(dumps: list[_Dump], world_size: int | None, mesh: dict[str, int] | None) -> int:
    sizes = set()
    for d in dumps:
        for pg in d.pgs:
            if pg.desc == "default_pg" and pg.ranks:
                sizes.add(len(pg.ranks))
    if len(sizes) > 1:
        raise IngestError(f"mixed jobs: dumps disagree on the world size ({', '.join(map(str, sorted(sizes)))})")
    if mesh:
        product = prod(mesh.values())
        if sizes and product not in sizes:
            raise IngestError(f"--mesh {mesh} has {product} ranks but the dumps say the world has {sizes.pop()}")
        sizes = {product}
    if world_size is not None:
        if sizes and world_size not in sizes:
            raise IngestError(f"--world-size {world_size} disagrees with the dumps' default group ({sizes.pop()} ranks)")
        sizes = {world_size}
    if sizes:
        world = sizes.pop()
    else:
        members = [r for d in dumps for pg in d.pgs for r in pg.ranks]
        world = max([d.rank for d in dumps] + members) + 1
        log.warning("the dumps do not name the world size; assuming %d (pass --world-size if ranks are missing)", world)
    too_big = [d for d in dumps if d.rank >= world]
    if too_big:
        raise IngestError(f"{too_big[0].path}: rank {too_big[0].rank} outside world size {world}")
    return world


def _group_for(entry: dict[str, Any], pg_by_name: dict[str, ProcessGroup], plan: GroupPlan) -> tuple[str, tuple[int, ...]]:
    pg_field = entry.get("process_group")
    name = str(pg_field[0]) if isinstance(pg_field, list | tuple) and pg_field else str(entry.get("pg_id", ""))
    desc = str(pg_field[1]) if isinstance(pg_field, list | tuple) and len(pg_field) > 1 else ""
    pg = pg_by_name.get(name)
    if pg is not None and pg.ranks:
        gid = plan.id_for(pg.desc, pg.ranks)
        if gid is not None:
            return gid, pg.ranks
    if desc == "default_pg" or (pg is not None and pg.desc == "default_pg"):
        return "world", tuple(range(plan.world_size))
    return f"pg{name}", pg.ranks if pg is not None else ()


INT64_MAX = 2**63 - 1


def _corrupt(path: Path, entry: dict[str, Any], field: str, value: object) -> IngestError:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    return IngestError(f"{path}: entry {entry.get('record_id')!r}: {field} = {shown} is out of range; the dump is corrupt")


def _field_int(entry: dict[str, Any], field: str, path: Path) -> int | None:
    """An integer field that must fit the schema's int64 and not be negative; None when absent."""
    value = _int(entry.get(field))
    if value is not None and not 0 <= value <= INT64_MAX:
        raise _corrupt(path, entry, field, value)
    return value


def _duration_ns(entry: dict[str, Any], path: Path) -> int | None:
    value = entry.get("duration_ms")
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    if not math.isfinite(value) or value < 0 or value * 1e6 > INT64_MAX:
        raise _corrupt(path, entry, "duration_ms", value)
    return int(value * 1e6)


def _nbytes(entry: dict[str, Any], path: Path) -> int | None:
    sizes, dtypes = entry.get("input_sizes"), entry.get("input_dtypes")
    if not isinstance(sizes, list) or not sizes or not isinstance(dtypes, list) or not dtypes:
        return None
    size = dtype_bytes(dtypes[0])
    if size is None or not isinstance(sizes[0], list):
        return None
    n = 1
    for d in sizes[0]:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            return None
        n *= d
    if n * size > INT64_MAX:
        raise _corrupt(path, entry, "input_sizes", sizes[0])
    return n * size


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def dump_rows(dump: _Dump, plan: GroupPlan) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Counter[str]]:
    """Markers and spans of one rank's dump."""
    rank = dump.rank
    stats: Counter[str] = Counter()
    pg_by_name = {pg.name: pg for pg in dump.pgs}
    status = dump.data.get("pg_status") or {}
    markers: list[dict[str, Any]] = []
    spans: list[dict[str, Any]] = []
    per_pair: Counter[tuple[int, int]] = Counter()
    entries = sorted((e for e in dump.data["entries"] if isinstance(e, dict)), key=lambda e: e.get("record_id", 0))
    for e in entries:
        created = _field_int(e, "time_created_ns", dump.path)
        if created is None:
            stats["entries without time_created_ns (skipped)"] += 1
            continue
        group, members = _group_for(e, pg_by_name, plan)
        name = str(e.get("profiling_name") or "")
        op = normalize_op(name)
        peer = None
        if e.get("is_p2p") or op in (CollectiveOp.SEND, CollectiveOp.RECV):
            m = _P2P_NAME.search(name)
            if m:
                # "nccl:send 0->1" / "nccl:recv 1<-0": this rank, then its peer, both group-local.
                local_peer = int(m.group(2))
                peer = members[local_peer] if local_peer < len(members) else local_peer
            if peer is None:
                stats["p2p entries without a peer (skipped)"] += 1
                continue
            pair = (rank, peer) if op == CollectiveOp.SEND else (peer, rank)
            per_pair[pair] += 1
            seq: int = per_pair[pair]
        else:
            coll_seq = _field_int(e, "collective_seq_id", dump.path)
            if coll_seq is None:
                stats["entries without collective_seq_id (skipped)"] += 1
                continue
            seq = coll_seq
        nbytes = _nbytes(e, dump.path)
        common = dict(rank=rank, group=group, seq=seq, op=op, step=None, bytes=nbytes, peer=peer)
        markers.append(dict(state=MarkerState.ENQUEUED, time_ns=created, **common))
        started = _field_int(e, "time_discovered_started_ns", dump.path)
        completed = _field_int(e, "time_discovered_completed_ns", dump.path)
        if started is not None:
            markers.append(dict(state=MarkerState.STARTED, time_ns=started, **common))
        pg_key = str(e.get("pg_id", ""))
        last_done = _int((status.get(pg_key) or {}).get("last_completed_collective")) if isinstance(status, dict) else None
        done_by_status = last_done is not None and not e.get("is_p2p") and seq <= last_done
        if completed is not None:
            markers.append(dict(state=MarkerState.COMPLETED, time_ns=completed, **common))
        elif e.get("state") == "completed" or e.get("retired") or done_by_status:
            # No completion time (gloo, or timing off): the enqueue time is the only lower bound.
            markers.append(dict(state=MarkerState.COMPLETED, time_ns=created, **common))
            stats["completions without a time (stamped at enqueue)"] += 1
        dur_ns = _duration_ns(e, dump.path)
        if dur_ns is not None:
            end = completed if completed is not None else started
            if end is not None:
                # The watchdog discovers completion late; the kernel cannot have started before the enqueue.
                start = max(created, end - dur_ns)
                kind = SpanKind.SEND if op == CollectiveOp.SEND else SpanKind.RECV if op == CollectiveOp.RECV else SpanKind.COLLECTIVE
                spans.append(dict(rank=rank, step=None, name=name or str(op), kind=kind, stream=Stream.COMM,
                                  start_ns=start, dur_ns=dur_ns, group=group, seq=seq, op=op, bytes=nbytes, peer=peer))
    return markers, spans, stats


def ingest_flight_recorder(
    src: Path | str,
    out: Path | str,
    *,
    mesh: dict[str, int] | None = None,
    world_size: int | None = None,
    prefix: str | None = None,
) -> IngestResult:
    """Import flight-recorder dumps under ``src`` as the run ``out``.

    ``mesh`` maps ranks onto tp/pp/dp when the process-group names do not; ``world_size`` says how
    many ranks the job had when the dumps do not (so that silent ranks are counted).
    """
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    check_out_dir(out)
    files = find_dumps(src, prefix)
    dumps = [_Dump(rank, path, load_dump(path)) for rank, path in sorted(files.items())]
    versions = {str(d.data.get("version")) for d in dumps}
    if len(versions) > 1:
        raise IngestError(f"mixed jobs: dumps of different flight-recorder versions ({', '.join(sorted(versions))})")
    _check_same_groups(dumps)
    world = _world_size(dumps, world_size, mesh)
    plan = plan_groups([pg for d in dumps for pg in d.pgs], world_size=world, mesh=mesh)
    warnings: list[str] = []
    n_markers = n_spans = 0
    timed = False
    approx = 0
    with StagedRun(out) as stage:
        infos = {}
        for d in dumps:
            try:
                markers, spans, stats = dump_rows(d, plan)
                n_markers += write_rows(stage.path, "markers", markers, d.rank, stage.run_id)
                n_spans += write_rows(stage.path, "spans", spans, d.rank, stage.run_id)
            except (TypeError, AttributeError, ValueError, OverflowError, pa.ArrowException) as exc:
                # A field of an unexpected type or size that the checks above did not name.
                reason = " ".join(str(exc).split())[:200]
                raise IngestError(f"{d.path}: not a flight-recorder dump of the expected shape ({reason})") from None
            timed = timed or bool(spans)
            approx += stats.get("completions without a time (stamped at enqueue)", 0)
            for what, count in stats.items():
                log.info("rank %d: %d %s", d.rank, count, what)
            first = min((m["time_ns"] for m in markers), default=None)
            infos[d.rank] = RankInfo(rank=d.rank, start_ns=first)
        missing = sorted(set(range(world)) - set(files))
        if missing:
            warnings.append(
                f"{len(missing)} of {world} ranks wrote no dump (suspects: a rank that dumped nothing may be the "
                f"one that hung): {', '.join(map(str, missing[:20]))}"
            )
        write_rank_tables(stage.path, plan, infos, stage.run_id)
        starts = [i.start_ns for i in infos.values() if i.start_ns is not None]
        meta = RunMeta(
            run_id=stage.run_id,
            source=RunSource.FLIGHT_RECORDER,
            world_size=world,
            mesh_axes=tuple(plan.mesh_sizes),
            mesh_sizes=plan.mesh_sizes,
            start_ns=min(starts) if starts else None,
            config={
                "ingest": {
                    "files": len(dumps),
                    "flight_recorder_version": versions.pop() if versions else None,
                    "comm_lib_version": dumps[0].data.get("comm_lib_version"),
                    "mesh_from": plan.mesh_source,
                    "expected_world_size": world,
                    "missing_ranks": missing,
                    "timed": timed,
                    "completion_times_approximate": approx > 0,
                    "warnings": warnings,
                }
            },
        )
        layout.write_run_meta(stage.path, meta)
    for w in warnings:
        log.warning(w)
    return IngestResult(
        run_dir=out,
        source=str(RunSource.FLIGHT_RECORDER),
        world_size=world,
        ranks_found=sorted(files),
        missing_ranks=missing,
        files=len(dumps),
        events=sum(len(d.data["entries"]) for d in dumps),
        spans=n_spans,
        markers=n_markers,
        seconds=time.perf_counter() - t0,
        mesh=dict(plan.mesh_sizes),
        warnings=warnings,
    )


def _check_same_groups(dumps: list[_Dump]) -> None:
    seen: dict[str, tuple[ProcessGroup, Path]] = {}
    for d in dumps:
        for pg in d.pgs:
            if not pg.ranks:
                continue
            known = seen.get(pg.name)
            if known is None:
                seen[pg.name] = (pg, d.path)
            elif (known[0].desc, known[0].ranks) != (pg.desc, pg.ranks):
                raise IngestError(
                    f"mixed jobs: process group {pg.name!r} is {known[0].desc} {list(known[0].ranks)} in "
                    f"{known[1].name} but {pg.desc} {list(pg.ranks)} in {d.path.name}"
                )
