"""Read a Chrome-trace JSON file (plain or gzip) incrementally: top-level keys, then events in batches.

Role in the data flow: the first stage of ``megascope ingest kineto``. A Kineto trace is one JSON
object whose ``traceEvents`` array holds almost all of the bytes; reading it with ``json.load``
holds the whole text plus every event dict in memory at once (several times the file size). This
reader keeps one chunk of text (1 MiB) and one batch of decoded events at a time, so memory
is bounded by the chunk size, whatever the file size.

How it stays fast in pure Python: Kineto writes events separated by ``},``; the reader cuts the
buffer at the last such separator and hands the whole run of events to ``json.loads`` in one call
(C speed). A cut that lands inside a nested object cannot parse as a JSON array, so a wrong cut is
always detected; the reader then falls back to decoding one event at a time, which is slower but
exact. Keys after ``traceEvents`` (recent torch writes ``baseTimeNanoseconds`` there) are read too
and available once the events are exhausted.

Example::

    reader = TraceReader(path)
    header = reader.read_header()          # keys before "traceEvents" (distributedInfo, ...)
    for batch in reader.iter_batches():    # lists of event dicts
        ...
    reader.trailer                         # keys after "traceEvents"
"""

from __future__ import annotations

import gzip
import json
import logging
import zlib
from collections.abc import Callable, Iterator
from json.decoder import scanstring  # type: ignore[attr-defined]
from pathlib import Path
from typing import IO, Any

from megascope.errors import IngestError

log = logging.getLogger(__name__)

# 1 MiB: an ingest of 256 x 20 ranks x steps peaks at ~235 MiB (PSS, two workers) against ~295 with
# 4 MiB chunks (the text, its bracketed copy and the decoded batch scale with it), at no measured
# cost in CPU time.
CHUNK_CHARS = 1 << 20
# An event larger than this (decoded text) is not a profiler event: stop instead of buffering forever.
MAX_EVENT_CHARS = 256 << 20
_WS = " \t\n\r"
_CUT_ATTEMPTS = 4
_SLOW_RUN = 512
_GZIP_MAGIC = b"\x1f\x8b"


def open_text(path: Path) -> IO[str]:
    """Open ``path`` as text, transparently un-gzipping by content (not by file name)."""
    try:
        with open(path, "rb") as probe:
            magic = probe.read(2)
    except OSError as exc:
        raise IngestError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if magic == _GZIP_MAGIC:
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


