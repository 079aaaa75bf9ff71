"""Pure figure functions shared by the dashboard and the CLI: shapes, colours, scale."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from megascope.figures.health import heartbeat_figure
from megascope.figures.overview import step_series_figure
from megascope.figures.timeline import timeline_figure
from megascope.figures.topology import MAX_ROWS, STATES, grid_positions, topology_figure
from megascope.topology import Mesh


def _states(mesh: Mesh, state_of: dict[int, str] | None = None) -> pd.DataFrame:
    rows = [{"rank": r, "host": f"node{r // 8:05d}", **mesh.coords(r), "state": (state_of or {}).get(r, "healthy")}
            for r in range(mesh.world_size)]
    return pd.DataFrame(rows)


def test_topology_colours_each_rank_by_its_state() -> None:
    mesh = Mesh.from_sizes(tp=2, pp=2, dp=2)
    states = _states(mesh, {6: "hung", 0: "waiting", 5: "slow"})
    fig = topology_figure(states, suspects=[{"rank": 6}])
    heat = fig.data[0]
    assert isinstance(heat, go.Heatmap)
    z = np.array(heat.z, dtype=float)
    custom = np.array(heat.customdata, dtype=object)
    cells = {int(custom[y, x][0]): STATES[int(z[y, x])] for y, x in zip(*np.where(~np.isnan(z)), strict=True)}
    assert cells == dict(zip(states["rank"], states["state"], strict=True))
    # the stage gap column stays empty, and every rank's hover names its coordinates
    assert np.isnan(z).sum() == z.shape[0]
    assert custom[int(np.where(z == STATES.index("hung"))[0][0]), int(np.where(z == STATES.index("hung"))[1][0])][2] \
        == "pp1 dp1 tp0"
    ringed = [t for t in fig.data if t.name == "suspect"]
    assert len(ringed) == 1 and list(ringed[0].text) == ["rank 6"]


def test_topology_of_12288_ranks_is_one_bounded_image() -> None:
    mesh = Mesh.for_world(12288, tp=8, pp=16)  # dp = 96
    states = _states(mesh, {12287: "hung"})
    frame, geometry = grid_positions(states)
    assert geometry["height"] <= MAX_ROWS
    assert not frame.duplicated(["x", "y"]).any()  # one cell per rank
    fig = topology_figure(states)
    heatmaps = [t for t in fig.data if isinstance(t, go.Heatmap)]
    assert len(heatmaps) == 1
    z = np.array(heatmaps[0].z, dtype=float)
    assert (~np.isnan(z)).sum() == 12288


def test_topology_folds_a_deep_data_parallel_axis() -> None:
    mesh = Mesh.for_world(1024, tp=1, pp=1)  # dp = 1024: folded into columns, not 1024 rows
    frame, geometry = grid_positions(_states(mesh))
    assert geometry["height"] <= MAX_ROWS and geometry["folds"] == 8
    assert not frame.duplicated(["x", "y"]).any()


def test_timeline_draws_waits_apart_from_transfers() -> None:
    spans = pd.DataFrame([
        {"rank": 0, "step": 1, "name": "forward", "kind": "forward", "stream": "compute", "start_ns": 1_000_000,
         "dur_ns": 4_000_000, "wait_ns": None, "microbatch": 0},
        {"rank": 0, "step": 1, "name": "tp.all_reduce", "kind": "collective", "stream": "comm",
         "start_ns": 5_000_000, "dur_ns": 3_000_000, "wait_ns": 2_000_000, "microbatch": 0},
        {"rank": 1, "step": 1, "name": "tp.all_reduce", "kind": "collective", "stream": "comm",
         "start_ns": 7_000_000, "dur_ns": 1_000_000, "wait_ns": 0, "microbatch": 0},
    ])
    fig = timeline_figure(spans, labels={0: "r0 tp0", 1: "r1 tp1"})
    by_name = {t.name: t for t in fig.data}
    busy, wait = by_name["collective"], by_name["collective wait"]
    # rank 0 waited 2 ms from its arrival (4 ms after the first span), then transferred 1 ms
    assert list(wait.base) == [4.0] and list(wait.x) == [2.0]
    assert sorted(zip(busy.base, busy.x, strict=True)) == [(6.0, 1.0), (6.0, 1.0)]
    assert set(fig.layout.yaxis.categoryarray) == {"r0 tp0 · compute", "r0 tp0 · comm", "r1 tp1 · comm"}


def test_empty_frames_give_a_figure_that_says_so() -> None:
    empty_spans = pd.DataFrame(columns=["rank", "step", "name", "kind", "stream", "start_ns", "dur_ns", "wait_ns"])
    assert "no spans" in timeline_figure(empty_spans).layout.annotations[0].text
    empty_steps = pd.DataFrame(columns=["step", "step_time_ns", "mfu", "tokens_per_s"])
    assert "no completed steps" in step_series_figure(empty_steps).layout.annotations[0].text
    assert "no ranks" in topology_figure(pd.DataFrame(columns=["rank", "host", "pp", "dp", "tp", "state"])
                                         ).layout.annotations[0].text
    assert "no heartbeat" in heartbeat_figure(pd.DataFrame(columns=["host", "time_ns", "value"]),
                                              metric="gpu_util_pct").layout.annotations[0].text


def test_overview_has_a_panel_per_series_with_data() -> None:
    per_step = pd.DataFrame({"step": [0, 1, 2], "step_time_ns": [2e8, 2.1e8, 2.2e8], "mfu": [0.4, 0.38, np.nan],
                             "tokens_per_s": [np.nan] * 3})
    loss = pd.DataFrame({"step": [0, 1, 2], "value": [10.0, 9.5, 9.1]})
    fig = step_series_figure(per_step, loss=loss)
    names = [t.name for t in fig.data]
    assert names == ["MFU (%)", "step time (ms)", "loss"]  # tokens/s is all-null: no panel
    assert list(fig.data[0].y[:2]) == [40.0, 38.0]
    assert list(fig.data[1].y) == [200.0, 210.0, 220.0]


def test_step_time_panel_fits_the_steady_state_and_names_the_steps_off_its_scale() -> None:
    # A real job's first step (1,942 ms) beside its steady 26-31 ms steps, one of them 35 ms.
    ms = [1942.0, 41.8] + [26.0 + (i % 5) for i in range(20)]
    ms[10] = 35.0
    per_step = pd.DataFrame({"step": range(22), "step_time_ns": [m * 1e6 for m in ms]})
    fig = step_series_figure(per_step)
    low, high = fig.layout.yaxis.range
    assert low > 20 and 41.8 < high < 50  # the steady steps fill the panel; 35 and 41.8 ms stay on it
    off = [t for t in fig.data if t.name == "off scale"]
    assert len(off) == 1 and list(off[0].x) == [0] and list(off[0].customdata) == [1942.0]
    assert fig.layout.annotations[0].text == "step time (ms) · off scale: step 0: 1,942"
    assert list(fig.data[0].y) == ms  # the line itself keeps every value (hover, autoscale)
    # Two steady levels (a job that slowed half-way) are both on the scale: nothing is clipped.
    two = step_series_figure(pd.DataFrame({"step": range(20), "step_time_ns": [3e7] * 10 + [6e7] * 10}))
    assert two.layout.yaxis.range is None and [t.name for t in two.data] == ["step time (ms)"]
    # Many steps off the scale are counted, not listed.
    many = step_series_figure(pd.DataFrame({"step": range(30), "step_time_ns": [3e7] * 25 + [9e8, 5e9, 9e8, 9e8, 9e8]}))
    assert many.layout.annotations[0].text == "step time (ms) · off scale: 5 steps, up to 5,000"


def _cells(norms: dict[tuple[int, int], float], ranks: int, steps: int) -> pd.DataFrame:
    """Heat-map cells (the columns of analysis.heatmap) of ``ranks`` x ``steps``, 1.0 unless given."""
    rows = [{"rank_bin": r, "step_bin": s, "rank": r, "step": s, "rank_lo": r, "rank_hi": r, "step_lo": s,
             "step_hi": s, "value_ns": 1e6 * norms.get((r, s), 1.0), "norm": norms.get((r, s), 1.0),
             "host": f"node{r // 8}", "pp": 0, "dp": r // 2, "tp": r % 2}
            for r in range(ranks) for s in range(steps)]
    return pd.DataFrame(rows)


def _colour_of(fig: go.Figure, ratio: float) -> tuple[int, int, int]:
    """The RGB the heat-map's colour scale gives ``ratio`` (its z is log2 of the ratio)."""
    heat = fig.data[0]
    z = (np.log2(ratio) - heat.zmin) / (heat.zmax - heat.zmin)
    stops = [(float(p), c) for p, c in heat.colorscale]
    for (p0, c0), (p1, c1) in zip(stops, stops[1:], strict=False):
        if p0 <= z <= p1:
            a = np.array([int(c0[i:i + 2], 16) for i in (1, 3, 5)])
            b = np.array([int(c1[i:i + 2], 16) for i in (1, 3, 5)])
            t = 0.0 if p1 == p0 else (z - p0) / (p1 - p0)
            return tuple(int(v) for v in np.round(a + (b - a) * t))  # type: ignore[return-value]
    raise AssertionError(f"{ratio} outside the colour scale")


