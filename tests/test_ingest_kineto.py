"""Kineto ingest: the streamed reader, the mapping onto the schema, bad inputs, and the real samples."""

from __future__ import annotations

import gzip
import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import Result
from ingest_fixtures import BASE_NS, GEN_KINETO, SHARED_DATA, gpu_trace, write_trace

from megascope.errors import IngestError
from megascope.ingest import ingest_kineto
from megascope.ingest.groups import ProcessGroup, axis_from_desc, parse_mesh_spec, plan_groups
from megascope.ingest.jsonstream import TraceReader
from megascope.store import open_run

# ------------------------------------------------------------------------------ reader


@pytest.mark.parametrize("chunk", [64, 1000, 1 << 20])
@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_reader_yields_every_event_and_trailing_keys(tmp_path: Path, chunk: int, suffix: str) -> None:
    trace = gpu_trace(0, 2)
    # Strings holding "}," and nested objects must not confuse the batch cut.
    trace["traceEvents"].insert(3, {"ph": "X", "cat": "cpu_op", "name": "odd },{ name", "ts": 1.0, "dur": 1.0,
                                    "pid": 1, "tid": 1, "args": {"nested": {"a": [{"b": 1}, {"c": "},"}]}}})
    path = write_trace(tmp_path / f"r0{suffix}", trace)
    reader = TraceReader(path, chunk_chars=chunk)
    header = reader.read_header()
    events = [e for batch in reader.iter_batches() for e in batch]
    assert events == trace["traceEvents"]
    assert header["distributedInfo"]["rank"] == 0
    assert reader.trailer == {"traceName": "rank0", "baseTimeNanoseconds": BASE_NS}


def test_reader_compact_json_without_separator_spaces(tmp_path: Path) -> None:
    trace = gpu_trace(1, 2, steps=40)
    for e in trace["traceEvents"]:
        if e.get("cat") == "kernel":  # real kernel names hold "}," (lambda types): not a separator
            e["name"] += "<{lambda(float)#1}, at::detail::Array<char*, 2> >"
    path = tmp_path / "r1.json"
    path.write_text(json.dumps(trace, separators=(",", ":")))
    events = [e for b in TraceReader(path, chunk_chars=100).iter_batches() for e in b]
    assert events == trace["traceEvents"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"[1, 2, 3]", "not a JSON object"),
        (b'{"schemaVersion": 1}', "no traceEvents"),
        (b'{"traceEvents": [{"ph": "X", "ts": 1}, {"ph": ', "truncated"),
        (b'{"traceEvents": [{"ph": "X", "ts": 1}, oops]}', "malformed"),
        (b"\xff\xfe\x00garbage", "UTF-8"),
    ],
)
def test_reader_bad_json_is_one_clear_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(IngestError, match=message):
        for _ in TraceReader(path).iter_batches():
            pass


def test_reader_truncated_gzip(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "r0.json.gz", gpu_trace(0, 2, steps=20))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(IngestError, match="truncated or corrupt gzip"):
        for _ in TraceReader(path).iter_batches():
            pass


# ---------------------------------------------------------------------------- mapping


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_level_ops_match_picking_one_op_at_a_time(seed: int) -> None:
    """The array search picks the same top-level ops as the plain scan it replaces, ties and
    end-equals-next-start (and float sums that overshoot it by an ulp) included."""
    import random

    from megascope.ingest.kineto_events import RankEvents
    from megascope.ingest.kineto_map import top_level_ops

    rng = random.Random(seed)
    ops = []
    for i in range(400):
        start = rng.choice([float(rng.randrange(0, 300)), round(rng.uniform(0, 300), 3)])
        dur = rng.choice([0.0, float(rng.randrange(1, 40)), round(rng.uniform(0, 40), 3)])
        ops.append((start, start + dur, f"op{i}"))
    events = RankEvents(header={})
    events.ops[1] = list(ops)
    expected = []
    current_end = float("-inf")
    for start, end, name in sorted(ops, key=lambda o: (o[0], -o[1])):
        if start >= current_end:
            current_end = end
            expected.append(name)
    assert top_level_ops(events)[1].names == expected


