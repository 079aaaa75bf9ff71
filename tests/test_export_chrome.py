"""Chrome JSON export and the ``megascope export`` command line."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from megascope.cli import main
from megascope.export import export_chrome
from megascope.store import open_run
from megascope.synth import SynthConfig, synth_run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("chrome") / "run"
    synth_run(out, SynthConfig(ranks=8, steps=2, tp=2, pp=2, seed=5))
    return out


def _spans(run_dir: Path) -> list[dict[str, Any]]:
    return open_run(run_dir).con.sql("SELECT * FROM spans").to_arrow_table().to_pylist()


def _load(data: bytes) -> dict[str, Any]:
    return json.loads(data)


def _ns(micros: float) -> int:
    return round(micros * 1000)


def test_chrome_json_has_every_span_with_exact_times(run_dir: Path) -> None:
    buf = io.BytesIO()
    stats = export_chrome(run_dir, buf, clock="raw")  # exact times: the host clocks as recorded
    doc = _load(buf.getvalue())
    shift = doc["otherData"]["megascope"]["time_shift_ns"]
    base = doc["baseTimeNanoseconds"]  # ts is relative to it, as in Kineto traces
    events = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    got = Counter((e["pid"] - 1, e["name"], e["cat"], base + _ns(e["ts"]), _ns(e["dur"])) for e in events)
    want = Counter((s["rank"], s["name"], s["kind"], s["start_ns"] + shift, s["dur_ns"]) for s in _spans(run_dir))
    assert got == want
    assert stats.spans == len(events)
    comm = next(e for e in events if e["cat"] == "collective")
    assert {"group", "seq", "op", "bytes", "step"} <= set(comm["args"])
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names[1].startswith("rank 0 · ")
    assert doc["otherData"]["megascope"]["clock_correction"].startswith("raw")


def test_chrome_flows_pair_each_send_with_its_receive(run_dir: Path) -> None:
    buf = io.BytesIO()
    export_chrome(run_dir, buf)
    events = _load(buf.getvalue())["traceEvents"]
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    sends = sum(1 for s in _spans(run_dir) if s["kind"] == "send")
    assert sends and len(starts) == sends and set(starts) == set(ends)
    for flow_id, start in starts.items():
        assert ends[flow_id]["pid"] != start["pid"]


def test_split_ranks_writes_one_file_per_rank_for_hta(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "per-rank"
    export_chrome(run_dir, out, split_ranks=True, ranks=[0, 3])
    files = sorted(p.name for p in out.iterdir())
    assert files == ["rank-00000.json", "rank-00003.json"]
    doc = json.loads((out / "rank-00003.json").read_text())
    assert doc["distributedInfo"]["rank"] == 3
    assert {e["pid"] for e in doc["traceEvents"]} == {4}
    assert sum(e["ph"] == "X" for e in doc["traceEvents"]) == sum(s["rank"] == 3 for s in _spans(run_dir))


def test_cli_exports_and_reports(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.pftrace"
    result = CliRunner().invoke(main, ["export", "perfetto", str(run_dir), "-o", str(out), "--ranks", "0-3",
                                       "--steps", "1", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["ranks"] == 4 and report["spans"] > 0 and out.stat().st_size == report["bytes"]
    out_json = tmp_path / "t.json"
    result = CliRunner().invoke(main, ["export", "chrome", str(run_dir), "-o", str(out_json), "--window", "0:0.05"])
    assert result.exit_code == 0, result.output
    assert json.loads(out_json.read_text())["traceEvents"]


@pytest.mark.parametrize("args", [["--steps", "x"], ["--window", "3:1"], ["--ranks", "100"]])
def test_cli_bad_options_are_errors_that_write_nothing(run_dir: Path, tmp_path: Path, args: list[str]) -> None:
    out = tmp_path / "t.pftrace"
    result = CliRunner().invoke(main, ["export", "perfetto", str(run_dir), "-o", str(out), *args])
    assert result.exit_code == 1 and result.exception is not None and isinstance(result.exception, SystemExit)
    assert result.stderr.startswith("Error: ") and len(result.stderr.strip().splitlines()) == 1
    assert not out.exists()


def test_cli_error_is_one_line_without_traceback(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    proc = subprocess.run([sys.executable, "-m", "megascope", "export", "chrome", str(run_dir), "-o", str(out),
                           "--ranks", "7-2"], capture_output=True, text=True)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists()