def test_heatmap_colours_tell_a_mild_straggler_from_a_gross_one() -> None:
    from megascope.figures.heatmap import heatmap_figure

    fig = heatmap_figure(_cells({(3, 1): 1.15, (5, 2): 3.0, (6, 0): 38.0}, ranks=8, steps=4), phase="own")
    white, mild, gross, extreme = (_colour_of(fig, v) for v in (1.0, 1.15, 3.0, 38.0))
    assert white[0] > 240 and white[1] > 240 and white[2] > 240
    # 1.15x is clearly coloured (not white), and far from both 3x and 38x.
    assert sum(abs(a - b) for a, b in zip(mild, white, strict=True)) > 150
    assert sum(abs(a - b) for a, b in zip(mild, gross, strict=True)) > 150
    assert sum(abs(a - b) for a, b in zip(gross, extreme, strict=True)) > 60
    # The figure is tall enough for every rank row to get pixels.
    assert fig.layout.height >= 360
    # Eight ranks and four steps: a tick at each rank and step, none between them (0.5).
    assert fig.layout.yaxis.dtick == 1 and fig.layout.xaxis.dtick == 1


def test_heatmap_marks_flagged_ranks_beside_the_axis_and_lists_the_worst() -> None:
    from megascope.figures.heatmap import heatmap_figure, worst_ranks

    # 1,024 ranks binned by 4 as the dashboard bins them: rank 77 lives in the bin starting at 76.
    cells = _cells({}, ranks=256, steps=3)
    cells["rank_lo"] = cells["rank_bin"] * 4
    cells["rank_hi"] = cells["rank_lo"] + 3
    cells.loc[cells["rank_bin"] == 19, ["rank", "norm"]] = [77, 1.15]
    fig = heatmap_figure(cells, phase="own", flagged=[77])
    marks = [t for t in fig.data if isinstance(t, go.Scatter) and t.name == "stragglers"]
    assert len(marks) == 1 and list(marks[0].y) == [76] and list(marks[0].text) == ["r77"]
    assert fig.layout.height >= 2 * 256
    assert fig.layout.yaxis.dtick is None and fig.layout.xaxis.dtick == 1  # 1,024 ranks: the axis places its ticks
    # The marks sit left of the rank axis; its title moves out past them (it overlapped "r3").
    plain = heatmap_figure(cells, phase="own")
    assert fig.layout.yaxis.title.standoff > (plain.layout.yaxis.title.standoff or 0)
    assert fig.layout.margin.l > plain.layout.margin.l
    worst = worst_ranks(cells)
    assert worst["rank"].tolist() == [77] and worst["worst"].iloc[0] == 1.15 and worst["slow_steps"].iloc[0] == 3


