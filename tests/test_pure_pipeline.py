"""A pure pipeline (every stage one rank): stragglers cannot be told, and every view says so while
still showing where the time goes.

tests/data/cpu-pp8-slow: the bundled trainer on CPU (gloo, pp8, 8 layers, 16 steps), rank 3 planted
1.18x slow in its compute. No rank has a stage peer, so no straggler is named; before, the heat-map
compared each rank with itself (1.0 everywhere, "none at 1.05x or more") and the topology read
"8 healthy". Now the heat-map compares each rank with all ranks of the step and says so, the
report lists the stages by their own time (rank 3 first, 1.41x), and the topology's summary says
slow ranks cannot be told.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from megascope import analysis
from megascope.store import open_run

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def pp8(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(shutil.copytree(DATA / "cpu-pp8-slow", tmp_path_factory.mktemp("pp8") / "run"))


def test_the_report_names_no_straggler_and_lists_the_stages_by_their_own_time(pp8: Path, cli: Any) -> None:
    result = analysis.report(open_run(pp8), with_whatif=False)
    assert result["stragglers"] == [] and result["stragglers_withheld"] == "no_peers"
    own = result["stages_own"]
    assert [o["rank"] for o in own][:1] == [3] and len(own) == 8
    assert own[0]["x"] > 1.3 and max(o["x"] for o in own[1:]) < 1.15, [(o["rank"], round(o["x"], 3)) for o in own]
    assert own[0]["coords"]["pp"] == 3 and own[0]["own_ns"] > 1.3 * sorted(o["own_ns"] for o in own)[4]
    text = cli("report", str(pp8))
    assert text.exit_code == 0, text.output
    line = next(ln for ln in text.output.splitlines() if "x all stages' median" in ln)
    assert line.rsplit("): ", 1)[1].startswith("rank 3 "), line


def test_a_run_with_stage_peers_lists_no_stages(tmp_path: Path) -> None:
    run = open_run(shutil.copytree(DATA / "cpu-pp4-dp2-slow", tmp_path / "run"))
    result = analysis.report(run, with_whatif=False)
    assert result["stragglers_withheld"] is None and result["stages_own"] is None
    cells = analysis.heatmap(run, phase="own")
    assert set(cells["peers"]) == {"stage"}


def test_the_heat_map_compares_each_rank_with_all_ranks_and_says_so(pp8: Path) -> None:
    from megascope.figures.heatmap import heatmap_figure

    cells = analysis.heatmap(open_run(pp8), phase="own")
    assert set(cells["peers"]) == {"all"} and len(cells) == 8 * 16
    by_rank = cells.groupby("rank")["norm"].median()
    assert by_rank.idxmax() == 3 and by_rank[3] > 1.25, by_rank.round(3).to_dict()
    figure = heatmap_figure(cells, phase="own")
    assert "median of all ranks" in figure.layout.title.text and "stages do different work" in figure.layout.title.text
    assert "all ranks" in figure.data[0].colorbar.title.text and "all ranks" in figure.data[0].hovertemplate


def test_the_live_heat_map_and_watch_compare_with_all_ranks(pp8: Path, cli: Any) -> None:
    from megascope.live import StepSumsTail, heat_cells, lone_stages

    tail = StepSumsTail(pp8)
    tail.update()
    places = open_run(pp8, tables=("ranks",)).con.execute("SELECT rank, host, coords FROM ranks ORDER BY rank").df()
    assert lone_stages(places)
    cells = heat_cells(tail.rank_step(), places, phase="compute")
    tail.close()
    assert set(cells["peers"]) == {"all"} and cells["rank"].nunique() == 8
    # Against the other ranks of its step, not itself: a rank's value over its own is 1.0 throughout.
    assert cells["norm"].round(6).ne(1.0).any()
    text = cli("watch", "--once", str(pp8))
    assert text.exit_code == 0 and "slowest compute (x all ranks)" in text.output, text.output


def test_the_topology_summary_says_slow_ranks_cannot_be_told(pp8: Path) -> None:
    from megascope.dashboard import data as dash_data
    from megascope.dashboard.pages import topology
    from megascope.dashboard.runs import RunRegistry

    registry = RunRegistry([pp8])
    served = registry.get(registry.ids[0])
    assert served is not None and served.run is not None
    lines = topology.banner(served, dash_data.rank_states(served), dash_data.hang(served))
    summary = lines[-1].children
    assert summary.startswith("8 healthy") and "slow ranks cannot be told" in summary, summary


def test_a_run_of_one_rank_says_so_everywhere(tmp_path: Path, synth: Any, cli: Any) -> None:
    """One rank: the header counts "1 rank", and each view says why nothing is compared in the
    words of one rank, not of pipeline stages."""
    from megascope.dashboard import data as dash_data
    from megascope.dashboard.pages import heatmap, topology
    from megascope.dashboard.runs import RunRegistry

    one = synth(tmp_path / "one", ranks=1, tp=1, pp=1, steps=6, seed=5)
    text = cli("report", str(one))
    assert text.exit_code == 0, text.output
    assert "(synth, 1 rank, " in text.output.splitlines()[0]
    assert "STRAGGLERS not told: a run of one rank has no peer to compare it with" in text.output
    registry = RunRegistry([one])
    served = registry.get(registry.ids[0])
    assert served is not None and served.run is not None
    assert dash_data.no_peers(served) == dash_data.ONE_RANK
    summary = topology.banner(served, dash_data.rank_states(served), dash_data.hang(served))[-1].children
    assert summary == "1 healthy · slow ranks cannot be told: one rank", summary
    note = heatmap.alone_note(analysis.heatmap(open_run(one), phase="own"))
    assert note is not None and note.children == heatmap.ONE_RANK