# ----------------------------------------------------------------------------- groups


def test_group_names_map_to_axes() -> None:
    assert axis_from_desc("TENSOR_MODEL_PARALLEL_GROUP") == "tp"
    assert axis_from_desc("PIPELINE_MODEL_PARALLEL_GROUP") == "pp"
    assert axis_from_desc("DATA_PARALLEL_GROUP") == "dp"
    assert axis_from_desc("mesh_tp") == "tp"
    assert axis_from_desc("MODEL_PARALLEL_GROUP") is None
    assert axis_from_desc("DATA_MODULO_EXPERT_PARALLEL_GROUP") is None
    assert parse_mesh_spec("tp=2, pp=2,dp=2") == {"tp": 2, "pp": 2, "dp": 2}


def test_plan_coordinates_come_from_group_membership() -> None:
    # Megatron order on 8 ranks: tp fastest, then dp, then pp (tp=2, dp=2, pp=2).
    pgs = [ProcessGroup("0", "default_pg", tuple(range(8)))]
    n = 1
    for t in range(2):
        for p in range(2):
            pgs.append(ProcessGroup(str(n), "DATA_PARALLEL_GROUP", (t + 4 * p, t + 2 + 4 * p)))
            n += 1
    for d in range(2):
        for p in range(2):
            pgs.append(ProcessGroup(str(n), "TENSOR_MODEL_PARALLEL_GROUP", (2 * d + 4 * p, 2 * d + 4 * p + 1)))
            n += 1
    plan = plan_groups(pgs, world_size=8)
    assert plan.mesh_sizes == {"pp": 1 * 2, "dp": 2, "tp": 2}
    for rank in range(8):
        assert plan.coords[rank] == {"tp": rank % 2, "dp": (rank // 2) % 2, "pp": rank // 4}
    assert plan.id_for("TENSOR_MODEL_PARALLEL_GROUP", (6, 7)) == "tp:3"


# ------------------------------------------------------------------------ mapping


def _write_job(src: Path, world: int, *, slow_rank: int | None = None, gz: bool = True) -> None:
    src.mkdir(parents=True, exist_ok=True)
    for rank in range(world):
        write_trace(src / f"rank{rank}.pt.trace.json{'.gz' if gz else ''}", gpu_trace(rank, world, slow_rank=slow_rank))


def test_gpu_trace_maps_onto_the_schema(tmp_path: Path) -> None:
    world = 3
    _write_job(tmp_path / "src", world, slow_rank=1)
    result = ingest_kineto(tmp_path / "src", tmp_path / "run", workers=1)
    assert result.world_size == world and result.missing_ranks == []
    run = open_run(tmp_path / "run")
    assert run.problems == []
    con = run.con
    for rank in range(world):
        trace = gpu_trace(rank, world, slow_rank=1)
        ev = trace["traceEvents"]
        kernels = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])
        rows = con.execute(
            "SELECT name, kind, stream, start_ns, dur_ns, step, seq, op, bytes, \"group\" FROM spans "
            "WHERE rank = ? AND stream LIKE 'cuda:%' ORDER BY start_ns", [rank]).fetchall()
        # collective spans are named after the collective, compute spans after the kernel
        assert [r[0] for r in rows] == [
            "nccl:all_reduce" if k["name"].startswith("nccl") else k["name"] for k in kernels]
        for row, k in zip(rows, kernels, strict=True):
            assert row[3] == BASE_NS + round(k["ts"] * 1000)
            assert row[4] == round(k["dur"] * 1000)
            assert row[2] == f"cuda:{k['args']['stream']}"
        kinds = {r[0]: r[1] for r in rows}
        assert kinds == {"gemm_fwd": "forward", "gemm_bwd": "backward", "nccl:all_reduce": "collective"}
        comm = [r for r in rows if r[1] == "collective"]
        assert [r[6] for r in comm] == [1, 2, 3]
        assert {(r[7], r[8], r[9]) for r in comm} == {("all_reduce", 2048, "world")}
        assert [r[5] for r in comm] == [5, 6, 7]
        steps = con.execute("SELECT step FROM spans WHERE rank = ? AND kind = 'step' ORDER BY step", [rank]).fetchall()
        assert [s[0] for s in steps] == [5, 6, 7]
    # Markers: enqueued at record_param_comms, completed at the kernel's end, for every collective.
    counts = con.execute("SELECT state, count(*) FROM markers GROUP BY state ORDER BY state").fetchall()
    assert counts == [("completed", 9), ("enqueued", 9)]
    # The slow rank arrives last at every all-reduce, and its peers' collectives hold the wait.
    last = con.execute("""
        SELECT seq, arg_max(rank, start_ns) FROM spans WHERE kind = 'collective' GROUP BY seq ORDER BY seq
    """).fetchall()
    assert [r[1] for r in last] == [1, 1, 1]
    groups = con.execute("SELECT rank, \"group\", kind, members FROM groups ORDER BY rank").fetchall()
    assert groups == [(r, "world", "world", [0, 1, 2]) for r in range(world)]
    ranks = con.execute("SELECT rank, device, device_name, coords['dp'] FROM ranks ORDER BY rank").fetchall()
    assert ranks == [(r, "cuda:0", "Test GPU", r) for r in range(world)]
    assert run.meta.source == "kineto" and run.meta.mesh_sizes == {"pp": 1, "dp": 3, "tp": 1}


