"""One BLAS thread for the analysis' small linear solves.

Role in the data flow: inside :mod:`megascope.analysis.base`, around the least-squares solve of
the hosts' clock offsets (one equation per host: 128 at 1,024 ranks, 1,536 at 12,288). numpy's
OpenBLAS runs such a solve on every core, and its worker threads then spin, waiting for more
work, long after it is done: on a 2-core machine an export's clock estimate took about 0.1 CPU-s
more that way than with one thread, whose solve takes milliseconds. :func:`one_blas_thread` sets
OpenBLAS to one thread for the block and back after. Where numpy's BLAS is not an OpenBLAS found
in this process (another BLAS, another platform), it does nothing. The offsets, rounded to
whole nanoseconds, came out the same either way on the runs measured (``docs/export.md``).

Example::

    with one_blas_thread():
        offsets = np.linalg.solve(laplacian, rhs)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# (set, get) thread-count functions, as numpy's own OpenBLAS (scipy-openblas, 64-bit ints) and a
# system OpenBLAS name them.
_SYMBOLS = (
    ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
    ("openblas_set_num_threads64_", "openblas_get_num_threads64_"),
    ("openblas_set_num_threads", "openblas_get_num_threads"),
)
_lock = threading.RLock()


@functools.cache
def _openblas() -> tuple[Any, Any] | None:
    """The loaded OpenBLAS's (set, get) thread-count functions, or None."""
    import numpy  # noqa: F401 - loads numpy's BLAS into the process before it is looked for

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    libraries = sorted({line.split()[-1] for line in maps.splitlines()
                        if "openblas" in line.lower() and line.split()[-1].startswith("/")})
    for library in libraries:
        try:
            lib = ctypes.CDLL(library)
        except OSError:
            continue
        for set_name, get_name in _SYMBOLS:
            setter, getter = getattr(lib, set_name, None), getattr(lib, get_name, None)
            if setter is not None and getter is not None:
                setter.argtypes, setter.restype, getter.restype = [ctypes.c_int], None, ctypes.c_int
                return setter, getter
    return None


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """OpenBLAS on one thread inside the block (and the count it had after)."""
    found = _openblas()
    if found is None:
        yield
        return
    setter, getter = found
    with _lock:
        before = getter()
        setter(1)
        try:
            yield
        finally:
            setter(before)
