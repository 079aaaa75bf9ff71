"""Mesh axes as data: cp and ep beside pp, dp and tp, group kinds from the groups table, one way
to show coordinates, and runs of schema 1 (fixed pp/dp/tp columns) read as before."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hand_runs import hand_run
from megascope.collectors import Collector

from megascope import analysis, layout, schema
from megascope.analysis.report import report
from megascope.compact import compact
from megascope.figures.topology import topology_figure
from megascope.store import open_run
from megascope.topology import Group, Mesh, coords_of, format_coords

SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"


def test_coordinates_are_shown_one_way() -> None:
    assert format_coords({"tp": 3, "cp": 1, "pp": 1, "dp": 0}) == "pp1 dp0 cp1 tp3"
    # a run's own axis order wins; unknown values are left out; every reader's shape is taken
    assert format_coords({"tp": 1, "dp_shard": 2, "dp": None}, ("dp_shard", "tp")) == "dp_shard2 tp1"
    assert format_coords([("tp", 1), ("pp", 0)]) == "pp0 tp1"
    assert format_coords(None) == "" and coords_of(float("nan")) == {}
    assert list(coords_of({"tp": 0, "ep": 1, "pp": 2})) == ["pp", "ep", "tp"]
    assert Mesh.for_world(32, tp=2, pp=2, cp=2, ep=2).axes == ("pp", "dp", "ep", "cp", "tp")
    assert Mesh.for_world(8, tp=2, pp=2).axes == ("pp", "dp", "tp")  # cp, ep only where used


def test_a_synthetic_cp_ep_run_places_and_names_every_rank(tmp_path: Path, synth: Callable[..., Path],
                                                         cli: Callable[..., Any]) -> None:
    run_dir = synth(tmp_path / "run", "straggler:rank=13,factor=1.3", ranks=32, steps=10, tp=2, pp=2, cp=2, ep=2, seed=3)
    run = open_run(run_dir)
    mesh = Mesh.for_world(32, tp=2, pp=2, cp=2, ep=2)
    assert run.meta.schema_version == schema.SCHEMA_VERSION == 2
    assert run.meta.mesh_axes == ("pp", "dp", "ep", "cp", "tp") and run.mesh == mesh
    assert dict(run.con.execute("SELECT rank, coords FROM ranks").fetchall()) == {r: mesh.coords(r) for r in range(32)}
    # every group's kind is its axis, and it holds the ranks that differ only along it
    groups = run.con.execute('SELECT DISTINCT "group", kind, members FROM groups').fetchall()
    assert {kind for _, kind, _ in groups} == {"pp", "dp", "ep", "cp", "tp"}
    for gid, kind, members in groups:
        assert mesh.group_of(members[0], kind) == Group(gid, kind, tuple(members))
    assert set(analysis.skew(run)["group_kind"]) == {"dp", "ep", "cp", "tp"}
    assert set(analysis.skew(run, group_kind="cp")["name"]) == {"cp.all_gather"}

    # report and CLI name the straggler with every axis, in the run's order
    found = report(run)
    assert [s["rank"] for s in found["stragglers"]] == [13]
    coords = found["stragglers"][0]["coords"]
    assert coords == mesh.coords(13) and list(coords) == list(mesh.axes)
    place = format_coords(coords)
    assert place == "pp0 dp1 ep1 cp0 tp1"
    text = cli("report", str(run_dir))
    assert text.exit_code == 0 and place in text.output
    assert json.loads(cli("report", str(run_dir), "--json").output)["stragglers"][0]["coords"] == coords

    # the dashboard's topology: each rank once, ep, cp and tp across a stage, its place on hover
    states = analysis.rank_states(run)
    fig = topology_figure(states)
    custom = np.array(fig.data[0].customdata, dtype=object)
    hovers = {int(c[0]): c[2] for c in custom.reshape(-1, 4) if int(c[0]) >= 0}
    assert hovers == {r: format_coords(mesh.coords(r)) for r in range(32)}
    labels = {a.text for a in fig.layout.annotations}
    assert {"ep0 cp0 tp0", "ep1 cp1 tp1"} <= labels


class _FakeMesh:
    """What the collector reads of a DeviceMesh: its rank tensor, dimension names and groups."""

    def __init__(self, ranks: torch.Tensor, names: tuple[str, ...]) -> None:
        self.mesh = ranks
        self.mesh_dim_names = names

    def get_group(self, name: str) -> None:
        return None


def test_a_collector_run_on_an_ep_cp_tp_mesh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = tmp_path / "run"
    world = 8
    # laid out column-major: coordinates come from the mesh's tensor, not from rank arithmetic
    ranks = torch.arange(world).reshape(2, 2, 2).permute(2, 1, 0).contiguous()
    mesh = _FakeMesh(ranks, ("ep", "cp", "tp"))
    monkeypatch.setenv("MEGASCOPE_RUN_ID", "ep-cp-tp")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        col = Collector.from_env(run_dir, mesh=mesh, intercept=False, flush_interval_s=0.05,
                                 device=torch.device("cpu"), handle_sigterm=False, marker_agent=False)
        for step in range(3):
            with col.step(step), col.span("forward", kind=schema.SpanKind.FORWARD):
                pass
        col.close()
    run = open_run(run_dir)
    assert run.meta.mesh_axes == ("pp", "dp", "ep", "cp", "tp")
    expected = {}
    for r in range(world):
        e, c, t = (int(i) for i in (ranks == r).nonzero()[0])
        expected[r] = {"pp": 0, "dp": 0, "ep": e, "cp": c, "tp": t}
    got = dict(run.con.execute("SELECT rank, coords FROM ranks").fetchall())
    assert got == expected and all(list(v) == list(run.meta.mesh_axes) for v in got.values())
    kinds = dict(run.con.execute('SELECT DISTINCT "group", kind FROM groups').fetchall())
    assert set(kinds.values()) == {"ep", "cp", "tp"}
    # a group holds the ranks alike on every axis but its own
    for kind, members in run.con.execute("SELECT kind, members FROM groups WHERE rank = 5").fetchall():
        assert sorted(members) == [r for r in range(world)
                                   if all(expected[r][a] == expected[5][a] for a in expected[5] if a != kind)]
    states = analysis.rank_states(run)
    assert {int(r): format_coords(c) for r, c in zip(states["rank"], states["coords"], strict=True)} \
        == {r: format_coords(expected[r]) for r in range(world)}
    hover = np.array(topology_figure(states).data[0].customdata, dtype=object).reshape(-1, 4)
    assert {int(c[0]): c[2] for c in hover if int(c[0]) >= 0}[5] == format_coords(expected[5])


def test_a_group_s_kind_is_read_from_the_groups_table_only(tmp_path: Path) -> None:
    # Spans on a group named like a TP group that the groups table does not list: kind "other".
    t0 = 1_767_225_600_000_000_000
    spans = [{"rank": r, "step": 0, "name": "all_reduce", "kind": "collective", "stream": "comm",
              "start_ns": t0 + 10 * r, "dur_ns": 100 - 10 * r, "group": group, "seq": 1, "op": "all_reduce"}
             for r in range(3) for group in ("tp:0", "dp:0")]
    run = open_run(hand_run(tmp_path / "run", spans, []))
    kinds = dict(analysis.skew(run)[["group", "group_kind"]].itertuples(index=False))
    assert kinds == {"tp:0": "other", "dp:0": "dp"}


def _v1_copy(tmp_path: Path) -> Path:
    run_dir = tmp_path / "v1"
    shutil.copytree(SAMPLES / "straggler", run_dir, ignore=shutil.ignore_patterns("_cache"))
    return run_dir


def test_a_schema_1_run_reads_as_before(tmp_path: Path) -> None:
    run_dir = _v1_copy(tmp_path)
    assert layout.read_run_json(run_dir)["schema_version"] == 1
    part = pq.read_table(next((run_dir / "ranks").glob("rank=*")))
    assert {"pp", "dp", "tp"} <= set(part.column_names) and "coords" not in part.column_names
    legacy = {}
    for f in sorted((run_dir / "ranks").glob("rank=*")):
        row = pq.read_table(f).to_pylist()[0]
        legacy[row["rank"]] = {a: row[a] for a in ("pp", "dp", "tp") if row[a] is not None}
    run = open_run(run_dir)
    assert dict(run.con.execute("SELECT rank, coords FROM ranks").fetchall()) == legacy
    before = report(run)
    assert before["stragglers"] and before["stragglers"][0]["coords"] == legacy[before["stragglers"][0]["rank"]]
    # compacted, the old columns become coords too, and the answers stay the same
    compact(run_dir, everything=True)
    after_run = open_run(run_dir)
    assert dict(after_run.con.execute("SELECT rank, coords FROM ranks").fetchall()) == legacy
    after = report(after_run)
    assert [(s["rank"], s["coords"], s["cause"]) for s in after["stragglers"]] \
        == [(s["rank"], s["coords"], s["cause"]) for s in before["stragglers"]]


def test_a_schema_1_ranks_table_with_a_missing_axis(tmp_path: Path) -> None:
    # Schema 1 wrote null where an axis was unknown: that axis is left out of coords.
    run_dir = tmp_path / "run"
    layout.write_run_meta(run_dir, schema.RunMeta(schema_version=1, run_id="old", source="collector", world_size=2,
                                                  mesh_sizes={"pp": 1, "dp": 2, "tp": 1}))
    v1 = pa.schema([pa.field("rank", pa.int32(), nullable=False), pa.field("host", pa.string(), nullable=False),
                    *(pa.field(a, pa.int32()) for a in schema.RANKS_V1_COORD_COLUMNS)])
    (run_dir / "ranks").mkdir()
    for r in range(2):  # as schema 1's writers left them (today's layout.write_part writes schema 2 only)
        pq.write_table(pa.Table.from_pylist([{"rank": r, "host": "h0", "pp": 0, "dp": r, "tp": None}], schema=v1),
                       run_dir / "ranks" / f"rank={r:05d}.parquet")
    run = open_run(run_dir)
    assert run.con.execute("SELECT rank, coords FROM ranks ORDER BY rank").fetchall() == [
        (0, {"pp": 0, "dp": 0}), (1, {"pp": 0, "dp": 1})]