def test_work_wait_records_are_not_calls_and_take_no_place_in_the_sequence(tmp_path: Path) -> None:
    # torch 2.10+ records Work.wait() as record_param_comms "wait": rank 0 waits twice a step here,
    # rank 1 once, rank 2 never; the all-reduces must still pair as 1, 2, 3 on every rank.
    src = tmp_path / "src"
    src.mkdir()
    for rank in range(3):
        write_trace(src / f"rank{rank}.pt.trace.json", gpu_trace(rank, 3, slow_rank=1, waits=2 - rank))
    result = ingest_kineto(src, tmp_path / "run", workers=1)
    assert not any("no execution" in w for w in result.warnings)
    con = open_run(tmp_path / "run").con
    seqs = con.execute("SELECT rank, list(seq ORDER BY seq) FROM spans WHERE kind = 'collective' GROUP BY 1 "
                       "ORDER BY 1").fetchall()
    assert seqs == [(r, [1, 2, 3]) for r in range(3)]
    assert con.execute("SELECT count(*) FROM markers").fetchone() == (18,)
    last = con.execute("SELECT seq, arg_max(rank, start_ns) FROM spans WHERE kind = 'collective' GROUP BY seq "
                       "ORDER BY seq").fetchall()
    assert [r[1] for r in last] == [1, 1, 1]


def test_parallel_and_serial_ingest_agree(tmp_path: Path) -> None:
    _write_job(tmp_path / "src", 2, gz=False)
    ingest_kineto(tmp_path / "src", tmp_path / "a", workers=1)
    ingest_kineto(tmp_path / "src", tmp_path / "b", workers=2)
    q = "SELECT * FROM spans ORDER BY rank, start_ns, name"
    assert open_run(tmp_path / "a").con.execute(q).fetchall() == open_run(tmp_path / "b").con.execute(q).fetchall()


