"""The columnar ``TracePacket`` layouts of the Perfetto export: slice begin, slice end, counter.

Role in the data flow: :mod:`megascope.export.perfetto` groups a chunk's events by which optional
fields they carry, builds one layout per group here and encodes it with
:mod:`megascope.export.protowire`. Field numbers are those of Perfetto's ``trace_packet.proto`` and
``track_event.proto``; the tests decode the output with the ``perfetto`` package's own classes.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from megascope.export.protowire import Const, Fixed64, Message, Node, Varint, tag_bytes, varint_bytes

U64 = npt.NDArray[np.uint64]

SEQUENCE_ID = 1

# TracePacket
_TIMESTAMP = 8
_SEQUENCE_ID_FIELD = 10
_TRACK_EVENT = 11
_SEQUENCE_FLAGS = 13
SEQ_INCREMENTAL_STATE_CLEARED = 1
SEQ_NEEDS_INCREMENTAL_STATE = 2
# TrackEvent
_CATEGORY_IIDS = 3
_DEBUG_ANNOTATIONS = 4
_TYPE = 9
_NAME_IID = 10
_TRACK_UUID = 11
_DOUBLE_COUNTER_VALUE = 44
_FLOW_IDS = 47
_TERMINATING_FLOW_IDS = 48
TYPE_SLICE_BEGIN = 1
TYPE_SLICE_END = 2
TYPE_COUNTER = 4
# DebugAnnotation
_ANN_NAME_IID = 1
_ANN_INT = 4
_ANN_STRING_IID = 17

# Debug annotations a slice may carry: (name, interned name iid, is an interned string).
ANNOTATIONS: tuple[tuple[str, int, bool], ...] = (
    ("step", 1, False),
    ("microbatch", 2, False),
    ("chunk", 3, False),
    ("group", 4, True),
    ("seq", 5, False),
    ("op", 6, True),
    ("bytes", 7, False),
    ("peer", 8, False),
)


def _varint_field(field: int, value: int) -> bytes:
    return tag_bytes(field, 0) + varint_bytes(value)


_SEQ_CONST = Const(_varint_field(_SEQUENCE_ID_FIELD, SEQUENCE_ID))
_NEEDS_STATE = Const(_varint_field(_SEQUENCE_FLAGS, SEQ_NEEDS_INCREMENTAL_STATE))


def _packet(ts: U64, event: list[Node], *, interned: bool) -> Node:
    children: list[Node] = [Varint(_TIMESTAMP, ts), _SEQ_CONST, Message(_TRACK_EVENT, event)]
    if interned:
        children.append(_NEEDS_STATE)
    return Message(1, children)  # Trace.packet


def slice_begin(
    ts: U64,
    track: U64,
    name_iid: U64,
    category_iid: U64,
    annotations: list[tuple[int, bool, U64]],
    flow: U64 | None,
) -> Node:
    """``annotations``: (name iid, is interned string, values) for the annotations all rows carry."""
    event: list[Node] = [Varint(_CATEGORY_IIDS, category_iid)]
    for name, is_string, values in annotations:
        event.append(Message(_DEBUG_ANNOTATIONS, [
            Const(_varint_field(_ANN_NAME_IID, name)),
            Varint(_ANN_STRING_IID if is_string else _ANN_INT, values),
        ]))
    event += [Const(_varint_field(_TYPE, TYPE_SLICE_BEGIN)), Varint(_NAME_IID, name_iid), Varint(_TRACK_UUID, track)]
    if flow is not None:
        event.append(Fixed64(_FLOW_IDS, flow))
    return _packet(ts, event, interned=True)


def slice_end(ts: U64, track: U64, terminating_flow: U64 | None) -> Node:
    event: list[Node] = [Const(_varint_field(_TYPE, TYPE_SLICE_END)), Varint(_TRACK_UUID, track)]
    if terminating_flow is not None:
        event.append(Fixed64(_TERMINATING_FLOW_IDS, terminating_flow))
    return _packet(ts, event, interned=False)


def counter(ts: U64, track: U64, values: npt.NDArray[np.float64]) -> Node:
    event: list[Node] = [
        Const(_varint_field(_TYPE, TYPE_COUNTER)),
        Varint(_TRACK_UUID, track),
        Fixed64(_DOUBLE_COUNTER_VALUE, values.astype(np.float64)),
    ]
    return _packet(ts, event, interned=False)


def int_annotation_values(values: npt.NDArray[np.int64]) -> U64:
    """int64 annotation values as protobuf varints see them (two's complement)."""
    return values.astype(np.int64).view(np.uint64)


# Track descriptors, encoded one at a time (tens of thousands per run, each different): the bytes
# the ``perfetto`` package's classes serialize, fields in number order, without building objects.
_TRACK_DESCRIPTOR = 60
_TD_UUID = 1
_TD_NAME = 2
_TD_PROCESS = 3
_TD_PARENT_UUID = 5
_TD_COUNTER = 8
_TD_CHILD_ORDERING = 11
_TD_SIBLING_ORDER_RANK = 12
_PD_PID = 1
_PD_PROCESS_NAME = 6
_PD_PROCESS_LABELS = 8
_CD_UNIT_NAME = 6
_PACKET_TAG = tag_bytes(1, 2)
_TD_TAG = tag_bytes(_TRACK_DESCRIPTOR, 2)
_SEQ_FIELD = _varint_field(_SEQUENCE_ID_FIELD, SEQUENCE_ID)


_TAGS = {f: tag_bytes(f, w) for f, w in ((_TD_UUID, 0), (_TD_NAME, 2), (_TD_PROCESS, 2), (_TD_PARENT_UUID, 0),
                                          (_TD_COUNTER, 2), (_TD_CHILD_ORDERING, 0), (_TD_SIBLING_ORDER_RANK, 0))}
_LABEL_TAG = tag_bytes(_PD_PROCESS_LABELS, 2)


def _len_field(field: int, payload: bytes) -> bytes:
    return tag_bytes(field, 2) + varint_bytes(len(payload)) + payload


def track_descriptor(uuid: int, *, name: str | None = None, parent: int | None = None, unit: str | None = None,
                     order: int | None = None, process: bytes | None = None, child_ordering: int | None = None,
                     ) -> bytes:
    """One ``Trace.packet`` holding a ``TrackDescriptor`` on the export's sequence."""
    parts = [_TAGS[_TD_UUID], varint_bytes(uuid)]
    if name is not None:
        encoded = name.encode()
        parts += [_TAGS[_TD_NAME], varint_bytes(len(encoded)), encoded]
    if process is not None:
        parts += [_TAGS[_TD_PROCESS], varint_bytes(len(process)), process]
    if parent is not None:
        parts += [_TAGS[_TD_PARENT_UUID], varint_bytes(parent)]
    if unit is not None:
        parts += [_TAGS[_TD_COUNTER], *_with_length(_len_field(_CD_UNIT_NAME, unit.encode()))]
    if child_ordering is not None:
        parts += [_TAGS[_TD_CHILD_ORDERING], varint_bytes(child_ordering)]
    if order is not None:
        parts += [_TAGS[_TD_SIBLING_ORDER_RANK], varint_bytes(order)]
    desc = b"".join(parts)
    body = b"".join((_SEQ_FIELD, _TD_TAG, varint_bytes(len(desc)), desc))
    return b"".join((_PACKET_TAG, varint_bytes(len(body)), body))


def _with_length(payload: bytes) -> tuple[bytes, bytes]:
    return varint_bytes(len(payload)), payload


def process_descriptor(pid: int, name: str, labels: list[str]) -> bytes:
    """The ``ProcessDescriptor`` of a ``TrackDescriptor`` (pid, name, labels)."""
    parts = [_varint_field(_PD_PID, pid), _len_field(_PD_PROCESS_NAME, name.encode())]
    for label in labels:
        encoded = label.encode()
        parts += [_LABEL_TAG, varint_bytes(len(encoded)), encoded]
    return b"".join(parts)
