"""The runs a dashboard serves: ids, live refresh and a per-run cache of analysis results.

Role in the data flow: sits between the store and the pages. Each served run directory gets a short
id (URLs carry ids, never paths, so nothing a browser sends reaches the file system); a watcher
thread notices new part files of a live run and refreshes its DuckDB views; every analysis result a
page needs is computed once per *generation* (one generation per distinct set of part files) and
shared by all callbacks and ``/metrics``.

Noticing new parts is cheap at 12,288 ranks: a part is renamed into ``spans/rank=N/``, which
changes that directory's mtime, so a poll stats the partition directories and lists nothing.

Refreshing is not: the views and the analyses look at every file of the run, so on a big live run
a refresh takes longer than the job takes to write the next parts, and longer as the run grows.
Two things keep the dashboard live there. A second thread follows the step sums of each run
that wrote while served, in the last five minutes (:class:`megascope.live.StepSumsTail`: what
each rank appended to its step log since the last look, one read per rank; or, for a run without
step logs, the new twins, at most each rank's two newest per update), and bumps the run's
``live_generation``: the overview shows those steps (step time, MFU), and the heat-map page a map
of them, before the analyses reach them. And the full refresh takes at most ``full_share`` of
the time: after a refresh and its precomputed results took D seconds, the next waits
D x (1 / full_share - 1) seconds (a refresh of a small run, milliseconds, waits for nothing); the
follower paces itself the same way.

Example::

    registry = RunRegistry([Path("runs/demo")])
    served = registry.get("demo")
    frame = served.result(("mfu",), lambda run: analysis.mfu(run))
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import duckdb

from megascope import layout
from megascope.errors import ConfigError, RunDirError
from megascope.live import StepSumsTail
from megascope.schema import TABLES
from megascope.store import Run, open_run

log = logging.getLogger(__name__)

T = TypeVar("T")

_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
# Tables whose new parts mean the job made progress (heartbeats keep coming during a hang).
_PROGRESS_TABLES = frozenset({"spans", "markers", "metrics"})
# A directory written to this recently may still change within the same mtime tick; look again.
_SETTLE_NS = 2_000_000_000
# Steps the follower keeps (the overview shows those beyond the analyses' last step); and, per
# update, the newest parts read per rank (one flush may hold the end of one step and the next).
FOLLOW_STEPS = 64
# A run that wrote nothing new for this long is not followed (until it writes again).
_FOLLOW_IDLE_NS = 300 * 1_000_000_000


def run_id_for(path: Path, taken: Iterable[str]) -> str:
    """A URL-safe id from the directory name, unique among ``taken``."""
    base = _ID_UNSAFE.sub("-", path.resolve().name).strip("-") or "run"
    taken = set(taken)
    candidate, n = base, 2
    while candidate in taken:
        candidate, n = f"{base}-{n}", n + 1
    return candidate


def _stat_mtime(path: Path) -> int | None:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _forget_outgrown_problems(run: Run) -> None:
    """Drop what a live run has outgrown since it was opened: "no data written yet" once parts
    exist, "ranks wrote no spans or markers" once every rank has (a starting job's ranks write
    their first parts seconds apart)."""
    written = run.ranks_written(("spans", "markers"))
    everyone = all(r in written for r in range(run.meta.world_size))
    run.problems[:] = [p for p in run.problems
                       if not (p.endswith("no data written yet") and written)
                       and not ("ranks wrote no spans or markers" in p and everyone)]


@dataclass(frozen=True)
class _Failed:
    error: Exception


@dataclass
class ServedRun:
    """One served run directory. ``run`` is None until its ``run.json`` exists (a job starting up)."""

    id: str
    path: Path
    run: Run | None = None
    generation: int = 0
    error: str | None = None  # why the run cannot be opened right now, for the page to say
    last_change_s: float = field(default_factory=time.monotonic)
    # Wall clock when a poll last saw new spans, markers or metrics arrive, or the follower new
    # steps (None: not while served). It bounds the run state's idle time, whatever the job's
    # host clocks say.
    progress_seen_ns: int | None = None
    # Wall clock of the file listing the views (and so the analyses) were last built from.
    refreshed_ns: int | None = None
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _cache: dict[tuple[Any, ...], tuple[int, Any]] = field(default_factory=dict, repr=False)
    _mtimes: dict[Path, int] = field(default_factory=dict, repr=False)
    _subdirs: dict[Path, tuple[int, list[Path]]] = field(default_factory=dict, repr=False)
    _settling: bool = field(default=False, repr=False)
    _last_poll_s: float = field(default=0.0, repr=False)
    # The run's step sums followed file by file (megascope.live), and its own generation.
    tail: StepSumsTail | None = field(default=None, repr=False)
    live_generation: int = 0
    _tail_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _live_cache: dict[tuple[Any, ...], tuple[int, Any]] = field(default_factory=dict, repr=False)
    # When the throttled full refresh may run next (monotonic seconds; see RunRegistry).
    _next_full_s: float = field(default=0.0, repr=False)
    # Why the views could not be refreshed, while that lasts: the pages then show the views of the
    # last refresh that worked (refreshed_ns), and the header says so.
    refresh_error: str | None = None

    # ---------------------------------------------------------------- following the step sums

    def follow(self) -> bool:
        """Read the step sums written since the last call; True (and ``live_generation`` bumped)
        when they hold steps. Never takes the run's lock: it goes on while an analysis runs."""
        if self.run is None:
            return False
        with self._tail_lock:
            try:
                if self.tail is None:
                    self.tail = StepSumsTail(self.path, window_steps=FOLLOW_STEPS, backfill=2, most_new=2)
                update = self.tail.update()
            except (OSError, RunDirError) as exc:
                log.info("run %s: step sums not followed: %s", self.id, exc)
                return False
            if not update.steps:
                return False
            # New steps are progress: between two full refreshes (minutes apart on a big run)
            # the run state must not read a job that is writing as stalled, hung or failed.
            self.progress_seen_ns = time.time_ns()
            self.live_generation += 1
            return True

    def live_steps(self) -> Any:
        """The followed steps: ``step, step_time_ns, ranks, mfu, tokens_per_s`` (empty before
        :meth:`follow` found any)."""
        with self._tail_lock:
            return self.tail.per_step() if self.tail is not None else None

    def live_result(self, key: tuple[Any, ...], compute: Callable[[Any], T]) -> T | None:
        """``compute(rank_step)`` of the followed steps (:meth:`StepSumsTail.rank_step`), once per
        ``live_generation`` and ``key``; None before :meth:`follow` found any."""
        with self._tail_lock:
            if self.tail is None:
                return None
            hit = self._live_cache.get(key)
            if hit is not None and hit[0] == self.live_generation:
                return hit[1]  # type: ignore[no-any-return]
            generation, frame = self.live_generation, self.tail.rank_step()
        value = compute(frame)
        with self._tail_lock:
            self._live_cache[key] = (generation, value)
        return value

    # ---------------------------------------------------------------- live refresh

    def _fingerprint(self) -> dict[Path, int]:
        """mtime of run.json, each table directory and each partition directory."""
        marks: dict[Path, int] = {}
        meta = _stat_mtime(self.path / layout.RUN_JSON)
        if meta is not None:
            marks[self.path / layout.RUN_JSON] = meta
        for table in TABLES:
            base = self.path / table
            base_mtime = _stat_mtime(base)
            if base_mtime is None:
                continue
            marks[base] = base_mtime
            if table in layout.SINGLE_FILE_TABLES or table in layout.UNPARTITIONED:
                continue
            # List partition directories only when one was added (the base's mtime moved).
            known = self._subdirs.get(base)
            if known is None or known[0] != base_mtime:
                subdirs = sorted(Path(e.path) for e in os.scandir(base) if e.is_dir() and "=" in e.name)
                self._subdirs[base] = (base_mtime, subdirs)
            for sub in self._subdirs[base][1]:
                mtime = _stat_mtime(sub)
                if mtime is not None:
                    marks[sub] = mtime
        # A compaction commits by writing a manifest there (and gives the part directories back
        # their mtimes when it removes merged parts): a change, not progress of the job.
        for table in TABLES:
            compacted = layout.compacted_dir(self.path, table)
            mtime = _stat_mtime(compacted)
            if mtime is not None:
                marks[compacted] = mtime
        return marks

    def poll(self) -> bool:
        """Look for new data; refresh the views and bump the generation if there is any."""
        with self._lock:
            now_ns = time.time_ns()
            marks = self._fingerprint()
            changed = marks != self._mtimes or self._settling
            self._settling = any(now_ns - m < _SETTLE_NS for m in marks.values())
            if not changed and self.run is not None:
                return False
            if self._mtimes and any(marks.get(p) != self._mtimes.get(p) for p in marks
                                    if (p.parent.name in _PROGRESS_TABLES or p.name in _PROGRESS_TABLES)
                                    and p.parent.name != layout.COMPACTED_DIR):
                self.progress_seen_ns = now_ns
            before, self._mtimes = self._mtimes, marks
            try:
                changed = self._reopen(now_ns)
            except BaseException as exc:
                self._mtimes = before  # the next poll tries again, whatever else changed by then
                self.refresh_error = (str(exc).splitlines() or [type(exc).__name__])[0]
                raise
            self.refresh_error = None
            return changed

    def _reopen(self, now_ns: int) -> bool:
        """Open the run, or refresh its views; True when they were (re)built."""
        if self.run is None:
            if (self.path / layout.RUN_JSON).exists():
                try:
                    self.run = open_run(self.path)
                    self.error = None
                except RunDirError as exc:
                    self.error = str(exc)
                    return False
            else:
                self.error = f"{self.path.name}: waiting for the job to write run.json"
                return False
        else:
            for problem in self.run.refresh():
                log.warning("%s", problem)
            _forget_outgrown_problems(self.run)
        self.refreshed_ns = now_ns
        self.generation += 1
        self.last_change_s = time.monotonic()
        self._cache = {k: v for k, v in self._cache.items() if v[0] == self.generation}
        log.debug("run %s: generation %d", self.id, self.generation)
        return True

    # ---------------------------------------------------------------- results

    def result(self, key: tuple[Any, ...], compute: Callable[[Run], T]) -> T:
        """``compute(run)`` once per generation and ``key``; callers on other threads wait and share.

        DuckDB work for one run is serialised: the views change under a refresh, and two cores
        gain nothing from running two analyses of one run at once.
        """
        with self._lock:
            if self.run is None:
                raise RunDirError(self.error or f"{self.path}: no data yet")
            hit = self._cache.get(key)
            if hit is not None and hit[0] == self.generation:
                if isinstance(hit[1], _Failed):
                    raise hit[1].error
                return hit[1]  # type: ignore[no-any-return]
            started = time.perf_counter()
            try:
                try:
                    value = self._compute(compute)
                except duckdb.IOException:
                    # A compaction pass with no grace (a job's last) removed a file the views name
                    # since the last refresh: the rows are in its compacted files, read them there.
                    if self.run.file_gone() is None:
                        raise
                    log.info("run %s: files removed since the last refresh; refreshing before %s", self.id, key)
                    self.run.refresh()
                    value = self._compute(compute)
            except Exception as exc:
                # Remembered for this generation: a failing analysis is not re-run on every view.
                self._cache[key] = (self.generation, _Failed(exc))
                raise
            log.debug("run %s: %s computed in %.3f s", self.id, key, time.perf_counter() - started)
            self._cache[key] = (self.generation, value)
            return value

    def _compute(self, compute: Callable[[Run], T]) -> T:
        assert self.run is not None
        # A fresh cursor per computation: one analysis' half-read result never blocks the next.
        run = self.run.with_cursor()
        try:
            return compute(run)
        finally:
            run.con.close()

    @contextlib.contextmanager
    def locked(self) -> Iterator[Run]:
        """The run, with its DuckDB connection to the caller alone (an export of a selection)."""
        with self._lock:
            if self.run is None:
                raise RunDirError(self.error or f"{self.path}: no data yet")
            run = self.run.with_cursor()
            try:
                yield run
            finally:
                run.con.close()

    def cached(self, key: tuple[Any, ...]) -> Any | None:
        """The result for ``key`` of the current generation if already computed (never computes)."""
        with self._lock:
            hit = self._cache.get(key)
            return hit[1] if hit is not None and hit[0] == self.generation else None


