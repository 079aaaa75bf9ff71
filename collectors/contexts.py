"""The context objects a collector hands out: spans, steps, communication handles, and no-ops.

Role in the data flow: the hot path of the in-job collector. Entering a span stamps the timer,
leaving it queues a pending span for the writer thread; nothing here waits for the device or takes
a lock. These objects read and write a few attributes of their :class:`Collector` (current step,
micro-batch, chunk) and call its ``_close_span``; users get them from ``col.span``, ``col.step``,
``col.comm`` and ``col.comm_begin``, never build them.

Example::

    with col.span("loss", kind=SpanKind.COMPUTE):   # a SpanContext
        ...
    h = col.comm_begin(op="all_reduce", group="dp:0", bytes=n)   # a CommHandle
    work.wait(); h.end()
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from megascope.schema import (
    COLLECTOR_CALLS_METRIC,
    COLLECTOR_STAMPS_METRIC,
    COLLECTOR_STEP_CALLS_METRIC,
    DEVICE_STREAM_PREFIX,
    HOST_PROBE_LOOPS,
    HOST_PROBE_METRIC,
    STEP_ERROR_METRIC,
    MarkerState,
    SpanKind,
)

_ENQUEUED = MarkerState.ENQUEUED.value

if TYPE_CHECKING:
    from megascope.collectors.collector import Collector


class _Noop:
    """What a disabled collector hands out: a context manager, decorator and comm handle doing nothing."""

    __slots__ = ()

    def __enter__(self) -> _Noop:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return fn

    def waiting(self) -> None:
        pass

    def hold(self) -> bool:
        return False

    def end(self) -> None:
        pass

    def abandon(self) -> None:
        pass


NOOP = _Noop()


class SpanContext:
    """One timed span: ``with col.span(...):`` or ``@col.span(...)``. Closed even on exceptions."""

    __slots__ = ("_col", "name", "kind", "stream", "label", "microbatch", "chunk", "_token", "_anchor", "_saved")

    def __init__(self, col: Collector, name: str, kind: str, stream: Any, label: str,
                 microbatch: int | None, chunk: int | None) -> None:
        self._col = col
        self.name = name
        self.kind = kind
        self.stream = stream  # a device stream to record on, or None for the current one
        self.label = label
        self.microbatch = microbatch
        self.chunk = chunk
        self._token: Any = None
        self._anchor: Any = None
        self._saved: tuple[int | None, int | None] = (None, None)

    def __enter__(self) -> SpanContext:
        col = self._col
        self._saved = (col._microbatch, col._chunk)
        if self.microbatch is not None:
            col._microbatch = self.microbatch
        if self.chunk is not None:
            col._chunk = self.chunk
        try:
            self._anchor = col._timer.anchor_ref
            self._token = col._timer.stamp(self.stream)
        except Exception:
            col._internal_error("span start")
            self._token = None
        return self

    def __exit__(self, *exc: object) -> None:
        col = self._col
        col._microbatch, col._chunk = self._saved
        token, self._token = self._token, None
        col._close_span(token, self._anchor, self.stream, col._step, self.name, self.kind, self.label,
                        self.microbatch if self.microbatch is not None else self._saved[0],
                        self.chunk if self.chunk is not None else self._saved[1], None, None, None, None, None)

    def __call__(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        col, name, kind, stream, mb, chunk = self._col, self.name, self.kind, self.stream, self.microbatch, self.chunk

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with col.span(name, kind=kind, microbatch=mb, chunk=chunk, stream=stream):
                return fn(*args, **kwargs)

        return timed


class StepContext(SpanContext):
    """A ``step`` span that also sets the collector's current step for everything inside."""

    __slots__ = ("step", "_prev_step", "_stamps")

    def __init__(self, col: Collector, step: int, label: str) -> None:
        super().__init__(col, "step", SpanKind.STEP.value, None, label, None, None)
        self.step = step
        self._prev_step: int | None = None
        self._stamps = 0

    def __enter__(self) -> StepContext:
        col = self._col
        self._prev_step = col._step
        col._step = col._last_step = self.step
        try:
            col._timer.maybe_refresh()  # step boundaries are where a device tends to be idle
        except Exception:
            col._internal_error("anchor refresh")
        self._stamps = col._timer.stamps
        col._sampled_calls.clear()
        col._prev_step_calls, col._step_calls = col._step_calls, {}
        if col._stacks is not None:
            try:
                col._stacks.arm(self.step, threading.get_ident())
            except Exception:
                col._internal_error("stack watch")
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        col = self._col
        col._step = self._prev_step
        if col._stacks is not None:
            col._stacks.disarm()
        # The collector's own footprint: every stamp of the step is a timing event on a device
        # clock, which costs the device ~2 us (docs/collector.md).
        now = time.time_ns()  # METRIC_ROWs (megascope.collectors.buffers)
        col._sink.metrics.put((col.rank, self.step, COLLECTOR_STAMPS_METRIC, float(col._timer.stamps - self._stamps),
                               now))
        if exc and isinstance(exc[0], type):  # the step ended by an exception: which one, and when
            col._sink.metrics.put((col.rank, self.step, STEP_ERROR_METRIC + exc[0].__name__, 1.0, now))
        # Groups timed in some micro-batches only: how many calls there were (reset at step entry).
        for group, calls in col._sampled_calls.items():
            col._sink.metrics.put((col.rank, self.step, COLLECTOR_CALLS_METRIC + group, float(calls), now))
        if col._sample_calls:
            for group, calls in col._step_calls.items():
                if col._prev_step_calls.get(group, 0) >= col._sample_calls_floor:  # they were sampled
                    col._sink.metrics.put((col.rank, self.step, COLLECTOR_STEP_CALLS_METRIC + group, float(calls),
                                           now))
        if col._held:
            col.release_held()
        every = col.config.host_probe_every
        if every and self.step % every == 0:
            col._sink.metrics.put((col.rank, self.step, HOST_PROBE_METRIC, float(probe_host()), now))
        col._writer.step_ended(self.step)  # the writer's pass, at the same steps on every rank


