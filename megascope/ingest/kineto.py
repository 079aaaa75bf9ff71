"""``megascope ingest kineto``: torch.profiler traces (one Chrome-trace JSON per rank) -> a run directory.

Role in the data flow: a foreign-trace writer. It reads each rank's ``.json`` / ``.json.gz`` as a
stream (:mod:`~megascope.ingest.jsonstream`), keeps what matters
(:mod:`~megascope.ingest.kineto_events`), maps it onto the schema
(:mod:`~megascope.ingest.kineto_map`) and writes ordinary Parquet parts, so ``report``,
``localize``, ``export`` and ``serve`` work on jobs that never ran megascope's collector.

Order of work, so that a bad input costs nothing:

1. read only the header of every file (rank, world size, process groups) and check the set: one
   job (same world size, backend and process groups), no rank twice;
2. map process groups to megascope groups and the mesh (:mod:`~megascope.ingest.groups`);
3. parse the files, one process per file where cores allow, into a hidden staging directory;
4. write ``ranks``, ``groups`` and ``run.json``, then rename the staging directory to ``-o``.

Example::

    from megascope.ingest import ingest_kineto
    result = ingest_kineto("traces/", "runs/job42")
    result.world_size, result.spans
"""

from __future__ import annotations

import ctypes
import gc
import importlib.abc
import logging
import multiprocessing
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from megascope import layout
from megascope.errors import IngestError
from megascope.ingest.groups import GroupPlan, ProcessGroup, parse_ranks, plan_groups
from megascope.ingest.jsonstream import TraceReader
from megascope.ingest.kineto_events import collect, trace_reader
from megascope.ingest.kineto_map import map_rank
from megascope.ingest.runwriter import RankInfo, StagedRun, check_out_dir, write_rank_tables, write_rows
from megascope.schema import RunMeta, RunSource

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
HEADER_CHUNK_CHARS = 64 << 10


@dataclass(frozen=True)
class IngestResult:
    """What an ingest wrote."""

    run_dir: Path
    source: str
    world_size: int
    ranks_found: list[int]
    missing_ranks: list[int]
    files: int
    events: int
    spans: int
    markers: int
    seconds: float
    mesh: dict[str, int]
    warnings: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Header:
    path: Path
    rank: int
    world_size: int | None  # None: the trace does not say (no distributedInfo.world_size)
    backend: str | None
    pgs: tuple[ProcessGroup, ...]
    host: str | None
    device_names: dict[int, str]
    rank_from: str = "distributedInfo"  # or "file name", or "single file"


def find_trace_files(src: Path) -> list[Path]:
    """``src`` itself, or every ``*.json`` / ``*.json.gz`` below it (hidden files skipped)."""
    src = Path(src)
    if src.is_file():
        return [src]
    if not src.is_dir():
        raise IngestError(f"{src}: no such file or directory")
    files = sorted(
        p for p in src.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(src).parts)
        and (p.name.endswith(".json") or p.name.endswith(".json.gz"))
    )
    if not files:
        raise IngestError(f"{src}: no Kineto traces (*.json or *.json.gz) found")
    return files


def _pg_list(info: dict[str, Any], path: Path) -> tuple[ProcessGroup, ...]:
    out = []
    for pg in info.get("pg_config") or []:
        if not isinstance(pg, dict):
            continue
        try:
            ranks = parse_ranks(pg.get("ranks", []))
        except ValueError:
            raise IngestError(f"{path}: distributedInfo.pg_config has unreadable ranks {pg.get('ranks')!r}") from None
        out.append(ProcessGroup(str(pg.get("pg_name", "")), str(pg.get("pg_desc", "")), ranks))
    return tuple(out)


