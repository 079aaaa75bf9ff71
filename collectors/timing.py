"""Timestamps without stopping the device: host clock on CPU, pooled CUDA events on GPU.

Role in the data flow: the :class:`~megascope.collectors.Collector` asks a timer for a *token* at
the start and end of every span (``stamp``); the writer thread later asks whether a token is
``ready`` and turns it into host wall-clock nanoseconds (``wall_ns``) through the :class:`Anchor`
that was current when the span began. A *mark* (``mark``, ``mark_done``, ``release_mark``) only
says that the work before it is done, not when: the completion of a communication call left
untimed. Both timers have the same methods, so every code path above them runs the same on CPU
(gloo tests) and on CUDA.

* :class:`HostTimer`: a token is ``time.perf_counter_ns()``; an anchor pairs it with
  ``time.time_ns()``, so NTP slewing of the wall clock is followed at every anchor refresh.
* :class:`CudaTimer`: a token is the key of a ``torch.cuda.Event(enable_timing=True)`` in a pool, recorded
  on the stream doing the work, or (``side_stream``, clock ``side-stream``) on a private stream made to
  wait for a timing-free marker on the work's stream, so that no timing event sits between the
  work's kernels. ``ready`` asks whether the event is done and ``wall_ns`` is the time from the
  anchor's event to it: neither waits for the device. Both go through ``torch.cuda.Event``, which
  holds the interpreter lock for the call, or (``event_calls="driver"``) straight to the CUDA driver
  (:class:`DriverEventCalls`), which lets go of it. The training thread's records go the other
  way (``record_calls="driver"``, :class:`DriverRecord`): torch's record lets go of the lock for
  the call, and a writer waiting for it takes it there, at every span; the driver's
  ``cuEventRecord`` called holding the lock gives no such turn. An anchor is an event
  recorded while the stream is idle (checked with ``Stream.query()``, a natural sync point such as
  the host having just read the loss), paired with the host wall clock of that moment. A new one is
  taken at most every ``anchor_interval_s`` and only when the stream is idle, so anchors never cost
  a synchronization; between anchors the device clock's drift against the host clock accumulates
  (``bench/collector_overhead.py`` measures it).

A pending span refers to its anchor by number (``anchor_ref``) and holds its stamps as plain
integers, so it holds no object Python's garbage collector must track: the collector's queue of
spans waiting for the device then never counts towards the interpreter's full collections, which
stop every thread of the rank. Timers keep their last ``ANCHOR_SLOTS`` anchors.

Example::

    timer = make_timer(torch.device("cpu"), anchor_interval_s=1.0)
    ref = timer.anchor_ref
    t0 = timer.stamp(None); ...; t1 = timer.stamp(None)
    if timer.ready(t1):
        start_ns, end_ns = timer.wall_ns(t0, ref), timer.wall_ns(t1, ref)
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import os
import threading
import time
from collections import deque
from typing import Any

from megascope.schema import DEVICE_STREAM_PREFIX

log = logging.getLogger(__name__)


# Anchors a pending span may still refer to. A timer takes at most one a second, so a span may
# wait over an hour for its device events before its anchor is gone (it is then dropped, counted).
ANCHOR_SLOTS = 4096
# A CUDA anchor's record call must return within this of the wall read before it (its wall time
# is then good to half of it); tries per refresh (on the training thread) and for the first anchor.
ANCHOR_BRACKET_NS = 200_000
ANCHOR_REFRESH_TRIES = 3
ANCHOR_FIRST_TRIES = 50


class Anchor:
    """A moment known on both clocks: ``wall_ns`` on the host, ``mark`` on the timer's clock."""

    __slots__ = ("wall_ns", "mark", "exact", "ref")

    def __init__(self, wall_ns: int, mark: Any, exact: bool) -> None:
        self.wall_ns = wall_ns
        self.mark = mark  # perf_counter_ns (host) or a recorded CUDA event
        # False when the stream was busy as the anchor was taken (only the very first CUDA anchor
        # can be): its wall time is then the host time of the record call, earlier than the truth.
        self.exact = exact
        self.ref = -1  # its number in the timer that took it


