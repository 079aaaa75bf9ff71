"""What the pieces of a device-clock span cost the calling thread from Python, beside the C floor
(``bench/gpu_event_floor.c``): a ctypes call that does nothing, ``cuEventRecord`` through ctypes
(the collector's ``record_calls="driver"``), torch's event record, and the host clock a host-clock
span reads. Thread CPU time per call, the median of five runs, the bare loop subtracted.

    python bench/gpu_span_floor.py --n 200000
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable

import torch


def per_call_ns(body: Callable[[int], None], n: int) -> float:
    runs = []
    for _ in range(5):
        t0 = time.thread_time_ns()
        body(n)
        runs.append((time.thread_time_ns() - t0) / n)
        torch.cuda.synchronize()
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=200_000)
    n = parser.parse_args().n
    torch.cuda.init()
    stream = torch.cuda.Stream()
    pool = [torch.cuda.Event(enable_timing=True) for _ in range(1024)]
    handles = [e.cuda_event for e in pool] if hasattr(pool[0], "cuda_event") else []
    with torch.cuda.stream(stream):
        for e in pool:
            e.record()
    torch.cuda.synchronize()
    handles = [int(e.cuda_event) for e in pool]
    raw_stream = int(stream.cuda_stream)
    libc = ctypes.PyDLL(None)
    nothing = libc.labs
    nothing.argtypes, nothing.restype = [ctypes.c_long], ctypes.c_long
    cuda = ctypes.PyDLL("libcuda.so.1")
    record = cuda.cuEventRecord
    record.argtypes, record.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
    torch_record = torch._C._CudaEventBase.record

    def loop(k: int) -> None:
        for i in range(k):
            handles[i & 1023]

    def ctypes_nothing(k: int) -> None:
        for i in range(k):
            handles[i & 1023]
            nothing(i)

    def ctypes_record(k: int) -> None:
        for i in range(k):
            record(handles[i & 1023], raw_stream)

    def torch_records(k: int) -> None:
        for i in range(k):
            torch_record(pool[i & 1023], stream)

    def host_clock(k: int) -> None:
        clock = time.perf_counter_ns
        for i in range(k):
            handles[i & 1023]
            clock()

    base = per_call_ns(loop, n)
    rows = [("bare loop", base)]
    for name, body in (("a ctypes call that does nothing (labs)", ctypes_nothing),
                       ("cuEventRecord through ctypes (PyDLL), a stream of its own", ctypes_record),
                       ("torch's Event.record (its C method), the same stream", torch_records),
                       ("time.perf_counter_ns (a host-clock stamp's clock)", host_clock)):
        rows.append((name, per_call_ns(body, n) - base))
    print(f"what\tns per call from Python (thread CPU, median of 5 x {n}, the bare loop subtracted)")
    for name, ns in rows:
        print(f"{name}\t{ns:.1f}")


if __name__ == "__main__":
    main()
