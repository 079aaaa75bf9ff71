"""Perfetto export: decoded with the perfetto package's own protos and checked against the run."""

from __future__ import annotations

import io
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from megascope.cli import main
from megascope.errors import ConfigError
from megascope.export import export_perfetto
from megascope.export.protowire import Const, Fixed64, Message, Varint, encode
from megascope.export.tracks import assign_lanes, event_order, nesting_violations
from megascope.inject import parse_injects
from megascope.store import open_run
from megascope.synth import SynthConfig, synth_run

STRAGGLER = 5


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "run"
    synth_run(out, SynthConfig(ranks=16, steps=3, tp=2, pp=2, seed=3,
                               faults=parse_injects([f"straggler:rank={STRAGGLER},factor=1.6"])))
    return out


def _spans(run_dir: Path, where: str = "TRUE") -> list[dict[str, Any]]:
    run = open_run(run_dir)
    return run.con.sql(f'SELECT * FROM spans WHERE {where}').to_arrow_table().to_pylist()


class Decoded:
    """A trace replayed the way a viewer does: interned names, tracks, slices from begin/end stacks."""

    def __init__(self, data: bytes) -> None:
        trace = pb.Trace()
        trace.ParseFromString(data)
        self.packets = list(trace.packet)
        self.names: dict[int, str] = {}
        self.strings: dict[int, str] = {}
        self.ann_names: dict[int, str] = {}
        self.tracks: dict[int, pb.TrackDescriptor] = {}
        self.metadata: dict[str, str] = {}
        self.slices: list[dict[str, Any]] = []
        self.counters: dict[int, list[tuple[int, float]]] = defaultdict(list)
        stacks: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for p in self.packets:
            for e in p.interned_data.event_names:
                self.names[e.iid] = e.name
            for e in p.interned_data.debug_annotation_names:
                self.ann_names[e.iid] = e.name
            for e in p.interned_data.debug_annotation_string_values:
                self.strings[e.iid] = e.str.decode()
            if p.HasField("track_descriptor"):
                self.tracks[p.track_descriptor.uuid] = p.track_descriptor
            for m in p.chrome_events.metadata:
                self.metadata[m.name] = m.string_value
            if not p.HasField("track_event"):
                continue
            ev = p.track_event
            assert ev.track_uuid in self.tracks, "a descriptor must precede its track's events"
            if ev.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
                args = {}
                for a in ev.debug_annotations:
                    key = self.ann_names[a.name_iid]
                    args[key] = self.strings[a.string_value_iid] if a.HasField("string_value_iid") else a.int_value
                stacks[ev.track_uuid].append({"name": self.names[ev.name_iid], "ts": p.timestamp,
                                              "track": ev.track_uuid, "args": args, "flows": list(ev.flow_ids),
                                              "terminating": []})
            elif ev.type == pb.TrackEvent.TYPE_SLICE_END:
                top = stacks[ev.track_uuid].pop()
                top["dur"] = p.timestamp - top["ts"]
                top["terminating"] = list(ev.terminating_flow_ids)
                self.slices.append(top)
            elif ev.type == pb.TrackEvent.TYPE_COUNTER:
                self.counters[ev.track_uuid].append((p.timestamp, ev.double_counter_value))
        assert not any(stacks.values()), "every begin has an end"

    @property
    def shift(self) -> int:
        return int(self.metadata["megascope.time_shift_ns"])

    def process_of(self, track_uuid: int) -> pb.TrackDescriptor:
        desc = self.tracks[track_uuid]
        while not desc.HasField("process"):
            desc = self.tracks[desc.parent_uuid]
        return desc

    def rank_of(self, track_uuid: int) -> int:
        return self.process_of(track_uuid).process.pid - 1


def _export(run_dir: Path, **kwargs: Any) -> Decoded:
    """Exact-time checks compare with the recorded clocks: ``clock="raw"`` unless a test asks."""
    buf = io.BytesIO()
    export_perfetto(run_dir, buf, **{"clock": "raw", **kwargs})
    return Decoded(buf.getvalue())


