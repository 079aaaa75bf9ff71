"""One line, never a traceback: unwritable outputs, absurd numbers in traces and dumps, absurd arguments.

Each case runs the real command line in a fresh interpreter and checks the error contract: exit
status non-zero, one ``Error:`` line on stderr, nothing left at ``-o`` or beside it.
"""

from __future__ import annotations

import copy
import os
import pickle
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ingest_fixtures import fr_dump, fr_entry, gpu_trace, write_trace
from safety import SAMPLES, assert_one_line_error, megascope, tree_digest

T0 = 1_795_000_000_000_000_000


def _mount_tmpfs(where: Path, options: str) -> bool:
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
    return proc.returncode == 0


@pytest.fixture
def readonly_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory nothing can be written into: a read-only mount as root, else no write permission."""
    where = tmp_path / "ro"
    where.mkdir()
    if os.geteuid() != 0:
        where.chmod(0o500)
        yield where
        where.chmod(0o700)
        return
    if not _mount_tmpfs(where, "ro,size=1m"):
        pytest.skip("cannot mount a read-only filesystem here")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


@pytest.fixture
def full_dir(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB filesystem: the first parts fit, the run does not."""
    where = tmp_path / "full"
    where.mkdir()
    if os.geteuid() != 0 or not _mount_tmpfs(where, "size=64k"):
        pytest.skip("cannot mount a small filesystem here")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def _kineto_job(src: Path, world: int = 2, edit: Any = None) -> Path:
    src.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        trace = gpu_trace(rank, world)
        if edit is not None and rank == world - 1:
            edit(trace)
        write_trace(src / f"rank{rank}.json", trace)
    return src


def _fr_job(src: Path, edit: Any = None, world: int = 2) -> Path:
    src.mkdir(parents=True, exist_ok=True)
    pgs = {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(world)))}}
    for rank in range(world):
        entries = [fr_entry(seq - 1, seq, created=T0 + seq * 10_000_000, completed=T0 + seq * 10_000_000 + 2_000_000)
                   for seq in range(1, 4)]
        dump = fr_dump(entries, copy.deepcopy(pgs))
        if edit is not None and rank == world - 1:
            edit(dump)
        (src / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(dump))
    return src


def _assert_nothing_beside(parent: Path, before: set[str]) -> None:
    assert {p.name for p in parent.iterdir()} == before, sorted(p.name for p in parent.iterdir())


# ------------------------------------------------------------------ unwritable -o


@pytest.mark.parametrize("command", [
    ["synth", "--ranks", "2", "--steps", "2", "-o", "{out}/run"],
    ["train", "--nproc", "1", "--steps", "1", "-o", "{out}/run"],
    ["export", "perfetto", "{sample}", "-o", "{out}/t.pftrace"],
    ["export", "chrome", "{sample}", "-o", "{out}/t.json"],
    ["export", "chrome", "{sample}", "--split-ranks", "-o", "{out}/hta"],
    ["heatmap", "{sample}", "-o", "{out}/hm.html"],
    ["ingest", "kineto", "{kineto}", "-o", "{out}/run"],
    ["ingest", "flight-recorder", "{fr}", "-o", "{out}/run"],
], ids=lambda c: " ".join(c[:2]) + (" split" if "--split-ranks" in c else ""))
def test_read_only_output_is_one_line(readonly_dir: Path, tmp_path: Path, command: list[str]) -> None:
    kineto = _kineto_job(tmp_path / "kineto")
    fr = _fr_job(tmp_path / "fr")
    args = [c.format(out=readonly_dir, sample=SAMPLES / "healthy", kineto=kineto, fr=fr) for c in command]
    proc = megascope(*args)
    assert_one_line_error(proc, mentions="Read-only file system" if os.geteuid() == 0 else "ermission denied")
    assert list(readonly_dir.iterdir()) == []