def read_header(path: Path, *, single: bool) -> _Header:
    """Rank, world size and process groups of one trace, from the keys before its events.

    A trace of one process without ``distributedInfo`` (or without its ``world_size``: a one-GPU
    profile, the commonest trace there is) keeps the rank it names, in ``distributedInfo.rank``
    or in its file name (``rank-3``, ``rank_3``); a lone such file is rank 0. The world size is
    then settled over the whole set by :func:`settle_world`.
    """
    # A small first chunk: the header is a few KiB, and every file's is read before any events.
    with TraceReader(path, chunk_chars=HEADER_CHUNK_CHARS) as reader:
        header = reader.read_header()
    info = header.get("distributedInfo")
    devices = {}
    for prop in header.get("deviceProperties") or []:
        if isinstance(prop, dict) and "id" in prop and "name" in prop:
            devices[int(prop["id"])] = str(prop["name"])
    host = header.get("host_name") if isinstance(header.get("host_name"), str) else None
    if not isinstance(info, dict):
        info = {}
    backend = info.get("backend") if isinstance(info.get("backend"), str) else None
    world: int | None = None
    if info.get("world_size") is not None:
        try:
            world = int(info["world_size"])
        except (TypeError, ValueError):
            raise IngestError(f"{path}: distributedInfo.world_size is not an integer ({info['world_size']!r})") from None
        if world < 1:
            raise IngestError(f"{path}: distributedInfo.world_size is {world}; it must be at least 1")
    pgs = _pg_list(info, path)
    if info.get("rank") is not None:
        try:
            rank = int(info["rank"])
        except (TypeError, ValueError):
            raise IngestError(f"{path}: distributedInfo.rank is not an integer ({info['rank']!r})") from None
        if rank < 0:
            raise IngestError(f"{path}: distributedInfo.rank is {rank}; it must be at least 0")
        return _Header(path, rank, world, backend, pgs, host, devices)
    match = _RANK_IN_NAME.search(path.name)
    if match:
        return _Header(path, int(match.group(1)), world, backend, pgs, host, devices, rank_from="file name")
    if single:
        return _Header(path, 0, world, backend, pgs, host, devices, rank_from="single file")
    raise IngestError(
        f"{path}: no distributedInfo.rank and no rank in the file name, so its rank is unknown; "
        "ingest it alone, or name it rank-N"
    )


def settle_world(headers: list[_Header]) -> tuple[list[_Header], list[str]]:
    """Fill in the world size where traces do not record it; the warnings that say how.

    One trace without a world size is read as a one-rank run (rank 0). Several are one job of
    ``max(rank) + 1`` ranks, or of the world size that the others record.
    """
    unknown = [h for h in headers if h.world_size is None]
    guessed = [h for h in headers if h.rank_from != "distributedInfo"]
    warnings = []
    if guessed and len(headers) > 1:
        shown = ", ".join(f"{h.path.name} -> rank {h.rank}" for h in guessed[:5])
        warnings.append(f"{len(guessed)} traces have no distributedInfo.rank; rank taken from the file name: {shown}")
    if not unknown:
        return headers, warnings
    known = {h.world_size for h in headers if h.world_size is not None}
    if len(headers) == 1:
        (h,) = headers
        was = f" (it names rank {h.rank}, kept as rank 0)" if h.rank else ""
        warnings.append(f"{h.path.name}: no distributedInfo.world_size; read as a one-rank run{was}")
        return [replace(h, rank=0, world_size=1)], warnings
    if len(known) == 1:
        world = known.pop()
        warnings.append(f"{len(unknown)} traces have no distributedInfo.world_size; taken as {world}, as the others record")
    elif not known:
        world = max(h.rank for h in headers) + 1
        warnings.append(f"no trace records distributedInfo.world_size; taken as the highest rank + 1 = {world}")
    else:
        return headers, warnings  # several recorded sizes: check_one_job names the mix
    return [h if h.world_size is not None else replace(h, world_size=world) for h in headers], warnings


def _read_header(path: Path, *, single: bool) -> _Header:
    try:
        return read_header(path, single=single)
    except RecursionError:
        raise IngestError(f"{path}: values nested too deeply; not a Kineto trace") from None
    except (TypeError, AttributeError, KeyError, IndexError, ValueError, OverflowError) as exc:
        # A header field of another type than torch.profiler writes (a number for deviceProperties).
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        raise IngestError(f"{path}: a header field of an unexpected shape ({reason}); the trace is corrupt") from None


