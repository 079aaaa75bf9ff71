"""Follow a live run's step sums: what each rank appended to its step log since the last look (or
each new twin, once), the per-(rank, step) sums of the newest steps kept in memory.

Role in the data flow: a reader beside the store, for a viewer of a job that is still writing (the
dashboard's live refresh). The store's views and the analysis' base tables answer every question
about a run, but each refresh of them looks at every file the run holds: at 12,288 ranks writing a
part per rank per second that is ~37,000 more files each second, and the refresh falls behind for
good. This reader's work per refresh follows what is new only.

**Step logs** (:mod:`megascope.steplog`), where the run's writers keep them (the collector does):
one ``pread`` per rank from the offset read so far, whole records only, at most ``window_steps * 4``
records a log a look (``most_new * 64`` where given; a reader behind the job skips to the newest);
a log found at the first update is read from its newest ``backfill`` records (a record is a step of
a flush). The folder is the run id's, so another run's logs are never read; a file that is not a
log of this layout is named in :attr:`StepSumsTail.problems` and skipped.

**Twins**, for runs without logs (older writers, importers; chosen once, at the first update that
finds either, ``source`` to force one):

* **listing**: one ``stat`` per rank partition of ``step_sums/`` and a directory scan of those whose
  modification time moved (or that changed in the last two seconds, within the clock's tick); the
  names already read are remembered per partition (a part's name is unique), so a scan finds the
  new ones without opening a file;
* **reading**: only the new twins (``step_sums/rank=N/part-*.parquet``, the per-(rank, step,
  group) sums every writer of spans writes beside each spans part), in one DuckDB scan of the
  columns kept, summed per (rank, step); rows of a (rank, step) that crossed a flush combine
  by SUM, MIN and MAX, as the analysis combines them;
* **keeping up**: with ``most_new``, at most that many new parts per rank partition are read per
  update, the newest: a reader slower than the job skips steps (their parts are never read)
  rather than falling further behind at every update; the newest step of every rank is read
  within one update's time. The analyses still read every part, later;
* **keeping**: the newest ``window_steps`` steps, so memory and the per-step answers stay bounded
  whatever the run's length. A run joined late is read from its newest ``backfill`` parts per
  rank on (part names sort by their writing time); a rank partition that appears later is read
  whole.

Twins stamped with another run's id are skipped and named in :attr:`StepSumsTail.problems`, as the
store does; so is a twin DuckDB cannot read (the others of the refresh are read one by one then).
Compaction removing merged twins changes nothing here: what was read stays summed.

What it gives: per step, the step time (median over the ranks of their step span, as
``megascope.analysis.mfu``), MFU and tokens/s from ``run.json``; per (rank, step), the step
time, compute, communication and data times for a live rank x step view. The collective wait
(own time) needs every rank's spans, not their sums: the full analysis still answers that, at its
own pace.

Example::

    from megascope.live import StepSumsTail
    tail = StepSumsTail("runs/job-1234")
    update = tail.update()          # UpdateStats(dirs_listed=..., files_read=..., ...)
    tail.per_step()                 # step, step_time_ns, ranks, mfu, tokens_per_s
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd

from megascope import layout, steplog
from megascope.store import read_meta, stamped_run_ids

log = logging.getLogger(__name__)

# A directory written to this recently may still change within the same mtime tick; look again.
_SETTLE_NS = 2_000_000_000
_SOURCES = ("auto", "log", "twins")
# Kept per (rank, step): how rows of one (rank, step) from several twins combine.
_COMBINE = {f: how for f, how in steplog.COMBINE.items() if how != "key"}
_SQL_AGG = {"max": "max", "min": "min", "sum": "sum"}


@dataclass
class UpdateStats:
    """What one :meth:`StepSumsTail.update` did."""

    dirs_listed: int = 0
    files_read: int = 0
    files_skipped: int = 0  # new parts left unread (``most_new``)
    rows: int = 0
    steps: list[int] = field(default_factory=list)  # steps that got new rows
    list_s: float = 0.0
    check_s: float = 0.0  # of read_s: the run ids in the new twins' metadata
    read_s: float = 0.0
    merge_s: float = 0.0


class StepSumsTail:
    """The newest ``window_steps`` steps of a live run's per-(rank, step) sums, extended by the
    twins written since the last :meth:`update`."""

    def __init__(self, run_dir: Path | str, *, window_steps: int = 400, backfill: int = 8,
                 most_new: int | None = None, threads: int | None = None, source: str = "auto") -> None:
        if window_steps < 1 or backfill < 1 or (most_new is not None and most_new < 1):
            raise ValueError(f"window_steps, backfill and most_new must be >= 1, got {window_steps}, {backfill} "
                             f"and {most_new}")
        if source not in _SOURCES:
            raise ValueError(f"source must be one of {', '.join(_SOURCES)}, got {source!r}")
        self.path = Path(run_dir)
        self.meta = read_meta(self.path)
        # "log" or "twins" once chosen; "auto" chooses at the first update that finds either.
        self.source = source
        self._log_dir = str(steplog.log_dir(self.path, self.meta.run_id)) if self.meta.run_id else None
        self._log_mtime: int | None = None
        self._log_names: list[str] = []
        self._offsets: dict[str, int] = {}  # log name -> bytes read; -1: a log this reader cannot read
        self.window_steps = window_steps
        self.backfill = backfill
        self.most_new = most_new
        self._updated = False  # partitions found by the first update are read from their newest parts
        self.problems: list[str] = []
        self._base = self.path / layout.STEP_SUMS_DIR
        self._base_mtime: int | None = None
        self._rank_dirs: list[str] = []
        self._listed: dict[str, tuple[int, frozenset[str]]] = {}
        self._by_step: dict[int, pd.DataFrame] = {}
        self._con = duckdb.connect(config={"threads": threads} if threads else {})
        self._con.execute("SET enable_progress_bar = false")

    def close(self) -> None:
        self._con.close()

    # ---------------------------------------------------------------- listing

    def _new_files(self, stats: UpdateStats) -> list[str]:
        try:
            base_mtime = os.stat(self._base).st_mtime_ns
        except OSError:
            return []
        now = time.time_ns()
        if base_mtime != self._base_mtime or now - base_mtime < _SETTLE_NS:
            self._rank_dirs = sorted(e.name for e in os.scandir(self._base)
                                     if e.name.startswith("rank=") and e.is_dir())
            self._base_mtime = base_mtime
        new: list[str] = []
        for name in self._rank_dirs:
            where = os.path.join(self._base, name)
            try:
                mtime = os.stat(where).st_mtime_ns
            except OSError:
                continue
            known = self._listed.get(name)
            if known is not None and known[0] == mtime and now - mtime >= _SETTLE_NS:
                continue
            try:
                names = frozenset(e.name for e in os.scandir(where)
                                  if e.name.endswith(".parquet") and not e.name.startswith("."))
            except OSError:
                continue
            stats.dirs_listed += 1
            if known is not None:
                fresh = sorted(names - known[1])
            else:
                fresh = sorted(names)[-self.backfill:] if not self._updated else sorted(names)
            if self.most_new is not None and len(fresh) > self.most_new:
                stats.files_skipped += len(fresh) - self.most_new
                fresh = fresh[-self.most_new:]
            new.extend(os.path.join(where, n) for n in fresh)
            self._listed[name] = (mtime, names)
        return new

    # ---------------------------------------------------------------- reading

    def _foreign(self, files: list[str]) -> set[str]:
        """The twins among ``files`` stamped with another run's id."""
        return {str(name) for name, run_id in stamped_run_ids(self._con, files).items() if run_id != self.meta.run_id}

    def _read(self, files: list[str], stats: UpdateStats) -> pd.DataFrame:
        columns = ", ".join(f'{_SQL_AGG[how]}("{c}") AS "{c}"' for c, how in _COMBINE.items())
        sql = (f"SELECT rank, step, {columns} FROM read_parquet(?, hive_partitioning=false) "
               "WHERE step IS NOT NULL GROUP BY rank, step")
        try:
            started = time.perf_counter()
            foreign = self._foreign(files)
            stats.check_s = time.perf_counter() - started
            good = [f for f in files if f not in foreign]
            bad = [(f, "a part of another run") for f in foreign]
            frame = self._con.execute(sql, [good]).df() if good else None
        except duckdb.Error:
            # One unreadable twin fails the whole scan: read them one by one, skip and name it.
            frames, bad = [], []
            for f in files:
                try:
                    if self._foreign([f]):
                        bad.append((f, "a part of another run"))
                        continue
                    frames.append(self._con.execute(sql, [[f]]).df())
                except duckdb.Error as exc:
                    bad.append((f, (str(exc).strip().splitlines() or [type(exc).__name__])[0]))
            frame = pd.concat(frames, ignore_index=True) if frames else None
        for f, why in bad:
            self._problem(f, why)
        return frame if frame is not None else _empty()

    def _choose(self) -> str:
        """The source to read: the run's step logs where its writers keep them, else the twins.
        Chosen once, at the first update that finds either (reading both would count steps twice):
        a writer makes its log folder before the first twin that has a record there."""
        if self.source == "auto":
            if self._log_dir is not None and os.path.isdir(self._log_dir):
                self.source = "log"
            elif os.path.isdir(self._base):
                self.source = "twins"
        return self.source

    # ---------------------------------------------------------------- step logs

    def _read_logs(self, stats: UpdateStats) -> pd.DataFrame:
        """The records appended to the run's step logs since the last update (one ``pread`` a log)."""
        where = self._log_dir
        assert where is not None
        t0 = time.perf_counter()
        try:
            mtime = os.stat(where).st_mtime_ns
        except OSError:
            return _empty()
        if mtime != self._log_mtime or time.time_ns() - mtime < _SETTLE_NS:
            self._log_names = sorted(e.name for e in os.scandir(where) if e.name.endswith(".steps"))
            self._log_mtime = mtime
            stats.dirs_listed += 1
        stats.list_s = time.perf_counter() - t0
        # A reader behind the job reads each log's newest records only, as ``most_new`` parts.
        most = self.window_steps * 4 if self.most_new is None else max(self.most_new * 64, 64)
        chunks: list[bytes] = []
        for name in self._log_names:
            offset = self._offsets.get(name)
            if offset == -1:
                continue
            path = os.path.join(where, name)
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                if offset is None:
                    why = steplog.check_header(os.pread(fd, steplog.HEADER_SIZE, 0))
                    if why == "no header yet":
                        continue
                    if why is not None:
                        self._problem(path, why)
                        self._offsets[name] = -1
                        continue
                    # A log found at the first update is read from its newest records on.
                    offset = self._seek_newest(fd, self.backfill if not self._updated else None)
                data = os.pread(fd, most * steplog.RECORD_SIZE, offset)
                if len(data) == most * steplog.RECORD_SIZE:  # perhaps more: skip to the newest
                    newest = self._seek_newest(fd, most)
                    if newest > offset:
                        stats.files_skipped += 1
                        offset = newest
                        data = os.pread(fd, most * steplog.RECORD_SIZE, offset)
            except OSError:
                continue
            finally:
                os.close(fd)
            whole = len(data) - len(data) % steplog.RECORD_SIZE
            self._offsets[name] = offset + whole
            if whole:
                chunks.append(data[:whole])
        stats.files_read = len(chunks)
        records = steplog.parse(b"".join(chunks))
        frame = pd.DataFrame({f: records[:, i] for i, f in enumerate(steplog.FIELDS)})
        for f, how in steplog.COMBINE.items():
            if how == "key":
                continue
            column = frame[f]
            null = column.to_numpy() == steplog.NULL
            if how == "sum":  # as the twins' SUMs read: float
                frame[f] = column.astype("float64").mask(null)
            elif null.any():  # timestamps: nullable integers, exact
                frame[f] = pd.arrays.IntegerArray(column.to_numpy(), null)
        return frame

    @staticmethod
    def _seek_newest(fd: int, records: int | None) -> int:
        """The offset of the newest ``records`` whole records of a log (all of them for None)."""
        size = os.fstat(fd).st_size
        count = (size - steplog.HEADER_SIZE) // steplog.RECORD_SIZE
        keep = count if records is None else min(count, records)
        return steplog.HEADER_SIZE + (count - keep) * steplog.RECORD_SIZE

    def _problem(self, path: str, why: str) -> None:
        problem = f"{path}: {why}; skipped"
        if problem not in self.problems:
            self.problems.append(problem)
            log.info(problem)

    def update(self) -> UpdateStats:
        """Read what was written since the last update (step logs or twins); returns what it did."""
        stats = UpdateStats()
        source = self._choose()
        if source == "log":
            t1 = time.perf_counter()
            fresh = self._read_logs(stats)
            self._updated = True
            stats.read_s = time.perf_counter() - t1 - stats.list_s
            stats.rows = len(fresh)
            if fresh.empty:
                return stats
        else:
            t0 = time.perf_counter()
            files = self._new_files(stats) if source == "twins" else []
            self._updated = True
            stats.list_s = time.perf_counter() - t0
            if not files:
                return stats
            t1 = time.perf_counter()
            fresh = self._read(files, stats)
            stats.read_s = time.perf_counter() - t1
            stats.files_read, stats.rows = len(files), len(fresh)
        t2 = time.perf_counter()
        for step, rows in fresh.groupby("step", sort=True):
            step = int(step)
            old = self._by_step.get(step)
            if old is not None:
                rows = pd.concat([old, rows], ignore_index=True).groupby(["rank", "step"], as_index=False).agg(_COMBINE)
            self._by_step[step] = rows.sort_values("rank", ignore_index=True)
            stats.steps.append(step)
        for step in sorted(self._by_step)[:-self.window_steps]:
            del self._by_step[step]
        stats.merge_s = time.perf_counter() - t2
        return stats

    # ---------------------------------------------------------------- answers

    def steps(self) -> list[int]:
        return sorted(self._by_step)

    def rank_step(self) -> pd.DataFrame:
        """One row per (rank, step) of the kept steps: step_ns, first_start_ns, last_end_ns,
        compute_ns (forward, backward, optimizer and other compute), comm_ns (collectives and
        pipeline transfers), data_ns, host_ns, spans."""
        if not self._by_step:
            return pd.DataFrame(columns=["rank", "step", "step_ns", "first_start_ns", "last_end_ns", "compute_ns",
                                         "comm_ns", "data_ns", "host_ns", "spans"])
        frame = pd.concat([self._by_step[s] for s in sorted(self._by_step)], ignore_index=True)
        compute = frame[["forward_ns", "backward_ns", "optimizer_ns", "compute_ns"]].sum(axis=1, min_count=1)
        comm = frame[["coll_ns", "recv_ns", "send_ns"]].sum(axis=1, min_count=1)
        return pd.DataFrame({
            "rank": frame["rank"].astype("int64"), "step": frame["step"].astype("int64"),
            "step_ns": frame["step_ns"], "first_start_ns": frame["first_start_ns"],
            "last_end_ns": frame["last_end_ns"], "compute_ns": compute, "comm_ns": comm,
            "data_ns": frame["data_ns"], "host_ns": frame["host_ns"], "spans": frame["spans"],
        })

    def per_step(self) -> pd.DataFrame:
        """Per kept step: step_time_ns (median over the ranks of their step span), ranks (how many
        wrote one), mfu (NaN without FLOPs and peak in run.json) and tokens_per_s."""
        rows = []
        for step in sorted(self._by_step):
            done = self._by_step[step]["step_ns"].dropna()
            if len(done):
                # Rounded half away from zero, as SQL's median(...)::BIGINT in the analysis.
                rows.append((step, math.floor(np.median(done.to_numpy(dtype=float)) + 0.5), len(done)))
        frame = pd.DataFrame(rows, columns=["step", "step_time_ns", "ranks"])
        seconds = frame["step_time_ns"].astype(float) / 1e9
        meta = self.meta
        if meta.model_flops_per_step and meta.peak_flops_per_device:
            frame["mfu"] = meta.model_flops_per_step / (seconds * meta.world_size * meta.peak_flops_per_device)
        else:
            frame["mfu"] = np.nan
        frame["tokens_per_s"] = (meta.tokens_per_step or np.nan) / seconds
        return frame