def test_parsing_workers_of_a_process_without_pandas_never_load_it(tmp_path: Path) -> None:
    """The ingest command's process has not imported pandas when it starts its parsing workers;
    each worker refuses it (pyarrow then works as where pandas is not installed), and the two-worker
    ingest writes the same spans as a one-worker one."""
    _write_job(tmp_path / "src", 3, gz=False)
    code = (
        "import sys\n"
        "from megascope.ingest.kineto import _init_worker\n"
        "_init_worker()\n"
        "import pyarrow as pa\n"
        "pa.Table.from_pylist([{'a': 1.5}])\n"
        "assert 'pandas' not in sys.modules\n"
        "try:\n"
        "    import pandas\n"
        "except ImportError:\n"
        "    print('refused')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "refused"
    done = subprocess.run([sys.executable, "-m", "megascope", "ingest", "kineto", str(tmp_path / "src"), "-o",
                           str(tmp_path / "two")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    ingest_kineto(tmp_path / "src", tmp_path / "one", workers=1)
    q = "SELECT * FROM spans ORDER BY rank, start_ns, name"
    assert open_run(tmp_path / "two").con.execute(q).fetchall() == open_run(tmp_path / "one").con.execute(q).fetchall()


def test_missing_rank_is_recorded(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for rank in (0, 2):
        write_trace(src / f"rank{rank}.json", gpu_trace(rank, 3))
    result = ingest_kineto(src, tmp_path / "run", workers=1)
    assert result.missing_ranks == [1]
    run = open_run(tmp_path / "run")
    assert run.meta.config["ingest"]["missing_ranks"] == [1]
    assert any("wrote no spans or markers: 1" in p for p in run.problems)
    assert run.con.execute("SELECT count(*) FROM ranks").fetchone() == (3,)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("duplicate", "duplicate rank 1"),
        ("mixed", "mixed jobs"),
        ("truncated", "truncated or corrupt gzip"),
        ("notjson", "not a JSON object"),
        ("empty", "no Kineto traces"),
    ],
)
def test_bad_inputs_fail_cleanly_and_write_nothing(tmp_path: Path, case: str, message: str,
                                                   cli: Callable[..., Result]) -> None:
    src = tmp_path / "src"
    src.mkdir()
    if case != "empty":
        write_trace(src / "rank0.json.gz", gpu_trace(0, 2, steps=30))
        write_trace(src / "rank1.json.gz", gpu_trace(1, 2, steps=30))
    if case == "duplicate":
        write_trace(src / "rank1-copy.json", gpu_trace(1, 2))
    elif case == "mixed":
        write_trace(src / "other.json", gpu_trace(2, 4))
    elif case == "truncated":
        data = (src / "rank1.json.gz").read_bytes()
        (src / "rank1.json.gz").write_bytes(data[: len(data) // 2])
    elif case == "notjson":
        (src / "rank1.json.gz").write_bytes(gzip.compress(b"<html>not json</html>"))
    out = tmp_path / "run"
    with pytest.raises(IngestError, match=message):
        ingest_kineto(src, out, workers=2)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    result = cli("ingest", "kineto", str(src), "-o", str(out))
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].startswith("Error: ")


def test_refuses_to_overwrite_a_run(tmp_path: Path) -> None:
    _write_job(tmp_path / "src", 2)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "keep.txt").write_text("mine")
    with pytest.raises(IngestError, match="not empty"):
        ingest_kineto(tmp_path / "src", tmp_path / "run")
    assert (tmp_path / "run" / "keep.txt").read_text() == "mine"


def test_cli_json_summary(tmp_path: Path, cli: Callable[..., Result]) -> None:
    _write_job(tmp_path / "src", 2)
    result = cli("ingest", "kineto", str(tmp_path / "src"), "-o", str(tmp_path / "run"), "--json", "--workers", "1")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["world_size"] == 2 and summary["ranks_found"] == [0, 1] and summary["spans"] > 0


@pytest.mark.parametrize("info", [None, {"rank": 0}, {"rank": 3}, {"backend": "nccl"}])
def test_single_process_trace_without_world_size_is_a_one_rank_run(
    tmp_path: Path, info: dict[str, Any] | None, caplog: pytest.LogCaptureFixture
) -> None:
    trace = gpu_trace(0, 1)
    del trace["distributedInfo"]
    if info is not None:
        trace["distributedInfo"] = info
    write_trace(tmp_path / "profile.json.gz", trace)
    with caplog.at_level(logging.WARNING):
        result = ingest_kineto(tmp_path / "profile.json.gz", tmp_path / "run", workers=1)
    assert result.world_size == 1 and result.ranks_found == [0] and result.spans > 0
    assert any("read as a one-rank run" in w for w in result.warnings)
    assert any("read as a one-rank run" in r.getMessage() for r in caplog.records)
    run = open_run(tmp_path / "run")
    assert run.con.execute("SELECT DISTINCT rank FROM spans").fetchall() == [(0,)]
    assert any("one-rank run" in w for w in run.meta.config["ingest"]["warnings"])


def test_traces_without_distributed_info_take_ranks_from_file_names(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for rank in (0, 1, 2):
        trace = gpu_trace(rank, 3)
        del trace["distributedInfo"]
        write_trace(src / f"worker_rank-{rank}.json", trace)
    result = ingest_kineto(src, tmp_path / "run", workers=1)
    assert result.world_size == 3 and result.ranks_found == [0, 1, 2]
    assert any("highest rank + 1 = 3" in w for w in result.warnings)
    anonymous = tmp_path / "anon"
    anonymous.mkdir()
    for name in ("a.json", "b.json"):
        trace = gpu_trace(0, 1)
        del trace["distributedInfo"]
        write_trace(anonymous / name, trace)
    with pytest.raises(IngestError, match="its rank is unknown"):
        ingest_kineto(anonymous, tmp_path / "run2", workers=1)


@pytest.mark.parametrize("source", ["generated", "real-gpu", "real-cpu"])
def test_compiled_and_standard_library_parsing_agree(tmp_path: Path, source: str) -> None:
    """The msgspec path and the json fallback keep the same events, down to every tuple."""
    pytest.importorskip("msgspec")
    from megascope.ingest.kineto_events import collect, trace_reader

    if source == "generated":
        path = write_trace(tmp_path / "rank0.json", gpu_trace(0, 2, steps=4))
    else:
        folder = SHARED_DATA / ("kineto-gpu-2rank" if source == "real-gpu" else "kineto-cpu-4rank")
        if not folder.is_dir():
            pytest.skip("shared sample traces not present")
        path = sorted(folder.glob("*.json*"))[0]
    fast = collect(trace_reader(path), scan=False)
    slow = collect(trace_reader(path, compiled=False), scan=False)
    assert fast.events == slow.events > 0
    assert (fast.steps, fast.thread_names, dict(fast.ops), fast.runtime, fast.pid) == (
        slow.steps, slow.thread_names, dict(slow.ops), slow.runtime, slow.pid)
    assert fast.device == slow.device and fast.comm_calls == slow.comm_calls
    assert (dict(fast.flow_fwd), dict(fast.flow_bwd), fast.first_ts, fast.last_ts) == (
        dict(slow.flow_fwd), dict(slow.flow_bwd), slow.first_ts, slow.last_ts)


# -------------------------------------------------------------------- real traces


def _last_arrivers(con: object) -> dict[int, int]:
    rows = con.execute(  # type: ignore[attr-defined]
        """SELECT last, count(*) FROM (
               SELECT "group", seq, arg_max(rank, start_ns) AS last, count(*) AS n FROM spans
               WHERE kind = 'collective' GROUP BY ALL) WHERE n > 1 GROUP BY last"""
    ).fetchall()
    return dict(rows)


@pytest.mark.skipif(not (SHARED_DATA / "kineto-cpu-4rank").is_dir(), reason="shared sample traces not present")
def test_real_cpu_gloo_traces(tmp_path: Path) -> None:
    src = SHARED_DATA / "kineto-cpu-4rank"
    ingest_kineto(src, tmp_path / "run")
    run = open_run(tmp_path / "run")
    con = run.con
    assert run.meta.world_size == 4 and run.problems == []
    # One collective span per gloo:all_reduce execution, seqs aligned across ranks.
    for path in sorted(src.glob("*.json.gz")):
        trace = json.loads(gzip.decompress(path.read_bytes()))
        rank = trace["distributedInfo"]["rank"]
        n_exec = sum(1 for e in trace["traceEvents"] if e.get("name") == "gloo:all_reduce")
        n_steps = sum(1 for e in trace["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#"))
        got = con.execute("SELECT count(*), min(seq), max(seq) FROM spans WHERE rank = ? AND kind = 'collective'",
                          [rank]).fetchone()
        assert got == (n_exec, 1, n_exec)
        assert con.execute("SELECT count(*) FROM spans WHERE rank = ? AND kind = 'step'", [rank]).fetchone() == (n_steps,)
    sizes = con.execute("SELECT DISTINCT count(*) FROM spans WHERE kind = 'collective' GROUP BY seq").fetchall()
    assert sizes == [(4,)]
    # The planted compute straggler arrives last at most all-reduces.
    arrivals = _last_arrivers(con)
    worst = max(arrivals, key=lambda r: arrivals[r])
    compute = con.execute("""SELECT rank FROM spans WHERE kind IN ('forward', 'compute') GROUP BY rank
                         ORDER BY sum(dur_ns) DESC LIMIT 1""").fetchone()
    assert compute is not None and worst == compute[0]


@pytest.mark.skipif(not (SHARED_DATA / "kineto-gpu-2rank").is_dir(), reason="shared sample traces not present")
def test_real_gpu_nccl_traces(tmp_path: Path) -> None:
    ingest_kineto(SHARED_DATA / "kineto-gpu-2rank", tmp_path / "run")
    run = open_run(tmp_path / "run")
    con = run.con
    assert con.execute("SELECT DISTINCT device_name FROM ranks").fetchall() == [("NVIDIA H200",)]
    # every recorded all-reduce of the window has a kernel on both ranks, with the same seq
    assert con.execute("SELECT DISTINCT count(*) FROM spans WHERE kind = 'collective' GROUP BY seq").fetchall() == [(2,)]
    assert con.execute("SELECT DISTINCT op FROM spans WHERE kind = 'collective'").fetchall() == [("all_reduce",)]
    kinds = {k for (k,) in con.execute("SELECT DISTINCT kind FROM spans").fetchall()}
    assert {"forward", "backward", "optimizer", "collective", "step"} <= kinds
    # the extra GEMMs: one rank's forward kernels take longer, and that rank arrives last
    fwd = dict(con.execute("SELECT rank, sum(dur_ns) FROM spans WHERE kind = 'forward' GROUP BY rank").fetchall())
    arrivals = _last_arrivers(con)
    slow = max(fwd, key=lambda r: fwd[r])
    assert max(arrivals, key=lambda r: arrivals[r]) == slow


@pytest.mark.skipif(not GEN_KINETO.is_file(), reason="shared trace generator not present")
def test_generated_3d_job_maps_megatron_groups(tmp_path: Path) -> None:
    src = tmp_path / "src"
    truth_out = subprocess.run(
        [sys.executable, str(GEN_KINETO), "--out", str(src), "--ranks", "8", "--steps", "3", "--tp", "2",
         "--pp", "2", "--kernels-per-step", "40", "--straggler-rank", "5", "--straggler-slowdown", "0.5", "--gzip"],
        capture_output=True, text=True, check=True).stdout
    truth = json.loads(truth_out.strip().splitlines()[-1])
    ingest_kineto(src, tmp_path / "run")
    run = open_run(tmp_path / "run")
    con = run.con
    assert run.meta.mesh_sizes == {"pp": 2, "dp": 2, "tp": 2}
    coords = con.execute("SELECT rank, coords['tp'], coords['dp'], coords['pp'] FROM ranks ORDER BY rank").fetchall()
    assert coords == [(r, r % 2, (r // 2) % 2, r // 4) for r in range(8)]
    groups = {g for (g,) in con.execute("SELECT DISTINCT \"group\" FROM spans WHERE \"group\" IS NOT NULL").fetchall()}
    assert {"tp:0", "dp:0", "pp:0"} <= groups
    # p2p: every send has the matching recv (same pair, same seq) on its peer
    unmatched = con.execute("""
        SELECT count(*) FROM spans s WHERE s.kind = 'send' AND NOT EXISTS (
            SELECT 1 FROM spans r WHERE r.kind = 'recv' AND r.rank = s.peer AND r.peer = s.rank AND r.seq = s.seq)
    """).fetchone()
    assert unmatched == (0,) and con.execute("SELECT count(*) FROM spans WHERE kind = 'send'").fetchone()[0] > 0
    # the straggler's compute is the longest among its pipeline stage
    stage = truth["straggler_coords_tp_dp_pp"][2]
    top = con.execute(f"""SELECT s.rank FROM spans s JOIN ranks USING (rank) WHERE ranks.coords['pp'] = {stage}
                      AND s.kind IN ('forward', 'backward') GROUP BY s.rank ORDER BY sum(s.dur_ns) DESC LIMIT 1""").fetchone()
    assert top == (truth["straggler_rank"],)


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared sample traces not present")
@pytest.mark.parametrize(("sample", "planted"), [("kineto-cpu-4rank", 3), ("kineto-gpu-2rank", 0)])
def test_report_names_the_planted_straggler(tmp_path: Path, sample: str, planted: int) -> None:
    """End to end: ingest, then the analysis' report (planted ranks as the data README states)."""
    analysis = pytest.importorskip("megascope.analysis")
    if not hasattr(analysis, "report"):
        pytest.skip("analysis.report not available")
    ingest_kineto(SHARED_DATA / sample, tmp_path / "run")
    report = analysis.report(open_run(tmp_path / "run"))
    assert report["stragglers"] and report["stragglers"][0]["rank"] == planted
    assert report["stragglers"][0]["cause"] == "compute"
    # Never a fix that lengthens the step: on the GPU sample the replay's model of a step (41 ms,
    # its device a step behind its host) is far from the measured 24 ms, and its fixed step longer.
    assert report["whatif"]["whatif_step_time_ns"] <= report["run"]["step_time_ns"]
    assert report["whatif"]["speedup"] >= 1.0


def test_real_gpu_ddp_traces_read_the_reducer_s_wait_and_what_a_fix_gives(tmp_path: Path) -> None:
    """Traces torch.profiler wrote (CPU and CUDA activities) of a 2-rank DDP job on 2x H200 over
    NCCL (``bench/ddp_sweep.py --device cuda --record profiler --seed 2731``, the MLP of four
    4096 x 4096 layers, 10 steps):

    - ``kineto-gpu-ddp-healthy`` (job 11): nothing planted, a 25.2 ms step;
    - ``kineto-gpu-ddp-pause`` (job 6): rank 1's host sleeps 60 ms between forward and backward
      (a 78 ms step); rank 0's first all-reduce kernel waits for it ~56 ms while its own backward
      kernels run, its stream idles from the backward's end (~25 ms) to the last reduction's;
    - ``kineto-gpu-ddp-slow`` (job 10): rank 1's GPU sleeps 0.1 of its step's device time in its
      forward and backward (a 26.6 ms step, 1.05x the healthy one).

    The reductions the backward hid are not the waiting rank's stall: its own time is its healthy
    step's, the paused rank's own time and the slow GPU's read what they cost, and a fix of the
    planted rank gives about the healthy step. Before, the waiting rank's whole wait in its NCCL
    kernels came off its own time: the slow GPU read 1.20x, and the fixes 14.2 and 22.3 ms, under
    the healthy step."""
    from megascope import analysis
    from megascope.analysis.base import prepare

    reports = {}
    for name in ("healthy", "pause", "slow"):
        ingest_kineto(Path(__file__).parent / "data" / f"kineto-gpu-ddp-{name}", tmp_path / name)
        reports[name] = analysis.report(open_run(tmp_path / name))
    healthy = reports["healthy"]["run"]["step_time_ns"]
    assert reports["healthy"]["stragglers"] == []
    paused = open_run(tmp_path / "pause")
    prepare(paused.con)
    own = dict(paused.con.execute("SELECT rank, median(own_ns) FROM ms_cache.rank_step GROUP BY rank").fetchall())
    assert own[0] == pytest.approx(healthy, rel=0.1)  # its wait for the paused rank is not its own
    for name, cause, low, high in (("pause", "host", 2.5, 3.5), ("slow", "compute", 1.04, 1.08)):
        found = reports[name]["stragglers"]
        assert [(s["rank"], s["cause"]) for s in found] == [(1, cause)], found
        assert low < found[0]["slowdown"] < high
        fixed = reports[name]["whatif"]["whatif_step_time_ns"]
        assert healthy * 0.97 < fixed < healthy * 1.15, (name, fixed / 1e6, healthy / 1e6)


def test_real_gpu_fsdp2_traces_prefetched_gathers_are_no_stall(tmp_path: Path) -> None:
    """``kineto-gpu-fsdp2-healthy``: a healthy 2-rank FSDP2 job on 2x H200 under torch.profiler
    (``bench/ddp_sweep.py --device cuda --record profiler --wrap fsdp2 --seed 2733``, job 0, a
    26.5 ms step). Its all-gathers run a layer ahead on a stream of their own, and rank 1's waited
    3.6 ms a step in them while its own kernels ran beside: a rank's waits are at most the time
    its device ran none of its kernels. Without that bound rank 0 read 1.10x rank 1 and was named."""
    from megascope import analysis
    from megascope.analysis.base import prepare

    ingest_kineto(Path(__file__).parent / "data" / "kineto-gpu-fsdp2-healthy", tmp_path / "run")
    run = open_run(tmp_path / "run")
    assert analysis.report(run)["stragglers"] == []
    prepare(run.con)
    rows = run.con.execute(
        "SELECT wait_ns, step_ns - forward_ns - backward_ns - optimizer_ns - compute_ns AS idle_ns, own_ns, step_ns "
        "FROM ms_cache.rank_step WHERE step_ns IS NOT NULL").fetchall()
    assert rows and all(wait <= max(idle, 0) + 1 for wait, idle, _, _ in rows)
    own = dict(run.con.execute("SELECT rank, median(own_ns) FROM ms_cache.rank_step GROUP BY rank").fetchall())
    assert own[0] / own[1] == pytest.approx(1.0, abs=0.05)
    healthy = analysis.report(run)["run"]["step_time_ns"]
    # ``kineto-gpu-fsdp2-slow`` (job 2 of the same sweep): rank 1's GPU 1.25x slow, a 31.4 ms step.
    # The replay holds a rank at a gather only from where its kernels stopped before the gather
    # completed: taken as blocking where issued, the fast rank's compute beside its gathers was
    # lost, and the fix read 22.3 ms, under the healthy step.
    ingest_kineto(Path(__file__).parent / "data" / "kineto-gpu-fsdp2-slow", tmp_path / "slow")
    slow = analysis.report(open_run(tmp_path / "slow"))
    assert [(s["rank"], s["cause"]) for s in slow["stragglers"]] == [(1, "compute")]
    fixed = slow["whatif"]["whatif_step_time_ns"]
    assert healthy * 0.97 < fixed < healthy * 1.1, (fixed / 1e6, healthy / 1e6)


@pytest.mark.parametrize(("sample", "planted", "cause"), [("kineto-ddp-pause", 2, "host"), ("kineto-ddp-slow", 0, "compute")])
def test_real_ddp_traces_name_the_planted_rank_with_its_cause(tmp_path: Path, sample: str, planted: int,
                                                              cause: str) -> None:
    """Traces torch.profiler wrote of real DDP jobs on gloo (``bench/ddp_sweep.py``), each with one
    planted rank whose cause the spans' share alone read wrongly (docs/analysis.md, Causes), and the
    wait it caused in the job's process group:

    - ``kineto-ddp-pause`` (3 ranks, seed 5, job 21): rank 2 sleeps 20 ms a step between its forward
      and backward; it came back to ops 7 ms slower than its peers' (a small share of its excess,
      beyond doubt), and most of its excess lies outside every span;
    - ``kineto-ddp-slow`` (5 ranks, seed 7, job 15): rank 0 also runs a forward and backward on 15%
      of its batch; its excess own time (34 ms a step) is mostly its peers' compute overlapped by
      their gradient all-reduces, 4.7 ms is in its spans and almost none outside them.
    """
    from megascope import analysis
    from megascope.analysis.stragglers import PAUSE_SHARE

    ingest_kineto(Path(__file__).parent / "data" / sample, tmp_path / "run")
    report = analysis.report(open_run(tmp_path / "run"))
    first = report["stragglers"][0]
    assert (first["rank"], first["cause"]) == (planted, cause)
    assert [s["rank"] for s in report["stragglers"]] == [planted]
    pause = first["evidence"]["pause_share"]
    assert (pause >= PAUSE_SHARE) if cause == "host" else (pause < PAUSE_SHARE)
    # The job's one process group, which the traces name "world", is its data-parallel group: the
    # wait the rank made its peers sit through there counts (it read 0 when only groups named TP
    # or DP did).
    assert first["evidence"]["wait_caused_t"] > 10