def test_protowire_layout_decodes_with_perfetto_protos() -> None:
    rng = np.random.default_rng(0)
    n = 500
    ts = rng.integers(0, 2**62, n).astype(np.uint64)
    uuid = rng.integers(1, 2**40, n).astype(np.uint64)
    flow = rng.integers(0, 2**63, n).astype(np.uint64)
    step = rng.integers(-5, 1000, n).astype(np.int64).view(np.uint64)
    node = Message(1, [Varint(8, ts), Message(11, [
        Message(4, [Const(b"\x08\x07"), Varint(4, step)]), Const(b"\x48\x01"), Varint(11, uuid), Fixed64(47, flow)])])
    trace = pb.Trace()
    trace.ParseFromString(encode(node, n).tobytes())
    assert len(trace.packet) == n
    for i in (0, 1, 77, n - 1):
        p = trace.packet[i]
        assert p.timestamp == ts[i]
        assert p.track_event.track_uuid == uuid[i]
        assert list(p.track_event.flow_ids) == [flow[i]]
        assert p.track_event.debug_annotations[0].int_value == int(step.view(np.int64)[i])
        assert p.track_event.type == pb.TrackEvent.TYPE_SLICE_BEGIN


def test_every_span_is_one_slice_on_its_rank_and_stream(run_dir: Path) -> None:
    trace = _export(run_dir)
    spans = _spans(run_dir)
    expected = Counter((s["rank"], s["name"], s["stream"], s["start_ns"] + trace.shift, s["dur_ns"]) for s in spans)
    got = Counter()
    for sl in trace.slices:
        stream = trace.tracks[sl["track"]].name.split(" #")[0]
        got[(trace.rank_of(sl["track"]), sl["name"], stream, sl["ts"], sl["dur"])] += 1
    assert got == expected
    # processes are named with host and mesh coordinates from the ranks table
    ranks = {r["rank"]: r for r in open_run(run_dir).con.sql("SELECT * FROM ranks").fetchdf().to_dict("records")}
    proc = {d.process.pid - 1: d.process.process_name for d in trace.tracks.values() if d.HasField("process")}
    assert set(proc) == set(ranks)
    r = ranks[9]
    c = r["coords"]
    assert proc[9].startswith(f"rank 9 · {r['host']} · pp{c['pp']} dp{c['dp']} tp{c['tp']}")
    assert "straggler" not in proc[9]


def test_slice_args_carry_the_span_columns(run_dir: Path) -> None:
    trace = _export(run_dir, ranks=[2])
    spans = {(s["name"], s["start_ns"] + trace.shift): s for s in _spans(run_dir, "rank = 2")}
    seen_comm = 0
    for sl in trace.slices:
        span = spans[(sl["name"], sl["ts"])]
        for key in ("step", "microbatch", "seq", "bytes", "peer", "group", "op"):
            assert sl["args"].get(key) == span[key]
        seen_comm += span["group"] is not None
    assert seen_comm > 0


def test_flows_link_collective_members_and_sends_to_receives(run_dir: Path) -> None:
    trace = _export(run_dir)
    by_flow: dict[int, set[int]] = defaultdict(set)
    for sl in trace.slices:
        for f in sl["flows"]:
            by_flow[f].add(trace.rank_of(sl["track"]))
    spans = _spans(run_dir)
    instances: dict[tuple[str, int], set[int]] = defaultdict(set)
    for s in spans:
        if s["kind"] == "collective":
            instances[(s["group"], s["seq"])].add(s["rank"])
    member_sets = Counter(frozenset(v) for v in by_flow.values() if len(v) > 1)
    assert member_sets == Counter(frozenset(v) for v in instances.values())
    # each send's flow is terminated by exactly the matching receive's end
    terminated = {f: trace.rank_of(sl["track"]) for sl in trace.slices for f in sl["terminating"]}
    sends = [sl for sl in trace.slices if sl["name"] == "send"]
    assert sends
    for sl in sends:
        (flow,) = sl["flows"]
        assert terminated[flow] == sl["args"]["peer"]


def test_same_run_same_bytes(run_dir: Path) -> None:
    outputs = []
    for _ in range(2):
        buf = io.BytesIO()
        export_perfetto(run_dir, buf, chunk_rows=300, clock="raw")  # several chunks
        outputs.append(buf.getvalue())
    assert outputs[0] == outputs[1]
    # chunking changes the packing, never the content
    small, whole = Decoded(outputs[0]), _export(run_dir)
    key = lambda sl: (sl["track"], sl["ts"], sl["dur"], sl["name"])  # noqa: E731
    assert sorted(map(key, small.slices)) == sorted(map(key, whole.slices))


