"""Overlap the three stages of an export: reading spans, encoding them, writing the bytes.

Role in the data flow: inside :mod:`megascope.export.perfetto`. DuckDB's scan, numpy's sorts and
encoders and the file system all release the interpreter lock for most of their work, so running
the scan one chunk ahead (:class:`Prefetch`) and the writes one queue behind
(:class:`BackgroundWriter`) lets the three proceed at once. Each stage holds at most ``depth``
items in its queue, so memory stays bounded by a few chunks, whatever the run size. The order of
items and bytes is kept, so the output is the same as a serial export's.

Example::

    for chunk in Prefetch(iter_span_chunks(run, resolved)):
        ...
    with BackgroundWriter(stream) as out:
        out.write(data)
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import IO, Any, TypeVar

T = TypeVar("T")

_DONE = object()


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Prefetch(Iterator[T]):
    """``items``, produced in a background thread up to ``depth`` items ahead of the consumer.

    The thread starts at once, so the first items are on their way before the consumer asks (the
    Perfetto export reads while the clock estimate runs). An exception in the producer is raised
    in the consumer at the item where it happened; :meth:`close` (or leaving a ``with`` block)
    stops the producer at its next item, whether or not anything was consumed.
    """

    def __init__(self, items: Iterable[T], *, depth: int = 1) -> None:
        self._box: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._produce, args=(items,), name="megascope-export-read", daemon=True)
        self._thread.start()

    def _produce(self, items: Iterable[T]) -> None:
        try:
            for item in items:
                while not self._stop.is_set():
                    try:
                        self._box.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._box.put(_DONE)
        except BaseException as exc:  # handed to the consumer, which raises it
            self._box.put(_Failed(exc))

    def __iter__(self) -> Prefetch[T]:
        return self

    def __next__(self) -> T:
        if self._finished:
            raise StopIteration
        item = self._box.get()
        if isinstance(item, _Failed):
            self.close()
            raise item.exc
        if item is _DONE:
            self.close()
            raise StopIteration
        return item  # type: ignore[no-any-return]

    def close(self) -> None:
        self._finished = True
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._box.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.05)

    def __enter__(self) -> Prefetch[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BackgroundWriter:
    """A write-only binary stream that hands its writes to a thread, in order.

    ``write`` returns at once (after at most ``depth`` writes are queued); a failure of the
    underlying stream is raised by the next ``write`` or by ``close``.
    """

    # Writes smaller than this are gathered into one buffer first (track descriptors, interned
    # strings): one queue hand-over per ~1 MiB rather than per packet.
    GATHER_BYTES = 1 << 20

    def __init__(self, raw: IO[bytes] | Any, *, depth: int = 16) -> None:
        self.raw = raw
        self._small = bytearray()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="megascope-export-write", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            data = self._queue.get()
            if data is _DONE:
                return
            if self._error is None:
                try:
                    self.raw.write(data)
                except BaseException as exc:  # raised in the writing thread at its next call
                    self._error = exc

    def write(self, data: bytes | bytearray | memoryview) -> int:
        if self._error is not None:
            raise self._error
        size = len(data) if not isinstance(data, memoryview) else data.nbytes
        if size < self.GATHER_BYTES // 16:
            self._small += data
            if len(self._small) >= self.GATHER_BYTES:
                self._hand_over()
            return size
        self._hand_over()
        self._queue.put(data)
        return size

    def _hand_over(self) -> None:
        if self._small:
            self._queue.put(bytes(self._small))
            self._small.clear()

    def close(self) -> None:
        if self._thread.is_alive():
            self._hand_over()
            self._queue.put(_DONE)
            self._thread.join()
        if self._error is not None:
            raise self._error

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