def probe_host(loops: int = HOST_PROBE_LOOPS) -> int:
    """Nanoseconds this thread takes for ``loops`` iterations of a fixed pure-Python loop (about
    0.26-0.38 ms on a 2-core cloud VM): how fast the CPU under it is right now."""
    start = time.perf_counter_ns()
    total = 0
    for i in range(loops):
        total += i
    return time.perf_counter_ns() - start


class StepLevel:
    """``with col.step_level():`` calls inside belong to the step, not to the micro-batch running."""

    __slots__ = ("_col", "_saved")

    def __init__(self, col: Collector) -> None:
        self._col = col
        self._saved: int | None = None

    def __enter__(self) -> StepLevel:
        self._saved, self._col._microbatch = self._col._microbatch, None
        return self

    def __exit__(self, *exc: object) -> None:
        self._col._microbatch = self._saved


class CommHandle:
    """A communication span in flight: ``end()`` after the wait (idempotent); a context manager too.

    Leaving the ``with`` block through an exception writes no completion: the call did not
    complete, and the lone ``enqueued`` marker says so. An untimed handle (``timed=False``,
    config.comm_sample_kinds) writes its markers and no span.
    """

    __slots__ = ("_col", "_token", "_anchor", "_done", "_wait", "_end", "_timed", "stream", "step", "name", "kind",
                 "label", "group", "seq", "op", "bytes", "peer", "microbatch", "chunk")

    def __init__(self, col: Collector, name: str, kind: str, label: str, group: str, seq: int, op: str,
                 nbytes: int | None, peer: int | None, stream: Any, timed: bool = True) -> None:
        # The training thread's hot path: every communication call builds one (positional arguments,
        # the marker put straight into the queue).
        self._col = col
        self.name = name
        self.kind = kind
        self.label = label
        self.group = group
        self.seq = seq
        self.op = op
        self.bytes = nbytes
        self.peer = peer
        self.stream = stream
        self.step = step = col._step
        self.microbatch = col._microbatch
        self.chunk = col._chunk
        self._done = False
        self._wait: Any = None
        self._end: Any = None
        self._timed = timed
        # MARKER_ROW (megascope.collectors.buffers)
        col._sink.markers.put((col.rank, group, seq, op, _ENQUEUED, time.time_ns(), step, nbytes, peer))
        if not timed:  # markers only (config.comm_sample_kinds)
            self._anchor = self._token = None
            return
        try:
            timer = col._timer
            self._anchor = timer.anchor_ref
            self._token = timer.stamp(stream)
            if timer.last_raw != timer.default_raw and stream is None:
                # Issued on a stream of its own (FSDP's all-gathers and reduce-scatters): it starts
                # when that stream is free, not when the device is, and the label says so.
                self.label = timer.side_label()
        except Exception:
            col._internal_error("comm start")
            self._anchor = self._token = None

    def waiting(self) -> None:
        """The caller starts waiting for an asynchronous operation (just before ``work.wait()``).

        ``end()`` then also writes a ``<name>:wait`` span (kind ``other``, same seq, op and peer, no group)
        from here to completion: the part of the operation that compute did not hide. On GPU it is
        stamped on the same stream, so it is the time that stream stalled.
        """
        if self._done or self._wait is not None or not self._timed or not self._col.config.wait_spans:
            return
        try:
            self._wait = self._col._timer.stamp(self.stream)
        except Exception:
            self._col._internal_error("comm wait")

    def hold(self) -> bool:
        """A blocking call issued on a stream of its own (FSDP2's parameter all-gathers): stamp its
        end now, on that stream, and write its span at ``end()``, once the caller's stream has
        come to wait for it (``waiting()`` first), so that it gets a wait span like an
        asynchronous call's. False (nothing done) for a call on the caller's stream, where it
        blocks as issued, and where wait spans are off: end it now."""
        if (self._done or self._end is not None or not self._timed or self._token is None
                or not self.label.startswith(DEVICE_STREAM_PREFIX) or not self._col.config.wait_spans):
            return False
        try:
            self._end = self._col._timer.stamp(self.stream)
        except Exception:
            self._col._internal_error("comm hold")
            return False
        return self._end is not None

    def end(self) -> None:
        """The operation has completed (on GPU: call it after ``work.wait()``)."""
        if self._done:
            return
        self._done = True
        if not self._timed:
            self._col._close_untimed(self.stream, self.step, self.group, self.seq, self.op, self.bytes, self.peer)
            return
        # The span belongs to the step it was issued in, even if its wait comes later. The wait
        # span ends where the operation does: it shares the end stamp (one device event fewer).
        self._col._close_span(self._token, self._anchor, self.stream, self.step, self.name, self.kind, self.label,
                              self.microbatch, self.chunk, self.group, self.seq, self.op, self.bytes, self.peer,
                              self._wait, self._end)

    def abandon(self) -> None:
        """The operation failed: give the timer token back, write no completion."""
        if not self._done:
            self._done = True
            self._col._timer.release(self._token)
            self._col._timer.release(self._wait)
            self._col._timer.release(self._end)

    def __enter__(self) -> CommHandle:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.end()
        else:
            self.abandon()