def test_selection_by_ranks_steps_and_window(run_dir: Path) -> None:
    trace = _export(run_dir, ranks=[1, 6], steps=(1, 1))
    want = Counter((s["rank"], s["name"], s["start_ns"] + trace.shift) for s in _spans(run_dir, "rank IN (1, 6) AND step = 1"))
    assert Counter((trace.rank_of(sl["track"]), sl["name"], sl["ts"]) for sl in trace.slices) == want
    spans = _spans(run_dir)
    lo = min(s["start_ns"] for s in spans) + 50_000_000
    hi = lo + 20_000_000
    trace = _export(run_dir, window=(lo, hi))
    want = Counter((s["rank"], s["start_ns"] + trace.shift)
                   for s in spans if s["start_ns"] <= hi and s["start_ns"] + s["dur_ns"] >= lo)
    assert Counter((trace.rank_of(sl["track"]), sl["ts"]) for sl in trace.slices) == want
    with pytest.raises(ConfigError):
        export_perfetto(run_dir, io.BytesIO(), ranks=[999])


def test_around_stragglers_keeps_the_straggler_and_who_waits_for_it(run_dir: Path) -> None:
    buf = io.BytesIO()
    stats = export_perfetto(run_dir, buf, around_stragglers=True)
    assert stats.stragglers[0] == STRAGGLER
    trace = Decoded(buf.getvalue())
    kept = {trace.rank_of(sl["track"]) for sl in trace.slices}
    groups = {g["group"] for g in _spans(run_dir, f"rank = {STRAGGLER} AND kind = 'collective'")}
    peers = {s["rank"] for s in _spans(run_dir) if s["group"] in groups}
    assert STRAGGLER in kept and peers <= kept and len(kept) < 16
    proc = {d.process.pid - 1: d.process.process_name for d in trace.tracks.values() if d.HasField("process")}
    assert proc[STRAGGLER].endswith("straggler")


