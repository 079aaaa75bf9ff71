"""Heat-map phases that must agree with the stragglers analysis: own time, host pauses, binning at scale."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Synth

from megascope import analysis
from megascope.store import open_run


@pytest.fixture(scope="module")
def runs(synth: Synth, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("phases")
    config = {"ranks": 8, "steps": 8, "tp": 2, "pp": 2, "gpus_per_host": 4, "seed": 11}
    return {"skew": synth(root / "skew", "skew:rank=3,ms=120", **config),
            "straggler": synth(root / "straggler", "straggler:rank=77,factor=1.15",
                               **{**config, "ranks": 128, "tp": 4, "pp": 4, "steps": 6})}


def _worst_rank(cells: object) -> int:
    import pandas as pd

    assert isinstance(cells, pd.DataFrame)
    return int(cells.groupby("rank")["norm"].median().idxmax())


def test_a_host_pause_outside_spans_shows_in_the_host_phase(runs: dict[str, Path]) -> None:
    run = open_run(runs["skew"])
    slow = analysis.stragglers(run)
    assert slow.iloc[0]["rank"] == 3 and slow.iloc[0]["cause"] == "host"
    host = analysis.heatmap(run, phase="host")
    assert _worst_rank(host) == 3
    paused = host[host["rank"] == 3]["value_ns"].median()
    assert paused >= 100e6, "the 120 ms pause is host time of rank 3"
    assert host[host["rank"] != 3]["norm"].max() < host[host["rank"] == 3]["norm"].median()


def test_own_time_is_never_negative_and_points_at_the_straggler(runs: dict[str, Path]) -> None:
    for name, culprit in (("skew", 3), ("straggler", 77)):
        run = open_run(runs[name])
        own = analysis.heatmap(run, phase="own")
        assert own["value_ns"].min() >= 0
        assert _worst_rank(own) == culprit == int(analysis.stragglers(run).iloc[0]["rank"])


def test_binning_keeps_the_straggler_cell(runs: dict[str, Path]) -> None:
    run = open_run(runs["straggler"])
    cells = analysis.heatmap(run, phase="own", max_ranks=16)
    assert cells["rank_bin"].nunique() == 16
    worst = cells.loc[cells["norm"].idxmax()]
    assert int(worst["rank"]) == 77 and worst["rank_lo"] <= 77 <= worst["rank_hi"]
    assert worst["norm"] > 1.1