class _Anchors:
    """The last ``ANCHOR_SLOTS`` anchors of a timer by number; ``anchor`` is the current one."""

    anchor: Anchor
    anchor_ref: int

    def _init_anchors(self, first: Anchor) -> None:
        self._ring: list[Anchor | None] = [None] * ANCHOR_SLOTS
        self._next_ref = 0
        self.anchors_taken = 0
        self._install(first)

    def _install(self, anchor: Anchor) -> None:
        anchor.ref = self._next_ref
        self._next_ref += 1
        self._ring[anchor.ref % ANCHOR_SLOTS] = anchor
        self.anchor = anchor
        self.anchor_ref = anchor.ref
        self.anchors_taken += 1

    def anchor_of(self, ref: int | Anchor) -> Anchor:
        """The anchor numbered ``ref`` (an :class:`Anchor` passes through); LookupError once it is
        no longer kept."""
        if isinstance(ref, Anchor):
            return ref
        anchor = self._ring[ref % ANCHOR_SLOTS]
        if anchor is None or anchor.ref != ref:
            raise LookupError(f"clock anchor {ref} is no longer kept")
        return anchor


class HostTimer(_Anchors):
    """Timestamps from ``time.perf_counter_ns()``, mapped to wall clock through anchors."""

    is_device = False
    # No device streams (CudaTimer: the stream the last stamp was taken on, and the default one).
    last_raw: int | None = None
    default_raw: int | None = None

    def __init__(self, *, anchor_interval_s: float = 1.0) -> None:
        self._interval_ns = int(anchor_interval_s * 1e9)
        self._init_anchors(self._take_anchor())
        self.stamps = 0  # stamps taken so far (the collector reports them per step)

    @staticmethod
    def _take_anchor() -> Anchor:
        # Midpoint of two wall reads around the perf read: error below ~100 ns.
        w0 = time.time_ns()
        mark = time.perf_counter_ns()
        w1 = time.time_ns()
        return Anchor((w0 + w1) // 2, mark, True)

    def maybe_refresh(self) -> None:
        """Take a new anchor if the current one is older than the anchor interval."""
        if time.perf_counter_ns() - self.anchor.mark >= self._interval_ns:
            self._install(self._take_anchor())

    def stamp(self, stream: Any = None) -> int:
        self.stamps += 1
        return time.perf_counter_ns()

    def ready(self, token: Any) -> bool:
        return True

    def wall_ns(self, token: Any, anchor: int | Anchor) -> int:
        a = self.anchor_of(anchor)
        return int(a.wall_ns + (token - a.mark))

    def release(self, token: Any) -> None:
        """Give a token back (a no-op for host stamps)."""

    def mark(self, stream: Any = None) -> int:
        """A completion mark: on the host, work is done when its call returns, so the mark is the
        wall-clock time of that moment."""
        return time.time_ns()

    def mark_done(self, mark: Any) -> bool:
        return True

    def release_mark(self, mark: Any) -> None:
        """Give a mark back (a no-op on the host)."""

    @property
    def outstanding(self) -> int:
        return 0


_CUDA_SUCCESS = 0
_CUDA_ERROR_NOT_READY = 600


class DriverEventCalls:
    """``cuEventQuery`` and ``cuEventElapsedTime`` on torch's events, called through ctypes.

    A ctypes call lets go of the interpreter lock while the driver runs it; ``torch.cuda.Event``'s
    ``query`` and ``elapsed_time`` hold it. The writer thread asks thousands of events a second
    whether they are done, and a driver call can wait for the driver's lock behind a launch that
    the training thread is blocked in (its launch queue full): holding the interpreter lock there,
    the writer would hold back the training thread's next launch until the device has drained a
    slot. ``lib`` is the driver library, ``context`` the CUDA context of the events: a thread that
    has no current context (the writer's own) is given it at its first call; one that has a
    current context keeps it (an event can be asked from any device's context).
    """

    def __init__(self, lib: Any, context: int) -> None:
        self._query = lib.cuEventQuery
        self._query.argtypes = [ctypes.c_void_p]
        self._query.restype = ctypes.c_int
        try:
            self._elapsed = lib.cuEventElapsedTime
        except AttributeError:
            self._elapsed = lib.cuEventElapsedTime_v2
        self._elapsed.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
        self._elapsed.restype = ctypes.c_int
        self._get_current = lib.cuCtxGetCurrent
        self._get_current.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._get_current.restype = ctypes.c_int
        self._set_current = lib.cuCtxSetCurrent
        self._set_current.argtypes = [ctypes.c_void_p]
        self._set_current.restype = ctypes.c_int
        self._context = context
        self._bound = threading.local()

    @classmethod
    def load(cls, torch: Any, index: int, *, hold: bool = False) -> DriverEventCalls | None:
        """The calls for device ``index`` of this process, or None (logged) where the driver library
        or one of its functions is missing. ``hold``: the calls keep the interpreter lock (a
        ``ctypes.PyDLL`` handle): a writer asking hundreds of events a pass then does not hand the
        lock to the training thread and wait to get it back at every call."""
        try:
            calls = cls((ctypes.PyDLL if hold else ctypes.CDLL)("libcuda.so.1"), 0)
            context = ctypes.c_void_p()
            with torch.cuda.device(index):  # the device's primary context, current for the moment
                rc = calls._get_current(ctypes.byref(context))
            if rc != _CUDA_SUCCESS or not context.value:
                raise OSError(f"cuCtxGetCurrent returned {rc}")
            calls._context = context.value
            return calls
        except (OSError, AttributeError) as exc:
            log.info("CUDA events through torch: the driver library is not usable (%s)", exc)
            return None

    def _bind(self) -> None:
        current = ctypes.c_void_p()
        if self._get_current(ctypes.byref(current)) == _CUDA_SUCCESS and not current.value:
            self._set_current(self._context)
        self._bound.done = True

    def done(self, handle: int) -> bool:
        """Whether the event ``handle`` is done; raises on a device error."""
        if not getattr(self._bound, "done", False):
            self._bind()
        rc = self._query(handle)
        if rc == _CUDA_SUCCESS:
            return True
        if rc == _CUDA_ERROR_NOT_READY:
            return False
        raise RuntimeError(f"cuEventQuery returned CUDA error {rc}")

    def elapsed_ms(self, start: int, end: int) -> float:
        """Milliseconds from event ``start`` to event ``end``; raises where either is not done."""
        if not getattr(self._bound, "done", False):
            self._bind()
        ms = ctypes.c_float()
        rc = self._elapsed(ctypes.byref(ms), start, end)
        if rc != _CUDA_SUCCESS:
            raise RuntimeError(f"cuEventElapsedTime returned CUDA error {rc}")
        return ms.value


class DriverRecord:
    """``cuEventRecord`` through a ``ctypes.PyDLL`` handle: the call keeps the interpreter lock.

    torch's ``Event.record`` lets go of the lock while the driver records. On the training thread
    that hands the lock to any thread waiting for it (the writer in a pass), and the training
    thread then waits for it back, at every record: hundreds of turns a step on a job that times
    its tensor-parallel calls. A record is a few microseconds of driver time; holding the lock
    through it costs the other threads that much, once. The call goes to the stream's context, so
    a record on the default stream (handle 0) needs the event's device current on the calling
    thread, as torch has it on a job's own threads; where it is not (any error), the caller
    records through torch instead."""

    def __init__(self, lib: Any) -> None:
        self._record = lib.cuEventRecord
        self._record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        self._record.restype = ctypes.c_int

    @classmethod
    def load(cls) -> DriverRecord | None:
        """The call, or None (logged) where the driver library or the function is missing."""
        try:
            return cls(ctypes.PyDLL("libcuda.so.1"))
        except (OSError, AttributeError) as exc:
            log.info("CUDA events recorded through torch: the driver library is not usable (%s)", exc)
            return None

    def __call__(self, event: int, stream: int) -> bool:
        """Record event handle ``event`` on stream handle ``stream``; False where the driver refused."""
        return self._record(event, stream) == _CUDA_SUCCESS


class CudaTimer(_Anchors):
    """Timestamps from pooled CUDA events on the stream doing the work; nothing synchronizes.

    ``max_events`` bounds the events alive at once (pooled plus in flight); when the device runs
    far behind the host and the pool is exhausted, ``stamp`` returns None and the caller drops the
    span (and counts it) rather than grow without bound. A token is the event's key in the pool.
    """

    is_device = True

    def __init__(self, device: Any, *, anchor_interval_s: float = 1.0, max_events: int = 200_000,
                 side_stream: bool = False, event_calls: str = "torch", record_calls: str = "torch") -> None:
        import torch

        self._torch = torch
        # side_stream: the timing event goes on a private stream made to wait for a timing-free
        # marker recorded on the work's stream (one private stream per work stream, so stamps of
        # different streams never wait for each other). A stream that waits for an event waits for
        # the marker's record at the time of the wait, so one marker is re-recorded for every stamp.
        self._side: dict[int, Any] | None = {} if side_stream else None
        # The hot path avoids building a Stream object per stamp (torch.cuda.current_stream does):
        # the current stream's raw handle keys a cache of Stream objects, and the event is recorded
        # (and queried, and timed) through the C methods. Both are private torch APIs; without them,
        # the public calls.
        self._raw_current: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._streams: dict[int, Any] = {}
        base = getattr(torch._C, "_CudaEventBase", None)
        self._record: Any = getattr(base, "record", None) or torch.cuda.Event.record
        self._query: Any = getattr(base, "query", None) or torch.cuda.Event.query
        self._elapsed: Any = getattr(base, "elapsed_time", None) or torch.cuda.Event.elapsed_time
        self._marker: Any = torch.cuda.Event(enable_timing=False) if side_stream else None
        self._wait: Any = getattr(base, "wait", None) or torch.cuda.Event.wait
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._index = self.device.index
        # The raw handle of the stream the last stamp was recorded on, against the device's default
        # stream: a communication call issued on a stream of its own (FSDP's all-gather and
        # reduce-scatter streams) is labelled with it (side_label).
        self.default_raw: int = torch.cuda.default_stream(self.device).cuda_stream
        self.last_raw: int | None = self.default_raw
        self._labels: dict[int, str] = {}
        self._interval_ns = int(anchor_interval_s * 1e9)
        self._max_events = max_events
        # The pool: a token is a key of it. Keys come from a counter, whose next() no two threads
        # can share (a backward hook may stamp from autograd's thread).
        self._events: dict[int, Any] = {}
        # Each pooled event's raw handle, for records through the driver (record_calls="driver").
        self._handles: dict[int, int] = {}
        self._keys = itertools.count()
        self._free: deque[int] = deque()
        # Timing-free events (``mark``): they tell that work is done, not when, and cost the device
        # nothing measurable where a timing event costs it microseconds.
        self._marks: dict[int, Any] = {}
        self._mark_handles: dict[int, int] = {}
        self._free_marks: deque[int] = deque()
        self.anchors_loose = 0  # anchor records that came back late (tried again, or kept as an inexact first)
        self.anchor_bracket_max_ns = 0  # the slowest anchor record call
        first = self._take_anchor(require_idle=False, tries=ANCHOR_FIRST_TRIES)
        assert first is not None  # require_idle=False always returns an anchor
        self._init_anchors(first)
        # ready, wall_ns and mark_done (the writer's calls) through the driver, without the
        # interpreter lock; None: through torch. After the first anchor: recording it made the
        # device's context, which a collector made before the job's first CUDA call finds missing.
        self._cu = (DriverEventCalls.load(torch, self._index, hold=event_calls == "driver-held")
                    if event_calls in ("driver", "driver-held") else None)
        self._calls = event_calls if self._cu is not None else "torch"
        # The training thread's records through the driver, keeping the interpreter lock; None:
        # through torch. Not with a side stream (its marker and wait go through torch anyway).
        self._rec = (DriverRecord.load() if record_calls == "driver" and not side_stream
                     and self._raw_current is not None else None)
        self.record_fallbacks = 0  # records the driver refused, made through torch instead
        self.stamps = 0  # timing events recorded so far (the collector reports them per step)

    def _new_event(self) -> int | None:
        try:
            return self._free.pop()
        except IndexError:
            pass
        if len(self._events) >= self._max_events:
            return None
        key = next(self._keys)
        self._events[key] = event = self._torch.cuda.Event(enable_timing=True)
        if self._rec is not None:
            self._handles[key] = self._created(event)
        return key

    def _created(self, event: Any) -> int:
        """The raw handle of ``event``, made now: torch makes an event's CUDA object at its first
        record, so it is recorded once, through torch, on the current stream."""
        self._record(event, self._current_stream())
        return int(event.cuda_event)

    def _take_anchor(self, *, require_idle: bool, tries: int = ANCHOR_REFRESH_TRIES) -> Anchor | None:
        """An event recorded on the current stream, paired with the host's wall clock of the record.

        The record call lets go of the interpreter lock, and getting it back can take the other
        threads' switch interval (5 ms) or longer: the call returns late, and a wall time taken
        after it would be late by as much, for every span timed through the anchor (a rank's
        whole run reading milliseconds behind its peers). So the call is bracketed by two wall
        reads and kept only when they are at most :data:`ANCHOR_BRACKET_NS` apart, trying up to
        ``tries`` times; a refresh that finds no tight bracket keeps the current anchor (None),
        the first anchor takes the tightest one found and, where it was not tight, counts as
        inexact, until the next refresh at an idle moment replaces it."""
        stream = self._torch.cuda.current_stream(self.device)
        idle = bool(stream.query())
        if require_idle and not idle:
            return None
        best: tuple[int, Any, int] | None = None  # bracket width, event, midpoint
        for _ in range(max(tries, 1)):
            # Anchor events are not pooled: the timer keeps its last ANCHOR_SLOTS anchors alive.
            event = self._torch.cuda.Event(enable_timing=True)
            w0 = time.time_ns()
            event.record(stream)
            w1 = time.time_ns()
            self.anchor_bracket_max_ns = max(self.anchor_bracket_max_ns, w1 - w0)
            if best is None or w1 - w0 < best[0]:
                best = (w1 - w0, event, (w0 + w1) // 2)
            if w1 - w0 <= ANCHOR_BRACKET_NS:
                break
            self.anchors_loose += 1
        assert best is not None
        width, event, wall = best
        if width > ANCHOR_BRACKET_NS and require_idle:
            return None
        return Anchor(wall, event, idle and width <= ANCHOR_BRACKET_NS)

    def maybe_refresh(self) -> None:
        """Take a new anchor if the current one is old and the current stream is idle right now.
        (Not sooner for an inexact one: each look asks the stream, which lets go of the
        interpreter lock on the training thread.)"""
        if time.time_ns() - self.anchor.wall_ns < self._interval_ns:
            return
        anchor = self._take_anchor(require_idle=True)
        if anchor is not None:
            self._install(anchor)

    @property
    def record_calls(self) -> str:
        """``driver`` or ``torch``: how the training thread's records reach the device."""
        return "driver" if self._rec is not None else "torch"

    def stamp(self, stream: Any = None) -> int | None:
        token = self._new_event()
        if token is None:
            return None
        rec = self._rec
        if rec is not None:
            raw = self._raw_current(self._index) if stream is None else stream.cuda_stream
            self.last_raw = raw
            if rec(self._handles[token], raw):
                self.stamps += 1
                return token
            self.record_fallbacks += 1
        if stream is None:
            stream = self._current_stream()
        self.last_raw = stream.cuda_stream
        if self._side is not None:
            side = self._side.get(stream.cuda_stream)
            if side is None:
                side = self._side[stream.cuda_stream] = self._torch.cuda.Stream(self.device)
            self._record(self._marker, stream)
            self._wait(self._marker, side)  # side.wait_event(marker), without its Python layers
            stream = side
        self._record(self._events[token], stream)
        self.stamps += 1
        return token

    def side_label(self) -> str:
        """``cuda:<stream id>`` of the stream the last stamp was recorded on (the caller's current
        stream then), worked out once per stream."""
        raw = self.last_raw
        label = self._labels.get(raw) if raw is not None else None
        if label is None:
            stream = self._streams.get(raw) if raw is not None else None
            if stream is None:
                stream = self._torch.cuda.current_stream(self.device)
            label = f"{DEVICE_STREAM_PREFIX}{stream.stream_id}"
            if raw is not None:
                self._labels[raw] = label
        return label

    def _current_stream(self) -> Any:
        if self._raw_current is None:
            return self._torch.cuda.current_stream(self.device)
        raw = self._raw_current(self._index)
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = self._torch.cuda.current_stream(self.device)
        return stream

    @property
    def untouched(self) -> bool:
        """Whether no timing event nor mark was ever recorded (the anchors aside)."""
        return self.stamps == 0 and not self._marks

    @property
    def event_calls(self) -> str:
        """``driver``, ``driver-held`` or ``torch``: how ready, wall_ns and mark_done reach the device."""
        return self._calls

    def ready(self, token: int) -> bool:
        if self._cu is not None:
            return self._cu.done(self._events[token].cuda_event)
        return bool(self._query(self._events[token]))

    def wall_ns(self, token: int, anchor: int | Anchor) -> int:
        # The elapsed time raises (never waits) if either event has not completed; callers ask ready().
        a = self.anchor_of(anchor)
        if self._cu is not None:
            return int(a.wall_ns + round(self._cu.elapsed_ms(a.mark.cuda_event, self._events[token].cuda_event) * 1e6))
        return int(a.wall_ns + round(self._elapsed(a.mark, self._events[token]) * 1e6))

    def release(self, token: int | None) -> None:
        if token is not None:
            self._free.append(token)

    def mark(self, stream: Any = None) -> int | None:
        """A timing-free event recorded on ``stream`` (default: the current one), for ``mark_done``;
        None when ``max_events`` marks are in flight."""
        try:
            key = self._free_marks.pop()
        except IndexError:
            if len(self._marks) >= self._max_events:
                return None
            key = next(self._keys)
            self._marks[key] = event = self._torch.cuda.Event(enable_timing=False)
            if self._rec is not None:
                self._mark_handles[key] = self._created(event)
        rec = self._rec
        if rec is not None:
            raw = self._raw_current(self._index) if stream is None else stream.cuda_stream
            if rec(self._mark_handles[key], raw):
                return key
            self.record_fallbacks += 1
        self._record(self._marks[key], self._current_stream() if stream is None else stream)
        return key

    def mark_done(self, mark: int) -> bool:
        if self._cu is not None:
            return self._cu.done(self._marks[mark].cuda_event)
        return bool(self._query(self._marks[mark]))

    def release_mark(self, mark: int | None) -> None:
        if mark is not None:
            self._free_marks.append(mark)

    @property
    def outstanding(self) -> int:
        return len(self._events) - len(self._free)


Timer = HostTimer | CudaTimer


def resolve_device(device: Any) -> Any:
    """The torch.device a collector times: ``device`` itself, or the job's CUDA device, or CPU.

    The job's CUDA device is CUDA's current one once the process has used CUDA. A collector made
    before that (the usual place: first thing in the script, before ``torch.cuda.set_device``)
    takes the device torchrun's convention gives the process, ``LOCAL_RANK`` modulo the visible
    devices: a collector on device 0 in every process would stamp every rank's work on one GPU's
    streams, and the spans and completion markers of the others would be the host's launch times.
    """
    import torch

    if device is not None:
        chosen = torch.device(device)
        if chosen.type == "cuda" and chosen.index is None:
            # "cuda" alone is CUDA's current device, as torch itself reads it.
            chosen = torch.device("cuda", torch.cuda.current_device())
        return chosen
    if torch.cuda.is_available():
        local = os.environ.get("LOCAL_RANK", "")
        if not torch.cuda.is_initialized() and local.isdigit():
            return torch.device("cuda", int(local) % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_timer(device: Any, *, anchor_interval_s: float, max_events: int, clock: str = "device",
               event_calls: str = "torch", record_calls: str = "torch") -> Timer:
    """The timer for ``device`` (a torch.device): events on CUDA unless ``clock`` is ``host``."""
    if getattr(device, "type", "cpu") == "cuda" and clock != "host":
        return CudaTimer(device, anchor_interval_s=anchor_interval_s, max_events=max_events,
                         side_stream=clock == "side-stream", event_calls=event_calls, record_calls=record_calls)
    return HostTimer(anchor_interval_s=anchor_interval_s)