@pytest.mark.parametrize("command", [
    ["synth", "--ranks", "16", "--steps", "20", "-o", "{out}/run"],
    ["ingest", "kineto", "{kineto}", "-o", "{out}/run"],
], ids=lambda c: " ".join(c[:2]))
def test_full_filesystem_is_one_line_and_leaves_nothing(full_dir: Path, tmp_path: Path, command: list[str]) -> None:
    kineto = _kineto_job(tmp_path / "kineto", world=2)
    # a trace bigger than the filesystem once written as parts
    for rank in range(2):
        trace = gpu_trace(rank, 2, steps=400)
        write_trace(kineto / f"rank{rank}.json", trace)
    proc = megascope(*[c.format(out=full_dir, kineto=kineto) for c in command])
    assert_one_line_error(proc, mentions="No space left on device")
    assert list(full_dir.iterdir()) == []


# ------------------------------------------------------------------ Kineto numbers


def _set_kernel(field: str, value: Any) -> Any:
    def edit(trace: dict[str, Any]) -> None:
        kernel = next(e for e in trace["traceEvents"] if e.get("cat") == "kernel")
        kernel[field] = value
    return edit


def _list_tid(trace: dict[str, Any]) -> None:
    meta = next(e for e in trace["traceEvents"] if e.get("ph") == "M")
    meta["tid"] = [1, 2]  # a list where a thread id belongs (found by the fuzz tier)


def _number_for_devices(trace: dict[str, Any]) -> None:
    trace["deviceProperties"] = 7  # a number where the header holds a list (found by the fuzz tier)


