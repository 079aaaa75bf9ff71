"""Follow a live run's step sums: each new twin read once, the per-(rank, step) sums of the newest
steps kept in memory.

Role in the data flow: a reader beside the store, for a viewer of a job that is still writing (the
dashboard's live refresh). The store's views and the analysis' base tables answer every question
about a run, but each refresh of them looks at every file the run holds: at 12,288 ranks writing a
part per rank per second that is ~37,000 more files each second, and the refresh falls behind for
good. This reader's work per refresh follows the new files only:

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

from megascope import layout
from megascope.store import read_meta

log = logging.getLogger(__name__)

# A directory written to this recently may still change within the same mtime tick; look again.
_SETTLE_NS = 2_000_000_000
# Kept per (rank, step): how rows of one (rank, step) from several twins combine.
_COMBINE = {
    "step_ns": "max", "step_start_ns": "min", "first_start_ns": "min", "last_end_ns": "max",
    "forward_ns": "sum", "backward_ns": "sum", "optimizer_ns": "sum", "compute_ns": "sum", "data_ns": "sum",
    "host_ns": "sum", "coll_ns": "sum", "recv_ns": "sum", "send_ns": "sum", "spans": "sum",
}
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
                 most_new: int | None = None, threads: int | None = None) -> None:
        if window_steps < 1 or backfill < 1 or (most_new is not None and most_new < 1):
            raise ValueError(f"window_steps, backfill and most_new must be >= 1, got {window_steps}, {backfill} "
                             f"and {most_new}")
        self.path = Path(run_dir)
        self.meta = read_meta(self.path)
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
        rows = self._con.execute(
            "SELECT file_name, decode(value) FROM parquet_kv_metadata(?) WHERE decode(key) = ?",
            [files, layout.RUN_ID_KEY.decode()]).fetchall()
        return {str(name) for name, run_id in rows if run_id != self.meta.run_id}

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
            problem = f"{f}: {why}; skipped"
            if problem not in self.problems:
                self.problems.append(problem)
                log.info(problem)
        return frame if frame is not None else pd.DataFrame(columns=["rank", "step", *_COMBINE])

    def update(self) -> UpdateStats:
        """Read the twins written since the last update; returns what it did."""
        stats = UpdateStats()
        t0 = time.perf_counter()
        files = self._new_files(stats)
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
