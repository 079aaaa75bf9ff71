"""Keep the memory an export frees for its next chunk, instead of handing it back to the system.

Role in the data flow: around :func:`megascope.export.perfetto.export_perfetto`. Each chunk
allocates the same few hundred MB of numpy arrays and byte buffers as the one before. With glibc's
defaults most of them are mapped afresh and given back when freed (arrays above its mmap
threshold, a heap trimmed above its trim threshold), so every chunk pays its page faults again:
on a virtual machine about a third of an export's CPU time went to the kernel. While
:func:`kept_heap` is open, allocations up to 32 MiB come from the heap and freed memory stays
there; when it closes the trim threshold is glibc's usual ceiling again and the heap is trimmed.
pyarrow's buffers (row groups read, tables taken and joined) come from the same heap meanwhile:
its default pool (mimalloc) gives freed pages back to the system after a short delay, and the next
chunk faults them in again; on the system allocator an export at 1,024 ranks took 0.07 to 0.15
CPU-s less on average (two sets of six, on a shared 2-core machine). Elsewhere than glibc it does
nothing.

Example::

    with kept_heap():
        ...  # chunk after chunk of the same size
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Iterator
from typing import Any

import pyarrow as pa

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20  # glibc's largest (and its dynamic threshold's ceiling on 64-bit)
_KEPT_TRIM_THRESHOLD = 1 << 30
_TRIM_THRESHOLD = 2 * _MMAP_THRESHOLD  # the ceiling of glibc's dynamic trim threshold


def _glibc() -> Any | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")  # the process's own C library, already loaded
        version = libc.gnu_get_libc_version  # glibc only
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    return libc


@contextlib.contextmanager
def kept_heap() -> Iterator[None]:
    libc = _glibc()
    if libc is None:
        yield
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    libc.mallopt(_M_TRIM_THRESHOLD, _KEPT_TRIM_THRESHOLD)
    arrow_pool = pa.default_memory_pool()
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        yield
    finally:
        pa.set_memory_pool(arrow_pool)
        libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
        libc.malloc_trim(0)