def _big_step(trace: dict[str, Any]) -> None:
    step = next(e for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#"))
    step["name"] = "ProfilerStep#12345678901234567890"


@pytest.mark.parametrize("edit", [
    _set_kernel("dur", 1e30),
    _set_kernel("dur", float("nan")),
    _set_kernel("dur", float("inf")),
    _set_kernel("ts", float("-inf")),
    _set_kernel("ts", 1e300),
    _big_step,
    _list_tid,
    _number_for_devices,
], ids=["dur 1e30", "dur NaN", "dur Infinity", "ts -Infinity", "ts 1e300", "20-digit step", "tid a list",
        "deviceProperties a number"])
def test_kineto_absurd_numbers_are_one_line(tmp_path: Path, edit: Any) -> None:
    src = _kineto_job(tmp_path / "src", edit=edit)
    out = tmp_path / "run"
    before = {p.name for p in tmp_path.iterdir()}
    proc = megascope("ingest", "kineto", src, "-o", out, "--workers", "1")
    assert_one_line_error(proc, mentions="rank1.json")
    _assert_nothing_beside(tmp_path, before)


def test_kineto_deep_nesting_is_one_line(tmp_path: Path) -> None:
    src = _kineto_job(tmp_path / "src")
    path = src / "rank1.json"
    text = path.read_text()
    deep = "[" * 200_000 + "]" * 200_000
    # an event whose args hold 200,000 nested lists
    path.write_text(text.replace('"traceEvents": [', '"traceEvents": [\n{"ph": "X", "name": "deep", "pid": 1, '
                                 f'"tid": 1, "ts": 1000.0, "dur": 1.0, "args": {{"x": {deep}}}}},', 1))
    out = tmp_path / "run"
    before = {p.name for p in tmp_path.iterdir()}
    proc = megascope("ingest", "kineto", src, "-o", out, "--workers", "1")
    assert_one_line_error(proc, mentions="rank1.json")
    _assert_nothing_beside(tmp_path, before)


# ------------------------------------------------------------------ flight-recorder numbers


def _pg_list(dump: dict[str, Any]) -> None:
    dump["pg_config"] = [dump["pg_config"]["0"]]


def _entry(field: str, value: Any) -> Any:
    def edit(dump: dict[str, Any]) -> None:
        dump["entries"][1][field] = value
    return edit


@pytest.mark.parametrize("edit", [
    _pg_list,
    _entry("time_created_ns", 2**80),
    _entry("time_created_ns", -(2**80)),
    _entry("time_discovered_completed_ns", 2**64),
    _entry("duration_ms", float("inf")),
    _entry("duration_ms", float("nan")),
    _entry("duration_ms", -1.0),
    _entry("duration_ms", 1e300),
    _entry("collective_seq_id", 2**70),
    _entry("input_sizes", [[2**62, 2**62]]),
], ids=["pg_config list", "created 2^80", "created -2^80", "completed 2^64", "duration inf", "duration NaN", "duration -1", "duration 1e300",
        "seq 2^70", "size 2^124"])
def test_flight_recorder_absurd_values_are_one_line(tmp_path: Path, edit: Any) -> None:
    src = _fr_job(tmp_path / "src", edit=edit)
    out = tmp_path / "run"
    before = {p.name for p in tmp_path.iterdir()}
    proc = megascope("ingest", "flight-recorder", src, "-o", out)
    assert_one_line_error(proc, mentions="nccl_trace_rank_1")
    _assert_nothing_beside(tmp_path, before)


# ------------------------------------------------------------------ synth arguments


@pytest.mark.parametrize("args,mentions", [
    (["--inject", "skew:rank=1,ms=1e300"], "ms"),
    (["--inject", "skew:rank=1,ms=inf"], "ms"),
    (["--inject", "straggler:rank=1,factor=nan"], "factor"),
    (["--inject", "straggler:rank=1,factor=inf"], "factor"),
    (["--inject", "straggler:rank=1,factor=1e300"], "factor"),
    (["--micro-batches", "100000000"], "micro-batches"),
    (["--clock-skew-ms", "1e300"], "clock-skew-ms"),
    (["--clock-skew-ms", "nan"], "clock-skew-ms"),
    (["--ranks", "100000000"], "ranks"),
    (["--steps", "100000000000"], "steps"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_synth_absurd_arguments_are_one_line(tmp_path: Path, args: list[str], mentions: str) -> None:
    base = {"--ranks": "4", "--steps": "2"}
    for flag in ("--ranks", "--steps"):
        if flag in args:
            base.pop(flag)
    flat = [x for kv in base.items() for x in kv]
    out = tmp_path / "run"
    proc = megascope("synth", *flat, *args, "-o", out, timeout=120)
    assert_one_line_error(proc, mentions=mentions)
    assert list(tmp_path.iterdir()) == []


def test_export_into_a_missing_directory_is_one_line(tmp_path: Path) -> None:
    proc = megascope("export", "chrome", SAMPLES / "healthy", "-o", tmp_path / "no" / "such" / "t.json")
    assert_one_line_error(proc, mentions="no such directory")
    assert tree_digest(tmp_path) == {}


def test_ingest_rename_failure_leaves_no_staging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megascope.errors import MegascopeError
    from megascope.ingest import ingest_flight_recorder, runwriter

    src = _fr_job(tmp_path / "src")

    def busy(a: Any, b: Any) -> None:
        raise OSError(16, "Device or resource busy", str(b))

    monkeypatch.setattr(runwriter.os, "replace", busy)
    before = {p.name for p in tmp_path.iterdir()}
    with pytest.raises(MegascopeError, match="Device or resource busy"):
        ingest_flight_recorder(src, tmp_path / "run")
    _assert_nothing_beside(tmp_path, before)


def test_ingest_onto_a_mount_point_leaves_no_staging(tmp_path: Path) -> None:
    mount = tmp_path / "mnt"
    mount.mkdir()
    if os.geteuid() != 0 or not _mount_tmpfs(mount, "size=1m"):
        pytest.skip("cannot mount here")
    try:
        src = _fr_job(tmp_path / "src")
        before = {p.name for p in tmp_path.iterdir()}
        proc = megascope("ingest", "flight-recorder", src, "-o", mount)
        assert_one_line_error(proc, mentions=str(mount))
        _assert_nothing_beside(tmp_path, before)
        assert list(mount.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mount)], check=False)



@pytest.mark.parametrize("args", [
    ["synth", "--ranks", "x", "-o", "r"],
    ["nosuch"],
    ["report"],
    ["export", "chrome", "R"],
    ["train", "--tp", "0", "-o", "r"],
], ids=" ".join)
def test_usage_errors_are_one_line(tmp_path: Path, args: list[str]) -> None:
    proc = megascope(*args, cwd=tmp_path)
    assert_one_line_error(proc, mentions="--help")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ Kineto: two jobs, negative durations


def test_kineto_traces_of_two_jobs_an_hour_apart_are_refused(tmp_path: Path) -> None:
    """Same world size and groups, clocks an hour apart: two jobs, not one job with slow hosts."""
    src = tmp_path / "src"
    src.mkdir()
    for rank in range(4):
        trace = gpu_trace(rank, 4, seed=rank // 2)
        if rank >= 2:
            trace["baseTimeNanoseconds"] += 3600 * 1_000_000_000
        write_trace(src / f"rank{rank}.json", trace)
    before = {p.name for p in tmp_path.iterdir()}
    proc = megascope("ingest", "kineto", src, "-o", tmp_path / "run", "--workers", "1")
    line = assert_one_line_error(proc, mentions="mixed jobs")
    assert "3,600 s" in line
    _assert_nothing_beside(tmp_path, before)


def test_kineto_ranks_a_little_apart_are_one_job(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for rank in range(2):
        trace = gpu_trace(rank, 2)
        trace["baseTimeNanoseconds"] += rank * 3 * 1_000_000  # 3 ms of clock difference
        write_trace(src / f"rank{rank}.json", trace)
    proc = megascope("ingest", "kineto", src, "-o", tmp_path / "run", "--workers", "1")
    assert proc.returncode == 0, proc.stderr


def test_kineto_negative_durations_are_skipped_and_counted(tmp_path: Path) -> None:
    import json

    from megascope.store import open_run

    def negative(trace: dict[str, Any]) -> None:
        kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel" and e["name"] == "gemm_fwd"]
        for k in kernels[:2]:
            k["dur"] = -5.0

    src = _kineto_job(tmp_path / "src", edit=negative)
    proc = megascope("ingest", "kineto", src, "-o", tmp_path / "run", "--workers", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert any("2 events with a negative duration skipped" in w for w in summary["warnings"]), summary["warnings"]
    run = open_run(tmp_path / "run")
    (negatives,) = run.con.execute("SELECT count(*) FROM spans WHERE dur_ns < 0").fetchone() or (None,)
    assert negatives == 0
    forward = dict(run.con.execute("SELECT rank, count(*) FROM spans WHERE name = 'gemm_fwd' GROUP BY rank").fetchall())
    assert forward == {0: 3, 1: 1}


def test_kineto_events_that_cannot_be_placed_are_counted(tmp_path: Path) -> None:
    """A collective whose host call sits at 1e300 µs has no execution to pair with: it is not
    imported, and the summary says so instead of dropping it without a word."""
    import json

    def far_call(trace: dict[str, Any]) -> None:
        call = next(e for e in trace["traceEvents"] if e.get("name") == "record_param_comms")
        call["ts"] = 1e300

    src = _kineto_job(tmp_path / "src", edit=far_call)
    proc = megascope("ingest", "kineto", src, "-o", tmp_path / "run", "--workers", "1", "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert any("not imported (1 of 2 ranks)" in w for w in summary["warnings"]), summary["warnings"]


def test_flight_recorder_dump_cut_inside_a_length_field_is_one_line(tmp_path: Path) -> None:
    """Found by the fuzz tier: the pickle ends inside the 8-byte length of its first frame."""
    src = tmp_path / "src"
    src.mkdir()
    raw = pickle.dumps(fr_dump([fr_entry(0, 1, created=T0, completed=T0 + 5)],
                               {"0": {"name": "0", "desc": "default_pg", "ranks": "[0]"}}), protocol=5)
    (src / "nccl_trace_rank_0").write_bytes(raw[: raw.index(b"\x95") + 4])
    before = {p.name for p in tmp_path.iterdir()}
    proc = megascope("ingest", "flight-recorder", src, "-o", tmp_path / "run")
    assert_one_line_error(proc, mentions="nccl_trace_rank_0")
    _assert_nothing_beside(tmp_path, before)