def test_estimated_clock_offsets_are_applied_and_stated(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pandas as pd

    from megascope.export import selection

    hosts = sorted({r["host"] for r in open_run(run_dir).con.sql("SELECT host FROM ranks").to_arrow_table().to_pylist()})
    offsets = {h: (i + 1) * 1_000_000 for i, h in enumerate(hosts)}
    frame = pd.DataFrame({"host": hosts, "offset_ns": [offsets[h] for h in hosts], "error_ns": 5_000, "samples": 10})
    monkeypatch.setattr(selection, "estimate_clock_offsets", lambda con, spans_of=None: frame)
    trace = _export(run_dir, ranks=[0, 15], clock="estimated")
    host_of = {r["rank"]: r["host"] for r in open_run(run_dir).con.sql("SELECT * FROM ranks").to_arrow_table().to_pylist()}
    want = Counter((s["rank"], s["start_ns"] + offsets[host_of[s["rank"]]] + trace.shift)
                   for s in _spans(run_dir, "rank IN (0, 15)"))
    assert Counter((trace.rank_of(sl["track"]), sl["ts"]) for sl in trace.slices) == want
    assert trace.metadata["megascope.clock_correction"].startswith("estimated")
    assert str(offsets[hosts[-1]]) in trace.metadata["megascope.clock_offsets_ns"]


def test_spans_are_read_while_the_ranks_and_the_clock_are_resolved(run_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a window the first chunks are read before the ranks table is read and the offsets
    are known; the offsets are added to every span all the same."""
    import threading

    import pandas as pd

    from megascope.export import perfetto, selection, source

    read = threading.Event()
    to_chunk, resolve = source._to_chunk, perfetto.resolve

    def reading(*args: Any, **kwargs: Any) -> Any:
        read.set()
        return to_chunk(*args, **kwargs)

    def resolving(*args: Any, **kwargs: Any) -> Any:
        assert read.wait(timeout=60), "no span was read while the ranks and the clock were resolved"
        return resolve(*args, **kwargs)

    host_of = {r["rank"]: r["host"] for r in open_run(run_dir).con.sql("SELECT * FROM ranks").to_arrow_table().to_pylist()}
    hosts = sorted(set(host_of.values()))
    offsets = {h: (i + 1) * 3_000_000 for i, h in enumerate(hosts)}
    frame = pd.DataFrame({"host": hosts, "offset_ns": [offsets[h] for h in hosts], "error_ns": 5_000, "samples": 10})
    monkeypatch.setattr(source, "_to_chunk", reading)
    monkeypatch.setattr(perfetto, "resolve", resolving)
    monkeypatch.setattr(selection, "estimate_clock_offsets", lambda con, spans_of=None: frame)
    trace = _export(run_dir, clock="estimated", chunk_rows=300)
    want = Counter((s["rank"], s["start_ns"] + offsets[host_of[s["rank"]]] + trace.shift) for s in _spans(run_dir))
    assert Counter((trace.rank_of(sl["track"]), sl["ts"]) for sl in trace.slices) == want


def test_raw_clocks_are_stated(run_dir: Path) -> None:
    trace = _export(run_dir, ranks=[0])
    assert trace.metadata["megascope.clock_correction"].startswith("raw")
    assert trace.metadata["megascope.clock_offsets_ns"] == "{}"


def test_the_export_estimates_the_offsets_the_analysis_does(tmp_path: Path) -> None:
    """The offsets-only estimate gives the analysis' offsets, on a fresh run and from built base tables."""
    from megascope import analysis
    from megascope.analysis.base import estimate_clock_offsets

    out = tmp_path / "run"
    synth_run(out, SynthConfig(ranks=32, steps=4, tp=2, pp=2, gpus_per_host=4, seed=11))
    alone = estimate_clock_offsets(open_run(out).con)
    run = open_run(out)
    full = analysis.clock_offsets(run)
    assert alone["host"].tolist() == full["host"].tolist()
    assert alone["offset_ns"].tolist() == full["offset_ns"].tolist()
    assert estimate_clock_offsets(run.con)["offset_ns"].tolist() == full["offset_ns"].tolist()  # read back
    truth = run.meta.config["synth"]["clock_offsets_ns"]
    ref = truth[alone["host"][0]]
    for host, offset in zip(alone["host"], alone["offset_ns"], strict=True):
        assert abs(offset - (ref - truth[host])) < 1_000_000


def test_a_failed_clock_estimate_is_one_line_naming_the_raw_clock(run_dir: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import duckdb

    from megascope.errors import ExportError
    from megascope.export import selection

    def broken(con: Any, spans_of: Any = None) -> Any:
        raise duckdb.IOException("IO Error: cannot read part-7.parquet\nmore detail")

    monkeypatch.setattr(selection, "estimate_clock_offsets", broken)
    with pytest.raises(ExportError, match="--clock raw") as info:
        export_perfetto(run_dir, io.BytesIO())
    assert "\n" not in str(info.value) and "part-7" in str(info.value)
    out = tmp_path / "t.pftrace"
    result = CliRunner().invoke(main, ["export", "perfetto", str(run_dir), "-o", str(out)])
    assert result.exit_code == 1 and result.stderr.startswith("Error: ") and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()
    result = CliRunner().invoke(main, ["export", "perfetto", str(run_dir), "-o", str(out), "--clock", "raw", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["clock_correction"].startswith("raw")
    with pytest.raises(ConfigError, match="unknown clock"):
        export_perfetto(run_dir, io.BytesIO(), clock="wrong")


def test_step_time_counters_match_step_spans(run_dir: Path) -> None:
    trace = _export(run_dir, ranks=[3])
    steps = sorted((s["start_ns"] + trace.shift, s["dur_ns"] / 1e6) for s in _spans(run_dir, "rank = 3 AND kind = 'step'"))
    (uuid,) = [u for u, d in trace.tracks.items() if d.name == "step time (ms)" and d.parent_uuid != 1 << 60]
    got = sorted(trace.counters[uuid])
    assert [t for t, _ in got] == [t for t, _ in steps]
    assert [v for _, v in got] == pytest.approx([v for _, v in steps])
    job = [u for u, d in trace.tracks.items() if d.name == "MFU (%)"]
    assert job and all(0 < v < 100 for _, v in trace.counters[job[0]])


def test_overlapping_spans_move_to_a_second_lane() -> None:
    base = np.full(4, 1 << 24, dtype=np.uint64)
    start = np.array([0, 1, 3, 20])
    end = np.array([10, 5, 7, 25])
    before, order, ends = base, *event_order(base, start, end)
    assert len(nesting_violations(before, order, ends)) == 1
    lanes, index, is_end = assign_lanes(base, start, end)
    assert len(set(lanes.tolist())) == 2  # [3, 7) overlaps [1, 5) without nesting
    assert len(nesting_violations(lanes, index, is_end)) == 0
    nested, _, _ = assign_lanes(base, np.array([0, 1, 5, 20]), np.array([10, 5, 7, 25]))
    assert set(nested.tolist()) == {1 << 24}  # touching and nested spans stay on one track


def test_packed_event_order_matches_the_four_key_sort() -> None:
    """The packed-key ordering and the plain lexsort agree, ties and empty spans included."""
    from megascope.export.tracks import _event_order_lexsort

    rng = np.random.default_rng(7)
    for trial in range(300):
        n = int(rng.integers(1, 80))
        track = (rng.integers(1, 5, n).astype(np.uint64) << np.uint64(24)) | np.uint64(2 << 8)
        start = rng.integers(0, 30, n).astype(np.int64) + 10**18
        end = start + rng.integers(0, 6, n)
        packed = event_order(track, start, end)
        plain = _event_order_lexsort(track, start, end)
        assert np.array_equal(packed[0], plain[0]) and np.array_equal(packed[1], plain[1]), trial
    wide = np.array([0, 2**62], dtype=np.int64)  # too wide to pack: the fallback answers
    assert event_order(np.array([1, 1], dtype=np.uint64), wide, wide + 1)[0].tolist() == [0, 0, 1, 1]


def test_file_output_is_atomic_and_errors_are_export_errors(run_dir: Path, tmp_path: Path) -> None:
    from megascope.errors import ExportError

    out = tmp_path / "t.pftrace"
    stats = export_perfetto(run_dir, out, steps=(0, 0))
    assert out.stat().st_size == stats.bytes > 0
    assert [p.name for p in tmp_path.iterdir()] == ["t.pftrace"]
    with pytest.raises(ExportError):
        export_perfetto(run_dir, tmp_path / "missing" / "t.pftrace")


def test_single_host_run_exports_with_estimated_offsets(tmp_path: Path) -> None:
    """One host: the estimate has no offset error to give (NA); the export still states its clocks."""
    out = tmp_path / "one-host"
    synth_run(out, SynthConfig(ranks=4, steps=2, tp=2, gpus_per_host=8))
    trace = _export(out, clock="estimated")
    assert trace.slices
    assert trace.metadata["megascope.clock_correction"].startswith("estimated")


def test_prefetch_keeps_order_and_raises_the_producers_error() -> None:
    from megascope.export.overlap import Prefetch

    assert list(Prefetch(iter(range(50)), depth=2)) == list(range(50))

    def failing() -> Any:
        yield 1
        raise ValueError("bad part")

    got = []
    with pytest.raises(ValueError, match="bad part"):
        for item in Prefetch(failing()):
            got.append(item)
    assert got == [1]
    early = Prefetch(iter(range(10**6)))
    assert next(early) == 0
    early.close()  # a consumer that stops early stops the producer


def test_background_writer_keeps_byte_order_and_reports_a_failed_write() -> None:
    from megascope.export.overlap import BackgroundWriter

    buf = io.BytesIO()
    pieces = [bytes([i % 256]) * (i * 977 % 200_000 + 1) for i in range(40)]
    with BackgroundWriter(buf, depth=2) as out:
        for piece in pieces:
            out.write(memoryview(piece) if len(piece) % 2 else piece)
    assert buf.getvalue() == b"".join(pieces)

    class Full(io.RawIOBase):
        def write(self, data: Any) -> int:
            raise OSError(28, "No space left on device")

    failing = BackgroundWriter(Full())
    failing.write(b"x" * (1 << 20))
    with pytest.raises(OSError, match="No space"):
        failing.close()


def test_kept_heap_puts_arrow_on_the_system_allocator_and_gives_it_back() -> None:
    import pyarrow as pa

    from megascope.export.memory import _glibc, kept_heap

    before = pa.default_memory_pool().backend_name
    with kept_heap():
        inside = pa.default_memory_pool().backend_name
        assert pa.array(np.arange(1000)).sum().as_py() == 499500
    assert pa.default_memory_pool().backend_name == before
    assert inside == ("system" if _glibc() is not None else before)


def test_raw_clock_estimates_nothing(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megascope.export import selection

    def must_not_run(con: Any, spans_of: Any = None) -> Any:
        raise AssertionError("clock offsets estimated although not requested")

    monkeypatch.setattr(selection, "estimate_clock_offsets", must_not_run)
    trace = _export(run_dir, clock="raw", steps=(1, 1))
    assert trace.metadata["megascope.clock_correction"].startswith("raw (")
    want = Counter((s["rank"], s["start_ns"]) for s in _spans(run_dir, "step = 1"))
    assert Counter((trace.rank_of(s["track"]), s["ts"] - trace.shift) for s in trace.slices) == want


def test_time_shift_needs_no_scan_on_wall_clock_runs_and_lifts_relative_ones(run_dir: Path) -> None:
    import dataclasses

    from megascope.export.selection import _time_shift

    run = open_run(run_dir)
    offsets = np.zeros(16, dtype=np.int64)
    offsets[3] = -5_000_000
    assert _time_shift(run, offsets) == 0  # epoch start: no shift, whatever the offsets
    first = dict(run.con.execute("SELECT rank, min(start_ns) FROM spans GROUP BY rank").fetchall())
    offsets[3] = -first[3] - 7  # rank 3's first span would land 7 ns before zero
    run.meta = dataclasses.replace(run.meta, start_ns=None)
    assert _time_shift(run, offsets) == 7


def test_same_bytes_before_and_after_compaction_and_for_any_chunking(tmp_path: Path) -> None:
    """The output depends on the spans only: not on how the run is stored (parts, or compacted
    files sorted by step and kind) nor on where the chunks are cut."""
    import shutil

    from megascope.compact import compact

    parts = tmp_path / "parts"
    synth_run(parts, SynthConfig(ranks=16, steps=4, tp=2, pp=2, seed=7,
                                 faults=parse_injects(["straggler:rank=3,factor=1.3"])))
    # spans that tie on track, start and end, told apart by their fields only
    shutil.copytree(parts, tmp_path / "compacted")
    before = {}
    for clock in ("raw", "estimated"):
        buf = io.BytesIO()
        export_perfetto(parts, buf, clock=clock)
        before[clock] = buf.getvalue()
        small = io.BytesIO()
        export_perfetto(parts, small, clock=clock, chunk_rows=500)
        assert small.getvalue() == before[clock]
    compact(tmp_path / "compacted", everything=True)
    assert not any((tmp_path / "compacted" / "spans").glob("*/*.parquet"))
    for clock in ("raw", "estimated"):
        for chunk_rows in (500, 400_000):
            buf = io.BytesIO()
            export_perfetto(tmp_path / "compacted", buf, clock=clock, chunk_rows=chunk_rows)
            assert buf.getvalue() == before[clock], (clock, chunk_rows)
    Decoded(before["estimated"])  # still a trace the perfetto protos parse, descriptors first


@pytest.mark.parametrize("group_rows", [None, 100])
def test_compacted_files_read_directly_give_the_bytes_of_parts_for_any_selection(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, group_rows: int | None) -> None:
    """A fully compacted run is read from its files (no per-block queries): any selection, any
    chunking (a small one re-reads row groups that do not fit the budget), the same bytes. Row
    groups hold one kind of a band of steps, or (``group_rows`` 100: steps of more rows) one kind
    of a range of ranks of one step."""
    import shutil

    from megascope import compact as compaction
    from megascope.compact import compact
    from megascope.export import source

    parts = tmp_path / "parts"
    synth_run(parts, SynthConfig(ranks=16, steps=6, tp=2, pp=2, seed=3))
    shutil.copytree(parts, tmp_path / "compacted")
    if group_rows is not None:
        monkeypatch.setattr(compaction, "ROW_GROUP_ROWS", group_rows)
    compact(tmp_path / "compacted", everything=True)
    lo, hi = open_run(parts).con.execute("SELECT min(start_ns), max(start_ns + dur_ns) FROM spans").fetchone()
    selections: list[dict[str, Any]] = [
        {}, {"ranks": [1, 2, 5, 11, 12]}, {"steps": (2, 4)}, {"ranks": range(4, 10), "steps": (1, 1)},
        {"window": (lo + (hi - lo) // 3, lo + (hi - lo) // 2)},
    ]

    def no_queries(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a fully compacted run went through per-block queries")

    monkeypatch.setattr(source, "_iter_rank_blocks", no_queries)
    for selection in selections:
        expected = io.BytesIO()
        export_perfetto(parts, expected, clock="raw", **selection)
        for chunk_rows in (150, 400_000):
            got = io.BytesIO()
            export_perfetto(tmp_path / "compacted", got, clock="raw", chunk_rows=chunk_rows, **selection)
            assert got.getvalue() == expected.getvalue(), (selection, chunk_rows)


def test_track_descriptors_are_the_bytes_the_perfetto_classes_write() -> None:
    from megascope.export import perfetto_layouts as lay

    def reference(**fields: Any) -> bytes:
        packet = pb.TracePacket()
        packet.trusted_packet_sequence_id = lay.SEQUENCE_ID
        desc = packet.track_descriptor
        desc.uuid = fields["uuid"]
        for key in ("name", "parent_uuid", "sibling_order_rank", "child_ordering"):
            if key in fields:
                setattr(desc, key, fields[key])
        if "unit" in fields:
            desc.counter.unit_name = fields["unit"]
        if "pid" in fields:
            desc.process.pid = fields["pid"]
            desc.process.process_name = fields["process_name"]
            desc.process.process_labels.extend(fields["labels"])
        trace = pb.Trace()
        trace.packet.append(packet)
        return trace.SerializeToString()

    uuid = (5 << 24) | (3 << 8) | 2
    assert lay.track_descriptor(uuid, name="comm #3", parent=5 << 24, order=3 * 256 + 2) == reference(
        uuid=uuid, name="comm #3", parent_uuid=5 << 24, sibling_order_rank=3 * 256 + 2)
    assert lay.track_descriptor(7, name="", parent=1, unit="ms", order=0) == reference(
        uuid=7, name="", parent_uuid=1, unit="ms", sibling_order_rank=0)
    assert lay.track_descriptor(1 << 62, name="gpu_util 0", parent=1 << 61, order=-1) == reference(
        uuid=1 << 62, name="gpu_util 0", parent_uuid=1 << 61, sibling_order_rank=-1)
    explicit = pb.TrackDescriptor.ChildTracksOrdering.EXPLICIT
    labels = ["host=node-03", "pp=1", "clock_offset_ns=-1234", "straggler"]
    got = lay.track_descriptor(18 << 24, process=lay.process_descriptor(18, "rank 17 · node-03", labels),
                               child_ordering=explicit)
    assert got == reference(uuid=18 << 24, pid=18, process_name="rank 17 · node-03", labels=labels,
                            child_ordering=explicit)


def test_event_order_does_not_depend_on_the_input_order() -> None:
    rng = np.random.default_rng(5)
    n = 400
    track = rng.integers(1, 4, n).astype(np.uint64) << np.uint64(8)
    start = rng.integers(0, 6, n).astype(np.int64) * 10
    end = start + rng.integers(0, 3, n).astype(np.int64) * 10
    label = rng.integers(0, 50, n).astype(np.int64)  # what tells two spans apart

    def ordered(perm: np.ndarray) -> list[tuple[int, int, int, int, bool]]:
        spans, is_end = event_order(track[perm], start[perm], end[perm], lambda s: [label[perm][s]])
        return [(int(track[perm][i]), int(start[perm][i]), int(end[perm][i]), int(label[perm][i]), bool(e))
                for i, e in zip(spans, is_end, strict=True)]

    want = ordered(np.arange(n))
    for _ in range(5):
        assert ordered(rng.permutation(n)) == want
