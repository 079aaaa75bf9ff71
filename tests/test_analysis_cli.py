"""``megascope report``, ``localize`` and ``heatmap`` through click, on small synthetic runs."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import Result
from conftest import Synth

from megascope.store import open_run


@pytest.fixture(scope="module")
def hung_run(synth: Synth, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth(tmp_path_factory.mktemp("cli") / "hung", "straggler:rank=3,factor=1.3", "hang:rank=9,step=4",
                 ranks=16, steps=6, tp=2, pp=2, seed=5, gpus_per_host=4)


@pytest.fixture(scope="module")
def slow_run(synth: Synth, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth(tmp_path_factory.mktemp("cli") / "slow", "straggler:rank=3,factor=1.3",
                 ranks=16, steps=6, tp=2, pp=2, seed=5, gpus_per_host=4)


def test_report_json_contract(hung_run: Path, slow_run: Path, cli: Callable[..., Result]) -> None:
    result = cli("report", str(hung_run), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert {"run", "mfu", "stragglers", "skew", "hang"} <= set(report)
    assert {"path", "source", "world_size", "mesh", "steps"} <= set(report["run"])
    assert report["run"]["mesh"] == {"pp": 2, "dp": 4, "tp": 2}
    assert {"mean", "per_step"} <= set(report["mfu"])
    assert report["hang"]["hung"] is True and report["hang"]["suspects"][0]["rank"] == 9
    # In a hung run every rank is a hang suspect or its victim: no straggler is named.
    assert report["stragglers"] == [] and report["stragglers_withheld"] == "hung"
    slow = json.loads(cli("report", str(slow_run), "--json").stdout)
    top = slow["stragglers"][0]
    assert {"rank", "host", "coords", "phase", "slowdown", "steps_slow_frac", "cause", "confidence", "evidence"} <= set(top)
    assert top["rank"] == 3 and top["cause"] == "compute" and set(top["coords"]) == {"pp", "dp", "tp"}
    assert slow["stragglers_withheld"] is None


def test_report_hints_at_compaction_on_a_run_of_many_parts(slow_run: Path, tmp_path: Path,
                                                           cli: Callable[..., Result],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from megascope.cli import analyze
    from megascope.compact import compact

    run = tmp_path / "run"
    shutil.copytree(slow_run, run)
    monkeypatch.setattr(analyze, "COMPACT_HINT_PARTS", 20)
    result = cli("report", str(run), "--json", "--no-whatif")
    assert result.exit_code == 0, result.output
    json.loads(result.stdout)  # the hint leaves the JSON alone
    hint = [line for line in result.stderr.splitlines() if line.startswith("hint:")]
    assert len(hint) == 1 and f"megascope compact {run} --all" in hint[0], result.stderr
    compact(run, min_age_s=0, keep_newest=0, grace_s=0, everything=True)
    result = cli("report", str(run), "--no-whatif")
    assert result.exit_code == 0 and "hint:" not in result.stderr, result.stderr
    monkeypatch.setattr(analyze, "COMPACT_HINT_PARTS", 2_000)
    assert "hint:" not in cli("report", str(slow_run), "--no-whatif").stderr
    # A run that may still be written to: only the parts older than a minute, beside the job.
    opened = open_run(slow_run)
    monkeypatch.setattr(analyze, "COMPACT_HINT_PARTS", 20)
    live = analyze._compact_hint(opened, slow_run, "stalled")
    opened.con.close()
    assert live is not None and f"megascope compact {slow_run}`" in live and "--all" not in live


def test_localize_json_and_text(hung_run: Path, cli: Callable[..., Result]) -> None:
    result = cli("localize", str(hung_run), "--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    assert found["hung"] is True
    suspect = found["suspects"][0]
    assert {"rank", "host", "coords", "group", "last_completed_seq", "missing_seq"} <= set(suspect)
    assert suspect["rank"] == 9
    text = cli("localize", str(hung_run))
    assert text.exit_code == 0 and "rank 9" in text.output
    report = cli("report", str(hung_run), "--no-whatif")
    assert report.exit_code == 0 and "STRAGGLERS not told: the run hung" in report.output and "HANG" in report.output


def test_heatmap_html(hung_run: Path, tmp_path: Path, cli: Callable[..., Result]) -> None:
    out = tmp_path / "heat.html"
    result = cli("heatmap", str(hung_run), "-o", str(out), "--phase", "compute", "--max-ranks", "8")
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 1000 and "plotly" in out.read_text()[:200_000].lower()


@pytest.mark.browser
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Chromium")
def test_heatmap_png(hung_run: Path, tmp_path: Path, cli: Callable[..., Result]) -> None:
    out = tmp_path / "heat.png"
    result = cli("heatmap", str(hung_run), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args", [["report"], ["localize"], ["heatmap", "-o", "x.html"]])
def test_bad_run_dir_is_one_line(tmp_path: Path, args: list[str], cli: Callable[..., Result]) -> None:
    result = cli(args[0], str(tmp_path / "missing"), *args[1:])
    assert result.exit_code == 1
    assert result.output.strip().count("\n") == 0 and "no such run directory" in result.output
    assert "Traceback" not in result.output


def test_heatmap_rejects_other_suffixes(hung_run: Path, tmp_path: Path, cli: Callable[..., Result]) -> None:
    result = cli("heatmap", str(hung_run), "-o", str(tmp_path / "heat.svg"))
    assert result.exit_code == 1 and ".html or .png" in result.output


def test_report_text_names_a_slow_link_with_its_groups(tmp_path: Path, cli: Callable[..., Result]) -> None:
    """A real gloo run with rank 1's link rate-limited (tests/data/cpu-tp2-dp2-slow-link): the text
    report names rank 1 `communication` and says which of its groups transfer slowly."""
    run = shutil.copytree(Path(__file__).parent / "data" / "cpu-tp2-dp2-slow-link", tmp_path / "run")
    result = cli("report", str(run))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    first = lines[lines.index(next(line for line in lines if line.startswith("STRAGGLERS"))) + 2].split()
    assert first[0] == "1" and "communication" in first
    assert any(line.strip().startswith("rank 1: its groups and pipeline links tp:0") and "transfer slowly" in line
               and "dp:1" in line and "slow link" in line for line in lines)


def test_report_text_names_both_ends_of_a_slow_pipeline_link(tmp_path: Path, cli: Callable[..., Result]) -> None:
    """pp2 x dp2 with rank 2's link rate-limited (tests/data/cpu-pp2-dp2-slow-link): nothing tells the
    ends of the slow link 0<>2 apart, and the text report says so for each."""
    run = shutil.copytree(Path(__file__).parent / "data" / "cpu-pp2-dp2-slow-link", tmp_path / "run")
    result = cli("report", str(run))
    assert result.exit_code == 0, result.output
    said = [line.strip() for line in result.stdout.splitlines() if "its pipeline link transfers slowly both ways" in line]
    assert [line.split(":")[0] for line in said] == ["rank 0", "rank 2"]
    assert all("p2p:0<>2" in line and "other end" in line and "either end" not in line for line in said)