class TraceReader:
    """Incremental reader of one Chrome-trace JSON object with a ``traceEvents`` array."""

    def __init__(
        self,
        path: Path | str,
        *,
        chunk_chars: int = CHUNK_CHARS,
        decode_batch: Callable[[str], list[Any] | None] | None = None,
        convert: Callable[[Any], Any] | None = None,
    ) -> None:
        """``decode_batch``: a faster parser for a JSON array of events, returning None where it
        refuses the text (the standard library then decodes it); ``convert``: turns each event the
        standard library decoded into the type ``decode_batch`` returns (None drops it)."""
        self.path = Path(path)
        self._decode_batch = decode_batch
        self._convert = convert
        self.header: dict[str, Any] = {}
        self.trailer: dict[str, Any] = {}
        self.events_read = 0
        self._chunk = chunk_chars
        self._fh: IO[str] | None = None
        self._buf = ""
        self._pos = 0
        self._consumed = 0  # characters dropped from the front of the buffer
        self._eof = False
        self._state = "start"  # start -> keys -> events -> done
        self._decoder = json.JSONDecoder()

    # ---------------------------------------------------------------- low level

    def _where(self) -> str:
        return f"{self.path}: at character {self._consumed + self._pos}"

    def _fill(self) -> bool:
        """Append the next chunk to the buffer; False at end of file."""
        if self._eof:
            return False
        if self._fh is None:
            self._fh = open_text(self.path)
        try:
            data = self._fh.read(self._chunk)
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise IngestError(f"{self.path}: truncated or corrupt gzip ({exc})") from None
        except UnicodeDecodeError as exc:
            raise IngestError(f"{self.path}: not UTF-8 text ({exc.reason} at byte {exc.start}); not a Kineto trace") from None
        except OSError as exc:
            raise IngestError(f"{self.path}: cannot read ({exc})") from None
        if not data:
            self._eof = True
            return False
        if self._pos:
            self._consumed += self._pos
            self._buf = self._buf[self._pos:] + data
            self._pos = 0
        else:
            self._buf += data
        return True

    def _skip_ws(self) -> None:
        """Advance past whitespace, reading more as needed (stops at EOF)."""
        while True:
            buf, pos, n = self._buf, self._pos, len(self._buf)
            while pos < n and buf[pos] in _WS:
                pos += 1
            self._pos = pos
            if pos < n or not self._fill():
                return

    def _peek(self) -> str:
        self._skip_ws()
        if self._pos >= len(self._buf):
            raise IngestError(f"{self._where()}: file ends early (truncated JSON?)")
        return self._buf[self._pos]

    def _expect(self, char: str) -> None:
        got = self._peek()
        if got != char:
            raise IngestError(f"{self._where()}: expected {char!r}, found {got!r}; not a Kineto trace JSON object")
        self._pos += 1

    def _decode_value(self) -> Any:
        """Decode one JSON value at the cursor, reading more text until it is complete."""
        self._skip_ws()
        while True:
            try:
                value, end = self._decoder.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as exc:
                # Only an error at the end of the buffer can be cured by more text.
                incomplete = exc.pos >= len(self._buf) - 1 or exc.msg.startswith("Unterminated string")
                if not incomplete or len(self._buf) - self._pos > MAX_EVENT_CHARS:
                    self._pos = exc.pos
                    raise IngestError(f"{self._where()}: malformed JSON ({exc.msg})") from None
                if not self._fill():
                    raise IngestError(f"{self._where()}: file ends inside a JSON value (truncated?)") from None
                continue
            if end >= len(self._buf) and self._fill():
                continue  # a number cut by the chunk boundary decodes as a shorter number
            self._pos = end
            return value

    def _decode_key(self) -> str:
        self._expect('"')
        while True:
            try:
                key, end = scanstring(self._buf, self._pos)
            except json.JSONDecodeError:
                if not self._fill():
                    raise IngestError(f"{self._where()}: file ends inside a key (truncated?)") from None
                continue
            self._pos = end
            return str(key)

    # --------------------------------------------------------------- top level

    def _read_keys(self, target: dict[str, Any]) -> bool:
        """Read ``"key": value`` pairs into ``target`` until ``traceEvents`` (True) or ``}`` (False)."""
        while True:
            char = self._peek()
            if char == "}":
                self._pos += 1
                return False
            if char == ",":
                self._pos += 1
                continue
            key = self._decode_key()
            self._expect(":")
            if key == "traceEvents":
                self._expect("[")
                return True
            target[key] = self._decode_value()

    def read_header(self) -> dict[str, Any]:
        """The top-level keys before ``traceEvents``; reads no events."""
        if self._state == "start":
            try:
                if self._peek() != "{":
                    raise IngestError(f"{self.path}: not a JSON object; not a Kineto trace")
                self._pos += 1
                self._state = "events" if self._read_keys(self.header) else "done"
                if self._state == "done":
                    raise IngestError(f"{self.path}: no traceEvents array; not a Kineto trace")
            except BaseException:
                self.close()
                raise
        return self.header

    def iter_batches(self) -> Iterator[list[Any]]:
        """Yield lists of events (dicts, or what the decoders make), in file order; afterwards
        :attr:`trailer` is filled."""
        try:
            self.read_header()
            while self._state == "events":
                batch = self._next_batch()
                if batch:
                    self.events_read += len(batch)
                    yield batch
            if self._state == "keys":
                self._read_keys(self.trailer)
                self._state = "done"
        finally:
            self.close()

    def scan_events(self, scan: Callable[[str, int], tuple[int, bool] | None]) -> bool:
        """Hand the text of the events to ``scan(text, pos)`` instead of decoding them: it reads the
        whole events from character ``pos`` and returns where it stopped and whether it read the
        array's closing ``]``, or None where it refuses the text. Afterwards :attr:`trailer` is
        filled. False (the reader closed, the rest unread) where ``scan`` refused, or the text ends
        or holds an event larger than :data:`MAX_EVENT_CHARS`: read the file with :meth:`reopen`'s
        reader then, whose errors say what is wrong."""
        try:
            self.read_header()
            while self._state == "events":
                result = scan(self._buf, self._pos)
                if result is None:
                    return False
                self._pos, closed = result
                if closed:
                    self._state = "keys"
                elif not self._fill() or len(self._buf) - self._pos > MAX_EVENT_CHARS:
                    return False
            self._read_keys(self.trailer)
            self._state = "done"
            return True
        except IngestError:
            return False
        finally:
            self.close()

    def reopen(self) -> TraceReader:
        """A new reader of the same file with the same settings, at its start."""
        return TraceReader(self.path, chunk_chars=self._chunk, decode_batch=self._decode_batch, convert=self._convert)

    def _next_batch(self) -> list[Any]:
        self._skip_ws()
        buf, pos = self._buf, self._pos
        if pos >= len(buf):
            raise IngestError(f"{self._where()}: file ends inside traceEvents (truncated?)")
        if buf[pos] == "]":
            self._pos += 1
            self._state = "keys"
            return []
        if buf[pos] == ",":
            self._pos += 1
            return []
        # Fast path: everything up to the last event separator of the buffer, decoded in one call.
        # "},<newline>" cannot sit inside a string (JSON strings hold no raw newlines), so prefer it;
        # a bare "}," may (kernel names contain "...#1}, at::..."): a cut that fails to parse is
        # moved before the parse error and tried again, a few times at most.
        cut = buf.rfind("},\n", pos)
        if cut <= pos:
            cut = buf.rfind("},", pos)
        for _ in range(_CUT_ATTEMPTS):
            if cut <= pos:
                break
            text = "[" + buf[pos:cut + 1] + "]"
            batch = self._decode_batch(text) if self._decode_batch is not None else None
            if batch is None:
                try:
                    batch = self._keep(json.loads(text))
                except json.JSONDecodeError as exc:
                    # exc.pos counts the "[" we added; the bad cut is at or after the error.
                    cut = buf.rfind("},", pos, min(pos + max(exc.pos - 1, 0), cut))
                    continue
            self._pos = cut + 2
            if not self._eof and len(buf) - self._pos < self._chunk:
                self._fill()
            return batch
        # Slow path: a run of single events (each reads more text when it is incomplete), so
        # that a format the fast path cannot cut costs linear time, not a re-parse per event.
        out = []
        for _ in range(_SLOW_RUN):
            self._skip_ws()
            if self._pos >= len(self._buf) or self._buf[self._pos] in "]":
                break
            if self._buf[self._pos] == ",":
                self._pos += 1
                continue
            out.extend(self._keep([self._decode_value()]))
        return out

    def _keep(self, values: list[Any]) -> list[Any]:
        """The event objects among ``values``, converted where the reader was given a converter."""
        if self._convert is None:
            return [v for v in values if isinstance(v, dict)]
        converted = (self._convert(v) for v in values)
        return [e for e in converted if e is not None]

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