def _empty() -> pd.DataFrame:
    return pd.DataFrame(columns=["rank", "step", *_COMBINE])


# Phases a live heat-map can show from the step sums: rank_step() column per phase.
LIVE_PHASES = {"step": "step_ns", "compute": "compute_ns", "comm": "comm_ns", "data": "data_ns"}


def lone_stages(places: pd.DataFrame) -> bool:
    """Whether no pipeline stage of ``places`` (``rank, coords``) has two ranks (a pure pipeline,
    or one rank): no rank has a peer doing the same work, and a comparison within stages says
    nothing."""
    stages = pd.Series([int(c.get("pp", 0)) if isinstance(c, dict) else 0 for c in places["coords"]], dtype="int64")
    return stages.empty or int(stages.value_counts().max()) < 2


def heat_cells(rank_step: pd.DataFrame, places: pd.DataFrame, *, phase: str = "compute",
               max_ranks: int | None = None, max_steps: int | None = None) -> pd.DataFrame:
    """Rank x step cells of ``phase`` from followed step sums (:meth:`StepSumsTail.rank_step`),
    normalised within peers, in the columns of :func:`megascope.analysis.heatmap`.

    ``places``: ``rank, host, coords`` (axis -> index) of every rank. Peers are the ranks of the
    same pipeline stage in the same step, as the analysis' heat-map has them, or every rank in the
    step where no stage has two (``peers``: 'stage' or 'all'); ``norm`` is a rank-step's time over
    its peers' median. Binned to at most ``max_ranks`` x ``max_steps``, each
    cell its bin's worst rank-step (for ``comm``, the furthest from 1 either way: a rank that
    pauses outside its work communicates least, its peers wait for it). What the step sums cannot
    tell (own time, waits, bubbles) is not offered: those need every rank's spans and come with the
    full analysis.
    """
    if phase not in LIVE_PHASES:
        raise ValueError(f"unknown live heat-map phase {phase!r} (known: {', '.join(LIVE_PHASES)})")
    columns = ["rank_bin", "step_bin", "rank", "step", "rank_lo", "rank_hi", "step_lo", "step_hi", "value_ns",
               "norm", "host", "coords", "pp", "dp", "tp", "peers"]
    frame = rank_step[["rank", "step", LIVE_PHASES[phase]]].rename(columns={LIVE_PHASES[phase]: "value_ns"})
    frame = frame.astype({"value_ns": "float64"}).dropna(subset=["value_ns"])
    if frame.empty:
        return pd.DataFrame(columns=columns)
    where = places[["rank", "host", "coords"]].copy()
    for axis in ("pp", "dp", "tp"):
        where[axis] = [int(c.get(axis, 0)) if isinstance(c, dict) else 0 for c in where["coords"]]
    frame = frame.merge(where, on="rank", how="left")
    frame["pp"] = frame["pp"].fillna(0).astype("int64")
    alone = lone_stages(places)
    frame["peers"] = "all" if alone else "stage"
    peers = frame.groupby(["step"] if alone else ["pp", "step"])["value_ns"].transform("median")
    frame["norm"] = frame["value_ns"] / peers.where(peers > 0)
    rank_order = np.sort(frame["rank"].unique())
    step_order = np.sort(frame["step"].unique())
    rank_per_bin = max(1, math.ceil(len(rank_order) / max_ranks)) if max_ranks else 1
    step_per_bin = max(1, math.ceil(len(step_order) / max_steps)) if max_steps else 1
    frame["rank_bin"] = np.searchsorted(rank_order, frame["rank"].to_numpy()) // rank_per_bin
    frame["step_bin"] = np.searchsorted(step_order, frame["step"].to_numpy()) // step_per_bin
    bins = frame.groupby(["rank_bin", "step_bin"])
    bounds = bins.agg(rank_lo=("rank", "min"), rank_hi=("rank", "max"), step_lo=("step", "min"),
                      step_hi=("step", "max")).reset_index()
    # A bin's cell: its rank-step furthest from its peers, up for time spent working; either way for
    # communication, where the rank the others wait for spends the least.
    with np.errstate(divide="ignore"):  # no communication at all: infinitely far, first
        frame["_far"] = np.abs(np.log(frame["norm"])) if phase == "comm" else frame["norm"]
    worst = frame.sort_values(["_far", "rank", "step"], ascending=[False, True, True], na_position="last")
    worst = worst.drop_duplicates(["rank_bin", "step_bin"])
    cells = worst.merge(bounds, on=["rank_bin", "step_bin"])
    return cells.sort_values(["rank_bin", "step_bin"], ignore_index=True)[columns]


