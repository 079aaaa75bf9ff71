"""The compiled Kineto scanner keeps exactly what the Python path keeps, or refuses the file."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from ingest_fixtures import gpu_trace, write_trace

from megascope.ingest import kineto_events
from megascope.ingest.jsonstream import TraceReader
from megascope.ingest.kineto_events import RankEvents, collect

pytestmark = pytest.mark.skipif(kineto_events._kscan is None,
                                reason="the compiled scanner (megascope/ingest/_kscan.c) is not built here")


def reader(path: Path, chunk: int) -> TraceReader:
    return TraceReader(path, chunk_chars=chunk, decode_batch=kineto_events.decode_batch,
                       convert=kineto_events.event_from_json)


def kept(events: RankEvents) -> str:
    """Everything collect() keeps, types and order included (1 == 1.0, but not in a repr)."""
    return repr((events.header, events.trailer, events.events, events.pid, events.first_ts, events.last_ts,
                 events.steps, list(events.thread_names.items()), list(events.ops.items()),
                 list(events.flow_fwd.items()), list(events.flow_bwd.items()), list(events.runtime.items()),
                 events.device, events.comm_calls))


def scanned(path: Path, chunk: int) -> bool:
    """Whether the scanner reads the whole file (rather than refusing it)."""
    out = RankEvents(header={})
    scanner = kineto_events._kscan.Collector(out.ops, out.runtime, out.device, out.comm_calls, out.steps,
                                             out.flow_fwd, out.flow_bwd, out.thread_names, kineto_events.CommCall)
    return reader(path, chunk).scan_events(scanner.scan)


def odd_trace(seed: int) -> dict[str, Any]:
    """A two-rank job's trace with what JSON allows and Kineto sometimes writes: escapes, non-ASCII
    names, integer times, exponents, string thread ids, nested arguments, keys in any order."""
    rng = random.Random(seed)
    trace = gpu_trace(0, 2, steps=4)
    events = trace["traceEvents"]
    names = ['op "quoted" \\ back', "naïve µs op", "emoji \U0001f600 op", "tab\there", "lambda#1}, at::x<{a}>",
             "nccl:all_reduce", "gloo:all_reduce", "c10d::allreduce_"]
    for i in range(60):
        ts = rng.choice([rng.randrange(1, 10**6), rng.uniform(1, 1e6), float(f"{rng.uniform(1, 9):.3f}e5")])
        event: dict[str, Any] = {"ph": "X", "cat": rng.choice(["cpu_op", "user_annotation", "kernel", "cuda_runtime",
                                                             "gpu_memcpy", "python_function", "fwdbwd"]),
                                 "name": rng.choice(names), "pid": rng.choice([1, "Spans", ""]),
                                 "tid": rng.choice([1, 2, "stream 7", "PyTorch Profiler"]), "ts": ts,
                                 "dur": rng.choice([rng.randrange(0, 500), rng.uniform(0, 500), 1e-7, "n/a"])}
        event["args"] = rng.choice([None, {}, {"correlation": 900000 + i, "stream": 7, "device": 0,
                                               "nested": {"a": [1, {"b": "},{"}], "c": [[], {}]},
                                               "Input Dims": [[4, 8], []], "Input type": ["float", ""],
                                               "Collective name": "allreduce", "In msg nelems": 32,
                                               "dtype": "Float", "Seq": i, "bytes": 1.5e3}])
        keys = list(event)
        rng.shuffle(keys)
        events.insert(rng.randrange(len(events)), {k: event[k] for k in keys})
    events.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": "stream 7", "args": {"name": "wörker \\ 7"}})
    events.append({"ph": "s", "cat": "fwdbwd", "name": "fwdbwd", "id": 3, "pid": 1, "tid": 2, "ts": 12})
    events.append({"ph": "i", "s": "g", "name": "Record Window End", "pid": "", "tid": "", "ts": 5.0})
    return trace


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("layout", ["indented", "compact"])
@pytest.mark.parametrize("chunk", [97, 1 << 20])
def test_scanner_keeps_what_the_python_path_keeps(tmp_path: Path, seed: int, layout: str, chunk: int) -> None:
    trace = odd_trace(seed)
    path = tmp_path / "rank0.json"
    if layout == "indented":  # escapes for every non-ASCII character
        write_trace(path, trace)
    else:  # no spaces, non-ASCII characters as they are (UTF-8)
        path.write_text(json.dumps(trace, separators=(",", ":"), ensure_ascii=False), encoding="utf-8")
    assert scanned(path, chunk)  # read by the scanner, not by the fallback
    fast = collect(reader(path, chunk), scan=True)  # chunk 97: events cut anywhere between two reads
    slow = collect(reader(path, 1 << 20), scan=False)
    assert fast.events == len(trace["traceEvents"])
    assert fast.device and fast.comm_calls and fast.steps and fast.thread_names
    assert kept(fast) == kept(slow)


@pytest.mark.parametrize("event", [
    '{"ph": "X", "ph": "X", "cat": "cpu_op", "name": "twice", "ts": 1, "dur": 1}',  # a key twice
    '{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1, "args": [1, 2]}',  # args not an object
    '{"ph": "X", "cat": "cpu_op", "name": "lone \\ud800", "ts": 1, "dur": 1}',  # a lone surrogate
    '{"ph": "X", "cat": "cpu_op", "name": "big", "ts": 123456789012345678901, "dur": 1}',  # past 64 bits
    '{"ph": "X", "cat": "cpu_op", "n\\u0061me": "escaped key", "ts": 1, "dur": 1}',
    '{"ph": "X", "cat": "cpu_op", "name": "ProfilerStep#\\u0661", "ts": 1, "dur": 1}',  # an Arabic-Indic digit
])
def test_a_refused_file_is_read_by_the_python_path(tmp_path: Path, event: str) -> None:
    text = json.dumps(gpu_trace(0, 2, steps=2), indent=1)
    cut = text.index('"traceEvents": [') + len('"traceEvents": [')
    path = tmp_path / "rank0.json"
    path.write_text(text[:cut] + event + "," + text[cut:])
    assert not scanned(path, 1 << 20)
    assert kept(collect(reader(path, 1 << 20), scan=True)) == kept(collect(reader(path, 1 << 20), scan=False))


def test_the_environment_switches_the_scanner_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kineto_events.SCANNER_ENV, "0")
    assert not kineto_events.scanner_enabled()
    monkeypatch.setenv(kineto_events.SCANNER_ENV, "1")
    assert kineto_events.scanner_enabled()
