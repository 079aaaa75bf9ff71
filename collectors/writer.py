"""The writer thread: resolves finished spans and writes Parquet parts, atomically, every interval.

Role in the data flow: the last in-job stage. Every ``flush_interval_s`` (and on ``flush()``,
SIGTERM and exit) it

1. turns pending spans whose timer tokens are ready into ``spans`` rows (and, for communication,
   the ``completed`` marker), and pending tensor metrics whose copy has landed into ``metrics`` rows;
2. writes each non-empty table as one new part through :func:`megascope.layout.write_part`
   (temporary name + rename: a reader never sees half a file; a SIGKILL loses at most one interval),
   and after each spans part its per-(rank, step, group) sums, its twin under ``step_sums/``
   (:func:`megascope.layout.write_sums_twin`), which spare the analysis aggregating every span,
   and before the twin those sums per step appended to the rank's step log
   (:class:`megascope.steplog.StepLog`), which live viewers follow with one read per rank;
3. (re)writes the per-rank ``ranks``/``groups`` files and ``run.json`` when they changed.

It runs on its own thread, so markers keep reaching the disk while the training thread is blocked
inside a collective. While the job marks steps, a pass starts at the end of a step whose number is
a multiple of a power of two, K, chosen so that K steps last about the flush interval
(:meth:`Writer.step_ended`): every rank of a synchronous job measures about the same step time and
so picks the same steps (or, across a rounding edge, every other one of them). A pass slows its
rank's training thread, and in a synchronous job the slowest rank of a step sets its pace: passes
at their own moments on every rank would slow almost every step of a large job, passes at the same
steps slow one step in K. Without steps (or while they stall) passes come every interval.

In the background it is paced (:class:`Pacer`): it works in slices of half a millisecond and
sleeps between them, so that it holds the interpreter lock for at most
``writer_duty`` of the time. Unpaced, a pass over a second's spans holds the lock for tens of
milliseconds at a stretch, and a training thread that launches work from Python stops launching for
that long: on a job whose host runs only a few tens of milliseconds ahead of its device, that is
device time lost. An explicit ``flush()`` (and ``close()``) is never paced.

A write that fails (unwritable directory, full disk) is logged, counted and retried at the next
interval with the rows kept in memory up to the buffer capacity; it never raises into the training
loop.

Example::

    writer = Writer(run_dir, rank=0, sink=sink, timer=timer, interval_s=1.0)
    writer.start(); ...; writer.close(timeout_s=5.0)
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
from megascope.collectors.buffers import RowBuffer, rows_to_table_dropping
from megascope.collectors.timing import Timer

from megascope import layout, schema
from megascope.schema import WAIT_SUFFIX, MarkerState, RunMeta, SpanKind
from megascope.steplog import StepLog
from megascope.stepsums import step_sums

log = logging.getLogger(__name__)

# Tables written as a stream of parts, in the order they are flushed.
_PART_TABLES = (("spans", schema.SPANS), ("markers", schema.MARKERS), ("metrics", schema.METRICS))
_WARN_EVERY_S = 60.0
_PACED_CHUNK_ROWS = 256  # rows turned into Arrow at a time between a paced pass's ticks
_MAX_EVERY_STEPS = 4096  # the most steps between step-aligned passes
_STEP_EMA = 0.2  # weight of the latest step in the step time a rank measures


class Sink:
    """The queues the training thread fills and the writer drains, one per table plus the pending."""

    def __init__(self, capacity: int) -> None:
        # Row layouts: megascope.collectors.buffers (SPAN_ROW, MARKER_ROW, ...), declared once.
        self.spans = RowBuffer(capacity)  # SPAN_ROW
        self.markers = RowBuffer(capacity)  # MARKER_ROW
        self.metrics = RowBuffer(capacity)  # METRIC_ROW
        # PENDING_SPAN_ROW: spans closed on the host whose device events may still be running.
        self.pending_spans = RowBuffer(capacity)
        # PENDING_MARK_ROW: untimed communication calls whose completion is still to be seen
        # (config.comm_sample_kinds).
        self.pending_marks = RowBuffer(capacity)
        # PENDING_METRIC_ROW: a device scalar being copied into a pinned host scalar, done when the
        # timer's mark (a pooled event) is; value and host_tensor/mark may be None.
        self.pending_metrics = RowBuffer(capacity)
        # Pinned host scalars by dtype, reused: freeing one records CUDA events (torch's host
        # allocator), which can block behind a full launch queue while holding the interpreter.
        self.pinned: dict[Any, list[Any]] = {}

    def buffer(self, table: str) -> RowBuffer:
        return getattr(self, table)  # type: ignore[no-any-return]

    @property
    def dropped(self) -> int:
        return sum(b.dropped for b in (self.spans, self.markers, self.metrics, self.pending_spans, self.pending_marks,
                                       self.pending_metrics))


class Pacer:
    """Keeps a background thread's share of the interpreter lock at most ``duty``.

    The thread calls :meth:`tick` between small units of work; once a slice of ``slice_s`` has
    passed since the last pause, ``tick`` sleeps ``slice_s * (1 - duty) / duty`` (sleeping releases
    the lock, so a waiting thread takes it at once). ``duty`` 1 never sleeps. While ``hurry`` is set
    (another thread waits for this work to finish) it does not pause.
    """

    def __init__(self, duty: float, *, slice_s: float = 0.0005, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not 0 < duty <= 1:
            raise ValueError(f"duty must be in (0, 1], got {duty}")
        self.duty = duty
        self.slice_s = slice_s
        self.pause_s = slice_s * (1 - duty) / duty
        self._clock = clock
        self._sleep = sleep
        self._since = clock()
        self.hurry = False
        self.pauses = 0

    def begin(self) -> None:
        """Start a pass: a full slice before the first pause."""
        self._since = self._clock()

    def tick(self) -> None:
        if self.pause_s <= 0 or self.hurry:
            return
        now = self._clock()
        if now - self._since >= self.slice_s:
            self._sleep(self.pause_s)
            self.pauses += 1
            self._since = self._clock()


_OTHER = SpanKind.OTHER.value
_COMPLETED = MarkerState.COMPLETED.value


_RESOLVED, _DROPPED, _NOT_DONE = 0, 1, 2


def _resolve_span(sink: Sink, timer: Timer, rank: int, item: Any, waiting: list[Any], direct: bool) -> int:
    """One pending span (and its wait span, if it has one) into the spans queue: ``_RESOLVED``, or
    ``_NOT_DONE`` (it stays pending), or ``_DROPPED`` after a device error. Runs once per span in
    the writer, holding the interpreter: kept to plain local operations (the layouts are unpacked
    and built in place, in the orders declared in megascope.collectors.buffers).

    ``direct``: time the end without asking first whether it is done. Timing an event that is not
    done raises (it never waits), and only then is the device asked; a pass does this while the
    spans before were all done (their events complete in the order they were recorded, mostly on
    one stream), which spares one device call per span: on GPUs each holds the interpreter beside a
    training thread that launches."""
    # PENDING_SPAN_ROW
    start, end, anchor, step, name, kind, stream, microbatch, chunk, group, seq, op, nbytes, peer, wait = item
    try:
        end_ns = None
        if direct:
            try:
                end_ns = timer.wall_ns(end, anchor)
            except Exception:
                if timer.ready(end):
                    raise
                waiting.append(item)
                return _NOT_DONE
        elif not timer.ready(end):
            waiting.append(item)
            return _NOT_DONE
        # The start was recorded earlier, almost always on the same stream, so it is done too:
        # asking costs a device call per span. Where it is not done, timing it raises; ask then.
        try:
            start_ns = timer.wall_ns(start, anchor)
            wait_ns = None if wait is None else timer.wall_ns(wait, anchor)
        except Exception:
            if timer.ready(start) and (wait is None or timer.ready(wait)):
                raise
            waiting.append(item)
            return _NOT_DONE
        if end_ns is None:
            end_ns = timer.wall_ns(end, anchor)
    except Exception:  # a device error must not stop the writer: drop this span
        log.debug("could not resolve span %s", name, exc_info=True)
        for token in (start, end, wait):
            timer.release(token)
        return _DROPPED
    release = timer.release
    release(start)
    release(end)
    put = sink.spans.put
    put((rank, step, name, kind, stream, start_ns, end_ns - start_ns if end_ns > start_ns else 0, microbatch,
         chunk, group, seq, op, nbytes, peer))  # SPAN_ROW
    if wait_ns is not None:
        release(wait)
        # No group: a span with a group is a communication span to every query of the run.
        put((rank, step, name + WAIT_SUFFIX, _OTHER, stream, wait_ns, end_ns - wait_ns if end_ns > wait_ns else 0,
             microbatch, chunk, None, seq, op, None, peer))
    if group is not None and seq is not None:
        sink.markers.put((rank, group, seq, op, _COMPLETED, end_ns, step, nbytes, peer))  # MARKER_ROW
    return _RESOLVED


def resolve_pending(sink: Sink, timer: Timer, rank: int, pacer: Pacer | None = None) -> int:
    """Move every pending span and metric whose device work has finished into its table queue.

    Returns how many could not be resolved because of an error (they are dropped). ``pacer`` is
    ticked after every span.
    """
    errors = 0
    waiting: list[Any] = []
    tick = pacer.tick if pacer is not None else None
    # Until the first span that is not done, the others are timed without asking (see _resolve_span);
    # after it, most of the queue was recorded later and is not done either: ask first.
    direct = timer.is_device
    left = len(sink.pending_spans)  # what is there now: spans added meanwhile wait for the next pass
    while left > 0:
        # Paced, even taking the items out is done a chunk at a time (it holds the interpreter too).
        items = sink.pending_spans.drain(_PACED_CHUNK_ROWS if tick is not None else left)
        left -= len(items)
        for item in items:
            if tick is not None:
                tick()
            status = _resolve_span(sink, timer, rank, item, waiting, direct)
            if status == _DROPPED:
                errors += 1
            elif status == _NOT_DONE:
                direct = False
    if waiting:
        sink.pending_spans.push_front(waiting)

    # Untimed calls: a completed marker. On the host the mark is the completion time; on a device,
    # the time the writer first sees its event done (up to one flush interval late: hang
    # localization reads which calls completed, not when).
    marks = sink.pending_marks.drain()
    now = time.time_ns() if marks and timer.is_device else None
    for i, (mark, step, group, seq, op, nbytes, peer) in enumerate(marks):  # PENDING_MARK_ROW
        try:
            if not timer.mark_done(mark):
                # Marks are recorded in call order, mostly on one stream: the rest are later.
                sink.pending_marks.push_front(marks[i:])
                break
        except Exception:
            errors += 1
            log.debug("could not resolve the completion of %s %s", group, seq, exc_info=True)
            continue
        timer.release_mark(mark)
        sink.markers.put((rank, group, seq, op, _COMPLETED, mark if now is None else now, step, nbytes,
                          peer))  # MARKER_ROW

    # No CUDA object is created or destroyed here: on a rank whose peer hangs, destroying an event
    # waits for the driver's lock behind a launch stuck in a full queue, holding the interpreter.
    waiting = []
    for item in sink.pending_metrics.drain():
        step, name, value, host_tensor, mark, time_ns = item  # PENDING_METRIC_ROW
        try:
            # A device-to-host copy is done when the mark recorded after it is.
            if mark is not None and not timer.mark_done(mark):
                waiting.append(item)
                continue
            if host_tensor is not None:
                value = float(host_tensor.item())  # host memory: no device access
        except Exception:
            errors += 1
            log.debug("could not resolve metric %s", name, exc_info=True)
            value = None
        if mark is not None:
            timer.release_mark(mark)
        if host_tensor is not None:
            sink.pinned.setdefault(host_tensor.dtype, []).append(host_tensor)
        sink.metrics.put((rank, step, name, value, time_ns))  # METRIC_ROW
    if waiting:
        sink.pending_metrics.push_front(waiting)
    return errors


class Writer:
    """Owns the background thread and the counters of what reached the disk."""

    def __init__(
        self,
        run_dir: Path,
        *,
        rank: int,
        sink: Sink,
        timer: Timer,
        interval_s: float,
        capacity: int,
        duty: float = 1.0,
        run_id: Callable[[], str | None] | None = None,
        align_steps: bool = True,
    ) -> None:
        self.run_dir = Path(run_dir)
        # run.json's run_id, stamped into every part (None: not known yet, or not stamped).
        self.run_id: Callable[[], str | None] = run_id if run_id is not None else (lambda: None)
        self.rank = rank
        self.sink = sink
        self.timer = timer
        self.interval_s = interval_s
        self.capacity = capacity
        # Background passes are paced unless the spans waiting exceed a quarter of the capacity:
        # a writer that falls that far behind catches up at full speed rather than drop rows.
        self.pacer = Pacer(duty)
        self.lock = threading.Lock()  # one flush at a time
        self._static_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Step-aligned passes (step_ended): the training thread sets _due at the end of a step
        # whose number is a multiple of every_steps (0: passes every interval_s).
        self.align_steps = align_steps
        self._due = threading.Event()
        self.every_steps = 0
        self._step_s: float | None = None  # the rank's step time, smoothed
        self._last_step_end: float | None = None
        self.aligned_passes = 0
        self._monotonic = time.monotonic
        self._static: dict[str, pa.Table] = {}  # ranks / groups: whole files, rewritten when changed
        self._run_meta: RunMeta | None = None
        self._retry: dict[str, pa.Table] = {}
        # ranks / groups written before this rank knew the run id: rewritten, stamped, once it does.
        self._unstamped: dict[str, pa.Table] = {}
        self.pollers: list[Callable[[], None]] = []  # extra work each pass (flight recorder)
        self.step_log = StepLog(self.run_dir, rank=rank)
        # Markers leave through the shared-memory ring (the marker agent writes them), not here.
        self.markers_elsewhere = False
        self.rows_written = {name: 0 for name, _ in _PART_TABLES}
        self.parts_written = 0
        self.write_errors = 0
        self.rows_lost = 0  # rows given up after failed writes
        self.rows_malformed = 0  # rows that did not fit their table's schema, left out
        self._malformed_warned: set[str] = set()
        self.internal_errors = 0
        self._last_warning = -_WARN_EVERY_S

    # ---------------------------------------------------------------- what to write
    # These take only the small static lock, never the flush lock: the caller may be the training
    # thread, or a poller running inside a flush.
    def set_static(self, table: str, data: pa.Table) -> None:
        with self._static_lock:
            self._static[table] = data

    def set_run_meta(self, meta: RunMeta) -> None:
        with self._static_lock:
            self._run_meta = meta

    def write_run_meta_now(self) -> None:
        """Write ``run.json`` now, from the calling thread (the writer thread retries on failure)."""
        with self.lock:
            with self._static_lock:
                meta, self._run_meta = self._run_meta, None
            if meta is None:
                return
            self._write_run_meta(meta)

    def _write_run_meta(self, meta: Any) -> None:
        """Write ``run.json``; on failure keep it for the next pass (unless a newer one came)."""
        try:
            layout.write_run_meta(self.run_dir, meta)
        except Exception as exc:
            self._failed("run.json", exc)
            with self._static_lock:
                self._run_meta = self._run_meta or meta

    # ---------------------------------------------------------------- the thread
    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"megascope-writer-r{self.rank}", daemon=True)
        self._thread.start()

    def step_ended(self, step: int) -> None:
        """The training thread ended ``step``: start a pass if it is one of the aligned steps.

        K (``every_steps``) is the power of two nearest to the flush interval over the rank's
        step time, so ranks whose step times differ by a few percent agree on it, and where two
        ranks pick K and 2K their passes still coincide at every multiple of 2K."""
        now = self._monotonic()
        last, self._last_step_end = self._last_step_end, now
        if not self.align_steps or last is None:
            return
        took = now - last
        smooth = self._step_s = took if self._step_s is None else self._step_s + _STEP_EMA * (took - self._step_s)
        if smooth <= 0:
            return
        ratio = self.interval_s / smooth
        every = 1 << min(max(round(math.log2(ratio)), 0), _MAX_EVERY_STEPS.bit_length() - 1) if ratio > 1 else 1
        self.every_steps = every
        if step % every == 0:
            self._due.set()

    def _wait_s(self) -> float:
        """How long the thread waits for an aligned step before a pass by time: while steps come,
        two intervals or two steps (an aligned step comes well before); without steps, or once
        none has ended for that long (a hang, a long evaluation, the end), the interval."""
        last, step_s = self._last_step_end, self._step_s
        if not self.every_steps or step_s is None or last is None:
            return self.interval_s
        patience = 2 * max(self.interval_s, step_s)
        return patience if self._monotonic() - last < patience else self.interval_s

    def _loop(self) -> None:
        while not self._stop.is_set():
            aligned = self._due.wait(self._wait_s())
            self._due.clear()
            if self._stop.is_set():
                break
            if aligned:
                self.aligned_passes += 1
            self.flush(paced=True)

    def flush(self, *, lock_timeout_s: float = -1, paced: bool = False) -> bool:
        """One full pass; False if the lock could not be had within ``lock_timeout_s``.

        ``paced`` (the writer thread's own passes): sleep between slices of work, see :class:`Pacer`.
        """
        if not paced:
            self.pacer.hurry = True  # a paced pass in progress finishes at full speed
        acquired = self.lock.acquire(timeout=lock_timeout_s)
        if not paced:
            self.pacer.hurry = False
        if not acquired:
            return False
        try:
            pacer = None
            if paced and self.pacer.pause_s > 0 and len(self.sink.pending_spans) < self.capacity // 4:
                pacer = self.pacer
                pacer.begin()
            self._flush_locked(pacer)
        except Exception:  # the writer thread must survive anything
            self.internal_errors += 1
            log.warning("megascope collector: flush failed", exc_info=True)
        finally:
            self.lock.release()
        return True

    def close(self, *, timeout_s: float) -> None:
        """Stop the thread, wait up to ``timeout_s`` for device events (never synchronizing), flush."""
        self._stop.set()
        self._due.set()
        self.pacer.hurry = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(self.interval_s, 1.0) + 5.0)
        deadline = time.monotonic() + timeout_s
        while len(self.sink.pending_spans) or len(self.sink.pending_marks) or len(self.sink.pending_metrics):
            with self.lock:
                self.internal_errors += resolve_pending(self.sink, self.timer, self.rank)
            if time.monotonic() >= deadline:
                break
            time.sleep(0.005)
        self.flush()
        self.step_log.close()
        # What the last flush could not write (a read-only or full disk) is lost with the process:
        # counted, so stats never say "0 rows dropped" for rows that never reached the disk.
        left = self.pending_rows + len(self.sink.spans) + len(self.sink.metrics) + len(self.sink.pending_spans)
        if not self.markers_elsewhere:
            left += len(self.sink.markers)
        if left:
            self.rows_lost += left
            self._retry.clear()
            log.warning("megascope collector (rank %d): %d rows could not be written before close and are lost "
                        "(%d write errors)", self.rank, left, self.write_errors)

    # ---------------------------------------------------------------- one pass
    def _flush_locked(self, pacer: Pacer | None = None) -> None:
        self.internal_errors += resolve_pending(self.sink, self.timer, self.rank, pacer)
        for poll in self.pollers:
            try:
                poll()
            except Exception:
                self.internal_errors += 1
                log.debug("poller failed", exc_info=True)
        self._write_static()
        for name, table_schema in _PART_TABLES:
            if name == "markers" and self.markers_elsewhere:
                continue
            self._write_rows(name, table_schema, pacer)

    def _write_static(self) -> None:
        with self._static_lock:
            meta, self._run_meta = self._run_meta, None
            static, self._static = self._static, {}
        if meta is not None:
            self._write_run_meta(meta)
        run_id = self.run_id()
        if run_id is not None and self._unstamped:
            static = self._unstamped | static
            self._unstamped = {}
        for table, data in static.items():
            try:
                layout.write_part(self.run_dir, table, data, rank=self.rank, run_id=run_id)
            except Exception as exc:
                self._failed(table, exc)
                with self._static_lock:
                    self._static.setdefault(table, data)  # unless a newer version came meanwhile
                continue
            if run_id is None:
                self._unstamped[table] = data
            else:
                self._unstamped.pop(table, None)

    def _write_rows(self, name: str, table_schema: pa.Schema, pacer: Pacer | None = None) -> None:
        buffer = self.sink.buffer(name)
        retry = self._retry.pop(name, None)
        # Rows become Arrow a chunk at a time; a row that does not fit its table is left out and
        # counted, the rest of its chunk written.
        if pacer is None or len(buffer) <= _PACED_CHUNK_ROWS:
            rows = buffer.drain()
            if not rows and retry is None:
                return
            data = self._convert(name, rows, table_schema)
        else:  # taking rows out and turning them into Arrow hold the interpreter lock: a chunk at a time
            chunks = []
            for _ in range(0, len(buffer), _PACED_CHUNK_ROWS):
                pacer.tick()
                chunks.append(self._convert(name, buffer.drain(_PACED_CHUNK_ROWS), table_schema))
            data = pa.concat_tables(chunks)
        if pacer is not None:
            pacer.tick()
        if retry is not None:
            data = pa.concat_tables([retry, data])
        try:
            path = layout.write_part(self.run_dir, name, data, rank=self.rank, run_id=self.run_id())
        except Exception as exc:
            self._failed(name, exc)
            if data.num_rows > self.capacity:  # keep the newest rows, bounded
                self.rows_lost += data.num_rows - self.capacity
                data = data.slice(data.num_rows - self.capacity)
            self._retry[name] = data
            return
        self.rows_written[name] += data.num_rows
        self.parts_written += 1
        if name == "spans":
            if pacer is not None:
                pacer.tick()
            # The part's sums, for live viewers (the step log, first) and the analysis (the twin).
            # Never retried: a spans part without a twin is aggregated by the analysis itself.
            try:
                sums = step_sums(data)
                try:
                    self.step_log.append(sums, run_id=self.run_id())
                except Exception as exc:  # for live viewers only: never at the twin's cost
                    self._failed("step_log", exc, retried=False)
                layout.write_sums_twin(path, data, run_id=self.run_id(), sums=sums)
            except Exception as exc:
                self._failed("step_sums", exc, retried=False)

    def _convert(self, name: str, rows: list[Any], table_schema: pa.Schema) -> pa.Table:
        data, bad = rows_to_table_dropping(rows, table_schema)
        if bad:
            self.rows_malformed += bad
            if name not in self._malformed_warned:
                self._malformed_warned.add(name)
                log.warning("megascope collector (rank %d): %d %s rows did not fit the table and were dropped "
                            "(counted in rows_dropped); the rest were written", self.rank, bad, name)
        return data

    def _failed(self, what: str, exc: BaseException, *, retried: bool = True) -> None:
        self.write_errors += 1
        now = time.monotonic()
        if now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            then = ("rows are kept in memory up to the buffer limit and retried" if retried else
                    "not retried (derived from the spans part, which is written)")
            log.warning(
                "megascope collector (rank %d): cannot write %s under %s (%s); training continues, %s "
                "(%d write errors so far)",
                self.rank, what, self.run_dir, str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                then, self.write_errors,
            )

    @property
    def pending_rows(self) -> int:
        return sum(t.num_rows for t in self._retry.values())
