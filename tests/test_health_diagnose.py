"""megascope diagnose: self-tests check their results, outliers are judged against peers, the slow rank is named."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import Result

from megascope.health import selftest
from megascope.health.datasheet import datasheet_for
from megascope.health.diagnose import DiagnoseConfig, build_report, run_diagnose
from megascope.health.outliers import mark_outliers, suspects
from megascope.store import open_run
from megascope.topology import Mesh

CPU = torch.device("cpu")


def _row(rank: int, test: str, value: float, group: str | None = None, ok: bool = True) -> dict[str, Any]:
    mesh = Mesh.for_world(4, tp=2)
    return {"time_ns": 1, "host": f"node{rank // 2}", "rank": rank, "test": test, "group": group, "value": value,
            "unit": "GB/s", "ok": ok, "outlier": False, "detail": None, "device_name": "GPU",
            "coords": mesh.coords(rank)}


def _allreduce_rows(speed: dict[str, float]) -> list[dict[str, Any]]:
    mesh = Mesh.for_world(4, tp=2)  # tp groups (0,1) (2,3); dp groups (0,2) (1,3)
    return [_row(r, "allreduce", speed[g.id], g.id) for r in range(4) for g in mesh.rank_groups(r)
            if g.id != "world"]


def test_slow_rank_is_the_intersection_of_slow_groups() -> None:
    rows = _allreduce_rows({"tp:0": 100.0, "tp:1": 20.0, "dp:0": 30.0, "dp:1": 100.0})
    judged = mark_outliers(rows, tolerance=0.25)
    assert {r["rank"] for r in judged if r["outlier"]} == {2}
    top = suspects(judged)
    assert [s["rank"] for s in top] == [2]
    assert top[0]["host"] == "node1" and top[0]["coords"] == {"pp": 0, "dp": 1, "tp": 0}
    assert any("tp:1" in reason for reason in top[0]["reasons"])


def test_slow_link_blames_both_ends() -> None:
    judged = mark_outliers(_allreduce_rows({"tp:0": 100.0, "tp:1": 20.0, "dp:0": 100.0, "dp:1": 100.0}))
    assert sorted(s["rank"] for s in suspects(judged)) == [2, 3]


def test_per_rank_outliers_against_peers_of_the_same_card_and_failures_first() -> None:
    rows = [_row(r, "gemm", v) for r, v in enumerate([400.0, 410.0, 250.0, 405.0])]
    rows.append(_row(3, "membw", 10.0, ok=False))
    rows.append(dict(_row(1, "gemm", 10.0), device_name="other card"))  # no peers: never an outlier
    judged = mark_outliers(rows, tolerance=0.25)
    assert [(r["rank"], r["test"]) for r in judged if r["outlier"]] == [(2, "gemm")]
    assert "62% of the median of 4 peers" in next(r["detail"] for r in judged if r["outlier"])
    assert [s["rank"] for s in suspects(judged)] == [3, 2]  # a wrong result outranks a slow one
    assert mark_outliers([_row(0, "gemm", 1.0)]) == [dict(_row(0, "gemm", 1.0))]  # alone: nothing to judge
    with pytest.raises(ValueError, match="tolerance"):
        mark_outliers(rows, tolerance=1.5)


def test_gemm_checksum_catches_a_corrupted_result(monkeypatch: pytest.MonkeyPatch) -> None:
    sizes = selftest.Sizes.for_device(CPU, iters=2)
    good = selftest.gemm(CPU, sizes)
    assert good.ok and good.value is not None and good.value > 0 and good.unit == "TFLOP/s"
    real_matmul = torch.matmul

    def flaky(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        real_matmul(a, b, out=out)
        out[7, 3] += 1e3  # one bad element, as a faulty multiplier would produce
        return out

    monkeypatch.setattr(selftest.torch, "matmul", flaky)
    bad = selftest.gemm(CPU, sizes)
    assert not bad.ok and bad.detail is not None and "checksum" in bad.detail


def test_copy_is_checked_bit_for_bit() -> None:
    m = selftest.membw(CPU, selftest.Sizes.for_device(CPU, iters=2))
    assert m.ok and m.unit == "GB/s" and m.value is not None and m.value > 0


def test_alone_writes_a_run_with_diagnostics_ranks_and_heartbeats(tmp_path: Path) -> None:
    out = tmp_path / "diag"
    report = run_diagnose(DiagnoseConfig(out=out, iters=2))
    assert report is not None and report["world_size"] == 1 and report["suspects"] == []
    assert {t["test"] for t in report["tests"]} == {"gemm", "membw"}  # no peers, no all-reduce, no GPU copies
    run = open_run(out)
    assert run.problems == [] and run.meta.source == "diagnose"
    got = run.con.execute("SELECT test, ok, outlier, host FROM diagnostics ORDER BY test").fetchall()
    assert got == [("gemm", True, False, socket.gethostname()), ("membw", True, False, socket.gethostname())]
    assert run.con.execute("SELECT rank, coords['pp'], coords['dp'], coords['tp'], device FROM ranks").fetchall() == [(0, 0, 0, 0, "cpu")]
    assert run.con.execute("SELECT count(*) FROM heartbeats WHERE metric = 'heartbeat'").fetchone()[0] >= 1
    # Into an existing run: only a diagnostics part is added.
    before = run.meta
    run_diagnose(DiagnoseConfig(out=out, iters=2))
    run = open_run(out)
    assert run.meta == before
    assert run.con.execute("SELECT count(*) FROM diagnostics").fetchone()[0] == 4


@pytest.mark.dist
def test_four_gloo_ranks_name_the_slowed_rank(tmp_path: Path) -> None:
    out = tmp_path / "diag"
    proc = subprocess.run([sys.executable, "-m", "megascope", "diagnose", "--nproc", "4", "--tp", "2",
                           "--slow-rank", "2", "--json", "-o", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    top = report["suspects"][0]
    assert top["rank"] == 2
    assert top["host"] == socket.gethostname()
    assert top["coords"] == {"pp": 0, "dp": 1, "tp": 0}
    assert report["failures"] == []
    run = open_run(out)
    per_test = dict(run.con.execute(
        "SELECT test || coalesce(' ' || split_part(\"group\", ':', 1), ''), count(DISTINCT rank) "
        "FROM diagnostics GROUP BY ALL").fetchall())
    assert per_test == {"gemm": 4, "membw": 4, "allreduce tp": 4, "allreduce dp": 4, "allreduce world": 4}
    slow_tests = {t for (t,) in run.con.execute("SELECT test FROM diagnostics WHERE rank = 2 AND outlier").fetchall()}
    assert {"gemm", "allreduce"} <= slow_tests
    assert run.con.execute("SELECT count(*) FROM groups WHERE \"group\" LIKE 'tp:%'").fetchone()[0] == 4


@pytest.mark.parametrize(("args", "message"), [
    (["--nproc", "3", "--tp", "2"], "not divisible"),
    (["--nproc", "2", "--slow-rank", "5"], "outside a world of 2"),
])
def test_bad_arguments_are_one_line_errors(tmp_path: Path, args: list[str], message: str,
                                           cli: Callable[..., Result]) -> None:
    result = cli("diagnose", *args, "-o", str(tmp_path / "d"))
    assert result.exit_code == 1 and message in result.output
    assert not (tmp_path / "d").exists()


def test_out_that_is_a_file_is_refused(tmp_path: Path, cli: Callable[..., Result]) -> None:
    target = tmp_path / "f"
    target.write_text("keep me")
    result = cli("diagnose", "-o", str(target))
    assert result.exit_code != 0 and target.read_text() == "keep me"


def test_report_compares_with_the_datasheet() -> None:
    rows = [dict(_row(r, "gemm", v), unit="TFLOP/s") for r, v in enumerate([700.0, 720.0])]
    report = build_report(rows, Path("x"), Mesh.for_world(2), "NVIDIA H100 80GB HBM3", "nccl")
    (gemm,) = report["tests"]
    assert gemm["datasheet"] == 989.0 and gemm["median_pct_of_datasheet"] == pytest.approx(71.8, abs=0.1)
    assert datasheet_for("NVIDIA H200")["card"] == "H200 SXM"  # type: ignore[index]
    assert datasheet_for("cpu") is None


def test_health_command_prints_findings_as_json(tmp_path: Path, cli: Callable[..., Result]) -> None:
    out = tmp_path / "diag"
    run_diagnose(DiagnoseConfig(out=out, iters=2))
    result = cli("health", str(out), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == {"run": str(out), "findings": []}


@pytest.mark.gpu
def test_gpu_diagnose_reaches_a_sane_share_of_the_datasheet(tmp_path: Path) -> None:
    nproc = min(torch.cuda.device_count(), 2)
    report = run_diagnose(DiagnoseConfig(out=tmp_path / "gpu", nproc=nproc if nproc > 1 else None))
    assert report is not None and report["failures"] == []
    tests = {t["test"] for t in report["tests"]}
    assert {"gemm", "membw", "h2d"} <= tests and (nproc < 2 or {"d2d", "allreduce"} <= tests)
    gemm = next(t for t in report["tests"] if t["test"] == "gemm")
    if "datasheet" in gemm:
        assert 20 < gemm["median_pct_of_datasheet"] < 110


def test_health_command_on_a_run_without_heartbeats(tmp_path: Path, cli: Callable[..., Result]) -> None:
    from megascope import layout
    from megascope.schema import RunMeta, RunSource

    layout.write_run_meta(tmp_path, RunMeta(run_id="x", source=RunSource.SYNTH, world_size=2))
    result = cli("health", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "no health findings" in result.output