def test_topology_click_position_maps_to_its_rank() -> None:
    from megascope.figures.topology import rank_at

    mesh = Mesh.from_sizes(tp=2, pp=2, dp=2)
    states = _states(mesh)
    frame, _geo = grid_positions(states)
    for row in frame.itertuples():
        assert rank_at(states, float(row.x), float(row.y)) == row.rank
    assert rank_at(states, 2.0, 0.0) is None  # the blank column between two stages
    fig = topology_figure(states)
    assert [a.text for a in fig.layout.annotations] == ["tp0", "tp1", "tp0", "tp1"]
    assert list(fig.layout.yaxis.ticktext) == ["0", "1"] and fig.layout.yaxis.title.text == "dp"


def test_timeline_shows_host_pauses_the_focus_rank_and_where_a_hung_rank_stopped() -> None:
    from megascope.figures.timeline import host_pauses

    ms = 1_000_000

    def span(rank: int, start: int, dur: int, kind: str = "forward") -> dict[str, object]:
        return {"rank": rank, "step": 3, "name": kind, "kind": kind, "stream": "compute", "start_ns": start * ms,
                "dur_ns": dur * ms, "wait_ns": None, "microbatch": 0}

    # Rank 1 pauses 150 ms between its forward and backward; rank 2 stops after 10 ms.
    spans = pd.DataFrame([span(1, 0, 20), span(1, 170, 30, "backward"), span(2, 0, 10), span(3, 0, 100),
                          span(3, 100, 100, "backward")])
    bounds = pd.DataFrame({"rank": [1, 3], "step": [3, 3], "start_ns": [0, 0], "dur_ns": [200 * ms, 200 * ms]})
    pauses = host_pauses(spans, bounds)
    assert pauses[["rank", "start_ns", "dur_ns"]].values.tolist() == [[1, 20 * ms, 150 * ms]]
    fig = timeline_figure(spans, step_bounds=bounds, focus=1, stopped={2: "never entered tp:0 seq 7"})
    pause = [t for t in fig.data if t.name == "pause"]
    assert len(pause) == 1 and list(pause[0].x) == [150.0] and list(pause[0].y) == ["r1 · host"]
    stopped = [t for t in fig.data if t.name == "stopped"]
    assert len(stopped) == 1 and list(stopped[0].x) == [10.0] and "never entered tp:0 seq 7" in stopped[0].hovertemplate
    label = [a for a in fig.layout.annotations if a.text == "rank 2 stopped here: never entered tp:0 seq 7"]
    assert len(label) == 1 and label[0].x == 10.0 and label[0].xanchor == "right"
    idle = timeline_figure(spans, step_bounds=bounds, stopped={2: "stopped outside its calls in step 3"})
    assert [a.text for a in idle.layout.annotations if a.text.startswith("rank 2")] == [
        "rank 2 stopped outside its calls in step 3"]
    assert sorted(t for t in fig.layout.yaxis.ticktext if t.startswith("<b>")) == ["<b>r1 · compute</b>", "<b>r1 · host</b>"]
    assert len(fig.layout.shapes) >= 1 and fig.layout.shapes[0].fillcolor == "#fff3b0"