def check_one_job(headers: list[_Header]) -> int:
    """The world size of the job; an error naming the files if they are not one job's ranks."""
    worlds = Counter(h.world_size or 0 for h in headers)
    if len(worlds) > 1:
        (w1, _), (w2, _) = worlds.most_common(2)
        a = next(h for h in headers if h.world_size == w1)
        b = next(h for h in headers if h.world_size == w2)
        raise IngestError(f"mixed jobs: {a.path.name} has world size {w1} but {b.path.name} has {w2}")
    backends = {h.backend for h in headers if h.backend}
    if len(backends) > 1:
        raise IngestError(f"mixed jobs: traces use different backends ({', '.join(sorted(backends))})")
    world = headers[0].world_size or 1
    seen: dict[int, Path] = {}
    for h in headers:
        if not 0 <= h.rank < world:
            raise IngestError(f"{h.path}: rank {h.rank} outside world size {world}")
        if h.rank in seen:
            raise IngestError(f"duplicate rank {h.rank}: {seen[h.rank].name} and {h.path.name}; pass one job's traces")
        seen[h.rank] = h.path
    names: dict[str, tuple[str, tuple[int, ...], Path]] = {}
    for h in headers:
        for pg in h.pgs:
            known = names.get(pg.name)
            if known is None:
                names[pg.name] = (pg.desc, pg.ranks, h.path)
            elif (known[0], known[1]) != (pg.desc, pg.ranks):
                raise IngestError(
                    f"mixed jobs: process group {pg.name!r} is {known[0]} {list(known[1])} in {known[2].name} "
                    f"but {pg.desc} {list(pg.ranks)} in {h.path.name}"
                )
    return world


# Ranks of one job profile the same steps, so their traces overlap in time, give or take the
# hosts' clock differences (milliseconds with NTP). A gap of a minute means two jobs.
MAX_TRACE_GAP_NS = 60 * 1_000_000_000


def check_one_window(results: list[dict[str, Any]]) -> None:
    """An error if some rank's trace starts well after another's ends: traces of two jobs (or of two
    profiling windows) whose world sizes and groups happen to agree."""
    timed = [r for r in results if r.get("start_ns") is not None]
    if len(timed) < 2:
        return
    first_end = min(timed, key=lambda r: r["end_ns"] if r["end_ns"] is not None else r["start_ns"])
    last_start = max(timed, key=lambda r: r["start_ns"])
    end = first_end["end_ns"] if first_end["end_ns"] is not None else first_end["start_ns"]
    gap = last_start["start_ns"] - end
    if gap > MAX_TRACE_GAP_NS:
        raise IngestError(
            f"mixed jobs: {Path(last_start['path']).name} (rank {last_start['rank']}) starts {gap / 1e9:,.0f} s after "
            f"{Path(first_end['path']).name} (rank {first_end['rank']}) ends; one job's traces overlap in time"
        )


def _pg_groups(header: _Header, plan: GroupPlan) -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for pg in header.pgs:
        gid = plan.id_for(pg.desc, pg.ranks)
        if gid is not None:
            out[pg.name] = (gid, pg.ranks)
    return out


