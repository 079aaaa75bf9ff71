"""Track ids, and the order in which slice begin/end events are written so that they nest.

Role in the data flow: both exporters place each span on a track (rank, stream, lane) and write its
begin and end in an order a trace viewer can rebuild slices from. A track is a stack: its slices must
nest. Spans of one stream usually do (a step holds micro-batches, a micro-batch holds layers), but
asynchronous communication (an ``isend`` in flight while the next ``irecv`` starts) can overlap
partially; such spans move to extra lanes of the same stream (``comm #2``), found greedily, only on
the tracks where the nesting check fails.

The nesting check is vectorised: with events sorted per track by (time, end-before-begin, outer
first), the stack height just before a span's end must be one more than it was just before its
begin. If every span passes, the begin/end sequence is a valid bracket sequence (the first wrong pop
would need a span whose height is off).

Track ids are deterministic (``(rank + 1) << 24 | stream code << 8 | lane``), so the same run
exports the same bytes.

Example::

    base = track_base(ranks, stream_codes(streams))
    track, span_index, is_end = assign_lanes(base, start, end)
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import numpy.typing as npt
import pandas as pd

I64 = npt.NDArray[np.int64]
U64 = npt.NDArray[np.uint64]

# Fixed codes for the streams megascope names; other streams hash into the space above 1024.
_KNOWN_STREAMS = {"host": 1, "compute": 2, "comm": 3, "copy": 4}
STEP_COUNTER_CODE = 8  # the per-rank "step time" counter track
MAX_LANES = 255


def stream_code(stream: str) -> int:
    """A 16-bit code per stream name, fixed for known streams, stable for any other."""
    if stream in _KNOWN_STREAMS:
        return _KNOWN_STREAMS[stream]
    if stream.startswith("cuda:") and stream[5:].isdigit() and int(stream[5:]) < 1000:
        return 16 + int(stream[5:])
    digest = int.from_bytes(hashlib.blake2b(stream.encode(), digest_size=4).digest(), "little")
    return 1024 + digest % (65536 - 1024)


def stream_sort_key(stream: str) -> tuple[int, str]:
    """Display order of a rank's streams: host, compute, comm, copy, device streams, the rest."""
    code = stream_code(stream)
    return (code if code < 1024 else 1024, stream)


def process_uuid(rank: int) -> int:
    return (rank + 1) << 24


def track_base(ranks: I64, codes: I64) -> U64:
    """Track ids with lane 0, one per span."""
    return ((ranks.astype(np.uint64) + np.uint64(1)) << np.uint64(24)) | (codes.astype(np.uint64) << np.uint64(8))


def step_counter_uuid(rank: int) -> int:
    return process_uuid(rank) | (STEP_COUNTER_CODE << 8)


Tiebreak = Callable[[I64], list[I64]]


def event_order(track: U64, start: I64, end: I64, tiebreak: Tiebreak | None = None) -> tuple[I64, npt.NDArray[np.bool_]]:
    """The write order of the 2n begin/end events of n spans.

    Returns ``(span_index, is_end)`` per event, sorted by track, then time; at equal times ends of
    non-empty spans come first, then begins (outer before inner), then ends of empty spans; ends at
    one time close inner spans first. Span ``i`` is "outer" to ``j`` when it sorts first by
    (start, longer first, ``tiebreak``). ``tiebreak(spans)`` gives further keys (most significant
    first) for those spans, which share a track, start and end; with keys that tell every two
    different spans apart, the order depends on the spans only, never on the order they came in
    (without, the input order decides).

    Tracks, times and the event kind are packed into one int64 key where they fit (the usual
    case: a few thousand tracks, hours of nanoseconds), so each ordering is one stable sort of
    data that is mostly in order already; otherwise a four-key ``lexsort`` does the same.
    """
    n = len(track)
    if n == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.bool_)
    codes, uniques = pd.factorize(track, sort=True)
    t0 = int(start.min())
    code_bits = max(1, (len(uniques) - 1).bit_length())
    time_bits = max(1, (int(max(end.max(), start.max())) - t0).bit_length())
    if code_bits + time_bits + 2 > 63 or int(end.min()) < t0:
        return _event_order_lexsort(track, start, end, tiebreak)
    track_key = codes.astype(np.int64) << np.int64(time_bits + 2)
    start_key = track_key | ((start - t0) << np.int64(2))
    # spans outer-first: by (track, start), ties by longer first, then the tiebreak keys
    spans = np.argsort(start_key, kind="stable")
    sorted_keys = start_key[spans]
    tie = sorted_keys[1:] == sorted_keys[:-1]
    if tie.any():
        tied = np.zeros(n, dtype=np.bool_)
        tied[1:] = tie
        tied[:-1] |= tie
        pos = np.flatnonzero(tied)  # whole blocks of equal (track, start), in place
        block = np.cumsum(np.concatenate([[0], ~tie]))[pos]
        # by (block, longer first, index): within a block ``spans`` is in index order already, so
        # one stable sort of (block, end descending) packed into an int64 where it fits
        later = end[spans[pos]] - t0
        block_bits = max(1, int(block[-1]).bit_length())
        end_bits = max(1, int(later.max()).bit_length())
        if block_bits + end_bits <= 62:
            order = np.argsort((block << np.int64(end_bits)) | ((1 << end_bits) - 1 - later), kind="stable")
        else:
            order = np.lexsort((spans[pos], -end[spans[pos]], block))
        spans[pos], block = spans[pos][order], block[order]
        if tiebreak is not None:  # spans that also end together: their fields decide
            sub = spans[pos]
            same = (block[1:] == block[:-1]) & (end[sub[1:]] == end[sub[:-1]])
            if same.any():
                both = np.zeros(len(pos), dtype=np.bool_)
                both[1:] = same
                both[:-1] |= same
                inner = np.flatnonzero(both)
                group = np.cumsum(np.concatenate([[0], ~same]))[inner]
                keys = [group, *tiebreak(sub[inner]), sub[inner]]
                spans[pos[inner]] = sub[inner][np.lexsort(keys[::-1])]
    # begins in that order carry kind 1; ends in the reverse order (inner first at equal times),
    # kind 0 (2 for an empty span, whose end follows the begins at its time)
    begin_keys = start_key[spans] | 1
    closing = spans[::-1]
    end_keys = track_key[closing] | ((end[closing] - t0) << np.int64(2)) | np.where(end[closing] == start[closing], 2, 0)
    by_end = np.argsort(end_keys, kind="stable")
    # two sorted runs whose keys never tie (the kind bits differ): the stable sort merges them
    order = np.argsort(np.concatenate([begin_keys, end_keys[by_end]]), kind="stable")
    return np.concatenate([spans, closing[by_end]])[order], order >= n


