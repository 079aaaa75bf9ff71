"""Columnar protobuf encoding: many messages of one shape, encoded at once with numpy.

Role in the data flow: the Perfetto exporter turns each batch of spans into hundreds of thousands
of ``TracePacket`` messages that share a shape (a timestamp, a track, a name, a few annotations).
Building them one Python object at a time costs microseconds per message; here a message *layout*
is a small tree of fields whose values are numpy columns, and every row of the layout is encoded at
once into a ``(rows, width)`` byte block.

Every row of a layout has the same width: a varint column is written with as many bytes as its
largest value needs, smaller values padded with continuation bytes (``0x81 0x80 0x00`` is 1 in
three bytes). Protobuf parsers accept such padded varints (Perfetto's own writer pads length
fields the same way), so nested lengths are constants and no per-row masking or copying is needed.
Rows with different optional fields belong to different layouts; the caller interleaves layouts.

Example::

    ts = np.array([1000, 2000], dtype=np.uint64)
    packet = Message(1, [Varint(8, ts), Message(11, [Varint(9, np.array([1, 2], np.uint64))])])
    block = encode(packet, rows=2)      # (2, width) uint8; block.tobytes() is two Trace.packet entries
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

U8 = npt.NDArray[np.uint8]
U64 = npt.NDArray[np.uint64]

WIRE_VARINT = 0
WIRE_FIXED64 = 1
WIRE_LEN = 2


_ONE_BYTE = [bytes((i,)) for i in range(128)]


def varint_bytes(value: int) -> bytes:
    """The minimal varint of one integer (negative ones as 64-bit two's complement)."""
    if 0 <= value < 128:
        return _ONE_BYTE[value]
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@functools.lru_cache(maxsize=256)
def tag_bytes(field_number: int, wire_type: int) -> bytes:
    return varint_bytes((field_number << 3) | wire_type)


def varint_width(max_value: int) -> int:
    """Bytes the minimal varint of ``max_value`` takes: the width of a padded varint column."""
    return max(1, (int(max_value).bit_length() + 6) // 7)


# A write of the bytes that differ between rows, into the whole block.
Op = Callable[[U8], None]


@dataclass(frozen=True)
class Const:
    """The same raw bytes in every row (a whole pre-encoded field)."""

    raw: bytes

    def width(self) -> int:
        return len(self.raw)

    def plan(self, template: U8, col: int, ops: list[Op]) -> int:
        template[col:col + len(self.raw)] = np.frombuffer(self.raw, dtype=np.uint8)
        return col + len(self.raw)


class Varint:
    """A varint field (uint32/64, enum, bool; int64 as two's complement) from a uint64 column."""

    def __init__(self, field_number: int, values: U64) -> None:
        self.field_number = field_number
        self.values = values.astype(np.uint64, copy=False)
        self._tag = tag_bytes(field_number, WIRE_VARINT)
        self._lo, self._hi = (int(self.values.min()), int(self.values.max())) if len(self.values) else (0, 0)
        self._vwidth = varint_width(self._hi)

    def width(self) -> int:
        return len(self._tag) + self._vwidth

    def plan(self, template: U8, col: int, ops: list[Op]) -> int:
        template[col:col + len(self._tag)] = np.frombuffer(self._tag, dtype=np.uint8)
        col += len(self._tag)
        # Bytes from the first one where the lowest and highest value agree on all higher bits
        # on are the same in every row: they go in the template.
        varying = 0
        while varying < self._vwidth and (self._lo >> (7 * varying)) != (self._hi >> (7 * varying)):
            varying += 1
        for k in range(varying, self._vwidth):
            group = (self._hi >> (7 * k)) & 0x7F
            template[col + k] = group | (0x80 if k < self._vwidth - 1 else 0)
        if varying:
            ops.append(functools.partial(self._write, col=col, varying=varying))
        return col + self._vwidth

    def _write(self, block: U8, col: int, varying: int) -> None:
        for k in range(varying):
            group = (self.values >> np.uint64(7 * k)).astype(np.uint8) if k else self.values.astype(np.uint8)
            if k < self._vwidth - 1:
                group |= np.uint8(0x80)
            else:
                group &= np.uint8(0x7F)
            block[:, col + k] = group


@dataclass(frozen=True)
class Fixed64:
    """A fixed64 / double field (one element of a non-packed repeated one, such as ``flow_ids``)."""

    field_number: int
    values: npt.NDArray[np.uint64] | npt.NDArray[np.float64]

    def width(self) -> int:
        return len(tag_bytes(self.field_number, WIRE_FIXED64)) + 8

    def plan(self, template: U8, col: int, ops: list[Op]) -> int:
        tag = tag_bytes(self.field_number, WIRE_FIXED64)
        template[col:col + len(tag)] = np.frombuffer(tag, dtype=np.uint8)
        col += len(tag)
        ops.append(functools.partial(self._write, col=col))
        return col + 8

    def _write(self, block: U8, col: int) -> None:
        rows = block.shape[0]
        little = np.ascontiguousarray(self.values).astype(self.values.dtype.newbyteorder("<"), copy=False)
        block[:, col:col + 8] = little.view(np.uint8).reshape(rows, 8)


class Node(Protocol):
    """A field of a layout: its constant width, its bytes common to every row (written into the
    template row) and the writes of those that differ."""

    def width(self) -> int: ...

    def plan(self, template: U8, col: int, ops: list[Op]) -> int: ...


@dataclass(frozen=True)
class Message:
    """A length-delimited sub-message; its length is the same in every row."""

    field_number: int
    children: list[Node]

    def body_width(self) -> int:
        return sum(child.width() for child in self.children)

    def width(self) -> int:
        body = self.body_width()
        return len(tag_bytes(self.field_number, WIRE_LEN)) + len(varint_bytes(body)) + body

    def plan(self, template: U8, col: int, ops: list[Op]) -> int:
        head = tag_bytes(self.field_number, WIRE_LEN) + varint_bytes(self.body_width())
        template[col:col + len(head)] = np.frombuffer(head, dtype=np.uint8)
        col += len(head)
        for child in self.children:
            col = child.plan(template, col, ops)
        return col


def encode(node: Node, rows: int) -> U8:
    """All ``rows`` rows of ``node``, one row per line of the returned ``(rows, width)`` block.

    The bytes every row shares (tags, lengths, constants, the high bytes of varints whose values
    agree there) are laid out once in a template row and tiled; only the bytes that differ are
    then written, column by column."""
    width = node.width()
    if not rows:
        return np.empty((0, width), dtype=np.uint8)
    template = np.zeros(width, dtype=np.uint8)
    ops: list[Op] = []
    end = node.plan(template, 0, ops)
    assert end == width
    block = np.tile(template, rows).reshape(rows, width)
    for op in ops:
        op(block)
    return block