def ingest_file(path: str, rank: int, stage: str, pg_groups: dict[str, tuple[str, tuple[int, ...]]],
                run_id: str | None = None) -> dict[str, Any]:
    """Parse one rank's trace and write its spans and markers into ``stage``. Runs in a worker."""
    t0 = time.perf_counter()
    # Parsing allocates millions of small objects and no reference cycles: the cyclic collector's
    # passes over them would cost ~40% of the parse and free nothing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        events = collect(trace_reader(path))
        tables = map_rank(events, rank=rank, pg_groups=pg_groups, path=path)
    except RecursionError:
        raise IngestError(f"{path}: values nested too deeply; not a Kineto trace") from None
    except (ValueError, OverflowError, pa.ArrowException) as exc:
        # NaN, Infinity, 1e30 or a 20-digit number where a time, duration or step belongs
        reason = " ".join(str(exc).split())[:200]
        raise IngestError(f"{path}: a time, duration or step out of range ({reason}); the trace is corrupt") from None
    except (TypeError, AttributeError, KeyError, IndexError) as exc:
        # A field of another type than torch.profiler writes (a list where a thread id belongs).
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
        raise IngestError(f"{path}: an event of an unexpected shape ({reason}); the trace is corrupt") from None
    finally:
        if collecting:
            gc.enable()
    span_table = tables.spans
    negative = pc.less(span_table["dur_ns"], 0)
    dropped = int(pc.sum(negative).as_py() or 0)
    if dropped:
        span_table = span_table.filter(pc.invert(negative))
    run_dir = Path(stage)
    spans = write_rows(run_dir, "spans", span_table, rank, run_id)
    markers = write_rows(run_dir, "markers", tables.markers, rank, run_id)
    ends = pc.add(span_table["start_ns"], span_table["dur_ns"])
    return {
        "negative_durations": dropped,
        "end_ns": pc.max(ends).as_py() if len(ends) else None,
        "rank": rank,
        "path": path,
        "events": events.events,
        "spans": spans,
        "markers": markers,
        "steps": tables.steps,
        "start_ns": tables.start_ns,
        "pid": events.pid,
        "device_index": tables.device_index,
        "stats": dict(tables.stats),
        "seconds": time.perf_counter() - t0,
    }


# glibc's malloc options (mallopt): allocations up to this size come from the heap, and freed heap
# memory is kept up to this size instead of being handed back to the system.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP_FREED_BYTES = 1 << 30