def _event_order_lexsort(track: U64, start: I64, end: I64, tiebreak: Tiebreak | None = None,
                         ) -> tuple[I64, npt.NDArray[np.bool_]]:
    """:func:`event_order` by a many-key sort, for keys too wide to pack."""
    n = len(track)
    everyone = np.arange(n)
    # rank spans outer-first within equal starts: by (track, start, -end, tiebreak, index)
    extra = tiebreak(everyone) if tiebreak is not None else []
    span_rank = np.empty(n, dtype=np.int64)
    span_rank[np.lexsort([everyone, *extra[::-1], -end, start, track])] = everyone
    idx = np.concatenate([everyone, everyone])
    is_end = np.concatenate([np.zeros(n, dtype=np.bool_), np.ones(n, dtype=np.bool_)])
    ts = np.concatenate([start, end])
    empty = end == start
    kind = np.concatenate([np.ones(n, dtype=np.int8), np.where(empty, 2, 0).astype(np.int8)])
    tie = np.concatenate([span_rank, -span_rank])
    tracks = np.concatenate([track, track])
    order = np.lexsort((tie, kind, ts, tracks))
    return idx[order], is_end[order]


def nesting_violations(track: U64, span_index: I64, is_end: npt.NDArray[np.bool_]) -> U64:
    """Tracks whose slices do not nest; ``track`` per span, events as :func:`event_order` gives them."""
    n = len(track)
    delta = np.where(is_end, -1, 1).astype(np.int64)
    before = np.cumsum(delta) - delta
    depth = np.empty(n, dtype=np.int64)
    depth[span_index[~is_end]] = before[~is_end]
    end_ok = before[is_end] == depth[span_index[is_end]] + 1
    bad_spans = span_index[is_end][~end_ok]
    return np.unique(track[bad_spans])


def _greedy_lanes(start: I64, end: I64) -> I64:
    """Lanes for the spans of one track: each span goes to the first lane where it nests."""
    order = np.lexsort((np.arange(len(start)), -end, start))
    lanes = np.zeros(len(start), dtype=np.int64)
    stacks: list[list[int]] = []
    for i in order.tolist():
        s, e = int(start[i]), int(end[i])
        placed = False
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= s:
                stack.pop()
            if not stack or stack[-1] >= e:
                stack.append(e)
                lanes[i] = min(lane, MAX_LANES)
                placed = True
                break
        if not placed:
            stacks.append([e])
            lanes[i] = min(len(stacks) - 1, MAX_LANES)
    return lanes


def assign_lanes(base: U64, start: I64, end: I64, tiebreak: Tiebreak | None = None,
                 ) -> tuple[U64, I64, npt.NDArray[np.bool_]]:
    """``base`` with a lane added where spans of one track overlap without nesting, and the
    write order of the events on the final tracks (as :func:`event_order` gives it). Spans with
    the same start and end get the same lane, so lanes do not depend on the input order."""
    span_index, is_end = event_order(base, start, end, tiebreak)
    bad = nesting_violations(base, span_index, is_end)
    if len(bad) == 0:
        return base, span_index, is_end
    out = base.copy()
    for track in bad.tolist():
        rows = np.flatnonzero(base == np.uint64(track))
        out[rows] = base[rows] | _greedy_lanes(start[rows], end[rows]).astype(np.uint64)
    span_index, is_end = event_order(out, start, end, tiebreak)
    return out, span_index, is_end