def step_lines(tail: StepSumsTail, places: pd.DataFrame, *, after: int | None = None) -> pd.DataFrame:
    """One row per kept step every rank has ended (``ranks`` equal to the run's world size), newer
    than ``after``: what ``megascope watch`` prints. Columns: step, step_time_ns, mfu, ranks,
    slow_rank and slow_x (the rank whose compute is furthest above its stage's median, and by how
    much), quiet_rank and quiet_x (the rank that spent the least in communication against its
    stage's median: the one the others wait for, when a rank pauses outside its work). Where no
    stage has two ranks (:func:`lone_stages`), against the median of every rank instead."""
    columns = ["step", "step_time_ns", "mfu", "ranks", "slow_rank", "slow_x", "quiet_rank", "quiet_x"]
    steps = tail.per_step()
    world = tail.meta.world_size
    steps = steps[steps["ranks"] >= world] if world else steps
    if after is not None:
        steps = steps[steps["step"] > after]
    if steps.empty:
        return pd.DataFrame(columns=columns)
    frame = tail.rank_step()
    frame = frame[frame["step"].isin(steps["step"])]
    out = steps.set_index("step")
    for phase, pick, rank_col, x_col in (("compute", "idxmax", "slow_rank", "slow_x"),
                                          ("comm", "idxmin", "quiet_rank", "quiet_x")):
        cells = heat_cells(frame, places, phase=phase).dropna(subset=["norm"])
        if cells.empty:
            out[rank_col], out[x_col] = pd.NA, np.nan
            continue
        chosen = cells.loc[getattr(cells.groupby("step")["norm"], pick)()].set_index("step")
        out[rank_col] = chosen["rank"].astype("Int64")
        out[x_col] = chosen["norm"].astype(float)
    return out.reset_index()[columns]