class RunRegistry:
    """The run directories one dashboard serves, by id; a watcher thread keeps live runs fresh.

    ``wait=True`` accepts directories that hold no run yet (``megascope demo`` serves a run before
    the job has written anything); otherwise each directory must open now, so a typo fails at
    start-up with one line instead of a blank page.
    """

    def __init__(self, run_dirs: Sequence[Path | str], *, wait: bool = False, poll_interval_s: float = 2.0,
                 idle_interval_s: float = 30.0, compact_every_s: float | None = None,
                 full_share: float = 0.5) -> None:
        if not run_dirs:
            raise ConfigError("no run directories to serve")
        if poll_interval_s <= 0:
            raise ConfigError(f"poll interval must be > 0, got {poll_interval_s}")
        if not 0 < full_share <= 1:
            raise ConfigError(f"full_share must be in (0, 1], got {full_share}")
        # The share of the time the full refresh (views and precomputed results) may take.
        self.full_share = full_share
        if compact_every_s is not None and compact_every_s <= 0:
            raise ConfigError(f"compaction period must be > 0, got {compact_every_s}")
        self.poll_interval_s = poll_interval_s
        # Off by default: compacting writes into the served run directories.
        self.compact_every_s = compact_every_s
        self._compacting: dict[str, threading.Thread] = {}
        self._compacted_at: dict[str, float] = {}
        self._no_compaction: set[str] = set()
        self.idle_interval_s = max(idle_interval_s, poll_interval_s)
        self._runs: dict[str, ServedRun] = {}
        self._warmers: list[Callable[[ServedRun], Any]] = []
        seen_paths: set[Path] = set()
        for raw in run_dirs:
            path = Path(raw).resolve()
            if path in seen_paths:
                continue
            seen_paths.add(path)
            if path.exists() and not path.is_dir():
                raise RunDirError(f"{raw}: not a directory")
            if not path.exists() and not wait:
                raise RunDirError(f"{raw}: no such run directory")
            served = ServedRun(id=run_id_for(path, self._runs), path=path)
            if not wait:
                served.refreshed_ns = time.time_ns()
                served.run = open_run(path)
                for problem in served.run.problems:
                    log.warning("%s", problem)
                served._mtimes = served._fingerprint()
                served.generation = 1
            else:
                served.poll()
            self._runs[served.id] = served
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._follower: threading.Thread | None = None

    # ---------------------------------------------------------------- lookup

    @property
    def ids(self) -> list[str]:
        return list(self._runs)

    def __iter__(self) -> Any:
        return iter(self._runs.values())

    def __len__(self) -> int:
        return len(self._runs)

    def get(self, run_id: str | None) -> ServedRun | None:
        """The run with this id, or None: an unknown id is never turned into a path."""
        if run_id is None:
            return None
        return self._runs.get(run_id)

    # ---------------------------------------------------------------- warming and watching

    def add_warmer(self, fetch: Callable[[ServedRun], Any]) -> None:
        """A result the watcher fetches after each refresh, so the next page view is a cache hit."""
        self._warmers.append(fetch)

    def warm(self, served: ServedRun) -> None:
        if served.run is None:
            return
        for fetch in self._warmers:
            if self._stop.is_set():
                return
            try:
                fetch(served)
            except Exception as exc:  # noqa: BLE001 - a page will show the error; the watcher goes on
                log.info("run %s: warming %s failed: %s", served.id, getattr(fetch, "__name__", fetch), exc)

    def poll_all(self) -> list[str]:
        """Poll every run once; the ids of those that changed. A run whose last refresh ended
        less than its throttle ago (see the module's doc) waits for a later poll."""
        now = time.monotonic()
        return self._poll([served for served in self._runs.values() if now >= served._next_full_s])

    def _poll(self, runs: Iterable[ServedRun]) -> list[str]:
        changed = []
        for served in runs:
            idle = time.monotonic() - served.last_change_s > 300
            # A run untouched for minutes is probably finished: look less often.
            if idle and time.monotonic() - served._last_poll_s < self.idle_interval_s:
                continue
            served._last_poll_s = time.monotonic()
            try:
                if served.poll():
                    changed.append(served.id)
            except Exception as exc:  # noqa: BLE001 - the watcher serves every run; it must not die
                log.warning("run %s: refresh failed, tried again next poll: %s", served.id,
                            str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return changed

    def _watch(self) -> None:
        for served in self._runs.values():
            self.warm(served)
        while not self._stop.wait(self.poll_interval_s):
            for served in list(self._runs.values()):
                if time.monotonic() < served._next_full_s:
                    continue
                started = time.monotonic()
                if self._poll([served]):
                    self.warm(served)
                    took = time.monotonic() - started
                    served._next_full_s = time.monotonic() + took * (1.0 / self.full_share - 1.0)
            self.compact_due()

    def _follow(self) -> None:
        pause = self.poll_interval_s
        while not self._stop.wait(pause):
            started = time.monotonic()
            for served in self._runs.values():
                if self._stop.is_set():
                    return
                # Only runs that wrote while served, in the last five minutes: a finished run's
                # analyses have every step already.
                seen = served.progress_seen_ns
                if seen is None or time.time_ns() - seen > _FOLLOW_IDLE_NS:
                    continue
                try:
                    served.follow()
                except Exception as exc:  # noqa: BLE001 - the full refresh still serves the run
                    log.warning("run %s: following its step sums failed: %s", served.id, exc)
            # At most full_share of the time here too: a follower slower than the job reads
            # each rank's newest parts only (most_new) and shows fewer of the steps.
            pause = max(self.poll_interval_s, (time.monotonic() - started) * (1.0 / self.full_share - 1.0))

    # ---------------------------------------------------------------- compaction (opt-in)

    def compact_due(self) -> list[str]:
        """Start a compaction pass, in a thread of its own, for each run whose period is up.

        A live pass (megascope.compact): parts older than a minute, never a rank's two newest;
        replaced parts stay until well after the watcher's next refresh. The watcher notices the
        commit by ``compacted/`` and refreshes the views. Returns the ids of the runs started."""
        if self.compact_every_s is None:
            return []
        started = []
        now = time.monotonic()
        for served in self._runs.values():
            if served.run is None or served.id in self._no_compaction:
                continue
            running = self._compacting.get(served.id)
            if running is not None and running.is_alive():
                continue
            if now - self._compacted_at.get(served.id, -float("inf")) < self.compact_every_s:
                continue
            self._compacted_at[served.id] = now
            thread = threading.Thread(target=self._compact, args=(served,), name=f"megascope-compact-{served.id}",
                                      daemon=True)
            self._compacting[served.id] = thread
            thread.start()
            started.append(served.id)
        return started

    def wait_compactions(self, timeout: float | None = None) -> None:
        for thread in list(self._compacting.values()):
            thread.join(timeout)

    def _compact(self, served: ServedRun) -> None:
        from megascope.compact import (
            DEFAULT_GRACE_S,
            DEFAULT_KEEP_NEWEST,
            DEFAULT_MIN_AGE_S,
            CompactionBusy,
            compact,
        )

        try:
            result = compact(served.path, min_age_s=DEFAULT_MIN_AGE_S, keep_newest=DEFAULT_KEEP_NEWEST,
                             grace_s=max(DEFAULT_GRACE_S, 10 * self.poll_interval_s))
        except CompactionBusy:
            return  # someone else's pass (the nodes' own, say): try again next period
        except Exception as exc:  # noqa: BLE001 - a thread of its own: its error is logged, never raised
            self._no_compaction.add(served.id)
            log.warning("run %s: not compacted, compaction off for it (%s)", served.id, exc)
            return
        if result.parts_merged:
            log.info("run %s: compacted %d parts into %d files in %.1f s", served.id, result.parts_merged,
                     result.files_written, result.seconds)

    def start(self) -> None:
        """Start the watcher thread (a daemon: it never keeps the process alive)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="megascope-watch", daemon=True)
            self._thread.start()
            self._follower = threading.Thread(target=self._follow, name="megascope-follow", daemon=True)
            self._follower.start()

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stop.set()
        for thread in (self._thread, self._follower):
            if thread is not None:
                thread.join(timeout)
        self._thread = self._follower = None