class _NoPandas(importlib.abc.MetaPathFinder):
    """An import finder that refuses pandas (see :func:`_init_worker`)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == "pandas" or name.startswith("pandas."):
            raise ImportError("pandas is not loaded in Kineto parsing workers")
        return None


def _init_worker() -> None:
    """Set up a parsing process: its inherited objects frozen, its freed memory kept.

    Each file allocates and frees tens of MiB; glibc hands large blocks back to the system
    and the next file faults them in again, page by page (one process, 25k-event rank files: ~2,800
    page faults and ~8 ms of system time per file, ~180 and ~2 ms with this). A worker keeps them
    instead; its peak memory is the same, since the next file reuses what the last one freed.
    """
    gc.freeze()
    if "pandas" not in sys.modules:
        # pyarrow imports pandas at its first array conversion when it can (~54 MB and ~0.5 s),
        # and nothing a worker does needs it: each worker would hold its own copy. Refused here
        # (pyarrow then works as where pandas is not installed). A parent that had imported it
        # already (a test, a notebook) shares its copy with the workers instead.
        sys.meta_path.insert(0, _NoPandas())
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _KEEP_FREED_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED_BYTES)
    except (OSError, AttributeError, TypeError):  # not glibc: its own defaults
        pass


def _pool_context() -> Any:
    # fork starts workers in milliseconds and the parent has no threads yet at this point.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else None)


def _run_files(
    jobs: list[tuple[str, int, str, dict[str, tuple[str, tuple[int, ...]]], str]],
    workers: int,
    progress: Progress | None,
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    total = len(jobs)
    if workers <= 1 or total == 1:
        for job in jobs:
            results.append(ingest_file(*job))
            if progress:
                progress(len(results), total)
        return results
    # A forked worker must never finalize what it inherited (a DuckDB connection torn down without
    # its threads crashes the worker): the parent's garbage is collected here, and each worker
    # freezes what it starts with so that its own collections never look at it.
    gc.collect()
    with ProcessPoolExecutor(max_workers=workers, mp_context=_pool_context(), initializer=_init_worker) as pool:
        pending: set[Future[dict[str, Any]]] = {pool.submit(ingest_file, *job) for job in jobs}
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for fut in done:
                exc = fut.exception()
                if exc is not None:
                    for other in pending:
                        other.cancel()
                    raise exc
                results.append(fut.result())
                if progress:
                    progress(len(results), total)
    return results


def ingest_kineto(
    src: Path | str,
    out: Path | str,
    *,
    mesh: dict[str, int] | None = None,
    workers: int | None = None,
    progress: Progress | None = None,
) -> IngestResult:
    """Import torch.profiler traces under ``src`` (a file or a directory) as the run ``out``.

    ``mesh`` (``{"tp": 2, "pp": 2, "dp": 2}``) says how ranks are laid out when the process-group
    names do not; ``workers`` caps the parsing processes (default: one per core).
    """
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    check_out_dir(out)
    files = find_trace_files(src)
    headers, warnings = settle_world([_read_header(p, single=len(files) == 1) for p in files])
    world = check_one_job(headers)
    plan = plan_groups([pg for h in headers for pg in h.pgs], world_size=world, mesh=mesh)
    n_workers = max(1, min(len(files), workers or os.cpu_count() or 1))
    log.info("ingesting %d Kineto traces of a %d-rank job with %d workers", len(files), world, n_workers)
    with StagedRun(out) as stage:
        jobs = [(str(h.path), h.rank, str(stage.path), _pg_groups(h, plan), stage.run_id) for h in headers]
        results = _run_files(jobs, n_workers, progress)
        by_rank = {h.rank: h for h in headers}
        infos: dict[int, RankInfo] = {}
        not_imported: Counter[str] = Counter()
        not_imported_ranks: Counter[str] = Counter()
        for r in results:
            h = by_rank[r["rank"]]
            dev = r["device_index"]
            infos[r["rank"]] = RankInfo(
                rank=r["rank"],
                host=h.host or "unknown",
                local_rank=dev,
                pid=r["pid"],
                device=f"cuda:{dev}" if dev is not None else "cpu",
                device_name=h.device_names.get(dev) if dev is not None else None,
                start_ns=r["start_ns"],
            )
            for what, count in r["stats"].items():
                if what not in ("spans", "markers") and count:
                    log.info("rank %d: %d %s", r["rank"], count, what)
                    if "skipped" in what or "no execution" in what:
                        not_imported[what] += count
                        not_imported_ranks[what] += 1
        check_one_window(results)
        # Events the mapping could not place are counted in the summary, never dropped without a word.
        for what, count in sorted(not_imported.items()):
            warnings.append(f"{count} {what.replace(' (skipped)', '')} not imported "
                            f"({not_imported_ranks[what]} of {len(results)} ranks)")
        for r in results:
            if r["negative_durations"]:
                warnings.append(f"rank {r['rank']}: {r['negative_durations']} events with a negative duration "
                                f"skipped ({Path(r['path']).name})")
        missing = sorted(set(range(world)) - set(infos))
        if missing:
            warnings.append(f"{len(missing)} of {world} ranks have no trace: {', '.join(map(str, missing[:20]))}")
        step_sets = {tuple(r["steps"]) for r in results}
        if len(step_sets) > 1:
            warnings.append("ranks recorded different ProfilerStep numbers; collective sequence numbers may not line up")
        write_rank_tables(stage.path, plan, infos, stage.run_id)
        device_names = {i.device_name for i in infos.values() if i.device_name}
        starts = [i.start_ns for i in infos.values() if i.start_ns is not None]
        meta = RunMeta(
            run_id=stage.run_id,
            source=RunSource.KINETO,
            world_size=world,
            mesh_axes=tuple(plan.mesh_sizes),
            mesh_sizes=plan.mesh_sizes,
            start_ns=min(starts) if starts else None,
            device_name=device_names.pop() if len(device_names) == 1 else None,
            config={
                "ingest": {
                    "files": len(files),
                    "backend": headers[0].backend,
                    "mesh_from": plan.mesh_source,
                    "expected_world_size": world,
                    "missing_ranks": missing,
                    "warnings": warnings,
                }
            },
        )
        layout.write_run_meta(stage.path, meta)
    for w in warnings:
        log.warning(w)
    return IngestResult(
        run_dir=out,
        source=str(RunSource.KINETO),
        world_size=world,
        ranks_found=sorted(infos),
        missing_ranks=missing,
        files=len(files),
        events=sum(r["events"] for r in results),
        spans=sum(r["spans"] for r in results),
        markers=sum(r["markers"] for r in results),
        seconds=time.perf_counter() - t0,
        mesh=dict(plan.mesh_sizes),
        warnings=warnings,
    )
